//! One suite for both lease ledgers: the same sequences of takes, renewals,
//! releases, cancellations, count reads and waits go to the
//! [`MemoryLedger`] and to the [`RedisLedger`] script, and both must answer
//! alike — hand-picked cases for every limit and refusal reason, then random
//! sequences (proptest).
//!
//! Time is injected, never slept: the memory ledger runs on a paused tokio
//! runtime moved with `tokio::time::advance`, the Redis script decides at a
//! [`FakeClock`]'s time moved by the same amounts, in whole milliseconds
//! (the script's unit). Leases live 20 s and the start window is 60 s of that
//! fake time, and keys expire on the server's real clock only a minute or
//! more after their last write, far longer than a case runs, so no real time
//! can straddle a boundary. Lease ids differ between the two (each ledger
//! makes its own), so a take is compared by its outcome, and later steps
//! name a lease by the order it was taken in.
#![cfg(feature = "redis")]

use std::cell::RefCell;
use std::collections::HashMap;
use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestRng, TestRunner};
use sluice_core::{FakeClock, Timestamp};
use sluice_lanes::{
    LaneConfig, Lease, LeaseKind, Ledger, LedgerCounts, MemoryLedger, RedisLedger,
    RedisLedgerConfig, RefusalReason, Taken, WorkspaceLimits,
};
use tokio::runtime::Runtime;

use crate::redis_server;

use redis_server::RedisServer;

/// How long a lease lives without renewal, in every case.
const TTL: Duration = Duration::from_secs(20);
/// The rolling start window, in every case.
const WINDOW: Duration = Duration::from_secs(60);
/// The fake clock's start (2025-12-01, Unix seconds).
const T0_SECS: u64 = 1_764_547_200;

const WORKSPACES: [&str; 3] = ["acme", "globex", "initech"];

/// One step of a sequence.
#[derive(Clone, Debug)]
enum Op {
    /// `Ledger::take` for a workspace (index into [`WORKSPACES`]).
    Take(usize, LeaseKind),
    /// `Ledger::renew` of the n-th lease taken.
    Renew(usize),
    /// `Ledger::release` of the n-th lease taken.
    Release(usize),
    /// `Ledger::cancel` of the n-th lease taken.
    Cancel(usize),
    /// `Ledger::counts` of a workspace.
    Counts(usize),
    /// Both clocks move forward this many milliseconds.
    Wait(u64),
}

/// What a ledger answered, lease ids aside.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Answer {
    Leased,
    Refused {
        reason: RefusalReason,
        retry_after: Option<Duration>,
        may_free: bool,
    },
    Renewed(bool),
    Done,
    Counts(LedgerCounts),
}

impl From<Taken> for Answer {
    fn from(taken: Taken) -> Self {
        match taken {
            Taken::Leased(_) => Answer::Leased,
            Taken::Refused {
                reason,
                retry_after,
                may_free,
            } => Answer::Refused {
                reason,
                retry_after,
                may_free,
            },
        }
    }
}

/// A `redis-server` and a runtime for the Redis ledgers of one test.
struct Shared {
    redis_rt: Runtime,
    server: RedisServer,
    clock: FakeClock,
    lanes: u32,
}

impl Shared {
    fn start(name: &str) -> Self {
        let redis_rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        Shared {
            redis_rt,
            server: RedisServer::start(name),
            clock: FakeClock::new(Timestamp::from_secs(T0_SECS)),
            lanes: 0,
        }
    }

    /// Both ledgers for `limits`, the Redis one on a lane of its own.
    fn pair(&mut self, limits: LaneConfig) -> Pair<'_> {
        self.lanes += 1;
        self.clock.set(Timestamp::from_secs(T0_SECS));
        let mut config = RedisLedgerConfig::new(self.server.url());
        config.lease_ttl = TTL;
        config.timeout = Duration::from_secs(2);
        let lane = format!("lane-{}", self.lanes);
        let redis = self
            .redis_rt
            .block_on(RedisLedger::connect_with_clock(
                config,
                &lane,
                limits.clone(),
                self.clock.clone(),
            ))
            .expect("connect");
        let memory_rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .expect("paused runtime");
        Pair {
            memory_rt,
            lane: limits.workspace_limits(),
            own: HashMap::new(),
            memory: MemoryLedger::new(limits, TTL),
            redis_rt: &self.redis_rt,
            redis,
            clock: &self.clock,
            leases: Vec::new(),
        }
    }
}

/// The two ledgers of one case, on one timeline.
struct Pair<'a> {
    memory_rt: Runtime,
    /// The lane's per-workspace limits.
    lane: WorkspaceLimits,
    /// Workspaces with limits of their own (as a plan gives), by index.
    own: HashMap<usize, WorkspaceLimits>,
    memory: MemoryLedger,
    redis_rt: &'a Runtime,
    redis: RedisLedger,
    clock: &'a FakeClock,
    /// Every lease taken, in order: (memory's, Redis's).
    leases: Vec<(Lease, Lease)>,
}

impl Pair<'_> {
    /// Runs `op` on both; `Err` says how they differ. A step naming a lease
    /// that was never taken answers `Done` on neither side.
    fn step(&mut self, op: &Op) -> Result<Answer, String> {
        let lease = |n: usize| self.leases.get(n).cloned();
        let (memory, redis) = match *op {
            Op::Take(i, kind) => {
                let ws = WORKSPACES[i];
                let limits = self.own.get(&i).copied().unwrap_or(self.lane);
                let m = self.memory_rt.block_on(self.memory.take(ws, limits, kind));
                let r = self.redis_rt.block_on(self.redis.take(ws, limits, kind));
                let (m, r) = (m.map_err(|e| e.to_string())?, r.map_err(|e| e.to_string())?);
                if let (Taken::Leased(ml), Taken::Leased(rl)) = (&m, &r) {
                    self.leases.push((ml.clone(), rl.clone()));
                }
                (Answer::from(m), Answer::from(r))
            }
            Op::Renew(n) => {
                let Some((ml, rl)) = lease(n) else {
                    return Ok(Answer::Done);
                };
                let m = self.memory_rt.block_on(self.memory.renew(&ml));
                let r = self.redis_rt.block_on(self.redis.renew(&rl));
                (
                    Answer::Renewed(m.map_err(|e| e.to_string())?),
                    Answer::Renewed(r.map_err(|e| e.to_string())?),
                )
            }
            Op::Release(n) | Op::Cancel(n) => {
                let Some((ml, rl)) = lease(n) else {
                    return Ok(Answer::Done);
                };
                let (m, r) = if matches!(op, Op::Release(_)) {
                    (
                        self.memory_rt.block_on(self.memory.release(&ml)),
                        self.redis_rt.block_on(self.redis.release(&rl)),
                    )
                } else {
                    (
                        self.memory_rt.block_on(self.memory.cancel(&ml)),
                        self.redis_rt.block_on(self.redis.cancel(&rl)),
                    )
                };
                m.map_err(|e| e.to_string())?;
                r.map_err(|e| e.to_string())?;
                (Answer::Done, Answer::Done)
            }
            Op::Counts(ws) => {
                let ws = WORKSPACES[ws];
                let m = self.memory_rt.block_on(self.memory.counts(ws));
                let r = self.redis_rt.block_on(self.redis.counts(ws));
                (
                    Answer::Counts(m.map_err(|e| e.to_string())?),
                    Answer::Counts(r.map_err(|e| e.to_string())?),
                )
            }
            Op::Wait(ms) => {
                let d = Duration::from_millis(ms);
                self.memory_rt.block_on(tokio::time::advance(d));
                self.clock.advance(d);
                (Answer::Done, Answer::Done)
            }
        };
        if memory == redis {
            Ok(memory)
        } else {
            Err(format!("{op:?}: memory {memory:?}, redis {redis:?}"))
        }
    }

    /// [`Pair::step`], panicking on a difference (hand-picked cases).
    fn expect(&mut self, op: Op) -> Answer {
        self.step(&op)
            .unwrap_or_else(|e| panic!("the ledgers differ: {e}"))
    }

    fn take(&mut self, ws: usize, kind: LeaseKind) -> Answer {
        self.expect(Op::Take(ws, kind))
    }

    fn wait(&mut self, d: Duration) {
        let ms = u64::try_from(d.as_millis()).expect("ms");
        self.expect(Op::Wait(ms));
    }

    fn counts(&mut self, ws: usize) -> LedgerCounts {
        match self.expect(Op::Counts(ws)) {
            Answer::Counts(c) => c,
            other => panic!("{other:?}"),
        }
    }
}

fn limits(in_flight: u32, starts: u32, cap: u32, reserve: u32) -> LaneConfig {
    LaneConfig::new()
        .with_workspace_in_flight(in_flight)
        .with_workspace_starts(starts, WINDOW)
        .with_global_cap(cap)
        .with_batch_reserve(reserve)
}

fn refused(reason: RefusalReason) -> Answer {
    Answer::Refused {
        reason,
        retry_after: None,
        may_free: false,
    }
}

fn rate_limited(retry_after: Duration, may_free: bool) -> Answer {
    Answer::Refused {
        reason: RefusalReason::WorkspaceRateLimit,
        retry_after: Some(retry_after),
        may_free,
    }
}

const SINGLE: LeaseKind = LeaseKind::Single;
const BATCH: LeaseKind = LeaseKind::Batch;

#[test]
fn l1_a_workspace_holds_at_most_its_in_flight_limit_on_both() {
    let mut shared = Shared::start("conf-inflight");
    let mut p = shared.pair(limits(2, 10, 10, 0));
    assert_eq!(p.take(0, SINGLE), Answer::Leased);
    assert_eq!(p.take(0, SINGLE), Answer::Leased);
    assert_eq!(
        p.take(0, SINGLE),
        refused(RefusalReason::WorkspaceInFlightLimit)
    );
    // Another workspace is not held by it.
    assert_eq!(p.take(1, SINGLE), Answer::Leased);
    // A release frees the place at once; a second release changes nothing.
    p.expect(Op::Release(0));
    p.expect(Op::Release(0));
    assert_eq!(p.take(0, SINGLE), Answer::Leased);
    let c = p.counts(0);
    assert_eq!(
        (c.global, c.workspace_running, c.workspace_starts),
        (3, 2, 3)
    );
}

#[test]
fn l1_the_rolling_start_limit_refuses_with_the_time_its_oldest_start_leaves() {
    let mut shared = Shared::start("conf-starts");
    let mut p = shared.pair(limits(5, 2, 10, 0));
    assert_eq!(p.take(0, SINGLE), Answer::Leased);
    p.wait(Duration::from_secs(10));
    assert_eq!(p.take(0, SINGLE), Answer::Leased);
    p.wait(Duration::from_secs(5));
    // Both calls still hold their place: a start may yet be given back.
    assert_eq!(
        p.take(0, SINGLE),
        rate_limited(WINDOW - Duration::from_secs(15), true)
    );
    p.expect(Op::Release(0));
    p.expect(Op::Release(1));
    // Released calls were sent: their starts stay, and none may free early.
    assert_eq!(
        p.take(0, SINGLE),
        rate_limited(WINDOW - Duration::from_secs(15), false)
    );
    assert_eq!(p.take(1, SINGLE), Answer::Leased, "another workspace");
    // At exactly start + window the start has left, on both.
    p.wait(WINDOW - Duration::from_secs(15));
    assert_eq!(p.take(0, SINGLE), Answer::Leased);
    assert_eq!(p.counts(0).workspace_starts, 2);
    // Batch items never count starts.
    assert_eq!(p.take(0, BATCH), Answer::Leased);
    assert_eq!(p.counts(0).workspace_starts, 2);
}

#[test]
fn l1_a_cancelled_call_gives_its_start_back_while_its_lease_holds() {
    let mut shared = Shared::start("conf-cancel");
    let mut p = shared.pair(limits(5, 2, 10, 0));
    assert_eq!(p.take(0, SINGLE), Answer::Leased);
    assert_eq!(p.take(0, SINGLE), Answer::Leased);
    p.expect(Op::Cancel(0));
    assert_eq!(p.counts(0).workspace_starts, 1);
    // Cancelling again, or after a release, gives nothing more back.
    p.expect(Op::Cancel(0));
    p.expect(Op::Release(1));
    p.expect(Op::Cancel(1));
    assert_eq!(p.counts(0).workspace_starts, 1);
    assert_eq!(p.take(0, SINGLE), Answer::Leased);
    assert_eq!(
        p.take(0, SINGLE),
        rate_limited(WINDOW, true),
        "the new call still holds its place"
    );
}

#[test]
fn l1_an_expired_lease_cancelled_keeps_its_start() {
    // Its place may have gone to another call that counted that start, so
    // the start stays for its window (the script's rule; the memory ledger
    // gave it back when no other operation had dropped the lease first).
    let mut shared = Shared::start("conf-expired-cancel");
    let mut p = shared.pair(limits(5, 1, 10, 0));
    assert_eq!(p.take(0, SINGLE), Answer::Leased);
    p.wait(TTL + Duration::from_secs(1));
    p.expect(Op::Cancel(0));
    let c = p.counts(0);
    assert_eq!((c.workspace_running, c.workspace_starts), (0, 1));
    assert_eq!(
        p.take(0, SINGLE),
        rate_limited(WINDOW - TTL - Duration::from_secs(1), false)
    );
}

#[test]
fn l1_the_global_cap_and_the_batch_reserve_refuse_as_busy() {
    let mut shared = Shared::start("conf-cap");
    // Cap 3, 1 kept from batch items: at most 2 batch items.
    let mut p = shared.pair(limits(5, 10, 3, 1));
    assert_eq!(p.take(0, BATCH), Answer::Leased);
    assert_eq!(p.take(1, BATCH), Answer::Leased);
    assert_eq!(p.take(2, BATCH), refused(RefusalReason::Busy));
    // The reserve is for single calls.
    assert_eq!(p.take(2, SINGLE), Answer::Leased);
    // The cap holds every workspace and kind.
    assert_eq!(p.take(1, SINGLE), refused(RefusalReason::Busy));
    assert_eq!(p.take(0, BATCH), refused(RefusalReason::Busy));
    // A workspace at its own limit hears that first, not busy.
    let mut p = shared.pair(limits(1, 10, 1, 0));
    assert_eq!(p.take(0, SINGLE), Answer::Leased);
    assert_eq!(
        p.take(0, SINGLE),
        refused(RefusalReason::WorkspaceInFlightLimit)
    );
    assert_eq!(p.take(1, SINGLE), refused(RefusalReason::Busy));
    let c = p.counts(1);
    assert_eq!((c.global, c.batch, c.workspace_running), (1, 0, 0));
}

#[test]
fn l1_leases_live_their_ttl_unless_renewed() {
    let mut shared = Shared::start("conf-ttl");
    let mut p = shared.pair(limits(2, 10, 10, 0));
    assert_eq!(p.take(0, SINGLE), Answer::Leased);
    assert_eq!(p.take(0, BATCH), Answer::Leased);
    p.wait(TTL - Duration::from_secs(5));
    assert_eq!(p.expect(Op::Renew(0)), Answer::Renewed(true));
    // At exactly its expiry the unrenewed lease is gone.
    p.wait(Duration::from_secs(5));
    assert_eq!(p.expect(Op::Renew(1)), Answer::Renewed(false));
    let c = p.counts(0);
    assert_eq!((c.global, c.batch, c.workspace_running), (1, 0, 1));
    p.wait(TTL - Duration::from_millis(5_001));
    assert_eq!(p.expect(Op::Renew(0)), Answer::Renewed(true));
    p.expect(Op::Release(0));
    assert_eq!(p.expect(Op::Renew(0)), Answer::Renewed(false));
    assert_eq!(p.counts(0).global, 0);
}

/// A workspace's own limits: `in_flight` running, `starts` per window.
fn own(in_flight: u32, starts: u32) -> WorkspaceLimits {
    let n = |n: u32| std::num::NonZeroU32::new(n).expect("above zero");
    WorkspaceLimits::new(n(in_flight), n(starts))
}

/// P3: a workspace with limits of its own (a plan's) is held to those, on
/// both ledgers, while the others keep the lane's.
#[test]
fn p3_a_workspace_with_limits_of_its_own_is_held_to_them_on_both() {
    let mut shared = Shared::start("conf-own");
    let mut p = shared.pair(limits(1, 2, 10, 0));
    p.own.insert(1, own(3, 4));
    assert_eq!(p.take(0, SINGLE), Answer::Leased);
    assert_eq!(
        p.take(0, SINGLE),
        refused(RefusalReason::WorkspaceInFlightLimit),
        "the lane's limit"
    );
    for _ in 0..3 {
        assert_eq!(p.take(1, SINGLE), Answer::Leased, "its own limit of 3");
    }
    assert_eq!(
        p.take(1, SINGLE),
        refused(RefusalReason::WorkspaceInFlightLimit)
    );
    // Its own start limit: 4 in the window, then refused until the first leaves.
    p.expect(Op::Release(1));
    assert_eq!(p.take(1, SINGLE), Answer::Leased);
    p.expect(Op::Release(2));
    p.wait(Duration::from_secs(10));
    assert_eq!(
        p.take(1, SINGLE),
        rate_limited(WINDOW - Duration::from_secs(10), true)
    );
    // A smaller limit of its own holds below the lane's.
    let mut q = shared.pair(limits(3, 10, 10, 0));
    q.own.insert(2, own(1, 1));
    assert_eq!(q.take(2, SINGLE), Answer::Leased);
    assert_eq!(
        q.take(2, SINGLE),
        refused(RefusalReason::WorkspaceInFlightLimit)
    );
    q.expect(Op::Release(0));
    assert_eq!(q.take(2, SINGLE), rate_limited(WINDOW, false));
    assert_eq!(q.take(0, SINGLE), Answer::Leased, "the lane's limits");
}

/// Random limits and sequences: small limits, so every refusal shows up; the
/// last workspace has limits of its own in half the cases.
fn case() -> impl Strategy<Value = (LaneConfig, Option<WorkspaceLimits>, Vec<Op>)> {
    let config =
        (1u32..4, 1u32..5, 1u32..6, 0u32..3).prop_map(|(f, s, c, r)| limits(f, s, c, r.min(c)));
    let own = prop::option::of((1u32..5, 1u32..6).prop_map(|(f, s)| own(f, s)));
    let ws = 0..WORKSPACES.len();
    let kind = prop_oneof![3 => Just(SINGLE), 1 => Just(BATCH)];
    let wait = prop_oneof![
        2 => 0u64..2_000,
        3 => 0u64..25_000,
        1 => Just(TTL.as_millis() as u64),
        1 => Just(WINDOW.as_millis() as u64),
    ];
    let op = prop_oneof![
        8 => (ws.clone(), kind).prop_map(|(w, k)| Op::Take(w, k)),
        2 => (0usize..16).prop_map(Op::Renew),
        3 => (0usize..16).prop_map(Op::Release),
        2 => (0usize..16).prop_map(Op::Cancel),
        1 => ws.prop_map(Op::Counts),
        4 => wait.prop_map(Op::Wait),
    ];
    (config, own, prop::collection::vec(op, 1..60))
}

fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(default)
}

/// L1: any sequence of takes, renewals, releases, cancellations, count reads
/// and waits gets the same answers from the memory ledger and the script,
/// and leaves the same counts behind.
#[test]
fn l1_memory_ledger_and_redis_script_answer_alike_for_any_sequence() {
    let shared = RefCell::new(Shared::start("conf-prop"));
    let seen: RefCell<HashMap<String, u32>> = RefCell::default();
    // A fixed seed: the coverage asserted below holds for these cases on every
    // run, not most runs.
    let mut runner = TestRunner::new_with_rng(
        Config {
            cases: cases(128),
            failure_persistence: None,
            ..Config::default()
        },
        TestRng::deterministic_rng(RngAlgorithm::ChaCha),
    );
    runner
        .run(&case(), |(config, own, ops)| {
            let mut shared = shared.borrow_mut();
            let mut p = shared.pair(config);
            if let Some(own) = own {
                p.own.insert(WORKSPACES.len() - 1, own);
            }
            // A lease is named by its number modulo the leases taken so far.
            for op in &ops {
                let op = match *op {
                    Op::Renew(_) | Op::Release(_) | Op::Cancel(_) if p.leases.is_empty() => {
                        continue;
                    }
                    Op::Renew(n) => Op::Renew(n % p.leases.len()),
                    Op::Release(n) => Op::Release(n % p.leases.len()),
                    Op::Cancel(n) => Op::Cancel(n % p.leases.len()),
                    ref other => other.clone(),
                };
                let answer = p.step(&op).map_err(TestCaseError::fail)?;
                let label = match answer {
                    Answer::Refused {
                        reason, may_free, ..
                    } => format!("{reason:?} may_free={may_free}"),
                    Answer::Renewed(held) => format!("renewed={held}"),
                    Answer::Leased => "leased".to_owned(),
                    _ => continue,
                };
                *seen.borrow_mut().entry(label).or_default() += 1;
            }
            for ws in 0..WORKSPACES.len() {
                p.step(&Op::Counts(ws)).map_err(TestCaseError::fail)?;
            }
            Ok(())
        })
        .unwrap_or_else(|e| panic!("{e}"));
    // A suite that never reached a case would prove nothing about it.
    let seen = seen.into_inner();
    for label in [
        "leased",
        "WorkspaceInFlightLimit may_free=false",
        "WorkspaceRateLimit may_free=false",
        "WorkspaceRateLimit may_free=true",
        "Busy may_free=false",
        "renewed=true",
        "renewed=false",
    ] {
        assert!(
            seen.get(label).is_some_and(|&n| n > 0),
            "never saw {label}: {seen:?}"
        );
    }
}
