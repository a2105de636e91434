// The producer warpgroup of the sm90 forward kernel (warpgroup 0, setmaxnreg.dec): warp 0 is the
// TMA warp, which loads each tile's Q once and streams its K and V tiles through the STAGES-deep
// rings (full / empty mbarriers), from the last key tile down to the first; on the dynamic
// schedule lane 0 of warp 1 runs the tile scheduler (TileScheduler::run_dynamic). The other
// producer threads return at once.
#pragma once
#include "scheduler.cuh"

namespace fc90 {

template <class Tr>
struct Producer {
    FC90_TRAITS(Tr);
    // A tile as the TMA warp loads it: query tile, head, batch, K/V head, first key row (paged:
    // the key count, see load_keys), first packed query row, TMA batch coordinates of Q and K/V.
    struct Tile {
        int m_block, h, bi, hk, k0, q0, bq, bk;
    };

    // One tile's loads: Q, then its key tiles [lo, hi) from hi - 1 down, K one tile ahead of V.
    // Every lane of the TMA warp runs this and waits on the barriers; lane 0 (`lead`) arrives and
    // issues the Q and dense K/V loads. A paged tile's boxes are issued by one lane each, every
    // lane reading its own page id, so the tile costs one page-table read latency, not one per
    // box.
    __device__ static __forceinline__ void load_keys(const FcParams& p, const FwdSmem<Tr>& sm, const CUtensorMap* tmq,
                                                     const CUtensorMap* tmk, const CUtensorMap* tmv, int lane,
                                                     bool lead, const Tile& t, int lo, int hi, PipeState<STAGES>& ks,
                                                     PipeState<STAGES>& vs, PipeState<QS>& qs) {
        const int m_block = t.m_block, h = t.h, bi = t.bi, hk = t.hk, k0 = t.k0, q0 = t.q0, bq = t.bq, bk = t.bk;
        // Key tile n of K or V into `dst`. Paged pools (p.page_table; page size 2^page_shift >=
        // 16; the host maps the pools as (d, page_size, hkv, pages) with boxes of min(page_size,
        // the largest power of two dividing BN) rows): lane j loads box j of the tile, inside one
        // page, its id read by that lane through fc::page_id (clamped into the pool). A box past
        // the sequence's last key (k0 holds the key count here) reloads the box holding it, as the
        // barrier expects the whole tile: those keys are masked and the consumers zero their V
        // rows. The paged twin (ILV; always paged) loads box j's rows over every column block
        // with one 5-D box at row group (page * page_size + slot) / 8 of the pool.
        // `blocks`: the tile's 64-column blocks in use (DBK for K, DBV for V).
        auto load_tile = [&](uint32_t dst, const CUtensorMap* tm, uint32_t bar, int n, int blocks) {
            if (ILV || (PAGED && p.page_table != nullptr)) {
                const int sh = p.page_shift;
                const int pb = min(1 << sh, BN & -BN);
                const int r = lane * pb;
                if (r < BN) {
                    const int key = min(n * BN + r, (k0 - 1) & -pb);
                    const int page = fc::page_id(p, bi, key >> sh, [&p, sh] { return (p.total_k >> sh) - 1; });
                    if (ILV) {
                        tma_load_5d(dst + r * DB * 128, tm, bar, 0, 0, 0, hk,
                                    (page << (sh - 3)) + ((key & ((1 << sh) - 1)) >> 3), kEvictLast);
                    } else {
#pragma unroll
                        for (int c = 0; c < blocks; ++c)
                            tma_load_4d(dst + c * BN * 128 + r * 128, tm, bar, c * 64,
                                        key & ((1 << sh) - 1), hk, page, kEvictLast);
                    }
                }
            } else if (lead) {
#pragma unroll
                for (int c = 0; c < blocks; ++c)
                    tma_load_4d(dst + c * BN * 128, tm, bar, c * 64, k0 + n * BN, hk, bk, kEvictLast);
            }
        };
        // (lane 0's expect_tx may follow other lanes' completed boxes: the tx count goes
        // negative meanwhile, and the phase cannot end before lane 0 arrives)
        auto load_k = [&](int n) {
            mbar_wait(sm.empty_k(ks.stage), ks.phase ^ 1);
            if (lead) mbar_arrive_expect_tx(sm.full_k(ks.stage), K_LOAD);
            load_tile(sm.sK + ks.stage * K_BYTES, tmk, sm.full_k(ks.stage), n, DBK);
            ks.advance();
        };
        auto load_v = [&](int n) {
            mbar_wait(sm.empty_v(vs.stage), vs.phase ^ 1);
            if (lead) mbar_arrive_expect_tx(sm.full_v(vs.stage), V_LOAD);
            load_tile(sm.sV + vs.stage * V_BYTES, tmv, sm.full_v(vs.stage), n, DBV);
            vs.advance();
        };
        // The Q buffer is free once both consumer warpgroups are past the last Q K^T of its
        // previous tile (with a separate O buffer; else past the epilogue).
        auto load_q = [&]() {
            const int qb = qs.stage;
            mbar_wait(sm.q_empty(qb), qs.phase ^ 1);
            if (lead) {
                mbar_arrive_expect_tx(sm.bar_q(qb), Q_LOAD);
#pragma unroll
                for (int c = 0; c < DBK; ++c)
                    tma_load_4d(sm.sQ + qb * Q_BYTES + c * BM * 128, tmq, sm.bar_q(qb), c * 64,
                                q0 + m_block * BM, h, bq, kEvictFirst);
            }
            qs.advance();
        };
        // Two Q buffers: Q first (its buffer's previous tile is long done), then the first K tile.
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

    // The TMA warp's loop over its tiles: from the ring on the dynamic schedule, else decoded
    // here (the static schedule) and published to the consumers.
    __device__ static __forceinline__ void tma_warp(const FcParams& p, const FwdSmem<Tr>& sm,
                                                    const TileScheduler<Tr>& sched, const CUtensorMap* tmq,
                                                    const CUtensorMap* tmk, const CUtensorMap* tmv, int tid,
                                                    PipeState<2>& ss) {
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
            Tile t;
            int n_max, tsq = 0, tsk = 0;
            if (DYN) {
                const int slot = ss.stage;
                mbar_wait(sm.sched_full(slot), ss.phase);
                const uint32_t a = sm.sched_val(slot);
                t.m_block = (int)fc::ld_shared_b32(a);
                t.h = (int)fc::ld_shared_b32(a + 4u);
                t.bi = (int)fc::ld_shared_b32(a + 8u);
                t.k0 = (int)fc::ld_shared_b32(a + 12u);
                n_max = (int)fc::ld_shared_b32(a + 16u);
                if (WINDOW) {
                    tsq = (int)fc::ld_shared_b32(a + 20u);
                    tsk = (int)fc::ld_shared_b32(a + 24u);
                }
                t.q0 = (int)fc::ld_shared_b32(a + 28u);
                __syncwarp();  // every lane has read the slot
                if (lead) mbar_arrive(sm.sched_empty(slot));
                ss.advance();
                if (t.m_block < 0) break;
            } else {
                if (k * sched.nctas >= sched.total) break;
                const int lin = sched.static_tile(k);
                if (lin >= sched.total) continue;
                sched.decode_tile(lin, t.m_block, t.h, t.bi);
                const fc::SeqRange sr = fc::seq_range(p, t.bi);
                if (t.m_block * BM >= sr.sq) continue;  // past a shorter sequence (varlen)
                sched.publish(ss, tid, t.m_block, t.h, t.bi, sr);
                n_max = TileScheduler<Tr>::n_tiles(p, sr, t.m_block);
                tsq = sr.sq;
                tsk = sr.sk;
                t.k0 = p.page_table != nullptr ? sr.sk : sr.k0;
                t.q0 = sr.q0;
            }
            t.hk = t.h / p.h_ratio;
            // TMA batch coordinates: the packed varlen maps have one batch entry
            t.bq = p.cu_seqlens_q != nullptr ? 0 : t.bi;
            t.bk = p.cu_seqlens_k != nullptr ? 0 : t.bi;
            if (n_max <= 0) continue;
            int lo, hi;
            sched.key_range(TileScheduler<Tr>::n_first(p, t.m_block, tsq, tsk), n_max, lo, hi);
            load_keys(p, sm, tmq, tmk, tmv, lane, lead, t, lo, hi, ks, vs, qs);
        }
        if (!DYN) sched.publish(ss, tid, -1, 0, 0, fc::SeqRange{0, 0, 0, 0});
    }

    __device__ static __forceinline__ void run(const FcParams& p, const FwdSmem<Tr>& sm, const TileScheduler<Tr>& sched,
                                               const CUtensorMap* tmq, const CUtensorMap* tmk, const CUtensorMap* tmv,
                                               int tid) {
        reg_dealloc<Tr::PROD_REGS>();
        PipeState<2> ss;  // tile-ring position (the scheduler thread's, or the TMA warp's)
        if (DYN && tid == 32) sched.run_dynamic(ss, tid);
        if (tid < 32) tma_warp(p, sm, sched, tmq, tmk, tmv, tid, ss);
    }
};

}  // namespace fc90
