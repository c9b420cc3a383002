//! `siliceo-bench peer --llama-server PATH`: our server against llama.cpp's
//! own `llama-server`, side by side in one run, as a new user would start
//! each: the same model, two threads each, llama-server with `-np 8 -kvu`
//! and its defaults otherwise, ours with its defaults (our store, KV8).
//! Measurements alternate between the two, rep by rep, while the other
//! server idles; every figure is the client's (streamed responses).
//!
//! - decode tok/s of one stream, and the aggregate of eight, over short
//!   prompts and over 800-token contexts of their own (cached first);
//! - a cold 1,700-token prompt: time to first token and prompt tok/s;
//! - the same prompt again with another ending (warm prefix): TTFT.
//!
//! Both are spoken to over the OpenAI API they both serve (`POST
//! /v1/completions`, token ids in, server-sent events out) by the same
//! client (`openai_client.rs`), on 127.0.0.1.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use siliceo_core::TokenId;
use siliceo_engine::{Model, ModelOptions};

use crate::median;
use crate::openai_client::{Timing, completions, serve_http};

struct LlamaServer {
    child: Child,
    port: u16,
}

impl Drop for LlamaServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

fn start_llama_server(bin: &Path, model: &Path, threads: u32) -> Result<LlamaServer> {
    let port = free_port()?;
    let t = threads.to_string();
    let child = Command::new(bin)
        .args(["-m"])
        .arg(model)
        .args(["-t", &t, "-tb", &t, "-np", "8", "-kvu", "-c", "8192"])
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("cannot start {}", bin.display()))?;
    let server = LlamaServer { child, port };
    let deadline = Instant::now() + Duration::from_secs(120);
    while Instant::now() < deadline {
        if let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) {
            let _ = write!(
                s,
                "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
            );
            let mut line = String::new();
            if BufReader::new(s).read_line(&mut line).is_ok() && line.contains(" 200 ") {
                return Ok(server);
            }
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    bail!("llama-server did not become healthy in 2 minutes")
}

/// Each stream's own context in the long-context decode row: eight of them
/// and their 128 generated tokens fit both servers' 8,192 KV tokens.
const CTX_TOKENS: usize = 800;

/// Options of `siliceo-bench peer`.
#[derive(Debug, Clone)]
pub struct PeerBench {
    /// The model both serve.
    pub model: PathBuf,
    /// llama.cpp's `llama-server` binary.
    pub llama_server: PathBuf,
    /// Median of this many runs.
    pub reps: usize,
    /// Threads each server uses.
    pub threads: u32,
}

/// Runs the comparison and prints a markdown table.
pub fn peer(b: &PeerBench) -> Result<()> {
    let model = Model::load(&b.model, &ModelOptions::default())?;
    let llama = start_llama_server(&b.llama_server, &b.model, b.threads)?;
    let mut cfg = siliceo_runtime::RuntimeConfig::new(&b.model);
    cfg.context.n_ctx = 8192;
    cfg.context.n_batch = 512;
    cfg.context.n_ubatch = 512;
    cfg.context.n_threads = Some(b.threads);
    cfg.context.n_threads_batch = Some(b.threads);
    cfg.scheduler.max_batch_tokens = 512;
    cfg.scheduler.max_running_seqs = 16;
    let rt = std::sync::Arc::new(siliceo_runtime::Runtime::start(cfg)?);
    let tokio = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let ours = serve_http(&tokio, rt.clone())?;
    let theirs = SocketAddr::from(([127, 0, 0, 1], llama.port));
    let short = |i: usize| -> Result<Vec<TokenId>> {
        Ok(model.tokenize(
            &format!("{} (stream {i})", crate::PROMPTS[i % crate::PROMPTS.len()]),
            true,
        )?)
    };
    let long_of = |len: usize, tag: &str, suffix: &str| -> Result<Vec<TokenId>> {
        let mut t = model.tokenize(&format!("Session {tag}. "), true)?;
        let piece = model.tokenize(
            " The harbour committee reviewed the accounts, the pier repairs, the ferry \
             timetable and the letters about the market square.",
            false,
        )?;
        while t.len() < len {
            t.extend(&piece);
        }
        t.truncate(len);
        t.extend(model.tokenize(suffix, false)?);
        Ok(t)
    };
    let long = |tag: &str, suffix: &str| long_of(1700, tag, suffix);
    // Each side runs its prompts at once.
    let run_llama = |prompts: Vec<Vec<TokenId>>, n_gen: u32| completions(theirs, prompts, n_gen);
    let run_ours = |prompts: Vec<Vec<TokenId>>, n_gen: u32| completions(ours, prompts, n_gen);
    // Warm both up (first requests pay one-time costs).
    run_llama(vec![short(0)?], 8)?;
    run_ours(vec![short(0)?], 8)?;
    let decode_rate = |t: &[Timing]| {
        let first = t.iter().map(|x| x.ttft_ms).fold(f64::MAX, f64::min);
        let last = t.iter().map(|x| x.end_ms).fold(0.0, f64::max);
        let n: u32 = t.iter().map(|x| x.tokens.saturating_sub(1)).sum();
        f64::from(n) * 1000.0 / (last - first).max(1e-9)
    };
    let (mut l1, mut o1, mut l8, mut o8) = (vec![], vec![], vec![], vec![]);
    let (mut l8c, mut o8c) = (vec![], vec![]);
    let (mut lc, mut oc, mut lw, mut ow) = (vec![], vec![], vec![], vec![]);
    for rep in 0..b.reps {
        l1.push(decode_rate(&run_llama(vec![short(rep)?], 128)?));
        o1.push(decode_rate(&run_ours(vec![short(rep)?], 128)?));
        let eight = |k: usize| (0..8).map(|i| short(k * 8 + i)).collect::<Result<Vec<_>>>();
        l8.push(decode_rate(&run_llama(eight(rep)?, 128)?));
        o8.push(decode_rate(&run_ours(eight(rep)?, 128)?));
        // Eight streams over contexts of their own: each prompt is sent
        // once first (both servers cache it), so the timed run is decode.
        let ctx = |side: &str| {
            (0..8)
                .map(|i| {
                    long_of(
                        CTX_TOKENS,
                        &format!("{side}{rep}-{i}"),
                        crate::PROMPTS[i % crate::PROMPTS.len()],
                    )
                })
                .collect::<Result<Vec<_>>>()
        };
        let (cl, co) = (ctx("CL")?, ctx("CO")?);
        run_llama(cl.clone(), 1)?;
        run_ours(co.clone(), 1)?;
        l8c.push(decode_rate(&run_llama(cl, 128)?));
        o8c.push(decode_rate(&run_ours(co, 128)?));
        // A cold prompt each, then the same with another ending.
        let (tag_l, tag_o) = (format!("L{rep}"), format!("O{rep}"));
        lc.push(run_llama(vec![long(&tag_l, " First question?")?], 8)?[0].ttft_ms);
        oc.push(run_ours(vec![long(&tag_o, " First question?")?], 8)?[0].ttft_ms);
        lw.push(run_llama(vec![long(&tag_l, " Second question, please?")?], 8)?[0].ttft_ms);
        ow.push(run_ours(vec![long(&tag_o, " Second question, please?")?], 8)?[0].ttft_ms);
    }
    let (l1, o1, l8, o8) = (median(l1), median(o1), median(l8), median(o8));
    let (l8c, o8c) = (median(l8c), median(o8c));
    let (lc, oc, lw, ow) = (median(lc), median(oc), median(lw), median(ow));
    println!();
    println!(
        "### {} · {} threads each · median of {} · alternating · the same OpenAI client (streamed /v1/completions) on both",
        model.name(),
        b.threads,
        b.reps
    );
    println!();
    println!(
        "| | llama-server (-np 8 -kvu) | siliceo ({}) | siliceo / llama-server |",
        rt.info().kv_format
    );
    println!("|---|---:|---:|---:|");
    println!(
        "| decode, 1 stream (tok/s) | {l1:.1} | {o1:.1} | {:.2}× |",
        o1 / l1
    );
    println!(
        "| decode, 8 streams (tok/s, all) | {l8:.1} | {o8:.1} | {:.2}× |",
        o8 / l8
    );
    println!(
        "| decode, 8 streams over {CTX_TOKENS}-token contexts of their own (tok/s, all) | {l8c:.1} | {o8c:.1} | {:.2}× |",
        o8c / l8c
    );
    println!(
        "| cold 1,700-token prompt: TTFT ms (prompt tok/s) | {lc:.0} ({:.0}) | {oc:.0} ({:.0}) | {:.2}× speed |",
        1700.0 * 1000.0 / lc,
        1700.0 * 1000.0 / oc,
        lc / oc
    );
    println!(
        "| warm prefix, new ending: TTFT ms | {lw:.0} | {ow:.0} | {:.2}× speed |",
        lw / ow
    );
    println!("| warm/cold TTFT | {:.1}× | {:.1}× | |", lc / lw, oc / ow);
    Ok(())
}
