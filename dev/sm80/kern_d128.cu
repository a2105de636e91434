#include "common/params.h"
#include "sm80/fwd.cuh"
#include "reg.h"
#include "configs.h"
CFG_D128(FCI)
void reg_d128(std::vector<KEntry>& v) { CFG_D128(FCR) }
