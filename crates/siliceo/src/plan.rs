//! `siliceo plan`: the memory planner on the command line.

use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result, bail};
use clap::Args;
use siliceo_core::{LayerKv, ModelGeometry, layers_alike};
use siliceo_kv_paging::gguf::GgufHeader;
use siliceo_kv_paging::planner::{DraftInput, KvFormat, Plan, PlanInput, parse_bytes, plan};

#[derive(Args, Debug)]
pub struct PlanArgs {
    /// GGUF model whose header gives the geometry and weight size.
    #[arg(long, short = 'm', conflicts_with = "geometry")]
    model: Option<PathBuf>,
    /// Geometry instead of a file: layers=32,kv_heads=8,head_dim=128,weights=4.9GiB
    /// (optional: heads=, head_dim_v=, context=).
    #[arg(long)]
    geometry: Option<String>,
    /// Memory budget, e.g. 8GiB, 16GB, 2.5GB (the VRAM plan; not with --kv).
    #[arg(long, required_unless_present = "kv")]
    budget: Option<String>,
    /// Plan our KV store instead, as `siliceo serve` sizes it for the same
    /// flags: its format (f16, kv8, k5v4, K:V, +rot, +tailN), with --kv-budget
    /// or --context (KV tokens), --max-running, --batch-tokens, --block-size.
    #[arg(long)]
    kv: Option<String>,
    /// With --kv: the store's bytes, all layers (as `serve --kv-budget`).
    #[arg(long, requires = "kv")]
    kv_budget: Option<String>,
    /// With --kv: most requests running at once [default: 16, as serve].
    #[arg(long, requires = "kv")]
    max_running: Option<u32>,
    /// With --kv: tokens per engine step [default: 512, as serve].
    #[arg(long, requires = "kv")]
    batch_tokens: Option<u32>,
    /// With --kv: token trees of this many branches (as `serve
    /// --spec-tree-width` with a drafter, --spec-ngram or --draft-model;
    /// their branch blocks are part of the store) [default: 1: none].
    #[arg(long, requires = "kv")]
    spec_tree_width: Option<usize>,
    /// With --kv and --spec-tree-width: most drafted tokens per step (as
    /// `serve --spec-max-draft`) [default: 8].
    #[arg(long, requires = "spec_tree_width")]
    spec_max_draft: Option<usize>,
    /// With --kv: llama.cpp's layers on the GPU (as `serve --gpu-layers`):
    /// where a build with the CUDA kernels keeps the store (each offloaded
    /// layer's pools and a scratch of its own in device memory).
    #[arg(long, requires = "kv")]
    gpu_layers: Option<u32>,
    /// K format: f16, bf16, q8_0, q5_1, q5_0, q4_1, q4_0, iq4_nl, kv8, k5.
    #[arg(long, default_value = "f16")]
    kv_k: String,
    /// V format: as --kv-k, plus v4.
    #[arg(long, default_value = "f16")]
    kv_v: String,
    /// Newest tokens per sequence kept in f16.
    #[arg(long, default_value_t = 0)]
    tail: u32,
    /// Tokens per block.
    #[arg(long, default_value_t = 64)]
    block_size: u32,
    /// Fraction of the budget kept free (never zero).
    #[arg(long, default_value_t = siliceo_kv_paging::planner::DEFAULT_SAFETY_MARGIN)]
    margin: f64,
    /// Compute-buffer reserve.
    #[arg(long, default_value = "256MiB")]
    reserve: String,
    /// Sequences whose tails are reserved.
    #[arg(long, default_value_t = 1)]
    sequences: u32,
    /// Context per sequence for the "sequences that fit" figure (default:
    /// trained context); with --kv, the store's KV tokens (as `serve
    /// --context`, default 8192).
    #[arg(long)]
    context: Option<u64>,
    /// A draft model sharing the budget (GGUF).
    #[arg(long, conflicts_with = "draft_geometry")]
    draft_model: Option<PathBuf>,
    /// A draft model's geometry instead of a file.
    #[arg(long)]
    draft_geometry: Option<String>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

/// Reads a GGUF header, reading more of the file until it is complete.
pub fn read_header(path: &Path) -> Result<GgufHeader> {
    siliceo_runtime::read_gguf_header(path)
        .map_err(|e| anyhow::anyhow!("{e}"))
        .with_context(|| format!("{} is not a readable GGUF model", path.display()))
}

fn parse_geometry(spec: &str) -> Result<(ModelGeometry, u64)> {
    let mut g = ModelGeometry {
        n_layer: 0,
        n_head: 0,
        n_head_kv: 0,
        head_dim_k: 0,
        head_dim_v: 0,
        n_embd: 0,
        n_vocab: 0,
        n_ctx_train: 0,
    };
    let mut weights = None;
    for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (k, v) = part
            .split_once('=')
            .with_context(|| format!("--geometry: `{part}` is not key=value"))?;
        let num = || {
            v.trim()
                .parse::<u32>()
                .with_context(|| format!("--geometry: `{k}` needs a number, got `{v}`"))
        };
        match k.trim() {
            "layers" => g.n_layer = num()?,
            "kv_heads" => g.n_head_kv = num()?,
            "heads" => g.n_head = num()?,
            "head_dim" => g.head_dim_k = num()?,
            "head_dim_v" => g.head_dim_v = num()?,
            "context" => g.n_ctx_train = num()?,
            "weights" => weights = Some(parse_bytes(v)?),
            other => bail!(
                "--geometry: unknown key `{other}` (layers, kv_heads, head_dim, weights, heads, head_dim_v, context)"
            ),
        }
    }
    if g.n_layer == 0 || g.n_head_kv == 0 || g.head_dim_k == 0 {
        bail!("--geometry needs at least layers=, kv_heads=, head_dim= and weights=");
    }
    if g.head_dim_v == 0 {
        g.head_dim_v = g.head_dim_k;
    }
    if g.n_head == 0 {
        g.n_head = g.n_head_kv;
    }
    let weights = weights.context("--geometry needs weights= (e.g. weights=4.9GiB)")?;
    Ok((g, weights))
}

/// A model's geometry, weight bytes, name and each layer's KV (from its
/// file, or alike layers from `--geometry`).
type Source = (ModelGeometry, u64, String, Vec<LayerKv>);

fn model_source(path: &Option<PathBuf>, geometry: &Option<String>) -> Result<Option<Source>> {
    match (path, geometry) {
        (Some(p), _) => {
            let h = read_header(p)?;
            let name = h.str("general.name").unwrap_or("model").to_owned();
            Ok(Some((
                h.geometry()?,
                h.weight_bytes()?,
                name,
                h.layer_kv()?,
            )))
        }
        (None, Some(spec)) => {
            let (g, w) = parse_geometry(spec)?;
            Ok(Some((g, w, "geometry".to_owned(), g.alike_layers())))
        }
        (None, None) => Ok(None),
    }
}

fn gib(b: f64) -> String {
    const K: f64 = 1024.0;
    match b {
        b if b >= K * K * K => format!("{:.2} GiB", b / (K * K * K)),
        b if b >= K * K => format!("{:.2} MiB", b / (K * K)),
        b if b >= K => format!("{:.1} KiB", b / K),
        b => format!("{b:.0} B"),
    }
}

pub fn cmd_plan(a: PlanArgs) -> Result<()> {
    let source = if a.model.is_none() && a.geometry.is_none() {
        Some(crate::default_model())
    } else {
        a.model.clone()
    };
    let (geometry, weights, name, layers) =
        model_source(&source, &a.geometry)?.context("give --model or --geometry")?;
    if let Some(kv) = &a.kv {
        return plan_store_cmd(&a, kv, &geometry, &layers, &name);
    }
    let budget = a.budget.as_deref().context("--budget is required")?;
    let draft = model_source(&a.draft_model, &a.draft_geometry)?;
    let k = KvFormat::parse(&a.kv_k)?;
    let v = KvFormat::parse(&a.kv_v)?;
    let input = PlanInput {
        k,
        v,
        tail_tokens: a.tail,
        block_size: a.block_size,
        safety_margin: a.margin,
        compute_reserve_bytes: parse_bytes(&a.reserve)?,
        sequences: a.sequences,
        draft: draft.as_ref().map(|(g, w, _, _)| DraftInput {
            geometry: *g,
            weight_bytes: *w,
            k,
            v,
        }),
        layers: if layers_alike(&layers) {
            Vec::new()
        } else {
            layers.clone()
        },
        ..PlanInput::new(geometry, weights, parse_bytes(budget)?)
    };
    let p: Plan = plan(&input)?;
    let context = a.context.unwrap_or(if geometry.n_ctx_train > 0 {
        u64::from(geometry.n_ctx_train)
    } else {
        4096
    });
    let seqs = p.max_sequences_at(&input, context);
    if a.json {
        let mut out = serde_json::to_value(&p)?;
        out["model"] = serde_json::json!(name);
        out["geometry"] = serde_json::to_value(geometry)?;
        if !layers_alike(&layers) {
            out["layers"] = serde_json::to_value(&layers)?;
        }
        out["budget_bytes"] = serde_json::json!(input.budget_bytes);
        out["kv_k"] = serde_json::json!(k.name());
        out["kv_v"] = serde_json::json!(v.name());
        out["block_size"] = serde_json::json!(a.block_size);
        out["tail_tokens"] = serde_json::json!(a.tail);
        out["f16_tail_tokens"] = serde_json::json!(input.f16_tail_tokens());
        out["context"] = serde_json::json!(context);
        out["max_sequences_at_context"] = serde_json::json!(seqs);
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    let g = geometry;
    println!("model              {name}: {}", describe(&g, &layers));
    println!(
        "budget             {} less {:.1} % margin = {} usable",
        gib(input.budget_bytes as f64),
        a.margin * 100.0,
        gib(p.usable_bytes as f64)
    );
    println!(
        "weights            {}{}",
        gib(p.weight_bytes as f64),
        if draft.is_some() {
            " (target + draft)"
        } else {
            ""
        }
    );
    println!("compute reserve    {}", gib(p.compute_reserve_bytes as f64));
    println!("left for KV        {}", gib(p.kv_bytes as f64));
    println!(
        "KV format          K {} ({:.2} bits), V {} ({:.2} bits); {:.2} bits per element on average",
        k.name(),
        k.bits_per_element(u64::from(g.head_dim_k)).unwrap_or(0.0),
        v.name(),
        v.bits_per_element(u64::from(g.head_dim_v)).unwrap_or(0.0),
        p.bits_per_element
    );
    println!(
        "per token          K {:.0} B + V {:.0} B = {:.0} B",
        p.k_bytes_per_token,
        p.v_bytes_per_token,
        p.k_bytes_per_token + p.v_bytes_per_token
    );
    println!(
        "per {}-token block K {} + V {} = {}",
        a.block_size,
        gib(p.k_bytes_per_block),
        gib(p.v_bytes_per_block),
        gib(p.k_bytes_per_block + p.v_bytes_per_block)
    );
    if p.draft_bytes_per_token > 0.0 {
        println!("draft KV per token {:.0} B", p.draft_bytes_per_token);
    }
    let f16_tail = input.f16_tail_tokens();
    if f16_tail > 0 {
        println!(
            "f16 tail           {} tokens{} × {} sequence(s) × {:.0} B = {}",
            f16_tail,
            if f16_tail > a.tail {
                " (--tail plus the newest, partial block)"
            } else {
                ""
            },
            a.sequences,
            p.tail_bytes_per_token,
            gib(p.tail_reserve_bytes as f64)
        );
    }
    println!(
        "blocks             {} ({} tokens)",
        p.num_blocks, p.block_tokens
    );
    println!(
        "max context        {} tokens for one sequence (trained context: {})",
        p.max_context_one_sequence, p.n_ctx_train
    );
    println!("sequences          {seqs} at {context} tokens each");
    Ok(())
}

/// The model's layers as the plans count them: alike, or each kind of layer
/// keeping KV and the layers keeping none.
fn describe(g: &ModelGeometry, layers: &[LayerKv]) -> String {
    if layers_alike(layers) {
        return format!(
            "{} layers, {} KV heads × head dim {}/{}",
            g.n_layer, g.n_head_kv, g.head_dim_k, g.head_dim_v
        );
    }
    // (KV heads, head size) → layers keeping KV of that shape.
    let mut kinds: Vec<((usize, usize), usize)> = Vec::new();
    let mut own = 0;
    let owners = layers.iter().enumerate().filter(|&(il, l)| l.source == il);
    for l in owners.map(|(_, l)| l) {
        own += 1;
        match kinds
            .iter_mut()
            .find(|(k, _)| *k == (l.kv_heads, l.head_dim))
        {
            Some((_, n)) => *n += 1,
            None => kinds.push(((l.kv_heads, l.head_dim), 1)),
        }
    }
    let kinds: Vec<String> = kinds
        .iter()
        .map(|((h, d), n)| format!("{n} × {h} KV heads × head dim {d}"))
        .collect();
    format!(
        "{} layers; KV in {own}: {}{}",
        layers.len(),
        kinds.join(", "),
        match layers.len() - own {
            0 => String::new(),
            shared => format!("; {shared} read other layers' KV"),
        }
    )
}

/// `plan --kv`: our KV store as `serve` sizes it for the same flags.
fn plan_store_cmd(
    a: &PlanArgs,
    kv: &str,
    g: &ModelGeometry,
    layers: &[LayerKv],
    name: &str,
) -> Result<()> {
    let format =
        siliceo_engine::KvFormat::parse(kv).map_err(|e| anyhow::anyhow!("--kv {kv}: {e}"))?;
    let size = match &a.kv_budget {
        Some(b) => siliceo_runtime::StoreSize::Budget(parse_bytes(b)?),
        None => siliceo_runtime::StoreSize::Tokens(a.context.unwrap_or(8192)),
    };
    let max_running = a.max_running.unwrap_or(16).clamp(1, 240);
    let batch = a.batch_tokens.unwrap_or(512).max(1);
    let spec = crate::serve::speculative_config(None, a.spec_max_draft, a.spec_tree_width);
    let branch_blocks = spec.tree_branch_blocks(a.block_size, max_running);
    let alike = layers_alike(layers);
    let (input, p) = siliceo_runtime::store_plan(
        layers,
        &format,
        size,
        a.block_size,
        max_running,
        batch,
        branch_blocks,
    )
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    // The layers llama.cpp offloads, and where the store then lives (each
    // offloaded layer's whose heads the CUDA kernels take).
    let split = match a.gpu_layers {
        None => None,
        Some(n) => {
            let offloaded = siliceo_core::offloaded_layers(g.n_layer as usize, n as usize);
            let on_device = siliceo_engine::device_store_layers(
                layers,
                &format,
                a.block_size as usize,
                g.n_head as usize,
                offloaded.clone(),
            )?;
            let split =
                siliceo_runtime::store_split(&p, layers, &format, a.block_size, &on_device)?;
            Some((split, offloaded))
        }
    };
    if a.json {
        let mut out = serde_json::to_value(p)?;
        out["model"] = serde_json::json!(name);
        out["format"] = serde_json::json!(format.name());
        out["input"] = serde_json::to_value(input)?;
        if !alike {
            out["layers"] = serde_json::to_value(layers)?;
        }
        if let Some((split, _)) = &split {
            out["gpu_layers"] = serde_json::json!(a.gpu_layers);
            out["split"] = serde_json::to_value(split)?;
            out["device_kernels_in_this_build"] = serde_json::json!(siliceo_engine::DEVICE_KERNELS);
        }
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!("model              {name}: {}", describe(g, layers));
    println!("format             {}", format.name());
    println!(
        "sealed blocks      {} × {} = {}",
        p.sealed_blocks,
        gib(p.sealed_block_bytes as f64),
        gib((u64::from(p.sealed_blocks) * p.sealed_block_bytes) as f64)
    );
    println!(
        "open blocks        {} (tails, partial blocks, copies for {max_running} running){} × {} + {} scratch {} = {}",
        p.open_blocks,
        if p.branch_blocks > 0 {
            format!(" + {} token-tree branch", p.branch_blocks)
        } else {
            String::new()
        },
        gib(p.open_block_bytes as f64),
        p.scratch_blocks,
        if alike {
            "of one layer"
        } else {
            "per layer shape"
        },
        gib(
            (u64::from(p.open_blocks + p.branch_blocks) * p.open_block_bytes + p.scratch_bytes)
                as f64
        )
    );
    println!("store              {} ({} B)", gib(p.bytes as f64), p.bytes);
    if let Some((split, layers)) = split {
        println!(
            "on the GPU         layers {}..{} ({} of {}; the store of {}), each with its own scratch: {} in device memory, {} in host memory ({} B in all){}",
            layers.start,
            layers.end,
            layers.len(),
            g.n_layer,
            split.device_layers,
            gib(split.device_bytes as f64),
            gib(split.host_bytes as f64),
            split.total(),
            if siliceo_engine::DEVICE_KERNELS {
                ""
            } else {
                "; as a build with the CUDA kernels places it (`cargo xtask build --cuda`): this one keeps every layer's store in host memory"
            }
        );
    }
    println!(
        "context            {} tokens, {:.0} B per token",
        p.tokens,
        p.bytes_per_token(a.block_size)
    );
    Ok(())
}
