# usage: summarize.py time.log torch.log  -> TFLOPS table per head dim (+ ratio vs torch FA2 at seq >= 2048)
import sys, collections, re
if sys.argv[1] == "--sustain":  # summarize.py --sustain sustain.log: both passes and their mean
    r = collections.OrderedDict()
    for l in open(sys.argv[2]):
        if l.startswith("SUST"):
            _, n, s, c, ps, us, tf = l.split()
            r.setdefault((re.sub(r"_m[01]_", "_", n), int(s), c), []).append(float(tf))
    print(f"{'config (sustained TFLOPS)':34s} {'seq':>6} c  pass0  pass1   mean")
    for (n, s, c), v in r.items():
        print(f"{n:34s} {s:6d} {c} " + " ".join(f"{x:6.1f}" for x in v) + f" {sum(v) / len(v):6.1f}")
    sys.exit(0)
seqs = [512, 1024, 2048, 4096, 8192, 16384]
t = collections.OrderedDict()
for l in open(sys.argv[1]):
    if not l.startswith("TIME") or "config" in l: continue
    _, n, s, c, us, tf = l.split()
    t.setdefault((re.sub(r"_m[01]_", "_", n), c), {})[int(s)] = float(tf)
tor = {}
for l in open(sys.argv[2]):
    m = re.match(r"TORCH d(\d+) seq\s*(\d+) causal(\d)\s+\S+ us\s+(\S+)", l)
    if m: tor.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = float(m.group(4))
print(f"{'config (TFLOPS)':34s} c " + " ".join(f"{s:>6d}" for s in seqs) + "   min ratio >=2k")
dims = sorted({re.search(r"_d(\d+)_", n).group(1) for (n, _) in t}, key=int)
for d in dims:
    for c in ("0", "1"):
        ref = tor.get((d, c), {})
        rows = [(f"TORCH_FA2_d{d}", ref)] + [(n, v) for (n, cc), v in t.items() if cc == c and f"_d{d}_" in n]
        for n, v in rows:
            ratios = [v[s] / ref[s] for s in seqs if s >= 2048 and s in v and s in ref]
            r = f"{min(ratios):.3f} [" + " ".join(f"{x:.3f}" for x in ratios) + "]" if ratios and not n.startswith("TORCH") else ""
            print(f"{n:34s} {c} " + " ".join(f"{v.get(s, float('nan')):6.1f}" for s in seqs) + "   " + r)
