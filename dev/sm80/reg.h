#pragma once
#include <vector>
#include <string>
struct KEntry { std::string name; int dt; int d, mask, bm, bn, warps, stages; const void* fn; int opt = 0; };
void reg_d64(std::vector<KEntry>&);
void reg_d128(std::vector<KEntry>&);
void reg_d256(std::vector<KEntry>&);
#define FCI1(DT, TY, D, M, BM, BN, W, S) \
  FC_SM80_FWD(k_##DT##_d##D##_m##M##_##BM##x##BN##_w##W##_s##S, TY, D, M, BM, BN, W, S)
#define FCI(D, BM, BN, W, S) \
  FCI1(bf16, __nv_bfloat16, D, 0, BM, BN, W, S) FCI1(bf16, __nv_bfloat16, D, 1, BM, BN, W, S) \
  FCI1(bf16, __nv_bfloat16, D, 2, BM, BN, W, S) FCI1(f16, __half, D, 0, BM, BN, W, S) \
  FCI1(f16, __half, D, 1, BM, BN, W, S) FCI1(f16, __half, D, 2, BM, BN, W, S)
#define FCR1(DT, DTI, D, M, BM, BN, W, S) \
  v.push_back(KEntry{#DT "_d" #D "_m" #M "_" #BM "x" #BN "_w" #W "_s" #S, DTI, D, M, BM, BN, W, S, \
                     (const void*)k_##DT##_d##D##_m##M##_##BM##x##BN##_w##W##_s##S});
#define FCR(D, BM, BN, W, S) \
  FCR1(bf16, 0, D, 0, BM, BN, W, S) FCR1(bf16, 0, D, 1, BM, BN, W, S) FCR1(bf16, 0, D, 2, BM, BN, W, S) \
  FCR1(f16, 1, D, 0, BM, BN, W, S) FCR1(f16, 1, D, 1, BM, BN, W, S) FCR1(f16, 1, D, 2, BM, BN, W, S)
