// registry of the d64 configs (CFG_D64 in configs.h; kernels in kern_cfg_*.cu)
#include "reg.h"
#include "configs.h"
CFG_D64(FCDECL)
void reg_d64(std::vector<KEntry>& v) { CFG_D64(FCCALL) }
