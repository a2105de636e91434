// flashcore: which keys a query row sees. One description of every mask, used by the sm80
// forward, the split-KV decode and the sm90 forward: the band of one row, the key-tile range of a
// block of rows, whether a key tile needs the per-element test (per tile, or as thresholds
// decided once per block of rows), and that test.
//
// Masks are bottom-right aligned: query row i of a sequence of sq rows and sk keys sits on the
// diagonal key i + sk - sq. A mask is a window [diag - wl, diag + wr] around it, a negative bound
// meaning unbounded on that side:
//   MASK_NONE    (0): (-1, -1), every key;
//   MASK_CAUSAL  (1): (-1,  0), keys up to the diagonal;
//   MASK_WINDOW  (2): (p.window_left, p.window_right) at run time.
// A chunked mask (keys of the row's own chunk only) would be one more id whose terms join the
// left and right edges below; the key-tile range and the per-element test need nothing else.
#pragma once
#include <stdint.h>
#include "params.h"

namespace fc {

enum MaskId { MASK_NONE = 0, MASK_CAUSAL = 1, MASK_WINDOW = 2 };

__device__ __forceinline__ int floor_div(int a, int b) {  // b > 0
    return a >= 0 ? a / b : -((-a + b - 1) / b);
}
__device__ __forceinline__ int clamp_i(int x, int lo, int hi) { return x < lo ? lo : (x > hi ? hi : x); }

// The one per-element application: score s of key `key` becomes -inf unless the row's band
// [lo, hi) holds the key; without `lo`, a band with no left bound (no window, or a window whose
// left bound the caller has ruled out). The two spell -inf differently (the same value): the
// compiler shapes the select around a constant it sees early (INFINITY) otherwise than around one
// it folds late, and each form is the one its kernels' SASS was measured with.
__device__ __forceinline__ void mask_score(float& s, int key, int lo, int hi) {
    if (key >= hi || key < lo) s = -__int_as_float(0x7f800000);
}
__device__ __forceinline__ void mask_score(float& s, int key, int hi) {
    if (key >= hi) s = -INFINITY;
}

// Band [lo, hi) of query row `row` (unclamped: lo may be negative; callers test keys < sk).
// (wl, wr): MASK_WINDOW's bounds, not read by the other masks. `off`: the band in offsets from
// key `off` (keys - off), for a kernel that tests constant offsets from its first column.
template <int MASK_ID>
__device__ __forceinline__ void band_limits(int row, int sq, int sk, int wl, int wr, int& lo, int& hi, int off = 0) {
    const int diag = row + sk - sq;
    lo = 0 - off;
    hi = sk - off;
    if (MASK_ID == MASK_CAUSAL) {
        hi = min(hi, diag + 1 - off);
    } else if (MASK_ID == MASK_WINDOW) {
        if (wr >= 0) hi = min(hi, diag + wr + 1 - off);
        if (wl >= 0) lo = max(lo, diag - wl - off);
    }
}
// The band of the row whose diagonal key is i + diag (diag = sk - sq), clamped into [0, sk].
// (wl, wr): the window as in the header ((-1, 0) for causal). Bands move right with the row, so
// rows i_min..i_max see keys [lo(i_min), hi(i_max)) between them and all of them see
// [lo(i_max), hi(i_min)) (the split-KV decode's key range of a row block).
template <int MASK_ID>
__device__ __forceinline__ void band_clamped(int i, int diag, int sk, int wl, int wr, int& lo, int& hi) {
    lo = 0;
    hi = sk;
    if (MASK_ID != MASK_NONE) {
        if (wr >= 0) hi = clamp_i(i + diag + wr + 1, 0, sk);
        if (wl >= 0) lo = clamp_i(i + diag - wl, 0, sk);
    }
}
// Key-tile range [n_min, n_max) (tiles of BN keys) visible to query rows [r0, r1] (inclusive,
// r1 >= r0). Empty when n_max <= n_min.
template <int MASK_ID, int BN>
__device__ __forceinline__ void key_tile_range(int r0, int r1, int sq, int sk, int wl, int wr, int& n_min,
                                               int& n_max) {
    n_min = 0;
    n_max = (sk + BN - 1) / BN;
    if (MASK_ID == MASK_CAUSAL) {
        n_max = min(n_max, floor_div(r1 + sk - sq, BN) + 1);
    } else if (MASK_ID == MASK_WINDOW) {
        if (wr >= 0) n_max = min(n_max, floor_div(r1 + sk - sq + wr, BN) + 1);
        if (wl >= 0) n_min = max(0, floor_div(r0 + sk - sq - wl, BN));
    }
}
// Whether key tile nb (keys [nb*BN, nb*BN+BN)) hides some key from some row of [r0, r1] (the
// ragged tail past sk included): only such tiles take the per-element test.
template <int MASK_ID, int BN>
__device__ __forceinline__ bool tile_needs_mask(int nb, int r0, int r1, int sq, int sk, int wl, int wr) {
    const int c0 = nb * BN, c1 = nb * BN + BN - 1;
    bool need = c1 >= sk;
    if (MASK_ID == MASK_CAUSAL) {
        need |= c1 > r0 + sk - sq;
    } else if (MASK_ID == MASK_WINDOW) {
        if (wr >= 0) need |= c1 > r0 + sk - sq + wr;
        if (wl >= 0) need |= c0 < r1 + sk - sq - wl;
    }
    return need;
}
// tile_needs_mask for rows [r0, r1] as two thresholds, for a kernel that decides them once per
// block of rows and then tests each key tile with one compare per bound: tile nb needs the
// per-element test iff nb >= nb_from (its last key is past sk or right of row r0's band; <= 0
// when every tile is) or nb * BN < key_left (its first key is left of row r1's band; INT_MIN
// without a left bound, so that the compare folds away).
template <int MASK_ID, int BN>
__device__ __forceinline__ void mask_thresholds(int r0, int r1, int sq, int sk, int wl, int wr, int& nb_from,
                                                int& key_left) {
    nb_from = sk / BN;
    key_left = -0x7fffffff - 1;
    if (MASK_ID == MASK_CAUSAL) {
        nb_from = min(nb_from, (r0 + sk - sq + 1) / BN);
    } else if (MASK_ID == MASK_WINDOW) {
        if (wr >= 0) nb_from = min(nb_from, (r0 + sk - sq + wr + 1) / BN);
        if (wl >= 0) key_left = r1 + sk - sq - wl;
    }
}

}  // namespace fc
