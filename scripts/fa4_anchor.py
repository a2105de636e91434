# FlashAttention-4 (CuTe DSL; its Hopper forward is FA3's design) measured on the GPU machine, on
# the grids of examples/bench and sdpa_anchor.py, in the same call as the code under test.
# This copy extends ../shared/bench/fa4_anchor.py with the sinks grid; it imports sdpa_anchor,
# so run it from a directory holding both (e.g. cp it into the .device dir that pack.sh makes).
#   python3 scripts/fa4_anchor.py [--grid fa3,seeds,llama,paged,mixed,sinks,dv] [--dtype bf16|f16] [--json FILE] [--head-dims 80,96]
# Needs the wheels staged by stage-fa4.sh (PYTHONPATH set by its install line). The first call of
# each (d, causal, paged) configuration JIT-compiles for a few seconds; timing starts after it.
# TFLOPS and GB/s are computed exactly as in sdpa_anchor.py. The "paged" grid reads K/V through a
# page table (page size 64 and 256, seqused_k) the way a serving engine's decode does. The "mixed"
# grid packs the 64 sequences of mixed-lengths.txt (varlen, cu_seqlens), causal, 32/8 heads, d128;
# its TFLOPS count each sequence's own causal work. Decode rows (seq_q 1) and the paged grid pass
# num_splits=0 (FA4's split heuristic, as a serving engine would); prefill keeps FA4's default.
# On sm90 FA4 has no split-KV (measured 2026-11-24): those rows fall back to one split and say so.
# The "dv" grid is examples/bench's DeepSeek prefill (q/k head dim 192, v 128, 16 heads, 16k tokens per
# call); its FLOPs count 2 * (192 + 128) per visible pair.
# The "sinks" grid is examples/bench's: gpt-oss attention (d64, 64/8 heads, 32k tokens per call,
# 4k..32k) with a learnable sink per head (FA4's learnable_sink, random values), causal and a
# causal 128-key window (window_size=(127, 0)); TFLOPS of a windowed row count the keys each row
# sees, as the bench does. Every row carries window (null: none) and sinks, as the bench's rows.
import argparse, json, os, sys, time
import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sdpa_anchor
from sdpa_anchor import grid as dense_grid, flops  # same shapes, same FLOP count
HERE = os.path.dirname(os.path.abspath(__file__))

def mixed_lengths():
    return [int(x) for x in open(os.path.join(HERE, "mixed-lengths.txt")).read().split(",")]

def grid(name):
    if name == "mixed":
        # 64 packed sequences (mixed-lengths.txt), LLaMA-3-8B heads, causal: batched prefill.
        yield ("mixed", 32, 8, 0, 0, 128, True, 0, None)
    elif name == "paged":
        for page in (64, 256):
            for b, sk in ((1, 32768), (8, 8192), (64, 4096), (64, 32768)):
                yield (b, 32, 8, 1, sk, 128, False, page, None)
    elif name == "sinks":
        # gpt-oss: full causal layers and 128-key causal windows (left 127, right 0), sinks on
        for w in (None, 127):
            for s in (4096, 8192, 16384, 32768):
                yield (32768 // s, 64, 8, s, s, 64, True, 0, w)
    elif name == "dv":
        # DeepSeek-V3 prefill head dims: q/k 192, v 128 (DV below); 16 heads; 16k tokens per call
        for c in (False, True):
            for s in (1024, 2048, 4096, 8192, 16384):
                yield (16384 // s, 16, 16, s, s, 192, c, 0, None)
    else:
        for row in dense_grid(name):
            yield row + (0, None)

# V's head dim per grid where it differs from q/k's
DV = {"dv": 128}

def window_flops(b, hq, sq, sk, d, w):
    # each query row i sees keys [i + sk - sq - w, i + sk - sq] within [0, sk) (bottom-right)
    seen = sum(max(0, min(sk, i + sk - sq + 1) - max(0, i + sk - sq - w)) for i in range(sq))
    return 4 * b * hq * seen * d

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--grid", default="fa3,seeds,llama")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "fa4.jsonl"))
    ap.add_argument("--head-dims", default="", help="comma-separated head dims for the fa3 grid, e.g. 80,96")
    a = ap.parse_args()
    sdpa_anchor.DIMS = [int(x) for x in a.head_dims.split(",") if x]
    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func
    dt = {"bf16": torch.bfloat16, "f16": torch.float16}[a.dtype]
    out = open(a.json, "a")
    print(f"fa4 {torch.cuda.get_device_name(0)}", flush=True)
    for g in a.grid.split(","):
        for (b, hq, hkv, sq, sk, d, c, page, w) in grid(g):
            if b == "mixed":
                lens = mixed_lengths()
                rec = dict(kind="fa4", grid=g, backend="fa4", dtype=a.dtype, b=len(lens), hq=hq, hkv=hkv, sq=sum(lens), sk=sum(lens), d=d, causal=c, page=0, varlen=True, window=None, sinks=False)
                cu = torch.tensor([0] + list(__import__("itertools").accumulate(lens)), device="cuda", dtype=torch.int32)
                q = torch.randn(sum(lens), hq, d, device="cuda", dtype=dt)
                k = torch.randn(sum(lens), hkv, d, device="cuda", dtype=dt); v = torch.randn_like(k)
                fn = lambda: flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens), causal=c)
                fl = sum(flops(1, hq, L, L, d, c) for L in lens)
                try:
                    fn(); torch.cuda.synchronize(); ms = do_bench(fn, warmup=50, rep=300, return_mode="median")
                except Exception as e:
                    rec["error"] = (str(e).splitlines() or [repr(e)])[0][:160]; out.write(json.dumps(rec) + "\n"); print("mixed: n/a", rec["error"]); continue
                rec.update(us=ms * 1e3, tflops=fl / (ms * 1e3) / 1e6)
                out.write(json.dumps(rec) + "\n"); print(f"mixed 64 seqs {sum(lens)} tokens d{d} c{int(c)}: {ms*1e3:9.1f} us {rec['tflops']:6.1f} T", flush=True)
                continue
            q = torch.randn(b, sq, hq, d, device="cuda", dtype=dt)
            dv = DV.get(g, d)
            rec = dict(kind="fa4", grid=g, backend="fa4", dtype=a.dtype, b=b, hq=hq, hkv=hkv, sq=sq, sk=sk, d=d, dv=dv, causal=c, page=page, window=w, sinks=g == "sinks")
            # the sinks grid's options: a sink logit per query head, the window as (left, right)
            kw = {}
            if g == "sinks":
                kw["learnable_sink"] = torch.rand(hq, device="cuda", dtype=torch.float32) * 5 - 1
            if w is not None:
                kw["window_size"] = (w, 0)
            try:
                if page:
                    npg = b * sk // page
                    kc = torch.randn(npg, page, hkv, d, device="cuda", dtype=dt)
                    vc = torch.randn(npg, page, hkv, d, device="cuda", dtype=dt)
                    table = torch.randperm(npg, device="cuda", dtype=torch.int32).view(b, sk // page)
                    used = torch.full((b,), sk, device="cuda", dtype=torch.int32)
                    cu_q = torch.arange(0, b + 1, device="cuda", dtype=torch.int32) * sq
                    qf = q.view(b * sq, hq, d)
                    fn = lambda: flash_attn_varlen_func(qf, kc, vc, cu_seqlens_q=cu_q, max_seqlen_q=sq, seqused_k=used, page_table=table, causal=c, num_splits=0)
                    kv_bytes = kc.numel() + vc.numel()
                else:
                    k = torch.randn(b, sk, hkv, d, device="cuda", dtype=dt)
                    v = torch.randn(b, sk, hkv, dv, device="cuda", dtype=dt)
                    fn = lambda: flash_attn_func(q, k, v, causal=c, num_splits=0 if sq == 1 else 1, **kw)
                    kv_bytes = k.numel() + v.numel()
                t0 = time.time()
                try:
                    fn(); torch.cuda.synchronize()
                except Exception as e:
                    if "learnable_sink" in str(e) and "learnable_sink" in kw:
                        # FA4 builds that take bf16 sinks only ("learnable_sink must be bfloat16")
                        kw["learnable_sink"] = kw["learnable_sink"].to(torch.bfloat16)
                        rec["sink_dtype"] = "bf16"
                        fn(); torch.cuda.synchronize()
                    # FA4 has no split-KV on sm90 ("SplitKV not supported on SM 9.0"): fall back to
                    # one split, as a serving engine on Hopper would, and say so in the record.
                    elif "SplitKV" not in str(e): raise
                    rec["splits"] = "1 (split-KV unsupported on this arch)"
                    if page:
                        fn = lambda: flash_attn_varlen_func(qf, kc, vc, cu_seqlens_q=cu_q, max_seqlen_q=sq, seqused_k=used, page_table=table, causal=c, num_splits=1)
                    else:
                        fn = lambda: flash_attn_func(q, k, v, causal=c, num_splits=1, **kw)
                    fn(); torch.cuda.synchronize()
                jit = time.time() - t0
                ms = do_bench(fn, warmup=50, rep=300, return_mode="median")
            except Exception as e:
                rec["error"] = (str(e).splitlines() or [repr(e)])[0][:160]
                out.write(json.dumps(rec) + "\n"); print(f"{g} {b} {hq}/{hkv} {sq}x{sk} d{d} c{int(c)} p{page}: n/a {rec['error']}", flush=True)
                continue
            us = ms * 1e3
            fl = window_flops(b, hq, sq, sk, d, w) if w is not None else flops(b, hq, sq, sk, d, c)
            fl = fl * (d + dv) / (2 * d)  # the scores take d per pair, the values dv
            rec.update(us=us, tflops=fl / us / 1e6,
                       gbps=(2 * q.numel() + kv_bytes) * q.element_size() / us / 1e3, first_call_s=jit)
            out.write(json.dumps(rec) + "\n")
            print(f"{g} {b} {hq}/{hkv} {sq}x{sk} d{d} c{int(c)} p{page}{f' w{w}' if w is not None else ''}{' sinks' if g == 'sinks' else ''}: {us:9.1f} us {rec['tflops']:6.1f} T {rec['gbps']:7.0f} GB/s (first call {jit:.1f} s)", flush=True)

if __name__ == "__main__":
    import warnings; warnings.filterwarnings("ignore")
    main()
