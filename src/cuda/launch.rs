//! Loading the kernel fatbins through cudarc and launching on candle's stream. Every driver call
//! is checked; a failure becomes a `candle_core::Error` naming the kernel and the problem shape.

use super::params::FcParams;
use super::variants;
use crate::knobs::knobs;
use cudarc::driver::sys::CUfunction_attribute_enum as Attr;
use cudarc::driver::{CudaFunction, CudaModule, CudaStream, LaunchConfig};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

type Key = (usize, String);

/// A problem's shape in error messages: formatted only when an error is built (the launch path
/// formats nothing on success).
pub(crate) type Shape<'a> = &'a dyn std::fmt::Display;

fn modules() -> &'static Mutex<HashMap<Key, Arc<CudaModule>>> {
    static M: OnceLock<Mutex<HashMap<Key, Arc<CudaModule>>>> = OnceLock::new();
    M.get_or_init(Default::default)
}

/// Loaded functions and their dynamic shared memory limits, per device ordinal, by symbol (looked
/// up by `&str`: no allocation per launch).
type Functions = HashMap<usize, HashMap<String, (CudaFunction, u32)>>;

fn functions() -> &'static Mutex<Functions> {
    static F: OnceLock<Mutex<Functions>> = OnceLock::new();
    F.get_or_init(Default::default)
}

pub(crate) fn err(kernel: &str, shape: Shape, what: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(format!("flashcore: CUDA kernel {kernel} [{shape}]: {what}"))
}

/// The function `symbol` of `family`'s fatbin, loaded once per device, with its dynamic shared
/// memory limit raised to at least `smem` bytes.
pub(crate) fn function(
    stream: &Arc<CudaStream>,
    family: &str,
    symbol: &str,
    smem: u32,
    shape: Shape,
) -> candle_core::Result<CudaFunction> {
    let ctx = stream.context();
    let ordinal = ctx.ordinal();
    let mut fns = functions().lock().unwrap_or_else(|e| e.into_inner());
    if let Some((f, limit)) = fns.get_mut(&ordinal).and_then(|m| m.get_mut(symbol)) {
        if *limit < smem {
            raise_smem(ctx, f, smem, symbol, shape)?;
            *limit = smem;
        }
        return Ok(f.clone());
    }
    let module = {
        let mkey = (ordinal, family.to_string());
        let mut mods = modules().lock().unwrap_or_else(|e| e.into_inner());
        match mods.get(&mkey) {
            Some(m) => m.clone(),
            None => {
                let image = fatbin_image(family).map_err(|e| err(symbol, shape, e))?;
                let m = ctx
                    .load_module(cudarc::nvrtc::Ptx::from_binary(image))
                    .map_err(|e| err(symbol, shape, format!("loading the {family} fatbin: {e}")))?;
                mods.insert(mkey, m.clone());
                m
            }
        }
    };
    let f = module.load_function(symbol).map_err(|e| {
        err(
            symbol,
            shape,
            format!("function not found in the {family} fatbin: {e}"),
        )
    })?;
    if smem > 48 * 1024 {
        raise_smem(ctx, &f, smem, symbol, shape)?;
    }
    fns.entry(ordinal)
        .or_default()
        .insert(symbol.to_string(), (f.clone(), smem.max(48 * 1024)));
    Ok(f)
}

/// The fatbin of `family`: the one embedded at build time or, when `FLASHCORE_FATBIN_DIR` is
/// set and holds `fc_<family>.fatbin`, that file (a kernel-development aid: try a rebuilt
/// kernel family with the same variant table without relinking; see docs/kernel-development.md).
fn fatbin_image(family: &str) -> Result<Vec<u8>, String> {
    if let Some(dir) = &knobs().fatbin_dir {
        let path = dir.join(format!("fc_{family}.fatbin"));
        if path.exists() {
            return std::fs::read(&path)
                .map_err(|e| format!("reading {} (FLASHCORE_FATBIN_DIR): {e}", path.display()));
        }
    }
    variants::fatbin(family)
        .map(|b| b.to_vec())
        .ok_or_else(|| format!("no fatbin for kernel family {family}"))
}

/// Raises `f`'s dynamic shared memory limit to `smem` bytes, after checking the device allows it.
fn raise_smem(
    ctx: &cudarc::driver::CudaContext,
    f: &CudaFunction,
    smem: u32,
    symbol: &str,
    shape: Shape,
) -> candle_core::Result<()> {
    use cudarc::driver::sys::CUdevice_attribute as DevAttr;
    let optin = ctx
        .attribute(DevAttr::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
        .map_err(|e| {
            err(
                symbol,
                shape,
                format!("reading the shared memory limit: {e}"),
            )
        })?;
    if smem as i64 > optin as i64 {
        return Err(err(
            symbol,
            shape,
            format!("needs {smem} B of shared memory per block; this GPU allows {optin} B"),
        ));
    }
    f.set_attribute(
        Attr::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        smem as i32,
    )
    .map_err(|e| {
        err(
            symbol,
            shape,
            format!("setting {smem} B of dynamic shared memory: {e}"),
        )
    })
}

/// Launches `f(params)` through [`launch`] with the attributes `ex`.
pub(crate) fn launch_params(
    stream: &Arc<CudaStream>,
    f: &CudaFunction,
    cfg: LaunchConfig,
    params: &FcParams,
    ex: Ex,
    kernel: &str,
    shape: Shape,
) -> candle_core::Result<()> {
    let mut args = [params as *const FcParams as *mut std::ffi::c_void];
    // SAFETY: the kernel's signature is `(const FcParams)`; `args` holds one pointer to it, alive
    // for the call (the driver copies parameters at launch). Pointers inside `params` refer to
    // live allocations (checked by the caller).
    unsafe { launch(stream, f, cfg, &mut args, ex, kernel, shape) }
}

/// `what` plus the launch geometry (and `how`, e.g. the launch kind), as a kernel error.
fn launch_err(
    kernel: &str,
    shape: Shape,
    cfg: &LaunchConfig,
    how: &str,
    what: String,
) -> candle_core::Error {
    err(
        kernel,
        shape,
        format!(
            "{what} (grid {:?}, block {:?}, smem {} B{how})",
            cfg.grid_dim, cfg.block_dim, cfg.shared_mem_bytes
        ),
    )
}

/// Launch attributes of [`launch`] (sm_90+; [`Ex::NONE`] is an ordinary launch).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Ex {
    /// A programmatic dependent of the previous kernel on the stream: the grid may be scheduled
    /// while the previous one drains, and must execute `griddepcontrol.wait` before it reads
    /// that kernel's output.
    pub pdl: bool,
    /// Thread-block clusters of this many consecutive blocks along x (1: none): the blocks of a
    /// cluster run at the same time on one GPC. The grid's x must be a multiple.
    pub cluster: u32,
}

impl Ex {
    /// An ordinary stream-ordered launch.
    pub const NONE: Ex = Ex {
        pdl: false,
        cluster: 1,
    };

    /// A programmatic dependent launch where `on` (the sm_90 SASS waits with
    /// `griddepcontrol.wait`), unless `FLASHCORE_NO_PDL=1` (then an ordinary stream-ordered
    /// launch, where the wait is a no-op; for debugging; src/knobs.rs).
    pub fn pdl(on: bool) -> Ex {
        Ex {
            pdl: on && !knobs().no_pdl,
            cluster: 1,
        }
    }

    /// Clusters of `n` blocks (1: none).
    pub fn clusters(n: u32) -> Ex {
        Ex {
            pdl: false,
            cluster: n,
        }
    }
}

/// Launches `f(args)` through `cuLaunchKernelEx` with the attributes `ex`: the one launch path of
/// every kernel. Checked: a failure names the kernel, the problem and the launch geometry; with
/// `FLASHCORE_SYNC=1` it also synchronises and reports asynchronous faults against this kernel
/// (debugging aid).
///
/// # Safety
/// `args` must point to values matching the kernel's parameters, alive for the call, and every
/// device pointer among them must refer to a live allocation of the sizes the kernel uses.
pub(crate) unsafe fn launch(
    stream: &Arc<CudaStream>,
    f: &CudaFunction,
    cfg: LaunchConfig,
    args: &mut [*mut std::ffi::c_void],
    ex: Ex,
    kernel: &str,
    shape: Shape,
) -> candle_core::Result<()> {
    use cudarc::driver::sys;
    // the launch kind in an error message (formatted only when an error is built)
    let fail = |what: String| {
        let how = match (ex.pdl, ex.cluster > 1) {
            (true, false) => ", programmatic dependent launch".to_string(),
            (pdl, true) => format!(
                ", clusters of {}{}",
                ex.cluster,
                if pdl {
                    ", programmatic dependent launch"
                } else {
                    ""
                }
            ),
            (false, false) => String::new(),
        };
        launch_err(kernel, shape, &cfg, &how, what)
    };
    if ex.cluster > 1 && !cfg.grid_dim.0.is_multiple_of(ex.cluster) {
        return Err(fail(format!(
            "the grid's x ({}) is not a multiple of the cluster size {}",
            cfg.grid_dim.0, ex.cluster
        )));
    }
    stream
        .context()
        .bind_to_thread()
        .map_err(|e| fail(format!("binding the context: {e}")))?;
    // SAFETY: a zeroed attribute value is valid for every union member; we set the ones we use.
    let mut attrs: [sys::CUlaunchAttribute; 2] = unsafe { std::mem::zeroed() };
    let mut n = 0;
    if ex.pdl {
        attrs[n].id =
            sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attrs[n].value.programmaticStreamSerializationAllowed = 1;
        n += 1;
    }
    if ex.cluster > 1 {
        attrs[n].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
        attrs[n].value.clusterDim.x = ex.cluster;
        attrs[n].value.clusterDim.y = 1;
        attrs[n].value.clusterDim.z = 1;
        n += 1;
    }
    let config = sys::CUlaunchConfig {
        gridDimX: cfg.grid_dim.0,
        gridDimY: cfg.grid_dim.1,
        gridDimZ: cfg.grid_dim.2,
        blockDimX: cfg.block_dim.0,
        blockDimY: cfg.block_dim.1,
        blockDimZ: cfg.block_dim.2,
        sharedMemBytes: cfg.shared_mem_bytes,
        hStream: stream.cu_stream(),
        attrs: attrs.as_mut_ptr(),
        numAttrs: n as u32,
    };
    // SAFETY: as the caller promises for `args`; `config` and its attributes outlive the call.
    let r = unsafe {
        sys::cuLaunchKernelEx(
            &config,
            f.cu_function(),
            args.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(fail(format!("launch failed: {r:?}")));
    }
    check_sync(stream, kernel, shape)
}

pub(crate) fn check_sync(
    stream: &Arc<CudaStream>,
    kernel: &str,
    shape: Shape,
) -> candle_core::Result<()> {
    if knobs().sync {
        stream
            .synchronize()
            .map_err(|e| err(kernel, shape, format!("failed while running: {e}")))?;
    }
    Ok(())
}

/// Fills `n` 16- or 32-bit words at `ptr` with `value` (the poisoning kernels of
/// kernels/common/util.cuh).
pub(crate) fn fill(
    stream: &Arc<CudaStream>,
    ptr: u64,
    n: usize,
    word_bytes: usize,
    value: u32,
) -> candle_core::Result<()> {
    let (sym, shape) = if word_bytes == 2 {
        ("fc_fill_u16", format!("n={n} u16"))
    } else {
        ("fc_fill_u32", format!("n={n} u32"))
    };
    let f = function(stream, "sm80", sym, 0, &shape)?;
    let blocks = n.div_ceil(256).clamp(1, 4096) as u32;
    let cfg = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let n64 = n as u64;
    let v16 = value as u16;
    let vp = if word_bytes == 2 {
        &v16 as *const u16 as *mut std::ffi::c_void
    } else {
        &value as *const u32 as *mut std::ffi::c_void
    };
    let mut args = [
        &ptr as *const u64 as *mut std::ffi::c_void,
        &n64 as *const u64 as *mut std::ffi::c_void,
        vp,
    ];
    // SAFETY: signature (ptr, n, word) of the fill kernel of `word_bytes`, each argument alive
    // for the call; `ptr` points at `n` words of `word_bytes` owned by the caller.
    unsafe { launch(stream, &f, cfg, &mut args, Ex::NONE, sym, &shape) }
}
