//! Serving many requests at once with the LLaMA example's model: continuous batching over a
//! paged K/V pool (flashcore's `attention_paged{,_varlen}` and `append_kv_paged_varlen`),
//! against static batching and one request at a time, with throughput and latency percentiles.
//!
//! ```text
//! # 256 generated requests on a GPU, Llama 3 8B shapes (random weights), all three engines
//! cargo run --release --features cuda --example serve -- --random-weights --preset llama3-8b \
//!     --requests 256 --prompt-len 128:2048 --gen-len 128:512 --compare --sequential-requests 16
//! # SmolLM2 on the CPU, requests from a JSONL file ({"prompt": ..., "max_new_tokens": ...})
//! cargo run --release --example serve -- --gguf "$(scripts/fetch-smollm2.sh)" --cpu \
//!     --requests-file prompts.jsonl
//! ```
//! The model code is examples/llama's (included below by path); engine.rs holds the three
//! engines. Per-request results go to stdout (one JSON line each with `--json`, then a summary
//! line), progress and the summary table to stderr.

#[allow(dead_code)]
#[path = "../llama/generate.rs"]
mod generate;
#[allow(dead_code)]
#[path = "../llama/load.rs"]
mod load;
#[allow(dead_code)]
#[path = "../llama/model.rs"]
mod model;
#[cfg(feature = "cuda")]
#[path = "../llama/nccl.rs"]
mod nccl;
#[allow(dead_code)]
#[path = "../llama/tokenizer.rs"]
mod tokenizer;
#[allow(dead_code)]
#[path = "../llama/tp.rs"]
mod tp;

mod engine;
mod report;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};
use clap::{Parser, ValueEnum};
use std::path::PathBuf;

use engine::{KvPool, Limits, Options, Request};
use generate::{device_mem_info, SplitMix64};
use load::{RunArgs, SourceArgs, TpArgs};
use model::{AttnBackend, Model};
use serde_json::Value;
use tokenizer::TextTokenizer;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Mode {
    Continuous,
    Static,
    Sequential,
}

/// What the paged K/V pools hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum KvDtype {
    /// The model's dtype.
    Model,
    /// e4m3 with one f32 scale per tensor (`--kv-scale`): half the bytes of bf16 per row.
    Fp8,
}

#[derive(Parser, Debug)]
#[command(
    about = "Continuous batching on a paged KV cache, against static batching and one request at a time"
)]
struct Args {
    #[command(flatten)]
    source: SourceArgs,

    /// Requests as JSON lines: {"prompt": "...", "max_new_tokens": N} (N defaults to
    /// --max-new-tokens). Needs a tokenizer.
    #[arg(long, conflicts_with = "requests")]
    requests_file: Option<PathBuf>,
    /// Generate N requests of random lengths (--prompt-len, --gen-len), seeded by --seed.
    #[arg(long)]
    requests: Option<usize>,
    /// Prompt lengths MIN:MAX (tokens) of generated requests.
    #[arg(long, default_value = "128:2048")]
    prompt_len: String,
    /// New-token counts MIN:MAX of generated requests.
    #[arg(long, default_value = "128:512")]
    gen_len: String,
    /// max_new_tokens of file requests that do not set it.
    #[arg(long, default_value_t = 128)]
    max_new_tokens: usize,
    /// Poisson arrivals at R requests per second (default: all at once).
    #[arg(long)]
    rate: Option<f64>,
    /// Keep generating after an end-of-sequence token (generated loads always do).
    #[arg(long)]
    ignore_eos: bool,
    /// Send file prompts as raw text, without the chat template.
    #[arg(long)]
    no_chat: bool,
    #[arg(long)]
    system: Option<String>,

    /// Which engine to run.
    #[arg(long, value_enum, default_value = "continuous")]
    mode: Mode,
    /// Run all three engines on the same requests and report token agreement with the
    /// one-at-a-time run.
    #[arg(long)]
    compare: bool,
    /// With --compare: give the one-at-a-time engine only the first K requests (it is slow).
    #[arg(long, value_name = "K")]
    sequential_requests: Option<usize>,

    /// Rows per K/V page.
    #[arg(long, default_value_t = 64)]
    page_size: usize,
    /// Element type of the K/V pools (continuous and static batching; one-at-a-time keeps a
    /// dense cache in the model's dtype).
    #[arg(long, value_enum, default_value = "model")]
    kv_dtype: KvDtype,
    /// With `--kv-dtype fp8`: pools hold `x / scale`, saturated to ±448 (vLLM's uncalibrated
    /// default is 1).
    #[arg(long, default_value_t = 1.0)]
    kv_scale: f32,
    /// Pages in the pool (default: --kv-mem-frac of the free GPU memory after loading; on the
    /// CPU, enough for every request at once).
    #[arg(long)]
    kv_pages: Option<usize>,
    /// Fraction of the free device memory given to K/V (pool, or static batching's cache).
    #[arg(long, default_value_t = 0.8)]
    kv_mem_frac: f64,
    /// Most requests running at once (continuous).
    #[arg(long, default_value_t = 256)]
    max_seqs: usize,
    /// Most new tokens per step (continuous; prompts are chunked to fit).
    #[arg(long, default_value_t = 2048)]
    max_batch_tokens: usize,
    /// Static batching's batch size (default: as many as the K/V memory holds at the longest
    /// prompt + generation, at most --max-seqs).
    #[arg(long)]
    static_batch: Option<usize>,
    /// Allow N positions (beyond the trained context for throughput runs).
    #[arg(long)]
    max_positions: Option<usize>,

    #[command(flatten)]
    run: RunArgs,
    #[command(flatten)]
    tp: TpArgs,
    /// One JSON line per request and a summary line on stdout.
    #[arg(long)]
    json: bool,
    /// No per-request output.
    #[arg(long)]
    quiet: bool,
    /// No progress bar.
    #[arg(long)]
    no_progress: bool,
}

fn parse_range(s: &str, what: &str) -> Result<(usize, usize)> {
    let (a, b) = s
        .split_once(':')
        .with_context(|| format!("{what}: expected MIN:MAX, got `{s}`"))?;
    let (a, b): (usize, usize) = (a.trim().parse()?, b.trim().parse()?);
    if a > b {
        bail!("{what}: MIN {a} > MAX {b}")
    }
    Ok((a, b))
}

/// Uniform in `lo..=hi`.
fn range(rng: &mut SplitMix64, (lo, hi): (usize, usize)) -> usize {
    lo + (rng.next_u64() % (hi - lo + 1) as u64) as usize
}

/// Text the generated prompts are cut from (with a tokenizer).
const FILLER: &str =
    "The history of the printing press begins in the fifteenth century, when movable \
type made books cheaper to produce. Within a few decades, presses operated in hundreds of cities, \
and the spread of pamphlets, maps and scientific tables changed how knowledge travelled. Rivers \
carried paper and ink; merchants carried news. ";

fn build_requests(args: &Args, tok: Option<&TextTokenizer>, vocab: usize) -> Result<Vec<Request>> {
    let mut rng = SplitMix64(args.run.seed);
    let mut reqs = Vec::new();
    if let Some(path) = &args.requests_file {
        let tok = tok.context("--requests-file needs a tokenizer (random weights have none)")?;
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        for (n, line) in text
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
        {
            let j: Value = serde_json::from_str(line)
                .with_context(|| format!("{}:{}: not JSON", path.display(), n + 1))?;
            let prompt = j.get("prompt").and_then(Value::as_str).with_context(|| {
                format!("{}:{}: missing string `prompt`", path.display(), n + 1)
            })?;
            let max_new = j
                .get("max_new_tokens")
                .and_then(load::json_usize)
                .unwrap_or(args.max_new_tokens);
            let ids = tok.encode_prompt(prompt, !args.no_chat, args.system.as_deref())?;
            if ids.is_empty() {
                bail!("{}:{}: the prompt is empty", path.display(), n + 1)
            }
            reqs.push(Request {
                id: reqs.len(),
                prompt: ids,
                max_new_tokens: max_new,
                arrival: 0.0,
            });
        }
    } else {
        let n = args
            .requests
            .context("give --requests N (generated load) or --requests-file FILE")?;
        let plen = parse_range(&args.prompt_len, "--prompt-len")?;
        let glen = parse_range(&args.gen_len, "--gen-len")?;
        if plen.0 == 0 {
            bail!("--prompt-len: prompts need at least one token")
        }
        let filler = match tok {
            Some(t) => t.encode(FILLER, false)?,
            None => Vec::new(),
        };
        let lo = (vocab / 8) as u64;
        for id in 0..n {
            let len = range(&mut rng, plen);
            let prompt: Vec<u32> = if filler.is_empty() {
                (0..len)
                    .map(|_| (lo + rng.next_u64() % (vocab as u64 - lo)) as u32)
                    .collect()
            } else {
                let off = range(&mut rng, (0, filler.len() - 1));
                (0..len).map(|i| filler[(off + i) % filler.len()]).collect()
            };
            reqs.push(Request {
                id,
                prompt,
                max_new_tokens: range(&mut rng, glen),
                arrival: 0.0,
            });
        }
    }
    if reqs.is_empty() {
        bail!("no requests")
    }
    if let Some(rate) = args.rate {
        if !(rate > 0.0 && rate.is_finite()) {
            bail!("--rate must be a positive number of requests per second, got {rate}")
        }
        let mut t = 0.0;
        for r in reqs.iter_mut() {
            t += -(1.0 - rng.next_f64()).ln() / rate;
            r.arrival = t;
        }
    }
    Ok(reqs)
}

fn main() -> Result<()> {
    let args = Args::parse();
    args.tp.before_cuda(&args.run);
    let (device, dtype) = args.run.device_and_dtype(args.tp.tp)?;
    let ranks = args.tp.ranks(&args.run, &device)?;
    let source = args.source.source()?;
    let t0 = std::time::Instant::now();
    let loaded = load::load_tp(
        &source,
        args.source.tokenizer.as_deref(),
        dtype,
        &ranks,
        AttnBackend::Flashcore,
    )?;
    let mut model: Model = loaded.model;
    let kv_dtype = match args.kv_dtype {
        KvDtype::Model => dtype,
        KvDtype::Fp8 => {
            model.set_kv_scale(Some(args.kv_scale))?;
            DType::F8E4M3
        }
    };
    if let Some(n) = args.max_positions {
        model.set_max_positions(n)?;
    }
    let tok = loaded.tokenizer.as_ref();
    let cfg = model.config().clone();
    eprintln!(
        "loaded {} in {:.1}s: {} layers, heads {}/{}, head_dim {}, {:.0}M params, {dtype:?} on {:?} (tp {})",
        loaded.description,
        t0.elapsed().as_secs_f64(),
        cfg.num_hidden_layers,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.num_params() as f64 * 1e-6,
        device.location(),
        model.tp(),
    );

    let requests = build_requests(&args, tok, cfg.vocab_size)?;
    let longest = requests
        .iter()
        .map(|r| r.prompt.len() + r.max_new_tokens)
        .max()
        .unwrap_or(0);
    if longest > cfg.max_position_embeddings {
        bail!(
            "a request needs {longest} positions, the model has {} (--max-positions N raises it)",
            cfg.max_position_embeddings
        )
    }
    let opt = Options {
        eos: if args.ignore_eos || args.requests_file.is_none() {
            Vec::new()
        } else {
            tok.map(|t| t.eos_ids.clone()).unwrap_or_default()
        },
        temperature: args.run.temperature,
        top_p: args.run.top_p,
        seed: args.run.seed,
        progress: !args.no_progress,
    };

    // K/V memory: the pool for continuous batching, the dense cache for static batching.
    // Per rank (each holds its share of the K/V heads); rank 0's free memory is the budget (it
    // also holds the LM head, so it has the least).
    let page_bytes = KvPool::page_bytes(&cfg, args.page_size, kv_dtype, model.tp());
    let row_bytes = page_bytes / args.page_size.max(1);
    let kv_budget =
        device_mem_info(&device).map(|(free, _)| (free as f64 * args.kv_mem_frac) as usize);
    let num_pages = match (args.kv_pages, kv_budget) {
        (Some(n), _) => n,
        (None, Some(bytes)) => bytes / page_bytes,
        (None, None) => requests
            .iter()
            .map(|r| (r.prompt.len() + r.max_new_tokens).div_ceil(args.page_size))
            .sum(),
    };
    // Static batching gets the same K/V memory: as many rows of the longest request as fit
    // (without a device memory figure, on the CPU, --max-seqs).
    let static_batch = args.static_batch.unwrap_or_else(|| match kv_budget {
        Some(bytes) => (bytes / (longest * row_bytes).max(1)).clamp(1, args.max_seqs),
        None => args.max_seqs,
    });
    let limits = Limits {
        max_seqs: args.max_seqs,
        max_batch_tokens: args.max_batch_tokens,
    };
    let prompt_tokens: usize = requests.iter().map(|r| r.prompt.len()).sum();
    eprintln!(
        "{} requests, {prompt_tokens} prompt tokens, up to {} new tokens; kv pool {num_pages} pages x {} rows ({:.2} GiB); static batch {static_batch}",
        requests.len(),
        requests.iter().map(|r| r.max_new_tokens).sum::<usize>(),
        args.page_size,
        (num_pages * page_bytes) as f64 / (1u64 << 30) as f64,
    );

    let modes: Vec<Mode> = if args.compare {
        vec![Mode::Continuous, Mode::Static, Mode::Sequential]
    } else {
        vec![args.mode]
    };
    let mut reports = Vec::new();
    for mode in modes {
        let reqs: &[Request] = match (mode, args.sequential_requests) {
            (Mode::Sequential, Some(k)) if args.compare => &requests[..k.min(requests.len())],
            _ => &requests,
        };
        if !device.is_cpu() {
            warm_up(
                &model,
                mode,
                &requests[0],
                &opt,
                &limits,
                args.page_size,
                (dtype, kv_dtype),
                &device,
            )?;
        }
        let r = match mode {
            Mode::Continuous => {
                let mut pool = KvPool::new(&model, num_pages, args.page_size, kv_dtype)?;
                engine::serve_continuous(&model, reqs, &opt, &limits, &mut pool)?
            }
            Mode::Static => engine::serve_static(
                &model,
                reqs,
                &opt,
                static_batch,
                args.max_batch_tokens,
                kv_dtype,
            )?,
            Mode::Sequential => engine::serve_sequential(&model, reqs, &opt, dtype)?,
        };
        report::print_requests(&r, tok, args.json, args.quiet)?;
        reports.push(r);
    }
    let floor = report::Floor::new(&cfg, dtype, kv_dtype, &device);
    report::print_summary(
        &reports,
        &floor,
        &loaded.description,
        dtype,
        &device,
        args.json,
    );
    Ok(())
}

/// Runs `mode` once on a short copy of a request, untimed: kernel loading and library
/// initialisation stay out of the measurement.
#[allow(clippy::too_many_arguments)]
fn warm_up(
    model: &Model,
    mode: Mode,
    first: &Request,
    opt: &Options,
    limits: &Limits,
    page_size: usize,
    (dtype, kv_dtype): (DType, DType),
    device: &Device,
) -> Result<()> {
    let pages = 4 * 64usize.div_ceil(page_size);
    let reqs: Vec<Request> = (0..2)
        .map(|id| Request {
            id,
            prompt: first.prompt[..first.prompt.len().min(24 + id)].to_vec(),
            max_new_tokens: 3,
            arrival: 0.0,
        })
        .collect();
    let quiet = Options {
        progress: false,
        ..opt.clone()
    };
    match mode {
        Mode::Continuous => {
            let mut pool = KvPool::new(model, pages, page_size, kv_dtype)?;
            engine::serve_continuous(model, &reqs, &quiet, limits, &mut pool)?;
        }
        Mode::Static => {
            engine::serve_static(model, &reqs, &quiet, 2, limits.max_batch_tokens, kv_dtype)?;
        }
        Mode::Sequential => {
            engine::serve_sequential(model, &reqs, &quiet, dtype)?;
        }
    }
    device.synchronize()?;
    Ok(())
}
