//! A llama.cpp context built through the raw `llama-cpp-sys-2` API:
//! `llama-cpp-2` exposes no evaluation callback, which shadow and grafted
//! attention need. Over the loaded [`Model`] (its pointer; the model is not
//! loaded twice), with a batch of `n_batch` tokens of one sequence id each.

use std::ptr::NonNull;

use llama_cpp_sys_2 as sys;

use crate::{EngineError, Model};

pub(crate) struct RawContext<'m> {
    ctx: NonNull<sys::llama_context>,
    pub(crate) batch: sys::llama_batch,
    n_batch: usize,
    n_vocab: usize,
    _model: &'m Model,
}

impl<'m> RawContext<'m> {
    /// A context with `params` over `model`; `what` names it in the error.
    ///
    /// # Safety
    /// `params.cb_eval_user_data`, when set, must stay valid (at a fixed
    /// address) for as long as the context lives.
    pub(crate) unsafe fn new(
        model: &'m Model,
        params: sys::llama_context_params,
        what: &str,
    ) -> Result<RawContext<'m>, EngineError> {
        // SAFETY: a loaded model and parameters from llama.cpp's defaults.
        let ctx = unsafe { sys::llama_init_from_model(model.raw().as_ptr(), params) };
        let ctx = NonNull::new(ctx).ok_or_else(|| EngineError::InvalidOption {
            field: "kv",
            reason: format!(
                "llama.cpp refused a {what} context of {} cells (see the log)",
                params.n_ctx
            ),
        })?;
        // SAFETY: a batch of n_batch tokens with one sequence id each.
        let batch = unsafe { sys::llama_batch_init(params.n_batch as i32, 0, 1) };
        Ok(RawContext {
            ctx,
            batch,
            n_batch: params.n_batch as usize,
            n_vocab: model.geometry().n_vocab as usize,
            _model: model,
        })
    }

    pub(crate) fn ptr(&self) -> *mut sys::llama_context {
        self.ctx.as_ptr()
    }

    /// Most tokens per decode.
    pub(crate) fn n_batch(&self) -> usize {
        self.n_batch
    }

    /// Runs the batch (filled through `batch`, `n_tokens` set); llama.cpp's
    /// return code.
    pub(crate) fn decode(&mut self) -> i32 {
        // SAFETY: a live context and a batch filled by the caller.
        unsafe { sys::llama_decode(self.ctx.as_ptr(), self.batch) }
    }

    /// Forgets llama.cpp's KV (zeroing its buffers with `data`).
    pub(crate) fn clear_memory(&mut self, data: bool) {
        // SAFETY: a live context.
        unsafe { sys::llama_memory_clear(sys::llama_get_memory(self.ctx.as_ptr()), data) };
    }

    /// The logits of batch index `i` of the last decode; the token there must
    /// have asked for them (llama.cpp aborts on one that did not: callers
    /// check).
    pub(crate) fn logits(&self, i: usize) -> &[f32] {
        // SAFETY: llama.cpp returns n_vocab floats for an output token.
        unsafe {
            std::slice::from_raw_parts(
                sys::llama_get_logits_ith(self.ctx.as_ptr(), i as i32),
                self.n_vocab,
            )
        }
    }
}

impl Drop for RawContext<'_> {
    fn drop(&mut self) {
        // SAFETY: created in `new`, freed once.
        unsafe {
            sys::llama_batch_free(self.batch);
            sys::llama_free(self.ctx.as_ptr());
        }
    }
}

/// Checks that `t`, layer `il`'s `kqv_out`, is a contiguous f32 matrix of
/// `width` × `tokens` (any token count when `None`) in host memory: the
/// attention output our kernel overwrites.
pub(crate) fn check_kqv_out(
    t: &sys::ggml_tensor,
    il: usize,
    width: usize,
    tokens: Option<usize>,
) -> Result<(), String> {
    if t.type_ != sys::GGML_TYPE_F32
        || t.ne[0] as usize != width
        || tokens.is_some_and(|n| t.ne[1] as usize != n)
        || t.ne[2] != 1
        || t.ne[3] != 1
        || t.nb[0] != 4
        || t.nb[1] != width * 4
    {
        return Err(format!(
            "kqv_out-{il}: shape {:?} strides {:?}, expected contiguous f32 [{width}, {}]",
            t.ne,
            t.nb,
            tokens.map_or("tokens".to_string(), |n| n.to_string())
        ));
    }
    if t.buffer.is_null() || t.data.is_null() {
        return Err(format!("kqv_out-{il} is not allocated"));
    }
    Ok(())
}
