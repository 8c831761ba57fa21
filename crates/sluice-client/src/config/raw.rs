//! The pace config file as written: serde structs, no checks beyond shape.
//! [`super::validate`] turns them into [`super::PaceConfig`].

use std::collections::BTreeMap;

use serde::Deserialize;

/// The whole file (`providers:` and an optional `pacer:` section).
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct RawConfig {
    /// Provider name → its entry (`openai:` alone, with no body, means
    /// "the shipped defaults").
    #[serde(default)]
    pub providers: BTreeMap<String, Option<RawProvider>>,
    /// Pacer-wide settings.
    #[serde(default)]
    pub pacer: Option<RawPacer>,
}

/// One provider's entry.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct RawProvider {
    /// The key, usually `${ENV_VAR}`.
    pub api_key: Option<String>,
    /// Where `/<provider>/<path>` is forwarded to.
    pub base_url: Option<String>,
    /// `openai` or `anthropic`: request and response shapes.
    pub style: Option<String>,
    /// The header the key goes in (`authorization` sends `Bearer <key>`).
    pub auth_header: Option<String>,
    /// TPM / RPM / RPD (0 = unlimited).
    pub rate_limits: Option<RawLimits>,
    /// Opt in to dropping old context when waiting will not do.
    pub shrink: Option<bool>,
    /// The longest a request waits for room before it is shrunk or refused.
    pub max_wait_seconds: Option<f64>,
    /// The completion budget counted when a request sets no `max_tokens`.
    pub default_max_tokens: Option<u32>,
    /// `o200k_base` or `cl100k_base`.
    pub encoding: Option<String>,
    /// Whether actual `usage` replaces the reservation (default true).
    pub reconcile: Option<bool>,
    /// Model name or `*` pattern → its limits (or its shared group).
    pub models: Option<BTreeMap<String, RawModel>>,
    /// Seconds of interactive traffic (at its recent rate) batch requests
    /// leave room for.
    pub interactive_reserve_seconds: Option<f64>,
    /// Several keys, each with its own limits (instead of `apiKey`).
    pub api_keys: Option<Vec<RawApiKey>>,
}

/// One `models:` entry.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct RawModel {
    /// The model's limits (0 or missing = no model limit on that axis).
    pub rate_limits: Option<RawLimits>,
    /// The name of a budget this model shares with other entries.
    pub shared: Option<String>,
}

/// One `apiKeys:` entry.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct RawApiKey {
    /// The key, usually `${ENV_VAR}`.
    pub key: String,
    /// What logs and pages call it (default `key1`, `key2`, …).
    pub name: Option<String>,
    /// This key's limits (default: the provider's `rateLimits`).
    pub rate_limits: Option<RawLimits>,
}

/// `rateLimits: {tpm, rpm, rpd, itpm, otpm, tpd}`.
#[derive(Clone, Copy, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawLimits {
    /// Tokens per minute.
    pub tpm: Option<u64>,
    /// Requests per minute.
    pub rpm: Option<u64>,
    /// Requests per day.
    pub rpd: Option<u64>,
    /// Input tokens per minute (where the provider counts input apart).
    pub itpm: Option<u64>,
    /// Output tokens per minute (where the provider counts output apart).
    pub otpm: Option<u64>,
    /// Tokens per day (rolling 24 h), where the provider sets one.
    pub tpd: Option<u64>,
}

/// `pacer:` settings shared by every provider.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct RawPacer {
    /// How much earlier than our send a provider may count a request's
    /// neighbours (network jitter), in milliseconds.
    pub arrival_margin_ms: Option<u64>,
    /// Attempts per request, the first included.
    pub max_attempts: Option<u32>,
    /// The largest request body the proxy reads, in bytes.
    pub max_body_bytes: Option<u64>,
    /// Origins of web pages whose requests the proxy forwards (a request with any
    /// other `Origin` is refused).
    pub allowed_origins: Option<Vec<String>>,
    /// Names `Host` may carry besides `localhost` and the proxy's addresses.
    pub allowed_hosts: Option<Vec<String>>,
    /// SHA-256 digests (hex, `sha256:` optional) of keys a caller must present.
    pub client_keys: Option<Vec<String>>,
}

/// The settings page's file next to the config: only limits.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct RawOverrides {
    /// Provider name → its edited limits.
    #[serde(default)]
    pub providers: BTreeMap<String, RawOverride>,
}

/// One provider's edited limits.
#[derive(Clone, Copy, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct RawOverride {
    /// The limits set on the settings page.
    pub rate_limits: RawLimits,
}
