//! NCCL, loaded at run time, for the all-reduce of tensor parallelism ([`crate::tp`]).
//!
//! Why not cudarc's `nccl` feature: candle-core fixes cudarc to dynamic *linking*, so that
//! feature would make `libnccl.so.2` a link-time and start-up requirement of every CUDA build
//! of the examples, including machines that never run with `--tp` (CI has no NCCL). Loading it
//! with `dlopen` when `--tp N > 1` asks for it keeps those builds as they are and turns a
//! missing library into an error that says what to install (docs/decisions.md#nccl-at-run-time).
//!
//! Where the library comes from, in order: `--nccl-lib PATH` (or `FLASHCORE_NCCL_LIB`), then
//! `libnccl.so.2` through the dynamic loader's search (LD_LIBRARY_PATH, the system library
//! directories: the `libnccl2` package), then the `nvidia-nccl-cu13` / `-cu12` wheels' `lib`
//! directories under the site-packages of `python3` on PATH, found without running Python.

use anyhow::{bail, Context, Result};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{sys, CudaEvent, CudaStream, DevicePtrMut};
use candle_core::{CpuStorage, CudaStorage, DType, Layout, Tensor};
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::tp::{AllReduce, Meeting};

type NcclComm = *mut c_void;
type NcclResult = c_int;

type GetVersionFn = unsafe extern "C" fn(*mut c_int) -> NcclResult;
type CommInitAllFn = unsafe extern "C" fn(*mut NcclComm, c_int, *const c_int) -> NcclResult;
type AllReduceFn = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    NcclComm,
    sys::CUstream,
) -> NcclResult;
type CommFn = unsafe extern "C" fn(NcclComm) -> NcclResult;
type GroupFn = unsafe extern "C" fn() -> NcclResult;
type ErrorStringFn = unsafe extern "C" fn(NcclResult) -> *const c_char;

/// The entry points used, resolved from the loaded library.
struct Lib {
    get_version: GetVersionFn,
    comm_init_all: CommInitAllFn,
    all_reduce: AllReduceFn,
    comm_destroy: CommFn,
    comm_abort: CommFn,
    group_start: GroupFn,
    group_end: GroupFn,
    error_string: ErrorStringFn,
    path: String,
}

// ncclDataType_t and ncclRedOp_t values (stable across NCCL 2.x).
const NCCL_FLOAT16: c_int = 6;
const NCCL_FLOAT32: c_int = 7;
const NCCL_BFLOAT16: c_int = 9;
const NCCL_SUM: c_int = 0;
const RTLD_NOW: c_int = 2;

extern "C" {
    fn dlopen(filename: *const c_char, flag: c_int) -> *mut c_void;
    fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
    fn dlerror() -> *mut c_char;
}

fn dl_error() -> String {
    // SAFETY: dlerror returns null or a NUL-terminated string owned by the loader.
    unsafe {
        let e = dlerror();
        if e.is_null() {
            "unknown error".into()
        } else {
            CStr::from_ptr(e).to_string_lossy().into_owned()
        }
    }
}

/// `site-packages/nvidia/nccl/lib/libnccl.so.2` candidates next to the `python3` on PATH.
fn wheel_candidates() -> Vec<PathBuf> {
    let mut out = Vec::new();
    let path = std::env::var_os("PATH").unwrap_or_default();
    for dir in std::env::split_paths(&path) {
        if !dir.join("python3").exists() {
            continue;
        }
        let prefixes = [
            dir.join(".."),
            PathBuf::from("/usr/local"),
            PathBuf::from("/usr"),
        ];
        for prefix in prefixes {
            for lib in ["lib", "lib64"] {
                let Ok(entries) = std::fs::read_dir(prefix.join(lib)) else {
                    continue;
                };
                for e in entries.flatten() {
                    let name = e.file_name();
                    if !name.to_string_lossy().starts_with("python3") {
                        continue;
                    }
                    for site in ["site-packages", "dist-packages"] {
                        let p = e.path().join(site).join("nvidia/nccl/lib/libnccl.so.2");
                        if p.is_file() {
                            out.push(p);
                        }
                    }
                }
            }
        }
    }
    out
}

const INSTALL: &str = "install NCCL 2.x: the system package (`apt install libnccl2`), or \
`pip install nvidia-nccl-cu13` and pass its library with --nccl-lib \
<site-packages>/nvidia/nccl/lib/libnccl.so.2 (or put that directory on LD_LIBRARY_PATH)";

impl Lib {
    fn open(explicit: Option<&Path>) -> Result<Lib> {
        let mut tried = Vec::new();
        let mut candidates: Vec<String> = Vec::new();
        if let Some(p) = explicit {
            candidates.push(p.display().to_string());
        } else {
            candidates.push("libnccl.so.2".into());
            candidates.extend(wheel_candidates().iter().map(|p| p.display().to_string()));
        }
        for c in candidates {
            let cs = CString::new(c.clone())?;
            // SAFETY: a NUL-terminated path; the handle is never closed (the library stays
            // loaded for the life of the process, as NCCL's own threads require).
            let h = unsafe { dlopen(cs.as_ptr(), RTLD_NOW) };
            if h.is_null() {
                tried.push(format!("{c}: {}", dl_error()));
                continue;
            }
            return Lib::resolve(h, c);
        }
        bail!(
            "tensor parallelism needs NCCL, which could not be loaded ({}); {INSTALL}",
            tried.join("; ")
        )
    }

    fn resolve(h: *mut c_void, path: String) -> Result<Lib> {
        let sym = |name: &str| -> Result<*mut c_void> {
            let cs = CString::new(name)?;
            // SAFETY: `h` is a live handle from dlopen and `cs` a NUL-terminated name.
            let p = unsafe { dlsym(h, cs.as_ptr()) };
            if p.is_null() {
                bail!("{path}: no symbol {name} ({}); {INSTALL}", dl_error())
            }
            Ok(p)
        };
        // SAFETY: each symbol is transmuted to the C signature NCCL 2.x declares for it.
        unsafe {
            Ok(Lib {
                get_version: std::mem::transmute::<*mut c_void, GetVersionFn>(sym(
                    "ncclGetVersion",
                )?),
                comm_init_all: std::mem::transmute::<*mut c_void, CommInitAllFn>(sym(
                    "ncclCommInitAll",
                )?),
                all_reduce: std::mem::transmute::<*mut c_void, AllReduceFn>(sym("ncclAllReduce")?),
                comm_destroy: std::mem::transmute::<*mut c_void, CommFn>(sym("ncclCommDestroy")?),
                comm_abort: std::mem::transmute::<*mut c_void, CommFn>(sym("ncclCommAbort")?),
                group_start: std::mem::transmute::<*mut c_void, GroupFn>(sym("ncclGroupStart")?),
                group_end: std::mem::transmute::<*mut c_void, GroupFn>(sym("ncclGroupEnd")?),
                error_string: std::mem::transmute::<*mut c_void, ErrorStringFn>(sym(
                    "ncclGetErrorString",
                )?),
                path,
            })
        }
    }

    fn check(&self, r: NcclResult, what: &str) -> Result<()> {
        if r == 0 {
            return Ok(());
        }
        // SAFETY: ncclGetErrorString returns a static NUL-terminated string.
        let msg = unsafe { CStr::from_ptr((self.error_string)(r)) }.to_string_lossy();
        bail!("{what} failed: NCCL error {r}: {msg}")
    }
}

/// Number of CUDA devices on this host.
pub fn device_count() -> Result<usize> {
    use candle_core::cuda_backend::cudarc::driver::CudaContext;
    Ok(CudaContext::device_count().context("counting CUDA devices")? as usize)
}

/// One communicator per rank over GPUs `0..n` of this process, made with `ncclCommInitAll`.
struct Group {
    lib: Lib,
    comms: Vec<NcclComm>,
    /// Set once `ncclCommAbort` has freed the communicators.
    aborted: std::sync::atomic::AtomicBool,
    /// `Some` in grouped launch mode: where the ranks' all-reduces wait for the last to arrive.
    grouped: Option<Meeting<Call>>,
}

/// How the ranks' all-reduces reach NCCL (`FLASHCORE_TP_LAUNCH`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Launch {
    /// Every rank's thread calls `ncclAllReduce` on its own communicator; the ranks' host
    /// threads never wait for each other (the collectives meet on the GPUs). Runs a two-layer
    /// model but hangs on Llama-3-8B shapes (examples/llama/README.md#tensor-parallelism).
    Threads,
    /// Each rank's thread deposits its call; the last to arrive issues all of them between
    /// `ncclGroupStart` and `ncclGroupEnd` (NCCL's single-thread, several-GPU usage), and the
    /// others wait for that: a host rendezvous per all-reduce (`tp::Meeting`). The default.
    Grouped,
}

impl Launch {
    pub fn from_env() -> Result<Launch> {
        match std::env::var("FLASHCORE_TP_LAUNCH").as_deref() {
            Err(_) | Ok("grouped") => Ok(Launch::Grouped),
            Ok("threads") => Ok(Launch::Threads),
            Ok(other) => bail!("FLASHCORE_TP_LAUNCH={other:?}: expected `grouped` or `threads`"),
        }
    }
}

/// One all-reduce call of one rank: buffer, element count, NCCL dtype, stream.
#[derive(Clone, Copy)]
struct Call {
    ptr: usize,
    count: usize,
    dtype: c_int,
    stream: usize,
}

// SAFETY: a communicator is used by one rank's thread at a time (the `Rank` handle owning its
// index), and NCCL communicators may be used from any thread.
unsafe impl Send for Group {}
unsafe impl Sync for Group {}

impl Group {
    /// Issues `calls[r]` on communicator `r` for every rank, inside one NCCL group.
    fn issue_all(&self, calls: &[Call]) -> Result<()> {
        // SAFETY: every call addresses a live buffer of its rank's device, deposited by a rank
        // thread that waits until this returns; each runs on its rank's own communicator.
        unsafe {
            self.lib.check((self.lib.group_start)(), "ncclGroupStart")?;
            for (r, c) in calls.iter().enumerate() {
                let p = c.ptr as *mut c_void;
                let r = (self.lib.all_reduce)(
                    p,
                    p,
                    c.count,
                    c.dtype,
                    NCCL_SUM,
                    self.comms[r],
                    c.stream as sys::CUstream,
                );
                if r != 0 {
                    (self.lib.group_end)();
                    self.lib.check(r, "ncclAllReduce")?;
                }
            }
            self.lib.check((self.lib.group_end)(), "ncclGroupEnd")
        }
    }

    /// Rank `rank`'s all-reduce in the current mode.
    fn all_reduce(&self, rank: usize, call: Call) -> Result<()> {
        let Some(meeting) = &self.grouped else {
            // SAFETY: as in `issue_all`, for this rank's call alone.
            let r = unsafe {
                let p = call.ptr as *mut c_void;
                (self.lib.all_reduce)(
                    p,
                    p,
                    call.count,
                    call.dtype,
                    NCCL_SUM,
                    self.comms[rank],
                    call.stream as sys::CUstream,
                )
            };
            return self.lib.check(r, "ncclAllReduce");
        };
        meeting.meet(rank, call, |calls| self.issue_all(calls))
    }

    fn abort(&self) {
        use std::sync::atomic::Ordering;
        if self.aborted.swap(true, Ordering::SeqCst) {
            return;
        }
        for &c in &self.comms {
            // SAFETY: each communicator came from ncclCommInitAll; after the abort it is never
            // used again (`aborted` is set first and Drop skips it).
            unsafe { (self.lib.comm_abort)(c) };
        }
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        if self.aborted.load(std::sync::atomic::Ordering::SeqCst) {
            return;
        }
        for &c in &self.comms {
            // SAFETY: each communicator was created by ncclCommInitAll and is destroyed once.
            unsafe { (self.lib.comm_destroy)(c) };
        }
    }
}

/// What `--tp` reports about the library and the time spent in all-reduces.
pub struct NcclInfo {
    pub path: String,
    pub version: i32,
}

/// A rank's handle: sums with NCCL on the tensor's device's stream (the stream candle runs
/// every op of that device on), in place on a contiguous copy.
pub struct Rank {
    group: Arc<Group>,
    rank: usize,
    /// With timing on: events around every all-reduce, to report their share of a step.
    timing: Option<Mutex<Vec<(CudaEvent, CudaEvent)>>>,
}

/// Handles for ranks `0..n` (GPU `i` is rank `i`), and what was loaded.
pub fn group(
    n: usize,
    lib_path: Option<&Path>,
    timing: bool,
) -> Result<(Vec<Arc<Rank>>, NcclInfo)> {
    let lib = Lib::open(lib_path)?;
    let mut version: c_int = 0;
    // SAFETY: ncclGetVersion writes one int.
    lib.check(unsafe { (lib.get_version)(&mut version) }, "ncclGetVersion")?;
    let devs: Vec<c_int> = (0..n as c_int).collect();
    let mut comms = vec![std::ptr::null_mut(); n];
    // SAFETY: `comms` has room for `n` handles and `devs` lists `n` device ordinals.
    lib.check(
        unsafe { (lib.comm_init_all)(comms.as_mut_ptr(), n as c_int, devs.as_ptr()) },
        "ncclCommInitAll",
    )?;
    let info = NcclInfo {
        path: lib.path.clone(),
        version,
    };
    let grouped = match Launch::from_env()? {
        Launch::Grouped => Some(Meeting::new(n)),
        Launch::Threads => None,
    };
    let group = Arc::new(Group {
        lib,
        comms,
        aborted: Default::default(),
        grouped,
    });
    let ranks = (0..n)
        .map(|rank| {
            Arc::new(Rank {
                group: group.clone(),
                rank,
                // Rank 0 is the one that reports; the others would only accumulate events.
                timing: (timing && rank == 0).then(|| Mutex::new(Vec::new())),
            })
        })
        .collect();
    Ok((ranks, info))
}

impl Rank {
    /// Milliseconds spent in this rank's all-reduces since the last call (waits for them).
    fn timed_ms(&self) -> Result<f64> {
        let Some(t) = &self.timing else {
            return Ok(0.0);
        };
        let pairs = std::mem::take(&mut *t.lock().map_err(|_| anyhow::anyhow!("poisoned"))?);
        let mut ms = 0.0;
        for (a, b) in &pairs {
            ms += a.elapsed_ms(b)? as f64;
        }
        Ok(ms)
    }
}

/// The in-place NCCL sum as a candle op (so it runs on the storage candle owns, on its stream).
struct SumOp<'a>(&'a Rank);

impl SumOp<'_> {
    fn launch(&self, s: &mut CudaStorage, l: &Layout) -> Result<()> {
        let Some((start, end)) = l.contiguous_offsets() else {
            bail!("all-reduce: the tensor must be contiguous")
        };
        let stream: Arc<CudaStream> = s.device.cuda_stream();
        let (dtype, elem, base) = match s.dtype() {
            DType::BF16 => {
                let p = s
                    .as_cuda_slice_mut::<half::bf16>()?
                    .device_ptr_mut(&stream)
                    .0;
                (NCCL_BFLOAT16, 2, p)
            }
            DType::F16 => {
                let p = s
                    .as_cuda_slice_mut::<half::f16>()?
                    .device_ptr_mut(&stream)
                    .0;
                (NCCL_FLOAT16, 2, p)
            }
            DType::F32 => {
                let p = s.as_cuda_slice_mut::<f32>()?.device_ptr_mut(&stream).0;
                (NCCL_FLOAT32, 4, p)
            }
            other => bail!("all-reduce: dtype {other:?} is not supported (bf16, f16, f32)"),
        };
        let ptr = (base + (start * elem) as u64) as *mut c_void;
        let group = &self.0.group;
        let events = match &self.0.timing {
            Some(_) => Some(stream.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?),
            None => None,
        };
        let trace = std::env::var_os("FLASHCORE_TP_TRACE").is_some();
        if trace {
            eprintln!("rank {} all-reduce of {} enters", self.0.rank, end - start);
        }
        // `ptr` addresses `end - start` elements of `dtype` owned by this storage, on the device
        // of this rank's communicator; NCCL enqueues on candle's stream for that device.
        let call = Call {
            ptr: ptr as usize,
            count: end - start,
            dtype,
            stream: stream.cu_stream() as usize,
        };
        group.all_reduce(self.0.rank, call)?;
        if trace {
            eprintln!("rank {} all-reduce returned", self.0.rank);
        }
        if let (Some(t), Some(a)) = (&self.0.timing, events) {
            let b = stream.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?;
            t.lock()
                .map_err(|_| anyhow::anyhow!("poisoned"))?
                .push((a, b));
        }
        Ok(())
    }
}

impl candle_core::InplaceOp1 for SumOp<'_> {
    fn name(&self) -> &'static str {
        "nccl-all-reduce"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        Err(candle_core::Error::Msg(
            "NCCL all-reduce of a CPU tensor (use tp::LocalSum on the CPU)".into(),
        ))
    }

    fn cuda_fwd(&self, s: &mut CudaStorage, l: &Layout) -> candle_core::Result<()> {
        self.launch(s, l)
            .map_err(|e| candle_core::Error::Msg(format!("{e:#}")))
    }
}

impl AllReduce for Rank {
    fn sum(&self, x: &Tensor) -> Result<Tensor> {
        // A fresh buffer: the sum overwrites it, and `x` may be shared.
        let y = x.force_contiguous()?;
        y.inplace_op1(&SumOp(self))?;
        Ok(y)
    }

    fn take_ms(&self) -> Result<f64> {
        self.timed_ms()
    }

    fn abort(&self) {
        self.group.abort()
    }
}
