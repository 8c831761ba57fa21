//! SPEC T5 and T7 with the official SDKs: the `openai` and `anthropic` Python SDKs
//! (pinned, from the package index, in a virtualenv this test makes under the
//! target directory and reuses) against `sluice serve`'s LLM routes in front of a
//! loopback provider: a token refusal raises the SDK's own RateLimitError in its
//! API's words, and the SDK's own retry waits the Retry-After sluice gave; a run
//! whose turns are spent raises the SDK's ConflictError with the pause's body,
//! not retried, and goes on once its owner grants more turns.

use crate::one_request;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use sluice_gateway::{Gateway, GatewayConfig, Upstream};
use tokio::io::AsyncWriteExt as _;
use tokio::net::TcpListener;

use crate::python_venv;

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

/// A provider answering chat completions and messages, each with its usage;
/// and the number of requests it answered.
async fn provider() -> (SocketAddr, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let answered = Arc::new(AtomicUsize::new(0));
    let count = Arc::clone(&answered);
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            let count = Arc::clone(&count);
            tokio::spawn(async move {
                let Some(got) = one_request::read_request(&mut conn).await else {
                    return;
                };
                count.fetch_add(1, Ordering::SeqCst);
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
    (addr, answered)
}

/// The virtualenv's `python` with [`SDKS`]: made once, for the tests of this
/// file one after the other.
async fn sdk_python() -> PathBuf {
    static MADE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    tokio::task::spawn_blocking(|| {
        let _one = MADE
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("llm-sdk-venv");
        python_venv::venv(&dir, &SDKS)
    })
    .await
    .expect("the virtualenv")
}

/// A gateway (one worker) on `policy` in front of `up`: it, its URL, and its
/// data directory.
async fn gateway(policy: &str, up: SocketAddr) -> (Gateway, String, PathBuf) {
    let policy = sluice_policy::parse_str(policy, Path::new("sdk.yaml")).expect("policy");
    let dir = std::env::temp_dir().join(format!("sluice-sdk-{}", fastrand::u64(..)));
    std::fs::create_dir_all(&dir).expect("data dir");
    let mut config = GatewayConfig::new(policy, dir.clone());
    config.workers = std::num::NonZeroUsize::new(1).expect("one");
    config.upstream = Some(Upstream::from_addr(up));
    let gateway = Gateway::start(config).await.expect("gateway starts");
    let base = format!("http://{}", gateway.addr().expect("an address"));
    (gateway, base, dir)
}

/// `python tests/python/<script> <args>`, within two minutes.
async fn run_script(python: PathBuf, script: &str, args: Vec<String>) -> Output {
    let script = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/python")
        .join(script);
    let run =
        tokio::task::spawn_blocking(move || Command::new(python).arg(script).args(args).output());
    tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .expect("the SDKs finished in time")
        .expect("no panic")
        .expect("python ran")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t5_the_official_sdks_raise_their_rate_limit_error_and_wait_sluices_retry_after() {
    let python = sdk_python().await;
    let (up, _) = provider().await;
    let (gateway, base, dir) = gateway(POLICY, up).await;
    let out = run_script(python, "llm_sdk.py", vec![base]).await;
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

/// An `llm: openai` route and runs of two turns at `quick`.
const TURNS_POLICY: &str = r#"
profile: default
window_seconds: 60
profiles:
  default:
    classes: { llm: 1000000 }
identity:
  credentials: [bearer]
turns:
  tiers: { quick: 2 }
routes:
  - { method: POST, path: /v1/chat/completions, class: llm, llm: openai }
  - { class: llm }
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t7_the_openai_sdk_raises_the_pause_as_an_api_error_with_its_body() {
    let python = sdk_python().await;
    let (up, forwarded) = provider().await;
    let (gateway, base, dir) = gateway(TURNS_POLICY, up).await;
    let out = run_script(python, "turns_sdk.py", vec![base, "sk-run".into()]).await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    let got: serde_json::Value = serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("{e}: stdout:\n{stdout}\nstderr:\n{stderr}"));
    // Two turns, then the pause: the SDK's ConflictError (409), not a rate limit.
    assert_eq!(got["successes"], 2, "{got:#}");
    let error = &got["error"];
    assert_eq!(error["class"], "ConflictError", "{got:#}");
    assert_eq!(error["conflict"], true, "{got:#}");
    assert_eq!(error["rate_limit"], false, "{got:#}");
    assert_eq!(error["status"], 409, "{got:#}");
    assert!(error["retry_after"].is_null(), "no Retry-After: {got:#}");
    // The SDK did not retry the pause: three requests reached sluice, two the
    // provider.
    assert_eq!(got["attempts"], 3, "the SDK retried the pause: {got:#}");
    // Its parsed body is the envelope's `error` object, intact.
    let body = &error["body"];
    assert_eq!(error["code"], "turn_budget_exhausted", "{got:#}");
    assert_eq!(body["code"], "turn_budget_exhausted", "{got:#}");
    assert_eq!(body["type"], "turn_budget_exhausted", "{got:#}");
    let details = &body["details"];
    assert_eq!(details["question"], "continue_or_finish", "{got:#}");
    assert_eq!(details["run"], "r1", "{got:#}");
    assert_eq!(details["turns_used"], 2, "{got:#}");
    assert_eq!(details["turns_granted"], 2, "{got:#}");
    assert_eq!(details["continue_url"], "/runs/r1/continue", "{got:#}");
    assert_eq!(details["finish_url"], "/runs/r1/finish", "{got:#}");
    assert_eq!(
        got["state_paused"][1],
        serde_json::json!({"run": "r1", "state": "paused", "turns_used": 2, "turns_granted": 2, "turns_left": 0}),
        "{got:#}"
    );
    // One more turn granted: the SDK's next call goes through.
    assert_eq!(got["continue"][0], 200, "{got:#}");
    assert_eq!(got["continue"][1]["turns_left"], 1, "{got:#}");
    assert_eq!(got["after_continue"], "Hi.", "{got:#}");
    assert_eq!(
        got["state_after"][1],
        serde_json::json!({"run": "r1", "state": "paused", "turns_used": 3, "turns_granted": 3, "turns_left": 0}),
        "{got:#}"
    );
    assert_eq!(
        forwarded.load(Ordering::SeqCst),
        3,
        "the provider saw the three turns taken, no pause"
    );
    gateway.shutdown().await;
    let _ = std::fs::remove_dir_all(dir);
}
