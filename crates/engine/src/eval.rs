//! What a KV-cache format costs in quality, measured on real text through
//! llama.cpp: perplexity, and the KL divergence of every scored position's
//! next-token distribution against the same model with an f16 KV cache.
//!
//! The text is cut into windows of `window` tokens every `stride` tokens; each
//! window is decoded from an empty cache, and the positions of its second half
//! are scored (the first half is context, as llama.cpp's `llama-perplexity`
//! does). Every configuration sees exactly the same windows.
//!
//! The reference ([`Reference`]) is by default *exact*: f32 K/V and llama.cpp's
//! plain attention (f32 matrix products and softmax). llama.cpp's f16 KV with
//! flash attention — what it serves with, and the only way it takes a quantized
//! V — is not exact on the CPU: its flash-attention kernel rounds Q to f16 and
//! accumulates V in an f16 accumulator (ggml-cpu `ops.cpp`, `VKQ16`), which
//! costs about as much as q8_0 KV on a small model (measured: KL 0.004 nats
//! against the exact run on SmolLM2-135M). Every llama.cpp type is run with
//! flash attention (needed for a quantized V), so its row includes that.
//!
//! Formats are llama.cpp's own KV types ([`KvConfig`], run by llama.cpp) or
//! siliceo's ([`KvFormat`], `ours:…`, run through shadow attention: our
//! store and CPU kernel inside llama.cpp's forward pass, see `shadow.rs`).

use siliceo_core::{KvType, ModelGeometry, SeqId, TokenId};

use crate::shadow::{ShadowContext, ShadowMode};
use crate::{
    Batch, BlockPlacer, Context, ContextOptions, DeviceAttention, EngineError, FlashAttention,
    GraftOptions, GraftStep, GraftedContext, KvFormat, Model, SeqKv,
};

/// One K/V format pair to measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvConfig {
    /// K cache type.
    pub k: KvType,
    /// V cache type.
    pub v: KvType,
}

impl KvConfig {
    /// Parses `f16`, `kv8` (q8_0/q8_0), `k5v4` (q5_1/q4_1 — llama.cpp's
    /// 5-bit and 4-bit types with a minimum), or `K/V` (`q8_0/q4_0`), or one
    /// type for both.
    pub fn parse(s: &str) -> Result<KvConfig, EngineError> {
        let bad = |reason: String| EngineError::InvalidOption {
            field: "configs",
            reason,
        };
        let t = |x: &str| x.parse::<KvType>().map_err(|e| bad(e.to_string()));
        Ok(match s.trim() {
            "kv8" => KvConfig {
                k: KvType::Q8_0,
                v: KvType::Q8_0,
            },
            "k5v4" => KvConfig {
                k: KvType::Q5_1,
                v: KvType::Q4_1,
            },
            other => match other.split_once('/') {
                Some((k, v)) => KvConfig { k: t(k)?, v: t(v)? },
                None => {
                    let x = t(other)?;
                    KvConfig { k: x, v: x }
                }
            },
        })
    }

    /// `k/v` names.
    pub fn name(&self) -> String {
        format!("{}/{}", self.k, self.v)
    }
}

/// A KV format to measure: llama.cpp's types, or ours through shadow attention.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EvalFormat {
    /// llama.cpp's own K/V types, run by llama.cpp.
    Llama(KvConfig),
    /// siliceo's formats (`ours:…`), run through shadow attention.
    Ours(KvFormat),
    /// siliceo's formats through the serving path (`serve:…`): grafted
    /// attention, llama.cpp's memory cleared every step, our store the only
    /// KV — the same numbers as `ours:` with `--shadow-chunk 1`, measured on
    /// what requests run through.
    Served(KvFormat),
    /// `floor`: the reference with every attention output changed by a
    /// relative 1e-6 (alternating signs) — the KL divergence that *any*
    /// harmless change of the computation shows on this model, because
    /// llama.cpp quantizes activations to 8 bits in front of quantized weights
    /// and a tiny change re-rolls that rounding. Formats near this row are
    /// indistinguishable from the reference.
    Floor,
}

/// The floor row's relative change of the attention outputs.
pub const FLOOR_JITTER: f32 = 1e-6;

impl EvalFormat {
    /// `ours:…` (see [`KvFormat::parse`]) or anything [`KvConfig::parse`] takes.
    pub fn parse(s: &str) -> Result<EvalFormat, EngineError> {
        if s.trim() == "floor" {
            return Ok(EvalFormat::Floor);
        }
        if let Some(rest) = s.trim().strip_prefix("serve:") {
            return Ok(EvalFormat::Served(KvFormat::parse(rest)?));
        }
        match s.trim().strip_prefix("ours:") {
            Some(rest) => Ok(EvalFormat::Ours(KvFormat::parse(rest)?)),
            None => Ok(EvalFormat::Llama(KvConfig::parse(s)?)),
        }
    }

    /// `k/v` for llama.cpp's types, `ours:k:v[+rot][+tailN]` for ours.
    pub fn name(&self) -> String {
        match self {
            EvalFormat::Llama(c) => c.name(),
            EvalFormat::Ours(f) => format!("ours:{}", f.name()),
            EvalFormat::Served(f) => format!("serve:{}", f.name()),
            EvalFormat::Floor => format!("floor (reference ± {FLOOR_JITTER:e})"),
        }
    }

    /// Average bits per K/V element (sealed blocks for ours; the F16 tail is
    /// not counted — it is a fixed number of tokens, not a share of them; the
    /// floor's are the exact reference's).
    pub fn bits_per_element(&self, g: &ModelGeometry) -> Result<f64, EngineError> {
        Ok(match self {
            EvalFormat::Llama(c) => (c.k.bits_per_element() + c.v.bits_per_element()) / 2.0,
            EvalFormat::Floor => 32.0,
            EvalFormat::Ours(f) | EvalFormat::Served(f) => f
                .layout(g.n_head_kv as usize, g.head_dim_k as usize)?
                .bits_per_element(),
        })
    }

    /// KV bytes per token for this model, all layers, K and V (sealed blocks for ours).
    pub fn kv_bytes_per_token(&self, g: &ModelGeometry) -> Result<u64, EngineError> {
        Ok(match self {
            EvalFormat::Llama(c) => g.kv_bytes_per_token(c.k, c.v),
            EvalFormat::Floor => g.kv_bytes_per_token(KvType::F32, KvType::F32),
            EvalFormat::Ours(f) | EvalFormat::Served(f) => {
                let l = f.layout(g.n_head_kv as usize, g.head_dim_k as usize)?;
                (l.bytes_per_token() * f64::from(g.n_layer)).round() as u64
            }
        })
    }
}

impl From<KvConfig> for EvalFormat {
    fn from(c: KvConfig) -> Self {
        EvalFormat::Llama(c)
    }
}

/// What every configuration is compared against.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Reference {
    /// f32 K/V, flash attention off: llama.cpp's f32 attention.
    #[default]
    Exact,
    /// f16 K/V with flash attention (llama.cpp's serving default).
    F16Flash,
}

impl Reference {
    /// `exact` or `f16`.
    pub fn parse(s: &str) -> Result<Reference, EngineError> {
        match s {
            "exact" | "f32" => Ok(Reference::Exact),
            "f16" => Ok(Reference::F16Flash),
            other => Err(EngineError::InvalidOption {
                field: "reference",
                reason: format!("`{other}`: expected `exact` (f32, no flash attention) or `f16`"),
            }),
        }
    }

    /// A label for tables.
    pub fn label(self) -> &'static str {
        match self {
            Reference::Exact => "f32/f32 exact (reference)",
            Reference::F16Flash => "f16/f16 flash (reference)",
        }
    }
}

/// What to measure.
#[derive(Debug, Clone)]
pub struct EvalOptions {
    /// Tokens per window.
    pub window: usize,
    /// Tokens between window starts (= `window` for disjoint windows).
    pub stride: usize,
    /// At most this many windows (0 = all).
    pub max_windows: usize,
    /// The configurations; the reference is always run first.
    pub configs: Vec<EvalFormat>,
    /// What KL divergence and top-1 agreement compare against.
    pub reference: Reference,
    /// Ours: query tokens per attention call — 1 = each position sees the
    /// store as decoding would (its partial block in F16), 0 = one block (a
    /// chunked prefill: its own block already quantized).
    pub shadow_chunk: usize,
    /// Threads (default: all cores).
    pub n_threads: Option<u32>,
}

/// The result for one configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct EvalRow {
    /// The K/V formats.
    pub config: EvalFormat,
    /// exp(mean negative log-likelihood of the next token).
    pub perplexity: f64,
    /// Mean KL(f16 ‖ this) over the scored positions, in nats.
    pub kl_mean: f64,
    /// 99th percentile of the per-position KL.
    pub kl_p99: f64,
    /// Share of positions whose most likely token equals the f16 run's.
    pub top1_agreement: f64,
    /// Average bits per K/V element.
    pub bits_per_element: f64,
    /// KV bytes per token for this model (all layers, K and V).
    pub kv_bytes_per_token: u64,
    /// Ours only: mean and maximum relative L2 difference of each layer's
    /// attention output from llama.cpp's (f16 K/V, flash attention) on the
    /// same inputs — the format's attention error, and for `ours:f16` the
    /// check that the shadow path reproduces llama.cpp (about 1e-6).
    pub attn_error: Option<(f64, f64)>,
}

/// The whole measurement.
#[derive(Debug, Clone, PartialEq)]
pub struct EvalReport {
    /// Tokens of the text.
    pub text_tokens: usize,
    /// Windows measured.
    pub windows: usize,
    /// Positions scored per configuration.
    pub scored: usize,
    /// One row per configuration, the reference first.
    pub rows: Vec<EvalRow>,
}

/// Log-softmax of `logits` into `out` (exponentials in f32 after subtracting
/// the maximum, their sum in f64).
fn log_softmax(logits: &[f32], out: &mut Vec<f32>) {
    let m = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    let sum: f64 = logits.iter().map(|&x| f64::from((x - m).exp())).sum();
    let lse = m + sum.ln() as f32;
    out.clear();
    out.extend(logits.iter().map(|&x| x - lse));
}

fn argmax(x: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best
}

/// One configuration's way of running a window.
enum Runner<'m> {
    Llama(Context<'m>, Batch),
    Shadow(ShadowContext<'m>),
    Graft(Box<GraftedContext<'m>>, BlockPlacer, SeqKv, Batch),
}

impl Runner<'_> {
    /// Decodes `win` from an empty cache and calls `scored(pos, logits)` for
    /// every position from `first_scored` to the one before the last.
    fn run(
        &mut self,
        win: &[TokenId],
        first_scored: usize,
        mut scored: impl FnMut(usize, &[f32]),
    ) -> Result<(), EngineError> {
        let wanted = |pos: usize| pos >= first_scored && pos + 1 < win.len();
        let chunk = match self {
            Runner::Llama(ctx, _) => {
                ctx.clear();
                ctx.n_batch() as usize
            }
            Runner::Shadow(ctx) => {
                ctx.clear();
                ctx.n_batch()
            }
            Runner::Graft(ctx, placer, seq, _) => {
                placer.release(seq);
                ctx.n_batch()
            }
        };
        for (c, part) in win.chunks(chunk).enumerate() {
            let pos0 = c * chunk;
            match self {
                Runner::Llama(ctx, batch) => {
                    batch.clear();
                    for (i, &t) in part.iter().enumerate() {
                        batch.push(t, (pos0 + i) as u32, SeqId(0), wanted(pos0 + i));
                    }
                    ctx.decode(batch)?;
                }
                Runner::Shadow(ctx) => ctx.decode(part, pos0, |i| wanted(pos0 + i))?,
                Runner::Graft(ctx, placer, seq, batch) => {
                    batch.clear();
                    for (i, &t) in part.iter().enumerate() {
                        batch.push(t, (pos0 + i) as u32, SeqId(0), wanted(pos0 + i));
                    }
                    let mut step = GraftStep::default();
                    placer.append(seq, part.len(), 0, &mut step)?;
                    let r = ctx.decode(batch, step);
                    placer.end_step();
                    r?;
                }
            }
            for i in (0..part.len()).filter(|&i| wanted(pos0 + i)) {
                let logits = match self {
                    Runner::Llama(ctx, _) => ctx.logits(i)?,
                    Runner::Shadow(ctx) => ctx.logits(i),
                    Runner::Graft(ctx, ..) => ctx.logits(i)?,
                };
                scored(pos0 + i, logits);
            }
        }
        Ok(())
    }
}

/// Measures `opts.configs` on `tokens`. `progress(done, total)` is called
/// after every window.
pub fn eval_kv(
    model: &Model,
    tokens: &[TokenId],
    opts: &EvalOptions,
    mut progress: impl FnMut(usize, usize),
) -> Result<EvalReport, EngineError> {
    let bad = |field, reason: String| Err(EngineError::InvalidOption { field, reason });
    if opts.window < 4 {
        return bad(
            "window",
            format!("{} tokens is too short (at least 4)", opts.window),
        );
    }
    if opts.stride == 0 {
        return bad("stride", "must be positive".into());
    }
    if tokens.len() < opts.window {
        return bad(
            "text",
            format!(
                "{} tokens, shorter than one window of {}",
                tokens.len(),
                opts.window
            ),
        );
    }
    let mut starts: Vec<usize> = (0..=tokens.len() - opts.window)
        .step_by(opts.stride)
        .collect();
    if opts.max_windows > 0 {
        starts.truncate(opts.max_windows);
    }
    let reference = EvalFormat::Llama(match opts.reference {
        Reference::Exact => KvConfig {
            k: KvType::F32,
            v: KvType::F32,
        },
        Reference::F16Flash => KvConfig {
            k: KvType::F16,
            v: KvType::F16,
        },
    });
    let mut configs = vec![reference];
    configs.extend(opts.configs.iter().cloned());
    let geometry = model.geometry();
    // Sizes first: a format the model cannot take fails before any work.
    let mut sizes = configs
        .iter()
        .map(|c| {
            Ok((
                c.bits_per_element(&geometry)?,
                c.kv_bytes_per_token(&geometry)?,
            ))
        })
        .collect::<Result<Vec<_>, EngineError>>()?;
    for (ci, c) in configs.iter().enumerate() {
        if *c == EvalFormat::Floor {
            sizes[ci] = sizes[0];
        }
    }
    let window = opts.window as u32;
    // llama.cpp rounds n_ctx up to a multiple of 256.
    let n_ctx = window.next_multiple_of(256);
    let n_batch = window.min(512);
    let mut runners = Vec::with_capacity(configs.len());
    for (ci, c) in configs.iter().enumerate() {
        let exact = ci == 0 && opts.reference == Reference::Exact;
        runners.push(match c {
            EvalFormat::Llama(c) => Runner::Llama(
                Context::new(
                    model,
                    ContextOptions {
                        n_ctx,
                        n_batch,
                        n_ubatch: n_batch,
                        n_seq_max: 1,
                        n_threads: opts.n_threads,
                        n_threads_batch: opts.n_threads,
                        type_k: c.k,
                        type_v: c.v,
                        flash_attention: if exact {
                            FlashAttention::Off
                        } else {
                            FlashAttention::On
                        },
                    },
                )?,
                Batch::new(),
            ),
            EvalFormat::Served(f) => {
                // One window at a time: its blocks, plus a step's worth of
                // tail blocks sealed away and not yet free.
                let blocks = (opts.window + 64).div_ceil(64) + (n_batch as usize).div_ceil(64) + 1;
                let ctx = GraftedContext::new(
                    model,
                    &GraftOptions {
                        format: f.clone(),
                        block_tokens: 64,
                        sealed_blocks: blocks,
                        tail_blocks: blocks,
                        scratch_blocks: 0,
                        n_batch,
                        max_seqs: 1,
                        threads: opts.n_threads,
                        kernel_threads: None,
                        copy_tensors: false,
                        device: DeviceAttention::Host,
                        tap_layer: None,
                        llama_attention: false,
                        q4_1_kernel: true,
                        windows: None,
                        windowed_blocks: None,
                    },
                )?;
                let placer = BlockPlacer::new(ctx.layout(), blocks, blocks);
                Runner::Graft(Box::new(ctx), placer, SeqKv::default(), Batch::new())
            }
            EvalFormat::Ours(_) | EvalFormat::Floor => {
                let mode = match c {
                    EvalFormat::Ours(f) => ShadowMode::Replace(f.clone()),
                    _ => ShadowMode::Jitter {
                        rel: FLOOR_JITTER,
                        exact: opts.reference == Reference::Exact,
                    },
                };
                Runner::Shadow(ShadowContext::new(
                    model,
                    &mode,
                    n_ctx,
                    n_batch,
                    opts.shadow_chunk,
                    opts.n_threads,
                )?)
            }
        });
    }
    let first_scored = opts.window / 2;
    let n_scored = opts.window - 1 - first_scored;
    let vocab = geometry.n_vocab as usize;
    let mut nll = vec![0f64; configs.len()];
    let mut kls: Vec<Vec<f64>> = vec![Vec::new(); configs.len()];
    let mut agree = vec![0usize; configs.len()];
    // The reference's log-probabilities and probabilities per scored position.
    let mut ref_lp: Vec<Vec<f32>> = vec![Vec::new(); n_scored];
    let mut ref_p: Vec<Vec<f32>> = vec![Vec::new(); n_scored];
    let mut lp = Vec::with_capacity(vocab);
    for (wi, &start) in starts.iter().enumerate() {
        let win = &tokens[start..start + opts.window];
        for (ci, runner) in runners.iter_mut().enumerate() {
            runner.run(win, first_scored, |pos, logits| {
                log_softmax(logits, &mut lp);
                let next = win[pos + 1].0 as usize;
                nll[ci] -= lp[next] as f64;
                let slot = pos - first_scored;
                if ci == 0 {
                    ref_lp[slot].clone_from(&lp);
                    ref_p[slot].clear();
                    ref_p[slot].extend(lp.iter().map(|&a| a.exp()));
                    kls[0].push(0.0);
                    agree[0] += 1;
                } else {
                    let r = &ref_lp[slot];
                    // Σ p·(log p − log q): f32 lanes of 1024, summed in f64.
                    let kl: f64 = r
                        .chunks(1024)
                        .zip(ref_p[slot].chunks(1024))
                        .zip(lp.chunks(1024))
                        .map(|((a, p), b)| {
                            f64::from(
                                a.iter()
                                    .zip(p)
                                    .zip(b)
                                    .map(|((&a, &p), &b)| p * (a - b))
                                    .sum::<f32>(),
                            )
                        })
                        .sum();
                    kls[ci].push(kl.max(0.0));
                    if argmax(r) == argmax(&lp) {
                        agree[ci] += 1;
                    }
                }
            })?;
        }
        progress(wi + 1, starts.len());
    }
    let total = starts.len() * n_scored;
    let rows = configs
        .iter()
        .enumerate()
        .map(|(ci, c)| {
            let mut k = std::mem::take(&mut kls[ci]);
            k.sort_by(f64::total_cmp);
            let p99 = k
                .get(((k.len() as f64 * 0.99).ceil() as usize).saturating_sub(1))
                .copied()
                .unwrap_or(0.0);
            EvalRow {
                config: c.clone(),
                perplexity: (nll[ci] / total as f64).exp(),
                kl_mean: k.iter().sum::<f64>() / total as f64,
                kl_p99: p99,
                top1_agreement: agree[ci] as f64 / total as f64,
                bits_per_element: sizes[ci].0,
                kv_bytes_per_token: sizes[ci].1,
                attn_error: match &runners[ci] {
                    Runner::Shadow(s) => s.divergence(),
                    Runner::Llama(..) | Runner::Graft(..) => None,
                },
            }
        })
        .collect();
    Ok(EvalReport {
        text_tokens: tokens.len(),
        windows: starts.len(),
        scored: total,
        rows,
    })
}
