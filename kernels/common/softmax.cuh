// flashcore: device helpers for online softmax, shared by the kernel families (masks:
// common/mask.cuh; score modifiers and the sink: common/variants.cuh).
//
// Conventions (see common/params.h):
//  * scores s are kept in raw q.k units; the running row max m is in raw units too, and
//    p = exp2(s * scale_log2 - m * scale_log2) is one FFMA plus ex2.approx.
//  * a row that has seen no visible key has m = -inf; fc_max_scaled() maps it to 0 so that
//    exp2(-inf - 0) = 0 and never (-inf) - (-inf) = NaN.
//  * mma.sync accumulator rows are spread over the 4 lanes of a quad (lane & 3), so row
//    reductions end with two xor-shuffles (fc_quad_max / fc_quad_sum).
//  * LSE is natural-log: lse = m * scale + ln(l); an empty row (l == 0) gives -inf and O = 0.
#pragma once
#include <stdint.h>
#include "ptx.cuh"
#include "variants.cuh"

#ifndef FC_NEG_INF
#define FC_NEG_INF (-__int_as_float(0x7f800000))
#endif

namespace fc {

__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return x;
}

__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 2);
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x;
}

// Row max in exp2 units, with the empty-row guard (m = -inf -> 0).
__device__ __forceinline__ float max_scaled(float m, float scale_log2) {
    return m == FC_NEG_INF ? 0.f : m * scale_log2;
}

// One online-softmax step for a row: given the old max m_old (raw units) and the new max m_new
// (raw units, already quad-reduced), returns the rescale factor alpha for O and l, and sets
// m_scaled (the exp2 bias to subtract from s * scale_log2 for this tile).
__device__ __forceinline__ float online_rescale(float m_old, float m_new, float scale_log2,
                                                float& m_scaled) {
    m_scaled = max_scaled(m_new, scale_log2);
    // m_old = -inf gives exp2(-inf) = 0: O and l are still zero then, so 0 * 0 = 0.
    return exp2_approx(m_old * scale_log2 - m_scaled);
}

// Lazy online-softmax step (sm80 FWD_LAZY, sm90 always): the row's reference max m (raw units)
// moves to m_new (the row max so far, quad-reduced) only at the row's first visible key or when
// m_new exceeds it by more than LAZY_RESCALE_LOG2 in exp2 units, so P <= 2^8 (exact in f32, the
// usual relative rounding in bf16/fp16); O, l and the LSE all use the same reference. Returns
// alpha for O and l: 1 while the reference stays, and at the first visible key (O and l are still
// zero), so callers rescale O only when some row of the warp returned alpha != 1 (a warp vote).
// Sets m_scaled, the exp2 bias of this tile. Needs scale_log2 > 0: the dispatcher refuses others.
constexpr float LAZY_RESCALE_LOG2 = 8.f;
__device__ __forceinline__ float lazy_rescale(float& m, float m_new, float scale_log2, float& m_scaled) {
    const bool first = m == FC_NEG_INF;
    // (-inf) - (-inf) = NaN compares false: a row with no visible key yet stays at -inf
    const bool up = (m_new - m) * scale_log2 > LAZY_RESCALE_LOG2;
    m_scaled = max_scaled(up ? m_new : m, scale_log2);
    const float alpha = up && !first ? exp2_approx(m * scale_log2 - m_scaled) : 1.f;
    if (up) m = m_new;
    return alpha;
}

// Final normalisation of a row: returns 1/l (0 for an empty row) and writes the natural-log LSE.
__device__ __forceinline__ float finalize_row(float m, float l, float scale, float& lse) {
    const bool empty = !(l > 0.f);  // also catches NaN
    lse = empty ? FC_NEG_INF : m * scale + __logf(l);
    return empty ? 0.f : 1.f / l;
}

// A compile-time flag for code that a runtime check unswitches (`if (x) f(Flag<true>{}); else
// f(Flag<false>{});`): each branch compiled on its own, no join inside an unrolled loop.
template <bool B>
struct Flag {
    static constexpr bool value = B;
};

}  // namespace fc
