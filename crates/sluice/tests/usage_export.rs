//! SPEC O4: `GET /usage/export?month=YYYY-MM` on the admin listener of real
//! `sluice serve` processes: two replicas on one Redis export the same lines,
//! whose sums are exactly what the budgets counted (`/usage`, `/quotas`, the
//! calls answered); on the embedded store the lines survive `kill -9`. A
//! loopback upstream reports known usage.

use crate::support;

use crate::one_request;

use std::collections::BTreeMap;
use std::net::SocketAddr;

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use serde_json::{Value, json};
use support::redis::RedisServer;
use support::{DataDir, Sluice, get, send, sha256_hex};
use tokio::io::AsyncWriteExt as _;
use tokio::net::TcpListener;

/// An LLM route with two priced families spending an uncapped monthly quota,
/// and a plain route spending a capped one.
const POLICY: &str = r#"
profile: default
profiles:
  default:
    classes: { llm: 1000000, plain: 1000000 }
identity:
  credentials: [bearer]
quotas:
  completions: {}
  messages: { monthly: 1000 }
tokens:
  month: { per: caller, limit: 1000000, monthly: true, default_max_output: 100 }
prices:
  - { model: "gpt-4o*", input: 2.5, output: 10, cached_input: 1.25 }
  - { model: "claude*", input: 3, output: 15, cached_input: 0.3 }
routes:
  - { method: POST, path: /v1/chat/completions, class: llm, llm: openai, tokens: [month], quota: completions }
  - { method: POST, path: /messages, class: plain, quota: messages }
  - { class: plain }
# With Redis: a loaded test machine may take longer than the default 20 ms.
store:
  timeout_ms: 2000
"#;

/// An upstream answering every request with a chat completion of known usage:
/// 20 input tokens (5 of them cached) and 30 output.
async fn upstream() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            tokio::spawn(async move {
                if one_request::read_request(&mut conn).await.is_none() {
                    return;
                }
                let body = r#"{"id":"c","usage":{"prompt_tokens":20,"completion_tokens":30,"prompt_tokens_details":{"cached_tokens":5}}}"#;
                let answer = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = conn.write_all(answer.as_bytes()).await;
            });
        }
    });
    addr
}

/// One chat call of `model` as `key`, answered 200.
async fn chat(sluice: &Sluice, key: &str, model: &str) {
    let body = json!({ "model": model, "max_tokens": 40,
                       "messages": [{ "role": "user", "content": "Say hi." }] });
    let reply = send(
        Request::post(sluice.url("/v1/chat/completions"))
            .header("authorization", format!("Bearer {key}"))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.to_string())))
            .expect("request"),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
}

/// One `POST /messages` as `key`, answered 200.
async fn message(sluice: &Sluice, key: &str) {
    let reply = send(
        Request::post(sluice.url("/messages"))
            .header("authorization", format!("Bearer {key}"))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(b"{}")))
            .expect("request"),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
}

/// The export of `month` (`None`: the current one) from `sluice`'s admin
/// listener, its lines sorted.
async fn export(sluice: &Sluice, month: Option<&str>) -> Vec<Value> {
    let query = month.map_or_else(String::new, |m| format!("?month={m}"));
    let reply = get(&sluice.admin_url(&format!("/usage/export{query}"))).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(reply.header("content-type"), Some("application/x-ndjson"));
    let mut lines: Vec<Value> = reply
        .text()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    lines.sort_by_key(Value::to_string);
    lines
}

/// The workspace of an unknown credential.
fn workspace(key: &str) -> String {
    format!("key:{}", sha256_hex(key))
}

/// Each workspace's sums over `lines`: calls, quota units (completions,
/// messages), tokens (input, cached, output) and money units.
fn sums(lines: &[Value]) -> BTreeMap<String, [u64; 7]> {
    let mut by_workspace: BTreeMap<String, [u64; 7]> = BTreeMap::new();
    for l in lines {
        let n = |v: &Value| v.as_u64().unwrap_or(0);
        let s = by_workspace
            .entry(l["workspace"].as_str().expect("a workspace").to_owned())
            .or_default();
        s[0] += n(&l["calls"]);
        s[1] += n(&l["quota_units"]["completions"]);
        s[2] += n(&l["quota_units"]["messages"]);
        s[3] += n(&l["tokens"]["input"]);
        s[4] += n(&l["tokens"]["cached_input"]);
        s[5] += n(&l["tokens"]["output"]);
        s[6] += n(&l["spend_units"]);
    }
    by_workspace
}

/// What the budgets counted for `key`'s workspace in `month`, read from
/// `sluice`'s `/quotas` and `/usage`, with `calls` the calls answered.
async fn counted(sluice: &Sluice, key: &str, month: &str, calls: u64) -> [u64; 7] {
    let w = workspace(key);
    let quotas = get(&sluice.admin_url(&format!("/quotas?workspace={w}")))
        .await
        .json();
    let quota = |f: &str| {
        quotas["quotas"]
            .as_array()
            .and_then(|q| q.iter().find(|q| q["family"] == f))
            .and_then(|q| q["usage"].as_u64())
            .unwrap_or(0)
    };
    let usage = get(&sluice.admin_url(&format!("/usage?workspace={w}&month={month}")))
        .await
        .json();
    let n = |v: &Value| v.as_u64().unwrap_or(0);
    [
        calls,
        quota("completions"),
        quota("messages"),
        n(&usage["tokens"]["input"]),
        n(&usage["tokens"]["cached_input"]),
        n(&usage["tokens"]["output"]),
        (usage["spend_usd"].as_f64().unwrap_or(0.0) * 100_000.0).round() as u64,
    ]
}

/// The current month (UTC) on this machine's clock, as `YYYY-MM`.
fn this_month() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    sluice_edge::UsageMonth::of(sluice_core::Timestamp::from_secs(secs)).to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn o4_two_replicas_on_one_redis_export_the_same_lines_summing_to_the_budgets() {
    let redis = RedisServer::start("o4-replicas");
    let up = format!("http://{}", upstream().await);
    let data = DataDir::new();
    std::fs::create_dir_all(&data.0).expect("data dir");
    let policy = data.0.join("policy.yaml");
    std::fs::write(&policy, POLICY).expect("policy file");
    let url = redis.url();
    let args = [
        "--config",
        policy.to_str().expect("utf-8"),
        "--upstream",
        &up,
        "--store",
        &url,
    ];
    let replicas = [Sluice::spawn(&args), Sluice::spawn(&args)];
    let month = this_month();
    // Calls spread over both replicas: chats of two families and an unpriced
    // model, and plain messages.
    for i in 0..6 {
        chat(&replicas[i % 2], "sk-a", "gpt-4o-mini").await;
    }
    for i in 0..3 {
        chat(&replicas[i % 2], "sk-b", "claude-sonnet-4").await;
    }
    chat(&replicas[1], "sk-b", "mystery").await;
    for i in 0..4 {
        message(&replicas[i % 2], "sk-a").await;
    }
    message(&replicas[0], "sk-b").await;
    let lines = export(&replicas[0], Some(&month)).await;
    if this_month() != month {
        // The month turned while the calls ran: their rows are split across two
        // months, as they should be; the sums below assume one.
        return;
    }
    // Every replica answers the same lines: the counts live in Redis.
    assert_eq!(export(&replicas[1], Some(&month)).await, lines);
    assert_eq!(export(&replicas[1], None).await, lines);
    let sums = sums(&lines);
    assert_eq!(sums.len(), 2, "{lines:?}");
    for sluice in &replicas {
        assert_eq!(
            sums[&workspace("sk-a")],
            counted(sluice, "sk-a", &month, 10).await
        );
        assert_eq!(
            sums[&workspace("sk-b")],
            counted(sluice, "sk-b", &month, 5).await
        );
    }
    // What the upstream reported, exactly: 10 chats of 15 + 5 cached input and
    // 30 output; sk-a's 6 gpt-4o* chats at 35 money units each.
    assert_eq!(sums[&workspace("sk-a")][5], 6 * 30);
    assert_eq!(sums[&workspace("sk-b")][3], 4 * 15);
    assert_eq!(sums[&workspace("sk-a")][6], 6 * 35);
    let models: Vec<&Value> = lines
        .iter()
        .filter(|l| l["workspace"] == workspace("sk-b"))
        .map(|l| &l["model"])
        .collect();
    assert_eq!(
        models.len(),
        3,
        "claude*, other and messages' null: {lines:?}"
    );
    // Bad input: a month that does not read is 400, naming the form expected.
    for bad in ["2026-13", "2026-1", "june", "2026-06-01"] {
        let reply = get(&replicas[0].admin_url(&format!("/usage/export?month={bad}"))).await;
        assert_eq!(reply.status, 400, "{bad}: {}", reply.text());
        assert!(reply.text().contains("YYYY-MM"), "{}", reply.text());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn o4_export_lines_on_the_embedded_store_survive_kill_9() {
    let up = format!("http://{}", upstream().await);
    let data = DataDir::new();
    std::fs::create_dir_all(&data.0).expect("data dir");
    let policy = data.0.join("policy.yaml");
    std::fs::write(&policy, POLICY).expect("policy file");
    let args = [
        "--config",
        policy.to_str().expect("utf-8"),
        "--upstream",
        &up,
        "--data-dir",
        data.arg(),
    ];
    let mut sluice = Sluice::spawn(&args);
    let month = this_month();
    for _ in 0..3 {
        chat(&sluice, "sk-a", "gpt-4o").await;
    }
    chat(&sluice, "sk-a", "claude-haiku").await;
    message(&sluice, "sk-a").await;
    message(&sluice, "sk-b").await;
    let before = export(&sluice, Some(&month)).await;
    let sums_before = sums(&before);
    assert_eq!(
        sums_before[&workspace("sk-a")],
        counted(&sluice, "sk-a", &month, 5).await
    );
    assert_eq!(sums_before[&workspace("sk-b")][2], 1, "{before:?}");
    // Each answer ended after its counts were durable: kill -9 loses none.
    sluice.kill();
    let sluice = Sluice::spawn(&args);
    assert_eq!(export(&sluice, Some(&month)).await, before);
    // And counting goes on from there.
    message(&sluice, "sk-b").await;
    if this_month() == month {
        let after = sums(&export(&sluice, Some(&month)).await);
        assert_eq!(after[&workspace("sk-b")][2], 2);
    }
}
