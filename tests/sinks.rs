//! Attention sinks (`AttnParams::sinks`) on the CPU: against the identity that a sink only
//! rescales a row, `o_sink = o / (1 + e^(sink - lse))` and `lse_sink = ln(e^lse + e^sink)` with
//! `(o, lse)` the same call without sinks; against the f64 model of tests/common; on dense,
//! packed and paged batches, with every mask and modifier; validation and non-finite sinks.

mod common;

use candle_core::{DType, Device, Result, Tensor};
use common::*;
use flashcore::{
    attention, attention_paged_with_lse, attention_slow, attention_varlen_with_lse,
    attention_with_lse, AttnParams, Mask,
};

/// Sinks for `hq` heads: spread over [-3, 5] (some below, some above typical LSEs of a few
/// nats), one large (20: the sink takes almost all the weight) and, from 3 heads on, one `-inf`
/// (no sink).
fn sinks(hq: usize, dev: &Device) -> Result<Tensor> {
    let mut v: Vec<f32> = (0..hq)
        .map(|h| -3.0 + 8.0 * ((h * 7 + 3) % 11) as f32 / 10.0)
        .collect();
    if hq >= 2 {
        v[1] = 20.0;
    }
    if hq >= 3 {
        v[2] = f32::NEG_INFINITY;
    }
    Tensor::from_vec(v, hq, dev)
}

fn logaddexp(a: f64, b: f64) -> f64 {
    let m = a.max(b);
    if m == f64::NEG_INFINITY {
        return m;
    }
    m + ((a - m).exp() + (b - m).exp()).ln()
}

/// Checks `(o_s, lse_s)` (with sinks) against the identity applied to `(o, lse)` (without).
/// `head_dim_of_lse`: which dim of the LSE is the head (1 for (b, hq, sq), 0 for (hq, total_q));
/// the head of an O row is dim `o.rank() - 2`. Heads whose sink is -inf must match bit for bit.
fn check_identity(
    what: &str,
    (o, lse): (&Tensor, &Tensor),
    (o_s, lse_s): (&Tensor, &Tensor),
    sinks: &[f32],
    head_dim_of_lse: usize,
) -> Result<()> {
    let hq = sinks.len();
    let dtype = o.dtype();
    let rank = o.rank();
    let d = o.dims()[rank - 1];
    let of = |t: &Tensor| -> Result<Vec<f64>> { t.to_dtype(DType::F64)?.flatten_all()?.to_vec1() };
    let (ov, osv) = (of(o)?, of(o_s)?);
    let (lv, lsv) = (of(lse)?, of(lse_s)?);
    let lse_dims = lse.dims().to_vec();
    // LSE index -> head
    let lse_head = |i: usize| -> usize {
        let inner: usize = lse_dims[head_dim_of_lse + 1..].iter().product();
        (i / inner) % hq
    };
    for (i, (&l, &ls)) in lv.iter().zip(&lsv).enumerate() {
        let h = lse_head(i);
        let want = logaddexp(l, sinks[h] as f64);
        if sinks[h] == f32::NEG_INFINITY {
            assert_eq!(
                l.to_bits(),
                ls.to_bits(),
                "{what}: lse {i} (head {h}, sink -inf) differs from no sink"
            );
        }
        let err = if want.is_infinite() || ls.is_infinite() {
            if want == ls {
                0.0
            } else {
                f64::INFINITY
            }
        } else {
            (want - ls).abs()
        };
        assert!(
            err <= 2e-6 * (1.0 + want.abs()),
            "{what}: lse {i} (head {h}): {ls} with sinks, want logaddexp({l}, {}) = {want}",
            sinks[h]
        );
    }
    // O: row r of head h has factor 1 / (1 + e^(sink - lse)); the LSE of a row is found from
    // its O position: O (.., rows, hq, d) with rows laid out as in the LSE.
    let o_dims = o.dims().to_vec();
    let floor = rounding_floor(dtype, 1.0);
    for (x, (&a, &b)) in ov.iter().zip(&osv).enumerate() {
        let h = (x / d) % hq;
        // the row index within the O layout, and the matching LSE entry
        let row = x / (d * hq);
        let li = match head_dim_of_lse {
            // dense (b, sq, hq, d) against (b, hq, sq)
            1 => {
                let sq = o_dims[1];
                let (bi, i) = (row / sq, row % sq);
                (bi * hq + h) * sq + i
            }
            // packed (total, hq, d) against (hq, total)
            _ => {
                let total = o_dims[0];
                h * total + row
            }
        };
        let l = lv[li];
        let f = if sinks[h] == f32::NEG_INFINITY {
            1.0
        } else {
            1.0 / (1.0 + (sinks[h] as f64 - l).exp())
        };
        let want = a * f;
        if sinks[h] == f32::NEG_INFINITY {
            assert_eq!(
                a.to_bits(),
                b.to_bits(),
                "{what}: O element {x} (head {h}, sink -inf) differs from no sink"
            );
        }
        // the sink output is rounded once from f32, the identity's input once too
        let tol = 2.0 * floor * (1.0 + a.abs()) + 1e-6 * a.abs();
        assert!(
            (want - b).abs() <= tol,
            "{what}: O element {x} (head {h}, lse {l}, sink {}): {b} with sinks, want {a} * {f} = {want}",
            sinks[h]
        );
    }
    Ok(())
}

fn params(mask: Mask, which: usize, hq: usize, b: usize, dev: &Device) -> Result<AttnParams> {
    Ok(AttnParams {
        mask,
        softcap: (which % 3 == 1).then_some(15.0),
        alibi_slopes: match which % 3 {
            2 if b > 0 => Some(Tensor::rand(0f32, 0.3, (b, hq), dev)?),
            2 => Some(Tensor::rand(0f32, 0.3, hq, dev)?),
            _ => None,
        },
        ..Default::default()
    })
}

const MASKS: [Mask; 5] = [
    Mask::None,
    Mask::Causal,
    Mask::Window {
        left: Some(5),
        right: Some(0),
    },
    Mask::Window {
        left: Some(3),
        right: Some(2),
    },
    Mask::Window {
        left: Some(127),
        right: Some(0),
    },
];

/// Dense batches: awkward lengths (1, 113; sq != sk, sq > sk under causal so that rows see no
/// key), GQA, every mask, softcap and ALiBi, f32 / bf16 / f64.
#[test]
fn sinks_dense_identity() -> Result<()> {
    let dev = Device::Cpu;
    let shapes = [
        (2, 1, 1, 4, 2, 64),
        (1, 113, 113, 8, 2, 64),
        (2, 113, 37, 4, 1, 32),
        (1, 7, 200, 6, 3, 16),
        (1, 64, 64, 3, 3, 128),
    ];
    let mut n = 0;
    for (si, &(b, sq, sk, hq, hkv, d)) in shapes.iter().enumerate() {
        for (mi, &mask) in MASKS.iter().enumerate() {
            for dtype in [DType::F32, DType::BF16, DType::F64] {
                let which = si + mi;
                let (q, k, v) = qkv(b, sq, sk, hq, hkv, d, dtype, si % 2 == 1, &dev)?;
                // per-batch slopes (b, hq) for the dense path too
                let p = params(mask, which, hq, b, &dev)?;
                let sn = sinks(hq, &dev)?;
                let ps = AttnParams {
                    sinks: Some(sn.clone()),
                    ..p.clone()
                };
                let (o, lse) = attention_with_lse(&q, &k, &v, &p)?;
                let (o_s, lse_s) = attention_with_lse(&q, &k, &v, &ps)?;
                let what = format!(
                    "{dtype:?} b{b} sq{sq} sk{sk} h{hq}/{hkv} d{d} {} softcap={:?} alibi={}",
                    mask_name(mask),
                    p.softcap,
                    p.alibi_slopes.is_some()
                );
                check_identity(&what, (&o, &lse), (&o_s, &lse_s), &sn.to_vec1()?, 1)?;
                // the f64 model of tests/common, with the sink in its max and sum
                if dtype != DType::BF16 {
                    let pr = AttnParams {
                        alibi_slopes: None,
                        ..ps.clone()
                    };
                    let (o_s, lse_s) = attention_with_lse(&q, &k, &v, &pr)?;
                    let (o_ref, lse_ref) = reference_f64(&q, &k, &v, &pr)?;
                    let err = max_abs_diff(&o_s, &o_ref)?;
                    assert!(
                        err <= 1e-5,
                        "{what}: sinks against the f64 model: O error {err:.3e}"
                    );
                    let lerr = lse_err(&lse_s, &lse_ref)?;
                    assert!(
                        lerr <= 1e-5 * (1.0 + max_abs(&lse_ref.clamp(-1e30, 1e30)?)?),
                        "{what}: sinks against the f64 model: LSE error {lerr:.3e}"
                    );
                }
                n += 1;
            }
        }
    }
    println!("sinks_dense_identity: {n} cases");
    Ok(())
}

/// The eager twin (`attention_slow`) takes sinks too and agrees with the fused path.
#[test]
fn sinks_eager_matches_fused() -> Result<()> {
    let dev = Device::Cpu;
    for (mi, &mask) in MASKS.iter().enumerate() {
        let (b, sq, sk, hq, hkv, d) = (2, 37, 29, 6, 2, 32);
        let (q, k, v) = qkv(b, sq, sk, hq, hkv, d, DType::F32, false, &dev)?;
        let p = AttnParams {
            sinks: Some(sinks(hq, &dev)?),
            ..params(mask, mi, hq, 0, &dev)?
        };
        let fused = attention(&q, &k, &v, &p)?;
        let eager = attention_slow(&q, &k, &v, &p)?;
        let err = max_abs_diff(&fused, &eager)?;
        assert!(err <= 1e-5, "{}: eager vs fused {err:.3e}", mask_name(mask));
    }
    Ok(())
}

/// Packed batches with empty sequences on either side (lengths 0, 1, 113), GQA, windows.
#[test]
fn sinks_varlen_identity() -> Result<()> {
    let dev = Device::Cpu;
    let (hq, hkv, d) = (6, 2, 32);
    let lens: [(usize, usize); 5] = [(3, 0), (0, 5), (1, 1), (113, 113), (17, 60)];
    let (tq, tk) = lens.iter().fold((0, 0), |(a, b), &(q, k)| (a + q, b + k));
    let cu = |f: &dyn Fn(&(usize, usize)) -> usize| -> Result<Tensor> {
        let mut v = vec![0u32];
        for l in &lens {
            v.push(v.last().unwrap() + f(l) as u32);
        }
        Tensor::new(v.as_slice(), &dev)
    };
    let (cu_q, cu_k) = (cu(&|l| l.0)?, cu(&|l| l.1)?);
    let (mq, mk) = (113, 113);
    for (mi, &mask) in MASKS.iter().enumerate() {
        for dtype in [DType::F32, DType::BF16] {
            let q = Tensor::randn(0f32, 1., (tq, hq, d), &dev)?.to_dtype(dtype)?;
            let k = Tensor::randn(0f32, 1., (tk, hkv, d), &dev)?.to_dtype(dtype)?;
            let v = Tensor::randn(0f32, 1., (tk, hkv, d), &dev)?.to_dtype(dtype)?;
            let p = params(mask, mi, hq, lens.len(), &dev)?;
            let sn = sinks(hq, &dev)?;
            let ps = AttnParams {
                sinks: Some(sn.clone()),
                ..p.clone()
            };
            let (o, lse) = attention_varlen_with_lse(&q, &k, &v, &cu_q, &cu_k, mq, mk, &p)?;
            let (o_s, lse_s) = attention_varlen_with_lse(&q, &k, &v, &cu_q, &cu_k, mq, mk, &ps)?;
            let what = format!("varlen {dtype:?} {}", mask_name(mask));
            check_identity(&what, (&o, &lse), (&o_s, &lse_s), &sn.to_vec1()?, 0)?;
            // the first sequence has rows and no key: O zeros, LSE the sink
            let l0 = lse_s.narrow(1, 0, 3)?.to_vec2::<f32>()?;
            let sv = sn.to_vec1::<f32>()?;
            for (h, row) in l0.iter().enumerate() {
                for &x in row {
                    assert_eq!(
                        x.to_bits(),
                        sv[h].to_bits(),
                        "{what}: keyless row, head {h}"
                    );
                }
            }
            assert_eq!(max_abs(&o_s.narrow(0, 0, 3)?)?, 0.0, "{what}: keyless rows");
        }
    }
    // a batch with no keys at all: answered without a kernel, LSE = the sinks
    let q = Tensor::randn(0f32, 1., (4, hq, d), &dev)?;
    let k = Tensor::zeros((0, hkv, d), DType::F32, &dev)?;
    let cq = Tensor::new(&[0u32, 4], &dev)?;
    let ck = Tensor::new(&[0u32, 0], &dev)?;
    let sn = sinks(hq, &dev)?;
    let p = AttnParams {
        sinks: Some(sn.clone()),
        ..Default::default()
    };
    let (o, lse) = attention_varlen_with_lse(&q, &k, &k, &cq, &ck, 4, 1, &p)?;
    assert_eq!(max_abs(&o)?, 0.0);
    let want = sn.reshape((hq, 1))?.broadcast_as((hq, 4))?;
    assert_eq!(
        lse_err(&lse, &want)?,
        0.0,
        "keyless batch: LSE must be the sinks"
    );
    // and one with no query rows at all: empty outputs
    let q0 = Tensor::zeros((0, hq, d), DType::F32, &dev)?;
    let c0 = Tensor::new(&[0u32, 0], &dev)?;
    let (o, lse) = attention_varlen_with_lse(&q0, &k, &k, &c0, &ck, 1, 1, &p)?;
    assert_eq!((o.dims(), lse.dims()), (&[0, hq, d][..], &[hq, 0][..]));
    Ok(())
}

/// A paged cache (pages of 16, shared and out-of-order pages), dense and packed queries.
#[test]
fn sinks_paged_identity() -> Result<()> {
    let dev = Device::Cpu;
    let (hq, hkv, d, ps) = (8, 2, 64, 16);
    let num_pages = 12;
    let kp = Tensor::randn(0f32, 1., (num_pages, ps, hkv, d), &dev)?;
    let vp = Tensor::randn(0f32, 1., (num_pages, ps, hkv, d), &dev)?;
    let table = Tensor::new(&[[3u32, 0, 7, 1], [5, 3, 9, 11], [2, 4, 6, 8]], &dev)?;
    let lens = Tensor::new(&[50u32, 1, 0], &dev)?;
    let sn = sinks(hq, &dev)?;
    for (mi, &mask) in MASKS.iter().enumerate() {
        let p = params(mask, mi, hq, 3, &dev)?;
        let psk = AttnParams {
            sinks: Some(sn.clone()),
            ..p.clone()
        };
        let q = Tensor::randn(0f32, 1., (3, 5, hq, d), &dev)?;
        let (o, lse) = attention_paged_with_lse(&q, &kp, &vp, &table, &lens, &p)?;
        let (o_s, lse_s) = attention_paged_with_lse(&q, &kp, &vp, &table, &lens, &psk)?;
        let what = format!("paged {}", mask_name(mask));
        check_identity(&what, (&o, &lse), (&o_s, &lse_s), &sn.to_vec1()?, 1)?;
        let cq = Tensor::new(&[0u32, 2, 3, 7], &dev)?;
        let qv = Tensor::randn(0f32, 1., (7, hq, d), &dev)?;
        let (o, lse) =
            flashcore::attention_paged_varlen_with_lse(&qv, &kp, &vp, &table, &lens, &cq, 4, &p)?;
        let (o_s, lse_s) =
            flashcore::attention_paged_varlen_with_lse(&qv, &kp, &vp, &table, &lens, &cq, 4, &psk)?;
        let what = format!("paged varlen {}", mask_name(mask));
        check_identity(&what, (&o, &lse), (&o_s, &lse_s), &sn.to_vec1()?, 0)?;
    }
    Ok(())
}

/// Non-finite sinks: -inf is no sink (bit for bit), +inf takes the whole weight (O zeros, LSE
/// +inf), NaN makes the rows that see a key NaN and the LSE of the others NaN (O zeros).
#[test]
fn sinks_non_finite() -> Result<()> {
    let dev = Device::Cpu;
    // causal, 6 rows over 4 keys: rows 0 and 1 see no key
    let (b, sq, sk, hq, hkv, d) = (1, 6, 4, 3, 1, 16);
    let (q, k, v) = qkv(b, sq, sk, hq, hkv, d, DType::F32, false, &dev)?;
    let p = AttnParams {
        mask: Mask::Causal,
        ..Default::default()
    };
    let sn = Tensor::new(&[f32::NEG_INFINITY, f32::INFINITY, f32::NAN], &dev)?;
    let ps = AttnParams {
        sinks: Some(sn),
        ..p.clone()
    };
    for eager in [false, true] {
        let run = |p: &AttnParams| -> Result<(Tensor, Option<Tensor>)> {
            if eager {
                Ok((attention_slow(&q, &k, &v, p)?, None))
            } else {
                let (o, l) = attention_with_lse(&q, &k, &v, p)?;
                Ok((o, Some(l)))
            }
        };
        let (o, lse) = run(&p)?;
        let (o_s, lse_s) = run(&ps)?;
        let o = o.reshape((sq, hq * d))?.to_vec2::<f32>()?;
        let o_s = o_s.reshape((sq, hq * d))?.to_vec2::<f32>()?;
        for i in 0..sq {
            let sees = i >= 2;
            // head 0: -inf, no sink (bit for bit on the fused path)
            for x in 0..d {
                let (a, b) = (o[i][x], o_s[i][x]);
                if eager {
                    assert!(
                        (a - b).abs() <= 1e-6,
                        "eager, -inf sink, row {i}: {a} vs {b}"
                    );
                } else {
                    assert_eq!(a.to_bits(), b.to_bits(), "-inf sink, row {i}");
                }
            }
            // head 1: +inf
            assert!(
                o_s[i][d..2 * d].iter().all(|&x| x == 0.0),
                "+inf sink row {i} (eager {eager})"
            );
            // head 2: NaN
            let nan_row = &o_s[i][2 * d..3 * d];
            if sees {
                assert!(
                    nan_row.iter().all(|x| x.is_nan()),
                    "NaN sink, row {i} sees keys (eager {eager})"
                );
            } else {
                assert!(
                    nan_row.iter().all(|&x| x == 0.0),
                    "NaN sink, keyless row {i} (eager {eager})"
                );
            }
        }
        if let (Some(lse), Some(lse_s)) = (lse, lse_s) {
            let lse = lse.to_vec3::<f32>()?.remove(0);
            let lse_s = lse_s.to_vec3::<f32>()?.remove(0);
            for i in 0..sq {
                assert_eq!(lse_s[0][i].to_bits(), lse[0][i].to_bits());
                assert_eq!(lse_s[1][i], f32::INFINITY);
                assert!(lse_s[2][i].is_nan());
            }
        }
    }
    Ok(())
}

/// Bad sinks are errors naming `sinks`, the rule and the value.
#[test]
fn sinks_validation() -> Result<()> {
    let dev = Device::Cpu;
    let (q, k, v) = qkv(1, 4, 4, 8, 2, 16, DType::F32, false, &dev)?;
    let err = |s: Tensor| -> String {
        let p = AttnParams {
            sinks: Some(s),
            ..Default::default()
        };
        match attention(&q, &k, &v, &p) {
            Ok(_) => panic!("accepted bad sinks"),
            Err(e) => e.to_string(),
        }
    };
    let cases = [
        (
            err(Tensor::zeros(8, DType::F16, &dev)?),
            "sinks: dtype must be f32, got F16",
        ),
        (
            err(Tensor::zeros(4, DType::F32, &dev)?),
            "sinks: shape must be (heads_q,) = (8,), got [4]",
        ),
        (
            err(Tensor::zeros((1, 8), DType::F32, &dev)?),
            "sinks: shape must be (heads_q,) = (8,), got [1, 8]",
        ),
        (
            err(Tensor::zeros((8, 2), DType::F32, &dev)?
                .narrow(1, 0, 1)?
                .squeeze(1)?),
            "sinks: must be contiguous, got strides [2]",
        ),
    ];
    for (got, want) in cases {
        assert!(got.contains(want), "error {got:?} should contain {want:?}");
        assert!(names(&got, "sinks"));
    }
    // the varlen and paged entries validate them too
    let cu = Tensor::new(&[0u32, 4], &dev)?;
    let p = AttnParams {
        sinks: Some(Tensor::zeros(3, DType::F32, &dev)?),
        ..Default::default()
    };
    let q3 = q.squeeze(0)?;
    let k3 = k.squeeze(0)?;
    let e = flashcore::attention_varlen(&q3, &k3, &k3, &cu, &cu, 4, 4, &p).unwrap_err();
    assert!(e.to_string().contains("sinks: shape must be"), "{e}");
    let table = Tensor::new(&[[0u32]], &dev)?;
    let lens = Tensor::new(&[4u32], &dev)?;
    let e = flashcore::attention_paged(&q, &k, &k, &table, &lens, &p).unwrap_err();
    assert!(e.to_string().contains("sinks: shape must be"), "{e}");
    Ok(())
}

/// A row whose visible scores are all -inf has no weight from its keys: with sinks it outputs
/// zeros with LSE = the sink (NaN for a NaN sink, -inf for none), on the fused and eager paths.
#[test]
fn sinks_rows_without_weight() -> Result<()> {
    let dev = Device::Cpu;
    let (sq, sk, hq, d) = (3, 5, 3, 16);
    // row 1 of every head: q = -inf against keys > 0, so every score is -inf
    let mut qv = vec![0.5f32; sq * hq * d];
    for x in &mut qv[hq * d..2 * hq * d] {
        *x = f32::NEG_INFINITY;
    }
    let q = Tensor::from_vec(qv, (1, sq, hq, d), &dev)?;
    let k = Tensor::rand(0.1f32, 1., (1, sk, 1, d), &dev)?;
    let v = Tensor::randn(0f32, 1., (1, sk, 1, d), &dev)?;
    let sinks = [2.0f32, f32::NAN, f32::NEG_INFINITY];
    let p = AttnParams {
        sinks: Some(Tensor::new(&sinks, &dev)?),
        ..Default::default()
    };
    let (o, lse) = attention_with_lse(&q, &k, &v, &p)?;
    let eager = attention_slow(&q, &k, &v, &p)?;
    let lse = lse.squeeze(0)?.to_vec2::<f32>()?;
    for out in [o, eager] {
        let out = out.reshape((sq, hq * d))?.to_vec2::<f32>()?;
        assert!(
            out[1].iter().all(|&x| x == 0.0),
            "row without weight: {:?}",
            out[1]
        );
        // the NaN sink's head: rows with weight are NaN
        for i in [0, 2] {
            assert!(
                out[i][d..2 * d].iter().all(|x| x.is_nan()),
                "NaN sink, row {i}"
            );
            assert!(
                out[i][..d].iter().all(|x| x.is_finite()),
                "finite sink, row {i}"
            );
        }
    }
    assert_eq!(lse[0][1], 2.0);
    assert!(lse[1][1].is_nan());
    assert_eq!(lse[2][1], f32::NEG_INFINITY);
    Ok(())
}
