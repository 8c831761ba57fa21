//! What the client is told: `X-RateLimit-*` on every response,
//! the IETF draft fields when enabled, and the refusals. Every HTTP answer
//! sluice makes itself is built here.

use std::fmt::Write as _;
use std::time::Duration;

use bytes::Bytes;
use http::header::{
    ACCEPT_ENCODING, ALLOW, CONTENT_TYPE, COOKIE, HeaderName, HeaderValue, RETRY_AFTER,
};
use http::{HeaderMap, Response, StatusCode};
use http_body_util::Full;
use sluice_core::Decision;
use sluice_policy::{PathError, Policy, Refusal, Unclassifiable};

use crate::head::Refused;
use crate::plan::{BudgetKind, Plan};

/// `X-Sluice-Workspace`: the caller's workspace, sent to the upstream.
pub const X_SLUICE_WORKSPACE: HeaderName = HeaderName::from_static("x-sluice-workspace");
/// `X-Sluice-User`: the caller's user, sent to the upstream.
pub const X_SLUICE_USER: HeaderName = HeaderName::from_static("x-sluice-user");
/// `X-Sluice-Cost`: what a call spent of its weighted budget, from the upstream.
pub const X_SLUICE_COST: HeaderName = HeaderName::from_static("x-sluice-cost");
/// `X-Sluice-Exhausted`: a weighted budget passed on exhausted, to the upstream.
pub const X_SLUICE_EXHAUSTED: HeaderName = HeaderName::from_static("x-sluice-exhausted");

/// True for the headers that carry signals between sluice and its upstream
/// (`X-Sluice-*`): a client's are removed before forwarding, an upstream's
/// `X-Sluice-Cost` before answering.
pub fn is_sluice_signal(name: &[u8]) -> bool {
    name.len() >= 9 && name[..9].eq_ignore_ascii_case(b"x-sluice-")
}

/// Calls `emit` with each header sluice adds to a forwarded request:
/// `X-Sluice-Workspace`, `X-Sluice-User`, `X-Sluice-Exhausted` for a
/// weighted budget passed on exhausted, and `Accept-Encoding: identity` for an
/// LLM call (in place of the client's: its answer is read for its usage). A server that writes its heads itself
/// writes these; [`upstream_headers`] puts them in a header map.
pub fn for_each_upstream_header(
    plan: &Plan,
    policy: &Policy,
    mut emit: impl FnMut(&HeaderName, &[u8]),
) {
    let own;
    let (workspace, user) = match &plan.from.principal {
        Some(p) => (p.workspace.as_bytes(), p.user.as_bytes()),
        None => {
            own = plan.from.own_label();
            (own.as_bytes(), own.as_bytes())
        }
    };
    emit(&X_SLUICE_WORKSPACE, workspace);
    emit(&X_SLUICE_USER, user);
    if plan.llm.is_some() {
        // An LLM call's answer is read for its `usage` as it passes (SPEC T3):
        // a compressed one could not be, and would be charged its reservation
        // (no upper bound on what a call without `max_tokens` spends).
        emit(&ACCEPT_ENCODING, b"identity");
    }
    if let Some(passed) = plan.passed {
        let value = format!(
            "{}; retry-after={}",
            plan.name(passed.index, policy),
            passed.retry_after
        );
        emit(&X_SLUICE_EXHAUSTED, value.as_bytes());
    }
}

/// The start of every admin login cookie's name (`sluice_admin_<port>`, see
/// `sluice_door::Door::cookie_name`). A browser sends a host's cookies to all of
/// its ports, so the cookie set by the admin listener comes along on requests
/// to the gateway: it is a credential of sluice's own and never goes upstream.
pub const ADMIN_COOKIE_PREFIX: &[u8] = b"sluice_admin_";

/// True when a `Cookie` field's value may hold an admin login cookie.
pub fn carries_admin_cookie(value: &[u8]) -> bool {
    value
        .windows(ADMIN_COOKIE_PREFIX.len())
        .any(|w| w == ADMIN_COOKIE_PREFIX)
}

/// Removes the admin login cookies from the `Cookie` fields of `headers` (the
/// field too when nothing else is left in it).
fn strip_admin_cookies(headers: &mut HeaderMap) {
    if headers
        .get_all(COOKIE)
        .iter()
        .any(|v| carries_admin_cookie(v.as_bytes()))
    {
        sluice_policy::retain_cookies(headers, |pair| !pair.starts_with(ADMIN_COOKIE_PREFIX));
    }
}

/// Replaces the client's `X-Sluice-*` headers with sluice's own (see
/// [`for_each_upstream_header`]), and removes the credentials that were not counted
/// (see [`sluice_policy::Identity::strip_uncounted`]) and the admin login cookies
/// ([`ADMIN_COOKIE_PREFIX`]).
pub fn upstream_headers(headers: &mut HeaderMap, plan: &Plan, policy: &Policy) {
    unname_own_fields(headers);
    if headers.keys().any(|n| n.as_str().contains('_')) {
        let read = policy.identity.read_headers();
        let spelled: Vec<HeaderName> = headers
            .keys()
            .filter(|n| is_underscore_spelling(n.as_str().as_bytes(), &read))
            .cloned()
            .collect();
        for name in spelled {
            headers.remove(name);
        }
    }
    policy.identity.strip_uncounted(headers);
    strip_admin_cookies(headers);
    let signals: Vec<HeaderName> = headers
        .keys()
        .filter(|n| is_sluice_signal(n.as_str().as_bytes()))
        .cloned()
        .collect();
    for name in signals {
        headers.remove(name);
    }
    for_each_upstream_header(plan, policy, |name, value| {
        if let Ok(v) = HeaderValue::from_bytes(value) {
            headers.insert(name.clone(), v);
        }
    });
}

/// The fields sluice sets on a forwarded request (besides `X-Sluice-*`): a
/// client's `Connection` never names them.
const OWN_FIELDS: [&str; 7] = [
    "x-request-id",
    "traceparent",
    "tracestate",
    "accept-encoding",
    "forwarded",
    "x-forwarded-for",
    "host",
];

/// Takes out of the client's `Connection` fields every name of a field sluice
/// sets on the forwarded request (`X-Sluice-*`, its request id, trace and forwarding fields): a proxy removes
/// the fields `Connection` names (RFC 9110 §7.6.1), and would remove sluice's
/// own with the client's — the caller's identity, a weighted budget passed on
/// exhausted. A `Connection` left naming nothing is removed.
pub fn unname_own_fields(headers: &mut HeaderMap) {
    let own = |token: &[u8]| {
        is_sluice_signal(token)
            || OWN_FIELDS
                .iter()
                .any(|f| f.as_bytes().eq_ignore_ascii_case(token))
    };
    let tokens = |value: &HeaderValue| -> Vec<Vec<u8>> {
        value
            .as_bytes()
            .split(|&b| b == b',')
            .map(|t| t.trim_ascii().to_vec())
            .filter(|t| !t.is_empty())
            .collect()
    };
    let values: Vec<HeaderValue> = headers
        .get_all(http::header::CONNECTION)
        .iter()
        .cloned()
        .collect();
    if values.iter().all(|v| tokens(v).iter().all(|t| !own(t))) {
        return;
    }
    headers.remove(http::header::CONNECTION);
    for value in values {
        let kept: Vec<Vec<u8>> = tokens(&value).into_iter().filter(|t| !own(t)).collect();
        if let Ok(v) = HeaderValue::from_bytes(&kept.join(&b", "[..]))
            && !kept.is_empty()
        {
            headers.append(http::header::CONNECTION, v);
        }
    }
}

/// Fields whose meaning sluice or its upstream's proxies act on, besides the
/// ones the policy reads and `X-Sluice-*`: an underscore spelling of one is
/// never forwarded.
const GUARDED_FIELDS: [&str; 17] = [
    "x-request-id",
    "traceparent",
    "tracestate",
    "forwarded",
    "x-forwarded-for",
    "x-forwarded-host",
    "x-forwarded-proto",
    "x-real-ip",
    "host",
    "content-length",
    "transfer-encoding",
    "x-http-method-override",
    "x-method-override",
    "x-http-method",
    "authorization",
    "x-api-key",
    "cookie",
];

/// True when `name` spells with `_` a field sluice reads (`read`: the policy's
/// credentials, principal and run fields) or sets or guards (`X-Sluice-*`,
/// forwarding, framing and override fields): `X_API_KEY`, `X_Sluice_Workspace`. Servers that map
/// field names CGI-style (`HTTP_X_API_KEY`) read it as the field sluice did not
/// see, so it is never forwarded.
pub fn is_underscore_spelling(name: &[u8], read: &[HeaderName]) -> bool {
    if !name.contains(&b'_') {
        return false;
    }
    let folded: Vec<u8> = name
        .iter()
        .map(|&b| {
            if b == b'_' {
                b'-'
            } else {
                b.to_ascii_lowercase()
            }
        })
        .collect();
    is_sluice_signal(&folded)
        || GUARDED_FIELDS
            .iter()
            .any(|f| f.as_bytes() == folded.as_slice())
        || read
            .iter()
            .any(|r| r.as_str().as_bytes() == folded.as_slice())
}

/// Reads and removes the upstream's `X-Sluice-Cost`: `Some(cost)` to charge,
/// `None` when absent (the unit spent at admission stands). Sent more than once,
/// the largest cost counts: an answer never settles below what it said it spent.
/// A value that is not a number is charged as one unit, as absent.
pub fn take_cost(headers: &mut HeaderMap) -> Option<u32> {
    match headers.entry(X_SLUICE_COST) {
        http::header::Entry::Occupied(fields) => fields
            .remove_entry_mult()
            .1
            .fold(None, |cost, value| cost.max(parse_cost(value.as_bytes()))),
        http::header::Entry::Vacant(_) => None,
    }
}

/// An `X-Sluice-Cost` value: a decimal count of units (saturating), a fraction
/// rounded up (`2.5` is 3), or `None`.
pub fn parse_cost(value: &[u8]) -> Option<u32> {
    let value = value.trim_ascii();
    let (whole, fraction) = match memchr::memchr(b'.', value) {
        Some(dot) => (&value[..dot], &value[dot + 1..]),
        None => (value, &[][..]),
    };
    let digits = |d: &[u8]| d.iter().all(u8::is_ascii_digit);
    if whole.is_empty()
        || !digits(whole)
        || !digits(fraction)
        || (value.len() > whole.len() && fraction.is_empty())
    {
        return None;
    }
    let units = whole.iter().fold(0u32, |n, &d| {
        n.saturating_mul(10).saturating_add(u32::from(d - b'0'))
    });
    Some(units.saturating_add(u32::from(fraction.iter().any(|&d| d != b'0'))))
}

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

/// `details.reason` of a refusal whose cost exceeds a budget's whole limit: it can
/// never be admitted, so it comes without `Retry-After`.
pub const COST_EXCEEDS_LIMIT: &str = "cost_exceeds_limit";

/// The edge limiter's 429 body.
pub const EDGE_BODY: &str = "Too many requests, please try again later.";

pub use crate::plan::retry_after_secs;

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
    let Some(binding) = decision.statuses().get(plan.shown_index(decision, policy)) else {
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
        let mut quota_policy = String::new();
        let mut state = String::new();
        for (i, s) in decision.statuses().iter().enumerate() {
            let name = plan.name(i, policy);
            let sep = if i == 0 { "" } else { ", " };
            let w = plan.window_secs(i, decision);
            let _ = write!(quota_policy, "{sep}\"{name}\";q={};w={w}", s.limit);
            // Seconds until more quota: a fixed window's reset; for a budget
            // that refills little by little and refused the request, its own
            // wait (so Retry-After, the longest wait, is never less).
            let t = plan.seconds_until_more(i, decision);
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

/// The 429 for a refused decision: the edge form, the JSON envelope, or for
/// a monthly quota `quota_exceeded` — depending on the refusing budget, with
/// `Retry-After`.
pub fn refusal(decision: &Decision, plan: &Plan, policy: &Policy) -> Response<Full<Bytes>> {
    let wait = refusal_wait(decision);
    let binding = decision.binding_index();
    if let Some(BudgetKind::Quota(q)) = plan.kinds.get(binding)
        && let (Some(family), Some(status)) = (
            policy.quotas.get(crate::plan::policy_index(*q)),
            decision.statuses().get(binding),
        )
    {
        let usage = status.limit - status.remaining;
        let resets_at = rfc3339(status.reset);
        let mut details = serde_json::json!({
            "family": family.name,
            "limit": status.limit,
            "usage": usage,
            "resets_at": resets_at,
        });
        if decision.is_never() {
            details["reason"] = COST_EXCEEDS_LIMIT.into();
        }
        let mut response = envelope_response(
            StatusCode::TOO_MANY_REQUESTS,
            "quota_exceeded",
            &format!(
                "Monthly {} quota exceeded: {usage} of {} used. It resets at {resets_at}.",
                family.name, status.limit
            ),
            details,
        );
        // A request larger than the whole monthly cap never fits: no Retry-After.
        if !decision.is_never() {
            response.headers_mut().insert(
                RETRY_AFTER,
                HeaderValue::from(status.reset_after_secs(decision.decided_at()).max(1)),
            );
        }
        rate_limit_headers(response.headers_mut(), decision, plan, policy);
        response.extensions_mut().insert(crate::QuotaRefusal);
        return response;
    }
    let mut response = match plan.refusal(binding, policy) {
        Refusal::Edge => {
            let mut r = Response::new(Full::new(Bytes::from_static(EDGE_BODY.as_bytes())));
            r.headers_mut().insert(
                CONTENT_TYPE,
                HeaderValue::from_static("text/html; charset=utf-8"),
            );
            r
        }
        Refusal::Envelope { .. } if decision.is_never() => {
            let limit = decision.statuses().get(binding).map_or(0, |s| s.limit);
            envelope_response(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limited",
                &format!(
                    "The request costs more than the whole limit of {limit}: it can never be admitted. Send less at once."
                ),
                serde_json::json!({
                    "reason": COST_EXCEEDS_LIMIT,
                    "limit": limit,
                    "window_seconds": plan.window_secs(binding, decision),
                }),
            )
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
                    "limit": decision.statuses().get(binding).map_or(0, |s| s.limit),
                    "window_seconds": plan.window_secs(binding, decision),
                }),
            )
        }
    };
    *response.status_mut() = StatusCode::TOO_MANY_REQUESTS;
    // A request that can never fit is told so by the absence of `Retry-After`: a
    // client that honours it would retry in vain.
    if !decision.is_never() {
        response
            .headers_mut()
            .insert(RETRY_AFTER, HeaderValue::from(wait));
    }
    rate_limit_headers(response.headers_mut(), decision, plan, policy);
    response
}

/// The 503 for a decision the store could not make (the request's classes
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

/// The 408 for a request body taken in whole that did not arrive within
/// `deadline` (the limiter's [body deadline](crate::Limiter::body_deadline)),
/// however steadily it came.
pub fn body_too_slow(deadline: std::time::Duration) -> Response<Full<Bytes>> {
    let secs = deadline.as_secs_f64();
    envelope_response(
        StatusCode::REQUEST_TIMEOUT,
        "request_timeout",
        &format!("The request body did not arrive within {secs} s."),
        serde_json::json!({ "deadline_seconds": secs }),
    )
}

/// The 503 for a request whose body would pass the bound on the request bytes the
/// gateway holds at once, with `Retry-After: 1`.
pub fn buffers_full(max_bytes: usize) -> Response<Full<Bytes>> {
    let mut r = envelope_response(
        StatusCode::SERVICE_UNAVAILABLE,
        "busy",
        "The gateway holds as many request bytes as it may; try again shortly.",
        serde_json::json!({ "max_buffered_bytes": max_bytes }),
    );
    r.headers_mut()
        .insert(RETRY_AFTER, HeaderValue::from_static("1"));
    r
}

/// The 503 for a request whose body would pass the bound on buffered bytes
/// ([`crate::BufferFull::Bound`]: as [`buffers_full`]) or its client's share of it
/// ([`crate::BufferFull::Share`]: the same answer, `details` naming the share and
/// `reason: "client_share"`), with `Retry-After: 1`.
pub fn buffers_refusal(
    full: crate::BufferFull,
    budget: &crate::BufferBudget,
) -> Response<Full<Bytes>> {
    if full == crate::BufferFull::Bound {
        return buffers_full(budget.max());
    }
    let mut r = envelope_response(
        StatusCode::SERVICE_UNAVAILABLE,
        "busy",
        "The gateway holds as many request bytes of this client as it may; try again shortly.",
        serde_json::json!({
            "reason": "client_share",
            "max_buffered_bytes": budget.max(),
            "max_client_buffered_bytes": budget.share(),
        }),
    );
    r.headers_mut()
        .insert(RETRY_AFTER, HeaderValue::from_static("1"));
    r
}

/// The 504 for a call through a guarded lane that took longer than the lane's
/// `timeout` (it was cut, and counts as a failure for the lane's breaker).
pub fn upstream_timed_out(timeout: Duration) -> Response<Full<Bytes>> {
    envelope_response(
        StatusCode::GATEWAY_TIMEOUT,
        "upstream_timeout",
        &format!(
            "The upstream did not answer within {} s.",
            timeout.as_secs_f64()
        ),
        serde_json::json!({ "timeout_seconds": timeout.as_secs_f64() }),
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

/// The 431 for a request head past `max_bytes` (as
/// [`request_head_len`](crate::request_head_len) counts it).
pub fn request_head_too_large(max_bytes: usize) -> Response<Full<Bytes>> {
    envelope_response(
        StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
        "request_header_fields_too_large",
        &format!("The request head is larger than {max_bytes} bytes."),
        serde_json::json!({ "max_bytes": max_bytes }),
    )
}

impl Refused {
    /// The answer to a request refused before anything was decided: the JSON
    /// envelope, with an `error.code` per kind of refusal and `details`
    /// naming the bound or the reason. No `Retry-After`: the same request is refused
    /// again.
    ///
    /// | refusal | status | `error.code` | `details` |
    /// |---|---|---|---|
    /// | batch past `limits.max_batch_items` | 413 | `payload_too_large` | `max_batch_items` |
    /// | JSON past `limits.max_json_depth` | 400 | `invalid_request` | `max_json_depth` |
    /// | an empty batch, not JSON-RPC, not UTF-8 JSON, a byte-order mark | 400 | `invalid_request` | `reason` |
    /// | a `Content-Encoding` but `identity` | 415 | `unsupported_media_type` | `content_encodings` |
    /// | a path with `..` above the root, a bad `%`, a `\\`, `;` parameters or an encoded slash (`%2F`, `%5C`) that change the route | 400 | `invalid_request` | `reason` (`path_parameters`, `encoded_slash`, …) |
    /// | a method that differs from a known one only by case (`post`), or a method-override field that changes the route or cannot be read | 400 | `invalid_request` | `reason: "method_case"` or `"method_override"` |
    /// | a method that differs from a known one only by case (`post`), a method-override field that changes the route or cannot be read | 400 | `invalid_request` | `reason: "method_case"`, `"method_override"` |
    /// | one kind of credential sent more than once, or two kinds without `identity.counted_credential` | 400 | `invalid_request` | `reason: "ambiguous_credentials"`, `field`, `fields`, `count` |
    /// | a credential field sluice cannot read (a Bearer without one token, not visible ASCII) | 400 | `invalid_request` | `reason: "malformed_credential"`, `field`, `fields`, `count: 1` |
    /// | a credential revoked through the admin API | 403 | `forbidden` | `reason: "credential_revoked"` |
    /// | a plan header (from a trusted auth layer) naming no plan of the policy | 400 | `invalid_request` | `reason: "unknown_plan"` |
    /// | an HTTP/1.1 request without `Host`, several `Host` fields, a bad `Host` | 400 | `invalid_request` | `reason` |
    /// | `CONNECT` | 405 | `method_not_allowed` | `method` (and an `Allow` field) |
    /// | a `Transfer-Encoding` but `chunked` alone (`gzip, chunked`) | 501 | `not_implemented` | `reason: "transfer_coding"`, `transfer_codings: ["chunked"]` |
    /// | more calls through a guarded lane in one request than a workspace runs at once | 400 | `invalid_request` | `reason: "too_many_lane_calls"`, `calls`, `max` |
    /// | a run id that is empty, too long or not of `[A-Za-z0-9-._~:@+=,]`, a depth that is no tier, a run header on a route whose calls are no turns, a run or depth header sent twice | 400 | `invalid_request` | `reason: "bad_run_id"`, `"unknown_depth"`, `"run_not_supported"`, `"several_run_headers"` |
    /// | an LLM route's body that is not JSON, not an object, a `model` not a string, a bad `max_tokens`, no input | 400 | `invalid_request` | `reason: "not_json"`, `"not_an_object"`, `"model_not_a_string"`, `"bad_max_tokens"`, `"no_input"`, `"duplicate_key"` |
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
            Refused::Path(PathError::Backslash) => invalid("backslash_in_path"),
            Refused::Path(PathError::ParametersChangeRoute) => invalid("path_parameters"),
            Refused::Path(PathError::EncodedSlashChangesRoute) => invalid("encoded_slash"),
            Refused::Path(PathError::MethodCase) => invalid("method_case"),
            Refused::Path(PathError::MethodOverride) => invalid("method_override"),
            Refused::Path(_) | Refused::Target => invalid("bad_target"),
            Refused::Credentials(ambiguous) => (
                StatusCode::BAD_REQUEST,
                "invalid_request",
                serde_json::json!({
                    "reason": if ambiguous.is_malformed() { "malformed_credential" } else { "ambiguous_credentials" },
                    "field": ambiguous.field(),
                    "fields": ambiguous.fields(),
                    "count": ambiguous.count,
                }),
            ),
            Refused::Revoked => (
                StatusCode::FORBIDDEN,
                "forbidden",
                serde_json::json!({ "reason": "credential_revoked" }),
            ),
            Refused::UnknownPlan => invalid("unknown_plan"),
            Refused::NoHost => invalid("missing_host"),
            Refused::Hosts(count) => (
                StatusCode::BAD_REQUEST,
                "invalid_request",
                serde_json::json!({ "reason": "several_hosts", "count": count }),
            ),
            Refused::BadHost => invalid("bad_host"),
            Refused::LaneCalls { calls, max } => (
                StatusCode::BAD_REQUEST,
                "invalid_request",
                serde_json::json!({ "reason": "too_many_lane_calls", "calls": calls, "max": max }),
            ),
            Refused::Batch(bad) => (
                StatusCode::BAD_REQUEST,
                "invalid_request",
                serde_json::json!({ "reason": bad.reason }),
            ),
            Refused::LlmBody(bad) => invalid(bad.reason()),
            Refused::UnpricedModel => invalid("unpriced_model"),
            Refused::Run(bad) => invalid(bad.reason()),
            Refused::TransferCoding => (
                StatusCode::NOT_IMPLEMENTED,
                "not_implemented",
                serde_json::json!({ "reason": "transfer_coding", "transfer_codings": ["chunked"] }),
            ),
            Refused::Connect => (
                StatusCode::METHOD_NOT_ALLOWED,
                "method_not_allowed",
                serde_json::json!({ "method": "CONNECT" }),
            ),
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
                Unclassifiable::DuplicateKey => invalid("duplicate_key"),
                _ => invalid("unclassifiable"),
            },
        };
        let mut r = envelope_response(status, code, &message, details);
        if status == StatusCode::METHOD_NOT_ALLOWED {
            // What the gateway forwards (RFC 9110 §15.5.6 asks for the field); the
            // upstream may still refuse some of them.
            r.headers_mut().insert(
                ALLOW,
                HeaderValue::from_static("GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS"),
            );
        }
        if status == StatusCode::UNSUPPORTED_MEDIA_TYPE {
            // The codings the server accepts (RFC 7694 §3).
            r.headers_mut()
                .insert(ACCEPT_ENCODING, HeaderValue::from_static("identity"));
        }
        r
    }
}

/// The JSON-RPC error code of a body refused before it is classified (JSON-RPC 2.0's
/// parse error): not JSON, not UTF-8, a byte-order mark, compressed, past a size or
/// depth bound (SPEC E5).
pub const JSONRPC_PARSE_ERROR: i64 = -32700;

impl Refused {
    /// The answer to a request refused before anything was decided, on a route that
    /// answers as JSON-RPC (its class comes from a JSON-RPC body): for a body the
    /// classifier cannot read ([`Refused::Body`]), the status and fields of
    /// [`Refused::response`] with a JSON-RPC error in place of the envelope,
    /// `{"jsonrpc":"2.0","id":null,"error":{"code":-32700,"message","data":{"reason",…}}}`
    /// (`data` also names the bound passed); any other refusal as
    /// [`Refused::response`].
    ///
    /// | body | status | `data` |
    /// |---|---|---|
    /// | not JSON | 400 | `reason: "not_json"` |
    /// | not UTF-8 (UTF-16, UTF-32) | 400 | `reason: "not_utf8"` |
    /// | a byte-order mark | 400 | `reason: "byte_order_mark"` |
    /// | JSON that is not a request object or a batch | 400 | `reason: "not_jsonrpc"` |
    /// | an empty batch | 400 | `reason: "empty_batch"` |
    /// | past `limits.max_json_depth` | 400 | `reason: "too_deep"`, `max_json_depth` |
    /// | past `limits.max_batch_items` | 413 | `reason: "too_many_items"`, `max_batch_items` |
    /// | a `Content-Encoding` but `identity` | 415 | `reason: "content_encoding"`, `content_encodings` |
    pub fn jsonrpc_response(&self) -> Response<Full<Bytes>> {
        let Refused::Body(body) = self else {
            return self.response();
        };
        let data = match body {
            Unclassifiable::TooManyItems { max_batch_items } => serde_json::json!({
                "reason": "too_many_items", "max_batch_items": max_batch_items,
            }),
            Unclassifiable::TooDeep { max_json_depth } => serde_json::json!({
                "reason": "too_deep", "max_json_depth": max_json_depth,
            }),
            Unclassifiable::Encoded => serde_json::json!({
                "reason": "content_encoding", "content_encodings": ["identity"],
            }),
            Unclassifiable::EmptyBatch => serde_json::json!({ "reason": "empty_batch" }),
            Unclassifiable::ByteOrderMark => serde_json::json!({ "reason": "byte_order_mark" }),
            Unclassifiable::NotUtf8 => serde_json::json!({ "reason": "not_utf8" }),
            Unclassifiable::NotJsonRpc => serde_json::json!({ "reason": "not_jsonrpc" }),
            Unclassifiable::NotJson => serde_json::json!({ "reason": "not_json" }),
            Unclassifiable::DuplicateKey => serde_json::json!({ "reason": "duplicate_key" }),
            _ => serde_json::json!({ "reason": "unclassifiable" }),
        };
        let message = format!("Parse error: {self}; nothing was counted or forwarded.");
        jsonrpc_error_answer(self.response(), &message, data)
    }
}

/// The 413 for a JSON-RPC body larger than the policy reads to classify
/// (`max_bytes`), on a route that answers as JSON-RPC: the status and fields of
/// [`payload_too_large`], with `{"jsonrpc":"2.0","id":null,"error":{"code":-32700,
/// "message","data":{"reason":"payload_too_large","max_bytes"}}}`.
pub fn jsonrpc_payload_too_large(max_bytes: usize) -> Response<Full<Bytes>> {
    jsonrpc_error_answer(
        payload_too_large(max_bytes),
        &format!("Parse error: the request body is larger than {max_bytes} bytes."),
        serde_json::json!({ "reason": "payload_too_large", "max_bytes": max_bytes }),
    )
}

/// The JSON-RPC error code of a call whose parameters cannot be taken.
pub const JSONRPC_INVALID_PARAMS: i64 = -32602;

/// `answer` (a 400 of a batch tool call whose arguments cannot be queued:
/// `bad`), status and fields kept, with the call's JSON-RPC error for its body:
/// `{"jsonrpc":"2.0","id":<the call's>,"error":{"code":-32602,"message",
/// "data":{"reason"}}}`, as the lane answers the call's other refusals.
pub fn jsonrpc_invalid_params(
    answer: Response<Full<Bytes>>,
    body: &[u8],
    bad: &crate::BadBatch,
) -> Response<Full<Bytes>> {
    let id = serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|call| call.get("id").cloned())
        .unwrap_or(serde_json::Value::Null);
    let message = format!("Invalid params: {bad}; nothing was counted or queued.");
    let data = serde_json::json!({ "reason": bad.reason });
    with_jsonrpc_error(answer, id, JSONRPC_INVALID_PARAMS, &message, data)
}

/// `answer` (status and fields kept) with a JSON-RPC parse error for its body.
fn jsonrpc_error_answer(
    answer: Response<Full<Bytes>>,
    message: &str,
    data: serde_json::Value,
) -> Response<Full<Bytes>> {
    let id = serde_json::Value::Null;
    with_jsonrpc_error(answer, id, JSONRPC_PARSE_ERROR, message, data)
}

/// `answer` (status and fields kept) with `{"jsonrpc":"2.0","id","error":{"code",
/// "message","data"}}` for its body.
fn with_jsonrpc_error(
    answer: Response<Full<Bytes>>,
    id: serde_json::Value,
    code: i64,
    message: &str,
    data: serde_json::Value,
) -> Response<Full<Bytes>> {
    let body = serde_json::json!({
        "jsonrpc": "2.0",
        "id": id,
        "error": { "code": code, "message": message, "data": data },
    });
    let (mut parts, _) = answer.into_parts();
    parts
        .headers
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    parts.headers.remove(http::header::CONTENT_LENGTH);
    Response::from_parts(parts, Full::new(Bytes::from(body.to_string())))
}

/// A response with the JSON envelope `{"error":{"code","message","details"}}`.
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

/// The JSON-RPC error code of a refusal answered as JSON-RPC.
pub const JSONRPC_RATE_LIMITED: i64 = -32029;

/// A 429 `refusal` of the JSON-RPC request `body`, answered as JSON-RPC (policy
/// option `jsonrpc.refusal: jsonrpc_error`): HTTP 429, `application/json`, the
/// refusal's `Retry-After` and `X-RateLimit-*` kept, and for each request id of
/// `body` (an array for a batch) `{"jsonrpc":"2.0","id","error":{"code":-32029,
/// "message","data":{"reason","retry_after_seconds","limit","class"}}}`.
/// `data.reason` is the envelope's `details.reason` when it has one (a lane's
/// reason, `cost_exceeds_limit`, `batch_backlog_limit`), else its `error.code`
/// (`quota_exceeded`, `rate_limited`); `retry_after_seconds` is `null` for a request
/// that can never be admitted. Any other answer is returned as it is.
pub fn jsonrpc_refusal(
    refusal: Response<Full<Bytes>>,
    body: &[u8],
    class: &str,
) -> Response<Full<Bytes>> {
    if refusal.status() != StatusCode::TOO_MANY_REQUESTS {
        return refusal;
    }
    let (mut parts, answer) = refusal.into_parts();
    let answer = futures_body(answer);
    let envelope: serde_json::Value = serde_json::from_slice(&answer).unwrap_or_default();
    let details = &envelope["error"]["details"];
    let retry: Option<u64> = parts
        .headers
        .get(RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok());
    // A 429 without Retry-After is one no wait would admit.
    let reason = details["reason"]
        .as_str()
        .or_else(|| retry.is_none().then_some(COST_EXCEEDS_LIMIT))
        .or_else(|| envelope["error"]["code"].as_str())
        .unwrap_or("rate_limited");
    let limit = parts
        .headers
        .get(X_RATELIMIT_LIMIT)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .map(serde_json::Value::from)
        .unwrap_or_else(|| details["limit"].clone());
    let message = match retry {
        Some(n) => format!("Rate limited: retry in {n} s"),
        None => "Rate limited: this request can never be admitted as it is".to_owned(),
    };
    let error = |id: serde_json::Value| {
        serde_json::json!({
            "jsonrpc": "2.0",
            "id": id,
            "error": {
                "code": JSONRPC_RATE_LIMITED,
                "message": message,
                "data": {
                    "reason": reason,
                    "retry_after_seconds": retry,
                    "limit": limit,
                    "class": class,
                },
            },
        })
    };
    let request: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
    let reply = match &request {
        serde_json::Value::Array(items) => {
            let errors: Vec<serde_json::Value> = items
                .iter()
                .filter_map(|m| m.get("id").cloned())
                .map(error)
                .collect();
            if errors.is_empty() {
                error(serde_json::Value::Null)
            } else {
                serde_json::Value::Array(errors)
            }
        }
        message => error(message.get("id").cloned().unwrap_or_default()),
    };
    parts
        .headers
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    parts.headers.remove(http::header::CONTENT_LENGTH);
    Response::from_parts(parts, Full::new(Bytes::from(reply.to_string())))
}

/// The bytes of a `Full` body (it is whole already: polling it once yields them).
fn futures_body(body: Full<Bytes>) -> Bytes {
    use http_body::Body as _;
    let mut body = std::pin::pin!(body);
    let waker = std::task::Waker::noop();
    let mut cx = std::task::Context::from_waker(waker);
    match body.as_mut().poll_frame(&mut cx) {
        std::task::Poll::Ready(Some(Ok(frame))) => frame.into_data().unwrap_or_default(),
        _ => Bytes::new(),
    }
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

    /// SPEC Q2: what the upstream says a call spent is never read as less.
    #[test]
    fn q2_a_cost_is_read_whole_rounded_up_and_its_largest_spelling_counts() {
        for (value, cost) in [
            ("3", Some(3)),
            (" 0 ", Some(0)),
            ("2.5", Some(3)),
            ("2.0", Some(2)),
            ("0.01", Some(1)),
            ("99999999999", Some(u32::MAX)),
            ("4294967295.5", Some(u32::MAX)),
            ("", None),
            ("2.", None),
            (".5", None),
            ("+4", None),
            ("-1", None),
            ("1e3", None),
            ("1.2.3", None),
        ] {
            assert_eq!(parse_cost(value.as_bytes()), cost, "{value:?}");
        }
        let mut headers = HeaderMap::new();
        for value in ["2", "junk", "5", "1"] {
            headers.append(X_SLUICE_COST, HeaderValue::from_static(value));
        }
        assert_eq!(take_cost(&mut headers), Some(5));
        assert!(headers.is_empty(), "every field taken out");
        assert_eq!(take_cost(&mut headers), None);
    }

    #[test]
    fn rfc3339_is_utc_with_seconds() {
        assert_eq!(rfc3339(1_786_371_751), "2026-08-10T14:22:31Z");
    }
}
