//! L3: the lane's circuit breaker — 5 failures in a row within a minute stop
//! all calls for 30 s, refused at once with the time left; then one probe
//! decides.

use crate::support;

use std::time::Duration;

use sluice_lanes::{BreakerStatus, Outcome, RefusalReason};
use support::{REST, lane, settle, spawn_wait, take, take_n};
use tokio::time::{Instant, advance};

const SEC: Duration = Duration::from_secs(1);

async fn trip(lane: &sluice_lanes::Lane) {
    for _ in 0..5 {
        take(lane, "acme").await.finish(Outcome::Failure);
    }
}

#[tokio::test(start_paused = true)]
async fn l3_five_failures_in_a_row_refuse_every_call_at_once_with_the_time_left() {
    let lane = lane();
    trip(&lane).await;
    let asked = Instant::now();
    let refused = lane.acquire("other", REST).await.expect_err("open");
    assert_eq!(
        asked.elapsed(),
        Duration::ZERO,
        "refused at once, not after 15 s"
    );
    assert_eq!(refused.reason, RefusalReason::Unavailable);
    assert_eq!(refused.reason.as_str(), "unavailable");
    assert_eq!(refused.retry_after, 30 * SEC);
    advance(12 * SEC).await;
    let refused = lane.acquire("acme", REST).await.expect_err("open");
    assert_eq!(
        refused.retry_after,
        18 * SEC,
        "retry-after is the time left"
    );
    assert_eq!(
        lane.snapshot().breaker,
        BreakerStatus::Open {
            retry_after: 18 * SEC
        }
    );
}

#[tokio::test(start_paused = true)]
async fn l3_four_failures_or_a_success_between_do_not_trip_it() {
    let lane = lane();
    for _ in 0..4 {
        take(&lane, "acme").await.finish(Outcome::Failure);
    }
    take(&lane, "acme").await.finish(Outcome::Success);
    take(&lane, "acme").await.finish(Outcome::Failure);
    assert_eq!(lane.snapshot().breaker, BreakerStatus::Closed);
    // A dropped call (client gone) is neither a success nor a failure.
    for _ in 0..3 {
        take(&lane, "acme").await.finish(Outcome::Failure);
    }
    drop(take(&lane, "acme").await);
    take(&lane, "acme").await.finish(Outcome::Failure);
    assert!(matches!(
        lane.snapshot().breaker,
        BreakerStatus::Open { .. }
    ));
}

#[tokio::test(start_paused = true)]
async fn l3_after_30s_exactly_one_probe_goes_and_its_success_closes_it() {
    let lane = lane();
    trip(&lane).await;
    advance(30 * SEC).await;
    assert_eq!(
        lane.snapshot().breaker,
        BreakerStatus::HalfOpen { probe_out: false }
    );
    let probe = take(&lane, "acme").await;
    assert!(probe.is_probe());
    assert_eq!(
        lane.snapshot().breaker,
        BreakerStatus::HalfOpen { probe_out: true }
    );
    let asked = Instant::now();
    let refused = lane
        .acquire("other", REST)
        .await
        .expect_err("one probe only");
    assert_eq!(asked.elapsed(), Duration::ZERO);
    assert_eq!(refused.reason, RefusalReason::Unavailable);
    advance(20 * SEC).await;
    probe.finish(Outcome::Success);
    assert_eq!(lane.snapshot().breaker, BreakerStatus::Closed);
    let calls = take_n(&lane, "other", 3).await;
    assert!(calls.iter().all(|p| !p.is_probe()));
}

#[tokio::test(start_paused = true)]
async fn l3_a_failed_probe_reopens_it_for_another_30s() {
    let lane = lane();
    trip(&lane).await;
    advance(30 * SEC).await;
    let probe = take(&lane, "acme").await;
    assert!(probe.is_probe());
    advance(5 * SEC).await;
    probe.finish(Outcome::Failure);
    let refused = lane.acquire("acme", REST).await.expect_err("re-opened");
    assert_eq!(refused.reason, RefusalReason::Unavailable);
    assert_eq!(refused.retry_after, 30 * SEC);
    advance(30 * SEC).await;
    let probe = take(&lane, "acme").await;
    assert!(probe.is_probe(), "a new probe after the new open time");
    probe.finish(Outcome::Success);
    assert_eq!(lane.snapshot().breaker, BreakerStatus::Closed);
}

#[tokio::test(start_paused = true)]
async fn l3_a_dropped_probe_lets_the_next_call_probe_at_once() {
    let lane = lane();
    trip(&lane).await;
    advance(30 * SEC).await;
    drop(take(&lane, "acme").await);
    let probe = take(&lane, "acme").await;
    assert!(probe.is_probe(), "the cancelled probe proved nothing");
    probe.finish(Outcome::Success);
}

#[tokio::test(start_paused = true)]
async fn l3_calls_waiting_in_line_are_refused_when_it_opens() {
    let lane = lane();
    let _acme = take_n(&lane, "acme", 3).await;
    let mut five = take_n(&lane, "beta", 3).await;
    five.extend(take_n(&lane, "gamma", 2).await);
    let waiter = spawn_wait(&lane, "acme", REST);
    settle().await;
    advance(2 * SEC).await;
    for p in five {
        p.finish(Outcome::Failure);
    }
    let (got, waited) = waiter.await.expect("task");
    let refused = got.expect_err("nothing is sent while open");
    assert_eq!(waited, 2 * SEC, "told at once, not at the end of its wait");
    assert_eq!(refused.reason, RefusalReason::Unavailable);
    assert_eq!(refused.retry_after, 30 * SEC);
    assert_eq!(lane.snapshot().waiting, 0);
}

#[tokio::test(start_paused = true)]
async fn l3_late_answers_of_calls_sent_before_it_opened_do_not_decide() {
    let lane = lane();
    let late_ok = take(&lane, "beta").await;
    let late_fail = take(&lane, "beta").await;
    trip(&lane).await;
    advance(10 * SEC).await;
    late_ok.finish(Outcome::Success);
    late_fail.finish(Outcome::Failure);
    assert_eq!(
        lane.snapshot().breaker,
        BreakerStatus::Open {
            retry_after: 20 * SEC
        },
        "neither closes it nor extends it: only the probe decides"
    );
}
