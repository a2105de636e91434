//! FP8 (e4m3) keys and values: the storage form of a serving engine's KV cache, half the bytes
//! of bf16 per cached row.
//!
//! A K/V tensor or pool in `F8E4M3` holds `x / scale` rounded to e4m3 after saturating to the
//! format's largest finite value (±448); it is read as `stored * scale`, with one f32 scale per
//! K/V head or one for all heads ([`KvScales`]). The CPU path dequantizes to f32 and runs the
//! f32 path (exact: an e4m3 value times an f32 scale is one f32 rounding), casting the output to
//! q's dtype. On a GPU the split-KV decode kernels read FP8 K/V as they are (seq_q up to
//! [`KERNEL_MAX_SQ`], bf16 / f16 q, head dims that are multiples of 16: [`in_kernel`]); every
//! other GPU call takes the slow path: the K/V it reads (for a paged cache, the sequences'
//! pages) dequantized into a temporary copy in q's dtype, then the kernels of that dtype
//! (docs/decisions.md#fp8-keys-and-values-in-the-decode-kernel).

use candle_core::{DType, Result, Tensor};

use crate::params::{AttnParams, KvScales};

/// Longest seq_q (rows per sequence) the FP8 decode kernels take: the split-KV decode's
/// (`DECODE_MAX_SQ`, kernels/variants.rs).
pub(crate) const KERNEL_MAX_SQ: usize = 16;

/// Whether a GPU kernel reads this call's F8E4M3 K/V as they are: q (f16 / bf16) on a CUDA
/// device, at most [`KERNEL_MAX_SQ`] query rows per sequence, one head dim `d` for q, k and v
/// (`dv`: v's) that is a multiple of 16 up to 256 (the kernels copy 16-byte chunks of 16 e4m3
/// values). Otherwise the K/V are widened first ([`widened`], or the paged slow path in op.rs)
/// and the 16-bit kernels take the head dims as they are.
pub(crate) fn in_kernel(q: &Tensor, max_sq: usize, d: usize, dv: usize) -> bool {
    cfg!(feature = "cuda")
        && q.device().is_cuda()
        && matches!(q.dtype(), DType::BF16 | DType::F16)
        && max_sq <= KERNEL_MAX_SQ
        && d == dv
        && d.is_multiple_of(16)
        && d <= 256
}

/// The largest finite e4m3 value.
pub const E4M3_MAX: f32 = 448.0;

fn bad(arg: &str, rule: &str, got: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(format!("flashcore: {arg}: {rule}, got {got}"))
}

/// Checks one scale tensor for K/V of `hkv` heads: f32, `(hkv,)` or `(1,)`, contiguous, on the
/// K/V device.
fn check_scale(name: &str, s: &Tensor, hkv: usize, kv: &Tensor) -> Result<()> {
    if s.dtype() != DType::F32 {
        return Err(bad(name, "dtype must be f32", format!("{:?}", s.dtype())));
    }
    if s.dims() != [hkv] && s.dims() != [1] {
        return Err(bad(
            name,
            &format!("shape must be (heads_kv,) = ({hkv},) or (1,)"),
            format!("{:?}", s.dims()),
        ));
    }
    if !s.device().same_device(kv.device()) {
        return Err(bad(
            name,
            "must be on the device of k/v",
            format!("{:?}", s.device().location()),
        ));
    }
    if !s.is_contiguous() {
        return Err(bad(name, "must be contiguous", format!("{:?}", s.stride())));
    }
    Ok(())
}

/// `x` `(..., hkv, d)` in F8E4M3 read as `stored * scale[head]` (in f32), rounded to `dtype`.
/// On a GPU flashcore's own kernel does it (`cuda::fp8`): bf16, f16 or f32.
pub(crate) fn dequantize(x: &Tensor, scale: &Tensor, dtype: DType) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        return crate::cuda::fp8::widen(x, scale, dtype);
    }
    let n = scale.dim(0)?;
    x.to_dtype(DType::F32)?
        .broadcast_mul(&scale.reshape((n, 1))?)?
        .to_dtype(dtype)
}

/// `x` `(..., hkv, d)` (f16, bf16, f32 or f64) stored as F8E4M3: `x / scale[head]`, saturated to
/// ±448, rounded to e4m3. NaN stays NaN (e4m3 has no infinity: ±inf saturate to ±448). On a
/// GPU flashcore's own kernel does it (`cuda::fp8`; bf16, f16 or f32 `x`).
pub(crate) fn quantize(x: &Tensor, scale: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        return crate::cuda::fp8::quantize(x, scale);
    }
    let n = scale.dim(0)?;
    let x = x.to_dtype(DType::F32)?;
    let y = x.broadcast_div(&scale.reshape((n, 1))?)?;
    let y = y.clamp(-E4M3_MAX, E4M3_MAX)?;
    // `clamp` maps NaN through min/max, which may turn it into a bound: keep NaN as NaN.
    let nan = x.ne(&x)?;
    let y = nan.where_cond(&x, &y)?;
    y.to_dtype(DType::F8E4M3)
}

/// [`quantize_e4m3`]'s checks, then [`quantize`].
pub(crate) fn quantize_public(x: &Tensor, scale: &Tensor) -> Result<Tensor> {
    if x.rank() < 2 {
        return Err(bad(
            "x",
            "must be (..., heads, head_dim)",
            format!("{:?}", x.dims()),
        ));
    }
    if x.dtype() == DType::F8E4M3 {
        return Err(bad("x", "is already F8E4M3", "F8E4M3"));
    }
    check_scale("scale", scale, x.dim(x.rank() - 2)?, x)?;
    quantize(x, scale)
}

/// [`dequantize_e4m3`]'s checks, then [`dequantize`].
pub(crate) fn dequantize_public(x: &Tensor, scale: &Tensor, dtype: DType) -> Result<Tensor> {
    if x.rank() < 2 {
        return Err(bad(
            "x",
            "must be (..., heads, head_dim)",
            format!("{:?}", x.dims()),
        ));
    }
    if x.dtype() != DType::F8E4M3 {
        return Err(bad("x", "dtype must be F8E4M3", format!("{:?}", x.dtype())));
    }
    if !dtype.is_float() || dtype == DType::F8E4M3 {
        return Err(bad(
            "dtype",
            "must be a wider float type",
            format!("{dtype:?}"),
        ));
    }
    check_scale("scale", scale, x.dim(x.rank() - 2)?, x)?;
    dequantize(x, scale, dtype)
}

/// The K/V form a call reads, after checking that `k`, `v` and `params.kv_scales` agree:
/// `None` for plain K/V, `Some(scales)` for F8E4M3 K/V.
pub(crate) fn kv_form<'a>(
    k: &Tensor,
    v: &Tensor,
    params: &'a AttnParams,
) -> Result<Option<&'a KvScales>> {
    // K/V heads are the second-to-last dimension in every layout (dense, packed, paged).
    let hkv = k.dims().iter().rev().nth(1).copied().unwrap_or(0);
    let fp8 = |t: &Tensor| t.dtype() == DType::F8E4M3;
    match (&params.kv_scales, fp8(k), fp8(v)) {
        (None, false, false) => Ok(None),
        (None, _, _) => Err(bad(
            "kv_scales",
            "F8E4M3 k/v need their scales (AttnParams::kv_scales)",
            format!("k {:?}, v {:?}", k.dtype(), v.dtype()),
        )),
        (Some(_), false, false) => Err(bad(
            "kv_scales",
            "apply to F8E4M3 k and v only",
            format!("k {:?}, v {:?}", k.dtype(), v.dtype()),
        )),
        (Some(_), true, false) | (Some(_), false, true) => Err(bad(
            "v",
            "dtype must match k's (both F8E4M3 with kv_scales)",
            format!("k {:?}, v {:?}", k.dtype(), v.dtype()),
        )),
        (Some(s), true, true) => {
            check_scale("kv_scales.k", &s.k, hkv, k)?;
            check_scale("kv_scales.v", &s.v, hkv, v)?;
            Ok(Some(s))
        }
    }
}

/// The scales an append into `k_pages` / `v_pages` quantizes with: `None` for plain pools,
/// `Some` for F8E4M3 pools, after checking that pools and scales agree.
pub(crate) fn append_form<'a>(
    k_new: &Tensor,
    k_pages: &Tensor,
    v_pages: &Tensor,
    scales: Option<&'a KvScales>,
) -> Result<Option<&'a KvScales>> {
    let fp8 = |t: &Tensor| t.dtype() == DType::F8E4M3;
    let hkv = k_pages.dims().iter().rev().nth(1).copied().unwrap_or(0);
    match (scales, fp8(k_pages), fp8(v_pages)) {
        (None, false, false) => Ok(None),
        (None, _, _) => Err(bad(
            "k_pages",
            "F8E4M3 pools are appended to with their scales (append_kv_paged_fp8)",
            format!(
                "k_pages {:?}, v_pages {:?}",
                k_pages.dtype(),
                v_pages.dtype()
            ),
        )),
        (Some(_), false, false) => Err(bad(
            "scales",
            "apply to F8E4M3 pools only",
            format!("k_pages {:?}", k_pages.dtype()),
        )),
        (Some(_), _, _) if fp8(k_pages) != fp8(v_pages) => Err(bad(
            "v_pages",
            "dtype must match k_pages's",
            format!(
                "k_pages {:?}, v_pages {:?}",
                k_pages.dtype(),
                v_pages.dtype()
            ),
        )),
        (Some(s), _, _) => {
            if fp8(k_new) {
                return Err(bad(
                    "k_new",
                    "rows appended to F8E4M3 pools are given unquantized (f16, bf16, f32, f64)",
                    format!("{:?}", k_new.dtype()),
                ));
            }
            check_scale("scales.k", &s.k, hkv, k_pages)?;
            check_scale("scales.v", &s.v, hkv, v_pages)?;
            Ok(Some(s))
        }
    }
}

/// The widened problem an F8E4M3 call stands for: on the CPU q and the dequantized K/V in f32
/// (f64 for an f64 q); on a GPU (the slow path) q as it is and the K/V dequantized in f32 and
/// rounded to q's dtype (one rounding, as bf16 K/V have). The options without `kv_scales`. The
/// output is then cast back to q's dtype ([`restore`]).
pub(crate) fn widened(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scales: &KvScales,
    params: &AttnParams,
) -> Result<(Tensor, Tensor, Tensor, AttnParams)> {
    let p = AttnParams {
        kv_scales: None,
        ..params.clone()
    };
    let wide = match q.dtype() {
        _ if !q.device().is_cpu() => q.dtype(),
        DType::F64 => DType::F64,
        _ => DType::F32,
    };
    Ok((
        q.to_dtype(wide)?,
        dequantize(k, &scales.k, wide)?,
        dequantize(v, &scales.v, wide)?,
        p,
    ))
}

/// The FP8 forward's queries (F8E4M3 q with `AttnParams::q_scale`): q dequantized to f32 and
/// the options without `q_scale`, or `None` for a 16-bit / f32 / f64 q. Checks the contract: the
/// scale f32 `(heads_q,)` or `(1,)` on q's device, k and v F8E4M3 with `kv_scales`; on a GPU an
/// error naming the option (no kernel yet).
pub(crate) fn fp8_queries(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    params: &AttnParams,
) -> Result<Option<(Tensor, AttnParams)>> {
    let fp8 = q.dtype() == DType::F8E4M3;
    let scale = match (&params.q_scale, fp8) {
        (None, false) => return Ok(None),
        (None, true) => {
            return Err(bad(
                "q_scale",
                "F8E4M3 q needs its scale (AttnParams::q_scale)",
                "none",
            ))
        }
        (Some(_), false) => {
            return Err(bad(
                "q_scale",
                "applies to F8E4M3 q only",
                format!("q {:?}", q.dtype()),
            ))
        }
        (Some(s), true) => s,
    };
    if !q.device().is_cpu() {
        return Err(bad(
            "q_scale",
            "F8E4M3 queries (the FP8 forward) have no GPU kernel yet; dequantize q first (dequantize_e4m3) or run on the CPU",
            format!("q on {:?}", q.device().location()),
        ));
    }
    let hq = q.dims().iter().rev().nth(1).copied().unwrap_or(0);
    if scale.dtype() != DType::F32 {
        return Err(bad(
            "q_scale",
            "dtype must be f32",
            format!("{:?}", scale.dtype()),
        ));
    }
    if scale.dims() != [hq] && scale.dims() != [1] {
        return Err(bad(
            "q_scale",
            &format!("shape must be (heads_q,) = ({hq},) or (1,)"),
            format!("{:?}", scale.dims()),
        ));
    }
    if !scale.device().same_device(q.device()) {
        return Err(bad(
            "q_scale",
            "must be on the device of q",
            format!("{:?}", scale.device().location()),
        ));
    }
    for (name, t) in [("k", k), ("v", v)] {
        if t.dtype() != DType::F8E4M3 || params.kv_scales.is_none() {
            return Err(bad(
                name,
                "the FP8 forward (F8E4M3 q) takes F8E4M3 k and v with kv_scales",
                format!("{:?}, kv_scales {}", t.dtype(), params.kv_scales.is_some()),
            ));
        }
    }
    let p = AttnParams {
        q_scale: None,
        ..params.clone()
    };
    Ok(Some((dequantize(q, scale, DType::F32)?, p)))
}

/// The output of the f32 problem cast to q's dtype (the LSE stays f32).
pub(crate) fn restore(
    (o, lse): (Tensor, Option<Tensor>),
    dtype: DType,
) -> Result<(Tensor, Option<Tensor>)> {
    Ok((o.to_dtype(dtype)?, lse))
}
