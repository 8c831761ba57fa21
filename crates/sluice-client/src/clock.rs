//! A [`Clock`] that follows tokio's time, so that the pacer's books and its
//! waits agree — and so that tests with `#[tokio::test(start_paused = true)]`
//! drive both with `tokio::time::advance`.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sluice_core::{Clock, Timestamp};
use tokio::time::Instant;

/// A fixed Unix time for tests and benchmarks to start a [`TokioClock`] at
/// (`TokioClock::at(TEST_EPOCH)`): 2025-11-30T00:00:00Z, a whole minute, so
/// that the pacer's windows and slots start at known instants and runs on
/// tokio's paused clock give the same numbers every time. Programs use
/// [`TokioClock::system`] instead.
pub const TEST_EPOCH: Timestamp = Timestamp::from_secs(1_764_460_800);

/// Unix time read from [`tokio::time::Instant`]: a fixed Unix instant at
/// construction, advanced by tokio's monotonic clock.
///
/// When tokio's clock is paused (tests), this clock stops with it and moves
/// when the test advances time, so a pacer's computed waits and the time its
/// books read are one and the same. Clones share the anchor.
#[derive(Clone, Copy, Debug)]
pub struct TokioClock {
    anchor_unix: Timestamp,
    anchor: Instant,
}

impl TokioClock {
    /// A clock reading `unix` now (tests start at a fixed instant).
    ///
    /// # Panics
    /// Outside a tokio runtime when tokio's `test-util` pause is in use, as
    /// [`tokio::time::Instant::now`] does.
    pub fn at(unix: Timestamp) -> Self {
        TokioClock {
            anchor_unix: unix,
            anchor: Instant::now(),
        }
    }

    /// A clock reading the current wall-clock time now.
    pub fn system() -> Self {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
            .unwrap_or(0);
        Self::at(Timestamp::from_nanos(nanos))
    }

    /// The tokio instant at which this clock reads `t` (now, if `t` is past).
    pub fn instant_at(&self, t: Timestamp) -> Instant {
        self.anchor + t.saturating_since(self.anchor_unix)
    }

    /// How long from now until this clock reads `t` (zero if past).
    pub fn until(&self, t: Timestamp) -> Duration {
        t.saturating_since(self.now())
    }
}

impl Clock for TokioClock {
    fn now(&self) -> Timestamp {
        self.anchor_unix
            .saturating_add(Instant::now().saturating_duration_since(self.anchor))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn follows_paused_tokio_time() {
        let clock = TokioClock::at(TEST_EPOCH);
        assert_eq!(clock.now(), TEST_EPOCH);
        tokio::time::advance(Duration::from_millis(1500)).await;
        assert_eq!(
            clock.now(),
            TEST_EPOCH.saturating_add(Duration::from_millis(1500))
        );
        let at = TEST_EPOCH.saturating_add(Duration::from_secs(3));
        assert_eq!(clock.until(at), Duration::from_millis(1500));
        tokio::time::sleep_until(clock.instant_at(at)).await;
        assert_eq!(clock.now(), at);
    }
}
