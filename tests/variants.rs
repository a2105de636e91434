//! The variant table (kernels/variants.rs) on its own, without a GPU: one symbol per kernel, every
//! problem class has a kernel on each GPU it targets, and the planner (src/plan/) picks the tiles
//! these tests name, asked with made-up device descriptions.

use candle_core::{DType, Device as Host, Tensor};
use flashcore::plan::variants::*;
use flashcore::plan::{plan_dense, Arch, Device, Options};
use flashcore::{AttnParams, Mask};

/// Opt-in shared memory per block: sm_86/89, sm_80, sm_90.
const SMEM_SM86: u32 = 99 * 1024;
const SMEM_SM80: u32 = 163 * 1024;
const SMEM_SM90: u32 = 227 * 1024;

/// Made-up devices: an H100 (132 SMs), an A100 (108 SMs, 163 KB per block), an sm_86 part (82
/// SMs, 99 KB per block).
const H100: Device = Device {
    major: 9,
    minor: 0,
    sm_count: 132,
    smem_per_block: SMEM_SM90,
    smem_per_sm: 228 * 1024,
    smem_reserved_per_block: 1024,
    dram_bytes_per_s: 3.35e12,
};
const A100: Device = Device {
    major: 8,
    minor: 0,
    sm_count: 108,
    smem_per_block: SMEM_SM80,
    smem_per_sm: 164 * 1024,
    smem_reserved_per_block: 1024,
    dram_bytes_per_s: 1.555e12,
};
const SM86: Device = Device {
    major: 8,
    minor: 6,
    sm_count: 82,
    smem_per_block: SMEM_SM86,
    smem_per_sm: 100 * 1024,
    smem_reserved_per_block: 1024,
    dram_bytes_per_s: 0.936e12,
};

/// The sm80 family on each of its targets: the sm_86 part, the A100, and the H100 forced to it
/// (its 227 KB per block).
fn sm80_targets() -> [(Device, Options<'static>); 3] {
    let forced = Options {
        arch: Some(Arch::Sm80),
        ..Options::default()
    };
    [
        (SM86, Options::default()),
        (A100, Options::default()),
        (H100, forced),
    ]
}

/// A problem to ask the planner about: `b` x `sq` query rows of `hq` heads (8 K/V heads where
/// `hq` allows, else `hq`) over `sk` keys, head dim `d`, `mask` as a kernel family names it
/// (`Local`: a causal window of a quarter of the keys), with or without a softcap. The tensors are zero-stride
/// views of one row: only shapes and strides are read.
struct Ask {
    dtype: KDType,
    d: usize,
    mask: KMask,
    b: usize,
    sq: usize,
    sk: usize,
    hq: usize,
    cap: bool,
    /// v's head dim when it is not `d`
    dv: Option<usize>,
}

impl Ask {
    /// A large grid (64 x 64 (batch, head) pairs) of `sq` rows.
    fn new(dtype: KDType, d: u32, mask: KMask, sq: usize) -> Ask {
        Ask {
            dtype,
            d: d as usize,
            mask,
            b: 64,
            sq,
            sk: sq,
            hq: 64,
            cap: false,
            dv: None,
        }
    }
    fn dv(self, dv: usize) -> Ask {
        Ask {
            dv: Some(dv),
            ..self
        }
    }
    fn cap(self, cap: bool) -> Ask {
        Ask { cap, ..self }
    }
    fn keys(self, sk: usize) -> Ask {
        Ask { sk, ..self }
    }
    fn grid(self, b: usize, hq: usize) -> Ask {
        Ask { b, hq, ..self }
    }
    /// The kernel the planner gives this problem on `dev`, or its error.
    fn on(&self, dev: &Device, opts: &Options) -> candle_core::Result<&'static Variant> {
        let dt = match self.dtype {
            KDType::Bf16 => DType::BF16,
            KDType::F16 => DType::F16,
        };
        let hkv = if self.hq.is_multiple_of(8) {
            8
        } else {
            self.hq
        };
        let row = Tensor::zeros((1, 1, 1, self.d), dt, &Host::Cpu)?;
        let q = row.broadcast_as((self.b, self.sq, self.hq, self.d))?;
        let kv = row.broadcast_as((self.b, self.sk, hkv, self.d))?;
        let dv = self.dv.unwrap_or(self.d);
        let v = Tensor::zeros((1, 1, 1, dv), dt, &Host::Cpu)?
            .broadcast_as((self.b, self.sk, hkv, dv))?;
        let mask = match self.mask {
            KMask::None => Mask::None,
            KMask::Causal => Mask::Causal,
            KMask::Local => Mask::Window {
                left: Some((self.sk / 4).max(1)),
                right: Some(0),
            },
        };
        let params = AttnParams {
            mask,
            softcap: self.cap.then_some(30.0),
            ..AttnParams::default()
        };
        Ok(plan_dense(&q, &kv, &v, &params, dev, opts)?.variant)
    }
    fn take(&self, dev: &Device, opts: &Options) -> &'static Variant {
        self.on(dev, opts).unwrap_or_else(|e| {
            panic!(
                "{:?} d{} {:?} b{} sq{} sk{} hq{} cap {}: {e}",
                self.dtype, self.d, self.mask, self.b, self.sq, self.sk, self.hq, self.cap
            )
        })
    }
}

#[test]
fn symbols_are_unique() {
    let mut seen = std::collections::HashSet::new();
    for v in VARIANTS {
        assert!(
            seen.insert(v.symbol()),
            "duplicate kernel symbol {}",
            v.symbol()
        );
    }
}

/// Every problem class has a kernel on every target at every seq_q: the planner answers (and
/// within the device's shared memory).
#[test]
fn every_class_serves_every_seq_len() {
    let targets = sm80_targets()
        .into_iter()
        .chain([(H100, Options::default())]);
    for (dev, opts) in targets {
        for dtype in [KDType::Bf16, KDType::F16] {
            for d in [64, 128, 256] {
                for mask in [KMask::None, KMask::Causal, KMask::Local] {
                    for sq in [1, 16, 17, 1024, 1025, 2048, 2049, 4096, 4097, 1 << 20] {
                        let b = if sq > 4097 { 1 } else { 64 };
                        let v = Ask::new(dtype, d, mask, sq).grid(b, 64).take(&dev, &opts);
                        assert!(v.smem_bytes() <= dev.smem_per_block, "{}", v.symbol());
                    }
                }
            }
        }
    }
    let h100 = |dtype, d, mask, sq| Ask::new(dtype, d, mask, sq).take(&H100, &Options::default());
    let short = h100(KDType::Bf16, 64, KMask::Causal, 1024);
    let long = h100(KDType::Bf16, 64, KMask::Causal, 1025);
    assert_eq!((short.block_m, long.block_m), (128, 192));
    for dtype in [KDType::Bf16, KDType::F16] {
        // d64 non-causal: four consumer warpgroups on 256x64 with a 4-deep K/V ring up to 1k
        // query rows, three on 192x128 above (docs/decisions.md#d64-four-warpgroups).
        let short = h100(dtype, 64, KMask::None, 1024);
        let long = h100(dtype, 64, KMask::None, 1025);
        assert_eq!(
            (short.block_m, short.block_n, short.warps, short.stages),
            (256, 64, 20, 4)
        );
        assert!(short.symbol().ends_with("_256x64_s4"), "{}", short.symbol());
        assert_eq!(
            (long.block_m, long.block_n, long.stages, long.q_stages),
            (192, 128, 2, 2)
        );
        assert!(long.symbol().ends_with("_192x128_q2"), "{}", long.symbol());
        let short = h100(dtype, 128, KMask::None, 1024);
        let long = h100(dtype, 128, KMask::None, 1025);
        assert_eq!((short.block_n, long.block_n), (128, 160));
        assert!(long.smem_bytes() <= SMEM_SM90, "{}", long.smem_bytes());
        for mask in [KMask::None, KMask::Causal] {
            let short = h100(dtype, 256, mask, 2048);
            let long = h100(dtype, 256, mask, 2049);
            assert_eq!((short.block_n, long.block_n), (64, 80), "d256 {mask:?}");
        }
    }
}

/// On grids of at most one 128-row d64 query tile per SM the planner takes the 128-row tiles
/// (`Variant::serves_grid`); larger grids keep the 256- and 192-row tiles.
#[test]
fn small_d64_grids_take_128_row_tiles() {
    let take = |mask: KMask, sq: usize, bh: usize| {
        let v = Ask::new(KDType::Bf16, 64, mask, sq)
            .grid(1, bh)
            .take(&H100, &Options::default());
        assert_eq!((v.family, v.kind), ("sm90", KKind::Fwd), "{}", v.symbol());
        v.block_m
    };
    // (mask, seq_q, batch x heads, block_m)
    let cases = [
        (KMask::None, 512, 8, 128), // the seeds' 1x8x512: 4 x 8 = 32 tiles of 128 rows
        (KMask::None, 1024, 16, 128), // 8 x 16 = 128
        (KMask::None, 1024, 20, 192), // 160 of 128 rows, 6 x 20 = 120 of 192
        (KMask::None, 2048, 4, 128), // 16 x 4 = 64
        (KMask::None, 512, 64, 192), // 2 x 64 = 128 tiles of 256 rows, 4 x 64 = 256 of 128
        (KMask::None, 512, 132, 256), // 2 x 132 tiles of 256 rows
        (KMask::None, 1025, 1024, 192), // past the 256-row tile's 1k
        (KMask::Causal, 512, 1024, 128),
        (KMask::Causal, 2048, 8, 128), // 16 x 8 = 128 tiles of 128 rows
        (KMask::Causal, 2048, 16, 192), // 256
        (KMask::Causal, 1500, 16, 192), // 12 x 16 = 192
    ];
    for (mask, sq, bh, want) in cases {
        assert_eq!(
            take(mask, sq, bh),
            want,
            "{mask:?} seq_q {sq}, {bh} (batch, head) pairs"
        );
    }
    // only d64 on sm90 depends on the grid
    for v in VARIANTS
        .iter()
        .filter(|v| v.head_dim != 64 || v.family != "sm90")
    {
        assert!(v.serves_grid(1, 1, 132), "{}", v.symbol());
    }
}

/// Every sm80 forward and decode class has a kernel within each target's shared memory: a
/// 99 KB device never gets a larger one.
#[test]
fn every_sm80_class_fits_every_target() {
    for (dev, opts) in sm80_targets() {
        for dtype in [KDType::Bf16, KDType::F16] {
            for d in [64, 128, 256] {
                for mask in [KMask::None, KMask::Causal, KMask::Local] {
                    for (kind, sq) in [(KKind::Fwd, 1024), (KKind::Decode, 4)] {
                        let v = Ask::new(dtype, d, mask, sq).keys(4096).take(&dev, &opts);
                        assert_eq!((v.family, v.kind, v.mask), ("sm80", kind, mask));
                        assert!(
                            v.smem_bytes() <= dev.smem_per_block,
                            "{} needs {} B, the device has {}",
                            v.symbol(),
                            v.smem_bytes(),
                            dev.smem_per_block
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn larger_tiles_are_preferred_where_they_fit() {
    // d256: the 226 KB warp-pair tile on sm_90, the 128 KB tile on sm_80, the 96 KB one on
    // sm_86/89.
    let [sm86, a100, h100] = sm80_targets();
    let d256 = |(dev, opts): &(Device, Options)| {
        Ask::new(KDType::Bf16, 256, KMask::None, 1024).take(dev, opts)
    };
    let pairs = d256(&h100);
    assert!(pairs.warp_pairs, "{}", pairs.symbol());
    // 128x128 Q/K/V tiles, 128x128 P tile, 2 x 8 warps x 32 rows of f32 row statistics.
    assert_eq!(
        (pairs.block_m, pairs.block_n, pairs.smem_bytes()),
        (128, 128, 192 * 1024 + 32 * 1024 + 2048)
    );
    assert!(pairs.symbol().ends_with("_128x128p"), "{}", pairs.symbol());
    let big = d256(&a100);
    let small = d256(&sm86);
    assert_eq!(
        (big.block_m, big.block_n, big.smem_bytes()),
        (128, 64, 128 * 1024)
    );
    assert_eq!(
        (small.block_m, small.block_n, small.smem_bytes()),
        (64, 32, 96 * 1024)
    );
    assert_ne!(big.symbol(), small.symbol());
    // The tile is launched as the table says: warps cover block_m in m16 tiles.
    for v in VARIANTS
        .iter()
        .filter(|v| v.family == "sm80" && v.kind == KKind::Fwd)
    {
        // (warp pairs: each pair covers 32 rows, so 8 rows per warp)
        let rows_per_warp = if v.warp_pairs { 8 } else { 16 };
        assert_eq!(v.block_m % (rows_per_warp * v.warps), 0, "{}", v.symbol());
        assert!(v.stages == 1 || v.stages == 2, "{}", v.symbol());
        if v.warp_pairs {
            // fwd_body_pair: one stage, whole 64-key P swizzle rows, named barriers 1..15.
            assert!(v.stages == 1 && v.block_n % 64 == 0 && v.block_n <= 128);
            assert!(v.warps % 2 == 0 && v.warps <= 30 && v.head_dim == 256);
        }
    }
}

#[test]
fn sm80_d128_tiles_per_mask() {
    // Non-causal 128x48 (80 KB: fits sm_86/89 too), causal 128x32, local 64x64
    // (docs/decisions.md#sm80-tiles); one choice on every smem budget.
    for (dev, opts) in sm80_targets() {
        for dtype in [KDType::Bf16, KDType::F16] {
            let tile = |mask| {
                let v = Ask::new(dtype, 128, mask, 1024).take(&dev, &opts);
                (v.block_m, v.block_n, v.warps, v.stages, v.smem_bytes())
            };
            assert_eq!(tile(KMask::None), (128, 48, 4, 2, 80 * 1024));
            assert_eq!(tile(KMask::Causal), (128, 32, 4, 2, 64 * 1024));
            assert_eq!(tile(KMask::Local), (64, 64, 4, 2, 80 * 1024));
        }
    }
}

/// Softcap: every sm80 class (forward and decode, every target, every seq_q) has a kernel that
/// computes it, and the softcap twins serve softcap problems only. d128 without a mask takes the
/// 128x32 twin (the 128x48 tile has no softcap body); sm90 d256 takes its `_cap` twins, and sm90
/// d64/d128 have none (those problems run on the sm80 family).
#[test]
fn softcap_has_a_kernel_everywhere() {
    for dtype in [KDType::Bf16, KDType::F16] {
        for d in [64, 128, 256] {
            for mask in [KMask::None, KMask::Causal, KMask::Local] {
                for (dev, opts) in sm80_targets() {
                    for sq in [4, 17, 1024, 1025, 2049, 1 << 20] {
                        let b = if sq > 4096 { 1 } else { 64 };
                        let ask = Ask::new(dtype, d, mask, sq).keys(sq.max(4096)).grid(b, 64);
                        let v = ask.cap(true).take(&dev, &opts);
                        assert!(v.has_cap_body() || v.softcap, "{}", v.symbol());
                        let plain = Ask::new(dtype, d, mask, sq)
                            .keys(sq.max(4096))
                            .grid(b, 64)
                            .take(&dev, &opts);
                        assert!(!plain.softcap, "{}", plain.symbol());
                        assert_eq!(v.family, "sm80");
                    }
                }
            }
            for mask in [KMask::None, KMask::Causal] {
                for sq in [1024, 2049] {
                    let ask = || Ask::new(dtype, d, mask, sq);
                    let capped = ask().cap(true).take(&H100, &Options::default());
                    let plain = ask().take(&H100, &Options::default());
                    assert!(
                        plain.family == "sm90" && !plain.softcap && !plain.has_cap_body(),
                        "{}",
                        plain.symbol()
                    );
                    if d == 256 {
                        assert!(
                            capped.family == "sm90" && capped.softcap,
                            "{}",
                            capped.symbol()
                        );
                        assert!(capped.symbol().ends_with("_cap"), "{}", capped.symbol());
                        assert_eq!(
                            (capped.block_m, capped.block_n),
                            (plain.block_m, plain.block_n)
                        );
                    } else {
                        assert_eq!(capped.family, "sm80", "{}", capped.symbol());
                    }
                }
            }
        }
        let [sm86, ..] = sm80_targets();
        let v = Ask::new(dtype, 128, KMask::None, 4096)
            .cap(true)
            .take(&sm86.0, &sm86.1);
        assert!(v.symbol().ends_with("_128x32_cap"), "{}", v.symbol());
    }
    for v in VARIANTS.iter().filter(|v| v.softcap) {
        assert!(
            v.admits_softcap(true) && !v.admits_softcap(false),
            "{}",
            v.symbol()
        );
    }
}

#[test]
fn sm90_kernels_fit_hopper() {
    for v in VARIANTS.iter().filter(|v| v.family == "sm90") {
        assert!(
            v.smem_bytes() <= SMEM_SM90,
            "{} needs {} B",
            v.symbol(),
            v.smem_bytes()
        );
    }
}

/// Every paged twin is a full-width d128 / d256 sm90 forward kernel listed before its narrow and
/// key-split twins and the kernel itself (same tile), every such kernel but the softcap ones has one, and a twin
/// reads power-of-two pages from 16 rows in-kernel.
#[test]
fn paged_twins_precede_their_kernel() {
    let mut n = 0;
    for (i, v) in VARIANTS.iter().enumerate() {
        if !v.paged {
            continue;
        }
        assert!(
            v.family == "sm90"
                && v.kind == KKind::Fwd
                && !v.softcap
                && v.narrow == 0
                && matches!(v.head_dim, 128 | 256)
                && matches!(v.mask, KMask::None | KMask::Causal),
            "{}",
            v.symbol()
        );
        let next = VARIANTS[i + 1..]
            .iter()
            .find(|w| w.narrow == 0 && !w.kv_split)
            .expect("a paged twin is not last");
        // (twins keep one Q buffer where their kernel has two)
        let own = Variant {
            paged: false,
            q_stages: next.q_stages,
            ..*v
        };
        assert_eq!(
            own.symbol(),
            next.symbol(),
            "{} must precede its kernel",
            v.symbol()
        );
        assert!(
            VARIANTS[i + 1..]
                .iter()
                .take_while(|w| w.symbol() != own.symbol())
                .all(|w| {
                    let base = Variant {
                        narrow: 0,
                        kv_split: false,
                        q_stages: own.q_stages,
                        ..*w
                    };
                    (w.narrow > 0 || w.kv_split) && base.symbol() == own.symbol()
                }),
            "{}: only its kernel's narrow and key-split twins between it and the kernel",
            v.symbol()
        );
        for page in [32usize, 64, 128, 256] {
            assert!(v.page_box(page).is_some(), "{} page {page}", v.symbol());
        }
        assert_eq!(v.page_box(16), Some(16), "{} takes pages of 16", v.symbol());
        assert_eq!(
            v.page_box(24),
            None,
            "{}: power-of-two pages only",
            v.symbol()
        );
        n += 1;
    }
    let full = VARIANTS
        .iter()
        .filter(|v| {
            v.family == "sm90"
                && matches!(v.head_dim, 128 | 256)
                && !v.softcap
                && v.narrow == 0
                && !v.paged
                && !v.kv_split
                && !matches!(v.mask, KMask::Local)
        })
        .count();
    assert_eq!(
        n, full,
        "a paged twin for every d128 / d256 sm90 tile (softcap twins and window kernels aside)"
    );
}

/// Every narrow twin is an sm90 forward kernel listed before the kernel it narrows (same tile),
/// which serves the full head dim, the twins of one kernel in increasing width; each width lies
/// between the next smaller kernel's head dim and its own, and the sm90 family has twins for every
/// (dtype, head dim, mask, tile) of d64, d128 and d256 but the softcap ones.
#[test]
fn narrow_twins_precede_their_kernel() {
    let mut n = 0;
    for (i, v) in VARIANTS.iter().enumerate() {
        if v.narrow == 0 {
            continue;
        }
        assert!(v.family == "sm90" && !v.softcap, "{}", v.symbol());
        let below = match v.head_dim {
            64 => 0,
            128 => 64,
            256 => 128,
            d => panic!("{}: no narrow twin of d{d}", v.symbol()),
        };
        assert!(
            v.narrow > below && v.narrow < v.head_dim && v.narrow % 16 == 0,
            "{}: width {} outside ({below}, {})",
            v.symbol(),
            v.narrow,
            v.head_dim
        );
        // (a key-split twin may sit between the widest narrow twin and its kernel)
        let next = VARIANTS[i + 1..]
            .iter()
            .find(|w| !w.kv_split)
            .expect("a narrow twin is not last");
        let own = Variant {
            narrow: 0,
            q_stages: next.q_stages,
            ..*v
        }
        .symbol();
        if next.narrow > 0 {
            assert!(
                next.narrow > v.narrow && Variant { narrow: 0, ..*next }.symbol() == own,
                "{} must be followed by a wider twin of its kernel or the kernel, not {}",
                v.symbol(),
                next.symbol()
            );
        } else {
            assert_eq!(own, next.symbol(), "{} must precede its kernel", v.symbol());
        }
        n += 1;
    }
    let full = |d: u32| {
        VARIANTS
            .iter()
            .filter(|v| {
                v.family == "sm90"
                    && v.head_dim == d
                    && !v.softcap
                    && v.narrow == 0
                    && !v.paged
                    && !v.kv_split
                    && !matches!(v.mask, KMask::Local)
            })
            .count()
    };
    // d64: d32; d128: d96; d256: d160 and d192
    assert_eq!(
        n,
        full(64) + full(128) + 2 * full(256),
        "narrow twins for every sm90 tile (softcap twins and window kernels aside)"
    );
    assert_eq!(
        n, 32,
        "narrow twins: d64 and d128 (8 tiles), d256 (4 tiles, two widths), bf16 and f16"
    );
}

/// Every key-split twin (`Variant::kv_split`) is an sm90 forward kernel of 128x128 tiles at d64 or
/// d128 (two consumer warpgroups: kernels/sm90/fwd.cuh `SPLIT`), listed right before the kernel
/// it splits, with the same tile and shared memory, serving any seq_q; one for each of d64
/// non-causal and causal and d128 non-causal (short) and causal, bf16 and f16.
#[test]
fn key_split_twins_precede_their_kernel() {
    let mut n = 0;
    for (i, v) in VARIANTS.iter().enumerate() {
        if !v.kv_split {
            continue;
        }
        assert!(
            v.family == "sm90"
                && v.kind == KKind::Fwd
                && matches!(v.head_dim, 64 | 128)
                && (v.block_m, v.block_n, v.stages) == (128, 128, 2)
                && v.narrow == 0
                && !v.paged
                && !v.softcap
                && v.max_sq == u32::MAX,
            "{}",
            v.symbol()
        );
        assert!(v.symbol().ends_with("_128x128_kvs"), "{}", v.symbol());
        let next = VARIANTS.get(i + 1).expect("a key-split twin is not last");
        let own = Variant {
            kv_split: false,
            max_sq: next.max_sq,
            q_stages: next.q_stages,
            ..*v
        };
        assert_eq!(
            own.symbol(),
            next.symbol(),
            "{} must precede its kernel",
            v.symbol()
        );
        // the same tiles, one Q buffer
        let one_q = Variant {
            q_stages: 1,
            ..*next
        };
        assert_eq!(v.smem_bytes(), one_q.smem_bytes(), "{}", v.symbol());
        n += 1;
    }
    assert_eq!(
        n, 8,
        "key-split twins: d64 and d128, no mask and causal, bf16 and f16"
    );
}

/// The planner's grid arithmetic (src/plan/choose.rs `kv_splits`, `decode_beats_starved_prefill`,
/// `Variant::serves_grid`) counts query tiles of `SM90_SMALL_BLOCK_M` rows: the tiles it weighs
/// (the key-split twins, the causal tiles up to d128 but the d64 192-row one, the small-grid d64
/// tiles) must have that height.
#[test]
fn grid_arithmetic_matches_the_tiles() {
    for v in VARIANTS {
        if v.kv_split
            || (v.family == "sm90"
                && v.kind == KKind::Fwd
                && v.head_dim <= 128
                && v.mask == KMask::Causal
                && v.block_m != 192)
        {
            assert_eq!(v.block_m, SM90_SMALL_BLOCK_M, "{}", v.symbol());
        }
    }
    // the 128-row d64 tiles for small grids exist in both dtypes and masks
    for dtype in [KDType::Bf16, KDType::F16] {
        for mask in [KMask::None, KMask::Causal] {
            assert!(
                VARIANTS.iter().any(|v| v.family == "sm90"
                    && v.kind == KKind::Fwd
                    && v.dtype == dtype
                    && v.head_dim == 64
                    && v.mask == mask
                    && v.block_m == SM90_SMALL_BLOCK_M
                    && !v.kv_split
                    && v.narrow == 0),
                "{dtype:?} {mask:?}"
            );
        }
    }
}

/// Two Q buffers (`Variant::q_stages`, kernels/sm90/fwd.cuh `QS`): sm90 forward kernels only, not
/// their twins, and only where the separate O buffer still fits beside them (the kernel
/// static_asserts it; this keeps the host's shared-memory size on the same formula).
#[test]
fn two_q_buffers_keep_the_o_buffer() {
    let mut n = 0;
    for v in VARIANTS {
        assert!(matches!(v.q_stages, 1 | 2), "{}", v.symbol());
        if v.q_stages == 1 {
            assert!(!v.symbol().contains("_q2"), "{}", v.symbol());
            continue;
        }
        assert!(
            v.family == "sm90"
                && v.kind == KKind::Fwd
                && !v.paged
                && !v.kv_split
                && v.narrow == 0
                && !v.softcap,
            "{}: two Q buffers on an sm90 forward kernel, not a twin",
            v.symbol()
        );
        let q = v.block_m * v.head_dim * 2;
        let kv = 2 * v.stages * v.block_n * v.head_dim * 2;
        assert_eq!(
            v.smem_bytes(),
            3 * q + kv + 1280,
            "{}: Q x 2, K/V, O",
            v.symbol()
        );
        assert!(v.smem_bytes() <= SMEM_SM90, "{}", v.symbol());
        assert!(v.symbol().contains("_q2"), "{}", v.symbol());
        n += 1;
    }
    assert_eq!(
        n, 10,
        "two Q buffers: d64 192x128 no mask, d64 128x128 causal, d128 128x128 causal, the d64 and \
         d128 window kernels; bf16 and f16"
    );
}

/// Every split-KV decode row has exactly one FP8-K/V twin (`KvType::E4m3`): the same tile, a
/// symbol naming e4m3, shared memory that fits sm_86/89; no other kernel reads FP8.
#[test]
fn fp8_decode_twins() {
    for v in VARIANTS
        .iter()
        .filter(|v| v.kind == KKind::Decode && v.kv == KvType::Same)
    {
        let twins: Vec<_> = VARIANTS
            .iter()
            .filter(|w| {
                w.kv == KvType::E4m3
                    && w.family == v.family
                    && w.dtype == v.dtype
                    && w.head_dim == v.head_dim
                    && w.mask == v.mask
            })
            .collect();
        assert_eq!(twins.len(), 1, "{}: FP8 twins", v.symbol());
        let t = twins[0];
        // key tiles of twice the keys: the same bytes a tile as the 16-bit row
        assert_eq!(
            (t.block_m, t.block_n, t.warps, t.stages),
            (v.block_m, 2 * v.block_n, v.warps, v.stages),
            "{}",
            t.symbol()
        );
        assert_eq!(t.block_n_16bit(), v.block_n, "{}", t.symbol());
        assert!(t.symbol().contains("_e4m3_"), "{}", t.symbol());
        assert!(
            t.smem_bytes() <= SMEM_SM86,
            "{}: {} B",
            t.symbol(),
            t.smem_bytes()
        );
    }
    assert!(VARIANTS
        .iter()
        .all(|v| v.kv == KvType::Same || v.kind == KKind::Decode));
}

/// DeepSeek prefill (d_qk 192, d_v 128) takes the separate-V kernels on sm_90 (`v_width`: a V
/// ring 128 wide and 128-key tiles), as do head dims that round up to the same 64-column blocks;
/// other pairs take the kernel of the larger head dim, and the sm80 targets the padded problem's.
#[test]
fn separate_v_kernels_take_deepseek_prefill() {
    for dtype in [KDType::Bf16, KDType::F16] {
        for mask in [KMask::None, KMask::Causal] {
            for (d, dv) in [(192, 128), (136, 72)] {
                for sq in [113, 4096] {
                    let v = Ask::new(dtype, d, mask, sq)
                        .dv(dv)
                        .take(&H100, &Options::default());
                    assert_eq!(
                        (v.head_dim, v.v_width, v.block_n),
                        (192, 128, 128),
                        "{}",
                        v.symbol()
                    );
                    assert!(v.symbol().ends_with("_128x128_v128"), "{}", v.symbol());
                    assert!(v.smem_bytes() <= SMEM_SM90);
                }
            }
            for (d, dv, kernel) in [
                (192, 64, 256),
                (128, 64, 128),
                (64, 128, 128),
                (128, 192, 256),
            ] {
                let v = Ask::new(dtype, d, mask, 4096)
                    .dv(dv as usize)
                    .take(&H100, &Options::default());
                assert_eq!((v.head_dim, v.v_width), (kernel, 0), "{}", v.symbol());
            }
            for (dev, opts) in sm80_targets() {
                let v = Ask::new(dtype, 192, mask, 4096).dv(128).take(&dev, &opts);
                assert_eq!((v.family, v.head_dim), ("sm80", 256), "{}", v.symbol());
            }
        }
    }
}

/// Head dims past 256 take the d512 kernels on sm_90 (V and O in launches of 256 columns,
/// `Variant::slices_v`), whichever side is wider; the sm80 targets refuse them naming it.
#[test]
fn head_dims_past_256_take_the_d512_kernels() {
    for mask in [KMask::None, KMask::Causal] {
        for (d, dv, launches) in [(512, 512, 2), (264, 264, 2), (512, 256, 1), (192, 264, 2)] {
            for sq in [1, 113, 16384] {
                let v = Ask::new(KDType::Bf16, d, mask, sq)
                    .dv(dv)
                    .take(&H100, &Options::default());
                assert_eq!((v.head_dim, v.v_width), (512, 256), "{}", v.symbol());
                assert_eq!(v.v_launches(dv), launches, "{}", v.symbol());
                assert!(v.smem_bytes() <= SMEM_SM90, "{}", v.smem_bytes());
            }
        }
        for (dev, opts) in sm80_targets() {
            for (d, dv, arg) in [(512, 512, "q"), (192, 264, "v")] {
                let e = Ask::new(KDType::F16, d, mask, 1024)
                    .dv(dv)
                    .on(&dev, &opts)
                    .unwrap_err();
                let e = e.to_string();
                assert!(
                    e.contains(&format!("{arg}: head_dim {}", d.max(dv as u32))),
                    "{e}"
                );
            }
        }
    }
}
