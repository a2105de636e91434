//! Which kernel family runs on which GPU: one `match` on the compute capability, plus the
//! overrides (`FLASHCORE_ARCH=sm80|sm90` or [`set_arch_override`]; `FLASHCORE_SMEM_LIMIT=bytes`
//! or [`set_smem_limit_override`]). The environment variables are read once per process
//! (src/knobs.rs).

use crate::knobs::knobs;
use std::sync::atomic::{AtomicU32, AtomicU8, Ordering};

/// A kernel family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// mma.sync + ldmatrix + cp.async (sm_80/86/89 SASS, sm_90 SASS, compute_80 PTX).
    Sm80,
    /// wgmma + TMA + warp specialisation (sm_90a).
    Sm90,
}

impl Arch {
    pub fn family(self) -> &'static str {
        match self {
            Arch::Sm80 => "sm80",
            Arch::Sm90 => "sm90",
        }
    }
    pub fn parse(s: &str) -> Option<Arch> {
        match s.trim().to_ascii_lowercase().as_str() {
            "sm80" | "sm_80" | "80" => Some(Arch::Sm80),
            "sm90" | "sm_90" | "sm90a" | "90" => Some(Arch::Sm90),
            _ => None,
        }
    }
}

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

fn forced() -> candle_core::Result<Option<Arch>> {
    match OVERRIDE.load(Ordering::Relaxed) {
        1 => return Ok(Some(Arch::Sm80)),
        2 => return Ok(Some(Arch::Sm90)),
        _ => {}
    }
    knobs().arch.clone().map_err(candle_core::Error::Msg)
}

/// The family for a GPU of compute capability `major.minor`.
pub fn select(major: i32, minor: i32) -> candle_core::Result<Arch> {
    let native = match (major, minor) {
        (9, 0) => Arch::Sm90,
        (8, _) => Arch::Sm80,
        // Blackwell and later run the sm80 family (compute_80 PTX, JIT-compiled by the driver).
        (m, _) if m >= 10 => Arch::Sm80,
        (m, n) => {
            return Err(candle_core::Error::Msg(format!(
                "flashcore: the CUDA kernels need compute capability >= 8.0 (Ampere), got {m}.{n}"
            )))
        }
    };
    match forced()? {
        Some(Arch::Sm90) if (major, minor) != (9, 0) => Err(candle_core::Error::Msg(format!(
            "flashcore: the sm90 family needs compute capability 9.0, got {major}.{minor}"
        ))),
        Some(a) => Ok(a),
        None => Ok(native),
    }
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
