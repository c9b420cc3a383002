//! The memory planner: what a memory budget holds once the weights are in.
//!
//! Arithmetic, stated once. For one model with `L` layers, `H` KV heads and
//! head dimensions `Dk`, `Dv`, a token's KV costs
//! `L × H × (bytes(Dk in K format) + bytes(Dv in V format))` — every layer
//! stores one K row and one V row of `H × D` elements per token. A block of `B`
//! tokens costs `B ×` that. The budget is split as
//!
//! ```text
//! usable  = budget × (1 − margin)
//! kv      = usable − weights − compute reserve − (draft weights)
//! tails   = sequences × min(tail, context) × f16 bytes per token
//! blocks  = ⌊(kv − tails) / (block bytes of the target + block bytes of the draft)⌋
//! ```
//!
//! A full-precision tail keeps each sequence's newest `tail` tokens in f16
//! outside the quantized blocks; a draft model (speculative decoding) keeps its
//! own KV for the same tokens, so its per-token bytes join the target's.

use serde::Serialize;
use siliceo_core::{KvType, LayerKv, ModelGeometry};

/// A KV element format: one of llama.cpp's types or one of ours.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(into = "String")]
pub enum KvFormat {
    /// A llama.cpp cache type.
    Llama(KvType),
    /// Ours: int8 per element, one f16 scale per token per group of 32
    /// elements (8 + 16/32 = 8.5 bits; `siliceo-kernels-turing`'s default KV8,
    /// measured better than one scale per head on keys with outlier channels).
    Kv8,
    /// Ours, keys: 5-bit per element, per-channel f16 scale and minimum over the
    /// tokens of a 64-token block (5 + 32/64 = 5.5 bits).
    K5,
    /// Ours, values: 4-bit per element, f16 scale and minimum per group of 32
    /// elements of a token (4 + 32/32 = 5 bits).
    V4,
}

impl From<KvFormat> for String {
    fn from(f: KvFormat) -> String {
        f.name().to_owned()
    }
}

impl KvFormat {
    /// Name as written on the command line.
    pub fn name(self) -> &'static str {
        match self {
            KvFormat::Llama(t) => t.name(),
            KvFormat::Kv8 => "kv8",
            KvFormat::K5 => "k5",
            KvFormat::V4 => "v4",
        }
    }

    /// Parses `f16`, `q8_0`, …, `kv8`, `k5`, `v4`.
    pub fn parse(s: &str) -> Result<KvFormat, siliceo_core::Error> {
        match s.trim().to_ascii_lowercase().as_str() {
            "kv8" => Ok(KvFormat::Kv8),
            "k5" => Ok(KvFormat::K5),
            "v4" => Ok(KvFormat::V4),
            other => other.parse::<KvType>().map(KvFormat::Llama),
        }
    }

    /// Bytes of one head row of `dim` elements for one token (block-level
    /// metadata of K5 amortised over the block's 64 tokens). `None` when the
    /// row is not a whole number of the format's groups.
    pub fn row_bytes(self, dim: u64) -> Option<f64> {
        match self {
            KvFormat::Llama(t) => t.row_bytes(dim).map(|b| b as f64),
            KvFormat::Kv8 => dim
                .is_multiple_of(32)
                .then_some(dim as f64 + (dim / 32) as f64 * 2.0),
            KvFormat::K5 => Some(dim as f64 * 5.0 / 8.0 + dim as f64 * 4.0 / 64.0),
            KvFormat::V4 => dim
                .is_multiple_of(32)
                .then(|| dim as f64 / 2.0 + (dim / 32) as f64 * 4.0),
        }
    }

    /// Average bits per element for rows of `dim` elements.
    pub fn bits_per_element(self, dim: u64) -> Option<f64> {
        self.row_bytes(dim).map(|b| b * 8.0 / dim as f64)
    }
}

/// What to plan for.
#[derive(Debug, Clone)]
pub struct PlanInput {
    /// The target model's geometry.
    pub geometry: ModelGeometry,
    /// Bytes of its weights.
    pub weight_bytes: u64,
    /// Total memory available (e.g. VRAM).
    pub budget_bytes: u64,
    /// K format.
    pub k: KvFormat,
    /// V format.
    pub v: KvFormat,
    /// Newest tokens per sequence kept in f16 (0 = none).
    pub tail_tokens: u32,
    /// Tokens per block.
    pub block_size: u32,
    /// Fraction of the budget kept free (allocator slack, fragmentation); must
    /// be positive. Default 0.05.
    pub safety_margin: f64,
    /// Bytes reserved for compute buffers (activations, logits).
    pub compute_reserve_bytes: u64,
    /// Sequences whose f16 tails are reserved when counting blocks.
    pub sequences: u32,
    /// A draft model sharing the budget: its geometry, weights and K/V formats.
    pub draft: Option<DraftInput>,
    /// Each layer's KV where the layers differ (Gemma 4's: heads of two
    /// sizes, layers without KV of their own; K and V heads one size);
    /// empty: `geometry`'s layers, alike.
    pub layers: Vec<LayerKv>,
}

/// A draft model that shares the budget.
#[derive(Debug, Clone)]
pub struct DraftInput {
    /// Its geometry.
    pub geometry: ModelGeometry,
    /// Bytes of its weights.
    pub weight_bytes: u64,
    /// Its K format.
    pub k: KvFormat,
    /// Its V format.
    pub v: KvFormat,
}

impl PlanInput {
    /// Tokens per sequence held in f16: `tail_tokens` for llama.cpp's types;
    /// for ours, whole blocks holding `tail_tokens` plus the newest, partial
    /// block (a block is quantized only when full: K5's per-channel scales
    /// need all its tokens).
    pub fn f16_tail_tokens(&self) -> u32 {
        let ours = |f: KvFormat| !matches!(f, KvFormat::Llama(_));
        if ours(self.k) || ours(self.v) {
            (self.tail_tokens + self.block_size).div_ceil(self.block_size.max(1)) * self.block_size
        } else {
            self.tail_tokens
        }
    }

    /// A plan input with defaults: f16 K and V, no tail, 64-token blocks, 5 %
    /// margin, 256 MiB compute reserve, one sequence, no draft.
    pub fn new(geometry: ModelGeometry, weight_bytes: u64, budget_bytes: u64) -> Self {
        PlanInput {
            geometry,
            weight_bytes,
            budget_bytes,
            k: KvFormat::Llama(KvType::F16),
            v: KvFormat::Llama(KvType::F16),
            tail_tokens: 0,
            block_size: 64,
            safety_margin: DEFAULT_SAFETY_MARGIN,
            compute_reserve_bytes: 256 << 20,
            sequences: 1,
            draft: None,
            layers: Vec::new(),
        }
    }
}

/// Why a configuration cannot work.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum PlanError {
    /// The weights (and reserve) alone exceed the usable budget.
    #[error(
        "the weights do not fit: {weights} B of weights + {reserve} B compute reserve > {usable} B usable ({budget} B budget less a {margin_pct:.1} % safety margin)"
    )]
    WeightsDoNotFit {
        /// Weight bytes (target plus draft).
        weights: u64,
        /// Compute reserve.
        reserve: u64,
        /// Usable bytes.
        usable: u64,
        /// The budget.
        budget: u64,
        /// Margin in percent.
        margin_pct: f64,
    },
    /// Not a single block fits after the weights and tails.
    #[error("no room for the KV cache: {kv_bytes} B left for KV, one block needs {block_bytes} B")]
    NoRoomForKv {
        /// Bytes left for KV.
        kv_bytes: u64,
        /// Bytes per block.
        block_bytes: u64,
    },
    /// The open blocks the running sequences need do not fit the budget.
    #[error(
        "the open (full-precision) blocks of {running} running sequences take {open_bytes} B, more than the {budget} B budget: raise the budget or lower the running sequences"
    )]
    OpenPoolDoesNotFit {
        /// Bytes of the open pool and scratch.
        open_bytes: u64,
        /// The budget.
        budget: u64,
        /// Running sequences it is sized for.
        running: u32,
    },
    /// A format does not divide the model's head dimension.
    #[error("{format} cannot store rows of {dim} elements")]
    FormatDoesNotFit {
        /// The format.
        format: &'static str,
        /// The head dimension.
        dim: u32,
    },
    /// What `--gpu-layers` puts on the device leaves less than the margin
    /// free.
    #[error(
        "offloading does not fit the GPU: {weights} B of weights + {kv} B of KV + {reserve} B compute reserve = {needed} B, and the device has {free} B free of {total} B; {margin} B ({margin_pct:.0} % of it) stay free: offload fewer layers or shorten the context"
    )]
    OffloadDoesNotFit {
        /// Offloaded weight bytes.
        weights: u64,
        /// KV bytes of the offloaded layers.
        kv: u64,
        /// Compute-buffer reserve.
        reserve: u64,
        /// Their sum.
        needed: u64,
        /// Free device memory.
        free: u64,
        /// Device memory in all.
        total: u64,
        /// Bytes kept free.
        margin: u64,
        /// The margin in percent of `total`.
        margin_pct: f64,
    },
    /// An input out of range.
    #[error("invalid plan input `{field}`: {reason}")]
    Invalid {
        /// Field.
        field: &'static str,
        /// Why.
        reason: String,
    },
}

/// What fits.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Plan {
    /// K bytes per token (all layers).
    pub k_bytes_per_token: f64,
    /// V bytes per token (all layers).
    pub v_bytes_per_token: f64,
    /// K bytes per block.
    pub k_bytes_per_block: f64,
    /// V bytes per block.
    pub v_bytes_per_block: f64,
    /// Draft model's K+V bytes per token (0 without a draft).
    pub draft_bytes_per_token: f64,
    /// f16 K+V bytes per tail token.
    pub tail_bytes_per_token: f64,
    /// Average bits per KV element (K and V together).
    pub bits_per_element: f64,
    /// Budget less the safety margin.
    pub usable_bytes: u64,
    /// Weights (target plus draft).
    pub weight_bytes: u64,
    /// Compute reserve.
    pub compute_reserve_bytes: u64,
    /// Bytes left for KV (blocks and tails).
    pub kv_bytes: u64,
    /// Bytes reserved for the f16 tails of `sequences` sequences.
    pub tail_reserve_bytes: u64,
    /// Blocks that fit.
    pub num_blocks: u64,
    /// Tokens those blocks hold.
    pub block_tokens: u64,
    /// Longest context of one sequence (blocks plus its tail).
    pub max_context_one_sequence: u64,
    /// The model's trained context (contexts past it need RoPE scaling).
    pub n_ctx_train: u32,
}

impl Plan {
    /// Sequences of `context` tokens each that fit at once.
    pub fn max_sequences_at(&self, input: &PlanInput, context: u64) -> u64 {
        let bs = u64::from(input.block_size);
        let tail = context.min(u64::from(input.f16_tail_tokens()));
        let per_seq = (context - tail).div_ceil(bs) as f64
            * (self.k_bytes_per_block
                + self.v_bytes_per_block
                + self.draft_bytes_per_token * bs as f64)
            + tail as f64 * (self.tail_bytes_per_token + self.draft_bytes_per_token);
        if per_seq <= 0.0 {
            return 0;
        }
        (self.kv_bytes as f64 / per_seq).floor() as u64
    }
}

fn per_token(
    g: &ModelGeometry,
    layers: &[LayerKv],
    k: KvFormat,
    v: KvFormat,
) -> Result<PerToken, PlanError> {
    // (KV heads, K head size, V head size) of each layer keeping KV, or of
    // all layers at once where they are alike.
    let rows: Vec<(u64, u32, u32)> = if layers.is_empty() {
        vec![(
            u64::from(g.n_head_kv) * u64::from(g.n_layer),
            g.head_dim_k,
            g.head_dim_v,
        )]
    } else {
        layers
            .iter()
            .enumerate()
            .filter(|&(il, l)| l.source == il)
            .map(|(_, l)| (l.kv_heads as u64, l.head_dim as u32, l.head_dim as u32))
            .collect()
    };
    let mut t = PerToken::default();
    for (heads, dk, dv) in rows {
        let bytes = |f: KvFormat, dim: u32| {
            f.row_bytes(u64::from(dim))
                .ok_or(PlanError::FormatDoesNotFit {
                    format: f.name(),
                    dim,
                })
        };
        t.k += bytes(k, dk)? * heads as f64;
        t.v += bytes(v, dv)? * heads as f64;
        t.elems += (heads * u64::from(dk + dv)) as f64;
    }
    Ok(t)
}

/// Bytes of K and of V per token, and elements of both.
#[derive(Default)]
struct PerToken {
    k: f64,
    v: f64,
    elems: f64,
}

/// Plans `input`, or says why it cannot fit.
pub fn plan(input: &PlanInput) -> Result<Plan, PlanError> {
    if !(input.safety_margin > 0.0 && input.safety_margin < 0.5) {
        return Err(PlanError::Invalid {
            field: "safety_margin",
            reason: format!("must be in (0, 0.5), got {}", input.safety_margin),
        });
    }
    if input.block_size == 0 {
        return Err(PlanError::Invalid {
            field: "block_size",
            reason: "must be at least 1".into(),
        });
    }
    let g = &input.geometry;
    let target = per_token(g, &input.layers, input.k, input.v)?;
    let (kpt, vpt) = (target.k, target.v);
    let f16 = KvFormat::Llama(KvType::F16);
    let tail = per_token(g, &input.layers, f16, f16)?;
    let (tk, tv) = (tail.k, tail.v);
    let draft_bpt = match &input.draft {
        Some(d) => {
            let t = per_token(&d.geometry, &[], d.k, d.v)?;
            t.k + t.v
        }
        None => 0.0,
    };
    let weights = input.weight_bytes + input.draft.as_ref().map_or(0, |d| d.weight_bytes);
    let usable = (input.budget_bytes as f64 * (1.0 - input.safety_margin)).floor() as u64;
    let fixed = weights + input.compute_reserve_bytes;
    if fixed >= usable {
        return Err(PlanError::WeightsDoNotFit {
            weights,
            reserve: input.compute_reserve_bytes,
            usable,
            budget: input.budget_bytes,
            margin_pct: input.safety_margin * 100.0,
        });
    }
    let kv = usable - fixed;
    let bs = f64::from(input.block_size);
    let tail_bpt = tk + tv;
    let tail_tokens = input.f16_tail_tokens();
    let tail_reserve =
        (f64::from(input.sequences) * f64::from(tail_tokens) * (tail_bpt + draft_bpt)).ceil()
            as u64;
    let block_bytes = bs * (kpt + vpt + draft_bpt);
    let for_blocks = kv.saturating_sub(tail_reserve);
    let num_blocks = (for_blocks as f64 / block_bytes).floor() as u64;
    if num_blocks == 0 {
        return Err(PlanError::NoRoomForKv {
            kv_bytes: for_blocks,
            block_bytes: block_bytes.ceil() as u64,
        });
    }
    let one_tail = (f64::from(tail_tokens) * (tail_bpt + draft_bpt)).ceil() as u64;
    let blocks_one = (kv.saturating_sub(one_tail) as f64 / block_bytes).floor() as u64;
    Ok(Plan {
        k_bytes_per_token: kpt,
        v_bytes_per_token: vpt,
        k_bytes_per_block: kpt * bs,
        v_bytes_per_block: vpt * bs,
        draft_bytes_per_token: draft_bpt,
        tail_bytes_per_token: tail_bpt,
        bits_per_element: (kpt + vpt) * 8.0 / target.elems,
        usable_bytes: usable,
        weight_bytes: weights,
        compute_reserve_bytes: input.compute_reserve_bytes,
        kv_bytes: kv,
        tail_reserve_bytes: tail_reserve,
        num_blocks,
        block_tokens: num_blocks * u64::from(input.block_size),
        max_context_one_sequence: blocks_one * u64::from(input.block_size) + u64::from(tail_tokens),
        n_ctx_train: g.n_ctx_train,
    })
}

/// How big to make a paged store of our own formats (grafted serving).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum StoreSize {
    /// As many sealed blocks as fit in this many bytes (all layers, every
    /// pool included).
    Budget(u64),
    /// Room for this many tokens of context in sealed blocks (or in open
    /// blocks, for a format that never seals), shared by all sequences.
    Tokens(u64),
}

/// What a paged store is made of: per-layer block sizes (from the store's
/// layout) and the serving limits that size its open pool.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct StoreInput {
    /// Layers (each holds every block).
    pub layers: u32,
    /// Bytes of one open (full-precision) block of one layer.
    pub open_block_bytes: u64,
    /// Bytes of one sealed block of one layer.
    pub sealed_block_bytes: u64,
    /// Bytes of one scratch block (0: an open block of one layer; a store
    /// whose layers differ in head size keeps a scratch set per size).
    pub scratch_block_bytes: u64,
    /// Tokens per block.
    pub block_size: u32,
    /// Newest tokens kept open beyond the partial block.
    pub tail_tokens: u32,
    /// Whether full blocks are sealed (a full-precision format never is).
    pub seals: bool,
    /// Most sequences running at once.
    pub max_running: u32,
    /// Most tokens one step computes.
    pub max_batch_tokens: u32,
    /// Open blocks for the branches of speculative token trees (a step's
    /// second and later branches write their K/V there; 0 without trees).
    pub branch_blocks: u32,
    /// The size asked for.
    pub size: StoreSize,
}

/// The store a [`StoreInput`] gives: block counts per pool and the bytes
/// they take, which is what the store allocates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct StorePlan {
    /// Open blocks kv-paging allocates (tails, partial blocks, copies, and
    /// room to cache partial blocks).
    pub open_blocks: u32,
    /// Sealed blocks (0 for a format that never seals).
    pub sealed_blocks: u32,
    /// Open blocks of one layer beside those, as per-step scratch for blocks
    /// filled and sealed within one step (their rows live only while a
    /// layer is computed, so the layers share one set).
    pub scratch_blocks: u32,
    /// Open blocks after the scratch, for a step's token-tree branches.
    pub branch_blocks: u32,
    /// Bytes of all pools, all layers.
    pub bytes: u64,
    /// Tokens of context the blocks hold (sealed blocks, or open blocks for
    /// a format that never seals).
    pub tokens: u64,
    /// Bytes of one open block, all layers.
    pub open_block_bytes: u64,
    /// Bytes of the scratch (one layer's blocks).
    pub scratch_bytes: u64,
    /// Bytes of one sealed block, all layers (0 for a format that never seals).
    pub sealed_block_bytes: u64,
}

/// Where a [`StorePlan`]'s bytes live when some layers' attention runs on a
/// GPU (grafted attention on the device): each such layer holds its pools
/// and a scratch of its own in device memory; the others, and one shared
/// scratch, stay in host memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct StoreSplit {
    /// Layers whose store is in device memory.
    pub device_layers: u32,
    /// Bytes in device memory.
    pub device_bytes: u64,
    /// Bytes in host memory.
    pub host_bytes: u64,
}

/// One layer keeping KV, for [`StorePlan::split_layers`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerBlocks {
    /// Bytes of one of its open blocks.
    pub open_block_bytes: u64,
    /// Bytes of one of its sealed blocks.
    pub sealed_block_bytes: u64,
    /// Its store is in device memory.
    pub on_device: bool,
}

impl StoreSplit {
    /// Both memories together.
    pub fn total(&self) -> u64 {
        self.device_bytes + self.host_bytes
    }
}

impl StorePlan {
    /// One layer's pools (sealed and open blocks, without the scratch).
    pub fn pool_bytes_per_layer(&self, n_layer: u32) -> u64 {
        (self.bytes - self.scratch_bytes) / u64::from(n_layer.max(1))
    }

    /// The plan with `device_layers` of the model's `n_layer` layers on the
    /// device.
    pub fn split(&self, n_layer: u32, device_layers: u32) -> StoreSplit {
        let d = device_layers.min(n_layer);
        let per_layer = self.pool_bytes_per_layer(n_layer);
        StoreSplit {
            device_layers: d,
            device_bytes: u64::from(d) * (per_layer + self.scratch_bytes),
            host_bytes: u64::from(n_layer - d) * per_layer + self.scratch_bytes,
        }
    }

    /// The plan of a store whose layers differ (one [`StoreInput`] "layer"
    /// standing for all, a scratch set per shape): `layers` are those
    /// keeping KV of their own, each with its block bytes and where its
    /// store is. A layer on the device holds its pools and a scratch of its
    /// own there; the others' pools and the shared scratch sets stay in
    /// host memory.
    pub fn split_layers(&self, layers: &[LayerBlocks]) -> StoreSplit {
        let (open, sealed) = (
            u64::from(self.open_blocks + self.branch_blocks),
            u64::from(self.sealed_blocks),
        );
        let mut split = StoreSplit {
            device_layers: 0,
            device_bytes: 0,
            host_bytes: self.scratch_bytes,
        };
        for l in layers {
            let pools = open * l.open_block_bytes + sealed * l.sealed_block_bytes;
            if l.on_device {
                split.device_layers += 1;
                split.device_bytes += pools + u64::from(self.scratch_blocks) * l.open_block_bytes;
            } else {
                split.host_bytes += pools;
            }
        }
        split
    }

    /// KV bytes per token of context: a sealed block's (an open block's for a
    /// format that never seals) over its tokens.
    pub fn bytes_per_token(&self, block_size: u32) -> f64 {
        let b = if self.sealed_blocks > 0 {
            self.sealed_block_bytes
        } else {
            self.open_block_bytes
        };
        b as f64 / f64::from(block_size.max(1))
    }
}

/// Sizes a store of our formats. The open pool is sized for the running
/// sequences — each holds its open tail (`tail_tokens` plus the partial
/// block) and one block for a copy-on-write or a block a step moves into
/// (cached partial blocks live in what the running sequences leave free,
/// and are evicted first) — plus the step's token-tree branch blocks and
/// one layer's scratch, and the rest goes to sealed blocks. A format that
/// never seals keeps everything in open blocks.
pub fn plan_store(input: &StoreInput) -> Result<StorePlan, PlanError> {
    let bad = |field, reason: String| Err(PlanError::Invalid { field, reason });
    if input.block_size == 0 || input.layers == 0 || input.open_block_bytes == 0 {
        return bad(
            "block_size",
            "blocks, layers and block bytes must be positive".into(),
        );
    }
    if input.seals && input.sealed_block_bytes == 0 {
        return bad("sealed_block_bytes", "must be positive".into());
    }
    let bs = u64::from(input.block_size);
    let layers = u64::from(input.layers);
    let open_b = input.open_block_bytes * layers;
    let sealed_b = input.sealed_block_bytes * layers;
    let running = u64::from(input.max_running.max(1));
    let blocks_of = |tokens: u64| tokens.div_ceil(bs);
    let branch = u64::from(input.branch_blocks);
    let scratch_b = if input.scratch_block_bytes == 0 {
        input.open_block_bytes
    } else {
        input.scratch_block_bytes
    };
    let (open, sealed, scratch) = if input.seals {
        let window = (u64::from(input.tail_tokens) + bs).div_ceil(bs);
        let open = running * (window + 1);
        let scratch = blocks_of(u64::from(input.max_batch_tokens)) + 1;
        let sealed = match input.size {
            StoreSize::Tokens(t) => blocks_of(t),
            StoreSize::Budget(b) => {
                let fixed = (open + branch) * open_b + scratch * scratch_b;
                if fixed >= b {
                    return Err(PlanError::OpenPoolDoesNotFit {
                        open_bytes: fixed,
                        budget: b,
                        running: input.max_running,
                    });
                }
                (b - fixed) / sealed_b
            }
        };
        (open, sealed, scratch)
    } else {
        let open = match input.size {
            StoreSize::Tokens(t) => blocks_of(t) + running,
            StoreSize::Budget(b) => (b / open_b).saturating_sub(branch),
        };
        (open, 0, 0)
    };
    let context_blocks = if input.seals {
        sealed
    } else {
        open.saturating_sub(running)
    };
    if context_blocks == 0 {
        return Err(PlanError::NoRoomForKv {
            kv_bytes: match input.size {
                StoreSize::Budget(b) => b,
                StoreSize::Tokens(t) => t,
            },
            block_bytes: if input.seals { sealed_b } else { open_b },
        });
    }
    let too_many = |n: u64| n > u64::from(u32::MAX) / 2;
    let all = open + sealed + scratch + branch;
    if too_many(all) {
        return bad("size", format!("{all} blocks are too many"));
    }
    Ok(StorePlan {
        open_blocks: open as u32,
        sealed_blocks: sealed as u32,
        scratch_blocks: scratch as u32,
        branch_blocks: branch as u32,
        bytes: (open + branch) * open_b + scratch * scratch_b + sealed * sealed_b,
        tokens: context_blocks * bs,
        open_block_bytes: open_b,
        scratch_bytes: scratch * scratch_b,
        sealed_block_bytes: if input.seals { sealed_b } else { 0 },
    })
}

/// The share of a memory budget (or a GPU) the planners keep free by default.
pub const DEFAULT_SAFETY_MARGIN: f64 = 0.05;

/// What `--gpu-layers` puts in device memory, as llama.cpp places it:
/// `gpu_layers` counts the output layer first (1 offloads only the output,
/// `n_layer + 1` or more offloads every layer); the input embedding stays on
/// the CPU.
#[derive(Debug, Clone)]
pub struct OffloadInput {
    /// Weight bytes of each repeating layer (`blk.N.*`), by layer.
    pub layer_weight_bytes: Vec<u64>,
    /// Weight bytes of the output layer (output matrix and norm).
    pub output_weight_bytes: u64,
    /// `--gpu-layers`.
    pub gpu_layers: u32,
    /// KV bytes per token of one layer in device memory (0 when the KV
    /// stays in host memory).
    pub kv_bytes_per_token_per_layer: f64,
    /// Tokens of KV each layer holds.
    pub kv_tokens: u64,
    /// Bytes of siliceo's store per offloaded layer in device memory (its
    /// pools where grafted attention runs on the GPU; 0 otherwise).
    pub store_bytes_per_layer: u64,
    /// Compute buffers (activations, logits) on the device.
    pub compute_reserve_bytes: u64,
    /// Share of the device kept free; must be in (0, 0.5).
    pub safety_margin: f64,
    /// The device's free and total bytes.
    pub free_bytes: u64,
    /// The device's total bytes.
    pub total_bytes: u64,
}

/// What offloading takes on the device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct OffloadPlan {
    /// Repeating layers on the device.
    pub layers: u32,
    /// Whether the output layer is there.
    pub output: bool,
    /// Weight bytes there.
    pub weight_bytes: u64,
    /// KV bytes there.
    pub kv_bytes: u64,
    /// Weights, KV and compute reserve.
    pub needed_bytes: u64,
    /// Free bytes left after them.
    pub left_bytes: u64,
}

/// Checks that offloading leaves the margin free on the device; a
/// configuration that would not is refused before anything is allocated
/// (instead of failing, or crawling, at the first peak).
pub fn plan_offload(i: &OffloadInput) -> Result<OffloadPlan, PlanError> {
    if !(i.safety_margin > 0.0 && i.safety_margin < 0.5) {
        return Err(PlanError::Invalid {
            field: "safety_margin",
            reason: format!("must be in (0, 0.5), got {}", i.safety_margin),
        });
    }
    let n_layer = i.layer_weight_bytes.len() as u32;
    let output = i.gpu_layers > 0;
    let on_gpu = siliceo_core::offloaded_layers(n_layer as usize, i.gpu_layers as usize);
    let layers = on_gpu.len() as u32;
    let weight_bytes = i.layer_weight_bytes[on_gpu].iter().sum::<u64>()
        + if output { i.output_weight_bytes } else { 0 };
    let kv_bytes = (i.kv_bytes_per_token_per_layer * i.kv_tokens as f64 * f64::from(layers)).ceil()
        as u64
        + i.store_bytes_per_layer * u64::from(layers);
    let needed = weight_bytes + kv_bytes + if output { i.compute_reserve_bytes } else { 0 };
    let margin = (i.total_bytes as f64 * i.safety_margin).ceil() as u64;
    if needed + margin > i.free_bytes {
        return Err(PlanError::OffloadDoesNotFit {
            weights: weight_bytes,
            kv: kv_bytes,
            reserve: i.compute_reserve_bytes,
            needed,
            free: i.free_bytes,
            total: i.total_bytes,
            margin,
            margin_pct: i.safety_margin * 100.0,
        });
    }
    Ok(OffloadPlan {
        layers,
        output,
        weight_bytes,
        kv_bytes,
        needed_bytes: needed,
        left_bytes: i.free_bytes - needed,
    })
}

/// Parses a size such as `8GiB`, `2.5GB`, `512MiB`, `1000000` (bytes).
/// Binary units (KiB, MiB, GiB, TiB) are powers of 1024, decimal ones (KB, MB,
/// GB, TB) powers of 1000.
pub fn parse_bytes(s: &str) -> Result<u64, PlanError> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let bad = || PlanError::Invalid {
        field: "size",
        reason: format!("`{s}` is not a size like 8GiB, 2.5GB or 512MiB"),
    };
    let n: f64 = num.parse().map_err(|_| bad())?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kib" | "k" => 1024.0,
        "mib" | "m" => 1024.0 * 1024.0,
        "gib" | "g" => 1024.0 * 1024.0 * 1024.0,
        "tib" | "t" => 1024f64.powi(4),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        _ => return Err(bad()),
    };
    Ok((n * mult).round() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geom(n_layer: u32, n_head_kv: u32, head_dim: u32) -> ModelGeometry {
        ModelGeometry {
            n_layer,
            n_head: n_head_kv * 4,
            n_head_kv,
            head_dim_k: head_dim,
            head_dim_v: head_dim,
            n_embd: n_head_kv * 4 * head_dim,
            n_vocab: 32000,
            n_ctx_train: 8192,
        }
    }

    const GIB: u64 = 1 << 30;

    #[test]
    fn llama3_8b_geometry_in_2_5_gb_of_kv() {
        // 32 layers, 8 KV heads, head dim 128: the budget is exactly 2.5 GB of
        // KV once weights are set to zero and the margin and reserve are tiny.
        let input = |k: KvFormat, v: KvFormat| PlanInput {
            k,
            v,
            safety_margin: 1e-9,
            compute_reserve_bytes: 0,
            ..PlanInput::new(geom(32, 8, 128), 0, 2_500_000_000)
        };
        let check = |k, v, bpt: f64, blocks: u64| {
            let p = plan(&input(k, v)).unwrap();
            assert_eq!(
                p.k_bytes_per_token + p.v_bytes_per_token,
                bpt,
                "{k:?}/{v:?}"
            );
            assert_eq!(p.num_blocks, blocks, "{k:?}/{v:?}");
        };
        let f16 = KvFormat::Llama(KvType::F16);
        let q8 = KvFormat::Llama(KvType::Q8_0);
        // f16: 32 × 8 × 128 × 2 × 2 = 131072 B/token; block = 8 MiB; 2.5e9 / 8388608 = 298.02
        check(f16, f16, 131_072.0, 298);
        // q8_0: 128 elems = 4 blocks × 34 B = 136 B per row; 32 × 8 × 136 × 2 = 69632 B/token; 2.5e9 / (69632 × 64) = 560.99
        check(q8, q8, 69_632.0, 560);
        // K5/V4: K row 128 × 5/8 + 128 × 4/64 = 88 B; V row 64 + 4 × 4 = 80 B; (88 + 80) × 256 = 43008 B/token;
        // the newest partial block stays f16 (64 × 131072 B): (2.5e9 − 8388608) / (43008 × 64) = 905.2
        check(KvFormat::K5, KvFormat::V4, 43_008.0, 905);
    }

    #[test]
    fn refuses_when_weights_do_not_fit_and_counts_the_draft() {
        let mut input = PlanInput::new(geom(32, 8, 128), 7 * GIB, 8 * GIB);
        input.safety_margin = 0.05;
        input.compute_reserve_bytes = 512 << 20;
        // 8 GiB × 0.95 = 7.6 GiB usable; 7 GiB + 0.5 GiB fits; plus a 1 GiB draft does not.
        assert!(plan(&input).is_ok());
        input.draft = Some(DraftInput {
            geometry: geom(24, 2, 64),
            weight_bytes: GIB,
            k: KvFormat::Llama(KvType::F16),
            v: KvFormat::Llama(KvType::F16),
        });
        let err = plan(&input).unwrap_err();
        assert!(matches!(err, PlanError::WeightsDoNotFit { .. }), "{err}");
        assert!(err.to_string().contains("do not fit"));
    }

    /// Layers of two shapes, two of them without KV (`gemma4-mini`'s): the
    /// bytes per token are those of the four layers keeping KV, a third of
    /// what the geometry's widest layer times six would say.
    #[test]
    fn layers_that_differ_count_each_layers_kv() {
        let windowed = [true, true, true, false, true, false];
        let layers = siliceo_core::layer_kv(&windowed, (128, 64), |il| [2, 2, 2, 1, 2, 1][il], 2);
        let alike = PlanInput::new(geom(6, 2, 128), GIB, 2 * GIB);
        let per_layer = PlanInput {
            layers,
            k: KvFormat::Kv8,
            v: KvFormat::Kv8,
            ..alike.clone()
        };
        let (a, p) = (plan(&alike).unwrap(), plan(&per_layer).unwrap());
        // f16: 6 layers × 2 heads × 128 × 2 B.
        assert_eq!(a.k_bytes_per_token, 3072.0);
        // f16 tail: 3 layers × 2 heads × 64 + 1 × 128, × 2 B.
        assert_eq!(p.tail_bytes_per_token, 2.0 * 1024.0);
        let kv8 = |dim: u64| KvFormat::Kv8.row_bytes(dim).unwrap();
        assert_eq!(p.k_bytes_per_token, 6.0 * kv8(64) + kv8(128));
        assert_eq!(p.k_bytes_per_token, p.v_bytes_per_token);
        let bits = (kv8(64) * 6.0 + kv8(128)) * 8.0 / 512.0;
        assert_eq!(p.bits_per_element, bits);
    }

    #[test]
    fn draft_and_tail_shrink_the_cache() {
        let base = PlanInput::new(geom(32, 8, 128), 4 * GIB, 8 * GIB);
        let p0 = plan(&base).unwrap();
        let with_tail = PlanInput {
            tail_tokens: 1024,
            sequences: 4,
            k: KvFormat::K5,
            v: KvFormat::V4,
            ..base.clone()
        };
        let p1 = plan(&with_tail).unwrap();
        // 1024 tail tokens plus the newest partial block, per sequence.
        assert_eq!(p1.tail_reserve_bytes, 4 * (1024 + 64) * 131_072);
        assert!(
            p1.num_blocks > p0.num_blocks,
            "K5/V4 holds more even after tails"
        );
        let with_draft = PlanInput {
            draft: Some(DraftInput {
                geometry: geom(24, 2, 64),
                weight_bytes: GIB / 2,
                k: KvFormat::Llama(KvType::F16),
                v: KvFormat::Llama(KvType::F16),
            }),
            ..base.clone()
        };
        let p2 = plan(&with_draft).unwrap();
        assert_eq!(p2.draft_bytes_per_token, 24.0 * 2.0 * 64.0 * 2.0 * 2.0);
        assert!(p2.num_blocks < p0.num_blocks);
        // Sequences at a context: 4096 tokens = 64 blocks of 8 MiB each.
        assert_eq!(
            p0.max_sequences_at(&base, 4096),
            p0.kv_bytes / (64 * 64 * 131_072)
        );
    }

    #[test]
    fn margin_is_never_zero_and_sizes_parse() {
        let input = PlanInput {
            safety_margin: 0.0,
            ..PlanInput::new(geom(2, 1, 64), 0, GIB)
        };
        assert!(matches!(
            plan(&input),
            Err(PlanError::Invalid {
                field: "safety_margin",
                ..
            })
        ));
        let check = |s: &str, v: u64| assert_eq!(parse_bytes(s).unwrap(), v, "{s}");
        check("8GiB", 8 * GIB);
        check("2.5GB", 2_500_000_000);
        check("512MiB", 512 << 20);
        check("100", 100);
        check("16 GiB", 16 * GIB);
        assert!(parse_bytes("8 apples").is_err());
        assert!(parse_bytes("").is_err());
    }

    #[test]
    fn offloading_counts_what_llama_cpp_puts_on_the_device() {
        const MB: u64 = 1 << 20;
        let base = OffloadInput {
            layer_weight_bytes: vec![100 * MB; 4],
            output_weight_bytes: 300 * MB,
            gpu_layers: 0,
            kv_bytes_per_token_per_layer: 1024.0,
            kv_tokens: 4096,
            store_bytes_per_layer: 0,
            compute_reserve_bytes: 256 * MB,
            safety_margin: 0.05,
            free_bytes: 2000 * MB,
            total_bytes: 2048 * MB,
        };
        let check = |gpu_layers: u32, layers: u32, output: bool, weights: u64| {
            let p = plan_offload(&OffloadInput {
                gpu_layers,
                ..base.clone()
            })
            .unwrap();
            assert_eq!(
                (p.layers, p.output, p.weight_bytes),
                (layers, output, weights * MB)
            );
            assert_eq!(p.kv_bytes, u64::from(layers) * 4 * MB);
            p
        };
        // llama.cpp counts the output layer first, then layers from the last.
        assert_eq!(check(0, 0, false, 0).needed_bytes, 0);
        check(1, 0, true, 300);
        check(2, 1, true, 400);
        let all = check(5, 4, true, 700);
        assert_eq!(all.needed_bytes, (700 + 16 + 256) * MB);
        assert_eq!(all.left_bytes, (2000 - 972) * MB);
        assert_eq!(check(99, 4, true, 700), all);
        // 972 MiB needed, and 5 % of 2,048 MiB (102.4 MiB) kept free: 1,074
        // MiB free is not enough, 1,075 is.
        let tight = |free: u64| {
            plan_offload(&OffloadInput {
                gpu_layers: 99,
                free_bytes: free * MB,
                ..base.clone()
            })
        };
        assert!(matches!(
            tight(1074),
            Err(PlanError::OffloadDoesNotFit { needed, margin, .. })
                if needed == 972 * MB && margin == (2048.0 * MB as f64 * 0.05).ceil() as u64
        ));
        assert!(tight(1075).is_ok());
        let e = tight(1000).unwrap_err().to_string();
        assert!(e.contains("offload fewer layers"), "{e}");
    }

    #[test]
    fn formats_parse_and_report_bits() {
        assert_eq!(KvFormat::parse("k5").unwrap(), KvFormat::K5);
        assert_eq!(
            KvFormat::parse("Q4_0").unwrap(),
            KvFormat::Llama(KvType::Q4_0)
        );
        assert!(KvFormat::parse("q3_k").is_err());
        assert_eq!(KvFormat::K5.bits_per_element(128), Some(5.5));
        assert_eq!(KvFormat::V4.bits_per_element(128), Some(5.0));
        assert_eq!(KvFormat::Kv8.bits_per_element(128), Some(8.5));
        assert_eq!(KvFormat::Kv8.bits_per_element(80), None);
        assert_eq!(KvFormat::V4.row_bytes(48), None);
    }

    /// SmolLM2's store in KV8 (30 layers, 3 KV heads of 64): 4,096 tokens,
    /// four sequences running.
    fn smollm2_kv8() -> StoreInput {
        StoreInput {
            layers: 30,
            open_block_bytes: 3 * 2 * 64 * 64 * 2,
            sealed_block_bytes: 3 * 2 * (64 * 64 + 64 * 2 * 2),
            scratch_block_bytes: 0,
            block_size: 64,
            tail_tokens: 0,
            seals: true,
            max_running: 4,
            max_batch_tokens: 256,
            branch_blocks: 0,
            size: StoreSize::Tokens(4096),
        }
    }

    #[test]
    fn a_store_of_our_formats_splits_open_and_sealed_pools() {
        let input = smollm2_kv8();
        let p = plan_store(&input).unwrap();
        // Each running sequence: its partial block and a copy; the scratch
        // is one layer's.
        assert_eq!(
            (p.open_blocks, p.sealed_blocks, p.scratch_blocks),
            (8, 64, 5)
        );
        assert_eq!(p.tokens, 4096);
        let open_b = input.open_block_bytes * 30;
        let sealed_b = input.sealed_block_bytes * 30;
        let scratch_b = 5 * input.open_block_bytes;
        assert_eq!(p.scratch_bytes, scratch_b);
        assert_eq!(p.bytes, 8 * open_b + scratch_b + 64 * sealed_b);
        // A budget: what is left after the open pools goes to sealed blocks.
        let b = plan_store(&StoreInput {
            size: StoreSize::Budget(p.bytes + sealed_b - 1),
            ..input
        })
        .unwrap();
        assert_eq!(b.sealed_blocks, 64);
        assert!(b.bytes < p.bytes + sealed_b);
        // A 1,024-token tail: 17 open blocks per sequence, and a copy.
        let t = plan_store(&StoreInput {
            tail_tokens: 1024,
            ..input
        })
        .unwrap();
        assert_eq!(t.open_blocks, 4 * 18);
        // F16 never seals: all open, plus one block per running sequence.
        let f = plan_store(&StoreInput {
            seals: false,
            ..input
        })
        .unwrap();
        assert_eq!(
            (f.open_blocks, f.sealed_blocks, f.scratch_blocks),
            (68, 0, 0)
        );
        assert_eq!(f.tokens, 4096);
        // Token-tree branch blocks come beside the open pool, in the bytes
        // and out of a budget's sealed blocks.
        let tb = plan_store(&StoreInput {
            branch_blocks: 8,
            ..input
        })
        .unwrap();
        assert_eq!((tb.open_blocks, tb.branch_blocks), (8, 8));
        assert_eq!(tb.bytes, p.bytes + 8 * open_b);
        let bb = plan_store(&StoreInput {
            branch_blocks: 8,
            size: StoreSize::Budget(p.bytes),
            ..input
        })
        .unwrap();
        assert_eq!(
            bb.sealed_blocks,
            64 - (8 * open_b).div_ceil(sealed_b) as u32
        );
        assert!(bb.bytes <= p.bytes);
        let fb = plan_store(&StoreInput {
            seals: false,
            branch_blocks: 8,
            size: StoreSize::Budget(f.bytes),
            ..input
        })
        .unwrap();
        assert_eq!((fb.open_blocks, fb.branch_blocks), (60, 8));
        // Too small a budget is refused.
        assert!(matches!(
            plan_store(&StoreInput {
                size: StoreSize::Budget(1 << 20),
                ..input
            }),
            Err(PlanError::OpenPoolDoesNotFit { .. })
        ));
        // Room for the open pools but not one sealed block.
        let open_only = 8 * open_b + scratch_b + sealed_b - 1;
        assert!(matches!(
            plan_store(&StoreInput {
                size: StoreSize::Budget(open_only),
                ..input
            }),
            Err(PlanError::NoRoomForKv { .. })
        ));
    }

    /// Layers listed one by one split as the one-layer arithmetic splits
    /// alike layers; layers of two shapes put each layer's pools (and, on
    /// the device, a scratch of its own) where it is.
    #[test]
    fn layers_split_one_by_one() {
        let input = StoreInput {
            branch_blocks: 2,
            ..smollm2_kv8()
        };
        let p = plan_store(&input).unwrap();
        let one = |on_device| LayerBlocks {
            open_block_bytes: input.open_block_bytes,
            sealed_block_bytes: input.sealed_block_bytes,
            on_device,
        };
        for d in [0, 1, 11, 30] {
            let layers: Vec<_> = (0..30).map(|il| one(il >= 30 - d)).collect();
            assert_eq!(
                p.split_layers(&layers),
                p.split(30, d as u32),
                "{d} on the device"
            );
        }
        // Two shapes (one layer of each keeping KV), a scratch set each.
        let (small, big) = ((100, 60), (200, 120));
        let two = plan_store(&StoreInput {
            layers: 1,
            open_block_bytes: small.0 + big.0,
            sealed_block_bytes: small.1 + big.1,
            scratch_block_bytes: small.0 + big.0,
            ..input
        })
        .unwrap();
        let at = |(o, s): (u64, u64), on_device| LayerBlocks {
            open_block_bytes: o,
            sealed_block_bytes: s,
            on_device,
        };
        let split = two.split_layers(&[at(small, false), at(big, true)]);
        let (open, sealed, scratch) = (
            u64::from(two.open_blocks + two.branch_blocks),
            u64::from(two.sealed_blocks),
            u64::from(two.scratch_blocks),
        );
        assert_eq!(split.device_layers, 1);
        assert_eq!(
            split.device_bytes,
            (open + scratch) * big.0 + sealed * big.1
        );
        assert_eq!(
            split.host_bytes,
            open * small.0 + sealed * small.1 + scratch * (small.0 + big.0)
        );
        assert_eq!(split.total(), two.bytes + scratch * big.0);
    }
}
