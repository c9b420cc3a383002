//! The serving path with some layers' store and attention on the CUDA
//! emulator (`RuntimeConfig::device_attention`): what a GPU run does through
//! the runtime, without a GPU.

use siliceo_core::Priority;
use siliceo_engine::DeviceAttention;
use siliceo_runtime::{Runtime, RuntimeConfig, SpeculativeConfig};

use super::{
    REPETITIVE, alone, assert_clean, assert_same_or_near_tie, long_prompts, model_path, request,
    speculate_alone_and_together, together, usage_of,
};

/// Layers 0, 1 and 29 of the model's 30 on the emulated device (a mixed
/// offload: the rest on the host store).
fn emulated(mut cfg: RuntimeConfig) -> RuntimeConfig {
    cfg.device_attention = Some(DeviceAttention::Emulated(vec![0, 1, 29]));
    cfg
}

/// Through the runtime, with three layers on the emulated device: it starts
/// with the store where its plan says (the start-up check compares what
/// each memory holds), in F16 (no sealed pool) and KV8, and in KV8 — 96-token steps that fill and seal
/// blocks within a step (each device layer's own scratch), prefix hits
/// (partial blocks copied on the device), n-gram token trees (branch
/// blocks, the kept branch copied) and preemption by swapping blocks out
/// to host memory and back — every greedy output is llama.cpp's up to a
/// near tie, and nothing leaks.
#[test]
fn device_layers_serve_through_the_runtime_on_the_emulator() {
    let n = 12;
    // (The emulator is slow: four prompts of 80–130 tokens.)
    let prompts = long_prompts();
    let refs: Vec<&str> = prompts.iter().take(4).map(String::as_str).collect();
    let expected = alone(&refs, n);

    // F16 seals nothing: its device layers hold no sealed pool (and the
    // start-up check counts none).
    let mut cfg = emulated(RuntimeConfig::new(model_path()));
    cfg.kv = siliceo_runtime::KvBackend::Ours {
        format: siliceo_engine::KvFormat::parse("f16").unwrap(),
        size: None,
        kernel_threads: None,
    };
    let rt = Runtime::start(cfg).unwrap();
    let (plan, split) = (rt.info().store.unwrap(), rt.info().store_split.unwrap());
    assert_eq!(plan.sealed_blocks, 0);
    assert_eq!(split.device_layers, 3);
    assert_eq!(split.device_bytes, 3 * plan.pool_bytes_per_layer(30));
    let (_, tokens, _) = rt
        .submit(request(refs[0], n, Priority::Normal))
        .unwrap()
        .blocking_collect();
    assert_same_or_near_tie(&tokens, &expected[0], "f16");
    assert_clean(&rt);
    drop(rt);

    let mut cfg = emulated(RuntimeConfig::new(model_path()));
    cfg.scheduler.max_batch_tokens = 96;
    cfg.context.n_batch = 96;
    let rt = Runtime::start(cfg).unwrap();
    let split = rt.info().store_split.unwrap();
    let plan = rt.info().store.unwrap();
    assert_eq!(split.device_layers, 3);
    // Each device layer's pools and scratch; the plan's bytes plus a
    // scratch per device layer in all.
    let per_layer = plan.pool_bytes_per_layer(30);
    assert_eq!(split.device_bytes, 3 * (per_layer + plan.scratch_bytes));
    assert_eq!(split.total(), plan.bytes + 3 * plan.scratch_bytes);
    assert!(plan.scratch_blocks > 0 && plan.sealed_blocks > 0);
    together(&rt, &refs, n, &expected);
    for (i, p) in refs.iter().enumerate() {
        let (_, tokens, done) = rt
            .submit(request(p, n, Priority::Normal))
            .unwrap()
            .blocking_collect();
        assert!(usage_of(&done).cached_prompt_tokens >= 64, "prompt {i}");
        assert_same_or_near_tie(&tokens, &expected[i], &format!("after a prefix hit, {i}"));
    }
    assert_clean(&rt);
    drop(rt);

    // Token trees.
    let mut cfg = emulated(RuntimeConfig::new(model_path()));
    cfg.speculative = Some(SpeculativeConfig {
        tree_width: 3,
        cost_switch_off: false,
        ..Default::default()
    });
    let rt = Runtime::start(cfg).unwrap();
    // (Two prompts, 16 tokens: the emulator is slow.)
    let m = 16;
    let repetitive = alone(&REPETITIVE[..2], m);
    let (_, accepted) =
        speculate_alone_and_together(&rt, &REPETITIVE[..2], &repetitive, m, "emulated trees");
    assert!(accepted > 0);
    assert!(rt.stats().unwrap().tree_verifications > 0, "no token tree");
    assert_clean(&rt);
    drop(rt);

    // A store of 192 tokens (three sealed blocks): the two requests that run first
    // hold most of it when a third, more urgent, comes, and one of them is
    // preempted, its blocks swapped out to host memory and back.
    let mut cfg = emulated(RuntimeConfig::new(model_path()));
    cfg.context.n_ctx = 192;
    cfg.prefix_caching = false;
    cfg.scheduler.recompute_below_tokens = 0;
    let rt = Runtime::start(cfg).unwrap();
    let mut streams = vec![
        rt.submit(request(refs[2], n, Priority::Batch)).unwrap(),
        rt.submit(request(refs[3], n, Priority::Normal)).unwrap(),
    ];
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while rt.stats().unwrap().running < 2 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    streams.push(
        rt.submit(request(refs[1], n, Priority::Interactive))
            .unwrap(),
    );
    for (s, i) in streams.into_iter().zip([2, 3, 1]) {
        let (_, tokens, _) = s.blocking_collect();
        assert_same_or_near_tie(&tokens, &expected[i], &format!("preempted, {i}"));
    }
    let stats = rt.stats().unwrap();
    assert!(stats.preemptions > 0, "the test must actually preempt");
    assert_clean(&rt);
}

/// Gemma 4's architecture (`gemma4-mini`: layers of two shapes, the last
/// two reading layers 2 and 3's KV) with every layer on the emulated
/// device: the runtime starts with four layers' pools there, in their
/// shapes, and serves in KV8 in 96-token steps, alone and together, with
/// llama.cpp's greedy output up to a near tie.
#[test]
fn gemma4_device_layers_serve_through_the_runtime_on_the_emulator() {
    let dir = std::env::temp_dir().join(format!("siliceo-emu-gemma4-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("gemma4-mini.gguf");
    siliceo_runtime::synth::synth_model(&siliceo_runtime::synth::SynthOptions {
        like: Some(siliceo_runtime::synth::Like::Gemma4Mini),
        quant: siliceo_runtime::synth::Quant::Q8_0,
        tokenizer: model_path(),
        out: path.clone(),
        layers: None,
        seed: 7,
        vocab_only: false,
    })
    .unwrap();
    let n = 12;
    let prompts = long_prompts();
    let refs: Vec<&str> = prompts.iter().skip(2).take(2).map(String::as_str).collect();
    let expected = super::alone_on(&path, &refs, n);
    let mut cfg = RuntimeConfig::new(&path);
    cfg.device_attention = Some(DeviceAttention::Emulated((0..6).collect()));
    cfg.scheduler.max_batch_tokens = 96;
    cfg.context.n_batch = 96;
    let rt = Runtime::start(cfg).unwrap();
    assert_eq!(rt.info().store_split.unwrap().device_layers, 4);
    for p in 0..2 {
        let (_, tokens, _) = rt
            .submit(request(refs[p], n, Priority::Normal))
            .unwrap()
            .blocking_collect();
        assert_same_or_near_tie(&tokens, &expected[p], &format!("alone, {p}"));
    }
    together(&rt, &refs, n, &expected);
    assert_clean(&rt);
    drop(rt);
    std::fs::remove_dir_all(&dir).ok();
}
