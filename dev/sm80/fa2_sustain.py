# torch SDPA FA2 ("flash") and cuDNN under sustained load, the harness's `sustain` method: per
# backend and shape, HEAT seconds of back-to-back calls (each after a 256 MB L2 flush), then 40
# event-timed calls, median; two passes. bf16, fa3-grid shapes (16k tokens).
# usage: fa2_sustain.py [heat_s] [dims] [points]   points: d:seq:causal,... (e.g. 64:2048:1) instead
#        of the default 2k non-causal, 16k non-causal and 16k causal per head dim
import sys, time, torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
heat = float(sys.argv[1]) if len(sys.argv) > 1 else 2.0
dims = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "128").split(",")]
if len(sys.argv) > 3:
    pts = [tuple(int(v) for v in x.split(":")) for x in sys.argv[3].split(",")]
else:
    pts = [(d, s, c) for d in dims for (s, c) in ((2048, 0), (16384, 0), (16384, 1))]
flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
H = {64: 32, 128: 16, 256: 8}
backs = [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)]
for pas in range(2):
    for d, s, causal in pts:
        causal = bool(causal)
        b, h = 16384 // s, H[d]
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for name, be in (backs if pas == 0 else backs[::-1]):
            with sdpa_kernel([be]):
                f = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                t0 = time.time()
                while time.time() - t0 < heat:
                    for _ in range(8):
                        flush.zero_(); f()
                    torch.cuda.synchronize()
                ts = []
                for _ in range(40):
                    flush.zero_()
                    e0 = torch.cuda.Event(enable_timing=True); e1 = torch.cuda.Event(enable_timing=True)
                    e0.record(); f(); e1.record(); e1.synchronize()
                    ts.append(e0.elapsed_time(e1))
            ts.sort(); t = ts[len(ts) // 2] * 1e-3
            avg = s / 2 if causal else s
            print(f"SUST torch_{name}_d{d} {s:5d} {int(causal)} pass{pas} {t*1e6:9.1f} {4*b*h*s*avg*d/t/1e12:7.1f}", flush=True)
