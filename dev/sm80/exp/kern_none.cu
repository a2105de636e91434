#include "reg.h"
void reg_d64(std::vector<KEntry>&) {}
void reg_d256(std::vector<KEntry>&) {}
