//! What the client of an LLM route is told, in its API's own dialect (SPEC T5),
//! so the official SDKs and `sluice pace` read it: OpenAI's
//! `x-ratelimit-*-tokens` fields (resets as durations, `6m0s`) and its
//! `rate_limit_exceeded` error; Anthropic's `anthropic-ratelimit-tokens-*`
//! fields (resets in RFC 3339) and its `rate_limit_error`.

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode};
use http_body_util::Full;
use sluice_core::Decision;
use sluice_policy::{LlmFormat, Policy};

use crate::plan::{BudgetKind, Plan, policy_index};

/// The token or money budget at `i` of `plan`, if it is one.
fn budget_of(plan: &Plan, policy: &Policy, i: usize) -> Option<sluice_policy::TokenBudget> {
    match plan.kinds.get(i) {
        Some(BudgetKind::Bucket(b)) => policy.buckets.get(policy_index(*b))?.tokens,
        _ => None,
    }
}

/// The index in `plan` of the token budget a client is told of: the one with
/// the fewest units left (the refusing one, when a token budget refused).
/// Money budgets are not token budgets: they are told of by their refusal.
fn binding_tokens(decision: &Decision, plan: &Plan, policy: &Policy) -> Option<usize> {
    let is_tokens = |i: usize| budget_of(plan, policy, i).is_some_and(|t| !t.priced);
    if !decision.is_admitted() && is_tokens(decision.binding_index()) {
        return Some(decision.binding_index());
    }
    let statuses = decision.statuses();
    (0..statuses.len())
        .filter(|&i| is_tokens(i))
        .min_by_key(|&i| statuses[i].remaining)
}

/// OpenAI's duration form of `secs`: `45s`, `6m0s`, `1h2m3s`.
pub fn openai_duration(secs: u64) -> String {
    let (h, m, s) = (secs / 3600, secs % 3600 / 60, secs % 60);
    match (h, m) {
        (0, 0) => format!("{s}s"),
        (0, _) => format!("{m}m{s}s"),
        _ => format!("{h}h{m}m{s}s"),
    }
}

/// The names of the token fields of an LLM route's `format`, in the order
/// [`for_each_token_header`] gives them: a transport that writes heads itself
/// drops the upstream's fields of these names.
pub fn token_header_names(format: LlmFormat) -> &'static [HeaderName; 3] {
    static OPENAI: [HeaderName; 3] = [
        HeaderName::from_static("x-ratelimit-limit-tokens"),
        HeaderName::from_static("x-ratelimit-remaining-tokens"),
        HeaderName::from_static("x-ratelimit-reset-tokens"),
    ];
    static ANTHROPIC: [HeaderName; 3] = [
        HeaderName::from_static("anthropic-ratelimit-tokens-limit"),
        HeaderName::from_static("anthropic-ratelimit-tokens-remaining"),
        HeaderName::from_static("anthropic-ratelimit-tokens-reset"),
    ];
    match format {
        LlmFormat::OpenAi => &OPENAI,
        LlmFormat::Anthropic => &ANTHROPIC,
    }
}

/// Calls `f` with each token field of `plan`'s binding token budget, in the
/// dialect of its route (nothing for a plan that is not an LLM call or holds
/// no token budget): limit, remaining, reset.
pub fn for_each_token_header(
    decision: &Decision,
    plan: &Plan,
    policy: &Policy,
    mut f: impl FnMut(&HeaderName, &str),
) {
    let (Some(format), Some(i)) = (plan.llm, binding_tokens(decision, plan, policy)) else {
        return;
    };
    let Some(status) = decision.statuses().get(i) else {
        return;
    };
    let [limit, remaining, reset] = token_header_names(format);
    f(limit, itoa::Buffer::new().format(status.limit));
    f(remaining, itoa::Buffer::new().format(status.remaining));
    match format {
        LlmFormat::OpenAi => f(
            reset,
            &openai_duration(plan.seconds_until_more(i, decision)),
        ),
        LlmFormat::Anthropic => f(reset, &crate::rfc3339(status.reset)),
    }
}

/// Writes the token fields of `plan`'s binding token budget, in the dialect of
/// its route, into `headers` (nothing for a plan that is not an LLM call or
/// holds no token budget).
pub fn token_headers(headers: &mut HeaderMap, decision: &Decision, plan: &Plan, policy: &Policy) {
    for_each_token_header(decision, plan, policy, |name, value| {
        if let Ok(value) = HeaderValue::from_str(value) {
            headers.insert(name.clone(), value);
        }
    });
}

/// The 429 refusing an LLM call, in its route's dialect: `Retry-After` (none
/// for a call that can never fit), the token fields, and the API's own error
/// body. `answer` is sluice's own refusal, whose `X-RateLimit-*` fields are kept.
pub fn llm_refusal(
    format: LlmFormat,
    answer: Response<Full<Bytes>>,
    decision: &Decision,
    plan: &Plan,
    policy: &Policy,
) -> Response<Full<Bytes>> {
    let tokens = binding_tokens(decision, plan, policy) == Some(decision.binding_index());
    // A money budget spent: OpenAI's `insufficient_quota`, no wait helps before
    // the month turns.
    let money = budget_of(plan, policy, decision.binding_index()).is_some_and(|t| t.priced);
    let never = decision.is_never() || money;
    let wait = crate::refusal_wait(decision);
    let budget = plan.name(decision.binding_index(), policy);
    let message = if money {
        format!("You exceeded your current quota for {budget}: it is spent until the month turns.")
    } else if never {
        format!(
            "Request too large for {budget}: it needs more than the whole limit ({}). Send a smaller request.",
            decision.binding().map_or(0, |b| b.limit)
        )
    } else {
        format!("Rate limit reached for {budget}. Please try again in {wait}s.")
    };
    let body = match format {
        LlmFormat::OpenAi => serde_json::json!({
            "error": {
                "message": message,
                "type": if money { "insufficient_quota" } else if tokens { "tokens" } else { "requests" },
                "param": null,
                "code": if money { "insufficient_quota" } else { "rate_limit_exceeded" },
            }
        }),
        LlmFormat::Anthropic => serde_json::json!({
            "type": "error",
            "error": { "type": "rate_limit_error", "message": message },
        }),
    };
    let (mut parts, _) = answer.into_parts();
    parts.status = StatusCode::TOO_MANY_REQUESTS;
    parts.headers.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    if never {
        parts.headers.remove(http::header::RETRY_AFTER);
    } else if let Ok(v) = HeaderValue::from_str(&wait.to_string()) {
        parts.headers.insert(http::header::RETRY_AFTER, v);
    }
    token_headers(&mut parts.headers, decision, plan, policy);
    let body = serde_json::to_vec(&body).unwrap_or_default();
    Response::from_parts(parts, Full::new(Bytes::from(body)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn t5_resets_read_as_openai_writes_them() {
        assert_eq!(openai_duration(0), "0s");
        assert_eq!(openai_duration(45), "45s");
        assert_eq!(openai_duration(360), "6m0s");
        assert_eq!(openai_duration(3723), "1h2m3s");
    }
}
