//! SPEC T1–T3, T5 over loopback: token budgets in front of a fake OpenAI- and
//! Anthropic-compatible upstream that reports known usage. A call reserves its
//! estimate before it is forwarded and settles at the upstream's `usage` (JSON
//! and server-sent events); an error before generation gives the reservation
//! back, a stream cut without usage keeps it; a call larger than the whole
//! budget is refused for good; a body that is not an LLM request is 400 and
//! sent nowhere; refusals and headers speak the API's dialect.

use crate::one_request;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use serde_json::{Value, json};
use sluice_gateway::{Gateway, GatewayConfig, Upstream};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};

/// Bound on every test's whole body.
const TEST_TIMEOUT: Duration = Duration::from_secs(60);

/// What the fake upstream reports for every call: 20 input tokens (5 of them
/// cached), 30 output tokens.
const USAGE: (u32, u32, u32) = (20, 5, 30);

/// A policy of one class with a token budget per workspace: 1,000 weighed
/// tokens an hour (long enough that no test straddles a window), cached input
/// at half weight, 100 output tokens reserved when a call names none.
const POLICY: &str = r#"
profile: default
window_seconds: 3600
profiles:
  default:
    classes: { llm: 1000000 }
identity:
  credentials: [bearer]
tokens:
  team:
    per: caller
    limit: 1000
    window_seconds: 3600
    weights: { input: 1, output: 1, cached_input: 0.5 }
    default_max_output: 100
routes:
  - { method: POST, path: /v1/chat/completions, class: llm, llm: openai, tokens: [team] }
  - { method: POST, path: /v1/messages, class: llm, llm: anthropic, tokens: [team] }
  - { class: llm }
"#;

/// How the fake upstream answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Reply {
    /// A JSON answer with `usage`.
    Json,
    /// A server-sent event stream whose last event holds `usage`.
    Stream,
    /// A 500 with no usage.
    Error,
    /// A stream cut before any usage.
    Cut,
    /// A JSON answer of 9 MiB (a batch of embeddings, say), its `usage` last.
    Large,
    /// A JSON answer whose `usage` counts its output alone.
    OutputOnly,
    /// A stream whose `usage` counts its output alone.
    OutputOnlyStream,
}

/// A fake LLM upstream: answers each request as `reply` says, and counts them.
async fn upstream(reply: Reply) -> (SocketAddr, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let seen = Arc::new(AtomicUsize::new(0));
    let count = Arc::clone(&seen);
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            let count = Arc::clone(&count);
            tokio::spawn(async move {
                let Some(got) = one_request::read_request(&mut conn).await else {
                    return;
                };
                count.fetch_add(1, Ordering::SeqCst);
                let request = String::from_utf8_lossy(&got);
                let anthropic = request.contains("POST /v1/messages");
                // As OpenAI: a stream reports its usage only when asked to.
                let asked = request.replace(' ', "").contains(r#""include_usage":true"#);
                let reply = if reply == Reply::Stream && !asked && !anthropic {
                    Reply::Cut
                } else {
                    reply
                };
                let _ = conn.write_all(answer(reply, anthropic).as_bytes()).await;
                let _ = conn.shutdown().await;
            });
        }
    });
    (addr, seen)
}

/// The fake upstream's answer.
fn answer(reply: Reply, anthropic: bool) -> String {
    let (input, cached, output) = USAGE;
    let usage = if anthropic {
        // Anthropic's input excludes cache reads.
        json!({ "input_tokens": input - cached, "cache_read_input_tokens": cached, "output_tokens": output })
    } else {
        json!({ "prompt_tokens": input, "completion_tokens": output,
                "prompt_tokens_details": { "cached_tokens": cached } })
    };
    match reply {
        Reply::Json => {
            let body = json!({ "id": "x", "usage": usage }).to_string();
            format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            )
        }
        Reply::Stream if anthropic => {
            // Anthropic's: the input in message_start, the output in message_delta.
            let start = json!({ "type": "message_start", "message": { "usage": {
                "input_tokens": input - cached, "cache_read_input_tokens": cached, "output_tokens": 1 } } });
            let delta = json!({ "type": "message_delta", "usage": { "output_tokens": output } });
            format!(
                "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\nevent: message_start\ndata: {start}\n\nevent: message_delta\ndata: {delta}\n\nevent: message_stop\ndata: {{\"type\":\"message_stop\"}}\n\n"
            )
        }
        Reply::Stream => {
            let first = json!({ "choices": [{ "delta": { "content": "hi" } }] });
            let last = json!({ "choices": [], "usage": usage });
            // With its length, as a server that answers a stream at once sends it.
            let body = format!("data: {first}\n\ndata: {last}\n\ndata: [DONE]\n\n");
            format!(
                "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            )
        }
        Reply::Large => {
            let data = "0.0123456789,".repeat((9 << 20) / 13);
            let body = format!(r#"{{"object":"list","data":[{data}0],"usage":{usage}}}"#);
            format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            )
        }
        Reply::OutputOnly => {
            let body = json!({ "id": "x", "usage": { "completion_tokens": output } }).to_string();
            format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            )
        }
        Reply::OutputOnlyStream => {
            let last = json!({ "choices": [], "usage": { "prompt_tokens": 0, "completion_tokens": output } });
            format!(
                "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\ndata: {last}\n\ndata: [DONE]\n\n"
            )
        }
        Reply::Error => {
            let body = r#"{"error":{"message":"overloaded"}}"#;
            format!(
                "HTTP/1.1 500 Internal Server Error\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            )
        }
        Reply::Cut => {
            let first = json!({ "choices": [{ "delta": { "content": "hi" } }] });
            format!(
                "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\ndata: {first}\n\n"
            )
        }
    }
}

/// A gateway with [`POLICY`] in front of `upstream`.
async fn start_gateway(upstream: SocketAddr) -> (Gateway, std::path::PathBuf) {
    let policy = sluice_policy::parse_str(POLICY, std::path::Path::new("tokens.yaml"))
        .expect("the test policy");
    let dir = std::env::temp_dir().join(format!(
        "sluice-tokens-{}-{}",
        std::process::id(),
        fastrand::u64(..)
    ));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let mut config = GatewayConfig::new(policy, dir.clone());
    config.workers = std::num::NonZeroUsize::new(1).expect("one");
    config.upstream = Some(Upstream::from_addr(upstream));
    (Gateway::start(config).await.expect("gateway starts"), dir)
}

/// One call: the status, the fields (lowercase) and the body.
async fn call(gateway: SocketAddr, path: &str, key: &str, body: &str) -> (u16, String, String) {
    let request = format!(
        "POST {path} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {key}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    send_raw(gateway, &request).await
}

/// `request` (whole, asking to close) sent as is: the answer's status, fields
/// (lowercase) and body.
async fn send_raw(gateway: SocketAddr, request: &str) -> (u16, String, String) {
    let mut conn = TcpStream::connect(gateway).await.expect("connect");
    conn.write_all(request.as_bytes()).await.expect("write");
    let mut got = Vec::new();
    let _ = conn.read_to_end(&mut got).await;
    let text = String::from_utf8_lossy(&got).into_owned();
    let status = text.get(9..12).and_then(|s| s.parse().ok()).unwrap_or(0);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    (status, head.to_ascii_lowercase(), body.to_owned())
}

/// The value of field `name` in `head`.
fn field<'h>(head: &'h str, name: &str) -> Option<&'h str> {
    head.lines()
        .find_map(|l| l.strip_prefix(&format!("{name}:")))
        .map(str::trim)
}

/// The budget's units left, as `GET`-less probing sees them: the remaining
/// tokens a fresh call's answer reports, minus what that call reserved.
fn remaining(head: &str) -> u32 {
    field(head, "x-ratelimit-remaining-tokens")
        .or_else(|| field(head, "anthropic-ratelimit-tokens-remaining"))
        .and_then(|v| v.parse().ok())
        .expect("a remaining-tokens field")
}

/// A chat call naming `max_tokens` (or not).
fn chat(max_tokens: Option<u32>, stream: bool) -> String {
    let mut body = json!({
        "model": "gpt-4o",
        "messages": [{ "role": "user", "content": "Say hi." }],
        "stream": stream,
    });
    if let Some(n) = max_tokens {
        body["max_tokens"] = json!(n);
    }
    body.to_string()
}

async fn bounded<F: Future>(test: F) -> F::Output {
    tokio::time::timeout(TEST_TIMEOUT, test)
        .await
        .expect("test timed out")
}

/// Units the fake upstream's usage weighs in the `team` budget: fresh input 15,
/// cached 5 at half weight (2.5), output 30: 47.5, rounded up.
fn settled_units() -> u32 {
    let (input, cached, output) = USAGE;
    ((input - cached) * 1000 + cached * 500 + output * 1000).div_ceil(1000)
}

/// Calls on `path` with `body` as `key` until one is refused: how many were
/// admitted, the remaining tokens each admitted answer reported, and the refusal.
async fn until_refused(
    addr: SocketAddr,
    path: &str,
    key: &str,
    body: &str,
) -> (u32, Vec<u32>, (u16, String, String)) {
    let mut remainings = Vec::new();
    for admitted in 0..200 {
        let (status, head, answer) = call(addr, path, key, body).await;
        if status != 200 {
            return (admitted, remainings, (status, head, answer));
        }
        remainings.push(remaining(&head));
    }
    panic!("never refused");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t2_t3_t5_reserved_before_settled_at_the_usage_and_refused_in_the_apis_dialect() {
    bounded(async {
        for (reply, path) in [
            (Reply::Json, "/v1/chat/completions"),
            (Reply::Stream, "/v1/chat/completions"),
            (Reply::Json, "/v1/messages"),
            (Reply::Stream, "/v1/messages"),
        ] {
            let (up, seen) = upstream(reply).await;
            let (gateway, dir) = start_gateway(up).await;
            let addr = gateway.addr().expect("an address");
            let anthropic = path == "/v1/messages";
            let body = if anthropic {
                json!({ "model": "claude-x", "max_tokens": 50,
                        "messages": [{ "role": "user", "content": "Say hi." }] })
                .to_string()
            } else {
                chat(Some(50), reply == Reply::Stream)
            };
            let (admitted, remainings, (status, head, refusal)) =
                until_refused(addr, path, "k1", &body).await;
            // Each answer tells the budget after its own reservation and every
            // earlier call's settlement: the first reserved R, each later one
            // sees the ones before settled at the usage.
            let reserved = 1000 - remainings[0];
            assert!(
                reserved > 50,
                "{reply:?}: the input is reserved too ({reserved})"
            );
            for (k, r) in remainings.iter().enumerate() {
                let k = u32::try_from(k).expect("few");
                assert_eq!(
                    *r,
                    1000 - k * settled_units() - reserved,
                    "{reply:?} call {k}"
                );
            }
            // As many calls as the settled usage allows, never more: the last
            // admitted left less than a reservation.
            assert_eq!(
                admitted,
                (1000 - reserved) / settled_units() + 1,
                "{reply:?}: {remainings:?}"
            );
            assert_eq!(
                seen.load(Ordering::SeqCst) as u32,
                admitted,
                "refused calls sent nowhere"
            );
            if reply == Reply::Stream && !anthropic {
                // sluice asked the stream for its usage (the settlement above is
                // exact); a client that did not ask does not see it, one that did
                // does.
                let key = "k2";
                let (status, head, answer) = call(addr, path, key, &body).await;
                assert_eq!(status, 200);
                if let Some(length) = field(&head, "content-length") {
                    assert_eq!(
                        length,
                        answer.len().to_string(),
                        "the length of what is sent"
                    );
                }
                assert!(answer.contains("\"content\":\"hi\""), "{answer}");
                assert!(answer.contains("[DONE]"), "{answer}");
                assert!(!answer.contains("usage"), "hidden: {answer}");
                let mut asking: Value = serde_json::from_str(&body).expect("JSON");
                asking["stream_options"] = json!({ "include_usage": true });
                let (_, _, answer) = call(addr, path, key, &asking.to_string()).await;
                assert!(answer.contains("\"usage\""), "asked for: {answer}");
            }
            // The refusal, in the API's dialect, with a Retry-After.
            assert_eq!(status, 429, "{refusal}");
            assert!(field(&head, "retry-after").is_some(), "{head}");
            let refusal: Value = serde_json::from_str(&refusal).expect("JSON");
            if anthropic {
                assert_eq!(refusal["type"], "error");
                assert_eq!(refusal["error"]["type"], "rate_limit_error");
                assert!(
                    field(&head, "anthropic-ratelimit-tokens-reset").is_some(),
                    "{head}"
                );
            } else {
                assert_eq!(refusal["error"]["code"], "rate_limit_exceeded");
                assert_eq!(refusal["error"]["type"], "tokens");
                let reset = field(&head, "x-ratelimit-reset-tokens").expect("a reset");
                assert!(reset.ends_with('s'), "OpenAI's duration form: {reset}");
            }
            gateway.shutdown().await;
            let _ = std::fs::remove_dir_all(dir);
        }
    })
    .await;
}

/// SPEC T2/T3: a stream however its body spells it (a key written with escapes,
/// `stream_options: null`) is asked for its usage and settles at it; a `stream`
/// a lax server reads as true but is not a boolean is refused 400 and sent nowhere.
/// Before, the first two went upstream unasked and were charged only their
/// reservation, whatever they spent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t2_t3_every_spelling_of_a_stream_settles_at_its_usage_or_is_refused() {
    bounded(async {
        let (up, seen) = upstream(Reply::Stream).await;
        let (gateway, dir) = start_gateway(up).await;
        let addr = gateway.addr().expect("an address");
        let plain = chat(Some(50), true);
        let spellings = [
            plain.replace(r#""stream":true"#, r#""str\u0065am":true"#),
            plain.replace(r#""stream":true"#, r#""stream":true,"stream_options":null"#),
        ];
        for (k, body) in spellings.iter().enumerate() {
            assert_ne!(body, &plain, "spelled otherwise");
            let key = format!("spelling-{k}");
            let (status, head, _) = call(addr, "/v1/chat/completions", &key, body).await;
            assert_eq!(status, 200, "{body}");
            let first = remaining(&head);
            let (status, head, answer) = call(addr, "/v1/chat/completions", &key, body).await;
            assert_eq!(status, 200, "{body}");
            assert!(!answer.contains("usage"), "hidden: {answer}");
            // The first call settled at its usage: the second sees the first's
            // settlement, not its reservation, below its own.
            assert_eq!(
                first - remaining(&head),
                settled_units(),
                "{body}: settled at the usage"
            );
        }
        let before = seen.load(Ordering::SeqCst);
        for stream in ["1", r#""true""#, r#"true,"stream_options":"x""#] {
            let body = plain.replace(r#""stream":true"#, &format!(r#""stream":{stream}"#));
            let (status, _, answer) = call(addr, "/v1/chat/completions", "lax", &body).await;
            assert_eq!(status, 400, "{body}: {answer}");
            let answer: Value = serde_json::from_str(&answer).expect("JSON");
            assert_eq!(
                answer["error"]["details"]["reason"], "bad_stream",
                "{answer}"
            );
        }
        assert_eq!(
            seen.load(Ordering::SeqCst),
            before,
            "refused calls sent nowhere"
        );
        gateway.shutdown().await;
        let _ = std::fs::remove_dir_all(dir);
    })
    .await;
}

/// SPEC T3, fail closed: an answer whose `usage` counts its output alone (no
/// input, or 0), as a JSON answer or a stream, has not said what the call spent,
/// and the call keeps its reservation. Before, the missing input was settled at
/// 0: the call was charged its output alone, less than it reserved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t3_a_usage_that_counts_no_input_keeps_the_reservation() {
    bounded(async {
        for (reply, stream) in [(Reply::OutputOnly, false), (Reply::OutputOnlyStream, true)] {
            let (up, _) = upstream(reply).await;
            let (gateway, dir) = start_gateway(up).await;
            let addr = gateway.addr().expect("an address");
            let body = chat(Some(50), stream);
            let (status, head, _) = call(addr, "/v1/chat/completions", "k", &body).await;
            assert_eq!(status, 200);
            let reserved = 1000 - remaining(&head);
            assert!(
                reserved > USAGE.2,
                "the reservation is above the output alone"
            );
            let (_, head, _) = call(addr, "/v1/chat/completions", "k", &body).await;
            assert_eq!(
                remaining(&head),
                1000 - 2 * reserved,
                "stream {stream}: the first kept its reservation"
            );
            gateway.shutdown().await;
            let _ = std::fs::remove_dir_all(dir);
        }
    })
    .await;
}

/// SPEC T3, bounded: a JSON answer is read for its usage as it passes, never
/// held whole, so one of any size settles at its usage (one past the 8 MiB a
/// connection once held was charged its reservation).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t3_a_json_answer_of_any_size_settles_at_its_usage() {
    bounded(async {
        let (up, _) = upstream(Reply::Large).await;
        let (gateway, dir) = start_gateway(up).await;
        let addr = gateway.addr().expect("an address");
        let body = chat(Some(50), false);
        let (status, head, answer) = call(addr, "/v1/chat/completions", "k1", &body).await;
        assert_eq!(status, 200);
        assert!(
            answer.len() > 9 << 20 && answer.ends_with("}}"),
            "passed whole"
        );
        let reserved = 1000 - remaining(&head);
        assert_ne!(reserved, settled_units());
        let (status, head, _) = call(addr, "/v1/chat/completions", "k1", &body).await;
        assert_eq!(status, 200);
        assert_eq!(
            remaining(&head),
            1000 - settled_units() - reserved,
            "the first call settled at its usage"
        );
        gateway.shutdown().await;
        let _ = std::fs::remove_dir_all(dir);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t2_t3_errors_refund_cut_streams_keep_the_reservation_and_bad_bodies_go_nowhere() {
    bounded(async {
        // An error before generation: every call's reservation given back.
        let (up, seen) = upstream(Reply::Error).await;
        let (gateway, dir) = start_gateway(up).await;
        let addr = gateway.addr().expect("an address");
        let mut first = None;
        for _ in 0..5 {
            let (status, head, _) =
                call(addr, "/v1/chat/completions", "k", &chat(Some(50), false)).await;
            assert_eq!(status, 500);
            let r = remaining(&head);
            assert_eq!(
                *first.get_or_insert(r),
                r,
                "refunded: each call sees the whole budget less its own"
            );
        }
        // A call larger than the whole budget: refused for good, no Retry-After.
        let (status, head, body) =
            call(addr, "/v1/chat/completions", "k", &chat(Some(5000), false)).await;
        assert_eq!(status, 429, "{body}");
        assert!(field(&head, "retry-after").is_none(), "{head}");
        // Bodies that are not an LLM request: 400 with the reason, sent nowhere.
        let before = seen.load(Ordering::SeqCst);
        for (body, reason) in [
            ("not json", "not_json"),
            ("[1]", "not_an_object"),
            (r#"{"model": 5, "messages": []}"#, "model_not_a_string"),
            (
                r#"{"model": "m", "max_tokens": -1, "messages": []}"#,
                "bad_max_tokens",
            ),
            (
                r#"{"model": "m", "max_tokens": 1e30, "messages": []}"#,
                "bad_max_tokens",
            ),
            (r#"{"model": "m"}"#, "no_input"),
            // A key named twice: readers differ on which value counts (SPEC E5).
            (
                r#"{"model": "m", "max_tokens": 10, "max_tokens": 900, "messages": []}"#,
                "duplicate_key",
            ),
        ] {
            let (status, _, answer) = call(addr, "/v1/chat/completions", "k", body).await;
            assert_eq!(status, 400, "{body}: {answer}");
            let answer: Value = serde_json::from_str(&answer).expect("JSON");
            assert_eq!(answer["error"]["details"]["reason"], reason, "{body}");
        }
        assert_eq!(
            seen.load(Ordering::SeqCst),
            before,
            "nothing forwarded uncounted"
        );
        gateway.shutdown().await;
        let _ = std::fs::remove_dir_all(dir);

        // A stream cut before its usage: each call keeps its reservation.
        let (up, _) = upstream(Reply::Cut).await;
        let (gateway, dir) = start_gateway(up).await;
        let addr = gateway.addr().expect("an address");
        let (_, head, _) = call(addr, "/v1/chat/completions", "k", &chat(Some(50), true)).await;
        let reserved = 1000 - remaining(&head);
        let (_, head, _) = call(addr, "/v1/chat/completions", "k", &chat(Some(50), true)).await;
        assert_eq!(
            remaining(&head),
            1000 - 2 * reserved,
            "the first kept its reservation"
        );
        gateway.shutdown().await;
        let _ = std::fs::remove_dir_all(dir);
    })
    .await;
}

/// SPEC T4: a money budget of one cent a month per caller at gpt-4o's price.
const MONEY_POLICY: &str = r#"
profile: default
window_seconds: 3600
profiles:
  default:
    classes: { llm: 1000000 }
identity:
  credentials: [bearer]
prices:
  - { model: "gpt-4o*", input: 2.5, output: 10, cached_input: 1.25 }
spend:
  cents: { per: caller, limit_usd: 0.01, monthly: true }
routes:
  - { method: POST, path: /v1/chat/completions, class: llm, llm: openai, spend: [cents] }
  - { class: llm }
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t4_money_is_reserved_at_the_price_settled_to_the_thousandth_of_a_cent_and_refused_as_quota()
 {
    bounded(async {
        let (up, seen) = upstream(Reply::Json).await;
        let policy = sluice_policy::parse_str(MONEY_POLICY, std::path::Path::new("money.yaml"))
            .expect("the money policy");
        let dir = std::env::temp_dir().join(format!("sluice-money-{}", fastrand::u64(..)));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let mut config = GatewayConfig::new(policy, dir.clone());
        config.workers = std::num::NonZeroUsize::new(1).expect("one");
        config.upstream = Some(Upstream::from_addr(up));
        let gateway = Gateway::start(config).await.expect("gateway starts");
        let addr = gateway.addr().expect("an address");
        // In hundred-thousandths of a dollar: 15 fresh input tokens at 2.50 USD a
        // million, 5 cached at 1.25, 30 output at 10: 34.375, rounded up.
        let settled = 35;
        let mut remainings = Vec::new();
        let refusal = loop {
            let (status, head, body) =
                call(addr, "/v1/chat/completions", "k", &chat(Some(50), false)).await;
            if status != 200 {
                break (status, head, body);
            }
            let left: u32 = field(&head, "x-ratelimit-remaining")
                .and_then(|v| v.parse().ok())
                .expect("x-ratelimit-remaining");
            remainings.push(left);
            assert!(remainings.len() < 100, "never refused");
        };
        // One cent is 1,000 units; each answer tells them after its reservation.
        let reserved = 1000 - remainings[0];
        for (k, left) in remainings.iter().enumerate() {
            let k = u32::try_from(k).expect("few");
            assert_eq!(
                *left,
                1000 - k * settled - reserved,
                "call {k}: to the thousandth of a cent"
            );
        }
        assert_eq!(
            seen.load(Ordering::SeqCst),
            remainings.len(),
            "refused calls sent nowhere"
        );
        let (status, head, body) = refusal;
        assert_eq!(status, 429, "{body}");
        let body: Value = serde_json::from_str(&body).expect("JSON");
        assert_eq!(body["error"]["code"], "insufficient_quota", "{body}");
        assert!(
            field(&head, "retry-after").is_none(),
            "no wait helps before the month turns: {head}"
        );
        // SPEC T6: what the workspace spent this month, exactly what settled.
        use sha2::Digest as _;
        let label: String = sha2::Sha256::digest(b"k")
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let usage = admin_get(
            gateway.admin_addr(),
            &format!("/usage?workspace=key:{label}"),
        )
        .await;
        let calls = u64::try_from(remainings.len()).expect("few");
        let (input, cached, output) = USAGE;
        assert_eq!(
            usage["tokens"]["input"],
            calls * u64::from(input - cached),
            "{usage}"
        );
        assert_eq!(usage["tokens"]["cached_input"], calls * u64::from(cached));
        assert_eq!(usage["tokens"]["output"], calls * u64::from(output));
        let spend = usage["spend_usd"].as_f64().expect("spend_usd");
        assert!(
            (spend - calls as f64 * 0.00035).abs() < 1e-9,
            "to the thousandth of a cent: {usage}"
        );
        assert_eq!(
            usage["by_model"]["gpt-4o*"]["output"],
            calls * u64::from(output)
        );
        let other = admin_get(
            gateway.admin_addr(),
            &format!("/usage?workspace=key:{label}&month=1999-01"),
        )
        .await;
        assert_eq!(other["error"]["code"], "invalid_request", "{other}");
        // A query string the API cannot read is the same JSON envelope, never
        // plain text, on each route that reads one.
        for path in [
            "/usage?workspace=a&workspace=b",
            "/usage/export?month=1&month=2",
            "/quotas?workspace=a&workspace=b",
            "/runs?near=x",
        ] {
            let refused = admin_get(gateway.admin_addr(), path).await;
            assert_eq!(
                refused["error"]["code"], "invalid_request",
                "{path}: {refused}"
            );
        }
        // A model with no price: refused, sent nowhere.
        let before = seen.load(Ordering::SeqCst);
        let unpriced = json!({ "model": "llama-3", "max_tokens": 5,
                               "messages": [{ "role": "user", "content": "hi" }] })
        .to_string();
        let (status, _, body) = call(addr, "/v1/chat/completions", "k2", &unpriced).await;
        assert_eq!(status, 400, "{body}");
        let body: Value = serde_json::from_str(&body).expect("JSON");
        assert_eq!(body["error"]["details"]["reason"], "unpriced_model");
        assert_eq!(seen.load(Ordering::SeqCst), before);
        gateway.shutdown().await;
        let _ = std::fs::remove_dir_all(dir);
    })
    .await;
}

/// `GET path` on the admin listener at `admin`: its JSON body.
async fn admin_get(admin: SocketAddr, path: &str) -> Value {
    let mut conn = TcpStream::connect(admin).await.expect("connect");
    let request = format!("GET {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n");
    conn.write_all(request.as_bytes()).await.expect("write");
    let mut got = Vec::new();
    let _ = conn.read_to_end(&mut got).await;
    let text = String::from_utf8_lossy(&got).into_owned();
    let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    serde_json::from_str(body).unwrap_or_else(|_| Value::String(text.clone()))
}

/// The workspace label of an unknown credential `key`: `key:<its SHA-256 in hex>`.
fn own_workspace(key: &str) -> String {
    use sha2::Digest as _;
    let hex: String = sha2::Sha256::digest(key.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("key:{hex}")
}

/// A gateway with [`MONEY_POLICY`] in front of `upstream` on data dir `dir`, its
/// clock shifted to read `at` (Unix seconds) now.
async fn gateway_at(upstream: SocketAddr, dir: &std::path::Path, at: i64) -> Gateway {
    let policy = sluice_policy::parse_str(MONEY_POLICY, std::path::Path::new("money.yaml"))
        .expect("the money policy");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_secs();
    let mut config = GatewayConfig::new(policy, dir.to_owned());
    config.workers = std::num::NonZeroUsize::new(1).expect("one");
    config.upstream = Some(Upstream::from_addr(upstream));
    config.clock_offset = at - i64::try_from(now).expect("in range");
    // The last gateway on `dir` has shut down, and its worker threads may still be
    // letting go of the data dir's file: its lock is waited for (5 s at most).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        match Gateway::start(config.clone()).await {
            Ok(gateway) => return gateway,
            Err(sluice_gateway::StartError::DataDir(sluice_store::OpenError::Locked {
                ..
            })) if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("gateway starts: {e:?}"),
        }
    }
}

/// SPEC T6: `GET /usage?month=` answers past months. Calls in January 2031, a
/// restart on the same data dir with the clock in February, calls there; then
/// both months read back exactly, the current month without `month`, and a
/// malformed, future or no longer kept month is 400 in the error envelope.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t6_usage_of_a_past_month_survives_the_turn_and_a_restart() {
    bounded(async {
        let (up, _) = upstream(Reply::Json).await;
        let dir = std::env::temp_dir().join(format!("sluice-t6-{}", fastrand::u64(..)));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let workspace = own_workspace("t6");
        // 2031-01-15T12:00:00Z: two calls.
        let january = gateway_at(up, &dir, 1_926_244_800).await;
        let addr = january.addr().expect("an address");
        for _ in 0..2 {
            let (status, _, body) =
                call(addr, "/v1/chat/completions", "t6", &chat(Some(50), false)).await;
            assert_eq!(status, 200, "{body}");
        }
        january.shutdown().await;
        // 2031-02-15T12:00:00Z, same data dir: three calls.
        let february = gateway_at(up, &dir, 1_928_923_200).await;
        let addr = february.addr().expect("an address");
        for _ in 0..3 {
            let (status, _, body) =
                call(addr, "/v1/chat/completions", "t6", &chat(Some(50), false)).await;
            assert_eq!(status, 200, "{body}");
        }
        let admin = february.admin_addr();
        let (input, cached, output) = USAGE;
        for (month, calls) in [("2031-01", 2u64), ("2031-02", 3)] {
            let usage = admin_get(
                admin,
                &format!("/usage?workspace={workspace}&month={month}"),
            )
            .await;
            assert_eq!(usage["month"], month, "{usage}");
            assert_eq!(
                usage["tokens"]["input"],
                calls * u64::from(input - cached),
                "{usage}"
            );
            assert_eq!(
                usage["tokens"]["cached_input"],
                calls * u64::from(cached),
                "{usage}"
            );
            assert_eq!(
                usage["tokens"]["output"],
                calls * u64::from(output),
                "{usage}"
            );
            assert_eq!(
                usage["by_model"]["gpt-4o*"]["input"],
                calls * u64::from(input - cached)
            );
            let spend = usage["spend_usd"].as_f64().expect("spend_usd");
            assert!((spend - calls as f64 * 0.00035).abs() < 1e-12, "{usage}");
        }
        let current = admin_get(admin, &format!("/usage?workspace={workspace}")).await;
        assert_eq!(current["month"], "2031-02", "{current}");
        assert_eq!(current["tokens"]["output"], 3 * u64::from(output));
        // A year before February 2031 is still kept (nothing in it); one more is not.
        let kept = admin_get(
            admin,
            &format!("/usage?workspace={workspace}&month=2030-02"),
        )
        .await;
        assert_eq!(kept["tokens"]["output"], 0, "{kept}");
        for month in [
            "2031-13", "abc", "2031-1", "", "2031-03", "2030-01", "1969-12",
        ] {
            let refused = admin_get(
                admin,
                &format!("/usage?workspace={workspace}&month={month}"),
            )
            .await;
            assert_eq!(
                refused["error"]["code"], "invalid_request",
                "{month}: {refused}"
            );
        }
        february.shutdown().await;
        let _ = std::fs::remove_dir_all(dir);
    })
    .await;
}

/// How the framing test's upstream delimits its stream.
#[derive(Clone, Copy, Debug)]
enum Framing {
    Length,
    Chunked,
    UntilClose,
}

/// An OpenAI stream whose usage-only chunk is split across many writes (and, for
/// a chunked body, across chunks), framed as `framing` says; the connection is
/// kept for the next request but for [`Framing::UntilClose`].
async fn split_stream_upstream(framing: Framing) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            tokio::spawn(async move {
                while let Some(got) = one_request::read_request(&mut conn).await {
                    let request = String::from_utf8_lossy(&got);
                    assert!(
                        request.replace(' ', "").contains(r#""include_usage":true"#),
                        "sluice asks for the usage: {request}"
                    );
                    let body = split_stream_body();
                    let head = match framing {
                        Framing::Length => format!(
                            "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: {}\r\n\r\n",
                            body.len()
                        ),
                        Framing::Chunked => "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n".to_owned(),
                        Framing::UntilClose => "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n".to_owned(),
                    };
                    let mut wire = head.into_bytes();
                    match framing {
                        Framing::Chunked => {
                            for piece in body.as_bytes().chunks(5) {
                                wire.extend_from_slice(format!("{:x}\r\n", piece.len()).as_bytes());
                                wire.extend_from_slice(piece);
                                wire.extend_from_slice(b"\r\n");
                            }
                            wire.extend_from_slice(b"0\r\n\r\n");
                        }
                        Framing::Length | Framing::UntilClose => {
                            wire.extend_from_slice(body.as_bytes());
                        }
                    }
                    for piece in wire.chunks(7) {
                        if conn.write_all(piece).await.is_err() {
                            return;
                        }
                        let _ = conn.flush().await;
                        tokio::task::yield_now().await;
                    }
                    if matches!(framing, Framing::UntilClose) {
                        let _ = conn.shutdown().await;
                        return;
                    }
                }
            });
        }
    });
    addr
}

/// The split stream's events: content, the usage-only chunk, `[DONE]`.
fn split_stream_body() -> String {
    let (input, cached, output) = USAGE;
    let usage = json!({ "prompt_tokens": input, "completion_tokens": output,
                        "prompt_tokens_details": { "cached_tokens": cached } });
    let first = json!({ "choices": [{ "delta": { "content": "hi" } }] });
    let last = json!({ "choices": [], "usage": usage });
    format!("data: {first}\n\ndata: {last}\n\ndata: [DONE]\n\n")
}

/// One response read from a kept-alive `conn`: its head (lowercase) and its body,
/// decoded from chunks when it is chunked.
async fn read_response(conn: &mut TcpStream, buf: &mut Vec<u8>) -> (String, Vec<u8>) {
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let n = conn.read(&mut chunk).await.expect("read");
        assert!(n > 0, "the head ends");
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
    buf.drain(..head_end);
    assert!(
        field(&head, "transfer-encoding") == Some("chunked"),
        "a stream changed on its way is chunked: {head}"
    );
    let mut body = Vec::new();
    loop {
        // A size line, then its data.
        let line_end = loop {
            if let Some(i) = buf.windows(2).position(|w| w == b"\r\n") {
                break i;
            }
            let n = conn.read(&mut chunk).await.expect("read");
            assert!(n > 0, "the body ends");
            buf.extend_from_slice(&chunk[..n]);
        };
        let size = usize::from_str_radix(&String::from_utf8_lossy(&buf[..line_end]), 16)
            .expect("a chunk size");
        while buf.len() < line_end + 2 + size + 2 {
            let n = conn.read(&mut chunk).await.expect("read");
            assert!(n > 0, "the chunk ends");
            buf.extend_from_slice(&chunk[..n]);
        }
        body.extend_from_slice(&buf[line_end + 2..line_end + 2 + size]);
        buf.drain(..line_end + 2 + size + 2);
        if size == 0 {
            return (head, body);
        }
    }
}

/// SPEC T3 on the gateway's fast path: a stream's usage-only chunk split across
/// TCP segments (and chunks) is read whole and settles the call exactly, and the
/// client, which did not ask for it, gets every other event and not that one,
/// on a connection it keeps — whether the upstream frames the stream by its
/// length, in chunks, or by closing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t3_a_split_usage_chunk_settles_exactly_and_is_hidden_on_every_framing() {
    bounded(async {
        let expected = split_stream_body().replace(
            &format!(
                "data: {}\n\n",
                json!({ "choices": [], "usage": { "prompt_tokens": USAGE.0,
                    "completion_tokens": USAGE.2,
                    "prompt_tokens_details": { "cached_tokens": USAGE.1 } } })
            ),
            "",
        );
        for framing in [Framing::Length, Framing::Chunked, Framing::UntilClose] {
            let up = split_stream_upstream(framing).await;
            let (gateway, dir) = start_gateway(up).await;
            let addr = gateway.addr().expect("an address");
            let mut conn = TcpStream::connect(addr).await.expect("connect");
            let body = chat(Some(50), true);
            let mut buf = Vec::new();
            let mut remainings = Vec::new();
            for _ in 0..3 {
                let request = format!(
                    "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer split\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                );
                conn.write_all(request.as_bytes()).await.expect("write");
                let (head, answer) = read_response(&mut conn, &mut buf).await;
                assert!(head.starts_with("http/1.1 200"), "{framing:?}: {head}");
                assert_eq!(
                    String::from_utf8_lossy(&answer),
                    expected,
                    "{framing:?}: every event but the usage-only chunk"
                );
                remainings.push(remaining(&head));
            }
            // Each call sees the ones before settled at the usage, exactly.
            let reserved = 1000 - remainings[0];
            for (k, r) in remainings.iter().enumerate() {
                let k = u32::try_from(k).expect("few");
                assert_eq!(*r, 1000 - k * settled_units() - reserved, "{framing:?}");
            }
            gateway.shutdown().await;
            let _ = std::fs::remove_dir_all(dir);
        }
    })
    .await;
}

/// A fake upstream that keeps each request head it reads (lowercase) and
/// answers a JSON body with the usage.
async fn recording_upstream() -> (SocketAddr, Arc<std::sync::Mutex<Vec<String>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let heads = Arc::new(std::sync::Mutex::new(Vec::new()));
    let kept = Arc::clone(&heads);
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            let kept = Arc::clone(&kept);
            tokio::spawn(async move {
                let Some(got) = one_request::read_request(&mut conn).await else {
                    return;
                };
                let text = String::from_utf8_lossy(&got).to_ascii_lowercase();
                let head = text.split("\r\n\r\n").next().unwrap_or_default().to_owned();
                kept.lock().expect("heads").push(head);
                let _ = conn.write_all(answer(Reply::Json, false).as_bytes()).await;
                let _ = conn.shutdown().await;
            });
        }
    });
    (addr, heads)
}

/// SPEC T3: an LLM call's answer is read for its usage as it passes, so sluice
/// asks the upstream for it uncompressed (`Accept-Encoding: identity` in place
/// of the client's `gzip, br`, which official SDKs send): a compressed answer's
/// usage could not be read, and the call would be charged its reservation
/// however much it spent. On the fast path (a body of known length) and on the
/// service stack (a chunked body) alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t3_an_llm_call_asks_the_upstream_for_an_answer_it_can_read() {
    bounded(async {
        let (up, heads) = recording_upstream().await;
        let (gateway, dir) = start_gateway(up).await;
        let addr = gateway.addr().expect("gateway addr");
        let body = chat(Some(50), false);
        let requests = [
            format!(
                "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer sk-enc\r\naccept-encoding: gzip, br\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            ),
            format!(
                "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer sk-enc\r\naccept-encoding: gzip, br\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n{:x}\r\n{body}\r\n0\r\n\r\n",
                body.len()
            ),
        ];
        for request in &requests {
            let (status, head, _) = send_raw(addr, request).await;
            assert_eq!(status, 200, "{head}");
        }
        // A plain route keeps what the client accepts.
        send_raw(addr, "GET /other HTTP/1.1\r\nhost: x\r\nauthorization: Bearer sk-enc\r\naccept-encoding: gzip\r\nconnection: close\r\n\r\n").await;
        let heads = heads.lock().expect("heads").clone();
        assert_eq!(heads.len(), 3, "{heads:?}");
        for head in &heads[..2] {
            let encodings: Vec<&str> = head
                .lines()
                .filter_map(|l| l.strip_prefix("accept-encoding:"))
                .map(str::trim)
                .collect();
            assert_eq!(encodings, ["identity"], "{head}");
        }
        assert!(heads[2].contains("accept-encoding: gzip"), "{}", heads[2]);
        gateway.shutdown().await;
        let _ = std::fs::remove_dir_all(dir);
    })
    .await;
}

/// One call with a chunked body (the service stack takes it): status and head.
async fn call_chunked(gateway: SocketAddr, key: &str, body: &str) -> (u16, String) {
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {key}\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n{:x}\r\n{body}\r\n0\r\n\r\n",
        body.len()
    );
    let (status, head, _) = send_raw(gateway, &request).await;
    (status, head)
}

/// SPEC T3 when the upstream gives no answer: a call that never reached it
/// (nothing listens) gives its reservation back; one it took and then dropped
/// without a response head may have been generated, so its reservation stands,
/// on the fast path and on the service stack alike (sluice's own 502 is no
/// error the upstream answered before generating).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t3_an_unreachable_upstream_refunds_one_that_took_the_call_does_not() {
    bounded(async {
        let body = chat(Some(50), false);
        // Nothing listens here.
        let closed = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let nowhere = closed.local_addr().expect("addr");
        drop(closed);
        let (gateway, dir) = start_gateway(nowhere).await;
        let addr = gateway.addr().expect("gateway addr");
        let (status, first, _) = call(addr, "/v1/chat/completions", "sk-gone", &body).await;
        assert_eq!(status, 502);
        let (status, second, _) = call(addr, "/v1/chat/completions", "sk-gone", &body).await;
        assert_eq!(status, 502);
        assert_eq!(
            remaining(&second),
            remaining(&first),
            "the first call's reservation came back"
        );
        gateway.shutdown().await;
        let _ = std::fs::remove_dir_all(dir);

        // This one reads the call and hangs up without a word.
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let mute = listener.local_addr().expect("addr");
        tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let _ = one_request::read_request(&mut conn).await;
                });
            }
        });
        let (gateway, dir) = start_gateway(mute).await;
        let addr = gateway.addr().expect("gateway addr");
        let (status, first, _) = call(addr, "/v1/chat/completions", "sk-mute", &body).await;
        assert_eq!(status, 502);
        let (status, second, _) = call(addr, "/v1/chat/completions", "sk-mute", &body).await;
        assert_eq!(status, 502);
        let reserved = remaining(&first) - remaining(&second);
        assert!(
            reserved > 50,
            "the first call's reservation stands: {reserved}"
        );
        let (status, third) = call_chunked(addr, "sk-mute", &body).await;
        assert_eq!(status, 502, "{third}");
        let (status, fourth) = call_chunked(addr, "sk-mute", &body).await;
        assert_eq!(status, 502, "{fourth}");
        assert_eq!(
            remaining(&third) - remaining(&fourth),
            reserved,
            "on the service stack too"
        );
        gateway.shutdown().await;
        let _ = std::fs::remove_dir_all(dir);
    })
    .await;
}

/// SPEC T3: an HTTP/2 client that cancels its LLM call (RST_STREAM) after the call
/// reached the upstream and before the answer's head leaves it settled at its
/// reservation, counted in `/usage` as the HTTP/1.1 path counts a client that
/// hangs up. Before, the dropped call was never settled: its reservation stayed
/// spent, but `/usage`, the usage export and the settlement metrics never saw it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t3_an_http2_call_its_client_cancels_is_settled_at_its_reservation() {
    bounded(async {
        // An upstream that takes the call and never answers.
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let up = listener.local_addr().expect("addr");
        let (took, mut taken) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                let took = took.clone();
                tokio::spawn(async move {
                    if one_request::read_request(&mut conn).await.is_some() {
                        let _ = took.send(());
                    }
                    let mut rest = Vec::new();
                    let _ = conn.read_to_end(&mut rest).await;
                });
            }
        });
        let (gateway, dir) = start_gateway(up).await;
        let addr = gateway.addr().expect("an address");
        let key = "h2-cancel";
        let tcp = TcpStream::connect(addr).await.expect("connect");
        let (client, connection) = h2::client::handshake(tcp).await.expect("h2");
        tokio::spawn(connection);
        let mut client = client.ready().await.expect("ready");
        let request = http::Request::post(format!("http://{addr}/v1/chat/completions"))
            .header("authorization", format!("Bearer {key}"))
            .header("content-type", "application/json")
            .body(())
            .expect("request");
        let (answer, mut body) = client.send_request(request, false).expect("sent");
        body.send_data(chat(Some(50), false).into(), true)
            .expect("body");
        taken.recv().await.expect("the upstream took the call");
        body.send_reset(h2::Reason::CANCEL);
        drop(answer);

        let workspace = own_workspace(key);
        let usage = loop {
            let usage = admin_get(
                gateway.admin_addr(),
                &format!("/usage?workspace={workspace}"),
            )
            .await;
            if usage["tokens"]["output"] != 0 {
                break usage;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        assert_eq!(usage["tokens"]["output"], 50, "its reservation: {usage}");
        assert!(
            usage["tokens"]["input"].as_u64().is_some_and(|n| n > 0),
            "{usage}"
        );
        gateway.shutdown().await;
        let _ = std::fs::remove_dir_all(dir);
    })
    .await;
}
