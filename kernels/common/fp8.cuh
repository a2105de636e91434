// FP8 (e4m3) conversions for K/V tensors and pools, the forms a serving engine stores and reads:
// quantize (16-bit or f32 -> e4m3 with a per-head or per-tensor scale), widen (e4m3 -> 16-bit or
// f32 times the scale) and a plain strided e4m3 copy. Every kernel walks a rank-4 view
// (dims d0..d3, element strides s0..s3; lower ranks are padded with leading 1s) in row-major
// order and writes a contiguous output; dim 2 is the K/V head, which picks the scale when
// `per_head` is set (scale[0] otherwise). Grid-stride loops: any grid covers any size.
// fc_widen_pages_*: the paged slow path's widening (a paged cache's pages in sequence order, one
// launch for K and V, the page table read on the device), below.
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

// The paged slow path (docs/decisions.md#fp8-keys-and-values-in-the-decode-kernel): the pages a
// batch reads, widened into 16-bit (or f32) pools in sequence order, K and V in one launch.
// Slot bi * max_pages + j of the output pools (b * max_pages pages of the input's page_size rows,
// contiguous (slot, row, head, column)) holds page table[bi][j] widened, for the pages sequence bi
// uses (j < ceil(len / page_size), len = seqlens[bi] clamped into [0, max_pages * page_size]).
// Other slots are not written: no kernel reads a page past a sequence's length (the table's
// columns there may hold any id), and a lying sequence's rows become NaN whatever they read.
// The remapped table `out_table` (b, max_pages) holds every entry's slot, except -1 (0xFFFFFFFF
// as u32) where a used entry's page id is not a page of the pool: the 16-bit call after it
// clamps that id into the widened pools (no read outside them) and its table check turns the
// sequence's rows into NaN, as for a 16-bit pool (docs/decisions.md#device-side-checks). Lengths
// are passed on unchanged, so a lying length is caught the same way. No read leaves the pools.
namespace fc8 {

struct PagesWiden {
    uint64_t src[2];    // e4m3 pools K, V (byte addresses); column stride 1
    uint64_t dst[2];    // output pools, contiguous, of T
    uint64_t scale[2];  // f32 scales, one per head (per_head) or one
    int64_t s_page[2], s_row[2], s_head[2];  // the pools' element (byte) strides
    uint64_t table;      // (b, max_pages) int32, contiguous
    uint64_t seqlens;    // (b,) int32
    uint64_t out_table;  // (b, max_pages) int32, contiguous
    int32_t d[2], per_head[2];
    int32_t b, max_pages, page_size, hkv, num_pages;
    int32_t parts;  // blocks per (slot, K or V): each covers 256 * WIDEN_ITER vectors of a page
};
static_assert(sizeof(PagesWiden) == 160, "PagesWiden layout (src/cuda/fp8.rs)");

constexpr int WIDEN_ITER = 4;  // vectors per thread per block, loads issued before the stores

template <int VEC> struct Bytes;
template <> struct Bytes<16> { uint4 x; };
template <> struct Bytes<8> { uint2 x; };
template <> struct Bytes<1> { uint8_t x; };

template <int VEC>
__device__ __forceinline__ Bytes<VEC> load_bytes(const uint8_t* p) {
    Bytes<VEC> b;
    if constexpr (VEC == 16) b.x = __ldg(reinterpret_cast<const uint4*>(p));
    else if constexpr (VEC == 8) b.x = __ldg(reinterpret_cast<const uint2*>(p));
    else b.x = __ldg(p);
    return b;
}

// Widens VEC e4m3 bytes times `s` into out[0..VEC) (one rounding to T each); VEC * sizeof(T) bytes
// stored as 16-byte vectors when they fill them (`out` then 16-byte aligned), else one by one.
template <typename T, int VEC>
__device__ __forceinline__ void store_widened(const Bytes<VEC>& b, float s, T* out) {
    uint4 w[(VEC * sizeof(T) + 15) / 16];
    T* v = reinterpret_cast<T*>(w);
    if constexpr (VEC == 1) {
        v[0] = from_f32<T>(__half2float(__half(__nv_cvt_fp8_to_halfraw(b.x, __NV_E4M3))) * s);
    } else {
        const uint16_t* pairs = reinterpret_cast<const uint16_t*>(&b.x);
#pragma unroll
        for (int i = 0; i < VEC / 2; ++i) {
            const float2 f = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pairs[i], __NV_E4M3)));
            v[2 * i] = from_f32<T>(f.x * s);
            v[2 * i + 1] = from_f32<T>(f.y * s);
        }
    }
    if constexpr ((VEC * sizeof(T)) % 16 == 0) {
#pragma unroll
        for (int i = 0; i < (int)(VEC * sizeof(T) / 16); ++i) reinterpret_cast<uint4*>(out)[i] = w[i];
    } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) out[i] = v[i];
    }
}

// Grid (x: slot-part tasks, grid-stride; y: 0 = K, 1 = V), 256 threads.
template <typename T, int VEC>
__device__ __forceinline__ void widen_pages(const PagesWiden& p) {
    const int kv = blockIdx.y;
    const int d = p.d[kv];
    const int cpr = d / VEC;                              // vectors per row of one head
    const int units = p.page_size * p.hkv * cpr;          // vectors per page (host: < 2^31)
    const int64_t page_elems = (int64_t)units * VEC;
    const int64_t slots = (int64_t)p.b * p.max_pages;
    const int cap = p.max_pages * p.page_size;            // host: < 2^31
    const uint8_t* src = reinterpret_cast<const uint8_t*>(p.src[kv]);
    T* dst = reinterpret_cast<T*>(p.dst[kv]);
    const float* scale = reinterpret_cast<const float*>(p.scale[kv]);
    const int32_t* table = reinterpret_cast<const int32_t*>(p.table);
    const int32_t* seqlens = reinterpret_cast<const int32_t*>(p.seqlens);
    const int64_t tasks = slots * p.parts;
    for (int64_t task = blockIdx.x; task < tasks; task += gridDim.x) {
        const int64_t slot = task / p.parts;
        const int part = (int)(task - slot * p.parts);
        const int bi = (int)(slot / p.max_pages);
        const int j = (int)(slot - (int64_t)bi * p.max_pages);
        const int len = min(max(__ldg(seqlens + bi), 0), cap);
        const bool used = j < (int)(((int64_t)len + p.page_size - 1) / p.page_size);
        const int page = __ldg(table + slot);
        const bool read = used && page >= 0 && page < p.num_pages;
        if (kv == 0 && part == 0 && threadIdx.x == 0)
            reinterpret_cast<int32_t*>(p.out_table)[slot] = used && !read ? -1 : (int32_t)slot;
        if (!read) continue;  // block-uniform
        const int u0 = part * (256 * WIDEN_ITER) + threadIdx.x;
        Bytes<VEC> b[WIDEN_ITER];
#pragma unroll
        for (int it = 0; it < WIDEN_ITER; ++it) {
            const int u = u0 + it * 256;
            if (u < units) {
                const int c = u % cpr;
                const int rh = u / cpr;
                const int h = rh % p.hkv;
                const int r = rh / p.hkv;
                b[it] = load_bytes<VEC>(src + (int64_t)page * p.s_page[kv] + (int64_t)r * p.s_row[kv] +
                                        (int64_t)h * p.s_head[kv] + c * VEC);
            }
        }
#pragma unroll
        for (int it = 0; it < WIDEN_ITER; ++it) {
            const int u = u0 + it * 256;
            if (u < units) {
                const int h = (u / cpr) % p.hkv;
                store_widened<T, VEC>(b[it], __ldg(scale + (p.per_head[kv] ? h : 0)),
                                      dst + slot * page_elems + (int64_t)u * VEC);
            }
        }
    }
}

}  // namespace fc8

#define FC8_WIDEN_PAGES(NAME, T, VEC)                                                    \
    extern "C" __global__ void __launch_bounds__(256) NAME(const fc8::PagesWiden p) { \
        fc8::widen_pages<T, VEC>(p);                                                    \
    }
FC8_WIDEN_PAGES(fc_widen_pages_e4m3_bf16_v16, __nv_bfloat16, 16)
FC8_WIDEN_PAGES(fc_widen_pages_e4m3_bf16_v8, __nv_bfloat16, 8)
FC8_WIDEN_PAGES(fc_widen_pages_e4m3_bf16_v1, __nv_bfloat16, 1)
FC8_WIDEN_PAGES(fc_widen_pages_e4m3_f16_v16, __half, 16)
FC8_WIDEN_PAGES(fc_widen_pages_e4m3_f16_v8, __half, 8)
FC8_WIDEN_PAGES(fc_widen_pages_e4m3_f16_v1, __half, 1)
FC8_WIDEN_PAGES(fc_widen_pages_e4m3_f32_v16, float, 16)
FC8_WIDEN_PAGES(fc_widen_pages_e4m3_f32_v8, float, 8)
FC8_WIDEN_PAGES(fc_widen_pages_e4m3_f32_v1, float, 1)

// widen over 16-element vectors: the view's last dim contiguous, a multiple of 16 long, every
// other stride and the view's start a multiple of 16 bytes (the host checks), so each vector
// lies in one row of one head and `out + 16 i` is 32-byte aligned.
namespace fc8 {
template <typename T>
__device__ __forceinline__ void widen16(const uint8_t* __restrict__ x, View4 v, T* __restrict__ out,
                                        const float* __restrict__ scale, int per_head) {
    const int64_t n = v.count() / 16;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        int h;
        const int64_t o = v.offset(i * 16, h);
        store_widened<T, 16>(load_bytes<16>(x + o), __ldg(scale + (per_head ? h : 0)), out + i * 16);
    }
}
}  // namespace fc8
#define FC8_WIDEN16(NAME, T)                                                                  \
    extern "C" __global__ void __launch_bounds__(256) NAME(const uint8_t* x, fc8::View4 v, T* out, \
                                                           const float* scale, int per_head) {  \
        fc8::widen16<T>(x, v, out, scale, per_head);                                           \
    }
FC8_WIDEN16(fc_widen_e4m3_bf16_v16, __nv_bfloat16)
FC8_WIDEN16(fc_widen_e4m3_f16_v16, __half)
FC8_WIDEN16(fc_widen_e4m3_f32_v16, float)
