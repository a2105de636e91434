#!/bin/bash
# Device call of session 5 (calls 2-5): the configs of configs.h checked, timed on the fa3 grid and
# under sustained load (EXP_SUSTAIN=2), then torch FA2/cuDNN the same sustained way for the head
# dims in S5_TORCH_DIMS (e.g. S5_TORCH_DIMS=64 bash dev/sm80/exp/sustain.sh).
set -u
R=${OUT:-/tmp/out}; mkdir -p $R
EXP_DIMS=${EXP_DIMS:-64,128} EXP_RAND=300 EXP_SUSTAIN=2 OUT=$R bash dev/sm80/exp/exp.sh 2>&1 | grep -v "^REG" | tail -60
[ -n "${S5_TORCH_DIMS:-}" ] && { timeout 120 python3 dev/sm80/fa2_sustain.py 2 "$S5_TORCH_DIMS" > $R/torch_sustain.log 2>&1; echo "torch rc=$?"; cat $R/torch_sustain.log; }
