// flashcore sm80-family split-KV decode (flash-decoding) + combine.
// mma.sync m16n8k16 (f32 accumulate), ldmatrix, cp.async multi-stage K/V ring. Builds for
// sm_80/86/89/90 SASS and compute_80 PTX (no sm_90a-only instructions).
//
// ----------------------------------------------------------------------------------------------
// What one CTA computes
//   GQA packing: the CTA owns one (batch b, kv head g, key split s, row block rb). Its "rows" are
//   the packed query rows of ALL h_ratio = hq / hkv query heads that read kv head g, times all sq
//   query positions: packed row r in [0, h_ratio * sq) is (query head g * h_ratio + r / sq,
//   position r % sq). Row block rb holds packed rows [rb * BLOCK_M, rb * BLOCK_M + BLOCK_M).
//   Every K/V element of the split's key range is read from memory once per row block (so once,
//   when h_ratio * sq <= BLOCK_M).
//   The keys the rows can see (whole [0, sk), or the causal / local band) are cut into
//   BLOCK_N-key tiles; the tiles are divided evenly (ceil) among the p.num_splits splits; split s
//   streams its tiles through a STAGES-deep cp.async ring in shared memory.
//   Warps: the CTA's m16 row tiles (ceil(rows_in_block / 16), rounded up to a power of two) are
//   spread over the warps, and the remaining warp factor splits every K/V tile along keys
//   (WN = WARPS / WM warps per row tile, BLOCK_N / WN keys each, 16 keys per step). Each warp keeps
//   its own online softmax (running max, sum, O in registers); the warps' partial results are
//   merged through shared memory at the end.
//
// Template parameters (the variant table's columns)
//   T        __nv_bfloat16 or __half.
//   HEAD_DIM 64, 128 or 256 (any multiple of 64 that fits registers).
//   MASK_ID  0 none, 1 causal (bottom-right: row i sees key j iff j <= i + sk - sq),
//            2 local window (p.window_left / p.window_right, negative = unbounded).
//   BLOCK_M  packed query rows per CTA: multiple of 16, <= 16 * WARPS.
//   BLOCK_N  keys per pipeline stage (tile): multiple of 16 * WARPS.
//   WARPS    warps per CTA (power of two).
//   STAGES   cp.async ring depth, >= 2 (the next tile is issued before the wait on the current
//            one, so up to STAGES tiles are in flight while a CTA waits).
//   Suggested: d64/d128: (64, 64, 4, 2) = 40 / 80 KB; d256: (32, 32, 2, 2) = 80 KB
//   (these fit the 99 KB per-block limit of sm_86/sm_89 as well as sm_80/sm_90).
//
// ----------------------------------------------------------------------------------------------
// LAUNCH CONTRACT
//   Split kernel  FC_SM80_DECODE(SYMBOL, T, HEAD_DIM, MASK_ID, BLOCK_M, BLOCK_N, WARPS, STAGES):
//     row_blocks = ceil(h_ratio * sq / BLOCK_M)
//     grid       = (row_blocks * num_splits * b * hkv, 1, 1)   (1-D; x = ((s*b + b_i)*hkv + g)*row_blocks + rb)
//     block      = (32 * WARPS, 1, 1)
//     dynamic smem bytes = (BLOCK_M + 2 * STAGES * BLOCK_N) * HEAD_DIM * 2
//                  (= Variant::smem_bytes(); call cudaFuncSetAttribute(MaxDynamicSharedMemorySize)
//                   when > 48 KB)
//     p.num_splits >= 1 (any value works; splits that get no tile write an empty partial).
//     num_splits == 1: the split kernel writes O (T, strides p.o_*_stride) and LSE (b, hq, sq)
//                      directly; o_partial / lse_partial are not touched (may be null); NO combine.
//     num_splits  > 1: the split kernel writes only the scratch:
//                      o_partial  f32 (num_splits, b, hq, sq, p.dv) contiguous,
//                      lse_partial f32 (num_splits, b, hq, sq) contiguous (natural log; -inf for a
//                      split that saw no key: a split with no tile leaves its o_partial rows
//                      unwritten, one whose rows see none of its keys writes them 0);
//                      then launch the combine kernel on the same stream with the same params.
//   Combine kernel FC_SM80_COMBINE(SYMBOL, T, HEAD_DIM)   (only when num_splits > 1):
//     grid  = (b * hq * sq, 1, 1), block = (256, 1, 1), dynamic smem = 0 (4.1 KB static).
//     Reads p.num_splits, o_partial, lse_partial; writes O (T, strides) and LSE (natural log).
//     p.combine_checks = 1: also checks the tables as fc_check_seqlens does (fc::prefix_sums_lie,
//     fc::pages_lie; before griddepcontrol.wait) and writes NaN rows where they lie, so no check
//     kernel need follow.
//   Optional (sm_90): launch the combine with cudaLaunchAttributeProgrammaticStreamSerialization
//   (CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 1) to hide its launch latency: the split
//   kernel executes griddepcontrol.launch_dependents at entry, the combine griddepcontrol.wait before
//   touching memory. The split kernel also executes griddepcontrol.wait at entry, so it may itself be
//   launched with that attribute after the kernel producing q/k/v. Without the attribute both are
//   no-ops (and they are compiled out for sm_8x).
//   Requirements: q/k/v/o base pointers 16-byte aligned, all row/head/batch strides multiples of
//   8 elements, last dim contiguous; hq = h_ratio * hkv; the split kernel needs p.scale,
//   p.scale_log2, p.window_*; p.softcap > 0 caps the scores (fc::softcap_tanh); p.alibi_slopes adds
//   the ALiBi bias (runtime branch per 16-key step, as softcap); head dims p.d (q, k) and p.dv
//   (v, o), equal or not, each <= HEAD_DIM and a positive multiple of 8 (of 16 for the `_e4m3`
//   kernels): Q / K columns from p.d on and V columns from p.dv on are zero-filled in shared
//   memory (16-bit K/V; the `_e4m3` kernels fill V's with copies: KvTileLoader::v_src_chunk),
//   O is merged and stored for its p.dv columns only. Paged caches (p.page_table): K/V rows
//   through fc::paged_row (common/seqlens.cuh), page by page per row; pages holding a warp's
//   rows of a tile (page_size a multiple of BLOCK_N / WARPS; smaller than a tile: the rows dealt
//   out by warp) one page per warp and tile, the page ids read 32 at a time ahead of use (no
//   window); paged splits without a window cut the table's key range p.sk. Sequences through
//   fc::seq_range (dense or varlen; the grid and the partial layout use p.sq = max_seqlen_q,
//   row blocks past a shorter sequence exit and the combine skips its rows).
//   Empty rows (no visible key, e.g. causal sq > sk): O = 0, LSE = -inf (the head's sink).
//   p.sinks (optional): the head's sink logit joins each row's normaliser and LSE once: in the
//   split kernel's epilogue when num_splits == 1, else in the combine (fc::finalize_sink).
//
// num_splits heuristic: fc_decode_num_splits() at the bottom of this file (host, pure).
// ----------------------------------------------------------------------------------------------
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>
#include <type_traits>
#include "common/params.h"
#include "common/ptx.cuh"
#include "common/mask.cuh"
#include "common/variants.cuh"
#include "common/softmax.cuh"
#include "common/seqlens.cuh"

namespace fc_decode {

// (the shared PTX helpers and dtype traits: common/ptx.cuh)
using fc::cp_async_wait;
using fc::smem_addr;
using fc::swz_elems;

// Balanced splits (p.split_budget > 0; the host sets it for paged / varlen batches of 2..32
// sequences, no mask: a causal decode of one query row takes the no-mask kernel; in the causal
// kernels the search made d64 spill 8 B on sm_86/89). The host sizes the grid by the longest
// sequence (p.sk), so even splits of that width leave a batch of unequal lengths with most CTAs
// short and a few long: 8 sequences of 1k..32k keys read 1.6 TB/s where the same keys in equal
// lengths read 2.6 (H100; decisions.md#balanced-decode-splits). Instead every CTA of the launch
// computes the same tiles
// per split: the smallest `tps` for which the batch's splits, the sum over sequences of
// ceil(tiles_i / tps), number at most p.split_budget (the host's even-split CTA count per K/V
// head, b * even, and a slack of b / 2, below one split per sequence so that equal lengths keep
// the host's partition), with ceil(tiles_i / tps) <= num_splits (the grid's splits per
// sequence, 2 * even). Splits past a sequence's end are empty (they write LSE -inf only), which
// the combine folds away. Each warp computes it (no barrier): lane i holds sequence i's tile
// count, and a binary search on tps reduces over the warp.
template <int BN>
__device__ __forceinline__ int balanced_tps(const FcParams& p, int nsplit) {
    const int lane = threadIdx.x & 31;
    const int t = lane < p.b ? (fc::keys_of(p, lane) + BN - 1) / BN : 0;  // b <= 32: one per lane
    int mx = t, sum = t;  // the host keeps b * ceil(p.sk / BN) < 2^30
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        mx = max(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        sum += __shfl_xor_sync(0xffffffffu, sum, o);
    }
    const int budget = p.split_budget;  // >= p.b (host)
    int lo = max(max((sum + budget - 1) / budget, (mx + nsplit - 1) / nsplit), 1), hi = max(mx, 1);
#pragma unroll 1
    while (lo < hi) {  // count(hi) <= budget always (tps = mx: one split per sequence, b <= budget)
        const int mid = lo + (hi - lo) / 2;
        int cnt = (t + mid - 1) / mid;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) cnt += __shfl_xor_sync(0xffffffffu, cnt, o);
        if (cnt <= budget) hi = mid; else lo = mid + 1;
    }
    return lo;
}

// ---------------------------------------------------------------- FP8 (e4m3) K/V
// Stored K/V element of the `_e4m3` kernels: one e4m3 byte (s.eeee.mmm, bias 7; S.1111.111 is
// NaN, no infinity).
using e4m3_t = uint8_t;

// Two e4m3 bytes of the word w as two values of T (a T pair: the first byte in bits 0-15):
// bytes 1 and 3 (ODD) or bytes 0 and 2. Exact for every byte but NaN (every other e4m3 value,
// subnormals included, is a T value): the byte's exponent and mantissa bits shifted into the
// low bits of T's fields make T's value times 2^(T's bias - 7), undone by one exact multiply
// of the magnitudes; the signs are put back after it. A NaN byte comes out as 480; with KEEP_NAN
// (a tile that holds one, `tile_has_nan`) it comes out NaN. No branch either way.
template <typename T, bool ODD, bool KEEP_NAN>
__device__ __forceinline__ uint32_t e4m3_pair(uint32_t w) {
    constexpr bool F16 = std::is_same<T, __half>::value;
    // e4m3 bits 0-6 to f16 bits 7-13 / bf16 bits 4-10, in each half
    constexpr uint32_t MAG = F16 ? 0x3F803F80u : 0x07F007F0u;
    const uint32_t mag = ODD ? (F16 ? (w >> 1) : (w >> 4)) & MAG : (F16 ? (w << 7) : (w << 4)) & MAG;
    const uint32_t sgn = (ODD ? w : (w << 8)) & 0x80008000u;
    uint32_t u;
    if constexpr (F16) {
        asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(u) : "r"(mag), "r"(0x5C005C00u));  // * 2^8
    } else {
        // * 2^120 (bf16 0x7B80), + 0: fma is the bf16x2 multiply sm_80 has
        asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(u) : "r"(mag), "r"(0x7B807B80u), "r"(0u));
    }
    u |= sgn;
    if constexpr (KEEP_NAN) {
        // bit 7 of a byte of `t`: its low seven bits were all ones (0x7F / 0xFF); prmt with
        // the selector's bit 3 set fills a byte with bit 7 of the byte it picks
        const uint32_t t = (w & 0x7F7F7F7Fu) + 0x01010101u;
        uint32_t m;
        asm("prmt.b32 %0, %1, 0, %2;\n" : "=r"(m) : "r"(t), "r"(ODD ? 0xBB99u : 0xAA88u));
        u |= m & 0x7FFF7FFFu;
    }
    return u;
}

// Whether any of the `n` 16-byte chunks at `chunk(i)` (this thread's copies of a ring slot)
// holds an e4m3 NaN byte: a byte whose low seven bits are all ones carries into its bit 7.
template <int N, typename F>
__device__ __forceinline__ bool chunks_have_nan(F chunk) {
    uint32_t acc = 0u;
#pragma unroll
    for (int i = 0; i < N; ++i) {
        const uint4 w = *chunk(i);
        acc |= ((w.x & 0x7F7F7F7Fu) + 0x01010101u) | ((w.y & 0x7F7F7F7Fu) + 0x01010101u) |
               ((w.z & 0x7F7F7F7Fu) + 0x01010101u) | ((w.w & 0x7F7F7F7Fu) + 0x01010101u);
    }
    return (acc & 0x80808080u) != 0u;
}

// Byte offset of (row, 16-byte chunk) in a ring tile of e4m3 bytes (D bytes a row): the chunk
// index XORed with the row so that the 8 rows one ldmatrix reads at one chunk fall in 8
// different 16-byte bank groups (rows of 64 bytes: two rows share 128 bytes, so the XOR takes
// row / 2).
template <int D>
__device__ __forceinline__ uint32_t swz8_bytes(int row, int chunk) {
    constexpr int KC = D / 16;  // chunks a row
    const int x = D >= 128 ? (row & 7) : ((row >> 1) & (KC - 1));
    return static_cast<uint32_t>(row * D + ((chunk ^ x) << 4));
}

// ---------------------------------------------------------------- split kernel
// F8 (e4m3 K/V): the head's scales, read where used (cached loads; held across the key loop they
// spilled the windowed d128 kernel). Scores are q . k_stored * |k scale| * p.scale: the K scale's
// sign and a zero scale go into the Q fragments (`QSign`: q . (-k) = (-q) . k exactly; a zero
// scale zeroes Q, so a NaN byte of K still gives a NaN score, and keeps p.scale), its magnitude
// into the scale (`k_mag`); the V scale multiplies 1 / L in the epilogue (`v_scale`). The 16-bit kernels keep their own expressions (`F8 ? scaled : plain`).
template <bool F8>
__device__ __forceinline__ float k_scale(const FcParams& p, int kvh) {
    return F8 ? __ldg(p.k_scales + kvh * p.kv_scale_stride) : 1.f;
}
template <bool F8>
__device__ __forceinline__ float k_mag(const FcParams& p, int kvh) {
    const float ks = k_scale<F8>(p, kvh);
    return ks == 0.f ? 1.f : fabsf(ks);  // NaN / inf stay NaN / inf: the reference's answer
}
template <bool F8>
__device__ __forceinline__ float v_scale(const FcParams& p, int kvh) {
    return F8 ? __ldg(p.v_scales + kvh * p.kv_scale_stride) : 1.f;
}

// The K scale's sign and zero as one operation on Q's fragments: x ^ flip, then & keep.
struct QSign {
    uint32_t flip = 0u, keep = 0xFFFFFFFFu;
    __device__ __forceinline__ explicit QSign(float ks)
        : flip(ks < 0.f ? 0x80008000u : 0u), keep(ks == 0.f ? 0u : 0xFFFFFFFFu) {}
    __device__ __forceinline__ uint32_t operator()(uint32_t x) const { return (x ^ flip) & keep; }
};

// Dynamic shared memory of a split kernel: the packed Q tile, then S stages of a K and a V tile
// of KB-byte elements; the epilogue reuses it (= Variant::smem_bytes()).
__host__ __device__ constexpr uint32_t split_smem_bytes(int D, int BM, int BN, int S, int KB = 2) {
    return (uint32_t)(BM * D * 2 + 2 * S * BN * D * KB);
}

// Online softmax of one 16-key step of split_kernel (two rows per thread: h = 0 -> row g8,
// h = 1 -> row g8 + 8): s becomes P (unnormalised), O and the running sums are rescaled.
template <int NT>
__device__ __forceinline__ void softmax_step(float (&s)[2][4], float (&o)[NT][4], float (&m_run)[2], float (&l_run)[2],
                                             float sl2) {
    float alpha[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float mx = fmaxf(fmaxf(s[0][2 * h], s[0][2 * h + 1]), fmaxf(s[1][2 * h], s[1][2 * h + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m_run[h], mx);
        const float m_safe = (m_new == -INFINITY) ? 0.f : m_new;
        alpha[h] = fc::exp2_approx((m_run[h] - m_safe) * sl2);
        m_run[h] = m_new;
        const float ms = m_safe * sl2;
        float rs = 0.f;
#pragma unroll
        for (int n = 0; n < 2; ++n) {
            s[n][2 * h] = fc::exp2_approx(fmaf(s[n][2 * h], sl2, -ms));
            s[n][2 * h + 1] = fc::exp2_approx(fmaf(s[n][2 * h + 1], sl2, -ms));
            rs += s[n][2 * h] + s[n][2 * h + 1];
        }
        l_run[h] = fmaf(l_run[h], alpha[h], rs);
    }
#pragma unroll
    for (int j = 0; j < NT; ++j) {
        o[j][0] *= alpha[0]; o[j][1] *= alpha[0];
        o[j][2] *= alpha[1]; o[j][3] *= alpha[1];
    }
}

// S = Q K^T for one 16-key step of split_kernel (one m16 row tile, two n8 key tiles): Q from
// registers (qf, Q_IN_REGS) or from its swizzled tile at sQ_u (row a_row, chunk + a_chk); K rows
// from k_row of the tile at sK_u (chunk + k_chk).
template <typename T, int D, bool Q_IN_REGS, int QK>
__device__ __forceinline__ void qk_step(float (&s)[2][4], const uint32_t (&qf)[QK][4], uint32_t sQ_u, int a_row, int a_chk,
                                        uint32_t sK_u, int k_row, int k_chk) {
    constexpr int KT = D / 16;
#pragma unroll
    for (int n = 0; n < 2; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KT; ++kk) {
        uint32_t a[4];
        if constexpr (Q_IN_REGS) {
            a[0] = qf[kk][0]; a[1] = qf[kk][1]; a[2] = qf[kk][2]; a[3] = qf[kk][3];
        } else {
            fc::ldsm_x4(a[0], a[1], a[2], a[3], sQ_u + 2 * swz_elems<D>(a_row, 2 * kk + a_chk));
        }
        uint32_t b0, b1, b2, b3;
        fc::ldsm_x4(b0, b1, b2, b3, sK_u + 2 * swz_elems<D>(k_row, 2 * kk + k_chk));
        fc::Elem<T>::template mma<false>(s[0], a, b0, b1);
        fc::Elem<T>::template mma<false>(s[1], a, b2, b3);
    }
}

// Softcap and ALiBi on one 16-key step of split_kernel (fc::Softcap, fc::Alibi), before the
// mask: keys t * BN + key0 + 2 * t4 + n * 8 + e, this thread's packed rows r0 + wm * 16 + g8 and
// 8 below (query head kvh * h_ratio + r / sq, position r % sq; the terms are combined inside
// the ALiBi branch so that no sum of them stays live across the key loop).
template <bool F8, int BN>
__device__ __forceinline__ void modify_scores(float (&s)[2][4], const FcParams& p, int t, int key0, int t4, int r0, int wm,
                                              int g8, int rows_total, int sq, int sk, int bb, int kvh) {
    if (p.softcap > 0.f) {  // before the mask, as in fwd.cuh softcap_tile
        // pre recomputed from the parameters here (a volatile copy keeps it from being
        // hoisted and held across the key loop: d64 causal spilled 4 B on sm_80)
        float c = p.softcap;
        asm volatile("mov.b32 %0, %0;" : "+f"(c));
        const fc::Softcap cap(F8 ? p.scale * k_mag<F8>(p, kvh) : p.scale, c);
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[n][e] = cap(s[n][e]);
    }
    if (p.alibi_slopes != nullptr) {  // before the mask, after softcap (bias in score units)
        const int kb = t * BN + key0 + 2 * t4;
        const float lo = F8 ? fc::alibi_floor_at(p, p.scale_log2 * k_mag<F8>(p, kvh)) : fc::alibi_floor(p);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = min(r0 + wm * 16 + g8 + 8 * h, rows_total - 1);
            const int hl = r / sq, i = r - hl * sq;
            const fc::Alibi alibi(F8 ? fc::alibi_slope_units_at(p, bb, kvh * p.h_ratio + hl, p.scale * k_mag<F8>(p, kvh))
                                     : fc::alibi_slope_units(p, bb, kvh * p.h_ratio + hl),
                                  lo);
            const int dg = i + sk - sq;
#pragma unroll
            for (int n = 0; n < 2; ++n)
#pragma unroll
                for (int e = 0; e < 2; ++e) s[n][2 * h + e] = alibi(s[n][2 * h + e], kb + n * 8 + e, dg);
        }
    }
}

// P of one 16-key step as the A fragment of P V: the S accumulators (C layout == A layout)
// rounded to T in pairs.
template <typename T>
__device__ __forceinline__ void p_frag(const float (&s)[2][4], uint32_t (&pa)[4]) {
    pa[0] = fc::Elem<T>::pack(s[0][0], s[0][1]);
    pa[1] = fc::Elem<T>::pack(s[0][2], s[0][3]);
    pa[2] = fc::Elem<T>::pack(s[1][0], s[1][1]);
    pa[3] = fc::Elem<T>::pack(s[1][2], s[1][3]);
}

// O += P V for one 16-key step of split_kernel: P from the S accumulators (C layout == A
// layout), V rows from v_row of the tile at sV_u (chunk + v_chk), transposed by ldmatrix.
template <typename T, int D>
__device__ __forceinline__ void pv_step(float (&o)[D / 8][4], const float (&s)[2][4], uint32_t sV_u, int v_row, int v_chk) {
    uint32_t pa[4];
    p_frag<T>(s, pa);
#pragma unroll
    for (int j2 = 0; j2 < D / 16; ++j2) {
        uint32_t b0, b1, b2, b3;
        fc::ldsm_x4_trans(b0, b1, b2, b3, sV_u + 2 * swz_elems<D>(v_row, 2 * j2 + v_chk));
        fc::Elem<T>::template mma<false>(o[2 * j2], pa, b0, b1);
        fc::Elem<T>::template mma<false>(o[2 * j2 + 1], pa, b2, b3);
    }
}

// F8: Q's A fragment of k16 block kk for the head-dim order the byte K tiles give (`qk_step_f8`):
// a[0] / a[2] = row g8's columns 16 kk + 4 t4 + {1, 3} / {0, 2}, a[1] / a[3] the same of row
// g8 + 8 (two 8-byte reads of the swizzled Q tile), the K scale's sign and zero applied.
template <int D>
__device__ __forceinline__ void q_frag_f8(uint32_t (&a)[4], const unsigned char* sQ, int row, int t4, int kk,
                                          const QSign& sg) {
    const int ch = 2 * kk + (t4 >> 1), off = 8 * (t4 & 1);
    const uint2 lo = *reinterpret_cast<const uint2*>(sQ + 2 * swz_elems<D>(row, ch) + off);
    const uint2 hi = *reinterpret_cast<const uint2*>(sQ + 2 * swz_elems<D>(row + 8, ch) + off);
    a[0] = sg(__byte_perm(lo.x, lo.y, 0x7632)); a[2] = sg(__byte_perm(lo.x, lo.y, 0x5410));
    a[1] = sg(__byte_perm(hi.x, hi.y, 0x7632)); a[3] = sg(__byte_perm(hi.x, hi.y, 0x5410));
}

// Q's A fragments held in registers for the whole key loop (Q_IN_REGS): through ldmatrix, or
// with e4m3 K/V in the head-dim order of `q_frag_f8`.
template <int D, bool F8, int QK, typename T>
__device__ __forceinline__ void load_q_frags(uint32_t (&qf)[QK][4], const T* sQ, uint32_t sQ_u, int a_row, int a_chk,
                                             int q_row, int t4, const QSign& qsign) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        if constexpr (F8) {
            q_frag_f8<D>(qf[kk], reinterpret_cast<const unsigned char*>(sQ), q_row, t4, kk, qsign);
        } else {
            fc::ldsm_x4(qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3], sQ_u + 2 * swz_elems<D>(a_row, 2 * kk + a_chk));
        }
    }
}

// F8: S = Q K^T for one 16-key step, K widened in registers. ldmatrix on the byte tile hands
// each thread 4 consecutive bytes (head-dim columns 4 t4 .. 4 t4 + 3 of a 16-column block) of
// key row g8, which are its B fragment for the k order {2 t4, 2 t4 + 1, 2 t4 + 8, 2 t4 + 9} <->
// columns 4 t4 + {1, 3, 0, 2} (the odd bytes, then the even ones: `e4m3_pair`); Q's fragments
// follow the same order (`q_frag_f8`), and a dot product does not depend on the order of its
// terms. Keys keep their order (k_row: matrices
// (keys 0-7, block 2 kk2), (keys 0-7, 2 kk2 + 1), (keys 8-15, 2 kk2), (keys 8-15, 2 kk2 + 1)).
template <typename T, int D, bool Q_IN_REGS, bool KEEP_NAN, int QK>
__device__ __forceinline__ void qk_step_f8(float (&s)[2][4], const uint32_t (&qf)[QK][4], const unsigned char* sQ,
                                           int q_row, int t4, const QSign& sg, uint32_t sK_u, int k_row, int k_chk) {
#pragma unroll
    for (int n = 0; n < 2; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
    for (int kk2 = 0; kk2 < D / 32; ++kk2) {
        uint32_t r[4];
        fc::ldsm_x4(r, sK_u + swz8_bytes<D>(k_row, 2 * kk2 + k_chk));
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int kk = 2 * kk2 + j;
            uint32_t a[4];
            if constexpr (Q_IN_REGS) {
                a[0] = qf[kk][0]; a[1] = qf[kk][1]; a[2] = qf[kk][2]; a[3] = qf[kk][3];
            } else {
                q_frag_f8<D>(a, sQ, q_row, t4, kk, sg);
            }
#pragma unroll
            for (int n = 0; n < 2; ++n) {
                const uint32_t w = r[2 * n + j];
                fc::Elem<T>::template mma<false>(s[n], a, e4m3_pair<T, true, KEEP_NAN>(w), e4m3_pair<T, false, KEEP_NAN>(w));
            }
        }
    }
}

// F8: O += P V for one 16-key step, V widened in registers. ldmatrix.trans on the byte tile (as
// 16-bit pairs) hands each thread, per 8 keys and 16 columns, the bytes (key 2 t4, columns
// 2 g8 and 2 g8 + 1) and (key 2 t4 + 1, the same columns): the B fragments of two n8 tiles, one
// of the block's even columns (bytes 0, 2) and one of its odd columns (bytes 1, 3). So
// o[2 c] holds columns 16 c + 2 n and o[2 c + 1] columns 16 c + 2 n + 1 (n the tile's column);
// the epilogue puts them back in order (`split_epilogue`). Keys stay in order, so P is the
// S accumulator as in `pv_step`.
template <typename T, int D, bool KEEP_NAN>
__device__ __forceinline__ void pv_step_f8(float (&o)[D / 8][4], const float (&s)[2][4], uint32_t sV_u, int v_row,
                                           int v_chk) {
    uint32_t pa[4];
    p_frag<T>(s, pa);
#pragma unroll
    for (int j2 = 0; j2 < D / 32; ++j2) {
        uint32_t r[4];  // (keys 0-7, block 2 j2), (keys 8-15, 2 j2), (keys 0-7, 2 j2 + 1), (keys 8-15, 2 j2 + 1)
        fc::ldsm_x4_trans(r, sV_u + swz8_bytes<D>(v_row, 2 * j2 + v_chk));
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const uint32_t lo = r[2 * j], hi = r[2 * j + 1];  // keys 0-7, keys 8-15
            fc::Elem<T>::template mma<false>(o[2 * (2 * j2 + j)], pa, e4m3_pair<T, false, KEEP_NAN>(lo),
                                             e4m3_pair<T, false, KEEP_NAN>(hi));
            fc::Elem<T>::template mma<false>(o[2 * (2 * j2 + j) + 1], pa, e4m3_pair<T, true, KEEP_NAN>(lo),
                                             e4m3_pair<T, true, KEEP_NAN>(hi));
        }
    }
}

// The warps a split CTA spreads its m16 row tiles over: ceil(rows / 16) rounded up to a power of
// two (the remaining W / that warps split each K/V tile along keys).
__device__ __forceinline__ int row_tile_warps(int rows_here) {
    const int mtiles = (rows_here + 15) >> 4;
    int WM = 1;
    while (WM < mtiles) WM <<= 1;
    return WM;
}

// Epilogue of split_kernel: the warps of a row tile (WN of them, each with its own online
// softmax over its share of the keys) merge through shared memory (the K/V ring, no longer read);
// each row's O and LSE go to the output (one split) or to the split's partial rows (the combine
// reads them). q0: the sequence's first packed query row; vdch: the 16-byte chunks of an O row
// (p.dv / 8), the only ones merged and stored (a partial row holds p.dv f32).
template <typename T, int D, int W, bool F8>
__device__ __forceinline__ void split_epilogue(const FcParams& p, float (&o)[D / 8][4], float (&m_run)[2],
                                               float (&l_run)[2], float sl2, int rows_here, int r0,
                                               int sq, int bb, int kvh, int split, int q0, int vdch, int hq,
                                               int nsplit, int tid, int warp, int g8, int t4) {
    constexpr int THREADS = W * 32;
    constexpr int CPR = D / 8;
    constexpr int NT = D / 8;
    extern __shared__ __align__(128) unsigned char fc_decode_smem[];
    const int WN = W / row_tile_warps(rows_here);
    cp_async_wait<0>();
    __syncthreads();
    constexpr int OSTR = D + 8;  // padded f32 row stride
    float* sO = reinterpret_cast<float*>(fc_decode_smem);  // [W][16][OSTR]
    float* sML = sO + W * 16 * OSTR;                       // [W][16][2] = (m, l)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float l = l_run[h];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const int rr = g8 + 8 * h;
        if constexpr (F8) {
            // pv_step_f8's order: o[2 c] columns 16 c + 4 t4 + {0, 2}, o[2 c + 1] + {1, 3}
            float* dst = sO + (warp * 16 + rr) * OSTR + 4 * t4;
#pragma unroll
            for (int c = 0; c < NT / 2; ++c)
                *reinterpret_cast<float4*>(dst + 16 * c) =
                    make_float4(o[2 * c][2 * h], o[2 * c + 1][2 * h], o[2 * c][2 * h + 1], o[2 * c + 1][2 * h + 1]);
        } else {
            float* dst = sO + (warp * 16 + rr) * OSTR + 2 * t4;
#pragma unroll
            for (int j = 0; j < NT; ++j)
                *reinterpret_cast<float2*>(dst + 8 * j) = make_float2(o[j][2 * h], o[j][2 * h + 1]);
        }
        if (t4 == 0) {
            sML[(warp * 16 + rr) * 2 + 0] = m_run[h];
            sML[(warp * 16 + rr) * 2 + 1] = l;
        }
    }
    __syncthreads();

    const float scale = fc::score_unit(F8 ? p.scale * k_mag<F8>(p, kvh) : p.scale, p.softcap);
    const float vsc = v_scale<F8>(p, kvh);
    const int B = p.b;
    for (int item = tid; item < rows_here * CPR; item += THREADS) {
        const int rl = item / CPR, ch = item - rl * CPR;
        if (ch >= vdch) continue;  // O's columns from p.dv on: none (zero V columns)
        const int mt = rl >> 4, rr = rl & 15;
        float M = -INFINITY;
        for (int w = 0; w < WN; ++w) M = fmaxf(M, sML[((mt * WN + w) * 16 + rr) * 2]);
        const float Ms = (M == -INFINITY) ? 0.f : M;
        float L = 0.f;
        for (int w = 0; w < WN; ++w) {
            const float* ml = sML + ((mt * WN + w) * 16 + rr) * 2;
            L += ml[1] * fc::exp2_approx((ml[0] - Ms) * sl2);
        }
        const float inv = L > 0.f ? (F8 ? vsc / L : 1.f / L) : 0.f;  // F8: the V scale, once
        float acc[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] = 0.f;
        for (int w = 0; w < WN; ++w) {
            const float* ml = sML + ((mt * WN + w) * 16 + rr) * 2;
            const float f = fc::exp2_approx((ml[0] - Ms) * sl2) * inv;
            const float* src = sO + ((mt * WN + w) * 16 + rr) * OSTR + ch * 8;
            const float4 x0 = *reinterpret_cast<const float4*>(src);
            const float4 x1 = *reinterpret_cast<const float4*>(src + 4);
            acc[0] = fmaf(f, x0.x, acc[0]); acc[1] = fmaf(f, x0.y, acc[1]);
            acc[2] = fmaf(f, x0.z, acc[2]); acc[3] = fmaf(f, x0.w, acc[3]);
            acc[4] = fmaf(f, x1.x, acc[4]); acc[5] = fmaf(f, x1.y, acc[5]);
            acc[6] = fmaf(f, x1.z, acc[6]); acc[7] = fmaf(f, x1.w, acc[7]);
        }
        // L = 0: no visible key (the combine skips this split); L NaN (a NaN score or slope):
        // NaN, which the combine carries into the row instead of skipping the split.
        float lse = L > 0.f ? Ms * scale + logf(L) : (L == 0.f ? -INFINITY : L);
        const int r = r0 + rl;
        const int hl = r / sq, i = r - hl * sq;
        const int h = kvh * p.h_ratio + hl;
        // One split writes the final row: the head's sink (if any) joins its normaliser here, as
        // a factor on the row normalised without it (held through the loop above, the sink
        // spilled the d256 windowed kernel); split grids leave it to the combine (once per row).
        if (nsplit == 1 && p.sinks != nullptr) {
            const float sink = fc::sink_of(p, h);
            if (sink != -INFINITY) {
                const float f = fc::finalize_sink(Ms * scale, L, sink, lse) * L;
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[e] *= f;
            }
        }
        if (nsplit == 1) {
            T* od = static_cast<T*>(p.o) + (int64_t)bb * p.o_batch_stride + (int64_t)(q0 + i) * p.o_row_stride +
                    (int64_t)h * p.o_head_stride + ch * 8;
            uint4 u;
            u.x = fc::Elem<T>::pack(acc[0], acc[1]);
            u.y = fc::Elem<T>::pack(acc[2], acc[3]);
            u.z = fc::Elem<T>::pack(acc[4], acc[5]);
            u.w = fc::Elem<T>::pack(acc[6], acc[7]);
            *reinterpret_cast<uint4*>(od) = u;
            if (ch == 0) fc::lse_ptr(p, bb, h, q0)[i] = lse;
        } else {
            const int64_t prow = (((int64_t)split * B + bb) * hq + h) * p.sq + i;
            float* od = p.o_partial + prow * p.dv + ch * 8;
            reinterpret_cast<float4*>(od)[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
            reinterpret_cast<float4*>(od)[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
            if (ch == 0) p.lse_partial[prow] = lse;
        }
    }
}

// Shared address of (row, 16-byte chunk) in a ring tile of e4m3 bytes (swz8_bytes). The
// 16-bit tiles' address arithmetic is kept as it was (swz_elems), and their kernels' PTX with
// it (other forms spilled d64 local 8 B on sm_80).
template <int D, typename T>
__device__ __forceinline__ uint32_t ring_addr8(T* tile, int row, int ch) {
    return smem_addr(tile) + swz8_bytes<D>(row, ch);
}

// The head's K and V base of sequence bb, kv head kvh: the head's rows in a paged pool (rows
// then through the page table), else the sequence's first key row.
template <typename KV>
__device__ __forceinline__ void kv_head_base(const FcParams& p, int bb, int kvh, const fc::SeqRange& sr, const KV*& kg,
                                             const KV*& vg) {
    const bool paged = p.page_table != nullptr;
    kg = static_cast<const KV*>(p.k) + (int64_t)kvh * p.k_head_stride +
         (paged ? 0 : (int64_t)bb * p.k_batch_stride + (int64_t)sr.k0 * p.k_row_stride);
    vg = static_cast<const KV*>(p.v) + (int64_t)kvh * p.v_head_stride +
         (paged ? 0 : (int64_t)bb * p.v_batch_stride + (int64_t)sr.k0 * p.v_row_stride);
}

// The split kernel's K / V tile loads into its cp.async ring, one of three ways:
//  * contiguous caches: rows key0, key0 + THREADS / KCPR, ... of the head's rows;
//  * paged pools whose pages hold whole runs of a warp's rows (`whole_pages`: paged, no window,
//    page_size a multiple of BN / W): each warp keeps 32 consecutive page ids of its sequence
//    from the split's first page on (lane l: page base + l), clamped into the pool, and reads
//    the next 32 ahead (base + 32 + l); when its tiles pass base + 32 those take over and the
//    next 32 are read, ~32 pages before use. (A lookup one tile ahead still stalled: a
//    page-table read issued behind a tile's copies returns after them when DRAM is saturated,
//    and b8 ran 0.94-0.95x the contiguous cache.) The first read does not wait for the sequence
//    length. Pages smaller than a tile (16, 32, 48 ...: any multiple of the BN / W rows a warp
//    copies) take this path too, with the tile's rows dealt out by warp (`warp_rows`): warp w
//    copies rows [w * BN / W, (w + 1) * BN / W) of the tile, which lie in one page, so the warp
//    looks up one page per tile instead of one per row (the per-row path's shuffles and 64-bit
//    address arithmetic per row pass; b64 x 4k at pages of 16 ran 0.945x the contiguous cache on
//    the H200 that way; decisions.md#paged-decode-page-reads). Windowed kernels take the per-row
//    path (with these registers d128 spilled 36-48 B);
//  * other paged pools: every row through the page table, the pages of a tile looked up one
//    tile ahead, one row per lane.
// Rows past the sequence (sk) and K chunks past kdch are zero-filled; V chunks past p.dv's
// columns are zero-filled or copies (v_chunk_ok, v_src_chunk). Tiles load in order.
template <typename T, typename KV, int D, int BN, int W, int PF>
struct KvTileLoader {
    static constexpr int THREADS = W * 32;
    static constexpr bool F8 = sizeof(KV) == 1;
    static constexpr int KB = sizeof(KV);  // bytes per stored K/V element
    static constexpr int KEL = 16 / KB;    // K/V elements per 16-byte chunk
    static constexpr int KCPR = D / KEL;   // 16-byte chunks per K/V row
    static constexpr int RW = BN / W;      // a warp's rows of a tile when they are dealt out by warp

    const FcParams& p;
    T* sKV;          // the ring: S slots of [K tile][V tile] of KV elements (addressed in T)
    const KV* kg;    // the head's K / V base (kv_head_base)
    const KV* vg;
    int64_t ksr, vsr;
    int bb, sk, kdch;  // kdch: 16-byte chunks of a stored K row (p.d's)
    bool paged, whole_pages, warp_rows;
    int tid, lane, warp;
    int last_page;
    // whole pages: the warp's window of page ids (lane l: page pg_base + l; the next 32 in pg_nxt)
    int pg_base = 0, pg_cur = 0, pg_nxt = 0;
    // per-row pages: tile pf_tile's page and slot of this lane's row, looked up ahead
    int pf_tile = -1, pf_page = 0, pf_slot = 0;
    // whole pages: the element offsets of this thread's first K and V row of tile nx_t
    int nx_t = -1;
    int64_t nx_ko = 0, nx_vo = 0;

    __device__ __forceinline__ KvTileLoader(const FcParams& p_, T* sKV_, const KV* kg_, const KV* vg_, int bb_, int sk_,
                                            int kdch_, bool whole_pages_, bool warp_rows_)
        : p(p_), sKV(sKV_), kg(kg_), vg(vg_), ksr(p_.k_row_stride), vsr(p_.v_row_stride), bb(bb_), sk(sk_),
          kdch(kdch_), paged(p_.page_table != nullptr), whole_pages(whole_pages_), warp_rows(warp_rows_),
          tid(threadIdx.x), lane(threadIdx.x & 31), warp(threadIdx.x >> 5),
          last_page(p_.page_table != nullptr ? p_.total_k / p_.page_size - 1 : 0) {}

    // V columns from p.dv on: their O columns are never merged or stored, so they need only be
    // read in bounds. The 16-bit tiles zero-fill those chunks (v_chunk_ok false), the byte tiles
    // copy the row's last chunk below p.dv into them (v_src_chunk): each form is the one that
    // kept its kernels' registers (the other spilled 16-bit d64 8-12 B on sm_86, or took e4m3
    // d64 from 128 to 139-151 registers). p.dv is re-read at each use (a volatile copy; held
    // across the key loop beside kdch it spilled 16-bit d64 8 B on sm_86 / sm_89).
    __device__ __forceinline__ int dv_remat() const {
        int dv;
        asm volatile("mov.b32 %0, %1;" : "=r"(dv) : "r"(p.dv));
        return dv;
    }
    __device__ __forceinline__ bool v_chunk_ok(int ch) const { return F8 || ch * KEL < dv_remat(); }
    __device__ __forceinline__ int v_src_chunk(int ch) const {
        return F8 ? min(ch, dv_remat() / KEL - 1) : ch;
    }
    // this thread's first row of a tile (whole pages; rows then every 32 / KCPR with
    // `warp_rows`, every THREADS / KCPR otherwise)
    __device__ __forceinline__ int row_first() const { return warp_rows ? warp * RW + lane / KCPR : tid / KCPR; }
    // page id j of the sequence (0 past the table's row), clamped into the pool
    __device__ __forceinline__ int read_pages(int j) const {
        return j < p.page_table_stride
                   ? fc::page_id(p, bb, j, [&] { return last_page; })
                   : 0;
    }
    // whole pages: the window from page `base` on
    __device__ __forceinline__ void seek_pages(int base) {
        pg_base = base;
        pg_cur = read_pages(pg_base + lane);
        pg_nxt = read_pages(pg_base + 32 + lane);
    }
    // Per-row pages: the page and slot of one row per lane of tile t. Rows are looked up within
    // the table's width (p.sk), not the sequence's length: the lookup does not wait for
    // seqused_k (rows past the length are not copied).
    __device__ __forceinline__ void lookup(int t, int& page, int& slot) const {
        constexpr int TPR = 32 / KCPR, ITERS = BN * KCPR / THREADS;
        page = 0;
        slot = 0;
        if (lane < TPR * ITERS) {
            const int key = t * BN + warp * TPR + (lane % TPR) + (THREADS / KCPR) * (lane / TPR);
            if (key < p.sk) page = fc::page_of(p, bb, key, slot);
        }
    }
    // Per-row pages: tile t's lookup ahead of its load.
    __device__ __forceinline__ void prefetch_rows(int t) {
        lookup(t, pf_page, pf_slot);
        pf_tile = t;
    }
    // Whole pages: the element offsets of this thread's first K and V row of tile t (from kg /
    // vg), advancing the warp's page ids as needed.
    __device__ __forceinline__ void page_offsets(int t, int64_t& ko, int64_t& vo) {
        const int j = (t * BN + (warp_rows ? warp * RW : 0)) / p.page_size;  // the warp's page
        while (j >= pg_base + 32) {  // tiles come in order (BN / RW pages per tile at most)
            pg_base += 32;
            pg_cur = pg_nxt;
            pg_nxt = read_pages(pg_base + 32 + lane);
        }
        const int64_t page = __shfl_sync(0xffffffffu, pg_cur, j - pg_base);  // j - pg_base < 32
        const int slot = t * BN - j * p.page_size + row_first();
        ko = fc::paged_offset(page, slot, p.k_batch_stride, ksr);
        vo = fc::paged_offset(page, slot, p.v_batch_stride, vsr);
    }
    // The prologue: tiles t_begin .. t_begin + S - 2 (those before t_end) into slots 0 .. S - 2,
    // one commit group each (F8: not unrolled; its tile loads unrolled spilled d128 on sm_80).
    template <int S>
    __device__ __forceinline__ void prologue(int t_begin, int t_end) {
        if constexpr (F8) {
#pragma unroll 1
            for (int s = 0; s < S - 1; ++s) {
                if (t_begin + s < t_end) load(t_begin + s, s);
                fc::cp_async_commit<false>();
            }
        } else {
#pragma unroll
            for (int s = 0; s < S - 1; ++s) {
                if (t_begin + s < t_end) load(t_begin + s, s);
                fc::cp_async_commit<false>();
            }
        }
    }
    // Once this thread's copies of ring slot `slot` are waited for: the barrier after which the
    // tile is visible to every warp; F8: it also tells whether any thread's copies hold a NaN
    // byte (the tile's steps then widen with NaN kept: `e4m3_pair`).
    __device__ __forceinline__ bool tile_barrier(int slot) const {
        if constexpr (F8) {
            return __syncthreads_or(copied_have_nan(slot));
        } else {
            __syncthreads();
            return false;
        }
    }
    // F8: whether the chunks this thread copied into ring slot `slot` (visible to it once its
    // copies are waited for) hold an e4m3 NaN byte; the rows as the load path that wrote them
    // (dealt out by warp on whole pages shorter than a tile).
    __device__ __forceinline__ bool copied_have_nan(int slot) const {
        constexpr int N = BN * KCPR / THREADS;
        const unsigned char* sK = reinterpret_cast<const unsigned char*>(sKV) + slot * (2 * BN * D);
        const bool by_warp = whole_pages && warp_rows;
        const int rf = by_warp ? row_first() : tid / KCPR;
        const int step = by_warp ? 32 / KCPR : THREADS / KCPR;
        const int ch = tid % KCPR;
        return chunks_have_nan<2 * N>([&](int i) {
            return reinterpret_cast<const uint4*>(sK + (i & 1) * (BN * D) + swz8_bytes<D>(rf + (i >> 1) * step, ch));
        });
    }
    __device__ __forceinline__ uint32_t addr(T* tile, int row, int ch) const {
        return F8 ? ring_addr8<D>(tile, row, ch) : smem_addr(tile + swz_elems<D>(row, ch));
    }

    // Tile t into ring slot `slot`.
    __device__ __forceinline__ void load(int t, int slot) {
        T* sK = sKV + slot * (2 * BN * D * KB / 2);  // 2 * BN * D * KB bytes per slot
        T* sV = sK + BN * D * KB / 2;
        const int ch = tid % KCPR;
        const int row0 = tid / KCPR;
        const int key0 = t * BN + row0;
        if (whole_pages) {
            load_whole_pages(t, sK, sV, ch);
        } else if (paged) {
            load_paged_rows(t, sK, sV, ch, row0, key0);
        } else {
            load_dense(sK, sV, ch, row0, key0);
        }
    }
    // The warp's rows follow each other in one page (tiles start at multiples of BN), addressed
    // as in the contiguous cache.
    __device__ __forceinline__ void load_whole_pages(int t, T* sK, T* sV, int ch) {
        constexpr int UNROLL = BN * KCPR / THREADS > 8 ? 4 : BN * KCPR / THREADS;  // as load_paged_rows
        int64_t ko, vo;
        if (nx_t == t) {
            ko = nx_ko;
            vo = nx_vo;
        } else {
            page_offsets(t, ko, vo);
        }
        const KV* kp = kg + ko + ch * KEL;
        const KV* vp = vg + vo + v_src_chunk(ch) * KEL;
        // the rows' copies, with the step between a thread's rows a compile-time constant (as a
        // runtime value it cost pages of 64 0.5-1 %)
        auto copy_rows = [&](auto step_c, int rf) {
            constexpr int STEP = decltype(step_c)::value;
            const KV* kpi = kp;
            const KV* vpi = vp;
#pragma unroll UNROLL
            for (int it = 0; it < BN * KCPR / THREADS; ++it) {
                const int row = rf + it * STEP;
                const bool in = t * BN + row < sk;
                const bool okk = in && ch < kdch, okv = in && v_chunk_ok(ch);
                fc::cp_async16<PF, false>(addr(sK, row, ch), okk ? kpi : kg, okk ? 16 : 0);
                fc::cp_async16<PF, false>(addr(sV, row, ch), okv ? vpi : vg, okv ? 16 : 0);
                kpi += STEP * ksr;
                vpi += STEP * vsr;
            }
        };
        if (warp_rows) {
            copy_rows(std::integral_constant<int, 32 / KCPR>{}, row_first());
        } else {
            copy_rows(std::integral_constant<int, THREADS / KCPR>{}, row_first());
        }
        // the next tile's rows, while these copies are in flight: its issue is then only the
        // copies, as in the contiguous cache (the page arithmetic in front of every tile's
        // copies lengthened each tile's round trip)
        page_offsets(t + 1, nx_ko, nx_vo);
        nx_t = t + 1;
    }
    // Every row through the page table. The warp's rows of this tile (TPR per pass, ITERS
    // passes: at most 32) get their page looked up once, one row per lane, all lanes at once,
    // one tile ahead (`lookup`); each pass takes its row's page and slot by shuffle. (A lookup
    // per pass put ITERS dependent page-table loads, mostly L2 misses, in front of every tile:
    // b1/b8 decode ran 0.6-0.8x the contiguous cache; one lookup per tile, not ahead: 0.82-0.90x.)
    __device__ __forceinline__ void load_paged_rows(int t, T* sK, T* sV, int ch, int row0, int key0) {
        constexpr int TPR = 32 / KCPR;  // distinct rows of a warp per pass
        constexpr int ITERS = BN * KCPR / THREADS;
        static_assert(32 % KCPR == 0 && TPR * ITERS <= 32, "paged decode: one row per lane");
        // d256 (16 passes) unrolled by 4: unrolled fully its tiles spilled 12-24 B
        constexpr int UNROLL = ITERS > 8 ? 4 : ITERS;
        int my_page, my_slot;
        if (pf_tile == t) {
            my_page = pf_page;
            my_slot = pf_slot;
        } else {
            lookup(t, my_page, my_slot);
        }
        lookup(t + 1, pf_page, pf_slot);  // tiles load in order: the next call's
        pf_tile = t + 1;
#pragma unroll UNROLL
        for (int it = 0; it < ITERS; ++it) {
            const int row = row0 + it * (THREADS / KCPR);
            const int key = key0 + it * (THREADS / KCPR);
            const bool in = key < sk;
            const bool okk = in && ch < kdch, okv = in && v_chunk_ok(ch);
            const int src = lane / KCPR + TPR * it;
            const int64_t page = __shfl_sync(0xffffffffu, my_page, src);
            const int slot = __shfl_sync(0xffffffffu, my_slot, src);
            const KV* kp = okk ? kg + fc::paged_offset(page, slot, p.k_batch_stride, ksr) + ch * KEL : kg;
            const int vc = v_src_chunk(ch);
            const KV* vp = okv ? vg + fc::paged_offset(page, slot, p.v_batch_stride, vsr) + vc * KEL : vg;
            fc::cp_async16<PF, false>(addr(sK, row, ch), kp, okk ? 16 : 0);
            fc::cp_async16<PF, false>(addr(sV, row, ch), vp, okv ? 16 : 0);
        }
    }
    __device__ __forceinline__ void load_dense(T* sK, T* sV, int ch, int row0, int key0) {
        const KV* kp = kg + (int64_t)key0 * ksr + ch * KEL;
        const KV* vp = vg + (int64_t)key0 * vsr + v_src_chunk(ch) * KEL;
#pragma unroll
        for (int it = 0; it < BN * KCPR / THREADS; ++it) {
            const int row = row0 + it * (THREADS / KCPR);
            const bool in = key0 + it * (THREADS / KCPR) < sk;
            const bool okk = in && ch < kdch, okv = in && v_chunk_ok(ch);
            const int64_t ko = (int64_t)it * (THREADS / KCPR) * ksr;
            const int64_t vo = (int64_t)it * (THREADS / KCPR) * vsr;
            fc::cp_async16<PF, false>(addr(sK, row, ch), okk ? kp + ko : kg, okk ? 16 : 0);
            fc::cp_async16<PF, false>(addr(sV, row, ch), okv ? vp + vo : vg, okv ? 16 : 0);
        }
    }
};

// The packed Q rows r0 .. r0 + rows_here - 1 of the split kernel's CTA (query head kvh * h_ratio
// + r / sq, position r % sq; qg: the sequence's first query row) into the swizzled Q tile at sQ
// with cp.async (one commit group); padding rows and chunks past dch zero-filled.
template <typename T, int D, int BM, int W>
__device__ __forceinline__ void load_q_tile(T* sQ, const FcParams& p, const T* qg, int tid, int r0, int rows_here, int sq,
                                            int kvh, int dch) {
    constexpr int THREADS = W * 32, CPR = D / 8;
    const int ch = tid % CPR;
#pragma unroll
    for (int it = 0; it < BM * CPR / THREADS; ++it) {
        const int row = tid / CPR + it * (THREADS / CPR);
        const int r = r0 + row;
        const bool ok = row < rows_here && ch < dch;
        const T* src = qg;
        if (ok) {
            const int hl = r / sq, i = r - hl * sq;
            src = qg + (int64_t)i * p.q_row_stride + (int64_t)(kvh * p.h_ratio + hl) * p.q_head_stride + ch * 8;
        }
        fc::cp_async16<128, false>(smem_addr(sQ + swz_elems<D>(row, ch)), src, ok ? 16 : 0);
    }
    fc::cp_async_commit<false>();
}

// The key tiles [t_lo, t_hi) the packed rows r0 .. r0 + rows_here - 1 of a split CTA see
// between them, and the keys [lo_all, hi_all) all of them see. The rows' positions i_min ..
// i_max: all of 0 .. sq - 1 when the block holds sq rows or more or spans two query heads.
template <int MASK, int BN>
__device__ __forceinline__ void split_key_range(int r0, int rows_here, int sq, int sk, int wl, int wr, int& t_lo, int& t_hi,
                                                int& lo_all, int& hi_all) {
    const int diag = sk - sq;
    const int r_last = r0 + rows_here - 1;
    int i_min, i_max;
    if (rows_here >= sq || (r0 / sq) != (r_last / sq)) {
        i_min = 0;
        i_max = sq - 1;
    } else {
        i_min = r0 % sq;
        i_max = r_last % sq;
    }
    int lo_cta = 0, hi_cta = sk;  // union of the rows' ranges
    lo_all = 0, hi_all = sk;
    if (MASK != 0) {
        if (wr >= 0) {
            hi_cta = fc::clamp_i(i_max + diag + wr + 1, 0, sk);
            hi_all = fc::clamp_i(i_min + diag + wr + 1, 0, sk);
        }
        if (wl >= 0) {
            lo_cta = fc::clamp_i(i_min + diag - wl, 0, sk);
            lo_all = fc::clamp_i(i_max + diag - wl, 0, sk);
        }
    }
    t_lo = lo_cta / BN;
    t_hi = (hi_cta + BN - 1) / BN;
    if (hi_cta <= lo_cta) t_hi = t_lo;
}

// The mask on one 16-key step of split_kernel: keys kb + n * 8 + (e & 1) against this thread's
// two rows' bands (row_lo / row_hi[e >> 1]).
__device__ __forceinline__ void mask_step(float (&s)[2][4], int kb, const int (&row_lo)[2], const int (&row_hi)[2]) {
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) fc::mask_score(s[n][e], kb + n * 8 + (e & 1), row_lo[e >> 1], row_hi[e >> 1]);
}

// The split CTA's row block rb, kv head kvh, sequence bb and split from blockIdx.x. Splits vary
// slowest: the hardware hands out the blocks in order, so every sequence's first splits come
// first and a split grid with empty splits (short sequences, balanced splits) puts its working
// CTAs one per SM before the empty ones, not two on one SM and none on the next (equal lengths
// under balanced splits: b8 x 32k at pages of 64 +2.6 % with the split fastest).
template <int BM>
__device__ __forceinline__ void split_block_coords(const FcParams& p, int& rb, int& kvh, int& bb, int& split) {
    const int row_blocks = (p.h_ratio * p.sq + BM - 1) / BM;  // the grid's (max_seqlen_q) packing
    int bid = blockIdx.x;
    rb = bid % row_blocks;
    bid /= row_blocks;
    kvh = bid % p.hkv;
    bid /= p.hkv;
    bb = bid % p.b;
    split = bid / p.b;
}

// The split kernel's tile shape rules (each failing one names itself).
template <typename T, typename KV, int D, int BM, int BN, int W, int S>
__host__ __device__ constexpr bool split_shape_ok() {
    constexpr int THREADS = W * 32, CPR = D / 8, KB = sizeof(KV), KCPR = D / (16 / KB);
    static_assert(std::is_same<KV, T>::value || std::is_same<KV, e4m3_t>::value, "K/V: T or e4m3");
    static_assert(D % 64 == 0, "HEAD_DIM must be a multiple of 64");
    static_assert((W & (W - 1)) == 0 && W >= 1 && W <= 8, "WARPS must be a power of two <= 8");
    static_assert(BM % 16 == 0 && BM <= 16 * W, "BLOCK_M must be a multiple of 16 and <= 16*WARPS");
    static_assert(BN % (16 * W) == 0, "BLOCK_N must be a multiple of 16*WARPS");
    static_assert(S >= 2, "STAGES >= 2");
    static_assert(THREADS % CPR == 0, "32*WARPS must be a multiple of HEAD_DIM/8");
    static_assert((BN * CPR) % THREADS == 0 && (BM * CPR) % THREADS == 0, "tile/thread mismatch");
    static_assert(THREADS % KCPR == 0 && (BN * KCPR) % THREADS == 0, "K/V tile/thread mismatch");
    // epilogue scratch (per-warp O, m, l) must fit in the dynamic smem
    static_assert(W * 16 * (D + 8) * 4 + W * 16 * 2 * 4 <= split_smem_bytes(D, BM, BN, S, KB), "epilogue smem");
    return true;
}

// KV: T, or e4m3_t for FP8 K/V (the `_e4m3` kernels): the ring holds K/V tiles of bytes
// (swz8_bytes), and the tensor-core steps widen the B fragments they read from them in
// registers (qk_step_f8, pv_step_f8): no 16-bit copy of a tile, no barrier beyond the 16-bit
// kernels'. The K scale of the head folds into the softmax scale (its sign and zero into Q's
// fragments), the V scale into the final 1 / L: no per-element multiply.
template <typename T, int D, int MASK, int BM, int BN, int W, int S, typename KV = T, int PF = 128>
__device__ __forceinline__ void split_kernel(const FcParams& p) {
    constexpr int THREADS = W * 32;
    constexpr bool F8 = sizeof(KV) == 1;
    constexpr int KB = sizeof(KV);     // bytes per stored K/V element
    constexpr int KEL = 16 / KB;       // K/V elements per 16-byte chunk
    constexpr int KT = D / 16;   // k16 steps of Q.K^T
    constexpr int NT = D / 8;    // n8 tiles of O
    // (F8 windowed d128 reads Q from shared memory: with Q held, the widening's registers
    // spilled 36-40 B)
    constexpr bool Q_IN_REGS = D <= 128 && !(F8 && MASK == fc::MASK_WINDOW && D == 128);
    static_assert(split_shape_ok<T, KV, D, BM, BN, W, S>(), "split kernel shape");

    extern __shared__ __align__(128) unsigned char fc_decode_smem[];
    fc::pdl_wait();               // inputs of a preceding kernel (no-op without PDL)
    fc::pdl_launch_dependents();  // let the combine grid get scheduled early (it waits for our completion)
    T* sQ = reinterpret_cast<T*>(fc_decode_smem);
    // S stages of [K tile BN x D][V tile BN x D] of KV elements (addressed in units of T, as
    // the 16-bit kernels always were)
    T* sKV = sQ + BM * D;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g8 = lane >> 2, t4 = lane & 3;
    const int hq = p.hq;
    const int nsplit = p.num_splits;
    int rb, kvh, bb, split;
    split_block_coords<BM>(p, rb, kvh, bb, split);
    const fc::SeqRange sr = fc::seq_range(p, bb);
    const int sq = sr.sq, sk = sr.sk;
    const int rows_total = p.h_ratio * sq;  // this sequence's packed rows

    const int r0 = rb * BM;
    if (r0 >= rows_total) return;  // a shorter sequence (varlen): the combine skips these rows
    const bool paged = p.page_table != nullptr;
    const bool fixed_splits = paged && MASK != 2;  // see `tps`
    constexpr int RW = BN / W;  // a warp's rows of a tile when they are dealt out by warp
    // the K / V ring's loads (KvTileLoader: whole pages per warp, pages per row, or contiguous)
    const int dch = p.d / 8;    // 16-byte chunks of a Q row
    const int vdch = p.dv / 8;  // of an O row
    // of a stored K row (F8: the host passes p.d % 16 == 0 and p.dv % 16 == 0)
    const int kdch = F8 ? p.d / KEL : dch;
    const KV* kg;
    const KV* vg;
    kv_head_base(p, bb, kvh, sr, kg, vg);
    KvTileLoader<T, KV, D, BN, W, PF> kv(p, sKV, kg, vg, bb, sk, kdch, fixed_splits && p.page_size % RW == 0,
                                         p.page_size % BN != 0);
    // Balanced splits: the first pages are read for the even split of p.sk into
    // split_budget / b parts (what equal lengths balance to) while `balanced_tps` runs, and
    // again below where the balanced split starts elsewhere.
    const bool balanced = MASK == 0 && p.split_budget > 0;
    const int spec_splits = balanced ? max(p.split_budget / p.b, 1) : nsplit;
    if (kv.whole_pages) {
        // the split's first page (its first tile as `tps` below, before any use of sk)
        const int tps0 = ((p.sk + BN - 1) / BN + spec_splits - 1) / spec_splits;
        kv.seek_pages(split * tps0 * BN / p.page_size);
    }

    const int rows_here = min(BM, rows_total - r0);
    const int WM = row_tile_warps(rows_here);
    const int WN = W / WM;
    const int wm = warp / WN, wn = warp - wm * WN;
    const int kpw = BN / WN;  // keys per warp per tile (multiple of 16)

    // ---- visible key range of this CTA's rows: tiles [t_lo, t_hi); keys [lo_all, hi_all) are
    // visible to every row (tiles inside need no mask)
    const int diag = sk - sq;
    const int wl = MASK == fc::MASK_WINDOW ? p.window_left : -1;
    const int wr = MASK == fc::MASK_WINDOW ? p.window_right : (MASK == fc::MASK_CAUSAL ? 0 : -1);
    int t_lo, t_hi, lo_all, hi_all;
    split_key_range<MASK, BN>(r0, rows_here, sq, sk, wl, wr, t_lo, t_hi, lo_all, hi_all);
    // ---- per-thread rows (for masks): rows g8 and g8 + 8 of m-tile wm
    int row_lo[2], row_hi[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = r0 + wm * 16 + g8 + 8 * h;
        fc::band_clamped<MASK>(r % sq, diag, sk, wl, wr, row_lo[h], row_hi[h]);
    }

    // ---- Q tile -> smem (cp.async, zero-filled padding rows)
    const T* qg = static_cast<const T*>(p.q) + (int64_t)bb * p.q_batch_stride + (int64_t)sr.q0 * p.q_row_stride;
    load_q_tile<T, D, BM, W>(sQ, p, qg, tid, r0, rows_here, sq, kvh, dch);

    // Splits of a paged cache without a window cut the grid's key range (p.sk = the table's
    // width in keys, not this sequence's length): a split's first tile, and so its first pages,
    // are known before the sequence length arrives (KvTileLoader). A shorter sequence leaves
    // its last splits empty; the longest split is the same.
    // The split's tiles are placed after the Q load is out (balanced splits read the lengths).
    const int tps = balanced ? balanced_tps<BN>(p, nsplit) : ((fixed_splits ? (p.sk + BN - 1) / BN : t_hi - t_lo) + nsplit - 1) / nsplit;
    const int t_first = t_lo + split * tps;  // fixed_splits: t_lo = 0
    if (balanced && kv.whole_pages && t_first * BN / p.page_size != kv.pg_base) kv.seek_pages(t_first * BN / p.page_size);
    const int t_begin = min(t_first, t_hi);
    const int t_end = min(t_begin + tps, t_hi);
    // An empty split of a split grid (past its sequence's keys: short sequences under even splits
    // of p.sk, and balanced splits): only LSE = -inf for the combine, which then never reads its
    // partial O; no tiles, no epilogue (the Q copy in flight is waited for). (Not in the windowed
    // kernels: d256 spilled 28 B on sm_80.)
    if (MASK != 2 && nsplit > 1 && t_begin >= t_end) {
        cp_async_wait<0>();
        for (int r = tid; r < rows_here; r += THREADS) {
            const int rr = r0 + r, hl = rr / sq, i = rr - hl * sq;
            p.lse_partial[(((int64_t)split * p.b + bb) * hq + kvh * p.h_ratio + hl) * p.sq + i] = -INFINITY;
        }
        return;
    }

    // Per-row pages with fixed splits: the split's first tile is known without the sequence's
    // length, so its lookup goes out beside the seqused_k read instead of after it (at b1, with
    // the tables in DRAM, one dependent DRAM round trip less in front of the first copy).
    if (paged && !kv.whole_pages && fixed_splits && t_first < (p.sk + BN - 1) / BN) kv.prefetch_rows(t_first);
    kv.template prologue<S>(t_begin, t_end);
    cp_async_wait<S - 1>();  // Q group landed
    __syncthreads();

    const uint32_t sQ_u = smem_addr(sQ);
    // ldmatrix lane offsets
    const int a_row = wm * 16 + (lane & 15);      // Q (A operand)
    const int a_chk = lane >> 4;                  // + 2*kk
    const int k_row = (lane & 7) + ((lane >> 4) << 3);  // K (B operand, non-trans) + key0
    const int k_chk = (lane >> 3) & 1;                  // + 2*kk
    const int v_row = (lane & 7) + (((lane >> 3) & 1) << 3);  // V (B operand, trans) + key0
    const int v_chk = lane >> 4;                              // + 2*j2

    const int q_row = wm * 16 + g8;  // F8: Q rows of q_frag_f8
    const QSign qsign(k_scale<F8>(p, kvh));
    uint32_t qf[Q_IN_REGS ? KT : 1][4];
    if constexpr (Q_IN_REGS) load_q_frags<D, F8>(qf, sQ, sQ_u, a_row, a_chk, q_row, t4, qsign);

    float o[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    float m_run[2] = {-INFINITY, -INFINITY};
    float l_run[2] = {0.f, 0.f};
    // F8: the head's scales, read where used (k_scale)
    const float sl2 = fc::score_unit_log2(F8 ? p.scale_log2 * k_mag<F8>(p, kvh) : p.scale_log2, p.softcap);

    // ---- main loop over this split's tiles
    for (int t = t_begin; t < t_end; ++t) {
        const int it = t - t_begin;
        // Issue the next tile BEFORE waiting for tile t, so that while this CTA stalls on tile t,
        // S tiles (not S - 1) are in flight.
        if (it > 0) __syncthreads();  // every warp is done with slot (it - 1) % S
        {
            const int tn = t + S - 1;
            if (tn < t_end) kv.load(tn, (it + S - 1) % S);
            fc::cp_async_commit<false>();
        }
        cp_async_wait<S - 1>();  // tile t landed (tiles t+1 .. t+S-1 may be pending)
        const bool tile_nan = kv.tile_barrier(it % S);  // tile t is visible to all warps
        const int slot = it % S;
        const uint32_t sK_u = F8 ? smem_addr(sKV) + slot * (2 * BN * D) : smem_addr(sKV + slot * (2 * BN * D));
        const uint32_t sV_u = sK_u + BN * D * KB;
        const bool need_mask = (t * BN < lo_all) || ((t + 1) * BN > hi_all);

        if constexpr (F8) {
            // the tile's 16-key steps; KEEP_NAN: widening that keeps NaN bytes NaN
            auto steps = [&](auto nan_c) {
                constexpr bool KEEP_NAN = decltype(nan_c)::value;
                for (int c = 0; c < kpw; c += 16) {
                    const int key0 = wn * kpw + c;  // within tile
                    float s[2][4];
                    qk_step_f8<T, D, Q_IN_REGS, KEEP_NAN>(s, qf, reinterpret_cast<const unsigned char*>(sQ), q_row, t4,
                                                          qsign, sK_u, key0 + k_row, k_chk);
                    modify_scores<F8, BN>(s, p, t, key0, t4, r0, wm, g8, rows_total, sq, sk, bb, kvh);
                    if (need_mask) mask_step(s, t * BN + key0 + 2 * t4, row_lo, row_hi);
                    softmax_step<NT>(s, o, m_run, l_run, sl2);
                    pv_step_f8<T, D, KEEP_NAN>(o, s, sV_u, key0 + v_row, v_chk);
                }
            };
            if (tile_nan) {
                steps(std::true_type{});
            } else {
                steps(std::false_type{});
            }
        } else {
            for (int c = 0; c < kpw; c += 16) {
                const int key0 = wn * kpw + c;  // within tile
                float s[2][4];
                qk_step<T, D, Q_IN_REGS>(s, qf, sQ_u, a_row, a_chk, sK_u, key0 + k_row, k_chk);
                modify_scores<F8, BN>(s, p, t, key0, t4, r0, wm, g8, rows_total, sq, sk, bb, kvh);
                if (need_mask) mask_step(s, t * BN + key0 + 2 * t4, row_lo, row_hi);
                // online softmax (two rows per thread: h = 0 -> row g8, h = 1 -> row g8 + 8)
                softmax_step<NT>(s, o, m_run, l_run, sl2);
                pv_step<T, D>(o, s, sV_u, key0 + v_row, v_chk);
            }
        }
    }

    // ---- epilogue: merge the warps' partial softmax states through smem
    split_epilogue<T, D, W, F8>(p, o, m_run, l_run, sl2, rows_here, r0, sq, bb, kvh, split, sr.q0, vdch, hq,
                                nsplit, tid, warp, g8, t4);
}

// ---------------------------------------------------------------- combine kernel
// One CTA (256 threads) per output row (b, h, i). Thread = (16-byte column chunk c, split group gi):
// group gi folds splits gi, gi + G, ... (8 loads in flight per thread) with its own running max;
// the G groups are merged through shared memory. Splits with lse_partial = -inf are skipped (their
// o_partial is never multiplied in; an empty split writes none).
template <typename T, int D>
__device__ __forceinline__ void combine_kernel(const FcParams& p) {
    static_assert(D % 64 == 0, "HEAD_DIM must be a multiple of 64");
    constexpr int THREADS = 256;
    constexpr int CH = D / 4;          // float4 chunks per row
    constexpr int G = THREADS / CH;    // split groups
    constexpr int U = 8;               // loads in flight per thread
    static_assert(THREADS % CH == 0, "combine layout");
    __shared__ float4 s_acc[G][CH];
    __shared__ float s_m[G], s_l[G];

    const int tid = threadIdx.x, c = tid % CH, gi = tid / CH;
    const int64_t rows = (int64_t)p.b * p.hq * p.sq;
    const int64_t row = blockIdx.x;
    const int sq = p.sq, hq = p.hq;
    const int i = (int)(row % sq);
    const int h = (int)((row / sq) % hq);
    const int bb = (int)(row / ((int64_t)sq * hq));
    // The tables are inputs, read before the wait (in the split grid's shadow). p.combine_checks:
    // this grid gives fc_check_seqlens's verdict (the host then launches none): NaN in the whole
    // output when the prefix sums lie (block 0 fills every element of the contiguous O and LSE,
    // rows no block owns included), in this sequence's rows when its length or pages lie.
    const fc::SeqRange sr = fc::seq_range(p, bb);
    bool lie = false;
    if (p.combine_checks != 0) {
        const bool all = __syncthreads_or(fc::prefix_sums_lie(p));
        lie = all || (i < sr.sq && __syncthreads_or(fc::pages_lie(p, bb)));  // block-uniform
        if (all && blockIdx.x == 0) {
            fc::pdl_wait();
            const int64_t n_rows = p.cu_seqlens_q != nullptr ? (int64_t)p.total_q : (int64_t)p.b * p.sq;
            uint16_t* o16 = static_cast<uint16_t*>(p.o);
            for (int64_t x = tid; x < n_rows * p.hq * p.dv; x += THREADS) o16[x] = 0x7FFF;
            for (int64_t x = tid; x < n_rows * p.hq; x += THREADS) p.lse[x] = __int_as_float(0x7FC00000);
        }
    }
    if (i >= sr.sq) {  // past the end of a shorter sequence (varlen): no such row
        fc::pdl_launch_dependents();
        return;
    }
    fc::pdl_wait();  // no-op unless launched as a programmatic dependent of the split kernel
    fc::pdl_launch_dependents();  // the varlen / paged check kernel may start (it waits to write)
    if (lie) {
        T* od = static_cast<T*>(p.o) + (int64_t)bb * p.o_batch_stride + (int64_t)(sr.q0 + i) * p.o_row_stride +
                (int64_t)h * p.o_head_stride;
        for (int x = tid; x < p.dv; x += THREADS) reinterpret_cast<uint16_t*>(od)[x] = 0x7FFF;
        if (tid == 0) fc::lse_ptr(p, bb, h, sr.q0)[i] = __int_as_float(0x7FC00000);
        return;
    }
    const int ns = p.num_splits;
    const float* lp = p.lse_partial + row;
    // Partial rows hold p.dv columns: a thread whose chunk lies past them folds the row's last
    // chunk instead (in bounds, never stored).
    const int dv = p.dv;
    const float* op = p.o_partial + row * dv + min(c * 4, dv - 4);
    const int64_t sstride = rows * dv;

    float m = -INFINITY, l = 0.f;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s0 = gi; s0 < ns; s0 += U * G) {
        float ls[U];
        float4 x[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int s = s0 + u * G;
            if (s < ns) {
                ls[u] = lp[(int64_t)s * rows];
                x[u] = *reinterpret_cast<const float4*>(op + (int64_t)s * sstride);
            } else {
                ls[u] = -INFINITY;
                x[u] = make_float4(0.f, 0.f, 0.f, 0.f);
            }
        }
        float mb = ls[0];
#pragma unroll
        for (int u = 1; u < U; ++u) mb = fmaxf(mb, ls[u]);
        const float m_new = fmaxf(m, mb);
        const float ms = (m_new == -INFINITY) ? 0.f : m_new;
        const float a = __expf(m - ms);
        l *= a;
        acc.x *= a; acc.y *= a; acc.z *= a; acc.w *= a;
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (ls[u] != -INFINITY) {
                const float w = __expf(ls[u] - ms);
                l += w;
                acc.x = fmaf(w, x[u].x, acc.x); acc.y = fmaf(w, x[u].y, acc.y);
                acc.z = fmaf(w, x[u].z, acc.z); acc.w = fmaf(w, x[u].w, acc.w);
            }
        }
        m = m_new;
    }
    s_acc[gi][c] = acc;
    if (c == 0) { s_m[gi] = m; s_l[gi] = l; }
    __syncthreads();
    if (tid < CH) {
        float M = s_m[0];
#pragma unroll
        for (int g = 1; g < G; ++g) M = fmaxf(M, s_m[g]);
        const float Ms = (M == -INFINITY) ? 0.f : M;
        float L = 0.f;
        float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int g = 0; g < G; ++g) {
            const float f = __expf(s_m[g] - Ms);
            L = fmaf(s_l[g], f, L);
            const float4 v = s_acc[g][tid];
            o.x = fmaf(f, v.x, o.x); o.y = fmaf(f, v.y, o.y); o.z = fmaf(f, v.z, o.z); o.w = fmaf(f, v.w, o.w);
        }
        // the head's sink (if any) joins the merged row's normaliser, once per row
        const float sink = fc::sink_of(p, h);
        float lse;
        float inv;
        if (sink == -INFINITY) {
            inv = L > 0.f ? 1.f / L : 0.f;
            lse = L > 0.f ? Ms + logf(L) : -INFINITY;
        } else {
            inv = fc::finalize_sink(Ms, L, sink, lse);
        }
        T* od = static_cast<T*>(p.o) + (int64_t)bb * p.o_batch_stride + (int64_t)(sr.q0 + i) * p.o_row_stride +
                (int64_t)h * p.o_head_stride + tid * 4;
        if (tid * 4 < dv)
            *reinterpret_cast<uint2*>(od) = make_uint2(fc::Elem<T>::pack(o.x * inv, o.y * inv), fc::Elem<T>::pack(o.z * inv, o.w * inv));
        if (tid == 0) fc::lse_ptr(p, bb, h, sr.q0)[i] = lse;
    }
}

}  // namespace fc_decode

#define FC_SM80_DECODE(SYMBOL, T, HEAD_DIM, MASK_ID, BLOCK_M, BLOCK_N, WARPS, STAGES)                  \
    extern "C" __global__ void __launch_bounds__((WARPS) * 32) SYMBOL(const __grid_constant__ FcParams p) { \
        fc_decode::split_kernel<T, HEAD_DIM, MASK_ID, BLOCK_M, BLOCK_N, WARPS, STAGES>(p);                \
    }                                                                                                   \
    constexpr FcKernelFacts fc_facts_##SYMBOL{                                                          \
        fc_decode::split_smem_bytes(HEAD_DIM, BLOCK_M, BLOCK_N, STAGES), true, false, false, false, HEAD_DIM, 1};

// The same with FP8 (e4m3) K/V and T queries / output (Variant::kv = E4m3).
#define FC_SM80_DECODE_E4M3(SYMBOL, T, HEAD_DIM, MASK_ID, BLOCK_M, BLOCK_N, WARPS, STAGES)             \
    extern "C" __global__ void __launch_bounds__((WARPS) * 32) SYMBOL(const __grid_constant__ FcParams p) { \
        fc_decode::split_kernel<T, HEAD_DIM, MASK_ID, BLOCK_M, BLOCK_N, WARPS, STAGES, fc_decode::e4m3_t>(p); \
    }                                                                                                   \
    constexpr FcKernelFacts fc_facts_##SYMBOL{                                                          \
        fc_decode::split_smem_bytes(HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, 1), true, false, false, false, HEAD_DIM, 1};

#define FC_SM80_COMBINE(SYMBOL, T, HEAD_DIM)                                                \
    extern "C" __global__ void __launch_bounds__(256) SYMBOL(const __grid_constant__ FcParams p) { \
        fc_decode::combine_kernel<T, HEAD_DIM>(p);                                          \
    }

// ---------------------------------------------------------------- host heuristic
// num_splits for the split kernel (pure function; port to Rust as is).
//   block_m / block_n: the variant's BLOCK_M / BLOCK_N; sm_count: multiprocessor count.
// Model (measured on H100, docs/decisions.md#split-kv-decode): the kernel is memory-bound; a grid
// of
// about ONE CTA per SM, each streaming a long key range with its cp.async ring, beat grids sized
// to the full occupancy (2 CTAs/SM) by 2-4 % at b=1 and b=8, and extra waves cost a tail. So:
// pick the smallest split count whose wave efficiency ctas / (ceil(ctas / sm_count) * sm_count)
// is within 5 % of the best reachable, with every split >= 256 keys and at most 128 splits; no
// split when the unsplit grid already covers 80 % of the SMs.
// Examples (132 SMs, 32/8 heads, sq 1, block 64x64): b1 sk4096 -> 16, b1 sk32768 -> 16,
// b8 -> 2, b64 -> 1.
static inline int fc_decode_num_splits(int b, int hkv, int hq, int sq, int sk, int sm_count, int block_m,
                                       int block_n) {
    const int MIN_KEYS = 256, MAX_SPLITS = 128;
    const int rows = (hq / hkv) * sq;
    const long long base = (long long)b * hkv * ((rows + block_m - 1) / block_m);
    const long long slots = sm_count > 0 ? sm_count : 1;
    const int n_tiles = (sk + block_n - 1) / block_n;
    int max_splits = sk / MIN_KEYS;
    if (max_splits > MAX_SPLITS) max_splits = MAX_SPLITS;
    if (max_splits > n_tiles) max_splits = n_tiles;
    if (max_splits <= 1 || base * 5 >= slots * 4) return 1;
    double best = 0.0;
    for (int s = 1; s <= max_splits; ++s) {
        const long long ctas = base * s;
        const double eff = (double)ctas / (double)(((ctas + slots - 1) / slots) * slots);
        if (eff > best) best = eff;
    }
    int pick = 1;
    for (int s = 1; s <= max_splits; ++s) {
        const long long ctas = base * s;
        const double eff = (double)ctas / (double)(((ctas + slots - 1) / slots) * slots);
        if (eff >= 0.95 * best) { pick = s; break; }
    }
    // even tile split: drop splits that would get no tile
    const int tps = (n_tiles + pick - 1) / pick;
    return (n_tiles + tps - 1) / tps;
}
