//! The whole config ([`PaceConfig`]): the providers and the pacer-wide
//! settings, and the limits as JSON.

use std::collections::BTreeMap;
use std::time::Duration;

use super::defaults::{DEFAULT_ARRIVAL_MARGIN, DEFAULT_MAX_ATTEMPTS, DEFAULT_MAX_BODY_BYTES};
use super::provider::ProviderConfig;

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

/// A checked pace config: from YAML ([`validate`](super::validate())) or in code
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
                        "tpd": p.limits.tpd,
                        "shrink": p.shrink,
                        "maxWaitSeconds": p.max_wait.as_secs_f64(),
                        "models": models_json(p),
                        "apiKeys": p.api_keys.iter().map(|k| serde_json::json!({
                            "name": k.name,
                            "tpm": k.limits.tpm, "rpm": k.limits.rpm, "rpd": k.limits.rpd,
                            "itpm": k.limits.itpm, "otpm": k.limits.otpm, "tpd": k.limits.tpd,
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
                "itpm": m.limits.itpm, "otpm": m.limits.otpm, "tpd": m.limits.tpd,
            })
        });
        if let Some(list) = entry.get_mut("patterns").and_then(|l| l.as_array_mut()) {
            list.push(serde_json::json!(m.pattern));
        }
    }
    serde_json::Value::Object(groups)
}
