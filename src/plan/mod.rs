//! The planner: a pure function from a validated problem and a description of the GPU
//! ([`Device`]) to everything a launch needs ([`Plan`]): the kernel variant, its grid, block,
//! shared memory and clusters, the key-range splits and the combine, the tile schedule, whether
//! a paged pool is gathered first, the scratch sizes and the table check. Nothing here touches a
//! device: the CUDA side (src/cuda/) reads the device once, asks [`plan`], builds the parameter
//! block from the plan and launches what it says. Compiled in every build, so that tests ask it
//! with made-up devices.

pub mod variants;

use crate::params::{Keys, Mask, Problem, Seqs};
use candle_core::{Result, Tensor};
use variants::{KKind, KMask, Variant};

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

/// The family for a GPU of compute capability `major.minor`, or `forced` where that GPU can run
/// it (sm90 needs 9.0 exactly).
pub fn select_family(major: i32, minor: i32, forced: Option<Arch>) -> Result<Arch> {
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
    match forced {
        Some(Arch::Sm90) if (major, minor) != (9, 0) => Err(candle_core::Error::Msg(format!(
            "flashcore: the sm90 family needs compute capability 9.0, got {major}.{minor}"
        ))),
        Some(a) => Ok(a),
        None => Ok(native),
    }
}

/// What the planner needs to know about a GPU (read once per device on the CUDA side; made up
/// in tests).
#[derive(Clone, Copy, Debug)]
pub struct Device {
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

/// What steers the planner besides the problem and the device: the kernels this build compiled
/// and the A/B overrides (the `FLASHCORE_*` knobs of src/knobs.rs on the CUDA side; all off by
/// [`Default`]).
#[derive(Clone, Copy, Debug)]
pub struct Options<'a> {
    /// Whether this build compiled a variant (`FLASHCORE_VARIANTS` at build time). Default: all.
    pub compiled: fn(&Variant) -> bool,
    /// A forced kernel family (`FLASHCORE_ARCH`, `set_arch_override`).
    pub arch: Option<Arch>,
    /// Plan as if a block could use at most this much shared memory (`FLASHCORE_SMEM_LIMIT`).
    pub smem_limit: Option<u32>,
    /// Variants whose symbol contains one of these are passed over (`FLASHCORE_SKIP_VARIANTS`).
    pub skip_variants: &'a [String],
    /// Causal sm90 problems take the static grids (`FLASHCORE_SM90_CAUSAL=static`).
    pub sm90_causal_static: bool,
    /// The sm90 key-split cluster size where the clusters fit one wave
    /// (`FLASHCORE_SM90_KV_SPLITS`).
    pub sm90_kv_splits: Option<usize>,
    /// Paged prefill always gathers the pages first (`FLASHCORE_PAGED_GATHER=1`).
    pub paged_gather: bool,
    /// Split-KV decodes split evenly (`FLASHCORE_DECODE_EVEN=1`).
    pub decode_even: bool,
    /// Split-KV decode grids are never capped below their occupancy
    /// (`FLASHCORE_DECODE_OCCUPANCY=full`).
    pub decode_full_occupancy: bool,
    /// Split-KV decode grids launch without clusters (`FLASHCORE_DECODE_CLUSTER=1`).
    pub decode_cluster_off: bool,
}

impl Default for Options<'_> {
    fn default() -> Self {
        Options {
            compiled: |_| true,
            arch: None,
            smem_limit: None,
            skip_variants: &[],
            sm90_causal_static: false,
            sm90_kv_splits: None,
            paged_gather: false,
            decode_even: false,
            decode_full_occupancy: false,
            decode_cluster_off: false,
        }
    }
}

/// A launch's geometry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grid {
    pub grid: (u32, u32, u32),
    pub block: u32,
    /// Dynamic shared memory per block, in bytes.
    pub smem: u32,
    /// Thread-block clusters of this many consecutive blocks along x (1: none).
    pub cluster: u32,
}

/// A paged prefill whose kernel cannot read the pool through the page table: the pages are
/// gathered into dense `(b, sk, hkv, d)` scratch first (`fc_gather_paged`), and the problem runs
/// on it with the keys in use per sequence.
#[derive(Clone, Copy, Debug)]
pub struct Gather {
    /// The kernel chosen for the paged problem, which could not read the pool itself.
    pub before: &'static Variant,
    /// The gather kernel's blocks (256 threads each).
    pub blocks: u32,
    /// Rows of each of the gathered K and V (`b * sk`, each `hkv * d` elements).
    pub rows: usize,
}

/// How the attention kernel runs.
#[derive(Clone, Copy, Debug)]
pub enum Launch {
    /// An sm90 forward: one launch with the four tensor maps.
    Sm90 {
        grid: Grid,
        /// Key-range splits per query tile (the key-split twins' cluster size; 1 elsewhere).
        splits: u32,
        /// The dynamic tile schedule: tiles drawn from the stream's tile counter.
        dynamic: bool,
        /// Rows per TMA box of K and V (a paged pool's boxes, else the key tile).
        box_k: u32,
        /// log2 of the page size when the kernel reads the pool through the page table, else 0.
        page_shift: i32,
        /// Launches over slices of v and o `variant.v_width` columns wide (`Variant::slices_v`:
        /// the d512 kernels), each the same grid; 1 elsewhere.
        v_slices: u32,
    },
    /// An sm80 forward: grid (query blocks, heads, batch) without a mask, (heads, query blocks,
    /// batch) with one, folded into several launches over slices of the batch and (no mask) of
    /// whole K/V head groups where it passes the grid's y / z limit.
    Sm80 {
        block: u32,
        smem: u32,
        m_blocks: usize,
        masked: bool,
        /// Heads per launch (all of them, or whole groups of the head ratio).
        head_chunk: usize,
    },
    /// A split-KV decode: the split grid, and with more than one split the combine.
    Decode {
        grid: Grid,
        splits: usize,
        /// The even split count (`decode_num_splits`); `splits` exceeds it where the kernel
        /// balances its splits over the batch's lengths.
        even: usize,
        /// The balanced splits' budget of working CTAs (0: even splits).
        split_budget: i32,
        /// The capped dynamic shared memory (`decode_capped_smem`), if the grid's CTAs per SM
        /// are capped.
        capped: Option<u32>,
        combine: Option<Combine>,
    },
}

/// The combine of a split-KV decode: one 256-thread block per output row.
#[derive(Clone, Copy, Debug)]
pub struct Combine {
    pub rows: usize,
    /// Whether the combine checks the tables itself (then no check kernel runs).
    pub checks: bool,
    /// f32 scratch of the partials: O (`rows * splits` rows of the kernel's head dim), then LSE.
    pub partial_f32: usize,
}

/// Everything a call launches, decided before anything is allocated.
#[derive(Clone, Debug)]
pub struct Plan {
    /// The kernel that computes the attention.
    pub variant: &'static Variant,
    /// The problem that kernel reads (the gathered one where the pages are gathered).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) runs: Problem,
    pub gather: Option<Gather>,
    pub launch: Launch,
    /// Blocks of the table check (`fc_check_seqlens`) that follows a packed or paged batch's
    /// kernels, unless the combine checks them.
    pub check: Option<u32>,
    /// Whether the dependent launches (the combine, the check) go out as programmatic
    /// dependents: the sm_90 SASS waits with `griddepcontrol.wait`, elsewhere it is compiled out.
    pub pdl: bool,
    /// Output elements (O) and LSE elements of the call.
    pub out_elems: usize,
    pub lse_elems: usize,
}

/// Largest grid y / z dimension.
pub(crate) const GRID_YZ: usize = 65535;

/// What a GPU described by `dev` would launch for attention over dense `q`, `k`, `v` with
/// `params` (as [`crate::attention`] takes them). Only shapes, strides and dtypes are read, so the
/// tensors may live anywhere, e.g. zero-stride broadcasts on the CPU. A problem with
/// `d_v != d_qk` is planned zero-padded, as the GPU runs it; a chunked one is an error (it runs
/// as pieces of ordinary attention).
pub fn plan_dense(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    params: &crate::AttnParams,
    dev: &Device,
    opts: &Options,
) -> Result<Plan> {
    let p = crate::params::validate(q, k, v, params)?;
    plan_validated(p, dev, opts)
}

/// [`plan_dense`] for attention over a paged cache (`attention_paged`, or with `packed_q` =
/// (cu_seqlens_q, max_seqlen_q) `attention_paged_varlen`).
#[allow(clippy::too_many_arguments)]
pub fn plan_paged(
    q: &Tensor,
    k_pages: &Tensor,
    v_pages: &Tensor,
    page_table: &Tensor,
    seqlens_k: &Tensor,
    packed_q: Option<(&Tensor, usize)>,
    params: &crate::AttnParams,
    dev: &Device,
    opts: &Options,
) -> Result<Plan> {
    let p = crate::params::validate_paged(
        q, k_pages, v_pages, page_table, seqlens_k, packed_q, params,
    )?;
    plan_validated(p, dev, opts)
}

fn plan_validated(p: Problem, dev: &Device, opts: &Options) -> Result<Plan> {
    if let Some(c) = p.chunk {
        candle_core::bail!(
            "flashcore: chunk Some({c}): chunked problems run as pieces of ordinary attention, each planned on its own"
        )
    }
    plan_head_dims(&p, dev, opts)
}

/// The plan for `p` as a GPU runs it: itself, or the zero-padded problem's where op.rs pads
/// ([`Problem::gpu_pads`]).
pub(crate) fn plan_head_dims(p: &Problem, dev: &Device, opts: &Options) -> Result<Plan> {
    if p.gpu_pads() {
        return plan(&p.padded(), dev, opts);
    }
    plan(p, dev, opts)
}

/// Whether `plan` runs a problem whose q/k and v/o head dims differ on the tensors as they are:
/// every kernel with K/V in q's dtype (v and o read and written at d_v: the sm90 forward through
/// their own TMA maps, the sm80 forward and split-KV decode through `p.dv`, a gathered pool at
/// its two widths). Not the FP8 decode kernels (one head dim for k and v)
/// (docs/decisions.md#separate-v-head-dim).
#[cfg(any(feature = "cuda", test))]
pub(crate) fn takes_head_dims_apart(plan: &Plan) -> bool {
    plan.variant.kv == variants::KvType::Same
}

/// The plan for problem `p` on `dev`: the kernel of [`choose`], then its launch.
pub(crate) fn plan(p: &Problem, dev: &Device, opts: &Options) -> Result<Plan> {
    let chosen = choose(p, dev, opts)?;
    let paged = matches!(p.keys, Keys::Paged { .. });
    let mut gather = None;
    let mut runs = None;
    if paged && chosen.kind != KKind::Decode && page_box(chosen, p, opts).is_none() {
        let g = gathered(p)?;
        gather = Some(Gather {
            before: chosen,
            blocks: (g.b * g.sk * g.hkv * g.d.max(g.dv) / 8)
                .div_ceil(256)
                .clamp(1, dev.sm_count.max(1) * 16) as u32,
            rows: g.b * g.sk,
        });
        runs = Some(g);
    }
    let runs = runs.unwrap_or_else(|| p.clone());
    let variant = match gather {
        Some(_) => choose(&runs, dev, opts)?,
        None => chosen,
    };
    let launch = match variant.kind {
        KKind::Fwd if variant.family == "sm90" => sm90_launch(&runs, variant, dev, opts)?,
        KKind::Fwd => sm80_launch(&runs, variant)?,
        KKind::Decode => decode_launch(&runs, variant, dev, opts)?,
    };
    let combine_checks = matches!(
        launch,
        Launch::Decode {
            combine: Some(Combine { checks: true, .. }),
            ..
        }
    );
    let tables = p.seqs != Seqs::Dense || paged;
    let (total_q, _) = p.totals();
    Ok(Plan {
        variant,
        gather,
        launch,
        check: (tables && !combine_checks).then_some(if paged { p.b as u32 } else { 1 }),
        pdl: dev.major == 9,
        out_elems: total_q * p.hq * p.dv,
        lse_elems: total_q * p.hq,
        runs,
    })
}

/// A paged problem as it runs on its pages gathered into dense `(b, sk, hkv, d)` scratch: the
/// keys in use per sequence (`Keys::Used`), batch-major strides.
fn gathered(p: &Problem) -> Result<Problem> {
    let rows = p.b * p.sk;
    if rows > i32::MAX as usize {
        return Err(candle_core::Error::Msg(format!(
            "flashcore: CUDA kernel fc_gather_paged [{}]: batch * max_pages * page_size = {rows} gathered rows: more than 2^31 - 1 (split the batch)",
            shape_str(p)
        )));
    }
    let strides = |d: usize| [p.sk * p.hkv * d, p.hkv * d, d];
    Ok(Problem {
        keys: Keys::Used,
        seqs: match p.seqs {
            Seqs::Dense => Seqs::Dense,
            Seqs::Varlen { total_q, .. } => Seqs::Varlen {
                total_q,
                total_k: rows,
            },
        },
        k_strides: strides(p.d),
        v_strides: strides(p.dv),
        ..p.clone()
    })
}

/// An error of kernel `symbol` on problem `p`, worded as the launch errors are.
fn kernel_err(symbol: &str, p: &Problem, what: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(format!(
        "flashcore: CUDA kernel {symbol} [{}]: {what}",
        shape_str(p)
    ))
}

/// The sm90 forward's launch. Persistent grid (one CTA per SM looping over tiles) where the
/// tiles are equal (no mask: the kernel's static round-robin schedule) or drawn from the tile
/// counter longest first (`sm90_dynamic`). Other causal problems: persistent up to 8 query
/// blocks, else one CTA per tile, the hardware balancing the unequal tiles (persistent again
/// when heads or batch exceed the grid's y / z limit). Key-split twins: one cluster of `splits`
/// CTAs per query tile. A grid that does not match the kernel's schedule is slower, never wrong.
fn sm90_launch(p: &Problem, v: &'static Variant, dev: &Device, opts: &Options) -> Result<Launch> {
    let sms = dev.sm_count.max(1);
    let m_blocks = p.sq.div_ceil(v.block_m as usize);
    let tiles = m_blocks * p.hq * p.b;
    let splits = if v.kv_split {
        kv_splits(p, sms, opts)
    } else {
        1
    };
    let dynamic = !v.kv_split && sm90_dynamic(v, p.mask, m_blocks) && !opts.sm90_causal_static;
    let (box_k, page_shift) = match p.keys {
        Keys::Paged { page_size, .. } => {
            let rows = page_box(v, p, opts).ok_or_else(|| {
                kernel_err(&v.symbol(), p, "internal: paged pool without a box size")
            })?;
            (rows, page_size.trailing_zeros() as i32)
        }
        _ => (v.block_n, 0),
    };
    if tiles > i32::MAX as usize {
        return Err(kernel_err(
            &v.symbol(),
            p,
            format!("{tiles} query tiles: more than 2^31 - 1"),
        ));
    }
    let grid = if v.kv_split {
        ((tiles * splits) as u32, 1, 1)
    } else if dynamic || p.mask == Mask::None || m_blocks <= 8 || p.hq > GRID_YZ || p.b > GRID_YZ {
        (tiles.min(sms) as u32, 1, 1)
    } else {
        (m_blocks as u32, p.hq as u32, p.b as u32)
    };
    Ok(Launch::Sm90 {
        grid: Grid {
            grid,
            block: v.threads(),
            smem: v.smem_bytes(),
            cluster: splits as u32,
        },
        splits: splits as u32,
        dynamic,
        box_k,
        page_shift,
        v_slices: v.v_launches(p.dv) as u32,
    })
}

/// The sm80 forward's launches ([`Launch::Sm80`]).
fn sm80_launch(p: &Problem, v: &'static Variant) -> Result<Launch> {
    let m_blocks = p.sq.div_ceil(v.block_m as usize);
    let masked = v.mask != KMask::None;
    if masked && m_blocks > GRID_YZ {
        return Err(kernel_err(
            &v.symbol(),
            p,
            format!(
                "{m_blocks} query blocks of a masked problem: at most {GRID_YZ} (seq_q <= {})",
                GRID_YZ * v.block_m as usize
            ),
        ));
    }
    let ratio = p.h_ratio();
    let head_chunk = if masked || p.hq <= GRID_YZ {
        p.hq
    } else {
        (GRID_YZ / ratio) * ratio
    };
    Ok(Launch::Sm80 {
        block: v.threads(),
        smem: v.smem_bytes(),
        m_blocks,
        masked,
        head_chunk,
    })
}

/// The split-KV decode's launch: the split grid ([`decode_grid`]) and, with more than one split,
/// the combine.
fn decode_launch(p: &Problem, v: &'static Variant, dev: &Device, opts: &Options) -> Result<Launch> {
    let g = decode_grid(p, v, dev, opts);
    if g.ctas > i32::MAX as usize {
        return Err(kernel_err(
            &v.symbol(),
            p,
            format!("grid of {} blocks is too large", g.ctas),
        ));
    }
    // The balanced splits' budget: the even grid's working CTAs per K/V head and a slack of
    // half a split per sequence (without it, 16 sequences of 128..32k keys ran 560 us instead
    // of 425; capping it at one wave did the same).
    let split_budget = if g.splits > g.even {
        (p.b * g.even + p.b / 2) as i32
    } else {
        0
    };
    // A packed or paged batch's combine checks the tables itself (one check kernel launch less:
    // 1-2 us of a b1 / b8 decode on the H200, docs/decisions.md#programmatic-dependent-launch),
    // for batches whose prefix sums one pass of its 256 threads reads.
    let combine = (g.splits > 1).then(|| {
        let tables = p.seqs != Seqs::Dense || matches!(p.keys, Keys::Paged { .. });
        let rows = p.b * p.hq * p.sq;
        Combine {
            rows,
            checks: tables && p.b <= 256,
            // the kernel writes whole rows of its head dim even where p.d is smaller
            partial_f32: g.splits * rows * (v.head_dim as usize + 1),
        }
    });
    Ok(Launch::Decode {
        grid: Grid {
            grid: (g.ctas as u32, 1, 1),
            block: v.threads(),
            smem: g.capped.unwrap_or(v.smem_bytes()),
            cluster: g.cluster,
        },
        splits: g.splits,
        even: g.even,
        split_budget,
        capped: g.capped,
        combine,
    })
}

mod choose;
mod decode;
#[cfg(not(feature = "cuda"))]
use choose::page_box;
pub(crate) use choose::{choose, shape_str};
#[cfg(feature = "cuda")]
pub(crate) use choose::{kernel_bound, page_box};
pub use choose::{kernel_head_dim, GPU_MAX_SCALE};
use choose::{kv_splits, sm90_dynamic};
use decode::decode_grid;
pub use decode::{decode_capped_smem, decode_num_splits};

#[cfg(test)]
mod tests;
