//! Documented on [`Breaker`].

use std::time::Duration;

use crate::Timestamp;

/// When a breaker opens and for how long.
///
/// ```
/// use std::time::Duration;
/// use sluice_core::BreakerConfig;
///
/// let config = BreakerConfig::new(5, Duration::from_secs(60), Duration::from_secs(30));
/// assert_eq!(config.failures, 5);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct BreakerConfig {
    /// Consecutive failures that open it.
    pub failures: u32,
    /// Those failures must all fall within this span (from the first).
    pub within: Duration,
    /// How long it stays open before letting a probe through.
    pub open_for: Duration,
}

impl BreakerConfig {
    /// Opens after `failures` failures in a row within `within`, for `open_for`.
    pub const fn new(failures: u32, within: Duration, open_for: Duration) -> Self {
        BreakerConfig {
            failures,
            within,
            open_for,
        }
    }
}

/// Where a breaker stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BreakerState {
    /// Calls go through.
    Closed,
    /// Calls are refused until `until`.
    Open {
        /// When a probe may go through.
        until: Timestamp,
    },
    /// One probe is out since `since`; other calls are refused until it
    /// reports, or until `open_for` has passed (a probe that never reports,
    /// e.g. a cancelled call, does not keep the breaker shut).
    HalfOpen {
        /// When the probe went out.
        since: Timestamp,
    },
}

/// What the breaker says about one call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Permit {
    /// Make the call and report its outcome.
    Call,
    /// Make the call as the half-open probe and report its outcome.
    Probe,
    /// Do not call; the breaker stays open for `retry_after`.
    Refused {
        /// Time left until a probe may go through.
        retry_after: Duration,
    },
}

/// A circuit breaker as a pure state machine: after `failures` failures in a
/// row (all within `within`), calls are refused for `open_for`; then one
/// probe is let through (half-open) and its outcome closes or re-opens the
/// breaker. Used in front of a shared store and of the guarded
/// upstream (5 in a row within a minute, open 30 s).
#[derive(Clone, Debug)]
pub struct Breaker {
    config: BreakerConfig,
    state: BreakerState,
    streak: u32,
    streak_started: Timestamp,
}

impl Breaker {
    /// A closed breaker.
    pub fn new(config: BreakerConfig) -> Self {
        Breaker {
            config,
            state: BreakerState::Closed,
            streak: 0,
            streak_started: Timestamp::EPOCH,
        }
    }

    /// Where it stands at `now` (an open breaker whose time is up reads as
    /// half-open-able but stays `Open` until [`Breaker::permit`] is asked).
    pub fn state(&self) -> BreakerState {
        self.state
    }

    /// May a call go through at `now`?
    pub fn permit(&mut self, now: Timestamp) -> Permit {
        match self.state {
            BreakerState::Closed => Permit::Call,
            BreakerState::Open { until } if now >= until => {
                self.state = BreakerState::HalfOpen { since: now };
                Permit::Probe
            }
            BreakerState::Open { until } => Permit::Refused {
                retry_after: until.saturating_since(now),
            },
            BreakerState::HalfOpen { since }
                if now.saturating_since(since) >= self.config.open_for =>
            {
                self.state = BreakerState::HalfOpen { since: now };
                Permit::Probe
            }
            BreakerState::HalfOpen { since } => Permit::Refused {
                retry_after: self
                    .config
                    .open_for
                    .saturating_sub(now.saturating_since(since)),
            },
        }
    }

    /// A call succeeded: the streak ends and the breaker closes.
    pub fn success(&mut self) {
        self.streak = 0;
        self.state = BreakerState::Closed;
    }

    /// A call failed at `now`.
    pub fn failure(&mut self, now: Timestamp) {
        if let BreakerState::HalfOpen { .. } = self.state {
            self.open(now);
            return;
        }
        if self.streak == 0 || now.saturating_since(self.streak_started) > self.config.within {
            self.streak = 0;
            self.streak_started = now;
        }
        self.streak += 1;
        if self.streak >= self.config.failures {
            self.open(now);
        }
    }

    /// The half-open probe went away without an outcome (the call was
    /// cancelled before the upstream answered): it proves nothing, so the
    /// next call at or after `now` may probe at once instead of waiting out
    /// another `open_for`. Does nothing unless the breaker is half-open.
    pub fn probe_abandoned(&mut self, now: Timestamp) {
        if let BreakerState::HalfOpen { .. } = self.state {
            self.state = BreakerState::Open { until: now };
        }
    }

    fn open(&mut self, now: Timestamp) {
        self.streak = 0;
        self.state = BreakerState::Open {
            until: now.saturating_add(self.config.open_for),
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const L3: BreakerConfig = BreakerConfig {
        failures: 5,
        within: Duration::from_secs(60),
        open_for: Duration::from_secs(30),
    };

    fn at(s: u64) -> Timestamp {
        Timestamp::from_secs(1_000 + s)
    }

    #[test]
    fn five_failures_in_a_row_within_a_minute_open_it_for_30_seconds() {
        let mut b = Breaker::new(L3);
        for i in 0..4 {
            assert_eq!(b.permit(at(i)), Permit::Call);
            b.failure(at(i));
        }
        assert_eq!(b.state(), BreakerState::Closed);
        b.failure(at(10));
        assert_eq!(
            b.permit(at(12)),
            Permit::Refused {
                retry_after: Duration::from_secs(28)
            }
        );
        assert_eq!(b.permit(at(40)), Permit::Probe, "time is up: one probe");
        assert!(
            matches!(b.permit(at(40)), Permit::Refused { .. }),
            "only one probe"
        );
        b.success();
        assert_eq!(b.permit(at(41)), Permit::Call);
    }

    #[test]
    fn a_probe_that_never_reports_does_not_keep_it_shut() {
        let mut b = Breaker::new(L3);
        for i in 0..5 {
            b.failure(at(i));
        }
        assert_eq!(b.permit(at(40)), Permit::Probe);
        assert!(matches!(b.permit(at(50)), Permit::Refused { .. }));
        assert_eq!(
            b.permit(at(70)),
            Permit::Probe,
            "a new probe after open_for"
        );
    }

    #[test]
    fn a_success_or_a_slow_streak_does_not_open_it() {
        let mut b = Breaker::new(L3);
        for i in 0..4 {
            b.failure(at(i));
        }
        b.success();
        b.failure(at(5));
        assert_eq!(b.state(), BreakerState::Closed);
        let mut slow = Breaker::new(L3);
        for i in 0..5 {
            slow.failure(at(i * 20));
        }
        assert_eq!(
            slow.state(),
            BreakerState::Closed,
            "5 failures over 80 s are not in a row within a minute"
        );
    }

    #[test]
    fn an_abandoned_probe_lets_the_next_call_probe_at_once() {
        let mut b = Breaker::new(L3);
        for i in 0..5 {
            b.failure(at(i));
        }
        assert_eq!(b.permit(at(40)), Permit::Probe);
        b.probe_abandoned(at(41));
        assert_eq!(b.permit(at(41)), Permit::Probe);
        assert!(matches!(b.permit(at(41)), Permit::Refused { .. }));
        let mut closed = Breaker::new(L3);
        closed.probe_abandoned(at(1));
        assert_eq!(closed.permit(at(1)), Permit::Call, "closed stays closed");
    }

    #[test]
    fn a_failed_probe_reopens_it() {
        let mut b = Breaker::new(L3);
        for i in 0..5 {
            b.failure(at(i));
        }
        assert_eq!(b.permit(at(35)), Permit::Probe);
        b.failure(at(35));
        assert_eq!(
            b.permit(at(36)),
            Permit::Refused {
                retry_after: Duration::from_secs(29)
            }
        );
    }
}
