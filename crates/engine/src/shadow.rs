//! Shadow attention: llama.cpp's own forward pass with every layer's
//! attention replaced by siliceo's paged KV store and CPU kernel
//! (`siliceo-kernels-turing`), so the quality of *our* KV formats can be
//! measured on real models and real text.
//!
//! How: a raw llama.cpp context (the `llama-cpp-sys-2` API; `llama-cpp-2`
//! exposes no evaluation callback) with flash attention and an f16 KV cache,
//! and an evaluation callback on its graph scheduler. The callback asks for
//! each layer's `Qcur-{il}`, `Kcur-{il}`, `Vcur-{il}` (the last tensor of each
//! name in graph order: after bias and RoPE) and `kqv_out-{il}` (the attention
//! output before the output projection). Q, K and V are copied out as they are
//! computed; when `kqv_out` is computed, K/V are appended to the layer's
//! [`KvStore`] in the chosen format and the kernel's attention overwrites
//! llama.cpp's, so every later op of the forward pass (output projection,
//! FFN, the next layers, the logits) uses ours. llama.cpp still fills its own
//! f16 cache, which nothing reads after the overwrite.
//!
//! Within a micro-batch, tokens are appended and attended to `chunk` tokens at
//! a time: a query sees its own chunk and everything before it, in the form
//! the store keeps it at that moment — the most recent tokens in the F16 tail,
//! older ones sealed in the format. With `chunk = 1` every query sees exactly
//! what it would see when decoded one token at a time (the current partial
//! block is always F16: a block is sealed only when full); with `chunk` = the
//! block size it sees what a chunked prefill sees (its own block already
//! sealed, as in llama.cpp's quantized caches, which quantize on write).
//!
//! Checked per decode: every layer's store holds exactly the tokens decoded
//! (a model whose graph names these tensors differently, or skips one, is
//! refused), the attention op is flash attention without ALiBi or soft-capping
//! (its scale is read from the op), and the tensors are f32 in host memory.

use std::ffi::{CStr, c_void};

use llama_cpp_sys_2 as sys;
use siliceo_core::TokenId;
use siliceo_kernels_turing::{AttnParams, Codec, KvLayout, KvStore, LayerAttn, SeqKv, SeqQuery};

use crate::KvFormat;

use crate::raw::RawContext;
use crate::{EngineError, Model};

/// What a shadow context does to llama.cpp's attention.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum ShadowMode {
    /// Replace it with our kernel over a store in this format.
    Replace(KvFormat),
    /// Keep it, times (1 ± `rel`) in alternating elements: what a harmless
    /// change of the computation costs downstream (the noise floor). `exact`:
    /// on f32 K/V without flash attention, else f16 K/V with it.
    Jitter {
        /// Relative size of the change.
        rel: f32,
        /// The exact reference's configuration.
        exact: bool,
    },
}

/// Which captured tensor a graph node is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Node {
    Q,
    K,
    V,
    Out,
}

fn parse_name(name: &[u8]) -> Option<(Node, usize)> {
    let dash = name.iter().rposition(|&b| b == b'-')?;
    let (base, il) = (&name[..dash], &name[dash + 1..]);
    let node = match base {
        b"Qcur" => Node::Q,
        b"Kcur" => Node::K,
        b"Vcur" => Node::V,
        b"kqv_out" => Node::Out,
        _ => return None,
    };
    let il = std::str::from_utf8(il).ok()?.parse().ok()?;
    Some((node, il))
}

/// One layer's shadow KV and the micro-batch's captured Q/K/V.
struct Layer {
    store: KvStore,
    seq: SeqKv,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    out: Vec<f32>,
    /// Tokens whose attention output this layer has handled.
    tokens: usize,
    /// The layer's sliding window (0 = the whole context).
    window: usize,
}

/// What the callback works on (boxed: llama.cpp holds a pointer to it).
struct State {
    layers: Vec<Layer>,
    n_head: usize,
    kv_heads: usize,
    head_dim: usize,
    params: AttnParams,
    /// Query tokens per attention call; chunks end on multiples of it.
    chunk: usize,
    /// `Some(rel)`: jitter llama.cpp's attention output instead of replacing it.
    jitter: Option<f32>,
    error: Option<String>,
    /// Relative L2 difference between llama.cpp's attention output and ours,
    /// per (layer, micro-batch): sum, count, maximum.
    diverge: (f64, usize, f64),
}

impl State {
    /// Copies an f32 `[head_dim, heads, tokens]` tensor (any strides) into `dst`.
    ///
    /// # Safety
    /// `t` must be a computed tensor in host memory.
    unsafe fn gather(
        t: &sys::ggml_tensor,
        heads: usize,
        d: usize,
        dst: &mut Vec<f32>,
    ) -> Result<(), String> {
        if t.type_ != sys::GGML_TYPE_F32 {
            return Err(format!("tensor type {} is not f32", t.type_));
        }
        if t.buffer.is_null() || unsafe { !sys::ggml_backend_buffer_is_host(t.buffer) } {
            return Err("tensor is not in host memory".into());
        }
        let (mut ne, mut nb) = (t.ne, t.nb);
        // Before the reshape, the same name is on the 2-D projection
        // `[heads·d, tokens]`; read it as `[d, heads, tokens]`.
        if ne[0] as usize == heads * d && ne[2] == 1 && ne[3] == 1 {
            ne = [d as i64, heads as i64, ne[1], 1];
            nb = [nb[0], d * nb[0], nb[1], nb[3]];
        }
        if ne[0] as usize != d || ne[1] as usize != heads || ne[3] != 1 {
            return Err(format!("shape {ne:?}, expected [{d}, {heads}, tokens, 1]"));
        }
        let n = ne[2] as usize;
        dst.clear();
        dst.reserve(n * heads * d);
        let base = t.data as *const u8;
        for tok in 0..n {
            for h in 0..heads {
                let row = tok * nb[2] + h * nb[1];
                if nb[0] == 4 {
                    // SAFETY: in bounds of the tensor by its shape and strides.
                    let s = unsafe { std::slice::from_raw_parts(base.add(row) as *const f32, d) };
                    dst.extend_from_slice(s);
                } else {
                    for i in 0..d {
                        // SAFETY: as above, element by element.
                        dst.push(unsafe {
                            (base.add(row + i * nb[0]) as *const f32).read_unaligned()
                        });
                    }
                }
            }
        }
        Ok(())
    }

    /// Handles one computed tensor.
    ///
    /// # Safety
    /// `t` is the tensor llama.cpp passes to the callback (computed, host).
    unsafe fn on_tensor(
        &mut self,
        t: &mut sys::ggml_tensor,
        node: Node,
        il: usize,
    ) -> Result<(), String> {
        let (nh, kvh, d) = (self.n_head, self.kv_heads, self.head_dim);
        let layer = self
            .layers
            .get_mut(il)
            .ok_or_else(|| format!("layer {il} beyond the model's layers"))?;
        match node {
            // Later tensors of the same name (after bias, after RoPE) overwrite
            // earlier ones: the last is what attention uses.
            Node::Q => unsafe { Self::gather(t, nh, d, &mut layer.q) },
            Node::K => unsafe { Self::gather(t, kvh, d, &mut layer.k) },
            Node::V => unsafe { Self::gather(t, kvh, d, &mut layer.v) },
            Node::Out if self.jitter.is_some() => {
                let rel = self.jitter.unwrap_or_default();
                let n = t.ne[1] as usize;
                if t.type_ != sys::GGML_TYPE_F32 || !unsafe { sys::ggml_is_contiguous(t) } {
                    return Err(format!("kqv_out-{il} is not contiguous f32"));
                }
                // SAFETY: a contiguous f32 tensor of ne[0]·ne[1] values in host memory.
                let dst = unsafe {
                    std::slice::from_raw_parts_mut(t.data as *mut f32, t.ne[0] as usize * n)
                };
                for (j, x) in dst.iter_mut().enumerate() {
                    *x *= if j % 2 == 0 { 1.0 + rel } else { 1.0 - rel };
                }
                layer.tokens += n;
                Ok(())
            }
            Node::Out => {
                let n = t.ne[1] as usize;
                crate::raw::check_kqv_out(t, il, nh * d, None)?;
                // SAFETY: a non-null buffer (checked).
                if unsafe { !sys::ggml_backend_buffer_is_host(t.buffer) } {
                    return Err(format!(
                        "kqv_out-{il} is not in host memory (shadow attention runs on the CPU)"
                    ));
                }
                // kqv_out is a reshape of the flash-attention op: read its scale.
                let src = t.src[0];
                // SAFETY: a node's sources live as long as the graph.
                let fa = (!src.is_null()).then(|| unsafe { &*src });
                let Some(fa) = fa.filter(|f| f.op == sys::GGML_OP_FLASH_ATTN_EXT) else {
                    return Err(format!(
                        "kqv_out-{il} is not flash attention's output (shadow attention needs flash attention on)"
                    ));
                };
                let p = |i: usize| f32::from_bits(fa.op_params[i] as u32);
                let (scale, max_bias, softcap) = (p(0), p(1), p(2));
                if max_bias != 0.0 || softcap != 0.0 {
                    return Err(format!(
                        "layer {il}: ALiBi ({max_bias}) or logit soft-capping ({softcap}) is not supported"
                    ));
                }
                if layer.q.len() != n * nh * d
                    || layer.k.len() != n * kvh * d
                    || layer.v.len() != n * kvh * d
                {
                    return Err(format!(
                        "layer {il}: captured Q/K/V ({}, {}, {} values) do not match {n} tokens",
                        layer.q.len(),
                        layer.k.len(),
                        layer.v.len()
                    ));
                }
                layer.out.resize(n * nh * d, 0.0);
                let chunk = self.chunk;
                let (qrow, kvrow) = (nh * d, kvh * d);
                let mut i = 0;
                while i < n {
                    // Chunks end on multiples of `chunk` in the sequence.
                    let pos = layer.seq.len;
                    let end = (i + chunk - pos % chunk).min(n);
                    layer
                        .store
                        .append(
                            &mut layer.seq,
                            &layer.k[i * kvrow..end * kvrow],
                            &layer.v[i * kvrow..end * kvrow],
                        )
                        .map_err(|e| format!("layer {il}: {e}"))?;
                    siliceo_kernels_turing::paged_attention_layer(
                        &layer.store,
                        nh,
                        &LayerAttn {
                            scale,
                            window: layer.window,
                            sinks: None,
                        },
                        &[SeqQuery {
                            kv: &layer.seq,
                            q: &layer.q[i * qrow..end * qrow],
                            n_q: end - i,
                        }],
                        &mut layer.out[i * qrow..end * qrow],
                        &self.params,
                    )
                    .map_err(|e| format!("layer {il}: {e}"))?;
                    i = end;
                }
                // SAFETY: checked contiguous f32 of n × nh·d values in host memory.
                let dst = unsafe { std::slice::from_raw_parts_mut(t.data as *mut f32, n * qrow) };
                let (mut e, mut x) = (0f64, 0f64);
                for (a, b) in dst.iter().zip(&layer.out) {
                    e += f64::from(a - b).powi(2);
                    x += f64::from(*a).powi(2);
                }
                let rel = if x > 0.0 { (e / x).sqrt() } else { 0.0 };
                self.diverge.0 += rel;
                self.diverge.1 += 1;
                self.diverge.2 = self.diverge.2.max(rel);
                dst.copy_from_slice(&layer.out);
                layer.tokens += n;
                layer.q.clear();
                layer.k.clear();
                layer.v.clear();
                Ok(())
            }
        }
    }
}

unsafe extern "C" fn eval_callback(t: *mut sys::ggml_tensor, ask: bool, ud: *mut c_void) -> bool {
    // SAFETY: llama.cpp passes a live tensor and our user data.
    let t = unsafe { &mut *t };
    // SAFETY: ggml names are NUL-terminated within the array.
    let name = unsafe { CStr::from_ptr(t.name.as_ptr()) }.to_bytes();
    let Some((node, il)) = parse_name(name) else {
        return !ask;
    };
    // SAFETY: the State outlives the context (ShadowContext owns both).
    let state = unsafe { &mut *(ud as *mut State) };
    if ask {
        return node == Node::Out || state.jitter.is_none();
    }
    if state.error.is_some() {
        return true;
    }
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| unsafe {
        state.on_tensor(t, node, il)
    }));
    match r {
        Ok(Ok(())) => {}
        Ok(Err(e)) => state.error = Some(e),
        Err(_) => state.error = Some(format!("panic in shadow attention (layer {il})")),
    }
    // Keep going either way (a `false` only skips the rest of a split); the
    // error is reported after the decode.
    true
}

/// A llama.cpp context whose attention is computed by siliceo's kernel over a
/// store in one [`KvFormat`].
pub(crate) struct ShadowContext<'m> {
    // Dropped before the State its callback uses.
    raw: RawContext<'m>,
    state: Box<State>,
}

impl<'m> ShadowContext<'m> {
    /// A context of `n_ctx` tokens (one sequence) over `model`, with the
    /// format's store sized for `n_ctx`.
    pub(crate) fn new(
        model: &'m Model,
        mode: &ShadowMode,
        n_ctx: u32,
        n_batch: u32,
        chunk: usize,
        n_threads: Option<u32>,
    ) -> Result<ShadowContext<'m>, EngineError> {
        let g = model.geometry();
        if g.head_dim_k != g.head_dim_v {
            return Err(EngineError::InvalidOption {
                field: "configs",
                reason: format!(
                    "shadow attention needs equal K and V head sizes ({} vs {})",
                    g.head_dim_k, g.head_dim_v
                ),
            });
        }
        let (kv_heads, d) = (g.n_head_kv as usize, g.head_dim_k as usize);
        let (layout, sealed, tail, jitter, exact) = match mode {
            ShadowMode::Replace(format) => {
                let layout = format.layout(kv_heads, d)?;
                let sealed = (n_ctx as usize).div_ceil(layout.block_tokens) + 1;
                let tail = KvStore::tail_blocks_per_seq(&layout) + 1;
                (layout, sealed, tail, None, false)
            }
            // No store: llama.cpp's own attention stays.
            ShadowMode::Jitter { rel, exact } => (
                KvLayout::new(kv_heads, d, Codec::F16, Codec::F16),
                0,
                0,
                Some(*rel),
                *exact,
            ),
        };
        let threads = n_threads
            .map(|n| n as usize)
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
        let windows = model
            .attention_windows()
            .ok_or_else(|| EngineError::InvalidOption {
                field: "configs",
                reason: format!(
                    "{}'s sliding windows are not known to this build",
                    model.name()
                ),
            })?;
        let layers = (0..g.n_layer as usize)
            .map(|il| {
                Ok(Layer {
                    window: windows[il],
                    store: KvStore::new(layout, sealed, tail).map_err(|e| {
                        EngineError::InvalidOption {
                            field: "configs",
                            reason: e.to_string(),
                        }
                    })?,
                    seq: SeqKv::default(),
                    q: Vec::new(),
                    k: Vec::new(),
                    v: Vec::new(),
                    out: Vec::new(),
                    tokens: 0,
                })
            })
            .collect::<Result<Vec<_>, EngineError>>()?;
        let mut state = Box::new(State {
            layers,
            n_head: g.n_head as usize,
            kv_heads,
            head_dim: d,
            params: AttnParams {
                threads,
                ..AttnParams::default()
            },
            chunk: if chunk == 0 {
                layout.block_tokens
            } else {
                chunk
            },
            jitter,
            error: None,
            diverge: (0.0, 0, 0.0),
        });
        // SAFETY: plain C calls; the callback's user data is the boxed State,
        // which lives (at a fixed address) as long as the context.
        let raw = unsafe {
            let mut p = sys::llama_context_default_params();
            p.n_ctx = n_ctx;
            p.n_batch = n_batch;
            p.n_ubatch = n_batch;
            p.n_seq_max = 1;
            let th = threads as i32;
            p.n_threads = th;
            p.n_threads_batch = th;
            if exact {
                p.flash_attn_type = sys::LLAMA_FLASH_ATTN_TYPE_DISABLED;
                p.type_k = sys::GGML_TYPE_F32;
                p.type_v = sys::GGML_TYPE_F32;
            } else {
                p.flash_attn_type = sys::LLAMA_FLASH_ATTN_TYPE_ENABLED;
                p.type_k = sys::GGML_TYPE_F16;
                p.type_v = sys::GGML_TYPE_F16;
            }
            p.cb_eval = Some(eval_callback);
            p.cb_eval_user_data = &mut *state as *mut State as *mut c_void;
            RawContext::new(model, p, "shadow")?
        };
        Ok(ShadowContext { raw, state })
    }

    /// Empties llama.cpp's cache and every layer's store.
    pub(crate) fn clear(&mut self) {
        self.raw.clear_memory(true);
        for l in &mut self.state.layers {
            l.store.release(&mut l.seq);
            l.tokens = 0;
        }
        self.state.error = None;
    }

    /// Most tokens per [`ShadowContext::decode`].
    pub(crate) fn n_batch(&self) -> usize {
        self.raw.n_batch()
    }

    /// Decodes `tokens` at positions `pos0..` of sequence 0; `want(i)` says
    /// whether token `i` needs logits.
    pub(crate) fn decode(
        &mut self,
        tokens: &[TokenId],
        pos0: usize,
        want: impl Fn(usize) -> bool,
    ) -> Result<(), EngineError> {
        if tokens.len() > self.raw.n_batch() {
            return Err(EngineError::BatchTooLarge {
                tokens: tokens.len(),
                n_batch: self.raw.n_batch() as u32,
            });
        }
        let b = &mut self.raw.batch;
        // SAFETY: the arrays hold n_batch entries (llama_batch_init).
        unsafe {
            for (i, t) in tokens.iter().enumerate() {
                *b.token.add(i) = t.0 as i32;
                *b.pos.add(i) = (pos0 + i) as i32;
                *b.n_seq_id.add(i) = 1;
                *(*b.seq_id.add(i)).add(0) = 0;
                *b.logits.add(i) = i8::from(want(i));
            }
        }
        b.n_tokens = tokens.len() as i32;
        let rc = self.raw.decode();
        if let Some(e) = self.state.error.take() {
            return Err(EngineError::Shadow(e));
        }
        if rc != 0 {
            return Err(EngineError::Shadow(format!("llama_decode returned {rc}")));
        }
        let want_len = pos0 + tokens.len();
        for (il, l) in self.state.layers.iter().enumerate() {
            if l.tokens != want_len {
                return Err(EngineError::Shadow(format!(
                    "layer {il} handled {} tokens, not {want_len}: this model's graph does not \
                     name Qcur/Kcur/Vcur/kqv_out for every layer as shadow attention expects",
                    l.tokens
                )));
            }
        }
        Ok(())
    }

    /// Mean and maximum, over layers and micro-batches so far, of the relative
    /// L2 difference between llama.cpp's attention output (f16 K/V, flash
    /// attention) and ours; `None` when nothing was replaced.
    pub(crate) fn divergence(&self) -> Option<(f64, f64)> {
        let (sum, n, max) = self.state.diverge;
        (n > 0).then(|| (sum / n as f64, max))
    }

    /// The logits of batch token `i` of the last decode (it must have asked for them).
    pub(crate) fn logits(&self, i: usize) -> &[f32] {
        self.raw.logits(i)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_formats_parse() {
        assert_eq!(parse_name(b"Qcur-0"), Some((Node::Q, 0)));
        assert_eq!(parse_name(b"kqv_out-27"), Some((Node::Out, 27)));
        assert_eq!(parse_name(b"Qcur_clamped-3"), None);
        assert_eq!(parse_name(b"attn_norm-3"), None);
        assert_eq!(parse_name(b"Kcur"), None);
    }
}
