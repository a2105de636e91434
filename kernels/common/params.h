// flashcore kernel ABI: the one parameter block every forward kernel takes by value.
// Mirrored field for field by `FcParams` in kernels/params.rs (#[repr(C)]); build.rs asserts every
// field's offset and size and the struct's size here at compile time, so change both together.
#pragma once
#include <stdint.h>

struct FcParams {
    // Inputs: q (b, sq, hq, d), k/v (b, sk, hkv, d); any strides, last dim contiguous (stride 1).
    // Variable-length batches: q (total_q, hq, d), k/v (total_k, hkv, d) with batch strides 0;
    // where sequence bi's rows and keys live is `seq_range` (common/seqlens.cuh), the one place
    // every kernel reads it from.
    const void* q;
    const void* k;
    const void* v;
    // Output (b, sq, hq, d) in the input dtype, and log-sum-exp (b, hq, sq) f32, both contiguous.
    void* o;
    float* lse;
    // ALiBi slopes f32, (hq,) or (b, hq) (alibi_batch_stride 0 or hq), or null. Bias added to
    // row i, key j of sequence bi, head h: -slopes[bi * alibi_batch_stride + h] * |j - (i + sk - sq)|.
    const float* alibi_slopes;
    // Attention sinks f32 (hq,), or null: one more natural-log logit per query head in every row's
    // softmax, without a value. Only the row's normaliser and LSE change, so the kernels fold it
    // in where a row is finished (fc::finalize_sink, common/softmax.cuh; the split-KV decode
    // in its combine, or in the split kernel when there is one split). -inf is exactly no sink.
    const float* sinks;
    // Split-KV scratch (decode): partial O (num_splits, b, hq, sq, dv) f32 and LSE (num_splits, b, hq, sq).
    float* o_partial;
    float* lse_partial;
    // Strides in elements.
    int64_t q_batch_stride, q_row_stride, q_head_stride;
    int64_t k_batch_stride, k_row_stride, k_head_stride;
    int64_t v_batch_stride, v_row_stride, v_head_stride;
    int64_t o_batch_stride, o_row_stride, o_head_stride;
    // LSE of (sequence bi, head h, row r): lse[bi * lse_batch_stride + h * lse_head_stride + q0 + r]
    // (q0: the sequence's first row, 0 when dense). Dense (b, hq, sq): hq * sq, sq. Varlen
    // (hq, total_q): 0, total_q.
    int64_t lse_batch_stride, lse_head_stride;
    // Where sequence bi lives (null = dense: every sequence has sq query rows and sk keys at batch
    // index bi). cu_seqlens_q / cu_seqlens_k: (b + 1) prefix sums into the packed rows (u32 read as
    // int32; clamped into [0, total_q] / [0, total_k] and monotone, so a lying table can make a
    // wrong answer, which the check kernel turns into NaN, but never an out-of-bounds access).
    const int32_t* cu_seqlens_q;
    const int32_t* cu_seqlens_k;
    // (b,) keys in use per sequence (<= its key range), or null. Paged caches: page_table (b,
    // page_table_stride) of page ids into k/v pools of page_size rows (common/seqlens.cuh), or null.
    const int32_t* seqused_k;
    const int32_t* page_table;
    int32_t page_table_stride, page_size;
    int32_t total_q, total_k;  // rows of the packed q and k/v (varlen); sq, sk when dense
    int32_t alibi_batch_stride;
    // sm90 forward over a paged pool: log2(page_size) (page sizes 2^4..; sm90/fwd.cuh); 0 otherwise.
    int32_t page_shift;
    // b: sequences; sq, sk: query rows and keys per sequence (varlen: max_seqlen_q / _k, the
    // bounds the grid is sized by; longer sequences are clamped there and flagged by the check
    // kernel). d: the head dim of the data (<= the kernel's HEAD_DIM; the kernels zero-fill the
    // columns d..HEAD_DIM in shared memory and never store them).
    int32_t b, hq, hkv, sq, sk, d;
    int32_t h_ratio;        // hq / hkv: query head h reads K/V head h / h_ratio
    float scale;            // softmax scale (applied to q.k before softcap/alibi/mask)
    float scale_log2;       // scale * log2(e)
    float softcap;          // > 0: s = softcap * tanh(s / softcap) after scaling; 0: off
    // Bottom-right aligned band: row i sees key j iff
    //   j >= i + sk - sq - window_left   (window_left  < 0: no lower bound)
    //   j <= i + sk - sq + window_right  (window_right < 0: no upper bound)
    // causal = (window_left -1, window_right 0); no mask = (-1, -1).
    int32_t window_left;
    int32_t window_right;
    int32_t num_splits;     // split-KV decode: number of key-range splits (1 = none)
    int32_t combine_checks; // 1: the split-KV combine checks the tables itself (fc::prefix_sums_lie,
                            // fc::pages_lie) and the host launches no fc_check_seqlens after it
    int32_t split_budget;   // split-KV decode: > 0 balances the splits over the batch's lengths
                            // (sm80/decode.cuh balanced_tps); 0: even splits of p.sk
    int32_t kv_scale_stride;  // FP8 K/V: k_scales[kvh * kv_scale_stride] (1 per head, 0 per tensor)
    // sm90 forward, persistent grid: a zeroed int32 the CTAs draw their next tile from (dynamic
    // schedule), or null for the static round-robin schedule. Ignored by the sm80 kernels.
    int32_t* tile_counter;
    // FP8 (e4m3) K/V, read by the split-KV decode's `_e4m3` kernels only, null otherwise: f32
    // scales, real value = stored value * scale of its K/V head (AttnParams::kv_scales).
    const float* k_scales;
    const float* v_scales;
    // Head dim of v and o (d_v), <= the kernel's HEAD_DIM like d (which is q's and k's, d_qk): V
    // columns dv..HEAD_DIM are zero-filled in shared memory and O stores dv columns. Kernels that
    // take only d_v == d_qk are never launched with another (the planner, src/plan/).
    int32_t dv;
};

// What a compiled kernel needs from its launch and what it can compute, stated by its
// instantiation macro (sm80/fwd.cuh, sm80/decode.cuh, sm90/fwd.cuh) as `fc_facts_<symbol>`. The
// generated translation unit asserts at compile time that every field equals what the variant
// table (kernels/variants.rs) states about that kernel, so the host launch and the kernel agree
// by construction, not by comment.
struct FcKernelFacts {
    uint32_t smem_bytes;  // dynamic shared memory the kernel is launched with (`smem_bytes`)
    bool softcap_body;    // computes softcap / ALiBi scores (`computes_modifiers`)
    bool tma_pages;       // reads a paged K/V pool through the page table by TMA (`tma_pages`)
    bool paged_twin;      // reads K/V only from a paged pool, one box per page (`paged`)
    bool kv_split;        // a key-split twin, launched in clusters (`kv_split`)
    int width;            // head-dim columns computed: HEAD_DIM, or a narrow twin's (`width`)
    int q_stages;         // Q buffers (`q_stages`)
    int v_width;          // sm90 forward: V / O columns computed, `width` but for a separate-V
                          // kernel (`v_width()`); 0 (not asserted) in the other families
};
