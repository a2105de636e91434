//! The decoding loop (prefill, then one token at a time into the KV cache), sampling, timing,
//! and the two backend comparisons: free-running greedy generations, and teacher-forced top-1
//! agreement on a fixed continuation.

use anyhow::Result;
use candle_core::{Device, Tensor};
use std::time::{Duration, Instant};

use crate::model::{argmax_rows, AttnBackend, KvCache, Model};

/// splitmix64: a tiny, seedable generator (reproducible runs without a `rand` dependency).
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Greedy when `temperature <= 0`; otherwise softmax(logits / temperature) restricted to the
/// smallest set of tokens whose probability reaches `top_p` (nucleus sampling).
pub struct Sampler {
    temperature: f64,
    top_p: f64,
    rng: SplitMix64,
}

impl Sampler {
    pub fn greedy() -> Sampler {
        Sampler {
            temperature: 0.0,
            top_p: 1.0,
            rng: SplitMix64(0),
        }
    }

    pub fn new(temperature: f64, top_p: f64, seed: u64) -> Sampler {
        Sampler {
            temperature,
            top_p: top_p.clamp(0.0, 1.0),
            rng: SplitMix64(seed),
        }
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0
    }

    /// Picks the next token from `(1, vocab)` f32 logits.
    pub fn sample(&mut self, logits: &Tensor) -> Result<u32> {
        if self.is_greedy() {
            return Ok(argmax_rows(logits)?[0]);
        }
        let logits: Vec<f32> = logits.flatten_all()?.to_vec1()?;
        let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
        let mut probs: Vec<(u32, f64)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, ((l as f64 - max) / self.temperature).exp()))
            .collect();
        let total: f64 = probs.iter().map(|p| p.1).sum();
        probs.sort_unstable_by(|a, b| b.1.total_cmp(&a.1));
        let mut kept = 0.0;
        let mut n = 0;
        for p in &probs {
            kept += p.1 / total;
            n += 1;
            if kept >= self.top_p {
                break;
            }
        }
        let mass: f64 = probs[..n].iter().map(|p| p.1).sum();
        let mut r = self.rng.next_f64() * mass;
        for p in &probs[..n] {
            r -= p.1;
            if r <= 0.0 {
                return Ok(p.0);
            }
        }
        Ok(probs[n - 1].0)
    }
}

/// Device memory in use (total minus free, so it includes the allocator's pool and any other
/// process on the GPU); `None` on CPU or when the query fails.
pub fn device_mem_used(device: &Device) -> Option<usize> {
    device_mem_info(device).map(|(free, total)| total - free)
}

/// (free, total) device memory in bytes; `None` on CPU or when the query fails.
pub fn device_mem_info(device: &Device) -> Option<(usize, usize)> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(cuda) = device {
        return cuda.cuda_stream().context().mem_get_info().ok();
    }
    let _ = device;
    None
}

#[derive(Clone, Debug, Default)]
pub struct GenStats {
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    /// From the start of the prefill to the first sampled token on the host.
    pub ttft: Duration,
    /// From the first token to the last (the first token is not counted).
    pub decode_time: Duration,
    /// Largest [`device_mem_used`] seen after prefill and after decoding.
    pub peak_mem: Option<usize>,
    pub hit_eos: bool,
    /// Time rank 0 spent in all-reduces while decoding (tensor parallelism with
    /// `--time-allreduce`; 0 otherwise).
    pub decode_allreduce: Duration,
}

impl GenStats {
    pub fn prefill_tok_s(&self) -> f64 {
        self.prompt_tokens as f64 / self.ttft.as_secs_f64()
    }

    /// Tokens per second after the first; `None` with fewer than two tokens.
    pub fn decode_tok_s(&self) -> Option<f64> {
        (self.generated_tokens > 1)
            .then(|| (self.generated_tokens - 1) as f64 / self.decode_time.as_secs_f64())
    }
}

pub struct Generation {
    pub tokens: Vec<u32>,
    pub stats: GenStats,
}

/// Prefills `prompt` and generates up to `max_new_tokens`, stopping after a token in `eos_ids`
/// (which is kept). `on_token` sees each token as soon as it is sampled. The cache is reset first.
pub fn generate(
    model: &Model,
    cache: &mut KvCache,
    prompt: &[u32],
    max_new_tokens: usize,
    eos_ids: &[u32],
    sampler: &mut Sampler,
    on_token: &mut dyn FnMut(u32) -> Result<()>,
) -> Result<Generation> {
    anyhow::ensure!(!prompt.is_empty(), "empty prompt");
    let device = cache.device();
    cache.reset();
    let mut stats = GenStats {
        prompt_tokens: prompt.len(),
        ..Default::default()
    };
    let mut tokens = Vec::with_capacity(max_new_tokens);
    if max_new_tokens == 0 {
        return Ok(Generation { tokens, stats });
    }
    device.synchronize()?;
    let start = Instant::now();
    let input = Tensor::new(prompt, &device)?.unsqueeze(0)?;
    let logits = model.forward_last(&input, cache)?;
    let mut next = sampler.sample(&logits)?; // copies to the host, so the device has finished
    stats.ttft = start.elapsed();
    stats.peak_mem = device_mem_used(&device);
    model.allreduce_ms()?; // the decode's share starts here
    let decode_start = Instant::now();
    loop {
        tokens.push(next);
        on_token(next)?;
        if eos_ids.contains(&next) {
            stats.hit_eos = true;
            break;
        }
        if tokens.len() >= max_new_tokens {
            break;
        }
        let input = Tensor::new(&[next], &device)?.unsqueeze(0)?;
        let logits = model.forward_last(&input, cache)?;
        next = sampler.sample(&logits)?;
    }
    stats.decode_time = decode_start.elapsed();
    stats.decode_allreduce = Duration::from_secs_f64(model.allreduce_ms()? * 1e-3);
    stats.generated_tokens = tokens.len();
    stats.peak_mem = stats.peak_mem.max(device_mem_used(&device));
    Ok(Generation { tokens, stats })
}

/// One short prefill and one decode step with the model's current backend, then a cache reset:
/// on a GPU this takes kernel loading and library initialisation out of the timed run.
pub fn warmup(model: &Model, cache: &mut KvCache, prompt: &[u32]) -> Result<()> {
    let device = cache.device();
    cache.reset();
    let head = &prompt[..prompt.len().min(16)];
    model.forward_last(&Tensor::new(head, &device)?.unsqueeze(0)?, cache)?;
    model.forward_last(&Tensor::new(&head[..1], &device)?.unsqueeze(0)?, cache)?;
    device.synchronize()?;
    cache.reset();
    Ok(())
}

/// Number of leading positions where two token sequences agree.
pub fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[derive(Clone, Debug)]
pub struct Agreement {
    /// Predictions compared: one after the prompt and one after each forced token but the last.
    pub positions: usize,
    /// Positions where the two backends' argmax agree, feeding tokens one at a time (decode).
    pub decode_agree: usize,
    /// The same with prompt and continuation in one forward pass (prefill).
    pub prefill_agree: usize,
    /// Largest |logit_eager - logit_flashcore| over all compared positions and vocabulary.
    pub max_abs_logit_diff: f32,
}

/// Top-1 agreement between eager and flashcore attention, teacher-forced on `continuation`
/// (normally eager's own greedy continuation of `prompt`). The model's backend is restored.
pub fn teacher_forced_agreement(
    model: &mut Model,
    cache: &mut KvCache,
    prompt: &[u32],
    continuation: &[u32],
) -> Result<Agreement> {
    anyhow::ensure!(
        !prompt.is_empty() && !continuation.is_empty(),
        "need a prompt and a continuation"
    );
    let device = cache.device();
    let n = continuation.len();
    let saved = model.attn;
    let mut decode_logits = Vec::new();
    let mut prefill_logits = Vec::new();
    for backend in [AttnBackend::Eager, AttnBackend::Flashcore] {
        model.attn = backend;
        // Decode: prompt, then each forced token on its own.
        decode_logits.push(forced_logits(model, cache, prompt, continuation)?); // (n, vocab)
                                                                                // Prefill: everything in one pass; keep the last n positions.
        cache.reset();
        let all: Vec<u32> = prompt
            .iter()
            .chain(&continuation[..n - 1])
            .copied()
            .collect();
        let logits = model
            .forward_all(&Tensor::new(all.as_slice(), &device)?.unsqueeze(0)?, cache)?
            .squeeze(0)?;
        prefill_logits.push(logits.narrow(0, prompt.len() - 1, n)?);
    }
    model.attn = saved;
    let agree = |a: &Tensor, b: &Tensor| -> Result<usize> {
        let (x, y) = (argmax_rows(a)?, argmax_rows(b)?);
        Ok(x.iter().zip(&y).filter(|(p, q)| p == q).count())
    };
    let max_diff = |a: &Tensor, b: &Tensor| -> Result<f32> {
        Ok((a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?)
    };
    Ok(Agreement {
        positions: n,
        decode_agree: agree(&decode_logits[0], &decode_logits[1])?,
        prefill_agree: agree(&prefill_logits[0], &prefill_logits[1])?,
        max_abs_logit_diff: max_diff(&decode_logits[0], &decode_logits[1])?
            .max(max_diff(&prefill_logits[0], &prefill_logits[1])?),
    })
}

/// Logits `(n, vocab)` f32 on the host after `prompt` and after each of the first `n - 1`
/// tokens of `continuation`, fed one at a time (decode), with the model's current backend.
pub fn forced_logits(
    model: &Model,
    cache: &mut KvCache,
    prompt: &[u32],
    continuation: &[u32],
) -> Result<Tensor> {
    anyhow::ensure!(
        !prompt.is_empty() && !continuation.is_empty(),
        "need a prompt and a continuation"
    );
    let device = cache.device();
    cache.reset();
    let n = continuation.len();
    let mut rows = vec![model.forward_last(&Tensor::new(prompt, &device)?.unsqueeze(0)?, cache)?];
    for &t in &continuation[..n - 1] {
        rows.push(model.forward_last(&Tensor::new(&[t], &device)?.unsqueeze(0)?, cache)?);
    }
    Ok(Tensor::cat(&rows, 0)?.to_device(&Device::Cpu)?)
}
