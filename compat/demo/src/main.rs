//! candle-transformers 0.11.1 models with `use_flash_attn` on and off, where `candle-flash-attn`
//! is flashcore's drop-in (compat/candle-flash-attn, through `[patch.crates-io]`).
//!
//! Each model is built from a real config with few layers and random weights (N(0, 0.02); norm
//! weights at their initial constant), on the CUDA device. For each model: a prompt of random
//! token ids runs through the flash model and the eager model (same weights), then N greedy
//! tokens with the model's KV cache. Reported: max |logit diff| at the prompt's last position
//! (the models return only that one) and at every decode step while both have been fed the
//! same tokens, greedy agreement, prefill and decode tokens/s. The flash and the eager model are
//! timed in alternation, and the median per-repetition ratio flash ÷ eager is reported beside
//! the medians (`paired_*_ratio`). One JSON line per model, then a table.
//!
//! Usage: demo [--models llama,mistral,...] [--prompt 128] [--gen 32] [--layers 2] [--seed 42]
//!             [--reps 5] [--cpu]
//! `--cpu` runs everything on the CPU in f32 (flashcore's CPU path behind the flash calls): a
//! smoke test of the demo itself on a machine without a GPU, not a measurement.

use anyhow::{bail, Context, Result};
use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarBuilder};
use candle_transformers::models::{
    gemma, gemma2, gemma3, gemma4, granite, helium, llama, mistral, mixtral, quantized_phi3, qwen2,
    qwen3, stable_lm,
};
use serde_json::json;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

// ---------------------------------------------------------------------------------------------
// Random weights, the same tensors for every model built from one `RandomWeights`.

/// Weights made on first request and remembered by name, so the flash and the eager model share
/// them. Generated on `gen_dev` in f32 and converted to what the caller asks for.
struct RandomWeights {
    gen_dev: Device,
    std: f64,
    cache: Mutex<HashMap<String, Tensor>>,
}

impl RandomWeights {
    fn new(gen_dev: &Device, std: f64) -> Arc<Self> {
        Arc::new(Self {
            gen_dev: gen_dev.clone(),
            std,
            cache: Mutex::new(HashMap::new()),
        })
    }

    fn make(&self, s: &Shape, name: &str, h: Init) -> candle_core::Result<Tensor> {
        match h {
            // Norm scales and other constants keep their initial value (1 for RmsNorm, 0 for
            // Gemma's `1 + w` norms); every matrix is N(0, std).
            Init::Const(c) if name.contains("norm") || s.rank() == 1 => {
                Tensor::ones(s, DType::F32, &self.gen_dev)?.affine(c, 0.)
            }
            _ => Tensor::randn(0f32, self.std as f32, s, &self.gen_dev),
        }
    }

    fn tensor(&self, s: &Shape, name: &str, h: Init) -> candle_core::Result<Tensor> {
        let mut cache = self.cache.lock().unwrap();
        if let Some(t) = cache.get(name) {
            if t.shape() != s {
                candle_core::bail!("{name}: asked for {s:?}, made as {:?}", t.shape())
            }
            return Ok(t.clone());
        }
        let t = self.make(s, name, h)?;
        cache.insert(name.to_string(), t.clone());
        Ok(t)
    }
}

/// A `SimpleBackend` view of shared random weights.
struct Shared(Arc<RandomWeights>);

impl SimpleBackend for Shared {
    fn get(
        &self,
        s: Shape,
        name: &str,
        h: Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        self.0.tensor(&s, name, h)?.to_device(dev)?.to_dtype(dtype)
    }
    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> candle_core::Result<Tensor> {
        candle_core::bail!("random weights: {name} requested without a shape")
    }
    fn contains_tensor(&self, _: &str) -> bool {
        true
    }
}

fn var_builder(w: &Arc<RandomWeights>, dtype: DType, dev: &Device) -> VarBuilder<'static> {
    VarBuilder::from_backend(Box::new(Shared(w.clone())), dtype, dev.clone())
}

// ---------------------------------------------------------------------------------------------
// The models behind one interface.

trait Lm {
    /// Logits of the last position of `ids` (1, seq), fed at position `pos`, as f32 (vocab,).
    fn step(&mut self, ids: &Tensor, pos: usize) -> Result<Tensor>;
    fn reset(&mut self) -> Result<()>;
}

struct Llama {
    model: llama::Llama,
    cfg: llama::Config,
    cache: llama::Cache,
    dtype: DType,
    dev: Device,
}
impl Lm for Llama {
    fn step(&mut self, ids: &Tensor, pos: usize) -> Result<Tensor> {
        Ok(self
            .model
            .forward(ids, pos, &mut self.cache)?
            .flatten_all()?)
    }
    fn reset(&mut self) -> Result<()> {
        self.cache = llama::Cache::new(true, self.dtype, &self.cfg, &self.dev)?;
        Ok(())
    }
}

struct Granite {
    model: granite::Granite,
    cfg: granite::Config,
    cache: granite::Cache,
    dtype: DType,
    dev: Device,
}
impl Lm for Granite {
    fn step(&mut self, ids: &Tensor, pos: usize) -> Result<Tensor> {
        Ok(self
            .model
            .forward(ids, pos, &mut self.cache)?
            .flatten_all()?)
    }
    fn reset(&mut self) -> Result<()> {
        self.cache = granite::Cache::new(true, self.dtype, &self.cfg, &self.dev)?;
        Ok(())
    }
}

/// A model without a KV-cache reset (mixtral, stable_lm): `reset` builds it again from the
/// shared weights (the same tensors, converted to the model's dtype again), outside the timed
/// region.
struct Rebuilt<M> {
    make: Box<dyn Fn() -> Result<M>>,
    model: M,
    forward: fn(&mut M, &Tensor, usize) -> candle_core::Result<Tensor>,
}
impl<M> Rebuilt<M> {
    fn new(
        make: Box<dyn Fn() -> Result<M>>,
        forward: fn(&mut M, &Tensor, usize) -> candle_core::Result<Tensor>,
    ) -> Result<Self> {
        let model = make()?;
        Ok(Self {
            make,
            model,
            forward,
        })
    }
}
impl<M> Lm for Rebuilt<M> {
    fn step(&mut self, ids: &Tensor, pos: usize) -> Result<Tensor> {
        Ok((self.forward)(&mut self.model, ids, pos)?
            .flatten_all()?
            .to_dtype(DType::F32)?)
    }
    fn reset(&mut self) -> Result<()> {
        self.model = (self.make)()?;
        Ok(())
    }
}

macro_rules! cached_model {
    ($name:ident, $ty:ty) => {
        struct $name($ty);
        impl Lm for $name {
            fn step(&mut self, ids: &Tensor, pos: usize) -> Result<Tensor> {
                Ok(self
                    .0
                    .forward(ids, pos)?
                    .flatten_all()?
                    .to_dtype(DType::F32)?)
            }
            fn reset(&mut self) -> Result<()> {
                self.0.clear_kv_cache();
                Ok(())
            }
        }
    };
}
cached_model!(Mistral, mistral::Model);
cached_model!(Gemma, gemma::Model);
cached_model!(Gemma2, gemma2::Model);
cached_model!(Helium, helium::Model);
cached_model!(Gemma3, gemma3::Model);
cached_model!(Gemma4, gemma4::text::TextModel);
cached_model!(Qwen2, qwen2::ModelForCausalLM);
cached_model!(Qwen3, qwen3::ModelForCausalLM);

/// quantized_phi3 resets its KV cache whenever a forward starts at position 0.
struct Phi3(quantized_phi3::ModelWeights);
impl Lm for Phi3 {
    fn step(&mut self, ids: &Tensor, pos: usize) -> Result<Tensor> {
        Ok(self.0.forward(ids, pos)?.flatten_all()?)
    }
    fn reset(&mut self) -> Result<()> {
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Configs (real ones, with `layers` layers).

fn llama_cfg(layers: usize) -> Result<llama::LlamaConfig> {
    // meta-llama/Meta-Llama-3-8B
    Ok(serde_json::from_value(json!({
        "hidden_size": 4096, "intermediate_size": 14336, "vocab_size": 128256,
        "num_hidden_layers": layers, "num_attention_heads": 32, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "bos_token_id": 128000,
        "eos_token_id": 128001, "max_position_embeddings": 8192, "tie_word_embeddings": false
    }))?)
}

fn mistral_cfg(layers: usize, flash: bool, sliding_window: usize) -> mistral::Config {
    // mistralai/Mistral-7B-v0.1 (sliding window 4096)
    let mut c = mistral::Config::config_7b_v0_1(flash);
    c.num_hidden_layers = layers;
    c.sliding_window = Some(sliding_window);
    c
}

fn granite_cfg(layers: usize) -> Result<granite::GraniteConfig> {
    // IBM Granite 3.x 8B (granite-3.3-8b's config.json): 4096 hidden, 32/8 heads, d128. candle's
    // granite has no attention/embedding/residual multipliers or logits scaling (both of its
    // paths alike).
    Ok(serde_json::from_value(json!({
        "hidden_size": 4096, "intermediate_size": 12800, "vocab_size": 49159,
        "num_hidden_layers": layers, "num_attention_heads": 32, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5, "rope_theta": 10000000.0, "bos_token_id": 0, "eos_token_id": 0,
        "rope_scaling": null, "max_position_embeddings": 131072
    }))?)
}

fn mixtral_cfg(layers: usize, flash: bool) -> Result<mixtral::Config> {
    // mistralai/Mixtral-8x7B-v0.1 (candle's v0_1_8x7b preset, whose fields are crate-private:
    // built from JSON to set the layer count): 8 experts, 2 per token, 32/8 heads, d128
    Ok(serde_json::from_value(json!({
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": layers, "num_attention_heads": 32, "num_key_value_heads": 8,
        "hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
        "rope_theta": 1e6, "sliding_window": 4096, "num_experts_per_tok": 2,
        "num_local_experts": 8, "use_flash_attn": flash
    }))?)
}

fn stable_lm_cfg(layers: usize, flash: bool) -> Result<stable_lm::Config> {
    // stabilityai/stablelm-3b-4e1t (candle's preset, from JSON for the layer count): 32 heads
    // of d80, a quarter of each rotated
    Ok(serde_json::from_value(json!({
        "vocab_size": 50304, "intermediate_size": 6912, "hidden_size": 2560,
        "num_hidden_layers": layers, "num_attention_heads": 32, "num_key_value_heads": 32,
        "hidden_act": "silu", "partial_rotary_factor": 0.25, "rope_theta": 10000.0,
        "max_position_embeddings": 4096, "layer_norm_eps": 1e-5, "use_cache": true,
        "use_flash_attn": flash
    }))?)
}

fn gemma_cfg(layers: usize) -> Result<gemma::Config> {
    // google/gemma-7b: head_dim 256, 16 heads (no GQA)
    Ok(serde_json::from_value(json!({
        "attention_bias": false, "head_dim": 256, "hidden_act": "gelu", "hidden_size": 3072,
        "intermediate_size": 24576, "num_attention_heads": 16, "num_hidden_layers": layers,
        "num_key_value_heads": 16, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "vocab_size": 256000, "max_position_embeddings": 8192
    }))?)
}

fn gemma2_cfg(layers: usize) -> Result<gemma2::Config> {
    // google/gemma-2-9b: head_dim 256, attention softcap 50, final softcap 30
    Ok(serde_json::from_value(json!({
        "attention_bias": false, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 3584, "intermediate_size": 14336, "num_attention_heads": 16,
        "num_hidden_layers": layers, "num_key_value_heads": 8, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "vocab_size": 256000, "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0, "query_pre_attn_scalar": 256, "sliding_window": 4096,
        "max_position_embeddings": 8192
    }))?)
}

fn gemma3_cfg(layers: usize) -> Result<gemma3::Config> {
    // google/gemma-3-4b-it's text_config: d256, 8/4 heads, five sliding-window (1024) layers per
    // global one. candle's gemma3 has no `rope_scaling` (linear 8 on the global layers) and makes
    // layer i sliding iff (i + 1) % 6 > 0, so the first five layers are sliding ones.
    // max_position_embeddings: 131072 published; 32768 here bounds the KV cache candle
    // preallocates for a global layer (the demo's prompts are far shorter).
    Ok(serde_json::from_value(json!({
        "attention_bias": false, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 2560, "intermediate_size": 10240, "num_attention_heads": 8,
        "num_hidden_layers": layers, "num_key_value_heads": 4, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "vocab_size": 262208,
        "final_logit_softcapping": null, "attn_logit_softcapping": null,
        "query_pre_attn_scalar": 256, "sliding_window": 1024, "sliding_window_pattern": 6,
        "max_position_embeddings": 32768
    }))?)
}

/// Gemma 4's layer kinds for `layers` layers: the published 5:1 pattern (layer i global iff
/// (i + 1) % 6 == 0), with the last layer global as in the published configs (60 layers end on
/// a global one), so any layer count runs a d512 global layer (1 layer: only that one).
fn gemma4_layer_types(layers: usize) -> Vec<&'static str> {
    (0..layers)
        .map(|i| {
            if (i + 1) % 6 == 0 || i + 1 == layers {
                "full_attention"
            } else {
                "sliding_attention"
            }
        })
        .collect()
}

fn gemma4_cfg(layers: usize, flash: bool) -> Result<gemma4::Gemma4TextConfig> {
    // google/gemma-4-31B's text_config (the dense model, which candle's gemma4 text decoder
    // matches: no per-layer embeddings, MoE or KV sharing): sliding layers d256 with 32/16
    // heads and a 1024 window, global layers d512 with 32/4 heads (num_global_key_value_heads),
    // final softcap 30. candle's decoder has no `attention_k_eq_v` (the global layers' V is K in
    // the checkpoint; here v_proj has its own random weights). max_position_embeddings: 262144
    // published; 32768 here bounds the preallocated KV cache of the global layers.
    Ok(serde_json::from_value(json!({
        "attention_bias": false, "head_dim": 256, "global_head_dim": 512,
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 5376,
        "intermediate_size": 21504, "num_attention_heads": 32, "num_hidden_layers": layers,
        "num_key_value_heads": 16, "num_global_key_value_heads": 4, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "vocab_size": 262144, "sliding_window": 1024,
        "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 256,
        "max_position_embeddings": 32768, "tie_word_embeddings": true,
        "layer_types": gemma4_layer_types(layers),
        "rope_parameters": {
            "full_attention": {"rope_theta": 1000000.0, "rope_type": "proportional",
                               "partial_rotary_factor": 0.25},
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}
        },
        "use_flash_attn": flash
    }))?)
}

fn qwen2_cfg(layers: usize) -> Result<qwen2::Config> {
    // Qwen/Qwen2-7B
    Ok(serde_json::from_value(json!({
        "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
        "num_hidden_layers": layers, "num_attention_heads": 28, "num_key_value_heads": 4,
        "max_position_embeddings": 32768, "sliding_window": 131072, "max_window_layers": 28,
        "tie_word_embeddings": false, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "use_sliding_window": false, "hidden_act": "silu"
    }))?)
}

fn qwen3_cfg(layers: usize) -> Result<qwen3::Config> {
    // Qwen/Qwen3-1.7B
    Ok(serde_json::from_value(json!({
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
        "num_hidden_layers": layers, "num_attention_heads": 16, "head_dim": 128,
        "attention_bias": false, "num_key_value_heads": 8, "max_position_embeddings": 40960,
        "sliding_window": null, "max_window_layers": 28, "tie_word_embeddings": true,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "use_sliding_window": false,
        "hidden_act": "silu"
    }))?)
}

/// microsoft/Phi-3-mini-4k-instruct as an in-memory GGUF (f16 tensors) for quantized_phi3, the
/// Phi-3 model of candle-transformers that has a flash-attn path (phi3.rs has none).
fn phi3_gguf(layers: usize, w: &RandomWeights) -> Result<Vec<u8>> {
    let (hidden, ffn, vocab, heads) = (3072usize, 8192usize, 32064usize, 32u32);
    let mut shapes: Vec<(String, Vec<usize>)> = vec![
        ("token_embd.weight".into(), vec![vocab, hidden]),
        ("output_norm.weight".into(), vec![hidden]),
        ("output.weight".into(), vec![vocab, hidden]),
    ];
    for l in 0..layers {
        let p = format!("blk.{l}");
        shapes.extend([
            (format!("{p}.attn_qkv.weight"), vec![3 * hidden, hidden]),
            (format!("{p}.attn_output.weight"), vec![hidden, hidden]),
            (format!("{p}.ffn_up.weight"), vec![2 * ffn, hidden]),
            (format!("{p}.ffn_down.weight"), vec![hidden, ffn]),
            (format!("{p}.attn_norm.weight"), vec![hidden]),
            (format!("{p}.ffn_norm.weight"), vec![hidden]),
        ]);
    }
    let mut tensors = Vec::new();
    for (name, shape) in &shapes {
        let s = Shape::from(shape.clone());
        let t = if shape.len() == 1 {
            w.tensor(&s, name, Init::Const(1.))?
        } else {
            w.tensor(
                &s,
                name,
                Init::Randn {
                    mean: 0.,
                    stdev: w.std,
                },
            )?
        };
        let q = QTensor::quantize(&t.to_device(&Device::Cpu)?, GgmlDType::F16)?;
        tensors.push((name.clone(), q));
    }
    use gguf_file::Value as V;
    let md: Vec<(&str, V)> = vec![
        ("phi3.attention.head_count", V::U32(heads)),
        ("phi3.attention.head_count_kv", V::U32(heads)),
        ("phi3.block_count", V::U32(layers as u32)),
        ("phi3.embedding_length", V::U32(hidden as u32)),
        ("phi3.context_length", V::U32(4096)),
        ("phi3.feed_forward_length", V::U32(ffn as u32)),
        ("phi3.rope.dimension_count", V::U32(hidden as u32 / heads)),
        ("phi3.attention.layer_norm_rms_epsilon", V::F32(1e-5)),
    ];
    let md_refs: Vec<(&str, &V)> = md.iter().map(|(k, v)| (*k, v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut buf = std::io::Cursor::new(Vec::new());
    gguf_file::write(&mut buf, &md_refs, &t_refs)?;
    Ok(buf.into_inner())
}

fn phi3_model(gguf: &[u8], flash: bool, dev: &Device) -> Result<Phi3> {
    let mut r = std::io::Cursor::new(gguf);
    let ct = gguf_file::Content::read(&mut r)?;
    Ok(Phi3(quantized_phi3::ModelWeights::from_gguf(
        flash, ct, &mut r, dev,
    )?))
}

// ---------------------------------------------------------------------------------------------
// The measurement.

struct Run {
    /// Prompt's last-position logits.
    prefill_logits: Vec<f32>,
    /// Logits after each generated token was fed (teacher-forced comparison is only valid while
    /// both runs have generated the same tokens).
    step_logits: Vec<Vec<f32>>,
    tokens: Vec<u32>,
    prefill_tok_s: f64,
    decode_tok_s: f64,
}

fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best as u32
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// One timed prefill of `prompt` and greedy decode of `gen` tokens after it: (prefill seconds,
/// decode seconds, prompt logits, step logits, tokens).
type Timed = (f64, f64, Vec<f32>, Vec<Vec<f32>>, Vec<u32>);

fn timed(m: &mut dyn Lm, prompt: &[u32], gen: usize, dev: &Device) -> Result<Timed> {
    let ids = Tensor::new(prompt, dev)?.unsqueeze(0)?;
    m.reset()?;
    dev.synchronize()?;
    let t0 = Instant::now();
    let logits = m.step(&ids, 0)?.to_vec1::<f32>()?;
    let prefill = t0.elapsed().as_secs_f64();
    let mut tok = argmax(&logits);
    let mut tokens = vec![tok];
    let mut step_logits = Vec::new();
    dev.synchronize()?;
    let t1 = Instant::now();
    for i in 0..gen.saturating_sub(1) {
        let x = Tensor::new(&[tok], dev)?.unsqueeze(0)?;
        let l = m.step(&x, prompt.len() + i)?.to_vec1::<f32>()?;
        tok = argmax(&l);
        tokens.push(tok);
        step_logits.push(l);
    }
    Ok((
        prefill,
        t1.elapsed().as_secs_f64(),
        logits,
        step_logits,
        tokens,
    ))
}

fn to_run(t: Vec<Timed>, prompt: usize, gen: usize) -> Result<Run> {
    let prefill_s: Vec<f64> = t.iter().map(|x| x.0).collect();
    let decode_s: Vec<f64> = t.iter().map(|x| x.1).collect();
    let (_, _, prefill_logits, step_logits, tokens) =
        t.into_iter().last().context("no timed run")?;
    Ok(Run {
        prefill_logits,
        step_logits,
        tokens,
        prefill_tok_s: prompt as f64 / median(prefill_s),
        decode_tok_s: (gen.saturating_sub(1)) as f64 / median(decode_s).max(1e-9),
    })
}

/// Warm-up (module loads, cuBLAS handles, allocator), then `reps` timed runs of the prefill and
/// of the greedy decode after it; tokens/s from the median times. The logits and tokens are the
/// last run's (every run computes the same ones).
fn run(m: &mut dyn Lm, prompt: &[u32], gen: usize, reps: usize, dev: &Device) -> Result<Run> {
    timed(m, prompt, 2, dev)?;
    let t = (0..reps.max(1))
        .map(|_| timed(m, prompt, gen, dev))
        .collect::<Result<Vec<_>>>()?;
    to_run(t, prompt.len(), gen)
}

/// The `[flash, eager]` pair of models timed in alternation (flash first on even repetitions,
/// eager first on odd ones), so that drift of the GPU's or the host's clocks during the call
/// reaches both alike; with the median over repetitions of the paired ratios flash ÷ eager
/// tokens/s (prefill, decode).
fn pair(
    mut ms: Vec<Box<dyn Lm>>,
    prompt: &[u32],
    gen: usize,
    reps: usize,
    dev: &Device,
) -> Result<Paired> {
    let (a, b) = ms.split_at_mut(1);
    let (flash, eager) = (a[0].as_mut(), b[0].as_mut());
    timed(flash, prompt, 2, dev)?;
    timed(eager, prompt, 2, dev)?;
    let (mut tf, mut te) = (Vec::new(), Vec::new());
    for r in 0..reps.max(1) {
        if r % 2 == 0 {
            tf.push(timed(flash, prompt, gen, dev)?);
            te.push(timed(eager, prompt, gen, dev)?);
        } else {
            te.push(timed(eager, prompt, gen, dev)?);
            tf.push(timed(flash, prompt, gen, dev)?);
        }
    }
    let paired = |secs: fn(&Timed) -> f64| {
        median(tf.iter().zip(&te).map(|(f, e)| secs(e) / secs(f)).collect())
    };
    let ratios = Some((paired(|t| t.0), paired(|t| t.1)));
    Ok(Paired {
        flash: to_run(tf, prompt.len(), gen)?,
        eager: to_run(te, prompt.len(), gen)?,
        ratios,
    })
}

/// A flash run and an eager run of one model, with the paired ratios when they alternated.
struct Paired {
    flash: Run,
    eager: Run,
    ratios: Option<(f64, f64)>,
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - *y as f64).abs())
        .fold(0f64, f64::max)
}

fn max_abs(a: &[f32]) -> f64 {
    a.iter().map(|x| (*x as f64).abs()).fold(0f64, f64::max)
}

struct Report {
    json: serde_json::Value,
    row: String,
}

#[allow(clippy::too_many_arguments)]
fn compare(
    model: &str,
    what: &str,
    dtype: &str,
    runs: &Paired,
    eager_where: &str,
    note: &str,
) -> Report {
    let (flash, eager) = (&runs.flash, &runs.eager);
    let prefill_diff = max_abs_diff(&flash.prefill_logits, &eager.prefill_logits);
    let first_div = flash
        .tokens
        .iter()
        .zip(&eager.tokens)
        .position(|(a, b)| a != b);
    let agree_prefix = first_div.unwrap_or(flash.tokens.len());
    let same = flash
        .tokens
        .iter()
        .zip(&eager.tokens)
        .filter(|(a, b)| a == b)
        .count();
    // Step i's logits follow token i; both runs fed identical inputs while tokens 0..=i agree.
    let steps_same_input = agree_prefix.min(flash.step_logits.len());
    let decode_diff = (0..steps_same_input)
        .map(|i| max_abs_diff(&flash.step_logits[i], &eager.step_logits[i]))
        .fold(0f64, f64::max);
    let json = json!({
        "model": model,
        "config": what,
        "dtype": dtype,
        "eager": eager_where,
        "logits_max_abs": max_abs(&eager.prefill_logits),
        "prefill_last_pos_max_abs_logit_diff": prefill_diff,
        "decode_steps_compared": steps_same_input,
        "decode_max_abs_logit_diff": (steps_same_input > 0).then_some(decode_diff),
        "greedy_tokens": flash.tokens.len(),
        "greedy_same_prefix": agree_prefix,
        "greedy_same_total": same,
        "flash_prefill_tok_s": flash.prefill_tok_s,
        "eager_prefill_tok_s": eager.prefill_tok_s,
        "flash_decode_tok_s": flash.decode_tok_s,
        "eager_decode_tok_s": eager.decode_tok_s,
        "paired_prefill_ratio": runs.ratios.map(|r| r.0),
        "paired_decode_ratio": runs.ratios.map(|r| r.1),
        "note": note,
    });
    let decode_cell = if steps_same_input > 0 {
        format!("{decode_diff:.3e}")
    } else {
        "-".into()
    };
    let paired = |i: usize| match runs.ratios {
        Some(r) => format!("{:.3}", if i == 0 { r.0 } else { r.1 }),
        None => "-".into(),
    };
    let row = format!(
        "| {model} | {prefill_diff:.3e} | {decode_cell} | {agree_prefix}/{} | {:.0} | {:.0} | {} | {:.1} | {:.1} | {} |",
        flash.tokens.len(),
        flash.prefill_tok_s,
        eager.prefill_tok_s,
        paired(0),
        flash.decode_tok_s,
        eager.decode_tok_s,
        paired(1)
    );
    Report { json, row }
}

/// Every model the demo runs (`--models`' default).
const DEMO_MODELS: &str =
    "llama,mistral,mistral-sw32,mixtral,gemma,gemma2,gemma3,gemma4,granite,helium,stable_lm,phi3,qwen2,qwen3";

/// The 20 files of candle-transformers 0.11.1 that call `candle_flash_attn` (all of them only
/// `flash_attn(q, k, v, scale, causal)`): the demo entry that runs each, or why none does.
const COVERAGE: [(&str, &str, &str); 20] = [
    ("gemma.rs", "gemma", ""),
    ("gemma2.rs", "gemma2", ""),
    ("gemma3.rs", "gemma3", ""),
    ("gemma4/text.rs", "gemma4", ""),
    ("granite.rs", "granite", ""),
    ("granitemoehybrid.rs", "", "hybrid Mamba-2 + attention MoE LLM: not wired into the demo yet"),
    ("helium.rs", "helium", ""),
    ("lfm2.rs", "", "hybrid short-convolution + attention LLM: not wired into the demo yet"),
    ("llama.rs", "llama", ""),
    ("mimi/transformer.rs", "", "audio codec (the transformer inside Mimi's encoder/decoder): needs the codec's convolution stack and audio input, not set up"),
    ("mistral.rs", "mistral", ""),
    ("mixtral.rs", "mixtral", ""),
    ("mmdit/blocks.rs", "", "diffusion transformer (Stable Diffusion 3's MMDiT; latents, timestep and text-encoder conditioning): too big to set up here"),
    ("quantized_phi3.rs", "phi3", ""),
    ("qwen3.rs", "qwen3", ""),
    ("stable_diffusion/attention.rs", "", "diffusion UNet's attention blocks (needs the UNet, VAE and text encoder): too big to set up here"),
    ("stable_lm.rs", "stable_lm", ""),
    ("voxtral/voxtral_llama.rs", "", "audio LLM (Voxtral's decoder behind its audio encoder): not set up"),
    ("wuerstchen/attention_processor.rs", "", "diffusion (Wuerstchen's prior/decoder attention): too big to set up here"),
    ("z_image/transformer.rs", "", "diffusion transformer (Z-Image): too big to set up here"),
];

struct Args {
    models: Vec<String>,
    prompt: usize,
    gen: usize,
    layers: usize,
    seed: u64,
    cpu: bool,
    /// Timed repetitions of the prefill and of the decode run (median).
    reps: usize,
}

fn parse_args() -> Result<Args> {
    let mut a = Args {
        models: DEMO_MODELS.split(',').map(String::from).collect(),
        prompt: 128,
        gen: 32,
        layers: 2,
        seed: 42,
        cpu: false,
        reps: 5,
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < argv.len() {
        if argv[i] == "--cpu" {
            a.cpu = true;
            i += 1;
            continue;
        }
        let val = argv.get(i + 1).context("missing value")?;
        match argv[i].as_str() {
            "--models" => a.models = val.split(',').map(String::from).collect(),
            "--prompt" => a.prompt = val.parse()?,
            "--gen" => a.gen = val.parse()?,
            "--layers" => a.layers = val.parse()?,
            "--seed" => a.seed = val.parse()?,
            "--reps" => a.reps = val.parse::<usize>()?.max(1),
            other => bail!(
                "unknown argument {other} (--models, --prompt, --gen, --layers, --seed, --reps, --cpu)"
            ),
        }
        i += 2;
    }
    Ok(a)
}

fn prompt_ids(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 33) % vocab as u64) as u32
        })
        .collect()
}

fn main() -> Result<()> {
    let args = parse_args()?;
    let (dev, dtype) = if args.cpu {
        (Device::Cpu, DType::F32)
    } else {
        let dev = Device::new_cuda(0).context("the demo needs a CUDA device (or --cpu)")?;
        (dev, DType::BF16)
    };
    let dt = if args.cpu { "f32 (--cpu)" } else { "bf16" };
    let here = if args.cpu { "cpu" } else { "gpu" };
    let std = 0.02;
    let (p, g, nl) = (args.prompt, args.gen, args.layers);
    let mut reports = Vec::new();
    let mut failed: Vec<(String, String)> = Vec::new();
    for name in &args.models {
        if !args.cpu {
            dev.set_seed(args.seed)?;
        }
        let w = RandomWeights::new(&dev, std);
        let t0 = Instant::now();
        // One model's failure (a model file's own bug, say) is reported and the others still run.
        let result = (|| -> Result<Report> {
            Ok(match name.as_str() {
                "llama" => {
                    let lc = llama_cfg(nl)?;
                    let prompt = prompt_ids(p, lc.vocab_size, args.seed);
                    let mut ms: Vec<Box<dyn Lm>> = Vec::new();
                    for flash in [true, false] {
                        let cfg = lc.clone().into_config(flash);
                        let model = llama::Llama::load(var_builder(&w, dtype, &dev), &cfg)?;
                        let cache = llama::Cache::new(true, dtype, &cfg, &dev)?;
                        let m = Llama {
                            model,
                            cfg,
                            cache,
                            dtype,
                            dev: dev.clone(),
                        };
                        ms.push(Box::new(m));
                    }
                    let runs = pair(ms, &prompt, g, args.reps, &dev)?;
                    let what = format!("Llama-3-8B, {nl} layers, 32/8 heads (GQA), d128");
                    compare("llama", &what, dt, &runs, here, "")
                }
                "mistral" | "mistral-sw32" => {
                    let sw = if name == "mistral" { 4096 } else { 32 };
                    let prompt = prompt_ids(p, 32000, args.seed);
                    let mut ms: Vec<Box<dyn Lm>> = Vec::new();
                    for flash in [true, false] {
                        let cfg = mistral_cfg(nl, flash, sw);
                        let m = mistral::Model::new(&cfg, var_builder(&w, dtype, &dev))?;
                        ms.push(Box::new(Mistral(m)));
                    }
                    let runs = pair(ms, &prompt, g, args.reps, &dev)?;
                    let what = format!(
                        "Mistral-7B-v0.1, {nl} layers, 32/8 heads, d128, sliding_window {sw}"
                    );
                    let note = if sw < p {
                        "candle-transformers' mistral passes only `causal` to flash_attn (no window) while its eager prefill masks the window: the difference is the model code's, not the kernel's"
                    } else {
                        "window longer than the prompt: both paths are plain causal"
                    };
                    compare(name, &what, dt, &runs, here, note)
                }
                "gemma2" => {
                    let cfg = gemma2_cfg(nl)?;
                    let prompt = prompt_ids(p, cfg.vocab_size, args.seed);
                    let mut ms: Vec<Box<dyn Lm>> = Vec::new();
                    for flash in [true, false] {
                        let m = gemma2::Model::new(flash, &cfg, var_builder(&w, dtype, &dev))?;
                        ms.push(Box::new(Gemma2(m)));
                    }
                    let runs = pair(ms, &prompt, g, args.reps, &dev)?;
                    let what = format!("Gemma-2-9B, {nl} layers, 16/8 heads, d256, softcap 50");
                    compare(
                    "gemma2",
                    &what,
                    dt,
                    &runs,
                    here,
                    "candle-transformers' gemma2 calls flash_attn without the attention softcap (eager applies it)",
                )
                }
                "gemma" => {
                    let cfg = gemma_cfg(nl)?;
                    let prompt = prompt_ids(p, cfg.vocab_size, args.seed);
                    let mut ms: Vec<Box<dyn Lm>> = Vec::new();
                    for flash in [true, false] {
                        let m = gemma::Model::new(flash, &cfg, var_builder(&w, dtype, &dev))?;
                        ms.push(Box::new(Gemma(m)));
                    }
                    let runs = pair(ms, &prompt, g, args.reps, &dev)?;
                    let what = format!("Gemma-7B, {nl} layers, 16 heads, d256");
                    compare("gemma", &what, dt, &runs, here, "")
                }
                "granite" => {
                    let gc = granite_cfg(nl)?;
                    let prompt = prompt_ids(p, gc.vocab_size, args.seed);
                    let mut ms: Vec<Box<dyn Lm>> = Vec::new();
                    for flash in [true, false] {
                        let cfg = gc.clone().into_config(flash);
                        let model = granite::Granite::load(var_builder(&w, dtype, &dev), &cfg)?;
                        let cache = granite::Cache::new(true, dtype, &cfg, &dev)?;
                        ms.push(Box::new(Granite {
                            model,
                            cfg,
                            cache,
                            dtype,
                            dev: dev.clone(),
                        }));
                    }
                    let runs = pair(ms, &prompt, g, args.reps, &dev)?;
                    let what = format!("Granite-3.x-8B, {nl} layers, 32/8 heads, d128");
                    compare("granite", &what, dt, &runs, here, "")
                }
                "mixtral" | "stable_lm" => {
                    let vocab = if name == "mixtral" { 32000 } else { 50304 };
                    let prompt = prompt_ids(p, vocab, args.seed);
                    let mut ms: Vec<Box<dyn Lm>> = Vec::new();
                    for flash in [true, false] {
                        let (w, dev) = (w.clone(), dev.clone());
                        if name == "mixtral" {
                            let cfg = mixtral_cfg(nl, flash)?;
                            let make = move || -> Result<mixtral::Model> {
                                Ok(mixtral::Model::new(&cfg, var_builder(&w, dtype, &dev))?)
                            };
                            ms.push(Box::new(Rebuilt::new(Box::new(make), |m, x, p| {
                                m.forward(x, p)
                            })?));
                        } else {
                            let cfg = stable_lm_cfg(nl, flash)?;
                            let make = move || -> Result<stable_lm::Model> {
                                Ok(stable_lm::Model::new(&cfg, var_builder(&w, dtype, &dev))?)
                            };
                            ms.push(Box::new(Rebuilt::new(Box::new(make), |m, x, p| {
                                m.forward(x, p)
                            })?));
                        }
                    }
                    let runs = pair(ms, &prompt, g, args.reps, &dev)?;
                    let what = if name == "mixtral" {
                        format!(
                            "Mixtral-8x7B, {nl} layers, 8 experts (2 per token), 32/8 heads, d128"
                        )
                    } else {
                        format!("StableLM-3B-4E1T, {nl} layers, 32 heads, d80")
                    };
                    compare(
                    name,
                    &what,
                    dt,
                    &runs,
                    here,
                    "no KV-cache reset in the model: rebuilt from the same weights before each run (untimed)",
                )
                }
                "helium" => {
                    let prompt = prompt_ids(p, 48000, args.seed);
                    let mut ms: Vec<Box<dyn Lm>> = Vec::new();
                    for flash in [true, false] {
                        // kyutai/helium-1-preview-2b (candle's config_2b)
                        let mut cfg = helium::Config::config_2b(flash);
                        cfg.num_hidden_layers = nl;
                        let m = helium::Model::new(&cfg, var_builder(&w, dtype, &dev))?;
                        ms.push(Box::new(Helium(m)));
                    }
                    let runs = pair(ms, &prompt, g, args.reps, &dev)?;
                    let what = format!("Helium-1-preview-2B, {nl} layers, 20 heads, d128");
                    compare("helium", &what, dt, &runs, here, "")
                }
                "gemma3" => {
                    // candle-transformers 0.11.1's gemma3 cannot run its global layers (every sixth):
                    // their KvCache::append slice-sets a non-contiguous V (the transposed v_proj
                    // output) and fails before attention, flash or eager. So at most the five
                    // sliding layers before the first global one.
                    let nl = nl.min(5);
                    let cfg = gemma3_cfg(nl)?;
                    let prompt = prompt_ids(p, cfg.vocab_size, args.seed);
                    let mut ms: Vec<Box<dyn Lm>> = Vec::new();
                    for flash in [true, false] {
                        let m = gemma3::Model::new(flash, &cfg, var_builder(&w, dtype, &dev))?;
                        ms.push(Box::new(Gemma3(m)));
                    }
                    let runs = pair(ms, &prompt, g, args.reps, &dev)?;
                    let what = format!(
                    "Gemma-3-4B, {nl} sliding layers (the model's global layers fail in its KV cache), 8/4 heads, d256, sliding_window 1024"
                );
                    let note = if p > 1024 {
                        "prompt longer than the window: candle-transformers' gemma3 passes only `causal` to flash_attn on its sliding layers while its eager path masks the window, so the two differ by the model code"
                    } else {
                        "window longer than the prompt: sliding and global layers are plain causal on both paths"
                    };
                    compare("gemma3", &what, dt, &runs, here, note)
                }
                "gemma4" => {
                    let prompt = prompt_ids(p, 262144, args.seed);
                    let mut ms: Vec<Box<dyn Lm>> = Vec::new();
                    for flash in [true, false] {
                        let cfg = gemma4_cfg(nl, flash)?;
                        let m = gemma4::text::TextModel::new(&cfg, var_builder(&w, dtype, &dev))?;
                        ms.push(Box::new(Gemma4(m)));
                    }
                    let runs = pair(ms, &prompt, g, args.reps, &dev)?;
                    let kinds = gemma4_layer_types(nl);
                    let global = kinds.iter().filter(|k| **k == "full_attention").count();
                    let what = format!(
                    "Gemma-4-31B, {nl} layers: {} sliding (32/16 heads, d256, window 1024) + {global} global (32/4 heads, d512)",
                    nl - global
                );
                    let mut note = String::from(
                    "global layers at d512 run the drop-in's slow path on a GPU (candle ops; flashcore's kernels stop at 256)",
                );
                    if p > 1024 {
                        note.push_str("; prompt longer than the window: the model passes only `causal` to flash_attn on its sliding layers while its eager path masks the window");
                    }
                    compare("gemma4", &what, dt, &runs, here, &note)
                }
                "phi3" => {
                    let gguf = phi3_gguf(nl, &w)?;
                    let prompt = prompt_ids(p, 32064, args.seed);
                    let mut ms: Vec<Box<dyn Lm>> = Vec::new();
                    for flash in [true, false] {
                        let m = phi3_model(&gguf, flash, &dev)?;
                        ms.push(Box::new(m));
                    }
                    let runs = pair(ms, &prompt, g, args.reps, &dev)?;
                    let what = format!(
                        "Phi-3-mini-4k (quantized_phi3, f16 GGUF), {nl} layers, 32 heads, d96"
                    );
                    compare(
                    "phi3",
                    &what,
                    "f32 (flash path casts q/k/v to bf16)",
                    &runs,
                    here,
                    "phi3.rs has no flash path; quantized_phi3.rs is candle-transformers' Phi-3 with use_flash_attn",
                )
                }
                "qwen2" => {
                    // qwen2.rs never calls candle_flash_attn: eager only.
                    let cfg = qwen2_cfg(nl)?;
                    let prompt = prompt_ids(p, cfg.vocab_size, args.seed);
                    let m = qwen2::ModelForCausalLM::new(&cfg, var_builder(&w, dtype, &dev))?;
                    let r = run(&mut Qwen2(m), &prompt, g, args.reps, &dev)?;
                    let json = json!({
                        "model": "qwen2",
                        "config": format!("Qwen2-7B, {nl} layers, 28/4 heads, d128"),
                        "dtype": dt,
                        "flash": null,
                        "eager_prefill_tok_s": r.prefill_tok_s,
                        "eager_decode_tok_s": r.decode_tok_s,
                        "note": "candle-transformers 0.11.1 qwen2.rs has no flash-attn path (no use_flash_attn); see qwen3",
                    });
                    let row = format!(
                        "| qwen2 (no flash path) | - | - | - | - | {:.0} | - | - | {:.1} | - |",
                        r.prefill_tok_s, r.decode_tok_s
                    );
                    Report { json, row }
                }
                "qwen3" => {
                    // With the flash-attn feature, qwen3.rs always takes flash_attn on a GPU and its
                    // matmul path on the CPU: the eager reference runs on the CPU in f32.
                    let cfg = qwen3_cfg(nl)?;
                    let prompt = prompt_ids(p, cfg.vocab_size, args.seed);
                    let m = qwen3::ModelForCausalLM::new(&cfg, var_builder(&w, dtype, &dev))?;
                    let flash = run(&mut Qwen3(m), &prompt, g, args.reps, &dev)?;
                    let cpu = Device::Cpu;
                    let m = qwen3::ModelForCausalLM::new(&cfg, var_builder(&w, DType::F32, &cpu))?;
                    let eager = run(&mut Qwen3(m), &prompt, g, 1, &cpu)?; // the CPU: one run
                    let what = format!("Qwen3-1.7B, {nl} layers, 16/8 heads, d128");
                    compare(
                    "qwen3",
                    &what,
                    "bf16 (flash, GPU) vs f32 (eager, CPU)",
                    &Paired {
                        flash,
                        eager,
                        ratios: None,
                    },
                    "cpu-f32",
                    "qwen3.rs has no use_flash_attn switch: flash on GPU whenever the feature is on; the diff includes bf16 vs f32 rounding, eager tok/s is the CPU's",
                )
                }
                other => bail!("unknown model {other} (one of {DEMO_MODELS})"),
            })
        })();
        let report = match result {
            Ok(r) => r,
            Err(e) => {
                let msg = format!("{e}").lines().next().unwrap_or("").to_string();
                println!("{}", json!({"model": name, "error": msg}));
                failed.push((name.clone(), msg));
                continue;
            }
        };
        let mut json = report.json;
        json["seconds"] = json!(t0.elapsed().as_secs_f64());
        json["prompt_tokens"] = json!(p);
        println!("{json}");
        reports.push(report.row);
    }
    println!();
    println!(
        "prompt {p} random tokens, {g} greedy tokens, {nl} layers, random weights N(0, {std}); diffs are max |logit diff| flash vs eager"
    );
    println!("| model | prefill diff | decode diff | greedy same prefix | flash prefill tok/s | eager prefill tok/s | paired prefill ratio | flash decode tok/s | eager decode tok/s | paired decode ratio |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for r in reports {
        println!("{r}");
    }
    println!();
    println!("The 20 candle-transformers 0.11.1 models that call candle_flash_attn:");
    println!("| model file | demo entry | ran in this call |");
    println!("|---|---|---|");
    for (file, entry, why) in COVERAGE {
        let ran = if entry.is_empty() {
            format!("no: {why}")
        } else if let Some((_, e)) = failed.iter().find(|(m, _)| m == entry) {
            format!("failed: {e}")
        } else if args.models.iter().any(|m| m == entry) {
            "yes".to_string()
        } else {
            "no: not in --models".to_string()
        };
        let entry = if entry.is_empty() { "-" } else { entry };
        println!("| {file} | {entry} | {ran} |");
    }
    if !failed.is_empty() {
        bail!("{} model(s) failed: {:?}", failed.len(), failed);
    }
    Ok(())
}
