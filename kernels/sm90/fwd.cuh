// flashcore sm_90a forward attention: FA3-style warp specialization (own code).
//
// CTA = 1 producer warpgroup (warp 0 issues TMA; setmaxnreg.dec) + BLOCK_M/64 consumer
// warpgroups (setmaxnreg.inc), each owning 64 query rows. Q is loaded once per tile (TMA, SW128,
// into one of QS buffers), K and V stream through a STAGES-deep ring of full/empty mbarriers, key
// tiles are walked from the last (masked) one down to 0. Per consumer: S = Q K^T with SS wgmma
// (K-major, SW128), online softmax in registers (exp2, scale_log2 folded, lazy O rescale; without a
// mask, key tiles after the first ones skip the row max: `softmax_gen`), P packed to 16-bit
// registers, O += P V with RS wgmma (V is MN-major in smem, imm-trans-b = 1). Intra-warpgroup
// overlap: QK^T of tile i is issued before the P V of tile i-1, and the softmax of tile i runs while
// that P V is in flight (the wait for that P V sits after the loop back-edge, so ptxas cannot hoist
// it above the softmax: v4; causal 128-row tiles up to d128 wait behind a branch inside the softmax
// instead: `SPV`).
// Optional ping-pong between consumer warpgroups (named barriers 1..NC) hands the tensor cores
// from one to the next. Persistent tile loop (any grid size, see below). Epilogue: 1/l, O staged
// (swizzled) in a separate O buffer when it fits in smem (then Q of the next tile loads right
// after the last Q K^T), else in the warpgroup's own slice of the Q buffer; one thread per
// warpgroup stores the slice with a TMA bulk-tensor store (rows >= sq are outside the map); LSE
// (natural log) f32; empty rows O = 0, LSE = -inf (16-byte stores), or the head's sink with p.sinks
// (which only the epilogue reads: fc::finalize_sink).
//
// ---------------------------------------------------------------------------------------------
// LAUNCH CONTRACT (host side; src/cuda/tma.rs `encode` builds the tensor maps)
//   kernel:  SYMBOL(const __grid_constant__ FcParams p, const __grid_constant__ CUtensorMap tm_q,
//                   const __grid_constant__ CUtensorMap tm_k, const __grid_constant__ CUtensorMap tm_v,
//                   const __grid_constant__ CUtensorMap tm_o)
//   grid: any size. Static schedule (p.tile_counter null): CTA i (linear id) processes tiles
//         k*nctas + (k odd ? nctas-1-i : i), k = 0, 1, ... of the ceil(sq/BLOCK_M)*hq*b query tiles;
//         one CTA per tile is grid (ceil(sq/BLOCK_M), hq, b), persistent is grid (min(tiles, #SMs), 1, 1)
//         (it overlaps one tile's epilogue with the next tile's loads: use it for no mask).
//         Dynamic schedule (DYN kernels: causal d64/d128, causal d256 with 64-key tiles;
//         p.tile_counter -> a zeroed int32 (left zeroed: the host keeps one per stream), grid
//         (min(tiles, #SMs), 1, 1)): CTA i starts with tile i, then a scheduler thread (warp 1 of the
//         producer warpgroup) draws nctas + atomicAdd(counter, 1) whenever a slot of a 2-slot mbarrier
//         ring in smem is free, and publishes the decoded tile to the TMA thread and the consumers.
//         Without a counter a DYN kernel takes tiles cta, cta + nctas, ... (one CTA per tile works).
//         Static kernels ignore the counter; the TMA thread publishes their tiles to the consumers.
//         block = WARPS*32 = (BLOCK_M/64 + 1) * 128 threads
//   dynamic smem = fc90::fwd_smem_bytes(BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, QS)  (host+device constexpr)
//                = (QS*BLOCK_M + 2*STAGES*BLOCK_N + (SEP_O ? BLOCK_M : 0)) * HEAD_DIM * 2 + 1280, where
//                  SEP_O = ((QS+1)*BLOCK_M + 2*STAGES*BLOCK_N) * HEAD_DIM * 2 + 1280 <= 232448 (227 KB)
//                  and QS (1 or 2 Q buffers) is the variant table's q_stages
//     -> needs cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes) (> 48 KB).
//   Tensor maps (cuTensorMapEncodeTiled), one each for q, k, v, o, all the same recipe:
//     dataType  CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 or _FLOAT16;  rank 4
//     globalAddress = p.q / p.k / p.v / p.o (must be 16-byte aligned)
//     globalDim     = { d, seq, heads, batch }  (fastest first; seq = sq for q and o, sk for k/v;
//                                                heads = hq for q and o, hkv for k/v)
//     globalStrides = { row_stride*2, head_stride*2, batch_stride*2 } bytes (each a multiple of 16
//                     and < 2^40; a size-1 dim may use any valid stride, e.g. seq*row_stride*2)
//     boxDim        = { 64, BLOCK_M (q) or BLOCK_N (k, v) or 64 (o), 1, 1 }
//     elementStrides= { 1, 1, 1, 1 }
//     interleave CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle CU_TENSOR_MAP_SWIZZLE_128B,
//     l2Promotion CU_TENSOR_MAP_L2_PROMOTION_L2_128B, oobFill CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE (zeros)
//   Requirements the host must check (else use the sm80 path): head_dim % 64 == 0; q/k/v base
//   addresses 16-B aligned and their row/head/batch strides multiples of 8 elements; o base 16-B
//   aligned and o strides multiples of 8 elements (TMA store, 16-byte zero stores); mask none or causal
//   (window_left = -1, window_right in {-1, 0}); softcap == 0 and no ALiBi, or either for the
//   FC_SM90_FWD_CAP twins (the score-modifier body); num_splits == 1, except for the
//   FC_SM90_FWD_KVS twins (SPLIT): num_splits = 1, 2 or 4, grid (num_splits * tiles, 1, 1) in
//   clusters of (num_splits, 1, 1), no tile counter: exactly one cluster per query tile (the
//   exchange reuses the K/V ring, which the loads of a cluster's next tile could overwrite before
//   rank 0 has read it). p.d <= HEAD_DIM (the
//   FC_SM90_FWD_NARROW twins: p.d <= DV): the maps' globalDim d = p.d, so TMA zero-fills the
//   columns beyond it and the O store clips them.
//   Varlen (p.cu_seqlens_q/k set, fc::seq_range): q/o maps over the packed (d, total_q, hq, 1)
//   rows and k/v over (d, total_k, hkv, 1), batch coordinate 0; tiles past a shorter sequence are
//   skipped by the scheduler; key rows past the sequence's end that a box reads are masked; O
//   leaves through 16-byte stores of the sequence's rows (a TMA box would write the next one's).
//   Paged K/V (p.page_table set, p.seqused_k the lengths, page_size = 2^p.page_shift >= 16): k/v
//   maps over the pools as (d, page_size, hkv, num_pages) with boxDim { 64, min(page_size,
//   BLOCK_N & -BLOCK_N), 1, 1 } (a box starts 2 KB-aligned in its stage): the TMA thread loads
//   each key tile box by box through the page table (`load_tile`). The paged twins (ILV,
//   FC_SM90_FWD_PG: paged problems only, p.d = HEAD_DIM, pages stored whole, 2^page_shift >= 16)
//   take k/v maps of rank 5 over the pools instead: globalDim { 64, 8, HEAD_DIM / 64, hkv,
//   num_pages * page_size / 8 }, globalStrides { row_stride*2, 128, head_stride*2,
//   8*row_stride*2 } bytes, boxDim { 64, 8, HEAD_DIM / 64, 1, min(page_size, BLOCK_N &
//   -BLOCK_N) / 8 } (one box per page or tile over every column; src/cuda/tma.rs encode_pool).
// ---------------------------------------------------------------------------------------------
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>
#include <cuda.h>
#include "../common/params.h"
#include "../common/softmax.cuh"
#include "../common/seqlens.cuh"
#include "hopper.cuh"


namespace fc90 {

// A compile-time element count passed to the consumers' generic lambdas.
template <int N> struct Int {
    static constexpr int value = N;
};

// A separate O staging buffer (BM x D) is used when it fits in the 227 KB opt-in limit; it lets the
// next tile's Q load start as soon as the last Q K^T of the current tile has completed.
// `qs`: Q buffers (QS, 1 or 2).
__host__ __device__ constexpr bool fwd_sep_o(int bm, int bn, int d, int stages, int qs = 1) {
    return (uint32_t)(((qs + 1) * bm + 2 * stages * bn) * d * 2) + 1280u <= 232448u;
}
__host__ __device__ constexpr uint32_t fwd_smem_bytes(int bm, int bn, int d, int stages, int qs = 1) {
    return (uint32_t)((qs * bm + 2 * stages * bn + (fwd_sep_o(bm, bn, d, stages, qs) ? bm : 0)) * d * 2) + 1024u + 256u;
}

template <typename T> struct TypeInfo;
template <> struct TypeInfo<__nv_bfloat16> {
    static constexpr bool bf16 = true;
    static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
        __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<uint32_t*>(&v);
    }
    static __device__ __forceinline__ float2 unpack(uint32_t v) {
        return make_float2(__uint_as_float(v << 16), __uint_as_float(v & 0xffff0000u));
    }
};
template <> struct TypeInfo<__half> {
    static constexpr bool bf16 = false;
    static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
        __half2 v = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<uint32_t*>(&v);
    }
    static __device__ __forceinline__ float2 unpack(uint32_t v) {
        return __half22float2(*reinterpret_cast<__half2*>(&v));
    }
};

// CAP: softcap (p.softcap > 0; the `_cap` twins, FC_SM90_FWD_CAP): each S tile
// becomes t = tanh(S * scale / softcap) right after its Q K^T (fc::softcap_tanh, before the mask),
// and the kept scores' unit is softcap instead of scale (exp2 factor, LSE).
// DV: the head dim the kernel computes (D: the full kernel). A narrow twin (DV < D, the variant
// table's `narrow`) keeps the D-wide shared-memory tiles of its kernel but loads, multiplies and
// stores only the first DV columns: Q K^T over DV / 16 k-steps, P V and O DV wide.
// ILV: the paged twin (`_pg`, FC_SM90_FWD_PG; full width only): its K and V stages keep each
// group of 8 key rows with all of its 64-column blocks together, [row group][column block][8
// rows][128 B], where the other kernels keep each column block's BN rows together, [column
// block][BN rows][128 B]. A page's rows over every column block are then one TMA box (a 5-D map
// over the pool: 64 columns, 8 rows, column blocks, head, the pool's row groups), so a tile of
// 16-row pages at d128 takes 8 boxes per K or V instead of 16 (`load_tile`); the wgmma
// descriptors step over the same bytes with other strides (KV_CB, KV_RG).
// SPLIT: the key-split twin (`_kvs`, FC_SM90_FWD_KVS; the variant table's `kv_split`) for grids
// with fewer query tiles than SMs. Launched in clusters of p.num_splits (2 or 4; 1 runs it like
// its kernel) consecutive CTAs along x, one cluster per query tile: CTA `rank` of the cluster
// walks the rank-th of num_splits contiguous chunks of the tile's key tiles (a rank whose chunk
// is empty walks key tile 0 and discards it, so every rank runs the same code). The ranks > 0
// leave their unnormalised O, reference maxima and row sums in their own K/V ring (free once both
// consumer warpgroups are past their last P V) and arrive on rank 0's `x_ready`; rank 0 reads
// them through distributed shared memory, rescales and adds them to its own, releases the others
// through their `x_done`, and runs the epilogue alone.
// QS: Q buffers (the variant table's `q_stages`). With two, the TMA thread loads the next tile's Q
// into the other buffer before the current tile is done (as soon as its tile is known and the
// buffer's tile before last has finished its Q K^T), so a short tile does not wait for its Q after
// the previous tile's last Q K^T. Needs the separate O buffer (O never staged in a Q buffer).
template <typename T, int D, int MASK, int BM, int BN, int STAGES, bool PINGPONG, bool CAP = false,
          int DV = D, bool ILV = false, bool SPLIT = false, int QS = 1>
struct FwdSm90 {
    static_assert(D % 64 == 0 && D <= 256, "head_dim must be 64, 128, 192 or 256");
    static_assert(DV % 16 == 0 && DV >= 32 && DV <= D, "narrow width: a multiple of 16, 32..D");
    static_assert(BM % 64 == 0 && BM >= 128 && BM <= 256, "BLOCK_M = 128, 192 or 256");
    static_assert(BN % 16 == 0 && BN <= 256, "BLOCK_N multiple of 16");
    static_assert(MASK >= 0 && MASK <= 2, "sm90 path: mask none, causal or window");
    // MASK 2, a window with a right bound (p.window_right >= 0, the host's rule): the causal
    // machinery below runs on the diagonal shifted right by window_right (`roff`), and a left bound
    // (p.window_left >= 0) starts each query tile's key walk at its first row's first key tile
    // (`n_first`) and masks the tiles a row's bound cuts (docs/decisions.md#sm90-windows).
    static constexpr bool CAUSAL = MASK >= 1;
    static constexpr bool WINDOW = MASK == 2;
    static constexpr int NC = BM / 64;  // consumer warpgroups
    static constexpr int NTHREADS = (NC + 1) * 128;
    static constexpr int DB = D / 64;  // 64-column (128-byte) blocks of the tiles
    static constexpr int DBV = (DV + 63) / 64;  // ... of them loaded and stored
    static constexpr uint32_t Q_BYTES = BM * D * 2;
    static constexpr uint32_t KV_BYTES = BN * D * 2;
    static constexpr bool SEP_O = fwd_sep_o(BM, BN, D, STAGES, QS);
    static_assert(QS == 1 || (QS == 2 && SEP_O), "two Q buffers need the separate O buffer");
    static constexpr uint32_t Q_LOAD = BM * DBV * 128;  // TMA bytes per Q / K-or-V tile
    static constexpr uint32_t KV_LOAD = BN * DBV * 128;
    // K/V stage strides in bytes: between 64-column blocks, and between groups of 8 key rows
    static constexpr uint32_t KV_CB = ILV ? 1024u : BN * 128u;
    static constexpr uint32_t KV_RG = ILV ? DB * 1024u : 1024u;
    static constexpr uint32_t TILE_BYTES = QS * Q_BYTES + 2 * STAGES * KV_BYTES + (SEP_O ? Q_BYTES : 0);
    static_assert(TILE_BYTES + 1280 <= 232448, "shared memory over the 227 KB limit");
    // setmaxnreg split. setmaxnreg.inc blocks until the CTA's register pool (what the launch
    // allocated: NTHREADS x the per-thread budget of __launch_bounds__(NTHREADS, 1), a multiple
    // of 8) has the registers, so the split must fit that pool, not the SM's 64K: with four
    // consumer warpgroups the pool is 640 x 96, and 112 / 56 hung
    // (decisions.md#sm90-register-split).
    // Causal tiles are unequal: dynamic schedule (p.tile_counter) for d64/d128 and for d256 with
    // 64-key tiles (`sm90_d256_short`; the 80-key tile spills at 232 consumer registers). No mask:
    // static (any grid). Host side: src/cuda/mod.rs `sm90_dynamic`.
    static constexpr bool DYN = CAUSAL && (D <= 128 || BN == 64);
    // d64, and d256 on the dynamic schedule, with two consumer warpgroups: the producer (TMA thread
    // + tile scheduler) spills at 24 registers, 40 then, and 232 for the consumers.
    // The dynamic schedule's threads carry each tile's sequence range (varlen):
    // at 24 registers the d128 causal producer spilled 32 B, so every DYN kernel takes 40.
    static constexpr bool PROD40 = D == 64 || DYN;
    static constexpr int PROD_REGS = NC == 2 ? (PROD40 ? 40 : 24) : 32;
    static constexpr int CONS_REGS = NC == 2 ? (PROD40 ? 232 : 240) : NC == 3 ? 160 : 112;
    static_assert((NC * CONS_REGS + PROD_REGS) * 128 <= (65536 / NTHREADS) / 8 * 8 * NTHREADS,
                  "setmaxnreg split over the CTA's register pool (the consumers' inc would hang)");
    // Paged K/V read through the page table (`load_tile`): every kernel but the dynamic-schedule
    // ones with three consumer warpgroups (d64 causal 192x128), whose 32-register producer spills
    // 44 B with the page walk, and the four-warpgroup tiles (d64 256x64), whose 32-register
    // producer spilled 4 B with the TMA warp's per-lane boxes; the host gathers for those
    // (`Variant::page_box`, kernels/variants.rs).
    static constexpr bool PAGED = !(NC == 3 && DYN) && NC != 4;
    static_assert(!ILV || (PAGED && DV == D && BN % 16 == 0), "paged twin: a paged, full-width kernel");
    static constexpr int BAR_SCHED = 1;            // named barriers 1..NC: ping-pong
    static constexpr int BAR_EPI = 1 + NC;         // named barriers NC+1..2NC: per-WG epilogue
    static constexpr int BAR_SPLIT = 1 + 2 * NC;   // the consumers of a key-split rank > 0
    // A key-split rank's exchange region per consumer warpgroup: per thread its DV / 2 O values
    // and (reference max in log2 units, partial row sum) x 2 rows, as float4 [DV / 8 + 1][128].
    static constexpr uint32_t X_BYTES = (DV / 8 + 1) * 128 * 16;
    static_assert(!SPLIT || (NC == 2 && SEP_O && !ILV && NC * X_BYTES <= 2 * STAGES * KV_BYTES),
                  "key-split twin: two consumer warpgroups, an O buffer, the exchange inside the K/V ring");
    static constexpr bool BF = TypeInfo<T>::bf16;
    // Lazy rescale: a row keeps its reference max m until the true max exceeds it by more than
    // RESCALE_LOG2 in exp2 units (P <= 2^8 = 256 then: exact in f32, the same relative rounding in
    // bf16/fp16, and O, l and the LSE all use the same reference). O is rescaled only when some
    // row of the warp moved its reference (a warp vote), not after every key tile: +2.2 % over the
    // fa3 grid (H100, docs/decisions.md#lazy-rescale).
    static constexpr float RESCALE_LOG2 = 8.f;  // = fc::LAZY_RESCALE_LOG2
    // Fast softmax (no row max, see softmax_gen) on the key tiles after the first ones: no mask
    // only. Same-binary A/B on the H100 (bf16, two runs each): d64 +7.5-11 %,
    // d128 +0.1-2.2 %, d256 +0-1 %. On causal tiles too it lost 3-7 % at d64 and d128 1k-4k,
    // and still 0-3 % with K freed by one thread per warpgroup and the P = inf scores
    // recomputed from global memory (that recompute itself cost d64 non-causal 1.4-4.3 %
    // through register pressure in the key loop): docs/decisions.md#fast-softmax-without-a-mask.
    static constexpr bool FAST = !CAUSAL;
    // Causal 128-row tiles up to d128 (two consumer warpgroups): the exact softmax also finishes
    // the P V in flight (`softmax_pv`, FA3's order). Same-binary A/B on the H100
    // (docs/decisions.md#spv-softmax-pv): d64 causal 512 / 1k +1.8-3.5 %, d128 causal +0-2 %, LLaMA
    // prefill +1.8 %;
    // the d64 192x128 causal tile ran 1.6-2.2 % slower at 8k / 16k with it, so it keeps the old
    // order.
    static constexpr bool SPV = CAUSAL && NC == 2 && D <= 128;
    // Causal tiles up to d128 (SPV's and the d64 192x128 one): the mask test is one per-tile
    // threshold (`n_mask`), and each row's sum of exponentials is two partial sums (even and odd
    // elements), which halves the serial FADD chain that follows the exponentials. Same-binary
    // A/B on the H100 (docs/decisions.md#two-row-sum-chains): d64 192x128 causal 2k-16k +1.2-2.0 %
    // (the threshold alone +0.7-1.7 %), two sums on the SPV tiles d64 512 / 1k +1.0-1.1 %, LLaMA
    // prefill +1.0 %, d128 causal -0.4 to +1.0 %. d256 causal lost 1.3-1.9 % at 1k / 2k with the
    // threshold and gained nothing from two sums; non-causal tiles lost 1-2 % at
    // d64 with two sums, so those keep one.
    static constexpr bool CAUSAL_SHORT = CAUSAL && D <= 128;
    // Causal tiles whose first warpgroup can see none of the query tile's last key tile (see
    // `SKIP1` in run()): the causal tiles without SPV.
    static constexpr bool SKIP1 = CAUSAL && !SPV;
    static_assert(!SKIP1 || BM - 64 <= BN, "SKIP1 passes over one key tile at most");
    using QK = Wgmma<BN, BF>;
    using PV = Wgmma<DV, BF>;

    // Dynamic schedule: the next tile from p.tile_counter, or total when none is left. Draws are
    // handed out in order and every CTA stops at its first draw past the tiles, so the draw of
    // value total - 1 is the launch's last: it puts the counter back to zero for the next launch
    // on the stream (one counter per stream, never re-zeroed by the host).
    __device__ static __forceinline__ int next_tile(const FcParams& p, int nctas, int total) {
        const unsigned v = atomicAdd(reinterpret_cast<unsigned*>(p.tile_counter), 1u);
        if (v == (unsigned)(total - 1)) atomicExch(p.tile_counter, 0);
        return v < (unsigned)(total - nctas) ? nctas + (int)v : total;
    }
    // Tile lin (0 <= lin < num_m * hq * b) -> (m_block, h, bi). Non-causal: m fastest (CTAs in flight
    // share K/V). Causal: longest query tiles first within groups of G (batch, head) pairs whose K and V
    // fit in ~24 MB of L2; a smaller remainder group goes first so the last group is a full one. The
    // h_ratio query heads of a K/V head are adjacent and share its K/V, so a group holds h_ratio times
    // as many query heads as K/V heads fit (as FA3's LPT scheduler): LLaMA-3-8B prefill (32/8 heads,
    // causal) took 3 groups at 4k instead of 1, +5 % at 4k and +9 % at 2k (H100;
    // docs/decisions.md#l2-group-budget).
    __device__ static __forceinline__ void decode_tile(const FcParams& p, int num_m, int lin, int& m_block, int& h,
                                                       int& bi) {
        int bh;
        if (CAUSAL) {
            const int nbh = p.hq * p.b;
            const long long kvh = 4LL * p.sk * D;
            const int G = (int)max(1LL, min((long long)nbh, (24LL << 20) / max(kvh, 1LL) * p.h_ratio));
            const int rem = nbh % G;
            int base, gsz, r;
            if (lin < rem * num_m) {
                base = 0; gsz = rem; r = lin;
            } else {
                const int l2 = lin - rem * num_m;
                const int grp = l2 / (G * num_m);
                base = rem + grp * G; gsz = G; r = l2 - grp * G * num_m;
            }
            m_block = num_m - 1 - r / gsz;
            bh = base + r % gsz;
        } else {
            m_block = lin % num_m;
            bh = lin / num_m;
        }
        h = bh % p.hq;
        bi = bh / p.hq;
    }
    // Raw score of query row `qr` (of the Q tile) and key row `kr` (of a K stage) from the
    // 128B-swizzled tiles in shared memory, f32 accumulation (fix_tile's rare path).
    __device__ static __forceinline__ float score_smem(uint32_t sq_, uint32_t sk_, int qr, int kr) {
        float acc = 0.f;
        const uint32_t qa = sq_ + qr * 128, ka = sk_ + (ILV ? (kr >> 3) * KV_RG + (kr & 7) * 128 : kr * 128),
                       qs = (qr & 7) << 4, ks = (kr & 7) << 4;
#pragma unroll 1
        for (int w = 0; w < DV / 2; ++w) {  // 32-bit words: 2 elements
            const uint32_t blk = (w >> 5), off = (((w & 31) >> 2) << 4) | ((w & 3) << 2);
            const float2 x = TypeInfo<T>::unpack(fc::ld_shared_b32(qa + blk * BM * 128 + (off ^ qs)));
            const float2 y = TypeInfo<T>::unpack(fc::ld_shared_b32(ka + blk * KV_CB + (off ^ ks)));
            acc = fmaf(x.x, y.x, acc);
            acc = fmaf(x.y, y.y, acc);
        }
        return acc;
    }
    // How far right of the diagonal (key i + sk - sq for row i) the mask's right edge lies.
    __device__ static __forceinline__ int roff(const FcParams& p) { return WINDOW ? p.window_right : 0; }
    // The first key tile any row of query tile m_block sees: its first row's left bound's tile.
    __device__ static __forceinline__ int n_first(const FcParams& p, int m_block, int sq, int sk) {
        if (!WINDOW || p.window_left < 0) return 0;
        const int first = m_block * BM + sk - sq - p.window_left;
        return first <= 0 ? 0 : first / BN;
    }
    __device__ static __forceinline__ int n_tiles(const FcParams& p, const fc::SeqRange& sr, int m_block) {
        int n_max = (sr.sk + BN - 1) / BN;
        if (CAUSAL) {
            // keys < lim are visible to some row
            const int lim = (m_block + 1) * BM + sr.sk - sr.sq + roff(p);
            n_max = lim <= 0 ? 0 : min(n_max, (lim + BN - 1) / BN);
        }
        return n_max;
    }

    __device__ static __forceinline__ void run(const FcParams& p, const CUtensorMap* tmq, const CUtensorMap* tmk,
                                               const CUtensorMap* tmv, const CUtensorMap* tmo) {
        extern __shared__ uint8_t smem_raw[];
        const uint32_t raw = smem_u32(smem_raw);
        const uint32_t sQ = (raw + 1023u) & ~1023u;
        const uint32_t sK = sQ + QS * Q_BYTES;  // QS Q buffers of Q_BYTES
        const uint32_t sV = sK + STAGES * KV_BYTES;
        const uint32_t sO = sV + STAGES * KV_BYTES;  // O staging buffer (only when SEP_O; else O goes to sQ)
        const uint32_t bars = sO + (SEP_O ? Q_BYTES : 0);
        auto full_k = [&](int s) { return bars + 16u + 8u * s; };
        auto full_v = [&](int s) { return bars + 16u + 8u * (STAGES + s); };
        auto empty_k = [&](int s) { return bars + 16u + 8u * (2 * STAGES + s); };
        auto empty_v = [&](int s) { return bars + 16u + 8u * (3 * STAGES + s); };
        // 2-slot ring of decoded tiles (m_block -1 = stop; see `publish`): the thread that
        // owns the schedule -> the TMA thread (dynamic) and the consumers
        auto sched_full = [&](int s) { return bars + 16u + 8u * (4 * STAGES + s); };
        auto sched_empty = [&](int s) { return bars + 16u + 8u * (4 * STAGES + 2 + s); };
        // slot words: m_block, h, bi, k0 (paged: sk), n_max, sq, sk, q0 (the tile's sequence: fc::seq_range)
        auto sched_val = [&](int s) { return bars + 16u + 8u * (4 * STAGES + 4) + 32u * s; };
        // key split (SPLIT): rank 0's x_ready (the other ranks' partials are in their rings),
        // the other ranks' x_done (rank 0 has read them)
        const uint32_t x_ready = bars + 16u + 8u * (4 * STAGES + 4) + 64u;
        const uint32_t x_done = x_ready + 8u;
        // Q buffer b: loaded (bar_q) and free again (q_empty); the second buffer's pair after x_done
        auto bar_q = [&](int b) { return b == 0 ? bars : x_done + 8u; };
        auto q_empty = [&](int b) { return b == 0 ? bars + 8u : x_done + 16u; };
        static_assert(16 + 8 * (4 * STAGES + 4) + 64 + 16 + 16 * (QS - 1) <= 256, "barrier area");

        // ---- persistent static schedule: CTA `cta` takes tiles k*nctas + (k odd ? nctas-1-cta : cta) ----
        // (key split: the clusters take the tiles as CTAs would, `rank` says which chunk of keys)
        const int num_m = (p.sq + BM - 1) / BM;
        const int total = num_m * p.hq * p.b;
        const int splits = SPLIT ? max(p.num_splits, 1) : 1;
        const int rank = SPLIT ? (int)blockIdx.x % splits : 0;
        const int nctas = gridDim.x * gridDim.y * gridDim.z / splits;
        const int cta = (blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z)) / splits;
        const int tid = threadIdx.x;
        const int wg = tid / 128;
        // Key tiles [lo, hi) of this rank out of the tile's [n_min, n_max), n_min < n_max (all of
        // them without a split); `discard`: an empty chunk, which walks tile n_min and drops the
        // result.
        auto key_range = [&](int n_min, int n_max, int& lo, int& hi) {
            if (!SPLIT) {
                lo = n_min;
                hi = n_max;
                return false;
            }
            const int chunk = (n_max - n_min + splits - 1) / splits;
            lo = n_min + rank * chunk;
            hi = min(n_max, lo + chunk);
            if (lo < hi) return false;
            lo = n_min;
            hi = n_min + 1;
            return true;
        };

        if (tid == 0) {
#pragma unroll
            for (int b = 0; b < QS; ++b) {
                mbar_init(bar_q(b), 1);
                // with a separate O buffer and FAST, each consumer warp frees Q after its last fix_tile
                mbar_init(q_empty(b), SEP_O && FAST ? NC * 4 : NC);
            }
#pragma unroll
            for (int s = 0; s < STAGES; ++s) {
                mbar_init(full_k(s), 1);
                mbar_init(full_v(s), 1);
                // FAST: each consumer warp frees a K stage once it can no longer need it (fix_tile);
                // else one thread per consumer warpgroup once its Q K^T is complete
                mbar_init(empty_k(s), FAST ? NC * 4 : NC);
                mbar_init(empty_v(s), NC);
            }
            for (int s = 0; s < 2; ++s) {
                mbar_init(sched_full(s), 1);
                mbar_init(sched_empty(s), NC * 128 + (DYN ? 1 : 0));  // + the TMA warp
            }
            if (SPLIT && splits > 1) {
                mbar_init(x_ready, (splits - 1) * NC * 128);  // every consumer thread of the others
                mbar_init(x_done, NC * 128);                  // every consumer thread of rank 0
            }
            fence_barrier_init();
        }
        __syncthreads();
        // the barriers of every CTA of the cluster are initialised before any remote arrival
        if (SPLIT && splits > 1) cluster_sync();
        // The paged twins: the host's table check (fc_check_seqlens, a programmatic dependent)
        // may be scheduled now; it reads the tables on an SM this grid has left and waits for the
        // grid before writing, so it no longer adds its launch after the kernel.
        if (ILV) pdl_launch_dependents();

        if (wg == 0) {
            // ================= producer =================
            reg_dealloc<PROD_REGS>();
            PipeState<2> ss;  // tile-ring position (the scheduler thread's, or the TMA warp's)
            // slot = {m_block (-1 = stop), head, batch, first key row, key tiles, sq, sk, first row}
            auto publish = [&](int m_block, int h, int bi, const fc::SeqRange& sr) {
                const int slot = ss.stage;
                mbar_wait(sched_empty(slot), ss.phase ^ 1);
                if ((tid & 31) == 0) {  // the warp's lane 0 (the TMA warp runs this with all lanes)
                    const uint32_t a = sched_val(slot);
                    fc::st_shared_b32(a, m_block);
                    fc::st_shared_b32(a + 4u, h);
                    fc::st_shared_b32(a + 8u, bi);
                    fc::st_shared_b32(a + 12u, p.page_table != nullptr ? sr.sk : sr.k0);  // see load_tile
                    fc::st_shared_b32(a + 16u, m_block < 0 ? 0 : n_tiles(p, sr, m_block));
                    fc::st_shared_b32(a + 20u, sr.sq);
                    fc::st_shared_b32(a + 24u, sr.sk);
                    fc::st_shared_b32(a + 28u, sr.q0);
                    mbar_arrive(sched_full(slot));
                }
                ss.advance();
            };
            const fc::SeqRange none{0, 0, 0, 0};
            if (DYN && tid == 32) {
                // scheduler thread (warp 1): tile `cta` first, then whatever the counter hands out
                // (decode_tile: longest first), as soon as a ring slot is free. Without a counter:
                // round robin over the grid (one CTA per tile: tile `cta` only).
                for (int lin = cta; lin < total; lin = p.tile_counter ? next_tile(p, nctas, total) : lin + nctas) {
                    int m_block, h, bi;
                    decode_tile(p, num_m, lin, m_block, h, bi);
                    const fc::SeqRange sr = fc::seq_range(p, bi);
                    if (m_block * BM >= sr.sq) continue;  // past a shorter sequence (varlen)
                    publish(m_block, h, bi, sr);
                }
                publish(-1, 0, 0, none);
            }
            if (tid < 32) {
                // The TMA warp: every lane runs the schedule and waits on the barriers; lane 0
                // (`lead`) arrives and issues the Q and dense K/V loads. A paged tile's boxes are
                // issued by one lane each, every lane reading its own page id, so the tile costs
                // one page-table read latency, not one per box.
                const int lane = tid;
                const bool lead = lane == 0;
                if (lead) {
                    tma_prefetch_desc(tmq);
                    tma_prefetch_desc(tmk);
                    tma_prefetch_desc(tmv);
                }
                PipeState<STAGES> ks, vs;
                PipeState<QS> qs;  // the Q buffers
                for (int k = 0;; ++k) {
                    int m_block, h, bi, hk, n_max, k0, q0, tsq = 0, tsk = 0;
                    if (DYN) {
                        const int slot = ss.stage;
                        mbar_wait(sched_full(slot), ss.phase);
                        const uint32_t a = sched_val(slot);
                        m_block = (int)fc::ld_shared_b32(a);
                        h = (int)fc::ld_shared_b32(a + 4u);
                        bi = (int)fc::ld_shared_b32(a + 8u);
                        k0 = (int)fc::ld_shared_b32(a + 12u);
                        n_max = (int)fc::ld_shared_b32(a + 16u);
                        if (WINDOW) {
                            tsq = (int)fc::ld_shared_b32(a + 20u);
                            tsk = (int)fc::ld_shared_b32(a + 24u);
                        }
                        q0 = (int)fc::ld_shared_b32(a + 28u);
                        __syncwarp();  // every lane has read the slot
                        if (lead) mbar_arrive(sched_empty(slot));
                        ss.advance();
                        if (m_block < 0) break;
                        hk = h / p.h_ratio;
                    } else {
                        if (k * nctas >= total) break;
                        const int lin = k * nctas + ((k & 1) ? nctas - 1 - cta : cta);
                        if (lin >= total) continue;
                        decode_tile(p, num_m, lin, m_block, h, bi);
                        const fc::SeqRange sr = fc::seq_range(p, bi);
                        if (m_block * BM >= sr.sq) continue;  // past a shorter sequence (varlen)
                        publish(m_block, h, bi, sr);
                        hk = h / p.h_ratio;
                        n_max = n_tiles(p, sr, m_block);
                        tsq = sr.sq;
                        tsk = sr.sk;
                        k0 = p.page_table != nullptr ? sr.sk : sr.k0;
                        q0 = sr.q0;
                    }
                    // TMA batch coordinates: the packed varlen maps have one batch entry
                    const int bq = p.cu_seqlens_q != nullptr ? 0 : bi;
                    const int bk = p.cu_seqlens_k != nullptr ? 0 : bi;
                    if (n_max <= 0) continue;
                    int lo, hi;
                    key_range(n_first(p, m_block, tsq, tsk), n_max, lo, hi);
                    // Key tile n of K or V into `dst`. Paged pools (p.page_table; page size
                    // 2^page_shift >= 16; the host maps the pools as (d, page_size, hkv, pages) with
                    // boxes of min(page_size, the largest power of two dividing BN) rows): lane j
                    // loads box j of the tile, inside one page, its id read by that lane and clamped
                    // into the pool (as fc::page_of). A box past the sequence's last key (k0 holds the
                    // key count here) reloads the box holding it, as the barrier expects the whole
                    // tile: those keys are masked and the consumers zero their V rows.
                    // The paged twin (ILV; always paged) loads box j's rows over every column block
                    // with one 5-D box at row group (page * page_size + slot) / 8 of the pool.
                    auto load_tile = [&](uint32_t dst, const CUtensorMap* tm, uint32_t bar, int n) {
                        if (ILV || (PAGED && p.page_table != nullptr)) {
                            const int sh = p.page_shift;
                            const int pb = min(1 << sh, BN & -BN);
                            const int r = lane * pb;
                            if (r < BN) {
                                const int key = min(n * BN + r, (k0 - 1) & -pb);
                                const int page = fc::clamp_i(
                                    __ldg(p.page_table + (int64_t)bi * p.page_table_stride + (key >> sh)), 0,
                                    (p.total_k >> sh) - 1);
                                if (ILV) {
                                    tma_load_5d(dst + r * DB * 128, tm, bar, 0, 0, 0, hk,
                                                (page << (sh - 3)) + ((key & ((1 << sh) - 1)) >> 3), kEvictLast);
                                } else {
#pragma unroll
                                    for (int c = 0; c < DBV; ++c)
                                        tma_load_4d(dst + c * BN * 128 + r * 128, tm, bar, c * 64,
                                                    key & ((1 << sh) - 1), hk, page, kEvictLast);
                                }
                            }
                        } else if (lead) {
#pragma unroll
                            for (int c = 0; c < DBV; ++c)
                                tma_load_4d(dst + c * BN * 128, tm, bar, c * 64, k0 + n * BN, hk, bk, kEvictLast);
                        }
                    };
                    // (lane 0's expect_tx may follow other lanes' completed boxes: the tx count
                    // goes negative meanwhile, and the phase cannot end before lane 0 arrives)
                    auto load_k = [&](int n) {
                        mbar_wait(empty_k(ks.stage), ks.phase ^ 1);
                        if (lead) mbar_arrive_expect_tx(full_k(ks.stage), KV_LOAD);
                        load_tile(sK + ks.stage * KV_BYTES, tmk, full_k(ks.stage), n);
                        ks.advance();
                    };
                    auto load_v = [&](int n) {
                        mbar_wait(empty_v(vs.stage), vs.phase ^ 1);
                        if (lead) mbar_arrive_expect_tx(full_v(vs.stage), KV_LOAD);
                        load_tile(sV + vs.stage * KV_BYTES, tmv, full_v(vs.stage), n);
                        vs.advance();
                    };
                    // The Q buffer is free once both consumer warpgroups are past the last Q K^T of its
                    // previous tile (with a separate O buffer; else past the epilogue). Two buffers:
                    // Q first (its buffer's previous tile is long done), then the first K tile.
                    auto load_q = [&]() {
                        const int qb = qs.stage;
                        mbar_wait(q_empty(qb), qs.phase ^ 1);
                        if (lead) {
                            mbar_arrive_expect_tx(bar_q(qb), Q_LOAD);
#pragma unroll
                            for (int c = 0; c < DBV; ++c)
                                tma_load_4d(sQ + qb * Q_BYTES + c * BM * 128, tmq, bar_q(qb), c * 64,
                                            q0 + m_block * BM, h, bq, kEvictFirst);
                        }
                        qs.advance();
                    };
                    if (QS > 1) load_q();
                    load_k(hi - 1);
                    if (QS == 1) load_q();
#pragma unroll 1
                    for (int n = hi - 2; n >= lo; --n) {
                        load_k(n);
                        load_v(n + 1);
                    }
                    load_v(lo);
                }
                if (!DYN) publish(-1, 0, 0, none);
            }
            return;
        }

        // ================= consumers =================
        reg_alloc<CONS_REGS>();
        // The consumer warpgroup. Causal tiles take it as a value ptxas knows is the same in every
        // lane (a shuffle from lane 0): from threadIdx it is per-thread to ptxas, and so is every
        // wgmma descriptor built from it (the Q slice), which then costs each wgmma of the key
        // loop an R2UR pair and its address arithmetic (d256 causal 128x64: 589 -> 550
        // instructions per key tile). Same binary on the H100
        // (decisions.md#warp-uniform-warpgroup-index): causal
        // +0.5-1.8 %, LLaMA prefill +1.4 %; but d64 / d128 non-causal 8k -3.3 / -2.1 % and the d256
        // non-causal 128x80 tile spills 20 B with it, so those keep the per-thread value.
        const int c = CAUSAL ? __shfl_sync(0xffffffffu, wg - 1, 0) : wg - 1;
        const int t128 = tid & 127;
        const int warp = t128 >> 5, lane = tid & 31, g = lane >> 2, tq = lane & 3;
        const float sl2 = CAP ? fc::score_unit_log2(p.scale_log2, p.softcap) : p.scale_log2;
        const float pre = CAP && p.softcap > 0.f ? __fdividef(p.scale, p.softcap) : 0.f;  // softcap: S -> tanh(S * pre)
        const uint64_t dq = desc_sw128(sQ + c * 8192, 16, 1024);
        const uint64_t dk = desc_sw128(sK, 16, KV_RG);
        const uint64_t dv = desc_sw128(sV, KV_CB, KV_RG);
        uint8_t* const gsO = smem_raw + ((SEP_O ? sO : sQ) - raw);
        const uint32_t slice = c * 8192;
        constexpr int CPR = DV / 8;  // 16-byte chunks per output row
        PipeState<STAGES> ks, vs;
        PipeState<2> ss;   // the tile ring
        PipeState<QS> qs;  // the Q buffers
        uint32_t xi = 0;

        float o[DV / 2];
        float s[BN / 2];
        uint32_t pa[BN / 16][4];
        float m_r[2], l_r[2];

        for (;;) {
            const int slot = ss.stage;
            mbar_wait(sched_full(slot), ss.phase);
            // The slot stays ours until the tile is done (arrive at the end): head and batch are
            // re-read from it where needed instead of living in registers across the key loop.
            const int m_block = (int)fc::ld_shared_b32(sched_val(slot));
            ss.advance();
            if (m_block < 0) break;
            auto head_batch = [&](int& h, int& bi) {
                h = (int)fc::ld_shared_b32(sched_val(slot) + 4u);
                bi = (int)fc::ld_shared_b32(sched_val(slot) + 8u);
            };
            auto q0_of = [&]() { return (int)fc::ld_shared_b32(sched_val(slot) + 28u); };
            auto lse_row0 = [&]() {  // this (head, sequence)'s LSE row
                int h, bi;
                head_batch(h, bi);
                return fc::lse_ptr(p, bi, h, q0_of());
            };
            const int n_max = (int)fc::ld_shared_b32(sched_val(slot) + 16u);
            // the tile's sequence: its query rows and keys (dense: p.sq, p.sk), re-read from the
            // slot where used (held in registers across the key loop, d128 causal spilled 32 B)
            auto sq_of = [&]() { return (int)fc::ld_shared_b32(sched_val(slot) + 20u); };
            auto sk_of = [&]() { return (int)fc::ld_shared_b32(sched_val(slot) + 24u); };
            const int row0 = m_block * BM + c * 64 + warp * 16 + g;  // rows row0 and row0 + 8

            if (n_max <= 0) {
                int h, bi;
                head_batch(h, bi);
                T* og = reinterpret_cast<T*>(p.o) + (int64_t)bi * p.o_batch_stride + (int64_t)h * p.o_head_stride +
                        (int64_t)q0_of() * p.o_row_stride;
                float* lse_g = lse_row0();
                const int sqv = sq_of();
                // every row of this tile sees no key: O = 0, LSE = -inf or the head's sink (no
                // smem use)
                if (tq == 0) {
                    const float sink = fc::sink_of(p, h);
                    if (row0 < sqv) lse_g[row0] = sink;
                    if (row0 + 8 < sqv) lse_g[row0 + 8] = sink;
                }
#pragma unroll
                for (int it = 0; it < 64 * CPR / 128; ++it) {
                    const int idx = it * 128 + t128;
                    const int rl = idx / CPR, chk = idx % CPR;
                    const int grow = m_block * BM + c * 64 + rl;
                    if (grow < sqv && chk * 8 < p.d)
                        *reinterpret_cast<uint4*>(og + (int64_t)grow * p.o_row_stride + chk * 8) = make_uint4(0, 0, 0, 0);
                }
                mbar_arrive(sched_empty(slot));
                continue;
            }

            // this tile's Q buffer (QS)
            const int qb = qs.stage;
            // this CTA's key tiles [lo, hi), walked from hi - 1 down (the whole tile's without a split)
            int lo, hi;
            const bool discard = key_range(n_first(p, m_block, sq_of(), sk_of()), n_max, lo, hi);
            int NT = hi - lo;
            m_r[0] = m_r[1] = -INFINITY;
            l_r[0] = l_r[1] = 0.f;
#pragma unroll
            for (int i = 0; i < DV / 2; ++i) o[i] = 0.f;

            // softmax of one S tile held in s[]: mask, new max, alpha, exponentials, partial row sums.
            // key tile n needs masking (it is the ragged last one or crosses the causal diagonal);
            // tiles are walked from the last down, so the masked ones come first
            // CAUSAL_SHORT: key tiles n >= n_mask need it (both conditions grow with n: the first
            // holds from sk / BN on, the second from (m_block * BM + sk - sq + 1) / BN on, which is
            // <= 0 when every tile does). Computed once per tile: re-reading sq and sk from the
            // slot in every key tile put two shared loads and a uniform chain before each softmax
            // (docs/decisions.md#mask-threshold).
            const int n_mask =
                CAUSAL_SHORT ? min(sk_of() / BN, (m_block * BM + sk_of() - sq_of() + roff(p) + 1) / BN) : 0;
            // WINDOW with a left bound: tiles starting left of the tile's last row's first key
            // (key_left) hold keys some row does not see.
            const bool left = WINDOW && p.window_left >= 0;
            const int key_left = left ? m_block * BM + BM - 1 + sk_of() - sq_of() - p.window_left : 0;
            auto need_mask = [&](int n) {
                if (left && n * BN < key_left) return true;
                if (CAUSAL_SHORT) return n >= n_mask;
                return (n * BN + BN > sk_of()) || (CAUSAL && n * BN + BN - 1 > m_block * BM + sk_of() - sq_of() + roff(p));
            };
            auto apply_mask = [&](int n, auto ne) {
                constexpr int NE = decltype(ne)::value;
                if (need_mask(n)) {
                    // Keys col < lim[r] are visible to row r (col < sk and, causal, col <= row + sk - sq):
                    // one compare against a constant column offset and one select per element (the
                    // per-element column/row arithmetic cost 3-4 instructions: +1.2-1.4 % at d64
                    // causal 512 / 1k, H100; docs/decisions.md#mask-threshold).
                    const int col0 = n * BN + 2 * tq;
                    int lim[2], low[2];
#pragma unroll
                    for (int r = 0; r < 2; ++r) {
                        lim[r] = sk_of() - col0;
                        if (CAUSAL) lim[r] = min(lim[r], row0 + 8 * r + sk_of() - sq_of() + roff(p) + 1 - col0);
                        // WINDOW: keys col >= low[r] only (the row's left bound)
                        low[r] = left ? row0 + 8 * r + sk_of() - sq_of() - p.window_left - col0 : -0x7fffffff;
                    }
#pragma unroll
                    for (int i = 0; i < NE; ++i) {
                        const int cc = 8 * (i >> 2) + (i & 1);
                        if (cc >= lim[(i >> 1) & 1] || (WINDOW && cc < low[(i >> 1) & 1])) s[i] = -INFINITY;
                    }
                }
            };
            // Softmax of key tile n held in s[]. `exact`: mask, new row max, alpha (the lazy rescale
            // rule below), exponentials, row sums. Otherwise (a key tile after the first ones, see
            // `fast_ok`) the exponentials use the rows' reference max as it stands, without a row max
            // first (that was ~16 % of the loop's instructions, and the exponentials waited for it):
            // a thread's partial row sum bounds each of its P, so sums <= 2^RESCALE_LOG2 in every
            // row of the warp mean no reference had to move and the tile is done. If not (rare: a
            // row's max grew past the threshold) it returns true and leaves l alone; `fix_tile`
            // redoes the tile in finish_pv, where the P registers of the P V in flight are free.
            // One body for both so that the key loop holds one copy of the exponentials.
            // The exact path's first half: mask, new row max, alpha and the reference max.
            auto row_max = [&](int n, float (&alpha)[2], auto ne) {
                constexpr int NE = decltype(ne)::value;
                apply_mask(n, ne);
                float mx[2] = {m_r[0], m_r[1]};
#pragma unroll
                for (int i = 0; i < NE; ++i) mx[(i >> 1) & 1] = fmaxf(mx[(i >> 1) & 1], s[i]);
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
                    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
                    // The rule of fc::lazy_rescale (common/softmax.cuh, the sm80 kernels), written
                    // out: through the helper this kernel ran 1.6 % slower at d128. The first
                    // visible key sets the reference (O = 0 and l = 0 until then:
                    // alpha 1); later only a growth past the threshold moves it. Needs a scale > 0
                    // (the dispatcher refuses others).
                    const bool first = m_r[r] == -INFINITY;
                    const bool upd = first ? mx[r] != -INFINITY : mx[r] * sl2 - m_r[r] * sl2 > RESCALE_LOG2;
                    alpha[r] = upd && !first ? ex2(m_r[r] * sl2 - mx[r] * sl2) : 1.f;
                    if (upd) m_r[r] = mx[r];
                }
            };
            // The rows' reference max in exp2 units (0 for a row that has seen no key yet).
            auto ref_mu = [&](float (&mu)[2]) {
#pragma unroll
                for (int r = 0; r < 2; ++r) mu[r] = m_r[r] == -INFINITY ? 0.f : m_r[r] * sl2;
            };
            // The exponentials of s[i0, i1) against mu, added to the row sums ps: two partial sums
            // per row on CAUSAL_SHORT tiles (even and odd elements), one otherwise; `total` adds
            // them up.
            auto exps = [&](int i0, int i1, const float (&mu)[2], float (&ps)[2][2]) {
#pragma unroll
                for (int i = i0; i < i1; ++i) {
                    const int r = (i >> 1) & 1;
                    s[i] = ex2(fmaf(s[i], sl2, -mu[r]));
                    ps[r][CAUSAL_SHORT ? (i & 1) : 0] += s[i];
                }
            };
            auto total = [&](const float (&ps)[2][2], int r) { return CAUSAL_SHORT ? ps[r][0] + ps[r][1] : ps[r][0]; };
            auto add_l = [&](const float (&alpha)[2], const float (&ps)[2][2]) {
#pragma unroll
                for (int r = 0; r < 2; ++r) l_r[r] = l_r[r] * alpha[r] + total(ps, r);
            };
            auto softmax_gen = [&](int n, float (&alpha)[2], bool exact) -> bool {
                if (exact) {
                    row_max(n, alpha, Int<BN / 2>{});
                } else {
                    alpha[0] = alpha[1] = 1.f;
                }
                float mu[2], ps[2][2] = {};
                ref_mu(mu);
                exps(0, BN / 2, mu, ps);
                constexpr float LIM = 1u << (int)RESCALE_LOG2;
                if (!exact && __any_sync(0xffffffffu, !(total(ps, 0) <= LIM) || !(total(ps, 1) <= LIM))) return true;
                add_l(alpha, ps);
                return false;
            };
            auto softmax = [&](int n, float (&alpha)[2]) { softmax_gen(n, alpha, true); };
            // Key tile n may skip the row max once the tile before it was unmasked: every row then
            // has a reference from at least one whole tile, which makes growth rare.
            auto fast_ok = [&](int n) {
                return FAST && !need_mask(n + 1) &&
                       !__any_sync(0xffffffffu, m_r[0] == -INFINITY || m_r[1] == -INFINITY);
            };
            // The score modifiers of the CAP twins (runtime: softcap, ALiBi), element i of key tile n.
            auto alibi = [&](float v, int n, int i) {
                int h, bi;
                head_batch(h, bi);
                const int col = n * BN + 8 * (i >> 2) + 2 * tq + (i & 1);
                const int diag = row0 + 8 * ((i >> 1) & 1) + sk_of() - sq_of();
                return fc::alibi_apply(v, fc::alibi_slope_units(p, bi, h), abs(col - diag), fc::alibi_floor(p));
            };
            auto mod_score = [&](float v, int n, int i) {
                if (p.softcap > 0.f) v = fc::softcap_tanh(v * pre);
                if (p.alibi_slopes != nullptr) v = alibi(v, n, i);
                return v;
            };
            // Redo key tile n whose s[] holds P = 2^(x - mu) from a fast softmax_gen: back to the raw
            // scores (log2; x - mu >= 128 gave P = inf and is recomputed from Q and K stage `kst` in
            // shared memory), then `softmax`.
            auto fix_tile = [&](int n, uint32_t kst, float (&alpha)[2]) {
                const float mu[2] = {m_r[0] * sl2, m_r[1] * sl2};
                const float isl2 = 1.f / sl2;
#pragma unroll
                for (int i = 0; i < BN / 2; ++i)
                    if (s[i] != INFINITY) s[i] = (lg2(s[i]) + mu[(i >> 1) & 1]) * isl2;
                uint64_t big = 0;
#pragma unroll
                for (int i = 0; i < BN / 2; ++i)
                    if (s[i] == INFINITY) big |= 1ull << i;
                while (big) {  // one dot product per P = inf (an index loop: one copy of the code)
                    const int i = __ffsll((long long)big) - 1;
                    big &= big - 1;
                    float v = score_smem(sQ + qb * Q_BYTES, sK + kst * KV_BYTES, c * 64 + warp * 16 + g + 8 * ((i >> 1) & 1),
                                         8 * (i >> 2) + 2 * tq + (i & 1));
                    if (CAP) v = mod_score(v, n, i);
#pragma unroll
                    for (int j = 0; j < BN / 2; ++j)
                        if (j == i) s[j] = v;
                }
                softmax(n, alpha);
            };
            auto cap_scores = [&](int n) {
                if (CAP) {
                    if (p.softcap > 0.f) {
#pragma unroll
                        for (int i = 0; i < BN / 2; ++i) s[i] = fc::softcap_tanh(s[i] * pre);
                    }
                    if (p.alibi_slopes != nullptr) {
                        int h, bi;
                        head_batch(h, bi);
                        const float sl = fc::alibi_slope_units(p, bi, h);
                        const float lo = fc::alibi_floor(p);
                        const int col0 = n * BN + 2 * tq, dg = row0 + sk_of() - sq_of();
#pragma unroll
                        for (int i = 0; i < BN / 2; ++i)
                            s[i] = fc::alibi_apply(s[i], sl, abs(col0 + 8 * (i >> 2) + (i & 1) - dg - 8 * ((i >> 1) & 1)), lo);
                    }
                }
            };
            auto convert_p = [&]() {
#pragma unroll
                for (int kk = 0; kk < BN / 16; ++kk)
#pragma unroll
                    for (int j = 0; j < 4; ++j)
                        pa[kk][j] = TypeInfo<T>::pack(s[8 * kk + 2 * j], s[8 * kk + 2 * j + 1]);
            };
            // The P V in flight is complete: O and P are this warpgroup's again; `release` frees its
            // V stage.
            auto pv_done = [&](bool release) {
                wg_wait<0>();
                fence_regs(o);
                fence_regs(pa);
                if (release) {
                    if (t128 == 0) mbar_arrive(empty_v(vs.stage));
                    vs.advance();
                }
            };
            // SPV kernels: the exact softmax of key tile n that also finishes the P V in flight, in
            // FA3's order: after the row max and the first exponentials, wait for the P V (`pv`: one
            // is in flight; free its V stage), rescale O, then the other exponentials with P packed
            // as they come. The rescale and the packing then fill the SFU's gaps instead of standing
            // between the softmax and the next Q K^T (there they sat after the ping-pong barrier:
            // ncu against FA4, docs/decisions.md#spv-softmax-pv). No finish_pv then.
            auto softmax_pv = [&](int n, float (&alpha)[2], bool pv) {
                row_max(n, alpha, Int<BN / 2>{});
                float mu[2], ps[2][2] = {};
                ref_mu(mu);
                // exponentials before the wait: BN / 16 against BN / 8, same binary (H100):
                // d64 / d128 causal 512-8k and LLaMA prefill +0.5-1.3 %, d128 16k -1.2 to +0.3 %;
                // BN / 4 ran 0.5-2.7 % slower
                constexpr int X = BN / 16;
                exps(0, X, mu, ps);
                // The waits sit behind the rescale's branch: in one basic block with the softmax,
                // ptxas hoisted the wait above the row max (no overlap with the P V: 2-4 % slower).
                if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
                    wg_wait<0>();
                    fence_regs(o);
#pragma unroll
                    for (int j = 0; j < DV / 2; ++j) o[j] *= alpha[(j >> 1) & 1];
                }
                pv_done(pv);
                exps(X, BN / 2, mu, ps);
                convert_p();
                add_l(alpha, ps);
            };
            // Q K^T over the DV columns in use (a narrow twin: the columns past p.d <= DV are zeros,
            // filled by TMA). Earlier narrow-Q K^T twins ran ceil(d / 16) k-steps in a
            // loop bounded by the parameter block (d80 +3-11 %, d160 +1-16 %); the loop in the
            // full-width kernels themselves cost d128 2-5 %, and a branch around single unrolled
            // wgmmas makes ptxas serialise them (C7515): hence compile-time twins
            // (docs/decisions.md#narrow-twins).
            auto issue_qk = [&](int stage) {
                const uint64_t dks = desc_add(dk, stage * KV_BYTES);
#pragma unroll
                for (int kk = 0; kk < DV / 16; ++kk)
                    QK::ss(s, desc_add(dq, qb * Q_BYTES + (kk / 4) * BM * 128 + (kk % 4) * 32),
                           desc_add(dks, (kk / 4) * KV_CB + (kk % 4) * 32), kk > 0 ? 1 : 0);
            };
            auto issue_pv = [&](int stage) {
                const uint64_t dvs = desc_add(dv, stage * KV_BYTES);
#pragma unroll
                for (int kk = 0; kk < BN / 16; ++kk) PV::rs(o, pa[kk], desc_add(dvs, kk * 2 * KV_RG), 1);
            };
            auto sched_sync = [&]() {
                if (PINGPONG) named_sync(BAR_SCHED + c, 256);
            };
            auto sched_arrive = [&](bool last) {
                if (PINGPONG && !(last && c == NC - 1)) named_arrive(BAR_SCHED + (c + 1) % NC, 256);
            };
            if (PINGPONG && c == NC - 1) named_arrive(BAR_SCHED, 256);  // seed: WG 0 goes first

            // Causal: the keys this warpgroup's rows can see end here (its last row's diagonal + 1),
            // re-read from the tile slot as everywhere in the consumer (SKIP1 and HALF below).
            auto wg_key_end = [&]() { return m_block * BM + c * 64 + 64 + sk_of() - sq_of() + roff(p); };
            // SKIP1 (causal tiles without SPV: d64 192x128, d256): the warpgroup's first key tile is
            // masked whole for its rows (its diagonal lies in the tile's other warpgroups: every d256
            // 128x64 query tile's first warpgroup, most d64 192x128 tiles' first two). It waits
            // for that tile's K and V and frees them, passes its ping-pong turn on, and starts at
            // the next tile. BM - 64 <= BN, so one tile at most. The branch is a warp vote:
            // decided on values read from shared memory it would be divergent to ptxas, which
            // then builds the whole key loop for divergent warps (the stage and phase it advances
            // no longer uniform: 24 more R2UR / IMAD per iteration, WARPSYNC around the wgmmas)
            // and the kernel ran 6-10 % slower. Same-binary A/B on the H100
            // (docs/decisions.md#skip1-and-half-votes): d256 causal 512-8k +0.9-2.7 %, d64 causal
            // 2k +3.5 %.
            if (SKIP1 && __any_sync(0xffffffffu, hi - lo >= 2 && wg_key_end() <= (hi - 1) * BN)) {
                mbar_wait(full_k(ks.stage), ks.phase);
                if (t128 == 0) mbar_arrive(empty_k(ks.stage));
                ks.advance();
                sched_sync();
                sched_arrive(false);
                mbar_wait(full_v(vs.stage), vs.phase);
                if (t128 == 0) mbar_arrive(empty_v(vs.stage));
                vs.advance();
                --hi;
                --NT;
            }
            constexpr bool HALF = CAUSAL && !CAP && D == 64 && BN == 128;
            // HALF (the d64 causal tiles): the warpgroup's first key tile is visible to its rows in
            // its first half only (at BM = BN and seq_q = seq_k, the first warpgroup's diagonal
            // tile): its row max, exponentials and sums run over those BN / 2 keys, and its P is
            // zero in the other half. The Q K^T stays whole (a second Q K^T shape in the kernel
            // made ptxas serialise the wgmmas: C7511, C7520). A warp vote, as SKIP1. Same-binary
            // A/B on the H100 (decisions.md#skip1-and-half-votes): d64 causal 512 / 1k +2.0 / +3.1
            // % with
            // a divergent branch, then +2.0 / +3.8 % more with the vote; the 192x128 tile 2k / 8k
            // +1.1 / +0.8 % over SKIP1 alone; on the d128 tiles -1 to +1.6 %, so not there.
            const bool half = HALF && __any_sync(0xffffffffu, wg_key_end() <= (hi - 1) * BN + BN / 2);

            mbar_wait(bar_q(qb), qs.phase);
            // ---- prologue: S_0 = Q K_0^T, softmax, P_0 ----
            mbar_wait(full_k(ks.stage), ks.phase);
            sched_sync();
            fence_regs(s);
            fence_regs(o);
            wg_fence();
            issue_qk(ks.stage);
            wg_commit();
            sched_arrive(false);
            wg_wait<0>();
            fence_regs(s);
            if (FAST ? lane == 0 : t128 == 0) mbar_arrive(empty_k(ks.stage));
            ks.advance();
            float alpha[2];
            cap_scores(hi - 1);
            if (half) {  // (alpha = 1: the first key tile)
                row_max(hi - 1, alpha, Int<BN / 4>{});
                float mu[2], ps[2][2] = {};
                ref_mu(mu);
                exps(0, BN / 4, mu, ps);
#pragma unroll
                for (int i = BN / 4; i < BN / 2; ++i) s[i] = 0.f;
                convert_p();
                add_l(alpha, ps);
            } else if (SPV) {
                softmax_pv(hi - 1, alpha, false);
            } else {
                softmax(hi - 1, alpha);
            }
            // Paged pools: the rows of the last key tile past the sequence's end hold whatever the
            // page holds (P is 0 there, but 0 * NaN is NaN): zero them in its V stage (the first
            // V tile of the loop) before any P V reads it. Both consumer warpgroups write the same
            // zeros; each fences its writes for the async proxy and syncs its own threads.
            if (PAGED && p.page_table != nullptr) {
                const int valid = sk_of() - (hi - 1) * BN;
                if (valid < BN) {
                    mbar_wait(full_v(vs.stage), vs.phase);
                    uint8_t* const vt = smem_raw + (sV + vs.stage * KV_BYTES - raw);
                    const int units = (BN - valid) * 8;  // 16-byte units per 64-column block
                    for (int i = t128; i < units * DBV; i += 128) {
                        const int cb = i / units, r = valid + (i % units) / 8, u = i % 8;
                        const int at = ILV ? (r >> 3) * KV_RG + cb * KV_CB + (r & 7) * 128 : cb * BN * 128 + r * 128;
                        *reinterpret_cast<uint4*>(vt + at + u * 16) = make_uint4(0, 0, 0, 0);
                    }
                    fence_proxy_async_smem();
                    named_sync(BAR_EPI + c, 128);
                }
            }
            // ---- steady state. Iteration i: finish tile i-1's P V (wait, release V, rescale O, P_{i-1}
            // to registers), then issue S_i = Q K_i^T and O += P_{i-1} V_{i-1}; softmax_i overlaps that
            // P V. The wait for P V sits at the top of the next iteration (after the loop back-edge) so
            // ptxas cannot hoist it above the softmax. SPV kernels do that finishing inside
            // softmax_pv instead (no finish_pv). ----
            // Finish the P V in flight (if `release`, free its V stage), finish the previous key
            // tile's softmax if softmax_gen left it (`fix`: fix_tile reads Q and that tile's K stage,
            // so each warp frees the K stage after it, and Q after the last finish_pv), rescale O,
            // P to registers.
            bool fix = false;
            uint32_t kprev = 0;
            auto finish_pv = [&](bool release, int nprev) {
                pv_done(release);
                if (fix) {
                    fix_tile(nprev, kprev, alpha);
                    if (lane == 0) mbar_arrive(empty_k(kprev));
                    fix = false;
                }
                if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
                    for (int j = 0; j < DV / 2; ++j) o[j] *= alpha[(j >> 1) & 1];
                }
                convert_p();
            };
            for (int i = 1; i < NT; ++i) {
                const int n = hi - 1 - i;
                if (!SPV) finish_pv(i >= 2, n + 1);
                mbar_wait(full_k(ks.stage), ks.phase);
                sched_sync();
                fence_regs(s);
                fence_regs(pa);
                fence_regs(o);
                wg_fence();
                issue_qk(ks.stage);
                wg_commit();
                mbar_wait(full_v(vs.stage), vs.phase);
                wg_fence();  // (without it ptxas puts one here itself and warns: C7519)
                issue_pv(vs.stage);
                wg_commit();
                sched_arrive(false);
                wg_wait<1>();
                fence_regs(s);
                kprev = ks.stage;
                ks.advance();
                cap_scores(n);
                if (FAST) {
                    // free the K stage now, or after fix_tile in the next finish_pv
                    // d64: a specialised copy for each case (one runtime-flagged body: -0.2 to -3.3 %
                    // at d64, -0.3 to +3.4 % at d128 non-causal)
                    if (D == 64)
                        fix = fast_ok(n) ? softmax_gen(n, alpha, false) : softmax_gen(n, alpha, true);
                    else
                        fix = softmax_gen(n, alpha, !fast_ok(n));
                    if (!fix && lane == 0) mbar_arrive(empty_k(kprev));
                } else {
                    if (t128 == 0) mbar_arrive(empty_k(kprev));
                    if (SPV)
                        softmax_pv(n, alpha, true);
                    else
                        softmax(n, alpha);
                }
            }
            if (!SPV) finish_pv(NT >= 2, lo);
            // all Q K^T of this tile are complete: with a separate O buffer, Q can be reloaded now
            if (SEP_O && (FAST ? lane == 0 : t128 == 0)) mbar_arrive(q_empty(qb));
            // ---- tail: O += P_{T-1} V_{T-1} ----
            mbar_wait(full_v(vs.stage), vs.phase);
            sched_sync();
            fence_regs(pa);
            fence_regs(o);
            wg_fence();
            issue_pv(vs.stage);
            wg_commit();
            sched_arrive(true);
            pv_done(true);

            // ================= key split: gather the other ranks' partials into rank 0 =================
            if (SPLIT && splits > 1) {
                const uint32_t xs = sK + c * X_BYTES + t128 * 16;  // this thread's float4 j at xs + j * 2048
                if (discard) {  // (only ranks > 0: rank 0's chunk is never empty)
                    m_r[0] = m_r[1] = -INFINITY;
                    l_r[0] = l_r[1] = 0.f;
#pragma unroll
                    for (int j = 0; j < DV / 2; ++j) o[j] = 0.f;
                }
                if (rank > 0) {
                    // both warpgroups are past their last P V: the ring holds no live K or V
                    named_sync(BAR_SPLIT, NC * 128);
#pragma unroll
                    for (int j = 0; j < DV / 8; ++j)
                        st_shared_v4(xs + j * 2048, make_float4(o[4 * j], o[4 * j + 1], o[4 * j + 2], o[4 * j + 3]));
                    const float mu0 = m_r[0] == -INFINITY ? -INFINITY : m_r[0] * sl2;
                    const float mu1 = m_r[1] == -INFINITY ? -INFINITY : m_r[1] * sl2;
                    st_shared_v4(xs + (DV / 8) * 2048, make_float4(mu0, mu1, l_r[0], l_r[1]));
                    mbar_arrive_cluster(mapa(x_ready, 0));
                    // rank 0 has read them (this CTA's smem must outlive the reads)
                    mbar_wait(x_done, xi & 1);
                    ++xi;
                    mbar_arrive(sched_empty(slot));
                    qs.advance();
                    continue;
                }
                mbar_wait_cluster(x_ready, xi & 1);
                ++xi;
                float mu[2], big[2];
#pragma unroll
                for (int r = 0; r < 2; ++r) big[r] = mu[r] = m_r[r] == -INFINITY ? -INFINITY : m_r[r] * sl2;
                for (int k = 1; k < splits; ++k) {
                    const float4 ml = ld_cluster_v4(mapa(xs + (DV / 8) * 2048, k));
                    big[0] = fmaxf(big[0], ml.x);
                    big[1] = fmaxf(big[1], ml.y);
                }
                // rows that saw no key anywhere keep m = -inf, l = 0 (and O = 0)
                const float ref[2] = {big[0] == -INFINITY ? 0.f : big[0], big[1] == -INFINITY ? 0.f : big[1]};
                float f[2] = {ex2(mu[0] - ref[0]), ex2(mu[1] - ref[1])};
#pragma unroll
                for (int r = 0; r < 2; ++r) l_r[r] *= f[r];
#pragma unroll
                for (int j = 0; j < DV / 2; ++j) o[j] *= f[(j >> 1) & 1];
                for (int k = 1; k < splits; ++k) {
                    const float4 ml = ld_cluster_v4(mapa(xs + (DV / 8) * 2048, k));
                    f[0] = ex2(ml.x - ref[0]);
                    f[1] = ex2(ml.y - ref[1]);
                    l_r[0] += f[0] * ml.z;
                    l_r[1] += f[1] * ml.w;
                    const uint32_t peer = mapa(xs, k);
#pragma unroll
                    for (int j = 0; j < DV / 8; ++j) {
                        const float4 v = ld_cluster_v4(peer + j * 2048);
                        o[4 * j] += f[0] * v.x;
                        o[4 * j + 1] += f[0] * v.y;
                        o[4 * j + 2] += f[1] * v.z;
                        o[4 * j + 3] += f[1] * v.w;
                    }
                }
                for (int k = 1; k < splits; ++k) mbar_arrive_cluster(mapa(x_done, k));
#pragma unroll
                for (int r = 0; r < 2; ++r) m_r[r] = big[r] == -INFINITY ? -INFINITY : big[r] / sl2;
            }

            // ================= epilogue =================
            float* lse_g = lse_row0();
            float inv[2], lse[2];
            // the head's sink joins the normaliser here (once per row, after a key split's merge)
            auto sink_of_tile = [&]() {
                int h, bi;
                head_batch(h, bi);
                return fc::sink_of(p, h);
            };
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float l = l_r[r];
                l += __shfl_xor_sync(0xffffffffu, l, 1);
                l += __shfl_xor_sync(0xffffffffu, l, 2);
                const float unit = CAP ? fc::score_unit(p.scale, p.softcap) : p.scale;
                const float sink = p.sinks != nullptr ? sink_of_tile() : -INFINITY;
                if (sink == -INFINITY) {
                    const bool empty = !(l > 0.f);
                    inv[r] = empty ? 0.f : 1.f / l;
                    lse[r] = empty ? -INFINITY : m_r[r] * unit + logf(l);
                } else {
                    inv[r] = fc::finalize_sink(m_r[r] * unit, l, sink, lse[r]);
                }
            }
            const int sqv = sq_of();
            if (tq == 0) {
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int row = row0 + 8 * r;
                    if (row < sqv) lse_g[row] = lse[r];
                }
            }
            // stage O (16-bit) into this warpgroup's 64-row slice of the O (or Q) buffer, 128B-swizzled
            if (SEP_O) {
                // the previous tile's TMA store must have read the slice
                if (t128 == 0) bulk_wait_read();
                named_sync(BAR_EPI + c, 128);
            }
#pragma unroll
            for (int i = 0; i < DV / 2; i += 2) {
                const int col = 8 * (i >> 2) + 2 * tq;
                const int rl = warp * 16 + g + 8 * ((i >> 1) & 1);
                const int cb = col >> 6, ch = (col & 63) >> 3;
                const uint32_t off = cb * BM * 128 + slice + rl * 128 + ((ch ^ (rl & 7)) << 4) + (col & 7) * 2;
                const int r = (i >> 1) & 1;
                *reinterpret_cast<uint32_t*>(gsO + off) = TypeInfo<T>::pack(o[i] * inv[r], o[i + 1] * inv[r]);
            }
            // One thread stores the slice with TMA (rows >= sq fall outside the map, so they are not
            // written): against 16-byte stores from every thread +0.8 % over the fa3 grid, +1.5-3 %
            // at d64/d128 up to 1k (H100; docs/decisions.md#o-through-a-tma-store).
            if (p.cu_seqlens_q != nullptr) {
                // Varlen (a uniform branch: the dense path stays as it was). A slice that lies inside
                // its sequence takes the TMA store at its packed row (batch coordinate 0); the slice
                // holding the sequence's last rows takes 16-byte stores of its rows (a TMA box past
                // the sequence's end would write the next sequence's rows). Neither choice branches
                // around a barrier: a divergent path holding one serialises every wgmma of the
                // kernel (ptxas C7520, 25-40 % slower:
                // docs/decisions.md#wgmma-serialisation-warnings).
                const int srow = m_block * BM + c * 64;
                // Not the 256-row d64 kernel (its 4 consumer warpgroups spill 8 B with the TMA store)
                // nor d256 (1.2-2.7 % slower than the 16-byte stores).
                const bool tail = BM > 192 || D > 128 || srow + 64 > sqv;
                fence_proxy_async_smem();
                named_sync(BAR_EPI + c, 128);
                int h, bi;
                head_batch(h, bi);
                const int q0 = q0_of();
                T* og = reinterpret_cast<T*>(p.o) + (int64_t)h * p.o_head_stride + (int64_t)q0 * p.o_row_stride;
#pragma unroll
                for (int it = 0; it < 64 * CPR / 128; ++it) {
                    const int idx = it * 128 + t128;
                    const int rl = idx / CPR, chk = idx % CPR;
                    const int grow = srow + rl;
                    const uint32_t off = (chk >> 3) * BM * 128 + slice + rl * 128 + (((chk & 7) ^ (rl & 7)) << 4);
                    if (tail && grow < sqv && chk * 8 < p.d)
                        *reinterpret_cast<uint4*>(og + (int64_t)grow * p.o_row_stride + chk * 8) =
                            *reinterpret_cast<const uint4*>(gsO + off);
                }
                if (t128 == 0 && !tail) {
#pragma unroll
                    for (int cb = 0; cb < DBV; ++cb)
                        tma_store_4d(tmo, (SEP_O ? sO : sQ) + cb * BM * 128 + slice, cb * 64, q0 + srow, h, 0);
                    bulk_commit();
                }
                // every thread's 16-byte reads of the staged slice are done (the next tile's staging,
                // or the Q load into the Q buffer, may overwrite it)
                named_sync(BAR_EPI + c, 128);
                if (!SEP_O && t128 == 0) {
                    bulk_wait_read();
                    mbar_arrive(q_empty(0));
                }
                mbar_arrive(sched_empty(slot));
                qs.advance();
                continue;
            }
            fence_proxy_async_smem();
            named_sync(BAR_EPI + c, 128);
            if (t128 == 0) {
                int h, bi;
                head_batch(h, bi);
#pragma unroll
                for (int cb = 0; cb < DBV; ++cb)
                    tma_store_4d(tmo, (SEP_O ? sO : sQ) + cb * BM * 128 + slice, cb * 64, m_block * BM + c * 64, h, bi);
                bulk_commit();
                if (!SEP_O) {
                    bulk_wait_read();  // O was staged in the Q buffer: free it once read
                    mbar_arrive(q_empty(0));
                }
            }
            mbar_arrive(sched_empty(slot));
            qs.advance();
        }
        // the CTA's smem must outlive this thread's last TMA store
        if (t128 == 0) bulk_wait();
    }
};

}  // namespace fc90

// SYMBOL(p, tm_q, tm_k, tm_v, tm_o): see the launch contract above. WARPS must be (BLOCK_M/64 + 1) * 4.
#define FC_SM90_FWD_EX(SYMBOL, T, HEAD_DIM, MASK_ID, BLOCK_M, BLOCK_N, WARPS, STAGES, PINGPONG, CAP, DV, ILV, SPLIT, QS) \
    extern "C" __global__ void __launch_bounds__((WARPS) * 32, 1)                                           \
        SYMBOL(const __grid_constant__ FcParams p, const __grid_constant__ CUtensorMap tm_q,                 \
               const __grid_constant__ CUtensorMap tm_k, const __grid_constant__ CUtensorMap tm_v,           \
               const __grid_constant__ CUtensorMap tm_o) {                                                  \
        static_assert((WARPS) == ((BLOCK_M) / 64 + 1) * 4, "sm90 fwd: WARPS = (BLOCK_M/64 + 1) * 4");       \
        fc90::FwdSm90<T, HEAD_DIM, MASK_ID, BLOCK_M, BLOCK_N, STAGES, PINGPONG, CAP, DV, ILV, SPLIT, QS>::run(p, &tm_q, &tm_k, &tm_v, &tm_o); \
    }                                                                                                          \
    constexpr FcKernelFacts fc_facts_##SYMBOL{                                                                 \
        fc90::fwd_smem_bytes(BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, QS), CAP,                                     \
        fc90::FwdSm90<T, HEAD_DIM, MASK_ID, BLOCK_M, BLOCK_N, STAGES, PINGPONG, CAP, DV, ILV, SPLIT, QS>::PAGED, \
        ILV, SPLIT, DV, QS};
// Ping-pong between consumer warpgroups for head_dim <= 128 (measured faster there), off for 256.
#define FC_SM90_FWD(SYMBOL, T, HEAD_DIM, MASK_ID, BLOCK_M, BLOCK_N, WARPS, STAGES, QS) \
    FC_SM90_FWD_EX(SYMBOL, T, HEAD_DIM, MASK_ID, BLOCK_M, BLOCK_N, WARPS, STAGES, ((HEAD_DIM) <= 128), false, HEAD_DIM, false, false, QS)
// The softcap twin of a kernel (the variant table's `softcap` entries; p.softcap > 0 required).
#define FC_SM90_FWD_CAP(SYMBOL, T, HEAD_DIM, MASK_ID, BLOCK_M, BLOCK_N, WARPS, STAGES, QS) \
    FC_SM90_FWD_EX(SYMBOL, T, HEAD_DIM, MASK_ID, BLOCK_M, BLOCK_N, WARPS, STAGES, ((HEAD_DIM) <= 128), true, HEAD_DIM, false, false, QS)
// The narrow twin of a kernel computing DV < HEAD_DIM columns (the variant table's `narrow`
// entries; head dims p.d <= DV only).
#define FC_SM90_FWD_NARROW(SYMBOL, T, HEAD_DIM, MASK_ID, BLOCK_M, BLOCK_N, WARPS, STAGES, QS, DV) \
    FC_SM90_FWD_EX(SYMBOL, T, HEAD_DIM, MASK_ID, BLOCK_M, BLOCK_N, WARPS, STAGES, ((HEAD_DIM) <= 128), false, DV, false, false, QS)
// The paged twin of a kernel (the variant table's `paged` entries): K/V read from a paged pool
// through the page table, one 5-D box per page or tile (`ILV`); p.page_table set, p.d = HEAD_DIM.
#define FC_SM90_FWD_PG(SYMBOL, T, HEAD_DIM, MASK_ID, BLOCK_M, BLOCK_N, WARPS, STAGES, QS) \
    FC_SM90_FWD_EX(SYMBOL, T, HEAD_DIM, MASK_ID, BLOCK_M, BLOCK_N, WARPS, STAGES, ((HEAD_DIM) <= 128), false, HEAD_DIM, true, false, QS)
// The key-split twin of a kernel (the variant table's `kv_split` entries): launched in clusters of
// p.num_splits CTAs along x, one cluster per query tile (see FwdSm90's SPLIT).
#define FC_SM90_FWD_KVS(SYMBOL, T, HEAD_DIM, MASK_ID, BLOCK_M, BLOCK_N, WARPS, STAGES, QS) \
    FC_SM90_FWD_EX(SYMBOL, T, HEAD_DIM, MASK_ID, BLOCK_M, BLOCK_N, WARPS, STAGES, ((HEAD_DIM) <= 128), false, HEAD_DIM, false, true, QS)
