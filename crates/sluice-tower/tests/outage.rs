//! D3 at the layer: while the store cannot answer, each class follows its
//! outage rule — decided locally with this replica's share, or 503.

use crate::edit;
use edit::Edit as _;

use crate::support;

use std::path::Path;

use http::StatusCode;
use sluice_core::{Budget, BudgetStatus, Decision, FakeClock, Timestamp};
use sluice_store::{BudgetStore, StoreError};
use support::{T0, start_with, tool_call};

/// A store that is down.
struct Down;

impl BudgetStore for Down {
    async fn decide(&self, _: &[Budget]) -> Result<Decision, StoreError> {
        Err(StoreError::Unavailable("down".into()))
    }
    async fn peek(&self, _: &[Budget]) -> Result<Decision, StoreError> {
        Err(StoreError::Unavailable("down".into()))
    }
    async fn adjust(&self, _: &Budget, _: i64, _: Timestamp) -> Result<BudgetStatus, StoreError> {
        Err(StoreError::Unavailable("down".into()))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d3_fail_open_classes_decide_locally_and_fail_closed_ones_answer_503() {
    let yaml = sluice_policy::DEFAULT_POLICY_YAML
        .edit("expensive: fail_open }", "expensive: fail_closed }")
        .edit("replicas: 1", "replicas: 3");
    let policy = sluice_policy::parse_str(&yaml, Path::new("outage.yaml")).expect("policy");
    let edge = start_with(policy, Down, FakeClock::new(Timestamp::from_secs(T0 + 1))).await;
    let key = ("x-api-key", "sk-outage");
    // read is fail_open: decided on this replica with 300 / 3 = 100.
    let r = edge.get("/search/fields", &[key]).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!((r.limit(), r.remaining()), (100, 99));
    for i in 0..20 {
        let r = edge.post("/evals", &[key], "{}").await;
        assert_eq!(r.status, StatusCode::OK, "standard call {i}");
    }
    let r = edge.post("/evals", &[key], "{}").await;
    assert_eq!(
        r.status,
        StatusCode::TOO_MANY_REQUESTS,
        "standard: 60 / 3 = 20 locally"
    );
    // expensive is fail_closed: 503 with the JSON envelope and Retry-After.
    for r in [
        edge.post("/chats", &[key], "{}").await,
        edge.rpc(&[key], &tool_call(1, "start_chat")).await,
    ] {
        assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(r.header("retry-after"), "1");
        let body: serde_json::Value = serde_json::from_str(&r.body).expect("envelope");
        assert_eq!(body["error"]["code"], "limiter_unavailable");
    }
}
