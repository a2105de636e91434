// flashcore sm80 forward attention (FA2-class): mma.sync m16n8k16 + ldmatrix + cp.async.
// Targets sm_80 / sm_86 / sm_89 (and sm_90 as Hopper's fallback path).
//
// FC_SM80_FWD(SYMBOL, T, HEAD_DIM, MASK_ID, BLOCK_M, BLOCK_N, WARPS, STAGES) defines
//   extern "C" __global__ void __launch_bounds__(WARPS*32) SYMBOL(const __grid_constant__ FcParams p)
// (FC_SM80_FWD_PAIRS: the same with key-split warp pairs, fwd_body_pair).
//
// Launch contract:
//   grid  = (ceil(sq / BLOCK_M), hq, b), block = WARPS*32 threads,
//   dynamic shared memory = fc_sm80::fwd_smem_bytes(): (BLOCK_M + 2*STAGES*BLOCK_N) * HEAD_DIM * 2
//   bytes, plus the pairs' P tiles and row statistics for FC_SM80_FWD_PAIRS
//   (cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES) above 48 KB).
//   BLOCK_M must be a multiple of 16*WARPS; BLOCK_N a multiple of 16; HEAD_DIM in {64, 128, 256};
//   STAGES in {1, 2}: 1 = one K and one V buffer (FA2 schedule: V load overlaps Q.K^T, next K
//   load overlaps softmax and P.V); 2 = double-buffered K and V, the whole next tile loads while
//   the current one is computed (one __syncthreads per key tile).
//
// HOST-SIDE REQUIREMENTS (validate and fall back otherwise):
//   * q, k, v, o base pointers 16-byte aligned, and every batch/row/head stride of q, k, v, o a
//     multiple of 8 elements (each 16-byte chunk of a row is moved with one cp.async / st.v4).
//   * last dim contiguous; hq == hkv * h_ratio; sq, sk >= 1 (sk == 0 also works: all rows
//     empty).
//   * p.softcap > 0 caps the scores (fc::softcap_tanh, common/softmax.cuh); p.alibi_slopes adds
//     the ALiBi bias. Both run in the kernel's FWD_GEN body (the plain body has neither).
//   * Head dims p.d (q, k) and p.dv (v, o), each <= HEAD_DIM and a positive multiple of 8, equal
//     or not: Q and K columns from p.d on and V columns from p.dv on are zero-filled in shared
//     memory, O is stored for its p.dv columns only. Either below HEAD_DIM takes the FWD_GEN
//     body; a pair whose mean is at most 3/4 of HEAD_DIM (1/2 of 64) the FWD_NARROW body where
//     the tile has one (fwd_narrow), which computes only the 16-column steps of Q.K^T that hold
//     p.d and those of P.V that hold p.dv and never touches the columns past them.
//   * Sequences through fc::seq_range (common/seqlens.cuh): dense, or varlen prefix sums (the
//     grid's m blocks cover p.sq = max_seqlen_q; blocks past a shorter sequence exit).
//     Split-KV fields are ignored (this kernel writes O and LSE directly).
// MASK_ID: 0 none, 1 causal (bottom-right), 2 local window (runtime p.window_left/right,
// negative = unbounded; bottom-right aligned like causal).
// Output: O (b, sq, hq, dv) in T via p.o strides, LSE (b, hq, sq) f32 natural log; rows that see
// no key get O = 0 and LSE = -inf (the head's sink with p.sinks). Every element of rows < sq is
// written exactly once. p.sinks changes only the epilogue (fc::finalize_sink).
#pragma once
#include <stdint.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include "common/params.h"
#include "common/ptx.cuh"
#include "common/mask.cuh"
#include "common/variants.cuh"
#include "common/softmax.cuh"
#include "common/smem.cuh"
#include "common/seqlens.cuh"

namespace fc_sm80 {

// (the shared PTX helpers and dtype traits: common/ptx.cuh)
using fc::cp_async_commit;
using fc::cp_async_wait_all;
using fc::cp_async16;
using fc::Elem;
using fc::launder32;
using fc::ldsm_x4;
using fc::ldsm_x4_trans;
using fc::smem_addr;
using fc::tid_remat;

// Narrow head dims (the FWD_NARROW body, fwd_narrow): Q.K^T runs only the k16 steps that
// hold columns below p.d, and P.V only the 16-column pairs of O below p.dv, so a d96 head on the
// d128 kernel does 3/4 of its MMAs, a d32 head on the d64 kernel half, and (192, 128) on the
// d256 kernel 12 of 16 steps of Q.K^T and 8 of 16 of P.V. The first
// narrow_min_ksteps<D>() steps of each always run (no branch; a head narrower than them computes
// zero-filled columns there); every later step is one warp-uniform branch. Other bodies run all
// D / 16 steps.
template <int D>
__host__ __device__ constexpr int narrow_min_ksteps() {
    return D >= 128 ? D / 32 : 1;
}
// k16 steps of Q.K^T (for dch = p.d / 8) or 16-column pairs of O (for dch = p.dv / 8) a narrow
// body computes when a row holds dch 16-byte chunks.
template <int D>
__device__ __forceinline__ int narrow_ksteps(int dch) {
    return max((dch + 1) >> 1, narrow_min_ksteps<D>());
}

// Async copy of a [NROWS][D] tile starting at global row pointer g (row stride in elements);
// rows >= valid are zero-filled. ONE_REM: test rows against one remainder register (valid - r0)
// instead of a row index per pass: for kernels whose key loop has no registers to spare (the
// warp pairs); on the d64 128x64 tile it measured 1.4-2.7 % slower
// (decisions.md#sm80-d256-warp-pairs).
// Columns from dch 16-byte chunks on (a head dim below D) are zero-filled up to chunk dz (the
// end of the last 16-column k-step a narrow body computes); chunks from dz on are not written.
template <int NROWS, int D, int NTHREADS, bool ONE_REM = false, typename T>
__device__ __forceinline__ void load_tile(uint32_t s, const T* __restrict__ g, int64_t stride,
                                          int valid, int tid, int dch = D / 8,
                                          int dz = D / 8) {
    constexpr int CH = D / 8;
    constexpr int TOTAL = NROWS * CH;
    static_assert(NTHREADS % CH == 0, "threads must cover whole rows");
    constexpr int ROWS_PER_PASS = NTHREADS / CH;
    const int ch = tid % CH;
    const int r0 = tid / CH;
    // Launder the stride so the compiler recomputes pass addresses by increments instead of
    // hoisting one 64-bit pointer per pass out of the key loop (costs ~2 registers per pass).
    int64_t step;
    asm volatile("mov.b64 %0, %1;" : "=l"(step) : "l"((int64_t)ROWS_PER_PASS * stride));
    const T* src = g + (int64_t)r0 * stride + ch * 8;
    uint32_t dst = s + fc::swz_bytes<D>(r0, ch);
    // ONE_REM: row r0 + i * ROWS_PER_PASS is valid when i * ROWS_PER_PASS < rem, one live
    // register and compares against immediates (a row index per pass kept 16 registers live
    // across the key loop of the 128-key pair tile).
    const int rem = valid - r0;
#pragma unroll
    for (int i = 0; i < (TOTAL + NTHREADS - 1) / NTHREADS; ++i) {
        const int r = r0 + i * ROWS_PER_PASS;
        if (TOTAL % NTHREADS == 0 || r < NROWS) {
            const bool ok = (ONE_REM ? i * ROWS_PER_PASS < rem : r < valid) && ch < dch;
            // (r & 7) changes between passes only when ROWS_PER_PASS % 8 != 0
            const uint32_t d = (ROWS_PER_PASS % 8 == 0) ? dst + i * ROWS_PER_PASS * (D * 2)
                                                        : s + fc::swz_bytes<D>(r, ch);
            if (ch < dz) cp_async16(d, ok ? (const void*)src : (const void*)g, ok ? 16 : 0);
        }
        src += step;
    }
}

// Tuning options of fwd_body (OPT bit mask). Every option computes the same result.
//   FWD_LAZY: lazy O rescale (fc::lazy_rescale, common/softmax.cuh). A row keeps its running
//     max unless the tile's max exceeds it by more than 2^8 (exp2 units); the 128 FMULs per key
//     tile that rescale O run only when some row of the warp raised its max (warp-uniform
//     branch). l, O and LSE all use the same (possibly stale) max, so the result is unchanged.
//   (A software-pipelined schedule, next tile's Q.K^T beside the current softmax, was tried and
//   dropped: it needs a second S tile, spills at 255 registers and measured 0-4% slower in the
//   dev harness; docs/decisions.md#sm80-tiles.)
//   FWD_XADDR: swizzled ldmatrix addresses as lane_base ^ (j << 5) (+ immediates) instead of four
//     precomputed chunk offsets per operand, recomputed per tile from one laundered register:
//     ~9 fewer registers live across the key loop, +1 LOP3 per ldmatrix address.
//   FWD_PAIR: key-split warp pairs (fwd_body_pair below; STAGES 1): two warps share 2x the rows
//     and split the keys of S and the columns of O; needs fwd_smem_bytes() of dynamic smem.
//   FWD_LEAN: fewer registers live across the key loop, for tiles at the 255-register limit
//     (d128 128x48 on sm_80/86/89): K/V tile pointers and the thread index recomputed from %ctaid / %tid where
//     they are used, one remainder register for load_tile's row test (STAGES 2). Costs 2-5 %
// on the H100 (decisions.md#sm80-tiles), so it is used only where the tile would spill without it.
//   FWD_GEN: the general body: softcap (p.softcap > 0), ALiBi (p.alibi_slopes), packed
//     variable-length batches (p.cu_seqlens_q/k, fc::seq_range) and head dims below D (p.d or
//     p.dv < D: zero-filled columns), each behind a runtime test. Kernels hold the plain body
//     (dense, d = dv = D, no score modifier: its SASS is that of the kernel before FWD_GEN) and
//     the general one and pick one per launch (fwd_has_cap_body): a runtime branch per key tile
//     inside one body cost the sm80 forward 1 % without softcap (H100, sm_90 SASS), and the
//     sequence ranges in registers made the d128 128x48 tile spill 32 B on sm_90
//     (decisions.md#softcap-and-alibi-bodies).
//   FWD_NARROW (with FWD_GEN): the general body for heads at most 3/4 of D wide, 1/2 of the d64
//     kernel's (fwd_narrow): Q.K^T skips the 16-column steps past p.d, P.V those past p.dv
//     (narrow_ksteps). A third body, not a runtime bound inside the general one: there the
//     per-step branches cost full-width varlen d128 12 % and softcap d128 5 % (H100, sm_90
//     SASS), and predicating the tail steps instead cost every general launch 25-40 %
//     (decisions.md#sm80-narrow-bodies). The third body adds ~17 % to the sm80 family's compile
//     time (127 -> 148 CPU-s here).
enum { FWD_LAZY = 1, FWD_XADDR = 4, FWD_PAIR = 8, FWD_LEAN = 16, FWD_GEN = 32, FWD_NARROW = 64 };

// Address of 16-byte chunk group j (0..3) for a lane: XA: base already holds the lane's swizzled
// chunk 0 and a 128-byte aligned row address, so ((c ^ sw) << 4) == base_bits ^ (j << 5).
template <bool XA>
__device__ __forceinline__ uint32_t lane_addr(uint32_t base, const uint32_t (&off)[4], int j) {
    return XA ? (base ^ (uint32_t)(j << 5)) : base + off[j];
}

// S = Q K^T for one key tile (Q fragments re-read from shared memory per k-step).
// KU: unroll factor of the k16 loop (KD = full; smaller bounds how far ptxas hoists the next
// steps' ldmatrix loads, i.e. the registers they hold).
// NARROW: a narrow body (kd = narrow_ksteps k16 steps hold p.d's columns): the steps from
// narrow_min_ksteps<D>() on run while kk < kd.
template <typename T, int D, int MT, int NS, bool XA = false, int KU = D / 16, bool NARROW = false>
__device__ __forceinline__ void qk_tile(float (&s)[MT][NS][4], uint32_t q_lane,
                                        const uint32_t (&q_off)[4], uint32_t k_base,
                                        const uint32_t (&k_off)[4], int kd = D / 16) {
    constexpr int KD = D / 16;
    if (XA) {
        q_lane = launder32(q_lane);
        k_base = launder32(k_base);
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < NS; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[mt][j][e] = 0.f;
#pragma unroll KU
    for (int kk = 0; kk < KD; ++kk) {
        // a narrow body's tail steps: one warp-uniform branch each
        if (NARROW && kk >= narrow_min_ksteps<D>() && kk >= kd) break;
        uint32_t a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
            ldsm_x4(a[mt], lane_addr<XA>(q_lane, q_off, kk & 3) + (mt * 16 * (D * 2) + (kk >> 2) * 128));
#pragma unroll
        for (int np = 0; np < NS / 2; ++np) {
            uint32_t b[4];
            ldsm_x4(b, lane_addr<XA>(k_base, k_off, kk & 3) + (np * 16 * (D * 2) + (kk >> 2) * 128));
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                Elem<T>::mma(s[mt][2 * np], a[mt], b[0], b[1]);
                Elem<T>::mma(s[mt][2 * np + 1], a[mt], b[2], b[3]);
            }
        }
    }
}

// S = Q K^T for one key tile with Q's fragments held in registers (qr, all KD k16 steps; loaded
// at the first tile); k_row: the K tile's base plus the lane's row (the swizzled chunk from
// k_off). NARROW as qk_tile.
template <typename T, int D, int MT, int NS, bool NARROW>
__device__ __forceinline__ void qk_tile_qregs(float (&s)[MT][NS][4], const uint32_t (&qr)[MT][D / 16][4],
                                              uint32_t k_row, const uint32_t (&k_off)[4], int kd) {
    constexpr int KD = D / 16;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < NS; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[mt][j][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KD; ++kk) {
        if (NARROW && kk >= narrow_min_ksteps<D>() && kk >= kd) break;  // (qk_tile)
#pragma unroll
        for (int np = 0; np < NS / 2; ++np) {
            uint32_t b[4];
            ldsm_x4(b, k_row + k_off[kk & 3] + (np * 16 * (D * 2) + (kk >> 2) * 128));
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                Elem<T>::mma(s[mt][2 * np], qr[mt][kk], b[0], b[1]);
                Elem<T>::mma(s[mt][2 * np + 1], qr[mt][kk], b[2], b[3]);
            }
        }
    }
}

// -inf outside the visible band (ragged key tail, causal diagonal, window edges).
// col_off: first key of this warp's columns inside the key tile (key-split warp pairs).
template <int MASK, int BN, int MT, int NS>
__device__ __forceinline__ void mask_tile(float (&s)[MT][NS][4], int nb, int warp_r0, int row_thr,
                                          int lane, int sq, int sk, int wl, int wr,
                                          int col_off = 0) {
    if (fc::tile_needs_mask<MASK, BN>(nb, warp_r0, warp_r0 + 16 * MT - 1, sq, sk, wl, wr)) {
        // Re-read the lane id here instead of keeping per-lane row/column terms live across the
        // key loop (register pressure).
        lane = fc::lane_remat();
        row_thr = warp_r0 + (lane >> 2);
        const int col0 = nb * BN + col_off + 2 * (lane & 3);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                int lo, hi;
                fc::band_limits<MASK>(row_thr + mt * 16 + hf * 8, sq, sk, wl, wr, lo, hi);
#pragma unroll
                for (int j = 0; j < NS; ++j)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int col = col0 + j * 8 + e;
                        fc::mask_score(s[mt][j][2 * hf + e], col, lo, hi);
                    }
            }
    }
}

// Softcap (CAP: the FWD_GEN body): S becomes tanh(S * pre), pre = scale / softcap (the kept
// scores' unit is then softcap: fc::score_unit), before the mask.
template <bool CAP, int MT, int NS>
__device__ __forceinline__ void softcap_tile(float (&s)[MT][NS][4], const FcParams& p) {
    if (CAP && p.softcap > 0.f) {
        const fc::Softcap cap(p.scale, p.softcap);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int j = 0; j < NS; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[mt][j][e] = cap(s[mt][j][e]);
    }
}

// ALiBi (the FWD_GEN body, p.alibi_slopes set): S -= slope_u * |col - (row + sk - sq)|, slope_u
// the slope in the kept scores' unit (fc::alibi_slope_units), floored (fc::alibi_apply), before
// the mask.
template <bool CAP, int BN, int MT, int NS>
__device__ __forceinline__ void alibi_tile(float (&s)[MT][NS][4], const FcParams& p, float slope_u,
                                           int nb, int warp_r0, int sq, int sk, int col_off = 0) {
    if (CAP && p.alibi_slopes != nullptr) {
        const int lane = fc::lane_remat();
        const int col0 = nb * BN + col_off + 2 * (lane & 3);
        const fc::Alibi alibi(slope_u, fc::alibi_floor(p));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int diag = warp_r0 + (lane >> 2) + mt * 16 + hf * 8 + sk - sq;
#pragma unroll
                for (int j = 0; j < NS; ++j)
#pragma unroll
                    for (int e = 0; e < 2; ++e)
                        s[mt][j][2 * hf + e] = alibi(s[mt][j][2 * hf + e], col0 + j * 8 + e, diag);
            }
    }
}

// Max of row half `hf` (accumulator elements 2*hf, 2*hf+1) of one m16 tile of S and `init`,
// across the quad of lanes that holds the row.
template <int NS>
__device__ __forceinline__ float row_max(const float (&s)[NS][4], int hf, float init) {
    float mx = init;
#pragma unroll
    for (int j = 0; j < NS; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * hf], s[j][2 * hf + 1]));
    return fc::quad_max(mx);
}
// Row half `hf` of S becomes P = exp2(s * sl2 - msc); returns this lane's part of the row sum.
template <int NS>
__device__ __forceinline__ float exp_row(float (&s)[NS][4], int hf, float sl2, float msc) {
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < NS; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const float pv = fc::exp2_approx(fmaf(s[j][2 * hf + e], sl2, -msc));
            s[j][2 * hf + e] = pv;
            sum += pv;
        }
    return sum;
}

// Row half `hf` (accumulator elements 2*hf, 2*hf+1) of m16 tile `mt` of O times f.
template <int MT, int ND>
__device__ __forceinline__ void scale_o_half(float (&o)[MT][ND][4], int mt, int hf, float f) {
#pragma unroll
    for (int j = 0; j < ND; ++j) {
        o[mt][j][2 * hf] *= f;
        o[mt][j][2 * hf + 1] *= f;
    }
}

// Online softmax of one S tile: s becomes P (unnormalised, f32), O and l are rescaled.
template <bool LAZY, int MT, int NS, int ND>
__device__ __forceinline__ void softmax_tile(float (&s)[MT][NS][4], float (&o)[MT][ND][4],
                                             float (&row_m)[MT][2], float (&row_l)[MT][2],
                                             float sl2) {
    if (!LAZY) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const float mx = row_max(s[mt], hf, row_m[mt][hf]);
                float msc;
                const float alpha = fc::online_rescale(row_m[mt][hf], mx, sl2, msc);
                row_m[mt][hf] = mx;
                const float sum = exp_row(s[mt], hf, sl2, msc);
                row_l[mt][hf] = row_l[mt][hf] * alpha + sum;
                scale_o_half(o, mt, hf, alpha);
            }
    } else {
        float alpha[MT][2];
        bool up_any = false;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const float mx = row_max(s[mt], hf, row_m[mt][hf]);
                float msc;
                alpha[mt][hf] = fc::lazy_rescale(row_m[mt][hf], mx, sl2, msc);
                up_any |= alpha[mt][hf] != 1.f;
                const float sum = exp_row(s[mt], hf, sl2, msc);
                row_l[mt][hf] = fmaf(row_l[mt][hf], alpha[mt][hf], sum);
            }
        if (__any_sync(0xffffffffu, up_any)) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int j = 0; j < ND; ++j) {
                    o[mt][j][0] *= alpha[mt][0];
                    o[mt][j][1] *= alpha[mt][0];
                    o[mt][j][2] *= alpha[mt][1];
                    o[mt][j][3] *= alpha[mt][1];
                }
        }
    }
}

// P of k16 step kk as mma A fragments, straight from the S accumulators (C layout == A layout).
template <typename T, int MT, int NS>
__device__ __forceinline__ void pack_p(const float (&s)[MT][NS][4], int kk, uint32_t (&pa)[MT][4]) {
    using E = Elem<T>;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        pa[mt][0] = E::pack(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        pa[mt][1] = E::pack(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        pa[mt][2] = E::pack(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        pa[mt][3] = E::pack(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
    }
}

// O += P[:, key0 .. key0+15] V[key0 .. key0+15, :] for the ND n8 columns at v_base.
// DMIN < ND / 2: a narrow body; the 16-column pairs from DMIN on run while dp < ndp.
template <typename T, int D, int MT, int ND, bool XA = false, int DMIN = ND / 2>
__device__ __forceinline__ void pv_k16(float (&o)[MT][ND][4], const uint32_t (&pa)[MT][4],
                                       uint32_t v_base, const uint32_t (&v_off)[4], int key0,
                                       int ndp = ND / 2) {
#pragma unroll
    for (int dp = 0; dp < ND / 2; ++dp) {
        if (dp >= DMIN && dp >= ndp) break;  // a narrow body's tail pairs
        uint32_t b[4];
        ldsm_x4_trans(b, lane_addr<XA>(v_base, v_off, dp & 3) + (key0 * (D * 2) + (dp >> 2) * 128));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            Elem<T>::mma(o[mt][2 * dp], pa[mt], b[0], b[1]);
            Elem<T>::mma(o[mt][2 * dp + 1], pa[mt], b[2], b[3]);
        }
    }
}

// O += P V, P straight from the S accumulators.
template <typename T, int D, int MT, int NS, int ND, bool XA = false, bool NARROW = false>
__device__ __forceinline__ void pv_tile(const float (&s)[MT][NS][4], float (&o)[MT][ND][4],
                                        uint32_t v_base, const uint32_t (&v_off)[4],
                                        int ndp = ND / 2) {
    if (XA) v_base = launder32(v_base);
#pragma unroll
    for (int kk = 0; kk < NS / 2; ++kk) {
        uint32_t pa[MT][4];
        pack_p<T>(s, kk, pa);
        pv_k16<T, D, MT, ND, XA, NARROW ? narrow_min_ksteps<D>() : ND / 2>(o, pa, v_base, v_off,
                                                                           kk * 16, ndp);
    }
}

// Epilogue of both forward bodies: this warp's normalised O (its 16*MT rows from warp_row, ND
// 16-byte column chunks from chunk0) packed to T in a swizzled [rows][D] smem tile whose rows no
// other warp (or only the warp's pair partner, on other columns) reads any more, then 16-byte
// coalesced global stores of the rows < rows_valid.
template <typename T, int D, int MT, int ND>
__device__ __forceinline__ void store_o(unsigned char* smem_o, const float (&o)[MT][ND][4],
                                        int warp_row, int lane, int chunk0, T* og,
                                        int64_t row_stride, int rows_valid, int dch = D / 8) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int r = warp_row + mt * 16 + hf * 8 + (lane >> 2);
#pragma unroll
            for (int j = 0; j < ND; ++j)
                *reinterpret_cast<uint32_t*>(smem_o + fc::swz_bytes<D>(r, chunk0 + j) + 4 * (lane & 3)) =
                    Elem<T>::pack(o[mt][j][2 * hf], o[mt][j][2 * hf + 1]);
        }
    __syncwarp();
#pragma unroll
    for (int i = 0; i < 16 * MT * ND / 32; ++i) {
        const int c = lane + 32 * i;
        const int r = warp_row + c / ND, ch = chunk0 + c % ND;
        if (r < rows_valid && ch < dch) {
            const uint4 val = *reinterpret_cast<const uint4*>(smem_o + fc::swz_bytes<D>(r, ch));
            *reinterpret_cast<uint4*>(og + (int64_t)r * row_stride + ch * 8) = val;
        }
    }
}

// One CTA's query block: grid decoding, global pointers and the visible key-tile range.
// GEN: the sequence's range from fc::seq_range (else dense: p.sq, p.sk, rows from 0).
template <typename T, int MASK, int BM, int BN, bool GEN>
struct FwdTile {
    int m0, rows_valid, n_min, n_max;
    int sq, sk;  // this sequence's query rows and keys (fc::seq_range)
    int h, bz;
    const T* qg;
    const T* kg;
    const T* vg;
    T* og;
    float* lseg;
    __device__ __forceinline__ explicit FwdTile(const FcParams& p) {
        // Grid (m_blocks, hq, b) without a mask. Causal/local: grid (hq, m_blocks, b), heaviest
        // query blocks first across every head (blocks are issued x-fastest), so the last wave
        // holds the lightest tiles.
        const int m_block = MASK != 0 ? (int)(gridDim.y - 1 - blockIdx.y) : (int)blockIdx.x;
        h = MASK != 0 ? (int)blockIdx.x : (int)blockIdx.y;
        bz = blockIdx.z;
        const int hk = h / p.h_ratio;
        const fc::SeqRange sr = GEN ? fc::seq_range(p, bz) : fc::SeqRange{0, p.sq, 0, p.sk};
        sq = sr.sq;
        sk = sr.sk;
        m0 = m_block * BM;
        rows_valid = min(BM, sq - m0);  // <= 0: the sequence is shorter (varlen), nothing to do
        qg = reinterpret_cast<const T*>(p.q) + bz * p.q_batch_stride + h * p.q_head_stride +
             (int64_t)(sr.q0 + m0) * p.q_row_stride;
        kg = reinterpret_cast<const T*>(p.k) + bz * p.k_batch_stride + hk * p.k_head_stride +
             (int64_t)sr.k0 * p.k_row_stride;
        vg = reinterpret_cast<const T*>(p.v) + bz * p.v_batch_stride + hk * p.v_head_stride +
             (int64_t)sr.k0 * p.v_row_stride;
        og = reinterpret_cast<T*>(p.o) + bz * p.o_batch_stride + h * p.o_head_stride +
             (int64_t)(sr.q0 + m0) * p.o_row_stride;
        lseg = fc::lse_ptr(p, bz, h, sr.q0 + m0);
        fc::key_tile_range<MASK, BN>(m0, m0 + rows_valid - 1, sq, sk, p.window_left,
                                     p.window_right, n_min, n_max);
    }
    // K or V rows of key tile nb, recomputed from %ctaid and the parameters at each use: the
    // volatile reads keep the compiler from holding the pointers (and what load_tile derives
    // from them) in registers across the key loop (used where the loop has none to spare).
    __device__ __forceinline__ static void ctaid_remat(int& m_block, int& h, int& bz) {
        uint32_t x, y, z;
        asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(x));
        asm volatile("mov.u32 %0, %%ctaid.y;" : "=r"(y));
        asm volatile("mov.u32 %0, %%ctaid.z;" : "=r"(z));
        m_block = MASK != 0 ? (int)(gridDim.y - 1 - y) : (int)x;
        h = (int)(MASK != 0 ? x : y);
        bz = (int)z;
    }
    // (The sequence's first key row is re-read too: varlen only, 0 when dense.)
    __device__ __forceinline__ static const T* kv_tile_remat(const FcParams& p, const void* base,
                                                             int64_t batch_stride,
                                                             int64_t head_stride, int64_t row_stride,
                                                             int h_ratio, int nb) {
        int m_block, h, bz;
        ctaid_remat(m_block, h, bz);
        const int k0 = GEN && p.cu_seqlens_k != nullptr ? fc::seq_range(p, bz).k0 : 0;
        return reinterpret_cast<const T*>(base) + bz * batch_stride + (h / h_ratio) * head_stride +
               (int64_t)(k0 + nb * BN) * row_stride;
    }
    // The ALiBi slope (in score units) the same way.
    __device__ __forceinline__ static float slope_remat(const FcParams& p) {
        int m_block, h, bz;
        ctaid_remat(m_block, h, bz);
        return fc::alibi_slope_units(p, bz, h);
    }
    // The head's sink (fc::sink_of; -inf without sinks) the same way.
    __device__ __forceinline__ static float sink_remat(const FcParams& p) {
        if (p.sinks == nullptr) return FC_NEG_INF;
        int m_block, h, bz;
        ctaid_remat(m_block, h, bz);
        return fc::sink_of(p, h);
    }
    // og and lseg the same way (for an epilogue after a loop with no registers to spare).
    __device__ __forceinline__ static void out_remat(const FcParams& p, T*& og, float*& lseg) {
        int m_block, h, bz;
        ctaid_remat(m_block, h, bz);
        const int m0 = m_block * BM + (GEN && p.cu_seqlens_q != nullptr ? fc::seq_range(p, bz).q0 : 0);
        og = reinterpret_cast<T*>(p.o) + bz * p.o_batch_stride + h * p.o_head_stride +
             (int64_t)m0 * p.o_row_stride;
        lseg = fc::lse_ptr(p, bz, h, m0);
    }
    // No row of this block sees any key: O = 0, LSE = -inf (the head's sink with sinks).
    template <int D, int NTH>
    __device__ __forceinline__ void write_empty(const FcParams& p, int tid) const {
        const int CH = GEN ? p.dv / 8 : D / 8;  // O's chunks
        for (int c = tid; c < rows_valid * CH; c += NTH) {
            const int r = c / CH, ch = c % CH;
            *reinterpret_cast<uint4*>(og + (int64_t)r * p.o_row_stride + ch * 8) =
                make_uint4(0, 0, 0, 0);
        }
        const float sink = fc::sink_of(p, h);
        for (int r = tid; r < rows_valid; r += NTH) lseg[r] = sink;
    }
};

// Epilogue of fwd_body: normalise this warp's rows (the head's sink joins the normaliser when
// there is one), write their LSE, stage O through the warp's own Q rows (only this warp ever read
// them), then 16-byte coalesced stores. LEAN: og / lseg recomputed from %ctaid (FwdTile::out_remat).
template <typename T, int D, int MASK, int BM, int BN, bool GEN, bool LEAN, int MT, int ND>
__device__ __forceinline__ void fwd_epilogue(const FcParams& p, float (&o)[MT][ND][4], const float (&row_m)[MT][2],
                                             const float (&row_l)[MT][2], int warp_row, int lane,
                                             int rows_valid, T* og, float* lseg) {
    extern __shared__ __align__(128) unsigned char fc_sm80_fwd_smem[];
    T* o_out = og;
    float* lse_out = lseg;
    if constexpr (LEAN) FwdTile<T, MASK, BM, BN, GEN>::out_remat(p, o_out, lse_out);
    const float scale = GEN ? fc::score_unit(p.scale, p.softcap) : p.scale;
    // The head's sink joins the normaliser here; the check is unswitched so that the plain
    // epilogue compiles as it did without sinks (one join per row pushed d256 into spills).
    auto finish = [&](auto with_sink) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const float l = fc::quad_sum(row_l[mt][hf]);
                float lse;
                // (the sink is read again per row: holding it beside O spilled at d256)
                const float inv =
                    decltype(with_sink)::value
                        ? fc::finalize_sink(row_m[mt][hf] * scale, l,
                                            FwdTile<T, MASK, BM, BN, GEN>::sink_remat(p), lse)
                        : fc::finalize_row(row_m[mt][hf], l, scale, lse);
                scale_o_half(o, mt, hf, inv);
                const int r = warp_row + mt * 16 + hf * 8 + (lane >> 2);
                if ((lane & 3) == 0 && r < rows_valid) lse_out[r] = lse;
            }
    };
    if (FwdTile<T, MASK, BM, BN, GEN>::sink_remat(p) == FC_NEG_INF)
        finish(fc::Flag<false>{});
    else
        finish(fc::Flag<true>{});
    __syncwarp();
    store_o<T, D>(fc_sm80_fwd_smem, o, warp_row, lane, 0, o_out, p.o_row_stride, rows_valid,
                  GEN ? p.dv / 8 : D / 8);
}

template <typename T, int D, int MASK, int BM, int BN, int WARPS, int STAGES, int OPT = 0>
__device__ __forceinline__ void fwd_body(const FcParams& p) {
    static_assert(D == 64 || D == 128 || D == 256, "HEAD_DIM must be 64, 128 or 256");
    // (p.d, p.dv <= D: Q/K columns from p.d on and V columns from p.dv on are zero in shared
    // memory; O columns from p.dv on are never stored)
    static_assert(BM % (16 * WARPS) == 0, "BLOCK_M must be a multiple of 16*WARPS");
    static_assert(BN % 16 == 0, "BLOCK_N must be a multiple of 16");
    static_assert(STAGES == 1 || STAGES == 2, "STAGES must be 1 or 2");
    constexpr int NTH = WARPS * 32;
    constexpr int MT = BM / (16 * WARPS);  // m16 tiles per warp
    constexpr int NS = BN / 8;             // n8 tiles of S per m16 tile
    constexpr int KD = D / 16;             // k16 steps of Q.K^T
    constexpr int ND = D / 8;              // n8 tiles of O
    // Keep Q in registers when the live accumulators leave room for it.
    constexpr bool Q_IN_REGS = (MT * KD * 4 + MT * ND * 4 + MT * NS * 4) <= 176;
    constexpr int QREG_MT = Q_IN_REGS ? MT : 1;
    constexpr int QREG_KD = Q_IN_REGS ? KD : 1;
    constexpr bool LEAN = (OPT & FWD_LEAN) != 0;
    constexpr bool GEN = (OPT & FWD_GEN) != 0;
    using E = Elem<T>;

    extern __shared__ __align__(128) unsigned char fc_sm80_fwd_smem[];
    const uint32_t sQ = smem_addr(fc_sm80_fwd_smem);
    const uint32_t sK = sQ + BM * D * 2;
    const uint32_t sV = sK + STAGES * BN * D * 2;

    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const FwdTile<T, MASK, BM, BN, GEN> t(p);
    if (t.rows_valid <= 0) return;  // past the end of a shorter sequence (varlen)
    if (t.n_max <= t.n_min) {
        t.template write_empty<D, NTH>(p, tid);
        return;
    }
    const int sq = t.sq, sk = t.sk;
    const int dch = GEN ? p.d / 8 : D / 8;    // 16-byte chunks of a Q / K row
    const int vch = GEN ? p.dv / 8 : D / 8;   // of a V / O row
    // k16 steps of Q.K^T (kd) and 16-column pairs of O (kdv) (narrow_ksteps), and the 16-byte
    // chunks of a Q / K row (dz) and a V row (vdz) written to shared memory (FWD_NARROW; all of
    // them otherwise).
    constexpr bool NARROW = GEN && (OPT & FWD_NARROW) != 0;
    const int kd = NARROW ? narrow_ksteps<D>(dch) : KD;
    const int kdv = NARROW ? narrow_ksteps<D>(vch) : KD;
    const int dz = 2 * kd, vdz = 2 * kdv;
    const int m0 = t.m0, rows_valid = t.rows_valid, n_min = t.n_min, n_max = t.n_max;
    const int wl = p.window_left, wr = p.window_right;
    const T* __restrict__ qg = t.qg;
    const T* __restrict__ kg = t.kg;
    const T* __restrict__ vg = t.vg;
    T* __restrict__ og = t.og;
    float* __restrict__ lseg = t.lseg;

    // Prologue: Q and the first (highest) key tile.
    load_tile<BM, D, NTH>(sQ, qg, p.q_row_stride, rows_valid, tid, dch, dz);
    const int nb = n_max - 1;
    const int kv_valid = sk - nb * BN;
    load_tile<BN, D, NTH>(sK, kg + (int64_t)nb * BN * p.k_row_stride, p.k_row_stride, kv_valid,
                          tid, dch, dz);
    if (STAGES == 2)
        load_tile<BN, D, NTH>(sV, vg + (int64_t)nb * BN * p.v_row_stride, p.v_row_stride,
                              kv_valid, tid, vch, vdz);
    cp_async_commit();

    // Per-lane ldmatrix geometry. Every tile row offset used below is a multiple of 8, so the
    // swizzle term of a lane is always (lane & 7).
    const int sw = lane & 7;
    const int warp_row = warp * 16 * MT;
    // A (Q): row = lane % 16, chunk += lane / 16
    const uint32_t q_lane = sQ + (warp_row + (lane & 15)) * (D * 2);
    const int q_chunk = lane >> 4;
    // B (K, non-trans): row = lane % 8 + (lane / 16) * 8, chunk += (lane / 8) % 2
    const uint32_t k_lane_row = ((lane & 7) + ((lane >> 4) << 3)) * (D * 2);
    const int k_chunk = (lane >> 3) & 1;
    // B (V, trans): row = lane % 8 + ((lane / 8) % 2) * 8, chunk += lane / 16
    const uint32_t v_lane_row = ((lane & 7) + (((lane >> 3) & 1) << 3)) * (D * 2);
    const int v_chunk = lane >> 4;
    // Swizzled chunk byte offsets: for chunk index 2*j + c (j = 0..3 inside a 128-byte group),
    // ((2*j + c) ^ sw) << 4; larger chunk indices add (j / 4) * 128 bytes as an immediate. Four
    // registers per operand instead of one per k-step.
    uint32_t q_off[4], k_off[4], v_off[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        q_off[j] = ((2 * j + q_chunk) ^ sw) << 4;
        k_off[j] = ((2 * j + k_chunk) ^ sw) << 4;
        v_off[j] = ((2 * j + v_chunk) ^ sw) << 4;
    }
    // XADDR: lane bases with the lane's swizzled chunk folded in (tile bases are 128-byte
    // aligned, rows are D*2 >= 128 bytes, so bits [6:4] of the row address are zero).
    constexpr bool XA = (OPT & FWD_XADDR) != 0;
    const uint32_t q_lx = XA ? q_lane + q_off[0] : q_lane;
    const uint32_t k_lx = XA ? k_lane_row + k_off[0] : k_lane_row;
    const uint32_t v_lx = XA ? v_lane_row + v_off[0] : v_lane_row;

    uint32_t qr[QREG_MT][QREG_KD][4];
    float o[MT][ND][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < ND; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[mt][j][e] = 0.f;
    float row_m[MT][2], row_l[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            row_m[mt][hf] = FC_NEG_INF;
            row_l[mt][hf] = 0.f;
        }

    const float sl2 = (OPT & FWD_GEN) != 0 ? fc::score_unit_log2(p.scale_log2, p.softcap) : p.scale_log2;
    const float slope_u = (OPT & FWD_GEN) != 0 ? fc::alibi_slope_units(p, t.bz, t.h) : 0.f;
    const int row_thr = m0 + warp_row + (lane >> 2);  // + mt*16 + hf*8
    const int warp_r0 = m0 + warp_row;                // first query row of this warp

    int stage = 0;
    for (int nb = n_max - 1; nb >= n_min; --nb) {
        const uint32_t sKs = sK + stage * (BN * D * 2);
        const uint32_t sVs = sV + stage * (BN * D * 2);
        cp_async_wait_all();
        __syncthreads();
        if (STAGES == 2) {
            if (nb > n_min) {
                const int nn = nb - 1;
                const uint32_t off = (stage ^ 1) * (BN * D * 2);
                if constexpr (LEAN) {
                    using FT = FwdTile<T, MASK, BM, BN, GEN>;
                    load_tile<BN, D, NTH, true>(sK + off, FT::kv_tile_remat(p, p.k, p.k_batch_stride,
                                                    p.k_head_stride, p.k_row_stride, p.h_ratio, nn),
                                                p.k_row_stride, sk - nn * BN, tid_remat(), dch, dz);
                    load_tile<BN, D, NTH, true>(sV + off, FT::kv_tile_remat(p, p.v, p.v_batch_stride,
                                                    p.v_head_stride, p.v_row_stride, p.h_ratio, nn),
                                                p.v_row_stride, sk - nn * BN, tid_remat(), vch, vdz);
                } else {
                    load_tile<BN, D, NTH>(sK + off, kg + (int64_t)nn * BN * p.k_row_stride,
                                          p.k_row_stride, sk - nn * BN, tid, dch, dz);
                    load_tile<BN, D, NTH>(sV + off, vg + (int64_t)nn * BN * p.v_row_stride,
                                          p.v_row_stride, sk - nn * BN, tid, vch, vdz);
                }
                cp_async_commit();
            }
        } else {
            load_tile<BN, D, NTH>(sV, vg + (int64_t)nb * BN * p.v_row_stride, p.v_row_stride,
                                  sk - nb * BN, tid, vch, vdz);
            cp_async_commit();
        }
        if (Q_IN_REGS && nb == n_max - 1) {
#pragma unroll
            for (int mt = 0; mt < QREG_MT; ++mt)
#pragma unroll
                for (int kk = 0; kk < QREG_KD; ++kk)
                    if (kk < narrow_min_ksteps<D>() || kk < kd)
                        ldsm_x4(qr[mt][kk], q_lane + mt * 16 * (D * 2) + (kk >> 2) * 128 + q_off[kk & 3]);
        }

        // S = Q K^T, then -inf outside the visible band (ragged key tail, causal diagonal, window
        // edges) on the tiles that need it.
        float s[MT][NS][4];
        if constexpr (!Q_IN_REGS) {
            qk_tile<T, D, MT, NS, XA, KD, NARROW>(s, XA ? q_lx : q_lane, q_off,
                                                  sKs + (XA ? k_lx : k_lane_row), k_off, kd);
        } else {
            qk_tile_qregs<T, D, MT, NS, NARROW>(s, qr, sKs + k_lane_row, k_off, kd);
        }
        softcap_tile<(OPT & FWD_GEN) != 0>(s, p);
        alibi_tile<(OPT & FWD_GEN) != 0, BN>(s, p, slope_u, nb, warp_r0, sq, sk);
        mask_tile<MASK, BN, MT, NS>(s, nb, warp_r0, row_thr, lane, sq, sk, wl, wr);

        if (STAGES == 1) {
            cp_async_wait_all();
            __syncthreads();  // V[nb] landed; every warp is done reading K
            if (nb > n_min) {
                const int nn = nb - 1;
                load_tile<BN, D, NTH>(sK, kg + (int64_t)nn * BN * p.k_row_stride, p.k_row_stride,
                                      sk - nn * BN, tid, dch, dz);
                cp_async_commit();
            }
        }

        // Online softmax.
        softmax_tile<(OPT & FWD_LAZY) != 0>(s, o, row_m, row_l, sl2);

        // O += P V, P straight from the S accumulators (C layout == A layout).
        pv_tile<T, D, MT, NS, ND, XA, NARROW>(s, o, sVs + (XA ? v_lx : v_lane_row), v_off, kdv);
        if (STAGES == 2) stage ^= 1;
    }

    // Epilogue: normalise, LSE, stage O through this warp's own Q rows (only this warp ever
    // read them), then 16-byte coalesced stores.
    fwd_epilogue<T, D, MASK, BM, BN, GEN, LEAN>(p, o, row_m, row_l, warp_row, lane, rows_valid, og, lseg);
}


// Online softmax of a warp pair's S half (fwd_body_pair): the row max is the larger of the two
// warps' partial maxima (published in shared memory at red_own / red_mate), s becomes P, O is
// rescaled, and the row's partial sum at red_own + SUM_OFF is updated by the quad's first lane.
template <uint32_t SUM_OFF, int MT, int NS, int ND>
__device__ __forceinline__ void pair_softmax(float (&s)[MT][NS][4], float (&o)[MT][ND][4], float (&row_m)[MT][2],
                                             uint32_t red_own, uint32_t red_mate, float sl2, bool quad0) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const float m_new = fmaxf(fc::ld_shared_f32(red_own + (mt * 16 + hf * 8) * 4),
                                      fc::ld_shared_f32(red_mate + (mt * 16 + hf * 8) * 4));
            float msc;
            const float alpha = fc::online_rescale(row_m[mt][hf], m_new, sl2, msc);
            row_m[mt][hf] = m_new;
            const float sum = fc::quad_sum(exp_row(s[mt], hf, sl2, msc));
            const uint32_t l_addr = red_own + SUM_OFF + (mt * 16 + hf * 8) * 4;
            if (quad0) fc::st_shared_f32(l_addr, fmaf(fc::ld_shared_f32(l_addr), alpha, sum));
#pragma unroll
            for (int j = 0; j < ND; ++j) {
                o[mt][j][2 * hf] *= alpha;
                o[mt][j][2 * hf + 1] *= alpha;
            }
        }
}

// Key-split warp pairs (FWD_PAIR; written for d256, where one warp cannot hold 32 rows of O).
// Warps 2i and 2i+1 own the same RW = BM / (WARPS/2) query rows (MT = RW/16 m16 tiles each):
//   S:  warp half h computes the rows' scores against keys [h*BN/2, (h+1)*BN/2) of the tile;
//   max: the pair swaps its partial row maxima through smem, so both use the same running max;
//   P:  each warp stores its half of P (16-bit) to smem; O columns [h*D/2, (h+1)*D/2) += P V with
//       its own P half from registers and the partner's from smem (ldmatrix);
//   l:  partial row sums per warp in smem (O and S take every register of the 128-key tile;
//       the sums are touched once per tile), added once in the epilogue.
// Per key tile every warp reads Q (RW rows), half of K and half of V's columns from smem: with
// BM 128, BN 64, 8 warps that is 416 KB of shared-memory reads per tile against 576 KB when one
// warp owns 16 full rows, at the same MMA count and half the O registers per row.
// Registers: O (MT*ND*4 = 128) and S (MT*NS*4 = 64 at BN 128) leave none to spare, so the
// Q.K^T k16 loop and the partner-half P.V loop stay rolled (unrolled, ptxas hoists the next
// steps' ldmatrix loads and spills 20-50 B; rolled measured within 2 % of unrolled
// and spill-free on sm_80 and sm_90), the row sums live in smem and the K/V/O pointers are
// recomputed where they are used.
// Schedule as STAGES 1 of fwd_body (V load beside Q.K^T, next K load beside softmax and P.V);
// the second __syncthreads of a tile also publishes the partial maxima, and one 64-thread named
// barrier per pair (id 1 + pair) publishes P.
// Extra dynamic smem after the K and V tiles: P [WARPS/2][RW][BN] (16-bit), then f32 [WARPS][RW]
// partial maxima and f32 [WARPS][RW] partial sums.
template <typename T, int D, int MASK, int BM, int BN, int WARPS, int STAGES, bool GEN = false>
__device__ __forceinline__ void fwd_body_pair(const FcParams& p) {
    constexpr bool CAP = GEN;  // the general body (FWD_GEN): softcap, ALiBi, varlen, d or dv < D
    const int dch = GEN ? p.d / 8 : D / 8;   // 16-byte chunks of a Q / K row
    const int vch = GEN ? p.dv / 8 : D / 8;  // of a V / O row
    static_assert(STAGES == 1, "key-split pairs use the one-stage schedule");
    static_assert(WARPS % 2 == 0 && WARPS <= 30, "warps come in pairs (named barriers 1..15)");
    constexpr int NTH = WARPS * 32;
    constexpr int PAIRS = WARPS / 2;
    constexpr int RW = BM / PAIRS;  // query rows of a pair
    static_assert(RW * PAIRS == BM && RW % 16 == 0, "BLOCK_M must be a multiple of 8*WARPS");
    static_assert(BN == 64 || BN == 128, "P rows must span whole 128-byte swizzle groups");
    constexpr int MT = RW / 16;  // m16 tiles per warp
    constexpr int HB = BN / 2;   // keys per warp
    constexpr int NS = HB / 8;   // n8 tiles of S per m16 tile
    constexpr int DH = D / 2;    // O columns per warp
    constexpr int ND = DH / 8;   // n8 tiles of O per m16 tile

    extern __shared__ __align__(128) unsigned char fc_sm80_fwd_smem[];
    const uint32_t sQ = smem_addr(fc_sm80_fwd_smem);
    const uint32_t sK = sQ + BM * D * 2;
    const uint32_t sV = sK + BN * D * 2;
    const uint32_t sP = sV + BN * D * 2;
    const uint32_t sRed = sP + PAIRS * RW * BN * 2;

    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int pair = warp >> 1, half = warp & 1;
    const FwdTile<T, MASK, BM, BN, GEN> t(p);
    if (t.rows_valid <= 0) return;  // past the end of a shorter sequence (varlen)
    if (t.n_max <= t.n_min) {
        t.template write_empty<D, NTH>(p, tid);
        return;
    }
    const int sq = t.sq, sk = t.sk;
    const int wl = p.window_left, wr = p.window_right;

    // Prologue: Q and the first (highest) key tile.
    load_tile<BM, D, NTH, true>(sQ, t.qg, p.q_row_stride, t.rows_valid, tid, dch);
    {
        const int nb = t.n_max - 1;
        load_tile<BN, D, NTH, true>(sK, t.kg + (int64_t)nb * BN * p.k_row_stride, p.k_row_stride,
                              sk - nb * BN, tid, dch);
        cp_async_commit();
    }

    // ldmatrix geometry as in fwd_body with XOR addressing (FWD_XADDR: each lane base holds the
    // lane's swizzled chunk 0); every row offset below is a multiple of 8.
    const int sw = lane & 7;
    const int warp_row = pair * RW;
    const uint32_t q_lane = sQ + (warp_row + (lane & 15)) * (D * 2) + (((lane >> 4) ^ sw) << 4);
    const uint32_t k_lane = sK + (half * HB + (lane & 7) + ((lane >> 4) << 3)) * (D * 2) +
                            ((((lane >> 3) & 1) ^ sw) << 4);
    const uint32_t v_lane = sV + ((lane & 7) + (((lane >> 3) & 1) << 3)) * (D * 2) +
                            half * DH * 2 + (((lane >> 4) ^ sw) << 4);
    const uint32_t no_off[4] = {0, 0, 0, 0};  // unused with XOR addressing
    // P tile of this pair: [RW][BN] 16-bit, chunk c of row r at ((c ^ (r & 7)) << 4).
    const uint32_t p_pair = sP + pair * RW * BN * 2;
    // Store: row (lane >> 2) (+ 8k), so the swizzle term is lane >> 2.
    const uint32_t p_st = p_pair + (lane >> 2) * (BN * 2) + 4 * (lane & 3);
    // Load (A operand of the partner's half): row lane & 15, chunk + lane / 16.
    const uint32_t p_ld = p_pair + (lane & 15) * (BN * 2);
    // Row exchange [WARPS][RW] f32 (partial maxima) and each warp's partial row sums.
    const uint32_t red_own = sRed + (warp * RW + (lane >> 2)) * 4;
    const uint32_t red_mate = sRed + ((warp ^ 1) * RW + (lane >> 2)) * 4;
    constexpr uint32_t SUM_OFF = WARPS * RW * 4;  // red_* + SUM_OFF: the sums
    const bool quad0 = (lane & 3) == 0;  // the lane of a quad that keeps the row's sum

    float o[MT][ND][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < ND; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[mt][j][e] = 0.f;
    float row_m[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            row_m[mt][hf] = FC_NEG_INF;
            if (quad0) fc::st_shared_f32(red_own + SUM_OFF + (mt * 16 + hf * 8) * 4, 0.f);
        }
    const float sl2 = CAP ? fc::score_unit_log2(p.scale_log2, p.softcap) : p.scale_log2;
    const int warp_r0 = t.m0 + warp_row;
    const int row_thr = warp_r0 + (lane >> 2);

    for (int nb = t.n_max - 1; nb >= t.n_min; --nb) {
        cp_async_wait_all();
        __syncthreads();  // K[nb] landed; every warp is done with V[nb+1], P and the maxima
        load_tile<BN, D, NTH, true>(sV, t.kv_tile_remat(p, p.v, p.v_batch_stride, p.v_head_stride,
                                                  p.v_row_stride, p.h_ratio, nb),
                              p.v_row_stride, sk - nb * BN, tid_remat(), vch);
        cp_async_commit();

        float s[MT][NS][4];
        qk_tile<T, D, MT, NS, true, 1>(s, q_lane, no_off, k_lane, no_off);
        softcap_tile<CAP>(s, p);
        alibi_tile<CAP, BN>(s, p, CAP ? t.slope_remat(p) : 0.f, nb, warp_r0, sq, sk, half * HB);
        mask_tile<MASK, BN, MT, NS>(s, nb, warp_r0, row_thr, lane, sq, sk, wl, wr, half * HB);
        // Partial row maxima to smem (read back after the barrier: no registers held across it).
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const float mx = row_max(s[mt], hf, row_m[mt][hf]);
                if ((lane & 3) == 0) fc::st_shared_f32(red_own + (mt * 16 + hf * 8) * 4, mx);
            }

        cp_async_wait_all();
        __syncthreads();  // V[nb] landed; K[nb] is free; partial maxima visible
        if (nb > t.n_min) {
            const int nn = nb - 1;
            load_tile<BN, D, NTH, true>(sK, t.kv_tile_remat(p, p.k, p.k_batch_stride, p.k_head_stride,
                                                      p.k_row_stride, p.h_ratio, nn),
                                  p.k_row_stride, sk - nn * BN, tid_remat(), dch);
            cp_async_commit();
        }

        // Online softmax with the pair's common row max.
        pair_softmax<SUM_OFF>(s, o, row_m, red_own, red_mate, sl2, quad0);
        // This warp's P half, one k16 step at a time (S registers die step by step): to smem for
        // the partner, and straight into its own P.V step.
        const uint32_t v_l = launder32(v_lane);
#pragma unroll
        for (int kk = 0; kk < HB / 16; ++kk) {
            uint32_t pa[MT][4];
            pack_p<T>(s, kk, pa);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    // e: (n8 tile 2kk + e/2, row half e%2)
                    const int c = half * (HB / 8) + 2 * kk + (e >> 1);
                    fc::st_shared_b32(p_st + (mt * 16 + (e & 1) * 8) * (BN * 2) + ((c ^ (lane >> 2)) << 4),
                                  pa[mt][e]);
                }
            }
            pv_k16<T, D, MT, ND, true>(o, pa, v_l, no_off, half * HB + kk * 16);
        }
        asm volatile("bar.sync %0, 64;" ::"r"(1 + pair) : "memory");  // partner's P visible
#pragma unroll 1
        for (int kk = 0; kk < HB / 16; ++kk) {
            uint32_t pb[MT][4];
            const int c = (half ^ 1) * (HB / 8) + 2 * kk + (lane >> 4);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                ldsm_x4(pb[mt], p_ld + mt * 16 * (BN * 2) + ((c ^ sw) << 4));
            pv_k16<T, D, MT, ND, true>(o, pb, v_l, no_off, (half ^ 1) * HB + kk * 16);
        }
    }

    // Epilogue: l = both halves' partial sums.
    asm volatile("bar.sync %0, 64;" ::"r"(1 + pair) : "memory");
    T* og;
    float* lseg;
    t.out_remat(p, og, lseg);
    const float scale = CAP ? fc::score_unit(p.scale, p.softcap) : p.scale;
    // the head's sink, unswitched and read per row as in fwd_body
    using FT = FwdTile<T, MASK, BM, BN, GEN>;
    auto finish = [&](auto with_sink) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const float l = fc::ld_shared_f32(red_own + SUM_OFF + (mt * 16 + hf * 8) * 4) +
                                fc::ld_shared_f32(red_mate + SUM_OFF + (mt * 16 + hf * 8) * 4);
                float lse;
                const float inv =
                    decltype(with_sink)::value
                        ? fc::finalize_sink(row_m[mt][hf] * scale, l, FT::sink_remat(p), lse)
                        : fc::finalize_row(row_m[mt][hf], l, scale, lse);
                scale_o_half(o, mt, hf, inv);
                const int r = warp_row + mt * 16 + hf * 8 + (lane >> 2);
                if (half == 0 && (lane & 3) == 0 && r < t.rows_valid) lseg[r] = lse;
            }
    };
    if (FT::sink_remat(p) == FC_NEG_INF)
        finish(fc::Flag<false>{});
    else
        finish(fc::Flag<true>{});
    // This warp's O columns go through the pair's own Q rows (only the pair read them, before the
    // last tile's second __syncthreads).
    store_o<T, D>(fc_sm80_fwd_smem, o, warp_row, lane, half * ND, og, p.o_row_stride, t.rows_valid,
                  vch);
}

}  // namespace fc_sm80

namespace fc_sm80 {
// Dynamic shared memory of a forward kernel: Q tile, STAGES K and V tiles, and for FWD_PAIR the
// pairs' P tiles plus one f32 per warp and row (kernels/variants.rs `smem_bytes` mirrors this).
__host__ __device__ constexpr int fwd_smem_bytes(int D, int BM, int BN, int WARPS, int STAGES,
                                                 int OPT) {
    return (BM + 2 * STAGES * BN) * D * 2 +
           ((OPT & FWD_PAIR) != 0 ? BM * BN * 2 + 2 * WARPS * (BM / (WARPS / 2)) * 4 : 0);
}
// Whether this compilation pass targets a GPU below sm_90 (device code of sm_80/86/89 and the
// compute_80 PTX; false on sm_90 and on the host, where only fwd_smem_bytes reads OPT).
__host__ __device__ constexpr bool fwd_pre_hopper_target() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
    return true;
#else
    return false;
#endif
}
// OPT used by FC_SM80_FWD (the variant table's macro) for a tile shape. Ship a measured winner by
// returning its bits here, e.g. `return (D == 128 && BM == 128 && BN == 32) ? FWD_LAZY : 0;`.
__host__ __device__ constexpr int fwd_default_opt(int D, int BM, int BN, int WARPS, int STAGES) {
    // Measured on the H100 (sm_90 SASS, bf16, fa3 grid; docs/decisions.md#sm80-tiles):
    //   d64 / d128 (4 warps): lazy rescale + XOR ldmatrix addressing, +5-10% over the plain
    //   schedule (d128 0.94-0.98x -> 1.04-1.07x FA2);
    //   d256 (8 warps, one m16 tile per warp): the lazy rescale costs 5-7%, XOR addressing is
    //   neutral: plain schedule.
    // d128 128x48: spill-free on sm_90 as is; ptxas for sm_80/86/89 spills 8 B, so
    // those targets (and the PTX) also take FWD_LEAN (0 spills; on the H100 2 % slower than
    // without, still 2 % faster than 128x32 under sustained load).
    return D == 256 ? 0
                    : (FWD_LAZY | FWD_XADDR |
                       (D == 128 && BN == 48 && fwd_pre_hopper_target() ? FWD_LEAN : 0));
}
// Whether a launch needs the general body (FWD_GEN): a score modifier, a packed batch, or a head
// dim (q/k's or v/o's) below the kernel's.
__device__ __forceinline__ bool fwd_general(const FcParams& p, int D) {
    return p.softcap > 0.f || p.alibi_slopes != nullptr || p.cu_seqlens_q != nullptr ||
           p.cu_seqlens_k != nullptr || p.seqused_k != nullptr || p.d != D || p.dv != D;
}
// Whether a kernel holds a softcap body (FWD_GEN) beside its plain one. Not the d128 128x48 tile:
// beside a softcap body its plain body ran 2.5-4.7 % slower (H100), so softcap d128
// without a mask takes the `_cap` twin of 128x32 (kernels/variants.rs `has_cap_body` mirrors this).
__host__ __device__ constexpr bool fwd_has_cap_body(int D, int BN) { return !(D == 128 && BN == 48); }
// Whether a kernel with a general body also holds a narrow one (FWD_NARROW): not the sliding
// window tiles (a third body there costs build time for a rare combination), and not the
// two-stage d256 tile of sm_86/89 (spilled 4-20 B with it); the warp pairs have none.
__host__ __device__ constexpr bool fwd_has_narrow_body(int D, int MASK, int STAGES) {
    return MASK != 2 && (D <= 128 || STAGES == 1);
}
// Whether a general launch takes the narrow body: the head leaves at least a quarter of the
// kernel's 16-column steps unused (half of the d64 kernel's, which is less MMA-bound). H100,
// forced sm80, bf16, fa3 grid, time of the general body ÷ the narrow one
// (decisions.md#sm80-narrow-bodies): d80 / d96 on d128 1.160 / 1.048, d160 / d192 on d256 1.223 /
// 1.058, d32 on d64 1.080;
// d112 (one step of eight saved) 0.935 and d48 on d64 0.898: the branches cost more than the
// steps they save. With p.d != p.dv the rule is the same on their mean (the steps saved in
// Q.K^T and in P.V count alike); with p.d == p.dv it is the rule above.
__device__ __forceinline__ bool fwd_narrow(const FcParams& p, int D) {
    return D == 64 ? p.d + p.dv <= D : 2 * (p.d + p.dv) <= 3 * D;
}
}  // namespace fc_sm80

// Key-split warp pairs (fwd_body_pair; the variant table's `warp_pairs` entries).
#define FC_SM80_FWD_PAIRS(SYMBOL, T, HEAD_DIM, MASK_ID, BLOCK_M, BLOCK_N, WARPS, STAGES)      \
    FC_SM80_FWD_OPT(SYMBOL, T, HEAD_DIM, MASK_ID, BLOCK_M, BLOCK_N, WARPS, STAGES, fc_sm80::FWD_PAIR)

#define FC_SM80_FWD(SYMBOL, T, HEAD_DIM, MASK_ID, BLOCK_M, BLOCK_N, WARPS, STAGES)            \
    FC_SM80_FWD_OPT(SYMBOL, T, HEAD_DIM, MASK_ID, BLOCK_M, BLOCK_N, WARPS, STAGES,             \
                    fc_sm80::fwd_default_opt(HEAD_DIM, BLOCK_M, BLOCK_N, WARPS, STAGES))

// OPT: bit mask of fc_sm80::FWD_LAZY / FWD_XADDR / FWD_PAIR / FWD_LEAN (1 / 4 / 8 / 16); 0 = the
// plain schedule. FWD_GEN / FWD_NARROW bodies are added here per launch (fwd_general, fwd_narrow).
#define FC_SM80_FWD_OPT(SYMBOL, T, HEAD_DIM, MASK_ID, BLOCK_M, BLOCK_N, WARPS, STAGES, OPT)   \
    extern "C" __global__ void __launch_bounds__((WARPS) * 32)                                 \
        SYMBOL(const __grid_constant__ FcParams p) {                                           \
        if constexpr (((OPT) & fc_sm80::FWD_PAIR) != 0) {                                       \
            if (fc_sm80::fwd_general(p, HEAD_DIM))                                              \
                fc_sm80::fwd_body_pair<T, HEAD_DIM, MASK_ID, BLOCK_M, BLOCK_N, WARPS, STAGES, true>(p); \
            else                                                                               \
                fc_sm80::fwd_body_pair<T, HEAD_DIM, MASK_ID, BLOCK_M, BLOCK_N, WARPS, STAGES>(p);  \
        } else if constexpr (fc_sm80::fwd_has_cap_body(HEAD_DIM, BLOCK_N)) {                     \
            if (fc_sm80::fwd_general(p, HEAD_DIM)) {                                            \
                if constexpr (fc_sm80::fwd_has_narrow_body(HEAD_DIM, MASK_ID, STAGES)) {         \
                    if (fc_sm80::fwd_narrow(p, HEAD_DIM)) {                                      \
                        fc_sm80::fwd_body<T, HEAD_DIM, MASK_ID, BLOCK_M, BLOCK_N, WARPS, STAGES, \
                                          (OPT) | fc_sm80::FWD_GEN | fc_sm80::FWD_NARROW>(p);   \
                        return;                                                                \
                    }                                                                          \
                }                                                                              \
                fc_sm80::fwd_body<T, HEAD_DIM, MASK_ID, BLOCK_M, BLOCK_N, WARPS, STAGES,        \
                                  (OPT) | fc_sm80::FWD_GEN>(p);                                \
            } else                                                                             \
                fc_sm80::fwd_body<T, HEAD_DIM, MASK_ID, BLOCK_M, BLOCK_N, WARPS, STAGES, OPT>(p); \
        } else {                                                                               \
            fc_sm80::fwd_body<T, HEAD_DIM, MASK_ID, BLOCK_M, BLOCK_N, WARPS, STAGES, OPT>(p);   \
        }                                                                                      \
    }                                                                                          \
    constexpr FcKernelFacts fc_facts_##SYMBOL{                                                 \
        (uint32_t)fc_sm80::fwd_smem_bytes(HEAD_DIM, BLOCK_M, BLOCK_N, WARPS, STAGES, OPT),     \
        ((OPT) & fc_sm80::FWD_PAIR) != 0 || fc_sm80::fwd_has_cap_body(HEAD_DIM, BLOCK_N),      \
        false, false, false, HEAD_DIM, 1};
