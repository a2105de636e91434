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

/// Largest |a - b|, computed on the CPU (either may live on a GPU).
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f64> {
    let cpu = candle_core::Device::Cpu;
    let a = a.to_device(&cpu)?.to_dtype(DType::F64)?;
    let b = b.to_device(&cpu)?.to_dtype(DType::F64)?;
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
    // k is q's head dim (d_qk) wide, v its own (d_v).
    let rep = |t: &Tensor| -> Result<Tensor> {
        let w = t.dim(3)?;
        let t = t.transpose(1, 2)?;
        t.unsqueeze(2)?
            .broadcast_as((b, hkv, ratio, sk, w))?
            .reshape((b, hq, sk, w))?
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
            // Chunked attention: the row's position and the key in the same chunk (floor
            // division: a row at diag < 0 is in chunk -1, which holds no key).
            let ok = left.is_none_or(|l| jj >= diag - l as i64)
                && right.is_none_or(|r| jj <= diag + r as i64)
                && p.chunk.is_none_or(|c| {
                    let c = i64::try_from(c).unwrap_or(i64::MAX);
                    diag.div_euclid(c) == jj.div_euclid(c)
                });
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
    // Sinks: a per-head logit beside every row's scores, in the max and the sum, without a value.
    let sink = p
        .sinks
        .as_ref()
        .map(|t| {
            t.to_device(&cpu)?
                .to_dtype(DType::F64)?
                .reshape((1, hq, 1, 1))
        })
        .transpose()?;
    let mut m = s.max_keepdim(D::Minus1)?;
    if let Some(sn) = &sink {
        m = m.broadcast_maximum(sn)?;
    }
    let m_safe = m.clamp(-1e300, f64::INFINITY)?; // -inf rows: avoid (-inf) - (-inf)
    let e = s.broadcast_sub(&m_safe)?.exp()?;
    let mut l = e.sum_keepdim(D::Minus1)?;
    if let Some(sn) = &sink {
        l = (l + sn.broadcast_sub(&m_safe)?.exp()?)?;
    }
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

/// Whether the error message `msg` names `arg` as a whole word (not as part of a longer
/// identifier: `q` is not named by `seq_q`, `cu_seqlens_k` not by `cu_seqlens_kv`).
pub fn names(msg: &str, arg: &str) -> bool {
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    msg.match_indices(arg).any(|(at, _)| {
        let before = msg[..at].chars().next_back();
        let after = msg[at + arg.len()..].chars().next();
        !before.is_some_and(ident) && !after.is_some_and(ident)
    })
}

/// The options of batch entry (or varlen sequence) `i`: `(batch, heads_q)` ALiBi slopes become
/// that row's `(heads_q,)` slopes; `(heads_q,)` slopes and every other option are shared.
pub fn params_of(p: &AttnParams, i: usize) -> Result<AttnParams> {
    let mut out = p.clone();
    if let Some(s) = &p.alibi_slopes {
        if s.rank() == 2 {
            out.alibi_slopes = Some(s.get(i)?.contiguous()?);
        }
    }
    Ok(out)
}

/// Sinks for the tests, f32 `(hq,)` on `dev`: spread over [-2, 12] (below and above the LSEs of
/// random rows over 1 to 64k keys, so that the sink takes from nothing to most of a row's
/// weight), head 2 `-inf` (no sink) when there are more than 2 heads.
pub fn test_sinks(hq: usize, dev: &Device) -> Result<Tensor> {
    let v: Vec<f32> = (0..hq)
        .map(|h| {
            if h == 2 {
                f32::NEG_INFINITY
            } else {
                -2.0 + 14.0 * ((h * 5 + 1) % 13) as f32 / 12.0
            }
        })
        .collect();
    Tensor::from_vec(v, hq, dev)
}

/// The same options with the ALiBi slopes and sinks (if any) on `dev`.
pub fn params_on(p: &AttnParams, dev: &Device) -> Result<AttnParams> {
    let mut out = p.clone();
    out.alibi_slopes = p
        .alibi_slopes
        .as_ref()
        .map(|s| s.to_device(dev))
        .transpose()?;
    out.sinks = p.sinks.as_ref().map(|s| s.to_device(dev)).transpose()?;
    Ok(out)
}

/// Short description of the options for the one-line case summaries.
pub fn opts_name(p: &AttnParams) -> String {
    let mut s = mask_name(p.mask);
    if let Some(c) = p.softcap {
        s += &format!(" cap{c}");
    }
    if let Some(sl) = &p.alibi_slopes {
        s += &format!(" alibi{:?}", sl.dims());
    }
    if let Some(sc) = p.softmax_scale {
        s += &format!(" scale{sc}");
    }
    if p.sinks.is_some() {
        s += " sinks";
    }
    if let Some(c) = p.chunk {
        s += &format!(" chunk{c}");
    }
    s
}

/// Runs the dense function `f` (O `(b, sq, hq, d)` and maybe LSE `(b, hq, sq)`) on each batch
/// entry with its own `(heads_q,)` slopes when `p` carries `(batch, heads_q)` slopes, else once on
/// the whole batch; results on the CPU, concatenated along the batch.
pub fn per_batch<F>(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    p: &AttnParams,
    f: F,
) -> Result<(Tensor, Option<Tensor>)>
where
    F: Fn(&Tensor, &Tensor, &Tensor, &AttnParams) -> Result<(Tensor, Option<Tensor>)>,
{
    let cpu = Device::Cpu;
    let per_entry = p.alibi_slopes.as_ref().is_some_and(|s| s.rank() == 2);
    if !per_entry {
        let (o, l) = f(q, k, v, p)?;
        return Ok((
            o.to_device(&cpu)?,
            l.map(|l| l.to_device(&cpu)).transpose()?,
        ));
    }
    let b = q.dim(0)?;
    let (mut os, mut ls) = (Vec::new(), Vec::new());
    for i in 0..b {
        let one = |t: &Tensor| t.narrow(0, i, 1);
        let (o, l) = f(&one(q)?, &one(k)?, &one(v)?, &params_of(p, i)?)?;
        os.push(o.to_device(&cpu)?);
        ls.push(l.map(|l| l.to_device(&cpu)).transpose()?);
    }
    let lse = ls
        .into_iter()
        .collect::<Option<Vec<_>>>()
        .map(|ls| Tensor::cat(&ls, 0))
        .transpose()?;
    Ok((Tensor::cat(&os, 0)?, lse))
}

/// A packed variable-length batch in the layout of `flashcore::attention_varlen`: q
/// `(total_q, heads_q, d)`, k and v `(total_k, heads_kv, d)`; the prefix sums as host vectors
/// and as u32 tensors on q's device; `max_q`/`max_k` the longest sequences.
#[derive(Clone, Debug)]
pub struct Varlen {
    pub q: Tensor,
    pub k: Tensor,
    pub v: Tensor,
    /// `(seq_q_i, seq_k_i)` per sequence.
    pub lens: Vec<(usize, usize)>,
    pub cu_q: Vec<u32>,
    pub cu_k: Vec<u32>,
    pub cu_q_t: Tensor,
    pub cu_k_t: Tensor,
    pub max_q: usize,
    pub max_k: usize,
}

/// `[0, l0, l0 + l1, ...]` as u32.
pub fn prefix_sums(lens: impl IntoIterator<Item = usize>) -> Vec<u32> {
    let mut cu = vec![0u32];
    for l in lens {
        cu.push(cu.last().unwrap() + l as u32);
    }
    cu
}

impl Varlen {
    /// Fresh random inputs (normal, std 1) for sequences of `(seq_q_i, seq_k_i)`. With
    /// `strided`, q is a narrow of a packed `(total_q, heads_q + 3, d)` buffer and k, v narrows of
    /// one packed `(total_k, 2 heads_kv + 1, d)` buffer (a fused projection's layout).
    pub fn random(
        lens: &[(usize, usize)],
        hq: usize,
        hkv: usize,
        d: usize,
        dtype: DType,
        strided: bool,
        dev: &Device,
    ) -> Result<Varlen> {
        Varlen::random_dv(lens, hq, hkv, d, d, dtype, strided, dev)
    }

    /// [`Varlen::random`] with v of its own head dim `dv` (q and k `d` wide). With `strided` and
    /// `dv != d`, k and v are narrows of two separate packed buffers.
    #[allow(clippy::too_many_arguments)]
    pub fn random_dv(
        lens: &[(usize, usize)],
        hq: usize,
        hkv: usize,
        d: usize,
        dv: usize,
        dtype: DType,
        strided: bool,
        dev: &Device,
    ) -> Result<Varlen> {
        let tq: usize = lens.iter().map(|l| l.0).sum();
        let tk: usize = lens.iter().map(|l| l.1).sum();
        let r = |shape: (usize, usize, usize)| Tensor::randn(0f32, 1., shape, dev)?.to_dtype(dtype);
        let (q, k, v) = if strided && dv == d {
            let q = r((tq, hq + 3, d))?.narrow(1, 2, hq)?;
            let kv = r((tk, 2 * hkv + 1, d))?;
            (q, kv.narrow(1, 1, hkv)?, kv.narrow(1, hkv + 1, hkv)?)
        } else if strided {
            let q = r((tq, hq + 3, d))?.narrow(1, 2, hq)?;
            let k = r((tk, hkv + 1, d))?.narrow(1, 1, hkv)?;
            let v = r((tk, hkv + 2, dv))?.narrow(1, 2, hkv)?;
            (q, k, v)
        } else {
            (r((tq, hq, d))?, r((tk, hkv, d))?, r((tk, hkv, dv))?)
        };
        Varlen::from_parts(q, k, v, lens)
    }

    /// A batch from given packed tensors; the prefix sums come from `lens`.
    pub fn from_parts(q: Tensor, k: Tensor, v: Tensor, lens: &[(usize, usize)]) -> Result<Varlen> {
        let cu_q = prefix_sums(lens.iter().map(|l| l.0));
        let cu_k = prefix_sums(lens.iter().map(|l| l.1));
        assert_eq!(q.dim(0)?, *cu_q.last().unwrap() as usize, "q rows");
        assert_eq!(k.dim(0)?, *cu_k.last().unwrap() as usize, "k rows");
        let dev = q.device().clone();
        Ok(Varlen {
            cu_q_t: Tensor::new(cu_q.as_slice(), &dev)?,
            cu_k_t: Tensor::new(cu_k.as_slice(), &dev)?,
            max_q: lens.iter().map(|l| l.0).max().unwrap_or(0),
            max_k: lens.iter().map(|l| l.1).max().unwrap_or(0),
            lens: lens.to_vec(),
            cu_q,
            cu_k,
            q,
            k,
            v,
        })
    }

    pub fn total_q(&self) -> usize {
        *self.cu_q.last().unwrap() as usize
    }
    pub fn total_k(&self) -> usize {
        *self.cu_k.last().unwrap() as usize
    }
    pub fn heads(&self) -> (usize, usize) {
        (self.q.dim(1).unwrap(), self.k.dim(1).unwrap())
    }
    pub fn head_dim(&self) -> usize {
        self.q.dim(2).unwrap()
    }
    /// v's head dim (the output's).
    pub fn v_head_dim(&self) -> usize {
        self.v.dim(2).unwrap()
    }

    /// The same inputs on `dev` in `dtype` (exact when widening); contiguous.
    pub fn to(&self, dev: &Device, dtype: DType) -> Result<Varlen> {
        let m = |t: &Tensor| t.to_device(dev)?.to_dtype(dtype)?.contiguous();
        let mut out = Varlen::from_parts(m(&self.q)?, m(&self.k)?, m(&self.v)?, &self.lens)?;
        (out.max_q, out.max_k) = (self.max_q, self.max_k);
        Ok(out)
    }

    /// Sequence `i` as a dense batch of one: q `(1, seq_q_i, hq, d)`, k/v `(1, seq_k_i, hkv, d)`.
    pub fn seq(&self, i: usize) -> Result<(Tensor, Tensor, Tensor)> {
        let (q0, k0) = (self.cu_q[i] as usize, self.cu_k[i] as usize);
        let (sq, sk) = self.lens[i];
        Ok((
            self.q.narrow(0, q0, sq)?.unsqueeze(0)?,
            self.k.narrow(0, k0, sk)?.unsqueeze(0)?,
            self.v.narrow(0, k0, sk)?.unsqueeze(0)?,
        ))
    }

    /// `attention_varlen_with_lse` on this batch (its own prefix sums and maxima).
    pub fn run(&self, p: &AttnParams) -> Result<(Tensor, Tensor)> {
        flashcore::attention_varlen_with_lse(
            &self.q,
            &self.k,
            &self.v,
            &self.cu_q_t,
            &self.cu_k_t,
            self.max_q,
            self.max_k,
            p,
        )
    }

    /// `attention_varlen` (no LSE) on this batch.
    pub fn run_o(&self, p: &AttnParams) -> Result<Tensor> {
        flashcore::attention_varlen(
            &self.q,
            &self.k,
            &self.v,
            &self.cu_q_t,
            &self.cu_k_t,
            self.max_q,
            self.max_k,
            p,
        )
    }

    /// `sum_i seq_q_i * seq_k_i * heads_q * d`: the size of the work (and of a CPU reference).
    pub fn work(&self) -> usize {
        let (hq, _) = self.heads();
        self.lens.iter().map(|&(a, b)| a * b).sum::<usize>() * hq * self.head_dim()
    }

    /// One-line shape summary: sequences, totals, maxima, heads, head dim, dtype, and the
    /// lengths when there are few.
    pub fn shape_name(&self) -> String {
        let (hq, hkv) = self.heads();
        let mut s = format!(
            "{:?} n{} tq{} tk{} max{}/{} h{hq}/{hkv} d{}",
            self.q.dtype(),
            self.lens.len(),
            self.total_q(),
            self.total_k(),
            self.max_q,
            self.max_k,
            self.head_dim()
        );
        if self.lens.len() <= 8 {
            s += &format!(" lens{:?}", self.lens);
        }
        s
    }
}

/// One unit of [`varlen_by_sequence`]: O `(seq_q, heads, d)` and maybe LSE `(heads, seq_q)`.
type SeqResult = (Tensor, Option<Tensor>);

/// Runs the dense function `f` (taking `(1, s, h, d)` q/k/v, returning O `(1, sq, h, d)` and
/// maybe LSE `(1, h, sq)`) on every sequence of `vl` with that sequence's options and packs the
/// results like `attention_varlen`: O `(total_q, hq, d)` in `vl`'s dtype and LSE `(hq, total_q)`,
/// on the CPU. Sequences with seq_k = 0 give zero rows and LSE -inf, or the sinks (no dense call
/// takes them); those with seq_q = 0 give nothing. With `per_head`, `f` runs once per (sequence, query head)
/// on that head and its K/V head, spread over all cores: the fast CPU reference for long
/// sequences (the CPU kernel parallelises over KV heads only).
pub fn varlen_by_sequence<F>(
    vl: &Varlen,
    p: &AttnParams,
    per_head: bool,
    f: F,
) -> Result<(Tensor, Option<Tensor>)>
where
    F: Fn(&Tensor, &Tensor, &Tensor, &AttnParams) -> Result<(Tensor, Option<Tensor>)> + Sync,
{
    let cpu = Device::Cpu;
    let (hq, hkv) = vl.heads();
    let d = vl.v_head_dim();
    let ratio = hq / hkv;
    let mut units: Vec<(usize, Option<usize>)> = Vec::new();
    for (i, &(sq, sk)) in vl.lens.iter().enumerate() {
        if sq > 0 && sk > 0 {
            if per_head {
                units.extend((0..hq).map(|h| (i, Some(h))));
            } else {
                units.push((i, None));
            }
        }
    }
    let unit = |&(i, h): &(usize, Option<usize>)| -> Result<SeqResult> {
        let (q, k, v) = vl.seq(i)?;
        let mut pi = params_of(p, i)?;
        let (q, k, v) = match h {
            Some(h) => {
                if let Some(s) = &pi.alibi_slopes {
                    pi.alibi_slopes = Some(s.narrow(0, h, 1)?);
                }
                if let Some(s) = &pi.sinks {
                    pi.sinks = Some(s.narrow(0, h, 1)?.contiguous()?);
                }
                (
                    q.narrow(2, h, 1)?,
                    k.narrow(2, h / ratio, 1)?,
                    v.narrow(2, h / ratio, 1)?,
                )
            }
            None => (q, k, v),
        };
        let (o, l) = f(&q, &k, &v, &pi)?;
        let o = o.squeeze(0)?.to_device(&cpu)?;
        let l = l.map(|l| l.squeeze(0)?.to_device(&cpu)).transpose()?;
        Ok((o, l))
    };
    let results: Vec<Result<SeqResult>> = if per_head && units.len() > 1 {
        let threads = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(units.len());
        let next = std::sync::atomic::AtomicUsize::new(0);
        let slots: Vec<std::sync::Mutex<Option<Result<SeqResult>>>> =
            units.iter().map(|_| std::sync::Mutex::new(None)).collect();
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(|| loop {
                    let n = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if n >= units.len() {
                        break;
                    }
                    *slots[n].lock().unwrap() = Some(unit(&units[n]));
                });
            }
        });
        slots
            .into_iter()
            .map(|m| m.into_inner().unwrap().expect("every unit ran"))
            .collect()
    } else {
        units.iter().map(unit).collect()
    };
    let mut results = results.into_iter();
    let (mut os, mut ls) = (Vec::new(), Vec::new());
    let mut all_lse = true;
    for &(sq, sk) in &vl.lens {
        if sq == 0 {
            continue;
        }
        if sk == 0 {
            os.push(Tensor::zeros((sq, hq, d), vl.q.dtype(), &cpu)?);
            ls.push(match &p.sinks {
                // keyless rows: LSE = the head's sink
                Some(sn) => sn
                    .to_device(&cpu)?
                    .reshape((hq, 1))?
                    .broadcast_as((hq, sq))?
                    .contiguous()?,
                None => Tensor::full(f32::NEG_INFINITY, (hq, sq), &cpu)?,
            });
            continue;
        }
        let parts = (0..if per_head { hq } else { 1 })
            .map(|_| results.next().expect("one result per unit"))
            .collect::<Result<Vec<_>>>()?;
        let o: Vec<Tensor> = parts.iter().map(|r| r.0.clone()).collect();
        os.push(Tensor::cat(&o, 1)?);
        match parts
            .iter()
            .map(|r| r.1.clone())
            .collect::<Option<Vec<_>>>()
        {
            Some(l) => ls.push(Tensor::cat(&l, 0)?),
            None => all_lse = false,
        }
    }
    let o = Tensor::cat(&os, 0)?.to_dtype(vl.q.dtype())?;
    let lse = if all_lse {
        Some(Tensor::cat(&ls, 1)?)
    } else {
        None
    };
    Ok((o, lse))
}

/// A paged cache holding a [`Varlen`] batch's K/V, in the layout of `flashcore::attention_paged`:
/// pools `(num_pages, page_size, hkv, d)` whose pages hold the sequences' keys in a shuffled
/// order, the page table `(b, max_pages)` and the lengths, as host vectors and as u32 tensors on
/// the batch's device. Pool rows no sequence uses (the tail of a last page, spare pages) are NaN,
/// and the table's unused entries hold page ids far outside the pool, so a kernel that reads
/// either fails the test. Built by scattering the packed rows, never by the gather under test.
#[derive(Clone, Debug)]
pub struct Paged {
    pub k_pages: Tensor,
    pub v_pages: Tensor,
    pub page_table: Tensor,
    pub seqlens_k: Tensor,
    pub table: Vec<u32>,
    pub page_size: usize,
    pub num_pages: usize,
    pub max_pages: usize,
}

impl Paged {
    /// Pages of `page_size` rows for `vl`'s keys. With `shared > 0`, sequence 1's first `shared`
    /// pages are sequence 0's (a shared prefix): `vl` must hold the same rows there
    /// ([`Varlen::share_prefix`]).
    pub fn from_varlen(
        vl: &Varlen,
        page_size: usize,
        shared: usize,
        rng: &mut Rng,
    ) -> Result<Paged> {
        let b = vl.lens.len();
        let pages_of = |sk: usize| sk.div_ceil(page_size);
        let max_pages = vl.lens.iter().map(|l| pages_of(l.1)).max().unwrap_or(0) + 1;
        // logical pages (sequence, index) that own a physical page; shared ones borrow seq 0's
        let mut owners: Vec<(usize, usize)> = Vec::new();
        for (i, &(_, sk)) in vl.lens.iter().enumerate() {
            let first = if i == 1 { shared } else { 0 };
            owners.extend((first..pages_of(sk)).map(|j| (i, j)));
        }
        let spare = 2;
        let num_pages = owners.len() + spare;
        // a shuffled physical page for every owner
        let mut phys: Vec<usize> = (0..num_pages).collect();
        for i in (1..phys.len()).rev() {
            phys.swap(i, rng.below(i + 1));
        }
        let mut table = vec![u32::MAX - 7; b * max_pages];
        for (n, &(i, j)) in owners.iter().enumerate() {
            table[i * max_pages + j] = phys[n] as u32;
        }
        for j in 0..shared {
            table[max_pages + j] = table[j];
        }
        // pool row -> packed key row (or the NaN row)
        let nan_row = vl.total_k() as u32;
        let mut src = vec![nan_row; num_pages * page_size];
        for (n, &(i, j)) in owners.iter().enumerate() {
            for s in 0..page_size {
                let key = j * page_size + s;
                if key < vl.lens[i].1 {
                    src[phys[n] * page_size + s] = vl.cu_k[i] + key as u32;
                }
            }
        }
        let dev = vl.q.device();
        let (_, hkv) = vl.heads();
        let idx = Tensor::new(src.as_slice(), dev)?;
        // Each pool at its own head dim (k: d_qk, v: d_v).
        let pool = |t: &Tensor| -> Result<Tensor> {
            let d = t.dim(2)?;
            let nan = Tensor::full(f32::NAN, (1, hkv, d), dev)?.to_dtype(t.dtype())?;
            Tensor::cat(&[t, &nan], 0)?
                .index_select(&idx, 0)?
                .reshape((num_pages, page_size, hkv, d))
        };
        let lens: Vec<u32> = vl.lens.iter().map(|l| l.1 as u32).collect();
        Ok(Paged {
            k_pages: pool(&vl.k)?,
            v_pages: pool(&vl.v)?,
            page_table: Tensor::from_vec(table.clone(), (b, max_pages), dev)?,
            seqlens_k: Tensor::new(lens.as_slice(), dev)?,
            table,
            page_size,
            num_pages,
            max_pages,
        })
    }

    /// `attention_paged_varlen_with_lse` of `vl`'s packed queries over this cache.
    pub fn run_varlen(&self, vl: &Varlen, p: &AttnParams) -> Result<(Tensor, Tensor)> {
        flashcore::attention_paged_varlen_with_lse(
            &vl.q,
            &self.k_pages,
            &self.v_pages,
            &self.page_table,
            &self.seqlens_k,
            &vl.cu_q_t,
            vl.max_q,
            p,
        )
    }

    /// `attention_paged_varlen` (O only, the LSE in flashcore's scratch) of `vl`'s packed
    /// queries over this cache.
    pub fn run_varlen_o(&self, vl: &Varlen, p: &AttnParams) -> Result<Tensor> {
        flashcore::attention_paged_varlen(
            &vl.q,
            &self.k_pages,
            &self.v_pages,
            &self.page_table,
            &self.seqlens_k,
            &vl.cu_q_t,
            vl.max_q,
            p,
        )
    }

    /// `attention_paged_with_lse` of `vl`'s queries as a dense `(b, sq, hq, d)` batch (every
    /// sequence must have the same `sq`); O and LSE returned packed like the varlen call's.
    pub fn run_dense(&self, vl: &Varlen, p: &AttnParams) -> Result<(Tensor, Tensor)> {
        let b = vl.lens.len();
        let sq = vl.lens[0].0;
        assert!(
            vl.lens.iter().all(|l| l.0 == sq),
            "dense q needs equal seq_q"
        );
        let (hq, _) = vl.heads();
        let (d, dv) = (vl.head_dim(), vl.v_head_dim());
        let q = vl.q.reshape((b, sq, hq, d))?;
        let (o, lse) = flashcore::attention_paged_with_lse(
            &q,
            &self.k_pages,
            &self.v_pages,
            &self.page_table,
            &self.seqlens_k,
            p,
        )?;
        assert_eq!(o.dims(), &[b, sq, hq, dv], "paged output shape");
        assert_eq!(lse.dims(), &[b, hq, sq], "paged lse shape");
        let lse = lse.transpose(0, 1)?.reshape((hq, b * sq))?;
        Ok((o.reshape((b * sq, hq, dv))?, lse))
    }
}

impl Varlen {
    /// The same batch with sequence 1's first `rows` keys and values replaced by sequence 0's
    /// (a shared prefix; both must have at least `rows` keys).
    pub fn share_prefix(&self, rows: usize) -> Result<Varlen> {
        assert!(self.lens.len() >= 2 && self.lens[0].1 >= rows && self.lens[1].1 >= rows);
        let swap = |t: &Tensor| -> Result<Tensor> {
            let k1 = self.cu_k[1] as usize;
            let parts = [
                t.narrow(0, 0, k1)?,
                t.narrow(0, 0, rows)?,
                t.narrow(0, k1 + rows, self.total_k() - k1 - rows)?,
            ];
            Tensor::cat(&parts, 0)
        };
        let mut out =
            Varlen::from_parts(self.q.clone(), swap(&self.k)?, swap(&self.v)?, &self.lens)?;
        (out.max_q, out.max_k) = (self.max_q, self.max_k);
        Ok(out)
    }
}
