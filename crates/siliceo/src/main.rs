//! `siliceo`: the command line of siliceo-infer.
//!
//! - `siliceo serve`: the gRPC server (see `serve.rs` for flags and the TOML file).
//! - `siliceo generate --prompt "..."`: streams a completion from a local GGUF.
//! - `siliceo model-info`: a GGUF's geometry and KV bytes per token per KV type.
//! - `siliceo plan`: what a memory budget holds (KV blocks, context, sequences).
//! - `siliceo synth-model --like qwen2.5-7b --out F`: a random-weight GGUF of
//!   that geometry, for speed measurements where no real model can go.
//!
//! With no `--model`, the default model is used (`SILICEO_MODEL`, else
//! `models/SmolLM2-135M-Instruct.Q4_1.gguf`); `cargo xtask fetch-model` fetches it.

mod eval_kv;
mod kv_opts;
mod plan;
mod serve;

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Result, bail};
use clap::{Args, Parser, Subcommand};
use siliceo_core::{KvType, SamplingParams};
use siliceo_engine::{EngineError, Model, ModelOptions};
use siliceo_runtime::Message as ChatMessage;
use siliceo_runtime::synth;
use siliceo_runtime::{Event, GenerateRequest, Input, Runtime, RuntimeConfig, RuntimeError};

const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

#[derive(Parser, Debug)]
#[command(
    name = "siliceo",
    version,
    about = "siliceo-infer: LLM serving on consumer hardware, built on llama.cpp"
)]
struct Cli {
    /// More log output (-v: info, -vv: debug). RUST_LOG overrides.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    #[command(subcommand)]
    command: Cmd,
}

// Built once per process from the command line: the size difference between
// variants costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand, Debug)]
enum Cmd {
    /// Serve a model: the OpenAI-compatible HTTP API and gRPC (siliceo.v1.Inference, health, reflection).
    Serve(serve::ServeArgs),
    /// Generate text from a prompt, streaming it as it is produced.
    Generate(GenerateArgs),
    /// Print a model's geometry and KV-cache bytes per token for each KV type.
    ModelInfo(ModelInfoArgs),
    /// Plan memory: KV blocks, context and sequences that fit a budget.
    Plan(plan::PlanArgs),
    /// Measure what KV-cache formats cost in quality on a text: perplexity,
    /// KL divergence against f16 KV, top-1 agreement, bytes per token.
    EvalKv(eval_kv::EvalKvArgs),
    /// Write a GGUF with a real model's architecture, geometry and
    /// quantization but random weights (noise for text, real for speed).
    SynthModel(SynthArgs),
}

#[derive(Args, Debug)]
struct ModelArg {
    /// GGUF model file (default: $SILICEO_MODEL, else models/SmolLM2-135M-Instruct.Q4_1.gguf).
    #[arg(long, short = 'm')]
    model: Option<PathBuf>,
    /// Layers to offload to the GPU (needs a CUDA build).
    #[arg(long, default_value_t = 0)]
    gpu_layers: u32,
}

#[derive(Args, Debug)]
struct GenerateArgs {
    #[command(flatten)]
    model: ModelArg,
    /// The prompt.
    #[arg(long, short = 'p')]
    prompt: String,
    /// Wrap the prompt as a user message in the model's chat template.
    #[arg(long)]
    chat: bool,
    /// System message (with --chat).
    #[arg(long, requires = "chat")]
    system: Option<String>,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 256)]
    max_tokens: u32,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Keep the k most likely tokens (0: off).
    #[arg(long, default_value_t = 0)]
    top_k: u32,
    /// Nucleus sampling mass (1: off).
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Drop tokens below min_p × the best probability (0: off).
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    /// Repetition penalty (1: off).
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f32,
    /// Presence penalty (0: off).
    #[arg(long, default_value_t = 0.0)]
    presence_penalty: f32,
    /// Frequency penalty (0: off).
    #[arg(long, default_value_t = 0.0)]
    frequency_penalty: f32,
    /// Random seed (same seed, same text).
    #[arg(long)]
    seed: Option<u64>,
    /// Stop before this string (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// Context length in tokens.
    #[arg(long, default_value_t = 4096)]
    ctx: u32,
    /// Threads (default: $SILICEO_THREADS, else all cores).
    #[arg(long)]
    threads: Option<u32>,
    /// KV format: ours (f16, kv8, k5v4, K:V codecs, +rot, +tailN) [default:
    /// kv8]; with --kv-backend llama, llama.cpp's presets f16, kv8, k5v4.
    #[arg(long)]
    kv: Option<String>,
    /// Where KV lives: ours or llama [default: ours].
    #[arg(long)]
    kv_backend: Option<String>,
    /// llama.cpp's K cache type (with --kv-backend llama).
    #[arg(long)]
    kv_k: Option<String>,
    /// llama.cpp's V cache type (with --kv-backend llama).
    #[arg(long)]
    kv_v: Option<String>,
    /// Batch-invariant weight products (no repacking, no tiled K-quant products).
    #[arg(long)]
    deterministic: bool,
}

/// `siliceo synth-model` flags (see `siliceo_runtime::synth`).
#[derive(Args, Debug)]
struct SynthArgs {
    /// The model whose architecture and geometry to copy: qwen2.5-7b,
    /// llama-3-8b, qwen2.5-1.5b, gpt-oss-20b, gpt-oss-mini (gpt-oss's
    /// architecture at test size), olmo3-mini, exaone4-mini,
    /// cohere2-mini (OLMo 3's, EXAONE 4's and Command R7B's, for tests of
    /// sliding windows), gemma4-mini (Gemma 4's: heads of two sizes, KV
    /// shared across layers), gemma4-alike (gemma4-mini with heads of one
    /// size, for a test), gemma4-wide (gemma4-mini with global heads of 512,
    /// Gemma 4's size) or gemma3n-mini (Gemma 3n's: AltUp, per-layer
    /// inputs, KV in the first 20 layers only).
    #[arg(long)]
    like: Option<synth::Like>,
    /// Weight quantization: q4_k_m (llama.cpp's Q4_K_M mix) or q8_0.
    #[arg(long, default_value = "q4_k_m")]
    quant: synth::Quant,
    /// A GGUF to take the tokenizer from (any model, or a --vocab-only file)
    /// [default: the default model].
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Output GGUF.
    #[arg(long)]
    out: PathBuf,
    /// Fewer layers than the model has (a small file for tests).
    #[arg(long)]
    layers: Option<u32>,
    /// Seed of the random weights.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Write only the tokenizer (a vocab-only GGUF, a few MB), to carry to a
    /// machine that makes the model itself.
    #[arg(long, conflicts_with_all = ["like", "layers"])]
    vocab_only: bool,
}

fn cmd_synth(a: SynthArgs) -> Result<()> {
    synth::synth_model(&synth::SynthOptions {
        like: a.like,
        quant: a.quant,
        tokenizer: a.tokenizer.unwrap_or_else(default_model),
        out: a.out,
        layers: a.layers,
        seed: a.seed,
        vocab_only: a.vocab_only,
    })?;
    Ok(())
}

#[derive(Args, Debug)]
struct ModelInfoArgs {
    #[command(flatten)]
    model: ModelArg,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

pub(crate) fn default_model() -> PathBuf {
    if let Some(p) = std::env::var_os("SILICEO_MODEL") {
        return PathBuf::from(p);
    }
    let local = PathBuf::from("models").join(DEFAULT_MODEL_FILE);
    if local.is_file() {
        return local;
    }
    // Running from elsewhere: the workspace this binary was built in.
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models")
        .join(DEFAULT_MODEL_FILE)
}

fn load(arg: &ModelArg) -> Result<Model> {
    let path = arg.model.clone().unwrap_or_else(default_model);
    match Model::load(
        &path,
        &ModelOptions {
            gpu_layers: arg.gpu_layers,
            ..ModelOptions::default()
        },
    ) {
        Ok(m) => Ok(m),
        Err(EngineError::ModelNotFound { path }) if arg.model.is_none() => bail!(
            "the default model is not there ({})\nfetch it with: cargo xtask fetch-model",
            path.display()
        ),
        Err(e) => Err(e.into()),
    }
}

fn cmd_generate(a: GenerateArgs) -> Result<()> {
    let params = SamplingParams {
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        min_p: a.min_p,
        seed: a.seed,
        repetition_penalty: a.repetition_penalty,
        presence_penalty: a.presence_penalty,
        frequency_penalty: a.frequency_penalty,
        max_tokens: a.max_tokens,
        stop: a.stop,
        ..SamplingParams::greedy()
    };
    params.validate()?;
    if a.prompt.is_empty() {
        bail!("the prompt is empty");
    }
    let path = a.model.model.clone().unwrap_or_else(default_model);
    if !path.is_file() {
        if a.model.model.is_none() {
            bail!(
                "the default model is not there ({})\nfetch it with: cargo xtask fetch-model",
                path.display()
            );
        }
        bail!("--model: no such file: {}", path.display());
    }
    let (backend, type_k, type_v) = kv_opts::kv_backend(
        &kv_opts::KvFlags {
            kv: a.kv.as_deref(),
            backend: a.kv_backend.as_deref(),
            kv_k: a.kv_k.as_deref(),
            kv_v: a.kv_v.as_deref(),
            ..kv_opts::KvFlags::default()
        },
        &path,
    )?;
    let input = if a.chat {
        let mut msgs = Vec::new();
        if let Some(s) = a.system {
            msgs.push(ChatMessage::new("system", s));
        }
        msgs.push(ChatMessage::new("user", a.prompt));
        Input::Chat(msgs)
    } else {
        Input::Prompt(a.prompt)
    };
    // One request through the serving runtime: the same path as `serve`.
    let mut rc = RuntimeConfig::new(&path);
    rc.kv = backend;
    rc.model = ModelOptions {
        gpu_layers: a.model.gpu_layers,
        deterministic: a.deterministic,
    };
    rc.context.n_ctx = a.ctx;
    rc.context.type_k = type_k;
    rc.context.type_v = type_v;
    rc.context.n_threads = a.threads;
    rc.context.n_threads_batch = a.threads;
    rc.context.n_batch = 512;
    rc.context.n_ubatch = 512;
    rc.scheduler.max_batch_tokens = 512;
    rc.scheduler.max_running_seqs = 1;
    rc.prefix_caching = false;
    rc.context.validate()?;
    let rt = Runtime::start(rc).map_err(|e| match e {
        RuntimeError::Start(m) if m.contains("not found") && a.model.model.is_none() => {
            anyhow::anyhow!("{m}\nfetch it with: cargo xtask fetch-model")
        }
        e => anyhow::anyhow!("{e}"),
    })?;
    let kv = kv_opts::describe(rt.info());
    let mut req = GenerateRequest::new(input);
    req.sampling = params;
    let mut stream = rt.submit(req)?;
    let mut stdout = std::io::stdout().lock();
    while let Some(event) = stream.blocking_next() {
        match event {
            Event::Text { text, .. } => {
                // A closed pipe (e.g. `| head`) ends the generation quietly.
                if stdout
                    .write_all(text.as_bytes())
                    .and_then(|_| stdout.flush())
                    .is_err()
                {
                    break;
                }
            }
            // Not asked for.
            Event::Prompt { .. } => {}
            Event::Done {
                finish_reason,
                usage,
                error,
                ..
            } => {
                let _ = writeln!(stdout);
                if let Some(e) = error {
                    bail!("{e}");
                }
                let prefill_s = (usage.ttft_ms.saturating_sub(usage.queue_ms)) as f64 / 1000.0;
                let decode_s = usage.decode_ms as f64 / 1000.0;
                eprintln!(
                    "[{} prompt tokens in {:.0} ms ({:.1} tok/s) · {} generated at {:.1} tok/s · finish: {} · KV {kv}]",
                    usage.prompt_tokens,
                    prefill_s * 1000.0,
                    f64::from(usage.prompt_tokens) / prefill_s.max(1e-9),
                    usage.completion_tokens,
                    f64::from(usage.completion_tokens.saturating_sub(1)) / decode_s.max(1e-9),
                    finish_reason
                );
                break;
            }
        }
    }
    Ok(())
}

fn cmd_model_info(a: ModelInfoArgs) -> Result<()> {
    let model = load(&a.model)?;
    let g = model.geometry();
    let kv: Vec<(KvType, Option<u64>, Option<u64>)> = KvType::ALL
        .into_iter()
        .map(|t| (t, g.k_bytes_per_token(t), g.v_bytes_per_token(t)))
        .collect();
    if a.json {
        let rows: Vec<_> = kv
            .iter()
            .map(|(t, k, v)| {
                serde_json::json!({
                    "type": t.name(),
                    "bits_per_element": t.bits_per_element(),
                    "k_bytes_per_token": k,
                    "v_bytes_per_token": v,
                })
            })
            .collect();
        let info = serde_json::json!({
            "path": model.path().display().to_string(),
            "name": model.name(),
            "architecture": model.architecture(),
            "n_params": model.n_params(),
            "weight_bytes": model.weight_bytes(),
            "geometry": g,
            "has_chat_template": model.chat_template().is_some(),
            "kv": rows,
        });
        println!("{}", serde_json::to_string_pretty(&info)?);
        return Ok(());
    }
    println!("model         {}", model.path().display());
    println!("name          {}", model.name());
    println!("architecture  {}", model.architecture());
    println!("parameters    {:.1} M", model.n_params() as f64 / 1e6);
    println!(
        "weights       {:.1} MiB",
        model.weight_bytes() as f64 / (1u64 << 20) as f64
    );
    println!("layers        {}", g.n_layer);
    println!(
        "heads         {} query, {} KV (group {})",
        g.n_head,
        g.n_head_kv,
        g.gqa_group()
    );
    println!("head dim      K {}, V {}", g.head_dim_k, g.head_dim_v);
    println!("hidden size   {}", g.n_embd);
    println!("vocabulary    {}", g.n_vocab);
    println!("trained ctx   {}", g.n_ctx_train);
    println!(
        "chat template {}",
        if model.chat_template().is_some() {
            "yes"
        } else {
            "no"
        }
    );
    println!();
    println!("KV cache per token (K and V in the same type):");
    println!(
        "  {:<7} {:>5} {:>10} {:>10} {:>10} {:>12}",
        "type", "bits", "K bytes", "V bytes", "K+V", "per 64-block"
    );
    for (t, k, v) in kv {
        match (k, v) {
            (Some(k), Some(v)) => println!(
                "  {:<7} {:>5.1} {:>10} {:>10} {:>10} {:>12}",
                t.name(),
                t.bits_per_element(),
                k,
                v,
                k + v,
                (k + v) * 64
            ),
            _ => println!(
                "  {:<7} {:>5.1}   (KV rows are not a whole number of {}-element blocks)",
                t.name(),
                t.bits_per_element(),
                t.block_elems()
            ),
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // `siliceo plan | head` must end quietly, not panic on a closed pipe: take
    // back the default SIGPIPE action Rust's runtime replaces. Not for `serve`:
    // a server outlives a closed log pipe (its sockets never raise SIGPIPE).
    #[cfg(unix)]
    if !matches!(cli.command, Cmd::Serve(_)) {
        // SAFETY: setting a signal's disposition to its default at start-up,
        // before any thread exists.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    // The server logs its own progress at info; llama.cpp's chatter stays at warn.
    let quiet = if matches!(cli.command, Cmd::Serve(_)) {
        "info,llama-cpp-2=warn,llama_cpp_2=error"
    } else {
        "warn"
    };
    let default_level = match cli.verbose {
        0 => quiet,
        1 => "info",
        _ => "debug",
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level)),
        )
        .with_writer(std::io::stderr)
        .init();
    let result = match cli.command {
        Cmd::Serve(a) => serve::cmd_serve(a),
        Cmd::Generate(a) => cmd_generate(a),
        Cmd::ModelInfo(a) => cmd_model_info(a),
        Cmd::Plan(a) => plan::cmd_plan(a),
        Cmd::EvalKv(a) => eval_kv::cmd_eval_kv(a),
        Cmd::SynthModel(a) => cmd_synth(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
