//! The split-KV decode's grid: key-range splits, balanced splits, occupancy cap and clusters.

use super::variants::{KMask, KvType, Variant};
use super::{Device, Options};
use crate::params::{Keys, Problem, Seqs};

/// The most key-range splits a decode of `sk` keys takes: at least 256 keys and one key tile
/// each, at most 128.
pub(crate) fn decode_max_splits(sk: usize, block_n: usize) -> usize {
    const MIN_KEYS: usize = 256;
    const MAX_SPLITS: usize = 128;
    (sk / MIN_KEYS).min(MAX_SPLITS).min(sk.div_ceil(block_n))
}

#[allow(clippy::too_many_arguments)]
/// Number of key-range splits for the decode kernels: about one CTA per slot (`sm_count`: the
/// SM count, or twice it where `decode` wants two CTAs per SM), each split at least 256 keys, at
/// most 128 splits; the smallest count within 5% of the best wave efficiency.
pub fn decode_num_splits(
    b: usize,
    hkv: usize,
    hq: usize,
    sq: usize,
    sk: usize,
    sm_count: usize,
    block_m: usize,
    block_n: usize,
) -> usize {
    let rows = (hq / hkv) * sq;
    let base = b * hkv * rows.div_ceil(block_m);
    let slots = sm_count.max(1);
    let n_tiles = sk.div_ceil(block_n);
    let max_splits = decode_max_splits(sk, block_n);
    if max_splits <= 1 || base * 5 >= slots * 4 {
        return 1;
    }
    let eff = |s: usize| {
        let ctas = base * s;
        ctas as f64 / (ctas.div_ceil(slots) * slots) as f64
    };
    let best = (1..=max_splits).map(eff).fold(0.0, f64::max);
    let pick = (1..=max_splits)
        .find(|&s| eff(s) >= 0.95 * best)
        .unwrap_or(1);
    // Even tile split: drop splits that would get no tile.
    let per = n_tiles.div_ceil(pick);
    n_tiles.div_ceil(per)
}

/// Dynamic shared memory that caps a one-split decode grid of `ctas` blocks at fewer resident
/// CTAs per SM than its shared memory allows, or `None` to launch it as it is. `page_size`: the
/// paged pool's page rows; `sk`: the grid's keys per sequence.
///
/// A decode streams K/V once, and past what hides DRAM latency more loads in flight cost
/// bandwidth. H100 (3.35 TB/s), bf16, 32/8 heads, contiguous cache
/// (docs/decisions.md#decode-occupancy-cap):
/// d128 at b64 × 32k 2781 µs with two CTAs per SM (128 KB of K/V in flight per SM), 2728 with
/// one (64 KB); d64 at b64 × 16k 734 µs with five (160 KB), 703 with two. The cap aims at the
/// fewest CTAs that keep 64 KB per SM in flight, scaled by the DRAM bandwidth: the H200
/// (4.9 TB/s) ran the same grids 1-5 % slower capped at the H100's 64 KB; its 94 KB leave
/// d128 uncapped and cap d64 at three CTAs per SM only where that fills the waves. Two CTAs per
/// SM stay at least where one CTA alone waits at its start or pays a new page every tile:
/// - pools of pages shorter than two key tiles (d128 at b64 × 32k, pages of 64: 2824 µs with
///   one CTA per SM against 2813 with two),
/// - sequences of fewer than 8192 keys whose uncapped grid already fills its last wave (d128
///   at b64 × 4k: pages of 256 372.2 against 369.0 µs, the contiguous cache 366.7 against
///   364.9; from 8k keys on one CTA gained, 2805 → 2785 µs at 32k, pages of 256).
///
/// It applies where it was measured: sm_90, CTAs of at least 4 warps (d256's 2-warp CTAs ran
/// 6 % slower alone on an SM), a grid larger than one capped wave whose last wave is at least
/// 85 % full (d128 at b24 × 32k, 1.45 capped waves, ran 5-6 % slower on paged pools; at b48,
/// 0.97 of a second capped wave against 0.45 uncapped, 5-7 % faster).
///
/// Public for the tests (they check the rule on the H100's, the H200's and the A100's figures
/// without a GPU).
pub fn decode_capped_smem(
    v: &Variant,
    info: &Device,
    opts: &Options,
    ctas: usize,
    page_size: Option<usize>,
    sk: usize,
) -> Option<u32> {
    const H100_BYTES_PER_S: f64 = 3.35e12;
    // (FP8 K/V: the e4m3 kernels widen every element in registers, so they keep every CTA
    // their shared memory allows)
    if info.major != 9
        || v.warps < 4
        || matches!(v.kv, KvType::E4m3)
        || info.dram_bytes_per_s <= 0.0
        || info.smem_per_sm == 0
        || opts.decode_full_occupancy
    {
        return None;
    }
    let (sms, per_sm, reserved) = (
        info.sm_count,
        info.smem_per_sm as usize,
        info.smem_reserved_per_block as usize,
    );
    let natural = per_sm / (v.smem_bytes() as usize + reserved);
    let fill = |per: usize| {
        let wave = per * sms;
        ctas as f64 / (ctas.div_ceil(wave) * wave) as f64
    };
    // K and V bytes in flight per CTA (16-bit tiles); the fewest CTAs that hold the target
    // (5 % slack: the H100's reported clock gives 1.001 x its 64 KB)
    let in_flight = (v.stages * v.block_n_16bit() * v.head_dim * 2 * 2) as f64;
    let target = 65536.0 * info.dram_bytes_per_s / H100_BYTES_PER_S;
    let mut cap = ((target / in_flight - 0.05).ceil() as usize).max(1);
    let short_pages = page_size.is_some_and(|ps| ps < 2 * v.block_n_16bit() as usize);
    if short_pages || (sk < 8192 && fill(natural) >= 0.85) {
        cap = cap.max(2);
    }
    if cap >= natural || ctas <= cap * sms || fill(cap) < 0.85 {
        return None;
    }
    // cap + 1 blocks of this footprint must not fit in the SM
    let smem = (per_sm / (cap + 1) + 1)
        .saturating_sub(reserved)
        .next_multiple_of(128);
    (smem <= info.smem_per_block as usize).then(|| (smem as u32).max(v.smem_bytes()))
}

/// A split-KV decode launch: key-range splits per sequence (`even`: the even split count), the
/// grid's blocks, the dynamic shared memory that caps its CTAs per SM (`decode_capped_smem`;
/// `None`: the kernel's own), and its thread-block clusters (`decode_cluster`; 1: none).
pub(crate) struct DecodeGrid {
    pub even: usize,
    pub splits: usize,
    pub ctas: usize,
    pub capped: Option<u32>,
    pub cluster: u32,
}

pub(crate) fn decode_grid(
    p: &Problem,
    variant: &Variant,
    info: &Device,
    opts: &Options,
) -> DecodeGrid {
    let sms = info.sm_count;
    let (bm, bn) = (variant.block_m as usize, variant.block_n as usize);
    // A paged cache whose pages split a key tile (page_size % block_n != 0: pages of 16 or 32)
    // aims its splits at two CTAs per SM, which hides more of the several pages per tile. H100
    // bf16, 32/8 heads d128, pages of 16, against the contiguous cache (splits doubled, rows then
    // looked up one by one; docs/decisions.md#split-kv-decode): b8 x 4k/8k/32k 0.91/0.88/0.83 ->
    // 0.95/0.95/0.93,
    // b1 x 8k/32k 0.88/0.89 -> 0.92/0.91; pages of 64 and 256 (one page per tile) gained nothing.
    // With a page per warp and tile (H200) one CTA per SM still loses at b1 and b8:
    // b8 x 8k / 32k 0.980 / 1.001 with two, 0.914 / 0.904 with one.
    let page_size = match p.keys {
        Keys::Paged { page_size, .. } => Some(page_size),
        _ => None,
    };
    // (counted in 16-bit tiles: an e4m3 tile of 2 x 64 keys holds the bytes of one of 64)
    let small_pages = page_size.is_some_and(|ps| ps % variant.block_n_16bit() as usize != 0);
    let slots = if small_pages { 2 * sms } else { sms };
    let even = decode_num_splits(p.b, p.hkv, p.hq, p.sq, p.sk, slots, bm, bn);
    // A packed or paged batch's lengths differ, and the host does not know them (they are on
    // the GPU): the split kernel balances its splits over them (`balanced_tps` in
    // kernels/sm80/decode.cuh), on a grid of up to twice the even split count per sequence
    // (the longest sequence's splits; a short one leaves its extra splits empty). H100, bf16,
    // 32/8 heads d128, pages of 64, against even splits (docs/decisions.md#balanced-decode-splits):
    // 8 sequences
    // of 1k..32k keys 234 -> 167 us, 16 of 128..32k 556 -> 438, 32 of 128..8k 198 -> 170; equal
    // lengths lose 1-3 % (the empty splits), 32 of them 5 % (a combine where none ran).
    let splits = balanced_splits(p, variant, even, small_pages, opts);
    let ctas = (p.h_ratio() * p.sq).div_ceil(bm) * splits * p.b * p.hkv;
    // Split grids are sized to the SM count (or twice it) already.
    let capped = if splits == 1 {
        decode_capped_smem(variant, info, opts, ctas, page_size, p.sk)
    } else {
        None
    };
    DecodeGrid {
        even,
        splits,
        ctas,
        capped,
        cluster: decode_cluster(info, splits, ctas, opts),
    }
}

/// Thread-block cluster size of a split-KV decode launch: 2 for one-split grids of an even
/// block count on sm_90, else 1 (no cluster). The grid's consecutive blocks are the K/V heads of
/// one sequence, so a cluster pairs two heads that read the same cache rows (the same pages of a
/// paged pool) and runs them together on one GPC. H100, bf16, L2 flushed, µs, clusters of 2
/// against none (docs/decisions.md#decode-clusters): d128 32/8 b64 × 32k pages of 64 2802.2–2810.5
/// against 2812.5–2821.1 (FA4's paged decode 2808.7–2816.5 in the same calls), pages of 256 and
/// the contiguous cache within ±0.2 %; d64 b64 × 16k 703 → 699 (pages of 256 718.7 → 715.7); d256 16/4 b64 × 16k
/// 1410 → 1398 (pages of 64 1428.6 → 1412.4). Clusters of 4 or 8 ran 2–20 % slower (the GPC's
/// slots no longer fill), and the multi-split grids of b1/b8 0–1 % slower with pairs (19.2 →
/// 19.4 µs at b1 × 4k): those launch without. The H200 ran every case within ±0.1 % either way.
fn decode_cluster(info: &Device, splits: usize, ctas: usize, opts: &Options) -> u32 {
    if info.major == 9 && splits == 1 && ctas.is_multiple_of(2) && !opts.decode_cluster_off {
        2
    } else {
        1
    }
}

/// Splits per sequence of a split-KV decode grid that balances its splits over the batch's
/// lengths (more than `even`), or `even` where the kernel splits evenly: dense batches (equal
/// lengths), one sequence, masked kernels (a causal decode of one row runs unmasked), more
/// than 32 sequences (`balanced_tps` holds one per lane), keys too short to split (256 per
/// split), and pages smaller than a key tile (their even splits already aim at two CTAs per
/// SM; balanced, 2 / 4 / 16 sequences of mixed lengths at pages of 16 ran 4-10 % slower, 8
/// and 32 sequences 14-16 % faster: not taken).
fn balanced_splits(
    p: &Problem,
    v: &Variant,
    even: usize,
    small_pages: bool,
    opts: &Options,
) -> usize {
    let lengths_differ = !matches!(p.seqs, Seqs::Dense) || !matches!(p.keys, Keys::Rows);
    let bn = v.block_n as usize;
    if !lengths_differ
        || small_pages
        || opts.decode_even
        || p.b < 2
        || p.b > 32
        || v.mask != KMask::None
        || p.b * p.sk.div_ceil(bn) >= 1 << 30
    {
        return even;
    }
    (2 * even).min(decode_max_splits(p.sk, bn)).max(even)
}
