//! Embed and Rerank over gRPC with all-MiniLM-L6-v2, next to generation.

use std::sync::Arc;

use siliceo_runtime::{EmbeddingConfig, EmbeddingService};
use siliceo_server::ServerConfig;
use siliceo_server::pb;
use tonic::Code;

use crate::{TestServer, collect, prompt_req};

fn embed_model() -> std::path::PathBuf {
    std::env::var_os("SILICEO_EMBED_MODEL")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| crate::manifest_dir().join("../../models/all-MiniLM-L6-v2.f16.gguf"))
}

pub async fn server_with_embeddings() -> TestServer {
    let svc = tokio::task::spawn_blocking(|| {
        EmbeddingService::start(EmbeddingConfig::new(embed_model()))
    })
    .await
    .unwrap()
    .unwrap_or_else(|e| panic!("{e}; run `cargo xtask fetch-model --embed`"));
    TestServer::start(ServerConfig {
        embeddings: Some(Arc::new(svc)),
        ..ServerConfig::default()
    })
    .await
}

fn cos(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>()
        / (a.iter().map(|x| x * x).sum::<f32>().sqrt()
            * b.iter().map(|x| x * x).sum::<f32>().sqrt())
}

fn req(inputs: &[&str], normalize: bool) -> pb::EmbedRequest {
    pb::EmbedRequest {
        inputs: inputs.iter().map(|s| s.to_string()).collect(),
        normalize,
        truncate: false,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn embed_and_rerank_over_grpc_next_to_generation() {
    let srv = server_with_embeddings().await;
    let mut c = srv.client().await;
    let info = c
        .get_model_info(pb::GetModelInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.embedding_model, "all-MiniLM-L6-v2");
    assert_eq!((info.embedding_dim, info.embedding_max_tokens), (384, 512));

    let texts = [
        "A man is playing a guitar.",
        "Someone is strumming a guitar.",
        "The stock market fell sharply today.",
        "How do I bake bread at home?",
        "What is a simple recipe for homemade bread?",
    ];
    let batch = c.embed(req(&texts, true)).await.unwrap().into_inner();
    assert_eq!(batch.embeddings.len(), 5);
    assert!(batch.prompt_tokens >= 5 * 3);
    let v: Vec<&[f32]> = batch
        .embeddings
        .iter()
        .map(|e| e.values.as_slice())
        .collect();
    for e in &v {
        assert_eq!(e.len(), 384);
        let n: f32 = e.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((n - 1.0).abs() < 1e-5, "norm {n}");
    }
    assert!(cos(v[0], v[1]) > cos(v[0], v[2]) + 0.3);
    assert!(cos(v[3], v[4]) > cos(v[3], v[2]) + 0.3);

    // One request per text, all at once, while a generation streams: same
    // vectors as the batch, and the generation finishes as it would alone.
    let mut g = srv.client().await;
    let gen_task =
        tokio::spawn(async move { collect(&mut g, prompt_req("Once upon a time", 48)).await });
    let mut tasks = Vec::new();
    for (i, t) in texts.iter().enumerate() {
        let mut c = srv.client().await;
        let t = t.to_string();
        tasks.push(tokio::spawn(async move {
            (i, c.embed(req(&[&t], true)).await.unwrap().into_inner())
        }));
    }
    for t in tasks {
        let (i, r) = t.await.unwrap();
        let d = r.embeddings[0]
            .values
            .iter()
            .zip(v[i])
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(d < 1e-3, "text {i}: alone vs batch differ by {d}");
    }
    let (_, toks, last) = gen_task.await.unwrap().unwrap();
    assert_eq!(toks.len(), 48);
    assert_eq!(last.usage.unwrap().completion_tokens, 48);

    let docs = vec![
        "The weather will be sunny tomorrow.".to_string(),
        "To make bread, mix flour, water, yeast and salt, then bake it.".to_string(),
        "Guitars have six strings.".to_string(),
    ];
    let r = c
        .rerank(pb::RerankRequest {
            query: "how to bake bread".into(),
            documents: docs.clone(),
            top_n: 0,
            truncate: false,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.method, "cosine");
    assert_eq!(r.results.len(), 3);
    assert_eq!(r.results[0].index, 1, "{:?}", r.results);
    assert!(r.results.windows(2).all(|w| w[0].score >= w[1].score));
    let top = c
        .rerank(pb::RerankRequest {
            query: "how to bake bread".into(),
            documents: docs,
            top_n: 1,
            truncate: false,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(top.results.len(), 1);
    assert_eq!(top.results[0].index, 1);
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_embedding_input_gets_invalid_argument_and_the_server_keeps_serving() {
    let srv = server_with_embeddings().await;
    let mut c = srv.client().await;
    let long = "word ".repeat(700);
    let cases: Vec<(pb::EmbedRequest, &str)> = vec![
        (req(&[], true), "inputs"),
        (req(&["fine", &long], true), "inputs"),
        (req(&["nul\0byte"], true), "inputs"),
    ];
    for (r, field) in cases {
        let e = c.embed(r).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
        assert!(e.message().starts_with(field), "{}", e.message());
    }
    let cut = c
        .embed(pb::EmbedRequest {
            inputs: vec![long.clone()],
            normalize: true,
            truncate: true,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(cut.prompt_tokens, 512);
    for (q, docs) in [("", vec!["x".to_string()]), ("query", vec![])] {
        let e = c
            .rerank(pb::RerankRequest {
                query: q.into(),
                documents: docs,
                top_n: 0,
                truncate: false,
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    }
    let e = c
        .rerank(pb::RerankRequest {
            query: "q".into(),
            documents: vec![long],
            top_n: 0,
            truncate: false,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    // Still serving.
    let ok = c
        .embed(req(&["still here"], false))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(ok.embeddings.len(), 1);
    srv.stop().await;
}
