//! SPEC T5 with the official SDKs: the `openai` and `anthropic` Python SDKs (pinned,
//! from the package index, in a virtualenv this test makes under the target
//! directory and reuses) against `sluice serve`'s token routes in front of a
//! loopback provider: a refusal raises the SDK's own RateLimitError in its API's
//! words, and the SDK's own retry waits the Retry-After sluice gave.

#[path = "../../../tests/support/one_request.rs"]
mod one_request;

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use sluice_gateway::{Gateway, GatewayConfig, Upstream};
use tokio::io::AsyncWriteExt as _;
use tokio::net::TcpListener;

#[path = "../../../tests/support/python_venv.rs"]
mod python_venv;

/// The SDK versions this test pins (the current releases when written).
const SDKS: [(&str, &str); 2] = [("openai", "3.57.0"), ("anthropic", "2.17.0")];

/// Tokens a caller per 2 s: a few calls a window, so that a refusal's
/// Retry-After is a second or two.
const POLICY: &str = r#"
profile: default
window_seconds: 60
profiles:
  default:
    classes: { llm: 1000000 }
identity:
  credentials: [bearer, x_api_key]
tokens:
  team: { per: caller, limit: 300, window_seconds: 2 }
routes:
  - { method: POST, path: /v1/chat/completions, class: llm, llm: openai, tokens: [team] }
  - { method: POST, path: /v1/messages, class: llm, llm: anthropic, tokens: [team] }
  - { class: llm }
"#;

/// A provider answering chat completions and messages, each with its usage.
async fn provider() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            tokio::spawn(async move {
                let Some(got) = one_request::read_request(&mut conn).await else {
                    return;
                };
                let body = if String::from_utf8_lossy(&got).contains("POST /v1/messages") {
                    r#"{"id":"msg_1","type":"message","role":"assistant","model":"claude-sonnet-4-5","content":[{"type":"text","text":"Hi."}],"stop_reason":"end_turn","stop_sequence":null,"usage":{"input_tokens":12,"output_tokens":40}}"#
                } else {
                    r#"{"id":"c1","object":"chat.completion","created":1,"model":"gpt-4o","choices":[{"index":0,"message":{"role":"assistant","content":"Hi."},"finish_reason":"stop"}],"usage":{"prompt_tokens":12,"completion_tokens":40,"total_tokens":52}}"#
                };
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t5_the_official_sdks_raise_their_rate_limit_error_and_wait_sluices_retry_after() {
    let python = tokio::task::spawn_blocking(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("llm-sdk-venv");
        python_venv::venv(&dir, &SDKS)
    })
    .await
    .expect("the virtualenv");
    let up = provider().await;
    let policy = sluice_policy::parse_str(POLICY, Path::new("sdk.yaml")).expect("policy");
    let dir = std::env::temp_dir().join(format!("sluice-sdk-{}", fastrand::u64(..)));
    std::fs::create_dir_all(&dir).expect("data dir");
    let mut config = GatewayConfig::new(policy, dir.clone());
    config.workers = std::num::NonZeroUsize::new(1).expect("one");
    config.upstream = Some(Upstream::from_addr(up));
    let gateway = Gateway::start(config).await.expect("gateway starts");
    let base = format!("http://{}", gateway.addr().expect("an address"));
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/llm_sdk.py");
    let run =
        tokio::task::spawn_blocking(move || Command::new(python).arg(script).arg(base).output());
    let out = tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .expect("the SDKs finished in time")
        .expect("no panic")
        .expect("python ran");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    for line in [
        "openai RateLimitError ok",
        "anthropic RateLimitError ok",
        "openai retry waited",
        "anthropic retry waited",
    ] {
        assert!(stdout.contains(line), "{stdout}");
    }
    gateway.shutdown().await;
    let _ = std::fs::remove_dir_all(dir);
}
