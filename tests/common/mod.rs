//! Helpers shared by the CPU and GPU test binaries.
#![allow(dead_code)]

use candle_core::{DType, Device, Result, Tensor, D};
use flashcore::{AttnParams, Mask};

/// Fresh random q, k, v of the given shape (normal, std 1), optionally as strided views:
/// q is a narrow of a packed (b, s, hq + 2 hkv, d) buffer and k/v are transposed from
/// (b, hkv, sk, d).
#[allow(clippy::too_many_arguments)]
pub fn qkv(
    b: usize,
    sq: usize,
    sk: usize,
    hq: usize,
    hkv: usize,
    d: usize,
    dtype: DType,
    strided: bool,
    dev: &Device,
) -> Result<(Tensor, Tensor, Tensor)> {
    let r =
        |shape: (usize, usize, usize, usize)| Tensor::randn(0f32, 1., shape, dev)?.to_dtype(dtype);
    if !strided {
        return Ok((r((b, sq, hq, d))?, r((b, sk, hkv, d))?, r((b, sk, hkv, d))?));
    }
    let packed = r((b, sq, hq + 3, d))?;
    let q = packed.narrow(2, 1, hq)?;
    let k = r((b, hkv, sk, d))?.transpose(1, 2)?;
    let v = r((b, hkv, sk, d))?.transpose(1, 2)?;
    Ok((q, k, v))
}

pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f64> {
    let a = a.to_dtype(DType::F64)?;
    let b = b.to_dtype(DType::F64)?;
    let d = (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f64>()?;
    Ok(d)
}

pub fn max_abs(a: &Tensor) -> Result<f64> {
    a.to_dtype(DType::F64)?
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_scalar::<f64>()
}

/// Count of non-finite elements.
pub fn non_finite(a: &Tensor) -> Result<usize> {
    let v = a.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
    Ok(v.iter().filter(|x| !x.is_finite()).count())
}

/// Max |a - b| where both are finite or both are the same infinity; a NaN or a mismatch of
/// infinities counts as an infinite error.
pub fn lse_err(a: &Tensor, b: &Tensor) -> Result<f64> {
    let a = a.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
    let b = b.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
    let mut m = 0f64;
    for (x, y) in a.iter().zip(b.iter()) {
        let e = if x.is_infinite() || y.is_infinite() {
            if x == y {
                0.0
            } else {
                f64::INFINITY
            }
        } else {
            (x - y).abs()
        };
        m = m.max(if e.is_nan() { f64::INFINITY } else { e });
    }
    Ok(m)
}

/// An independent float64 reference built from candle ops on the CPU: returns (O, LSE) for the
/// full problem. Inputs are copied to the CPU and upcast.
pub fn reference_f64(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    p: &AttnParams,
) -> Result<(Tensor, Tensor)> {
    let cpu = Device::Cpu;
    let q = q.to_device(&cpu)?.to_dtype(DType::F64)?;
    let k = k.to_device(&cpu)?.to_dtype(DType::F64)?;
    let v = v.to_device(&cpu)?.to_dtype(DType::F64)?;
    let (b, sq, hq, d) = q.dims4()?;
    let (_, sk, hkv, _) = k.dims4()?;
    let ratio = hq / hkv;
    let q = q.transpose(1, 2)?.contiguous()?;
    let rep = |t: &Tensor| -> Result<Tensor> {
        let t = t.transpose(1, 2)?;
        t.unsqueeze(2)?
            .broadcast_as((b, hkv, ratio, sk, d))?
            .reshape((b, hq, sk, d))?
            .contiguous()
    };
    let (k, v) = (rep(&k)?, rep(&v)?);
    let scale = p.softmax_scale.unwrap_or(1.0 / (d as f32).sqrt()) as f64;
    let mut s = (q.matmul(&k.t()?)? * scale)?;
    if let Some(c) = p.softcap {
        let c = c as f64;
        s = ((s / c)?.tanh()? * c)?;
    }
    // Visibility and ALiBi distance, written out element by element (independent of the crate).
    let (left, right) = p.mask.bounds();
    let mut bias = vec![0f64; sq * sk];
    let mut dist = vec![0f64; sq * sk];
    for i in 0..sq {
        for j in 0..sk {
            let diag = i as i64 + sk as i64 - sq as i64;
            let jj = j as i64;
            let ok = left.is_none_or(|l| jj >= diag - l as i64)
                && right.is_none_or(|r| jj <= diag + r as i64);
            bias[i * sk + j] = if ok { 0.0 } else { f64::NEG_INFINITY };
            dist[i * sk + j] = (jj - diag).abs() as f64;
        }
    }
    if let Some(sl) = &p.alibi_slopes {
        let sl = sl
            .to_device(&cpu)?
            .to_dtype(DType::F64)?
            .reshape((hq, 1, 1))?;
        let dist = Tensor::from_vec(dist, (1, sq, sk), &cpu)?;
        s = s.broadcast_sub(&sl.broadcast_mul(&dist)?)?;
    }
    let s = s.broadcast_add(&Tensor::from_vec(bias, (sq, sk), &cpu)?)?;
    let m = s.max_keepdim(D::Minus1)?;
    let m_safe = m.clamp(-1e300, f64::INFINITY)?; // -inf rows: avoid (-inf) - (-inf)
    let e = s.broadcast_sub(&m_safe)?.exp()?;
    let l = e.sum_keepdim(D::Minus1)?;
    let l_safe = l.clamp(1e-300, f64::INFINITY)?;
    let o = e
        .broadcast_div(&l_safe)?
        .matmul(&v)?
        .transpose(1, 2)?
        .contiguous()?;
    let lse = (m_safe + l.log()?)?.squeeze(D::Minus1)?; // l = 0 gives -inf
    Ok((o, lse))
}

pub fn mask_name(m: Mask) -> String {
    match m {
        Mask::None => "none".into(),
        Mask::Causal => "causal".into(),
        Mask::Window { left, right } => format!("win({left:?},{right:?})"),
    }
}

/// Rounding floor of the tolerance rule: a few units in the last place of the output dtype at
/// the output's magnitude.
pub fn rounding_floor(dtype: DType, magnitude: f64) -> f64 {
    let eps = match dtype {
        DType::BF16 => 2f64.powi(-8),
        DType::F16 => 2f64.powi(-11),
        DType::F32 => 2f64.powi(-24),
        _ => 2f64.powi(-53),
    };
    2.0 * eps * magnitude.max(1e-3) + 1e-6
}

/// Xorshift generator seeded from the clock (fresh problems every run); the seed is printed so a
/// failure can be reproduced.
pub struct Rng(u64);

impl Rng {
    pub fn from_clock(label: &str) -> Rng {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64
            | 1;
        println!("{label}: seed {seed}");
        Rng(seed)
    }
    /// Uniform in `0..n`.
    pub fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}

/// Number of random problems for the GPU tests (`FLASHCORE_RANDOM_CASES`, default 100).
pub fn random_cases() -> usize {
    std::env::var("FLASHCORE_RANDOM_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(100)
}
