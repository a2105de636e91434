// Tile schedules of the sm90 forward kernel: which query tile (m_block, head, batch) a CTA works
// on next, the key tiles each query tile walks, and the smem ring (FwdSmem::sched_*) through which
// the thread that owns the schedule hands decoded tiles to the TMA warp and the consumers.
//
// Static schedule (no tile counter, every non-DYN kernel): CTA `cta` takes the tiles
// k * nctas + (k odd ? nctas - 1 - cta : cta), k = 0, 1, ...; its TMA warp decodes them and
// publishes each to the consumers. Dynamic schedule (DYN kernels): a scheduler thread (warp 1 of
// the producer warpgroup) starts with tile `cta`, then draws nctas + atomicAdd(counter) while a
// ring slot is free, and publishes to the TMA warp and the consumers alike. A key-split cluster
// takes its tiles as one CTA would; `rank` picks its chunk of the keys.
#pragma once
#include "traits.cuh"

namespace fc90 {

// A published tile, read back from its ring slot. The consumers hold the slot until the tile is
// done, so they re-read the words where needed instead of keeping them in registers across the
// key loop (held there, d128 causal spilled 32 B).
template <class Tr>
struct TileSlot {
    FwdSmem<Tr> sm;
    int slot;
    __device__ __forceinline__ uint32_t word(uint32_t off) const { return fc::ld_shared_b32(sm.sched_val(slot) + off); }
    __device__ __forceinline__ int m_block() const { return (int)fc::ld_shared_b32(sm.sched_val(slot)); }
    __device__ __forceinline__ void head_batch(int& h, int& bi) const {
        h = (int)word(4u);
        bi = (int)word(8u);
    }
    __device__ __forceinline__ int n_max() const { return (int)word(16u); }
    // the tile's sequence: its query rows and keys (dense: p.sq, p.sk) and first packed row
    __device__ __forceinline__ int sq() const { return (int)word(20u); }
    __device__ __forceinline__ int sk() const { return (int)word(24u); }
    __device__ __forceinline__ int q0() const { return (int)word(28u); }
};

template <class Tr>
struct TileScheduler {
    FC90_TRAITS(Tr);
    const FcParams& p;
    const FwdSmem<Tr> sm;
    int num_m;   // query tiles per (head, batch)
    int total;   // query tiles of the launch
    int splits;  // key-split cluster size (1 without SPLIT)
    int rank;    // this CTA's chunk of the keys
    int nctas;   // CTAs (clusters) of the grid
    int cta;     // this CTA's (cluster's) linear id

    __device__ __forceinline__ TileScheduler(const FcParams& p_, const FwdSmem<Tr>& sm_)
        : p(p_),
          sm(sm_),
          num_m((p_.sq + BM - 1) / BM),
          total(num_m * p_.hq * p_.b),
          splits(SPLIT ? max(p_.num_splits, 1) : 1),
          rank(SPLIT ? (int)blockIdx.x % splits : 0),
          nctas(gridDim.x * gridDim.y * gridDim.z / splits),
          cta((blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z)) / splits) {}

    // Dynamic schedule: the next tile from p.tile_counter, or total when none is left. Draws are
    // handed out in order and every CTA stops at its first draw past the tiles, so the draw of
    // value total - 1 is the launch's last: it puts the counter back to zero for the next launch
    // on the stream (one counter per stream, never re-zeroed by the host).
    __device__ __forceinline__ int next_tile() const {
        const unsigned v = atomicAdd(reinterpret_cast<unsigned*>(p.tile_counter), 1u);
        if (v == (unsigned)(total - 1)) atomicExch(p.tile_counter, 0);
        return v < (unsigned)(total - nctas) ? nctas + (int)v : total;
    }
    // The static schedule's tile of round k (may be >= total in the last round).
    __device__ __forceinline__ int static_tile(int k) const { return k * nctas + ((k & 1) ? nctas - 1 - cta : cta); }
    // Tile lin (0 <= lin < num_m * hq * b) -> (m_block, h, bi). Non-causal: m fastest (CTAs in flight
    // share K/V). Causal: longest query tiles first within groups of G (batch, head) pairs whose K and V
    // fit in ~24 MB of L2; a smaller remainder group goes first so the last group is a full one. The
    // h_ratio query heads of a K/V head are adjacent and share its K/V, so a group holds h_ratio times
    // as many query heads as K/V heads fit (as FA3's LPT scheduler): LLaMA-3-8B prefill (32/8 heads,
    // causal) took 3 groups at 4k instead of 1, +5 % at 4k and +9 % at 2k (H100;
    // docs/decisions.md#l2-group-budget).
    __device__ __forceinline__ void decode_tile(int lin, int& m_block, int& h, int& bi) const {
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

    // ---- the key tiles of a query tile ----
    // The key tiles [n_min, n_max) some row of query tile m_block sees: fc::key_tile_range over
    // its BM rows (MASK 2: a window, right bound p.window_right >= 0 by the host's rule). Empty
    // when n_max <= 0 (rows that see no key); the callers need one bound each, and the other's
    // arithmetic folds away.
    __device__ static __forceinline__ void key_tiles(const FcParams& p, int m_block, int sq, int sk, int& n_min,
                                                     int& n_max) {
        fc::key_tile_range<MASK, BN>(m_block * BM, m_block * BM + BM - 1, sq, sk, p.window_left, p.window_right, n_min,
                                     n_max);
    }
    __device__ static __forceinline__ int n_first(const FcParams& p, int m_block, int sq, int sk) {
        int n_min, n_max;
        key_tiles(p, m_block, sq, sk, n_min, n_max);
        return n_min;
    }
    __device__ static __forceinline__ int n_tiles(const FcParams& p, const fc::SeqRange& sr, int m_block) {
        int n_min, n_max;
        key_tiles(p, m_block, sr.sq, sr.sk, n_min, n_max);
        return n_max;
    }
    // Key tiles [lo, hi) of this rank out of the tile's [n_min, n_max), n_min < n_max (all of
    // them without a split). Returns `discard`: an empty chunk, which walks tile n_min and drops
    // the result, so that every rank runs the same code.
    __device__ __forceinline__ bool key_range(int n_min, int n_max, int& lo, int& hi) const {
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
    }

    // ---- the tile ring (producer side) ----
    // Publish a tile into the next slot: {m_block (-1 = stop), head, batch, first key row (paged:
    // the key count, see Producer::load_keys), key tiles, sq, sk, first row}. Run by a whole
    // warp (the TMA warp) or by one thread (the scheduler thread); lane 0 writes.
    __device__ __forceinline__ void publish(PipeState<2>& ss, int tid, int m_block, int h, int bi,
                                            const fc::SeqRange& sr) const {
        const int slot = ss.stage;
        mbar_wait(sm.sched_empty(slot), ss.phase ^ 1);
        if ((tid & 31) == 0) {  // the warp's lane 0 (the TMA warp runs this with all lanes)
            const uint32_t a = sm.sched_val(slot);
            fc::st_shared_b32(a, m_block);
            fc::st_shared_b32(a + 4u, h);
            fc::st_shared_b32(a + 8u, bi);
            fc::st_shared_b32(a + 12u, p.page_table != nullptr ? sr.sk : sr.k0);
            fc::st_shared_b32(a + 16u, m_block < 0 ? 0 : n_tiles(p, sr, m_block));
            fc::st_shared_b32(a + 20u, sr.sq);
            fc::st_shared_b32(a + 24u, sr.sk);
            fc::st_shared_b32(a + 28u, sr.q0);
            mbar_arrive(sm.sched_full(slot));
        }
        ss.advance();
    }
    // The dynamic schedule's thread: tile `cta` first, then whatever the counter hands out
    // (decode_tile: longest first), as soon as a ring slot is free; then the stop. Without a
    // counter: round robin over the grid (one CTA per tile: tile `cta` only).
    __device__ __forceinline__ void run_dynamic(PipeState<2>& ss, int tid) const {
        for (int lin = cta; lin < total; lin = p.tile_counter ? next_tile() : lin + nctas) {
            int m_block, h, bi;
            decode_tile(lin, m_block, h, bi);
            const fc::SeqRange sr = fc::seq_range(p, bi);
            if (m_block * BM >= sr.sq) continue;  // past a shorter sequence (varlen)
            publish(ss, tid, m_block, h, bi, sr);
        }
        publish(ss, tid, -1, 0, 0, fc::SeqRange{0, 0, 0, 0});
    }
};

}  // namespace fc90
