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

/// What the keys and values a kernel reads are stored as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvType {
    /// The dtype of q and o (`KDType`).
    Same,
    /// FP8 e4m3 bytes with f32 scales per K/V head or per tensor (`AttnParams::kv_scales`): the
    /// split-KV decode kernels load them as bytes and widen them to q's dtype in registers
    /// (kernels/sm80/decode.cuh, docs/decisions.md#fp8-keys-and-values-in-the-decode-kernel).
    E4m3,
}

impl KvType {
    /// The symbol's part after the dtype (`_e4m3`; empty for `Same`).
    pub const fn suffix(self) -> &'static str {
        match self {
            KvType::Same => "",
            KvType::E4m3 => "_e4m3",
        }
    }
    /// Bytes per stored K/V element, given the bytes of q's dtype.
    pub const fn bytes(self, q_bytes: u32) -> u32 {
        match self {
            KvType::Same => q_bytes,
            KvType::E4m3 => 1,
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
    /// Longest seq_q this variant is preferred for (`u32::MAX`: any). Entries of one problem
    /// class are tried in table order; see `VARIANTS`.
    pub max_sq: u32,
    /// sm80 forward only: key-split warp pairs (`FC_SM80_FWD_PAIRS`, kernels/sm80/fwd.cuh): two
    /// warps share 2 x 16 query rows, split the keys of S and the columns of O, and swap P
    /// through shared memory.
    pub warp_pairs: bool,
    /// A softcap twin (symbol suffix `_cap`): the dispatcher gives it the problems with a softcap
    /// and only those (`admits_softcap`). The sm90 twins are the kernel compiled with softcap
    /// (`FC_SM90_FWD_CAP`); sm80 kernels carry a softcap body anyway (`has_cap_body`), so an sm80
    /// twin is a tile added for a class whose preferred tile has none.
    pub softcap: bool,
    /// sm90 forward only, 0 elsewhere: a narrow twin's head dim (symbol suffix `_n<width>`,
    /// `FC_SM90_FWD_NARROW`). It keeps its kernel's tiles in shared memory but loads, multiplies
    /// and stores only `narrow` columns (Q·Kᵀ over narrow / 16 k-steps, P·V and O `narrow` wide):
    /// d32 on the d64 tiles, d96 on d128, d160 and d192 on d256. The dispatcher gives it the head
    /// dims up to `narrow` that no narrower entry before it took; the kernel stays full width.
    /// (The sm80 forward kernels need no twins: their narrow body is chosen inside the kernel per
    /// launch, `FWD_NARROW` / `fwd_narrow` in kernels/sm80/fwd.cuh.)
    pub narrow: u32,
    /// sm90 forward only: the paged twin (symbol suffix `_pg`, `FC_SM90_FWD_PG`) of a full-width
    /// d128 / d256 kernel. It reads K/V only from a paged pool through the page table, with one
    /// TMA box per page (or per key tile) over all of its columns, where the kernel itself
    /// takes one box per page and 64-column block (`page_box`, kernels/sm90/fwd.cuh `ILV`).
    /// The dispatcher gives it the paged prefill problems without a score modifier whose pools
    /// hold whole pages of power-of-two rows (`takes_pages`), and nothing else.
    pub paged: bool,
    /// sm90 forward only: the key-split twin (symbol suffix `_kvs`, `FC_SM90_FWD_KVS`) of a
    /// 128-row d64 / d128 kernel. Launched in clusters of 2 or 4 CTAs per query tile, each
    /// walking a chunk of the tile's keys; rank 0 gathers the others' partial O, maxima and sums
    /// through distributed shared memory and writes O and the LSE (kernels/sm90/fwd.cuh `SPLIT`).
    /// The dispatcher gives it the problems whose 128-row tiles leave most SMs idle
    /// (`kv_splits` in src/plan/choose.rs), and nothing else.
    pub kv_split: bool,
    /// sm90 forward only, 1 elsewhere: Q buffers (symbol suffix `_q2` for 2; the sm90 forward
    /// macros' `QS`, kernels/sm90/fwd.cuh). With two, the TMA thread loads a tile's Q while the
    /// tile before it is still in its key loop. Twins (narrow, paged, key-split) keep one.
    pub q_stages: u32,
    /// What K and V are stored as (`KvType`): FP8 rows exist for the split-KV decode kernels
    /// only (`e4m3`), one per bf16 / f16 decode row, generated by `rows`.
    pub kv: KvType,
    /// sm90 forward only, 0 elsewhere: a separate-V kernel's head dim of V and O (symbol suffix
    /// `_v<width>`, `FC_SM90_FWD_SEPV`), a multiple of 64 below `head_dim`, which stays q's and
    /// k's. Its V ring and O buffer are this wide, so a wider key tile fits than in the
    /// `head_dim` kernel (DeepSeek prefill, d_qk 192 / d_v 128:
    /// docs/decisions.md#separate-v-head-dim). The dispatcher gives it the problems whose d_qk
    /// and d_v round up to `head_dim` and `v_width` in 64-column blocks (`takes_head_dims`).
    pub v_width: u32,
}

impl Variant {
    /// Entry-point name: `fc_<family>_<kind>_<dtype>_d<head_dim>_<mask>_<block_m>x<block_n>`,
    /// plus `p` for warp pairs, `_s<stages>` for sm90 tiles with other than two K/V stages (the
    /// tile tells apart the variants of one problem class that need different smem), and `_cap`,
    /// `_pg` or `_n<width>` for a twin.
    pub fn symbol(&self) -> String {
        let stages = if self.is_family("sm90") && self.stages != 2 {
            format!("_s{}", self.stages)
        } else {
            String::new()
        };
        let twin = if self.softcap {
            "_cap".to_string()
        } else if self.paged {
            "_pg".to_string()
        } else if self.kv_split {
            "_kvs".to_string()
        } else if self.narrow > 0 {
            format!("_n{}", self.narrow)
        } else if self.v_width > 0 {
            format!("_v{}", self.v_width)
        } else {
            String::new()
        };
        let q2 = if self.q_stages == 2 { "_q2" } else { "" };
        format!(
            "fc_{}_{}_{}{}_d{}_{}_{}x{}{}{stages}{q2}{twin}",
            self.family,
            self.kind.name(),
            self.dtype.name(),
            self.kv.suffix(),
            self.head_dim,
            self.mask.name(),
            self.block_m,
            self.block_n,
            if self.warp_pairs { "p" } else { "" },
        )
    }
    /// The instantiation macro's suffix in the family's `<kind>.cuh` (`FC_SM80_FWD_PAIRS`).
    pub const fn macro_suffix(&self) -> &'static str {
        if matches!(self.kv, KvType::E4m3) {
            "_E4M3"
        } else if self.warp_pairs {
            "_PAIRS"
        } else if self.softcap && self.is_family("sm90") {
            "_CAP"
        } else if self.narrow > 0 {
            "_NARROW"
        } else if self.paged {
            "_PG"
        } else if self.kv_split {
            "_KVS"
        } else if self.v_width > 0 {
            "_SEPV"
        } else {
            ""
        }
    }
    /// Whether the kernel computes softcap (p.softcap > 0) besides plain scores: the sm80 kernels
    /// but the d128 128x48 forward tile (`fc_sm80::fwd_has_cap_body`, kernels/sm80/fwd.cuh; the
    /// split-KV decode kernels branch per key tile). sm90 kernels: no, their twins only.
    pub const fn has_cap_body(&self) -> bool {
        self.is_family("sm80")
            && !(matches!(self.kind, KKind::Fwd) && self.head_dim == 128 && self.block_n == 48)
    }
    /// Whether this variant takes a problem. `modifiers`: softcap or ALiBi; `general`: a packed
    /// (varlen) batch or a head dim below the kernel's. sm80 forward kernels run both in their
    /// general body (`has_cap_body`; `fc_sm80::fwd_general`), so a tile without one passes them
    /// to its `_cap` twin; sm90 kernels run varlen and smaller head dims in every kernel and the
    /// score modifiers in their `_cap` twins only.
    pub const fn admits(&self, modifiers: bool, general: bool) -> bool {
        let needs = if self.is_family("sm80") { modifiers || general } else { modifiers };
        if self.softcap {
            needs
        } else {
            !needs || self.has_cap_body()
        }
    }
    /// Whether this variant takes a problem of `sq` query rows in each of `bh` (batch, head)
    /// pairs on a GPU of `sms` SMs, by how many CTAs its tiles give. d64 on sm90 only: the
    /// 256-row tile (`sm90_d64_short`) serves problems with at least as many of its query tiles
    /// as SMs; the 128-row tiles serve causal problems up to 1k rows (`sm90_d64_causal_short`)
    /// and any problem whose 128-row tiles all run at once, one per SM (`sm90_d64_small`; causal
    /// too): each CTA then walks the keys for 128 rows instead of 192. Between that and a full
    /// grid of 192-row tiles, the 128-row ones would take a second round on some SMs (2 x 1500
    /// rows x 8 heads causal: 29.9 against 29.0 us, H100;
    /// docs/decisions.md#small-grids-on-128-row-tiles).
    pub const fn serves_grid(&self, sq: usize, bh: usize, sms: usize) -> bool {
        if !self.is_family("sm90")
            || !matches!(self.kind, KKind::Fwd)
            || self.head_dim != 64
            || matches!(self.mask, KMask::Local)
        {
            return true;
        }
        match self.block_m {
            256 => sq.div_ceil(256) * bh >= sms,
            SM90_SMALL_BLOCK_M => {
                (matches!(self.mask, KMask::Causal) && sq <= 1024) || sq.div_ceil(SM90_SMALL_BLOCK_M as usize) * bh <= sms
            }
            _ => true,
        }
    }
    /// Whether this variant takes a dense problem with (`cap`) or without a softcap.
    pub const fn admits_softcap(&self, cap: bool) -> bool {
        self.admits(cap, false)
    }
    /// Rows per TMA box when this kernel reads a paged K/V pool of `page_size`-row pages through
    /// the page table, or `None` when the pages are gathered into dense scratch first. sm90
    /// forward kernels (but the dynamic-schedule tiles with three consumer warpgroups and the
    /// four-warpgroup tiles, whose producers have no room for the page walk: `FwdSm90::PAGED`,
    /// kernels/sm90/fwd.cuh) on power-of-two pages; a box is min(page_size, the largest power of
    /// two dividing block_n) rows, each inside one page, the boxes of a tile issued by one lane of
    /// the TMA warp each. From 32-row boxes (H100, docs/decisions.md#paged-prefill-tma-boxes):
    /// chunked prefill at
    /// pages of 32 runs 0.94-0.98x the contiguous cache (gathered: 0.80-0.88x); 16-row boxes run
    /// 0.80-0.87x, about what gathering costs (the TMA unit takes about as long for a 2 KB box as
    /// for an 8 KB one), so pages of 16 are gathered at d128 / d256 by these kernels. The paged
    /// twins (`paged`) take one box per page over all column blocks, and pages from 16 rows: a
    /// tile of 16-row pages then costs as many boxes as a d64 kernel's (one 64-column block),
    /// which read pages of 16 in-kernel too (0.96x the contiguous cache at 512 new
    /// over 8192 cached keys, d128, where gathering ran 0.80x).
    pub const fn page_box(&self, page_size: usize) -> Option<u32> {
        if !self.tma_pages() || !page_size.is_power_of_two() {
            return None;
        }
        let bn = self.block_n as usize;
        let pow2 = bn & bn.wrapping_neg();
        let rows = if page_size < pow2 { page_size } else { pow2 };
        if rows >= 32 || (rows >= 16 && (self.paged || self.head_dim == 64)) {
            Some(rows as u32)
        } else {
            None
        }
    }
    /// Whether the kernel can read a paged K/V pool through the page table with TMA boxes
    /// (`FwdSm90::PAGED`, kernels/sm90/fwd.cuh): the sm90 forward kernels but the
    /// dynamic-schedule tiles with three consumer warpgroups and the four-warpgroup tiles, whose
    /// producers have no registers to spare for the page walk. `page_box` decides the box size.
    pub const fn tma_pages(&self) -> bool {
        let three_dyn = self.block_m == 192
            && matches!(self.mask, KMask::Causal)
            && (self.head_dim <= 128 || self.block_n == 64);
        let four = self.block_m == 256;
        self.is_family("sm90") && matches!(self.kind, KKind::Fwd) && !three_dyn && !four
    }
    /// Whether the kernel computes score modifiers (softcap, ALiBi): in a body beside its plain
    /// one (`has_cap_body`) or because it is a softcap twin.
    pub const fn computes_modifiers(&self) -> bool {
        self.has_cap_body() || self.softcap
    }
    /// Head-dim columns of q and k the kernel computes: its head dim, or a narrow twin's width.
    pub const fn width(&self) -> u32 {
        if self.narrow > 0 {
            self.narrow
        } else {
            self.head_dim
        }
    }
    /// Head-dim columns of v and o the kernel computes: `width`, or a separate-V kernel's
    /// `v_width`.
    pub const fn v_width(&self) -> u32 {
        if self.v_width > 0 {
            self.v_width
        } else {
            self.width()
        }
    }
    /// Whether v and o run in slices of `v_width` columns, one launch each, every launch
    /// computing the scores again: the d512 kernels, whose O for 512 columns would not fit a
    /// consumer warpgroup's registers (`sm90_d512`).
    pub const fn slices_v(&self) -> bool {
        self.v_width > 0 && self.head_dim > 256
    }
    /// Launches over v and o for a problem whose v head dim is `d_v`: `slices_v` kernels one per
    /// `v_width` columns, others one.
    pub const fn v_launches(&self, d_v: usize) -> usize {
        if self.slices_v() {
            d_v.div_ceil(self.v_width as usize)
        } else {
            1
        }
    }
    /// Whether the kernel computes a problem of head dims `d_qk` and `d_v` (the narrower one's
    /// columns zero-filled up to the kernel's). A separate-V kernel takes exactly the problems
    /// whose head dims round up to its two widths in 64-column blocks; any other takes those
    /// whose larger head dim it computes, and none that a separate-V kernel would (so a
    /// (192, 128) problem never pays for a 192-wide V on a kernel of that width: the dispatcher
    /// tries separate-V rows first, src/plan/choose.rs).
    pub const fn takes_head_dims(&self, d_qk: usize, d_v: usize) -> bool {
        if self.slices_v() {
            d_qk <= self.head_dim as usize && d_v <= self.head_dim as usize
        } else if self.v_width > 0 {
            d_qk.div_ceil(64) * 64 == self.head_dim as usize
                && d_v.div_ceil(64) * 64 == self.v_width as usize
        } else {
            let d = if d_qk > d_v { d_qk } else { d_v };
            d <= self.width() as usize
        }
    }
    /// Keys of a 16-bit K/V tile holding the bytes of one of this kernel's key tiles
    /// (`block_n`, or `block_n / 2` for e4m3 K/V): the decode planner's rules on pages and bytes
    /// in flight count in these.
    pub const fn block_n_16bit(&self) -> u32 {
        self.block_n * self.kv.bytes(2) / 2
    }
    pub const fn threads(&self) -> u32 {
        self.warps * 32
    }
    /// Dynamic shared memory the kernel is launched with, in bytes (16-bit elements):
    /// Q tile plus `stages` K and V tiles (and for warp pairs their P tiles and f32 row maxima
    /// and sums, as `fc_sm80::fwd_smem_bytes`). FP8 K/V (`KvType::E4m3`, decode): `stages` K
    /// and V tiles of bytes (`fc_decode::split_smem_bytes`).
    pub const fn smem_bytes(&self) -> u32 {
        if matches!(self.kv, KvType::E4m3) {
            // the Q tile and the ring of byte tiles (split_smem_bytes)
            return self.block_m * self.head_dim * 2 + 2 * self.stages * self.block_n * self.head_dim;
        }
        let tiles = (self.q_stages * self.block_m + 2 * self.stages * self.block_n) * self.head_dim * 2;
        if self.is_family("sm90") {
            // fc90::fwd_smem_bytes: Q buffers, K and V rings (V `v_width` wide for a separate-V
            // kernel), a separate O staging tile when it fits in 227 KB, plus 1 KB of alignment
            // slack for the 128B swizzle and 256 B of barriers.
            let vd = if self.v_width > 0 { self.v_width } else { self.head_dim };
            let tiles = (self.q_stages * self.block_m + self.stages * self.block_n) * self.head_dim * 2
                + self.stages * self.block_n * vd * 2;
            let sep_o = tiles + self.block_m * vd * 2 + 1280 <= 232448;
            tiles + if sep_o { self.block_m * vd * 2 } else { 0 } + 1280
        } else if self.warp_pairs {
            let rows_per_pair = self.block_m / (self.warps / 2);
            tiles + self.block_m * self.block_n * 2 + 2 * self.warps * rows_per_pair * 4
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
        // util: the poisoning fills; seqlens: the varlen / paged check kernel
        // (fc_check_seqlens); paged: the paged cache's append and gather kernels; fp8: the e4m3
        // quantize / widen / copy conversions.
        headers: &[
            "common/util.cuh",
            "common/seqlens.cuh",
            "common/paged.cuh",
            "common/fp8.cuh",
        ],
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
    // Tile shapes (block_m x block_n, warps, K/V stages) per head dim; see
    // docs/decisions.md#sm80-tiles.
    // Measured on H100 (sm_90 SASS of the mma.sync kernel), bf16, 16k tokens, vs torch FA2.
    // Dynamic smem = (block_m + 2*stages*block_n) * head_dim * 2:
    //   d64 48 KB, d128 80 KB non-causal / 64 KB causal (fit sm_86/89's 99 KB), d256 128 KB
    //   (sm_80; sm_90 takes `sm80_pairs`, sm_86/89 take the `sm80_small` tile below).
    // d128 non-causal 128x48: under the H100's sustained 700 W power cap, where the
    //   whole fa3 grid runs, 3.7-4.2 % faster than 128x32 (fewer Q re-reads and row reductions
    //   per key); causal stays 128x32 (+1.6 % sustained, mixed in short runs).
    // The Local (MASK_ID 2) kernel of d128 128x32 spills a few bytes: use (64, 64, 4, 2) for it.
    let (block_m, block_n, warps, stages) = match (head_dim, mask) {
        (64, _) => (128, 64, 4, 2),
        (128, KMask::Local) => (64, 64, 4, 2),
        (128, KMask::None) => (128, 48, 4, 2),
        (128, _) => (128, 32, 4, 2),
        _ => (128, 64, 8, 1),
    };
    Variant { family: "sm80", kind: KKind::Fwd, dtype, head_dim, mask, block_m, block_n, warps, stages, max_sq: u32::MAX, warp_pairs: false, softcap: false, narrow: 0, paged: false, kv_split: false, q_stages: 1, kv: KvType::Same, v_width: 0 }
}

const fn sm80_pairs(dtype: KDType, head_dim: u32, mask: KMask) -> Variant {
    // d256 with key-split warp pairs: 128x128, 8 warps (4 pairs of 32 rows), one K and one V
    // stage, 226 KB (H100 / sm_90 only). Per 128-key tile a warp reads 88 KB of smem for 32 x 128
    // outputs where the 128x64 tile's warps read 144 KB for 16 x 256. Forced sm80 on the H100,
    // bf16 8 x 8 heads x 2k non-causal: 355 TFLOPS against 306
    // (docs/decisions.md#sm80-d256-warp-pairs).
    Variant { family: "sm80", kind: KKind::Fwd, dtype, head_dim, mask, block_m: 128, block_n: 128, warps: 8, stages: 1, max_sq: u32::MAX, warp_pairs: true, softcap: false, narrow: 0, paged: false, kv_split: false, q_stages: 1, kv: KvType::Same, v_width: 0 }
}

const fn sm80_small(dtype: KDType, head_dim: u32, mask: KMask) -> Variant {
    // d256 for GPUs with 99 KB of smem per block (sm_86/89): 64x32, 4 warps, 2 stages = 96 KB.
    // Checked against an f64 reference and 0.93-0.96x torch FA2 on the H100
    // (docs/decisions.md#sm80-d256-warp-pairs),
    // where the 128 KB tile above runs 1.04-1.08x.
    Variant { family: "sm80", kind: KKind::Fwd, dtype, head_dim, mask, block_m: 64, block_n: 32, warps: 4, stages: 2, max_sq: u32::MAX, warp_pairs: false, softcap: false, narrow: 0, paged: false, kv_split: false, q_stages: 1, kv: KvType::Same, v_width: 0 }
}

/// Packed query rows (`h_ratio * seq_q` per K/V head and sequence) per CTA of the split-KV decode
/// kernels at head dims up to 128 (d256: 32). The dispatcher counts decode blocks of this height
/// (src/plan/choose.rs `decode_beats_starved_prefill`).
pub const DECODE_BLOCK_M: u32 = 64;

/// Query rows per CTA of the sm90 tiles that serve grids of few query tiles: the 128-row d64
/// tiles (`sm90_d64_small`, `sm90_d64_causal_short`); the d128 causal tiles and every key-split
/// twin have the same height (tests/variants.rs `grid_arithmetic_matches_the_tiles`). The
/// dispatcher's grid arithmetic (`serves_grid`, src/plan/choose.rs `kv_splits`,
/// `decode_beats_starved_prefill`) counts query tiles of this height.
pub const SM90_SMALL_BLOCK_M: u32 = 128;

const fn sm80_decode(dtype: KDType, head_dim: u32, mask: KMask) -> Variant {
    // Split-KV decode: block_m = packed query rows (h_ratio * sq) per CTA, block_n = keys per
    // cp.async stage. 40 / 80 / 80 KB of smem: fits sm_86/89's 99 KB. See
    // docs/decisions.md#split-kv-decode.
    let (block_m, block_n, warps, stages) = match head_dim {
        256 => (32, 32, 2, 2),
        _ => (DECODE_BLOCK_M, 64, 4, 2),
    };
    Variant { family: "sm80", kind: KKind::Decode, dtype, head_dim, mask, block_m, block_n, warps, stages, max_sq: u32::MAX, warp_pairs: false, softcap: false, narrow: 0, paged: false, kv_split: false, q_stages: 1, kv: KvType::Same, v_width: 0 }
}

const fn sm90(dtype: KDType, head_dim: u32, mask: KMask) -> Variant {
    // wgmma + TMA, 1 producer + block_m/64 consumer warpgroups, 2-stage K/V ring; see
    // docs/decisions.md#sm90-warp-specialisation.
    // d128 non-causal 128x160 (225 KB with the O staging buffer) serves seq_q > 1k, after
    // `sm90_d128_short`; d256 128x80 serves seq_q > 2k, after `sm90_d256_short`.
    let (block_m, block_n) = match (head_dim, mask) {
        (64, _) => (192, 128),
        (128, KMask::None) => (128, 160),
        (128, _) => (128, 128),
        _ => (128, 80),
    };
    let v = sm90_tile(dtype, head_dim, mask, block_m, block_n, u32::MAX);
    // Two Q buffers (`Variant::q_stages`) where they measured faster in both runs
    // (H100, bf16, same binary, docs/decisions.md#sm90-two-q-buffers): d64 non-causal 192x128 2k
    // +2.8-3.5 %, 8k +1.4-3.4 %;
    // d128 causal 512 +2.0 %, 1k-16k within +-0.5 %. The d64 causal 192x128 kernel ran 4-8 %
    // slower with them (and spilled 4 B), d128 128x160 has no room.
    match (head_dim, mask) {
        (64, KMask::None) | (128, KMask::Causal) => q2(v),
        _ => v,
    }
}

/// Windows with a right bound (gpt-oss's, Mistral's and Gemma's local layers: right bound 0) on
/// the 128x128 causal tiles: the causal walk on the diagonal shifted by the right bound, started
/// at each query tile's first visible key tile (kernels/sm90/fwd.cuh `WINDOW`;
/// docs/decisions.md#sm90-windows). Windows without a right bound run on the sm80 family.
const fn sm90_window(dtype: KDType, head_dim: u32) -> Variant {
    q2(sm90_tile(dtype, head_dim, KMask::Local, 128, 128, u32::MAX))
}

/// `v` with two Q buffers (`Variant::q_stages`); its twins keep one.
const fn q2(v: Variant) -> Variant {
    Variant { q_stages: 2, ..v }
}

const fn sm90_tile(dtype: KDType, head_dim: u32, mask: KMask, block_m: u32, block_n: u32, max_sq: u32) -> Variant {
    sm90_staged(dtype, head_dim, mask, block_m, block_n, max_sq, 2)
}

/// The softcap twin of `v` (`Variant::softcap`). sm90: d256 only (Gemma 2's head dim; with
/// a softcap body the d64/d128 kernels spilled 8-152 B, so softcap runs there on the sm80 family).
/// sm80: d128 without a mask on the causal tile, 128x32 (the 128x48 tile has no softcap body).
const fn cap(v: Variant) -> Variant {
    Variant { softcap: true, ..v }
}

/// The separate-V kernel of an sm90 tile (`Variant::v_width`): V and O `v_width` wide.
const fn sepv(v: Variant, v_width: u32) -> Variant {
    Variant { v_width, ..v }
}

/// DeepSeek V2 / V3 prefill, d_qk 192 and d_v 128 (`Variant::v_width`): 128x128 tiles over a
/// V ring 128 wide (209 KB, no room for the O buffer), two consumer warpgroups; causal on the
/// dynamic schedule up to 32 query tiles (`sm90_dynamic`). 128x112 with the O buffer ran the
/// same within 1 % but causal 1k (+3.5 %) on the H200 (docs/decisions.md#separate-v-head-dim).
const fn sm90_d192_v128(dtype: KDType, mask: KMask) -> Variant {
    sepv(sm90_tile(dtype, 192, mask, 128, 128, u32::MAX), 128)
}

/// Head dims past 256 (Gemma 4's global layers: d512; up to 512 on either side): Q and K 512 wide,
/// V and O in slices of 256 columns, one launch each (`Variant::slices_v`), 128x32 tiles over a
/// two-stage ring (225 KB, O staged in the Q buffer); causal on the dynamic schedule up to 32
/// query tiles. A slice computes the scores again: 1.5x the useful work at d512.
const fn sm90_d512(dtype: KDType, mask: KMask) -> Variant {
    sepv(sm90_tile(dtype, 512, mask, 128, 32, u32::MAX), 256)
}

/// The paged twin of an sm90 kernel (`Variant::paged`), with one Q buffer.
const fn pg(v: Variant) -> Variant {
    Variant { paged: true, q_stages: 1, ..v }
}

/// The key-split twin of an sm90 kernel (`Variant::kv_split`), with one Q buffer (one tile per CTA).
/// It serves any seq_q (the key split is for few query tiles, whatever their length).
const fn kvs(v: Variant) -> Variant {
    Variant { kv_split: true, max_sq: u32::MAX, q_stages: 1, ..v }
}

/// The narrow twin of an sm90 kernel computing `width` head-dim columns (`Variant::narrow`), with
/// one Q buffer.
const fn narrow(v: Variant, width: u32) -> Variant {
    Variant { narrow: width, q_stages: 1, ..v }
}

const fn sm90_staged(dtype: KDType, head_dim: u32, mask: KMask, block_m: u32, block_n: u32, max_sq: u32, stages: u32) -> Variant {
    let warps = (block_m / 64 + 1) * 4;
    Variant { family: "sm90", kind: KKind::Fwd, dtype, head_dim, mask, block_m, block_n, warps, stages, max_sq, warp_pairs: false, softcap: false, narrow: 0, paged: false, kv_split: false, q_stages: 1, kv: KvType::Same, v_width: 0 }
}

/// Non-causal d64 up to 1k query rows: 256x64 tiles, four consumer warpgroups, a 4-deep K/V ring
/// (symbol suffix `_s4`). The 192-row tile pads 512 / 1k query rows to 576 / 1152, and d64 is
/// latency-bound (ncu profile): a fourth consumer warpgroup hides more of it. Same-binary
/// A/B on the H100 against 192x128 (bf16): +8.5 / +6.3 % at 512 / 1k
/// (2 stages: +3.4-5.1 / +4.5-5.8 %); from 2k up the 64-key tiles lose (2 stages:
/// -3 % at 2k, -7 % at 8k and 16k). Where it has fewer query tiles than the GPU has SMs
/// (`Variant::serves_grid`) the later entries take over (1x8x512 16.6 ->
/// 14.7 us on 192x128, 13.3 us on 128x128). docs/decisions.md#d64-four-warpgroups.
const fn sm90_d64_short(dtype: KDType) -> Variant {
    sm90_staged(dtype, 64, KMask::None, 256, 64, 1024, 4)
}

/// Non-causal d64 on grids of at most one 128-row query tile per SM (`Variant::serves_grid`):
/// more CTAs, each walking the keys for fewer rows than on the 192-row tile. H100, bf16, CUDA
/// events after an L2 flush (docs/decisions.md#small-grids-on-128-row-tiles): 1x8x512 14.7 -> 13.3
/// us, 1x16x1024 21.2 -> 19.0,
/// 1x4x2048 30.5 -> 26.8.
const fn sm90_d64_small(dtype: KDType) -> Variant {
    sm90_tile(dtype, 64, KMask::None, SM90_SMALL_BLOCK_M, 128, u32::MAX)
}

/// Causal d64 up to 1k query rows, and above 1k on grids of at most one 128-row query tile per
/// SM (`Variant::serves_grid`; 1x8x2048 34.0 -> 29.5 us, 1x4x4096 57.0 -> 47.6):
/// 128-row tiles. With 192-row ones the causal grid computes
/// 1.7x / 1.5x / 1.18x / 1.12x the useful work at 512 / 1k / 2k / 4k (128 rows: 1.25x / 1.12x /
/// 1.06x / 1.03x). Same-call A/B on the H100: 128 rows +13 % / +16 % /
/// +1 % / -2 % at 512 / 1k / 2k / 4k. On the later kernel the 192-row tile wins 2k: +2.5 % in the
/// same call (bf16, two runs each), so on full grids 128 rows keep <= 1k.
/// Two Q buffers: 512 +2.2 %, 1k within 0.3 %. docs/decisions.md#sm90-tile-shapes.
const fn sm90_d64_causal_short(dtype: KDType) -> Variant {
    q2(sm90_tile(dtype, 64, KMask::Causal, SM90_SMALL_BLOCK_M, 128, u32::MAX))
}

/// Non-causal d128 up to 1k query rows: 128-key tiles; longer problems take 128x160 (`sm90`).
/// Wider key tiles halve the per-key softmax bookkeeping; 160 keys still leave room for the
/// separate O staging buffer (225 KB) and waste 1.5 % on the ragged last tile at 2k / 4k (176
/// keys, FA3's choice: no O buffer, 3 % at 2k). Same-binary A/B in the fa3 grid on the H100,
/// 160 / 176 against 128 (bf16, two runs each; docs/decisions.md#sm90-tile-shapes): 512 -11 / -11
/// %, 1k -5 / -7 %,
/// 2k +2 / -1 %, 4k -1 / -2 %, 8k +2 / +3 %, 16k +4 / +4 %; after 2 s of heat, 2k +1.5 / -2 %
/// and 16k +3 / +2 %.
const fn sm90_d128_short(dtype: KDType) -> Variant {
    sm90_tile(dtype, 128, KMask::None, 128, 128, 1024)
}

/// d256 up to 2k query rows: 64-key tiles; longer problems take 128x80 (`sm90`). 80 keys leave a
/// ragged last tile at 512 (7 x 80 for 512 keys) and, causal, compute more of the diagonal. Same
/// binary A/B on the H100 (bf16, two runs each, FLASHCORE_SKIP_VARIANTS;
/// docs/decisions.md#sm90-tile-shapes):
/// non-causal +2.7 / +2.5 % at 512, +0.3 / +0.9 % at 1k, +2.0 / +0.9 % at 2k; causal +3.7 / +3.2 %,
/// -1.3 / -0.8 %, +3.0 / +3.1 %.
const fn sm90_d256_short(dtype: KDType, mask: KMask) -> Variant {
    sm90_tile(dtype, 256, mask, 128, 64, 2048)
}

/// Largest seq_q routed to the split-KV decode kernels (decode and speculative widths).
pub const DECODE_MAX_SQ: u32 = 16;

/// Entry point of the combine kernel paired with a family's decode kernels.
pub fn combine_symbol(family: &str, dtype: KDType, head_dim: u32) -> String {
    format!("fc_{}_combine_{}_d{}", family, dtype.name(), head_dim)
}

/// The FP8-K/V twin (`KvType::E4m3`) of a split-KV decode row: key tiles twice as long (a byte
/// tile of 2 x block_n keys holds what a 16-bit tile of block_n does), the same ring depth, so
/// the bytes in flight and the barriers per byte match the 16-bit kernel's; 40 / 80 / 80 KB of
/// shared memory (fits sm_86 / sm_89's 99 KB).
/// docs/decisions.md#fp8-keys-and-values-in-the-decode-kernel.
const fn e4m3(v: Variant) -> Variant {
    Variant { kv: KvType::E4m3, block_n: 2 * v.block_n, ..v }
}

/// Kernels per dtype with K/V in that dtype (`base_rows`).
const BASE_ROWS: usize = 74;

/// Split-KV decode rows among `base_rows`: each has an FP8-K/V twin (`e4m3`).
const fn decode_rows() -> usize {
    let base = base_rows(KDType::Bf16);
    let (mut i, mut n) = (0, 0);
    while i < BASE_ROWS {
        if matches!(base[i].kind, KKind::Decode) {
            n += 1;
        }
        i += 1;
    }
    n
}

/// Kernels per dtype (`ROWS`): the table is written once and compiled for bf16 and f16 alike,
/// each split-KV decode row also for FP8 K/V.
pub const ROWS: usize = BASE_ROWS + decode_rows();

/// Every compiled kernel of one q dtype: `base_rows`, then the FP8-K/V twin of each of its
/// decode rows, in the same order (a twin never precedes a row with K/V in q's dtype, so a
/// search by (family, kind, dtype, head dim, mask) that ignores `kv` finds the latter first).
const fn rows(t: KDType) -> [Variant; ROWS] {
    let base = base_rows(t);
    let mut all = [base[0]; ROWS];
    let (mut i, mut n) = (0, BASE_ROWS);
    while i < BASE_ROWS {
        all[i] = base[i];
        if matches!(base[i].kind, KKind::Decode) {
            all[n] = e4m3(base[i]);
            n += 1;
        }
        i += 1;
    }
    all
}

/// Every compiled kernel of one dtype with K/V in that dtype. Where one problem class (family,
/// kind, dtype, K/V type, head dim, mask) has several entries, they are in order of preference:
/// the dispatcher takes the first one whose shared memory fits the GPU and whose `max_sq` admits
/// the problem's seq_q.
const fn base_rows(t: KDType) -> [Variant; BASE_ROWS] {
    [
        narrow(sm90_d64_short(t), 32),
        sm90_d64_short(t),
        narrow(sm90_d64_small(t), 32),
        kvs(sm90_d64_small(t)),
        sm90_d64_small(t),
        narrow(sm90(t, 64, KMask::None), 32),
        sm90(t, 64, KMask::None),
        narrow(sm90_d64_causal_short(t), 32),
        kvs(sm90_d64_causal_short(t)),
        sm90_d64_causal_short(t),
        narrow(sm90(t, 64, KMask::Causal), 32),
        sm90(t, 64, KMask::Causal),
        sm90_window(t, 64),
        pg(sm90_d128_short(t)),
        narrow(sm90_d128_short(t), 96),
        kvs(sm90_d128_short(t)),
        sm90_d128_short(t),
        pg(sm90(t, 128, KMask::None)),
        narrow(sm90(t, 128, KMask::None), 96),
        sm90(t, 128, KMask::None),
        pg(sm90(t, 128, KMask::Causal)),
        narrow(sm90(t, 128, KMask::Causal), 96),
        kvs(sm90(t, 128, KMask::Causal)),
        sm90(t, 128, KMask::Causal),
        sm90_window(t, 128),
        pg(sm90_d256_short(t, KMask::None)),
        narrow(sm90_d256_short(t, KMask::None), 160),
        narrow(sm90_d256_short(t, KMask::None), 192),
        sm90_d256_short(t, KMask::None),
        pg(sm90(t, 256, KMask::None)),
        narrow(sm90(t, 256, KMask::None), 160),
        narrow(sm90(t, 256, KMask::None), 192),
        sm90(t, 256, KMask::None),
        cap(sm90_d256_short(t, KMask::None)),
        cap(sm90(t, 256, KMask::None)),
        pg(sm90_d256_short(t, KMask::Causal)),
        narrow(sm90_d256_short(t, KMask::Causal), 160),
        narrow(sm90_d256_short(t, KMask::Causal), 192),
        sm90_d256_short(t, KMask::Causal),
        pg(sm90(t, 256, KMask::Causal)),
        narrow(sm90(t, 256, KMask::Causal), 160),
        narrow(sm90(t, 256, KMask::Causal), 192),
        sm90(t, 256, KMask::Causal),
        cap(sm90_d256_short(t, KMask::Causal)),
        cap(sm90(t, 256, KMask::Causal)),
        sm90_d192_v128(t, KMask::None),
        sm90_d192_v128(t, KMask::Causal),
        sm90_d512(t, KMask::None),
        sm90_d512(t, KMask::Causal),
        sm80(t, 64, KMask::None),
        sm80(t, 64, KMask::Causal),
        sm80(t, 64, KMask::Local),
        sm80(t, 128, KMask::None),
        cap(Variant { block_n: 32, ..sm80(t, 128, KMask::None) }),
        sm80(t, 128, KMask::Causal),
        sm80(t, 128, KMask::Local),
        sm80_pairs(t, 256, KMask::None),
        sm80(t, 256, KMask::None),
        sm80_small(t, 256, KMask::None),
        sm80_pairs(t, 256, KMask::Causal),
        sm80(t, 256, KMask::Causal),
        sm80_small(t, 256, KMask::Causal),
        sm80_pairs(t, 256, KMask::Local),
        sm80(t, 256, KMask::Local),
        sm80_small(t, 256, KMask::Local),
        sm80_decode(t, 64, KMask::None),
        sm80_decode(t, 64, KMask::Causal),
        sm80_decode(t, 64, KMask::Local),
        sm80_decode(t, 128, KMask::None),
        sm80_decode(t, 128, KMask::Causal),
        sm80_decode(t, 128, KMask::Local),
        sm80_decode(t, 256, KMask::None),
        sm80_decode(t, 256, KMask::Causal),
        sm80_decode(t, 256, KMask::Local),
    ]
}

/// `ROWS` for bf16, then for f16.
const fn both_dtypes() -> [Variant; 2 * ROWS] {
    let (bf16, f16) = (rows(KDType::Bf16), rows(KDType::F16));
    let mut all = [bf16[0]; 2 * ROWS];
    let mut i = 0;
    while i < ROWS {
        all[i] = bf16[i];
        all[ROWS + i] = f16[i];
        i += 1;
    }
    all
}

/// Every compiled kernel: `rows` for each dtype.
pub const VARIANTS: &[Variant] = &both_dtypes();
