//! Prometheus metrics on a port of their own (`--metrics-listen`): the
//! runtime's exposition ([`Runtime::prometheus`]), which counts requests of
//! every protocol, served by a small HTTP/1.1 responder (`GET /metrics`).

use std::sync::Arc;

use siliceo_runtime::Runtime;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// Serves `GET /metrics` (anything else: 404) until the process ends.
pub async fn serve_metrics(listener: TcpListener, rt: Arc<Runtime>) {
    loop {
        let Ok((mut sock, _)) = listener.accept().await else {
            continue;
        };
        let rt = rt.clone();
        tokio::spawn(async move {
            let mut buf = vec![0u8; 4096];
            let mut n = 0;
            // Read until the end of the request head (or the buffer is full).
            while n < buf.len() {
                match sock.read(&mut buf[n..]).await {
                    Ok(0) | Err(_) => break,
                    Ok(k) => n += k,
                }
                if buf[..n].windows(4).any(|w| w == b"\r\n\r\n") {
                    break;
                }
            }
            let head = String::from_utf8_lossy(&buf[..n]);
            let ok = head.starts_with("GET /metrics ") || head.starts_with("GET / ");
            let (status, body) = if ok {
                let body = tokio::task::spawn_blocking(move || rt.prometheus())
                    .await
                    .unwrap_or_default();
                ("200 OK", body)
            } else {
                ("404 Not Found", "not found; try /metrics\n".to_string())
            };
            let resp = format!(
                "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = sock.write_all(resp.as_bytes()).await;
            let _ = sock.shutdown().await;
        });
    }
}
