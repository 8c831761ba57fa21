//! D4: leases taken by the Redis script (kind `l`) and by sluice-core's
//! reference model (`take_leases`) agree: the same random sequences of
//! requests (leased fixed windows beside exact budgets, each asking for some
//! units past its cost), give-backs of leftovers (`adjust` by a negative delta
//! at the lease's instant, also after its window, alone or in a take's own
//! call) and moves of one fake clock
//! give identical decisions and grants. The memory store's leases are exact
//! (each grant its cost): one process has one ledger.
#![cfg(feature = "redis")]

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestRng, TestRunner};
use sluice_core::{
    Budget, BudgetKey, CellRef, Clock, FakeClock, GiveBack, Ledger, Rate, Timestamp, adjust,
    take_leases,
};
use sluice_store::{BudgetStore, MemoryConfig, MemoryStore, RedisConfig, RedisStore};

use crate::redis_server;

use redis_server::RedisServer;

const T0_SECS: u64 = 3_897_244_800 - 90;

fn nz(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).expect("non-zero")
}

/// Two leased fixed windows, an exact fixed window and an exact GCRA budget.
fn budgets(case: u64) -> Vec<Budget> {
    let shapes = [
        (Rate::FixedWindow { seconds: nz(10) }, 12),
        (Rate::FixedWindow { seconds: nz(1) }, 5),
        (Rate::FixedWindow { seconds: nz(2) }, 4),
        (
            Rate::Gcra {
                period: Duration::from_secs(1),
                burst: nz(2),
            },
            3,
        ),
    ];
    shapes
        .iter()
        .enumerate()
        .map(|(i, &(rate, limit))| Budget {
            key: BudgetKey::new("lease", format!("c{case}-b{i}").as_bytes()),
            rate,
            limit,
            cost: 1,
        })
        .collect()
}

#[derive(Default)]
struct MapLedger(HashMap<u64, u64>);

impl Ledger for MapLedger {
    fn read(&mut self, at: CellRef<'_>) -> u64 {
        self.0.get(&at.cell).copied().unwrap_or(0)
    }
    fn write(&mut self, at: CellRef<'_>, value: u64) {
        self.0.insert(at.cell, value);
    }
}

#[derive(Clone, Debug)]
enum Step {
    /// A request over `(budget, cost, want)`, taking leases, after giving
    /// back leftovers `(budget, units, back)` in the same call.
    Take(Vec<(usize, u32, u32)>, Vec<(usize, u32, usize)>),
    /// Give back `units` of `budget`, for the take `back` takes ago.
    GiveBack {
        budget: usize,
        units: u32,
        back: usize,
    },
    /// The clock moves.
    Advance(u64),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        5 => proptest::sample::subsequence(vec![0usize, 1, 2, 3], 1..=4).prop_flat_map(|picks| {
            let n = picks.len();
            (
                Just(picks),
                proptest::collection::vec((0u32..=3, 0u32..=14), n),
                prop_oneof![
                    2 => Just(Vec::new()),
                    1 => proptest::collection::vec((0usize..4, 1u32..=6, 0usize..4), 1..=3),
                ],
            )
                .prop_map(|(picks, cw, backs)| {
                    Step::Take(
                        picks.into_iter().zip(cw).map(|(b, (c, w))| (b, c, w)).collect(),
                        backs,
                    )
                })
        }),
        2 => (0usize..4, 1u32..=6, 0usize..4)
            .prop_map(|(budget, units, back)| Step::GiveBack { budget, units, back }),
        2 => (1u64..1_500_000).prop_map(Step::Advance),
    ]
}

fn fail(e: impl std::fmt::Display) -> TestCaseError {
    TestCaseError::fail(e.to_string())
}

async fn run_case(
    clock: &FakeClock,
    redis: &RedisStore,
    all: &[Budget],
    steps: &[Step],
) -> Result<(), TestCaseError> {
    let mut ledger = MapLedger::default();
    let memory = MemoryStore::with_clock(MemoryConfig::with_max_keys(1_000), clock.clone());
    let mut taken_at: Vec<Timestamp> = Vec::new();
    for (i, s) in steps.iter().enumerate() {
        let now = clock.now();
        match s {
            Step::Take(picks, backs) => {
                let bs: Vec<Budget> = picks
                    .iter()
                    .map(|&(b, cost, _)| all[b].with_cost(cost))
                    .collect();
                let wants: Vec<u32> = picks.iter().map(|&(_, _, w)| w).collect();
                let backs: Vec<(Budget, GiveBack)> = backs
                    .iter()
                    .map(|&(budget, units, back)| {
                        let reserved_at = taken_at
                            .len()
                            .checked_sub(back + 1)
                            .and_then(|k| taken_at.get(k))
                            .copied()
                            .unwrap_or(now);
                        (all[budget], GiveBack { units, reserved_at })
                    })
                    .collect();
                for (b, back) in &backs {
                    adjust(
                        b,
                        -i64::from(back.units),
                        back.reserved_at,
                        &mut ledger,
                        now,
                    );
                }
                let (want_d, want_g) = take_leases(&bs, &wants, &mut ledger, now).map_err(fail)?;
                let (got_d, got_g) = redis.take_leases(&bs, &wants, &backs).await.map_err(fail)?;
                prop_assert_eq!((&want_d, &want_g), (&got_d, &got_g), "step {}: {:?}", i, s);
                for (g, b) in want_g.iter().zip(&bs) {
                    prop_assert!(*g == 0 || *g >= b.cost, "a grant covers the cost");
                    prop_assert!(*g <= b.limit, "a grant never passes the limit");
                }
                let (mem_d, mem_g) = memory
                    .take_leases(&bs, &wants, &backs)
                    .await
                    .map_err(fail)?;
                let exact: Vec<u32> = bs
                    .iter()
                    .map(|b| if mem_d.is_admitted() { b.cost } else { 0 })
                    .collect();
                prop_assert_eq!(mem_g, exact, "the memory store's leases are exact");
                if want_d.is_admitted() {
                    taken_at.push(now);
                }
            }
            Step::GiveBack {
                budget,
                units,
                back,
            } => {
                let at = taken_at
                    .len()
                    .checked_sub(back + 1)
                    .and_then(|k| taken_at.get(k))
                    .copied()
                    .unwrap_or(now);
                let b = all[*budget];
                let want = adjust(&b, -i64::from(*units), at, &mut ledger, now);
                let got = redis
                    .adjust(&b, -i64::from(*units), at)
                    .await
                    .map_err(fail)?;
                prop_assert_eq!(want, got, "step {}: {:?}", i, s);
            }
            Step::Advance(us) => clock.advance(Duration::from_micros(*us)),
        }
    }
    Ok(())
}

/// D4: the Redis script's leases are sluice-core's, decision for decision.
#[test]
fn d4_redis_script_takes_and_gives_back_leases_as_the_reference_model() {
    let clock = FakeClock::new(Timestamp::from_secs(T0_SECS));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let server = RedisServer::start("lease-parity");
    let mut config = RedisConfig::new(server.url());
    config.timeout = Duration::from_secs(2);
    let store = rt
        .block_on(RedisStore::connect_with_clock(config, clock.clone()))
        .expect("connect");
    let cases: u32 = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(96);
    let mut runner = TestRunner::new_with_rng(
        Config {
            cases,
            failure_persistence: None,
            ..Config::default()
        },
        TestRng::deterministic_rng(RngAlgorithm::ChaCha),
    );
    let case = std::cell::Cell::new(0u64);
    let result = runner.run(&proptest::collection::vec(step(), 1..60), |steps| {
        case.set(case.get() + 1);
        let all = budgets(case.get());
        rt.block_on(run_case(&clock, &store, &all, &steps))
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}
