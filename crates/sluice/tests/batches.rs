//! L4 through a real `sluice serve` in front of its demo optimizer: batches are
//! queued durably and answered 202, run on the lane's spare capacity with
//! `Idempotency-Key: <batch_id>/<index>`, read back with progress and results,
//! refused only for what the contract names, and survive `kill -9`.

use crate::edit;
use edit::Edit as _;

use crate::support;

use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use serde_json::{Value, json};
use support::{DataDir, Sluice, send};

fn submit(sluice: &Sluice, key: &str, body: &Value) -> Request<Full<Bytes>> {
    Request::post(sluice.url("/messages/optimize/batch"))
        .header("x-api-key", key)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .expect("request")
}

fn status(sluice: &Sluice, key: &str, id: &str) -> Request<Full<Bytes>> {
    Request::get(sluice.url(&format!("/messages/optimize/batches/{id}")))
        .header("x-api-key", key)
        .body(Full::new(Bytes::new()))
        .expect("request")
}

fn items(n: usize) -> Vec<Value> {
    (0..n)
        .map(|i| json!({ "message": format!("draft {i}") }))
        .collect()
}

/// Reads the batch until it is done (bounded), returning its last status.
async fn until_done(sluice: &Sluice, key: &str, id: &str) -> Value {
    let started = Instant::now();
    loop {
        let reply = send(status(sluice, key, id)).await;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
        let body = reply.json();
        if body["state"] == "done" || started.elapsed() > Duration::from_secs(60) {
            return body;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l4_a_batch_is_queued_at_once_runs_and_reports_each_result() {
    let sluice = Sluice::spawn(&["--demo-optimize-seconds", "0.2"]);
    let reply = send(submit(&sluice, "sk-acme", &json!({ "items": items(8) }))).await;
    assert_eq!(reply.status, StatusCode::ACCEPTED, "{}", reply.text());
    let body = reply.json();
    let id = body["batch_id"].as_str().expect("batch_id").to_owned();
    assert_eq!(body["items"], 8);
    let status_url = format!("/messages/optimize/batches/{id}");
    assert_eq!(body["status_url"], status_url);
    assert_eq!(reply.header("location"), Some(status_url.as_str()));

    let done = until_done(&sluice, "sk-acme", &id).await;
    assert_eq!(done["state"], "done", "{done}");
    assert_eq!(
        (done["total"].as_u64(), done["done"].as_u64()),
        (Some(8), Some(8))
    );
    let results = done["items"].as_array().expect("items");
    assert_eq!(results.len(), 8);
    for (i, item) in results.iter().enumerate() {
        assert_eq!(item["index"], i);
        assert_eq!(item["state"], "done", "{item}");
        assert_eq!(item["status"], 200);
        assert_eq!(item["result"]["optimized"], format!("draft {i}"), "{item}");
        // Each item went upstream with its own key.
        assert_eq!(item["result"]["idempotency_key"], format!("{id}/{i}"));
    }
    // Batch items count only toward the global cap, never a workspace's 3 at once.
    let demo = send(
        Request::get(sluice.url("/demo/optimizer"))
            .body(Full::new(Bytes::new()))
            .expect("request"),
    )
    .await
    .json();
    assert_eq!(demo["calls"], 8, "{demo}");
    // /status shows the batch lane: nothing left queued, 8 done here.
    let admin = send(
        Request::get(sluice.admin_url("/status"))
            .body(Full::new(Bytes::new()))
            .expect("request"),
    )
    .await
    .json();
    let batches = &admin["limiter"]["batches"][0];
    assert_eq!(batches["lane"], "optimizer", "{admin}");
    assert_eq!(batches["done_here"], 8, "{batches}");
    assert!(
        demo["most_at_once"].as_u64() <= Some(15),
        "cap minus reserve: {demo}"
    );

    // Another workspace's batch, and an unknown one, are not found.
    assert_eq!(
        send(status(&sluice, "sk-globex", &id)).await.status,
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        send(status(&sluice, "sk-acme", "bat_0000")).await.status,
        StatusCode::NOT_FOUND
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l4_bad_bodies_conflicts_and_idempotent_repeats() {
    let sluice = Sluice::spawn(&["--demo-optimize-seconds", "0"]);
    for (body, reason) in [
        (json!([1]), "not_an_object"),
        (json!({ "items": [] }), "empty_batch"),
        (json!({ "items": [1, 2] }), "item_not_an_object"),
        (json!({ "items": [{}], "priority": 1 }), "unknown_field"),
        (json!({ "drafts": [{}] }), "unknown_field"),
    ] {
        let reply = send(submit(&sluice, "sk-acme", &body)).await;
        assert_eq!(
            reply.status,
            StatusCode::BAD_REQUEST,
            "{body}: {}",
            reply.text()
        );
        assert_eq!(reply.json()["error"]["details"]["reason"], reason, "{body}");
    }
    let first = json!({ "items": items(2), "idempotency_key": "k-1" });
    let a = send(submit(&sluice, "sk-acme", &first)).await;
    assert_eq!(a.status, StatusCode::ACCEPTED, "{}", a.text());
    let b = send(submit(&sluice, "sk-acme", &first)).await;
    assert_eq!(b.status, StatusCode::ACCEPTED);
    assert_eq!(
        a.json()["batch_id"],
        b.json()["batch_id"],
        "same key and body, same batch"
    );
    let other = json!({ "items": items(3), "idempotency_key": "k-1" });
    let c = send(submit(&sluice, "sk-acme", &other)).await;
    assert_eq!(c.status, StatusCode::CONFLICT, "{}", c.text());
    assert_eq!(c.json()["error"]["code"], "conflict");
    // The repeat and the conflict gave their quota units back: 2 counted in all.
    assert_eq!(messages_used(&sluice, "sk-acme").await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l4_q1_a_batch_larger_than_the_quota_left_is_refused_and_the_backlog_is_bounded() {
    let dir = DataDir::new();
    std::fs::create_dir_all(&dir.0).expect("dir");
    let policy = dir.0.join("policy.yaml");
    let yaml = sluice_policy::DEFAULT_POLICY_YAML
        .edit("messages: { monthly: 1000 }", "messages: { monthly: 15 }")
        .edit("      backlog: 5000\n", "      backlog: 12\n")
        .edit("      max_items: 1000\n", "      max_items: 10\n");
    std::fs::write(&policy, yaml).expect("policy");
    let data = dir.0.join("data");
    let sluice = Sluice::spawn(&[
        "--config",
        policy.to_str().expect("path"),
        "--data-dir",
        data.to_str().expect("path"),
        // Slow enough that nothing finishes during the test.
        "--demo-optimize-seconds",
        "600",
    ]);
    let ok = send(submit(&sluice, "sk-acme", &json!({ "items": items(10) }))).await;
    assert_eq!(ok.status, StatusCode::ACCEPTED, "{}", ok.text());
    // 10 queued (some running); 3 more would pass the backlog of 12.
    let backlog = send(submit(&sluice, "sk-acme", &json!({ "items": items(3) }))).await;
    assert_eq!(
        backlog.status,
        StatusCode::TOO_MANY_REQUESTS,
        "{}",
        backlog.text()
    );
    let body = backlog.json();
    assert_eq!(body["error"]["code"], "rate_limited");
    assert_eq!(body["error"]["details"]["reason"], "batch_backlog_limit");
    assert_eq!(backlog.header("retry-after"), None, "no Retry-After");
    // Another workspace: 10 of its 15 a month, then 10 more would pass its quota
    // (its items count at submit): quota_exceeded, before the backlog is asked.
    let globex_ok = send(submit(&sluice, "sk-globex", &json!({ "items": items(10) }))).await;
    assert_eq!(globex_ok.status, StatusCode::ACCEPTED);
    let over = send(submit(&sluice, "sk-globex", &json!({ "items": items(10) }))).await;
    assert_eq!(
        over.status,
        StatusCode::TOO_MANY_REQUESTS,
        "{}",
        over.text()
    );
    assert_eq!(over.json()["error"]["code"], "quota_exceeded");
}

/// SPEC L4 with Q1: a batch that spends the last of its workspace's monthly quota
/// still answers its repeat (same idempotency key, same body) with its 202 and
/// `batch_id`, counting nothing more: a client whose first answer was lost is
/// told what it queued. A new batch, or the same key with another body, is still
/// refused `quota_exceeded`, and nothing of them is queued. Before, the repeat was
/// refused 429 `quota_exceeded` while its batch ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l4_q1_a_repeat_of_the_batch_that_spent_the_quota_is_answered_as_it_was() {
    let dir = DataDir::new();
    std::fs::create_dir_all(&dir.0).expect("dir");
    let policy = dir.0.join("policy.yaml");
    let yaml = sluice_policy::DEFAULT_POLICY_YAML
        .edit("messages: { monthly: 1000 }", "messages: { monthly: 5 }");
    std::fs::write(&policy, yaml).expect("policy");
    let sluice = Sluice::spawn(&[
        "--config",
        policy.to_str().expect("path"),
        "--demo-optimize-seconds",
        "600",
    ]);
    let batch = json!({ "items": items(5), "idempotency_key": "k-1" });
    let first = send(submit(&sluice, "sk-acme", &batch)).await;
    assert_eq!(first.status, StatusCode::ACCEPTED, "{}", first.text());
    let id = first.json()["batch_id"].clone();
    assert_eq!(messages_used(&sluice, "sk-acme").await, 5);
    for _ in 0..2 {
        let repeat = send(submit(&sluice, "sk-acme", &batch)).await;
        assert_eq!(repeat.status, StatusCode::ACCEPTED, "{}", repeat.text());
        assert_eq!(repeat.json()["batch_id"], id);
    }
    for other in [
        json!({ "items": items(1), "idempotency_key": "k-2" }),
        json!({ "items": items(1) }),
        json!({ "items": items(4), "idempotency_key": "k-1" }),
    ] {
        let refused = send(submit(&sluice, "sk-acme", &other)).await;
        assert_eq!(
            refused.status,
            StatusCode::TOO_MANY_REQUESTS,
            "{other}: {}",
            refused.text()
        );
        assert_eq!(refused.json()["error"]["code"], "quota_exceeded", "{other}");
    }
    // Another workspace's key names none of acme's batches.
    let globex = send(submit(&sluice, "sk-globex", &batch)).await;
    assert_eq!(globex.status, StatusCode::ACCEPTED, "{}", globex.text());
    assert_ne!(globex.json()["batch_id"], id);
    assert_eq!(
        messages_used(&sluice, "sk-acme").await,
        5,
        "nothing more counted"
    );
    let status = send(status(&sluice, "sk-acme", id.as_str().expect("id"))).await;
    assert_eq!(status.json()["total"], 5, "{}", status.text());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l4_kill_9_during_a_batch_loses_no_item_and_no_result() {
    let data = DataDir::new();
    let mut sluice = Sluice::spawn(&["--data-dir", data.arg(), "--demo-optimize-seconds", "0.5"]);
    let reply = send(submit(&sluice, "sk-acme", &json!({ "items": items(40) }))).await;
    assert_eq!(reply.status, StatusCode::ACCEPTED, "{}", reply.text());
    let id = reply.json()["batch_id"].as_str().expect("id").to_owned();
    // Once some have finished (and others run or wait), kill -9.
    let started = Instant::now();
    let before = loop {
        let now = send(status(&sluice, "sk-acme", &id)).await.json();
        if now["done"].as_u64().unwrap_or(0) > 0 || started.elapsed() > Duration::from_secs(30) {
            break now;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    sluice.kill();
    drop(sluice);
    let sluice = Sluice::spawn(&["--data-dir", data.arg(), "--demo-optimize-seconds", "0.1"]);
    let done = until_done(&sluice, "sk-acme", &id).await;
    assert_eq!(done["state"], "done", "{done}");
    assert_eq!(done["done"], 40, "every item ended once: {done}");
    let finished_before = before["done"].as_u64().unwrap_or(0);
    assert!(
        finished_before > 0,
        "some finished before the kill: {before}"
    );
    for (i, item) in done["items"].as_array().expect("items").iter().enumerate() {
        assert_eq!(
            item["result"]["idempotency_key"],
            format!("{id}/{i}"),
            "{item}"
        );
        // Results recorded before the kill are still there, unchanged.
        if before["items"][i]["state"] == "done" {
            assert_eq!(item["result"], before["items"][i]["result"]);
            assert_eq!(item["attempts"], before["items"][i]["attempts"]);
        }
    }
}

/// The `messages` quota units the workspace of credential `key` has spent this
/// month (`GET /quotas` on the admin listener).
async fn messages_used(sluice: &Sluice, key: &str) -> u64 {
    let usage = send(
        Request::get(sluice.admin_url(&format!(
            "/quotas?workspace=key:{}",
            support::sha256_hex(key)
        )))
        .body(Full::new(Bytes::new()))
        .expect("request"),
    )
    .await
    .json();
    usage["quotas"]
        .as_array()
        .and_then(|q| q.iter().find(|f| f["family"] == "messages"))
        .and_then(|f| f["usage"].as_u64())
        .unwrap_or_else(|| panic!("no messages quota: {usage}"))
}

fn rpc(sluice: &Sluice, key: &str, body: &Value) -> Request<Full<Bytes>> {
    Request::post(sluice.url("/mcp"))
        .header("x-api-key", key)
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .body(Full::new(Bytes::from(body.to_string())))
        .expect("request")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l4_the_batch_tools_run_the_batch_lane_over_jsonrpc() {
    let sluice = Sluice::spawn(&["--demo-optimize-seconds", "0"]);
    let call = |id: u32, name: &str, arguments: Value| {
        json!({ "jsonrpc": "2.0", "id": id, "method": "tools/call",
                "params": { "name": name, "arguments": arguments } })
    };
    let reply = send(rpc(
        &sluice,
        "sk-acme",
        &call(
            1,
            "optimize_message_batch",
            json!({ "items": items(3), "idempotency_key": "t-1" }),
        ),
    ))
    .await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    let body = reply.json();
    assert_eq!(body["id"], 1);
    let id = body["result"]["structuredContent"]["batch_id"]
        .as_str()
        .expect("batch_id")
        .to_owned();
    assert_eq!(body["result"]["structuredContent"]["items"], 3);

    // A call longer than a connection's read buffer (the fast path holds its body in
    // pieces, then hands it whole to the batch lanes) is queued the same (issue 23).
    let long: Vec<Value> = (0..40)
        .map(|i| json!({ "message": format!("draft {i} {}", "x".repeat(1000)) }))
        .collect();
    let request = call(
        6,
        "optimize_message_batch",
        json!({ "items": long, "idempotency_key": "t-long" }),
    );
    assert!(request.to_string().len() > 32 << 10);
    let reply = send(rpc(&sluice, "sk-acme", &request)).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    assert_eq!(reply.json()["result"]["structuredContent"]["items"], 40);

    // Read it back with get_batch until it is done.
    let started = Instant::now();
    let status = loop {
        let reply = send(rpc(
            &sluice,
            "sk-acme",
            &call(2, "get_batch", json!({ "batch_id": id })),
        ))
        .await;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
        let status = reply.json()["result"]["structuredContent"].clone();
        if status["state"] == "done" || started.elapsed() > Duration::from_secs(30) {
            break status;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(status["done"], 3, "{status}");
    // The REST status route shows the same batch.
    let rest = send(self::status(&sluice, "sk-acme", &id)).await.json();
    assert_eq!(rest["batch_id"], id.as_str());

    // Another workspace gets a JSON-RPC error, not its batch.
    let other = send(rpc(
        &sluice,
        "sk-globex",
        &call(3, "get_batch", json!({ "batch_id": id })),
    ))
    .await;
    assert_eq!(other.status, StatusCode::NOT_FOUND);
    assert_eq!(other.json()["error"]["data"]["code"], "not_found");

    // Inside a JSON-RPC batch the tool is refused: sluice answers it only alone.
    let mixed = json!([
        call(4, "get_batch", json!({ "batch_id": id })),
        call(5, "search_fields", json!({}))
    ]);
    let reply = send(rpc(&sluice, "sk-acme", &mixed)).await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{}", reply.text());
    assert_eq!(reply.json()["jsonrpc"], "2.0", "{}", reply.text());
    assert_eq!(
        reply.json()["error"]["data"]["reason"],
        "batch_tool_in_batch"
    );

    // Arguments that cannot be queued: the call's own JSON-RPC error (an MCP
    // client reads no HTTP status), nothing spent.
    let before = messages_used(&sluice, "sk-acme").await;
    for (n, (arguments, reason)) in [
        (json!({ "items": [1] }), "item_not_an_object"),
        (json!({ "items": [] }), "empty_batch"),
        (
            json!({ "items": items(1), "idempotency_key": 7 }),
            "bad_idempotency_key",
        ),
        (json!({ "items": items(1), "extra": true }), "unknown_field"),
    ]
    .into_iter()
    .enumerate()
    {
        let id = 10 + u32::try_from(n).expect("few");
        let reply = send(rpc(
            &sluice,
            "sk-acme",
            &call(id, "optimize_message_batch", arguments),
        ))
        .await;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{}", reply.text());
        let answer = reply.json();
        assert_eq!(answer["jsonrpc"], "2.0", "{answer}");
        assert_eq!(answer["id"], id, "{answer}");
        assert_eq!(answer["error"]["code"], -32602, "{answer}");
        assert_eq!(answer["error"]["data"]["reason"], reason, "{answer}");
    }
    assert_eq!(messages_used(&sluice, "sk-acme").await, before);
}

/// A batch tool's call spelled another way — its name with JSON escapes, or the
/// retired tool name with the action that maps to it — is the batch lane's all the
/// same: queued by sluice with its items' quota spent, never forwarded to the
/// upstream as one call (issue: the look for the name was by its bytes as sent).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l4_a_batch_tool_spelled_another_way_is_still_the_batch_lane() {
    let sluice = Sluice::spawn(&["--demo-optimize-seconds", "0"]);
    let raw = |body: String| {
        Request::post(sluice.url("/mcp"))
            .header("x-api-key", "sk-acme")
            .header("content-type", "application/json")
            .header("accept", "application/json, text/event-stream")
            .body(Full::new(Bytes::from(body)))
            .expect("request")
    };
    let items3 = Value::from(items(3)).to_string();
    let spellings = [
        format!(
            r#"{{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{{"name":"optimize\u005fmessage_batch","arguments":{{"items":{items3}}}}}}}"#
        ),
        format!(
            r#"{{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{{"name":"messages","arguments":{{"action":"optimize_batch","items":{items3}}}}}}}"#
        ),
    ];
    for (n, body) in spellings.into_iter().enumerate() {
        let reply = send(raw(body.clone())).await;
        assert_eq!(reply.status, StatusCode::OK, "{body}: {}", reply.text());
        let answer = reply.json();
        assert_eq!(
            answer["result"]["structuredContent"]["items"], 3,
            "{body}: queued by sluice's batch lane, not forwarded: {answer}"
        );
        assert_eq!(
            messages_used(&sluice, "sk-acme").await,
            3 * (n as u64 + 1),
            "each item spends a unit"
        );
    }
    // Inside a JSON-RPC batch, the retired spelling is refused as the tool is.
    let mixed = format!(
        r#"[{{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{{"name":"messages","arguments":{{"action":"optimize_batch","items":{items3}}}}}}},{{"jsonrpc":"2.0","id":4,"method":"tools/list"}}]"#
    );
    let reply = send(raw(mixed)).await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{}", reply.text());
    assert_eq!(
        reply.json()["error"]["data"]["reason"],
        "batch_tool_in_batch"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l4_replicas_on_one_redis_share_the_queue() {
    let redis = support::redis::RedisServer::start("batches");
    let url = redis.url();
    let a = Sluice::spawn(&["--store", &url, "--demo-optimize-seconds", "0"]);
    let b = Sluice::spawn(&["--store", &url, "--demo-optimize-seconds", "0"]);
    let reply = send(submit(&a, "sk-acme", &json!({ "items": items(6) }))).await;
    assert_eq!(reply.status, StatusCode::ACCEPTED, "{}", reply.text());
    let id = reply.json()["batch_id"].as_str().expect("id").to_owned();
    // The other replica reads it (and either may run its items).
    let done = until_done(&b, "sk-acme", &id).await;
    assert_eq!(done["done"], 6, "{done}");
    assert_eq!(send(status(&a, "sk-acme", &id)).await.json()["done"], 6);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l4_a_single_call_starts_within_a_second_while_5000_batch_items_run() {
    let dir = DataDir::new();
    std::fs::create_dir_all(&dir.0).expect("dir");
    let policy = dir.0.join("policy.yaml");
    let yaml = sluice_policy::DEFAULT_POLICY_YAML.edit(
        "messages: { monthly: 1000 }",
        "messages: { monthly: 100000 }",
    );
    std::fs::write(&policy, yaml).expect("policy");
    let data = dir.0.join("data");
    let sluice = Sluice::spawn(&[
        "--config",
        policy.to_str().expect("path"),
        "--data-dir",
        data.to_str().expect("path"),
        "--demo-optimize-seconds",
        "0.5",
    ]);
    // 5,000 items (five batches of the most one may hold), from two workspaces.
    for i in 0..5 {
        let key = if i % 2 == 0 { "sk-bulk-a" } else { "sk-bulk-b" };
        let reply = send(submit(&sluice, key, &json!({ "items": items(1000) }))).await;
        assert_eq!(reply.status, StatusCode::ACCEPTED, "{}", reply.text());
    }
    // The batch lane fills what it may: wait until items run.
    let started = Instant::now();
    loop {
        let demo = send(
            Request::get(sluice.url("/demo/optimizer"))
                .body(Full::new(Bytes::new()))
                .expect("request"),
        )
        .await
        .json();
        if demo["running"].as_u64() >= Some(10) || started.elapsed() > Duration::from_secs(30) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Single calls still start at once: the reserve is theirs.
    for i in 0..3 {
        let asked = Instant::now();
        let reply = send(
            Request::post(sluice.url("/messages/optimize"))
                .header("x-api-key", format!("sk-single-{i}"))
                .body(Full::new(Bytes::from_static(b"{\"message\":\"now\"}")))
                .expect("request"),
        )
        .await;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
        // 0.5 s is the call itself.
        assert!(
            asked.elapsed() < Duration::from_millis(1500),
            "a single call waited {:?} beside the batch",
            asked.elapsed()
        );
    }
    let demo = send(
        Request::get(sluice.url("/demo/optimizer"))
            .body(Full::new(Bytes::new()))
            .expect("request"),
    )
    .await
    .json();
    assert!(
        demo["most_at_once"].as_u64() <= Some(20),
        "the global cap: {demo}"
    );
    let bulk_most: u64 = ["sk-bulk-a", "sk-bulk-b"]
        .iter()
        .filter_map(|k| {
            demo["workspaces"][format!("key:{}", support::sha256_hex(k))]["most_at_once"].as_u64()
        })
        .sum();
    assert!(bulk_most <= 15 + 15, "{demo}");
    let admin = send(
        Request::get(sluice.admin_url("/status"))
            .body(Full::new(Bytes::new()))
            .expect("request"),
    )
    .await
    .json();
    let lane = &admin["limiter"]["lanes"][0];
    assert!(
        lane["batch_running"].as_u64() <= Some(15),
        "cap minus reserve: {lane}"
    );
}

/// A test upstream on a port of its own: `POST <path>` answers 500 (after a
/// moment) when the body holds `"poison"`, else 200 with the path, the
/// `X-Request-Id` and the `Idempotency-Key` it was sent. It counts the calls it
/// failed.
struct TestUpstream {
    url: String,
    failed: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl TestUpstream {
    async fn start() -> TestUpstream {
        use hyper::service::service_fn;
        use hyper_util::rt::TokioIo;
        use std::sync::atomic::Ordering;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        let failed = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let counter = std::sync::Arc::clone(&failed);
        tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                let counter = std::sync::Arc::clone(&counter);
                tokio::spawn(async move {
                    let service = service_fn(move |request: Request<hyper::body::Incoming>| {
                        let counter = std::sync::Arc::clone(&counter);
                        async move {
                            use http_body_util::BodyExt as _;
                            let (parts, body) = request.into_parts();
                            let body = body
                                .collect()
                                .await
                                .map(|c| c.to_bytes())
                                .unwrap_or_default();
                            let header = |name: &str| {
                                parts
                                    .headers
                                    .get(name)
                                    .and_then(|v| v.to_str().ok())
                                    .map(str::to_owned)
                            };
                            let poison = String::from_utf8_lossy(&body).contains("poison");
                            let (status, answer) = if poison {
                                counter.fetch_add(1, Ordering::Relaxed);
                                tokio::time::sleep(Duration::from_millis(20)).await;
                                (500, json!({ "error": "this item always fails" }))
                            } else {
                                (
                                    200,
                                    json!({
                                        "path": parts.uri.path(),
                                        "request_id": header("x-request-id"),
                                        "idempotency_key": header("idempotency-key"),
                                    }),
                                )
                            };
                            let mut response =
                                http::Response::new(Full::new(Bytes::from(answer.to_string())));
                            *response.status_mut() = StatusCode::from_u16(status).expect("status");
                            response.headers_mut().insert(
                                http::header::CONTENT_TYPE,
                                http::HeaderValue::from_static("application/json"),
                            );
                            Ok::<_, std::convert::Infallible>(response)
                        }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(socket), service)
                        .await;
                });
            }
        });
        TestUpstream { url, failed }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l4_l3_a_poison_batch_fails_on_its_own_while_other_workspaces_single_calls_are_served() {
    let upstream = TestUpstream::start().await;
    // A short open time: the poison workspace's own hold (5 failed attempts in
    // a row hold its items for the breaker's open time) is over in seconds.
    let dir = DataDir::new();
    std::fs::create_dir_all(&dir.0).expect("dir");
    let policy = dir.0.join("policy.yaml");
    let yaml = sluice_policy::DEFAULT_POLICY_YAML.edit("open_seconds: 30", "open_seconds: 2");
    std::fs::write(&policy, yaml).expect("policy");
    let sluice = Sluice::spawn(&[
        "--config",
        policy.to_str().expect("path"),
        "--upstream",
        &upstream.url,
    ]);
    let poison: Vec<Value> = (0..10)
        .map(|i| json!({ "message": format!("poison {i}") }))
        .collect();
    let reply = send(submit(&sluice, "sk-poison", &json!({ "items": poison }))).await;
    assert_eq!(reply.status, StatusCode::ACCEPTED, "{}", reply.text());
    let id = reply.json()["batch_id"].as_str().expect("id").to_owned();
    // Beside it, single calls of other workspaces: every one is served, before
    // and after the batch's items have failed often enough to open a breaker
    // they counted toward (5 in a row).
    let started = Instant::now();
    let mut singles = 0;
    let done = loop {
        let reply = send(
            Request::post(sluice.url("/messages/optimize"))
                .header("x-api-key", format!("sk-single-{singles}"))
                .body(Full::new(Bytes::from_static(b"{\"message\":\"fine\"}")))
                .expect("request"),
        )
        .await;
        assert_eq!(
            reply.status,
            StatusCode::OK,
            "single call {singles} after {} poison attempts: {}",
            upstream.failed.load(std::sync::atomic::Ordering::Relaxed),
            reply.text()
        );
        singles += 1;
        let status = send(status(&sluice, "sk-poison", &id)).await.json();
        if status["state"] == "done" {
            break status;
        }
        assert!(started.elapsed() < Duration::from_secs(60), "{status}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(
        upstream.failed.load(std::sync::atomic::Ordering::Relaxed) >= 10 * 3,
        "each poison item was tried 3 times"
    );
    assert!(
        singles >= 5,
        "the single calls ran beside the batch: {singles}"
    );
    assert_eq!(
        (done["failed"].as_u64(), done["done"].as_u64()),
        (Some(10), Some(0)),
        "{done}"
    );
    for item in done["items"].as_array().expect("items") {
        assert_eq!(item["state"], "failed", "{item}");
        assert_eq!(item["status"], 500, "{item}");
        assert_eq!(item["result"]["error"], "this item always fails", "{item}");
    }
    // The lane's breaker never opened.
    let admin = send(
        Request::get(sluice.admin_url("/status"))
            .body(Full::new(Bytes::new()))
            .expect("request"),
    )
    .await
    .json();
    let lane = &admin["limiter"]["lanes"][0];
    assert_eq!(lane["breaker"], "closed", "{lane}");
    // A good batch meanwhile: each item names itself upstream.
    let reply = send(submit(&sluice, "sk-good", &json!({ "items": items(2) }))).await;
    let id = reply.json()["batch_id"].as_str().expect("id").to_owned();
    let done = until_done(&sluice, "sk-good", &id).await;
    for (i, item) in done["items"].as_array().expect("items").iter().enumerate() {
        assert_eq!(item["result"]["request_id"], format!("{id}/{i}"), "{item}");
        assert_eq!(
            item["result"]["idempotency_key"],
            format!("{id}/{i}"),
            "{item}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l4_two_batch_lanes_each_run_only_their_own_items_on_their_own_route() {
    let upstream = TestUpstream::start().await;
    let dir = DataDir::new();
    std::fs::create_dir_all(&dir.0).expect("dir");
    let policy = dir.0.join("policy.yaml");
    let yaml = sluice_policy::DEFAULT_POLICY_YAML.edit(
        "routes:\n",
        "  summarizer:
    workspace_in_flight: 3
    workspace_starts: 12
    starts_window_seconds: 60
    global_in_flight: 20
    batch_reserve: 5
    wait_seconds: 15
    jsonrpc_wait_seconds: 120
    max_waiting: 1000
    timeout_seconds: 180
    breaker: { failures: 5, within_seconds: 60, open_seconds: 30 }
    batch:
      route: /messages/summarize
      max_items: 1000
      backlog: 5000
      keep_hours: 168
routes:
  - { method: POST, path: /messages/summarize, class: expensive, lane: summarizer }
  - { method: POST, path: /messages/summarize/batch, class: expensive }
  - { method: GET, path: \"/messages/summarize/batches/{id}\", class: read }
",
    );
    std::fs::write(&policy, yaml).expect("policy");
    let sluice = Sluice::spawn(&[
        "--config",
        policy.to_str().expect("path"),
        "--upstream",
        &upstream.url,
    ]);
    let mut batches = Vec::new();
    for route in [
        "/messages/optimize",
        "/messages/summarize",
        "/messages/optimize",
        "/messages/summarize",
    ] {
        let reply = send(
            Request::post(sluice.url(&format!("{route}/batch")))
                .header("x-api-key", "sk-acme")
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from(
                    json!({ "items": items(5) }).to_string(),
                )))
                .expect("request"),
        )
        .await;
        assert_eq!(
            reply.status,
            StatusCode::ACCEPTED,
            "{route}: {}",
            reply.text()
        );
        batches.push((
            route,
            reply.json()["batch_id"].as_str().expect("id").to_owned(),
        ));
    }
    for (route, id) in &batches {
        let started = Instant::now();
        let done = loop {
            let reply = send(
                Request::get(sluice.url(&format!("{route}/batches/{id}")))
                    .header("x-api-key", "sk-acme")
                    .body(Full::new(Bytes::new()))
                    .expect("request"),
            )
            .await;
            assert_eq!(reply.status, StatusCode::OK, "{route}: {}", reply.text());
            let body = reply.json();
            if body["state"] == "done" || started.elapsed() > Duration::from_secs(30) {
                break body;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert_eq!(done["done"], 5, "{route}: {done}");
        for item in done["items"].as_array().expect("items") {
            assert_eq!(item["result"]["path"], *route, "{route}: {item}");
        }
        // The other lane does not know it.
        let other = if *route == "/messages/optimize" {
            "/messages/summarize"
        } else {
            "/messages/optimize"
        };
        let reply = send(
            Request::get(sluice.url(&format!("{other}/batches/{id}")))
                .header("x-api-key", "sk-acme")
                .body(Full::new(Bytes::new()))
                .expect("request"),
        )
        .await;
        assert_eq!(
            reply.status,
            StatusCode::NOT_FOUND,
            "{other}: {}",
            reply.text()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l4_oversized_and_deep_bodies_are_refused_as_on_mcp_and_key_order_is_not_a_new_body() {
    let sluice = Sluice::spawn(&["--demo-optimize-seconds", "0"]);
    // Over 1 MiB: 413, as a JSON-RPC body that large is.
    let big = json!({ "items": [{ "message": "x".repeat(1024 * 1024 + 16) }] });
    let reply = send(submit(&sluice, "sk-acme", &big)).await;
    assert_eq!(
        reply.status,
        StatusCode::PAYLOAD_TOO_LARGE,
        "{}",
        reply.text()
    );
    assert_eq!(reply.json()["error"]["code"], "payload_too_large");
    // Nested 200 deep: 400 naming the depth bound.
    let deep = format!(
        "{{\"items\":[{{\"message\":{}1{}}}]}}",
        "[".repeat(200),
        "]".repeat(200)
    );
    let reply = send(
        Request::post(sluice.url("/messages/optimize/batch"))
            .header("x-api-key", "sk-acme")
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(deep)))
            .expect("request"),
    )
    .await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{}", reply.text());
    assert_eq!(
        reply.json()["error"]["details"]["max_json_depth"],
        64,
        "{}",
        reply.text()
    );
    // The same JSON, keys in another order and spaced out: the same batch.
    let raw = |text: &'static str| {
        Request::post(sluice.url("/messages/optimize/batch"))
            .header("x-api-key", "sk-acme")
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(text.as_bytes())))
            .expect("request")
    };
    let a = send(raw(
        r#"{"items":[{"message":"a","tone":"dry"}],"idempotency_key":"k-order"}"#,
    ))
    .await;
    assert_eq!(a.status, StatusCode::ACCEPTED, "{}", a.text());
    let b = send(raw(
        "{ \"idempotency_key\" : \"k-order\",\n  \"items\" : [ { \"tone\" : \"dry\", \"message\" : \"a\" } ] }",
    ))
    .await;
    assert_eq!(b.status, StatusCode::ACCEPTED, "{}", b.text());
    assert_eq!(a.json()["batch_id"], b.json()["batch_id"]);
    let c = send(raw(
        r#"{"items":[{"message":"b","tone":"dry"}],"idempotency_key":"k-order"}"#,
    ))
    .await;
    assert_eq!(c.status, StatusCode::CONFLICT, "{}", c.text());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l4_past_the_queues_global_bound_or_the_addresss_share_a_submit_is_503_with_retry_after() {
    let sluice = Sluice::spawn(&[
        "--demo-optimize-seconds",
        "600",
        "--batch-max-queued-items",
        "16",
        "--batch-address-share",
        "2",
    ]);
    // Each unknown key is a workspace of its own, all from one address: the
    // address holds at most 8 unfinished items however many keys it uses.
    let reply = send(submit(&sluice, "sk-flood-1", &json!({ "items": items(8) }))).await;
    assert_eq!(reply.status, StatusCode::ACCEPTED, "{}", reply.text());
    let reply = send(submit(&sluice, "sk-flood-2", &json!({ "items": items(1) }))).await;
    assert_eq!(
        reply.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        reply.text()
    );
    assert_eq!(reply.header("retry-after"), Some("30"));
    let body = reply.json();
    assert_eq!(body["error"]["code"], "unavailable", "{body}");
    let details = &body["error"]["details"];
    assert_eq!(details["reason"], "batch_queue_full", "{body}");
    assert_eq!(details["bound"], "address_queued_items", "{body}");
    assert_eq!(
        (details["used"].as_u64(), details["limit"].as_u64()),
        (Some(8), Some(8))
    );
    // The refused batch's quota units were given back.
    assert_eq!(messages_used(&sluice, "sk-flood-2").await, 0);
}
