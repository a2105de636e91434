#include "reg.h"
void reg_d64(std::vector<KEntry>&) {}
