//! The gRPC server of siliceo-infer.
//!
//! Serves `proto/siliceo/v1/inference.proto` (package `siliceo.v1`, service
//! `Inference`) over a [`Runtime`] with tonic, next to the standard
//! `grpc.health.v1` health service and server reflection (v1 and v1alpha, so
//! `grpcurl -plaintext 127.0.0.1:50051 list` works with no .proto at hand).
//! Optional: an API key (`authorization: Bearer <key>`, compared in constant
//! time) on the `Inference` service, and Prometheus metrics on a separate port.
//!
//! ```no_run
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use siliceo_runtime::{Runtime, RuntimeConfig};
//! use siliceo_server::{ServerConfig, serve};
//!
//! let rt = Arc::new(Runtime::start(RuntimeConfig::new("models/SmolLM2-135M-Instruct.Q4_1.gguf"))?);
//! serve(rt, ServerConfig::default(), async { let _ = tokio::signal::ctrl_c().await; }).await?;
//! # Ok(()) }
//! ```
//!
//! **Architecture invariant:** the only crate that knows the proto; mapping
//! errors to `tonic::Status` happens here and nowhere else.
#![deny(missing_docs)]

mod metrics;
mod service;
pub mod vllm;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

pub use service::{GenerateStream, InferenceService};
pub use siliceo_core::ApiKeys;
pub use siliceo_core::TlsIdentity;
use siliceo_runtime::{EmbeddingService, Rejected, Runtime, RuntimeError};
use tokio::net::TcpListener;
use tonic::{Request, Status};

/// Generated types and stubs of `siliceo.v1` (server and client).
#[allow(missing_docs, clippy::all)]
pub mod pb {
    tonic::include_proto!("siliceo.v1");

    /// The encoded file descriptor set (for reflection).
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        tonic::include_file_descriptor_set!("siliceo_v1_descriptor");
}

/// How the server listens and guards itself.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// gRPC address (default `127.0.0.1:50051`).
    pub listen: SocketAddr,
    /// When any, every `Inference` call needs `authorization: Bearer <key>`
    /// with one of them.
    pub api_keys: ApiKeys,
    /// Prometheus metrics address (`GET /metrics`); off when `None`.
    pub metrics_listen: Option<SocketAddr>,
    /// Largest request message, in bytes (default 4 MiB); larger ones get
    /// `INVALID_ARGUMENT`.
    pub max_request_bytes: usize,
    /// On shutdown, in-flight streams get this long to finish before they are
    /// cancelled (default 10 s).
    pub shutdown_grace: Duration,
    /// Serve gRPC over TLS (rustls) with this certificate chain and key.
    pub tls: Option<TlsIdentity>,
    /// The embedding model behind `Embed` and `Rerank`; without one they
    /// answer `UNIMPLEMENTED`.
    pub embeddings: Option<Arc<EmbeddingService>>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 50051)),
            api_keys: ApiKeys::default(),
            metrics_listen: None,
            max_request_bytes: 4 << 20,
            shutdown_grace: Duration::from_secs(10),
            tls: None,
            embeddings: None,
        }
    }
}

/// Server failures (binding, transport).
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// Could not bind an address.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// The transport failed.
    #[error("gRPC transport: {0}")]
    Transport(#[from] tonic::transport::Error),
    /// Reflection could not be built from the descriptor set.
    #[error("reflection: {0}")]
    Reflection(String),
}

/// The gRPC status for a runtime error: `INVALID_ARGUMENT` naming the field,
/// `RESOURCE_EXHAUSTED` for a full queue or a request larger than the whole
/// cache, `ALREADY_EXISTS` for a duplicate id, `UNAVAILABLE` when stopping,
/// `INTERNAL` for engine failures.
pub fn status_of(e: &RuntimeError) -> Status {
    match e {
        RuntimeError::InvalidRequest { field, reason } => {
            Status::invalid_argument(format!("{field}: {reason}"))
        }
        RuntimeError::ContextLengthExceeded { field, .. } => {
            Status::invalid_argument(format!("{field}: {e}"))
        }
        RuntimeError::Rejected(r) => match r {
            Rejected::DuplicateId(_) => Status::already_exists(r.to_string()),
            Rejected::PromptTooLong { .. } | Rejected::EmptyPrompt(_) => {
                Status::invalid_argument(format!("prompt: {r}"))
            }
            _ => Status::resource_exhausted(r.to_string()),
        },
        RuntimeError::Stopped => Status::unavailable("the engine has stopped"),
        RuntimeError::Start(m) | RuntimeError::Engine(m) => Status::internal(m.clone()),
        other => Status::internal(other.to_string()),
    }
}

/// `INVALID_ARGUMENT` for a message over `limit` bytes.
pub(crate) fn check_size<M: prost::Message>(m: &M, limit: usize) -> Result<(), Status> {
    let n = m.encoded_len();
    if n > limit {
        return Err(Status::invalid_argument(format!(
            "request: message of {n} bytes exceeds the limit of {limit} bytes"
        )));
    }
    Ok(())
}

/// Runs a blocking runtime call on tokio's blocking pool, its error as a status.
pub(crate) async fn blocking<T: Send + 'static>(
    rt: &Arc<Runtime>,
    f: impl FnOnce(&Runtime) -> Result<T, RuntimeError> + Send + 'static,
) -> Result<T, Status> {
    let rt = rt.clone();
    tokio::task::spawn_blocking(move || f(&rt))
        .await
        .map_err(|_| Status::internal("the request handler failed"))?
        .map_err(|e| status_of(&e))
}

/// `svc` behind the API key check, when there is a key.
fn keyed<S>(
    svc: S,
    keys: ApiKeys,
) -> tonic::service::interceptor::InterceptedService<
    S,
    impl FnMut(Request<()>) -> Result<Request<()>, Status> + Clone,
> {
    tonic::service::interceptor::InterceptedService::new(svc, move |req: Request<()>| {
        if keys.is_empty() {
            Ok(req)
        } else {
            check_key(&keys, &req).map(|()| req)
        }
    })
}

/// Checks `authorization: Bearer <key>`.
fn check_key(keys: &ApiKeys, req: &Request<()>) -> Result<(), Status> {
    let given = req
        .metadata()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .ok_or_else(|| Status::unauthenticated("missing `authorization: Bearer <key>`"))?;
    if keys.accepts(given) {
        Ok(())
    } else {
        Err(Status::unauthenticated("wrong API key"))
    }
}

/// Binds `cfg.listen` and serves until `shutdown` resolves; see [`serve_on`].
pub async fn serve(
    rt: Arc<Runtime>,
    cfg: ServerConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    let listener = TcpListener::bind(cfg.listen)
        .await
        .map_err(|source| ServerError::Bind {
            addr: cfg.listen,
            source,
        })?;
    serve_on(listener, rt, cfg, shutdown).await
}

/// Serves on an already bound listener until `shutdown` resolves. Then the
/// health service reports `NOT_SERVING`, no new connection is accepted,
/// in-flight streams get `cfg.shutdown_grace` to finish, and whatever is left
/// is cancelled (its clients get a final `CANCELLED` message). Returns when
/// every connection has closed.
pub async fn serve_on(
    listener: TcpListener,
    rt: Arc<Runtime>,
    cfg: ServerConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    let addr = listener.local_addr().map_err(|source| ServerError::Bind {
        addr: cfg.listen,
        source,
    })?;
    if let Some(maddr) = cfg.metrics_listen {
        let ml = TcpListener::bind(maddr)
            .await
            .map_err(|source| ServerError::Bind {
                addr: maddr,
                source,
            })?;
        let local = ml.local_addr().unwrap_or(maddr);
        tracing::info!(%local, "metrics on http://{local}/metrics");
        tokio::spawn(metrics::serve_metrics(ml, rt.clone()));
    }
    let svc = InferenceService::new(rt.clone(), cfg.max_request_bytes)
        .with_embeddings(cfg.embeddings.clone());
    // tonic's own hard cap; requests between our limit and this one get a
    // clear INVALID_ARGUMENT from the services.
    let decode_cap = cfg.max_request_bytes.saturating_mul(4).max(1 << 20);
    let inference = keyed(
        pb::inference_server::InferenceServer::new(svc).max_decoding_message_size(decode_cap),
        cfg.api_keys.clone(),
    );
    // SMG's engine protocol beside ours, under the same API key.
    let vllm = keyed(
        vllm::vpb::vllm_engine_server::VllmEngineServer::new(vllm::VllmEngineService::new(
            rt.clone(),
            cfg.max_request_bytes,
        ))
        .max_decoding_message_size(decode_cap),
        cfg.api_keys.clone(),
    );
    let (health, health_svc) = tonic_health::server::health_reporter();
    health
        .set_serving::<pb::inference_server::InferenceServer<InferenceService>>()
        .await;
    let reflection = |v1: bool| {
        let b = tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(pb::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(vllm::vpb::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET);
        if v1 {
            b.build_v1().map(|s| (Some(s), None))
        } else {
            b.build_v1alpha().map(|s| (None, Some(s)))
        }
        .map_err(|e| ServerError::Reflection(e.to_string()))
    };
    let (Some(refl_v1), None) = reflection(true)? else {
        unreachable!()
    };
    let (None, Some(refl_v1alpha)) = reflection(false)? else {
        unreachable!()
    };
    let grace = cfg.shutdown_grace;
    let rt_stop = rt.clone();
    let (stopping_tx, stopping_rx) = tokio::sync::oneshot::channel::<()>();
    let signal = async move {
        shutdown.await;
        tracing::info!("shutting down: no new connections; draining streams for up to {grace:?}");
        health
            .set_not_serving::<pb::inference_server::InferenceServer<InferenceService>>()
            .await;
        let _ = stopping_tx.send(());
        // After the grace period, cancel what is still running so every
        // stream ends and the server can close.
        tokio::spawn(async move {
            tokio::time::sleep(grace).await;
            let _ = tokio::task::spawn_blocking(move || rt_stop.cancel_all()).await;
        });
    };
    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = &cfg.tls {
        builder = builder.tls_config(tonic::transport::ServerTlsConfig::new().identity(
            tonic::transport::Identity::from_pem(&tls.cert_pem, &tls.key_pem),
        ))?;
    }
    tracing::info!(%addr, tls = cfg.tls.is_some(), "siliceo gRPC server ready on {addr}");
    let server = builder
        .add_service(health_svc)
        .add_service(refl_v1)
        .add_service(refl_v1alpha)
        .add_service(inference)
        .add_service(vllm)
        .serve_with_incoming_shutdown(
            // TCP_NODELAY: without it a small unary reply (Embed, Tokenize)
            // waits on the client's delayed ACK, ~40 ms per call.
            tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
            signal,
        );
    // Connections whose clients never answer the GOAWAY would hold a graceful
    // shutdown open forever: past the grace period plus a little for the
    // cancelled streams' last messages, they are dropped.
    let deadline = async move {
        if stopping_rx.await.is_ok() {
            tokio::time::sleep(grace + Duration::from_secs(2)).await;
        } else {
            std::future::pending::<()>().await;
        }
    };
    tokio::select! {
        r = server => r?,
        () = deadline => tracing::warn!("closing connections that did not finish in time"),
    }
    tracing::info!("server stopped");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constant_time_eq_compares_bytes() {
        assert!(siliceo_core::constant_time_eq(b"secret", b"secret"));
        assert!(!siliceo_core::constant_time_eq(b"secret", b"secreT"));
        assert!(!siliceo_core::constant_time_eq(b"secret", b"secret!"));
        assert!(siliceo_core::constant_time_eq(b"", b""));
    }

    #[test]
    fn keys_are_checked_from_bearer_metadata() {
        let mut req = Request::new(());
        let keys = ApiKeys::new(["k".to_string(), "k2".to_string()]);
        assert_eq!(
            check_key(&keys, &req).unwrap_err().code(),
            tonic::Code::Unauthenticated
        );
        req.metadata_mut()
            .insert("authorization", "Bearer nope".parse().unwrap());
        assert_eq!(
            check_key(&keys, &req).unwrap_err().code(),
            tonic::Code::Unauthenticated
        );
        for k in ["k", "k2"] {
            req.metadata_mut()
                .insert("authorization", format!("Bearer {k}").parse().unwrap());
            assert!(check_key(&keys, &req).is_ok());
        }
    }

    #[test]
    fn runtime_errors_map_to_typed_statuses() {
        let inv = RuntimeError::InvalidRequest {
            field: "top_p",
            reason: "must be in (0, 1]".into(),
        };
        let s = status_of(&inv);
        assert_eq!(s.code(), tonic::Code::InvalidArgument);
        assert!(s.message().starts_with("top_p:"), "{}", s.message());
        let id = || siliceo_core::RequestId("r1".into());
        let full = RuntimeError::Rejected(Rejected::QueueFull(id()));
        assert_eq!(status_of(&full).code(), tonic::Code::ResourceExhausted);
        let dup = RuntimeError::Rejected(Rejected::DuplicateId(id()));
        assert_eq!(status_of(&dup).code(), tonic::Code::AlreadyExists);
        let long = RuntimeError::ContextLengthExceeded {
            field: "max_tokens",
            prompt_tokens: 10,
            max_tokens: 100_000,
            n_ctx: 4096,
        };
        let s = status_of(&long);
        assert_eq!(s.code(), tonic::Code::InvalidArgument);
        assert!(
            s.message()
                .starts_with("max_tokens: the prompt's 10 tokens"),
            "{}",
            s.message()
        );
        assert_eq!(
            status_of(&RuntimeError::Stopped).code(),
            tonic::Code::Unavailable
        );
    }
}
