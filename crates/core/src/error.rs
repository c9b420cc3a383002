/// Errors raised by the shared types: a value out of range or a name not known.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A request parameter is outside its valid range.
    #[error("invalid `{field}`: {reason}")]
    InvalidParameter {
        /// The parameter's name, as a client spells it.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// A KV cache type name that is not one of [`crate::KvType::ALL`].
    #[error(
        "unknown KV cache type `{0}` (known: f32, f16, bf16, q8_0, q5_1, q5_0, q4_1, q4_0, iq4_nl)"
    )]
    UnknownKvType(String),
    /// A priority name that is not `interactive`, `normal` or `batch`.
    #[error("unknown priority `{0}` (known: interactive, normal, batch)")]
    UnknownPriority(String),
}

impl Error {
    /// A stable, short label for metrics (`error=<kind>`).
    pub fn error_kind(&self) -> &'static str {
        match self {
            Error::InvalidParameter { .. } => "invalid_parameter",
            Error::UnknownKvType(_) => "unknown_kv_type",
            Error::UnknownPriority(_) => "unknown_priority",
        }
    }

    pub(crate) fn invalid(field: &'static str, reason: impl Into<String>) -> Self {
        Error::InvalidParameter {
            field,
            reason: reason.into(),
        }
    }
}
