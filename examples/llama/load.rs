//! Where weights come from: the Hugging Face hub (through hf-hub's cache, so a cached repo loads
//! offline), a local directory with the same files, a GGUF file (dequantized to the run dtype,
//! tokenizer rebuilt from its metadata), or random weights at a published shape.
//!
//! Every source ends as Hugging Face tensor names in a `VarBuilder` and goes through the same
//! [`Model::load`].

use anyhow::{bail, Context, Result};
use candle_core::quantized::gguf_file;
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::model::{AttnBackend, Config, Model};
use crate::tokenizer::{gguf_int, TextTokenizer};
use crate::tp::AllReduce;
use serde_json::Value;
use std::sync::Arc;

/// Where the weights come from, as command-line options (examples/llama and examples/serve
/// flatten it into their arguments).
#[derive(clap::Args, Debug, Clone)]
pub struct SourceArgs {
    /// Hugging Face repo id (config.json, tokenizer.json, safetensors), through the hf-hub cache.
    #[arg(long, group = "source")]
    pub model: Option<String>,
    /// Revision of --model.
    #[arg(long, default_value = "main")]
    pub revision: String,
    /// Local directory with config.json, tokenizer.json and model.safetensors (or sharded + index).
    #[arg(long, group = "source")]
    pub model_dir: Option<PathBuf>,
    /// A llama-family GGUF file; weights are dequantized to --dtype.
    #[arg(long, group = "source")]
    pub gguf: Option<PathBuf>,
    /// Random weights at the shape of --preset, created on the device (synthetic token ids).
    #[arg(long, group = "source", requires = "preset")]
    pub random_weights: bool,
    /// Shape for --random-weights.
    #[arg(long, value_enum)]
    pub preset: Option<Preset>,
    /// With --random-weights: keep only the first N layers of the preset (a model that does
    /// not fit the GPUs at hand, at its real layer shapes).
    #[arg(long, value_name = "N", requires = "random_weights")]
    pub layers: Option<usize>,
    /// A tokenizer.json to use instead of the source's.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
}

/// Published shapes for `--random-weights` ([`Config::preset`]).
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum Preset {
    #[value(name = "llama3-8b")]
    Llama3_8b,
    #[value(name = "llama3-70b")]
    Llama3_70b,
    #[value(name = "llama3-1b")]
    Llama3_1b,
    #[value(name = "smollm2-135m")]
    Smollm2_135m,
}

impl SourceArgs {
    pub fn source(&self) -> Result<Source> {
        Ok(if let Some(repo) = &self.model {
            Source::Hub {
                repo: repo.clone(),
                revision: self.revision.clone(),
            }
        } else if let Some(dir) = &self.model_dir {
            Source::Dir(dir.clone())
        } else if let Some(path) = &self.gguf {
            Source::Gguf(path.clone())
        } else if self.random_weights {
            let preset = match self.preset {
                Some(Preset::Llama3_8b) => "llama3-8b",
                Some(Preset::Llama3_70b) => "llama3-70b",
                Some(Preset::Llama3_1b) => "llama3-1b",
                Some(Preset::Smollm2_135m) | None => "smollm2-135m",
            };
            Source::Random {
                preset: preset.to_string(),
                layers: self.layers,
            }
        } else {
            bail!("choose a model: --model REPO_ID, --model-dir DIR, --gguf FILE or --random-weights --preset NAME")
        })
    }
}

/// `--dtype`.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum RunDtype {
    Bf16,
    F16,
    F32,
}

/// The run's device, dtype and sampling, as command-line options (examples/llama and
/// examples/serve flatten it into their arguments).
#[derive(clap::Args, Debug, Clone)]
pub struct RunArgs {
    /// Run dtype (default: bf16 on CUDA, f32 on CPU).
    #[arg(long, value_enum)]
    pub dtype: Option<RunDtype>,
    /// Run on the CPU even when a GPU is available.
    #[arg(long)]
    pub cpu: bool,
    /// Seed for sampling, synthetic prompts and loads (random weights use a fixed seed per
    /// tensor name, so they are the same at every --tp).
    #[arg(long, default_value_t = 299_792_458)]
    pub seed: u64,
    /// Sampling temperature; 0 (the default) is greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    /// Nucleus sampling threshold (with --temperature > 0).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f64,
    /// Keep candle's CUDA allocation defaults. Otherwise (these examples run on one stream) the
    /// device's tensors skip cudarc's cross-stream events (two created per allocation, one
    /// recorded per use) and freed memory stays in the stream-ordered pool instead of being
    /// returned to the driver at every synchronisation.
    #[arg(long)]
    pub cuda_defaults: bool,
}

impl RunArgs {
    /// The run's device (the first GPU when there is one, unless `--cpu`) and dtype (default
    /// bf16 on a GPU, f32 on the CPU); seeds the GPU's generator (candle's CPU generator cannot
    /// be seeded).
    /// With several ranks (`tp > 1`) on GPUs the device gets its own stream (see
    /// [`crate::tp::rank_devices`]).
    pub fn device_and_dtype(&self, tp: usize) -> Result<(Device, DType)> {
        let device = if self.cpu {
            Device::Cpu
        } else {
            match Device::cuda_if_available(0)? {
                Device::Cuda(_) if tp > 1 => Device::new_cuda_with_stream(0)?,
                d => d,
            }
        };
        let dtype = match self.dtype {
            Some(RunDtype::Bf16) => DType::BF16,
            Some(RunDtype::F16) => DType::F16,
            Some(RunDtype::F32) => DType::F32,
            None if device.is_cpu() => DType::F32,
            None => DType::BF16,
        };
        self.prepare(&device)?;
        Ok((device, dtype))
    }

    /// Seeds a GPU's generator and sets its allocation mode (every device of a run).
    pub fn prepare(&self, device: &Device) -> Result<()> {
        if !device.is_cpu() {
            device.set_seed(self.seed)?;
        }
        #[cfg(feature = "cuda")]
        if let (Device::Cuda(cuda), false) = (device, self.cuda_defaults) {
            one_stream_allocator(cuda)?;
        }
        Ok(())
    }
}

/// Tensor parallelism, as command-line options (examples/llama and examples/serve).
#[derive(clap::Args, Debug, Clone)]
pub struct TpArgs {
    /// Shard the model over N GPUs (0..N) of this host: whole heads and MLP columns per GPU, one
    /// thread per GPU, NCCL all-reduces (loaded at run time). On the CPU: N emulated ranks.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub tp: usize,
    /// The NCCL library to load for --tp > 1 (default: `libnccl.so.2` through the loader's
    /// search, then pip's nvidia-nccl wheels next to `python3`).
    #[arg(long, value_name = "PATH")]
    pub nccl_lib: Option<PathBuf>,
    /// Time every all-reduce with CUDA events and report their share of decoding (adds host
    /// work to each call: leave it off for tokens/sec).
    #[arg(long)]
    pub time_allreduce: bool,
}

impl TpArgs {
    /// Call first in `main`, before anything touches CUDA. With `--tp N > 1` on GPUs, CUDA's
    /// lazy module loading is turned off (`CUDA_MODULE_LOADING=EAGER`, unless set): a kernel's
    /// first launch under lazy loading loads it under the context lock and waits for the
    /// device's queue to drain, which can wait on an all-reduce that waits on the other rank,
    /// whose thread is blocked behind the same kind of launch (a known NCCL hazard).
    pub fn before_cuda(&self, run: &RunArgs) {
        if self.tp > 1 && !run.cpu && std::env::var_os("CUDA_MODULE_LOADING").is_none() {
            // Single-threaded here: nothing else reads the environment yet.
            std::env::set_var("CUDA_MODULE_LOADING", "EAGER");
        }
    }

    /// The group's devices (rank 0 on `first`, prepared like it) and all-reduce handles; says
    /// on stderr what was set up when there are several ranks.
    pub fn ranks(&self, run: &RunArgs, first: &Device) -> Result<Ranks> {
        let (ranks, line) = self.setup(run, first)?;
        if let Some(line) = line {
            eprintln!("{line}");
        }
        Ok(ranks)
    }

    fn setup(&self, run: &RunArgs, first: &Device) -> Result<(Ranks, Option<String>)> {
        let n = self.tp;
        if n == 0 {
            bail!("--tp must be at least 1")
        }
        if n == 1 {
            return Ok((Ranks::one(first), None));
        }
        let devices = crate::tp::rank_devices(first, n)?;
        for d in &devices[1..] {
            run.prepare(d)?;
        }
        if first.is_cpu() {
            let line = format!("tp {n}: {n} emulated ranks on the CPU (in-process all-reduce)");
            let comms = crate::tp::LocalSum::group(n);
            return Ok((Ranks { devices, comms }, Some(line)));
        }
        #[cfg(feature = "cuda")]
        {
            let (handles, info) =
                crate::nccl::group(n, self.nccl_lib.as_deref(), self.time_allreduce)?;
            let v = info.version;
            let line = format!(
                "tp {n}: GPUs 0..{n}, NCCL {}.{}.{} from {}, launch {:?}, CUDA_MODULE_LOADING={}",
                v / 10000,
                (v / 100) % 100,
                v % 100,
                info.path,
                crate::nccl::Launch::from_env()?,
                std::env::var("CUDA_MODULE_LOADING").unwrap_or_else(|_| "(unset)".into())
            );
            let comms = handles
                .into_iter()
                .map(|h| h as Arc<dyn AllReduce>)
                .collect();
            Ok((Ranks { devices, comms }, Some(line)))
        }
        #[cfg(not(feature = "cuda"))]
        bail!("--tp {n} on a GPU needs the `cuda` feature")
    }
}

/// Host work per CUDA allocation and use for a process that runs on one stream: no cudarc
/// events (candle's `disable_event_tracking`: they order uses across streams, and every tensor
/// here lives on the device's one stream) and a stream-ordered pool that keeps freed memory
/// (release threshold u64::MAX) rather than unmapping it at each synchronisation and mapping it
/// again on the next allocations.
#[cfg(feature = "cuda")]
fn one_stream_allocator(cuda: &candle_core::CudaDevice) -> Result<()> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    // SAFETY: every tensor of these examples is created and used on the device's one stream.
    unsafe { cuda.disable_event_tracking() };
    let dev = cuda.cuda_stream().context().cu_device();
    let mut pool = std::mem::MaybeUninit::<sys::CUmemoryPool>::uninit();
    // SAFETY: `pool` receives the device's default pool handle; the threshold is a u64 read by
    // the call.
    unsafe {
        let r = sys::cuDeviceGetDefaultMemPool(pool.as_mut_ptr(), dev);
        if r != sys::CUresult::CUDA_SUCCESS {
            anyhow::bail!("cuDeviceGetDefaultMemPool failed: {r:?}");
        }
        let mut threshold = u64::MAX;
        let r = sys::cuMemPoolSetAttribute(
            pool.assume_init(),
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            &mut threshold as *mut u64 as *mut std::ffi::c_void,
        );
        if r != sys::CUresult::CUDA_SUCCESS {
            anyhow::bail!("setting the memory pool's release threshold failed: {r:?}");
        }
    }
    Ok(())
}

#[derive(Clone, Debug)]
pub enum Source {
    Hub {
        repo: String,
        revision: String,
    },
    Dir(PathBuf),
    Gguf(PathBuf),
    Random {
        preset: String,
        layers: Option<usize>,
    },
}

/// The devices of a tensor-parallel group and each rank's all-reduce (none for one rank).
pub struct Ranks {
    pub devices: Vec<Device>,
    pub comms: Vec<Arc<dyn AllReduce>>,
}

impl Ranks {
    pub fn one(device: &Device) -> Ranks {
        Ranks {
            devices: vec![device.clone()],
            comms: vec![],
        }
    }

    fn first(&self) -> &Device {
        &self.devices[0]
    }

    /// The model over these ranks, rank `r` reading its weights through `vbs[r]`, with the
    /// rotary table sized for the config's positions.
    fn load(&self, vbs: &[VarBuilder], cfg: &Config, attn: AttnBackend) -> Result<Model> {
        Model::load_ranks(
            vbs,
            self.comms.clone(),
            cfg,
            cfg.max_position_embeddings,
            attn,
        )
    }
}

pub struct Loaded {
    pub model: Model,
    /// `None` for random weights (prompts are then synthetic token ids).
    pub tokenizer: Option<TextTokenizer>,
    pub description: String,
}

/// The files of a Hugging Face-layout checkpoint.
#[derive(Debug)]
pub struct ModelFiles {
    pub config: PathBuf,
    pub tokenizer: Option<PathBuf>,
    pub tokenizer_config: Option<PathBuf>,
    pub weights: Vec<PathBuf>,
}

/// A JSON file (config.json, tokenizer_config.json, a safetensors index) as a value tree.
pub fn read_json(path: &Path) -> Result<Value> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

/// A JSON number that is a non-negative integer (`4096` or `4096.0`) as a `usize`.
pub fn json_usize(v: &Value) -> Option<usize> {
    match v.as_u64() {
        Some(n) => usize::try_from(n).ok(),
        None => v
            .as_f64()
            .filter(|x| *x >= 0.0 && x.fract() == 0.0 && *x <= usize::MAX as f64)
            .map(|x| x as usize),
    }
}

const INDEX: &str = "model.safetensors.index.json";
const SINGLE: &str = "model.safetensors";

/// The shard files named in a `model.safetensors.index.json`, sorted, each once.
fn shard_names(index: &Path) -> Result<Vec<String>> {
    let j = read_json(index)?;
    let map = j
        .get("weight_map")
        .and_then(Value::as_object)
        .context("index: missing `weight_map`")?;
    let mut names = map
        .values()
        .map(|v| {
            v.as_str()
                .map(str::to_string)
                .context("index: weight_map values must be file names")
        })
        .collect::<Result<Vec<_>>>()?;
    names.sort();
    names.dedup();
    Ok(names)
}

pub fn dir_files(dir: &Path) -> Result<ModelFiles> {
    let existing = |name: &str| Some(dir.join(name)).filter(|p| p.is_file());
    let config =
        existing("config.json").with_context(|| format!("{}: no config.json", dir.display()))?;
    let weights = if let Some(index) = existing(INDEX) {
        shard_names(&index)?.iter().map(|n| dir.join(n)).collect()
    } else if let Some(single) = existing(SINGLE) {
        vec![single]
    } else {
        bail!("{}: neither {INDEX} nor {SINGLE}", dir.display())
    };
    Ok(ModelFiles {
        config,
        tokenizer: existing("tokenizer.json"),
        tokenizer_config: existing("tokenizer_config.json"),
        weights,
    })
}

/// Resolves the files of `repo` at `revision` through hf-hub: from its cache ($HF_HOME/hub or
/// ~/.cache/huggingface/hub) when present, else downloaded into it. With `HF_HUB_OFFLINE=1` only
/// the cache is used.
pub fn hub_files(repo_id: &str, revision: &str) -> Result<ModelFiles> {
    let offline = std::env::var("HF_HUB_OFFLINE")
        .map(|v| v == "1" || v.eq_ignore_ascii_case("true"))
        .unwrap_or(false);
    hub_files_in(hf_hub::Cache::from_env(), offline, repo_id, revision)
}

/// [`hub_files`] with an explicit cache directory.
pub fn hub_files_in(
    cache: hf_hub::Cache,
    offline: bool,
    repo_id: &str,
    revision: &str,
) -> Result<ModelFiles> {
    use hf_hub::{api::sync::ApiBuilder, Repo, RepoType};
    let repo = Repo::with_revision(repo_id.to_string(), RepoType::Model, revision.to_string());
    let cached = cache.repo(repo.clone());
    let api = if offline {
        None
    } else {
        let mut builder = ApiBuilder::from_cache(cache).with_progress(true);
        if let Ok(endpoint) = std::env::var("HF_ENDPOINT") {
            builder = builder.with_endpoint(endpoint);
        }
        Some(builder.build()?.repo(repo))
    };
    let fetch = |name: &str| -> Result<PathBuf> {
        if let Some(p) = cached.get(name) {
            return Ok(p);
        }
        match &api {
            Some(api) => {
                eprintln!("fetching {repo_id}@{revision}/{name}");
                api.get(name)
                    .with_context(|| format!("{repo_id}@{revision}: cannot get {name}"))
            }
            None => bail!(
                "{repo_id}@{revision}/{name} is not in the hf-hub cache and HF_HUB_OFFLINE is set"
            ),
        }
    };
    let config = fetch("config.json")?;
    let tokenizer = Some(fetch("tokenizer.json")?);
    let tokenizer_config = fetch("tokenizer_config.json").ok();
    // Prefer what the cache already has, so an offline run never probes the network.
    let index = match (cached.get(INDEX), cached.get(SINGLE)) {
        (Some(p), _) => Some(p),
        (None, Some(_)) => None,
        (None, None) => fetch(INDEX).ok(),
    };
    let weights = match index {
        Some(index) => {
            let names = shard_names(&index)?;
            let n = names.len();
            names
                .iter()
                .enumerate()
                .map(|(i, name)| {
                    eprintln!("shard {}/{n}: {name}", i + 1);
                    fetch(name)
                })
                .collect::<Result<Vec<_>>>()?
        }
        None => vec![fetch(SINGLE)?],
    };
    Ok(ModelFiles {
        config,
        tokenizer,
        tokenizer_config,
        weights,
    })
}

/// Loads a Hugging Face-layout checkpoint (config.json + safetensors + tokenizer files).
#[allow(dead_code)] // the single-GPU entry the tests use; the examples call the `_tp` forms
pub fn load_files(
    files: &ModelFiles,
    dtype: DType,
    device: &Device,
    attn: AttnBackend,
) -> Result<(Model, Option<TextTokenizer>)> {
    load_files_tp(files, dtype, &Ranks::one(device), attn)
}

/// [`load_files`] over the ranks of a tensor-parallel group (each maps the files and keeps its
/// part of every weight).
pub fn load_files_tp(
    files: &ModelFiles,
    dtype: DType,
    ranks: &Ranks,
    attn: AttnBackend,
) -> Result<(Model, Option<TextTokenizer>)> {
    let cfg = Config::from_hf_json(&read_json(&files.config)?)?;
    let tokenizer = match &files.tokenizer {
        Some(t) => Some(TextTokenizer::from_hf_files(
            t,
            files.tokenizer_config.as_deref(),
            &cfg.eos_token_ids,
        )?),
        None => None,
    };
    for (i, w) in files.weights.iter().enumerate() {
        let size = std::fs::metadata(w).map(|m| m.len()).unwrap_or(0);
        eprintln!(
            "weights {}/{}: {} ({:.1} MiB)",
            i + 1,
            files.weights.len(),
            w.display(),
            size as f64 / (1 << 20) as f64
        );
    }
    let vbs = ranks
        .devices
        .iter()
        .map(|device| {
            // SAFETY: the files are memory-mapped read-only; they must not change while loading.
            Ok(unsafe { VarBuilder::from_mmaped_safetensors(&files.weights, dtype, device)? })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((ranks.load(&vbs, &cfg, attn)?, tokenizer))
}

#[allow(dead_code)] // the single-GPU entry the tests use; the examples call the `_tp` forms
pub fn load(
    source: &Source,
    tokenizer_override: Option<&Path>,
    dtype: DType,
    device: &Device,
    attn: AttnBackend,
) -> Result<Loaded> {
    load_tp(source, tokenizer_override, dtype, &Ranks::one(device), attn)
}

/// [`load`] over the ranks of a tensor-parallel group.
pub fn load_tp(
    source: &Source,
    tokenizer_override: Option<&Path>,
    dtype: DType,
    ranks: &Ranks,
    attn: AttnBackend,
) -> Result<Loaded> {
    let (model, tokenizer, description) = match source {
        Source::Hub { repo, revision } => {
            let files = hub_files(repo, revision)?;
            let (m, t) = load_files_tp(&files, dtype, ranks, attn)?;
            (m, t, format!("{repo}@{revision}"))
        }
        Source::Dir(dir) => {
            let files = dir_files(dir)?;
            let (m, t) = load_files_tp(&files, dtype, ranks, attn)?;
            (m, t, dir.display().to_string())
        }
        Source::Gguf(path) => {
            let (m, t) = load_gguf(path, dtype, ranks, attn)?;
            let t = match (t, tokenizer_override) {
                (Ok(t), _) => Some(t),
                // An unsupported embedded tokenizer is fine when --tokenizer replaces it.
                (Err(e), Some(_)) => {
                    eprintln!("gguf: embedded tokenizer not used: {e:#}");
                    None
                }
                (Err(e), None) => return Err(e),
            };
            (m, t, path.display().to_string())
        }
        Source::Random { preset, layers } => {
            let mut cfg = Config::preset(preset)?;
            let mut description = format!("random weights, preset {preset}");
            if let Some(n) = *layers {
                if n == 0 || n > cfg.num_hidden_layers {
                    bail!(
                        "--layers {n}: preset {preset} has {} layers (1..={} allowed)",
                        cfg.num_hidden_layers,
                        cfg.num_hidden_layers
                    )
                }
                cfg.num_hidden_layers = n;
                description += &format!(" (first {n} layers)");
            }
            (random_model(&cfg, dtype, ranks, attn)?, None, description)
        }
    };
    let tokenizer = match tokenizer_override {
        Some(path) => {
            let cfg = model.config();
            let mut t = TextTokenizer::from_hf_files(path, None, &cfg.eos_token_ids)?;
            // Keep the source's chat format and stop tokens when the override has none.
            if let Some(orig) = tokenizer {
                t.chat = t.chat.or(orig.chat);
                t.eos_ids.extend(orig.eos_ids);
                t.eos_ids.sort_unstable();
                t.eos_ids.dedup();
            }
            Some(t)
        }
        None => tokenizer,
    };
    Ok(Loaded {
        model,
        tokenizer,
        description,
    })
}

/// Random weights (normal, std 0.02; norms at 1) created on each rank's device as the model
/// asks for them ([`RandomWeights`]), so no full copy of the model exists anywhere.
pub fn random_model(cfg: &Config, dtype: DType, ranks: &Ranks, attn: AttnBackend) -> Result<Model> {
    cfg.validate()?;
    eprintln!(
        "creating {:.2}B random parameters ({:?}) on {} device(s)",
        cfg.num_params() as f64 * 1e-9,
        dtype,
        ranks.devices.len()
    );
    let vbs: Vec<VarBuilder> = ranks
        .devices
        .iter()
        .map(|d| {
            let backend: Box<dyn candle_nn::var_builder::SimpleBackend> = Box::new(RandomWeights {
                tied: cfg.tie_word_embeddings,
            });
            VarBuilder::from_backend(backend, dtype, d.clone())
        })
        .collect();
    ranks.load(&vbs, cfg, attn)
}

/// A weight source that makes each tensor when asked: norms (`*norm.weight`) are ones, every
/// other weight is normal with std 0.02 from a generator seeded by the tensor's name. A tensor's
/// values depend only on its name and shape, so every rank of a tensor-parallel group (and a
/// single-GPU run) sees the same model. On a GPU the device's generator is reseeded per tensor;
/// on the CPU (whose candle generator cannot be seeded) a host generator fills it.
struct RandomWeights {
    tied: bool,
}

/// FNV-1a of the name: the tensor's seed.
fn name_seed(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

impl candle_nn::var_builder::SimpleBackend for RandomWeights {
    fn get(
        &self,
        s: candle_core::Shape,
        name: &str,
        _: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        if name.ends_with("norm.weight") {
            return Tensor::ones(s, dtype, dev);
        }
        let seed = name_seed(name);
        let t = if dev.is_cpu() {
            let mut rng = crate::generate::SplitMix64(seed);
            let n = s.elem_count();
            let mut v = Vec::with_capacity(n);
            while v.len() < n {
                // Box-Muller: two normals from two uniforms in (0, 1].
                let (u1, u2) = (1.0 - rng.next_f64(), rng.next_f64());
                let r = (-2.0 * u1.ln()).sqrt() * 0.02;
                let a = std::f64::consts::TAU * u2;
                v.push((r * a.cos()) as f32);
                v.push((r * a.sin()) as f32);
            }
            v.truncate(n);
            Tensor::from_vec(v, s, dev)?
        } else {
            dev.set_seed(seed)?;
            Tensor::randn(0f32, 0.02, s, dev)?
        };
        t.to_dtype(dtype)
    }

    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> candle_core::Result<Tensor> {
        Err(candle_core::Error::Msg(format!(
            "random weights: {name} asked for without a shape"
        )))
    }

    fn contains_tensor(&self, name: &str) -> bool {
        !(name.ends_with(".bias") || (name == "lm_head.weight" && self.tied))
    }
}

fn gguf_config(content: &gguf_file::Content, arch: &str) -> Result<Config> {
    let md = &content.metadata;
    let int = |k: &str| {
        md.get(&format!("{arch}.{k}"))
            .and_then(gguf_int)
            .map(|x| x as usize)
    };
    let float = |k: &str| {
        md.get(&format!("{arch}.{k}")).and_then(|v| match v {
            gguf_file::Value::F32(x) => Some(*x as f64),
            gguf_file::Value::F64(x) => Some(*x),
            _ => None,
        })
    };
    let req = |k: &str| int(k).with_context(|| format!("gguf: missing `{arch}.{k}`"));
    let hidden_size = req("embedding_length")?;
    let num_attention_heads = req("attention.head_count")?;
    let embd = content
        .tensor_infos
        .get("token_embd.weight")
        .context("gguf: no token_embd.weight")?;
    let id = |k: &str| md.get(k).and_then(gguf_int).map(|x| x as u32);
    Ok(Config {
        hidden_size,
        intermediate_size: req("feed_forward_length")?,
        vocab_size: embd.shape.dims()[0],
        num_hidden_layers: req("block_count")?,
        num_attention_heads,
        num_key_value_heads: int("attention.head_count_kv").unwrap_or(num_attention_heads),
        head_dim: int("attention.key_length").unwrap_or(hidden_size / num_attention_heads),
        rms_norm_eps: float("attention.layer_norm_rms_epsilon").unwrap_or(1e-5),
        rope_theta: float("rope.freq_base").unwrap_or(10_000.0),
        rope_scaling: None,
        rope_freq_factors: None,
        max_position_embeddings: int("context_length").unwrap_or(4096),
        tie_word_embeddings: !content.tensor_infos.contains_key("output.weight"),
        bos_token_id: id("tokenizer.ggml.bos_token_id"),
        eos_token_ids: id("tokenizer.ggml.eos_token_id").into_iter().collect(),
    })
}

/// llama.cpp's name for a tensor -> the Hugging Face name.
fn hf_name(gguf: &str) -> Option<String> {
    let fixed = match gguf {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(f) = fixed {
        return Some(f.to_string());
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    let (part, kind) = rest.rsplit_once('.')?; // kind: weight | bias
    let hf = match part {
        "attn_norm" => "input_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}.{kind}"))
}

/// Undoes llama.cpp's reordering of Q/K rows. Its converter stores each head's rows as
/// interleaved pairs (for rotary on adjacent dimensions): GGUF row `2i + j` of a head is Hugging
/// Face row `j * d/2 + i`. Splitting the rows into `(heads, d/2, 2)` and swapping the last two
/// axes restores the half-split order that `model.rs` rotates.
fn unpermute_rows(w: &Tensor, heads: usize) -> Result<Tensor> {
    let dims = w.dims().to_vec();
    let rows = dims[0];
    let half = rows / heads / 2;
    let mut split = vec![heads, half, 2];
    split.extend_from_slice(&dims[1..]);
    Ok(w.reshape(split)?
        .transpose(1, 2)?
        .contiguous()?
        .reshape(dims)?)
}

/// Reads a llama-family GGUF file: weights dequantized on `device` and cast to `dtype`,
/// tokenizer rebuilt from the metadata (an error there is returned beside the model, so that a
/// `--tokenizer` file can stand in for an unsupported one).
pub fn load_gguf(
    path: &Path,
    dtype: DType,
    ranks: &Ranks,
    attn: AttnBackend,
) -> Result<(Model, Result<TextTokenizer>)> {
    let device = ranks.first();
    let mut file =
        std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let content = gguf_file::Content::read(&mut file)
        .with_context(|| format!("reading gguf header of {}", path.display()))?;
    let arch = content
        .metadata
        .get("general.architecture")
        .and_then(|v| v.to_string().ok())
        .cloned()
        .unwrap_or_else(|| "llama".to_string());
    // Only the llama converter permutes Q/K; Qwen2 keeps Hugging Face order.
    let permuted = match arch.as_str() {
        "llama" | "mistral" | "granite" => true,
        "qwen2" => false,
        other => {
            bail!("gguf: architecture `{other}` is not supported (llama, mistral, granite, qwen2)")
        }
    };
    let mut cfg = gguf_config(&content, &arch)?;
    let tokenizer = TextTokenizer::from_gguf(&content);

    if content.tensor_infos.contains_key("rope_freqs.weight") {
        let f = content
            .tensor(&mut file, "rope_freqs.weight", &Device::Cpu)?
            .dequantize(&Device::Cpu)?;
        cfg.rope_freq_factors = Some(f.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?);
    }

    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    let total = names.len();
    let mut tensors = HashMap::new();
    let mut skipped = Vec::new();
    for (n, name) in names.into_iter().enumerate() {
        let Some(hf) = hf_name(name) else {
            skipped.push(name.clone());
            continue;
        };
        let q = content.tensor(&mut file, name, device)?;
        let mut w = q.dequantize(device)?;
        if permuted && hf.contains("self_attn.q_proj") {
            w = unpermute_rows(&w, cfg.num_attention_heads)?;
        } else if permuted && hf.contains("self_attn.k_proj") {
            w = unpermute_rows(&w, cfg.num_key_value_heads)?;
        }
        tensors.insert(hf, w.to_dtype(dtype)?);
        if (n + 1) % 64 == 0 || n + 1 == total {
            eprintln!("gguf: {}/{total} tensors dequantized", n + 1);
        }
    }
    if skipped.iter().any(|s| s != "rope_freqs.weight") {
        eprintln!("gguf: ignored tensors: {skipped:?}");
    }
    // Dequantized once, on rank 0's device; each rank copies out its part.
    let vbs: Vec<VarBuilder> = ranks
        .devices
        .iter()
        .map(|d| VarBuilder::from_tensors(tensors.clone(), dtype, d))
        .collect();
    Ok((ranks.load(&vbs, &cfg, attn)?, tokenizer))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpermute_inverts_llama_cpp_permutation() -> Result<()> {
        // Two heads of dimension 4, 3 input features; row r holds r everywhere.
        let (heads, d, cols) = (2usize, 4usize, 3usize);
        let hf = Tensor::arange(0f32, (heads * d) as f32, &Device::Cpu)?
            .unsqueeze(1)?
            .broadcast_as((heads * d, cols))?
            .contiguous()?;
        // llama.cpp: reshape(heads, 2, d/2, cols).swapaxes(1, 2).
        let gguf = hf
            .reshape((heads, 2, d / 2, cols))?
            .transpose(1, 2)?
            .contiguous()?
            .reshape((heads * d, cols))?;
        let rows: Vec<f32> = gguf.narrow(1, 0, 1)?.flatten_all()?.to_vec1()?;
        assert_eq!(rows, [0., 2., 1., 3., 4., 6., 5., 7.]);
        let back = unpermute_rows(&gguf, heads)?;
        assert_eq!(back.to_vec2::<f32>()?, hf.to_vec2::<f32>()?);
        Ok(())
    }
}
