//! Backoff on 429 and retryable 5xx: the provider's own hint when
//! it gives one — `retry-after-ms`, `Retry-After` (seconds or an HTTP date),
//! an OpenAI-style message ("Please try again in 16.062s"),
//! `error.details.retry_after_seconds`, Google's `google.rpc.RetryInfo`
//! (`error.details[].retryDelay`, Gemini's only hint, in a body that may be
//! wrapped in a one-element array) — otherwise exponential backoff with
//! full jitter, never under 1 s, capped at 60 s, for a bounded number of
//! attempts. Some answers are never retried: `insufficient_quota`, 400, 401.

use std::time::{Duration, SystemTime};

use http::{HeaderMap, StatusCode};
use serde_json::Value;

use crate::headers::parse_duration;

/// The shortest computed backoff.
pub const MIN_BACKOFF: Duration = Duration::from_secs(1);
/// The longest computed backoff, and the longest provider hint still waited
/// for (a longer one is handed back to the caller).
pub const MAX_BACKOFF: Duration = Duration::from_secs(60);

/// Whether an answer may be tried again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Retryable {
    /// Success or a final answer: hand it back.
    No,
    /// Try again (after the hint, if any).
    Yes {
        /// The provider's own delay, when it said one.
        hint: Option<Duration>,
    },
}

/// Classifies an answer. `body` is the answer's body when the status is
/// one that may be retried (the caller reads it only then).
pub fn classify(status: StatusCode, headers: &HeaderMap, body: Option<&[u8]>) -> Retryable {
    let retryable_status = matches!(
        status.as_u16(),
        408 | 409 | 429 | 500 | 502 | 503 | 504 | 529
    );
    if !retryable_status {
        return Retryable::No;
    }
    let json: Option<Value> = body.and_then(|b| serde_json::from_slice(b).ok());
    if let Some(j) = &json {
        let err = error_of(j);
        let is = |k: &str| err.get(k).and_then(Value::as_str) == Some("insufficient_quota");
        if is("code") || is("type") {
            return Retryable::No;
        }
    }
    Retryable::Yes {
        hint: retry_after(headers, body, SystemTime::now()),
    }
}

/// The delay the provider asks for, from any of the forms it may use.
/// `now` resolves an HTTP-date `Retry-After`.
pub fn retry_after(headers: &HeaderMap, body: Option<&[u8]>, now: SystemTime) -> Option<Duration> {
    let get = |n: &str| headers.get(n).and_then(|v| v.to_str().ok()).map(str::trim);
    if let Some(ms) = get("retry-after-ms").and_then(|v| v.parse::<f64>().ok())
        && let Ok(d) = Duration::try_from_secs_f64(ms / 1000.0)
    {
        return Some(d);
    }
    if let Some(v) = get("retry-after") {
        if let Ok(secs) = v.parse::<f64>()
            && let Ok(d) = Duration::try_from_secs_f64(secs)
        {
            return Some(d);
        }
        if let Ok(at) = httpdate::parse_http_date(v) {
            return Some(at.duration_since(now).unwrap_or(Duration::ZERO));
        }
    }
    body.and_then(body_hint)
}

/// The `@type` of Google's retry hint in `error.details[]`.
pub const GOOGLE_RETRY_INFO: &str = "type.googleapis.com/google.rpc.RetryInfo";

/// The error object of a JSON error body: `error` of the body, or of its
/// first element when the body is an array (Gemini's OpenAI-compatible
/// endpoint answers `[{"error":{…}}]`), else the body itself.
fn error_of(json: &Value) -> &Value {
    let top = match json {
        Value::Array(items) => items.first().unwrap_or(json),
        _ => json,
    };
    top.get("error").unwrap_or(top)
}

/// A hint inside a JSON error body: `error.details.retry_after_seconds`
/// (also without `error`), Google's `error.details[]` entry of type
/// [`GOOGLE_RETRY_INFO`] with its `retryDelay` (`"37s"`), or a message saying
/// "try again in 16.062s" / "retry in 37s". The body may be a one-element
/// array around the object. A negative, malformed or non-finite value is no
/// hint.
pub fn body_hint(body: &[u8]) -> Option<Duration> {
    let json: Value = serde_json::from_slice(body).ok()?;
    let err = error_of(&json);
    for holder in [err.get("details"), json.get("details"), Some(err)]
        .into_iter()
        .flatten()
    {
        if let Some(s) = holder.get("retry_after_seconds").and_then(Value::as_f64)
            && let Ok(d) = Duration::try_from_secs_f64(s)
        {
            return Some(d);
        }
    }
    if let Some(d) = err
        .get("details")
        .and_then(Value::as_array)
        .and_then(|details| retry_info(details))
    {
        return Some(d);
    }
    let message = err.get("message").and_then(Value::as_str)?;
    message_hint(message)
}

/// The `retryDelay` of the first well-formed `google.rpc.RetryInfo` among
/// `details`.
fn retry_info(details: &[Value]) -> Option<Duration> {
    details
        .iter()
        .filter(|d| d.get("@type").and_then(Value::as_str) == Some(GOOGLE_RETRY_INFO))
        .find_map(|d| {
            d.get("retryDelay")
                .and_then(Value::as_str)
                .and_then(parse_proto_duration)
        })
}

/// A protobuf `Duration` in its JSON form: seconds with up to nine
/// fractional digits and an `s` (`"37s"`, `"1.5s"`, `"0.250s"`). Negative,
/// malformed or out-of-range values (past protobuf's 315,576,000,000 s) are
/// `None`.
pub fn parse_proto_duration(v: &str) -> Option<Duration> {
    const MAX_SECS: u64 = 315_576_000_000;
    let digits = v.trim().strip_suffix('s')?;
    let (whole, frac) = match digits.split_once('.') {
        Some((w, f)) => (w, f),
        None => (digits, ""),
    };
    let all_digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
    if whole.is_empty() || !all_digits(whole) || frac.len() > 9 || !all_digits(frac) {
        return None;
    }
    let secs: u64 = whole.parse().ok().filter(|s| *s <= MAX_SECS)?;
    let nanos = if frac.is_empty() {
        0
    } else {
        // "25" of "0.25s" is 250,000,000 ns.
        frac.parse::<u32>().ok()? * 10u32.pow(9 - frac.len() as u32)
    };
    Some(Duration::new(secs, nanos))
}

/// "Please try again in 16.062s." / "try again in 20ms" / "in 1m30s" /
/// Gemini's "Please retry in 37.5s." / Azure's "Please retry after 3
/// seconds.".
pub fn message_hint(message: &str) -> Option<Duration> {
    let lower = message.to_ascii_lowercase();
    let at = ["try again in ", "retry in ", "retry after "]
        .iter()
        .find_map(|p| lower.find(p).map(|i| i + p.len()))?;
    let rest = message.get(at..)?;
    let token: String = rest
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '.' || *c == 'µ')
        .collect();
    let token = token.trim_end_matches('.');
    if let Some(d) = parse_duration(token) {
        return Some(d);
    }
    // "try again in 20 seconds"
    let mut words = rest.split_whitespace();
    let n: f64 = words.next()?.parse().ok()?;
    let unit = words.next().unwrap_or("s").trim_end_matches(['.', ',']);
    let scale = match unit {
        u if u.starts_with("ms") || u.starts_with("milli") => 1e-3,
        u if u.starts_with('m') => 60.0,
        u if u.starts_with('h') => 3600.0,
        _ => 1.0,
    };
    Duration::try_from_secs_f64(n * scale).ok()
}

/// How many times and how long to back off: [`RetryPolicy::default`], then
/// set the fields to change.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RetryPolicy {
    /// Attempts per request, the first included.
    pub max_attempts: u32,
    /// The first computed backoff's upper bound (doubles per attempt).
    pub base: Duration,
    /// The largest computed backoff.
    pub cap: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_attempts: crate::config::DEFAULT_MAX_ATTEMPTS,
            base: MIN_BACKOFF,
            cap: MAX_BACKOFF,
        }
    }
}

/// One request's backoff state.
#[derive(Debug)]
pub struct Backoff {
    policy: RetryPolicy,
    attempts: u32,
    rng: fastrand::Rng,
}

impl Backoff {
    /// A fresh backoff (the first attempt is about to be made).
    pub fn new(policy: RetryPolicy) -> Self {
        Backoff {
            policy,
            attempts: 1,
            rng: fastrand::Rng::new(),
        }
    }

    /// The same with a seeded jitter source (tests, benchmarks).
    pub fn with_seed(policy: RetryPolicy, seed: u64) -> Self {
        Backoff {
            rng: fastrand::Rng::with_seed(seed),
            ..Backoff::new(policy)
        }
    }

    /// Attempts made so far.
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// The wait before the next attempt, or `None` when the attempts are
    /// used up or the provider's hint is longer than [`RetryPolicy::cap`].
    /// A hint is honoured as given; otherwise the wait is drawn uniformly
    /// from `[0, min(cap, base · 2^(n−1))]` (full jitter) and raised to at
    /// least [`MIN_BACKOFF`]. A hint of no wait at all (`Retry-After: 0`, or
    /// a date this clock has passed) is no hint: every attempt would go at
    /// once, a burst at a provider that has just refused.
    pub fn next_delay(&mut self, hint: Option<Duration>) -> Option<Duration> {
        if self.attempts >= self.policy.max_attempts {
            return None;
        }
        let n = self.attempts;
        self.attempts += 1;
        if let Some(h) = hint.filter(|h| !h.is_zero()) {
            return (h <= self.policy.cap).then_some(h);
        }
        let ceiling = self
            .policy
            .base
            .saturating_mul(1u32 << (n - 1).min(20))
            .min(self.policy.cap);
        let nanos = u64::try_from(ceiling.as_nanos()).unwrap_or(u64::MAX);
        let drawn = Duration::from_nanos(self.rng.u64(0..=nanos));
        Some(drawn.max(MIN_BACKOFF).min(self.policy.cap))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use http::HeaderValue;

    use super::*;

    fn h(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut m = HeaderMap::new();
        for (k, v) in pairs {
            m.insert(*k, HeaderValue::from_str(v).unwrap());
        }
        m
    }

    #[test]
    fn c5_each_retry_after_form() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_764_460_800);
        assert_eq!(
            retry_after(&h(&[("retry-after-ms", "1500")]), None, now),
            Some(Duration::from_millis(1500))
        );
        assert_eq!(
            retry_after(&h(&[("retry-after", "7")]), None, now),
            Some(Duration::from_secs(7))
        );
        assert_eq!(
            retry_after(
                &h(&[("retry-after", "Sun, 30 Nov 2025 00:00:42 GMT")]),
                None,
                now
            ),
            Some(Duration::from_secs(42))
        );
        let openai = br#"{"error":{"message":"Rate limit reached for gpt-4o in organization org-x on tokens per min (TPM): Limit 30000, Used 29000, Requested 2000. Please try again in 16.062s. Visit https://platform.openai.com/account/rate-limits to learn more.","type":"tokens","code":"rate_limit_exceeded"}}"#;
        assert_eq!(
            retry_after(&HeaderMap::new(), Some(openai), now),
            Some(Duration::from_millis(16_062))
        );
        let ms = br#"{"error":{"message":"Please try again in 20ms."}}"#;
        assert_eq!(body_hint(ms), Some(Duration::from_millis(20)));
        let details = br#"{"error":{"code":"rate_limited","message":"busy","details":{"retry_after_seconds":12}}}"#;
        assert_eq!(body_hint(details), Some(Duration::from_secs(12)));
        // Header wins over body.
        assert_eq!(
            retry_after(&h(&[("retry-after", "3")]), Some(details), now),
            Some(Duration::from_secs(3))
        );
        assert_eq!(
            message_hint("please try again in 2 seconds"),
            Some(Duration::from_secs(2))
        );
        // Azure OpenAI's message (its headers say the same).
        let azure = br#"{"error":{"code":"429","message":"Requests to the ChatCompletions_Create Operation under Azure OpenAI API version 2024-10-21 have exceeded token rate limit of your current OpenAI S0 pricing tier. Please retry after 3 seconds. Please go here: https://aka.ms/oai/quotaincrease if you would like to further increase the default rate limit."}}"#;
        assert_eq!(body_hint(azure), Some(Duration::from_secs(3)));
        assert_eq!(message_hint("we retry after lunch"), None);
    }

    /// Gemini's 429 as its OpenAI-compatible endpoint answers it (no
    /// header; the hint is a `google.rpc.RetryInfo` among the details).
    const GEMINI_429: &str = include_str!("../tests/recorded/gemini_429.json");

    #[test]
    fn c5_gemini_retry_info_in_an_array_or_an_object() {
        let now = SystemTime::UNIX_EPOCH;
        assert_eq!(
            retry_after(&HeaderMap::new(), Some(GEMINI_429.as_bytes()), now),
            Some(Duration::from_secs(37))
        );
        // The native endpoint's object form.
        let object = GEMINI_429
            .trim()
            .trim_start_matches('[')
            .trim_end_matches(']');
        assert_eq!(body_hint(object.as_bytes()), Some(Duration::from_secs(37)));
        assert_eq!(
            classify(
                StatusCode::TOO_MANY_REQUESTS,
                &HeaderMap::new(),
                Some(GEMINI_429.as_bytes())
            ),
            Retryable::Yes {
                hint: Some(Duration::from_secs(37))
            }
        );
        // A header still wins over the body.
        assert_eq!(
            retry_after(
                &h(&[("retry-after", "3")]),
                Some(GEMINI_429.as_bytes()),
                now
            ),
            Some(Duration::from_secs(3))
        );
        let with = |delay: &str| {
            format!(
                r#"[{{"error":{{"code":429,"status":"RESOURCE_EXHAUSTED","details":[{{"@type":"{GOOGLE_RETRY_INFO}","retryDelay":"{delay}"}}]}}}}]"#
            )
        };
        for (delay, want) in [
            ("3s", Some(Duration::from_secs(3))),
            ("1.5s", Some(Duration::from_millis(1500))),
            ("0.250s", Some(Duration::from_millis(250))),
            ("0.000000001s", Some(Duration::from_nanos(1))),
            ("0s", Some(Duration::ZERO)),
            // Garbage, negative, enormous: no hint (the backoff decides).
            ("-5s", None),
            ("37", None),
            ("s", None),
            (".5s", None),
            ("1.0000000001s", None),
            ("1e3s", None),
            ("99999999999999999999s", None),
            ("315576000001s", None),
            ("NaNs", None),
        ] {
            assert_eq!(body_hint(with(delay).as_bytes()), want, "{delay}");
        }
        // A RetryInfo of another type name, or a number, is not read.
        let other = br#"{"error":{"details":[{"@type":"type.googleapis.com/google.rpc.Help","retryDelay":"9s"},{"@type":"type.googleapis.com/google.rpc.RetryInfo","retryDelay":9}]}}"#;
        assert_eq!(body_hint(other), None);
        // Empty arrays and non-objects say nothing, and do not panic.
        for body in [
            &b"[]"[..],
            b"[1]",
            b"[[]]",
            b"\"x\"",
            b"{\"error\":[]}",
            b"null",
        ] {
            assert_eq!(body_hint(body), None);
        }
        // Gemini's message form, when the details are missing.
        let msg = br#"[{"error":{"code":429,"message":"Resource exhausted. Please retry in 12.5s.","status":"RESOURCE_EXHAUSTED"}}]"#;
        assert_eq!(body_hint(msg), Some(Duration::from_millis(12_500)));
    }

    #[test]
    fn c5_garbage_negative_and_enormous_retry_after_are_bounded() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_764_460_800);
        // Garbage and negative values are no hint (the backoff decides).
        for (name, v) in [
            ("retry-after", "abc"),
            ("retry-after", "-5"),
            ("retry-after", "NaN"),
            ("retry-after", "inf"),
            ("retry-after", "1e400"),
            ("retry-after", "Sun, 99 Foo 2025 00:00:00 GMT"),
            ("retry-after-ms", "-1500"),
            ("retry-after-ms", "NaN"),
            ("retry-after-ms", "soon"),
        ] {
            assert_eq!(
                retry_after(&h(&[(name, v)]), None, now),
                None,
                "{name}: {v}"
            );
        }
        // A garbage header does not hide a good body hint.
        assert_eq!(
            retry_after(
                &h(&[("retry-after", "abc")]),
                Some(br#"{"error":{"details":{"retry_after_seconds":4}}}"#),
                now
            ),
            Some(Duration::from_secs(4))
        );
        // A date in the past: go now.
        assert_eq!(
            retry_after(
                &h(&[("retry-after", "Sun, 30 Nov 2025 00:00:00 GMT")]),
                None,
                now
            ),
            Some(Duration::ZERO)
        );
        // An enormous hint is read as it is, and never waited: the answer
        // goes back to the caller.
        let huge = retry_after(&h(&[("retry-after", "99999999999")]), None, now).unwrap();
        assert_eq!(huge, Duration::from_secs(99_999_999_999));
        let mut b = Backoff::with_seed(RetryPolicy::default(), 7);
        assert_eq!(b.next_delay(Some(huge)), None);
        let body = br#"{"error":{"details":{"retry_after_seconds":1e300}}}"#;
        assert_eq!(body_hint(body), None, "past Duration: no hint");
    }

    #[test]
    fn c5_insufficient_quota_in_an_array_body_is_final() {
        let quota = br#"[{"error":{"message":"You exceeded your current quota","type":"insufficient_quota","code":"insufficient_quota"}}]"#;
        assert_eq!(
            classify(
                StatusCode::TOO_MANY_REQUESTS,
                &HeaderMap::new(),
                Some(quota)
            ),
            Retryable::No
        );
    }

    #[test]
    fn c5_never_retry_quota_400_401() {
        let quota = br#"{"error":{"message":"You exceeded your current quota","type":"insufficient_quota","code":"insufficient_quota"}}"#;
        assert_eq!(
            classify(
                StatusCode::TOO_MANY_REQUESTS,
                &HeaderMap::new(),
                Some(quota)
            ),
            Retryable::No
        );
        assert_eq!(
            classify(StatusCode::BAD_REQUEST, &HeaderMap::new(), None),
            Retryable::No
        );
        assert_eq!(
            classify(StatusCode::UNAUTHORIZED, &HeaderMap::new(), None),
            Retryable::No
        );
        assert_eq!(
            classify(StatusCode::OK, &HeaderMap::new(), None),
            Retryable::No
        );
        assert_eq!(
            classify(StatusCode::SERVICE_UNAVAILABLE, &HeaderMap::new(), None),
            Retryable::Yes { hint: None }
        );
        assert_eq!(
            classify(
                StatusCode::TOO_MANY_REQUESTS,
                &h(&[("retry-after", "2")]),
                None
            ),
            Retryable::Yes {
                hint: Some(Duration::from_secs(2))
            }
        );
    }

    #[test]
    fn c5_full_jitter_floor_cap_and_bound() {
        let policy = RetryPolicy {
            max_attempts: 8,
            ..RetryPolicy::default()
        };
        for seed in 0..200 {
            let mut b = Backoff::with_seed(policy, seed);
            for n in 1..8u32 {
                let d = b.next_delay(None).unwrap();
                assert!(d >= MIN_BACKOFF, "{d:?}");
                assert!(
                    d <= Duration::from_secs(1 << (n - 1)).min(MAX_BACKOFF),
                    "{n} {d:?}"
                );
            }
            assert_eq!(b.next_delay(None), None, "bounded attempts");
            // `Retry-After: 0` (or a date passed): backed off, never at once.
            let mut b = Backoff::with_seed(policy, seed);
            for _ in 1..8u32 {
                let d = b.next_delay(Some(Duration::ZERO)).unwrap();
                assert!(d >= MIN_BACKOFF, "{d:?}");
            }
        }
        let mut b = Backoff::with_seed(policy, 1);
        assert_eq!(
            b.next_delay(Some(Duration::from_millis(300))),
            Some(Duration::from_millis(300))
        );
        assert_eq!(b.next_delay(Some(Duration::from_secs(61))), None);
        // Later draws spread out: not all at the floor.
        let mut b = Backoff::with_seed(policy, 3);
        let draws: Vec<_> = (0..7).map(|_| b.next_delay(None).unwrap()).collect();
        assert!(
            draws.iter().any(|d| *d > Duration::from_secs(2)),
            "{draws:?}"
        );
    }
}
