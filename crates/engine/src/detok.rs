//! Incremental detokenization that never emits a broken UTF-8 character.

use siliceo_core::{SamplingParams, StopMatcher, StopOutcome, TokenId};

use crate::Model;

/// Turns a stream of byte chunks into a stream of valid UTF-8 text.
///
/// A multi-byte character split across tokens is held back until it is
/// complete; bytes that can never form a character become U+FFFD.
#[derive(Debug, Default, Clone)]
pub struct Utf8Stream {
    pending: Vec<u8>,
}

impl Utf8Stream {
    /// An empty stream.
    pub fn new() -> Self {
        Utf8Stream::default()
    }

    /// Adds bytes; returns the text that is now complete (possibly empty).
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        let mut start = 0;
        loop {
            match std::str::from_utf8(&self.pending[start..]) {
                Ok(s) => {
                    out.push_str(s);
                    start = self.pending.len();
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // Safe: from_utf8 just vouched for these bytes.
                    out.push_str(
                        std::str::from_utf8(&self.pending[start..start + valid])
                            .unwrap_or_default(),
                    );
                    start += valid;
                    match e.error_len() {
                        // Incomplete character at the end: wait for more bytes.
                        None => break,
                        Some(n) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            start += n;
                        }
                    }
                }
            }
        }
        self.pending.drain(..start);
        out
    }

    /// Ends the stream: any incomplete character left becomes U+FFFD.
    pub fn finish(&mut self) -> String {
        let out = if self.pending.is_empty() {
            String::new()
        } else {
            String::from_utf8_lossy(&self.pending).into_owned()
        };
        self.pending.clear();
        out
    }

    /// Bytes held back waiting for the rest of a character.
    pub fn pending_len(&self) -> usize {
        self.pending.len()
    }
}

/// Detokenizes a generation token by token.
#[derive(Debug)]
pub struct Detokenizer<'m> {
    model: &'m Model,
    stream: Utf8Stream,
    /// Control tokens rendered as their text (markup a reader needs, such
    /// as Mistral's `[TOOL_CALLS]`).
    preserved: std::sync::Arc<[TokenId]>,
}

impl<'m> Detokenizer<'m> {
    /// A detokenizer for `model`'s vocabulary.
    pub fn new(model: &'m Model) -> Self {
        Detokenizer {
            model,
            stream: Utf8Stream::new(),
            preserved: std::sync::Arc::from([]),
        }
    }

    /// The bytes `token` stands for here: control tokens are nothing,
    /// except the preserved ones, which are their text.
    pub fn bytes_of(&self, token: TokenId) -> Vec<u8> {
        self.model
            .token_bytes(token, self.preserved.contains(&token))
    }

    /// The text `token` completes (control tokens render as nothing, but
    /// the preserved ones).
    pub fn push(&mut self, token: TokenId) -> String {
        let bytes = self.bytes_of(token);
        self.stream.push(&bytes)
    }

    /// Whatever is left at the end of the generation.
    pub fn finish(&mut self) -> String {
        self.stream.finish()
    }
}

/// A generation's text, token by token: detokenization, end-of-generation and
/// stop tokens, and stop strings — the one place both [`crate::generate()`] and
/// the serving runtime turn sampled tokens into text.
#[derive(Debug)]
pub struct TokenText<'m> {
    model: &'m Model,
    detok: Detokenizer<'m>,
    stops: StopMatcher,
    ignore_eos: bool,
    stop_token_ids: Vec<TokenId>,
    /// Tokens before which nothing stops the generation.
    min_tokens: u32,
    /// Tokens pushed so far.
    seen: u32,
}

impl<'m> TokenText<'m> {
    /// This text, where nothing stops the generation before its
    /// `min_tokens`-th token (vLLM's `min_tokens`: end-of-generation and
    /// stop tokens, which the sampler bans meanwhile, and stop strings).
    pub fn with_min_tokens(mut self, min_tokens: u32) -> Self {
        self.min_tokens = min_tokens;
        self
    }

    /// This text, where the `preserved` control tokens render as their
    /// text (markup a reader of the output needs) instead of nothing.
    pub fn with_preserved(mut self, preserved: std::sync::Arc<[TokenId]>) -> Self {
        self.detok.preserved = preserved;
        self
    }

    /// The bytes `token` stands for in this text.
    pub fn bytes_of(&self, token: TokenId) -> Vec<u8> {
        self.detok.bytes_of(token)
    }

    /// Text for a generation under `params` (stop strings, stop tokens, `ignore_eos`).
    pub fn new(model: &'m Model, params: &SamplingParams) -> Self {
        TokenText {
            model,
            detok: Detokenizer::new(model),
            stops: StopMatcher::new(&params.stop),
            ignore_eos: params.ignore_eos,
            stop_token_ids: params.stop_token_ids.clone(),
            min_tokens: 0,
            seen: 0,
        }
    }

    /// The text `token` makes safe to emit, and whether the generation stops
    /// here: an end-of-generation token (not emitted), a requested stop
    /// token (emitted as vLLM does: its text, which a control token has
    /// none of), or a completed stop string (not emitted).
    pub fn push(&mut self, token: TokenId) -> (String, bool) {
        self.seen += 1;
        let eog = !self.ignore_eos && self.model.is_eog(token);
        if self.seen < self.min_tokens {
            // Too early to stop: an end-of-generation token (let through
            // only when nothing else was allowed) is no text.
            return (
                if eog {
                    String::new()
                } else {
                    self.detok.push(token)
                },
                false,
            );
        }
        let is_stop_token = eog || self.stop_token_ids.contains(&token);
        let piece = if eog {
            String::new()
        } else {
            self.detok.push(token)
        };
        match self.stops.push(&piece) {
            StopOutcome::Continue(t) => (t, is_stop_token),
            StopOutcome::Stopped(t) => (t, true),
        }
    }

    /// The stop string that ended the generation, if one did.
    pub fn stop_string(&self) -> Option<&str> {
        self.stops.matched()
    }

    /// The generation ended for another reason: what was held back (a split
    /// character, a possible stop string's start).
    pub fn finish(&mut self) -> String {
        let mut tail = self.detok.finish();
        tail.push_str(&self.stops.finish());
        tail
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_characters_are_held_back() {
        let text = "héllo, 世界 🦀!";
        let bytes = text.as_bytes();
        // Feed one byte at a time: every emitted piece must be valid and the
        // concatenation must be the original.
        let mut s = Utf8Stream::new();
        let mut out = String::new();
        for b in bytes {
            out.push_str(&s.push(std::slice::from_ref(b)));
        }
        out.push_str(&s.finish());
        assert_eq!(out, text);
    }

    #[test]
    fn every_split_point_round_trips() {
        let text = "aé世🦀b".as_bytes();
        for i in 0..=text.len() {
            for j in i..=text.len() {
                let mut s = Utf8Stream::new();
                let mut out = s.push(&text[..i]);
                out += &s.push(&text[i..j]);
                out += &s.push(&text[j..]);
                out += &s.finish();
                assert_eq!(out.as_bytes(), text, "split at {i},{j}");
            }
        }
    }

    #[test]
    fn invalid_bytes_become_replacement_characters() {
        let mut s = Utf8Stream::new();
        assert_eq!(s.push(b"a\xffb"), "a\u{FFFD}b");
        assert_eq!(s.push(b"\xe4\xb8"), "");
        assert_eq!(s.pending_len(), 2);
        assert_eq!(s.finish(), "\u{FFFD}");
        assert_eq!(s.pending_len(), 0);
    }
}
