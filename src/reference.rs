//! The CPU path: a fused reference computing the exact function of the crate docs (f32
//! accumulation for 16/32-bit inputs, f64 for f64), and the eager composition of candle ops.

use crate::params::{AttnParams, Mask, Problem};
use candle_core::{DType, Device, Result, Tensor, WithDType, D};

/// Accumulation type of the CPU path.
pub(crate) trait Acc:
    Copy
    + Send
    + Sync
    + PartialOrd
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Div<Output = Self>
    + std::ops::AddAssign
{
    const ZERO: Self;
    const NEG_INF: Self;
    fn of(x: f64) -> Self;
    fn f64(self) -> f64;
    fn exp(self) -> Self;
    fn tanh(self) -> Self;
}

macro_rules! acc {
    ($t:ty) => {
        impl Acc for $t {
            const ZERO: Self = 0.0;
            const NEG_INF: Self = <$t>::NEG_INFINITY;
            fn of(x: f64) -> Self {
                x as $t
            }
            fn f64(self) -> f64 {
                self as f64
            }
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            fn tanh(self) -> Self {
                <$t>::tanh(self)
            }
        }
    };
}
acc!(f32);
acc!(f64);

/// Dot product with four independent partial sums (lets the compiler vectorise it).
fn dot<A: Acc>(a: &[A], b: &[A]) -> A {
    let mut acc = [A::ZERO; 4];
    let (ca, cb) = (a.chunks_exact(4), b.chunks_exact(4));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..4 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut tail = A::ZERO;
    for (x, y) in ra.iter().zip(rb) {
        tail += *x * *y;
    }
    (acc[0] + acc[1]) + (acc[2] + acc[3]) + tail
}

/// Keys visible to query row `i`: the half-open range `lo..hi` (empty when `lo >= hi`).
pub(crate) fn visible_keys(i: usize, sq: usize, sk: usize, mask: Mask) -> (usize, usize) {
    let diag = i as i64 + sk as i64 - sq as i64;
    let (left, right) = mask.bounds();
    let lo = left.map_or(0, |l| (diag - l as i64).max(0));
    let hi = right.map_or(sk as i64, |r| (diag + r as i64 + 1).clamp(0, sk as i64));
    (lo.min(sk as i64) as usize, hi as usize)
}

/// One query head's result: (batch, head, O rows `(sq, d)`, LSE `(sq,)`).
type HeadResult<A> = (usize, usize, Vec<A>, Vec<f32>);

/// Fused CPU attention over strided storage. `q`, `k`, `v` are the storages' full slices with
/// the layouts' start offsets already applied. Returns O `(b, sq, hq, d)` contiguous in `T` and
/// LSE `(b, hq, sq)` f32.
pub(crate) fn fused<T: WithDType, A: Acc>(
    q: &[T],
    k: &[T],
    v: &[T],
    p: &Problem,
    slopes: Option<&[f32]>,
) -> (Vec<T>, Vec<f32>) {
    let (b, sq, sk, hq, hkv, d) = (p.b, p.sq, p.sk, p.hq, p.hkv, p.d);
    let ratio = hq / hkv;
    let mut out = vec![T::zero(); b * sq * hq * d];
    let mut lse = vec![f32::NEG_INFINITY; b * hq * sq];
    let scale = A::of(p.scale as f64);
    let softcap = p.softcap.map(|c| A::of(c as f64));
    // One unit of work: a (batch, kv head) pair; it owns the output of its `ratio` query heads.
    // Collect disjoint output slices per unit so threads can write without locks.
    let units: Vec<(usize, usize)> = (0..b)
        .flat_map(|bi| (0..hkv).map(move |g| (bi, g)))
        .collect();
    // Threads only pay for themselves on real work (spawning costs more than a decode step).
    let work = b * hq * sq * sk * d;
    let nthreads = if work < 1 << 22 {
        1
    } else {
        std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(units.len())
            .max(1)
    };
    let worker = |t: usize| -> Vec<HeadResult<A>> {
        let mut res = Vec::new();
        let mut kbuf = vec![A::ZERO; sk * d];
        let mut vbuf = vec![A::ZERO; sk * d];
        let mut scores = vec![A::ZERO; sk];
        for &(bi, g) in units.iter().skip(t).step_by(nthreads) {
            for j in 0..sk {
                let ko = bi * p.k_strides[0] + j * p.k_strides[1] + g * p.k_strides[2];
                let vo = bi * p.v_strides[0] + j * p.v_strides[1] + g * p.v_strides[2];
                for x in 0..d {
                    kbuf[j * d + x] = A::of(k[ko + x].to_f64());
                    vbuf[j * d + x] = A::of(v[vo + x].to_f64());
                }
            }
            for h in g * ratio..(g + 1) * ratio {
                let slope = slopes.map(|s| A::of(s[h] as f64));
                let mut o_head = vec![A::ZERO; sq * d];
                let mut l_head = vec![f32::NEG_INFINITY; sq];
                let mut qrow = vec![A::ZERO; d];
                for i in 0..sq {
                    let (lo, hi) = visible_keys(i, sq, sk, p.mask);
                    if lo >= hi {
                        continue;
                    }
                    let qo = bi * p.q_strides[0] + i * p.q_strides[1] + h * p.q_strides[2];
                    for x in 0..d {
                        qrow[x] = A::of(q[qo + x].to_f64());
                    }
                    let diag = i as f64 + sk as f64 - sq as f64;
                    let mut m = A::NEG_INF;
                    for j in lo..hi {
                        let kr = &kbuf[j * d..(j + 1) * d];
                        let mut s = dot(&qrow, kr) * scale;
                        if let Some(c) = softcap {
                            s = c * (s / c).tanh();
                        }
                        if let Some(sl) = slope {
                            s = s - sl * A::of((j as f64 - diag).abs());
                        }
                        scores[j] = s;
                        if s > m {
                            m = s;
                        }
                    }
                    let mut l = A::ZERO;
                    let orow = &mut o_head[i * d..(i + 1) * d];
                    for j in lo..hi {
                        let pj = (scores[j] - m).exp();
                        l += pj;
                        let vr = &vbuf[j * d..(j + 1) * d];
                        for x in 0..d {
                            orow[x] += pj * vr[x];
                        }
                    }
                    for o in orow.iter_mut() {
                        *o = *o / l;
                    }
                    l_head[i] = (m.f64() + l.f64().ln()) as f32;
                }
                res.push((bi, h, o_head, l_head));
            }
        }
        res
    };
    let results: Vec<Vec<HeadResult<A>>> = if nthreads == 1 {
        vec![worker(0)]
    } else {
        std::thread::scope(|s| {
            let worker = &worker;
            let handles: Vec<_> = (1..nthreads).map(|t| s.spawn(move || worker(t))).collect();
            let mut all = vec![worker(0)];
            all.extend(
                handles
                    .into_iter()
                    .map(|h| h.join().expect("flashcore: CPU worker panicked")),
            );
            all
        })
    };
    for (bi, h, o_head, l_head) in results.into_iter().flatten() {
        for i in 0..sq {
            let dst = ((bi * sq + i) * hq + h) * d;
            for x in 0..d {
                out[dst + x] = T::from_f64(o_head[i * d + x].f64());
            }
        }
        lse[(bi * hq + h) * sq..(bi * hq + h + 1) * sq].copy_from_slice(&l_head);
    }
    (out, lse)
}

/// `(seq_q, seq_k)` additive mask: 0 where visible, -inf elsewhere, in `dtype`.
pub(crate) fn mask_bias(
    sq: usize,
    sk: usize,
    mask: Mask,
    dtype: DType,
    dev: &Device,
) -> Result<Tensor> {
    let mut m = vec![f32::NEG_INFINITY; sq * sk];
    for i in 0..sq {
        let (lo, hi) = visible_keys(i, sq, sk, mask);
        for j in lo..hi.max(lo) {
            m[i * sk + j] = 0.0;
        }
    }
    Tensor::from_vec(m, (sq, sk), dev)?.to_dtype(dtype)
}

/// `(heads_q, seq_q, seq_k)` ALiBi bias `-slope[h] * |j - (i + sk - sq)|`.
fn alibi_bias(slopes: &Tensor, sq: usize, sk: usize, dtype: DType) -> Result<Tensor> {
    let dev = slopes.device();
    let i = Tensor::arange(0u32, sq as u32, dev)?
        .to_dtype(DType::F32)?
        .reshape((sq, 1))?;
    let j = Tensor::arange(0u32, sk as u32, dev)?
        .to_dtype(DType::F32)?
        .reshape((1, sk))?;
    let dist = j.broadcast_sub(&(i + (sk as f64 - sq as f64))?)?.abs()?;
    let h = slopes.dims1()?;
    slopes
        .reshape((h, 1, 1))?
        .broadcast_mul(&dist.unsqueeze(0)?)?
        .neg()?
        .to_dtype(dtype)
}

/// Eager attention from candle ops in the input dtype: transpose, repeat K/V for GQA, matmul,
/// softcap, ALiBi, mask, softmax, matmul. Rows that see no key come out as zeros here too.
pub(crate) fn eager(q: &Tensor, k: &Tensor, v: &Tensor, params: &AttnParams) -> Result<Tensor> {
    eager_chunked(q, k, v, params, EAGER_MAX_ELEMS)
}

/// Largest intermediate (elements) the eager path builds at once: candle's element-wise CUDA
/// kernels take 32-bit element counts (CUDA_ERROR_INVALID_VALUE beyond), so bigger problems are
/// split over the batch, then over groups of KV heads.
const EAGER_MAX_ELEMS: usize = 1 << 30;

/// [`eager`] with every intermediate below `max_elems` elements where a batch or KV-head split
/// gets it there (a single (1 batch, 1 KV head) problem runs whole).
pub(crate) fn eager_chunked(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    params: &AttnParams,
    max_elems: usize,
) -> Result<Tensor> {
    let p = crate::params::validate(q, k, v, params)?;
    let biggest = p.b * p.hq * p.sk * p.sq.max(p.d);
    if biggest <= max_elems || (p.b == 1 && p.hkv == 1) {
        return eager_whole(q, k, v, params);
    }
    let parts = if p.b > 1 {
        let h = p.b / 2;
        vec![
            eager_chunked(
                &q.narrow(0, 0, h)?,
                &k.narrow(0, 0, h)?,
                &v.narrow(0, 0, h)?,
                params,
                max_elems,
            )?,
            eager_chunked(
                &q.narrow(0, h, p.b - h)?,
                &k.narrow(0, h, p.b - h)?,
                &v.narrow(0, h, p.b - h)?,
                params,
                max_elems,
            )?,
        ]
    } else {
        // Query heads [g * ratio, (g + n) * ratio) read KV heads [g, g + n).
        let ratio = p.h_ratio();
        let h = p.hkv / 2;
        let mut out = Vec::with_capacity(2);
        for (g, n) in [(0, h), (h, p.hkv - h)] {
            let mut sub = params.clone();
            sub.alibi_slopes = match &params.alibi_slopes {
                Some(sl) => Some(sl.narrow(0, g * ratio, n * ratio)?),
                None => None,
            };
            out.push(eager_chunked(
                &q.narrow(2, g * ratio, n * ratio)?,
                &k.narrow(2, g, n)?,
                &v.narrow(2, g, n)?,
                &sub,
                max_elems,
            )?);
        }
        out
    };
    Tensor::cat(&parts, if p.b > 1 { 0 } else { 2 })
}

fn eager_whole(q: &Tensor, k: &Tensor, v: &Tensor, params: &AttnParams) -> Result<Tensor> {
    let p = crate::params::validate(q, k, v, params)?;
    let dtype = p.dtype;
    let ratio = p.h_ratio();
    let q = q.transpose(1, 2)?.contiguous()?; // (b, hq, sq, d)
    let repeat = |t: &Tensor| -> Result<Tensor> {
        let t = t.transpose(1, 2)?; // (b, hkv, sk, d)
        let t = if ratio == 1 {
            t
        } else {
            let (b, hkv, sk, d) = t.dims4()?;
            t.unsqueeze(2)?
                .broadcast_as((b, hkv, ratio, sk, d))?
                .reshape((b, hkv * ratio, sk, d))?
        };
        t.contiguous()
    };
    let k = repeat(k)?;
    let v = repeat(v)?;
    let mut s = (q.matmul(&k.t()?)? * p.scale as f64)?;
    if let Some(c) = p.softcap {
        s = ((s / c as f64)?.tanh()? * c as f64)?;
    }
    if let Some(sl) = &params.alibi_slopes {
        s = s.broadcast_add(&alibi_bias(sl, p.sq, p.sk, dtype)?)?;
    }
    let any_masked = p.mask != Mask::None;
    if any_masked {
        s = s.broadcast_add(&mask_bias(p.sq, p.sk, p.mask, dtype, s.device())?)?;
    }
    let mut w = candle_nn::ops::softmax_last_dim(&s)?;
    if any_masked {
        // A fully masked row gives NaN (0/0) in the softmax; the function defines it as zeros.
        let empty = s.max_keepdim(D::Minus1)?.eq(f64::NEG_INFINITY)?;
        w = empty
            .broadcast_as(w.shape())?
            .where_cond(&w.zeros_like()?, &w)?;
    }
    w.matmul(&v)?.transpose(1, 2)?.contiguous()
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// The eager twin splits big problems over the batch and KV-head groups (candle's CUDA
    /// element-wise kernels take 32-bit counts): split and whole must agree, ALiBi slopes and
    /// GQA included.
    #[test]
    fn eager_split_matches_whole() -> Result<()> {
        let dev = Device::Cpu;
        let (b, sq, sk, hq, hkv, d) = (3, 9, 21, 8, 2, 16);
        let q = Tensor::randn(0f32, 1., (b, sq, hq, d), &dev)?;
        let k = Tensor::randn(0f32, 1., (b, sk, hkv, d), &dev)?;
        let v = Tensor::randn(0f32, 1., (b, sk, hkv, d), &dev)?;
        let slopes = Tensor::rand(0f32, 1., hq, &dev)?;
        let p = AttnParams {
            mask: Mask::Causal,
            alibi_slopes: Some(slopes),
            ..Default::default()
        };
        let whole = eager_whole(&q, &k, &v, &p)?;
        // Forces the split down to single (batch, KV head) pieces.
        let split = eager_chunked(&q, &k, &v, &p, 1)?;
        assert_eq!(split.dims(), whole.dims());
        let diff = (whole - split)?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f32>()?;
        assert!(diff < 1e-6, "split eager differs from whole by {diff}");
        Ok(())
    }
}
