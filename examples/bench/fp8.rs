//! `--grid fp8decode`: paged decode over a bf16 KV cache against the same cache in FP8 (e4m3)
//! with per-head scales. 32/8 heads, d128, pages of 64 in shuffled order, one query row, b1 / b8 /
//! b64 x 4k / 8k / 16k / 32k keys. Per row: each run's time, GB/s on the bytes it reads (K and V
//! of every cached key, q and o), the FP8 run's speed over the bf16 one, and the largest
//! difference between the two outputs: the bf16 cache holds the FP8 cache's dequantized values
//! rounded to bf16 (`stored * scale`), so the two compute the same attention up to bf16
//! rounding. docs/decisions.md#fp8-keys-and-values-in-the-decode-kernel.
//!
//! `--grid fp8prefill`: chunked prefill over the same two caches: a chunk of sq = 512 / 2048 new
//! query rows (causal, bottom-right: they are the last sq of the sequence's keys, appended
//! before the call) over a paged cache holding sk = 4k / 16k / 32k keys in all, b1 / b4, 32/8
//! heads, d128, pages of 64 in shuffled order. The FP8 cache takes the slow path (its pages
//! widened to bf16 on the device, then the bf16 kernels). Per row: both times, TFLOPS, the FP8
//! run's speed over the bf16 one, what the difference costs per byte the widening moves, the time
//! `dequantize_e4m3` takes for both pools alone, and the largest difference between the two
//! outputs (a mismatch beyond bf16 rounding fails the run).

use super::{json_num, time_call, Args};
use anyhow::bail;
use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use flashcore::{AttnParams, KvScales};
use serde_json::json;

const HQ: usize = 32;
const HKV: usize = 8;
const D: usize = 128;
const PAGE: usize = 64;
/// Pages generated at once; a larger pool repeats them (the values do not change the timing).
const BLOCK_PAGES: usize = 512;

/// The two caches of `pages` pages: F8E4M3 pools and bf16 pools of their dequantized values.
struct Caches {
    k8: Tensor,
    v8: Tensor,
    k16: Tensor,
    v16: Tensor,
}

fn caches(pages: usize, s: &KvScales, dev: &Device) -> Result<Caches> {
    let n = pages.min(BLOCK_PAGES);
    let block = |scale: &Tensor| -> Result<(Tensor, Tensor)> {
        let x = Tensor::randn(0f32, 1., (n, PAGE, HKV, D), dev)?;
        // candle cannot cast to or from F8E4M3 on CUDA: flashcore's conversions
        let q8 = flashcore::quantize_e4m3(&x, scale)?;
        let wide = flashcore::dequantize_e4m3(&q8, scale, DType::BF16)?;
        Ok((q8, wide))
    };
    let fill = |t: &Tensor| -> Result<Tensor> {
        let reps = pages.div_ceil(n);
        let all = Tensor::cat(&vec![t.clone(); reps], 0)?;
        Ok(all.narrow(0, 0, pages)?.contiguous()?)
    };
    let (k8, k16) = block(&s.k)?;
    let (v8, v16) = block(&s.v)?;
    Ok(Caches {
        k8: fill(&k8)?,
        v8: fill(&v8)?,
        k16: fill(&k16)?,
        v16: fill(&v16)?,
    })
}

/// A page table `(b, sk / PAGE)` over `b * sk / PAGE` pages in a seeded shuffled order.
fn table(b: usize, sk: usize, dev: &Device) -> Result<Tensor> {
    let mp = sk / PAGE;
    let mut perm: Vec<u32> = (0..(b * mp) as u32).collect();
    let mut x = 0x9E37_79B9u64;
    for i in (1..perm.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        perm.swap(i, (x % (i as u64 + 1)) as usize);
    }
    Ok(Tensor::from_vec(perm, (b, mp), dev)?)
}

/// The device's copy bandwidth in GB/s (bytes read plus bytes written) on a 2 GiB bf16 buffer of
/// random values: the ceiling a kernel that streams its input once can approach.
fn copy_gbps(args: &Args, dev: &Device) -> Result<f64> {
    let n = 1usize << 30;
    let x = Tensor::randn(0f32, 1., n / 4, dev)?
        .to_dtype(DType::BF16)?
        .repeat(4)?;
    let t = time_call(args, dev, |_| Ok(x.copy().map(|_| ())?))??;
    Ok((2 * 2 * n) as f64 / t / 1e3)
}

/// Runs the grid, printing one line (or JSON object) per problem.
pub fn grid(args: &Args, dev: &Device) -> Result<()> {
    if !dev.is_cuda() {
        anyhow::bail!("--grid fp8decode needs a CUDA device (the CPU path has no FP8 kernel)");
    }
    if !args.json {
        println!(
            "device: {:?}, q bf16, K/V bf16 vs FP8 e4m3 (per-head scales), timing {}",
            dev.location(),
            args.timing
        );
    }
    let s = KvScales {
        k: Tensor::rand(0.5f32, 1.5, HKV, dev)?,
        v: Tensor::rand(0.5f32, 1.5, HKV, dev)?,
    };
    let copy = copy_gbps(args, dev)?;
    if !args.json {
        println!("device copy: {copy:.1} GB/s (bytes read + written, 2 GiB buffer)");
    }
    let p16 = AttnParams::default();
    let p8 = AttnParams {
        kv_scales: Some(s.clone()),
        ..Default::default()
    };
    for b in [1usize, 8, 64] {
        for sk in [4096usize, 8192, 16384, 32768] {
            let c = caches(b * sk / PAGE, &s, dev)?;
            let pt = table(b, sk, dev)?;
            let lens = Tensor::new(vec![sk as u32; b].as_slice(), dev)?;
            let q = Tensor::randn(0f32, 1., (b, 1, HQ, D), dev)?.to_dtype(DType::BF16)?;
            let run16 = || flashcore::attention_paged(&q, &c.k16, &c.v16, &pt, &lens, &p16);
            let run8 = || flashcore::attention_paged(&q, &c.k8, &c.v8, &pt, &lens, &p8);
            let t16 = time_call(args, dev, |_| Ok(run16().map(|_| ())?))??;
            let t8 = time_call(args, dev, |_| Ok(run8().map(|_| ())?))??;
            let (o16, o8) = (run16()?, run8()?);
            let diff = (o16.to_dtype(DType::F32)? - o8.to_dtype(DType::F32)?)?
                .abs()?
                .flatten_all()?
                .max(0)?
                .to_scalar::<f32>()?;
            let mag = o16
                .to_dtype(DType::F32)?
                .abs()?
                .flatten_all()?
                .max(0)?
                .to_scalar::<f32>()?;
            let qo = (2 * b * HQ * D * 2) as f64;
            let kv = (2 * b * sk * HKV * D) as f64;
            let (gb16, gb8) = ((qo + 2.0 * kv) / t16 / 1e3, (qo + kv) / t8 / 1e3);
            let row = json!({
                "grid": "fp8decode", "b": b, "hq": HQ, "hkv": HKV, "sq": 1,
                "sk": sk, "d": D, "page": PAGE, "us_bf16": json_num(t16), "us_fp8": json_num(t8),
                "gbps_bf16": json_num(gb16), "gbps_fp8": json_num(gb8),
                "speedup": json_num(t16 / t8), "copy_gbps": json_num(copy), "max_diff": json_num(diff as f64),
                "max_out": json_num(mag as f64), "timing": args.timing,
            });
            if args.json {
                println!("{row}");
            } else {
                println!(
                    "b{b:<2} s{sk:<5} d{D} h{HQ}/{HKV} page {PAGE}: bf16 {t16:8.1} us {gb16:7.1} GB/s | fp8 {t8:8.1} us {gb8:7.1} GB/s ({:.0} % of copy) | fp8 {:.2}x | max |o8 - o16| {diff:.2e} (|o| <= {mag:.2})",
                    100.0 * gb8 / copy,
                    t16 / t8
                );
            }
        }
    }
    Ok(())
}

/// `--grid fp8prefill`: chunked prefill (module docs). Fails (after printing every row) when an
/// FP8 output differs from the bf16 cache's by more than 2 % of the outputs' magnitude or holds a
/// non-finite value.
pub fn prefill_grid(args: &Args, dev: &Device) -> Result<()> {
    if !dev.is_cuda() {
        bail!("--grid fp8prefill needs a CUDA device (the CPU path has no FP8 kernel)");
    }
    if !args.json {
        println!(
            "device: {:?}, q bf16, K/V bf16 vs FP8 e4m3 (per-head scales), causal (bottom-right), timing {}",
            dev.location(),
            args.timing
        );
    }
    let s = KvScales {
        k: Tensor::rand(0.5f32, 1.5, HKV, dev)?,
        v: Tensor::rand(0.5f32, 1.5, HKV, dev)?,
    };
    let causal = AttnParams {
        mask: flashcore::Mask::Causal,
        ..Default::default()
    };
    let p8 = AttnParams {
        kv_scales: Some(s.clone()),
        ..causal.clone()
    };
    let mut bad = Vec::new();
    for b in [1usize, 4] {
        for sk in [4096usize, 16384, 32768] {
            let c = caches(b * sk / PAGE, &s, dev)?;
            let pt = table(b, sk, dev)?;
            let lens = Tensor::new(vec![sk as u32; b].as_slice(), dev)?;
            // the widening's cost alone, near enough: both pools dequantized whole (the table
            // uses every page) by `dequantize_e4m3`
            let tw = time_call(args, dev, |_| {
                flashcore::dequantize_e4m3(&c.k8, &s.k, DType::BF16)?;
                flashcore::dequantize_e4m3(&c.v8, &s.v, DType::BF16)?;
                Ok(())
            })??;
            for sq in [512usize, 2048] {
                let q = Tensor::randn(0f32, 1., (b, sq, HQ, D), dev)?.to_dtype(DType::BF16)?;
                let run16 = || flashcore::attention_paged(&q, &c.k16, &c.v16, &pt, &lens, &causal);
                let run8 = || flashcore::attention_paged(&q, &c.k8, &c.v8, &pt, &lens, &p8);
                let t16 = time_call(args, dev, |_| Ok(run16().map(|_| ())?))??;
                let t8 = time_call(args, dev, |_| Ok(run8().map(|_| ())?))??;
                let (o16, o8) = (
                    run16()?.to_dtype(DType::F32)?,
                    run8()?.to_dtype(DType::F32)?,
                );
                let max_of = |t: &Tensor| -> Result<f32> {
                    Ok(t.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?)
                };
                let diff = max_of(&(&o16 - &o8)?)?;
                let mag = max_of(&o16)?;
                let finite = o8
                    .flatten_all()?
                    .to_vec1::<f32>()?
                    .iter()
                    .all(|x| x.is_finite());
                let ok = finite && diff <= 0.02 * mag.max(1e-3);
                // causal bottom-right: row i sees sk - sq + i + 1 keys
                let seen = (sq * (sk - sq) + sq * (sq + 1) / 2) as f64;
                let flops = 4.0 * (b * HQ * D) as f64 * seen;
                let (tf16, tf8) = (flops / t16 / 1e6, flops / t8 / 1e6);
                // the widening's bytes: every cached K and V element read once (e4m3) and written
                // once (bf16)
                let widen_bytes = (2 * b * sk * HKV * D * 3) as f64;
                let gap_gbps = (t8 > t16).then(|| widen_bytes / (t8 - t16) / 1e3);
                let row = json!({
                    "grid": "fp8prefill", "b": b, "hq": HQ, "hkv": HKV, "sq": sq, "sk": sk,
                    "d": D, "page": PAGE, "causal": true, "us_bf16": json_num(t16),
                    "us_fp8": json_num(t8), "tflops_bf16": json_num(tf16),
                    "tflops_fp8": json_num(tf8), "speed": json_num(t16 / t8),
                    "gap_gbps": gap_gbps.map(json_num), "us_dequantize_pools": json_num(tw), "max_diff": json_num(diff as f64),
                    "max_out": json_num(mag as f64), "finite": finite, "ok": ok,
                    "timing": args.timing,
                });
                if args.json {
                    println!("{row}");
                } else {
                    println!(
                        "{}b{b} q{sq:<4} k{sk:<5} d{D} h{HQ}/{HKV} page {PAGE}: bf16 {t16:8.1} us {tf16:6.1} TFLOPS | fp8 {t8:8.1} us {tf8:6.1} TFLOPS | fp8 {:.3}x bf16's speed | gap {:.1} us{} on the widening's {:.0} MB (pools dequantized alone {tw:.1} us) | max |o8 - o16| {diff:.2e} (|o| <= {mag:.2}){}",
                        if ok { "" } else { "[FAIL] " },
                        t16 / t8,
                        t8 - t16,
                        gap_gbps.map_or(String::new(), |g| format!(" = {g:.0} GB/s")),
                        widen_bytes / 1e6,
                        if finite { "" } else { ", non-finite FP8 output" }
                    );
                }
                if !ok {
                    bad.push(format!("b{b} q{sq} k{sk}"));
                }
            }
        }
    }
    if !bad.is_empty() {
        bail!(
            "fp8prefill: FP8 output differs from the bf16 cache's beyond 2 % of |o| (or is not finite): {}",
            bad.join(", ")
        );
    }
    Ok(())
}
