//! E8, D3 and R1 after a store outage (issue 39, item 6): the real binary, two
//! `sluice serve --rls` replicas on one real `redis-server`. Redis is restarted
//! (killed and started again on the same socket: every connection the replicas
//! held is closed) and left idle; then bursts of concurrent rate-limit service
//! calls on one counter of 5. Every call is decided on Redis — exactly 5
//! admitted in all, none answered by the outage rule (which, `fail_open`, would
//! admit them). And the gateway's own path, which the report saw hold: its
//! `fail_open` decides on this replica's share (`limit / store.replicas`), which
//! held near the limit while every decision it made was an outage one. After the
//! restart a burst of registrations (5 a minute per address, E7) is decided on
//! Redis, none on a replica's share.
//!
//! The calls are made by a small gRPC client written here (HTTP/2 and the few
//! protobuf fields a `ShouldRateLimit` call needs), so that a thousand of them
//! can be in flight at once.

use crate::support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::{BufMut as _, Bytes, BytesMut};
use http::Request;
use http_body_util::{BodyExt as _, Full};
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo};
use support::redis::RedisServer;
use support::{DataDir, Sluice};

/// One rule of 5 on `user`. A year rather than a minute: the same counter,
/// and no run can straddle its window's end.
const DOMAINS: &str = "domains:
  - domain: api
    descriptors:
      - key: user
        rate_limit: { unit: year, requests_per_unit: 5 }
";

/// Calls in one burst (as in the report: 1,000 at once over two replicas).
const BURST: usize = 1_000;

/// HTTP/2 connections per replica (each carries at most 256 calls at once).
const CONNECTIONS: usize = 4;

/// The longest a burst may take.
const BURST_TIMEOUT: Duration = Duration::from_secs(120);

/// The built-in policy with `DOMAINS`, and a store timeout that replicas on two
/// busy cores meet (a timeout is not what this test is about).
fn policy(dir: &DataDir) -> String {
    std::fs::create_dir_all(&dir.0).expect("test directory");
    let default = sluice_policy::DEFAULT_POLICY_YAML;
    assert!(default.contains("\nheaders:\n") && default.contains("timeout_ms: 20\n"));
    let yaml = default
        .replacen("\nheaders:\n", &format!("\n{DOMAINS}headers:\n"), 1)
        .replacen("timeout_ms: 20\n", "timeout_ms: 2000\n", 1);
    let path = dir.0.join("recovery.yaml");
    std::fs::write(&path, yaml).expect("write policy");
    path.to_str().expect("utf-8 path").to_owned()
}

/// A protobuf length-delimited field.
fn field(out: &mut BytesMut, number: u32, bytes: &[u8]) {
    varint(out, u64::from(number << 3 | 2));
    varint(out, bytes.len() as u64);
    out.put_slice(bytes);
}

fn varint(out: &mut BytesMut, mut v: u64) {
    while v >= 0x80 {
        out.put_u8((v as u8 & 0x7f) | 0x80);
        v >>= 7;
    }
    out.put_u8(v as u8);
}

/// A `RateLimitRequest` for `domain` with one descriptor of one entry, framed
/// as one gRPC message.
fn rate_limit_request(domain: &str, key: &str, value: &str) -> Bytes {
    let mut entry = BytesMut::new();
    field(&mut entry, 1, key.as_bytes());
    field(&mut entry, 2, value.as_bytes());
    let mut descriptor = BytesMut::new();
    field(&mut descriptor, 1, &entry);
    let mut message = BytesMut::new();
    field(&mut message, 1, domain.as_bytes());
    field(&mut message, 2, &descriptor);
    let mut framed = BytesMut::new();
    framed.put_u8(0);
    framed.put_u32(u32::try_from(message.len()).expect("small"));
    framed.put_slice(&message);
    framed.freeze()
}

/// A `RateLimitResponse`'s `overall_code` (field 1; 0, `UNKNOWN`, when absent).
fn overall_code(framed: &[u8]) -> u64 {
    let mut rest = framed.get(5..).expect("a gRPC message");
    let read_varint = |rest: &mut &[u8]| {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let (&b, tail) = rest.split_first().expect("a whole varint");
            *rest = tail;
            v |= u64::from(b & 0x7f) << shift;
            if b < 0x80 {
                break;
            }
        }
        v
    };
    while !rest.is_empty() {
        let tag = read_varint(&mut rest);
        match tag & 7 {
            0 if tag >> 3 == 1 => return read_varint(&mut rest),
            0 => {
                read_varint(&mut rest);
            }
            2 => {
                let len = usize::try_from(read_varint(&mut rest)).expect("length");
                rest = &rest[len..];
            }
            wire => panic!("unexpected wire type {wire} in the answer"),
        }
    }
    0
}

/// `RateLimitResponse.Code`.
const OK: u64 = 1;
const OVER_LIMIT: u64 = 2;

/// An HTTP/2 connection to a replica's rate-limit service.
async fn connect(addr: SocketAddr) -> SendRequest<Full<Bytes>> {
    let stream = tokio::net::TcpStream::connect(addr)
        .await
        .expect("connect to the rate-limit service");
    let (send, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
            .await
            .expect("HTTP/2 handshake");
    tokio::spawn(conn);
    send
}

/// One `ShouldRateLimit` call: its overall code.
async fn should_rate_limit(mut send: SendRequest<Full<Bytes>>, body: Bytes) -> u64 {
    let request = Request::post("/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit")
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(Full::new(body))
        .expect("request");
    send.ready().await.expect("connection ready");
    let response = send.send_request(request).await.expect("an answer");
    let collected = response.into_body().collect().await.expect("the body");
    let status = collected
        .trailers()
        .and_then(|t| t.get("grpc-status"))
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    assert_eq!(status.as_deref(), Some("0"), "grpc-status");
    overall_code(&collected.to_bytes())
}

/// `BURST` calls on `user=value` at once, spread over `replicas`: (OK,
/// OVER_LIMIT).
async fn burst(replicas: &[Sluice], value: &str) -> (usize, usize) {
    let mut connections = Vec::new();
    for replica in replicas {
        for _ in 0..CONNECTIONS {
            connections.push(connect(replica.start.rls.expect("started with --rls")).await);
        }
    }
    let body = rate_limit_request("api", "user", value);
    let calls: Vec<_> = (0..BURST)
        .map(|i| {
            let send = connections[i % connections.len()].clone();
            tokio::spawn(should_rate_limit(send, body.clone()))
        })
        .collect();
    let answered = async {
        let (mut ok, mut over) = (0, 0);
        for call in calls {
            match call.await.expect("call task") {
                OK => ok += 1,
                OVER_LIMIT => over += 1,
                code => panic!("overall code {code}"),
            }
        }
        (ok, over)
    };
    tokio::time::timeout(BURST_TIMEOUT, answered)
        .await
        .expect("the burst answered in time")
}

/// Calls `replica` answered by the outage rule so far
/// (`sluice_rls_requests_total{outcome="outage"}`).
async fn outages(replica: &Sluice) -> f64 {
    let metrics = support::get(&replica.admin_url("/metrics")).await.text();
    metrics
        .lines()
        .filter(|l| l.starts_with("sluice_rls_requests_total") && l.contains("outcome=\"outage\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Waits (bounded) until `server` answers `PING`.
fn wait_until_it_answers(server: &RedisServer) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !server.cli(&["PING"]).contains("PONG") {
        assert!(
            Instant::now() < deadline,
            "redis-server does not answer PING"
        );
        std::thread::yield_now();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e8_r1_d3_a_burst_right_after_redis_restarts_is_decided_on_redis() {
    let mut redis = RedisServer::start("recovery");
    let dir = DataDir::new();
    let policy = policy(&dir);
    let replicas: Vec<Sluice> = (0..2)
        .map(|_| {
            Sluice::spawn(&[
                "--config",
                &policy,
                "--rls",
                "127.0.0.1:0",
                "--store",
                &redis.url(),
            ])
        })
        .collect();
    // Every connection the bursts will use is open (and answering) before
    // the restart: each replica's shared one and each of its threads' own.
    for _ in 0..2 {
        let (ok, over) = burst(&replicas, "warm").await;
        assert!(
            ok <= 5 && ok + over == BURST,
            "warming up: {ok} OK, {over} over"
        );
    }
    for replica in &replicas {
        assert_eq!(outages(replica).await, 0.0, "before the restart");
    }
    redis.restart();
    wait_until_it_answers(&redis);
    // Idle, as in the report (10 s there): nothing asks the closed
    // connections anything until the first burst.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut admitted = Vec::new();
    for _ in 0..3 {
        let (ok, over) = burst(&replicas, "ada").await;
        assert_eq!(ok + over, BURST);
        admitted.push(ok);
    }
    let mut counted = Vec::new();
    for replica in &replicas {
        counted.push(outages(replica).await);
    }
    assert_eq!(
        counted,
        [0.0, 0.0],
        "calls answered by the outage rule, per replica (admitted per burst: {admitted:?})"
    );
    assert_eq!(
        admitted,
        [5, 0, 0],
        "admitted per burst: exactly the rule's 5"
    );
}

/// Local decisions so far (`sluice_local_decisions_total`): decisions made on
/// this replica's share because the store could not decide.
async fn local_decisions(replica: &Sluice) -> f64 {
    let metrics = support::get(&replica.admin_url("/metrics")).await.text();
    metrics
        .lines()
        .filter(|l| l.starts_with("sluice_local_decisions_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// `n` requests at once, spread over `replicas`' gateways: the statuses.
async fn gateway_burst(replicas: &[Sluice], method: &str, path: &str, n: usize) -> Vec<u16> {
    let calls: Vec<_> = (0..n)
        .map(|i| {
            let request = Request::builder()
                .method(method)
                .uri(replicas[i % replicas.len()].url(path))
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from_static(b"{}")))
                .expect("request");
            tokio::spawn(support::send(request))
        })
        .collect();
    let mut statuses = Vec::with_capacity(n);
    for call in calls {
        statuses.push(call.await.expect("request task").status.as_u16());
    }
    statuses
}

/// Waits until the current minute has more than 10 s left, so that a burst on
/// a per-minute budget does not straddle a window's end (windows are aligned
/// to the epoch, on the Redis server's clock, this machine's).
async fn clear_of_a_minute_end() {
    let into_minute = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("after the epoch")
            .as_millis()
            % 60_000
    };
    let deadline = Instant::now() + Duration::from_secs(15);
    while into_minute() > 50_000 {
        assert!(Instant::now() < deadline, "the minute did not turn");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e8_e7_d3_a_gateway_burst_right_after_redis_restarts_is_decided_on_redis() {
    const REGISTRATIONS: usize = 60;
    let mut redis = RedisServer::start("recovery-gateway");
    let dir = DataDir::new();
    let policy = policy(&dir);
    let replicas: Vec<Sluice> = (0..2)
        .map(|_| Sluice::spawn(&["--config", &policy, "--store", &redis.url()]))
        .collect();
    // Every connection the burst will use is open before the restart: each
    // replica's shared one and each of its workers' own.
    for _ in 0..2 {
        let statuses = gateway_burst(&replicas, "GET", "/", 200).await;
        assert!(
            statuses.iter().all(|s| *s != 503),
            "warming up: {statuses:?}"
        );
    }
    for replica in &replicas {
        assert_eq!(local_decisions(replica).await, 0.0, "before the restart");
    }
    redis.restart();
    wait_until_it_answers(&redis);
    // Idle, as in the report: nothing asks the closed connections anything.
    tokio::time::sleep(Duration::from_secs(2)).await;
    clear_of_a_minute_end().await;
    let statuses = gateway_burst(&replicas, "POST", "/oauth/register", REGISTRATIONS).await;
    let refused = statuses.iter().filter(|s| **s == 429).count();
    let mut local = Vec::new();
    for replica in &replicas {
        local.push(local_decisions(replica).await);
    }
    assert_eq!(
        local,
        [0.0, 0.0],
        "decisions made on a replica's share, per replica (statuses: {statuses:?})"
    );
    assert_eq!(
        REGISTRATIONS - refused,
        5,
        "registrations let through of {REGISTRATIONS}: {statuses:?}"
    );
}
