//! sluice's keyed memory decision side by side with governor's
//! `DefaultKeyedRateLimiter::check_key`, in one run.
//!
//! Rows: one hot key, 100,000 keys round-robin, each on 1 and 2 threads;
//! and a 4-budget all-or-nothing decision against one governor check (and,
//! for context, four independent ones).
//! Limits are high enough that every call is admitted on both sides.
//! Multi-thread rows report wall time divided by the decisions made by all
//! threads (time per decision at aggregate throughput).

use std::hint::black_box;
use std::num::NonZeroU32;
use std::time::Duration;

mod support;
use support::threaded;

use criterion::{Criterion, criterion_group, criterion_main};
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};
use sluice_core::{Budget, BudgetKey, Rate};
use sluice_store::{MemoryConfig, MemoryStore};

const KEYS: u64 = 100_000;

fn sluice_store() -> MemoryStore {
    MemoryStore::new(MemoryConfig::default())
}

fn governor() -> DefaultKeyedRateLimiter<u64> {
    RateLimiter::keyed(Quota::per_second(NonZeroU32::MAX))
}

fn budget(scope: u64, subject: u64) -> Budget {
    Budget::per_window(
        BudgetKey::from_digests(scope, subject),
        u32::MAX,
        NonZeroU32::new(60).expect("non-zero"),
    )
}

fn single_budget(c: &mut Criterion) {
    let scope = BudgetKey::new("expensive", b"").scope();
    for threads in [1u64, 2] {
        let mut g = c.benchmark_group(format!("hot_key/{threads}_thread"));
        let store = sluice_store();
        let gov = governor();
        g.bench_function("sluice", |b| {
            b.iter_custom(|iters| {
                threaded(threads, iters, &|_, _| {
                    black_box(store.decide_now(&[budget(scope, 7)]).is_ok());
                })
            })
        });
        g.bench_function("governor", |b| {
            b.iter_custom(|iters| {
                threaded(threads, iters, &|_, _| {
                    black_box(gov.check_key(&7).is_ok());
                })
            })
        });
        g.finish();

        let mut g = c.benchmark_group(format!("keys_100k_round_robin/{threads}_thread"));
        let store = sluice_store();
        let gov = governor();
        for k in 0..KEYS {
            store.decide_now(&[budget(scope, k)]).expect("warm");
            gov.check_key(&k).ok();
        }
        g.bench_function("sluice", |b| {
            b.iter_custom(|iters| {
                threaded(threads, iters, &|t, i| {
                    let k = (i * 7 + t * 50_000) % KEYS;
                    black_box(store.decide_now(&[budget(scope, k)]).is_ok());
                })
            })
        });
        g.bench_function("governor", |b| {
            b.iter_custom(|iters| {
                threaded(threads, iters, &|t, i| {
                    let k = (i * 7 + t * 50_000) % KEYS;
                    black_box(gov.check_key(&k).is_ok());
                })
            })
        });
        g.finish();
    }
}

fn four_budgets(c: &mut Criterion) {
    let mut g = c.benchmark_group("four_budgets/1_thread");
    let store = sluice_store();
    let gov = governor();
    let class = BudgetKey::new("expensive", b"").scope();
    let ip = BudgetKey::new("ip", b"").scope();
    let route = BudgetKey::new("route:/oauth/register", b"").scope();
    let quota = BudgetKey::new("quota:messages", b"").scope();
    g.bench_function("sluice_4_budgets", |b| {
        let mut i = 0u64;
        b.iter(|| {
            i = (i + 1) % KEYS;
            let req = [
                budget(class, i),
                budget(ip, i / 10),
                budget(route, i / 10),
                Budget {
                    rate: Rate::CalendarMonth,
                    ..budget(quota, i / 100)
                },
            ];
            black_box(store.decide_now(&req).is_ok())
        })
    });
    g.bench_function("governor_1_check", |b| {
        let mut i = 0u64;
        b.iter(|| {
            i = (i + 1) % KEYS;
            black_box(gov.check_key(&i).is_ok())
        })
    });
    // Context, not the goal's anchor: four independent governor checks on the
    // same key pattern (not all-or-nothing: a refusal on the last would not
    // give back the first three).
    let govs = [governor(), governor(), governor(), governor()];
    g.bench_function("governor_4_checks", |b| {
        let mut i = 0u64;
        b.iter(|| {
            i = (i + 1) % KEYS;
            let ok = govs[0].check_key(&i).is_ok()
                & govs[1].check_key(&(i / 10)).is_ok()
                & govs[2].check_key(&(i / 10)).is_ok()
                & govs[3].check_key(&(i / 100)).is_ok();
            black_box(ok)
        })
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    targets = single_budget, four_budgets
}
criterion_main!(benches);
