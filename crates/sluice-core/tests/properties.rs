//! Invariants of the multi-budget decision, for any arrival sequence.

use crate::support;

use std::collections::HashMap;
use std::time::Duration;

use proptest::prelude::*;
use sluice_core::{Budget, BudgetKey, Mode, Rate, Timestamp, adjust, decide};
use support::{MapLedger, nz, secs};

const T0: u64 = 1_764_460_800;

/// The GCRA budget of [`budgets`]: 7 units per 3 s (an interval of
/// 428.57 ms, not a whole microsecond), at most 4 back to back.
const GCRA_PERIOD: Duration = Duration::from_secs(3);
const GCRA_LIMIT: u32 = 7;
const GCRA_BURST: u32 = 4;

/// The rolling window of [`budgets`]: 20 units in any 4 s, in 250 ms slots.
const ROLLING_MILLIS: u32 = 4_000;
const ROLLING_LIMIT: u32 = 20;

/// Six budgets of different shapes, one of every rate; requests pick a
/// subset and costs.
fn budgets() -> Vec<Budget> {
    vec![
        Budget::per_window(BudgetKey::new("expensive", b"a"), 30, secs(60)),
        Budget::per_window(BudgetKey::new("ip", b"ip"), 50, secs(10)),
        Budget {
            key: BudgetKey::new("sliding", b"a"),
            rate: Rate::SlidingWindow { seconds: secs(20) },
            limit: 25,
            cost: 1,
        },
        Budget {
            key: BudgetKey::new("quota", b"ws"),
            rate: Rate::CalendarMonth,
            limit: 400,
            cost: 1,
        },
        Budget {
            key: BudgetKey::new("rpm", b"a"),
            rate: Rate::Gcra {
                period: GCRA_PERIOD,
                burst: secs(GCRA_BURST),
            },
            limit: GCRA_LIMIT,
            cost: 1,
        },
        Budget {
            key: BudgetKey::new("tpm", b"a"),
            rate: Rate::RollingWindow {
                millis: nz(ROLLING_MILLIS),
                slot_millis: nz(250),
            },
            limit: ROLLING_LIMIT,
            cost: 1,
        },
    ]
}

/// The most units a GCRA of `limit` per `period` with `burst` may admit at
/// instants within `span` of each other: the burst, plus one unit per
/// emission interval (the interval rounded down to a whole microsecond, as
/// the algorithm does).
fn gcra_bound(period: Duration, limit: u32, burst: u32, span: Duration) -> u64 {
    let t = period.as_micros() / u128::from(limit) * 1_000;
    u64::from(burst) + (span.as_nanos() / t) as u64
}

fn window_of(b: &Budget, t: Timestamp) -> u64 {
    match b.rate {
        Rate::FixedWindow { seconds }
        | Rate::SlidingWindow { seconds }
        | Rate::Until { end: seconds } => t.as_secs() / u64::from(seconds.get()),
        Rate::CalendarMonth => sluice_core::month_of(t).start,
        Rate::Gcra { .. } | Rate::RollingWindow { .. } | Rate::Turns { .. } => 0,
    }
}

#[derive(Clone, Debug)]
struct Arrival {
    gap_ms: u64,
    picks: Vec<bool>,
    costs: Vec<u32>,
}

fn arrivals() -> impl Strategy<Value = Vec<Arrival>> {
    prop::collection::vec(
        (
            0u64..3_000,
            prop::collection::vec(any::<bool>(), 6),
            prop::collection::vec(0u32..12, 6),
        )
            .prop_map(|(gap_ms, picks, costs)| Arrival {
                gap_ms,
                picks,
                costs,
            }),
        1..400,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Admitted units never exceed the limit in any aligned window of any
    /// budget, and a refused decision changes no budget.
    #[test]
    fn admitted_never_exceeds_limit_and_refusal_spends_nothing(seq in arrivals()) {
        let all = budgets();
        let mut ledger = MapLedger::default();
        let mut spent: HashMap<(usize, u64), u64> = HashMap::new();
        // GCRA and rolling-window admissions: (when, units).
        let mut paced: Vec<(Timestamp, u64)> = Vec::new();
        let mut rolled: Vec<(Timestamp, u64)> = Vec::new();
        let mut now = Timestamp::from_secs(T0 + 17);
        for a in &seq {
            now = now.saturating_add(Duration::from_millis(a.gap_ms));
            let chosen: Vec<(usize, Budget)> = all
                .iter()
                .enumerate()
                .filter(|(i, _)| a.picks[*i])
                .map(|(i, b)| (i, b.with_cost(a.costs[i])))
                .collect();
            let req: Vec<Budget> = chosen.iter().map(|(_, b)| *b).collect();
            let before = ledger.clone();
            let d = decide(&req, &mut ledger, now, Mode::Spend).expect("decide");
            if d.is_admitted() {
                for (i, b) in &chosen {
                    if let Rate::Gcra { .. } = b.rate {
                        paced.push((now, u64::from(b.cost)));
                    } else if let Rate::RollingWindow { .. } = b.rate {
                        rolled.push((now, u64::from(b.cost)));
                    } else {
                        *spent.entry((*i, window_of(b, now))).or_default() += u64::from(b.cost);
                    }
                }
            } else {
                prop_assert_eq!(&ledger, &before, "a refusal changed the books");
            }
            for (s, (_, b)) in d.statuses().iter().zip(&chosen) {
                prop_assert!(s.remaining <= b.limit);
            }
        }
        for ((i, w), units) in spent {
            prop_assert!(units <= u64::from(all[i].limit), "budget {} window {} spent {}", i, w, units);
        }
        // GCRA: between any two admissions, at most the burst plus one unit
        // per interval elapsed.
        for (a, &(start, _)) in paced.iter().enumerate() {
            let mut units = 0;
            for &(at, cost) in &paced[a..] {
                units += cost;
                let bound = gcra_bound(GCRA_PERIOD, GCRA_LIMIT, GCRA_BURST, at.saturating_since(start));
                prop_assert!(units <= bound, "{} units in {:?}, at most {}", units, at.saturating_since(start), bound);
            }
        }
        // Rolling window: no interval of its length holds more than the limit.
        let span = Duration::from_millis(u64::from(ROLLING_MILLIS));
        for (a, &(start, _)) in rolled.iter().enumerate() {
            let units: u64 = rolled[a..]
                .iter()
                .take_while(|(at, _)| at.saturating_since(start) <= span)
                .map(|&(_, cost)| cost)
                .sum();
            prop_assert!(units <= u64::from(ROLLING_LIMIT), "{} units within {:?} of {:?}", units, span, start);
        }
    }

    /// GCRA and the rolling window tell exact waits: a caller that asks
    /// again exactly when told is admitted, and one that asks any earlier
    /// is not.
    #[test]
    fn gcra_and_rolling_admit_exactly_when_they_said(
        rolling in any::<bool>(),
        steps in prop::collection::vec((1u32..=GCRA_BURST, 0u64..2_000_000_000), 1..60),
        early_ns in 1u64..1_000_000,
    ) {
        let b = budgets()[if rolling { 5 } else { 4 }];
        let mut ledger = MapLedger::default();
        let mut now = Timestamp::from_secs(T0 + 5);
        for (cost, gap_ns) in steps {
            now = Timestamp::from_nanos(now.as_nanos() + gap_ns);
            let b = b.with_cost(cost);
            let d = decide(&[b], &mut ledger, now, Mode::Spend).expect("decide");
            if d.is_admitted() {
                continue;
            }
            let wait = d.retry_after().expect("a cost within the burst can wait");
            prop_assert!(wait > Duration::ZERO);
            if wait.as_nanos() > u128::from(early_ns) {
                let early = now.saturating_add(wait - Duration::from_nanos(early_ns));
                let d = decide(&[b], &mut ledger.clone(), early, Mode::Peek).expect("peek");
                prop_assert!(!d.is_admitted(), "admitted {:?} early", Duration::from_nanos(early_ns));
            }
            now = now.saturating_add(wait);
            let d = decide(&[b], &mut ledger, now, Mode::Spend).expect("decide");
            prop_assert!(d.is_admitted(), "refused when told to come back");
        }
    }

    /// Charges and refunds after the fact keep the books within [0, limit].
    #[test]
    fn adjust_keeps_books_between_zero_and_limit(
        ops in prop::collection::vec((0u64..5_000, -40i64..40, any::<bool>(), 0usize..5), 1..300)
    ) {
        let all = budgets();
        let mut ledger = MapLedger::default();
        let mut now = Timestamp::from_secs(T0 + 3);
        for (gap_ms, delta, is_decide, which) in ops {
            let reserved_at = now;
            now = now.saturating_add(Duration::from_millis(gap_ms));
            let b = all[which];
            let status = if is_decide {
                let d = decide(&[b], &mut ledger, now, Mode::Spend).expect("decide");
                d.statuses()[0]
            } else {
                adjust(&b, delta, reserved_at, &mut ledger, now)
            };
            prop_assert!(status.remaining <= b.limit);
            let peek = decide(&[b.with_cost(0)], &mut ledger, now, Mode::Peek).expect("peek");
            prop_assert!(peek.statuses()[0].remaining <= b.limit);
            prop_assert_eq!(peek.statuses()[0].remaining, status.remaining);
            // Spending exactly what is left must be admitted.
            let left = peek.statuses()[0].remaining;
            let fill = decide(&[b.with_cost(left)], &mut ledger.clone(), now, Mode::Peek).expect("fill");
            prop_assert!(fill.is_admitted());
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2_000))]

    /// The precomputed GCRA step (a keyed limiter's hot path) decides as the
    /// general decision does, on any cell, cost and quota: the same verdict,
    /// the same cell written, the same wait to the nanosecond.
    #[test]
    fn the_gcra_step_decides_as_the_general_decision(
        period_ms in prop_oneof![1u64..2_000, 1_000u64..100_000_000, Just(u64::MAX / 2_000_000)],
        limit in prop_oneof![1u32..100, Just(u32::MAX), any::<u32>().prop_map(|n| n.max(1))],
        burst in prop_oneof![1u32..100, Just(u32::MAX), any::<u32>().prop_map(|n| n.max(1))],
        cost in prop_oneof![0u32..8, any::<u32>()],
        cell in prop_oneof![Just(0u64), any::<u64>(), (T0 - 5..T0 + 5, 0u32..1_000_000_000).prop_map(|(s, n)| (s << 32) | u64::from(n))],
        now_nanos in 0u64..20_000_000_000,
    ) {
        let period = Duration::from_millis(period_ms);
        let budget = Budget {
            key: BudgetKey::new("keyed", b"k"),
            rate: Rate::Gcra { period, burst: nz(burst) },
            limit,
            cost,
        };
        let now = Timestamp::from_nanos(T0 * 1_000_000_000 - 10_000_000_000 + now_nanos);
        let mut general = cell;
        let d = sluice_core::decide_cell(&budget, &mut general, now, Mode::Spend);
        let step = sluice_core::GcraStep::new(period, limit, nz(burst)).spend(cell, cost, now);
        match step {
            Ok(written) => {
                prop_assert!(d.is_admitted());
                prop_assert_eq!(written, general);
            }
            Err(u64::MAX) => {
                prop_assert!(d.is_never());
                prop_assert_eq!(general, cell);
            }
            Err(wait) => {
                prop_assert!(!d.is_admitted() && !d.is_never());
                prop_assert_eq!(d.retry_after(), Some(Duration::from_nanos(wait)));
                prop_assert_eq!(general, cell);
            }
        }
    }
}

proptest! {
    /// A decision built in its box is the decision built by value: the statuses
    /// given (those past `MAX_BUDGETS` dropped), admitted only when every one
    /// admits, at the instant given.
    #[test]
    fn a_boxed_decision_is_the_decision_by_value(
        verdicts in proptest::collection::vec(0u8..3, 0..16),
        at in 0u64..4_000_000_000,
    ) {
        let statuses: Vec<sluice_core::BudgetStatus> = verdicts
            .iter()
            .enumerate()
            .map(|(i, v)| sluice_core::BudgetStatus {
                verdict: match v {
                    0 => sluice_core::Verdict::Admitted,
                    1 => sluice_core::Verdict::NotYet { retry_after: Duration::from_millis(at % 997) },
                    _ => sluice_core::Verdict::Never,
                },
                limit: 10,
                remaining: u32::try_from(i).unwrap_or(0),
                reset: at + 60,
            })
            .collect();
        let now = Timestamp::from_secs(at);
        let boxed = sluice_core::Decision::boxed_from_statuses(now, statuses.iter().copied());
        let kept = &statuses[..statuses.len().min(sluice_core::MAX_BUDGETS)];
        prop_assert_eq!(boxed.statuses(), kept);
        prop_assert_eq!(boxed.is_admitted(), kept.iter().all(|s| s.verdict == sluice_core::Verdict::Admitted));
        prop_assert_eq!(boxed.decided_at(), now);
        prop_assert_eq!(&*boxed, &sluice_core::Decision::from_statuses(now, statuses));
    }
}
