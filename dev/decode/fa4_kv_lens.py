# FA4 4.0.0b36 paged decode over batches of unequal lengths (seqused_k): the lengths of examples/bench --kv-lens.
# python3 fa4_kv_lens.py mixed:8:1024:32768 equal:8:11283 ...  (PYTHONPATH as for ../../../shared/bench/fa4_anchor.py)
import torch, sys
from triton.testing import do_bench
from flash_attn.cute import flash_attn_varlen_func
def mixed(n, lo, hi):
    x = 0x9E3779B97F4A7C15; M = 2**64; out = []
    for _ in range(n):
        x = (x * 6364136223846793005 + 1442695040888963407) % M
        out.append(lo + ((x >> 33) % (hi - lo + 1)))
    return out
hq, hkv, d, page = 32, 8, 128, 64
for spec in sys.argv[1:]:
    kind, n, a, b = spec.split(':') if spec.startswith('mixed') else (spec.split(':') + [None])
    lens = mixed(int(n), int(a), int(b)) if kind == 'mixed' else [int(a)] * int(n)
    n = len(lens); mp = (max(lens) + page - 1) // page; npg = n * mp
    kc = torch.randn(npg, page, hkv, d, device='cuda', dtype=torch.bfloat16); vc = torch.randn_like(kc)
    table = torch.randperm(npg, device='cuda', dtype=torch.int32).view(n, mp)
    used = torch.tensor(lens, device='cuda', dtype=torch.int32)
    q = torch.randn(n, hq, d, device='cuda', dtype=torch.bfloat16)
    cu = torch.arange(0, n + 1, device='cuda', dtype=torch.int32)
    ns = 0
    fn = lambda: flash_attn_varlen_func(q, kc, vc, cu_seqlens_q=cu, max_seqlen_q=1, seqused_k=used, page_table=table, num_splits=ns)
    try:
        fn(); torch.cuda.synchronize()
    except Exception as e:
        if 'SplitKV' not in str(e): raise
        ns = 1; fn(); torch.cuda.synchronize()
    ms = do_bench(fn, warmup=50, rep=300, return_mode='median')
    byt = 2 * sum(lens) * hkv * d * 2 + 2 * n * hq * d * 2
    print(f"fa4 paged p{page} {spec} (splits {'heuristic' if ns == 0 else 1}): {ms*1e3:.1f} us {byt/ms/1e6:.0f} GB/s", flush=True)
