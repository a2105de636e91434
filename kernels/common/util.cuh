// Small utility kernels shared by every family: output poisoning for tests and the pipeline check.
#pragma once
#include <stdint.h>

// Fill n 16-bit words with `value` (e.g. 0x7FFF, a NaN in both f16 and bf16).
extern "C" __global__ void fc_fill_u16(uint16_t* __restrict__ dst, uint64_t n, uint16_t value) {
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
         i += (uint64_t)gridDim.x * blockDim.x) {
        dst[i] = value;
    }
}

// Fill n 32-bit words with `value` (e.g. 0x7FC00000, a NaN in f32).
extern "C" __global__ void fc_fill_u32(uint32_t* __restrict__ dst, uint64_t n, uint32_t value) {
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
         i += (uint64_t)gridDim.x * blockDim.x) {
        dst[i] = value;
    }
}
