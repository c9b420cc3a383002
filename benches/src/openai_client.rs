//! The few lines of an OpenAI client a benchmark needs: one streamed
//! `POST /v1/completions` (token ids in, server-sent events out) over a
//! blocking socket, timed as the client sees it. The same code speaks to our
//! HTTP API and to llama-server's, so neither side gets another client.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Instant;

use anyhow::{Context as _, Result, bail};
use siliceo_core::TokenId;

/// One streamed completion as the client saw it.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    /// Submit to first generated text, ms (from `t0`).
    pub ttft_ms: f64,
    /// Submit to the end of the stream, ms (from `t0`).
    pub end_ms: f64,
    /// Tokens generated: the usage chunk's count, or (a server that sends
    /// none) the chunks that carried text, one token each.
    pub tokens: u32,
}

/// A greedy completion of exactly `n` tokens (`ignore_eos`) of `prompt`,
/// streamed with a usage chunk; `t0` is the clock both times count from.
pub fn completion(addr: SocketAddr, prompt: &[TokenId], n: u32, t0: Instant) -> Result<Timing> {
    let ids: Vec<u32> = prompt.iter().map(|t| t.0).collect();
    let body = serde_json::json!({
        "prompt": ids,
        "max_tokens": n,
        "temperature": 0.0,
        "ignore_eos": true,
        "stream": true,
        "stream_options": {"include_usage": true},
    })
    .to_string();
    let mut s = TcpStream::connect(addr)?;
    s.set_nodelay(true)?;
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut r = BufReader::new(s);
    let mut line = String::new();
    r.read_line(&mut line)?;
    if !line.contains(" 200 ") {
        bail!("{addr} answered {}", line.trim());
    }
    let (mut first, mut tokens, mut chunks) = (None, None, 0u32);
    // Each event arrives in one chunk of the chunked body, so its `data:`
    // line is whole; the chunk-size lines around it are skipped.
    loop {
        line.clear();
        if r.read_line(&mut line)? == 0 {
            break;
        }
        let Some(data) = line.trim().strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            break;
        }
        let v: serde_json::Value =
            serde_json::from_str(data).with_context(|| format!("event `{data}`"))?;
        if v["choices"][0]["text"]
            .as_str()
            .is_some_and(|t| !t.is_empty())
        {
            first.get_or_insert(t0.elapsed().as_secs_f64() * 1000.0);
            chunks += 1;
        }
        if let Some(k) = v["usage"]["completion_tokens"].as_u64() {
            tokens = Some(k as u32);
        }
    }
    Ok(Timing {
        ttft_ms: first.context("the stream carried no text")?,
        end_ms: t0.elapsed().as_secs_f64() * 1000.0,
        tokens: tokens.unwrap_or(chunks),
    })
}

/// Serves `rt`'s OpenAI API on a loopback port of `tokio`'s; returns where.
pub fn serve_http(
    tokio: &tokio::runtime::Runtime,
    rt: std::sync::Arc<siliceo_runtime::Runtime>,
) -> Result<SocketAddr> {
    let listener = tokio.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
    let addr = listener.local_addr()?;
    tokio.spawn(siliceo_http::serve_on(
        listener,
        rt,
        siliceo_http::HttpConfig::default(),
        std::future::pending(),
    ));
    Ok(addr)
}

/// `completion` of every prompt at once, one thread each.
pub fn completions(addr: SocketAddr, prompts: Vec<Vec<TokenId>>, n: u32) -> Result<Vec<Timing>> {
    let t0 = Instant::now();
    let handles: Vec<_> = prompts
        .into_iter()
        .map(|p| std::thread::spawn(move || completion(addr, &p, n, t0)))
        .collect();
    handles
        .into_iter()
        .map(|h| {
            h.join()
                .map_err(|_| anyhow::anyhow!("client thread panicked"))?
        })
        .collect()
}
