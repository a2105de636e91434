#!/bin/bash
cd "$(dirname "$0")"
export NVCC=/usr/local/cuda/bin/nvcc
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv,noheader
./run.sh 2>&1 | tee $OUT/build.log | grep -vE "^REG" | tail -20
cp ptxas_d*.log $OUT/ 2>/dev/null
echo "kernels: $(grep -c REG $OUT/build.log), with spills: $(grep REG $OUT/build.log | grep -vc "spill 0/0")"; grep REG $OUT/build.log | grep -v "spill 0/0"
[ -x h ] || exit 1
./h check > $OUT/check.log 2>&1; echo "check rc=$?"; grep -E "FAIL|sweep|strided|random|TOTAL" $OUT/check.log | head -40
./h time > $OUT/time.log 2>&1; echo "time rc=$?"
python3 bench_torch.py > $OUT/torch.log 2>&1; echo "torch rc=$?"
python3 summarize.py $OUT/time.log $OUT/torch.log

