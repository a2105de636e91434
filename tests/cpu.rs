//! CPU path: the fused reference against an independent float64 composition of candle ops,
//! over a sweep of shapes, masks and options; input validation messages; LSE; backward.

mod common;

use candle_core::{DType, Device, Result, Tensor, Var};
use common::*;
use flashcore::{attention, attention_slow, attention_with_lse, flash_attn, AttnParams, Mask};

/// One case: the fused CPU path must be within 2x the error of a naive same-precision
/// implementation (candle ops in the input dtype) plus a rounding floor, both measured against
/// float64. Returns the fused error.
#[allow(clippy::too_many_arguments)]
fn check(
    b: usize,
    sq: usize,
    sk: usize,
    hq: usize,
    hkv: usize,
    d: usize,
    dtype: DType,
    strided: bool,
    p: &AttnParams,
) -> Result<f64> {
    let dev = Device::Cpu;
    let (q, k, v) = qkv(b, sq, sk, hq, hkv, d, dtype, strided, &dev)?;
    let p = AttnParams {
        alibi_slopes: p
            .alibi_slopes
            .as_ref()
            .map(|_| Tensor::rand(0f32, 0.5, hq, &dev))
            .transpose()?,
        ..p.clone()
    };
    let (o, lse) = attention_with_lse(&q, &k, &v, &p)?;
    assert_eq!(o.dims(), q.dims());
    assert_eq!(o.dtype(), dtype);
    assert_eq!(lse.dims(), &[b, hq, sq]);
    let (o_ref, lse_ref) = reference_f64(&q, &k, &v, &p)?;
    let naive = attention_slow(&q, &k, &v, &p)?;
    let err = max_abs_diff(&o, &o_ref)?;
    let naive_err = max_abs_diff(&naive, &o_ref)?;
    let floor = rounding_floor(dtype, max_abs(&o_ref)?);
    let what = format!(
        "{dtype:?} b{b} sq{sq} sk{sk} h{hq}/{hkv} d{d} strided={strided} mask={} softcap={:?} alibi={}",
        mask_name(p.mask),
        p.softcap,
        p.alibi_slopes.is_some()
    );
    assert_eq!(non_finite(&o)?, 0, "{what}: non-finite output");
    assert!(
        err <= 2.0 * naive_err + floor,
        "{what}: fused error {err:.3e} > 2 x naive {naive_err:.3e} + floor {floor:.1e}"
    );
    // LSE is computed in f32: allow f32 rounding of values of magnitude ~ log(sk) + |max score|.
    let lerr = lse_err(&lse, &lse_ref)?;
    assert!(
        lerr <= 1e-4 * (1.0 + max_abs(&lse_ref.clamp(-1e30, 1e30)?)?),
        "{what}: lse error {lerr:.3e}"
    );
    Ok(err)
}

fn p(mask: Mask) -> AttnParams {
    AttnParams {
        mask,
        ..Default::default()
    }
}

#[test]
fn sweep_shapes_masks_gqa() -> Result<()> {
    let seqs = [
        (1, 1),
        (1, 113),
        (7, 7),
        (7, 113),
        (113, 7),
        (113, 113),
        (256, 256),
        (1, 1023),
        (256, 1023),
    ];
    let heads = [(8, 8), (8, 2), (8, 1)];
    let masks = [
        Mask::None,
        Mask::Causal,
        Mask::Window {
            left: Some(16),
            right: Some(4),
        },
        Mask::Window {
            left: Some(0),
            right: None,
        },
    ];
    let mut n = 0;
    for (i, &(sq, sk)) in seqs.iter().enumerate() {
        for (j, &(hq, hkv)) in heads.iter().enumerate() {
            for (m, &mask) in masks.iter().enumerate() {
                // Rotate head dims and layouts through the sweep so every combination of each
                // pair of axes appears without the full cartesian product.
                let d = [64, 128, 32, 96, 256][(i + j + m) % 5];
                let strided = (i + m) % 2 == 1;
                check(2, sq, sk, hq, hkv, d, DType::F32, strided, &p(mask))?;
                n += 1;
            }
        }
    }
    assert_eq!(n, seqs.len() * heads.len() * masks.len());
    Ok(())
}

#[test]
fn sweep_dtypes_head_dims() -> Result<()> {
    for dtype in [DType::F32, DType::F16, DType::BF16, DType::F64] {
        for d in [32, 64, 96, 128, 256] {
            for mask in [Mask::None, Mask::Causal] {
                check(1, 113, 256, 8, 2, d, dtype, d == 128, &p(mask))?;
            }
        }
    }
    Ok(())
}

/// Head dims past the GPU kernels' 256, up to 512 (Gemma 4's global layers), on the CPU path:
/// against the f64 reference, every mask, strided views, GQA; 520 is refused naming q.
#[test]
fn head_dims_to_512_on_the_cpu() -> Result<()> {
    for dtype in [DType::F32, DType::BF16] {
        for d in [264, 392, 512] {
            for mask in [
                Mask::Causal,
                Mask::Window {
                    left: Some(17),
                    right: Some(3),
                },
            ] {
                check(2, 33, 65, 4, 2, d, dtype, d == 392, &p(mask))?;
            }
        }
    }
    let f = DType::F32;
    let t = |s: &[usize]| Tensor::zeros(s, f, &Device::Cpu);
    let e = err_of(
        &t(&[1, 4, 2, 520])?,
        &t(&[1, 4, 2, 520])?,
        &t(&[1, 4, 2, 520])?,
        &p(Mask::None),
    );
    // q and k may be 576 wide (MLA), v at most 512.
    assert_eq!(
        e,
        "flashcore: v: head_dim must be a multiple of 8 in 8..=512, got 520"
    );
    let e = err_of(
        &t(&[1, 4, 2, 584])?,
        &t(&[1, 4, 2, 584])?,
        &t(&[1, 4, 2, 512])?,
        &p(Mask::None),
    );
    assert_eq!(
        e,
        "flashcore: q: head_dim must be a multiple of 8 in 8..=576, got 584"
    );
    Ok(())
}

#[test]
fn long_sequence_1023() -> Result<()> {
    check(
        1,
        1023,
        1023,
        8,
        2,
        128,
        DType::BF16,
        true,
        &p(Mask::Causal),
    )?;
    check(1, 1023, 1023, 8, 8, 64, DType::F32, false, &p(Mask::None))?;
    Ok(())
}

#[test]
fn softcap_and_alibi() -> Result<()> {
    let slopes = Some(Tensor::zeros(1, DType::F32, &Device::Cpu)?); // replaced per case in check()
    for (sq, sk) in [(7, 113), (113, 113), (256, 7)] {
        for mask in [
            Mask::None,
            Mask::Causal,
            Mask::Window {
                left: Some(8),
                right: Some(8),
            },
        ] {
            let sc = AttnParams {
                softcap: Some(5.0),
                softmax_scale: Some(0.5),
                ..p(mask)
            };
            check(2, sq, sk, 8, 2, 64, DType::F32, true, &sc)?;
            let al = AttnParams {
                alibi_slopes: slopes.clone(),
                ..p(mask)
            };
            check(2, sq, sk, 8, 4, 64, DType::BF16, false, &al)?;
            let both = AttnParams {
                alibi_slopes: slopes.clone(),
                softcap: Some(20.0),
                ..p(mask)
            };
            check(1, sq, sk, 4, 1, 128, DType::F16, false, &both)?;
        }
    }
    Ok(())
}

#[test]
fn random_problems() -> Result<()> {
    // Fresh shapes each run, from the clock; printed so a failure can be reproduced.
    let mut rng = Rng::from_clock("random_problems");
    let mut next = |n: usize| rng.below(n);
    for _ in 0..40 {
        let hkv = [1, 2, 4][next(3)];
        let hq = hkv * [1, 2, 4][next(3)];
        let d = [32, 64, 96, 128, 256][next(5)];
        let sq = 1 + next(150);
        let sk = 1 + next(150);
        let mask = [
            Mask::None,
            Mask::Causal,
            Mask::Window {
                left: Some(next(40)),
                right: Some(next(40)),
            },
        ][next(3)];
        let dtype = [DType::F32, DType::BF16, DType::F16][next(3)];
        check(
            1 + next(2),
            sq,
            sk,
            hq,
            hkv,
            d,
            dtype,
            next(2) == 1,
            &p(mask),
        )?;
    }
    Ok(())
}

#[test]
fn empty_rows_are_zero_with_neg_inf_lse() -> Result<()> {
    // sq > sk under a causal mask: the first sq - sk rows see no key.
    let (q, k, v) = qkv(1, 10, 4, 2, 1, 64, DType::F32, false, &Device::Cpu)?;
    let (o, lse) = attention_with_lse(&q, &k, &v, &p(Mask::Causal))?;
    let o_rows = o.narrow(1, 0, 6)?;
    assert_eq!(max_abs(&o_rows)?, 0.0);
    assert_eq!(non_finite(&o)?, 0);
    let l = lse.narrow(2, 0, 6)?.flatten_all()?.to_vec1::<f32>()?;
    assert!(l.iter().all(|x| *x == f32::NEG_INFINITY), "{l:?}");
    let l = lse.narrow(2, 6, 4)?.flatten_all()?.to_vec1::<f32>()?;
    assert!(l.iter().all(|x| x.is_finite()), "{l:?}");
    Ok(())
}

#[test]
fn flash_attn_matches_attention_and_causal_is_bottom_right() -> Result<()> {
    let dev = Device::Cpu;
    let (q, k, v) = qkv(2, 3, 9, 4, 2, 64, DType::F32, false, &dev)?;
    let a = flash_attn(&q, &k, &v, 0.3, true)?;
    let b = attention(
        &q,
        &k,
        &v,
        &AttnParams {
            softmax_scale: Some(0.3),
            mask: Mask::Causal,
            ..Default::default()
        },
    )?;
    assert_eq!(max_abs_diff(&a, &b)?, 0.0);
    // Bottom-right: the last query row sees every key, so it equals unmasked attention.
    let full = flash_attn(&q, &k, &v, 0.3, false)?;
    assert!(max_abs_diff(&a.narrow(1, 2, 1)?, &full.narrow(1, 2, 1)?)? < 1e-6);
    // The first query row sees keys 0..=6 only: changing key 8 must not change it.
    let k2 = k.slice_assign(
        &[0..2, 8..9, 0..2, 0..64],
        &Tensor::ones((2, 1, 2, 64), DType::F32, &dev)?,
    )?;
    let a2 = flash_attn(&q, &k2, &v, 0.3, true)?;
    assert_eq!(
        max_abs_diff(&a.narrow(1, 0, 1)?, &a2.narrow(1, 0, 1)?)?,
        0.0
    );
    assert!(max_abs_diff(&a.narrow(1, 2, 1)?, &a2.narrow(1, 2, 1)?)? > 0.0);
    // Default scale is 1/sqrt(d).
    let dflt = attention(&q, &k, &v, &AttnParams::default())?;
    let expl = flash_attn(&q, &k, &v, 1.0 / 8.0, false)?;
    assert_eq!(max_abs_diff(&dflt, &expl)?, 0.0);
    Ok(())
}

#[test]
fn gqa_equals_repeated_kv() -> Result<()> {
    let dev = Device::Cpu;
    let (q, k, v) = qkv(1, 17, 33, 8, 2, 64, DType::F32, false, &dev)?;
    let rep = |t: &Tensor| -> Result<Tensor> {
        let (b, s, h, d) = t.dims4()?;
        t.unsqueeze(3)?
            .broadcast_as((b, s, h, 4, d))?
            .reshape((b, s, h * 4, d))?
            .contiguous()
    };
    let a = flash_attn(&q, &k, &v, 0.125, true)?;
    let b = flash_attn(&q, &rep(&k)?, &rep(&v)?, 0.125, true)?;
    assert!(max_abs_diff(&a, &b)? < 1e-6);
    Ok(())
}

#[test]
fn backward_fails_loudly() -> Result<()> {
    let dev = Device::Cpu;
    let q = Var::randn(0f32, 1., (1, 4, 2, 32), &dev)?;
    let (_, k, v) = qkv(1, 4, 4, 2, 2, 32, DType::F32, false, &dev)?;
    let o = flash_attn(q.as_tensor(), &k, &v, 0.2, false)?;
    let err = o.sum_all()?.backward().unwrap_err().to_string();
    assert!(
        err.contains("flashcore-attention") && err.to_lowercase().contains("backward"),
        "{err}"
    );
    Ok(())
}

fn err_of(q: &Tensor, k: &Tensor, v: &Tensor, p: &AttnParams) -> String {
    attention(q, k, v, p)
        .expect_err("must be rejected")
        .to_string()
}

#[test]
fn validation_messages() -> Result<()> {
    let dev = Device::Cpu;
    let t = |s: &[usize], dt: DType| Tensor::zeros(s, dt, &dev).unwrap();
    let f = DType::F32;
    let q = t(&[1, 4, 8, 64], f);
    let k = t(&[1, 6, 2, 64], f);
    let d = AttnParams::default();
    let cases: Vec<(String, &str)> = vec![
        (err_of(&t(&[4, 8, 64], f), &k, &k, &d), "q: must have rank 4 (batch, seq_q, heads_q, head_dim), got rank 3 with shape [4, 8, 64]"),
        (err_of(&q, &t(&[1, 6, 64], f), &k, &d), "k: must have rank 4 (batch, seq_k, heads_kv, head_dim), got rank 3"),
        (err_of(&t(&[1, 4, 8, 64], DType::U32), &k, &k, &d), "q: dtype must be f16, bf16, f32 or f64, got U32"),
        (err_of(&q, &t(&[1, 6, 2, 64], DType::F16), &k, &d), "k: dtype must match q (F32), got F16"),
        (err_of(&q, &k, &t(&[1, 6, 2, 64], DType::BF16), &d), "v: dtype must match q (F32), got BF16"),
        (err_of(&q, &t(&[2, 6, 2, 64], f), &t(&[2, 6, 2, 64], f), &d), "k: batch must equal q's batch 1, got 2"),
        (err_of(&q, &t(&[1, 6, 2, 32], f), &t(&[1, 6, 2, 32], f), &d), "k: head_dim must equal q's head_dim 64, got 32"),
        (err_of(&q, &k, &t(&[1, 5, 2, 64], f), &d), "v: shape must equal k's [1, 6, 2, 64] but for the last dim (v's head_dim may differ from k's), got [1, 5, 2, 64]"),
        (err_of(&q, &k, &t(&[1, 6, 2, 20], f), &d), "v: head_dim must be a multiple of 8 in 8..=512, got 20"),
        (err_of(&q, &k, &t(&[1, 6, 2, 520], f), &d), "v: head_dim must be a multiple of 8 in 8..=512, got 520"),
        (err_of(&q, &t(&[1, 6, 3, 64], f), &t(&[1, 6, 3, 64], f), &d), "k: heads_q (8) must be a multiple of heads_kv, got heads_kv 3"),
        (err_of(&t(&[1, 4, 8, 300], f), &t(&[1, 6, 2, 300], f), &t(&[1, 6, 2, 300], f), &d), "q: head_dim must be a multiple of 8 in 8..=576, got 300"),
        (err_of(&t(&[1, 4, 8, 12], f), &t(&[1, 6, 2, 12], f), &t(&[1, 6, 2, 12], f), &d), "head_dim must be a multiple of 8 in 8..=576, got 12"),
        (err_of(&t(&[1, 4, 64, 8], f).transpose(2, 3)?, &k, &k, &d), "q: the last dimension (head_dim) must be contiguous (stride 1)"),
        (err_of(&t(&[1, 0, 8, 64], f), &k, &k, &d), "q: must not be empty, got shape [1, 0, 8, 64]"),
        (err_of(&q, &t(&[1, 0, 2, 64], f), &t(&[1, 0, 2, 64], f), &d), "k: must not be empty (seq_k >= 1)"),
        (err_of(&q, &k, &k, &AttnParams { softmax_scale: Some(f32::NAN), ..d.clone() }), "softmax_scale: must be finite, got NaN"),
        (err_of(&q, &k, &k, &AttnParams { softcap: Some(-1.0), ..d.clone() }), "softcap: must be finite and > 0, got -1"),
        (err_of(&q, &k, &k, &AttnParams { alibi_slopes: Some(t(&[8], DType::F16)), ..d.clone() }), "alibi_slopes: dtype must be f32, got F16"),
        (err_of(&q, &k, &k, &AttnParams { alibi_slopes: Some(t(&[4], f)), ..d.clone() }), "alibi_slopes: shape must be (heads_q,) = (8,) or (batch, heads_q) = (1, 8), got [4]"),
    ];
    for (got, want) in cases {
        assert!(
            got.contains(want),
            "error message\n  {got}\nshould contain\n  {want}"
        );
        assert!(got.starts_with("flashcore: "), "{got}");
    }
    Ok(())
}

#[test]
fn eager_twin_agrees() -> Result<()> {
    let (q, k, v) = qkv(1, 33, 65, 4, 1, 64, DType::F32, true, &Device::Cpu)?;
    for mask in [
        Mask::None,
        Mask::Causal,
        Mask::Window {
            left: Some(3),
            right: Some(2),
        },
    ] {
        let a = attention(&q, &k, &v, &p(mask))?;
        let b = attention_slow(&q, &k, &v, &p(mask))?;
        assert!(max_abs_diff(&a, &b)? < 1e-5, "{mask:?}");
    }
    Ok(())
}
