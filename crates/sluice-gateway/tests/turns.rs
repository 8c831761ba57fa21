//! SPEC T7 over loopback: a gateway in front of a fake OpenAI-compatible
//! upstream and an MCP endpoint. A run's turns are counted on both request
//! paths (the fast path serves the MCP route, the service stack the LLM route
//! and the run endpoints); a paused call is answered 409 and never reaches the
//! upstream; its owner's grant over HTTP lets the run go on.

use crate::one_request;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use serde_json::{Value, json};
use sluice_gateway::{Gateway, GatewayConfig, Upstream};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};

const TEST_TIMEOUT: Duration = Duration::from_secs(60);

const POLICY: &str = r#"
profile: default
window_seconds: 3600
profiles:
  default:
    classes: { llm: 1000000, plain: 1000000 }
identity:
  credentials: [bearer]
turns:
  tiers: { quick: 2 }
routes:
  - { method: POST, path: /v1/chat/completions, class: llm, llm: openai }
  - { method: POST, path: /mcp, jsonrpc: true }
  - { class: plain }
jsonrpc:
  default_class: llm
"#;

/// A fake upstream answering every request 200 with a chat completion's usage,
/// counting them.
async fn upstream() -> (SocketAddr, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let seen = Arc::new(AtomicUsize::new(0));
    let count = Arc::clone(&seen);
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            let count = Arc::clone(&count);
            tokio::spawn(async move {
                if one_request::read_request(&mut conn).await.is_none() {
                    return;
                }
                count.fetch_add(1, Ordering::SeqCst);
                let body = json!({ "id": "x", "result": {},
                    "usage": { "prompt_tokens": 5, "completion_tokens": 5 } })
                .to_string();
                let answer = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = conn.write_all(answer.as_bytes()).await;
                let _ = conn.shutdown().await;
            });
        }
    });
    (addr, seen)
}

/// One request: its status and JSON body.
async fn send(
    gateway: SocketAddr,
    (method, path): (&str, &str),
    headers: &str,
    body: &str,
) -> (u16, Value) {
    let mut conn = TcpStream::connect(gateway).await.expect("connect");
    let request = format!(
        "{method} {path} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer ada\r\n{headers}content-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    conn.write_all(request.as_bytes()).await.expect("write");
    let mut got = Vec::new();
    let _ = conn.read_to_end(&mut got).await;
    let text = String::from_utf8_lossy(&got).into_owned();
    let status = text.get(9..12).and_then(|s| s.parse().ok()).unwrap_or(0);
    let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    (status, serde_json::from_str(body).unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t7_a_paused_run_is_never_forwarded_and_a_grant_over_http_lets_it_go_on() {
    tokio::time::timeout(TEST_TIMEOUT, async {
        let (up, seen) = upstream().await;
        let policy = sluice_policy::parse_str(POLICY, std::path::Path::new("turns.yaml"))
            .expect("the test policy");
        let dir = std::env::temp_dir().join(format!(
            "sluice-turns-{}-{}",
            std::process::id(),
            fastrand::u64(..)
        ));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let mut config = GatewayConfig::new(policy, dir.clone());
        config.workers = std::num::NonZeroUsize::new(1).expect("one");
        config.upstream = Some(Upstream::from_addr(up));
        let gateway = Gateway::start(config).await.expect("gateway starts");
        let addr = gateway.addr().expect("an address");

        let chat = json!({ "model": "gpt-4o", "messages": [{ "role": "user", "content": "hi" }] })
            .to_string();
        let run = "x-sluice-run: loop-1\r\nx-sluice-depth: quick\r\n";
        let llm = ("POST", "/v1/chat/completions");
        assert_eq!(send(addr, llm, run, &chat).await.0, 200);
        assert_eq!(send(addr, llm, run, &chat).await.0, 200);
        let (status, body) = send(addr, llm, run, &chat).await;
        assert_eq!(status, 409, "{body}");
        assert_eq!(body["error"]["details"]["question"], "continue_or_finish");
        assert_eq!(
            seen.load(Ordering::SeqCst),
            2,
            "the paused call never reached the upstream"
        );

        // The owner's grant, over HTTP/1.1 (the fast path hands it over).
        let (status, state) = send(
            addr,
            ("POST", "/runs/loop-1/continue"),
            "",
            r#"{"turns":1}"#,
        )
        .await;
        assert_eq!(
            (status, state["turns_granted"].as_u64()),
            (200, Some(3)),
            "{state}"
        );
        assert_eq!(send(addr, llm, run, &chat).await.0, 200);
        assert_eq!(send(addr, llm, run, &chat).await.0, 409);
        let (status, state) = send(addr, ("GET", "/runs/loop-1"), "", "").await;
        assert_eq!(
            (status, state["state"].as_str()),
            (200, Some("paused")),
            "{state}"
        );
        assert_eq!(seen.load(Ordering::SeqCst), 3);

        // MCP tool calls on the fast path: the same run rule, a JSON-RPC pause.
        let call = json!({ "jsonrpc": "2.0", "id": 1, "method": "tools/call",
            "params": { "name": "search", "arguments": {} } })
        .to_string();
        let mcp = ("POST", "/mcp");
        let run = "x-sluice-run: mcp-1\r\nx-sluice-depth: quick\r\n";
        assert_eq!(send(addr, mcp, run, &call).await.0, 200);
        assert_eq!(send(addr, mcp, run, &call).await.0, 200);
        let (status, body) = send(addr, mcp, run, &call).await;
        assert_eq!(status, 409, "{body}");
        assert_eq!(
            body["error"]["data"]["question"], "continue_or_finish",
            "{body}"
        );
        assert_eq!(seen.load(Ordering::SeqCst), 5);
        // A route with no token budget does not estimate tokens, yet reads its body
        // as its format says: one that does not read is 400 and sent nowhere.
        let (status, body) = send(addr, llm, "", "not json").await;
        assert_eq!(
            (status, body["error"]["details"]["reason"].as_str()),
            (400, Some("not_json")),
            "{body}"
        );
        assert_eq!(seen.load(Ordering::SeqCst), 5);
        // A run header on a route whose calls are no turns: 400, not forwarded.
        let (status, body) = send(addr, ("POST", "/other"), "x-sluice-run: r\r\n", "{}").await;
        assert_eq!(
            (status, body["error"]["details"]["reason"].as_str()),
            (400, Some("run_not_supported"))
        );
        assert_eq!(seen.load(Ordering::SeqCst), 5);
        drop(gateway);
        let _ = std::fs::remove_dir_all(dir);
    })
    .await
    .expect("test timed out");
}
