//! Text in and out: a `tokenizers::Tokenizer` plus what the model needs around it (BOS to
//! prepend, end-of-turn ids, chat format). Built either from `tokenizer.json` (+ optional
//! `tokenizer_config.json`) or rebuilt from a GGUF file's `tokenizer.ggml.*` metadata.
//!
//! Chat templates are Jinja in the checkpoints; instead of a template engine this recognises the
//! few formats the LLaMA family uses (ChatML, Llama 3, Llama 2 `[INST]`, Zephyr) from markers in
//! the template and writes the single-user-turn prompt directly.

use anyhow::{bail, Context, Result};
use candle_core::quantized::gguf_file;
use std::collections::HashMap;
use std::path::Path;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::decoders::DecoderWrapper;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::{Prepend, Replace, Sequence as NormalizerSequence};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::NormalizerWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

use serde_json::Value;

/// Single-turn chat prompt formats.
#[derive(Clone, Debug, PartialEq)]
pub enum ChatFormat {
    /// `<|im_start|>user\n...<|im_end|>\n<|im_start|>assistant\n` (SmolLM2, Qwen2). When the
    /// template inserts a fixed system turn for conversations without one, it is kept here.
    ChatMl { default_system: Option<String> },
    /// `<|start_header_id|>user<|end_header_id|>\n\n...<|eot_id|>` (Llama 3).
    Llama3,
    /// `<s>[INST] ... [/INST]` (Llama 2 chat).
    Llama2,
    /// `<|user|>\n...</s>\n<|assistant|>\n` (TinyLlama chat, Zephyr).
    Zephyr,
}

impl ChatFormat {
    /// Recognises the format of a Jinja chat template; `None` if unknown.
    pub fn detect(template: &str) -> Option<ChatFormat> {
        if template.contains("<|im_start|>") {
            Some(ChatFormat::ChatMl {
                default_system: chatml_default_system(template),
            })
        } else if template.contains("<|start_header_id|>") {
            Some(ChatFormat::Llama3)
        } else if template.contains("[INST]") {
            Some(ChatFormat::Llama2)
        } else if template.contains("<|user|>") {
            Some(ChatFormat::Zephyr)
        } else {
            None
        }
    }

    /// The prompt text for one user message, ending where the assistant's reply starts.
    pub fn render(&self, user: &str, system: Option<&str>) -> String {
        match self {
            ChatFormat::ChatMl { default_system } => {
                let mut s = String::new();
                if let Some(sys) = system.or(default_system.as_deref()) {
                    s += &format!("<|im_start|>system\n{sys}<|im_end|>\n");
                }
                s + &format!("<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")
            }
            ChatFormat::Llama3 => {
                let mut s = String::from("<|begin_of_text|>");
                if let Some(sys) = system {
                    s += &format!("<|start_header_id|>system<|end_header_id|>\n\n{sys}<|eot_id|>");
                }
                s + &format!(
                    "<|start_header_id|>user<|end_header_id|>\n\n{user}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
                )
            }
            ChatFormat::Llama2 => match system {
                Some(sys) => format!("<s>[INST] <<SYS>>\n{sys}\n<</SYS>>\n\n{user} [/INST]"),
                None => format!("<s>[INST] {user} [/INST]"),
            },
            ChatFormat::Zephyr => {
                let mut s = String::new();
                if let Some(sys) = system {
                    s += &format!("<|system|>\n{sys}</s>\n");
                }
                s + &format!("<|user|>\n{user}</s>\n<|assistant|>\n")
            }
        }
    }

    /// Tokens that end an assistant turn in this format.
    fn end_tokens(&self) -> &'static [&'static str] {
        match self {
            ChatFormat::ChatMl { .. } => &["<|im_end|>"],
            ChatFormat::Llama3 => &["<|eot_id|>", "<|end_of_text|>"],
            ChatFormat::Llama2 | ChatFormat::Zephyr => &["</s>"],
        }
    }
}

/// The literal system message a ChatML template inserts when the conversation has none, e.g.
/// SmolLM2-Instruct's `'<|im_start|>system\nYou are a helpful AI assistant named SmolLM, ...'`.
fn chatml_default_system(template: &str) -> Option<String> {
    let marker = "<|im_start|>system";
    let start = template.find(marker)? + marker.len();
    let rest = &template[start..];
    let rest = rest
        .strip_prefix("\\n")
        .or_else(|| rest.strip_prefix('\n'))?;
    let end = rest.find("<|im_end|>")?;
    let text = &rest[..end];
    // A Jinja expression here (e.g. `' + message['content'] + '`) means no fixed default.
    if text.is_empty() || text.contains('\'') || text.contains("{{") || text.contains("{%") {
        return None;
    }
    Some(text.to_string())
}

pub struct TextTokenizer {
    pub inner: Tokenizer,
    /// Prepended by [`TextTokenizer::encode`] when the tokenizer itself does not add it (GGUF).
    pub add_bos: Option<u32>,
    /// Generation stops at any of these.
    pub eos_ids: Vec<u32>,
    pub chat: Option<ChatFormat>,
}

impl TextTokenizer {
    /// `tokenizer.json`, plus `tokenizer_config.json` when present for the chat template and
    /// the EOS token; `config_eos` are the ids listed in `config.json`.
    pub fn from_hf_files(
        tokenizer_json: &Path,
        tokenizer_config: Option<&Path>,
        config_eos: &[u32],
    ) -> Result<Self> {
        let inner = Tokenizer::from_file(tokenizer_json)
            .map_err(anyhow::Error::msg)
            .with_context(|| format!("loading {}", tokenizer_json.display()))?;
        let mut chat = None;
        let mut eos_names = Vec::new();
        if let Some(path) = tokenizer_config {
            let tc = crate::load::read_json(path)?;
            let template = match tc.get("chat_template") {
                Some(Value::String(s)) => Some(s.clone()),
                // A list of named templates: take "default", else the first.
                Some(other) => other
                    .as_array()
                    .and_then(|list| {
                        list.iter()
                            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                            .or(list.first())
                    })
                    .and_then(|t| t.get("template"))
                    .and_then(Value::as_str)
                    .map(str::to_string),
                _ => None,
            };
            chat = template.as_deref().and_then(ChatFormat::detect);
            match tc.get("eos_token") {
                Some(Value::String(s)) => eos_names.push(s.clone()),
                Some(obj) => eos_names.extend(
                    obj.get("content")
                        .and_then(Value::as_str)
                        .map(str::to_string),
                ),
                None => {}
            }
        }
        let mut eos_ids = config_eos.to_vec();
        for name in eos_names {
            eos_ids.extend(inner.token_to_id(&name));
        }
        Ok(Self::finish(inner, None, eos_ids, chat))
    }

    fn finish(
        inner: Tokenizer,
        add_bos: Option<u32>,
        mut eos_ids: Vec<u32>,
        chat: Option<ChatFormat>,
    ) -> Self {
        if let Some(fmt) = &chat {
            for name in fmt.end_tokens() {
                eos_ids.extend(inner.token_to_id(name));
            }
        }
        eos_ids.sort_unstable();
        eos_ids.dedup();
        TextTokenizer {
            inner,
            add_bos,
            eos_ids,
            chat,
        }
    }

    /// Rebuilds the tokenizer stored in a GGUF file: `tokenizer.ggml.model = gpt2` (byte-level
    /// BPE: GPT-2, SmolLM2, Llama 3, Qwen2 pre-tokenizers) or `llama` (SentencePiece BPE).
    pub fn from_gguf(content: &gguf_file::Content) -> Result<Self> {
        let md = &content.metadata;
        let get = |k: &str| md.get(k).with_context(|| format!("gguf: missing `{k}`"));
        let model = get("tokenizer.ggml.model")?.to_string()?.clone();
        let tokens: Vec<String> = get("tokenizer.ggml.tokens")?
            .to_vec()?
            .iter()
            .map(|v| v.to_string().cloned())
            .collect::<candle_core::Result<_>>()?;
        let types: Vec<i32> = match md.get("tokenizer.ggml.token_type") {
            Some(v) => v
                .to_vec()?
                .iter()
                .map(|v| {
                    gguf_int(v)
                        .map(|x| x as i32)
                        .context("gguf: bad token_type")
                })
                .collect::<Result<_>>()?,
            None => vec![1; tokens.len()],
        };
        // The second field: whether a BOS is prepended when the file does not say.
        let (mut inner, add_bos_default) = match model.as_str() {
            "gpt2" => (gguf_byte_level_bpe(md, &tokens)?, false),
            "llama" => (gguf_sentencepiece_bpe(md, &tokens, &types)?, true),
            other => bail!(
                "gguf: tokenizer.ggml.model = `{other}` is not supported (`gpt2`: byte-level BPE, \
                 `llama`: SentencePiece BPE); pass --tokenizer with the model's tokenizer.json instead"
            ),
        };

        // llama.cpp token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
        let with_type = |ty: i32, special: bool| -> Vec<AddedToken> {
            tokens
                .iter()
                .zip(&types)
                .filter(|(_, t)| **t == ty)
                .map(|(s, _)| AddedToken::from(s.clone(), special))
                .collect()
        };
        inner
            .add_special_tokens(with_type(3, true))
            .map_err(anyhow::Error::msg)?;
        inner
            .add_tokens(with_type(4, false))
            .map_err(anyhow::Error::msg)?;

        let id = |k: &str| md.get(k).and_then(gguf_int).map(|x| x as u32);
        let add_bos = md
            .get("tokenizer.ggml.add_bos_token")
            .and_then(|v| v.to_bool().ok())
            .unwrap_or(add_bos_default);
        let bos = if add_bos {
            id("tokenizer.ggml.bos_token_id")
        } else {
            None
        };
        let eos: Vec<u32> = id("tokenizer.ggml.eos_token_id")
            .into_iter()
            .chain(id("tokenizer.ggml.eot_token_id"))
            .collect();
        let chat = md
            .get("tokenizer.chat_template")
            .and_then(|v| v.to_string().ok())
            .and_then(|t| ChatFormat::detect(t));
        Ok(Self::finish(inner, bos, eos, chat))
    }

    /// Token ids for `text`; special tokens written in the text (`<|im_start|>`) are recognised.
    /// `add_special` runs the tokenizer's post-processor (BOS for Llama tokenizer.json files);
    /// the chat formats already spell out their BOS, so chat prompts pass `false`.
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, add_special)
            .map_err(anyhow::Error::msg)?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        if add_special {
            ids.extend(self.add_bos);
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    /// The prompt ids: the chat format when there is one and `use_chat`, the raw text otherwise.
    pub fn encode_prompt(
        &self,
        prompt: &str,
        use_chat: bool,
        system: Option<&str>,
    ) -> Result<Vec<u32>> {
        match (&self.chat, use_chat) {
            (Some(fmt), true) => self.encode(&fmt.render(prompt, system), false),
            _ => self.encode(prompt, true),
        }
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, true).map_err(anyhow::Error::msg)
    }
}

type Metadata = HashMap<String, gguf_file::Value>;

/// `tokenizer.ggml.model = gpt2`: byte-level BPE from the stored merges, with the
/// pre-tokenizer named by `tokenizer.ggml.pre`.
fn gguf_byte_level_bpe(md: &Metadata, tokens: &[String]) -> Result<Tokenizer> {
    let merges: Vec<(String, String)> = md
        .get("tokenizer.ggml.merges")
        .context("gguf: missing `tokenizer.ggml.merges`")?
        .to_vec()?
        .iter()
        .map(|v| {
            let s = v.to_string()?;
            s.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| candle_core::Error::Msg(format!("gguf: bad merge `{s}`")))
        })
        .collect::<candle_core::Result<_>>()?;
    let pre = md
        .get("tokenizer.ggml.pre")
        .and_then(|v| v.to_string().ok())
        .cloned()
        .unwrap_or_default();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab_of(tokens), merges)
        .ignore_merges(pre == "llama-bpe")
        .build()
        .map_err(anyhow::Error::msg)?;
    let mut inner = Tokenizer::new(bpe);
    inner.with_pre_tokenizer(Some(byte_level_pre_tokenizer(&pre)?));
    inner.with_decoder(Some(ByteLevelDecoder::default()));
    Ok(inner)
}

/// `tokenizer.ggml.model = llama`: a SentencePiece BPE vocabulary (Llama 2, TinyLlama, Mistral)
/// with per-piece scores and `<0xNN>` byte pieces, rebuilt the way Hugging Face converts such
/// models: the merges are every split of a normal piece into two vocabulary pieces, ranked by the
/// merged piece's score (highest first); spaces become `▁` and a `▁` is prepended (unless
/// `add_space_prefix` is false); characters outside the vocabulary fall back to byte pieces.
fn gguf_sentencepiece_bpe(md: &Metadata, tokens: &[String], types: &[i32]) -> Result<Tokenizer> {
    const SPACE: &str = "\u{2581}";
    let scores: Vec<f32> = match md.get("tokenizer.ggml.scores") {
        Some(v) => v
            .to_vec()?
            .iter()
            .map(|v| v.to_f32())
            .collect::<candle_core::Result<_>>()?,
        None => (0..tokens.len()).map(|i| -(i as f32)).collect(),
    };
    anyhow::ensure!(
        scores.len() == tokens.len() && types.len() == tokens.len(),
        "gguf: {} tokens, {} scores, {} token types",
        tokens.len(),
        scores.len(),
        types.len()
    );
    let vocab = vocab_of(tokens);
    // (left, right, score of left+right); within one piece ordered by (id of left, id of right).
    let mut merges: Vec<(String, String, f32)> = Vec::new();
    for ((piece, &score), &ty) in tokens.iter().zip(&scores).zip(types) {
        if ty != 1 {
            continue; // control, unknown and byte pieces are never the result of a merge
        }
        let mut local: Vec<(u32, u32, &str, &str)> = piece
            .char_indices()
            .skip(1)
            .filter_map(|(at, _)| {
                let (l, r) = piece.split_at(at);
                Some((*vocab.get(l)?, *vocab.get(r)?, l, r))
            })
            .collect();
        local.sort_unstable();
        merges.extend(
            local
                .into_iter()
                .map(|(_, _, l, r)| (l.to_string(), r.to_string(), score)),
        );
    }
    merges.sort_by(|a, b| b.2.total_cmp(&a.2)); // stable: equal scores keep the order above
    let merges = merges.into_iter().map(|(l, r, _)| (l, r)).collect();
    let mut builder = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .byte_fallback(true)
        .fuse_unk(true);
    if let Some(i) = types.iter().position(|t| *t == 2) {
        builder = builder.unk_token(tokens[i].clone());
    }
    let mut inner = Tokenizer::new(builder.build().map_err(anyhow::Error::msg)?);

    let add_space_prefix = md
        .get("tokenizer.ggml.add_space_prefix")
        .and_then(|v| v.to_bool().ok())
        .unwrap_or(true);
    let spaces = Replace::new(" ", SPACE).map_err(anyhow::Error::msg)?;
    let normalizer: NormalizerWrapper = if add_space_prefix {
        NormalizerSequence::new(vec![Prepend::new(SPACE.to_string()).into(), spaces.into()]).into()
    } else {
        spaces.into()
    };
    inner
        .with_normalizer(Some(normalizer))
        .map_err(anyhow::Error::msg)?;
    let mut decoders: Vec<DecoderWrapper> = vec![
        Replace::new(SPACE, " ").map_err(anyhow::Error::msg)?.into(),
        ByteFallback::new().into(),
        Fuse::new().into(),
    ];
    if add_space_prefix {
        decoders.push(Strip::new(' ', 1, 0).into());
    }
    inner.with_decoder(Some(DecoderSequence::new(decoders)));
    Ok(inner)
}

fn vocab_of(tokens: &[String]) -> tokenizers::models::bpe::Vocab {
    tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect()
}

/// An integer metadata value of any width (files disagree on u32 / i32 / u64).
pub fn gguf_int(v: &gguf_file::Value) -> Option<i64> {
    use gguf_file::Value as V;
    match *v {
        V::U8(x) => Some(x as i64),
        V::I8(x) => Some(x as i64),
        V::U16(x) => Some(x as i64),
        V::I16(x) => Some(x as i64),
        V::U32(x) => Some(x as i64),
        V::I32(x) => Some(x as i64),
        V::U64(x) => i64::try_from(x).ok(),
        V::I64(x) => Some(x),
        _ => None,
    }
}

/// The pre-tokenizer that llama.cpp's `tokenizer.ggml.pre` names, as a `tokenizers` pipeline.
fn byte_level_pre_tokenizer(pre: &str) -> Result<PreTokenizerWrapper> {
    // Llama 3 ("llama-bpe") and Qwen2 split with their own regex, then map bytes without GPT-2's.
    const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    const QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    let regex_then_bytes = |re: &str| -> Result<PreTokenizerWrapper> {
        let split = Split::new(
            SplitPattern::Regex(re.to_string()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(anyhow::Error::msg)?;
        Ok(Sequence::new(vec![
            split.into(),
            ByteLevel::new(false, true, false).into(),
        ])
        .into())
    };
    match pre {
        // SmolLM2 (and StarCoder-style vocabularies): every digit is its own pre-token, then
        // GPT-2's byte-level regex.
        "smollm" | "starcoder" | "refact" => Ok(Sequence::new(vec![
            Digits::new(true).into(),
            ByteLevel::new(false, true, true).into(),
        ])
        .into()),
        "llama-bpe" | "llama3" => regex_then_bytes(LLAMA3),
        "qwen2" => regex_then_bytes(QWEN2),
        "" | "default" | "gpt2" | "gpt-2" => Ok(ByteLevel::new(false, true, true).into()),
        other => {
            eprintln!(
                "warning: gguf pre-tokenizer `{other}` not known; using GPT-2's byte-level regex"
            );
            Ok(ByteLevel::new(false, true, true).into())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gguf_file::Value;

    /// A SentencePiece-style vocabulary as llama.cpp stores it: pieces, scores (higher merges
    /// first), types (2 unknown, 3 control, 6 byte, 1 normal).
    fn spm_content() -> gguf_file::Content {
        let pieces: &[(&str, i32)] = &[
            ("<unk>", 2),
            ("<s>", 3),
            ("</s>", 3),
            ("<0x21>", 6),
            ("\u{2581}", 1),
            ("h", 1),
            ("e", 1),
            ("l", 1),
            ("o", 1),
            ("w", 1),
            ("r", 1),
            ("d", 1),
            ("he", 1),
            ("ll", 1),
            ("llo", 1),
            ("hello", 1),
            ("\u{2581}hello", 1),
            ("\u{2581}w", 1),
            ("or", 1),
            ("\u{2581}wor", 1),
            ("ld", 1),
            ("\u{2581}world", 1),
        ];
        let arr = |f: &dyn Fn(usize, &(&str, i32)) -> Value| {
            Value::Array(pieces.iter().enumerate().map(|(i, p)| f(i, p)).collect())
        };
        let mut md = HashMap::new();
        md.insert("tokenizer.ggml.model".into(), Value::String("llama".into()));
        md.insert(
            "tokenizer.ggml.tokens".into(),
            arr(&|_, p| Value::String(p.0.into())),
        );
        md.insert(
            "tokenizer.ggml.scores".into(),
            arr(&|i, _| Value::F32(-(i as f32))),
        );
        md.insert(
            "tokenizer.ggml.token_type".into(),
            arr(&|_, p| Value::I32(p.1)),
        );
        md.insert("tokenizer.ggml.bos_token_id".into(), Value::U32(1));
        md.insert("tokenizer.ggml.eos_token_id".into(), Value::U32(2));
        gguf_file::Content {
            magic: gguf_file::VersionedMagic::GgufV3,
            metadata: md,
            tensor_infos: HashMap::new(),
            tensor_data_offset: 0,
        }
    }

    #[test]
    fn sentencepiece_gguf_tokenizer() -> Result<()> {
        let tok = TextTokenizer::from_gguf(&spm_content())?;
        // BOS prepended by default, merges in score order, `!` through its byte piece.
        let ids = tok.encode("hello world!", true)?;
        assert_eq!(ids, vec![1, 16, 21, 3]);
        assert_eq!(tok.decode(&ids)?, "hello world!");
        assert_eq!(tok.eos_ids, vec![2]);
        // Control tokens in the text are matched before normalization: no `▁` is prepended.
        assert_eq!(tok.encode("</s>", false)?, vec![2]);
        Ok(())
    }

    #[test]
    fn chat_formats() {
        let smol = "{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}";
        let fmt = ChatFormat::detect(smol).unwrap();
        assert_eq!(
            fmt.render("Hi", None),
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
             <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        let plain = ChatFormat::detect(
            "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>'}}",
        )
        .unwrap();
        assert_eq!(
            plain,
            ChatFormat::ChatMl {
                default_system: None
            }
        );
        assert_eq!(
            ChatFormat::detect("{{ '<|start_header_id|>' }}"),
            Some(ChatFormat::Llama3)
        );
        assert_eq!(ChatFormat::detect("no markers"), None);
    }
}
