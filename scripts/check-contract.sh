#!/usr/bin/env bash
# Shows that the build-time contract between kernels/variants.rs / kernels/params.rs and the CUDA
# kernels can fail: builds a copy of the tree with one fact altered at a time (shared memory, the
# softcap body, the TMA page walk, a parameter-block field) and expects its CUDA build to fail with
# a message naming the variant or field. Needs nvcc (as the CUDA build does); each build stops in
# nvcc's front end at the failing static_asserts (seconds).
# The copy's build script is compiled with rustc and run by hand (as cargo runs it, with OUT_DIR
# and CARGO_FEATURE_CUDA), not through cargo: cargo would share the repo's target directory
# slots with the copy and leave its altered build behind for the next real build.
#   bash scripts/check-contract.sh
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

fail=0
# check NAME FILE SED-EXPR VARIANT EXPECTED-MESSAGE
check() {
    local name=$1 file=$2 expr=$3 variant=$4 expect=$5
    rm -rf "$tmp/tree" && mkdir -p "$tmp/tree"
    (cd "$repo" && git ls-files -z | xargs -0 cp --parents -t "$tmp/tree")
    cp "$tmp/tree/$file" "$tmp/orig"
    sed -i "$expr" "$tmp/tree/$file"
    if cmp -s "$tmp/orig" "$tmp/tree/$file"; then
        echo "contract check '$name': the edit '$expr' changed nothing in $file (stale script)"
        fail=1
        return
    fi
    rm -rf "$tmp/out" && mkdir -p "$tmp/out"
    if ! (cd "$tmp/tree" && rustc --edition 2021 --crate-type bin -o "$tmp/build-script" build.rs \
            >"$tmp/log" 2>&1); then
        echo "contract check '$name': the build script does not compile:"
        tail -20 "$tmp/log"
        fail=1
        return
    fi
    if (cd "$tmp/tree" && OUT_DIR="$tmp/out" CARGO_FEATURE_CUDA=1 FLASHCORE_VARIANTS=$variant \
            "$tmp/build-script" >"$tmp/log" 2>&1); then
        echo "contract check '$name': the kernels compiled with $file altered (they must not)"
        fail=1
    elif grep -q -- "$expect" "$tmp/log"; then
        echo "contract check '$name': the build failed as it must: $(grep -m1 -o -- "$expect[^\"]*" "$tmp/log")"
    else
        echo "contract check '$name': the build failed without naming '$expect':"
        tail -20 "$tmp/log"
        fail=1
    fi
}

check "shared memory" kernels/variants.rs 's/tiles + if sep_o/tiles + 16 + if sep_o/' \
    fc_sm90_fwd_bf16_d128_causal_128x128_q2 \
    "variant fc_sm90_fwd_bf16_d128_causal_128x128_q2: kernels/variants.rs says smem_bytes()"
check "softcap body" kernels/variants.rs \
    's/self.head_dim == 128 \&\& self.block_n == 48/self.head_dim == 128 \&\& self.block_n == 64/' \
    fc_sm80_fwd_bf16_d128_nomask_128x48 \
    "variant fc_sm80_fwd_bf16_d128_nomask_128x48: kernels/variants.rs says computes_modifiers()"
check "TMA page walk" kernels/variants.rs 's/let four = self.block_m == 256;/let four = self.block_m >= 128;/' \
    fc_sm90_fwd_f16_d256_causal_128x80 \
    "variant fc_sm90_fwd_f16_d256_causal_128x80: kernels/variants.rs says tma_pages()"
check "parameter block" kernels/params.rs 's/^    page_size: i32,/    page_size: i64,/' \
    fc_sm80_decode_bf16_d64_nomask \
    "FcParams.page_size: kernels/params.rs puts it at byte"
[ "$fail" = 0 ] && echo "contract checks: every altered fact failed the build, naming it"
exit "$fail"
