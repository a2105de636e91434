// The key split of the sm90 forward kernel (SPLIT, the `_kvs` twins): a cluster of p.num_splits
// CTAs shares one query tile, each rank walking its chunk of the key tiles
// (TileScheduler::key_range). Once both consumer warpgroups of a rank > 0 are past their last P V
// its K/V ring holds no live tile, and the rank leaves there its unnormalised O, reference maxima
// (exp2 units) and row sums, per warpgroup X_BYTES as float4 [DV / 8 + 1][128], then arrives on
// rank 0's x_ready. Rank 0 reads them through distributed shared memory, rescales every partial
// to the largest maximum and adds them to its own, releases the others through their x_done
// (their smem must outlive the reads) and runs the epilogue alone. The kernel body runs, after the
// tile's last P V: exchange, drop, then give (ranks > 0, done with the tile) or take (rank 0).
#pragma once
#include "mainloop.cuh"

namespace fc90 {

template <class Tr>
struct KeySplit {
    FC90_TRAITS(Tr);
    const FwdSmem<Tr> sm;
    const TileScheduler<Tr> sched;
    uint32_t& xi;  // exchanges done: the parity of x_ready / x_done

    __device__ __forceinline__ KeySplit(const FwdSmem<Tr>& sm_, const TileScheduler<Tr>& sched_, uint32_t& xi_)
        : sm(sm_), sched(sched_), xi(xi_) {}

    // A rank > 0: its partials into its own ring; returns once rank 0 has read them.
    __device__ __forceinline__ void give(Mainloop<Tr>& ml, uint32_t xs) {
        // both warpgroups are past their last P V: the ring holds no live K or V
        named_sync(BAR_SPLIT, NC * 128);
#pragma unroll
        for (int j = 0; j < DV / 8; ++j)
            st_shared_v4(xs + j * 2048, make_float4(ml.o[4 * j], ml.o[4 * j + 1], ml.o[4 * j + 2], ml.o[4 * j + 3]));
        const float mu0 = ml.m_r[0] == -INFINITY ? -INFINITY : ml.m_r[0] * ml.sl2;
        const float mu1 = ml.m_r[1] == -INFINITY ? -INFINITY : ml.m_r[1] * ml.sl2;
        st_shared_v4(xs + (DV / 8) * 2048, make_float4(mu0, mu1, ml.l_r[0], ml.l_r[1]));
        mbar_arrive_cluster(mapa(sm.x_ready(), 0));
        // rank 0 has read them (this CTA's smem must outlive the reads)
        mbar_wait(sm.x_done(), xi & 1);
        ++xi;
    }
    // Rank 0: every other rank's partials merged into O, m and l.
    __device__ __forceinline__ void take(Mainloop<Tr>& ml, uint32_t xs) {
        const int splits = sched.splits;
        const float sl2 = ml.sl2;
        mbar_wait_cluster(sm.x_ready(), xi & 1);
        ++xi;
        float mu[2], big[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) big[r] = mu[r] = ml.m_r[r] == -INFINITY ? -INFINITY : ml.m_r[r] * sl2;
        for (int k = 1; k < splits; ++k) {
            const float4 ml4 = ld_cluster_v4(mapa(xs + (DV / 8) * 2048, k));
            big[0] = fmaxf(big[0], ml4.x);
            big[1] = fmaxf(big[1], ml4.y);
        }
        // rows that saw no key anywhere keep m = -inf, l = 0 (and O = 0)
        const float ref[2] = {big[0] == -INFINITY ? 0.f : big[0], big[1] == -INFINITY ? 0.f : big[1]};
        float f[2] = {fc::exp2_approx(mu[0] - ref[0]), fc::exp2_approx(mu[1] - ref[1])};
#pragma unroll
        for (int r = 0; r < 2; ++r) ml.l_r[r] *= f[r];
#pragma unroll
        for (int j = 0; j < DV / 2; ++j) ml.o[j] *= f[(j >> 1) & 1];
        for (int k = 1; k < splits; ++k) {
            const float4 ml4 = ld_cluster_v4(mapa(xs + (DV / 8) * 2048, k));
            f[0] = fc::exp2_approx(ml4.x - ref[0]);
            f[1] = fc::exp2_approx(ml4.y - ref[1]);
            ml.l_r[0] += f[0] * ml4.z;
            ml.l_r[1] += f[1] * ml4.w;
            const uint32_t peer = mapa(xs, k);
#pragma unroll
            for (int j = 0; j < DV / 8; ++j) {
                const float4 v = ld_cluster_v4(peer + j * 2048);
                ml.o[4 * j] += f[0] * v.x;
                ml.o[4 * j + 1] += f[0] * v.y;
                ml.o[4 * j + 2] += f[1] * v.z;
                ml.o[4 * j + 3] += f[1] * v.w;
            }
        }
        for (int k = 1; k < splits; ++k) mbar_arrive_cluster(mapa(sm.x_done(), k));
#pragma unroll
        for (int r = 0; r < 2; ++r) ml.m_r[r] = big[r] == -INFINITY ? -INFINITY : big[r] / sl2;
    }
    // This thread's exchange area: float4 j at xs + j * 2048 (in every rank's ring).
    __device__ __forceinline__ uint32_t exchange(const Mainloop<Tr>& ml) const {
        return sm.sK + ml.c * X_BYTES + ml.t128 * 16;
    }
    // An empty chunk (`discard`, only ranks > 0: rank 0's chunk is never empty) contributes
    // nothing: m = -inf, l = 0, O = 0.
    __device__ __forceinline__ void drop(Mainloop<Tr>& ml, bool discard) const {
        if (discard) {
            ml.m_r[0] = ml.m_r[1] = -INFINITY;
            ml.l_r[0] = ml.l_r[1] = 0.f;
#pragma unroll
            for (int j = 0; j < DV / 2; ++j) ml.o[j] = 0.f;
        }
    }
};

}  // namespace fc90
