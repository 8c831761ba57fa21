//! The multi-budget decision: admit on every budget or on none.

use std::time::Duration;

use arrayvec::ArrayVec;

use crate::rate::{self, BudgetStatus, Rate, Verdict};
use crate::rolling::{self, RollingEval, RollingSlots};
use crate::{BudgetKey, Timestamp};

/// The most budgets one decision may touch. A JSON-RPC batch holding all four
/// classes, its IP ceiling, route buckets, weighted budgets and a few monthly
/// quotas fit; more is refused with [`DecisionError::TooManyBudgets`] (policies
/// are checked to stay within it).
pub const MAX_BUDGETS: usize = 12;

/// One budget a request wants to spend on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Budget {
    /// Which budget of which subject.
    pub key: BudgetKey,
    /// How it refills.
    pub rate: Rate,
    /// Units per window (or per period).
    pub limit: u32,
    /// Units this request spends (0 = only look).
    pub cost: u32,
}

impl Budget {
    /// A budget spending one unit of `limit` per fixed window of `seconds`.
    pub fn per_window(key: BudgetKey, limit: u32, seconds: std::num::NonZeroU32) -> Self {
        Budget {
            key,
            rate: Rate::FixedWindow { seconds },
            limit,
            cost: 1,
        }
    }

    /// The keys of the cells this budget writes at `now`, which are also
    /// the ones it reads but for a rolling window: one, or two for a sliding
    /// window. A store locks or fetches these before a decision. A rolling
    /// window's is its current slot; its older slots, read too, live where
    /// the current one does (see [`Budget::cell_at`]).
    #[inline]
    pub fn cells(&self, now: Timestamp) -> ArrayVec<u64, 2> {
        rate::cells(&self.rate, &self.key, now)
    }

    /// The key of the cell a [`Ledger`] is asked for as `index` at `now`:
    /// [`Budget::cells`]`[index]`, and for a rolling window the slot `index`
    /// slots before the current one. `None` past the budget's cells.
    pub fn cell_at(&self, index: usize, now: Timestamp) -> Option<u64> {
        match self.rate {
            Rate::RollingWindow {
                millis,
                slot_millis,
            } => {
                let g = RollingSlots::of_rate(millis, slot_millis);
                let j = g.current(now).checked_sub(index as u64)?;
                (j >= g.first(now)).then(|| RollingSlots::cell(self.key.fingerprint(), j))
            }
            _ => self.cells(now).get(index).copied(),
        }
    }

    /// The key of the one cell this budget keeps its state in, or `None`
    /// for a budget that needs two (see [`Rate::is_one_cell`]). Cheaper than
    /// [`Budget::cells`] on a store's hot path.
    #[inline(always)]
    pub fn one_cell(&self) -> Option<u64> {
        self.rate.is_one_cell().then(|| self.key.fingerprint())
    }

    /// The same budget with another key (e.g. a shared overflow subject).
    pub fn with_key(mut self, key: BudgetKey) -> Self {
        self.key = key;
        self
    }

    /// The same budget with another cost.
    pub fn with_cost(mut self, cost: u32) -> Self {
        self.cost = cost;
        self
    }
}

/// Whether a decision spends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Spend on every budget if all admit.
    Spend,
    /// Report what would happen; change nothing.
    Peek,
}

/// Errors of a decision's input (never of the budgets' state).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecisionError {
    /// More than [`MAX_BUDGETS`] budgets in one decision.
    #[error("a decision may touch at most {MAX_BUDGETS} budgets, {given} were given")]
    TooManyBudgets {
        /// How many were given.
        given: usize,
    },
}

/// Where a budget's state is read and written during one decision.
///
/// A store implements this over whatever it has locked for the decision; the
/// core calls [`Ledger::read`] for every cell first and [`Ledger::write`] only
/// if the whole decision admits.
pub trait Ledger {
    /// The value of a cell (`0` when absent).
    fn read(&mut self, at: CellRef<'_>) -> u64;
    /// Stores `value` in a cell.
    fn write(&mut self, at: CellRef<'_>, value: u64);
}

/// One cell of one budget, as a [`Ledger`] is asked for it.
#[derive(Clone, Copy, Debug)]
pub struct CellRef<'a> {
    /// The budget the cell belongs to.
    pub budget: &'a Budget,
    /// Which of the budget's cells (see [`Budget::cells`]).
    pub index: usize,
    /// The cell's key.
    pub cell: u64,
}

/// The outcome of one decision: admitted or not, and per budget what the
/// client should be told.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    admitted: bool,
    decided_at: Timestamp,
    statuses: ArrayVec<BudgetStatus, MAX_BUDGETS>,
}

impl Decision {
    /// A decision made elsewhere, e.g. inside a shared store's server-side
    /// script: admitted when every status admits. Statuses past
    /// [`MAX_BUDGETS`] are dropped.
    pub fn from_statuses(
        decided_at: Timestamp,
        statuses: impl IntoIterator<Item = BudgetStatus>,
    ) -> Self {
        let mut decision = Decision::empty(decided_at);
        decision.extend(statuses);
        decision
    }

    /// [`Decision::from_statuses`] in its box, written where it stays: only the
    /// statuses given are touched (a decision built and then boxed copies all of
    /// its [`MAX_BUDGETS`] slots).
    pub fn boxed_from_statuses(
        decided_at: Timestamp,
        statuses: impl IntoIterator<Item = BudgetStatus>,
    ) -> Box<Self> {
        let mut decision = Box::write(Box::new_uninit(), Decision::empty(decided_at));
        decision.extend(statuses);
        decision
    }

    /// A decision over no budgets yet: admitted.
    fn empty(decided_at: Timestamp) -> Self {
        Decision {
            admitted: true,
            decided_at,
            statuses: ArrayVec::new(),
        }
    }

    /// Adds statuses (those past [`MAX_BUDGETS`] dropped): admitted while every
    /// one admits.
    fn extend(&mut self, statuses: impl IntoIterator<Item = BudgetStatus>) {
        for status in statuses.into_iter().take(MAX_BUDGETS) {
            self.admitted &= status.verdict == Verdict::Admitted;
            // `take` keeps it within the capacity.
            let _ = self.statuses.try_push(status);
        }
    }

    /// True when every budget admitted (and, in [`Mode::Spend`], all were spent).
    pub fn is_admitted(&self) -> bool {
        self.admitted
    }

    /// The instant the decision was made at (pass it to [`adjust`] as
    /// `reserved_at`).
    pub fn decided_at(&self) -> Timestamp {
        self.decided_at
    }

    /// Per budget, in the order given.
    pub fn statuses(&self) -> &[BudgetStatus] {
        &self.statuses
    }

    /// True when some budget can never admit this cost (cost above its limit).
    pub fn is_never(&self) -> bool {
        self.statuses.iter().any(|s| s.verdict == Verdict::Never)
    }

    /// The index of the budget that binds: when admitted, the one with the
    /// fewest units left (the first of equals); when refused, the refusing
    /// one with the longest wait (a never-fitting one first).
    pub fn binding_index(&self) -> usize {
        let mut best = 0;
        for (i, s) in self.statuses.iter().enumerate() {
            let b = &self.statuses[best];
            let better = if self.admitted {
                s.remaining < b.remaining
            } else {
                match (s.retry_after(), b.retry_after()) {
                    (None, Some(_)) => true,
                    (Some(x), Some(y)) => x > y,
                    _ => false,
                }
            };
            if better {
                best = i;
            }
        }
        best
    }

    /// The binding budget's status (see [`Decision::binding_index`]); `None`
    /// only for a decision over no budgets.
    pub fn binding(&self) -> Option<&BudgetStatus> {
        self.statuses.get(self.binding_index())
    }

    /// When refused and a retry can succeed: how long until every budget has
    /// room. `None` when admitted or when a budget can never fit.
    pub fn retry_after(&self) -> Option<Duration> {
        if self.admitted || self.is_never() {
            return None;
        }
        self.statuses
            .iter()
            .filter_map(BudgetStatus::retry_after)
            .max()
    }
}

/// Decides `budgets` at `now` against `ledger`: all admit and (in
/// [`Mode::Spend`]) all are spent, or nothing changes.
///
/// # Errors
/// [`DecisionError::TooManyBudgets`] when given more than [`MAX_BUDGETS`].
#[inline]
pub fn decide<L: Ledger>(
    budgets: &[Budget],
    ledger: &mut L,
    now: Timestamp,
    mode: Mode,
) -> Result<Decision, DecisionError> {
    if budgets.len() > MAX_BUDGETS {
        return Err(DecisionError::TooManyBudgets {
            given: budgets.len(),
        });
    }
    Ok(decide_within_bounds(budgets, ledger, now, mode))
}

/// Decides one budget whose state is one cell (every [`Rate`] but the
/// sliding window, see [`Budget::cells`]), updating `cell` in place: a
/// store's hot path. A two-cell budget is decided on its first cell only, so
/// callers check `budget.cells(now).len() == 1` first.
///
/// Always inlined: out of line, the caller's frame gets the 272-byte
/// [`Decision`] by one more move (measured in the store's decision bench).
#[inline(always)]
pub fn decide_cell(budget: &Budget, cell: &mut u64, now: Timestamp, mode: Mode) -> Decision {
    // Built directly rather than through `InPlaceDecision`: on the hottest
    // path, moving a finished decision out of a builder costs a copy.
    let e = rate::evaluate_one(&budget.rate, *cell, budget.limit, budget.cost, now);
    let admitted = e.verdict == Verdict::Admitted;
    let spent = admitted && mode == Mode::Spend;
    if spent && let Some(v) = e.write {
        *cell = v;
    }
    let mut decision = Decision {
        admitted,
        decided_at: now,
        statuses: ArrayVec::new(),
    };
    decision.statuses.push(BudgetStatus {
        verdict: e.verdict,
        limit: budget.limit,
        remaining: if spent {
            e.remaining_after
        } else {
            e.remaining_before
        },
        reset: e.reset,
    });
    decision
}

/// An all-or-nothing decision over one-cell budgets whose cells a store holds
/// in place (under its locks), one budget at a time.
///
/// [`InPlaceDecision::step`] writes a cell only while every budget so far has
/// admitted; when a later budget refuses, the store restores the cells that
/// were written (it holds the locks, so nobody saw them). Every budget is
/// still evaluated, so the refusal reports the longest wait.
#[derive(Debug)]
pub struct InPlaceDecision {
    decision: Decision,
    remaining_before: [u32; MAX_BUDGETS],
    mode: Mode,
}

impl InPlaceDecision {
    /// An empty decision at `now`.
    #[inline]
    pub fn new(now: Timestamp, mode: Mode) -> Self {
        InPlaceDecision {
            decision: Decision {
                admitted: true,
                decided_at: now,
                statuses: ArrayVec::new(),
            },
            remaining_before: [0; MAX_BUDGETS],
            mode,
        }
    }

    /// Evaluates `budget` against its (first) cell's value. Returns `true`
    /// when it wrote `cell`, i.e. when the store must restore it should the
    /// decision end refused. Budgets past [`MAX_BUDGETS`] are ignored.
    #[inline]
    pub fn step(&mut self, budget: &Budget, cell: &mut u64) -> bool {
        let i = self.decision.statuses.len();
        if i == MAX_BUDGETS {
            return false;
        }
        let now = self.decision.decided_at;
        let e = rate::evaluate_one(&budget.rate, *cell, budget.limit, budget.cost, now);
        self.decision.admitted &= e.verdict == Verdict::Admitted;
        let mut wrote = false;
        if self.decision.admitted
            && self.mode == Mode::Spend
            && let Some(v) = e.write
        {
            *cell = v;
            wrote = true;
        }
        self.remaining_before[i] = e.remaining_before;
        self.decision.statuses.push(BudgetStatus {
            verdict: e.verdict,
            limit: budget.limit,
            remaining: e.remaining_after,
            reset: e.reset,
        });
        wrote
    }

    /// The decision. When it is not admitted (or only peeked), the statuses
    /// report the books as they stood.
    #[inline]
    pub fn finish(mut self) -> Decision {
        if !(self.decision.admitted && self.mode == Mode::Spend) {
            for (s, before) in self.decision.statuses.iter_mut().zip(self.remaining_before) {
                s.remaining = before;
            }
        }
        self.decision
    }
}

/// [`decide`] for callers that already hold at most [`MAX_BUDGETS`] budgets
/// (a store's one-budget fast path). Budgets past [`MAX_BUDGETS`] are
/// ignored, never a panic.
#[inline]
pub fn decide_within_bounds<L: Ledger>(
    budgets: &[Budget],
    ledger: &mut L,
    now: Timestamp,
    mode: Mode,
) -> Decision {
    let budgets = &budgets[..budgets.len().min(MAX_BUDGETS)];
    // Tentative cell values, so two budgets sharing a cell see each other:
    // (budget, cell index, cell, value).
    let mut pending: ArrayVec<(usize, usize, u64, u64), { 2 * MAX_BUDGETS }> = ArrayVec::new();
    // Built in place: a decision is a few hundred bytes, not worth moving.
    let mut decision = Decision {
        admitted: true,
        decided_at: now,
        statuses: ArrayVec::new(),
    };
    let mut remaining_before = [0u32; MAX_BUDGETS];
    for (i, b) in budgets.iter().enumerate() {
        if let Rate::RollingWindow {
            millis,
            slot_millis,
        } = b.rate
        {
            let g = RollingSlots::of_rate(millis, slot_millis);
            let (first, counts) = read_slots(b, &g, ledger, now, |cell| {
                pending
                    .iter()
                    .rev()
                    .find(|(j, _, c, _)| *c == cell && budgets[*j].key == b.key)
                    .map(|&(_, _, _, v)| v)
            });
            let e = rolling::evaluate(&g, first, &counts, b.limit, b.cost, now);
            decision.admitted &= e.verdict == Verdict::Admitted;
            if let Some((j, count)) = e.write {
                // The current slot: index 0.
                let cell = RollingSlots::cell(b.key.fingerprint(), j);
                pending.push((i, 0, cell, g.value(j, count)));
            }
            remaining_before[i] = e.remaining_before;
            decision.statuses.push(rolling_status(b, &e));
            continue;
        }
        let keys = rate::cells(&b.rate, &b.key, now);
        let mut values = [0u64; 2];
        for (index, &cell) in keys.iter().enumerate() {
            values[index] = match pending
                .iter()
                .rev()
                .find(|(j, _, c, _)| *c == cell && budgets[*j].key == b.key)
            {
                Some(&(_, _, _, v)) => v,
                None => ledger.read(CellRef {
                    budget: b,
                    index,
                    cell,
                }),
            };
        }
        let e = rate::evaluate(&b.rate, &keys, &values[..keys.len()], b.limit, b.cost, now);
        decision.admitted &= e.verdict == Verdict::Admitted;
        for &(cell, v) in &e.writes {
            let index = keys.iter().position(|&k| k == cell).unwrap_or(0);
            pending.push((i, index, cell, v));
        }
        remaining_before[i] = e.remaining_before;
        decision.statuses.push(BudgetStatus {
            verdict: e.verdict,
            limit: b.limit,
            remaining: e.remaining_after,
            reset: e.reset,
        });
    }
    if decision.admitted && mode == Mode::Spend {
        for &(i, index, cell, v) in &pending {
            let at = CellRef {
                budget: &budgets[i],
                index,
                cell,
            };
            ledger.write(at, v);
        }
    } else {
        // Nothing was spent: report the books as they stand.
        for (s, before) in decision.statuses.iter_mut().zip(remaining_before) {
            s.remaining = before;
        }
    }
    decision
}

/// A rolling window's slot counts at `now`, oldest (`first`) to current,
/// read through `ledger` unless `pending` holds a tentative value. The
/// current slot is read first (index 0): a store finds where the budget
/// lives by it.
fn read_slots<L: Ledger>(
    b: &Budget,
    g: &RollingSlots,
    ledger: &mut L,
    now: Timestamp,
    pending: impl Fn(u64) -> Option<u64>,
) -> (u64, Vec<u32>) {
    let (first, current) = (g.first(now), g.current(now));
    let fp = b.key.fingerprint();
    let len = usize::try_from(current - first + 1).unwrap_or(0);
    let mut counts = vec![0u32; len];
    for (index, slot) in counts.iter_mut().rev().enumerate() {
        let cell = RollingSlots::cell(fp, current - index as u64);
        let value = pending(cell).unwrap_or_else(|| {
            ledger.read(CellRef {
                budget: b,
                index,
                cell,
            })
        });
        *slot = RollingSlots::count(value, now);
    }
    (first, counts)
}

fn rolling_status(b: &Budget, e: &RollingEval) -> BudgetStatus {
    BudgetStatus {
        verdict: e.verdict,
        limit: b.limit,
        remaining: e.remaining_after,
        reset: e.reset,
    }
}

/// Charges (`delta > 0`) or refunds (`delta < 0`) `budget` after the fact, for
/// costs known only when a call ends. `reserved_at` is when the
/// original spend was decided.
///
/// The books never go below zero. A charge takes a fixed-window or monthly
/// budget past its limit when it must (SPEC T3: below zero for the rest of its
/// window; it admits nothing until then), and a refund takes back from what was
/// counted; the other rates' books stay within the limit. A refund for a window
/// that no longer counts is dropped (refunding it into the current window
/// would hand out units that were never spent there); a charge always lands
/// in the current window.
pub fn adjust<L: Ledger>(
    budget: &Budget,
    delta: i64,
    reserved_at: Timestamp,
    ledger: &mut L,
    now: Timestamp,
) -> BudgetStatus {
    if let Rate::RollingWindow {
        millis,
        slot_millis,
    } = budget.rate
    {
        let g = RollingSlots::of_rate(millis, slot_millis);
        let (first, counts) = read_slots(budget, &g, ledger, now, |_| None);
        let e = rolling::adjust(&g, first, &counts, budget.limit, delta, reserved_at, now);
        if let Some((j, count)) = e.write {
            let index = (g.current(now) - j) as usize;
            let cell = RollingSlots::cell(budget.key.fingerprint(), j);
            ledger.write(
                CellRef {
                    budget,
                    index,
                    cell,
                },
                g.value(j, count),
            );
        }
        return rolling_status(budget, &e);
    }
    let keys = rate::cells(&budget.rate, &budget.key, now);
    let values: ArrayVec<u64, 2> = keys
        .iter()
        .enumerate()
        .map(|(index, &cell)| {
            ledger.read(CellRef {
                budget,
                index,
                cell,
            })
        })
        .collect();
    let a = rate::adjust(
        &budget.rate,
        &keys,
        &values,
        budget.limit,
        delta,
        reserved_at,
        now,
    );
    for &(cell, v) in &a.writes {
        let index = keys.iter().position(|&k| k == cell).unwrap_or(0);
        ledger.write(
            CellRef {
                budget,
                index,
                cell,
            },
            v,
        );
    }
    BudgetStatus {
        verdict: Verdict::Admitted,
        limit: budget.limit,
        remaining: a.remaining_after,
        reset: a.reset,
    }
}
