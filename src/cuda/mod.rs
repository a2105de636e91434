//! The CUDA path: reads the device once ([`device_info`]), asks the planner (src/plan/) what to
//! launch, and executes the plan on candle's stream (`run`, `launch`).

mod append;
pub mod arch;
pub(crate) mod fp8;
mod launch;
pub mod params;
mod run;
mod scratch;
mod tma;
pub mod variants;

pub use crate::plan::Device as DeviceInfo;
pub use crate::plan::{decode_num_splits, kernel_head_dim, GPU_MAX_SCALE};
pub(crate) use append::append_paged;
pub use arch::{set_arch_override, set_smem_limit_override, Arch};
pub(crate) use run::forward;

use crate::knobs::knobs;
use crate::params::{Keys, Problem};
use crate::plan::{Launch, Options, Plan};
use candle_core::cuda_backend::{CudaDevice, CudaStorage};
use candle_core::{DType, Layout, Result, Tensor};
use cudarc::driver::{CudaSlice, DevicePtr};
use half::{bf16, f16};
use std::sync::atomic::{AtomicBool, Ordering};
use variants::Variant;

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

/// The planner's options in force: the kernels this build compiled and the `FLASHCORE_*` knobs
/// (src/knobs.rs) with the programmatic overrides ([`set_arch_override`],
/// [`set_smem_limit_override`]).
fn options() -> Result<Options<'static>> {
    let k = knobs();
    Ok(Options {
        compiled: variants::is_compiled,
        arch: arch::forced()?,
        smem_limit: arch::smem_limit_override()?,
        skip_variants: &k.skip_variants,
        sm90_causal_static: k.sm90_causal_static,
        sm90_kv_splits: k.sm90_kv_splits,
        paged_gather: k.paged_gather,
        decode_even: k.decode_even,
        decode_full_occupancy: k.decode_full_occupancy,
        decode_cluster_off: k.decode_cluster_off,
    })
}

/// The plan for problem `p` on `dev` with the options in force.
fn plan_on(dev: &CudaDevice, p: &Problem) -> Result<Plan> {
    crate::plan::plan(p, &device_info(dev)?, &options()?)
}

/// Dynamic shared memory that caps a one-split decode grid of `ctas` blocks below the CTAs per
/// SM its shared memory allows, or `None` (`plan::decode_capped_smem` with the options in force).
pub fn decode_capped_smem(
    v: &Variant,
    info: &DeviceInfo,
    ctas: usize,
    page_size: Option<usize>,
    sk: usize,
) -> Option<u32> {
    let opts = Options {
        decode_full_occupancy: knobs().decode_full_occupancy,
        ..Options::default()
    };
    crate::plan::decode_capped_smem(v, info, &opts, ctas, page_size, sk)
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
    // d_v != d_qk runs zero-padded to max(d_qk, d_v) where the kernel needs one head dim
    // (op::apply_padded).
    let (prob, pad) = padded_note(prob);
    let info = device_info(dev)?;
    let v = crate::plan::choose(&prob, &info, &options()?)?;
    Ok(pad + &v.symbol() + &route_note(dev, &prob, v, &info)?)
}

/// For a split-KV decode `v`: `" (clusters of N)"` when it launches in clusters, then
/// `" (at most N CTAs per SM)"` when its CTAs per SM are capped (`decode_capped_smem`). For an
/// sm90 key-split twin: `" (keys split over clusters of N)"`. Otherwise empty.
fn route_note(dev: &CudaDevice, p: &Problem, v: &Variant, info: &DeviceInfo) -> Result<String> {
    if !v.kv_split && v.kind != variants::KKind::Decode {
        return Ok(String::new());
    }
    let plan = plan_on(dev, p)?;
    Ok(match plan.launch {
        Launch::Sm90 { splits, .. } if plan.variant.kv_split => {
            format!(" (keys split over clusters of {splits})")
        }
        Launch::Decode { grid, capped, .. } => {
            let mut note = String::new();
            if grid.cluster > 1 {
                note += &format!(" (clusters of {})", grid.cluster);
            }
            if let Some(smem) = capped {
                let per = info.smem_per_sm / (smem + info.smem_reserved_per_block);
                let ctas = if per == 1 { "CTA" } else { "CTAs" };
                note += &format!(" (at most {per} {ctas} per SM)");
            }
            note
        }
        _ => String::new(),
    })
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
        let kv = crate::params::PagedKv {
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
    let opts = options()?;
    let v = crate::plan::choose(&prob, &info, &opts)?;
    if v.kind == variants::KKind::Decode {
        return Ok(pad + &v.symbol() + &route_note(dev, &prob, v, &info)?);
    }
    Ok(pad
        + &match crate::plan::page_box(v, &prob, &opts) {
            Some(rows) => format!(
                "{}{} (in-kernel, {rows}-row boxes)",
                v.symbol(),
                route_note(dev, &prob, v, &info)?
            ),
            None => {
                let mut used = prob.clone();
                used.keys = Keys::Used;
                format!(
                    "gathered, then {}",
                    crate::plan::choose(&used, &info, &opts)?.symbol()
                )
            }
        })
}

/// The problem a GPU launches for `p`: itself, or where op.rs pads ([`Problem::gpu_pads`]) the
/// zero-padded one ([`Problem::padded`]) and the prefix `"padded to d=D, then "` for the route
/// descriptions.
fn padded_note(p: Problem) -> (Problem, String) {
    if !p.gpu_pads() {
        return (p, String::new());
    }
    let wide = p.padded();
    let note = format!("padded to d={}, then ", wide.d);
    (wide, note)
}

/// A problem's shape in error messages (`plan::shape_str`), formatted only when an error is
/// built.
#[derive(Clone, Copy)]
struct ShapeOf<'a>(&'a Problem);

impl std::fmt::Display for ShapeOf<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&crate::plan::shape_str(self.0))
    }
}

/// Text built by a closure when displayed (lazy error context).
struct Fmt<F>(F);

impl<F: Fn(&mut std::fmt::Formatter<'_>) -> std::fmt::Result> std::fmt::Display for Fmt<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        (self.0)(f)
    }
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
