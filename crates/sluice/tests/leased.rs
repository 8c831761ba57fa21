//! D4, leased budgets on real replicas: `sluice serve` processes on one real
//! `redis-server`, a caller's read class and IP ceiling leased. Together they
//! admit no more than the bound `limit + N × lease` a window — in fact no more
//! than `limit` units taken from any one window's counter — while Redis serves
//! far fewer than one script call per request; `/status` and `/metrics` say
//! what the leases did. A request holding an exact budget beside a leased one
//! is all or nothing; on the memory store a leased budget is exact. And
//! `sluice check --replicas N` prints the bound.

use crate::edit;
use edit::Edit as _;

use crate::support;

use std::collections::BTreeMap;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use support::redis::RedisServer;
use support::{Sluice, get, send};

const LEASE: u64 = 20;
const LIMIT: u64 = 300;

/// The default policy with `window` seconds, `leased` (classes or ceilings by
/// name) leased with `lease` units for `lease_ms`, `replicas` stated, decisions
/// waiting long enough for a debug build (fail_closed: nothing decided
/// locally), and `edits` made.
fn policy_with(
    name: &str,
    window: u64,
    leased: &[&str],
    lease_ms: u32,
    replicas: u32,
    edits: &[(&str, &str)],
) -> String {
    let dir = std::env::temp_dir().join(format!("sluice-leased-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join(format!("{name}.yaml"));
    let algorithms: String = leased
        .iter()
        .map(|b| {
            format!("  {b}: {{ consistency: leased, lease: {LEASE}, lease_ms: {lease_ms} }}\n")
        })
        .collect();
    let mut yaml = sluice_policy::DEFAULT_POLICY_YAML
        .edit(
            "window_seconds: 60\nprofiles",
            &format!("window_seconds: {window}\nprofiles"),
        )
        .edit("read: fail_open", "read: fail_closed")
        .edit("timeout_ms: 20", "timeout_ms: 2000")
        .edit("  replicas: 1", &format!("  replicas: {replicas}"))
        .edit("store:\n", &format!("algorithms:\n{algorithms}store:\n"));
    for (from, to) in edits {
        yaml = yaml.edit(from, to);
    }
    std::fs::write(&path, yaml).expect("write policy");
    path.to_str().expect("utf-8 path").to_owned()
}

/// The longest window (no run can straddle one), the read class and the IP
/// ceiling leased, for two replicas.
fn policy() -> String {
    policy_with("leased", 4_294_967_295, &["read", "ip"], 1000, 2, &[])
}

/// One GET of /search/fields as `key` on `url`: its status and, when admitted,
/// the reset of the window its units came from (`X-RateLimit-Reset`).
async fn read(url: &str, key: &str) -> (u16, Option<u64>) {
    let r = send(
        Request::get(url)
            .header("x-api-key", key)
            .body(Full::new(Bytes::new()))
            .expect("request"),
    )
    .await;
    let status = r.status.as_u16();
    assert!(status == 200 || status == 429, "decided: {status}");
    let reset = r
        .header("x-ratelimit-reset")
        .and_then(|v| v.parse().ok())
        .filter(|_| status == 200);
    (status, reset)
}

/// What `/status` says the replica's leases did.
async fn leases_of(replica: &Sluice) -> serde_json::Value {
    get(&replica.admin_url("/status")).await.json()["limiter"]["leases"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d4_two_replicas_admit_within_the_bound_with_few_redis_calls() {
    let redis = RedisServer::start("d4");
    let policy = policy();
    let replicas: Vec<Sluice> = (0..2)
        .map(|_| Sluice::spawn(&["--config", &policy, "--store", &redis.url()]))
        .collect();
    let calls_before = redis.script_calls();
    let commands_before = redis.commands();
    const WORKERS: usize = 4;
    const EACH: usize = 150;
    let tasks: Vec<_> = (0..WORKERS)
        .map(|w| {
            let urls: Vec<String> = replicas.iter().map(|r| r.url("/search/fields")).collect();
            tokio::spawn(async move {
                let mut admitted = 0u64;
                for i in 0..EACH {
                    let r = send(
                        Request::get(&urls[(w + i) % 2])
                            .header("x-api-key", "sk-leased")
                            .body(Full::new(Bytes::new()))
                            .expect("request"),
                    )
                    .await;
                    let status = r.status.as_u16();
                    assert!(status == 200 || status == 429, "decided: {status}");
                    admitted += u64::from(status == 200);
                }
                admitted
            })
        })
        .collect();
    let mut admitted = 0;
    for t in tasks {
        admitted += t.await.expect("task");
    }
    let requests = (WORKERS * EACH) as u64;
    let calls = redis.script_calls() - calls_before;
    let commands = redis.commands() - commands_before;
    eprintln!(
        "d4: {admitted} of {requests} admitted (limit {LIMIT}, bound {}), {calls} script calls, {commands} Redis commands",
        LIMIT + 2 * LEASE
    );
    assert!(
        admitted <= LIMIT + 2 * LEASE,
        "{admitted} admitted: above the bound"
    );
    // In one window leases only lend units the counter counted: at most the
    // limit, and at least what is left once both replicas' leases are gone.
    assert!(admitted <= LIMIT, "{admitted} admitted in one window");
    assert!(
        admitted >= LIMIT - 2 * LEASE,
        "{admitted} admitted: leases kept too much"
    );
    assert!(
        calls * 5 <= requests,
        "{calls} script calls for {requests} requests: leases should save most"
    );
    assert!(
        commands < requests,
        "{commands} Redis commands for {requests} requests: fewer than one each"
    );
    let mut taken = 0;
    let mut saved = 0;
    for r in &replicas {
        let status = get(&r.admin_url("/status")).await.json();
        let leases = &status["limiter"]["leases"];
        taken += leases["taken"].as_u64().expect("leases.taken");
        saved += leases["calls_saved"].as_u64().expect("leases.calls_saved");
        // The most that can have been admitted past a window on Redis's clock
        // (one host, clocks in pace: at most a lease's units at an edge).
        let seen = leases["over_admission_seen"]
            .as_u64()
            .expect("over_admission_seen");
        assert!(seen <= LEASE, "{seen} units may be over: {leases}");
        let metrics = get(&r.admin_url("/metrics")).await.text();
        assert!(
            metrics.contains("sluice_lease_calls_saved_total"),
            "{metrics}"
        );
    }
    assert!(taken >= 2, "both replicas took leases: {taken}");
    assert!(
        saved + calls >= requests,
        "every request decided by a lease or a call: {saved} saved, {calls} calls"
    );
}

#[test]
fn d4_check_prints_the_bound_for_the_stated_replicas() {
    let policy = policy();
    let out = Command::new(support::binary())
        .args(["check", &policy, "--replicas", "5"])
        .stdin(Stdio::null())
        .output()
        .expect("run sluice check");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("leased: read: leases of at most 20 units for at most 1000 ms; with 5 replica(s) at most 300 + 5 x 20 = 400 admitted"),
        "{text}"
    );
    let out = Command::new(support::binary())
        .args(["check", &policy])
        .stdin(Stdio::null())
        .output()
        .expect("run sluice check");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("with 2 replica(s) at most 300 + 2 x 20 = 340 admitted"),
        "the policy's store.replicas: {text}"
    );
}

/// Three replicas on one Redis, a 2-second window (load runs across several of
/// its edges), each replica taking leases of at most 20 units for at most
/// 500 ms: grouped by the window their units came from (the reset each
/// admitted answer states), no window lends more than its limit — so no
/// window of the server's clock admits more than `limit + 3 × lease` (a lease
/// outlives its window by at most the call's latency, and each replica holds
/// one). Every window reached its limit (the load is several times it), and
/// Redis served far fewer script calls than requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d4_three_replicas_across_window_edges_never_pass_the_bound() {
    const WINDOW: u64 = 2;
    const REPLICAS: usize = 3;
    let redis = RedisServer::start("d4-edges");
    let policy = policy_with("edges", WINDOW, &["read", "ip"], 500, 3, &[]);
    let replicas: Vec<Sluice> = (0..REPLICAS)
        .map(|_| Sluice::spawn(&["--config", &policy, "--store", &redis.url()]))
        .collect();
    let calls_before = redis.script_calls();
    // Load for three windows and a half: whole windows in the middle.
    let until = Instant::now() + Duration::from_millis(3 * WINDOW * 1000 + 1000);
    let tasks: Vec<_> = (0..6)
        .map(|w| {
            let url = replicas[w % REPLICAS].url("/search/fields");
            tokio::spawn(async move {
                let mut admitted: BTreeMap<u64, u64> = BTreeMap::new();
                let mut requests = 0u64;
                while Instant::now() < until {
                    requests += 1;
                    if let (200, Some(reset)) = read(&url, "sk-edges").await {
                        *admitted.entry(reset).or_default() += 1;
                    }
                }
                (admitted, requests)
            })
        })
        .collect();
    let mut admitted: BTreeMap<u64, u64> = BTreeMap::new();
    let mut requests = 0;
    for t in tasks {
        let (a, n) = t.await.expect("task");
        requests += n;
        for (reset, count) in a {
            *admitted.entry(reset).or_default() += count;
        }
    }
    let calls = redis.script_calls() - calls_before;
    let bound = LIMIT + REPLICAS as u64 * LEASE;
    eprintln!(
        "d4 edges: {requests} requests, admitted by window {admitted:?} (limit {LIMIT}, bound {bound}), {calls} script calls"
    );
    assert!(
        admitted.len() >= 3,
        "the load crossed window edges: {admitted:?}"
    );
    for (reset, &count) in &admitted {
        assert!(
            count <= LIMIT,
            "window ending {reset}: {count} admitted, above its limit (bound {bound})"
        );
    }
    // The whole windows (not the first or last, which the load only touched).
    let whole: Vec<u64> = admitted
        .values()
        .copied()
        .skip(1)
        .take(admitted.len().saturating_sub(2))
        .collect();
    assert!(
        whole.iter().all(|&c| c >= LIMIT - REPLICAS as u64 * LEASE),
        "a whole window under-admitted by more than the leases held: {whole:?}"
    );
    assert!(
        calls * 5 <= requests,
        "{calls} script calls for {requests} requests: leases should save most"
    );
    for r in &replicas {
        let leases = leases_of(r).await;
        assert!(
            leases["taken"].as_u64().expect("leases.taken") >= 1,
            "every replica decided from leases: {leases}"
        );
    }
}

/// A request holding an exact budget (the read class, 50 a window) and a leased
/// one (the IP ceiling, leased 20 at a time) is all or nothing: the 250
/// requests the read class refuses spend nothing of the IP ceiling's lease, so
/// another caller from the same IP still has its own 50.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d4_exact_and_leased_budgets_in_one_request_are_all_or_nothing() {
    let redis = RedisServer::start("d4-mixed");
    let policy = policy_with(
        "mixed",
        4_294_967_295,
        &["ip"],
        1000,
        1,
        &[("read: 300", "read: 50")],
    );
    let replica = Sluice::spawn(&["--config", &policy, "--store", &redis.url()]);
    let url = replica.url("/search/fields");
    let mut first = 0;
    for _ in 0..300 {
        first += u64::from(read(&url, "sk-first").await.0 == 200);
    }
    let mut second = 0;
    for _ in 0..60 {
        second += u64::from(read(&url, "sk-second").await.0 == 200);
    }
    assert_eq!(first, 50, "the exact read class admits its limit");
    assert_eq!(
        second, 50,
        "the leased IP ceiling spent only what was admitted (300 - 50 - a lease left)"
    );
    let leases = leases_of(&replica).await;
    assert!(leases["taken"].as_u64().expect("taken") >= 1, "{leases}");
    assert!(leases["calls_saved"].as_u64().is_some(), "{leases}");
}

/// On the memory store (one process) a leased budget is exact: no lease is
/// taken, and the read class admits exactly its limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d4_memory_store_stays_exact() {
    let policy = policy_with("memory", 4_294_967_295, &["read", "ip"], 1000, 1, &[]);
    let replica = Sluice::spawn(&["--config", &policy]);
    let url = replica.url("/search/fields");
    let mut admitted = 0;
    for _ in 0..(LIMIT + 50) {
        admitted += u64::from(read(&url, "sk-memory").await.0 == 200);
    }
    assert_eq!(admitted, LIMIT);
    let leases = leases_of(&replica).await;
    assert_eq!(leases["taken"], 0, "{leases}");
    assert_eq!(leases["calls_saved"], 0, "{leases}");
}

/// The reads `key` gets admitted on `url`, of `n` sent one after another.
async fn admitted_reads(url: &str, key: &str, n: usize) -> u64 {
    let mut admitted = 0;
    for _ in 0..n {
        admitted += u64::from(read(url, key).await.0 == 200);
    }
    admitted
}

/// A replica whose traffic stops with leases in hand gives back what they did
/// not spend once their time is up, with no request to carry it (the upkeep,
/// asleep until a lease is taken); one that stops (SIGTERM) gives back its
/// live leases on the way out. Either way the other replica then admits the
/// whole limit less what the first admitted, to the unit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d4_leftovers_go_back_when_a_replica_goes_quiet_or_stops() {
    let redis = RedisServer::start("d4-upkeep");
    let policy = policy_with(
        "upkeep",
        4_294_967_295,
        &["read", "ip"],
        1000,
        2,
        &[("{ ip: 300,", "{ ip: 100000,")],
    );
    let mut a = Sluice::spawn(&["--config", &policy, "--store", &redis.url()]);
    let b = Sluice::spawn(&["--config", &policy, "--store", &redis.url()]);
    const FIRST: u64 = 30;
    let url_a = a.url("/search/fields");
    let url_b = b.url("/search/fields");
    assert_eq!(
        admitted_reads(&url_a, "sk-quiet", FIRST as usize).await,
        FIRST
    );
    // Quiet: A's leases end after their `lease_ms` and go back.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let leases = leases_of(&a).await;
        if leases["returned"].as_u64().unwrap_or(0) >= 2 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no leftovers given back: {leases}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let commands = redis.commands();
    assert_eq!(
        admitted_reads(&url_b, "sk-quiet", LIMIT as usize + 10).await,
        LIMIT - FIRST,
        "B admits what A did not spend"
    );
    assert!(redis.commands() > commands);
    // Stopping: A's live leases go back on its way out.
    assert_eq!(
        admitted_reads(&url_a, "sk-stop", FIRST as usize).await,
        FIRST
    );
    let held = leases_of(&a).await;
    a.terminate();
    assert!(
        a.wait_exit(Duration::from_secs(20)).is_some(),
        "A stops on SIGTERM"
    );
    assert_eq!(
        admitted_reads(&url_b, "sk-stop", LIMIT as usize + 10).await,
        LIMIT - FIRST,
        "B admits what A held when it stopped: {held}"
    );
}
