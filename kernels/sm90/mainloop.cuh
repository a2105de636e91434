// The consumer mainloop of the sm90 forward kernel: one consumer warpgroup's 64 query rows of a
// query tile against its key tiles, walked from the last (masked) one down. Per key tile: S = Q K^T
// with SS wgmma (K-major, SW128), the score modifiers (CAP), the mask, the online softmax in
// registers (exp2 with scale_log2 folded in, lazy O rescale; without a mask, key tiles after the
// first ones skip the row max: `softmax_gen`), P packed to 16-bit registers, O += P V with RS wgmma
// (V is MN-major in smem, imm-trans-b = 1). QK^T of tile i is issued before the P V of tile i-1,
// and the softmax of tile i runs while that P V is in flight (the wait for that P V sits after the
// loop back-edge, so ptxas cannot hoist it above the softmax; SPV tiles wait behind a branch
// inside the softmax instead). Optional ping-pong between the consumer warpgroups (named barriers
// 1..NC) hands the tensor cores from one to the next.
//
// State: O (DV / 2 floats), S or P (BN / 2 floats), P packed (BN / 16 x 4 words), and per row
// pair the reference max m and the sum l. After `run_tile` O, m and l are the unnormalised result
// of each thread's rows row0 and row0 + 8; the key split (combine.cuh) and the epilogue
// (epilogue.cuh) take them from there.
#pragma once
#include "scheduler.cuh"

namespace fc90 {

// A consumer thread's accumulators: O, S or P, P packed, and per row pair the reference max,
// the sum of exponentials and the latest rescale factors. The caller keeps each as a separate
// local (not fields of the Mainloop) so that each is promoted to registers on its own once its
// loops are unrolled, without holding back the Mainloop's scalars.
template <class Tr>
struct Accum {
    float (&o)[Tr::DV / 2];
    float (&s)[Tr::BN / 2];
    uint32_t (&pa)[Tr::BN / 16][4];
    float (&m_r)[2];
    float (&l_r)[2];
    float (&alpha)[2];
};

template <class Tr>
struct Mainloop {
    FC90_TRAITS(Tr);
    using Sched = TileScheduler<Tr>;
    const FcParams& p;
    // Copies (a few words each), not references, like every part's: they become registers with
    // the Mainloop's other scalars.
    const FwdSmem<Tr> sm;
    const Sched sched;
    // Thread geometry. `c`, the consumer warpgroup: causal tiles take it as a value ptxas knows is
    // the same in every lane (a shuffle from lane 0): from threadIdx it is per-thread to ptxas, and
    // so is every wgmma descriptor built from it (the Q slice), which then costs each wgmma of the
    // key loop an R2UR pair and its address arithmetic (d256 causal 128x64: 589 -> 550
    // instructions per key tile). Same binary on the H100
    // (decisions.md#warp-uniform-warpgroup-index): causal +0.5-1.8 %, LLaMA prefill +1.4 %; but
    // d64 / d128 non-causal 8k -3.3 / -2.1 % and the d256 non-causal 128x80 tile spills 20 B with
    // it, so those keep the per-thread value.
    const int c;
    const int t128, warp, lane, g, tq;
    const float sl2;  // the kept scores' unit in exp2 terms (scale, or softcap for CAP)
    const fc::Softcap cap;  // softcap (CAP, p.softcap > 0): S -> tanh(S * scale / softcap)
    const uint64_t dq, dk, dv;  // wgmma descriptors of this warpgroup's Q slice, K and V stage 0
    PipeState<STAGES> ks, vs;  // the K and V rings' positions

    // The accumulators live in the caller, one array each (see Accum).
    float (&o)[DV / 2];
    float (&s)[BN / 2];
    uint32_t (&pa)[BN / 16][4];
    float (&m_r)[2];
    float (&l_r)[2];
    float (&alpha)[2];  // the O / l rescale factors of the latest softmax

    // The tile: its ring slot, query tile, this thread's first row (rows row0 and row0 + 8), its
    // Q buffer and its parity, the key tiles [lo, hi) walked and their count NT.
    TileSlot<Tr> tile;
    int m_block, row0, qb, lo, hi, NT;
    uint32_t q_phase;  // the Q buffer's parity
    // The mask's thresholds (fc::mask_thresholds, begin_tile): CAUSAL_SHORT: key tiles n >= n_mask
    // need the mask; WINDOW: tiles starting left of key_left hold keys some row does not see
    // (INT_MIN without a left bound, and always without a window).
    int n_mask, key_left;

    __device__ __forceinline__ Mainloop(const FcParams& p_, const FwdSmem<Tr>& sm_, const Sched& sched_, int wg, int tid,
                                        Accum<Tr>& acc)
        : p(p_),
          sm(sm_),
          sched(sched_),
          c(CAUSAL ? __shfl_sync(0xffffffffu, wg - 1, 0) : wg - 1),
          t128(tid & 127),
          warp(t128 >> 5),
          lane(tid & 31),
          g(lane >> 2),
          tq(lane & 3),
          sl2(CAP ? fc::score_unit_log2(p_.scale_log2, p_.softcap) : p_.scale_log2),
          cap(p_.scale, p_.softcap),
          dq(desc_sw128(sm_.sQ + c * 8192, 16, 1024)),
          dk(desc_sw128(sm_.sK, 16, KV_RG)),
          dv(desc_sw128(sm_.sV, KV_CB, KV_RG)),
          o(acc.o),
          s(acc.s),
          pa(acc.pa),
          m_r(acc.m_r),
          l_r(acc.l_r),
          alpha(acc.alpha),
          tile{sm_, 0} {}

    __device__ __forceinline__ int sq_of() const { return tile.sq(); }
    __device__ __forceinline__ int sk_of() const { return tile.sk(); }
    // sq where the mask reads it (the diagonal): a shared load, so not where it is not needed.
    __device__ __forceinline__ int sq_mask() const { return CAUSAL ? sq_of() : 0; }

    // Raw score of query row `qr` (of the Q tile) and key row `kr` (of a K stage) from the
    // 128B-swizzled tiles in shared memory, f32 accumulation (fix_tile's rare path).
    __device__ static __forceinline__ float score_smem(uint32_t sq_, uint32_t sk_, int qr, int kr) {
        float acc = 0.f;
        const uint32_t qa = sq_ + qr * 128, ka = sk_ + (ILV ? (kr >> 3) * KV_RG + (kr & 7) * 128 : kr * 128),
                       qs = (qr & 7) << 4, ks = (kr & 7) << 4;
#pragma unroll 1
        for (int w = 0; w < DK / 2; ++w) {  // 32-bit words: 2 elements
            const uint32_t blk = (w >> 5), off = (((w & 31) >> 2) << 4) | ((w & 3) << 2);
            const float2 x = fc::Elem<T>::unpack(fc::ld_shared_b32(qa + blk * BM * 128 + (off ^ qs)));
            const float2 y = fc::Elem<T>::unpack(fc::ld_shared_b32(ka + blk * KV_CB + (off ^ ks)));
            acc = fmaf(x.x, y.x, acc);
            acc = fmaf(x.y, y.y, acc);
        }
        return acc;
    }

    // ---- mask (common/mask.cuh) ----
    // Key tile n needs masking (it is the ragged last one or crosses the causal diagonal, or a
    // left window bound cuts it); tiles are walked from the last down, so the masked ones come
    // first. fc::mask_thresholds from begin_tile (CAUSAL_SHORT, a left bound); the other kernels
    // (no mask, d256 causal) test fc::tile_needs_mask's right-edge terms per tile, written out
    // with a short circuit: each operand re-reads sq / sk from the tile slot (shared loads), and
    // through the helper's value parameters those loads moved ahead of the tile arithmetic and
    // lost the short circuit (the no-mask key loop +16 instructions, d256 causal -8).
    __device__ __forceinline__ bool need_mask(int n) const {
        if (n * BN < key_left) return true;
        if (CAUSAL_SHORT) return n >= n_mask;
        static_assert(!WINDOW || CAUSAL_SHORT, "a window's right bound is tested through the thresholds");
        return (n * BN + BN > sk_of()) || (CAUSAL && n * BN + BN - 1 > m_block * BM + sk_of() - sq_of());
    }
    template <int NE>
    __device__ __forceinline__ void apply_mask(int n) {
        if (need_mask(n)) {
            // fc::mask_score on each element against its row's band (fc::band_limits) in the
            // thread's column offsets (keys - col0): one compare against a constant offset and
            // one select per element (the per-element column/row arithmetic cost 3-4
            // instructions: +1.2-1.4 % at d64 causal 512 / 1k, H100;
            // docs/decisions.md#mask-threshold). No window: no left bound to test.
            const int col0 = n * BN + 2 * tq;
            int lo[2], hi[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int skv = sk_of();  // (sk's load before sq's, as measured)
                fc::band_limits<MASK>(row0 + 8 * r, sq_mask(), skv, p.window_left, p.window_right, lo[r], hi[r], col0);
            }
#pragma unroll
            for (int i = 0; i < NE; ++i) {
                const int cc = 8 * (i >> 2) + (i & 1), r = (i >> 1) & 1;
                if (WINDOW)
                    fc::mask_score(s[i], cc, lo[r], hi[r]);
                else
                    fc::mask_score(s[i], cc, hi[r]);
            }
        }
    }

    // ---- online softmax ----
    // Softmax of key tile n held in s[]. `exact`: mask, new row max, alpha (the lazy rescale rule
    // below), exponentials, row sums. Otherwise (a key tile after the first ones, see `fast_ok`)
    // the exponentials use the rows' reference max as it stands, without a row max first (that
    // was ~16 % of the loop's instructions, and the exponentials waited for it): a thread's
    // partial row sum bounds each of its P, so sums <= 2^RESCALE_LOG2 in every row of the warp
    // mean no reference had to move and the tile is done. If not (rare: a row's max grew past the
    // threshold) softmax_gen returns true and leaves l alone; `fix_tile` redoes the tile in
    // finish_pv, where the P registers of the P V in flight are free. One body for both so that
    // the key loop holds one copy of the exponentials.
    // The exact path's first half: mask, new row max, alpha and the reference max.
    template <int NE>
    __device__ __forceinline__ void row_max(int n, float (&al)[2]) {
        apply_mask<NE>(n);
        float mx[2] = {m_r[0], m_r[1]};
#pragma unroll
        for (int i = 0; i < NE; ++i) mx[(i >> 1) & 1] = fmaxf(mx[(i >> 1) & 1], s[i]);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
            // The rule of fc::lazy_rescale (common/softmax.cuh, the sm80 kernels), written out:
            // through the helper this kernel ran 1.6 % slower at d128. The first visible key sets
            // the reference (O = 0 and l = 0 until then: alpha 1); later only a growth past the
            // threshold moves it. Needs a scale > 0 (the dispatcher refuses others).
            const bool first = m_r[r] == -INFINITY;
            const bool upd = first ? mx[r] != -INFINITY : mx[r] * sl2 - m_r[r] * sl2 > RESCALE_LOG2;
            al[r] = upd && !first ? fc::exp2_approx(m_r[r] * sl2 - mx[r] * sl2) : 1.f;
            if (upd) m_r[r] = mx[r];
        }
    }
    // The rows' reference max in exp2 units (0 for a row that has seen no key yet).
    __device__ __forceinline__ void ref_mu(float (&mu)[2]) const {
#pragma unroll
        for (int r = 0; r < 2; ++r) mu[r] = m_r[r] == -INFINITY ? 0.f : m_r[r] * sl2;
    }
    // The exponentials of s[i0, i1) against mu, added to the row sums ps: two partial sums per row
    // on CAUSAL_SHORT tiles (even and odd elements), one otherwise; `total` adds them up.
    __device__ __forceinline__ void exps(int i0, int i1, const float (&mu)[2], float (&ps)[2][2]) {
#pragma unroll
        for (int i = i0; i < i1; ++i) {
            const int r = (i >> 1) & 1;
            s[i] = fc::exp2_approx(fmaf(s[i], sl2, -mu[r]));
            ps[r][CAUSAL_SHORT ? (i & 1) : 0] += s[i];
        }
    }
    __device__ static __forceinline__ float total(const float (&ps)[2][2], int r) {
        return CAUSAL_SHORT ? ps[r][0] + ps[r][1] : ps[r][0];
    }
    __device__ __forceinline__ void add_l(const float (&al)[2], const float (&ps)[2][2]) {
#pragma unroll
        for (int r = 0; r < 2; ++r) l_r[r] = l_r[r] * al[r] + total(ps, r);
    }
    __device__ __forceinline__ bool softmax_gen(int n, float (&al)[2], bool exact) {
        if (exact) {
            row_max<BN / 2>(n, al);
        } else {
            al[0] = al[1] = 1.f;
        }
        float mu[2], ps[2][2] = {};
        ref_mu(mu);
        exps(0, BN / 2, mu, ps);
        constexpr float LIM = 1u << (int)RESCALE_LOG2;
        if (!exact && __any_sync(0xffffffffu, !(total(ps, 0) <= LIM) || !(total(ps, 1) <= LIM))) return true;
        add_l(al, ps);
        return false;
    }
    __device__ __forceinline__ void softmax(int n, float (&al)[2]) { softmax_gen(n, al, true); }
    // Key tile n may skip the row max once the tile before it was unmasked: every row then has a
    // reference from at least one whole tile, which makes growth rare.
    __device__ __forceinline__ bool fast_ok(int n) const {
        return FAST && !need_mask(n + 1) && !__any_sync(0xffffffffu, m_r[0] == -INFINITY || m_r[1] == -INFINITY);
    }

    // ---- score modifiers (the CAP twins; runtime: softcap, ALiBi) ----
    // fc::Softcap, then fc::Alibi (common/variants.cuh) on element i of key tile n: key
    // n * BN + 8 * (i >> 2) + 2 * tq + (i & 1) of row row0 + 8 * ((i >> 1) & 1).
    __device__ __forceinline__ fc::Alibi alibi_of() const {
        int h, bi;
        tile.head_batch(h, bi);
        return fc::Alibi(fc::alibi_slope_units(p, bi, h), fc::alibi_floor(p));
    }
    __device__ __forceinline__ float mod_score(float v, int n, int i) const {
        if (p.softcap > 0.f) v = cap(v);
        if (p.alibi_slopes != nullptr)
            v = alibi_of()(v, n * BN + 8 * (i >> 2) + 2 * tq + (i & 1), row0 + 8 * ((i >> 1) & 1) + sk_of() - sq_of());
        return v;
    }
    // The whole S tile of key tile n.
    __device__ __forceinline__ void cap_scores(int n) {
        if (CAP) {
            if (p.softcap > 0.f) {
#pragma unroll
                for (int i = 0; i < BN / 2; ++i) s[i] = cap(s[i]);
            }
            if (p.alibi_slopes != nullptr) {
                const fc::Alibi alibi = alibi_of();
                const int col0 = n * BN + 2 * tq, dg = row0 + sk_of() - sq_of();
#pragma unroll
                for (int i = 0; i < BN / 2; ++i)
                    s[i] = alibi(s[i], col0 + 8 * (i >> 2) + (i & 1), dg + 8 * ((i >> 1) & 1));
            }
        }
    }
    // Redo key tile n whose s[] holds P = 2^(x - mu) from a fast softmax_gen: back to the raw
    // scores (log2; x - mu >= 128 gave P = inf and is recomputed from Q and K stage `kst` in
    // shared memory), then `softmax`.
    __device__ __forceinline__ void fix_tile(int n, uint32_t kst, float (&al)[2]) {
        const float mu[2] = {m_r[0] * sl2, m_r[1] * sl2};
        const float isl2 = 1.f / sl2;
#pragma unroll
        for (int i = 0; i < BN / 2; ++i)
            if (s[i] != INFINITY) s[i] = (fc::log2_approx(s[i]) + mu[(i >> 1) & 1]) * isl2;
        uint64_t big = 0;
#pragma unroll
        for (int i = 0; i < BN / 2; ++i)
            if (s[i] == INFINITY) big |= 1ull << i;
        while (big) {  // one dot product per P = inf (an index loop: one copy of the code)
            const int i = __ffsll((long long)big) - 1;
            big &= big - 1;
            float v = score_smem(sm.sQ + qb * Q_BYTES, sm.sK + kst * K_BYTES, c * 64 + warp * 16 + g + 8 * ((i >> 1) & 1),
                                 8 * (i >> 2) + 2 * tq + (i & 1));
            if (CAP) v = mod_score(v, n, i);
#pragma unroll
            for (int j = 0; j < BN / 2; ++j)
                if (j == i) s[j] = v;
        }
        softmax(n, al);
    }
    __device__ __forceinline__ void convert_p() {
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk)
#pragma unroll
            for (int j = 0; j < 4; ++j) pa[kk][j] = fc::Elem<T>::pack(s[8 * kk + 2 * j], s[8 * kk + 2 * j + 1]);
    }
    // The P V in flight is complete: O and P are this warpgroup's again; `release` frees its V
    // stage.
    __device__ __forceinline__ void pv_done(bool release) {
        wg_wait<0>();
        fence_regs(o);
        fence_regs(pa);
        if (release) {
            if (t128 == 0) mbar_arrive(sm.empty_v(vs.stage));
            vs.advance();
        }
    }
    // SPV kernels: the exact softmax of key tile n that also finishes the P V in flight, in FA3's
    // order: after the row max and the first exponentials, wait for the P V (`pv`: one is in
    // flight; free its V stage), rescale O, then the other exponentials with P packed as they
    // come. The rescale and the packing then fill the SFU's gaps instead of standing between the
    // softmax and the next Q K^T (there they sat after the ping-pong barrier: ncu against FA4,
    // docs/decisions.md#spv-softmax-pv). No finish_pv then.
    __device__ __forceinline__ void softmax_pv(int n, float (&al)[2], bool pv) {
        row_max<BN / 2>(n, al);
        float mu[2], ps[2][2] = {};
        ref_mu(mu);
        // exponentials before the wait: BN / 16 against BN / 8, same binary (H100):
        // d64 / d128 causal 512-8k and LLaMA prefill +0.5-1.3 %, d128 16k -1.2 to +0.3 %;
        // BN / 4 ran 0.5-2.7 % slower
        constexpr int X = BN / 16;
        exps(0, X, mu, ps);
        // The waits sit behind the rescale's branch: in one basic block with the softmax, ptxas
        // hoisted the wait above the row max (no overlap with the P V: 2-4 % slower).
        if (__any_sync(0xffffffffu, al[0] != 1.f || al[1] != 1.f)) {
            wg_wait<0>();
            fence_regs(o);
#pragma unroll
            for (int j = 0; j < DV / 2; ++j) o[j] *= al[(j >> 1) & 1];
        }
        pv_done(pv);
        exps(X, BN / 2, mu, ps);
        convert_p();
        add_l(al, ps);
    }
    // HALF (the d64 causal tiles, see run_tile): the first key tile's softmax over its first
    // BN / 2 keys, P zero in the other half (alpha = 1: the first key tile).
    __device__ __forceinline__ void softmax_half(int n) {
        row_max<BN / 4>(n, alpha);
        float mu[2], ps[2][2] = {};
        ref_mu(mu);
        exps(0, BN / 4, mu, ps);
#pragma unroll
        for (int i = BN / 4; i < BN / 2; ++i) s[i] = 0.f;
        convert_p();
        add_l(alpha, ps);
    }

    // ---- wgmma ----
    // Q K^T over the DK columns in use (a narrow twin: the columns past p.d <= DK are zeros, filled
    // by TMA). Earlier narrow-Q K^T twins ran ceil(d / 16) k-steps in a loop bounded by the
    // parameter block (d80 +3-11 %, d160 +1-16 %); the loop in the full-width kernels themselves
    // cost d128 2-5 %, and a branch around single unrolled wgmmas makes ptxas serialise them
    // (C7515): hence compile-time twins (docs/decisions.md#narrow-twins).
    __device__ __forceinline__ void issue_qk(int stage) {
        const uint64_t dks = desc_add(dk, stage * K_BYTES);
#pragma unroll
        for (int kk = 0; kk < DK / 16; ++kk)
            QK::ss(s, desc_add(dq, qb * Q_BYTES + (kk / 4) * BM * 128 + (kk % 4) * 32),
                   desc_add(dks, (kk / 4) * KV_CB + (kk % 4) * 32), kk > 0 ? 1 : 0);
    }
    __device__ __forceinline__ void issue_pv(int stage) {
        const uint64_t dvs = desc_add(dv, stage * V_BYTES);
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) PV::rs(o, pa[kk], desc_add(dvs, kk * 2 * KV_RG), 1);
    }
    // Ping-pong: wait for this warpgroup's turn at the tensor cores; pass the turn on (the last
    // warpgroup's last P V of a tile passes nothing: the next tile's seed does).
    __device__ __forceinline__ void sched_sync() const {
        if (PINGPONG) named_sync(BAR_SCHED + c, 256);
    }
    __device__ __forceinline__ void sched_arrive(bool last) const {
        if (PINGPONG && !(last && c == NC - 1)) named_arrive(BAR_SCHED + (c + 1) % NC, 256);
    }
    // Causal: the keys this warpgroup's rows can see end here (its last row's band,
    // fc::band_limits), sq and sk re-read from the tile slot as everywhere in the consumer (SKIP1
    // and HALF).
    __device__ __forceinline__ int wg_key_end() const {
        const int skv = sk_of();
        int lo_, hi_;
        fc::band_limits<MASK>(m_block * BM + c * 64 + 63, sq_of(), skv, p.window_left, p.window_right, lo_, hi_);
        return hi_;
    }

    // ---- one query tile ----
    // The tile in ring slot `tile_`, query tile mb: this thread's rows.
    __device__ __forceinline__ void set_tile(TileSlot<Tr> tile_, int mb) {
        tile = tile_;
        m_block = mb;
        row0 = m_block * BM + c * 64 + warp * 16 + g;
    }
    // Reset the state for the tile (key tiles below n_max > 0, Q buffer qb_); returns `discard`
    // (TileScheduler::key_range).
    __device__ __forceinline__ bool begin_tile(int n_max, int qb_) {
        qb = qb_;
        const bool discard = sched.key_range(Sched::n_first(p, m_block, sq_of(), sk_of()), n_max, lo, hi);
        NT = hi - lo;
        m_r[0] = m_r[1] = -INFINITY;
        l_r[0] = l_r[1] = 0.f;
#pragma unroll
        for (int i = 0; i < DV / 2; ++i) o[i] = 0.f;
        // CAUSAL_SHORT: key tiles n >= n_mask need the mask (both conditions grow with n: the
        // first holds from sk / BN on, the second from (m_block * BM + sk - sq + 1) / BN on, which
        // is <= 0 when every tile does). Computed once per tile: re-reading sq and sk from the
        // slot in every key tile put two shared loads and a uniform chain before each softmax
        // (docs/decisions.md#mask-threshold).
        n_mask = 0;
        key_left = -0x7fffffff - 1;
        if (CAUSAL_SHORT || WINDOW) {
            const int skv = sk_of();
            fc::mask_thresholds<MASK, BN>(m_block * BM, m_block * BM + BM - 1, sq_of(), skv, p.window_left,
                                          p.window_right, n_mask, key_left);
        }
        return discard;
    }
    // SKIP1 (causal tiles without SPV: d64 192x128, d256): the warpgroup's first key tile is
    // masked whole for its rows (its diagonal lies in the tile's other warpgroups: every d256
    // 128x64 query tile's first warpgroup, most d64 192x128 tiles' first two). It waits for that
    // tile's K and V and frees them, passes its ping-pong turn on, and starts at the next tile.
    // BM - 64 <= BN, so one tile at most. The branch is a warp vote: decided on values read from
    // shared memory it would be divergent to ptxas, which then builds the whole key loop for
    // divergent warps (the stage and phase it advances no longer uniform: 24 more R2UR / IMAD per
    // iteration, WARPSYNC around the wgmmas) and the kernel ran 6-10 % slower. Same-binary A/B on
    // the H100 (docs/decisions.md#skip1-and-half-votes): d256 causal 512-8k +0.9-2.7 %, d64 causal
    // 2k +3.5 %.
    __device__ __forceinline__ void skip_first() {
        if (SKIP1 && __any_sync(0xffffffffu, hi - lo >= 2 && wg_key_end() <= (hi - 1) * BN)) {
            mbar_wait(sm.full_k(ks.stage), ks.phase);
            if (t128 == 0) mbar_arrive(sm.empty_k(ks.stage));
            ks.advance();
            sched_sync();
            sched_arrive(false);
            mbar_wait(sm.full_v(vs.stage), vs.phase);
            if (t128 == 0) mbar_arrive(sm.empty_v(vs.stage));
            vs.advance();
            --hi;
            --NT;
        }
    }
    // The first key tile: S_0 = Q K_0^T, softmax, P_0. HALF (the d64 causal tiles): the
    // warpgroup's first key tile is visible to its rows in its first half only (at BM = BN and
    // seq_q = seq_k, the first warpgroup's diagonal tile): its row max, exponentials and sums run
    // over those BN / 2 keys, and its P is zero in the other half. The Q K^T stays whole (a second
    // Q K^T shape in the kernel made ptxas serialise the wgmmas: C7511, C7520). A warp vote, as
    // SKIP1. Same-binary A/B on the H100 (decisions.md#skip1-and-half-votes): d64 causal 512 / 1k
    // +2.0 / +3.1 % with a divergent branch, then +2.0 / +3.8 % more with the vote; the 192x128
    // tile 2k / 8k +1.1 / +0.8 % over SKIP1 alone; on the d128 tiles -1 to +1.6 %, so not there.
    __device__ __forceinline__ void prologue() {
        constexpr bool HALF = CAUSAL && !CAP && D == 64 && BN == 128;
        const bool half = HALF && __any_sync(0xffffffffu, wg_key_end() <= (hi - 1) * BN + BN / 2);

        mbar_wait(sm.bar_q(qb), q_phase);
        mbar_wait(sm.full_k(ks.stage), ks.phase);
        sched_sync();
        fence_regs(s);
        fence_regs(o);
        wg_fence();
        issue_qk(ks.stage);
        wg_commit();
        sched_arrive(false);
        wg_wait<0>();
        fence_regs(s);
        if (FAST ? lane == 0 : t128 == 0) mbar_arrive(sm.empty_k(ks.stage));
        ks.advance();
        cap_scores(hi - 1);
        if (half) {
            softmax_half(hi - 1);
        } else if (SPV) {
            softmax_pv(hi - 1, alpha, false);
        } else {
            softmax(hi - 1, alpha);
        }
    }
    // Paged pools: the rows of the last key tile past the sequence's end hold whatever the page
    // holds (P is 0 there, but 0 * NaN is NaN): zero them in its V stage (the first V tile of the
    // loop) before any P V reads it. Both consumer warpgroups write the same zeros; each fences
    // its writes for the async proxy and syncs its own threads.
    __device__ __forceinline__ void zero_paged_tail(uint8_t* smem_raw) {
        if (PAGED && p.page_table != nullptr) {
            const int valid = sk_of() - (hi - 1) * BN;
            if (valid < BN) {
                mbar_wait(sm.full_v(vs.stage), vs.phase);
                uint8_t* const vt = smem_raw + (sm.sV + vs.stage * V_BYTES - sm.raw);
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
    }
    // Finish the P V in flight (if `release`, free its V stage), finish the previous key tile's
    // softmax if softmax_gen left it (`fix`: fix_tile reads Q and that tile's K stage, so each
    // warp frees the K stage after it, and Q after the last finish_pv), rescale O, P to registers.
    // `fix`: the latest fast softmax must be redone (fix_tile) on K stage `kprev`.
    __device__ __forceinline__ void finish_pv(bool release, int nprev, bool& fix, uint32_t kprev) {
        pv_done(release);
        if (fix) {
            fix_tile(nprev, kprev, alpha);
            if (lane == 0) mbar_arrive(sm.empty_k(kprev));
            fix = false;
        }
        if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
            for (int j = 0; j < DV / 2; ++j) o[j] *= alpha[(j >> 1) & 1];
        }
        convert_p();
    }
    // The steady state. Iteration i: finish tile i-1's P V (wait, release V, rescale O, P_{i-1}
    // to registers), then issue S_i = Q K_i^T and O += P_{i-1} V_{i-1}; softmax_i overlaps that
    // P V. The wait for P V sits at the top of the next iteration (after the loop back-edge) so
    // ptxas cannot hoist it above the softmax. SPV kernels do that finishing inside softmax_pv
    // instead (no finish_pv). Then the tail: O += P_{T-1} V_{T-1}.
    __device__ __forceinline__ void key_loop() {
        uint32_t kprev = 0;
        bool fix = false;
        for (int i = 1; i < NT; ++i) {
            const int n = hi - 1 - i;
            if (!SPV) finish_pv(i >= 2, n + 1, fix, kprev);
            mbar_wait(sm.full_k(ks.stage), ks.phase);
            sched_sync();
            fence_regs(s);
            fence_regs(pa);
            fence_regs(o);
            wg_fence();
            issue_qk(ks.stage);
            wg_commit();
            mbar_wait(sm.full_v(vs.stage), vs.phase);
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
                if (!fix && lane == 0) mbar_arrive(sm.empty_k(kprev));
            } else {
                if (t128 == 0) mbar_arrive(sm.empty_k(kprev));
                if (SPV)
                    softmax_pv(n, alpha, true);
                else
                    softmax(n, alpha);
            }
        }
        if (!SPV) finish_pv(NT >= 2, lo, fix, kprev);
        // all Q K^T of this tile are complete: with a separate O buffer, Q can be reloaded now
        if (SEP_O && (FAST ? lane == 0 : t128 == 0)) mbar_arrive(sm.q_empty(qb));
        mbar_wait(sm.full_v(vs.stage), vs.phase);
        sched_sync();
        fence_regs(pa);
        fence_regs(o);
        wg_fence();
        issue_pv(vs.stage);
        wg_commit();
        sched_arrive(true);
        pv_done(true);
    }
    // The tile of set_tile (n_max > 0 key tiles, Q buffer qb_ of parity qphase): O, m and l of
    // this warpgroup's rows over this rank's key tiles. Returns `discard` (an empty key-split chunk).
    __device__ __forceinline__ bool run_tile(int n_max, int qb_, uint32_t qphase, uint8_t* smem_raw) {
        const bool discard = begin_tile(n_max, qb_);
        q_phase = qphase;
        if (PINGPONG && c == NC - 1) named_arrive(BAR_SCHED, 256);  // seed: WG 0 goes first
        skip_first();
        prologue();
        zero_paged_tail(smem_raw);
        key_loop();
        return discard;
    }
};

}  // namespace fc90
