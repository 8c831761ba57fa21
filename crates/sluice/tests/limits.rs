//! The limiter inside the real `sluice serve` process and `sluice check`.
//!
//! The process runs on the real clock, so these tests use the default policy
//! with `window_seconds` set to the largest value (a window that started at
//! the Unix epoch and ends in 2106): no run can straddle a window boundary.

use crate::edit;
use edit::Edit as _;

use crate::support;

use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use support::{Sluice, get, run_to_exit, send};

const FOREVER: &str = "window_seconds: 4294967295";

fn policy_file(name: &str, edit: impl FnOnce(String) -> String) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("sluice-limits-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join(name);
    let yaml = edit(sluice_policy::DEFAULT_POLICY_YAML.edit(
        "window_seconds: 60\nprofiles",
        &format!("{FOREVER}\nprofiles"),
    ));
    std::fs::write(&path, yaml).expect("write policy");
    path
}

async fn post(sluice: &Sluice, path: &str, key: &str) -> support::Reply {
    send(
        Request::post(sluice.url(path))
            .header("x-api-key", key)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(b"{}")))
            .expect("request"),
    )
    .await
}

/// Each connection is served by one of the gateway's worker threads (round robin);
/// the budgets are one set for all of them: 40 concurrent calls on 40 connections
/// spread over 3 workers admit exactly 30 and hand out every remaining count once.
#[tokio::test]
async fn e1_gateway_workers_share_one_set_of_budgets() {
    let policy = policy_file("workers.yaml", |y| y);
    let sluice = Sluice::spawn(&[
        "--config",
        policy.to_str().expect("utf-8 path"),
        "--workers",
        "3",
    ]);
    let calls: Vec<_> = (0..40)
        .map(|_| {
            let url = sluice.url("/chats");
            tokio::spawn(async move {
                send(
                    Request::post(url)
                        .header("x-api-key", "sk-workers")
                        .header("content-type", "application/json")
                        .body(Full::new(Bytes::from_static(b"{}")))
                        .expect("request"),
                )
                .await
            })
        })
        .collect();
    let mut remaining = Vec::new();
    let mut refused = 0;
    for call in calls {
        let r = call.await.expect("call task");
        match r.status.as_u16() {
            200 => remaining.push(
                r.header("x-ratelimit-remaining")
                    .and_then(|v| v.parse::<u32>().ok())
                    .expect("remaining header"),
            ),
            429 => refused += 1,
            other => panic!("unexpected status {other}: {}", r.text()),
        }
    }
    remaining.sort_unstable();
    assert_eq!(remaining, (0..30).collect::<Vec<u32>>());
    assert_eq!(refused, 10);
}

#[tokio::test]
async fn e1_h2_the_31st_expensive_call_through_the_gateway_is_refused() {
    let policy = policy_file("forever.yaml", |y| y);
    let sluice = Sluice::spawn(&["--config", policy.to_str().expect("utf-8 path")]);
    for i in 0..30 {
        let r = post(&sluice, "/chats", "sk-gateway").await;
        assert_eq!(r.status, 200, "chat {i}: {}", r.text());
        assert_eq!(r.header("x-ratelimit-limit"), Some("30"));
        assert_eq!(
            r.header("x-ratelimit-remaining"),
            Some((29 - i).to_string().as_str())
        );
        assert_eq!(r.header("x-ratelimit-reset"), Some("4294967295"));
    }
    let r = post(&sluice, "/chats", "sk-gateway").await;
    assert_eq!(r.status, 429);
    assert_eq!(r.header("content-type"), Some("text/html; charset=utf-8"));
    assert_eq!(r.text(), "Too many requests, please try again later.");
    assert!(
        r.header("retry-after")
            .and_then(|v| v.parse::<u64>().ok())
            .is_some_and(|s| s >= 1)
    );
    // The upstream never saw the refused call, and /status shows the caller's spend.
    let status = get(&sluice.admin_url("/status")).await.json();
    let limiter = &status["limiter"];
    assert_eq!(limiter["classes"]["expensive"], 30);
    assert_eq!(limiter["top_callers"][0]["units"], 30);
    assert!(
        limiter["top_callers"][0]["caller"]
            .as_str()
            .is_some_and(|c| c.starts_with("key:"))
    );
    let metrics = get(&sluice.admin_url("/metrics")).await.text();
    assert!(metrics.contains("sluice_decisions_total"), "{metrics}");
    assert!(metrics.contains("sluice_refusals_total"), "{metrics}");
    assert!(
        metrics.contains("sluice_decision_seconds_bucket{le="),
        "{metrics}"
    );
}

#[tokio::test]
async fn e1_profile_local_through_the_gateway() {
    let policy = policy_file("local.yaml", |y| y);
    let sluice = Sluice::spawn(&[
        "--config",
        policy.to_str().expect("utf-8 path"),
        "--profile",
        "local",
    ]);
    let r = post(&sluice, "/chats", "sk-local").await;
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-ratelimit-limit"), Some("150"));
    let r = get(&sluice.url("/search/fields")).await;
    assert_eq!(r.header("x-ratelimit-limit"), Some("1500"));
}

#[test]
fn check_prints_the_resolved_policy_or_every_problem_with_exit_2() {
    let example = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/policy.yaml");
    let ok = run_to_exit(&["check", example], Duration::from_secs(30));
    assert!(ok.status.success(), "{}", ok.stderr);
    let bad = policy_file("bad.yaml", |y| {
        y.edit("expensive: 30 }", "expensive: 0 }").edit(
            "class: expensive }\n  - { method: POST, path: \"/routines",
            "class: costly }\n  - { method: POST, path: \"/routines",
        )
    });
    let failed = run_to_exit(
        &["check", bad.to_str().expect("utf-8 path")],
        Duration::from_secs(30),
    );
    assert_eq!(failed.status.code(), Some(2), "{}", failed.stderr);
    assert!(
        failed
            .stderr
            .contains("profiles.production.classes.expensive"),
        "{}",
        failed.stderr
    );
    assert!(
        failed
            .stderr
            .contains("routes[3].class: unknown class \"costly\""),
        "{}",
        failed.stderr
    );
    let typo = policy_file("typo.yaml", |y| {
        y.edit(
            "default_class: standard\njsonrpc",
            "default_klass: standard\njsonrpc",
        )
    });
    let failed = run_to_exit(
        &["check", typo.to_str().expect("utf-8 path")],
        Duration::from_secs(30),
    );
    assert_eq!(failed.status.code(), Some(2));
    assert!(
        failed.stderr.contains("unknown field `default_klass`"),
        "{}",
        failed.stderr
    );
    assert!(failed.stderr.contains("line "), "{}", failed.stderr);
    let serve_bad = run_to_exit(
        &["serve", "--config", bad.to_str().expect("utf-8 path")],
        Duration::from_secs(30),
    );
    assert_eq!(
        serve_bad.status.code(),
        Some(2),
        "a bad policy stops serve before it listens"
    );
}

/// Sends `request` on a new connection and reads the answer to its close: the status
/// code, the fields (names lower-cased) and the body.
async fn raw_exchange(
    sluice: &Sluice,
    request: &str,
) -> (u16, std::collections::BTreeMap<String, String>, String) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut stream = tokio::net::TcpStream::connect(sluice.start.gateway)
        .await
        .expect("connect");
    stream.write_all(request.as_bytes()).await.expect("write");
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).await.expect("read");
    let answer = String::from_utf8(answer).expect("utf-8 answer");
    let (head, body) = answer.split_once("\r\n\r\n").expect("a head");
    let mut lines = head.lines();
    let status = lines.next().expect("status line")[9..12]
        .parse()
        .expect("status");
    let fields = lines
        .filter_map(|l| l.split_once(": "))
        .map(|(n, v)| (n.to_ascii_lowercase(), v.to_owned()))
        .collect();
    (status, fields, body.to_owned())
}

/// The gateway answers plain HTTP/1.1 on its own fast path and hands HTTP/1.0 to hyper
/// and the service stack: a refusal reads the same either way (H1, H2).
#[tokio::test]
async fn h1_h2_a_refusal_reads_the_same_on_both_http1_paths() {
    let policy = policy_file("forever-parity.yaml", |y| y);
    let sluice = Sluice::spawn(&["--config", policy.to_str().expect("utf-8 path")]);
    for i in 0..30 {
        let r = post(&sluice, "/chats", "sk-parity").await;
        assert_eq!(r.status, 200, "chat {i}: {}", r.text());
    }
    let refused = |version: &str| {
        format!(
            "POST /chats {version}\r\nhost: x\r\nx-api-key: sk-parity\r\ncontent-type: application/json\r\n\
             content-length: 2\r\nconnection: close\r\n\r\n{{}}"
        )
    };
    let (fast_status, fast, fast_body) = raw_exchange(&sluice, &refused("HTTP/1.1")).await;
    let (hyper_status, hyper, hyper_body) = raw_exchange(&sluice, &refused("HTTP/1.0")).await;
    assert_eq!((fast_status, hyper_status), (429, 429));
    assert_eq!(fast_body, hyper_body);
    assert_eq!(fast_body, "Too many requests, please try again later.");
    // The same fields (bar how each version says it closes), the same values but the
    // clock's.
    let names = |fields: &std::collections::BTreeMap<String, String>| {
        fields
            .keys()
            .filter(|n| *n != "connection")
            .cloned()
            .collect::<Vec<_>>()
    };
    assert_eq!(names(&fast), names(&hyper), "{fast:?} vs {hyper:?}");
    for name in [
        "content-type",
        "content-length",
        "x-ratelimit-limit",
        "x-ratelimit-remaining",
        "x-ratelimit-reset",
    ] {
        assert_eq!(fast.get(name), hyper.get(name), "{name}");
    }
    assert!(fast.contains_key("retry-after") && fast.contains_key("date"));
}

/// A refused request whose body arrives after its head: the body is read and dropped
/// with the refusal, and the connection goes on to serve the next request (H2).
#[tokio::test]
async fn h2_a_refused_upload_leaves_its_connection_open() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let policy = policy_file("forever-kept.yaml", |y| y);
    let sluice = Sluice::spawn(&["--config", policy.to_str().expect("utf-8 path")]);
    for i in 0..30 {
        let r = post(&sluice, "/chats", "sk-kept").await;
        assert_eq!(r.status, 200, "chat {i}: {}", r.text());
    }
    let (first, rest) = ("{\"prompt\":", "\"a later piece\"}");
    let mut stream = tokio::net::TcpStream::connect(sluice.start.gateway)
        .await
        .expect("connect");
    let head = format!(
        "POST /chats HTTP/1.1\r\nhost: x\r\nx-api-key: sk-kept\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n{first}",
        first.len() + rest.len()
    );
    stream.write_all(head.as_bytes()).await.expect("write");
    stream.flush().await.expect("flush");
    tokio::task::yield_now().await;
    let next = format!("{rest}GET /things/1 HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n");
    stream.write_all(next.as_bytes()).await.expect("write");
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).await.expect("read");
    let answer = String::from_utf8(answer).expect("utf-8 answer");
    let refused_at = answer.find("HTTP/1.1 429 ").expect("a refusal");
    let served_at = answer
        .find("HTTP/1.1 200 OK\r\n")
        .expect("the next request served");
    assert!(refused_at == 0 && served_at > refused_at, "{answer}");
    assert!(
        !answer[..served_at].contains("connection: close"),
        "{answer}"
    );
}

/// Sends one GET on `stream` and reads until the end of the head; true for a 200.
fn get_ok(stream: &mut std::net::TcpStream) -> bool {
    use std::io::{Read as _, Write as _};
    if stream
        .write_all(b"GET /search/fields HTTP/1.1\r\nhost: x\r\n\r\n")
        .is_err()
    {
        return false;
    }
    let mut buf = [0u8; 4096];
    let mut seen = Vec::new();
    while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => return false,
            Ok(n) => seen.extend_from_slice(&buf[..n]),
        }
    }
    seen.starts_with(b"HTTP/1.1 200 ")
}

#[test]
fn one_address_holds_at_most_its_connections_and_a_closed_one_frees_a_place() {
    use std::io::Read as _;
    let sluice = Sluice::spawn(&["--max-connections-per-ip", "3"]);
    let connect = || {
        let s = std::net::TcpStream::connect(sluice.start.gateway).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        s
    };
    let mut held: Vec<_> = (0..3).map(|_| connect()).collect();
    for s in &mut held {
        assert!(get_ok(s), "the first three connections are served");
    }
    // The fourth is closed at once, before a request is read.
    let mut fourth = connect();
    let mut buf = [0u8; 64];
    let n = fourth.read(&mut buf).unwrap_or(0);
    assert_eq!(n, 0, "closed without an answer");
    // The three still work; one closing frees a place (bounded retries: the slot is
    // given back when the gateway sees the close).
    assert!(get_ok(&mut held[0]));
    drop(held.pop());
    let served = (0..200).any(|_| {
        let mut s = connect();
        let ok = get_ok(&mut s);
        if !ok {
            std::thread::sleep(Duration::from_millis(10));
        }
        ok
    });
    assert!(served, "a place came free");
}

#[test]
fn max_connections_past_the_open_file_limit_is_lowered_with_a_warning() {
    use std::io::{BufRead as _, BufReader};
    let dir = support::DataDir::new();
    // A hard limit of 200 descriptors cannot hold 10,000 connections (three each).
    let mut child = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!(
            "ulimit -n 200 && exec {} serve --listen 127.0.0.1:0 --admin 127.0.0.1:0 --data-dir {} --max-connections 10000",
            env!("CARGO_BIN_EXE_sluice"),
            dir.arg()
        ))
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn");
    let stderr = child.stderr.take().expect("stderr");
    let stdout = child.stdout.take().expect("stdout");
    // stderr is read to its end in the background: a closed pipe would stop sluice.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let started = BufReader::new(stdout).lines().next().and_then(Result::ok);
    let warning = std::iter::from_fn(|| rx.recv_timeout(Duration::from_secs(10)).ok())
        .take(20)
        .find(|l| l.contains("--max-connections"));
    let _ = child.kill();
    let _ = child.wait();
    let warning = warning.expect("a warning about the open-file limit");
    assert!(
        warning.contains("the limit is 200") && warning.contains("serving at most 24 connections"),
        "{warning}"
    );
    assert!(
        started.is_some_and(|l| l.starts_with("sluice: listening on")),
        "it still starts"
    );
}

/// P5: `sluice serve --dry-run` forwards past every limit, over HTTP/1.1 (the fast
/// path) and HTTP/2 (the hyper path) alike, and counts each refusal it did not give
/// in `/metrics` and on the dashboard; X-RateLimit-* still describe the budget.
#[tokio::test]
async fn p5_serve_dry_run_forwards_past_the_limit_on_both_paths_and_counts_each_would_be_refusal() {
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;

    let policy = policy_file("dry-run.yaml", |y| y);
    let sluice = Sluice::spawn(&[
        "--config",
        policy.to_str().expect("utf-8 path"),
        "--dry-run",
    ]);
    // The admin listener says it is a dry run (the dashboard's badge reads this).
    let status = get(&sluice.admin_url("/status")).await.json();
    assert_eq!(status["limiter"]["dry_run"], true, "{status}");
    // 30 expensive calls a minute; 34 over HTTP/1.1, then 2 over HTTP/2.
    for i in 0..34 {
        let r = post(&sluice, "/chats", "sk-dry").await;
        assert_eq!(r.status, 200, "chat {i}: {}", r.text());
        let remaining = if i < 30 { 29 - i } else { 0 };
        assert_eq!(
            r.header("x-ratelimit-remaining"),
            Some(remaining.to_string().as_str()),
            "chat {i}"
        );
    }
    let h2 = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http::<Full<Bytes>>();
    for i in 0..2 {
        let response = h2
            .request(
                Request::post(sluice.url("/chats"))
                    .header("x-api-key", "sk-dry")
                    .header("content-type", "application/json")
                    .body(Full::new(Bytes::from_static(b"{}")))
                    .expect("request"),
            )
            .await
            .expect("h2 request");
        assert_eq!(response.version(), http::Version::HTTP_2);
        assert_eq!(response.status(), 200, "h2 chat {i}");
        assert_eq!(response.headers()["x-ratelimit-remaining"], "0");
    }
    let metrics = get(&sluice.admin_url("/metrics")).await.text();
    let line = metrics
        .lines()
        .find(|l| l.starts_with("sluice_shadow_refusals_total{") && l.contains("\"expensive\""))
        .unwrap_or_else(|| panic!("no shadow refusal of expensive in:\n{metrics}"));
    assert!(line.contains("reason=\"rate_limited\""), "{line}");
    assert!(line.ends_with(" 6"), "4 + 2 would-be refusals: {line}");
    assert!(
        !metrics
            .lines()
            .any(|l| l.starts_with("sluice_refusals_total{") && !l.ends_with(" 0")),
        "nothing refused for real"
    );
    let dashboard = get(&sluice.admin_url("/dashboard.json")).await.json();
    assert_eq!(
        dashboard["status"]["limiter"]["dry_run"], true,
        "{dashboard}"
    );
    assert_eq!(
        dashboard["tally"]["shadow_refusals"],
        serde_json::json!([{ "budget": "expensive", "reason": "rate_limited", "count": 6 }])
    );
}

/// A policy of the operator's own: six classes and three per-IP ceilings, none of
/// the built-in names, and no `default_class` (the last route is the catch-all).
const OWN_CLASSES: &str = "profile: free
window_seconds: 4294967295
profiles:
  free:
    classes: { ping: 50, list: 20, search: 6, write: 4, generate: 3, export: 2 }
    ip_ceilings: { ip_all: 40, ip_heavy: 8, ip_light: 30 }
  pro:
    classes: { ping: 500, list: 200, search: 60, write: 40, generate: 30, export: 20 }
    ip_ceilings: { ip_all: 400, ip_heavy: 80, ip_light: 300 }
ceilings:
  ip_all: { classes: [ping, list, search, write, generate, export] }
  ip_heavy: { classes: [generate, export] }
  ip_light: { classes: [ping, list], only: true }
routes:
  - { method: POST, path: /rpc, jsonrpc: true }
  - { method: GET, path: /ping, class: ping }
  - { method: POST, path: /generate, class: generate }
  - { method: GET, path: \"/export/*\", class: export }
  - { class: write }
jsonrpc:
  methods:
    ping: [ping]
    list: [tools/list]
  tools:
    generate_image: { class: generate }
";

/// P1: classes, ceilings and profiles are the policy's data. Six classes and three
/// ceilings of the operator's own names limit through the HTTP/1.1 fast path, the
/// hyper path (HTTP/2) and JSON-RPC bodies alike, and every place a user reads
/// (headers, `/metrics`, `/status`, `sluice check`) names them.
#[tokio::test]
async fn p1_six_classes_and_three_ceilings_of_the_operators_own_limit_through_both_paths() {
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;

    let policy = policy_file("own-classes.yaml", |_| OWN_CLASSES.to_owned());
    let policy = policy.to_str().expect("utf-8 path");
    let sluice = Sluice::spawn(&["--config", policy]);
    let h2 = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http::<Full<Bytes>>();
    let h2_send = |request: Request<Full<Bytes>>| {
        let h2 = h2.clone();
        async move {
            let response = h2.request(request).await.expect("h2 request");
            assert_eq!(response.version(), http::Version::HTTP_2);
            response
        }
    };
    // `generate`: 3 per caller, over HTTP/1.1.
    for i in 0..3 {
        let r = post(&sluice, "/generate", "sk-a").await;
        assert_eq!(r.status, 200, "generate {i}: {}", r.text());
        assert_eq!(r.header("x-ratelimit-limit"), Some("3"), "generate {i}");
    }
    let refused = post(&sluice, "/generate", "sk-a").await;
    assert_eq!(refused.status, 429, "{}", refused.text());
    assert_eq!(refused.header("x-ratelimit-limit"), Some("3"));
    // `export`: 2 per caller, over HTTP/2.
    for i in 0..3 {
        let response = h2_send(
            Request::get(sluice.url("/export/report"))
                .header("x-api-key", "sk-a")
                .body(Full::new(Bytes::new()))
                .expect("request"),
        )
        .await;
        let expected = if i < 2 { 200 } else { 429 };
        assert_eq!(response.status(), expected, "export {i}");
        assert_eq!(response.headers()["x-ratelimit-limit"], "2", "export {i}");
    }
    // Another caller's 3 generations fill the per-IP ceiling over the heavy classes
    // (3 + 2 + 3 = 8; refused requests spent nothing).
    for i in 0..3 {
        let response = h2_send(
            Request::post(sluice.url("/generate"))
                .header("x-api-key", "sk-b")
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from_static(b"{}")))
                .expect("request"),
        )
        .await;
        assert_eq!(response.status(), 200, "sk-b generate {i}");
    }
    let ceiling = post(&sluice, "/generate", "sk-c").await;
    assert_eq!(ceiling.status, 429, "{}", ceiling.text());
    assert_eq!(ceiling.header("x-ratelimit-limit"), Some("8"), "ip_heavy");
    // The catch-all route's class is the default: `write`, 4 per caller.
    let write = post(&sluice, "/anything/else", "sk-c").await;
    assert_eq!(
        write.header("x-ratelimit-limit"),
        Some("4"),
        "{}",
        write.text()
    );
    // A JSON-RPC batch of the light classes only is not a heavy request; one that
    // holds a generation is, and the heavy ceiling refuses it.
    let rpc = |body: &'static str| {
        send(
            Request::post(sluice.url("/rpc"))
                .header("x-api-key", "sk-d")
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from_static(body.as_bytes())))
                .expect("request"),
        )
    };
    let light = rpc(r#"[{"jsonrpc":"2.0","id":1,"method":"ping"},{"jsonrpc":"2.0","id":2,"method":"tools/list"}]"#).await;
    assert_ne!(light.status, 429, "{}", light.text());
    let heavy = rpc(r#"[{"jsonrpc":"2.0","id":1,"method":"ping"},{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"generate_image"}}]"#).await;
    assert_eq!(heavy.status, 429, "{}", heavy.text());
    assert_eq!(heavy.header("x-ratelimit-limit"), Some("8"), "ip_heavy");

    let metrics = get(&sluice.admin_url("/metrics")).await.text();
    let count = |prefix: &str| {
        metrics
            .lines()
            .find(|l| l.starts_with(prefix))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|n| n.parse::<u64>().ok())
            .unwrap_or_else(|| panic!("no {prefix} in:\n{metrics}"))
    };
    assert_eq!(count("sluice_refusals_total{reason=\"ip_heavy\"}"), 2);
    assert_eq!(count("sluice_refusals_total{reason=\"generate\"}"), 1);
    assert_eq!(count("sluice_refusals_total{reason=\"export\"}"), 1);
    assert_eq!(
        count("sluice_decisions_total{class=\"generate\",outcome=\"admitted\"}"),
        6
    );
    let status = get(&sluice.admin_url("/status")).await.json();
    let limiter = &status["limiter"];
    assert_eq!(
        limiter["class_names"],
        serde_json::json!(["ping", "list", "search", "write", "generate", "export"]),
        "{status}"
    );
    assert_eq!(limiter["classes"]["generate"], 3);
    assert_eq!(
        limiter["ip_ceilings"],
        serde_json::json!({ "ip_all": 40, "ip_heavy": 8, "ip_light": 30 })
    );
    assert_eq!(limiter["profile"], "free");

    // `sluice check` prints the classes and ceilings by their names; `--profile`
    // takes any profile the policy has and names them when it has not.
    let check = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["check", policy])
        .output()
        .expect("sluice check");
    let out = String::from_utf8_lossy(&check.stdout);
    assert!(check.status.success(), "{out}");
    assert!(
        out.contains(
            "per caller and class: ping 50, list 20, search 6, write 4, generate 3, export 2"
        ),
        "{out}"
    );
    assert!(
        out.contains("ip_heavy 8 (requests holding any of generate, export)")
            && out.contains("ip_light 30 (requests holding only ping, list)"),
        "{out}"
    );
    let pro = Sluice::spawn(&["--config", policy, "--profile", "pro"]);
    let status = get(&pro.admin_url("/status")).await.json();
    assert_eq!(status["limiter"]["classes"]["generate"], 30, "{status}");
    let nope = run_to_exit(
        &["serve", "--config", policy, "--profile", "staging"],
        Duration::from_secs(30),
    );
    assert_eq!(nope.status.code(), Some(2), "{}", nope.stderr);
    assert!(
        nope.stderr.contains("staging") && nope.stderr.contains("free, pro"),
        "{}",
        nope.stderr
    );
}
