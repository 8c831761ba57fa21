//! L1–L3 through a real `sluice serve` in front of its demo optimizer (each call
//! takes a few seconds): the lane holds its limits on both HTTP/1.1 request paths, says
//! where it stands in `/status` and `/metrics`, and trips its breaker when the
//! optimizer fails.

use crate::support;

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

/// L1 and L2: a call waiting for its lane's place whose client hangs up leaves the
/// line, on both HTTP/1.1 request paths: it never takes a place, a start or the
/// upstream's work once places free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l2_a_waiting_call_whose_client_hangs_up_leaves_the_line() {
    use tokio::io::AsyncWriteExt as _;
    let sluice = Sluice::spawn(&["--demo-optimize-seconds", "2"]);
    let running: Vec<_> = (0..3)
        .map(|_| tokio::spawn(send(optimize(&sluice, "sk-acme", false))))
        .collect();
    let lane = |status: &Value| status["limiter"]["lanes"][0].clone();
    let until = |running: u64, waiting: u64| {
        let sluice = &sluice;
        async move {
            let mut l = Value::Null;
            for _ in 0..250 {
                l = lane(&get(&sluice.admin_url("/status")).await.json());
                if l["running"] == running && l["waiting"] == waiting {
                    return l;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            panic!("the lane never showed {running} running and {waiting} waiting: {l}");
        }
    };
    until(3, 0).await;
    // Two more callers wait (one on the fast path, one chunked through hyper), then
    // hang up.
    let body = "{\"message\":\"hello\"}";
    let mut waiting = Vec::new();
    for chunked in [false, true] {
        let mut stream = tokio::net::TcpStream::connect(sluice.start.gateway)
            .await
            .expect("connect");
        let head = if chunked {
            format!(
                "POST /messages/optimize HTTP/1.1\r\nHost: x\r\nX-API-Key: sk-acme\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{body}\r\n0\r\n\r\n",
                body.len()
            )
        } else {
            format!(
                "POST /messages/optimize HTTP/1.1\r\nHost: x\r\nX-API-Key: sk-acme\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            )
        };
        stream.write_all(head.as_bytes()).await.expect("write");
        waiting.push(stream);
    }
    until(3, 2).await;
    drop(waiting);
    until(3, 0).await;
    for call in running {
        let reply = call.await.expect("task");
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    }
    until(0, 0).await;
    let demo = get(&sluice.url("/demo/optimizer")).await.json();
    assert_eq!(demo["calls"], 3, "no call of a caller that left: {demo}");
    let status = get(&sluice.admin_url("/status")).await.json();
    assert_eq!(
        lane(&status)["workspaces"][0]["started_in_window"],
        3,
        "no start spent by them: {status}"
    );
}
