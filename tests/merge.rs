//! `merge_states`: attention over a shared prefix and over each sequence's own keys, merged from
//! their LSEs, equals one call over all keys (cascade attention); input checks.

use candle_core::{DType, Device, Result, Tensor};
use flashcore::{attention_varlen_with_lse, attention_with_lse, merge_states, AttnParams, Mask};

fn max_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    let d = (a.to_dtype(DType::F32)? - b.to_dtype(DType::F32)?)?.abs()?;
    d.flatten_all()?.max(0)?.to_scalar::<f32>()
}

/// Cascade: keys [0, prefix) without a mask, keys [prefix, sk) with the causal mask (bottom-right,
/// so the suffix's last key lines up with the last query), merged = causal over all keys.
fn cascade(
    dtype: DType,
    b: usize,
    sq: usize,
    prefix: usize,
    own: usize,
    hq: usize,
    hkv: usize,
) -> Result<()> {
    let dev = Device::Cpu;
    let d = 64;
    let sk = prefix + own;
    let q = Tensor::randn(0f32, 1., (b, sq, hq, d), &dev)?.to_dtype(dtype)?;
    let k = Tensor::randn(0f32, 1., (b, sk, hkv, d), &dev)?.to_dtype(dtype)?;
    let v = Tensor::randn(0f32, 1., (b, sk, hkv, d), &dev)?.to_dtype(dtype)?;
    let causal = AttnParams {
        mask: Mask::Causal,
        ..Default::default()
    };
    let none = AttnParams::default();
    let (o_all, lse_all) = attention_with_lse(&q, &k, &v, &causal)?;
    let (o_p, lse_p) = attention_with_lse(
        &q,
        &k.narrow(1, 0, prefix)?,
        &v.narrow(1, 0, prefix)?,
        &none,
    )?;
    let (o_s, lse_s) = attention_with_lse(
        &q,
        &k.narrow(1, prefix, own)?,
        &v.narrow(1, prefix, own)?,
        &causal,
    )?;
    let (o, lse) = merge_states(&o_p, &lse_p, &o_s, &lse_s)?;
    assert_eq!(o.dims(), o_all.dims());
    assert_eq!(o.dtype(), dtype);
    assert_eq!(lse.dims(), lse_all.dims());
    let tol = match dtype {
        DType::F32 => 1e-5,
        DType::F64 => 1e-5,
        _ => 2e-2,
    };
    let (eo, el) = (max_diff(&o, &o_all)?, max_diff(&lse, &lse_all)?);
    assert!(
        eo <= tol,
        "{dtype:?} b{b} sq{sq} {prefix}+{own}: o differs by {eo}"
    );
    assert!(
        el <= 1e-4,
        "{dtype:?} b{b} sq{sq} {prefix}+{own}: lse differs by {el}"
    );
    Ok(())
}

#[test]
fn cascade_equals_one_call() -> Result<()> {
    cascade(DType::F32, 2, 7, 33, 9, 4, 2)?;
    cascade(DType::F32, 1, 1, 100, 1, 8, 1)?; // decode
    cascade(DType::F64, 1, 5, 16, 5, 2, 2)?;
    cascade(DType::BF16, 2, 13, 64, 20, 4, 4)?;
    cascade(DType::F32, 1, 4, 8, 4, 2, 1)?; // as many queries as own keys
    Ok(())
}

#[test]
fn an_empty_part_changes_nothing() -> Result<()> {
    // A part over no keys (zeros, LSE -inf) merged with a real one gives the real one back.
    let dev = Device::Cpu;
    let q = Tensor::randn(0f32, 1., (2, 5, 4, 16), &dev)?;
    let k = Tensor::randn(0f32, 1., (2, 9, 2, 16), &dev)?;
    let v = Tensor::randn(0f32, 1., (2, 9, 2, 16), &dev)?;
    let p = AttnParams {
        mask: Mask::Causal,
        ..Default::default()
    };
    let (o, lse) = attention_with_lse(&q, &k, &v, &p)?;
    // What attention returns for rows that see no key: zeros and LSE -inf.
    let o0 = o.zeros_like()?;
    let lse0 = lse.ones_like()?.affine(0., f64::NEG_INFINITY)?;
    for (m, ml) in [
        merge_states(&o, &lse, &o0, &lse0)?,
        merge_states(&o0, &lse0, &o, &lse)?,
    ] {
        assert!(max_diff(&m, &o)? <= 1e-6);
        assert!(max_diff(&ml, &lse)? <= 1e-6);
    }
    Ok(())
}

#[test]
fn rows_without_keys_stay_zero() -> Result<()> {
    // Both parts empty for every row: zeros and LSE -inf, never NaN.
    // A causal problem with more queries than keys: rows 0..2 see no key (zeros, LSE -inf).
    let dev = Device::Cpu;
    let q = Tensor::randn(0f32, 1., (1, 3, 2, 8), &dev)?;
    let k = Tensor::randn(0f32, 1., (1, 1, 2, 8), &dev)?;
    let p = AttnParams {
        mask: Mask::Causal,
        ..Default::default()
    };
    let (o, lse) = attention_with_lse(&q, &k, &k, &p)?;
    let (o, lse) = (o.narrow(1, 0, 2)?, lse.narrow(2, 0, 2)?);
    let (m, ml) = merge_states(&o, &lse, &o, &lse)?;
    assert_eq!(m.abs()?.sum_all()?.to_scalar::<f32>()?, 0.0);
    let ml: Vec<f32> = ml.flatten_all()?.to_vec1()?;
    assert!(ml.iter().all(|x| *x == f32::NEG_INFINITY), "{ml:?}");
    Ok(())
}

#[test]
fn packed_layout() -> Result<()> {
    // Two sequences packed: the prefix and suffix parts as varlen calls, merged, against one
    // varlen call over all keys.
    let dev = Device::Cpu;
    let (hq, hkv, d) = (4, 2, 32);
    let (lq, lp, ls) = ([3u32, 5], [10u32, 6], [4u32, 7]);
    let cum = |l: &[u32]| -> Vec<u32> {
        let mut c = vec![0];
        for x in l {
            c.push(c.last().unwrap() + x);
        }
        c
    };
    let tq = (lq[0] + lq[1]) as usize;
    let q = Tensor::randn(0f32, 1., (tq, hq, d), &dev)?;
    let mk = |n: usize| Tensor::randn(0f32, 1., (n, hkv, d), &dev);
    let (kp, vp) = (mk((lp[0] + lp[1]) as usize)?, mk((lp[0] + lp[1]) as usize)?);
    let (ks, vs) = (mk((ls[0] + ls[1]) as usize)?, mk((ls[0] + ls[1]) as usize)?);
    // All keys per sequence: its prefix rows then its own rows.
    let mut ka = Vec::new();
    let mut va = Vec::new();
    let (cp, cs) = (cum(&lp), cum(&ls));
    for i in 0..2 {
        ka.push(kp.narrow(0, cp[i] as usize, lp[i] as usize)?);
        ka.push(ks.narrow(0, cs[i] as usize, ls[i] as usize)?);
        va.push(vp.narrow(0, cp[i] as usize, lp[i] as usize)?);
        va.push(vs.narrow(0, cs[i] as usize, ls[i] as usize)?);
    }
    let (ka, va) = (Tensor::cat(&ka, 0)?, Tensor::cat(&va, 0)?);
    let la: Vec<u32> = (0..2).map(|i| lp[i] + ls[i]).collect();
    let t = |v: Vec<u32>| Tensor::new(v, &dev);
    let (cuq, cup, cus, cua) = (t(cum(&lq))?, t(cp.clone())?, t(cs.clone())?, t(cum(&la))?);
    let causal = AttnParams {
        mask: Mask::Causal,
        ..Default::default()
    };
    let none = AttnParams::default();
    let (o_all, l_all) = attention_varlen_with_lse(&q, &ka, &va, &cuq, &cua, 5, 16, &causal)?;
    let (o_p, l_p) = attention_varlen_with_lse(&q, &kp, &vp, &cuq, &cup, 5, 10, &none)?;
    let (o_s, l_s) = attention_varlen_with_lse(&q, &ks, &vs, &cuq, &cus, 5, 7, &causal)?;
    let (o, l) = merge_states(&o_p, &l_p, &o_s, &l_s)?;
    assert!(max_diff(&o, &o_all)? <= 1e-5);
    assert!(max_diff(&l, &l_all)? <= 1e-4);
    Ok(())
}

#[test]
fn bad_inputs_name_the_argument() -> Result<()> {
    let dev = Device::Cpu;
    let o = Tensor::zeros((1, 3, 2, 8), DType::F32, &dev)?;
    let lse = Tensor::zeros((1, 2, 3), DType::F32, &dev)?;
    let msg = |r: Result<(Tensor, Tensor)>| r.err().map(|e| e.to_string()).unwrap_or_default();
    let e = msg(merge_states(&o, &lse, &o.narrow(1, 0, 2)?, &lse));
    assert!(e.contains("o_a") && e.contains("o_b"), "{e}");
    let e = msg(merge_states(&o, &lse.to_dtype(DType::F16)?, &o, &lse));
    assert!(e.contains("lse_a must be f32"), "{e}");
    let e = msg(merge_states(&o, &lse, &o, &lse.narrow(2, 0, 2)?));
    assert!(e.contains("lse_b"), "{e}");
    let e = msg(merge_states(&o, &lse, &o.to_dtype(DType::BF16)?, &lse));
    assert!(e.contains("same dtype"), "{e}");
    Ok(())
}
