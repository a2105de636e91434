//! Which kernel family runs on which GPU: one `match` on the compute capability, plus the
//! overrides (`FLASHCORE_ARCH=sm80|sm90` or [`set_arch_override`]; `FLASHCORE_SMEM_LIMIT=bytes`
//! or [`set_smem_limit_override`]). The environment variables are read once per process
//! (src/knobs.rs).

use crate::knobs::knobs;
use std::sync::atomic::{AtomicU32, AtomicU8, Ordering};

pub use crate::plan::Arch;

static OVERRIDE: AtomicU8 = AtomicU8::new(0);

/// Forces a kernel family for every later call in this process (`None` restores automatic
/// selection). Takes precedence over `FLASHCORE_ARCH`.
pub fn set_arch_override(arch: Option<Arch>) {
    let v = match arch {
        None => 0,
        Some(Arch::Sm80) => 1,
        Some(Arch::Sm90) => 2,
    };
    OVERRIDE.store(v, Ordering::Relaxed);
}

/// The family forced by [`set_arch_override`] or `FLASHCORE_ARCH`, if any.
pub(crate) fn forced() -> candle_core::Result<Option<Arch>> {
    match OVERRIDE.load(Ordering::Relaxed) {
        1 => return Ok(Some(Arch::Sm80)),
        2 => return Ok(Some(Arch::Sm90)),
        _ => {}
    }
    knobs().arch.clone().map_err(candle_core::Error::Msg)
}

/// The family for a GPU of compute capability `major.minor`, with the overrides in force.
pub fn select(major: i32, minor: i32) -> candle_core::Result<Arch> {
    crate::plan::select_family(major, minor, forced()?)
}

static SMEM_LIMIT: AtomicU32 = AtomicU32::new(0);

/// Plans every later call in this process as if the GPU allowed at most `bytes` of shared memory
/// per block (`None` restores the device's own limit). Takes precedence over
/// `FLASHCORE_SMEM_LIMIT`. A big GPU then runs the tiles a smaller one gets, e.g. an H100 with
/// `Some(101376)` the 99 KB tiles of sm_86/89: how those are tested on the H100.
pub fn set_smem_limit_override(bytes: Option<u32>) {
    SMEM_LIMIT.store(bytes.unwrap_or(0), Ordering::Relaxed);
}

/// The shared-memory override in force, if any.
pub fn smem_limit_override() -> candle_core::Result<Option<u32>> {
    match SMEM_LIMIT.load(Ordering::Relaxed) {
        0 => {}
        n => return Ok(Some(n)),
    }
    knobs().smem_limit.clone().map_err(candle_core::Error::Msg)
}
