//! Why the pacer did not let a request go, and how that reads over HTTP.

use std::time::Duration;

use http::StatusCode;
use sluice_store::StoreError;

/// Why a request was not paced through.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PaceError {
    /// No provider of that name in the config.
    #[error("no provider `{provider}` in the pace config")]
    UnknownProvider {
        /// The name asked for.
        provider: String,
    },
    /// The request alone is larger than the provider's whole TPM: no wait
    /// would ever let it through.
    #[error(
        "request needs ~{estimated} tokens but {provider} allows {limit} per minute: it can never be sent (shorten it{})",
        if *.shrink { "; shrinking could not bring it under" } else { ", or enable shrink for this provider" }
    )]
    TooLarge {
        /// The provider.
        provider: String,
        /// Estimated tokens (prompt + completion budget), after any shrink.
        estimated: u32,
        /// The provider's TPM.
        limit: u32,
        /// Whether shrinking was enabled (and tried).
        shrink: bool,
    },
    /// Room comes back later than the provider's maximum wait allows.
    #[error(
        "{provider} has no room for this request for {wait:?} (longer than the {max_wait:?} a request may wait)"
    )]
    WouldWait {
        /// The provider.
        provider: String,
        /// How long until it would fit.
        wait: Duration,
        /// The configured maximum.
        max_wait: Duration,
    },
    /// The request names a priority that is neither `interactive` nor
    /// `batch` (the `x-sluice-priority` header).
    #[error("x-sluice-priority: `{value}` is not a priority (expected `interactive` or `batch`)")]
    InvalidPriority {
        /// What the request said.
        value: String,
    },
    /// A JSON body the pacer cannot count: not JSON, or a completion budget,
    /// `n` or `stream` of a type a lenient provider reads as a number or a
    /// boolean (`"900"`, `900.0`, `1`), which the estimate would take as absent
    /// and so under-count, tripping the provider.
    #[error("the request body cannot be counted: {message}")]
    UncountableBody {
        /// A short machine-readable name (`not_json`, `bad_max_tokens`, `bad_n`,
        /// `bad_stream`).
        reason: &'static str,
        /// What is wrong, for the message.
        message: String,
    },
    /// The budget store could not answer.
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl PaceError {
    /// The HTTP status the proxy answers with.
    pub fn status(&self) -> StatusCode {
        match self {
            PaceError::UnknownProvider { .. } => StatusCode::NOT_FOUND,
            PaceError::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            PaceError::WouldWait { .. } => StatusCode::TOO_MANY_REQUESTS,
            PaceError::InvalidPriority { .. } | PaceError::UncountableBody { .. } => {
                StatusCode::BAD_REQUEST
            }
            PaceError::Store(_) => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// The `error.code` of the JSON envelope.
    pub fn code(&self) -> &'static str {
        match self {
            PaceError::UnknownProvider { .. } => "unknown_provider",
            PaceError::TooLarge { .. } => "request_too_large",
            PaceError::WouldWait { .. } => "rate_limited",
            PaceError::InvalidPriority { .. } => "invalid_priority",
            PaceError::UncountableBody { .. } => "invalid_request",
            PaceError::Store(_) => "store_unavailable",
        }
    }

    /// When a retry can succeed, after how long.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            PaceError::WouldWait { wait, .. } => Some(*wait),
            PaceError::Store(_) => Some(Duration::from_secs(1)),
            _ => None,
        }
    }

    /// The JSON envelope `{"error":{"code","message","details"}}`.
    pub fn envelope(&self) -> serde_json::Value {
        let details = match self {
            PaceError::UnknownProvider { provider } => serde_json::json!({ "provider": provider }),
            PaceError::TooLarge {
                provider,
                estimated,
                limit,
                shrink,
            } => serde_json::json!({
                "provider": provider,
                "estimated_tokens": estimated,
                "tpm_limit": limit,
                "shrink": shrink,
            }),
            PaceError::WouldWait {
                provider,
                wait,
                max_wait,
            } => serde_json::json!({
                "provider": provider,
                "retry_after_seconds": wait.as_secs_f64().ceil() as u64,
                "max_wait_seconds": max_wait.as_secs_f64(),
            }),
            PaceError::InvalidPriority { .. } => {
                serde_json::json!({ "header": crate::priority::PRIORITY_HEADER })
            }
            PaceError::UncountableBody { reason, .. } => serde_json::json!({ "reason": reason }),
            PaceError::Store(_) => serde_json::json!({ "retry_after_seconds": 1 }),
        };
        serde_json::json!({
            "error": { "code": self.code(), "message": self.to_string(), "details": details }
        })
    }
}
