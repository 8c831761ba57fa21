//! L4's capacity rules: batch items run only on capacity single calls are not
//! using, never beyond the global cap minus the reserve, count toward the
//! global cap only, take turns by fewest running, and wait out an open
//! breaker.

use crate::support;

use std::time::Duration;

use sluice_lanes::{BatchPermit, Lane, Outcome, RefusalReason};
use support::{REST, lane, running, settle, spawn_wait, take, take_n};
use tokio::time::advance;

const SEC: Duration = Duration::from_secs(1);

fn batch_items(lane: &Lane, workspace: &str, n: usize) -> Vec<BatchPermit> {
    (0..n)
        .map(|i| {
            lane.try_acquire_batch(workspace)
                .unwrap_or_else(|| panic!("batch item {i} of {workspace} found no place"))
        })
        .collect()
}

#[tokio::test(start_paused = true)]
async fn l4_batch_items_never_exceed_the_global_cap_minus_the_reserve() {
    let lane = lane();
    let mut items = batch_items(&lane, "acme", 10);
    items.extend(batch_items(&lane, "beta", 5));
    assert!(
        lane.try_acquire_batch("gamma").is_none(),
        "15 = 20 - 5 at most"
    );
    assert_eq!(lane.snapshot().batch_running, 15);
    // The reserve is there for single calls: five start at once.
    let singles: Vec<_> = [
        take(&lane, "a").await,
        take(&lane, "b").await,
        take(&lane, "c").await,
        take(&lane, "d").await,
        take(&lane, "e").await,
    ]
    .into();
    assert_eq!(lane.snapshot().running, 20);
    drop(singles);
    assert!(
        lane.try_acquire_batch("gamma").is_none(),
        "free places, but the batch share is still full"
    );
    items.pop().expect("item").finish(Outcome::Success);
    assert!(lane.try_acquire_batch("gamma").is_some());
}

#[tokio::test(start_paused = true)]
async fn l4_batch_items_count_only_toward_the_global_cap() {
    let lane = lane();
    let _three = take_n(&lane, "acme", 3).await;
    let items = batch_items(&lane, "acme", 15);
    let ws = &lane.snapshot().workspaces[0];
    assert_eq!(
        (ws.running, ws.started_in_window, ws.batch_running),
        (3, 3, 15)
    );
    drop(items);
    // 15 items did not spend acme's 12 starts or its 3 in flight.
    let _more = batch_items(&lane, "acme", 15);
    drop(_three);
    let _again = take_n(&lane, "acme", 3).await;
}

#[tokio::test(start_paused = true)]
async fn l4_no_batch_item_starts_while_a_single_call_waits_for_a_place() {
    let lane = lane();
    let mut items = batch_items(&lane, "bulk", 15);
    let _singles = (take_n(&lane, "w0", 3).await, take_n(&lane, "w1", 2).await);
    let single = spawn_wait(&lane, "fresh", REST);
    settle().await;
    assert_eq!(lane.snapshot().waiting, 1);
    items.pop().expect("item").finish(Outcome::Success);
    assert_eq!(
        running(&lane, "fresh"),
        1,
        "the freed place went to the single call"
    );
    assert!(lane.try_acquire_batch("bulk").is_none());
    assert!(single.await.expect("task").0.is_ok());
}

#[tokio::test(start_paused = true)]
async fn l4_a_single_call_held_by_its_own_workspace_limit_does_not_stall_batches() {
    let lane = lane();
    let _three = take_n(&lane, "acme", 3).await;
    let fourth = spawn_wait(&lane, "acme", REST);
    settle().await;
    // acme's 4th waits for acme's own place, which no batch item takes.
    assert!(lane.try_acquire_batch("bulk").is_some());
    fourth.abort();
}

#[tokio::test(start_paused = true)]
async fn l4_workspaces_take_turns_by_fewest_batch_items_running() {
    let lane = lane();
    let _a = batch_items(&lane, "a", 2);
    let _b = batch_items(&lane, "b", 1);
    assert_eq!(lane.next_batch_workspace(&["a", "b"]), Some("b"));
    assert_eq!(
        lane.next_batch_workspace(&["a", "b", "c"]),
        Some("c"),
        "none running goes first"
    );
    let mut order = Vec::new();
    let mut held = Vec::new();
    for _ in 0..6 {
        let (i, item) = lane
            .try_acquire_next_batch(&["a", "b", "c"])
            .expect("a place");
        order.push(["a", "b", "c"][i]);
        held.push(item);
    }
    // c (0) → b and c tie at 1, b listed first → c … until all are even.
    assert_eq!(order, ["c", "b", "c", "a", "b", "c"]);
    assert_eq!(lane.next_batch_workspace(&[]), None);
}

#[tokio::test(start_paused = true)]
async fn l4_l3_no_batch_item_starts_while_the_breaker_is_open_and_single_calls_probe_first() {
    let lane = lane();
    for _ in 0..5 {
        take(&lane, "acme").await.finish(Outcome::Failure);
    }
    assert!(lane.try_acquire_batch("bulk").is_none());
    let waiter = {
        let lane = lane.clone();
        tokio::spawn(async move { lane.batch_capacity().await })
    };
    settle().await;
    advance(30 * SEC).await;
    settle().await;
    // The open time is up: the probe is for a single call first, for as long
    // again.
    assert!(!waiter.is_finished());
    assert!(
        lane.try_acquire_batch("bulk").is_none(),
        "single calls first"
    );
    advance(29 * SEC).await;
    settle().await;
    assert!(!waiter.is_finished());
    advance(SEC).await;
    settle().await;
    assert!(
        waiter.is_finished(),
        "woken when no single call took the probe"
    );
    // With no single call around, a batch item may be the one probe.
    let probe = lane.try_acquire_batch("bulk").expect("the probe");
    assert!(probe.is_probe());
    assert!(lane.try_acquire_batch("bulk").is_none(), "one probe only");
    let refused = lane.acquire("acme", REST).await.expect_err("probe out");
    assert_eq!(refused.reason, RefusalReason::Unavailable);
    probe.finish(Outcome::Success);
    assert!(lane.try_acquire_batch("bulk").is_some());
}

#[tokio::test(start_paused = true)]
async fn l4_l3_a_single_call_is_the_probe_as_soon_as_the_open_time_is_up() {
    let lane = lane();
    for _ in 0..5 {
        take(&lane, "acme").await.finish(Outcome::Failure);
    }
    advance(30 * SEC).await;
    assert!(lane.try_acquire_batch("bulk").is_none());
    let probe = lane.acquire("globex", REST).await.expect("the probe");
    assert!(probe.is_probe());
    probe.finish(Outcome::Success);
    assert!(lane.try_acquire_batch("bulk").is_some(), "closed again");
}

#[tokio::test(start_paused = true)]
async fn l4_l3_batch_item_failures_never_open_the_breaker_for_other_workspaces() {
    let lane = lane();
    // One workspace's poison items fail, far more than 5 in a row.
    for _ in 0..50 {
        lane.try_acquire_batch("poison")
            .expect("a place")
            .finish(Outcome::Failure);
    }
    let call = lane.acquire("globex", REST).await.expect("still served");
    assert!(!call.is_probe());
    call.finish(Outcome::Success);
    // Single calls' own failures still open it.
    for _ in 0..5 {
        take(&lane, "acme").await.finish(Outcome::Failure);
    }
    let refused = lane.acquire("globex", REST).await.expect_err("open");
    assert_eq!(refused.reason, RefusalReason::Unavailable);
}

#[tokio::test(start_paused = true)]
async fn l4_l3_a_failed_batch_probe_hands_the_probe_back_to_single_calls() {
    let lane = lane();
    for _ in 0..5 {
        take(&lane, "acme").await.finish(Outcome::Failure);
    }
    advance(60 * SEC).await;
    let probe = lane.try_acquire_batch("poison").expect("the probe");
    assert!(probe.is_probe());
    probe.finish(Outcome::Failure);
    // Not open for another 30 s: the next single call probes at once.
    let call = lane.acquire("globex", REST).await.expect("the probe");
    assert!(call.is_probe());
    call.finish(Outcome::Success);
    assert!(lane.try_acquire_batch("poison").is_some());
}

#[tokio::test(start_paused = true)]
async fn l4_batch_capacity_wakes_the_runner_when_an_item_finishes() {
    let lane = lane();
    let mut items = batch_items(&lane, "bulk", 15);
    let runner = {
        let lane = lane.clone();
        tokio::spawn(async move {
            lane.batch_capacity().await;
            lane.try_acquire_batch("bulk")
        })
    };
    settle().await;
    assert!(!runner.is_finished());
    items.pop().expect("item").finish(Outcome::Success);
    let item = runner.await.expect("task");
    assert!(item.is_some(), "the runner took the freed batch place");
    assert_eq!(lane.snapshot().batch_running, 15);
}

/// What the batch lane's outage watch reads: how many calls, single or batch,
/// the upstream answered (a failure, or a place given back without an
/// outcome, is no answer), and where the breaker stands without a snapshot.
#[tokio::test(start_paused = true)]
async fn l4_l3_the_lane_counts_the_calls_the_upstream_answered() {
    let lane = lane();
    assert_eq!(lane.successes(), 0);
    take(&lane, "acme").await.finish(Outcome::Success);
    batch_items(&lane, "beta", 1)
        .pop()
        .expect("item")
        .finish(Outcome::Success);
    assert_eq!(lane.successes(), 2, "a single call's answer and an item's");
    take(&lane, "acme").await.finish(Outcome::Failure);
    drop(batch_items(&lane, "beta", 1));
    assert_eq!(lane.successes(), 2, "a failure and a drop are no answers");
    assert_eq!(lane.breaker(), lane.snapshot().breaker);
    assert_eq!(lane.breaker().as_str(), "closed");
}
