//! Grafted attention: llama.cpp computes everything but attention; siliceo's
//! paged store (one [`KvPages`] per layer, in a [`KvFormat`]) and CPU kernel
//! own the KV.
//!
//! How: a raw llama.cpp context with flash attention, an f16 KV cache of one
//! step's size and an evaluation callback that asks only for each layer's
//! `kqv_out-{il}` (a view of the `FLASH_ATTN_EXT` output). When that node is
//! computed, its op's inputs are still intact: Q, and K/V in the f16 cache at
//! the batch's cells (cells `0..n` in batch order: the cache is cleared after
//! every decode, so a batch always starts at cell 0). The callback writes each
//! token's K/V into the rows [`GraftStep::writes`] names, copies and seals
//! blocks as the step says, runs the paged-attention kernel for every query
//! run of [`GraftStep::queries`] over the blocks it names (within the
//! layer's sliding window, where it has one: [`Model::attention_windows`]),
//! and overwrites
//! `kqv_out`: every later op (output projection, FFN, later layers, logits)
//! runs on our attention. After the decode llama.cpp's memory is cleared, so
//! its attention only ever spans one step's tokens and its own KV holds at
//! most one step; a sequence with no cells may continue at any position, so
//! positions are passed as they are, far beyond this context's `n_ctx`.
//!
//! The block ids of a [`GraftStep`] are the store's: tail (F16) blocks and
//! sealed blocks, each indexing its pool in every layer. Who decides them —
//! one allocator for all layers — is the caller (the runtime, through
//! kv-paging). A failed decode leaves the rows it wrote in blocks the caller
//! frees; shared blocks are never written.

use std::ffi::{CStr, c_void};
use std::ops::Range;

use llama_cpp_sys_2 as sys;
use siliceo_kernels_turing::{
    AttnParams, KvLayout, KvPages, LayerAttn, SeqKv, SeqQuery, SharedTail,
};

use crate::graft_device::DeviceLayers;
use crate::raw::RawContext;
use crate::{Batch, EngineError, KvFormat, Model};

/// Copy token rows `rows` of tail block `src` into the same rows of tail
/// block `dst` (copy-on-write of a shared partial block; a token tree's
/// branch taking its partial block's rows, or giving back its kept rows).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowCopy {
    /// Tail block to copy from.
    pub src: u32,
    /// Tail block to copy to.
    pub dst: u32,
    /// Token rows to copy.
    pub rows: Range<usize>,
}

/// One query run: consecutive batch tokens of one sequence (the last
/// `tokens.len()` tokens of `kv`, causal), and the blocks they see.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GraftQuery {
    /// Batch indices (contiguous).
    pub tokens: Range<usize>,
    /// The sequence's blocks as these queries see them (sealed, then tail)
    /// and its length after the last of them.
    pub kv: SeqKv,
}

/// What one decode does to the store, beside llama.cpp's batch. Per layer,
/// in this order: `writes`, `copies` (in their order: a copy may read rows
/// this step wrote, or an earlier copy did), `seals`, then attention for
/// `queries`.
/// A query run sees rows that later runs of the same step write only where
/// its own `kv` reaches them, so one attention call serves every run.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GraftStep {
    /// Where each batch token's K and V go: (tail block, row), in batch order.
    pub writes: Vec<(u32, u16)>,
    /// Copies of tail rows, after the writes.
    pub copies: Vec<RowCopy>,
    /// Tail blocks quantized into sealed blocks: (tail, sealed), after the writes.
    pub seals: Vec<(u32, u32)>,
    /// Every batch token's attention, exactly once.
    pub queries: Vec<GraftQuery>,
    /// The windowed layers' part, where they keep pools of their own
    /// ([`GraftOptions::windowed_blocks`]): their writes, copies, seals and
    /// query runs, over their blocks. A run's view may name
    /// [`GraftStep::RELEASED`] for a block wholly before its first query's
    /// window (which no query reads).
    pub windowed: Option<Box<GraftStep>>,
}

impl GraftStep {
    /// A block a windowed view names but no query reads (released by the
    /// window).
    pub const RELEASED: u32 = u32::MAX;

    /// Empties the step, keeping its allocations.
    pub fn clear(&mut self) {
        self.copies.clear();
        self.writes.clear();
        self.seals.clear();
        self.queries.clear();
        if let Some(w) = self.windowed.as_mut() {
            w.clear();
        }
    }
}

/// How to build a [`GraftedContext`].
#[derive(Debug, Clone)]
pub struct GraftOptions {
    /// The KV format of the store.
    pub format: KvFormat,
    /// Tokens per block (even; 64 in serving).
    pub block_tokens: usize,
    /// Sealed blocks per layer.
    pub sealed_blocks: usize,
    /// Tail (F16) blocks per layer.
    pub tail_blocks: usize,
    /// Scratch tail blocks, one set for all layers (tail ids `tail_blocks..`):
    /// rows a step writes and seals within one layer's attention (a block
    /// filled and sealed within the step). Only writes, seals and queries
    /// may name them.
    pub scratch_blocks: usize,
    /// Most tokens per decode.
    pub n_batch: u32,
    /// Most sequences per decode (at most [`MAX_SEQS_PER_STEP`] and
    /// `n_batch`).
    pub max_seqs: u32,
    /// llama.cpp's threads (`None` = all cores).
    pub threads: Option<u32>,
    /// The attention kernel's threads, the calling thread included (`None` =
    /// llama.cpp's count).
    pub kernel_threads: Option<usize>,
    /// Read Q, K, V and write the attention output through ggml's tensor
    /// copies (`ggml_backend_tensor_get`/`_set`) even where they are in host
    /// memory: what an offloaded layer's device tensors always take, so a
    /// CPU can check that path. Slower; `false` in serving.
    pub copy_tensors: bool,
    /// Where the attention (and store) of llama.cpp's offloaded layers live.
    pub device: DeviceAttention,
    /// Keep a copy of this layer's attention output after every decode
    /// ([`GraftedContext::tapped`]): for tests and quality checks.
    pub tap_layer: Option<usize>,
    /// Let llama.cpp compute its own attention in the layers on the host
    /// too, before ours overwrites it (for comparisons). `false` in serving:
    /// the flash-attention node is switched off while the graph runs (its
    /// inputs are still computed; see [`GraftedContext::llama_attention_off`]).
    pub llama_attention: bool,
    /// Compute the host layers' Q4_1 weight products with siliceo's kernel
    /// (llama.cpp's exact bits, each weight block unpacked once for up to 8
    /// tokens; see `q4_1.rs`) where the CPU has AVX-512 VNNI (any product)
    /// or AVX2 (products of two or more tokens) and the kernel passed its
    /// start-up check against llama.cpp's own. `true` in serving;
    /// `SILICEO_LLAMA_MATMUL=1` turns it off for the whole process.
    pub q4_1_kernel: bool,
    /// Each layer's sliding window, instead of [`Model::attention_windows`]
    /// (`None` in serving). For tests: a table llama.cpp's graph disagrees
    /// with must fail the decode.
    pub windows: Option<Vec<usize>>,
    /// Sealed and tail blocks of each windowed layer's store, where the
    /// layers with a sliding window keep pools of their own (smaller: a
    /// sequence holds only a window's worth there), addressed by
    /// [`GraftStep::windowed`]; `None`: every layer's store is sized alike
    /// and one step addresses them all. The windowed layers must share one
    /// window and stay on the host.
    pub windowed_blocks: Option<(usize, usize)>,
}

/// Where grafted attention runs for the layers llama.cpp offloads to a GPU.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum DeviceAttention {
    /// Every layer's store and attention on the host; an offloaded layer's
    /// Q, K, V and output cross through host memory each step.
    #[default]
    Host,
    /// The layers llama.cpp offloads keep their store in the GPU's memory
    /// and run siliceo's CUDA kernels on llama.cpp's device tensors (feature
    /// `cuda-kernels`, and kernels built by `cargo xtask kernels`).
    Cuda,
    /// The CUDA kernels in the CPU emulator (feature `cuda-emu`) for the
    /// layers named, reading llama.cpp's host tensors as device memory: the
    /// device path tested without a GPU. Slow.
    Emulated(Vec<usize>),
}

impl DeviceAttention {
    /// What serving uses for `model`: the GPU's own store and kernels for
    /// its offloaded layers where this build has them, else the host.
    /// `SILICEO_DEVICE_ATTENTION=host` keeps every layer's attention on the
    /// host (a fallback, and the baseline the device path is measured
    /// against). Offloaded layers whose shape the kernels lack (heads
    /// other than 64, 128, 256 or 512, or more query heads per KV head
    /// than [`siliceo_kernels_turing::shapes::max_group`]) stay on the host
    /// too, with a warning (`graft_device::device_owners`).
    pub fn for_model(model: &Model) -> DeviceAttention {
        let host = std::env::var("SILICEO_DEVICE_ATTENTION").is_ok_and(|v| v == "host");
        if cfg!(feature = "cuda-kernels") && !host && !model.offloaded_layers().is_empty() {
            return DeviceAttention::Cuda;
        }
        DeviceAttention::Host
    }
}

/// The layers keeping KV whose store a build with the CUDA kernels keeps in
/// device memory when llama.cpp offloads the layers `offloaded`: each whose
/// shape (in `format`, blocks of `block_tokens`) the kernels take (the
/// others stay on the host), and a layer keeping no KV follows its
/// source. What `siliceo plan` and the start-up checks count.
pub fn device_store_layers(
    layers: &[siliceo_core::LayerKv],
    format: &KvFormat,
    block_tokens: usize,
    n_heads: usize,
    offloaded: std::ops::Range<usize>,
) -> Result<Vec<usize>, EngineError> {
    let (layouts, layout_of) = format.layer_layouts(layers, block_tokens)?;
    let sources: Vec<usize> = layers.iter().map(|l| l.source).collect();
    let shapes = crate::graft_device::Shapes {
        layouts: &layouts,
        layout_of: &layout_of,
        sources: &sources,
    };
    let offloaded: Vec<usize> = offloaded.collect();
    Ok(crate::graft_device::device_owners(
        &DeviceAttention::Cuda,
        &offloaded,
        shapes,
        n_heads,
    ))
}

/// Saved rows of some blocks of every layer (swap-out), in the order asked.
#[derive(Debug, Clone)]
pub struct SavedBlocks {
    /// Which pool each block came from (`true` = sealed).
    kinds: Vec<bool>,
    bytes: Vec<u8>,
}

impl SavedBlocks {
    /// Bytes held in host memory.
    pub fn byte_len(&self) -> usize {
        self.bytes.len()
    }
}

/// A block of the store: which pool, which index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreBlock {
    /// A sealed block.
    Sealed(u32),
    /// A tail (F16) block.
    Tail(u32),
}

/// Where a layer's KV lives.
enum LayerStore {
    /// In host memory, read and written by the CPU kernel.
    Host(KvPages),
    /// In device memory ([`State::device`]).
    Device,
    /// Nowhere: the layer keeps no KV and attends over another layer's
    /// ([`State::sources`]).
    Borrowed,
}

impl LayerStore {
    fn host(&self) -> Option<&KvPages> {
        match self {
            LayerStore::Host(p) => Some(p),
            _ => None,
        }
    }

    fn host_mut(&mut self) -> Option<&mut KvPages> {
        match self {
            LayerStore::Host(p) => Some(p),
            _ => None,
        }
    }
}

/// What the callback works on (boxed: llama.cpp holds a pointer to it).
struct State {
    /// Each layer's store.
    layers: Vec<LayerStore>,
    /// The layers whose store lives on the device.
    device: Option<Box<dyn DeviceLayers>>,
    /// The scratch blocks, lent to the layer being computed: one set per
    /// layout (a model whose layers' heads differ in size has two).
    scratch: Vec<SharedTail>,
    /// Each layer's scratch set (an index into `scratch`).
    scratch_of: Vec<usize>,
    /// The layer whose store each layer attends over: itself, or for a
    /// layer that keeps no KV of its own (Gemma 4's last layers) the one it
    /// reads ([`Model::layer_kv`]).
    sources: Vec<usize>,
    /// Read and write attention tensors through ggml's copies even in host
    /// memory ([`GraftOptions::copy_tensors`]).
    copy_tensors: bool,
    /// Bytes of an input read from device memory.
    staging: Vec<u8>,
    /// Each layer's query heads, KV heads and head size.
    geom: Vec<(usize, usize, usize)>,
    /// Each layer's group: 0, or 1 for a windowed layer keeping pools of
    /// its own ([`GraftOptions::windowed_blocks`]), by the layer whose KV
    /// it reads.
    group: Vec<usize>,
    /// Tail blocks of a layer's own per group (the scratch's ids follow
    /// them).
    own_tail: [usize; 2],
    /// Whether the decode in flight writes rows to the scratch, per group
    /// (set once per decode; the layers reading another's KV need K/V only
    /// then).
    step_writes_scratch: [bool; 2],
    params: AttnParams,
    step: GraftStep,
    /// Batch tokens of the decode in flight.
    n_tokens: usize,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    out: Vec<f32>,
    /// Layers handled in the decode in flight.
    layers_done: usize,
    error: Option<String>,
    /// The tapped layer and its last attention output.
    tap: Option<usize>,
    tapped: Vec<f32>,
    /// Whether llama.cpp's own attention runs ([`GraftOptions::llama_attention`]).
    llama_attention: bool,
    /// Addresses of the flash-attention nodes switched off in the last (or
    /// in-flight) decode; switched back on after it, cleared before the next.
    switched_off: Vec<usize>,
    /// Host Q4_1 weight products on siliceo's kernel (llama.cpp's bits,
    /// fewer unpacks: see `q4_1.rs`); `None` where the CPU lacks it.
    q4_1: Option<Box<crate::q4_1::Shared>>,
    /// Each layer's sliding window (0 = the whole context).
    windows: Vec<usize>,
    /// The layer being computed has attention sinks: `sinks`, one logit per
    /// query head.
    has_sinks: bool,
    sinks: Vec<f32>,
    /// The mask llama.cpp gave the global layers and the windowed ones in
    /// the decode in flight, on a device and on the host
    /// ([`State::check_mask`]).
    masks: [[Option<usize>; 2]; 2],
}

/// One layer's mask against those seen so far in a decode (`seen[0]` the
/// global layers', `seen[1]` the windowed ones'): each kind must have one
/// mask, unlike the other kind's. Records the layer's.
fn match_mask(
    seen: &mut [Option<usize>; 2],
    windowed: bool,
    mask: usize,
) -> Result<(), &'static str> {
    let (own, other) = (usize::from(windowed), usize::from(!windowed));
    if seen[other] == Some(mask) {
        return Err("shares its mask with the layers of the other kind");
    }
    if seen[own].is_some_and(|m| m != mask) {
        return Err("has a mask unlike the other layers of its kind");
    }
    seen[own] = Some(mask);
    Ok(())
}

/// Copies tokens `0..n` of a `[d, tokens, heads, 1]` view (any strides; f32 or
/// f16) into `dst` as `[token][head][d]` f32. A tensor outside host memory
/// (an offloaded layer's), or any tensor when `copy` is set, is read through
/// ggml's tensor copy into `staging` first.
///
/// # Safety
/// `t` must be a computed tensor holding at least `n` tokens.
unsafe fn gather(
    t: &sys::ggml_tensor,
    n: usize,
    heads: usize,
    d: usize,
    dst: &mut Vec<f32>,
    staging: &mut Vec<u8>,
    copy: bool,
) -> Result<(), String> {
    if t.buffer.is_null() || t.data.is_null() {
        return Err("an attention input is not allocated".into());
    }
    if t.ne[0] as usize != d || t.ne[2] as usize != heads || (t.ne[1] as usize) < n || t.ne[3] != 1
    {
        return Err(format!(
            "an attention input has shape {:?}, expected [{d}, ≥{n}, {heads}, 1]",
            t.ne
        ));
    }
    let f16 = match t.type_ {
        sys::GGML_TYPE_F32 => false,
        sys::GGML_TYPE_F16 => true,
        other => {
            return Err(format!(
                "an attention input has type {other}, not f32 or f16"
            ));
        }
    };
    let nb = t.nb;
    dst.clear();
    if n == 0 {
        return Ok(());
    }
    dst.reserve(n * heads * d);
    // SAFETY: a non-null buffer of a live tensor.
    let host = unsafe { sys::ggml_backend_buffer_is_host(t.buffer) } && !copy;
    let base = if host {
        t.data as *const u8
    } else {
        // The bytes the first n tokens span, read in one copy.
        let span =
            (d - 1) * nb[0] + (n - 1) * nb[1] + (heads - 1) * nb[2] + if f16 { 2 } else { 4 };
        // SAFETY: a live tensor.
        let total = unsafe { sys::ggml_nbytes(t) };
        if span > total {
            return Err(format!(
                "an attention input spans {span} bytes for {n} tokens, beyond its {total}"
            ));
        }
        staging.resize(span, 0);
        // SAFETY: `span` bytes from offset 0 lie within the tensor (checked:
        // ggml aborts otherwise) and `staging` holds them.
        unsafe { sys::ggml_backend_tensor_get(t, staging.as_mut_ptr().cast(), 0, span) };
        staging.as_ptr()
    };
    for tok in 0..n {
        for h in 0..heads {
            let row = tok * nb[1] + h * nb[2];
            for i in 0..d {
                // SAFETY: in bounds of the tensor (or its copy) by its shape
                // and strides.
                let x = unsafe {
                    let p = base.add(row + i * nb[0]);
                    if f16 {
                        half::f16::from_bits((p as *const u16).read_unaligned()).to_f32()
                    } else {
                        (p as *const f32).read_unaligned()
                    }
                };
                dst.push(x);
            }
        }
    }
    Ok(())
}

/// Reads an attention op's sinks (`src[4]`: f32, one per query head, in
/// host or device memory) into `dst`.
///
/// # Safety
/// `t` must be a live, computed tensor.
unsafe fn read_sinks(t: &sys::ggml_tensor, heads: usize, dst: &mut Vec<f32>) -> Result<(), String> {
    if t.type_ != sys::GGML_TYPE_F32
        || t.ne[0] as usize != heads
        || t.ne[1..].iter().any(|&n| n != 1)
        || t.nb[0] != 4
        || t.buffer.is_null()
    {
        return Err(format!(
            "attention sinks of type {} and shape {:?}, expected f32 [{heads}]",
            t.type_, t.ne
        ));
    }
    dst.resize(heads, 0.0);
    // SAFETY: `heads` contiguous f32 (checked), wherever the tensor lives.
    unsafe { sys::ggml_backend_tensor_get(t, dst.as_mut_ptr().cast(), 0, heads * 4) };
    Ok(())
}

impl State {
    /// Handles `kqv_out-{il}`.
    ///
    /// # Safety
    /// `t` is the tensor llama.cpp passes to the callback (computed).
    unsafe fn on_layer(&mut self, t: &mut sys::ggml_tensor, il: usize) -> Result<(), String> {
        if il >= self.layers.len() {
            return Err(format!("layer {il} beyond the model's layers"));
        }
        let ((nh, kvh, d), n) = (self.geom[il], self.n_tokens);
        let source = self.sources[il];
        crate::raw::check_kqv_out(t, il, nh * d, Some(n))?;
        // SAFETY: a node's sources live as long as the graph.
        let fa = unsafe { t.src[0].as_ref() };
        // Switched off when this very node was asked about, just before.
        let ours = |f: &sys::ggml_tensor| {
            self.switched_off.last() == Some(&(f as *const sys::ggml_tensor as usize))
        };
        let Some(fa) = fa.filter(|f| f.op == sys::GGML_OP_FLASH_ATTN_EXT || ours(f)) else {
            return Err(format!("kqv_out-{il} is not flash attention's output"));
        };
        let p = |i: usize| f32::from_bits(fa.op_params[i] as u32);
        let (scale, max_bias, softcap) = (p(0), p(1), p(2));
        if max_bias != 0.0 || softcap != 0.0 || fa.op_params[4] != 0 {
            return Err(format!(
                "layer {il}: ALiBi ({max_bias}), logit soft-capping ({softcap}) or top-k \
                 attention ({}) is not supported",
                fa.op_params[4]
            ));
        }
        // SAFETY: a node's sources live as long as the graph.
        let sinks = unsafe { fa.src[4].as_ref() };
        self.check_mask(fa, il)?;
        // SAFETY: Q, K and V of the op, computed before it and not yet freed.
        let (q, k, v) = unsafe { (&*fa.src[0], &*fa.src[1], &*fa.src[2]) };
        // A layer reusing another layer's cache would be stored twice,
        // unless it is the layer the model says it reads.
        // SAFETY: a view's source tensor lives as long as the context.
        if let Some(cache) = unsafe { k.view_src.as_ref() } {
            // SAFETY: ggml names are NUL-terminated within the array.
            let name = unsafe { CStr::from_ptr(cache.name.as_ptr()) }.to_bytes();
            let own = format!("cache_k_l{source}");
            if name.starts_with(b"cache_k_l") && name != own.as_bytes() {
                return Err(format!(
                    "layer {il} attends over another layer's cache ({}), not layer {source}'s",
                    String::from_utf8_lossy(name)
                ));
            }
        }
        if matches!(self.layers[source], LayerStore::Device) {
            let dev = self
                .device
                .as_mut()
                .expect("a layer without a host store is on the device");
            // SAFETY: the op's inputs and output, computed (checked above).
            unsafe {
                dev.layer(
                    il,
                    &self.step, // the device holds no windowed group
                    nh,
                    q,
                    k,
                    v,
                    t,
                    scale,
                    self.windows[il],
                    sinks,
                )?
            };
            self.layers_done += 1;
            self.tap_output(t, il);
            return Ok(());
        }
        self.has_sinks = sinks.is_some();
        if let Some(s) = sinks {
            // SAFETY: a source of the op, computed (a weight) before it.
            unsafe { read_sinks(s, nh, &mut self.sinks) }
                .map_err(|e| format!("layer {il}: {e}"))?;
        }
        let copy = self.copy_tensors;
        // A layer reading another's KV needs that layer's rows of this step
        // only where they went to the scratch (which the layers after it
        // took over): llama.cpp's cache holds them, and they go there again.
        let kv = source == il || self.step_writes_scratch[self.group[il]];
        unsafe {
            gather(q, n, nh, d, &mut self.q, &mut self.staging, copy)?;
            if kv {
                gather(k, n, kvh, d, &mut self.k, &mut self.staging, copy)?;
                gather(v, n, kvh, d, &mut self.v, &mut self.staging, copy)?;
            }
        }
        // The scratch is this layer's while it is computed.
        let sc = self.scratch_of[source];
        host_layer(&mut self.layers, source).swap_shared(&mut self.scratch[sc]);
        let r = self.apply(il, scale);
        host_layer(&mut self.layers, source).swap_shared(&mut self.scratch[sc]);
        r?;
        // SAFETY: a non-null buffer (checked by `check_kqv_out`).
        if unsafe { sys::ggml_backend_buffer_is_host(t.buffer) } && !copy {
            // SAFETY: checked contiguous f32 of n × nh·d values in host memory.
            let dst = unsafe { std::slice::from_raw_parts_mut(t.data as *mut f32, n * nh * d) };
            dst.copy_from_slice(&self.out);
        } else {
            // SAFETY: the tensor is exactly n × nh·d contiguous f32 (checked).
            unsafe {
                sys::ggml_backend_tensor_set(t, self.out.as_ptr().cast(), 0, n * nh * d * 4);
            }
        }
        self.layers_done += 1;
        self.tap_output(t, il);
        Ok(())
    }

    /// Checks that llama.cpp masks layer `il` as [`Model::attention_windows`]
    /// says: every windowed layer takes one mask tensor, every global layer
    /// another (an iSWA cache builds one of each). A window table that
    /// disagrees with llama.cpp's would attend over the wrong tokens.
    fn check_mask(&mut self, fa: &sys::ggml_tensor, il: usize) -> Result<(), String> {
        // SAFETY: a node's sources live as long as the graph.
        let Some(tensor) = (unsafe { fa.src[3].as_ref() }) else {
            return Ok(());
        };
        let mask = tensor as *const sys::ggml_tensor as usize;
        // ggml's scheduler copies an input once per backend that reads it:
        // layers on the host and on a device see different copies.
        // SAFETY: a live tensor's buffer (checked non-null first).
        let host =
            tensor.buffer.is_null() || unsafe { sys::ggml_backend_buffer_is_host(tensor.buffer) };
        match_mask(
            &mut self.masks[usize::from(host)],
            self.windows[il] > 0,
            mask,
        )
        .map_err(|wrong| {
            format!(
                "layer {il} (window {}): llama.cpp's graph {wrong}; this build's window \
                     table does not match llama.cpp's",
                self.windows[il]
            )
        })
    }

    /// Asked (before the graph computes) about `kqv_out-<il>` of a layer on
    /// the host: switches llama.cpp's flash attention that feeds it off (the
    /// CPU backend skips a `GGML_OP_NONE` node), unless it is to run. Its
    /// inputs are still computed, and `on_layer` writes the whole output.
    fn switch_off_llama_attention(&mut self, t: &sys::ggml_tensor, il: usize) {
        let source = self.sources.get(il).copied().unwrap_or(il);
        if self.llama_attention || !matches!(self.layers.get(source), Some(LayerStore::Host(_))) {
            return;
        }
        // SAFETY: a node's sources live as long as the graph; nothing reads
        // the node while the callback runs.
        let Some(fa) = (unsafe { t.src[0].as_mut() }) else {
            return;
        };
        // Only a node in host memory, which the CPU backend computes.
        // SAFETY: a live tensor's buffer (null before allocation).
        if fa.op != sys::GGML_OP_FLASH_ATTN_EXT
            || fa.buffer.is_null()
            || !unsafe { sys::ggml_backend_buffer_is_host(fa.buffer) }
        {
            return;
        }
        fa.op = sys::GGML_OP_NONE;
        self.switched_off.push(fa as *mut sys::ggml_tensor as usize);
    }

    /// Switches the nodes `switch_off_llama_attention` switched off back on
    /// (llama.cpp may reuse the graph for the next decode).
    fn restore_llama_attention(&self) {
        for &a in &self.switched_off {
            // SAFETY: the graph lives until llama.cpp builds the next one,
            // after this decode returned.
            unsafe { (*(a as *mut sys::ggml_tensor)).op = sys::GGML_OP_FLASH_ATTN_EXT };
        }
    }

    /// Keeps a copy of layer `il`'s attention output when it is the tapped
    /// layer ([`GraftOptions::tap_layer`]).
    fn tap_output(&mut self, t: &sys::ggml_tensor, il: usize) {
        if self.tap != Some(il) {
            return;
        }
        let (nh, _, d) = self.geom[il];
        let len = self.n_tokens * nh * d;
        self.tapped.resize(len, 0.0);
        // SAFETY: kqv_out holds exactly `len` contiguous f32 (checked by
        // `check_kqv_out`), in host or device memory.
        unsafe { sys::ggml_backend_tensor_get(t, self.tapped.as_mut_ptr().cast(), 0, len * 4) };
    }

    /// The step's writes, copies, seals and attention in layer `il` (its
    /// inputs gathered) into `self.out`.
    fn apply(&mut self, il: usize, scale: f32) -> Result<(), String> {
        let ((nh, kvh, d), n) = (self.geom[il], self.n_tokens);
        let source = self.sources[il];
        let pages = host_layer(&mut self.layers, source);
        let g = self.group[il];
        let step = match g {
            0 => &self.step,
            _ => self
                .step
                .windowed
                .as_deref()
                .ok_or("a windowed layer without the step's windowed part")?,
        };
        let row = kvh * d;
        // A layer reading another's KV writes only the step's scratch rows
        // again (the same values; the scratch held them only while that
        // layer ran), never copies or seals (done).
        let own = source == il;
        for (i, &(block, r)) in step.writes.iter().enumerate() {
            if !own && (block as usize) < self.own_tail[g] {
                continue;
            }
            pages.write_token(
                block,
                usize::from(r),
                &self.k[i * row..(i + 1) * row],
                &self.v[i * row..(i + 1) * row],
            );
        }
        if own {
            for c in &step.copies {
                pages.copy_tail_rows(c.src, c.dst, c.rows.clone());
            }
            for &(src, dst) in &step.seals {
                pages.seal(src, dst);
            }
        }
        let qrow = nh * d;
        let queries: Vec<SeqQuery<'_>> = step
            .queries
            .iter()
            .map(|g| SeqQuery {
                kv: &g.kv,
                q: &self.q[g.tokens.start * qrow..g.tokens.end * qrow],
                n_q: g.tokens.len(),
            })
            .collect();
        // The runs are in batch order and cover it (checked before the decode).
        self.out.resize(n * qrow, 0.0);
        let attn = LayerAttn {
            scale,
            window: self.windows[il],
            sinks: self.has_sinks.then_some(&self.sinks[..]),
        };
        siliceo_kernels_turing::paged_attention_layer(
            pages,
            nh,
            &attn,
            &queries,
            &mut self.out,
            &self.params,
        )
        .map_err(|e| format!("layer {il}: {e}"))
    }
}

/// Layer `il`'s host store (a layer on the device has none).
fn host_layer(layers: &mut [LayerStore], il: usize) -> &mut KvPages {
    layers[il].host_mut().expect("a host layer")
}

/// Copies within a pool of `tail` blocks of `t` rows.
fn check_copies(copies: &[RowCopy], tail: usize, t: usize) -> Result<(), EngineError> {
    match copies
        .iter()
        .find(|c| c.src as usize >= tail || c.dst as usize >= tail || c.rows.end > t)
    {
        Some(c) => Err(EngineError::Graft(format!("copy {c:?} outside the store"))),
        None => Ok(()),
    }
}

fn parse_layer(name: &[u8]) -> Option<usize> {
    let rest = name.strip_prefix(b"kqv_out-")?;
    std::str::from_utf8(rest).ok()?.parse().ok()
}

/// A node's name, read only as far as `kqv_out-` decides (the callback is
/// asked about every node of every graph).
fn node_name(t: &sys::ggml_tensor) -> Option<&[u8]> {
    // SAFETY: ggml's name is a NUL-terminated `char` array inside the tensor.
    let raw: &[u8] = unsafe { &*(&t.name as *const [std::ffi::c_char] as *const [u8]) };
    if !raw.starts_with(b"kqv_out-") {
        return None;
    }
    let end = raw.iter().position(|&b| b == 0).unwrap_or(raw.len());
    Some(&raw[..end])
}

unsafe extern "C" fn eval_callback(t: *mut sys::ggml_tensor, ask: bool, ud: *mut c_void) -> bool {
    // SAFETY: llama.cpp passes a live tensor and our user data.
    let t = unsafe { &mut *t };
    if ask && t.op == sys::GGML_OP_MUL_MAT {
        // SAFETY: the State outlives the context (GraftedContext owns both);
        // asked before the graph computes, so nothing else touches it.
        let state = unsafe { &mut *(ud as *mut State) };
        if let Some(k) = state.q4_1.as_mut() {
            // SAFETY: a node of the graph about to compute; the Shared is
            // boxed in the State, which outlives the graph's computation.
            unsafe { k.take(t) };
        }
        return false;
    }
    let Some(il) = node_name(t).and_then(parse_layer) else {
        return !ask;
    };
    // SAFETY: the State outlives the context (GraftedContext owns both).
    let state = unsafe { &mut *(ud as *mut State) };
    if ask {
        state.switch_off_llama_attention(t, il);
        return true;
    }
    if state.error.is_some() {
        return true;
    }
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| unsafe {
        state.on_layer(t, il)
    }));
    match r {
        Ok(Ok(())) => {}
        Ok(Err(e)) => state.error = Some(e),
        Err(_) => state.error = Some(format!("panic in grafted attention (layer {il})")),
    }
    // Always true: false only skips the rest of a split, not the graph; the
    // error is reported after the decode.
    true
}

/// Block placement without sharing, for callers that drive a
/// [`GraftedContext`] without kv-paging (the quality harness, tests): free
/// lists of both pools, and per append the writes, seals and query runs
/// with the serving path's semantics — a query at position `p` sees the
/// store at `p + 1` tokens (a full block is sealed once `tail_tokens` more
/// follow it), however many tokens a step carries; a sealed-away tail block
/// is free again only after the step ([`BlockPlacer::end_step`]).
#[derive(Debug, Clone)]
pub struct BlockPlacer {
    t: usize,
    tail_tokens: usize,
    seals: bool,
    free_tail: Vec<u32>,
    free_sealed: Vec<u32>,
    released: Vec<u32>,
}

impl BlockPlacer {
    /// Placement over `sealed` sealed and `tail` tail blocks of `layout`
    /// (a full-precision layout never seals).
    pub fn new(layout: &KvLayout, sealed: usize, tail: usize) -> BlockPlacer {
        BlockPlacer {
            t: layout.block_tokens,
            tail_tokens: layout.tail_tokens,
            seals: !layout.full_precision(),
            free_tail: (0..tail as u32).rev().collect(),
            free_sealed: (0..sealed as u32).rev().collect(),
            released: Vec::new(),
        }
    }

    /// Appends `n` tokens to `seq`, at batch indices `first..first + n`:
    /// their writes, the seals they cause and their query runs go into `g`.
    pub fn append(
        &mut self,
        seq: &mut SeqKv,
        n: usize,
        first: usize,
        g: &mut GraftStep,
    ) -> Result<(), EngineError> {
        let full = |what: &str| EngineError::Graft(format!("the store has no free {what} block"));
        let t = self.t;
        let start = seq.len;
        let mut run = start;
        let view = |seq: &SeqKv, len: usize| {
            seq.prefix(len, t)
                .expect("a query's tokens are placed before its view is taken")
        };
        for _ in 0..n {
            let p = seq.len;
            let off = p - seq.sealed.len() * t;
            if off / t == seq.tail.len() {
                seq.tail
                    .push(self.free_tail.pop().ok_or_else(|| full("tail"))?);
            }
            g.writes.push((seq.tail[off / t], (off % t) as u16));
            seq.len += 1;
            if self.seals && seq.len - seq.sealed.len() * t >= self.tail_tokens + t {
                // Queries before this token see the block open.
                if p > run {
                    g.queries.push(GraftQuery {
                        tokens: first + (run - start)..first + (p - start),
                        kv: view(seq, p),
                    });
                    run = p;
                }
                let dst = self.free_sealed.pop().ok_or_else(|| full("sealed"))?;
                let src = seq.tail.remove(0);
                g.seals.push((src, dst));
                seq.sealed.push(dst);
                self.released.push(src);
            }
        }
        if seq.len > run {
            g.queries.push(GraftQuery {
                tokens: first + (run - start)..first + (seq.len - start),
                kv: view(seq, seq.len),
            });
        }
        Ok(())
    }

    /// After the step's decode: the tail blocks it sealed away are free.
    pub fn end_step(&mut self) {
        self.free_tail.append(&mut self.released);
    }

    /// Frees `seq`'s blocks and empties it.
    pub fn release(&mut self, seq: &mut SeqKv) {
        self.free_sealed.append(&mut seq.sealed);
        self.free_tail.append(&mut seq.tail);
        seq.len = 0;
    }
}

/// A llama.cpp context whose attention — and KV — are siliceo's.
pub struct GraftedContext<'m> {
    model: &'m Model,
    // Dropped before the State its callback uses.
    raw: RawContext<'m>,
    state: Box<State>,
    layout: KvLayout,
    /// For each index of the last decoded batch: did it request logits.
    logits_mask: Vec<bool>,
    /// The batch's runs of one sequence's consecutive tokens.
    runs: Vec<Range<usize>>,
    /// llama.cpp sequence ids of the context.
    n_ids: usize,
    /// Scratch tail blocks ([`GraftOptions::scratch_blocks`]).
    n_scratch: usize,
    /// Each layer's layout (its shape's), on the host or the device.
    layer_layouts: Vec<KvLayout>,
    /// (sealed, tail) blocks per layer.
    capacity: (usize, usize),
    /// (sealed, tail) blocks per windowed layer keeping pools of its own.
    windowed_capacity: Option<(usize, usize)>,
    /// Those layers' window (0 without their own pools).
    group_window: usize,
}

impl std::fmt::Debug for GraftedContext<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GraftedContext")
            .field("model", &self.model.name())
            .field("layout", &self.layout.name())
            .field("n_batch", &self.raw.n_batch())
            .finish_non_exhaustive()
    }
}

/// The most sequences one decode may carry (llama.cpp's sequence ids).
pub const MAX_SEQS_PER_STEP: usize = 256;

impl<'m> GraftedContext<'m> {
    /// A context over `model` with a store of `opts.sealed_blocks` sealed and
    /// `opts.tail_blocks` tail blocks per layer.
    pub fn new(model: &'m Model, opts: &GraftOptions) -> Result<GraftedContext<'m>, EngineError> {
        model.check_graftable()?;
        let g = model.geometry();
        let layer_kv = model.layer_kv().ok_or_else(|| EngineError::Unsupported {
            model: model.name().to_string(),
            reason: "sliding windows this build does not know".into(),
        })?;
        if let Some(l) = layer_kv
            .iter()
            .find(|l| l.kv_heads == 0 || !(g.n_head as usize).is_multiple_of(l.kv_heads))
        {
            return Err(EngineError::Unsupported {
                model: model.name().to_string(),
                reason: format!("{} query heads over {} KV heads", g.n_head, l.kv_heads),
            });
        }
        let (layouts, layout_of) = opts.format.layer_layouts(&layer_kv, opts.block_tokens)?;
        // Layer 0's (every layer's, but for Gemma 4's).
        let layout = layouts[0];
        if opts.n_batch == 0 {
            return Err(EngineError::InvalidOption {
                field: "n_batch",
                reason: "must be at least 1".into(),
            });
        }
        // Sequence ids for llama.cpp: at least the sequences of a step, and
        // enough to cut prefill chunks into short pieces (see `decode`);
        // llama.cpp keeps a logits row per id.
        let n_ids = opts
            .max_seqs
            .max(64)
            .clamp(1, (MAX_SEQS_PER_STEP as u32).min(opts.n_batch));
        let n_layer = g.n_layer as usize;
        let candidates: Vec<usize> = match &opts.device {
            DeviceAttention::Host => Vec::new(),
            DeviceAttention::Cuda => model.offloaded_layers().collect(),
            DeviceAttention::Emulated(layers) => layers.clone(),
        };
        let sources: Vec<usize> = layer_kv.iter().map(|l| l.source).collect();
        let shapes = crate::graft_device::Shapes {
            layouts: &layouts,
            layout_of: &layout_of,
            sources: &sources,
        };
        // The layers keeping KV whose store is on the device (a layer
        // keeping none follows its source).
        let on_device = crate::graft_device::device_owners(
            &opts.device,
            &candidates,
            shapes,
            g.n_head as usize,
        );
        let windows = match &opts.windows {
            Some(w) if w.len() == n_layer => w.clone(),
            Some(w) => {
                return Err(EngineError::InvalidOption {
                    field: "windows",
                    reason: format!("{} windows for {n_layer} layers", w.len()),
                });
            }
            None => model
                .attention_windows()
                .ok_or_else(|| EngineError::Unsupported {
                    model: model.name().to_string(),
                    reason: "sliding windows this build does not know".into(),
                })?,
        };
        // The windowed layers' own pools: every layer reading a windowed
        // layer's KV is in group 1 (one window for all, on the host).
        let group: Vec<usize> = (0..n_layer)
            .map(|il| usize::from(opts.windowed_blocks.is_some() && windows[sources[il]] > 0))
            .collect();
        let mut group_window = 0;
        if opts.windowed_blocks.is_some() {
            let bad = |reason: String| {
                Err(EngineError::InvalidOption {
                    field: "windowed_blocks",
                    reason,
                })
            };
            let mut ws: Vec<usize> = windows.iter().copied().filter(|&w| w > 0).collect();
            ws.dedup();
            if ws.is_empty() {
                return bad("the model has no windowed layers".into());
            }
            if ws.len() > 1 {
                return bad(format!(
                    "its windowed layers have windows of {ws:?} tokens, not one"
                ));
            }
            if (0..n_layer).any(|il| group[il] == 1 && on_device.contains(&sources[il])) {
                return bad("windowed layers keep pools of their own only on the host".into());
            }
            group_window = ws[0];
        }
        let device = if on_device.is_empty() {
            None
        } else {
            let pools = (opts.sealed_blocks, opts.tail_blocks + opts.scratch_blocks);
            let dev = crate::graft_device::device_store(
                &opts.device,
                shapes,
                &on_device,
                pools,
                g.n_head as usize,
            )
            .map_err(|reason| EngineError::InvalidOption {
                field: "device",
                reason,
            })?;
            Some(dev)
        };
        let layers = (0..n_layer)
            .map(|il| {
                if layer_kv[il].source != il {
                    return Ok(LayerStore::Borrowed);
                }
                if on_device.contains(&il) {
                    return Ok(LayerStore::Device);
                }
                let (sealed, tail) = match opts.windowed_blocks {
                    Some(w) if group[il] == 1 => w,
                    _ => (opts.sealed_blocks, opts.tail_blocks),
                };
                KvPages::new(layouts[layout_of[il]], sealed, tail).map(LayerStore::Host)
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| EngineError::InvalidOption {
                field: "kv",
                reason: e.to_string(),
            })?;
        let threads = opts.threads.unwrap_or_else(crate::context::default_threads);
        let mut state = Box::new(State {
            layers,
            device,
            scratch: layouts
                .iter()
                .map(|l| SharedTail::new(l, opts.scratch_blocks))
                .collect(),
            scratch_of: layout_of.clone(),
            sources: sources.clone(),
            copy_tensors: opts.copy_tensors,
            staging: Vec::new(),
            geom: layer_kv
                .iter()
                .map(|l| (g.n_head as usize, l.kv_heads, l.head_dim))
                .collect(),
            group,
            own_tail: [opts.tail_blocks, opts.windowed_blocks.map_or(0, |w| w.1)],
            step_writes_scratch: [false; 2],
            params: AttnParams {
                threads: opts.kernel_threads.unwrap_or(threads as usize).max(1),
                // On llama.cpp's own (idle, spinning) OpenMP threads, which
                // wake in a microsecond or two: worth it for less work.
                runner: Some(crate::omp::run),
                min_work_per_thread: 1 << 16,
                ..AttnParams::default()
            },
            step: GraftStep::default(),
            n_tokens: 0,
            q: Vec::new(),
            k: Vec::new(),
            v: Vec::new(),
            out: Vec::new(),
            layers_done: 0,
            error: None,
            tap: opts.tap_layer,
            tapped: Vec::new(),
            llama_attention: opts.llama_attention,
            switched_off: Vec::new(),
            q4_1: opts
                .q4_1_kernel
                .then(crate::q4_1::Q41Kernel::probe)
                .flatten()
                .map(|k| Box::new(crate::q4_1::Shared::new(k))),
            windows,
            has_sinks: false,
            sinks: Vec::new(),
            masks: [[None; 2]; 2],
        });
        // llama.cpp's own cache: one step, padded as llama.cpp pads it.
        let n_ctx = opts.n_batch.div_ceil(256) * 256;
        // SAFETY: plain C calls; the callback's user data is the boxed State,
        // which lives (at a fixed address) as long as the context.
        let raw = unsafe {
            let mut p = sys::llama_context_default_params();
            p.n_ctx = n_ctx;
            p.n_batch = opts.n_batch;
            p.n_ubatch = opts.n_batch;
            p.n_seq_max = n_ids;
            p.n_threads = threads as i32;
            p.n_threads_batch = threads as i32;
            p.flash_attn_type = sys::LLAMA_FLASH_ATTN_TYPE_ENABLED;
            p.type_k = sys::GGML_TYPE_F16;
            p.type_v = sys::GGML_TYPE_F16;
            p.kv_unified = true;
            p.cb_eval = Some(eval_callback);
            p.cb_eval_user_data = &mut *state as *mut State as *mut c_void;
            RawContext::new(model, p, "grafted")?
        };
        Ok(GraftedContext {
            model,
            raw,
            state,
            layout,
            logits_mask: Vec::new(),
            runs: Vec::new(),
            n_ids: n_ids as usize,
            n_scratch: opts.scratch_blocks,
            capacity: (opts.sealed_blocks, opts.tail_blocks),
            windowed_capacity: opts.windowed_blocks,
            group_window,
            layer_layouts: layout_of.iter().map(|&i| layouts[i]).collect(),
        })
    }

    /// The model.
    pub fn model(&self) -> &'m Model {
        self.model
    }

    /// The store's layout (codecs, tail, rotation, block size).
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// Most tokens per decode.
    pub fn n_batch(&self) -> usize {
        self.raw.n_batch()
    }

    /// (sealed, tail) blocks per layer (the scratch not counted).
    pub fn capacity(&self) -> (usize, usize) {
        self.capacity
    }

    /// (sealed, tail) blocks per windowed layer where those keep pools of
    /// their own ([`GraftOptions::windowed_blocks`]).
    pub fn windowed_capacity(&self) -> Option<(usize, usize)> {
        self.windowed_capacity
    }

    /// Whether layer `il`'s store is the windowed layers' own (its blocks
    /// are [`GraftStep::windowed`]'s).
    pub fn in_windowed_group(&self, il: usize) -> bool {
        self.state.group.get(il) == Some(&1)
    }

    /// Scratch tail blocks (one set for all layers).
    pub fn scratch_blocks(&self) -> usize {
        self.n_scratch
    }

    /// Bytes the store holds, all layers and the scratch, on the host and
    /// on the device.
    pub fn store_bytes(&self) -> usize {
        self.host_store_bytes() + self.device_store_bytes()
    }

    /// Bytes of the store in host memory.
    pub fn host_store_bytes(&self) -> usize {
        self.state
            .layers
            .iter()
            .filter_map(LayerStore::host)
            .map(KvPages::byte_len)
            .sum::<usize>()
            + self
                .state
                .scratch
                .iter()
                .map(SharedTail::byte_len)
                .sum::<usize>()
    }

    /// Bytes of the store in device memory (layers on the device, each with
    /// its own scratch blocks).
    pub fn device_store_bytes(&self) -> usize {
        self.state.device.as_ref().map_or(0, |d| d.bytes())
    }

    /// Layers in which the last decode switched llama.cpp's own attention
    /// off (every host layer unless [`GraftOptions::llama_attention`]).
    pub fn llama_attention_off(&self) -> usize {
        self.state.switched_off.len()
    }

    /// Weight products of the last decode computed by siliceo's Q4_1 kernel
    /// instead of llama.cpp's `vec_dot` (the same bits; 0 where this CPU
    /// lacks AVX2, for one-token products without AVX-512 VNNI, where the
    /// model has no Q4_1 weights, or with `SILICEO_LLAMA_MATMUL=1`).
    pub fn q4_1_products(&self) -> usize {
        self.state.q4_1.as_ref().map_or(0, |k| k.last_switched())
    }

    /// Layers whose store and attention are on the device.
    pub fn device_layers(&self) -> usize {
        self.state
            .layers
            .iter()
            .filter(|l| matches!(l, LayerStore::Device))
            .count()
    }

    /// Bytes of one (sealed, tail) block summed over the layers that keep KV
    /// of their own, each in its layout.
    pub fn block_bytes(&self) -> (usize, usize) {
        let (g, w) = self.block_bytes_by_group();
        (g.0 + w.0, g.1 + w.1)
    }

    /// [`block_bytes`](Self::block_bytes) of the layers whose blocks are the
    /// step's own, and of those whose blocks are its windowed part's
    /// ([`GraftOptions::windowed_blocks`]; 0 without).
    pub fn block_bytes_by_group(&self) -> ((usize, usize), (usize, usize)) {
        let mut sums = [(0, 0); 2];
        for (il, store) in self.state.layers.iter().enumerate() {
            let sum = &mut sums[self.state.group[il]];
            let l = match store {
                LayerStore::Host(p) => *p.layout(),
                LayerStore::Device => self.layer_layouts[il],
                LayerStore::Borrowed => continue,
            };
            sum.0 += l.block_bytes();
            sum.1 += l.tail_block_bytes();
        }
        (sums[0], sums[1])
    }

    /// The layer whose store layer `il` attends over (itself, but for
    /// Gemma 4's last layers).
    pub fn kv_source(&self, il: usize) -> usize {
        self.state.sources.get(il).copied().unwrap_or(il)
    }

    /// One host layer's store, to read a sequence back (tests, quality
    /// checks); `None` for a layer on the device.
    pub fn layer(&self, il: usize) -> Option<&KvPages> {
        self.state.layers.get(il)?.host()
    }

    /// One layer's pools as bytes (sealed, tail: the scratch not included),
    /// wherever the layer lives.
    pub fn layer_pools(&self, il: usize) -> Result<(Vec<u8>, Vec<u8>), EngineError> {
        if self.kv_source(il) != il {
            return Err(EngineError::Graft(format!(
                "layer {il} keeps no KV of its own (it reads layer {}'s)",
                self.kv_source(il)
            )));
        }
        if let Some(pages) = self.layer(il) {
            return Ok((pages.sealed_bytes().to_vec(), pages.tail_bytes().to_vec()));
        }
        let dev = self
            .state
            .device
            .as_ref()
            .ok_or_else(|| EngineError::Graft(format!("no layer {il}")))?;
        let (s, mut t) = dev.pools(il).map_err(EngineError::Graft)?;
        t.truncate(self.capacity.1 * self.layer_layouts[il].tail_block_bytes());
        Ok((s, t))
    }

    /// Cells llama.cpp's own KV cache holds right now (0 between decodes).
    pub fn llama_cells(&self) -> u32 {
        // SAFETY: a live context; its sequence ids are 0..n_ids.
        unsafe {
            let mem = sys::llama_get_memory(self.raw.ptr());
            (0..self.n_ids as i32)
                .map(|s| {
                    let (lo, hi) = (
                        sys::llama_memory_seq_pos_min(mem, s),
                        sys::llama_memory_seq_pos_max(mem, s),
                    );
                    if lo >= 0 && hi >= lo {
                        (hi - lo + 1) as u32
                    } else {
                        0
                    }
                })
                .sum()
        }
    }

    /// The attention kernel's thread count.
    pub fn set_kernel_threads(&mut self, threads: usize) {
        self.state.params.threads = threads.max(1);
    }

    fn check_step(&self, batch: &Batch, step: &GraftStep) -> Result<(), EngineError> {
        let (sealed, own) = self.capacity();
        self.check_part(batch, step, sealed, own, 0)?;
        match (self.windowed_capacity, step.windowed.as_deref()) {
            (None, None) => Ok(()),
            (Some((sealed, own)), Some(w)) => self
                .check_part(batch, w, sealed, own, self.group_window)
                .map_err(|e| EngineError::Graft(format!("windowed layers: {e}"))),
            (Some(_), None) => Err(EngineError::Graft(
                "the windowed layers keep pools of their own: the step needs their part".into(),
            )),
            (None, Some(_)) => Err(EngineError::Graft(
                "a windowed part for a store whose layers share their pools".into(),
            )),
        }
    }

    /// One group's part of a step against its pools: `sealed` sealed and
    /// `own` tail blocks (the scratch after them). With a `window`, a view
    /// may name [`GraftStep::RELEASED`] for blocks wholly before its first
    /// query's window.
    fn check_part(
        &self,
        batch: &Batch,
        step: &GraftStep,
        sealed: usize,
        own: usize,
        window: usize,
    ) -> Result<(), EngineError> {
        let bad = |why: String| Err(EngineError::Graft(why));
        let tail = own + self.scratch_blocks();
        if step.writes.len() != batch.len() {
            return bad(format!(
                "{} writes for a batch of {} tokens",
                step.writes.len(),
                batch.len()
            ));
        }
        let t = self.layout.block_tokens;
        for &(b, r) in &step.writes {
            if b as usize >= tail || usize::from(r) >= t {
                return bad(format!("write to tail block {b} row {r} outside the store"));
            }
        }
        check_copies(&step.copies, own, t)?;
        for &(s, d) in &step.seals {
            if s as usize >= tail || d as usize >= sealed {
                return bad(format!("seal of tail {s} into {d} outside the store"));
            }
        }
        let mut next = 0;
        for q in &step.queries {
            if q.tokens.start != next || q.tokens.is_empty() {
                return bad(format!(
                    "query runs must cover the batch in order; {:?} after {next}",
                    q.tokens
                ));
            }
            next = q.tokens.end;
            // Blocks before `unread` lie wholly before the first query's
            // window.
            let first = q.kv.len.saturating_sub(q.tokens.len());
            let unread = if window == 0 {
                0
            } else {
                (first + 1).saturating_sub(window) / t
            };
            let ok = |i: usize, b: u32, cap: usize| {
                (b as usize) < cap || (b == GraftStep::RELEASED && i < unread)
            };
            let n_sealed = q.kv.sealed.len();
            if q.kv
                .sealed
                .iter()
                .enumerate()
                .any(|(i, &b)| !ok(i, b, sealed))
                || q.kv
                    .tail
                    .iter()
                    .enumerate()
                    .any(|(i, &b)| !ok(n_sealed + i, b, tail))
            {
                return bad(format!(
                    "query run {:?} names blocks outside the store",
                    q.tokens
                ));
            }
        }
        if next != batch.len() {
            return bad(format!(
                "query runs cover {next} of {} batch tokens",
                batch.len()
            ));
        }
        Ok(())
    }

    /// Runs the model over `batch` with attention (and KV) as `step` says.
    /// Positions may be anywhere; every token belongs to one sequence, and a
    /// sequence's tokens are consecutive in positions and in the batch; at
    /// most [`GraftOptions::max_seqs`] sequences (runs of consecutive tokens).
    pub fn decode(&mut self, batch: &Batch, step: GraftStep) -> Result<(), EngineError> {
        self.logits_mask.clear();
        self.state.switched_off.clear();
        if batch.is_empty() {
            return Ok(());
        }
        if batch.len() > self.raw.n_batch() {
            return Err(EngineError::BatchTooLarge {
                tokens: batch.len(),
                n_batch: self.raw.n_batch() as u32,
            });
        }
        self.check_step(batch, &step)?;
        let n_vocab = self.model.geometry().n_vocab;
        // Runs of consecutive tokens of one sequence (the batch's order).
        self.runs.clear();
        let mut last: Option<(i32, u32)> = None;
        for (i, t) in batch.tokens().enumerate() {
            if t.token.0 >= n_vocab {
                return Err(EngineError::InvalidToken {
                    token: t.token.0,
                    n_vocab,
                });
            }
            let [seq] = t.seqs[..] else {
                return Err(EngineError::Graft(format!(
                    "batch token {i} belongs to {} sequences; grafted steps take one",
                    t.seqs.len()
                )));
            };
            match last {
                Some((s, p)) if s == seq && p + 1 == t.pos => {
                    self.runs.last_mut().expect("a run").end = i + 1;
                }
                _ => self.runs.push(i..i + 1),
            }
            last = Some((seq, t.pos));
        }
        if self.runs.len() > self.n_ids {
            return Err(EngineError::Graft(format!(
                "{} runs of sequences in one step, at most {}",
                self.runs.len(),
                self.n_ids
            )));
        }
        // llama.cpp's own attention runs too and is overwritten: spread each
        // run over several of its sequence ids (consecutive pieces) so that
        // each query's causal mask holds a few tokens, not the whole chunk.
        let (n, spare) = (batch.len(), self.n_ids - self.runs.len());
        let b = &mut self.raw.batch;
        let mut id = 0i32;
        let mut toks = batch.tokens();
        for run in &self.runs {
            let len = run.len();
            let pieces = 1 + len * spare / n;
            for k in 0..pieces {
                for i in run.start + k * len / pieces..run.start + (k + 1) * len / pieces {
                    let t = toks.next().expect("as many tokens as runs cover");
                    // SAFETY: the arrays hold n_batch entries (llama_batch_init).
                    unsafe {
                        *b.token.add(i) = t.token.0 as i32;
                        *b.pos.add(i) = t.pos as i32;
                        *b.n_seq_id.add(i) = 1;
                        *(*b.seq_id.add(i)).add(0) = id;
                        *b.logits.add(i) = i8::from(t.logits);
                    }
                    self.logits_mask.push(t.logits);
                }
                id += 1;
            }
        }
        self.raw.batch.n_tokens = batch.len() as i32;
        let own_tail = self.state.own_tail;
        let scratch =
            |part: &GraftStep, own: usize| part.writes.iter().any(|&(b, _)| b as usize >= own);
        self.state.step_writes_scratch = [
            scratch(&step, own_tail[0]),
            step.windowed
                .as_deref()
                .is_some_and(|w| scratch(w, own_tail[1])),
        ];
        self.state.step = step;
        self.state.n_tokens = batch.len();
        self.state.layers_done = 0;
        self.state.error = None;
        self.state.masks = [[None; 2]; 2];
        if let Some(dev) = self.state.device.as_mut() {
            dev.end_step();
        }
        let rc = self.raw.decode();
        self.state.restore_llama_attention();
        if let Some(e) = self.state.q4_1.as_mut().and_then(|k| k.restore()) {
            self.state.error.get_or_insert(e);
        }
        // llama.cpp keeps nothing between steps.
        self.raw.clear_memory(false);
        let error = self.state.error.take();
        if error.is_some() {
            // A layer that panicked still holds the scratch.
            let state = &mut *self.state;
            for (il, store) in state.layers.iter_mut().enumerate() {
                if let LayerStore::Host(pages) = store
                    && pages.shared_blocks() > 0
                {
                    pages.swap_shared(&mut state.scratch[state.scratch_of[il]]);
                }
            }
        }
        if let Some(dev) = self.state.device.as_mut() {
            dev.end_step();
        }
        let done = self.state.layers_done;
        if error.is_some() || rc != 0 || done != self.state.layers.len() {
            self.logits_mask.clear();
        }
        if let Some(e) = error {
            return Err(EngineError::Graft(e));
        }
        if rc != 0 {
            return Err(EngineError::Graft(format!("llama_decode returned {rc}")));
        }
        if done != self.state.layers.len() {
            return Err(EngineError::Graft(format!(
                "{done} of {} layers went through the kernel: this model's graph does not \
                 name every layer's attention kqv_out",
                self.state.layers.len()
            )));
        }
        Ok(())
    }

    /// Logits for batch index `index` of the last decode; the token there
    /// must have asked for them.
    pub fn logits(&self, index: usize) -> Result<&[f32], EngineError> {
        if !self.logits_mask.get(index).copied().unwrap_or(false) {
            return Err(EngineError::NoLogits { index });
        }
        Ok(self.raw.logits(index))
    }

    /// The tapped layer's attention output in the last decode
    /// (`tokens × heads × head_dim`; empty without [`GraftOptions::tap_layer`]).
    pub fn tapped(&self) -> &[f32] {
        &self.state.tapped
    }

    /// An error for what names blocks of every layer alike, where windowed
    /// layers keep pools of their own.
    fn one_group(&self, what: &str) -> Result<(), EngineError> {
        match self.windowed_capacity {
            None => Ok(()),
            Some(_) => Err(EngineError::Graft(format!(
                "{what} is not supported where windowed layers keep pools of their own"
            ))),
        }
    }

    /// Copies tail rows in every layer, between decodes (a token tree's kept
    /// branch into its request's blocks), in order.
    pub fn copy_rows(&mut self, copies: &[RowCopy]) -> Result<(), EngineError> {
        self.one_group("copies of rows between decodes")?;
        let (_, tail) = self.capacity();
        check_copies(copies, tail, self.layout.block_tokens)?;
        for pages in self
            .state
            .layers
            .iter_mut()
            .filter_map(LayerStore::host_mut)
        {
            for c in copies {
                pages.copy_tail_rows(c.src, c.dst, c.rows.clone());
            }
        }
        if let Some(dev) = self.state.device.as_mut() {
            dev.copy_rows(copies).map_err(EngineError::Graft)?;
        }
        Ok(())
    }

    /// Copies `blocks` of every layer into host memory (a swapped-out sequence).
    pub fn save_blocks(&self, blocks: &[StoreBlock]) -> Result<SavedBlocks, EngineError> {
        self.one_group("saving blocks")?;
        let mut bytes = Vec::new();
        for (il, store) in self.state.layers.iter().enumerate() {
            let pages = match store {
                LayerStore::Host(pages) => pages,
                LayerStore::Device => {
                    let dev = self.state.device.as_ref().expect("a device store");
                    dev.save(il, blocks, &mut bytes)
                        .map_err(EngineError::Graft)?;
                    continue;
                }
                LayerStore::Borrowed => continue,
            };
            for &b in blocks {
                bytes.extend_from_slice(match b {
                    StoreBlock::Sealed(i) => pages.sealed_block(i),
                    StoreBlock::Tail(i) => pages.tail_block(i),
                });
            }
        }
        Ok(SavedBlocks {
            kinds: blocks
                .iter()
                .map(|b| matches!(b, StoreBlock::Sealed(_)))
                .collect(),
            bytes,
        })
    }

    /// Writes saved blocks back, into `blocks` (same count and pools as saved).
    pub fn restore_blocks(
        &mut self,
        saved: &SavedBlocks,
        blocks: &[StoreBlock],
    ) -> Result<(), EngineError> {
        self.one_group("restoring blocks")?;
        let kinds: Vec<bool> = blocks
            .iter()
            .map(|b| matches!(b, StoreBlock::Sealed(_)))
            .collect();
        if kinds != saved.kinds {
            return Err(EngineError::Graft(format!(
                "restoring {} blocks into {} of other pools",
                saved.kinds.len(),
                blocks.len()
            )));
        }
        let mut at = 0;
        let state = &mut *self.state;
        for (il, store) in state.layers.iter_mut().enumerate() {
            let pages = match store {
                LayerStore::Host(pages) => pages,
                LayerStore::Device => {
                    let dev = state.device.as_mut().expect("a device store");
                    at += dev
                        .restore(il, blocks, &saved.bytes[at..])
                        .map_err(EngineError::Graft)?;
                    continue;
                }
                LayerStore::Borrowed => continue,
            };
            for &b in blocks {
                let dst = match b {
                    StoreBlock::Sealed(i) => pages.sealed_block_mut(i),
                    StoreBlock::Tail(i) => pages.tail_block_mut(i),
                };
                dst.copy_from_slice(&saved.bytes[at..at + dst.len()]);
                at += dst.len();
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_kqv_out_is_asked_for() {
        assert_eq!(parse_layer(b"kqv_out-0"), Some(0));
        assert_eq!(parse_layer(b"kqv_out-31"), Some(31));
        assert_eq!(parse_layer(b"kqv_out"), None);
        assert_eq!(parse_layer(b"Qcur-3"), None);
        assert_eq!(parse_layer(b"kqv_out-x"), None);
    }

    /// The first layer whose mask disagrees with `windows` (a window per
    /// layer, 0 = global), given the mask tensor llama.cpp gave each.
    fn first_mismatch(windows: &[usize], masks: &[usize]) -> Option<(usize, &'static str)> {
        let mut seen = [None; 2];
        (0..windows.len()).find_map(|il| {
            match_mask(&mut seen, windows[il] > 0, masks[il])
                .err()
                .map(|e| (il, e))
        })
    }

    #[test]
    fn a_window_table_unlike_llama_cpps_masks_is_caught() {
        // Gemma 3's period of 6 as llama.cpp masks it: windowed layers share
        // mask 1, global layers (5 and 11) mask 2.
        let masks = [1, 1, 1, 1, 1, 2, 1, 1, 1, 1, 1, 2];
        let right = crate::model::windows_by_period(12, 6, 512);
        assert_eq!(first_mismatch(&right, &masks), None);
        // A period of 4 (Cohere2's) for the same graph: layer 3 is called
        // global but has the windowed layers' mask.
        let period_4 = crate::model::windows_by_period(12, 4, 512);
        assert_eq!(
            first_mismatch(&period_4, &masks),
            Some((3, "shares its mask with the layers of the other kind"))
        );
        // No windows at all: layer 5's mask differs from the other global
        // layers'.
        assert_eq!(
            first_mismatch(&[0; 12], &masks),
            Some((5, "has a mask unlike the other layers of its kind"))
        );
        // Every layer windowed (the last layer of the period forgotten).
        assert_eq!(
            first_mismatch(&[512; 12], &masks),
            Some((5, "has a mask unlike the other layers of its kind"))
        );
        // A model without windows: one mask for all, and a table of zeros.
        assert_eq!(first_mismatch(&[0; 12], &[7; 12]), None);
    }
}
