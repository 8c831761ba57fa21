//! The exact rolling window ([`Rate::RollingWindow`](crate::Rate)): units
//! counted per time slot, each slot in one cell.
//!
//! A unit spent at `t` falls in the epoch-aligned slot `j = t / slot` and
//! counts until `leaves(j) = (j + 1) * slot + span`: at any instant `now`
//! the window holds every slot from `first = (now - span) / slot` to the
//! current one. Every unit spent in the last `span` is therefore counted
//! (and, at most, units of one slot more), so no rolling interval of `span`
//! ever holds more than the limit. The wait until a cost fits is exact: the
//! instant enough of the oldest slots have left.

use std::num::NonZeroU32;
use std::time::Duration;

use crate::Timestamp;
use crate::key::mix64;
use crate::rate::{Verdict, cell_is_stale};

const NANOS_PER_SEC: u64 = 1_000_000_000;
const NANOS_PER_MILLI: u64 = 1_000_000;
/// Odd multiplier spreading slot numbers over fingerprints (a bijection).
const SLOT_MIX: u64 = 0x9e37_79b9_7f4a_7c15;
const ROLLING_SALT: u64 = 0x5f52_4f4c_4c49_4e47; // "_ROLLING"

/// The most slots a rolling window is cut into: a longer window (relative to
/// its slot) uses proportionally wider slots, so that a decision reads at
/// most this many cells (plus two).
pub const MAX_ROLLING_SLOTS: u32 = 4_096;

/// The slot arithmetic of a rolling window: which epoch-aligned slot an
/// instant falls in, which slots still count, when a slot leaves, and when
/// a cost fits again. [`Rate::RollingWindow`](crate::Rate) decides with it,
/// and so can a caller that keeps a window's slots its own way (sluice's
/// pacer keeps its day window as one store cell per slot, read once per
/// process when settled).
///
/// A unit spent at `t` falls in slot `j = t / slot` and counts until
/// [`leaves_at(j)`](RollingSlots::leaves_at) `= (j + 1) * slot + span`.
///
/// ```
/// use std::time::Duration;
/// use sluice_core::{RollingSlots, Timestamp};
///
/// let w = RollingSlots::new(Duration::from_secs(60), Duration::from_secs(1));
/// let now = Timestamp::from_secs(1_000);
/// assert_eq!(w.current(now), 1_000);
/// assert_eq!(w.first(now), 940);
/// assert_eq!(w.leaves_at(940), Timestamp::from_secs(1_001));
/// // Slots 940..=1000 hold 70 and 30 units (the rest none): 40 more of 100
/// // fit once slot 940 has left.
/// let mut counts = vec![0; 61];
/// counts[0] = 70;
/// counts[60] = 30;
/// assert_eq!(w.ready_at(940, &counts, 100, 40, now), Some(Timestamp::from_secs(1_001)));
/// assert_eq!(w.ready_at(940, &counts, 100, 0, now), Some(now));
/// assert_eq!(w.ready_at(940, &counts, 100, 101, now), None);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RollingSlots {
    /// The window's length in nanoseconds.
    span: u64,
    /// A slot's length in nanoseconds (at least 1).
    slot: u64,
}

impl RollingSlots {
    /// A window of `span` in slots of `slot` (at least a nanosecond), as
    /// given: not widened.
    #[inline]
    pub fn new(span: Duration, slot: Duration) -> Self {
        let nanos = |d: Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        RollingSlots {
            span: nanos(span),
            slot: nanos(slot).max(1),
        }
    }

    /// The geometry of a [`Rate::RollingWindow`](crate::Rate) of `millis` in
    /// slots of `slot_millis` (widened to at most [`MAX_ROLLING_SLOTS`]
    /// slots per window).
    #[inline]
    pub fn of_rate(millis: NonZeroU32, slot_millis: NonZeroU32) -> Self {
        let slot = slot_millis
            .get()
            .max(millis.get().div_ceil(MAX_ROLLING_SLOTS));
        RollingSlots {
            span: u64::from(millis.get()) * NANOS_PER_MILLI,
            slot: u64::from(slot) * NANOS_PER_MILLI,
        }
    }

    /// The slot holding `now`.
    #[inline]
    pub fn current(&self, now: Timestamp) -> u64 {
        now.as_nanos() / self.slot
    }

    /// The oldest slot still counted at `now`.
    #[inline]
    pub fn first(&self, now: Timestamp) -> u64 {
        now.as_nanos().saturating_sub(self.span) / self.slot
    }

    /// When slot `j`'s units stop counting.
    #[inline]
    pub fn leaves_at(&self, j: u64) -> Timestamp {
        Timestamp::from_nanos(self.leaves(j))
    }

    /// When slot `j`'s units stop counting (nanoseconds since the epoch).
    #[inline]
    pub(crate) fn leaves(&self, j: u64) -> u64 {
        (j + 1).saturating_mul(self.slot).saturating_add(self.span)
    }

    /// The earliest instant (at or after `now`) at which `cost` more units
    /// fit under `limit` if nothing else is spent, the slots from `first`
    /// on holding `counts` (oldest first, up to the current slot): the oldest
    /// slots leave first. `None` when `cost > limit`: never.
    pub fn ready_at(
        &self,
        first: u64,
        counts: &[u32],
        limit: u32,
        cost: u32,
        now: Timestamp,
    ) -> Option<Timestamp> {
        let room = u64::from(limit.checked_sub(cost)?);
        let mut left: u64 = counts.iter().map(|&c| u64::from(c)).sum();
        if left <= room {
            return Some(now);
        }
        for (i, &c) in counts.iter().enumerate() {
            left -= u64::from(c);
            if left <= room {
                return Some(self.leaves_at(first + i as u64).max(now));
            }
        }
        Some(now)
    }

    /// The cell key of slot `j` of the budget with fingerprint `fp`: the same
    /// whatever the window's span, so a changed span keeps the books.
    #[inline]
    pub(crate) fn cell(fp: u64, j: u64) -> u64 {
        mix64(fp ^ ROLLING_SALT ^ j.wrapping_mul(SLOT_MIX))
    }

    /// The cell value of slot `j` holding `count` units: stale (see
    /// [`cell_is_stale`]) from the second after the slot leaves the window.
    #[inline]
    pub(crate) fn value(&self, j: u64, count: u32) -> u64 {
        let until = (self.leaves(j) - 1) / NANOS_PER_SEC;
        (until.min(u64::from(u32::MAX)) << 32) | u64::from(count)
    }

    /// The units a slot's cell holds at `now` (none once it is stale).
    #[inline]
    pub(crate) fn count(value: u64, now: Timestamp) -> u32 {
        if cell_is_stale(value, now) {
            0
        } else {
            value as u32
        }
    }
}

/// One rolling budget's evaluation.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RollingEval {
    pub(crate) verdict: Verdict,
    pub(crate) remaining_before: u32,
    pub(crate) remaining_after: u32,
    pub(crate) reset: u64,
    /// The slot to write and its new count.
    pub(crate) write: Option<(u64, u32)>,
}

fn remaining(limit: u32, used: u64) -> u32 {
    (u64::from(limit).saturating_sub(used)) as u32
}

/// The Unix second (rounded up) at which every counted unit has left, or
/// `now` when none is counted.
fn reset_of(g: &RollingSlots, first: u64, counts: &[u32], now: Timestamp) -> u64 {
    let last = counts.iter().rposition(|&c| c > 0);
    let at = last.map_or(now.as_nanos(), |i| g.leaves(first + i as u64));
    at.div_ceil(NANOS_PER_SEC)
}

/// Evaluates spending `cost` of `limit` at `now` on the window whose slots
/// `first..` hold `counts` (the last one being the current slot).
pub(crate) fn evaluate(
    g: &RollingSlots,
    first: u64,
    counts: &[u32],
    limit: u32,
    cost: u32,
    now: Timestamp,
) -> RollingEval {
    let used: u64 = counts.iter().map(|&c| u64::from(c)).sum();
    let never = cost > limit;
    let fits = !never && used + u64::from(cost) <= u64::from(limit);
    let before = remaining(limit, used);
    let current = first + counts.len().saturating_sub(1) as u64;
    let spends = fits && cost > 0;
    let verdict = if never {
        Verdict::Never
    } else if fits {
        Verdict::Admitted
    } else {
        let at = g.ready_at(first, counts, limit, cost, now).unwrap_or(now);
        Verdict::NotYet {
            retry_after: at.saturating_since(now),
        }
    };
    let cur = counts.last().copied().unwrap_or(0);
    RollingEval {
        verdict,
        remaining_before: before,
        remaining_after: if fits { before - cost } else { before },
        reset: if spends {
            g.leaves(current).div_ceil(NANOS_PER_SEC)
        } else {
            reset_of(g, first, counts, now)
        },
        write: spends.then(|| (current, cur.saturating_add(cost))),
    }
}

/// Charges (`delta > 0`, to the current slot, up to the limit) or refunds
/// (`delta < 0`, from the slot `reserved_at` fell in, if it still counts;
/// never below zero) after the fact.
pub(crate) fn adjust(
    g: &RollingSlots,
    first: u64,
    counts: &[u32],
    limit: u32,
    delta: i64,
    reserved_at: Timestamp,
    now: Timestamp,
) -> RollingEval {
    let used: u64 = counts.iter().map(|&c| u64::from(c)).sum();
    let current = first + counts.len().saturating_sub(1) as u64;
    let target = if delta < 0 {
        let j = g.current(reserved_at);
        (first..=current).contains(&j).then_some(j)
    } else {
        Some(current)
    };
    let mut write = None;
    if let Some(j) = target {
        let i = (j - first) as usize;
        let old = counts.get(i).copied().unwrap_or(0);
        let magnitude = u32::try_from(delta.unsigned_abs()).unwrap_or(u32::MAX);
        let new = if delta < 0 {
            old - magnitude.min(old)
        } else {
            old.saturating_add(magnitude.min(remaining(limit, used)))
        };
        if new != old {
            write = Some((j, new));
        }
    }
    let after_used = match write {
        Some((j, new)) => {
            let old = counts[(j - first) as usize];
            used - u64::from(old) + u64::from(new)
        }
        None => used,
    };
    let reset = match write {
        Some((j, new)) => {
            let mut last = counts
                .iter()
                .rposition(|&c| c > 0)
                .map(|i| first + i as u64);
            if new > 0 {
                last = Some(last.map_or(j, |l| l.max(j)));
            } else if last == Some(j) {
                last = counts[..(j - first) as usize]
                    .iter()
                    .rposition(|&c| c > 0)
                    .map(|i| first + i as u64);
            }
            last.map_or(now.as_nanos(), |l| g.leaves(l))
                .div_ceil(NANOS_PER_SEC)
        }
        None => reset_of(g, first, counts, now),
    };
    RollingEval {
        verdict: Verdict::Admitted,
        remaining_before: remaining(limit, used),
        remaining_after: remaining(limit, after_used),
        reset,
        write,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nz(n: u32) -> NonZeroU32 {
        NonZeroU32::new(n).expect("non-zero")
    }

    #[test]
    fn a_rate_geometry_is_the_window_given_until_it_needs_wider_slots() {
        assert_eq!(
            RollingSlots::of_rate(nz(60_000), nz(250)),
            RollingSlots::new(Duration::from_secs(60), Duration::from_millis(250))
        );
        // A day in 1 ms slots would be 86.4 M slots: widened to 4,096 at most.
        let day = RollingSlots::of_rate(nz(86_400_000), nz(1));
        let at = Timestamp::from_secs(1_764_547_200);
        assert!(day.current(at) - day.first(at) <= u64::from(MAX_ROLLING_SLOTS) + 1);
        // A zero slot is a nanosecond, not a division by zero.
        let tiny = RollingSlots::new(Duration::from_secs(1), Duration::ZERO);
        assert_eq!(tiny.current(Timestamp::from_nanos(7)), 7);
    }

    #[test]
    fn a_slot_counts_until_its_end_plus_the_span() {
        let w = RollingSlots::new(Duration::from_secs(60), Duration::from_secs(1));
        let j = w.current(Timestamp::from_nanos(10_500 * NANOS_PER_MILLI));
        assert_eq!(j, 10);
        assert_eq!(w.leaves_at(j), Timestamp::from_secs(71));
        // Just before it leaves, slot 10 is the oldest counted; at it, 11 is.
        assert_eq!(w.first(Timestamp::from_nanos(70_999 * NANOS_PER_MILLI)), 10);
        assert_eq!(w.first(Timestamp::from_secs(71)), 11);
    }

    #[test]
    fn ready_at_is_the_retry_evaluate_answers() {
        let w = RollingSlots::of_rate(nz(10_000), nz(1_000));
        let now = Timestamp::from_secs(100);
        let first = w.first(now);
        let counts = [3, 0, 4, 0, 0, 2, 0, 0, 0, 0, 1];
        assert_eq!(counts.len() as u64, w.current(now) - first + 1);
        for cost in 0..=12 {
            let e = evaluate(&w, first, &counts, 10, cost, now);
            let ready = w.ready_at(first, &counts, 10, cost, now);
            match e.verdict {
                Verdict::Admitted => assert_eq!(ready, Some(now), "cost {cost}"),
                Verdict::NotYet { retry_after } => {
                    assert_eq!(ready, Some(now.saturating_add(retry_after)), "cost {cost}");
                    assert!(retry_after > Duration::ZERO);
                }
                Verdict::Never => assert_eq!(ready, None, "cost {cost}"),
            }
        }
        // 10 used: 2 more fit once the oldest slot (3) has left, 4 more
        // once the one holding 4 has too.
        assert_eq!(
            w.ready_at(first, &counts, 10, 2, now),
            Some(w.leaves_at(first))
        );
        assert_eq!(
            w.ready_at(first, &counts, 10, 4, now),
            Some(w.leaves_at(first + 2))
        );
    }
}
