//! The gRPC server end to end: a real runtime on the real model, the real
//! server on a real socket on 127.0.0.1, and the generated client.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use siliceo_core::TokenId;
use siliceo_engine::{GreedyTrace, Model, ModelOptions};
use siliceo_runtime::{Runtime, RuntimeConfig};
use siliceo_server::pb::inference_client::InferenceClient;
use siliceo_server::pb::{self, generate_request::Input};
use siliceo_server::{ServerConfig, serve_on};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::oneshot;
use tonic::Code;
use tonic::transport::Channel;

mod embed;

/// This package's folder in the checkout the tests run in: cargo sets it when
/// it runs a test. A test binary built in another checkout that shares the
/// target directory must not read that checkout's models.
pub fn manifest_dir() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from)
}

fn model_path() -> PathBuf {
    std::env::var_os("SILICEO_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| manifest_dir().join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf"))
}

struct TestServer {
    addr: std::net::SocketAddr,
    metrics: Option<std::net::SocketAddr>,
    stop: Option<oneshot::Sender<()>>,
    done: tokio::task::JoinHandle<Result<(), siliceo_server::ServerError>>,
    rt: Arc<Runtime>,
}

impl TestServer {
    async fn start(cfg: ServerConfig) -> TestServer {
        let mut rc = RuntimeConfig::new(model_path());
        rc.context.n_ctx = 2048;
        rc.scheduler.max_running_seqs = 16;
        let rt = Arc::new(
            tokio::task::spawn_blocking(move || Runtime::start(rc))
                .await
                .unwrap()
                .unwrap(),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        // Metrics on a port of their own, found by binding :0 first.
        let metrics = match cfg.metrics_listen {
            Some(_) => {
                let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
                Some(l.local_addr().unwrap())
            }
            None => None,
        };
        let cfg = ServerConfig {
            metrics_listen: metrics,
            ..cfg
        };
        let (tx, rx) = oneshot::channel();
        let done = tokio::spawn(serve_on(listener, rt.clone(), cfg, async {
            let _ = rx.await;
        }));
        TestServer {
            addr,
            metrics,
            stop: Some(tx),
            done,
            rt,
        }
    }

    async fn client(&self) -> InferenceClient<Channel> {
        for _ in 0..100 {
            if let Ok(c) = InferenceClient::connect(format!("http://{}", self.addr)).await {
                return c;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("server at {} never accepted", self.addr);
    }

    /// A plaintext client, connected lazily (for a TLS server it cannot work).
    async fn client_plain_attempt(&self) -> InferenceClient<Channel> {
        InferenceClient::new(
            Channel::from_shared(format!("http://{}", self.addr))
                .unwrap()
                .connect_lazy(),
        )
    }

    async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        self.done.await.unwrap().unwrap();
    }
}

/// A `max_tokens` that keeps a stream going for many seconds, yet fits the
/// context of 2,048 tokens beside a short prompt.
const LONG: u32 = 2000;

/// A function tool on the wire (`parameters`: its schema's text).
fn tool(name: &str, parameters: &str) -> pb::Tool {
    pb::Tool {
        name: name.into(),
        description: String::new(),
        parameters: parameters.into(),
    }
}

/// A chat of `messages` (a request for 4 tokens).
fn chat_req(messages: Vec<pb::ChatMessage>) -> pb::GenerateRequest {
    pb::GenerateRequest {
        input: Some(Input::Chat(pb::ChatMessages { messages })),
        ..prompt_req("", 4)
    }
}

/// A message of `role` saying `content`.
fn said(role: &str, content: &str) -> pb::ChatMessage {
    pb::ChatMessage {
        role: role.into(),
        content: content.into(),
        ..Default::default()
    }
}

/// A one-message chat offering `t`, with `tool_choice`.
fn chat_with_tools(t: pb::Tool, tool_choice: &str) -> pb::GenerateRequest {
    pb::GenerateRequest {
        tools: vec![t],
        tool_choice: tool_choice.into(),
        ..chat_req(vec![said("user", "Weather in Paris?")])
    }
}

fn prompt_req(p: &str, max_tokens: u32) -> pb::GenerateRequest {
    pb::GenerateRequest {
        input: Some(Input::Prompt(p.to_string())),
        max_tokens,
        ignore_eos: true,
        ..Default::default()
    }
}

/// Text, tokens and the final message of one streamed generation.
async fn collect(
    c: &mut InferenceClient<Channel>,
    req: pb::GenerateRequest,
) -> Result<(String, Vec<TokenId>, pb::GenerateResponse), tonic::Status> {
    let mut s = c.generate(req).await?.into_inner();
    let (mut text, mut toks) = (String::new(), Vec::new());
    while let Some(m) = s.message().await? {
        if m.usage.is_some() {
            return Ok((text, toks, m));
        }
        text.push_str(&m.text);
        toks.extend(m.token_ids.iter().map(|t| TokenId(*t)));
    }
    panic!("the stream ended without a final message");
}

/// Opens a generation stream and waits for its first message.
async fn open_stream(
    c: &mut InferenceClient<Channel>,
    req: pb::GenerateRequest,
) -> (tonic::Streaming<pb::GenerateResponse>, pb::GenerateResponse) {
    let mut s = c.generate(req).await.unwrap().into_inner();
    let first = s.message().await.unwrap().expect("a first message");
    (s, first)
}

/// Reads a generation stream up to its final message (the one with usage).
async fn final_message(s: &mut tonic::Streaming<pb::GenerateResponse>) -> pb::GenerateResponse {
    loop {
        let m = s.message().await.unwrap().expect("a final message");
        if m.usage.is_some() {
            return m;
        }
    }
}

async fn wait_idle(c: &mut InferenceClient<Channel>) -> pb::KvStats {
    // Bounded polling for a state change, not a timing assertion.
    let mut last = None;
    for _ in 0..500 {
        let kv = c
            .get_model_info(pb::GetModelInfoRequest {})
            .await
            .unwrap()
            .into_inner()
            .kv
            .unwrap();
        if kv.running == 0 && kv.waiting == 0 && kv.used_blocks == 0 {
            return kv;
        }
        last = Some(kv);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("the server never became idle: {last:?}");
}

const PROMPTS: [&str; 16] = [
    "The three primary colours are",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The capital of Japan is",
    "Water boils at",
    "My favourite programming language is",
    "The quick brown fox",
    "In 1969, the first humans",
    "A good breakfast contains",
    "The largest planet in the solar system",
    "To make a cup of tea, first",
    "The Eiffel Tower is located in",
    "Photosynthesis is the process",
    "Dear hiring manager,",
    "The most important rule of cooking is",
    "import numpy as np\n",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn streams_text_tokens_and_usage() {
    let srv = TestServer::start(ServerConfig::default()).await;
    let mut c = srv.client().await;
    let (mut s, first) = open_stream(&mut c, prompt_req("The capital of France is", 12)).await;
    assert!(
        !first.request_id.is_empty(),
        "the first message names the request"
    );
    let mut text = first.text.clone();
    let mut n = first.token_ids.len();
    let last = loop {
        let m = s.message().await.unwrap().expect("a final message");
        if m.usage.is_some() {
            break m;
        }
        assert!(m.request_id.is_empty());
        text.push_str(&m.text);
        n += m.token_ids.len();
    };
    assert!(
        s.message().await.unwrap().is_none(),
        "nothing after the final message"
    );
    assert_eq!(last.finish_reason, pb::FinishReason::Length as i32);
    assert_eq!(last.request_id, first.request_id);
    let u = last.usage.unwrap();
    assert_eq!(u.completion_tokens, 12);
    assert_eq!(n, 12);
    assert!(u.prompt_tokens > 0 && u.ttft_ms >= u.queue_ms, "{u:?}");
    // The text is the detokenized tokens.
    assert!(!text.is_empty());
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixteen_concurrent_clients_get_their_solo_greedy_outputs() {
    let n = 16;
    let model_refs = tokio::task::spawn_blocking(move || {
        let model = Model::load(model_path(), &ModelOptions::default()).unwrap();
        PROMPTS
            .iter()
            .map(|p| {
                let toks = model.tokenize(p, true).unwrap();
                GreedyTrace::run(&model, &toks, n, 0.5).unwrap()
            })
            .collect::<Vec<_>>()
    })
    .await
    .unwrap();
    let srv = TestServer::start(ServerConfig::default()).await;
    let tasks: Vec<_> = PROMPTS
        .iter()
        .map(|p| {
            let addr = srv.addr;
            let req = prompt_req(p, n);
            tokio::spawn(async move {
                // Each client on its own connection.
                let mut c = InferenceClient::connect(format!("http://{addr}"))
                    .await
                    .unwrap();
                collect(&mut c, req).await.unwrap()
            })
        })
        .collect();
    for (i, t) in tasks.into_iter().enumerate() {
        let (_, toks, last) = t.await.unwrap();
        assert_eq!(last.finish_reason, pb::FinishReason::Length as i32);
        if let Err(e) = model_refs[i].check(&toks) {
            panic!("client {i} ({:?}): {e}", PROMPTS[i]);
        }
    }
    let mut c = srv.client().await;
    wait_idle(&mut c).await;
    srv.rt.check_kv().unwrap();
    srv.stop().await;
}

fn field_error(
    r: Result<(String, Vec<TokenId>, pb::GenerateResponse), tonic::Status>,
) -> (Code, String) {
    let e = r.expect_err("expected an error status");
    (e.code(), e.message().to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_requests_get_invalid_argument_naming_the_field() {
    let srv = TestServer::start(ServerConfig {
        max_request_bytes: 64 * 1024,
        ..ServerConfig::default()
    })
    .await;
    let mut c = srv.client().await;
    let cases: Vec<(pb::GenerateRequest, &str)> = vec![
        (pb::GenerateRequest::default(), "input:"),
        (prompt_req("", 4), "prompt:"),
        (prompt_req(&"word ".repeat(3000), 4), "prompt:"),
        (
            pb::GenerateRequest {
                sampling: Some(pb::SamplingParams {
                    top_p: Some(0.0),
                    ..Default::default()
                }),
                ..prompt_req("hi", 4)
            },
            "top_p:",
        ),
        (
            pb::GenerateRequest {
                sampling: Some(pb::SamplingParams {
                    temperature: Some(-1.0),
                    ..Default::default()
                }),
                ..prompt_req("hi", 4)
            },
            "temperature:",
        ),
        (
            pb::GenerateRequest {
                input: Some(Input::Tokens(pb::TokenIds {
                    ids: vec![9_999_999],
                })),
                ..prompt_req("", 4)
            },
            "tokens:",
        ),
        (
            pb::GenerateRequest {
                stop: (0..17).map(|i| format!("s{i}")).collect(),
                ..prompt_req("hi", 4)
            },
            "stop:",
        ),
        (
            chat_req(vec![said("wizard", "hi")]),
            "chat.messages[0].role:",
        ),
        (
            pb::GenerateRequest {
                priority: 42,
                ..prompt_req("hi", 4)
            },
            "priority:",
        ),
        // Tools: checked on the wire, then against the model's template
        // (SmolLM2's writes no tool calls).
        (chat_with_tools(tool("get_weather", ""), ""), "tools:"),
        (
            chat_with_tools(tool("get weather", ""), ""),
            "tools[0].name:",
        ),
        (
            chat_with_tools(tool("f", "[1]"), ""),
            "tools[0].parameters:",
        ),
        (chat_with_tools(tool("f", "{"), ""), "tools[0].parameters:"),
        (chat_with_tools(tool("f", ""), "g"), "tool_choice:"),
        (
            chat_req(vec![
                said("user", "hi"),
                pb::ChatMessage {
                    role: "assistant".into(),
                    tool_calls: vec![pb::ToolCall {
                        id: "c".into(),
                        name: "f".into(),
                        arguments: "{not json".into(),
                    }],
                    ..Default::default()
                },
            ]),
            "chat.messages[1].tool_calls[0].arguments:",
        ),
        (prompt_req(&"x".repeat(100 * 1024), 4), "request:"),
        // One limit for both protocols: a prompt plus max_tokens over the
        // context is refused, naming the field.
        (
            prompt_req("Once upon a time", 100_000),
            "max_tokens: the prompt's",
        ),
    ];
    for (req, field) in cases {
        let (code, msg) = field_error(collect(&mut c, req).await);
        assert_eq!(code, Code::InvalidArgument, "{field} {msg}");
        assert!(msg.starts_with(field), "expected `{field}…`, got `{msg}`");
    }
    // Still serving, nothing leaked.
    let (text, _, _) = collect(&mut c, prompt_req("The sky is", 4)).await.unwrap();
    assert!(!text.is_empty());
    wait_idle(&mut c).await;
    srv.rt.check_kv().unwrap();
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dropped_streams_and_cancel_free_the_kv_at_once() {
    let srv = TestServer::start(ServerConfig::default()).await;
    let mut c = srv.client().await;
    // A client that goes away mid-stream.
    let (s, first) = open_stream(&mut c, prompt_req("Once upon a time", LONG)).await;
    assert!(!first.text.is_empty() || !first.token_ids.is_empty());
    let during = c
        .get_model_info(pb::GetModelInfoRequest {})
        .await
        .unwrap()
        .into_inner()
        .kv
        .unwrap();
    assert_eq!(during.running, 1);
    assert!(during.used_blocks > 0);
    drop(s);
    wait_idle(&mut c).await;

    // Cancel by id: the stream ends with CANCELLED.
    let mut req = prompt_req("Once upon a time", LONG);
    req.request_id = "to-cancel".into();
    let (mut s, _) = open_stream(&mut c, req).await;
    c.cancel(pb::CancelRequest {
        request_id: "to-cancel".into(),
    })
    .await
    .unwrap();
    let last = final_message(&mut s).await;
    assert_eq!(last.finish_reason, pb::FinishReason::Cancelled as i32);
    wait_idle(&mut c).await;
    let e = c
        .cancel(pb::CancelRequest {
            request_id: "to-cancel".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    srv.rt.check_kv().unwrap();
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tokenize_detokenize_model_info_and_unimplemented_embeddings() {
    let srv = TestServer::start(ServerConfig::default()).await;
    let mut c = srv.client().await;
    let ids = c
        .tokenize(pb::TokenizeRequest {
            text: "Hello, world".into(),
            add_special: false,
        })
        .await
        .unwrap()
        .into_inner()
        .ids;
    assert!(!ids.is_empty());
    let text = c
        .detokenize(pb::DetokenizeRequest { ids })
        .await
        .unwrap()
        .into_inner()
        .text;
    assert_eq!(text, "Hello, world");
    let e = c
        .detokenize(pb::DetokenizeRequest {
            ids: vec![u32::MAX],
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(e.message().starts_with("ids:"), "{}", e.message());
    let info = c
        .get_model_info(pb::GetModelInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.n_layer, 30);
    assert_eq!(info.n_vocab, 49152);
    assert_eq!(info.context_tokens, 2048);
    assert_eq!(info.block_size, 64);
    // The default serves through our store in kv8 (grafted attention).
    assert_eq!(info.kv_backend, "ours");
    assert_eq!(info.kv_type_k, "kv8");
    assert_eq!(info.kv_type_v, "kv8");
    assert!(info.kv_format.starts_with("kv8:kv8"), "{}", info.kv_format);
    assert!(info.kv_store_bytes > 0);
    assert!(info.prefix_caching);
    assert!(info.kv_bytes_per_token > 0);
    assert_eq!(
        info.embedding_model, "",
        "no embedding model in this server"
    );
    let e = c
        .embed(pb::EmbedRequest {
            inputs: vec!["x".into()],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unimplemented);
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn api_key_health_reflection_and_metrics() {
    let srv = TestServer::start(ServerConfig {
        api_keys: siliceo_server::ApiKeys::new(["s3cret".to_string()]),
        metrics_listen: Some("127.0.0.1:0".parse().unwrap()),
        ..ServerConfig::default()
    })
    .await;
    let mut c = srv.client().await;
    let e = collect(&mut c, prompt_req("hi", 2)).await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated);
    let mut req = tonic::Request::new(prompt_req("The sky is", 3));
    req.metadata_mut()
        .insert("authorization", "Bearer s3cret".parse().unwrap());
    let mut s = c.generate(req).await.unwrap().into_inner();
    while s.message().await.unwrap().is_some() {}

    // Health needs no key.
    let channel = Channel::from_shared(format!("http://{}", srv.addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel.clone());
    let st = health
        .check(tonic_health::pb::HealthCheckRequest {
            service: "siliceo.v1.Inference".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .status;
    assert_eq!(
        st,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );

    // Reflection lists the service (what `grpcurl list` asks).
    use tonic_reflection::pb::v1::{
        ServerReflectionRequest, server_reflection_client::ServerReflectionClient,
        server_reflection_request::MessageRequest, server_reflection_response::MessageResponse,
    };
    let mut refl = ServerReflectionClient::new(channel);
    let mut resp = refl
        .server_reflection_info(tokio_stream::iter(vec![ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        }]))
        .await
        .unwrap()
        .into_inner();
    let msg = resp.message().await.unwrap().unwrap();
    let Some(MessageResponse::ListServicesResponse(list)) = msg.message_response else {
        panic!("unexpected reflection answer: {msg:?}");
    };
    let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    assert!(
        names.contains(&"siliceo.v1.Inference".to_string()),
        "{names:?}"
    );
    assert!(
        names.contains(&"grpc.health.v1.Health".to_string()),
        "{names:?}"
    );

    // Metrics over plain HTTP.
    let mut sock = tokio::net::TcpStream::connect(srv.metrics.unwrap())
        .await
        .unwrap();
    sock.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut body = String::new();
    sock.read_to_string(&mut body).await.unwrap();
    assert!(body.starts_with("HTTP/1.1 200 OK"), "{body}");
    assert!(body.contains("siliceo_generated_tokens_total 3"), "{body}");
    assert!(
        body.contains("siliceo_requests_finished_total{reason=\"length\"} 1"),
        "{body}"
    );
    assert!(body.contains("siliceo_kv_blocks_free"), "{body}");
    srv.stop().await;
}

/// Starts a server with `grace`, opens a stream of `max_tokens`, shuts the
/// server down after the first message and returns how the stream ended.
async fn finish_reason_on_shutdown(grace: Duration, prompt: &str, max_tokens: u32) -> i32 {
    let srv = TestServer::start(ServerConfig {
        shutdown_grace: grace,
        ..ServerConfig::default()
    })
    .await;
    let mut c = srv.client().await;
    let (mut s, _) = open_stream(&mut c, prompt_req(prompt, max_tokens)).await;
    let stopping = tokio::spawn(srv.stop());
    let last = final_message(&mut s).await;
    drop(s);
    drop(c);
    stopping.await.unwrap();
    last.finish_reason
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn shutdown_lets_streams_finish_then_cancels_what_is_left() {
    // A short stream finishes inside the grace period…
    let short =
        finish_reason_on_shutdown(Duration::from_secs(120), "Counting: one, two,", 24).await;
    assert_eq!(short, pb::FinishReason::Length as i32);
    // …an endless one is cancelled when the grace period runs out.
    let endless =
        finish_reason_on_shutdown(Duration::from_millis(300), "Once upon a time", LONG).await;
    assert_eq!(endless, pb::FinishReason::Cancelled as i32);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tls_serves_clients_that_trust_the_certificate() {
    use tonic::transport::{Certificate, ClientTlsConfig};
    // A test CA and a localhost certificate it signs, made by the openssl CLI
    // (rustls wants a real chain: a self-signed CA is refused as an end entity).
    let dir = std::env::temp_dir().join(format!("siliceo-tls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let openssl = |args: &[&str]| {
        let out = std::process::Command::new("openssl")
            .args(args)
            .current_dir(&dir)
            .output()
            .expect("the openssl command line (Debian package openssl)");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
    ];
    openssl(
        &[
            &["req", "-x509"][..],
            &ec,
            &[
                "-days",
                "1",
                "-subj",
                "/CN=siliceo test CA",
                "-keyout",
                "ca.key",
                "-out",
                "ca.pem",
            ],
        ]
        .concat(),
    );
    openssl(
        &[
            &["req"][..],
            &ec,
            &[
                "-subj",
                "/CN=localhost",
                "-keyout",
                "key.pem",
                "-out",
                "leaf.csr",
            ],
        ]
        .concat(),
    );
    std::fs::write(
        dir.join("ext.cnf"),
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n",
    )
    .unwrap();
    openssl(&[
        "x509",
        "-req",
        "-in",
        "leaf.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "1",
        "-out",
        "cert.pem",
        "-extfile",
        "ext.cnf",
    ]);
    let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
    let ca_pem = std::fs::read(dir.join("ca.pem")).unwrap();
    let srv = TestServer::start(ServerConfig {
        tls: Some(siliceo_server::TlsIdentity {
            cert_pem: std::fs::read(&cert).unwrap(),
            key_pem: std::fs::read(&key).unwrap(),
        }),
        ..ServerConfig::default()
    })
    .await;
    let channel = Channel::from_shared(format!("https://{}", srv.addr))
        .unwrap()
        .tls_config(
            ClientTlsConfig::new()
                .ca_certificate(Certificate::from_pem(&ca_pem))
                .domain_name("localhost"),
        )
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut c = InferenceClient::new(channel);
    let (text, _, last) = collect(&mut c, prompt_req("The capital of France is", 4))
        .await
        .unwrap();
    assert!(!text.is_empty());
    assert_eq!(last.finish_reason, pb::FinishReason::Length as i32);
    // A plaintext client gets nowhere.
    let mut plain = srv.client_plain_attempt().await;
    assert!(
        plain
            .get_model_info(pb::GetModelInfoRequest {})
            .await
            .is_err(),
        "plaintext must not work against a TLS server"
    );
    let _ = std::fs::remove_dir_all(&dir);
    srv.stop().await;
}
