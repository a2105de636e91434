# cuDNN SDPA decode anchor (same device call as the harness timing).
import torch, torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
from triton.testing import do_bench
import warnings; warnings.filterwarnings("ignore")
dt = torch.bfloat16
x = torch.randn(1 << 29, device="cuda", dtype=dt); y = torch.empty_like(x)
ms = do_bench(lambda: y.copy_(x), warmup=20, rep=200, return_mode="median")
print(f"TORCH copy_ 1 GiB: {2 * x.numel() * 2 / ms / 1e6:.1f} GB/s (read+write)"); del x, y
for b in (1, 8, 64):
    for sk in (4096, 8192, 32768):
        q = torch.randn(b, 32, 1, 128, device="cuda", dtype=dt)
        k = torch.randn(b, 8, sk, 128, device="cuda", dtype=dt)
        v = torch.randn(b, 8, sk, 128, device="cuda", dtype=dt)
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            fn = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            fn(); torch.cuda.synchronize()
            ms = do_bench(fn, warmup=50, rep=300, return_mode="median")
        us = ms * 1e3
        gb = (2 * q.numel() + k.numel() + v.numel()) * 2 / us / 1e3
        print(f"CUDNN b{b:<3} sk{sk:<6} {us:9.2f} us {gb:8.1f} GB/s", flush=True)
        del q, k, v
