//! CPU path of the packed variable-length API (`attention_varlen`, `attention_varlen_with_lse`):
//! every sequence must equal the dense CPU `attention` of that sequence alone (bottom-right
//! alignment with its own lengths, its own ALiBi slopes) and the eager candle composition
//! (`attention_slow`); sequences of length 0 on either side; argument validation; and dense
//! `attention` with per-batch `(batch, heads_q)` ALiBi slopes.

mod common;

use candle_core::{DType, Device, Result, Tensor};
use common::*;
use flashcore::{attention, attention_slow, attention_with_lse, AttnParams, Mask};

/// The dense fused CPU path on one sequence, with its LSE.
fn dense(q: &Tensor, k: &Tensor, v: &Tensor, p: &AttnParams) -> Result<(Tensor, Option<Tensor>)> {
    let (o, l) = attention_with_lse(q, k, v, p)?;
    Ok((o, Some(l)))
}

/// The eager candle composition on one sequence.
fn eager(q: &Tensor, k: &Tensor, v: &Tensor, p: &AttnParams) -> Result<(Tensor, Option<Tensor>)> {
    Ok((attention_slow(q, k, v, p)?, None))
}

/// Checks one varlen problem on the CPU against the per-sequence dense path (tight: the same
/// arithmetic) and the per-sequence eager composition (f32/f64 only), LSE included; also the
/// LSE-less entry point. Returns (error vs dense, error vs eager).
fn check(vl: &Varlen, p: &AttnParams) -> Result<(f64, f64)> {
    let what = format!("{} {}", vl.shape_name(), opts_name(p));
    let dtype = vl.q.dtype();
    let (hq, _) = vl.heads();
    let (tq, d) = (vl.total_q(), vl.head_dim());
    let (o, lse) = vl.run(p)?;
    assert_eq!(o.dims(), &[tq, hq, d], "{what}: output shape");
    assert_eq!(o.dtype(), dtype, "{what}: output dtype");
    assert_eq!(
        lse.dims(),
        &[hq, tq],
        "{what}: lse shape (heads_q, total_q)"
    );
    assert_eq!(lse.dtype(), DType::F32, "{what}: lse dtype");
    assert_eq!(non_finite(&o)?, 0, "{what}: non-finite output");

    let (o_ref, lse_ref) = varlen_by_sequence(vl, p, false, dense)?;
    let lse_ref = lse_ref.expect("dense LSE");
    let mag = max_abs(&o_ref)?;
    let tol = match dtype {
        DType::F64 => 1e-12,
        DType::F32 => 1e-5,
        _ => rounding_floor(dtype, mag),
    };
    let err = max_abs_diff(&o, &o_ref)?;
    assert!(
        err <= tol,
        "{what}: varlen differs from per-sequence dense attention by {err:.3e} > {tol:.1e}"
    );
    let lse_tol = 1e-5 * (1.0 + max_abs(&lse_ref.clamp(-1e30, 1e30)?)?);
    let lerr = lse_err(&lse, &lse_ref)?;
    assert!(
        lerr <= lse_tol,
        "{what}: varlen LSE differs from per-sequence dense LSE by {lerr:.3e} > {lse_tol:.1e}"
    );

    let o_only = vl.run_o(p)?;
    let e_only = max_abs_diff(&o_only, &o)?;
    assert!(
        e_only <= tol,
        "{what}: attention_varlen differs from attention_varlen_with_lse by {e_only:.3e}"
    );

    let mut e_slow = 0.0;
    if matches!(dtype, DType::F32 | DType::F64) {
        let (o_slow, _) = varlen_by_sequence(vl, p, false, eager)?;
        e_slow = max_abs_diff(&o, &o_slow)?;
        // The eager ALiBi bias is built in f32 (slope x distance, then added), whatever the
        // input dtype: allow f32 rounding of scores as large as the longest distance.
        let tol = if p.alibi_slopes.is_some() {
            2e-6 * (1 + vl.max_q.max(vl.max_k)) as f64 * mag.max(1.0)
        } else if dtype == DType::F64 {
            1e-10
        } else {
            5e-5 * mag.max(1.0)
        };
        assert!(
            e_slow <= tol,
            "{what}: varlen differs from per-sequence attention_slow by {e_slow:.3e} > {tol:.1e}"
        );
    }
    println!("[OK] {what}: vs dense {err:.1e}, vs eager {e_slow:.1e}, lse {lerr:.1e}");
    Ok((err, e_slow))
}

/// Random `(seq_q, seq_k)` lengths: 0 and 1 often, otherwise uniform in 1..=max, independently
/// on both sides (so seq_q != seq_k mostly); at least one query row and one key overall.
fn random_lens(rng: &mut Rng, n: usize, max: usize) -> Vec<(usize, usize)> {
    let one = |rng: &mut Rng| match rng.below(8) {
        0 => 0,
        1 => 1,
        _ => 1 + rng.below(max),
    };
    let mut lens: Vec<(usize, usize)> = (0..n).map(|_| (one(rng), one(rng))).collect();
    if lens.iter().all(|l| l.0 == 0) || lens.iter().all(|l| l.1 == 0) {
        let at = rng.below(n);
        lens[at] = (1 + rng.below(max), 1 + rng.below(max));
    }
    lens
}

/// The option sets the sweeps rotate through: plain, softcap, ALiBi `(heads_q,)`, ALiBi
/// `(batch, heads_q)`, and softcap + per-sequence ALiBi + a non-default scale.
fn options(which: usize, mask: Mask, n: usize, hq: usize) -> Result<AttnParams> {
    let dev = Device::Cpu;
    let slopes = |shape: &[usize]| Tensor::rand(0f32, 1., shape, &dev);
    Ok(match which % 5 {
        0 => AttnParams {
            mask,
            ..Default::default()
        },
        1 => AttnParams {
            mask,
            softcap: Some(5.0),
            ..Default::default()
        },
        2 => AttnParams {
            mask,
            alibi_slopes: Some(slopes(&[hq])?),
            ..Default::default()
        },
        3 => AttnParams {
            mask,
            alibi_slopes: Some(slopes(&[n, hq])?),
            ..Default::default()
        },
        _ => AttnParams {
            mask,
            softcap: Some(3.0),
            softmax_scale: Some(0.3),
            alibi_slopes: Some(slopes(&[n, hq])?),
            ..Default::default()
        },
    })
}

/// Head dims 8/40/64/96/256 x GQA 1/4/8 x six masks, options rotating so that each head dim
/// meets each option; random lengths (0 and 1 included) per case.
fn sweep(dtype: DType) -> Result<()> {
    let mut rng = Rng::from_clock(&format!("varlen sweep {dtype:?}"));
    let masks = [
        Mask::None,
        Mask::Causal,
        Mask::Window {
            left: Some(3),
            right: Some(0),
        },
        Mask::Window {
            left: Some(5),
            right: Some(2),
        },
        Mask::Window {
            left: None,
            right: Some(1),
        },
        Mask::Window {
            left: Some(0),
            right: None,
        },
    ];
    let mut n_cases = 0;
    for (di, d) in [8, 40, 64, 96, 256].into_iter().enumerate() {
        for (hi, (hq, hkv)) in [(8, 8), (8, 2), (8, 1)].into_iter().enumerate() {
            for (mi, mask) in masks.into_iter().enumerate() {
                let n = 1 + rng.below(6);
                let lens = random_lens(&mut rng, n, 40);
                let strided = (di + mi) % 2 == 1;
                let vl = Varlen::random(&lens, hq, hkv, d, dtype, strided, &Device::Cpu)?;
                check(&vl, &options(di + hi + mi, mask, n, hq)?)?;
                n_cases += 1;
            }
        }
    }
    println!("varlen sweep {dtype:?}: {n_cases} cases passed");
    Ok(())
}

#[test]
fn varlen_matches_dense_and_eager_f32() -> Result<()> {
    sweep(DType::F32)
}

#[test]
fn varlen_matches_dense_and_eager_f64() -> Result<()> {
    sweep(DType::F64)
}

/// Random problems: 1 to 64 sequences of up to 200 rows, every dtype, head dim (multiples of 8),
/// GQA ratio, random windows and options, some given a max_seqlen above the longest sequence.
#[test]
fn varlen_random_problems() -> Result<()> {
    let mut rng = Rng::from_clock("varlen_random_problems");
    for _ in 0..24 {
        let n = 1 + rng.below(64);
        let max = if n > 16 { 24 } else { 200 };
        let lens = random_lens(&mut rng, n, max);
        let hkv = [1, 2, 4][rng.below(3)];
        let hq = hkv * [1, 2, 4, 8][rng.below(4)];
        let d = 8 * (1 + rng.below(32));
        let d = if n > 16 { d.min(64) } else { d };
        let dtype = [DType::F32, DType::F64, DType::F16, DType::BF16][rng.below(4)];
        let mask = [
            Mask::None,
            Mask::Causal,
            Mask::Window {
                left: Some(rng.below(50)),
                right: Some(rng.below(50)),
            },
        ][rng.below(3)];
        let strided = rng.below(2) == 1;
        let mut vl = Varlen::random(&lens, hq, hkv, d, dtype, strided, &Device::Cpu)?;
        if rng.below(3) == 0 {
            vl.max_q += rng.below(100);
            vl.max_k += rng.below(100);
        }
        check(&vl, &options(rng.below(5), mask, n, hq)?)?;
    }
    Ok(())
}

/// Sequences of length 0 on either side, first and last, and seq_q > seq_k under a causal mask:
/// a sequence with seq_k = 0 outputs zero rows with LSE -inf, one with seq_q = 0 no rows; the
/// others are unaffected by their empty neighbours.
#[test]
fn varlen_empty_sequences() -> Result<()> {
    let dev = Device::Cpu;
    let lens = [
        (0, 5),
        (3, 0),
        (1, 1),
        (0, 0),
        (9, 4),
        (4, 9),
        (2, 0),
        (0, 3),
    ];
    for dtype in [DType::F32, DType::F64] {
        for mask in [Mask::None, Mask::Causal] {
            let vl = Varlen::random(&lens, 4, 2, 16, dtype, false, &dev)?;
            let p = AttnParams {
                mask,
                alibi_slopes: Some(Tensor::rand(0f32, 1., (lens.len(), 4), &dev)?),
                ..Default::default()
            };
            check(&vl, &p)?;
            let (o, lse) = vl.run(&p)?;
            let lse = lse.to_vec2::<f32>()?;
            let o = o.to_dtype(DType::F64)?;
            for (i, &(sq, sk)) in lens.iter().enumerate() {
                let q0 = vl.cu_q[i] as usize;
                for r in q0..q0 + sq {
                    // causal with seq_q 9 > seq_k 4: the first 5 rows see no key
                    let empty = sk == 0 || (mask == Mask::Causal && r - q0 + sk < sq);
                    let row_max = max_abs(&o.get(r)?)?;
                    for (h, l) in lse.iter().enumerate() {
                        assert_eq!(
                            l[r] == f32::NEG_INFINITY,
                            empty,
                            "{dtype:?} {mask:?} seq {i} row {r} head {h}: lse {}",
                            l[r]
                        );
                    }
                    if empty {
                        assert_eq!(row_max, 0.0, "{dtype:?} {mask:?} seq {i} row {r}");
                    } else {
                        assert!(row_max > 0.0, "{dtype:?} {mask:?} seq {i} row {r}");
                    }
                }
            }
        }
    }
    Ok(())
}

/// One sequence is dense attention with batch 1, bit for bit in shape and within f32 rounding.
#[test]
fn varlen_single_sequence_equals_dense() -> Result<()> {
    let dev = Device::Cpu;
    let (q, k, v) = qkv(1, 37, 53, 8, 2, 64, DType::F32, false, &dev)?;
    let p = AttnParams {
        mask: Mask::Causal,
        softcap: Some(10.0),
        ..Default::default()
    };
    let vl = Varlen::from_parts(q.squeeze(0)?, k.squeeze(0)?, v.squeeze(0)?, &[(37, 53)])?;
    let (o, lse) = vl.run(&p)?;
    let (od, lsed) = attention_with_lse(&q, &k, &v, &p)?;
    assert!(max_abs_diff(&o, &od.squeeze(0)?)? <= 1e-6);
    assert!(lse_err(&lse, &lsed.squeeze(0)?)? <= 1e-5);
    Ok(())
}

/// max_seqlen_q/k only bound the lengths: larger values change nothing.
#[test]
fn varlen_max_seqlen_is_only_a_bound() -> Result<()> {
    let dev = Device::Cpu;
    let lens = [(5, 9), (0, 3), (12, 12), (1, 30)];
    let mut vl = Varlen::random(&lens, 4, 1, 32, DType::F32, false, &dev)?;
    let p = AttnParams {
        mask: Mask::Causal,
        ..Default::default()
    };
    let (o, lse) = vl.run(&p)?;
    (vl.max_q, vl.max_k) = (4096, 100_000);
    let (o2, lse2) = vl.run(&p)?;
    assert_eq!(max_abs_diff(&o, &o2)?, 0.0);
    assert_eq!(lse_err(&lse, &lse2)?, 0.0);
    Ok(())
}

/// q narrowed out of a packed (total, hq + 3, d) buffer and k/v out of a packed
/// (total, 2 hkv + 1, d) one (a fused projection's output) give the same result as contiguous
/// copies.
#[test]
fn varlen_strided_views() -> Result<()> {
    let dev = Device::Cpu;
    let lens = [(7, 7), (0, 4), (13, 29), (1, 1)];
    let vl = Varlen::random(&lens, 8, 2, 64, DType::F32, true, &dev)?;
    assert!(!vl.q.is_contiguous() && !vl.k.is_contiguous());
    let p = AttnParams {
        mask: Mask::Window {
            left: Some(4),
            right: Some(1),
        },
        ..Default::default()
    };
    let (o, lse) = vl.run(&p)?;
    let (o2, lse2) = vl.to(&dev, DType::F32)?.run(&p)?;
    assert!(max_abs_diff(&o, &o2)? <= 1e-6);
    assert!(lse_err(&lse, &lse2)? <= 1e-6);
    check(&vl, &p)?;
    Ok(())
}

/// Runs attention_varlen with the given pieces and returns the error message (it must fail).
#[allow(clippy::too_many_arguments)]
fn varlen_err(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cu_q: &Tensor,
    cu_k: &Tensor,
    max_q: usize,
    max_k: usize,
    p: &AttnParams,
) -> String {
    match flashcore::attention_varlen_with_lse(q, k, v, cu_q, cu_k, max_q, max_k, p) {
        Ok(_) => "<no error>".into(),
        Err(e) => e.to_string(),
    }
}

/// The valid problem the validation cases perturb one argument of: 3 sequences (3, 5), (0, 2),
/// (4, 4); heads 4/2; d 16; f32.
struct Base {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_q: Tensor,
    cu_k: Tensor,
    max_q: usize,
    max_k: usize,
}

fn base() -> Result<Base> {
    let dev = Device::Cpu;
    let vl = Varlen::random(&[(3, 5), (0, 2), (4, 4)], 4, 2, 16, DType::F32, false, &dev)?;
    Ok(Base {
        q: vl.q,
        k: vl.k,
        v: vl.v,
        cu_q: vl.cu_q_t,
        cu_k: vl.cu_k_t,
        max_q: vl.max_q,
        max_k: vl.max_k,
    })
}

fn u32s(v: &[u32]) -> Tensor {
    Tensor::new(v, &Device::Cpu).unwrap()
}

/// Every argument error of the varlen API: an `Err` (never a panic) whose message names the
/// argument.
#[test]
fn varlen_argument_errors() -> Result<()> {
    let dev = Device::Cpu;
    let b = base()?;
    let d = AttnParams::default();
    let z = |s: &[usize], dt: DType| Tensor::zeros(s, dt, &dev).unwrap();
    let f = DType::F32;
    // The base problem itself is fine.
    flashcore::attention_varlen_with_lse(&b.q, &b.k, &b.v, &b.cu_q, &b.cu_k, 4, 5, &d)?;
    let e = |q: &Tensor, k: &Tensor, v: &Tensor, cq: &Tensor, ck: &Tensor, p: &AttnParams| {
        varlen_err(q, k, v, cq, ck, b.max_q, b.max_k, p)
    };
    let slopes = |s: &[usize], dt: DType| AttnParams {
        alibi_slopes: Some(Tensor::ones(s, dt, &dev).unwrap()),
        ..Default::default()
    };
    let cases: Vec<(&str, String, &[&str])> = vec![
        (
            "cu_seqlens_q i64",
            e(&b.q, &b.k, &b.v, &b.cu_q.to_dtype(DType::I64)?, &b.cu_k, &d),
            &["cu_seqlens_q"],
        ),
        (
            "cu_seqlens_q f32",
            e(&b.q, &b.k, &b.v, &b.cu_q.to_dtype(f)?, &b.cu_k, &d),
            &["cu_seqlens_q"],
        ),
        (
            "cu_seqlens_k u8",
            e(&b.q, &b.k, &b.v, &b.cu_q, &b.cu_k.to_dtype(DType::U8)?, &d),
            &["cu_seqlens_k"],
        ),
        (
            "cu_seqlens_k i64",
            e(&b.q, &b.k, &b.v, &b.cu_q, &b.cu_k.to_dtype(DType::I64)?, &d),
            &["cu_seqlens_k"],
        ),
        (
            "cu_seqlens_q rank 2",
            e(&b.q, &b.k, &b.v, &b.cu_q.unsqueeze(0)?, &b.cu_k, &d),
            &["cu_seqlens_q"],
        ),
        (
            "cu_seqlens_k rank 2",
            e(&b.q, &b.k, &b.v, &b.cu_q, &b.cu_k.unsqueeze(1)?, &d),
            &["cu_seqlens_k"],
        ),
        (
            "cu_seqlens_q rank 0",
            e(&b.q, &b.k, &b.v, &Tensor::new(0u32, &dev)?, &b.cu_k, &d),
            &["cu_seqlens_q"],
        ),
        // both of length 1: either may be named first
        (
            "both cu_seqlens of length 1",
            e(&b.q, &b.k, &b.v, &u32s(&[0]), &u32s(&[0]), &d),
            &["cu_seqlens_q", "cu_seqlens_k"],
        ),
        (
            "both cu_seqlens empty",
            e(&b.q, &b.k, &b.v, &u32s(&[]), &u32s(&[]), &d),
            &["cu_seqlens_q", "cu_seqlens_k"],
        ),
        (
            "cu_seqlens_k of length 1",
            e(&b.q, &b.k, &b.v, &b.cu_q, &u32s(&[0]), &d),
            &["cu_seqlens_k"],
        ),
        (
            "cu_seqlens_k batch differs",
            e(&b.q, &b.k, &b.v, &b.cu_q, &u32s(&[0, 5, 11]), &d),
            &["cu_seqlens_k"],
        ),
        (
            "cu_seqlens_k batch differs (longer)",
            e(&b.q, &b.k, &b.v, &b.cu_q, &u32s(&[0, 5, 7, 11, 11]), &d),
            &["cu_seqlens_k"],
        ),
        (
            "q rank 4",
            e(&b.q.unsqueeze(0)?, &b.k, &b.v, &b.cu_q, &b.cu_k, &d),
            &["q"],
        ),
        (
            "q rank 2",
            e(&b.q.flatten_from(1)?, &b.k, &b.v, &b.cu_q, &b.cu_k, &d),
            &["q"],
        ),
        (
            "k rank 4",
            e(&b.q, &b.k.unsqueeze(0)?, &b.v, &b.cu_q, &b.cu_k, &d),
            &["k"],
        ),
        (
            "v rank 2",
            e(&b.q, &b.k, &b.v.flatten_from(1)?, &b.cu_q, &b.cu_k, &d),
            &["v"],
        ),
        (
            "v shape differs from k",
            e(&b.q, &b.k, &z(&[11, 1, 16], f), &b.cu_q, &b.cu_k, &d),
            &["v"],
        ),
        (
            "heads_q not a multiple of heads_kv",
            e(
                &b.q,
                &z(&[11, 3, 16], f),
                &z(&[11, 3, 16], f),
                &b.cu_q,
                &b.cu_k,
                &d,
            ),
            &["k", "heads_kv", "heads_q"],
        ),
        (
            "head_dim differs",
            e(
                &b.q,
                &z(&[11, 2, 8], f),
                &z(&[11, 2, 8], f),
                &b.cu_q,
                &b.cu_k,
                &d,
            ),
            &["k", "head_dim"],
        ),
        (
            "head_dim not a multiple of 8",
            e(
                &z(&[7, 4, 12], f),
                &z(&[11, 2, 12], f),
                &z(&[11, 2, 12], f),
                &b.cu_q,
                &b.cu_k,
                &d,
            ),
            &["q", "head_dim"],
        ),
        (
            "k dtype differs",
            e(&b.q, &b.k.to_dtype(DType::F16)?, &b.v, &b.cu_q, &b.cu_k, &d),
            &["k"],
        ),
        (
            "alibi (heads_q + 1,)",
            e(&b.q, &b.k, &b.v, &b.cu_q, &b.cu_k, &slopes(&[5], f)),
            &["alibi_slopes"],
        ),
        (
            "alibi (batch + 1, heads_q)",
            e(&b.q, &b.k, &b.v, &b.cu_q, &b.cu_k, &slopes(&[4, 4], f)),
            &["alibi_slopes"],
        ),
        (
            "alibi (batch - 1, heads_q)",
            e(&b.q, &b.k, &b.v, &b.cu_q, &b.cu_k, &slopes(&[2, 4], f)),
            &["alibi_slopes"],
        ),
        (
            "alibi (batch, heads_q + 1)",
            e(&b.q, &b.k, &b.v, &b.cu_q, &b.cu_k, &slopes(&[3, 5], f)),
            &["alibi_slopes"],
        ),
        (
            "alibi (batch, heads_q, 1)",
            e(&b.q, &b.k, &b.v, &b.cu_q, &b.cu_k, &slopes(&[3, 4, 1], f)),
            &["alibi_slopes"],
        ),
        (
            "alibi f64",
            e(
                &b.q,
                &b.k,
                &b.v,
                &b.cu_q,
                &b.cu_k,
                &slopes(&[3, 4], DType::F64),
            ),
            &["alibi_slopes"],
        ),
    ];
    for (case, got, want) in cases {
        assert!(
            got.starts_with("flashcore: ") && want.iter().any(|w| names(&got, w)),
            "{case}: error message\n  {got}\nshould start with `flashcore: ` and name one of {want:?}"
        );
        println!("[OK] {case}: {got}");
    }
    Ok(())
}

/// On the CPU the prefix sums are checked on the host: first value 0, non-decreasing, last value
/// equal to the rows of q (resp. k), every length <= max_seqlen. Each case breaks exactly one rule
/// (max_seqlen generous unless it is the rule under test).
#[test]
fn varlen_seqlens_checked_on_host() -> Result<()> {
    let b = base()?; // lens (3, 5), (0, 2), (4, 4): cu_q [0, 3, 3, 7], cu_k [0, 5, 7, 11]
    let d = AttnParams::default();
    let run = |cq: &[u32], ck: &[u32], mq: usize, mk: usize| {
        varlen_err(&b.q, &b.k, &b.v, &u32s(cq), &u32s(ck), mq, mk, &d)
    };
    let (cq, ck) = ([0, 3, 3, 7], [0, 5, 7, 11]);
    // the base with exact and with generous maxima is valid
    assert_eq!(run(&cq, &ck, 4, 5), "<no error>");
    assert_eq!(run(&cq, &ck, 100, 100), "<no error>");
    let cases: Vec<(&str, String, &str)> = vec![
        (
            "cu_seqlens_q starts at 1",
            run(&[1, 3, 3, 7], &ck, 100, 100),
            "cu_seqlens_q",
        ),
        (
            "cu_seqlens_k starts at 2",
            run(&cq, &[2, 5, 7, 11], 100, 100),
            "cu_seqlens_k",
        ),
        (
            "cu_seqlens_q decreasing",
            run(&[0, 5, 3, 7], &ck, 100, 100),
            "cu_seqlens_q",
        ),
        (
            "cu_seqlens_k decreasing",
            run(&cq, &[0, 8, 7, 11], 100, 100),
            "cu_seqlens_k",
        ),
        (
            "cu_seqlens_q wraps (u32::MAX)",
            run(&[0, u32::MAX, 3, 7], &ck, 100, 100),
            "cu_seqlens_q",
        ),
        (
            "cu_seqlens_q last < total_q",
            run(&[0, 3, 3, 6], &ck, 100, 100),
            "cu_seqlens_q",
        ),
        (
            "cu_seqlens_q last > total_q",
            run(&[0, 3, 3, 8], &ck, 100, 100),
            "cu_seqlens_q",
        ),
        (
            "cu_seqlens_k last < total_k",
            run(&cq, &[0, 5, 7, 10], 100, 100),
            "cu_seqlens_k",
        ),
        (
            "cu_seqlens_k last > total_k",
            run(&cq, &[0, 5, 7, 1000], 100, 100),
            "cu_seqlens_k",
        ),
        (
            "a query length > max_seqlen_q",
            run(&cq, &ck, 3, 100),
            "max_seqlen_q",
        ),
        (
            "a key length > max_seqlen_k",
            run(&cq, &ck, 100, 4),
            "max_seqlen_k",
        ),
        ("max_seqlen_q 0", run(&cq, &ck, 0, 100), "max_seqlen_q"),
    ];
    for (case, got, want) in cases {
        assert!(
            got.starts_with("flashcore: ") && names(&got, want),
            "{case}: error message\n  {got}\nshould start with `flashcore: ` and name {want}"
        );
        println!("[OK] {case}: {got}");
    }
    Ok(())
}

/// Dense `attention` with `(batch, heads_q)` ALiBi slopes equals per-batch calls with that
/// entry's `(heads_q,)` slopes (O and LSE), over masks, softcap, GQA, f32 and f64; a wrong
/// slope shape names alibi_slopes.
#[test]
fn dense_alibi_per_batch_slopes() -> Result<()> {
    let dev = Device::Cpu;
    let mut n = 0;
    for dtype in [DType::F32, DType::F64] {
        for (b, sq, sk, hq, hkv) in [(3, 9, 21, 8, 2), (2, 1, 40, 4, 1), (4, 17, 5, 2, 2)] {
            for mask in [
                Mask::None,
                Mask::Causal,
                Mask::Window {
                    left: Some(4),
                    right: Some(1),
                },
            ] {
                for softcap in [None, Some(7.0)] {
                    let (q, k, v) = qkv(b, sq, sk, hq, hkv, 32, dtype, n % 2 == 1, &dev)?;
                    let p = AttnParams {
                        mask,
                        softcap,
                        alibi_slopes: Some(Tensor::rand(0f32, 1., (b, hq), &dev)?),
                        ..Default::default()
                    };
                    let what =
                        format!("{dtype:?} b{b} sq{sq} sk{sk} h{hq}/{hkv} {}", opts_name(&p));
                    let (o, lse) = attention_with_lse(&q, &k, &v, &p)?;
                    assert_eq!(o.dims(), q.dims(), "{what}");
                    assert_eq!(lse.dims(), &[b, hq, sq], "{what}");
                    let (o_ref, lse_ref) = per_batch(&q, &k, &v, &p, |q, k, v, p| {
                        let (o, l) = attention_with_lse(q, k, v, p)?;
                        Ok((o, Some(l)))
                    })?;
                    let err = max_abs_diff(&o, &o_ref)?;
                    let lerr = lse_err(&lse, &lse_ref.unwrap())?;
                    let tol = if dtype == DType::F64 { 1e-12 } else { 1e-5 };
                    assert!(
                        err <= tol && lerr <= 1e-5,
                        "{what}: O {err:.2e}, LSE {lerr:.2e}"
                    );
                    // the plain entry point agrees
                    let o2 = attention(&q, &k, &v, &p)?;
                    assert!(
                        max_abs_diff(&o2, &o)? <= tol,
                        "{what}: attention vs _with_lse"
                    );
                    println!("[OK] {what}: O {err:.1e}, LSE {lerr:.1e}");
                    n += 1;
                }
            }
        }
    }
    let (q, k, v) = qkv(3, 4, 4, 4, 2, 32, DType::F32, false, &dev)?;
    let shapes: [&[usize]; 5] = [&[2, 4], &[3, 5], &[4, 4], &[3, 4, 1], &[12]];
    for shape in shapes {
        let p = AttnParams {
            alibi_slopes: Some(Tensor::ones(shape, DType::F32, &dev)?),
            ..Default::default()
        };
        let e = attention(&q, &k, &v, &p)
            .expect_err("must be rejected")
            .to_string();
        assert!(names(&e, "alibi_slopes"), "slopes {shape:?}: {e}");
    }
    println!("dense_alibi_per_batch_slopes: {n} cases passed");
    Ok(())
}
