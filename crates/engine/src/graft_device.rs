//! Grafted attention on the device: the layers llama.cpp runs on a GPU keep
//! their store in device memory and run siliceo's CUDA kernels
//! (`siliceo_kernels_turing::graft`) on the tensors llama.cpp computed there
//! — Q, and K/V in its f16 cache — writing the attention output in place.
//! Only a step's small tables cross to the device, once per decode.
//!
//! The kernels and llama.cpp share the device's primary CUDA context (cudarc
//! retains it; ggml's CUDA backend uses the runtime API, which runs on it),
//! so llama.cpp's device pointers are ours to read. ggml synchronizes its
//! stream before the evaluation callback (`ggml_backend_sched_compute_splits`)
//! and our kernels finish before the callback returns, so the two streams
//! never overlap.
//!
//! Without a GPU the same code runs on the CUDA emulator (feature
//! `cuda-emu`): llama.cpp's tensors are then host memory, which the emulator
//! reads as its device memory, so the whole path — tables, strides, launches
//! — is tested against the CPU store.

use siliceo_kernels_turing::KvLayout;
#[cfg(any(feature = "cuda-kernels", feature = "cuda-emu"))]
use siliceo_kernels_turing::device::{Backend, DeviceKv, Kernels};
#[cfg(any(feature = "cuda-kernels", feature = "cuda-emu"))]
use siliceo_kernels_turing::graft::{DeviceRows, DeviceSpan, DeviceStep, QueryRun, StepTuning};

use llama_cpp_sys_2 as sys;

use crate::graft::{GraftStep, RowCopy, StoreBlock};

/// The device side of a grafted context: the layers whose store lives on
/// the device. Object-safe, so the context holds one whatever the backend.
pub(crate) trait DeviceLayers {
    /// Forgets the last decode's tables (a new decode begins).
    fn end_step(&mut self);
    /// Layer `il` of `step`: writes, copies, seals, attention (each query
    /// seeing its last `window` positions, 0 = all; with the op's attention
    /// `sinks`, f32 per query head) into `out`.
    ///
    /// # Safety
    /// The tensors are the layer's computed `FLASH_ATTN_EXT` inputs and its
    /// `kqv_out`, holding `n` tokens.
    #[allow(clippy::too_many_arguments)]
    unsafe fn layer(
        &mut self,
        il: usize,
        step: &GraftStep,
        n_heads: usize,
        q: &sys::ggml_tensor,
        k: &sys::ggml_tensor,
        v: &sys::ggml_tensor,
        out: &sys::ggml_tensor,
        scale: f32,
        window: usize,
        sinks: Option<&sys::ggml_tensor>,
    ) -> Result<(), String>;
    /// Tail-row copies in every device layer, in order.
    fn copy_rows(&mut self, copies: &[RowCopy]) -> Result<(), String>;
    /// Appends the bytes of `blocks` of layer `il` to `out`.
    fn save(&self, il: usize, blocks: &[StoreBlock], out: &mut Vec<u8>) -> Result<(), String>;
    /// Writes `blocks` of layer `il` from `bytes` (as `save` gave them);
    /// returns the bytes used.
    fn restore(&mut self, il: usize, blocks: &[StoreBlock], bytes: &[u8]) -> Result<usize, String>;
    /// Bytes of device memory the pools hold.
    fn bytes(&self) -> usize;
    /// Layer `il`'s pools (sealed, tail), copied back.
    fn pools(&self, il: usize) -> Result<(Vec<u8>, Vec<u8>), String>;
}

/// The store's shapes: a layout per distinct layer shape, each layer's
/// shape, and the layer whose KV each layer reads (itself, but for Gemma 4's
/// last layers).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Shapes<'a> {
    pub(crate) layouts: &'a [KvLayout],
    pub(crate) layout_of: &'a [usize],
    pub(crate) sources: &'a [usize],
}

/// Device pools for some layers, on backend `B`.
#[cfg(any(feature = "cuda-kernels", feature = "cuda-emu"))]
pub(crate) struct DeviceStore<B: Backend> {
    kernels: Kernels<B>,
    /// By layer index; `None` for layers on the host and layers keeping no
    /// KV of their own.
    layers: Vec<Option<DeviceKv<B>>>,
    /// The layer whose store each layer attends over.
    sources: Vec<usize>,
    /// Each layer's shape (an index into `steps`).
    shape_of: Vec<usize>,
    /// The decode in flight's tables for each shape (its kernels, partitions
    /// and query buffer follow the heads' size and count), uploaded at the
    /// step's first device layer of that shape.
    steps: Vec<Option<DeviceStep<B>>>,
    /// llama.cpp's tensors for these layers are host memory (the emulator);
    /// else they must be in the device's own buffers (CUDA0).
    host_tensors: bool,
    /// Which runs the prefill kernel serves (`SILICEO_DEVICE_PREFILL_MIN_TOKENS`).
    tuning: StepTuning,
}

#[cfg(any(feature = "cuda-kernels", feature = "cuda-emu"))]
impl<B: Backend> DeviceStore<B> {
    /// Pools of `sealed` and `tail` blocks for each layer in `on_device`
    /// (layers keeping KV of their own), each in its shape.
    pub(crate) fn new(
        kernels: Kernels<B>,
        shapes: Shapes<'_>,
        on_device: &[usize],
        (sealed, tail): (usize, usize),
        n_heads: usize,
        host_tensors: bool,
    ) -> Result<DeviceStore<B>, String> {
        let n_layer = shapes.sources.len();
        let mut layers: Vec<Option<DeviceKv<B>>> = (0..n_layer).map(|_| None).collect();
        for &il in on_device {
            let slot = layers
                .get_mut(il)
                .ok_or_else(|| format!("device layer {il} beyond the model's {n_layer}"))?;
            let layout = shapes.layouts[shapes.layout_of[il]];
            *slot = Some(
                kernels
                    .alloc(layout, sealed, tail)
                    .map_err(|e| format!("layer {il}'s store on the device: {e}"))?,
            );
        }
        let tuning = StepTuning::from_env().map_err(|e| e.to_string())?;
        // What the kernels refuse (head sizes, query heads per KV head,
        // codecs) is refused now, not at the first decode: one layer of
        // each shape.
        let mut probed = vec![false; shapes.layouts.len()];
        for (il, kv) in layers.iter().enumerate() {
            let Some(kv) = kv else { continue };
            if std::mem::replace(&mut probed[shapes.layout_of[il]], true) {
                continue;
            }
            let one = siliceo_kernels_turing::SeqKv {
                sealed: Vec::new(),
                tail: vec![0],
                len: 1,
            };
            let run = [QueryRun {
                tokens: 1,
                kv: &one,
            }];
            kernels
                .graft_step(kv, n_heads, &[(0, 0)], Vec::new(), Vec::new(), &run)
                .map_err(|e| format!("the device kernels cannot serve layer {il}: {e}"))?;
        }
        Ok(DeviceStore {
            kernels,
            layers,
            sources: shapes.sources.to_vec(),
            shape_of: shapes.layout_of.to_vec(),
            steps: (0..shapes.layouts.len()).map(|_| None).collect(),
            host_tensors,
            tuning,
        })
    }

    fn kv(&self, il: usize) -> Result<&DeviceKv<B>, String> {
        self.layers
            .get(il)
            .and_then(Option::as_ref)
            .ok_or_else(|| format!("layer {il} is not on the device"))
    }

    /// A tensor of `[d, tokens, heads]` as the kernels take it, checked to
    /// live where they can read it.
    ///
    /// # Safety
    /// `t` is a live, allocated tensor.
    unsafe fn rows(&self, t: &sys::ggml_tensor, what: &str) -> Result<DeviceRows, String> {
        let f16 = match t.type_ {
            sys::GGML_TYPE_F32 => false,
            sys::GGML_TYPE_F16 => true,
            other => return Err(format!("{what} has type {other}, not f32 or f16")),
        };
        // SAFETY: a live tensor (the caller's contract).
        let bytes = unsafe { sys::ggml_nbytes(t) };
        // SAFETY: as above.
        unsafe { self.check_place(t, what)? };
        Ok(DeviceRows {
            addr: t.data as u64,
            f16,
            nb: [t.nb[0], t.nb[1], t.nb[2]],
            bytes,
        })
    }

    /// # Safety
    /// `t` is a live tensor.
    unsafe fn check_place(&self, t: &sys::ggml_tensor, what: &str) -> Result<(), String> {
        if t.buffer.is_null() || t.data.is_null() {
            return Err(format!("{what} is not allocated"));
        }
        // SAFETY: a non-null buffer of a live tensor.
        let host = unsafe { sys::ggml_backend_buffer_is_host(t.buffer) };
        // SAFETY: a non-null buffer; ggml's names are NUL-terminated.
        let name = unsafe { std::ffi::CStr::from_ptr(sys::ggml_backend_buffer_name(t.buffer)) };
        // The kernels run on device 0: a tensor of another GPU, or split
        // over several ("CUDA_Split"), is not theirs to read.
        if host == self.host_tensors && (host || name.to_bytes() == b"CUDA0") {
            return Ok(());
        }
        Err(format!(
            "{what} is in {} memory ({}), where this layer's store expects {}",
            if host { "host" } else { "device" },
            name.to_string_lossy(),
            if self.host_tensors {
                "host memory (the emulator)"
            } else {
                "GPU 0's (CUDA0)"
            }
        ))
    }
}

#[cfg(any(feature = "cuda-kernels", feature = "cuda-emu"))]
impl<B: Backend> DeviceLayers for DeviceStore<B> {
    fn end_step(&mut self) {
        self.steps.iter_mut().for_each(|s| *s = None);
    }

    unsafe fn layer(
        &mut self,
        il: usize,
        step: &GraftStep,
        n_heads: usize,
        q: &sys::ggml_tensor,
        k: &sys::ggml_tensor,
        v: &sys::ggml_tensor,
        out: &sys::ggml_tensor,
        scale: f32,
        window: usize,
        sinks: Option<&sys::ggml_tensor>,
    ) -> Result<(), String> {
        let err = |e: siliceo_kernels_turing::KernelError| format!("layer {il} on the device: {e}");
        // A layer keeping no KV attends over its source's pools, and writes
        // and seals the step's rows there again: the same values from the
        // same llama.cpp cache, so the pools do not change (each device
        // layer has its own scratch, which no other layer takes over).
        let source = self.sources.get(il).copied().unwrap_or(il);
        let shape = self.shape_of.get(il).copied().unwrap_or(0);
        if self.steps[shape].is_none() {
            let runs: Vec<QueryRun<'_>> = step
                .queries
                .iter()
                .map(|g| QueryRun {
                    tokens: g.tokens.len(),
                    kv: &g.kv,
                })
                .collect();
            let copies = step
                .copies
                .iter()
                .map(|c| (c.src, c.dst, c.rows.clone()))
                .collect();
            let kv = self.kv(source)?;
            self.steps[shape] = Some(
                self.kernels
                    .graft_step_with(
                        kv,
                        n_heads,
                        &step.writes,
                        copies,
                        step.seals.clone(),
                        &runs,
                        &self.tuning,
                    )
                    .map_err(err)?,
            );
        }
        // SAFETY: live tensors of the layer (the caller's contract).
        let (qr, kr, vr) = unsafe { (self.rows(q, "Q")?, self.rows(k, "K")?, self.rows(v, "V")?) };
        // SAFETY: as above.
        unsafe { self.check_place(out, "the attention output")? };
        // SAFETY: as above.
        let span = DeviceSpan {
            addr: out.data as u64,
            bytes: unsafe { sys::ggml_nbytes(out) },
        };
        let sinks = match sinks {
            None => None,
            Some(s) => {
                if s.type_ != sys::GGML_TYPE_F32 || s.ne[0] as usize != n_heads || s.nb[0] != 4 {
                    return Err(format!(
                        "layer {il}: attention sinks of type {} and shape {:?}, expected f32 \
                         [{n_heads}]",
                        s.type_, s.ne
                    ));
                }
                // SAFETY: a live tensor (the caller's contract).
                unsafe { self.check_place(s, "the attention sinks")? };
                Some(DeviceSpan {
                    addr: s.data as u64,
                    bytes: n_heads * 4,
                })
            }
        };
        let dev_step = self.steps[shape].as_ref().expect("uploaded above");
        let kv = self.layers[source].as_mut().expect("checked by kv()");
        self.kernels
            .graft_layer(kv, dev_step, qr, kr, vr, scale, window, sinks, span)
            .map_err(err)
    }

    fn copy_rows(&mut self, copies: &[RowCopy]) -> Result<(), String> {
        for (il, kv) in self.layers.iter_mut().enumerate() {
            let Some(kv) = kv else { continue };
            for c in copies {
                self.kernels
                    .copy_rows(kv, c.src, c.dst, c.rows.clone())
                    .map_err(|e| format!("layer {il}: {e}"))?;
            }
        }
        Ok(())
    }

    fn save(&self, il: usize, blocks: &[StoreBlock], out: &mut Vec<u8>) -> Result<(), String> {
        let kv = self.kv(il)?;
        for &b in blocks {
            let (sealed, i) = match b {
                StoreBlock::Sealed(i) => (true, i),
                StoreBlock::Tail(i) => (false, i),
            };
            out.extend(
                self.kernels
                    .read_block(kv, sealed, i)
                    .map_err(|e| format!("layer {il}: {e}"))?,
            );
        }
        Ok(())
    }

    fn restore(&mut self, il: usize, blocks: &[StoreBlock], bytes: &[u8]) -> Result<usize, String> {
        let kv = self.layers[il]
            .as_mut()
            .ok_or_else(|| format!("layer {il} is not on the device"))?;
        let l = *kv.layout();
        let mut at = 0;
        for &b in blocks {
            let (sealed, i, size) = match b {
                StoreBlock::Sealed(i) => (true, i, l.block_bytes()),
                StoreBlock::Tail(i) => (false, i, l.tail_block_bytes()),
            };
            let src = bytes
                .get(at..at + size)
                .ok_or_else(|| "saved blocks end early".to_string())?;
            self.kernels
                .write_block(kv, sealed, i, src)
                .map_err(|e| format!("layer {il}: {e}"))?;
            at += size;
        }
        Ok(at)
    }

    fn bytes(&self) -> usize {
        self.layers.iter().flatten().map(DeviceKv::bytes).sum()
    }

    fn pools(&self, il: usize) -> Result<(Vec<u8>, Vec<u8>), String> {
        self.kernels
            .download(self.kv(il)?)
            .map_err(|e| format!("layer {il}: {e}"))
    }
}

/// The layers of `candidates` (llama.cpp's offloaded layers, or those a
/// test names) whose store and attention go to the device: each that keeps
/// KV of its own and whose shape the CUDA kernels take
/// ([`siliceo_kernels_turing::device::check_attention`]). The others stay
/// on the host (with a warning per shape); a layer keeping no KV goes where
/// its source's store is, listed or not.
pub(crate) fn device_owners(
    choice: &crate::graft::DeviceAttention,
    candidates: &[usize],
    shapes: Shapes<'_>,
    n_heads: usize,
) -> Vec<usize> {
    let mut warned = vec![false; shapes.layouts.len()];
    let mut owners = Vec::new();
    for &il in candidates {
        if shapes.sources.get(il) != Some(&il) {
            continue;
        }
        let shape = shapes.layout_of[il];
        if *choice == crate::graft::DeviceAttention::Host {
            continue;
        }
        match siliceo_kernels_turing::shapes::check_attention(&shapes.layouts[shape], n_heads) {
            Ok(_) => owners.push(il),
            Err(why) => {
                if !std::mem::replace(&mut warned[shape], true) {
                    tracing::warn!(
                        layer = il,
                        head_dim = shapes.layouts[shape].head_dim,
                        kv_heads = shapes.layouts[shape].kv_heads,
                        "{why}: the offloaded layers of this shape keep their attention on the host"
                    );
                }
            }
        }
    }
    owners
}

/// The device store for `choice` over the layers `on_device`.
pub(crate) fn device_store(
    choice: &crate::graft::DeviceAttention,
    shapes: Shapes<'_>,
    on_device: &[usize],
    pools: (usize, usize),
    n_heads: usize,
) -> Result<Box<dyn DeviceLayers>, String> {
    use crate::graft::DeviceAttention;
    match choice {
        DeviceAttention::Host => Err("no layer's store is on the device".into()),
        DeviceAttention::Cuda => {
            #[cfg(feature = "cuda-kernels")]
            {
                let k = siliceo_kernels_turing::cuda::CudaKernels::new(0).map_err(|e| {
                    format!("{e} (build the kernels with `cargo xtask kernels`, or serve the offloaded layers' attention on the host)")
                })?;
                let store = DeviceStore::new(k, shapes, on_device, pools, n_heads, false)?;
                Ok(Box::new(store))
            }
            #[cfg(not(feature = "cuda-kernels"))]
            {
                let _ = (shapes, on_device, pools, n_heads);
                Err("this build has no CUDA kernels (the engine's `cuda-kernels` feature)".into())
            }
        }
        DeviceAttention::Emulated(_) => {
            #[cfg(feature = "cuda-emu")]
            {
                let k = siliceo_kernels_turing::emu::EmuKernels::emulated();
                let store = DeviceStore::new(k, shapes, on_device, pools, n_heads, true)?;
                Ok(Box::new(store))
            }
            #[cfg(not(feature = "cuda-emu"))]
            {
                let _ = (shapes, on_device, pools, n_heads);
                Err("this build has no CUDA emulator (the engine's `cuda-emu` feature)".into())
            }
        }
    }
}
