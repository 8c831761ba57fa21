//! The memory backend: exactness under threads, bounded memory, reclamation.

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;
use sluice_core::{Budget, BudgetKey, FakeClock, Mode, Rate, Timestamp, decide};
use sluice_store::{BudgetStore, MemoryConfig, MemoryStore};

const T0: u64 = 1_764_460_800;

fn minute() -> NonZeroU32 {
    NonZeroU32::new(60).expect("non-zero")
}

fn store(max_keys: usize, shards: usize) -> MemoryStore<FakeClock> {
    MemoryStore::with_clock(
        MemoryConfig::with_max_keys(max_keys).with_shards(shards),
        FakeClock::new(Timestamp::from_secs(T0 + 1)),
    )
}

#[test]
fn concurrent_attempts_on_one_key_admit_exactly_the_limit() {
    let store = Arc::new(store(10_000, 64));
    let budget = Budget::per_window(BudgetKey::new("expensive", b"hot"), 1_000, minute());
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let store = Arc::clone(&store);
            std::thread::spawn(move || {
                (0..10_000)
                    .filter(|_| store.decide_now(&[budget]).expect("decide").is_admitted())
                    .count()
            })
        })
        .collect();
    let admitted: usize = threads.into_iter().map(|t| t.join().expect("thread")).sum();
    assert_eq!(admitted, 1_000);
}

#[test]
fn concurrent_multi_budget_decisions_are_all_or_nothing_and_exact() {
    // Every thread spends on a shared IP ceiling and its own caller budget;
    // shards are locked in order, so this also shows there is no deadlock.
    let store = Arc::new(store(10_000, 8));
    let ceiling = Budget::per_window(BudgetKey::new("ip", b"203.0.113.9"), 300, minute());
    let threads: Vec<_> = (0..4u8)
        .map(|t| {
            let store = Arc::clone(&store);
            std::thread::spawn(move || {
                let own = Budget::per_window(BudgetKey::new("read", &[t]), 100, minute());
                (0..5_000)
                    .filter(|_| {
                        store
                            .decide_now(&[own, ceiling])
                            .expect("decide")
                            .is_admitted()
                    })
                    .count()
            })
        })
        .collect();
    let per_thread: Vec<usize> = threads
        .into_iter()
        .map(|t| t.join().expect("thread"))
        .collect();
    assert_eq!(per_thread.iter().sum::<usize>(), 300);
    assert!(per_thread.iter().all(|&n| n <= 100));
    let left = store.peek_now(&[ceiling]).expect("peek");
    assert_eq!(left.statuses()[0].remaining, 0);
}

#[test]
fn a_decision_over_many_shards_spends_each_budget_in_its_own_shard() {
    // Asked for more shards than a store has (clamped to MAX_SHARDS), eight
    // subjects land on several shards; each budget's cell must be the one a
    // single-budget decision (which finds its shard directly) reads back.
    let store = store(10_000, 4 * sluice_store::MAX_SHARDS);
    let mut budgets: Vec<Budget> = (0..8u8)
        .map(|s| Budget::per_window(BudgetKey::new("read", &[s]), 5, minute()))
        .collect();
    budgets[7].limit = 2;
    let admitted: Vec<bool> = (0..3)
        .map(|_| store.decide_now(&budgets).expect("decide").is_admitted())
        .collect();
    assert_eq!(admitted, [true, true, false]);
    for b in &budgets {
        let alone = store.peek_now(std::slice::from_ref(b)).expect("peek");
        assert_eq!(alone.statuses()[0].remaining, b.limit - 2, "{b:?}");
    }
}

#[test]
fn a_million_new_keys_stay_under_the_cap_and_an_active_key_keeps_its_count() {
    let store = store(100_000, 64);
    let active = Budget::per_window(BudgetKey::new("standard", b"active caller"), 60, minute());
    for _ in 0..45 {
        assert!(store.decide_now(&[active]).expect("decide").is_admitted());
    }
    for i in 0u64..1_000_000 {
        let b = Budget::per_window(
            BudgetKey::from_digests(BudgetKey::new("standard", b"").scope(), i),
            60,
            minute(),
        );
        store.decide_now(&[b]).expect("decide");
        if i % 100_000 == 0 {
            assert!(store.len() <= store.capacity());
        }
    }
    assert!(
        store.capacity() <= 100_000 + 64,
        "cap rounds up by at most one per shard"
    );
    assert!(store.len() <= store.capacity());
    assert!(
        store.overflowed() > 0,
        "past the cap new subjects share the overflow budget"
    );
    let still = store.peek_now(&[active]).expect("peek");
    assert_eq!(
        still.statuses()[0].remaining,
        15,
        "the active caller kept its spent count"
    );
    // The overflow budget is shared and bounded: new subjects were refused
    // once it ran out, rather than each getting a fresh 60.
    let newcomer = Budget::per_window(
        BudgetKey::from_digests(BudgetKey::new("standard", b"").scope(), u64::MAX),
        60,
        minute(),
    );
    assert!(!store.decide_now(&[newcomer]).expect("decide").is_admitted());
}

#[test]
fn stale_cells_are_reclaimed_and_their_room_reused() {
    let store = store(16, 1);
    let scope = BudgetKey::new("read", b"").scope();
    let b = |i: u64| Budget::per_window(BudgetKey::from_digests(scope, i), 5, minute());
    for i in 0..16 {
        store.decide_now(&[b(i)]).expect("decide");
    }
    assert_eq!(store.len(), 16);
    // Full: the 17th subject goes to the overflow budget.
    store.decide_now(&[b(100)]).expect("decide");
    assert_eq!(store.overflowed(), 1);
    // A minute later every cell is stale; a new subject gets its own cell.
    store.clock().advance(Duration::from_secs(61));
    let d = store.decide_now(&[b(101)]).expect("decide");
    assert_eq!(d.statuses()[0].remaining, 4);
    assert_eq!(store.overflowed(), 1);
    assert_eq!(store.len(), 1, "the sweep dropped the 16 stale cells");
    store.clock().advance(Duration::from_secs(120));
    store.reclaim();
    assert!(store.is_empty());
}

#[tokio::test]
async fn the_store_trait_decides_peeks_and_adjusts() {
    let store = store(1_000, 4);
    let b = Budget::per_window(BudgetKey::new("warehouse_reads", b"user"), 10, minute());
    let d = store.decide(&[b.with_cost(3)]).await.expect("decide");
    assert_eq!(d.statuses()[0].remaining, 7);
    let s = store.adjust(&b, -2, d.decided_at()).await.expect("adjust");
    assert_eq!(s.remaining, 9);
    let p = store.peek(&[b]).await.expect("peek");
    assert_eq!(p.statuses()[0].remaining, 9);
    let err = store.decide(&[b; sluice_core::MAX_BUDGETS + 1]).await;
    assert!(
        err.is_err(),
        "more than MAX_BUDGETS is an error, not a panic"
    );
}

proptest! {
    /// Below its cap the sharded store decides exactly as the pure model.
    #[test]
    fn memory_store_matches_the_pure_model(
        ops in prop::collection::vec((0u64..4_000, 0usize..6, 0u32..5, 0usize..4), 1..300)
    ) {
        let store = store(10_000, 4);
        let clock = store.clock().clone();
        let mut model = std::collections::HashMap::<u64, u64>::new();
        struct Model<'a>(&'a mut std::collections::HashMap<u64, u64>);
        impl sluice_core::Ledger for Model<'_> {
            fn read(&mut self, at: sluice_core::CellRef<'_>) -> u64 { self.0.get(&at.cell).copied().unwrap_or(0) }
            fn write(&mut self, at: sluice_core::CellRef<'_>, v: u64) { self.0.insert(at.cell, v); }
        }
        let budgets = [
            Budget::per_window(BudgetKey::new("a", b"1"), 7, minute()),
            Budget::per_window(BudgetKey::new("a", b"2"), 7, minute()),
            Budget { key: BudgetKey::new("s", b"1"), rate: Rate::SlidingWindow { seconds: NonZeroU32::new(10).expect("nz") }, limit: 9, cost: 1 },
            Budget { key: BudgetKey::new("q", b"1"), rate: Rate::CalendarMonth, limit: 50, cost: 1 },
        ];
        // `shape`: one budget; the same budget twice (one cell, two costs);
        // two budgets; or the same budget twice and then another, which
        // may refuse after both spends on the shared cell.
        for (gap, which, cost, shape) in ops {
            clock.advance(Duration::from_millis(gap));
            let first = budgets[which % 4].with_cost(cost);
            let req: Vec<Budget> = match shape {
                0 => vec![first],
                1 => vec![first, budgets[which % 4].with_cost(2)],
                2 => vec![first, budgets[(which + 1) % 4]],
                _ => vec![first, budgets[which % 4], budgets[(which + 1) % 4].with_cost(3)],
            };
            let got = store.decide_now(&req).expect("store");
            let want = decide(&req, &mut Model(&mut model), clock_now(&clock), Mode::Spend).expect("model");
            prop_assert_eq!(got, want);
        }
    }
}

fn clock_now(c: &FakeClock) -> Timestamp {
    use sluice_core::Clock;
    c.now()
}

#[test]
fn a_request_falling_back_to_the_overflow_budget_spends_each_budget_once() {
    let store = store(16, 1);
    let scope = BudgetKey::new("read", b"").scope();
    let b = |i: u64| Budget::per_window(BudgetKey::from_digests(scope, i), 5, minute());
    for i in 0..16 {
        store.decide_now(&[b(i)]).expect("decide");
    }
    // Budget 0 exists; subject 999 is new and its shard is full: the in-place
    // path backs out and the general path folds 999 into the overflow budget.
    let d = store.decide_now(&[b(0), b(999)]).expect("decide");
    assert!(d.is_admitted());
    assert_eq!(d.statuses()[0].remaining, 3, "spent exactly once");
    assert_eq!(d.statuses()[1].remaining, 4);
    assert_eq!(store.overflowed(), 1);
    assert_eq!(
        store.peek_now(&[b(0)]).expect("peek").statuses()[0].remaining,
        3
    );
}

#[test]
fn a_fall_back_after_inserting_and_sharing_a_cell_spends_it_once() {
    let store = store(16, 1);
    let scope = BudgetKey::new("read", b"").scope();
    let b = |i: u64| Budget::per_window(BudgetKey::from_digests(scope, i), 5, minute());
    for i in 0..14 {
        store.decide_now(&[b(i)]).expect("decide");
    }
    // 100 is new (inserted), spent twice through one cell; 101 takes the
    // last room; 102 finds the shard full, so the in-place path backs all
    // of it out before the general path decides, which inserts new cells
    // only at commit and must still count 100 and 101 against the cap.
    let d = store
        .decide_now(&[b(100), b(100).with_cost(2), b(101), b(102)])
        .expect("decide");
    assert!(d.is_admitted());
    assert_eq!(d.statuses()[1].remaining, 2, "1 + 2 spent, each once");
    assert_eq!(store.len(), 16, "the general path kept the cap");
    assert_eq!(store.overflowed(), 1, "102 shares the overflow budget");
    assert_eq!(
        store.peek_now(&[b(100)]).expect("peek").statuses()[0].remaining,
        2
    );
    assert_eq!(
        store.peek_now(&[b(101)]).expect("peek").statuses()[0].remaining,
        4
    );
}

#[test]
fn a_sweep_on_the_general_path_keeps_the_cells_it_is_deciding() {
    // A sliding window (general path) returns to a full shard that still
    // holds its own stale cell: the sweep that makes room must not drop a
    // cell the decision has already found, or its spend is lost.
    let store = store(2, 1);
    let sliding = Budget {
        key: BudgetKey::new("s", b"1"),
        rate: Rate::SlidingWindow {
            seconds: NonZeroU32::new(10).expect("nz"),
        },
        limit: 3,
        cost: 1,
    };
    let hour = Budget::per_window(
        BudgetKey::new("h", b"1"),
        10,
        NonZeroU32::new(3_600).expect("nz"),
    );
    assert!(store.decide_now(&[sliding]).expect("decide").is_admitted());
    assert!(store.decide_now(&[hour]).expect("decide").is_admitted());
    store.clock().advance(Duration::from_secs(21));
    let admitted = (0..5)
        .filter(|_| store.decide_now(&[sliding]).expect("decide").is_admitted())
        .count();
    assert_eq!(admitted, 3, "the limit, no more");
}

#[test]
fn a_refused_multi_budget_request_restores_every_cell_it_touched() {
    let store = store(1_000, 2);
    let caller = Budget::per_window(BudgetKey::new("expensive", b"k"), 30, minute());
    let fresh = Budget::per_window(BudgetKey::new("route", b"ip"), 5, minute());
    let ceiling = Budget::per_window(BudgetKey::new("ip", b"ip"), 1, minute());
    assert!(store.decide_now(&[ceiling]).expect("decide").is_admitted());
    let before = store.len();
    let d = store.decide_now(&[caller, fresh, ceiling]).expect("decide");
    assert!(!d.is_admitted());
    assert_eq!(d.binding().expect("binding").limit, 1);
    assert_eq!(
        store.len(),
        before,
        "cells inserted for the refused request were removed"
    );
    let p = store.peek_now(&[caller, fresh]).expect("peek");
    assert_eq!(p.statuses()[0].remaining, 30);
    assert_eq!(p.statuses()[1].remaining, 5);
}

#[test]
fn under_churn_at_the_cap_no_budget_admits_past_its_limit_and_the_cap_holds() {
    // Four threads decide a caller budget and an IP ceiling per request on
    // a store smaller than the callers, while one thread moves the clock a
    // window on now and then: shards fill, sweep, rebuild their tables and
    // fold new subjects into overflow budgets, all under contention. Each
    // caller is asked ~20 times a window (limit 5) and each IP ~200 (limit
    // 45, under its ten callers' 50), so neither limit hides the other.
    let store = Arc::new(store(128, 4));
    let clock = store.clock().clone();
    let caller = |c: u64| Budget::per_window(BudgetKey::from_digests(1, c), 5, minute());
    let ceiling = |c: u64| Budget::per_window(BudgetKey::from_digests(2, c / 10), 45, minute());
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let store = Arc::clone(&store);
            let clock = clock.clone();
            std::thread::spawn(move || {
                let mut admitted = Vec::new();
                for i in 0..5_000u64 {
                    if t == 0 && i % 1_000 == 999 {
                        clock.advance(Duration::from_secs(61));
                    }
                    let c = (t * 7_919 + i * 31) % 200;
                    let d = store.decide_now(&[caller(c), ceiling(c)]).expect("decide");
                    if d.is_admitted() {
                        admitted.push((c, d.decided_at().as_secs() / 60));
                    }
                    assert!(store.len() <= 128, "cap held: {}", store.len());
                }
                admitted
            })
        })
        .collect();
    let mut per_caller = std::collections::HashMap::<(u64, u64), u32>::new();
    let mut per_ip = std::collections::HashMap::<(u64, u64), u32>::new();
    for t in threads {
        for (c, window) in t.join().expect("thread") {
            *per_caller.entry((c, window)).or_default() += 1;
            *per_ip.entry((c / 10, window)).or_default() += 1;
        }
    }
    assert!(!per_caller.is_empty());
    assert!(store.overflowed() > 0, "the cap was reached");
    assert!(per_caller.values().all(|&n| n <= 5), "a caller past 5");
    assert!(per_ip.values().all(|&n| n <= 45), "an IP past 45");
    assert!(store.len() <= 128);
}

/// SPEC C7: a hold put through a guarded store is the guarded store's, read
/// back through either.
#[tokio::test]
async fn c7_a_guarded_store_holds_in_the_store_it_guards() {
    let clock = FakeClock::new(Timestamp::from_secs(T0));
    let memory = MemoryStore::with_clock(MemoryConfig::default(), clock.clone());
    let guarded =
        sluice_store::Guarded::with_clock(memory, sluice_store::STORE_BREAKER, clock.clone());
    let key = BudgetKey::new("pace-hold", b"k");
    guarded
        .hold(&key, Duration::from_secs(30))
        .await
        .expect("hold");
    assert_eq!(guarded.inner().held_now(&[key]), [Duration::from_secs(30)]);
    clock.advance(Duration::from_secs(10));
    assert_eq!(
        guarded.held(&[key]).await.expect("held"),
        [Duration::from_secs(20)]
    );
}
