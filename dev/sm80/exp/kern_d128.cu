// registry of the d128 and d256 configs; the kernels themselves are in kern_cfg_*.cu (one TU per config)
#include "reg.h"
#include "configs.h"
CFG_D128(FCDECL)
CFG_D256(FCDECL)
void reg_d128(std::vector<KEntry>& v) { CFG_D128(FCCALL) }
void reg_d256(std::vector<KEntry>& v) { CFG_D256(FCCALL) }
