//! The model's tokenizer as Hugging Face `tokenizers` files, made from the
//! GGUF's vocabulary: what a gateway that tokenizes for us (SMG in gRPC mode)
//! loads to turn text into the same token ids llama.cpp would.
//!
//! Byte-level BPE vocabularies (`tokenizer.ggml.model = gpt2`) carry all a
//! `tokenizer.json` needs: the tokens (already in byte-level form, `Ġ` for a
//! space), the merges, each token's type (control tokens become special added
//! tokens) and the pre-tokenizer's name, which picks the split rules below —
//! the same rules llama.cpp applies for that name (`src/llama-vocab.cpp`).
//! A vocabulary of another kind (SentencePiece, WordPiece) or an unknown
//! pre-tokenizer is refused with the reason, never approximated: a gateway
//! whose token ids differ from ours would route and cache on wrong prefixes.

use serde_json::{Value, json};
use siliceo_kv_paging::gguf::GgufHeader;

/// Qwen2's split rule: single digits, case-insensitive contractions, and
/// newlines kept apart from other whitespace.
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Llama 3's split rule: as Qwen2's, with digits in runs of up to three.
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// llama.cpp's token types (`llama_token_type`).
const TOKEN_CONTROL: i128 = 3;
const TOKEN_USER_DEFINED: i128 = 4;

/// What [`hf_tokenizer_files`] makes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenizerExport {
    /// The files.
    pub files: Vec<TokenizerFile>,
    /// Tokens that end generation ([`eos_ids`]).
    pub eos_ids: Vec<u32>,
    /// The beginning-of-sequence token, if the vocabulary has one.
    pub bos_id: Option<u32>,
}

/// One exported file: its name and bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenizerFile {
    /// File name (`tokenizer.json`, `tokenizer_config.json`, …).
    pub name: &'static str,
    /// Contents (JSON).
    pub bytes: Vec<u8>,
}

/// The pre-tokenizer for llama.cpp's pre-tokenizer name, or why none.
fn pre_tokenizer(pre: &str) -> Result<Value, String> {
    let byte_level = |use_regex: bool| {
        json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
               "use_regex": use_regex})
    };
    let split_then_bytes = |pattern: &str| {
        json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated",
             "invert": false},
            byte_level(false),
        ]})
    };
    Ok(match pre {
        // ByteLevel's own split is GPT-2's rule.
        "gpt-2" | "gpt2" | "mpt" | "olmo" => byte_level(true),
        // Every digit on its own, then GPT-2's rule.
        "smollm" | "starcoder" | "refact" | "codeshell" => {
            json!({"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true},
                byte_level(true),
            ]})
        }
        "qwen2" | "deepseek-r1-qwen" | "megrez" | "stablelm2" => split_then_bytes(QWEN2_SPLIT),
        "llama-bpe" | "llama3" | "dbrx" | "smaug-bpe" => split_then_bytes(LLAMA3_SPLIT),
        other => {
            return Err(format!(
                "the GGUF's pre-tokenizer `{other}` has no exported equivalent here \
                 (supported: gpt2, smollm/starcoder, qwen2, llama-bpe); give the gateway \
                 the model's own tokenizer.json instead"
            ));
        }
    })
}

/// A token id the GGUF's metadata names under `key`.
fn token_id(header: &GgufHeader, key: &str) -> Option<u32> {
    header.int(key).and_then(|v| u32::try_from(v).ok())
}

/// The tokens that end generation: end of sequence and end of turn.
pub fn eos_ids(header: &GgufHeader) -> Vec<u32> {
    let mut ids = Vec::new();
    for key in ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"] {
        if let Some(id) = token_id(header, key)
            && !ids.contains(&id)
        {
            ids.push(id);
        }
    }
    ids
}

/// `tokenizer.json`, `tokenizer_config.json`, and the `config.json` and
/// `generation_config.json` a loader reads end-of-sequence ids from, for the
/// model in `header` (served with a context of `n_ctx` tokens).
pub fn hf_tokenizer_files(header: &GgufHeader, n_ctx: u32) -> Result<TokenizerExport, String> {
    let model = header.str("tokenizer.ggml.model").unwrap_or("(none)");
    if model != "gpt2" {
        return Err(format!(
            "the GGUF's tokenizer is `{model}`; only byte-level BPE (`gpt2`) vocabularies \
             are exported as tokenizer.json"
        ));
    }
    let pre = pre_tokenizer(header.str("tokenizer.ggml.pre").unwrap_or("default"))?;
    let tokens = header
        .strs("tokenizer.ggml.tokens")
        .ok_or("the GGUF has no `tokenizer.ggml.tokens`")?;
    let merges = header
        .strs("tokenizer.ggml.merges")
        .ok_or("the GGUF has no `tokenizer.ggml.merges`")?;
    let types = header.ints("tokenizer.ggml.token_type");
    let kind = |id: usize| types.and_then(|t| t.get(id).copied()).unwrap_or(1);

    let mut vocab = serde_json::Map::with_capacity(tokens.len());
    let mut added = Vec::new();
    for (id, tok) in tokens.iter().enumerate() {
        vocab.insert(tok.clone(), json!(id));
        let k = kind(id);
        if k == TOKEN_CONTROL || k == TOKEN_USER_DEFINED {
            added.push(json!({
                "id": id, "content": tok, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": k == TOKEN_CONTROL,
            }));
        }
    }
    let token_of = |key: &str| {
        let id = token_id(header, key)?;
        Some((id, tokens.get(id as usize)?))
    };
    let bos = token_of("tokenizer.ggml.bos_token_id");
    let eos = token_of("tokenizer.ggml.eos_token_id").map(|(_, t)| t);
    let add_bos = header.bool("tokenizer.ggml.add_bos_token").unwrap_or(false) && bos.is_some();
    let post = match bos.filter(|_| add_bos) {
        Some((id, bos)) => {
            json!({
                "type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": bos, "type_id": 0}},
                           {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": bos, "type_id": 0}},
                         {"Sequence": {"id": "A", "type_id": 0}},
                         {"SpecialToken": {"id": bos, "type_id": 1}},
                         {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {bos.as_str(): {"id": bos, "ids": [id], "tokens": [bos]}},
            })
        }
        None => Value::Null,
    };
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre,
        "post_processor": post,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true,
                    "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null,
            "continuing_subword_prefix": null, "end_of_word_suffix": null,
            "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": merges,
        },
    });
    let mut config = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": n_ctx,
        "add_bos_token": add_bos,
        "add_eos_token": false,
        "clean_up_tokenization_spaces": false,
    });
    if let Some(t) = header.str("tokenizer.chat_template") {
        config["chat_template"] = json!(t);
    }
    if let Some((_, b)) = bos {
        config["bos_token"] = json!(b);
    }
    if let Some(e) = eos {
        config["eos_token"] = json!(e);
    }
    if let Some((_, p)) = token_of("tokenizer.ggml.padding_token_id") {
        config["pad_token"] = json!(p);
    }
    let eos_ids = eos_ids(header);
    let bos_id = bos.map(|(id, _)| id);
    let generation = json!({"eos_token_id": eos_ids, "bos_token_id": bos_id});
    let model_config = json!({
        "model_type": header.str("general.architecture").unwrap_or_default(),
        "eos_token_id": eos_ids,
        "bos_token_id": bos_id,
        "max_position_embeddings": n_ctx,
        "vocab_size": tokens.len(),
    });
    let files = [
        ("tokenizer.json", tokenizer),
        ("tokenizer_config.json", config),
        ("generation_config.json", generation),
        ("config.json", model_config),
    ]
    .into_iter()
    .map(|(name, v)| TokenizerFile {
        name,
        bytes: serde_json::to_vec(&v).expect("JSON values serialize"),
    })
    .collect();
    Ok(TokenizerExport {
        files,
        eos_ids,
        bos_id,
    })
}
