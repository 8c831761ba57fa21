//! A provider's limits per axis, and where the limits in force come from.

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
    /// Tokens per day (rolling 24 h), where the provider sets one: the
    /// request's tokens (prompt and completion budget) spend it, its
    /// answer's usage settles it.
    pub tpd: u32,
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
            tpd: 0,
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

    /// The same limits with `tpd` tokens a day (0 = unlimited).
    ///
    /// ```
    /// use sluice_client::config::ProviderLimits;
    ///
    /// let l = ProviderLimits::new(6_000, 30, 14_400).with_tpd(500_000);
    /// assert_eq!(l.tpd, 500_000);
    /// ```
    #[must_use]
    pub const fn with_tpd(mut self, tpd: u32) -> Self {
        self.tpd = tpd;
        self
    }

    /// Whether no axis is limited.
    pub const fn is_unlimited(&self) -> bool {
        self.tpm == 0
            && self.rpm == 0
            && self.rpd == 0
            && self.itpm == 0
            && self.otpm == 0
            && self.tpd == 0
    }

    /// No limit on any axis.
    pub const UNLIMITED: ProviderLimits = ProviderLimits::new(0, 0, 0);
}

/// Where a provider's effective limits come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LimitsOrigin {
    /// The shipped table ([`SHIPPED_PROVIDERS`](super::SHIPPED_PROVIDERS)).
    Shipped,
    /// The config file's `rateLimits`.
    Config,
    /// The settings page (the overrides file).
    Settings,
}
