// Where sequence bi's query rows and keys live: the one description every kernel reads its rows
// through (dense batches, packed variable-length batches; paged caches add a page table here).
#pragma once
#include <stdint.h>
#include "params.h"
#include "mask.cuh"
#include "variants.cuh"

namespace fc {

struct SeqRange {
    int q0;  // first row of the sequence in the packed q / o (0 when dense: batch strides apply)
    int sq;  // query rows of the sequence
    int k0;  // first key row in the packed k / v (0 when dense)
    int sk;  // keys of the sequence
};

// Sequence bi. Varlen: rows cu[bi]..cu[bi+1] of the packed tensors, clamped into the tensors
// ([0, total]) and to the grid's bound (p.sq / p.sk = max_seqlen), so whatever the prefix sums
// hold, no kernel reads or writes outside its buffers (lying sums are caught by
// fc::prefix_sums_lie, in fc_check_seqlens or the split-KV combine: the output becomes NaN).
__device__ __forceinline__ SeqRange seq_range(const FcParams& p, int bi) {
    SeqRange r;
    if (p.cu_seqlens_q != nullptr) {
        const int a = clamp_i(__ldg(p.cu_seqlens_q + bi), 0, p.total_q);
        const int e = clamp_i(__ldg(p.cu_seqlens_q + bi + 1), a, p.total_q);
        r.q0 = a;
        r.sq = min(e - a, p.sq);
    } else {
        r.q0 = 0;
        r.sq = p.sq;
    }
    if (p.cu_seqlens_k != nullptr) {
        const int a = clamp_i(__ldg(p.cu_seqlens_k + bi), 0, p.total_k);
        const int e = clamp_i(__ldg(p.cu_seqlens_k + bi + 1), a, p.total_k);
        r.k0 = a;
        r.sk = min(e - a, p.sk);
    } else {
        r.k0 = 0;
        r.sk = p.sk;
    }
    if (p.seqused_k != nullptr) r.sk = min(r.sk, max(__ldg(p.seqused_k + bi), 0));
    return r;
}

// Sequence bi's number of keys, as seq_range(p, bi).sk, without the query side's loads (the
// decode's balanced_tps runs where registers are short). seq_range keeps its own copy: built on
// this one, the sm80 family's SASS changed.
__device__ __forceinline__ int keys_of(const FcParams& p, int bi) {
    int sk = p.sk;
    if (p.cu_seqlens_k != nullptr) {
        const int a = clamp_i(__ldg(p.cu_seqlens_k + bi), 0, p.total_k);
        const int e = clamp_i(__ldg(p.cu_seqlens_k + bi + 1), a, p.total_k);
        sk = min(e - a, p.sk);
    }
    if (p.seqused_k != nullptr) sk = min(sk, max(__ldg(p.seqused_k + bi), 0));
    return sk;
}

// Paged caches (p.page_table set): k/v are pools of p.total_k / p.page_size pages of p.page_size
// rows, batch stride = page stride; sequence bi's key j is row j % page_size of page
// page_table[bi * page_table_stride + j / page_size]. The page id is clamped into the pool, so a
// lying table reads a wrong row of the pool, never outside it (fc::pages_lie: that sequence's
// output becomes NaN). `key` < p.sk = the table's width in keys <= page_table_stride * page_size.
// page_id is the lookup itself: entry j of sequence bi's table clamped into pages [0, last()]
// (last() = p.total_k / p.page_size - 1, however the caller has it), for the kernels that find j
// or the slot their own way (the sm90 producer by shifts, the split-KV decode a window of entries
// per warp). `last` is a callable, evaluated after the entry's load is issued: the order every
// kernel was measured with (a value argument computed first reorders their SASS).
template <class Last>
__device__ __forceinline__ int page_id(const FcParams& p, int bi, int j, Last last) {
    return clamp_i(__ldg(p.page_table + (int64_t)bi * p.page_table_stride + j), 0, last());
}
__device__ __forceinline__ int page_of(const FcParams& p, int bi, int key, int& slot) {
    const int ps = p.page_size;
    const int j = key / ps;
    slot = key - j * ps;
    return page_id(p, bi, j, [&] { return p.total_k / ps - 1; });
}
// Element offset of row `slot` of page `page` in a pool with (page, row) strides: the one form of
// a paged K/V address (the head's offset is added by the caller).
__device__ __forceinline__ int64_t paged_offset(int64_t page, int slot, int64_t page_stride, int64_t row_stride) {
    return page * page_stride + (int64_t)slot * row_stride;
}
__device__ __forceinline__ int64_t paged_row(const FcParams& p, int bi, int key, int64_t page_stride,
                                             int64_t row_stride) {
    int slot;
    const int page = page_of(p, bi, key, slot);
    return paged_offset(page, slot, page_stride, row_stride);
}

// LSE slot of row `row` (of the sequence) for sequence bi, head h.
__device__ __forceinline__ float* lse_ptr(const FcParams& p, int bi, int h, int q0) {
    return p.lse + (int64_t)bi * p.lse_batch_stride + (int64_t)h * p.lse_head_stride + q0;
}

// The tables' checks, shared by fc_check_seqlens and the split-KV combine. Each returns the
// calling thread's share of the verdict (work strided over the block's threads); OR it over the
// block (__syncthreads_or).
// Prefix sums (q and k): first 0, monotone, last == total, every length <= max_seqlen. A lie
// here turns the whole output into NaN (rows may have gone to other sequences' places).
__device__ __forceinline__ bool prefix_sums_lie(const FcParams& p) {
    bool bad = false;
    for (int i = threadIdx.x; i <= p.b; i += blockDim.x) {
        if (p.cu_seqlens_q != nullptr) {
            const int a = p.cu_seqlens_q[i];
            if (i == 0) bad |= a != 0;
            if (i == p.b) bad |= a != p.total_q;
            if (i < p.b) {
                const int e = p.cu_seqlens_q[i + 1];
                bad |= e < a || e - a > p.sq || a < 0;
            }
        }
        if (p.cu_seqlens_k != nullptr) {
            const int a = p.cu_seqlens_k[i];
            if (i == 0) bad |= a != 0;
            if (i == p.b) bad |= a != p.total_k;
            if (i < p.b) {
                const int e = p.cu_seqlens_k[i + 1];
                bad |= e < a || e - a > p.sk || a < 0;
            }
        }
    }
    return bad;
}
// Paged sequence bi: its length seqused_k[bi] within the table (<= p.sk) and every page it uses
// within the pool. A lie here turns that sequence's rows into NaN (it read only its own pages,
// clamped into the pool; the other sequences' rows are right).
__device__ __forceinline__ bool pages_lie(const FcParams& p, int bi) {
    if (p.page_table == nullptr) return false;
    const int len = p.seqused_k[bi];
    bool bad = len < 0 || len > p.sk;
    const int used = (min(max(len, 0), p.sk) + p.page_size - 1) / p.page_size;
    const int np = p.total_k / p.page_size;
    for (int j = threadIdx.x; j < used; j += blockDim.x) {
        const int page = p.page_table[(int64_t)bi * p.page_table_stride + j];
        bad |= page < 0 || page >= np;
    }
    return bad;
}

}  // namespace fc

// Checks the tables of a varlen or paged launch (fc::prefix_sums_lie, fc::pages_lie) and writes
// NaN where they lie: the whole O (n_o 16-bit words, contiguous) and LSE (n_lse f32) when the
// prefix sums lie (block 0 checks them), sequence i's rows of O and LSE when its length or pages
// lie (block i). Launched after the attention kernel on the same stream, so rows the attention
// could not place are NaN too. Costs no host sync. Grid (b) with a page table, else (1); 256
// threads. On sm_90 the host launches it as a programmatic dependent (the tables are read before
// griddepcontrol.wait). Split-KV decodes with p.combine_checks do the same checks in the combine.
#ifndef FC_NO_SHARED_KERNELS  // for a unit linked beside another that already defines it
extern "C" __global__ void __launch_bounds__(256) fc_check_seqlens(const FcParams p, uint64_t n_o, uint64_t n_lse) {
    const int bi = blockIdx.x;
    const bool all = __syncthreads_or(bi == 0 && fc::prefix_sums_lie(p));
    const bool mine = __syncthreads_or(fc::pages_lie(p, bi));
    if (!all && !mine) return;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    // launched as a programmatic dependent of the attention kernel (sm_90): the tables are
    // inputs and were read above; O and LSE only once that kernel has finished
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
    uint16_t* o = reinterpret_cast<uint16_t*>(p.o);
    if (all) {
        for (uint64_t i = threadIdx.x; i < n_o; i += blockDim.x) o[i] = 0x7FFF;
        for (uint64_t i = threadIdx.x; i < n_lse; i += blockDim.x) p.lse[i] = __int_as_float(0x7FC00000);
        return;
    }
    // sequence bi's rows (clamped into the output by seq_range), every head, O's dv columns
    const fc::SeqRange sr = fc::seq_range(p, bi);
    const int64_t per_row = (int64_t)p.hq * p.dv;
    for (int64_t x = threadIdx.x; x < (int64_t)sr.sq * per_row; x += blockDim.x) {
        const int i = (int)(x / per_row), h = (int)(x % per_row / p.dv), c = (int)(x % p.dv);
        o[(int64_t)bi * p.o_batch_stride + (int64_t)(sr.q0 + i) * p.o_row_stride + (int64_t)h * p.o_head_stride + c] =
            0x7FFF;
    }
    for (int x = threadIdx.x; x < sr.sq * p.hq; x += blockDim.x)
        fc::lse_ptr(p, bi, x / sr.sq, sr.q0)[x % sr.sq] = __int_as_float(0x7FC00000);
}
#endif  // FC_NO_SHARED_KERNELS
