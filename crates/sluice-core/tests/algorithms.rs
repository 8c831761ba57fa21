//! Exact behaviour of each algorithm at known instants.

use crate::support;

use std::time::Duration;

use sluice_core::{Budget, BudgetKey, Mode, Rate, Timestamp, Verdict, adjust, decide, month_of};
use support::{MapLedger, secs};

/// 2025-11-30T00:00:00Z, the start of a minute.
const T0: u64 = 1_764_460_800;

fn at(secs: u64, millis: u64) -> Timestamp {
    Timestamp::from_nanos(secs * 1_000_000_000 + millis * 1_000_000)
}

#[test]
fn e1_fixed_window_counts_to_the_limit_and_resets_at_the_aligned_boundary() {
    let b = Budget::per_window(BudgetKey::new("expensive", b"k"), 30, secs(60));
    let mut l = MapLedger::default();
    for i in 0..30 {
        let d = decide(&[b], &mut l, at(T0 + 10, 0), Mode::Spend).expect("decide");
        assert!(d.is_admitted());
        assert_eq!(d.statuses()[0].remaining, 29 - i);
        assert_eq!(d.statuses()[0].reset, T0 + 60);
    }
    let d = decide(&[b], &mut l, at(T0 + 23, 500), Mode::Spend).expect("decide");
    assert!(!d.is_admitted() && !d.is_never());
    assert_eq!(d.retry_after(), Some(Duration::from_millis(36_500)));
    assert_eq!(d.statuses()[0].remaining, 0);
    // The next aligned window is whole again.
    let d = decide(&[b], &mut l, at(T0 + 60, 0), Mode::Spend).expect("decide");
    assert!(d.is_admitted());
    assert_eq!(d.statuses()[0].remaining, 29);
    assert_eq!(d.statuses()[0].reset, T0 + 120);
}

#[test]
fn e1_classes_are_independent_budgets() {
    let exp = Budget::per_window(BudgetKey::new("expensive", b"k"), 1, secs(60));
    let read = Budget::per_window(BudgetKey::new("read", b"k"), 300, secs(60));
    let mut l = MapLedger::default();
    assert!(
        decide(&[exp], &mut l, at(T0, 0), Mode::Spend)
            .expect("d")
            .is_admitted()
    );
    assert!(
        !decide(&[exp], &mut l, at(T0, 0), Mode::Spend)
            .expect("d")
            .is_admitted()
    );
    let d = decide(&[read], &mut l, at(T0, 0), Mode::Spend).expect("d");
    assert!(d.is_admitted());
    assert_eq!(d.statuses()[0].remaining, 299);
}

#[test]
fn weighted_cost_spends_several_units_and_never_fits_above_the_limit() {
    let b = Budget::per_window(BudgetKey::new("warehouse_reads", b"u"), 10, secs(60));
    let mut l = MapLedger::default();
    let d = decide(&[b.with_cost(7)], &mut l, at(T0, 0), Mode::Spend).expect("d");
    assert_eq!(d.statuses()[0].remaining, 3);
    let d = decide(&[b.with_cost(4)], &mut l, at(T0, 0), Mode::Spend).expect("d");
    assert!(!d.is_admitted());
    assert_eq!(d.statuses()[0].remaining, 3, "a refusal spends nothing");
    let d = decide(&[b.with_cost(11)], &mut l, at(T0 + 60, 0), Mode::Spend).expect("d");
    assert_eq!(d.statuses()[0].verdict, Verdict::Never);
    assert_eq!(d.retry_after(), None);
    // A cached answer costs nothing and leaves no state behind.
    let before = l.clone();
    let d = decide(&[b.with_cost(0)], &mut l, at(T0 + 120, 0), Mode::Spend).expect("d");
    assert!(d.is_admitted());
    assert_eq!(l, before);
}

#[test]
fn peek_reports_without_spending() {
    let b = Budget::per_window(BudgetKey::new("read", b"k"), 2, secs(60));
    let mut l = MapLedger::default();
    decide(&[b], &mut l, at(T0, 0), Mode::Spend).expect("d");
    let before = l.clone();
    let p = decide(&[b], &mut l, at(T0, 0), Mode::Peek).expect("d");
    assert!(p.is_admitted());
    assert_eq!(
        p.statuses()[0].remaining,
        1,
        "peek reports the books as they stand"
    );
    assert_eq!(l, before);
}

/// SPEC T3 (and Q2's weighted budgets): a settlement can take a budget below
/// zero for the rest of its window. The books count past the limit, so a later
/// refund (another call's reservation given back) takes back from what was
/// really counted: a call that overran is not forgotten by the next refund.
#[test]
fn t3_adjust_charges_past_the_limit_and_refunds_from_what_was_counted() {
    let b = Budget::per_window(BudgetKey::new("warehouse_reads", b"u"), 10, secs(60));
    let mut l = MapLedger::default();
    let now = at(T0 + 5, 0);
    decide(&[b], &mut l, now, Mode::Spend).expect("d");
    // The upstream said the call spent 4 units: charge 3 more.
    assert_eq!(adjust(&b, 3, now, &mut l, now).remaining, 6);
    // Charged past the limit: 54 counted, nothing left.
    assert_eq!(adjust(&b, 50, now, &mut l, now).remaining, 0);
    // A refund of 40 takes back from the 54: still past the limit.
    assert_eq!(adjust(&b, -40, now, &mut l, now).remaining, 0);
    assert!(
        !decide(&[b], &mut l, now, Mode::Spend)
            .expect("d")
            .is_admitted(),
        "below zero for the rest of its window"
    );
    assert_eq!(adjust(&b, -10, now, &mut l, now).remaining, 6);
    // Refunds clamp at zero spent.
    assert_eq!(adjust(&b, -100, now, &mut l, now).remaining, 10);
    decide(&[b.with_cost(2)], &mut l, now, Mode::Spend).expect("d");
    // A refund for a reservation made in an earlier window is dropped.
    let later = at(T0 + 61, 0);
    decide(&[b.with_cost(5)], &mut l, later, Mode::Spend).expect("d");
    assert_eq!(adjust(&b, -2, now, &mut l, later).remaining, 5);
    // A charge lands in the current window.
    assert_eq!(adjust(&b, 1, now, &mut l, later).remaining, 4);
}

#[test]
fn q1_calendar_month_quota_resets_at_the_next_month() {
    let b = Budget {
        key: BudgetKey::new("quota:messages", b"ws"),
        rate: Rate::CalendarMonth,
        limit: 2,
        cost: 1,
    };
    let mut l = MapLedger::default();
    // 2025-11-30T23:59:59.999999999Z: the last nanosecond of November.
    let last = Timestamp::from_nanos(month_of(Timestamp::from_secs(T0)).end * 1_000_000_000 - 1);
    assert!(
        decide(&[b], &mut l, Timestamp::from_secs(T0), Mode::Spend)
            .expect("d")
            .is_admitted()
    );
    let d = decide(&[b], &mut l, last, Mode::Spend).expect("d");
    assert!(d.is_admitted());
    assert_eq!(d.statuses()[0].reset, 1_764_547_200, "2025-12-01T00:00:00Z");
    let d = decide(&[b], &mut l, last, Mode::Spend).expect("d");
    assert_eq!(d.retry_after(), Some(Duration::from_nanos(1)));
    let dec = Timestamp::from_secs(1_764_547_200);
    let d = decide(&[b], &mut l, dec, Mode::Spend).expect("d");
    assert!(d.is_admitted());
    assert_eq!(d.statuses()[0].remaining, 1);
    assert_eq!(d.statuses()[0].reset, 1_767_225_600, "2026-01-01T00:00:00Z");
}

#[test]
fn sliding_window_weighs_the_previous_window() {
    let b = Budget {
        key: BudgetKey::new("read", b"k"),
        rate: Rate::SlidingWindow { seconds: secs(60) },
        limit: 10,
        cost: 1,
    };
    let mut l = MapLedger::default();
    for _ in 0..10 {
        assert!(
            decide(&[b], &mut l, at(T0 + 50, 0), Mode::Spend)
                .expect("d")
                .is_admitted()
        );
    }
    // 15 s into the next window, 45/60 of the previous 10 still count: 7.5.
    let d = decide(&[b], &mut l, at(T0 + 75, 0), Mode::Peek).expect("d");
    assert_eq!(d.statuses()[0].remaining, 2);
    assert!(
        decide(&[b.with_cost(2)], &mut l, at(T0 + 75, 0), Mode::Spend)
            .expect("d")
            .is_admitted()
    );
    let d = decide(&[b], &mut l, at(T0 + 75, 0), Mode::Spend).expect("d");
    assert!(!d.is_admitted());
    // 7.5 + 2 + 1 > 10 until the previous window weighs <= 7 units: 42 s left of it,
    // i.e. at T0 + 78.
    assert_eq!(d.retry_after(), Some(Duration::from_secs(3)));
    assert!(
        decide(&[b], &mut l, at(T0 + 78, 0), Mode::Spend)
            .expect("d")
            .is_admitted()
    );
    // Two windows later nothing of the first remains.
    let d = decide(&[b], &mut l, at(T0 + 180, 0), Mode::Peek).expect("d");
    assert_eq!(d.statuses()[0].remaining, 10);
}

#[test]
fn c3_gcra_with_burst_one_spaces_requests_evenly() {
    let b = Budget {
        key: BudgetKey::new("rpm", b"openai"),
        rate: Rate::Gcra {
            period: Duration::from_secs(60),
            burst: secs(1),
        },
        limit: 600,
        cost: 1,
    };
    let mut l = MapLedger::default();
    let t = at(T0, 0);
    assert!(
        decide(&[b], &mut l, t, Mode::Spend)
            .expect("d")
            .is_admitted()
    );
    let d = decide(&[b], &mut l, t, Mode::Spend).expect("d");
    assert_eq!(
        d.retry_after(),
        Some(Duration::from_millis(100)),
        "600/min = one per 100 ms"
    );
    let t = t.saturating_add(Duration::from_millis(100));
    assert!(
        decide(&[b], &mut l, t, Mode::Spend)
            .expect("d")
            .is_admitted()
    );
    assert!(
        !decide(&[b], &mut l, t, Mode::Spend)
            .expect("d")
            .is_admitted()
    );
}

#[test]
fn gcra_burst_allows_that_many_back_to_back() {
    let b = Budget {
        key: BudgetKey::new("g", b"k"),
        rate: Rate::Gcra {
            period: Duration::from_secs(10),
            burst: secs(5),
        },
        limit: 10,
        cost: 1,
    };
    let mut l = MapLedger::default();
    let t = at(T0, 0);
    for i in 0..5 {
        let d = decide(&[b], &mut l, t, Mode::Spend).expect("d");
        assert!(d.is_admitted());
        assert_eq!(d.statuses()[0].remaining, 4 - i);
    }
    let d = decide(&[b], &mut l, t, Mode::Spend).expect("d");
    assert_eq!(d.retry_after(), Some(Duration::from_secs(1)));
    assert_eq!(d.statuses()[0].reset, T0 + 5);
    assert_eq!(
        decide(&[b.with_cost(6)], &mut l, t, Mode::Peek)
            .expect("d")
            .statuses()[0]
            .verdict,
        Verdict::Never
    );
    // A refund gives one unit back at once.
    adjust(&b, -1, t, &mut l, t);
    assert!(
        decide(&[b], &mut l, t, Mode::Spend)
            .expect("d")
            .is_admitted()
    );
}

#[test]
fn binding_budget_is_the_tightest_or_the_refusing_one() {
    let class = Budget::per_window(BudgetKey::new("read", b"k"), 300, secs(60));
    let ip = Budget::per_window(BudgetKey::new("ip", b"1.2.3.4"), 2, secs(60));
    let mut l = MapLedger::default();
    let d = decide(&[class, ip], &mut l, at(T0, 0), Mode::Spend).expect("d");
    assert_eq!(d.binding_index(), 1, "ip has 1 left, the class 299");
    decide(&[class, ip], &mut l, at(T0, 0), Mode::Spend).expect("d");
    let d = decide(&[class, ip], &mut l, at(T0, 0), Mode::Spend).expect("d");
    assert!(!d.is_admitted());
    assert_eq!(d.binding().expect("binding").limit, 2);
    assert_eq!(
        d.statuses()[0].remaining,
        298,
        "a refusal reports the books unchanged"
    );
}

#[test]
fn too_many_budgets_is_an_error_not_a_panic() {
    let b = Budget::per_window(BudgetKey::new("x", b"k"), 1, secs(1));
    let many = [b; sluice_core::MAX_BUDGETS + 1];
    assert!(decide(&many, &mut MapLedger::default(), at(T0, 0), Mode::Spend).is_err());
}

#[test]
fn deciding_a_two_cell_budget_on_one_cell_is_not_a_panic() {
    // `decide_cell` is for one-cell budgets; misused on a sliding window it
    // treats the missing previous window as empty.
    let b = Budget {
        key: BudgetKey::new("read", b"k"),
        rate: Rate::SlidingWindow { seconds: secs(60) },
        limit: 2,
        cost: 1,
    };
    let mut cell = 0;
    let d = sluice_core::decide_cell(&b, &mut cell, at(T0 + 5, 0), Mode::Spend);
    assert!(d.is_admitted());
    assert_eq!(d.statuses()[0].remaining, 1);
}

#[test]
fn a_cost_of_zero_only_looks_on_every_rate() {
    // Each rate after one spend of 2: a cost of 0 is admitted, writes
    // nothing, and reports the books as they stand.
    let rates = [
        (Rate::FixedWindow { seconds: secs(60) }, 3, T0 + 60),
        (Rate::CalendarMonth, 3, 1_764_547_200),
        (
            Rate::Gcra {
                period: Duration::from_secs(10),
                burst: secs(5),
            },
            3,
            // 2 units of 10 s / 5 each: whole again 4 s on.
            T0 + 4,
        ),
    ];
    for (rate, remaining, reset) in rates {
        let b = Budget {
            key: BudgetKey::new("zero", b"k"),
            rate,
            limit: 5,
            cost: 2,
        };
        let mut l = MapLedger::default();
        let t = at(T0, 0);
        assert!(
            decide(&[b], &mut l, t, Mode::Spend)
                .expect("d")
                .is_admitted()
        );
        let books = l.0.clone();
        let d = decide(&[b.with_cost(0)], &mut l, t, Mode::Spend).expect("d");
        assert!(d.is_admitted(), "{rate:?}");
        assert_eq!(d.statuses()[0].remaining, remaining, "{rate:?}");
        assert_eq!(d.statuses()[0].reset, reset, "{rate:?}");
        assert_eq!(l.0, books, "{rate:?}: nothing written");
    }
}

#[test]
fn gcra_interval_is_a_whole_microsecond() {
    // 7 per minute: 8.571428571… s between units, counted as 8.571428 s
    // (the shared store's clock resolution), so every store spaces alike.
    let b = Budget {
        key: BudgetKey::new("g", b"us"),
        rate: Rate::Gcra {
            period: Duration::from_secs(60),
            burst: secs(1),
        },
        limit: 7,
        cost: 1,
    };
    let mut l = MapLedger::default();
    let t = at(T0, 0);
    assert!(
        decide(&[b], &mut l, t, Mode::Spend)
            .expect("d")
            .is_admitted()
    );
    let d = decide(&[b], &mut l, t, Mode::Spend).expect("d");
    assert_eq!(d.retry_after(), Some(Duration::from_micros(8_571_428)));
    // A limit above one per microsecond is spaced one microsecond apart.
    let fast = Budget {
        rate: Rate::Gcra {
            period: Duration::from_millis(1),
            burst: secs(1),
        },
        limit: 5_000,
        key: BudgetKey::new("g", b"fast"),
        ..b
    };
    assert!(
        decide(&[fast], &mut l, t, Mode::Spend)
            .expect("d")
            .is_admitted()
    );
    let d = decide(&[fast], &mut l, t, Mode::Spend).expect("d");
    assert_eq!(d.retry_after(), Some(Duration::from_micros(1)));
}

#[test]
fn a_sliding_window_wait_ends_on_a_whole_microsecond() {
    // 3 in the previous 5 s window, 6 of 9 in this one: one more fits once
    // 3 * (5 s - e) / 5 s <= 2, i.e. e >= 1.666666666… s; the wait ends at
    // the first whole microsecond past it, as on the shared store's clock.
    let b = Budget {
        key: BudgetKey::new("s", b"us"),
        rate: Rate::SlidingWindow { seconds: secs(5) },
        limit: 9,
        cost: 3,
    };
    let mut l = MapLedger::default();
    let start = T0 / 5 * 5;
    let spend = |l: &mut MapLedger, b: Budget, t| decide(&[b], l, t, Mode::Spend).expect("d");
    assert!(spend(&mut l, b, at(start - 1, 0)).is_admitted());
    assert!(spend(&mut l, b.with_cost(6), at(start, 500)).is_admitted());
    let one = b.with_cost(1);
    let d = decide(&[one], &mut l, at(start, 500), Mode::Peek).expect("d");
    assert_eq!(d.retry_after(), Some(Duration::from_micros(1_166_667)));
    let ready = Timestamp::from_nanos(at(start, 0).as_nanos() + 1_666_667_000);
    assert!(
        decide(&[one], &mut l, ready, Mode::Peek)
            .expect("d")
            .is_admitted()
    );
    let early = Timestamp::from_nanos(ready.as_nanos() - 1_000);
    assert!(
        !decide(&[one], &mut l, early, Mode::Peek)
            .expect("d")
            .is_admitted()
    );
}

fn rolling(limit: u32, millis: u32, slot_millis: u32) -> Budget {
    Budget {
        key: BudgetKey::new("tpm", b"openai"),
        rate: Rate::RollingWindow {
            millis: support::nz(millis),
            slot_millis: support::nz(slot_millis),
        },
        limit,
        cost: 1,
    }
}

#[test]
fn c2_a_rolling_window_waits_exactly_until_its_oldest_slots_leave() {
    // 1,000 tokens per 61 s (60 s + a 1 s arrival margin), 250 ms slots.
    let b = rolling(1_000, 61_000, 250);
    let mut l = MapLedger::default();
    let t0 = at(T0, 0);
    let d = decide(&[b.with_cost(800)], &mut l, t0, Mode::Spend).expect("d");
    assert!(d.is_admitted());
    assert_eq!(d.statuses()[0].remaining, 200);
    assert_eq!(d.statuses()[0].reset, T0 + 62, "61.25 s, rounded up");
    // The answer used 500: 300 go back to the slot they were spent in.
    let s = adjust(&b, -300, t0, &mut l, at(T0 + 1, 0));
    assert_eq!(s.remaining, 500);
    let d = decide(&[b.with_cost(600)], &mut l, at(T0 + 1, 0), Mode::Spend).expect("d");
    assert_eq!(
        d.retry_after(),
        Some(Duration::from_millis(60_250)),
        "until the first slot leaves: its end + 61 s"
    );
    assert!(!d.is_admitted());
    let left = at(T0 + 61, 250);
    let early = Timestamp::from_nanos(left.as_nanos() - 1);
    assert!(
        !decide(&[b.with_cost(600)], &mut l, early, Mode::Peek)
            .expect("d")
            .is_admitted()
    );
    let d = decide(&[b.with_cost(600)], &mut l, left, Mode::Spend).expect("d");
    assert!(d.is_admitted());
    // More than the whole limit never fits.
    let d = decide(&[b.with_cost(1_001)], &mut l, left, Mode::Peek).expect("d");
    assert!(d.is_never());
}

#[test]
fn a_rolling_window_counts_every_slot_and_refunds_only_while_they_count() {
    let b = rolling(10, 1_000, 100);
    let mut l = MapLedger::default();
    for ms in [0, 100, 250, 900] {
        assert!(
            decide(&[b.with_cost(2)], &mut l, at(T0, ms), Mode::Spend)
                .expect("d")
                .is_admitted()
        );
    }
    // 8 in the window; at 1.05 s the first slot ([0, 100 ms)) has just left.
    let d = decide(&[b.with_cost(0)], &mut l, at(T0 + 1, 50), Mode::Peek).expect("d");
    assert_eq!(d.statuses()[0].remaining, 2);
    let d = decide(&[b.with_cost(0)], &mut l, at(T0 + 1, 100), Mode::Peek).expect("d");
    assert_eq!(d.statuses()[0].remaining, 4);
    // A refund for the slot that left is dropped; one for a counted slot lands.
    let s = adjust(&b, -2, at(T0, 0), &mut l, at(T0 + 1, 100));
    assert_eq!(s.remaining, 4);
    let s = adjust(&b, -1, at(T0, 250), &mut l, at(T0 + 1, 100));
    assert_eq!(s.remaining, 5);
    // A charge fills the window up to its limit, no further.
    let s = adjust(&b, 50, at(T0 + 1, 100), &mut l, at(T0 + 1, 100));
    assert_eq!(s.remaining, 0);
    let d = decide(&[b.with_cost(1)], &mut l, at(T0 + 1, 100), Mode::Peek).expect("d");
    assert_eq!(
        d.retry_after(),
        Some(Duration::from_millis(100)),
        "the oldest counted slot, [100, 200) ms, leaves at 1.2 s"
    );
}

#[test]
fn a_long_rolling_window_is_cut_into_at_most_max_rolling_slots() {
    // A day in 1 ms slots would be 86.4 million cells: it is cut into
    // 4,096 slots of 21,094 ms (86,400,000 / 4,096 = 21,093.75, rounded up).
    let b = rolling(5, 86_400_000, 1);
    let mut l = MapLedger::default();
    assert!(
        decide(&[b.with_cost(5)], &mut l, at(T0, 0), Mode::Spend)
            .expect("d")
            .is_admitted()
    );
    let d = decide(&[b], &mut l, at(T0, 0), Mode::Peek).expect("d");
    // The units leave a day after the end of their slot.
    let slot_end = (T0 * 1_000 / 21_094 + 1) * 21_094;
    let wait = slot_end - T0 * 1_000 + 86_400_000;
    assert_eq!(d.retry_after(), Some(Duration::from_millis(wait)));
    assert_eq!(sluice_core::MAX_ROLLING_SLOTS, 4_096);
}
