#!/usr/bin/env bash
# Runs on the GPU machine from the repo root, over binaries packed by ../shared/device/pack.sh
# into .device/ (see README "Measuring on a GPU"). Steps: tests | bench | anchor | llama | all.
#   bash scripts/gpu-run.sh tests          GPU test binary: sweep + random problems (both paths)
#   bash scripts/gpu-run.sh bench          fa3 + llama grids, flashcore and eager, then torch SDPA
# Logs go to $OUT (or ./gpu-logs).
set -uo pipefail
out=${OUT:-gpu-logs}; mkdir -p "$out"
# This machine has a GPU: a test that finds none fails instead of skipping.
export FLASHCORE_REQUIRE_GPU=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$out/gpu.txt"
rc=0
for step in "${@:-all}"; do
  case $step in
    tests|all)
      FLASHCORE_RANDOM_CASES=${FLASHCORE_RANDOM_CASES:-500} bash .device/run.sh gpu --test-threads 1 --nocapture \
        > "$out/tests.log" 2>&1 || rc=1
      grep -E "^\[OK\]|passed|test result|panicked|FAILED|skipped|error" "$out/tests.log" | grep -v "^\[OK\]" | tail -30
      ;;
  esac
  case $step in
    bench|all)
      bash .device/run.sh bench --grid fa3,llama --backend all --verify ${BENCH_ARGS:-} 2>&1 | tee "$out/bench.log" || rc=1
      python3 .device/sdpa_anchor.py --grid fa3,llama 2>&1 | tee "$out/anchor.log" || rc=1
      ;;
  esac
done
exit $rc
