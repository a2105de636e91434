#!/bin/bash
# Session 5 call 2: sm80 d128 tiles under sustained (power-capped) load + torch FA2/cuDNN the same way.
set -u
R=${OUT:-/tmp/out}; mkdir -p $R
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active --format=csv,noheader,nounits -lms 200 > $R/smi.csv 2>/dev/null &
SMI=$!
EXP_RAND=200 EXP_SUSTAIN=2 OUT=$R bash dev/sm80/exp/exp.sh 2>&1 | grep -v "^REG" | tail -40
echo "torch start $(date +%s.%N)" > $R/phases
timeout 200 python3 dev/sm80/fa2_sustain.py 2 128 > $R/torch_sustain.log 2>&1; echo "torch rc=$?"
echo "torch end $(date +%s.%N)" >> $R/phases
cat $R/torch_sustain.log | tail -12
kill $SMI
