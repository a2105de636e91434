//! # candle-flash-attn (flashcore edition)
//!
//! A drop-in replacement for [candle-flash-attn 0.11.1](https://crates.io/crates/candle-flash-attn)
//! backed by flashcore (this repository): every public function of that crate, with the same
//! signature and the same meaning, computed by flashcore's kernels (CUDA, with the `cuda`
//! feature) or by its CPU path (CPU tensors). Substitute it for the crates.io crate with
//! `[patch.crates-io]`; see this crate's README for the one extra line that turns on CUDA and
//! for every place where the behaviour differs (all of them supersets or explicit errors).
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

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::op::BackpropOp;
use candle_core::DType;
use candle_core::{CpuStorage, Layout, Result, Shape, Storage, Tensor};
use flashcore::{AttnParams, Mask};

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
             built without its `cuda` feature; add `candle-flash-attn = {{ version = \"0.11.1\", \
             features = [\"cuda\"] }}` to your [dependencies]"
        )
    }
    Ok(())
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
    };
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
    };
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

/// Flash-attention v2 layer.
///
/// This implements scaled dot-product attention, `softmax(Q @ K^T . softmax_scale) @ V`.
/// Multi-query and grouped-query attention are supported by using tensors k and v with fewer heads
/// than q, the number of heads in k and v has to be divisible by the number of heads in q.
///
/// # Arguments
///
/// * `q` - Query tensor with shape `(batch, seq_len_q, num_heads_q, head_size)`.
/// * `k` - Key tensor with shape `(batch, seq_len_kv, num_heads_kv, head_size)`.
/// * `v` - Value tensor with shape `(batch, seq_len_kv, num_heads_kv, head_size)`.
///
/// The resulting tensor has dimensions `(batch, seq_len_q, num_heads_q, head_size)`.
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

/// Flash-attention v2 layer.
///
/// This implements scaled dot-product attention, `softmax(Q @ K^T . softmax_scale) @ V`.
/// Multi-query and grouped-query attention are supported by using tensors k and v with fewer heads
/// than q, the number of heads in k and v has to be divisible by the number of heads in q.
///
/// # Arguments
///
/// * `q` - Query tensor with shape `(batch, seq_len_q, num_heads_q, head_size)`.
/// * `k` - Key tensor with shape `(batch, seq_len_kv, num_heads_kv, head_size)`.
/// * `v` - Value tensor with shape `(batch, seq_len_kv, num_heads_kv, head_size)`.
/// * `window_size_left` - Limit left attention to value tokens.
/// * `window_size_right` - Limit right attention to value tokens.
///
/// # Causal mask
///
/// `window_size_left=None` with `window_size_right=Some(0)` applies a causal mask to the result
/// of  `Q @ K^T`
///
/// The resulting tensor has dimensions `(batch, seq_len_q, num_heads_q, head_size)`.
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

/// Flash-attention v2 layer.
///
/// This implements scaled dot-product attention, `softmax(Q @ K^T . softmax_scale) @ V`.
/// Multi-query and grouped-query attention are supported by using tensors k and v with fewer heads
/// than q, the number of heads in k and v has to be divisible by the number of heads in q.
///
/// # Arguments
///
/// * `q` - Query tensor with shape `(batch, seq_len_q, num_heads_q, head_size)`.
/// * `k` - Key tensor with shape `(batch, seq_len_kv, num_heads_kv, head_size)`.
/// * `v` - Value tensor with shape `(batch, seq_len_kv, num_heads_kv, head_size)`.
/// * `alibi_slopes` - Alibi slopes tensor with shape `(num_heads_q)`.
///
/// The resulting tensor has dimensions `(batch, seq_len_q, num_heads_q, head_size)`.
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

/// Flash-attention v2 layer.
///
/// This implements scaled dot-product attention, `softmax(Q @ K^T . softmax_scale) @ V`.
/// Multi-query and grouped-query attention are supported by using tensors k and v with fewer heads
/// than q, the number of heads in k and v has to be divisible by the number of heads in q.
///
/// # Arguments
///
/// * `q` - Query tensor with shape `(batch, seq_len_q, num_heads_q, head_size)`.
/// * `k` - Key tensor with shape `(batch, seq_len_kv, num_heads_kv, head_size)`.
/// * `v` - Value tensor with shape `(batch, seq_len_kv, num_heads_kv, head_size)`.
/// * `alibi_slopes` - Alibi slopes tensor with shape `(num_heads_q)`.
/// * `window_size_left` - Limit left attention to value tokens.
/// * `window_size_right` - Limit right attention to value tokens.
///
/// # Causal mask
///
/// `window_size_left=None` with `window_size_right=Some(0)` applies a causal mask to the result
/// of  `Q @ K^T`
///
/// The resulting tensor has dimensions `(batch, seq_len_q, num_heads_q, head_size)`.
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

/// Flash-attention v2 layer.
///
/// This implements scaled dot-product attention, `softmax(Q @ K^T . softmax_scale) @ V`.
/// Multi-query and grouped-query attention are supported by using tensors `k` and `v` with fewer heads
/// than `q`. The number of heads in `k` and `v` must be divisible by the number of heads in `q`.
///
/// # Arguments
///
/// * `q` - Query tensor with shape `(batch, seq_len_q, num_heads_q, head_size)`.
/// * `k` - Key tensor with shape `(batch, seq_len_kv, num_heads_kv, head_size)`.
/// * `v` - Value tensor with shape `(batch, seq_len_kv, num_heads_kv, head_size)`.
/// * `alibi_slopes` - Optional alibi slopes tensor with shape `(num_heads_q)`.
/// * `softmax_scale` - Scaling factor for the softmax operation.
/// * `window_size_left` - Optional limit on left attention to value tokens.
/// * `window_size_right` - Optional limit on right attention to value tokens.
/// * `softcap` - Gemma style softcap the attention logits before the softmax.
///
/// # Causal Mask
///
/// Setting `window_size_left=None` and `window_size_right=Some(0)` applies a causal mask to the result
/// of `Q @ K^T`.
///
/// # Returns
///
/// The resulting tensor has dimensions `(batch, seq_len_q, num_heads_q, head_size)`.
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
/// Flash-attention v2 layer with variable-length batching.
///
/// This implements scaled dot-product attention, `softmax(Q @ K^T . softmax_scale) @ V`.
/// Multi-query and grouped-query attention are supported by using tensors k and v with fewer heads
/// than q, the number of heads in k and v has to be divisible by the number of heads in q.
///
/// # Arguments
///
/// * `q` - Query tensor with shape `(total_q, num_heads_q, head_size)`.
/// * `k` - Key tensor with shape `(total_kv, num_heads_kv, head_size)`.
/// * `v` - Value tensor with shape `(total_kv, num_heads_kv, head_size)`.
/// * `seqlens_q` - The cumulative lengths of the sequences in the batch, used to index in q.
/// * `seqlens_k` - The cumulative lengths of the sequences in the batch, used to index in k and v.
/// * `max_seqlen_q` - The maximum query sequence length for q in the batch.
/// * `max_seqlen_k` - The maximum query sequence length for k and v in the batch.
///
/// `seqlens_q` and `seqlens_k` contain `batch_size + 1` elements, typically `0`, `seqlen_1`,
/// `seqlen_1 + seqlen_2`, etc.
///
/// The resulting tensor has dimensions `(total_q, num_heads_q, head_size)`.
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
/// Flash-attention v2 layer with variable-length batching.
///
/// This implements scaled dot-product attention, `softmax(Q @ K^T . softmax_scale) @ V`.
/// Multi-query and grouped-query attention are supported by using tensors k and v with fewer heads
/// than q, the number of heads in k and v has to be divisible by the number of heads in q.
///
/// # Arguments
///
/// * `q` - Query tensor with shape `(total_q, num_heads_q, head_size)`.
/// * `k` - Key tensor with shape `(total_kv, num_heads_kv, head_size)`.
/// * `v` - Value tensor with shape `(total_kv, num_heads_kv, head_size)`.
/// * `seqlens_q` - The cumulative lengths of the sequences in the batch, used to index in q.
/// * `seqlens_k` - The cumulative lengths of the sequences in the batch, used to index in k and v.
/// * `max_seqlen_q` - The maximum query sequence length for q in the batch.
/// * `max_seqlen_k` - The maximum query sequence length for k and v in the batch.
/// * `window_size_left` - Limit left attention to value tokens.
/// * `window_size_right` - Limit right attention to value tokens.
///
/// `seqlens_q` and `seqlens_k` contain `batch_size + 1` elements, typically `0`, `seqlen_1`,
/// `seqlen_1 + seqlen_2`, etc.
///
/// The resulting tensor has dimensions `(total_q, num_heads_q, head_size)`.
///
/// # Causal mask
///
/// `window_size_left=None` with `window_size_right=Some(0)` applies a causal mask to the result
/// of  `Q @ K^T`
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
/// Flash-attention v2 layer with variable-length batching and paged K/V cache.
///
/// This implements scaled dot-product attention, `softmax(Q @ K^T . softmax_scale) @ V`.
/// Multi-query and grouped-query attention are supported by using tensors k and v with fewer heads
/// than q, the number of heads in k and v has to be divisible by the number of heads in q.
///
/// # Arguments
///
/// * `q` - Query tensor with shape `(total_q, num_heads_q, head_size)`.
/// * `k` - Paged key tensor with shape `(num_blocks, page_block_size, num_heads_kv, head_size)`.
/// * `v` - Paged value tensor with shape `(num_blocks, page_block_size, num_heads_kv, head_size)`.
/// * `seqlens_q` - The cumulative lengths of the sequences in the batch, used to index in q.
/// * `seqlens_k` - The cumulative lengths of the sequences in the batch, used to index in k and v.
/// * `block_table` - Per-batch physical block indices with shape `(batch_size, max_blocks)`.
/// * `mm_prefix_ranges` - Optional per-batch ranges with shape `(batch_size, max_ranges, 2)` that bypass the causal/window mask.
/// * `max_seqlen_q` - The maximum query sequence length for q in the batch.
/// * `max_seqlen_k` - The maximum query sequence length for k and v in the batch.
/// * `window_size_left` - Limit left attention to value tokens.
/// * `window_size_right` - Limit right attention to value tokens.
/// * `page_block_size` - Number of tokens per K/V cache block.
/// * `softcap` - Optional Gemma-style softcap for attention logits before the softmax.
///
/// The resulting tensor has dimensions `(total_q, num_heads_q, head_size)`.
///
/// # flashcore
///
/// Runs `flashcore::attention_paged_varlen`: the per-sequence key counts are taken from the
/// prefix sums `seqlens_k` (`seqlens_k[i + 1] - seqlens_k[i]`, on the device), `block_table`
/// (u32, or i32 as the original's callers build it) is the page table, and `page_block_size`
/// must equal k's dim 1. The window is converted as in the other functions (with
/// `max_seqlen_k`). Any page size works (the original needs a multiple of 32).
/// `mm_prefix_ranges` (ranges that bypass the mask) is not supported: `Some` is an error naming
/// it, never a result computed without it.
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
    if mm_prefix_ranges.is_some() {
        candle_core::bail!(
            "candle-flash-attn (flashcore): {function}: mm_prefix_ranges is not supported \
             (flashcore has no mask-bypass ranges); pass None"
        )
    }
    if k.rank() == 4 && k.dims()[1] != page_block_size {
        candle_core::bail!(
            "candle-flash-attn (flashcore): {function}: page_block_size {page_block_size} must \
             equal k's page size (dim 1 of {:?})",
            k.dims()
        )
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
    };
    flashcore::attention_paged_varlen(q, k, v, &table, &lens, seqlens_q, max_seqlen_q, &params)
}

#[allow(clippy::too_many_arguments)]
/// Flash-attention v2 layer with variable-length batching.
///
/// This implements scaled dot-product attention, `softmax(Q @ K^T . softmax_scale) @ V`.
/// Multi-query and grouped-query attention are supported by using tensors k and v with fewer heads
/// than q, the number of heads in k and v has to be divisible by the number of heads in q.
///
/// # Arguments
///
/// * `q` - Query tensor with shape `(total_q, num_heads_q, head_size)`.
/// * `k` - Key tensor with shape `(total_kv, num_heads_kv, head_size)`.
/// * `v` - Value tensor with shape `(total_kv, num_heads_kv, head_size)`.
/// * `alibi_slopes` - Alibi slopes tensor with shape `(num_heads_q)`.
/// * `seqlens_q` - The cumulative lengths of the sequences in the batch, used to index in q.
/// * `seqlens_k` - The cumulative lengths of the sequences in the batch, used to index in k and v.
/// * `max_seqlen_q` - The maximum query sequence length for q in the batch.
/// * `max_seqlen_k` - The maximum query sequence length for k and v in the batch.
///
/// `seqlens_q` and `seqlens_k` contain `batch_size + 1` elements, typically `0`, `seqlen_1`,
/// `seqlen_1 + seqlen_2`, etc.
///
/// The resulting tensor has dimensions `(total_q, num_heads_q, head_size)`.
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
/// Flash-attention v2 layer with variable-length batching.
///
/// This implements scaled dot-product attention, `softmax(Q @ K^T . softmax_scale) @ V`.
/// Multi-query and grouped-query attention are supported by using tensors k and v with fewer heads
/// than q, the number of heads in k and v has to be divisible by the number of heads in q.
///
/// # Arguments
///
/// * `q` - Query tensor with shape `(total_q, num_heads_q, head_size)`.
/// * `k` - Key tensor with shape `(total_kv, num_heads_kv, head_size)`.
/// * `v` - Value tensor with shape `(total_kv, num_heads_kv, head_size)`.
/// * `alibi_slopes` - Alibi slopes tensor with shape `(num_heads_q)`.
/// * `seqlens_q` - The cumulative lengths of the sequences in the batch, used to index in q.
/// * `seqlens_k` - The cumulative lengths of the sequences in the batch, used to index in k and v.
/// * `max_seqlen_q` - The maximum query sequence length for q in the batch.
/// * `max_seqlen_k` - The maximum query sequence length for k and v in the batch.
/// * `window_size_left` - Limit left attention to value tokens.
/// * `window_size_right` - Limit right attention to value tokens.
///
/// `seqlens_q` and `seqlens_k` contain `batch_size + 1` elements, typically `0`, `seqlen_1`,
/// `seqlen_1 + seqlen_2`, etc.
///
/// The resulting tensor has dimensions `(total_q, num_heads_q, head_size)`.
///
/// # Causal mask
///
/// `window_size_left=None` with `window_size_right=Some(0)` applies a causal mask to the result
/// of  `Q @ K^T`
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
/// Flash-attention v2 layer with variable-length batching.
///
/// This implements scaled dot-product attention, `softmax(Q @ K^T . softmax_scale) @ V`.
/// Multi-query and grouped-query attention are supported by using tensors k and v with fewer heads
/// than q, the number of heads in k and v has to be divisible by the number of heads in q.
///
/// # Arguments
///
/// * `q` - Query tensor with shape `(total_q, num_heads_q, head_size)`.
/// * `k` - Key tensor with shape `(total_kv, num_heads_kv, head_size)`.
/// * `v` - Value tensor with shape `(total_kv, num_heads_kv, head_size)`.
/// * `alibi_slopes` - Option, alibi slopes tensor with shape `(num_heads_q)`.
/// * `seqlens_q` - The cumulative lengths of the sequences in the batch, used to index in q.
/// * `seqlens_k` - The cumulative lengths of the sequences in the batch, used to index in k and v.
/// * `max_seqlen_q` - The maximum query sequence length for q in the batch.
/// * `max_seqlen_k` - The maximum query sequence length for k and v in the batch.
/// * `window_size_left` - Option, limit left attention to value tokens.
/// * `window_size_right` - Option, limit right attention to value tokens.
/// * `softcap` - Gemma style softcap the attention logits before the softmax.
///
/// `seqlens_q` and `seqlens_k` contain `batch_size + 1` elements, typically `0`, `seqlen_1`,
/// `seqlen_1 + seqlen_2`, etc.
///
/// The resulting tensor has dimensions `(total_q, num_heads_q, head_size)`.
///
/// # Causal mask
///
/// `window_size_left=None` with `window_size_right=Some(0)` applies a causal mask to the result
/// of  `Q @ K^T`
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
