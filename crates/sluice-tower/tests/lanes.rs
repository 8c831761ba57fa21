//! L1–L3 at the edge: the optimizer's lane in front of a slow upstream, driven
//! through the tower layer in process on tokio's paused clock (no sockets, so time
//! only moves when every task waits).

use crate::edit;
use edit::Edit as _;

use std::convert::Infallible;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt as _, Full};
use sluice_policy::{DEFAULT_POLICY_YAML, parse_str};
use sluice_store::{MemoryConfig, MemoryStore};
use sluice_tower::{Limiter, SluiceLayer};
use tokio::time::Instant;
use tower::{Layer as _, Service, ServiceExt as _};

const SEC: Duration = Duration::from_secs(1);

/// A slow upstream: each call takes `took`, answers `status`, and counts the calls
/// running at once.
#[derive(Clone)]
struct Slow {
    took: Duration,
    status: Arc<AtomicU32>,
    running: Arc<AtomicUsize>,
    most: Arc<AtomicUsize>,
    calls: Arc<AtomicUsize>,
}

impl Slow {
    fn new(took: Duration) -> Self {
        Slow {
            took,
            status: Arc::new(AtomicU32::new(200)),
            running: Arc::default(),
            most: Arc::default(),
            calls: Arc::default(),
        }
    }
}

impl Service<Request<Full<Bytes>>> for Slow {
    type Response = Response<Full<Bytes>>;
    type Error = Infallible;
    type Future =
        std::pin::Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Infallible>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: Request<Full<Bytes>>) -> Self::Future {
        let this = self.clone();
        Box::pin(async move {
            this.calls.fetch_add(1, Ordering::SeqCst);
            let now = this.running.fetch_add(1, Ordering::SeqCst) + 1;
            this.most.fetch_max(now, Ordering::SeqCst);
            tokio::time::sleep(this.took).await;
            this.running.fetch_sub(1, Ordering::SeqCst);
            let status = StatusCode::from_u16(this.status.load(Ordering::SeqCst) as u16)
                .unwrap_or(StatusCode::OK);
            let mut r = Response::new(Full::new(Bytes::from_static(b"{}")));
            *r.status_mut() = status;
            Ok(r)
        })
    }
}

struct Edge {
    limiter: Arc<Limiter<MemoryStore>>,
    upstream: Slow,
}

struct Reply {
    status: StatusCode,
    retry_after: Option<u64>,
    body: serde_json::Value,
}

impl Edge {
    fn new(edit: impl FnOnce(&str) -> String, took: Duration) -> Self {
        let yaml = edit(DEFAULT_POLICY_YAML);
        let policy = parse_str(&yaml, Path::new("lanes.yaml")).expect("policy");
        let limiter = Arc::new(Limiter::new(
            policy,
            MemoryStore::new(MemoryConfig::default()),
        ));
        Edge {
            limiter,
            upstream: Slow::new(took),
        }
    }

    async fn send(&self, mut request: Request<Full<Bytes>>) -> Reply {
        request
            .extensions_mut()
            .insert(sluice_tower::PeerAddr(([203, 0, 113, 9], 5000).into()));
        let service = SluiceLayer::new(Arc::clone(&self.limiter)).layer(self.upstream.clone());
        let response = service.oneshot(request).await.expect("infallible");
        let status = response.status();
        let retry_after = response
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok());
        let body = response
            .into_body()
            .collect()
            .await
            .map(|c| c.to_bytes())
            .unwrap_or_default();
        Reply {
            status,
            retry_after,
            body: serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null),
        }
    }

    /// `POST /messages/optimize` as workspace (key) `key`.
    async fn optimize(&self, key: &str) -> Reply {
        self.send(
            Request::post("/messages/optimize")
                .header("host", "api")
                .header("x-api-key", key)
                .body(Full::new(Bytes::from_static(b"{\"draft\":\"hi\"}")))
                .expect("request"),
        )
        .await
    }

    /// The `optimize_message` tool over JSON-RPC as `key`.
    async fn optimize_tool(&self, key: &str) -> Reply {
        let body = r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"optimize_message","arguments":{"draft":"hi"}}}"#;
        self.send(
            Request::post("/mcp")
                .header("host", "api")
                .header("x-api-key", key)
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from_static(body.as_bytes())))
                .expect("request"),
        )
        .await
    }

    fn most_at_once(&self) -> usize {
        self.upstream.most.load(Ordering::SeqCst)
    }
}

fn reason(r: &Reply) -> &str {
    r.body["error"]["details"]["reason"].as_str().unwrap_or("")
}

fn assert_lane_refusal(r: &Reply, expected: &str) {
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS, "{}", r.body);
    assert_eq!(r.body["error"]["code"], "rate_limited", "{}", r.body);
    assert_eq!(reason(r), expected, "{}", r.body);
    let seconds = r.body["error"]["details"]["retry_after_seconds"]
        .as_u64()
        .expect("details.retry_after_seconds");
    assert_eq!(r.retry_after, Some(seconds), "Retry-After says the same");
}

#[tokio::test(start_paused = true)]
async fn l1_l2_the_fourth_concurrent_call_waits_15s_then_workspace_in_flight_limit() {
    let edge = Arc::new(Edge::new(str::to_owned, 100 * SEC));
    let mut running = Vec::new();
    for _ in 0..3 {
        let edge = Arc::clone(&edge);
        running.push(tokio::spawn(async move { edge.optimize("sk-acme").await }));
    }
    tokio::time::sleep(SEC).await;
    let asked = Instant::now();
    let fourth = edge.optimize("sk-acme").await;
    assert_eq!(asked.elapsed(), 15 * SEC, "it waited its 15 s in line");
    assert_lane_refusal(&fourth, "workspace_in_flight_limit");
    let wait = fourth.retry_after.expect("Retry-After");
    assert!(
        (5..=75).contains(&wait),
        "an estimate within 5–75 s: {wait}"
    );
    assert_eq!(
        edge.most_at_once(),
        3,
        "never more than 3 for one workspace"
    );
    // Another workspace is not held by acme's calls.
    let other = edge.optimize("sk-globex").await;
    assert_eq!(other.status, StatusCode::OK);
    for call in running {
        assert_eq!(call.await.expect("task").status, StatusCode::OK);
    }
    let lane = &edge.limiter.lanes()[0].snapshot();
    assert_eq!(
        (lane.running, lane.waiting),
        (0, 0),
        "every place came back"
    );
}

#[tokio::test(start_paused = true)]
async fn l1_the_thirteenth_start_in_60s_is_refused_with_an_exact_retry_after() {
    let edge = Edge::new(str::to_owned, SEC);
    for _ in 0..12 {
        assert_eq!(edge.optimize("sk-acme").await.status, StatusCode::OK);
        tokio::time::sleep(SEC).await;
    }
    // 12 calls started at t = 0, 2, …, 22 s (each took 1 s, then 1 s pause); now
    // t = 24 s: the first start leaves the window at 60 s.
    let thirteenth = edge.optimize("sk-acme").await;
    assert_lane_refusal(&thirteenth, "workspace_rate_limit");
    assert_eq!(thirteenth.retry_after, Some(36));
}

#[tokio::test(start_paused = true)]
async fn l1_a_full_global_cap_gives_optimizer_busy() {
    let edge = Arc::new(Edge::new(
        |y| {
            y.edit("global_in_flight: 20", "global_in_flight: 4")
                .edit("batch_reserve: 5", "batch_reserve: 1")
        },
        100 * SEC,
    ));
    let mut calls = Vec::new();
    for key in ["sk-a", "sk-a", "sk-a", "sk-b"] {
        let edge = Arc::clone(&edge);
        calls.push(tokio::spawn(async move { edge.optimize(key).await }));
    }
    tokio::time::sleep(SEC).await;
    let busy = edge.optimize("sk-c").await;
    assert_lane_refusal(&busy, "optimizer_busy");
    assert_eq!(edge.most_at_once(), 4, "the global cap held");
}

#[tokio::test(start_paused = true)]
async fn l2_a_jsonrpc_tool_call_waits_up_to_two_minutes() {
    let edge = Arc::new(Edge::new(str::to_owned, 300 * SEC));
    let mut running = Vec::new();
    for _ in 0..3 {
        let edge = Arc::clone(&edge);
        running.push(tokio::spawn(
            async move { edge.optimize_tool("sk-acme").await },
        ));
    }
    tokio::time::sleep(SEC).await;
    let asked = Instant::now();
    let fourth = edge.optimize_tool("sk-acme").await;
    assert_eq!(asked.elapsed(), 120 * SEC, "a tool call waits 2 min");
    // On /mcp the refusal is a JSON-RPC error whose data an agent can read.
    assert_eq!(fourth.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(fourth.body["id"], 1);
    assert_eq!(fourth.body["error"]["code"], -32029);
    let data = &fourth.body["error"]["data"];
    assert_eq!(data["reason"], "workspace_in_flight_limit", "{data}");
    assert_eq!(data["class"], "expensive");
    assert_eq!(data["retry_after_seconds"].as_u64(), fourth.retry_after);
}

#[tokio::test(start_paused = true)]
async fn l3_five_failures_open_the_breaker_then_one_probe_closes_it() {
    let edge = Edge::new(str::to_owned, SEC);
    edge.upstream.status.store(503, Ordering::SeqCst);
    for i in 0..5 {
        let r = edge.optimize(&format!("sk-{i}")).await;
        assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
    }
    let calls = edge.upstream.calls.load(Ordering::SeqCst);
    let asked = Instant::now();
    let refused = edge.optimize("sk-new").await;
    assert_eq!(asked.elapsed(), Duration::ZERO, "refused at once");
    assert_lane_refusal(&refused, "optimizer_unavailable");
    assert_eq!(refused.retry_after, Some(30), "the time left");
    assert_eq!(
        edge.upstream.calls.load(Ordering::SeqCst),
        calls,
        "nothing was sent while it is open"
    );
    tokio::time::sleep(30 * SEC).await;
    edge.upstream.status.store(200, Ordering::SeqCst);
    assert_eq!(edge.optimize("sk-probe").await.status, StatusCode::OK);
    assert_eq!(edge.optimize("sk-after").await.status, StatusCode::OK);
}

#[tokio::test(start_paused = true)]
async fn l3_an_upstream_that_hangs_is_cut_at_the_lane_timeout_and_counts_as_a_failure() {
    let edge = Edge::new(
        |y| y.edit("timeout_seconds: 180", "timeout_seconds: 5"),
        3600 * SEC,
    );
    let asked = Instant::now();
    let r = edge.optimize("sk-acme").await;
    assert_eq!(asked.elapsed(), 5 * SEC);
    assert_eq!(r.status, StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(r.body["error"]["code"], "upstream_timeout");
    let lane = edge.limiter.lanes()[0].snapshot();
    assert_eq!(lane.running, 0, "the place came back");
}

#[tokio::test(start_paused = true)]
async fn l1_q1_a_call_its_quota_refuses_gives_back_its_lane_start() {
    let edge = Edge::new(
        |y| y.edit("messages: { monthly: 1000 }", "messages: { monthly: 2 }"),
        SEC,
    );
    assert_eq!(edge.optimize("sk-acme").await.status, StatusCode::OK);
    assert_eq!(edge.optimize("sk-acme").await.status, StatusCode::OK);
    for _ in 0..20 {
        let r = edge.optimize("sk-acme").await;
        assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(r.body["error"]["code"], "quota_exceeded", "{}", r.body);
    }
    let lane = edge.limiter.lanes()[0].snapshot();
    let started: u32 = lane.workspaces.iter().map(|w| w.started_in_window).sum();
    assert_eq!(started, 2, "refused calls took no start");
    assert_eq!(edge.upstream.calls.load(Ordering::SeqCst), 2);
}

#[tokio::test(start_paused = true)]
async fn l2_a_client_that_goes_away_leaves_the_line_at_once() {
    let edge = Arc::new(Edge::new(str::to_owned, 100 * SEC));
    let mut running = Vec::new();
    for _ in 0..3 {
        let edge = Arc::clone(&edge);
        running.push(tokio::spawn(async move { edge.optimize("sk-acme").await }));
    }
    tokio::time::sleep(SEC).await;
    let waiter = {
        let edge = Arc::clone(&edge);
        tokio::spawn(async move { edge.optimize("sk-acme").await })
    };
    tokio::time::sleep(SEC).await;
    assert_eq!(edge.limiter.lanes()[0].snapshot().waiting, 1);
    waiter.abort();
    let _ = waiter.await;
    assert_eq!(edge.limiter.lanes()[0].snapshot().waiting, 0);
}

#[tokio::test(start_paused = true)]
async fn l1_a_jsonrpc_batch_takes_a_place_per_call_and_one_that_never_fits_is_refused_at_once() {
    let edge = Arc::new(Edge::new(str::to_owned, 10 * SEC));
    let call = |id: u32| {
        format!(
            r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{{"name":"optimize_message","arguments":{{}}}}}}"#
        )
    };
    let batch = |n: u32| {
        let calls: Vec<String> = (0..n).map(call).collect();
        Request::post("/mcp")
            .header("host", "api")
            .header("x-api-key", "sk-acme")
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(format!("[{}]", calls.join(",")))))
            .expect("request")
    };
    let two = {
        let edge = Arc::clone(&edge);
        let request = batch(2);
        tokio::spawn(async move { edge.send(request).await })
    };
    tokio::time::sleep(SEC).await;
    assert_eq!(
        edge.limiter.lanes()[0].snapshot().running,
        2,
        "a place per call"
    );
    assert_eq!(two.await.expect("task").status, StatusCode::OK);
    assert_eq!(edge.limiter.lanes()[0].snapshot().running, 0);

    let asked = Instant::now();
    let four = edge.send(batch(4)).await;
    assert_eq!(
        asked.elapsed(),
        Duration::ZERO,
        "never fits: refused at once"
    );
    assert_eq!(four.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        four.body["error"]["details"]["reason"],
        "too_many_lane_calls"
    );
    assert_eq!(four.body["error"]["details"]["max"], 3);
    assert_eq!(four.retry_after, None, "waiting would not help");
}
