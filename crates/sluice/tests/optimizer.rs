//! L1–L3 through a real `sluice serve` in front of its demo optimizer (each call
//! takes a few seconds): the lane holds its limits on both HTTP/1.1 request paths, says
//! where it stands in `/status` and `/metrics`, and trips its breaker when the
//! optimizer fails.

mod support;

use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use serde_json::Value;
use support::{Sluice, get, send};

fn optimize(sluice: &Sluice, key: &str, chunked: bool) -> Request<Full<Bytes>> {
    let builder = Request::post(sluice.url("/messages/optimize"))
        .header("x-api-key", key)
        .header("content-type", "application/json");
    // A chunked body is not one the fast path serves: it goes through hyper.
    let builder = if chunked {
        builder.header("transfer-encoding", "chunked")
    } else {
        builder
    };
    builder
        .body(Full::new(Bytes::from_static(b"{\"message\":\"hello\"}")))
        .expect("request")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l1_a_workspace_never_runs_more_than_3_optimizer_calls_on_either_path() {
    let sluice = Sluice::spawn(&["--demo-optimize-seconds", "3"]);
    let mut calls = Vec::new();
    for i in 0..16 {
        // Two workspaces, eight calls each, half on each request path.
        let key = if i % 2 == 0 { "sk-acme" } else { "sk-globex" };
        let request = optimize(&sluice, key, i % 4 < 2);
        calls.push(tokio::spawn(send(request)));
    }
    // While they run, the lane shows what it holds (once all 16 have arrived; the
    // first calls take 3 s).
    let mut status = Value::Null;
    for _ in 0..100 {
        status = get(&sluice.admin_url("/status")).await.json();
        let lane = &status["limiter"]["lanes"][0];
        if lane["running"].as_u64().unwrap_or(0) + lane["waiting"].as_u64().unwrap_or(0) == 16 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let lane = &status["limiter"]["lanes"][0];
    assert_eq!(lane["lane"], "optimizer", "{status}");
    assert_eq!(lane["running"], 6, "3 per workspace: {lane}");
    assert_eq!(lane["waiting"], 10, "{lane}");
    let metrics = get(&sluice.admin_url("/metrics")).await.text();
    assert!(
        metrics.contains("sluice_lane_running{lane=\"optimizer\"} 6"),
        "{metrics}"
    );

    for call in calls {
        let reply = call.await.expect("task");
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    }
    let demo = get(&sluice.url("/demo/optimizer")).await.json();
    assert_eq!(demo["calls"], 16, "{demo}");
    let workspaces = demo["workspaces"].as_object().expect("workspaces");
    assert_eq!(workspaces.len(), 2, "{demo}");
    for (workspace, w) in workspaces {
        assert_eq!(w["most_at_once"], 3, "{workspace}: {demo}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l3_a_failing_optimizer_opens_the_breaker_and_calls_are_refused_at_once() {
    let sluice = Sluice::spawn(&["--demo-optimize-seconds", "0"]);
    let failing = send(
        Request::post(sluice.url("/demo/optimizer?failing=true"))
            .body(Full::new(Bytes::new()))
            .expect("request"),
    )
    .await;
    assert_eq!(failing.status, StatusCode::OK, "{}", failing.text());
    for i in 0..5 {
        let reply = send(optimize(&sluice, &format!("sk-{i}"), false)).await;
        assert_eq!(
            reply.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "{}",
            reply.text()
        );
    }
    let refused = send(optimize(&sluice, "sk-next", true)).await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
    let body: Value = refused.json();
    assert_eq!(body["error"]["code"], "rate_limited");
    assert_eq!(body["error"]["details"]["reason"], "optimizer_unavailable");
    let wait: u64 = refused
        .header("retry-after")
        .and_then(|v| v.parse().ok())
        .expect("Retry-After");
    assert!((1..=30).contains(&wait), "the time left: {wait}");
    assert_eq!(body["error"]["details"]["retry_after_seconds"], wait);
    let demo = get(&sluice.url("/demo/optimizer")).await.json();
    assert_eq!(
        demo["calls"], 5,
        "nothing was sent while it is open: {demo}"
    );
    let status = get(&sluice.admin_url("/status")).await.json();
    assert_eq!(status["limiter"]["lanes"][0]["breaker"], "open");
}
