// d128 experiment: X(D, BM, BN, WARPS, STAGES, OPT), one per line (exp.sh builds one TU per line).
// OPT bits (kernels/sm80/fwd.cuh): 1 FWD_LAZY, 4 FWD_XADDR (session 2 also had 2 = a pipelined
// schedule, measured slower and removed).
//   o0 = plain schedule;  o1 = lazy O rescale;  o5 = lazy + XOR ldmatrix addressing (shipped for
//   d64/d128 since session 2; d256 ships o0).
#define CFG_D128(X) \
  X(128, 128, 32, 4, 2, 0) \
  X(128, 128, 32, 4, 2, 1) \
  X(128, 128, 32, 4, 2, 5)
