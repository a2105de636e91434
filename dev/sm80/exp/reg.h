#pragma once
#include <vector>
#include <string>
struct KEntry { std::string name; int dt; int d, mask, bm, bn, warps, stages; const void* fn; int opt = 0; };
void reg_d64(std::vector<KEntry>&);
void reg_d128(std::vector<KEntry>&);
void reg_d256(std::vector<KEntry>&);
// X(D, BM, BN, WARPS, STAGES, OPT): OPT = fc_sm80::FWD_* bit mask (0 = plain schedule)
#define FCI1(DT, TY, D, M, BM, BN, W, S, O) \
  FC_SM80_FWD_OPT(k_##DT##_d##D##_m##M##_##BM##x##BN##_w##W##_s##S##_o##O, TY, D, M, BM, BN, W, S, O)
#define FCI(D, BM, BN, W, S, O) \
  FCI1(bf16, __nv_bfloat16, D, 0, BM, BN, W, S, O) FCI1(bf16, __nv_bfloat16, D, 1, BM, BN, W, S, O) \
  FCI1(bf16, __nv_bfloat16, D, 2, BM, BN, W, S, O) FCI1(f16, __half, D, 0, BM, BN, W, S, O) \
  FCI1(f16, __half, D, 1, BM, BN, W, S, O) FCI1(f16, __half, D, 2, BM, BN, W, S, O)
#define FCR1(DT, DTI, D, M, BM, BN, W, S, O) \
  v.push_back(KEntry{#DT "_d" #D "_m" #M "_" #BM "x" #BN "_w" #W "_s" #S "_o" #O, DTI, D, M, BM, BN, W, S, \
                     (const void*)k_##DT##_d##D##_m##M##_##BM##x##BN##_w##W##_s##S##_o##O, O});
#define FCR(D, BM, BN, W, S, O) \
  FCR1(bf16, 0, D, 0, BM, BN, W, S, O) FCR1(bf16, 0, D, 1, BM, BN, W, S, O) FCR1(bf16, 0, D, 2, BM, BN, W, S, O) \
  FCR1(f16, 1, D, 0, BM, BN, W, S, O) FCR1(f16, 1, D, 1, BM, BN, W, S, O) FCR1(f16, 1, D, 2, BM, BN, W, S, O)
// extern declaration of one config's registration function
#define FCDECL(D, BM, BN, W, S, O) void reg_##D##_##BM##x##BN##_w##W##_s##S##_o##O(std::vector<KEntry>&);
#define FCCALL(D, BM, BN, W, S, O) reg_##D##_##BM##x##BN##_w##W##_s##S##_o##O(v);
