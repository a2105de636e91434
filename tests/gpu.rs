//! GPU tests (feature `cuda`): every test skips itself, saying so, when no CUDA device is present
//! (FLASHCORE_REQUIRE_GPU=1 makes that a failure); with one, each compares the kernels against a
//! CPU reference and can fail. One binary, so the packed bundle carries candle's PTX once.
#![cfg(feature = "cuda")]

mod common;
#[path = "common/gpu.rs"]
mod common_gpu;

use candle_core::{DType, Device, Result, Tensor};
use common::*;
use common_gpu::{arch_under_test, gpu};
use flashcore::{attention_slow, attention_with_lse, AttnParams, Mask};

struct Case {
    b: usize,
    sq: usize,
    sk: usize,
    hq: usize,
    hkv: usize,
    d: usize,
    dtype: DType,
    mask: Mask,
    strided: bool,
}

impl std::fmt::Display for Case {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:?} b{} sq{} sk{} h{}/{} d{} {} strided={}",
            self.dtype,
            self.b,
            self.sq,
            self.sk,
            self.hq,
            self.hkv,
            self.d,
            mask_name(self.mask),
            self.strided
        )
    }
}

/// Runs one case on the GPU (outputs poisoned first) and checks the tolerance rule: the fused
/// error against float64 is at most 2x the error of the naive same-precision GPU implementation
/// (candle matmul/softmax in the input dtype) plus a rounding floor; LSE within f32 rounding.
/// Also returns the kernel the dispatcher picked.
fn check(dev: &Device, c: &Case) -> Result<(f64, f64, String)> {
    let (q, k, v) = qkv(c.b, c.sq, c.sk, c.hq, c.hkv, c.d, c.dtype, c.strided, dev)?;
    let (e, ne) = check_inputs(&c.to_string(), &q, &k, &v, c.mask)?;
    let kernel = match dev {
        Device::Cuda(d) => {
            let p = AttnParams {
                mask: c.mask,
                ..Default::default()
            };
            flashcore::cuda::describe(d, &p, &q, &k, &v)?
        }
        _ => "cpu".into(),
    };
    Ok((e, ne, kernel))
}

/// The tolerance rule on given inputs; returns (fused error, naive error) against float64.
fn check_inputs(what: &str, q: &Tensor, k: &Tensor, v: &Tensor, mask: Mask) -> Result<(f64, f64)> {
    let p = AttnParams {
        mask,
        ..Default::default()
    };
    check_params(what, q, k, v, &p)
}

/// `check_inputs` with any parameters.
fn check_params(
    what: &str,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    p: &AttnParams,
) -> Result<(f64, f64)> {
    let (o, lse) = attention_with_lse(q, k, v, p)?;
    let o = o.to_device(&Device::Cpu)?;
    let lse = lse.to_device(&Device::Cpu)?;
    assert_eq!(
        non_finite(&o)?,
        0,
        "{what}: non-finite (unwritten or NaN) output elements"
    );
    let (o_ref, lse_ref) = reference_f64(q, k, v, p)?;
    let naive = attention_slow(q, k, v, p)?.to_device(&Device::Cpu)?;
    let err = max_abs_diff(&o, &o_ref)?;
    let naive_err = max_abs_diff(&naive, &o_ref)?;
    let floor = rounding_floor(q.dtype(), max_abs(&o_ref)?);
    assert!(
        err <= 2.0 * naive_err + floor,
        "{what}: fused error {err:.3e} > 2 x naive {naive_err:.3e} + floor {floor:.1e}"
    );
    let lerr = lse_err(&lse, &lse_ref)?;
    assert!(lerr <= 2e-3, "{what}: lse error {lerr:.3e}");
    Ok((err, naive_err))
}

#[test]
fn pipeline_tiny_kernel_poisons() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        let t = Tensor::ones((3, 1000), dtype, &dev)?;
        flashcore::cuda::poison(&t)?;
        let n = non_finite(&t.to_device(&Device::Cpu)?)?;
        assert_eq!(
            n, 3000,
            "{dtype:?}: poison kernel wrote {n} of 3000 elements"
        );
    }
    Ok(())
}

#[test]
fn sweep() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    arch_under_test();
    let seqs = [
        (1, 1),
        (1, 113),
        (7, 113),
        (113, 7),
        (113, 113),
        (256, 256),
        (1023, 1023),
        (2113, 2113), // past sm90 d64 causal's 128-row tile (max_sq 1024): the 192-row one
        (1, 4224),
        (4224, 4224),
        (113, 4224),
        (1023, 113),
    ];
    let heads = [(8, 8), (8, 2), (8, 1)];
    let mut n = 0;
    for dtype in [DType::BF16, DType::F16] {
        for d in [64, 128, 256] {
            for mask in [
                Mask::None,
                Mask::Causal,
                Mask::Window {
                    left: Some(100),
                    right: Some(20),
                },
            ] {
                for &(sq, sk) in &seqs {
                    if sq * sk >= 4224 * 4224 && (d != 128 || dtype == DType::F16) {
                        continue; // the f64 CPU reference of the largest case is slow: once per mask
                    }
                    // Every (heads, strided) combination recurs every 6 cases.
                    let (hq, hkv) = heads[n % 3];
                    let c = Case {
                        b: if sq * sk > 1 << 20 { 1 } else { 2 },
                        sq,
                        sk,
                        hq,
                        hkv,
                        d,
                        dtype,
                        mask,
                        strided: n % 2 == 0,
                    };
                    let (e, ne, kernel) = check(&dev, &c)?;
                    println!("[OK] {c}: err {e:.2e} (naive {ne:.2e}) {kernel}");
                    n += 1;
                }
            }
        }
    }
    println!("sweep: {n} cases passed");
    Ok(())
}

#[test]
fn random_problems() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    arch_under_test();
    let count = random_cases();
    let mut rng = Rng::from_clock("random_problems");
    let mut next = |n: usize| rng.below(n);
    for i in 0..count {
        let hkv = [1, 2, 4][next(3)];
        let hq = hkv * [1, 2, 4, 8][next(4)];
        let c = Case {
            b: 1 + next(3),
            sq: 1 + next(600),
            sk: 1 + next(600),
            hq,
            hkv,
            d: [64, 128, 256][next(3)],
            dtype: [DType::BF16, DType::F16][next(2)],
            mask: [
                Mask::None,
                Mask::Causal,
                Mask::Window {
                    left: Some(next(300)),
                    right: Some(next(300)),
                },
            ][next(3)],
            strided: next(2) == 1,
        };
        check(&dev, &c)
            .map_err(|e| candle_core::Error::Msg(format!("random case {i} ({c}): {e}")))?;
    }
    println!("random_problems: {count} cases passed");
    Ok(())
}

/// d64 problems by grid size (`Variant::serves_grid`): without a mask the 256-row tile
/// (`_256x64_s4`) when it has at least as many query tiles as the GPU has SMs, the 192-row one
/// below that, and the 128-row one when its query tiles fit one per SM; causal above 1k rows the
/// 128-row tile likewise. Each checked against the reference; the kernel names
/// are asserted on the sm90 dispatch.
#[test]
fn short_d64_tiles_by_problem_size() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    arch_under_test();
    let Device::Cuda(cuda) = &dev else {
        unreachable!()
    };
    // (b, sq, sk, hq, hkv, mask, tile when sm90, asserted on GPUs of more SMs than the first
    // count and at most the second):
    // 4 x 8 = 32 tiles of 128 rows; 4 x 40 = 160 of 256 rows; 2 x 64 = 128 of 256 rows and
    // 4 x 64 = 256 of 128 rows (H100: 132 SMs); causal 16 x 4 = 64 and 9 x 64 = 576 of 128 rows
    let sms = flashcore::cuda::device_info(cuda)?.sm_count;
    for (b, sq, sk, hq, hkv, mask, tile, least, most) in [
        (1, 512, 512, 8, 8, Mask::None, "_128x128", 31, usize::MAX),
        (1, 1000, 600, 40, 8, Mask::None, "_256x64_s4", 0, 160),
        (4, 512, 512, 16, 4, Mask::None, "_192x128", 128, 255),
        (
            1,
            2048,
            2048,
            4,
            1,
            Mask::Causal,
            "_128x128",
            63,
            usize::MAX,
        ),
        (2, 1100, 1100, 32, 8, Mask::Causal, "_192x128", 0, 575),
    ] {
        let c = Case {
            b,
            sq,
            sk,
            hq,
            hkv,
            d: 64,
            dtype: DType::BF16,
            mask,
            strided: false,
        };
        let (e, ne, kernel) = check(&dev, &c)?;
        if kernel.contains("_sm90_") && least < sms && sms <= most {
            // (small grids may split their keys over clusters: the key-split twin of the tile)
            let sym = kernel.split(' ').next().unwrap_or_default();
            assert!(
                sym.trim_end_matches("_kvs")
                    .trim_end_matches("_q2")
                    .ends_with(tile),
                "{c}: ran {kernel}, want {tile}"
            );
        }
        println!("[OK] {c}: err {e:.2e} (naive {ne:.2e}) {kernel}");
    }
    Ok(())
}

/// The sm90 dynamic causal schedule draws its tiles from one counter per stream that each launch
/// leaves at zero for the next (kernels/sm90/fwd.cuh `next_tile`): many causal launches of
/// different tile counts back to back, each against the CPU reference with poisoned outputs (a
/// counter left off zero skips tiles, which stay NaN). Other GPUs and families run the same
/// problems, where the test checks only the results.
#[test]
fn dynamic_schedule_counter_across_launches() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    arch_under_test();
    let mut n = 0;
    for round in 0..3 {
        // (b, sq, hq, hkv, d): 1 to 32 query tiles per head, tile counts below and above the SMs
        for (b, sq, hq, hkv, d) in [
            (1, 100, 2, 1, 64),
            (2, 1000, 8, 2, 128),
            (1, 4096, 4, 4, 128),
            (3, 513, 16, 4, 64),
            (1, 200, 1, 1, 128),
            (2, 700, 12, 3, 256),
        ] {
            let c = Case {
                b,
                sq,
                sk: sq + 17 * round,
                hq,
                hkv,
                d,
                dtype: if n % 2 == 0 { DType::BF16 } else { DType::F16 },
                mask: Mask::Causal,
                strided: false,
            };
            let (e, ne, kernel) = check(&dev, &c)?;
            println!("[OK] {c}: err {e:.2e} (naive {ne:.2e}) {kernel}");
            n += 1;
        }
    }
    println!("dynamic_schedule_counter_across_launches: {n} launches passed");
    Ok(())
}

/// The sm90 narrow twins (d32 on the d64 tiles, d96 on d128, d160 and d192 on d256) on every
/// tile they have, causal and not, at the twin's width, below it and just above it (the next
/// twin or the full kernel then): the 2x naive-error rule, and on sm90 the kernel chosen.
#[test]
fn narrow_twins_on_every_tile() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    arch_under_test();
    let Device::Cuda(cuda) = &dev else {
        unreachable!()
    };
    let sms = flashcore::cuda::device_info(cuda)?.sm_count;
    // (width, mask, b, sq, sk, hq, hkv, tile): the tiles of d64, d128 and d256 by problem size
    // (the 256-row d64 tile needs a query tile per SM: 4 x 40 = 160 >= 132 on the H100; the
    // 192-row d64 ones here have 12 x 40 = 480 query tiles of 128 rows, the 128-row one 16;
    // the d128 128x160 case has 12 x 12 = 144, too many for the key-split clusters)
    let tiles = [
        (32, Mask::None, 1, 1000, 600, 40, 8, "_256x64_s4"),
        (32, Mask::None, 1, 1500, 1500, 40, 8, "_192x128"),
        (32, Mask::None, 1, 500, 700, 4, 2, "_128x128"),
        (32, Mask::Causal, 2, 500, 700, 4, 1, "_128x128"),
        (32, Mask::Causal, 1, 1500, 1500, 40, 40, "_192x128"),
        (96, Mask::None, 2, 500, 300, 4, 2, "_128x128"),
        (96, Mask::None, 1, 1500, 1400, 12, 1, "_128x160"),
        (96, Mask::Causal, 1, 700, 900, 4, 4, "_128x128"),
        (160, Mask::None, 2, 500, 600, 2, 1, "_128x64"),
        (160, Mask::None, 1, 2200, 2100, 2, 2, "_128x80"),
        (160, Mask::Causal, 1, 1500, 1600, 4, 1, "_128x64"),
        (160, Mask::Causal, 1, 2200, 2300, 2, 1, "_128x80"),
        (192, Mask::None, 1, 300, 500, 4, 2, "_128x64"),
        (192, Mask::None, 1, 2100, 2200, 2, 1, "_128x80"),
        (192, Mask::Causal, 2, 600, 600, 2, 2, "_128x64"),
        (192, Mask::Causal, 1, 2300, 2200, 2, 1, "_128x80"),
    ];
    let mut n = 0;
    for (w, mask, b, sq, sk, hq, hkv, tile) in tiles {
        for d in [w - 8, w, w + 8] {
            let c = Case {
                b,
                sq,
                sk,
                hq,
                hkv,
                d,
                dtype: if n % 2 == 0 { DType::BF16 } else { DType::F16 },
                mask,
                strided: n % 3 == 1,
            };
            let (e, ne, kernel) = check(&dev, &c)?;
            if kernel.contains("_sm90_") && (tile != "_256x64_s4" || sms <= 160) {
                let twin = format!("_n{w}");
                if d <= w {
                    assert!(
                        kernel.ends_with(&format!("{tile}{twin}")),
                        "{c}: ran {kernel}, want the {tile} tile's {twin} twin"
                    );
                } else if w == 160 {
                    assert!(
                        kernel.ends_with(&format!("{tile}_n192")),
                        "{c}: ran {kernel}"
                    );
                } else {
                    // the full kernel, or on small grids its key-split twin
                    let sym = kernel.split(' ').next().unwrap_or_default();
                    assert!(
                        sym.trim_end_matches("_kvs")
                            .trim_end_matches("_q2")
                            .ends_with(tile),
                        "{c}: ran {kernel}, want {tile}"
                    );
                }
            }
            println!("[OK] {c}: err {e:.2e} (naive {ne:.2e}) {kernel}");
            n += 1;
        }
    }
    Ok(())
}

/// Softmax scales other than 1/sqrt(d) (small, large; zero and negative ones have no GPU kernel
/// and must say so) and scores that grow as the kernels walk the keys (last key tile first): the
/// running-max bookkeeping of every family, including the sm90 lazy rescale (a row's reference
/// max moves only when the max grows by more than 2^8 in exp2 units; scale 1 and the ramp make
/// that happen tile after tile).
#[test]
fn softmax_scales_and_growing_scores() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    arch_under_test();
    let (mut n, mut combo) = (0, 0);
    for d in [64, 128, 256] {
        for mask in [Mask::None, Mask::Causal] {
            combo += 1; // bf16 / f16 and packed / strided alternate
            let dtype = if combo % 2 == 0 {
                DType::BF16
            } else {
                DType::F16
            };
            let (sq, sk) = if mask == Mask::None {
                (300, 700)
            } else {
                (700, 700)
            };
            let (q, k, v) = qkv(1, sq, sk, 4, 2, d, dtype, combo % 3 != 0, &dev)?;
            // key j scaled by 1 + 3 (sk - 1 - j) / sk: scores grow toward key 0
            let ramp: Vec<f32> = (0..sk)
                .map(|j| 1.0 + 3.0 * (sk - 1 - j) as f32 / sk as f32)
                .collect();
            let ramp = Tensor::from_vec(ramp, (1, sk, 1, 1), &dev)?.to_dtype(dtype)?;
            let k_ramp = k.broadcast_mul(&ramp)?;
            let base = 1.0 / (d as f32).sqrt();
            for (scale, ramped) in [
                (0.0, false),
                (-0.3 * base, false),
                (0.02 * base, false),
                (1.0, false),
                (base, true),
                (2.0 * base, true),
            ] {
                let keys = if ramped { &k_ramp } else { &k };
                let what = format!(
                    "{dtype:?} sq{sq} sk{sk} h4/2 d{d} {} scale {scale:.4} ramp={ramped}",
                    mask_name(mask)
                );
                let p = AttnParams {
                    mask,
                    softmax_scale: Some(scale),
                    ..Default::default()
                };
                if scale <= 0.0 {
                    // no GPU kernel: a clear error, and the CPU path computes it
                    let e = flashcore::attention(&q, keys, &v, &p)
                        .unwrap_err()
                        .to_string();
                    assert!(
                        e.contains("no CUDA kernel for softmax_scale"),
                        "{what}: {e}"
                    );
                    let cpu = |t: &Tensor| t.to_device(&Device::Cpu);
                    let (e, ne) = check_params(&what, &cpu(&q)?, &cpu(keys)?, &cpu(&v)?, &p)?;
                    println!("[OK] {what}: GPU refuses; CPU err {e:.2e} (naive {ne:.2e})");
                } else {
                    let (e, ne) = check_params(&what, &q, keys, &v, &p)?;
                    println!("[OK] {what}: err {e:.2e} (naive {ne:.2e})");
                }
                n += 1;
            }
        }
    }
    println!("softmax_scales_and_growing_scores: {n} cases passed");
    Ok(())
}

/// Scores that jump far above every earlier key tile late in the walk (keys 0..8, the last tile
/// the kernels visit): q gets +2 on every element and the first 8 keys +`bump`. With bump 10 the
/// jump is ~230 in exp2 units, past f32's range, so the sm90 kernel's stale-max exponentials
/// (non-causal tiles) overflow to inf and those scores must be recomputed from the Q and K tiles
/// in shared memory; with bump 1 (~23) they only grow past the rescale threshold and are rebuilt
/// from their logarithms. Causal cases check the exact path on the same data. The last shape has
/// more query tiles than the H100 has SMs: persistent CTAs run several tiles, so the next tile's
/// Q and K loads would race a late reader of those buffers.
/// q + 2 and the first 8 keys + `bump` (the last key tile the kernels visit): those scores jump
/// by ~2 * bump * d * scale above every earlier tile. Returns contiguous q and k in their dtype.
fn jumping(q: &Tensor, k: &Tensor, bump: f32) -> Result<(Tensor, Tensor)> {
    let (dtype, sk) = (k.dtype(), k.dim(1)?);
    let q = (q.to_dtype(DType::F32)? + 2.0)?.to_dtype(dtype)?;
    let bumps: Vec<f32> = (0..sk).map(|j| if j < 8 { bump } else { 0.0 }).collect();
    let bumps = Tensor::from_vec(bumps, (1, sk, 1, 1), k.device())?;
    let k = k
        .to_dtype(DType::F32)?
        .broadcast_add(&bumps)?
        .to_dtype(dtype)?;
    Ok((q, k))
}

#[test]
fn scores_jumping_late() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    arch_under_test();
    let mut n = 0;
    for d in [64, 128, 256] {
        for mask in [Mask::None, Mask::Causal] {
            let small = if mask == Mask::None {
                (1, 300, 700, 4, 2)
            } else {
                (1, 700, 700, 4, 2)
            };
            for (bump, dtype, (b, sq, sk, hq, hkv)) in [
                (10.0, DType::BF16, small),
                (1.0, DType::F16, small),
                (10.0, DType::BF16, (2, 1100, 1000, 16, 4)),
            ] {
                let strided = n % 2 == 1;
                let (q, k, v) = qkv(b, sq, sk, hq, hkv, d, dtype, strided, &dev)?;
                let (q, k) = jumping(&q, &k, bump)?;
                // the bumps above made q and k contiguous: every other case as strided views again
                // (the kernels' tensor maps carry the strides)
                let (q, k) = if strided {
                    let pad = Tensor::zeros((b, sq, 3, d), dtype, &dev)?;
                    let q = Tensor::cat(&[&q, &pad], 2)?.narrow(2, 0, hq)?;
                    (q, k.transpose(1, 2)?.contiguous()?.transpose(1, 2)?)
                } else {
                    (q, k)
                };
                let what = format!(
                    "{dtype:?} b{b} sq{sq} sk{sk} h{hq}/{hkv} d{d} {} bump {bump}{}",
                    mask_name(mask),
                    if strided { " strided" } else { "" }
                );
                let (e, ne) = check_inputs(&what, &q, &k, &v, mask)?;
                println!("[OK] {what}: err {e:.2e} (naive {ne:.2e})");
                n += 1;
            }
        }
    }
    println!("scores_jumping_late: {n} cases passed");
    Ok(())
}

#[test]
fn unsupported_options_error_clearly() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    arch_under_test();
    let (q, k, v) = qkv(1, 8, 8, 2, 2, 64, DType::F32, false, &dev)?;
    let e = flashcore::attention(&q, &k, &v, &AttnParams::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("no CUDA kernel for dtype F32"), "{e}");
    // A scale <= 0 has no GPU kernel (masking with -inf raw scores needs a positive scale);
    // ALiBi, softcap and every head dim that is a multiple of 8 do (tests/gpu_varlen.rs).
    let (q, k, v) = qkv(1, 8, 8, 2, 2, 64, DType::BF16, false, &dev)?;
    let p = AttnParams {
        softmax_scale: Some(-0.5),
        ..Default::default()
    };
    let e = flashcore::attention(&q, &k, &v, &p)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("no CUDA kernel for softmax_scale -0.5") && e.contains("sq=8"),
        "{e}"
    );
    // Head dims past 256 run on the CPU only: refused before anything runs, naming q.
    let (q, k, v) = qkv(1, 8, 8, 2, 2, 264, DType::BF16, false, &dev)?;
    let e = flashcore::attention(&q, &k, &v, &AttnParams::default())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("q: head_dim must be at most 256 on a GPU") && e.contains("got 264"),
        "{e}"
    );
    Ok(())
}

/// Softcap (Gemma 2: `c * tanh(s / c)`) on the sm80 forward, warp-pair and split-KV decode
/// kernels and the sm90 d256 kernels (Hopper runs d64/d128 softcap on the sm80 family), every head
/// dim, mask, dtype, GQA, strided views, prefill and decode widths, sq != sk; `boost` scales q so
/// that most scores saturate the tanh. Then scores that jump in the last key tile the kernels
/// visit (as `scores_jumping_late`): with softcap 120 the growth passes 2^128 in exp2 units (the
/// sm90 fast softmax's P = inf recompute, capped), with 30 it does not. Checked against the f64
/// reference under the tolerance rule, LSE included.
#[test]
fn softcap_on_the_gpu() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    arch_under_test();
    let Device::Cuda(cuda) = &dev else {
        unreachable!()
    };
    let shapes = [
        (1, 1),
        (3, 700),
        (113, 113),
        (1023, 1023),
        (7, 113),
        (300, 64),
        (2113, 300),
    ];
    let mut n = 0;
    for dtype in [DType::BF16, DType::F16] {
        for d in [64, 128, 256] {
            for mask in [
                Mask::None,
                Mask::Causal,
                Mask::Window {
                    left: Some(50),
                    right: Some(0),
                },
            ] {
                for &(sq, sk) in &shapes {
                    let (hq, hkv) = [(8, 8), (8, 2), (4, 1)][n % 3];
                    let strided = n % 2 == 1;
                    let (cap, boost) = [(50.0, 1.0), (5.0, 4.0), (20.0, 16.0)][n % 3];
                    let (q, k, v) = qkv(2, sq, sk, hq, hkv, d, dtype, strided, &dev)?;
                    let q = (q.to_dtype(DType::F32)? * boost)?.to_dtype(dtype)?;
                    let p = AttnParams {
                        mask,
                        softcap: Some(cap),
                        ..Default::default()
                    };
                    let kernel = flashcore::cuda::describe(cuda, &p, &q, &k, &v)?;
                    // sm90: only d256 has softcap twins; sm80: not the 128x48 tile (no softcap body)
                    let fits = if kernel.contains("_sm90_") {
                        d == 256 && kernel.ends_with("_cap")
                    } else {
                        kernel.contains("_sm80_") && !kernel.ends_with("_128x48")
                    };
                    assert!(fits, "softcap ran {kernel}");
                    let what = format!(
                        "{dtype:?} b2 sq{sq} sk{sk} h{hq}/{hkv} d{d} {} softcap {cap} q x{boost} strided={strided}",
                        mask_name(mask)
                    );
                    let (e, ne) = check_params(&what, &q, &k, &v, &p)?;
                    println!("[OK] {what}: err {e:.2e} (naive {ne:.2e}) {kernel}");
                    n += 1;
                }
            }
        }
    }
    for d in [64, 128, 256] {
        for mask in [Mask::None, Mask::Causal] {
            for cap in [120.0, 30.0] {
                let (b, sq, sk, hq, hkv) = (1, 700, 700, 4, 2);
                let (q, k, v) = qkv(b, sq, sk, hq, hkv, d, DType::BF16, false, &dev)?;
                let (q, k) = jumping(&q, &k, 10.0)?;
                let p = AttnParams {
                    mask,
                    softcap: Some(cap),
                    ..Default::default()
                };
                let kernel = flashcore::cuda::describe(cuda, &p, &q, &k, &v)?;
                let what = format!(
                    "BF16 b{b} sq{sq} sk{sk} h{hq}/{hkv} d{d} {} softcap {cap} jumping",
                    mask_name(mask)
                );
                let (e, ne) = check_params(&what, &q, &k, &v, &p)?;
                println!("[OK] {what}: err {e:.2e} (naive {ne:.2e}) {kernel}");
                n += 1;
            }
        }
    }
    println!("softcap_on_the_gpu: {n} cases passed");
    Ok(())
}

/// A KV cache preallocated for `max_len` positions, narrowed to the first `sk` (no copy).
fn cache_views(
    dev: &Device,
    b: usize,
    sk: usize,
    max_len: usize,
    hkv: usize,
    d: usize,
    dtype: DType,
) -> Result<(Tensor, Tensor)> {
    let k = Tensor::randn(0f32, 1., (b, max_len, hkv, d), dev)?.to_dtype(dtype)?;
    let v = Tensor::randn(0f32, 1., (b, max_len, hkv, d), dev)?.to_dtype(dtype)?;
    Ok((k.narrow(1, 0, sk)?, v.narrow(1, 0, sk)?))
}

#[allow(clippy::too_many_arguments)]
fn check_decode(
    dev: &Device,
    b: usize,
    sq: usize,
    sk: usize,
    hq: usize,
    hkv: usize,
    d: usize,
    dtype: DType,
    mask: Mask,
) -> Result<()> {
    let q = Tensor::randn(0f32, 1., (b, sq, hq, d), dev)?.to_dtype(dtype)?;
    let (k, v) = cache_views(dev, b, sk, sk + 37, hkv, d, dtype)?;
    let what = format!(
        "decode {dtype:?} b{b} sq{sq} sk{sk} h{hq}/{hkv} d{d} {}",
        mask_name(mask)
    );
    check_inputs(&what, &q, &k, &v, mask).map(|(e, ne)| {
        if std::env::var_os("FLASHCORE_TEST_VERBOSE").is_some() {
            println!("[OK] {what}: err {e:.2e} (naive {ne:.2e})");
        }
    })
}

#[test]
fn decode_sweep() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    arch_under_test();
    let mut n = 0;
    for dtype in [DType::BF16, DType::F16] {
        for sq in [1, 2, 4, 16] {
            for sk in [1, 17, 4096, 65537] {
                for (hq, hkv) in [(32, 8), (32, 32), (8, 1)] {
                    let mask = if (sq + sk + hkv) % 2 == 0 {
                        Mask::Causal
                    } else {
                        Mask::None
                    };
                    // batch 2 on every other case, except at 65537 keys (the f64 CPU
                    // reference dominates the test's time there).
                    let b = if sk > 8192 { 1 } else { 1 + (n % 2) };
                    check_decode(&dev, b, sq, sk, hq, hkv, 128, dtype, mask)?;
                    n += 1;
                }
            }
        }
    }
    for d in [64, 256] {
        check_decode(&dev, 2, 4, 5000, 32, 8, d, DType::BF16, Mask::Causal)?;
        check_decode(&dev, 1, 1, 3000, 8, 1, d, DType::F16, Mask::None)?;
    }
    println!("decode_sweep: {} cases passed", n + 4);
    Ok(())
}

/// Whether a test asserts the sm90 dispatcher's route on `dev`: an sm_90 GPU whose SM count
/// `sms` admits, without `FLASHCORE_TEST_ARCH` (which forces another family).
fn sm90_route_asserted(dev: &Device, sms: impl Fn(usize) -> bool) -> Result<bool> {
    let Device::Cuda(cuda) = dev else {
        return Ok(false);
    };
    let info = flashcore::cuda::device_info(cuda)?;
    Ok(info.major == 9 && std::env::var_os("FLASHCORE_TEST_ARCH").is_none() && sms(info.sm_count))
}

/// On sm_90 a few more query rows than the decode's 16 run its split-KV kernels over long keys
/// when the prefill grid would leave SMs idle and the packed rows make at most 16 blocks of 64
/// from 4k keys (`decode_beats_starved_prefill` in src/plan/choose.rs): each case against the
/// reference, and on sm90 the route asserted, on both sides of each bound.
#[test]
fn decode_takes_a_few_more_rows_on_sm90() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    arch_under_test();
    // the route is asserted on the sm90 dispatch of a GPU with 32..=132 SMs (H100 SXM, H200)
    let sm90 = sm90_route_asserted(&dev, |sms| (32..=132).contains(&sms))?;
    // (b, sq, sk, hq, hkv, d, mask, decode on sm90)
    let cases = [
        (1, 17, 4096, 32, 8, 128, Mask::Causal, true), // 8 x 2 blocks
        (1, 32, 5000, 8, 8, 128, Mask::None, true),    // 8 x 1
        (1, 64, 16384, 32, 8, 64, Mask::Causal, false), // 8 x 4 = 32 blocks: the key split
        (1, 64, 8192, 32, 8, 128, Mask::None, false),  // 32 blocks, too few keys
        (1, 24, 4100, 32, 8, 128, Mask::None, true),
        (1, 17, 4095, 32, 8, 128, Mask::Causal, false), // too few keys
        (2, 64, 4096, 32, 8, 128, Mask::Causal, false), // 64 blocks
        (1, 17, 4096, 32, 8, 256, Mask::Causal, false), // d256
        (1, 100, 4096, 8, 1, 128, Mask::None, true),    // 800 packed rows: 13 blocks
    ];
    for (n, (b, sq, sk, hq, hkv, d, mask, decode)) in cases.into_iter().enumerate() {
        let c = Case {
            b,
            sq,
            sk,
            hq,
            hkv,
            d,
            dtype: if n % 2 == 0 { DType::BF16 } else { DType::F16 },
            mask,
            strided: n % 3 == 1,
        };
        let (e, ne, kernel) = check(&dev, &c)?;
        if sm90 {
            assert_eq!(kernel.contains("decode"), decode, "{c}: ran {kernel}");
        }
        println!("[OK] {c}: err {e:.2e} (naive {ne:.2e}) {kernel}");
    }
    Ok(())
}

/// sm90 grids of few 128-row query tiles split each tile's keys over a cluster of 2 or 4 CTAs
/// whose rank 0 gathers the others' partials through distributed shared memory (the key-split
/// twins, `kv_splits` in src/plan/choose.rs): awkward lengths (1 to 9000 keys, seq_q above seq_k
/// causal so that some ranks walk no key of their own and some rows see no key at all), GQA
/// 1 / 4 / 8, strided views, both dtypes; each against the reference with poisoned outputs, and
/// on a 132-SM sm90 GPU (H100 SXM, H200) the route and cluster size asserted.
#[test]
fn key_split_clusters_on_sm90() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    arch_under_test();
    let sm90 = sm90_route_asserted(&dev, |sms| sms == 132)?
        && std::env::var_os("FLASHCORE_SM90_KV_SPLITS").is_none();
    // (b, sq, sk, hq, hkv, d, mask, clusters on a 132-SM sm90; 0 = no key split): clusters of 2
    // where 2 x ceil(sq / 128) x hq x b <= 132 and sk >= 16 x the kernel's head dim, each bound
    // from both sides
    let cases = [
        (1, 200, 1023, 4, 1, 64, Mask::None, 0), // too few keys for d64
        (1, 200, 1025, 4, 1, 64, Mask::None, 2), // 9 key tiles: chunks of 5 and 4
        (1, 200, 2047, 4, 1, 128, Mask::None, 0), // too few keys for d128
        (1, 200, 2048, 4, 1, 128, Mask::None, 2), // 16 key tiles
        (1, 1000, 4096, 8, 8, 128, Mask::None, 2), // 64 tiles
        (1, 1100, 4096, 8, 8, 128, Mask::None, 0), // 72 tiles: clusters would not fit
        (1, 113, 4000, 8, 2, 128, Mask::Causal, 2), // GQA 4
        (1, 1023, 3000, 8, 1, 64, Mask::Causal, 2), // GQA 8, 64 tiles
        (1, 2500, 2100, 2, 2, 64, Mask::Causal, 2), // rows < 400 see no key; one-key-tile tiles
        (1, 64, 9000, 32, 32, 128, Mask::None, 2), // 71 key tiles
        (1, 4224, 4224, 1, 1, 128, Mask::Causal, 2), // 33 tiles
        (3, 100, 2048, 8, 8, 64, Mask::None, 2), // 24 tiles
        (1, 512, 5000, 12, 4, 64, Mask::Causal, 2), // 48 tiles
        (1, 129, 1, 16, 4, 64, Mask::None, 0),   // one key
        (1, 2048, 2048, 16, 16, 128, Mask::Causal, 0), // 256 tiles: a full grid
    ];
    for (n, (b, sq, sk, hq, hkv, d, mask, clusters)) in cases.into_iter().enumerate() {
        let c = Case {
            b,
            sq,
            sk,
            hq,
            hkv,
            d,
            dtype: if n % 2 == 0 { DType::BF16 } else { DType::F16 },
            mask,
            strided: n % 3 == 1,
        };
        let (e, ne, kernel) = check(&dev, &c)?;
        if sm90 {
            let want = format!("_kvs (keys split over clusters of {clusters})");
            if clusters > 0 {
                assert!(kernel.ends_with(&want), "{c}: ran {kernel}, want {want}");
            } else {
                assert!(
                    !kernel.contains("_kvs"),
                    "{c}: ran {kernel}, want no key split"
                );
            }
        }
        println!("[OK] {c}: err {e:.2e} (naive {ne:.2e}) {kernel}");
    }
    Ok(())
}

#[test]
fn decode_random() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    arch_under_test();
    let count = random_cases();
    let mut rng = Rng::from_clock("decode_random");
    let mut next = |n: usize| rng.below(n);
    for _ in 0..count {
        let hkv = [1, 2, 8][next(3)];
        let hq = hkv * [1, 4, 8][next(3)];
        let mask = [
            Mask::None,
            Mask::Causal,
            Mask::Window {
                left: Some(next(2000)),
                right: Some(next(4)),
            },
        ][next(3)];
        let sk = if next(4) == 0 {
            1 + next(40)
        } else {
            1 + next(9000)
        };
        check_decode(
            &dev,
            1 + next(4),
            1 + next(16),
            sk,
            hq,
            hkv,
            [64, 128, 256][next(3)],
            [DType::BF16, DType::F16][next(2)],
            mask,
        )?;
    }
    println!("decode_random: {count} cases passed");
    Ok(())
}

/// The decode's CTA-per-SM cap (`flashcore::cuda::decode_capped_smem`) on the figures the
/// driver reports for the H100 SXM, the H200 and the A100 (no GPU needed): what was measured to
/// help is capped (docs/decisions.md#decode-occupancy-cap), the rest launches as before, and a
/// cap's shared
/// memory lets exactly that many CTAs share an SM.
#[test]
fn decode_cap_rule_without_a_gpu() {
    if std::env::var("FLASHCORE_DECODE_OCCUPANCY").as_deref() == Ok("full") {
        println!("decode_cap_rule_without_a_gpu: skipped (FLASHCORE_DECODE_OCCUPANCY=full)");
        return;
    }
    use flashcore::cuda::variants::{KDType, KKind, KMask, VARIANTS};
    use flashcore::cuda::{decode_capped_smem, DeviceInfo};
    let hopper = |dram_bytes_per_s| DeviceInfo {
        major: 9,
        minor: 0,
        sm_count: 132,
        smem_per_block: 232448,
        smem_per_sm: 233472,
        smem_reserved_per_block: 1024,
        dram_bytes_per_s,
    };
    let (h100, h200) = (
        hopper(2.619e9 * 2.0 * 5120.0 / 8.0),
        hopper(3.201e9 * 2.0 * 6144.0 / 8.0),
    );
    let a100 = DeviceInfo {
        major: 8,
        minor: 0,
        sm_count: 108,
        smem_per_block: 166912,
        smem_per_sm: 167936,
        smem_reserved_per_block: 1024,
        dram_bytes_per_s: 1.215e9 * 2.0 * 5120.0 / 8.0,
    };
    let decode = |d: u32| {
        VARIANTS
            .iter()
            .find(|v| {
                v.kind == KKind::Decode
                    && v.dtype == KDType::Bf16
                    && v.head_dim == d
                    && v.mask == KMask::None
            })
            .expect("a bf16 decode kernel")
    };
    // (device, head dim, CTAs, page rows, keys, CTAs per SM wanted: None = not capped)
    let cases = [
        (&h100, 128, 512, None, 32768, Some(1)),
        (&h100, 128, 384, None, 777, Some(1)),
        (&h100, 128, 512, None, 4096, None),
        (&h100, 128, 512, None, 8192, Some(1)),
        (&h100, 64, 512, None, 16384, Some(2)),
        (&h100, 64, 512, Some(64), 16384, Some(2)),
        (&h100, 128, 512, Some(64), 32768, None),
        (&h100, 128, 512, Some(256), 32768, Some(1)),
        (&h100, 128, 512, Some(256), 4096, None),
        (&h100, 128, 384, Some(256), 4096, Some(1)),
        (&h100, 128, 192, None, 32768, None),
        (&h100, 128, 320, None, 32768, None),
        (&h100, 128, 128, None, 32768, None),
        (&h100, 256, 512, None, 16384, None),
        (&h200, 128, 512, None, 32768, None),
        (&h200, 64, 512, None, 16384, None),
        (&a100, 128, 512, None, 32768, None),
    ];
    for (info, d, ctas, page, sk, want) in cases {
        let v = decode(d);
        let got = decode_capped_smem(v, info, ctas, page, sk).map(|smem| {
            assert!(smem >= v.smem_bytes() && smem <= info.smem_per_block);
            info.smem_per_sm / (smem + info.smem_reserved_per_block)
        });
        assert_eq!(
            got,
            want,
            "d{d}, {ctas} CTAs, pages {page:?}, {sk} keys, {} GB/s",
            info.dram_bytes_per_s / 1e9
        );
    }
}

/// Sinks (`AttnParams::sinks`) on the prefill kernels of both families: GQA (gpt-oss's 64/8 at
/// d64), causal, no mask and windows (gpt-oss's 128-key window), rows that see no key (seq_q >
/// seq_k under causal), sm90's key-split clusters (the sink joins after the ranks' merge), d256
/// (sm80's warp pairs), narrow and general-body head dims (40, 96), softcap and ALiBi rotating;
/// against the float64 reference with the sink in its max and sum, outputs poisoned first.
#[test]
fn sinks_on_the_gpu() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    arch_under_test();
    let win = |l, r| Mask::Window {
        left: Some(l),
        right: Some(r),
    };
    // on a 132-SM sm90 (H100 SXM, H200) the key-split cases are asserted to run the key-split
    // twins (the sink then joins after the ranks' merge)
    let sm90 = sm90_route_asserted(&dev, |sms| sms == 132)?
        && std::env::var_os("FLASHCORE_SM90_KV_SPLITS").is_none();
    // (b, sq, sk, hq, hkv, d, mask, a key split on a 132-SM sm90)
    let cases = [
        (2, 113, 113, 8, 2, 64, Mask::Causal, false),
        (1, 1023, 1023, 64, 8, 64, win(127, 0), false),
        (1, 1000, 1000, 64, 8, 64, Mask::Causal, false),
        (2, 300, 100, 8, 8, 128, Mask::Causal, false),
        (1, 257, 2113, 4, 1, 256, Mask::None, false),
        (1, 200, 1025, 4, 1, 64, Mask::None, true),
        (1, 113, 4000, 8, 2, 128, Mask::Causal, true),
        (1, 2500, 2100, 2, 2, 64, Mask::Causal, true),
        (1, 129, 1, 16, 4, 64, Mask::None, false),
        (1, 500, 700, 8, 4, 96, win(100, 20), false),
        (1, 333, 333, 8, 8, 40, Mask::Causal, false),
        (2, 700, 700, 16, 2, 256, win(127, 0), false),
    ];
    for (n, (b, sq, sk, hq, hkv, d, mask, kvs)) in cases.into_iter().enumerate() {
        let dtype = if n % 2 == 0 { DType::BF16 } else { DType::F16 };
        let (q, k, v) = qkv(b, sq, sk, hq, hkv, d, dtype, n % 3 == 1, &dev)?;
        let p = AttnParams {
            mask,
            // (no modifiers on the key-split cases: softcap and ALiBi at d <= 128 run sm80)
            softcap: (n % 3 == 1 && !kvs).then_some(30.0),
            alibi_slopes: (n % 3 == 2 && !kvs)
                .then(|| Tensor::rand(0f32, 0.5, hq, &dev))
                .transpose()?,
            sinks: Some(test_sinks(hq, &dev)?),
            ..Default::default()
        };
        let what = format!(
            "sinks {dtype:?} b{b} sq{sq} sk{sk} h{hq}/{hkv} d{d} {}",
            opts_name(&p)
        );
        let kernel = match &dev {
            Device::Cuda(c) => flashcore::cuda::describe(c, &p, &q, &k, &v)?,
            _ => "cpu".into(),
        };
        if sm90 && kvs {
            assert!(
                kernel.contains("_kvs"),
                "{what}: ran {kernel}, want a key split"
            );
        }
        let (e, ne) = check_params(&what, &q, &k, &v, &p)?;
        println!("[OK] {what}: err {e:.2e} (naive {ne:.2e}) {kernel}");
    }
    Ok(())
}

/// Sinks on the split-KV decode: many splits (the sink joins in the combine, once), one split
/// (in the split kernel's epilogue), windows (gpt-oss's 128 keys), GQA 8, head dims 64/128/256,
/// sm90's decode for a few more rows; against the float64 reference, outputs poisoned first.
#[test]
fn sinks_decode_on_the_gpu() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    arch_under_test();
    let win = Mask::Window {
        left: Some(127),
        right: Some(0),
    };
    // (b, sq, sk, hq, hkv, d, mask)
    let cases = [
        (1, 1, 16384, 64, 8, 64, Mask::None),
        (1, 1, 8192, 64, 8, 64, win),
        (64, 1, 1024, 64, 8, 64, Mask::Causal),
        (2, 4, 5000, 32, 8, 128, Mask::Causal),
        (1, 16, 4096, 8, 1, 256, Mask::None),
        (1, 17, 4096, 32, 8, 128, Mask::Causal),
        (3, 1, 300, 8, 1, 64, Mask::None),
        (1, 8, 3, 8, 2, 64, Mask::Causal),
    ];
    for (n, (b, sq, sk, hq, hkv, d, mask)) in cases.into_iter().enumerate() {
        let dtype = if n % 2 == 0 { DType::BF16 } else { DType::F16 };
        let q = Tensor::randn(0f32, 1., (b, sq, hq, d), &dev)?.to_dtype(dtype)?;
        let (k, v) = cache_views(&dev, b, sk, sk + 37, hkv, d, dtype)?;
        let p = AttnParams {
            mask,
            softcap: (n % 3 == 2).then_some(30.0),
            sinks: Some(test_sinks(hq, &dev)?),
            ..Default::default()
        };
        let what = format!(
            "sinks decode {dtype:?} b{b} sq{sq} sk{sk} h{hq}/{hkv} d{d} {}",
            opts_name(&p)
        );
        let kernel = match &dev {
            Device::Cuda(c) => flashcore::cuda::describe(c, &p, &q, &k, &v)?,
            _ => "cpu".into(),
        };
        let (e, ne) = check_params(&what, &q, &k, &v, &p)?;
        println!("[OK] {what}: err {e:.2e} (naive {ne:.2e}) {kernel}");
    }
    Ok(())
}

/// Non-finite sinks on the GPU, prefill and decode (many splits and one): a `-inf` sink is no
/// sink bit for bit (O and LSE), `+inf` gives O zeros and LSE +inf, NaN gives NaN rows where a
/// row sees a key and zeros with LSE NaN where it sees none; a finite sink on the same call
/// matches the rescaling identity `o / (1 + e^(sink - lse))`, `ln(e^lse + e^sink)`.
#[test]
fn sinks_non_finite_on_the_gpu() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    arch_under_test();
    let (hq, hkv, d) = (4, 2, 64);
    let sinks = [f32::NEG_INFINITY, f32::INFINITY, f32::NAN, 3.0];
    // (b, sq, sk, mask, rows that see no key: the first `none` of each sequence)
    let cases = [
        (1, 300, 200, Mask::Causal, 100),
        (1, 1, 16384, Mask::None, 0),
        (2, 1, 300, Mask::None, 0),
        (1, 4, 2, Mask::Causal, 2),
        (2, 200, 200, Mask::Causal, 0),
    ];
    for (n, (b, sq, sk, mask, none)) in cases.into_iter().enumerate() {
        let dtype = if n % 2 == 0 { DType::BF16 } else { DType::F16 };
        let (q, k, v) = qkv(b, sq, sk, hq, hkv, d, dtype, false, &dev)?;
        let plain = AttnParams {
            mask,
            ..Default::default()
        };
        let with = AttnParams {
            sinks: Some(Tensor::new(&sinks, &dev)?),
            ..plain.clone()
        };
        let what = format!(
            "non-finite sinks {dtype:?} b{b} sq{sq} sk{sk} {}",
            mask_name(mask)
        );
        let cpu = |t: Tensor| -> Result<Vec<f32>> {
            t.to_dtype(DType::F32)?
                .flatten_all()?
                .to_device(&Device::Cpu)?
                .to_vec1()
        };
        let (o, lse) = attention_with_lse(&q, &k, &v, &plain)?;
        let (o_s, lse_s) = attention_with_lse(&q, &k, &v, &with)?;
        let (o, lse, o_s, lse_s) = (cpu(o)?, cpu(lse)?, cpu(o_s)?, cpu(lse_s)?);
        let tol = rounding_floor(dtype, 1.0) as f32;
        for bi in 0..b {
            for i in 0..sq {
                let sees = i >= none;
                for (h, &sink) in sinks.iter().enumerate() {
                    let li = (bi * hq + h) * sq + i;
                    let o0 = ((bi * sq + i) * hq + h) * d;
                    let (row, row_s) = (&o[o0..o0 + d], &o_s[o0..o0 + d]);
                    let (l, ls) = (lse[li], lse_s[li]);
                    let at = format!("{what}: batch {bi} row {i} head {h} (sink {sink})");
                    match h {
                        0 => {
                            assert_eq!(l.to_bits(), ls.to_bits(), "{at}: LSE");
                            for (a, c) in row.iter().zip(row_s) {
                                assert_eq!(a.to_bits(), c.to_bits(), "{at}: O");
                            }
                        }
                        1 => {
                            assert_eq!(ls, f32::INFINITY, "{at}: LSE");
                            assert!(row_s.iter().all(|&x| x == 0.0), "{at}: O {row_s:?}");
                        }
                        2 => {
                            assert!(ls.is_nan(), "{at}: LSE {ls}");
                            if sees {
                                assert!(row_s.iter().all(|x| x.is_nan()), "{at}: O {row_s:?}");
                            } else {
                                assert!(row_s.iter().all(|&x| x == 0.0), "{at}: O {row_s:?}");
                            }
                        }
                        _ => {
                            let m = l.max(sink);
                            let want = m + ((l - m).exp() + (sink - m).exp()).ln();
                            assert!(
                                (ls - want).abs() <= 1e-4 * (1.0 + want.abs()),
                                "{at}: LSE {ls}, want {want}"
                            );
                            let f = 1.0 / (1.0 + (sink - l).exp());
                            for (a, c) in row.iter().zip(row_s) {
                                assert!(
                                    (a * f - c).abs() <= 2.0 * tol * (1.0 + a.abs()),
                                    "{at}: O {c}, want {a} * {f}"
                                );
                            }
                        }
                    }
                }
            }
        }
        println!("[OK] {what}");
    }
    Ok(())
}

/// Windows with a right bound on sm_90 run the sm90 window kernels (`sm90_window`, kernels/sm90
/// fwd.cuh `WINDOW`) up to 32 query tiles of 128 rows (their dynamic schedule): left bounds
/// cutting tiles, right bounds past the diagonal, no left bound, seq_q > seq_k and seq_q < seq_k,
/// GQA, head dims below the kernel's; windows without a right bound, and longer queries, stay on
/// the sm80 family. Against the float64 reference (outputs poisoned), the route
/// asserted on an sm_90 device unless another family is forced.
#[test]
fn sm90_windows() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    arch_under_test();
    let sm90 = match &dev {
        Device::Cuda(cuda) => {
            flashcore::cuda::device_info(cuda)?.major == 9
                && std::env::var("FLASHCORE_TEST_ARCH").map_or(true, |a| a == "sm90")
        }
        _ => false,
    };
    let w = |left: Option<usize>, right: Option<usize>| Mask::Window { left, right };
    // (b, sq, sk, hq, hkv, d, mask, the sm90 window kernel on sm_90)
    let cases = [
        (2, 1023, 1023, 64, 8, 64, w(Some(127), Some(0)), true),
        (1, 4096, 4096, 8, 8, 128, w(Some(1000), Some(0)), true),
        (1, 4224, 4224, 8, 8, 128, w(Some(1000), Some(0)), true),
        (2, 113, 4224, 8, 2, 64, w(Some(300), Some(5)), true),
        (1, 2113, 1000, 8, 4, 128, w(Some(50), Some(200)), true),
        (1, 700, 700, 8, 1, 64, w(None, Some(30)), true),
        (2, 257, 257, 4, 4, 128, w(Some(0), Some(0)), true),
        (1, 1500, 3000, 8, 8, 96, w(Some(129), Some(1)), true),
        (1, 600, 600, 8, 2, 64, w(Some(64), None), false),
    ];
    for (n, (b, sq, sk, hq, hkv, d, mask, window_kernel)) in cases.into_iter().enumerate() {
        let c = Case {
            b,
            sq,
            sk,
            hq,
            hkv,
            d,
            dtype: if n % 2 == 0 { DType::BF16 } else { DType::F16 },
            mask,
            strided: n % 3 == 1,
        };
        let (e, ne, kernel) = check(&dev, &c)?;
        println!("[OK] {c}: err {e:.2e} (naive {ne:.2e}) {kernel}");
        if sm90 {
            let on_window = kernel.contains("sm90_fwd") && kernel.contains("_local_");
            assert_eq!(on_window, window_kernel, "{c}: {kernel}");
        }
    }
    Ok(())
}
