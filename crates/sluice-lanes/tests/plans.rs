//! P3: a workspace with per-workspace limits of its own (as a plan gives it)
//! is held to those, in one process and across replicas on one ledger, while
//! every other workspace keeps the lane's; on tokio's paused clock.

use crate::support;

use std::num::NonZeroU32;
use std::time::Duration;

use sluice_lanes::{
    Lane, LaneConfig, LanePermit, LedgerOutage, MemoryLedger, Outcome, RefusalReason,
    WorkspaceLimits,
};
use support::{REST, lane, take_n};
use tokio::time::{Instant, advance};

const SEC: Duration = Duration::from_secs(1);

fn limits(in_flight: u32, starts: u32) -> WorkspaceLimits {
    let n = |n: u32| NonZeroU32::new(n).expect("above zero");
    WorkspaceLimits::new(n(in_flight), n(starts))
}

/// Takes `n` places of `workspace` within `own`, each free at once.
async fn take_within(
    lane: &Lane,
    workspace: &str,
    own: WorkspaceLimits,
    n: usize,
) -> Vec<LanePermit> {
    let mut held = Vec::new();
    for i in 0..n {
        let asked = Instant::now();
        let permit = lane
            .acquire_within(workspace, own, REST)
            .await
            .unwrap_or_else(|r| panic!("{workspace} call {i}: {r}"));
        assert_eq!(
            asked.elapsed(),
            Duration::ZERO,
            "{workspace} call {i} waited"
        );
        held.push(permit);
    }
    held
}

#[tokio::test(start_paused = true)]
async fn p3_a_workspace_on_a_larger_plan_runs_more_at_once_and_starts_more() {
    let lane = lane();
    let pro = limits(6, 20);
    // The lane's 3 hold the default workspace; the plan's 6 hold the pro one.
    let acme = take_n(&lane, "acme", 3).await;
    let refused = lane
        .acquire("acme", Duration::ZERO)
        .await
        .expect_err("the lane's limit");
    assert_eq!(refused.reason, RefusalReason::WorkspaceInFlightLimit);
    let mut globex = take_within(&lane, "globex", pro, 6).await;
    let asked = Instant::now();
    let refused = lane
        .acquire_within("globex", pro, REST)
        .await
        .expect_err("a 7th");
    assert_eq!(asked.elapsed(), REST, "it waited its whole wait");
    assert_eq!(refused.reason, RefusalReason::WorkspaceInFlightLimit);
    for p in acme.into_iter().chain(globex.drain(..)) {
        p.finish(Outcome::Success);
    }
    // Its start limit: 20 in the window (6 spent), then an exact retry-after.
    for _ in 0..14 {
        lane.acquire_within("globex", pro, REST)
            .await
            .expect("a start of its 20")
            .finish(Outcome::Success);
    }
    let refused = lane
        .acquire_within("globex", pro, REST)
        .await
        .expect_err("a 21st start");
    assert_eq!(refused.reason, RefusalReason::WorkspaceRateLimit);
    assert_eq!(
        refused.retry_after,
        60 * SEC - REST,
        "the first start leaves at 60 s"
    );
}

#[tokio::test(start_paused = true)]
async fn p3_a_workspace_on_a_smaller_plan_is_held_below_the_lanes_limits() {
    let lane = lane();
    let trial = limits(1, 2);
    let first = take_within(&lane, "trial", trial, 1).await;
    // A second call waits for the first, then starts the moment it finishes.
    let waiter = {
        let lane = lane.clone();
        tokio::spawn(async move { lane.acquire_within("trial", trial, REST).await })
    };
    advance(2 * SEC).await;
    assert_eq!(lane.snapshot().waiting, 1, "held by its own limit of 1");
    first.into_iter().for_each(|p| p.finish(Outcome::Success));
    let second = waiter
        .await
        .expect("task")
        .expect("started when the first finished");
    second.finish(Outcome::Success);
    // Its 2 starts are spent: a third is refused with the exact slot.
    let refused = lane
        .acquire_within("trial", trial, Duration::ZERO)
        .await
        .expect_err("a 3rd start");
    assert_eq!(refused.reason, RefusalReason::WorkspaceRateLimit);
    assert_eq!(refused.retry_after, 58 * SEC);
    // The lane's own limits for everyone else.
    take_n(&lane, "acme", 3).await;
}

#[tokio::test(start_paused = true)]
async fn p3_a_plans_limits_hold_across_two_replicas_on_one_ledger() {
    let config = LaneConfig::default();
    let ledger = MemoryLedger::new(config.clone(), 10 * SEC);
    let replica = || {
        Lane::with_ledger(
            "optimizer",
            config.clone(),
            ledger.clone(),
            LedgerOutage::FailClosed,
        )
        .expect("config")
    };
    let (a, b) = (replica(), replica());
    let pro = limits(5, 12);
    let mut held = take_within(&a, "globex", pro, 3).await;
    held.extend(take_within(&b, "globex", pro, 2).await);
    // Each replica counts fewer than 5 itself: the ledger holds the sixth.
    let refused = b
        .acquire_within("globex", pro, Duration::from_secs(1))
        .await
        .expect_err("a 6th across replicas");
    assert_eq!(refused.reason, RefusalReason::WorkspaceInFlightLimit);
    let c = sluice_lanes::Ledger::counts(&ledger, "globex")
        .await
        .expect("memory ledger");
    assert_eq!((c.workspace_running, c.workspace_starts), (5, 5));
    // A workspace on no plan still gets the lane's 3 across replicas.
    let mut acme = take_n(&a, "acme", 2).await;
    acme.extend(take_n(&b, "acme", 1).await);
    let refused = a
        .acquire("acme", Duration::from_secs(1))
        .await
        .expect_err("a 4th across replicas");
    assert_eq!(refused.reason, RefusalReason::WorkspaceInFlightLimit);
    for p in held.into_iter().chain(acme) {
        p.finish(Outcome::Success);
    }
}

#[tokio::test(start_paused = true)]
async fn p3_a_raised_limit_starts_the_calls_already_waiting() {
    let lane = lane();
    let held = take_n(&lane, "acme", 3).await;
    let waiting = {
        let lane = lane.clone();
        tokio::spawn(async move { lane.acquire("acme", REST).await })
    };
    advance(SEC).await;
    assert_eq!(lane.snapshot().waiting, 1, "held by the lane's 3");
    // acme moves to a plan of 5: its next call brings the new limits, and the one
    // waiting starts at once, before it.
    let next = lane
        .acquire_within("acme", limits(5, 12), Duration::ZERO)
        .await
        .expect("room under the new limit");
    let first = waiting
        .await
        .expect("task")
        .expect("started when the limit rose");
    assert_eq!(lane.snapshot().running, 5);
    for p in held.into_iter().chain([first, next]) {
        p.finish(Outcome::Success);
    }
}
