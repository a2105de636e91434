#!/bin/bash
cd "$(dirname "$0")"
NV=/usr/local/cuda/bin/nvcc
# all-target compile of the variant table (background, parallel per arch)
for A in "arch=compute_80,code=sm_80" "arch=compute_86,code=sm_86" "arch=compute_89,code=sm_89" "arch=compute_90,code=sm_90" "arch=compute_80,code=compute_80"; do
  n=$(echo $A | sed 's/.*code=//'); $NV -O3 -std=c++17 -I../../kernels -gencode $A -Xptxas -v -c tu_all.cu -o tu_$n.o > $OUT/tu_$n.log 2>&1 &
done
./dev.sh
wait
for f in $OUT/tu_*.log; do echo "$f: warnings=$(grep -ci warning $f) errors=$(grep -ci error $f) spilling=$(grep -E 'spill (stores|loads)' $f | grep -vc ' 0 bytes spill stores, 0 bytes spill loads') entries=$(grep -c 'Compiling entry' $f) maxreg=$(grep -oE 'Used [0-9]+' $f | awk '{print $2}' | sort -n | tail -1)"; done
