//! Errors in OpenAI's JSON shape, with the status each one warrants.

use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use siliceo_runtime::{Rejected, RuntimeError};

/// An error answered as `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// What went wrong, for a person.
    pub message: String,
    /// OpenAI's error type (`invalid_request_error`, …).
    pub kind: &'static str,
    /// The request field at fault, when there is one.
    pub param: Option<String>,
    /// A stable code (`model_not_found`, `invalid_api_key`, …).
    pub code: Option<&'static str>,
    /// Seconds a client should wait before retrying (429 and 503).
    pub retry_after_s: Option<u32>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            retry_after_s: None,
        }
    }

    /// 400 naming `field`.
    pub fn invalid(field: impl Into<String>, reason: impl std::fmt::Display) -> Self {
        let field = field.into();
        let mut e = Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            format!("{field}: {reason}"),
        );
        e.param = Some(field);
        e
    }

    /// 400 for a field this server does not implement (yet).
    pub fn unsupported(field: &str, what: &str) -> Self {
        let mut e = Self::invalid(field, format!("{what} is not supported by this server"));
        e.code = Some("unsupported_parameter");
        e
    }

    /// 401.
    pub fn unauthorized(message: &str) -> Self {
        let mut e = Self::new(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            message.to_string(),
        );
        e.code = Some("invalid_api_key");
        e
    }

    /// 404 for a model this server does not serve.
    pub fn model_not_found(asked: &str, served: &str) -> Self {
        let mut e = Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("the model `{asked}` does not exist; this server serves `{served}`"),
        );
        e.param = Some("model".into());
        e.code = Some("model_not_found");
        e
    }

    /// 404 for something kept by id that is not there (`param`: the field
    /// that named it, when one did).
    pub fn not_found(param: Option<&str>, message: impl Into<String>) -> Self {
        let mut e = Self::new(StatusCode::NOT_FOUND, "invalid_request_error", message);
        e.param = param.map(str::to_string);
        e
    }

    /// 404 for an unknown path.
    pub fn no_route(path: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("no such endpoint: {path}"),
        )
    }

    /// 405: the endpoint exists, the method does not (axum keeps the
    /// `Allow` header).
    pub fn wrong_method(method: &Method, path: &str) -> Self {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "invalid_request_error",
            format!("{path} does not take {method}"),
        )
    }

    /// 413.
    pub fn too_large(limit: usize) -> Self {
        let mut e = Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!("the request body exceeds the limit of {limit} bytes"),
        );
        e.code = Some("request_too_large");
        e
    }

    /// 500.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    /// The status and body for a runtime error: 400 naming the field, 429
    /// for a full queue (with `Retry-After`), 400 for a request larger than
    /// the whole cache or context, 503 when the engine is stopping, 500 for
    /// engine failures.
    pub fn from_runtime(e: &RuntimeError) -> Self {
        match e {
            // The runtime's chat input is OpenAI's `messages`.
            RuntimeError::InvalidRequest {
                field: "chat",
                reason,
            } => Self::invalid("messages", reason),
            RuntimeError::InvalidRequest { field, reason } => Self::invalid(*field, reason),
            RuntimeError::ContextLengthExceeded { field, .. } => {
                let mut e = Self::invalid(*field, e.to_string());
                e.code = Some("context_length_exceeded");
                e
            }
            RuntimeError::Rejected(r) => match r {
                Rejected::PromptTooLong { .. } | Rejected::EmptyPrompt(_) => {
                    Self::invalid("prompt", r.to_string())
                }
                Rejected::TooLargeForCache { .. } => {
                    let mut e = Self::invalid("max_tokens", r.to_string());
                    e.code = Some("context_length_exceeded");
                    e
                }
                Rejected::DuplicateId(_) => Self::invalid("id", r.to_string()),
                _ => {
                    let mut e = Self::new(
                        StatusCode::TOO_MANY_REQUESTS,
                        "rate_limit_error",
                        r.to_string(),
                    );
                    e.code = Some("queue_full");
                    e.retry_after_s = Some(1);
                    e
                }
            },
            RuntimeError::Stopped => {
                let mut e = Self::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "server_error",
                    "the engine has stopped",
                );
                e.retry_after_s = Some(5);
                e
            }
            other => Self::internal(other.to_string()),
        }
    }

    /// The JSON body (also sent as an SSE event when a stream fails midway).
    pub fn body(&self) -> serde_json::Value {
        #[derive(Serialize)]
        struct Inner<'a> {
            message: &'a str,
            #[serde(rename = "type")]
            kind: &'a str,
            param: Option<&'a str>,
            code: Option<&'a str>,
        }
        serde_json::json!({
            "error": Inner {
                message: &self.message,
                kind: self.kind,
                param: self.param.as_deref(),
                code: self.code,
            }
        })
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status.as_u16(), self.message)
    }
}

impl std::error::Error for ApiError {}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after_s {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runtime_errors_map_to_openai_statuses() {
        let e = ApiError::from_runtime(&RuntimeError::InvalidRequest {
            field: "temperature",
            reason: "must be in [0, 2]".into(),
        });
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(e.param.as_deref(), Some("temperature"));
        // A chat the template refuses names OpenAI's field.
        let e = ApiError::from_runtime(&RuntimeError::InvalidRequest {
            field: "chat",
            reason: "roles must alternate".into(),
        });
        assert_eq!(e.param.as_deref(), Some("messages"));
        let e = ApiError::from_runtime(&RuntimeError::Rejected(Rejected::QueueFull(
            siliceo_core::RequestId("r1".into()),
        )));
        assert_eq!(e.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(e.retry_after_s, Some(1));
        let body = e.body();
        assert_eq!(body["error"]["type"], "rate_limit_error");
        assert_eq!(body["error"]["code"], "queue_full");
        let e = ApiError::from_runtime(&RuntimeError::ContextLengthExceeded {
            field: "max_completion_tokens",
            prompt_tokens: 10,
            max_tokens: 5000,
            n_ctx: 4096,
        });
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(e.param.as_deref(), Some("max_completion_tokens"));
        assert_eq!(e.body()["error"]["code"], "context_length_exceeded");
        let e = ApiError::from_runtime(&RuntimeError::Engine("boom".into()));
        assert_eq!(e.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(
            ApiError::from_runtime(&RuntimeError::Stopped).status,
            StatusCode::SERVICE_UNAVAILABLE
        );
    }
}
