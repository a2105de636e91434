# torch SDPA FlashAttention-2 backend timing (triton do_bench: L2 flushed between reps), bf16.
# usage: bench_torch.py [seqs] [dims]   e.g. bench_torch.py 512,1024 128
import torch, sys
from torch.nn.attention import sdpa_kernel, SDPBackend
import triton.testing as tt
import torch.nn.functional as F
print("torch", torch.__version__, torch.cuda.get_device_name())
seqs = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "512,1024,2048,4096,8192,16384").split(",")]
dims = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "64,128,256").split(",")]
for d, h in [(64, 32), (128, 16), (256, 8)]:
    if d not in dims: continue
    for s in seqs:
        b = 16384 // s
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for causal in (False, True):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                f = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                t = tt.do_bench(f, warmup=25, rep=150, return_mode="median") * 1e-3
            avg = s / 2 if causal else s
            print(f"TORCH d{d} seq{s:6d} causal{int(causal)} {t*1e6:9.1f} us {4*b*h*s*avg*d/t/1e12:7.1f} TFLOPS", flush=True)
