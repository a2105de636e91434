// Paged KV caches: the append kernel (new K or V rows into a pool through the page table) and
// the gather kernel (a paged cache into dense rows for the prefill kernels). Both move 16-byte
// chunks of 16-bit elements (f16 / bf16), so head dims are multiples of 8 and every stride a
// multiple of 8 elements (the host checks).
#pragma once
#include <stdint.h>
#include "params.h"
#include "seqlens.cuh"

// Writes rows of `src` (dense (b, n_new, hkv, d): batch stride s_b, n_new > 0; or packed
// (total, hkv, d) with prefix sums `cu` (b + 1), n_new = 0, s_b unused) into `pool` (num_pages,
// page_size, hkv, d) strides (p_p, p_r, p_h): row j of sequence bi goes to position
// positions[bi] + j, i.e. row pos % page_size of page page_table[bi * max_pages + pos /
// page_size]. A row whose position falls outside the table, or whose page id is not a page of
// the pool, is not written (masked: nothing outside the pool is touched). Grid-stride over
// (row, head, 16-byte chunk).
extern "C" __global__ void __launch_bounds__(256) fc_append_paged(
    const uint4* __restrict__ src, uint4* __restrict__ pool, const int32_t* __restrict__ page_table,
    const int32_t* __restrict__ positions, const int32_t* __restrict__ cu, int64_t s_b, int64_t s_r,
    int64_t s_h, int64_t p_p, int64_t p_r, int64_t p_h, int32_t b, int32_t n_new, int32_t total,
    int32_t hkv, int32_t d, int32_t page_size, int32_t num_pages, int32_t max_pages) {
    const int cpr = d / 8;
    const int64_t n = (int64_t)total * hkv * cpr;
    for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
         idx += (int64_t)gridDim.x * blockDim.x) {
        const int c = (int)(idx % cpr);
        const int h = (int)((idx / cpr) % hkv);
        const int r = (int)(idx / ((int64_t)cpr * hkv));
        int bi, j;
        int64_t s_off;  // element offset of the row in src
        if (cu == nullptr) {
            bi = r / n_new;
            j = r - bi * n_new;
            s_off = (int64_t)bi * s_b + (int64_t)j * s_r;
        } else {
            // the last sequence whose start is <= r (prefix sums that lie only misplace rows)
            int lo = 0, hi = b - 1;
            while (lo < hi) {
                const int mid = (lo + hi + 1) >> 1;
                if (__ldg(cu + mid) <= r) lo = mid; else hi = mid - 1;
            }
            bi = lo;
            j = r - __ldg(cu + bi);
            if (j < 0) continue;
            s_off = (int64_t)r * s_r;
        }
        const int pos = __ldg(positions + bi) + j;
        if (pos < 0 || pos / page_size >= max_pages) continue;
        const int page = __ldg(page_table + (int64_t)bi * max_pages + pos / page_size);
        if (page < 0 || page >= num_pages) continue;
        const int64_t dst = (int64_t)page * p_p + (int64_t)(pos % page_size) * p_r + (int64_t)h * p_h;
        pool[(dst >> 3) + c] = __ldg(src + ((s_off + (int64_t)h * s_h) >> 3) + c);
    }
}

// Gathers a paged cache (p.page_table, p.seqused_k; pools p.k / p.v with (page, row, head)
// strides) into dense buffers dk (b, p.sk, hkv, p.d) and dv (b, p.sk, hkv, p.dv), both
// contiguous: row j of sequence bi is the pool row of fc::paged_row for j < its length, zeros
// past it (the prefill kernels read whole tiles; their masked keys must hold finite values).
// Grid-stride over (sequence, row, head, 16-byte chunk) with the wider row's chunks; a chunk
// past the narrower row's end is not written.
extern "C" __global__ void __launch_bounds__(256) fc_gather_paged(const FcParams p, uint4* __restrict__ dk,
                                                                  uint4* __restrict__ dv) {
    const int kcpr = p.d / 8, vcpr = p.dv / 8;
    const int cpr = max(kcpr, vcpr);
    const int64_t n = (int64_t)p.b * p.sk * p.hkv * cpr;
    const uint4* kpool = static_cast<const uint4*>(p.k);
    const uint4* vpool = static_cast<const uint4*>(p.v);
    for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
         idx += (int64_t)gridDim.x * blockDim.x) {
        const int c = (int)(idx % cpr);
        const int64_t rh = idx / cpr;  // (bi * sk + j) * hkv + h
        const int h = (int)(rh % p.hkv);
        const int64_t row = rh / p.hkv;  // bi * sk + j
        const int bi = (int)(row / p.sk);
        const int j = (int)(row - (int64_t)bi * p.sk);
        const fc::SeqRange sr = fc::seq_range(p, bi);
        uint4 kx = make_uint4(0, 0, 0, 0), vx = kx;
        const bool kc = c < kcpr, vc = c < vcpr;
        if (j < sr.sk) {
            const int64_t ko = fc::paged_row(p, bi, j, p.k_batch_stride, p.k_row_stride) + (int64_t)h * p.k_head_stride;
            const int64_t vo = fc::paged_row(p, bi, j, p.v_batch_stride, p.v_row_stride) + (int64_t)h * p.v_head_stride;
            if (kc) kx = __ldg(kpool + (ko >> 3) + c);
            if (vc) vx = __ldg(vpool + (vo >> 3) + c);
        }
        if (kc) dk[rh * kcpr + c] = kx;
        if (vc) dv[rh * vcpr + c] = vx;
    }
}
