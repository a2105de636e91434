//! The `CustomOp3` over (q, k, v): CPU reference path and CUDA dispatch, for dense and packed
//! (variable-length) batches.

use crate::params::{
    check_cu_seqlens, check_pages, validate, validate_paged, validate_varlen, AttnParams, Keys,
    Problem, Seqs,
};
pub(crate) use crate::params::{Append, Extra, PagedKv};
use crate::reference;
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Storage, Tensor};
use std::sync::{Arc, Mutex};

pub(crate) struct FlashAttn {
    pub problem: Problem,
    pub extra: Extra,
    /// Whether the caller asked for the log-sum-exp: the forward then leaves it in `lse`.
    pub want_lse: bool,
    pub lse: LseSlot,
}

/// Where the attention op's forward leaves its LSE storage for the op that hands it out as a
/// tensor ([`Emit`]). A candle custom op has one output and candle has no view of a storage in
/// another dtype, so O and LSE in one output would cost a copy of the LSE per call: they are two
/// outputs of two ops instead, the storage moved from one to the other without a copy
/// (docs/decisions.md#lse-beside-o). Filled by one forward, emptied by the one `Emit` that follows
/// it.
#[derive(Clone, Default)]
pub(crate) struct LseSlot(Arc<Mutex<Option<Storage>>>);

impl LseSlot {
    fn put(&self, s: Storage) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(s);
    }
    fn take(&self) -> Result<Storage> {
        let s = self.0.lock().unwrap_or_else(|e| e.into_inner()).take();
        s.ok_or_else(|| {
            candle_core::Error::Msg("flashcore: internal: forward produced no lse".into())
        })
    }
}

/// A packed batch's description as the caller gives it.
pub(crate) struct Varlen<'a> {
    pub cu_q: &'a Tensor,
    pub cu_k: &'a Tensor,
    pub max_q: usize,
    pub max_k: usize,
}

/// One sequence of a batch on the CPU: its first query row / key row (packed) or batch index
/// (dense, with the rows at 0), and its lengths.
struct SeqSpan {
    bi: usize,
    q0: usize,
    sq: usize,
    k0: usize,
    sk: usize,
}

impl FlashAttn {
    fn stash_lse(&self, s: Storage) {
        if self.want_lse {
            self.lse.put(s);
        }
    }

    /// The sequences of the batch on the CPU (prefix sums read and checked on the host).
    fn cpu_spans(&self) -> Result<Vec<SeqSpan>> {
        let p = &self.problem;
        match p.seqs {
            Seqs::Dense => Ok((0..p.b)
                .map(|bi| SeqSpan {
                    bi,
                    q0: 0,
                    sq: p.sq,
                    k0: 0,
                    sk: p.sk,
                })
                .collect()),
            Seqs::Varlen { total_q, total_k } => {
                let (Some(cq), Some(ck)) = (&self.extra.cu_q, &self.extra.cu_k) else {
                    candle_core::bail!("flashcore: internal: cu_seqlens missing")
                };
                let cq = check_cu_seqlens(
                    "cu_seqlens_q",
                    "max_seqlen_q",
                    &cq.to_vec1::<u32>()?,
                    total_q,
                    p.sq,
                )?;
                let ck = check_cu_seqlens(
                    "cu_seqlens_k",
                    "max_seqlen_k",
                    &ck.to_vec1::<u32>()?,
                    total_k,
                    p.sk,
                )?;
                Ok((0..p.b)
                    .map(|bi| SeqSpan {
                        bi,
                        q0: cq[bi],
                        sq: cq[bi + 1] - cq[bi],
                        k0: ck[bi],
                        sk: ck[bi + 1] - ck[bi],
                    })
                    .collect())
            }
        }
    }

    fn cpu_typed<T: candle_core::WithDType>(
        &self,
        q: &[T],
        k: &[T],
        v: &[T],
        offsets: [usize; 3],
    ) -> Result<Vec<T>> {
        let p = &self.problem;
        let slopes = match &self.extra.alibi_slopes {
            Some(s) => Some(s.flatten_all()?.to_vec1::<f32>()?),
            None => None,
        };
        let sinks = match &self.extra.sinks {
            Some(s) => Some(s.to_vec1::<f32>()?),
            None => None,
        };
        let sinks = sinks.as_deref();
        let run = |q: &[T], k: &[T], v: &[T], prob: &Problem, slopes: Option<&[f32]>| {
            if T::DTYPE == DType::F64 {
                reference::fused::<T, f64>(q, k, v, prob, slopes, sinks)
            } else {
                reference::fused::<T, f32>(q, k, v, prob, slopes, sinks)
            }
        };
        if p.seqs == Seqs::Dense && !p.alibi_per_batch {
            let (q, k, v) = (&q[offsets[0]..], &k[offsets[1]..], &v[offsets[2]..]);
            let (o, lse) = run(q, k, v, p, slopes.as_deref());
            self.stash_lse(Storage::Cpu(CpuStorage::F32(lse)));
            return Ok(o);
        }
        // One sequence at a time: each is a batch of one at its own offsets and lengths.
        let (total_q, _) = p.totals();
        // Output rows are d_v wide.
        let (hq, d) = (p.hq, p.dv);
        let mut out = vec![T::zero(); total_q * hq * d];
        // (b, hq, sq) or (hq, total_q): every head's rows start at its sink's LSE (-inf without)
        let mut lse = vec![f32::NEG_INFINITY; total_q * hq];
        if let Some(sk) = sinks {
            let per_head = match p.seqs {
                Seqs::Dense => p.sq,
                Seqs::Varlen { .. } => total_q,
            };
            for (i, x) in lse.iter_mut().enumerate() {
                *x = sk[(i / per_head) % hq];
            }
        }
        for s in self.cpu_spans()? {
            // No rows, or no keys: the rows stay zero with LSE -inf, or the sink's (and nothing
            // is read).
            if s.sq == 0 || s.sk == 0 {
                continue;
            }
            let off = |o: usize, st: &[usize; 3], row0: usize| o + s.bi * st[0] + row0 * st[1];
            let sub = Problem {
                b: 1,
                sq: s.sq,
                sk: s.sk,
                ..p.clone()
            };
            let sl = slopes.as_deref().map(|x| {
                if p.alibi_per_batch {
                    &x[s.bi * hq..(s.bi + 1) * hq]
                } else {
                    x
                }
            });
            let (o, l) = run(
                &q[off(offsets[0], &p.q_strides, s.q0)..],
                &k[off(offsets[1], &p.k_strides, s.k0)..],
                &v[off(offsets[2], &p.v_strides, s.k0)..],
                &sub,
                sl,
            );
            // O rows of the sequence are contiguous in both layouts.
            let row0 = match p.seqs {
                Seqs::Dense => s.bi * p.sq,
                Seqs::Varlen { .. } => s.q0,
            };
            out[row0 * hq * d..(row0 + s.sq) * hq * d].copy_from_slice(&o);
            for h in 0..hq {
                let src = &l[h * s.sq..(h + 1) * s.sq];
                let dst = match p.seqs {
                    Seqs::Dense => (s.bi * hq + h) * p.sq,
                    Seqs::Varlen { .. } => h * total_q + s.q0,
                };
                lse[dst..dst + s.sq].copy_from_slice(src);
            }
        }
        self.stash_lse(Storage::Cpu(CpuStorage::F32(lse)));
        Ok(out)
    }
}

impl CustomOp3 for FlashAttn {
    fn name(&self) -> &'static str {
        "flashcore-attention"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let offs = [l1.start_offset(), l2.start_offset(), l3.start_offset()];
        let shape = self.problem.out_shape();
        let out = match (s1, s2, s3) {
            (CpuStorage::F32(q), CpuStorage::F32(k), CpuStorage::F32(v)) => {
                CpuStorage::F32(self.cpu_typed(q, k, v, offs)?)
            }
            (CpuStorage::F64(q), CpuStorage::F64(k), CpuStorage::F64(v)) => {
                CpuStorage::F64(self.cpu_typed(q, k, v, offs)?)
            }
            (CpuStorage::F16(q), CpuStorage::F16(k), CpuStorage::F16(v)) => {
                CpuStorage::F16(self.cpu_typed(q, k, v, offs)?)
            }
            (CpuStorage::BF16(q), CpuStorage::BF16(k), CpuStorage::BF16(v)) => {
                CpuStorage::BF16(self.cpu_typed(q, k, v, offs)?)
            }
            _ => candle_core::bail!(
                "flashcore: q, k, v: dtype must be one of f16, bf16, f32, f64 and agree, got {:?}",
                [s1.dtype(), s2.dtype(), s3.dtype()]
            ),
        };
        Ok((out, shape))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (o, lse) = crate::cuda::forward(
            &self.problem,
            &self.extra,
            (s1, l1),
            (s2, l2),
            (s3, l3),
            self.want_lse,
        )?;
        if let Some(lse) = lse {
            self.stash_lse(Storage::Cuda(lse));
        }
        Ok((o, self.problem.out_shape()))
    }
}

/// A result computed beside the attention op (its LSE, or the answer of an empty batch) handed
/// out as the output of an op over (q, k, v), so that it is recorded for backprop like O: a
/// backward pass through it fails with `BackwardNotSupported` instead of silently giving no
/// gradient.
struct Emit {
    name: &'static str,
    src: EmitSrc,
}

enum EmitSrc {
    /// Storage stashed by the attention op's forward (moved out, no copy).
    Slot(LseSlot, Shape),
    /// A contiguous tensor on q's device (copied).
    Tensor(Tensor),
}

impl Emit {
    fn take(&self) -> Result<(Storage, Shape)> {
        match &self.src {
            EmitSrc::Slot(slot, shape) => Ok((slot.take()?, shape.clone())),
            EmitSrc::Tensor(t) => {
                let (st, l) = t.storage_and_layout();
                let s = match &*st {
                    Storage::Cpu(c) => Storage::Cpu(c.try_clone(l)?),
                    #[cfg(feature = "cuda")]
                    Storage::Cuda(c) => Storage::Cuda(c.try_clone(l)?),
                    _ => candle_core::bail!("flashcore: internal: unexpected storage"),
                };
                Ok((s, t.shape().clone()))
            }
        }
    }
}

impl CustomOp3 for Emit {
    fn name(&self) -> &'static str {
        self.name
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        match self.take()? {
            (Storage::Cpu(c), shape) => Ok((c, shape)),
            _ => candle_core::bail!("flashcore: internal: result not on the cpu"),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        match self.take()? {
            (Storage::Cuda(c), shape) => Ok((c, shape)),
            _ => candle_core::bail!("flashcore: internal: result not on the gpu"),
        }
    }
}

/// `src` as the output of an [`Emit`] op named `name` over (q, k, v).
fn emit(q: &Tensor, k: &Tensor, v: &Tensor, name: &'static str, src: EmitSrc) -> Result<Tensor> {
    q.apply_op3_arc(k, v, Arc::new(Box::new(Emit { name, src })))
}

/// The answer of a batch with no query rows or no keys at all: O zeros, LSE -inf (each head's
/// sink with sinks), both recorded like a computed answer.
fn empty_answer(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    problem: &Problem,
    sinks: Option<&Tensor>,
    want_lse: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    let o = Tensor::zeros(problem.out_shape(), q.dtype(), q.device())?;
    let o = emit(q, k, v, "flashcore-attention", EmitSrc::Tensor(o))?;
    let lse = if want_lse {
        let shape = problem.lse_shape();
        let l = match sinks {
            None => Tensor::full(f32::NEG_INFINITY, shape, q.device())?,
            // (b, hq, sq) or (hq, total_q): the head is dim 1 or dim 0
            Some(s) => {
                let hq = problem.hq;
                let col = match problem.seqs {
                    Seqs::Dense => s.reshape((1, hq, 1))?,
                    Seqs::Varlen { .. } => s.reshape((hq, 1))?,
                };
                col.broadcast_as(shape)?.contiguous()?
            }
        };
        Some(emit(
            q,
            k,
            v,
            "flashcore-attention-lse",
            EmitSrc::Tensor(l),
        )?)
    } else {
        None
    };
    Ok((o, lse))
}

/// (batch, row, head) strides of a dense tensor, or (0, row, head) of a packed one.
fn strides_of(t: &Tensor) -> [usize; 3] {
    let s = t.stride();
    if t.rank() == 4 {
        [s[0], s[1], s[2]]
    } else {
        [0, s[0], s[1]]
    }
}

/// The GPU kernels load 16-byte vectors: a view whose offset or strides are not multiples of 8
/// elements (16 for F8E4M3) is copied to a contiguous tensor first (the only copy flashcore ever
/// makes).
fn aligned(t: &Tensor) -> Result<Tensor> {
    let l = t.layout();
    let rank = t.rank();
    let m = 16 / t.dtype().size_in_bytes().clamp(1, 2);
    if t.device().is_cuda()
        && (!l.start_offset().is_multiple_of(m)
            || l.stride()[..rank - 1].iter().any(|s| !s.is_multiple_of(m)))
    {
        #[cfg(feature = "cuda")]
        if t.dtype() == DType::F8E4M3 {
            // candle has no strided F8E4M3 copy on CUDA
            return crate::cuda::fp8::contiguous(t);
        }
        t.contiguous()
    } else {
        Ok(t.clone())
    }
}

/// Runs the op (recorded for backprop so that a backward pass fails loudly with
/// `BackwardNotSupported`) on a validated problem; returns the output and, if asked, the LSE.
fn apply(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    problem: Problem,
    extra: Extra,
    want_lse: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    let (q, k, v) = (&aligned(q)?, &aligned(k)?, &aligned(v)?);
    let problem = Problem {
        q_strides: strides_of(q),
        k_strides: strides_of(k),
        v_strides: strides_of(v),
        ..problem
    };
    if !q.device().is_cpu() && problem.gpu_pads() {
        return apply_padded(q, k, v, problem, extra, want_lse);
    }
    let lse_shape = problem.lse_shape();
    let slot = LseSlot::default();
    let op = FlashAttn {
        problem,
        extra,
        want_lse,
        lse: slot.clone(),
    };
    let o = q.apply_op3_arc(k, v, Arc::new(Box::new(op)))?;
    let lse = if want_lse {
        let src = EmitSrc::Slot(slot, lse_shape);
        Some(emit(q, k, v, "flashcore-attention-lse", src)?)
    } else {
        None
    };
    Ok((o, lse))
}

/// A problem with `d_v != d_qk` whose GPU kernel takes one head dim for q, k and v
/// ([`Problem::gpu_pads`]: FP8 K/V read by a kernel; `fp8::in_kernel` widens those first, so
/// none arrives today): the narrower side is copied with zero columns up to `D = max(d_qk, d_v)` ([`Problem::padded`]),
/// the `D`-wide problem runs, and the output is narrowed back to its first `d_v` columns. Zero
/// columns of q and k leave every `q . k` as it was, and the scale stays the one resolved from
/// `d_qk`, so the scores, the softmax and the LSE are those of the unpadded problem; zero columns
/// of v give output columns that are zero and dropped. The copies cost bandwidth
/// (docs/decisions.md#separate-v-head-dim).
fn apply_padded(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    problem: Problem,
    extra: Extra,
    want_lse: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    let wide = problem.padded();
    let pad = |t: &Tensor| -> Result<Tensor> {
        let last = t.rank() - 1;
        let d = t.dim(last)?;
        if d == wide.d {
            return Ok(t.clone());
        }
        let mut shape = t.dims().to_vec();
        shape[last] = wide.d - d;
        let zeros = Tensor::zeros(shape, t.dtype(), t.device())?;
        // `cat` of views it cannot copy row by row returns a transposed view: the kernels need
        // the head dim contiguous.
        Tensor::cat(&[t, &zeros], last)?.contiguous()
    };
    let (o, lse) = apply(&pad(q)?, &pad(k)?, &pad(v)?, wide, extra, want_lse)?;
    let last = o.rank() - 1;
    Ok((o.narrow(last, 0, problem.dv)?.contiguous()?, lse))
}

/// Validates a dense batch and runs it.
pub(crate) fn run(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    params: &AttnParams,
    want_lse: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    if let Some((q32, p)) = crate::fp8::fp8_queries(q, k, v, params)? {
        return crate::fp8::restore(run(&q32, k, v, &p, want_lse)?, DType::BF16);
    }
    let kv_scales = crate::fp8::kv_form(k, v, params)?;
    if let Some(s) = kv_scales {
        let sq = q.dims().get(1).copied().unwrap_or(0);
        if !crate::fp8::in_kernel(q, sq, last_dim(q), last_dim(v)) {
            let (q2, k2, v2, p) = crate::fp8::widened(q, k, v, s, params)?;
            return crate::fp8::restore(run(&q2, &k2, &v2, &p, want_lse)?, q.dtype());
        }
    }
    let problem = validate(q, k, v, params)?;
    if problem.chunk.is_some() && !q.device().is_cpu() {
        // No kernel takes a chunk: it runs as pieces (docs/decisions.md#chunked-attention).
        return crate::chunk::dense(q, k, v, &problem, params, want_lse);
    }
    let extra = Extra {
        alibi_slopes: params.alibi_slopes.clone(),
        sinks: params.sinks.clone(),
        kv_scales: kv_scales.cloned(),
        ..Default::default()
    };
    apply(q, k, v, problem, extra, want_lse)
}

/// Validates a packed batch and runs it. Empty batches (no query rows, or no keys at all) are
/// answered without a kernel.
pub(crate) fn run_varlen(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqs: &Varlen,
    params: &AttnParams,
    want_lse: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    if let Some((q32, p)) = crate::fp8::fp8_queries(q, k, v, params)? {
        return crate::fp8::restore(run_varlen(&q32, k, v, seqs, &p, want_lse)?, DType::BF16);
    }
    let kv_scales = crate::fp8::kv_form(k, v, params)?;
    if let Some(s) = kv_scales {
        if !crate::fp8::in_kernel(q, seqs.max_q, last_dim(q), last_dim(v)) {
            let (q2, k2, v2, p) = crate::fp8::widened(q, k, v, s, params)?;
            let r = run_varlen(&q2, &k2, &v2, seqs, &p, want_lse)?;
            return crate::fp8::restore(r, q.dtype());
        }
    }
    let problem = validate_varlen(
        q, k, v, seqs.cu_q, seqs.cu_k, seqs.max_q, seqs.max_k, params,
    )?;
    let (total_q, total_k) = problem.totals();
    if q.device().is_cpu() {
        // The host can check the sums' values for free: do it before anything runs.
        check_cu_seqlens(
            "cu_seqlens_q",
            "max_seqlen_q",
            &seqs.cu_q.to_vec1::<u32>()?,
            total_q,
            problem.sq,
        )?;
        check_cu_seqlens(
            "cu_seqlens_k",
            "max_seqlen_k",
            &seqs.cu_k.to_vec1::<u32>()?,
            total_k,
            problem.sk,
        )?;
    }
    if total_q == 0 || total_k == 0 {
        // Nothing to attend: every row (if any) sees no key.
        return empty_answer(q, k, v, &problem, params.sinks.as_ref(), want_lse);
    }
    if problem.chunk.is_some() && !q.device().is_cpu() {
        return crate::chunk::varlen(q, k, v, seqs, &problem, params, want_lse);
    }
    let extra = Extra {
        alibi_slopes: params.alibi_slopes.clone(),
        sinks: params.sinks.clone(),
        cu_q: Some(seqs.cu_q.clone()),
        cu_k: Some(seqs.cu_k.clone()),
        kv_scales: kv_scales.cloned(),
        ..Default::default()
    };
    apply(q, k, v, problem, extra, want_lse)
}

/// Validates attention over a paged cache and runs it: q dense `(b, sq, hq, d)`, or packed
/// `(total_q, hq, d)` with `packed_q = Some((cu_seqlens_q, max_seqlen_q))`. On the CPU the tables
/// are read and checked on the host and the pages gathered into a packed batch for the reference
/// path; on a GPU the kernels read through the page table (`cuda::forward`).
pub(crate) fn run_paged(
    q: &Tensor,
    kv: &PagedKv,
    packed_q: Option<(&Tensor, usize)>,
    params: &AttnParams,
    want_lse: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    // F8E4M3 pools: on the CPU they stay in e4m3 through the gather below (`run_varlen` then
    // dequantizes only the rows the sequences read); on a GPU a decode kernel reads them, or
    // the slow path widens the sequences' pages (`paged_fp8_widened`).
    if let Some((q32, p)) = crate::fp8::fp8_queries(q, kv.k_pages, kv.v_pages, params)? {
        return crate::fp8::restore(run_paged(&q32, kv, packed_q, &p, want_lse)?, DType::BF16);
    }
    let kv_scales = crate::fp8::kv_form(kv.k_pages, kv.v_pages, params)?;
    let max_q = match packed_q {
        Some((_, m)) => m,
        None => q.dims().get(1).copied().unwrap_or(0),
    };
    if let Some(s) = kv_scales {
        if !q.device().is_cpu()
            && !crate::fp8::in_kernel(q, max_q, last_dim(q), last_dim(kv.v_pages))
        {
            return paged_fp8_widened(q, kv, packed_q, params, s, want_lse);
        }
    }
    let problem = validate_paged(
        q,
        kv.k_pages,
        kv.v_pages,
        kv.page_table,
        kv.seqlens_k,
        packed_q,
        params,
    )?;
    if q.device().is_cpu() {
        return cpu_paged(q, kv, packed_q, &problem, params, want_lse);
    }
    if let Some(answer) = paged_without_rows(q, kv, &problem, params, want_lse) {
        return answer;
    }
    if problem.chunk.is_some() {
        return crate::chunk::paged(q, kv, packed_q, &problem, params, want_lse);
    }
    let extra = Extra {
        alibi_slopes: params.alibi_slopes.clone(),
        sinks: params.sinks.clone(),
        cu_q: packed_q.map(|(c, _)| c.clone()),
        cu_k: None,
        page_table: Some(kv.page_table.clone()),
        seqlens_k: Some(kv.seqlens_k.clone()),
        kv_scales: kv_scales.cloned(),
    };
    apply(q, kv.k_pages, kv.v_pages, problem, extra, want_lse)
}

/// The answer of a paged problem without query rows (no kernel runs), or `None` when it has some.
fn paged_without_rows(
    q: &Tensor,
    kv: &PagedKv,
    problem: &Problem,
    params: &AttnParams,
    want_lse: bool,
) -> Option<Result<(Tensor, Option<Tensor>)>> {
    let (total_q, _) = problem.totals();
    (total_q == 0).then(|| {
        empty_answer(
            q,
            kv.k_pages,
            kv.v_pages,
            problem,
            params.sinks.as_ref(),
            want_lse,
        )
    })
}

/// The last dimension of `t` (its head dim), 0 for a scalar.
fn last_dim(t: &Tensor) -> usize {
    t.dims().last().copied().unwrap_or(0)
}

/// The slow path of F8E4M3 pools on a GPU (problems no FP8 kernel takes, such as chunked
/// prefill; `fp8::in_kernel`): the pages each sequence uses are widened on the device, in one
/// launch for K and V, into temporary pools in q's dtype (one rounding of `stored * scale`, as
/// bf16 K/V have) laid out in sequence order, with the page table renumbered into them
/// (`cuda::fp8::widen_pages`); the problem then runs on those. Pages no sequence reads are not
/// read, and no table is read on the host: a lying page id or length makes that sequence's rows
/// NaN, as with 16-bit pools (docs/decisions.md#device-side-checks). The temporary pools hold
/// `batch * max_pages` pages (the table's width), as the gathered 16-bit path's scratch does;
/// only the used ones are written.
/// A chunk (`AttnParams::chunk`) is split into pieces first (src/chunk.rs, which reads the
/// tables on the host); each piece comes back here without one.
/// docs/decisions.md#fp8-keys-and-values-in-the-decode-kernel.
fn paged_fp8_widened(
    q: &Tensor,
    kv: &PagedKv,
    packed_q: Option<(&Tensor, usize)>,
    params: &AttnParams,
    scales: &crate::KvScales,
    want_lse: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    let problem = validate_paged(
        q,
        kv.k_pages,
        kv.v_pages,
        kv.page_table,
        kv.seqlens_k,
        packed_q,
        params,
    )?;
    if problem.chunk.is_some() {
        return crate::chunk::paged(q, kv, packed_q, &problem, params, want_lse);
    }
    if let Some(answer) = paged_without_rows(q, kv, &problem, params, want_lse) {
        return answer;
    }
    #[cfg(feature = "cuda")]
    {
        let (k, v, page_table) = crate::cuda::fp8::widen_pages(kv, scales, q.dtype())?;
        let wide = PagedKv {
            k_pages: &k,
            v_pages: &v,
            page_table: &page_table,
            seqlens_k: kv.seqlens_k,
        };
        let p = AttnParams {
            kv_scales: None,
            ..params.clone()
        };
        run_paged(q, &wide, packed_q, &p, want_lse)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = scales;
        candle_core::bail!(
            "flashcore: q: FP8 pools on a {:?} device need the `cuda` feature",
            q.device().location()
        )
    }
}

/// A paged problem's page table and lengths read back to the host and checked there (errors
/// name the argument), with the pool geometry they index.
struct HostPages {
    table: Vec<u32>,
    lens: Vec<usize>,
    page_size: usize,
    num_pages: usize,
    max_pages: usize,
}

fn host_pages(kv: &PagedKv, problem: &Problem) -> Result<HostPages> {
    let Keys::Paged {
        page_size,
        num_pages,
        max_pages,
    } = problem.keys
    else {
        candle_core::bail!("flashcore: internal: paged problem without pages")
    };
    let table = kv.page_table.flatten_all()?.to_vec1::<u32>()?;
    let lens = check_pages(
        &table,
        &kv.seqlens_k.to_vec1::<u32>()?,
        page_size,
        num_pages,
        max_pages,
    )?;
    Ok(HostPages {
        table,
        lens,
        page_size,
        num_pages,
        max_pages,
    })
}

/// The CPU path of [`run_paged`]: every table value checked on the host (errors name the
/// argument), each sequence's keys gathered from its pages into a packed batch, and the packed
/// reference path run on it (dense q goes through it as `b` sequences of `sq` rows).
fn cpu_paged(
    q: &Tensor,
    kv: &PagedKv,
    packed_q: Option<(&Tensor, usize)>,
    problem: &Problem,
    params: &AttnParams,
    want_lse: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    let HostPages {
        table,
        lens,
        page_size,
        num_pages,
        max_pages,
    } = host_pages(kv, problem)?;
    let mut rows: Vec<u32> = Vec::with_capacity(lens.iter().sum());
    for (i, &len) in lens.iter().enumerate() {
        rows.extend((0..len).map(|j| {
            let page = table[i * max_pages + j / page_size] as usize;
            (page * page_size + j % page_size) as u32
        }));
    }
    let (hkv, d, dv) = (problem.hkv, problem.d, problem.dv);
    let gather = |pool: &Tensor| -> Result<Tensor> {
        // The K pool is d_qk wide, the V pool d_v.
        let width = pool.dim(3)?;
        let flat = pool.reshape((num_pages * page_size, hkv, width))?;
        if rows.is_empty() {
            return flat.narrow(0, 0, 0);
        }
        flat.index_select(&Tensor::new(rows.as_slice(), q.device())?, 0)
    };
    let (k, v) = (gather(kv.k_pages)?, gather(kv.v_pages)?);
    let cu_k = Tensor::new(
        crate::params::prefix_sums(lens.iter().copied()).as_slice(),
        q.device(),
    )?;
    let max_k = lens.iter().copied().max().unwrap_or(0);
    match packed_q {
        Some((cu_q, max_q)) => {
            let seqs = Varlen {
                cu_q,
                cu_k: &cu_k,
                max_q,
                max_k,
            };
            run_varlen(q, &k, &v, &seqs, params, want_lse)
        }
        None => {
            let (b, sq, hq) = (problem.b, problem.sq, problem.hq);
            let qp = q.reshape((b * sq, hq, d))?;
            let cu_q = Tensor::new(
                crate::params::prefix_sums(std::iter::repeat_n(sq, b)).as_slice(),
                q.device(),
            )?;
            let seqs = Varlen {
                cu_q: &cu_q,
                cu_k: &cu_k,
                max_q: sq,
                max_k,
            };
            let (o, lse) = run_varlen(&qp, &k, &v, &seqs, params, want_lse)?;
            let o = o.reshape((b, sq, hq, dv))?;
            let lse = lse
                .map(|l| l.reshape((hq, b, sq))?.transpose(0, 1)?.contiguous())
                .transpose()?;
            Ok((o, lse))
        }
    }
}

/// New K or V rows written into a paged pool in place (`append_kv_paged`): the pool is the
/// in-place destination, the new rows the source; the tables travel beside.
pub(crate) struct AppendOp<'a> {
    pub name: &'static str,
    /// The rows, their tables and the pool's geometry (`d`: this pool's head dim).
    pub rows: Append<'a>,
    /// On the CPU: the pool row of every new row, checked on the host before anything is written
    /// ([`AppendOp::host_slots`]).
    pub slots: Option<Vec<usize>>,
}

impl AppendOp<'_> {
    /// (sequence, row within its new rows) of every new row, on the host.
    fn host_rows(&self) -> Result<Vec<(usize, usize)>> {
        match self.rows.cu_new {
            None => {
                let n = self.rows.total / self.rows.b.max(1);
                Ok((0..self.rows.total).map(|r| (r / n, r % n)).collect())
            }
            Some(cu) => {
                let cu = check_cu_seqlens(
                    "cu_seqlens_new",
                    "cu_seqlens_new",
                    &cu.to_vec1::<u32>()?,
                    self.rows.total,
                    usize::MAX,
                )?;
                let mut rows = Vec::with_capacity(self.rows.total);
                for i in 0..self.rows.b {
                    rows.extend((0..cu[i + 1] - cu[i]).map(|j| (i, j)));
                }
                Ok(rows)
            }
        }
    }

    /// Pool row (page * page_size + slot) of every new row, every value checked on the host:
    /// positions within the table, pages within the pool, and no two new rows writing the same
    /// pool row.
    fn host_slots(&self) -> Result<Vec<usize>> {
        let table = self.rows.page_table.flatten_all()?.to_vec1::<u32>()?;
        let pos = self.rows.positions.to_vec1::<u32>()?;
        let cap = self.rows.max_pages * self.rows.page_size;
        self.host_rows()?
            .into_iter()
            .map(|(i, j)| {
                let at = pos[i] as usize + j;
                if at >= cap {
                    return Err(candle_core::Error::Msg(format!(
                        "flashcore: positions: sequence {i} writes position {at} (positions[{i}] = {} + row {j}), beyond the page table's max_pages ({}) * page_size ({}) = {cap}",
                        pos[i], self.rows.max_pages, self.rows.page_size
                    )));
                }
                let page = table[i * self.rows.max_pages + at / self.rows.page_size] as usize;
                if page >= self.rows.num_pages {
                    return Err(candle_core::Error::Msg(format!(
                        "flashcore: page_table: every page written must be a page of the pool (0..{}), got entry [{i}][{}] = {page}",
                        self.rows.num_pages,
                        at / self.rows.page_size
                    )));
                }
                Ok(page * self.rows.page_size + at % self.rows.page_size)
            })
            .collect::<Result<Vec<usize>>>()
            .and_then(|slots| self.check_distinct(slots))
    }

    /// Two new rows writing the same pool row would make the result depend on the order of the
    /// writes: an error naming both.
    fn check_distinct(&self, slots: Vec<usize>) -> Result<Vec<usize>> {
        let mut owner = std::collections::HashMap::with_capacity(slots.len());
        let rows = self.host_rows()?;
        for (r, &slot) in slots.iter().enumerate() {
            if let Some(&first) = owner.get(&slot) {
                let ((i0, j0), (i1, j1)) = (rows[first], rows[r]);
                return Err(candle_core::Error::Msg(format!(
                    "flashcore: page_table: every new row must go to its own pool row, got sequence {i0} row {j0} and sequence {i1} row {j1} both at page {} row {} (check page_table and positions)",
                    slot / self.rows.page_size,
                    slot % self.rows.page_size
                )));
            }
            owner.insert(slot, r);
        }
        Ok(slots)
    }

    fn cpu_typed<T: Copy>(
        &self,
        pool: &mut [T],
        pl: &Layout,
        src: &[T],
        sl: &Layout,
    ) -> Result<()> {
        let slots = match &self.slots {
            Some(s) => s.clone(),
            None => self.host_slots()?,
        };
        let rows = self.host_rows()?;
        let ps = pl.stride();
        let ss = sl.stride();
        let (s_b, s_r, s_h) = if self.rows.cu_new.is_some() {
            (0, ss[0], ss[1])
        } else {
            (ss[0], ss[1], ss[2])
        };
        for (r, (&slot, &(i, j))) in slots.iter().zip(&rows).enumerate() {
            let (page, at) = (slot / self.rows.page_size, slot % self.rows.page_size);
            let s_row = if self.rows.cu_new.is_some() {
                r * s_r
            } else {
                i * s_b + j * s_r
            };
            for h in 0..self.rows.hkv {
                let dst = pl.start_offset() + page * ps[0] + at * ps[1] + h * ps[2];
                let s0 = sl.start_offset() + s_row + h * s_h;
                pool[dst..dst + self.rows.d].copy_from_slice(&src[s0..s0 + self.rows.d]);
            }
        }
        Ok(())
    }
}

impl candle_core::InplaceOp2 for AppendOp<'_> {
    fn name(&self) -> &'static str {
        "flashcore-append-kv-paged"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<()> {
        match (s1, s2) {
            (CpuStorage::F32(d), CpuStorage::F32(s)) => self.cpu_typed(d, l1, s, l2),
            (CpuStorage::F64(d), CpuStorage::F64(s)) => self.cpu_typed(d, l1, s, l2),
            (CpuStorage::F16(d), CpuStorage::F16(s)) => self.cpu_typed(d, l1, s, l2),
            (CpuStorage::BF16(d), CpuStorage::BF16(s)) => self.cpu_typed(d, l1, s, l2),
            (CpuStorage::F8E4M3(d), CpuStorage::F8E4M3(s)) => self.cpu_typed(d, l1, s, l2),
            (d, s) => candle_core::bail!(
                "flashcore: {}: dtype must be f16, bf16, f32 or f64 and match the new rows, got {:?} and {:?}",
                self.name,
                d.dtype(),
                s.dtype()
            ),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &mut candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<()> {
        crate::cuda::append_paged((s1, l1), (s2, l2), &self.rows, self.name)
    }
}

/// Validates and runs `append_kv_paged` (`cu_new = None`: k_new / v_new `(b, n_new, hkv, d)`) or
/// its packed twin (`(total, hkv, d)` with prefix sums `(b + 1,)`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn append_kv_paged(
    k_new: &Tensor,
    v_new: &Tensor,
    k_pages: &Tensor,
    v_pages: &Tensor,
    page_table: &Tensor,
    positions: &Tensor,
    cu_new: Option<&Tensor>,
    scales: Option<&crate::KvScales>,
) -> Result<()> {
    let (k_q, v_q);
    let (k_new, v_new) = match crate::fp8::append_form(k_new, k_pages, v_pages, scales)? {
        None => (k_new, v_new),
        Some(s) => {
            k_q = crate::fp8::quantize(k_new, &s.k)?;
            v_q = crate::fp8::quantize(v_new, &s.v)?;
            (&k_q, &v_q)
        }
    };
    let g = crate::params::validate_append(
        k_new, v_new, k_pages, v_pages, page_table, positions, cu_new,
    )?;
    check_no_alias(k_new, v_new, k_pages, v_pages)?;
    let mut op = AppendOp {
        name: "k_pages",
        rows: Append {
            page_table,
            positions,
            cu_new,
            b: g.b,
            total: g.total,
            hkv: g.hkv,
            d: g.d,
            page_size: g.page_size,
            num_pages: g.num_pages,
            max_pages: g.max_pages,
        },
        slots: None,
    };
    if k_pages.device().is_cpu() {
        // Every table value checked before either pool is written.
        op.slots = Some(op.host_slots()?);
    }
    // Each pool at its own head dim (d_qk for K, d_v for V).
    for (name, new, pool, d) in [
        ("k_pages", k_new, k_pages, g.d),
        ("v_pages", v_new, v_pages, g.dv),
    ] {
        let new = aligned(new)?;
        let op = AppendOp {
            name,
            rows: Append { d, ..op.rows },
            slots: op.slots.clone(),
        };
        pool.inplace_op2(&new, &op)?;
    }
    Ok(())
}

/// Address of the storage behind `t` (views of one tensor share it).
fn storage_addr(t: &Tensor) -> usize {
    let (s, _) = t.storage_and_layout();
    &*s as *const Storage as usize
}

/// The pools are written in place from the new rows: `k_pages` and `v_pages` must be different
/// storages, and neither may be the storage of `k_new` or `v_new` (checked before anything is
/// written).
fn check_no_alias(
    k_new: &Tensor,
    v_new: &Tensor,
    k_pages: &Tensor,
    v_pages: &Tensor,
) -> Result<()> {
    let (kp, vp) = (storage_addr(k_pages), storage_addr(v_pages));
    if kp == vp {
        candle_core::bail!(
            "flashcore: v_pages: must not share storage with k_pages (the two pools are written separately), got views of one tensor"
        )
    }
    for (name, t) in [("k_new", k_new), ("v_new", v_new)] {
        let a = storage_addr(t);
        for (pool, p) in [("k_pages", kp), ("v_pages", vp)] {
            if a == p {
                candle_core::bail!(
                    "flashcore: {name}: must not share storage with {pool} (the pool is written in place), got a view of {pool}"
                )
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Mask;
    use candle_core::Device;

    fn max_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
        (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()
    }

    /// What a GPU does with `d_v != d_qk` (zero padding to `max(d_qk, d_v)`, the padded problem,
    /// the output narrowed back to `d_v`), run on the CPU path so that it is checked without a
    /// GPU: the same O (to rounding) and LSE as the unpadded problem, default scale
    /// `1 / sqrt(d_qk)` kept, dense and packed, with sinks and ALiBi.
    #[test]
    fn padded_problem_equals_unpadded() -> Result<()> {
        let dev = Device::Cpu;
        for (d, dv) in [(192, 128), (64, 128), (40, 24)] {
            let (hq, hkv) = (4, 2);
            // Strided views: q a narrow of wider heads, k transposed in storage, v narrowed.
            let q = Tensor::randn(0f32, 1., (2, 37, hq + 1, d), &dev)?.narrow(2, 1, hq)?;
            let k = Tensor::randn(0f32, 1., (2, hkv, 50, d), &dev)?.transpose(1, 2)?;
            let v = Tensor::randn(0f32, 1., (2, 50, hkv + 1, dv), &dev)?.narrow(2, 0, hkv)?;
            let p = AttnParams {
                mask: Mask::Causal,
                sinks: Some(Tensor::new(&[0.5f32, -1.0, 2.0, 0.0], &dev)?),
                alibi_slopes: Some(Tensor::new(&[0.1f32, 0.2, 0.3, 0.4], &dev)?),
                ..Default::default()
            };
            let extra = Extra {
                alibi_slopes: p.alibi_slopes.clone(),
                sinks: p.sinks.clone(),
                ..Default::default()
            };
            let (o, l) = run(&q, &k, &v, &p, true)?;
            let prob = validate(&q, &k, &v, &p)?;
            let (po, pl) = apply_padded(&q, &k, &v, prob, extra.clone(), true)?;
            assert_eq!(po.dims(), o.dims());
            let (eo, el) = (max_diff(&o, &po)?, max_diff(&l.unwrap(), &pl.unwrap())?);
            assert!(eo < 1e-5 && el < 1e-5, "dense d{d}/{dv}: O {eo}, LSE {el}");

            // Packed: sequences of 37 and 20 query rows, 50 and 9 keys; k transposed in storage.
            let qp = q.contiguous()?.reshape((74, hq, d))?.narrow(0, 0, 57)?;
            let kp = Tensor::randn(0f32, 1., (hkv, 59, d), &dev)?.transpose(0, 1)?;
            let vp = v.contiguous()?.reshape((100, hkv, dv))?.narrow(0, 0, 59)?;
            let cu_q = Tensor::new(&[0u32, 37, 57], &dev)?;
            let cu_k = Tensor::new(&[0u32, 50, 59], &dev)?;
            let seqs = Varlen {
                cu_q: &cu_q,
                cu_k: &cu_k,
                max_q: 37,
                max_k: 50,
            };
            let (o, l) = run_varlen(&qp, &kp, &vp, &seqs, &p, true)?;
            let prob = validate_varlen(&qp, &kp, &vp, &cu_q, &cu_k, 37, 50, &p)?;
            let extra = Extra {
                cu_q: Some(cu_q.clone()),
                cu_k: Some(cu_k.clone()),
                ..extra
            };
            let (po, pl) = apply_padded(&qp, &kp, &vp, prob, extra, true)?;
            assert_eq!(po.dims(), &[57, hq, dv]);
            let (eo, el) = (max_diff(&o, &po)?, max_diff(&l.unwrap(), &pl.unwrap())?);
            assert!(eo < 1e-5 && el < 1e-5, "packed d{d}/{dv}: O {eo}, LSE {el}");
        }
        Ok(())
    }
}
