//! Guarded lanes across replicas (L1 with D2): several `sluice serve` processes on
//! one redis-server in front of one slow upstream, written here, that counts the
//! calls running at once per `X-Sluice-Workspace` and in total.

use crate::edit;
use edit::Edit as _;

use crate::support;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use support::redis::RedisServer;
use support::{Sluice, send};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};

/// How long a lease lives in these tests (`lease_ttl_seconds`).
const TTL: Duration = Duration::from_secs(2);

/// What the upstream saw.
#[derive(Default)]
struct Seen {
    running: HashMap<String, u32>,
    most: HashMap<String, u32>,
    total: u32,
    most_total: u32,
    started: u32,
}

/// A slow upstream on a loopback port: `POST /messages/optimize` takes 1 s (20 s
/// when the body says `hold`), anything else answers at once.
struct Upstream {
    url: String,
    seen: Arc<Mutex<Seen>>,
}

impl Upstream {
    async fn start() -> Upstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        let seen = Arc::new(Mutex::new(Seen::default()));
        let shared = Arc::clone(&seen);
        tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                tokio::spawn(connection(socket, Arc::clone(&shared)));
            }
        });
        Upstream { url, seen }
    }

    fn seen<T>(&self, f: impl FnOnce(&Seen) -> T) -> T {
        f(&self.seen.lock().expect("lock"))
    }

    /// Waits (bounded) until `check` holds.
    async fn until(&self, what: &str, check: impl Fn(&Seen) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !self.seen(&check) {
            assert!(Instant::now() < deadline, "upstream never saw {what}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// Serves one keep-alive connection.
async fn connection(mut socket: TcpStream, seen: Arc<Mutex<Seen>>) {
    let mut buf: Vec<u8> = Vec::new();
    loop {
        // The head.
        let (head, path, workspace, length, chunked) = loop {
            let mut headers = [httparse::EMPTY_HEADER; 64];
            let mut req = httparse::Request::new(&mut headers);
            match req.parse(&buf) {
                Ok(httparse::Status::Complete(n)) => {
                    let header = |name: &str| {
                        req.headers
                            .iter()
                            .find(|h| h.name.eq_ignore_ascii_case(name))
                            .map(|h| String::from_utf8_lossy(h.value).into_owned())
                    };
                    let length = header("content-length")
                        .and_then(|v| v.trim().parse::<usize>().ok())
                        .unwrap_or(0);
                    let chunked =
                        header("transfer-encoding").is_some_and(|v| v.contains("chunked"));
                    break (
                        n,
                        req.path.unwrap_or("").to_owned(),
                        header("x-sluice-workspace").unwrap_or_default(),
                        length,
                        chunked,
                    );
                }
                Ok(httparse::Status::Partial) => {}
                Err(_) => return,
            }
            if !read_more(&mut socket, &mut buf).await {
                return;
            }
        };
        // The body.
        let end = loop {
            let end = if chunked {
                buf[head..]
                    .windows(5)
                    .position(|w| w == b"0\r\n\r\n")
                    .map(|p| head + p + 5)
            } else {
                (buf.len() >= head + length).then_some(head + length)
            };
            if let Some(end) = end {
                break end;
            }
            if !read_more(&mut socket, &mut buf).await {
                return;
            }
        };
        let hold = buf[head..end].windows(4).any(|w| w == b"hold");
        buf.drain(..end);
        if path == "/messages/optimize" {
            {
                let mut s = seen.lock().expect("lock");
                s.started += 1;
                s.total += 1;
                s.most_total = s.most_total.max(s.total);
                let now = {
                    let r = s.running.entry(workspace.clone()).or_default();
                    *r += 1;
                    *r
                };
                let most = s.most.entry(workspace.clone()).or_default();
                *most = (*most).max(now);
            }
            let took = if hold { 20 } else { 1 };
            tokio::time::sleep(Duration::from_secs(took)).await;
            let mut s = seen.lock().expect("lock");
            s.total -= 1;
            if let Some(r) = s.running.get_mut(&workspace) {
                *r -= 1;
            }
        }
        let answer =
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}";
        if socket.write_all(answer).await.is_err() {
            return;
        }
    }
}

async fn read_more(socket: &mut TcpStream, buf: &mut Vec<u8>) -> bool {
    let mut chunk = [0u8; 8192];
    match socket.read(&mut chunk).await {
        Ok(0) | Err(_) => false,
        Ok(n) => {
            buf.extend_from_slice(&chunk[..n]);
            true
        }
    }
}

/// The default policy with a global cap of 6 (2 kept from batches), starts not
/// binding, leases of 2 s, and a store timeout a loaded debug build meets.
fn policy(name: &str) -> String {
    write_policy(name, lane_yaml(6))
}

/// The built-in policy's YAML with a global cap of `cap` (2 kept from batches),
/// starts not binding, leases of 2 s, and a store timeout a loaded debug build meets.
fn lane_yaml(cap: u32) -> String {
    sluice_policy::DEFAULT_POLICY_YAML
        .edit("global_in_flight: 20", &format!("global_in_flight: {cap}"))
        .edit("batch_reserve: 5", "batch_reserve: 2")
        .edit("workspace_starts: 12", "workspace_starts: 100")
        .edit(
            "timeout_seconds: 180",
            &format!(
                "timeout_seconds: 180\n    lease_ttl_seconds: {}",
                TTL.as_secs()
            ),
        )
        .edit("timeout_ms: 20", "timeout_ms: 2000")
}

/// Writes `yaml` as `name` in this test run's directory; its path.
fn write_policy(name: &str, yaml: String) -> String {
    let dir = std::env::temp_dir().join(format!("sluice-lanes-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join(name);
    std::fs::write(&path, yaml).expect("write policy");
    path.to_str().expect("utf-8 path").to_owned()
}

fn replica(policy: &str, redis: &RedisServer, upstream: &Upstream) -> Sluice {
    Sluice::spawn(&[
        "--config",
        policy,
        "--store",
        &redis.url(),
        "--upstream",
        &upstream.url,
    ])
}

fn optimize(sluice: &Sluice, key: &str, body: &'static str) -> Request<Full<Bytes>> {
    Request::post(sluice.url("/messages/optimize"))
        .header("x-api-key", key)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .expect("request")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l1_d2_three_replicas_on_one_redis_run_at_most_3_per_workspace_and_6_in_all() {
    let redis = RedisServer::start("lanes");
    let upstream = Upstream::start().await;
    let policy = policy("caps.yaml");
    let replicas: Vec<Sluice> = (0..3)
        .map(|_| replica(&policy, &redis, &upstream))
        .collect();
    let keys = ["sk-a", "sk-b", "sk-c", "sk-d", "sk-e"];
    // 40 calls at once: 8 per workspace, each workspace's spread over all three.
    let tasks: Vec<_> = (0..40)
        .map(|i| {
            let request = optimize(&replicas[i % 3], keys[i % 5], "{}");
            tokio::spawn(async move {
                let r = send(request).await;
                (r.status.as_u16(), r.text())
            })
        })
        .collect();
    let mut served = 0;
    for t in tasks {
        let (status, body) = t.await.expect("task");
        match status {
            200 => served += 1,
            429 => assert!(
                body.contains("optimizer_busy") || body.contains("workspace_in_flight_limit"),
                "a lane refusal: {body}"
            ),
            other => panic!("{other}: {body}"),
        }
    }
    let (most_total, most, started) = upstream.seen(|s| (s.most_total, s.most.clone(), s.started));
    assert_eq!(started, served, "every call served went upstream once");
    assert!(
        served >= 12,
        "the lane kept its places busy ({served} served)"
    );
    assert_eq!(
        most_total, 6,
        "the global cap across three replicas, reached and never passed"
    );
    assert_eq!(most.len(), 5, "every workspace was served: {most:?}");
    for (workspace, n) in &most {
        assert!(*n <= 3, "{workspace} ran {n} at once across replicas");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l1_a_replica_killed_with_sigkill_gives_its_places_back_within_the_lease_ttl() {
    let redis = RedisServer::start("lanes-kill");
    let upstream = Upstream::start().await;
    let policy = policy("kill.yaml");
    let mut doomed = replica(&policy, &redis, &upstream);
    let survivor = replica(&policy, &redis, &upstream);
    // Three calls of one workspace held upstream through the doomed replica.
    for _ in 0..3 {
        let request = optimize(&doomed, "sk-kill", r#"{"hold":true}"#);
        tokio::spawn(async move {
            // Its connection dies with the replica: no answer is expected.
            let _ = support::client().request(request).await;
        });
    }
    upstream.until("three held calls", |s| s.total == 3).await;
    // A fourth, on the other replica, waits: the doomed replica's leases hold.
    let fourth = tokio::spawn(send(optimize(&survivor, "sk-kill", "{}")));
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        upstream.seen(|s| s.started),
        3,
        "the fourth call is held across replicas"
    );
    doomed.kill();
    let killed = Instant::now();
    upstream.until("the fourth call", |s| s.started == 4).await;
    let took = killed.elapsed();
    assert!(
        took <= TTL + Duration::from_millis(1500),
        "the places came back {took:?} after SIGKILL (lease TTL {TTL:?})"
    );
    assert!(
        took >= Duration::from_secs(1),
        "not before the leases could expire ({took:?})"
    );
    let reply = fourth.await.expect("task");
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert!(
        survivor.stderr().is_empty() || !survivor.stderr().contains("panicked"),
        "{}",
        survivor.stderr()
    );
}

/// A global cap of 12 (2 kept from batches), starts not binding, keys `sk-a`
/// (workspace acme, on plan `pro`: 5 of its calls at once), `sk-b` (globex, on
/// no plan: the lane's 3) and `sk-c` (initech, put on `pro` at run time).
fn plan_policy(name: &str) -> String {
    let keys: String = [("sk-a", "acme"), ("sk-b", "globex"), ("sk-c", "initech")]
        .iter()
        .map(|(key, ws)| {
            format!(
                "\n    - {{ sha256: {}, workspace: {ws}, user: u-{ws} }}",
                support::sha256_hex(key)
            )
        })
        .collect();
    let yaml = lane_yaml(12)
        .edit("  keys: []", &format!("  keys:{keys}"))
        .edit(
            "headers:\n",
            "plans:\n  pro:\n    lanes: { optimizer: { workspace_in_flight: 5 } }\nworkspaces:\n  acme: { plan: pro }\nheaders:\n",
        );
    write_policy(name, yaml)
}

/// Sends `n` optimize calls with each key at once, spread over `replicas`, and
/// checks each was served.
async fn optimize_all(replicas: &[Sluice], keys: &[&str], n: usize) {
    let tasks: Vec<_> = (0..n * keys.len())
        .map(|i| {
            let request = optimize(&replicas[i % replicas.len()], keys[i % keys.len()], "{}");
            tokio::spawn(async move {
                let r = send(request).await;
                (r.status.as_u16(), r.text())
            })
        })
        .collect();
    for t in tasks {
        let (status, body) = t.await.expect("task");
        assert_eq!(status, 200, "served after a wait within 15 s: {body}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p3_d2_a_plans_lane_limits_hold_across_three_replicas_and_a_runtime_change_too() {
    let redis = RedisServer::start("lanes-plans");
    let upstream = Upstream::start().await;
    let policy = plan_policy("plans.yaml");
    let replicas: Vec<Sluice> = (0..3)
        .map(|_| replica(&policy, &redis, &upstream))
        .collect();
    // 10 calls each of acme (pro) and globex (no plan), all at once.
    optimize_all(&replicas, &["sk-a", "sk-b"], 10).await;
    let most = upstream.seen(|s| s.most.clone());
    assert_eq!(
        most.get("acme"),
        Some(&5),
        "pro's 5 at once across replicas, reached and never passed: {most:?}"
    );
    assert_eq!(most.get("globex"), Some(&3), "the lane's 3: {most:?}");
    // initech goes on pro through one replica's admin API; every replica then
    // lets 5 of its calls run at once.
    let put = send(
        Request::put(replicas[1].admin_url("/tenants/workspaces/initech"))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(br#"{"plan":"pro"}"#)))
            .expect("request"),
    )
    .await;
    assert_eq!(put.status, 204, "{}", put.text());
    let started = Instant::now();
    for replica in &replicas {
        loop {
            let reply = support::get(&replica.admin_url("/tenants/workspaces/initech")).await;
            if reply.json()["limits"]["lanes"]["optimizer.workspace_in_flight"] == 5 {
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "a replica never put initech on pro"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    optimize_all(&replicas, &["sk-c"], 10).await;
    let most = upstream.seen(|s| s.most.clone());
    assert_eq!(most.get("initech"), Some(&5), "{most:?}");
}
