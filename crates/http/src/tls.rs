//! HTTPS: the API over rustls (with ring, as gRPC's TLS), from the same PEM
//! certificate chain and key as gRPC (`--tls-cert`, `--tls-key`).

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use siliceo_core::TlsIdentity;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

/// A client gets this long to finish its handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

fn bad(what: &str, e: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, format!("TLS {what}: {e}"))
}

/// The server side of TLS for `id`: HTTP/1.1 (the API's only protocol).
pub(crate) fn acceptor(id: &TlsIdentity) -> io::Result<TlsAcceptor> {
    let certs = CertificateDer::pem_slice_iter(&id.cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad("certificate", e))?;
    if certs.is_empty() {
        return Err(bad("certificate", "no PEM certificate found"));
    }
    let key = PrivateKeyDer::from_pem_slice(&id.key_pem).map_err(|e| bad("key", e))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| bad("setup", e))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| bad("certificate and key", e))?;
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(cfg)))
}

/// Accepts TCP connections and runs their handshakes side by side, so a slow
/// or broken client delays only itself; `accept` yields finished ones.
#[derive(Debug)]
pub(crate) struct TlsListener {
    ready: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    local: SocketAddr,
    acceptor: JoinHandle<()>,
}

impl TlsListener {
    pub(crate) fn new(tcp: TcpListener, tls: TlsAcceptor) -> io::Result<TlsListener> {
        let local = tcp.local_addr()?;
        let (tx, ready) = mpsc::channel(64);
        let acceptor = tokio::spawn(async move {
            while !tx.is_closed() {
                let (sock, addr) = match tcp.accept().await {
                    Ok(c) => c,
                    Err(e) => {
                        // Out of file descriptors, say: wait a little.
                        tracing::warn!(error = %e, "accepting an HTTPS connection failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let (tls, tx) = (tls.clone(), tx.clone());
                tokio::spawn(async move {
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, tls.accept(sock)).await {
                        Ok(Ok(stream)) => {
                            let _ = tx.send((stream, addr)).await;
                        }
                        Ok(Err(e)) => tracing::debug!(%addr, error = %e, "TLS handshake failed"),
                        Err(_) => tracing::debug!(%addr, "TLS handshake timed out"),
                    }
                });
            }
        });
        Ok(TlsListener {
            ready,
            local,
            acceptor,
        })
    }
}

impl Drop for TlsListener {
    fn drop(&mut self) {
        self.acceptor.abort();
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.ready.recv().await {
            Some(c) => c,
            // The acceptor task is gone (only when the listener is dropped).
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.local)
    }
}
