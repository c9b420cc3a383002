//! `siliceo serve`: the gRPC server and the OpenAI-compatible HTTP API on
//! one model.
//!
//! Settings come from defaults, then an optional TOML file (`--config`), then
//! flags; a flag wins over the file. Every key of the file has the flag's name
//! with `_` for `-`, e.g.:
//!
//! ```toml
//! model = "models/SmolLM2-135M-Instruct.Q4_1.gguf"
//! listen = "127.0.0.1:50051"
//! context = 8192
//! kv = "k5v4+tail64"
//! kv_budget = "1GiB"
//! max_running = 16
//! ```

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use clap::Args;
use serde::Deserialize;
use siliceo_http::HttpConfig;
use siliceo_runtime::{Runtime, RuntimeConfig};
use siliceo_server::ServerConfig;

/// Flags of `siliceo serve` (all optional: the file, then the defaults, fill in).
#[derive(Args, Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServeArgs {
    /// TOML file with any of these settings (flags win).
    #[arg(long)]
    #[serde(skip)]
    config: Option<PathBuf>,
    /// GGUF model (default: $SILICEO_MODEL, else the default model).
    #[arg(long, short = 'm')]
    model: Option<PathBuf>,
    /// A Jinja chat template to use instead of the one the GGUF carries
    /// (transformers' dialect; a file that does not compile stops start-up).
    #[arg(long)]
    chat_template_file: Option<PathBuf>,
    /// Repeating layers to run on the GPU (a CUDA build; `cargo xtask build
    /// --cuda`), the last ones first, as llama.cpp offloads; their KV store
    /// and attention go with them. Start-up refuses a setting that leaves
    /// less than the memory margin free [default: 0].
    #[arg(long)]
    gpu_layers: Option<u32>,
    /// gRPC address [default: 127.0.0.1:50051].
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// OpenAI-compatible HTTP API address, or `off` [default: 127.0.0.1:8080].
    #[arg(long)]
    http_listen: Option<String>,
    /// Require `authorization: Bearer <key>` (or set SILICEO_API_KEY), on
    /// gRPC and HTTP alike; repeat it to accept several keys (in the config
    /// file: a string or a list).
    #[arg(long = "api-key", value_name = "KEY")]
    #[serde(deserialize_with = "one_or_many")]
    api_key: Vec<String>,
    /// Accept the keys in this file too: one per line, blank lines and
    /// lines starting with `#` skipped (keys kept out of the process list).
    #[arg(long)]
    api_key_file: Option<PathBuf>,
    /// Let web pages from this origin call the HTTP API from a browser
    /// (CORS), e.g. http://localhost:3000; repeat it for more, or `*` for
    /// any [default: none].
    #[arg(long = "allow-origin", value_name = "ORIGIN")]
    allow_origin: Vec<String>,
    /// Prometheus metrics address, e.g. 127.0.0.1:9090 [default: off].
    #[arg(long)]
    metrics_listen: Option<SocketAddr>,
    /// KV tokens shared by all running requests (the longest sequence), when
    /// --kv-budget is not given [default: 8192].
    #[arg(long)]
    context: Option<u32>,
    /// KV format. Ours (the default backend): f16, kv8, k5v4 or K:V codecs
    /// (kv8[/G], k5, v4[/G], f16), then +rot (Hadamard-rotated K) and +tailN
    /// (the newest N tokens kept in f16) [default: kv8]. With --kv-backend
    /// llama: llama.cpp's presets f16, kv8 (q8_0/q8_0), k5v4 (q5_1/q4_1).
    /// `siliceo eval-kv` measures what each costs (docs/KV_QUALITY.md).
    #[arg(long)]
    kv: Option<String>,
    /// Where KV lives: ours (siliceo's paged store and kernel) or llama
    /// (llama.cpp's own cache, for comparison) [default: ours].
    #[arg(long)]
    kv_backend: Option<String>,
    /// Our store's size in bytes, all layers (e.g. 2GiB); without it the store
    /// holds --context tokens.
    #[arg(long)]
    kv_budget: Option<String>,
    /// llama.cpp's K cache type (with --kv-backend llama): f16, bf16, q8_0,
    /// q5_1, q5_0, q4_1, q4_0, iq4_nl.
    #[arg(long)]
    kv_k: Option<String>,
    /// llama.cpp's V cache type (with --kv-backend llama); a quantized V turns
    /// flash attention on.
    #[arg(long)]
    kv_v: Option<String>,
    /// Batch-invariant weight products too (no repacked weights, no tiled
    /// K-quant products): the same request gives the same tokens alone or in
    /// any batch on K-quant models as well, at a cost in speed.
    #[arg(long)]
    deterministic: bool,
    /// Threads of our attention kernel [default: --threads].
    #[arg(long)]
    kernel_threads: Option<usize>,
    /// Tokens per KV block [default: 64].
    #[arg(long)]
    block_size: Option<u32>,
    /// Most requests running at once [default: 16].
    #[arg(long)]
    max_running: Option<usize>,
    /// Most requests waiting; beyond it, RESOURCE_EXHAUSTED [default: 1024].
    #[arg(long)]
    max_waiting: Option<usize>,
    /// Tokens computed per engine step (decodes + prefill chunks) [default: 512].
    #[arg(long)]
    batch_tokens: Option<usize>,
    /// Threads for llama.cpp [default: $SILICEO_THREADS, else all cores].
    #[arg(long)]
    threads: Option<u32>,
    /// Turn prefix caching off.
    #[arg(long)]
    no_prefix_cache: bool,
    /// Keep every block of the layers with a sliding window (Gemma 2/3,
    /// gpt-oss), as llama.cpp's --swa-full does; by default they keep a
    /// window's worth per sequence in pools of their own.
    #[arg(long)]
    swa_full: bool,
    /// Seconds in-flight streams get to finish on SIGINT/SIGTERM [default: 10].
    #[arg(long)]
    shutdown_grace_s: Option<u64>,
    /// Largest request message in bytes [default: 4194304].
    #[arg(long)]
    max_request_bytes: Option<usize>,
    /// Memory in MiB for the Responses API's kept responses (what
    /// `previous_response_id` continues and `GET /v1/responses/{id}`
    /// returns; the oldest go first), 0 to keep none [default: 64].
    #[arg(long)]
    responses_store_mb: Option<usize>,
    /// Thinking budgets of the effort levels requests name
    /// (`reasoning_effort`, `reasoning.effort`, Anthropic's
    /// `output_config.effort`), as LEVEL=TOKENS or LEVEL=none (no cap),
    /// comma-separated; unnamed levels keep their defaults [default:
    /// minimal=0,low=1024,medium=4096,high=16384,xhigh=none,max=none].
    #[arg(long)]
    reasoning_budgets: Option<String>,
    /// Serve gRPC and the HTTP API over TLS with this PEM certificate chain
    /// (with --tls-key).
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Speculative decoding with the n-gram (prompt lookup) drafter, for
    /// requests that set `speculative` (with --draft-model, the draft model
    /// drafts instead).
    #[arg(long)]
    spec_ngram: bool,
    /// Most drafted tokens per step [default: 8].
    #[arg(long)]
    spec_max_draft: Option<usize>,
    /// Verify up to this many drafted branches as a token tree (greedy
    /// requests without penalties; the n-gram drafter's distinct
    /// continuations, or the draft model's top 2 first tokens) [default: 1:
    /// chains].
    #[arg(long)]
    spec_tree_width: Option<usize>,
    /// Draft model for speculative decoding (same vocabulary as --model,
    /// checked at start-up); requests opt in with `speculative`.
    #[arg(long)]
    draft_model: Option<PathBuf>,
    /// Embedding model (GGUF with pooling, e.g. all-MiniLM-L6-v2 from
    /// `cargo xtask fetch-model --embed`) behind the Embed and Rerank RPCs;
    /// it runs on its own thread next to generation.
    #[arg(long)]
    embedding_model: Option<PathBuf>,
}

impl ServeArgs {
    /// Fills every unset flag from `file`.
    fn over(self, file: ServeArgs) -> ServeArgs {
        ServeArgs {
            config: self.config,
            model: self.model.or(file.model),
            chat_template_file: self.chat_template_file.or(file.chat_template_file),
            gpu_layers: self.gpu_layers.or(file.gpu_layers),
            listen: self.listen.or(file.listen),
            http_listen: self.http_listen.or(file.http_listen),
            api_key: if self.api_key.is_empty() {
                file.api_key
            } else {
                self.api_key
            },
            api_key_file: self.api_key_file.or(file.api_key_file),
            allow_origin: if self.allow_origin.is_empty() {
                file.allow_origin
            } else {
                self.allow_origin
            },
            metrics_listen: self.metrics_listen.or(file.metrics_listen),
            context: self.context.or(file.context),
            kv: self.kv.or(file.kv),
            kv_backend: self.kv_backend.or(file.kv_backend),
            kv_budget: self.kv_budget.or(file.kv_budget),
            kv_k: self.kv_k.or(file.kv_k),
            kv_v: self.kv_v.or(file.kv_v),
            deterministic: self.deterministic || file.deterministic,
            kernel_threads: self.kernel_threads.or(file.kernel_threads),
            block_size: self.block_size.or(file.block_size),
            max_running: self.max_running.or(file.max_running),
            max_waiting: self.max_waiting.or(file.max_waiting),
            batch_tokens: self.batch_tokens.or(file.batch_tokens),
            threads: self.threads.or(file.threads),
            no_prefix_cache: self.no_prefix_cache || file.no_prefix_cache,
            swa_full: self.swa_full || file.swa_full,
            shutdown_grace_s: self.shutdown_grace_s.or(file.shutdown_grace_s),
            max_request_bytes: self.max_request_bytes.or(file.max_request_bytes),
            responses_store_mb: self.responses_store_mb.or(file.responses_store_mb),
            reasoning_budgets: self.reasoning_budgets.or(file.reasoning_budgets),
            spec_ngram: self.spec_ngram || file.spec_ngram,
            spec_max_draft: self.spec_max_draft.or(file.spec_max_draft),
            spec_tree_width: self.spec_tree_width.or(file.spec_tree_width),
            tls_cert: self.tls_cert.or(file.tls_cert),
            tls_key: self.tls_key.or(file.tls_key),
            draft_model: self.draft_model.or(file.draft_model),
            embedding_model: self.embedding_model.or(file.embedding_model),
        }
    }
}

/// A string or a list of strings (the config file's `api_key`).
fn one_or_many<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(String),
        Many(Vec<String>),
    }
    Ok(match OneOrMany::deserialize(d)? {
        OneOrMany::One(k) => vec![k],
        OneOrMany::Many(v) => v,
    })
}

/// The keys `--api-key`, `--api-key-file` and `SILICEO_API_KEY` give (the
/// variable only when neither flag gives one). A key file that gives none
/// is an error: it was meant to lock the server.
fn api_keys(a: &ServeArgs) -> Result<siliceo_server::ApiKeys> {
    let mut keys = a.api_key.clone();
    if let Some(path) = &a.api_key_file {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("--api-key-file {}", path.display()))?;
        let found = siliceo_server::ApiKeys::parse_file(&text);
        if found.is_empty() {
            bail!("--api-key-file {}: no key in it", path.display());
        }
        keys.extend(found);
    }
    if keys.is_empty() {
        keys.extend(std::env::var("SILICEO_API_KEY").ok());
    }
    Ok(siliceo_server::ApiKeys::new(keys))
}

/// The runtime, gRPC and HTTP configuration `a` describes.
/// Speculative decoding as `--spec-max-draft` [8, 1–16] and
/// `--spec-tree-width` [1, 1–8] ask for (`siliceo plan` sizes the store the
/// same way).
pub(crate) fn speculative_config(
    draft_model: Option<PathBuf>,
    max_draft: Option<usize>,
    tree_width: Option<usize>,
) -> siliceo_runtime::SpeculativeConfig {
    siliceo_runtime::SpeculativeConfig {
        draft_model,
        max_draft: max_draft.unwrap_or(8).clamp(1, 16),
        tree_width: tree_width.unwrap_or(1).clamp(1, 8),
        ..Default::default()
    }
}

fn configs(a: ServeArgs) -> Result<(RuntimeConfig, ServerConfig, Option<HttpConfig>)> {
    let a = match &a.config {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            let file: ServeArgs =
                toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
            a.over(file)
        }
        None => a,
    };
    if let Some(d) = &a.draft_model
        && !d.is_file()
    {
        bail!("--draft-model: no such file: {}", d.display());
    }
    if let Some(e) = &a.embedding_model
        && !e.is_file()
    {
        bail!(
            "--embedding-model: no such file: {}\nfetch all-MiniLM-L6-v2 with: cargo xtask fetch-model --embed",
            e.display()
        );
    }
    let model = a.model.clone().unwrap_or_else(crate::default_model);
    if !model.is_file() {
        if a.model.is_none() {
            bail!(
                "the default model is not there ({})\nfetch it with: cargo xtask fetch-model",
                model.display()
            );
        }
        bail!("--model: no such file: {}", model.display());
    }
    let (backend, type_k, type_v) = crate::kv_opts::kv_backend(
        &crate::kv_opts::KvFlags {
            kv: a.kv.as_deref(),
            backend: a.kv_backend.as_deref(),
            kv_k: a.kv_k.as_deref(),
            kv_v: a.kv_v.as_deref(),
            budget: a.kv_budget.as_deref(),
            kernel_threads: a.kernel_threads,
        },
        &model,
    )?;
    let mut rc = RuntimeConfig::new(model);
    if let Some(path) = &a.chat_template_file {
        rc.chat_template = Some(
            std::fs::read_to_string(path)
                .with_context(|| format!("--chat-template-file {}", path.display()))?,
        );
    }
    rc.kv = backend;
    rc.model.deterministic = a.deterministic;
    rc.model.gpu_layers = a.gpu_layers.unwrap_or(0);
    rc.context.n_ctx = a.context.unwrap_or(8192);
    rc.context.type_k = type_k;
    rc.context.type_v = type_v;
    rc.context.n_threads = a.threads;
    rc.context.n_threads_batch = a.threads;
    let batch = a.batch_tokens.unwrap_or(512);
    if batch == 0 {
        bail!("--batch-tokens must be at least 1");
    }
    rc.context.n_batch = batch as u32;
    rc.context.n_ubatch = batch as u32;
    rc.scheduler.max_batch_tokens = batch;
    rc.scheduler.max_running_seqs = a.max_running.unwrap_or(16).clamp(1, 240);
    // The KV (our store's tokens, llama.cpp's cells) bounds a sequence.
    rc.scheduler.max_seq_len = usize::MAX;
    if let Some(w) = a.max_waiting {
        rc.scheduler.max_waiting = w;
    }
    rc.block_size = a.block_size.unwrap_or(64);
    if rc.block_size == 0 {
        bail!("--block-size must be at least 1");
    }
    rc.prefix_caching = !a.no_prefix_cache;
    rc.swa_full = a.swa_full;
    if a.spec_ngram || a.draft_model.is_some() {
        rc.speculative = Some(speculative_config(
            a.draft_model.clone(),
            a.spec_max_draft,
            a.spec_tree_width,
        ));
    }
    rc.context.validate().map_err(|e| anyhow::anyhow!("{e}"))?;
    let tls = match (&a.tls_cert, &a.tls_key) {
        (Some(c), Some(k)) => Some(siliceo_server::TlsIdentity {
            cert_pem: std::fs::read(c).with_context(|| format!("--tls-cert {}", c.display()))?,
            key_pem: std::fs::read(k).with_context(|| format!("--tls-key {}", k.display()))?,
        }),
        (None, None) => None,
        _ => bail!("--tls-cert and --tls-key go together"),
    };
    let sc = ServerConfig {
        listen: a.listen.unwrap_or(ServerConfig::default().listen),
        api_keys: api_keys(&a)?,
        metrics_listen: a.metrics_listen,
        max_request_bytes: a
            .max_request_bytes
            .unwrap_or(ServerConfig::default().max_request_bytes),
        shutdown_grace: Duration::from_secs(a.shutdown_grace_s.unwrap_or(10)),
        tls,
        embeddings: None,
    };
    let http = match a.http_listen.as_deref() {
        Some("off") => None,
        other => {
            // The same certificate serves HTTPS; a bad one fails here.
            if let Some(tls) = &sc.tls {
                siliceo_http::check_tls(tls).context("--tls-cert/--tls-key")?;
            }
            let listen = match other {
                None => HttpConfig::default().listen,
                Some(a) => a.parse().with_context(|| {
                    format!("--http-listen `{a}`: an address like 127.0.0.1:8080, or `off`")
                })?,
            };
            let allow_origins = siliceo_http::AllowOrigins::parse(&a.allow_origin)
                .map_err(|e| anyhow::anyhow!("--allow-origin: {e}"))?;
            let reasoning_budgets = a
                .reasoning_budgets
                .as_deref()
                .map(siliceo_http::ReasoningBudgets::parse)
                .transpose()
                .map_err(|e| anyhow::anyhow!("--reasoning-budgets: {e}"))?
                .unwrap_or_default();
            Some(HttpConfig {
                listen,
                allow_origins,
                api_keys: sc.api_keys.clone(),
                max_request_bytes: sc.max_request_bytes,
                tls: sc.tls.clone(),
                responses_store_bytes: a
                    .responses_store_mb
                    .map_or(siliceo_http::DEFAULT_RESPONSES_STORE_BYTES, |mb| mb << 20),
                reasoning_budgets,
                ..HttpConfig::default()
            })
        }
    };
    Ok((rc, sc, http))
}

/// Resolves on SIGINT or SIGTERM.
async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// Runs `siliceo serve`.
pub fn cmd_serve(a: ServeArgs) -> Result<()> {
    let embedding_model = a.embedding_model.clone();
    let (rc, mut sc, mut http) = configs(a)?;
    let model = rc.model_path.clone();
    eprintln!("siliceo: loading {}", model.display());
    let rt = Arc::new(Runtime::start(rc).map_err(|e| anyhow::anyhow!("{e}"))?);
    if let Some(path) = embedding_model {
        eprintln!("siliceo: loading embedding model {}", path.display());
        let svc =
            siliceo_runtime::EmbeddingService::start(siliceo_runtime::EmbeddingConfig::new(path))
                .map_err(|e| anyhow::anyhow!("{e}"))?;
        sc.embeddings = Some(Arc::new(svc));
    }
    if let Some(h) = &mut http {
        h.embeddings = sc.embeddings.clone();
    }
    let tokio = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    tokio.block_on(async move {
        let listener = tokio::net::TcpListener::bind(sc.listen)
            .await
            .with_context(|| format!("cannot listen on {}", sc.listen))?;
        let addr = listener.local_addr()?;
        let http_listener = match &http {
            Some(h) => Some(
                tokio::net::TcpListener::bind(h.listen)
                    .await
                    .with_context(|| format!("cannot listen on {} (--http-listen)", h.listen))?,
            ),
            None => None,
        };
        let http_addr = match &http_listener {
            Some(l) => {
                let scheme = if sc.tls.is_some() { "https" } else { "http" };
                format!(" · HTTP {scheme}://{}", l.local_addr()?)
            }
            None => String::new(),
        };
        let info = rt.info();
        // One line when ready: scripts and tests wait for it.
        println!(
            "siliceo: ready on {addr}{http_addr} · model {}{} · context {} · KV {} · blocks of {} · prefix cache {}{}{}{}",
            info.model_name,
            match info.gpu_layers {
                0 => String::new(),
                n => format!(" ({n} of {} layers on the GPU)", info.geometry.n_layer),
            },
            info.n_ctx,
            crate::kv_opts::describe(info),
            info.block_size,
            if info.prefix_caching { "on" } else { "off" },
            match sc.api_keys.len() {
                0 => String::new(),
                1 => " · API key required".to_string(),
                n => format!(" · one of {n} API keys required"),
            },
            if sc.tls.is_some() { " · TLS" } else { "" },
            match &sc.embeddings {
                Some(e) => format!(" · embeddings {} ({} dims)", e.info().model_name, e.info().dim),
                None => String::new(),
            }
        );
        use std::io::Write as _;
        let _ = std::io::stdout().flush();
        // One signal stops both servers.
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        tokio::spawn(async move {
            shutdown_signal().await;
            let _ = stop_tx.send(true);
        });
        let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
            let _ = rx.wait_for(|s| *s).await;
        };
        let http_task = match (http_listener, http) {
            (Some(l), Some(h)) => Some(tokio::spawn(siliceo_http::serve_on(
                l,
                rt.clone(),
                h,
                stopped(stop_rx.clone()),
            ))),
            _ => None,
        };
        siliceo_server::serve_on(listener, rt, sc, stopped(stop_rx))
            .await
            .map_err(anyhow::Error::from)?;
        if let Some(t) = http_task {
            t.await
                .context("the HTTP server failed")?
                .context("the HTTP server failed")?;
        }
        anyhow::Ok(())
    })?;
    eprintln!("siliceo: stopped");
    Ok(())
}
