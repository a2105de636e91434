// flashcore sm_90a forward attention: FA3-style warp specialization (own code). This file is the
// kernel body and its launch contract; the parts it composes live beside it:
//
//   traits.cuh     FwdTraits (the compile-time shape: tile sizes, twins, register split, the
//                  tuning switches with their measurements), FwdSmem (shared-memory map and
//                  mbarriers), fwd_smem_bytes (host and device)
//   scheduler.cuh  TileScheduler: static and dynamic tile schedules, the key tiles of a query
//                  tile, the key split's chunks, the tile ring (TileSlot) to the other warps
//   producer.cuh   Producer: warpgroup 0; the TMA warp loads Q once per tile and streams K / V
//                  through STAGES-deep full / empty mbarrier rings; the scheduler thread
//   mainloop.cuh   Mainloop: a consumer warpgroup's key loop (Q K^T and P V wgmma, mask, score
//                  modifiers, online softmax with lazy rescale, ping-pong)
//   combine.cuh    KeySplit: the key-split ranks' partials merged into rank 0 through DSMEM
//   epilogue.cuh   Epilogue: 1/l, sinks, LSE, O staged in smem and stored by TMA or 16-byte stores
//
// CTA = 1 producer warpgroup + BLOCK_M/64 consumer warpgroups, each owning 64 query rows.
// Persistent tile loop (any grid size, see below): per tile the consumers run the mainloop, the
// key split's gather (SPLIT) and the epilogue, then hand the tile's ring slot back.
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
//   columns beyond it and the O store clips them. V and O have their own head dim p.dv (<= the
//   kernel's V width: HEAD_DIM, a narrow twin's DV, a FC_SM90_FWD_SEPV kernel's DV): the v and o
//   maps' globalDim d = p.dv, zero-filled and clipped alike.
//   Varlen (p.cu_seqlens_q/k set, fc::seq_range): q/o maps over the packed (d, total_q, hq, 1)
//   rows and k/v over (d, total_k, hkv, 1), batch coordinate 0; tiles past a shorter sequence are
//   skipped by the scheduler; key rows past the sequence's end that a box reads are masked; O
//   leaves through 16-byte stores of the sequence's rows (a TMA box would write the next one's).
//   Paged K/V (p.page_table set, p.seqused_k the lengths, page_size = 2^p.page_shift >= 16): k/v
//   maps over the pools as (d, page_size, hkv, num_pages) with boxDim { 64, min(page_size,
//   BLOCK_N & -BLOCK_N), 1, 1 } (a box starts 2 KB-aligned in its stage): the TMA thread loads
//   each key tile box by box through the page table (Producer::load_keys). The paged twins (ILV,
//   FC_SM90_FWD_PG: paged problems only, p.d = HEAD_DIM, pages stored whole, 2^page_shift >= 16)
//   take k/v maps of rank 5 over the pools instead: globalDim { 64, 8, HEAD_DIM / 64, hkv,
//   num_pages * page_size / 8 }, globalStrides { row_stride*2, 128, head_stride*2,
//   8*row_stride*2 } bytes, boxDim { 64, 8, HEAD_DIM / 64, 1, min(page_size, BLOCK_N &
//   -BLOCK_N) / 8 } (one box per page or tile over every column; src/cuda/tma.rs encode_pool).
// ---------------------------------------------------------------------------------------------
#pragma once
#include "traits.cuh"
#include "scheduler.cuh"
#include "producer.cuh"
#include "mainloop.cuh"
#include "combine.cuh"
#include "epilogue.cuh"

namespace fc90 {

template <typename T, int D, int MASK, int BM, int BN, int STAGES, bool PINGPONG, bool CAP = false,
          int DK = D, bool ILV = false, bool SPLIT = false, int QS = 1, int DV = DK, int VD = D>
struct FwdSm90 : FwdTraits<T, D, MASK, BM, BN, STAGES, PINGPONG, CAP, DK, ILV, SPLIT, QS, DV, VD> {
    using Tr = FwdTraits<T, D, MASK, BM, BN, STAGES, PINGPONG, CAP, DK, ILV, SPLIT, QS, DV, VD>;

    // The consumer warpgroups' loop over the tiles of the ring: the key loop, the key split's
    // gather, the epilogue; each tile's slot is handed back once its epilogue no longer reads it.
    __device__ static __forceinline__ void consume(const FcParams& p, const FwdSmem<Tr>& sm,
                                                   const TileScheduler<Tr>& sched, const CUtensorMap* tmo,
                                                   uint8_t* smem_raw, int tid, int wg) {
        reg_alloc<Tr::CONS_REGS>();
        float o[Tr::DV / 2];
        float s[Tr::BN / 2];
        uint32_t pa[Tr::BN / 16][4];
        float m_r[2], l_r[2], alpha[2];
        Accum<Tr> acc{o, s, pa, m_r, l_r, alpha};
        Mainloop<Tr> ml(p, sm, sched, wg, tid, acc);
        PipeState<2> ss;       // the tile ring
        PipeState<Tr::QS> qs;  // the Q buffers
        uint32_t xi = 0;       // key split: exchanges done
        KeySplit<Tr> split(sm, sched, xi);
        const Epilogue<Tr> epi(p, sm, tmo, smem_raw);
        for (;;) {
            const int slot = ss.stage;
            mbar_wait(sm.sched_full(slot), ss.phase);
            // The slot stays ours until the tile is done (arrive at the end).
            const TileSlot<Tr> tile{sm, slot};
            const int m_block = tile.m_block();
            ss.advance();
            if (m_block < 0) break;
            const int n_max = tile.n_max();
            ml.set_tile(tile, m_block);
            if (n_max <= 0) {
                epi.empty_tile(ml);
                mbar_arrive(sm.sched_empty(slot));
                continue;
            }
            const bool discard = ml.run_tile(n_max, qs.stage, qs.phase, smem_raw);
            if (Tr::SPLIT && sched.splits > 1) {  // key split: gather the partials into rank 0
                const uint32_t xs = split.exchange(ml);
                split.drop(ml, discard);
                if (sched.rank > 0) {
                    split.give(ml, xs);
                    mbar_arrive(sm.sched_empty(slot));
                    qs.advance();
                    continue;
                }
                split.take(ml, xs);
            }
            const int sqv = epi.finish(ml);
            if (p.cu_seqlens_q != nullptr) {
                epi.store_varlen(ml, sqv);
                mbar_arrive(sm.sched_empty(slot));
                qs.advance();
                continue;
            }
            epi.store_dense(ml);
            mbar_arrive(sm.sched_empty(slot));
            qs.advance();
        }
        // the CTA's smem must outlive this thread's last TMA store
        if (ml.t128 == 0) bulk_wait();
    }

    __device__ static __forceinline__ void run(const FcParams& p, const CUtensorMap* tmq, const CUtensorMap* tmk,
                                               const CUtensorMap* tmv, const CUtensorMap* tmo) {
        extern __shared__ uint8_t smem_raw[];
        const FwdSmem<Tr> sm(fc::smem_addr(smem_raw));
        const TileScheduler<Tr> sched(p, sm);
        const int tid = threadIdx.x;
        const int wg = tid / 128;
        if (tid == 0) sm.init_barriers(sched.splits);
        __syncthreads();
        // the barriers of every CTA of the cluster are initialised before any remote arrival
        if (Tr::SPLIT && sched.splits > 1) cluster_sync();
        // The paged twins: the host's table check (fc_check_seqlens, a programmatic dependent)
        // may be scheduled now; it reads the tables on an SM this grid has left and waits for the
        // grid before writing, so it no longer adds its launch after the kernel.
        if (Tr::ILV) fc::pdl_launch_dependents<true>();
        if (wg == 0) {
            Producer<Tr>::run(p, sm, sched, tmq, tmk, tmv, tid);
            return;
        }
        consume(p, sm, sched, tmo, smem_raw, tid, wg);
    }
};

}  // namespace fc90

// SYMBOL(p, tm_q, tm_k, tm_v, tm_o): see the launch contract above. WARPS must be (BLOCK_M/64 + 1) * 4.
// DK: the Q/K width computed; DV, VD: the V/O width computed and the V ring's (FwdTraits).
#define FC_SM90_FWD_EX(SYMBOL, T, HEAD_DIM, MASK_ID, BLOCK_M, BLOCK_N, WARPS, STAGES, PINGPONG, CAP, DK, ILV, SPLIT, QS, DV, VD) \
    extern "C" __global__ void __launch_bounds__((WARPS) * 32, 1)                                           \
        SYMBOL(const __grid_constant__ FcParams p, const __grid_constant__ CUtensorMap tm_q,                 \
               const __grid_constant__ CUtensorMap tm_k, const __grid_constant__ CUtensorMap tm_v,           \
               const __grid_constant__ CUtensorMap tm_o) {                                                  \
        static_assert((WARPS) == ((BLOCK_M) / 64 + 1) * 4, "sm90 fwd: WARPS = (BLOCK_M/64 + 1) * 4");       \
        fc90::FwdSm90<T, HEAD_DIM, MASK_ID, BLOCK_M, BLOCK_N, STAGES, PINGPONG, CAP, DK, ILV, SPLIT, QS, DV, VD>::run(p, &tm_q, &tm_k, &tm_v, &tm_o); \
    }                                                                                                          \
    constexpr FcKernelFacts fc_facts_##SYMBOL{                                                                 \
        fc90::fwd_smem_bytes(BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, QS, VD), CAP,                                 \
        fc90::FwdSm90<T, HEAD_DIM, MASK_ID, BLOCK_M, BLOCK_N, STAGES, PINGPONG, CAP, DK, ILV, SPLIT, QS, DV, VD>::PAGED, \
        ILV, SPLIT, DK, QS, DV};
// Ping-pong between consumer warpgroups for head_dim <= 128 (measured faster there), off for 256.
#define FC_SM90_FWD(SYMBOL, T, HEAD_DIM, MASK_ID, BLOCK_M, BLOCK_N, WARPS, STAGES, QS) \
    FC_SM90_FWD_EX(SYMBOL, T, HEAD_DIM, MASK_ID, BLOCK_M, BLOCK_N, WARPS, STAGES, ((HEAD_DIM) <= 128), false, HEAD_DIM, false, false, QS, HEAD_DIM, HEAD_DIM)
// The softcap twin of a kernel (the variant table's `softcap` entries; p.softcap > 0 required).
#define FC_SM90_FWD_CAP(SYMBOL, T, HEAD_DIM, MASK_ID, BLOCK_M, BLOCK_N, WARPS, STAGES, QS) \
    FC_SM90_FWD_EX(SYMBOL, T, HEAD_DIM, MASK_ID, BLOCK_M, BLOCK_N, WARPS, STAGES, ((HEAD_DIM) <= 128), true, HEAD_DIM, false, false, QS, HEAD_DIM, HEAD_DIM)
// The narrow twin of a kernel computing DV < HEAD_DIM columns (the variant table's `narrow`
// entries; head dims p.d <= DV only).
#define FC_SM90_FWD_NARROW(SYMBOL, T, HEAD_DIM, MASK_ID, BLOCK_M, BLOCK_N, WARPS, STAGES, QS, DV) \
    FC_SM90_FWD_EX(SYMBOL, T, HEAD_DIM, MASK_ID, BLOCK_M, BLOCK_N, WARPS, STAGES, ((HEAD_DIM) <= 128), false, DV, false, false, QS, DV, HEAD_DIM)
// The separate-V kernel (the variant table's `v_width` entries): Q and K HEAD_DIM wide, V and O
// DV wide (a multiple of 64 below HEAD_DIM), with a V ring and O buffer of that width; problems
// with p.d <= HEAD_DIM and p.dv <= DV.
#define FC_SM90_FWD_SEPV(SYMBOL, T, HEAD_DIM, MASK_ID, BLOCK_M, BLOCK_N, WARPS, STAGES, QS, DV) \
    FC_SM90_FWD_EX(SYMBOL, T, HEAD_DIM, MASK_ID, BLOCK_M, BLOCK_N, WARPS, STAGES, ((HEAD_DIM) <= 128), false, HEAD_DIM, false, false, QS, DV, DV)
// The paged twin of a kernel (the variant table's `paged` entries): K/V read from a paged pool
// through the page table, one 5-D box per page or tile (`ILV`); p.page_table set, p.d = HEAD_DIM.
#define FC_SM90_FWD_PG(SYMBOL, T, HEAD_DIM, MASK_ID, BLOCK_M, BLOCK_N, WARPS, STAGES, QS) \
    FC_SM90_FWD_EX(SYMBOL, T, HEAD_DIM, MASK_ID, BLOCK_M, BLOCK_N, WARPS, STAGES, ((HEAD_DIM) <= 128), false, HEAD_DIM, true, false, QS, HEAD_DIM, HEAD_DIM)
// The key-split twin of a kernel (the variant table's `kv_split` entries): launched in clusters of
// p.num_splits CTAs along x, one cluster per query tile (see FwdSm90's SPLIT).
#define FC_SM90_FWD_KVS(SYMBOL, T, HEAD_DIM, MASK_ID, BLOCK_M, BLOCK_N, WARPS, STAGES, QS) \
    FC_SM90_FWD_EX(SYMBOL, T, HEAD_DIM, MASK_ID, BLOCK_M, BLOCK_N, WARPS, STAGES, ((HEAD_DIM) <= 128), false, HEAD_DIM, false, true, QS, HEAD_DIM, HEAD_DIM)
