//! Lanes built on a ledger shared by replicas, given to the limiter with
//! `Limiter::with_lanes` (L1 across replicas, D3 for lanes), on tokio's paused
//! clock: two limiters on one `MemoryLedger` stand for two replicas.

use crate::edit;
use edit::Edit as _;

use std::net::{IpAddr, Ipv4Addr};
use std::path::Path;
use std::time::Duration;

use http::{HeaderMap, HeaderValue, Method, StatusCode};
use http_body_util::BodyExt as _;
use sluice_edge::{Forward, Limiter, lane_config, ledger_outage};
use sluice_lanes::{
    Lane, Lease, LeaseKind, Ledger, LedgerCounts, LedgerError, LedgerOutage, MemoryLedger, Taken,
};
use sluice_policy::{DEFAULT_POLICY_YAML, Policy, parse_str};
use sluice_store::{MemoryConfig, MemoryStore};
use tokio::time::Instant;

fn policy(yaml: &str) -> Policy {
    parse_str(yaml, Path::new("shared.yaml")).expect("policy")
}

/// A limiter on `policy` whose optimizer lane shares `ledger`.
fn replica(policy: &Policy, ledger: impl Ledger + 'static) -> Limiter<MemoryStore> {
    let rule = &policy.lanes[0];
    let lane = Lane::with_ledger(
        rule.name.as_str(),
        lane_config(rule),
        ledger,
        ledger_outage(policy, 0),
    )
    .expect("lane");
    Limiter::new(policy.clone(), MemoryStore::new(MemoryConfig::default())).with_lanes(vec![lane])
}

async fn optimize<'l>(
    limiter: &'l Limiter<MemoryStore>,
    key: &str,
) -> Result<Forward<'l, MemoryStore>, http::Response<http_body_util::Full<bytes::Bytes>>> {
    let mut headers = HeaderMap::new();
    headers.insert("x-api-key", HeaderValue::from_str(key).expect("key"));
    let route = limiter
        .route_for(&Method::POST, "/messages/optimize")
        .expect("route");
    let intake = limiter.intake(Ok(route), IpAddr::V4(Ipv4Addr::LOCALHOST));
    intake.planned(&headers, None, None).admit(None).await
}

async fn json(r: http::Response<http_body_util::Full<bytes::Bytes>>) -> serde_json::Value {
    let body = r.into_body().collect().await.expect("body").to_bytes();
    serde_json::from_slice(&body).expect("JSON")
}

#[tokio::test(start_paused = true)]
async fn l1_two_limiters_on_one_ledger_run_three_calls_of_a_workspace_in_all() {
    let policy = policy(DEFAULT_POLICY_YAML);
    let ledger = MemoryLedger::new(lane_config(&policy.lanes[0]), Duration::from_secs(10));
    let (a, b) = (
        replica(&policy, ledger.clone()),
        replica(&policy, ledger.clone()),
    );
    let mut running = Vec::new();
    for limiter in [&a, &b, &a] {
        running.push(optimize(limiter, "sk-acme").await.expect("admitted"));
    }
    let asked = Instant::now();
    let refused = optimize(&b, "sk-acme")
        .await
        .err()
        .expect("a 4th across both");
    assert_eq!(asked.elapsed(), Duration::from_secs(15), "the REST wait");
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    let body = json(refused).await;
    assert_eq!(
        body["error"]["details"]["reason"],
        "workspace_in_flight_limit"
    );
    // The place goes back when the call ends, on every replica.
    if let Some(mut forward) = running.pop() {
        forward.finish(Some(200));
    }
    optimize(&b, "sk-acme")
        .await
        .expect("the freed place, seen from the other replica");
}

/// A ledger that never answers.
struct Down;

impl Ledger for Down {
    async fn take(
        &self,
        _: &str,
        _: sluice_lanes::WorkspaceLimits,
        _: LeaseKind,
    ) -> Result<Taken, LedgerError> {
        Err(LedgerError::Unavailable("connection refused".into()))
    }
    async fn renew(&self, _: &Lease) -> Result<bool, LedgerError> {
        Err(LedgerError::Unavailable("connection refused".into()))
    }
    async fn release(&self, _: &Lease) -> Result<(), LedgerError> {
        Err(LedgerError::Unavailable("connection refused".into()))
    }
    async fn counts(&self, _: &str) -> Result<LedgerCounts, LedgerError> {
        Err(LedgerError::Unavailable("connection refused".into()))
    }
    fn ttl(&self) -> Duration {
        Duration::from_secs(10)
    }
}

#[tokio::test(start_paused = true)]
async fn d3_a_lane_whose_ledger_is_down_answers_as_a_store_that_cannot_decide() {
    let policy = policy(DEFAULT_POLICY_YAML);
    // The optimizer's calls count toward the capped `messages` quota, which no
    // replica may decide alone: the lane fails closed.
    assert_eq!(ledger_outage(&policy, 0), LedgerOutage::FailClosed);
    let limiter = replica(&policy, Down);
    let asked = Instant::now();
    let refused = optimize(&limiter, "sk-acme")
        .await
        .err()
        .expect("ledger down");
    assert_eq!(asked.elapsed(), Duration::ZERO, "answered at once");
    assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        refused
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok()),
        Some("1")
    );
    let body = json(refused).await;
    assert_eq!(body["error"]["code"], "limiter_unavailable");
    assert_eq!(limiter.lanes()[0].snapshot().running, 0);
}

#[test]
fn d3_a_lane_fails_open_only_where_every_call_through_it_would() {
    let uncapped = DEFAULT_POLICY_YAML
        .edit("messages: { monthly: 1000 }", "messages: {}")
        .edit("replicas: 1", "replicas: 3");
    match ledger_outage(&policy(&uncapped), 0) {
        LedgerOutage::FailOpen { replicas } => assert_eq!(replicas.get(), 3),
        other => panic!("expensive fails open, no capped quota: {other:?}"),
    }
    let closed = uncapped.edit("expensive: fail_open }", "expensive: fail_closed }");
    assert_eq!(
        ledger_outage(&policy(&closed), 0),
        LedgerOutage::FailClosed,
        "the expensive class fails closed"
    );
}
