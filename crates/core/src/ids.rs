use std::fmt;

use serde::{Deserialize, Serialize};

/// A token of a model's vocabulary.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Serialize, Deserialize,
)]
#[serde(transparent)]
#[repr(transparent)]
pub struct TokenId(pub u32);

/// A sequence slot inside one inference context (llama.cpp's `llama_seq_id`).
///
/// Sequence ids are a scarce resource (at most `n_seq_max`, ≤ 256): whoever hands
/// them out must take them back when a request ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
#[repr(transparent)]
pub struct SeqId(pub u32);

/// A request's id, chosen by the client or assigned by the server.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub String);

impl From<u32> for TokenId {
    fn from(v: u32) -> Self {
        TokenId(v)
    }
}

impl From<TokenId> for u32 {
    fn from(v: TokenId) -> Self {
        v.0
    }
}

impl fmt::Display for TokenId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl fmt::Display for SeqId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "seq{}", self.0)
    }
}

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<&str> for RequestId {
    fn from(v: &str) -> Self {
        RequestId(v.to_owned())
    }
}

impl From<String> for RequestId {
    fn from(v: String) -> Self {
        RequestId(v)
    }
}
