// FP8 (e4m3) conversions for K/V tensors and pools, the forms a serving engine stores and reads:
// quantize (16-bit or f32 -> e4m3 with a per-head or per-tensor scale), widen (e4m3 -> 16-bit or
// f32 times the scale) and a plain strided e4m3 copy. Every kernel walks a rank-4 view
// (dims d0..d3, element strides s0..s3; lower ranks are padded with leading 1s) in row-major
// order and writes a contiguous output; dim 2 is the K/V head, which picks the scale when
// `per_head` is set (scale[0] otherwise). Grid-stride loops: any grid covers any size.
#pragma once
#include <stdint.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

namespace fc8 {

struct View4 {
    int64_t d0, d1, d2, d3, s0, s1, s2, s3;
    // Element offset of the i-th element in row-major order, and its head (index along dim 2).
    __device__ __forceinline__ int64_t offset(int64_t i, int& head) const {
        const int64_t i3 = i % d3;
        int64_t r = i / d3;
        const int64_t i2 = r % d2;
        r /= d2;
        const int64_t i1 = r % d1;
        const int64_t i0 = r / d1;
        head = (int)i2;
        return i0 * s0 + i1 * s1 + i2 * s2 + i3 * s3;
    }
    __device__ __forceinline__ int64_t count() const { return d0 * d1 * d2 * d3; }
};

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

// x / scale rounded to nearest e4m3; finite values past +-448 and infinities saturate to
// +-448, NaN stays NaN (the cvt's satfinite mode).
template <typename T>
__device__ __forceinline__ void quantize(const T* __restrict__ x, View4 v, uint8_t* __restrict__ out,
                                         const float* __restrict__ scale, int per_head) {
    const int64_t n = v.count();
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        int h;
        const int64_t o = v.offset(i, h);
        const float y = to_f32(x[o]) / __ldg(scale + (per_head ? h : 0));
        out[i] = __nv_cvt_float_to_fp8(y, __NV_SATFINITE, __NV_E4M3);
    }
}

// stored * scale, rounded once to T.
template <typename T>
__device__ __forceinline__ void widen(const uint8_t* __restrict__ x, View4 v, T* __restrict__ out,
                                      const float* __restrict__ scale, int per_head) {
    const int64_t n = v.count();
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        int h;
        const int64_t o = v.offset(i, h);
        const float e = __half2float(__half(__nv_cvt_fp8_to_halfraw(x[o], __NV_E4M3)));
        out[i] = from_f32<T>(e * __ldg(scale + (per_head ? h : 0)));
    }
}

}  // namespace fc8

#define FC8_QUANTIZE(NAME, T)                                                                 \
    extern "C" __global__ void __launch_bounds__(256) NAME(const T* x, fc8::View4 v, uint8_t* out, \
                                                           const float* scale, int per_head) {  \
        fc8::quantize<T>(x, v, out, scale, per_head);                                          \
    }
#define FC8_WIDEN(NAME, T)                                                                    \
    extern "C" __global__ void __launch_bounds__(256) NAME(const uint8_t* x, fc8::View4 v, T* out, \
                                                           const float* scale, int per_head) {  \
        fc8::widen<T>(x, v, out, scale, per_head);                                             \
    }
FC8_QUANTIZE(fc_quantize_e4m3_bf16, __nv_bfloat16)
FC8_QUANTIZE(fc_quantize_e4m3_f16, __half)
FC8_QUANTIZE(fc_quantize_e4m3_f32, float)
FC8_WIDEN(fc_widen_e4m3_bf16, __nv_bfloat16)
FC8_WIDEN(fc_widen_e4m3_f16, __half)
FC8_WIDEN(fc_widen_e4m3_f32, float)

// A strided e4m3 view copied into a contiguous buffer, byte for byte.
extern "C" __global__ void __launch_bounds__(256) fc_copy_e4m3(const uint8_t* __restrict__ x,
                                                               fc8::View4 v,
                                                               uint8_t* __restrict__ out) {
    const int64_t n = v.count();
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        int h;
        out[i] = x[v.offset(i, h)];
    }
}
