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
//! `(batch, seq_k, heads_kv, head_dim)`, the output is shaped like `q`; `v` may have its own
//! head dim (see Head dims), and the output then has `v`'s. Inputs may be strided
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
//! Any bound is valid, `usize::MAX` included: a left bound `>= seq_k` or a right bound `>= seq_q`
//! (of packed batches: `max_seqlen_k` / `max_seqlen_q`; of a paged cache: the page table's rows)
//! is the same as `None`, so `Window { left: Some(usize::MAX), right: Some(0) }` is exactly
//! [`Mask::Causal`]. A query row that sees no key (possible when `seq_q > seq_k` under a causal mask) outputs zeros
//! and its log-sum-exp is `-inf`; never NaN. `AttnParams::chunk = Some(c)` (chunked attention)
//! further limits the row at position `p = i + seq_k - seq_q` to keys
//! `floor(p / c) * c <= j < (floor(p / c) + 1) * c` (on a GPU as pieces of unchunked attention).
//!
//! ## Packed batches of different lengths
//! [`attention_varlen`] takes sequences packed along the rows, `q` `(total_q, heads_q, head_dim)`
//! and `k`/`v` `(total_k, heads_kv, head_dim)`, with u32 prefix sums `cu_seqlens_q` /
//! `cu_seqlens_k` of shape `(batch + 1,)` (as candle-flash-attn's `flash_attn_varlen`): sequence
//! `i` has query rows `cu_q[i]..cu_q[i + 1]` and keys `cu_k[i]..cu_k[i + 1]`, and every option
//! applies per sequence with that sequence's own `seq_q` and `seq_k` (bottom-right masks
//! included). Lengths may be 0 on either side. On the CPU the sums are fully checked (start at 0,
//! non-decreasing, end at the row counts, every length within `max_seqlen_*`); on a GPU that would
//! need a device sync, so the kernels clamp every range into the tensors (never reading or writing
//! outside them) and a check on the device (a kernel after the attention, or the split-KV
//! combine) fills the whole output and LSE with NaN if the sums lie.
//!
//! ## Head dims
//! q and k share one head dim `d_qk`; v and the output have `d_v`, which may differ (DeepSeek's
//! prefill is `(192, 128)`, MLA's absorbed decode `(576, 512)`), in every entry point (paged: a K
//! pool `(…, d_qk)` and a V pool `(…, d_v)`). Each is a multiple of 8 up to 256 everywhere, up to
//! 512 on sm_90 ([`SM90_MAX_HEAD_DIM`]: Gemma 4's d512, Q·Kᵀ over all columns, V and O in two
//! launches of 256 columns); on the CPU `d_v` goes up to 512 ([`MAX_HEAD_DIM`]) and `d_qk` up to
//! 576 ([`MAX_QK_HEAD_DIM`]); past that on a GPU, or past 256 on the sm80 family
//! ([`GPU_MAX_HEAD_DIM`]), is an error naming `q` or `v`. The default scale is `1 / sqrt(d_qk)`. The GPU kernels are compiled for 64, 128 and 256, with
//! narrow variants that compute only 32, 96, 160 or 192 columns (sm90 twins, sm80 bodies chosen
//! per launch); other head dims run on the next kernel up with the extra columns zero-filled in
//! shared memory (no copy; the compute of the padded columns is spent). On a GPU, `d_v != d_qk`
//! runs on a kernel of `D = max(d_qk, d_v)` that reads v and writes o at `d_v`, no copies
//! (DeepSeek's `(192, 128)` on an sm90 kernel of its own; FP8 K/V of two head dims are widened
//! first) (docs/decisions.md#separate-v-head-dim).
//!
//! ## Scores
//! `s = softmax_scale * q . k`; then, if `softcap` is set, `s = softcap * tanh(s / softcap)`; then,
//! with ALiBi slopes, `s -= slope[h] * |j - (i + seq_k - seq_q)|`; then the mask; then the softmax.
//! The log-sum-exp returned by [`attention_with_lse`] is `ln(sum_j exp(s_ij))` over visible keys.
//! With [`AttnParams::sinks`] each row's softmax has one more term, `exp(sinks[h])`, that carries
//! no value: the output is scaled by `1 / (1 + exp(sinks[h] - lse))` and the log-sum-exp
//! includes it; a row that sees no key then has LSE `sinks[h]` (its output stays zeros).
//!
//! ## Non-finite values
//! Scores are computed in f32 (f64 for f64 inputs). `softmax_scale` must be finite (any finite
//! value, `f32::MAX` included; the GPU kernels take `0 < scale <= 1024`), `softcap` finite and
//! `> 0`:
//! otherwise an error. The dot product is scaled where that keeps it finite: a scale of at most
//! 1 in magnitude multiplies q first, a larger one the dot product, so a score is finite
//! whenever `sum_x |scale * q_x * k_x|` is. Then, per query row, over the keys it sees:
//! - a score of `-inf` gives that key weight 0; a row whose scores are all `-inf` (or that sees
//!   no key) outputs zeros with LSE `-inf`;
//! - scores of `+inf` share the row's weight equally (the softmax's limit), LSE `+inf`;
//! - a NaN score makes the row NaN (O and LSE), as does a non-finite ALiBi slope for every row
//!   of its head;
//! - NaN or Inf in the row's own q, or in a K or V row it sees, propagates as in plain IEEE
//!   arithmetic (`0 * inf` is NaN, as in torch); K and V rows it does not see (masked, past a
//!   sequence's length, another sequence's) never reach it on the CPU.
//!
//! The CPU path follows these rules exactly; see the README's numeric contract for the GPU.
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
//! Backward is not implemented: using the output, or the log-sum-exp of the `_with_lse`
//! functions, in a backward pass returns `candle_core::Error::BackwardNotSupported`.

mod cache;
mod chunk;
mod fp8;
mod knobs;
mod merge;
mod op;
mod params;
pub mod plan;
mod reference;

#[cfg(feature = "cuda")]
pub mod cuda;

pub use cache::PagedKvCache;
pub use fp8::E4M3_MAX;
pub use merge::merge_states;
pub use params::{
    AttnParams, KvScales, Mask, GPU_MAX_HEAD_DIM, MAX_HEAD_DIM, MAX_QK_HEAD_DIM, SM90_MAX_HEAD_DIM,
    SUPPORTED_HEAD_DIMS,
};

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

/// Attention over a packed batch of sequences of different lengths (see the crate docs): q
/// `(total_q, heads_q, head_dim)`, k/v `(total_k, heads_kv, head_dim)` (v may have its own head
/// dim), `cu_seqlens_q` / `cu_seqlens_k` u32 `(batch + 1,)` prefix sums on q's device,
/// `max_seqlen_q` / `max_seqlen_k` at least every sequence's length. Returns `(total_q, heads_q,
/// v's head_dim)`. ALiBi slopes may be
/// `(heads_q,)` or `(batch, heads_q)`. One kernel launch for the whole batch on the GPU.
#[allow(clippy::too_many_arguments)]
pub fn attention_varlen(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cu_seqlens_q: &Tensor,
    cu_seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    params: &AttnParams,
) -> Result<Tensor> {
    let seqs = op::Varlen {
        cu_q: cu_seqlens_q,
        cu_k: cu_seqlens_k,
        max_q: max_seqlen_q,
        max_k: max_seqlen_k,
    };
    op::run_varlen(q, k, v, &seqs, params, false).map(|(o, _)| o)
}

/// Like [`attention_varlen`], also returning the log-sum-exp of each query row, `(heads_q,
/// total_q)` f32 (natural log; `-inf` for rows that see no key).
#[allow(clippy::too_many_arguments)]
pub fn attention_varlen_with_lse(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cu_seqlens_q: &Tensor,
    cu_seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    params: &AttnParams,
) -> Result<(Tensor, Tensor)> {
    let seqs = op::Varlen {
        cu_q: cu_seqlens_q,
        cu_k: cu_seqlens_k,
        max_q: max_seqlen_q,
        max_k: max_seqlen_k,
    };
    let (o, lse) = op::run_varlen(q, k, v, &seqs, params, true)?;
    let lse =
        lse.ok_or_else(|| candle_core::Error::Msg("flashcore: internal: lse missing".into()))?;
    Ok((o, lse))
}

/// Attention over a paged KV cache (as vLLM, FlashInfer and FlashAttention's `page_table` /
/// `block_table`): q `(batch, seq_q, heads_q, head_dim)`; `k_pages` / `v_pages` pools `(num_pages,
/// page_size, heads_kv, head_dim)` (the V pool may have its own head dim); `page_table` u32 `(batch, max_pages_per_seq)`, sequence `i`'s
/// key `j` living in row `j % page_size` of page `page_table[i][j / page_size]`; `seqlens_k` u32
/// `(batch,)` the keys of each sequence (at most `max_pages_per_seq * page_size`). All on q's
/// device. Every option applies as in [`attention`], with each sequence's own `seq_k` (masks stay
/// bottom-right: the new queries are the last `seq_q` positions of the sequence). Any page size
/// works (16 and 64 are what serving engines use). Returns `(batch, seq_q, heads_q, v's
/// head_dim)`.
///
/// Checks: on the CPU every table value is checked on the host (a page id outside the pool, or a
/// length beyond the table, is an error naming the argument). On a GPU reading the tables would
/// cost a device sync: the kernels clamp every page id into the pool and every length into the
/// table, so nothing outside the pools is ever read, and the rows (O and LSE) of a sequence whose
/// table lies are filled with NaN (the other sequences' rows keep their values; a lying length
/// can move their split boundaries, so their rounding, in a decode balanced over the batch's
/// lengths). On the GPU, `seq_q <= 16` (decode) reads K/V through the page table inside the
/// split-KV kernel, its splits balanced over the lengths of a batch of 2..32 sequences. Longer queries on sm_90 run the prefill kernels on the
/// pool through the page table (TMA boxes of up to the page size, each inside one page) when the
/// page size is a power of two of at least 32 rows; otherwise (smaller or odd pages, sm_80-class
/// GPUs, softcap or ALiBi below d256) the pages are first gathered into a dense scratch (one copy
/// of the batch's keys, `batch * max_pages_per_seq * page_size` rows).
pub fn attention_paged(
    q: &Tensor,
    k_pages: &Tensor,
    v_pages: &Tensor,
    page_table: &Tensor,
    seqlens_k: &Tensor,
    params: &AttnParams,
) -> Result<Tensor> {
    let kv = op::PagedKv {
        k_pages,
        v_pages,
        page_table,
        seqlens_k,
    };
    op::run_paged(q, &kv, None, params, false).map(|(o, _)| o)
}

/// Like [`attention_paged`], also returning the log-sum-exp `(batch, heads_q, seq_q)` f32.
pub fn attention_paged_with_lse(
    q: &Tensor,
    k_pages: &Tensor,
    v_pages: &Tensor,
    page_table: &Tensor,
    seqlens_k: &Tensor,
    params: &AttnParams,
) -> Result<(Tensor, Tensor)> {
    let kv = op::PagedKv {
        k_pages,
        v_pages,
        page_table,
        seqlens_k,
    };
    let (o, lse) = op::run_paged(q, &kv, None, params, true)?;
    Ok((o, lse_or_internal(lse)?))
}

/// [`attention_paged`] with packed queries of different lengths, for chunked prefill over a
/// cached prefix and mixed prefill/decode batches: q `(total_q, heads_q, head_dim)` with u32
/// prefix sums `cu_seqlens_q` `(batch + 1,)` and `max_seqlen_q` bounding every sequence's query
/// rows (as [`attention_varlen`]); the keys come from the paged cache (sequence `i` has
/// `seqlens_k[i]` keys, its queries being the last `seq_q_i` of them under the bottom-right
/// masks). Returns `(total_q, heads_q, v's head_dim)`.
#[allow(clippy::too_many_arguments)]
pub fn attention_paged_varlen(
    q: &Tensor,
    k_pages: &Tensor,
    v_pages: &Tensor,
    page_table: &Tensor,
    seqlens_k: &Tensor,
    cu_seqlens_q: &Tensor,
    max_seqlen_q: usize,
    params: &AttnParams,
) -> Result<Tensor> {
    let kv = op::PagedKv {
        k_pages,
        v_pages,
        page_table,
        seqlens_k,
    };
    op::run_paged(q, &kv, Some((cu_seqlens_q, max_seqlen_q)), params, false).map(|(o, _)| o)
}

/// Like [`attention_paged_varlen`], also returning the log-sum-exp `(heads_q, total_q)` f32.
#[allow(clippy::too_many_arguments)]
pub fn attention_paged_varlen_with_lse(
    q: &Tensor,
    k_pages: &Tensor,
    v_pages: &Tensor,
    page_table: &Tensor,
    seqlens_k: &Tensor,
    cu_seqlens_q: &Tensor,
    max_seqlen_q: usize,
    params: &AttnParams,
) -> Result<(Tensor, Tensor)> {
    let kv = op::PagedKv {
        k_pages,
        v_pages,
        page_table,
        seqlens_k,
    };
    let (o, lse) = op::run_paged(q, &kv, Some((cu_seqlens_q, max_seqlen_q)), params, true)?;
    Ok((o, lse_or_internal(lse)?))
}

/// Writes new keys and values into paged pools in place: `k_new` / `v_new` `(batch, n_new,
/// heads_kv, head_dim)` (each at its pool's head dim, which may differ), row `j` of sequence `i` going to position `positions[i] + j` (u32
/// `(batch,)`, usually the sequence's length before the append), i.e. row `pos % page_size` of
/// page `page_table[i][pos / page_size]`. Pools `(num_pages, page_size, heads_kv, head_dim)` of
/// the new rows' dtype (V's head dim may differ from K's); the tables on the pools' device. One launch per pool for the whole batch
/// on the GPU. On the CPU every position and page id is checked (an error names the argument and
/// nothing is written); on a GPU a row whose position is beyond the table or whose page id is not
/// a page of the pool is skipped (never written outside the pool), unchecked.
///
/// Checked before anything is written, on every device: the pools' head dim must be contiguous
/// (as [`attention_paged`] requires), `k_pages` and `v_pages` must be different tensors, and
/// neither `k_new` nor `v_new` may be a view of a pool. On the CPU two new rows of the batch
/// writing the same pool row is an error too; on a GPU (whose tables are not read on the host)
/// such rows race and one of them is kept.
pub fn append_kv_paged(
    k_new: &Tensor,
    v_new: &Tensor,
    k_pages: &Tensor,
    v_pages: &Tensor,
    page_table: &Tensor,
    positions: &Tensor,
) -> Result<()> {
    op::append_kv_paged(
        k_new, v_new, k_pages, v_pages, page_table, positions, None, None,
    )
}

/// [`append_kv_paged`] for packed new rows of different counts: `k_new` / `v_new` `(total_new,
/// heads_kv, head_dim)` with u32 prefix sums `cu_seqlens_new` `(batch + 1,)`; sequence `i`'s rows
/// `cu[i]..cu[i + 1]` go to positions `positions[i]..`.
#[allow(clippy::too_many_arguments)]
pub fn append_kv_paged_varlen(
    k_new: &Tensor,
    v_new: &Tensor,
    k_pages: &Tensor,
    v_pages: &Tensor,
    page_table: &Tensor,
    cu_seqlens_new: &Tensor,
    positions: &Tensor,
) -> Result<()> {
    op::append_kv_paged(
        k_new,
        v_new,
        k_pages,
        v_pages,
        page_table,
        positions,
        Some(cu_seqlens_new),
        None,
    )
}

/// `x` `(..., heads, head_dim)` (f16, bf16, f32 or f64; on a GPU bf16, f16 or f32) stored as
/// F8E4M3: `x / scale[h]` for head `h`, saturated to ±[`E4M3_MAX`] and rounded to e4m3 (NaN
/// stays NaN). `scale`: f32 `(heads,)` or `(1,)` on `x`'s device. This is how the FP8 appends
/// store rows, for K/V kept as dense tensors; on a GPU it runs flashcore's own kernel (candle
/// 0.11 cannot cast to or from F8E4M3 there).
pub fn quantize_e4m3(x: &Tensor, scale: &Tensor) -> Result<Tensor> {
    fp8::quantize_public(x, scale)
}

/// F8E4M3 `x` `(..., heads, head_dim)` read back as `stored * scale[h]` in `dtype` (one
/// rounding; on a GPU bf16, f16 or f32), the inverse of [`quantize_e4m3`] up to e4m3's rounding.
pub fn dequantize_e4m3(x: &Tensor, scale: &Tensor, dtype: candle_core::DType) -> Result<Tensor> {
    fp8::dequantize_public(x, scale, dtype)
}

/// [`append_kv_paged`] into F8E4M3 pools (an FP8 KV cache): each new row `x` (f16, bf16, f32 or
/// f64) of K/V head `h` is stored as `x / scale[h]` saturated to ±[`E4M3_MAX`] and rounded to
/// e4m3 (NaN stays NaN); attention reads it back with the same [`KvScales`] in
/// `AttnParams::kv_scales`. On a GPU the quantization runs there and the append kernel moves
/// the bytes (head dims that are multiples of 16).
#[allow(clippy::too_many_arguments)]
pub fn append_kv_paged_fp8(
    k_new: &Tensor,
    v_new: &Tensor,
    k_pages: &Tensor,
    v_pages: &Tensor,
    page_table: &Tensor,
    positions: &Tensor,
    scales: &KvScales,
) -> Result<()> {
    op::append_kv_paged(
        k_new,
        v_new,
        k_pages,
        v_pages,
        page_table,
        positions,
        None,
        Some(scales),
    )
}

/// [`append_kv_paged_varlen`] into F8E4M3 pools, quantizing as [`append_kv_paged_fp8`] does.
#[allow(clippy::too_many_arguments)]
pub fn append_kv_paged_varlen_fp8(
    k_new: &Tensor,
    v_new: &Tensor,
    k_pages: &Tensor,
    v_pages: &Tensor,
    page_table: &Tensor,
    cu_seqlens_new: &Tensor,
    positions: &Tensor,
    scales: &KvScales,
) -> Result<()> {
    op::append_kv_paged(
        k_new,
        v_new,
        k_pages,
        v_pages,
        page_table,
        positions,
        Some(cu_seqlens_new),
        Some(scales),
    )
}

fn lse_or_internal(lse: Option<Tensor>) -> Result<Tensor> {
    lse.ok_or_else(|| candle_core::Error::Msg("flashcore: internal: lse missing".into()))
}

/// The same function as [`attention`] composed of plain candle ops (matmul, mask, softmax,
/// matmul) in f32 (f64 for f64 inputs) and cast back to the input dtype, with K/V repeated for
/// GQA, following the same rules for masks, ALiBi slopes (`(heads_q,)` or `(batch, heads_q)`) and
/// non-finite values. The `_slow` twin used by tests and the benchmark's `eager` backend; it
/// materialises the full score matrix (split over the batch and KV-head groups when an
/// intermediate would exceed 2^30 elements).
pub fn attention_slow(q: &Tensor, k: &Tensor, v: &Tensor, params: &AttnParams) -> Result<Tensor> {
    reference::eager(q, k, v, params)
}
