//! What a constrained request's output must match.

use serde::{Deserialize, Serialize};

use crate::Error;

/// Largest constraint text (a schema, a regex or a grammar) a request may
/// carry, in bytes.
pub const MAX_CONSTRAINT_BYTES: usize = 256 * 1024;

/// A language the generated text is held to while decoding: each sampled
/// token keeps the text a prefix of some sentence of it, and end-of-text is
/// allowed only once the sentence is complete.
///
/// The text is compiled per request (`siliceo-constrain`); an invalid
/// schema, regex or grammar is refused before the request is queued.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum Constraint {
    /// Any JSON object (OpenAI's `response_format: json_object`).
    JsonObject,
    /// JSON that validates against a JSON schema (given as JSON text).
    JsonSchema {
        /// The schema, as JSON text.
        schema: String,
        /// Refuse schema keywords the compiler cannot enforce (otherwise
        /// they are ignored).
        strict: bool,
    },
    /// Text matching a regular expression (Rust `regex` syntax), anchored
    /// at both ends.
    Regex(String),
    /// Text derived by a Lark grammar (llguidance's dialect: `start` is the
    /// root rule).
    Lark(String),
    /// Text a Lark grammar's rule `lead` derives, then text `then` holds
    /// (a reasoning model's thinking, free, before the answer the request
    /// constrains).
    Led {
        /// Lark rules, `lead` among them.
        lead: String,
        /// What holds the rest of the text.
        then: Box<Constraint>,
    },
}

impl Constraint {
    /// A short name of its kind (`json_object`, `json_schema`, `regex`,
    /// `grammar`; a led constraint's is what follows the lead), for logs
    /// and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Constraint::JsonObject => "json_object",
            Constraint::JsonSchema { .. } => "json_schema",
            Constraint::Regex(_) => "regex",
            Constraint::Lark(_) => "grammar",
            Constraint::Led { then, .. } => then.kind(),
        }
    }

    /// Checks the size limit; `field` names the request field it came from.
    pub fn validate(&self, field: &'static str) -> Result<(), Error> {
        let len = match self {
            Constraint::JsonObject => 0,
            Constraint::JsonSchema { schema, .. } => schema.len(),
            Constraint::Regex(s) | Constraint::Lark(s) => s.len(),
            Constraint::Led { then, .. } => return then.validate(field),
        };
        if len > MAX_CONSTRAINT_BYTES {
            return Err(Error::invalid(
                field,
                format!("{len} bytes; at most {MAX_CONSTRAINT_BYTES} are accepted"),
            ));
        }
        if matches!(self, Constraint::Regex(s) | Constraint::Lark(s) if s.trim().is_empty()) {
            return Err(Error::invalid(field, "is empty"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oversized_and_empty_constraints_are_refused_naming_the_field() {
        let big = Constraint::Regex("a".repeat(MAX_CONSTRAINT_BYTES + 1));
        let err = big.validate("regex").unwrap_err();
        assert!(matches!(
            err,
            Error::InvalidParameter { field: "regex", .. }
        ));
        let empty = Constraint::Lark("  \n".into());
        assert!(empty.validate("grammar").is_err());
        assert!(Constraint::JsonObject.validate("response_format").is_ok());
        assert_eq!(Constraint::Lark("start: \"a\"".into()).kind(), "grammar");
    }
}
