//! The client's rate-limit header parsing, `sluice_client::RateLimitHeaders::parse`
//! (public), over arbitrary header values: the IETF structured `RateLimit` /
//! `RateLimit-Policy` fields and every other family it reads.
//!
//! Input: lines (`\n`); a line's first byte picks a field name from the ones the
//! parser reads, the rest is its value (lines that are no valid value are skipped).
//!
//! Beyond "no panic":
//! - what is found does not depend on the time: parsed at `now` and 37 s later the
//!   same axes say the same limits and remainders, and a reset is never later at
//!   the later time, nor more than 37 s earlier;
//! - the result serialises (as the pacer's status does) and `used()` is at most the
//!   limit.
#![no_main]

use std::time::Duration;

use http::{HeaderMap, HeaderName, HeaderValue};
use libfuzzer_sys::fuzz_target;
use sluice_client::RateLimitHeaders;
use sluice_client::headers::Axis;
use sluice_core::Timestamp;

const NAMES: &[&str] = &[
    "ratelimit",
    "ratelimit-policy",
    "ratelimit-limit",
    "ratelimit-remaining",
    "ratelimit-reset",
    "x-ratelimit-limit",
    "x-ratelimit-remaining",
    "x-ratelimit-reset",
    "x-ratelimit-limit-requests",
    "x-ratelimit-remaining-requests",
    "x-ratelimit-reset-requests",
    "x-ratelimit-limit-tokens",
    "x-ratelimit-remaining-tokens",
    "x-ratelimit-reset-tokens",
    "anthropic-ratelimit-requests-limit",
    "anthropic-ratelimit-requests-remaining",
    "anthropic-ratelimit-requests-reset",
    "anthropic-ratelimit-tokens-limit",
    "anthropic-ratelimit-tokens-remaining",
    "anthropic-ratelimit-tokens-reset",
    "anthropic-ratelimit-input-tokens-limit",
    "anthropic-ratelimit-input-tokens-remaining",
    "anthropic-ratelimit-input-tokens-reset",
    "anthropic-ratelimit-output-tokens-limit",
    "anthropic-ratelimit-output-tokens-remaining",
    "anthropic-ratelimit-output-tokens-reset",
    "retry-after",
];

const NOW: Timestamp = Timestamp::from_secs(1_764_460_800);
const LATER: Duration = Duration::from_secs(37);

fn same_but_reset(a: &Axis, b: &Axis) {
    assert_eq!(a.limit, b.limit);
    assert_eq!(a.remaining, b.remaining);
    assert_eq!(a.reset.is_some(), b.reset.is_some());
    if let (Some(x), Some(y)) = (a.reset, b.reset) {
        assert!(y <= x, "a reset later at a later time: {x:?} → {y:?}");
        assert!(
            x - y <= LATER,
            "a reset that moved more than the time: {x:?} → {y:?}"
        );
    }
    if let (Some(limit), Some(used)) = (a.limit, a.used()) {
        assert!(used <= limit);
    }
}

fuzz_target!(|data: &[u8]| {
    let mut headers = HeaderMap::new();
    for line in data.split(|&b| b == b'\n') {
        let Some((&pick, value)) = line.split_first() else {
            continue;
        };
        let Ok(value) = HeaderValue::from_bytes(value) else {
            continue;
        };
        let name = HeaderName::from_static(NAMES[usize::from(pick) % NAMES.len()]);
        headers.append(name, value);
    }
    let now = RateLimitHeaders::parse(&headers, NOW);
    let later_now = Timestamp::from_nanos(NOW.as_nanos() + LATER.as_secs() * 1_000_000_000);
    let later = RateLimitHeaders::parse(&headers, later_now);
    for (a, b) in [
        (&now.requests, &later.requests),
        (&now.tokens, &later.tokens),
        (&now.input_tokens, &later.input_tokens),
        (&now.output_tokens, &later.output_tokens),
    ] {
        same_but_reset(a, b);
    }
    assert_eq!(now.is_empty(), later.is_empty());
    serde_json::to_string(&now).expect("the headers serialise");
});
