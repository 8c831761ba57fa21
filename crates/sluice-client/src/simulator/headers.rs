//! The rate-limit headers of an answer, in OpenAI's or Anthropic's shapes.

use std::time::Duration;

use http::{HeaderMap, HeaderValue};
use sluice_core::Timestamp;

use super::book::Verdict;
use crate::api::ApiStyle;

/// Puts the rate-limit headers of verdict `v` (reached at `now`) into an
/// answer's headers `h`, in `style`'s shapes.
pub(super) fn rate_headers(h: &mut HeaderMap, style: ApiStyle, v: &Verdict, now: Timestamp) {
    let cfg = v.limits;
    let mut put = |k: String, val: String| {
        if let (Ok(k), Ok(val)) = (
            http::HeaderName::from_bytes(k.as_bytes()),
            HeaderValue::from_str(&val),
        ) {
            h.insert(k, val);
        }
    };
    match style {
        ApiStyle::OpenAi => {
            put("x-ratelimit-limit-requests".into(), cfg.rpm.to_string());
            put("x-ratelimit-limit-tokens".into(), cfg.tpm.to_string());
            put(
                "x-ratelimit-remaining-requests".into(),
                v.remaining_requests.to_string(),
            );
            put(
                "x-ratelimit-remaining-tokens".into(),
                v.remaining_tokens.to_string(),
            );
            put(
                "x-ratelimit-reset-requests".into(),
                fmt_duration(v.reset_requests),
            );
            put(
                "x-ratelimit-reset-tokens".into(),
                fmt_duration(v.reset_tokens),
            );
        }
        ApiStyle::Anthropic => {
            let at = |d: Duration| {
                let t = now.saturating_add(d);
                jiff::Timestamp::from_nanosecond(i128::from(t.as_nanos()))
                    .map(|t| t.to_string())
                    .unwrap_or_default()
            };
            put(
                "anthropic-ratelimit-requests-limit".into(),
                cfg.rpm.to_string(),
            );
            put(
                "anthropic-ratelimit-requests-remaining".into(),
                v.remaining_requests.to_string(),
            );
            put(
                "anthropic-ratelimit-requests-reset".into(),
                at(v.reset_requests),
            );
            put(
                "anthropic-ratelimit-tokens-limit".into(),
                cfg.tpm.to_string(),
            );
            put(
                "anthropic-ratelimit-tokens-remaining".into(),
                v.remaining_tokens.to_string(),
            );
            put(
                "anthropic-ratelimit-tokens-reset".into(),
                at(v.reset_tokens),
            );
            for (name, limit, remaining) in [
                ("input-tokens", cfg.itpm, v.remaining_input),
                ("output-tokens", cfg.otpm, v.remaining_output),
            ] {
                if limit > 0 {
                    put(
                        format!("anthropic-ratelimit-{name}-limit"),
                        limit.to_string(),
                    );
                    put(
                        format!("anthropic-ratelimit-{name}-remaining"),
                        remaining.to_string(),
                    );
                    put(
                        format!("anthropic-ratelimit-{name}-reset"),
                        at(v.reset_tokens),
                    );
                }
            }
        }
    }
}

/// OpenAI's duration style: `20ms`, `1.5s`, `6m0s`.
pub(super) fn fmt_duration(d: Duration) -> String {
    let ms = d.as_millis();
    if ms < 1000 {
        format!("{ms}ms")
    } else if ms < 60_000 {
        let s = d.as_secs_f64();
        let t = format!("{s:.3}");
        format!("{}s", t.trim_end_matches('0').trim_end_matches('.'))
    } else {
        format!("{}m{}s", ms / 60_000, (ms % 60_000) / 1000)
    }
}
