#include "common/params.h"
#include "sm80/fwd.cuh"
#include "reg.h"
#include "configs.h"
CFG_D64(FCI)
void reg_d64(std::vector<KEntry>& v) { CFG_D64(FCR) }
