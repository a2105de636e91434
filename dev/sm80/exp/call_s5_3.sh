#!/bin/bash
# Session 5 calls 3-5: sm80 tiles (d128 128x64, 128x48; d64 128x96, 128x128; FWD_LEAN) vs the shipped ones: check, grid, sustained.
set -u
R=${OUT:-/tmp/out}; mkdir -p $R
EXP_DIMS=64,128 EXP_RAND=300 EXP_SUSTAIN=2 OUT=$R bash dev/sm80/exp/exp.sh 2>&1 | grep -v "^REG" | tail -60
[ -n "${S5_TORCH_DIMS:-}" ] && { timeout 120 python3 dev/sm80/fa2_sustain.py 2 "$S5_TORCH_DIMS" > $R/torch_sustain.log 2>&1; echo "torch rc=$?"; cat $R/torch_sustain.log; }
