//! The embedding service on all-MiniLM-L6-v2 (`cargo xtask fetch-model --embed`):
//! requests waiting together run together, abandoned ones are dropped, a
//! panic fails only its round.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::Duration;

use siliceo_runtime::{
    EmbedInput, EmbeddingConfig, EmbeddingService, Pooling, RerankMethod, RuntimeError,
};

/// This package's folder in the checkout the tests run in: cargo sets it when
/// it runs a test. A test binary built in another checkout that shares the
/// target directory must not read that checkout's models.
pub fn manifest_dir() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from)
}

fn embed_model() -> PathBuf {
    std::env::var_os("SILICEO_EMBED_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| manifest_dir().join("../../models/all-MiniLM-L6-v2.f16.gguf"))
}

fn service() -> EmbeddingService {
    EmbeddingService::start(EmbeddingConfig::new(embed_model()))
        .unwrap_or_else(|e| panic!("{e}; run `cargo xtask fetch-model --embed`"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_requests_are_batched_and_answered_in_order() {
    let svc = std::sync::Arc::new(service());
    assert_eq!(svc.info().pooling, Pooling::Mean);
    assert_eq!(svc.info().dim, 384);
    let texts: Vec<String> = (0..40)
        .map(|i| format!("sentence number {i} about topic {}", i % 7))
        .collect();
    let all = svc.embed(texts.clone(), true, false).await.unwrap();
    assert_eq!(all.vectors.len(), 40);
    let before = svc.stats().batches.load(Ordering::Relaxed);
    // Hold the worker busy with a big request so the 40 singles queue up
    // behind it and run together.
    let big: Vec<String> = (0..200)
        .map(|i| format!("filler text {i} ").repeat(10))
        .collect();
    let s = svc.clone();
    let busy = tokio::spawn(async move { s.embed(big, false, false).await });
    tokio::time::sleep(Duration::from_millis(30)).await;
    let singles: Vec<_> = texts
        .iter()
        .map(|t| {
            let s = svc.clone();
            let t = t.clone();
            tokio::spawn(async move { s.embed(vec![t], true, false).await })
        })
        .collect();
    for (i, h) in singles.into_iter().enumerate() {
        let r = h.await.unwrap().unwrap();
        let d = r.vectors[0]
            .iter()
            .zip(&all.vectors[i])
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(d < 1e-3, "input {i} differs by {d} from the batched run");
    }
    busy.await.unwrap().unwrap();
    let batches = svc.stats().batches.load(Ordering::Relaxed) - before;
    let requests = 41;
    assert!(
        batches < requests,
        "{requests} requests took {batches} llama.cpp batches: not batched together"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandoned_requests_are_dropped_before_they_run() {
    let svc = std::sync::Arc::new(service());
    let big: Vec<String> = (0..300)
        .map(|i| format!("filler text {i} ").repeat(10))
        .collect();
    let s = svc.clone();
    let busy = tokio::spawn(async move { s.embed(big, false, false).await });
    tokio::time::sleep(Duration::from_millis(30)).await;
    // Gives up long before the worker reaches it.
    let gave_up = tokio::time::timeout(
        Duration::from_millis(5),
        svc.embed(vec!["late".into()], true, false),
    )
    .await;
    assert!(gave_up.is_err(), "the worker was expected to be busy");
    busy.await.unwrap().unwrap();
    // The next request runs after the abandoned one was skipped.
    svc.embed(vec!["after".into()], true, false).await.unwrap();
    assert_eq!(svc.stats().abandoned.load(Ordering::Relaxed), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rerank_by_cosine_and_typed_errors() {
    let svc = service();
    let docs = vec![
        "Paris is the capital of France.".to_string(),
        "Bananas are rich in potassium.".to_string(),
        "The French capital city is Paris.".to_string(),
    ];
    let r = svc
        .rerank("What is the capital of France?".into(), docs, 0, false)
        .await
        .unwrap();
    assert_eq!(r.method, RerankMethod::Cosine);
    let order: Vec<usize> = r.ranked.iter().map(|x| x.0).collect();
    assert_eq!(*order.last().unwrap(), 1, "{:?}", r.ranked);
    let bad = [
        svc.embed(vec![], false, false).await,
        svc.embed(vec!["a\0b".into()], false, false).await,
        svc.embed(vec!["word ".repeat(600)], false, false).await,
        svc.embed(vec!["x".into(); 5000], false, false).await,
    ];
    for b in bad {
        assert!(
            matches!(b, Err(RuntimeError::InvalidRequest { .. })),
            "{b:?}"
        );
    }
    assert!(matches!(
        svc.rerank("q".into(), vec![], 0, false).await,
        Err(RuntimeError::InvalidRequest { .. })
    ));
    // A bad request next to good ones fails alone.
    let ok = svc.embed(vec!["fine".into()], false, false).await.unwrap();
    assert_eq!(ok.vectors.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_ids_embed_as_the_text_they_spell() {
    let svc = service();
    let text = "The quick brown fox jumps over the lazy dog.";
    let model = siliceo_engine::Model::load(embed_model(), &Default::default()).unwrap();
    // `[CLS] … [SEP]`, as the service tokenizes text.
    let ids = model.tokenize(text, true).unwrap();
    assert!(ids.len() > 4, "{ids:?}");
    let by_text = svc.embed(vec![text.into()], true, false).await.unwrap();
    let by_ids = svc
        .embed_inputs(vec![EmbedInput::Tokens(ids.clone())], true, false)
        .await
        .unwrap();
    // The same tokens in the same batch shape: the same vector, bit for bit.
    assert_eq!(by_ids.vectors, by_text.vectors);
    assert_eq!(by_ids.prompt_tokens, ids.len() as u32);
    // Ids are used as they are: without the separators they are another input.
    let bare = svc
        .embed_inputs(
            vec![EmbedInput::Tokens(ids[1..ids.len() - 1].to_vec())],
            true,
            false,
        )
        .await
        .unwrap();
    assert_ne!(bare.vectors, by_text.vectors);
    let n_vocab = model.geometry().n_vocab;
    let long = EmbedInput::Tokens(vec![ids[1]; 600]);
    for (bad, why) in [
        (EmbedInput::Tokens(vec![]), "no tokens"),
        (
            EmbedInput::Tokens(vec![ids[0], siliceo_core::TokenId(n_vocab)]),
            "outside the vocabulary",
        ),
        (long.clone(), "600 tokens"),
    ] {
        match svc.embed_inputs(vec![bad], true, false).await {
            Err(RuntimeError::InvalidRequest { field, reason }) => {
                assert_eq!(field, "inputs");
                assert!(reason.contains(why), "{reason}");
            }
            other => panic!("expected InvalidRequest ({why}), got {other:?}"),
        }
    }
    let cut = svc.embed_inputs(vec![long], true, true).await.unwrap();
    assert_eq!(cut.prompt_tokens, svc.info().max_tokens);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_fails_its_round_and_the_service_goes_on() {
    let svc = service();
    let e = svc
        .embed(vec!["siliceo-fault-panic now".into()], false, false)
        .await
        .unwrap_err();
    assert!(
        matches!(&e, RuntimeError::Engine(m) if m.contains("panicked")),
        "{e:?}"
    );
    assert_eq!(svc.stats().panics.load(Ordering::Relaxed), 1);
    let ok = svc
        .embed(vec!["works again".into()], true, false)
        .await
        .unwrap();
    assert_eq!(ok.vectors[0].len(), 384);
}

#[test]
fn a_missing_or_non_embedding_model_fails_to_start() {
    let e = EmbeddingService::start(EmbeddingConfig::new("/nonexistent/model.gguf")).unwrap_err();
    assert!(matches!(e, RuntimeError::Start(_)), "{e:?}");
    let generation = manifest_dir().join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let e = EmbeddingService::start(EmbeddingConfig::new(generation)).unwrap_err();
    assert!(
        matches!(&e, RuntimeError::Start(m) if m.contains("not an embedding model")),
        "{e:?}"
    );
}

/// The cross-encoder path through the service, on the made-up head of
/// `all-MiniLM-L6-v2.rank-head.test.gguf` (its scores mean nothing; the engine
/// test checks them against the head's formula): method, one score per
/// document, best first, top_n.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_pooling_model_reranks_as_a_cross_encoder() {
    let path = manifest_dir().join("../../models/all-MiniLM-L6-v2.rank-head.test.gguf");
    let svc = EmbeddingService::start(EmbeddingConfig::new(path)).unwrap();
    assert_eq!(svc.info().pooling, Pooling::Rank);
    assert_eq!(svc.info().dim, 1);
    let docs: Vec<String> = ["alpha", "beta gamma", "delta epsilon zeta", "eta"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let r = svc
        .rerank("query text".into(), docs.clone(), 0, false)
        .await
        .unwrap();
    assert_eq!(r.method, RerankMethod::CrossEncoder);
    assert_eq!(r.ranked.len(), 4);
    assert!(
        r.ranked.windows(2).all(|w| w[0].1 >= w[1].1),
        "{:?}",
        r.ranked
    );
    let mut seen: Vec<usize> = r.ranked.iter().map(|x| x.0).collect();
    seen.sort();
    assert_eq!(seen, vec![0, 1, 2, 3]);
    let top = svc
        .rerank("query text".into(), docs, 2, false)
        .await
        .unwrap();
    assert_eq!(top.ranked, r.ranked[..2].to_vec());
}
