//! One provider as checked ([`ProviderConfig`]): where it is, how a key is
//! sent, its limits, models and keys, and how its requests are paced.

use std::fmt;
use std::time::Duration;

use http::HeaderName;

use super::defaults::{DEFAULT_INTERACTIVE_RESERVE, DEFAULT_MAX_WAIT};
use super::keys::ApiKey;
use super::limits::{LimitsOrigin, ProviderLimits};
use super::models::{ModelLimits, model_entry};
use super::shipped::{ShippedProvider, shipped};
use crate::api::{ApiStyle, ApiStyleExt, DEFAULT_MAX_TOKENS};
use crate::tokens::Encoding;

/// One provider, checked: [`ProviderConfig::new`], then set the fields to
/// change.
#[derive(Clone, PartialEq)]
#[non_exhaustive]
pub struct ProviderConfig {
    /// The config key; also the proxy's path prefix.
    pub name: String,
    /// The key sent upstream (none: the client's own credentials pass).
    pub api_key: Option<String>,
    /// Base URL without a trailing `/`.
    pub base_url: String,
    /// Request and response shapes.
    pub style: ApiStyle,
    /// The header the key goes in (`authorization` → `Bearer <key>`).
    pub auth_header: HeaderName,
    /// Effective limits.
    pub limits: ProviderLimits,
    /// Where [`ProviderConfig::limits`] come from.
    pub origin: LimitsOrigin,
    /// Drop old context when waiting would exceed `max_wait`.
    pub shrink: bool,
    /// The longest a request waits for room (queue included).
    pub max_wait: Duration,
    /// Completion budget counted when a request sets no `max_tokens`.
    pub default_max_tokens: u32,
    /// Tokenizer used for estimates.
    pub encoding: Encoding,
    /// Replace the reservation with the answer's `usage` when it ends.
    pub reconcile: bool,
    /// Per-model limits (`models:`); a request naming a model they cover is
    /// paced by its group's limits and by [`ProviderConfig::limits`].
    pub models: Vec<ModelLimits>,
    /// Batch requests leave room for this long of interactive requests at
    /// their recent rate (besides the largest one): more keeps interactive
    /// latency through bursts, less leaves batch jobs more.
    pub interactive_reserve: Duration,
    /// Several keys (`apiKeys:`), each with its own limits; empty: the one
    /// [`ProviderConfig::api_key`] (or none) with [`ProviderConfig::limits`].
    pub api_keys: Vec<ApiKey>,
}

impl fmt::Debug for ProviderConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProviderConfig")
            .field("name", &self.name)
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .field("base_url", &self.base_url)
            .field("style", &self.style)
            .field("auth_header", &self.auth_header)
            .field("limits", &self.limits)
            .field("origin", &self.origin)
            .field("shrink", &self.shrink)
            .field("max_wait", &self.max_wait)
            .field("default_max_tokens", &self.default_max_tokens)
            .field("encoding", &self.encoding)
            .field("reconcile", &self.reconcile)
            .field("interactive_reserve", &self.interactive_reserve)
            .field("models", &self.models)
            .field("api_keys", &self.api_keys)
            .finish()
    }
}

impl ProviderConfig {
    /// A provider at `base_url` with `limits` and every other setting at
    /// its default (for tests and library users without a file).
    pub fn new(name: &str, base_url: &str, limits: ProviderLimits) -> Self {
        let known = shipped(name);
        let style = known.map_or(ApiStyle::OpenAi, |s| s.style);
        ProviderConfig {
            name: name.to_owned(),
            api_key: None,
            base_url: base_url.trim_end_matches('/').to_owned(),
            style,
            auth_header: default_auth_header(style, known),
            limits,
            origin: LimitsOrigin::Config,
            shrink: false,
            max_wait: DEFAULT_MAX_WAIT,
            default_max_tokens: DEFAULT_MAX_TOKENS,
            encoding: Encoding::O200kBase,
            reconcile: true,
            models: Vec::new(),
            interactive_reserve: DEFAULT_INTERACTIVE_RESERVE,
            api_keys: Vec::new(),
        }
    }

    /// The same provider with per-model limits.
    #[must_use]
    pub fn with_models(mut self, models: impl IntoIterator<Item = ModelLimits>) -> Self {
        self.models = models.into_iter().collect();
        self
    }

    /// The same provider with several keys, each with its own limits.
    #[must_use]
    pub fn with_api_keys(mut self, keys: impl IntoIterator<Item = ApiKey>) -> Self {
        self.api_keys = keys.into_iter().collect();
        self
    }

    /// The `models:` entry governing `model`, if any (see [`model_entry`]).
    pub fn model(&self, model: &str) -> Option<&ModelLimits> {
        model_entry(&self.models, model)
    }

    /// A provider sluice ships: its base URL, API style and conservative
    /// mid-tier limits (see [`SHIPPED_PROVIDERS`](super::SHIPPED_PROVIDERS)); `None` for a name it
    /// does not know. Azure's (`azure`) base URL is a template with a
    /// `{resource}` to replace: set [`ProviderConfig::base_url`].
    ///
    /// ```
    /// use sluice_client::config::{ProviderConfig, ProviderLimits};
    ///
    /// let openai = ProviderConfig::shipped("openai").unwrap();
    /// assert_eq!(openai.base_url, "https://api.openai.com/v1");
    /// let mine = openai.with_limits(ProviderLimits::new(30_000, 500, 0));
    /// assert_eq!(mine.limits.tpm, 30_000);
    /// assert!(ProviderConfig::shipped("nobody").is_none());
    /// ```
    pub fn shipped(name: &str) -> Option<Self> {
        let s = shipped(name)?;
        let mut p = ProviderConfig::new(s.name, s.base_url, s.limits);
        p.origin = LimitsOrigin::Shipped;
        Some(p)
    }

    /// The same provider with other limits.
    #[must_use]
    pub fn with_limits(mut self, limits: ProviderLimits) -> Self {
        self.limits = limits;
        self.origin = LimitsOrigin::Config;
        self
    }

    /// The same provider with `shrink` on and `max_wait`.
    pub fn with_shrink(mut self, max_wait: Duration) -> Self {
        self.shrink = true;
        self.max_wait = max_wait;
        self
    }

    /// The value of the auth header for `key`.
    pub fn auth_value(&self, key: &str) -> String {
        if self.auth_header == http::header::AUTHORIZATION {
            format!("Bearer {key}")
        } else {
            key.to_owned()
        }
    }
}

/// The header a key goes in when the config names none: the shipped
/// provider's own (Azure's `api-key`) when `style` is its style, else the
/// style's default.
pub(super) fn default_auth_header(style: ApiStyle, known: Option<&ShippedProvider>) -> HeaderName {
    known
        .filter(|k| k.style == style)
        .and_then(|k| k.auth_header)
        .and_then(|h| HeaderName::from_bytes(h.as_bytes()).ok())
        .unwrap_or_else(|| style.default_auth_header())
}
