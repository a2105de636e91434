// flashcore: device helpers for online softmax and band masks, shared by the forward kernels.
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

#ifndef FC_NEG_INF
#define FC_NEG_INF (-__int_as_float(0x7f800000))
#endif

namespace fc {

// 2^x with the SFU (ex2.approx.ftz): exp2(-inf) = +0.
__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

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

// Softcap (Gemma 2 style, p.softcap = c > 0): the score scale * q.k becomes c * tanh(scale * q.k / c).
// The kernels keep t = tanh(q.k * (scale / c)) in place of the raw score, so the kept scores'
// unit is c instead of scale: exp2 factor c * log2(e), LSE = m * c + ln(l). tanh through one
// exp2 and one fast division: 1 - 2 / (1 + e^2x) (+-1 at +-inf, absolute error ~1e-7, i.e. ~c
// * 1e-7 on the score; tanh.approx's 2^-11 relative error would be c * 5e-4 there).
__device__ __forceinline__ float softcap_tanh(float x) {
    return 1.f - __fdividef(2.f, 1.f + exp2_approx(x * 2.8853900817779268f));
}
// The unit of the kept scores (LSE factor) and its exp2 factor, with or without softcap.
__device__ __forceinline__ float score_unit(float scale, float softcap) { return softcap > 0.f ? softcap : scale; }
__device__ __forceinline__ float score_unit_log2(float scale_log2, float softcap) {
    return softcap > 0.f ? softcap * 1.4426950408889634f : scale_log2;
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

// A finished row with a sink (AttnParams::sinks: one more logit, natural-log units, with no
// value). mn: the row's reference max in natural-log units (any finite value while l > 0), l: the
// row's sum of e^(s - mn). Writes the natural-log LSE including the sink and returns the factor
// for the row's unnormalised O: e^(mn - mt) / (l e^(mn - mt) + e^(sink - mt)), mt = max(mn, sink)
// (so neither exponent is positive). The term of whichever is the max is exactly 1: a +inf sink
// gives O = 0 and LSE +inf, a NaN sink NaN. A row with no weight (l = 0: it saw no key, or only
// -inf scores) has O = 0 and LSE = the sink; l NaN (a NaN score) stays NaN. Callers take
// finalize_row for a sink of -inf instead (unswitched: fc::Flag), so that no sink is bit for bit
// the kernel without sinks.
__device__ __forceinline__ float finalize_sink(float mn, float l, float sink, float& lse) {
    if (!(l > 0.f)) {
        lse = sink + l;  // l is 0 or NaN
        return 0.f;
    }
    const float mt = fmaxf(mn, sink);  // a NaN sink is dropped here and caught by `b`
    const float a = mn >= mt ? 1.f : __expf(mn - mt);
    const float b = sink >= mt ? 1.f : __expf(sink - mt);
    const float lt = fmaf(l, a, b);
    lse = mt + __logf(lt);
    return a / lt;
}

// A compile-time flag for code that a runtime check unswitches (`if (x) f(Flag<true>{}); else
// f(Flag<false>{});`): each branch compiled on its own, no join inside an unrolled loop.
template <bool B>
struct Flag {
    static constexpr bool value = B;
};

// Bottom-right aligned band of visible keys for query row i: keys j with lo <= j < hi.
// MASK_ID: 0 none, 1 causal, 2 local window with runtime bounds (negative = unbounded).
template <int MASK_ID>
__device__ __forceinline__ void band_limits(int row, int sq, int sk, int window_left,
                                            int window_right, int& lo, int& hi) {
    const int diag = row + sk - sq;
    lo = 0;
    hi = sk;
    if (MASK_ID == 1) {
        hi = min(hi, diag + 1);
    } else if (MASK_ID == 2) {
        if (window_right >= 0) hi = min(hi, diag + window_right + 1);
        if (window_left >= 0) lo = max(lo, diag - window_left);
    }
}

__device__ __forceinline__ int floor_div(int a, int b) {  // b > 0
    return a >= 0 ? a / b : -((-a + b - 1) / b);
}

// Key-tile range [n_min, n_max) (tiles of BN keys) visible to query rows [r0, r1] (inclusive,
// r1 >= r0). Empty when n_max <= n_min.
template <int MASK_ID, int BN>
__device__ __forceinline__ void key_tile_range(int r0, int r1, int sq, int sk, int window_left,
                                               int window_right, int& n_min, int& n_max) {
    n_min = 0;
    n_max = (sk + BN - 1) / BN;
    if (MASK_ID == 1) {
        n_max = min(n_max, floor_div(r1 + sk - sq, BN) + 1);
    } else if (MASK_ID == 2) {
        if (window_right >= 0) n_max = min(n_max, floor_div(r1 + sk - sq + window_right, BN) + 1);
        if (window_left >= 0) n_min = max(0, floor_div(r0 + sk - sq - window_left, BN));
    }
}

// Does key tile nb (keys [nb*BN, nb*BN+BN)) need per-element masking for rows [r0, r1]?
template <int MASK_ID, int BN>
__device__ __forceinline__ bool tile_needs_mask(int nb, int r0, int r1, int sq, int sk,
                                                int window_left, int window_right) {
    const int c0 = nb * BN, c1 = nb * BN + BN - 1;
    bool need = c1 >= sk;
    if (MASK_ID == 1) {
        need |= c1 > r0 + sk - sq;
    } else if (MASK_ID == 2) {
        if (window_right >= 0) need |= c1 > r0 + sk - sq + window_right;
        if (window_left >= 0) need |= c0 < r1 + sk - sq - window_left;
    }
    return need;
}

}  // namespace fc
