// The epilogue of the sm90 forward kernel, per consumer warpgroup: the row sums reduced over the
// quad, the head's sink (p.sinks, fc::Sink) joined to the normaliser, LSE (natural log,
// f32), O scaled by 1/l and staged 16-bit and 128B-swizzled in the warpgroup's 64-row slice of
// the O buffer (SEP_O) or of the Q buffer, then stored by one thread with a TMA bulk-tensor store
// (rows >= sq fall outside the map) or, for the slice holding a varlen sequence's last rows and
// some shapes, by 16-byte stores. Rows that see no key get O = 0 and LSE = -inf (or the sink).
#pragma once
#include "mainloop.cuh"

namespace fc90 {

template <class Tr>
struct Epilogue {
    FC90_TRAITS(Tr);
    static constexpr int CPR = DV / 8;  // 16-byte chunks per output row
    const FcParams& p;
    const FwdSmem<Tr> sm;
    const CUtensorMap* tmo;
    uint8_t* const gsO;  // the staging buffer (O, or Q without SEP_O), generic address

    __device__ __forceinline__ Epilogue(const FcParams& p_, const FwdSmem<Tr>& sm_, const CUtensorMap* tmo_,
                                        uint8_t* smem_raw)
        : p(p_), sm(sm_), tmo(tmo_), gsO(smem_raw + ((SEP_O ? sm_.sO : sm_.sQ) - sm_.raw)) {}

    // A tile whose rows see no key at all: O = 0, LSE = -inf or the head's sink (no smem use).
    __device__ __forceinline__ void empty_tile(const Mainloop<Tr>& ml) const {
        const TileSlot<Tr> tile = ml.tile;
        const int m_block = ml.m_block, row0 = ml.row0;  // rows row0 and row0 + 8
        int h, bi;
        tile.head_batch(h, bi);
        T* og = reinterpret_cast<T*>(p.o) + (int64_t)bi * p.o_batch_stride + (int64_t)h * p.o_head_stride +
                (int64_t)tile.q0() * p.o_row_stride;
        float* lse_g = lse_row0(tile);
        const int sqv = tile.sq();
        if (ml.tq == 0) {
            const float sink = fc::sink_of(p, h);
            if (row0 < sqv) lse_g[row0] = sink;
            if (row0 + 8 < sqv) lse_g[row0 + 8] = sink;
        }
#pragma unroll
        for (int it = 0; it < 64 * CPR / 128; ++it) {
            const int idx = it * 128 + ml.t128;
            const int rl = idx / CPR, chk = idx % CPR;
            const int grow = m_block * BM + ml.c * 64 + rl;
            if (grow < sqv && chk * 8 < p.dv)
                *reinterpret_cast<uint4*>(og + (int64_t)grow * p.o_row_stride + chk * 8) = make_uint4(0, 0, 0, 0);
        }
    }
    // this (head, sequence)'s LSE row
    __device__ __forceinline__ float* lse_row0(TileSlot<Tr> tile) const {
        int h, bi;
        tile.head_batch(h, bi);
        return fc::lse_ptr(p, bi, h, tile.q0());
    }
    // 1/l and the LSE of this thread's two rows; the LSE stored. The head's sink joins the
    // normaliser here (once per row, after a key split's merge). Returns the tile's sq.
    __device__ __forceinline__ int normalise(const Mainloop<Tr>& ml, float (&inv)[2]) const {
        float* lse_g = lse_row0(ml.tile);
        float lse[2];
        auto sink_of_tile = [&]() {
            int h, bi;
            ml.tile.head_batch(h, bi);
            return fc::sink_of(p, h);
        };
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float l = ml.l_r[r];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            const float unit = CAP ? fc::score_unit(p.scale, p.softcap) : p.scale;
            const float sink = p.sinks != nullptr ? sink_of_tile() : -INFINITY;
            if (sink == -INFINITY) {
                const bool empty = !(l > 0.f);
                inv[r] = empty ? 0.f : 1.f / l;
                lse[r] = empty ? -INFINITY : ml.m_r[r] * unit + logf(l);
            } else {
                inv[r] = fc::Sink(sink).finalize(ml.m_r[r] * unit, l, lse[r]);
            }
        }
        const int sqv = ml.sq_of();
        if (ml.tq == 0) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int row = ml.row0 + 8 * r;
                if (row < sqv) lse_g[row] = lse[r];
            }
        }
        return sqv;
    }
    // O * inv (16-bit) into this warpgroup's 64-row slice of the O (or Q) buffer, 128B-swizzled.
    __device__ __forceinline__ void stage_o(const Mainloop<Tr>& ml, const float (&inv)[2]) const {
        const uint32_t slice = ml.c * 8192;
        if (SEP_O) {
            // the previous tile's TMA store must have read the slice
            if (ml.t128 == 0) bulk_wait_read();
            named_sync(BAR_EPI + ml.c, 128);
        }
#pragma unroll
        for (int i = 0; i < DV / 2; i += 2) {
            const int col = 8 * (i >> 2) + 2 * ml.tq;
            const int rl = ml.warp * 16 + ml.g + 8 * ((i >> 1) & 1);
            const int cb = col >> 6, ch = (col & 63) >> 3;
            const uint32_t off = cb * BM * 128 + slice + rl * 128 + ((ch ^ (rl & 7)) << 4) + (col & 7) * 2;
            const int r = (i >> 1) & 1;
            *reinterpret_cast<uint32_t*>(gsO + off) = fc::Elem<T>::pack(ml.o[i] * inv[r], ml.o[i + 1] * inv[r]);
        }
    }
    // Varlen (a uniform branch: the dense path stays as it was). A slice that lies inside its
    // sequence takes the TMA store at its packed row (batch coordinate 0); the slice holding the
    // sequence's last rows takes 16-byte stores of its rows (a TMA box past the sequence's end
    // would write the next sequence's rows). Neither choice branches around a barrier: a
    // divergent path holding one serialises every wgmma of the kernel (ptxas C7520, 25-40 %
    // slower: docs/decisions.md#wgmma-serialisation-warnings).
    __device__ __forceinline__ void store_varlen(const Mainloop<Tr>& ml, int sqv) const {
        const uint32_t slice = ml.c * 8192;
        const int srow = ml.m_block * BM + ml.c * 64;
        // Not the 256-row d64 kernel (its 4 consumer warpgroups spill 8 B with the TMA store)
        // nor d256 (1.2-2.7 % slower than the 16-byte stores).
        const bool tail = BM > 192 || D > 128 || srow + 64 > sqv;
        fence_proxy_async_smem();
        named_sync(BAR_EPI + ml.c, 128);
        int h, bi;
        ml.tile.head_batch(h, bi);
        const int q0 = ml.tile.q0();
        T* og = reinterpret_cast<T*>(p.o) + (int64_t)h * p.o_head_stride + (int64_t)q0 * p.o_row_stride;
#pragma unroll
        for (int it = 0; it < 64 * CPR / 128; ++it) {
            const int idx = it * 128 + ml.t128;
            const int rl = idx / CPR, chk = idx % CPR;
            const int grow = srow + rl;
            const uint32_t off = (chk >> 3) * BM * 128 + slice + rl * 128 + (((chk & 7) ^ (rl & 7)) << 4);
            if (tail && grow < sqv && chk * 8 < p.dv)
                *reinterpret_cast<uint4*>(og + (int64_t)grow * p.o_row_stride + chk * 8) =
                    *reinterpret_cast<const uint4*>(gsO + off);
        }
        if (ml.t128 == 0 && !tail) {
#pragma unroll
            for (int cb = 0; cb < DBV; ++cb)
                tma_store_4d(tmo, (SEP_O ? sm.sO : sm.sQ) + cb * BM * 128 + slice, cb * 64, q0 + srow, h, 0);
            bulk_commit();
        }
        // every thread's 16-byte reads of the staged slice are done (the next tile's staging, or
        // the Q load into the Q buffer, may overwrite it)
        named_sync(BAR_EPI + ml.c, 128);
        if (!SEP_O && ml.t128 == 0) {
            bulk_wait_read();
            mbar_arrive(sm.q_empty(0));
        }
    }
    // Dense: one thread stores the slice with TMA (rows >= sq fall outside the map, so they are
    // not written): against 16-byte stores from every thread +0.8 % over the fa3 grid, +1.5-3 %
    // at d64/d128 up to 1k (H100; docs/decisions.md#o-through-a-tma-store).
    __device__ __forceinline__ void store_dense(const Mainloop<Tr>& ml) const {
        const uint32_t slice = ml.c * 8192;
        fence_proxy_async_smem();
        named_sync(BAR_EPI + ml.c, 128);
        if (ml.t128 == 0) {
            int h, bi;
            ml.tile.head_batch(h, bi);
#pragma unroll
            for (int cb = 0; cb < DBV; ++cb)
                tma_store_4d(tmo, (SEP_O ? sm.sO : sm.sQ) + cb * BM * 128 + slice, cb * 64, ml.m_block * BM + ml.c * 64,
                             h, bi);
            bulk_commit();
            if (!SEP_O) {
                bulk_wait_read();  // O was staged in the Q buffer: free it once read
                mbar_arrive(sm.q_empty(0));
            }
        }
    }
    // The epilogue's first half: LSE stored, O normalised and staged. Returns the tile's sq.
    // Then store_varlen or store_dense.
    __device__ __forceinline__ int finish(const Mainloop<Tr>& ml) const {
        float inv[2];
        const int sqv = normalise(ml, inv);
        stage_o(ml, inv);
        return sqv;
    }
};

}  // namespace fc90
