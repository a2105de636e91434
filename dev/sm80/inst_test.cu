#include "common/params.h"
#include "sm80/fwd.cuh"
FC_SM80_FWD(k128_32, __nv_bfloat16, 128, 0, 128, 32, 4, 2)
FC_SM80_FWD(k128_48, __nv_bfloat16, 128, 0, 128, 48, 4, 2)
FC_SM80_FWD(k128_32c, __nv_bfloat16, 128, 1, 128, 32, 4, 2)
FC_SM80_FWD(k128_256_32, __nv_bfloat16, 128, 0, 256, 32, 8, 2)
FC_SM80_FWD(k64_128, __nv_bfloat16, 64, 0, 128, 128, 4, 2)
FC_SM80_FWD(k64_96, __nv_bfloat16, 64, 0, 128, 96, 4, 2)
