//! End-to-end checks of the LLaMA example (examples/llama/) on the CPU: eager and flashcore
//! attention must generate the same greedy tokens.
//!
//! 1. A tiny random LLaMA (tests/fixtures/tiny_llama.rs) written to a temporary directory (sharded safetensors + index,
//!    config.json, tokenizer.json) loads through the example's `--model-dir` path.
//! 2. SmolLM2-135M-Instruct (GGUF, Q4_1) answers "What is the capital of France?" with Paris.
//!    The file comes from `scripts/fetch-smollm2.sh`; it is looked up in $FLASHCORE_SMOLLM2_GGUF,
//!    then in the script's default cache. Without it the test says it is skipped and passes, unless
//!    FLASHCORE_REQUIRE_MODEL=1 (CI) makes the missing file a failure.

#![allow(dead_code)] // the example's modules carry CLI-only helpers

#[path = "../examples/llama/generate.rs"]
mod generate;
#[path = "../examples/llama/load.rs"]
mod load;
#[path = "../examples/llama/model.rs"]
mod model;
#[cfg(feature = "cuda")]
#[path = "../examples/llama/nccl.rs"]
mod nccl;
#[path = "fixtures/tiny_llama.rs"]
mod tiny_llama;
#[path = "../examples/llama/tokenizer.rs"]
mod tokenizer;
#[path = "../examples/llama/tp.rs"]
mod tp;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};

use generate::{forced_logits, generate, teacher_forced_agreement, Sampler};
use load::Source;
use model::{AttnBackend, KvCache, Model};
use tiny_llama::{smollm2_gguf, write_tiny_llama, TempDir};

fn greedy(
    model: &mut Model,
    backend: AttnBackend,
    prompt: &[u32],
    n: usize,
    eos: &[u32],
) -> Result<Vec<u32>> {
    model.attn = backend;
    let mut cache = KvCache::new(model, 1, prompt.len() + n, DType::F32)?;
    let g = generate(
        model,
        &mut cache,
        prompt,
        n,
        eos,
        &mut Sampler::greedy(),
        &mut |_| Ok(()),
    )?;
    Ok(g.tokens)
}

#[test]
fn tiny_llama_model_dir_eager_matches_flashcore() -> Result<()> {
    // Written in hf-hub's cache layout, so that the same files also load as `--model REPO_ID`
    // (offline, from the cache).
    let tmp = TempDir::new("tiny-llama")?;
    let hub = tmp.0.join("hub");
    let repo_dir = hub.join("models--flashcore--tiny-llama");
    let snapshot = repo_dir.join("snapshots/0123456789abcdef");
    std::fs::create_dir_all(&snapshot)?;
    std::fs::create_dir_all(repo_dir.join("refs"))?;
    std::fs::write(repo_dir.join("refs/main"), "0123456789abcdef")?;
    write_tiny_llama(&snapshot)?;

    let loaded = load::load(
        &Source::Dir(snapshot.clone()),
        None,
        DType::F32,
        &Device::Cpu,
        AttnBackend::Eager,
    )?;
    let mut model = loaded.model;
    let tok = loaded.tokenizer.expect("tokenizer.json was written");
    let cfg = model.config().clone();
    assert_eq!(
        (
            cfg.num_hidden_layers,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim
        ),
        (2, 4, 2, 16)
    );
    assert!(!cfg.tie_word_embeddings);
    assert_eq!(tok.eos_ids, vec![cfg.vocab_size as u32 - 1]);

    let prompt = tok.encode("the thin hen went in there", true)?;
    assert!(prompt.len() > 10, "prompt: {prompt:?}");
    let n = 24;
    // No EOS: always compare the full length.
    let eager = greedy(&mut model, AttnBackend::Eager, &prompt, n, &[])?;
    let fused = greedy(&mut model, AttnBackend::Flashcore, &prompt, n, &[])?;
    println!(
        "tiny llama, prompt {} tokens\n  eager:     {eager:?}\n  flashcore: {fused:?}",
        prompt.len()
    );
    assert_eq!(eager.len(), n);
    assert_eq!(
        eager, fused,
        "greedy tokens differ between eager and flashcore"
    );

    // The hub path resolves the same files from the cache and generates the same tokens.
    let files = load::hub_files_in(
        hf_hub::Cache::new(hub),
        true,
        "flashcore/tiny-llama",
        "main",
    )?;
    assert_eq!(files.weights.len(), 2);
    let (mut hub_model, _) =
        load::load_files(&files, DType::F32, &Device::Cpu, AttnBackend::Flashcore)?;
    assert_eq!(
        greedy(&mut hub_model, AttnBackend::Flashcore, &prompt, n, &[])?,
        eager
    );

    // Teacher-forced: both backends agree at every position, decoding and in one pass.
    let mut cache = KvCache::new(&model, 1, prompt.len() + n, DType::F32)?;
    let a = teacher_forced_agreement(&mut model, &mut cache, &prompt, &eager)?;
    println!("  agreement: {a:?}");
    assert_eq!((a.decode_agree, a.prefill_agree), (n, n));
    assert!(
        a.max_abs_logit_diff < 1e-3,
        "logits differ by {}",
        a.max_abs_logit_diff
    );

    // The KV cache path computes the same logits as one pass over the whole sequence.
    for backend in [AttnBackend::Eager, AttnBackend::Flashcore] {
        model.attn = backend;
        let all: Vec<u32> = prompt.iter().chain(&eager).copied().collect();
        let mut cache = KvCache::new(&model, 1, all.len(), DType::F32)?;
        let full = model
            .forward_all(
                &Tensor::new(all.as_slice(), &Device::Cpu)?.unsqueeze(0)?,
                &mut cache,
            )?
            .squeeze(0)?;
        cache.reset();
        let split = prompt.len();
        let mut rows = vec![model
            .forward_all(
                &Tensor::new(&all[..split], &Device::Cpu)?.unsqueeze(0)?,
                &mut cache,
            )?
            .squeeze(0)?];
        for &t in &all[split..] {
            rows.push(
                model.forward_last(&Tensor::new(&[t], &Device::Cpu)?.unsqueeze(0)?, &mut cache)?,
            );
        }
        let stepped = Tensor::cat(&rows, 0)?;
        let diff = (full - stepped)?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f32>()?;
        println!(
            "  {}: one pass vs cached decode, max |logit diff| = {diff:.3e}",
            backend.name()
        );
        assert!(
            diff < 1e-3,
            "{}: cached decode differs from one pass by {diff}",
            backend.name()
        );
    }
    Ok(())
}

/// The model's one attention entry point on both backends, reading K/V as narrowed views of a
/// preallocated cache (as the decoder does): prefill (t = L), chunked prefill (t < L) and
/// decode (t = 1), GQA 9:3 and 4:1.
#[test]
fn attend_eager_matches_flashcore_on_cache_views() -> Result<()> {
    let dev = Device::Cpu;
    for (hq, hkv) in [(9usize, 3usize), (4, 1)] {
        let (cap, d) = (48usize, 64usize);
        let k_cache = Tensor::zeros((1, cap, hkv, d), DType::F32, &dev)?;
        let v_cache = Tensor::zeros((1, cap, hkv, d), DType::F32, &dev)?;
        k_cache.slice_set(&Tensor::randn(0f32, 1., (1, 40, hkv, d), &dev)?, 1, 0)?;
        v_cache.slice_set(&Tensor::randn(0f32, 1., (1, 40, hkv, d), &dev)?, 1, 0)?;
        for (t, l) in [(33usize, 33usize), (7, 40), (1, 40)] {
            let q = Tensor::randn(0f32, 1., (1, t, hq, d), &dev)?;
            let (k, v) = (k_cache.narrow(1, 0, l)?, v_cache.narrow(1, 0, l)?);
            let mask = model::causal_mask(t, l, &dev)?;
            let eager = model::attend(&q, &k, &v, AttnBackend::Eager, mask.as_ref())?;
            let fused = model::attend(&q, &k, &v, AttnBackend::Flashcore, None)?;
            assert_eq!(fused.dims(), &[1, t, hq, d]);
            let diff = (eager - fused)?
                .abs()?
                .flatten_all()?
                .max(0)?
                .to_scalar::<f32>()?;
            assert!(
                diff < 1e-5,
                "hq {hq} hkv {hkv} t {t} L {l}: max diff {diff}"
            );
        }
    }
    Ok(())
}

#[test]
fn smollm2_gguf_says_paris_with_both_backends() -> Result<()> {
    let Some(path) = smollm2_gguf() else {
        println!("SKIPPED: SmolLM2 GGUF not found (run scripts/fetch-smollm2.sh or set FLASHCORE_SMOLLM2_GGUF)");
        return Ok(());
    };
    let loaded = load::load(
        &Source::Gguf(path.clone()),
        None,
        DType::F32,
        &Device::Cpu,
        AttnBackend::Eager,
    )?;
    let mut model = loaded.model;
    let tok = loaded.tokenizer.expect("gguf tokenizer");
    let cfg = model.config().clone();
    assert_eq!(
        (
            cfg.num_hidden_layers,
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim
        ),
        (30, 576, 9, 3, 64)
    );
    assert!(cfg.tie_word_embeddings);
    assert_eq!(cfg.rope_theta, 100_000.0);
    assert!(tok.eos_ids.contains(&2), "eos ids {:?}", tok.eos_ids);

    // The rebuilt tokenizer: special tokens are single ids, digits are split one by one, and
    // text survives a round trip.
    assert_eq!(tok.encode("<|im_start|>", false)?, vec![1]);
    let digits = tok.encode("12345", false)?;
    assert_eq!(digits.len(), 5, "digits: {digits:?}");
    let text = "Hello, world!  Ünïcödé — 42 apples\n\tand 3.14";
    assert_eq!(tok.decode(&tok.encode(text, false)?)?, text);

    let chat = tok.chat.clone().expect("chat template detected");
    let rendered = chat.render("What is the capital of France?", None);
    assert!(
        rendered.ends_with(
            "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
        ),
        "{rendered:?}"
    );
    let prompt = tok.encode_prompt("What is the capital of France?", true, None)?;

    let n = 20;
    let eager = greedy(&mut model, AttnBackend::Eager, &prompt, n, &tok.eos_ids)?;
    let fused = greedy(&mut model, AttnBackend::Flashcore, &prompt, n, &tok.eos_ids)?;
    let (text_e, text_f) = (tok.decode(&eager)?, tok.decode(&fused)?);
    println!(
        "SmolLM2 ({}), prompt {} tokens",
        path.display(),
        prompt.len()
    );
    println!("  eager:     {text_e:?} {eager:?}");
    println!("  flashcore: {text_f:?} {fused:?}");
    assert_eq!(
        eager, fused,
        "greedy tokens differ between eager and flashcore"
    );
    assert!(text_e.contains("Paris"), "answer without Paris: {text_e:?}");
    Ok(())
}

/// The eager baseline computes long prefills in query-row chunks (candle's element-wise CUDA
/// kernels take 32-bit element counts): chunked and whole give the same output.
#[test]
fn eager_attention_chunks_match_whole() -> Result<()> {
    let dev = Device::Cpu;
    let (b, t, l, hq, hkv, d) = (2, 37, 53, 4, 2, 16);
    let q = Tensor::randn(0f32, 1., (b, t, hq, d), &dev)?;
    let k = Tensor::randn(0f32, 1., (b, l, hkv, d), &dev)?;
    let v = Tensor::randn(0f32, 1., (b, l, hkv, d), &dev)?;
    let mask = model::causal_mask(t, l, &dev)?;
    let whole = model::eager_attention_chunked(&q, &k, &v, mask.as_ref(), usize::MAX)?;
    // 5 query rows per chunk: 8 chunks, the last one ragged.
    let chunked = model::eager_attention_chunked(&q, &k, &v, mask.as_ref(), b * hq * l * 5)?;
    assert_eq!(chunked.dims(), &[b, t, hq, d]);
    let diff = (whole - chunked)?
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_scalar::<f32>()?;
    assert!(diff < 1e-5, "chunked eager differs from whole by {diff}");
    Ok(())
}

/// Largest |x| of a tensor.
fn max_abs(t: &Tensor) -> Result<f32> {
    Ok(t.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?)
}

/// Tensor parallelism, emulated on the CPU: two ranks (threads), each with half of the heads
/// and of the MLP columns, summing partial outputs through `tp::LocalSum`, compute the logits
/// of the unsharded model: decoding step by step with either attention backend, and the paged
/// path of examples/serve. Without the all-reduces (or with a wrong split) the logits differ.
#[test]
fn tiny_llama_tensor_parallel_two_ranks_equal_one() -> Result<()> {
    let tmp = TempDir::new("tiny-llama-tp")?;
    write_tiny_llama(&tmp.0)?;
    let files = load::dir_files(&tmp.0)?;
    let (mut one, _) = load::load_files(&files, DType::F32, &Device::Cpu, AttnBackend::Eager)?;
    let ranks = load::Ranks {
        devices: vec![Device::Cpu; 2],
        comms: tp::LocalSum::group(2),
    };
    let (mut two, _) = load::load_files_tp(&files, DType::F32, &ranks, AttnBackend::Eager)?;
    assert_eq!((one.tp(), two.tp()), (1, 2));
    let vocab = one.config().vocab_size as u32;
    let prompt: Vec<u32> = (0..23u32).map(|i| (i * 37 + 5) % vocab).collect();
    let n = 12;
    for backend in [AttnBackend::Eager, AttnBackend::Flashcore] {
        one.attn = backend;
        two.attn = backend;
        let mut c1 = KvCache::new(&one, 1, prompt.len() + n, DType::F32)?;
        let mut c2 = KvCache::new(&two, 1, prompt.len() + n, DType::F32)?;
        let g1 = generate(
            &one,
            &mut c1,
            &prompt,
            n,
            &[],
            &mut Sampler::greedy(),
            &mut |_| Ok(()),
        )?;
        let g2 = generate(
            &two,
            &mut c2,
            &prompt,
            n,
            &[],
            &mut Sampler::greedy(),
            &mut |_| Ok(()),
        )?;
        assert_eq!(g1.tokens, g2.tokens, "{backend:?}: greedy tokens differ");
        let l1 = forced_logits(&one, &mut c1, &prompt, &g1.tokens)?;
        let l2 = forced_logits(&two, &mut c2, &prompt, &g1.tokens)?;
        let (diff, scale) = (max_abs(&(&l1 - &l2)?)?, max_abs(&l1)?);
        println!("  tp 2 vs 1 ({backend:?}): max |logit diff| {diff:.3e} of {scale:.3}");
        assert!(diff <= 1e-4 * scale, "{backend:?}: logits differ by {diff}");
    }

    // The paged path: a prefill chunk and a decode step in one batch.
    let forward_paged = |m: &Model| -> Result<Tensor> {
        let pools = m.kv_buffers(8, 16, DType::F32)?;
        let seqs = [
            model::SeqStep {
                tokens: &prompt,
                cached: 0,
                pages: &[3, 1],
            },
            model::SeqStep {
                tokens: &prompt[..5],
                cached: 0,
                pages: &[6],
            },
        ];
        let batch = model::PagedBatch::new(&seqs, 16, &m.devices())?;
        let first = m.forward_paged(&batch, &pools)?;
        let next = [3u32];
        let step = [model::SeqStep {
            tokens: &next,
            cached: prompt.len(),
            pages: &[3, 1],
        }];
        let batch = model::PagedBatch::new(&step, 16, &m.devices())?;
        Ok(Tensor::cat(&[first, m.forward_paged(&batch, &pools)?], 0)?)
    };
    let (p1, p2) = (forward_paged(&one)?, forward_paged(&two)?);
    assert_eq!(p1.dims(), &[3, vocab as usize]);
    let (diff, scale) = (max_abs(&(&p1 - &p2)?)?, max_abs(&p1)?);
    assert!(diff <= 1e-4 * scale, "paged: logits differ by {diff}");
    Ok(())
}

/// A split that does not divide the heads is refused, naming the option and the counts.
#[test]
fn tensor_parallel_refuses_uneven_heads() -> Result<()> {
    let tmp = TempDir::new("tiny-llama-tp3")?;
    write_tiny_llama(&tmp.0)?;
    let files = load::dir_files(&tmp.0)?;
    let ranks = load::Ranks {
        devices: vec![Device::Cpu; 3],
        comms: tp::LocalSum::group(3),
    };
    let err = match load::load_files_tp(&files, DType::F32, &ranks, AttnBackend::Eager) {
        Ok(_) => panic!("3 ranks over 2 K/V heads were accepted"),
        Err(e) => format!("{e:#}"),
    };
    assert!(
        err.contains("--tp 3") && err.contains("2 key-value heads"),
        "{err}"
    );
    Ok(())
}

/// The grouped NCCL launch's meeting point (`tp::Meeting`), with threads and a recording issuer:
/// every round is issued once, by one thread, with every rank's call in rank order, and every
/// rank sees the round's outcome (an error included).
#[test]
fn tensor_parallel_meeting_issues_each_round_once() -> Result<()> {
    use std::sync::Mutex;
    let ranks = 3;
    let rounds = 200;
    let meeting = tp::Meeting::<(usize, usize)>::new(ranks);
    let issued: Mutex<Vec<Vec<(usize, usize)>>> = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for rank in 0..ranks {
            let (meeting, issued) = (&meeting, &issued);
            s.spawn(move || {
                for round in 0..rounds {
                    let r = meeting.meet(rank, (rank, round), |calls| {
                        issued.lock().unwrap().push(calls.to_vec());
                        if round == 7 {
                            anyhow::bail!("round 7 fails")
                        }
                        Ok(())
                    });
                    assert_eq!(r.is_err(), round == 7, "rank {rank} round {round}: {r:?}");
                }
            });
        }
    });
    let issued = issued.into_inner().unwrap();
    assert_eq!(issued.len(), rounds);
    for (round, calls) in issued.iter().enumerate() {
        let want: Vec<(usize, usize)> = (0..ranks).map(|r| (r, round)).collect();
        assert_eq!(calls, &want, "round {round}");
    }
    Ok(())
}
