#!/usr/bin/env bash
# Install the pinned CUDA 13.0 toolkit from PyPI wheels into a prefix, for hosts without CUDA
# (CI, build-only machines). Nothing here needs a GPU. Usage:
#   scripts/install-cuda-toolkit.sh [PREFIX]        (default: $HOME/.cache/flashcore/cuda-13.0)
# then evaluate the printed exports, or: eval "$(scripts/install-cuda-toolkit.sh --env [PREFIX])"
#
# Why 13.0: the GPU machines run driver 580 (CUDA 13.0); PTX from a newer nvcc is rejected there.
# The link-time `libcuda.so` stub (soname libcuda.so.1) is generated from the driver symbols that
# cudarc declares, so candle/cudarc link without a driver; at run time the real driver is used.
set -euo pipefail
quiet_env=0
if [ "${1:-}" = "--env" ]; then quiet_env=1; shift; fi
prefix=${1:-${FLASHCORE_CUDA_PREFIX:-$HOME/.cache/flashcore/cuda-13.0}}
log() { if [ $quiet_env = 1 ]; then echo "$*" >&2; else echo "$*"; fi; }

pkgs=(
  nvidia-cuda-nvcc==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cuda-crt==13.0.88
  nvidia-nvvm==13.0.88 nvidia-cuda-cccl==13.0.85 nvidia-cublas==13.0.2.14
  nvidia-curand==10.4.0.35 nvidia-cuda-nvrtc==13.0.88
)
stamp="$prefix/.installed"
want=$(printf '%s\n' "${pkgs[@]}" | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  log "installing CUDA 13.0 toolkit wheels into $prefix"
  rm -rf "$prefix.tmp" && mkdir -p "$prefix.tmp"
  python3 -m pip install -q --disable-pip-version-check --no-deps --no-compile --target "$prefix.tmp/site" "${pkgs[@]}" >&2
  # The wheels unpack under site/nvidia/cu13/{bin,include,lib,nvvm}; expose them as a normal prefix.
  root="$prefix.tmp/site/nvidia/cu13"
  [ -x "$root/bin/nvcc" ] || { echo "install-cuda-toolkit: nvcc not found in the wheels (looked in $root/bin)" >&2; exit 1; }
  for d in bin include lib nvvm; do [ -e "$root/$d" ] && ln -s "site/nvidia/cu13/$d" "$prefix.tmp/$d"; done
  ln -s lib "$prefix.tmp/lib64"
  chmod +x "$root"/bin/* "$root"/nvvm/bin/* 2>/dev/null || true
  # Unversioned .so links (the linker looks for libfoo.so).
  (cd "$root/lib" && for f in lib*.so.*; do b=${f%%.so.*}; [ -e "$b.so" ] || ln -s "$f" "$b.so"; done)
  rm -rf "$prefix" && mv "$prefix.tmp" "$prefix"
  # Fix the symlinks that pointed into prefix.tmp (they are relative, so they survive the move).
  echo "$want" > "$stamp"
fi

# Link-time stub libcuda.so (soname libcuda.so.1) exporting every driver symbol that cudarc
# declares, so candle/cudarc link without a driver; the real driver is used at run time. The
# symbol list comes from cudarc's source in the cargo registry: fetch it first if it is missing
# (from the repo this script lives in), and regenerate whenever the set of cudarc versions changes.
registry="${CARGO_HOME:-$HOME/.cargo}/registry/src"
cudarc_dirs() { ls -d "$registry"/*/cudarc-*/src/driver/sys 2>/dev/null | sort; }
if [ -z "$(cudarc_dirs)" ]; then
  repo=$(cd "$(dirname "$0")/.." && pwd)
  if [ -f "$repo/Cargo.toml" ] && command -v cargo >/dev/null; then
    log "fetching crates (for cudarc's driver symbol list)"
    (cd "$repo" && cargo fetch >&2) || true
  fi
fi
dirs=$(cudarc_dirs)
[ -n "$dirs" ] || { echo "install-cuda-toolkit: cudarc's source is not in $registry; run 'cargo fetch' in the repo first" >&2; exit 1; }
stub="$prefix/lib/stubs/libcuda.so"
stub_key=$( (echo "$dirs"; echo v2-returns-no-device) | sha256sum | cut -c1-16)
if [ ! -f "$stub" ] || [ "$(cat "$prefix/lib/stubs/.key" 2>/dev/null)" != "$stub_key" ]; then
  mkdir -p "$prefix/lib/stubs"
  src=$(mktemp --suffix=.c)
  # shellcheck disable=SC2086
  # Every stub returns CUDA_ERROR_NO_DEVICE (100), so a test binary run against the stub (CI:
  # LD_LIBRARY_PATH=$prefix/lib/stubs) sees "no CUDA device" and skips instead of crashing.
  grep -rhoE '\bcu[A-Z][A-Za-z0-9_]*\b' $dirs | sort -u | awk '{print "int " $1 "(void) { return 100; }"}' > "$src"
  cc -shared -fPIC -nostdlib -Wl,-soname,libcuda.so.1 -o "$stub" "$src"
  ln -sf libcuda.so "$prefix/lib/stubs/libcuda.so.1"
  log "libcuda stub: $(wc -l < "$src") driver symbols"
  rm -f "$src"
  echo "$stub_key" > "$prefix/lib/stubs/.key"
fi

exports="export CUDA_HOME=$prefix CUDA_PATH=$prefix CUDA_ROOT=$prefix PATH=$prefix/bin:\$PATH LIBRARY_PATH=$prefix/lib:$prefix/lib/stubs:\${LIBRARY_PATH:-} LD_LIBRARY_PATH=$prefix/lib:\${LD_LIBRARY_PATH:-} CUDA_COMPUTE_CAP=\${CUDA_COMPUTE_CAP:-80}"
if [ $quiet_env = 1 ]; then echo "$exports"; else
  "$prefix/bin/nvcc" --version | tail -2
  echo "# use it with:"; echo "$exports"
fi
