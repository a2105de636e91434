# Compress the SASS instruction stream into a readable event order: Hk=QK HGMMA, Hv=PV HGMMA (tnspB),
# W<n>=WARPGROUP.DEPBAR.LE gsb0 n, WA=WARPGROUP.ARRIVE, X<n>=n MUFU.EX2, R=SYNCS.ARRIVE, T=TRYWAIT, BS/BA=bar sync/arrive
import sys, re
ev = []
for line in open(sys.argv[1]):
    m = re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
    if not m: continue
    ins = m.group(2)
    if "HGMMA" in ins: t = "Hv" if "tnspB" in ins else "Hk"
    elif "WARPGROUP.DEPBAR" in ins: t = "W" + ins.split()[-1]
    elif "WARPGROUP.ARRIVE" in ins: t = "WA"
    elif "MUFU.EX2" in ins: t = "X"
    elif "SYNCS.ARRIVE" in ins: t = "R"
    elif "TRYWAIT" in ins: t = "T"
    elif "BAR.SYNC" in ins: t = "BS"
    elif "BAR.ARV" in ins: t = "BA"
    elif re.match(r"(@!?U?P\d )?BRA", ins): t = "br@" + m.group(1)
    else: continue
    if ev and ev[-1][0] == t: ev[-1][1] += 1
    else: ev.append([t, 1])
print(" ".join(f"{t}x{n}" if n > 1 else t for t, n in ev))
