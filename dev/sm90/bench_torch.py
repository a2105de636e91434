# torch SDPA baselines (FA2 "flash", cuDNN) on the fa3 grid, same call as the harness bench.
import sys, warnings
warnings.filterwarnings("ignore")
import torch, torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
from triton.testing import do_bench
dts = sys.argv[1].split(",") if len(sys.argv) > 1 else ["bf16"]
print(f"torch {torch.__version__} cuDNN {torch.backends.cudnn.version()} {torch.cuda.get_device_name()}")
for dn in dts:
    dt = {"bf16": torch.bfloat16, "f16": torch.float16}[dn]
    for d, h in ((64, 32), (128, 16), (256, 8)):
        if dn == "f16" and d != 128: continue
        for s in (512, 1024, 2048, 4096, 8192, 16384):
            for c in (False, True):
                b = 16384 // s
                q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=dt) for _ in range(3))
                fl = 4 * b * h * s * s * d / (2 if c else 1)
                row = []
                for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                    try:
                        with sdpa_kernel([be]):
                            fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=c)
                            fn(); torch.cuda.synchronize()
                            ms = do_bench(fn, warmup=25, rep=150, return_mode="median")
                        row.append(f"{name} {ms*1e3:9.1f}us {fl/ms/1e9:6.1f}T")
                    except Exception as e:
                        row.append(f"{name} n/a")
                print(f"TORCH {dn} d{d} h{h} b{b} s{s} causal={int(c)} | " + " | ".join(row), flush=True)
                del q, k, v
