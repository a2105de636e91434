// mimics the lead's generated unit: every variant row (incl. local) for all targets
#include "common/params.h"
#include "sm80/fwd.cuh"
#define V(DT, TY, D, M, MN, BM, BN, W, S) FC_SM80_FWD(fc_sm80_fwd_##DT##_d##D##_##MN, TY, D, M, BM, BN, W, S)
#define VD(DT, TY) \
  V(DT, TY, 64, 0, nomask, 128, 64, 4, 2) V(DT, TY, 64, 1, causal, 128, 64, 4, 2) V(DT, TY, 64, 2, local, 128, 64, 4, 2) \
  V(DT, TY, 128, 0, nomask, 128, 32, 4, 2) V(DT, TY, 128, 1, causal, 128, 32, 4, 2) V(DT, TY, 128, 2, local, 64, 64, 4, 2) \
  V(DT, TY, 256, 0, nomask, 128, 64, 8, 1) V(DT, TY, 256, 1, causal, 128, 64, 8, 1) V(DT, TY, 256, 2, local, 128, 64, 8, 1)
VD(bf16, __nv_bfloat16)
VD(f16, __half)
