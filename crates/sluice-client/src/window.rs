//! Exact rolling windows (60 s of tokens, 24 h of requests) kept in a
//! [`BudgetStore`], so that every process on one key reads and spends the
//! same books.
//!
//! The token window ([`TokenWindow`]) is one [`Rate::RollingWindow`] budget
//! per provider key, in 250 ms slots: the store decides it whole, so reading
//! it, or reserving on it together with the request budgets, is one store
//! call (one Redis round trip), and a wait comes back exact from the store.
//!
//! The day window ([`SlotWindow`], 1,441 slots of 60 s) keeps the older
//! design, which reads each settled slot once and keeps it. It is not a
//! [`Rate::RollingWindow`] because that budget is decided whole by the
//! store, reading every slot of the window on every call (1,441 cells for a
//! day of minutes); here a process reads a slot once after it settles, and a
//! send reads the last few. What it counts is the same: the slot arithmetic
//! (slot of an instant, oldest slot counted, when a slot leaves, when a cost
//! fits) is sluice-core's [`RollingSlots`], over one counter cell per time
//! slot,
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
//! is dropped by the store afterwards.

use std::collections::BTreeMap;
use std::num::NonZeroU32;
use std::time::Duration;

use sluice_core::{
    Budget, BudgetKey, Decision, MAX_BUDGETS, Rate, RollingSlots, Timestamp, Verdict,
};
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

/// The pacer's token window: at most the TPM in any `span + margin`, one
/// [`Rate::RollingWindow`] budget per provider key in the store.
///
/// Its methods mirror [`SlotWindow`]'s where the pacer uses both alike:
/// [`TokenWindow::read`] and [`TokenWindow::cell`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct TokenWindow {
    scope: u64,
    span: Duration,
    slot: NonZeroU32,
}

/// Whole milliseconds, rounded up (a window never counts shorter than asked).
fn millis_up(d: Duration) -> u64 {
    u64::try_from(d.as_nanos().div_ceil(1_000_000)).unwrap_or(u64::MAX)
}

fn nonzero_millis(ms: u64) -> NonZeroU32 {
    NonZeroU32::new(u32::try_from(ms).unwrap_or(u32::MAX)).unwrap_or(NonZeroU32::MIN)
}

impl TokenWindow {
    /// A window named `axis` (its key's scope) of `span` (+ the margin
    /// given per call) in slots of `slot` (whole milliseconds, at least one).
    pub(crate) fn new(axis: &str, span: Duration, slot: Duration) -> Self {
        TokenWindow {
            scope: sluice_core::digest(format!("sluice-pace/{axis}").as_bytes()),
            span,
            slot: nonzero_millis(u64::try_from(slot.as_millis()).unwrap_or(u64::MAX)),
        }
    }

    /// The window's length with `margin`, in milliseconds.
    fn span_millis(&self, margin: Duration) -> u64 {
        millis_up(self.span.saturating_add(margin))
    }

    fn of_millis(&self, subject: u64, millis: u64, limit: u32, cost: u32) -> Budget {
        Budget {
            key: BudgetKey::from_digests(self.scope, subject),
            rate: Rate::RollingWindow {
                millis: nonzero_millis(millis),
                slot_millis: self.slot,
            },
            limit,
            cost,
        }
    }

    /// The budget that reserves `cost` tokens of `limit` in the window
    /// reaching back `span + margin`.
    pub(crate) fn budget(&self, subject: u64, margin: Duration, limit: u32, cost: u32) -> Budget {
        self.of_millis(subject, self.span_millis(margin), limit, cost)
    }

    /// The slot holding `t` (what a permit remembers of its reservation).
    pub(crate) fn slot_of(&self, t: Timestamp) -> u64 {
        RollingSlots::new(self.span, Duration::from_millis(u64::from(self.slot.get()))).current(t)
    }

    /// The budget through which tokens reserved in slot `slot` are given
    /// back, or tokens charged now: the store places a refund in the slot
    /// its reservation instant fell in and a charge in the current slot, so
    /// `slot` only says which the caller means. It reaches back as far as
    /// the largest arrival margin, so a refund lands whatever the margin
    /// (one into a slot that already left the window changes no decision).
    pub(crate) fn cell(&self, subject: u64, _slot: u64, limit: u32, cost: u32) -> Budget {
        self.budget(subject, MAX_MARGIN, limit, cost)
    }

    /// The window as it stands at `now`, in one store call (this window is
    /// read whole and keeps nothing).
    ///
    /// # Errors
    /// The store's.
    pub(crate) async fn read<S: BudgetStore>(
        &self,
        store: &S,
        subject: u64,
        now: Timestamp,
        margin: Duration,
    ) -> Result<TokenReading, StoreError> {
        let d = store
            .peek(&[self.budget(subject, margin, u32::MAX, 0)])
            .await?;
        Ok(TokenReading {
            total: used_of(&d, 0),
            current: self.slot_of(now),
            ready_at: Some(now),
            room_by_deadline: u32::MAX,
        })
    }

    /// Tokens of the window that will still count `ahead[i]` from now, for
    /// each instant, in one store call (a window shortened by that much,
    /// read now).
    ///
    /// # Errors
    /// The store's.
    pub(crate) async fn ahead<S: BudgetStore>(
        &self,
        store: &S,
        subject: u64,
        margin: Duration,
        ahead: &[Duration],
    ) -> Result<Vec<u64>, StoreError> {
        let span = self.span_millis(margin);
        let probes: Vec<Budget> = ahead
            .iter()
            .map(|h| {
                let ms = u64::try_from(h.as_millis()).unwrap_or(u64::MAX);
                self.of_millis(subject, span.saturating_sub(ms).max(1), u32::MAX, 0)
            })
            .collect();
        let d = store.peek(&probes).await?;
        Ok((0..probes.len()).map(|i| used_of(&d, i)).collect())
    }

    /// The window at `now` and what `cost` more tokens under `limit` would
    /// meet, in one store call: when they fit (if nothing else is spent)
    /// and how many tokens fit by `deadline`.
    ///
    /// # Errors
    /// The store's.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn plan<S: BudgetStore>(
        &self,
        store: &S,
        subject: u64,
        now: Timestamp,
        margin: Duration,
        limit: u32,
        cost: u32,
        deadline: Timestamp,
    ) -> Result<TokenReading, StoreError> {
        let span = self.span_millis(margin);
        // What still counts at the deadline is what counts now in a window
        // shorter by the time until then (rounded down: never less).
        let ahead = u64::try_from(deadline.saturating_since(now).as_millis()).unwrap_or(u64::MAX);
        let shortened = span.checked_sub(ahead).filter(|&ms| ms > 0);
        let mut probes = vec![self.of_millis(subject, span, u32::MAX, 0)];
        if let Some(ms) = shortened {
            probes.push(self.of_millis(subject, ms, limit, 0));
        }
        // Last: a probe's tentative spend is seen by later probes of the key.
        probes.push(self.of_millis(subject, span, limit, cost));
        let d = store.peek(&probes).await?;
        let last = d.statuses().last().map(|s| s.verdict);
        Ok(TokenReading {
            total: used_of(&d, 0),
            current: self.slot_of(now),
            ready_at: match last {
                Some(Verdict::Admitted) => Some(now),
                Some(Verdict::NotYet { retry_after }) => Some(now.saturating_add(retry_after)),
                Some(Verdict::Never) | None => None,
            },
            room_by_deadline: match shortened {
                Some(_) => d.statuses().get(1).map_or(0, |s| s.remaining),
                None => limit,
            },
        })
    }
}

/// Units a probe of limit `u32::MAX` found spent.
fn used_of(d: &Decision, i: usize) -> u64 {
    d.statuses()
        .get(i)
        .map_or(0, |s| u64::from(u32::MAX - s.remaining))
}

/// The token window as one store call found it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TokenReading {
    total: u64,
    current: u64,
    ready_at: Option<Timestamp>,
    room_by_deadline: u32,
}

impl TokenReading {
    /// Tokens in the window.
    pub(crate) fn total(&self) -> u64 {
        self.total
    }

    /// The slot the reading was made in.
    pub(crate) fn current(&self) -> u64 {
        self.current
    }

    /// When the planned tokens fit (`None`: never, more than the limit).
    pub(crate) fn ready_at(&self) -> Option<Timestamp> {
        self.ready_at
    }

    /// Tokens that fit under the planned limit by the planned deadline.
    pub(crate) fn room_by_deadline(&self) -> u32 {
        self.room_by_deadline
    }
}

/// A rolling window of `span` counted in slots of `slot`: sluice-core's
/// [`RollingSlots`] of `span + margin` (the margin given per call), its
/// slots kept as one store cell each (see the module docs for why not a
/// [`Rate::RollingWindow`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct SlotWindow {
    scope: u64,
    span: Duration,
    slot: Duration,
    slot_ns: u64,
}

impl SlotWindow {
    /// A window named `axis` (part of every cell's key).
    pub(crate) fn new(axis: &str, span: Duration, slot: Duration) -> Self {
        let slot = slot.max(Duration::from_millis(1));
        SlotWindow {
            scope: sluice_core::digest(format!("sluice-pace/{axis}").as_bytes()),
            span,
            slot,
            slot_ns: nanos(slot),
        }
    }

    /// The slot geometry reaching back `span + margin`.
    fn slots(&self, margin: Duration) -> RollingSlots {
        RollingSlots::new(self.span.saturating_add(margin), self.slot)
    }

    pub(crate) fn slot_of(&self, t: Timestamp) -> u64 {
        self.slots(Duration::ZERO).current(t)
    }

    /// The oldest slot still in the window at `t`.
    fn first(&self, t: Timestamp, margin: Duration) -> u64 {
        self.slots(margin).first(t)
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
        self.window
            .slots(self.margin)
            .ready_at(self.first, &self.values, limit, cost, now)
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
        // The settled slot is kept: a refund in the store is not re-read...
        clock.advance(Duration::from_secs(40));
        let h = w.read(&store, 1, &kept, clock.now(), margin).await.unwrap();
        assert_eq!(h.total(), 70);
        // ...until the slot leaves the window.
        clock.advance(Duration::from_secs(11));
        let h = w.read(&store, 1, &kept, clock.now(), margin).await.unwrap();
        assert_eq!(h.total(), 0);
    }

    /// Counts the calls that reach the store.
    struct Counting<S> {
        inner: S,
        calls: std::sync::atomic::AtomicU32,
    }

    impl<S: BudgetStore> BudgetStore for Counting<S> {
        async fn decide(&self, b: &[Budget]) -> Result<Decision, StoreError> {
            self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            self.inner.decide(b).await
        }
        async fn peek(&self, b: &[Budget]) -> Result<Decision, StoreError> {
            self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            self.inner.peek(b).await
        }
        async fn adjust(
            &self,
            b: &Budget,
            delta: i64,
            at: Timestamp,
        ) -> Result<sluice_core::BudgetStatus, StoreError> {
            self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            self.inner.adjust(b, delta, at).await
        }
    }

    #[tokio::test]
    async fn c2_the_token_window_is_planned_in_one_store_call_and_exactly() {
        let clock = FakeClock::new(TEST_EPOCH);
        let store = Counting {
            inner: MemoryStore::with_clock(MemoryConfig::default(), clock.clone()),
            calls: Default::default(),
        };
        let calls = || store.calls.load(std::sync::atomic::Ordering::SeqCst);
        let w = TokenWindow::new("tpm", Duration::from_secs(60), Duration::from_millis(250));
        let margin = Duration::from_secs(1);
        // 300 tokens in each of four slots, 10 s apart.
        for _ in 0..4 {
            let d = store
                .decide(&[w.budget(1, margin, 1_000, 300)])
                .await
                .unwrap();
            assert!(d.is_admitted() || calls() == 4);
            clock.advance(Duration::from_secs(10));
        }
        assert_eq!(calls(), 4, "three admitted, the fourth refused");
        let now = clock.now();
        let before = calls();
        let deadline = now.saturating_add(Duration::from_secs(25));
        let p = w
            .plan(&store, 1, now, margin, 1_000, 500, deadline)
            .await
            .unwrap();
        assert_eq!(calls() - before, 1, "one store call");
        assert_eq!(p.total(), 900);
        // 500 more fit once two slots have left: the second, spent at
        // +10 s, leaves at its slot's end + 61 s = +71.25 s.
        let second = TEST_EPOCH.saturating_add(Duration::from_millis(71_250));
        assert_eq!(p.ready_at(), Some(second));
        // By the deadline (+65 s) the first slot (leaving at +61.25 s) has
        // left: 1,000 - 600 fit.
        assert_eq!(p.room_by_deadline(), 400);
        let p = w
            .plan(&store, 1, now, margin, 1_000, 1_001, deadline)
            .await
            .unwrap();
        assert_eq!(p.ready_at(), None, "more than the limit never fits");
        // A refund through the slot's cell lands in the slot of its instant.
        store
            .adjust(
                &w.cell(1, w.slot_of(TEST_EPOCH), u32::MAX, 0),
                -300,
                TEST_EPOCH,
            )
            .await
            .unwrap();
        let r = w.read(&store, 1, now, margin).await.unwrap();
        assert_eq!(r.total(), 600);
    }
}
