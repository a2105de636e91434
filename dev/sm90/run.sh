#!/bin/bash
# usage: bash run.sh "<steps>"   steps: build sass one check rand bench benchall torch torchf16
cd "$(dirname "$0")"
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
S="$1"
export PATH=/usr/local/cuda/bin:$PATH
t0=$(date +%s)
if [[ $S == *build* ]]; then
  rm -f *.o h
  make -j16 h > $OUT/build.log 2>&1 || { tail -40 $OUT/build.log; exit 1; }
  grep -h -E "spill|C75" inst_*.o.log | sort | uniq -c | sort -rn | head -20
  echo "build $(( $(date +%s) - t0 ))s"
fi
if [[ $S == *sass* ]]; then
  for f in inst_fc_sm90_fwd_bf16_d128_nomask inst_fc_sm90_fwd_bf16_d64_nomask inst_fc_sm90_fwd_bf16_d256_nomask inst_fc_sm90_fwd_bf16_d128_causal; do
    cuobjdump -sass $f.o > $OUT/$f.sass; echo "$f HGMMA $(grep -c HGMMA $OUT/$f.sass) LDL/STL $(grep -cE 'LDL|STL' $OUT/$f.sass) USETMAXREG $(grep -c USETMAXREG $OUT/$f.sass)"
  done
fi
if [[ $S == *one* ]]; then timeout 60 ./h one 128 2 16 1024 1024 0 1; echo "rc=$?"; timeout 60 ./h one 128 2 16 1000 1100 1 1; echo "rc=$?"; fi
if [[ $S == *check* ]]; then timeout 90 ./h check > $OUT/check.log 2>&1; echo "check rc=$?"; grep -c "^ok" $OUT/check.log; grep FAIL $OUT/check.log | head -20; tail -1 $OUT/check.log; fi
if [[ $S == *rand* ]]; then timeout 90 ./h rand 500 7 > $OUT/rand.log 2>&1; echo "rand rc=$?"; grep FAIL $OUT/rand.log | head -10; tail -1 $OUT/rand.log; fi
if [[ $S == *benchall* ]]; then timeout 120 ./h bench all f16 2 > $OUT/bench.log 2>&1; echo "bench rc=$?"; cat $OUT/bench.log;
elif [[ $S == *bench* ]]; then timeout 120 ./h bench main f16 > $OUT/bench.log 2>&1; echo "bench rc=$?"; cat $OUT/bench.log; fi
if [[ $S == *torchf16* ]]; then timeout 150 python3 bench_torch.py bf16,f16 > $OUT/torch.log 2>&1; echo "torch rc=$?"; cat $OUT/torch.log | grep -v "^$";
elif [[ $S == *torch* ]]; then timeout 150 python3 bench_torch.py bf16 > $OUT/torch.log 2>&1; echo "torch rc=$?"; cat $OUT/torch.log; fi
echo "total $(( $(date +%s) - t0 ))s"
