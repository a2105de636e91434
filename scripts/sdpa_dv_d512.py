#!/usr/bin/env python3
# torch SDPA anchors for `bench --grid dv,d512`: python3 scripts/sdpa_dv_d512.py OUT.jsonl dv,d512
# The dv grid (q/k 192, v 128, 16 heads) and the d512 grid (32/4 heads, K/V heads repeated
# outside the timing), 16k tokens per call; every backend that runs the shape (cuDNN,
# memory-efficient, flash), median of CUDA-event timings after warm-up, fresh random inputs.
# TFLOPS count q/k at d and v at dv, causal halved.
import json, sys, torch
from torch.nn.attention import sdpa_kernel, SDPBackend
F = torch.nn.functional
out = open(sys.argv[1], 'w')
grids = sys.argv[2].split(',')
def bench(fn, reps=20):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b) * 1e3)
    ts.sort(); return ts[len(ts) // 2]
shapes = []
if 'dv' in grids:
    shapes += [(16384 // s, 16, 16, s, 192, 128, c) for c in (False, True) for s in (1024, 2048, 4096, 8192, 16384)]
if 'd512' in grids:
    shapes += [(16384 // s, 32, 4, s, d, d, c) for d in (256, 512) for c in (True, False) for s in (8192, 16384)]
for (b, hq, hkv, s, d, dv, causal) in shapes:
    q = torch.randn(b, hq, s, d, device='cuda', dtype=torch.bfloat16)
    k = torch.randn(b, hkv, s, d, device='cuda', dtype=torch.bfloat16).repeat_interleave(hq // hkv, 1)
    v = torch.randn(b, hkv, s, dv, device='cuda', dtype=torch.bfloat16).repeat_interleave(hq // hkv, 1)
    for name, be in [('cudnn', SDPBackend.CUDNN_ATTENTION), ('efficient', SDPBackend.EFFICIENT_ATTENTION), ('flash', SDPBackend.FLASH_ATTENTION)]:
        try:
            with sdpa_kernel([be]):
                us = bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
        except Exception as e:
            print(name, d, dv, s, causal, 'failed:', str(e).split('\n')[0][:90]); continue
        fl = 2 * b * hq * s * s * (d + dv) * (0.5 if causal else 1.0)
        row = dict(backend=name, d=d, dv=dv, causal=causal, sq=s, b=b, hq=hq, us=us, tflops=fl / us / 1e6)
        print(json.dumps(row)); out.write(json.dumps(row) + '\n'); out.flush()
    del q, k, v; torch.cuda.empty_cache()
