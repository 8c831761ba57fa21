//! What operators read: structured log lines (`--log-format json`), one line per
//! refusal with reason, budget, class and the caller's digest (never the credential,
//! SPEC E2), the access log (`--access-log`), and the request id (`X-Request-Id`)
//! passed to the upstream and returned, on the fast path and the hyper path.

use crate::edit;
use edit::Edit as _;

use crate::support;

use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use serde_json::Value;
use support::{DataDir, Reply, Sluice, send};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

const CREDENTIAL: &str = "sk-live-do-not-log-4f1c2e";
const QUERY_SECRET: &str = "query-secret-9d8e7f";

/// The built-in policy with one expensive call a window (an hour: the test's calls
/// cannot straddle two).
fn policy_file(dir: &DataDir) -> String {
    std::fs::create_dir_all(&dir.0).expect("dir");
    let file = dir.0.join("policy.yaml");
    let text = sluice_policy::DEFAULT_POLICY_YAML
        .edit("window_seconds: 60", "window_seconds: 3600")
        .edit("standard: 60, expensive: 30", "standard: 60, expensive: 1");
    std::fs::write(&file, text).expect("write");
    file.to_str().expect("path").to_owned()
}

async fn post_chat(sluice: &Sluice, request_id: Option<&str>) -> Reply {
    let mut request = Request::post(sluice.url(&format!("/chats?api_key={QUERY_SECRET}")))
        .header("authorization", format!("Bearer {CREDENTIAL}"));
    if let Some(id) = request_id {
        request = request.header("x-request-id", id);
    }
    send(request.body(Full::new(Bytes::new())).expect("request")).await
}

/// The JSON lines of `sluice`'s stderr.
fn json_lines(sluice: &Sluice) -> Vec<Value> {
    sluice
        .stderr()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// Waits (bounded) until a line matching `wanted` is logged.
async fn logged(sluice: &Sluice, wanted: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if let Some(line) = json_lines(sluice).into_iter().find(|l| wanted(l)) {
            return line;
        }
        assert!(Instant::now() < deadline, "not logged: {}", sluice.stderr());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2_a_refusal_is_one_json_line_with_reason_budget_and_caller_digest_never_the_credential() {
    let dir = DataDir::new();
    let file = policy_file(&dir);
    let sluice = Sluice::spawn(&["--config", &file, "--log-format", "json", "--access-log"]);
    let admitted = post_chat(&sluice, Some("first-call")).await;
    assert_eq!(admitted.status, 200);
    let refused = post_chat(&sluice, None).await;
    assert_eq!(refused.status, 429);
    let id = refused
        .header("x-request-id")
        .expect("an id on the refusal")
        .to_owned();

    let line = logged(&sluice, |l| l["target"] == "sluice::refusal").await;
    assert_eq!(line["level"], "INFO");
    assert_eq!(line["request_id"], id.as_str());
    assert_eq!(line["reason"], "rate_limited");
    assert_eq!(line["budget"], "expensive");
    assert_eq!(line["class"], "expensive");
    assert_eq!(line["limit"], 1);
    assert!(
        line["retry_after"].as_u64().is_some_and(|s| s >= 1),
        "{line}"
    );
    let caller = line["caller"].as_str().expect("caller");
    assert!(
        caller.len() == 16 && caller.bytes().all(|b| b.is_ascii_hexdigit()),
        "{caller}"
    );
    assert_eq!(
        json_lines(&sluice)
            .iter()
            .filter(|l| l["target"] == "sluice::refusal")
            .count(),
        1,
        "one line per refusal"
    );

    // Both requests have an access line; the path is logged without its query.
    let access = logged(&sluice, |l| {
        l["target"] == "sluice::access" && l["request_id"] == id.as_str()
    })
    .await;
    assert_eq!(access["status"], 429);
    assert_eq!(access["method"], "POST");
    assert_eq!(access["path"], "/chats");
    let first = logged(&sluice, |l| {
        l["target"] == "sluice::access" && l["request_id"] == "first-call"
    })
    .await;
    assert_eq!(first["status"], 200);

    let log = sluice.stderr();
    assert!(
        !log.contains(CREDENTIAL),
        "the credential is in the log: {log}"
    );
    assert!(
        !log.contains(QUERY_SECRET),
        "the query is in the log: {log}"
    );
    // Every line is JSON.
    assert!(
        log.lines()
            .all(|l| serde_json::from_str::<Value>(l).is_ok()),
        "{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_refusals_writes_at_most_the_bound_of_lines_a_second_and_counts_every_one() {
    let dir = DataDir::new();
    let file = policy_file(&dir);
    let sluice = Sluice::spawn(&[
        "--config",
        &file,
        "--log-format",
        "json",
        "--access-log",
        "--refusal-log-per-second",
        "3",
    ]);
    assert_eq!(post_chat(&sluice, None).await.status, 200);
    let unix = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("after 1970")
            .as_secs()
    };
    let from = unix();
    for i in 0..40 {
        let id = format!("flood-{i}");
        assert_eq!(post_chat(&sluice, Some(&id)).await.status, 429);
    }
    let seconds = unix() - from + 1;
    // A refusal's line is written before its answer, and its access line after:
    // once the last access line is in, every refusal line written is too.
    logged(&sluice, |l| {
        l["target"] == "sluice::access" && l["request_id"] == "flood-39"
    })
    .await;
    let lines = json_lines(&sluice)
        .iter()
        .filter(|l| l["target"] == "sluice::refusal" && l["reason"] == "rate_limited")
        .count() as u64;
    assert!(
        (3..=3 * seconds).contains(&lines),
        "{lines} refusal lines in {seconds} s at 3 a second"
    );
    let metrics = support::get(&sluice.admin_url("/metrics")).await.text();
    let refused: f64 = metrics
        .lines()
        .filter(|l| l.starts_with("sluice_refusals_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(refused, 40.0, "every refusal is counted: {metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_access_lines_unless_asked_and_text_logs_by_default() {
    let dir = DataDir::new();
    let file = policy_file(&dir);
    let sluice = Sluice::spawn(&["--config", &file]);
    assert_eq!(post_chat(&sluice, None).await.status, 200);
    assert_eq!(post_chat(&sluice, None).await.status, 429);
    let deadline = Instant::now() + Duration::from_secs(5);
    while !sluice.stderr().contains("sluice::refusal") {
        assert!(Instant::now() < deadline, "{}", sluice.stderr());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let log = sluice.stderr();
    assert!(!log.contains("sluice::access"), "{log}");
    assert!(log.contains("reason=\"rate_limited\""), "{log}");
    assert!(!log.contains(CREDENTIAL), "{log}");
}

/// A request over HTTP/1.0 (served by hyper and the service stack, not the fast
/// path): its head and the JSON body.
async fn get_on_hyper_path(sluice: &Sluice, id: &str) -> (String, Value) {
    let mut stream = tokio::net::TcpStream::connect(sluice.start.gateway)
        .await
        .expect("connect");
    let head = format!("GET /echo HTTP/1.0\r\nhost: x\r\nx-request-id: {id}\r\n\r\n");
    stream.write_all(head.as_bytes()).await.expect("write");
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).await.expect("read");
    let text = String::from_utf8_lossy(&answer).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").expect("a head");
    (head.to_owned(), serde_json::from_str(body).expect("JSON"))
}

fn header_of(head: &str, name: &str) -> Option<String> {
    head.lines().find_map(|l| {
        let (n, v) = l.split_once(':')?;
        n.eq_ignore_ascii_case(name).then(|| v.trim().to_owned())
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sane_request_id_is_kept_and_passed_upstream_an_insane_one_replaced_on_both_paths() {
    let sluice = Sluice::spawn(&[]);
    let too_long = "a".repeat(sluice_edge::MAX_REQUEST_ID_LEN + 1);
    for (sent, kept) in [
        ("abc-123.XYZ_~", true),
        ("has space", false),
        (too_long.as_str(), false),
    ] {
        // Fast path.
        let reply = send(
            Request::get(sluice.url("/echo"))
                .header("x-request-id", sent)
                .body(Full::new(Bytes::new()))
                .expect("request"),
        )
        .await;
        let returned = reply.header("x-request-id").expect("id").to_owned();
        let upstream = reply.json()["headers"]["x-request-id"].clone();
        assert_eq!(
            upstream,
            returned.as_str(),
            "the upstream got the id returned"
        );
        assert_eq!(returned == sent, kept, "{sent:?} → {returned:?}");
        assert!(returned.len() <= sluice_edge::MAX_REQUEST_ID_LEN);
        // The hyper path.
        let (head, body) = get_on_hyper_path(&sluice, sent).await;
        let returned = header_of(&head, "x-request-id").expect("id on the hyper path");
        assert_eq!(body["headers"]["x-request-id"], returned.as_str());
        assert_eq!(returned == sent, kept, "{sent:?} → {returned:?}");
    }
    // Without one, each request gets its own.
    let ids: Vec<String> = futures_ids(&sluice).await;
    assert_ne!(ids[0], ids[1]);
}

async fn futures_ids(sluice: &Sluice) -> Vec<String> {
    let mut ids = Vec::new();
    for _ in 0..2 {
        let reply = send(
            Request::get(sluice.url("/echo"))
                .body(Full::new(Bytes::new()))
                .expect("request"),
        )
        .await;
        ids.push(reply.header("x-request-id").expect("id").to_owned());
    }
    ids
}
