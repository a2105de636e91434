//! GPU reliability tests (feature `cuda`, issue 53): the inputs at the edge of the numeric
//! contract. Huge window bounds, NaN in V rows a query row does not see, ALiBi slopes that are
//! huge or not finite, softmax scales at the GPU's bound and raw scores far from 1. Every test
//! skips itself, saying so, without a CUDA device; FLASHCORE_TEST_ARCH=sm80|sm90 picks the
//! kernel family (the H100 runs both), and outputs are poisoned before every kernel writes them.
#![cfg(feature = "cuda")]

mod common;
#[path = "common/gpu.rs"]
mod common_gpu;

use candle_core::{DType, Device, Result, Tensor};
use common::*;
use common_gpu::{arch_under_test, gpu};
use flashcore::{attention_slow, attention_with_lse, AttnParams, Mask};

fn cpu(t: &Tensor) -> Result<Tensor> {
    t.to_device(&Device::Cpu)
}

/// Window bounds of issue 53: small, at the int32 edge and far past it.
const BOUNDS: [usize; 7] = [
    63,
    1000,
    (1 << 31) - 1,
    1 << 31,
    1 << 32,
    1 << 40,
    usize::MAX,
];

/// `m` with every bound past `limit` dropped: the same mask for a problem of at most `limit`
/// query rows and keys, in a form the f64 reference computes without overflow.
fn ref_mask(m: Mask, limit: usize) -> Mask {
    let (l, r) = m.bounds();
    Mask::Window {
        left: l.filter(|&x| x < limit),
        right: r.filter(|&x| x < limit),
    }
    .canonical()
}

/// The masks a window bound `x` takes part in: (x, 0), (x, x), (x, 3), (2, x).
fn windows_with(x: usize) -> [Mask; 4] {
    let w = |left, right| Mask::Window {
        left: Some(left),
        right: Some(right),
    };
    [w(x, 0), w(x, x), w(x, 3), w(2, x)]
}

/// The largest error of `o` against the f64 reference `o_ref` that passes: twice the rounding
/// floor of the dtype at the reference's magnitude (the wrong answers these tests guard against
/// are off by O(1)).
fn tol(dtype: DType, o_ref: &Tensor) -> Result<f64> {
    Ok(2.0 * rounding_floor(dtype, max_abs(o_ref)?))
}

/// `attention_with_lse` on the GPU with `p` against the f64 reference with `p_ref` (the same
/// mask in reference-safe form): finite, within the tolerance rule (at most 2x the naive
/// same-precision error plus the rounding floor), LSE within f32 rounding. Returns (O, LSE) on
/// the CPU.
fn check_dense(
    what: &str,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    p: &AttnParams,
    p_ref: &AttnParams,
) -> Result<(Tensor, Tensor)> {
    let (o, lse) = attention_with_lse(q, k, v, p)?;
    let (o, lse) = (cpu(&o)?, cpu(&lse)?);
    assert_eq!(non_finite(&o)?, 0, "{what}: non-finite output elements");
    let (o_ref, lse_ref) = reference_f64(q, k, v, p_ref)?;
    let naive = cpu(&attention_slow(q, k, v, p_ref)?)?;
    let err = max_abs_diff(&o, &o_ref)?;
    let naive_err = max_abs_diff(&naive, &o_ref)?;
    let floor = rounding_floor(q.dtype(), max_abs(&o_ref)?);
    assert!(
        err <= 2.0 * naive_err + floor,
        "{what}: error {err:.3e} > 2 x naive {naive_err:.3e} + floor {floor:.1e}"
    );
    let lerr = lse_err(&lse, &lse_ref)?;
    assert!(lerr <= 2e-3, "{what}: lse error {lerr:.3e}");
    Ok((o, lse))
}

/// The kernel that runs a dense problem (for the log lines).
fn kernel_of(dev: &Device, p: &AttnParams, q: &Tensor, k: &Tensor, v: &Tensor) -> String {
    match dev {
        Device::Cuda(d) => {
            flashcore::cuda::describe(d, p, q, k, v).unwrap_or_else(|e| e.to_string())
        }
        _ => "cpu".into(),
    }
}

/// `Mask::Window` bounds at and past 2^31 - 1 (issue 53: the H100 gave finite wrong answers,
/// max diff 2.4-2.8, on both families for every bound >= 2^31 - 1). Each window is checked
/// against the f64 reference of the same mask; where its bounds reach past every key (left >=
/// seq_k, right >= seq_q) it must also give exactly the output of the equivalent canonical
/// mask (causal or none): the kernels run the same code for both. Shapes with seq_q = seq_k,
/// seq_q < seq_k and seq_q > seq_k (rows that see no key).
#[test]
fn huge_window_bounds_dense() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    arch_under_test();
    let mut n = 0;
    for (sq, sk, d) in [(64, 64, 64), (40, 100, 64), (100, 40, 64), (64, 64, 256)] {
        let (q, k, v) = qkv(1, sq, sk, 2, 2, d, DType::BF16, sq == sk, &dev)?;
        for x in BOUNDS {
            for mask in windows_with(x) {
                let what = format!("bf16 sq{sq} sk{sk} h2 d{d} {}", mask_name(mask));
                let p = AttnParams {
                    mask,
                    ..Default::default()
                };
                let p_ref = AttnParams {
                    mask: ref_mask(mask, sq.max(sk)),
                    ..Default::default()
                };
                let (o, lse) = check_dense(&what, &q, &k, &v, &p, &p_ref)?;
                // The mask the kernels run: bounds no row can reach dropped.
                let (l, r) = mask.bounds();
                let canon = Mask::Window {
                    left: l.filter(|&x| x < sk),
                    right: r.filter(|&x| x < sq),
                }
                .canonical();
                if matches!(canon, Mask::Causal | Mask::None) {
                    let pc = AttnParams {
                        mask: canon,
                        ..Default::default()
                    };
                    let (oc, lc) = attention_with_lse(&q, &k, &v, &pc)?;
                    let (eo, el) = (max_abs_diff(&o, &cpu(&oc)?)?, lse_err(&lse, &cpu(&lc)?)?);
                    assert!(
                        eo == 0.0 && el == 0.0,
                        "{what}: differs from {} (O {eo:.3e}, LSE {el:.3e})",
                        mask_name(canon)
                    );
                }
                n += 1;
            }
        }
        println!(
            "[OK] sq{sq} sk{sk} d{d}: {}",
            kernel_of(
                &dev,
                &AttnParams {
                    mask: Mask::Window {
                        left: Some(usize::MAX),
                        right: Some(0)
                    },
                    ..Default::default()
                },
                &q,
                &k,
                &v
            )
        );
    }
    println!("huge_window_bounds_dense: {n} cases passed");
    Ok(())
}

/// Reference of a packed batch, sequence by sequence, under `p` (the reference-safe mask).
fn varlen_reference(vl: &Varlen, p: &AttnParams) -> Result<(Tensor, Tensor)> {
    let (o, lse) = varlen_by_sequence(vl, p, false, |q, k, v, p| {
        let (o, l) = reference_f64(q, k, v, p)?;
        Ok((o, Some(l)))
    })?;
    Ok((o, lse.expect("the reference returns the LSE")))
}

/// O / LSE of a packed call against the packed reference (tolerance: twice the rounding floor).
fn check_packed(
    what: &str,
    o: &Tensor,
    lse: &Tensor,
    o_ref: &Tensor,
    lse_ref: &Tensor,
) -> Result<()> {
    let (o, lse) = (cpu(o)?, cpu(lse)?);
    assert_eq!(non_finite(&o)?, 0, "{what}: non-finite output elements");
    let err = max_abs_diff(&o, o_ref)?;
    let t = tol(o.dtype(), o_ref)?;
    assert!(err <= t, "{what}: error {err:.3e} > {t:.3e}");
    let lerr = lse_err(&lse, lse_ref)?;
    assert!(lerr <= 2e-3, "{what}: lse error {lerr:.3e}");
    Ok(())
}

/// Huge window bounds on packed batches (the general / varlen bodies; the bounds are max_seqlen_q
/// / _k there) and on paged caches: a paged prefill and split-KV decodes through the page table
/// (packed and dense queries of 1-16 rows over up to 1000 keys, so the key range splits).
#[test]
fn huge_window_bounds_varlen_and_paged() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    arch_under_test();
    let mut rng = Rng::from_clock("huge_window_bounds_varlen_and_paged");
    let mut n = 0;
    let prefill = Varlen::random(
        &[(64, 64), (30, 100), (100, 30), (1, 77)],
        4,
        2,
        64,
        DType::BF16,
        true,
        &dev,
    )?;
    let decode = Varlen::random(
        &[(1, 700), (3, 1000), (16, 300)],
        4,
        2,
        64,
        DType::BF16,
        false,
        &dev,
    )?;
    let dense_decode = Varlen::random(
        &[(1, 700), (1, 1000), (1, 300)],
        8,
        2,
        64,
        DType::BF16,
        false,
        &dev,
    )?;
    let paged_prefill = Paged::from_varlen(&prefill, 16, 0, &mut rng)?;
    let paged_decode = Paged::from_varlen(&decode, 16, 0, &mut rng)?;
    let paged_dense = Paged::from_varlen(&dense_decode, 32, 0, &mut rng)?;
    for x in BOUNDS {
        for mask in windows_with(x) {
            let p = AttnParams {
                mask,
                ..Default::default()
            };
            for (name, vl, paged) in [
                ("varlen", &prefill, None),
                ("paged varlen prefill", &prefill, Some(&paged_prefill)),
                ("paged varlen decode", &decode, Some(&paged_decode)),
                ("paged dense decode", &dense_decode, Some(&paged_dense)),
            ] {
                let what = format!("{name} {} {}", vl.shape_name(), mask_name(mask));
                let p_ref = AttnParams {
                    mask: ref_mask(mask, vl.max_q.max(vl.max_k) + 1),
                    ..Default::default()
                };
                let (o_ref, lse_ref) = varlen_reference(vl, &p_ref)?;
                let (o, lse) = match (paged, name) {
                    (None, _) => vl.run(&p)?,
                    (Some(pg), "paged dense decode") => pg.run_dense(vl, &p)?,
                    (Some(pg), _) => pg.run_varlen(vl, &p)?,
                };
                check_packed(&what, &o, &lse, &o_ref, &lse_ref)?;
                n += 1;
            }
        }
    }
    println!("huge_window_bounds_varlen_and_paged: {n} cases passed");
    Ok(())
}

/// `t` (on any device, any dtype) with the rows `rows` = (batch, row, head) of a (b, s, h, d)
/// tensor set to NaN, on `t`'s device in `t`'s dtype.
fn with_nan_rows(t: &Tensor, rows: &[(usize, usize, usize)]) -> Result<Tensor> {
    let (b, s, h, d) = t.dims4()?;
    let mut x = cpu(t)?
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    for &(bi, r, hi) in rows {
        let at = ((bi * s + r) * h + hi) * d;
        x[at..at + d].iter_mut().for_each(|e| *e = f32::NAN);
    }
    Tensor::from_vec(x, (b, s, h, d), &Device::Cpu)?
        .to_dtype(t.dtype())?
        .to_device(t.device())
}

/// `t` with the same rows set to zero instead (the reference for rows that never see them).
fn with_zero_rows(t: &Tensor, rows: &[(usize, usize, usize)]) -> Result<Tensor> {
    let (b, s, h, d) = t.dims4()?;
    let mut x = cpu(t)?
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    for &(bi, r, hi) in rows {
        let at = ((bi * s + r) * h + hi) * d;
        x[at..at + d].iter_mut().for_each(|e| *e = 0.0);
    }
    Tensor::from_vec(x, (b, s, h, d), &Device::Cpu)?
        .to_dtype(t.dtype())?
        .to_device(t.device())
}

/// How one output row came out against the reference.
#[derive(Debug, PartialEq)]
enum RowIs {
    Nan,
    Correct,
}

/// Classifies every output row (b, row, head) of a (b, sq, hq, d) output against `o_ref`:
/// all-NaN, or finite and within `t` of the reference. Anything else (a finite wrong row, a
/// partly NaN row, an infinity) fails.
fn classify(what: &str, o: &Tensor, o_ref: &Tensor, t: f64) -> Result<Vec<RowIs>> {
    let (b, sq, hq, d) = o.dims4()?;
    let o = cpu(o)?
        .to_dtype(DType::F64)?
        .flatten_all()?
        .to_vec1::<f64>()?;
    let r = o_ref
        .to_dtype(DType::F64)?
        .flatten_all()?
        .to_vec1::<f64>()?;
    let mut out = Vec::with_capacity(b * sq * hq);
    for row in 0..b * sq * hq {
        let (x, y) = (&o[row * d..row * d + d], &r[row * d..row * d + d]);
        let (bi, i, h) = (row / (sq * hq), row / hq % sq, row % hq);
        if x.iter().all(|e| e.is_nan()) {
            out.push(RowIs::Nan);
        } else {
            let err = x
                .iter()
                .zip(y)
                .map(|(a, b)| {
                    if a.is_finite() {
                        (a - b).abs()
                    } else {
                        f64::INFINITY
                    }
                })
                .fold(0f64, f64::max);
            assert!(
                err <= t,
                "{what}: row (b{bi}, i{i}, h{h}) is neither NaN nor correct: error {err:.3e} > {t:.3e}"
            );
            out.push(RowIs::Correct);
        }
    }
    Ok(out)
}

/// NaN in one V row (batch 0, head 0, key `nan_key`) of a causal problem. The numeric contract's
/// GPU rule (docs: FlashAttention-style kernels multiply the masked probabilities, 0, by the V
/// tile): rows that see the NaN key are NaN; rows of the same head whose query tile loads the
/// key's tile may be NaN too; every other row (rows whose query tile ends more than 512 rows
/// before the key, other heads, other batch entries) is finite and correct. And never a finite
/// wrong row. The same NaN in the K row leaks nowhere: masked scores are replaced, not scaled.
#[test]
fn nan_in_an_unseen_v_row() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    arch_under_test();
    for (sq, sk, nan_key, d) in [
        (64, 64, 63, 64),
        (1024, 1024, 1000, 64),
        (300, 300, 299, 256),
        (4, 1000, 998, 64), // split-KV decode: rows 0-1 do not see key 998, rows 2-3 do
    ] {
        let (q, k, v) = qkv(2, sq, sk, 2, 2, d, DType::BF16, false, &dev)?;
        let bad = [(0, nan_key, 0)];
        let p = AttnParams {
            mask: Mask::Causal,
            ..Default::default()
        };
        let what = format!("bf16 b2 sq{sq} sk{sk} h2 d{d} causal, V row {nan_key} NaN");
        let (o_ref, lse_ref) = reference_f64(&q, &k, &with_zero_rows(&v, &bad)?, &p)?;
        let t = tol(DType::BF16, &o_ref)?;
        let (o, lse) = attention_with_lse(&q, &k, &with_nan_rows(&v, &bad)?, &p)?;
        // the LSE does not read V: finite and correct everywhere
        let lerr = lse_err(&cpu(&lse)?, &lse_ref)?;
        assert!(lerr <= 2e-3, "{what}: lse error {lerr:.3e}");
        let rows = classify(&what, &o, &o_ref, t)?;
        let at = |bi: usize, i: usize, h: usize| &rows[(bi * sq + i) * 2 + h];
        let diag = |i: usize| i + sk - sq;
        let mut leaked = 0;
        for i in 0..sq {
            for (bi, h) in [(0, 1), (1, 0), (1, 1)] {
                assert_eq!(*at(bi, i, h), RowIs::Correct, "{what}: b{bi} h{h} row {i}");
            }
            if diag(i) >= nan_key {
                assert_eq!(*at(0, i, 0), RowIs::Nan, "{what}: row {i} sees the NaN key");
            } else if diag(i) + 512 < nan_key {
                assert_eq!(
                    *at(0, i, 0),
                    RowIs::Correct,
                    "{what}: row {i} is far from it"
                );
            } else if *at(0, i, 0) == RowIs::Nan {
                leaked += 1;
            }
        }
        println!(
            "[OK] {what}: {leaked} rows that do not see the key came out NaN (documented); {}",
            kernel_of(&dev, &p, &q, &k, &v)
        );
        // The same key's K row NaN: only rows that see it are NaN.
        let (o, _) = attention_with_lse(&q, &with_nan_rows(&k, &bad)?, &v, &p)?;
        let (o_ref, _) = reference_f64(&q, &with_zero_rows(&k, &bad)?, &v, &p)?;
        let rows = classify(&what, &o, &o_ref, tol(DType::BF16, &o_ref)?)?;
        for i in 0..sq {
            let want = if diag(i) >= nan_key {
                RowIs::Nan
            } else {
                RowIs::Correct
            };
            assert_eq!(rows[i * 2], want, "{what}, as a K row instead: row {i}");
        }
    }
    // Packed batches: the NaN in sequence 0's last V row never reaches sequence 1.
    let vl = Varlen::random(
        &[(64, 64), (64, 64), (30, 90)],
        2,
        1,
        64,
        DType::BF16,
        false,
        &dev,
    )?;
    let bad = [(0, 63, 0)];
    let v4 = vl.v.unsqueeze(0)?;
    let mut nan_vl = vl.clone();
    nan_vl.v = with_nan_rows(&v4, &bad)?.squeeze(0)?;
    let mut zero_vl = vl.clone();
    zero_vl.v = with_zero_rows(&v4, &bad)?.squeeze(0)?;
    let p = AttnParams {
        mask: Mask::Causal,
        ..Default::default()
    };
    let (o_ref, _) = varlen_reference(&zero_vl, &p)?;
    let (o, _) = nan_vl.run(&p)?;
    let what = format!("varlen {} causal, V row 63 NaN", vl.shape_name());
    let rows = classify(
        &what,
        &o.unsqueeze(0)?,
        &o_ref.unsqueeze(0)?,
        tol(DType::BF16, &o_ref)?,
    )?;
    for (r, row) in rows.iter().enumerate() {
        let packed = r / 2;
        if packed >= 64 {
            assert_eq!(
                *row,
                RowIs::Correct,
                "{what}: packed row {packed} head {}",
                r % 2
            );
        }
    }
    println!("[OK] {what}: the other sequences are finite and correct");
    Ok(())
}

/// The dense (b, hq) slopes tensor.
fn slopes(v: &[f32], shape: &[usize], dev: &Device) -> Result<Tensor> {
    Tensor::from_vec(v.to_vec(), shape, dev)
}

/// ALiBi slopes so large that every key but the row's own diagonal one gets weight 0 (issue 53:
/// 1e38 gave all-NaN on the GPU, the slope divided by the scale overflowing to inf and inf * 0 =
/// NaN at distance 0): O must be exactly the diagonal key's V row and the LSE that key's scaled
/// score. Prefill (sm80 general body; d256 the sm90 `_cap` twins), no mask and causal, and the
/// split-KV decode.
#[test]
fn huge_alibi_slopes() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    arch_under_test();
    let mut n = 0;
    for (sq, sk, d, mask) in [
        (64, 64, 64, Mask::Causal),
        (64, 64, 64, Mask::None),
        (200, 200, 256, Mask::Causal),
        (130, 130, 256, Mask::None),
        (1, 1000, 64, Mask::None),
        (4, 1000, 64, Mask::Causal),
    ] {
        let hq = 4;
        let (q, k, v) = qkv(1, sq, sk, hq, 2, d, DType::BF16, false, &dev)?;
        for big in [1e30f32, 1e38, f32::MAX] {
            let sl = slopes(&[big, big, big / 2.0, big], &[hq], &dev)?;
            let p = AttnParams {
                mask,
                alibi_slopes: Some(sl),
                ..Default::default()
            };
            let what = format!(
                "bf16 sq{sq} sk{sk} h4/2 d{d} {} slope {big:e}",
                mask_name(mask)
            );
            let (o, lse) = attention_with_lse(&q, &k, &v, &p)?;
            let (o, lse) = (cpu(&o)?, cpu(&lse)?);
            // expected: row i = V[diag i] of its K/V head; LSE = scale * q_i . k_diag
            let vv = cpu(&v)?.to_dtype(DType::F64)?;
            let qq = cpu(&q)?.to_dtype(DType::F64)?;
            let kk = cpu(&k)?.to_dtype(DType::F64)?;
            let scale = 1.0 / (d as f64).sqrt();
            let o64 = o.to_dtype(DType::F64)?;
            let lse64 = lse.to_dtype(DType::F64)?;
            for i in 0..sq {
                let j = i + sk - sq;
                for h in 0..hq {
                    let want = vv.get(0)?.get(j)?.get(h / 2)?;
                    let got = o64.get(0)?.get(i)?.get(h)?;
                    let e = max_abs_diff(&got, &want)?;
                    let t = rounding_floor(DType::BF16, max_abs(&want)?);
                    assert!(
                        e <= t,
                        "{what}: row {i} head {h} is not V[{j}] (max diff {e:.3e})"
                    );
                    let s = (qq.get(0)?.get(i)?.get(h)? * kk.get(0)?.get(j)?.get(h / 2)?)?
                        .sum_all()?
                        .to_scalar::<f64>()?
                        * scale;
                    let l = lse64.get(0)?.get(h)?.get(i)?.to_scalar::<f64>()?;
                    assert!(
                        (l - s).abs() <= 1e-3 * (1.0 + s.abs()),
                        "{what}: row {i} head {h}: LSE {l} != diagonal score {s}"
                    );
                }
            }
            n += 1;
        }
        println!(
            "[OK] sq{sq} sk{sk} d{d} {}: {}",
            mask_name(mask),
            kernel_of(
                &dev,
                &AttnParams {
                    mask,
                    alibi_slopes: Some(slopes(&[1.0; 4], &[hq], &dev)?),
                    ..Default::default()
                },
                &q,
                &k,
                &v
            )
        );
    }
    println!("huge_alibi_slopes: {n} cases passed");
    Ok(())
}

/// Non-finite ALiBi slopes (NaN, +inf, -inf): every row of that (sequence, head) that sees a key
/// has a NaN output, as a NaN input; rows that see no key stay zeros with LSE -inf; the other
/// heads and sequences are finite and correct. (b, hq) slopes, so batch entry 0's slopes are all
/// finite; seq_q > seq_k causal, so the first rows of every head see no key, and without a mask,
/// where those rows see only keys behind their diagonal (ordinary slopes, checked against the
/// reference).
#[test]
fn non_finite_alibi_slopes() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    arch_under_test();
    for (sq, sk, d, mask) in [
        (80, 64, 64, Mask::Causal),
        (80, 64, 256, Mask::Causal),
        (4, 1000, 64, Mask::Causal),
        (80, 64, 64, Mask::None),
        (200, 130, 256, Mask::None),
    ] {
        let (b, hq) = (2, 4);
        let (q, k, v) = qkv(b, sq, sk, hq, 2, d, DType::BF16, false, &dev)?;
        let good = [0.5f32, 0.25, 0.125, 0.0625];
        let mut both = good.to_vec();
        both.extend([f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.3]);
        let p = AttnParams {
            mask,
            alibi_slopes: Some(slopes(&both, &[b, hq], &dev)?),
            ..Default::default()
        };
        let what = format!(
            "bf16 b2 sq{sq} sk{sk} h4/2 d{d} {}, slopes {both:?}",
            mask_name(mask)
        );
        let (o, lse) = attention_with_lse(&q, &k, &v, &p)?;
        let (o, lse) = (cpu(&o)?, cpu(&lse)?);
        // reference: batch 0 with its slopes, batch 1 with the non-finite ones replaced (the
        // rows of those heads are checked separately)
        let mut sane = both.clone();
        sane[4..7].copy_from_slice(&[0.0, 0.0, 0.0]);
        let p_ref = AttnParams {
            alibi_slopes: Some(slopes(&sane, &[b, hq], &Device::Cpu)?),
            ..p.clone()
        };
        let (o_ref, lse_ref) = per_batch(&q, &k, &v, &p_ref, |q, k, v, p| {
            let (o, l) = reference_f64(q, k, v, p)?;
            Ok((o, Some(l)))
        })?;
        let lse_ref = lse_ref.expect("reference LSE");
        let t = tol(DType::BF16, &o_ref)?;
        let rows = classify(&what, &o, &o_ref, t)?;
        for bi in 0..b {
            for i in 0..sq {
                let sees = mask == Mask::None || i + sk >= sq; // row i sees a key
                for h in 0..hq {
                    let bad = bi == 1 && h < 3;
                    let row = &rows[(bi * sq + i) * hq + h];
                    let l = lse.get(bi)?.get(h)?.get(i)?.to_scalar::<f32>()?;
                    let lr = lse_ref.get(bi)?.get(h)?.get(i)?.to_scalar::<f64>()?;
                    match (bad, sees) {
                        (true, true) => assert_eq!(*row, RowIs::Nan, "{what}: b{bi} h{h} row {i}"),
                        (_, false) => {
                            assert_eq!(*row, RowIs::Correct, "{what}: b{bi} h{h} empty row {i}");
                            assert_eq!(
                                l,
                                f32::NEG_INFINITY,
                                "{what}: b{bi} h{h} empty row {i} LSE"
                            );
                        }
                        (false, true) => {
                            assert_eq!(*row, RowIs::Correct, "{what}: b{bi} h{h} row {i}");
                            assert!(
                                (l as f64 - lr).abs() <= 2e-3,
                                "{what}: b{bi} h{h} row {i}: LSE {l} against {lr}"
                            );
                        }
                    }
                }
            }
        }
        println!("[OK] {what}: {}", kernel_of(&dev, &p, &q, &k, &v));
    }
    Ok(())
}

/// Softmax scales: the GPU kernels fold `scale * log2(e)` into the exponent of raw f32 scores and
/// take 0 < scale <= 2^10 (`flashcore::cuda::GPU_MAX_SCALE`). Above it (f32::MAX gave all-NaN)
/// the call is a clear error naming softmax_scale. At 2^10, on integer-valued q and k
/// (scores 1 or more apart, ties exact), the answer is the f64 reference's: each row's argmax
/// key, ties shared. Raw dot products up to ~1e29 (q and k entries of 2^46) with a scale of
/// 2^-95 keep the usual accuracy: the scores are accumulated unscaled in f32.
#[test]
fn softmax_scale_bounds() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    arch_under_test();
    for (sq, sk, d, mask) in [
        (64, 64, 64, Mask::Causal),
        (100, 300, 64, Mask::None),
        (200, 200, 256, Mask::Causal),
        (3, 1000, 64, Mask::Causal),
    ] {
        let (q, k, v) = qkv(1, sq, sk, 4, 2, d, DType::BF16, false, &dev)?;
        let shape = format!("bf16 sq{sq} sk{sk} h4/2 d{d} {}", mask_name(mask));
        for scale in [f32::MAX, 1e30, 65536.0, 1024.5, f32::INFINITY] {
            let p = AttnParams {
                mask,
                softmax_scale: Some(scale),
                ..Default::default()
            };
            let e = attention_with_lse(&q, &k, &v, &p).unwrap_err().to_string();
            assert!(names(&e, "softmax_scale"), "{shape} scale {scale:e}: {e}");
        }
        let p = AttnParams {
            mask,
            softmax_scale: Some(flashcore::cuda::GPU_MAX_SCALE),
            ..Default::default()
        };
        let what = format!("{shape} scale 2^10, integer q and k");
        let int = |t: &Tensor| t.to_dtype(DType::F32)?.round()?.to_dtype(DType::BF16);
        let (qi, ki) = (int(&q)?, int(&k)?);
        let (o, lse) = attention_with_lse(&qi, &ki, &v, &p)?;
        let (o, lse) = (cpu(&o)?, cpu(&lse)?.to_dtype(DType::F64)?);
        assert_eq!(non_finite(&o)?, 0, "{what}: non-finite output elements");
        let (o_ref, lse_ref) = reference_f64(&qi, &ki, &v, &p)?;
        let err = max_abs_diff(&o, &o_ref)?;
        let t = tol(DType::BF16, &o_ref)?;
        assert!(err <= t, "{what}: error {err:.3e} > {t:.3e}");
        // LSE ~ 1e3 x the top score: relative f32 rounding
        let rel = ((&lse - &lse_ref)?.abs()? / (lse_ref.abs()? + 1.0)?)?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f64>()?;
        assert!(rel <= 1e-5, "{what}: LSE relative error {rel:.3e}");
        println!(
            "[OK] {what}: err {err:.2e}; {}",
            kernel_of(&dev, &p, &qi, &ki, &v)
        );
        // raw scores ~1e29, scaled back to ~1
        let big = 2f64.powi(46);
        let (qb, kb) = (
            (q.to_dtype(DType::F32)? * big)?,
            (k.to_dtype(DType::F32)? * big)?,
        );
        let (qb, kb) = (qb.to_dtype(DType::BF16)?, kb.to_dtype(DType::BF16)?);
        let p = AttnParams {
            mask,
            softmax_scale: Some(2f32.powi(-92) / (d as f32).sqrt()),
            ..Default::default()
        };
        check_dense(&format!("{shape} q, k x 2^46"), &qb, &kb, &v, &p, &p)?;
        println!("[OK] {shape} q, k x 2^46");
    }
    Ok(())
}
