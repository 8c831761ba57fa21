//! L1 and L2: per-workspace limits, the global cap, fair hand-off, bounded
//! waits and honest retry-after values, on tokio's paused clock with the
//! default numbers (3 running and 12 starts a minute per workspace, 20 in
//! flight, waits of 15 s for REST and 2 min for JSON-RPC tool calls).

use crate::support;

use std::time::Duration;

use sluice_lanes::{Lane, LaneConfig, Outcome, RefusalReason};
use support::{JSONRPC, REST, lane, running, settle, spawn_wait, take, take_n, waiting};
use tokio::time::{Instant, advance};

const SEC: Duration = Duration::from_secs(1);

#[tokio::test(start_paused = true)]
async fn l1_fourth_concurrent_call_waits_15s_then_workspace_in_flight_limit() {
    let lane = lane();
    let _three = take_n(&lane, "acme", 3).await;
    let asked = Instant::now();
    let refused = lane
        .acquire("acme", REST)
        .await
        .expect_err("a 4th call must not start");
    assert_eq!(asked.elapsed(), REST, "it waited its whole 15 s in line");
    assert_eq!(refused.reason, RefusalReason::WorkspaceInFlightLimit);
    assert_eq!(refused.reason.as_str(), "workspace_in_flight_limit");
    // Nothing finished yet: the guess is 90 s a call, the calls started 15 s
    // ago, so 75 s left (also the ceiling).
    assert_eq!(refused.retry_after, 75 * SEC);
    assert_eq!(running(&lane, "acme"), 3);
    assert_eq!(waiting(&lane, "acme"), 0, "the refused call left the line");
}

#[tokio::test(start_paused = true)]
async fn l1_a_waiting_call_starts_the_moment_a_place_frees() {
    let lane = lane();
    let mut three = take_n(&lane, "acme", 3).await;
    let fourth = spawn_wait(&lane, "acme", REST);
    settle().await;
    assert_eq!(waiting(&lane, "acme"), 1);
    advance(5 * SEC).await;
    three.pop().expect("a permit").finish(Outcome::Success);
    let (got, waited) = fourth.await.expect("task");
    assert!(got.is_ok(), "the freed place went to the waiting call");
    assert_eq!(waited, 5 * SEC);
    assert_eq!(running(&lane, "acme"), 3);
}

#[tokio::test(start_paused = true)]
async fn l2_in_flight_estimate_comes_from_observed_durations() {
    let lane = lane();
    let first = take(&lane, "acme").await;
    advance(40 * SEC).await;
    first.finish(Outcome::Success); // held 40 s: the mean is 40 s
    let _three = take_n(&lane, "acme", 3).await; // started at t = 40 s
    let refused = lane.acquire("acme", REST).await.expect_err("refused");
    // At t = 55 s the earliest running call is expected to end at 80 s.
    assert_eq!(refused.retry_after, 25 * SEC);
    assert!(!refused.reason.retry_after_is_exact());
    assert_eq!(lane.snapshot().expected_duration, 40 * SEC);
}

#[tokio::test(start_paused = true)]
async fn l2_estimates_stay_within_5_and_75_seconds() {
    let lane = lane();
    let quick = take(&lane, "acme").await;
    advance(SEC).await;
    quick.finish(Outcome::Success); // mean 1 s
    let _three = take_n(&lane, "acme", 3).await;
    let refused = lane.acquire("acme", REST).await.expect_err("refused");
    assert_eq!(refused.retry_after, 5 * SEC, "overdue calls still say 5 s");
    assert_eq!(refused.retry_after_secs(), 5);
}

#[tokio::test(start_paused = true)]
async fn l1_thirteenth_start_in_60s_gets_workspace_rate_limit_with_an_exact_retry_after() {
    let lane = lane();
    for _ in 0..12 {
        take(&lane, "acme").await.finish(Outcome::Success);
        advance(SEC).await; // starts at t = 0, 1, …, 11 s
    }
    advance(8 * SEC).await; // t = 20 s
    let asked = Instant::now();
    let refused = lane.acquire("acme", REST).await.expect_err("13th start");
    assert_eq!(
        asked.elapsed(),
        Duration::ZERO,
        "its start slot is 40 s away, past its 15 s wait: refused at once"
    );
    assert_eq!(refused.reason, RefusalReason::WorkspaceRateLimit);
    assert_eq!(refused.reason.as_str(), "workspace_rate_limit");
    assert_eq!(
        refused.retry_after,
        40 * SEC,
        "the start at t = 0 leaves at 60 s"
    );
    assert!(refused.reason.retry_after_is_exact());
    assert_eq!(lane.snapshot().workspaces[0].started_in_window, 12);

    // Retrying exactly then succeeds; a retry a moment earlier would not.
    advance(40 * SEC - Duration::from_millis(1)).await;
    let early = lane
        .acquire("acme", Duration::ZERO)
        .await
        .expect_err("early");
    assert_eq!(early.retry_after, Duration::from_millis(1));
    advance(Duration::from_millis(1)).await;
    take(&lane, "acme").await.finish(Outcome::Success);
}

#[tokio::test(start_paused = true)]
async fn l1_a_rate_limited_call_within_its_wait_starts_at_its_exact_slot() {
    let lane = lane();
    for _ in 0..12 {
        take(&lane, "acme").await.finish(Outcome::Success);
        advance(SEC).await;
    }
    advance(38 * SEC).await; // t = 50 s: the first slot frees at 60 s
    let (got, waited) = spawn_wait(&lane, "acme", REST).await.expect("task");
    assert!(got.is_ok());
    assert_eq!(waited, 10 * SEC);
    // The next one (slot of the start at t = 1 s) waits exactly 1 s more.
    let (got, waited) = spawn_wait(&lane, "acme", REST).await.expect("task");
    assert!(got.is_ok());
    assert_eq!(waited, SEC);
}

#[tokio::test(start_paused = true)]
async fn l1_full_global_cap_gives_busy() {
    let lane = lane();
    let mut held = Vec::new();
    for w in 0..6 {
        held.extend(take_n(&lane, &format!("w{w}"), 3).await);
    }
    held.extend(take_n(&lane, "w6", 2).await);
    assert_eq!(lane.snapshot().running, 20);
    let asked = Instant::now();
    let refused = lane.acquire("fresh", REST).await.expect_err("busy");
    assert_eq!(asked.elapsed(), REST);
    assert_eq!(refused.reason, RefusalReason::Busy);
    assert_eq!(refused.reason.as_str(), "busy");
    assert_eq!(refused.retry_after, 75 * SEC);
}

#[tokio::test(start_paused = true)]
async fn l1_a_freed_global_place_goes_to_the_workspace_with_the_fewest_running() {
    let lane = lane();
    let mut held = Vec::new();
    for w in 0..6 {
        held.push(take_n(&lane, &format!("w{w}"), 3).await);
    }
    let _g = take_n(&lane, "g", 2).await;
    // g (2 running) waits first, h (0 running) waits twice afterwards.
    let g3 = spawn_wait(&lane, "g", REST);
    settle().await;
    advance(SEC).await;
    let h1 = spawn_wait(&lane, "h", REST);
    let h2 = spawn_wait(&lane, "h", REST);
    settle().await;
    assert_eq!(lane.snapshot().waiting, 3);

    drop(held[0].pop());
    settle().await;
    assert!(
        h1.is_finished(),
        "h runs none: it goes before g, which waited longer"
    );
    assert!(!g3.is_finished());
    drop(held[1].pop());
    settle().await;
    assert!(h2.is_finished(), "h runs 1, g runs 2: h again");
    assert!(!g3.is_finished());
    drop(held[2].pop());
    settle().await;
    assert!(g3.is_finished());
    assert_eq!((running(&lane, "g"), running(&lane, "h")), (3, 2));
    for h in [h1, h2, g3] {
        assert!(h.await.expect("task").0.is_ok());
    }
}

#[tokio::test(start_paused = true)]
async fn l1_between_equals_the_longest_waiting_workspace_goes_first() {
    let lane = lane();
    let mut held = Vec::new();
    for w in 0..5 {
        held.push(take_n(&lane, &format!("w{w}"), 3).await);
    }
    held.push(take_n(&lane, "w5", 3).await);
    held.push(take_n(&lane, "w6", 2).await);
    let j = spawn_wait(&lane, "j", REST);
    settle().await;
    advance(SEC).await;
    let i = spawn_wait(&lane, "i", REST);
    settle().await;
    drop(held[0].pop());
    settle().await;
    assert!(j.is_finished() && !i.is_finished(), "j waited longer");
    drop(held[1].pop());
    settle().await;
    assert!(i.is_finished());
}

#[tokio::test(start_paused = true)]
async fn l1_a_dropped_waiter_leaves_the_line_at_once() {
    let lane = lane();
    let mut three = take_n(&lane, "acme", 3).await;
    let fourth = spawn_wait(&lane, "acme", REST);
    settle().await;
    assert_eq!(waiting(&lane, "acme"), 1);
    fourth.abort();
    settle().await;
    assert_eq!(
        waiting(&lane, "acme"),
        0,
        "gone without waiting for its deadline"
    );
    assert_eq!(lane.snapshot().waiting, 0);
    three.pop().expect("permit").finish(Outcome::Success);
    assert_eq!(
        running(&lane, "acme"),
        2,
        "no place was handed to the gone call"
    );
    let (got, waited) = spawn_wait(&lane, "acme", REST).await.expect("task");
    assert!(got.is_ok() && waited == Duration::ZERO);
}

#[tokio::test(start_paused = true)]
async fn l1_a_waiter_dropped_after_its_place_was_handed_over_gives_it_back() {
    let lane = lane();
    let mut three = take_n(&lane, "acme", 3).await;
    let fourth = spawn_wait(&lane, "acme", REST);
    let fifth = spawn_wait(&lane, "acme", REST);
    settle().await;
    // The place goes to the 4th under the lock; it is cancelled before it
    // ever runs again, so the place must move on to the 5th.
    three.pop().expect("permit").finish(Outcome::Success);
    fourth.abort();
    settle().await;
    assert!(fourth.await.expect_err("aborted").is_cancelled());
    let (got, _) = fifth.await.expect("task");
    assert!(
        got.is_ok(),
        "the handed-over place moved on to the next waiter"
    );
    assert_eq!(running(&lane, "acme"), 3);
    assert_eq!(lane.snapshot().running, 3);
}

#[tokio::test(start_paused = true)]
async fn l1_a_place_is_released_exactly_once_by_finish_drop_or_panic() {
    let lane = lane();
    take(&lane, "acme").await.finish(Outcome::Success);
    assert_eq!(lane.snapshot().running, 0);
    take(&lane, "acme").await.finish(Outcome::Failure);
    assert_eq!(lane.snapshot().running, 0);
    drop(take(&lane, "acme").await);
    assert_eq!(lane.snapshot().running, 0);
    let panicking = lane.clone();
    let task = tokio::spawn(async move {
        let _permit = panicking.acquire("acme", REST).await.expect("a free place");
        panic!("the handler panics while holding the place");
    });
    assert!(task.await.expect_err("panicked").is_panic());
    assert_eq!(lane.snapshot().running, 0);
    assert_eq!(running(&lane, "acme"), 0);
    // Three more fit again: nothing was leaked, nothing doubled.
    let three = take_n(&lane, "acme", 3).await;
    assert_eq!(running(&lane, "acme"), 3);
    drop(three);
    assert_eq!(lane.snapshot().running, 0);
}

#[tokio::test(start_paused = true)]
async fn l2_a_jsonrpc_tool_call_waits_up_to_2_minutes() {
    let lane = lane();
    let mut three = take_n(&lane, "acme", 3).await;
    let call = spawn_wait(&lane, "acme", JSONRPC);
    settle().await;
    advance(100 * SEC).await;
    assert!(!call.is_finished(), "still in line after 100 s");
    three.pop().expect("permit").finish(Outcome::Success);
    let (got, waited) = call.await.expect("task");
    assert!(got.is_ok());
    assert_eq!(waited, 100 * SEC);

    let (got, waited) = spawn_wait(&lane, "acme", JSONRPC).await.expect("task");
    assert_eq!(
        waited, JSONRPC,
        "a call nobody makes room for waits the full 2 min"
    );
    assert_eq!(
        got.expect_err("refused").reason,
        RefusalReason::WorkspaceInFlightLimit
    );
}

#[tokio::test(start_paused = true)]
async fn l2_the_line_is_bounded_and_refuses_at_once_past_it() {
    let lane =
        Lane::new("optimizer", LaneConfig::default().with_max_waiting(2, 1)).expect("config");
    let _a = take_n(&lane, "a", 3).await;
    let _b = take_n(&lane, "b", 3).await;
    let _c = take_n(&lane, "c", 3).await;
    let a4 = spawn_wait(&lane, "a", REST);
    settle().await;
    let asked = Instant::now();
    let refused = lane
        .acquire("a", REST)
        .await
        .expect_err("a's share is full");
    assert_eq!(asked.elapsed(), Duration::ZERO);
    assert_eq!(refused.reason, RefusalReason::WorkspaceInFlightLimit);
    let b4 = spawn_wait(&lane, "b", REST);
    settle().await;
    let refused = lane.acquire("c", REST).await.expect_err("the line is full");
    assert_eq!(asked.elapsed(), Duration::ZERO);
    assert_eq!(refused.reason, RefusalReason::WorkspaceInFlightLimit);
    assert_eq!(lane.snapshot().waiting, 2);
    a4.abort();
    b4.abort();
}

#[tokio::test(start_paused = true)]
async fn l2_a_zero_wait_is_a_try_that_refuses_at_once() {
    let lane = lane();
    let _three = take_n(&lane, "acme", 3).await;
    let refused = lane
        .acquire("acme", Duration::ZERO)
        .await
        .expect_err("no room");
    assert_eq!(refused.reason, RefusalReason::WorkspaceInFlightLimit);
    assert_eq!(lane.snapshot().waiting, 0);
}

#[tokio::test(start_paused = true)]
async fn l1_a_newcomer_does_not_overtake_its_workspace_line() {
    let lane = lane();
    let mut three = take_n(&lane, "acme", 3).await;
    let first = spawn_wait(&lane, "acme", REST);
    settle().await;
    let second = spawn_wait(&lane, "acme", REST);
    settle().await;
    three.pop().expect("permit").finish(Outcome::Success);
    settle().await;
    assert!(first.is_finished() && !second.is_finished());
    second.abort();
}

#[tokio::test(start_paused = true)]
async fn l1_the_snapshot_shows_running_waiting_starts_batch_and_breaker() {
    let lane = lane();
    let three = take_n(&lane, "acme", 3).await;
    let item = lane.try_acquire_batch("acme").expect("a batch place");
    let fourth = spawn_wait(&lane, "acme", REST);
    settle().await;
    drop(three);
    let _beta = take(&lane, "beta").await;
    settle().await;
    let snap = lane.snapshot();
    assert_eq!(snap.lane, "optimizer");
    assert_eq!((snap.global_cap, snap.batch_cap), (20, 15));
    assert_eq!((snap.running, snap.waiting, snap.batch_running), (3, 0, 1));
    assert_eq!(snap.breaker, sluice_lanes::BreakerStatus::Closed);
    assert_eq!(snap.breaker.as_str(), "closed");
    let acme = &snap.workspaces[0];
    assert_eq!(acme.workspace, "acme");
    assert_eq!(
        (
            acme.running,
            acme.waiting,
            acme.started_in_window,
            acme.batch_running
        ),
        (1, 0, 4, 1),
        "the 4th started when the first three went; batch items are not starts"
    );
    assert_eq!(snap.workspaces[1].workspace, "beta");
    drop(item);
    drop(fourth.await.expect("task").0.expect("started"));
    advance(60 * SEC).await;
    assert!(
        lane.snapshot()
            .workspaces
            .iter()
            .all(|w| w.workspace == "beta"),
        "idle workspaces leave the snapshot once their starts leave the window"
    );
}

#[tokio::test(start_paused = true)]
async fn l1_a_cancelled_call_gives_back_its_place_and_its_start() {
    let lane = lane();
    // Twelve starts, each refused by another limit after it got its place: none
    // of them was a call, so none counts toward the 12 a minute.
    for _ in 0..12 {
        take(&lane, "acme").await.cancel();
    }
    assert_eq!(running(&lane, "acme"), 0);
    assert_eq!(
        lane.snapshot()
            .workspaces
            .iter()
            .map(|w| w.started_in_window)
            .sum::<u32>(),
        0
    );
    // Twelve real starts still fit.
    for _ in 0..12 {
        take(&lane, "acme").await.finish(Outcome::Success);
    }
    let refused = lane
        .acquire("acme", Duration::ZERO)
        .await
        .expect_err("the 13th real start");
    assert_eq!(refused.reason, RefusalReason::WorkspaceRateLimit);
}
