//! The CUDA path: picks a kernel family by compute capability ([`arch`]), a kernel from the
//! variant table ([`variants`]), and launches it on candle's stream (`launch`).

pub mod arch;
pub(crate) mod fp8;
mod launch;
pub mod params;
mod tma;
pub mod variants;

pub use arch::{set_arch_override, set_smem_limit_override, Arch};

use crate::knobs::knobs;
use crate::op::Extra;
use crate::params::{Keys, Mask, Problem, Seqs};
use candle_core::cuda_backend::{CudaDevice, CudaStorage};
use candle_core::{DType, Layout, Result, Tensor};
use cudarc::driver::{CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};
use half::{bf16, f16};
use params::FcParams;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use variants::{KDType, KKind, KMask, KvType, Variant};

static POISON: AtomicBool = AtomicBool::new(false);

/// When on, every output buffer is filled with NaN before the kernel runs, so that elements a
/// kernel fails to write show up in tests. Costs one extra fill per output; off by default.
pub fn set_poison_outputs(on: bool) {
    POISON.store(on, Ordering::Relaxed);
}

fn poison_on() -> bool {
    POISON.load(Ordering::Relaxed) || knobs().poison
}

/// Fills a CUDA tensor's storage with NaN (the pipeline check of the crate's tiny kernels).
/// f16/bf16/f32 only.
pub fn poison(t: &Tensor) -> Result<()> {
    let (s, l) = t.storage_and_layout();
    let candle_core::Storage::Cuda(s) = &*s else {
        candle_core::bail!(
            "flashcore: poison: tensor must be on a CUDA device, got {:?}",
            t.device().location()
        )
    };
    let stream = s.device.cuda_stream();
    let n = l.shape().elem_count();
    let off = l.start_offset();
    if !l.is_contiguous() {
        candle_core::bail!(
            "flashcore: poison: tensor must be contiguous, got strides {:?}",
            l.stride()
        );
    }
    match t.dtype() {
        DType::BF16 => {
            let (p, _g) = s.as_cuda_slice::<bf16>()?.device_ptr(&stream);
            launch::fill(&stream, p + 2 * off as u64, n, 2, 0x7FFF)
        }
        DType::F16 => {
            let (p, _g) = s.as_cuda_slice::<f16>()?.device_ptr(&stream);
            launch::fill(&stream, p + 2 * off as u64, n, 2, 0x7FFF)
        }
        DType::F32 => {
            let (p, _g) = s.as_cuda_slice::<f32>()?.device_ptr(&stream);
            launch::fill(&stream, p + 4 * off as u64, n, 4, 0x7FC0_0000)
        }
        dt => candle_core::bail!("flashcore: poison: dtype must be f16, bf16 or f32, got {dt:?}"),
    }
}

/// What the dispatcher needs to know about a GPU, read once per device.
#[derive(Clone, Copy, Debug)]
pub struct DeviceInfo {
    pub major: i32,
    pub minor: i32,
    pub sm_count: usize,
    /// Largest dynamic shared memory a block may opt in to, in bytes (99 KB on sm_86/89, 163 KB
    /// on sm_80, 227 KB on sm_90).
    pub smem_per_block: u32,
    /// Shared memory of one SM, in bytes (228 KB on sm_90); 0 where the driver does not report it.
    pub smem_per_sm: u32,
    /// Shared memory the system reserves per resident block, in bytes (1 KB from sm_80 on; 0
    /// where the driver does not report it).
    pub smem_reserved_per_block: u32,
    /// Peak DRAM bandwidth in bytes per second from the memory clock and bus width (3.35e12 on
    /// the H100 SXM, 4.9e12 on the H200); 0 where the driver does not report them.
    pub dram_bytes_per_s: f64,
}

/// The compute capability and SM count of `dev` (cached per device ordinal).
pub fn device_info(dev: &CudaDevice) -> Result<DeviceInfo> {
    use cudarc::driver::sys::CUdevice_attribute as DevAttr;
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    static CACHE: OnceLock<Mutex<HashMap<usize, DeviceInfo>>> = OnceLock::new();
    let stream = dev.cuda_stream();
    let ctx = stream.context();
    let cache = CACHE.get_or_init(Default::default);
    if let Some(i) = cache
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&ctx.ordinal())
    {
        return Ok(*i);
    }
    let e = |what: &str, err: cudarc::driver::DriverError| {
        candle_core::Error::Msg(format!(
            "flashcore: reading the {what} of CUDA device {}: {err}",
            ctx.ordinal()
        ))
    };
    let (major, minor) = ctx
        .compute_capability()
        .map_err(|err| e("compute capability", err))?;
    let sm_count = ctx
        .attribute(DevAttr::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .map_err(|err| e("multiprocessor count", err))? as usize;
    let smem_per_block = ctx
        .attribute(DevAttr::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
        .map_err(|err| e("shared memory limit", err))? as u32;
    // Read for the decode's occupancy cap (`decode_capped_smem`); a value of 0 (not reported)
    // turns the cap off, a failed query is an error like the others.
    let attr = |a, what: &str| {
        ctx.attribute(a)
            .map_err(|err| e(what, err))
            .map(|x| x.max(0))
    };
    let smem_per_sm = attr(
        DevAttr::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
        "shared memory per multiprocessor",
    )? as u32;
    let smem_reserved_per_block = attr(
        DevAttr::CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK,
        "reserved shared memory per block",
    )? as u32;
    // kHz and bits; double data rate
    let khz = attr(
        DevAttr::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE,
        "memory clock rate",
    )?;
    let bits = attr(
        DevAttr::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH,
        "memory bus width",
    )?;
    let dram_bytes_per_s = khz as f64 * 1e3 * 2.0 * bits as f64 / 8.0;
    let info = DeviceInfo {
        major,
        minor,
        sm_count,
        smem_per_block,
        smem_per_sm,
        smem_reserved_per_block,
        dram_bytes_per_s,
    };
    cache
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(ctx.ordinal(), info);
    Ok(info)
}

/// Which kernel family and variant a problem runs on `dev`: the dispatcher's decision, exposed for
/// the benchmark and tests. A split-KV decode launched in thread-block clusters adds
/// ` (clusters of N)`, and one whose CTAs per SM are capped below what its shared memory allows
/// ` (at most N CTAs per SM)`.
pub fn describe(
    dev: &CudaDevice,
    p: &crate::AttnParams,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
) -> Result<String> {
    let prob = crate::params::validate(q, k, v, p)?;
    if prob.chunk.is_some() {
        // Chunked attention runs as pieces (chunk::dense): each piece's route.
        return crate::chunk::describe_dense(dev, p, q, k, v, &prob);
    }
    let info = device_info(dev)?;
    // d_v != d_qk runs zero-padded to max(d_qk, d_v) (op::apply_padded).
    let (prob, pad) = padded_note(prob);
    let v = choose(&prob, &info)?;
    Ok(pad + &v.symbol() + &route_note(&prob, v, &info))
}

/// For a split-KV decode: `" (clusters of N)"` when it launches in clusters (`decode_cluster`),
/// then `" (at most N CTAs per SM)"` when its CTAs per SM are capped (`decode_capped_smem`). For
/// an sm90 key-split twin: `" (keys split over clusters of N)"` (`kv_splits`). Otherwise empty.
fn route_note(p: &Problem, v: &Variant, info: &DeviceInfo) -> String {
    if v.kv_split {
        return format!(
            " (keys split over clusters of {})",
            kv_splits(p, info.sm_count)
        );
    }
    if v.kind != KKind::Decode {
        return String::new();
    }
    let grid = decode_grid(p, v, info);
    let mut note = String::new();
    if grid.cluster > 1 {
        note += &format!(" (clusters of {})", grid.cluster);
    }
    if let Some(smem) = grid.capped {
        let per = info.smem_per_sm / (smem + info.smem_reserved_per_block);
        let ctas = if per == 1 { "CTA" } else { "CTAs" };
        note += &format!(" (at most {per} {ctas} per SM)");
    }
    note
}

/// The same for a paged problem (`attention_paged` with `q` dense, or `attention_paged_varlen`
/// with `packed_q` = (cu_seqlens_q, max_seqlen_q)): the kernel, and for prefill whether it reads
/// the pool through the page table (`in-kernel, R-row boxes`) or the pages are gathered first
/// (then the kernel that runs on the gathered rows).
#[allow(clippy::too_many_arguments)]
pub fn describe_paged(
    dev: &CudaDevice,
    p: &crate::AttnParams,
    q: &Tensor,
    k_pages: &Tensor,
    v_pages: &Tensor,
    page_table: &Tensor,
    seqlens_k: &Tensor,
    packed_q: Option<(&Tensor, usize)>,
) -> Result<String> {
    let prob =
        crate::params::validate_paged(q, k_pages, v_pages, page_table, seqlens_k, packed_q, p)?;
    if prob.chunk.is_some() {
        // Chunked attention runs as one paged call over pieces (chunk::paged_plan).
        let kv = crate::op::PagedKv {
            k_pages,
            v_pages,
            page_table,
            seqlens_k,
        };
        let plan = crate::chunk::paged_plan(q, &kv, packed_q, &prob, p)?;
        let packed = plan.packed_q.as_ref().map(|(cu, m)| (cu, *m));
        let route = describe_paged(
            dev,
            &plan.params,
            &plan.q,
            k_pages,
            v_pages,
            &plan.page_table,
            &plan.seqlens_k,
            packed,
        )?;
        let c = prob.chunk.unwrap_or(0);
        return Ok(crate::chunk::route_summary(c, plan.pieces, &[route]));
    }
    let info = device_info(dev)?;
    let (prob, pad) = padded_note(prob);
    let v = choose(&prob, &info)?;
    if v.kind == KKind::Decode {
        return Ok(pad + &v.symbol() + &route_note(&prob, v, &info));
    }
    Ok(pad
        + &match page_box(v, &prob) {
            Some(rows) => format!(
                "{}{} (in-kernel, {rows}-row boxes)",
                v.symbol(),
                route_note(&prob, v, &info)
            ),
            None => {
                let mut used = prob.clone();
                used.keys = Keys::Used;
                format!("gathered, then {}", choose(&used, &info)?.symbol())
            }
        })
}

/// The problem a GPU launches for `p`: itself, or with `d_v != d_qk` the zero-padded one
/// ([`Problem::padded`]) and the prefix `"padded to d=D, then "` for the route descriptions.
fn padded_note(p: Problem) -> (Problem, String) {
    if p.dv == p.d {
        return (p, String::new());
    }
    let wide = p.padded();
    let note = format!("padded to d={}, then ", wide.d);
    (wide, note)
}

/// Rows per TMA box when prefill kernel `v` reads paged problem `p`'s pool through the page table
/// (`Variant::page_box`), or `None`: the pages are gathered into dense scratch first (always
/// with FLASHCORE_PAGED_GATHER=1, an A/B aid).
fn page_box(v: &Variant, p: &Problem) -> Option<u32> {
    match p.keys {
        Keys::Paged { page_size, .. } if !paged_gather_forced() => v.page_box(page_size),
        _ => None,
    }
}

fn shape_str(p: &Problem) -> String {
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

/// A problem's shape in error messages ([`shape_str`]), formatted only when an error is built.
#[derive(Clone, Copy)]
struct ShapeOf<'a>(&'a Problem);

impl std::fmt::Display for ShapeOf<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&shape_str(self.0))
    }
}

/// Text built by a closure when displayed (lazy error context).
struct Fmt<F>(F);

impl<F: Fn(&mut std::fmt::Formatter<'_>) -> std::fmt::Result> std::fmt::Display for Fmt<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        (self.0)(f)
    }
}

/// The compiled head dim a problem's head dim runs on: the smallest of 64, 128, 256 that holds
/// it (the kernels zero-fill the columns beyond `p.d` in shared memory and never store them; the
/// sm90 narrow twins and the sm80 narrow bodies also skip the 16-column steps past `p.d`).
pub fn kernel_head_dim(d: usize) -> u32 {
    match d {
        0..=64 => 64,
        65..=128 => 128,
        _ => 256,
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
fn kernel_bound(bound: Option<usize>, limit: usize) -> i32 {
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
fn skipped(v: &Variant) -> bool {
    let skip = &knobs().skip_variants;
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
/// CTA per tile. docs/decisions.md#sm90-dynamic-causal-schedule has the tables.
fn sm90_dynamic(v: &Variant, mask: Mask, m_blocks: usize) -> bool {
    if mask == Mask::None {
        return false;
    }
    match v.head_dim {
        64 | 128 => m_blocks <= 32,
        256 => v.block_n == 64 && m_blocks <= 8,
        _ => false,
    }
}

/// `FLASHCORE_SM90_CAUSAL=static`: causal sm90 problems take the static grids (no tile
/// counter) instead of the dynamic schedule (src/knobs.rs).
fn causal_static() -> bool {
    knobs().sm90_causal_static
}

/// `FLASHCORE_PAGED_GATHER=1`: paged prefill gathers the pages into dense scratch on sm90 too
/// (instead of the kernels reading the pool through the page table): an A/B aid.
fn paged_gather_forced() -> bool {
    knobs().paged_gather
}

/// Shared memory per block the dispatcher may plan with: the device's opt-in limit, lowered by
/// [`arch::smem_limit_override`] (to run the tiles of smaller GPUs on a big one).
fn smem_budget(info: &DeviceInfo) -> Result<u32> {
    Ok(match arch::smem_limit_override()? {
        Some(n) => n.min(info.smem_per_block),
        None => info.smem_per_block,
    })
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
fn kv_splits(p: &Problem, sms: usize) -> usize {
    let forced = knobs().sm90_kv_splits;
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
fn choose(p: &Problem, info: &DeviceInfo) -> Result<&'static Variant> {
    let arch = arch::select(info.major, info.minor)?;
    let smem = smem_budget(info)?;
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
    let d = kernel_head_dim(p.d);
    // Softcap and ALiBi run in score-modifier bodies, packed batches and head dims below the
    // kernel's in the sm80 general bodies (`Variant::admits`).
    let modified = p.softcap.is_some() || p.alibi;
    let general = p.seqs != Seqs::Dense || p.keys != Keys::Rows || p.d != d as usize;
    // The paged twins (`Variant::paged`) take paged prefill over pools of whole power-of-two
    // pages (`tma::encode_pool`) at their full head dim; FLASHCORE_PAGED_GATHER=1 turns them off.
    let whole = |s: &[usize; 3], rows: usize| s[0] == rows * s[1];
    let twin_pages = match p.keys {
        Keys::Paged { page_size, .. } => {
            page_size >= 16
                && page_size.is_power_of_two()
                && whole(&p.k_strides, page_size)
                && whole(&p.v_strides, page_size)
                && !paged_gather_forced()
        }
        _ => false,
    };
    let mut candidates: Vec<(&str, KKind)> = Vec::new();
    // FP8 K/V: the split-KV decode kernels only (op.rs sends everything else through the slow
    // path first, `fp8::in_kernel`).
    let kv = if p.kv_fp8 {
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
            || (arch == Arch::Sm90 && decode_beats_starved_prefill(p, info.sm_count))
        {
            candidates.push(("sm80", KKind::Decode));
        }
        if arch == Arch::Sm90 {
            candidates.push(("sm90", KKind::Fwd));
        }
        candidates.push(("sm80", KKind::Fwd));
        KvType::Same
    };
    let splits = kv_splits(p, info.sm_count);
    // The sm90 window kernels take windows with a right bound (kernels/sm90/fwd.cuh `WINDOW`), and
    // only where the dynamic tile schedule applies: a windowed query tile walks a few key tiles, so
    // one CTA per tile spends its time starting up (docs/decisions.md#sm90-windows).
    let sm90_window_ok = |v: &Variant| {
        kernel_bound(p.window().1, p.sq) >= 0
            && sm90_dynamic(v, p.mask, p.sq.div_ceil(v.block_m as usize))
            && !causal_static()
    };
    let mut missing = Vec::new();
    let mut too_big = Vec::new();
    for (family, kind) in candidates {
        for v in variants::candidates(family, kind, dtype, kv, d, mask) {
            if skipped(v) {
                continue;
            }
            if !variants::is_compiled(v) {
                missing.push(format!(
                    "{} (not compiled in this build: FLASHCORE_VARIANTS)",
                    v.symbol()
                ));
            } else if v.smem_bytes() > smem {
                too_big.push(format!("{} needs {} B", v.symbol(), v.smem_bytes()));
            } else if p.sq > v.max_sq as usize
                || !v.admits(modified, general)
                || !v.serves_grid(p.sq, p.hq * p.b, info.sm_count)
                || (v.narrow > 0 && p.d > v.narrow as usize)
                || (v.paged && !(twin_pages && p.d == v.head_dim as usize))
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

fn ptr<T: candle_core::cuda_backend::CudaDType>(
    s: &CudaStorage,
    l: &Layout,
    stream: &std::sync::Arc<cudarc::driver::CudaStream>,
) -> Result<(u64, usize)> {
    let slice: &CudaSlice<T> = s.as_cuda_slice::<T>()?;
    let (p, _guard) = slice.device_ptr(stream);
    Ok((
        p + (l.start_offset() * std::mem::size_of::<T>()) as u64,
        slice.len() - l.start_offset(),
    ))
}

/// Device address of F8E4M3 K/V storage at its layout's offset (one byte per element).
fn fp8_ptr(
    s: &CudaStorage,
    l: &Layout,
    name: &str,
    stream: &std::sync::Arc<cudarc::driver::CudaStream>,
) -> Result<u64> {
    match &s.slice {
        candle_core::cuda_backend::CudaStorageSlice::F8E4M3(slice) => {
            let (p, _guard) = slice.device_ptr(stream);
            Ok(p + l.start_offset() as u64)
        }
        _ => candle_core::bail!("flashcore: internal: {name} is not F8E4M3 storage"),
    }
}

fn alloc_out<T: candle_core::cuda_backend::CudaDType + cudarc::driver::DeviceRepr>(
    dev: &CudaDevice,
    n: usize,
    shape: launch::Shape,
) -> Result<CudaSlice<T>> {
    // SAFETY: every element is written by the kernel (tests check it with poisoned buffers).
    unsafe { dev.cuda_stream().alloc::<T>(n) }.map_err(|e| {
        launch::err(
            "alloc",
            shape,
            format!("allocating {n} output elements: {e}"),
        )
    })
}

/// The most key-range splits a decode of `sk` keys takes: at least 256 keys and one key tile
/// each, at most 128.
fn decode_max_splits(sk: usize, block_n: usize) -> usize {
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

/// `FLASHCORE_DECODE_EVEN=1`: split-KV decodes split evenly, never balanced over the batch's
/// lengths (an A/B aid; src/knobs.rs).
fn even_splits_forced() -> bool {
    knobs().decode_even
}

/// `FLASHCORE_DECODE_OCCUPANCY=full`: split-KV decode grids run as many CTAs per SM as their
/// shared memory allows, never capped by `decode_capped_smem` (an A/B aid; src/knobs.rs).
fn full_occupancy_forced() -> bool {
    knobs().decode_full_occupancy
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
/// Public for the tests (tests/gpu.rs checks the rule on the H100's, the H200's and the A100's
/// figures without a GPU).
pub fn decode_capped_smem(
    v: &Variant,
    info: &DeviceInfo,
    ctas: usize,
    page_size: Option<usize>,
    sk: usize,
) -> Option<u32> {
    const H100_BYTES_PER_S: f64 = 3.35e12;
    if info.major != 9
        || v.warps < 4
        || info.dram_bytes_per_s <= 0.0
        || info.smem_per_sm == 0
        || full_occupancy_forced()
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
    // K and V tiles of 2-byte elements in flight per CTA; the fewest CTAs that hold the target
    // (5 % slack: the H100's reported clock gives 1.001 x its 64 KB)
    let in_flight = (v.stages * v.block_n * v.head_dim * 2 * 2) as f64;
    let target = 65536.0 * info.dram_bytes_per_s / H100_BYTES_PER_S;
    let mut cap = ((target / in_flight - 0.05).ceil() as usize).max(1);
    let short_pages = page_size.is_some_and(|ps| ps < 2 * v.block_n as usize);
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
struct DecodeGrid {
    even: usize,
    splits: usize,
    ctas: usize,
    capped: Option<u32>,
    cluster: u32,
}

fn decode_grid(p: &Problem, variant: &Variant, info: &DeviceInfo) -> DecodeGrid {
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
    let small_pages = page_size.is_some_and(|ps| ps % bn != 0);
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
    let splits = balanced_splits(p, variant, even, small_pages);
    let ctas = (p.h_ratio() * p.sq).div_ceil(bm) * splits * p.b * p.hkv;
    // Split grids are sized to the SM count (or twice it) already.
    let capped = if splits == 1 {
        decode_capped_smem(variant, info, ctas, page_size, p.sk)
    } else {
        None
    };
    DecodeGrid {
        even,
        splits,
        ctas,
        capped,
        cluster: decode_cluster(info, splits, ctas),
    }
}

/// `FLASHCORE_DECODE_CLUSTER=1`: split-KV decode grids launch without thread-block clusters
/// (an A/B aid; `decode_cluster`; src/knobs.rs).
fn decode_cluster_off() -> bool {
    knobs().decode_cluster_off
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
fn decode_cluster(info: &DeviceInfo, splits: usize, ctas: usize) -> u32 {
    if info.major == 9 && splits == 1 && ctas.is_multiple_of(2) && !decode_cluster_off() {
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
fn balanced_splits(p: &Problem, v: &Variant, even: usize, small_pages: bool) -> usize {
    let lengths_differ = !matches!(p.seqs, Seqs::Dense) || !matches!(p.keys, Keys::Rows);
    let bn = v.block_n as usize;
    if !lengths_differ
        || small_pages
        || even_splits_forced()
        || p.b < 2
        || p.b > 32
        || v.mask != KMask::None
        || p.b * p.sk.div_ceil(bn) >= 1 << 30
    {
        return even;
    }
    (2 * even).min(decode_max_splits(p.sk, bn)).max(even)
}

/// Split-KV decode: the split kernel writes O/LSE directly (one split) or f32 partials that the
/// combine kernel merges by their LSE. Returns whether the combine checked the tables
/// (`combine_checks`: then no `fc_check_seqlens` need follow).
fn decode(
    dev: &CudaDevice,
    p: &Problem,
    variant: &Variant,
    mut prm: FcParams,
    shape: launch::Shape,
) -> Result<bool> {
    let symbol = variants::symbol(variant);
    let stream = dev.cuda_stream();
    let info = device_info(dev)?;
    let DecodeGrid {
        even,
        splits,
        ctas,
        capped,
        cluster,
    } = decode_grid(p, variant, &info);
    // The balanced splits' budget: the even grid's working CTAs per K/V head and a slack of
    // half a split per sequence (without it, 16 sequences of 128..32k keys ran 560 us instead
    // of 425; capping it at one wave did the same).
    prm.split_budget = if splits > even {
        (p.b * even + p.b / 2) as i32
    } else {
        0
    };
    if ctas > i32::MAX as usize {
        return Err(launch::err(
            &symbol,
            shape,
            format!("grid of {ctas} blocks is too large"),
        ));
    }
    prm.num_splits = splits as i32;
    let cfg = LaunchConfig {
        grid_dim: (ctas as u32, 1, 1),
        block_dim: (variant.threads(), 1, 1),
        shared_mem_bytes: capped.unwrap_or(variant.smem_bytes()),
    };
    let f = &launch::function(
        &stream,
        variant.family,
        &symbol,
        cfg.shared_mem_bytes,
        shape,
    )?;
    if splits == 1 {
        if cluster > 1 {
            let ex = launch::Ex {
                pdl: false,
                cluster,
            };
            launch::launch_params_ex(&stream, f, cfg, &prm, ex, &symbol, shape)?;
        } else {
            launch::launch_params(&stream, f, cfg, &prm, &symbol, shape)?;
        }
        return Ok(false);
    }
    // A packed or paged batch's combine checks the tables itself (one check kernel launch less:
    // 1-2 us of a b1 / b8 decode on the H200, docs/decisions.md#programmatic-dependent-launch), for
    // batches whose
    // prefix sums one pass of its 256 threads reads.
    let tables = !matches!(p.seqs, Seqs::Dense) || matches!(p.keys, Keys::Paged { .. });
    let checks = tables && p.b <= 256;
    prm.combine_checks = i32::from(checks);
    let n_lse = splits * p.b * p.hq * p.sq;
    // One allocation for both partials (O first: n_lse rows of the kernel's head dim, which the
    // kernel writes whole even when p.d is smaller, 16-byte aligned; then LSE).
    let kd = variant.head_dim as usize;
    let csym = variants::combine_symbol_of(variant);
    let cf = launch::function(&stream, variant.family, &csym, 0, shape)?;
    let rows = p.b * p.hq * p.sq;
    let ccfg = LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let cshape = Fmt(|f: &mut std::fmt::Formatter<'_>| write!(f, "{shape} splits={splits}"));
    // The partials live in the stream's scratch, which another host thread's call on the same
    // stream would overwrite: the scratch stays locked until both grids are enqueued, so no
    // other call's launches come between this split grid and its combine.
    with_scratch(&stream, |scratch| {
        let (opp, _keep) = grown(&mut scratch.part, &stream, n_lse * (kd + 1)).map_err(|e| {
            launch::err(
                &symbol,
                shape,
                format!(
                    "allocating {} f32 of split-KV scratch: {e}",
                    n_lse * (kd + 1)
                ),
            )
        })?;
        let lpp = opp + (n_lse * kd * 4) as u64;
        if poison_on() {
            launch::fill(&stream, opp, n_lse * (kd + 1), 4, 0x7FC0_0000)?;
        }
        prm.o_partial = opp;
        prm.lse_partial = lpp;
        launch::launch_params(&stream, f, cfg, &prm, &symbol, shape)?;
        // On 9.x the fatbin's sm_90 SASS runs, whose combine waits with griddepcontrol.wait:
        // launch it as a programmatic dependent so it is scheduled while the split grid drains.
        // Elsewhere (sm_8x SASS, or PTX JIT-compiled for a newer GPU) the wait is compiled out:
        // plain launch.
        if info.major == 9 {
            launch::launch_params_pdl(&stream, &cf, ccfg, &prm, &csym, &cshape)
        } else {
            launch::launch_params(&stream, &cf, ccfg, &prm, &csym, &cshape)
        }
    })?;
    Ok(checks)
}

/// Runs the forward on CUDA storages; returns O and, when `want_lse`, the LSE (otherwise the
/// kernels write it to the stream's scratch: no allocation).
pub(crate) fn forward(
    p: &Problem,
    extra: &Extra,
    q: (&CudaStorage, &Layout),
    k: (&CudaStorage, &Layout),
    v: (&CudaStorage, &Layout),
    want_lse: bool,
) -> Result<(CudaStorage, Option<CudaStorage>)> {
    let dev = q.0.device.clone();
    // Validation dropped every window bound no row can reach (left >= sk, right >= sq), so the
    // bounds fit the kernels' int32 band arithmetic and Window{huge, 0} runs the causal kernel.
    debug_assert_eq!(p.mask, crate::params::normalise_mask(p.mask, p.sq, p.sk));
    if p.dv != p.d {
        // op::apply pads such problems to one head dim before they reach a kernel.
        candle_core::bail!(
            "flashcore: internal: a GPU launch needs d_v == d_qk, got {} and {}",
            p.dv,
            p.d
        )
    }
    let variant = choose(p, &device_info(&dev)?)?;
    match p.dtype {
        DType::BF16 => run_typed::<bf16>(&dev, p, variant, extra, q, k, v, want_lse),
        DType::F16 => run_typed::<f16>(&dev, p, variant, extra, q, k, v, want_lse),
        _ => unreachable!("choose() admits only f16 and bf16"),
    }
}

/// Device address of a small contiguous side tensor (ALiBi slopes, prefix sums) on q's device.
fn side_ptr<T: candle_core::cuda_backend::CudaDType>(
    t: &Tensor,
    name: &str,
    stream: &std::sync::Arc<cudarc::driver::CudaStream>,
) -> Result<u64> {
    let (s, l) = t.storage_and_layout();
    let candle_core::Storage::Cuda(s) = &*s else {
        candle_core::bail!("flashcore: {name}: must be on the CUDA device of q")
    };
    if !l.is_contiguous() {
        candle_core::bail!(
            "flashcore: {name}: must be contiguous, got strides {:?}",
            l.stride()
        )
    }
    Ok(ptr::<T>(s, l, stream)?.0)
}

/// Largest grid y / z dimension.
const GRID_YZ: usize = 65535;

#[allow(clippy::too_many_arguments)]
fn run_typed<T: candle_core::cuda_backend::CudaDType + cudarc::driver::DeviceRepr>(
    dev: &CudaDevice,
    p: &Problem,
    variant: &Variant,
    extra: &Extra,
    q: (&CudaStorage, &Layout),
    k: (&CudaStorage, &Layout),
    v: (&CudaStorage, &Layout),
    want_lse: bool,
) -> Result<(CudaStorage, Option<CudaStorage>)> {
    let shape = ShapeOf(p);
    let symbol = variants::symbol(variant);
    let stream = dev.cuda_stream();
    // elements per 16-byte vector of k / v
    let kv_vec = if p.kv_fp8 { 16 } else { 8 };
    for (name, l, m) in [("q", q.1, 8), ("k", k.1, kv_vec), ("v", v.1, kv_vec)] {
        // The kernels load 16-byte vectors: op::run makes misaligned views contiguous first.
        let rank = l.dims().len();
        if !l.start_offset().is_multiple_of(m)
            || l.stride()[..rank - 1].iter().any(|s| !s.is_multiple_of(m))
        {
            return Err(launch::err(
                &symbol,
                &shape,
                format!("{name}: offset and strides must be multiples of {m} elements, got offset {} strides {:?}", l.start_offset(), l.stride()),
            ));
        }
    }
    let (qp, _) = ptr::<T>(q.0, q.1, &stream)?;
    let (kp, vp) = if p.kv_fp8 {
        (
            fp8_ptr(k.0, k.1, "k", &stream)?,
            fp8_ptr(v.0, v.1, "v", &stream)?,
        )
    } else {
        (
            ptr::<T>(k.0, k.1, &stream)?.0,
            ptr::<T>(v.0, v.1, &stream)?.0,
        )
    };
    // F8E4M3 K/V: their scales, both per head or both per tensor (a `(1,)` one beside a
    // `(heads_kv,)` one is broadcast to it; the kernel takes one stride for both).
    let _kv_scales = match &extra.kv_scales {
        Some(s) if p.kv_fp8 => {
            let per_head = |t: &Tensor| -> Result<Tensor> {
                if t.dims() == [p.hkv] {
                    Ok(t.clone())
                } else {
                    t.broadcast_as(p.hkv)?.contiguous()
                }
            };
            Some(if s.k.dims() == s.v.dims() {
                (s.k.clone(), s.v.clone())
            } else {
                (per_head(&s.k)?, per_head(&s.v)?)
            })
        }
        None if !p.kv_fp8 => None,
        _ => candle_core::bail!("flashcore: internal: F8E4M3 k/v without their scales [{shape}]"),
    };
    let (k_scales, v_scales, kv_scale_stride) = match &_kv_scales {
        Some((ks, vs)) => (
            side_ptr::<f32>(ks, "kv_scales.k", &stream)?,
            side_ptr::<f32>(vs, "kv_scales.v", &stream)?,
            i32::from(ks.dims() != [1]),
        ),
        None => (0, 0, 0),
    };
    let (total_q, total_k) = p.totals();
    let paged = matches!(p.keys, Keys::Paged { .. });
    let n_out = total_q * p.hq * p.d;
    let n_lse = p.hq * total_q;
    let o: CudaSlice<T> = alloc_out(dev, n_out, &shape)?;
    let lse: Option<CudaSlice<f32>> = if want_lse {
        Some(alloc_out(dev, n_lse, &shape)?)
    } else {
        None
    };
    let (op, _og) = o.device_ptr(&stream);
    // `_lse_scratch` lives to the end of the call, after every launch that writes `lp`.
    let (lp, _lg, _lse_scratch) = match &lse {
        Some(l) => {
            let (lp, g) = l.device_ptr(&stream);
            (lp, Some(g), None)
        }
        None => {
            // written by the kernels, read by nobody: calls may share it
            let (lp, keep) =
                with_scratch(&stream, |s| grown(&mut s.lse, &stream, n_lse)).map_err(|e| {
                    launch::err(
                        &symbol,
                        &shape,
                        format!("allocating {n_lse} f32 of LSE scratch: {e}"),
                    )
                })?;
            (lp, None, Some(keep))
        }
    };
    if poison_on() {
        launch::fill(&stream, op, n_out, 2, 0x7FFF)?;
        launch::fill(&stream, lp, n_lse, 4, 0x7FC0_0000)?;
    }
    let slopes_ptr = match &extra.alibi_slopes {
        None => 0,
        Some(t) => side_ptr::<f32>(t, "alibi_slopes", &stream)?,
    };
    let sinks_ptr = match &extra.sinks {
        None => 0,
        Some(t) => side_ptr::<f32>(t, "sinks", &stream)?,
    };
    // Where the sequences live: prefix sums of packed q (and of packed k when the keys are rows),
    // keys in use per sequence, the page table.
    let side = |t: &Option<Tensor>, name: &str, want: bool| -> Result<u64> {
        match (t, want) {
            (_, false) => Ok(0),
            (Some(t), true) => side_ptr::<u32>(t, name, &stream),
            (None, true) => candle_core::bail!("flashcore: internal: {name} missing [{shape}]"),
        }
    };
    let varlen_q = p.seqs != Seqs::Dense;
    let varlen_k = varlen_q && p.keys == Keys::Rows;
    let cu_q = side(&extra.cu_q, "cu_seqlens_q", varlen_q)?;
    let cu_k = side(&extra.cu_k, "cu_seqlens_k", varlen_k)?;
    let seqused = side(&extra.seqlens_k, "seqlens_k", p.keys != Keys::Rows)?;
    let page_table = side(&extra.page_table, "page_table", paged)?;
    let (page_size, page_table_stride) = match p.keys {
        Keys::Paged {
            page_size,
            max_pages,
            ..
        } => (page_size as i32, max_pages as i32),
        _ => (0, 0),
    };
    let (wl, wr) = p.window();
    let [qb, qr, qh] = p.q_strides.map(|x| x as i64);
    let [kb, kr, kh] = p.k_strides.map(|x| x as i64);
    let [vb, vr, vh] = p.v_strides.map(|x| x as i64);
    // O (b, sq, hq, d) or (total_q, hq, d) contiguous; LSE (b, hq, sq) or (hq, total_q).
    let (o_batch_stride, lse_batch_stride, lse_head_stride) = if varlen_q {
        (0, 0, total_q as i64)
    } else {
        (
            (p.sq * p.hq * p.d) as i64,
            (p.hq * p.sq) as i64,
            p.sq as i64,
        )
    };
    let prm = FcParams {
        q: qp,
        k: kp,
        v: vp,
        o: op,
        lse: lp,
        alibi_slopes: slopes_ptr,
        sinks: sinks_ptr,
        o_partial: 0,
        lse_partial: 0,
        q_batch_stride: qb,
        q_row_stride: qr,
        q_head_stride: qh,
        k_batch_stride: kb,
        k_row_stride: kr,
        k_head_stride: kh,
        v_batch_stride: vb,
        v_row_stride: vr,
        v_head_stride: vh,
        o_batch_stride,
        o_row_stride: (p.hq * p.d) as i64,
        o_head_stride: p.d as i64,
        lse_batch_stride,
        lse_head_stride,
        cu_seqlens_q: cu_q,
        cu_seqlens_k: cu_k,
        seqused_k: seqused,
        page_table,
        page_table_stride,
        page_size,
        total_q: total_q as i32,
        total_k: total_k as i32,
        alibi_batch_stride: if p.alibi_per_batch { p.hq as i32 } else { 0 },
        page_shift: 0,
        b: p.b as i32,
        hq: p.hq as i32,
        hkv: p.hkv as i32,
        sq: p.sq as i32,
        sk: p.sk as i32,
        d: p.d as i32,
        h_ratio: p.h_ratio() as i32,
        scale: p.scale,
        scale_log2: p.scale * std::f32::consts::LOG2_E,
        softcap: p.softcap.unwrap_or(0.0),
        window_left: kernel_bound(wl, p.sk),
        window_right: kernel_bound(wr, p.sq),
        num_splits: 1,
        combine_checks: 0,
        split_budget: 0,
        kv_scale_stride,
        tile_counter: 0,
        k_scales,
        v_scales,
    };
    // The check kernel reads the tables as the caller gave them (page table included).
    let check_prm = prm;
    // Paged prefill: the prefill kernels read K/V rows, not pages. The pages are gathered into
    // dense scratch (`gather_paged`) and the problem continues on it with the keys in use per
    // sequence (Keys::Used). Paged decode reads through the page table in the kernel.
    //
    // On sm90 the forward kernels read the pool through the page table themselves, box by box
    // (`Variant::page_box`: power-of-two pages, boxes of at least 32 rows, 16 for the d64 kernels
    // and the paged twins); FLASHCORE_PAGED_GATHER=1 gathers there too (an A/B aid).
    let page_box = page_box(variant, p);
    let in_kernel = paged && page_box.is_some();
    let used: Problem;
    let _scratch: Option<Scratch<T>>;
    let (p, variant, prm) = if paged && variant.kind != KKind::Decode && !in_kernel {
        let (p2, prm2, bufs) = gather_paged::<T>(dev, p, prm, &shape)?;
        used = p2;
        _scratch = Some(bufs);
        let v2 = choose(&used, &device_info(dev)?)?;
        (&used, v2, prm2)
    } else {
        _scratch = None;
        (p, variant, prm)
    };
    let (kp, vp) = (prm.k, prm.v);
    let symbol = variants::symbol(variant);
    let smem = variant.smem_bytes();
    // the split-KV decode looks its kernel up itself (with the shared memory of its grid)
    let function = || launch::function(&stream, variant.family, &symbol, smem, &shape);
    // whether the kernels checked the tables themselves (the split-KV combine)
    let checked = match variant.kind {
        KKind::Fwd if variant.family == "sm90" => {
            // (batch, row, head) strides in elements. Packed operands are one batch entry of
            // `total` rows (the kernel's batch coordinate is 0 for them).
            let enc = |base: u64,
                       (seq, batch): (usize, usize),
                       heads: usize,
                       strides: [usize; 3],
                       box_rows: u32,
                       name: &str| {
                let op = tma::Operand {
                    base,
                    d: p.d,
                    seq,
                    heads,
                    batch,
                    strides,
                    box_rows,
                };
                tma::encode(variant.dtype, &op, name).map_err(|e| launch::err(&symbol, &shape, e))
            };
            // (rows, batch entries) of each map: packed operands are one batch entry of `total`
            // rows; a paged pool is `num_pages` entries of `page_size` rows.
            let dims_q = if varlen_q { (total_q, 1) } else { (p.sq, p.b) };
            let mut prm = prm;
            let (dims_k, box_k) = match p.keys {
                Keys::Paged {
                    page_size,
                    num_pages,
                    ..
                } => {
                    let rows = page_box.ok_or_else(|| {
                        launch::err(&symbol, &shape, "internal: paged pool without a box size")
                    })?;
                    prm.page_shift = page_size.trailing_zeros() as i32;
                    ((page_size, num_pages), rows)
                }
                _ if varlen_k => ((total_k, 1), variant.block_n),
                _ => ((p.sk, p.b), variant.block_n),
            };
            let tm_q = enc(qp, dims_q, p.hq, p.q_strides, variant.block_m, "q")?;
            let pool = |base: u64, strides: [usize; 3], name: &str| {
                let (page_size, num_pages) = dims_k;
                let pool = tma::Pool {
                    base,
                    d: p.d,
                    page_size,
                    heads: p.hkv,
                    num_pages,
                    strides,
                    box_rows: box_k,
                };
                tma::encode_pool(variant.dtype, &pool, name)
                    .map_err(|e| launch::err(&symbol, &shape, e))
            };
            let (tm_k, tm_v) = if variant.paged {
                (
                    pool(kp, p.k_strides, "k_pages")?,
                    pool(vp, p.v_strides, "v_pages")?,
                )
            } else {
                (
                    enc(kp, dims_k, p.hkv, p.k_strides, box_k, "k")?,
                    enc(vp, dims_k, p.hkv, p.v_strides, box_k, "v")?,
                )
            };
            // O (written by the op, strides as in `prm`): each consumer warpgroup stores 64 rows
            // (varlen: 16-byte stores instead; the map is still encoded, unused).
            let o_strides =
                [prm.o_batch_stride, prm.o_row_stride, prm.o_head_stride].map(|x| x as usize);
            let tm_o = enc(op, dims_q, p.hq, o_strides, 64, "o")?;
            let m_blocks = p.sq.div_ceil(variant.block_m as usize);
            let tiles = m_blocks * p.hq * p.b;
            // Persistent grid (one CTA per SM looping over tiles). Equal tiles (no mask) take the
            // kernel's static round-robin schedule. Causal problems on a dynamic-schedule kernel
            // draw their tiles from the stream's counter, longest first (`sm90_dynamic`,
            // `tile_counter`). Other causal problems: persistent up to 8 query blocks, else one
            // CTA per tile, the hardware balancing the unequal tiles (persistent again when heads
            // or batch exceed the grid's y / z limit). FLASHCORE_SM90_CAUSAL=static turns the
            // dynamic schedule off (an A/B aid). A grid that does not match the kernel's schedule
            // is slower, never wrong.
            let sms = device_info(dev)?.sm_count.max(1);
            // Key-split twins: one cluster of `splits` CTAs per query tile (`kv_splits`), static
            // schedule; every other kernel gets num_splits = 1 (the dispatcher's split count).
            let splits = if variant.kv_split {
                kv_splits(p, sms)
            } else {
                1
            };
            prm.num_splits = splits as i32;
            let dynamic =
                !variant.kv_split && sm90_dynamic(variant, p.mask, m_blocks) && !causal_static();
            if tiles > i32::MAX as usize {
                return Err(launch::err(
                    &symbol,
                    &shape,
                    format!("{tiles} query tiles: more than 2^31 - 1"),
                ));
            }
            let grid = if variant.kv_split {
                ((tiles * splits) as u32, 1, 1)
            } else if dynamic {
                prm.tile_counter = tile_counter(&stream).map_err(|e| {
                    launch::err(&symbol, &shape, format!("allocating the tile counter: {e}"))
                })?;
                (tiles.min(sms) as u32, 1, 1)
            } else if p.mask == Mask::None || m_blocks <= 8 || p.hq > GRID_YZ || p.b > GRID_YZ {
                (tiles.min(sms) as u32, 1, 1)
            } else {
                (m_blocks as u32, p.hq as u32, p.b as u32)
            };
            let cfg = LaunchConfig {
                grid_dim: grid,
                block_dim: (variant.threads(), 1, 1),
                shared_mem_bytes: smem,
            };
            let f = function()?;
            if splits == 1 {
                let mut b = stream.launch_builder(&f);
                b.arg(&prm).arg(&tm_q).arg(&tm_k).arg(&tm_v).arg(&tm_o);
                // SAFETY: signature (FcParams, CUtensorMap x4) as in kernels/sm90/fwd.cuh; the
                // maps describe the live q/k/v/o buffers whose pointers are in `prm`.
                unsafe { b.launch(cfg) }.map_err(|e| {
                    launch::err(
                        &symbol,
                        &shape,
                        format!(
                            "launch failed (grid {grid:?}, block {}, smem {smem} B): {e}",
                            variant.threads()
                        ),
                    )
                })?;
                launch::check_sync(&stream, &symbol, &shape)?;
            } else {
                // the key-split twins: thread-block clusters of `splits` CTAs
                let ex = launch::Ex {
                    pdl: false,
                    cluster: splits as u32,
                };
                let mut args = [
                    &prm as *const FcParams as *mut std::ffi::c_void,
                    &tm_q as *const _ as *mut std::ffi::c_void,
                    &tm_k as *const _ as *mut std::ffi::c_void,
                    &tm_v as *const _ as *mut std::ffi::c_void,
                    &tm_o as *const _ as *mut std::ffi::c_void,
                ];
                // SAFETY: signature (FcParams, CUtensorMap x4) as in kernels/sm90/fwd.cuh, each
                // argument alive for the call; the maps describe the live q/k/v/o buffers whose
                // pointers are in `prm`.
                unsafe { launch::launch_ex(&stream, &f, cfg, &mut args, ex, &symbol, &shape) }?;
            }
            false
        }
        KKind::Fwd => {
            sm80_fwd(p, variant, prm, &function()?, &stream, &symbol, &shape)?;
            false
        }
        KKind::Decode => decode(dev, p, variant, prm, &shape)?,
    };
    if (varlen_q || paged) && !checked {
        let pdl = device_info(dev)?.major == 9;
        check_seqlens(&stream, &check_prm, n_out, n_lse, &shape, pdl)?;
    }
    drop((_og, _lg, _lse_scratch));
    Ok((
        CudaStorage::wrap_cuda_slice(o, dev.clone()),
        lse.map(|l| CudaStorage::wrap_cuda_slice(l, dev.clone())),
    ))
}

/// Device memory kept per stream (`with_scratch`: per host thread for the per-thread default
/// stream, for the process's life otherwise; an entry keeps its stream alive). Kernels on one
/// stream run one after another, so each launch can use the same buffers as the last one.
#[derive(Default)]
struct StreamScratch {
    /// The sm90 dynamic schedule's tile counter: allocated and zeroed on the stream's first
    /// dynamic launch; each launch leaves it at zero again (the CTA that makes the launch's last
    /// draw resets it, kernels/sm90/fwd.cuh), so no launch pays an allocation and a memset for
    /// a fresh counter (3.8 us of host time per call on the H100 machine's host;
    /// docs/decisions.md#host-path-per-call),
    /// and a replayed CUDA graph finds it zeroed too.
    counter: Option<CudaSlice<i32>>,
    /// f32 scratch the kernels write and nobody returns: the LSE of a call that does not ask for
    /// it, and the split-KV decode's partial O and LSE. Grows to the largest request. A call
    /// keeps a reference to the buffer it was given until its launches are enqueued, so a
    /// buffer replaced by another call's larger request (another host thread's, on a stream
    /// several threads share) is freed (stream-ordered) only after them: the LSE scratch is
    /// taken without holding the lock through the launches.
    lse: Option<Arc<CudaSlice<f32>>>,
    part: Option<Arc<CudaSlice<f32>>>,
}

/// Runs `f` on `stream`'s scratch (`f` must not call this again: not re-entrant).
///
/// The scratch belongs to one CUDA stream of one context, so that a call's kernels and every
/// other call that uses the same buffers are ordered on that stream. A stream handle alone does
/// not name a stream: candle's `CudaDevice::new` runs on the per-thread default stream, handle
/// `CU_STREAM_PER_THREAD`, which is a different stream in every host thread, and handles repeat
/// across devices. So the per-thread stream's scratch is thread-local (one per context), and
/// other streams' scratch is keyed by (context, handle) behind a lock. Before, one scratch per
/// handle was shared by every thread: the kernels of calls made from two threads ran at once on
/// their two streams and wrote each other's split-KV partials and sm90 tile counter
/// (tests/gpu_varlen.rs `paged_decode_from_threads`, docs/decisions.md#per-thread-scratch).
fn with_scratch<R>(
    stream: &std::sync::Arc<cudarc::driver::CudaStream>,
    f: impl FnOnce(&mut StreamScratch) -> R,
) -> R {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    // the Arc keeps the stream and its context (and so both handles) alive
    type Map = HashMap<(usize, usize), (std::sync::Arc<cudarc::driver::CudaStream>, StreamScratch)>;
    /// `CU_STREAM_PER_THREAD` (cuda.h)
    const PER_THREAD: usize = 0x2;
    let key = (
        stream.context().cu_ctx() as usize,
        stream.cu_stream() as usize,
    );
    let fresh = || (stream.clone(), StreamScratch::default());
    if key.1 == PER_THREAD {
        thread_local! {
            // dropped at thread exit, on that thread: its buffers are freed on its own stream
            static MINE: std::cell::RefCell<Map> = Default::default();
        }
        return MINE.with(|m| f(&mut m.borrow_mut().entry(key).or_insert_with(fresh).1));
    }
    static C: OnceLock<Mutex<Map>> = OnceLock::new();
    let mut map = C
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    f(&mut map.entry(key).or_insert_with(fresh).1)
}

/// The device address of `stream`'s tile counter for the sm90 dynamic schedule (`StreamScratch`).
fn tile_counter(
    stream: &std::sync::Arc<cudarc::driver::CudaStream>,
) -> std::result::Result<u64, cudarc::driver::DriverError> {
    with_scratch(stream, |s| {
        if s.counter.is_none() {
            s.counter = Some(stream.alloc_zeros::<i32>(1)?);
        }
        let c = s.counter.as_ref().expect("set above");
        Ok(c.device_ptr(stream).0)
    })
}

/// At least `n` f32 of a stream's scratch buffer `slot` (a field of `StreamScratch`),
/// reallocated when smaller: its device address and a reference that keeps it allocated. The
/// caller holds the reference until its launches that use the address are enqueued on
/// `stream`; a buffer replaced meanwhile is then freed on the stream after those launches
/// (cudarc frees stream-ordered when the last reference drops).
fn grown(
    slot: &mut Option<Arc<CudaSlice<f32>>>,
    stream: &Arc<cudarc::driver::CudaStream>,
    n: usize,
) -> std::result::Result<(u64, Arc<CudaSlice<f32>>), cudarc::driver::DriverError> {
    if slot.as_ref().is_none_or(|b| b.len() < n) {
        // SAFETY: scratch the kernels write before any read (nothing reads the LSE scratch;
        // the combine reads only the partials its split grid wrote).
        *slot = Some(Arc::new(unsafe { stream.alloc::<f32>(n.max(1))? }));
    }
    let b = slot.clone().expect("set above");
    let ptr = b.device_ptr(stream).0;
    Ok((ptr, b))
}

/// The sm80 forward: grid (query blocks, heads, batch) without a mask, (heads, query blocks,
/// batch) with one (the kernels walk the query blocks heaviest first). Grids past the y / z limit
/// fold into several launches over slices of the batch and, without a mask, of the heads (whole
/// K/V head groups): the parameter block's pointers move to each slice.
#[allow(clippy::too_many_arguments)]
fn sm80_fwd(
    p: &Problem,
    variant: &Variant,
    prm: FcParams,
    f: &cudarc::driver::CudaFunction,
    stream: &std::sync::Arc<cudarc::driver::CudaStream>,
    symbol: &str,
    shape: launch::Shape,
) -> Result<()> {
    let m_blocks = p.sq.div_ceil(variant.block_m as usize);
    let masked = variant.mask != KMask::None;
    if masked && m_blocks > GRID_YZ {
        return Err(launch::err(
            symbol,
            shape,
            format!(
                "{m_blocks} query blocks of a masked problem: at most {GRID_YZ} (seq_q <= {})",
                GRID_YZ * variant.block_m as usize
            ),
        ));
    }
    let ratio = p.h_ratio();
    // Heads per launch: all, or (no mask, more than the y limit) whole groups of `ratio`.
    let head_chunk = if masked || p.hq <= GRID_YZ {
        p.hq
    } else {
        (GRID_YZ / ratio) * ratio
    };
    let esz = 2u64;
    for b0 in (0..p.b).step_by(GRID_YZ) {
        let nb = (p.b - b0).min(GRID_YZ);
        for h0 in (0..p.hq).step_by(head_chunk) {
            let nh = (p.hq - h0).min(head_chunk);
            let mut c = prm;
            let (b0i, h0i) = (b0 as i64, h0 as i64);
            let hk0 = (h0 / ratio) as i64;
            c.b = nb as i32;
            c.hq = nh as i32;
            c.hkv = (nh / ratio) as i32;
            c.q = prm.q + esz * (b0i * prm.q_batch_stride + h0i * prm.q_head_stride) as u64;
            c.k = prm.k + esz * (b0i * prm.k_batch_stride + hk0 * prm.k_head_stride) as u64;
            c.v = prm.v + esz * (b0i * prm.v_batch_stride + hk0 * prm.v_head_stride) as u64;
            c.o = prm.o + esz * (b0i * prm.o_batch_stride + h0i * prm.o_head_stride) as u64;
            c.lse = prm.lse + 4 * (b0i * prm.lse_batch_stride + h0i * prm.lse_head_stride) as u64;
            if prm.alibi_slopes != 0 {
                c.alibi_slopes =
                    prm.alibi_slopes + 4 * (b0i * prm.alibi_batch_stride as i64 + h0i) as u64;
            }
            if prm.sinks != 0 {
                c.sinks = prm.sinks + 4 * h0 as u64;
            }
            // the batch slice's entries of the per-sequence tables (0 = absent stays 0)
            let at = |ptr: u64| if ptr == 0 { 0 } else { ptr + 4 * b0 as u64 };
            c.cu_seqlens_q = at(prm.cu_seqlens_q);
            c.cu_seqlens_k = at(prm.cu_seqlens_k);
            c.seqused_k = at(prm.seqused_k);
            let (gx, gy) = if masked {
                (nh, m_blocks)
            } else {
                (m_blocks, nh)
            };
            let cfg = LaunchConfig {
                grid_dim: (gx as u32, gy as u32, nb as u32),
                block_dim: (variant.threads(), 1, 1),
                shared_mem_bytes: variant.smem_bytes(),
            };
            launch::launch_params(stream, f, cfg, &c, symbol, shape)?;
        }
    }
    Ok(())
}

/// After a packed batch's kernels: `fc_check_seqlens` (kernels/common/seqlens.cuh) turns the
/// whole O and LSE into NaN when the prefix sums lie (checked on the device: no host sync).
fn check_seqlens(
    stream: &std::sync::Arc<cudarc::driver::CudaStream>,
    prm: &FcParams,
    n_o: usize,
    n_lse: usize,
    shape: launch::Shape,
    pdl: bool,
) -> Result<()> {
    let sym = "fc_check_seqlens";
    let f = launch::function(stream, "sm80", sym, 0, shape)?;
    // one block per sequence checks its pages (block 0 also the prefix sums)
    let blocks = if prm.page_table != 0 { prm.b as u32 } else { 1 };
    let cfg = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let (no, nl) = (n_o as u64, n_lse as u64);
    if pdl {
        // On 9.x the check reads the tables while the attention kernel drains and waits for it
        // (griddepcontrol.wait) only before filling NaN: its launch leaves the critical path.
        let mut args = [
            prm as *const FcParams as *mut std::ffi::c_void,
            &no as *const u64 as *mut std::ffi::c_void,
            &nl as *const u64 as *mut std::ffi::c_void,
        ];
        // SAFETY: signature (FcParams, u64, u64), as below.
        return unsafe { launch::launch_pdl(stream, &f, cfg, &mut args, sym, shape) };
    }
    let mut b = stream.launch_builder(&f);
    b.arg(prm).arg(&no).arg(&nl);
    // SAFETY: signature (FcParams, u64, u64); the pointers in `prm` are the live O, LSE and
    // prefix-sum buffers of this launch, O holding n_o 16-bit and LSE n_lse f32 elements.
    unsafe { b.launch(cfg) }.map_err(|e| launch::err(sym, shape, format!("launch failed: {e}")))?;
    launch::check_sync(stream, sym, shape)
}

/// Dense K and V scratch a paged cache is gathered into.
type Scratch<T> = (CudaSlice<T>, CudaSlice<T>);

/// Gathers a paged problem's K/V pages into dense `(b, sk, hkv, d)` scratch (`fc_gather_paged`,
/// kernels/common/paged.cuh; rows past a sequence's length zero) and returns the same problem on
/// it with the keys in use per sequence (`Keys::Used`), its parameter block, and the scratch.
fn gather_paged<T: candle_core::cuda_backend::CudaDType + cudarc::driver::DeviceRepr>(
    dev: &CudaDevice,
    p: &Problem,
    prm: FcParams,
    shape: launch::Shape,
) -> Result<(Problem, FcParams, Scratch<T>)> {
    let sym = "fc_gather_paged";
    let stream = dev.cuda_stream();
    let rows = p.b * p.sk;
    if rows > i32::MAX as usize {
        return Err(launch::err(
            sym,
            shape,
            format!(
                "batch * max_pages * page_size = {rows} gathered rows: more than 2^31 - 1 (split the batch)"
            ),
        ));
    }
    let n = rows * p.hkv * p.d;
    let dk: CudaSlice<T> = alloc_out(dev, n, shape)?;
    let dv: CudaSlice<T> = alloc_out(dev, n, shape)?;
    let (dkp, gk) = dk.device_ptr(&stream);
    let (dvp, gv) = dv.device_ptr(&stream);
    let f = launch::function(&stream, "sm80", sym, 0, shape)?;
    let sms = device_info(dev)?.sm_count.max(1);
    let blocks = (n / 8).div_ceil(256).clamp(1, sms * 16);
    let cfg = LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = stream.launch_builder(&f);
    b.arg(&prm).arg(&dkp).arg(&dvp);
    // SAFETY: signature (FcParams, uint4*, uint4*); `prm` describes the live pools, page table
    // and lengths, dk / dv hold b * sk * hkv * d elements of 16 bits.
    unsafe { b.launch(cfg) }.map_err(|e| launch::err(sym, shape, format!("launch failed: {e}")))?;
    launch::check_sync(&stream, sym, shape)?;
    drop((gk, gv));
    let row = p.hkv * p.d;
    let strides = [p.sk * row, row, p.d];
    let used = Problem {
        keys: Keys::Used,
        seqs: match p.seqs {
            Seqs::Dense => Seqs::Dense,
            Seqs::Varlen { total_q, .. } => Seqs::Varlen {
                total_q,
                total_k: rows,
            },
        },
        k_strides: strides,
        v_strides: strides,
        ..p.clone()
    };
    let [kb, kr, kh] = strides.map(|x| x as i64);
    let prm = FcParams {
        k: dkp,
        v: dvp,
        k_batch_stride: kb,
        k_row_stride: kr,
        k_head_stride: kh,
        v_batch_stride: kb,
        v_row_stride: kr,
        v_head_stride: kh,
        page_table: 0,
        page_table_stride: 0,
        page_size: 0,
        total_k: rows as i32,
        ..prm
    };
    Ok((used, prm, (dk, dv)))
}

/// What `append_paged` writes: sequences, rows, and the pool's geometry.
pub(crate) struct Append<'a> {
    pub page_table: &'a Tensor,
    pub positions: &'a Tensor,
    /// Packed new rows: their prefix sums `(b + 1,)`; `None` for a dense `(b, n_new, hkv, d)`.
    pub cu_new: Option<&'a Tensor>,
    pub b: usize,
    pub total: usize,
    pub hkv: usize,
    pub d: usize,
    pub page_size: usize,
    pub num_pages: usize,
    pub max_pages: usize,
}

/// Writes the new rows `src` into the pool (`fc_append_paged`, kernels/common/paged.cuh): one
/// launch for the whole batch. `name` is the pool's argument name (for errors).
pub(crate) fn append_paged(
    pool: (&mut CudaStorage, &Layout),
    src: (&CudaStorage, &Layout),
    a: &Append,
    name: &str,
) -> Result<()> {
    let sym = "fc_append_paged";
    let shape = Fmt(|f: &mut std::fmt::Formatter<'_>| {
        write!(
            f,
            "{name}: {} new rows into {} pages of {} x {} x {}, batch {}",
            a.total, a.num_pages, a.page_size, a.hkv, a.d, a.b
        )
    });
    if a.total == 0 {
        return Ok(());
    }
    let dev = pool.0.device.clone();
    let stream = dev.cuda_stream();
    let (pl, sl) = (pool.1, src.1);
    // The kernel moves 16-byte chunks of 16-bit elements: F8E4M3 rows move as rows of half as
    // many 16-bit elements (strides and head dim halved), so they need multiples of 16.
    use candle_core::backend::BackendStorage;
    let e = if pool.0.dtype() == DType::F8E4M3 {
        2
    } else {
        1
    };
    if e == 2 && !a.d.is_multiple_of(16) {
        candle_core::bail!(
            "flashcore: {name}: the GPU append into F8E4M3 pools needs a head_dim that is a multiple of 16, got {}",
            a.d
        )
    }
    if !pl.start_offset().is_multiple_of(8 * e)
        || pl.stride()[..3].iter().any(|s| !s.is_multiple_of(8 * e))
    {
        candle_core::bail!(
            "flashcore: {name}: the GPU append needs offset and strides that are multiples of {} elements, got offset {} strides {:?}",
            8 * e,
            pl.start_offset(),
            pl.stride()
        )
    }
    let rank = sl.dims().len();
    if !sl.start_offset().is_multiple_of(8 * e)
        || sl.stride()[..rank - 1]
            .iter()
            .any(|s| !s.is_multiple_of(8 * e))
    {
        return Err(launch::err(
            sym,
            &shape,
            format!(
                "internal: misaligned new rows (offset {}, strides {:?})",
                sl.start_offset(),
                sl.stride()
            ),
        ));
    }
    let ss = sl.stride();
    let (s_b, s_r, s_h) = if a.cu_new.is_some() {
        (0, ss[0], ss[1])
    } else {
        (ss[0], ss[1], ss[2])
    };
    let ps = pl.stride();
    let (dst, src_ptr) = match pool.0.dtype() {
        DType::F8E4M3 => (
            fp8_ptr(pool.0, pl, name, &stream)?,
            fp8_ptr(src.0, sl, "new rows", &stream)?,
        ),
        DType::BF16 => (
            ptr::<bf16>(pool.0, pl, &stream)?.0,
            ptr::<bf16>(src.0, sl, &stream)?.0,
        ),
        DType::F16 => (
            ptr::<f16>(pool.0, pl, &stream)?.0,
            ptr::<f16>(src.0, sl, &stream)?.0,
        ),
        dt => candle_core::bail!(
            "flashcore: {name}: no CUDA append for dtype {dt:?} yet (the GPU kernels take f16 and bf16)"
        ),
    };
    let pt = side_ptr::<u32>(a.page_table, "page_table", &stream)?;
    let pos = side_ptr::<u32>(a.positions, "positions", &stream)?;
    let cu = match a.cu_new {
        Some(t) => side_ptr::<u32>(t, "cu_seqlens_new", &stream)?,
        None => 0,
    };
    let n_new = if a.cu_new.is_some() { 0 } else { a.total / a.b };
    let f = launch::function(&stream, "sm80", sym, 0, &shape)?;
    let chunks = a.total * a.hkv * a.d / e / 8;
    let sms = device_info(&dev)?.sm_count.max(1);
    let cfg = LaunchConfig {
        grid_dim: (chunks.div_ceil(256).clamp(1, sms * 16) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let i = |x: usize| (x / e) as i64;
    let n32 = |x: usize| x as i32;
    let (sb, sr, sh) = (i(s_b), i(s_r), i(s_h));
    let (pp, pr, ph) = (i(ps[0]), i(ps[1]), i(ps[2]));
    let (b, nn, total, hkv, d) = (n32(a.b), n32(n_new), n32(a.total), n32(a.hkv), n32(a.d / e));
    let (psz, np, mp) = (n32(a.page_size), n32(a.num_pages), n32(a.max_pages));
    let mut lb = stream.launch_builder(&f);
    lb.arg(&src_ptr).arg(&dst).arg(&pt).arg(&pos).arg(&cu);
    lb.arg(&sb).arg(&sr).arg(&sh).arg(&pp).arg(&pr).arg(&ph);
    lb.arg(&b)
        .arg(&nn)
        .arg(&total)
        .arg(&hkv)
        .arg(&d)
        .arg(&psz)
        .arg(&np)
        .arg(&mp);
    // SAFETY: signature as fc_append_paged in kernels/common/paged.cuh; src holds `total` rows of
    // the given strides, the pool `num_pages` pages, the tables b (x max_pages) u32 entries; the
    // kernel writes only rows whose page id is inside the pool.
    unsafe { lb.launch(cfg) }
        .map_err(|e| launch::err(sym, &shape, format!("launch failed: {e}")))?;
    launch::check_sync(&stream, sym, &shape)
}
