//! What the client is told (SPEC H1–H3): `X-RateLimit-*` on every response,
//! the IETF draft fields when enabled, and the refusals. Every HTTP answer
//! sluice makes itself is built here.

use std::fmt::Write as _;
use std::time::Duration;

use bytes::Bytes;
use http::header::{ACCEPT_ENCODING, CONTENT_TYPE, HeaderName, HeaderValue, RETRY_AFTER};
use http::{HeaderMap, Response, StatusCode};
use http_body_util::Full;
use sluice_core::Decision;
use sluice_policy::{PathError, Policy, Refusal, Unclassifiable};

use crate::limiter::Refused;
use crate::plan::Plan;

/// `X-RateLimit-Limit`.
pub const X_RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
/// `X-RateLimit-Remaining`.
pub const X_RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
/// `X-RateLimit-Reset` (Unix seconds).
pub const X_RATELIMIT_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");
/// IETF draft-10 `RateLimit-Policy`.
pub const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
/// IETF draft-10 `RateLimit`.
pub const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");

/// The edge limiter's 429 body (SPEC H2).
pub const EDGE_BODY: &str = "Too many requests, please try again later.";

/// Seconds, rounded up, never below 1: what `Retry-After` says.
pub fn retry_after_secs(d: Duration) -> u64 {
    let secs = d.as_secs() + u64::from(d.subsec_nanos() > 0);
    secs.max(1)
}

/// The wait a refusal announces: until every budget has room, or — for a
/// request that can never fit — until the refusing budget's window resets.
pub fn refusal_wait(decision: &Decision) -> u64 {
    match decision.retry_after() {
        Some(d) => retry_after_secs(d),
        None => decision
            .binding()
            .map_or(1, |b| b.reset_after_secs(decision.decided_at()).max(1)),
    }
}

/// The value of one rate-limit header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RateLimitValue<'a> {
    /// A number (`X-RateLimit-*`).
    Number(u64),
    /// A structured field (the IETF draft's `RateLimit` and `RateLimit-Policy`).
    Text(&'a str),
}

/// Calls `emit` with each rate-limit header of `decision`, in order: the three
/// `X-RateLimit-*` of the binding budget, then, when the policy enables them, the
/// IETF draft-10 `RateLimit-Policy` and `RateLimit`. A server that writes its heads
/// itself writes these; [`rate_limit_headers`] puts them in a header map.
pub fn for_each_rate_limit_header(
    decision: &Decision,
    plan: &Plan,
    policy: &Policy,
    mut emit: impl FnMut(&HeaderName, RateLimitValue<'_>),
) {
    let Some(binding) = decision.binding() else {
        return;
    };
    emit(
        &X_RATELIMIT_LIMIT,
        RateLimitValue::Number(binding.limit.into()),
    );
    emit(
        &X_RATELIMIT_REMAINING,
        RateLimitValue::Number(binding.remaining.into()),
    );
    emit(&X_RATELIMIT_RESET, RateLimitValue::Number(binding.reset));
    if policy.ietf_headers {
        let now = decision.decided_at();
        let mut quota_policy = String::new();
        let mut state = String::new();
        for (i, s) in decision.statuses().iter().enumerate() {
            let name = plan.name(i, policy);
            let sep = if i == 0 { "" } else { ", " };
            let w = plan.windows.get(i).copied().unwrap_or(0);
            let _ = write!(quota_policy, "{sep}\"{name}\";q={};w={w}", s.limit);
            // Seconds until more quota: the window's reset (for every budget
            // of a refused request this is <= Retry-After's wait).
            let t = s.reset_after_secs(now);
            let _ = write!(state, "{sep}\"{name}\";r={};t={t}", s.remaining);
        }
        emit(&RATELIMIT_POLICY, RateLimitValue::Text(&quota_policy));
        emit(&RATELIMIT, RateLimitValue::Text(&state));
    }
}

/// Adds the rate-limit headers of `decision` to `headers`.
pub fn rate_limit_headers(
    headers: &mut HeaderMap,
    decision: &Decision,
    plan: &Plan,
    policy: &Policy,
) {
    for_each_rate_limit_header(decision, plan, policy, |name, value| match value {
        RateLimitValue::Number(n) => {
            headers.insert(name.clone(), HeaderValue::from(n));
        }
        RateLimitValue::Text(text) => {
            if let Ok(v) = HeaderValue::from_str(text) {
                headers.insert(name.clone(), v);
            }
        }
    });
}

/// The 429 for a refused decision: the edge form or the JSON envelope,
/// depending on the refusing budget, always with `Retry-After`.
pub fn refusal(decision: &Decision, plan: &Plan, policy: &Policy) -> Response<Full<Bytes>> {
    let wait = refusal_wait(decision);
    let binding = decision.binding_index();
    let mut response = match plan.refusal(binding, policy) {
        Refusal::Edge => {
            let mut r = Response::new(Full::new(Bytes::from_static(EDGE_BODY.as_bytes())));
            r.headers_mut().insert(
                CONTENT_TYPE,
                HeaderValue::from_static("text/html; charset=utf-8"),
            );
            r
        }
        Refusal::Envelope { message } => {
            let at = decision.decided_at().as_secs().saturating_add(wait);
            envelope_response(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limited",
                &message.replace("{retry_after}", &wait.to_string()),
                serde_json::json!({
                    "retry_at": rfc3339(at),
                    "retry_after_seconds": wait,
                }),
            )
        }
    };
    *response.status_mut() = StatusCode::TOO_MANY_REQUESTS;
    response
        .headers_mut()
        .insert(RETRY_AFTER, HeaderValue::from(wait));
    rate_limit_headers(response.headers_mut(), decision, plan, policy);
    response
}

/// The 503 for a decision the store could not make (SPEC D3: the request's classes
/// fail closed), with `Retry-After: 1`.
pub fn limiter_unavailable(error: &impl std::fmt::Display) -> Response<Full<Bytes>> {
    let mut r = envelope_response(
        StatusCode::SERVICE_UNAVAILABLE,
        "limiter_unavailable",
        "The rate limiter's store did not answer; try again shortly.",
        serde_json::json!({ "reason": error.to_string() }),
    );
    r.headers_mut()
        .insert(RETRY_AFTER, HeaderValue::from_static("1"));
    r
}

/// The 400 for a request body that could not be read: the client left, or stopped
/// sending it.
pub fn body_unreadable() -> Response<Full<Bytes>> {
    envelope_response(
        StatusCode::BAD_REQUEST,
        "invalid_request",
        "The request body could not be read.",
        serde_json::json!({}),
    )
}

/// The 413 for a body larger than the policy reads to classify (`max_bytes`).
pub fn payload_too_large(max_bytes: usize) -> Response<Full<Bytes>> {
    envelope_response(
        StatusCode::PAYLOAD_TOO_LARGE,
        "payload_too_large",
        &format!("The request body is larger than {max_bytes} bytes."),
        serde_json::json!({ "max_bytes": max_bytes }),
    )
}

impl Refused {
    /// The answer to a request refused before anything was decided: the JSON
    /// envelope (SPEC H3), with an `error.code` per kind of refusal and `details`
    /// naming the bound or the reason. No `Retry-After`: the same request is refused
    /// again.
    ///
    /// | refusal | status | `error.code` | `details` |
    /// |---|---|---|---|
    /// | batch past `limits.max_batch_items` | 413 | `payload_too_large` | `max_batch_items` |
    /// | JSON past `limits.max_json_depth` | 400 | `invalid_request` | `max_json_depth` |
    /// | an empty batch, not JSON-RPC, not UTF-8 JSON, a byte-order mark | 400 | `invalid_request` | `reason` |
    /// | a `Content-Encoding` but `identity` | 415 | `unsupported_media_type` | `content_encodings` |
    /// | a path with `..` above the root, or a bad `%` | 400 | `invalid_request` | `reason` |
    pub fn response(&self) -> Response<Full<Bytes>> {
        let message = format!("Refused, nothing was counted or forwarded: {self}.");
        let invalid = |reason: &str| {
            (
                StatusCode::BAD_REQUEST,
                "invalid_request",
                serde_json::json!({ "reason": reason }),
            )
        };
        let (status, code, details) = match self {
            Refused::Path(PathError::AboveRoot) => invalid("path_above_root"),
            Refused::Path(PathError::BadPercentEncoding) => invalid("bad_percent_encoding"),
            Refused::Path(_) | Refused::Target => invalid("bad_target"),
            Refused::Body(body) => match body {
                Unclassifiable::TooManyItems { max_batch_items } => (
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "payload_too_large",
                    serde_json::json!({ "max_batch_items": max_batch_items }),
                ),
                Unclassifiable::TooDeep { max_json_depth } => (
                    StatusCode::BAD_REQUEST,
                    "invalid_request",
                    serde_json::json!({ "max_json_depth": max_json_depth }),
                ),
                Unclassifiable::Encoded => (
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    "unsupported_media_type",
                    serde_json::json!({ "content_encodings": ["identity"] }),
                ),
                Unclassifiable::EmptyBatch => invalid("empty_batch"),
                Unclassifiable::ByteOrderMark => invalid("byte_order_mark"),
                Unclassifiable::NotUtf8 => invalid("not_utf8"),
                Unclassifiable::NotJsonRpc => invalid("not_jsonrpc"),
                Unclassifiable::NotJson => invalid("not_json"),
                _ => invalid("unclassifiable"),
            },
        };
        let mut r = envelope_response(status, code, &message, details);
        if status == StatusCode::UNSUPPORTED_MEDIA_TYPE {
            // The codings the server accepts (RFC 7694 §3).
            r.headers_mut()
                .insert(ACCEPT_ENCODING, HeaderValue::from_static("identity"));
        }
        r
    }
}

/// A response with the JSON envelope `{"error":{"code","message","details"}}` (SPEC H3).
pub fn envelope_response(
    status: StatusCode,
    code: &str,
    message: &str,
    details: serde_json::Value,
) -> Response<Full<Bytes>> {
    let body = serde_json::json!({
        "error": { "code": code, "message": message, "details": details }
    });
    let mut r = Response::new(Full::new(Bytes::from(body.to_string())));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

/// Unix seconds as RFC 3339 UTC (`2026-08-10T14:22:31Z`).
pub fn rfc3339(unix_secs: u64) -> String {
    i64::try_from(unix_secs)
        .ok()
        .and_then(|s| jiff::Timestamp::from_second(s).ok())
        .map_or_else(|| "9999-12-31T23:59:59Z".to_owned(), |t| t.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_rounds_up_and_is_at_least_one_second() {
        assert_eq!(retry_after_secs(Duration::from_millis(1)), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(36_500)), 37);
        assert_eq!(retry_after_secs(Duration::from_secs(37)), 37);
        assert_eq!(retry_after_secs(Duration::ZERO), 1);
    }

    #[test]
    fn rfc3339_is_utc_with_seconds() {
        assert_eq!(rfc3339(1_786_371_751), "2026-08-10T14:22:31Z");
    }
}
