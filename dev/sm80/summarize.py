import sys, collections, re
t = collections.OrderedDict()
for l in open(sys.argv[1]):
    if not l.startswith("TIME") or "config" in l: continue
    _, n, s, c, us, tf = l.split()
    t.setdefault((re.sub(r"_m[01]", "", n), c), []).append(tf)
tor = collections.OrderedDict()
for l in open(sys.argv[2]):
    m = re.match(r"TORCH d(\d+) seq\s*(\d+) causal(\d)\s+\S+ us\s+(\S+)", l)
    if m: tor.setdefault((f"TORCH_FA2_d{m.group(1)}", m.group(3)), []).append(m.group(4))
print(f"{'config':30s} c  " + " ".join(f"{s:>6d}" for s in [512,1024,2048,4096,8192,16384]))
for d in ("64", "128", "256"):
    for (n, c), v in list(tor.items()) + list(t.items()):
        if n.endswith("_d" + d) or ("_d" + d + "_") in n:
            print(f"{n:30s} {c}  " + " ".join(f"{x:>6s}" for x in v))
