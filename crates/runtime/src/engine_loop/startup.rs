//! Start-up: the model, where its KV lives, the draft model, the scheduler.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use crossbeam_channel::{Receiver, Sender};
use siliceo_core::SeqId;
use siliceo_engine::{
    Batch, Context, ContextOptions, DeviceAttention, GraftOptions, GraftedContext, KvFormat, Model,
};
use siliceo_kv_paging::planner::{
    LayerBlocks, StoreInput, StorePlan, StoreSize, StoreSplit, plan_store,
};
use siliceo_kv_paging::{CacheKeys, KvConfig, Sealing, Window, WindowedGroup};
use siliceo_scheduler::Scheduler;

use super::holders::Holders;
use super::kv::{GraftKv, Kv, LlamaKv};
use super::speculative::DraftModel;
use super::{Engine, MaskStats};
use crate::kv_events::KvEventHub;
use crate::{Command, KvBackend, RuntimeConfig, RuntimeError, RuntimeInfo};

/// The store a configuration of ours asks for, for a model whose layers
/// keep `layers` ([`siliceo_core::ModelGeometry::alike_layers`], or each
/// layer's where they differ: [`Model::layer_kv`],
/// `GgufHeader::layer_kv`): the planner's input and the block counts and
/// bytes [`plan_store`] gives — what the store then allocates (checked at
/// start-up), and what `siliceo plan --kv` prints. `branch_blocks` are the
/// open blocks token trees need
/// ([`crate::SpeculativeConfig::tree_branch_blocks`]; 0 without).
///
/// Layers alike are planned as they are; layers that differ (Gemma 4's) as
/// one "layer" whose blocks are all the layers' that keep KV of their own,
/// each in its head size, with a scratch set per head size.
pub fn store_plan(
    layers: &[siliceo_core::LayerKv],
    format: &KvFormat,
    size: StoreSize,
    block_size: u32,
    max_running: u32,
    max_batch_tokens: u32,
    branch_blocks: u32,
) -> Result<(StoreInput, StorePlan), RuntimeError> {
    let first = layers
        .first()
        .ok_or_else(|| RuntimeError::Start("a model without layers".into()))?;
    let layout = format
        .layout(first.kv_heads, first.head_dim)
        .map_err(|e| RuntimeError::Start(e.to_string()))?;
    let f16 = layout.full_precision();
    let (n, open_b, sealed_b, scratch_b) = if siliceo_engine::layers_alike(layers) {
        let mut layout = layout;
        layout.block_tokens = block_size as usize;
        layout
            .check()
            .map_err(|e| RuntimeError::Start(format!("--block-size {block_size}: {e}")))?;
        (
            layers.len() as u32,
            layout.tail_block_bytes() as u64,
            layout.block_bytes() as u64,
            0,
        )
    } else {
        let (layouts, of) = format
            .layer_layouts(layers, block_size as usize)
            .map_err(|e| RuntimeError::Start(format!("--block-size {block_size}: {e}")))?;
        let (mut open, mut sealed) = (0, 0);
        for (il, l) in layers.iter().enumerate() {
            if l.source == il {
                open += layouts[of[il]].tail_block_bytes() as u64;
                sealed += layouts[of[il]].block_bytes() as u64;
            }
        }
        let scratch = layouts.iter().map(|l| l.tail_block_bytes() as u64).sum();
        (1, open, sealed, scratch)
    };
    let input = StoreInput {
        layers: n,
        open_block_bytes: open_b,
        sealed_block_bytes: sealed_b,
        scratch_block_bytes: scratch_b,
        block_size,
        tail_tokens: layout.tail_tokens as u32,
        seals: !f16,
        max_running,
        max_batch_tokens,
        branch_blocks,
        size,
    };
    let plan = plan_store(&input).map_err(|e| RuntimeError::Start(format!("KV store: {e}")))?;
    Ok((input, plan))
}

/// Where `plan`'s bytes live with the store of the layers `on_device`
/// (keeping KV of their own) in device memory: each such layer's pools and
/// a scratch of its own there, the rest in host memory. Layers alike split
/// by the one-layer arithmetic, layers that differ one by one.
pub fn store_split(
    plan: &StorePlan,
    layers: &[siliceo_core::LayerKv],
    format: &KvFormat,
    block_size: u32,
    on_device: &[usize],
) -> Result<StoreSplit, RuntimeError> {
    if siliceo_engine::layers_alike(layers) {
        return Ok(plan.split(layers.len() as u32, on_device.len() as u32));
    }
    let (layouts, of) = format
        .layer_layouts(layers, block_size as usize)
        .map_err(|e| RuntimeError::Start(e.to_string()))?;
    let blocks: Vec<LayerBlocks> = (0..layers.len())
        .filter(|&il| layers[il].source == il)
        .map(|il| LayerBlocks {
            open_block_bytes: layouts[of[il]].tail_block_bytes() as u64,
            sealed_block_bytes: layouts[of[il]].block_bytes() as u64,
            on_device: on_device.contains(&il),
        })
        .collect();
    Ok(plan.split_layers(&blocks))
}

/// The windowed layers' own pools ([`RuntimeConfig::swa_full`] off).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowedPools {
    /// The windowed layers' window, and what kv-paging sizes by.
    pub group: WindowedGroup,
    /// Layers in the global group, and in the windowed one.
    pub layers: (usize, usize),
    /// Bytes of the windowed layers' pools (in host memory).
    pub bytes: u64,
}

/// Whether and how the windowed layers of a model whose layers keep
/// `layers` and see `windows` (0: the whole context) can keep pools of
/// their own: layers alike in shape, one window, some global layers, the
/// store on the host, no token trees (`branch_blocks` 0). Sized by
/// [`WindowedGroup::for_running`]: what the running sequences hold across a
/// step (a window each, a step's appends among them), and cached windows
/// for half as many.
#[allow(clippy::too_many_arguments)]
pub fn windowed_pools(
    layers: &[siliceo_core::LayerKv],
    windows: &[usize],
    format: &KvFormat,
    block_size: u32,
    max_running: u32,
    max_batch_tokens: u32,
    branch_blocks: u32,
    on_host: bool,
) -> Result<Option<WindowedPools>, RuntimeError> {
    let n_windowed = windows.iter().filter(|&&w| w > 0).count();
    let mut ws: Vec<usize> = windows.iter().copied().filter(|&w| w > 0).collect();
    ws.dedup();
    if !on_host
        || branch_blocks > 0
        || ws.len() != 1
        || n_windowed == layers.len()
        || windows.len() != layers.len()
        || !siliceo_engine::layers_alike(layers)
    {
        return Ok(None);
    }
    let window = Window {
        tokens: ws[0] as u32,
        margin: 0,
        max_append: max_batch_tokens,
    };
    let mut layout = format
        .layout(layers[0].kv_heads, layers[0].head_dim)
        .map_err(|e| RuntimeError::Start(e.to_string()))?;
    layout.block_tokens = block_size as usize;
    // Room for every running sequence, and for half as many cached windows.
    let group = WindowedGroup::for_running(
        window,
        max_running.max(1),
        block_size,
        (!layout.full_precision()).then_some(layout.tail_tokens as u32),
        max_running.max(1).div_ceil(2),
    );
    let bytes = n_windowed as u64
        * (u64::from(group.num_blocks) * layout.tail_block_bytes() as u64
            + u64::from(group.sealed_blocks) * layout.block_bytes() as u64);
    Ok(Some(WindowedPools {
        group,
        layers: (layers.len() - n_windowed, n_windowed),
        bytes,
    }))
}

/// The store of our format for a model whose layers keep `layers` and see
/// `windows`: with the windowed layers in pools of their own
/// ([`windowed_pools`]) where that holds more tokens in a budget, or the
/// same tokens in fewer bytes, than keeping every block of every layer
/// (`swa_full`, or what [`store_plan`] plans for all layers). The plan is
/// the global layers' then (or all layers').
#[allow(clippy::too_many_arguments)]
pub fn plan_windowed_store(
    layers: &[siliceo_core::LayerKv],
    windows: &[usize],
    format: &KvFormat,
    size: StoreSize,
    block_size: u32,
    max_running: u32,
    max_batch_tokens: u32,
    branch_blocks: u32,
    on_host: bool,
    swa_full: bool,
) -> Result<(StoreInput, StorePlan, Option<WindowedPools>), RuntimeError> {
    let plan = |layers: &[siliceo_core::LayerKv], size| {
        store_plan(
            layers,
            format,
            size,
            block_size,
            max_running,
            max_batch_tokens,
            branch_blocks,
        )
    };
    let (input, full) = plan(layers, size)?;
    let candidate = if swa_full {
        None
    } else {
        windowed_pools(
            layers,
            windows,
            format,
            block_size,
            max_running,
            max_batch_tokens,
            branch_blocks,
            on_host,
        )?
    };
    let Some(w) = candidate else {
        return Ok((input, full, None));
    };
    let global = &layers[..w.layers.0];
    let better = match size {
        StoreSize::Budget(b) if b > w.bytes => match plan(global, StoreSize::Budget(b - w.bytes)) {
            Ok((gi, gp)) => (gp.tokens > full.tokens).then_some((gi, gp)),
            Err(_) => None,
        },
        StoreSize::Budget(_) => None,
        StoreSize::Tokens(_) => {
            let (gi, gp) = plan(global, size)?;
            (gp.bytes + w.bytes < full.bytes).then_some((gi, gp))
        }
    };
    Ok(match better {
        Some((gi, gp)) => (gi, gp, Some(w)),
        None => (input, full, None),
    })
}

/// Block size, most running sequences and most tokens per step, as the
/// engine clamps a configuration's (llama.cpp allows 256 sequence ids;
/// holders take some on its own cache).
fn step_limits(cfg: &RuntimeConfig) -> (u32, u32, u32) {
    let n_batch = cfg.context.n_batch.max(1);
    (
        cfg.block_size.max(1),
        cfg.scheduler.max_running_seqs.clamp(1, 256) as u32,
        (cfg.scheduler.max_batch_tokens as u32).clamp(1, n_batch),
    )
}

/// [`plan_windowed_store`] for a runtime configuration serving our store in
/// `format` (sized by `size`, else the context), for a model whose layers
/// keep `layers` and see `windows` (empty: planned all alike).
fn our_store_plan(
    cfg: &RuntimeConfig,
    layers: &[siliceo_engine::LayerKv],
    windows: &[usize],
    format: &KvFormat,
    size: Option<StoreSize>,
    on_host: bool,
) -> Result<(StoreInput, StorePlan, Option<WindowedPools>), RuntimeError> {
    let (bs, max_running, max_batch_tokens) = step_limits(cfg);
    let branch = cfg
        .speculative
        .as_ref()
        .map_or(0, |s| s.tree_branch_blocks(bs, max_running));
    plan_windowed_store(
        layers,
        windows,
        format,
        size.unwrap_or(StoreSize::Tokens(u64::from(cfg.context.n_ctx))),
        bs,
        max_running,
        max_batch_tokens,
        branch,
        on_host,
        cfg.swa_full,
    )
}

/// With layers offloaded to a GPU: what they take there (weights, llama.cpp's
/// KV of those layers, compute buffers) must leave the margin free, or the
/// runtime refuses to start. Nothing to check without a GPU.
fn check_offload(cfg: &RuntimeConfig) -> Result<(), RuntimeError> {
    if cfg.model.gpu_layers == 0 {
        return Ok(());
    }
    let Some((free, total)) = siliceo_engine::gpu_memory() else {
        return Ok(());
    };
    let fail =
        |e: String| RuntimeError::Start(format!("--gpu-layers {}: {e}", cfg.model.gpu_layers));
    let header = crate::read_gguf_header(&cfg.model_path).map_err(fail)?;
    let g = header.geometry().map_err(|e| fail(e.to_string()))?;
    let mut layers = vec![0u64; g.n_layer as usize];
    let mut output = 0u64;
    for t in &header.tensors {
        let bytes = t.bytes().unwrap_or(0);
        let layer = t
            .name
            .strip_prefix("blk.")
            .and_then(|r| r.split('.').next()?.parse::<usize>().ok());
        match layer {
            Some(l) if l < layers.len() => layers[l] += bytes,
            _ if t.name.starts_with("output") => output += bytes,
            _ => {}
        }
    }
    if !header.tensors.iter().any(|t| t.name == "output.weight") {
        // Tied embeddings: llama.cpp puts a copy of token_embd on the output
        // layer's device.
        output += header
            .tensors
            .iter()
            .filter(|t| t.name == "token_embd.weight")
            .filter_map(|t| t.bytes())
            .sum::<u64>();
    }
    // llama.cpp's own cache sits with its layers (counted as the layers'
    // average: Gemma 4's last layers keep none, and its windowed layers'
    // cache is smaller, so this errs high); our store too where this build
    // serves offloaded layers with the CUDA kernels (each such layer's pools
    // and its own scratch, shared evenly over the offloaded layers; layers
    // whose heads the kernels lack stay in host memory), else in host
    // memory.
    let layer_kv = header.layer_kv().map_err(|e| fail(e.to_string()))?;
    let (kv_per_layer, store_per_layer) = match &cfg.kv {
        KvBackend::Llama => {
            let (k, v) = (cfg.context.type_k, cfg.context.type_v);
            let mut bytes = 0u64;
            for (il, l) in layer_kv.iter().enumerate() {
                let row = (l.kv_heads * l.head_dim) as u64;
                if l.source == il {
                    bytes += k
                        .row_bytes(row)
                        .zip(v.row_bytes(row))
                        .map(|(k, v)| k + v)
                        .ok_or_else(|| {
                            fail(format!(
                                "layer {il}: a row of {row} is not whole blocks of {k:?}/{v:?}"
                            ))
                        })?;
                }
            }
            (bytes as f64 / f64::from(g.n_layer.max(1)), 0)
        }
        KvBackend::Ours { format, size, .. } if siliceo_engine::DEVICE_KERNELS => {
            let (_, plan, _) = our_store_plan(cfg, &layer_kv, &[], format, *size, false)?;
            let offloaded =
                siliceo_core::offloaded_layers(g.n_layer as usize, cfg.model.gpu_layers as usize);
            let n = offloaded.len().max(1) as u64;
            let on_device = siliceo_engine::device_store_layers(
                &layer_kv,
                format,
                cfg.block_size.max(1) as usize,
                g.n_head as usize,
                offloaded,
            )
            .map_err(|e| fail(e.to_string()))?;
            let split = store_split(&plan, &layer_kv, format, cfg.block_size.max(1), &on_device)?;
            // The offloaded layers' share, evenly.
            (0.0, split.device_bytes.div_ceil(n))
        }
        KvBackend::Ours { .. } => (0.0, 0),
    };
    // Compute buffers: logits and activations of one micro-batch (an
    // estimate: llama.cpp sizes them when the context is made).
    let ubatch = u64::from(cfg.context.n_ubatch.max(1));
    let reserve = ubatch * (u64::from(g.n_vocab) + 16 * u64::from(g.n_embd)) * 4 + (64 << 20);
    let plan =
        siliceo_kv_paging::planner::plan_offload(&siliceo_kv_paging::planner::OffloadInput {
            layer_weight_bytes: layers,
            output_weight_bytes: output,
            gpu_layers: cfg.model.gpu_layers,
            kv_bytes_per_token_per_layer: kv_per_layer,
            store_bytes_per_layer: store_per_layer,
            kv_tokens: u64::from(cfg.context.n_ctx),
            compute_reserve_bytes: reserve,
            safety_margin: siliceo_kv_paging::planner::DEFAULT_SAFETY_MARGIN,
            free_bytes: free,
            total_bytes: total,
        })
        .map_err(|e| fail(e.to_string()))?;
    tracing::info!(
        layers = plan.layers,
        output = plan.output,
        needed = plan.needed_bytes,
        left = plan.left_bytes,
        "offload fits the GPU"
    );
    Ok(())
}

pub(crate) fn run(
    cfg: RuntimeConfig,
    rx: Receiver<Command>,
    ready: Sender<Result<Started, RuntimeError>>,
) {
    if let Err(e) = check_offload(&cfg) {
        let _ = ready.send(Err(e));
        return;
    }
    let model = match Model::load(&cfg.model_path, &cfg.model) {
        Ok(m) => m,
        Err(e) => {
            let _ = ready.send(Err(RuntimeError::Start(e.to_string())));
            return;
        }
    };
    // The draft model, when configured: same vocabulary as the target.
    let draft_path = cfg
        .speculative
        .as_ref()
        .and_then(|c| c.draft_model.as_ref());
    let draft = match draft_path {
        None => None,
        Some(path) => match Model::load(path, &cfg.model).and_then(|d| {
            model.check_draft_compatible(&d)?;
            Ok(d)
        }) {
            Ok(d) => Some(d),
            Err(e) => {
                let _ = ready.send(Err(RuntimeError::Start(format!(
                    "draft model {}: {e}",
                    path.display()
                ))));
                return;
            }
        },
    };
    // Shared with the runtime's request layer, which templates and
    // tokenizes on the submitting threads (llama.cpp's tokenizer only reads
    // the vocabulary).
    let model = Arc::new(model);
    match Engine::start(&model, draft.as_ref(), &cfg) {
        Ok((mut engine, info)) => {
            tracing::info!(
                kv = %info.kv_format,
                max_seq_len = engine.max_seq_len,
                blocks = info.kv_blocks,
                block_size = engine.block_size,
                "engine ready"
            );
            let _ = ready.send(Ok(Started {
                info,
                model: model.clone(),
                kv_events: engine.kv_events.clone(),
            }));
            engine.serve(&rx);
        }
        Err(e) => {
            let _ = ready.send(Err(e));
        }
    }
}

/// What the engine thread hands the [`crate::Runtime`] once it is ready.
pub(crate) struct Started {
    pub(crate) info: RuntimeInfo,
    pub(crate) model: Arc<Model>,
    pub(crate) kv_events: Arc<KvEventHub>,
}

impl<'m> Engine<'m> {
    /// Builds the engine over a loaded model.
    fn start(
        model: &'m Model,
        draft: Option<&'m Model>,
        cfg: &RuntimeConfig,
    ) -> Result<(Engine<'m>, RuntimeInfo), RuntimeError> {
        let start = |e: siliceo_engine::EngineError| RuntimeError::Start(e.to_string());
        let (bs, max_running, max_batch_tokens) = step_limits(cfg);
        let n_batch = cfg.context.n_batch.max(1);
        let mut pools_kept = None;
        let (kv, kv_config, max_seq_len, kv_format, store, store_split) = match &cfg.kv {
            KvBackend::Llama => {
                let n_holders = if cfg.prefix_caching {
                    cfg.prefix_holders.min(256 - max_running)
                } else {
                    0
                };
                let mut opts = cfg.context.clone();
                opts.n_seq_max = max_running + n_holders;
                let ctx = Context::new(model, opts).map_err(start)?;
                let n_ctx = ctx.n_ctx();
                // Blocks cover the context's cells, less one block of slack
                // for where llama.cpp places a batch.
                let num_blocks = (n_ctx / bs).saturating_sub(1).max(1);
                let kv_config = KvConfig {
                    num_blocks,
                    block_size: bs,
                    prefix_caching: n_holders > 0,
                    sealing: None,
                    cache_partial: false,
                    window: None,
                    windowed: None,
                };
                let format = format!("{}/{}", cfg.context.type_k, cfg.context.type_v);
                let kv = Kv::Llama(LlamaKv {
                    ctx,
                    holders: Holders::new(max_running, n_holders),
                });
                (kv, kv_config, n_ctx as usize, format, None, None)
            }
            KvBackend::Ours {
                format,
                size,
                kernel_threads,
            } => {
                // Per layer where the layers' KV differ (Gemma 4's).
                let layer_kv = model
                    .layer_kv()
                    .unwrap_or_else(|| model.geometry().alike_layers());
                let device = cfg
                    .device_attention
                    .clone()
                    .unwrap_or_else(|| DeviceAttention::for_model(model));
                let on_host = device == DeviceAttention::Host
                    || (device == DeviceAttention::Cuda && model.offloaded_layers().is_empty());
                let (input, plan, windowed) = our_store_plan(
                    cfg,
                    &layer_kv,
                    &model.attention_windows().unwrap_or_default(),
                    format,
                    *size,
                    on_host,
                )?;
                // The plan is the global layers' where the windowed ones
                // keep pools of their own.
                let global_layers = &layer_kv[..windowed.map_or(layer_kv.len(), |w| w.layers.0)];
                pools_kept = windowed;
                if let Some(w) = windowed {
                    tracing::info!(
                        window = w.group.window.tokens,
                        windowed_layers = w.layers.1,
                        open_blocks = w.group.num_blocks,
                        sealed_blocks = w.group.sealed_blocks,
                        bytes = w.bytes,
                        "the windowed layers keep pools of their own (--swa-full keeps all blocks)"
                    );
                }
                let ctx = GraftedContext::new(
                    model,
                    &GraftOptions {
                        format: format.clone(),
                        block_tokens: bs as usize,
                        sealed_blocks: plan.sealed_blocks as usize,
                        tail_blocks: (plan.open_blocks + plan.branch_blocks) as usize,
                        scratch_blocks: plan.scratch_blocks as usize,
                        n_batch,
                        max_seqs: max_running,
                        threads: cfg.context.n_threads,
                        kernel_threads: *kernel_threads,
                        copy_tensors: false,
                        device,
                        tap_layer: None,
                        llama_attention: false,
                        q4_1_kernel: true,
                        windows: None,
                        windowed_blocks: windowed
                            .map(|w| (w.group.sealed_blocks as usize, w.group.num_blocks as usize)),
                    },
                )
                .map_err(start)?;
                // Each layer on the device has its own scratch blocks.
                let device_layers = ctx.device_layers() as u32;
                let on_device: Vec<usize> = (0..layer_kv.len())
                    .filter(|&il| ctx.kv_source(il) == il && ctx.layer(il).is_none())
                    .collect();
                let mut split = store_split(&plan, global_layers, format, bs, &on_device)?;
                split.host_bytes += windowed.map_or(0, |w| w.bytes);
                let (host, device) = (ctx.host_store_bytes(), ctx.device_store_bytes());
                if (host as u64, device as u64) != (split.host_bytes, split.device_bytes) {
                    return Err(RuntimeError::Start(format!(
                        "the store allocated {host} bytes in host memory and {device} in device \
                         memory, the plan says {} and {}",
                        split.host_bytes, split.device_bytes
                    )));
                }
                if device_layers > 0 {
                    tracing::info!(
                        layers = device_layers,
                        device_bytes = ctx.device_store_bytes(),
                        host_bytes = ctx.host_store_bytes(),
                        "grafted attention on the GPU for the offloaded layers"
                    );
                }
                let kv_config = KvConfig {
                    num_blocks: plan.open_blocks,
                    block_size: bs,
                    prefix_caching: cfg.prefix_caching,
                    sealing: input.seals.then_some(Sealing {
                        blocks: plan.sealed_blocks,
                        tail_tokens: input.tail_tokens,
                    }),
                    cache_partial: cfg.prefix_caching,
                    window: None,
                    windowed: windowed.map(|w| w.group),
                };
                let kv = Kv::Graft(GraftKv::new(ctx, plan, &kv_config));
                (
                    kv,
                    kv_config,
                    plan.tokens as usize,
                    format.name(),
                    Some(plan),
                    Some(split),
                )
            }
        };
        let max_seq_len = max_seq_len.min(cfg.scheduler.max_seq_len);
        // The draft model's own context, a sequence per running request.
        let draft = match draft {
            None => None,
            Some(d) => {
                let dopts = ContextOptions {
                    n_ctx: (max_seq_len as u32).next_multiple_of(256),
                    n_seq_max: max_running,
                    ..cfg.context.clone()
                };
                let ctx = Context::new(d, dopts)
                    .map_err(|e| RuntimeError::Start(format!("draft context: {e}")))?;
                Some(DraftModel { ctx })
            }
        };
        let mut sched_cfg = cfg.scheduler;
        sched_cfg.max_batch_tokens = max_batch_tokens as usize;
        sched_cfg.max_seq_len = max_seq_len;
        sched_cfg.max_running_seqs = max_running as usize;
        let sched = Scheduler::new(sched_cfg, kv_config);
        let info = RuntimeInfo {
            model_path: cfg.model_path.clone(),
            model_name: model.name().to_string(),
            architecture: model.architecture().to_string(),
            geometry: model.geometry(),
            gpu_layers: model.offloaded_layers().len() as u32,
            n_ctx: max_seq_len as u32,
            type_k: cfg.context.type_k,
            type_v: cfg.context.type_v,
            kv_backend: match cfg.kv {
                KvBackend::Llama => "llama",
                KvBackend::Ours { .. } => "ours",
            },
            kv_format: kv_format.clone(),
            store,
            store_split,
            block_size: bs,
            // The global group's: the windowed layers' own are in `windowed_pools`.
            kv_blocks: sched.kv().global().capacity().total() as u32,
            max_running_seqs: max_running,
            prefix_caching: kv_config.prefix_caching,
            speculative: cfg.speculative.clone(),
            attention_windows: model.attention_windows().unwrap_or_default(),
            windowed_pools: pools_kept,
        };
        let engine = Engine {
            model,
            kv,
            free_seqs: (0..max_running).rev().map(SeqId).collect(),
            max_running,
            max_seq_len,
            block_size: bs,
            speculative: cfg.speculative.clone(),
            draft,
            sched,
            keys: CacheKeys::new(model.path().display().to_string(), kv_format),
            live: HashMap::new(),
            epoch: Instant::now(),
            batch: Batch::new(),
            steps: 0,
            step_us: 0,
            decode_us: 0,
            panics: 0,
            tree_verifications: 0,
            tree_later_branches_kept: 0,
            spec_cost_pauses: 0,
            constraint_overlap: cfg.constraint_overlap,
            mask_stats: MaskStats::default(),
            draft_memory: siliceo_speculative::DraftCostMemory::default(),
            kv_events: Arc::new(KvEventHub::new()),
        };
        Ok((engine, info))
    }
}
