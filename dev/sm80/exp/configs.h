// Experiment configs: X(D, BM, BN, WARPS, STAGES, OPT), one per line (exp.sh builds one TU per line).
// OPT bits (kernels/sm80/fwd.cuh): 1 FWD_LAZY, 4 FWD_XADDR (session 2 also had 2 = a pipelined
// schedule, measured slower and removed).
//   o0 = plain schedule;  o1 = lazy O rescale;  o5 = lazy + XOR ldmatrix addressing (shipped for
//   d64/d128 since session 2; d256 ships o0).
// Dynamic smem = (BM + 2*STAGES*BN) * D * 2 bytes: sm_86/89 allow 99 KB per block, sm_80 163 KB,
// sm_90 227 KB (two 96 KB blocks fit one H100 SM).
#define CFG_D128(X) \
  X(128, 128, 32, 4, 2, 5)
// session 3 (docs/perf.md "Session 3", call 1): d256 tiles per smem budget: 128 KB (shipped for
// sm_80/sm_90), 192 KB (H100 only: no faster), 96 KB (shipped for sm_86/89: 0.93-0.96x FA2).
// 64x64 w4 s1 (96 KB) spills 40-52 B at 255 registers; Q kept in registers (tried as an OPT bit)
// spills in every d256 tile: both left out.
#define CFG_D256(X) \
  X(256, 128, 64, 8, 1, 0) \
  X(256, 128, 64, 8, 2, 0) \
  X(256, 64, 32, 4, 2, 0) \
  X(256, 128, 32, 8, 2, 0) \
  X(256, 128, 64, 8, 1, 4) \
  X(256, 128, 64, 8, 2, 4)
