//! The bound of leased budgets (SPEC D4), for any interleaving: N simulated
//! replicas, each with a [`LeaseHolder`], on one store's cell; answers that
//! arrive late (a slow Redis: leases renewed early, while the rest of the
//! lease in hand is spent), leases that end by time, replicas killed holding a
//! lease.

use crate::support;

use std::collections::BTreeMap;

use proptest::prelude::*;
use sluice_core::{
    Budget, BudgetKey, CellRef, Decision, LeaseHolder, LeaseTerms, Ledger, Local, Mode, Rate,
    Timestamp, adjust, decide_cell, take_lease,
};
use support::{nz, secs};

const T0_NANOS: u64 = 1_764_460_800 * 1_000_000_000;

/// The store's one cell of the budget, as a ledger for [`adjust`].
struct OneCell(u64);

impl Ledger for OneCell {
    fn read(&mut self, _: CellRef<'_>) -> u64 {
        self.0
    }
    fn write(&mut self, _: CellRef<'_>, value: u64) {
        self.0 = value;
    }
}

#[derive(Clone, Debug)]
enum Event {
    /// A request of `cost` at replica `r`.
    Request { r: usize, cost: u32 },
    /// Replica `r`'s store answer (if one is on its way) arrives.
    Deliver { r: usize },
    /// Replica `r`'s sweep ends its lease if its time is up.
    Sweep { r: usize },
    /// Replica `r` dies (its lease and any answer on the way are lost) and starts again.
    Kill { r: usize },
    /// Time passes.
    Advance { millis: u64 },
}

fn event(replicas: usize) -> impl Strategy<Value = Event> {
    prop_oneof![
        6 => (0..replicas, 1u32..=3).prop_map(|(r, cost)| Event::Request { r, cost }),
        3 => (0..replicas).prop_map(|r| Event::Deliver { r }),
        1 => (0..replicas).prop_map(|r| Event::Sweep { r }),
        1 => (0..replicas).prop_map(|r| Event::Kill { r }),
        3 => (0u64..400).prop_map(|millis| Event::Advance { millis }),
    ]
}

struct Answer {
    cost: u32,
    decision: Decision,
    granted: u32,
}

struct Replica {
    holder: LeaseHolder,
    answer: Option<Answer>,
}

/// Runs `events` and returns the units admitted per window of the store's
/// clock: a request decided by the store (exactly, or the cost of the request
/// that took a lease) when the store decided it, as every exact decision is
/// counted (SPEC D2); a request admitted from a lease when its replica admits it.
fn run(
    limit: u32,
    window: u32,
    terms: LeaseTerms,
    replicas: usize,
    events: &[Event],
    instant_answers: bool,
) -> BTreeMap<u64, u64> {
    let budget = Budget {
        key: BudgetKey::new("read", b"hot"),
        rate: Rate::FixedWindow {
            seconds: secs(window),
        },
        limit,
        cost: 1,
    };
    let mut cell = OneCell(0);
    let mut now = Timestamp::from_nanos(T0_NANOS);
    let mut admitted: BTreeMap<u64, u64> = BTreeMap::new();
    let mut count = |at: Timestamp, units: u32| {
        *admitted
            .entry(at.as_secs() / u64::from(window))
            .or_default() += u64::from(units);
    };
    let fresh = || Replica {
        holder: LeaseHolder::new(terms),
        answer: None,
    };
    let mut rs: Vec<Replica> = (0..replicas).map(|_| fresh()).collect();
    let give = |cell: &mut OneCell, back: Option<sluice_core::GiveBack>, now: Timestamp| {
        if let Some(b) = back {
            adjust(&budget, -i64::from(b.units), b.reserved_at, cell, now);
        }
    };
    // What a lease of an earlier window, ended by a renewal, gives back.
    let deliver = |r: &mut Replica, now: Timestamp| -> Option<sluice_core::GiveBack> {
        let a = r.answer.take()?;
        if a.granted > 0 {
            return r.holder.granted(a.granted, a.cost, &a.decision, now);
        }
        let s = a.decision.statuses()[0];
        r.holder.refused(s.remaining, s.retry_after(), now);
        None
    };
    for e in events {
        match *e {
            Event::Request { r, cost } => {
                let rep = &mut rs[r];
                match rep.holder.decide(cost, now) {
                    Local::Admitted { .. } => count(now, cost),
                    Local::Refused { .. } => {}
                    Local::Ask { want, give_back } => {
                        give(&mut cell, give_back, now);
                        let (decision, granted) =
                            take_lease(&budget.with_cost(cost), &mut cell.0, now, want);
                        assert!(granted <= terms.units.get().max(cost));
                        if granted > 0 {
                            count(now, cost);
                        }
                        rep.answer = Some(Answer {
                            cost,
                            decision,
                            granted,
                        });
                        if instant_answers {
                            give(&mut cell, deliver(rep, now), now);
                        }
                    }
                    Local::Exact { give_back } => {
                        give(&mut cell, give_back, now);
                        let d = decide_cell(&budget.with_cost(cost), &mut cell.0, now, Mode::Spend);
                        if d.is_admitted() {
                            count(now, cost);
                        }
                    }
                }
            }
            Event::Deliver { r } => give(&mut cell, deliver(&mut rs[r], now), now),
            Event::Sweep { r } => {
                let back = rs[r].holder.end_if_over(now);
                give(&mut cell, back, now);
            }
            Event::Kill { r } => rs[r] = fresh(),
            Event::Advance { millis } => {
                now = now.saturating_add(std::time::Duration::from_millis(millis));
            }
        }
        // What the bound rests on: a replica holds at most one lease's units
        // of a budget, renewals included.
        for rep in &rs {
            assert!(
                rep.holder.held() <= terms.units.get(),
                "{e:?}: held {}",
                rep.holder.held()
            );
        }
    }
    admitted
}

fn case() -> impl Strategy<Value = (u32, u32, LeaseTerms, usize, Vec<Event>)> {
    (1u32..=20, 1u32..=3, 1usize..=4).prop_flat_map(|(limit, window, replicas)| {
        (
            Just(limit),
            Just(window),
            (1u32..=limit, 1u32..=1000).prop_map(|(u, ms)| LeaseTerms::new(nz(u), nz(ms))),
            Just(replicas),
            proptest::collection::vec(event(replicas), 0..300),
        )
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2_000, ..ProptestConfig::default() })]

    /// Any interleaving, answers as late as they come: admitted per window of
    /// the store's clock ≤ limit + N × lease.
    #[test]
    fn d4_replicas_admit_at_most_limit_plus_replicas_times_lease(
        (limit, window, terms, replicas, events) in case()
    ) {
        let bound = terms.bound(limit, replicas as u32);
        for (w, units) in run(limit, window, terms, replicas, &events, false) {
            prop_assert!(units <= bound, "window {w}: {units} admitted, bound {bound}");
        }
    }

    /// With answers that arrive as they are decided, a lease ends within its
    /// window and leasing is exact: admitted per window ≤ limit.
    #[test]
    fn d4_leases_answered_at_once_never_pass_the_limit(
        (limit, window, terms, replicas, events) in case()
    ) {
        for (w, units) in run(limit, window, terms, replicas, &events, true) {
            prop_assert!(units <= u64::from(limit), "window {w}: {units} admitted, limit {limit}");
        }
    }
}

/// The bound is reached, not only respected: a lease taken in a window's last
/// instant whose answer arrives after its end is spent in the next window,
/// beside that window's whole limit.
#[test]
fn d4_late_answers_can_spend_a_lease_past_its_window() {
    let terms = LeaseTerms::new(nz(4), nz(1000));
    let mut events = vec![Event::Advance { millis: 999 }];
    // Grow replica 0's lease to its full size within the first window.
    for _ in 0..3 {
        events.push(Event::Request { r: 0, cost: 1 });
        events.push(Event::Deliver { r: 0 });
        events.push(Event::Request { r: 0, cost: 1 });
    }
    events.push(Event::Request { r: 0, cost: 1 });
    events.push(Event::Request { r: 0, cost: 1 });
    events.push(Event::Advance { millis: 1 });
    events.push(Event::Deliver { r: 0 });
    for _ in 0..3 {
        events.push(Event::Request { r: 0, cost: 1 });
    }
    let admitted = run(100, 1, terms, 1, &events, false);
    assert!(admitted.values().all(|&u| u <= terms.bound(100, 1)));
    let second = admitted.values().nth(1).copied();
    assert_eq!(
        second,
        Some(3),
        "the first window's last lease (3 units past its request's) was spent in the second: {admitted:?}"
    );
}
