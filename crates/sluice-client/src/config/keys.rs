//! `apiKeys:` under a provider: several keys, each with its own limits. The
//! pacer sends a request with the key that can send it soonest.

use std::fmt;

use super::limits::ProviderLimits;

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
    /// The axes its own `rateLimits` gives (the others follow the
    /// provider's, also when the settings page changes them).
    own: [Option<u32>; 6],
}

impl ApiKey {
    /// A key called `name` with `limits`.
    pub fn new(name: &str, secret: &str, limits: ProviderLimits) -> Self {
        let l = limits;
        ApiKey {
            name: name.to_owned(),
            secret: secret.to_owned(),
            limits,
            own: [l.tpm, l.rpm, l.rpd, l.itpm, l.otpm, l.tpd].map(Some),
        }
    }

    /// A key whose own `rateLimits` give the axes in `own` (tpm, rpm, rpd,
    /// itpm, otpm, tpd), the others taken from `provider`.
    pub(crate) fn inheriting(
        name: String,
        secret: String,
        own: [Option<u32>; 6],
        provider: ProviderLimits,
    ) -> Self {
        let mut key = ApiKey {
            name,
            secret,
            limits: provider,
            own,
        };
        key.follow(provider);
        key
    }

    /// Takes the axes it does not set itself from the provider's `limits`.
    pub(crate) fn follow(&mut self, provider: ProviderLimits) {
        let p = [
            provider.tpm,
            provider.rpm,
            provider.rpd,
            provider.itpm,
            provider.otpm,
            provider.tpd,
        ];
        let [tpm, rpm, rpd, itpm, otpm, tpd] =
            [0, 1, 2, 3, 4, 5].map(|i| self.own[i].unwrap_or(p[i]));
        self.limits = ProviderLimits::new(tpm, rpm, rpd)
            .with_io(itpm, otpm)
            .with_tpd(tpd);
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
