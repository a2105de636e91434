#!/usr/bin/env bash
# Builds the demo binary (release, CUDA) into flashcore's target dir, so the candle CUDA crates
# already built there can be reused, prints how long the build took, and packs the binary for
# the GPU machine into target/demo-device/ (stripped + gzipped, ~22 MB; see DEVICE.md).
#   bash compat/demo/build.sh                                   # -> target/release/demo
#   CARGO_TARGET_DIR=/work/main/target/demo-build bash compat/demo/build.sh   # a separate dir
set -euo pipefail
cd "$(dirname "$0")"
root=$(cd ../.. && pwd)
# nvcc for candle-kernels and flashcore's kernels (sets CUDA_COMPUTE_CAP=80 unless already set,
# the value the other CUDA builds of this repository use).
eval "$(bash "$root/scripts/install-cuda-toolkit.sh" --env)"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$root/target}"
# A kernel-development filter would leave the GPU binary without most of flashcore's kernels.
if [ -n "${FLASHCORE_VARIANTS:-}" ]; then
    echo "build.sh: ignoring FLASHCORE_VARIANTS=$FLASHCORE_VARIANTS (the device binary needs every kernel)" >&2
    unset FLASHCORE_VARIANTS
fi
t0=$(date +%s)
cargo build --release --bin demo
t=$(( $(date +%s) - t0 ))
echo "demo build: ${t} s (target dir $CARGO_TARGET_DIR) -> $CARGO_TARGET_DIR/release/demo"

# Pack for the GPU machine (carry target/demo-device, run target/demo-device/run.sh).
pack="$root/target/demo-device"
rm -rf "$pack" && mkdir -p "$pack/bin"
cp "$CARGO_TARGET_DIR/release/demo" "$pack/bin/demo"
strip "$pack/bin/demo"
tar czf "$pack/bundle.tgz" -C "$pack" bin && rm -rf "$pack/bin"
cat > "$pack/run.sh" <<'RUN'
#!/usr/bin/env bash
# On the GPU machine: unpack, point the loader at the CUDA libraries there, run the demo.
set -uo pipefail
d=$(cd "$(dirname "$0")" && pwd)
[ -d "$d/bin" ] || tar xzf "$d/bundle.tgz" -C "$d"
for p in /usr/local/cuda/targets/x86_64-linux/lib /usr/local/cuda/lib64; do [ -d $p ] && export LD_LIBRARY_PATH=$p:${LD_LIBRARY_PATH:-}; done
exec "$d/bin/demo" "$@"
RUN
chmod +x "$pack/run.sh"
echo "packed: $pack ($(du -sh "$pack/bundle.tgz" | cut -f1) bundle.tgz + run.sh)"
