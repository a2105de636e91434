//! Which kernel runs a problem: the variant table's first admissible entry for the device.

use super::variants::{self, KDType, KKind, KMask, KvType, Variant};
use super::{select_family, Arch, Device, Options};
use crate::params::{Keys, Mask, Problem, Seqs};
use candle_core::{DType, Result};

/// Rows per TMA box when prefill kernel `v` reads paged problem `p`'s pool through the page table
/// (`Variant::page_box`), or `None`: the pages are gathered into dense scratch first (always
/// with FLASHCORE_PAGED_GATHER=1, an A/B aid).
pub(crate) fn page_box(v: &Variant, p: &Problem, opts: &Options) -> Option<u32> {
    match p.keys {
        Keys::Paged { page_size, .. } if !opts.paged_gather => v.page_box(page_size),
        _ => None,
    }
}

/// A problem's shape in error messages.
pub(crate) fn shape_str(p: &Problem) -> String {
    let mut seqs = match p.seqs {
        Seqs::Dense => String::new(),
        Seqs::Varlen { total_q, total_k } => {
            format!(" varlen total_q={total_q} total_k={total_k} (sq, sk = max)")
        }
    };
    match p.keys {
        Keys::Rows => {}
        Keys::Used => seqs += " seqused_k",
        Keys::Paged {
            page_size,
            num_pages,
            max_pages,
        } => {
            seqs +=
                &format!(" paged page_size={page_size} num_pages={num_pages} max_pages={max_pages}")
        }
    }
    format!(
        "b={} sq={} sk={} hq={} hkv={} d={} {:?} mask={:?}{seqs}",
        p.b, p.sq, p.sk, p.hq, p.hkv, p.d, p.dtype, p.mask
    )
}

/// The compiled head dim a problem's head dim runs on: the smallest of 64, 128, 256 and 512
/// (sm90 only) that holds it (the kernels zero-fill the columns beyond `p.d` in shared memory
/// and never store them; the sm90 narrow twins and the sm80 narrow bodies also skip the
/// 16-column steps past `p.d`).
pub fn kernel_head_dim(d: usize) -> u32 {
    match d {
        0..=64 => 64,
        65..=128 => 128,
        129..=256 => 256,
        _ => 512,
    }
}

/// Largest softmax scale the GPU kernels take. They keep raw f32 `q . k` scores and compute
/// `p = exp2(s * scale_log2 - m * scale_log2)` with one FFMA, where `m * scale_log2` is rounded
/// to f32: the exponent of every key of a row is off by up to half an ulp of `|m| * scale *
/// log2(e)` (m: the row max). That shift is common to the row's keys and cancels in O while it is
/// small; it reaches the bf16 / f16 rounding of P at |m| * scale * log2(e) ~ 2^16 and overflows P
/// past ~2^26 (NaN rows). At scale 2^10 the first needs |q . k| ~ 44; a larger scale makes it
/// likely on ordinary data, so the GPU refuses it (the CPU path takes any finite scale). Below it
/// the bound is on the data (the numeric contract states it).
pub const GPU_MAX_SCALE: f32 = 1024.0;

/// A window bound as the kernels take it: -1 unbounded, else the bound, saturated at `limit`
/// (the problem's sk for the left bound, sq for the right one: validation already dropped
/// bounds at or past it, `params::normalise_mask`, so this only guards the i32 conversion).
pub(crate) fn kernel_bound(bound: Option<usize>, limit: usize) -> i32 {
    match bound {
        None => -1,
        Some(x) if x >= limit => -1,
        Some(x) => x.min(i32::MAX as usize) as i32,
    }
}

fn kmask(m: Mask) -> KMask {
    match m {
        Mask::None => KMask::None,
        Mask::Causal => KMask::Causal,
        Mask::Window { .. } => KMask::Local,
    }
}

/// `FLASHCORE_SKIP_VARIANTS=substr[,substr]`: the dispatcher passes over the variants whose
/// symbol contains one of the substrings and takes the next candidate (an A/B aid for problem
/// classes with several tiles, e.g. `d64_causal_128x128`; src/knobs.rs).
fn skipped(v: &Variant, skip: &[String]) -> bool {
    !skip.is_empty() && {
        let sym = v.symbol();
        skip.iter().any(|x| sym.contains(x.as_str()))
    }
}

/// Whether a causal sm90 problem with `m_blocks` query blocks takes the dynamic tile schedule
/// (a tile counter and a persistent grid; the kernel side is `DYN` in kernels/sm90/fwd.cuh:
/// causal d64/d128, and d256 with 64-key tiles). d64/d128 up to 32 query blocks: +1-16 % at
/// 512-2k, +2-3 % at 4k, but 2-6 % slower than one CTA per tile at 16k (H100). d256
/// up to 8 (1k): +7.4 / +8.3 % at 512 / 1k, but -9 % at 2k, which keeps one
/// CTA per tile. docs/decisions.md#sm90-dynamic-causal-schedule has the tables. Windows (the
/// sm90 window kernels, d64/d128) at any length: a windowed tile walks 2-3 key tiles
/// (docs/decisions.md#sm90-windows). The separate-V d192 and the d512 kernels up to 32, as
/// d128 (d192 causal 1k 214 against 234 us static, H200; d512 not compared).
pub(crate) fn sm90_dynamic(v: &Variant, mask: Mask, m_blocks: usize) -> bool {
    if mask == Mask::None {
        return false;
    }
    match v.head_dim {
        64 | 128 => m_blocks <= 32 || v.mask == KMask::Local,
        192 | 512 => v.v_width > 0 && m_blocks <= 32,
        256 => v.block_n == 64 && m_blocks <= 8,
        _ => false,
    }
}

/// Shared memory per block the dispatcher may plan with: the device's opt-in limit, lowered by
/// `Options::smem_limit` (to run the tiles of smaller GPUs on a big one).
fn smem_budget(dev: &Device, opts: &Options) -> u32 {
    match opts.smem_limit {
        Some(n) => n.min(dev.smem_per_block),
        None => dev.smem_per_block,
    }
}

/// Whether a problem of more query rows than `DECODE_MAX_SQ` runs the split-KV decode kernels
/// on sm_90. The sm90 prefill grid has `ceil(seq_q / 128) * hq * b` CTAs; with fewer than the SMs
/// each walks every key of its tile, or half of them in clusters of two (`kv_splits`). The decode
/// kernel splits the keys over the SMs and pays for its packed 64-row blocks (`h_ratio * seq_q`
/// rows per K/V head and sequence) at mma.sync rates, about 9 us per block at 32k keys: it wins
/// with up to 16 blocks from 4k keys, at head dims up to 128 (d256 packs 32-row blocks).
/// bf16, CUDA events after an L2 flush, us, 32/8 heads d128 causal unless noted
/// (docs/decisions.md#decode-for-few-query-rows). H100, prefill in one CTA per tile -> decode:
/// seq_q 17 over 32k 364-367 -> 148; 32 over 32k 365
/// -> 148 (pages of 64: 370 -> 154); 32 over 8k 99.4 -> 51.2; 32 over 4k 54.5 -> 35.1. H200,
/// prefill in clusters of two -> decode: 17 or 32 over 32k 197 -> 150, 32 over 8k
/// 60.0 -> 51.3, 32 over 4k 37.1 -> 34.7; and where the clusters win (32 blocks): 64 over 32k
/// 196 -> 285 (MHA 200 -> 287), b2 x 32 over 16k 110 -> 154.
fn decode_beats_starved_prefill(p: &Problem, sms: usize) -> bool {
    let blocks = p.b * p.hkv * (p.h_ratio() * p.sq).div_ceil(variants::DECODE_BLOCK_M as usize);
    let tiles = p.sq.div_ceil(variants::SM90_SMALL_BLOCK_M as usize) * p.hq * p.b;
    p.d <= 128 && tiles < sms && blocks <= 16 && p.sk >= 4096
}

/// Clusters of how many CTAs split each query tile's keys on the sm90 key-split twins
/// (`Variant::kv_split`): 2 where the 128-row tiles in clusters of two still fit in one wave on
/// the SMs and there are at least 16 keys per column of the kernel's head dim (1024 at d64, 2048
/// at d128: the exchange grows with the width), else 1 (the twins are not chosen). bf16, CUDA
/// events after an L2 flush (docs/decisions.md#key-split-clusters), us, one CTA per tile ->
/// clusters of 2: H100 1 x 4 x
/// 2048 x 64 26.8 -> 21.9, d128 31.1-31.4 -> 26.2, 1 x 4 x 1024 x 64 17.7 -> 16.9, 1 x 2 x 4096
/// x 64 causal 46.7 -> 32.5, 1 x 1 x 8192 x 128 causal 101 -> 61.3, 1 x 32/8 x 256 rows over 32k
/// keys d128 causal 372 -> 225, 1 x 32/8 x 64 over 4k d128 50.0 -> 35.3; where they lose: 1 x 8
/// x 1024 x 128 20.6-20.9 -> 21.2-21.5, and at 512 keys 1 x 8 x 512 x 64 13.3 -> 15.3, d128 15.1
/// -> 18.1. Clusters of 4 ran as slowly as one CTA per tile or worse (H100 1 x 8 x 512 x 64 24.2
/// us; 1 x 32/8 x 64 over 4k 50.2), as if the GPU did not hold 32 of them at once (not queried).
/// `FLASHCORE_SM90_KV_SPLITS=1|2|4` forces the count wherever the clusters fit one wave (an A/B
/// aid; src/knobs.rs).
pub(crate) fn kv_splits(p: &Problem, sms: usize, opts: &Options) -> usize {
    let forced = opts.sm90_kv_splits;
    let tiles = p.sq.div_ceil(variants::SM90_SMALL_BLOCK_M as usize) * p.hq * p.b;
    match forced {
        Some(n) if tiles * n <= sms => n,
        Some(_) => 1,
        None if tiles * 2 <= sms && p.sk >= 16 * kernel_head_dim(p.d) as usize => 2,
        None => 1,
    }
}

/// The variant that runs `p` on a GPU of family `arch` with `smem` bytes of shared memory per
/// block: the first compiled candidate in the variant table's order of preference that fits.
/// Otherwise an error saying which option has no GPU kernel (yet), or what does not fit.
pub(crate) fn choose(p: &Problem, dev: &Device, opts: &Options) -> Result<&'static Variant> {
    let arch = select_family(dev.major, dev.minor, opts.arch)?;
    let smem = smem_budget(dev, opts);
    let unsupported = |what: String| {
        candle_core::Error::Msg(format!(
            "flashcore: no CUDA kernel for {what} yet [{}]; use the CPU path (tensors on Device::Cpu) or drop the option",
            shape_str(p)
        ))
    };
    let dtype = match p.dtype {
        DType::BF16 => KDType::Bf16,
        DType::F16 => KDType::F16,
        dt => {
            return Err(unsupported(format!(
                "dtype {dt:?} (the GPU kernels take f16 and bf16)"
            )))
        }
    };
    // No kernel takes a chunk: op runs a problem whose chunk survived normalisation as pieces
    // of ordinary attention (src/chunk.rs, docs/decisions.md#chunked-attention), never as if
    // unchunked.
    if let Some(c) = p.chunk {
        return Err(candle_core::Error::Msg(format!(
            "flashcore: internal: chunk Some({c}) reached a kernel launch [{}]; chunked problems run as pieces",
            shape_str(p)
        )));
    }
    // The kernels mask with -inf raw scores and keep the row max of raw scores: that needs a
    // positive scale (0 turns masked scores into NaN, a negative one gives them weight +inf).
    // The scale is folded into the exponent of raw f32 scores (`GPU_MAX_SCALE` says why it is
    // bounded).
    let scale_ok = p.scale > 0.0 && p.scale <= GPU_MAX_SCALE;
    if !scale_ok {
        return Err(unsupported(format!(
            "softmax_scale {} (the GPU kernels take 0 < scale <= 1024)",
            p.scale
        )));
    }
    // One query row per sequence sees all of its keys under the causal mask (bottom-right
    // aligned): the no-mask kernels compute the same, and the decode's balanced splits
    // (`balanced_splits`) run there only.
    let mask = match p.mask {
        Mask::Causal if p.sq == 1 => KMask::None,
        m => kmask(m),
    };
    // q/k and v/o may have different head dims (`Variant::takes_head_dims`): a kernel of the
    // larger one zero-fills the narrower side, unless a separate-V kernel takes the pair.
    let d = kernel_head_dim(p.d.max(p.dv));
    if d as usize > crate::GPU_MAX_HEAD_DIM && arch != Arch::Sm90 {
        let (name, x) = if p.d >= p.dv { ("q", p.d) } else { ("v", p.dv) };
        return Err(candle_core::Error::Msg(format!(
            "flashcore: {name}: head_dim {x} runs on the sm90 kernels only (compute capability 9.0); the sm80 family takes head dims up to {} [{}]",
            crate::GPU_MAX_HEAD_DIM,
            shape_str(p)
        )));
    }
    let d_sepv = (p.d.div_ceil(64) * 64) as u32;
    // Softcap and ALiBi run in score-modifier bodies, packed batches and head dims below the
    // kernel's in the sm80 general bodies (`Variant::admits`).
    let modified = p.softcap.is_some() || p.alibi;
    let general =
        p.seqs != Seqs::Dense || p.keys != Keys::Rows || p.d != d as usize || p.dv != d as usize;
    // The paged twins (`Variant::paged`) take paged prefill over pools of whole power-of-two
    // pages (`tma::encode_pool`) at their full head dim; FLASHCORE_PAGED_GATHER=1 turns them off.
    let whole = |s: &[usize; 3], rows: usize| s[0] == rows * s[1];
    let twin_pages = match p.keys {
        Keys::Paged { page_size, .. } => {
            page_size >= 16
                && page_size.is_power_of_two()
                && whole(&p.k_strides, page_size)
                && whole(&p.v_strides, page_size)
                && !opts.paged_gather
        }
        _ => false,
    };
    let mut candidates: Vec<(&str, KKind)> = Vec::new();
    // FP8 K/V: the split-KV decode kernels only (op.rs sends everything else through the slow
    // path first, `fp8::in_kernel`).
    let kv = if p.kv_fp8 {
        if p.dv != p.d {
            return Err(unsupported(format!(
                "kv_scales: F8E4M3 k/v with head dims {} and {} (the FP8 decode kernels take one head dim for k and v)",
                p.d, p.dv
            )));
        }
        if p.sq > variants::DECODE_MAX_SQ as usize || !p.d.is_multiple_of(16) {
            return Err(unsupported(format!(
                "kv_scales: F8E4M3 k/v with seq_q {} and head_dim {} (the FP8 decode kernels take seq_q <= {} and head dims that are multiples of 16)",
                p.sq,
                p.d,
                variants::DECODE_MAX_SQ
            )));
        }
        candidates.push(("sm80", KKind::Decode));
        KvType::E4m3
    } else {
        // Few query rows against a key range: split-KV decode (memory bound; the sm80 family's
        // mma.sync kernel serves every arch), on sm_90 also a few more over long keys
        // (`decode_beats_starved_prefill`).
        if p.sq <= variants::DECODE_MAX_SQ as usize
            || (arch == Arch::Sm90 && decode_beats_starved_prefill(p, dev.sm_count))
        {
            candidates.push(("sm80", KKind::Decode));
        }
        if arch == Arch::Sm90 {
            candidates.push(("sm90", KKind::Fwd));
        }
        candidates.push(("sm80", KKind::Fwd));
        KvType::Same
    };
    let splits = kv_splits(p, dev.sm_count, opts);
    // The sm90 window kernels take windows with a right bound (kernels/sm90/fwd.cuh `WINDOW`), and
    // only where the dynamic tile schedule applies: a windowed query tile walks a few key tiles, so
    // one CTA per tile spends its time starting up (docs/decisions.md#sm90-windows).
    let sm90_window_ok = |v: &Variant| {
        kernel_bound(p.window().1, p.sq) >= 0
            && sm90_dynamic(v, p.mask, p.sq.div_ceil(v.block_m as usize))
            && !opts.sm90_causal_static
    };
    let mut missing = Vec::new();
    let mut too_big = Vec::new();
    for (family, kind) in candidates {
        // separate-V kernels first (d_qk and d_v apart, each rounded to 64 columns), then the
        // kernels of the larger head dim
        let sepv = variants::candidates(family, kind, dtype, kv, d_sepv, mask)
            .filter(|v| v.v_width > 0 && p.dv != p.d);
        for v in sepv.chain(variants::candidates(family, kind, dtype, kv, d, mask)) {
            if skipped(v, opts.skip_variants) {
                continue;
            }
            if !(opts.compiled)(v) {
                missing.push(format!(
                    "{} (not compiled in this build: FLASHCORE_VARIANTS)",
                    v.symbol()
                ));
            } else if v.smem_bytes() > smem {
                too_big.push(format!("{} needs {} B", v.symbol(), v.smem_bytes()));
            } else if p.sq > v.max_sq as usize
                || !v.admits(modified, general)
                || !v.serves_grid(p.sq, p.hq * p.b, dev.sm_count)
                || !v.takes_head_dims(p.d, p.dv)
                || (v.paged && !(twin_pages && p.d == v.head_dim as usize && p.dv == p.d))
                || (v.kv_split && splits < 2)
                || (v.family == "sm90" && matches!(v.mask, KMask::Local) && !sm90_window_ok(v))
            {
                // a later entry serves longer queries, the problem's softcap choice
                // (`Variant::admits`: softcap twins, kernels with a general body), small
                // problems (`Variant::serves_grid`), head dims wider than a narrow twin's, problems
                // other than a paged twin's, grids that fill the GPU without a key split, or
                // windows the sm90 window kernels do not take
                continue;
            } else {
                return Ok(v);
            }
        }
    }
    if !too_big.is_empty() {
        return Err(unsupported(format!(
            "this GPU's {smem} B of shared memory per block ({})",
            too_big.join(", ")
        )));
    }
    if !missing.is_empty() {
        return Err(unsupported(missing.join(", ")));
    }
    Err(unsupported(format!(
        "{dtype:?} head_dim {d} with mask {:?}",
        p.mask
    )))
}
