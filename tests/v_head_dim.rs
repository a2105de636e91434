//! A separate V head dim (`d_v != d_qk`) on the CPU: q and k `(…, d_qk)`, v and the output
//! `(…, d_v)`, in every entry point (dense, `attention_slow`, packed, paged over pools of two
//! widths, decode, the LSE twins, FP8 pools, `PagedKvCache`, `merge_states`), with every option,
//! against the independent f64 model of tests/common. Pairs (64, 32), (192, 128) (DeepSeek
//! prefill), (128, 192) and (576, 512) (MLA's absorbed decode); awkward lengths (0, 1, 113), GQA,
//! shuffled page tables with NaN in unused pool rows.

mod common;

use candle_core::{DType, Device, Result, Tensor};
use common::*;
use flashcore::{
    append_kv_paged, append_kv_paged_fp8, append_kv_paged_varlen, attention, attention_paged,
    attention_slow, attention_with_lse, flash_attn, merge_states, AttnParams, KvScales, Mask,
    PagedKvCache,
};

const PAIRS: [(usize, usize); 4] = [(64, 32), (192, 128), (128, 192), (576, 512)];

/// Option set `which`: 0 plain, 1 softcap, 2 ALiBi `(hq,)`, 3 sinks, 4 chunk, 5 all of them.
fn opts(mask: Mask, which: usize, hq: usize) -> Result<AttnParams> {
    let dev = Device::Cpu;
    let mut p = AttnParams {
        mask,
        ..Default::default()
    };
    if which == 1 || which == 5 {
        p.softcap = Some(5.0);
    }
    if which == 2 || which == 5 {
        let s: Vec<f32> = (0..hq).map(|h| 0.05 + 0.1 * h as f32).collect();
        p.alibi_slopes = Some(Tensor::new(s.as_slice(), &dev)?);
    }
    if which == 3 || which == 5 {
        p.sinks = Some(test_sinks(hq, &dev)?);
    }
    if which == 4 || which == 5 {
        p.chunk = Some(33);
    }
    Ok(p)
}

const MASKS: [Mask; 3] = [
    Mask::None,
    Mask::Causal,
    Mask::Window {
        left: Some(20),
        right: Some(3),
    },
];

/// Random `(b, s, h, d)` tensors in `dtype`.
fn rand4(shape: (usize, usize, usize, usize), dtype: DType) -> Result<Tensor> {
    Tensor::randn(0f32, 1., shape, &Device::Cpu)?.to_dtype(dtype)
}

/// Dense problems: `attention_with_lse`, `attention`, `flash_attn` and `attention_slow` against
/// the f64 model for every pair, lengths 1 and 113, GQA, strided views, every option set; the
/// output is `(…, d_v)` and the default scale `1 / sqrt(d_qk)`.
#[test]
fn dense_matches_f64_model() -> Result<()> {
    let mut n = 0;
    for (pi, &(d, dv)) in PAIRS.iter().enumerate() {
        // (b, sq, sk, hq, hkv)
        for &(b, sq, sk, hq, hkv) in &[(1, 1, 1, 1, 1), (2, 113, 113, 4, 2), (1, 1, 113, 8, 1)] {
            let dtype = if n % 2 == 0 { DType::F32 } else { DType::F64 };
            let strided = n % 3 == 1;
            let q = rand4((b, sq, hq + 2, d), dtype)?.narrow(2, 1, hq)?;
            let k = rand4((b, hkv, sk, d), dtype)?.transpose(1, 2)?;
            let v = if strided {
                rand4((b, hkv, sk, dv), dtype)?.transpose(1, 2)?
            } else {
                rand4((b, sk, hkv, dv), dtype)?
            };
            for (mi, &mask) in MASKS.iter().enumerate() {
                let mut p = opts(mask, (pi + mi + n) % 6, hq)?;
                if dtype == DType::F64 {
                    // The model takes the default scale in f32, the f64 path in f64: give one.
                    p.softmax_scale = Some(0.07);
                }
                let what = format!("b{b} sq{sq} sk{sk} h{hq}/{hkv} d{d}/{dv} {}", opts_name(&p));
                let (o, lse) = attention_with_lse(&q, &k, &v, &p)?;
                assert_eq!(o.dims(), &[b, sq, hq, dv], "{what}: output shape");
                assert_eq!(lse.dims(), &[b, hq, sq], "{what}: lse shape");
                let (ro, rl) = reference_f64(&q, &k, &v, &p)?;
                let tol = if dtype == DType::F64 { 1e-11 } else { 3e-5 };
                let (eo, el) = (max_abs_diff(&o, &ro)?, lse_err(&lse, &rl)?);
                assert!(eo < tol && el < 2e-5, "{what}: O err {eo}, LSE err {el}");
                let e2 = max_abs_diff(&attention(&q, &k, &v, &p)?, &ro)?;
                assert!(e2 < tol, "{what}: attention err {e2}");
                let es = max_abs_diff(&attention_slow(&q, &k, &v, &p)?, &ro)?;
                assert!(es < tol, "{what}: attention_slow err {es}");
                if p.alibi_slopes.is_none()
                    && p.sinks.is_none()
                    && p.softcap.is_none()
                    && p.chunk.is_none()
                    && matches!(mask, Mask::None | Mask::Causal)
                {
                    let scale = p.softmax_scale.unwrap_or(1.0 / (d as f32).sqrt());
                    let f = flash_attn(&q, &k, &v, scale, mask == Mask::Causal)?;
                    let ef = max_abs_diff(&f, &ro)?;
                    assert!(ef < tol, "{what}: flash_attn err {ef}");
                }
                n += 1;
            }
        }
    }
    println!("dense_matches_f64_model: {n} cases");
    Ok(())
}

/// The default scale is `1 / sqrt(d_qk)`: the same as passing it, and not `1 / sqrt(d_v)` (nor
/// that of the padded `max(d_qk, d_v)`).
#[test]
fn default_scale_is_one_over_sqrt_d_qk() -> Result<()> {
    for (d, dv) in [(192, 128), (64, 256)] {
        let q = rand4((1, 9, 2, d), DType::F32)?;
        let k = rand4((1, 9, 2, d), DType::F32)?;
        let v = rand4((1, 9, 2, dv), DType::F32)?;
        let (o, l) = attention_with_lse(&q, &k, &v, &AttnParams::default())?;
        for (s, same) in [
            (1.0 / (d as f32).sqrt(), true),
            (1.0 / (dv as f32).sqrt(), false),
        ] {
            let p = AttnParams {
                softmax_scale: Some(s),
                ..Default::default()
            };
            let (o2, l2) = attention_with_lse(&q, &k, &v, &p)?;
            let diff = max_abs_diff(&o, &o2)? + lse_err(&l, &l2)?;
            assert_eq!(diff == 0.0, same, "d{d}/{dv} scale {s}: diff {diff}");
        }
    }
    Ok(())
}

/// Packed batches (empty sequences on either side, 1, 113) and paged caches over K and V pools
/// of two widths (shuffled pages, NaN in unused rows and far-away table entries): the varlen,
/// paged-varlen and paged (dense q, decode and prefill) calls and their LSE twins against the
/// f64 model per sequence.
#[test]
fn varlen_and_paged_match_f64_model() -> Result<()> {
    let dev = Device::Cpu;
    let mut rng = Rng::from_clock("v_head_dim varlen_and_paged");
    let lens = [(0, 5), (5, 0), (113, 113), (1, 130), (40, 17), (1, 1)];
    let mut n = 0;
    for &(d, dv) in &PAIRS {
        let (hq, hkv) = [(4, 2), (8, 1), (2, 2)][n % 3];
        let vl = Varlen::random_dv(&lens, hq, hkv, d, dv, DType::F32, n % 2 == 0, &dev)?;
        for (mi, &mask) in MASKS.iter().enumerate() {
            let p = opts(mask, (mi + n) % 6, hq)?;
            let what = format!("{} dv{dv} {}", vl.shape_name(), opts_name(&p));
            let (want_o, want_l) = model(&vl, &p)?;
            let (o, l) = vl.run(&p)?;
            assert_eq!(o.dims(), &[vl.total_q(), hq, dv], "{what}: varlen shape");
            let (eo, el) = (max_abs_diff(&o, &want_o)?, lse_err(&l, &want_l)?);
            assert!(eo < 3e-5 && el < 2e-5, "varlen {what}: O {eo}, LSE {el}");
            let eo = max_abs_diff(&vl.run_o(&p)?, &want_o)?;
            assert!(eo < 3e-5, "varlen O-only {what}: {eo}");
            let pg = Paged::from_varlen(&vl, [16, 5, 64][mi], 0, &mut rng)?;
            assert_eq!(pg.k_pages.dim(3)?, d);
            assert_eq!(pg.v_pages.dim(3)?, dv);
            let (po, pl) = pg.run_varlen(&vl, &p)?;
            let (eo, el) = (max_abs_diff(&po, &want_o)?, lse_err(&pl, &want_l)?);
            assert!(
                eo < 3e-5 && el < 2e-5,
                "paged varlen {what}: O {eo}, LSE {el}"
            );
            let eo = max_abs_diff(&pg.run_varlen_o(&vl, &p)?, &want_o)?;
            assert!(eo < 3e-5, "paged varlen O-only {what}: {eo}");
            n += 1;
        }
        // Dense q over pages: decode (one row per sequence) and a few rows per sequence.
        for lens in [
            vec![(1, 0), (1, 37), (1, 200), (1, 64)],
            vec![(5, 3), (5, 113), (5, 5)],
        ] {
            let vl = Varlen::random_dv(&lens, hq, hkv, d, dv, DType::F32, false, &dev)?;
            for (mi, &mask) in MASKS.iter().enumerate() {
                let p = opts(mask, (mi + n) % 6, hq)?;
                let what = format!("dense-q paged {} dv{dv} {}", vl.shape_name(), opts_name(&p));
                let (want_o, want_l) = model(&vl, &p)?;
                let pg = Paged::from_varlen(&vl, 8, 0, &mut rng)?;
                let (o, l) = pg.run_dense(&vl, &p)?;
                let (eo, el) = (max_abs_diff(&o, &want_o)?, lse_err(&l, &want_l)?);
                assert!(eo < 3e-5 && el < 2e-5, "{what}: O {eo}, LSE {el}");
                let b = lens.len();
                let sq = lens[0].0;
                let o2 = attention_paged(
                    &vl.q.reshape((b, sq, hq, d))?,
                    &pg.k_pages,
                    &pg.v_pages,
                    &pg.page_table,
                    &pg.seqlens_k,
                    &p,
                )?;
                let eo = max_abs_diff(&o2.reshape((b * sq, hq, dv))?, &want_o)?;
                assert!(eo < 3e-5, "{what}: attention_paged O-only {eo}");
                n += 1;
            }
        }
    }
    println!("varlen_and_paged_match_f64_model: {n} cases");
    Ok(())
}

/// The f64 model of a packed batch, per sequence.
fn model(vl: &Varlen, p: &AttnParams) -> Result<(Tensor, Tensor)> {
    let (o, l) = varlen_by_sequence(vl, p, false, |q, k, v, p| {
        let (o, l) = reference_f64(q, k, v, p)?;
        Ok((o.to_dtype(vl.q.dtype())?, Some(l.to_dtype(DType::F32)?)))
    })?;
    Ok((o, l.expect("the model gives LSEs")))
}

/// A `PagedKvCache` with K and V of two widths, filled by appends (dense and packed), read by
/// decode and prefill against the f64 model of the rows appended; and FP8 pools of two widths
/// (`append_kv_paged_fp8`, `kv_scales`) against the model of the dequantized rows.
#[test]
fn cache_appends_and_fp8_pools() -> Result<()> {
    let dev = Device::Cpu;
    for &(d, dv) in &PAIRS {
        let (hq, hkv, ps) = (8, 2, 16);
        let mut cache = PagedKvCache::with_head_dims(32, ps, hkv, d, dv, DType::F32, &dev)?;
        assert_eq!(cache.k_pages().dims(), &[32, ps, hkv, d]);
        assert_eq!(cache.v_pages().dims(), &[32, ps, hkv, dv]);
        let (a, b) = (cache.add_sequence(), cache.add_sequence());
        let k1 = rand4((2, 37, hkv, d), DType::F32)?;
        let v1 = rand4((2, 37, hkv, dv), DType::F32)?;
        cache.append(&[a, b], &k1, &v1)?;
        let k2 = rand4((1, 1, hkv, d), DType::F32)?;
        let v2 = rand4((1, 1, hkv, dv), DType::F32)?;
        cache.append(&[b], &k2, &v2)?;
        // K and V given at each other's widths: refused, naming the argument, nothing taken.
        let free = cache.free_pages();
        if d != dv {
            let e = cache.append(&[a], &v2, &k2).unwrap_err().to_string();
            assert!(names(&e, "k_new") || names(&e, "v_new"), "{e}");
            assert_eq!(cache.free_pages(), free);
        }
        let (table, lens) = cache.tables(&[a, b])?;
        let ka = k1.narrow(0, 0, 1)?;
        let va = v1.narrow(0, 0, 1)?;
        let kb = Tensor::cat(&[&k1.narrow(0, 1, 1)?, &k2], 1)?;
        let vb = Tensor::cat(&[&v1.narrow(0, 1, 1)?, &v2], 1)?;
        for sq in [1usize, 5] {
            let q = rand4((2, sq, hq, d), DType::F32)?;
            let p = AttnParams {
                mask: Mask::Causal,
                sinks: Some(test_sinks(hq, &dev)?),
                ..Default::default()
            };
            let o = attention_paged(&q, cache.k_pages(), cache.v_pages(), &table, &lens, &p)?;
            assert_eq!(o.dims(), &[2, sq, hq, dv]);
            let (ra, _) = reference_f64(&q.narrow(0, 0, 1)?, &ka, &va, &p)?;
            let (rb, _) = reference_f64(&q.narrow(0, 1, 1)?, &kb, &vb, &p)?;
            let e = max_abs_diff(&o, &Tensor::cat(&[&ra, &rb], 0)?)?;
            assert!(e < 3e-5, "cache d{d}/{dv} sq{sq}: err {e}");
        }

        // FP8 pools of two widths, appended to dense then packed.
        let kp = Tensor::zeros((8, ps, hkv, d), DType::F8E4M3, &dev)?;
        let vp = Tensor::zeros((8, ps, hkv, dv), DType::F8E4M3, &dev)?;
        let scales = KvScales {
            k: Tensor::new(&[0.02f32, 0.05], &dev)?,
            v: Tensor::new(&[0.03f32], &dev)?,
        };
        let table = Tensor::new(&[[5u32, 2, 7], [1, 6, 0]], &dev)?;
        let kn = rand4((2, 20, hkv, d), DType::F32)?;
        let vn = rand4((2, 20, hkv, dv), DType::F32)?;
        let pos = Tensor::new(&[0u32, 0], &dev)?;
        append_kv_paged_fp8(&kn, &vn, &kp, &vp, &table, &pos, &scales)?;
        let lens = Tensor::new(&[20u32, 20], &dev)?;
        let q = rand4((2, 3, hq, d), DType::F32)?;
        let p = AttnParams {
            mask: Mask::Causal,
            kv_scales: Some(scales.clone()),
            ..Default::default()
        };
        let o = attention_paged(&q, &kp, &vp, &table, &lens, &p)?;
        assert_eq!(o.dims(), &[2, 3, hq, dv]);
        // The model reads the stored e4m3 values back through the same scales.
        let deq = |x: &Tensor, s: &Tensor| -> Result<Tensor> {
            let n = s.dim(0)?;
            x.to_dtype(DType::F8E4M3)?
                .to_dtype(DType::F32)?
                .broadcast_mul(&s.reshape((n, 1))?)
        };
        let quant = |x: &Tensor, s: &Tensor| -> Result<Tensor> {
            let n = s.dim(0)?;
            deq(&x.broadcast_div(&s.reshape((n, 1))?)?, s)
        };
        let p_model = AttnParams {
            kv_scales: None,
            ..p.clone()
        };
        let mut want = Vec::new();
        for i in 0..2 {
            let (r, _) = reference_f64(
                &q.narrow(0, i, 1)?,
                &quant(&kn.narrow(0, i, 1)?, &scales.k)?,
                &quant(&vn.narrow(0, i, 1)?, &scales.v)?,
                &p_model,
            )?;
            want.push(r);
        }
        let e = max_abs_diff(&o, &Tensor::cat(&want, 0)?)?;
        assert!(e < 3e-5, "fp8 pools d{d}/{dv}: err {e}");
    }
    Ok(())
}

/// Packed appends into pools of two widths write each pool at its own width (and nothing else).
#[test]
fn packed_append_writes_each_pool_at_its_width() -> Result<()> {
    let dev = Device::Cpu;
    let (d, dv, hkv, ps) = (192, 128, 2, 4);
    let kp = Tensor::zeros((6, ps, hkv, d), DType::F32, &dev)?;
    let vp = Tensor::zeros((6, ps, hkv, dv), DType::F32, &dev)?;
    let kn = rand4((1, 7, hkv, d), DType::F32)?.squeeze(0)?;
    let vn = rand4((1, 7, hkv, dv), DType::F32)?.squeeze(0)?;
    let table = Tensor::new(&[[3u32, 0], [5, 1]], &dev)?;
    let cu = Tensor::new(&[0u32, 3, 7], &dev)?;
    let pos = Tensor::new(&[1u32, 0], &dev)?;
    append_kv_paged_varlen(&kn, &vn, &kp, &vp, &table, &cu, &pos)?;
    // Sequence 0's rows 0..3 at positions 1..4 (page 3, rows 1..4); sequence 1's rows 3..7 at
    // positions 0..4 (page 5, rows 0..4).
    let slots = [(3, 1), (3, 2), (3, 3), (5, 0), (5, 1), (5, 2), (5, 3)];
    for (r, &(page, row)) in slots.iter().enumerate() {
        let got_k = kp.get(page)?.get(row)?;
        let got_v = vp.get(page)?.get(row)?;
        assert_eq!(max_abs_diff(&got_k, &kn.get(r)?)?, 0.0, "k row {r}");
        assert_eq!(max_abs_diff(&got_v, &vn.get(r)?)?, 0.0, "v row {r}");
    }
    // Every other row stays zero.
    let written: f64 = kp.abs()?.sum_all()?.to_scalar::<f32>()? as f64;
    let want: f64 = kn.abs()?.sum_all()?.to_scalar::<f32>()? as f64;
    assert!(
        (written - want).abs() < 1e-3 * want,
        "k pool: {written} vs {want}"
    );
    let written: f64 = vp.abs()?.sum_all()?.to_scalar::<f32>()? as f64;
    let want: f64 = vn.abs()?.sum_all()?.to_scalar::<f32>()? as f64;
    assert!(
        (written - want).abs() < 1e-3 * want,
        "v pool: {written} vs {want}"
    );
    Ok(())
}

/// Cascade attention at `d_v != d_qk`: a shared prefix and each sequence's own keys, merged
/// with `merge_states`, equal one call over all keys.
#[test]
fn merge_states_at_d_v() -> Result<()> {
    let (d, dv, hq, hkv) = (192, 128, 4, 2);
    let q = rand4((1, 7, hq, d), DType::F32)?;
    let k = rand4((1, 50, hkv, d), DType::F32)?;
    let v = rand4((1, 50, hkv, dv), DType::F32)?;
    let p = AttnParams::default();
    let (oa, la) = attention_with_lse(&q, &k.narrow(1, 0, 30)?, &v.narrow(1, 0, 30)?, &p)?;
    let (ob, lb) = attention_with_lse(&q, &k.narrow(1, 30, 20)?, &v.narrow(1, 30, 20)?, &p)?;
    let (o, l) = merge_states(&oa, &la, &ob, &lb)?;
    assert_eq!(o.dims(), &[1, 7, hq, dv]);
    let (ro, rl) = reference_f64(&q, &k, &v, &p)?;
    let (eo, el) = (max_abs_diff(&o, &ro)?, lse_err(&l, &rl)?);
    assert!(eo < 3e-5 && el < 2e-5, "merged: O {eo}, LSE {el}");
    Ok(())
}

/// Bad head dims are errors naming the argument, the rule and the value.
#[test]
fn head_dim_errors_name_the_argument() -> Result<()> {
    let dev = Device::Cpu;
    let z = |s: &[usize]| Tensor::zeros(s, DType::F32, &dev);
    let p = AttnParams::default();
    let err = |r: Result<Tensor>| r.expect_err("must be rejected").to_string();
    let q = z(&[1, 4, 4, 192])?;
    let k = z(&[1, 6, 2, 192])?;
    for (got, want) in [
        (
            err(attention(&q, &k, &z(&[1, 6, 2, 100])?, &p)),
            "flashcore: v: head_dim must be a multiple of 8 in 8..=512, got 100",
        ),
        (
            err(attention(&q, &k, &z(&[1, 6, 2, 520])?, &p)),
            "flashcore: v: head_dim must be a multiple of 8 in 8..=512, got 520",
        ),
        (
            err(attention(
                &q,
                &z(&[1, 6, 2, 128])?,
                &z(&[1, 6, 2, 128])?,
                &p,
            )),
            "flashcore: k: head_dim must equal q's head_dim 192, got 128",
        ),
        (
            err(attention(&q, &k, &z(&[1, 6, 1, 128])?, &p)),
            "flashcore: v: shape must equal k's [1, 6, 2, 192] but for the last dim",
        ),
    ] {
        assert!(got.contains(want), "{got}\nshould contain\n{want}");
    }
    // Paged: pools of two widths must agree but for the head dim; appends name the row tensor.
    let table = Tensor::new(&[[0u32]], &dev)?;
    let lens = Tensor::new(&[3u32], &dev)?;
    let kp = z(&[2, 4, 2, 192])?;
    let e = err(attention_paged(
        &q,
        &kp,
        &z(&[2, 4, 1, 128])?,
        &table,
        &lens,
        &p,
    ));
    assert!(
        e.contains("flashcore: v: shape must equal k's [2, 4, 2, 192]"),
        "{e}"
    );
    let e = err(attention_paged(
        &q,
        &kp,
        &z(&[2, 4, 2, 12])?,
        &table,
        &lens,
        &p,
    ));
    assert!(
        e.contains("flashcore: v: head_dim must be a multiple of 8"),
        "{e}"
    );
    let vp = z(&[2, 4, 2, 128])?;
    let pos = Tensor::new(&[0u32], &dev)?;
    let e = append_kv_paged(
        &z(&[1, 2, 2, 192])?,
        &z(&[1, 2, 2, 192])?,
        &kp,
        &vp,
        &table,
        &pos,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("flashcore: v_new: its last two dims must be v_pages' (heads_kv, head_dim) = (2, 128), got [1, 2, 2, 192]"),
        "{e}"
    );
    let e = append_kv_paged(
        &z(&[1, 2, 2, 192])?,
        &z(&[1, 3, 2, 128])?,
        &kp,
        &vp,
        &table,
        &pos,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("flashcore: v_new: shape must equal k_new's"),
        "{e}"
    );
    let e = append_kv_paged(
        &z(&[1, 2, 2, 192])?,
        &z(&[1, 2, 2, 128])?,
        &kp,
        &z(&[3, 4, 2, 128])?,
        &table,
        &pos,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("flashcore: v_pages: shape must equal k_pages'"),
        "{e}"
    );
    // Both widths fine: accepted.
    append_kv_paged(
        &z(&[1, 2, 2, 192])?,
        &z(&[1, 2, 2, 128])?,
        &kp,
        &vp,
        &table,
        &pos,
    )?;
    Ok(())
}
