//! `apiKeys:` under a provider: several keys, each with its own limits. The
//! pacer sends a request with the key that can send it soonest.

use std::fmt;

use super::ProviderLimits;

/// One of a provider's keys, checked. Its value never appears in `Debug`,
/// logs, `/status`, `/limits` or the settings page: only its [`ApiKey::name`].
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ApiKey {
    /// What logs and pages call it (`name:`, else `key1`, `key2`, … in
    /// the order written).
    pub name: String,
    /// The key itself (after `${ENV}` substitution).
    pub secret: String,
    /// Its limits (`rateLimits:`, else the provider's).
    pub limits: ProviderLimits,
}

impl ApiKey {
    /// A key called `name` with `limits`.
    pub fn new(name: &str, secret: &str, limits: ProviderLimits) -> Self {
        ApiKey {
            name: name.to_owned(),
            secret: secret.to_owned(),
            limits,
        }
    }
}

impl fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ApiKey")
            .field("name", &self.name)
            .field("secret", &"<redacted>")
            .field("limits", &self.limits)
            .finish()
    }
}
