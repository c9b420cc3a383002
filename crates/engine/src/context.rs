//! An inference context: KV cache, batched decode, sequence operations.

use std::num::NonZeroU32;

use llama_cpp_2::DecodeError;
use llama_cpp_2::SeqState;
use llama_cpp_2::context::LlamaContext;
use llama_cpp_2::context::params::{KvCacheType, LlamaContextParams};
use llama_cpp_2::llama_batch::LlamaBatch;
use llama_cpp_2::token::LlamaToken;
use siliceo_core::{KvType, SeqId, TokenId};

use crate::{EngineError, Model};

/// When llama.cpp uses flash attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FlashAttention {
    /// llama.cpp decides (on where the backend supports it).
    #[default]
    Auto,
    /// Always (needed for a quantized V cache).
    On,
    /// Never.
    Off,
}

/// How to build a [`Context`]. The defaults suit one interactive user on a
/// small model; servers raise `n_seq_max` and `n_ctx`.
#[derive(Debug, Clone)]
pub struct ContextOptions {
    /// KV cells shared by all sequences (unified KV cache).
    pub n_ctx: u32,
    /// Most tokens one `decode` call may carry.
    pub n_batch: u32,
    /// Physical micro-batch size llama.cpp splits a batch into.
    pub n_ubatch: u32,
    /// Sequence ids available (`0..n_seq_max`), at most 256.
    pub n_seq_max: u32,
    /// Threads for single-token decode; `None` = all cores.
    pub n_threads: Option<u32>,
    /// Threads for batches; `None` = all cores.
    pub n_threads_batch: Option<u32>,
    /// K cache element type.
    pub type_k: KvType,
    /// V cache element type.
    pub type_v: KvType,
    /// Flash attention policy; forced on when V is quantized.
    pub flash_attention: FlashAttention,
}

impl Default for ContextOptions {
    fn default() -> Self {
        ContextOptions {
            n_ctx: 4096,
            n_batch: 512,
            n_ubatch: 512,
            n_seq_max: 16,
            n_threads: None,
            n_threads_batch: None,
            type_k: KvType::F16,
            type_v: KvType::F16,
            flash_attention: FlashAttention::Auto,
        }
    }
}

impl ContextOptions {
    /// Checks ranges; the error names the option.
    pub fn validate(&self) -> Result<(), EngineError> {
        let bad = |field, reason: String| Err(EngineError::InvalidOption { field, reason });
        if self.n_ctx < 16 {
            return bad("n_ctx", format!("must be at least 16, got {}", self.n_ctx));
        }
        if self.n_batch == 0 || self.n_ubatch == 0 {
            return bad("n_batch", "n_batch and n_ubatch must be at least 1".into());
        }
        if !(1..=256).contains(&self.n_seq_max) {
            return bad(
                "n_seq_max",
                format!("must be in 1..=256, got {}", self.n_seq_max),
            );
        }
        if self.type_v.is_quantized() && self.flash_attention == FlashAttention::Off {
            return bad(
                "flash_attention",
                format!(
                    "a quantized V cache ({}) needs flash attention",
                    self.type_v
                ),
            );
        }
        Ok(())
    }
}

fn kv_cache_type(t: KvType) -> KvCacheType {
    match t {
        KvType::F32 => KvCacheType::F32,
        KvType::F16 => KvCacheType::F16,
        KvType::Bf16 => KvCacheType::BF16,
        KvType::Q8_0 => KvCacheType::Q8_0,
        KvType::Q5_1 => KvCacheType::Q5_1,
        KvType::Q5_0 => KvCacheType::Q5_0,
        KvType::Q4_1 => KvCacheType::Q4_1,
        KvType::Q4_0 => KvCacheType::Q4_0,
        KvType::Iq4Nl => KvCacheType::IQ4_NL,
    }
}

/// Threads for llama.cpp and our attention kernel where a configuration
/// names none: `SILICEO_THREADS` when it holds a positive number, else every
/// core this process may use. The variable is for processes that share the
/// cores: a test harness running several tests at once (oversubscribed,
/// ggml's spinning barriers wait on threads the OS has descheduled), or a
/// container whose CPU quota is below the cores it sees. Read once.
pub(crate) fn default_threads() -> u32 {
    static THREADS: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *THREADS.get_or_init(|| {
        let cores = std::thread::available_parallelism()
            .map(|n| n.get() as u32)
            .unwrap_or(1);
        let var = std::env::var("SILICEO_THREADS").ok();
        threads_from_env(var.as_deref()).unwrap_or_else(|| {
            if let Some(v) = &var {
                tracing::warn!(
                    "SILICEO_THREADS={v:?} is not a positive number: using all {cores} cores"
                );
            }
            cores
        })
    })
}

/// `SILICEO_THREADS`' value as a thread count: `None` when unset, zero or
/// not a number.
fn threads_from_env(var: Option<&str>) -> Option<u32> {
    var?.trim().parse().ok().filter(|&n| n > 0)
}

/// The tokens of one `decode` call: each at a position in one or more sequences,
/// some asking for logits.
#[derive(Debug, Clone, Default)]
pub struct Batch {
    tokens: Vec<BatchToken>,
}

#[derive(Debug, Clone)]
pub(crate) struct BatchToken {
    pub(crate) token: TokenId,
    pub(crate) pos: u32,
    pub(crate) seqs: Vec<i32>,
    pub(crate) logits: bool,
}

impl Batch {
    /// An empty batch.
    pub fn new() -> Self {
        Batch::default()
    }

    /// Adds `token` at `pos` of `seq`; returns its index in the batch (the
    /// index to read logits with when `logits` is true).
    pub fn push(&mut self, token: TokenId, pos: u32, seq: SeqId, logits: bool) -> usize {
        self.push_shared(token, pos, &[seq], logits)
    }

    /// Adds a token that belongs to several sequences at once (a shared prefix
    /// or a tree node).
    pub fn push_shared(&mut self, token: TokenId, pos: u32, seqs: &[SeqId], logits: bool) -> usize {
        self.tokens.push(BatchToken {
            token,
            pos,
            seqs: seqs.iter().map(|s| s.0 as i32).collect(),
            logits,
        });
        self.tokens.len() - 1
    }

    /// Adds `seq` to the sequences of the token at `index` (a token that
    /// several draft branches share).
    ///
    /// # Panics
    /// When `index` is not a token of the batch.
    pub fn share(&mut self, index: usize, seq: SeqId) {
        self.tokens[index].seqs.push(seq.0 as i32);
    }

    /// Adds `tokens` of `seq` at consecutive positions from `start`, asking for
    /// logits on the last one only; returns that token's index.
    pub fn push_run(&mut self, tokens: &[TokenId], start: u32, seq: SeqId) -> Option<usize> {
        let n = tokens.len();
        let mut last = None;
        for (i, &t) in tokens.iter().enumerate() {
            last = Some(self.push(t, start + i as u32, seq, i + 1 == n));
        }
        last
    }

    pub(crate) fn tokens(&self) -> impl Iterator<Item = &BatchToken> {
        self.tokens.iter()
    }

    /// Tokens in the batch.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether the batch is empty.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Empties the batch, keeping its allocation.
    pub fn clear(&mut self) {
        self.tokens.clear();
    }
}

/// A saved sequence: its KV cells and positions, in host memory.
#[derive(Debug, Clone)]
pub struct SeqSnapshot {
    state: SeqState,
    n_pos: u32,
}

impl SeqSnapshot {
    /// Bytes held in host memory.
    pub fn byte_len(&self) -> usize {
        self.state.byte_len()
    }

    /// Positions the sequence held when it was saved.
    pub fn n_pos(&self) -> u32 {
        self.n_pos
    }
}

/// An inference context over a [`Model`]: one unified KV cache shared by up to
/// `n_seq_max` sequences.
pub struct Context<'m> {
    model: &'m Model,
    ctx: LlamaContext<'m>,
    batch: LlamaBatch<'static>,
    opts: ContextOptions,
    /// For each index of the last decoded batch: did it request logits.
    logits_mask: Vec<bool>,
}

impl std::fmt::Debug for Context<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("model", &self.model.name())
            .field("opts", &self.opts)
            .finish_non_exhaustive()
    }
}

impl<'m> Context<'m> {
    /// Creates a context with a unified KV cache (`kv_unified`), so a prefix can
    /// be shared between sequences by tagging cells rather than copying them.
    pub fn new(model: &'m Model, opts: ContextOptions) -> Result<Context<'m>, EngineError> {
        opts.validate()?;
        let geometry = model.geometry();
        for (field, t, row) in [
            (
                "type_k",
                opts.type_k,
                geometry.n_head_kv * geometry.head_dim_k,
            ),
            (
                "type_v",
                opts.type_v,
                geometry.n_head_kv * geometry.head_dim_v,
            ),
        ] {
            if t.row_bytes(u64::from(row)).is_none() {
                return Err(EngineError::InvalidOption {
                    field,
                    reason: format!(
                        "{t} stores blocks of {} elements; this model's KV rows have {row}",
                        t.block_elems()
                    ),
                });
            }
        }
        let flash = if opts.type_v.is_quantized() {
            FlashAttention::On
        } else {
            opts.flash_attention
        };
        let fa = match flash {
            FlashAttention::Auto => llama_cpp_sys_2::LLAMA_FLASH_ATTN_TYPE_AUTO,
            FlashAttention::On => llama_cpp_sys_2::LLAMA_FLASH_ATTN_TYPE_ENABLED,
            FlashAttention::Off => llama_cpp_sys_2::LLAMA_FLASH_ATTN_TYPE_DISABLED,
        };
        let threads = opts.n_threads.unwrap_or_else(default_threads);
        let threads_batch = opts.n_threads_batch.unwrap_or(threads);
        let n_batch = opts.n_batch.min(opts.n_ctx);
        let params = LlamaContextParams::default()
            .with_n_ctx(NonZeroU32::new(opts.n_ctx))
            .with_n_batch(n_batch)
            .with_n_ubatch(opts.n_ubatch.min(n_batch))
            .with_n_seq_max(opts.n_seq_max)
            .with_n_threads(threads as i32)
            .with_n_threads_batch(threads_batch as i32)
            .with_type_k(kv_cache_type(opts.type_k))
            .with_type_v(kv_cache_type(opts.type_v))
            .with_flash_attention_policy(fa)
            .with_kv_unified(true);
        let ctx = model
            .llama()
            .new_context(crate::backend()?, params)
            .map_err(|source| EngineError::ContextCreate {
                n_ctx: opts.n_ctx,
                type_k: opts.type_k,
                type_v: opts.type_v,
                source,
            })?;
        let batch = LlamaBatch::new(n_batch as usize, opts.n_seq_max as i32);
        Ok(Context {
            model,
            ctx,
            batch,
            opts: ContextOptions { n_batch, ..opts },
            logits_mask: Vec::new(),
        })
    }

    /// The model this context runs.
    pub fn model(&self) -> &'m Model {
        self.model
    }

    /// The options it was built with (`n_batch` clamped to `n_ctx`).
    pub fn options(&self) -> &ContextOptions {
        &self.opts
    }

    /// KV cells in the cache.
    pub fn n_ctx(&self) -> u32 {
        self.ctx.n_ctx()
    }

    /// Most tokens per `decode`.
    pub fn n_batch(&self) -> u32 {
        self.opts.n_batch
    }

    /// Sequence ids available.
    pub fn n_seq_max(&self) -> u32 {
        self.opts.n_seq_max
    }

    fn check_seq(&self, seq: SeqId) -> Result<i32, EngineError> {
        if seq.0 < self.opts.n_seq_max {
            Ok(seq.0 as i32)
        } else {
            Err(EngineError::InvalidSeq {
                seq: seq.0,
                n_seq_max: self.opts.n_seq_max,
            })
        }
    }

    /// Runs the model over `batch`. Tokens of many sequences may share one call;
    /// each sequence sees only its own (and shared) cells.
    pub fn decode(&mut self, batch: &Batch) -> Result<(), EngineError> {
        if batch.is_empty() {
            return Ok(());
        }
        if batch.len() > self.opts.n_batch as usize {
            return Err(EngineError::BatchTooLarge {
                tokens: batch.len(),
                n_batch: self.opts.n_batch,
            });
        }
        let n_vocab = self.model.geometry().n_vocab;
        self.batch.clear();
        self.logits_mask.clear();
        for t in &batch.tokens {
            if t.token.0 >= n_vocab {
                return Err(EngineError::InvalidToken {
                    token: t.token.0,
                    n_vocab,
                });
            }
            for &s in &t.seqs {
                self.check_seq(SeqId(s as u32))?;
            }
            if t.pos >= self.ctx.n_ctx() {
                return Err(EngineError::PromptTooLong {
                    tokens: t.pos as usize + 1,
                    n_ctx: self.ctx.n_ctx(),
                });
            }
            self.batch
                .add(
                    LlamaToken(t.token.0 as i32),
                    t.pos as i32,
                    &t.seqs,
                    t.logits,
                )
                .map_err(|_| EngineError::BatchTooLarge {
                    tokens: batch.len(),
                    n_batch: self.opts.n_batch,
                })?;
            self.logits_mask.push(t.logits);
        }
        match self.ctx.decode(&mut self.batch) {
            Ok(()) => Ok(()),
            Err(DecodeError::NoKvCacheSlot) => {
                self.logits_mask.clear();
                Err(EngineError::KvCacheFull)
            }
            Err(e) => {
                self.logits_mask.clear();
                Err(EngineError::Decode(e))
            }
        }
    }

    /// Logits for batch index `index` of the last [`Context::decode`]; the
    /// token there must have asked for them.
    pub fn logits(&self, index: usize) -> Result<&[f32], EngineError> {
        if !self.logits_mask.get(index).copied().unwrap_or(false) {
            return Err(EngineError::NoLogits { index });
        }
        Ok(self.ctx.get_logits_ith(index as i32))
    }

    /// Decodes `tokens` into `seq` from position `start`, splitting by
    /// `n_batch`, and returns the logits of the last token.
    pub fn prefill(
        &mut self,
        seq: SeqId,
        tokens: &[TokenId],
        start: u32,
    ) -> Result<Vec<f32>, EngineError> {
        if tokens.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        let end = start as usize + tokens.len();
        if end > self.n_ctx() as usize {
            return Err(EngineError::PromptTooLong {
                tokens: end,
                n_ctx: self.n_ctx(),
            });
        }
        let mut batch = Batch::new();
        let chunk = self.opts.n_batch as usize;
        let mut last = 0;
        for (c, part) in tokens.chunks(chunk).enumerate() {
            batch.clear();
            let is_last = (c + 1) * chunk >= tokens.len();
            let first_pos = start + (c * chunk) as u32;
            for (i, &t) in part.iter().enumerate() {
                last = batch.push(t, first_pos + i as u32, seq, is_last && i + 1 == part.len());
            }
            self.decode(&batch)?;
        }
        Ok(self.logits(last)?.to_vec())
    }

    /// Removes the cells of `seq` in positions `[p0, p1)` (`None` = open end).
    pub fn seq_rm(
        &mut self,
        seq: SeqId,
        p0: Option<u32>,
        p1: Option<u32>,
    ) -> Result<(), EngineError> {
        let s = self.check_seq(seq)?;
        self.ctx
            .kv_cache_seq_rm(s, p0, p1)
            .map_err(|_| EngineError::KvOp {
                op: "seq_rm",
                seq: seq.0,
            })
    }

    /// Tags the cells of `src` in `[p0, p1)` as also belonging to `dst` (no copy
    /// with a unified cache: this is how prefixes are shared).
    pub fn seq_cp(
        &mut self,
        src: SeqId,
        dst: SeqId,
        p0: Option<u32>,
        p1: Option<u32>,
    ) -> Result<(), EngineError> {
        let s = self.check_seq(src)?;
        let d = self.check_seq(dst)?;
        self.ctx
            .kv_cache_seq_cp(s, d, p0, p1)
            .map_err(|_| EngineError::KvOp {
                op: "seq_cp",
                seq: src.0,
            })
    }

    /// Shifts the positions of `seq` in `[p0, p1)` by `delta` (RoPE is re-applied).
    pub fn seq_shift(
        &mut self,
        seq: SeqId,
        p0: Option<u32>,
        p1: Option<u32>,
        delta: i32,
    ) -> Result<(), EngineError> {
        let s = self.check_seq(seq)?;
        self.ctx
            .kv_cache_seq_add(s, p0, p1, delta)
            .map_err(|_| EngineError::KvOp {
                op: "seq_shift",
                seq: seq.0,
            })
    }

    /// Positions held by `seq` (one past the largest position), 0 when empty.
    pub fn seq_len(&self, seq: SeqId) -> Result<u32, EngineError> {
        let s = self.check_seq(seq)?;
        Ok((self.ctx.kv_cache_seq_pos_max(s) + 1).max(0) as u32)
    }

    /// The smallest and largest position `seq` has cells for, or `None` when
    /// it has none. (llama.cpp does not say how many cells a sequence holds.)
    pub fn seq_pos_range(&self, seq: SeqId) -> Result<Option<(u32, u32)>, EngineError> {
        let s = self.check_seq(seq)?;
        let (lo, hi) = (
            self.ctx.kv_cache_seq_pos_min(s),
            self.ctx.kv_cache_seq_pos_max(s),
        );
        Ok((lo >= 0 && hi >= lo).then_some((lo as u32, hi as u32)))
    }

    /// Forgets everything in the cache.
    pub fn clear(&mut self) {
        self.ctx.clear_kv_cache();
    }

    /// Copies the KV state of `seq` into host memory.
    pub fn save_seq(&self, seq: SeqId) -> Result<SeqSnapshot, EngineError> {
        let s = self.check_seq(seq)?;
        let n_pos = self.seq_len(seq)?;
        let state = self
            .ctx
            .state_seq_get(s, llama_cpp_2::LlamaStateSeqFlags::empty())
            .map_err(|source| EngineError::State {
                op: "save",
                seq: seq.0,
                source,
            })?;
        Ok(SeqSnapshot { state, n_pos })
    }

    /// Restores a snapshot into `seq` (which should be empty); the snapshot may
    /// come from another sequence id.
    pub fn restore_seq(&mut self, snapshot: &SeqSnapshot, seq: SeqId) -> Result<(), EngineError> {
        let s = self.check_seq(seq)?;
        self.ctx
            .state_seq_set(&snapshot.state, s)
            .map_err(|source| EngineError::State {
                op: "restore",
                seq: seq.0,
                source,
            })
    }
}

#[cfg(test)]
mod tests {
    use super::threads_from_env;

    #[test]
    fn siliceo_threads_takes_positive_numbers_only() {
        assert_eq!(threads_from_env(Some("3")), Some(3));
        assert_eq!(threads_from_env(Some(" 1\n")), Some(1));
        for bad in ["0", "-2", "two", "", "1.5"] {
            assert_eq!(threads_from_env(Some(bad)), None, "{bad:?}");
        }
        assert_eq!(threads_from_env(None), None);
    }
}
