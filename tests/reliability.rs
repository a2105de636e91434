//! Regression tests of issue 53 on the CPU: inputs that used to panic, come out silently wrong,
//! or turn a finite answer into NaN. Each test states what the rule is; the numeric contract
//! is in the README.

#![allow(clippy::needless_range_loop)] // rows, heads and columns index several arrays at once

use candle_core::{DType, Device, Result, Tensor, Var};
use flashcore::{
    append_kv_paged, attention, attention_paged, attention_paged_varlen,
    attention_paged_varlen_with_lse, attention_paged_with_lse, attention_slow, attention_varlen,
    attention_varlen_with_lse, attention_with_lse, AttnParams, Mask, PagedKvCache,
};

fn randn(shape: &[usize], dtype: DType, dev: &Device) -> Result<Tensor> {
    Tensor::randn(0f32, 1., shape, dev)?.to_dtype(dtype)
}

fn vec_f64(t: &Tensor) -> Result<Vec<f64>> {
    t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()
}

/// Bitwise equality (NaN compared by bits too).
fn same_bits(a: &Tensor, b: &Tensor) -> Result<bool> {
    let (a, b) = (vec_f64(a)?, vec_f64(b)?);
    Ok(a.len() == b.len() && a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()))
}

fn max_diff(a: &Tensor, b: &Tensor) -> Result<f64> {
    let (a, b) = (vec_f64(a)?, vec_f64(b)?);
    Ok(a.iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(
            0f64,
            |m, d| {
                if d.is_nan() {
                    f64::INFINITY
                } else {
                    m.max(d)
                }
            },
        ))
}

fn window(left: Option<usize>, right: Option<usize>) -> AttnParams {
    AttnParams {
        mask: Mask::Window { left, right },
        ..Default::default()
    }
}

fn masked(mask: Mask) -> AttnParams {
    AttnParams {
        mask,
        ..Default::default()
    }
}

/// Window bounds a caller may write for "unbounded" or "as far as it goes".
fn huge_bounds(sk: usize, sq: usize) -> Vec<usize> {
    let mut v = vec![
        sk.max(sq),
        sk.max(sq) + 1,
        sk + sq,
        (1 << 31) - 1,
        1 << 31,
        i64::MAX as usize,
        usize::MAX - 1,
        usize::MAX,
    ];
    if usize::BITS == 64 {
        v.extend([1usize << 32, 1 << 40, 1 << 63]);
    }
    v
}

/// `Window { left: x, right: 0 }` with `x >= seq_k` is the causal mask, `Window { left: l, right:
/// y }` with `y >= seq_q` is the window without a right bound, and both huge is no mask:
/// bit-identical answers, for every such bound up to `usize::MAX` (the bounds used to be cast to
/// i64 and added unchecked: an overflow panic in debug builds, rows of zeros in release).
#[test]
fn huge_window_bounds_are_the_unbounded_masks() -> Result<()> {
    let dev = Device::Cpu;
    for dtype in [DType::F32, DType::F16, DType::F64] {
        for (sq, sk) in [(7, 7), (5, 11), (9, 4), (1, 70)] {
            let q = randn(&[2, sq, 4, 16], dtype, &dev)?;
            let k = randn(&[2, sk, 2, 16], dtype, &dev)?;
            let v = randn(&[2, sk, 2, 16], dtype, &dev)?;
            let (causal, lse_c) = attention_with_lse(&q, &k, &v, &masked(Mask::Causal))?;
            let (none, lse_n) = attention_with_lse(&q, &k, &v, &masked(Mask::None))?;
            let (left2, lse_l) = attention_with_lse(&q, &k, &v, &window(Some(2), None))?;
            for x in huge_bounds(sk, sq) {
                let what = format!("{dtype:?} sq {sq} sk {sk} bound {x}");
                for (p, want, want_lse) in [
                    (window(Some(x), Some(0)), &causal, &lse_c),
                    (window(Some(x), Some(x)), &none, &lse_n),
                    (window(None, Some(x)), &none, &lse_n),
                    (window(Some(2), Some(x)), &left2, &lse_l),
                ] {
                    let (o, lse) = attention_with_lse(&q, &k, &v, &p)?;
                    assert!(same_bits(&o, want)?, "{what}: {:?} differs", p.mask);
                    assert!(
                        same_bits(&lse, want_lse)?,
                        "{what}: {:?} lse differs",
                        p.mask
                    );
                    // The eager twin agrees with its own unbounded mask.
                    let slow = attention_slow(&q, &k, &v, &p)?;
                    let slow_want = attention_slow(
                        &q,
                        &k,
                        &v,
                        &masked(match p.mask.bounds() {
                            (Some(l), Some(0)) if l == x => Mask::Causal,
                            (Some(2), _) => Mask::Window {
                                left: Some(2),
                                right: None,
                            },
                            _ => Mask::None,
                        }),
                    )?;
                    assert!(same_bits(&slow, &slow_want)?, "{what}: slow {:?}", p.mask);
                }
            }
        }
    }
    Ok(())
}

/// The same for packed and paged batches (bounds against `max_seqlen_*` and the page table).
#[test]
fn huge_window_bounds_varlen_and_paged() -> Result<()> {
    let dev = Device::Cpu;
    let (hq, hkv, d) = (4, 2, 8);
    let lens_q = [3usize, 0, 6, 1];
    let lens_k = [5usize, 2, 6, 9];
    let cu = |l: &[usize]| {
        let mut c = vec![0u32];
        for &x in l {
            c.push(c.last().unwrap() + x as u32);
        }
        Tensor::new(c.as_slice(), &dev)
    };
    let (tq, tk) = (lens_q.iter().sum::<usize>(), lens_k.iter().sum::<usize>());
    let q = randn(&[tq, hq, d], DType::F32, &dev)?;
    let k = randn(&[tk, hkv, d], DType::F32, &dev)?;
    let v = randn(&[tk, hkv, d], DType::F32, &dev)?;
    let (cq, ck) = (cu(&lens_q)?, cu(&lens_k)?);
    let run = |p: &AttnParams| attention_varlen_with_lse(&q, &k, &v, &cq, &ck, 6, 9, p);
    let (causal, lc) = run(&masked(Mask::Causal))?;
    let (none, ln) = run(&masked(Mask::None))?;
    // Paged: 4 sequences with the lengths above in pages of 4 rows (shuffled page ids).
    let page = 4;
    let max_pages = 3;
    let pool_k = randn(&[16, page, hkv, d], DType::F32, &dev)?;
    let pool_v = randn(&[16, page, hkv, d], DType::F32, &dev)?;
    let table: Vec<u32> = vec![3, 9, 1, 0, 0, 0, 15, 4, 2, 7, 11, 5];
    let table = Tensor::from_vec(table, (4, max_pages), &dev)?;
    let seqlens = Tensor::new(&[5u32, 2, 6, 9], &dev)?;
    let qd = randn(&[4, 2, hq, d], DType::F32, &dev)?;
    let paged =
        |p: &AttnParams| attention_paged_with_lse(&qd, &pool_k, &pool_v, &table, &seqlens, p);
    let paged_v = |p: &AttnParams| {
        attention_paged_varlen_with_lse(&q, &pool_k, &pool_v, &table, &seqlens, &cq, 6, p)
    };
    let (pc, plc) = paged(&masked(Mask::Causal))?;
    let (pn, pln) = paged(&masked(Mask::None))?;
    let (pvc, pvlc) = paged_v(&masked(Mask::Causal))?;
    for x in huge_bounds(12, 6) {
        let (o, l) = run(&window(Some(x), Some(0)))?;
        assert!(
            same_bits(&o, &causal)? && same_bits(&l, &lc)?,
            "varlen left {x}"
        );
        let (o, l) = run(&window(Some(x), Some(x)))?;
        assert!(
            same_bits(&o, &none)? && same_bits(&l, &ln)?,
            "varlen both {x}"
        );
        let (o, l) = paged(&window(Some(x), Some(0)))?;
        assert!(
            same_bits(&o, &pc)? && same_bits(&l, &plc)?,
            "paged left {x}"
        );
        let (o, l) = paged(&window(Some(x), Some(x)))?;
        assert!(
            same_bits(&o, &pn)? && same_bits(&l, &pln)?,
            "paged both {x}"
        );
        let (o, l) = paged_v(&window(Some(x), Some(0)))?;
        assert!(
            same_bits(&o, &pvc)? && same_bits(&l, &pvlc)?,
            "paged varlen {x}"
        );
    }
    Ok(())
}

fn is_backward_not_supported(r: Result<candle_core::backprop::GradStore>) -> bool {
    matches!(r, Err(candle_core::Error::BackwardNotSupported { .. }))
}

/// A backward pass through the log-sum-exp fails like one through the output (it used to
/// return Ok with no gradient for q, k, v): dense, packed and paged, and the answer of a packed
/// batch without keys.
#[test]
fn lse_backward_is_an_error() -> Result<()> {
    let dev = Device::Cpu;
    let q = Var::from_tensor(&randn(&[1, 5, 2, 8], DType::F32, &dev)?)?;
    let k = Var::from_tensor(&randn(&[1, 5, 2, 8], DType::F32, &dev)?)?;
    let v = Var::from_tensor(&randn(&[1, 5, 2, 8], DType::F32, &dev)?)?;
    let p = masked(Mask::Causal);
    let (o, lse) = attention_with_lse(q.as_tensor(), k.as_tensor(), &v, &p)?;
    assert!(is_backward_not_supported(o.sum_all()?.backward()));
    assert!(
        is_backward_not_supported(lse.sum_all()?.backward()),
        "dense lse"
    );

    let qp = Var::from_tensor(&randn(&[5, 2, 8], DType::F32, &dev)?)?;
    let kp = Var::from_tensor(&randn(&[5, 2, 8], DType::F32, &dev)?)?;
    let cu = Tensor::new(&[0u32, 2, 5], &dev)?;
    let (_, lse) = attention_varlen_with_lse(&qp, &kp, &kp, &cu, &cu, 3, 3, &p)?;
    assert!(
        is_backward_not_supported(lse.sum_all()?.backward()),
        "varlen lse"
    );
    // No keys at all: the zeros and -inf are recorded like a computed answer.
    let cu0 = Tensor::new(&[0u32, 0, 0], &dev)?;
    let k0 = Var::from_tensor(&Tensor::zeros((0, 2, 8), DType::F32, &dev)?)?;
    let (o, lse) = attention_varlen_with_lse(&qp, &k0, &k0, &cu, &cu0, 3, 0, &p)?;
    assert!(
        is_backward_not_supported(o.sum_all()?.backward()),
        "empty varlen o"
    );
    assert!(
        is_backward_not_supported(lse.sum_all()?.backward()),
        "empty varlen lse"
    );

    let pool = Var::from_tensor(&randn(&[2, 4, 2, 8], DType::F32, &dev)?)?;
    let table = Tensor::new(&[[1u32, 0]], &dev)?;
    let lens = Tensor::new(&[6u32], &dev)?;
    let (o, lse) = attention_paged_with_lse(q.as_tensor(), &pool, &pool, &table, &lens, &p)?;
    assert!(
        is_backward_not_supported(o.sum_all()?.backward()),
        "paged o"
    );
    assert!(
        is_backward_not_supported(lse.sum_all()?.backward()),
        "paged lse"
    );
    let cq = Tensor::new(&[0u32, 5], &dev)?;
    let (_, lse) = attention_paged_varlen_with_lse(&qp, &pool, &pool, &table, &lens, &cq, 5, &p)?;
    assert!(
        is_backward_not_supported(lse.sum_all()?.backward()),
        "paged varlen lse"
    );
    Ok(())
}

/// Sets row `j` of `(b, s, h, d)` (every batch entry and head) to `x`.
fn poison_row(t: &Tensor, j: usize, x: f64) -> Result<Tensor> {
    let (b, s, h, d) = t.dims4()?;
    let mut v = vec_f64(t)?;
    for bi in 0..b {
        for e in &mut v[((bi * s + j) * h) * d..((bi * s + j + 1) * h) * d] {
            *e = x;
        }
    }
    Tensor::from_vec(v, (b, s, h, d), t.device())?.to_dtype(t.dtype())
}

/// Row `i` of `(b, s, h, d)` (all batch entries and heads): whether every value is finite.
fn row_finite(t: &Tensor, i: usize) -> Result<bool> {
    let (b, s, h, d) = t.dims4()?;
    let v = vec_f64(t)?;
    Ok((0..b).all(|bi| {
        v[((bi * s + i) * h) * d..((bi * s + i + 1) * h) * d]
            .iter()
            .all(|x| x.is_finite())
    }))
}

/// A NaN or Inf in a V (or K) row that a query row does not see never reaches that row; it
/// reaches exactly the rows that see it (the fused path used to leak a V row into the rows of
/// its block: rows 4-6 of a causal 8-row problem with V row 7 NaN came out NaN).
#[test]
fn masked_non_finite_kv_rows_do_not_leak() -> Result<()> {
    let dev = Device::Cpu;
    for dtype in [DType::F32, DType::F16, DType::BF16, DType::F64] {
        for (hq, hkv) in [(1, 1), (2, 1), (8, 2)] {
            for poison in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
                for sk in [8usize, 70, 130] {
                    let q = randn(&[2, sk, hq, 16], dtype, &dev)?;
                    let k = randn(&[2, sk, hkv, 16], dtype, &dev)?;
                    let v = randn(&[2, sk, hkv, 16], dtype, &dev)?;
                    let last = sk - 1;
                    let what = format!("{dtype:?} h{hq}/{hkv} sk {sk} poison {poison}");
                    // Causal: only the last row sees the last key.
                    for (name, k, v) in [
                        ("v", k.clone(), poison_row(&v, last, poison)?),
                        ("k", poison_row(&k, last, poison)?, v.clone()),
                    ] {
                        for (slow, o) in [
                            (false, attention(&q, &k, &v, &masked(Mask::Causal))?),
                            (true, attention_slow(&q, &k, &v, &masked(Mask::Causal))?),
                        ] {
                            for i in 0..last {
                                assert!(
                                    row_finite(&o, i)?,
                                    "{what}: {name} row {last} reached row {i} (slow={slow})"
                                );
                            }
                            if poison.is_nan() || name == "v" {
                                assert!(
                                    !row_finite(&o, last)?,
                                    "{what}: {name} lost (slow={slow})"
                                );
                            }
                        }
                    }
                    // A window whose left edge has passed key 0: rows > 3 do not see it.
                    let p = window(Some(3), Some(0));
                    let v0 = poison_row(&v, 0, poison)?;
                    let o = attention(&q, &k, &v0, &p)?;
                    let slow = attention_slow(&q, &k, &v0, &p)?;
                    for i in 0..sk {
                        assert_eq!(row_finite(&o, i)?, i > 3, "{what}: window row {i}");
                        assert_eq!(row_finite(&slow, i)?, i > 3, "{what}: slow window row {i}");
                    }
                }
            }
        }
    }
    Ok(())
}

/// Softmax of f64 scores over `v` rows (the weights of -inf scores are 0; +inf scores share the
/// weight): the expected answer of one row.
fn softmax_row(scores: &[f64], v: &[Vec<f64>]) -> Vec<f64> {
    let d = v[0].len();
    let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let w: Vec<f64> = if m == f64::INFINITY {
        scores
            .iter()
            .map(|&s| (s == f64::INFINITY) as u8 as f64)
            .collect()
    } else {
        scores.iter().map(|&s| (s - m).exp()).collect()
    };
    let l: f64 = w.iter().sum();
    (0..d)
        .map(|x| w.iter().zip(v).map(|(w, r)| w * r[x]).sum::<f64>() / l)
        .collect()
}

/// Scores of -inf for some visible keys and finite for others: the -inf keys get weight 0 and
/// the row keeps its finite answer (ALiBi slopes of 1e38 push the far keys to -inf in f32; the
/// first key blocks of the row had only -inf scores and the row used to come out NaN).
#[test]
fn minus_inf_scores_for_some_visible_keys() -> Result<()> {
    let dev = Device::Cpu;
    let (sk, d) = (200, 8);
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let q = randn(&[1, 1, 2, d], dtype, &dev)?;
        let k = randn(&[1, sk, 1, d], dtype, &dev)?;
        let v = randn(&[1, sk, 1, d], dtype, &dev)?;
        let p = AttnParams {
            alibi_slopes: Some(Tensor::new(&[1e38f32, 1e37], &dev)?),
            ..Default::default()
        };
        let (o, lse) = attention_with_lse(&q, &k, &v, &p)?;
        let slow = attention_slow(&q, &k, &v, &p)?;
        let (qv, kv, vv) = (vec_f64(&q)?, vec_f64(&k)?, vec_f64(&v)?);
        let vrows: Vec<Vec<f64>> = (0..sk).map(|j| vv[j * d..(j + 1) * d].to_vec()).collect();
        for (h, slope) in [(0, 1e38f32), (1, 1e37)] {
            // In f32, as the CPU path computes the scores.
            let scores: Vec<f64> = (0..sk)
                .map(|j| {
                    let dot: f32 = (0..d)
                        .map(|x| qv[h * d + x] as f32 * kv[j * d + x] as f32)
                        .sum::<f32>()
                        * (1.0 / (d as f32).sqrt());
                    (dot - slope * (sk - 1 - j) as f32) as f64
                })
                .collect();
            assert!(scores.contains(&f64::NEG_INFINITY));
            let want = softmax_row(&scores, &vrows);
            let got = &vec_f64(&o)?[h * d..(h + 1) * d];
            let got_slow = &vec_f64(&slow)?[h * d..(h + 1) * d];
            for x in 0..d {
                let tol = if dtype == DType::F32 { 1e-5 } else { 1e-2 };
                assert!(
                    (got[x] - want[x]).abs() <= tol * (1.0 + want[x].abs()),
                    "{dtype:?} head {h}: {} vs {}",
                    got[x],
                    want[x]
                );
                assert!((got_slow[x] - want[x]).abs() <= tol * (1.0 + want[x].abs()));
            }
            assert!(vec_f64(&lse)?[h].is_finite(), "{dtype:?}: lse");
        }
    }
    Ok(())
}

/// A softmax scale of `f32::MAX` (valid: finite) makes most scores +inf in f32: the +inf keys
/// share the weight, the limit of the softmax (it used to give NaN rows). With `q . k_j = j - 3`
/// key 4 scores exactly `f32::MAX` and keys from 5 on +inf.
#[test]
fn plus_inf_scores_share_the_weight() -> Result<()> {
    let dev = Device::Cpu;
    let (sk, d) = (9, 8);
    let mut qv = vec![0f32; d];
    qv[0] = 1.0;
    let mut kv = vec![0f32; sk * d];
    for j in 0..sk {
        kv[j * d] = j as f32 - 3.0;
    }
    let vv: Vec<f32> = (0..sk * d).map(|i| ((i * 7) % 11) as f32 - 5.0).collect();
    let q = Tensor::from_vec(vec![qv; sk].concat(), (1, sk, 1, d), &dev)?;
    let k = Tensor::from_vec(kv, (1, sk, 1, d), &dev)?;
    let v = Tensor::from_vec(vv.clone(), (1, sk, 1, d), &dev)?;
    let p = AttnParams {
        softmax_scale: Some(f32::MAX),
        mask: Mask::Causal,
        ..Default::default()
    };
    for dtype in [DType::F32, DType::F64, DType::F16] {
        let (q, k, v) = (q.to_dtype(dtype)?, k.to_dtype(dtype)?, v.to_dtype(dtype)?);
        let (o, lse) = attention_with_lse(&q, &k, &v, &p)?;
        let slow = attention_slow(&q, &k, &v, &p)?;
        let (o, slow, lse) = (vec_f64(&o)?, vec_f64(&slow)?, vec_f64(&lse)?);
        for i in 0..sk {
            // Row i sees keys 0..=i. In f32 the scores are -inf (keys 0, 1), -f32::MAX, 0,
            // f32::MAX, then +inf: rows 0 and 1 see only -inf (zeros, LSE -inf), rows 2..=4 their
            // own key, later rows the mean of keys 5..=i (LSE +inf). f64 accumulates with every
            // score finite: each row its own (largest) key.
            // (The LSE is f32: beyond f32::MAX in magnitude it is infinite for f64 too.)
            let (keys, lse_want): (Vec<usize>, f64) = match (i, dtype) {
                (0..=1, DType::F64) => (vec![i], f64::NEG_INFINITY),
                (2..=4, DType::F64) => (vec![i], f64::NAN),
                (_, DType::F64) => (vec![i], f64::INFINITY),
                (0..=1, _) => (vec![], f64::NEG_INFINITY),
                (2..=4, _) => (vec![i], f64::NAN),
                _ => ((5..=i).collect(), f64::INFINITY),
            };
            for x in 0..d {
                let want = if keys.is_empty() {
                    0.0
                } else {
                    keys.iter().map(|&j| vv[j * d + x] as f64).sum::<f64>() / keys.len() as f64
                };
                let got = o[i * d + x];
                assert!(
                    (got - want).abs() < 1e-3,
                    "{dtype:?} row {i}: {got} vs {want}"
                );
                assert!(
                    (slow[i * d + x] - want).abs() < 1e-3,
                    "{dtype:?} slow row {i}"
                );
            }
            if lse_want.is_nan() {
                assert!(lse[i].is_finite(), "{dtype:?} row {i}: lse {}", lse[i]);
            } else {
                assert_eq!(lse[i], lse_want, "{dtype:?} row {i}");
            }
        }
    }
    Ok(())
}

/// `q . k` overflowing f32 while `scale * q . k` is finite: the scale is applied where it keeps
/// the products finite (the score used to be inf * scale = inf, and the row NaN).
#[test]
fn dot_product_overflow_before_the_scale() -> Result<()> {
    let dev = Device::Cpu;
    let (sk, d) = (6, 8);
    let q = Tensor::full(1e19f32, (1, 1, 1, d), &dev)?;
    let c: Vec<f32> = (0..sk).map(|j| j as f32 / 5.0).collect();
    let kv: Vec<f32> = c.iter().flat_map(|&c| vec![c * 1e19; d]).collect();
    let k = Tensor::from_vec(kv, (1, sk, 1, d), &dev)?;
    let vv: Vec<f32> = (0..sk * d).map(|i| (i % 5) as f32).collect();
    let v = Tensor::from_vec(vv.clone(), (1, sk, 1, d), &dev)?;
    let p = AttnParams {
        softmax_scale: Some(2e-38),
        ..Default::default()
    };
    // Scores 16 * c_j (q . k = 8 * c_j * 1e38 overflows f32 for c_j > 0.43).
    let scores: Vec<f64> = c.iter().map(|&c| 16.0 * c as f64).collect();
    let vrows: Vec<Vec<f64>> = (0..sk)
        .map(|j| vv[j * d..(j + 1) * d].iter().map(|&x| x as f64).collect())
        .collect();
    let want = softmax_row(&scores, &vrows);
    for (what, o) in [
        ("fused", attention(&q, &k, &v, &p)?),
        ("slow", attention_slow(&q, &k, &v, &p)?),
    ] {
        let o = vec_f64(&o)?;
        for x in 0..d {
            assert!(
                (o[x] - want[x]).abs() < 1e-4,
                "{what}: {} vs {}",
                o[x],
                want[x]
            );
        }
    }
    Ok(())
}

/// A non-finite ALiBi slope makes every row of its head NaN (the rows of the other heads keep
/// their values): the slope is an input like q.
#[test]
fn non_finite_alibi_slopes_poison_their_head() -> Result<()> {
    let dev = Device::Cpu;
    let q = randn(&[1, 6, 3, 8], DType::F32, &dev)?;
    let k = randn(&[1, 6, 1, 8], DType::F32, &dev)?;
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        for mask in [
            Mask::None,
            Mask::Causal,
            Mask::Window {
                left: Some(1),
                right: Some(0),
            },
        ] {
            let p = AttnParams {
                mask,
                alibi_slopes: Some(Tensor::new(&[0.5f32, bad, 0.25], &dev)?),
                ..Default::default()
            };
            for (slow, o) in [
                (false, attention(&q, &k, &k, &p)?),
                (true, attention_slow(&q, &k, &k, &p)?),
            ] {
                let o = vec_f64(&o)?;
                for i in 0..6 {
                    for h in 0..3 {
                        let row = &o[(i * 3 + h) * 8..(i * 3 + h + 1) * 8];
                        assert_eq!(
                            row.iter().all(|x| x.is_finite()),
                            h != 1,
                            "slope {bad} {mask:?} row {i} head {h} slow={slow}"
                        );
                    }
                }
            }
        }
    }
    Ok(())
}

/// The eager twin computes 16-bit inputs in f32 (it overflowed in f16 where the fused path is
/// finite) and takes `(batch, heads_q)` ALiBi slopes as `attention` does.
#[test]
fn attention_slow_f16_and_per_batch_slopes() -> Result<()> {
    let dev = Device::Cpu;
    let q = (randn(&[2, 9, 4, 64], DType::F32, &dev)? * 60.0)?.to_dtype(DType::F16)?;
    let k = (randn(&[2, 9, 2, 64], DType::F32, &dev)? * 60.0)?.to_dtype(DType::F16)?;
    let v = randn(&[2, 9, 2, 64], DType::F16, &dev)?;
    let p = masked(Mask::Causal);
    let fused = attention(&q, &k, &v, &p)?;
    let slow = attention_slow(&q, &k, &v, &p)?;
    assert_eq!(fused.dims(), slow.dims());
    let diff = max_diff(&fused, &slow)?;
    assert!(diff < 1e-2, "f16 slow vs fused: {diff}");
    let p = AttnParams {
        mask: Mask::Causal,
        alibi_slopes: Some(Tensor::new(
            &[[0.5f32, 0.25, 0.125, 1.0], [0.1, 0.2, 0.3, 0.4]],
            &dev,
        )?),
        ..Default::default()
    };
    let (q, k, v) = (
        q.to_dtype(DType::F32)?,
        k.to_dtype(DType::F32)?,
        v.to_dtype(DType::F32)?,
    );
    let (q, k) = ((q / 60.0)?, (k / 60.0)?);
    let fused = attention(&q, &k, &v, &p)?;
    let slow = attention_slow(&q, &k, &v, &p)?;
    let diff = max_diff(&fused, &slow)?;
    assert!(diff < 1e-5, "per-batch slopes: {diff}");
    Ok(())
}

fn err_of<T>(r: Result<T>) -> String {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

/// `append_kv_paged` checks everything before it writes anything: a pool whose last dim is
/// strided, `v_new` being a view of `v_pages`, `k_pages` and `v_pages` being one tensor, and two
/// rows of the batch writing the same pool row are errors, and neither pool changes.
#[test]
fn append_kv_paged_checks_before_writing() -> Result<()> {
    let dev = Device::Cpu;
    let (np, ps, h, d) = (4, 4, 2, 8);
    let k_pages = Tensor::zeros((np, ps, h, d), DType::F32, &dev)?;
    let v_pages = Tensor::zeros((np, ps, h, d), DType::F32, &dev)?;
    let new = randn(&[1, 2, h, d], DType::F32, &dev)?;
    let table = Tensor::new(&[[2u32, 1]], &dev)?;
    let pos = Tensor::new(&[0u32], &dev)?;
    let untouched = |what: &str| -> Result<()> {
        assert_eq!(
            vec_f64(&k_pages)?.iter().filter(|x| **x != 0.0).count(),
            0,
            "{what}: k written"
        );
        assert_eq!(
            vec_f64(&v_pages)?.iter().filter(|x| **x != 0.0).count(),
            0,
            "{what}: v written"
        );
        Ok(())
    };
    // Strided head dim (a transposed view).
    let t_pool = Tensor::zeros((np, ps, d, h), DType::F32, &dev)?.transpose(2, 3)?;
    let e = err_of(append_kv_paged(&new, &new, &k_pages, &t_pool, &table, &pos));
    assert!(e.contains("v_pages") && e.contains("contiguous"), "{e}");
    untouched("strided")?;
    // v_new a view of v_pages.
    let alias = v_pages.narrow(0, 0, 1)?.narrow(1, 0, 2)?;
    let e = err_of(append_kv_paged(
        &new, &alias, &k_pages, &v_pages, &table, &pos,
    ));
    assert!(e.contains("v_new") && e.contains("v_pages"), "{e}");
    untouched("alias")?;
    // One pool for both.
    let e = err_of(append_kv_paged(
        &new, &new, &k_pages, &k_pages, &table, &pos,
    ));
    assert!(e.contains("v_pages") && e.contains("k_pages"), "{e}");
    untouched("same pool")?;
    // Two sequences writing the same rows.
    let new2 = randn(&[2, 2, h, d], DType::F32, &dev)?;
    let table2 = Tensor::new(&[[2u32, 1], [3, 2]], &dev)?;
    let pos2 = Tensor::new(&[0u32, 4], &dev)?;
    let e = err_of(append_kv_paged(
        &new2, &new2, &k_pages, &v_pages, &table2, &pos2,
    ));
    assert!(
        e.contains("page_table") && e.contains("page 2 row 0"),
        "{e}"
    );
    untouched("same slot")?;
    // Within one sequence is fine; so is a distinct slot.
    append_kv_paged(
        &new2,
        &new2,
        &k_pages,
        &v_pages,
        &table2,
        &Tensor::new(&[0u32, 2], &dev)?,
    )?;
    Ok(())
}

/// `PagedKvCache::append` takes no page when the append rejects the rows, and `new` with an
/// element count that overflows is an error (it used to panic in debug builds and give a pool
/// of 0 elements in release).
#[test]
fn paged_cache_append_and_new_reject_cleanly() -> Result<()> {
    let dev = Device::Cpu;
    let mut cache = PagedKvCache::new(8, 4, 2, 8, DType::F32, &dev)?;
    let a = cache.add_sequence();
    let b = cache.add_sequence();
    cache.append(
        &[a],
        &randn(&[1, 3, 2, 8], DType::F32, &dev)?,
        &randn(&[1, 3, 2, 8], DType::F32, &dev)?,
    )?;
    let free = cache.free_pages();
    // Wrong head dim: rejected by the append after the pages were counted.
    let bad = randn(&[2, 6, 2, 16], DType::F32, &dev)?;
    assert!(cache.append(&[a, b], &bad, &bad).is_err());
    assert_eq!(cache.free_pages(), free, "pages taken by a rejected append");
    assert_eq!((cache.len(a), cache.len(b)), (Some(3), Some(0)));
    // The cache still works, with the same pages.
    let ok = randn(&[2, 6, 2, 8], DType::F32, &dev)?;
    cache.append(&[a, b], &ok, &ok)?;
    assert_eq!((cache.len(a), cache.len(b)), (Some(9), Some(6)));
    assert_eq!(cache.free_pages(), free - 2 - 2);
    let (table, lens) = cache.tables(&[a, b])?;
    let q = randn(&[2, 1, 4, 8], DType::F32, &dev)?;
    attention_paged(
        &q,
        cache.k_pages(),
        cache.v_pages(),
        &table,
        &lens,
        &Default::default(),
    )?;
    for shape in [
        (1 << 20, 1 << 20, 1 << 20, 1 << 20),
        (1 << 31, 1 << 31, 1 << 2, 8),
        (u32::MAX as usize, usize::MAX / 2, 1, 8),
        (4, 4, 0, 8),
    ] {
        let r = std::panic::catch_unwind(|| {
            PagedKvCache::new(shape.0, shape.1, shape.2, shape.3, DType::F16, &dev)
        });
        let r = r.unwrap_or_else(|_| panic!("{shape:?}: panicked"));
        let e = err_of(r);
        assert!(e.contains("PagedKvCache"), "{shape:?}: {e}");
    }
    Ok(())
}

/// `heads_kv = 0` is its own error, not a divisibility complaint.
#[test]
fn zero_kv_heads_message() -> Result<()> {
    let dev = Device::Cpu;
    let q = randn(&[1, 2, 4, 8], DType::F32, &dev)?;
    let k = Tensor::zeros((1, 2, 0, 8), DType::F32, &dev)?;
    let e = err_of(attention(&q, &k, &k, &Default::default()));
    assert!(e.contains("k: heads_kv must be >= 1"), "{e}");
    let cu = Tensor::new(&[0u32, 2], &dev)?;
    let e = err_of(attention_varlen(
        &q.squeeze(0)?,
        &k.squeeze(0)?,
        &k.squeeze(0)?,
        &cu,
        &cu,
        2,
        2,
        &Default::default(),
    ));
    assert!(e.contains("heads_kv must be >= 1"), "{e}");
    let pool = Tensor::zeros((1, 4, 0, 8), DType::F32, &dev)?;
    let e = err_of(attention_paged_varlen(
        &q.squeeze(0)?,
        &pool,
        &pool,
        &Tensor::new(&[[0u32]], &dev)?,
        &Tensor::new(&[2u32], &dev)?,
        &cu,
        2,
        &Default::default(),
    ));
    assert!(e.contains("heads_kv must be >= 1"), "{e}");
    Ok(())
}

/// f64 inputs get the default scale `1 / sqrt(head_dim)` in f64 (it was the f32 value, an
/// error of ~1e-8 against the exact result).
#[test]
fn f64_default_scale_is_exact() -> Result<()> {
    let dev = Device::Cpu;
    let (sk, d) = (5, 24);
    let q = randn(&[1, 1, 1, d], DType::F64, &dev)?;
    let k = (randn(&[1, sk, 1, d], DType::F64, &dev)? * 4.0)?;
    let v = randn(&[1, sk, 1, d], DType::F64, &dev)?;
    let o = vec_f64(&attention(&q, &k, &v, &Default::default())?)?;
    let slow = vec_f64(&attention_slow(&q, &k, &v, &Default::default())?)?;
    let (qv, kv, vv) = (vec_f64(&q)?, vec_f64(&k)?, vec_f64(&v)?);
    let scale = 1.0 / (d as f64).sqrt();
    let scores: Vec<f64> = (0..sk)
        .map(|j| (0..d).map(|x| qv[x] * kv[j * d + x]).sum::<f64>() * scale)
        .collect();
    let vrows: Vec<Vec<f64>> = (0..sk).map(|j| vv[j * d..(j + 1) * d].to_vec()).collect();
    let want = softmax_row(&scores, &vrows);
    for x in 0..d {
        assert!((o[x] - want[x]).abs() < 1e-13, "{} vs {}", o[x], want[x]);
        assert!(
            (slow[x] - want[x]).abs() < 1e-13,
            "slow {} vs {}",
            slow[x],
            want[x]
        );
    }
    Ok(())
}
