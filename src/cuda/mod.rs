//! The CUDA path: picks a kernel family by compute capability ([`arch`]), a kernel from the
//! variant table ([`variants`]), and launches it on candle's stream ([`launch`]).

pub mod arch;
mod launch;
pub mod params;
mod tma;
pub mod variants;

pub use arch::{set_arch_override, set_smem_limit_override, Arch};

use crate::params::{Mask, Problem};
use candle_core::cuda_backend::{CudaDevice, CudaStorage};
use candle_core::{DType, Layout, Result, Tensor};
use cudarc::driver::{CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};
use half::{bf16, f16};
use params::FcParams;
use std::sync::atomic::{AtomicBool, Ordering};
use variants::{KDType, KKind, KMask, Variant};

static POISON: AtomicBool = AtomicBool::new(false);

/// When on, every output buffer is filled with NaN before the kernel runs, so that elements a
/// kernel fails to write show up in tests. Costs one extra fill per output; off by default.
pub fn set_poison_outputs(on: bool) {
    POISON.store(on, Ordering::Relaxed);
}

fn poison_on() -> bool {
    static ENV: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    POISON.load(Ordering::Relaxed)
        || *ENV.get_or_init(|| std::env::var_os("FLASHCORE_POISON").is_some_and(|v| v != "0"))
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
    let info = DeviceInfo {
        major,
        minor,
        sm_count,
        smem_per_block,
    };
    cache
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(ctx.ordinal(), info);
    Ok(info)
}

/// Which kernel family and variant a problem runs on `dev`: the dispatcher's decision, exposed for
/// the benchmark and tests.
pub fn describe(
    dev: &CudaDevice,
    p: &crate::AttnParams,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
) -> Result<String> {
    let prob = crate::params::validate(q, k, v, p)?;
    let info = device_info(dev)?;
    let v = choose(
        &prob,
        arch::select(info.major, info.minor)?,
        smem_budget(&info)?,
    )?;
    Ok(v.symbol())
}

fn shape_str(p: &Problem) -> String {
    format!(
        "b={} sq={} sk={} hq={} hkv={} d={} {:?} mask={:?}",
        p.b, p.sq, p.sk, p.hq, p.hkv, p.d, p.dtype, p.mask
    )
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
/// classes with several tiles, e.g. `d64_causal_128x128`). Read once.
fn skipped(v: &Variant) -> bool {
    static ENV: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    let skip = ENV.get_or_init(|| {
        std::env::var("FLASHCORE_SKIP_VARIANTS")
            .map(|s| {
                s.split(',')
                    .filter(|x| !x.is_empty())
                    .map(String::from)
                    .collect()
            })
            .unwrap_or_default()
    });
    !skip.is_empty() && {
        let sym = v.symbol();
        skip.iter().any(|x| sym.contains(x.as_str()))
    }
}

/// Whether a causal sm90 problem with `m_blocks` query blocks takes the dynamic tile schedule
/// (a tile counter and a persistent grid; the kernel side is `DYN` in kernels/sm90/fwd.cuh:
/// causal d64/d128, and d256 with 64-key tiles). d64/d128 up to 32 query blocks: +1-16 % at
/// 512-2k, +2-3 % at 4k, but 2-6 % slower than one CTA per tile at 16k (H100, session 3). d256
/// up to 8 (1k): +7.4 / +8.3 % at 512 / 1k, but -9 % at 2k (session 7, call H), which keeps one
/// CTA per tile. docs/perf.md has the tables.
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

/// `FLASHCORE_SM90_CAUSAL=static`: causal sm90 problems take session 2's grids (no tile
/// counter) instead of the dynamic schedule. Read once.
fn causal_static() -> bool {
    static ENV: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ENV.get_or_init(|| std::env::var("FLASHCORE_SM90_CAUSAL").is_ok_and(|v| v == "static"))
}

/// Shared memory per block the dispatcher may plan with: the device's opt-in limit, lowered by
/// [`arch::smem_limit_override`] (to run the tiles of smaller GPUs on a big one).
fn smem_budget(info: &DeviceInfo) -> Result<u32> {
    Ok(match arch::smem_limit_override()? {
        Some(n) => n.min(info.smem_per_block),
        None => info.smem_per_block,
    })
}

/// The variant that runs `p` on a GPU of family `arch` with `smem` bytes of shared memory per
/// block: the first compiled candidate in the variant table's order of preference that fits.
/// Otherwise an error saying which option has no GPU kernel (yet), or what does not fit.
fn choose(p: &Problem, arch: Arch, smem: u32) -> Result<&'static Variant> {
    let shape = shape_str(p);
    let unsupported = |what: String| {
        candle_core::Error::Msg(format!(
            "flashcore: no CUDA kernel for {what} yet [{shape}]; use the CPU path (tensors on Device::Cpu) or drop the option"
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
    if p.alibi {
        return Err(unsupported("ALiBi slopes".into()));
    }
    // The kernels mask with -inf raw scores and keep the row max of raw scores: that needs a
    // positive scale (0 turns masked scores into NaN, a negative one gives them weight +inf).
    if p.scale <= 0.0 {
        return Err(unsupported(format!(
            "softmax_scale {} (the GPU kernels take a scale > 0)",
            p.scale
        )));
    }
    let mask = kmask(p.mask);
    let d = p.d as u32;
    let mut candidates: Vec<(&str, KKind)> = Vec::new();
    // Few query rows against a key range: split-KV decode (memory bound; the sm80 family's
    // mma.sync kernel serves every arch).
    if p.sq <= variants::DECODE_MAX_SQ as usize {
        candidates.push(("sm80", KKind::Decode));
    }
    if arch == Arch::Sm90 {
        candidates.push(("sm90", KKind::Fwd));
    }
    candidates.push(("sm80", KKind::Fwd));
    let mut missing = Vec::new();
    let mut too_big = Vec::new();
    for (family, kind) in candidates {
        for v in variants::candidates(family, kind, dtype, d, mask) {
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
            } else if p.sq > v.max_sq as usize || !v.admits_softcap(p.softcap.is_some()) {
                // a later entry serves longer queries, or the problem's softcap choice
                // (`Variant::admits_softcap`: softcap twins, kernels with a softcap body)
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

fn alloc_out<T: candle_core::cuda_backend::CudaDType + cudarc::driver::DeviceRepr>(
    dev: &CudaDevice,
    n: usize,
    shape: &str,
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

#[allow(clippy::too_many_arguments)]
/// Number of key-range splits for the decode kernels: about one CTA per SM, each split at
/// least 256 keys, at most 128 splits; the smallest count within 5% of the best wave efficiency.
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
    const MIN_KEYS: usize = 256;
    const MAX_SPLITS: usize = 128;
    let rows = (hq / hkv) * sq;
    let base = b * hkv * rows.div_ceil(block_m);
    let slots = sm_count.max(1);
    let n_tiles = sk.div_ceil(block_n);
    let max_splits = (sk / MIN_KEYS).min(MAX_SPLITS).min(n_tiles);
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

/// Split-KV decode: the split kernel writes O/LSE directly (one split) or f32 partials that the
/// combine kernel merges by their LSE.
fn decode(
    dev: &CudaDevice,
    p: &Problem,
    variant: &Variant,
    mut prm: FcParams,
    f: &cudarc::driver::CudaFunction,
    shape: &str,
) -> Result<()> {
    let symbol = variant.symbol();
    let stream = dev.cuda_stream();
    let info = device_info(dev)?;
    let sms = info.sm_count;
    let (bm, bn) = (variant.block_m as usize, variant.block_n as usize);
    let splits = decode_num_splits(p.b, p.hkv, p.hq, p.sq, p.sk, sms, bm, bn);
    let row_blocks = (p.h_ratio() * p.sq).div_ceil(bm);
    let ctas = row_blocks * splits * p.b * p.hkv;
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
        shared_mem_bytes: variant.smem_bytes(),
    };
    if splits == 1 {
        return launch::launch_params(&stream, f, cfg, &prm, &symbol, shape);
    }
    let n_lse = splits * p.b * p.hq * p.sq;
    // One allocation for both partials (O first: n_lse * d floats, 16-byte aligned; then LSE).
    let part: CudaSlice<f32> = alloc_out(dev, n_lse * (p.d + 1), shape)?;
    let (opp, _g1) = part.device_ptr(&stream);
    let lpp = opp + (n_lse * p.d * 4) as u64;
    if poison_on() {
        launch::fill(&stream, opp, n_lse * (p.d + 1), 4, 0x7FC0_0000)?;
    }
    prm.o_partial = opp;
    prm.lse_partial = lpp;
    launch::launch_params(&stream, f, cfg, &prm, &symbol, shape)?;
    let dtype = variant.dtype;
    let csym = variants::combine_symbol(variant.family, dtype, variant.head_dim);
    let cf = launch::function(&stream, variant.family, &csym, 0, shape)?;
    let rows = p.b * p.hq * p.sq;
    let ccfg = LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let cshape = format!("{shape} splits={splits}");
    // On 9.x the fatbin's sm_90 SASS runs, whose combine waits with griddepcontrol.wait: launch it
    // as a programmatic dependent so it is scheduled while the split grid drains. Elsewhere
    // (sm_8x SASS, or PTX JIT-compiled for a newer GPU) the wait is compiled out: plain launch.
    if info.major == 9 {
        launch::launch_params_pdl(&stream, &cf, ccfg, &prm, &csym, &cshape)
    } else {
        launch::launch_params(&stream, &cf, ccfg, &prm, &csym, &cshape)
    }
}

/// Runs the forward on CUDA storages; returns (O, LSE).
pub(crate) fn forward(
    p: &Problem,
    slopes: Option<&Tensor>,
    q: (&CudaStorage, &Layout),
    k: (&CudaStorage, &Layout),
    v: (&CudaStorage, &Layout),
) -> Result<(CudaStorage, CudaStorage)> {
    let dev = q.0.device.clone();
    let info = device_info(&dev)?;
    let variant = choose(
        p,
        arch::select(info.major, info.minor)?,
        smem_budget(&info)?,
    )?;
    match p.dtype {
        DType::BF16 => run_typed::<bf16>(&dev, p, variant, slopes, q, k, v),
        DType::F16 => run_typed::<f16>(&dev, p, variant, slopes, q, k, v),
        _ => unreachable!("choose() admits only f16 and bf16"),
    }
}

#[allow(clippy::too_many_arguments)]
fn run_typed<T: candle_core::cuda_backend::CudaDType + cudarc::driver::DeviceRepr>(
    dev: &CudaDevice,
    p: &Problem,
    variant: &Variant,
    slopes: Option<&Tensor>,
    q: (&CudaStorage, &Layout),
    k: (&CudaStorage, &Layout),
    v: (&CudaStorage, &Layout),
) -> Result<(CudaStorage, CudaStorage)> {
    let shape = shape_str(p);
    let symbol = variant.symbol();
    let stream = dev.cuda_stream();
    for (name, l) in [("q", q.1), ("k", k.1), ("v", v.1)] {
        // The kernels load 16-byte vectors: op::run makes misaligned views contiguous first.
        if !l.start_offset().is_multiple_of(8)
            || l.stride()[..3].iter().any(|s| !s.is_multiple_of(8))
        {
            return Err(launch::err(
                &symbol,
                &shape,
                format!("{name}: offset and strides must be multiples of 8 elements, got offset {} strides {:?}", l.start_offset(), l.stride()),
            ));
        }
    }
    let (qp, _) = ptr::<T>(q.0, q.1, &stream)?;
    let (kp, _) = ptr::<T>(k.0, k.1, &stream)?;
    let (vp, _) = ptr::<T>(v.0, v.1, &stream)?;
    let n_out = p.b * p.sq * p.hq * p.d;
    let n_lse = p.b * p.hq * p.sq;
    let o: CudaSlice<T> = alloc_out(dev, n_out, &shape)?;
    let lse: CudaSlice<f32> = alloc_out(dev, n_lse, &shape)?;
    let (op, _og) = o.device_ptr(&stream);
    let (lp, _lg) = lse.device_ptr(&stream);
    if poison_on() {
        launch::fill(&stream, op, n_out, 2, 0x7FFF)?;
        launch::fill(&stream, lp, n_lse, 4, 0x7FC0_0000)?;
    }
    let slopes_ptr = match slopes {
        None => 0,
        Some(t) => {
            let (s, l) = t.storage_and_layout();
            let candle_core::Storage::Cuda(s) = &*s else {
                candle_core::bail!("flashcore: alibi_slopes: must be on the CUDA device of q")
            };
            if !l.is_contiguous() {
                candle_core::bail!(
                    "flashcore: alibi_slopes: must be contiguous, got strides {:?}",
                    l.stride()
                )
            }
            ptr::<f32>(s, l, &stream)?.0
        }
    };
    let (wl, wr) = p.window();
    let st = |l: &Layout| {
        let s = l.stride();
        (s[0] as i64, s[1] as i64, s[2] as i64)
    };
    let (qb, qr, qh) = st(q.1);
    let (kb, kr, kh) = st(k.1);
    let (vb, vr, vh) = st(v.1);
    let prm = FcParams {
        q: qp,
        k: kp,
        v: vp,
        o: op,
        lse: lp,
        alibi_slopes: slopes_ptr,
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
        o_batch_stride: (p.sq * p.hq * p.d) as i64,
        o_row_stride: (p.hq * p.d) as i64,
        o_head_stride: p.d as i64,
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
        window_left: wl.map_or(-1, |x| x.min(i32::MAX as usize) as i32),
        window_right: wr.map_or(-1, |x| x.min(i32::MAX as usize) as i32),
        num_splits: 1,
        _pad: 0,
        tile_counter: 0,
    };
    let smem = variant.smem_bytes();
    let f = launch::function(&stream, variant.family, &symbol, smem, &shape)?;
    match variant.kind {
        KKind::Fwd if variant.family == "sm90" => {
            let strides = |l: &Layout| {
                let s = l.stride();
                [s[0], s[1], s[2]]
            };
            // (batch, row, head) strides in elements
            let enc = |base: u64,
                       seq: usize,
                       heads: usize,
                       strides: [usize; 3],
                       box_rows: u32,
                       name: &str| {
                let op = tma::Operand {
                    base,
                    d: p.d,
                    seq,
                    heads,
                    batch: p.b,
                    strides,
                    box_rows,
                };
                tma::encode(variant.dtype, &op, name).map_err(|e| launch::err(&symbol, &shape, e))
            };
            let tm_q = enc(qp, p.sq, p.hq, strides(q.1), variant.block_m, "q")?;
            let tm_k = enc(kp, p.sk, p.hkv, strides(k.1), variant.block_n, "k")?;
            let tm_v = enc(vp, p.sk, p.hkv, strides(v.1), variant.block_n, "v")?;
            // O (written by the op, strides as in `prm`): each consumer warpgroup stores 64 rows.
            let o_strides =
                [prm.o_batch_stride, prm.o_row_stride, prm.o_head_stride].map(|x| x as usize);
            let tm_o = enc(op, p.sq, p.hq, o_strides, 64, "o")?;
            let m_blocks = p.sq.div_ceil(variant.block_m as usize);
            let tiles = m_blocks * p.hq * p.b;
            // Persistent grid (one CTA per SM looping over tiles). Equal tiles (no mask) take the
            // kernel's static round-robin schedule. Causal problems on a dynamic-schedule kernel
            // draw their tiles from a zeroed counter, longest first (`sm90_dynamic`). Other
            // causal problems: persistent up to 8 query blocks, else one CTA per tile, the
            // hardware balancing the unequal tiles. FLASHCORE_SM90_CAUSAL=static turns the dynamic
            // schedule off (an A/B aid). A grid that does not match the kernel's schedule is
            // slower, never wrong.
            let sms = device_info(dev)?.sm_count.max(1);
            let dynamic = sm90_dynamic(variant, p.mask, m_blocks) && !causal_static();
            let mut prm = prm;
            let _counter: Option<CudaSlice<i32>>;
            let grid = if dynamic {
                let c = stream.alloc_zeros::<i32>(1).map_err(|e| {
                    launch::err(&symbol, &shape, format!("allocating the tile counter: {e}"))
                })?;
                prm.tile_counter = c.device_ptr(&stream).0;
                _counter = Some(c);
                (tiles.min(sms) as u32, 1, 1)
            } else if p.mask == Mask::None || m_blocks <= 8 {
                _counter = None;
                (tiles.min(sms) as u32, 1, 1)
            } else {
                _counter = None;
                if p.hq > 65535 || p.b > 65535 {
                    return Err(launch::err(
                        &symbol,
                        &shape,
                        "heads_q and batch must each be <= 65535",
                    ));
                }
                (m_blocks as u32, p.hq as u32, p.b as u32)
            };
            let cfg = LaunchConfig {
                grid_dim: grid,
                block_dim: (variant.threads(), 1, 1),
                shared_mem_bytes: smem,
            };
            let mut b = stream.launch_builder(&f);
            b.arg(&prm).arg(&tm_q).arg(&tm_k).arg(&tm_v).arg(&tm_o);
            // SAFETY: signature (FcParams, CUtensorMap x4) as in kernels/sm90/fwd.cuh; the maps
            // describe the live q/k/v/o buffers whose pointers are in `prm`.
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
        }
        KKind::Fwd => {
            let m_blocks = p.sq.div_ceil(variant.block_m as usize);
            // Masked kernels take (heads, query blocks, batch) and walk the query blocks
            // heaviest first (kernels/sm80/fwd.cuh).
            let (gx, gy) = if variant.mask == KMask::None {
                (m_blocks, p.hq)
            } else {
                (p.hq, m_blocks)
            };
            if gy > 65535 || p.b > 65535 {
                return Err(launch::err(
                    &symbol,
                    &shape,
                    format!("grid ({gx}, {gy}, {}): query blocks (masked) or heads_q, and batch, must each be <= 65535", p.b),
                ));
            }
            let cfg = LaunchConfig {
                grid_dim: (gx as u32, gy as u32, p.b as u32),
                block_dim: (variant.threads(), 1, 1),
                shared_mem_bytes: smem,
            };
            launch::launch_params(&stream, &f, cfg, &prm, &symbol, &shape)?;
        }
        KKind::Decode => decode(dev, p, variant, prm, &f, &shape)?,
    }
    drop((_og, _lg));
    Ok((
        CudaStorage::wrap_cuda_slice(o, dev.clone()),
        CudaStorage::wrap_cuda_slice(lse, dev.clone()),
    ))
}
