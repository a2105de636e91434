// Experiment configs: X(D, BM, BN, WARPS, STAGES, OPT), one per line (exp.sh builds one TU per line).
// OPT bits (kernels/sm80/fwd.cuh): 1 FWD_LAZY, 4 FWD_XADDR, 8 FWD_PAIR (session 2 also had 2 = a
// pipelined schedule, measured slower and removed).
//   o0 = plain schedule;  o1 = lazy O rescale;  o5 = lazy + XOR ldmatrix addressing (shipped for
//   d64/d128 since session 2; d256 ships o0 at 128x64);  o8 = key-split warp pairs (d256
//   128x128 on sm_90, session 4).
// Dynamic smem = fc_sm80::fwd_smem_bytes(): (BM + 2*STAGES*BN) * D * 2 bytes (+ P and row
// exchange for o8); sm_86/89 allow 99 KB per block, sm_80 163 KB, sm_90 227 KB.
// session 4 (call 5): warp pairs at d128 (256x64 w8, 128x128 w8, 128x64 w8, 128x64 w4) are
// spill-free but 0.65-0.89x the shipped 128x32 w4 s2 tile: left out.
#define CFG_D128(X) \
  X(128, 128, 32, 4, 2, 5)
// session 3 (docs/perf.md "Session 3", call 1): d256 tiles per smem budget: 128 KB (shipped for
// sm_80/sm_90), 192 KB (H100 only: no faster), 96 KB (shipped for sm_86/89: 0.93-0.96x FA2).
// 64x64 w4 s1 (96 KB) spills 40-52 B at 255 registers; Q kept in registers (tried as an OPT bit)
// spills in every d256 tile: both left out.
// session 4 (calls 1-4): key-split warp pairs. 128x64 (145 KB) ran no faster than the plain
// 128x64; 128x128 (226 KB, H100 only) +15 %, shipped with its Q.K^T loop rolled (spill-free).
#define CFG_D256(X) \
  X(256, 128, 64, 8, 1, 0) \
  X(256, 128, 128, 8, 1, 8)
