//! A LLaMA-family decoder (Llama 2/3, TinyLlama, SmolLM2; Qwen2-style checkpoints with or without
//! q/k/v biases) written against candle ops, with attention behind one function, [`attend`], that
//! either composes candle ops (`eager`) or makes one `flashcore::attention` call (`flashcore`).
//!
//! Activations stay in the `(batch, seq, heads, head_dim)` layout that flashcore takes, so the
//! fused path needs no transposes and no copies: new keys/values are written in place into a
//! preallocated [`KvCache`] and attention reads `cache.narrow(1, 0, len)` directly. Rotary
//! embeddings use the Hugging Face "half split" convention (dimension `i` rotates with `i + d/2`);
//! GGUF checkpoints, whose Q/K rows llama.cpp stores interleaved, are un-permuted at load time
//! (see `load.rs`), so one rotary implementation serves every format.

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::{Embedding, Linear, VarBuilder};

use crate::load::json_usize;
use crate::tp::{on_ranks, AllReduce, Shard};
use serde_json::Value;
use std::sync::Arc;

/// Which attention implementation the decoder calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnBackend {
    /// candle ops: `q k^T` matmul, causal mask, softmax (in f32), matmul with `v`; K/V repeated
    /// for grouped-query attention, as candle's own llama does.
    Eager,
    /// One `flashcore::attention` call per layer: causal, native GQA, strided cache views.
    Flashcore,
}

impl AttnBackend {
    pub fn name(self) -> &'static str {
        match self {
            AttnBackend::Eager => "eager",
            AttnBackend::Flashcore => "flashcore",
        }
    }
}

/// Llama 3.1-style frequency-dependent rotary scaling (`rope_scaling.rope_type == "llama3"`).
#[derive(Clone, Debug, PartialEq)]
pub struct Llama3RopeScaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: usize,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub vocab_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: Option<Llama3RopeScaling>,
    /// Per-frequency divisors stored by llama.cpp as `rope_freqs.weight` (Llama 3.1+ GGUF files).
    pub rope_freq_factors: Option<Vec<f32>>,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

impl Config {
    /// Reads a Hugging Face `config.json` (`LlamaForCausalLM`, `Qwen2ForCausalLM` and
    /// look-alikes). Fields that are absent take the transformers defaults.
    pub fn from_hf_json(j: &Value) -> Result<Config> {
        let req = |k: &str| -> Result<usize> {
            j.get(k)
                .and_then(json_usize)
                .with_context(|| format!("config.json: missing or bad `{k}`"))
        };
        let opt_f = |k: &str, default: f64| j.get(k).and_then(Value::as_f64).unwrap_or(default);
        let hidden_size = req("hidden_size")?;
        let num_attention_heads = req("num_attention_heads")?;
        let num_key_value_heads = j
            .get("num_key_value_heads")
            .and_then(json_usize)
            .unwrap_or(num_attention_heads);
        let head_dim = j
            .get("head_dim")
            .and_then(json_usize)
            .unwrap_or(hidden_size / num_attention_heads);
        if let Some(act) = j.get("hidden_act").and_then(Value::as_str) {
            if act != "silu" {
                bail!("config.json: hidden_act `{act}` is not supported (only silu / SwiGLU)")
            }
        }
        let rope_scaling = match j.get("rope_scaling") {
            None => None,
            Some(rs) => {
                let kind = rs
                    .get("rope_type")
                    .or_else(|| rs.get("type"))
                    .and_then(Value::as_str)
                    .unwrap_or("");
                match kind {
                    "llama3" => {
                        let f = |k: &str| {
                            rs.get(k)
                                .and_then(Value::as_f64)
                                .with_context(|| format!("rope_scaling: missing `{k}`"))
                        };
                        Some(Llama3RopeScaling {
                            factor: f("factor")?,
                            low_freq_factor: f("low_freq_factor")?,
                            high_freq_factor: f("high_freq_factor")?,
                            original_max_position_embeddings: f("original_max_position_embeddings")?
                                as usize,
                        })
                    }
                    "default" | "" => None,
                    other => bail!(
                        "config.json: rope_scaling type `{other}` is not supported (only llama3)"
                    ),
                }
            }
        };
        let ids = |v: Option<&Value>| -> Vec<u32> {
            match v {
                Some(Value::Number(x)) => x.as_f64().map(|x| x as u32).into_iter().collect(),
                Some(Value::Array(a)) => {
                    a.iter().filter_map(json_usize).map(|x| x as u32).collect()
                }
                _ => vec![],
            }
        };
        Ok(Config {
            hidden_size,
            intermediate_size: req("intermediate_size")?,
            vocab_size: req("vocab_size")?,
            num_hidden_layers: req("num_hidden_layers")?,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps: opt_f("rms_norm_eps", 1e-6),
            rope_theta: opt_f("rope_theta", 10_000.0),
            rope_scaling,
            rope_freq_factors: None,
            max_position_embeddings: j
                .get("max_position_embeddings")
                .and_then(json_usize)
                .unwrap_or(4096),
            tie_word_embeddings: j
                .get("tie_word_embeddings")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            bos_token_id: ids(j.get("bos_token_id")).first().copied(),
            eos_token_ids: ids(j.get("eos_token_id")),
        })
    }

    /// Published shapes, for `--random-weights` throughput runs.
    pub fn preset(name: &str) -> Result<Config> {
        let llama3_scaling = |factor: f64| {
            Some(Llama3RopeScaling {
                factor,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192,
            })
        };
        let cfg = match name {
            // Meta-Llama-3.1-8B
            "llama3-8b" => Config {
                hidden_size: 4096,
                intermediate_size: 14336,
                vocab_size: 128256,
                num_hidden_layers: 32,
                num_attention_heads: 32,
                num_key_value_heads: 8,
                head_dim: 128,
                rms_norm_eps: 1e-5,
                rope_theta: 500_000.0,
                rope_scaling: llama3_scaling(8.0),
                rope_freq_factors: None,
                max_position_embeddings: 131072,
                tie_word_embeddings: false,
                bos_token_id: Some(128000),
                eos_token_ids: vec![128001, 128008, 128009],
            },
            // Meta-Llama-3.1-70B
            "llama3-70b" => Config {
                hidden_size: 8192,
                intermediate_size: 28672,
                vocab_size: 128256,
                num_hidden_layers: 80,
                num_attention_heads: 64,
                num_key_value_heads: 8,
                head_dim: 128,
                rms_norm_eps: 1e-5,
                rope_theta: 500_000.0,
                rope_scaling: llama3_scaling(8.0),
                rope_freq_factors: None,
                max_position_embeddings: 131072,
                tie_word_embeddings: false,
                bos_token_id: Some(128000),
                eos_token_ids: vec![128001, 128008, 128009],
            },
            // Llama-3.2-1B
            "llama3-1b" => Config {
                hidden_size: 2048,
                intermediate_size: 8192,
                vocab_size: 128256,
                num_hidden_layers: 16,
                num_attention_heads: 32,
                num_key_value_heads: 8,
                head_dim: 64,
                rms_norm_eps: 1e-5,
                rope_theta: 500_000.0,
                rope_scaling: llama3_scaling(32.0),
                rope_freq_factors: None,
                max_position_embeddings: 131072,
                tie_word_embeddings: true,
                bos_token_id: Some(128000),
                eos_token_ids: vec![128001, 128008, 128009],
            },
            // SmolLM2-135M
            "smollm2-135m" => Config {
                hidden_size: 576,
                intermediate_size: 1536,
                vocab_size: 49152,
                num_hidden_layers: 30,
                num_attention_heads: 9,
                num_key_value_heads: 3,
                head_dim: 64,
                rms_norm_eps: 1e-5,
                rope_theta: 100_000.0,
                rope_scaling: None,
                rope_freq_factors: None,
                max_position_embeddings: 8192,
                tie_word_embeddings: true,
                bos_token_id: Some(1),
                eos_token_ids: vec![2],
            },
            other => {
                bail!(
                "unknown preset `{other}` (expected llama3-8b, llama3-70b, llama3-1b or smollm2-135m)"
            )
            }
        };
        Ok(cfg)
    }

    pub fn validate(&self) -> Result<()> {
        if self.num_attention_heads == 0 || self.num_key_value_heads == 0 {
            bail!("config: head counts must be positive")
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            bail!(
                "config: num_attention_heads ({}) must be a multiple of num_key_value_heads ({})",
                self.num_attention_heads,
                self.num_key_value_heads
            )
        }
        if !self.head_dim.is_multiple_of(2) {
            bail!(
                "config: head_dim must be even for rotary embeddings (got {})",
                self.head_dim
            )
        }
        Ok(())
    }

    /// Parameter count (embeddings counted once when tied).
    pub fn num_params(&self) -> usize {
        let (h, i, v) = (self.hidden_size, self.intermediate_size, self.vocab_size);
        let q = self.num_attention_heads * self.head_dim;
        let kv = self.num_key_value_heads * self.head_dim;
        let per_layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h;
        let head = if self.tie_word_embeddings { 0 } else { v * h };
        v * h + self.num_hidden_layers * per_layer + h + head
    }

    /// Inverse rotary frequencies `theta^(-2i/d)`, with Llama 3 scaling or GGUF factors applied.
    pub fn inv_freqs(&self) -> Vec<f64> {
        let d = self.head_dim;
        let mut inv: Vec<f64> = (0..d / 2)
            .map(|i| 1.0 / self.rope_theta.powf((2 * i) as f64 / d as f64))
            .collect();
        if let Some(s) = &self.rope_scaling {
            let orig = s.original_max_position_embeddings as f64;
            let low_wavelen = orig / s.low_freq_factor;
            let high_wavelen = orig / s.high_freq_factor;
            for f in inv.iter_mut() {
                let wavelen = 2.0 * std::f64::consts::PI / *f;
                *f = if wavelen < high_wavelen {
                    *f
                } else if wavelen > low_wavelen {
                    *f / s.factor
                } else {
                    let smooth = (orig / wavelen - s.low_freq_factor)
                        / (s.high_freq_factor - s.low_freq_factor);
                    (1.0 - smooth) * *f / s.factor + smooth * *f
                };
            }
        }
        if let Some(factors) = &self.rope_freq_factors {
            for (f, div) in inv.iter_mut().zip(factors) {
                *f /= *div as f64;
            }
        }
        inv
    }
}

/// Per-rank, per-layer `(k, v)` buffers: `[rank][layer]`, each `(n, rows, heads_kv / tp,
/// head_dim)` on the rank's device (a rank keeps the K/V heads of its query heads).
pub type Pools = Vec<Layers>;

/// One rank's `(k, v)` buffers, one pair per layer.
pub type Layers = Vec<(Tensor, Tensor)>;

/// Keys and values of every layer, preallocated as `(batch, max_seq, heads_kv, head_dim)` (per
/// rank: its share of the heads) and written in place with `slice_set`; the first `len`
/// positions are valid.
pub struct KvCache {
    ranks: Pools,
    len: usize,
}

impl KvCache {
    pub fn new(model: &Model, batch: usize, max_seq: usize, dtype: DType) -> Result<KvCache> {
        let ranks = model.kv_buffers(batch, max_seq, dtype)?;
        Ok(KvCache { ranks, len: 0 })
    }

    /// Rank 0's device (where inputs go and logits come back).
    pub fn device(&self) -> Device {
        self.ranks
            .first()
            .and_then(|l| l.first())
            .map(|(k, _)| k.device().clone())
            .unwrap_or(Device::Cpu)
    }

    /// Forget the contents (the buffers are kept and overwritten by the next prefill).
    pub fn reset(&mut self) {
        self.len = 0;
    }
}

/// One sequence's share of a [`PagedBatch`]: its new tokens, the rows it already has in the
/// cache (its new tokens take positions `cached..cached + tokens.len()`), and the pages holding
/// its keys (enough for `cached + tokens.len()` rows).
pub struct SeqStep<'a> {
    pub tokens: &'a [u32],
    pub cached: usize,
    pub pages: &'a [u32],
}

/// The new tokens of several sequences packed into one forward pass whose keys and values live
/// in per-layer paged pools `(num_pages, page_size, heads_kv, head_dim)` (the step of a
/// continuous-batching loop, examples/serve). Built on the host once per step (a few small u32
/// tensors) and read by every layer: the new K/V rows go into the pools with one
/// `append_kv_paged_varlen`, attention reads them back through the page tables.
///
/// Attention runs per *group* of consecutive sequences: sequences with one new token (decode)
/// form a group served by `attention_paged`'s split-KV kernel (query heads of a K/V head packed
/// into one tile, keys read once), sequences with several (chunks of prefill) one served by
/// `attention_paged_varlen`'s prefill kernels (a query tile per head; on pages they cannot read
/// through the table, a gather of the group's pages first). Decodes riding in the prefill call
/// would read their keys once per query head: a mixed step makes two calls per layer, not one.
pub struct PagedBatch {
    /// The step's small tensors, one copy on each rank's device.
    ranks: Vec<BatchTensors>,
    cu: Vec<usize>,
    total: usize,
    max_position: usize,
}

/// A [`PagedBatch`]'s tensors on one device.
struct BatchTensors {
    tokens: Tensor,
    positions: Tensor,
    table: Tensor,
    cu_new: Tensor,
    start: Tensor,
    groups: Vec<AttnGroup>,
    last_rows: Tensor,
}

/// Consecutive sequences of a [`PagedBatch`] that one attention call serves.
struct AttnGroup {
    first_row: usize,
    rows: usize,
    table: Tensor,
    seqlens_k: Tensor,
    /// `None` when every sequence has one new token; otherwise the group's `cu_seqlens_q`
    /// (from its first row) and `max_seqlen_q`.
    varlen: Option<(Tensor, usize)>,
}

/// Page table `(n, width)` (unused entries 0) of `seqs`, u32 on `device`.
fn page_table(seqs: &[SeqStep], device: &Device) -> Result<Tensor> {
    let width = seqs.iter().map(|s| s.pages.len()).max().unwrap_or(0).max(1);
    let mut table = vec![0u32; seqs.len() * width];
    for (row, s) in table.chunks_mut(width).zip(seqs) {
        row[..s.pages.len()].copy_from_slice(s.pages);
    }
    Ok(Tensor::from_vec(table, (seqs.len(), width), device)?)
}

fn u32s(v: impl IntoIterator<Item = usize>, device: &Device) -> Result<Tensor> {
    let v: Vec<u32> = v.into_iter().map(|x| x as u32).collect();
    Ok(Tensor::new(v.as_slice(), device)?)
}

impl PagedBatch {
    /// The step of `seqs`, its tensors on each of `devices` (a model's [`Model::devices`]).
    pub fn new(seqs: &[SeqStep], page_size: usize, devices: &[Device]) -> Result<PagedBatch> {
        if seqs.is_empty() {
            bail!("PagedBatch: no sequences")
        }
        let mut tokens = Vec::new();
        let mut positions = Vec::new();
        let mut cu = vec![0usize];
        for (i, s) in seqs.iter().enumerate() {
            let end = s.cached + s.tokens.len();
            if s.tokens.is_empty() || s.pages.len() * page_size < end {
                bail!(
                    "PagedBatch: sequence {i} has {} new tokens after {} cached rows in {} pages of {page_size}",
                    s.tokens.len(),
                    s.cached,
                    s.pages.len()
                )
            }
            tokens.extend_from_slice(s.tokens);
            positions.extend(s.cached..end);
            cu.push(tokens.len());
        }
        let max_position = positions.iter().copied().max().unwrap_or(0);
        let ranks = devices
            .iter()
            .map(|device| BatchTensors::new(seqs, &tokens, &positions, &cu, device))
            .collect::<Result<Vec<_>>>()?;
        Ok(PagedBatch {
            ranks,
            total: *cu.last().unwrap_or(&0),
            cu,
            max_position,
        })
    }

    /// Takes the logits of sequence `i` at its new token `rows[i]` instead of its last one (the
    /// last real token of a right-padded prompt).
    pub fn logits_at(mut self, rows: &[usize]) -> Result<PagedBatch> {
        let n = self.cu.len() - 1;
        if rows.len() != n || (0..n).any(|i| self.cu[i] + rows[i] >= self.cu[i + 1]) {
            bail!("PagedBatch::logits_at: rows {rows:?} do not index the {n} sequences' new tokens")
        }
        for r in &mut self.ranks {
            let device = r.last_rows.device().clone();
            r.last_rows = u32s((0..n).map(|i| self.cu[i] + rows[i]), &device)?;
        }
        Ok(self)
    }

    /// Attention calls per layer (1, or 2 when decodes and prefill chunks share the step).
    pub fn groups(&self) -> usize {
        self.ranks.first().map_or(0, |r| r.groups.len())
    }
}

impl BatchTensors {
    fn new(
        seqs: &[SeqStep],
        tokens: &[u32],
        positions: &[usize],
        cu: &[usize],
        device: &Device,
    ) -> Result<BatchTensors> {
        // Groups: runs of consecutive sequences of the same kind (one new token or several).
        let mut groups = Vec::new();
        let mut a = 0;
        while a < seqs.len() {
            let decode = seqs[a].tokens.len() == 1;
            let mut b = a + 1;
            while b < seqs.len() && (seqs[b].tokens.len() == 1) == decode {
                b += 1;
            }
            let g = &seqs[a..b];
            let varlen = if decode {
                None
            } else {
                let cu_g = u32s(cu[a..=b].iter().map(|&c| c - cu[a]), device)?;
                let max_q = g.iter().map(|s| s.tokens.len()).max().unwrap_or(1);
                Some((cu_g, max_q))
            };
            groups.push(AttnGroup {
                first_row: cu[a],
                rows: cu[b] - cu[a],
                table: page_table(g, device)?,
                seqlens_k: u32s(g.iter().map(|s| s.cached + s.tokens.len()), device)?,
                varlen,
            });
            a = b;
        }
        Ok(BatchTensors {
            tokens: Tensor::new(tokens, device)?,
            positions: u32s(positions.iter().copied(), device)?,
            table: page_table(seqs, device)?,
            cu_new: u32s(cu.iter().copied(), device)?,
            start: u32s(seqs.iter().map(|s| s.cached), device)?,
            groups,
            last_rows: u32s(cu[1..].iter().map(|&c| c - 1), device)?,
        })
    }
}

struct Attention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
}

/// How a tensor-parallel rank takes its part of a projection `(out, in)`.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Split {
    /// All of it (one rank).
    Whole,
    /// A block of output rows (heads, MLP columns): column parallel; the bias splits the same way.
    Out,
    /// A block of input columns: row parallel; the partial products are summed across ranks,
    /// so only rank 0 adds the bias.
    In,
}

/// `t` narrowed to this rank's block along `dim`, copied so that the full tensor is freed.
fn take_part(t: Tensor, dim: usize, shard: Shard) -> Result<Tensor> {
    if shard.size == 1 {
        return Ok(t);
    }
    let (start, len) = shard.part(t.dim(dim)?);
    Ok(t.narrow(dim, start, len)?.force_contiguous()?)
}

/// Loads a projection (this rank's part of it); a bias is used when the checkpoint has one
/// (Qwen2 q/k/v).
fn linear(
    vb: &VarBuilder,
    in_dim: usize,
    out_dim: usize,
    name: &str,
    split: Split,
    shard: Shard,
) -> Result<Linear> {
    let vb = vb.pp(name);
    let w = vb.get((out_dim, in_dim), "weight")?;
    let has_bias = vb.contains_tensor("bias");
    let split = if shard.size == 1 { Split::Whole } else { split };
    let (w, b) = match split {
        Split::Whole => (w, has_bias.then(|| vb.get(out_dim, "bias")).transpose()?),
        Split::Out => {
            let b = match has_bias {
                true => Some(take_part(vb.get(out_dim, "bias")?, 0, shard)?),
                false => None,
            };
            (take_part(w, 0, shard)?, b)
        }
        Split::In => {
            let b = match has_bias && shard.rank == 0 {
                true => Some(vb.get(out_dim, "bias")?),
                false => None,
            };
            (take_part(w, 1, shard)?, b)
        }
    };
    Ok(Linear::new(w, b))
}

impl Attention {
    /// This rank's heads: query heads `[r·hq/n, (r+1)·hq/n)` and the K/V heads they read
    /// (grouped-query attention maps query head `h` to K/V head `h / (hq / hkv)`, so a
    /// contiguous block of query heads reads a contiguous block of K/V heads).
    fn load(vb: &VarBuilder, cfg: &Config, shard: Shard) -> Result<Attention> {
        let (h, d) = (cfg.hidden_size, cfg.head_dim);
        let (hq, hkv) = (cfg.num_attention_heads, cfg.num_key_value_heads);
        Ok(Attention {
            q_proj: linear(vb, h, hq * d, "q_proj", Split::Out, shard)?,
            k_proj: linear(vb, h, hkv * d, "k_proj", Split::Out, shard)?,
            v_proj: linear(vb, h, hkv * d, "v_proj", Split::Out, shard)?,
            o_proj: linear(vb, hq * d, h, "o_proj", Split::In, shard)?,
            num_heads: hq / shard.size,
            num_kv_heads: hkv / shard.size,
            head_dim: d,
        })
    }

    fn forward(
        &self,
        x: &Tensor,
        rope: &Rope,
        pos: usize,
        cache: &mut (Tensor, Tensor),
        backend: AttnBackend,
        eager_mask: Option<&Tensor>,
    ) -> Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let (hq, hkv, d) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let q = self.q_proj.forward(x)?.reshape((b, t, hq, d))?;
        let k = self.k_proj.forward(x)?.reshape((b, t, hkv, d))?;
        let v = self
            .v_proj
            .forward(x)?
            .reshape((b, t, hkv, d))?
            .contiguous()?;
        let (q, k) = rope.apply(&q, &k, pos)?;

        let (k_cache, v_cache) = cache;
        let max_seq = k_cache.dim(1)?;
        if pos + t > max_seq {
            bail!("kv cache full: {pos} + {t} positions > capacity {max_seq}")
        }
        k_cache.slice_set(&k, 1, pos)?;
        v_cache.slice_set(&v, 1, pos)?;
        let k_all = k_cache.narrow(1, 0, pos + t)?;
        let v_all = v_cache.narrow(1, 0, pos + t)?;

        let o = attend(&q, &k_all, &v_all, backend, eager_mask)?;
        self.o_proj
            .forward(&o.reshape((b, t, hq * d))?)
            .map_err(Into::into)
    }
}

impl Attention {
    /// [`Attention::forward`] for a [`PagedBatch`]: `x` `(1, total, hidden)` packed; the new
    /// K/V go into `pool` and attention reads through the page tables (always flashcore).
    fn forward_paged(
        &self,
        x: &Tensor,
        cos_sin: &(Tensor, Tensor),
        batch: &BatchTensors,
        total: usize,
        pool: &(Tensor, Tensor),
        kv_scales: Option<&flashcore::KvScales>,
    ) -> Result<Tensor> {
        let (hq, hkv, d) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let q = self.q_proj.forward(x)?.reshape((1, total, hq, d))?;
        let k = self.k_proj.forward(x)?.reshape((1, total, hkv, d))?;
        let v = self.v_proj.forward(x)?.reshape((total, hkv, d))?;
        let (q, k) = Rope::apply_with(&q, &k, cos_sin)?;
        let (k_pages, v_pages) = pool;
        let (k, v) = (k.reshape((total, hkv, d))?, v.contiguous()?);
        let (t, cu, at) = (&batch.table, &batch.cu_new, &batch.start);
        match kv_scales {
            None => flashcore::append_kv_paged_varlen(&k, &v, k_pages, v_pages, t, cu, at)?,
            Some(sc) => {
                flashcore::append_kv_paged_varlen_fp8(&k, &v, k_pages, v_pages, t, cu, at, sc)?
            }
        }
        let q = q.reshape((total, hq, d))?;
        let params = flashcore::AttnParams {
            softmax_scale: Some(softmax_scale(d) as f32),
            mask: flashcore::Mask::Causal,
            kv_scales: kv_scales.cloned(),
            ..Default::default()
        };
        let mut outs = Vec::with_capacity(batch.groups.len());
        for g in &batch.groups {
            let qg = q.narrow(0, g.first_row, g.rows)?;
            let o = match &g.varlen {
                None => flashcore::attention_paged(
                    &qg.reshape((g.rows, 1, hq, d))?,
                    k_pages,
                    v_pages,
                    &g.table,
                    &g.seqlens_k,
                    &params,
                )?
                .reshape((g.rows, hq, d))?,
                Some((cu_q, max_q)) => flashcore::attention_paged_varlen(
                    &qg,
                    k_pages,
                    v_pages,
                    &g.table,
                    &g.seqlens_k,
                    cu_q,
                    *max_q,
                    &params,
                )?,
            };
            outs.push(o);
        }
        let o = match outs.len() {
            1 => outs.pop().expect("one group"),
            _ => Tensor::cat(&outs, 0)?,
        };
        Ok(self.o_proj.forward(&o.reshape((1, total, hq * d))?)?)
    }
}

fn softmax_scale(head_dim: usize) -> f64 {
    1.0 / (head_dim as f64).sqrt()
}

/// Causal attention of `q` `(b, t, hq, d)` over `k`, `v` `(b, L, hkv, d)`, where the `t` queries
/// are the last `t` of the `L` positions; returns `(b, t, hq, d)`. The one place the backends
/// differ. `eager_mask` is [`causal_mask`]`(t, L)`, built once per forward pass by the caller.
pub fn attend(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    backend: AttnBackend,
    eager_mask: Option<&Tensor>,
) -> Result<Tensor> {
    match backend {
        AttnBackend::Flashcore => flashcore_attention(q, k, v),
        AttnBackend::Eager => eager_attention(q, k, v, eager_mask),
    }
}

/// One fused call: causal (aligned bottom-right, so decoding sees every cached key), GQA
/// native, `k`/`v` read in place from the cache views.
fn flashcore_attention(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
    let params = flashcore::AttnParams {
        softmax_scale: Some(softmax_scale(q.dim(3)?) as f32),
        mask: flashcore::Mask::Causal,
        ..Default::default()
    };
    Ok(flashcore::attention(q, k, v, &params)?)
}

/// Additive mask `(t, L)` f32 for `t` queries at the end of `L` positions: query `i` (absolute
/// position `L - t + i`) sees keys `j <= L - t + i`. `None` when every key is visible (`t == 1`).
pub fn causal_mask(t: usize, l: usize, device: &Device) -> Result<Option<Tensor>> {
    if t == 1 {
        return Ok(None);
    }
    let offset = l - t;
    let mask: Vec<f32> = (0..t)
        .flat_map(|i| {
            (0..l).map(move |j| {
                if j > i + offset {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
        })
        .collect();
    Ok(Some(Tensor::from_vec(mask, (t, l), device)?))
}

/// `(b, hkv, L, d)` -> `(b, hkv * n_rep, L, d)`, each KV head repeated for its `n_rep` query heads.
fn repeat_kv(x: &Tensor, n_rep: usize) -> Result<Tensor> {
    if n_rep == 1 {
        return Ok(x.contiguous()?);
    }
    let (b, hkv, l, d) = x.dims4()?;
    Ok(x.unsqueeze(2)?
        .broadcast_as((b, hkv, n_rep, l, d))?
        .reshape((b, hkv * n_rep, l, d))?)
}

/// Largest score tensor (elements) the eager path materialises at once. candle's element-wise
/// CUDA kernels take the element count as a 32-bit launch size (a (1, 32, 16384, 16384) score
/// tensor has 2^33 elements and fails with CUDA_ERROR_INVALID_VALUE), so long prefills are
/// computed in query-row chunks of at most this many scores.
const EAGER_MAX_SCORES: usize = 1 << 30;

/// The candle-ops baseline: scores in the run dtype, mask and softmax in f32, then `P v`.
fn eager_attention(q: &Tensor, k: &Tensor, v: &Tensor, mask: Option<&Tensor>) -> Result<Tensor> {
    eager_attention_chunked(q, k, v, mask, EAGER_MAX_SCORES)
}

/// [`eager_attention`] with at most `max_scores` score elements materialised at once.
pub fn eager_attention_chunked(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    max_scores: usize,
) -> Result<Tensor> {
    let (b, t, hq, d) = q.dims4()?;
    let (l, hkv) = (k.dim(1)?, k.dim(2)?);
    let n_rep = hq / hkv;
    let q = q.transpose(1, 2)?.contiguous()?; // (b, hq, t, d)
    let k = repeat_kv(&k.transpose(1, 2)?, n_rep)?; // (b, hq, L, d)
    let v = repeat_kv(&v.transpose(1, 2)?, n_rep)?;
    let rows = (max_scores / (b * hq * l).max(1)).clamp(1, t.max(1));
    let mut outs = Vec::with_capacity(t.div_ceil(rows));
    for r0 in (0..t).step_by(rows) {
        let n = rows.min(t - r0);
        let qc = if n == t {
            q.clone()
        } else {
            q.narrow(2, r0, n)?
        };
        let scores = (qc.matmul(&k.t()?)? * softmax_scale(d))?.to_dtype(DType::F32)?; // (b, hq, n, L)
        let scores = match mask {
            Some(m) => scores.broadcast_add(&m.narrow(0, r0, n)?)?,
            None => scores,
        };
        let probs = candle_nn::ops::softmax_last_dim(&scores)?.to_dtype(v.dtype())?;
        outs.push(probs.matmul(&v)?);
    }
    let o = if outs.len() == 1 {
        outs.pop().expect("one chunk")
    } else {
        Tensor::cat(&outs, 2)?
    };
    Ok(o.transpose(1, 2)?) // (b, t, hq, d)
}

/// Rotary tables `(max_pos, head_dim / 2)` in the run dtype, half-split convention.
struct Rope {
    cos: Tensor,
    sin: Tensor,
}

impl Rope {
    fn new(cfg: &Config, max_pos: usize, dtype: DType, device: &Device) -> Result<Rope> {
        let inv = cfg.inv_freqs();
        let half = inv.len();
        let mut angles = Vec::with_capacity(max_pos * half);
        for p in 0..max_pos {
            angles.extend(inv.iter().map(|f| (p as f64 * f) as f32));
        }
        let angles = Tensor::from_vec(angles, (max_pos, half), device)?;
        Ok(Rope {
            cos: angles.cos()?.to_dtype(dtype)?,
            sin: angles.sin()?.to_dtype(dtype)?,
        })
    }

    fn apply(&self, q: &Tensor, k: &Tensor, pos: usize) -> Result<(Tensor, Tensor)> {
        let t = q.dim(1)?;
        let max = self.cos.dim(0)?;
        if pos + t > max {
            bail!(
                "position {} is beyond the rotary table ({max} positions)",
                pos + t
            )
        }
        let cos = self.cos.narrow(0, pos, t)?;
        let sin = self.sin.narrow(0, pos, t)?;
        let q = candle_nn::rotary_emb::rope_thd(&q.contiguous()?, &cos, &sin)?;
        let k = candle_nn::rotary_emb::rope_thd(&k.contiguous()?, &cos, &sin)?;
        Ok((q, k))
    }

    /// The `(t, head_dim / 2)` cos and sin rows of tokens at arbitrary positions (u32 `(t,)`,
    /// each below the table's length: the caller checks, as `index_select` on a GPU does not).
    fn at(&self, positions: &Tensor) -> Result<(Tensor, Tensor)> {
        Ok((
            self.cos.index_select(positions, 0)?,
            self.sin.index_select(positions, 0)?,
        ))
    }

    /// Rotates `(1, t, h, d)` queries and keys by the rows [`Rope::at`] gathered.
    fn apply_with(
        q: &Tensor,
        k: &Tensor,
        (cos, sin): &(Tensor, Tensor),
    ) -> Result<(Tensor, Tensor)> {
        let q = candle_nn::rotary_emb::rope_thd(&q.contiguous()?, cos, sin)?;
        let k = candle_nn::rotary_emb::rope_thd(&k.contiguous()?, cos, sin)?;
        Ok((q, k))
    }
}

struct Mlp {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
}

impl Mlp {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let gate = candle_nn::ops::silu(&self.gate_proj.forward(x)?)?;
        let up = self.up_proj.forward(x)?;
        Ok(self.down_proj.forward(&(gate * up)?)?)
    }
}

struct Block {
    input_norm: Tensor,
    attn: Attention,
    post_attn_norm: Tensor,
    mlp: Mlp,
}

impl Block {
    /// Pre-norm residual block; `attn` maps the normed input to the attention output. Under
    /// tensor parallelism the attention and MLP outputs are this rank's partial sums, completed
    /// by `comm` before each residual add.
    fn forward(
        &self,
        x: Tensor,
        eps: f32,
        comm: Option<&dyn AllReduce>,
        attn: impl FnOnce(&Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let reduce = |t: Tensor| -> Result<Tensor> {
            match comm {
                Some(c) => c.sum(&t),
                None => Ok(t),
            }
        };
        let h = candle_nn::ops::rms_norm(&x, &self.input_norm, eps)?;
        let x = (x + reduce(attn(&h)?)?)?;
        let h = candle_nn::ops::rms_norm(&x, &self.post_attn_norm, eps)?;
        Ok((&x + reduce(self.mlp.forward(&h)?)?)?)
    }
}

/// One tensor-parallel rank's part of the model, on its device.
struct Rank {
    embed: Embedding,
    blocks: Vec<Block>,
    norm: Tensor,
    /// Rank 0 only: the rank that samples.
    lm_head: Option<Linear>,
    rope: Rope,
    comm: Option<Arc<dyn AllReduce>>,
    device: Device,
    /// Descales of FP8 K/V pools (`Model::set_kv_scale`), on this rank's device.
    kv_scales: Option<flashcore::KvScales>,
}

/// The decoder: one [`Rank`] per GPU of a tensor-parallel group (one for TP=1). Every method
/// runs all ranks (on a thread each when there are several) and returns rank 0's logits.
pub struct Model {
    ranks: Vec<Rank>,
    cfg: Config,
    eps: f32,
    /// The attention implementation used by the next forward pass; switchable between runs.
    pub attn: AttnBackend,
}

impl Rank {
    fn load(
        vb: &VarBuilder,
        cfg: &Config,
        max_pos: usize,
        shard: Shard,
        comm: Option<Arc<dyn AllReduce>>,
    ) -> Result<Rank> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        let embed_w = vb.get((cfg.vocab_size, h), "model.embed_tokens.weight")?;
        // Always read (also where unused), so that every rank asks a random-weight source for
        // the same tensors in the same order.
        let lm_head_w = if cfg.tie_word_embeddings || !vb.contains_tensor("lm_head.weight") {
            embed_w.clone()
        } else {
            vb.get((cfg.vocab_size, h), "lm_head.weight")?
        };
        let mut blocks = Vec::with_capacity(cfg.num_hidden_layers);
        let n = cfg.num_hidden_layers;
        for l in 0..n {
            let vb_l = vb.pp(format!("model.layers.{l}"));
            let vb_mlp = vb_l.pp("mlp");
            blocks.push(Block {
                input_norm: vb_l.get(h, "input_layernorm.weight")?,
                attn: Attention::load(&vb_l.pp("self_attn"), cfg, shard)?,
                post_attn_norm: vb_l.get(h, "post_attention_layernorm.weight")?,
                mlp: Mlp {
                    gate_proj: linear(&vb_mlp, h, i, "gate_proj", Split::Out, shard)?,
                    up_proj: linear(&vb_mlp, h, i, "up_proj", Split::Out, shard)?,
                    down_proj: linear(&vb_mlp, i, h, "down_proj", Split::In, shard)?,
                },
            });
            if n >= 8 && ((l + 1) % n.div_ceil(4) == 0 || l + 1 == n) {
                let of = match shard.size {
                    1 => String::new(),
                    s => format!(" (rank {}/{s})", shard.rank),
                };
                eprintln!("layers {}/{n} loaded{of}", l + 1);
            }
        }
        Ok(Rank {
            embed: Embedding::new(embed_w, h),
            blocks,
            norm: vb.get(h, "model.norm.weight")?,
            lm_head: (shard.rank == 0).then(|| Linear::new(lm_head_w, None)),
            rope: Rope::new(cfg, max_pos, vb.dtype(), vb.device())?,
            comm,
            device: vb.device().clone(),
            kv_scales: None,
        })
    }

    fn comm(&self) -> Option<&dyn AllReduce> {
        self.comm.as_deref()
    }

    /// Final hidden states `(b, t, hidden)` for `tokens` `(b, t)` u32 (on this rank's device)
    /// after `pos` cached positions, K/V written into `layers`.
    fn hidden(
        &self,
        tokens: &Tensor,
        layers: &mut [(Tensor, Tensor)],
        pos: usize,
        attn: AttnBackend,
        eps: f32,
    ) -> Result<Tensor> {
        let t = tokens.dim(1)?;
        let mut x = self.embed.forward(tokens)?;
        // Built once per forward pass and shared by the layers.
        let eager_mask = match attn {
            AttnBackend::Eager => causal_mask(t, pos + t, &self.device)?,
            AttnBackend::Flashcore => None,
        };
        for (block, layer_cache) in self.blocks.iter().zip(layers.iter_mut()) {
            x = block.forward(x, eps, self.comm(), |h| {
                block
                    .attn
                    .forward(h, &self.rope, pos, layer_cache, attn, eager_mask.as_ref())
            })?;
        }
        Ok(candle_nn::ops::rms_norm(&x, &self.norm, eps)?)
    }

    /// Rank 0: f32 logits of `x`; other ranks: `None`.
    fn logits(&self, x: &Tensor) -> Result<Option<Tensor>> {
        match &self.lm_head {
            Some(head) => Ok(Some(head.forward(x)?.to_dtype(DType::F32)?)),
            None => Ok(None),
        }
    }

    fn forward_paged(
        &self,
        batch: &PagedBatch,
        bt: &BatchTensors,
        pools: &[(Tensor, Tensor)],
        eps: f32,
    ) -> Result<Option<Tensor>> {
        // Every layer rotates the same positions: gather their cos/sin rows once.
        let cos_sin = self.rope.at(&bt.positions)?;
        let mut x = self.embed.forward(&bt.tokens)?.unsqueeze(0)?;
        for (block, pool) in self.blocks.iter().zip(pools) {
            x = block.forward(x, eps, self.comm(), |h| {
                let scales = self.kv_scales.as_ref();
                block
                    .attn
                    .forward_paged(h, &cos_sin, bt, batch.total, pool, scales)
            })?;
        }
        if self.lm_head.is_none() {
            return Ok(None);
        }
        let last = x.squeeze(0)?.index_select(&bt.last_rows, 0)?;
        let last = candle_nn::ops::rms_norm(&last, &self.norm, eps)?;
        self.logits(&last)
    }
}

/// Rank 0's value out of [`on_ranks`]' results.
fn first(mut v: Vec<Option<Tensor>>) -> Result<Tensor> {
    match v.swap_remove(0) {
        Some(t) => Ok(t),
        None => bail!("rank 0 returned no logits"),
    }
}

impl Model {
    /// Builds the model from Hugging Face tensor names (`model.layers.N.self_attn.q_proj.weight`,
    /// ...). `max_pos` sizes the rotary table (at least the KV cache capacity).
    pub fn load(vb: VarBuilder, cfg: &Config, max_pos: usize, attn: AttnBackend) -> Result<Model> {
        Model::load_ranks(&[vb], vec![], cfg, max_pos, attn)
    }

    /// A tensor-parallel model over `vbs.len()` ranks: rank `r` reads its part of every weight
    /// through `vbs[r]` (which sets its device) and sums partial outputs through `comms[r]`
    /// (empty for one rank).
    pub fn load_ranks(
        vbs: &[VarBuilder],
        comms: Vec<Arc<dyn AllReduce>>,
        cfg: &Config,
        max_pos: usize,
        attn: AttnBackend,
    ) -> Result<Model> {
        cfg.validate()?;
        let size = vbs.len();
        crate::tp::check_divisible(
            size,
            cfg.num_key_value_heads,
            cfg.num_attention_heads,
            cfg.intermediate_size,
        )?;
        if size > 1 && comms.len() != size {
            bail!(
                "{size} ranks need {size} all-reduce handles, got {}",
                comms.len()
            )
        }
        let mut comms = comms.into_iter();
        let ranks = vbs
            .iter()
            .enumerate()
            .map(|(rank, vb)| {
                let shard = Shard { rank, size };
                Rank::load(vb, cfg, max_pos, shard, comms.next())
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Model {
            ranks,
            cfg: cfg.clone(),
            eps: cfg.rms_norm_eps as f32,
            attn,
        })
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// Tensor-parallel ranks (1 without `--tp`).
    pub fn tp(&self) -> usize {
        self.ranks.len()
    }

    /// Milliseconds rank 0 spent in all-reduces since the last call (timed ones only, see
    /// `--time-allreduce`; 0 otherwise).
    pub fn allreduce_ms(&self) -> Result<f64> {
        match &self.ranks[0].comm {
            Some(c) => c.take_ms(),
            None => Ok(0.0),
        }
    }

    /// Paged K/V pools in FP8 (e4m3) hold `x / scale` and attention reads them back times `scale`
    /// (one scale per tensor for K and V alike; `None`: pools in the model's dtype).
    pub fn set_kv_scale(&mut self, scale: Option<f32>) -> Result<()> {
        for r in &mut self.ranks {
            r.kv_scales = match scale {
                None => None,
                Some(s) => {
                    if !(s.is_finite() && s > 0.0) {
                        bail!("--kv-scale must be a positive finite number, got {s}")
                    }
                    let t = Tensor::new(&[s], &r.device)?;
                    Some(flashcore::KvScales { k: t.clone(), v: t })
                }
            };
        }
        Ok(())
    }

    /// Each rank's device; rank 0's is where inputs go and logits come back.
    pub fn devices(&self) -> Vec<Device> {
        self.ranks.iter().map(|r| r.device.clone()).collect()
    }

    /// Zeroed K/V buffers `[rank][layer]`, `(n, rows, heads_kv / tp, head_dim)`: a dense cache of
    /// `n` sequences, or a paged pool of `n` pages of `rows` rows.
    pub fn kv_buffers(&self, n: usize, rows: usize, dtype: DType) -> Result<Pools> {
        let heads = self.cfg.num_key_value_heads / self.tp();
        let shape = (n, rows, heads, self.cfg.head_dim);
        self.ranks
            .iter()
            .map(|r| {
                (0..self.cfg.num_hidden_layers)
                    .map(|_| {
                        Ok((
                            Tensor::zeros(shape, dtype, &r.device)?,
                            Tensor::zeros(shape, dtype, &r.device)?,
                        ))
                    })
                    .collect()
            })
            .collect()
    }

    /// Rebuilds the rotary table for `n` positions and lets the model run that far, beyond the
    /// context it was trained for when `n` is larger (throughput runs at long prompts).
    pub fn set_max_positions(&mut self, n: usize) -> Result<()> {
        for r in &mut self.ranks {
            let dtype = r.rope.cos.dtype();
            r.rope = Rope::new(&self.cfg, n, dtype, &r.device)?;
        }
        self.cfg.max_position_embeddings = n;
        Ok(())
    }

    /// Final hidden states of every rank for `tokens` `(b, t)` u32, placed after the
    /// `cache.len()` positions already cached, mapped by `out` (rank 0's result is returned);
    /// the cache grows by `t`.
    fn run(
        &self,
        tokens: &Tensor,
        cache: &mut KvCache,
        out: impl Fn(&Rank, Tensor) -> Result<Option<Tensor>> + Sync,
    ) -> Result<Tensor> {
        let (b, t) = tokens.dims2()?;
        let pos = cache.len;
        if cache.ranks.len() != self.ranks.len()
            || cache
                .ranks
                .iter()
                .any(|l| l.len() != self.cfg.num_hidden_layers)
        {
            bail!(
                "kv cache has {} ranks of {:?} layers, model has {} ranks of {} layers",
                cache.ranks.len(),
                cache.ranks.iter().map(Vec::len).collect::<Vec<_>>(),
                self.ranks.len(),
                self.cfg.num_hidden_layers
            )
        }
        // Each rank's copy of the ids is built from host data, never copied from rank 0's
        // device: a read on another GPU's stream would queue behind that rank's all-reduce,
        // which waits for this rank. One rank uses the caller's tensor as it is.
        let inputs = match self.ranks.len() {
            1 => vec![tokens.clone()],
            _ => {
                let host: Vec<u32> = tokens.flatten_all()?.to_vec1()?;
                self.ranks
                    .iter()
                    .map(|r| Ok(Tensor::from_slice(&host, (b, t), &r.device)?))
                    .collect::<Result<Vec<_>>>()?
            }
        };
        let (attn, eps) = (self.attn, self.eps);
        let mut work: Vec<(&Rank, &Tensor, &mut Layers)> = self
            .ranks
            .iter()
            .zip(&inputs)
            .zip(cache.ranks.iter_mut())
            .map(|((r, x), l)| (r, x, l))
            .collect();
        let outs = on_ranks(
            &mut work,
            self.ranks[0].comm(),
            |_, (rank, tokens, layers)| {
                let x = rank.hidden(tokens, layers, pos, attn, eps)?;
                out(rank, x)
            },
        )?;
        cache.len = pos + t;
        first(outs)
    }

    /// Logits of the last position only, `(b, vocab)` f32 (prefill and decode).
    pub fn forward_last(&self, tokens: &Tensor, cache: &mut KvCache) -> Result<Tensor> {
        self.run(tokens, cache, |rank, x| {
            if rank.lm_head.is_none() {
                return Ok(None);
            }
            let t = x.dim(1)?;
            rank.logits(&x.narrow(1, t - 1, 1)?.squeeze(1)?)
        })
    }

    /// Logits of each sequence's last new token, `(sequences, vocab)` f32, for a
    /// [`PagedBatch`] over per-rank, per-layer pools `(k_pages, v_pages)` (flashcore attention
    /// whatever [`Model::attn`] says).
    pub fn forward_paged(&self, batch: &PagedBatch, pools: &Pools) -> Result<Tensor> {
        if pools.len() != self.ranks.len()
            || batch.ranks.len() != self.ranks.len()
            || pools.iter().any(|p| p.len() != self.cfg.num_hidden_layers)
        {
            bail!(
                "{} ranks of K/V pools ({:?} layers) and a batch for {} ranks, for a model of {} \
                 ranks of {} layers",
                pools.len(),
                pools.iter().map(Vec::len).collect::<Vec<_>>(),
                batch.ranks.len(),
                self.ranks.len(),
                self.cfg.num_hidden_layers
            )
        }
        let max = self.ranks[0].rope.cos.dim(0)?;
        if batch.max_position >= max {
            bail!(
                "position {} is beyond the rotary table ({max} positions)",
                batch.max_position
            )
        }
        let eps = self.eps;
        let mut work: Vec<(&Rank, &BatchTensors, &Layers)> = self
            .ranks
            .iter()
            .zip(&batch.ranks)
            .zip(pools)
            .map(|((r, b), p)| (r, b, p))
            .collect();
        let outs = on_ranks(&mut work, self.ranks[0].comm(), |_, (rank, bt, pool)| {
            rank.forward_paged(batch, bt, pool, eps)
        })?;
        first(outs)
    }

    /// Logits of every position, `(b, t, vocab)` f32 (teacher-forced scoring).
    pub fn forward_all(&self, tokens: &Tensor, cache: &mut KvCache) -> Result<Tensor> {
        self.run(tokens, cache, |rank, x| rank.logits(&x))
    }
}

/// Index of the largest logit in each row of `(b, vocab)`.
pub fn argmax_rows(logits: &Tensor) -> Result<Vec<u32>> {
    Ok(logits.argmax(D::Minus1)?.to_vec1::<u32>()?)
}
