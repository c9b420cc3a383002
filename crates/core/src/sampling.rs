use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::{Error, TokenId};

/// Most stop strings a request may carry.
pub const MAX_STOP_STRINGS: usize = 16;
/// Longest stop string, in bytes.
pub const MAX_STOP_STRING_BYTES: usize = 256;

/// How to pick each next token, and when to stop.
///
/// The defaults ([`SamplingParams::default`]) are greedy decoding of at most
/// 256 tokens; every filter is off at its neutral value (`top_k = 0`,
/// `top_p = 1`, `min_p = 0`, penalties 1/0/0).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// Softmax temperature; `0` means greedy (argmax).
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; `0` disables.
    pub top_k: u32,
    /// Keep the smallest set of tokens whose probability sums to `top_p`; `1` disables.
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` × the best token's probability; `0` disables.
    pub min_p: f32,
    /// Seed of the sampler's random stream; `None` draws one.
    pub seed: Option<u64>,
    /// Divide positive logits (multiply negative ones) of recently seen tokens; `1` disables.
    pub repetition_penalty: f32,
    /// Subtracted from the logit of every recently seen token; `0` disables.
    pub presence_penalty: f32,
    /// Subtracted once per occurrence of a recently seen token; `0` disables.
    pub frequency_penalty: f32,
    /// How many recent tokens (prompt included) the penalties look at.
    pub penalty_last_n: u32,
    /// Most tokens to generate.
    pub max_tokens: u32,
    /// Generation stops before any of these strings; they are not returned.
    pub stop: Vec<String>,
    /// Generation stops after any of these tokens (in addition to
    /// end-of-generation tokens), whose text is returned (a control token
    /// has none), as vLLM does.
    pub stop_token_ids: Vec<TokenId>,
    /// Keep going past end-of-generation tokens (benchmarks only).
    pub ignore_eos: bool,
    /// Added to these tokens' logits before anything else (OpenAI's
    /// `logit_bias`: −100 bans a token, +100 all but forces it).
    pub logit_bias: Vec<(TokenId, f32)>,
}

/// Most tokens a request may bias (OpenAI's limit).
pub const MAX_LOGIT_BIAS: usize = 300;

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams::greedy()
    }
}

impl SamplingParams {
    /// Greedy decoding, 256 tokens, no penalties.
    pub fn greedy() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: None,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            penalty_last_n: 64,
            max_tokens: 256,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            logit_bias: Vec::new(),
        }
    }

    /// Whether the next token is chosen by argmax.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// Whether any of the three penalties is active.
    pub fn has_penalties(&self) -> bool {
        self.penalty_last_n > 0
            && (self.repetition_penalty != 1.0
                || self.presence_penalty != 0.0
                || self.frequency_penalty != 0.0)
    }

    /// Whether the logits are used as the model gave them (no penalties, no
    /// bias): greedy decoding is then a plain argmax.
    pub fn is_plain(&self) -> bool {
        !self.has_penalties() && self.logit_bias.is_empty()
    }

    /// Checks every field's range; the error names the offending field.
    pub fn validate(&self) -> Result<(), Error> {
        let finite = |field: &'static str, v: f32| {
            if v.is_finite() {
                Ok(())
            } else {
                Err(Error::invalid(
                    field,
                    format!("must be a finite number, got {v}"),
                ))
            }
        };
        finite("temperature", self.temperature)?;
        finite("top_p", self.top_p)?;
        finite("min_p", self.min_p)?;
        finite("repetition_penalty", self.repetition_penalty)?;
        finite("presence_penalty", self.presence_penalty)?;
        finite("frequency_penalty", self.frequency_penalty)?;
        if !(0.0..=100.0).contains(&self.temperature) {
            return Err(Error::invalid(
                "temperature",
                format!("must be in [0, 100], got {}", self.temperature),
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(Error::invalid(
                "top_p",
                format!("must be in (0, 1], got {}", self.top_p),
            ));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(Error::invalid(
                "min_p",
                format!("must be in [0, 1], got {}", self.min_p),
            ));
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty <= 10.0) {
            return Err(Error::invalid(
                "repetition_penalty",
                format!("must be in (0, 10], got {}", self.repetition_penalty),
            ));
        }
        if !(-2.0..=2.0).contains(&self.presence_penalty) {
            return Err(Error::invalid(
                "presence_penalty",
                format!("must be in [-2, 2], got {}", self.presence_penalty),
            ));
        }
        if !(-2.0..=2.0).contains(&self.frequency_penalty) {
            return Err(Error::invalid(
                "frequency_penalty",
                format!("must be in [-2, 2], got {}", self.frequency_penalty),
            ));
        }
        if self.max_tokens == 0 {
            return Err(Error::invalid("max_tokens", "must be at least 1"));
        }
        if self.logit_bias.len() > MAX_LOGIT_BIAS {
            return Err(Error::invalid(
                "logit_bias",
                format!(
                    "at most {MAX_LOGIT_BIAS} tokens, got {}",
                    self.logit_bias.len()
                ),
            ));
        }
        if let Some((t, b)) = self
            .logit_bias
            .iter()
            .find(|(_, b)| !(-100.0..=100.0).contains(b))
        {
            return Err(Error::invalid(
                "logit_bias",
                format!("the bias of token {} must be in [-100, 100], got {b}", t.0),
            ));
        }
        if self.stop.len() > MAX_STOP_STRINGS {
            return Err(Error::invalid(
                "stop",
                format!(
                    "at most {MAX_STOP_STRINGS} stop strings, got {}",
                    self.stop.len()
                ),
            ));
        }
        for s in &self.stop {
            if s.is_empty() {
                return Err(Error::invalid("stop", "stop strings must not be empty"));
            }
            if s.len() > MAX_STOP_STRING_BYTES {
                return Err(Error::invalid(
                    "stop",
                    format!(
                        "a stop string is at most {MAX_STOP_STRING_BYTES} bytes, got {}",
                        s.len()
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// Scheduling class of a request. Lower classes age upwards so they are never
/// starved forever.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Serialize, Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Priority {
    /// A person is waiting on it.
    Interactive,
    /// The default.
    #[default]
    Normal,
    /// Offline work; runs when nothing else wants the engine.
    Batch,
}

impl Priority {
    /// All classes, highest first.
    pub const ALL: [Priority; 3] = [Priority::Interactive, Priority::Normal, Priority::Batch];

    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            Priority::Interactive => "interactive",
            Priority::Normal => "normal",
            Priority::Batch => "batch",
        }
    }
}

impl fmt::Display for Priority {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Priority {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Priority::ALL
            .into_iter()
            .find(|p| p.name().eq_ignore_ascii_case(s.trim()))
            .ok_or_else(|| Error::UnknownPriority(s.to_owned()))
    }
}

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// An end-of-generation token, a stop token or a stop string.
    Stop,
    /// `max_tokens` reached, or the context is full.
    Length,
    /// The client cancelled, or its deadline passed.
    Cancelled,
    /// The request failed; the error is reported beside it.
    Error,
}

impl FinishReason {
    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
            FinishReason::Error => "error",
        }
    }
}

impl fmt::Display for FinishReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field_of(p: SamplingParams) -> Option<&'static str> {
        match p.validate() {
            Ok(()) => None,
            Err(Error::InvalidParameter { field, .. }) => Some(field),
            Err(e) => panic!("unexpected {e}"),
        }
    }

    #[test]
    fn validation_names_the_field() {
        let base = SamplingParams::greedy;
        let cases: Vec<(SamplingParams, Option<&str>)> = vec![
            (base(), None),
            (
                SamplingParams {
                    temperature: -0.1,
                    ..base()
                },
                Some("temperature"),
            ),
            (
                SamplingParams {
                    temperature: f32::NAN,
                    ..base()
                },
                Some("temperature"),
            ),
            (
                SamplingParams {
                    top_p: 0.0,
                    ..base()
                },
                Some("top_p"),
            ),
            (
                SamplingParams {
                    top_p: 1.5,
                    ..base()
                },
                Some("top_p"),
            ),
            (
                SamplingParams {
                    min_p: 1.5,
                    ..base()
                },
                Some("min_p"),
            ),
            (
                SamplingParams {
                    repetition_penalty: 0.0,
                    ..base()
                },
                Some("repetition_penalty"),
            ),
            (
                SamplingParams {
                    presence_penalty: 3.0,
                    ..base()
                },
                Some("presence_penalty"),
            ),
            (
                SamplingParams {
                    frequency_penalty: -3.0,
                    ..base()
                },
                Some("frequency_penalty"),
            ),
            (
                SamplingParams {
                    max_tokens: 0,
                    ..base()
                },
                Some("max_tokens"),
            ),
            (
                SamplingParams {
                    stop: vec![String::new()],
                    ..base()
                },
                Some("stop"),
            ),
            (
                SamplingParams {
                    stop: vec!["x".into(); 17],
                    ..base()
                },
                Some("stop"),
            ),
            (
                SamplingParams {
                    temperature: 0.8,
                    top_k: 40,
                    top_p: 0.95,
                    min_p: 0.05,
                    ..base()
                },
                None,
            ),
        ];
        for (params, expected) in cases {
            assert_eq!(field_of(params.clone()), expected, "{params:?}");
        }
    }

    #[test]
    fn priority_parses_and_orders() {
        assert_eq!(
            "Interactive".parse::<Priority>().unwrap(),
            Priority::Interactive
        );
        assert!(Priority::Interactive < Priority::Normal && Priority::Normal < Priority::Batch);
        assert!("urgent".parse::<Priority>().is_err());
    }
}
