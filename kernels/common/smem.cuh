// flashcore: 32-bit shared-memory words through 32-bit shared addresses (no 64-bit generic pointer
// kept live), shared by the kernel families.
#pragma once
#include <stdint.h>

namespace fc {

__device__ __forceinline__ void st_shared_b32(uint32_t addr, uint32_t v) {
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ uint32_t ld_shared_b32(uint32_t addr) {
    uint32_t v;
    asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(addr) : "memory");
    return v;
}
__device__ __forceinline__ void st_shared_f32(uint32_t addr, float v) {
    st_shared_b32(addr, __float_as_uint(v));
}
__device__ __forceinline__ float ld_shared_f32(uint32_t addr) {
    return __uint_as_float(ld_shared_b32(addr));
}

}  // namespace fc
