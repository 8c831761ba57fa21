//! How a lane is configured: [`LaneConfig`] and what [`Lane::new`] checks.
//!
//! [`Lane::new`]: crate::Lane::new

use std::num::NonZeroU32;
use std::time::Duration;

use sluice_core::BreakerConfig;

/// The limits, bounds and timings of one lane.
///
/// [`LaneConfig::default`] holds the numbers of an expensive upstream whose
/// calls take one to two minutes: per workspace 3 running and 12 started in
/// any 60 s, 20 in flight across all workspaces of which 5 are never given to
/// batch items, a line of at most 256 waiting calls (32 per workspace), a
/// breaker that opens for 30 s after 5 failures in a row within 60 s, and a
/// 3-minute upstream timeout.
///
/// Fields are public to read and to set one by one; the `with_*` methods
/// chain. [`Lane::new`](crate::Lane::new) checks the whole.
///
/// ```
/// use std::time::Duration;
/// use sluice_lanes::LaneConfig;
///
/// let config = LaneConfig::default()
///     .with_global_cap(40)
///     .with_batch_reserve(10)
///     .with_upstream_timeout(Duration::from_secs(120));
/// assert_eq!(config.workspace_in_flight, 3);
/// assert_eq!(config.global_cap, 40);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct LaneConfig {
    /// Single calls of one workspace running at once (default 3).
    pub workspace_in_flight: u32,
    /// Single calls of one workspace started in any [`start_window`]
    /// (default 12). The window rolls: a start counts until exactly
    /// `start_window` after it.
    ///
    /// [`start_window`]: LaneConfig::start_window
    pub workspace_starts: u32,
    /// The rolling window of [`workspace_starts`](LaneConfig::workspace_starts)
    /// (default 60 s).
    pub start_window: Duration,
    /// Calls in flight across all workspaces, single calls and batch items
    /// together (default 20).
    pub global_cap: u32,
    /// Places of the global cap never given to batch items (default 5): at
    /// most `global_cap - batch_reserve` batch items run at once, so single
    /// calls always find room beside a long batch.
    pub batch_reserve: u32,
    /// Calls waiting in line across all workspaces (default 256). Past it a
    /// call is refused at once with the limit that holds it.
    pub max_waiting: usize,
    /// Calls of one workspace waiting in line (default 32), so that one
    /// workspace cannot fill the whole line. Past it a call is refused at once.
    pub max_waiting_per_workspace: usize,
    /// When the breaker opens and for how long (default: 5 failures in a row
    /// within 60 s open it for 30 s).
    pub breaker: BreakerConfig,
    /// The longest the upstream may take for one call (default 180 s). The
    /// lane does not run the call: the caller cuts it at this timeout and
    /// reports it as [`Outcome::Failure`](crate::Outcome::Failure).
    pub upstream_timeout: Duration,
    /// How long a call is expected to hold its place before any call has
    /// finished (default 90 s); afterwards a moving average of finished calls
    /// is used.
    pub expected_duration: Duration,
    /// The shortest estimated retry-after (default 5 s).
    pub min_retry_estimate: Duration,
    /// The longest estimated retry-after (default 75 s).
    pub max_retry_estimate: Duration,
    /// On a lane with a shared ledger: how long after the ledger refused a
    /// place (another replica holds it) the lane asks again (default
    /// 250 ms). A place freed on another replica is seen at most this late;
    /// the ledger is asked at most about `global_cap` times per interval.
    pub lease_retry: Duration,
}

impl Default for LaneConfig {
    fn default() -> Self {
        LaneConfig {
            workspace_in_flight: 3,
            workspace_starts: 12,
            start_window: Duration::from_secs(60),
            global_cap: 20,
            batch_reserve: 5,
            max_waiting: 256,
            max_waiting_per_workspace: 32,
            breaker: BreakerConfig::new(5, Duration::from_secs(60), Duration::from_secs(30)),
            upstream_timeout: Duration::from_secs(180),
            expected_duration: Duration::from_secs(90),
            min_retry_estimate: Duration::from_secs(5),
            max_retry_estimate: Duration::from_secs(75),
            lease_retry: Duration::from_millis(250),
        }
    }
}

impl LaneConfig {
    /// The defaults (see the type's docs).
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets [`workspace_in_flight`](LaneConfig::workspace_in_flight).
    #[must_use]
    pub fn with_workspace_in_flight(mut self, n: u32) -> Self {
        self.workspace_in_flight = n;
        self
    }

    /// Sets [`workspace_starts`](LaneConfig::workspace_starts) per `window`.
    #[must_use]
    pub fn with_workspace_starts(mut self, n: u32, window: Duration) -> Self {
        self.workspace_starts = n;
        self.start_window = window;
        self
    }

    /// Sets [`global_cap`](LaneConfig::global_cap).
    #[must_use]
    pub fn with_global_cap(mut self, n: u32) -> Self {
        self.global_cap = n;
        self
    }

    /// Sets [`batch_reserve`](LaneConfig::batch_reserve).
    #[must_use]
    pub fn with_batch_reserve(mut self, n: u32) -> Self {
        self.batch_reserve = n;
        self
    }

    /// Sets [`max_waiting`](LaneConfig::max_waiting) and
    /// [`max_waiting_per_workspace`](LaneConfig::max_waiting_per_workspace).
    #[must_use]
    pub fn with_max_waiting(mut self, total: usize, per_workspace: usize) -> Self {
        self.max_waiting = total;
        self.max_waiting_per_workspace = per_workspace;
        self
    }

    /// Sets [`breaker`](LaneConfig::breaker).
    #[must_use]
    pub fn with_breaker(mut self, breaker: BreakerConfig) -> Self {
        self.breaker = breaker;
        self
    }

    /// Sets [`upstream_timeout`](LaneConfig::upstream_timeout).
    #[must_use]
    pub fn with_upstream_timeout(mut self, timeout: Duration) -> Self {
        self.upstream_timeout = timeout;
        self
    }

    /// Sets [`expected_duration`](LaneConfig::expected_duration).
    #[must_use]
    pub fn with_expected_duration(mut self, d: Duration) -> Self {
        self.expected_duration = d;
        self
    }

    /// Sets the bounds of estimated retry-after values.
    #[must_use]
    pub fn with_retry_estimate_bounds(mut self, min: Duration, max: Duration) -> Self {
        self.min_retry_estimate = min;
        self.max_retry_estimate = max;
        self
    }

    /// Sets [`lease_retry`](LaneConfig::lease_retry).
    #[must_use]
    pub fn with_lease_retry(mut self, every: Duration) -> Self {
        self.lease_retry = every;
        self
    }

    /// The per-workspace limits every workspace has unless a call names its
    /// own ([`Lane::acquire_within`](crate::Lane::acquire_within)).
    pub fn workspace_limits(&self) -> WorkspaceLimits {
        let nonzero = |n: u32| NonZeroU32::new(n).unwrap_or(NonZeroU32::MIN);
        WorkspaceLimits {
            in_flight: nonzero(self.workspace_in_flight),
            starts: nonzero(self.workspace_starts),
        }
    }

    /// Batch items that may run at once: `global_cap - batch_reserve`.
    pub fn batch_cap(&self) -> u32 {
        self.global_cap.saturating_sub(self.batch_reserve)
    }

    /// Checks the whole configuration.
    ///
    /// # Errors
    /// [`ConfigError`] naming the first field that cannot work.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let nonzero = [
            ("workspace_in_flight", self.workspace_in_flight),
            ("workspace_starts", self.workspace_starts),
            ("global_cap", self.global_cap),
            ("breaker.failures", self.breaker.failures),
        ];
        for (field, n) in nonzero {
            if n == 0 {
                return Err(ConfigError::Zero(field));
            }
        }
        let durations = [
            ("start_window", self.start_window),
            ("upstream_timeout", self.upstream_timeout),
            ("breaker.open_for", self.breaker.open_for),
            ("lease_retry", self.lease_retry),
        ];
        for (field, d) in durations {
            if d.is_zero() {
                return Err(ConfigError::Zero(field));
            }
        }
        if self.batch_reserve > self.global_cap {
            return Err(ConfigError::ReserveAboveCap {
                reserve: self.batch_reserve,
                cap: self.global_cap,
            });
        }
        if self.min_retry_estimate > self.max_retry_estimate {
            return Err(ConfigError::EstimateBounds);
        }
        Ok(())
    }
}

/// One workspace's limits in a lane: single calls running at once, and
/// single calls started in any [`LaneConfig::start_window`] (the window is
/// the lane's, the same for every workspace).
///
/// A lane's own limits ([`LaneConfig::workspace_limits`]) apply to every
/// workspace; a caller that knows a workspace's own (from its plan) passes
/// them with each call ([`Lane::acquire_within`](crate::Lane::acquire_within)).
///
/// ```
/// use std::num::NonZeroU32;
/// use sluice_lanes::{LaneConfig, WorkspaceLimits};
///
/// let pro = WorkspaceLimits::new(NonZeroU32::new(10).unwrap(), NonZeroU32::new(60).unwrap());
/// assert_eq!(LaneConfig::default().workspace_limits().in_flight.get(), 3);
/// assert_eq!(pro.starts.get(), 60);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct WorkspaceLimits {
    /// Single calls of the workspace running at once.
    pub in_flight: NonZeroU32,
    /// Single calls of the workspace started in any start window.
    pub starts: NonZeroU32,
}

impl WorkspaceLimits {
    /// `in_flight` running at once and `starts` started per start window.
    pub fn new(in_flight: NonZeroU32, starts: NonZeroU32) -> Self {
        WorkspaceLimits { in_flight, starts }
    }
}

/// A [`LaneConfig`] that cannot work.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A limit or duration that must be above zero is zero.
    #[error("lane config: `{0}` must be above zero")]
    Zero(&'static str),
    /// More places reserved from batch items than there are.
    #[error("lane config: `batch_reserve` ({reserve}) is above `global_cap` ({cap})")]
    ReserveAboveCap {
        /// The configured reserve.
        reserve: u32,
        /// The configured global cap.
        cap: u32,
    },
    /// `min_retry_estimate` is above `max_retry_estimate`.
    #[error("lane config: `min_retry_estimate` is above `max_retry_estimate`")]
    EstimateBounds,
}
