//! # flashcore
//!
//! Fused attention for [candle](https://github.com/huggingface/candle): one call computes
//! `softmax(scale * q k^T + bias, masked) v` without materialising the score matrix.
//! Hand-written CUDA kernels are picked per GPU at run time (an `mma.sync` path for
//! Ampere/Ada, sm_80/86/89, that also serves as the fallback on newer GPUs); a CPU path computes
//! the same function in f32/f64, so a model using flashcore runs everywhere.
//!
//! ## Layout
//! As in `candle-flash-attn`: `q` is `(batch, seq_q, heads_q, head_dim)`, `k` and `v` are
//! `(batch, seq_k, heads_kv, head_dim)`, the output is shaped like `q`. Inputs may be strided
//! views (narrowed, transposed) as long as the last dimension is contiguous; they are read in
//! place. Grouped-query and multi-query attention are native: `heads_q` must be a multiple of
//! `heads_kv`, and query head `h` reads K/V head `h / (heads_q / heads_kv)`; nothing is repeated.
//!
//! ## Masks are aligned bottom-right
//! As in FlashAttention >= 2.1, query row `i` (of `seq_q`) may see key `j` (of `seq_k`) when
//! `j <= i + seq_k - seq_q` under [`Mask::Causal`]. With `seq_q == seq_k` this is the usual
//! lower-triangular mask; with `seq_q == 1` (decoding) the single query sees every key. A sliding
//! window `Mask::Window { left, right }` lets row `i` see keys
//! `i + seq_k - seq_q - left <= j <= i + seq_k - seq_q + right` (`None` = unbounded on that side).
//! A query row that sees no key (possible when `seq_q > seq_k` under a causal mask) outputs zeros
//! and its log-sum-exp is `-inf`; never NaN.
//!
//! ## Scores
//! `s = softmax_scale * q . k`; then, if `softcap` is set, `s = softcap * tanh(s / softcap)`; then,
//! with ALiBi slopes, `s -= slope[h] * |j - (i + seq_k - seq_q)|`; then the mask; then the softmax.
//! The log-sum-exp returned by [`attention_with_lse`] is `ln(sum_j exp(s_ij))` over visible keys.
//!
//! ## Example
//! ```
//! use candle_core::{DType, Device, Tensor};
//! # fn main() -> candle_core::Result<()> {
//! let dev = Device::Cpu;
//! let q = Tensor::randn(0f32, 1., (1, 5, 8, 64), &dev)?;
//! let k = Tensor::randn(0f32, 1., (1, 5, 2, 64), &dev)?; // GQA: 8 query heads, 2 KV heads
//! let v = Tensor::randn(0f32, 1., (1, 5, 2, 64), &dev)?;
//! let o = flashcore::flash_attn(&q, &k, &v, 1.0 / 8.0, true)?;
//! assert_eq!(o.dims(), &[1, 5, 8, 64]);
//! # Ok(()) }
//! ```
//!
//! Backward is not implemented: using the output in a backward pass returns
//! `candle_core::Error::BackwardNotSupported`.

mod op;
mod params;
mod reference;

#[cfg(feature = "cuda")]
pub mod cuda;

pub use params::{AttnParams, Mask, SUPPORTED_HEAD_DIMS};

use candle_core::{Result, Tensor};

/// Drop-in replacement for `candle_flash_attn::flash_attn`: same arguments, same meaning
/// (causal aligned bottom-right).
pub fn flash_attn(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    let p = AttnParams {
        softmax_scale: Some(softmax_scale),
        mask: if causal { Mask::Causal } else { Mask::None },
        ..Default::default()
    };
    attention(q, k, v, &p)
}

/// Fused attention with every option of [`AttnParams`]; see the crate docs for the semantics.
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, params: &AttnParams) -> Result<Tensor> {
    op::run(q, k, v, params, false).map(|(o, _)| o)
}

/// Like [`attention`], also returning the log-sum-exp of each query row, `(batch, heads_q,
/// seq_q)` f32 (natural log; `-inf` for rows that see no key).
pub fn attention_with_lse(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    params: &AttnParams,
) -> Result<(Tensor, Tensor)> {
    let (o, lse) = op::run(q, k, v, params, true)?;
    let lse =
        lse.ok_or_else(|| candle_core::Error::Msg("flashcore: internal: lse missing".into()))?;
    Ok((o, lse))
}

/// The same function as [`attention`] composed of plain candle ops (matmul, mask, softmax,
/// matmul) in the input dtype, with K/V repeated for GQA. The `_slow` twin used by tests and the
/// benchmark's `eager` backend; it materialises the full score matrix (split over the batch and
/// KV-head groups when an intermediate would exceed 2^30 elements).
pub fn attention_slow(q: &Tensor, k: &Tensor, v: &Tensor, params: &AttnParams) -> Result<Tensor> {
    reference::eager(q, k, v, params)
}
