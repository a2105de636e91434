//! GPU tests of FP8 (e4m3) keys and values (feature `cuda`; every test skips itself, saying so,
//! without a CUDA device, or fails with FLASHCORE_REQUIRE_GPU=1): the split-KV decode kernels
//! reading F8E4M3 pools and dense K/V with per-head and per-tensor scales, the slow path
//! (dequantized pages, then the 16-bit kernels) for prefill-sized queries, and the GPU append
//! into F8E4M3 pools.
//!
//! Truth: the CPU path on the same F8E4M3 tensors with an f32 q (it dequantizes K/V to f32 and
//! runs the f32 path), so the GPU is judged on the dequantized values themselves. Tolerance: the
//! kernels round P to q's dtype as the 16-bit kernels do, so the error is that of a bf16 / f16
//! decode: at most `rel` of the reference's largest output plus a rounding floor. Each decode
//! case also runs with a V scale 1.5x too large and requires that to fail the same check (the
//! check can fail). Outputs are poisoned (NaN) before every kernel; pool rows no sequence owns
//! hold NaN bytes, so a read past a sequence or through a wrong page shows.
//! FLASHCORE_TEST_ARCH=sm80|sm90 forces a kernel family for the slow path's prefill kernels.
#![cfg(feature = "cuda")]

mod common;
#[path = "common/gpu.rs"]
mod common_gpu;

use candle_core::{DType, Device, Result, Tensor};
use common::*;
use common_gpu::{arch_under_test, gpu};
use flashcore::{AttnParams, KvScales, Mask};

/// Keys per sequence of the paged decode batches.
const LENS: [usize; 5] = [0, 1, 113, 1023, 4224];

/// Relative tolerance (of the reference's largest output) for q's dtype.
fn rel(dtype: DType) -> f64 {
    match dtype {
        DType::BF16 => 1.5e-2,
        _ => 4e-3,
    }
}

/// Scales on the CPU: per head (`n = hkv`) or per tensor (`n = 1`), in [0.05, 1.55).
fn scales(n: usize, salt: f32) -> Result<Tensor> {
    let v: Vec<f32> = (0..n)
        .map(|h| 0.05 + ((h as f32 * 0.37 + salt) % 1.0) * 1.5)
        .collect();
    Tensor::new(v.as_slice(), &Device::Cpu)
}

/// F8E4M3 paged pools on the CPU for sequences of `lens` keys: pages handed out in a shuffled
/// order, one spare table column and three spare pages, every pool row no sequence owns (the
/// spare pages and each last page's tail) NaN.
struct Pools {
    k: Tensor,
    v: Tensor,
    table: Tensor,
    lens: Tensor,
}

fn pools(rng: &mut Rng, lens: &[usize], page: usize, hkv: usize, d: usize) -> Result<Pools> {
    pools_with(rng, lens, page, hkv, d, d, 0)
}

/// [`pools`] with a K pool of head dim `dk` and a V pool of `dv`; with `pad > 0` each pool is a
/// view (offset `pad`) of one `pad` columns wider whose first `pad` columns are NaN, so a read of
/// the wrong columns shows.
fn pools_with(
    rng: &mut Rng,
    lens: &[usize],
    page: usize,
    hkv: usize,
    dk: usize,
    dv: usize,
    pad: usize,
) -> Result<Pools> {
    let cpu = Device::Cpu;
    let need: Vec<usize> = lens.iter().map(|l| l.div_ceil(page)).collect();
    let max_pages = need.iter().copied().max().unwrap_or(0) + 1;
    let num_pages = need.iter().sum::<usize>() + 3;
    let mut order: Vec<u32> = (0..num_pages as u32).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, rng.below(i + 1));
    }
    let mut table = vec![0u32; lens.len() * max_pages];
    let mut owned = vec![0u8; num_pages * page];
    let mut next = 0;
    for (i, (&len, &n)) in lens.iter().zip(&need).enumerate() {
        for j in 0..max_pages {
            // columns past the sequence's pages: any page (they must not be read)
            table[i * max_pages + j] = order[if j < n {
                next + j
            } else {
                rng.below(num_pages)
            }];
        }
        for r in 0..len {
            owned[table[i * max_pages + r / page] as usize * page + r % page] = 1;
        }
        next += n;
    }
    let owned = Tensor::from_vec(owned, (num_pages, page, 1, 1), &cpu)?;
    let pool = |d: usize| -> Result<Tensor> {
        let shape = (num_pages, page, hkv, d);
        let x = Tensor::randn(0f32, 3., shape, &cpu)?;
        let nan = Tensor::full(f32::NAN, shape, &cpu)?;
        let x = owned.broadcast_as(shape)?.where_cond(&x, &nan)?;
        if pad == 0 {
            return x.to_dtype(DType::F8E4M3);
        }
        let lead = Tensor::full(f32::NAN, (num_pages, page, hkv, pad), &cpu)?;
        Tensor::cat(&[&lead, &x], 3)?
            .to_dtype(DType::F8E4M3)?
            .narrow(3, pad, d)
    };
    let lens32: Vec<u32> = lens.iter().map(|&l| l as u32).collect();
    Ok(Pools {
        k: pool(dk)?,
        v: pool(dv)?,
        table: Tensor::from_vec(table, (lens.len(), max_pages), &cpu)?,
        lens: Tensor::new(lens32.as_slice(), &cpu)?,
    })
}

fn scales_on(s: &KvScales, dev: &Device) -> Result<KvScales> {
    Ok(KvScales {
        k: s.k.to_device(dev)?,
        v: s.v.to_device(dev)?,
    })
}

/// One paged case: GPU (q in `dtype`) against the CPU truth (q in f32, same pools), then the
/// same GPU call with a V scale 1.5x too large, which must fail the check. Returns the error
/// relative to the bound.
fn paged_case(
    dev: &Device,
    pl: &Pools,
    q: &Tensor,
    s: &KvScales,
    p: &AttnParams,
    dtype: DType,
    tag: &str,
) -> Result<f64> {
    paged_case_q(dev, pl, q, None, s, p, dtype, tag)
}

/// How far rounding K to q's dtype can move a score, where the call takes the slow path (more
/// than 16 query rows a sequence, or a head dim that is not a multiple of 16: K/V widened to
/// q's dtype first, `stored · scale` rounded once) and 0 where a decode kernel folds the scales
/// in exactly: each score moves by at most u · softmax scale · |q| · |k| (Cauchy-Schwarz, u the
/// dtype's unit roundoff), and a log-sum-exp by at most the largest move of its terms.
fn widened_score_err(
    q: &Tensor,
    pl: &Pools,
    s: &KvScales,
    p: &AttnParams,
    max_q: Option<usize>,
    dtype: DType,
) -> Result<f64> {
    let d = q.dim(q.rank() - 1)?;
    let rows = max_q.unwrap_or(if q.rank() == 4 { q.dim(1)? } else { 1 });
    if rows <= 16 && d.is_multiple_of(16) {
        return Ok(0.0);
    }
    let u = if dtype == DType::BF16 {
        2f64.powi(-9)
    } else {
        2f64.powi(-11)
    };
    let max_norm = |t: &Tensor| -> Result<f64> {
        let n = t
            .to_dtype(DType::F32)?
            .sqr()?
            .sum_keepdim(t.rank() - 1)?
            .sqrt()?;
        Ok(n.flatten_all()?
            .to_vec1::<f32>()?
            .into_iter()
            .filter(|x| x.is_finite())
            .fold(0f32, f32::max) as f64)
    };
    let ks = s.k.abs()?.max(0)?.to_scalar::<f32>()? as f64;
    let scale = p
        .softmax_scale
        .map_or(1.0 / (pl.k.dim(3)? as f64).sqrt(), |x| x as f64);
    Ok(u * scale * max_norm(&q.to_dtype(dtype)?)? * max_norm(&pl.k)? * ks)
}

/// `attention_paged_with_lse`, or with `packed` q `attention_paged_varlen_with_lse`.
#[allow(clippy::too_many_arguments)]
fn paged_call(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    table: &Tensor,
    lens: &Tensor,
    packed: Option<(&Tensor, usize)>,
    p: &AttnParams,
) -> Result<(Tensor, Tensor)> {
    match packed {
        Some((cu, max_q)) => {
            flashcore::attention_paged_varlen_with_lse(q, k, v, table, lens, cu, max_q, p)
        }
        None => flashcore::attention_paged_with_lse(q, k, v, table, lens, p),
    }
}

/// [`paged_case`] with dense q (`packed = None`) or packed q (`Some((cu_seqlens_q on the CPU,
/// max_seqlen_q))`).
#[allow(clippy::too_many_arguments)]
fn paged_case_q(
    dev: &Device,
    pl: &Pools,
    q: &Tensor,
    packed: Option<(&Tensor, usize)>,
    s: &KvScales,
    p: &AttnParams,
    dtype: DType,
    tag: &str,
) -> Result<f64> {
    let cpu = Device::Cpu;
    let q32 = q.to_dtype(dtype)?.to_dtype(DType::F32)?;
    let pc = AttnParams {
        kv_scales: Some(s.clone()),
        ..params_on(p, &cpu)?
    };
    let (want, want_lse) = paged_call(&q32, &pl.k, &pl.v, &pl.table, &pl.lens, packed, &pc)?;
    let on = |t: &Tensor| t.to_device(dev);
    let (kg, vg, tg, lg) = (on(&pl.k)?, on(&pl.v)?, on(&pl.table)?, on(&pl.lens)?);
    let cug = packed
        .map(|(cu, m)| Ok::<_, candle_core::Error>((on(cu)?, m)))
        .transpose()?;
    let qg = q.to_dtype(dtype)?.to_device(dev)?;
    let run = |sc: &KvScales| {
        let pg = AttnParams {
            kv_scales: Some(scales_on(sc, dev)?),
            ..params_on(p, dev)?
        };
        paged_call(
            &qg,
            &kg,
            &vg,
            &tg,
            &lg,
            cug.as_ref().map(|(c, m)| (c, *m)),
            &pg,
        )
    };
    let (o, lse) = run(s)?;
    assert_eq!(o.dtype(), dtype, "{tag}");
    let mag = max_abs(&want)?;
    let bound = rel(dtype) * mag + rounding_floor(dtype, mag);
    let err = max_abs_diff(&o, &want)?;
    assert!(
        err <= bound,
        "{tag}: max error {err:.3e} > {bound:.3e} (outputs up to {mag:.3})"
    );
    let le = lse_err(&lse, &want_lse)?;
    let lse_tol = 2e-3 + widened_score_err(q, pl, s, p, packed.map(|(_, m)| m), dtype)?;
    assert!(le <= lse_tol, "{tag}: LSE error {le:.3e} > {lse_tol:.3e}");
    if mag > 1e-3 {
        let wrong = KvScales {
            k: s.k.clone(),
            v: (&s.v * 1.5)?,
        };
        let (ow, _) = run(&wrong)?;
        let ew = max_abs_diff(&ow, &want)?;
        assert!(
            ew > bound,
            "{tag}: a V scale 1.5x too large passed the check ({ew:.3e} <= {bound:.3e})"
        );
    }
    Ok(err / bound)
}

/// Paged decode over F8E4M3 pools: sequences of 0 / 1 / 113 / 1023 / 4224 keys in one batch,
/// shuffled page tables, GQA 1 / 4 / 8, head dims 64 / 128 / 256, no mask / causal / window,
/// one and four query rows, per-head and per-tensor scales, sinks, pages of 64 and 16, bf16
/// and f16.
#[test]
fn fp8_paged_decode_matches_the_dequantized_reference() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    arch_under_test();
    let mut rng = Rng::from_clock("fp8_paged_decode");
    let masks = [
        Mask::None,
        Mask::Causal,
        Mask::Window {
            left: Some(100),
            right: Some(0),
        },
    ];
    let (mut cases, mut worst) = (0, 0f64);
    for (ratio, hkv) in [(1usize, 4usize), (4, 2), (8, 1)] {
        for d in [64usize, 128, 256] {
            for (mi, &mask) in masks.iter().enumerate() {
                for sq in [1usize, 4] {
                    let i = cases;
                    let dtype = if i % 2 == 0 { DType::BF16 } else { DType::F16 };
                    let page = if i % 3 == 2 { 16 } else { 64 };
                    let per_head = i % 2 == 1 || hkv == 1;
                    let hq = ratio * hkv;
                    let pl = pools(&mut rng, &LENS, page, hkv, d)?;
                    let n = if per_head { hkv } else { 1 };
                    let s = KvScales {
                        k: scales(n, 0.1 + mi as f32 * 0.2)?,
                        v: scales(n, 0.6)?,
                    };
                    let q = Tensor::randn(0f32, 1., (LENS.len(), sq, hq, d), &Device::Cpu)?;
                    let p = AttnParams {
                        mask,
                        sinks: (i % 3 == 0).then(|| test_sinks(hq, &dev)).transpose()?,
                        ..Default::default()
                    };
                    let tag = format!(
                        "{dtype:?} d{d} hq{hq}/hkv{hkv} sq{sq} page{page} {} scales {} sinks {}",
                        mask_name(mask),
                        if per_head { "per head" } else { "per tensor" },
                        p.sinks.is_some()
                    );
                    let r = paged_case(&dev, &pl, &q, &s, &p, dtype, &tag)?;
                    worst = worst.max(r);
                    cases += 1;
                }
            }
        }
    }
    println!("{cases} FP8 paged decode cases, worst error {worst:.2} of the bound");
    Ok(())
}

/// Scales of every sign: a negative K scale (its sign goes into the widened keys), a zero K
/// scale (zero keys: uniform weights), a negative V scale, and one head with all three normal.
#[test]
fn fp8_decode_scales_of_every_sign() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    arch_under_test();
    let mut rng = Rng::from_clock("fp8_scale_signs");
    let (hkv, hq, d) = (4, 16, 128);
    let s = KvScales {
        k: Tensor::new(&[-0.7f32, 0.0, 0.3, 1.1], &Device::Cpu)?,
        v: Tensor::new(&[0.5f32, -0.9, 0.0, 1.3], &Device::Cpu)?,
    };
    for mask in [Mask::None, Mask::Causal] {
        let pl = pools(&mut rng, &[700, 64, 5], 64, hkv, d)?;
        let q = Tensor::randn(0f32, 1., (3, 2, hq, d), &Device::Cpu)?;
        let p = AttnParams {
            mask,
            ..Default::default()
        };
        paged_case(&dev, &pl, &q, &s, &p, DType::BF16, &mask_name(mask))?;
    }
    Ok(())
}

/// Dense decode over F8E4M3 K/V (`attention`, `attention_varlen` with one query row per
/// sequence) and the slow path of prefill-sized queries: dense prefill, and chunked prefill
/// over an F8E4M3 paged cache (`attention_paged_varlen`, the sequences' pages dequantized,
/// then the 16-bit kernels), each against the CPU on the same tensors.
#[test]
fn fp8_dense_decode_and_slow_paths() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    arch_under_test();
    let cpu = Device::Cpu;
    let mut rng = Rng::from_clock("fp8_dense_and_slow");
    let (hq, hkv, d) = (8, 2, 128);
    let s = KvScales {
        k: scales(hkv, 0.2)?,
        v: scales(1, 0.7)?,
    };
    let check = |tag: &str, got: &Tensor, want: &Tensor, dtype: DType| -> Result<()> {
        let mag = max_abs(want)?;
        let bound = rel(dtype) * mag + rounding_floor(dtype, mag);
        let err = max_abs_diff(got, want)?;
        assert!(err <= bound, "{tag}: max error {err:.3e} > {bound:.3e}");
        println!("{tag}: error {err:.3e} (bound {bound:.3e})");
        Ok(())
    };
    for dtype in [DType::BF16, DType::F16] {
        for (sq, mask) in [(1usize, Mask::None), (3, Mask::Causal), (200, Mask::Causal)] {
            // dense: 3 sequences of 777 keys
            let q = Tensor::randn(0f32, 1., (3, sq, hq, d), &cpu)?.to_dtype(dtype)?;
            let kv = || Tensor::randn(0f32, 3., (3, 777, hkv, d), &cpu)?.to_dtype(DType::F8E4M3);
            let (k, v) = (kv()?, kv()?);
            let pc = AttnParams {
                mask,
                kv_scales: Some(s.clone()),
                ..Default::default()
            };
            let want = flashcore::attention(&q.to_dtype(DType::F32)?, &k, &v, &pc)?;
            let pg = AttnParams {
                kv_scales: Some(scales_on(&s, &dev)?),
                ..pc.clone()
            };
            let on = |t: &Tensor| t.to_device(&dev);
            let got = flashcore::attention(&on(&q)?, &on(&k)?, &on(&v)?, &pg)?;
            check(&format!("dense {dtype:?} sq{sq}"), &got, &want, dtype)?;
        }
        // chunked prefill: 37 / 1 / 200 new rows over 300 / 64 / 4224 cached keys
        let lens = [300usize, 64, 4224];
        let rows = [37usize, 1, 200];
        let pl = pools(&mut rng, &lens, 64, hkv, d)?;
        let cu = prefix_sums(rows);
        let total = *cu.last().unwrap() as usize;
        let q = Tensor::randn(0f32, 1., (total, hq, d), &cpu)?.to_dtype(dtype)?;
        let cu_c = Tensor::new(cu.as_slice(), &cpu)?;
        let pc = AttnParams {
            mask: Mask::Causal,
            kv_scales: Some(s.clone()),
            ..Default::default()
        };
        let want = flashcore::attention_paged_varlen(
            &q.to_dtype(DType::F32)?,
            &pl.k,
            &pl.v,
            &pl.table,
            &pl.lens,
            &cu_c,
            200,
            &pc,
        )?;
        let pg = AttnParams {
            kv_scales: Some(scales_on(&s, &dev)?),
            ..pc.clone()
        };
        let on = |t: &Tensor| t.to_device(&dev);
        let got = flashcore::attention_paged_varlen(
            &on(&q)?,
            &on(&pl.k)?,
            &on(&pl.v)?,
            &on(&pl.table)?,
            &on(&pl.lens)?,
            &on(&cu_c)?,
            200,
            &pg,
        )?;
        check(&format!("chunked prefill {dtype:?}"), &got, &want, dtype)?;
    }
    Ok(())
}

/// The paged slow path (queries of more than 16 rows over F8E4M3 pools: the pages each sequence
/// uses widened on the device in one launch, then the 16-bit kernels), dense and packed q, against
/// the CPU on the same pools and failing with a V scale 1.5x too large: shuffled tables whose
/// spare columns point at any page, NaN in every pool row no sequence owns, sequences of 0 to
/// 1500 keys (one with more query rows than keys), pages of 16 / 32 / 64, head dims 128 (16-byte
/// vectors) and 72 (8-byte), pools that are views at an offset of 4 bytes (read byte by byte)
/// and 8 bytes with NaN in the columns before them, a V pool narrower than the K pool, GQA 1 /
/// 2 / 4 / 8, per-head and per-tensor scales, causal / no mask / window, sinks, and a chunk
/// (split into pieces on the host first).
#[test]
fn fp8_paged_prefill_slow_path() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    arch_under_test();
    let cpu = Device::Cpu;
    let mut rng = Rng::from_clock("fp8_paged_prefill");
    // (name, d_qk, d_v, view offset, page, hq, hkv)
    let shapes = [
        ("d128", 128, 128, 0, 64, 8, 2),
        ("d128 p16", 128, 128, 0, 16, 4, 4),
        ("d72", 72, 72, 0, 64, 8, 1),
        ("d64 view +4", 64, 64, 4, 32, 8, 2),
        ("d128 view +8", 128, 128, 8, 64, 8, 4),
        ("dk128 dv64", 128, 64, 0, 64, 8, 2),
    ];
    let lens = [700usize, 64, 0, 1500, 33];
    let rows = [37usize, 200, 5, 17, 50];
    let masks = [
        Mask::Causal,
        Mask::None,
        Mask::Window {
            left: Some(300),
            right: Some(0),
        },
    ];
    let (mut cases, mut worst) = (0, 0f64);
    for (si, &(name, dk, dv, pad, page, hq, hkv)) in shapes.iter().enumerate() {
        let pl = pools_with(&mut rng, &lens, page, hkv, dk, dv, pad)?;
        for (mi, &mask) in masks.iter().enumerate() {
            let i = si * masks.len() + mi;
            let dtype = if i.is_multiple_of(2) {
                DType::BF16
            } else {
                DType::F16
            };
            let n = if i % 3 == 1 { 1 } else { hkv };
            let s = KvScales {
                k: scales(n, 0.15 + mi as f32 * 0.2)?,
                v: scales(n, 0.55)?,
            };
            let p = AttnParams {
                mask,
                sinks: (i % 4 == 3).then(|| test_sinks(hq, &cpu)).transpose()?,
                chunk: (mi == 0 && si % 2 == 1).then_some(256),
                ..Default::default()
            };
            let tag = format!(
                "{name} page{page} hq{hq}/hkv{hkv} {dtype:?} {} scales {} sinks {} chunk {:?}",
                mask_name(mask),
                if n == 1 { "per tensor" } else { "per head" },
                p.sinks.is_some(),
                p.chunk
            );
            // dense q: 40 rows per sequence
            let q = Tensor::randn(0f32, 1., (lens.len(), 40, hq, dk), &cpu)?;
            let r = paged_case(&dev, &pl, &q, &s, &p, dtype, &format!("{tag} dense q40"))?;
            worst = worst.max(r);
            // packed q: rows per sequence as `rows`
            let cu = prefix_sums(rows);
            let total = *cu.last().unwrap() as usize;
            let q = Tensor::randn(0f32, 1., (total, hq, dk), &cpu)?;
            let cu = Tensor::new(cu.as_slice(), &cpu)?;
            let max_q = *rows.iter().max().unwrap();
            let r = paged_case_q(
                &dev,
                &pl,
                &q,
                Some((&cu, max_q)),
                &s,
                &p,
                dtype,
                &format!("{tag} packed q"),
            )?;
            worst = worst.max(r);
            cases += 2;
        }
    }
    println!("{cases} FP8 paged slow-path cases, worst error {worst:.2} of the bound");
    Ok(())
}

/// Tables that lie to the paged slow path on the GPU: a page id outside the pool, a length beyond
/// the table, for dense and packed q. Nothing is read outside the pools, the lying sequence's
/// rows of O and LSE are NaN (the 16-bit call's table check, as with 16-bit pools), the other
/// sequences' rows are bit for bit those of the honest call; an honest call afterwards is still
/// right. With a chunk the tables are read on the host: the lie is an error naming the argument.
/// Poisoning off, so the NaN comes from the check.
#[test]
fn fp8_paged_slow_path_lying_tables() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    arch_under_test();
    flashcore::cuda::set_poison_outputs(false);
    let cpu = Device::Cpu;
    let mut rng = Rng::from_clock("fp8_paged_lies");
    let (hq, hkv) = (8usize, 2usize);
    let lens = [90usize, 40, 700];
    let rows = [40usize, 20, 120];
    let mut outcome = Ok(());
    for (page, d) in [(16usize, 64usize), (64, 128), (64, 72)] {
        let pl = pools_with(&mut rng, &lens, page, hkv, d, d, 0)?;
        let s = KvScales {
            k: scales(hkv, 0.3)?,
            v: scales(hkv, 0.7)?,
        };
        let p = AttnParams {
            mask: Mask::Causal,
            kv_scales: Some(scales_on(&s, &dev)?),
            ..Default::default()
        };
        let on = |t: &Tensor| t.to_device(&dev);
        let (kg, vg, tg, lg) = (on(&pl.k)?, on(&pl.v)?, on(&pl.table)?, on(&pl.lens)?);
        let max_pages = pl.table.dim(1)?;
        let num_pages = pl.k.dim(0)?;
        let mut t = pl.table.flatten_all()?.to_vec1::<u32>()?;
        t[max_pages] = num_pages as u32 + 5; // sequence 1's first (used) page
        let bad_table = Tensor::from_vec(t, (lens.len(), max_pages), &dev)?;
        let mut l: Vec<u32> = lens.iter().map(|&x| x as u32).collect();
        l[2] = (max_pages * page + 1) as u32;
        let bad_lens = Tensor::new(l.as_slice(), &dev)?;
        let cu = prefix_sums(rows);
        let total = *cu.last().unwrap() as usize;
        let cu_g = Tensor::new(cu.as_slice(), &dev)?;
        let max_q = *rows.iter().max().unwrap();
        for packed in [false, true] {
            let q = if packed {
                Tensor::randn(0f32, 1., (total, hq, d), &cpu)?
            } else {
                Tensor::randn(0f32, 1., (lens.len(), 40, hq, d), &cpu)?
            };
            let q = q.to_dtype(DType::BF16)?.to_device(&dev)?;
            let run = |t: &Tensor, l: &Tensor| -> Result<(Tensor, Tensor)> {
                let cu = packed.then_some((&cu_g, max_q));
                paged_call(&q, &kg, &vg, t, l, cu, &p)
            };
            // per sequence: its rows of O and its LSE entries, flattened
            let split = |o: &Tensor, lse: &Tensor| -> Result<Vec<(Vec<f32>, Vec<f32>)>> {
                let o = o.to_dtype(DType::F32)?.to_device(&cpu)?;
                let lse = lse.to_device(&cpu)?;
                (0..lens.len())
                    .map(|j| {
                        let (oj, lj) = if packed {
                            let (r0, n) = (cu[j] as usize, rows[j]);
                            (o.narrow(0, r0, n)?, lse.narrow(1, r0, n)?)
                        } else {
                            (o.get(j)?, lse.get(j)?)
                        };
                        Ok((
                            oj.flatten_all()?.to_vec1::<f32>()?,
                            lj.flatten_all()?.to_vec1::<f32>()?,
                        ))
                    })
                    .collect()
            };
            let (o, lse) = run(&tg, &lg)?;
            let good = split(&o, &lse)?;
            let shape = format!(
                "page {page} d{d} {}",
                if packed { "packed" } else { "dense" }
            );
            for (lie, t, l, liar) in [
                ("page id outside the pool", &bad_table, &lg, 1usize),
                ("length beyond the table", &tg, &bad_lens, 2),
            ] {
                let (o, lse) = run(t, l)?;
                for (j, (oj, lj)) in split(&o, &lse)?.into_iter().enumerate() {
                    let verdict = if j == liar {
                        (oj.iter().all(|x| x.is_nan()) && lj.iter().all(|x| x.is_nan()))
                            .then_some("all NaN")
                    } else {
                        let same = |a: &[f32], b: &[f32]| {
                            a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
                        };
                        (same(&oj, &good[j].0) && same(&lj, &good[j].1))
                            .then_some("as the honest call")
                    };
                    println!(
                        "{shape}: {lie} (sequence {liar}): sequence {j}: {}",
                        verdict.unwrap_or("WRONG")
                    );
                    if verdict.is_none() {
                        outcome = Err(candle_core::Error::Msg(format!(
                            "{shape}: {lie} (sequence {liar}): sequence {j}: {} NaN of {} in O, {} of {} in LSE",
                            oj.iter().filter(|x| x.is_nan()).count(),
                            oj.len(),
                            lj.iter().filter(|x| x.is_nan()).count(),
                            lj.len()
                        )));
                    }
                }
            }
            // with a chunk the pieces are planned from the tables on the host: a lie is an error
            let pc = AttnParams {
                chunk: Some(4 * page),
                ..p.clone()
            };
            let cu = packed.then_some((&cu_g, max_q));
            match paged_call(&q, &kg, &vg, &bad_table, &lg, cu, &pc) {
                Err(e) if names(&e.to_string(), "page_table") => {}
                other => {
                    outcome = Err(candle_core::Error::Msg(format!(
                        "{shape}: a chunk over a lying table: expected an error naming page_table, got {:?}",
                        other.map(|_| ())
                    )))
                }
            }
        }
    }
    flashcore::cuda::set_poison_outputs(true);
    outcome?;
    // an honest call after the lies
    let pl = pools(&mut rng, &lens, 64, hkv, 128)?;
    let s = KvScales {
        k: scales(hkv, 0.2)?,
        v: scales(1, 0.6)?,
    };
    let q = Tensor::randn(0f32, 1., (lens.len(), 40, hq, 128), &cpu)?;
    let p = AttnParams {
        mask: Mask::Causal,
        ..Default::default()
    };
    paged_case(&dev, &pl, &q, &s, &p, DType::BF16, "after lies")?;
    Ok(())
}

/// `append_kv_paged_fp8` on the GPU stores the bytes the CPU stores (saturation included), and
/// a decode reads them back.
#[test]
fn fp8_append_on_the_gpu_matches_the_cpu() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    arch_under_test();
    let cpu = Device::Cpu;
    let (hkv, d, page, b) = (2usize, 64usize, 16usize, 3usize);
    let max_pages = 4;
    let num_pages = b * max_pages;
    let table: Vec<u32> = (0..num_pages as u32).rev().collect();
    let table = Tensor::from_vec(table, (b, max_pages), &cpu)?;
    let pos = Tensor::new(&[0u32, 5, 31], &cpu)?;
    let s = KvScales {
        k: scales(hkv, 0.4)?,
        v: scales(hkv, 0.9)?,
    };
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        // N(0, 100) / scale: some values past ±448, which saturate
        let kn = Tensor::randn(0f32, 100., (b, 20, hkv, d), &cpu)?.to_dtype(dtype)?;
        let vn = Tensor::randn(0f32, 100., (b, 20, hkv, d), &cpu)?.to_dtype(dtype)?;
        let zeros = || Tensor::zeros((num_pages, page, hkv, d), DType::F8E4M3, &cpu);
        let (kc, vc) = (zeros()?, zeros()?);
        flashcore::append_kv_paged_fp8(&kn, &vn, &kc, &vc, &table, &pos, &s)?;
        let on = |t: &Tensor| t.to_device(&dev);
        let (kg, vg) = (on(&zeros()?)?, on(&zeros()?)?);
        let sg = scales_on(&s, &dev)?;
        flashcore::append_kv_paged_fp8(
            &on(&kn)?,
            &on(&vn)?,
            &kg,
            &vg,
            &on(&table)?,
            &on(&pos)?,
            &sg,
        )?;
        let f32_of = |t: &Tensor| t.to_device(&cpu)?.to_dtype(DType::F32);
        assert_eq!(
            max_abs_diff(&f32_of(&kg)?, &f32_of(&kc)?)?,
            0.0,
            "{dtype:?} k"
        );
        assert_eq!(
            max_abs_diff(&f32_of(&vg)?, &f32_of(&vc)?)?,
            0.0,
            "{dtype:?} v"
        );
        assert_eq!(max_abs(&f32_of(&kg)?)?, 448.0, "{dtype:?}: saturation");
    }
    Ok(())
}

/// `quantize_e4m3` / `dequantize_e4m3` on the GPU (flashcore's kernels) against the CPU (candle's
/// casts): bit-identical e4m3 bytes for bf16 / f16 / f32 inputs given as strided views, with
/// values past ±448 (saturated), infinities and NaN; identical widened values in every dtype
/// (16-byte vectors and element by element);
/// and a dense decode over a misaligned F8E4M3 view (copied by the e4m3 copy kernel first).
#[test]
fn fp8_conversions_match_the_cpu() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    arch_under_test();
    let cpu = Device::Cpu;
    let (hkv, d) = (4usize, 48usize);
    for per_head in [true, false] {
        let s = scales(if per_head { hkv } else { 1 }, 0.3)?;
        let sg = s.to_device(&dev)?;
        for dtype in [DType::BF16, DType::F16, DType::F32] {
            // (3, 5, hkv, d) read through a transpose: a strided view on both devices
            let mut x = Tensor::randn(0f32, 200., (3, hkv, 5, d), &cpu)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            x[7] = f32::NAN;
            x[100] = f32::INFINITY;
            x[201] = f32::NEG_INFINITY;
            let x = Tensor::from_vec(x, (3, hkv, 5, d), &cpu)?.to_dtype(dtype)?;
            let xc = x.transpose(1, 2)?;
            let xg = x.to_device(&dev)?.transpose(1, 2)?;
            let qc = flashcore::quantize_e4m3(&xc, &s)?;
            let qg = flashcore::quantize_e4m3(&xg, &sg)?;
            assert_eq!(qg.dtype(), DType::F8E4M3);
            let bits = |t: &Tensor| -> Result<Vec<f32>> {
                t.to_device(&cpu)?
                    .to_dtype(DType::F32)?
                    .flatten_all()?
                    .to_vec1::<f32>()
            };
            let (bc, bg) = (bits(&qc)?, bits(&qg)?);
            let same = bc
                .iter()
                .zip(&bg)
                .all(|(a, b)| a == b || (a.is_nan() && b.is_nan()));
            assert!(
                same,
                "{dtype:?} per_head {per_head}: GPU e4m3 bytes differ from the CPU's"
            );
            assert_eq!(
                bg.iter().filter(|v| v.is_nan()).count(),
                1,
                "{dtype:?}: NaN kept"
            );
            assert_eq!(
                bg.iter().filter(|v| v.abs() == 448.0).count(),
                bc.iter().filter(|v| v.abs() == 448.0).count()
            );
            assert!(bg.iter().any(|v| v.abs() == 448.0), "{dtype:?}: saturation");
            // widen the GPU bytes on both devices, through strided views again (heads stay the
            // second-to-last dim): rows of 16-byte vectors (the vector kernel), and rows at an
            // offset of 8 bytes (element by element)
            for view in ["transposed", "offset 8"] {
                let f = |t: &Tensor| match view {
                    "transposed" => t.transpose(0, 1),
                    _ => t.narrow(3, 8, d - 16),
                };
                let wc = flashcore::dequantize_e4m3(&f(&qg.to_device(&cpu)?)?, &s, dtype)?;
                let wg = flashcore::dequantize_e4m3(&f(&qg)?, &sg, dtype)?;
                assert_eq!(wg.dtype(), dtype);
                let (vc, vg) = (bits(&wc)?, bits(&wg)?);
                let same = vc
                    .iter()
                    .zip(&vg)
                    .all(|(a, b)| a == b || (a.is_nan() && b.is_nan()));
                assert!(
                    same,
                    "{dtype:?} per_head {per_head} {view}: widened values differ"
                );
            }
        }
    }
    // a misaligned F8E4M3 view (offset 8 bytes into each row): copied, then decoded
    let (hq, sk) = (8usize, 300usize);
    let s = KvScales {
        k: scales(hkv, 0.1)?,
        v: scales(hkv, 0.6)?,
    };
    let wide = |seed: f32| -> Result<Tensor> {
        (Tensor::randn(0f32, 2., (2, sk, hkv, 64 + 8), &cpu)? + seed as f64)?
            .to_dtype(DType::F8E4M3)
    };
    let (kw, vw) = (wide(0.0)?, wide(0.5)?);
    let (k, v) = (kw.narrow(3, 8, 64)?, vw.narrow(3, 8, 64)?);
    let q = Tensor::randn(0f32, 1., (2, 1, hq, 64), &cpu)?.to_dtype(DType::BF16)?;
    let pc = AttnParams {
        kv_scales: Some(s.clone()),
        ..Default::default()
    };
    let want = flashcore::attention(&q.to_dtype(DType::F32)?, &k, &v, &pc)?;
    let pg = AttnParams {
        kv_scales: Some(scales_on(&s, &dev)?),
        ..Default::default()
    };
    let on = |t: &Tensor| t.to_device(&dev);
    let (kg, vg) = (on(&kw)?.narrow(3, 8, 64)?, on(&vw)?.narrow(3, 8, 64)?);
    let got = flashcore::attention(&on(&q)?, &kg, &vg, &pg)?;
    let mag = max_abs(&want)?;
    let bound = rel(DType::BF16) * mag + rounding_floor(DType::BF16, mag);
    let err = max_abs_diff(&got, &want)?;
    assert!(
        err <= bound,
        "misaligned F8E4M3 view: max error {err:.3e} > {bound:.3e}"
    );
    Ok(())
}

/// NaN bytes (e4m3 0x7F / 0xFF) in the keys and values the decode kernels widen: one NaN key
/// byte makes every score of that key NaN, so the rows of its K/V head come out NaN; one NaN
/// value byte makes that one output column NaN for the rows that give its key a weight, and
/// every other column stays finite (which also pins the column order the kernels put back
/// together). Judged element by element against the CPU: NaN where it has NaN, within the
/// bound elsewhere. Head dims 64 / 128 / 256, bf16 and f16.
#[test]
fn fp8_decode_nan_bytes_land_where_the_cpu_puts_them() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    arch_under_test();
    let cpu = Device::Cpu;
    let (b, sk, hkv, hq) = (2usize, 777usize, 2usize, 8usize);
    for (i, d) in [64usize, 128, 256].into_iter().enumerate() {
        let dtype = if i % 2 == 0 { DType::BF16 } else { DType::F16 };
        let flat = |salt: f32| -> Result<Vec<f32>> {
            (Tensor::randn(0f32, 2., (b, sk, hkv, d), &cpu)? + salt as f64)?
                .flatten_all()?
                .to_vec1::<f32>()
        };
        let at = |bi: usize, key: usize, h: usize, c: usize| ((bi * sk + key) * hkv + h) * d + c;
        let (mut kx, mut vx) = (flat(0.0)?, flat(0.3)?);
        kx[at(0, 5, 0, 17)] = f32::NAN; // sequence 0, K/V head 0: all its rows NaN
        vx[at(1, 300, 1, d - 9)] = f32::NAN; // sequence 1, head 1: column d - 9 only
        vx[at(1, 301, 1, 2)] = -f32::NAN; // and column 2 (a 0xFF byte)
        let to8 = |x: Vec<f32>| Tensor::from_vec(x, (b, sk, hkv, d), &cpu)?.to_dtype(DType::F8E4M3);
        let (k, v) = (to8(kx)?, to8(vx)?);
        let s = KvScales {
            k: scales(hkv, 0.4)?,
            v: scales(hkv, 0.8)?,
        };
        let q = Tensor::randn(0f32, 1., (b, 1, hq, d), &cpu)?.to_dtype(dtype)?;
        let pc = AttnParams {
            kv_scales: Some(s.clone()),
            ..Default::default()
        };
        let want = flashcore::attention(&q.to_dtype(DType::F32)?, &k, &v, &pc)?;
        let pg = AttnParams {
            kv_scales: Some(scales_on(&s, &dev)?),
            ..Default::default()
        };
        let on = |t: &Tensor| t.to_device(&dev);
        let got = flashcore::attention(&on(&q)?, &on(&k)?, &on(&v)?, &pg)?;
        let w = want.flatten_all()?.to_vec1::<f32>()?;
        let g = got
            .to_device(&cpu)?
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let mag = w
            .iter()
            .filter(|x| x.is_finite())
            .fold(0f32, |m, x| m.max(x.abs())) as f64;
        let bound = rel(dtype) * mag + rounding_floor(dtype, mag);
        let nans = w.iter().filter(|x| x.is_nan()).count();
        // sequence 0's 4 heads of K/V head 0 (all d columns), sequence 1's 4 heads of head 1 (two columns)
        assert_eq!(nans, 4 * d + 4 * 2, "d{d}: the CPU's NaN count");
        for (j, (x, y)) in w.iter().zip(&g).enumerate() {
            let ok = if x.is_nan() {
                y.is_nan()
            } else {
                y.is_finite() && ((x - y).abs() as f64) <= bound
            };
            assert!(
                ok,
                "d{d} {dtype:?}: output element {j} is {y}, the CPU's {x} (bound {bound:.3e})"
            );
        }
    }
    Ok(())
}

/// F8E4M3 queries (the FP8 forward, `AttnParams::q_scale`) have no GPU kernel yet: refused before
/// anything runs, naming the option (the CPU path computes them: tests/fp8.rs).
#[test]
fn fp8_queries_are_refused_on_the_gpu() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    arch_under_test();
    let one = |h: usize| Tensor::ones(h, DType::F32, &dev);
    let e4m3 = |h: usize| -> Result<Tensor> {
        flashcore::quantize_e4m3(&Tensor::randn(0f32, 1., (1, 16, h, 64), &dev)?, &one(h)?)
    };
    let (q, k, v) = (e4m3(8)?, e4m3(2)?, e4m3(2)?);
    let p = AttnParams {
        q_scale: Some(one(8)?),
        kv_scales: Some(KvScales {
            k: one(2)?,
            v: one(2)?,
        }),
        ..Default::default()
    };
    let e = flashcore::attention(&q, &k, &v, &p)
        .unwrap_err()
        .to_string();
    assert!(
        names(&e, "q_scale") && e.contains("no GPU kernel yet"),
        "{e}"
    );
    Ok(())
}
