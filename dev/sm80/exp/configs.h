// Experiment configs: X(D, BM, BN, WARPS, STAGES, OPT), one per line (exp.sh builds one TU per line).
// OPT bits (kernels/sm80/fwd.cuh): 1 FWD_LAZY, 4 FWD_XADDR, 8 FWD_PAIR, 16 FWD_LEAN (session 2
// also had 2 = a pipelined schedule, measured slower and removed).
//   o0 = plain schedule;  o1 = lazy O rescale;  o5 = lazy + XOR ldmatrix addressing (shipped for
//   d64/d128 since session 2; d256 ships o0 at 128x64);  o8 = key-split warp pairs (d256
//   128x128 on sm_90, session 4);  o21 = o5 + FWD_LEAN (d128 128x48 on sm_80/86/89, session 5).
// Dynamic smem = fc_sm80::fwd_smem_bytes(): (BM + 2*STAGES*BN) * D * 2 bytes (+ P and row
// exchange for o8); sm_86/89 allow 99 KB per block, sm_80 163 KB, sm_90 227 KB.
// Session 5 also times configs under sustained load (`EXP_SUSTAIN=2`: 2 s of back-to-back calls
// before each timing, two passes): the H100 sits at its 700 W cap through any long run, the fa3
// grid included, so what counts between tiles is throughput at the capped clock.
//
// session 4 (call 5): warp pairs at d128 (256x64 w8, 128x128 w8, 128x64 w8, 128x64 w4) are
// spill-free but 0.65-0.89x the shipped 128x32 w4 s2 tile: left out.
// session 5 (calls 2-5, docs/perf.md "Session 5"), sustained TFLOPS at 2k nc / 16k nc / 16k causal:
//   d64: 128x64 o5 (shipped) 313/332/315; 128x96 o5 307/328/314 (spills 12 B); 128x96 o21
//     294/312/304; 128x128 o5 316/329/326 (spills 28 B); 128x128 o21 309/322/314. Keep 128x64.
//   d128: 128x32 o5 (shipped until session 5) 344/358/357; 128x64 o5 367/382/372 but spills
//     32 B (sm_90) / 44 B (sm_80), spill-free only with FWD_LEAN plus a Q.K^T loop unrolled by 2:
//     337/349/351; 128x48 o5 358/373/363 (spill-free on sm_90, 8 B on sm_80/86/89); 128x48 o21
//     353/366/356 (spill-free everywhere). Shipped: 128x48 non-causal, o5 on sm_90 and o21 on
//     the others (fwd_default_opt); causal keeps 128x32 (+1.6 % sustained, mixed in short runs).
//     192x32 w6 and 256x32 w8 (call 2): 234 and 301 at 16k nc, far behind.
#define CFG_D64(X) \
  X(64, 128, 64, 4, 2, 5)
#define CFG_D128(X) \
  X(128, 128, 32, 4, 2, 5) \
  X(128, 128, 48, 4, 2, 5) \
  X(128, 128, 48, 4, 2, 21)
// session 3 (docs/perf.md "Session 3", call 1): d256 tiles per smem budget: 128 KB (shipped for
// sm_80/sm_90), 192 KB (H100 only: no faster), 96 KB (shipped for sm_86/89: 0.93-0.96x FA2).
// 64x64 w4 s1 (96 KB) spills 40-52 B at 255 registers; Q kept in registers (tried as an OPT bit)
// spills in every d256 tile: both left out.
// session 4 (calls 1-4): key-split warp pairs. 128x64 (145 KB) ran no faster than the plain
// 128x64; 128x128 (226 KB, H100 only) +15 %, shipped with its Q.K^T loop rolled (spill-free).
#define CFG_D256(X) \
  X(256, 128, 64, 8, 1, 0) \
  X(256, 128, 128, 8, 1, 8)
