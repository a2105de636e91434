#!/usr/bin/env python3
# Writes inst_<name>.cu (one kernel each, compiled in parallel) and kernels.inc (the harness table).
import os
V = []  # (name, T, D, mask, BM, BN, stages, pingpong, main)
for t in ("bf16", "f16"):
    for d in (64, 128, 256):
        for m in (0, 1):
            bm, bn, pp = {64: (192, 128, 1), 128: (128, 128, 1), 256: (128, 80, 0)}[d]
            V.append((f"fc_sm90_fwd_{t}_d{d}_{['nomask','causal'][m]}", t, d, m, bm, bn, 2, pp, 1))
X = [("bf16", 128, 0, 128, 176, 2, 1), ("bf16", 128, 1, 128, 128, 2, 0),
     ("bf16", 256, 0, 128, 80, 2, 1), ("bf16", 256, 1, 128, 80, 2, 1)]
for (t, d, m, bm, bn, st, pp) in X:
    V.append((f"x_{t}_d{d}_{['nomask','causal'][m]}_{bm}x{bn}_pp{pp}", t, d, m, bm, bn, st, pp, 0))
TY = {"bf16": "__nv_bfloat16", "f16": "__half"}
for f in os.listdir("."):
    if f.startswith("inst_") and f.endswith(".cu"): os.remove(f)
inc = []
for i, (name, t, d, m, bm, bn, st, pp, main) in enumerate(V):
    warps = (bm // 64 + 1) * 4
    with open(f"inst_{name}.cu", "w") as f:
        if i > 0:  # fc_check_seqlens (common/seqlens.cuh) lives in the first instance only
            f.write("#define FC_NO_SHARED_KERNELS\n")
        f.write('#include "sm90/fwd.cuh"\n')
        f.write(f"FC_SM90_FWD_EX({name}, {TY[t]}, {d}, {m}, {bm}, {bn}, {warps}, {st}, {'true' if pp else 'false'}, false, {d}, false, false, 1)\n")
        f.write(f'extern "C" const void* get_{name}() {{ return (const void*){name}; }}\n')
    inc.append(f'KV("{name}", get_{name}, {1 if t=="bf16" else 0}, {d}, {m}, {bm}, {bn}, {st}, {pp}, {main})')
with open("kernels.inc", "w") as f:
    for (name, *_ ) in V: f.write(f'extern "C" const void* get_{name}();\n')
    f.write("#define KERNEL_TABLE \\\n" + " \\\n".join(inc) + "\n")
with open("Makefile", "w") as f:
    objs = " ".join(f"inst_{v[0]}.o" for v in V)
    f.write("NVCC ?= nvcc\nFLAGS = -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -I../../kernels\n")
    f.write(f"OBJS = {objs}\n")
    f.write("h: harness.o $(OBJS)\n\t$(NVCC) $(FLAGS) -o h harness.o $(OBJS) -lcuda -Xcompiler -fopenmp\n")
    f.write("harness.o: harness.cu kernels.inc\n\t$(NVCC) $(FLAGS) -Xcompiler -fopenmp -c harness.cu -o harness.o\n")
    f.write("inst_%.o: inst_%.cu ../../kernels/sm90/fwd.cuh ../../kernels/sm90/hopper.cuh\n\t$(NVCC) $(FLAGS) -Xptxas -v -c $< -o $@ 2> $@.log; cat $@.log\n")
print(len(V), "variants")
