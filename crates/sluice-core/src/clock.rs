//! Time as a parameter: a [`Timestamp`] type and the [`Clock`] that produces it.
//!
//! The core never reads the time itself. Stores and services hold a [`Clock`]
//! and pass `now` into the pure algorithms, so tests drive time with a
//! [`FakeClock`] instead of sleeping.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Nanoseconds since the Unix epoch (UTC).
///
/// Windows are aligned to the Unix epoch so that every replica agrees on where a
/// window starts and on the `X-RateLimit-Reset` it reports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Timestamp(u64);

const NANOS_PER_SEC: u64 = 1_000_000_000;

impl Timestamp {
    /// The Unix epoch.
    pub const EPOCH: Timestamp = Timestamp(0);

    /// A timestamp from nanoseconds since the Unix epoch.
    #[inline]
    pub const fn from_nanos(nanos: u64) -> Self {
        Timestamp(nanos)
    }

    /// A timestamp from whole seconds since the Unix epoch (saturating).
    #[inline]
    pub const fn from_secs(secs: u64) -> Self {
        Timestamp(secs.saturating_mul(NANOS_PER_SEC))
    }

    /// Nanoseconds since the Unix epoch.
    #[inline]
    pub const fn as_nanos(self) -> u64 {
        self.0
    }

    /// Whole seconds since the Unix epoch (rounded down).
    #[inline]
    pub const fn as_secs(self) -> u64 {
        self.0 / NANOS_PER_SEC
    }

    /// This instant moved forward by `d` (saturating).
    pub fn saturating_add(self, d: Duration) -> Self {
        Timestamp(self.0.saturating_add(duration_nanos(d)))
    }

    /// The time from `earlier` to `self`, or zero if `earlier` is later.
    pub const fn saturating_since(self, earlier: Timestamp) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }
}

/// A duration in nanoseconds, saturating at `u64::MAX` (about 584 years).
pub(crate) fn duration_nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// A source of the current time.
///
/// Implementations must never go backwards by more than the platform's
/// wall-clock adjustments allow; [`SystemClock`] is monotonic.
pub trait Clock: Send + Sync {
    /// The current instant.
    fn now(&self) -> Timestamp;
}

impl<C: Clock + ?Sized> Clock for Arc<C> {
    fn now(&self) -> Timestamp {
        (**self).now()
    }
}

impl<C: Clock + ?Sized> Clock for &C {
    fn now(&self) -> Timestamp {
        (**self).now()
    }
}

/// The real clock: the wall-clock time read once at construction, advanced by
/// the monotonic clock (the CPU's invariant TSC where the platform has one,
/// via `quanta`, else the OS monotonic clock).
///
/// Durations between two readings are monotonic (a wall-clock step does not
/// make budgets refill or stall), while readings stay on the Unix time line
/// so that window boundaries and reset times are in real Unix seconds.
#[derive(Clone, Debug)]
pub struct SystemClock {
    anchor_wall: u64,
    mono: quanta::Clock,
    anchor_mono: quanta::Instant,
}

impl SystemClock {
    /// A clock anchored at the current wall-clock time.
    pub fn new() -> Self {
        let anchor_wall = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(duration_nanos)
            .unwrap_or(0);
        let mono = quanta::Clock::new();
        let anchor_mono = mono.now();
        SystemClock {
            anchor_wall,
            mono,
            anchor_mono,
        }
    }
}

impl SystemClock {
    /// A clock reading `offset_secs` seconds ahead of (or, negative, behind)
    /// the wall clock: a replica with a skewed clock, for tests and drills.
    pub fn with_offset(offset_secs: i64) -> Self {
        let mut clock = SystemClock::new();
        clock.anchor_wall = if offset_secs >= 0 {
            clock
                .anchor_wall
                .saturating_add(offset_secs.unsigned_abs().saturating_mul(NANOS_PER_SEC))
        } else {
            clock
                .anchor_wall
                .saturating_sub(offset_secs.unsigned_abs().saturating_mul(NANOS_PER_SEC))
        };
        clock
    }
}

impl Default for SystemClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for SystemClock {
    #[inline]
    fn now(&self) -> Timestamp {
        Timestamp(self.anchor_wall.saturating_add(duration_nanos(
            self.mono.now().saturating_duration_since(self.anchor_mono),
        )))
    }
}

/// A settable clock for tests: time moves only when the test says so.
///
/// Clones share the same time.
#[derive(Clone, Debug, Default)]
pub struct FakeClock {
    nanos: Arc<AtomicU64>,
}

impl FakeClock {
    /// A fake clock reading `start`.
    pub fn new(start: Timestamp) -> Self {
        FakeClock {
            nanos: Arc::new(AtomicU64::new(start.as_nanos())),
        }
    }

    /// Moves the clock forward by `d`.
    pub fn advance(&self, d: Duration) {
        self.nanos.fetch_add(duration_nanos(d), Ordering::SeqCst);
    }

    /// Sets the clock to `t` (may move it backwards: tests use this to model skew).
    pub fn set(&self, t: Timestamp) {
        self.nanos.store(t.as_nanos(), Ordering::SeqCst);
    }
}

impl Clock for FakeClock {
    fn now(&self) -> Timestamp {
        Timestamp(self.nanos.load(Ordering::SeqCst))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fake_clock_moves_only_when_told() {
        let clock = FakeClock::new(Timestamp::from_secs(100));
        assert_eq!(clock.now(), Timestamp::from_secs(100));
        clock.advance(Duration::from_millis(1500));
        assert_eq!(clock.now().as_nanos(), 101_500_000_000);
        let shared = clock.clone();
        shared.set(Timestamp::from_secs(7));
        assert_eq!(clock.now(), Timestamp::from_secs(7));
    }

    #[test]
    fn an_offset_clock_reads_ahead_or_behind() {
        let ahead = SystemClock::with_offset(30).now().as_secs();
        let plain = SystemClock::new().now().as_secs();
        let behind = SystemClock::with_offset(-30).now().as_secs();
        assert!((29..=31).contains(&(ahead - plain)));
        assert!((29..=31).contains(&(plain - behind)));
    }

    #[test]
    fn system_clock_is_monotonic_and_on_the_unix_line() {
        let clock = SystemClock::new();
        let a = clock.now();
        let b = clock.now();
        assert!(b >= a);
        // 2020-01-01 .. 2200-01-01: a reading on the real Unix time line.
        assert!(a.as_secs() > 1_577_836_800 && a.as_secs() < 7_258_118_400);
    }
}
