//! # candle-flash-attn (flashcore edition)
//!
//! A drop-in replacement for [candle-flash-attn 0.11.1](https://crates.io/crates/candle-flash-attn)
//! backed by flashcore (this repository): every public function of that crate, with the same
//! signature and the same meaning, computed by flashcore's kernels (CUDA, with the `cuda`
//! feature, on by default as the original always builds its kernels) or by its CPU path (CPU
//! tensors). Substitute it for the crates.io crate with `[patch.crates-io]`; see this crate's
//! README for every place where the behaviour differs (all of them supersets or explicit
//! errors).
//!
//! ## How the arguments are translated
//! - `causal: bool` is `window_size_left = None, window_size_right = Some(0)`, as in the
//!   original, which is flashcore's [`flashcore::Mask::Causal`] (bottom-right aligned, like
//!   FlashAttention >= 2.1).
//! - Windows follow the original's host code exactly: a side that is `None` **or larger than
//!   `seqlen_k`** (`max_seqlen_k` for the varlen functions) is "unbounded" (`-1`); then, as in
//!   FlashAttention 2, when exactly one side is bounded the other becomes `seqlen_k`. A left side
//!   of `seqlen_k` is the same as unbounded (row `i` would start at `i - seqlen_q < 0`), so it
//!   maps to `None`; a right side of `seqlen_k` is kept as `Some(seqlen_k)`, which differs from
//!   unbounded only when `seqlen_q > seqlen_k + 1` (FlashAttention 2 then hides the keys past
//!   `i + 2 seqlen_k - seqlen_q`, and so does this crate). See [`window_mask`].
//! - `softcap: f32` (or `Option<f32>`) is applied when `> 0.0`, as in FlashAttention 2's
//!   `if (softcap > 0.0)`; `0.0` (or any value that is not `> 0`) means no softcap.
//! - ALiBi slopes are f32 `(num_heads_q,)`; flashcore also accepts `(batch, num_heads_q)`.
//!
//! ## Rules every function shares
//! - Dtypes: f16 or bf16 on a GPU; on the CPU also f32 and f64. `q`, `k` and `v` share one dtype
//!   and one device; the output has `q`'s dtype.
//! - Grouped-query and multi-query attention: `k` and `v` may have fewer heads than `q`, and the
//!   query head count must be a multiple of the K/V head count. Query head `h` reads K/V head
//!   `h / (heads_q / heads_kv)`; nothing is repeated in memory.
//! - Head dims: any multiple of 8 up to 512, as the original; `q` and `k` share one, and `v`
//!   (with the output) may have its own (a superset of the original, which needs one head dim
//!   for all three; flashcore's docs: "Head dims"). flashcore's GPU kernels stop at
//!   [`flashcore::GPU_MAX_HEAD_DIM`]: a CUDA call past it runs a slower path composed of candle
//!   ops on the GPU instead (the README's "Head dims above 256 on a GPU").
//! - Inputs may be strided views as long as the last dimension is contiguous.
//! - A query row that sees no key (a causal mask with `seqlen_q > seqlen_k`) returns zeros.
//! - Bad arguments return an error that names the argument, the rule and the value.

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::op::BackpropOp;
use candle_core::DType;
use candle_core::{CpuStorage, Layout, Result, Shape, Storage, Tensor};
use flashcore::{AttnParams, Mask};

mod slow;

/// The slow path of CUDA calls past flashcore's GPU head dims, callable on any device. Public
/// only so that this crate's tests can run it on CPU tensors (where the functions above use
/// flashcore's CPU path); not part of candle-flash-attn's API.
#[doc(hidden)]
pub mod slow_path {
    use super::*;

    /// Score elements per block of query rows (default 2^26); the result must not depend on it.
    pub fn set_block_elems(n: usize) {
        slow::set_block_elems(n)
    }

    /// [`flash_attn_alibi_windowed_softcap`]'s arguments, through the slow path.
    #[allow(clippy::too_many_arguments)]
    pub fn dense(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        alibi_slopes: Option<&Tensor>,
        softmax_scale: f32,
        window_size_left: Option<usize>,
        window_size_right: Option<usize>,
        softcap: f32,
    ) -> Result<Tensor> {
        let mask = window_mask(window_size_left, window_size_right, dense_seqlen_k(k));
        let o = slow::Opts {
            mask,
            scale: softmax_scale,
            softcap: softcap_of(Some(softcap)),
        };
        slow::dense("slow_path::dense", q, k, v, alibi_slopes, &o)
    }

    /// [`flash_attn_varlen_alibi_windowed_softcap`]'s arguments, through the slow path.
    #[allow(clippy::too_many_arguments)]
    pub fn varlen(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        alibi_slopes: Option<&Tensor>,
        seqlens_q: &Tensor,
        seqlens_k: &Tensor,
        max_seqlen_q: usize,
        max_seqlen_k: usize,
        softmax_scale: f32,
        window_size_left: Option<usize>,
        window_size_right: Option<usize>,
        softcap: f32,
    ) -> Result<Tensor> {
        let o = slow::Opts {
            mask: window_mask(window_size_left, window_size_right, max_seqlen_k),
            scale: softmax_scale,
            softcap: softcap_of(Some(softcap)),
        };
        slow::varlen(
            "slow_path::varlen",
            q,
            k,
            v,
            alibi_slopes,
            seqlens_q,
            seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            &o,
        )
    }

    /// [`flash_attn_varlen_paged_windowed`]'s arguments, through the slow path.
    #[allow(clippy::too_many_arguments)]
    pub fn paged(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        seqlens_q: &Tensor,
        seqlens_k: &Tensor,
        block_table: &Tensor,
        mm_prefix_ranges: Option<&Tensor>,
        max_seqlen_q: usize,
        max_seqlen_k: usize,
        softmax_scale: f32,
        window_size_left: Option<usize>,
        window_size_right: Option<usize>,
        softcap: Option<f32>,
    ) -> Result<Tensor> {
        let o = slow::Opts {
            mask: window_mask(window_size_left, window_size_right, max_seqlen_k),
            scale: softmax_scale,
            softcap: softcap_of(softcap),
        };
        paged_slow(
            "slow_path::paged",
            q,
            k,
            v,
            seqlens_q,
            seqlens_k,
            block_table,
            mm_prefix_ranges,
            max_seqlen_q,
            &o,
        )
    }
}

/// The mask that candle-flash-attn 0.11.1 applies for `window_size_left` /
/// `window_size_right` when the keys are `seqlen_k` long (the dense functions pass `k`'s
/// sequence length, the varlen ones `max_seqlen_k`).
///
/// The original turns each side into an `i32`: `-1` when it is `None` or larger than
/// `seqlen_k`, else the value. `(-1, 0)` is causal. Then FlashAttention 2 sets a `-1` side to
/// `seqlen_k` when the other side is `>= 0`. Its kernels let query row `i` see key `j` iff
/// `i + sk - sq - left <= j <= i + sk - sq + right`, which is [`Mask::Window`]'s rule.
pub fn window_mask(
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
    seqlen_k: usize,
) -> Mask {
    let left = window_size_left.filter(|&w| w <= seqlen_k);
    let right = window_size_right.filter(|&w| w <= seqlen_k);
    match (left, right) {
        (None, None) => Mask::None,
        (None, Some(0)) => Mask::Causal,
        // FA2 sets left = seqlen_k here: j >= i - seqlen_q, always true, i.e. unbounded.
        (None, Some(r)) => Mask::Window {
            left: None,
            right: Some(r),
        },
        // FA2 sets right = seqlen_k here; kept literally (not always the same as unbounded).
        (Some(l), None) => Mask::Window {
            left: Some(l),
            right: Some(seqlen_k),
        },
        (Some(l), Some(r)) => Mask::Window {
            left: Some(l),
            right: Some(r),
        },
    }
}

/// FlashAttention 2 applies a softcap iff it is `> 0.0`.
fn softcap_of(softcap: Option<f32>) -> Option<f32> {
    softcap.filter(|&c| c > 0.0)
}

/// CUDA tensors reach flashcore's kernels only when this crate's `cuda` feature is on; without
/// it candle would answer with a generic "no cuda implementation" error, so say what to do.
fn check_device(q: &Tensor, function: &str) -> Result<()> {
    if q.device().is_cuda() && !cfg!(feature = "cuda") {
        candle_core::bail!(
            "candle-flash-attn (flashcore): {function}: q is on a CUDA device but this crate was \
             built without its `cuda` feature (on by default; turned off here by \
             `--no-default-features` or `default-features = false`)"
        )
    }
    Ok(())
}

/// The slow path's options from flashcore's (scale given, softcap already `> 0` or none).
fn slow_opts(p: &AttnParams) -> slow::Opts {
    slow::Opts {
        mask: p.mask,
        scale: p.softmax_scale.unwrap_or(1.0),
        softcap: p.softcap,
    }
}

/// `k`'s sequence length for a dense call, 0 when `k` is not rank 4 (flashcore then rejects
/// the rank with a message naming `k`).
fn dense_seqlen_k(k: &Tensor) -> usize {
    if k.rank() == 4 {
        k.dims()[1]
    } else {
        0
    }
}

#[allow(clippy::too_many_arguments)]
fn dense(
    function: &str,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: Option<&Tensor>,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
    softcap: Option<f32>,
) -> Result<Tensor> {
    check_device(q, function)?;
    let params = AttnParams {
        softmax_scale: Some(softmax_scale),
        mask: window_mask(window_size_left, window_size_right, dense_seqlen_k(k)),
        softcap: softcap_of(softcap),
        alibi_slopes: alibi_slopes.cloned(),
        ..Default::default()
    };
    if slow::wanted(q, v) {
        return slow::dense(function, q, k, v, alibi_slopes, &slow_opts(&params));
    }
    flashcore::attention(q, k, v, &params)
}

#[allow(clippy::too_many_arguments)]
fn varlen(
    function: &str,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: Option<&Tensor>,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
    softcap: Option<f32>,
) -> Result<Tensor> {
    check_device(q, function)?;
    let params = AttnParams {
        softmax_scale: Some(softmax_scale),
        mask: window_mask(window_size_left, window_size_right, max_seqlen_k),
        softcap: softcap_of(softcap),
        alibi_slopes: alibi_slopes.cloned(),
        ..Default::default()
    };
    if slow::wanted(q, v) {
        return slow::varlen(
            function,
            q,
            k,
            v,
            alibi_slopes,
            seqlens_q,
            seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            &slow_opts(&params),
        );
    }
    flashcore::attention_varlen(
        q,
        k,
        v,
        seqlens_q,
        seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        &params,
    )
}

/// The original's custom op, with the same public fields. Applying it with
/// `q.apply_op3(k, v, FlashAttn { .. })` runs flashcore on copies of the inputs (the op's
/// storages are copied into fresh tensors and the output copied back); the functions below call
/// flashcore directly and copy nothing.
pub struct FlashAttn {
    pub softmax_scale: f32,
    pub alibi_slopes: Option<Tensor>,
    pub window_size_left: Option<usize>,
    pub window_size_right: Option<usize>,
    pub softcap: Option<f32>,
}

impl FlashAttn {
    fn forward(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        dense(
            "FlashAttn",
            q,
            k,
            v,
            self.alibi_slopes.as_ref(),
            self.softmax_scale,
            self.window_size_left,
            self.window_size_right,
            self.softcap,
        )
    }
}

/// A contiguous copy of the view `l` of storage `s`.
fn copy_view<S>(s: &S, l: &Layout) -> Result<S>
where
    S: BackendStorage,
    S::Device: BackendDevice<Storage = S>,
{
    let mut dst = s.device().zeros_impl(l.shape(), s.dtype())?;
    s.copy_strided_src(&mut dst, 0, l)?;
    Ok(dst)
}

/// A fresh tensor holding the view `l` of storage `s`.
fn tensor_of<S>(s: &S, l: &Layout, wrap: fn(S) -> Storage) -> Result<Tensor>
where
    S: BackendStorage,
    S::Device: BackendDevice<Storage = S>,
{
    Ok(Tensor::from_storage(
        wrap(copy_view(s, l)?),
        l.shape().clone(),
        BackpropOp::none(),
        false,
    ))
}

impl candle_core::CustomOp3 for FlashAttn {
    fn name(&self) -> &'static str {
        "flash-attn"
    }

    fn cpu_fwd(
        &self,
        q: &CpuStorage,
        q_l: &Layout,
        k: &CpuStorage,
        k_l: &Layout,
        v: &CpuStorage,
        v_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let o = self.forward(
            &tensor_of(q, q_l, Storage::Cpu)?,
            &tensor_of(k, k_l, Storage::Cpu)?,
            &tensor_of(v, v_l, Storage::Cpu)?,
        )?;
        let (s, l) = o.storage_and_layout();
        match &*s {
            Storage::Cpu(c) => Ok((copy_view(c, l)?, l.shape().clone())),
            _ => {
                candle_core::bail!("candle-flash-attn (flashcore): FlashAttn: output left the CPU")
            }
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        q: &candle_core::CudaStorage,
        q_l: &Layout,
        k: &candle_core::CudaStorage,
        k_l: &Layout,
        v: &candle_core::CudaStorage,
        v_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let o = self.forward(
            &tensor_of(q, q_l, Storage::Cuda)?,
            &tensor_of(k, k_l, Storage::Cuda)?,
            &tensor_of(v, v_l, Storage::Cuda)?,
        )?;
        let (s, l) = o.storage_and_layout();
        match &*s {
            Storage::Cuda(c) => Ok((copy_view(c, l)?, l.shape().clone())),
            _ => {
                candle_core::bail!("candle-flash-attn (flashcore): FlashAttn: output left the GPU")
            }
        }
    }
}

/// Attention over a dense batch: `softmax(softmax_scale · q kᵀ) v` for every query head, without
/// materialising the scores.
///
/// `q` is `(batch, seqlen_q, heads_q, head_dim)`, `k` and `v` are `(batch, seqlen_k, heads_kv,
/// head_dim)` (see the crate docs for dtypes, strides and the GQA rule); the result has `q`'s shape
/// and dtype.
///
/// `softmax_scale` multiplies every score `q · k` before the softmax (usually
/// `1 / sqrt(head_dim)`).
///
/// `causal` hides from query row `i` every key after position `i + seqlen_k - seqlen_q` (the
/// bottom-right aligned causal mask).
pub fn flash_attn(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    let window_size_right = if causal { Some(0) } else { None };
    dense(
        "flash_attn",
        q,
        k,
        v,
        None,
        softmax_scale,
        None,
        window_size_right,
        None,
    )
}

/// Attention over a dense batch with a sliding window (`flash_attn` with a band mask).
///
/// `q` is `(batch, seqlen_q, heads_q, head_dim)`, `k` and `v` are `(batch, seqlen_k, heads_kv,
/// head_dim)` (see the crate docs for dtypes, strides and the GQA rule); the result has `q`'s shape
/// and dtype.
///
/// `softmax_scale` multiplies every score `q · k` before the softmax (usually
/// `1 / sqrt(head_dim)`).
///
/// `window_size_left` / `window_size_right` bound how many keys before / after query row `i`'s
/// diagonal position (`i + seqlen_k - seqlen_q`) it may see; `None` leaves that side open, and
/// `(None, Some(0))` is the causal mask. How large or one-sided windows are read: [`window_mask`].
pub fn flash_attn_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    dense(
        "flash_attn_windowed",
        q,
        k,
        v,
        None,
        softmax_scale,
        window_size_left,
        window_size_right,
        None,
    )
}

/// Attention over a dense batch with ALiBi position biases.
///
/// `q` is `(batch, seqlen_q, heads_q, head_dim)`, `k` and `v` are `(batch, seqlen_k, heads_kv,
/// head_dim)` (see the crate docs for dtypes, strides and the GQA rule); the result has `q`'s shape
/// and dtype.
///
/// `alibi_slopes`: f32, one slope per query head, `(heads_q,)` (or `(batch, heads_q)`); each score
/// gets `-slope · |j - (i + seqlen_k - seqlen_q)|` added before the mask.
///
/// `softmax_scale` multiplies every score `q · k` before the softmax (usually
/// `1 / sqrt(head_dim)`).
///
/// `causal` hides from query row `i` every key after position `i + seqlen_k - seqlen_q` (the
/// bottom-right aligned causal mask).
pub fn flash_attn_alibi(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: &Tensor,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    let window_size_right = if causal { Some(0) } else { None };
    dense(
        "flash_attn_alibi",
        q,
        k,
        v,
        Some(alibi_slopes),
        softmax_scale,
        None,
        window_size_right,
        None,
    )
}

/// Attention over a dense batch with ALiBi position biases and a sliding window.
///
/// `q` is `(batch, seqlen_q, heads_q, head_dim)`, `k` and `v` are `(batch, seqlen_k, heads_kv,
/// head_dim)` (see the crate docs for dtypes, strides and the GQA rule); the result has `q`'s shape
/// and dtype.
///
/// `alibi_slopes`: f32, one slope per query head, `(heads_q,)` (or `(batch, heads_q)`); each score
/// gets `-slope · |j - (i + seqlen_k - seqlen_q)|` added before the mask.
///
/// `softmax_scale` multiplies every score `q · k` before the softmax (usually
/// `1 / sqrt(head_dim)`).
///
/// `window_size_left` / `window_size_right` bound how many keys before / after query row `i`'s
/// diagonal position (`i + seqlen_k - seqlen_q`) it may see; `None` leaves that side open, and
/// `(None, Some(0))` is the causal mask. How large or one-sided windows are read: [`window_mask`].
pub fn flash_attn_alibi_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: &Tensor,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    dense(
        "flash_attn_alibi_windowed",
        q,
        k,
        v,
        Some(alibi_slopes),
        softmax_scale,
        window_size_left,
        window_size_right,
        None,
    )
}

/// Attention over a dense batch with every option: optional ALiBi, a sliding window and a softcap.
///
/// `q` is `(batch, seqlen_q, heads_q, head_dim)`, `k` and `v` are `(batch, seqlen_k, heads_kv,
/// head_dim)` (see the crate docs for dtypes, strides and the GQA rule); the result has `q`'s shape
/// and dtype.
///
/// `alibi_slopes` (optional): f32, one slope per query head, `(heads_q,)` (or `(batch, heads_q)`);
/// each score gets `-slope · |j - (i + seqlen_k - seqlen_q)|` added before the mask.
///
/// `softmax_scale` multiplies every score `q · k` before the softmax (usually
/// `1 / sqrt(head_dim)`).
///
/// `window_size_left` / `window_size_right` bound how many keys before / after query row `i`'s
/// diagonal position (`i + seqlen_k - seqlen_q`) it may see; `None` leaves that side open, and
/// `(None, Some(0))` is the causal mask. How large or one-sided windows are read: [`window_mask`].
///
/// `softcap`: when `> 0.0`, each scaled score `s` becomes `softcap · tanh(s / softcap)` before
/// ALiBi and the mask (Gemma 2 uses 50); `0.0` turns it off.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_alibi_windowed_softcap(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: Option<&Tensor>,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
    softcap: f32,
) -> Result<Tensor> {
    dense(
        "flash_attn_alibi_windowed_softcap",
        q,
        k,
        v,
        alibi_slopes,
        softmax_scale,
        window_size_left,
        window_size_right,
        Some(softcap),
    )
}

#[allow(clippy::too_many_arguments)]
/// Attention over sequences of different lengths packed into one batch (no padding).
///
/// The batch's sequences are stacked along the first dimension: `q` is `(total_q, heads_q,
/// head_dim)`, `k` and `v` are `(total_k, heads_kv, head_dim)`. `seqlens_q` / `seqlens_k` are u32
/// prefix sums of `batch + 1` entries (`0, len_0, len_0 + len_1, ...`): sequence `i` owns rows
/// `seqlens_q[i]..seqlens_q[i + 1]` of `q` and `seqlens_k[i]..seqlens_k[i + 1]` of `k` / `v`.
/// `max_seqlen_q` / `max_seqlen_k` bound the longest sequence on each side. Masks, ALiBi and
/// softcap apply to each sequence on its own, with its own lengths. The result is `(total_q,
/// heads_q, head_dim)` in `q`'s dtype.
///
/// `softmax_scale` multiplies every score `q · k` before the softmax (usually
/// `1 / sqrt(head_dim)`).
///
/// `causal` hides from query row `i` of a sequence every key after position `i + len_k - len_q`
/// (the bottom-right aligned causal mask; `len_q`, `len_k`: that sequence's own lengths).
pub fn flash_attn_varlen(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    let window_size_right = if causal { Some(0) } else { None };
    varlen(
        "flash_attn_varlen",
        q,
        k,
        v,
        None,
        seqlens_q,
        seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        softmax_scale,
        None,
        window_size_right,
        None,
    )
}

#[allow(clippy::too_many_arguments)]
/// Attention over packed sequences of different lengths, with a sliding window.
///
/// The batch's sequences are stacked along the first dimension: `q` is `(total_q, heads_q,
/// head_dim)`, `k` and `v` are `(total_k, heads_kv, head_dim)`. `seqlens_q` / `seqlens_k` are u32
/// prefix sums of `batch + 1` entries (`0, len_0, len_0 + len_1, ...`): sequence `i` owns rows
/// `seqlens_q[i]..seqlens_q[i + 1]` of `q` and `seqlens_k[i]..seqlens_k[i + 1]` of `k` / `v`.
/// `max_seqlen_q` / `max_seqlen_k` bound the longest sequence on each side. Masks, ALiBi and
/// softcap apply to each sequence on its own, with its own lengths. The result is `(total_q,
/// heads_q, head_dim)` in `q`'s dtype.
///
/// `softmax_scale` multiplies every score `q · k` before the softmax (usually
/// `1 / sqrt(head_dim)`).
///
/// `window_size_left` / `window_size_right` bound how many keys before / after query row `i`'s
/// diagonal position (`i + seqlen_k - seqlen_q`) it may see; `None` leaves that side open, and
/// `(None, Some(0))` is the causal mask. How large or one-sided windows are read: [`window_mask`].
/// Window sides larger than `max_seqlen_k` count as open.
pub fn flash_attn_varlen_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    varlen(
        "flash_attn_varlen_windowed",
        q,
        k,
        v,
        None,
        seqlens_q,
        seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        softmax_scale,
        window_size_left,
        window_size_right,
        None,
    )
}

#[allow(clippy::too_many_arguments)]
/// Attention of packed queries over a paged K/V cache (chunked prefill, decode, mixed batches).
///
/// `q` is `(total_q, heads_q, head_dim)` with u32 prefix sums `seqlens_q` (`batch + 1` entries),
/// as in [`flash_attn_varlen`]. `k` and `v` are pools of pages, `(num_pages, page_block_size,
/// heads_kv, head_dim)`; `block_table` `(batch, max_pages)` lists each sequence's pages in order
/// (u32, or i32 as the original's callers build it): key `j` of sequence `i` is row
/// `j % page_block_size` of page `block_table[i][j / page_block_size]`. Sequence `i` has
/// `seqlens_k[i + 1] - seqlens_k[i]` keys (`seqlens_k`: u32 prefix sums); its queries are the
/// last positions of the sequence, so masks align at the bottom right. `page_block_size` must
/// equal `k`'s second dimension; any page size works (the original needs a multiple of 32).
/// `max_seqlen_q` / `max_seqlen_k` bound the longest sequence on each side.
///
/// `softmax_scale` multiplies every score `q · k` before the softmax (usually
/// `1 / sqrt(head_dim)`).
///
/// `window_size_left` / `window_size_right` bound how many keys before / after query row `i`'s
/// diagonal position (`i + seqlen_k - seqlen_q`) it may see; `None` leaves that side open, and
/// `(None, Some(0))` is the causal mask. How large or one-sided windows are read: [`window_mask`].
///
/// `softcap`: `Some(c)` with `c > 0.0` caps each scaled score to `c · tanh(s / c)`; `None` or
/// `Some(0.0)` turns it off.
///
/// `mm_prefix_ranges`: `None`, or i32 `(batch, max_ranges, 2)` on q's device, half-open ranges
/// `[start, end)` of key positions per sequence (a multimodal prefix, e.g. an image's tokens): a
/// query at position `p` (`i + seqlen_k - seqlen_q`) inside a range (`start <= p < end`) also
/// sees every key of that range (below the sequence's length) that the causal or window mask
/// hides; ranges with `start >= end` are ignored. Without a mask every key is visible anyway.
/// See [`prefix_ranges`] for how it is computed.
///
/// Runs `flashcore::attention_paged_varlen`. The result is `(total_q, heads_q, head_dim)` in
/// `q`'s dtype.
pub fn flash_attn_varlen_paged_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    block_table: &Tensor,
    mm_prefix_ranges: Option<&Tensor>,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
    page_block_size: usize,
    softcap: Option<f32>,
) -> Result<Tensor> {
    let function = "flash_attn_varlen_paged_windowed";
    check_device(q, function)?;
    if k.rank() == 4 && k.dims()[1] != page_block_size {
        candle_core::bail!(
            "candle-flash-attn (flashcore): {function}: page_block_size {page_block_size} must \
             equal k's page size (dim 1 of {:?})",
            k.dims()
        )
    }
    if slow::wanted(q, v) {
        let o = slow::Opts {
            mask: window_mask(window_size_left, window_size_right, max_seqlen_k),
            scale: softmax_scale,
            softcap: softcap_of(softcap),
        };
        return paged_slow(
            function,
            q,
            k,
            v,
            seqlens_q,
            seqlens_k,
            block_table,
            mm_prefix_ranges,
            max_seqlen_q,
            &o,
        );
    }
    let n = seqlens_k.dims1()?;
    if n < 2 {
        candle_core::bail!(
            "candle-flash-attn (flashcore): {function}: seqlens_k must have shape (batch + 1,) \
             with batch >= 1, got {:?}",
            seqlens_k.dims()
        )
    }
    if seqlens_k.dtype() == DType::U32 && seqlens_k.device().is_cpu() {
        // candle's u32 subtraction panics (debug) or wraps on a decreasing pair: check first.
        let cu = seqlens_k.to_vec1::<u32>()?;
        if let Some(i) = cu.windows(2).position(|w| w[1] < w[0]) {
            candle_core::bail!(
                "candle-flash-attn (flashcore): {function}: seqlens_k must be non-decreasing \
                 prefix sums, got entry {} = {} after {}",
                i + 1,
                cu[i + 1],
                cu[i]
            )
        }
    }
    let lens = (seqlens_k.narrow(0, 1, n - 1)? - seqlens_k.narrow(0, 0, n - 1)?)?;
    let table = match block_table.dtype() {
        DType::U32 => block_table.clone(),
        _ => block_table.to_dtype(DType::U32)?,
    };
    let params = AttnParams {
        softmax_scale: Some(softmax_scale),
        mask: window_mask(window_size_left, window_size_right, max_seqlen_k),
        softcap: softcap_of(softcap),
        alibi_slopes: None,
        ..Default::default()
    };
    let o = flashcore::attention_paged_varlen(
        q,
        k,
        v,
        &table,
        &lens,
        seqlens_q,
        max_seqlen_q,
        &params,
    )?;
    match mm_prefix_ranges {
        None => Ok(o),
        Some(ranges) => {
            let paged = PagedBatch {
                q,
                k_pages: k,
                v_pages: v,
                seqlens_q,
                seqlens_k,
                block_table: &table,
            };
            prefix_ranges(o, &paged, ranges, &params)
        }
    }
}

/// The inputs of a paged call as [`prefix_ranges`] reads them: packed q, the pools, the prefix
/// sums of both sides, the block table (u32).
struct PagedBatch<'a> {
    q: &'a Tensor,
    k_pages: &'a Tensor,
    v_pages: &'a Tensor,
    seqlens_q: &'a Tensor,
    seqlens_k: &'a Tensor,
    block_table: &'a Tensor,
}

fn ranges_err(rule: &str, got: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(format!(
        "candle-flash-attn (flashcore): flash_attn_varlen_paged_windowed: mm_prefix_ranges: \
         {rule}, got {got}"
    ))
}

/// `mm_prefix_ranges`: i32 `(batch, max_ranges, 2)` on q's device.
fn check_ranges(ranges: &Tensor, batch: usize, q: &Tensor) -> Result<()> {
    if ranges.dtype() != DType::I32 {
        return Err(ranges_err(
            "dtype must be i32",
            format!("{:?}", ranges.dtype()),
        ));
    }
    if ranges.rank() != 3 || ranges.dims()[0] != batch || ranges.dims()[2] != 2 {
        return Err(ranges_err(
            &format!("shape must be (batch, max_ranges, 2) with batch = {batch}"),
            format!("{:?}", ranges.dims()),
        ));
    }
    if !ranges.device().same_device(q.device()) {
        return Err(ranges_err(
            "must be on q's device",
            format!("{:?}", ranges.device().location()),
        ));
    }
    Ok(())
}

/// The non-empty `[start, end)` ranges of each sequence, read on the host (checked ranges).
fn read_ranges(ranges: &Tensor) -> Result<Vec<Vec<(i64, i64)>>> {
    let (n, per_seq, _) = ranges.dims3()?;
    let rs: Vec<i32> = ranges.flatten_all()?.to_vec1::<i32>()?;
    Ok((0..n)
        .map(|i| {
            (0..per_seq)
                .map(|r| {
                    let at = (i * per_seq + r) * 2;
                    (rs[at] as i64, rs[at + 1] as i64)
                })
                .filter(|(s, e)| s < e)
                .collect()
        })
        .collect())
}

/// The paged function through the slow path: the block table as u32 (an i32 one cast), the
/// ranges checked and read on the host.
#[allow(clippy::too_many_arguments)]
fn paged_slow(
    function: &str,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    block_table: &Tensor,
    mm_prefix_ranges: Option<&Tensor>,
    max_seqlen_q: usize,
    o: &slow::Opts,
) -> Result<Tensor> {
    let table = match block_table.dtype() {
        DType::U32 => block_table.clone(),
        _ => block_table.to_dtype(DType::U32)?,
    };
    let ranges = match mm_prefix_ranges {
        None => None,
        Some(r) => {
            let batch = seqlens_q.dims().first().map_or(0, |n| n.saturating_sub(1));
            check_ranges(r, batch, q)?;
            Some(read_ranges(r)?)
        }
    };
    slow::paged(
        function,
        q,
        k,
        v,
        seqlens_q,
        seqlens_k,
        &table,
        ranges.as_deref(),
        max_seqlen_q,
        o,
    )
}

/// Whether key `j` is visible to the query at position `p` under `mask` (bottom-right: the
/// band `p - left ..= p + right`, an absent side unbounded).
fn in_band(mask: Mask, p: i64, j: i64) -> bool {
    let (left, right) = mask.bounds();
    let wide = |x: usize| i64::try_from(x).unwrap_or(i64::MAX);
    left.is_none_or(|l| j >= p.saturating_sub(wide(l)))
        && right.is_none_or(|r| j <= p.saturating_add(wide(r)))
}

/// `mm_prefix_ranges` of `flash_attn_varlen_paged_windowed`, as candle-flash-attn 0.11.1's
/// kernels apply them: a key `j < seqlen_k` hidden by the causal/window mask from the query at
/// position `p` becomes visible when some range `[start, end)` of the sequence (with `start <
/// end`) holds both `p` and `j`. Scale, softcap and the softmax are unchanged.
///
/// flashcore has no per-key mask, so `o` (flashcore's answer with the mask alone, which also
/// validated every other argument) is kept for every query row the ranges do not change, and the
/// rows they change are recomputed here from candle ops with an explicit visibility matrix, in
/// f32 (f64 for f64 inputs): their keys gathered from the pages, `softmax(scale · q kᵀ (softcap),
/// masked) v`, a row without a visible key giving zeros. This reads the prefix sums, the block
/// table and the ranges on the host (a device sync on a GPU, where the block table's page ids and
/// the key counts are then checked here, naming the argument) and materialises `heads_q x rows x
/// seqlen_k` scores per sequence for the changed rows only: meant for image-sized prefixes.
fn prefix_ranges(
    o: Tensor,
    b: &PagedBatch,
    ranges: &Tensor,
    params: &AttnParams,
) -> Result<Tensor> {
    let n = b.seqlens_q.dims1()? - 1;
    check_ranges(ranges, n, b.q)?;
    if params.mask == Mask::None {
        return Ok(o); // every key is visible already
    }
    let all_ranges = read_ranges(ranges)?;
    let cu_q = b.seqlens_q.to_vec1::<u32>()?;
    let cu_k = b.seqlens_k.to_vec1::<u32>()?;
    let (num_pages, ps, hkv, d) = b.k_pages.dims4()?;
    let dv = b.v_pages.dims()[3];
    let max_pages = b.block_table.dims()[1];
    let table = b.block_table.flatten_all()?.to_vec1::<u32>()?;
    let (total_q, hq, _) = b.q.dims3()?;
    let ratio = hq / hkv;
    let wide = if b.q.dtype() == DType::F64 {
        DType::F64
    } else {
        DType::F32
    };
    let dev = b.q.device();
    let flat_k = b.k_pages.reshape((num_pages * ps, hkv, d))?;
    let flat_v = b.v_pages.reshape((num_pages * ps, hkv, dv))?;
    // GQA: (sk, hkv, w) -> (hq, sk, w), query head h reading K/V head h / ratio.
    let per_head = |t: &Tensor| -> Result<Tensor> {
        let (sk, _, w) = t.dims3()?;
        t.to_dtype(wide)?
            .transpose(0, 1)?
            .unsqueeze(1)?
            .broadcast_as((hkv, ratio, sk, w))?
            .reshape((hq, sk, w))
    };
    let (mut rows_changed, mut outs) = (Vec::new(), Vec::new());
    for i in 0..n {
        let (q0, sq) = (cu_q[i] as usize, (cu_q[i + 1] - cu_q[i]) as usize);
        let sk = (cu_k[i + 1] - cu_k[i]) as usize;
        let seq_ranges = &all_ranges[i];
        if sq == 0 || sk == 0 || seq_ranges.is_empty() {
            continue;
        }
        // Visibility of the rows the ranges change: (rows, sk), 1 = visible.
        let (mut rows, mut vis) = (Vec::new(), Vec::new());
        for t in 0..sq {
            let p = t as i64 + sk as i64 - sq as i64;
            let row: Vec<u8> = (0..sk as i64)
                .map(|j| {
                    let bypass = seq_ranges
                        .iter()
                        .any(|&(s, e)| s <= p && p < e && s <= j && j < e);
                    (in_band(params.mask, p, j) || bypass) as u8
                })
                .collect();
            let changed = row
                .iter()
                .enumerate()
                .any(|(j, &x)| x == 1 && !in_band(params.mask, p, j as i64));
            if changed {
                rows.push(t);
                vis.extend(row);
            }
        }
        if rows.is_empty() {
            continue;
        }
        let key_rows = slow::key_rows(
            "flash_attn_varlen_paged_windowed",
            &table,
            i,
            sk,
            (num_pages, ps, max_pages),
        )?;
        let key_rows = Tensor::new(key_rows.as_slice(), dev)?;
        let k = per_head(&flat_k.index_select(&key_rows, 0)?)?; // (hq, sk, d)
        let v = per_head(&flat_v.index_select(&key_rows, 0)?)?; // (hq, sk, dv)
        let q_rows: Vec<u32> = rows.iter().map(|&t| (q0 + t) as u32).collect();
        let q_sel =
            b.q.index_select(&Tensor::new(q_rows.as_slice(), dev)?, 0)?
                .to_dtype(wide)?
                .transpose(0, 1)?
                .contiguous()?; // (hq, rows, d)
        let scale = params.softmax_scale.unwrap_or(1.0 / (d as f32).sqrt()) as f64;
        let mut s = (q_sel.matmul(&k.t()?.contiguous()?)? * scale)?; // (hq, rows, sk)
        if let Some(c) = params.softcap {
            let c = c as f64;
            s = ((s / c)?.tanh()? * c)?;
        }
        let vis = Tensor::from_vec(vis, (1, rows.len(), sk), dev)?.broadcast_as(s.shape())?;
        let neg_inf = Tensor::full(f64::NEG_INFINITY, (), dev)?
            .to_dtype(wide)?
            .broadcast_as(s.shape())?;
        let s = vis.where_cond(&s, &neg_inf)?;
        // softmax over the visible keys; a row whose scores are all -inf gives zeros
        let m = s.max_keepdim(2)?;
        let m = m.eq(f64::NEG_INFINITY)?.where_cond(&m.zeros_like()?, &m)?;
        let e = s.broadcast_sub(&m)?.exp()?;
        let z = e.sum_keepdim(2)?;
        let z = z.eq(0f64)?.where_cond(&z.ones_like()?, &z)?;
        let rows_o = e
            .broadcast_div(&z)?
            .matmul(&v.contiguous()?)?
            .transpose(0, 1)?
            .to_dtype(o.dtype())?; // (rows, hq, dv)
        rows_changed.extend(rows.iter().map(|&t| q0 + t));
        outs.push(rows_o);
    }
    if outs.is_empty() {
        return Ok(o);
    }
    // Every output row from `o`, but the changed ones from the explicit path.
    let mut pick: Vec<u32> = (0..total_q as u32).collect();
    for (n, &r) in rows_changed.iter().enumerate() {
        pick[r] = (total_q + n) as u32;
    }
    let mut parts = vec![o];
    parts.extend(outs);
    Tensor::cat(&parts, 0)?.index_select(&Tensor::new(pick.as_slice(), dev)?, 0)
}

#[allow(clippy::too_many_arguments)]
/// Attention over packed sequences of different lengths, with ALiBi position biases.
///
/// The batch's sequences are stacked along the first dimension: `q` is `(total_q, heads_q,
/// head_dim)`, `k` and `v` are `(total_k, heads_kv, head_dim)`. `seqlens_q` / `seqlens_k` are u32
/// prefix sums of `batch + 1` entries (`0, len_0, len_0 + len_1, ...`): sequence `i` owns rows
/// `seqlens_q[i]..seqlens_q[i + 1]` of `q` and `seqlens_k[i]..seqlens_k[i + 1]` of `k` / `v`.
/// `max_seqlen_q` / `max_seqlen_k` bound the longest sequence on each side. Masks, ALiBi and
/// softcap apply to each sequence on its own, with its own lengths. The result is `(total_q,
/// heads_q, head_dim)` in `q`'s dtype.
///
/// `alibi_slopes`: f32, one slope per query head, `(heads_q,)` (or `(batch, heads_q)`); each score
/// gets `-slope · |j - (i + seqlen_k - seqlen_q)|` added before the mask.
///
/// `softmax_scale` multiplies every score `q · k` before the softmax (usually
/// `1 / sqrt(head_dim)`).
///
/// `causal` hides from query row `i` of a sequence every key after position `i + len_k - len_q`
/// (the bottom-right aligned causal mask; `len_q`, `len_k`: that sequence's own lengths).
pub fn flash_attn_varlen_alibi(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    let window_size_right = if causal { Some(0) } else { None };
    varlen(
        "flash_attn_varlen_alibi",
        q,
        k,
        v,
        Some(alibi_slopes),
        seqlens_q,
        seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        softmax_scale,
        None,
        window_size_right,
        None,
    )
}

#[allow(clippy::too_many_arguments)]
/// Attention over packed sequences of different lengths, with ALiBi and a sliding window.
///
/// The batch's sequences are stacked along the first dimension: `q` is `(total_q, heads_q,
/// head_dim)`, `k` and `v` are `(total_k, heads_kv, head_dim)`. `seqlens_q` / `seqlens_k` are u32
/// prefix sums of `batch + 1` entries (`0, len_0, len_0 + len_1, ...`): sequence `i` owns rows
/// `seqlens_q[i]..seqlens_q[i + 1]` of `q` and `seqlens_k[i]..seqlens_k[i + 1]` of `k` / `v`.
/// `max_seqlen_q` / `max_seqlen_k` bound the longest sequence on each side. Masks, ALiBi and
/// softcap apply to each sequence on its own, with its own lengths. The result is `(total_q,
/// heads_q, head_dim)` in `q`'s dtype.
///
/// `alibi_slopes`: f32, one slope per query head, `(heads_q,)` (or `(batch, heads_q)`); each score
/// gets `-slope · |j - (i + seqlen_k - seqlen_q)|` added before the mask.
///
/// `softmax_scale` multiplies every score `q · k` before the softmax (usually
/// `1 / sqrt(head_dim)`).
///
/// `window_size_left` / `window_size_right` bound how many keys before / after query row `i`'s
/// diagonal position (`i + seqlen_k - seqlen_q`) it may see; `None` leaves that side open, and
/// `(None, Some(0))` is the causal mask. How large or one-sided windows are read: [`window_mask`].
pub fn flash_attn_varlen_alibi_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    varlen(
        "flash_attn_varlen_alibi_windowed",
        q,
        k,
        v,
        Some(alibi_slopes),
        seqlens_q,
        seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        softmax_scale,
        window_size_left,
        window_size_right,
        None,
    )
}

#[allow(clippy::too_many_arguments)]
/// Attention over packed sequences of different lengths with every option: optional ALiBi, a
/// sliding window and a softcap.
///
/// The batch's sequences are stacked along the first dimension: `q` is `(total_q, heads_q,
/// head_dim)`, `k` and `v` are `(total_k, heads_kv, head_dim)`. `seqlens_q` / `seqlens_k` are u32
/// prefix sums of `batch + 1` entries (`0, len_0, len_0 + len_1, ...`): sequence `i` owns rows
/// `seqlens_q[i]..seqlens_q[i + 1]` of `q` and `seqlens_k[i]..seqlens_k[i + 1]` of `k` / `v`.
/// `max_seqlen_q` / `max_seqlen_k` bound the longest sequence on each side. Masks, ALiBi and
/// softcap apply to each sequence on its own, with its own lengths. The result is `(total_q,
/// heads_q, head_dim)` in `q`'s dtype.
///
/// `alibi_slopes` (optional): f32, one slope per query head, `(heads_q,)` (or `(batch, heads_q)`);
/// each score gets `-slope · |j - (i + seqlen_k - seqlen_q)|` added before the mask.
///
/// `softmax_scale` multiplies every score `q · k` before the softmax (usually
/// `1 / sqrt(head_dim)`).
///
/// `window_size_left` / `window_size_right` bound how many keys before / after query row `i`'s
/// diagonal position (`i + seqlen_k - seqlen_q`) it may see; `None` leaves that side open, and
/// `(None, Some(0))` is the causal mask. How large or one-sided windows are read: [`window_mask`].
///
/// `softcap`: when `> 0.0`, each scaled score `s` becomes `softcap · tanh(s / softcap)` before
/// ALiBi and the mask (Gemma 2 uses 50); `0.0` turns it off.
pub fn flash_attn_varlen_alibi_windowed_softcap(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: Option<&Tensor>,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
    softcap: f32,
) -> Result<Tensor> {
    varlen(
        "flash_attn_varlen_alibi_windowed_softcap",
        q,
        k,
        v,
        alibi_slopes,
        seqlens_q,
        seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        softmax_scale,
        window_size_left,
        window_size_right,
        Some(softcap),
    )
}
