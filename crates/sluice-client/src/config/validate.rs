//! Checking a raw config ([`RawConfig`]) and building the typed one: every
//! problem found, each with its key path.

use std::collections::BTreeMap;
use std::time::Duration;

use http::HeaderName;
use sluice_core::Problem;

use super::defaults::{DEFAULT_INTERACTIVE_RESERVE, DEFAULT_MAX_WAIT};
use super::env;
use super::keys::ApiKey;
use super::limits::{LimitsOrigin, ProviderLimits};
use super::models::{ModelLimits, globs_overlap};
use super::pace::{PaceConfig, PacerSettings};
use super::provider::ProviderConfig;
use super::raw::{self, RawConfig, RawLimits, RawProvider};
use super::shipped::{ShippedProvider, shipped};
use crate::api::{ApiStyle, ApiStyleExt, DEFAULT_MAX_TOKENS};
use crate::tokens::Encoding;

pub(super) fn check_limits(
    path: &str,
    raw: Option<&RawLimits>,
    fallback: Option<ProviderLimits>,
    problems: &mut Vec<Problem>,
) -> Option<ProviderLimits> {
    let mut ok = true;
    let mut axis = |name: &str, v: Option<u64>, fb: Option<u32>| -> u32 {
        match (v, fb) {
            (Some(v), _) => u32::try_from(v).unwrap_or_else(|_| {
                problems.push(Problem {
                    path: format!("{path}.{name}"),
                    message: format!("{v} is larger than {} (0 means unlimited)", u32::MAX),
                });
                ok = false;
                0
            }),
            (None, Some(fb)) => fb,
            (None, None) => {
                problems.push(Problem {
                    path: format!("{path}.{name}"),
                    message: "required: this provider has no shipped default (0 means unlimited)"
                        .into(),
                });
                ok = false;
                0
            }
        }
    };
    let r = raw.copied().unwrap_or_default();
    let limits = ProviderLimits {
        tpm: axis("tpm", r.tpm, fallback.map(|f| f.tpm)),
        rpm: axis("rpm", r.rpm, fallback.map(|f| f.rpm)),
        rpd: axis("rpd", r.rpd, fallback.map(|f| f.rpd)),
        itpm: axis("itpm", r.itpm, Some(fallback.map_or(0, |f| f.itpm))),
        otpm: axis("otpm", r.otpm, Some(fallback.map_or(0, |f| f.otpm))),
        tpd: axis("tpd", r.tpd, Some(fallback.map_or(0, |f| f.tpd))),
    };
    ok.then_some(limits)
}

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
}

/// Checks a raw config and builds the typed one; `env` looks variables up.
///
/// # Errors
/// Every problem found, each with its key path.
pub fn validate(
    raw: &RawConfig,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<PaceConfig, Vec<Problem>> {
    let mut problems = Vec::new();
    let mut providers = BTreeMap::new();
    for (name, entry) in &raw.providers {
        let base = format!("providers.{name}");
        if !valid_name(name) {
            problems.push(Problem {
                path: base.clone(),
                message: "a provider name is 1–64 of letters, digits, `-`, `_`, `.` (it is the proxy's path prefix)".into(),
            });
            continue;
        }
        let entry = entry.clone().unwrap_or_default();
        if let Some(p) = check_provider(name, &base, &entry, env, &mut problems) {
            providers.insert(name.clone(), p);
        }
    }
    let pacer = check_pacer(raw.pacer.as_ref(), &mut problems);
    if problems.is_empty() {
        Ok(PaceConfig { providers, pacer })
    } else {
        Err(problems)
    }
}

/// Checks one provider's entry (`name`, at key path `base`) and builds it;
/// `None` when it had problems (each pushed to `problems`). The entry's
/// fields are checked in a fixed order, so the problems come in it too.
fn check_provider(
    name: &str,
    base: &str,
    entry: &RawProvider,
    env: &dyn Fn(&str) -> Option<String>,
    problems: &mut Vec<Problem>,
) -> Option<ProviderConfig> {
    let before = problems.len();
    let known = shipped(name);
    let api_key =
        substituted(base, "apiKey", &entry.api_key, env, problems).filter(|k| !k.is_empty());
    let base_url = substituted(base, "baseUrl", &entry.base_url, env, problems);
    let style = check_style(base, entry.style.as_deref(), known, problems);
    let base_url = check_base_url(base, base_url, known, problems);
    let auth_header = check_auth_header(base, entry.auth_header.as_deref(), style, known, problems);
    let (limits, origin) = check_rate_limits(base, entry.rate_limits.as_ref(), known, problems);
    let max_wait = check_max_wait(base, entry.max_wait_seconds, problems);
    let default_max_tokens = check_default_max_tokens(base, entry.default_max_tokens, problems);
    let encoding = check_encoding(base, entry.encoding.as_deref(), problems);
    check_io(
        &format!("{base}.rateLimits"),
        entry.rate_limits.as_ref(),
        style,
        problems,
    );
    let interactive_reserve =
        check_interactive_reserve(base, entry.interactive_reserve_seconds, problems);
    let models = entry
        .models
        .as_ref()
        .map(|m| check_models(base, m, style, problems))
        .unwrap_or_default();
    let api_keys = check_api_keys(base, entry, limits, style, env, problems);
    if problems.len() > before {
        return None;
    }
    Some(ProviderConfig {
        name: name.to_owned(),
        api_key,
        base_url,
        style,
        auth_header,
        limits: limits?,
        origin,
        shrink: entry.shrink.unwrap_or(false),
        max_wait,
        default_max_tokens,
        encoding,
        reconcile: entry.reconcile.unwrap_or(true),
        models,
        interactive_reserve,
        api_keys,
    })
}

/// The text at `base.key` with its `${ENV}` variables substituted (`None`
/// when absent, or when a variable is missing or malformed: a problem).
fn substituted(
    base: &str,
    key: &str,
    v: &Option<String>,
    env: &dyn Fn(&str) -> Option<String>,
    problems: &mut Vec<Problem>,
) -> Option<String> {
    let v = v.as_ref()?;
    match env::substitute(v, env) {
        Ok(s) => Some(s),
        Err(e) => {
            problems.push(Problem {
                path: format!("{base}.{key}"),
                message: e.message(),
            });
            None
        }
    }
}

/// The provider's `style`: the shipped provider's (or OpenAI's) when not
/// given; an unknown style is a problem.
fn check_style(
    base: &str,
    raw: Option<&str>,
    known: Option<&ShippedProvider>,
    problems: &mut Vec<Problem>,
) -> ApiStyle {
    match raw {
        None => known.map_or(ApiStyle::OpenAi, |k| k.style),
        Some(s) => ApiStyle::parse(s).unwrap_or_else(|| {
            problems.push(Problem {
                path: format!("{base}.style"),
                message: format!("`{s}` is not a style (expected `openai` or `anthropic`)"),
            });
            ApiStyle::OpenAi
        }),
    }
}

/// The provider's `baseUrl` without a trailing `/`: the shipped one when not
/// given (required for a provider sluice does not ship), and an http(s) URL.
fn check_base_url(
    base: &str,
    base_url: Option<String>,
    known: Option<&ShippedProvider>,
    problems: &mut Vec<Problem>,
) -> String {
    let base_url = match (base_url, known) {
        (Some(u), _) => u,
        (None, Some(k)) if k.base_url_is_template() => {
            problems.push(Problem {
                path: format!("{base}.baseUrl"),
                message: format!(
                    "required: {} has no base URL sluice can know; write yours, `{}` with your resource's name (or its `/openai/deployments/<deployment>` form)",
                    k.title, k.base_url
                ),
            });
            String::new()
        }
        (None, Some(k)) => k.base_url.to_owned(),
        (None, None) => {
            problems.push(Problem {
                path: format!("{base}.baseUrl"),
                message: "required: this provider has no shipped base URL".into(),
            });
            String::new()
        }
    };
    let base_url = base_url.trim_end_matches('/').to_owned();
    if !base_url.is_empty()
        && (!(base_url.starts_with("http://") || base_url.starts_with("https://"))
            || base_url.parse::<http::Uri>().is_err())
    {
        problems.push(Problem {
            path: format!("{base}.baseUrl"),
            message: format!("`{base_url}` is not an http:// or https:// URL"),
        });
    }
    base_url
}

/// The header the key goes in (`authHeader`, lower-cased); when not given,
/// the shipped provider's own (Azure's `api-key`) if the style is its, else
/// the style's default.
fn check_auth_header(
    base: &str,
    raw: Option<&str>,
    style: ApiStyle,
    known: Option<&ShippedProvider>,
    problems: &mut Vec<Problem>,
) -> HeaderName {
    match raw {
        None => super::provider::default_auth_header(style, known),
        Some(h) => HeaderName::from_bytes(h.to_ascii_lowercase().as_bytes()).unwrap_or_else(|_| {
            problems.push(Problem {
                path: format!("{base}.authHeader"),
                message: format!("`{h}` is not a header name"),
            });
            style.default_auth_header()
        }),
    }
}

/// The provider's `rateLimits` and where they come from: the config's (axes
/// it leaves out from the shipped defaults), else the shipped defaults;
/// required for a provider sluice does not ship.
fn check_rate_limits(
    base: &str,
    raw: Option<&RawLimits>,
    known: Option<&ShippedProvider>,
    problems: &mut Vec<Problem>,
) -> (Option<ProviderLimits>, LimitsOrigin) {
    match raw {
        None => match known {
            Some(k) => (Some(k.limits), LimitsOrigin::Shipped),
            None => {
                problems.push(Problem {
                    path: format!("{base}.rateLimits"),
                    message: "required: this provider has no shipped defaults (write {tpm, rpm, rpd}; 0 = unlimited)".into(),
                });
                (None, LimitsOrigin::Config)
            }
        },
        Some(r) => (
            check_limits(
                &format!("{base}.rateLimits"),
                Some(r),
                known.map(|k| k.limits),
                problems,
            ),
            LimitsOrigin::Config,
        ),
    }
}

/// `maxWaitSeconds`: in (0, 86400], [`DEFAULT_MAX_WAIT`] when not given.
fn check_max_wait(base: &str, raw: Option<f64>, problems: &mut Vec<Problem>) -> Duration {
    match raw {
        None => DEFAULT_MAX_WAIT,
        Some(s) if s.is_finite() && s > 0.0 && s <= 86_400.0 => Duration::from_secs_f64(s),
        Some(s) => {
            problems.push(Problem {
                path: format!("{base}.maxWaitSeconds"),
                message: format!("{s} is not a number of seconds in (0, 86400]"),
            });
            DEFAULT_MAX_WAIT
        }
    }
}

/// `defaultMaxTokens`: at least 1, [`DEFAULT_MAX_TOKENS`] when not given.
fn check_default_max_tokens(base: &str, raw: Option<u32>, problems: &mut Vec<Problem>) -> u32 {
    match raw {
        None => DEFAULT_MAX_TOKENS,
        Some(0) => {
            problems.push(Problem {
                path: format!("{base}.defaultMaxTokens"),
                message: "must be at least 1".into(),
            });
            DEFAULT_MAX_TOKENS
        }
        Some(n) => n,
    }
}

/// `encoding`: one the tokenizer knows, `o200k_base` when not given.
fn check_encoding(base: &str, raw: Option<&str>, problems: &mut Vec<Problem>) -> Encoding {
    match raw {
        None => Encoding::O200kBase,
        Some(e) => Encoding::parse(e).unwrap_or_else(|| {
            problems.push(Problem {
                path: format!("{base}.encoding"),
                message: format!(
                    "`{e}` is not an encoding (expected `o200k_base` or `cl100k_base`)"
                ),
            });
            Encoding::O200kBase
        }),
    }
}

/// `interactiveReserveSeconds`: in [0, 60], [`DEFAULT_INTERACTIVE_RESERVE`]
/// when not given.
fn check_interactive_reserve(
    base: &str,
    raw: Option<f64>,
    problems: &mut Vec<Problem>,
) -> Duration {
    match raw {
        None => DEFAULT_INTERACTIVE_RESERVE,
        Some(s) if s.is_finite() && (0.0..=60.0).contains(&s) => Duration::from_secs_f64(s),
        Some(s) => {
            problems.push(Problem {
                path: format!("{base}.interactiveReserveSeconds"),
                message: format!("{s} is not a number of seconds in [0, 60]"),
            });
            DEFAULT_INTERACTIVE_RESERVE
        }
    }
}

/// The provider's `apiKeys` (none unless its limits checked out); giving
/// `apiKey` as well is a problem.
fn check_api_keys(
    base: &str,
    entry: &RawProvider,
    limits: Option<ProviderLimits>,
    style: ApiStyle,
    env: &dyn Fn(&str) -> Option<String>,
    problems: &mut Vec<Problem>,
) -> Vec<ApiKey> {
    match (&entry.api_keys, limits) {
        (Some(keys), Some(l)) => {
            if entry.api_key.is_some() {
                problems.push(Problem {
                    path: format!("{base}.apiKeys"),
                    message: "give `apiKey` or `apiKeys`, not both".into(),
                });
            }
            check_keys(base, keys, l, style, env, problems)
        }
        _ => Vec::new(),
    }
}

/// `otpm` without `itpm` where the provider counts input and output apart
/// (Anthropic): the input side would go unpaced.
fn check_io(path: &str, raw: Option<&RawLimits>, style: ApiStyle, problems: &mut Vec<Problem>) {
    if let Some(r) = raw
        && style == ApiStyle::Anthropic
        && r.otpm.is_some()
        && r.itpm.is_none()
    {
        problems.push(Problem {
            path: format!("{path}.otpm"),
            message: "an `otpm` without an `itpm`: this provider counts input and output tokens apart; give `itpm` too (0 = unlimited)".into(),
        });
    }
}

fn valid_pattern(p: &str) -> bool {
    !p.is_empty() && p.len() <= 128 && p.chars().all(|c| !c.is_whitespace() && !c.is_control())
}

fn check_models(
    base: &str,
    raw: &BTreeMap<String, raw::RawModel>,
    style: ApiStyle,
    problems: &mut Vec<Problem>,
) -> Vec<ModelLimits> {
    let mut out: Vec<ModelLimits> = Vec::new();
    // Group → (limits, the entry that gave them).
    let mut groups: BTreeMap<String, (ProviderLimits, String)> = BTreeMap::new();
    let mut unset: Vec<(String, String)> = Vec::new();
    for (pattern, m) in raw {
        let path = format!("{base}.models.{pattern}");
        if !valid_pattern(pattern) {
            problems.push(Problem {
                path,
                message: "a model name or pattern is 1–128 characters without spaces (`*` matches any run)".into(),
            });
            continue;
        }
        let group = match &m.shared {
            Some(g) if !valid_name(g) => {
                problems.push(Problem {
                    path: format!("{path}.shared"),
                    message: "a group name is 1–64 of letters, digits, `-`, `_`, `.`".into(),
                });
                continue;
            }
            Some(g) => g.clone(),
            None => pattern.clone(),
        };
        check_io(
            &format!("{path}.rateLimits"),
            m.rate_limits.as_ref(),
            style,
            problems,
        );
        match &m.rate_limits {
            Some(r) => {
                let Some(l) = check_limits(
                    &format!("{path}.rateLimits"),
                    Some(r),
                    Some(ProviderLimits::UNLIMITED),
                    problems,
                ) else {
                    continue;
                };
                match groups.get(&group) {
                    Some((other, by)) if *other != l => problems.push(Problem {
                        path: format!("{path}.rateLimits"),
                        message: format!(
                            "the group `{group}` already has other limits (from `{by}`): entries sharing one budget give the same limits, or only one gives them"
                        ),
                    }),
                    Some(_) => {}
                    None => {
                        groups.insert(group.clone(), (l, pattern.clone()));
                    }
                }
            }
            None if m.shared.is_none() => {
                problems.push(Problem {
                    path,
                    message: "give `rateLimits`, or `shared:` naming a group another entry gives them for".into(),
                });
                continue;
            }
            None => {}
        }
        unset.push((pattern.clone(), group.clone()));
    }
    for (pattern, group) in unset {
        match groups.get(&group) {
            Some((l, _)) => out.push(ModelLimits {
                pattern,
                group,
                limits: *l,
            }),
            None => problems.push(Problem {
                path: format!("{base}.models.{pattern}.shared"),
                message: format!("no entry gives `rateLimits` for the group `{group}`"),
            }),
        }
    }
    for (i, a) in out.iter().enumerate() {
        for b in &out[i + 1..] {
            if a.group != b.group && a.limits != b.limits && globs_overlap(&a.pattern, &b.pattern) {
                problems.push(Problem {
                    path: format!("{base}.models.{}", b.pattern),
                    message: format!(
                        "`{}` and `{}` can both match one model, with different limits: make them disjoint or share one group",
                        a.pattern, b.pattern
                    ),
                });
            }
        }
    }
    out
}

fn check_keys(
    base: &str,
    raw: &[raw::RawApiKey],
    provider: ProviderLimits,
    style: ApiStyle,
    env: &dyn Fn(&str) -> Option<String>,
    problems: &mut Vec<Problem>,
) -> Vec<ApiKey> {
    let mut out: Vec<ApiKey> = Vec::new();
    if raw.is_empty() {
        problems.push(Problem {
            path: format!("{base}.apiKeys"),
            message: "an empty list: give at least one key, or leave `apiKeys` out".into(),
        });
    }
    for (i, k) in raw.iter().enumerate() {
        let path = format!("{base}.apiKeys[{i}]");
        let secret = match env::substitute(&k.key, env) {
            Ok(s) if s.is_empty() => {
                problems.push(Problem {
                    path: format!("{path}.key"),
                    message: "the key is empty".into(),
                });
                continue;
            }
            Ok(s) => s,
            Err(e) => {
                problems.push(Problem {
                    path: format!("{path}.key"),
                    message: e.message(),
                });
                continue;
            }
        };
        let name = k.name.clone().unwrap_or_else(|| format!("key{}", i + 1));
        if !valid_name(&name) || out.iter().any(|o| o.name == name) {
            problems.push(Problem {
                path: format!("{path}.name"),
                message: format!(
                    "`{name}` is not a unique name of 1–64 letters, digits, `-`, `_`, `.`"
                ),
            });
            continue;
        }
        check_io(
            &format!("{path}.rateLimits"),
            k.rate_limits.as_ref(),
            style,
            problems,
        );
        let r = k.rate_limits.unwrap_or_default();
        if k.rate_limits.is_some()
            && check_limits(
                &format!("{path}.rateLimits"),
                Some(&r),
                Some(provider),
                problems,
            )
            .is_none()
        {
            continue;
        }
        // Checked above: each given axis fits a u32.
        let own = [r.tpm, r.rpm, r.rpd, r.itpm, r.otpm, r.tpd]
            .map(|v| v.and_then(|v| u32::try_from(v).ok()));
        out.push(ApiKey::inheriting(name, secret, own, provider));
    }
    out
}

fn check_pacer(raw: Option<&raw::RawPacer>, problems: &mut Vec<Problem>) -> PacerSettings {
    let mut s = PacerSettings::default();
    let Some(raw) = raw else { return s };
    if let Some(ms) = raw.arrival_margin_ms {
        if ms > 60_000 {
            problems.push(Problem {
                path: "pacer.arrivalMarginMs".into(),
                message: format!("{ms} is more than 60000"),
            });
        } else {
            s.arrival_margin = Duration::from_millis(ms);
        }
    }
    if let Some(n) = raw.max_attempts {
        if (1..=10).contains(&n) {
            s.max_attempts = n;
        } else {
            problems.push(Problem {
                path: "pacer.maxAttempts".into(),
                message: format!("{n} is not in 1..=10"),
            });
        }
    }
    if let Some(b) = raw.max_body_bytes {
        match usize::try_from(b) {
            Ok(b) if b >= 1024 => s.max_body_bytes = b,
            _ => problems.push(Problem {
                path: "pacer.maxBodyBytes".into(),
                message: format!("{b} is not a size of at least 1024 bytes"),
            }),
        }
    }
    for (i, origin) in raw.allowed_origins.iter().flatten().enumerate() {
        let ok = origin.split_once("://").is_some_and(|(scheme, rest)| {
            matches!(scheme, "http" | "https") && !rest.is_empty() && !rest.contains('/')
        });
        if ok {
            s.allowed_origins.push(origin.to_ascii_lowercase());
        } else {
            problems.push(Problem {
                path: format!("pacer.allowedOrigins[{i}]"),
                message: format!(
                    "{origin:?} is not an origin such as http://localhost:3000 (scheme, host, port; no path)"
                ),
            });
        }
    }
    for (i, host) in raw.allowed_hosts.iter().flatten().enumerate() {
        if host.is_empty() || host.contains(['/', ':', '@', ' ']) {
            problems.push(Problem {
                path: format!("pacer.allowedHosts[{i}]"),
                message: format!("{host:?} is not a host name such as host.docker.internal"),
            });
        } else {
            s.allowed_hosts.push(host.to_ascii_lowercase());
        }
    }
    for (i, key) in raw.client_keys.iter().flatten().enumerate() {
        let hex = key.trim();
        let hex = hex.strip_prefix("sha256:").unwrap_or(hex);
        if hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            s.client_keys.push(hex.to_ascii_lowercase());
        } else {
            problems.push(Problem {
                path: format!("pacer.clientKeys[{i}]"),
                message: "expected a key's SHA-256 digest, 64 hex digits (printf %s \"$KEY\" | sha256sum), never the key itself".to_owned(),
            });
        }
    }
    s
}
