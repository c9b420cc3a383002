//! One sequence generated start to finish: the vertical slice the CLI uses and
//! the reference the batched runtime is tested against.

use std::ops::ControlFlow;
use std::time::{Duration, Instant};

use siliceo_core::{FinishReason, Sampler, SamplingParams, SeqId, TokenId};

use crate::{Context, EngineError, TokenText};

/// The result of [`generate`].
#[derive(Debug, Clone)]
pub struct Generation {
    /// Generated tokens (a stop token is included; a stop string's tokens too).
    pub tokens: Vec<TokenId>,
    /// Generated text, stop string excluded.
    pub text: String,
    /// Why it ended.
    pub finish_reason: FinishReason,
    /// Tokens of the prompt that were decoded.
    pub prompt_tokens: usize,
    /// Time to evaluate the prompt and pick the first token.
    pub prefill_time: Duration,
    /// Time spent producing the remaining tokens.
    pub decode_time: Duration,
}

impl Generation {
    /// Generated tokens per second after the first.
    pub fn decode_tokens_per_second(&self) -> f64 {
        let n = self.tokens.len().saturating_sub(1) as f64;
        let s = self.decode_time.as_secs_f64();
        if s > 0.0 { n / s } else { 0.0 }
    }
}

/// Generates a continuation of `prompt` in `seq`, calling `on_text` with each
/// piece of new text (valid UTF-8, stop strings held back) and its token.
///
/// The prompt is appended after whatever `seq` already holds, so a sequence
/// that received a cached prefix with [`Context::seq_cp`] only needs the rest.
/// Returning [`ControlFlow::Break`] from `on_text` cancels the generation.
pub fn generate(
    ctx: &mut Context<'_>,
    seq: SeqId,
    prompt: &[TokenId],
    params: &SamplingParams,
    mut on_text: impl FnMut(&str, TokenId) -> ControlFlow<()>,
) -> Result<Generation, EngineError> {
    params.validate()?;
    if prompt.is_empty() {
        return Err(EngineError::EmptyPrompt);
    }
    let model = ctx.model();
    if let Some(&bad) = prompt.iter().find(|t| !model.is_valid_token(**t)) {
        return Err(EngineError::InvalidToken {
            token: bad.0,
            n_vocab: model.geometry().n_vocab,
        });
    }
    let start = ctx.seq_len(seq)?;
    let n_ctx = ctx.n_ctx();
    if start as usize + prompt.len() >= n_ctx as usize {
        return Err(EngineError::PromptTooLong {
            tokens: start as usize + prompt.len(),
            n_ctx,
        });
    }
    let mut sampler = Sampler::new(params);
    for &t in prompt {
        sampler.accept(t);
    }
    let mut text = TokenText::new(model, params);
    let mut out = Generation {
        tokens: Vec::new(),
        text: String::new(),
        finish_reason: FinishReason::Length,
        prompt_tokens: prompt.len(),
        prefill_time: Duration::ZERO,
        decode_time: Duration::ZERO,
    };

    let t0 = Instant::now();
    let mut logits = ctx.prefill(seq, prompt, start)?;
    let mut pos = start + prompt.len() as u32;
    let mut t_first = None;
    let mut batch = crate::Batch::new();
    loop {
        let token = sampler.sample(&logits);
        sampler.accept(token);
        out.tokens.push(token);
        if t_first.is_none() {
            t_first = Some(Instant::now());
        }
        let (emit, stopped) = text.push(token);
        out.text.push_str(&emit);
        let cancelled = on_text(&emit, token).is_break();
        if stopped {
            out.finish_reason = FinishReason::Stop;
            break;
        }
        if cancelled {
            out.finish_reason = FinishReason::Cancelled;
            break;
        }
        if out.tokens.len() >= params.max_tokens as usize || pos + 1 >= n_ctx {
            out.finish_reason = FinishReason::Length;
            break;
        }
        batch.clear();
        let idx = batch.push(token, pos, seq, true);
        ctx.decode(&batch)?;
        pos += 1;
        logits.clear();
        logits.extend_from_slice(ctx.logits(idx)?);
    }
    if out.finish_reason != FinishReason::Stop {
        let tail = text.finish();
        if !tail.is_empty() {
            out.text.push_str(&tail);
            let _ = on_text(&tail, *out.tokens.last().unwrap_or(&TokenId(0)));
        }
    }
    let t_first = t_first.unwrap_or(t0);
    out.prefill_time = t_first - t0;
    out.decode_time = t_first.elapsed();
    Ok(out)
}
