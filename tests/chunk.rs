//! Chunked attention (`AttnParams::chunk`, Llama 4): the query at bottom-right position `p` sees
//! only keys in `[floor(p / c) * c, (floor(p / c) + 1) * c)`, intersected with the mask. On the
//! CPU against the f64 model of tests/common (which checks `floor(p / c) == floor(j / c)` key by
//! key) and against an independent construction (each chunk run as its own bottom-right aligned
//! sub-problem without a chunk, results concatenated); on dense, packed and paged batches, the
//! LSE twins and `attention_slow`, with every mask, softcap, ALiBi, sinks and GQA; the canonical
//! form (a chunk that changes nothing is no chunk, bit for bit); validation; and on a GPU
//! (pieces of ordinary attention, src/chunk.rs) against the CPU path, outputs poisoned.

mod common;
#[cfg(feature = "cuda")]
#[path = "common/gpu.rs"]
mod common_gpu;

use candle_core::{DType, Device, Result, Tensor};
use common::*;
use flashcore::{
    attention, attention_paged_with_lse, attention_slow, attention_varlen_with_lse,
    attention_with_lse, AttnParams, Mask,
};

/// The options of case `which`: 0 plain, 1 softcap, 2 ALiBi `(hq,)`, 3 sinks, 4 all three.
fn opts(mask: Mask, chunk: Option<usize>, which: usize, hq: usize) -> Result<AttnParams> {
    let dev = Device::Cpu;
    let mut p = AttnParams {
        mask,
        chunk,
        ..Default::default()
    };
    if which == 1 || which == 4 {
        p.softcap = Some(5.0);
    }
    if which == 2 || which == 4 {
        let s: Vec<f32> = (0..hq).map(|h| 0.05 + 0.1 * h as f32).collect();
        p.alibi_slopes = Some(Tensor::new(s.as_slice(), &dev)?);
    }
    if which == 3 || which == 4 {
        p.sinks = Some(test_sinks(hq, &dev)?);
    }
    Ok(p)
}

/// Bit-level equality of two tensors (same dtype and shape).
fn same_bits(a: &Tensor, b: &Tensor) -> Result<bool> {
    let f = |t: &Tensor| -> Result<Vec<u64>> {
        Ok(t.to_dtype(DType::F64)?
            .flatten_all()?
            .to_vec1::<f64>()?
            .iter()
            .map(|x| x.to_bits())
            .collect())
    };
    Ok(a.dims() == b.dims() && f(a)? == f(b)?)
}

const MASKS: [Mask; 5] = [
    Mask::None,
    Mask::Causal,
    Mask::Window {
        left: Some(17),
        right: Some(3),
    },
    Mask::Window {
        left: Some(30),
        right: Some(0),
    },
    Mask::Window {
        left: None,
        right: Some(5),
    },
];

/// Dense problems of awkward shapes (lengths 1 and 113, `c` not dividing `sk`, `sq != sk` both
/// ways, GQA, one query row) against the f64 model: O and LSE of `attention_with_lse`, O of
/// `attention` and of `attention_slow`. The model without the chunk must differ from the model
/// with it on most cases (the chunk is not a no-op here).
#[test]
fn chunk_dense_matches_f64_model() -> Result<()> {
    let dev = Device::Cpu;
    // (b, sq, sk, hq, hkv, d)
    let shapes = [
        (1, 1, 1, 1, 1, 8),
        (2, 113, 113, 4, 2, 16),
        (1, 113, 200, 4, 1, 16),
        (1, 50, 20, 2, 2, 8),
        (1, 37, 37, 8, 2, 32),
        (2, 1, 130, 4, 4, 16),
    ];
    let (mut cases, mut changed) = (0, 0);
    for (si, &(b, sq, sk, hq, hkv, d)) in shapes.iter().enumerate() {
        let dtype = if si % 2 == 0 { DType::F32 } else { DType::F64 };
        let (q, k, v) = qkv(b, sq, sk, hq, hkv, d, dtype, si == 2, &dev)?;
        for (mi, &mask) in MASKS.iter().enumerate() {
            for (ci, c) in [1usize, 7, 16, 64].into_iter().enumerate() {
                let mut p = opts(mask, Some(c), (si + mi + ci) % 5, hq)?;
                if dtype == DType::F64 {
                    // The model takes the default scale in f32, the f64 path in f64: give one.
                    p.softmax_scale = Some(0.3);
                }
                let what = format!("b{b} sq{sq} sk{sk} h{hq}/{hkv} d{d} {}", opts_name(&p));
                let (o, lse) = attention_with_lse(&q, &k, &v, &p)?;
                let (ro, rl) = reference_f64(&q, &k, &v, &p)?;
                // The LSE is f32 whatever the dtype.
                let tol = if dtype == DType::F64 { 1e-11 } else { 2e-5 };
                let (eo, el) = (max_abs_diff(&o, &ro)?, lse_err(&lse, &rl)?);
                assert!(eo < tol && el < 2e-5, "{what}: O err {eo}, LSE err {el}");
                let o2 = attention(&q, &k, &v, &p)?;
                assert!(
                    same_bits(&o, &o2)?,
                    "{what}: attention != attention_with_lse"
                );
                let es = max_abs_diff(&attention_slow(&q, &k, &v, &p)?, &ro)?;
                assert!(es < tol, "{what}: attention_slow err {es}");
                let unchunked = AttnParams {
                    chunk: None,
                    ..p.clone()
                };
                let (uo, _) = reference_f64(&q, &k, &v, &unchunked)?;
                cases += 1;
                if max_abs_diff(&uo, &ro)? > 1e-3 {
                    changed += 1;
                }
            }
        }
    }
    println!("{changed} of {cases} cases changed by the chunk");
    assert!(
        changed * 2 > cases,
        "the chunk changed only {changed} of {cases} cases"
    );
    Ok(())
}

/// Chunked attention as a concatenation of sub-problems, built without the crate's chunk code:
/// the rows whose position `p = i + sk - sq` lies in chunk `n` (`[n c, (n + 1) c)`) against the
/// keys `[n c, min((n + 1) c, sk))`, as a dense problem without a chunk; rows at `p < 0` see no
/// key (zeros, LSE -inf or the sink). Under the causal mask the sub-problem's bottom-right
/// alignment puts each row at `p - n c`, its position within the chunk, so windows and ALiBi
/// carry over; without a mask every row of the chunk sees all of its keys.
#[test]
fn chunk_equals_sub_problems() -> Result<()> {
    let dev = Device::Cpu;
    let (b, hq, hkv, d) = (2, 4, 2, 16);
    for (sq, sk) in [(113, 113), (64, 200), (90, 40), (1, 77)] {
        let (q, k, v) = qkv(b, sq, sk, hq, hkv, d, DType::F64, false, &dev)?;
        let off = sk as i64 - sq as i64;
        for c in [1usize, 16, 50, 64, 113] {
            let variants = [
                (Mask::Causal, 0),
                (Mask::Causal, 2),
                (Mask::Causal, 4),
                (
                    Mask::Window {
                        left: Some(20),
                        right: Some(0),
                    },
                    3,
                ),
                (Mask::None, 0),
                (Mask::None, 3),
            ];
            for (mask, which) in variants {
                let p = opts(mask, Some(c), which, hq)?;
                let what = format!("sq{sq} sk{sk} c{c} {}", opts_name(&p));
                let sub_p = AttnParams {
                    chunk: None,
                    ..p.clone()
                };
                let mut os = Vec::new();
                let mut ls = Vec::new();
                // Rows before the first key: chunk -1.
                let before = (-off).clamp(0, sq as i64) as usize;
                if before > 0 {
                    os.push(Tensor::zeros((b, before, hq, d), DType::F64, &dev)?);
                    ls.push(match &p.sinks {
                        Some(s) => s
                            .to_dtype(DType::F32)?
                            .reshape((1, hq, 1))?
                            .broadcast_as((b, hq, before))?
                            .contiguous()?,
                        None => Tensor::full(f32::NEG_INFINITY, (b, hq, before), &dev)?,
                    });
                }
                let mut covered = before;
                for n in 0..sk.div_ceil(c) {
                    let (k0, k1) = (n * c, ((n + 1) * c).min(sk));
                    let i0 = (k0 as i64 - off).clamp(0, sq as i64) as usize;
                    let i1 = (((n + 1) * c) as i64 - off).clamp(0, sq as i64) as usize;
                    if i0 >= i1 {
                        continue;
                    }
                    assert_eq!(i0, covered, "{what}: rows of chunk {n}");
                    covered = i1;
                    if mask != Mask::None {
                        // The sub-problem's diagonal is the row's position within the chunk.
                        let (nq, nk) = (i1 - i0, k1 - k0);
                        assert_eq!(
                            nk as i64 - nq as i64,
                            i0 as i64 + off - k0 as i64,
                            "{what}: alignment of chunk {n}"
                        );
                    }
                    let (o, l) = attention_with_lse(
                        &q.narrow(1, i0, i1 - i0)?,
                        &k.narrow(1, k0, k1 - k0)?,
                        &v.narrow(1, k0, k1 - k0)?,
                        &sub_p,
                    )?;
                    os.push(o);
                    ls.push(l);
                }
                assert_eq!(covered, sq, "{what}: every row in one chunk");
                let want_o = Tensor::cat(&os, 1)?;
                let want_l = Tensor::cat(&ls, 2)?;
                let (o, l) = attention_with_lse(&q, &k, &v, &p)?;
                let (eo, el) = (max_abs_diff(&o, &want_o)?, lse_err(&l, &want_l)?);
                // f64 inputs; the LSEs are f32 (one rounding each).
                assert!(eo < 1e-11 && el < 1e-5, "{what}: O err {eo}, LSE err {el}");
            }
        }
    }
    Ok(())
}

/// The f64 model per sequence, packed like `attention_varlen` (LSE f32).
fn varlen_model(vl: &Varlen, p: &AttnParams) -> Result<(Tensor, Tensor)> {
    let (o, l) = varlen_by_sequence(vl, p, false, |q, k, v, p| {
        let (o, l) = reference_f64(q, k, v, p)?;
        Ok((o.to_dtype(vl.q.dtype())?, Some(l.to_dtype(DType::F32)?)))
    })?;
    Ok((o, l.expect("the model gives LSEs")))
}

/// Packed and paged batches (shuffled page tables, NaN in unused pool rows) with empty
/// sequences, one-row sequences, sequences of fewer keys than query rows and `c` not dividing
/// the lengths: `attention_varlen_with_lse`, `attention_paged_varlen_with_lse` and the O-only
/// twins against the f64 model, each sequence at its own bottom-right positions.
#[test]
fn chunk_varlen_and_paged_match_f64_model() -> Result<()> {
    let dev = Device::Cpu;
    let mut rng = Rng::from_clock("chunk_varlen_and_paged");
    let lens = [
        (0, 5),
        (5, 0),
        (113, 113),
        (1, 200),
        (40, 17),
        (30, 30),
        (7, 64),
    ];
    let (hq, hkv, d) = (4, 2, 16);
    let vl = Varlen::random(&lens, hq, hkv, d, DType::F32, true, &dev)?;
    let masks = [
        Mask::None,
        Mask::Causal,
        Mask::Window {
            left: Some(9),
            right: Some(0),
        },
        Mask::Window {
            left: Some(12),
            right: Some(4),
        },
    ];
    let mut n = 0;
    for mask in masks {
        for c in [1usize, 16, 33, 64] {
            let p = opts(mask, Some(c), n % 5, hq)?;
            n += 1;
            let what = format!("{} {}", vl.shape_name(), opts_name(&p));
            let (want_o, want_l) = varlen_model(&vl, &p)?;
            let (o, l) = vl.run(&p)?;
            let (eo, el) = (max_abs_diff(&o, &want_o)?, lse_err(&l, &want_l)?);
            assert!(eo < 2e-5 && el < 2e-5, "varlen {what}: O {eo}, LSE {el}");
            assert!(same_bits(&vl.run_o(&p)?, &o)?, "varlen O-only {what}");
            let pg = Paged::from_varlen(&vl, 16, 0, &mut rng)?;
            let (po, pl) = pg.run_varlen(&vl, &p)?;
            let (eo, el) = (max_abs_diff(&po, &want_o)?, lse_err(&pl, &want_l)?);
            assert!(
                eo < 2e-5 && el < 2e-5,
                "paged varlen {what}: O {eo}, LSE {el}"
            );
            assert!(
                same_bits(&pg.run_varlen_o(&vl, &p)?, &po)?,
                "paged O-only {what}"
            );
        }
    }
    // Dense q over pages: decode (one row per sequence) and a few rows per sequence.
    for lens in [
        vec![(1, 0), (1, 37), (1, 200), (1, 64)],
        vec![(5, 3), (5, 40), (5, 5)],
    ] {
        let vl = Varlen::random(&lens, hq, hkv, d, DType::F32, false, &dev)?;
        for (i, mask) in masks.into_iter().enumerate() {
            for c in [1usize, 16, 33] {
                let p = opts(mask, Some(c), (i + c) % 5, hq)?;
                let what = format!("dense-q paged {} {}", vl.shape_name(), opts_name(&p));
                let (want_o, want_l) = varlen_model(&vl, &p)?;
                let pg = Paged::from_varlen(&vl, 8, 0, &mut rng)?;
                let (o, l) = pg.run_dense(&vl, &p)?;
                let (eo, el) = (max_abs_diff(&o, &want_o)?, lse_err(&l, &want_l)?);
                assert!(eo < 2e-5 && el < 2e-5, "{what}: O {eo}, LSE {el}");
            }
        }
    }
    Ok(())
}

/// `c = 1`: every row sees at most the one key at its own position (and only if the mask lets
/// it): O is that key's V row (or, with a sink, that row scaled by its softmax weight against
/// the sink), checked directly.
#[test]
fn chunk_of_one_sees_the_diagonal_key() -> Result<()> {
    let dev = Device::Cpu;
    let (b, sq, sk, hq, hkv, d) = (1, 20, 30, 2, 1, 8);
    let (q, k, v) = qkv(b, sq, sk, hq, hkv, d, DType::F64, false, &dev)?;
    let p = AttnParams {
        chunk: Some(1),
        ..Default::default()
    };
    let (o, lse) = attention_with_lse(&q, &k, &v, &p)?;
    let scale = 1.0 / (d as f64).sqrt();
    let (qv, kv, vv) = (
        q.flatten_all()?.to_vec1::<f64>()?,
        k.flatten_all()?.to_vec1::<f64>()?,
        v.flatten_all()?.to_vec1::<f64>()?,
    );
    let (ov, lv) = (
        o.flatten_all()?.to_vec1::<f64>()?,
        lse.flatten_all()?.to_vec1::<f32>()?,
    );
    for i in 0..sq {
        let j = i + sk - sq;
        for h in 0..hq {
            let qr = &qv[(i * hq + h) * d..(i * hq + h + 1) * d];
            let kr = &kv[j * d..(j + 1) * d];
            let s: f64 = qr.iter().zip(kr).map(|(a, b)| a * b).sum::<f64>() * scale;
            assert!(
                (lv[h * sq + i] as f64 - s).abs() < 1e-5,
                "row {i} head {h}: LSE {} want the one score {s}",
                lv[h * sq + i]
            );
            for x in 0..d {
                let got = ov[(i * hq + h) * d + x];
                assert!(
                    (got - vv[j * d + x]).abs() < 1e-12,
                    "row {i} head {h} col {x}: {got} want V[{j}]"
                );
            }
        }
    }
    Ok(())
}

/// The canonical form: a chunk at least the key count that cannot change any row is no chunk,
/// bit for bit (O and LSE, fused and eager), for dense, packed and paged batches; where rows sit
/// before the first key (`sq > sk`) without a causal right bound, those rows lose their keys and
/// every other row is unchanged, bit for bit.
#[test]
fn chunk_at_least_the_keys_is_no_chunk() -> Result<()> {
    let dev = Device::Cpu;
    let mut rng = Rng::from_clock("chunk_normalise");
    let (hq, hkv, d) = (4, 2, 16);
    for (sq, sk) in [(1, 1), (40, 113), (113, 113), (7, 200)] {
        let (q, k, v) = qkv(2, sq, sk, hq, hkv, d, DType::F32, false, &dev)?;
        for (mi, &mask) in MASKS.iter().enumerate() {
            let base = opts(mask, None, mi % 5, hq)?;
            let (o0, l0) = attention_with_lse(&q, &k, &v, &base)?;
            let s0 = attention_slow(&q, &k, &v, &base)?;
            for c in [sk, sk + 5, usize::MAX] {
                let p = AttnParams {
                    chunk: Some(c),
                    ..base.clone()
                };
                let what = format!("sq{sq} sk{sk} {}", opts_name(&p));
                let (o, l) = attention_with_lse(&q, &k, &v, &p)?;
                assert!(same_bits(&o, &o0)? && same_bits(&l, &l0)?, "{what}");
                assert!(
                    same_bits(&attention_slow(&q, &k, &v, &p)?, &s0)?,
                    "{what} (slow)"
                );
            }
        }
    }
    // Packed / paged, causal: any chunk >= the longest key count is no chunk.
    let lens = [(3, 0), (40, 17), (1, 90), (64, 64)];
    let vl = Varlen::random(&lens, hq, hkv, d, DType::F32, false, &dev)?;
    let pg = Paged::from_varlen(&vl, 16, 0, &mut rng)?;
    let base = opts(Mask::Causal, None, 3, hq)?;
    let (o0, l0) = vl.run(&base)?;
    let (po0, pl0) = pg.run_varlen(&vl, &base)?;
    for c in [90, 91, usize::MAX] {
        let p = AttnParams {
            chunk: Some(c),
            ..base.clone()
        };
        let (o, l) = vl.run(&p)?;
        assert!(same_bits(&o, &o0)? && same_bits(&l, &l0)?, "varlen c{c}");
        let (o, l) = pg.run_varlen(&vl, &p)?;
        assert!(same_bits(&o, &po0)? && same_bits(&l, &pl0)?, "paged c{c}");
    }
    // Rows before the first key, no mask: chunk -1 holds no key.
    let (sq, sk) = (50, 20);
    let (q, k, v) = qkv(1, sq, sk, hq, hkv, d, DType::F32, false, &dev)?;
    let base = AttnParams::default();
    let (o0, l0) = attention_with_lse(&q, &k, &v, &base)?;
    for c in [sk, 1000, usize::MAX] {
        let p = AttnParams {
            chunk: Some(c),
            ..Default::default()
        };
        let (o, l) = attention_with_lse(&q, &k, &v, &p)?;
        let early = sq - sk;
        assert_eq!(max_abs(&o.narrow(1, 0, early)?)?, 0.0, "c{c}: early rows");
        let le = l.narrow(2, 0, early)?.flatten_all()?.to_vec1::<f32>()?;
        assert!(
            le.iter().all(|&x| x == f32::NEG_INFINITY),
            "c{c}: early LSE"
        );
        assert!(
            same_bits(&o.narrow(1, early, sk)?, &o0.narrow(1, early, sk)?)?
                && same_bits(&l.narrow(2, early, sk)?, &l0.narrow(2, early, sk)?)?,
            "c{c}: later rows"
        );
    }
    Ok(())
}

/// `chunk = Some(0)` is an error naming `chunk`, the rule and the value, on every entry point.
#[test]
fn chunk_zero_is_an_error() -> Result<()> {
    let dev = Device::Cpu;
    let (hq, hkv, d) = (4, 2, 16);
    let (q, k, v) = qkv(1, 5, 9, hq, hkv, d, DType::F32, false, &dev)?;
    let p = AttnParams {
        chunk: Some(0),
        mask: Mask::Causal,
        ..Default::default()
    };
    let check = |what: &str, e: candle_core::Error| {
        let m = e.to_string();
        assert!(
            names(&m, "chunk") && m.contains(">= 1") && m.contains("got 0"),
            "{what}: {m}"
        );
    };
    check("attention", attention(&q, &k, &v, &p).unwrap_err());
    check("with_lse", attention_with_lse(&q, &k, &v, &p).unwrap_err());
    check("slow", attention_slow(&q, &k, &v, &p).unwrap_err());
    let vl = Varlen::random(&[(3, 4), (0, 2)], hq, hkv, d, DType::F32, false, &dev)?;
    check("varlen", vl.run(&p).unwrap_err());
    let e = attention_varlen_with_lse(
        &vl.q, &vl.k, &vl.v, &vl.cu_q_t, &vl.cu_k_t, vl.max_q, vl.max_k, &p,
    )
    .unwrap_err();
    check("varlen direct", e);
    let mut rng = Rng::from_clock("chunk_zero");
    let pg = Paged::from_varlen(&vl, 4, 0, &mut rng)?;
    check("paged varlen", pg.run_varlen(&vl, &p).unwrap_err());
    let qd = Tensor::randn(0f32, 1., (2, 1, hq, d), &dev)?;
    let e = attention_paged_with_lse(
        &qd,
        &pg.k_pages,
        &pg.v_pages,
        &pg.page_table,
        &pg.seqlens_k,
        &p,
    )
    .unwrap_err();
    check("paged", e);
    Ok(())
}

/// Chunked attention on a GPU: no kernel takes a chunk, so it runs as pieces of ordinary
/// attention (src/chunk.rs). Each test skips without a CUDA device (FLASHCORE_REQUIRE_GPU=1 makes
/// that a failure); outputs are poisoned (NaN) before every kernel, so an unwritten row fails.
#[cfg(feature = "cuda")]
mod gpu {
    use super::*;
    use common_gpu::{arch_under_test, gpu};
    use flashcore::attention_varlen;

    /// The GPU tests' tolerance rule: O within `2 x naive + floor` of the truth (the naive
    /// same-precision composition's error, plus a few units in the last place), no non-finite
    /// element, LSE within 2e-3 (equal infinities agree). Prints the one-line summary.
    fn assert_close(
        what: &str,
        got: (&Tensor, &Tensor),
        truth: (&Tensor, &Tensor),
        naive: &Tensor,
    ) -> Result<()> {
        let cpu = Device::Cpu;
        let o = got.0.to_device(&cpu)?;
        let bad = non_finite(&o)?;
        assert_eq!(
            bad, 0,
            "{what}: {bad} non-finite (unwritten or NaN) elements"
        );
        let err = max_abs_diff(&o, truth.0)?;
        let naive_err = max_abs_diff(naive, truth.0)?;
        let bound = 2.0 * naive_err + rounding_floor(got.0.dtype(), max_abs(truth.0)?);
        let lerr = lse_err(&got.1.to_device(&cpu)?, truth.1)?;
        let summary = format!("{what}: err {err:.2e} (bound {bound:.2e}) lse {lerr:.1e}");
        assert!(err <= bound, "{summary}: error above the bound");
        assert!(lerr <= 2e-3, "{summary}: lse error above 2e-3");
        println!("[OK] {summary}");
        Ok(())
    }

    /// `(batch, heads_q)` ALiBi slopes on `dev`.
    fn slopes_per_batch(b: usize, hq: usize, dev: &Device) -> Result<Tensor> {
        let s: Vec<f32> = (0..b * hq).map(|x| 0.02 + 0.03 * x as f32).collect();
        Tensor::from_vec(s, (b, hq), dev)
    }

    /// Dense batches: several pieces per call (c not dividing the length), strided views, a
    /// window, rows before the first key (zeros, LSE = the sink), decode, `d_v != d_qk` (the
    /// padded route inside each piece), both dtypes, softcap, both ALiBi shapes and sinks, O and
    /// LSE and the O-only twin against the CPU path's chunk (f32). The route names the pieces.
    #[test]
    fn chunk_dense_on_gpu() -> Result<()> {
        let Some(dev) = gpu() else { return Ok(()) };
        arch_under_test();
        let cpu = Device::Cpu;
        // (b, sq, sk, hq, hkv, d, dv, mask, c, options, strided)
        let win = Mask::Window {
            left: Some(100),
            right: Some(0),
        };
        let cases = [
            (2, 300, 300, 8, 2, 64, 64, Mask::Causal, 128, 0, false),
            (2, 113, 113, 4, 2, 64, 64, Mask::Causal, 50, 4, true),
            (1, 200, 520, 4, 4, 128, 128, win, 100, 1, false),
            (2, 90, 40, 4, 2, 64, 64, Mask::None, 16, 3, false),
            (2, 1, 700, 8, 1, 64, 64, Mask::Causal, 256, 5, false),
            (1, 257, 257, 4, 2, 192, 128, Mask::Causal, 64, 2, false),
        ];
        for (n, &(b, sq, sk, hq, hkv, d, dv, mask, c, which, strided)) in cases.iter().enumerate() {
            let dtype = if n % 2 == 0 { DType::BF16 } else { DType::F16 };
            let (q, k, v) = qkv(b, sq, sk, hq, hkv, d, dtype, strided, &dev)?;
            let v = if dv == d {
                v
            } else {
                Tensor::randn(0f32, 1., (b, sk, hkv, dv), &dev)?.to_dtype(dtype)?
            };
            // 5: (batch, heads_q) slopes and sinks.
            let mut p = opts(mask, Some(c), which.min(4), hq)?;
            if which == 5 {
                p.alibi_slopes = Some(slopes_per_batch(b, hq, &cpu)?);
                p.sinks = Some(test_sinks(hq, &cpu)?);
            }
            let pg = params_on(&p, &dev)?;
            let Device::Cuda(cuda) = &dev else {
                unreachable!()
            };
            let route = flashcore::cuda::describe(cuda, &pg, &q, &k, &v)?;
            let what = format!(
                "{dtype:?} b{b} sq{sq} sk{sk} h{hq}/{hkv} d{d}/{dv} {} [{route}]",
                opts_name(&p)
            );
            assert!(route.contains("pieces (chunk"), "{what}: route");
            let (o, lse) = attention_with_lse(&q, &k, &v, &pg)?;
            let f32c = |t: &Tensor| t.to_device(&cpu)?.to_dtype(DType::F32);
            let (to, tl) = attention_with_lse(&f32c(&q)?, &f32c(&k)?, &f32c(&v)?, &p)?;
            let (naive, _) = per_batch(&q, &k, &v, &pg, |q, k, v, p| {
                Ok((attention_slow(q, k, v, p)?, None))
            })?;
            assert_close(&what, (&o, &lse), (&to, &tl), &naive)?;
            let o2 = attention(&q, &k, &v, &pg)?;
            assert_close(&format!("{what} O only"), (&o2, &lse), (&to, &tl), &naive)?;
            if sq > sk {
                // Rows before the first key see nothing: exact zeros.
                let early = o.narrow(1, 0, sq - sk)?.to_device(&cpu)?;
                assert_eq!(max_abs(&early)?, 0.0, "{what}: rows before the first key");
            }
        }
        // Normalised away (causal, c >= sk): the usual kernel, bit for bit.
        let (q, k, v) = qkv(1, 64, 64, 4, 2, 64, DType::BF16, false, &dev)?;
        let whole = AttnParams {
            mask: Mask::Causal,
            chunk: Some(64),
            ..Default::default()
        };
        let none = AttnParams {
            chunk: None,
            ..whole.clone()
        };
        assert!(same_bits(
            &attention(&q, &k, &v, &whole)?,
            &attention(&q, &k, &v, &none)?
        )?);
        Ok(())
    }

    /// The truth of a packed problem (the CPU path's chunk, f32, per sequence) and the naive
    /// composition on the GPU.
    fn packed_truth(vl: &Varlen, p: &AttnParams) -> Result<(Tensor, Tensor, Tensor)> {
        let cpu = Device::Cpu;
        let vl32 = vl.to(&cpu, DType::F32)?;
        let (to, tl) = varlen_by_sequence(&vl32, &params_on(p, &cpu)?, false, |q, k, v, p| {
            let (o, l) = attention_with_lse(q, k, v, p)?;
            Ok((o, Some(l)))
        })?;
        let (naive, _) = varlen_by_sequence(vl, p, false, |q, k, v, p| {
            Ok((attention_slow(q, k, v, p)?, None))
        })?;
        Ok((to, tl.expect("LSE"), naive))
    }

    /// The batches and options of the packed and paged tests: sequences without rows or keys,
    /// one row, more rows than keys, keys of chunks no query sees, a long one.
    fn packed_cases(dev: &Device) -> Result<Vec<(Varlen, AttnParams)>> {
        let lens = [
            (3, 40),
            (17, 17),
            (1, 70),
            (0, 5),
            (5, 0),
            (130, 300),
            (64, 20),
            (0, 0),
            (200, 200),
        ];
        let cpu = Device::Cpu;
        let win = Mask::Window {
            left: Some(50),
            right: Some(0),
        };
        // (mask, c, options, head dim, dtype)
        let cases = [
            (Mask::Causal, 64, 0, 64, DType::BF16),
            (win, 96, 1, 64, DType::F16),
            (Mask::None, 32, 3, 128, DType::BF16),
            (Mask::Causal, 16, 5, 64, DType::BF16),
            (Mask::Causal, 128, 4, 128, DType::F16),
        ];
        let mut out = Vec::new();
        for (mask, c, which, d, dtype) in cases {
            let vl = Varlen::random(&lens, 8, 2, d, DType::F32, false, &cpu)?.to(dev, dtype)?;
            let mut p = opts(mask, Some(c), which.min(4), 8)?;
            if which == 5 {
                p.alibi_slopes = Some(slopes_per_batch(lens.len(), 8, &cpu)?);
                p.sinks = Some(test_sinks(8, &cpu)?);
            }
            out.push((vl, params_on(&p, dev)?));
        }
        Ok(out)
    }

    /// Packed batches: one packed call over the pieces (O and LSE, and the O-only twin) against
    /// the CPU path's chunk.
    #[test]
    fn chunk_varlen_on_gpu() -> Result<()> {
        let Some(dev) = gpu() else { return Ok(()) };
        arch_under_test();
        for (vl, p) in packed_cases(&dev)? {
            let what = format!("varlen {} {}", vl.shape_name(), opts_name(&p));
            let (to, tl, naive) = packed_truth(&vl, &p)?;
            let (o, l) = vl.run(&p)?;
            assert_close(&what, (&o, &l), (&to, &tl), &naive)?;
            let o2 = attention_varlen(
                &vl.q, &vl.k, &vl.v, &vl.cu_q_t, &vl.cu_k_t, vl.max_q, vl.max_k, &p,
            )?;
            assert_close(&format!("{what} O only"), (&o2, &l), (&to, &tl), &naive)?;
        }
        Ok(())
    }

    /// Paged caches (shuffled pages, NaN in unused pool rows, unused table entries outside the
    /// pool) of pages of 16 and 64 rows: packed q, dense q of several rows (packed pieces) and
    /// decode (dense q kept, one piece per sequence) against the CPU path's chunk; the route
    /// names the pieces; a chunk that is not a multiple of the page size is an error naming
    /// `chunk` and the page size.
    #[test]
    fn chunk_paged_on_gpu() -> Result<()> {
        let Some(dev) = gpu() else { return Ok(()) };
        arch_under_test();
        let Device::Cuda(cuda) = &dev else {
            unreachable!()
        };
        let mut rng = Rng::from_clock("chunk_paged_gpu");
        for (n, (vl, p)) in packed_cases(&dev)?.into_iter().enumerate() {
            let c = p.chunk.expect("chunk");
            let ps = if c % 64 == 0 && n % 2 == 0 { 64 } else { 16 };
            let pg = Paged::from_varlen(&vl, ps, 0, &mut rng)?;
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
            let what = format!("paged{ps} {} {} [{route}]", vl.shape_name(), opts_name(&p));
            assert!(route.contains("pieces (chunk"), "{what}: route");
            let (to, tl, naive) = packed_truth(&vl, &p)?;
            let (o, l) = pg.run_varlen(&vl, &p)?;
            assert_close(&what, (&o, &l), (&to, &tl), &naive)?;
            let o2 = pg.run_varlen_o(&vl, &p)?;
            assert_close(&format!("{what} O only"), (&o2, &l), (&to, &tl), &naive)?;
        }
        // Dense q: decode (one piece per sequence) and five rows per sequence.
        let cpu = Device::Cpu;
        for lens in [
            vec![(1, 40), (1, 90), (1, 0), (1, 300), (1, 64)],
            vec![(5, 3), (5, 40), (5, 130), (5, 5)],
        ] {
            let vl =
                Varlen::random(&lens, 8, 1, 64, DType::F32, false, &cpu)?.to(&dev, DType::BF16)?;
            let p = params_on(&opts(Mask::Causal, Some(32), 3, 8)?, &dev)?;
            let pg = Paged::from_varlen(&vl, 16, 0, &mut rng)?;
            let (b, sq) = (lens.len(), lens[0].0);
            let q = vl.q.reshape((b, sq, 8, 64))?;
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
            let what = format!(
                "dense-q paged {} {} [{route}]",
                vl.shape_name(),
                opts_name(&p)
            );
            let (to, tl, naive) = packed_truth(&vl, &p)?;
            let (o, l) = pg.run_dense(&vl, &p)?;
            assert_close(&what, (&o, &l), (&to, &tl), &naive)?;
        }
        // A chunk that is not a multiple of the page size.
        let (vl, p) = packed_cases(&dev)?.swap_remove(0);
        let pg = Paged::from_varlen(&vl, 16, 0, &mut rng)?;
        let p = AttnParams {
            chunk: Some(24),
            ..p
        };
        let e = pg
            .run_varlen(&vl, &p)
            .expect_err("chunk 24, pages of 16")
            .to_string();
        assert!(
            names(&e, "chunk") && e.contains("page_size (16)") && e.contains("got 24"),
            "{e}"
        );
        Ok(())
    }
}
