//! Benchmark runner: flashcore against candle's eager attention (matmul, mask, softmax, matmul)
//! on the available device. One line per case:
//!   [OK] sm80 bf16 b16 h16/16 s2048/2048 d64 : 612.3 us 224.5 TFLOPS
//!
//!   cargo run --release --features cuda --example bench -- --grid fa3 --backend all
//!   cargo run --release --example bench            (CPU, default problem)

use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};
use clap::Parser;
use flashcore::{AttnParams, Mask};
use std::time::Instant;

#[derive(Parser, Debug)]
#[command(about = "flashcore attention benchmark")]
struct Args {
    /// flashcore, eager or all.
    #[arg(long, default_value = "all")]
    backend: String,
    /// bf16, f16 or f32 (f32 runs on the CPU path only).
    #[arg(long, default_value = "bf16")]
    dtype: String,
    /// One problem: b,hq,hkv,sq,sk,d.
    #[arg(long)]
    shape: Option<String>,
    /// Causal mask (bottom-right aligned) for --shape.
    #[arg(long)]
    causal: bool,
    /// A named grid: fa3, seeds, llama (comma-separated for several).
    #[arg(long)]
    grid: Option<String>,
    /// Force a kernel family: sm80 or sm90.
    #[arg(long)]
    force_arch: Option<String>,
    /// Compare the last rows of each output with the CPU reference and report the max error.
    #[arg(long)]
    verify: bool,
    /// One JSON object per line instead of the human-readable lines.
    #[arg(long)]
    json: bool,
    /// Run on the CPU even when a GPU is available.
    #[arg(long)]
    cpu: bool,
    /// Timed repetitions (the median is reported; at least this many).
    #[arg(long, default_value_t = 20)]
    reps: usize,
    /// How a GPU case is timed. `flush` (default on CUDA): CUDA events around each call with a
    /// 256 MB L2 flush before it, median, the method of the SDPA anchor (triton do_bench); host
    /// work is hidden behind the flush. `batch`: host clock around back-to-back batches of calls,
    /// median per call; includes per-call host work when it exceeds the kernel's time.
    #[arg(long, default_value = "flush")]
    timing: String,
    /// Seconds of back-to-back calls before each `flush` timing, so that the case is timed at
    /// the clock the GPU holds under sustained load (an H100 sits at its power cap then).
    #[arg(long, default_value_t = 0.0)]
    heat: f64,
    /// Softcap every problem's scores: `c * tanh(s / c)` (Gemma 2 uses 50).
    #[arg(long)]
    softcap: Option<f32>,
}

#[derive(Clone, Copy, Debug)]
struct Problem {
    b: usize,
    hq: usize,
    hkv: usize,
    sq: usize,
    sk: usize,
    d: usize,
    causal: bool,
}

impl Problem {
    fn flops(&self) -> f64 {
        let avg_sk = if self.causal {
            ((self.sk.saturating_sub(self.sq)) + self.sk) as f64 / 2.0
        } else {
            self.sk as f64
        };
        4.0 * (self.b * self.hq * self.sq) as f64 * avg_sk * self.d as f64
    }
    fn bytes(&self, elem: usize) -> f64 {
        (elem
            * (2 * self.b * self.sq * self.hq * self.d + 2 * self.b * self.sk * self.hkv * self.d))
            as f64
    }
}

fn grid(name: &str) -> Result<Vec<Problem>> {
    let mut v = Vec::new();
    match name {
        "fa3" => {
            for (d, h) in [(64, 32), (128, 16), (256, 8)] {
                for s in [512, 1024, 2048, 4096, 8192, 16384] {
                    for causal in [false, true] {
                        v.push(Problem {
                            b: 16384 / s,
                            hq: h,
                            hkv: h,
                            sq: s,
                            sk: s,
                            d,
                            causal,
                        });
                    }
                }
            }
        }
        "seeds" => {
            v.push(Problem {
                b: 16,
                hq: 16,
                hkv: 16,
                sq: 2048,
                sk: 2048,
                d: 64,
                causal: false,
            });
            v.push(Problem {
                b: 1,
                hq: 8,
                hkv: 8,
                sq: 512,
                sk: 512,
                d: 64,
                causal: false,
            });
        }
        "llama" => {
            v.push(Problem {
                b: 1,
                hq: 32,
                hkv: 8,
                sq: 4096,
                sk: 4096,
                d: 128,
                causal: true,
            });
            for b in [1, 8, 64] {
                for sk in [4096, 8192, 32768] {
                    v.push(Problem {
                        b,
                        hq: 32,
                        hkv: 8,
                        sq: 1,
                        sk,
                        d: 128,
                        causal: false,
                    });
                }
            }
        }
        _ => bail!("unknown grid {name:?}: expected fa3, seeds or llama"),
    }
    Ok(v)
}

fn sync(dev: &Device) -> Result<()> {
    dev.synchronize()?;
    Ok(())
}

/// Median time in microseconds of `f` over `reps` timed batches after warm-up; each batch runs
/// enough calls to last ~20 ms and rotates among the input sets.
fn time_it(dev: &Device, reps: usize, mut f: impl FnMut(usize) -> Result<()>) -> Result<f64> {
    f(0)?;
    sync(dev)?;
    let t = Instant::now();
    f(1)?;
    sync(dev)?;
    let one = t.elapsed().as_secs_f64();
    let per_batch = ((0.02 / one.max(1e-6)) as usize).clamp(1, 200);
    let mut times = Vec::with_capacity(reps);
    let mut it = 0;
    for _ in 0..reps {
        sync(dev)?;
        let t = Instant::now();
        for _ in 0..per_batch {
            f(it)?;
            it += 1;
        }
        sync(dev)?;
        times.push(t.elapsed().as_secs_f64() / per_batch as f64);
    }
    times.sort_by(|a, b| a.partial_cmp(b).unwrap());
    Ok(times[times.len() / 2] * 1e6)
}

/// Median time in microseconds of one call of `f`, timed with CUDA events on candle's stream,
/// with a 256 MB memset before each call so that every call starts from a cold L2 (the method
/// of triton's do_bench, which the SDPA anchor uses). Calls rotate among the input sets.
#[cfg(feature = "cuda")]
fn time_events(
    dev: &Device,
    reps: usize,
    heat: f64,
    mut f: impl FnMut(usize) -> Result<()>,
) -> Result<f64> {
    use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
    let Device::Cuda(cd) = dev else {
        bail!("--timing flush needs a CUDA device")
    };
    let stream = cd.cuda_stream();
    // SAFETY: the flush buffer is only ever memset.
    let mut flush = unsafe { stream.alloc::<u8>(256 << 20) }?;
    let timing = Some(CUevent_flags::CU_EVENT_DEFAULT);
    // Optional heat (`--heat`): back-to-back calls until the clock settles.
    let mut it = 0;
    let t = Instant::now();
    while t.elapsed().as_secs_f64() < heat {
        for _ in 0..8 {
            stream.memset_zeros(&mut flush)?;
            f(it)?;
            it += 1;
        }
        stream.synchronize()?;
    }
    let mut one = |i: usize| -> Result<f64> {
        stream.memset_zeros(&mut flush)?;
        let start = stream.record_event(timing)?;
        f(i)?;
        let end = stream.record_event(timing)?;
        Ok(start.elapsed_ms(&end)? as f64 * 1e3)
    };
    // Warm-up (module loads, allocator) for ~50 ms, then about 300 ms of timed calls.
    let t = Instant::now();
    let mut est = f64::INFINITY;
    while it < 3 || t.elapsed().as_secs_f64() < 0.05 {
        est = est.min(one(it)?);
        it += 1;
    }
    let n = ((300e3 / (est + 100.0)) as usize).clamp(reps, 1000);
    let mut pending = Vec::with_capacity(n);
    for _ in 0..n {
        stream.memset_zeros(&mut flush)?;
        let start = stream.record_event(timing)?;
        f(it)?;
        it += 1;
        pending.push((start, stream.record_event(timing)?));
    }
    let mut times = pending
        .iter()
        .map(|(s, e)| Ok(s.elapsed_ms(e)? as f64 * 1e3))
        .collect::<Result<Vec<f64>>>()?;
    times.sort_by(|a, b| a.partial_cmp(b).unwrap());
    Ok(times[times.len() / 2])
}

fn main() -> Result<()> {
    let args = Args::parse();
    if !(args.heat.is_finite() && args.heat >= 0.0) {
        bail!("--heat must be a number of seconds >= 0, got {}", args.heat);
    }
    if args.heat > 0.0 && args.timing != "flush" {
        bail!(
            "--heat applies to --timing flush only, got --timing {}",
            args.timing
        );
    }
    let dev = if args.cpu {
        Device::Cpu
    } else {
        Device::cuda_if_available(0)?
    };
    let dtype = match args.dtype.as_str() {
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        "f32" => DType::F32,
        d => bail!("--dtype must be bf16, f16 or f32, got {d:?}"),
    };
    #[cfg(feature = "cuda")]
    if let Some(a) = &args.force_arch {
        let arch = flashcore::cuda::Arch::parse(a)
            .ok_or_else(|| anyhow::anyhow!("--force-arch must be sm80 or sm90, got {a:?}"))?;
        flashcore::cuda::set_arch_override(Some(arch));
    }
    #[cfg(not(feature = "cuda"))]
    if args.force_arch.is_some() {
        bail!("--force-arch needs a build with the `cuda` feature");
    }
    let problems = if let Some(s) = &args.shape {
        let n: Vec<usize> = s
            .split(',')
            .map(|x| x.trim().parse())
            .collect::<std::result::Result<_, _>>()?;
        let [b, hq, hkv, sq, sk, d] = n[..] else {
            bail!("--shape takes b,hq,hkv,sq,sk,d, got {s:?}")
        };
        vec![Problem {
            b,
            hq,
            hkv,
            sq,
            sk,
            d,
            causal: args.causal,
        }]
    } else if let Some(g) = &args.grid {
        g.split(',').map(grid).collect::<Result<Vec<_>>>()?.concat()
    } else if dev.is_cpu() {
        vec![Problem {
            b: 1,
            hq: 8,
            hkv: 2,
            sq: 512,
            sk: 512,
            d: 64,
            causal: true,
        }]
    } else {
        vec![Problem {
            b: 16,
            hq: 16,
            hkv: 16,
            sq: 2048,
            sk: 2048,
            d: 64,
            causal: false,
        }]
    };
    let backends: Vec<&str> = match args.backend.as_str() {
        "all" => vec!["flashcore", "eager"],
        "flashcore" => vec!["flashcore"],
        "eager" => vec!["eager"],
        b => bail!("--backend must be flashcore, eager or all, got {b:?}"),
    };
    if !args.json {
        println!(
            "device: {:?}, dtype {dtype:?}, timing {}",
            dev.location(),
            args.timing
        );
    }
    for p in problems {
        // Enough input sets to exceed the L2 cache (50 MB on an H100) between reuses.
        let set_bytes = p.bytes(dtype.size_in_bytes());
        let nsets = if dev.is_cpu() {
            1
        } else {
            ((120e6 / set_bytes).ceil() as usize).clamp(1, 8)
        };
        let mut sets = Vec::new();
        for _ in 0..nsets {
            let r =
                |s: (usize, usize, usize, usize)| Tensor::randn(0f32, 1., s, &dev)?.to_dtype(dtype);
            sets.push((
                r((p.b, p.sq, p.hq, p.d))?,
                r((p.b, p.sk, p.hkv, p.d))?,
                r((p.b, p.sk, p.hkv, p.d))?,
            ));
        }
        let params = AttnParams {
            mask: if p.causal { Mask::Causal } else { Mask::None },
            softcap: args.softcap,
            ..Default::default()
        };
        for &backend in &backends {
            let run = |i: usize| -> candle_core::Result<Tensor> {
                let (q, k, v) = &sets[i % nsets];
                if backend == "eager" {
                    flashcore::attention_slow(q, k, v, &params)
                } else {
                    flashcore::attention(q, k, v, &params)
                }
            };
            let arch = arch_name(backend, &dev, &params, &sets[0]);
            let call = |i: usize| -> Result<()> {
                run(i)?;
                Ok(())
            };
            let res = match (args.timing.as_str(), dev.is_cuda()) {
                #[cfg(feature = "cuda")]
                ("flush", true) => time_events(&dev, args.reps, args.heat, call),
                ("flush", _) | ("batch", _) => time_it(&dev, args.reps, call),
                (t, _) => bail!("--timing must be flush or batch, got {t:?}"),
            };
            let (status, us, err) = match res {
                Ok(us) => {
                    let err = if args.verify {
                        Some(verify(&run(0)?, &sets[0], &params)?)
                    } else {
                        None
                    };
                    ("OK", us, err)
                }
                Err(e) => {
                    eprintln!("{backend} {p:?}: {e}");
                    ("ERR", f64::NAN, None)
                }
            };
            let tflops = p.flops() / us / 1e6;
            let gbps = p.bytes(dtype.size_in_bytes()) / us / 1e3;
            if args.json {
                println!(
                    "{{\"backend\":\"{backend}\",\"arch\":\"{arch}\",\"dtype\":\"{}\",\"b\":{},\"hq\":{},\"hkv\":{},\"sq\":{},\"sk\":{},\"d\":{},\"causal\":{},\"softcap\":{},\"us\":{},\"tflops\":{},\"gbps\":{},\"max_err\":{},\"timing\":\"{}\",\"status\":\"{status}\"}}",
                    args.dtype, p.b, p.hq, p.hkv, p.sq, p.sk, p.d, p.causal, args.softcap.unwrap_or(0.0),
                    json_num(us), json_num(tflops), json_num(gbps), err.map_or("null".into(), json_num),
                    args.timing
                );
            } else {
                let perf = if p.sq <= 16 {
                    format!("{gbps:8.1} GB/s")
                } else {
                    format!("{tflops:6.1} TFLOPS")
                };
                let e = err.map_or(String::new(), |e| format!("  max_err {e:.2e}"));
                println!(
                    "[{status}] {backend:<9} {arch:<6} {} b{} h{}/{} s{}/{} d{}{}{} : {us:9.1} us {perf}{e}",
                    args.dtype, p.b, p.hq, p.hkv, p.sq, p.sk, p.d, if p.causal { " causal" } else { "" },
                    args.softcap.map_or(String::new(), |c| format!(" softcap {c}"))
                );
            }
        }
    }
    Ok(())
}

fn json_num(x: f64) -> String {
    if x.is_finite() {
        format!("{x:.4}")
    } else {
        "null".into()
    }
}

/// The kernel family a backend runs on (the dispatcher's decision for flashcore).
fn arch_name(
    backend: &str,
    dev: &Device,
    params: &AttnParams,
    set: &(Tensor, Tensor, Tensor),
) -> String {
    if backend == "eager" {
        return "eager".into();
    }
    match dev {
        Device::Cpu => "cpu".into(),
        #[cfg(feature = "cuda")]
        Device::Cuda(d) => flashcore::cuda::describe(d, params, &set.0, &set.1, &set.2)
            .ok()
            .and_then(|s| {
                s.split('_')
                    .nth(1)
                    .map(|x| format!("{x}{}", if s.contains("_decode_") { "-dec" } else { "" }))
            })
            .unwrap_or_else(|| "n/a".into()),
        _ => {
            let _ = (params, set);
            "n/a".into()
        }
    }
}

/// Max |error| of the last (up to) 64 query rows of batch 0 against the CPU reference. The last
/// rows of a bottom-right aligned problem form a valid sub-problem with the same keys.
fn verify(out: &Tensor, set: &(Tensor, Tensor, Tensor), p: &AttnParams) -> Result<f64> {
    let (q, k, v) = set;
    let sq = q.dim(1)?;
    let r = sq.min(64);
    let cpu = Device::Cpu;
    let q1 = q
        .narrow(0, 0, 1)?
        .narrow(1, sq - r, r)?
        .to_device(&cpu)?
        .to_dtype(DType::F32)?;
    let k1 = k.narrow(0, 0, 1)?.to_device(&cpu)?.to_dtype(DType::F32)?;
    let v1 = v.narrow(0, 0, 1)?.to_device(&cpu)?.to_dtype(DType::F32)?;
    let want = flashcore::attention(&q1, &k1, &v1, p)?;
    let got = out
        .narrow(0, 0, 1)?
        .narrow(1, sq - r, r)?
        .to_device(&cpu)?
        .to_dtype(DType::F32)?;
    Ok((got - want)?
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_scalar::<f32>()? as f64)
}
