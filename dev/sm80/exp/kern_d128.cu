// registry of all d128 configs; the kernels themselves are in kern_cfg_*.cu (one TU per config)
#include "reg.h"
#include "configs.h"
CFG_D128(FCDECL)
void reg_d128(std::vector<KEntry>& v) { CFG_D128(FCCALL) }
