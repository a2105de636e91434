//! `FcParams`: the kernel parameter block, field for field the struct of kernels/common/params.h.

/// Passed by value to every forward kernel (`const __grid_constant__ FcParams p`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct FcParams {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub o: u64,
    pub lse: u64,
    pub alibi_slopes: u64,
    pub o_partial: u64,
    pub lse_partial: u64,
    pub q_batch_stride: i64,
    pub q_row_stride: i64,
    pub q_head_stride: i64,
    pub k_batch_stride: i64,
    pub k_row_stride: i64,
    pub k_head_stride: i64,
    pub v_batch_stride: i64,
    pub v_row_stride: i64,
    pub v_head_stride: i64,
    pub o_batch_stride: i64,
    pub o_row_stride: i64,
    pub o_head_stride: i64,
    pub lse_batch_stride: i64,
    pub lse_head_stride: i64,
    /// Varlen: (b + 1) i32 prefix sums into the packed rows of q / k, or 0 (dense).
    pub cu_seqlens_q: u64,
    pub cu_seqlens_k: u64,
    /// (b,) keys used per sequence, or 0.
    pub seqused_k: u64,
    /// Paged KV: page table (b, page_table_stride) i32, or 0.
    pub page_table: u64,
    pub page_table_stride: i32,
    pub page_size: i32,
    pub total_q: i32,
    pub total_k: i32,
    pub alibi_batch_stride: i32,
    /// sm90 forward over a paged pool: log2(page_size); 0 otherwise.
    pub page_shift: i32,
    pub b: i32,
    pub hq: i32,
    pub hkv: i32,
    pub sq: i32,
    pub sk: i32,
    pub d: i32,
    pub h_ratio: i32,
    pub scale: f32,
    pub scale_log2: f32,
    pub softcap: f32,
    pub window_left: i32,
    pub window_right: i32,
    pub num_splits: i32,
    /// 1: the split-KV combine checks the tables itself (no `fc_check_seqlens` after it).
    pub combine_checks: i32,
    /// Split-KV decode: > 0 balances the splits over the batch's lengths (at most
    /// `b * split_budget + b / 2` splits in all); 0: even splits of `sk`.
    pub split_budget: i32,
    pub _pad: i32,
    /// sm90 forward: zeroed i32 for the dynamic tile schedule, or 0 (static).
    pub tile_counter: u64,
}

// SAFETY: plain-old-data with the C layout the kernels declare.
unsafe impl cudarc::driver::DeviceRepr for FcParams {}

const _: () = assert!(std::mem::size_of::<FcParams>() == 8 * 8 + 14 * 8 + 4 * 8 + 22 * 4 + 8);
