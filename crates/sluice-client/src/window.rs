//! An exact rolling window (60 s of tokens, 24 h of requests) kept in a
//! [`BudgetStore`], so that every process on one key reads and spends the
//! same books (SPEC C7).
//!
//! The core offers fixed, sliding-counter and GCRA budgets, none of which
//! bounds *every* rolling window with variable costs: the pacer needs "the
//! tokens sent in the last 60 s". It is built here from one counter cell per
//! time slot (250 ms for tokens, 60 s for requests):
//!
//! * a send spends on the cell of the slot it falls in, through
//!   [`BudgetStore::decide`] with the budget's limit set to *what the other
//!   slots in the window leave*, so the check and the spend stay one atomic
//!   store operation;
//! * slots that are over never receive spends again (refunds only lower
//!   them), so a process reads each once ([`BudgetStore::peek`]) and keeps
//!   it, and a decision touches only the last few slots;
//! * a slot counts until `slot end + window + arrival margin`; the room a
//!   wait is computed for is therefore exact to the slot.
//!
//! Each slot's counter is a [`Rate::FixedWindow`] of `W` seconds chosen so
//! that the epoch-aligned window `[W, 2W)` covers exactly the slot's life
//! (`W = ⌈end / 2⌉ ≤ start`): the cell lives as long as the slot matters and
//! is dropped by the store afterwards. What core could add to make this
//! direct: a `Rate::Counter { until: Timestamp }` (a counter cell with an
//! explicit expiry) and a decision "sum of these cells + cost ≤ limit";
//! with them a Redis script would decide a rolling window in one call.

use std::collections::BTreeMap;
use std::num::NonZeroU32;
use std::time::Duration;

use sluice_core::{Budget, BudgetKey, MAX_BUDGETS, Rate, Timestamp};
use sluice_store::{BudgetStore, StoreError};

const NANOS_PER_SEC: u64 = 1_000_000_000;
/// A slot is read and kept once this long after it ended (clock skew
/// between processes that share a store).
const SETTLE: Duration = Duration::from_secs(2);
/// Slot cells live as if the arrival margin were this large, so that a
/// changed margin never makes a slot's cell move.
const MAX_MARGIN: Duration = Duration::from_secs(60);
/// Odd multiplier spreading slot numbers over scope digests (a bijection).
const SLOT_MIX: u64 = 0x9e37_79b9_7f4a_7c15;

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// A rolling window of `span` counted in slots of `slot`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SlotWindow {
    scope: u64,
    span: Duration,
    slot_ns: u64,
}

impl SlotWindow {
    /// A window named `axis` (part of every cell's key).
    pub(crate) fn new(axis: &str, span: Duration, slot: Duration) -> Self {
        SlotWindow {
            scope: sluice_core::digest(format!("sluice-pace/{axis}").as_bytes()),
            span,
            slot_ns: nanos(slot).max(1_000_000),
        }
    }

    pub(crate) fn slot_of(&self, t: Timestamp) -> u64 {
        t.as_nanos() / self.slot_ns
    }

    fn reach_ns(&self, margin: Duration) -> u64 {
        nanos(self.span).saturating_add(nanos(margin))
    }

    /// The oldest slot still in the window at `t`.
    fn first(&self, t: Timestamp, margin: Duration) -> u64 {
        t.as_nanos().saturating_sub(self.reach_ns(margin)) / self.slot_ns
    }

    /// When slot `j` stops counting.
    pub(crate) fn leaves_at(&self, j: u64, margin: Duration) -> Timestamp {
        Timestamp::from_nanos(
            (j + 1)
                .saturating_mul(self.slot_ns)
                .saturating_add(self.reach_ns(margin)),
        )
    }

    /// The budget of slot `j`'s counter cell.
    pub(crate) fn cell(&self, subject: u64, j: u64, limit: u32, cost: u32) -> Budget {
        let start = j.saturating_mul(self.slot_ns) / NANOS_PER_SEC;
        let end_ns = (j + 1)
            .saturating_mul(self.slot_ns)
            .saturating_add(nanos(self.span + MAX_MARGIN + SETTLE));
        let end = end_ns.div_ceil(NANOS_PER_SEC) + 1;
        let w = end.div_ceil(2);
        // [w, 2w) covers [start, end) whenever end <= 2 * start, i.e. for
        // any time after 1970-01-01 plus a few minutes; otherwise one window
        // from the epoch to 2106.
        let seconds = if w <= start {
            u32::try_from(w).ok().and_then(NonZeroU32::new)
        } else {
            None
        }
        .unwrap_or(NonZeroU32::MAX);
        Budget {
            key: BudgetKey::from_digests(self.scope ^ j.wrapping_mul(SLOT_MIX), subject),
            rate: Rate::FixedWindow { seconds },
            limit,
            cost,
        }
    }

    /// The window's slots at `now`: kept values for settled slots, the rest
    /// read from the store (and kept once settled).
    pub(crate) async fn read<S: BudgetStore>(
        &self,
        store: &S,
        subject: u64,
        kept: &parking_lot::Mutex<SlotCache>,
        now: Timestamp,
        margin: Duration,
    ) -> Result<History, StoreError> {
        let first = self.first(now, margin);
        let current = self.slot_of(now).max(first);
        let len = usize::try_from(current - first + 1).unwrap_or(usize::MAX);
        let mut values = vec![0u32; len];
        let mut missing = Vec::new();
        {
            let mut k = kept.lock();
            if k.subject != subject {
                k.slots.clear();
                k.subject = subject;
            }
            k.slots = k.slots.split_off(&first);
            for (i, j) in (first..=current).enumerate() {
                match k.slots.get(&j) {
                    Some(v) => values[i] = *v,
                    None => missing.push(j),
                }
            }
        }
        let mut fetched = Vec::with_capacity(missing.len());
        for chunk in missing.chunks(MAX_BUDGETS) {
            let budgets: Vec<Budget> = chunk
                .iter()
                .map(|&j| self.cell(subject, j, u32::MAX, 0))
                .collect();
            let d = store.peek(&budgets).await?;
            for (&j, s) in chunk.iter().zip(d.statuses()) {
                let v = u32::MAX - s.remaining;
                values[usize::try_from(j - first).unwrap_or(0)] = v;
                fetched.push((j, v));
            }
        }
        let settled_before = now.as_nanos().saturating_sub(nanos(SETTLE)) / self.slot_ns;
        let mut k = kept.lock();
        if k.subject == subject {
            for (j, v) in fetched {
                // Slot j has ended SETTLE ago: nobody spends on it any more.
                if j < settled_before {
                    k.slots.insert(j, v);
                }
            }
        }
        Ok(History {
            first,
            values,
            window: *self,
            margin,
        })
    }
}

/// Slot values a process has read once and keeps (settled slots only).
#[derive(Debug, Default)]
pub(crate) struct SlotCache {
    subject: u64,
    slots: BTreeMap<u64, u32>,
}

impl SlotCache {
    /// Lowers a kept slot by a refund this process made.
    pub(crate) fn refund(&mut self, subject: u64, j: u64, units: u32) {
        if self.subject == subject
            && let Some(v) = self.slots.get_mut(&j)
        {
            *v = v.saturating_sub(units);
        }
    }
}

/// The window's slots as read at one instant.
#[derive(Debug)]
pub(crate) struct History {
    first: u64,
    values: Vec<u32>,
    window: SlotWindow,
    margin: Duration,
}

impl History {
    /// Units in the window.
    pub(crate) fn total(&self) -> u64 {
        self.values.iter().map(|&v| u64::from(v)).sum()
    }

    /// The current slot.
    pub(crate) fn current(&self) -> u64 {
        self.first + self.values.len() as u64 - 1
    }

    /// Units in the current slot.
    pub(crate) fn current_value(&self) -> u32 {
        self.values.last().copied().unwrap_or(0)
    }

    /// The earliest instant (≥ `now`) at which `cost` more units fit under
    /// `limit` if nothing else is spent; `None` when `cost > limit`.
    pub(crate) fn room_at(&self, limit: u32, cost: u32, now: Timestamp) -> Option<Timestamp> {
        if cost > limit {
            return None;
        }
        let need = u64::from(limit) - u64::from(cost);
        let mut left = self.total();
        if left <= need {
            return Some(now);
        }
        for (i, &v) in self.values.iter().enumerate() {
            left -= u64::from(v);
            if left <= need {
                let at = self.window.leaves_at(self.first + i as u64, self.margin);
                return Some(at.max(now));
            }
        }
        Some(now)
    }

    /// Units free under `limit` at `t` (≥ now) if nothing else is spent.
    pub(crate) fn room_by(&self, limit: u32, t: Timestamp) -> u32 {
        let still: u64 = self
            .values
            .iter()
            .enumerate()
            .filter(|(i, _)| self.window.leaves_at(self.first + *i as u64, self.margin) > t)
            .map(|(_, &v)| u64::from(v))
            .sum();
        u32::try_from(u64::from(limit).saturating_sub(still)).unwrap_or(0)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use sluice_core::{Clock, FakeClock};
    use sluice_store::{MemoryConfig, MemoryStore};

    use super::*;
    use crate::clock::TEST_EPOCH;

    #[test]
    fn a_slot_cell_lives_exactly_through_the_slot_life() {
        let w = SlotWindow::new("tpm", Duration::from_secs(60), Duration::from_millis(250));
        let j = w.slot_of(TEST_EPOCH);
        let b = w.cell(7, j, 100, 1);
        let Rate::FixedWindow { seconds } = b.rate else {
            panic!("fixed window expected")
        };
        let s = u64::from(seconds.get());
        assert!(s <= TEST_EPOCH.as_secs());
        assert!(2 * s >= TEST_EPOCH.as_secs() + 60 + 60 + 2);
        assert!(2 * s <= TEST_EPOCH.as_secs() + 60 + 60 + 2 + 3);
        assert_ne!(w.cell(7, j + 1, 1, 1).key, b.key);
    }

    #[tokio::test]
    async fn spends_are_read_back_and_rooms_computed_exactly() {
        let clock = FakeClock::new(TEST_EPOCH);
        let store = MemoryStore::with_clock(MemoryConfig::default(), clock.clone());
        let w = SlotWindow::new("tpm", Duration::from_secs(60), Duration::from_secs(1));
        let kept = parking_lot::Mutex::new(SlotCache::default());
        let margin = Duration::ZERO;
        let j = w.slot_of(clock.now());
        assert!(
            store
                .decide(&[w.cell(1, j, 100, 70)])
                .await
                .unwrap()
                .is_admitted()
        );
        clock.advance(Duration::from_secs(10));
        let h = w.read(&store, 1, &kept, clock.now(), margin).await.unwrap();
        assert_eq!(h.total(), 70);
        // 40 more fit when the first slot leaves: 1 s slot + 60 s window.
        let at = h.room_at(100, 40, clock.now()).unwrap();
        assert_eq!(at, TEST_EPOCH.saturating_add(Duration::from_secs(61)));
        assert_eq!(h.room_at(100, 30, clock.now()), Some(clock.now()));
        assert_eq!(h.room_at(100, 101, clock.now()), None);
        assert_eq!(h.room_by(100, at), 100);
        // The settled slot is kept: a refund in the store is not re-read...
        clock.advance(Duration::from_secs(40));
        let h = w.read(&store, 1, &kept, clock.now(), margin).await.unwrap();
        assert_eq!(h.total(), 70);
        // ...until the slot leaves the window.
        clock.advance(Duration::from_secs(11));
        let h = w.read(&store, 1, &kept, clock.now(), margin).await.unwrap();
        assert_eq!(h.total(), 0);
    }
}
