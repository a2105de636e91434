#!/bin/bash
# usage: run.sh [check|rand|time|all]
set -e
cd "$(dirname "$0")"
NV=${NVCC:-nvcc}
ARCH="-gencode arch=compute_90,code=sm_90"
for D in 64 128 256; do
  $NV -O3 -std=c++17 $ARCH -I../../kernels -Xptxas -v -c kern_d$D.cu -o kern_d$D.o > ptxas_d$D.log 2>&1 &
done
$NV -O3 -std=c++17 $ARCH -I../../kernels -Xcompiler -fopenmp -c harness.cu -o harness.o
wait
cat ptxas_d*.log | grep -E "error|warning" || true
for D in 64 128 256; do python3 - ptxas_d$D.log <<'PY'
import sys,re
fn=None
for line in open(sys.argv[1]):
    m=re.search(r"Compiling entry function '(\w+)'",line)
    if m: fn=m.group(1)
    m=re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads",line)
    if m: sp=m.groups()
    m=re.search(r"Used (\d+) registers",line)
    if m and fn: print(f"REG {fn:45s} regs {m.group(1)} spill {sp[0]}/{sp[1]}")
PY
done
$NV -O3 $ARCH harness.o kern_d64.o kern_d128.o kern_d256.o -Xcompiler -fopenmp -o h -lcuda
