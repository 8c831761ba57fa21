//! Leased budgets (SPEC D4): this replica's leases of its callers' class,
//! ceiling and bucket budgets (and of the rate-limit service's rules), and the
//! decisions made from them without the store.
//!
//! A request whose leased budgets all have a lease in hand (and no other
//! budget) is admitted here with no store call; one whose leased budget is
//! known exhausted is refused here until the budget's reset. Otherwise the
//! budgets without a lease go to the store in one call, those that may take a
//! lease asking for one ([`BudgetStore::take_leases`]); the units admitted from
//! leases are put back when the store refuses the rest (all or nothing).
//!
//! One request at a time asks the store for a budget's lease; the others of
//! this replica that need it wait for that answer (at most [`ASK_WAIT`], then
//! they are decided exactly), so a busy budget costs one store call a lease.
//! Leftovers of ended leases go back to the store in the next call this
//! replica makes to it (the same one call, [`BudgetStore::take_leases`]); a
//! sweep, at most every [`SWEEP_EVERY`], ends the leases no request touches.
//! When no request of a leased budget comes to do either, the upkeep
//! ([`Limiter::keep_leases`], every [`SWEEP_EVERY`] while leases are held or
//! leftovers wait, asleep otherwise) does both, and at shutdown ends every
//! lease and gives its leftovers back.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

use arrayvec::ArrayVec;
use parking_lot::Mutex;
use sluice_core::{
    Budget, BudgetKey, BudgetStatus, Clock, ClockGap, Decision, GiveBack, LeaseCounts, LeaseHolder,
    LeaseTerms, Local, MAX_BUDGETS, Rate, Timestamp, Verdict,
};
use sluice_policy::Policy;
use sluice_store::{BudgetStore, StoreError};
use tokio::sync::Notify;
use tokio::sync::futures::OwnedNotified;

use super::Limiter;
use crate::plan::{BudgetKind, Plan};

/// The most budgets (subject and scope) a replica keeps lease state for; past
/// it, a budget not yet held is decided exactly on the store.
pub const MAX_LEASED_KEYS: usize = 100_000;

/// Ended leases' leftovers waiting for the next store call, at most this many
/// (past it the oldest are dropped: units unused, never over-admitted).
const MAX_PENDING_GIVE_BACKS: usize = 4_096;

/// The longest a request waits for another request's lease to arrive before it
/// is decided exactly on the store.
pub const ASK_WAIT: Duration = Duration::from_secs(1);

/// How often, at most, the leases no request touches are looked at, to end
/// those whose time is up and give their leftovers back.
pub const SWEEP_EVERY: Duration = Duration::from_millis(100);

/// How many times a request waits for others' leases before it is decided
/// exactly.
const MAX_WAITS: usize = 4;

struct Entry {
    holder: LeaseHolder,
    /// The budget as last decided (what a sweep gives leftovers back to).
    budget: Budget,
    /// The store's remaining units after the last grant (what headers add the
    /// lease to), and its window's reset.
    remaining: u32,
    reset: u64,
    /// Woken when the holder's ask is answered (or abandoned).
    answered: Arc<Notify>,
}

/// The lease holders by budget key. Looked up twice a request or so, hence
/// foldhash (seeded per process: a caller cannot aim keys at one bucket)
/// rather than SipHash.
type LeaseMap = HashMap<BudgetKey, Entry, foldhash::fast::RandomState>;

/// This replica's leases and what they have saved (for `/status` and `/metrics`).
#[derive(Default)]
pub(crate) struct Leases {
    /// The clock leases live by: this replica's fallback store's unless set
    /// ([`Limiter::with_lease_clock`]).
    clock: Option<Arc<dyn Clock>>,
    entries: Mutex<LeaseMap>,
    pending: Mutex<Vec<(Budget, GiveBack)>>,
    /// When the last sweep ran (Unix nanoseconds of this replica's clock).
    swept: AtomicU64,
    taken: AtomicU64,
    returned: AtomicU64,
    expired: AtomicU64,
    saved: AtomicU64,
    past_window: AtomicU64,
    /// The store's clock against this replica's at the last answer
    /// ([`ClockGap`], nanoseconds): what ends a lease the store's clock has
    /// passed, and what says a unit may be admitted past its window.
    gap_least: AtomicI64,
    gap_most: AtomicI64,
    /// `sluice_lease_calls_saved_total`, looked up once (it moves on most
    /// requests of a leased budget).
    saved_counter: std::sync::OnceLock<metrics::Counter>,
    /// Woken when a lease is taken or a leftover queued: the upkeep's cue
    /// ([`Limiter::leases_to_keep`]).
    to_keep: Notify,
}

/// What the leases say of them, by snapshot (in `/status` as `leases`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct LeaseTally {
    /// Leases taken from the store.
    pub taken: u64,
    /// Leases that ended with units left, given back.
    pub returned: u64,
    /// Leases ended by time (`lease_ms`, their window's end, or the store's
    /// clock past their window).
    pub expired: u64,
    /// Store calls saved: requests decided from leases alone.
    #[serde(rename = "calls_saved")]
    pub saved: u64,
    /// The over-admission seen: units admitted from leases when, by the
    /// store's clock as last measured, their window may already have ended
    /// (the most this replica can have admitted over a limit; 0 while the
    /// clocks keep pace).
    pub over_admission_seen: u64,
}

/// One budget's part of a request before the store is asked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Part {
    /// Not leased (or no lease state to be had): decided on the store.
    Exact,
    /// Admitted from the lease in hand: its status, and which lease
    /// ([`LeaseHolder::lease`], kept across an early renewal).
    Local(BudgetStatus, u64),
    /// Take a lease of up to this many units in the store call, as the
    /// holder's ask of this id ([`LeaseHolder::asking`]).
    Ask(u32, u64),
}

/// What the leases say of a whole request.
enum Outcome {
    /// Decided here, no store call.
    Decided(Box<Decision>),
    /// Another request is asking for a lease this one needs: wait for it.
    Wait(OwnedNotified),
    /// Ask the store, budget by budget as the parts (filled in) say.
    Store,
}

fn terms_of(policy: &Policy, kind: &BudgetKind) -> Option<LeaseTerms> {
    match kind {
        BudgetKind::Class(c) => policy.classes.get(c.index())?.consistency.lease(),
        BudgetKind::Ceiling(i) => policy
            .ceilings
            .get(usize::try_from(*i).ok()?)?
            .consistency
            .lease(),
        BudgetKind::Bucket(i) => policy
            .buckets
            .get(usize::try_from(*i).ok()?)?
            .consistency
            .lease(),
        _ => None,
    }
}

/// Puts back the units of the parts admitted from leases, and lets go of the
/// asks of `parts` that will not be made (their waiters are woken).
fn undo(entries: &mut LeaseMap, budgets: &[Budget], parts: &[Part]) {
    for (b, part) in budgets.iter().zip(parts) {
        let Some(e) = entries.get_mut(&b.key) else {
            continue;
        };
        match part {
            // Back into the lease they came from, renewed since or not; if it
            // has ended since, they are lost (units unused, never over-admitted).
            Part::Local(_, lease) => e.holder.refund(*lease, b.cost),
            Part::Ask(_, ask) if e.holder.asking() == Some(*ask) => {
                e.holder.failed();
                e.answered.notify_waiters();
            }
            Part::Ask(..) | Part::Exact => {}
        }
    }
}

impl Leases {
    /// What it has done so far.
    pub(crate) fn tally(&self) -> LeaseTally {
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        LeaseTally {
            taken: load(&self.taken),
            returned: load(&self.returned),
            expired: load(&self.expired),
            saved: load(&self.saved),
            over_admission_seen: load(&self.past_window),
        }
    }

    /// What was last measured of the store's clock against this replica's.
    fn gap(&self) -> ClockGap {
        ClockGap {
            least: self.gap_least.load(Ordering::Relaxed),
            most: self.gap_most.load(Ordering::Relaxed),
        }
    }

    fn measured(&self, gap: ClockGap) {
        self.gap_least.store(gap.least, Ordering::Relaxed);
        self.gap_most.store(gap.most, Ordering::Relaxed);
    }

    /// Now, on the clock leases live by.
    fn now(&self, fallback: &dyn Clock) -> Timestamp {
        match &self.clock {
            Some(clock) => clock.now(),
            None => fallback.now(),
        }
    }

    fn count(&self, before: LeaseCounts, after: LeaseCounts) {
        let add = |a: &AtomicU64, name: &'static str, d: u64| {
            if d > 0 {
                a.fetch_add(d, Ordering::Relaxed);
                metrics::counter!(name).increment(d);
            }
        };
        add(
            &self.taken,
            "sluice_leases_taken_total",
            after.taken.saturating_sub(before.taken),
        );
        add(
            &self.returned,
            "sluice_leases_returned_total",
            after.returned.saturating_sub(before.returned),
        );
        add(
            &self.expired,
            "sluice_leases_expired_total",
            after.expired.saturating_sub(before.expired),
        );
        add(
            &self.past_window,
            "sluice_lease_over_admission_seen_total",
            after.past_window.saturating_sub(before.past_window),
        );
    }

    fn saved_one(&self) {
        self.saved.fetch_add(1, Ordering::Relaxed);
        self.saved_counter
            .get_or_init(|| metrics::counter!("sluice_lease_calls_saved_total"))
            .increment(1);
    }

    fn queue(&self, budget: Budget, back: Option<GiveBack>) {
        if let Some(back) = back {
            let mut pending = self.pending.lock();
            if pending.len() >= MAX_PENDING_GIVE_BACKS {
                pending.remove(0);
            }
            pending.push((budget.with_cost(1), back));
            drop(pending);
            self.to_keep.notify_one();
        }
    }

    /// The leftovers to give back in the next store call (at most
    /// [`MAX_BUDGETS`]; the rest wait for the call after).
    fn take_pending(&self) -> ArrayVec<(Budget, GiveBack), MAX_BUDGETS> {
        let mut pending = self.pending.lock();
        let n = pending.len().min(MAX_BUDGETS);
        pending.drain(..n).collect()
    }

    /// Ends the leases whose time is up at `now` that no request touched, at
    /// most every [`SWEEP_EVERY`] (their leftovers wait for the next call).
    fn sweep(&self, entries: &mut LeaseMap, now: Timestamp) {
        let last = self.swept.load(Ordering::Relaxed);
        let every = u64::try_from(SWEEP_EVERY.as_nanos()).unwrap_or(u64::MAX);
        if now.as_nanos() < last.saturating_add(every) {
            return;
        }
        self.end_leases(entries, now, false);
    }

    /// Ends the leases whose time is up at `now` (every lease when `all`),
    /// queueing their leftovers; true when a lease is still held.
    fn end_leases(&self, entries: &mut LeaseMap, now: Timestamp, all: bool) -> bool {
        self.swept.store(now.as_nanos(), Ordering::Relaxed);
        let mut held = false;
        for e in entries.values_mut() {
            let before = e.holder.counts();
            let back = if all {
                e.holder.end()
            } else {
                e.holder.end_if_over(now)
            };
            self.queue(e.budget, back);
            self.count(before, e.holder.counts());
            held |= e.holder.held() > 0;
        }
        held
    }
}

/// Lets go of a request's asks if it is dropped before the store answers (its
/// caller went away): the next request asks again, and the waiting are woken.
struct AskGuard<'a> {
    leases: &'a Leases,
    /// The budgets asked for, and each ask's id.
    asked: ArrayVec<(BudgetKey, u64), MAX_BUDGETS>,
}

impl AskGuard<'_> {
    fn disarm(&mut self) {
        self.asked.clear();
    }
}

impl Drop for AskGuard<'_> {
    fn drop(&mut self) {
        if self.asked.is_empty() {
            return;
        }
        let mut entries = self.leases.entries.lock();
        for (key, ask) in &self.asked {
            if let Some(e) = entries.get_mut(key)
                && e.holder.asking() == Some(*ask)
            {
                e.holder.failed();
                e.answered.notify_waiters();
            }
        }
    }
}

impl<S: BudgetStore> Limiter<S> {
    /// What this replica's leases have done (SPEC D4).
    pub fn lease_tally(&self) -> LeaseTally {
        self.leases.tally()
    }

    /// The upkeep of this replica's leases (SPEC D4), for when no request of a
    /// leased budget comes to do it: ends the leases whose time is up (every
    /// lease when `ending`, at shutdown) and gives what they did not spend
    /// back to the store, with the leftovers it kept while it did not answer.
    /// True while there is more to do ([`SWEEP_EVERY`] from now: leases held,
    /// leftovers waiting); otherwise wait for [`Limiter::leases_to_keep`].
    pub async fn keep_leases(&self, ending: bool) -> bool {
        if !self.store.leases() {
            return false;
        }
        let now = self.leases.now(self.fallback.clock());
        let held = {
            let mut entries = self.leases.entries.lock();
            self.leases.end_leases(&mut entries, now, ending)
        };
        // At most the whole queue's worth of calls, each of up to
        // `MAX_BUDGETS` leftovers; what a failed call may have sent is
        // dropped (units unused, never over-admitted), what it did not the
        // store keeps for its recovery.
        for _ in 0..MAX_PENDING_GIVE_BACKS.div_ceil(MAX_BUDGETS) {
            let backs = self.leases.take_pending();
            if backs.is_empty() && !self.store.holds_give_backs() {
                break;
            }
            if self.store.take_leases(&[], &[], &backs).await.is_err() {
                break;
            }
        }
        held || !self.leases.pending.lock().is_empty() || self.store.holds_give_backs()
    }

    /// Resolves once a lease is taken or a leftover queued since the last
    /// time it resolved: the upkeep's cue to [`Limiter::keep_leases`] again.
    pub async fn leases_to_keep(&self) {
        self.leases.to_keep.notified().await;
    }

    /// The same limiter with its leases living by `clock` (a test's fake
    /// clock) rather than the fallback store's; leases held so far are dropped,
    /// so call it before the first request.
    pub fn with_lease_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.leases = Arc::new(Leases {
            clock: Some(clock),
            ..Leases::default()
        });
        self
    }

    /// Decides `budgets` (the plan's, in its order) with the leases of those the
    /// policy leases; `None` when none of them is leased (or the store takes no
    /// leases), for the caller to decide exactly.
    pub(super) async fn decide_leased(
        &self,
        plan: &Plan,
        budgets: &[Budget],
    ) -> Option<Result<Box<Decision>, StoreError>> {
        if !self.store.leases() || budgets.len() != plan.kinds.len() {
            return None;
        }
        let terms: ArrayVec<Option<LeaseTerms>, MAX_BUDGETS> = plan
            .kinds
            .iter()
            .map(|k| terms_of(&self.policy, k))
            .collect();
        self.decide_by_leases(&terms, budgets, Some(plan)).await
    }

    /// Decides `budgets` from leases where `terms` (one for each, in order)
    /// lease a budget; `None` when none is leased (or the store takes no
    /// leases). A
    /// `plan`'s request falls back on its outage rule when the store does not
    /// answer; without one (a rate-limit service request, whose domain has its
    /// own rule) the store's error is returned.
    pub(crate) async fn decide_by_leases(
        &self,
        terms: &[Option<LeaseTerms>],
        budgets: &[Budget],
        plan: Option<&Plan>,
    ) -> Option<Result<Box<Decision>, StoreError>> {
        if !self.store.leases() || budgets.len() != terms.len() {
            return None;
        }
        if budgets.iter().any(|b| b.cost > b.limit) {
            // It can never fit: the store says so (no `Retry-After`, SPEC H2),
            // whatever a lease or a known exhausted budget would.
            return None;
        }
        let terms: ArrayVec<Option<LeaseTerms>, MAX_BUDGETS> = terms
            .iter()
            .zip(budgets)
            .map(|(t, b)| t.filter(|_| b.cost > 0 && matches!(b.rate, Rate::FixedWindow { .. })))
            .collect();
        if terms.iter().all(Option::is_none) {
            return None;
        }
        let mut waits = 0;
        let mut again = true;
        let mut parts: ArrayVec<Part, MAX_BUDGETS> = ArrayVec::new();
        loop {
            let now = self.leases.now(self.fallback.clock());
            match self.lease_parts(budgets, &terms, now, waits < MAX_WAITS, &mut parts) {
                Outcome::Decided(d) => return Some(Ok(d)),
                Outcome::Wait(answered) => {
                    waits += 1;
                    // Bounded: past it this request asks, or is decided exactly.
                    let _ = tokio::time::timeout(ASK_WAIT, answered).await;
                }
                Outcome::Store => {
                    // Boxed: the store's part is taken about once a lease, and
                    // its state (the call's budgets, asks and leftovers, the
                    // store's own future) would otherwise be moved with every
                    // request's future, those decided from leases too.
                    match Box::pin(self.decide_with_store(plan, budgets, &parts, now, again)).await
                    {
                        Ok(Stored::Decided(d)) => return Some(Ok(d)),
                        // An early renewal failed or was refused: decided
                        // again, from the lease it would have renewed.
                        Ok(Stored::Again) => again = false,
                        Err(e) => return Some(Err(e)),
                    }
                }
            }
        }
    }

    /// Each budget's part of a request at `now`, under the leases' lock: decided
    /// here, to wait for another request's ask (when `may_wait`), or the
    /// store's (as `parts` then say).
    fn lease_parts(
        &self,
        budgets: &[Budget],
        terms: &[Option<LeaseTerms>],
        now: Timestamp,
        may_wait: bool,
        parts: &mut ArrayVec<Part, MAX_BUDGETS>,
    ) -> Outcome {
        parts.clear();
        let mut refused: Option<(usize, Duration, u64)> = None;
        let mut wait: Option<OwnedNotified> = None;
        let gap = self.leases.gap();
        let mut entries = self.leases.entries.lock();
        self.leases.sweep(&mut entries, now);
        for (i, (b, t)) in budgets.iter().zip(terms).enumerate() {
            let Some(t) = *t else {
                parts.push(Part::Exact);
                continue;
            };
            if entries.len() >= MAX_LEASED_KEYS && !entries.contains_key(&b.key) {
                // Bounded: forget the holders holding nothing.
                entries.retain(|_, e| e.holder.held() > 0 || e.holder.is_asking());
                if entries.len() >= MAX_LEASED_KEYS {
                    parts.push(Part::Exact);
                    continue;
                }
            }
            let e = entries.entry(b.key).or_insert_with(|| Entry {
                holder: LeaseHolder::new(t),
                budget: *b,
                remaining: b.limit,
                reset: 0,
                answered: Arc::new(Notify::new()),
            });
            if e.holder.terms() != t || e.budget.limit != b.limit || e.budget.rate != b.rate {
                // A reload changed its terms or its limit: its lease ends here.
                let before = e.holder.counts();
                self.leases.queue(e.budget, e.holder.end());
                self.leases.count(before, e.holder.counts());
                let asking = e.holder.is_asking();
                e.holder = LeaseHolder::new(t);
                if asking {
                    // The old ask's answer is for the old terms: let it go.
                    e.answered.notify_waiters();
                }
            }
            e.budget = *b;
            let before = e.holder.counts();
            let part = match e.holder.decide_at(b.cost, now, gap) {
                Local::Admitted { remaining } => Part::Local(
                    BudgetStatus {
                        verdict: Verdict::Admitted,
                        limit: b.limit,
                        remaining: e.remaining.saturating_add(remaining),
                        reset: e.reset,
                    },
                    // Admitted from it, so a lease is in hand.
                    e.holder.lease().unwrap_or(u64::MAX),
                ),
                Local::Refused { retry_after } => {
                    refused.get_or_insert((i, retry_after, e.reset));
                    Part::Exact
                }
                Local::Ask { want, give_back } => {
                    self.leases.queue(*b, give_back);
                    Part::Ask(want, e.holder.asking().unwrap_or(0))
                }
                Local::Exact { give_back } => {
                    self.leases.queue(*b, give_back);
                    if may_wait && wait.is_none() {
                        wait = Some(Arc::clone(&e.answered).notified_owned());
                    }
                    Part::Exact
                }
            };
            self.leases.count(before, e.holder.counts());
            parts.push(part);
        }
        // Known exhausted: refused here, until its reset, no store call (SPEC
        // D4), the other budgets told as this replica last knew them.
        if let Some((index, retry_after, reset)) = refused {
            undo(&mut entries, budgets, parts);
            let statuses: ArrayVec<BudgetStatus, MAX_BUDGETS> = budgets
                .iter()
                .zip(parts.iter())
                .enumerate()
                .map(|(i, (b, p))| match p {
                    _ if i == index => BudgetStatus {
                        verdict: Verdict::NotYet { retry_after },
                        limit: b.limit,
                        remaining: 0,
                        reset,
                    },
                    Part::Local(s, _) => *s,
                    // Not spent: what the store last said of it, with the
                    // lease in hand (an exact budget's state is not known
                    // here: it is shown whole, as a store that was not asked).
                    _ => {
                        let (remaining, last_reset) =
                            entries.get(&b.key).map_or((b.limit, 0), |e| {
                                (e.remaining.saturating_add(e.holder.held()), e.reset)
                            });
                        BudgetStatus {
                            verdict: Verdict::Admitted,
                            limit: b.limit,
                            remaining: remaining.min(b.limit),
                            reset: if last_reset == 0 { reset } else { last_reset },
                        }
                    }
                })
                .collect();
            drop(entries);
            self.leases.saved_one();
            return Outcome::Decided(Decision::boxed_from_statuses(
                gap.on_store_clock(now),
                statuses,
            ));
        }
        if let Some(wait) = wait {
            // Another request of this replica is asking for a lease this one
            // needs: nothing is spent meanwhile, and this one decides again
            // once that answer is in.
            undo(&mut entries, budgets, parts);
            return Outcome::Wait(wait);
        }
        drop(entries);
        if parts.iter().all(|p| matches!(p, Part::Local(..))) {
            self.leases.saved_one();
            let statuses = parts.iter().filter_map(|p| match p {
                Part::Local(s, _) => Some(*s),
                _ => None,
            });
            return Outcome::Decided(Decision::boxed_from_statuses(
                gap.on_store_clock(now),
                statuses,
            ));
        }
        Outcome::Store
    }

    /// The store's part: the budgets not admitted from leases, in one call
    /// (taking leases where asked, giving leftovers back), then the leases'
    /// part of the answer. When `may_retry` and an ask that renewed a lease
    /// early failed or was refused while that lease still holds the
    /// request's cost, nothing is spent and the request is to be decided
    /// again ([`Stored::Again`]), from that lease.
    async fn decide_with_store(
        &self,
        plan: Option<&Plan>,
        budgets: &[Budget],
        parts: &[Part],
        now: Timestamp,
        may_retry: bool,
    ) -> Result<Stored, StoreError> {
        let mut guard = AskGuard {
            leases: &self.leases,
            asked: budgets
                .iter()
                .zip(parts)
                .filter_map(|(b, p)| match p {
                    Part::Ask(_, ask) => Some((b.key, *ask)),
                    _ => None,
                })
                .collect(),
        };
        let sent: ArrayVec<Budget, MAX_BUDGETS> = budgets
            .iter()
            .zip(parts)
            .filter(|(_, p)| !matches!(p, Part::Local(..)))
            .map(|(b, _)| *b)
            .collect();
        let wants: ArrayVec<u32, MAX_BUDGETS> = parts
            .iter()
            .filter(|p| !matches!(p, Part::Local(..)))
            .map(|p| match p {
                Part::Ask(w, _) => *w,
                _ => 0,
            })
            .collect();
        let backs = self.leases.take_pending();
        let answer = if wants.iter().any(|&w| w > 0) || !backs.is_empty() {
            // Leftovers given back in this call. If it fails, the store
            // keeps those it knows it did not send (and, while it does not
            // answer, holds them all) for the call after its recovery; those
            // of a call that may have run are dropped (units unused, never
            // over-admitted).
            self.store.take_leases(&sent, &wants, &backs).await
        } else {
            self.store
                .decide_from(&sent, plan.map_or(0, |p| p.network))
                .await
                .map(|d| (d, Vec::new()))
        };
        let (d, grants) = match answer {
            Ok(a) => {
                self.set_degraded(false);
                let arrived = self.leases.now(self.fallback.clock());
                self.leases
                    .measured(ClockGap::measured(now, arrived, a.0.decided_at()));
                a
            }
            Err(e) => {
                guard.disarm();
                {
                    let mut entries = self.leases.entries.lock();
                    undo(&mut entries, budgets, parts);
                    if may_retry && may_spend(&entries, budgets, parts) {
                        return Ok(Stored::Again);
                    }
                }
                let StoreError::Unavailable(why) = e else {
                    return Err(e);
                };
                self.set_degraded(true);
                return match plan {
                    Some(plan) if self.fails_open(plan) => {
                        self.metrics.local.increment(1);
                        self.counts.local.fetch_add(1, Ordering::Relaxed);
                        self.decide_locally(plan, budgets)
                            .map(|d| Stored::Decided(Box::new(d)))
                    }
                    _ => Err(StoreError::Unavailable(why)),
                };
            }
        };
        guard.disarm();
        let mut statuses: ArrayVec<BudgetStatus, MAX_BUDGETS> = ArrayVec::new();
        let mut from_store = d.statuses().iter().zip(0..);
        let mut entries = self.leases.entries.lock();
        for (b, p) in budgets.iter().zip(parts) {
            if let Part::Local(s, _) = p {
                statuses.push(*s);
                continue;
            }
            let Some((&s, j)) = from_store.next() else {
                break;
            };
            let ask = match p {
                Part::Ask(_, ask) => Some(*ask),
                _ => None,
            };
            match entries.get_mut(&b.key) {
                // The answer to this holder's ask (a holder replaced meanwhile
                // asks on its own: its ask has another id).
                Some(e) if ask.is_some() && e.holder.asking() == ask => {
                    let before = e.holder.counts();
                    if d.is_admitted() {
                        let granted = grants.get(j).copied().unwrap_or(b.cost);
                        let one = Decision::from_statuses(d.decided_at(), [s]);
                        // A lease of an earlier window, renewed into this
                        // one's: its leftovers go back to their window.
                        let back = e.holder.granted(granted, b.cost, &one, now);
                        self.leases.queue(e.budget, back);
                        self.leases.to_keep.notify_one();
                        e.remaining = s.remaining;
                        e.reset = s.reset;
                        let held = e.holder.held();
                        statuses.push(BudgetStatus {
                            remaining: s.remaining.saturating_add(held),
                            ..s
                        });
                    } else {
                        e.holder.refused(s.remaining, s.retry_after(), now);
                        e.reset = s.reset;
                        statuses.push(s);
                    }
                    e.answered.notify_waiters();
                    self.leases.count(before, e.holder.counts());
                }
                Some(e) if ask.is_some() => {
                    // The holder was replaced meanwhile (a reload, or the
                    // bound on holders): what this call took past the cost
                    // goes back.
                    let granted = grants.get(j).copied().unwrap_or(b.cost);
                    if d.is_admitted() && granted > b.cost {
                        self.leases.queue(
                            e.budget,
                            Some(GiveBack {
                                units: granted - b.cost,
                                reserved_at: d.decided_at(),
                            }),
                        );
                    }
                    statuses.push(s);
                }
                _ => statuses.push(s),
            }
        }
        if !d.is_admitted() {
            undo(
                &mut entries,
                budgets,
                &parts
                    .iter()
                    .map(|p| match p {
                        // The asks are answered: only the local units go back.
                        Part::Ask(..) => Part::Exact,
                        other => *other,
                    })
                    .collect::<ArrayVec<Part, MAX_BUDGETS>>(),
            );
            if may_retry && may_spend(&entries, budgets, parts) {
                return Ok(Stored::Again);
            }
        }
        drop(entries);
        Ok(Stored::Decided(Decision::boxed_from_statuses(
            d.decided_at(),
            statuses,
        )))
    }
}

/// What the store's part of a request came to.
enum Stored {
    /// The request's decision.
    Decided(Box<Decision>),
    /// Nothing spent: decide it again (an early renewal failed or was refused,
    /// and the lease it would have renewed holds the request's cost).
    Again,
}

/// True when a budget of `parts` that asked for a lease may now be spent from
/// the lease in hand ([`LeaseHolder::may_spend`]).
fn may_spend(entries: &LeaseMap, budgets: &[Budget], parts: &[Part]) -> bool {
    budgets.iter().zip(parts).any(|(b, p)| {
        matches!(p, Part::Ask(..))
            && entries
                .get(&b.key)
                .is_some_and(|e| e.holder.may_spend(b.cost))
    })
}
