// The kernel parameter block, the Rust side of kernels/common/params.h. Plain Rust with no
// dependencies: src/cuda/params.rs `include!`s it to fill the block, and build.rs `include!`s it
// to emit a `static_assert` per field (offset and size) and for the whole struct's size into each
// generated translation unit, so a layout that drifts from the C struct fails the build.
// Field meanings are documented once, in params.h.

/// Declares `FcParams` and `FC_PARAMS_LAYOUT`, (field, offset, size) of every field in order.
macro_rules! fc_params {
    ($($(#[$doc:meta])* $field:ident: $ty:ty,)*) => {
        /// Passed by value to every kernel (`const __grid_constant__ FcParams p`); field for field
        /// the struct of kernels/common/params.h (checked at build time).
        #[repr(C)]
        #[derive(Clone, Copy, Debug, Default)]
        pub struct FcParams {
            $($(#[$doc])* pub $field: $ty,)*
        }

        /// Every field of [`FcParams`] as (name, byte offset, byte size), in declaration order.
        pub const FC_PARAMS_LAYOUT: &[(&str, usize, usize)] = &[
            $((stringify!($field), std::mem::offset_of!(FcParams, $field), std::mem::size_of::<$ty>()),)*
        ];
    };
}

fc_params! {
    q: u64,
    k: u64,
    v: u64,
    o: u64,
    lse: u64,
    alibi_slopes: u64,
    /// Attention sinks f32 (hq,), natural-log logits, or 0.
    sinks: u64,
    o_partial: u64,
    lse_partial: u64,
    q_batch_stride: i64,
    q_row_stride: i64,
    q_head_stride: i64,
    k_batch_stride: i64,
    k_row_stride: i64,
    k_head_stride: i64,
    v_batch_stride: i64,
    v_row_stride: i64,
    v_head_stride: i64,
    o_batch_stride: i64,
    o_row_stride: i64,
    o_head_stride: i64,
    lse_batch_stride: i64,
    lse_head_stride: i64,
    /// Varlen: (b + 1) i32 prefix sums into the packed rows of q / k, or 0 (dense).
    cu_seqlens_q: u64,
    cu_seqlens_k: u64,
    /// (b,) keys used per sequence, or 0.
    seqused_k: u64,
    /// Paged KV: page table (b, page_table_stride) i32, or 0.
    page_table: u64,
    page_table_stride: i32,
    page_size: i32,
    total_q: i32,
    total_k: i32,
    alibi_batch_stride: i32,
    /// sm90 forward over a paged pool: log2(page_size); 0 otherwise.
    page_shift: i32,
    b: i32,
    hq: i32,
    hkv: i32,
    sq: i32,
    sk: i32,
    d: i32,
    h_ratio: i32,
    scale: f32,
    scale_log2: f32,
    softcap: f32,
    window_left: i32,
    window_right: i32,
    num_splits: i32,
    /// 1: the split-KV combine checks the tables itself (no `fc_check_seqlens` after it).
    combine_checks: i32,
    /// Split-KV decode: > 0 balances the splits over the batch's lengths (at most
    /// `b * split_budget + b / 2` splits in all); 0: even splits of `sk`.
    split_budget: i32,
    /// FP8 K/V (`k_scales`): 1 when the scales are per K/V head, 0 for one per tensor.
    kv_scale_stride: i32,
    /// sm90 forward: zeroed i32 for the dynamic tile schedule, or 0 (static).
    tile_counter: u64,
    /// FP8 K/V (the `_e4m3` decode kernels): f32 scales of K and V, or 0.
    k_scales: u64,
    v_scales: u64,
    /// Head dim of v and o (d_v); `d` is q's and k's.
    dv: i32,
}
