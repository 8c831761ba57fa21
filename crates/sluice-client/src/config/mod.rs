//! The pace config: YAML → [`RawConfig`] → [`validate`] →
//! [`PaceConfig`], with `${ENV}` substitution, the shipped provider defaults,
//! the settings page's overrides file and hot reload ([`ConfigWatcher`]).
//!
//! ```yaml
//! providers:
//!   openai:
//!     apiKey: ${OPENAI_API_KEY}
//!     rateLimits: { tpm: 150000, rpm: 60, rpd: 0 }   # 0 = unlimited
//!   anthropic:
//!     apiKey: ${ANTHROPIC_API_KEY}                    # limits: shipped defaults
//!   local:
//!     baseUrl: http://127.0.0.1:8080/v1
//!     rateLimits: { tpm: 0, rpm: 0, rpd: 0 }
//!     shrink: true
//!     maxWaitSeconds: 10
//! ```

mod env;
mod keys;
mod models;
pub mod raw;
mod shipped;
mod watch;

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use http::HeaderName;

pub use keys::ApiKey;
pub use models::{ModelLimits, glob_matches, globs_overlap, model_entry};
pub use raw::{RawApiKey, RawConfig, RawLimits, RawModel, RawOverrides, RawProvider};
pub use shipped::{SHIPPED_PROVIDERS, ShippedProvider, shipped};
pub use watch::{ConfigWatcher, LimitsSource, StaticLimits, overrides_path};

use crate::tokens::Encoding;

/// Default longest wait for room before a request is shrunk or refused.
pub const DEFAULT_MAX_WAIT: Duration = Duration::from_secs(90);
/// Default completion budget when a request sets no `max_tokens`.
pub const DEFAULT_MAX_TOKENS: u32 = 4_096;
/// Default allowance for the provider counting a request when it arrives.
pub const DEFAULT_ARRIVAL_MARGIN: Duration = Duration::from_secs(1);
/// Default attempts per request (the first included).
pub const DEFAULT_MAX_ATTEMPTS: u32 = 5;
/// Default time of interactive traffic held back from batch requests.
pub const DEFAULT_INTERACTIVE_RESERVE: Duration = Duration::from_secs(2);
/// Default largest request body the proxy reads: 32 MiB.
pub const DEFAULT_MAX_BODY_BYTES: usize = 32 << 20;

/// A provider's limits; 0 on an axis means unlimited.
///
/// ```
/// use sluice_client::config::ProviderLimits;
///
/// let limits = ProviderLimits::new(30_000, 500, 0); // TPM, RPM, no daily cap
/// assert_eq!((limits.tpm, limits.rpm, limits.rpd), (30_000, 500, 0));
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize)]
#[non_exhaustive]
pub struct ProviderLimits {
    /// Tokens per minute (rolling 60 s).
    pub tpm: u32,
    /// Requests per minute, spaced evenly.
    pub rpm: u32,
    /// Requests per day (rolling 24 h).
    pub rpd: u32,
    /// Input tokens per minute (rolling 60 s), where the provider counts
    /// input apart (Anthropic's ITPM).
    pub itpm: u32,
    /// Output tokens per minute (rolling 60 s), where the provider counts
    /// output apart (Anthropic's OTPM); the completion budget spends it.
    pub otpm: u32,
}

impl ProviderLimits {
    /// `tpm` tokens a minute, `rpm` requests a minute and `rpd` requests a
    /// day; 0 on an axis means unlimited.
    pub const fn new(tpm: u32, rpm: u32, rpd: u32) -> Self {
        ProviderLimits {
            tpm,
            rpm,
            rpd,
            itpm: 0,
            otpm: 0,
        }
    }

    /// The same limits with `itpm` input and `otpm` output tokens a
    /// minute (0 = unlimited).
    ///
    /// ```
    /// use sluice_client::config::ProviderLimits;
    ///
    /// let l = ProviderLimits::new(0, 50, 0).with_io(40_000, 8_000);
    /// assert_eq!((l.itpm, l.otpm), (40_000, 8_000));
    /// ```
    #[must_use]
    pub const fn with_io(mut self, itpm: u32, otpm: u32) -> Self {
        self.itpm = itpm;
        self.otpm = otpm;
        self
    }

    /// Whether no axis is limited.
    pub const fn is_unlimited(&self) -> bool {
        self.tpm == 0 && self.rpm == 0 && self.rpd == 0 && self.itpm == 0 && self.otpm == 0
    }

    /// No limit on any axis.
    pub const UNLIMITED: ProviderLimits = ProviderLimits::new(0, 0, 0);
}

/// Where a provider's effective limits come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LimitsOrigin {
    /// The shipped table ([`SHIPPED_PROVIDERS`]).
    Shipped,
    /// The config file's `rateLimits`.
    Config,
    /// The settings page (the overrides file).
    Settings,
}

/// Request and response shapes of a provider's API.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ApiStyle {
    /// OpenAI-compatible: `messages` with system turns, `usage.prompt_tokens`,
    /// `Authorization: Bearer`.
    #[serde(rename = "openai")]
    OpenAi,
    /// Anthropic Messages: top-level `system`, `usage.input_tokens`,
    /// `x-api-key`.
    Anthropic,
}

impl ApiStyle {
    fn parse(s: &str) -> Option<Self> {
        match s {
            "openai" => Some(ApiStyle::OpenAi),
            "anthropic" => Some(ApiStyle::Anthropic),
            _ => None,
        }
    }

    /// The header the key goes in by default.
    pub fn default_auth_header(self) -> HeaderName {
        match self {
            ApiStyle::OpenAi => http::header::AUTHORIZATION,
            ApiStyle::Anthropic => HeaderName::from_static("x-api-key"),
        }
    }
}

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
        let style = shipped(name).map_or(ApiStyle::OpenAi, |s| s.style);
        ProviderConfig {
            name: name.to_owned(),
            api_key: None,
            base_url: base_url.trim_end_matches('/').to_owned(),
            style,
            auth_header: style.default_auth_header(),
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
    /// mid-tier limits (see [`SHIPPED_PROVIDERS`]); `None` for a name it
    /// does not know.
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

/// Pacer-wide settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PacerSettings {
    /// How much earlier than our send a provider may count a request's
    /// neighbours: windows reach back `60 s + arrival_margin`.
    pub arrival_margin: Duration,
    /// Attempts per request, the first included.
    pub max_attempts: u32,
    /// The largest request body the proxy reads.
    pub max_body_bytes: usize,
    /// Origins of web pages whose requests the proxy forwards
    /// (`pacer.allowedOrigins`; a request with another `Origin` is 403).
    pub allowed_origins: Vec<String>,
    /// Names `Host` may carry besides `localhost` and the proxy's own addresses
    /// (`pacer.allowedHosts`, e.g. `host.docker.internal`; others are 421).
    pub allowed_hosts: Vec<String>,
    /// SHA-256 digests (64 lowercase hex digits) of keys a caller must present one of
    /// (`pacer.clientKeys`; empty: none required).
    pub client_keys: Vec<String>,
}

impl Default for PacerSettings {
    fn default() -> Self {
        PacerSettings {
            arrival_margin: DEFAULT_ARRIVAL_MARGIN,
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            allowed_origins: Vec::new(),
            allowed_hosts: Vec::new(),
            client_keys: Vec::new(),
        }
    }
}

/// A checked pace config: from YAML ([`validate`]) or in code
/// ([`PaceConfig::from_providers`]).
#[derive(Clone, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct PaceConfig {
    /// Providers by name.
    pub providers: BTreeMap<String, ProviderConfig>,
    /// Pacer-wide settings.
    pub pacer: PacerSettings,
}

impl PaceConfig {
    /// A config of these providers with default pacer settings.
    pub fn from_providers(providers: impl IntoIterator<Item = ProviderConfig>) -> Self {
        PaceConfig {
            providers: providers.into_iter().map(|p| (p.name.clone(), p)).collect(),
            pacer: PacerSettings::default(),
        }
    }

    /// The provider called `name`.
    pub fn provider(&self, name: &str) -> Option<&ProviderConfig> {
        self.providers.get(name)
    }

    /// The effective limits per provider, the wire format of `GET /limits`:
    /// `{"providers": {"openai": {"tpm":150000,"rpm":60,"rpd":0,"source":"shipped", …}}}`.
    pub fn limits_json(&self) -> serde_json::Value {
        let providers: serde_json::Map<String, serde_json::Value> = self
            .providers
            .values()
            .map(|p| {
                (
                    p.name.clone(),
                    serde_json::json!({
                        "tpm": p.limits.tpm,
                        "rpm": p.limits.rpm,
                        "rpd": p.limits.rpd,
                        "source": p.origin,
                        "baseUrl": p.base_url,
                        "style": p.style,
                        "itpm": p.limits.itpm,
                        "otpm": p.limits.otpm,
                        "shrink": p.shrink,
                        "maxWaitSeconds": p.max_wait.as_secs_f64(),
                        "models": models_json(p),
                        "apiKeys": p.api_keys.iter().map(|k| serde_json::json!({
                            "name": k.name,
                            "tpm": k.limits.tpm, "rpm": k.limits.rpm, "rpd": k.limits.rpd,
                            "itpm": k.limits.itpm, "otpm": k.limits.otpm,
                        })).collect::<Vec<_>>(),
                    }),
                )
            })
            .collect();
        serde_json::json!({ "providers": providers })
    }
}

/// `models` of `/limits`: per group, its patterns and limits.
fn models_json(p: &ProviderConfig) -> serde_json::Value {
    let mut groups = serde_json::Map::new();
    for m in &p.models {
        let entry = groups.entry(m.group.clone()).or_insert_with(|| {
            serde_json::json!({
                "patterns": [],
                "tpm": m.limits.tpm, "rpm": m.limits.rpm, "rpd": m.limits.rpd,
                "itpm": m.limits.itpm, "otpm": m.limits.otpm,
            })
        });
        if let Some(list) = entry.get_mut("patterns").and_then(|l| l.as_array_mut()) {
            list.push(serde_json::json!(m.pattern));
        }
    }
    serde_json::Value::Object(groups)
}

/// One thing wrong with a pace config, at a key path such as
/// `providers.openai.rateLimits.tpm` (the same shape as a policy's problems).
pub use sluice_core::Problem;

/// Why a config was not accepted (or not saved).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file could not be read.
    #[error("{file}: {source}")]
    Read {
        /// The file.
        file: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The YAML does not have the config's shape (the message has the line
    /// and column).
    #[error("{file}: {message}")]
    Parse {
        /// The file.
        file: PathBuf,
        /// The parser's message.
        message: String,
    },
    /// The YAML has the right shape but wrong values.
    #[error("{file}: {} problem(s):\n{}", problems.len(), problems.iter().map(|p| format!("  {p}")).collect::<Vec<_>>().join("\n"))]
    Invalid {
        /// The file.
        file: PathBuf,
        /// Every problem found, each with its key path.
        problems: Vec<Problem>,
    },
    /// The settings page's file could not be written.
    #[error("{file}: cannot save: {source}")]
    Write {
        /// The file.
        file: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
}

impl ConfigError {
    /// The problems, when the config parsed but did not validate.
    pub fn problems(&self) -> &[Problem] {
        match self {
            ConfigError::Invalid { problems, .. } => problems,
            _ => &[],
        }
    }
}

/// Reads, parses and validates the config at `path`, then applies the
/// settings page's overrides file next to it ([`overrides_path`]) if present.
///
/// # Errors
/// [`ConfigError`] naming the file, the key path and (for YAML errors) the
/// line.
pub fn load(path: &Path) -> Result<PaceConfig, ConfigError> {
    load_with_env(path, &|name| std::env::var(name).ok())
}

/// [`load`] with variables looked up by `env` instead of the process
/// environment.
///
/// # Errors
/// As [`load`].
pub fn load_with_env(
    path: &Path,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<PaceConfig, ConfigError> {
    let text = read(path)?;
    let mut config = parse_str_with_env(&text, path, env)?;
    let over = overrides_path(path);
    match std::fs::read_to_string(&over) {
        Ok(text) => apply_overrides(&mut config, &text, &over)?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(source) => return Err(ConfigError::Read { file: over, source }),
    }
    Ok(config)
}

fn read(path: &Path) -> Result<String, ConfigError> {
    std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        file: path.to_owned(),
        source,
    })
}

/// Parses and validates config YAML (no overrides); `file` names it in
/// errors.
///
/// # Errors
/// [`ConfigError::Parse`] or [`ConfigError::Invalid`].
pub fn parse_str(text: &str, file: &Path) -> Result<PaceConfig, ConfigError> {
    parse_str_with_env(text, file, &|name| std::env::var(name).ok())
}

/// [`parse_str`] with variables looked up by `env`.
///
/// # Errors
/// As [`parse_str`].
pub fn parse_str_with_env(
    text: &str,
    file: &Path,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<PaceConfig, ConfigError> {
    let raw: RawConfig = serde_saphyr::from_str(text).map_err(|e| ConfigError::Parse {
        file: file.to_owned(),
        message: e.to_string(),
    })?;
    validate(&raw, env).map_err(|problems| ConfigError::Invalid {
        file: file.to_owned(),
        problems,
    })
}

fn apply_overrides(config: &mut PaceConfig, text: &str, file: &Path) -> Result<(), ConfigError> {
    let raw: RawOverrides = serde_saphyr::from_str(text).map_err(|e| ConfigError::Parse {
        file: file.to_owned(),
        message: e.to_string(),
    })?;
    let mut problems = Vec::new();
    for (name, o) in &raw.providers {
        let path = format!("providers.{name}.rateLimits");
        let Some(p) = config.providers.get_mut(name) else {
            problems.push(Problem {
                path: format!("providers.{name}"),
                message: "not a provider of the config file".into(),
            });
            continue;
        };
        let limits = check_limits(&path, Some(&o.rate_limits), None, &mut problems);
        if let Some(mut l) = limits {
            // A file written before the input/output axes keeps the config's.
            if o.rate_limits.itpm.is_none() {
                l.itpm = p.limits.itpm;
            }
            if o.rate_limits.otpm.is_none() {
                l.otpm = p.limits.otpm;
            }
            p.limits = l;
            for k in &mut p.api_keys {
                k.follow(l);
            }
            p.origin = LimitsOrigin::Settings;
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(ConfigError::Invalid {
            file: file.to_owned(),
            problems,
        })
    }
}

fn check_limits(
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

fn check_provider(
    name: &str,
    base: &str,
    entry: &RawProvider,
    env: &dyn Fn(&str) -> Option<String>,
    problems: &mut Vec<Problem>,
) -> Option<ProviderConfig> {
    let before = problems.len();
    let known = shipped(name);
    let mut text = |key: &str, v: &Option<String>| -> Option<String> {
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
    };
    let api_key = text("apiKey", &entry.api_key).filter(|k| !k.is_empty());
    let base_url = text("baseUrl", &entry.base_url);
    let style = match entry.style.as_deref() {
        None => known.map_or(ApiStyle::OpenAi, |k| k.style),
        Some(s) => ApiStyle::parse(s).unwrap_or_else(|| {
            problems.push(Problem {
                path: format!("{base}.style"),
                message: format!("`{s}` is not a style (expected `openai` or `anthropic`)"),
            });
            ApiStyle::OpenAi
        }),
    };
    let base_url = match (base_url, known) {
        (Some(u), _) => u,
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
    let auth_header = match &entry.auth_header {
        None => style.default_auth_header(),
        Some(h) => HeaderName::from_bytes(h.to_ascii_lowercase().as_bytes()).unwrap_or_else(|_| {
            problems.push(Problem {
                path: format!("{base}.authHeader"),
                message: format!("`{h}` is not a header name"),
            });
            style.default_auth_header()
        }),
    };
    let (limits, origin) = match &entry.rate_limits {
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
    };
    let max_wait = match entry.max_wait_seconds {
        None => DEFAULT_MAX_WAIT,
        Some(s) if s.is_finite() && s > 0.0 && s <= 86_400.0 => Duration::from_secs_f64(s),
        Some(s) => {
            problems.push(Problem {
                path: format!("{base}.maxWaitSeconds"),
                message: format!("{s} is not a number of seconds in (0, 86400]"),
            });
            DEFAULT_MAX_WAIT
        }
    };
    let default_max_tokens = match entry.default_max_tokens {
        None => DEFAULT_MAX_TOKENS,
        Some(0) => {
            problems.push(Problem {
                path: format!("{base}.defaultMaxTokens"),
                message: "must be at least 1".into(),
            });
            DEFAULT_MAX_TOKENS
        }
        Some(n) => n,
    };
    let encoding = match entry.encoding.as_deref() {
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
    };
    check_io(
        &format!("{base}.rateLimits"),
        entry.rate_limits.as_ref(),
        style,
        problems,
    );
    let interactive_reserve = match entry.interactive_reserve_seconds {
        None => DEFAULT_INTERACTIVE_RESERVE,
        Some(s) if s.is_finite() && (0.0..=60.0).contains(&s) => Duration::from_secs_f64(s),
        Some(s) => {
            problems.push(Problem {
                path: format!("{base}.interactiveReserveSeconds"),
                message: format!("{s} is not a number of seconds in [0, 60]"),
            });
            DEFAULT_INTERACTIVE_RESERVE
        }
    };
    let models = entry
        .models
        .as_ref()
        .map(|m| check_models(base, m, style, problems))
        .unwrap_or_default();
    let api_keys = match (&entry.api_keys, limits) {
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
    };
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
        let own =
            [r.tpm, r.rpm, r.rpd, r.itpm, r.otpm].map(|v| v.and_then(|v| u32::try_from(v).ok()));
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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn env(name: &str) -> Option<String> {
        (name == "OPENAI_API_KEY").then(|| "sk-test".to_owned())
    }

    fn parse(text: &str) -> Result<PaceConfig, ConfigError> {
        parse_str_with_env(text, Path::new("pace.yaml"), &env)
    }

    #[test]
    fn c1_seed_config_shape_parses() {
        let c = parse(
            "providers:\n  openai:\n    apiKey: ${OPENAI_API_KEY}\n    rateLimits:\n      tpm: 150000\n      rpm: 60\n      rpd: 0\n",
        )
        .unwrap();
        let o = c.provider("openai").unwrap();
        assert_eq!(o.api_key.as_deref(), Some("sk-test"));
        assert_eq!(o.base_url, "https://api.openai.com/v1");
        assert_eq!(o.limits, ProviderLimits::new(150_000, 60, 0));
        assert_eq!(o.origin, LimitsOrigin::Config);
        assert_eq!(o.auth_value("k"), "Bearer k");
        assert!(!format!("{o:?}").contains("sk-test"));
    }

    #[test]
    fn c1_shipped_defaults_fill_missing_limits() {
        let c = parse("providers:\n  groq:\n  anthropic:\n    rateLimits: {tpm: 1000}\n").unwrap();
        let g = c.provider("groq").unwrap();
        assert_eq!(g.limits, ProviderLimits::new(30_000, 30, 14_400));
        assert_eq!(g.origin, LimitsOrigin::Shipped);
        let a = c.provider("anthropic").unwrap();
        assert_eq!(a.limits, ProviderLimits::new(1000, 50, 0));
        assert_eq!(a.style, ApiStyle::Anthropic);
        assert_eq!(a.auth_header.as_str(), "x-api-key");
        assert_eq!(a.auth_value("k"), "k");
    }

    #[test]
    fn c1_missing_env_names_variable_and_key_path() {
        let e = parse("providers:\n  anthropic:\n    apiKey: ${ANTHROPIC_API_KEY}\n").unwrap_err();
        let text = e.to_string();
        assert!(text.contains("pace.yaml"), "{text}");
        assert!(text.contains("providers.anthropic.apiKey"), "{text}");
        assert!(text.contains("ANTHROPIC_API_KEY"), "{text}");
    }

    #[test]
    fn c1_unknown_fields_and_bad_values_are_refused_with_paths() {
        let e = parse("providers:\n  openai:\n    rateLimit: {tpm: 1}\n").unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("rateLimit") && text.contains("line"),
            "{text}"
        );
        let e = parse("providers:\n  mine:\n    rateLimits: {tpm: 1}\n").unwrap_err();
        let paths: Vec<_> = e.problems().iter().map(|p| p.path.as_str()).collect();
        assert_eq!(
            paths,
            [
                "providers.mine.baseUrl",
                "providers.mine.rateLimits.rpm",
                "providers.mine.rateLimits.rpd"
            ]
        );
        let e = parse("providers:\n  x:\n    baseUrl: ftp://a\n    rateLimits: {tpm: 0, rpm: 0, rpd: 0}\n    style: grpc\n").unwrap_err();
        let paths: Vec<_> = e.problems().iter().map(|p| p.path.as_str()).collect();
        assert_eq!(paths, ["providers.x.style", "providers.x.baseUrl"]);
    }

    #[test]
    fn m1_models_parse_with_patterns_and_shared_groups() {
        let c = parse(
            "providers:\n  openai:\n    models:\n      gpt-4o: {rateLimits: {tpm: 30000, rpm: 500}}\n      \"gpt-4o-mini*\": {shared: small, rateLimits: {tpm: 200000}}\n      \"gpt-3.5*\": {shared: small}\n",
        )
        .unwrap();
        let o = c.provider("openai").unwrap();
        assert_eq!(
            o.limits,
            ProviderLimits::new(150_000, 60, 0),
            "provider-wide stay"
        );
        let m = o.model("gpt-4o").unwrap();
        assert_eq!(m.limits, ProviderLimits::new(30_000, 500, 0));
        assert_eq!(o.model("gpt-3.5-turbo").unwrap().group, "small");
        assert_eq!(
            o.model("gpt-3.5-turbo").unwrap().limits,
            ProviderLimits::new(200_000, 0, 0)
        );
        assert!(o.model("o1").is_none());
        let j = c.limits_json();
        assert_eq!(j["providers"]["openai"]["models"]["small"]["tpm"], 200_000);
        assert_eq!(
            j["providers"]["openai"]["models"]["small"]["patterns"]
                .as_array()
                .unwrap()
                .len(),
            2
        );
    }

    #[test]
    fn m1_two_patterns_matching_one_model_with_different_limits_are_an_error() {
        let e = parse(
            "providers:\n  openai:\n    models:\n      \"gpt-4o*\": {rateLimits: {tpm: 30000}}\n      \"gpt*mini\": {rateLimits: {tpm: 1000}}\n      \"claude*\": {rateLimits: {tpm: 5}}\n",
        )
        .unwrap_err();
        let p = e.problems();
        assert_eq!(p.len(), 1, "{e}");
        assert!(p[0].path.starts_with("providers.openai.models."), "{e}");
        assert!(
            p[0].message.contains("gpt-4o*") && p[0].message.contains("gpt*mini"),
            "{e}"
        );
        // Same limits, or one shared group: fine.
        parse("providers:\n  openai:\n    models:\n      \"gpt-4o*\": {rateLimits: {tpm: 1}}\n      \"*mini\": {rateLimits: {tpm: 1}}\n").unwrap();
        parse("providers:\n  openai:\n    models:\n      \"gpt-4o*\": {shared: g, rateLimits: {tpm: 1}}\n      \"*mini\": {shared: g}\n").unwrap();
    }

    #[test]
    fn m1_bad_model_entries_are_named() {
        let e = parse(
            "providers:\n  openai:\n    models:\n      a: {}\n      b: {shared: nobody}\n      c: {shared: g, rateLimits: {tpm: 1}}\n      d: {shared: g, rateLimits: {tpm: 2}}\n      e: {rateLimits: {tpm: 1, bogus: 2}}\n",
        );
        // An unknown key is a parse error naming it.
        assert!(e.unwrap_err().to_string().contains("bogus"));
        let e = parse(
            "providers:\n  openai:\n    models:\n      a: {}\n      b: {shared: nobody}\n      c: {shared: g, rateLimits: {tpm: 1}}\n      d: {shared: g, rateLimits: {tpm: 2}}\n",
        )
        .unwrap_err();
        let paths: Vec<_> = e.problems().iter().map(|p| p.path.as_str()).collect();
        assert_eq!(
            paths,
            [
                "providers.openai.models.a",
                "providers.openai.models.d.rateLimits",
                "providers.openai.models.b.shared"
            ],
            "{e}"
        );
    }

    #[test]
    fn m2_itpm_and_otpm_parse_and_an_otpm_alone_is_refused_where_both_are_counted() {
        let c = parse(
            "providers:\n  anthropic:\n    rateLimits: {tpm: 0, itpm: 40000, otpm: 8000}\n    models:\n      \"claude-*-haiku*\": {rateLimits: {itpm: 100000, otpm: 20000}}\n",
        )
        .unwrap();
        let a = c.provider("anthropic").unwrap();
        assert_eq!(
            a.limits,
            ProviderLimits::new(0, 50, 0).with_io(40_000, 8_000)
        );
        assert_eq!(
            a.model("claude-3-5-haiku-latest").unwrap().limits,
            ProviderLimits::new(0, 0, 0).with_io(100_000, 20_000)
        );
        let e = parse(
            "providers:\n  anthropic:\n    rateLimits: {otpm: 8000}\n    models:\n      m: {rateLimits: {otpm: 1}}\n",
        )
        .unwrap_err();
        let paths: Vec<_> = e.problems().iter().map(|p| p.path.as_str()).collect();
        assert_eq!(
            paths,
            [
                "providers.anthropic.rateLimits.otpm",
                "providers.anthropic.models.m.rateLimits.otpm"
            ],
            "{e}"
        );
        // A provider counting tokens together may cap output alone.
        parse("providers:\n  openai:\n    rateLimits: {otpm: 8000}\n").unwrap();
    }

    #[test]
    fn m4_api_keys_parse_with_their_limits_and_an_unset_variable_is_named() {
        let c = parse(
            "providers:\n  openai:\n    rateLimits: {tpm: 1000, rpm: 10}\n    apiKeys:\n      - key: ${OPENAI_API_KEY}\n        name: main\n      - key: sk-literal\n        rateLimits: {tpm: 5000}\n",
        )
        .unwrap();
        let o = c.provider("openai").unwrap();
        assert_eq!(o.api_keys.len(), 2);
        assert_eq!(o.api_keys[0].name, "main");
        assert_eq!(o.api_keys[0].limits, ProviderLimits::new(1000, 10, 0));
        assert_eq!(o.api_keys[1].name, "key2");
        assert_eq!(o.api_keys[1].limits, ProviderLimits::new(5000, 10, 0));
        let shown = format!("{o:?} {}", c.limits_json());
        assert!(
            !shown.contains("sk-test") && !shown.contains("sk-literal"),
            "{shown}"
        );
        let e = parse(
            "providers:\n  openai:\n    apiKey: x\n    apiKeys:\n      - key: ${NOT_SET_ANYWHERE}\n      - key: a\n        name: main\n      - key: b\n        name: main\n",
        )
        .unwrap_err();
        let text = e.to_string();
        let paths: Vec<_> = e.problems().iter().map(|p| p.path.as_str()).collect();
        assert_eq!(
            paths,
            [
                "providers.openai.apiKeys",
                "providers.openai.apiKeys[0].key",
                "providers.openai.apiKeys[2].name"
            ],
            "{text}"
        );
        assert!(text.contains("NOT_SET_ANYWHERE"), "{text}");
    }

    #[test]
    fn m1_the_example_pace_config_parses() {
        let text = include_str!("../../../../examples/pace.yaml");
        let c = parse_str_with_env(text, Path::new("examples/pace.yaml"), &|name| {
            name.ends_with("_API_KEY").then(|| "sk-example".to_owned())
        })
        .unwrap();
        let o = c.provider("openai").unwrap();
        assert_eq!(o.model("gpt-3.5-turbo-0125").unwrap().group, "small");
    }

    #[test]
    fn m3_interactive_reserve_seconds_parses_and_is_bounded() {
        let c = parse("providers:\n  openai:\n    interactiveReserveSeconds: 10\n").unwrap();
        let o = c.provider("openai").unwrap();
        assert_eq!(o.interactive_reserve, Duration::from_secs(10));
        let c = parse("providers:\n  openai:\n").unwrap();
        assert_eq!(
            c.provider("openai").unwrap().interactive_reserve,
            DEFAULT_INTERACTIVE_RESERVE
        );
        let e = parse("providers:\n  openai:\n    interactiveReserveSeconds: -1\n").unwrap_err();
        let paths: Vec<_> = e.problems().iter().map(|p| p.path.as_str()).collect();
        assert_eq!(paths, ["providers.openai.interactiveReserveSeconds"]);
    }

    #[test]
    fn m2_the_settings_page_s_overrides_keep_itpm_and_otpm() {
        let dir = std::env::temp_dir().join(format!("sluice-m2-overrides-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("pace.yaml");
        std::fs::write(
            &file,
            "providers:\n  anthropic:\n    rateLimits: {tpm: 0, itpm: 40000, otpm: 8000}\n",
        )
        .unwrap();
        // An overrides file of before the axes: the config's itpm/otpm stay.
        std::fs::write(
            overrides_path(&file),
            "providers:\n  anthropic:\n    rateLimits: { tpm: 0, rpm: 10, rpd: 0 }\n",
        )
        .unwrap();
        let c = load_with_env(&file, &env).unwrap();
        let a = c.provider("anthropic").unwrap();
        assert_eq!(
            a.limits,
            ProviderLimits::new(0, 10, 0).with_io(40_000, 8_000)
        );
        // An edit saved by the page keeps them too.
        let watcher = ConfigWatcher::open(&file).unwrap();
        watcher
            .save_limits(
                "anthropic",
                ProviderLimits::new(0, 20, 0).with_io(30_000, 6_000),
            )
            .unwrap();
        let c = load_with_env(&file, &env).unwrap();
        assert_eq!(
            c.provider("anthropic").unwrap().limits,
            ProviderLimits::new(0, 20, 0).with_io(30_000, 6_000)
        );
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn m4_keys_follow_the_settings_page_on_the_axes_they_do_not_set() {
        let c = parse(
            "providers:\n  openai:\n    rateLimits: {tpm: 1000, rpm: 10}\n    apiKeys:\n      - key: a\n      - key: b\n        rateLimits: {tpm: 5000}\n",
        )
        .unwrap();
        let source = StaticLimits::new(c);
        source
            .save_limits("openai", ProviderLimits::new(2000, 20, 0))
            .unwrap();
        let c = source.current();
        let keys = &c.provider("openai").unwrap().api_keys;
        assert_eq!(keys[0].limits, ProviderLimits::new(2000, 20, 0));
        assert_eq!(keys[1].limits, ProviderLimits::new(5000, 20, 0));
    }
}
