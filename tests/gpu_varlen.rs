//! GPU tests of the packed variable-length API, every head dim that is a multiple of 8, and ALiBi
//! on the GPU (feature `cuda`; every test skips itself, saying so, without a CUDA device, or fails
//! with FLASHCORE_REQUIRE_GPU=1).
//!
//! Tolerance rule (as in tests/gpu.rs): the GPU error against the truth is at most 2x the error
//! of the naive same-precision composition (`attention_slow` per sequence, on the GPU, in the
//! input dtype) plus a rounding floor; LSE within 2e-3. For varlen problems the truth is the
//! dense CPU path on each sequence alone, from the same inputs converted to f32 (exact), with that
//! sequence's own lengths and slopes; for dense problems the independent float64 reference of
//! tests/common. Outputs are poisoned (NaN) before every kernel, so unwritten elements fail.
//! FLASHCORE_TEST_ARCH=sm80|sm90 forces a kernel family (the H100 runs this binary twice).
#![cfg(feature = "cuda")]

mod common;
#[path = "common/gpu.rs"]
mod common_gpu;

use candle_core::{DType, Device, Error, Result, Tensor};
use common::*;
use common_gpu::{arch_under_test, gpu};
use flashcore::cuda::set_poison_outputs;
use flashcore::{attention_slow, attention_with_lse, AttnParams, Mask};

const MASKS: [Mask; 4] = [
    Mask::None,
    Mask::Causal,
    Mask::Window {
        left: Some(64),
        right: Some(0),
    },
    Mask::Window {
        left: Some(100),
        right: Some(20),
    },
];

/// ALiBi slopes on `dev`: `(hq,)` when `per_seq` is `None`, else `(n, hq)`; uniform in (0, 1).
fn slopes(dev: &Device, per_seq: Option<usize>, hq: usize) -> Result<Tensor> {
    match per_seq {
        None => Tensor::rand(0f32, 1., hq, dev),
        Some(n) => Tensor::rand(0f32, 1., (n, hq), dev),
    }
}

/// The option sets the sweeps rotate through: plain, softcap 30, ALiBi `(heads_q,)`, ALiBi
/// `(batch, heads_q)`, softcap 30 + ALiBi `(batch, heads_q)`.
fn options(dev: &Device, which: usize, mask: Mask, n: usize, hq: usize) -> Result<AttnParams> {
    let (softcap, alibi) = match which % 5 {
        0 => (None, None),
        1 => (Some(30.0), None),
        2 => (None, Some(None)),
        3 => (None, Some(Some(n))),
        _ => (Some(30.0), Some(Some(n))),
    };
    Ok(AttnParams {
        mask,
        softcap,
        alibi_slopes: alibi.map(|a| slopes(dev, a, hq)).transpose()?,
        ..Default::default()
    })
}

/// The truth of a varlen problem: the dense CPU path on each sequence alone (per head, over all
/// cores) from the inputs converted to f32, with that sequence's slopes.
fn varlen_truth(vl: &Varlen, p: &AttnParams) -> Result<(Tensor, Tensor)> {
    let cpu = Device::Cpu;
    let vl32 = vl.to(&cpu, DType::F32)?;
    let (o, l) = varlen_by_sequence(&vl32, &params_on(p, &cpu)?, true, |q, k, v, p| {
        let (o, l) = attention_with_lse(q, k, v, p)?;
        Ok((o, Some(l)))
    })?;
    Ok((o, l.expect("dense LSE")))
}

/// The naive same-precision composition, per sequence, on the inputs' device and dtype.
fn varlen_naive(vl: &Varlen, p: &AttnParams) -> Result<Tensor> {
    let (o, _) = varlen_by_sequence(vl, p, false, |q, k, v, p| {
        Ok((attention_slow(q, k, v, p)?, None))
    })?;
    Ok(o)
}

/// The tolerance rule on one varlen problem (`attention_varlen_with_lse`, and with `plain_too`
/// also `attention_varlen`); rows of sequences without keys must be exact zeros. Prints the
/// one-line summary. Returns the error.
fn check_varlen(tag: &str, vl: &Varlen, p: &AttnParams, plain_too: bool) -> Result<f64> {
    let plain = |p: &AttnParams| vl.run_o(p);
    check_packed(tag, vl, p, &|p| vl.run(p), plain_too.then_some(&plain))
}

/// A runner of a packed problem: O `(total_q, hq, d)` and LSE `(hq, total_q)`; or O only.
type RunFn<'a> = &'a dyn Fn(&AttnParams) -> Result<(Tensor, Tensor)>;
type RunOFn<'a> = &'a dyn Fn(&AttnParams) -> Result<Tensor>;

/// [`check_varlen`] with the call under test given: `run` (O and LSE of `vl`'s problem, e.g.
/// through a paged cache holding its keys) and optionally `run_o` (O only).
fn check_packed(
    tag: &str,
    vl: &Varlen,
    p: &AttnParams,
    run: RunFn,
    run_o: Option<RunOFn>,
) -> Result<f64> {
    let what = format!("{tag} {} {}", vl.shape_name(), opts_name(p));
    let t0 = std::time::Instant::now();
    let ctx = |e: Error| Error::Msg(format!("{what}: {e}"));
    let (hq, _) = vl.heads();
    // The output has v's head dim.
    let (tq, dv) = (vl.total_q(), vl.v_head_dim());
    let (o, lse) = run(p).map_err(ctx)?;
    assert_eq!(o.dims(), &[tq, hq, dv], "{what}: output shape");
    assert_eq!(
        lse.dims(),
        &[hq, tq],
        "{what}: lse shape (heads_q, total_q)"
    );
    let o = o.to_device(&Device::Cpu)?;
    let lse = lse.to_device(&Device::Cpu)?;
    let gpu_s = t0.elapsed().as_secs_f64();
    let bad = non_finite(&o)?;
    assert_eq!(
        bad, 0,
        "{what}: {bad} non-finite (unwritten or NaN) output elements"
    );
    let (o_ref, lse_ref) = varlen_truth(vl, p).map_err(ctx)?;
    let ref_s = t0.elapsed().as_secs_f64() - gpu_s;
    let naive = varlen_naive(vl, p).map_err(ctx)?;
    let err = max_abs_diff(&o, &o_ref)?;
    let naive_err = max_abs_diff(&naive, &o_ref)?;
    let floor = rounding_floor(vl.q.dtype(), max_abs(&o_ref)?);
    let bound = 2.0 * naive_err + floor;
    let lerr = lse_err(&lse, &lse_ref)?;
    let summary = format!(
        "{what}: err {err:.2e} (naive {naive_err:.2e}, bound {bound:.2e}) lse {lerr:.1e} \
         [gpu {gpu_s:.2}s, cpu ref {ref_s:.2}s]"
    );
    assert!(err <= bound, "{summary}: error above the bound");
    assert!(lerr <= 2e-3, "{summary}: lse error above 2e-3");
    for (i, &(sq, sk)) in vl.lens.iter().enumerate() {
        if sk == 0 && sq > 0 {
            let rows = o.narrow(0, vl.cu_q[i] as usize, sq)?;
            let m = max_abs(&rows)?;
            assert_eq!(
                m, 0.0,
                "{summary}: sequence {i} has no key: its rows must be zeros"
            );
        }
    }
    if let Some(run_o) = run_o {
        let o2 = run_o(p).map_err(ctx)?.to_device(&Device::Cpu)?;
        assert_eq!(
            non_finite(&o2)?,
            0,
            "{what}: attention_varlen: non-finite output"
        );
        let e2 = max_abs_diff(&o2, &o_ref)?;
        assert!(e2 <= bound, "{summary}: attention_varlen error {e2:.2e}");
    }
    println!("[OK] {summary}");
    Ok(err)
}

/// The tolerance rule on one dense problem against the float64 reference (`(batch, heads_q)`
/// slopes: per batch entry), LSE included. Prints the one-line summary with the kernel picked.
fn check_dense(what: &str, q: &Tensor, k: &Tensor, v: &Tensor, p: &AttnParams) -> Result<f64> {
    let what = format!("{what} {}", opts_name(p));
    let ctx = |e: Error| Error::Msg(format!("{what}: {e}"));
    let kernel = match q.device() {
        Device::Cuda(d) => {
            flashcore::cuda::describe(d, p, q, k, v).unwrap_or_else(|e| format!("(describe: {e})"))
        }
        _ => "cpu".into(),
    };
    let (o, lse) = attention_with_lse(q, k, v, p).map_err(ctx)?;
    // q's shape with v's head dim.
    let mut want_dims = q.dims().to_vec();
    want_dims[3] = v.dim(3)?;
    assert_eq!(o.dims(), want_dims.as_slice(), "{what}: output shape");
    let o = o.to_device(&Device::Cpu)?;
    let lse = lse.to_device(&Device::Cpu)?;
    let bad = non_finite(&o)?;
    assert_eq!(
        bad, 0,
        "{what}: {bad} non-finite (unwritten or NaN) output elements"
    );
    let (o_ref, lse_ref) = per_batch(q, k, v, p, |q, k, v, p| {
        let (o, l) = reference_f64(q, k, v, p)?;
        Ok((o, Some(l)))
    })?;
    let (naive, _) = per_batch(q, k, v, p, |q, k, v, p| {
        Ok((attention_slow(q, k, v, p)?, None))
    })
    .map_err(ctx)?;
    let err = max_abs_diff(&o, &o_ref)?;
    let naive_err = max_abs_diff(&naive, &o_ref)?;
    let floor = rounding_floor(q.dtype(), max_abs(&o_ref)?);
    let bound = 2.0 * naive_err + floor;
    let lerr = lse_err(&lse, &lse_ref.expect("reference LSE"))?;
    let summary = format!(
        "{what}: err {err:.2e} (naive {naive_err:.2e}, bound {bound:.2e}) lse {lerr:.1e} {kernel}"
    );
    assert!(err <= bound, "{summary}: error above the bound");
    assert!(lerr <= 2e-3, "{summary}: lse error above 2e-3");
    println!("[OK] {summary}");
    Ok(err)
}

/// Packed batches covering empty sequences on either side, 1, 113, 1023 and 4224, chunked
/// prefill (seq_k >= seq_q), seq_q > seq_k (causal: rows without keys), 64 small sequences;
/// every mask, both dtypes; GQA 1/4/8, head dims, softcap and both ALiBi slope shapes rotate.
/// The long batch (4224 x 4224) runs twice only, with few heads.
#[test]
fn varlen_sweep() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    arch_under_test();
    let mut rng = Rng::from_clock("varlen_sweep");
    let many: Vec<(usize, usize)> = (0..64)
        .map(|i| match i % 9 {
            0 => (0, 1 + rng.below(64)),
            1 => (1 + rng.below(64), 0),
            2 => (1, 1),
            _ => (1 + rng.below(64), 1 + rng.below(128)),
        })
        .collect();
    let batches: Vec<(&str, Vec<(usize, usize)>)> = vec![
        (
            "mixed",
            vec![
                (0, 5),
                (5, 0),
                (1, 1),
                (113, 113),
                (1, 300),
                (37, 1023),
                (16, 16),
                (0, 0),
                (200, 64),
            ],
        ),
        (
            "chunked-prefill",
            vec![
                (64, 1024),
                (113, 4224),
                (1, 77),
                (255, 511),
                (7, 7),
                (128, 128),
            ],
        ),
        (
            "q-longer-than-k",
            vec![(300, 100), (50, 10), (10, 0), (1, 0), (64, 64), (17, 1)],
        ),
        ("64-small", many),
    ];
    let heads = [(4, 4), (8, 2), (8, 1)];
    let dims = [64, 128, 256, 96];
    let mut n = 0;
    for (name, lens) in &batches {
        for dtype in [DType::BF16, DType::F16] {
            for mask in MASKS {
                let (hq, hkv) = heads[n % 3];
                let d = dims[n % 4];
                let p = options(&dev, n, mask, lens.len(), hq)?;
                let vl = Varlen::random(lens, hq, hkv, d, dtype, n % 2 == 1, &dev)?;
                check_varlen(name, &vl, &p, n % 3 == 0)?;
                n += 1;
            }
        }
    }
    let long = [(1023, 1023), (4224, 4224), (0, 1), (1, 4224)];
    for (dtype, (hq, hkv), mask, alibi) in [
        (DType::BF16, (8, 1), Mask::Causal, None),
        (DType::F16, (4, 4), Mask::None, Some(None)),
        (DType::BF16, (8, 2), MASKS[3], Some(Some(long.len()))),
    ] {
        let vl = Varlen::random(&long, hq, hkv, 64, dtype, false, &dev)?;
        let p = AttnParams {
            mask,
            alibi_slopes: alibi.map(|a| slopes(&dev, a, hq)).transpose()?,
            ..Default::default()
        };
        check_varlen("long", &vl, &p, true)?;
        n += 1;
    }
    println!("varlen_sweep: {n} cases passed");
    Ok(())
}

/// Short queries (every seq_q_i <= 16: the split-KV decode path): 64 single-token sequences over
/// caches of 0 to 4224 keys, speculative-decoding batches (1 to 16 queries, some sequences with
/// fewer keys than queries or none), a tiny batch; every mask, both dtypes, GQA 1/4/8, softcap
/// and both ALiBi slope shapes; one case passes max_seqlen_q 16 for single-token sequences.
#[test]
fn varlen_decode() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    arch_under_test();
    let mut rng = Rng::from_clock("varlen_decode");
    let single: Vec<(usize, usize)> = (0..64)
        .map(|i| match i {
            0 => (1, 0),
            1 => (1, 1),
            2 => (1, 4224),
            3 => (0, 17),
            _ => (1, 1 + rng.below(3000)),
        })
        .collect();
    let spec: Vec<(usize, usize)> = (0..24)
        .map(|i| match i {
            0 => (16, 5),
            1 => (4, 0),
            2 => (0, 300),
            3 => (16, 4224),
            _ => {
                let sq = 1 + rng.below(16);
                (sq, sq + rng.below(2000))
            }
        })
        .collect();
    let tiny = vec![(1, 1), (16, 16), (0, 4), (3, 0), (2, 113)];
    let heads = [(8, 8), (32, 8), (8, 1)];
    let dims = [64, 128, 256, 128];
    let mut n = 0;
    for (name, lens) in [
        ("decode-64", &single),
        ("spec-decode", &spec),
        ("tiny", &tiny),
    ] {
        for dtype in [DType::BF16, DType::F16] {
            for mask in MASKS {
                let (hq, hkv) = heads[n % 3];
                let d = dims[(n / 3) % 4];
                let p = options(&dev, n, mask, lens.len(), hq)?;
                let vl = Varlen::random(lens, hq, hkv, d, dtype, false, &dev)?;
                assert!(vl.max_q <= 16);
                check_varlen(name, &vl, &p, n % 4 == 0)?;
                n += 1;
            }
        }
    }
    let mut vl = Varlen::random(&single, 8, 2, 128, DType::BF16, false, &dev)?;
    vl.max_q = 16;
    check_varlen(
        "decode-64 max_seqlen_q 16",
        &vl,
        &options(&dev, 0, Mask::Causal, 64, 8)?,
        false,
    )?;
    println!("varlen_decode: {} cases passed", n + 1);
    Ok(())
}

/// Random packed batches (FLASHCORE_RANDOM_CASES / 5, default 20): 1 to 64 sequences, half of
/// the batches decode-shaped (seq_q <= 16), lengths 0..=4224 (mostly short, at most one long
/// sequence), any GQA ratio, any head dim multiple of 8, random windows, softcap, ALiBi; the
/// work of each case is capped so that the CPU reference stays fast.
#[test]
fn varlen_random() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    arch_under_test();
    let count = random_cases().div_ceil(5);
    let mut rng = Rng::from_clock("varlen_random");
    for i in 0..count {
        let n = 1 + rng.below(64);
        let decode = rng.below(2) == 0;
        let long_at = if rng.below(3) == 0 {
            Some(rng.below(n))
        } else {
            None
        };
        let mut lens: Vec<(usize, usize)> = (0..n)
            .map(|s| {
                let max = if Some(s) == long_at { 4225 } else { 301 };
                let len = |rng: &mut Rng, cap: usize| match rng.below(10) {
                    0 => 0,
                    1 => 1,
                    _ => rng.below(cap),
                };
                let sq = len(&mut rng, if decode { 17 } else { max });
                (sq, len(&mut rng, max))
            })
            .collect();
        if lens.iter().all(|l| l.0 == 0) {
            lens[0].0 = 1;
        }
        if lens.iter().all(|l| l.1 == 0) {
            lens[0].1 = 1;
        }
        let hkv = [1, 2, 8][rng.below(3)];
        let hq = hkv * [1, 4, 8][rng.below(3)];
        let d = 8 * (1 + rng.below(32));
        // cap the work (and so the CPU reference time): halve the largest sequence
        let cap = 1usize << 30;
        while lens.iter().map(|&(a, b)| a * b).sum::<usize>() * hq * d > cap {
            let big = (0..n).max_by_key(|&s| lens[s].0 * lens[s].1).unwrap();
            let (sq, sk) = lens[big];
            lens[big] = if sq > 16 { (sq / 2, sk) } else { (sq, sk / 2) };
        }
        let mask = [
            Mask::None,
            Mask::Causal,
            Mask::Window {
                left: Some(rng.below(300)),
                right: Some(rng.below(40)),
            },
            Mask::Window {
                left: None,
                right: Some(rng.below(8)),
            },
        ][rng.below(4)];
        let dtype = [DType::BF16, DType::F16][rng.below(2)];
        let p = options(&dev, rng.below(5), mask, n, hq)?;
        let vl = Varlen::random(&lens, hq, hkv, d, dtype, rng.below(2) == 0, &dev)?;
        check_varlen(&format!("random {i}"), &vl, &p, false)?;
    }
    println!("varlen_random: {count} cases passed");
    Ok(())
}

/// Every head dim that is a multiple of 8 in 8..=256 runs on the GPU, f16 and bf16: dense
/// prefill (b2 sq77 sk130 causal h4/2), dense decode (b2 sq1 sk300 h8/1) and one varlen batch
/// (causal or window 100/20 alternating).
#[test]
fn head_dims_every_multiple_of_8() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    arch_under_test();
    let mut n = 0;
    let lens = [(0, 3), (77, 130), (1, 300), (16, 16), (5, 0), (40, 9)];
    for d in (8..=256).step_by(8) {
        for dtype in [DType::BF16, DType::F16] {
            let strided = n % 2 == 1;
            let (q, k, v) = qkv(2, 77, 130, 4, 2, d, dtype, strided, &dev)?;
            let p = AttnParams {
                mask: Mask::Causal,
                ..Default::default()
            };
            let what = format!("dense {dtype:?} b2 sq77 sk130 h4/2 d{d} strided={strided}");
            check_dense(&what, &q, &k, &v, &p)?;
            let (q, k, v) = qkv(2, 1, 300, 8, 1, d, dtype, strided, &dev)?;
            let what = format!("dense decode {dtype:?} b2 sq1 sk300 h8/1 d{d} strided={strided}");
            check_dense(&what, &q, &k, &v, &AttnParams::default())?;
            n += 2;
        }
        let dtype = if d % 16 == 0 { DType::BF16 } else { DType::F16 };
        let mask = if d % 16 == 0 { Mask::Causal } else { MASKS[3] };
        let vl = Varlen::random(&lens, 4, 2, d, dtype, false, &dev)?;
        let p = AttnParams {
            mask,
            ..Default::default()
        };
        check_varlen("head dims", &vl, &p, false)?;
        n += 1;
    }
    println!("head_dims_every_multiple_of_8: {n} cases passed");
    Ok(())
}

/// ALiBi on the GPU, dense: prefill and decode (seq_q <= 16) shapes, `(heads_q,)` and
/// `(batch, heads_q)` slopes, with and without softcap 30, masks rotating; both dtypes.
#[test]
fn alibi_on_the_gpu() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    arch_under_test();
    let shapes = [
        (2, 200, 333, 8, 2, 64),
        (2, 1023, 1023, 4, 4, 128),
        (1, 77, 4224, 8, 1, 64),
        (2, 16, 16, 8, 8, 256),
        (3, 1, 2000, 8, 1, 128),
        (2, 4, 777, 32, 8, 64),
        (2, 16, 3000, 8, 2, 256),
    ];
    let mut n = 0;
    for (b, sq, sk, hq, hkv, d) in shapes {
        for per_batch_slopes in [false, true] {
            for softcap in [None, Some(30.0)] {
                let dtype = if n % 2 == 0 { DType::BF16 } else { DType::F16 };
                let mask = MASKS[n % 4];
                let strided = n % 3 == 0;
                let (q, k, v) = qkv(b, sq, sk, hq, hkv, d, dtype, strided, &dev)?;
                let p = AttnParams {
                    mask,
                    softcap,
                    alibi_slopes: Some(slopes(&dev, per_batch_slopes.then_some(b), hq)?),
                    ..Default::default()
                };
                let what = format!(
                    "alibi {dtype:?} b{b} sq{sq} sk{sk} h{hq}/{hkv} d{d} strided={strided}"
                );
                check_dense(&what, &q, &k, &v, &p)?;
                n += 1;
            }
        }
    }
    println!("alibi_on_the_gpu: {n} cases passed");
    Ok(())
}

/// A lie: its name, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k.
type Lie = (&'static str, Vec<u32>, Vec<u32>, usize, usize);

/// Prefix sums that lie must never crash, read out of bounds or return finite garbage: the
/// whole output (O and LSE) is NaN, or the call fails. Covers non-monotone, first != 0,
/// last != total (above and below, far above), a length above max_seqlen_q / max_seqlen_k, a
/// u32::MAX entry; prefill- and decode-shaped batches, both dtypes, with and without options.
/// Runs with output poisoning off (the NaN must come from the seqlens check, not the poison);
/// afterwards the GPU must still compute a normal problem correctly.
#[test]
fn lying_seqlens_give_nan() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    arch_under_test();
    set_poison_outputs(false);
    let prefill = vec![(40, 90), (0, 3), (120, 120), (1, 30), (70, 20)];
    let decode = vec![(1, 90), (0, 3), (16, 120), (1, 30), (4, 20)];
    let mut n = 0;
    let mut outcome = Ok(());
    // split-KV decode (longer keys): the combine checks the prefix sums itself
    let split = vec![(1, 3000), (0, 3), (1, 1200), (1, 30), (1, 2000)];
    for (shape, lens) in [
        ("prefill", &prefill),
        ("decode", &decode),
        ("split decode", &split),
    ] {
        for (dtype, opts) in [(DType::BF16, 0), (DType::F16, 4)] {
            let vl = Varlen::random(lens, 8, 2, 64, dtype, false, &dev)?;
            let p = options(&dev, opts, Mask::Causal, lens.len(), 8)?;
            let (cq, ck) = (vl.cu_q.clone(), vl.cu_k.clone());
            let (tq, tk) = (vl.total_q() as u32, vl.total_k() as u32);
            let with = |v: &[u32], at: usize, x: u32| {
                let mut v = v.to_vec();
                v[at] = x;
                v
            };
            let swap = |v: &[u32]| {
                let mut v = v.to_vec();
                v.swap(1, 3);
                v
            };
            let lies: Vec<Lie> = vec![
                (
                    "cu_q not monotone",
                    swap(&cq),
                    ck.clone(),
                    vl.max_q,
                    vl.max_k,
                ),
                (
                    "cu_k not monotone",
                    cq.clone(),
                    swap(&ck),
                    vl.max_q,
                    vl.max_k,
                ),
                (
                    "cu_q[0] = 1",
                    with(&cq, 0, 1),
                    ck.clone(),
                    vl.max_q,
                    vl.max_k,
                ),
                (
                    "cu_k[0] = 2",
                    cq.clone(),
                    with(&ck, 0, 2),
                    vl.max_q,
                    vl.max_k,
                ),
                (
                    "cu_q last = total_q + 100",
                    with(&cq, 5, tq + 100),
                    ck.clone(),
                    4096,
                    vl.max_k,
                ),
                (
                    "cu_q last = total_q - 1",
                    with(&cq, 5, tq - 1),
                    ck.clone(),
                    vl.max_q,
                    vl.max_k,
                ),
                (
                    "cu_k last = total_k + 100000",
                    cq.clone(),
                    with(&ck, 5, tk + 100_000),
                    vl.max_q,
                    1 << 20,
                ),
                (
                    "cu_k last = total_k - 1",
                    cq.clone(),
                    with(&ck, 5, tk - 1),
                    vl.max_q,
                    vl.max_k,
                ),
                (
                    "a seq_q > max_seqlen_q",
                    cq.clone(),
                    ck.clone(),
                    vl.max_q - 1,
                    vl.max_k,
                ),
                (
                    "a seq_k > max_seqlen_k",
                    cq.clone(),
                    ck.clone(),
                    vl.max_q,
                    vl.max_k - 1,
                ),
                (
                    "cu_k[2] = u32::MAX",
                    cq.clone(),
                    with(&ck, 2, u32::MAX),
                    vl.max_q,
                    vl.max_k,
                ),
                (
                    "cu_q[3] = u32::MAX",
                    with(&cq, 3, u32::MAX),
                    ck.clone(),
                    vl.max_q,
                    vl.max_k,
                ),
            ];
            for (lie, cu_q, cu_k, max_q, max_k) in lies {
                let what = format!("{shape} {} {}: {lie}", vl.shape_name(), opts_name(&p));
                let cu_q = Tensor::new(cu_q.as_slice(), &dev)?;
                let cu_k = Tensor::new(cu_k.as_slice(), &dev)?;
                let r = flashcore::attention_varlen_with_lse(
                    &vl.q, &vl.k, &vl.v, &cu_q, &cu_k, max_q, max_k, &p,
                );
                let verdict = match r {
                    Err(e) => format!("Err: {e}"),
                    Ok((o, lse)) => {
                        let count = |t: &Tensor| -> Result<(usize, usize)> {
                            let v = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                            Ok((v.iter().filter(|x| x.is_nan()).count(), v.len()))
                        };
                        let (on, ot) = count(&o)?;
                        let (ln, lt) = count(&lse)?;
                        if on != ot || ln != lt {
                            outcome = Err(Error::Msg(format!(
                                "{what}: O has {on} NaN of {ot}, LSE {ln} of {lt}: not all NaN"
                            )));
                            println!("[FAIL] {what}: O {on}/{ot} NaN, LSE {ln}/{lt} NaN");
                            continue;
                        }
                        "all NaN".to_string()
                    }
                };
                if n % 6 == 0 {
                    // the LSE-less entry point too
                    if let Ok(o) = flashcore::attention_varlen(
                        &vl.q, &vl.k, &vl.v, &cu_q, &cu_k, max_q, max_k, &p,
                    ) {
                        let v = o.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                        let nan = v.iter().filter(|x| x.is_nan()).count();
                        if nan != v.len() {
                            outcome = Err(Error::Msg(format!(
                                "{what}: attention_varlen: {nan} NaN of {}",
                                v.len()
                            )));
                        }
                    }
                }
                println!("[OK] {what}: {verdict}");
                n += 1;
            }
            // the device is still usable: the honest problem right after
            arch_under_test();
            check_varlen(&format!("{shape} after lies"), &vl, &p, true)?;
            set_poison_outputs(false);
        }
    }
    arch_under_test();
    outcome?;
    println!("lying_seqlens_give_nan: {n} lies gave NaN or an error");
    Ok(())
}

/// Argument errors that involve the device: prefix sums or slopes on the CPU with q on the GPU,
/// prefix sums of another dtype, f32 inputs (no GPU kernel), a wrong slope shape; each an
/// `Err` naming the argument. Then a normal call still works.
#[test]
fn varlen_gpu_argument_errors() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    arch_under_test();
    let cpu = Device::Cpu;
    let lens = [(3, 5), (0, 2), (4, 4)];
    let vl = Varlen::random(&lens, 4, 2, 64, DType::BF16, false, &dev)?;
    let d = AttnParams::default();
    let run = |q: &Tensor, k: &Tensor, v: &Tensor, cq: &Tensor, ck: &Tensor, p: &AttnParams| {
        match flashcore::attention_varlen_with_lse(q, k, v, cq, ck, vl.max_q, vl.max_k, p) {
            Ok(_) => "<no error>".to_string(),
            Err(e) => e.to_string(),
        }
    };
    let (q, k, v) = (&vl.q, &vl.k, &vl.v);
    let (cq, ck) = (&vl.cu_q_t, &vl.cu_k_t);
    let vl32 = vl.to(&dev, DType::F32)?;
    let with_slopes = |t: Tensor| AttnParams {
        alibi_slopes: Some(t),
        ..Default::default()
    };
    let cases: Vec<(&str, String, &[&str])> = vec![
        (
            "cu_seqlens_q on the CPU",
            run(q, k, v, &cq.to_device(&cpu)?, ck, &d),
            &["cu_seqlens_q"],
        ),
        (
            "cu_seqlens_k on the CPU",
            run(q, k, v, cq, &ck.to_device(&cpu)?, &d),
            &["cu_seqlens_k"],
        ),
        (
            "cu_seqlens_q i64",
            run(q, k, v, &cq.to_dtype(DType::I64)?, ck, &d),
            &["cu_seqlens_q"],
        ),
        (
            "cu_seqlens_k f32",
            run(q, k, v, cq, &ck.to_dtype(DType::F32)?, &d),
            &["cu_seqlens_k"],
        ),
        (
            "cu_seqlens_k batch differs",
            run(q, k, v, cq, &ck.narrow(0, 0, 3)?, &d),
            &["cu_seqlens_k"],
        ),
        ("q rank 4", run(&q.unsqueeze(0)?, k, v, cq, ck, &d), &["q"]),
        (
            "f32 on the GPU",
            run(&vl32.q, &vl32.k, &vl32.v, cq, ck, &d),
            &["F32", "f32"],
        ),
        (
            "alibi_slopes on the CPU",
            run(
                q,
                k,
                v,
                cq,
                ck,
                &with_slopes(Tensor::ones(4, DType::F32, &cpu)?),
            ),
            &["alibi_slopes"],
        ),
        (
            "alibi_slopes (batch + 1, heads_q)",
            run(
                q,
                k,
                v,
                cq,
                ck,
                &with_slopes(Tensor::ones((4, 4), DType::F32, &dev)?),
            ),
            &["alibi_slopes"],
        ),
        (
            "alibi_slopes (heads_q - 1,)",
            run(
                q,
                k,
                v,
                cq,
                ck,
                &with_slopes(Tensor::ones(3, DType::F32, &dev)?),
            ),
            &["alibi_slopes"],
        ),
    ];
    for (case, got, want) in cases {
        assert!(
            got.starts_with("flashcore: ") && want.iter().any(|w| got.contains(w)),
            "{case}: error message\n  {got}\nshould start with `flashcore: ` and name one of {want:?}"
        );
        println!("[OK] {case}: {got}");
    }
    let p = AttnParams {
        mask: Mask::Causal,
        alibi_slopes: Some(slopes(&dev, Some(lens.len()), 4)?),
        ..Default::default()
    };
    check_varlen("after errors", &vl, &p, true)?;
    Ok(())
}

/// Grids past CUDA's 65535 limit on grid y/z: 70000 batch entries x 1 head, and 1 batch entry x
/// 70000 heads (GQA 70000/7000), prefill-shaped (seq 20) and decode-shaped (seq_q 1), bf16, d64,
/// causal; the sm80 kernels fold the grid, sm90 walks it. Truth: the CPU path on f32 copies of
/// the inputs (one call); the naive composition is `attention_slow` on the GPU.
#[test]
fn grids_beyond_65535() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    arch_under_test();
    let p = AttnParams {
        mask: Mask::Causal,
        ..Default::default()
    };
    for (b, hq, hkv, sq, sk) in [
        (70000, 1, 1, 20, 20),
        (70000, 1, 1, 1, 37),
        (1, 70000, 7000, 20, 20),
        (1, 70000, 7000, 1, 37),
    ] {
        let what = format!("b{b} h{hq}/{hkv} sq{sq} sk{sk} d64 bf16 causal");
        let ctx = |e: Error| Error::Msg(format!("{what}: {e}"));
        let q = (Tensor::randn(0f32, 1., (b, sq, hq, 64), &dev)?).to_dtype(DType::BF16)?;
        let k = (Tensor::randn(0f32, 1., (b, sk, hkv, 64), &dev)?).to_dtype(DType::BF16)?;
        let v = (Tensor::randn(0f32, 1., (b, sk, hkv, 64), &dev)?).to_dtype(DType::BF16)?;
        let kernel = match &dev {
            Device::Cuda(d) => flashcore::cuda::describe(d, &p, &q, &k, &v)
                .unwrap_or_else(|e| format!("(describe: {e})")),
            _ => unreachable!(),
        };
        let (o, lse) = attention_with_lse(&q, &k, &v, &p).map_err(ctx)?;
        let o = o.to_device(&Device::Cpu)?;
        let bad = non_finite(&o)?;
        assert_eq!(bad, 0, "{what}: {bad} non-finite output elements");
        let f = |t: &Tensor| t.to_device(&Device::Cpu)?.to_dtype(DType::F32);
        let (o_ref, lse_ref) = attention_with_lse(&f(&q)?, &f(&k)?, &f(&v)?, &p)?;
        let naive = attention_slow(&q, &k, &v, &p)?.to_device(&Device::Cpu)?;
        let err = max_abs_diff(&o, &o_ref)?;
        let naive_err = max_abs_diff(&naive, &o_ref)?;
        let bound = 2.0 * naive_err + rounding_floor(DType::BF16, max_abs(&o_ref)?);
        let lerr = lse_err(&lse.to_device(&Device::Cpu)?, &lse_ref)?;
        let summary =
            format!("{what}: err {err:.2e} (naive {naive_err:.2e}, bound {bound:.2e}) lse {lerr:.1e} {kernel}");
        assert!(err <= bound, "{summary}: error above the bound");
        assert!(lerr <= 2e-3, "{summary}: lse error above 2e-3");
        println!("[OK] {summary}");
    }
    Ok(())
}

/// `vl` in a paged pool of `page_size`-row pages in shuffled order; when the first two sequences
/// have at least two pages of keys, they share their first two pages (the keys made equal
/// first). Returns the (possibly changed) batch, the pool and the number of shared pages.
fn paged_sharing(vl: Varlen, page_size: usize, rng: &mut Rng) -> Result<(Varlen, Paged, usize)> {
    let lens = &vl.lens;
    let shared = if lens[0].1 >= 2 * page_size && lens[1].1 >= 2 * page_size {
        2
    } else {
        0
    };
    let vl = if shared > 0 {
        vl.share_prefix(shared * page_size)?
    } else {
        vl
    };
    let pg = Paged::from_varlen(&vl, page_size, shared, rng)?;
    Ok((vl, pg, shared))
}

/// Paged caches on the GPU: decode (split-KV through the page table) and prefill / chunked
/// prefill (sm90: through the page table for power-of-two pages, else pages gathered, then the
/// prefill kernels), against the CPU reference of the same
/// keys packed. Shuffled pages, a prefix shared between two sequences, last pages partly filled
/// (their unused rows NaN), unused table entries far outside the pool; page sizes 16, 64, 256 and
/// an odd 48; sequences of 0 to 32k keys; GQA 1/4/8; every mask, softcap and both ALiBi shapes
/// rotating; both dtypes; packed and dense queries.
#[test]
fn paged_attention() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    arch_under_test();
    let mut rng = Rng::from_clock("paged_attention");
    let decode: Vec<(usize, usize)> = (0..24)
        .map(|i| match i {
            0 => (1, 0),
            1 => (1, 1),
            2 => (1, 4224),
            3 => (1, 32768),
            _ => (1, 1 + rng.below(3000)),
        })
        .collect();
    let spec: Vec<(usize, usize)> = (0..8)
        .map(|i| {
            if i == 0 {
                (16, 300)
            } else {
                let s = 1 + rng.below(16);
                (s, s + rng.below(1500))
            }
        })
        .collect();
    let chunked = vec![(113, 1023), (0, 64), (512, 4224), (1, 1), (64, 64)];
    let heads = [(8, 8), (32, 8), (8, 1)];
    let dims = [128, 64, 256, 96];
    let mut n = 0;
    for (name, lens, dense_q) in [
        ("paged-decode", &decode, true),
        ("paged-spec", &spec, false),
        ("paged-chunked", &chunked, false),
    ] {
        for (pi, page_size) in [16usize, 64, 256, 48].into_iter().enumerate() {
            for dtype in [DType::BF16, DType::F16] {
                let mask = MASKS[(n + pi) % 4];
                let (hq, hkv) = heads[n % 3];
                let d = dims[(n / 3) % 4];
                let p = options(&dev, n, mask, lens.len(), hq)?;
                let vl = Varlen::random(lens, hq, hkv, d, dtype, n % 2 == 1, &dev)?;
                let (vl, pg, shared) = paged_sharing(vl, page_size, &mut rng)?;
                let tag = format!(
                    "{name} page {page_size}{}",
                    if shared > 0 { " shared" } else { "" }
                );
                let plain = |p: &AttnParams| pg.run_varlen(&vl, p).map(|r| r.0);
                check_packed(&tag, &vl, &p, &|p| pg.run_varlen(&vl, p), Some(&plain))?;
                if dense_q {
                    check_packed(
                        &format!("{tag} dense q"),
                        &vl,
                        &p,
                        &|p| pg.run_dense(&vl, p),
                        None,
                    )?;
                }
                n += 1;
            }
        }
    }
    println!("paged_attention: {n} cases passed");
    Ok(())
}

/// Decode batches of very unequal lengths (2..32 sequences; one query row each), where the
/// split kernel balances its splits over the lengths (`balanced_tps`, kernels/sm80/decode.cuh):
/// a long sequence takes many splits, short ones one, empty ones none. Packed keys and paged
/// caches (pages of 64, shuffled; and pages of 16, which split evenly, their empty splits
/// exiting early), no mask and causal (one row: the no-mask kernel), GQA 1/4/8, both dtypes,
/// the option sets rotating; and a batch of equal lengths (the host's even partition).
#[test]
fn decode_balanced_splits() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    arch_under_test();
    let mut rng = Rng::from_clock("decode_balanced_splits");
    let skewed: Vec<(usize, usize)> = [32768, 1, 0, 5000, 300, 17000, 2, 9000]
        .iter()
        .map(|&k| (1, k))
        .collect();
    let random: Vec<(usize, usize)> = (0..2 + rng.below(31))
        .map(|_| {
            (
                1,
                [0, 1, 1 + rng.below(600), 1 + rng.below(20000)][rng.below(4)],
            )
        })
        .collect();
    let two = vec![(1, 30000), (1, 700)];
    let equal = vec![(1, 3000); 6];
    let heads = [(32, 8), (8, 1), (16, 4), (8, 8)];
    let mut n = 0;
    for (name, lens) in [
        ("skewed", &skewed),
        ("random", &random),
        ("two", &two),
        ("equal", &equal),
    ] {
        for (i, mask) in [Mask::None, Mask::Causal].into_iter().enumerate() {
            let dtype = [DType::BF16, DType::F16][(n + i) % 2];
            let (hq, hkv) = heads[n % 4];
            let d = [128, 64, 256][n % 3];
            let p = options(&dev, n, mask, lens.len(), hq)?;
            let vl = Varlen::random(lens, hq, hkv, d, dtype, n % 2 == 1, &dev)?;
            check_varlen(&format!("balanced {name} varlen"), &vl, &p, false)?;
            for page_size in [16, 64] {
                let pg = Paged::from_varlen(&vl, page_size, 0, &mut rng)?;
                check_packed(
                    &format!("balanced {name} page {page_size}"),
                    &vl,
                    &p,
                    &|p| pg.run_varlen(&vl, p),
                    None,
                )?;
            }
            n += 1;
        }
    }
    println!("decode_balanced_splits: {n} batches passed");
    Ok(())
}

/// Decode grids of more than one wave whose CTAs per SM the dispatcher caps below what their
/// shared memory allows (sm_90; `decode_capped_smem` in src/plan/decode.rs): the same kernels with
/// more shared memory reserved, so more CTAs run one after another on each SM. Dense caches
/// (d128 at 48 sequences: one CTA per SM; d64 at 64: two), packed lengths and paged pools of 256
/// rows (one CTA per SM) and of 64 (left at two: pages shorter than two key tiles). The route
/// is asserted on the H100 (sm_90 at 3.35 TB/s) unless `FLASHCORE_DECODE_OCCUPANCY=full`;
/// elsewhere the same cases run with whatever cap the GPU gets. These one-split grids also
/// launch in clusters of two CTAs on every sm_90 (`decode_cluster`), unless
/// `FLASHCORE_DECODE_CLUSTER=1`; a one-sequence decode (a split grid) launches without.
#[test]
fn decode_grids_capped_per_sm() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    arch_under_test();
    let Device::Cuda(cuda) = &dev else {
        unreachable!()
    };
    // the caps below are the H100's (3.35 TB/s); faster DRAM keeps more CTAs per SM
    let info = flashcore::cuda::device_info(cuda)?;
    let capping = info.major == 9
        && info.dram_bytes_per_s > 3e12
        && info.dram_bytes_per_s < 3.5e12
        && std::env::var("FLASHCORE_DECODE_OCCUPANCY").as_deref() != Ok("full");
    let clustering =
        info.major == 9 && std::env::var("FLASHCORE_DECODE_CLUSTER").as_deref() != Ok("1");
    let expect = |what: &str, route: &str, per: Option<usize>| -> Result<()> {
        println!("{what}: {route}");
        if clustering && !route.contains("(clusters of 2)") {
            return Err(Error::Msg(format!(
                "{what}: route {route:?}, expected a one-split grid in clusters of 2 on sm_90"
            )));
        }
        if !capping {
            return Ok(());
        }
        let want = match per {
            Some(1) => Some("(at most 1 CTA per SM)".to_string()),
            Some(n) => Some(format!("(at most {n} CTAs per SM)")),
            None => None,
        };
        let ok = match &want {
            Some(w) => route.ends_with(w.as_str()),
            None => !route.contains("at most"),
        };
        if !ok {
            return Err(Error::Msg(format!(
                "{what}: route {route:?}, expected {}",
                want.as_deref().unwrap_or("no CTA cap")
            )));
        }
        Ok(())
    };
    let mut rng = Rng::from_clock("decode_grids_capped_per_sm");
    // dense caches: 48 x 8 K/V heads (384 CTAs of d128) and 64 x 8 (512 of d64)
    for (b, sk, d, dtype, per) in [
        (48, 777, 128, DType::BF16, 1),
        (64, 1000, 64, DType::F16, 2),
    ] {
        let (q, k, v) = qkv(b, 1, sk, 32, 8, d, dtype, false, &dev)?;
        let p = AttnParams::default();
        let what = format!("capped dense b{b} sk{sk} d{d}");
        expect(
            &what,
            &flashcore::cuda::describe(cuda, &p, &q, &k, &v)?,
            Some(per),
        )?;
        check_dense(&what, &q, &k, &v, &p)?;
    }
    // one sequence: a grid of key splits, no clusters and no cap
    {
        let (q, k, v) = qkv(1, 1, 4224, 32, 8, 128, DType::BF16, false, &dev)?;
        let p = AttnParams::default();
        let route = flashcore::cuda::describe(cuda, &p, &q, &k, &v)?;
        println!("split b1 sk4224: {route}");
        if route.contains("clusters") || route.contains("at most") {
            return Err(Error::Msg(format!(
                "split b1 sk4224: route {route:?}, expected no clusters and no CTA cap"
            )));
        }
        check_dense("split b1 sk4224", &q, &k, &v, &p)?;
    }
    // packed lengths (0 and 1 included) and paged pools, 48 sequences, d128 32/8
    let lens: Vec<(usize, usize)> = (0..48)
        .map(|i| match i {
            0 => (1, 0),
            1 => (1, 1),
            2 => (1, 4224),
            _ => (1, 1 + rng.below(2000)),
        })
        .collect();
    for (i, dtype) in [DType::BF16, DType::F16].into_iter().enumerate() {
        let p = options(&dev, i, Mask::None, lens.len(), 32)?;
        let vl = Varlen::random(&lens, 32, 8, 128, dtype, i == 1, &dev)?;
        check_varlen(&format!("capped varlen {dtype:?}"), &vl, &p, false)?;
        for (page_size, per) in [(256, Some(1)), (64, None)] {
            let pg = Paged::from_varlen(&vl, page_size, 0, &mut rng)?;
            let tag = format!("capped page {page_size} {dtype:?}");
            let q = vl.q.reshape((lens.len(), 1, 32, 128))?;
            let route = flashcore::cuda::describe_paged(
                cuda,
                &p,
                &q,
                &pg.k_pages,
                &pg.v_pages,
                &pg.page_table,
                &pg.seqlens_k,
                None,
            )?;
            expect(&tag, &route, per)?;
            check_packed(&tag, &vl, &p, &|p| pg.run_dense(&vl, p), None)?;
        }
    }
    Ok(())
}

/// Paged decodes from several host threads at once on one device. candle's `CudaDevice::new`
/// runs every host thread on its own per-thread default stream (one handle,
/// `CU_STREAM_PER_THREAD`, a different stream per thread), so the threads' kernels run at the
/// same time. flashcore's scratch (split-KV partials, the LSE nobody returns, the sm90 tile
/// counter) must then be per thread: when it was keyed by the stream handle alone,
/// the threads overwrote each other's partials and whole sequences came out wrong in every
/// run on the H100/H200 (docs/decisions.md#per-thread-scratch). Each thread's problem (its own
/// lengths, page size and head dim, so different split counts and scratch sizes) is first
/// checked against the CPU reference alone; then four threads repeat their calls, with and
/// without the LSE, and every output must equal the checked one bit for bit (the kernels are
/// deterministic; outputs are poisoned before each call, so an unwritten element shows as well
/// as a wrong one). `FC_THREADS_MODE=serial` (one thread at a time) and `mutex` (the threads
/// take turns, call and readback) are the controls.
#[test]
fn paged_decode_from_threads() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    arch_under_test();
    let mut rng = Rng::from_clock("paged_decode_from_threads");
    let bits = |t: &Tensor| -> Result<Vec<u32>> {
        let v = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        Ok(v.into_iter().map(f32::to_bits).collect())
    };
    let mut cases = Vec::new();
    for (t, (sk, page_size, d, hkv)) in [
        (4224usize, 64usize, 128usize, 8usize),
        (3000, 16, 128, 8),
        (8192, 256, 64, 4),
        (1500 + rng.below(1000), 48, 256, 2),
    ]
    .into_iter()
    .enumerate()
    {
        let lens = vec![(1, sk), (1, sk / 2 + t), (1, 1 + rng.below(sk))];
        let vl = Varlen::random(&lens, 4 * hkv, hkv, d, DType::BF16, t % 2 == 1, &dev)?;
        let (vl, pg, _) = paged_sharing(vl, page_size, &mut rng)?;
        let p = AttnParams::default();
        let tag = format!("threads case {t} page {page_size}");
        let plain = |p: &AttnParams| pg.run_varlen_o(&vl, p);
        check_packed(&tag, &vl, &p, &|p| pg.run_varlen(&vl, p), Some(&plain))?;
        let (o, lse) = pg.run_varlen(&vl, &p)?;
        cases.push((vl, pg, p, bits(&o)?, bits(&lse)?));
    }
    let mode = std::env::var("FC_THREADS_MODE").unwrap_or_default();
    let gate = std::sync::Mutex::new(());
    let gate = &gate;
    let mode = mode.as_str();
    std::thread::scope(|s| -> Result<()> {
        let handles: Vec<_> = cases
            .iter()
            .enumerate()
            .map(|(t, (vl, pg, p, o_want, lse_want))| {
                let h = s.spawn(move || -> Result<usize> {
                    let mut calls = 0;
                    for it in 0..60 {
                        let _g = (mode == "mutex").then(|| gate.lock().unwrap());
                        let o = if it % 2 == 0 {
                            let (o, lse) = pg.run_varlen(vl, p)?;
                            if bits(&lse)? != *lse_want {
                                candle_core::bail!("thread {t} call {it}: the LSE changed");
                            }
                            o
                        } else {
                            pg.run_varlen_o(vl, p)?
                        };
                        let got = bits(&o)?;
                        if got != *o_want {
                            let n = got.iter().zip(o_want.iter()).filter(|(a, b)| a != b).count();
                            candle_core::bail!(
                                "thread {t} call {it}: {n} of {} output elements differ from the checked run",
                                got.len()
                            );
                        }
                        calls += 1;
                    }
                    Ok(calls)
                });
                if mode == "serial" {
                    let r = h.join().expect("a decode thread panicked");
                    s.spawn(move || r)
                } else {
                    h
                }
            })
            .collect();
        let mut calls = 0;
        for h in handles {
            calls += h.join().expect("a decode thread panicked")?;
        }
        println!(
            "paged_decode_from_threads: {calls} calls from 4 threads, every output as checked"
        );
        Ok(())
    })
}

/// Prefill over a paged pool: on sm90 read by the kernels through the page table where
/// `Variant::page_box` allows (box by box, one box per lane of the TMA warp, the rows of the last
/// tile past each sequence's end zeroed in shared memory): d128 and d256 by the paged twins (one
/// 5-D box per page over all columns, pages of 16 to 256 here, every tile of both), the other
/// head dims by their kernels from pages of 32, gathered for pages of 16. The pools' unused rows
/// are NaN, so a box or a V row read wrongly shows.
/// Ragged lengths (1023, 4097), a shared prefix, sequences without queries or keys, GQA 1/4/8,
/// causal and no mask (the sm90 kernels' masks), d64 beyond 1k query rows (the 192-row causal
/// tile gathers instead), d96 / d160 (narrow twins), both dtypes. On sm80 (forced) the same
/// problems take the gather path.
#[test]
fn paged_prefill_through_the_page_table() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    arch_under_test();
    let mut rng = Rng::from_clock("paged_prefill");
    let lens = vec![
        (113, 1023),
        (512, 4097),
        (300, 300),
        (0, 64),
        (1, 1),
        (40, 0),
        (17, 129),
    ];
    let long_d64 = vec![(1100, 2500), (64, 700)];
    let equal_q = vec![(96, 1023), (96, 4097), (96, 96), (96, 300)];
    // past the short tiles' 1k / 2k query rows: d128 128x160 and d256 128x80
    let long_q = vec![(2100, 2500), (64, 700), (1, 33)];
    let cases = [
        (
            16usize,
            128usize,
            (32usize, 8usize),
            Mask::Causal,
            DType::BF16,
            &lens,
        ),
        (32, 64, (8, 8), Mask::None, DType::F16, &lens),
        (64, 128, (8, 1), Mask::None, DType::BF16, &lens),
        (64, 256, (32, 8), Mask::Causal, DType::F16, &lens),
        (256, 64, (32, 8), Mask::Causal, DType::BF16, &lens),
        (256, 96, (8, 8), Mask::Causal, DType::BF16, &lens),
        (128, 256, (8, 1), Mask::None, DType::BF16, &lens),
        (64, 64, (32, 8), Mask::Causal, DType::BF16, &long_d64),
        (64, 128, (32, 8), Mask::Causal, DType::BF16, &equal_q),
        (16, 64, (8, 8), Mask::None, DType::F16, &equal_q),
        (32, 128, (32, 8), Mask::Causal, DType::F16, &lens),
        (32, 96, (8, 8), Mask::Causal, DType::BF16, &lens),
        (32, 160, (8, 2), Mask::Causal, DType::BF16, &lens),
        (32, 256, (16, 16), Mask::Causal, DType::BF16, &lens),
        (32, 64, (32, 8), Mask::Causal, DType::F16, &long_d64),
        (16, 256, (8, 2), Mask::None, DType::F16, &lens),
        (16, 128, (8, 8), Mask::None, DType::BF16, &equal_q),
        (16, 128, (8, 2), Mask::None, DType::F16, &long_q),
        (16, 256, (8, 8), Mask::Causal, DType::BF16, &long_q),
        (128, 128, (16, 4), Mask::Causal, DType::BF16, &long_q),
    ];
    // on sm90 (not forced to sm80) d128 and d256 must take the paged twins in-kernel
    let Device::Cuda(cuda) = &dev else {
        unreachable!("gpu() is a CUDA device")
    };
    let twins = flashcore::cuda::device_info(cuda)?.major == 9
        && std::env::var("FLASHCORE_TEST_ARCH").map_or(true, |a| a != "sm80");
    for (page_size, d, (hq, hkv), mask, dtype, lens) in cases {
        let vl = Varlen::random(lens, hq, hkv, d, dtype, false, &dev)?;
        let (vl, pg, _) = paged_sharing(vl, page_size, &mut rng)?;
        let p = AttnParams {
            mask,
            ..Default::default()
        };
        let tag = format!("paged-prefill page {page_size}");
        let route = flashcore::cuda::describe_paged(
            cuda,
            &p,
            &vl.q,
            &pg.k_pages,
            &pg.v_pages,
            &pg.page_table,
            &pg.seqlens_k,
            Some((&vl.cu_q_t, vl.max_q)),
        )?;
        println!("{tag} d{d} {hq}/{hkv} {mask:?} {dtype:?}: {route}");
        if twins && (d == 128 || d == 256) && !route.contains("_pg (in-kernel") {
            return Err(Error::Msg(format!(
                "{tag} d{d}: expected a paged twin reading the pool in-kernel, got {route}"
            )));
        }
        let plain = |p: &AttnParams| pg.run_varlen(&vl, p).map(|r| r.0);
        check_packed(&tag, &vl, &p, &|p| pg.run_varlen(&vl, p), Some(&plain))?;
        if lens.iter().all(|l| l.0 == lens[0].0) {
            check_packed(
                &format!("{tag} dense q"),
                &vl,
                &p,
                &|p| pg.run_dense(&vl, p),
                None,
            )?;
        }
    }
    Ok(())
}

/// Pools that are strided views, as a cache holding more heads than one call reads or a
/// head-major store gives them: rows wider than the heads read (a pool narrowed to half its
/// heads: whole pages, the paged twins at d128 / d256 on sm90), head-major pages `(num_pages,
/// hkv, page_size, d)` seen transposed (pages not whole: the kernels' own boxes or the gather),
/// and a pool starting at a page offset. Pages of 16 and 64, d64 / d128 / d256, both masks.
#[test]
fn paged_prefill_strided_pools() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    arch_under_test();
    let Device::Cuda(cuda) = &dev else {
        unreachable!("gpu() is a CUDA device")
    };
    let twins = flashcore::cuda::device_info(cuda)?.major == 9
        && std::env::var("FLASHCORE_TEST_ARCH").map_or(true, |a| a != "sm80");
    let mut rng = Rng::from_clock("paged_strided");
    let lens = vec![(113, 1023), (300, 300), (1, 33), (40, 0), (130, 2100)];
    for (page_size, d, mask, dtype) in [
        (16usize, 128usize, Mask::Causal, DType::BF16),
        (64, 128, Mask::None, DType::F16),
        (16, 256, Mask::None, DType::BF16),
        (64, 256, Mask::Causal, DType::F16),
        (16, 64, Mask::Causal, DType::BF16),
    ] {
        let vl = Varlen::random(&lens, 16, 4, d, dtype, false, &dev)?;
        let pg = Paged::from_varlen(&vl, page_size, 0, &mut rng)?;
        let (np, ps, hkv, dd) = pg.k_pages.dims4()?;
        let wide = |t: &Tensor| -> Result<Tensor> {
            let junk = Tensor::full(f32::NAN, (np, ps, hkv, dd), &dev)?.to_dtype(dtype)?;
            Tensor::cat(&[t, &junk], 2)?.narrow(2, 0, hkv)
        };
        let head_major =
            |t: &Tensor| -> Result<Tensor> { t.transpose(1, 2)?.contiguous()?.transpose(1, 2) };
        let offset = |t: &Tensor| -> Result<Tensor> {
            let junk = Tensor::full(f32::NAN, (3, ps, hkv, dd), &dev)?.to_dtype(dtype)?;
            Tensor::cat(&[&junk, t], 0)?.narrow(0, 3, np)
        };
        type Layout<'a> = (&'a str, &'a dyn Fn(&Tensor) -> Result<Tensor>, bool);
        let layouts: [Layout; 3] = [
            ("rows wider than the heads", &wide, true),
            ("head-major pages", &head_major, false),
            ("pool at a page offset", &offset, true),
        ];
        for (layout, f, whole) in layouts {
            let mut g = pg.clone();
            g.k_pages = f(&pg.k_pages)?;
            g.v_pages = f(&pg.v_pages)?;
            let p = AttnParams {
                mask,
                ..Default::default()
            };
            let route = flashcore::cuda::describe_paged(
                cuda,
                &p,
                &vl.q,
                &g.k_pages,
                &g.v_pages,
                &g.page_table,
                &g.seqlens_k,
                Some((&vl.cu_q_t, vl.max_q)),
            )?;
            let tag = format!("paged-prefill page {page_size}, {layout}");
            println!("{tag} d{d} {mask:?} {dtype:?}: {route}");
            let twin = route.contains("_pg (in-kernel");
            if twins && d >= 128 && twin != whole {
                return Err(Error::Msg(format!(
                    "{tag} d{d}: a paged twin {} for this layout, got {route}",
                    if whole { "expected" } else { "not allowed" }
                )));
            }
            check_packed(&tag, &vl, &p, &|p| g.run_varlen(&vl, p), None)?;
        }
    }
    Ok(())
}

/// Tables that lie on the GPU: a page id outside the pool, a length beyond the table. The
/// kernels clamp (no out-of-bounds read), and the check (the check kernel, or the split-KV
/// combine) turns the lying sequence's rows of O and LSE into NaN; the other sequences' rows are
/// bit for bit those of the honest call. A normal problem afterwards is still right. Poisoning
/// off, so the NaN comes from the check.
#[test]
fn paged_lying_tables_give_nan() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    arch_under_test();
    set_poison_outputs(false);
    let mut rng = Rng::from_clock("paged_lies");
    let mut outcome = Ok(());
    // d64 pages of 16 (prefill: gathered) and 64 (sm90 prefill: read through the table
    // in-kernel), d128 / d256 pages of 16 and 32 (sm90 prefill: the paged twins); decodes with
    // split-KV (keys of 700: the combine checks the tables) and without (a table of 208 keys: one
    // split, the check kernel)
    for (shape, lens, page_size, d) in [
        ("decode", vec![(1, 90), (1, 3), (1, 700)], 16, 64),
        ("decode, one split", vec![(1, 90), (1, 3), (1, 200)], 16, 64),
        ("prefill", vec![(40, 90), (0, 3), (120, 700)], 16, 64),
        ("decode p64", vec![(1, 90), (1, 3), (1, 700)], 64, 64),
        ("prefill p64", vec![(40, 90), (0, 3), (120, 700)], 64, 64),
        (
            "prefill p16 d128",
            vec![(40, 90), (0, 3), (120, 700)],
            16,
            128,
        ),
        (
            "prefill p32 d256",
            vec![(40, 90), (0, 3), (120, 700)],
            32,
            256,
        ),
    ] {
        let vl = Varlen::random(&lens, 8, 2, d, DType::BF16, false, &dev)?;
        let pg = Paged::from_varlen(&vl, page_size, 0, &mut rng)?;
        let p = options(&dev, 0, Mask::Causal, lens.len(), 8)?;
        let (o_good, lse_good) = pg.run_varlen(&vl, &p)?;
        let mut bad_page = pg.clone();
        let mut t = pg.table.clone();
        t[pg.max_pages] = pg.num_pages as u32 + 5; // sequence 1's first (used) page
        bad_page.page_table = Tensor::from_vec(t, (lens.len(), pg.max_pages), &dev)?;
        let mut bad_len = pg.clone();
        let mut l: Vec<u32> = lens.iter().map(|x| x.1 as u32).collect();
        l[2] = (pg.max_pages * page_size + 1) as u32;
        bad_len.seqlens_k = Tensor::new(l.as_slice(), &dev)?;
        for (lie, g, liar) in [
            ("page id outside the pool", &bad_page, 1),
            ("length beyond the table", &bad_len, 2),
        ] {
            let (o, lse) = g.run_varlen(&vl, &p)?;
            // per sequence: O rows (total_q, hq, d) and LSE columns (hq, total_q)
            for (j, &(n, _)) in lens.iter().enumerate() {
                let r0 = vl.cu_q[j] as usize;
                if n == 0 {
                    continue; // no rows (and an empty CUDA tensor's cast fails to launch)
                }
                let o_j = o.narrow(0, r0, n)?;
                let lse_j = lse.narrow(1, r0, n)?;
                let (nan, lnan) = (non_finite(&o_j)?, non_finite(&lse_j)?);
                let verdict = if j == liar {
                    // the lying sequence: every row NaN
                    (nan == o_j.elem_count() && lnan == lse_j.elem_count()).then_some("all NaN")
                } else {
                    // the others: exactly the honest call's rows
                    let same = |a: &Tensor, b: &Tensor| -> Result<bool> {
                        let (a, b) = (a.to_dtype(DType::F32)?, b.to_dtype(DType::F32)?);
                        let a = a.flatten_all()?.to_vec1::<f32>()?;
                        let b = b.flatten_all()?.to_vec1::<f32>()?;
                        Ok(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()))
                    };
                    (same(&o_j, &o_good.narrow(0, r0, n)?)?
                        && same(&lse_j, &lse_good.narrow(1, r0, n)?)?)
                    .then_some("as the honest call")
                };
                println!(
                    "{shape}: {lie} (sequence {liar}): sequence {j}: {nan} NaN in O, {lnan} in LSE: {}",
                    verdict.unwrap_or("WRONG")
                );
                if verdict.is_none() {
                    outcome = Err(Error::Msg(format!(
                        "{shape}: {lie} (sequence {liar}): sequence {j} has {nan}/{} NaN in O, {lnan}/{} in LSE",
                        o_j.elem_count(),
                        lse_j.elem_count()
                    )));
                }
            }
        }
    }
    set_poison_outputs(true);
    outcome?;
    let vl = Varlen::random(&[(3, 300), (1, 17)], 8, 2, 64, DType::BF16, false, &dev)?;
    let pg = Paged::from_varlen(&vl, 16, 0, &mut rng)?;
    check_packed(
        "after lies",
        &vl,
        &AttnParams::default(),
        &|p| pg.run_varlen(&vl, p),
        None,
    )?;
    Ok(())
}

/// `append_kv_paged` on the GPU writes exactly what the CPU path writes (bit for bit) at page
/// boundary cases, dense and packed, both dtypes; a row whose position is beyond the table or
/// whose page is outside the pool is skipped, and nothing else in the pools changes.
#[test]
fn paged_append_on_the_gpu() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    arch_under_test();
    let cpu = Device::Cpu;
    let (hkv, d) = (4, 128);
    for dtype in [DType::BF16, DType::F16] {
        for (page_size, starts) in [(16usize, vec![0u32, 15, 16, 31]), (64, vec![63, 1, 0, 128])] {
            let b = starts.len();
            let max_pages = 300usize.div_ceil(page_size);
            let num_pages = b * max_pages + 1;
            // every table entry a different page (in reverse order), so no two rows share a slot
            let table: Vec<u32> = (0..(b * max_pages) as u32)
                .map(|x| num_pages as u32 - 1 - x)
                .collect();
            let pt_c = Tensor::from_vec(table, (b, max_pages), &cpu)?;
            let pool0 =
                Tensor::randn(0f32, 1., (num_pages, page_size, hkv, d), &cpu)?.to_dtype(dtype)?;
            let pos_c = Tensor::new(starts.as_slice(), &cpu)?;
            for packed in [false, true] {
                let (kn, cu) = if packed {
                    let counts = [1usize, 17, 2, 40];
                    let cu = prefix_sums(counts);
                    let total = *cu.last().unwrap() as usize;
                    (
                        Tensor::randn(0f32, 1., (total, hkv, d), &cpu)?.to_dtype(dtype)?,
                        Some(cu),
                    )
                } else {
                    (
                        Tensor::randn(0f32, 1., (b, 33, hkv, d), &cpu)?.to_dtype(dtype)?,
                        None,
                    )
                };
                let run = |dv: &Device| -> Result<Vec<f32>> {
                    // fresh storage each (to_device on the CPU would share pool0's)
                    let kp = pool0.to_device(dv)?.copy()?;
                    let vp = pool0.to_device(dv)?.copy()?;
                    let k = kn.to_device(dv)?;
                    let pt = pt_c.to_device(dv)?;
                    let pos = pos_c.to_device(dv)?;
                    match &cu {
                        Some(c) => {
                            let c = Tensor::new(c.as_slice(), dv)?;
                            flashcore::append_kv_paged_varlen(&k, &k, &kp, &vp, &pt, &c, &pos)?
                        }
                        None => flashcore::append_kv_paged(&k, &k, &kp, &vp, &pt, &pos)?,
                    }
                    let a = kp
                        .to_device(&cpu)?
                        .to_dtype(DType::F32)?
                        .flatten_all()?
                        .to_vec1::<f32>()?;
                    let bv = vp
                        .to_device(&cpu)?
                        .to_dtype(DType::F32)?
                        .flatten_all()?
                        .to_vec1::<f32>()?;
                    assert!(a == bv, "k and v pools differ after the same rows");
                    Ok(a)
                };
                let want = run(&cpu)?;
                let got = run(&dev)?;
                let diff = want
                    .iter()
                    .zip(&got)
                    .filter(|(a, b)| a.to_bits() != b.to_bits())
                    .count();
                let before = pool0
                    .to_dtype(DType::F32)?
                    .flatten_all()?
                    .to_vec1::<f32>()?;
                let changed = want.iter().zip(&before).filter(|(a, b)| a != b).count();
                println!("append {dtype:?} page {page_size} packed {packed}: {changed} elements written, {diff} differ from the CPU");
                assert!(changed > 0, "the append wrote nothing");
                assert_eq!(diff, 0, "GPU append differs from the CPU append");
            }
            // beyond the table / outside the pool: skipped on the GPU, nothing else touched
            let mut bad = vec![0u32; b * max_pages];
            bad[0] = num_pages as u32 + 3;
            let kp = pool0.to_device(&dev)?;
            let vp = pool0.to_device(&dev)?;
            let k = Tensor::randn(0f32, 1., (b, 2, hkv, d), &dev)?.to_dtype(dtype)?;
            let pos = Tensor::new(
                vec![0u32, (max_pages * page_size) as u32 - 1, 0, 0].as_slice(),
                &dev,
            )?;
            let pt = Tensor::from_vec(bad, (b, max_pages), &dev)?;
            flashcore::append_kv_paged(&k, &k, &kp, &vp, &pt, &pos)?;
            let after = kp.to_device(&cpu)?.to_dtype(DType::F32)?;
            let before = pool0.to_dtype(DType::F32)?;
            // rows that may change: sequence 1's last table slot row (its id 0 -> page 0), and
            // sequences 2 and 3 (page 0, rows 0 and 1): all in page 0
            let rest_a = after.narrow(0, 1, num_pages - 1)?;
            let rest_b = before.narrow(0, 1, num_pages - 1)?;
            assert_eq!(
                max_abs_diff(&rest_a, &rest_b)?,
                0.0,
                "a skipped row was written elsewhere"
            );
        }
    }
    Ok(())
}

/// Sinks (`AttnParams::sinks`) on packed batches: sequences without keys (rows: zeros, LSE the
/// sink) or without rows, 1 to 4224 keys, seq_q > seq_k under causal, a batch of decode rows
/// (max_seqlen_q <= 16: the split-KV kernels, their splits balanced over the lengths); every
/// mask, GQA 64/8 (gpt-oss) and others, softcap and both ALiBi shapes rotating; against the CPU
/// path per sequence (with the sinks), outputs poisoned first.
#[test]
fn sinks_varlen_on_the_gpu() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    arch_under_test();
    let batches: [&[(usize, usize)]; 3] = [
        &[(3, 0), (0, 5), (1, 1), (113, 113), (17, 600)],
        &[(1023, 1023), (1, 4224), (500, 100)],
        &[(1, 2000), (3, 3000), (16, 900), (1, 17), (2, 0)],
    ];
    let heads = [(64, 8, 64), (8, 2, 128), (4, 4, 256)];
    let mut n = 0;
    for lens in batches {
        for mask in MASKS {
            let (hq, hkv, d) = heads[n % 3];
            let dtype = if n % 2 == 0 { DType::BF16 } else { DType::F16 };
            let vl = Varlen::random(lens, hq, hkv, d, dtype, n % 2 == 1, &dev)?;
            let p = AttnParams {
                sinks: Some(test_sinks(hq, &dev)?),
                ..options(&dev, n, mask, lens.len(), hq)?
            };
            check_varlen("sinks varlen", &vl, &p, n % 3 == 0)?;
            n += 1;
        }
    }
    println!("sinks_varlen_on_the_gpu: {n} cases passed");
    Ok(())
}

/// Sinks over paged caches: decode (split-KV through the page table, one query row per
/// sequence, dense and packed q) and prefill / chunked prefill (sm90: through the page table
/// for pages of 64, gathered for pages of 16), shuffled pages with NaN in unused pool rows;
/// every mask, GQA, both dtypes; against the CPU path per sequence, outputs poisoned first.
#[test]
fn sinks_paged_on_the_gpu() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    arch_under_test();
    let mut rng = Rng::from_clock("sinks_paged_on_the_gpu");
    let decode: Vec<(usize, usize)> = vec![(1, 0), (1, 1), (1, 4224), (1, 9000), (1, 300), (1, 17)];
    let chunked: Vec<(usize, usize)> = vec![(113, 1023), (0, 64), (300, 2000), (1, 1), (64, 64)];
    let heads = [(64, 8, 64), (8, 1, 128), (8, 8, 256)];
    let mut n = 0;
    for (name, lens, dense_q) in [
        ("sinks paged-decode", &decode, true),
        ("sinks paged-chunked", &chunked, false),
    ] {
        for page_size in [16usize, 64] {
            for mask in [MASKS[n % 4], MASKS[(n + 2) % 4]] {
                let (hq, hkv, d) = heads[n % 3];
                let dtype = if n % 2 == 0 { DType::BF16 } else { DType::F16 };
                let p = AttnParams {
                    sinks: Some(test_sinks(hq, &dev)?),
                    ..options(&dev, n, mask, lens.len(), hq)?
                };
                let vl = Varlen::random(lens, hq, hkv, d, dtype, false, &dev)?;
                let pg = Paged::from_varlen(&vl, page_size, 0, &mut rng)?;
                let tag = format!("{name} page {page_size}");
                let plain = |p: &AttnParams| pg.run_varlen_o(&vl, p);
                check_packed(&tag, &vl, &p, &|p| pg.run_varlen(&vl, p), Some(&plain))?;
                if dense_q {
                    check_packed(
                        &format!("{tag} dense q"),
                        &vl,
                        &p,
                        &|p| pg.run_dense(&vl, p),
                        None,
                    )?;
                }
                n += 1;
            }
        }
    }
    println!("sinks_paged_on_the_gpu: {n} cases passed");
    Ok(())
}

/// A separate V head dim on the GPU (docs/decisions.md#separate-v-head-dim): (192, 128)
/// (DeepSeek prefill), (64, 128) and (128, 64), dense prefill and decode, packed batches (empty
/// sequences, 1, 113), paged decode and prefill over K and V pools of two widths (shuffled pages,
/// NaN in unused rows), masks, GQA, softcap, ALiBi and sinks rotating, both dtypes; outputs
/// poisoned first, against the f64 reference / the CPU path. The dispatcher's description says
/// that no route pads and that plain (192, 128) prefill takes the separate-V kernel on sm_90.
/// Head dims past 512 are refused naming the argument.
#[test]
fn v_head_dim_on_the_gpu() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    arch_under_test();
    let Device::Cuda(cuda) = &dev else {
        unreachable!()
    };
    let mut rng = Rng::from_clock("v_head_dim_on_the_gpu");
    let mut n = 0;
    let with_sinks = |p: AttnParams, n: usize, hq: usize| -> Result<AttnParams> {
        Ok(if n % 3 == 2 {
            AttnParams {
                sinks: Some(test_sinks(hq, &dev)?),
                ..p
            }
        } else {
            p
        })
    };
    let mut sepv_routes = 0;
    for (d, dv) in [(192, 128), (64, 128), (128, 64)] {
        // Dense: prefill and decode shapes.
        for &(b, sq, sk, hq, hkv) in &[
            (1, 113, 113, 8, 2),
            (2, 1023, 1023, 4, 4),
            (2, 1, 4224, 16, 1),
            (1, 7, 300, 8, 8),
        ] {
            for dtype in [DType::BF16, DType::F16] {
                let strided = n % 2 == 1;
                let r = |s: (usize, usize, usize, usize)| -> Result<Tensor> {
                    Tensor::randn(0f32, 1., s, &dev)?.to_dtype(dtype)
                };
                let q = r((b, sq, hq + 2, d))?.narrow(2, 1, hq)?;
                let k = if strided {
                    r((b, hkv, sk, d))?.transpose(1, 2)?
                } else {
                    r((b, sk, hkv, d))?
                };
                let v = r((b, sk, hkv, dv))?;
                let p = with_sinks(options(&dev, n, MASKS[n % 4], b, hq)?, n, hq)?;
                let route = flashcore::cuda::describe(cuda, &p, &q, &k, &v)?;
                // every 16-bit kernel reads v and writes o at d_v: nothing is padded
                assert!(!route.starts_with("padded"), "{route}");
                let plain = p.softcap.is_none() && p.alibi_slopes.is_none();
                if route.contains("fc_sm90_fwd") && (d, dv) == (192, 128) && plain {
                    assert!(route.ends_with("_v128"), "the separate-V kernel: {route}");
                }
                sepv_routes += route.ends_with("_v128") as usize;
                let what = format!("dv dense {dtype:?} b{b} sq{sq} sk{sk} h{hq}/{hkv} d{d}/{dv}");
                check_dense(&what, &q, &k, &v, &p)?;
                n += 1;
            }
        }
        // Packed batches.
        let lens = [(0, 3), (113, 113), (1, 300), (5, 0), (40, 9), (1, 1)];
        for dtype in [DType::BF16, DType::F16] {
            let (hq, hkv) = [(8, 2), (4, 4)][n % 2];
            let vl = Varlen::random_dv(&lens, hq, hkv, d, dv, dtype, n % 2 == 0, &dev)?;
            let p = with_sinks(options(&dev, n, MASKS[n % 4], lens.len(), hq)?, n, hq)?;
            check_varlen("dv varlen", &vl, &p, true)?;
            n += 1;
        }
        // Paged: decode (dense and packed q) and chunked prefill, pages of 16 and 64.
        let decode: Vec<(usize, usize)> = vec![(1, 0), (1, 1), (1, 4224), (1, 300), (1, 17)];
        let chunked: Vec<(usize, usize)> = vec![(113, 1023), (0, 64), (300, 700), (1, 1)];
        for (name, lens, dense_q) in [
            ("dv paged-decode", &decode, true),
            ("dv paged-chunked", &chunked, false),
        ] {
            for page_size in [16usize, 64] {
                let (hq, hkv) = [(16, 2), (8, 8), (8, 1)][n % 3];
                let dtype = if n % 2 == 0 { DType::BF16 } else { DType::F16 };
                let p = with_sinks(options(&dev, n, MASKS[n % 4], lens.len(), hq)?, n, hq)?;
                let vl = Varlen::random_dv(lens, hq, hkv, d, dv, dtype, false, &dev)?;
                let pg = Paged::from_varlen(&vl, page_size, 0, &mut rng)?;
                let tag = format!("{name} page {page_size} d{d}/{dv}");
                let plain = |p: &AttnParams| pg.run_varlen_o(&vl, p);
                check_packed(&tag, &vl, &p, &|p| pg.run_varlen(&vl, p), Some(&plain))?;
                if dense_q {
                    check_packed(
                        &format!("{tag} dense q"),
                        &vl,
                        &p,
                        &|p| pg.run_dense(&vl, p),
                        None,
                    )?;
                }
                n += 1;
            }
        }
    }
    // Past 512 on either side: refused before anything runs, naming the argument (v past 512
    // anywhere, q past 512 on a GPU; past 256 on the sm80 family: `head_dims_past_256_on_sm90`).
    let z = |s: (usize, usize, usize, usize)| Tensor::zeros(s, DType::BF16, &dev);
    for (d, dv, want) in [
        (
            192,
            520,
            "v: head_dim must be a multiple of 8 in 8..=512, got 520",
        ),
        (520, 128, "q: head_dim must be at most 512 on a GPU"),
    ] {
        let e = flashcore::attention(
            &z((1, 8, 2, d))?,
            &z((1, 8, 2, d))?,
            &z((1, 8, 2, dv))?,
            &AttnParams::default(),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains(want) && e.contains("got 520"), "{e}");
    }
    let sm90 = flashcore::cuda::describe(
        cuda,
        &AttnParams::default(),
        &Tensor::zeros((1, 300, 2, 64), DType::BF16, &dev)?,
        &Tensor::zeros((1, 300, 2, 64), DType::BF16, &dev)?,
        &Tensor::zeros((1, 300, 2, 64), DType::BF16, &dev)?,
    )?
    .contains("fc_sm90_fwd");
    assert!(
        !sm90 || sepv_routes > 0,
        "no case ran the separate-V kernel"
    );
    println!("v_head_dim_on_the_gpu: {n} cases passed ({sepv_routes} on the separate-V kernel)");
    Ok(())
}

/// Head dims past 256 (Gemma 4's d512): on sm_90 the d512 kernels (Q·Kᵀ over every column, V and
/// O in launches of 256 columns) against the f64 reference: (512, 512), (264, 264), (512, 256),
/// (320, 512), (192, 264); dense prefill and decode shapes, GQA 1/4/8, no mask and causal, sinks
/// rotating, both dtypes, strided q, packed batches with empty sequences and paged caches
/// (shuffled pages) for prefill and decode; outputs poisoned. On the sm80 family: an error naming
/// the argument and the rule.
#[test]
fn head_dims_past_256_on_sm90() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    arch_under_test();
    let Device::Cuda(cuda) = &dev else {
        unreachable!()
    };
    let probe = Tensor::zeros((1, 8, 2, 512), DType::BF16, &dev)?;
    let sm90 = flashcore::cuda::describe(cuda, &AttnParams::default(), &probe, &probe, &probe)
        .map(|r| r.contains("fc_sm90_fwd"))
        .unwrap_or(false);
    if !sm90 {
        for (d, dv, arg) in [(512, 512, "q"), (192, 264, "v"), (264, 128, "q")] {
            let z = |s: (usize, usize, usize, usize)| Tensor::zeros(s, DType::BF16, &dev);
            let e = flashcore::attention(
                &z((1, 8, 2, d))?,
                &z((1, 8, 2, d))?,
                &z((1, 8, 2, dv))?,
                &AttnParams::default(),
            )
            .unwrap_err()
            .to_string();
            assert!(
                e.contains(&format!(
                    "{arg}: head_dim {} runs on the sm90 kernels only",
                    d.max(dv)
                )),
                "{e}"
            );
        }
        println!("head_dims_past_256_on_sm90: the sm80 family refuses them");
        return Ok(());
    }
    let mut rng = Rng::from_clock("head_dims_past_256_on_sm90");
    let mut n = 0;
    let opts = |n: usize, mask: Mask, hq: usize| -> Result<AttnParams> {
        Ok(AttnParams {
            mask,
            sinks: if n % 3 == 2 {
                Some(test_sinks(hq, &dev)?)
            } else {
                None
            },
            ..Default::default()
        })
    };
    for (d, dv) in [(512, 512), (264, 264), (512, 256), (320, 512), (192, 264)] {
        for &(b, sq, sk, hq, hkv) in &[(1, 113, 300, 8, 2), (2, 257, 257, 4, 4), (1, 1, 1023, 8, 1)]
        {
            let dtype = [DType::BF16, DType::F16][n % 2];
            let r = |s: (usize, usize, usize, usize)| -> Result<Tensor> {
                Tensor::randn(0f32, 1., s, &dev)?.to_dtype(dtype)
            };
            let q = r((b, sq, hq + 1, d))?.narrow(2, 1, hq)?;
            let k = r((b, sk, hkv, d))?;
            let v = r((b, sk, hkv, dv))?;
            let p = opts(n, [Mask::None, Mask::Causal][n % 2], hq)?;
            let route = flashcore::cuda::describe(cuda, &p, &q, &k, &v)?;
            assert!(route.contains("_d512_"), "{route}");
            let what = format!("d512 dense {dtype:?} b{b} sq{sq} sk{sk} h{hq}/{hkv} d{d}/{dv}");
            check_dense(&what, &q, &k, &v, &p)?;
            n += 1;
        }
    }
    let lens = [(0, 3), (113, 113), (1, 300), (5, 0), (40, 9)];
    for (d, dv) in [(512, 512), (320, 512)] {
        let dtype = [DType::BF16, DType::F16][n % 2];
        let vl = Varlen::random_dv(&lens, 8, 2, d, dv, dtype, n % 2 == 0, &dev)?;
        let p = opts(n, [Mask::None, Mask::Causal][n % 2], 8)?;
        check_varlen("d512 varlen", &vl, &p, true)?;
        n += 1;
        let decode: Vec<(usize, usize)> = vec![(1, 0), (1, 300), (1, 17)];
        let chunked: Vec<(usize, usize)> = vec![(113, 1023), (1, 1), (64, 64)];
        for (name, lens) in [
            ("d512 paged-decode", &decode),
            ("d512 paged-chunked", &chunked),
        ] {
            for page_size in [16usize, 64] {
                let p = opts(n, [Mask::None, Mask::Causal][n % 2], 8)?;
                let vl = Varlen::random_dv(lens, 8, 1, d, dv, dtype, false, &dev)?;
                let pg = Paged::from_varlen(&vl, page_size, 0, &mut rng)?;
                let tag = format!("{name} page {page_size} d{d}/{dv}");
                let plain = |p: &AttnParams| pg.run_varlen_o(&vl, p);
                check_packed(&tag, &vl, &p, &|p| pg.run_varlen(&vl, p), Some(&plain))?;
                n += 1;
            }
        }
    }
    println!("head_dims_past_256_on_sm90: {n} cases passed");
    Ok(())
}
