//! Holds: "no request on this key before then", kept where the budgets are so
//! that every process on the store honours the same one (SPEC C5, C7: a
//! provider's `Retry-After` stops every process pacing its key, not just the
//! one that got the 429).
//!
//! A hold is written as a length ([`BudgetStore::hold`]) and read as what is
//! left of it ([`BudgetStore::held`]), both on the store's own clock: the
//! Redis store's is the server's, so processes whose clocks disagree still
//! agree on when a hold ends. A hold only ever grows: a shorter one never
//! shortens a longer one. Holds live apart from budgets (a budget and a hold
//! of one [`BudgetKey`] do not meet).
//!
//! ```
//! use std::time::Duration;
//! use sluice_core::{BudgetKey, FakeClock, Timestamp};
//! use sluice_store::{BudgetStore, MemoryConfig, MemoryStore};
//!
//! # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
//! let clock = FakeClock::new(Timestamp::from_secs(1_764_460_800));
//! let store = MemoryStore::with_clock(MemoryConfig::default(), clock.clone());
//! let key = BudgetKey::new("pace-hold", b"openai");
//! store.hold(&key, Duration::from_secs(30)).await.unwrap();
//! store.hold(&key, Duration::from_secs(5)).await.unwrap(); // never shortens it
//! clock.advance(Duration::from_secs(10));
//! assert_eq!(store.held(&[key]).await.unwrap(), [Duration::from_secs(20)]);
//! clock.advance(Duration::from_secs(20));
//! assert_eq!(store.held(&[key]).await.unwrap(), [Duration::ZERO]);
//! # });
//! ```
//!
//! [`BudgetStore::hold`]: crate::BudgetStore::hold
//! [`BudgetStore::held`]: crate::BudgetStore::held

use std::collections::HashMap;
use std::time::Duration;

use parking_lot::Mutex;
use sluice_core::{BudgetKey, Timestamp};

/// The longest hold a store keeps: a longer one is held this long.
pub const MAX_HOLD: Duration = Duration::from_secs(24 * 3600);

/// The most holds an in-process store keeps at once. Past it, holds already
/// over are dropped first; then the one ending soonest makes room (the least
/// time a hold can lose).
pub const MAX_HOLDS: usize = 65_536;

/// The holds of one process's store: per key, the instant it ends.
#[derive(Debug, Default)]
pub(crate) struct MemoryHolds {
    until: Mutex<HashMap<BudgetKey, Timestamp>>,
}

impl MemoryHolds {
    /// Holds `key` until `now + for_` (at most [`MAX_HOLD`]) or what it
    /// holds already, whichever is later.
    pub(crate) fn hold(&self, key: BudgetKey, for_: Duration, now: Timestamp) {
        let end = now.saturating_add(for_.min(MAX_HOLD));
        if end <= now {
            return;
        }
        let mut until = self.until.lock();
        if until.len() >= MAX_HOLDS && !until.contains_key(&key) {
            until.retain(|_, t| *t > now);
            if until.len() >= MAX_HOLDS {
                let soonest = until.iter().min_by_key(|(_, t)| **t).map(|(k, t)| (*k, *t));
                match soonest {
                    Some((_, t)) if t >= end => return,
                    Some((k, _)) => {
                        until.remove(&k);
                    }
                    None => {}
                }
            }
        }
        let t = until.entry(key).or_insert(end);
        *t = (*t).max(end);
    }

    /// What is left of each key's hold at `now` (zero: not held).
    pub(crate) fn held(&self, keys: &[BudgetKey], now: Timestamp) -> Vec<Duration> {
        let until = self.until.lock();
        keys.iter()
            .map(|k| {
                until
                    .get(k)
                    .map_or(Duration::ZERO, |t| t.saturating_since(now))
            })
            .collect()
    }

    /// Holds kept now (those over but not dropped yet included).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.until.lock().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: u64) -> BudgetKey {
        BudgetKey::from_digests(1, n)
    }

    #[test]
    fn c7_a_hold_only_grows_ends_on_time_and_is_bounded_by_a_day() {
        let holds = MemoryHolds::default();
        let t0 = Timestamp::from_secs(1_764_460_800);
        let s = Duration::from_secs;
        holds.hold(key(1), s(30), t0);
        holds.hold(key(1), s(5), t0.saturating_add(s(1)));
        assert_eq!(holds.held(&[key(1), key(2)], t0), [s(30), s(0)]);
        holds.hold(key(1), s(40), t0.saturating_add(s(10)));
        assert_eq!(holds.held(&[key(1)], t0.saturating_add(s(10))), [s(40)]);
        assert_eq!(holds.held(&[key(1)], t0.saturating_add(s(50))), [s(0)]);
        holds.hold(key(3), s(7 * 24 * 3600), t0);
        assert_eq!(holds.held(&[key(3)], t0), [MAX_HOLD]);
    }

    #[test]
    fn holds_are_bounded_and_the_soonest_ending_makes_room() {
        let holds = MemoryHolds::default();
        let t0 = Timestamp::from_secs(1_764_460_800);
        let s = Duration::from_secs;
        // Key 0 ends first; every other one a second after it.
        holds.hold(key(0), s(10), t0);
        for n in 1..MAX_HOLDS as u64 {
            holds.hold(key(n), s(11), t0);
        }
        assert_eq!(holds.len(), MAX_HOLDS);
        // A new hold shorter than all of them is the one left out.
        holds.hold(key(u64::MAX), s(5), t0);
        assert_eq!(holds.held(&[key(u64::MAX)], t0), [s(0)]);
        // A longer one takes the place of the one ending soonest.
        holds.hold(key(u64::MAX), s(60), t0);
        assert_eq!(holds.len(), MAX_HOLDS);
        assert_eq!(holds.held(&[key(u64::MAX), key(0)], t0), [s(60), s(0)]);
        // Once they are over, they make room first.
        let later = t0.saturating_add(s(12));
        holds.hold(key(u64::MAX - 1), s(1), later);
        assert_eq!(holds.len(), 2);
    }
}
