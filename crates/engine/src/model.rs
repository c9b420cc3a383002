//! A loaded GGUF model: geometry, vocabulary, chat template.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;

use llama_cpp_2::model::params::LlamaModelParams;
use llama_cpp_2::model::{LlamaChatMessage, LlamaModel};
use llama_cpp_2::token::LlamaToken;
use siliceo_core::{ModelGeometry, TokenId};

use crate::{EngineError, backend};

/// How to load a model.
#[derive(Debug, Clone, Default)]
pub struct ModelOptions {
    /// Layers to offload to the GPU (0 = CPU only; ignored without a GPU backend).
    pub gpu_layers: u32,
    /// Batch-invariant weight products: no repacked weights
    /// (`use_extra_bufts = false`) and no tiled K-quant products
    /// (`GGML_CPU_TILED_MM=0`), whose results depend on how many rows a batch
    /// has. Costs speed on K-quant models (docs/BENCHMARKS.md). The tiled
    /// switch is read once per process, at its first matrix product: set it
    /// for the first model a process runs.
    pub deterministic: bool,
}

/// One chat message (`role` is `system`, `user` or `assistant`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    /// Who speaks.
    pub role: String,
    /// What they say.
    pub content: String,
}

impl ChatMessage {
    /// A message.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A GGUF model loaded through llama.cpp. Shareable across threads; contexts
/// borrow it.
pub struct Model {
    inner: LlamaModel,
    path: PathBuf,
    geometry: ModelGeometry,
    architecture: String,
    name: String,
    gpu_layers: u32,
    /// `{arch}.attention.sliding_window_pattern` when the file lists it per
    /// layer (llama.cpp's metadata strings leave arrays out).
    window_flags: Option<Vec<bool>>,
    /// `{arch}.attention.head_count_kv` when the file lists it per layer.
    kv_heads: Option<Vec<u32>>,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("path", &self.path)
            .field("architecture", &self.architecture)
            .field("geometry", &self.geometry)
            .finish_non_exhaustive()
    }
}

/// Checks the GGUF magic and version before llama.cpp sees the file, so a wrong
/// file gets a clear error.
fn check_gguf_header(path: &Path) -> Result<(), EngineError> {
    let mut f = File::open(path).map_err(|source| {
        if source.kind() == std::io::ErrorKind::NotFound {
            EngineError::ModelNotFound {
                path: path.to_owned(),
            }
        } else {
            EngineError::Io {
                path: path.to_owned(),
                source,
            }
        }
    })?;
    let mut header = [0u8; 8];
    let not_gguf = |reason: &str| EngineError::NotGguf {
        path: path.to_owned(),
        reason: reason.to_owned(),
    };
    f.read_exact(&mut header)
        .map_err(|_| not_gguf("file is shorter than a GGUF header"))?;
    if &header[..4] != b"GGUF" {
        return Err(not_gguf("missing the `GGUF` magic bytes"));
    }
    let version = u32::from_le_bytes([header[4], header[5], header[6], header[7]]);
    if !(2..=3).contains(&version) {
        return Err(not_gguf(&format!("unsupported GGUF version {version}")));
    }
    Ok(())
}

impl Model {
    /// Loads a GGUF file.
    pub fn load(path: impl AsRef<Path>, opts: &ModelOptions) -> Result<Model, EngineError> {
        let path = path.as_ref();
        if !path.is_file() {
            return Err(EngineError::ModelNotFound {
                path: path.to_owned(),
            });
        }
        check_gguf_header(path)?;
        let backend = backend()?;
        let inner = if opts.deterministic {
            load_without_repacking(path, opts.gpu_layers)?
        } else {
            let params = LlamaModelParams::default().with_n_gpu_layers(opts.gpu_layers);
            LlamaModel::load_from_file(backend, path, &params).map_err(|source| {
                EngineError::ModelLoad {
                    path: path.to_owned(),
                    source,
                }
            })?
        };
        let architecture = inner
            .meta_val_str("general.architecture")
            .unwrap_or_else(|_| "unknown".into());
        let name = inner.meta_val_str("general.name").unwrap_or_else(|_| {
            path.file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default()
        });
        let meta_u32 = |key: &str| {
            inner
                .meta_val_str(&format!("{architecture}.{key}"))
                .ok()
                .and_then(|v| v.trim().parse::<u32>().ok())
        };
        let n_head = inner.n_head();
        let n_embd = u32::try_from(inner.n_embd()).unwrap_or(0);
        let default_head_dim = n_embd.checked_div(n_head).unwrap_or(0);
        let geometry = ModelGeometry {
            n_layer: inner.n_layer(),
            n_head,
            n_head_kv: inner.n_head_kv(),
            head_dim_k: meta_u32("attention.key_length").unwrap_or(default_head_dim),
            head_dim_v: meta_u32("attention.value_length").unwrap_or(default_head_dim),
            n_embd,
            n_vocab: u32::try_from(inner.n_vocab()).unwrap_or(0),
            n_ctx_train: inner.n_ctx_train(),
        };
        tracing::info!(path = %path.display(), %architecture, ?geometry, "model loaded");
        // Arrays llama.cpp's metadata strings leave out, read in one pass.
        let [window_flags, kv_heads] = gguf_arrays(
            path,
            [
                &format!("{architecture}.attention.sliding_window_pattern"),
                &format!("{architecture}.attention.head_count_kv"),
            ],
        );
        let window_flags = window_flags.map(|f| f.into_iter().map(|x| x != 0).collect());
        Ok(Model {
            inner,
            path: path.to_owned(),
            geometry,
            architecture,
            name,
            gpu_layers: if backend::supports_gpu_offload() {
                opts.gpu_layers
            } else {
                0
            },
            window_flags,
            kv_heads,
        })
    }

    /// The repeating layers llama.cpp puts on the GPU
    /// ([`siliceo_core::offloaded_layers`]); none without a GPU backend.
    pub fn offloaded_layers(&self) -> std::ops::Range<usize> {
        siliceo_core::offloaded_layers(self.geometry.n_layer as usize, self.gpu_layers as usize)
    }

    /// The file it was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Layers, heads, dimensions, vocabulary, trained context.
    pub fn geometry(&self) -> ModelGeometry {
        self.geometry
    }

    /// `general.architecture` (e.g. `llama`, `qwen2`).
    pub fn architecture(&self) -> &str {
        &self.architecture
    }

    /// `general.name`, or the file name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Bytes of weights (llama.cpp's `llama_model_size`).
    pub fn weight_bytes(&self) -> u64 {
        self.inner.size()
    }

    /// Parameter count.
    pub fn n_params(&self) -> u64 {
        self.inner.n_params()
    }

    /// A metadata value of the GGUF, as a string.
    pub fn meta(&self, key: &str) -> Option<String> {
        self.inner.meta_val_str(key).ok()
    }

    /// The architecture's metadata value `{arch}.{key}`, parsed.
    fn arch_meta<T: std::str::FromStr>(&self, key: &str) -> Option<T> {
        self.meta(&format!("{}.{key}", self.architecture))?
            .trim()
            .parse()
            .ok()
    }

    /// The model's default chat template (Jinja source), if it has one.
    pub fn chat_template(&self) -> Option<String> {
        self.inner
            .chat_template(None)
            .ok()
            .and_then(|t| t.to_string().ok())
    }

    /// The text of the BOS and EOS tokens (for chat templates that print
    /// them), and whether tokenizing adds a BOS.
    pub fn bos_eos(&self) -> (String, String, bool) {
        let vocab = self.inner.vocab();
        let text = |t: LlamaToken| {
            if t.0 < 0 {
                String::new()
            } else {
                String::from_utf8_lossy(&self.token_bytes(TokenId(t.0 as u32), true)).into_owned()
            }
        };
        (text(vocab.bos()), text(vocab.eos()), vocab.should_add_bos())
    }

    /// Renders `messages` with the model's chat template; `add_assistant`
    /// leaves the assistant's turn open for generation.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_assistant: bool,
    ) -> Result<String, EngineError> {
        let template = self
            .inner
            .chat_template(None)
            .map_err(|_| EngineError::NoChatTemplate)?;
        let msgs = messages
            .iter()
            .map(|m| LlamaChatMessage::new(m.role.clone(), m.content.clone()))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| EngineError::ChatTemplate(e.to_string()))?;
        self.inner
            .apply_chat_template(&template, &msgs, add_assistant)
            .map_err(|e| EngineError::ChatTemplate(e.to_string()))
    }

    /// Tokenizes `text`. `add_special` adds BOS/EOS where the model wants them;
    /// special tokens written in the text (`<|im_start|>`) are always parsed.
    pub fn tokenize(&self, text: &str, add_special: bool) -> Result<Vec<TokenId>, EngineError> {
        if text.as_bytes().contains(&0) {
            return Err(EngineError::Tokenize("text contains a NUL byte".into()));
        }
        let toks = self
            .inner
            .vocab()
            .tokenize(text.as_bytes(), add_special, true);
        Ok(toks.into_iter().map(|t| TokenId(t.0 as u32)).collect())
    }

    /// The bytes one token stands for. Control tokens render as their text when
    /// `special` is true and as nothing otherwise.
    pub fn token_bytes(&self, token: TokenId, special: bool) -> Vec<u8> {
        self.inner
            .vocab()
            .token_to_piece(LlamaToken(token.0 as i32), special, None)
    }

    /// Text of a token sequence (invalid UTF-8 replaced by U+FFFD).
    pub fn detokenize(&self, tokens: &[TokenId], special: bool) -> String {
        let mut bytes = Vec::new();
        for &t in tokens {
            bytes.extend(self.token_bytes(t, special));
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// Checks that `draft` can draft for this model: the same token ids must
    /// mean the same text. Vocabulary sizes may differ by up to 128 padding
    /// entries (llama.cpp's own speculative example allows the same); the ids
    /// both have are compared on a sample (the first 512, every 97th, the last
    /// 512) and on the tokenization of a probe text with special tokens.
    pub fn check_draft_compatible(&self, draft: &Model) -> Result<(), EngineError> {
        const MAX_SIZE_DIFFERENCE: u32 = 128;
        let (nt, nd) = (self.geometry.n_vocab, draft.geometry.n_vocab);
        if nt.abs_diff(nd) > MAX_SIZE_DIFFERENCE {
            return Err(EngineError::IncompatibleVocab(format!(
                "{nd} draft tokens vs {nt} target tokens (at most {MAX_SIZE_DIFFERENCE} apart)"
            )));
        }
        let n = nt.min(nd);
        let sample = (0..n.min(512))
            .chain((0..n).step_by(97))
            .chain(n.saturating_sub(512)..n);
        for id in sample {
            let (a, b) = (
                self.token_bytes(TokenId(id), true),
                draft.token_bytes(TokenId(id), true),
            );
            if a != b {
                return Err(EngineError::IncompatibleVocab(format!(
                    "token {id} is {:?} in the target and {:?} in the draft",
                    String::from_utf8_lossy(&a),
                    String::from_utf8_lossy(&b)
                )));
            }
        }
        let probe = "def f(x):\n    return x * 2  # naïve, 数字 🙂";
        if self.tokenize(probe, true)? != draft.tokenize(probe, true)? {
            return Err(EngineError::IncompatibleVocab(
                "the same text tokenizes differently".into(),
            ));
        }
        Ok(())
    }

    /// The prompt of a fill-in-the-middle request, as llama.cpp's server
    /// builds it for a model with FIM tokens: `<fim_prefix> prefix
    /// <fim_suffix> suffix <fim_middle>` (BOS first where the model adds
    /// one); the model then writes the middle. `None` when the model has no
    /// FIM tokens.
    pub fn infill_tokens(
        &self,
        prefix: &str,
        suffix: &str,
    ) -> Result<Option<Vec<TokenId>>, EngineError> {
        let v = self.inner.vocab();
        let (pre, suf, mid) = (v.fim_pre(), v.fim_suf(), v.fim_mid());
        let id = |t: LlamaToken| u32::try_from(t.0).ok().map(TokenId);
        let (Some(pre), Some(suf), Some(mid)) = (id(pre), id(suf), id(mid)) else {
            return Ok(None);
        };
        // BOS (where the model wants one) comes from tokenizing nothing.
        let mut out = self.tokenize("", true)?;
        out.push(pre);
        out.extend(self.tokenize(prefix, false)?);
        out.push(suf);
        out.extend(self.tokenize(suffix, false)?);
        out.push(mid);
        Ok(Some(out))
    }

    /// Whether `token` ends a generation (EOS, EOT, `<|im_end|>`, …).
    pub fn is_eog(&self, token: TokenId) -> bool {
        self.inner.vocab().is_eog(LlamaToken(token.0 as i32))
    }

    /// Whether `token` is a control token (`<|im_start|>`, `<|im_end|>`, …):
    /// markup, never text.
    pub fn is_control(&self, token: TokenId) -> bool {
        self.inner.vocab().is_control(LlamaToken(token.0 as i32))
    }

    /// Whether `token` is inside the vocabulary.
    pub fn is_valid_token(&self, token: TokenId) -> bool {
        token.0 < self.geometry.n_vocab
    }

    pub(crate) fn llama(&self) -> &LlamaModel {
        &self.inner
    }

    /// The `llama_model` behind the safe wrapper, for the raw contexts
    /// (shadow and grafted attention) `llama-cpp-2` cannot build.
    pub(crate) fn raw(&self) -> NonNull<llama_cpp_sys_2::llama_model> {
        const _: () = assert!(
            std::mem::size_of::<LlamaModel>()
                == std::mem::size_of::<NonNull<llama_cpp_sys_2::llama_model>>()
        );
        // SAFETY: llama-cpp-2 =0.1.160 (pinned) declares `LlamaModel` as
        // `#[repr(transparent)]` over `Ptr<llama_model>`, itself
        // `#[repr(transparent)]` over `NonNull<llama_model>`; the copy is a
        // pointer the wrapper keeps owning.
        unsafe { std::mem::transmute_copy(&self.inner) }
    }

    /// Each layer's sliding attention window (0 = the whole context), as
    /// llama.cpp builds the layer's mask: where the model has a window
    /// (`llama_model_n_swa`), a layer is windowed by the GGUF's
    /// `{arch}.attention.sliding_window_pattern` (one flag per layer, or a
    /// period whose last layer is global), or else by the architecture's
    /// default period as llama.cpp sets it (`load_swa_pattern` in its
    /// `src/models/*.cpp`). `None` for a windowed architecture this table
    /// does not know, or one whose windows are not llama.cpp's standard
    /// kind (chunked, symmetric).
    pub fn attention_windows(&self) -> Option<Vec<usize>> {
        // SAFETY: a plain query of a loaded model.
        let n_swa = unsafe { llama_cpp_sys_2::llama_model_n_swa(self.raw().as_ptr()) };
        let layers = self.geometry.n_layer as usize;
        let window = usize::try_from(n_swa).unwrap_or(0);
        if window == 0 {
            return Some(vec![0; layers]);
        }
        let arch = &self.architecture;
        // Standard windows, the global layer last in each period.
        let period = match arch.as_str() {
            "gemma2" | "gpt-oss" => Some(2),
            "cohere2" | "olmo2" => Some(4),
            // EXAONE 4 has windows only at 32B's 64 layers (llama.cpp reads
            // a window key in the others too, but masks them as global).
            "exaone4" if layers == 64 => Some(4),
            "exaone4" => return Some(vec![0; layers]),
            "gemma3" => Some(6),
            // Gemma 4's GGUF lists its windowed layers (llama.cpp requires
            // the list): no period to fall back on.
            "gemma4" => None,
            // Gemma 3n's: listed, or one global layer in five
            // (`load_swa_pattern(ml, 5)` in llama.cpp's `gemma3n.cpp`).
            "gemma3n" => Some(5),
            _ => return None,
        };
        // Listed per layer (read from the file: llama.cpp's metadata
        // strings leave arrays out), or a period in the file, or the
        // architecture's.
        let key = "attention.sliding_window_pattern";
        match &self.window_flags {
            Some(f) if f.len() >= layers => Some(
                f[..layers]
                    .iter()
                    .map(|&w| if w { window } else { 0 })
                    .collect(),
            ),
            Some(_) => None,
            None => {
                let p = match self.meta(&format!("{arch}.{key}")) {
                    Some(v) => v.trim().parse().ok()?,
                    None => period?,
                };
                Some(windows_by_period(layers, p, window))
            }
        }
    }

    /// Each layer's KV as llama.cpp keeps it: its heads' size (Gemma 4's
    /// windowed layers have their own, `attention.key_length_swa`), its KV
    /// heads (`attention.head_count_kv` may list them per layer) and the
    /// layer whose KV it attends over — itself, but for the last
    /// `attention.shared_kv_layers` layers of Gemma 4, which read the last
    /// windowed or global layer with KV of its own (llama.cpp's `reuse`
    /// in `llama-model.cpp`). `None` where the windows are not known.
    pub fn layer_kv(&self) -> Option<Vec<siliceo_core::LayerKv>> {
        let g = self.geometry;
        let windows = self.attention_windows()?;
        let full = g.head_dim_k as usize;
        let swa = self.arch_meta("attention.key_length_swa").unwrap_or(full);
        let shared = siliceo_core::shared_kv_layers(
            &self.architecture,
            windows.len(),
            self.arch_meta::<usize>("attention.shared_kv_layers"),
        );
        let windowed: Vec<bool> = windows.iter().map(|&w| w > 0).collect();
        let kv_heads = |il: usize| {
            self.kv_heads
                .as_ref()
                .and_then(|h| h.get(il))
                .map_or(g.n_head_kv as usize, |&h| h as usize)
        };
        Some(siliceo_core::layer_kv(
            &windowed,
            (full, swa),
            kv_heads,
            shared,
        ))
    }

    /// Whether the model's attention has sinks (gpt-oss: a learned logit
    /// per head in each softmax's denominator).
    pub fn has_attention_sinks(&self) -> bool {
        self.architecture == "gpt-oss"
    }

    /// Refuses a model whose attention grafted serving cannot compute: it
    /// must be causal softmax attention over one KV cache per layer, over
    /// the whole context or a standard sliding window
    /// ([`Model::attention_windows`]), without ALiBi, logit soft-capping or
    /// attention sinks (also checked per op at run time), with equal K and
    /// V head sizes.
    pub fn check_graftable(&self) -> Result<(), EngineError> {
        let refuse = |why: String| {
            Err(EngineError::Unsupported {
                model: self.name.clone(),
                reason: why,
            })
        };
        let raw = self.raw().as_ptr();
        // SAFETY: plain queries of a loaded model.
        let (recurrent, hybrid, encoder, swa) = unsafe {
            (
                llama_cpp_sys_2::llama_model_is_recurrent(raw),
                llama_cpp_sys_2::llama_model_is_hybrid(raw),
                llama_cpp_sys_2::llama_model_has_encoder(raw),
                llama_cpp_sys_2::llama_model_n_swa(raw),
            )
        };
        if recurrent || hybrid {
            return refuse("recurrent or hybrid memory (no KV cache to graft)".into());
        }
        if encoder {
            return refuse("an encoder with cross-attention".into());
        }
        // Gemma 4's and Gemma 3n's: checked before the windows, which those
        // have too, so the refusal names what the store lacks first.
        let arch = &self.architecture;
        let meta_u = |key: &str| self.arch_meta::<u32>(key);
        // Gemma 4's and Gemma 3n's are served (`Model::layer_kv`, tested on
        // synthetic `gemma4-mini` and `gemma3n-mini`); others' are not tried.
        let per_layer_ok = arch == "gemma4" || arch == "gemma3n";
        let shared = siliceo_core::shared_kv_layers(
            arch,
            self.geometry.n_layer as usize,
            meta_u("attention.shared_kv_layers").map(|n| n as usize),
        );
        if let Some(n) = Some(shared).filter(|&n| n > 0 && !per_layer_ok) {
            return refuse(format!(
                "KV shared across layers (the last {n} layers attend over earlier layers' KV, \
                 as Gemma 4's and Gemma 3n's do)"
            ));
        }
        let g = self.geometry;
        let swa_heads = [
            meta_u("attention.key_length_swa"),
            meta_u("attention.value_length_swa"),
        ];
        if let Some(d) = swa_heads
            .into_iter()
            .flatten()
            .find(|&d| (d != g.head_dim_k || d != g.head_dim_v) && !per_layer_ok)
        {
            return refuse(format!(
                "heads of a size per layer (windowed layers' of {d}, the others' of {})",
                g.head_dim_k
            ));
        }
        if swa > 0 && self.attention_windows().is_none() {
            return refuse(format!(
                "sliding-window attention (window {swa}) of an architecture ({}) whose \
                 windowed layers this build does not know",
                self.architecture
            ));
        }
        if g.head_dim_k != g.head_dim_v {
            return refuse(format!(
                "K and V heads of different sizes ({} and {}), as in MLA",
                g.head_dim_k, g.head_dim_v
            ));
        }
        // llama.cpp's architectures whose attention has sinks (a learned
        // logit per head in the softmax, `attn_sinks` tensors) other than
        // gpt-oss, whose sinks the kernel takes (tested on a synthetic
        // gpt-oss): not tried here.
        if matches!(
            arch.as_str(),
            "mimo2" | "granite_swa" | "hy_v4" | "dflash" | "deepseek4"
        ) {
            return refuse("attention sinks in an architecture not tested with them".into());
        }
        let meta_f = |key: &str| self.arch_meta::<f64>(key);
        if meta_f("attention.kv_lora_rank").is_some_and(|r| r > 0.0) {
            return refuse("multi-head latent attention (MLA)".into());
        }
        if meta_f("attention.max_alibi_bias").is_some_and(|b| b > 0.0) {
            return refuse("ALiBi position biases".into());
        }
        if meta_f("attn_logit_softcapping").is_some_and(|c| c > 0.0) {
            return refuse("attention logit soft-capping".into());
        }
        // LongRoPE (Phi-3's long-context variants): llama.cpp picks the long
        // or short rope factors by the context size it is given.
        let scaling = self.meta(&format!("{arch}.rope.scaling.type"));
        let long_factors = arch == "phi3"
            && self
                .meta(&format!("{arch}.rope.scaling.original_context_length"))
                .is_some();
        if scaling.as_deref().is_some_and(|t| t.contains("longrope")) || long_factors {
            return refuse(
                "LongRoPE, whose factors depend on the context size llama.cpp is given".into(),
            );
        }
        Ok(())
    }
}

/// Integer (or boolean) arrays of a GGUF's metadata, read with ggml's GGUF
/// reader (metadata only); `None` for a key that is missing or not such an
/// array.
fn gguf_arrays<const N: usize>(path: &Path, keys: [&str; N]) -> [Option<Vec<u32>>; N] {
    let mut out = [const { None }; N];
    let Ok(file) = std::ffi::CString::new(path.to_string_lossy().as_bytes()) else {
        return out;
    };
    // SAFETY: ggml's GGUF reader over a file it opens and we free; with
    // `no_alloc` and no context it reads the metadata only.
    let ctx = unsafe {
        llama_cpp_sys_2::gguf_init_from_file(
            file.as_ptr(),
            llama_cpp_sys_2::gguf_init_params {
                no_alloc: true,
                ctx: std::ptr::null_mut(),
            },
        )
    };
    if ctx.is_null() {
        return out;
    }
    for (slot, key) in out.iter_mut().zip(keys) {
        if let Ok(key) = std::ffi::CString::new(key) {
            // SAFETY: a live context (freed below).
            *slot = unsafe { gguf_u32s(ctx, &key) };
        }
    }
    // SAFETY: made above, not used after.
    unsafe { llama_cpp_sys_2::gguf_free(ctx) };
    out
}

/// One integer (or boolean) array of `ctx`'s metadata.
///
/// # Safety
/// `ctx` must be a live GGUF context.
unsafe fn gguf_u32s(
    ctx: *mut llama_cpp_sys_2::gguf_context,
    key: &std::ffi::CStr,
) -> Option<Vec<u32>> {
    // SAFETY: plain queries of a live context; the array's data holds `n`
    // elements of its type.
    unsafe {
        let id = llama_cpp_sys_2::gguf_find_key(ctx, key.as_ptr());
        let mut out = None;
        if id >= 0 && llama_cpp_sys_2::gguf_get_kv_type(ctx, id) == llama_cpp_sys_2::GGUF_TYPE_ARRAY
        {
            let n = llama_cpp_sys_2::gguf_get_arr_n(ctx, id);
            let data = llama_cpp_sys_2::gguf_get_arr_data(ctx, id);
            out = match llama_cpp_sys_2::gguf_get_arr_type(ctx, id) {
                llama_cpp_sys_2::GGUF_TYPE_BOOL
                | llama_cpp_sys_2::GGUF_TYPE_UINT8
                | llama_cpp_sys_2::GGUF_TYPE_INT8 => Some(
                    std::slice::from_raw_parts(data as *const u8, n)
                        .iter()
                        .map(|&b| u32::from(b))
                        .collect(),
                ),
                llama_cpp_sys_2::GGUF_TYPE_INT32 | llama_cpp_sys_2::GGUF_TYPE_UINT32 => {
                    Some(std::slice::from_raw_parts(data as *const u32, n).to_vec())
                }
                _ => None,
            };
        }
        out
    }
}

/// [`siliceo_core::windowed_by_period`], each windowed layer's window
/// `window` (0 for the others).
pub(crate) fn windows_by_period(layers: usize, period: usize, window: usize) -> Vec<usize> {
    siliceo_core::windowed_by_period(layers, period)
        .into_iter()
        .map(|w| if w { window } else { 0 })
        .collect()
}

/// Loads `path` through the raw API with weight repacking off (llama-cpp-2
/// does not expose `use_extra_bufts`), and turns tiled K-quant products off.
fn load_without_repacking(path: &Path, gpu_layers: u32) -> Result<LlamaModel, EngineError> {
    let c = std::ffi::CString::new(path.to_string_lossy().as_bytes()).map_err(|_| {
        EngineError::InvalidOption {
            field: "model",
            reason: "path holds a NUL byte".into(),
        }
    })?;
    if std::env::var_os("GGML_CPU_TILED_MM").is_none() {
        // SAFETY: set before llama.cpp's first matrix product reads it (once,
        // under a call_once); no other thread of ours reads the environment
        // while a model loads.
        unsafe { std::env::set_var("GGML_CPU_TILED_MM", "0") };
    }
    // SAFETY: plain C calls with llama.cpp's default parameters.
    let ptr = unsafe {
        let mut p = llama_cpp_sys_2::llama_model_default_params();
        p.n_gpu_layers = gpu_layers as i32;
        p.use_extra_bufts = false;
        llama_cpp_sys_2::llama_model_load_from_file(c.as_ptr(), p)
    };
    let ptr = NonNull::new(ptr).ok_or_else(|| EngineError::ModelLoad {
        path: path.to_owned(),
        source: llama_cpp_2::LlamaModelLoadError::NullResult,
    })?;
    // SAFETY: the layout argument of `Model::raw`, the other way: the wrapper
    // takes ownership and frees the model on drop (llama_model_free).
    Ok(unsafe { std::mem::transmute::<NonNull<llama_cpp_sys_2::llama_model>, LlamaModel>(ptr) })
}
