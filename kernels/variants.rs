// The variant table: the single list of compiled kernels. build.rs `include!`s this file to generate
// the instantiation translation unit of each family and to compile it; src/cuda/variants.rs
// `include!`s it to pick a kernel at run time; the GPU tests sweep it. Plain Rust, no dependencies.

/// Element type of q/k/v/o.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KDType {
    Bf16,
    F16,
}

impl KDType {
    pub const fn name(self) -> &'static str {
        match self {
            KDType::Bf16 => "bf16",
            KDType::F16 => "f16",
        }
    }
    /// The CUDA C++ type spelled in the instantiation unit.
    pub const fn cuda_type(self) -> &'static str {
        match self {
            KDType::Bf16 => "__nv_bfloat16",
            KDType::F16 => "__half",
        }
    }
}

/// Mask family compiled into a kernel. `Local` covers sliding windows (runtime left/right bounds);
/// `Causal` is the (unbounded, 0) window with the cheaper tile bounds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KMask {
    None,
    Causal,
    Local,
}

impl KMask {
    pub const fn name(self) -> &'static str {
        match self {
            KMask::None => "nomask",
            KMask::Causal => "causal",
            KMask::Local => "local",
        }
    }
    pub const fn id(self) -> u32 {
        match self {
            KMask::None => 0,
            KMask::Causal => 1,
            KMask::Local => 2,
        }
    }
}

/// What a kernel computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KKind {
    /// Prefill / general forward: grid (ceil(sq / block_m), hq, b).
    Fwd,
    /// Split-KV decode: small sq, key range split across CTAs, then `Combine`.
    Decode,
}

impl KKind {
    pub const fn name(self) -> &'static str {
        match self {
            KKind::Fwd => "fwd",
            KKind::Decode => "decode",
        }
    }
}

/// One compiled kernel: its tile shape is part of the table so the host launch and the device code
/// agree by construction.
#[derive(Clone, Copy, Debug)]
pub struct Variant {
    pub family: &'static str,
    pub kind: KKind,
    pub dtype: KDType,
    pub head_dim: u32,
    pub mask: KMask,
    pub block_m: u32,
    pub block_n: u32,
    pub warps: u32,
    pub stages: u32,
}

impl Variant {
    /// Entry-point name: `fc_<family>_<kind>_<dtype>_d<head_dim>_<mask>`.
    pub fn symbol(&self) -> String {
        format!(
            "fc_{}_{}_{}_d{}_{}",
            self.family,
            self.kind.name(),
            self.dtype.name(),
            self.head_dim,
            self.mask.name()
        )
    }
    pub const fn threads(&self) -> u32 {
        self.warps * 32
    }
    /// Dynamic shared memory the kernel is launched with, in bytes (16-bit elements):
    /// Q tile plus `stages` K and V tiles.
    pub const fn smem_bytes(&self) -> u32 {
        let tiles = (self.block_m + 2 * self.stages * self.block_n) * self.head_dim * 2;
        if self.is_family("sm90") {
            // fc90::fwd_smem_bytes: a separate O staging tile when it fits in 227 KB, plus 1 KB
            // of alignment slack for the 128B swizzle and 256 B of barriers.
            let sep_o = tiles + self.block_m * self.head_dim * 2 + 1280 <= 232448;
            tiles + if sep_o { self.block_m * self.head_dim * 2 } else { 0 } + 1280
        } else {
            tiles
        }
    }
    const fn is_family(&self, name: &str) -> bool {
        let (a, b) = (self.family.as_bytes(), name.as_bytes());
        if a.len() != b.len() {
            return false;
        }
        let mut i = 0;
        while i < a.len() {
            if a[i] != b[i] {
                return false;
            }
            i += 1;
        }
        true
    }
}

/// A kernel family: one translation unit, one fatbin, one set of targets.
#[derive(Clone, Copy, Debug)]
pub struct Family {
    pub name: &'static str,
    /// Headers (under kernels/) always included by the generated unit. Each kind with a compiled
    /// variant also includes `<family>/<kind>.cuh`, which provides the
    /// `FC_<FAMILY>_<KIND>(SYMBOL, T, HEAD_DIM, MASK_ID, BLOCK_M, BLOCK_N, WARPS, STAGES)` macros.
    pub headers: &'static [&'static str],
    /// nvcc -gencode arguments.
    pub gencode: &'static [&'static str],
}

pub const FAMILIES: &[Family] = &[
    Family {
        name: "sm80",
        headers: &["common/util.cuh"],
        gencode: &[
            "arch=compute_80,code=sm_80",
            "arch=compute_86,code=sm_86",
            "arch=compute_89,code=sm_89",
            // Native code for Hopper too: the sm80 path is Hopper's fallback and decode path.
            "arch=compute_90,code=sm_90",
            "arch=compute_80,code=compute_80",
        ],
    },
    Family {
        name: "sm90",
        headers: &[],
        gencode: &["arch=compute_90a,code=sm_90a"],
    },
];

const fn sm80(dtype: KDType, head_dim: u32, mask: KMask) -> Variant {
    // Tile shapes (block_m x block_n, warps, K/V stages) per head dim; see docs/perf.md.
    // Measured on H100 (sm_90 SASS of the mma.sync kernel), bf16, 16k tokens, vs torch FA2.
    // Dynamic smem = (block_m + 2*stages*block_n) * head_dim * 2:
    //   d64 48 KB, d128 64 KB (fit sm_86/89's 99 KB), d256 128 KB (sm_80 / sm_90 only: the host
    //   must check the device's max opt-in smem per block and fall back on sm_86/89).
    // The Local (MASK_ID 2) kernel of d128 128x32 spills a few bytes: use (64, 64, 4, 2) for it.
    let (block_m, block_n, warps, stages) = match (head_dim, mask) {
        (64, _) => (128, 64, 4, 2),
        (128, KMask::Local) => (64, 64, 4, 2),
        (128, _) => (128, 32, 4, 2),
        _ => (128, 64, 8, 1),
    };
    Variant { family: "sm80", kind: KKind::Fwd, dtype, head_dim, mask, block_m, block_n, warps, stages }
}

const fn sm80_decode(dtype: KDType, head_dim: u32, mask: KMask) -> Variant {
    // Split-KV decode: block_m = packed query rows (h_ratio * sq) per CTA, block_n = keys per
    // cp.async stage. 40 / 80 / 80 KB of smem: fits sm_86/89's 99 KB. See docs/perf.md.
    let (block_m, block_n, warps, stages) = match head_dim {
        256 => (32, 32, 2, 2),
        _ => (64, 64, 4, 2),
    };
    Variant { family: "sm80", kind: KKind::Decode, dtype, head_dim, mask, block_m, block_n, warps, stages }
}

const fn sm90(dtype: KDType, head_dim: u32, mask: KMask) -> Variant {
    // wgmma + TMA, 1 producer + block_m/64 consumer warpgroups, 2-stage K/V ring; see docs/perf.md.
    let (block_m, block_n) = match head_dim {
        64 => (192, 128),
        128 => (128, 128),
        _ => (128, 80),
    };
    let warps = (block_m / 64 + 1) * 4;
    Variant { family: "sm90", kind: KKind::Fwd, dtype, head_dim, mask, block_m, block_n, warps, stages: 2 }
}

/// Largest seq_q routed to the split-KV decode kernels (decode and speculative widths).
pub const DECODE_MAX_SQ: u32 = 16;

/// Entry point of the combine kernel paired with a family's decode kernels.
pub fn combine_symbol(family: &str, dtype: KDType, head_dim: u32) -> String {
    format!("fc_{}_combine_{}_d{}", family, dtype.name(), head_dim)
}

pub const VARIANTS: &[Variant] = &[
    sm90(KDType::Bf16, 64, KMask::None),
    sm90(KDType::Bf16, 64, KMask::Causal),
    sm90(KDType::Bf16, 128, KMask::None),
    sm90(KDType::Bf16, 128, KMask::Causal),
    sm90(KDType::Bf16, 256, KMask::None),
    sm90(KDType::Bf16, 256, KMask::Causal),
    sm90(KDType::F16, 64, KMask::None),
    sm90(KDType::F16, 64, KMask::Causal),
    sm90(KDType::F16, 128, KMask::None),
    sm90(KDType::F16, 128, KMask::Causal),
    sm90(KDType::F16, 256, KMask::None),
    sm90(KDType::F16, 256, KMask::Causal),
    sm80(KDType::Bf16, 64, KMask::None),
    sm80(KDType::Bf16, 64, KMask::Causal),
    sm80(KDType::Bf16, 64, KMask::Local),
    sm80(KDType::Bf16, 128, KMask::None),
    sm80(KDType::Bf16, 128, KMask::Causal),
    sm80(KDType::Bf16, 128, KMask::Local),
    sm80(KDType::Bf16, 256, KMask::None),
    sm80(KDType::Bf16, 256, KMask::Causal),
    sm80(KDType::Bf16, 256, KMask::Local),
    sm80(KDType::F16, 64, KMask::None),
    sm80(KDType::F16, 64, KMask::Causal),
    sm80(KDType::F16, 64, KMask::Local),
    sm80(KDType::F16, 128, KMask::None),
    sm80(KDType::F16, 128, KMask::Causal),
    sm80(KDType::F16, 128, KMask::Local),
    sm80(KDType::F16, 256, KMask::None),
    sm80(KDType::F16, 256, KMask::Causal),
    sm80(KDType::F16, 256, KMask::Local),
    sm80_decode(KDType::Bf16, 64, KMask::None),
    sm80_decode(KDType::Bf16, 64, KMask::Causal),
    sm80_decode(KDType::Bf16, 64, KMask::Local),
    sm80_decode(KDType::Bf16, 128, KMask::None),
    sm80_decode(KDType::Bf16, 128, KMask::Causal),
    sm80_decode(KDType::Bf16, 128, KMask::Local),
    sm80_decode(KDType::Bf16, 256, KMask::None),
    sm80_decode(KDType::Bf16, 256, KMask::Causal),
    sm80_decode(KDType::Bf16, 256, KMask::Local),
    sm80_decode(KDType::F16, 64, KMask::None),
    sm80_decode(KDType::F16, 64, KMask::Causal),
    sm80_decode(KDType::F16, 64, KMask::Local),
    sm80_decode(KDType::F16, 128, KMask::None),
    sm80_decode(KDType::F16, 128, KMask::Causal),
    sm80_decode(KDType::F16, 128, KMask::Local),
    sm80_decode(KDType::F16, 256, KMask::None),
    sm80_decode(KDType::F16, 256, KMask::Causal),
    sm80_decode(KDType::F16, 256, KMask::Local),
];
