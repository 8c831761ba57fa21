//! A flood of new keys against the memory store (issue: hardening, item 4): memory
//! stays bounded, no active caller is handed a fresh budget, and a flood does not
//! deny a budget to new callers from networks it does not come from.

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;
use sluice_core::{Budget, BudgetKey, Clock as _, FakeClock, Rate, Timestamp};
use sluice_store::{MemoryConfig, MemoryStore, NO_NETWORK};

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

/// A request as the gateway plans it: the caller's class budget (`standard`,
/// 60 a minute) and its IP's ceiling (300 a minute).
fn request(caller: u64, ip: u64) -> [Budget; 2] {
    let class = BudgetKey::new("class:standard", b"").scope();
    let ceiling = BudgetKey::new("ip:work", b"").scope();
    [
        Budget::per_window(BudgetKey::from_digests(class, caller), 60, minute()),
        Budget::per_window(BudgetKey::from_digests(ceiling, ip), 300, minute()),
    ]
}

/// Floods `store` with `n` new callers, each from its own address, spread
/// over `networks` client networks (numbered from 1), starting at subject `from`.
fn flood(store: &MemoryStore<FakeClock>, from: u64, n: u64, networks: u64) {
    for i in from..from + n {
        let network = 1 + i % networks;
        store
            .decide_now_from(&request(i, i | 1 << 63), network)
            .expect("decide");
    }
}

#[test]
fn e2_a_key_flood_leaves_a_new_caller_from_another_network_its_own_budget() {
    let store = store(10_000, 16);
    // An active caller (its network: 7,000) spends 45 of its 60 before the flood.
    let active = request(u64::MAX - 1, u64::MAX - 2);
    for _ in 0..45 {
        let d = store.decide_now_from(&active, 7_000).expect("decide");
        assert!(d.is_admitted());
    }
    // 200,000 new callers from 500 networks: 20 times the key cap.
    flood(&store, 0, 200_000, 500);
    assert!(store.len() <= store.capacity(), "the key cap holds");
    let (networks, global) = store.overflow_len();
    assert!(networks <= store.overflow_capacity(), "{networks}");
    assert_eq!(
        global, 0,
        "the per-network table had room for every network"
    );
    assert!(store.overflowed() > 0, "the flood reached the cap");

    // A new caller from a network the flood did not come from: admitted, and
    // what it has is its network's budget, untouched by the flood.
    let newcomer = request(u64::MAX - 3, u64::MAX - 4);
    let d = store.decide_now_from(&newcomer, 5_000).expect("decide");
    assert!(d.is_admitted(), "{d:?}");
    assert_eq!(d.statuses()[0].remaining, 59);
    assert_eq!(d.statuses()[1].remaining, 299);

    // New callers from a flooding network share that network's budget: 400
    // of them spent its 60 standard units, so one more is refused — each
    // new key did not get a fresh 60.
    let d = store
        .decide_now_from(&request(u64::MAX - 5, u64::MAX - 6), 1)
        .expect("decide");
    assert!(!d.is_admitted());

    // The active caller kept its cell and its count through the flood.
    let d = store.peek_now(&active).expect("peek");
    assert_eq!(d.statuses()[0].remaining, 15, "no fresh budget");
}

#[test]
fn e2_an_active_callers_count_survives_floods_from_its_own_network_too() {
    // A flood from the active caller's own network: the caller keeps its
    // cell, so only newcomers share the (spent) network budget.
    let store = store(2_000, 16);
    let active = request(u64::MAX - 1, u64::MAX - 2);
    for _ in 0..30 {
        assert!(
            store
                .decide_now_from(&active, 1)
                .expect("decide")
                .is_admitted()
        );
    }
    flood(&store, 0, 50_000, 1);
    for spent in 31..=60 {
        let d = store.decide_now_from(&active, 1).expect("decide");
        assert!(d.is_admitted(), "unit {spent}");
    }
    let d = store.decide_now_from(&active, 1).expect("decide");
    assert!(
        !d.is_admitted(),
        "61st unit of 60: the count was never reset"
    );
}

#[test]
fn e2_the_network_table_is_bounded_and_past_it_newcomers_share_the_scopes_budget() {
    // A flood from more networks, in one window, than the per-network table
    // holds: the table stays at its cap, and the rest share the global budget.
    let store = store(1_000, 16);
    let cap = store.overflow_capacity();
    assert_eq!(cap, 125);
    flood(&store, 0, 20_000, 10_000);
    let (networks, global) = store.overflow_len();
    assert!(networks <= cap, "{networks} > {cap}");
    assert!(global > 0);
    assert!(store.len() <= store.capacity());
    // The next window: every flood cell is stale, so a new caller from a new
    // network is decided in its own cell again, and the tables empty on reclaim.
    store.clock().advance(Duration::from_secs(60));
    let d = store
        .decide_now_from(&request(u64::MAX - 1, u64::MAX - 2), 99_999)
        .expect("decide");
    assert_eq!(d.statuses()[0].remaining, 59);
    store.reclaim();
    assert_eq!(store.overflow_len(), (0, 0));
    assert_eq!(store.len(), 2);
}

#[test]
fn e2_without_a_network_newcomers_share_the_scopes_global_budget() {
    let store = store(1_000, 16);
    flood(&store, 0, 5_000, 10);
    let d = store
        .decide_now_from(&request(u64::MAX - 1, u64::MAX - 2), NO_NETWORK)
        .expect("decide");
    assert!(d.is_admitted(), "the global budget is not the flood's");
    // …but it is shared by every newcomer without a network.
    for i in 0..59 {
        store
            .decide_now_from(&request(1 << 40 | i, 1 << 41 | i), NO_NETWORK)
            .expect("decide");
    }
    let d = store
        .decide_now_from(&request(1 << 42, 1 << 43), NO_NETWORK)
        .expect("decide");
    assert!(!d.is_admitted());
}

#[test]
fn e2_a_network_overflow_budget_admits_exactly_its_limit_under_threads() {
    // Newcomers decided at once on different shards, all folded into one
    // network's budget: the overflow tables stay locked from the first read to
    // the commit, so no two decisions spend the same count.
    let store = Arc::new(store(64, 16));
    // Ten times the key cap of callers on a budget nobody exhausts: every
    // shard is full whatever the hasher's seed (a shard left with room would
    // give a newcomer a cell of its own), while the per-network table stays
    // empty for network 9,999 (a full one would fold it into the scope's
    // global budget).
    let fill = BudgetKey::new("fill", b"").scope();
    for i in 0..640 {
        let budget = Budget::per_window(BudgetKey::from_digests(fill, i), 1_000_000, minute());
        assert!(store.decide_now(&[budget]).expect("decide").is_admitted());
    }
    assert_eq!(store.len(), store.capacity(), "every shard is full");
    let admitted: usize = (0..4u64)
        .map(|t| {
            let store = Arc::clone(&store);
            std::thread::spawn(move || {
                (0..2_000u64)
                    .filter(|i| {
                        let caller = 1 << 50 | t << 20 | i;
                        store
                            .decide_now_from(&request(caller, caller), 9_999)
                            .expect("decide")
                            .is_admitted()
                    })
                    .count()
            })
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|h| h.join().expect("thread"))
        .sum();
    assert_eq!(admitted, 60, "the network's standard budget, exactly");
}

#[test]
fn a_gcra_cell_back_at_full_capacity_is_dropped() {
    // governor's `retain_recent` idea: a cell whose bucket is full again
    // carries nothing, so a caller that spent nothing recently holds no cell.
    let store = store(1_000, 16);
    let scope = BudgetKey::new("pace", b"").scope();
    let gcra = |s: u64| Budget {
        key: BudgetKey::from_digests(scope, s),
        rate: Rate::Gcra {
            period: Duration::from_secs(10),
            burst: NonZeroU32::new(5).expect("non-zero"),
        },
        limit: 10,
        cost: 1,
    };
    for s in 0..500 {
        assert!(store.decide_now(&[gcra(s)]).expect("decide").is_admitted());
    }
    assert_eq!(store.len(), 500);
    store.clock().advance(Duration::from_secs(3));
    store.reclaim();
    assert_eq!(store.len(), 0, "every bucket refilled: nothing kept");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// Whatever floods arrive, from up to 30 networks, and however time moves:
    /// the store stays within its caps, and an active caller's count in each
    /// window is exactly what it spent (eviction never hands it a fresh budget),
    /// whether it holds a cell of its own or shares its network's overflow
    /// budget (30 networks' two budgets, and its own, fit the table of 64).
    #[test]
    fn e2_floods_never_reset_an_active_caller_and_stay_bounded(
        steps in proptest::collection::vec(
            (0u8..4, 1u64..400, 1u64..31, 0u64..20), 1..40),
    ) {
        let store = store(512, 16);
        prop_assert_eq!(store.overflow_capacity(), 64);
        let active = request(u64::MAX - 1, u64::MAX - 2);
        let mut spent_in_window = 0u32;
        let mut window = (T0 + 1) / 60;
        let mut next = 0u64;
        for (kind, n, networks, secs) in steps {
            match kind {
                0 | 1 => {
                    flood(&store, next, n * 10, networks);
                    next += n * 10;
                }
                2 => {
                    for _ in 0..n % 7 {
                        let d = store.decide_now_from(&active, 4242).expect("decide");
                        if d.is_admitted() {
                            spent_in_window += 1;
                        }
                    }
                }
                _ => store.clock().advance(Duration::from_secs(secs)),
            }
            let now = store.clock().now().as_secs() / 60;
            if now != window {
                window = now;
                spent_in_window = 0;
            }
            prop_assert!(store.len() <= store.capacity());
            prop_assert!(store.overflow_len().0 <= store.overflow_capacity());
            let d = store.peek_now_from(&active, 4242).expect("peek");
            prop_assert_eq!(d.statuses()[0].remaining, 60 - spent_in_window.min(60));
        }
    }
}
