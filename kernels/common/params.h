// flashcore kernel ABI: the one parameter block every forward kernel takes by value.
// Mirrored field for field by `FcParams` in src/cuda/params.rs (#[repr(C)]); change both together.
#pragma once
#include <stdint.h>

struct FcParams {
    // Inputs: q (b, sq, hq, d), k/v (b, sk, hkv, d); any strides, last dim contiguous (stride 1).
    const void* q;
    const void* k;
    const void* v;
    // Output (b, sq, hq, d) in the input dtype, and log-sum-exp (b, hq, sq) f32, both contiguous.
    void* o;
    float* lse;
    // ALiBi slopes (hq,) f32, or null. Bias added to row i, key j: -slope * |j - (i + sk - sq)|.
    const float* alibi_slopes;
    // Split-KV scratch (decode): partial O (num_splits, b, hq, sq, d) f32 and LSE (num_splits, b, hq, sq).
    float* o_partial;
    float* lse_partial;
    // Strides in elements.
    int64_t q_batch_stride, q_row_stride, q_head_stride;
    int64_t k_batch_stride, k_row_stride, k_head_stride;
    int64_t v_batch_stride, v_row_stride, v_head_stride;
    int64_t o_batch_stride, o_row_stride, o_head_stride;
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
    int32_t _pad;
    // sm90 forward, persistent grid: a zeroed int32 the CTAs draw their next tile from (dynamic
    // schedule), or null for the static round-robin schedule. Ignored by the sm80 kernels.
    int32_t* tile_counter;
};
