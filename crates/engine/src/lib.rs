//! llama.cpp for siliceo-infer, through the `llama-cpp-2` crate.
//!
//! This is the only crate that touches llama.cpp. It gives the layers above a
//! small, typed surface:
//!
//! - [`Model`]: a loaded GGUF — its [`ModelGeometry`](siliceo_core::ModelGeometry),
//!   vocabulary, chat template, tokenization.
//! - [`Context`]: one inference context with a *unified* KV cache shared by up
//!   to `n_seq_max` sequences. [`Context::decode`] runs a [`Batch`] that may mix
//!   tokens of many sequences; sequence operations remove, share
//!   ([`Context::seq_cp`]: cells are tagged, not copied), shift, save to and
//!   restore from host memory.
//! - [`Detokenizer`] / [`Utf8Stream`]: token-by-token text that never splits a
//!   UTF-8 character.
//! - [`generate()`]: one sequence start to finish, with sampling from
//!   [`siliceo_core::Sampler`], stop tokens, stop strings and max tokens.
//!
//! Errors are one [`EngineError`] enum; a full KV cache is
//! [`EngineError::KvCacheFull`], which a scheduler handles by evicting or
//! preempting. llama.cpp's log goes to `tracing`.
//!
//! ```no_run
//! use siliceo_core::{SamplingParams, SeqId};
//! use siliceo_engine::{Context, ContextOptions, Model, ModelOptions, generate};
//!
//! let model = Model::load("models/SmolLM2-135M-Instruct.Q4_1.gguf", &ModelOptions::default())?;
//! let mut ctx = Context::new(&model, ContextOptions::default())?;
//! let prompt = model.tokenize("The capital of France is", true)?;
//! let out = generate(&mut ctx, SeqId(0), &prompt, &SamplingParams::greedy(), |text, _| {
//!     print!("{text}");
//!     std::ops::ControlFlow::Continue(())
//! })?;
//! println!("\n{} tokens, {:.1} tok/s", out.tokens.len(), out.decode_tokens_per_second());
//! # Ok::<(), siliceo_engine::EngineError>(())
//! ```
#![deny(missing_docs)]

mod backend;
mod context;
mod detok;
mod embed;
mod error;
pub mod eval;
mod format;
mod generate;
mod graft;
mod graft_device;
mod model;
mod omp;
mod q4_1;
mod raw;
mod reference;
mod shadow;

pub use backend::{backend_init, gpu_memory, supports_gpu_offload};
pub use context::{Batch, Context, ContextOptions, FlashAttention, SeqSnapshot};
pub use detok::{Detokenizer, TokenText, Utf8Stream};
pub use embed::{Embedder, EmbedderOptions, Embeddings, Pooling, cosine, l2_normalize};
pub use error::EngineError;
pub use format::KvFormat;
pub use generate::{Generation, generate};
pub use graft::{
    BlockPlacer, DeviceAttention, GraftOptions, GraftQuery, GraftStep, GraftedContext,
    MAX_SEQS_PER_STEP, RowCopy, SavedBlocks, StoreBlock, device_store_layers,
};
pub use model::{ChatMessage, Model, ModelOptions};
pub use siliceo_core::{LayerKv, layers_alike};

/// Whether this build serves llama.cpp's offloaded layers with siliceo's
/// CUDA kernels and a store in device memory (feature `cuda-kernels`).
pub const DEVICE_KERNELS: bool = cfg!(feature = "cuda-kernels");
pub use reference::GreedyTrace;
pub use siliceo_kernels_turing::{KvLayout, SeqKv};

pub(crate) use backend::backend;
