//! SPEC T1, T3: a monthly token budget on the embedded store is durable: what
//! settled calls spent survives `kill -9` of the real binary, and a restart on
//! the same data dir goes on from it. A loopback upstream reports known usage.

use crate::support;

use crate::one_request;

use std::net::SocketAddr;

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use serde_json::json;
use support::{DataDir, Sluice, send};
use tokio::io::AsyncWriteExt as _;
use tokio::net::TcpListener;

/// A monthly budget of 100,000 weighed tokens per caller.
const POLICY: &str = r#"
profile: default
profiles:
  default:
    classes: { llm: 1000000 }
identity:
  credentials: [bearer]
tokens:
  month: { per: caller, limit: 100000, monthly: true, default_max_output: 100 }
routes:
  - { method: POST, path: /v1/chat/completions, class: llm, llm: openai, tokens: [month] }
  - { class: llm }
"#;

/// Units each call settles at: the upstream reports 20 input and 30 output.
const SETTLED: u32 = 50;

/// An upstream answering every request with a chat completion of known usage.
async fn upstream() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            tokio::spawn(async move {
                if one_request::read_request(&mut conn).await.is_none() {
                    return;
                }
                let body = r#"{"id":"c","usage":{"prompt_tokens":20,"completion_tokens":30}}"#;
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

/// One chat call as `sk-a`: the tokens its answer says are left.
async fn call(sluice: &Sluice) -> u32 {
    let body = json!({ "model": "gpt-4o", "max_tokens": 40,
                       "messages": [{ "role": "user", "content": "Say hi." }] });
    let request = Request::post(sluice.url("/v1/chat/completions"))
        .header("authorization", "Bearer sk-a")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .expect("request");
    let reply = send(request).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    reply
        .header("x-ratelimit-remaining-tokens")
        .and_then(|v| v.parse().ok())
        .expect("x-ratelimit-remaining-tokens")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t1_t3_a_monthly_token_budget_survives_kill_9() {
    let up = upstream().await;
    let data = DataDir::new();
    std::fs::create_dir_all(&data.0).expect("data dir");
    let policy = data.0.join("policy.yaml");
    std::fs::write(&policy, POLICY).expect("policy file");
    let upstream = format!("http://{up}");
    let args = [
        "--config",
        policy.to_str().expect("utf-8"),
        "--upstream",
        &upstream,
        "--data-dir",
        data.arg(),
    ];
    let mut sluice = Sluice::spawn(&args);
    // The first call's reservation, with nothing spent before it.
    let reserved = 100_000 - call(&sluice).await;
    for _ in 0..4 {
        call(&sluice).await;
    }
    // Five calls settled at 50 each; each answer ended after its settlement.
    sluice.kill();
    let sluice = Sluice::spawn(&args);
    assert_eq!(
        call(&sluice).await,
        100_000 - 5 * SETTLED - reserved,
        "what settled before kill -9 is still spent"
    );
}
