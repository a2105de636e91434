//! LLaMA-family text generation with eager (candle ops) or flashcore attention.
//!
//! ```text
//! # a hub checkpoint (hf-hub cache; offline once cached)
//! cargo run --release --example llama -- --model HuggingFaceTB/SmolLM2-135M-Instruct --prompt "What is 2+2?"
//! # a GGUF file, both backends side by side, on the CPU
//! cargo run --release --example llama -- --gguf "$(scripts/fetch-smollm2.sh)" --cpu --compare
//! # throughput at Llama 3 8B shapes, random weights, 4k-token synthetic prompt (CUDA build)
//! cargo run --release --features cuda --example llama -- --random-weights --preset llama3-8b \
//!     --prompt-len 4096 --max-new-tokens 128 --json
//! # tensor parallelism over GPUs 0 and 1 (NCCL loaded at run time, see nccl.rs)
//! cargo run --release --features cuda --example llama -- --random-weights --preset llama3-70b \
//!     --tp 2 --prompt-len 4096 --max-new-tokens 64 --json
//! ```
//! Streaming text goes to stdout, progress and the report to stderr; with `--json` stdout holds
//! exactly one JSON line.

mod generate;
mod load;
#[allow(dead_code)] // also examples/serve's model: its paged batches are unused here
mod model;
#[cfg(feature = "cuda")]
mod nccl;
mod tokenizer;
mod tp;

use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};
use clap::{Parser, ValueEnum};
use std::io::Write;

use generate::{
    common_prefix, forced_logits, generate, teacher_forced_agreement, warmup, GenStats, Generation,
    Sampler,
};
use load::{Ranks, RunArgs, SourceArgs, TpArgs};
use model::{AttnBackend, KvCache, Model};
use serde_json::json;
use tokenizer::TextTokenizer;

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Attn {
    Eager,
    Flashcore,
}

#[derive(Parser, Debug)]
#[command(about = "LLaMA-family generation with eager or flashcore attention")]
struct Args {
    #[command(flatten)]
    source: SourceArgs,

    /// Attention implementation.
    #[arg(long, value_enum, default_value = "flashcore")]
    attn: Attn,
    /// Run eager and flashcore on the same prompt; print both outputs and how many tokens agree.
    #[arg(long)]
    compare: bool,
    /// Teacher-forced top-1 agreement over N tokens of eager's greedy continuation (EOS
    /// ignored), decoding and in one pass; takes precedence over --compare.
    #[arg(long, value_name = "N")]
    agreement: Option<usize>,

    /// The user message (sent through the chat template when the tokenizer has one).
    #[arg(long, default_value = "What is the capital of France?")]
    prompt: String,
    /// Use a synthetic prompt of exactly N tokens instead of --prompt.
    #[arg(long, value_name = "N")]
    prompt_len: Option<usize>,
    /// Upper bound on generated tokens (generation also stops at an end-of-turn token).
    #[arg(long, default_value_t = 64)]
    max_new_tokens: usize,
    /// Keep generating after an end-of-sequence token (fixed-length throughput runs).
    #[arg(long)]
    ignore_eos: bool,
    /// Send --prompt as is, without the tokenizer's chat template.
    #[arg(long)]
    no_chat: bool,
    /// System message for the chat template.
    #[arg(long)]
    system: Option<String>,

    /// Allow N positions (prompt + new tokens), beyond the model's trained context if larger:
    /// for throughput runs at long prompts (quality past the trained context is not the point).
    #[arg(long, value_name = "N")]
    max_positions: Option<usize>,

    #[command(flatten)]
    run: RunArgs,
    #[command(flatten)]
    tp: TpArgs,
    /// With --tp N > 1: generate N tokens greedily on one GPU, then feed the same tokens to the
    /// N-GPU model, and report where their argmax agrees and the largest logit difference.
    #[arg(long, value_name = "TOKENS", requires = "tp")]
    compare_tp: Option<usize>,
    /// Print one machine-readable JSON line on stdout (and no streamed text).
    #[arg(long)]
    json: bool,
}

impl From<Attn> for AttnBackend {
    fn from(a: Attn) -> AttnBackend {
        match a {
            Attn::Eager => AttnBackend::Eager,
            Attn::Flashcore => AttnBackend::Flashcore,
        }
    }
}

/// A fixed English paragraph, repeated to build `--prompt-len` prompts when there is a tokenizer.
const FILLER: &str =
    "The history of the printing press begins in the fifteenth century, when movable \
type made books cheaper to produce. Within a few decades, presses operated in hundreds of cities, \
and the spread of pamphlets, maps and scientific tables changed how knowledge travelled. ";

/// Exactly `n` prompt tokens: the filler text tokenized and repeated, or (without a tokenizer)
/// pseudo-random ids from the upper part of the vocabulary.
fn synthetic_prompt(
    n: usize,
    tok: Option<&TextTokenizer>,
    vocab: usize,
    seed: u64,
) -> Result<Vec<u32>> {
    if let Some(tok) = tok {
        let mut ids = tok.encode("", true)?; // BOS when the tokenizer adds one
        let filler = tok.encode(FILLER, false)?;
        anyhow::ensure!(!filler.is_empty(), "filler text tokenized to nothing");
        while ids.len() < n {
            ids.extend_from_slice(&filler[..filler.len().min(n - ids.len())]);
        }
        ids.truncate(n);
        return Ok(ids);
    }
    let lo = (vocab / 8) as u64;
    let mut state = seed;
    Ok((0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (lo + (state >> 33) % (vocab as u64 - lo)) as u32
        })
        .collect())
}

fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        DType::F32 => "f32",
        _ => "other",
    }
}

fn device_name(d: &Device) -> String {
    match d {
        Device::Cpu => "cpu".into(),
        other => format!("{:?}", other.location()).to_lowercase(),
    }
}

fn fmt_mem(m: Option<usize>) -> String {
    m.map(|b| format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64))
        .unwrap_or_else(|| "n/a".into())
}

fn stats_json(backend: AttnBackend, g: &Generation, text: Option<&str>) -> String {
    let s = &g.stats;
    let opt = |x: Option<f64>| {
        x.map(|v| format!("{v:.3}"))
            .unwrap_or_else(|| "null".into())
    };
    let mut out = format!(
        "{{\"attn\":{},\"prompt_tokens\":{},\"generated_tokens\":{},\"ttft_ms\":{:.3},\"prefill_tok_s\":{:.3},\"decode_tok_s\":{},\"peak_mem_bytes\":{},\"hit_eos\":{},\"tokens\":{:?}",
        json!(backend.name()),
        s.prompt_tokens,
        s.generated_tokens,
        s.ttft.as_secs_f64() * 1e3,
        s.prefill_tok_s(),
        opt(s.decode_tok_s()),
        s.peak_mem.map(|m| m.to_string()).unwrap_or_else(|| "null".into()),
        s.hit_eos,
        g.tokens,
    );
    if !s.decode_allreduce.is_zero() {
        out += &format!(
            ",\"decode_allreduce_ms\":{:.3},\"decode_ms\":{:.3}",
            s.decode_allreduce.as_secs_f64() * 1e3,
            s.decode_time.as_secs_f64() * 1e3
        );
    }
    if let Some(t) = text {
        out += &format!(",\"text\":{}", json!(t));
    }
    out + "}"
}

fn report(backend: AttnBackend, s: &GenStats) {
    eprintln!(
        "[{}] prompt tokens      {}",
        backend.name(),
        s.prompt_tokens
    );
    eprintln!(
        "[{}] generated tokens   {}{}",
        backend.name(),
        s.generated_tokens,
        if s.hit_eos { " (stopped at EOS)" } else { "" }
    );
    eprintln!(
        "[{}] time to 1st token  {:.1} ms",
        backend.name(),
        s.ttft.as_secs_f64() * 1e3
    );
    eprintln!(
        "[{}] prefill            {:.1} tok/s",
        backend.name(),
        s.prefill_tok_s()
    );
    match s.decode_tok_s() {
        Some(r) => eprintln!(
            "[{}] decode             {:.2} tok/s (excluding the first token)",
            backend.name(),
            r
        ),
        None => eprintln!(
            "[{}] decode             n/a (fewer than 2 tokens)",
            backend.name()
        ),
    }
    if !s.decode_allreduce.is_zero() {
        eprintln!(
            "[{}] all-reduce share   {:.1}% of decoding (rank 0, CUDA events)",
            backend.name(),
            100.0 * s.decode_allreduce.as_secs_f64() / s.decode_time.as_secs_f64()
        );
    }
    eprintln!(
        "[{}] device memory      {} (max sampled after prefill and at the end)",
        backend.name(),
        fmt_mem(s.peak_mem)
    );
}

struct Run<'a> {
    model: &'a mut Model,
    cache: KvCache,
    tok: Option<&'a TextTokenizer>,
    prompt: Vec<u32>,
    eos: Vec<u32>,
    args: &'a Args,
}

impl Run<'_> {
    /// One generation with `backend`, streaming text to stdout unless `--json`.
    fn generate(
        &mut self,
        backend: AttnBackend,
        stream: bool,
    ) -> Result<(Generation, Option<String>)> {
        self.model.attn = backend;
        if !self.cache.device().is_cpu() {
            warmup(self.model, &mut self.cache, &self.prompt)?;
        }
        let mut sampler = if self.args.run.temperature > 0.0 {
            Sampler::new(
                self.args.run.temperature,
                self.args.run.top_p,
                self.args.run.seed,
            )
        } else {
            Sampler::greedy()
        };
        let mut decoder = self.tok.map(|t| t.inner.decode_stream(true));
        let mut on_token = |id: u32| -> Result<()> {
            if stream {
                let mut out = std::io::stdout().lock();
                match decoder.as_mut() {
                    Some(d) => {
                        if let Some(piece) = d.step(id).map_err(anyhow::Error::msg)? {
                            write!(out, "{piece}")?;
                        }
                    }
                    None => write!(out, "{id} ")?,
                }
                out.flush()?;
            }
            Ok(())
        };
        let g = generate(
            self.model,
            &mut self.cache,
            &self.prompt,
            self.args.max_new_tokens,
            &self.eos,
            &mut sampler,
            &mut on_token,
        )?;
        if stream {
            println!();
        }
        let text = match self.tok {
            Some(t) => Some(t.decode(&g.tokens)?),
            None => None,
        };
        Ok((g, text))
    }
}

/// Loads the model over `ranks` and applies `--max-positions`.
fn load_model(args: &Args, dtype: DType, ranks: &Ranks) -> Result<load::Loaded> {
    let t0 = std::time::Instant::now();
    let mut loaded = load::load_tp(
        &args.source.source()?,
        args.source.tokenizer.as_deref(),
        dtype,
        ranks,
        args.attn.into(),
    )?;
    if let Some(n) = args.max_positions {
        loaded.model.set_max_positions(n)?;
    }
    let cfg = loaded.model.config();
    eprintln!(
        "loaded {} in {:.1}s: {} layers, hidden {}, heads {}/{} (q/kv), head_dim {}, vocab {}, {:.0}M params; {} on {}{}",
        loaded.description,
        t0.elapsed().as_secs_f64(),
        cfg.num_hidden_layers,
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.vocab_size,
        cfg.num_params() as f64 * 1e-6,
        dtype_name(dtype),
        device_name(&ranks.devices[0]),
        match ranks.devices.len() {
            1 => String::new(),
            n => format!(" and {} more (tensor parallel)", n - 1),
        },
    );
    Ok(loaded)
}

/// The run's prompt tokens: `--prompt-len` synthetic ones or the encoded `--prompt`.
fn build_prompt(args: &Args, tok: Option<&TextTokenizer>, vocab: usize) -> Result<Vec<u32>> {
    let prompt = match (args.prompt_len, tok) {
        (Some(n), t) => synthetic_prompt(n, t, vocab, args.run.seed)?,
        (None, Some(t)) => t.encode_prompt(&args.prompt, !args.no_chat, args.system.as_deref())?,
        (None, None) => {
            bail!("no tokenizer (random weights): use --prompt-len N for a synthetic prompt")
        }
    };
    anyhow::ensure!(!prompt.is_empty(), "the prompt is empty");
    Ok(prompt)
}

/// `--compare-tp N`: one-GPU greedy tokens and logits against the `--tp` model fed the same
/// tokens (teacher-forced, so every position is compared even after a disagreement).
fn compare_tp(args: &Args, n: usize, device: &Device, dtype: DType, ranks: Ranks) -> Result<()> {
    anyhow::ensure!(n > 0, "--compare-tp needs N > 0");
    let positions = |model: &Model, len: usize| -> Result<usize> {
        let max = len + n;
        if max > model.config().max_position_embeddings {
            bail!("prompt + {n} tokens exceed the model's positions (--max-positions N)")
        }
        Ok(max)
    };
    let one = load_model(args, dtype, &Ranks::one(device))?;
    let prompt = build_prompt(args, one.tokenizer.as_ref(), one.model.config().vocab_size)?;
    let mut cache = KvCache::new(&one.model, 1, positions(&one.model, prompt.len())?, dtype)?;
    let mut greedy = Sampler::greedy();
    let reference = generate(
        &one.model,
        &mut cache,
        &prompt,
        n,
        &[],
        &mut greedy,
        &mut |_| Ok(()),
    )?;
    let ref_logits =
        forced_logits(&one.model, &mut cache, &prompt, &reference.tokens)?.to_dtype(DType::F32)?;
    drop((cache, one));
    // In bf16/f16, the rounding of one GPU's model is the yardstick: the same model in f32, fed
    // the same tokens, against both the one-GPU and the N-GPU logits.
    let exact = if dtype == DType::F32 {
        None
    } else {
        let mut m = load_model(args, DType::F32, &Ranks::one(device))?;
        // The GPU kernels take f16/bf16 only: the f32 yardstick runs eager attention.
        m.model.attn = AttnBackend::Eager;
        let mut cache = KvCache::new(&m.model, 1, positions(&m.model, prompt.len())?, DType::F32)?;
        Some(forced_logits(
            &m.model,
            &mut cache,
            &prompt,
            &reference.tokens,
        )?)
    };
    let tp = load_model(args, dtype, &ranks)?;
    let mut cache = KvCache::new(&tp.model, 1, positions(&tp.model, prompt.len())?, dtype)?;
    let tp_logits =
        forced_logits(&tp.model, &mut cache, &prompt, &reference.tokens)?.to_dtype(DType::F32)?;
    let agree = |x: &Tensor, y: &Tensor| -> Result<usize> {
        let (a, b) = (model::argmax_rows(x)?, model::argmax_rows(y)?);
        Ok(a.iter().zip(&b).filter(|(x, y)| x == y).count())
    };
    let max_abs =
        |t: &Tensor| -> Result<f32> { Ok(t.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?) };
    let same = agree(&ref_logits, &tp_logits)?;
    let diff = max_abs(&(&ref_logits - &tp_logits)?)?;
    let scale = max_abs(&ref_logits)?;
    let yardstick = match &exact {
        None => String::new(),
        Some(e) => format!(
            ",\"f32_one_max_abs_diff\":{},\"f32_tp_max_abs_diff\":{},\"f32_one_argmax_agree\":{},\"f32_tp_argmax_agree\":{}",
            max_abs(&(e - &ref_logits)?)?,
            max_abs(&(e - &tp_logits)?)?,
            agree(e, &ref_logits)?,
            agree(e, &tp_logits)?,
        ),
    };
    let tp_n = tp.model.tp();
    println!(
        "{{\"mode\":\"compare_tp\",\"model\":{},\"dtype\":\"{}\",\"tp\":{tp_n},\"prompt_tokens\":{},\"positions\":{n},\"argmax_agree\":{same},\"greedy_tokens_equal\":{},\"max_abs_logit_diff\":{diff},\"max_abs_logit\":{scale}{yardstick}}}",
        json!(&tp.description),
        dtype_name(dtype),
        prompt.len(),
        same == n,
    );
    Ok(())
}

fn main() -> Result<()> {
    let args = Args::parse();
    args.tp.before_cuda(&args.run);
    let (device, dtype) = args.run.device_and_dtype(args.tp.tp)?;
    let ranks = args.tp.ranks(&args.run, &device)?;
    if let Some(n) = args.compare_tp {
        anyhow::ensure!(args.tp.tp > 1, "--compare-tp needs --tp N > 1");
        return compare_tp(&args, n, &device, dtype, ranks);
    }
    let attn: AttnBackend = args.attn.into();
    let loaded = load_model(&args, dtype, &ranks)?;
    let mut model = loaded.model;
    let tok = loaded.tokenizer.as_ref();
    let cfg = model.config().clone();
    let prompt = build_prompt(&args, tok, cfg.vocab_size)?;
    let eos: Vec<u32> = if args.ignore_eos || tok.is_none() {
        vec![]
    } else {
        tok.map(|t| t.eos_ids.clone()).unwrap_or_default()
    };
    let extra = args.max_new_tokens.max(args.agreement.unwrap_or(0));
    let max_seq = prompt.len() + extra;
    if max_seq > cfg.max_position_embeddings {
        bail!(
            "prompt ({}) + new tokens ({extra}) exceed the model's {} positions (--max-positions N raises it)",
            prompt.len(),
            cfg.max_position_embeddings
        )
    }
    let cache = KvCache::new(&model, 1, max_seq, dtype)?;
    eprintln!(
        "prompt: {} tokens; kv cache: {} positions",
        prompt.len(),
        max_seq
    );

    let mut run = Run {
        model: &mut model,
        cache,
        tok,
        prompt,
        eos,
        args: &args,
    };
    let stream = !args.json;

    if let Some(n) = args.agreement {
        anyhow::ensure!(n > 0, "--agreement needs N > 0");
        // Eager's greedy continuation, EOS ignored so that there are exactly N positions.
        run.model.attn = AttnBackend::Eager;
        let reference = generate(
            run.model,
            &mut run.cache,
            &run.prompt,
            n,
            &[],
            &mut Sampler::greedy(),
            &mut |_| Ok(()),
        )?;
        let a =
            teacher_forced_agreement(run.model, &mut run.cache, &run.prompt, &reference.tokens)?;
        let frac = |k: usize| k as f64 / a.positions as f64;
        if args.json {
            println!(
                "{{\"mode\":\"agreement\",\"model\":{},\"dtype\":\"{}\",\"device\":{},\"prompt_tokens\":{},\"positions\":{},\"decode_agree\":{:.6},\"prefill_agree\":{:.6},\"max_abs_logit_diff\":{}}}",
                json!(&loaded.description),
                dtype_name(dtype),
                json!(&device_name(&device)),
                run.prompt.len(),
                a.positions,
                frac(a.decode_agree),
                frac(a.prefill_agree),
                a.max_abs_logit_diff,
            );
        } else {
            if let Some(t) = tok {
                println!(
                    "continuation (eager, greedy): {:?}",
                    t.decode(&reference.tokens)?
                );
            }
            println!(
                "teacher-forced top-1 agreement over {} positions:",
                a.positions
            );
            println!(
                "  decode  (one token per step): {}/{} = {:.4}",
                a.decode_agree,
                a.positions,
                frac(a.decode_agree)
            );
            println!(
                "  prefill (one pass):           {}/{} = {:.4}",
                a.prefill_agree,
                a.positions,
                frac(a.prefill_agree)
            );
            println!(
                "  max |logit diff|:             {:.4e}",
                a.max_abs_logit_diff
            );
        }
        return Ok(());
    }

    if args.compare {
        let mut results = Vec::new();
        for backend in [AttnBackend::Eager, AttnBackend::Flashcore] {
            if stream {
                println!("--- {} ---", backend.name());
            }
            let (g, text) = run.generate(backend, stream)?;
            report(backend, &g.stats);
            results.push((backend, g, text));
        }
        let (a, b) = (&results[0].1.tokens, &results[1].1.tokens);
        let agree = common_prefix(a, b);
        let compared = a.len().max(b.len());
        if args.json {
            println!(
                "{{\"mode\":\"compare\",\"model\":{},\"dtype\":\"{}\",\"device\":{},\"agree_tokens\":{agree},\"compared_tokens\":{compared},\"eager\":{},\"flashcore\":{}}}",
                json!(&loaded.description),
                dtype_name(dtype),
                json!(&device_name(&device)),
                stats_json(results[0].0, &results[0].1, results[0].2.as_deref()),
                stats_json(results[1].0, &results[1].1, results[1].2.as_deref()),
            );
        } else {
            let kind = if args.run.temperature > 0.0 {
                "sampled"
            } else {
                "greedy"
            };
            println!(
                "{kind} tokens agreeing (common prefix): {agree}/{compared}{}",
                if a == b { " (identical)" } else { "" }
            );
        }
        return Ok(());
    }

    let (g, text) = run.generate(attn, stream)?;
    report(attn, &g.stats);
    if args.json {
        println!(
            "{{\"mode\":\"generate\",\"model\":{},\"dtype\":\"{}\",\"device\":{},\"result\":{}}}",
            json!(&loaded.description),
            dtype_name(dtype),
            json!(&device_name(&device)),
            stats_json(attn, &g, text.as_deref()),
        );
    }
    Ok(())
}
