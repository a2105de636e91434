// The compile-time shape of one sm90 forward kernel (FwdTraits), its shared-memory map
// (FwdSmem) and the small helpers every part uses. The parts (scheduler, producer, mainloop,
// combine, epilogue) take a FwdTraits instantiation and import its names with FC90_TRAITS.
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

// A separate O staging buffer (BM x D) is used when it fits in the 227 KB opt-in limit; it lets the
// next tile's Q load start as soon as the last Q K^T of the current tile has completed.
// `qs`: Q buffers (QS, 1 or 2).
// `vd`: the width of the V ring and the O buffer (d, but for the separate-V kernels).
__host__ __device__ __forceinline__ constexpr bool fwd_sep_o(int bm, int bn, int d, int stages, int qs = 1, int vd = 0) {
    return (uint32_t)(((qs * bm + stages * bn) * d + (stages * bn + bm) * (vd > 0 ? vd : d)) * 2) + 1280u <= 232448u;
}
__host__ __device__ __forceinline__ constexpr uint32_t fwd_smem_bytes(int bm, int bn, int d, int stages, int qs = 1, int vd = 0) {
    return (uint32_t)(((qs * bm + stages * bn) * d +
                       (stages * bn + (fwd_sep_o(bm, bn, d, stages, qs, vd) ? bm : 0)) * (vd > 0 ? vd : d)) * 2) +
           1024u + 256u;
}

// CAP: softcap (p.softcap > 0; the `_cap` twins, FC_SM90_FWD_CAP): each S tile
// becomes t = tanh(S * scale / softcap) right after its Q K^T (fc::Softcap, before the mask),
// and the kept scores' unit is softcap instead of scale (exp2 factor, LSE).
// DK: the head dim of Q and K the kernel computes (D: the full kernel). A narrow twin (DK < D,
// the variant table's `narrow`) keeps the D-wide shared-memory tiles of its kernel but loads,
// multiplies and stores only the first DK columns: Q K^T over DK / 16 k-steps, P V and O DK wide.
// DV, VD: the head dim of V and O the kernel computes (DK unless set) and the width of its V ring
// and O buffer (D unless set). A separate-V kernel (the variant table's `v_width`; DeepSeek's
// d_qk 192, d_v 128) has DK = D and DV = VD < D: V stages of BN x VD, so a wider key tile fits.
// ILV: the paged twin (`_pg`, FC_SM90_FWD_PG; full width only): its K and V stages keep each
// group of 8 key rows with all of its 64-column blocks together, [row group][column block][8
// rows][128 B], where the other kernels keep each column block's BN rows together, [column
// block][BN rows][128 B]. A page's rows over every column block are then one TMA box (a 5-D map
// over the pool: 64 columns, 8 rows, column blocks, head, the pool's row groups), so a tile of
// 16-row pages at d128 takes 8 boxes per K or V instead of 16 (Producer::load_keys); the wgmma
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
template <typename T_, int D_, int MASK_, int BM_, int BN_, int STAGES_, bool PINGPONG_, bool CAP_ = false,
          int DK_ = D_, bool ILV_ = false, bool SPLIT_ = false, int QS_ = 1, int DV_ = DK_, int VD_ = D_>
struct FwdTraits {
    using T = T_;
    static constexpr int D = D_, MASK = MASK_, BM = BM_, BN = BN_, STAGES = STAGES_, DK = DK_, DV = DV_, VD = VD_,
                         QS = QS_;
    static constexpr bool PINGPONG = PINGPONG_, CAP = CAP_, ILV = ILV_, SPLIT = SPLIT_;
    static_assert(D % 64 == 0 && D <= 512, "head_dim: a multiple of 64 up to 512");
    static_assert(DK % 16 == 0 && DK >= 32 && DK <= D, "narrow width: a multiple of 16, 32..D");
    static_assert(DV % 16 == 0 && DV >= 32 && DV <= VD && VD % 64 == 0 && VD <= D, "V width: 32..VD, VD 64..D");
    static_assert(BM % 64 == 0 && BM >= 128 && BM <= 256, "BLOCK_M = 128, 192 or 256");
    static_assert(BN % 16 == 0 && BN <= 256, "BLOCK_N multiple of 16");
    static_assert(MASK >= 0 && MASK <= 2, "sm90 path: mask none, causal or window");
    // MASK 2, a window with a right bound (p.window_right >= 0, the host's rule): the causal
    // machinery runs on the window's right edge (common/mask.cuh's band of a row), and a left
    // bound (p.window_left >= 0) starts each query tile's key walk at its first row's first key
    // tile (TileScheduler::n_first) and masks the tiles a row's bound cuts
    // (docs/decisions.md#sm90-windows).
    static constexpr bool CAUSAL = MASK >= 1;
    static constexpr bool WINDOW = MASK == 2;
    static constexpr int NC = BM / 64;  // consumer warpgroups
    static constexpr int NTHREADS = (NC + 1) * 128;
    static constexpr int DB = D / 64;  // 64-column (128-byte) blocks of the tiles
    static constexpr int DBK = (DK + 63) / 64;  // ... of Q and K loaded
    static constexpr int DBV = (DV + 63) / 64;  // ... of V loaded and O stored
    static constexpr uint32_t Q_BYTES = BM * D * 2;
    static constexpr uint32_t K_BYTES = BN * D * 2;   // a K stage
    static constexpr uint32_t V_BYTES = BN * VD * 2;  // a V stage
    static constexpr uint32_t O_BYTES = BM * VD * 2;  // the O buffer (SEP_O)
    static constexpr bool SEP_O = fwd_sep_o(BM, BN, D, STAGES, QS, VD);
    static_assert(QS == 1 || (QS == 2 && SEP_O), "two Q buffers need the separate O buffer");
    static constexpr uint32_t Q_LOAD = BM * DBK * 128;  // TMA bytes per Q / K / V tile
    static constexpr uint32_t K_LOAD = BN * DBK * 128;
    static constexpr uint32_t V_LOAD = BN * DBV * 128;
    // K/V stage strides in bytes: between 64-column blocks, and between groups of 8 key rows
    static constexpr uint32_t KV_CB = ILV ? 1024u : BN * 128u;
    static constexpr uint32_t KV_RG = ILV ? DB * 1024u : 1024u;
    static constexpr uint32_t TILE_BYTES = QS * Q_BYTES + STAGES * (K_BYTES + V_BYTES) + (SEP_O ? O_BYTES : 0);
    static_assert(TILE_BYTES + 1280 <= 232448, "shared memory over the 227 KB limit");
    // setmaxnreg split. setmaxnreg.inc blocks until the CTA's register pool (what the launch
    // allocated: NTHREADS x the per-thread budget of __launch_bounds__(NTHREADS, 1), a multiple
    // of 8) has the registers, so the split must fit that pool, not the SM's 64K: with four
    // consumer warpgroups the pool is 640 x 96, and 112 / 56 hung
    // (decisions.md#sm90-register-split).
    // Causal tiles are unequal: dynamic schedule (p.tile_counter) for d64/d128, for d256 with
    // 64-key tiles (`sm90_d256_short`; the 80-key tile spills at 232 consumer registers) and for
    // the separate-V kernels (O as narrow as d128's). No mask: static (any grid). Host side:
    // src/plan/choose.rs `sm90_dynamic`.
    static constexpr bool DYN = CAUSAL && (D <= 128 || BN == 64 || VD < D);
    // d64, and d256 on the dynamic schedule, with two consumer warpgroups: the producer (TMA thread
    // + tile scheduler) spills at 24 registers, 40 then, and 232 for the consumers.
    // The dynamic schedule's threads carry each tile's sequence range (varlen):
    // at 24 registers the d128 causal producer spilled 32 B, so every DYN kernel takes 40.
    static constexpr bool PROD40 = D == 64 || DYN;
    static constexpr int PROD_REGS = NC == 2 ? (PROD40 ? 40 : 24) : 32;
    static constexpr int CONS_REGS = NC == 2 ? (PROD40 ? 232 : 240) : NC == 3 ? 160 : 112;
    static_assert((NC * CONS_REGS + PROD_REGS) * 128 <= (65536 / NTHREADS) / 8 * 8 * NTHREADS,
                  "setmaxnreg split over the CTA's register pool (the consumers' inc would hang)");
    // Paged K/V read through the page table (Producer::load_keys): every kernel but the dynamic-schedule
    // ones with three consumer warpgroups (d64 causal 192x128), whose 32-register producer spills
    // 44 B with the page walk, and the four-warpgroup tiles (d64 256x64), whose 32-register
    // producer spilled 4 B with the TMA warp's per-lane boxes; the host gathers for those
    // (`Variant::page_box`, kernels/variants.rs).
    static constexpr bool PAGED = !(NC == 3 && DYN) && NC != 4;
    static_assert(!ILV || (PAGED && DK == D && DV == D && VD == D && BN % 16 == 0),
                  "paged twin: a paged, full-width kernel");
    static constexpr int BAR_SCHED = 1;            // named barriers 1..NC: ping-pong
    static constexpr int BAR_EPI = 1 + NC;         // named barriers NC+1..2NC: per-WG epilogue
    static constexpr int BAR_SPLIT = 1 + 2 * NC;   // the consumers of a key-split rank > 0
    // A key-split rank's exchange region per consumer warpgroup: per thread its DV / 2 O values
    // and (reference max in log2 units, partial row sum) x 2 rows, as float4 [DV / 8 + 1][128].
    static constexpr uint32_t X_BYTES = (DV / 8 + 1) * 128 * 16;
    static_assert(!SPLIT || (NC == 2 && SEP_O && !ILV && NC * X_BYTES <= STAGES * (K_BYTES + V_BYTES)),
                  "key-split twin: two consumer warpgroups, an O buffer, the exchange inside the K/V ring");
    static constexpr bool BF = fc::Elem<T>::bf16;
    // Lazy rescale: a row keeps its reference max m until the true max exceeds it by more than
    // RESCALE_LOG2 in exp2 units (P <= 2^8 = 256 then: exact in f32, the same relative rounding in
    // bf16/fp16, and O, l and the LSE all use the same reference). O is rescaled only when some
    // row of the warp moved its reference (a warp vote), not after every key tile: +2.2 % over the
    // fa3 grid (H100, docs/decisions.md#lazy-rescale).
    static constexpr float RESCALE_LOG2 = 8.f;  // = fc::LAZY_RESCALE_LOG2
    // Fast softmax (no row max, see Mainloop::softmax_gen) on the key tiles after the first ones: no mask
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
    // `Mainloop::skip_first`): the causal tiles without SPV whose key tiles span the first
    // warpgroup's rows (BM - 64 <= BN: one tile to pass over at most). The d512 tiles (BN 32)
    // run the masked tiles of their first warpgroup instead.
    static constexpr bool SKIP1 = CAUSAL && !SPV && BM - 64 <= BN;
    using QK = Wgmma<BN, BF>;
    using PV = Wgmma<DV, BF>;
};

// A part's view of its kernel: the FwdTraits names, unqualified.
#define FC90_TRAITS(TR)                                                                             \
    using T = typename TR::T;                                                                        \
    static constexpr int D = TR::D, MASK = TR::MASK, BM = TR::BM, BN = TR::BN, STAGES = TR::STAGES,  \
                         DK = TR::DK, DV = TR::DV, VD = TR::VD, QS = TR::QS, NC = TR::NC, DB = TR::DB, \
                         DBK = TR::DBK, DBV = TR::DBV;                                               \
    static constexpr bool PINGPONG = TR::PINGPONG, CAP = TR::CAP, ILV = TR::ILV, SPLIT = TR::SPLIT,  \
                          CAUSAL = TR::CAUSAL, WINDOW = TR::WINDOW, SEP_O = TR::SEP_O,              \
                          DYN = TR::DYN, PAGED = TR::PAGED, BF = TR::BF, FAST = TR::FAST,            \
                          SPV = TR::SPV, CAUSAL_SHORT = TR::CAUSAL_SHORT, SKIP1 = TR::SKIP1;         \
    static constexpr uint32_t Q_BYTES = TR::Q_BYTES, K_BYTES = TR::K_BYTES, V_BYTES = TR::V_BYTES,   \
                              O_BYTES = TR::O_BYTES, Q_LOAD = TR::Q_LOAD, K_LOAD = TR::K_LOAD,       \
                              V_LOAD = TR::V_LOAD, KV_CB = TR::KV_CB, KV_RG = TR::KV_RG,             \
                              X_BYTES = TR::X_BYTES;                                                 \
    static constexpr int BAR_SCHED = TR::BAR_SCHED, BAR_EPI = TR::BAR_EPI, BAR_SPLIT = TR::BAR_SPLIT; \
    static constexpr float RESCALE_LOG2 = TR::RESCALE_LOG2;                                          \
    using QK = typename TR::QK;                                                                      \
    using PV = typename TR::PV

// Shared memory, from the 1 KB-aligned base: QS Q buffers, the K ring, the V ring (STAGES stages
// each), the O staging buffer (SEP_O only; else O is staged in the Q buffer), then 256 bytes of
// mbarriers and the tile ring's slots. Every address is a shared-window u32.
template <class Tr>
struct FwdSmem {
    FC90_TRAITS(Tr);
    uint32_t raw, sQ, sK, sV, sO, bars;
    __device__ __forceinline__ explicit FwdSmem(uint32_t raw_)
        : raw(raw_),
          sQ((raw_ + 1023u) & ~1023u),
          sK(sQ + QS * Q_BYTES),
          sV(sK + STAGES * K_BYTES),
          sO(sV + STAGES * V_BYTES),
          bars(sO + (SEP_O ? O_BYTES : 0)) {}
    __device__ __forceinline__ uint32_t full_k(int s) const { return bars + 16u + 8u * s; }
    __device__ __forceinline__ uint32_t full_v(int s) const { return bars + 16u + 8u * (STAGES + s); }
    __device__ __forceinline__ uint32_t empty_k(int s) const { return bars + 16u + 8u * (2 * STAGES + s); }
    __device__ __forceinline__ uint32_t empty_v(int s) const { return bars + 16u + 8u * (3 * STAGES + s); }
    // The 2-slot ring of decoded tiles (m_block -1 = stop; TileScheduler::publish): the thread
    // that owns the schedule -> the TMA thread (dynamic) and the consumers.
    __device__ __forceinline__ uint32_t sched_full(int s) const { return bars + 16u + 8u * (4 * STAGES + s); }
    __device__ __forceinline__ uint32_t sched_empty(int s) const { return bars + 16u + 8u * (4 * STAGES + 2 + s); }
    // slot words: m_block, h, bi, k0 (paged: sk), n_max, sq, sk, q0 (TileSlot)
    __device__ __forceinline__ uint32_t sched_val(int s) const { return bars + 16u + 8u * (4 * STAGES + 4) + 32u * s; }
    // Key split (SPLIT): rank 0's x_ready (the other ranks' partials are in their rings), the
    // other ranks' x_done (rank 0 has read them).
    __device__ __forceinline__ uint32_t x_ready() const { return bars + 16u + 8u * (4 * STAGES + 4) + 64u; }
    __device__ __forceinline__ uint32_t x_done() const { return x_ready() + 8u; }
    // Q buffer b: loaded (bar_q) and free again (q_empty); the second buffer's pair after x_done.
    __device__ __forceinline__ uint32_t bar_q(int b) const { return b == 0 ? bars : x_done() + 8u; }
    __device__ __forceinline__ uint32_t q_empty(int b) const { return b == 0 ? bars + 8u : x_done() + 16u; }
    static_assert(16 + 8 * (4 * STAGES + 4) + 64 + 16 + 16 * (QS - 1) <= 256, "barrier area");

    // Thread 0, before the CTA's first __syncthreads (`splits`: the key split's cluster size).
    __device__ __forceinline__ void init_barriers(int splits) const {
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
            mbar_init(x_ready(), (splits - 1) * NC * 128);  // every consumer thread of the others
            mbar_init(x_done(), NC * 128);                  // every consumer thread of rank 0
        }
        fence_barrier_init();
    }
};

}  // namespace fc90
