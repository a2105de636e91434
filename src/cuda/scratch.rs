//! Device memory kept per CUDA stream between calls: the sm90 tile counter, the LSE nobody asked
//! for and the split-KV partials.

use cudarc::driver::{CudaSlice, DevicePtr};
use std::sync::Arc;

/// Device memory kept per stream (`with_scratch`: per host thread for the per-thread default
/// stream, for the process's life otherwise; an entry keeps its stream alive). Kernels on one
/// stream run one after another, so each launch can use the same buffers as the last one.
#[derive(Default)]
pub(super) struct StreamScratch {
    /// The sm90 dynamic schedule's tile counter: allocated and zeroed on the stream's first
    /// dynamic launch; each launch leaves it at zero again (the CTA that makes the launch's last
    /// draw resets it, kernels/sm90/fwd.cuh), so no launch pays an allocation and a memset for
    /// a fresh counter (3.8 us of host time per call on the H100 machine's host;
    /// docs/decisions.md#host-path-per-call),
    /// and a replayed CUDA graph finds it zeroed too.
    pub counter: Option<CudaSlice<i32>>,
    /// f32 scratch the kernels write and nobody returns: the LSE of a call that does not ask for
    /// it, and the split-KV decode's partial O and LSE. Grows to the largest request. A call
    /// keeps a reference to the buffer it was given until its launches are enqueued, so a
    /// buffer replaced by another call's larger request (another host thread's, on a stream
    /// several threads share) is freed (stream-ordered) only after them: the LSE scratch is
    /// taken without holding the lock through the launches.
    pub lse: Option<Arc<CudaSlice<f32>>>,
    pub part: Option<Arc<CudaSlice<f32>>>,
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
pub(super) fn with_scratch<R>(
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
pub(super) fn tile_counter(
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
pub(super) fn grown(
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
