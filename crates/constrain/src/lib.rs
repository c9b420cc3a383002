//! Constrained decoding for siliceo-infer.
//!
//! A [`Constraint`] (a JSON schema, any JSON object, a regex or a Lark
//! grammar) is compiled by [llguidance] against the model's vocabulary into a
//! [`Matcher`]: before each token is sampled, [`Matcher::mask`] gives the
//! set of tokens that keep the output a prefix of a sentence of the
//! constraint, and [`Mask::apply`] sets every other logit to −∞ (before
//! temperature, top-k and top-p, so the filters see only allowed tokens).
//! End-of-generation tokens are allowed only once the sentence is complete.
//!
//! The vocabulary is turned into llguidance's token trie once per model
//! ([`Grammars::new`], lazily on the first constrained request); each request
//! compiles its own constraint ([`Grammars::compile`]), off the engine thread.
//!
//! ```
//! use siliceo_constrain::{Grammars, Vocabulary};
//! use siliceo_core::{Constraint, TokenId};
//!
//! // A toy vocabulary: every byte, then an end-of-generation token.
//! let mut tokens: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
//! tokens.push(b"</s>".to_vec());
//! let mut special = vec![false; 256];
//! special.push(true);
//! let grammars = Grammars::new(Vocabulary {
//!     tokens,
//!     special,
//!     end_of_generation: vec![TokenId(256)],
//! });
//! let mut m = grammars.compile(&Constraint::Regex("[0-9]{4}-[0-9]{2}".into()))?;
//! let mut logits = vec![0.0f32; grammars.vocab_size()];
//! m.mask()?.apply(&mut logits);
//! assert!(logits[b'7' as usize].is_finite());
//! assert_eq!(logits[b'x' as usize], f32::NEG_INFINITY);
//! assert_eq!(logits[256], f32::NEG_INFINITY, "the end waits for a complete match");
//! # Ok::<(), siliceo_constrain::ConstraintError>(())
//! ```
//!
//! **Architecture invariant:** knows nothing of llama.cpp or any protocol;
//! the engine supplies the vocabulary's bytes, the runtime drives matchers.
//!
//! [llguidance]: https://github.com/guidance-ai/llguidance
#![deny(missing_docs)]

use std::fmt;
use std::sync::{Arc, Mutex, OnceLock};

use llguidance::ParserFactory;
use llguidance::api::{GrammarWithLexer, StopReason, TopLevelGrammar};
use llguidance::toktrie::{self, SimpleVob, TokEnv, TokRxInfo, TokTrie};
use siliceo_core::{Constraint, TokenId};

/// Why a constraint could not be compiled or followed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConstraintError {
    /// The schema, regex or grammar does not compile (its own message says
    /// where).
    #[error("{0}")]
    Invalid(String),
    /// A token the constraint does not allow reached the matcher (a bug in
    /// the caller: tokens must be sampled under the mask).
    #[error("token {token} is not allowed by the constraint: {reason}")]
    Rejected {
        /// The token.
        token: u32,
        /// llguidance's account.
        reason: String,
    },
    /// The matcher failed while computing a mask (a grammar too expensive to
    /// follow within llguidance's limits, say).
    #[error("the constraint failed: {0}")]
    Failed(String),
}

/// The model's vocabulary as the grammar compiler needs it.
#[derive(Clone)]
pub struct Vocabulary {
    /// Each token's bytes (as text, without special rendering), indexed by id.
    pub tokens: Vec<Vec<u8>>,
    /// Control tokens (`<|im_start|>`, …): never produced as text, so never
    /// allowed by a constraint; their text is kept for grammars that name
    /// them.
    pub special: Vec<bool>,
    /// End-of-generation tokens: allowed once the constraint is complete.
    pub end_of_generation: Vec<TokenId>,
}

impl fmt::Debug for Vocabulary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Vocabulary")
            .field("tokens", &self.tokens.len())
            .field("end_of_generation", &self.end_of_generation)
            .finish_non_exhaustive()
    }
}

/// The grammar compiler of one model: its token trie, built once on first
/// use, shared by every request.
pub struct Grammars {
    vocab: Mutex<Option<Vocabulary>>,
    vocab_size: usize,
    factory: OnceLock<Result<ParserFactory, String>>,
    /// Compiled constraints, most recently used last: a request with a
    /// constraint seen before clones its matcher (sharing its lexer's
    /// states) instead of compiling again.
    cache: Mutex<Vec<(Constraint, llguidance::Matcher)>>,
}

/// Compiled constraints [`Grammars`] keeps for reuse.
pub const CACHED_GRAMMARS: usize = 64;

impl fmt::Debug for Grammars {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Grammars")
            .field("vocab_size", &self.vocab_size)
            .field("built", &self.factory.get().is_some())
            .finish()
    }
}

impl Grammars {
    /// A compiler for `vocab`. The token trie is built on the first
    /// [`compile`](Self::compile) (tens of milliseconds for 150k tokens).
    pub fn new(vocab: Vocabulary) -> Self {
        Grammars {
            vocab_size: vocab.tokens.len(),
            vocab: Mutex::new(Some(vocab)),
            factory: OnceLock::new(),
            cache: Mutex::new(Vec::new()),
        }
    }

    /// Tokens in the vocabulary (the length of a mask).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    fn factory(&self) -> Result<&ParserFactory, ConstraintError> {
        self.factory
            .get_or_init(|| {
                let vocab = self
                    .vocab
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .take()
                    .ok_or("the vocabulary was lost while building the token trie")?;
                build_factory(vocab)
            })
            .as_ref()
            .map_err(|e| ConstraintError::Failed(e.clone()))
    }

    /// Compiles `c` into a matcher positioned at the start of the output.
    /// An invalid schema, regex or grammar is [`ConstraintError::Invalid`],
    /// with the compiler's message.
    ///
    /// The last [`CACHED_GRAMMARS`] distinct constraints stay compiled: a
    /// request with one of them gets a clone of its matcher, whose lexer
    /// states (built lazily, the costly part of the first masks) are shared
    /// with every request of that constraint.
    pub fn compile(&self, c: &Constraint) -> Result<Matcher, ConstraintError> {
        {
            let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(i) = cache.iter().position(|(k, _)| k == c) {
                let entry = cache.remove(i);
                let inner = entry.1.clone();
                cache.push(entry);
                return Ok(Matcher { inner, accepted: 0 });
            }
        }
        let m = self.compile_new(c)?;
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        if cache.len() >= CACHED_GRAMMARS {
            cache.remove(0);
        }
        cache.push((c.clone(), m.inner.clone()));
        Ok(m)
    }

    fn compile_new(&self, c: &Constraint) -> Result<Matcher, ConstraintError> {
        let factory = self.factory()?;
        let grammar = grammar_of(c)?;
        let parser = factory
            .create_parser(grammar)
            .map_err(|e| ConstraintError::Invalid(shorten(&e.to_string())))?;
        let inner = llguidance::Matcher::new(Ok(parser));
        if let Some(e) = inner.get_error() {
            return Err(ConstraintError::Invalid(shorten(&e)));
        }
        Ok(Matcher { inner, accepted: 0 })
    }
}

/// llguidance's grammar for `c`. A led constraint is two grammars: `start:
/// lead @then` with the lead's rules, and `c`'s own, named `then`.
fn grammar_of(c: &Constraint) -> Result<TopLevelGrammar, ConstraintError> {
    let grammar = match c {
        Constraint::JsonObject => json_grammar(serde_json::json!({"type": "object"}), true)?,
        Constraint::JsonSchema { schema, strict } => {
            let value: serde_json::Value = serde_json::from_str(schema)
                .map_err(|e| ConstraintError::Invalid(format!("not JSON: {e}")))?;
            if !value.is_object() && !value.is_boolean() {
                return Err(ConstraintError::Invalid(
                    "a JSON schema is an object (or true/false)".into(),
                ));
            }
            json_grammar(value, !strict)?
        }
        Constraint::Regex(rx) => TopLevelGrammar::from_regex(rx),
        Constraint::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
        Constraint::Led { lead, then } => {
            let mut rest = grammar_of(then)?.grammars;
            if rest.len() != 1 {
                return Err(ConstraintError::Invalid(
                    "a led constraint follows one grammar".into(),
                ));
            }
            rest[0].name = Some("then".into());
            let head = GrammarWithLexer {
                lark_grammar: Some(format!("start: lead @then\n{lead}")),
                ..GrammarWithLexer::default()
            };
            rest.insert(0, head);
            TopLevelGrammar {
                grammars: rest,
                max_tokens: None,
            }
        }
        _ => {
            return Err(ConstraintError::Invalid(format!(
                "constraint kind `{}` is not supported",
                c.kind()
            )));
        }
    };
    Ok(grammar)
}

/// At most 600 characters of an llguidance message (they can carry a long
/// grammar dump after the cause).
fn shorten(s: &str) -> String {
    let s = s.trim();
    let cut = s.char_indices().nth(600).map_or(s.len(), |(i, _)| i);
    s[..cut].to_string()
}

/// A JSON-schema grammar with the separators models write (`", "`, `": "`)
/// and no free whitespace, so the output cannot spin in blank space.
fn json_grammar(
    mut schema: serde_json::Value,
    lenient: bool,
) -> Result<TopLevelGrammar, ConstraintError> {
    if let Some(obj) = schema.as_object_mut() {
        if obj.contains_key("x-guidance") {
            return Err(ConstraintError::Invalid(
                "`x-guidance` is reserved: the server sets the JSON layout".into(),
            ));
        }
        obj.insert(
            "x-guidance".into(),
            serde_json::json!({
                "item_separator": ", ",
                "key_separator": ": ",
                "whitespace_flexible": false,
                "lenient": lenient,
            }),
        );
    }
    Ok(TopLevelGrammar::from_json_schema(schema))
}

fn build_factory(vocab: Vocabulary) -> Result<ParserFactory, String> {
    let n = vocab.tokens.len();
    if n == 0 || vocab.special.len() != n {
        return Err(format!(
            "vocabulary of {n} tokens with {} special flags",
            vocab.special.len()
        ));
    }
    let eog: Vec<u32> = vocab
        .end_of_generation
        .iter()
        .map(|t| t.0)
        .filter(|&t| (t as usize) < n)
        .collect();
    let Some(&first_eog) = eog.first() else {
        return Err("the vocabulary has no end-of-generation token".into());
    };
    let words: Vec<Vec<u8>> = vocab
        .tokens
        .into_iter()
        .zip(&vocab.special)
        .map(|(bytes, &special)| {
            if special {
                // toktrie's marker: never text, still nameable in a grammar.
                let mut w = Vec::with_capacity(bytes.len() + 1);
                w.push(TokTrie::SPECIAL_TOKEN_MARKER);
                w.extend_from_slice(&bytes);
                w
            } else {
                bytes
            }
        })
        .collect();
    let info = TokRxInfo::new(n as u32, first_eog);
    let trie = TokTrie::from(&info, &words).with_eos_tokens(&eog);
    let env: TokEnv = Arc::new(toktrie::ApproximateTokEnv::new(trie));
    let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
    factory.quiet();
    Ok(factory)
}

/// One request's constraint, following its output token by token.
pub struct Matcher {
    inner: llguidance::Matcher,
    accepted: usize,
}

impl fmt::Debug for Matcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Matcher")
            .field("accepted", &self.accepted)
            .field("finished", &self.is_finished())
            .finish()
    }
}

/// The tokens allowed at one position.
#[derive(Clone)]
pub struct Mask(SimpleVob);

impl fmt::Debug for Mask {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Mask({} allowed)", self.0.num_set())
    }
}

impl Mask {
    /// Whether `token` is allowed.
    pub fn allows(&self, token: TokenId) -> bool {
        (token.0 as usize) < self.0.len() && self.0.is_allowed(token.0)
    }

    /// How many tokens are allowed.
    pub fn count(&self) -> usize {
        self.0.num_set()
    }

    /// Sets the logit of every token not allowed to −∞ (tokens past the
    /// mask's end too).
    pub fn apply(&self, logits: &mut [f32]) {
        let words = self.0.as_slice();
        for (w, chunk) in logits.chunks_mut(32).enumerate() {
            let bits = words.get(w).copied().unwrap_or(0);
            if bits == u32::MAX {
                continue;
            }
            for (b, l) in chunk.iter_mut().enumerate() {
                if bits & (1 << b) == 0 {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        let len = self.0.len();
        if logits.len() > len {
            logits[len..].fill(f32::NEG_INFINITY);
        }
    }
}

impl Matcher {
    /// The tokens allowed next. Once the constraint is complete and nothing
    /// may follow, only end-of-generation tokens.
    pub fn mask(&mut self) -> Result<Mask, ConstraintError> {
        let m = self
            .inner
            .compute_mask_or_eos()
            .map_err(|e| ConstraintError::Failed(shorten(&e.to_string())))?;
        if m.is_zero() {
            return Err(ConstraintError::Failed(
                "no token can continue the output (the vocabulary cannot spell what the \
                 constraint requires)"
                    .into(),
            ));
        }
        Ok(Mask(m))
    }

    /// Advances past `token`, which must be allowed by the current mask.
    pub fn accept(&mut self, token: TokenId) -> Result<(), ConstraintError> {
        if self.inner.is_stopped() {
            // Past the end (an end-of-generation token the caller chose to
            // ignore): nothing more to follow.
            return Ok(());
        }
        self.inner
            .consume_token(token.0)
            .map_err(|e| ConstraintError::Rejected {
                token: token.0,
                reason: shorten(&e.to_string()),
            })?;
        self.accepted += 1;
        Ok(())
    }

    /// How many leading tokens of `tokens` the constraint allows from here
    /// (the state does not change).
    pub fn valid_prefix(&mut self, tokens: &[TokenId]) -> usize {
        if tokens.is_empty() || self.inner.is_stopped() {
            return 0;
        }
        let ids: Vec<u32> = tokens.iter().map(|t| t.0).collect();
        self.inner.validate_tokens(&ids).unwrap_or(0)
    }

    /// Whether the output is complete: an end-of-generation token was
    /// accepted or nothing more may follow.
    pub fn is_finished(&self) -> bool {
        self.inner.is_stopped() && self.inner.stop_reason() != StopReason::InternalError
    }

    /// Tokens accepted so far.
    pub fn accepted(&self) -> usize {
        self.accepted
    }
}

#[cfg(test)]
mod tests;
