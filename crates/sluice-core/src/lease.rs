//! Leased budgets (SPEC D4): a replica takes a lease of units of a fixed-window
//! budget from the shared store and decides from it on its own.
//!
//! Two halves, both pure:
//!
//! - the store's: [`take_lease`] spends at least a request's cost and at most
//!   the units asked for from a budget's cell, or nothing, in the decision the
//!   store makes anyway (the counter never passes the limit). What a lease did
//!   not spend goes back through [`crate::adjust`] with a negative delta and
//!   the lease's `decided_at`: a window already over takes nothing back.
//! - the replica's: a [`LeaseHolder`] per budget and subject says, for each
//!   request, whether the lease in hand admits it, whether the budget is known
//!   exhausted until its reset, or whether the store must be asked (and for how
//!   many units, sized to this replica's recent demand within the lease's
//!   `units`). A lease three quarters spent is renewed early: one request asks
//!   for what fits under `units` beside what is held, the others spend the
//!   rest meanwhile, and the grant adds to the lease in hand.
//!
//! The bound: over any window of the store's clock, N replicas admit at most
//! `limit + N × units` ([`LeaseTerms::bound`]). The counter of a window never
//! passes `limit`; a lease ends at the first of `millis` and its window's end,
//! both reckoned on the replica's clock from when its call was sent (before
//! the store decided it), so it ends before its window on the store's clock
//! as long as the two clocks keep pace; a replica holds at most one lease of a
//! budget at a time, so should they not (the store's clock steps ahead), at
//! most `units` of a window's leases are spent after it. What the replica last
//! measured of the store's clock ([`ClockGap`]) ends a lease once the store's
//! clock is surely past its window, and counts the units admitted when it may
//! be ([`LeaseCounts::past_window`]: the over-admission seen).
//!
//! ```
//! use std::num::NonZeroU32;
//! use sluice_core::{Budget, BudgetKey, LeaseHolder, LeaseTerms, Local, Timestamp, take_lease};
//!
//! let terms = LeaseTerms::new(NonZeroU32::new(4).unwrap(), NonZeroU32::new(500).unwrap());
//! assert_eq!(terms.bound(10, 3), 22);
//! let budget = Budget::per_window(BudgetKey::new("read", b"caller"), 10, NonZeroU32::new(1).unwrap());
//! let (mut cell, now) = (0u64, Timestamp::from_secs(1_764_460_800));
//! let mut holder = LeaseHolder::new(terms);
//! let Local::Ask { want, .. } = holder.decide(1, now) else { panic!() };
//! let (decision, granted) = take_lease(&budget, &mut cell, now, want);
//! assert!(decision.is_admitted());
//! assert!(holder.granted(granted, 1, &decision, now).is_none(), "nothing to give back");
//! ```

use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::decision::{CellRef, Decision, DecisionError, Ledger, Mode, decide, decide_cell};
use crate::{Budget, Rate, Timestamp};

/// The longest a lease may live, in milliseconds (SPEC D4: at most 1 s).
pub const MAX_LEASE_MILLIS: u32 = 1_000;

/// How a leased budget is leased: at most `units` at once, each lease for at
/// most `millis` milliseconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LeaseTerms {
    /// The most units one replica holds of one budget at once.
    pub units: NonZeroU32,
    /// The longest one lease lives, in milliseconds (at most
    /// [`MAX_LEASE_MILLIS`]; a longer one is cut to it).
    pub millis: NonZeroU32,
}

impl LeaseTerms {
    /// Terms of `units` for `millis` milliseconds (cut to [`MAX_LEASE_MILLIS`]).
    pub fn new(units: NonZeroU32, millis: NonZeroU32) -> Self {
        let millis = millis.min(NonZeroU32::new(MAX_LEASE_MILLIS).unwrap_or(NonZeroU32::MIN));
        LeaseTerms { units, millis }
    }

    /// The most `replicas` replicas admit of a budget of `limit` per window in
    /// any one window: `limit + replicas × units`.
    pub const fn bound(self, limit: u32, replicas: u32) -> u64 {
        limit as u64 + replicas as u64 * self.units.get() as u64
    }

    /// How long one lease lives at most.
    pub const fn duration(self) -> Duration {
        Duration::from_millis(self.millis.get() as u64)
    }
}

/// The store's half of a lease: spends at least `budget.cost` and at most
/// `want` units of `budget` from its `cell` at `now`, as many as are left, and
/// says how many (`0` when the decision refused, changing nothing).
///
/// Only a fixed window is leased: for any other rate the grant is the cost,
/// decided exactly as [`decide_cell`] decides it. A `want` below the cost is
/// taken as the cost.
pub fn take_lease(budget: &Budget, cell: &mut u64, now: Timestamp, want: u32) -> (Decision, u32) {
    if !matches!(budget.rate, Rate::FixedWindow { .. }) {
        let d = decide_cell(budget, cell, now, Mode::Spend);
        let granted = if d.is_admitted() { budget.cost } else { 0 };
        return (d, granted);
    }
    let peek = decide_cell(budget, cell, now, Mode::Peek);
    if !peek.is_admitted() {
        return (peek, 0);
    }
    let left = peek.statuses().first().map_or(budget.cost, |s| s.remaining);
    let grant = want.min(left).max(budget.cost);
    let d = decide_cell(&budget.with_cost(grant), cell, now, Mode::Spend);
    let granted = if d.is_admitted() { grant } else { 0 };
    (d, granted)
}

/// The store's half for a whole request (the reference model of a store's
/// `take_leases`): if every budget admits its cost at `now`, each is spent, a
/// fixed-window budget whose `wants` entry is above its cost by
/// [`take_lease`] (up to that many), every other by its cost; otherwise
/// nothing changes. Returns the decision (statuses after the grants) and the
/// units each budget granted (all 0 when refused). `wants` shorter than
/// `budgets` wants no more than the cost of the budgets past its end.
///
/// # Errors
/// [`DecisionError::TooManyBudgets`] when given more than [`crate::MAX_BUDGETS`].
pub fn take_leases<L: Ledger>(
    budgets: &[Budget],
    wants: &[u32],
    ledger: &mut L,
    now: Timestamp,
) -> Result<(Decision, Vec<u32>), DecisionError> {
    let peek = decide(budgets, ledger, now, Mode::Peek)?;
    if !peek.is_admitted() {
        return Ok((peek, vec![0; budgets.len()]));
    }
    let mut statuses = Vec::with_capacity(budgets.len());
    let mut grants = Vec::with_capacity(budgets.len());
    for (i, b) in budgets.iter().enumerate() {
        let want = wants.get(i).copied().unwrap_or(0);
        let (d, granted) = match (b.rate, b.one_cell()) {
            (Rate::FixedWindow { .. }, Some(cell)) if want > b.cost => {
                let at = CellRef {
                    budget: b,
                    index: 0,
                    cell,
                };
                let mut value = ledger.read(at);
                let (d, granted) = take_lease(b, &mut value, now, want);
                ledger.write(at, value);
                (d, granted)
            }
            _ => {
                let d = decide(std::slice::from_ref(b), ledger, now, Mode::Spend)?;
                let granted = if d.is_admitted() { b.cost } else { 0 };
                (d, granted)
            }
        };
        statuses.extend(d.statuses().first().copied());
        grants.push(granted);
    }
    Ok((Decision::from_statuses(now, statuses), grants))
}

/// What a replica's [`LeaseHolder`] says of one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Local {
    /// Admitted from the lease in hand, no store call; `remaining` units of the
    /// lease are left.
    Admitted {
        /// Units left in the lease.
        remaining: u32,
    },
    /// The budget was found exhausted: refused locally until its reset.
    Refused {
        /// The time until the budget's window resets.
        retry_after: Duration,
    },
    /// Ask the store: take a lease of up to `want` units (at least the cost)
    /// with [`take_lease`] in this request's decision, then tell the holder
    /// ([`LeaseHolder::granted`], [`LeaseHolder::refused`] or
    /// [`LeaseHolder::failed`]). `give_back`, if any, goes back first.
    Ask {
        /// Units to ask for.
        want: u32,
        /// The unspent units of the lease that just ended.
        give_back: Option<GiveBack>,
    },
    /// Another request of this replica is taking a lease: decide this one
    /// exactly on the store (as a budget without a lease). `give_back`, if
    /// any, goes back first.
    Exact {
        /// The unspent units of the lease that just ended.
        give_back: Option<GiveBack>,
    },
}

/// Units of an ended lease to give back: [`crate::adjust`] the budget by
/// `-units` with `reserved_at` (a window already over takes nothing back).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GiveBack {
    /// Units the lease did not spend.
    pub units: u32,
    /// When the store decided the lease ([`Decision::decided_at`], the store's clock).
    pub reserved_at: Timestamp,
}

/// The store's clock against this replica's, as last measured: at its last
/// answer the store's clock was at least `least` and at most `most`
/// nanoseconds ahead of this replica's (negative: behind). With the call sent
/// at `sent` and answered at `arrived` on this replica's clock and decided at
/// `decided_at` on the store's, `least = decided_at − arrived` and
/// `most = decided_at − sent`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClockGap {
    /// The least the store's clock was ahead, in nanoseconds.
    pub least: i64,
    /// The most the store's clock was ahead, in nanoseconds.
    pub most: i64,
}

impl ClockGap {
    /// One clock for both (tests driving store and replica by one fake clock).
    pub const SAME: ClockGap = ClockGap { least: 0, most: 0 };

    /// The gap measured by one call: sent at `sent` and answered at `arrived`
    /// (this replica's clock), decided at `decided_at` (the store's).
    pub fn measured(sent: Timestamp, arrived: Timestamp, decided_at: Timestamp) -> Self {
        let gap = |local: Timestamp| {
            let (d, l) = (
                i128::from(decided_at.as_nanos()),
                i128::from(local.as_nanos()),
            );
            i64::try_from(d - l).unwrap_or(if d > l { i64::MAX } else { i64::MIN })
        };
        let (least, most) = (gap(arrived.max(sent)), gap(sent));
        ClockGap { least, most }
    }

    /// `now` (this replica's clock) on the store's clock, at the least it was
    /// measured ahead: what a decision made here from a lease is stamped with,
    /// as the store stamps its own. While a lease is live it lies before the
    /// lease's window ends on the store's clock, so a settlement of the
    /// request (an adjustment at that time) goes to the window its units came
    /// from, and `Retry-After` and the reset's seconds are reckoned against
    /// the store's window as on every other answer.
    pub fn on_store_clock(self, now: Timestamp) -> Timestamp {
        Self::shift(now, self.least)
    }

    /// `now` (this replica's clock) moved by `by` nanoseconds: a time on the
    /// store's clock.
    fn shift(now: Timestamp, by: i64) -> Timestamp {
        let nanos = if by >= 0 {
            now.as_nanos().saturating_add(by.unsigned_abs())
        } else {
            now.as_nanos().saturating_sub(by.unsigned_abs())
        };
        Timestamp::from_nanos(nanos)
    }
}

/// Lease and ask ids, unique in the process: a holder replaced (the terms
/// changed, or it was forgotten to bound memory) starts from where the last
/// left off, so a refund or an answer meant for the one before never lands in
/// the new one.
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn next_id() -> u64 {
    NEXT_ID.fetch_add(1, Ordering::Relaxed)
}

/// What a [`LeaseHolder`] has done, for `/status` and `/metrics`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LeaseCounts {
    /// Leases taken (a grant of more than the cost).
    pub taken: u64,
    /// Leases ended with units left, given back.
    pub returned: u64,
    /// Leases ended by time (`millis`, their window's end, or the store's clock
    /// past their window).
    pub expired: u64,
    /// Requests decided without a store call (admitted from a lease, or refused
    /// as exhausted).
    pub saved: u64,
    /// Units admitted from a lease when, by the store's clock as last measured
    /// ([`ClockGap::most`]), its window may already have ended: the most of
    /// this holder's admissions that can be over a limit (the over-admission
    /// seen; 0 while the two clocks keep pace).
    pub past_window: u64,
}

#[derive(Clone, Copy, Debug)]
struct Held {
    /// Which lease it is ([`LeaseHolder::lease`]): unique in the process; an
    /// early renewal adds to it and keeps it.
    id: u64,
    left: u32,
    /// What it held when last granted or renewed (what "three quarters
    /// spent" is reckoned from).
    full: u32,
    /// False once an early renewal failed or was refused: the rest is then
    /// spent here, and the store asked again when it is dry or over.
    renews: bool,
    spent: u32,
    ends: Timestamp,
    reserved_at: Timestamp,
    /// Its window's end on the store's clock.
    window_end: Timestamp,
}

impl Held {
    /// Whether the store's clock, `gap` from this replica's `now`, is surely
    /// past its window (then it ends here, before its own time).
    fn window_surely_over(&self, now: Timestamp, gap: ClockGap) -> bool {
        ClockGap::shift(now, gap.least) >= self.window_end
    }

    /// Whether the store's clock may be past its window (a unit spent then is
    /// counted as perhaps over the limit).
    fn window_may_be_over(&self, now: Timestamp, gap: ClockGap) -> bool {
        ClockGap::shift(now, gap.most) >= self.window_end
    }

    /// Whether it may still be spent at `now`: neither its time nor, surely,
    /// its window is over.
    fn live_at(&self, now: Timestamp, gap: ClockGap) -> bool {
        now < self.ends && !self.window_surely_over(now, gap)
    }
}

/// One replica's lease of one budget of one subject, and what it knows of it.
///
/// Times given to it are this replica's clock; times of the store
/// ([`Decision::decided_at`], the status's reset) are used as durations, and
/// against this replica's clock only through a measured [`ClockGap`].
#[derive(Clone, Debug)]
pub struct LeaseHolder {
    terms: LeaseTerms,
    size: u32,
    held: Option<Held>,
    /// The ask in flight, if any ([`LeaseHolder::asking`]).
    asking: Option<u64>,
    exhausted_until: Option<Timestamp>,
    counts: LeaseCounts,
}

impl LeaseHolder {
    /// A holder with no lease, that will ask for one unit at first.
    pub fn new(terms: LeaseTerms) -> Self {
        LeaseHolder {
            terms,
            size: 1,
            held: None,
            asking: None,
            exhausted_until: None,
            counts: LeaseCounts::default(),
        }
    }

    /// The units the next lease holds past the asking request's cost (the
    /// whole grant, cost included, is at most the terms' `units`).
    pub fn next_size(&self) -> u32 {
        self.size
    }

    /// Units of the lease in hand (0 without one).
    pub fn held(&self) -> u32 {
        self.held.map_or(0, |h| h.left)
    }

    /// What the holder has done so far.
    pub fn counts(&self) -> LeaseCounts {
        self.counts
    }

    /// True when a request of this holder is asking the store for a lease.
    pub fn is_asking(&self) -> bool {
        self.asking.is_some()
    }

    /// The ask in flight, if any: an id unique in the process, given when
    /// [`LeaseHolder::decide_at`] answers [`Local::Ask`], so that its answer
    /// ([`LeaseHolder::granted`], [`LeaseHolder::refused`],
    /// [`LeaseHolder::failed`]) is given to this holder and this ask only.
    pub fn asking(&self) -> Option<u64> {
        self.asking
    }

    /// Ends the lease in hand if its time is up at `now`, giving back what it
    /// did not spend. A sweep calls this for holders no request touches.
    pub fn end_if_over(&mut self, now: Timestamp) -> Option<GiveBack> {
        let h = self.held?;
        if now < h.ends {
            return None;
        }
        self.held = None;
        self.counts.expired += 1;
        // It ended with units left: demand over a lease was what it spent.
        self.size = h.spent.clamp(1, self.terms.units.get());
        self.give_back(h)
    }

    fn give_back(&mut self, h: Held) -> Option<GiveBack> {
        (h.left > 0).then(|| {
            self.counts.returned += 1;
            GiveBack {
                units: h.left,
                reserved_at: h.reserved_at,
            }
        })
    }

    /// What to do with a request costing `cost` at `now`, the store's clock
    /// taken to be this replica's ([`ClockGap::SAME`]).
    pub fn decide(&mut self, cost: u32, now: Timestamp) -> Local {
        self.decide_at(cost, now, ClockGap::SAME)
    }

    /// What to do with a request costing `cost` at `now`, with `gap` what this
    /// replica last measured of the store's clock. A lease whose window the
    /// store's clock has surely passed (`now + gap.least` at or past its end)
    /// ends here, whatever its own time (the store's clock decides); units
    /// admitted when it may have (`now + gap.most`) are counted in
    /// [`LeaseCounts::past_window`].
    pub fn decide_at(&mut self, cost: u32, now: Timestamp, gap: ClockGap) -> Local {
        if let Some(until) = self.exhausted_until {
            if now < until {
                // Known exhausted: what the lease in hand still holds is
                // spent first (its units were counted), then refused here
                // until the reset. A lease whose time is up is left to the
                // sweep, which gives its leftovers back.
                if let Some(h) = self.held.as_mut()
                    && h.live_at(now, gap)
                    && h.left >= cost
                {
                    return Self::spend(h, &mut self.counts, cost, now, gap);
                }
                self.counts.saved += 1;
                return Local::Refused {
                    retry_after: until.saturating_since(now),
                };
            }
            self.exhausted_until = None;
        }
        let mut give_back = self.end_if_over(now);
        if let Some(h) = self.held
            && h.window_surely_over(now, gap)
        {
            // The store's clock is past its window, ahead of this replica's.
            self.held = None;
            self.counts.expired += 1;
            give_back = self.give_back(h);
        }
        if let Some(h) = self.held.as_mut() {
            if h.left >= cost {
                let units = self.terms.units.get();
                if h.renews
                    && self.asking.is_none()
                    && (h.left - cost).saturating_mul(4) < h.full
                    && h.left < units
                {
                    // Three quarters spent before its time: this request asks
                    // the store for its cost and the next units while the
                    // others go on spending the rest, so none waits for the
                    // store at the turn. What is held stays at most `units`.
                    self.asking = Some(next_id());
                    self.size = self.size.saturating_mul(2).min(units);
                    return Local::Ask {
                        want: cost.saturating_add(self.size.min(units - h.left)),
                        give_back: None,
                    };
                }
                return Self::spend(h, &mut self.counts, cost, now, gap);
            }
            // Dry before its time: this replica's demand outgrew it.
            let h = *h;
            self.held = None;
            self.size = self.size.saturating_mul(2).min(self.terms.units.get());
            give_back = self.give_back(h);
        }
        if self.asking.is_some() {
            return Local::Exact { give_back };
        }
        self.asking = Some(next_id());
        Local::Ask {
            want: cost
                .saturating_add(self.size)
                .min(self.terms.units.get())
                .max(cost),
            give_back,
        }
    }

    /// Admits a request of `cost` at `now` from `h` (which holds at least
    /// `cost`), counting it as saved, and as perhaps past its window when the
    /// store's clock may be past it.
    fn spend(
        h: &mut Held,
        counts: &mut LeaseCounts,
        cost: u32,
        now: Timestamp,
        gap: ClockGap,
    ) -> Local {
        h.left -= cost;
        h.spent += cost;
        counts.saved += 1;
        if h.window_may_be_over(now, gap) {
            counts.past_window += u64::from(cost);
        }
        Local::Admitted { remaining: h.left }
    }

    /// The store granted `granted` units (as [`take_lease`] said) for a request
    /// costing `cost`, in `decision`, whose call was sent at `now` (before the
    /// store decided it). The lease holds what is left past the cost, until
    /// `millis` from `now` or the window's end (the decision's reset, as a
    /// duration from its `decided_at`), whichever is first: reckoned from the
    /// send, it ends before its window does on the store's clock.
    ///
    /// A grant that renews the lease in hand early ([`LeaseHolder::decide_at`])
    /// adds to what it still holds when both are of one window (the ask was
    /// sized so that the sum is at most the terms' `units`), and the lease
    /// then lives from `now`; a lease in hand of an earlier window ends, and
    /// what it did not spend is returned, to be given back to its window.
    #[must_use = "a lease of an earlier window ended: give its units back"]
    pub fn granted(
        &mut self,
        granted: u32,
        cost: u32,
        decision: &Decision,
        now: Timestamp,
    ) -> Option<GiveBack> {
        self.asking = None;
        let left = granted.saturating_sub(cost);
        if left == 0 {
            return None;
        }
        let reset = decision.statuses().first().map_or(0, |s| s.reset);
        let to_reset = Timestamp::from_secs(reset).saturating_since(decision.decided_at());
        let life = self.terms.duration().min(to_reset);
        if life.is_zero() {
            // Taken in the window's last instant: nothing to hold it for.
            return None;
        }
        self.counts.taken += 1;
        let window_end = Timestamp::from_secs(reset);
        let ends = now.saturating_add(life);
        let mut back = None;
        match self.held.as_mut() {
            Some(h) if h.window_end == window_end => {
                // Renewed: one lease, at most `units`, living from this grant.
                h.left = h.left.saturating_add(left).min(self.terms.units.get());
                h.full = h.left;
                h.renews = true;
                // Recent demand is reckoned from here.
                h.spent = 0;
                h.ends = h.ends.max(ends);
                h.reserved_at = decision.decided_at();
                return None;
            }
            Some(_) => {
                if let Some(old) = self.held.take() {
                    self.counts.expired += 1;
                    back = self.give_back(old);
                }
            }
            None => {}
        }
        self.held = Some(Held {
            id: next_id(),
            left,
            full: left,
            renews: true,
            spent: 0,
            ends,
            reserved_at: decision.decided_at(),
            window_end,
        });
        back
    }

    /// The store refused the request at `now`. When the budget has nothing left
    /// (`remaining` 0) it is answered locally until `retry_after` from `now`.
    /// A lease in hand is then spent here, without asking to renew it early.
    pub fn refused(&mut self, remaining: u32, retry_after: Option<Duration>, now: Timestamp) {
        self.asking = None;
        self.no_renewal();
        if remaining == 0
            && let Some(wait) = retry_after
        {
            self.exhausted_until = Some(now.saturating_add(wait));
        }
    }

    /// Which lease is in hand, if any: what a request admitted from it
    /// ([`Local::Admitted`]) keeps to be refunded ([`LeaseHolder::refund`]).
    /// An early renewal adds to the lease and keeps it; a new lease (after
    /// one ended) is another.
    pub fn lease(&self) -> Option<u64> {
        self.held.map(|h| h.id)
    }

    /// Puts `cost` units back into lease `lease`: a request admitted from it
    /// ([`Local::Admitted`]) that another budget then refused (all or nothing).
    /// Nothing when that lease has ended since; never more than the terms'
    /// `units` held (past them the units stay unused until the window ends).
    pub fn refund(&mut self, lease: u64, cost: u32) {
        let units = self.terms.units.get();
        if let Some(h) = self.held.as_mut()
            && h.id == lease
        {
            h.left = h.left.saturating_add(cost).min(units.max(h.left));
            h.spent = h.spent.saturating_sub(cost);
        }
        self.counts.saved = self.counts.saved.saturating_sub(1);
    }

    /// Its terms.
    pub fn terms(&self) -> LeaseTerms {
        self.terms
    }

    /// Ends the lease in hand now, whatever its time (the terms changed, the
    /// holder is dropped), giving back what it did not spend.
    pub fn end(&mut self) -> Option<GiveBack> {
        let h = self.held.take()?;
        self.give_back(h)
    }

    /// The store could not answer: the next request asks again.
    ///
    /// A lease in hand is then spent here, without asking to renew it early
    /// (during an outage, the lease decides until it ends).
    pub fn failed(&mut self) {
        self.asking = None;
        self.no_renewal();
    }

    fn no_renewal(&mut self) {
        if let Some(h) = self.held.as_mut() {
            h.renews = false;
        }
    }

    /// True when the lease in hand holds at least `cost` units and will not be
    /// renewed early: a request whose renewal just failed or was refused can
    /// be decided again, from the lease.
    pub fn may_spend(&self, cost: u32) -> bool {
        self.held.is_some_and(|h| !h.renews && h.left >= cost)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::BudgetKey;

    const T0: u64 = 1_764_460_800;

    fn terms(units: u32, millis: u32) -> LeaseTerms {
        LeaseTerms::new(
            NonZeroU32::new(units).expect("units"),
            NonZeroU32::new(millis).expect("millis"),
        )
    }

    fn budget(limit: u32) -> Budget {
        Budget::per_window(BudgetKey::new("read", b"c"), limit, NonZeroU32::MIN)
    }

    fn at(ms: u64) -> Timestamp {
        Timestamp::from_nanos(T0 * 1_000_000_000 + ms * 1_000_000)
    }

    #[test]
    fn d4_take_lease_grants_between_cost_and_want_never_past_the_limit() {
        let b = budget(5);
        let mut cell = 0;
        let (d, g) = take_lease(&b, &mut cell, at(0), 3);
        assert!(d.is_admitted());
        assert_eq!(g, 3);
        let (d, g) = take_lease(&b, &mut cell, at(1), 3);
        assert!(d.is_admitted());
        assert_eq!(g, 2, "only what is left");
        let (d, g) = take_lease(&b, &mut cell, at(2), 3);
        assert!(!d.is_admitted());
        assert_eq!(g, 0);
        assert_eq!(d.statuses()[0].remaining, 0);
    }

    #[test]
    fn d4_lease_never_outlives_lease_ms_or_its_window() {
        let b = budget(100);
        let mut h = LeaseHolder::new(terms(10, 300));
        let mut cell = 0;
        // Grow the size to 10 by running dry.
        for _ in 0..6 {
            let now = at(10);
            match h.decide(1, now) {
                Local::Ask { want, .. } => {
                    let (d, g) = take_lease(&b.with_cost(1), &mut cell, now, want);
                    assert!(h.granted(g, 1, &d, now).is_none());
                }
                Local::Admitted { .. } => {}
                other => panic!("{other:?}"),
            }
        }
        assert!(h.held() > 0);
        assert!(h.end_if_over(at(309)).is_none());
        assert!(
            h.end_if_over(at(310)).is_some(),
            "300 ms after it was taken"
        );
        // Taken 100 ms before the window's end: ends with the window.
        let now = at(900);
        let Local::Ask { want, .. } = h.decide(1, now) else {
            panic!()
        };
        let (d, g) = take_lease(&b, &mut cell, now, want);
        assert!(h.granted(g, 1, &d, now).is_none());
        assert!(h.held() > 0);
        assert!(h.end_if_over(at(999)).is_none());
        let back = h.end_if_over(at(1000)).expect("ended");
        assert_eq!(back.reserved_at, now);
    }

    #[test]
    fn d4_exhausted_budget_is_refused_locally_until_its_reset() {
        let b = budget(1);
        let mut cell = 0;
        let mut h = LeaseHolder::new(terms(1, 1000));
        let now = at(200);
        let Local::Ask { want, .. } = h.decide(1, now) else {
            panic!()
        };
        let (d, g) = take_lease(&b, &mut cell, now, want);
        assert!(h.granted(g, 1, &d, now).is_none());
        let Local::Ask { want, .. } = h.decide(1, at(300)) else {
            panic!()
        };
        let (d, _) = take_lease(&b, &mut cell, at(300), want);
        let s = d.statuses()[0];
        h.refused(s.remaining, s.retry_after(), at(300));
        assert_eq!(
            h.decide(1, at(999)),
            Local::Refused {
                retry_after: Duration::from_millis(1)
            }
        );
        assert!(matches!(h.decide(1, at(1000)), Local::Ask { .. }));
        assert_eq!(h.counts().saved, 1);
    }

    #[test]
    fn d4_lease_size_follows_recent_demand_within_lease() {
        let mut h = LeaseHolder::new(terms(8, 100));
        let b = budget(1000);
        let mut cell = 0;
        let mut sizes = Vec::new();
        for i in 0..40 {
            let now = at(i);
            if let Local::Ask { want, give_back } = h.decide(1, now) {
                assert!(give_back.is_none(), "busy: every lease is spent");
                sizes.push(want);
                let (d, g) = take_lease(&b, &mut cell, now, want);
                assert!(h.granted(g, 1, &d, now).is_none());
            }
        }
        // Busy: each lease is renewed once three quarters of it are spent
        // (the asking request's cost on the store, the others spending what is
        // left meanwhile), doubling with demand: 1, 2, 4 units past the cost,
        // then what fits under the lease's 8 beside the 2 still held: 6.
        assert_eq!(sizes, [2, 3, 5, 7, 7, 7, 7, 7]);
        // Quiet: one request per lease's life.
        let mut wants = Vec::new();
        for i in 0..3 {
            let now = at(200 + i * 150);
            if let Local::Ask { want, .. } = h.decide(1, now) {
                wants.push(want);
                let (d, g) = take_lease(&b, &mut cell, now, want);
                assert!(h.granted(g, 1, &d, now).is_none());
            }
        }
        assert_eq!(
            wants.last(),
            Some(&2),
            "a quiet replica holds little: its cost and one"
        );
    }

    #[test]
    fn d4_a_refund_puts_a_refused_requests_units_back() {
        let mut h = holding(5, at(0));
        let before = h.held();
        let lease = h.lease().expect("a lease in hand");
        assert!(matches!(h.decide(1, at(1)), Local::Admitted { .. }));
        h.refund(lease, 1);
        assert_eq!(h.held(), before);
        assert_eq!(h.end().map(|g| g.units), Some(before));
    }

    #[test]
    fn d4_a_refund_or_an_ask_of_a_replaced_holder_never_lands_in_its_successor() {
        // A request admitted from the first holder's lease; a reload (or the
        // bound on holders) then replaces the holder, which takes a lease of
        // its own. The first lease's refund and ask are not the new one's.
        let old = holding(4, at(0));
        let old_lease = old.lease().expect("a lease in hand");
        let mut asking = LeaseHolder::new(terms(5, 1000));
        assert!(matches!(asking.decide(1, at(0)), Local::Ask { .. }));
        let old_ask = asking.asking().expect("an ask in flight");
        let mut new = holding(4, at(10));
        let held = new.held();
        new.refund(old_lease, 1);
        assert_eq!(new.held(), held, "the old lease's unit stays out");
        assert_ne!(new.lease(), Some(old_lease));
        assert!(matches!(new.decide(1, at(20)), Local::Admitted { .. }));
        let mut fresh = LeaseHolder::new(terms(5, 1000));
        assert!(matches!(fresh.decide(1, at(30)), Local::Ask { .. }));
        assert_ne!(fresh.asking(), Some(old_ask), "each ask is its own");
    }

    #[test]
    fn d4_one_ask_at_a_time_others_decide_exactly() {
        let mut h = LeaseHolder::new(terms(4, 100));
        assert!(matches!(h.decide(1, at(0)), Local::Ask { .. }));
        assert_eq!(h.decide(1, at(0)), Local::Exact { give_back: None });
        h.failed();
        assert!(matches!(h.decide(1, at(0)), Local::Ask { .. }));
    }

    /// A holder with a lease of `units` past the cost, taken at `now` from a
    /// fresh budget of 100 a second.
    fn holding(units: u32, now: Timestamp) -> LeaseHolder {
        let b = budget(100);
        let mut cell = 0;
        let mut h = LeaseHolder::new(terms(units + 1, 1000));
        h.size = units;
        let Local::Ask { want, .. } = h.decide(1, now) else {
            panic!("asks first")
        };
        let (d, g) = take_lease(&b, &mut cell, now, want);
        assert!(h.granted(g, 1, &d, now).is_none());
        assert_eq!(h.held(), units);
        h
    }

    #[test]
    fn d4_the_stores_clock_ahead_ends_a_lease_before_its_own_time() {
        // Taken 400 ms before the window's end: it would live until then.
        let mut h = holding(5, at(600));
        let ahead = |ms: i64| ClockGap {
            least: ms * 1_000_000,
            most: ms * 1_000_000 + 2_000_000,
        };
        assert!(matches!(
            h.decide_at(1, at(700), ahead(100)),
            Local::Admitted { remaining: 4 }
        ));
        // The store's clock is found 300 ms ahead: at 700 ms here it is past
        // the window's end there, so the lease ends and the store is asked.
        let Local::Ask { give_back, .. } = h.decide_at(1, at(700), ahead(300)) else {
            panic!("the store's clock decides")
        };
        assert_eq!(give_back.map(|g| g.units), Some(4));
        assert_eq!(h.counts().expired, 1);
        assert_eq!(h.counts().past_window, 0, "nothing admitted past it");
    }

    #[test]
    fn d4_units_admitted_when_the_window_may_be_over_are_counted() {
        let mut h = holding(5, at(600));
        // The store's clock 200..=350 ms ahead: at 680 ms here it may be past
        // the window's end (680 + 350 >= 1000) though surely not (680 + 200).
        let gap = ClockGap {
            least: 200_000_000,
            most: 350_000_000,
        };
        assert!(matches!(
            h.decide_at(1, at(640), gap),
            Local::Admitted { .. }
        ));
        assert_eq!(h.counts().past_window, 0);
        assert!(matches!(
            h.decide_at(2, at(680), gap),
            Local::Admitted { .. }
        ));
        assert_eq!(h.counts().past_window, 2, "its cost, in units");
        // One clock for both: never.
        let mut same = holding(5, at(600));
        for ms in [700, 900, 999] {
            assert!(matches!(same.decide(1, at(ms)), Local::Admitted { .. }));
        }
        assert_eq!(same.counts().past_window, 0);
    }

    #[test]
    fn d4_clock_gap_is_measured_from_send_and_arrival() {
        let gap = ClockGap::measured(at(100), at(103), at(1_101));
        assert_eq!(gap.least, 998_000_000);
        assert_eq!(gap.most, 1_001_000_000);
        let behind = ClockGap::measured(at(100), at(103), at(50));
        assert_eq!((behind.least, behind.most), (-53_000_000, -50_000_000));
        assert_eq!(
            ClockGap::shift(at(100), -1_000_000),
            at(99),
            "a time on the store's clock"
        );
    }

    #[test]
    fn d4_a_lease_renewed_early_adds_to_what_is_held_within_its_units() {
        let b = budget(100);
        let mut cell = 0;
        let mut h = holding(4, at(100));
        for _ in 0..3 {
            assert!(matches!(h.decide(1, at(200)), Local::Admitted { .. }));
        }
        // Three quarters spent: this request renews, the rest stays spendable.
        let Local::Ask {
            want,
            give_back: None,
        } = h.decide(1, at(200))
        else {
            panic!("renews early")
        };
        assert_eq!(
            want, 5,
            "its cost and the 4 that fit under 5 beside the 1 held"
        );
        assert!(matches!(
            h.decide(1, at(201)),
            Local::Admitted { remaining: 0 }
        ));
        let (d, g) = take_lease(&b, &mut cell, at(200), want);
        assert!(h.granted(g, 1, &d, at(200)).is_none(), "one lease, renewed");
        assert_eq!(h.held(), 4);
        assert_eq!(h.counts().taken, 2);
    }

    #[test]
    fn d4_a_refund_lands_in_the_lease_renewed_since_but_not_in_a_new_one() {
        let b = budget(100);
        let mut cell = 0;
        let mut h = holding(4, at(100));
        let first = h.lease().expect("a lease in hand");
        for _ in 0..3 {
            assert!(matches!(h.decide(1, at(200)), Local::Admitted { .. }));
        }
        let Local::Ask { want, .. } = h.decide(1, at(200)) else {
            panic!("renews early")
        };
        // Spent meanwhile: the request to be refunded.
        assert!(matches!(
            h.decide(1, at(201)),
            Local::Admitted { remaining: 0 }
        ));
        let (d, g) = take_lease(&b, &mut cell, at(200), want);
        assert!(h.granted(g, 1, &d, at(200)).is_none());
        assert_eq!(h.lease(), Some(first), "renewed: still the same lease");
        assert_eq!(h.held(), 4);
        // The request admitted before the renewal, refused by another budget.
        h.refund(first, 1);
        assert_eq!(h.held(), 5, "its unit back in the renewed lease");
        h.refund(first, 1);
        assert_eq!(h.held(), 5, "never more than the terms' units");
        // Once that lease has ended, the next one is another.
        assert!(h.end().is_some());
        let Local::Ask { want, .. } = h.decide(1, at(300)) else {
            panic!("asks")
        };
        let (d, g) = take_lease(&b, &mut cell, at(300), want);
        assert!(h.granted(g, 1, &d, at(300)).is_none());
        assert_ne!(h.lease(), Some(first));
        let held = h.held();
        h.refund(first, 1);
        assert_eq!(h.held(), held, "a refund for an ended lease is dropped");
    }

    #[test]
    fn d4_a_renewal_answered_in_the_next_window_gives_the_old_lease_back() {
        let b = budget(100);
        let mut h = holding(4, at(900));
        for _ in 0..3 {
            assert!(matches!(h.decide(1, at(950)), Local::Admitted { .. }));
        }
        let Local::Ask { want, .. } = h.decide(1, at(950)) else {
            panic!("renews early")
        };
        // The store decides it in its next window.
        let mut next = 0;
        let (d, g) = take_lease(&b, &mut next, at(1_001), want);
        let back = h.granted(g, 1, &d, at(950)).expect("the old lease ends");
        assert_eq!((back.units, back.reserved_at), (1, at(900)));
        assert_eq!(h.held(), 4, "the new window's lease");
    }

    #[test]
    fn d4_a_failed_renewal_leaves_the_lease_to_be_spent() {
        let mut h = holding(4, at(100));
        for _ in 0..3 {
            assert!(matches!(h.decide(1, at(200)), Local::Admitted { .. }));
        }
        assert!(matches!(h.decide(1, at(200)), Local::Ask { .. }));
        h.failed();
        assert!(h.may_spend(1), "decided again, from the lease");
        assert!(matches!(
            h.decide(1, at(200)),
            Local::Admitted { remaining: 0 }
        ));
        assert!(
            matches!(h.decide(1, at(200)), Local::Ask { .. }),
            "dry: asks"
        );
    }

    #[test]
    fn d4_bound_is_limit_plus_replicas_times_lease() {
        assert_eq!(terms(5, 1000).bound(100, 4), 120);
        assert_eq!(terms(1, 2000).millis.get(), MAX_LEASE_MILLIS);
    }
}
