#!/bin/bash
# sm80-kernel tile/schedule experiment on the H100 (configs.h): build (one TU per config, parallel), ptxas regs/spills
# (sm_90 used + sm_80 check), full correctness check, timing (L2 flushed) of every config vs torch FA2.
# Run from the repo root:  bash dev/sm80/exp/exp.sh   (logs -> $OUT, else dev/sm80/exp/out)
# Local compile-only test (no GPU): EXP_COMPILE_ONLY=1 NVCC=nvcc bash dev/sm80/exp/exp.sh
set -u
T0=$(date +%s)
H="$(cd "$(dirname "$0")" && pwd)"
KDIR="$(cd "$H/../../../kernels" && pwd)"
OUT="${OUT:-$H/out}"; mkdir -p "$OUT"
NV="${NVCC:-/usr/local/cuda/bin/nvcc}"
CUDA_ROOT="$(dirname "$(dirname "$(command -v "$NV" || echo /usr/local/cuda/bin/nvcc)")")"
B="$H/build"; rm -rf "$B"; mkdir -p "$B"
cd "$H"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv,noheader
FL="-O3 -std=c++17 -I$KDIR -I$H"
ARCH="-gencode arch=compute_90,code=sm_90"

# 1. one translation unit per config line "  X(D, BM, BN, W, S, OPT)" of configs.h
i=0; objs=""
while read -r line; do
  args=$(echo "$line" | sed -E 's/^\s*X\(([^)]*)\).*/\1/' | tr -d ' ')
  IFS=, read -r D BM BN W S O <<< "$args"
  f="$B/kern_cfg_$i.cu"
  cat > "$f" <<TU
#include "common/params.h"
#include "sm80/fwd.cuh"
#include "reg.h"
FCI($D, $BM, $BN, $W, $S, $O)
void reg_${D}_${BM}x${BN}_w${W}_s${S}_o${O}(std::vector<KEntry>& v) { FCR($D, $BM, $BN, $W, $S, $O) }
TU
  ( $NV $FL $ARCH -Xptxas -v -c "$f" -o "$B/kern_cfg_$i.o" > "$B/ptxas90_$i.log" 2>&1 ) &
  ( $NV $FL -gencode arch=compute_80,code=sm_80 -Xptxas -v -cubin "$f" -o "$B/kern_cfg_$i.sm80.cubin" > "$B/ptxas80_$i.log" 2>&1 ) &
  objs="$objs $B/kern_cfg_$i.o"; i=$((i + 1))
done < <(grep -E '^\s+X\(' configs.h)
$NV $FL $ARCH -Xcompiler -fopenmp -c ../harness.cu -o "$B/harness.o" > "$B/harness.log" 2>&1 &
$NV $FL $ARCH -c kern_d128.cu -o "$B/kern_d128.o" > "$B/reg.log" 2>&1 &
$NV $FL $ARCH -c kern_none.cu -o "$B/kern_none.o" > "$B/none.log" 2>&1 &
wait
cat "$B"/*.log | grep -iE "error|warning" | grep -v "bytes stack" | head -20
cat "$B"/ptxas*.log > "$OUT/ptxas.log"
python3 - "$B" <<'PY' | tee "$OUT/regs.txt"
import sys, re, glob
for f in sorted(glob.glob(sys.argv[1] + "/ptxas*.log")):
    fn = None
    for line in open(f):
        m = re.search(r"Compiling entry function '(\w+)' for '(\w+)'", line)
        if m: fn = f"{m.group(1)} {m.group(2)}"
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m: sp = m.groups()
        m = re.search(r"Used (\d+) registers", line)
        if m and fn: print(f"REG {fn:48s} regs {m.group(1):>3s} spill {sp[0]}/{sp[1]}")
PY
echo "kernels: $(grep -c REG "$OUT/regs.txt"), with spills: $(grep REG "$OUT/regs.txt" | grep -vc 'spill 0/0')"
LINK="-L$CUDA_ROOT/lib64 -L$CUDA_ROOT/lib64/stubs -L$CUDA_ROOT/lib/stubs"
$NV $ARCH "$B/harness.o" "$B/kern_d128.o" "$B/kern_none.o" $objs -Xcompiler -fopenmp -o "$B/h" $LINK -lcuda || { echo "LINK FAILED"; exit 1; }
echo "build done in $(( $(date +%s) - T0 )) s"
[ "${EXP_COMPILE_ONLY:-0}" = 1 ] && exit 0

# 2. correctness: sweep (all configs x dtype x none/causal x 36 shapes), strided/packed/local, random
timeout 150 "$B/h" check "${EXP_RAND:-400}" > "$OUT/check.log" 2>&1; echo "check rc=$? (124 = timeout)"
grep -E "^FAIL" "$OUT/check.log" | head -20
grep -E "^sweep|^after strided|^random|^TOTAL" "$OUT/check.log"
echo "FAIL count per config (none listed = all pass):"; grep -E "^FAIL" "$OUT/check.log" | awk '{print $2}' | sed -E 's/_m[0-9]_/_/' | sort | uniq -c
echo "check done at $(( $(date +%s) - T0 )) s"

# 3. timing: every config, bf16, mask none/causal, fa3 grid (16k tokens; h16 for d128, h8 for d256)
timeout 90 "$B/h" time > "$OUT/time.log" 2>&1; echo "time rc=$?"
timeout 90 python3 ../bench_torch.py 512,1024,2048,4096,8192,16384 ${EXP_DIMS:-128,256} > "$OUT/torch.log" 2>&1; echo "torch rc=$?"
python3 summarize.py "$OUT/time.log" "$OUT/torch.log" | tee "$OUT/table.txt"
if [ -n "${EXP_SUSTAIN:-}" ]; then  # then sustained (power-capped) timing
  timeout 400 "$B/h" sustain "$EXP_SUSTAIN" > "$OUT/sustain.log" 2>&1; echo "sustain rc=$?"
  python3 summarize.py --sustain "$OUT/sustain.log" | tee "$OUT/sustain.txt"
fi
echo "total $(( $(date +%s) - T0 )) s"
