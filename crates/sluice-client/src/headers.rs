//! What providers say about their limits: OpenAI's
//! `x-ratelimit-*` (resets as durations such as `6m0s`, `20ms`), Anthropic's
//! `anthropic-ratelimit-*` (resets as RFC 3339 instants), the generic
//! `X-RateLimit-*` and `RateLimit-*` fields, and the IETF draft's structured
//! `RateLimit` / `RateLimit-Policy` fields.

use std::time::Duration;

use http::HeaderMap;
use sluice_core::Timestamp;

/// One axis a provider reports on (requests or tokens).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Axis {
    /// The provider's limit on this axis.
    pub limit: Option<u64>,
    /// What is left now.
    pub remaining: Option<u64>,
    /// How long until the axis is whole again.
    #[serde(serialize_with = "ser_secs")]
    pub reset: Option<Duration>,
}

fn ser_secs<S: serde::Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
    match d {
        Some(d) => s.serialize_some(&d.as_secs_f64()),
        None => s.serialize_none(),
    }
}

impl Axis {
    /// True when the provider said nothing on this axis.
    pub fn is_empty(&self) -> bool {
        self.limit.is_none() && self.remaining.is_none() && self.reset.is_none()
    }

    /// Units the provider counts as used (`limit − remaining`).
    pub fn used(&self) -> Option<u64> {
        Some(self.limit?.saturating_sub(self.remaining?))
    }

    fn fill(&mut self, other: Axis) {
        self.limit = self.limit.or(other.limit);
        self.remaining = self.remaining.or(other.remaining);
        self.reset = self.reset.or(other.reset);
    }
}

/// Everything rate-limit related in one response's headers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RateLimitHeaders {
    /// Requests (per minute on OpenAI and Anthropic).
    pub requests: Axis,
    /// Tokens (input + output).
    pub tokens: Axis,
    /// Anthropic's input-token axis.
    pub input_tokens: Axis,
    /// Anthropic's output-token axis.
    pub output_tokens: Axis,
}

impl RateLimitHeaders {
    /// Parses every known family; `now` resolves absolute reset instants.
    pub fn parse(headers: &HeaderMap, now: Timestamp) -> Self {
        let mut h = RateLimitHeaders::default();
        let get = |name: &str| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::trim)
        };
        let num = |name: &str| get(name).and_then(parse_count);
        // OpenAI.
        for (axis, suffix) in [(&mut h.requests, "requests"), (&mut h.tokens, "tokens")] {
            axis.fill(Axis {
                limit: num(&format!("x-ratelimit-limit-{suffix}")),
                remaining: num(&format!("x-ratelimit-remaining-{suffix}")),
                reset: get(&format!("x-ratelimit-reset-{suffix}")).and_then(parse_duration),
            });
        }
        // Anthropic.
        for (axis, name) in [
            (&mut h.requests, "requests"),
            (&mut h.tokens, "tokens"),
            (&mut h.input_tokens, "input-tokens"),
            (&mut h.output_tokens, "output-tokens"),
        ] {
            axis.fill(Axis {
                limit: num(&format!("anthropic-ratelimit-{name}-limit")),
                remaining: num(&format!("anthropic-ratelimit-{name}-remaining")),
                reset: get(&format!("anthropic-ratelimit-{name}-reset"))
                    .and_then(|v| parse_instant(v, now)),
            });
        }
        // Generic X-RateLimit-* and the draft's RateLimit-*: requests.
        for prefix in ["x-ratelimit", "ratelimit"] {
            h.requests.fill(Axis {
                limit: num(&format!("{prefix}-limit")),
                remaining: num(&format!("{prefix}-remaining")),
                reset: get(&format!("{prefix}-reset")).and_then(|v| parse_reset(v, now)),
            });
        }
        // IETF structured fields.
        if let Some(v) = get("ratelimit") {
            let policies = get("ratelimit-policy")
                .map(parse_policies)
                .unwrap_or_default();
            for (name, axis) in parse_ratelimit(v, &policies) {
                if name.contains("token") {
                    h.tokens.fill(axis);
                } else {
                    h.requests.fill(axis);
                }
            }
        }
        h
    }

    /// True when no family was present.
    pub fn is_empty(&self) -> bool {
        self.requests.is_empty()
            && self.tokens.is_empty()
            && self.input_tokens.is_empty()
            && self.output_tokens.is_empty()
    }
}

/// A count: a whole number, or a finite non-negative one (truncated;
/// saturating at `u64::MAX`). `NaN`, `inf` and negatives say nothing.
fn parse_count(v: &str) -> Option<u64> {
    v.parse::<u64>().ok().or_else(|| {
        v.parse::<f64>()
            .ok()
            .filter(|f| f.is_finite() && *f >= 0.0)
            .map(|f| f as u64)
    })
}

/// OpenAI-style durations (Go's `time.Duration` text): `6m0s`, `1m30.5s`,
/// `20ms`, `1h2m3s`, `0s`, `350us` / `350µs`, `5ns`, or a bare number of
/// seconds. Negative, malformed (`abc`, `5x`, `1.2.3s`) or unrepresentable
/// (`1e400`) values are `None`; a huge one (`99999999h`) is returned as is,
/// and whoever waits on it bounds it (a hold lasts at most a day).
pub fn parse_duration(v: &str) -> Option<Duration> {
    let v = v.trim();
    if v.is_empty() {
        return None;
    }
    if let Ok(secs) = v.parse::<f64>() {
        return Duration::try_from_secs_f64(secs).ok();
    }
    let mut total = 0f64;
    let mut rest = v;
    while !rest.is_empty() {
        let n_end = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        if n_end == 0 {
            return None;
        }
        let n: f64 = rest[..n_end].parse().ok()?;
        rest = &rest[n_end..];
        let u_end = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let scale = match &rest[..u_end] {
            "h" => 3600.0,
            "m" => 60.0,
            "s" => 1.0,
            "ms" => 1e-3,
            "us" | "µs" => 1e-6,
            "ns" => 1e-9,
            _ => return None,
        };
        total += n * scale;
        rest = &rest[u_end..];
    }
    Duration::try_from_secs_f64(total).ok()
}

/// An RFC 3339 instant, as the time from `now` until it (zero if past).
pub fn parse_instant(v: &str, now: Timestamp) -> Option<Duration> {
    let t: jiff::Timestamp = v.trim().parse().ok()?;
    let nanos = u64::try_from(t.as_nanosecond()).ok()?;
    Some(Timestamp::from_nanos(nanos).saturating_since(now))
}

/// A generic reset: Unix seconds when large, else seconds from now.
fn parse_reset(v: &str, now: Timestamp) -> Option<Duration> {
    let n: f64 = v.parse().ok()?;
    if n > 1e9 {
        let at = Timestamp::from_nanos((n * 1e9) as u64);
        Some(at.saturating_since(now))
    } else {
        Duration::try_from_secs_f64(n).ok()
    }
}

/// `RateLimit-Policy: "default";q=100;w=60, "tokens";q=1000;w=60` → names and
/// quotas. Parsed as an IETF structured-field list (RFC 9651), so a quoted name may
/// hold `,` or `;`; a value that is no such list says nothing.
fn parse_policies(v: &str) -> Vec<(String, u64)> {
    sf_list(v)
        .iter()
        .filter_map(|(name, params)| Some((name.clone(), param(params, "q")?)))
        .collect()
}

/// Each member of a structured-field list that is an item named by a string or a
/// token, with its parameters (members of any other shape are skipped).
fn sf_list(v: &str) -> Vec<(String, sfv::Parameters)> {
    let Ok(list) = sfv::Parser::new(v).parse::<sfv::List>() else {
        return Vec::new();
    };
    list.into_iter()
        .filter_map(|entry| match entry {
            sfv::ListEntry::Item(item) => {
                let name = match &item.bare_item {
                    sfv::BareItem::String(s) => s.as_str().to_owned(),
                    sfv::BareItem::Token(t) => t.as_str().to_owned(),
                    _ => return None,
                };
                Some((name, item.params))
            }
            sfv::ListEntry::InnerList(_) => None,
        })
        .collect()
}

/// A non-negative integer parameter.
fn param(params: &sfv::Parameters, key: &str) -> Option<u64> {
    params
        .iter()
        .find(|(k, _)| k.as_str() == key)
        .and_then(|(_, v)| v.as_integer())
        .and_then(|n| u64::try_from(n).ok())
}

/// `RateLimit: "default";r=50;t=30` (draft-10, a structured-field list) or the older
/// `RateLimit: limit=100, remaining=50, reset=30`.
fn parse_ratelimit(v: &str, policies: &[(String, u64)]) -> Vec<(String, Axis)> {
    let mut out = Vec::new();
    let old_style = v.split(',').all(|p| {
        p.trim()
            .split_once('=')
            .is_some_and(|(k, _)| matches!(k.trim(), "limit" | "remaining" | "reset"))
    });
    if old_style {
        let mut a = Axis::default();
        for p in v.split(',') {
            if let Some((k, val)) = p.trim().split_once('=') {
                let n = val.trim().parse::<u64>().ok();
                match k.trim() {
                    "limit" => a.limit = n,
                    "remaining" => a.remaining = n,
                    "reset" => a.reset = n.map(Duration::from_secs),
                    _ => {}
                }
            }
        }
        out.push(("default".to_owned(), a));
        return out;
    }
    for (name, params) in sf_list(v) {
        let axis = Axis {
            limit: policies.iter().find(|(n, _)| *n == name).map(|(_, q)| *q),
            remaining: param(&params, "r"),
            reset: param(&params, "t").map(Duration::from_secs),
        };
        out.push((name, axis));
    }
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use http::HeaderValue;

    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    const NOW: Timestamp = Timestamp::from_secs(1_764_460_800);

    #[test]
    fn c6_openai_durations() {
        assert_eq!(parse_duration("6m0s"), Some(Duration::from_secs(360)));
        assert_eq!(parse_duration("20ms"), Some(Duration::from_millis(20)));
        assert_eq!(parse_duration("1s"), Some(Duration::from_secs(1)));
        assert_eq!(
            parse_duration("1m30.5s"),
            Some(Duration::from_millis(90_500))
        );
        assert_eq!(parse_duration("2h"), Some(Duration::from_secs(7200)));
        assert_eq!(parse_duration("0.25"), Some(Duration::from_millis(250)));
        assert_eq!(parse_duration("soon"), None);
        assert_eq!(parse_duration("5x"), None);
    }

    #[test]
    fn c6_openai_reset_durations_every_form_and_garbage() {
        let ms = Duration::from_millis;
        for (v, want) in [
            ("6m0s", Some(Duration::from_secs(360))),
            ("1m30.5s", Some(ms(90_500))),
            ("12ms", Some(ms(12))),
            ("1h2m3s", Some(Duration::from_secs(3723))),
            ("0s", Some(Duration::ZERO)),
            ("500us", Some(Duration::from_micros(500))),
            ("500µs", Some(Duration::from_micros(500))),
            ("1.5µs", Some(Duration::from_nanos(1500))),
            ("7ns", Some(Duration::from_nanos(7))),
            ("2m", Some(Duration::from_secs(120))),
            ("59.999s", Some(ms(59_999))),
            (" 20ms ", Some(ms(20))),
            ("3", Some(Duration::from_secs(3))),
            ("99999999h", Some(Duration::from_secs(99_999_999 * 3600))),
            // Garbage: nothing.
            ("abc", None),
            ("-5s", None),
            ("-0s", None),
            ("-1", None),
            ("", None),
            ("s", None),
            ("ms", None),
            ("5x", None),
            ("5 s", None),
            ("1.2.3s", None),
            ("1s5", None),
            ("1e400", None),
            ("1e400s", None),
            ("NaN", None),
            ("inf", None),
            ("99999999999999999999999h", None),
        ] {
            assert_eq!(parse_duration(v), want, "{v:?}");
        }
        // Never a panic, whatever the bytes.
        for v in [
            "\u{0}",
            "..s",
            "1..s",
            ".s",
            "µ",
            "1µ",
            "9".repeat(400).as_str(),
        ] {
            let _ = parse_duration(v);
        }
    }

    #[test]
    fn c6_openai_recorded_header_set_and_garbage_values() {
        // Recorded from a chat completion (gpt-4o-mini, tier 5).
        let h = RateLimitHeaders::parse(
            &headers(&[
                ("x-ratelimit-limit-requests", "30000"),
                ("x-ratelimit-limit-tokens", "150000000"),
                ("x-ratelimit-remaining-requests", "29999"),
                ("x-ratelimit-remaining-tokens", "149999975"),
                ("x-ratelimit-reset-requests", "2ms"),
                ("x-ratelimit-reset-tokens", "0s"),
            ]),
            NOW,
        );
        assert_eq!(
            h.requests,
            Axis {
                limit: Some(30_000),
                remaining: Some(29_999),
                reset: Some(Duration::from_millis(2))
            }
        );
        assert_eq!(
            h.tokens,
            Axis {
                limit: Some(150_000_000),
                remaining: Some(149_999_975),
                reset: Some(Duration::ZERO)
            }
        );
        // Garbage values say nothing; the others still count.
        let h = RateLimitHeaders::parse(
            &headers(&[
                ("x-ratelimit-limit-requests", "abc"),
                ("x-ratelimit-remaining-requests", "-1"),
                ("x-ratelimit-reset-requests", "-5s"),
                ("x-ratelimit-limit-tokens", "NaN"),
                ("x-ratelimit-remaining-tokens", "inf"),
                ("x-ratelimit-reset-tokens", "1m30.5s"),
            ]),
            NOW,
        );
        assert_eq!(h.requests, Axis::default());
        assert_eq!(
            h.tokens,
            Axis {
                limit: None,
                remaining: None,
                reset: Some(Duration::from_millis(90_500))
            }
        );
        // Counts past u64 saturate rather than overflow.
        let h = RateLimitHeaders::parse(
            &headers(&[
                ("x-ratelimit-limit-tokens", "1e30"),
                ("x-ratelimit-remaining-tokens", "99999999999999999999999"),
            ]),
            NOW,
        );
        assert_eq!(h.tokens.limit, Some(u64::MAX));
        assert_eq!(h.tokens.used(), Some(0));
    }

    #[test]
    fn c6_openai_headers() {
        let h = RateLimitHeaders::parse(
            &headers(&[
                ("x-ratelimit-limit-requests", "60"),
                ("x-ratelimit-remaining-requests", "59"),
                ("x-ratelimit-reset-requests", "1s"),
                ("x-ratelimit-limit-tokens", "150000"),
                ("x-ratelimit-remaining-tokens", "149984"),
                ("x-ratelimit-reset-tokens", "6m0s"),
            ]),
            NOW,
        );
        assert_eq!(
            h.requests,
            Axis {
                limit: Some(60),
                remaining: Some(59),
                reset: Some(Duration::from_secs(1))
            }
        );
        assert_eq!(h.tokens.used(), Some(16));
        assert_eq!(h.tokens.reset, Some(Duration::from_secs(360)));
    }

    #[test]
    fn c6_anthropic_headers_with_rfc3339_resets() {
        let h = RateLimitHeaders::parse(
            &headers(&[
                ("anthropic-ratelimit-requests-limit", "50"),
                ("anthropic-ratelimit-requests-remaining", "49"),
                ("anthropic-ratelimit-requests-reset", "2025-11-30T00:00:30Z"),
                ("anthropic-ratelimit-tokens-limit", "120000"),
                ("anthropic-ratelimit-tokens-remaining", "100000"),
                ("anthropic-ratelimit-tokens-reset", "2025-11-30T00:00:01.5Z"),
                ("anthropic-ratelimit-input-tokens-limit", "80000"),
            ]),
            NOW,
        );
        assert_eq!(h.requests.reset, Some(Duration::from_secs(30)));
        assert_eq!(h.tokens.reset, Some(Duration::from_millis(1500)));
        assert_eq!(h.tokens.used(), Some(20_000));
        assert_eq!(h.input_tokens.limit, Some(80_000));
    }

    #[test]
    fn c6_ietf_names_are_structured_strings_not_split_on_separators() {
        // A quoted name may hold `,` and `;`: splitting on them would read
        // "r=0" as the name of a second policy and lose the tokens axis.
        let h = RateLimitHeaders::parse(
            &headers(&[
                (
                    "ratelimit-policy",
                    "\"req, per; min\";q=30;w=60, \"tokens\";q=1000;w=60",
                ),
                (
                    "ratelimit",
                    "\"req, per; min\";r=4;t=37, \"tokens\";r=900;t=5",
                ),
            ]),
            NOW,
        );
        assert_eq!(
            h.requests,
            Axis {
                limit: Some(30),
                remaining: Some(4),
                reset: Some(Duration::from_secs(37))
            }
        );
        assert_eq!(h.tokens.remaining, Some(900));
        // A value that is no structured list says nothing (it is not guessed at).
        let h = RateLimitHeaders::parse(&headers(&[("ratelimit", "\"open;r=1")]), NOW);
        assert!(h.is_empty(), "{h:?}");
    }

    #[test]
    fn c6_generic_and_ietf_headers() {
        let h = RateLimitHeaders::parse(
            &headers(&[
                ("x-ratelimit-limit", "30"),
                ("x-ratelimit-remaining", "0"),
                ("x-ratelimit-reset", "1764460837"),
            ]),
            NOW,
        );
        assert_eq!(
            h.requests,
            Axis {
                limit: Some(30),
                remaining: Some(0),
                reset: Some(Duration::from_secs(37))
            }
        );
        let h = RateLimitHeaders::parse(
            &headers(&[
                (
                    "ratelimit-policy",
                    "\"expensive\";q=30;w=60, \"tokens\";q=1000;w=60",
                ),
                ("ratelimit", "\"expensive\";r=0;t=37, \"tokens\";r=900;t=5"),
            ]),
            NOW,
        );
        assert_eq!(
            h.requests,
            Axis {
                limit: Some(30),
                remaining: Some(0),
                reset: Some(Duration::from_secs(37))
            }
        );
        assert_eq!(
            h.tokens,
            Axis {
                limit: Some(1000),
                remaining: Some(900),
                reset: Some(Duration::from_secs(5))
            }
        );
        let h = RateLimitHeaders::parse(
            &headers(&[("ratelimit", "limit=10, remaining=3, reset=7")]),
            NOW,
        );
        assert_eq!(
            h.requests,
            Axis {
                limit: Some(10),
                remaining: Some(3),
                reset: Some(Duration::from_secs(7))
            }
        );
        assert!(RateLimitHeaders::parse(&HeaderMap::new(), NOW).is_empty());
    }
}
