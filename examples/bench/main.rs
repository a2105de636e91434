//! Benchmark runner: flashcore against candle's eager attention (matmul, mask, softmax, matmul)
//! on the available device. One line per case:
//!   [OK] sm80 bf16 b16 h16/16 s2048/2048 d64 : 612.3 us 224.5 TFLOPS
//!
//!   cargo run --release --features cuda --example bench -- --grid fa3 --backend all
//!   cargo run --release --example bench            (CPU, default problem)
//!   ... --grid fa3 --head-dim 96                   (any multiple of 8 up to 256; fa3 heads = 2048 / d)
//!   ... --varlen mixed:64:128:4096 --shape 0,32,8,0,0,128 --causal
//!       (a packed batch: `varlen` runs attention_varlen, `padded` the dense call on the batch
//!        padded to its longest sequence; TFLOPS count the useful work of both)
//!   ... --grid llama --paged 64
//!       (`paged` runs attention_paged over pools of 64-row pages in shuffled order holding the
//!        same K/V as the contiguous `flashcore` call; JSON lines gain `page`)
//!   ... --shape 0,32,8,1,0,128 --paged 64 --kv-lens mixed:256:128:2560 --backend paged
//!       (a serving engine's decode batch: each sequence reads its own number of cached keys;
//!        GB/s count only those)
//!   ... --grid sinks --verify
//!       (gpt-oss attention: d64, 64/8 heads, learnable sinks, causal and a 128-key causal
//!        window; `--shape ... --sinks --window 127` runs one such problem)
//!   ... --grid dv,d512
//!       (DeepSeek prefill, q/k 192 and v 128; Gemma 4's d512 layers beside d256)
//!   ... --grid fp8decode
//!       (paged decode, 32/8 heads d128 pages of 64, b1/8/64 x 4k-32k: a bf16 KV cache against
//!        the same cache in FP8 e4m3; times, GB/s, speed-up and the outputs' largest difference)
//!   ... --grid fp8prefill
//!       (chunked prefill, the same heads and pages: 512 / 2048 new causal rows over 4k-32k
//!        cached keys, b1/b4, bf16 cache against FP8; times, TFLOPS, speed and the difference)
//!   ... --grid fa3 --backend all --json > fa3.jsonl
//!   ... --plot-from fa3.jsonl,sdpa.jsonl,fa4.jsonl --plot docs/charts/fa3
//!       (SVG charts, no device needed: TFLOPS per shape with one series per backend, and
//!        flashcore's TFLOPS over each other backend's; `--plot` after a run charts its own rows)
//!
//! `--verify` judges every flashcore row (flashcore, paged, varlen) against the CPU reference
//! with the tolerance of examples/bench/judge.rs, prints FAIL rows and exits non-zero on any.

mod fp8;
mod judge;
mod plot;

use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};
use clap::Parser;
use flashcore::{AttnParams, Mask};
use judge::Verdict;
use serde_json::{json, Value};
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
    /// For --shape: a causal sliding window, each query seeing itself and this many keys before
    /// it (as the sinks grid's windowed rows; implies causal).
    #[arg(long)]
    window: Option<usize>,
    /// For --shape: learnable attention sinks (random f32 per query head), as the sinks grid.
    #[arg(long)]
    sinks: bool,
    /// A named grid: fa3, seeds, llama, sinks, dv, d512 (comma-separated for several). sinks:
    /// gpt-oss's attention (d64, 64/8 heads, learnable sinks; causal, and a causal window of 128
    /// keys). dv: DeepSeek's prefill head dims (q/k 192, v 128; 16 heads). d512: Gemma 4's global
    /// layers (32/4 heads, 8k / 16k) beside the same shapes at d256.
    /// fp8decode (alone): paged decode over a bf16 cache against the same cache in FP8;
    /// fp8prefill (alone): chunked prefill over the two (examples/bench/fp8.rs).
    #[arg(long)]
    grid: Option<String>,
    /// Force a kernel family: sm80 or sm90.
    #[arg(long)]
    force_arch: Option<String>,
    /// Judge each flashcore row (backends flashcore, paged, varlen; eager is reported, not
    /// judged) against flashcore's CPU path in f32 on the same inputs: the last 64 query rows of
    /// batch 0 (varlen: the first and last sequences). A row passes when max |out - ref| <= tol *
    /// max |ref|, tol = 2e-2 for bf16, 4e-3 for f16, 1e-4 for f32, and every output element is
    /// finite; failing rows print FAIL and the run exits non-zero.
    #[arg(long)]
    verify: bool,
    /// Add this to every judged output before --verify compares it, to show the check failing:
    /// 0.5 fails every row (the outputs of the bench's N(0, 1) inputs stay far below
    /// 0.5 / 2e-2 = 25 in magnitude).
    #[arg(long, default_value_t = 0.0, requires = "verify")]
    perturb_output: f64,
    /// Write SVG charts: PATH.svg (TFLOPS per shape, one series per backend) and PATH-ratio.svg
    /// (flashcore's TFLOPS over each other backend's), PATH without or with `.svg`. Charts the
    /// rows just run, or those of --plot-from.
    #[arg(long)]
    plot: Option<String>,
    /// Chart these JSONL files (comma-separated) instead of running anything: this bench's
    /// --json rows, the anchor scripts' rows (sdpa_anchor.py, fa4_anchor.py) or any lines with
    /// backend, b, hq, hkv, sq, sk, d, causal and tflops. Needs --plot.
    #[arg(long, requires = "plot")]
    plot_from: Option<String>,
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
    /// median per call; includes per-call host work when it exceeds the kernel's time. `host`
    /// (CUDA): the host's time to issue one call (validation, dispatch, allocation, launches)
    /// while the GPU is still busy with earlier work, median of batches; the kernels' time is
    /// not in it.
    #[arg(long, default_value = "flush")]
    timing: String,
    /// Seconds of back-to-back calls before each `flush` timing, so that the case is timed at
    /// the clock the GPU holds under sustained load (an H100 sits at its power cap then).
    #[arg(long, default_value_t = 0.0)]
    heat: f64,
    /// Softcap every problem's scores: `c * tanh(s / c)` (Gemma 2 uses 50).
    #[arg(long)]
    softcap: Option<f32>,
    /// Run every problem at this head dim (any multiple of 8 up to 256; the fa3 grid then takes
    /// 2048 / d heads, as `sdpa_anchor.py --head-dims`).
    #[arg(long)]
    head_dim: Option<usize>,
    /// A packed batch of these sequence lengths (q = k per sequence): `L1,L2,...`,
    /// `mixed:N:MIN:MAX` (N lengths drawn uniformly, seeded), `equal:N:L`, or `file:PATH` (a
    /// comma-separated list, e.g. ../shared/bench/mixed-lengths.txt). Heads and head dim from
    /// --shape (b, sq, sk ignored) or 32/8/128; --causal applies.
    #[arg(long)]
    varlen: Option<String>,
    /// Also time every dense problem through a paged KV cache of this page size (backend
    /// `paged`: the same K/V in pages of a pool in shuffled order) beside the contiguous
    /// `flashcore` call; --backend all then means flashcore and paged.
    #[arg(long)]
    paged: Option<usize>,
    /// Where `--paged` puts the pages in the pool: `shuffled` (default; a seeded random order,
    /// the worst case for locality) or `sequential` (each sequence's pages in order, one
    /// sequence after another: a fresh pool's free list).
    #[arg(long, default_value = "shuffled")]
    page_order: String,
    /// With --paged and --shape: each sequence's number of cached keys (a --varlen spec), as a
    /// serving engine's decode batch holds them. b becomes their count and sk their maximum;
    /// the paged call reads only these lengths (`seqlens_k`), and GB/s count only them.
    #[arg(long)]
    kv_lens: Option<String>,
}

/// K/V `(b, sk, hkv, d)` as pools of `page_size`-row pages in a shuffled (seeded) order, with
/// the page table `(b, max_pages)` and the lengths: what `attention_paged` reads.
struct Pages {
    k: Tensor,
    v: Tensor,
    table: Tensor,
    lens: Tensor,
}

fn to_pages(k: &Tensor, v: &Tensor, page_size: usize, seed: Option<u64>) -> Result<Pages> {
    let (b, sk, hkv, d) = k.dims4()?;
    let mp = sk.div_ceil(page_size);
    let np = b * mp;
    // pool page i holds logical page perm[i] (sequence perm[i] / mp, its page perm[i] % mp);
    // no seed: the identity
    let mut perm: Vec<u32> = (0..np as u32).collect();
    if let Some(seed) = seed {
        let mut x = seed | 1;
        for i in (1..np).rev() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            perm.swap(i, (x % (i as u64 + 1)) as usize);
        }
    }
    let mut table = vec![0u32; np];
    for (i, &l) in perm.iter().enumerate() {
        table[l as usize] = i as u32;
    }
    let dev = k.device();
    let idx = Tensor::new(perm.as_slice(), dev)?;
    let pool = |t: &Tensor| -> Result<Tensor> {
        let pad = mp * page_size - sk;
        let t = if pad > 0 {
            Tensor::cat(&[t, &Tensor::zeros((b, pad, hkv, d), t.dtype(), dev)?], 1)?
        } else {
            t.clone()
        };
        Ok(t.reshape((np, page_size, hkv, d))?.index_select(&idx, 0)?)
    };
    Ok(Pages {
        k: pool(k)?,
        v: pool(v)?,
        table: Tensor::from_vec(table, (b, mp), dev)?,
        lens: Tensor::new(vec![sk as u32; b].as_slice(), dev)?,
    })
}

/// Sequence lengths of `--varlen`.
fn varlen_lengths(spec: &str) -> Result<Vec<usize>> {
    let parts: Vec<&str> = spec.split(':').collect();
    let num = |x: &str| -> Result<usize> { Ok(x.trim().parse()?) };
    Ok(match parts[..] {
        ["mixed", n, lo, hi] => {
            let (n, lo, hi) = (num(n)?, num(lo)?, num(hi)?);
            if lo > hi {
                bail!("--varlen mixed:N:MIN:MAX needs MIN <= MAX, got {spec:?}");
            }
            // A small LCG: the same lengths on every machine.
            let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
            (0..n)
                .map(|_| {
                    x = x
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    lo + ((x >> 33) as usize) % (hi - lo + 1)
                })
                .collect()
        }
        ["equal", n, l] => vec![num(l)?; num(n)?],
        ["file", path] => std::fs::read_to_string(path)?
            .split(',')
            .map(num)
            .collect::<Result<_>>()?,
        _ => spec.split(',').map(num).collect::<Result<_>>()?,
    })
}

#[derive(Clone, Debug)]
struct Problem {
    b: usize,
    hq: usize,
    hkv: usize,
    sq: usize,
    sk: usize,
    d: usize,
    causal: bool,
    /// A packed batch of these lengths (b = count, sq = sk = the longest).
    lens: Option<Vec<usize>>,
    /// A causal sliding window: each query sees itself and this many keys before it
    /// (`Mask::Window { left: Some(w), right: Some(0) }`; gpt-oss's windowed layers: 127).
    window: Option<usize>,
    /// Attention sinks (`AttnParams::sinks`), random f32 per query head.
    sinks: bool,
    /// V's (and the output's) head dim when it differs from q/k's `d`.
    dv: Option<usize>,
}

impl Problem {
    fn dv(&self) -> usize {
        self.dv.unwrap_or(self.d)
    }
    /// Two matrix products per visible (query, key) pair: `2 d` FLOPs for the scores and
    /// `2 dv` for the weighted values.
    fn flops(&self) -> f64 {
        if let Some(lens) = &self.lens {
            let one = |l: usize| Problem {
                b: 1,
                sq: l,
                sk: l,
                lens: None,
                window: None,
                sinks: false,
                ..self.clone()
            };
            return lens.iter().map(|&l| one(l).flops()).sum();
        }
        if let Some(w) = self.window {
            // keys each row sees: [i + sk - sq - w, i + sk - sq] within [0, sk)
            let seen: usize = (0..self.sq)
                .map(|i| {
                    let diag = (i + self.sk) as i64 - self.sq as i64;
                    let lo = (diag - w as i64).max(0);
                    let hi = (diag + 1).min(self.sk as i64);
                    (hi - lo).max(0) as usize
                })
                .sum();
            return 2.0 * (self.b * self.hq) as f64 * seen as f64 * (self.d + self.dv()) as f64;
        }
        let avg_sk = if self.causal {
            ((self.sk.saturating_sub(self.sq)) + self.sk) as f64 / 2.0
        } else {
            self.sk as f64
        };
        2.0 * (self.b * self.hq * self.sq) as f64 * avg_sk * (self.d + self.dv()) as f64
    }
    fn bytes(&self, elem: usize) -> f64 {
        if let Some(lens) = &self.lens {
            let t: usize = lens.iter().sum();
            let dd = self.d + self.dv();
            return (elem * (t * self.hq * dd + t * self.hkv * dd)) as f64;
        }
        let dd = self.d + self.dv();
        (elem * (self.b * self.sq * self.hq * dd + self.b * self.sk * self.hkv * dd)) as f64
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
                            lens: None,
                            window: None,
                            sinks: false,
                            dv: None,
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
                lens: None,
                window: None,
                sinks: false,
                dv: None,
            });
            v.push(Problem {
                b: 1,
                hq: 8,
                hkv: 8,
                sq: 512,
                sk: 512,
                d: 64,
                causal: false,
                lens: None,
                window: None,
                sinks: false,
                dv: None,
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
                lens: None,
                window: None,
                sinks: false,
                dv: None,
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
                        lens: None,
                        window: None,
                        sinks: false,
                        dv: None,
                    });
                }
            }
        }
        "sinks" => {
            // gpt-oss attention: d64, 64 query / 8 KV heads, learnable sinks, layers alternating
            // full causal attention and a 128-key causal window; 32k tokens per call
            for window in [None, Some(127)] {
                for s in [4096, 8192, 16384, 32768] {
                    v.push(Problem {
                        b: 32768 / s,
                        hq: 64,
                        hkv: 8,
                        sq: s,
                        sk: s,
                        d: 64,
                        causal: true,
                        lens: None,
                        window,
                        sinks: true,
                        dv: None,
                    });
                }
            }
        }
        "dv" => {
            // DeepSeek-V3 prefill: q/k head dim 192 (128 + 64 rope), v 128; 16 heads (a TP-8
            // shard of 128); 16k tokens per call
            for causal in [false, true] {
                for s in [1024, 2048, 4096, 8192, 16384] {
                    v.push(Problem {
                        b: 16384 / s,
                        hq: 16,
                        hkv: 16,
                        sq: s,
                        sk: s,
                        d: 192,
                        causal,
                        lens: None,
                        window: None,
                        sinks: false,
                        dv: Some(128),
                    });
                }
            }
        }
        "d512" => {
            // Gemma 4's global layers (d512, 32/4 heads) beside the same shapes at d256; 16k
            // tokens per call
            for d in [256, 512] {
                for causal in [true, false] {
                    for s in [8192, 16384] {
                        v.push(Problem {
                            b: 16384 / s,
                            hq: 32,
                            hkv: 4,
                            sq: s,
                            sk: s,
                            d,
                            causal,
                            lens: None,
                            window: None,
                            sinks: false,
                            dv: None,
                        });
                    }
                }
            }
        }
        _ => bail!("unknown grid {name:?}: expected fa3, seeds, llama, sinks, dv or d512"),
    }
    Ok(v)
}

fn sync(dev: &Device) -> Result<()> {
    dev.synchronize()?;
    Ok(())
}

/// The median of a non-empty list of timings (the upper one of an even count).
fn median(mut times: Vec<f64>) -> f64 {
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
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
    Ok(median(times) * 1e6)
}

/// Median host time in microseconds to issue one call of `f` (`--timing host`): batches of calls
/// issued behind ~4 ms of memsets on candle's stream, so that no call waits for the GPU; a batch
/// during which the GPU ran dry (its marker event already complete when the batch ends) is an
/// error rather than a number.
#[cfg(feature = "cuda")]
fn time_host(dev: &Device, reps: usize, mut f: impl FnMut(usize) -> Result<()>) -> Result<f64> {
    let Device::Cuda(cd) = dev else {
        bail!("--timing host needs a CUDA device")
    };
    let stream = cd.cuda_stream();
    // SAFETY: the buffer is only ever memset.
    let mut busy = unsafe { stream.alloc::<u8>(256 << 20) }?;
    for i in 0..3 {
        f(i)?;
    }
    stream.synchronize()?;
    let per_batch = 32;
    let mut times = Vec::with_capacity(reps);
    let mut it = 0;
    for _ in 0..reps.max(5) {
        for _ in 0..48 {
            stream.memset_zeros(&mut busy)?;
        }
        let marker = stream.record_event(None)?;
        let t = Instant::now();
        for _ in 0..per_batch {
            f(it)?;
            it += 1;
        }
        let host = t.elapsed().as_secs_f64();
        if marker.try_is_complete()? {
            bail!(
                "--timing host: the GPU ran dry during a batch ({:.1} us per call): the memsets are too short for these calls",
                host / per_batch as f64 * 1e6
            );
        }
        stream.synchronize()?;
        times.push(host / per_batch as f64);
    }
    Ok(median(times) * 1e6)
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
    let times = pending
        .iter()
        .map(|(s, e)| Ok(s.elapsed_ms(e)? as f64 * 1e3))
        .collect::<Result<Vec<f64>>>()?;
    Ok(median(times))
}

/// Times `call` with `--timing`'s method: the outer error is a method this device lacks (the run
/// stops), the inner one a failed case (reported as such).
fn time_call(
    args: &Args,
    dev: &Device,
    call: impl FnMut(usize) -> Result<()>,
) -> Result<Result<f64>> {
    Ok(match (args.timing.as_str(), dev.is_cuda()) {
        #[cfg(feature = "cuda")]
        ("flush", true) => time_events(dev, args.reps, args.heat, call),
        ("flush", _) | ("batch", _) => time_it(dev, args.reps, call),
        #[cfg(feature = "cuda")]
        ("host", true) => time_host(dev, args.reps, call),
        (t, _) => bail!("--timing must be flush, batch or host (CUDA), got {t:?}"),
    })
}

fn main() -> Result<()> {
    let args = Args::parse();
    if let (Some(out), Some(files)) = (&args.plot, &args.plot_from) {
        let mut rows = Vec::new();
        for f in files.split(',').filter(|f| !f.is_empty()) {
            rows.extend(plot::read_jsonl(std::path::Path::new(f))?);
        }
        for path in plot::write_charts(&rows, out)? {
            eprintln!("wrote {}", path.display());
        }
        return Ok(());
    }
    if !args.perturb_output.is_finite() {
        bail!(
            "--perturb-output must be a finite number, got {}",
            args.perturb_output
        );
    }
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
    if args.grid.as_deref() == Some("fp8decode") {
        return fp8::grid(&args, &dev);
    }
    if args.grid.as_deref() == Some("fp8prefill") {
        return fp8::prefill_grid(&args, &dev);
    }
    let kv_lens = match &args.kv_lens {
        Some(spec) => {
            if args.paged.is_none() || args.shape.is_none() || args.varlen.is_some() || args.verify
            {
                bail!("--kv-lens needs --paged and --shape (and no --varlen or --verify)");
            }
            let l = varlen_lengths(spec)?;
            if l.is_empty() || l.contains(&0) {
                bail!("--kv-lens needs at least one length, each >= 1: {spec:?}");
            }
            Some(l)
        }
        None => None,
    };
    let mut problems = if let Some(spec) = &args.varlen {
        let lens = varlen_lengths(spec)?;
        if lens.is_empty() {
            bail!("--varlen gave no lengths: {spec:?}");
        }
        let (hq, hkv, d) = match &args.shape {
            Some(s) => {
                let n: Vec<usize> = s
                    .split(',')
                    .map(|x| x.trim().parse())
                    .collect::<std::result::Result<_, _>>()?;
                let [_, hq, hkv, _, _, d] = n[..] else {
                    bail!("--shape takes b,hq,hkv,sq,sk,d, got {s:?}")
                };
                (hq, hkv, d)
            }
            None => (32, 8, 128),
        };
        let max = *lens.iter().max().unwrap_or(&0);
        vec![Problem {
            b: lens.len(),
            hq,
            hkv,
            sq: max,
            sk: max,
            d,
            causal: args.causal,
            lens: Some(lens),
            window: None,
            sinks: false,
            dv: None,
        }]
    } else if let Some(s) = &args.shape {
        let n: Vec<usize> = s
            .split(',')
            .map(|x| x.trim().parse())
            .collect::<std::result::Result<_, _>>()?;
        let [b, hq, hkv, sq, sk, d] = n[..] else {
            bail!("--shape takes b,hq,hkv,sq,sk,d, got {s:?}")
        };
        let (b, sk) = match &kv_lens {
            Some(l) => (l.len(), *l.iter().max().unwrap_or(&0)),
            None => (b, sk),
        };
        vec![Problem {
            b,
            hq,
            hkv,
            sq,
            sk,
            d,
            causal: args.causal || args.window.is_some(),
            lens: None,
            window: args.window,
            sinks: args.sinks,
            dv: None,
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
            lens: None,
            window: None,
            sinks: false,
            dv: None,
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
            lens: None,
            window: None,
            sinks: false,
            dv: None,
        }]
    };
    if let Some(d) = args.head_dim {
        let fa3 = args.grid.as_deref().is_some_and(|g| g.contains("fa3"));
        for p in problems.iter_mut() {
            if fa3 && p.lens.is_none() && p.sq * p.b == 16384 {
                p.hq = (2048 / d).max(1);
                p.hkv = p.hq;
            }
            p.d = d;
        }
        // The fa3 grid lists each shape at d64/128/256: at one head dim those coincide.
        let mut seen = std::collections::HashSet::new();
        problems.retain(|p| seen.insert(format!("{p:?}")));
    }
    let backends: Vec<&str> = match args.backend.as_str() {
        "all" if args.paged.is_some() => vec!["flashcore", "paged"],
        "all" => vec!["flashcore", "eager"],
        "paged" if args.paged.is_some() => vec!["paged"],
        "flashcore" => vec!["flashcore"],
        "eager" => vec!["eager"],
        b => bail!("--backend must be flashcore, eager, all (or paged with --paged), got {b:?}"),
    };
    if !args.json {
        println!(
            "device: {:?}, dtype {dtype:?}, timing {}",
            dev.location(),
            args.timing
        );
    }
    let mut rows: Vec<Value> = Vec::new();
    for p in problems {
        if p.lens.is_some() {
            run_varlen(&args, &dev, dtype, &p, &mut rows)?;
            continue;
        }
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
                r((p.b, p.sk, p.hkv, p.dv()))?,
            ));
        }
        let params = AttnParams {
            mask: match (p.window, p.causal) {
                (Some(w), _) => Mask::Window {
                    left: Some(w),
                    right: Some(0),
                },
                (None, true) => Mask::Causal,
                (None, false) => Mask::None,
            },
            softcap: args.softcap,
            // gpt-oss's sinks are learned per head; random values around typical row LSEs
            sinks: p
                .sinks
                .then(|| Tensor::rand(-1f32, 4., p.hq, &dev))
                .transpose()?,
            ..Default::default()
        };
        let pages = match args.paged {
            Some(ps) if backends.contains(&"paged") => {
                if ps == 0 {
                    bail!("--paged takes a page size >= 1");
                }
                let seed = |i: usize| match args.page_order.as_str() {
                    "shuffled" => Ok(Some(0x9E37_79B9 + i as u64)),
                    "sequential" => Ok(None),
                    o => bail!("--page-order must be shuffled or sequential, got {o:?}"),
                };
                let mut pages = sets
                    .iter()
                    .enumerate()
                    .map(|(i, (_, k, v))| to_pages(k, v, ps, seed(i)?))
                    .collect::<Result<Vec<_>>>()?;
                if let Some(l) = &kv_lens {
                    let l: Vec<u32> = l.iter().map(|&x| x as u32).collect();
                    for pg in pages.iter_mut() {
                        pg.lens = Tensor::new(l.as_slice(), &dev)?;
                    }
                }
                pages
            }
            _ => Vec::new(),
        };
        for &backend in &backends {
            let run = |i: usize| -> candle_core::Result<Tensor> {
                let (q, k, v) = &sets[i % nsets];
                match backend {
                    "eager" => flashcore::attention_slow(q, k, v, &params),
                    "paged" => {
                        let pg = &pages[i % nsets];
                        flashcore::attention_paged(q, &pg.k, &pg.v, &pg.table, &pg.lens, &params)
                    }
                    _ => flashcore::attention(q, k, v, &params),
                }
            };
            let arch = arch_name(backend, &dev, &params, &sets[0]);
            let call = |i: usize| -> Result<()> {
                run(i)?;
                Ok(())
            };
            let res = time_call(&args, &dev, call)?;
            let (status, us, err) = match res {
                Ok(us) => {
                    let err = if args.verify {
                        let judged = backend != "eager";
                        let out = run(0)?;
                        let perturb = if judged { args.perturb_output } else { 0.0 };
                        Some((
                            judge::check_dense(&out, &sets[0], &params, perturb)?,
                            judged,
                        ))
                    } else {
                        None
                    };
                    (verdict_status(err), us, err)
                }
                Err(e) => {
                    eprintln!("{backend} {p:?}: {e}");
                    ("ERR", f64::NAN, None)
                }
            };
            let tflops = p.flops() / us / 1e6;
            let bytes = match (&kv_lens, backend) {
                (Some(l), "paged") => {
                    let keys: usize = l.iter().sum();
                    (dtype.size_in_bytes() * 2 * (p.b * p.sq * p.hq + keys * p.hkv) * p.d) as f64
                }
                _ => p.bytes(dtype.size_in_bytes()),
            };
            let gbps = bytes / us / 1e3;
            let mut row = json!({
                "backend": backend, "arch": arch, "dtype": args.dtype,
                "b": p.b, "hq": p.hq, "hkv": p.hkv, "sq": p.sq, "sk": p.sk, "d": p.d, "dv": p.dv(),
                "causal": p.causal, "softcap": args.softcap.unwrap_or(0.0),
                "window": p.window, "sinks": p.sinks,
                "us": json_num(us), "tflops": json_num(tflops), "gbps": json_num(gbps),
                "timing": args.timing, "status": status,
            });
            add_verdict(&mut row, err);
            match (args.paged, backend) {
                (None, _) => {}
                (Some(ps), "paged") => {
                    row["page"] = json!(ps);
                    row["page_order"] = json!(args.page_order);
                    if let Some(l) = &args.kv_lens {
                        row["kv_lens"] = json!(l);
                    }
                }
                (Some(_), _) => row["page"] = Value::Null,
            }
            if args.json {
                println!("{row}");
            } else {
                let perf = if p.sq <= 16 {
                    format!("{gbps:8.1} GB/s")
                } else {
                    format!("{tflops:6.1} TFLOPS")
                };
                let e = verdict_text(err);
                println!(
                    "[{status}] {backend:<9} {arch:<6} {} b{} h{}/{} s{}/{} d{}{}{}{}{}{}{} : {us:9.1} us {perf}{e}",
                    args.dtype, p.b, p.hq, p.hkv, p.sq, p.sk, p.d,
                    p.dv.map_or(String::new(), |v| format!("/{v}")),
                    if p.causal { " causal" } else { "" },
                    p.window.map_or(String::new(), |w| format!(" window {w}")),
                    if p.sinks { " sinks" } else { "" },
                    args.softcap.map_or(String::new(), |c| format!(" softcap {c}")),
                    match (args.paged, backend) { (Some(ps), "paged") => format!(" page {ps} {}", args.page_order), _ => String::new() }
                );
            }
            rows.push(row);
        }
    }
    finish(&args, &rows)
}

/// After the last row: the charts of `--plot`, then the verdict of `--verify` as the exit status.
fn finish(args: &Args, rows: &[Value]) -> Result<()> {
    if let Some(out) = &args.plot {
        let rows: Vec<plot::Row> = rows.iter().filter_map(plot::Row::from_value).collect();
        for path in plot::write_charts(&rows, out)? {
            eprintln!("wrote {}", path.display());
        }
    }
    let failed = rows.iter().filter(|r| r["status"] == "FAIL").count();
    if failed > 0 {
        bail!(
            "--verify: {failed} of {} rows FAILED (tolerance: --help, --verify)",
            rows.len()
        );
    }
    Ok(())
}

/// A row's status: `FAIL` when --verify judged it and it failed, else `OK`.
fn verdict_status(err: Option<(Verdict, bool)>) -> &'static str {
    match err {
        Some((v, true)) if !v.pass() => "FAIL",
        _ => "OK",
    }
}

/// The --verify columns of a JSON row (absent without --verify).
fn add_verdict(row: &mut Value, err: Option<(Verdict, bool)>) {
    let num = |x: f64| if x.is_finite() { json!(x) } else { Value::Null };
    row["max_err"] = err.map_or(Value::Null, |(v, _)| num(v.max_err));
    if let Some((v, judged)) = err {
        row["rel_err"] = num(v.rel_err());
        row["tol"] = if judged { json!(v.tol) } else { Value::Null };
    }
}

/// The --verify columns of a text row.
fn verdict_text(err: Option<(Verdict, bool)>) -> String {
    match err {
        None => String::new(),
        Some((v, true)) => format!(
            "  max_err {:.2e} rel {:.2e} {} tol {:.0e}",
            v.max_err,
            v.rel_err(),
            if v.pass() { "<=" } else { "> FAIL" },
            v.tol
        ),
        Some((v, false)) => format!(
            "  max_err {:.2e} rel {:.2e} (not judged)",
            v.max_err,
            v.rel_err()
        ),
    }
}

/// A packed batch (`--varlen`): `varlen` times one attention_varlen call over the packed
/// sequences, `padded` the dense call on the batch padded to its longest sequence (what a caller
/// without varlen pays); both report TFLOPS of the useful (unpadded) work. `--verify` compares
/// the varlen output of the first and last sequences with the CPU reference.
fn run_varlen(
    args: &Args,
    dev: &Device,
    dtype: DType,
    p: &Problem,
    rows: &mut Vec<Value>,
) -> Result<()> {
    let lens = p.lens.clone().unwrap_or_default();
    let total: usize = lens.iter().sum();
    let max = p.sq;
    let mut cu = vec![0u32];
    for &l in &lens {
        cu.push(cu.last().unwrap() + l as u32);
    }
    let cu = Tensor::new(cu.as_slice(), dev)?;
    let r = |s: &[usize]| -> candle_core::Result<Tensor> {
        Tensor::randn(0f32, 1., s, dev)?.to_dtype(dtype)
    };
    let (q, k, v) = (
        r(&[total, p.hq, p.d])?,
        r(&[total, p.hkv, p.d])?,
        r(&[total, p.hkv, p.d])?,
    );
    let params = AttnParams {
        mask: if p.causal { Mask::Causal } else { Mask::None },
        softcap: args.softcap,
        ..Default::default()
    };
    let padded_tokens = lens.len() * max;
    for backend in ["varlen", "padded"] {
        let dense = if backend == "padded" {
            Some((
                r(&[lens.len(), max, p.hq, p.d])?,
                r(&[lens.len(), max, p.hkv, p.d])?,
                r(&[lens.len(), max, p.hkv, p.d])?,
            ))
        } else {
            None
        };
        let run = || -> candle_core::Result<Tensor> {
            match &dense {
                Some((q, k, v)) => flashcore::attention(q, k, v, &params),
                None => flashcore::attention_varlen(&q, &k, &v, &cu, &cu, max, max, &params),
            }
        };
        let call = |_: usize| -> Result<()> {
            run()?;
            Ok(())
        };
        let res = time_call(args, dev, call)?;
        let (status, us) = match res {
            Ok(us) => ("OK", us),
            Err(e) => {
                eprintln!("{backend} {} sequences: {e}", lens.len());
                ("ERR", f64::NAN)
            }
        };
        let err = if args.verify && backend == "varlen" && status == "OK" {
            let o = run()?;
            let mut worst: Option<Verdict> = None;
            for i in [0, lens.len() - 1] {
                let (a, l) = (cu.get(i)?.to_scalar::<u32>()? as usize, lens[i]);
                if l == 0 {
                    continue;
                }
                let v =
                    judge::check_packed_seq(&o, (&q, &k, &v), a, l, &params, args.perturb_output)?;
                worst = Some(worst.map_or(v, |w| w.worst(v)));
            }
            worst.map(|v| (v, true))
        } else {
            None
        };
        let status = if status == "OK" {
            verdict_status(err)
        } else {
            status
        };
        let tflops = p.flops() / us / 1e6;
        let mut row = json!({
            "backend": backend, "arch": "varlen", "dtype": args.dtype,
            "b": lens.len(), "hq": p.hq, "hkv": p.hkv, "sq": max, "sk": max, "d": p.d,
            "causal": p.causal, "softcap": args.softcap.unwrap_or(0.0),
            "us": json_num(us), "tflops": json_num(tflops), "gbps": Value::Null,
            "timing": args.timing, "status": status,
            "varlen": true, "tokens": total, "padded_tokens": padded_tokens,
        });
        add_verdict(&mut row, err);
        if args.json {
            println!("{row}");
        } else {
            let e = verdict_text(err);
            println!(
                "[{status}] {backend:<9} {} {} seqs ({total} tokens, padded {padded_tokens}) h{}/{} d{}{} : {us:9.1} us {tflops:6.1} TFLOPS{e}",
                args.dtype, lens.len(), p.hq, p.hkv, p.d, if p.causal { " causal" } else { "" }
            );
        }
        rows.push(row);
    }
    Ok(())
}

/// A JSON number rounded to 4 decimals, `null` when not finite (a failed case).
fn json_num(x: f64) -> Value {
    if x.is_finite() {
        json!((x * 1e4).round() / 1e4)
    } else {
        Value::Null
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
