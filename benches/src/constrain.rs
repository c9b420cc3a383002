//! `siliceo-bench constrain`: what a JSON-schema constraint costs per decode
//! step. The same greedy chats run unconstrained and under a schema, with
//! the masks computed beside llama.cpp's decode (`overlap`, the default) and
//! after it over the machine's cores (`after`), at 1 and 8 streams, side by
//! side in one process. Every request generates exactly `TOKENS` tokens (the
//! schema asks for a long array, so none completes early).

use anyhow::Result;
use siliceo_core::{Constraint, SamplingParams};
use siliceo_runtime::{GenerateRequest, Input, Message, Runtime};

use crate::{ServeBench, median, run_exact};

const TOKENS: u32 = 64;

/// A list of at least 40 users: long enough that no request completes its
/// JSON within `TOKENS`.
const USERS: &str = r#"{
  "type": "array",
  "minItems": 40,
  "items": {
    "type": "object",
    "properties": {
      "name": {"type": "string", "maxLength": 30},
      "age": {"type": "integer", "minimum": 0, "maximum": 120},
      "role": {"enum": ["admin", "user", "guest"]},
      "email": {"type": "string", "format": "email"}
    },
    "required": ["name", "age", "role", "email"],
    "additionalProperties": false
  }
}"#;

const ASKS: [&str; 8] = [
    "List the users of a web shop as JSON.",
    "Give me sample users for a test database, as JSON.",
    "Write JSON describing the staff of a bakery.",
    "List the members of a chess club as JSON.",
    "Invent the users of a small forum, as JSON.",
    "Give JSON for the accounts of a family's laptop.",
    "List the players of a football team as JSON.",
    "Describe the volunteers of a library as JSON.",
];

fn request(i: usize, constrained: bool) -> GenerateRequest {
    let mut r = GenerateRequest::new(Input::Chat(vec![Message::new(
        "user",
        ASKS[i % ASKS.len()],
    )]));
    r.sampling = SamplingParams {
        max_tokens: TOKENS,
        ignore_eos: true,
        ..SamplingParams::greedy()
    };
    if constrained {
        r.constraint = Some(Constraint::JsonSchema {
            schema: USERS.into(),
            strict: true,
        });
    }
    r
}

/// Runs `streams` requests at once; returns generated tokens per second.
fn run(rt: &Runtime, streams: usize, constrained: bool) -> Result<f64> {
    let requests = (0..streams).map(|i| request(i, constrained)).collect();
    Ok(run_exact(rt, requests, TOKENS)?.0)
}

pub(crate) fn constrain(b: &ServeBench) -> Result<()> {
    let start = |overlap: bool| -> Result<Runtime> {
        let mut cfg = b.config();
        cfg.constraint_overlap = overlap;
        Ok(Runtime::start(cfg)?)
    };
    let overlap = start(true)?;
    let after = start(false)?;
    println!(
        "{}",
        b.header(&format!("{TOKENS} tokens per request, greedy"))
    );
    println!(
        "| streams | unconstrained tok/s | JSON schema, masks beside decode | JSON schema, masks after decode | mask µs per token (beside / after) |"
    );
    println!("|---:|---:|---:|---:|---:|");
    for streams in [1usize, 8] {
        // Warm-up: the token trie, the grammar's lexer, the prefix cache.
        for rt in [&overlap, &after] {
            run(rt, streams, true)?;
        }
        run(&overlap, streams, false)?;
        let (mut free, mut beside, mut later) = (Vec::new(), Vec::new(), Vec::new());
        let mask_us = |rt: &Runtime| -> Result<(u64, u64)> {
            let s = rt.stats()?;
            Ok((s.constraint_mask_us, s.constraint_masks))
        };
        let (o0, a0) = (mask_us(&overlap)?, mask_us(&after)?);
        for rep in 0..b.reps {
            // A different order each rep: no mode always runs first.
            for k in 0..3 {
                match (rep + k) % 3 {
                    0 => free.push(run(&overlap, streams, false)?),
                    1 => beside.push(run(&overlap, streams, true)?),
                    _ => later.push(run(&after, streams, true)?),
                }
            }
        }
        let (o1, a1) = (mask_us(&overlap)?, mask_us(&after)?);
        let per = |a: (u64, u64), b: (u64, u64)| (b.0 - a.0) as f64 / (b.1 - a.1).max(1) as f64;
        let (f, o, a) = (median(free), median(beside), median(later));
        println!(
            "| {streams} | {f:.1} | {o:.1} ({:.3}×) | {a:.1} ({:.3}×) | {:.0} / {:.0} |",
            o / f,
            a / f,
            per(o0, o1),
            per(a0, a1)
        );
    }
    Ok(())
}
