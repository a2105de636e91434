// flashcore: the PTX the kernel families share (SFU exp2 / log2, cp.async, ldmatrix, the 16-bit
// tile swizzle, programmatic dependent launch, register laundering) and the 16-bit dtype traits.
// One definition each; where two kernels need different ordering guarantees from the same
// instruction (a "memory" clobber or `volatile`), the difference is a template parameter
// here, not a second copy, so that each kernel keeps the instruction order it was measured with.
#pragma once
#include <stdint.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace fc {

// ---------------------------------------------------------------- SFU
// 2^x with the SFU (ex2.approx.ftz): exp2(-inf) = +0.
__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// log2(x) with the SFU (lg2.approx.ftz).
__device__ __forceinline__ float log2_approx(float x) {
    float y;
    asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// ---------------------------------------------------------------- registers
// x through a volatile move: the compiler cannot fold or hoist what is derived from it, so the
// value is rebuilt where it is used instead of being held live across a loop.
__device__ __forceinline__ uint32_t launder32(uint32_t x) {
    asm volatile("mov.b32 %0, %1;" : "=r"(x) : "r"(x));
    return x;
}
// threadIdx.x through a volatile read (as launder32: recomputed, not kept live).
__device__ __forceinline__ int tid_remat() {
    uint32_t x;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(x));
    return (int)x;
}
// The lane id through a volatile read.
__device__ __forceinline__ int lane_remat() {
    int lane;
    asm volatile("mov.u32 %0, %%laneid;" : "=r"(lane));
    return lane;
}

// ---------------------------------------------------------------- shared memory
__device__ __forceinline__ uint32_t smem_addr(const void* ptr) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// A [rows][D] tile of 16-bit elements whose 16-byte chunks are XOR-swizzled by (row & 7):
// physical chunk = chunk ^ (row & 7), conflict-free for ldmatrix (8 rows, one chunk) and for
// row-wise 16-byte stores. Two units of the same address: bytes (shared addresses) and elements
// (T pointers); swz_bytes == 2 * swz_elems.
template <int D>
__device__ __forceinline__ uint32_t swz_bytes(int row, int chunk) {
    return static_cast<uint32_t>(row * (D * 2) + ((chunk ^ (row & 7)) << 4));
}
template <int D>
__device__ __forceinline__ int swz_elems(int row, int chunk) {
    return row * D + ((chunk ^ (row & 7)) << 3);
}

// ---------------------------------------------------------------- cp.async
// 16-byte global -> shared copy of `src_bytes` (16, or 0: the destination is zero-filled and
// nothing is read). PF: L2 prefetch hint in bytes (0 none, 128, 256). ORDERED: a "memory"
// clobber, so the compiler keeps ordinary memory accesses on their side of the copy.
template <int PF = 0, bool ORDERED = true>
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes) {
    if constexpr (ORDERED) {
        static_assert(PF == 0, "an ordered copy has no prefetch hint");
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes)
                     : "memory");
    } else if constexpr (PF == 256) {
        asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
    } else if constexpr (PF == 128) {
        asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
    } else {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
    }
}
template <bool ORDERED = true>
__device__ __forceinline__ void cp_async_commit() {
    if constexpr (ORDERED) {
        asm volatile("cp.async.commit_group;\n" ::: "memory");
    } else {
        asm volatile("cp.async.commit_group;\n" ::);
    }
}
// Wait until at most N committed groups are pending.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { cp_async_wait<0>(); }

// ---------------------------------------------------------------- ldmatrix
__device__ __forceinline__ void ldsm_x4(uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3, uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3,
                                              uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) { ldsm_x4(r[0], r[1], r[2], r[3], addr); }
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], uint32_t addr) {
    ldsm_x4_trans(r[0], r[1], r[2], r[3], addr);
}

// ---------------------------------------------------------------- programmatic dependent launch
// sm_90+ (compiled out below it); both are no-ops when the grid was not launched with the
// programmatic stream serialization attribute.
// Wait for the grid this one depends on (its writes are visible after).
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
// Let the dependent grid be scheduled (it still waits for this grid's completion to read).
// ORDERED: a "memory" clobber (memory accesses stay on their side of it).
template <bool ORDERED = false>
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if constexpr (ORDERED) {
        asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    } else {
        asm volatile("griddepcontrol.launch_dependents;\n" ::);
    }
#endif
}

// ---------------------------------------------------------------- 16-bit dtype traits
// Elem<T> for T = __nv_bfloat16 / __half: `bf16`, the m16n8k16 tensor-core MMA with f32
// accumulators (c += a b, A row-major in four registers, B column-major in two), the f32 pair
// -> T pair conversion (lo -> bits [15:0], hi -> bits [31:16], round to nearest even) and back
// (`unpack`: exact). The sm90 kernels take `bf16`, `pack` and `unpack` (their MMAs are wgmma,
// sm90/wgmma_gen.cuh). ORDERED: the MMA is
// `volatile` (kept in program order with the other volatile asm, e.g. the ldmatrix feeding it);
// unordered, the compiler may schedule it freely.
template <typename T>
struct Elem;
template <>
struct Elem<__nv_bfloat16> {
    static constexpr bool bf16 = true;
    template <bool ORDERED = true>
    static __device__ __forceinline__ void mma(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
        if constexpr (ORDERED) {
            asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                         "{%8,%9}, {%0,%1,%2,%3};"
                         : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                         : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
        } else {
            asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                "{%8,%9}, {%0,%1,%2,%3};"
                : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
        }
    }
    static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
        uint32_t r;
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    }
    static __device__ __forceinline__ float2 unpack(uint32_t v) {
        return make_float2(__uint_as_float(v << 16), __uint_as_float(v & 0xffff0000u));
    }
};
template <>
struct Elem<__half> {
    static constexpr bool bf16 = false;
    template <bool ORDERED = true>
    static __device__ __forceinline__ void mma(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
        if constexpr (ORDERED) {
            asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                         "{%8,%9}, {%0,%1,%2,%3};"
                         : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                         : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
        } else {
            asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                "{%8,%9}, {%0,%1,%2,%3};"
                : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
        }
    }
    static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
        uint32_t r;
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    }
    static __device__ __forceinline__ float2 unpack(uint32_t v) {
        return __half22float2(*reinterpret_cast<__half2*>(&v));
    }
};

}  // namespace fc
