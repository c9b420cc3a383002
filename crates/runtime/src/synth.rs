//! `siliceo synth-model` (and `siliceo-bench synth-model`): a GGUF with a real model's architecture, geometry
//! and quantization, random weights, and a real tokenizer copied from another
//! GGUF. Its text is noise; its speed is the real model's speed (the same
//! tensors, shapes and types go through the same kernels). Made for machines
//! that cannot fetch a real model: the GPU machine takes 64 MiB of files and
//! reaches no network, so it makes a 7B-class model itself, in seconds.

use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use siliceo_kv_paging::gguf::{GgufHeader, GgufWriter, MetaValue, metadata_spans, padding};

/// Why a synthetic model could not be written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SynthError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A GGUF could not be read or built.
    #[error(transparent)]
    Gguf(#[from] siliceo_kv_paging::gguf::GgufError),
    /// Bad options or a tokenizer that cannot be used.
    #[error("{0}")]
    Invalid(String),
}

type Result<T> = std::result::Result<T, SynthError>;

fn invalid<T>(m: impl Into<String>) -> Result<T> {
    Err(SynthError::Invalid(m.into()))
}

/// The architectures and geometries `--like` names (from each model's
/// published config.json).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Like {
    /// Qwen2.5-7B(-Instruct): 28 layers, 3584 wide, 28/4 heads.
    Qwen25_7b,
    /// Llama-3-8B: 32 layers, 4096 wide, 32/8 heads.
    Llama3_8b,
    /// Qwen2.5-1.5B: 28 layers, 1536 wide, 12/2 heads (with an output matrix
    /// of its own, as Qwen2.5-Coder-1.5B's GGUF has).
    Qwen25_1_5b,
    /// gpt-oss-20b: 24 layers, 2880 wide, 64/8 heads of 64, 32 experts (4
    /// used) of 2880, attention sinks, a 128-token window on every other
    /// layer (its experts in Q8_0 or Q4_K here, not MXFP4).
    GptOss20b,
    /// gpt-oss's architecture at test size: 2 layers (the first windowed),
    /// 256 wide, 8/2 heads of 64, 4 experts (2 used) of 256, a 32-token
    /// window, attention sinks. For tests of sinks and windows, not speed.
    GptOssMini,
    /// OLMo 3's architecture (llama.cpp's `olmo2` with a sliding window) at
    /// test size: 4 layers, the first three with a 32-token window and the
    /// fourth global (llama.cpp's default period of 4), 512 wide, 8/2 heads
    /// of 64, Q and K normalised before RoPE, norms after attention and
    /// after the feed-forward instead of before. For tests of windows.
    Olmo3Mini,
    /// EXAONE 4's architecture at test size: OLMo 3's shape with Q and K
    /// normalised per head, and a 32-token window key, which llama.cpp
    /// ignores at any depth but 32B's 64 layers. For tests of windows.
    Exaone4Mini,
    /// Cohere's Command R7B architecture (`cohere2`) at test size: OLMo 3's
    /// dimensions, attention and feed-forward side by side after one layer
    /// norm, RoPE in the windowed layers only, tied embeddings, a 32-token
    /// window on three layers in four. For tests of windows.
    Cohere2Mini,
    /// Google's Gemma 4 architecture at test size: 6 layers, 256 wide, 4
    /// query heads; windowed layers (a 32-token window) with 2 KV heads of
    /// 64, the others ([`GEMMA4_PATTERN`]) global with 1 KV head of 128
    /// (KV heads listed per layer); the last
    /// [`GEMMA4_SHARED_KV`] layers read the KV of earlier ones, as Gemma 4's
    /// do. No per-layer embeddings (E2B's and E4B's), no experts.
    Gemma4Mini,
    /// `gemma4-mini` with its global layers shaped like its windowed ones
    /// (2 KV heads of 64), which no Gemma 4 is: every layer then shares one
    /// scratch set, so the layers between a sharing layer and its source
    /// overwrite the source's scratch rows of the step. A test of the
    /// sharing layers' rewrite of those rows.
    Gemma4Alike,
    /// `gemma4-mini` with global heads of 512, Gemma 4's size (4 query heads
    /// over its one KV head): for tests of the CUDA kernels' heads of 512.
    Gemma4Wide,
    /// Google's Gemma 3n architecture at test size: 22 layers, 256 wide, 4
    /// query heads over 2 KV heads of 64, windowed layers (a 32-token
    /// window) as listed in [`GEMMA3N_PATTERN`]; llama.cpp keeps KV in the
    /// first 20 layers only (its `n_layer_kv_from_start`), so the last two
    /// read layers 18 and 19's. AltUp over 4 streams, per-layer inputs of
    /// 256 and LAuReL of rank 64 (llama.cpp's fixed sizes), their
    /// coefficient and router weights 0.
    Gemma3nMini,
}

/// `gemma3n-mini`'s windowed layers (`true`): one global layer in five, as
/// Gemma 3n's, then a windowed and a global layer among the two that keep
/// no KV.
pub const GEMMA3N_PATTERN: [bool; 22] = {
    let mut p = [true; 22];
    let mut il = 4;
    while il < 20 {
        p[il] = false;
        il += 5;
    }
    p[21] = false;
    p
};
/// Gemma 3n's AltUp streams, per-layer input size and LAuReL rank: fixed
/// in llama.cpp (`llama_hparams`), not read from the file.
const GEMMA3N_ALTUP: u64 = 4;
const GEMMA3N_PER_LAYER: u64 = 256;
const GEMMA3N_LAUREL: u64 = 64;

/// `gemma4-mini`'s windowed layers (`true`) and global ones: layer 3 is the
/// last global layer with its own KV, layer 2 the last windowed one.
pub const GEMMA4_PATTERN: [bool; 6] = [true, true, true, false, true, false];
/// `gemma4-mini`'s layers at the end that keep no KV of their own.
pub const GEMMA4_SHARED_KV: u32 = 2;
/// `gemma4-mini`'s windowed layers' head size.
const GEMMA4_SWA_HEAD: u32 = 64;
/// `gemma4-mini`'s global layers' KV heads (its windowed layers have
/// `n_head_kv`): listed per layer, as a Gemma 4 with fewer global KV heads
/// lists them.
const GEMMA4_GLOBAL_KV_HEADS: u32 = 1;

/// A Gemma 4 geometry's layer shape: (head size, KV heads). Windowed
/// layers have heads of [`GEMMA4_SWA_HEAD`] and `n_head_kv` of them; global
/// ones heads of `head_dim` and [`GEMMA4_GLOBAL_KV_HEADS`], unless their
/// heads are the windowed layers' size (`gemma4-alike`): then the windowed
/// layers' shape.
fn gemma4_shape(g: &Geometry, windowed: bool) -> (u32, u32) {
    if windowed || g.head_dim == GEMMA4_SWA_HEAD {
        (GEMMA4_SWA_HEAD, g.n_head_kv)
    } else {
        (g.head_dim, GEMMA4_GLOBAL_KV_HEADS)
    }
}

/// Weight types: llama.cpp's Q4_K_M mix, or Q8_0 throughout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Quant {
    /// Q4_K, with Q6_K for the output and for attn_v/ffn_down on the layers
    /// llama.cpp's Q4_K_M gives more bits.
    Q4KM,
    /// Q8_0 for every matrix.
    Q8_0,
}

impl std::str::FromStr for Like {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Like, String> {
        match s {
            "qwen2.5-7b" => Ok(Like::Qwen25_7b),
            "llama-3-8b" => Ok(Like::Llama3_8b),
            "qwen2.5-1.5b" => Ok(Like::Qwen25_1_5b),
            "gpt-oss-20b" => Ok(Like::GptOss20b),
            "gpt-oss-mini" => Ok(Like::GptOssMini),
            "olmo3-mini" => Ok(Like::Olmo3Mini),
            "exaone4-mini" => Ok(Like::Exaone4Mini),
            "cohere2-mini" => Ok(Like::Cohere2Mini),
            "gemma4-mini" => Ok(Like::Gemma4Mini),
            "gemma4-alike" => Ok(Like::Gemma4Alike),
            "gemma4-wide" => Ok(Like::Gemma4Wide),
            "gemma3n-mini" => Ok(Like::Gemma3nMini),
            _ => Err(format!(
                "`{s}`: one of qwen2.5-7b, llama-3-8b, qwen2.5-1.5b, gpt-oss-20b, gpt-oss-mini, \
                 olmo3-mini, exaone4-mini, cohere2-mini, gemma4-mini, gemma4-alike, gemma4-wide, gemma3n-mini"
            )),
        }
    }
}

impl std::str::FromStr for Quant {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Quant, String> {
        match s {
            "q4_k_m" => Ok(Quant::Q4KM),
            "q8_0" => Ok(Quant::Q8_0),
            _ => Err(format!("`{s}`: q4_k_m or q8_0")),
        }
    }
}

/// What to write.
#[derive(Debug, Clone)]
pub struct SynthOptions {
    /// The model whose architecture and geometry to copy (not needed with
    /// `vocab_only`).
    pub like: Option<Like>,
    /// Weight quantization.
    pub quant: Quant,
    /// A GGUF to take the tokenizer from (any model, or a vocab-only file).
    pub tokenizer: PathBuf,
    /// Output GGUF.
    pub out: PathBuf,
    /// Fewer layers than the model has (a small file for tests).
    pub layers: Option<u32>,
    /// Seed of the random weights.
    pub seed: u64,
    /// Write only the tokenizer (a vocab-only GGUF, a few MB).
    pub vocab_only: bool,
}

/// A transformer's shape, as llama.cpp's GGUF metadata states it.
#[derive(Debug, Clone, PartialEq)]
pub struct Geometry {
    /// `general.architecture`.
    pub arch: &'static str,
    /// The model it imitates.
    pub name: &'static str,
    /// Layers.
    pub n_layer: u32,
    /// Hidden size.
    pub n_embd: u32,
    /// Query heads.
    pub n_head: u32,
    /// KV heads.
    pub n_head_kv: u32,
    /// Feed-forward size.
    pub n_ff: u32,
    /// The model's own vocabulary size (rows of token_embd).
    pub n_vocab: u32,
    /// Training context.
    pub n_ctx: u32,
    /// RoPE base frequency.
    pub rope_base: f32,
    /// RMS norm epsilon.
    pub rms_eps: f32,
    /// Q/K/V projections have biases (Qwen2).
    pub qkv_bias: bool,
    /// The output matrix is the token embedding (no output.weight).
    pub tied: bool,
    /// Head size where it is not `n_embd / n_head` (0: it is).
    pub head_dim: u32,
    /// Mixture of experts: (experts, experts used per token); `n_ff` is
    /// each expert's feed-forward size.
    pub experts: Option<(u32, u32)>,
    /// Sliding attention window (0: none).
    pub window: u32,
}

impl Geometry {
    /// Each head's size.
    pub fn head_dim(&self) -> u32 {
        if self.head_dim == 0 {
            self.n_embd / self.n_head
        } else {
            self.head_dim
        }
    }
}

impl Like {
    /// The geometry of the model this names.
    pub fn geometry(self) -> Geometry {
        match self {
            Like::Qwen25_7b => Geometry {
                arch: "qwen2",
                name: "qwen2.5-7b",
                n_layer: 28,
                n_embd: 3584,
                n_head: 28,
                n_head_kv: 4,
                n_ff: 18944,
                n_vocab: 152064,
                n_ctx: 32768,
                rope_base: 1e6,
                rms_eps: 1e-6,
                qkv_bias: true,
                tied: false,
                head_dim: 0,
                experts: None,
                window: 0,
            },
            Like::Llama3_8b => Geometry {
                arch: "llama",
                name: "llama-3-8b",
                n_layer: 32,
                n_embd: 4096,
                n_head: 32,
                n_head_kv: 8,
                n_ff: 14336,
                n_vocab: 128256,
                n_ctx: 8192,
                rope_base: 5e5,
                rms_eps: 1e-5,
                qkv_bias: false,
                tied: false,
                head_dim: 0,
                experts: None,
                window: 0,
            },
            // From gpt-oss-20b's config.json.
            Like::GptOss20b => Geometry {
                arch: "gpt-oss",
                name: "gpt-oss-20b",
                n_layer: 24,
                n_embd: 2880,
                n_head: 64,
                n_head_kv: 8,
                n_ff: 2880,
                n_vocab: 201088,
                n_ctx: 131072,
                rope_base: 150000.0,
                rms_eps: 1e-5,
                qkv_bias: true,
                tied: false,
                head_dim: 64,
                experts: Some((32, 4)),
                window: 128,
            },
            Like::GptOssMini => Geometry {
                arch: "gpt-oss",
                name: "gpt-oss-mini",
                n_layer: 2,
                n_embd: 256,
                n_head: 8,
                n_head_kv: 2,
                n_ff: 256,
                n_vocab: 0,
                n_ctx: 4096,
                rope_base: 150000.0,
                rms_eps: 1e-5,
                qkv_bias: true,
                tied: false,
                head_dim: 64,
                experts: Some((4, 2)),
                window: 32,
            },
            Like::Olmo3Mini => Geometry {
                arch: "olmo2",
                name: "olmo3-mini",
                n_layer: 4,
                n_embd: 512,
                n_head: 8,
                n_head_kv: 2,
                n_ff: 512,
                n_vocab: 0,
                n_ctx: 4096,
                rope_base: 5e5,
                rms_eps: 1e-6,
                qkv_bias: false,
                tied: false,
                head_dim: 0,
                experts: None,
                window: 32,
            },
            Like::Exaone4Mini => Geometry {
                arch: "exaone4",
                name: "exaone4-mini",
                ..Like::Olmo3Mini.geometry()
            },
            Like::Cohere2Mini => Geometry {
                arch: "cohere2",
                name: "cohere2-mini",
                tied: true,
                ..Like::Olmo3Mini.geometry()
            },
            Like::Gemma4Mini => Geometry {
                arch: "gemma4",
                name: "gemma4-mini",
                n_layer: GEMMA4_PATTERN.len() as u32,
                n_embd: 256,
                n_head: 4,
                n_head_kv: 2,
                n_ff: 512,
                n_vocab: 0,
                n_ctx: 4096,
                rope_base: 1e6,
                rms_eps: 1e-6,
                qkv_bias: false,
                tied: true,
                head_dim: 128,
                experts: None,
                window: 32,
            },
            Like::Gemma3nMini => Geometry {
                arch: "gemma3n",
                name: "gemma3n-mini",
                n_layer: GEMMA3N_PATTERN.len() as u32,
                head_dim: 64,
                ..Like::Gemma4Mini.geometry()
            },
            Like::Gemma4Alike => Geometry {
                name: "gemma4-alike",
                head_dim: GEMMA4_SWA_HEAD,
                ..Like::Gemma4Mini.geometry()
            },
            Like::Gemma4Wide => Geometry {
                name: "gemma4-wide",
                head_dim: 512,
                ..Like::Gemma4Mini.geometry()
            },
            Like::Qwen25_1_5b => Geometry {
                arch: "qwen2",
                name: "qwen2.5-1.5b",
                n_layer: 28,
                n_embd: 1536,
                n_head: 12,
                n_head_kv: 2,
                n_ff: 8960,
                n_vocab: 151936,
                n_ctx: 32768,
                rope_base: 1e6,
                rms_eps: 1e-6,
                qkv_bias: true,
                tied: false,
                head_dim: 0,
                experts: None,
                window: 0,
            },
        }
    }
}

const F32: u32 = 0;
const Q8_0: u32 = 8;
const Q4_K: u32 = 12;
const Q6_K: u32 = 14;

/// llama.cpp's rule for the layers Q4_K_M gives Q6_K attn_v and ffn_down.
fn more_bits(layer: u32, n_layer: u32) -> bool {
    layer < n_layer / 8 || layer >= 7 * n_layer / 8 || (layer - n_layer / 8) % 3 == 2
}

/// One tensor of the synthetic model: name, dims (innermost first), type.
pub type TensorSpec = (String, Vec<u64>, u32);

/// The tensor table of a model of geometry `g` with `n_vocab` rows of
/// embedding, in llama.cpp's names and file order.
pub fn tensors(g: &Geometry, n_vocab: u32, quant: Quant) -> Vec<TensorSpec> {
    let (e, ff, v) = (u64::from(g.n_embd), u64::from(g.n_ff), u64::from(n_vocab));
    let hd = u64::from(g.head_dim());
    let (q, kv) = (u64::from(g.n_head) * hd, u64::from(g.n_head_kv) * hd);
    let (base, more) = match quant {
        Quant::Q4KM => (Q4_K, Q6_K),
        Quant::Q8_0 => (Q8_0, Q8_0),
    };
    let mut t: Vec<TensorSpec> = Vec::new();
    let mut add = |name: String, dims: &[u64], ty: u32| t.push((name, dims.to_vec(), ty));
    add("token_embd.weight".into(), &[e, v], base);
    if g.arch == "gemma4" {
        gemma4_tensors(g, (base, more), &mut add);
        return t;
    }
    if g.arch == "gemma3n" {
        gemma3n_tensors(g, v, (base, more), &mut add);
        return t;
    }
    add("output_norm.weight".into(), &[e], F32);
    if !g.tied {
        add("output.weight".into(), &[e, v], more);
    }
    // OLMo 2/3 and EXAONE 4: norms after attention and the feed-forward,
    // none before; Q and K normalised over all their heads (OLMo) or per
    // head (EXAONE).
    let post_norms = matches!(g.arch, "olmo2" | "exaone4");
    let (q_norm, k_norm) = if g.arch == "exaone4" {
        (hd, hd)
    } else {
        (q, kv)
    };
    for l in 0..g.n_layer {
        let b = |s: &str| format!("blk.{l}.{s}");
        let rich = if more_bits(l, g.n_layer) { more } else { base };
        if !post_norms {
            add(b("attn_norm.weight"), &[e], F32);
        }
        add(b("attn_q.weight"), &[e, q], base);
        add(b("attn_k.weight"), &[e, kv], base);
        add(b("attn_v.weight"), &[e, kv], rich);
        if g.qkv_bias {
            add(b("attn_q.bias"), &[q], F32);
            add(b("attn_k.bias"), &[kv], F32);
            add(b("attn_v.bias"), &[kv], F32);
        }
        add(b("attn_output.weight"), &[q, e], base);
        if let Some((n_exp, _)) = g.experts {
            // gpt-oss: an output bias, sinks, a post-attention norm, and
            // biased experts behind a biased router.
            let x = u64::from(n_exp);
            add(b("attn_output.bias"), &[e], F32);
            add(b("attn_sinks.weight"), &[u64::from(g.n_head)], F32);
            add(b("post_attention_norm.weight"), &[e], F32);
            add(b("ffn_gate_inp.weight"), &[e, x], base);
            add(b("ffn_gate_inp.bias"), &[x], F32);
            add(b("ffn_gate_exps.weight"), &[e, ff, x], base);
            add(b("ffn_gate_exps.bias"), &[ff, x], F32);
            add(b("ffn_up_exps.weight"), &[e, ff, x], base);
            add(b("ffn_up_exps.bias"), &[ff, x], F32);
            add(b("ffn_down_exps.weight"), &[ff, e, x], rich);
            add(b("ffn_down_exps.bias"), &[e, x], F32);
            continue;
        }
        if post_norms {
            add(b("attn_q_norm.weight"), &[q_norm], F32);
            add(b("attn_k_norm.weight"), &[k_norm], F32);
            add(b("post_attention_norm.weight"), &[e], F32);
        } else if g.arch != "cohere2" {
            // (Cohere's feed-forward reads the attention's norm.)
            add(b("ffn_norm.weight"), &[e], F32);
        }
        add(b("ffn_gate.weight"), &[e, ff], base);
        add(b("ffn_up.weight"), &[e, ff], base);
        add(b("ffn_down.weight"), &[ff, e], rich);
        if post_norms {
            add(b("post_ffw_norm.weight"), &[e], F32);
        }
    }
    t
}

/// Gemma 4's tensors after the embedding (tied output): per layer a head
/// size by its kind, Q and K normalised, norms after attention and after
/// the feed-forward; K and V only in layers with KV of their own; one
/// `rope_freqs` for the global layers' proportional RoPE.
fn gemma4_tensors(
    g: &Geometry,
    (base, more): (u32, u32),
    add: &mut impl FnMut(String, &[u64], u32),
) {
    let (e, ff) = (u64::from(g.n_embd), u64::from(g.n_ff));
    add("output_norm.weight".into(), &[e], F32);
    let global = u64::from(g.head_dim);
    add("rope_freqs.weight".into(), &[global / 2], F32);
    let with_kv = g.n_layer.saturating_sub(GEMMA4_SHARED_KV);
    for l in 0..g.n_layer {
        let b = |s: &str| format!("blk.{l}.{s}");
        let rich = if more_bits(l, g.n_layer) { more } else { base };
        let (hd, kv_heads) = gemma4_shape(g, GEMMA4_PATTERN[l as usize % GEMMA4_PATTERN.len()]);
        let hd = u64::from(hd);
        let (q, kv) = (u64::from(g.n_head) * hd, u64::from(kv_heads) * hd);
        add(b("attn_norm.weight"), &[e], F32);
        add(b("attn_q.weight"), &[e, q], base);
        if l < with_kv {
            add(b("attn_k.weight"), &[e, kv], base);
            add(b("attn_v.weight"), &[e, kv], rich);
            add(b("attn_k_norm.weight"), &[hd], F32);
        }
        add(b("attn_q_norm.weight"), &[hd], F32);
        add(b("attn_output.weight"), &[q, e], base);
        gemma_feed_forward(&b, (e, ff), (base, rich), add);
    }
}

/// Gemma 3n's tensors after the embedding (tied output): AltUp's
/// projections, the per-layer input embedding (Q4_K whatever `quant`: it is
/// the biggest tensor, 256 values per layer per token) and its projection;
/// per layer, Gemma's attention (Q and K normalised, K and V in every
/// layer, though the last ones are not read) and feed-forward with norms
/// after each, the per-layer input's gate and projection, AltUp's router
/// and coefficients, and LAuReL (its second matrix Q8_0: rows of 64).
fn gemma3n_tensors(
    g: &Geometry,
    n_vocab: u64,
    (base, more): (u32, u32),
    add: &mut impl FnMut(String, &[u64], u32),
) {
    let (e, ff) = (u64::from(g.n_embd), u64::from(g.n_ff));
    let hd = u64::from(g.head_dim());
    let (q, kv) = (u64::from(g.n_head) * hd, u64::from(g.n_head_kv) * hd);
    let (alt, ple) = (GEMMA3N_ALTUP, GEMMA3N_PER_LAYER);
    let per_layer = ple * u64::from(g.n_layer);
    add("output_norm.weight".into(), &[e], F32);
    add("altup_proj.weight".into(), &[e, e, alt - 1], base);
    add("altup_unembd_proj.weight".into(), &[e, e, alt - 1], base);
    add(
        "per_layer_token_embd.weight".into(),
        &[per_layer, n_vocab],
        Q4_K,
    );
    add("per_layer_model_proj.weight".into(), &[e, per_layer], base);
    add("per_layer_proj_norm.weight".into(), &[ple], F32);
    for l in 0..g.n_layer {
        let b = |s: &str| format!("blk.{l}.{s}");
        let rich = if more_bits(l, g.n_layer) { more } else { base };
        add(b("attn_norm.weight"), &[e], F32);
        add(b("attn_q.weight"), &[e, q], base);
        add(b("attn_k.weight"), &[e, kv], base);
        add(b("attn_v.weight"), &[e, kv], rich);
        add(b("attn_output.weight"), &[q, e], base);
        add(b("attn_q_norm.weight"), &[hd], F32);
        add(b("attn_k_norm.weight"), &[hd], F32);
        gemma_feed_forward(&b, (e, ff), (base, rich), add);
        add(b("inp_gate.weight"), &[e, ple], base);
        add(b("proj.weight"), &[ple, e], base);
        add(b("post_norm.weight"), &[e], F32);
        add(b("altup_correct_coef.weight"), &[alt, alt], F32);
        add(b("altup_correct_scale.weight"), &[e], F32);
        add(b("altup_predict_coef.weight"), &[alt, alt * alt], F32);
        add(b("altup_router.weight"), &[e, alt], F32);
        add(b("altup_router_norm.weight"), &[e], F32);
        add(b("laurel_l.weight"), &[e, GEMMA3N_LAUREL], base);
        add(b("laurel_r.weight"), &[GEMMA3N_LAUREL, e], Q8_0);
        add(b("laurel_post_norm.weight"), &[e], F32);
    }
}

/// A Gemma layer's norm after attention and its feed-forward between two
/// norms (`b` names the layer's tensors).
fn gemma_feed_forward(
    b: &impl Fn(&str) -> String,
    (e, ff): (u64, u64),
    (base, rich): (u32, u32),
    add: &mut impl FnMut(String, &[u64], u32),
) {
    add(b("post_attention_norm.weight"), &[e], F32);
    add(b("ffn_norm.weight"), &[e], F32);
    add(b("ffn_gate.weight"), &[e, ff], base);
    add(b("ffn_up.weight"), &[e, ff], base);
    add(b("ffn_down.weight"), &[ff, e], rich);
    add(b("post_ffw_norm.weight"), &[e], F32);
}

/// splitmix64: fast, seedable, good enough for noise.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn fill(&mut self, b: &mut [u8]) {
        for c in b.chunks_mut(8) {
            let r = self.next().to_le_bytes();
            c.copy_from_slice(&r[..c.len()]);
        }
    }
}

fn f16_bits(x: f32) -> [u8; 2] {
    half::f16::from_f32(x).to_le_bytes()
}

/// Random blocks of a quantized type whose weights have a real model's
/// spread (zero mean, standard deviation about 0.02): random quants and
/// sub-block scales, with the block scales chosen for that spread.
fn block_pool(ty: u32, blocks: usize, rng: &mut Rng) -> Vec<u8> {
    let size = match ty {
        Q4_K => 144,
        Q6_K => 210,
        Q8_0 => 34,
        _ => unreachable!("no random blocks of type {ty}"),
    };
    let mut pool = vec![0u8; size * blocks];
    rng.fill(&mut pool);
    for b in pool.chunks_exact_mut(size) {
        match ty {
            // d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of 4-bit
            // quants: w = d·sc·q − dmin·m, zero mean when dmin = 7.5·d.
            Q4_K => {
                b[0..2].copy_from_slice(&f16_bits(1e-4));
                b[2..4].copy_from_slice(&f16_bits(7.5e-4));
            }
            // 6-bit quants, 16 int8 scales, then d: w = d·sc·(q − 32).
            Q6_K => b[208..210].copy_from_slice(&f16_bits(2e-5)),
            // d, then 32 int8 quants.
            _ => b[0..2].copy_from_slice(&f16_bits(2.7e-4)),
        }
    }
    pool
}

/// Reads a GGUF's header bytes (however long its vocabulary).
fn header_bytes(path: &Path) -> Result<(GgufHeader, Vec<u8>)> {
    crate::read_gguf_header_bytes(path)
        .map_err(|e| SynthError::Invalid(format!("--tokenizer: {e}")))
}

/// Copies `src`'s `tokenizer.*` entries into `w`, its per-token arrays
/// (tokens, types, scores) padded to `n_vocab` with unused tokens.
fn copy_tokenizer(w: &mut GgufWriter, bytes: &[u8], n_vocab: u64) -> Result<u64> {
    let mut copied = 0;
    for (key, span) in metadata_spans(bytes)? {
        if !key.starts_with("tokenizer.") {
            continue;
        }
        let raw = &bytes[span];
        let per_token = [
            "tokenizer.ggml.tokens",
            "tokenizer.ggml.token_type",
            "tokenizer.ggml.scores",
        ];
        if per_token.contains(&key.as_str()) {
            w.raw(&pad_array(raw, key.len(), n_vocab)?);
        } else {
            w.raw(raw);
        }
        copied += 1;
    }
    Ok(copied)
}

/// A raw array entry (key, type 9, element type, count, elements) grown to
/// `n` elements: strings `<synth_pad_N>`, i32 5 (llama.cpp's UNUSED token
/// type), f32 0.
fn pad_array(raw: &[u8], key_len: usize, n: u64) -> Result<Vec<u8>> {
    let at = 8 + key_len;
    let word = |o: usize| u32::from_le_bytes(raw[o..o + 4].try_into().expect("4 bytes"));
    if word(at) != 9 {
        return invalid("a per-token tokenizer entry is not an array");
    }
    let elem = word(at + 4);
    let len = u64::from_le_bytes(raw[at + 8..at + 16].try_into().expect("8 bytes"));
    let mut out = raw.to_vec();
    if len >= n {
        return Ok(out);
    }
    out[at + 8..at + 16].copy_from_slice(&n.to_le_bytes());
    for i in len..n {
        match elem {
            8 => {
                let s = format!("<synth_pad_{i}>");
                out.extend((s.len() as u64).to_le_bytes());
                out.extend(s.as_bytes());
            }
            5 => out.extend(5i32.to_le_bytes()),
            6 => out.extend(0f32.to_le_bytes()),
            t => return invalid(format!("cannot pad a tokenizer array of element type {t}")),
        }
    }
    Ok(out)
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> SynthError + '_ {
    move |source| SynthError::Io {
        path: path.to_owned(),
        source,
    }
}

/// Writes the GGUF `a` describes, with progress on stderr.
pub fn synth_model(a: &SynthOptions) -> Result<()> {
    let t0 = Instant::now();
    let tok_path = &a.tokenizer;
    let (tok, tok_bytes) = header_bytes(tok_path)?;
    let Some(MetaValue::Array { len: tok_vocab, .. }) = tok.meta.get("tokenizer.ggml.tokens")
    else {
        return invalid(format!(
            "{} has no tokenizer (tokenizer.ggml.tokens)",
            tok_path.display()
        ));
    };
    let tok_vocab = *tok_vocab;
    let tok_name = tok.str("general.name").unwrap_or("?").to_string();
    let mut w = GgufWriter::default();
    if a.vocab_only {
        w.str(
            "general.architecture",
            tok.str("general.architecture").unwrap_or("llama"),
        );
        w.str("general.name", &format!("vocabulary of {tok_name}"));
        copy_tokenizer(&mut w, &tok_bytes, tok_vocab)?;
        std::fs::write(&a.out, w.header()).map_err(io(&a.out))?;
        eprintln!(
            "synth-model: wrote {} ({} tokens of {tok_name}'s vocabulary, {} bytes)",
            a.out.display(),
            tok_vocab,
            std::fs::metadata(&a.out).map_err(io(&a.out))?.len()
        );
        return Ok(());
    }
    let Some(like) = a.like else {
        return invalid(
            "--like is needed (qwen2.5-7b, llama-3-8b, qwen2.5-1.5b, gpt-oss-20b, \
             gpt-oss-mini, olmo3-mini, exaone4-mini, cohere2-mini, gemma4-mini, gemma4-alike, gemma4-wide or gemma3n-mini), or --vocab-only",
        );
    };
    let mut g = like.geometry();
    if let Some(n) = a.layers {
        if !(1..=g.n_layer).contains(&n) {
            return invalid(format!("--layers must be 1..={}", g.n_layer));
        }
        g.n_layer = n;
    }
    // The embedding has a row per token the tokenizer knows: the model's own
    // count, padded with unused tokens, or the tokenizer's when it has more.
    let n_vocab = u64::from(g.n_vocab).max(tok_vocab);
    let arch = g.arch;
    let k = |s: &str| format!("{arch}.{s}");
    w.str("general.architecture", arch);
    w.str(
        "general.name",
        &format!(
            "synthetic {} (random weights; tokenizer of {tok_name})",
            g.name
        ),
    );
    w.u32(
        "general.file_type",
        if a.quant == Quant::Q4KM { 15 } else { 7 },
    );
    w.u32(&k("context_length"), g.n_ctx);
    w.u32(&k("embedding_length"), g.n_embd);
    w.u32(&k("block_count"), g.n_layer);
    w.u32(&k("feed_forward_length"), g.n_ff);
    w.u32(&k("attention.head_count"), g.n_head);
    if arch != "gemma4" {
        w.u32(&k("attention.head_count_kv"), g.n_head_kv);
    }
    w.u32(&k("rope.dimension_count"), g.head_dim());
    if g.head_dim != 0 {
        w.u32(&k("attention.key_length"), g.head_dim);
        w.u32(&k("attention.value_length"), g.head_dim);
    }
    if let Some((n_exp, used)) = g.experts {
        w.u32(&k("expert_count"), n_exp);
        w.u32(&k("expert_used_count"), used);
        w.u32(&k("expert_feed_forward_length"), g.n_ff);
    }
    if g.window > 0 {
        w.u32(&k("attention.sliding_window"), g.window);
    }
    w.f32(&k("rope.freq_base"), g.rope_base);
    w.f32(&k("attention.layer_norm_rms_epsilon"), g.rms_eps);
    if arch == "gemma4" {
        let n = g.n_layer as usize;
        let pattern: Vec<bool> = (0..n)
            .map(|l| GEMMA4_PATTERN[l % GEMMA4_PATTERN.len()])
            .collect();
        w.bools(&k("attention.sliding_window_pattern"), &pattern);
        w.u32(
            &k("attention.shared_kv_layers"),
            GEMMA4_SHARED_KV.min(g.n_layer),
        );
        let kv_heads: Vec<i32> = pattern
            .iter()
            .map(|&windowed| gemma4_shape(&g, windowed).1 as i32)
            .collect();
        w.i32s(&k("attention.head_count_kv"), &kv_heads);
        w.u32(&k("attention.key_length_swa"), GEMMA4_SWA_HEAD);
        w.u32(&k("attention.value_length_swa"), GEMMA4_SWA_HEAD);
        w.u32(&k("rope.dimension_count_swa"), GEMMA4_SWA_HEAD);
        w.f32(&k("rope.freq_base_swa"), 1e4);
        w.u32(&k("embedding_length_per_layer_input"), 0);
    }
    if arch == "gemma3n" {
        let flags: Vec<bool> = (0..g.n_layer as usize)
            .map(|l| GEMMA3N_PATTERN[l % GEMMA3N_PATTERN.len()])
            .collect();
        w.bools(&k("attention.sliding_window_pattern"), &flags);
        w.f32(&k("rope.freq_base_swa"), 1e4);
        w.f32(&k("final_logit_softcapping"), 30.0);
        w.u32(
            &k("embedding_length_per_layer_input"),
            GEMMA3N_PER_LAYER as u32,
        );
    }
    if arch == "cohere2" {
        // A layer norm, and logits scaled (Command R7B's 0.25).
        w.f32(&k("attention.layer_norm_epsilon"), g.rms_eps);
        w.f32(&k("logit_scale"), 0.25);
    }
    w.u32(&k("vocab_size"), n_vocab as u32);
    copy_tokenizer(&mut w, &tok_bytes, n_vocab)?;
    let specs = tensors(&g, n_vocab as u32, a.quant);
    let mut sizes = Vec::with_capacity(specs.len());
    for (name, dims, ty) in &specs {
        sizes.push(w.tensor(name, dims, *ty)?);
    }
    let total: u64 = sizes.iter().sum();
    eprintln!(
        "synth-model: {} ({arch}, {} layers, {} wide, {}/{} heads, vocabulary {n_vocab}), {:?}: {} tensors, {:.2} GiB",
        g.name,
        g.n_layer,
        g.n_embd,
        g.n_head,
        g.n_head_kv,
        a.quant,
        specs.len(),
        gib(total)
    );
    let file = std::fs::File::create(&a.out).map_err(io(&a.out))?;
    let mut out = BufWriter::with_capacity(8 << 20, file);
    out.write_all(&w.header()).map_err(io(&a.out))?;
    let mut rng = Rng(a.seed);
    // A pool of random blocks per type, written from a random offset each
    // time: random enough for speed, and made at disk speed.
    const POOL: usize = 1 << 16;
    let mut pools: Vec<(u32, Vec<u8>)> = Vec::new();
    let ones: Vec<u8> = 1f32.to_le_bytes().repeat(1 << 16);
    let zeros = vec![0u8; ones.len()];
    // Gemma 4 scales attention scores by 1 (its Q and K are normalised
    // instead): with norm weights of 1 the scores of random weights reach
    // tens and every softmax is one-hot, so small differences in arithmetic
    // flip it. A real model's learned weights keep them moderate; these do.
    let quarters: Vec<u8> = 0.25f32.to_le_bytes().repeat(1 << 16);
    let mut written = 0u64;
    let mut last_report = Instant::now();
    for ((name, _, ty), &bytes) in specs.iter().zip(&sizes) {
        let (buf, start) = if *ty == F32 {
            // Norm weights 1, biases 0.
            let qk_norm =
                name.ends_with("attn_q_norm.weight") || name.ends_with("attn_k_norm.weight");
            // AltUp's router and coefficients at 0: each stream predicts
            // itself and takes the layer's correction whole (random mixing
            // weights would compound over the layers).
            let altup_mix = [
                "altup_router.",
                "altup_predict_coef.",
                "altup_correct_coef.",
            ]
            .iter()
            .any(|t| name.contains(t));
            (
                if name.ends_with(".bias") {
                    &zeros
                } else if matches!(arch, "gemma4" | "gemma3n") && qk_norm {
                    &quarters
                } else if arch == "gemma3n" && altup_mix {
                    &zeros
                } else {
                    &ones
                },
                0,
            )
        } else {
            let i = match pools.iter().position(|(t, _)| t == ty) {
                Some(i) => i,
                None => {
                    pools.push((*ty, block_pool(*ty, POOL, &mut rng)));
                    pools.len() - 1
                }
            };
            let pool = &pools[i].1;
            (pool, (rng.next() as usize % POOL) * (pool.len() / POOL))
        };
        // `bytes` of `buf` from `start`, round and round.
        let (mut left, mut at) = (bytes as usize, start);
        while left > 0 {
            let n = left.min(buf.len() - at);
            out.write_all(&buf[at..at + n]).map_err(io(&a.out))?;
            left -= n;
            at = 0;
        }
        out.write_all(&vec![0u8; padding(bytes) as usize])
            .map_err(io(&a.out))?;
        written += bytes;
        if last_report.elapsed().as_secs_f64() > 2.0 {
            eprintln!("synth-model: {:.1} / {:.1} GiB", gib(written), gib(total));
            last_report = Instant::now();
        }
    }
    out.flush().map_err(io(&a.out))?;
    eprintln!(
        "synth-model: wrote {} in {:.1} s. Random weights: its text is noise, its speed is {}'s",
        a.out.display(),
        t0.elapsed().as_secs_f64(),
        g.name
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q4_k_m_gives_more_bits_where_llama_cpp_does() {
        // llama.cpp's use_more_bits for 28 layers: the first 3, the last 4,
        // and every third in between.
        let more: Vec<u32> = (0..28).filter(|&l| more_bits(l, 28)).collect();
        assert_eq!(more, [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26, 27]);
    }

    #[test]
    fn random_blocks_have_a_real_models_spread() {
        // Dequantize Q8_0 blocks (the simplest layout) and check the spread.
        let pool = block_pool(Q8_0, 256, &mut Rng(3));
        let mut sum = 0f64;
        let mut sq = 0f64;
        for b in pool.chunks_exact(34) {
            let d = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
            for &q in &b[2..] {
                let w = f64::from(d * f32::from(q as i8));
                sum += w;
                sq += w * w;
            }
        }
        let n = 256.0 * 32.0;
        let (mean, sd) = (sum / n, (sq / n - (sum / n).powi(2)).sqrt());
        assert!(
            mean.abs() < 0.002 && (0.01..0.04).contains(&sd),
            "{mean} {sd}"
        );
    }

    #[test]
    fn pads_token_arrays_with_unused_tokens() {
        let mut w = GgufWriter::default();
        w.strs("tokenizer.ggml.tokens", &["a".into(), "b".into()]);
        w.i32s("tokenizer.ggml.token_type", &[1, 3]);
        let h = w.header();
        let mut out = GgufWriter::default();
        assert_eq!(copy_tokenizer(&mut out, &h, 4).unwrap(), 2);
        let back = GgufHeader::parse(&out.header()).unwrap();
        assert_eq!(
            back.strs("tokenizer.ggml.tokens").unwrap(),
            ["a", "b", "<synth_pad_2>", "<synth_pad_3>"].map(String::from)
        );
        assert_eq!(
            back.ints("tokenizer.ggml.token_type").unwrap(),
            [1, 3, 5, 5]
        );
    }
}
