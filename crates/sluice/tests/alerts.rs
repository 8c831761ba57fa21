//! SPEC O3: alerts from real `sluice serve` processes to a real webhook
//! receiver on a loopback port. The receiver checks each delivery's
//! HMAC-SHA256 signature (computed here, apart from sluice's own); the 80 % and
//! 100 % events of a monthly quota arrive once each; `kill -9` between the
//! decision and the delivery loses none and sends none twice; a receiver that
//! is down and then up gets every event; a webhook that hangs, redirects or
//! answers 500 never slows a request. Retries use a short configured backoff
//! (`retry_ms`); the tests wait for what the receiver sees, never for time.

use crate::support;

use crate::one_request;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use serde_json::Value;
use support::redis::RedisServer;
use support::{DataDir, Sluice, get, send};
use tokio::io::AsyncWriteExt as _;
use tokio::net::TcpListener;
use tokio::sync::mpsc;

/// The signing secret (the file holds it with a trailing newline).
const SECRET: &str = "whsec-test-0123456789";

/// How the receiver answers.
const OK: u8 = 0;
const FAIL_500: u8 = 1;
const HANG: u8 = 2;
const REDIRECT: u8 = 3;
const CLOSE: u8 = 4;

/// One delivery as the receiver saw it.
#[derive(Debug)]
struct Delivery {
    id: String,
    body: Value,
    /// The signature matched the body.
    signed: bool,
    /// What the receiver answered (its mode then).
    answered: u8,
}

/// HMAC-SHA256 (RFC 2104), written here so that the test does not check sluice
/// with sluice's own code.
fn hmac(key: &[u8], message: &[u8]) -> String {
    use sha2::{Digest as _, Sha256};
    let mut block = [0u8; 64];
    block[..key.len()].copy_from_slice(key);
    let inner: Vec<u8> = block.iter().map(|b| b ^ 0x36).collect();
    let outer: Vec<u8> = block.iter().map(|b| b ^ 0x5c).collect();
    let mut h = Sha256::new();
    h.update(&inner);
    h.update(message);
    let inner_hash = h.finalize();
    let mut h = Sha256::new();
    h.update(&outer);
    h.update(inner_hash);
    hex::encode(h.finalize())
}

/// A webhook receiver on a loopback port answering as `mode` says, each
/// delivery sent on the channel.
async fn receiver(mode: Arc<AtomicU8>) -> (SocketAddr, mpsc::UnboundedReceiver<Delivery>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            let (tx, mode) = (tx.clone(), Arc::clone(&mode));
            tokio::spawn(async move {
                let answered = mode.load(Ordering::SeqCst);
                if answered == CLOSE {
                    return;
                }
                let Some(raw) = one_request::read_request(&mut conn).await else {
                    return;
                };
                let text = String::from_utf8_lossy(&raw).into_owned();
                let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
                let header = |name: &str| {
                    head.lines()
                        .filter_map(|l| l.split_once(':'))
                        .find(|(k, _)| k.trim().eq_ignore_ascii_case(name))
                        .map(|(_, v)| v.trim().to_owned())
                        .unwrap_or_default()
                };
                let signed = header("x-sluice-signature")
                    == format!("sha256={}", hmac(SECRET.as_bytes(), body.as_bytes()));
                let _ = tx.send(Delivery {
                    id: header("x-sluice-event"),
                    body: serde_json::from_str(body).unwrap_or(Value::Null),
                    signed,
                    answered,
                });
                let answer = match answered {
                    OK => "HTTP/1.1 204 No Content\r\nconnection: close\r\n\r\n",
                    FAIL_500 => {
                        "HTTP/1.1 500 Internal Server Error\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
                    }
                    REDIRECT => {
                        "HTTP/1.1 302 Found\r\nlocation: http://127.0.0.1:9/elsewhere\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
                    }
                    _ => {
                        // Hang: hold the connection, never answer.
                        std::future::pending::<()>().await;
                        return;
                    }
                };
                let _ = conn.write_all(answer.as_bytes()).await;
            });
        }
    });
    (addr, rx)
}

/// An upstream answering every request 200.
async fn upstream() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            tokio::spawn(async move {
                if one_request::read_request(&mut conn).await.is_none() {
                    return;
                }
                let _ = conn
                    .write_all(
                        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}",
                    )
                    .await;
            });
        }
    });
    addr
}

/// A policy of a monthly quota of 10 messages per workspace, alerting `hook` at
/// 80 % and 100 %, with a short backoff; written with its secret file in
/// `data`. The arguments to serve it on the embedded store in `data`.
fn setup(data: &DataDir, hook: SocketAddr, up: SocketAddr, timeout_ms: u32) -> Vec<String> {
    std::fs::create_dir_all(&data.0).expect("data dir");
    std::fs::write(data.0.join("alert-secret"), format!("{SECRET}\n")).expect("secret");
    let policy = format!(
        r#"
profile: default
profiles:
  default:
    classes: {{ calls: 1000 }}
identity:
  credentials: [bearer]
quotas:
  messages: {{ monthly: 10 }}
routes:
  - {{ method: POST, path: /messages, class: calls, quota: messages }}
  - {{ class: calls }}
# With Redis: a loaded test machine may take longer than the default 20 ms.
store:
  timeout_ms: 2000
alerts:
  - url: http://{hook}/hooks/sluice
    at: [0.8, 1.0]
    budgets: [messages]
    secret_file: alert-secret
    timeout_ms: {timeout_ms}
    retry_ms: 20
    max_retry_ms: 100
"#
    );
    let path = data.0.join("policy.yaml");
    std::fs::write(&path, policy).expect("policy");
    [
        "--config",
        path.to_str().expect("utf-8"),
        "--upstream",
        &format!("http://{up}"),
        "--data-dir",
        data.arg(),
    ]
    .map(str::to_owned)
    .to_vec()
}

fn spawn(args: &[String]) -> Sluice {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Sluice::spawn(&args)
}

/// One `POST /messages` as `key`: its status and how long it took.
async fn message(sluice: &Sluice, key: &str) -> (u16, Duration) {
    let started = Instant::now();
    let reply = send(
        Request::post(sluice.url("/messages"))
            .header("authorization", format!("Bearer {key}"))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(b"{}")))
            .expect("request"),
    )
    .await;
    (reply.status.as_u16(), started.elapsed())
}

/// The next delivery, within 10 s.
async fn next(rx: &mut mpsc::UnboundedReceiver<Delivery>) -> Delivery {
    tokio::time::timeout(Duration::from_secs(10), rx.recv())
        .await
        .expect("a delivery within 10 s")
        .expect("the receiver runs")
}

/// Deliveries until each of `ids` (or, with none given, `n` distinct events) has
/// been answered 2xx; returns them all.
async fn until_delivered(rx: &mut mpsc::UnboundedReceiver<Delivery>, n: usize) -> Vec<Delivery> {
    let mut seen = Vec::new();
    loop {
        let ok: std::collections::BTreeSet<&str> = seen
            .iter()
            .filter(|d: &&Delivery| d.answered == OK)
            .map(|d| d.id.as_str())
            .collect();
        if ok.len() >= n {
            return seen;
        }
        seen.push(next(rx).await);
    }
}

/// `/status`'s alert events.
async fn events(sluice: &Sluice) -> Vec<Value> {
    get(&sluice.admin_url("/status")).await.json()["limiter"]["alerts"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

/// `/status`'s alert events once all `n` are delivered (the receiver sees a
/// delivery before sluice reads its answer), within 10 s.
async fn all_delivered(sluice: &Sluice, n: usize) -> Vec<Value> {
    let settled = async {
        loop {
            let listed = events(sluice).await;
            if listed.len() == n && listed.iter().all(|e| e["state"] == "delivered") {
                return listed;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), settled)
        .await
        .expect("every event noted delivered within 10 s")
}

/// The thresholds of `deliveries` answered 2xx, by event id.
fn delivered(deliveries: &[Delivery]) -> BTreeMap<String, Vec<f64>> {
    let mut by_id: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for d in deliveries.iter().filter(|d| d.answered == OK) {
        by_id
            .entry(d.id.clone())
            .or_default()
            .push(d.body["threshold"].as_f64().unwrap_or(0.0));
    }
    by_id
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn o3_the_80_and_100_percent_events_arrive_once_each_signed() {
    let mode = Arc::new(AtomicU8::new(OK));
    let (hook, mut rx) = receiver(Arc::clone(&mode)).await;
    let data = DataDir::new();
    let sluice = spawn(&setup(&data, hook, upstream().await, 2_000));
    for n in 1..=12 {
        let (status, _) = message(&sluice, "sk-a").await;
        assert_eq!(status, if n <= 10 { 200 } else { 429 }, "call {n}");
    }
    let deliveries = until_delivered(&mut rx, 2).await;
    assert!(deliveries.iter().all(|d| d.signed), "{deliveries:?}");
    let by_id = delivered(&deliveries);
    let mut thresholds: Vec<f64> = by_id.values().flatten().copied().collect();
    thresholds.sort_by(f64::total_cmp);
    assert_eq!(thresholds, [0.8, 1.0], "once each: {deliveries:?}");
    let first = &deliveries[0].body;
    assert_eq!(first["budget"], "messages");
    assert_eq!(first["limit"], 10);
    assert_eq!(first["type"], "budget.threshold");
    // The outbox holds those two, delivered at the first try; nothing else is
    // left to send.
    let listed = all_delivered(&sluice, 2).await;
    for e in &listed {
        assert_eq!(e["attempts"], 1, "{e}");
    }
    assert!(rx.try_recv().is_err(), "no more deliveries");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn o3_kill_9_between_decision_and_delivery_loses_no_event_and_sends_none_twice() {
    let mode = Arc::new(AtomicU8::new(FAIL_500));
    let (hook, mut rx) = receiver(Arc::clone(&mode)).await;
    let data = DataDir::new();
    let args = setup(&data, hook, upstream().await, 2_000);
    let mut sluice = spawn(&args);
    for _ in 0..10 {
        assert_eq!(message(&sluice, "sk-a").await.0, 200);
    }
    // Both events were kept when their calls were answered; the receiver fails
    // every try until sluice is killed.
    let mut failed = std::collections::BTreeSet::new();
    while failed.len() < 2 {
        let d = next(&mut rx).await;
        assert_eq!(d.answered, FAIL_500);
        failed.insert(d.id);
    }
    sluice.kill();
    // The receiver comes up only once the new process has started: a try the
    // killed one had on its way has been answered 500 by then.
    let sluice = spawn(&args);
    mode.store(OK, Ordering::SeqCst);
    let deliveries = until_delivered(&mut rx, 2).await;
    let by_id = delivered(&deliveries);
    assert_eq!(by_id.len(), 2, "{deliveries:?}");
    assert!(by_id.values().all(|t| t.len() == 1), "{deliveries:?}");
    assert_eq!(
        by_id
            .keys()
            .cloned()
            .collect::<std::collections::BTreeSet<_>>(),
        failed
    );
    // The restarted process knows both are delivered: a refused call and the
    // workspace's 100 % make nothing new.
    all_delivered(&sluice, 2).await;
    assert_eq!(message(&sluice, "sk-a").await.0, 429);
    assert_eq!(events(&sluice).await.len(), 2);
    assert!(rx.try_recv().is_err(), "no more deliveries");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn o3_a_receiver_down_then_up_gets_every_event_once() {
    let mode = Arc::new(AtomicU8::new(CLOSE));
    let (hook, mut rx) = receiver(Arc::clone(&mode)).await;
    let data = DataDir::new();
    let sluice = spawn(&setup(&data, hook, upstream().await, 2_000));
    // Two workspaces, four events, while the receiver closes every connection.
    for key in ["sk-a", "sk-b"] {
        for _ in 0..10 {
            assert_eq!(message(&sluice, key).await.0, 200);
        }
    }
    // sluice has tried (and failed) by now: /status says so.
    let tried = async {
        loop {
            let listed = events(&sluice).await;
            if listed.len() == 4 && listed.iter().all(|e| e["attempts"].as_u64() >= Some(1)) {
                return listed;
            }
            tokio::task::yield_now().await;
        }
    };
    let listed = tokio::time::timeout(Duration::from_secs(10), tried)
        .await
        .expect("every event tried within 10 s");
    assert!(listed.iter().all(|e| e["state"] == "pending"), "{listed:?}");
    mode.store(OK, Ordering::SeqCst);
    let deliveries = until_delivered(&mut rx, 4).await;
    all_delivered(&sluice, 4).await;
    let by_id = delivered(&deliveries);
    assert_eq!(by_id.len(), 4);
    assert!(by_id.values().all(|t| t.len() == 1), "{deliveries:?}");
    assert!(deliveries.iter().all(|d| d.signed));
    assert!(rx.try_recv().is_err(), "no more deliveries");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn o3_a_webhook_that_hangs_redirects_or_fails_never_slows_a_request() {
    for (mode_now, last) in [(HANG, "timed out"), (REDIRECT, "302"), (FAIL_500, "500")] {
        let mode = Arc::new(AtomicU8::new(mode_now));
        let (hook, mut rx) = receiver(Arc::clone(&mode)).await;
        let data = DataDir::new();
        // A hanging webhook is given up on after 30 s a try: far longer than any
        // call may take.
        let sluice = spawn(&setup(&data, hook, upstream().await, 30_000));
        for key in ["sk-a", "sk-b", "sk-c"] {
            for _ in 0..10 {
                let (status, took) = message(&sluice, key).await;
                assert_eq!(status, 200);
                assert!(
                    took < Duration::from_secs(5),
                    "{last}: a call took {took:?}"
                );
            }
        }
        // The webhook was reached, and its events wait in the outbox.
        let d = next(&mut rx).await;
        assert_eq!(d.answered, mode_now);
        if mode_now != HANG {
            // Tried again (with backoff), never delivered.
            let again = next(&mut rx).await;
            assert_eq!(again.answered, mode_now);
            let listed = events(&sluice).await;
            assert_eq!(listed.len(), 6, "{listed:?}");
            assert!(listed.iter().all(|e| e["state"] == "pending"), "{listed:?}");
            assert!(
                listed.iter().any(|e| e["last"] == last),
                "{last}: {listed:?}"
            );
        }
        // The admin listener answers at once too.
        let started = Instant::now();
        assert_eq!(events(&sluice).await.len(), 6);
        assert!(started.elapsed() < Duration::from_secs(5));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn o3_two_replicas_on_one_redis_send_each_event_once() {
    let redis = RedisServer::start("o3-replicas");
    let mode = Arc::new(AtomicU8::new(OK));
    let (hook, mut rx) = receiver(Arc::clone(&mode)).await;
    let up = upstream().await;
    // Each replica its own data dir (its outbox), both on one Redis.
    let (a, b) = (DataDir::new(), DataDir::new());
    let url = redis.url();
    let replica = |data: &DataDir| {
        let mut args = setup(data, hook, up, 2_000);
        args.extend(["--store".to_owned(), url.clone()]);
        spawn(&args)
    };
    let replicas = [replica(&a), replica(&b)];
    // One workspace's calls alternate between the replicas: the 8th (on one)
    // and the 9th (on the other) both leave the budget past 80 %, so both make
    // that event; one claims it in Redis and sends it.
    for n in 0..12 {
        let (status, _) = message(&replicas[n % 2], "sk-a").await;
        assert_eq!(status, if n < 10 { 200 } else { 429 }, "call {n}");
    }
    let deliveries = until_delivered(&mut rx, 2).await;
    let by_id = delivered(&deliveries);
    assert_eq!(by_id.len(), 2, "{deliveries:?}");
    assert!(by_id.values().all(|t| t.len() == 1), "{deliveries:?}");
    let sent: usize = {
        let mut delivered_total = 0;
        for r in &replicas {
            delivered_total += events(r)
                .await
                .iter()
                .filter(|e| e["state"] == "delivered" || e["state"] == "pending")
                .count();
        }
        delivered_total
    };
    assert_eq!(sent, 2, "two events kept to send, across both replicas");
    let elsewhere: usize = {
        let mut n = 0;
        for r in &replicas {
            n += events(r)
                .await
                .iter()
                .filter(|e| e["state"] == "elsewhere")
                .count();
        }
        n
    };
    assert_eq!(elsewhere, 1, "the 80 % event, made twice, claimed once");
    assert!(rx.try_recv().is_err(), "no more deliveries");
}

#[test]
fn o3_sluice_check_describes_alerts_and_refuses_a_missing_or_empty_secret() {
    use support::run_to_exit;
    let data = DataDir::new();
    let hook: SocketAddr = "127.0.0.1:9".parse().expect("addr");
    let args = setup(&data, hook, hook, 2_000);
    let policy = args[1].clone();
    let checked = std::process::Command::new(support::binary())
        .args(["check", &policy])
        .output()
        .expect("sluice check");
    let out = String::from_utf8_lossy(&checked.stdout);
    assert!(checked.status.success(), "{out}");
    assert!(
        out.contains("alert: POST http://127.0.0.1:9/hooks/sluice when messages passes 80%, 100% of its limit"),
        "{out}"
    );
    std::fs::write(data.0.join("alert-secret"), "  \n").expect("secret");
    let empty = run_to_exit(&["check", &policy], Duration::from_secs(30));
    assert_eq!(empty.status.code(), Some(2), "{}", empty.stderr);
    assert!(
        empty.stderr.contains("alerts[0].secret_file"),
        "{}",
        empty.stderr
    );
    std::fs::remove_file(data.0.join("alert-secret")).expect("remove");
    let missing = run_to_exit(&["check", &policy], Duration::from_secs(30));
    assert_eq!(missing.status.code(), Some(2), "{}", missing.stderr);
    assert!(
        missing.stderr.contains("alert-secret"),
        "{}",
        missing.stderr
    );
    // serve refuses to start without it, naming it.
    let serve = run_to_exit(
        &[
            "serve",
            "--config",
            &policy,
            "--listen",
            "127.0.0.1:0",
            "--admin",
            "127.0.0.1:0",
            "--data-dir",
            data.arg(),
        ],
        Duration::from_secs(30),
    );
    assert_ne!(serve.status.code(), Some(0));
    assert!(serve.stderr.contains("alert-secret"), "{}", serve.stderr);
}
