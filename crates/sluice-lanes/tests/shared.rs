//! Lanes that share one ledger act as replicas: the limits hold across all of
//! them (L1, L2 and D2 for lanes). Two `Lane`s on clones of one `MemoryLedger`
//! stand for two replicas on one Redis, on tokio's paused clock.

use crate::support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use sluice_lanes::{
    Lane, LaneConfig, Lease, LeaseKind, Ledger, LedgerCounts, LedgerError, LedgerOutage,
    MemoryLedger, Outcome, RefusalReason, Taken, WorkspaceLimits,
};
use support::{REST, running, settle, spawn_wait};
use tokio::time::{Instant, advance};

const SEC: Duration = Duration::from_secs(1);
const TTL: Duration = Duration::from_secs(10);

/// Two replicas of the default lane on one ledger.
fn replicas() -> (Lane, Lane, MemoryLedger) {
    let config = LaneConfig::default();
    let ledger = MemoryLedger::new(config.clone(), TTL);
    let lane = |l: &MemoryLedger| {
        Lane::with_ledger(
            "optimizer",
            config.clone(),
            l.clone(),
            LedgerOutage::FailClosed,
        )
        .expect("config")
    };
    (lane(&ledger), lane(&ledger), ledger)
}

async fn counts(ledger: &MemoryLedger, workspace: &str) -> LedgerCounts {
    ledger.counts(workspace).await.expect("memory ledger")
}

#[tokio::test(start_paused = true)]
async fn l1_three_per_workspace_hold_across_two_replicas() {
    let (a, b, ledger) = replicas();
    let mut held = vec![
        a.acquire("acme", REST).await.expect("1st"),
        a.acquire("acme", REST).await.expect("2nd"),
        b.acquire("acme", REST).await.expect("3rd"),
    ];
    assert!(b.is_shared());
    // b counts one of acme's calls itself: its own count would start another.
    assert_eq!(running(&b, "acme"), 1);
    let asked = Instant::now();
    let refused = b
        .acquire("acme", REST)
        .await
        .expect_err("a 4th across replicas");
    assert_eq!(asked.elapsed(), REST, "it waited its whole wait");
    assert_eq!(refused.reason, RefusalReason::WorkspaceInFlightLimit);
    assert!(refused.retry_after >= 5 * SEC, "an estimate within bounds");
    assert_eq!(
        running(&b, "acme"),
        1,
        "the refused call gave its place back"
    );
    let c = counts(&ledger, "acme").await;
    assert_eq!(
        (c.workspace_running, c.workspace_starts),
        (3, 3),
        "no start spent by the refused call"
    );
    // Another workspace is not held by acme's limit on either replica.
    b.acquire("globex", REST)
        .await
        .expect("globex")
        .finish(Outcome::Success);
    held.pop().expect("a permit").finish(Outcome::Success);
}

#[tokio::test(start_paused = true)]
async fn l1_the_global_cap_of_20_holds_across_two_replicas() {
    let (a, b, ledger) = replicas();
    let mut held = Vec::new();
    for i in 0..20 {
        let lane = if i % 2 == 0 { &a } else { &b };
        let workspace = format!("w{}", i / 3);
        held.push(lane.acquire(&workspace, REST).await.expect("a place"));
    }
    assert_eq!(counts(&ledger, "x").await.global, 20);
    assert_eq!(a.snapshot().running + b.snapshot().running, 20);
    assert!(
        a.snapshot().running < 20,
        "neither replica is full by its own count"
    );
    for lane in [&a, &b] {
        let refused = lane.acquire("fresh", REST).await.expect_err("cap is full");
        assert_eq!(refused.reason, RefusalReason::Busy);
    }
    assert_eq!(
        lane_batch(&a).await,
        None,
        "no batch item beyond the shared cap"
    );
    assert_eq!(counts(&ledger, "x").await.global, 20);
}

async fn lane_batch(lane: &Lane) -> Option<String> {
    lane.acquire_batch("bulk")
        .await
        .map(|p| p.workspace().to_owned())
}

#[tokio::test(start_paused = true)]
async fn l1_a_place_freed_on_one_replica_goes_to_a_waiter_on_the_other_within_the_retry() {
    let (a, b, ledger) = replicas();
    let retry = a.config().lease_retry;
    let mut three = vec![
        a.acquire("acme", REST).await.expect("1"),
        a.acquire("acme", REST).await.expect("2"),
        a.acquire("acme", REST).await.expect("3"),
    ];
    let waiter = spawn_wait(&b, "acme", REST);
    settle().await;
    advance(5 * SEC + retry / 3).await;
    settle().await;
    assert!(!waiter.is_finished(), "still held by a's three calls");
    let freed = Instant::now();
    three.pop().expect("a permit").finish(Outcome::Success);
    let (got, waited) = waiter.await.expect("task");
    let permit = got.expect("the place freed on a went to b's waiter");
    let after = Instant::now() - freed;
    // Tokio's timers fire on whole milliseconds: one more at most.
    assert!(
        after <= retry + Duration::from_millis(1),
        "taken {after:?} after it freed (retry {retry:?})"
    );
    assert!(waited < REST);
    let c = counts(&ledger, "acme").await;
    assert_eq!(c.workspace_running, 3);
    assert_eq!(
        c.workspace_starts, 4,
        "asking again spent no start while refused"
    );
    drop(permit);
}

#[tokio::test(start_paused = true)]
async fn l1_the_global_cap_hands_a_place_across_replicas_and_the_line_keeps_its_order() {
    let (a, b, _ledger) = replicas();
    let mut held = Vec::new();
    for i in 0..20 {
        held.push(
            a.acquire(&format!("w{}", i / 3), REST)
                .await
                .expect("place"),
        );
    }
    let first = spawn_wait(&b, "late-1", REST);
    settle().await;
    advance(SEC).await;
    let second = spawn_wait(&b, "late-2", REST);
    settle().await;
    advance(SEC).await;
    held.pop().expect("a permit").finish(Outcome::Success);
    let (got, _) = first.await.expect("task");
    assert!(got.is_ok(), "the first in b's line took the freed place");
    settle().await;
    assert!(!second.is_finished(), "the cap is full again");
    held.pop().expect("a permit").finish(Outcome::Success);
    let (got, waited) = second.await.expect("task");
    assert!(got.is_ok());
    assert!(waited < REST);
}

#[tokio::test(start_paused = true)]
async fn l1_finished_cancelled_and_dropped_permits_give_their_lease_back() {
    let (a, _b, ledger) = replicas();
    let finished = a.acquire("acme", REST).await.expect("place");
    let cancelled = a.acquire("acme", REST).await.expect("place");
    let dropped = a.acquire("acme", REST).await.expect("place");
    assert_eq!(a.leases_held(), 3);
    assert_eq!(counts(&ledger, "acme").await.workspace_running, 3);
    finished.finish(Outcome::Success);
    cancelled.cancel();
    drop(dropped);
    settle().await;
    assert_eq!(a.leases_held(), 0);
    let c = counts(&ledger, "acme").await;
    assert_eq!((c.global, c.workspace_running), (0, 0));
    assert_eq!(
        c.workspace_starts, 2,
        "the cancelled call's start went back too"
    );
    // A batch item's lease goes back the same way.
    let item = a.acquire_batch("bulk").await.expect("a batch place");
    assert_eq!(counts(&ledger, "bulk").await.batch, 1);
    item.finish(Outcome::Success);
    settle().await;
    assert_eq!(counts(&ledger, "bulk").await.batch, 0);
}

#[tokio::test(start_paused = true)]
async fn l1_leases_are_renewed_while_their_calls_run() {
    let (a, b, ledger) = replicas();
    let three = vec![
        a.acquire("acme", REST).await.expect("1"),
        a.acquire("acme", REST).await.expect("2"),
        a.acquire("acme", REST).await.expect("3"),
    ];
    // Six lease lifetimes later the calls still hold their places.
    for _ in 0..60 {
        advance(SEC).await;
        settle().await;
    }
    assert_eq!(counts(&ledger, "acme").await.workspace_running, 3);
    let refused = b.acquire("acme", REST).await.expect_err("still 3 running");
    assert_eq!(refused.reason, RefusalReason::WorkspaceInFlightLimit);
    drop(three);
    settle().await;
    assert_eq!(counts(&ledger, "acme").await.workspace_running, 0);
}

#[tokio::test(start_paused = true)]
async fn l1_the_start_limit_holds_across_replicas_with_an_exact_retry_after() {
    let (a, b, _ledger) = replicas();
    for i in 0..12 {
        let lane = if i % 2 == 0 { &a } else { &b };
        lane.acquire("acme", REST)
            .await
            .expect("a start")
            .finish(Outcome::Success);
        advance(SEC).await;
    }
    // b counts 6 starts itself; the ledger counts 12. The first left at
    // t = 0 leaves the window at 60 s; it is 12 s now.
    let asked = Instant::now();
    let refused = b.acquire("acme", REST).await.expect_err("13th start");
    assert_eq!(
        asked.elapsed(),
        Duration::ZERO,
        "refused at once: its slot is past its wait"
    );
    assert_eq!(refused.reason, RefusalReason::WorkspaceRateLimit);
    assert_eq!(refused.retry_after, 48 * SEC, "exact");
    // With a long enough wait, the call starts exactly when the slot frees.
    let asked = Instant::now();
    let permit = b.acquire("acme", 60 * SEC).await.expect("starts at 60 s");
    assert_eq!(asked.elapsed(), 48 * SEC);
    drop(permit);
}

#[tokio::test(start_paused = true)]
async fn l4_batch_items_stay_within_cap_minus_reserve_across_replicas() {
    let (a, b, ledger) = replicas();
    let mut items = Vec::new();
    for i in 0..15 {
        let lane = if i % 2 == 0 { &a } else { &b };
        items.push(lane.acquire_batch("bulk").await.expect("a batch place"));
    }
    assert!(a.acquire_batch("bulk").await.is_none());
    assert!(
        b.try_acquire_batch("bulk").is_none(),
        "a shared lane leases through acquire_batch only"
    );
    // Single calls still have the reserve, on either replica.
    let single = b.acquire("acme", REST).await.expect("reserve");
    assert_eq!(counts(&ledger, "acme").await.global, 16);
    drop(single);
    drop(items);
    settle().await;
    assert_eq!(counts(&ledger, "acme").await.global, 0);
}

/// A ledger that can be taken down: a `MemoryLedger` behind a switch.
#[derive(Clone)]
struct Flaky {
    inner: MemoryLedger,
    down: Arc<AtomicBool>,
}

impl Flaky {
    fn check(&self) -> Result<(), LedgerError> {
        if self.down.load(Ordering::SeqCst) {
            Err(LedgerError::Unavailable("connection refused".into()))
        } else {
            Ok(())
        }
    }
}

impl Ledger for Flaky {
    async fn take(
        &self,
        workspace: &str,
        limits: WorkspaceLimits,
        kind: LeaseKind,
    ) -> Result<Taken, LedgerError> {
        self.check()?;
        self.inner.take(workspace, limits, kind).await
    }
    async fn renew(&self, lease: &Lease) -> Result<bool, LedgerError> {
        self.check()?;
        self.inner.renew(lease).await
    }
    async fn release(&self, lease: &Lease) -> Result<(), LedgerError> {
        self.check()?;
        self.inner.release(lease).await
    }
    async fn counts(&self, workspace: &str) -> Result<LedgerCounts, LedgerError> {
        self.check()?;
        self.inner.counts(workspace).await
    }
    fn ttl(&self) -> Duration {
        self.inner.ttl()
    }
}

fn flaky(outage: LedgerOutage) -> (Lane, Arc<AtomicBool>) {
    let config = LaneConfig::default();
    let down = Arc::new(AtomicBool::new(false));
    let ledger = Flaky {
        inner: MemoryLedger::new(config.clone(), TTL),
        down: Arc::clone(&down),
    };
    let lane = Lane::with_ledger("optimizer", config, ledger, outage).expect("config");
    (lane, down)
}

#[tokio::test(start_paused = true)]
async fn d3_an_unreachable_ledger_fails_closed_at_once_and_recovers_by_itself() {
    let (lane, down) = flaky(LedgerOutage::FailClosed);
    down.store(true, Ordering::SeqCst);
    let asked = Instant::now();
    let refused = lane.acquire("acme", REST).await.expect_err("ledger down");
    assert_eq!(asked.elapsed(), Duration::ZERO, "no call hangs");
    assert_eq!(refused.reason, RefusalReason::LedgerUnavailable);
    assert_eq!(refused.reason.as_str(), "ledger_unavailable");
    assert_eq!(refused.retry_after, SEC);
    let snapshot = lane.snapshot();
    assert_eq!(snapshot.running, 0);
    assert!(
        snapshot.workspaces.is_empty(),
        "neither its place nor its start stayed: {snapshot:?}"
    );
    assert!(
        lane.acquire_batch("bulk").await.is_none(),
        "batch items wait"
    );
    down.store(false, Ordering::SeqCst);
    let permit = lane.acquire("acme", REST).await.expect("served again");
    assert_eq!(lane.leases_held(), 1);
    drop(permit);
}

#[tokio::test(start_paused = true)]
async fn d3_failing_open_a_replica_counts_its_share_of_each_limit() {
    let replicas = std::num::NonZeroU32::new(2).expect("2");
    let (lane, down) = flaky(LedgerOutage::FailOpen { replicas });
    down.store(true, Ordering::SeqCst);
    // 3 per workspace / 2 replicas = 1; 20 global / 2 = 10.
    let one = lane.acquire("acme", REST).await.expect("its share");
    let refused = lane.acquire("acme", REST).await.expect_err("1 of 3 here");
    assert_eq!(refused.reason, RefusalReason::WorkspaceInFlightLimit);
    let mut held = vec![one];
    for i in 1..10 {
        held.push(lane.acquire(&format!("w{i}"), REST).await.expect("share"));
    }
    let refused = lane.acquire("w10", REST).await.expect_err("10 of 20 here");
    assert_eq!(refused.reason, RefusalReason::Busy);
    // Renewed on the fallback while the ledger stays down.
    for _ in 0..30 {
        advance(SEC).await;
        settle().await;
    }
    assert_eq!(lane.leases_held(), 10);
    down.store(false, Ordering::SeqCst);
    drop(held);
    settle().await;
    let _back = lane.acquire("acme", REST).await.expect("shared again");
    assert_eq!(lane.leases_held(), 1);
}

/// Resolves `lane.batch_capacity()` on a task and reports when it resolved: it must
/// stay pending for `held` (the lane asks the ledger no sooner), and resolve then.
async fn capacity_held_for(lane: &Lane, held: Duration) {
    let waiter = {
        let lane = lane.clone();
        tokio::spawn(async move { lane.batch_capacity().await })
    };
    settle().await;
    advance(held - Duration::from_millis(1)).await;
    settle().await;
    assert!(
        !waiter.is_finished(),
        "batch capacity looked free before the retry: a runner would ask in a loop"
    );
    advance(Duration::from_millis(1)).await;
    settle().await;
    assert!(waiter.is_finished(), "woken when it is time to ask again");
}

/// S1: a batch lease refused (other replicas fill the batch share) or not asked
/// for (the ledger is down) does not make batch capacity look free: a batch runner
/// waiting on it asks the ledger again after `lease_retry`, not in a loop.
#[tokio::test(start_paused = true)]
async fn s1_a_refused_or_unasked_batch_lease_holds_batch_capacity_until_the_retry() {
    let retry = LaneConfig::default().lease_retry;
    let (a, b, _ledger) = replicas();
    let mut items = Vec::new();
    for _ in 0..15 {
        items.push(a.acquire_batch("bulk").await.expect("a batch place"));
    }
    assert!(b.acquire_batch("bulk").await.is_none(), "the share is full");
    capacity_held_for(&b, retry).await;

    let (lane, down) = flaky(LedgerOutage::FailClosed);
    down.store(true, Ordering::SeqCst);
    assert!(lane.acquire_batch("bulk").await.is_none(), "ledger down");
    capacity_held_for(&lane, retry).await;
    down.store(false, Ordering::SeqCst);
    assert!(lane.acquire_batch("bulk").await.is_some(), "served again");
    drop(items);
}
