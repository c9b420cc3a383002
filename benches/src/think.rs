//! `siliceo-bench think`: what a thinking budget costs per decode step. The
//! same greedy chats, whose prompt opens a `<think>` block (a template of
//! our own, as DeepSeek-R1's does), run with no budget, with one they never
//! reach (each token still goes through the budget's check), and with one
//! of 16 tokens (the block is closed for the model, which then answers), and
//! with a JSON constraint that follows the thinking (each thinking token
//! then goes through the lead grammar's mask), at 1 and 8 streams, side by
//! side in one process. Every request generates exactly `TOKENS` tokens.

use anyhow::{Result, bail};
use siliceo_core::{Constraint, SamplingParams};
use siliceo_runtime::{GenerateRequest, Input, Message, Runtime};

use crate::{ServeBench, median, run_exact};

const TOKENS: u32 = 64;

/// ChatML whose generation prompt opens a thinking block.
const OPENS_THINKING: &str = "{%- for m in messages -%}\
    {{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}\
    {%- endfor -%}\
    {%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n<think>\\n' }}{%- endif -%}";

const ASKS: [&str; 8] = [
    "Why is the sky blue?",
    "How do bees make honey?",
    "What makes a bridge strong?",
    "Why do cats purr?",
    "How does a refrigerator work?",
    "Why is the sea salty?",
    "How do plants drink water?",
    "What causes thunder?",
];

/// How a run's requests think: a budget, and whether a JSON constraint
/// follows the thinking.
type Mode = (Option<u32>, bool);

fn request(i: usize, (budget, json): Mode) -> GenerateRequest {
    let mut r = GenerateRequest::new(Input::Chat(vec![Message::new(
        "user",
        ASKS[i % ASKS.len()],
    )]));
    r.sampling = SamplingParams {
        max_tokens: TOKENS,
        ignore_eos: true,
        ..SamplingParams::greedy()
    };
    r.thinking_budget = budget;
    if json {
        r.constraint = Some(Constraint::JsonObject);
    }
    r
}

/// Runs `streams` requests at once; returns generated tokens per second,
/// and whether every output closed its block.
fn run(rt: &Runtime, streams: usize, mode: Mode) -> Result<(f64, bool)> {
    let requests = (0..streams).map(|i| request(i, mode)).collect();
    let (tps, texts) = run_exact(rt, requests, TOKENS)?;
    Ok((tps, texts.iter().all(|t| t.contains("</think>"))))
}

pub(crate) fn think(b: &ServeBench) -> Result<()> {
    let mut cfg = b.config();
    cfg.chat_template = Some(OPENS_THINKING.to_string());
    let rt = Runtime::start(cfg)?;
    println!(
        "{}",
        b.header(&format!(
            "{TOKENS} tokens per request, greedy, the prompt opening `<think>`"
        ))
    );
    println!(
        "| streams | no budget tok/s | budget never reached | budget of 16 (closed, then answered) | JSON after the thinking (all 64 thinking) |"
    );
    println!("|---:|---:|---:|---:|---:|");
    let modes: [Mode; 4] = [
        (None, false),
        (Some(1_000_000), false),
        (Some(16), false),
        (None, true),
    ];
    for streams in [1usize, 8] {
        // Warm-up: the prefix cache.
        for m in modes {
            run(&rt, streams, m)?;
        }
        let mut got: [Vec<f64>; 4] = Default::default();
        for rep in 0..b.reps {
            // A different order each rep: no mode always runs first.
            for k in 0..modes.len() {
                let i = (rep + k) % modes.len();
                let (tps, closed) = run(&rt, streams, modes[i])?;
                if i == 2 && !closed {
                    bail!("a budget of 16 left a thinking block open");
                }
                got[i].push(tps);
            }
        }
        let [free, never, small, json] = got.map(median);
        println!(
            "| {streams} | {free:.1} | {never:.1} ({:.3}×) | {small:.1} ({:.3}×) | {json:.1} ({:.3}×) |",
            never / free,
            small / free,
            json / free
        );
    }
    Ok(())
}
