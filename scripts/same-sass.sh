#!/usr/bin/env bash
# Same machine code, without a GPU: compiles one kernel family's generated unit (build.rs's
# OUT_DIR/fc_<family>.cu) against the kernels/ of two git revisions and compares, per kernel
# symbol, the cubin's .text section (the SASS bytes) and its register / shared-memory facts.
# Identical .text means identical speed, so a pure restructuring of kernels/ can be shown
# neutral here (docs/decisions.md#same-machine-code-shown-without-a-gpu).
#
#   scripts/same-sass.sh REV_A REV_B FAMILY [SYMBOL_REGEX]
#     REV_A / REV_B: git revisions, or "." for the working tree.
#     FAMILY: sm80 | sm90; the sm80 family compiles its sm_90 code (the H100's).
#     SYMBOL_REGEX: only the kernels whose symbol matches (default: all).
# Needs nvcc (scripts/install-cuda-toolkit.sh) and a CUDA build of the current tree (for the
# generated unit: `cargo build --release --features cuda`). Both revisions must accept the
# same generated unit (same kernel macros); a table change needs a fresh unit per revision.
set -euo pipefail
[ $# -ge 3 ] || { sed -n 2,14p "$0"; exit 2; }
A=$1; B=$2; FAM=$3; RE=${4:-.}
top=$(git rev-parse --show-toplevel); cd "$top"
unit=$(ls -t target/release/build/flashcore-*/out/fc_$FAM.cu 2>/dev/null | head -1)
[ -n "$unit" ] || { echo "no generated fc_$FAM.cu: run cargo build --release --features cuda" >&2; exit 1; }
case $FAM in sm80) arch=sm_90; comp=compute_90;; sm90) arch=sm_90a; comp=compute_90a;; *) echo "family: sm80|sm90" >&2; exit 2;; esac
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
# Keep the unit's preamble and only the chosen instantiations (a macro line and its asserts).
python3 - "$unit" "$RE" > "$tmp/unit.cu" <<'PY'
import re, sys
src, rx = open(sys.argv[1]).read().split('\n'), re.compile(sys.argv[2])
keep, out = True, []
for line in src:
    m = re.match(r'FC_\w+\((\w+),', line)
    if m:
        keep = bool(rx.search(m.group(1)))
    if keep or not (m or line.startswith('static_assert(fc_facts_')):
        out.append(line)
print('\n'.join(out))
PY
tree() { # tree REV DIR: the kernels/ of REV in DIR
  mkdir -p "$2"
  if [ "$1" = "." ]; then cp -r kernels "$2/"; else git archive "$1" kernels | tar x -C "$2"; fi
}
build() { # build NAME: cubin of the unit against tree NAME
  nvcc --cubin -O3 -std=c++17 -gencode "arch=$comp,code=$arch" -I "$tmp/$1/kernels" \
    -o "$tmp/$1.cubin" "$tmp/unit.cu" 2> "$tmp/$1.log" || { cat "$tmp/$1.log" >&2; exit 1; }
}
tree "$A" "$tmp/a"; tree "$B" "$tmp/b"
build a & pa=$!; build b & pb=$!; wait $pa; wait $pb
python3 - "$tmp/a.cubin" "$tmp/b.cubin" "$RE" <<'PY'
import struct, sys, re
def sections(path):
    d = open(path, 'rb').read()
    assert d[:4] == b'\x7fELF' and d[4] == 2, path
    shoff, = struct.unpack_from('<Q', d, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from('<HHH', d, 0x3A)
    hdr = [struct.unpack_from('<IIQQQQIIQQ', d, shoff + i * shentsize) for i in range(shnum)]
    stro = hdr[shstrndx][4]
    def name(o): return d[stro + o: d.index(b'\0', stro + o)].decode()
    # (name, type, flags, offset, size, link, info): info holds the register count on .text
    return {name(h[0]): (h[1], h[2], d[h[4]:h[4] + h[5]] if h[1] != 8 else h[5], h[7])
            for h in hdr}
a, b = sections(sys.argv[1]), sections(sys.argv[2])
rx = re.compile(sys.argv[3])
texts = sorted(n for n in a.keys() | b.keys() if n.startswith('.text.') and rx.search(n))
diff = 0
for n in texts:
    sa, sb = a.get(n), b.get(n)
    related = ['.nv.shared.' + n[6:], '.nv.info.' + n[6:]]
    same = sa == sb and all(a.get(r) == b.get(r) for r in related)
    if not same:
        diff += 1
        why = 'missing in one' if sa is None or sb is None else (
            f'SASS differs ({len(sa[2])} vs {len(sb[2])} bytes)'
            if sa[2] != sb[2] or sa[3] != sb[3] else 'shared memory or kernel info differ')
        print(f'DIFFERENT {n[6:]}: {why}')
total = sum(len(a[n][2]) for n in texts if n in a)
print(f'{len(texts) - diff} of {len(texts)} kernels identical ({total} bytes of SASS compared)')
sys.exit(1 if diff else 0)
PY
