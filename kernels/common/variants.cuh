// flashcore: score modifiers, the per-score changes an attention variant makes between Q.K^T and
// the softmax, and the sink, its change to the normaliser. Each is a small value built once per
// tile (or row) from the parameters and applied per score, so the kernels share the arithmetic
// and keep their own loops over their accumulator layouts:
//   NoScoreMod   identity;
//   Softcap      s -> tanh(s * scale / cap) (the kept scores' unit becomes cap);
//   Alibi        s -> max(s - slope * |key - diag|, floor);
//   Sink         one more logit in the row's normaliser (finalize).
// Order inside a kernel: softcap, then ALiBi (its bias is in the kept scores' unit), then the
// mask (common/mask.cuh), so masked keys are -inf whatever the modifiers did.
#pragma once
#include <stdint.h>
#include "params.h"
#include "ptx.cuh"

namespace fc {

// ---------------------------------------------------------------- softcap
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

// ---------------------------------------------------------------- ALiBi
// ALiBi slope of (sequence bi, head h) divided by the kept scores' unit (scale, or softcap), so
// the kernels subtract slope_u * |j - (i + sk - sq)| from raw scores; 0 without ALiBi.
// A finite slope saturates at the largest finite float in those units: distance 0 then subtracts
// exactly 0 (never inf * 0 = NaN) and the other distances a bias that is huge or -inf (weight 0),
// as the CPU's `slope * dist` overflowing to -inf. A non-finite slope gives NaN, which reaches
// every score of the head, distance 0 included (the CPU path's rule for such slopes); masked keys
// are set to -inf after this bias, so rows that see no key still come out empty.
// `scale`: the softmax scale the scores are kept in (p.scale; an FP8 decode's p.scale times its
// K scale's magnitude, sm80/decode.cuh).
__device__ __forceinline__ float alibi_slope_units_at(const FcParams& p, int bi, int h, float scale) {
    if (p.alibi_slopes == nullptr) return 0.f;
    const float unit = p.softcap > 0.f ? p.softcap : scale;
    const float slope = __ldg(p.alibi_slopes + (int64_t)bi * p.alibi_batch_stride + h);
    constexpr float kMax = 3.40282346638528859812e+38f;
    if (!(fabsf(slope) <= kMax)) return __int_as_float(0x7fffffff);
    return fminf(fmaxf(slope / unit, -kMax), kMax);
}
__device__ __forceinline__ float alibi_slope_units(const FcParams& p, int bi, int h) {
    return alibi_slope_units_at(p, bi, h, p.scale);
}

// Scores with an ALiBi bias are floored at -2^16 in exp2 units (alibi_floor, in the kept scores'
// unit): a key there already has weight 2^-65536 = 0 against any key the row sees above
// -2^16 + 150, and the floor keeps a row's running max small: p = exp2(s * sl2 - m * sl2)
// rounds m * sl2 to f32, which shifts the exponent by up to half an ulp of |m * sl2| (2^-9 at
// 2^16; at the unfloored -1e33 of a slope of 1e30 it was 2^83: P = inf, NaN rows). A row whose
// visible keys all lie below the floor (seq_q > seq_k rows before the diagonal under a huge
// slope, or raw scores past the documented |q.k * scale * log2(e)| < 2^16) averages them.
__device__ __forceinline__ float alibi_floor_at(const FcParams& p, float scale_log2) {
    const float unit_log2 = p.softcap > 0.f ? p.softcap * 1.4426950408889634f : scale_log2;
    return -65536.f / unit_log2;
}
__device__ __forceinline__ float alibi_floor(const FcParams& p) { return alibi_floor_at(p, p.scale_log2); }

// Score s minus the ALiBi bias slope_u * dist, floored at lo (alibi_floor). A NaN (a non-finite
// slope) passes the floor.
__device__ __forceinline__ float alibi_apply(float s, float slope_u, int dist, float lo) {
    const float x = s - slope_u * (float)dist;
    return x < lo ? lo : x;
}

// ---------------------------------------------------------------- sink
// The sink logit of query head h (natural log), or -inf (no sink) without sinks.
__device__ __forceinline__ float sink_of(const FcParams& p, int h) {
    return p.sinks != nullptr ? __ldg(p.sinks + h) : -__int_as_float(0x7f800000);
}

// A finished row with a sink (AttnParams::sinks: one more logit, natural-log units, with no
// value). mn: the row's reference max in natural-log units (any finite value while l > 0), l: the
// row's sum of e^(s - mn). Writes the natural-log LSE including the sink and returns the factor
// for the row's unnormalised O: e^(mn - mt) / (l e^(mn - mt) + e^(sink - mt)), mt = max(mn, sink)
// (so neither exponent is positive). The term of whichever is the max is exactly 1: a +inf sink
// gives O = 0 and LSE +inf, a NaN sink NaN. A row with no weight (l = 0: it saw no key, or only
// -inf scores) has O = 0 and LSE = the sink; l NaN (a NaN score) stays NaN. Callers take
// their sink-free finalisation for a sink of -inf instead (unswitched: fc::Flag), so that no
// sink is bit for bit the kernel without sinks.
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

// ---------------------------------------------------------------- the modifiers as values
// s: a kept score; key: its key index in the sequence; diag: the row's diagonal key (i + sk - sq).
struct NoScoreMod {
    __device__ __forceinline__ float operator()(float s, int, int) const { return s; }
};
// Softcap at p.softcap > 0 on scores kept in units of `scale` (p.scale; an FP8 decode's scale
// times its K scale's magnitude).
struct Softcap {
    float pre;  // scale / cap
    __device__ __forceinline__ Softcap(float scale, float cap) : pre(__fdividef(scale, cap)) {}
    __device__ __forceinline__ float operator()(float s, int = 0, int = 0) const { return softcap_tanh(s * pre); }
};
// ALiBi with the slope in the kept scores' unit (alibi_slope_units*) and the floor (alibi_floor*).
struct Alibi {
    float slope_u, floor;
    __device__ __forceinline__ Alibi(float slope_u_, float floor_) : slope_u(slope_u_), floor(floor_) {}
    __device__ __forceinline__ float operator()(float s, int key, int diag) const {
        return alibi_apply(s, slope_u, abs(key - diag), floor);
    }
};
// The head's sink: none (-inf) leaves the row's finalisation as it is.
struct Sink {
    float logit;
    __device__ __forceinline__ explicit Sink(float logit_) : logit(logit_) {}
    __device__ __forceinline__ bool none() const { return logit == -__int_as_float(0x7f800000); }
    // finalize_sink with this logit: the factor for the row's O and its LSE.
    __device__ __forceinline__ float finalize(float mn, float l, float& lse) const {
        return finalize_sink(mn, l, logit, lse);
    }
};

}  // namespace fc
