//! How a budget refills: the algorithms, as pure functions of
//! `(cells, now, limit, cost)`.
//!
//! A store keeps each budget's state in one or two 64-bit *cells*. The high 32
//! bits of every non-empty cell hold the Unix second after which the cell no
//! longer matters (see [`cell_is_stale`]); a store may drop such a cell at any
//! time without changing any decision. An absent cell reads as `0`.

use std::num::NonZeroU32;
use std::time::Duration;

use arrayvec::ArrayVec;

use crate::calendar::month_bounds;
use crate::clock::duration_nanos;
use crate::key::mix64;
use crate::rolling::{self, RollingSlots};
use crate::{BudgetKey, Timestamp};

const NANOS_PER_SEC: u64 = 1_000_000_000;
const NANOS_PER_MICRO: u64 = 1_000;
const SLIDING_SALT: [u64; 2] = [0x9e37_79b9_7f4a_7c15, 0xc2b2_ae3d_27d4_eb4f];

/// True when `cell` can be dropped at `now` without changing any decision.
#[inline]
pub const fn cell_is_stale(cell: u64, now: Timestamp) -> bool {
    (cell >> 32) < now.as_secs()
}

#[inline]
pub(crate) const fn pack(until: u64, low: u32) -> u64 {
    // Unix seconds fit 32 bits until 2106; saturate rather than wrap.
    let until = if until > u32::MAX as u64 {
        u32::MAX as u64
    } else {
        until
    };
    (until << 32) | low as u64
}

#[inline]
pub(crate) const fn low(cell: u64) -> u32 {
    cell as u32
}

/// How a budget refills.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Rate {
    /// `limit` units per window of `seconds`, windows aligned to the Unix
    /// epoch (every replica agrees where a window starts).
    FixedWindow {
        /// Window length in seconds.
        seconds: NonZeroU32,
    },
    /// The sliding-window counter: the previous aligned window's count,
    /// weighted by how much of it still overlaps the last `seconds`, plus the
    /// current window's count. Smoother than a fixed window at the boundary;
    /// never admits more than `limit` in any aligned window. A refusal's wait
    /// ends on the first whole microsecond at which the cost fits.
    SlidingWindow {
        /// Window length in seconds.
        seconds: NonZeroU32,
    },
    /// `limit` units per calendar month (UTC); resets at the first instant of
    /// the next month.
    CalendarMonth,
    /// The generic cell rate algorithm: `limit` units per `period`, evenly
    /// spaced, with at most `burst` units at once. `burst = 1` spaces every
    /// unit evenly (pacing). The interval between units, `period / limit`,
    /// is rounded down to a whole microsecond (at least one): every store,
    /// the shared one included, spaces units alike.
    Gcra {
        /// The period over which `limit` units are allowed.
        period: Duration,
        /// How many units may go back to back.
        burst: NonZeroU32,
    },
    /// An exact rolling window: at every instant, at most `limit` units
    /// spent in the last `millis` milliseconds. Time is cut into
    /// epoch-aligned slots of `slot_millis`; a unit counts from when it is
    /// spent until `millis` after the end of its slot, so the window is
    /// exact to the slot (it may hold a unit up to one slot longer, never
    /// shorter), and a refusal's wait is exact: until enough of the oldest
    /// slots have left.
    ///
    /// State: one cell per slot that holds units, so a decision reads up to
    /// `millis / slot_millis + 2` cells; a window of more than
    /// [`MAX_ROLLING_SLOTS`](crate::MAX_ROLLING_SLOTS) slots uses
    /// proportionally wider ones. The slot width must stay the same for a
    /// budget; its length may change (a lengthened window may or may not
    /// count slots that had already left the shorter one).
    RollingWindow {
        /// Window length in milliseconds.
        millis: NonZeroU32,
        /// Slot length in milliseconds.
        slot_millis: NonZeroU32,
    },
    /// The turns of one agent run (SPEC T7): a run new at this decision may
    /// take `limit` turns (its tier's, kept for the run's life whatever
    /// later decisions pass), more once they are granted ([`crate::adjust`]
    /// with a negative delta: a grant of that many), none once it is finished
    /// (a positive delta past its turns). Waiting never frees a turn: a spent
    /// run's refusal is [`Verdict::NotYet`] until it is granted more, a
    /// finished run's [`Verdict::Never`]. The run is forgotten `idle_secs`
    /// after its last turn or change (its cell then reads as a new run's).
    ///
    /// A run's status tells its turns left, grants included: its `remaining`
    /// may exceed its `limit` (the tier's turns) once it was granted more.
    Turns {
        /// Seconds without a turn or change after which the run is forgotten.
        idle_secs: NonZeroU32,
    },
    /// A count kept until `end` (Unix seconds) and gone after it: counted as
    /// the fixed window `[0, end)` ([`Rate::until`]).
    Until {
        /// The Unix second the count is kept until.
        end: NonZeroU32,
    },
}

impl Rate {
    /// The shortest window [`Rate::until`] makes, and the shortest fixed window
    /// [`Rate::is_until`] reads as one: 10⁹ seconds (about 31.7 years), longer
    /// than any window a policy means.
    pub const UNTIL_MIN_SECONDS: u32 = 1_000_000_000;

    /// A count that never resets before `end` (Unix seconds) and is gone after
    /// it: the fixed window `[0, end)`, whose one window runs from the epoch to
    /// `end`. Every store drops its cell after `end`, as it drops a fixed
    /// window's when the window is over (the memory store's sweep, the durable
    /// book's past-period cells, Redis's `EXPIREAT`). `end` is taken between
    /// [`Rate::UNTIL_MIN_SECONDS`] and `u32::MAX` (February 2106). Used for
    /// counts kept for a while rather than limited, such as an LLM gateway's
    /// usage per month.
    ///
    /// ```
    /// use std::num::NonZeroU32;
    /// use sluice_core::Rate;
    ///
    /// let kept = Rate::until(1_800_000_000);
    /// assert!(kept.is_until());
    /// assert_eq!(kept.counted(), Rate::FixedWindow { seconds: NonZeroU32::new(1_800_000_000).unwrap() });
    /// assert!(!Rate::FixedWindow { seconds: NonZeroU32::new(86_400).unwrap() }.is_until());
    /// assert!(!Rate::FixedWindow { seconds: NonZeroU32::MAX }.is_until());
    /// assert!(!Rate::CalendarMonth.is_until());
    /// ```
    pub const fn until(end: u64) -> Rate {
        let end = if end > u32::MAX as u64 {
            u32::MAX
        } else if end < Rate::UNTIL_MIN_SECONDS as u64 {
            Rate::UNTIL_MIN_SECONDS
        } else {
            end as u32
        };
        let end = match NonZeroU32::new(end) {
            Some(end) => end,
            None => NonZeroU32::MAX, // not reached: `end` is at least 10⁹
        };
        Rate::Until { end }
    }

    /// The rate a budget of this one is counted by: a [`Rate::Until`] as its
    /// fixed window `[0, end)`, any other as it is.
    #[inline(always)]
    pub const fn counted(&self) -> Rate {
        match *self {
            Rate::Until { end } => Rate::FixedWindow { seconds: end },
            rate => rate,
        }
    }

    /// True for a rate [`Rate::until`] makes. A store that keeps long-lived
    /// counts durable (the embedded store) keeps these with the monthly quotas;
    /// a fixed window, however long, is not one.
    pub const fn is_until(&self) -> bool {
        matches!(self, Rate::Until { .. })
    }

    /// True when a budget of this rate keeps its state in one cell: every
    /// rate but the sliding window (which reads two) and the rolling window
    /// (one per slot).
    #[inline(always)]
    pub const fn is_one_cell(&self) -> bool {
        !matches!(
            self,
            Rate::SlidingWindow { .. } | Rate::RollingWindow { .. }
        )
    }
}

/// What one budget says about one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The cost fits now.
    Admitted,
    /// The cost does not fit now; it will after `retry_after`.
    NotYet {
        /// How long until the cost fits, assuming nothing else spends.
        retry_after: Duration,
    },
    /// The cost can never fit: it is larger than the budget's whole limit.
    Never,
}

/// Where one budget stands, as the client is told (limit, remaining, reset).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BudgetStatus {
    /// What this budget says about the request.
    pub verdict: Verdict,
    /// The budget's limit per window.
    pub limit: u32,
    /// Units left: after this request if it was admitted and spent, otherwise
    /// as the books stand.
    pub remaining: u32,
    /// Unix second at which the current window ends (fixed, sliding, month)
    /// or the budget is whole again (GCRA).
    pub reset: u64,
}

impl BudgetStatus {
    /// Seconds from `now` until `reset`, rounded up.
    pub fn reset_after_secs(&self, now: Timestamp) -> u64 {
        self.reset.saturating_sub(now.as_secs())
    }

    /// The time until the cost fits (`None` for [`Verdict::Never`], zero when admitted).
    pub fn retry_after(&self) -> Option<Duration> {
        match self.verdict {
            Verdict::Admitted => Some(Duration::ZERO),
            Verdict::NotYet { retry_after } => Some(retry_after),
            Verdict::Never => None,
        }
    }
}

/// One budget's evaluation: its status before and after spending, and the
/// cells to write if every budget of the decision admits.
#[derive(Clone, Debug)]
pub(crate) struct Evaluation {
    pub(crate) verdict: Verdict,
    pub(crate) remaining_before: u32,
    pub(crate) remaining_after: u32,
    pub(crate) reset: u64,
    pub(crate) writes: ArrayVec<(u64, u64), 2>,
}

/// The cell keys a budget uses at `now`.
#[inline]
pub(crate) fn cells(rate: &Rate, key: &BudgetKey, now: Timestamp) -> ArrayVec<u64, 2> {
    let rate = &rate.counted();
    let fp = key.fingerprint();
    let mut out = ArrayVec::new();
    match rate {
        Rate::SlidingWindow { seconds } => {
            let w = now.as_secs() / u64::from(seconds.get());
            out.push(mix64(fp ^ SLIDING_SALT[(w & 1) as usize]));
            out.push(mix64(fp ^ SLIDING_SALT[((w + 1) & 1) as usize]));
        }
        Rate::RollingWindow {
            millis,
            slot_millis,
        } => out.push(RollingSlots::cell(
            fp,
            RollingSlots::of_rate(*millis, *slot_millis).current(now),
        )),
        _ => out.push(fp),
    }
    out
}

#[inline]
fn window_bounds(rate: &Rate, now: Timestamp) -> (u64, u64) {
    let rate = &rate.counted();
    match rate {
        Rate::FixedWindow { seconds }
        | Rate::SlidingWindow { seconds }
        | Rate::Until { end: seconds } => {
            let w = u64::from(seconds.get());
            let start = now.as_secs() / w * w;
            (start, start + w)
        }
        Rate::CalendarMonth => month_bounds(now),
        Rate::Gcra { .. } | Rate::RollingWindow { .. } | Rate::Turns { .. } => {
            (now.as_secs(), now.as_secs())
        }
    }
}

/// GCRA's emission interval, `period / limit`, in nanoseconds but rounded
/// down to a whole microsecond (at least one): the resolution of a shared
/// store's clock, so that every store spaces units alike.
#[inline]
fn gcra_interval(period: Duration, limit: u32) -> u64 {
    let micros = duration_nanos(period) / NANOS_PER_MICRO;
    (micros / u64::from(limit.max(1))).max(1) * NANOS_PER_MICRO
}

fn verdict_for(fits: bool, never: bool, retry_after_nanos: u64) -> Verdict {
    if never {
        Verdict::Never
    } else if fits {
        Verdict::Admitted
    } else {
        Verdict::NotYet {
            retry_after: Duration::from_nanos(retry_after_nanos),
        }
    }
}

/// A GCRA budget's spacing worked out once, for a caller that decides the
/// same budget over and over (a keyed limiter): each call is then a compare
/// and an add on the cell, with no division and no [`crate::Decision`] built.
/// It decides exactly as [`Rate::Gcra`] does through the general decision
/// (a property test holds the two together), and writes the same cell.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GcraStep {
    /// Nanoseconds between two units (see [`gcra_interval`]).
    interval: u64,
    /// `interval × burst`: how far ahead of now the theoretical arrival time may run.
    capacity: u64,
    /// The largest cost that can ever fit: the smaller of limit and burst.
    max_cost: u32,
}

impl GcraStep {
    /// The step of `Rate::Gcra { period, burst }` with `limit` units per period.
    pub fn new(period: Duration, limit: u32, burst: NonZeroU32) -> Self {
        let interval = gcra_interval(period, limit);
        GcraStep {
            interval,
            capacity: interval.saturating_mul(u64::from(burst.get())),
            max_cost: limit.min(burst.get()),
        }
    }

    /// Spends `cost` units from a cell holding `cell` at `now`: `Ok` with the
    /// cell's new value (`cell` itself for a cost of 0), or `Err` with the
    /// nanoseconds until the cost fits (`u64::MAX`: it never will, the cost
    /// is above the limit or the burst).
    ///
    /// # Errors
    /// As above: the cost does not fit now.
    #[inline(always)]
    pub fn spend(&self, cell: u64, cost: u32, now: Timestamp) -> Result<u64, u64> {
        if cost > self.max_cost {
            return Err(u64::MAX);
        }
        let now = now.as_nanos();
        let stored_tat = (cell >> 32) * NANOS_PER_SEC + u64::from(low(cell) % 1_000_000_000);
        let tat = stored_tat.max(now);
        let spend = self.interval.saturating_mul(u64::from(cost));
        let after = (tat - now).saturating_add(spend);
        if after <= self.capacity {
            if cost == 0 {
                return Ok(cell);
            }
            let new_tat = tat.saturating_add(spend);
            Ok(pack(
                new_tat / NANOS_PER_SEC,
                (new_tat % NANOS_PER_SEC) as u32,
            ))
        } else {
            Err(after - self.capacity)
        }
    }
}

/// One one-cell budget's evaluation (every [`Rate`] but the sliding window):
/// its status before and after spending, and the value to write if every
/// budget of the decision admits.
#[derive(Clone, Copy, Debug)]
pub(crate) struct OneCell {
    pub(crate) verdict: Verdict,
    pub(crate) remaining_before: u32,
    pub(crate) remaining_after: u32,
    pub(crate) reset: u64,
    /// The cell's new value when the cost fits and is not zero.
    pub(crate) write: Option<u64>,
}

/// Evaluates spending `cost` of `limit` at `now` on a one-cell budget whose
/// cell holds `value`: the stores' hot path, always inlined. A sliding window
/// is evaluated on its current window's cell alone (a previous window of
/// zero); callers check [`Rate::is_one_cell`] first.
#[inline(always)]
pub(crate) fn evaluate_one(
    rate: &Rate,
    value: u64,
    limit: u32,
    cost: u32,
    now: Timestamp,
) -> OneCell {
    let rate = &rate.counted();
    let never = cost > limit;
    match rate {
        Rate::FixedWindow { .. } | Rate::CalendarMonth | Rate::Until { .. } => {
            let (_, end) = window_bounds(rate, now);
            let spent = if value >> 32 == end.min(u64::from(u32::MAX)) {
                low(value)
            } else {
                0
            };
            let spent = spent.min(limit);
            let fits = !never && spent.saturating_add(cost) <= limit;
            let remaining_before = limit - spent;
            let remaining_after = if fits {
                remaining_before - cost
            } else {
                remaining_before
            };
            let verdict = if fits {
                Verdict::Admitted
            } else {
                verdict_for(
                    false,
                    never,
                    (end * NANOS_PER_SEC).saturating_sub(now.as_nanos()),
                )
            };
            OneCell {
                verdict,
                remaining_before,
                remaining_after,
                reset: end,
                write: (fits && cost > 0).then(|| pack(end, spent + cost)),
            }
        }
        Rate::Gcra { period, burst } => {
            let t = gcra_interval(*period, limit);
            let capacity = t.saturating_mul(u64::from(burst.get()));
            let stored_tat = (value >> 32) * NANOS_PER_SEC + u64::from(low(value) % 1_000_000_000);
            let tat = stored_tat.max(now.as_nanos());
            let debt = tat - now.as_nanos();
            let spend = t.saturating_mul(u64::from(cost));
            let never = never || u64::from(cost) > u64::from(burst.get());
            let fits = !never && debt.saturating_add(spend) <= capacity;
            let remaining_before = (capacity.saturating_sub(debt) / t) as u32;
            // `spend` is `cost` whole intervals, so when it fits
            // `(capacity - debt - spend) / t` is `remaining_before - cost`:
            // one division fewer on the hot path.
            let remaining_after = if fits {
                remaining_before.saturating_sub(cost)
            } else {
                remaining_before
            };
            let new_tat = tat.saturating_add(spend);
            let drained = if fits { new_tat } else { tat };
            let retry = debt.saturating_add(spend).saturating_sub(capacity);
            OneCell {
                verdict: verdict_for(fits, never, retry),
                remaining_before,
                remaining_after,
                reset: drained.div_ceil(NANOS_PER_SEC),
                write: (fits && cost > 0)
                    .then(|| pack(new_tat / NANOS_PER_SEC, (new_tat % NANOS_PER_SEC) as u32)),
            }
        }
        Rate::RollingWindow {
            millis,
            slot_millis,
        } => {
            // The current slot alone (callers check `is_one_cell` first).
            let g = RollingSlots::of_rate(*millis, *slot_millis);
            let current = g.current(now);
            let count = RollingSlots::count(value, now);
            let e = rolling::evaluate(&g, current, &[count], limit, cost, now);
            OneCell {
                verdict: e.verdict,
                remaining_before: e.remaining_before,
                remaining_after: e.remaining_after,
                reset: e.reset,
                write: e.write.map(|(j, c)| g.value(j, c)),
            }
        }
        Rate::Turns { idle_secs } => {
            crate::turns::evaluate_cell(value, limit, cost, *idle_secs, now)
        }
        Rate::SlidingWindow { .. } => {
            let e = evaluate(rate, &[0], &[value], limit, cost, now);
            OneCell {
                verdict: e.verdict,
                remaining_before: e.remaining_before,
                remaining_after: e.remaining_after,
                reset: e.reset,
                write: e.writes.first().map(|&(_, v)| v),
            }
        }
    }
}

#[inline]
/// Evaluates spending `cost` of `limit` at `now`, given the cells' values (in
/// the order of [`cells`]).
pub(crate) fn evaluate(
    rate: &Rate,
    cell_keys: &[u64],
    values: &[u64],
    limit: u32,
    cost: u32,
    now: Timestamp,
) -> Evaluation {
    let rate = &rate.counted();
    let never = cost > limit;
    let mut writes = ArrayVec::new();
    match rate {
        Rate::SlidingWindow { seconds } => {
            let w_secs = u64::from(seconds.get());
            let (start, end) = window_bounds(rate, now);
            let w = u128::from(w_secs * NANOS_PER_SEC);
            // The current window's cell matters until the next one ends; the
            // previous window's cell until this one ends.
            let cur = if values[0] >> 32 == end + w_secs {
                low(values[0])
            } else {
                0
            };
            // A caller that passed only the current cell (see `decide_cell`)
            // gets a previous window of zero rather than a panic.
            let prev_cell = values.get(1).copied().unwrap_or(0);
            let prev = if prev_cell >> 32 == end {
                low(prev_cell)
            } else {
                0
            };
            let elapsed = u128::from(now.as_nanos() - start * NANOS_PER_SEC);
            let overlap = w - elapsed;
            // estimate = prev * overlap / w + cur, compared exactly in w units.
            let used = u128::from(prev) * overlap + u128::from(cur) * w;
            let cap = u128::from(limit) * w;
            let need = u128::from(cost) * w;
            let fits = !never && used + need <= cap;
            let remaining_before = (cap.saturating_sub(used) / w) as u32;
            let remaining_after = if fits {
                ((cap - used - need) / w) as u32
            } else {
                remaining_before
            };
            if fits && cost > 0 {
                writes.push((cell_keys[0], pack(end + w_secs, cur + cost)));
            }
            // A wait ends on the first whole microsecond at which the cost
            // fits (windows start on whole seconds): the resolution of a
            // shared store's clock, so that every store tells the same wait.
            let w_us = u128::from(w_secs) * u128::from(NANOS_PER_SEC / NANOS_PER_MICRO);
            let micro = u128::from(NANOS_PER_MICRO);
            let retry = if fits || never {
                0
            } else if u128::from(cur) + u128::from(cost) <= u128::from(limit) {
                // Wait in this window until prev's weight has fallen enough:
                // prev * (w - e) <= (limit - cur - cost) * w.
                let room = (u128::from(limit) - u128::from(cur) - u128::from(cost)) * w_us;
                let e_needed = w_us.saturating_sub(room / u128::from(prev.max(1))) * micro;
                (e_needed.saturating_sub(elapsed)) as u64
            } else {
                // Wait for the next window, then for cur's weight to fall.
                let to_end = (w - elapsed) as u64;
                let room = u128::from(limit - cost) * w_us;
                let e_needed = (w_us - (room / u128::from(cur.max(1))).min(w_us)) * micro;
                to_end + e_needed as u64
            };
            Evaluation {
                verdict: verdict_for(fits, never, retry),
                remaining_before,
                remaining_after,
                reset: end,
                writes,
            }
        }
        _ => {
            let e = evaluate_one(rate, values[0], limit, cost, now);
            if let Some(v) = e.write {
                writes.push((cell_keys[0], v));
            }
            Evaluation {
                verdict: e.verdict,
                remaining_before: e.remaining_before,
                remaining_after: e.remaining_after,
                reset: e.reset,
                writes,
            }
        }
    }
}

/// Charges or refunds `delta` units after the fact (see [`crate::adjust`]).
pub(crate) fn adjust(
    rate: &Rate,
    cell_keys: &[u64],
    values: &[u64],
    limit: u32,
    delta: i64,
    reserved_at: Timestamp,
    now: Timestamp,
) -> Evaluation {
    let rate = &rate.counted();
    let clamp = |spent: u32| -> u32 {
        let v = i64::from(spent).saturating_add(delta);
        v.clamp(0, i64::from(limit)) as u32
    };
    let mut writes = ArrayVec::new();
    let (_, end) = window_bounds(rate, now);
    let (_, reserved_end) = window_bounds(rate, reserved_at);
    match rate {
        Rate::FixedWindow { .. } | Rate::CalendarMonth | Rate::Until { .. } => {
            // Counted past the limit too (SPEC T3: a settled call can take the
            // budget below zero for the rest of its window): a later refund
            // then takes back from what was really counted, never from a
            // count clamped at the limit.
            let spent = if values[0] >> 32 == end.min(u64::from(u32::MAX)) {
                low(values[0])
            } else {
                0
            };
            let new = if delta < 0 && reserved_end != end {
                spent
            } else {
                i64::from(spent)
                    .saturating_add(delta)
                    .clamp(0, i64::from(u32::MAX)) as u32
            };
            if new != spent {
                writes.push((cell_keys[0], pack(end, new)));
            }
            Evaluation {
                verdict: Verdict::Admitted,
                remaining_before: limit.saturating_sub(spent),
                remaining_after: limit.saturating_sub(new),
                reset: end,
                writes,
            }
        }
        Rate::SlidingWindow { seconds } => {
            let w_secs = u64::from(seconds.get());
            // Index 0 is the current window's cell (identity end + w), index 1
            // the previous window's (identity end).
            let target = if delta >= 0 || reserved_end == end {
                Some((0, end + w_secs))
            } else if reserved_end + w_secs == end {
                Some((1, end))
            } else {
                None
            };
            if let Some((i, identity)) = target {
                let value = values.get(i).copied().unwrap_or(0);
                let spent = if value >> 32 == identity {
                    low(value).min(limit)
                } else {
                    0
                };
                let mut new = clamp(spent);
                if i == 0 && new > spent {
                    // A charge may fill the estimate up to the limit, no further.
                    let (start, _) = window_bounds(rate, now);
                    let w = u128::from(w_secs * NANOS_PER_SEC);
                    let prev_cell = values.get(1).copied().unwrap_or(0);
                    let prev = if prev_cell >> 32 == end {
                        low(prev_cell)
                    } else {
                        0
                    };
                    let overlap = w - u128::from(now.as_nanos() - start * NANOS_PER_SEC);
                    let room =
                        (u128::from(limit) * w).saturating_sub(u128::from(prev) * overlap) / w;
                    new = new.min((room as u32).max(spent));
                }
                if new != spent
                    && let Some(&key) = cell_keys.get(i)
                {
                    writes.push((key, pack(identity, new)));
                }
            }
            let mut e = evaluate(
                rate,
                cell_keys,
                &apply(values, cell_keys, &writes),
                limit,
                0,
                now,
            );
            e.writes = writes;
            e
        }
        Rate::RollingWindow {
            millis,
            slot_millis,
        } => {
            // The current slot alone: `decision::adjust` reads them all.
            let g = RollingSlots::of_rate(*millis, *slot_millis);
            let current = g.current(now);
            let counts = [RollingSlots::count(values[0], now)];
            let e = rolling::adjust(&g, current, &counts, limit, delta, reserved_at, now);
            if let Some((j, c)) = e.write {
                writes.push((cell_keys[0], g.value(j, c)));
            }
            Evaluation {
                verdict: Verdict::Admitted,
                remaining_before: e.remaining_before,
                remaining_after: e.remaining_after,
                reset: e.reset,
                writes,
            }
        }
        Rate::Turns { idle_secs } => {
            let e = crate::turns::adjust_cell(values[0], limit, delta, *idle_secs, now);
            if let Some(v) = e.write {
                writes.push((cell_keys[0], v));
            }
            Evaluation {
                verdict: Verdict::Admitted,
                remaining_before: e.remaining_before,
                remaining_after: e.remaining_after,
                reset: e.reset,
                writes,
            }
        }
        Rate::Gcra { period, burst } => {
            let t = gcra_interval(*period, limit);
            let capacity = t.saturating_mul(u64::from(burst.get()));
            let stored_tat =
                (values[0] >> 32) * NANOS_PER_SEC + u64::from(low(values[0]) % 1_000_000_000);
            let now_n = now.as_nanos();
            let tat = stored_tat.max(now_n);
            let shift = t.saturating_mul(delta.unsigned_abs());
            let new_tat = if delta >= 0 {
                tat.saturating_add(shift)
                    .min(now_n.saturating_add(capacity))
            } else {
                tat.saturating_sub(shift).max(now_n)
            };
            if new_tat != tat {
                writes.push((
                    cell_keys[0],
                    pack(new_tat / NANOS_PER_SEC, (new_tat % NANOS_PER_SEC) as u32),
                ));
            }
            Evaluation {
                verdict: Verdict::Admitted,
                remaining_before: (capacity.saturating_sub(tat - now_n) / t) as u32,
                remaining_after: (capacity.saturating_sub(new_tat - now_n) / t) as u32,
                reset: new_tat.div_ceil(NANOS_PER_SEC),
                writes,
            }
        }
    }
}

fn apply(values: &[u64], keys: &[u64], writes: &[(u64, u64)]) -> ArrayVec<u64, 2> {
    keys.iter()
        .zip(values)
        .map(|(k, v)| {
            writes
                .iter()
                .find(|(c, _)| c == k)
                .map_or(*v, |&(_, nv)| nv)
        })
        .collect()
}
