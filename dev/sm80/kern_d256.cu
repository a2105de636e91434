#define FC_NO_SHARED_KERNELS  // fc_check_seqlens lives in harness.cu's translation unit
#include "common/params.h"
#include "sm80/fwd.cuh"
#include "reg.h"
#include "configs.h"
CFG_D256(FCI)
void reg_d256(std::vector<KEntry>& v) { CFG_D256(FCR) }
