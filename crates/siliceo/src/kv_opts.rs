//! The KV flags `serve` and `generate` share: where KV lives and in what
//! format, and how big our store is.

use std::path::Path;

use anyhow::{Context as _, Result, bail};
use siliceo_core::KvType;
use siliceo_engine::KvFormat;
use siliceo_runtime::{KvBackend, StoreSize};

/// The KV flags as given (all optional).
#[derive(Debug, Default, Clone)]
pub struct KvFlags<'a> {
    /// `--kv`.
    pub kv: Option<&'a str>,
    /// `--kv-backend`.
    pub backend: Option<&'a str>,
    /// `--kv-k`.
    pub kv_k: Option<&'a str>,
    /// `--kv-v`.
    pub kv_v: Option<&'a str>,
    /// `--kv-budget`.
    pub budget: Option<&'a str>,
    /// `--kernel-threads`.
    pub kernel_threads: Option<usize>,
}

/// The backend and llama.cpp's K/V types the flags describe, checked
/// against the model's KV rows (from its GGUF header, before it loads).
pub fn kv_backend(f: &KvFlags<'_>, model: &Path) -> Result<(KvBackend, KvType, KvType)> {
    match f.backend.unwrap_or("ours") {
        "ours" => {
            if f.kv_k.is_some() || f.kv_v.is_some() {
                bail!(
                    "--kv-k and --kv-v pick llama.cpp's cache types: use them with \
                     --kv-backend llama (our formats: --kv f16|kv8|k5v4[+rot][+tailN])"
                );
            }
            let format = match f.kv {
                Some(s) => KvFormat::parse(s).map_err(|e| anyhow::anyhow!("--kv {s}: {e}"))?,
                None => KvFormat::default(),
            };
            let size = f
                .budget
                .map(|b| {
                    siliceo_kv_paging::planner::parse_bytes(b)
                        .map(StoreSize::Budget)
                        .map_err(|e| anyhow::anyhow!("--kv-budget {b}: {e}"))
                })
                .transpose()?;
            let backend = KvBackend::Ours {
                format,
                size,
                kernel_threads: f.kernel_threads,
            };
            Ok((backend, KvType::F16, KvType::F16))
        }
        "llama" => {
            if f.budget.is_some() {
                bail!("--kv-budget sizes our store; llama.cpp's cache is sized by --context");
            }
            let (k, v) = llama_types(f, model)?;
            Ok((KvBackend::Llama, k, v))
        }
        other => bail!("--kv-backend {other}: expected ours or llama"),
    }
}

fn kv_type(s: Option<&str>, flag: &str, preset: KvType) -> Result<KvType> {
    match s {
        None => Ok(preset),
        Some(s) => s.parse().with_context(|| format!("--{flag}")),
    }
}

/// K and V types from a llama.cpp `--kv` preset and `--kv-k`/`--kv-v`.
fn llama_types(f: &KvFlags<'_>, model: &Path) -> Result<(KvType, KvType)> {
    let preset = match f.kv {
        Some(p) => siliceo_engine::eval::KvConfig::parse(p)
            .map_err(|e| anyhow::anyhow!("--kv {p}: {e} (llama.cpp presets: f16, kv8, k5v4)"))?,
        None => siliceo_engine::eval::KvConfig {
            k: KvType::F16,
            v: KvType::F16,
        },
    };
    let k = kv_type(f.kv_k, "kv-k", preset.k)?;
    let v = kv_type(f.kv_v, "kv-v", preset.v)?;
    let header = crate::plan::read_header(model)?;
    let g = header
        .geometry()
        .with_context(|| format!("reading the geometry of {}", model.display()))?;
    let arch = header.str("general.architecture").unwrap_or_default();
    if arch.starts_with("qwen2") && k.bits_per_element() < 8.0 {
        eprintln!(
            "warning: --kv-k {k} on a {arch} model: llama.cpp's K types below 8 bits break \
             Qwen2-family models (measured on Qwen2.5-Coder-1.5B: perplexity ×100 and more, \
             docs/KV_QUALITY.md); use our --kv k5v4 (the default backend), or --kv-k q8_0"
        );
    }
    for (flag, t, row) in [
        ("kv-k", k, g.n_head_kv * g.head_dim_k),
        ("kv-v", v, g.n_head_kv * g.head_dim_v),
    ] {
        if t.row_bytes(u64::from(row)).is_none() {
            bail!(
                "--{flag} {t}: this model's KV rows have {row} elements, not a multiple of {t}'s {}-element blocks; \
                 llama.cpp cannot store them (try q8_0 for 32-element rows, or f16)",
                t.block_elems()
            );
        }
    }
    Ok((k, v))
}

/// How the ready line and `generate`'s summary name the KV.
pub fn describe(info: &siliceo_runtime::RuntimeInfo) -> String {
    let kv = match &info.store {
        Some(s) => store_text(&info.kv_format, s, info.store_split.as_ref()),
        None => format!("llama.cpp {}", info.kv_format),
    };
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    match (info.sliding_window(), info.windowed_pools) {
        (Some((w, n)), Some(p)) => format!(
            "{kv} · sliding window {w} in {n} of {} layers, in pools of their own \
             ({} open, {} sealed blocks, {:.0} MiB; --swa-full keeps every block)",
            info.geometry.n_layer,
            p.group.num_blocks,
            p.group.sealed_blocks,
            mib(p.bytes)
        ),
        (Some((w, n)), None) => format!(
            "{kv} · sliding window {w} in {n} of {} layers",
            info.geometry.n_layer
        ),
        (None, _) => kv,
    }
}

/// Our store in a few words: its format, its bytes (and those in GPU
/// memory, with the layers whose store is there) and its tokens.
fn store_text(
    format: &str,
    plan: &siliceo_runtime::StorePlan,
    split: Option<&siliceo_runtime::StoreSplit>,
) -> String {
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    match split.filter(|s| s.device_layers > 0) {
        Some(s) => format!(
            "ours {format} ({:.0} MiB: {:.0} MiB in GPU memory for {} layers, {:.0} MiB in host memory; {} tokens)",
            mib(s.total()),
            mib(s.device_bytes),
            s.device_layers,
            mib(s.host_bytes),
            plan.tokens
        ),
        None => format!(
            "ours {format} ({:.0} MiB, {} tokens)",
            mib(plan.bytes),
            plan.tokens
        ),
    }
}

#[cfg(test)]
mod tests {
    use siliceo_runtime::{StoreSize, StoreSplit};

    #[test]
    fn the_store_says_what_is_in_gpu_memory() {
        let layers = siliceo_core::ModelGeometry {
            n_layer: 30,
            n_head: 9,
            n_head_kv: 3,
            head_dim_k: 64,
            head_dim_v: 64,
            n_embd: 576,
            n_vocab: 49152,
            n_ctx_train: 8192,
        }
        .alike_layers();
        let format = siliceo_engine::KvFormat::parse("kv8").unwrap();
        let (_, plan) =
            siliceo_runtime::store_plan(&layers, &format, StoreSize::Tokens(4096), 64, 4, 256, 0)
                .unwrap();
        let host = super::store_text("kv8:kv8", &plan, Some(&plan.split(30, 0)));
        assert_eq!(
            host,
            format!(
                "ours kv8:kv8 ({:.0} MiB, 4096 tokens)",
                plan.bytes as f64 / 1048576.0
            )
        );
        let split: StoreSplit = plan.split(30, 10);
        let gpu = super::store_text("kv8:kv8", &plan, Some(&split));
        assert!(gpu.contains("in GPU memory for 10 layers"), "{gpu}");
        assert!(gpu.ends_with("; 4096 tokens)"), "{gpu}");
    }
}
