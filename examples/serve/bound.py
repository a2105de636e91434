#!/usr/bin/env python3
"""Issue #23's ratio on a model of the load: both engines with every step at its floor.

Rebuilds examples/serve's generated load (the same SplitMix64 stream as `build_requests` in
main.rs: --requests, --prompt-len, --gen-len, --seed; random-weight models, no tokenizer) and
prices each step of the continuous and the static engine at its floor on Llama-3-8B shapes:

  step = max(weight bytes / bandwidth, GEMM FLOPs / peak)     (every weight read once per step)
       + K/V bytes the step's decode rows read / bandwidth
       + prefill attention FLOPs / peak

Continuous: first come, first served (or --policy lof: longest generation first), chunked
prefill within --max-batch-tokens, one decode token per running request per step, every request
fits the pool. Static: --static-batch requests in arrival order, prefilled padded to the batch's
longest prompt (sub-batches of at most --max-batch-tokens padded tokens), then every row decodes
to the batch's longest generation reading its own rows only (as `serve_static`).

  python3 examples/serve/bound.py                       # the issue's load, H100-like floors
  python3 examples/serve/bound.py --bandwidth 3.35e12 --peak 990e12
"""
import argparse

M64 = (1 << 64) - 1


class SplitMix64:
    def __init__(self, seed):
        self.x = seed

    def next(self):
        self.x = (self.x + 0x9E3779B97F4A7C15) & M64
        z = self.x
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
        return z ^ (z >> 31)


def parse_range(s):
    lo, hi = s.split(":")
    return int(lo), int(hi)


def load(n, plen, glen, seed):
    """(prompt length, new tokens) per request, as main.rs draws them (one draw per prompt
    token: random-weight models have no tokenizer, so prompts are random ids)."""
    rng = SplitMix64(seed)
    pick = lambda lo, hi: lo + rng.next() % (hi - lo + 1)
    reqs = []
    for _ in range(n):
        p = pick(*plen)
        for _ in range(p):
            rng.next()
        reqs.append((p, pick(*glen)))
    return reqs


class Floor:
    """Llama-3-8B: 32 layers, hidden 4096, 32/8 heads of 128, MLP 14336, vocab 128256, bf16."""

    def __init__(self, bandwidth, peak):
        layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336
        self.body = 32 * layer
        self.head = 4096 * 128256
        self.weight_bytes = 2 * (self.body + self.head)
        self.kv_row_bytes = 2 * 8 * 128 * 2 * 32
        self.bw, self.peak = bandwidth, peak

    def step(self, tokens, logits, kv_rows, attn_flops):
        gemm = max(self.weight_bytes / self.bw, (2 * self.body * tokens + 2 * self.head * logits) / self.peak)
        return gemm + self.kv_row_bytes * kv_rows / self.bw + attn_flops / self.peak


def prefill_attn_flops(cached, n):
    """Causal attention of n new queries after `cached` keys, 32 heads of 128, 32 layers."""
    keys = n * cached + n * (n + 1) / 2
    return 4 * 128 * 32 * 32 * keys


def continuous(reqs, floor, budget, policy):
    order = range(len(reqs))
    if policy == "lof":
        order = sorted(order, key=lambda i: -reqs[i][1])
    waiting = list(order)
    running = []  # [request, rows cached, tokens generated]
    t = steps = 0
    while waiting or running:
        left = budget
        plan = [(s, 1) for s in running if s[1] >= reqs[s[0]][0]]
        for s in running:
            p = reqs[s[0]][0]
            if s[1] < p and left > 0:
                n = min(p - s[1], left)
                left -= n
                plan.append((s, n))
        while left > 0 and waiting:
            s = [waiting.pop(0), 0, 0]
            running.append(s)
            n = min(reqs[s[0]][0], left)
            left -= n
            plan.append((s, n))
        tokens = logits = kv = 0
        attn = 0.0
        for s, n in plan:
            p = reqs[s[0]][0]
            tokens += n
            attn += prefill_attn_flops(s[1], n)
            if n == 1 and s[1] >= p:
                kv += s[1] + 1
            s[1] += n
            logits += s[1] >= p
        t += floor.step(tokens, logits, kv, attn)
        steps += 1
        for s, _ in plan:
            p, g = reqs[s[0]]
            if s[1] >= p:
                s[2] += 1
                if s[2] >= g:
                    running.remove(s)
    return t, steps


def static(reqs, floor, batch, budget):
    t = steps = 0
    for k in range(0, len(reqs), batch):
        group = reqs[k:k + batch]
        b = len(group)
        p_max = max(p for p, _ in group)
        g_max = max(g for _, g in group)
        per = max(budget // p_max, 1)
        for first in range(0, b, per):
            rows = min(per, b - first)
            t += floor.step(rows * p_max, rows, 0, rows * prefill_attn_flops(0, p_max))
            steps += 1
        for step in range(1, g_max):
            t += floor.step(b, b, sum(p + step for p, _ in group), 0.0)
            steps += 1
    return t, steps


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-len", default="128:2048")
    ap.add_argument("--gen-len", default="128:512")
    ap.add_argument("--seed", type=int, default=299792458)
    ap.add_argument("--static-batch", type=int, default=165)
    ap.add_argument("--max-batch-tokens", default="2048,8192,0", help="comma-separated; 0: unlimited")
    ap.add_argument("--policy", default="fcfs", choices=["fcfs", "lof"])
    ap.add_argument("--bandwidth", type=float, default=3.0e12, help="bytes/s")
    ap.add_argument("--peak", type=float, default=750e12, help="bf16 GEMM FLOP/s")
    a = ap.parse_args()
    reqs = load(a.requests, parse_range(a.prompt_len), parse_range(a.gen_len), a.seed)
    new = sum(g for _, g in reqs)
    print(f"{len(reqs)} requests: {sum(p for p, _ in reqs)} prompt + {new} new tokens")
    floor = Floor(a.bandwidth, a.peak)
    for budget in (int(x) for x in a.max_batch_tokens.split(",")):
        b = budget if budget > 0 else 1 << 62
        tc, sc = continuous(reqs, floor, b, a.policy)
        ts, ss = static(reqs, floor, a.static_batch, b if budget > 0 else 2048)
        print(
            f"budget {budget or 'unlimited'}: continuous ({a.policy}) {tc:.2f} s, {sc} steps, "
            f"{new / tc:.0f} tok/s; static {ts:.2f} s, {ss} steps, {new / ts:.0f} tok/s; "
            f"ratio {ts / tc:.3f}"
        )


if __name__ == "__main__":
    main()
