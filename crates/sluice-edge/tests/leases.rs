//! D4, leased budgets through the edge's phases on a real `redis-server`, with
//! the limiter's clock and the Redis script's clock one fake clock: a replica
//! with a lease in hand keeps deciding from it while Redis is down (and no
//! further), and decides on Redis again once it is back; concurrent requests of
//! one replica cost one script call per lease, not one each; an ended lease's
//! leftover goes back in the replica's next call, for other replicas to use;
//! and with Redis's clock apart from the replica's, Redis's clock decides
//! when a lease's window is over, and what may have been admitted past it is
//! counted.

use std::net::IpAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use sluice_core::{
    Clock, Decision, FakeClock, LeaseHolder, LeaseTerms, Local, Timestamp, take_lease,
};
use sluice_edge::Limiter;
use sluice_policy::{Policy, parse_str};
use sluice_store::{BudgetStore, RedisConfig, RedisStore};

use crate::redis_server;
use crate::support;

use redis_server::RedisServer;

/// Whole minutes since the epoch, ahead of the real clock Redis expires keys by.
const T0: u64 = 3_897_244_800 - 3_600;

const PEER: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(203, 0, 113, 9));

/// The standard class (100 a minute) and the IP ceiling (1000) leased 10 units
/// at a time for at most a second; nothing decided locally while Redis is down.
fn policy() -> Policy {
    let yaml = "profile: p
window_seconds: 60
ceilings:
  ip: { classes: [read, standard, expensive] }
  ip_protocol: { classes: [protocol], only: true }
profiles:
  p:
    classes: { protocol: 100, read: 100, standard: 100, expensive: 100 }
    ip_ceilings: { ip: 1000, ip_protocol: 1000 }
default_class: standard
algorithms:
  standard: { consistency: leased, lease: 10, lease_ms: 1000 }
  ip: { consistency: leased, lease: 10, lease_ms: 1000 }
store:
  timeout_ms: 200
  outage: { protocol: fail_closed, read: fail_closed, standard: fail_closed, expensive: fail_closed }
";
    match parse_str(yaml, Path::new("leases.yaml")) {
        Ok(policy) => policy,
        Err(e) => panic!("{e}"),
    }
}

async fn limiter(server: &RedisServer, clock: &FakeClock) -> Limiter<RedisStore> {
    limiter_with(server, clock, policy()).await
}

/// A limiter of `policy` on `server`, its leases and Redis's script on `clock`.
async fn limiter_with(
    server: &RedisServer,
    clock: &FakeClock,
    policy: Policy,
) -> Limiter<RedisStore> {
    let mut config = RedisConfig::new(server.url());
    config.timeout = Duration::from_millis(500);
    let redis = RedisStore::connect_with_clock(config, clock.clone())
        .await
        .expect("connect");
    Limiter::new(policy, redis).with_lease_clock(Arc::new(clock.clone()))
}

/// One GET through the limiter's phases as `key`: its status (200 when forwarded).
async fn send<S: BudgetStore>(limiter: &Limiter<S>, key: &str) -> u16 {
    let parts = support::request_as(key, "GET", "/things");
    let route = limiter.route(&parts).map_err(|e| e.to_string());
    let intake = limiter.intake(Ok(route.expect("route")), PEER);
    let planned = intake.planned(&parts.headers, None, None);
    match planned.admit(None).await {
        Ok(_) => 200,
        Err(answer) => answer.status().as_u16(),
    }
}

/// The units a replica's lease holds after `n` requests of cost 1 at one
/// instant, as sluice-core's model of a holder and a store says.
fn held_after(n: usize) -> u32 {
    let terms = LeaseTerms::new(
        std::num::NonZeroU32::new(10).expect("10"),
        std::num::NonZeroU32::new(1000).expect("1000"),
    );
    let budget = sluice_core::Budget::per_window(
        sluice_core::BudgetKey::new("model", b"c"),
        100,
        std::num::NonZeroU32::new(60).expect("60"),
    );
    let (mut holder, mut cell) = (LeaseHolder::new(terms), 0u64);
    let now = Timestamp::from_secs(T0 + 1);
    for _ in 0..n {
        if let Local::Ask { want, .. } = holder.decide(1, now) {
            let (d, granted): (Decision, u32) = take_lease(&budget, &mut cell, now, want);
            assert!(holder.granted(granted, 1, &d, now).is_none());
        }
    }
    holder.held()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d4_a_replica_decides_from_its_lease_during_an_outage_then_on_redis_again() {
    let mut server = RedisServer::start("d4-outage");
    let clock = FakeClock::new(Timestamp::from_secs(T0 + 1));
    let limiter = limiter(&server, &clock).await;
    const WARM: usize = 12;
    let held = held_after(WARM);
    assert!(held > 0, "the model holds a lease after {WARM} requests");
    for _ in 0..WARM {
        assert_eq!(send(&limiter, "k").await, 200);
    }
    server.kill();
    // Redis is gone: the lease in hand decides, then nothing is admitted.
    let mut during = Vec::new();
    for _ in 0..(held + 3) {
        during.push(send(&limiter, "k").await);
    }
    let admitted = during.iter().filter(|&&s| s == 200).count();
    assert_eq!(
        admitted,
        usize::try_from(held).expect("held"),
        "the lease's units, then refusals: {during:?}"
    );
    assert!(
        during[..admitted].iter().all(|&s| s == 200)
            && during[admitted..].iter().all(|&s| s == 503),
        "fail_closed once the lease is spent: {during:?}"
    );
    let tally = limiter.lease_tally();
    assert!(tally.saved >= u64::from(held), "{tally:?}");
    // Back: decided on Redis again (a fresh Redis: the window starts over).
    server.restart();
    clock.advance(Duration::from_secs(2));
    let mut after = 503;
    for _ in 0..50 {
        after = send(&limiter, "k").await;
        if after == 200 {
            break;
        }
        // The store reconnects on its own; each try is a decision, not a wait.
        tokio::task::yield_now().await;
    }
    assert_eq!(after, 200, "decided on Redis again once it is back");
}

#[tokio::test]
async fn d4_concurrent_requests_of_one_replica_wait_for_one_ask() {
    let server = RedisServer::start("d4-asks");
    let clock = FakeClock::new(Timestamp::from_secs(T0 + 1));
    let limiter = Arc::new(limiter(&server, &clock).await);
    let before = server.script_calls();
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..50 {
        let limiter = Arc::clone(&limiter);
        set.spawn(async move { send(&limiter, "busy").await });
    }
    let mut admitted = 0;
    while let Some(status) = set.join_next().await {
        admitted += usize::from(status.expect("task") == 200);
    }
    let calls = server.script_calls() - before;
    eprintln!("d4 asks: 50 concurrent requests, {calls} script calls");
    assert_eq!(admitted, 50);
    // Leases of 2, 3, 5, 9, then 10 (the lease) units: about one call per lease
    // (the requests asking wait for one ask), where exact decisions take 50.
    assert!(
        calls <= 10,
        "{calls} script calls for 50 concurrent requests"
    );
    assert!(limiter.lease_tally().taken >= 4);
}

/// Two replicas on one Redis and one fake clock, a budget of 20 leased 10 at a
/// time. Replica A's six requests take leases of 2, 3 and 5 units (10 from
/// Redis) and leave 4 unspent; once `lease_ms` is past, A's next request gives
/// those 4 back in its own script call, taking a lease of 2. Replica B then
/// finds 20 - 10 + 4 - 2 = 12 units and admits exactly 12 (it would find 10
/// had the leftover stayed with A), and no more than the limit is admitted in
/// all.
#[tokio::test]
async fn d4_leftovers_go_back_in_the_next_call_for_other_replicas_to_use() {
    let server = RedisServer::start("d4-give-back");
    let clock = FakeClock::new(Timestamp::from_secs(T0 + 1));
    let policy = || {
        let yaml = "profile: p
window_seconds: 60
ceilings:
  ip: { classes: [read, standard, expensive] }
  ip_protocol: { classes: [protocol], only: true }
profiles:
  p:
    classes: { protocol: 100, read: 100, standard: 20, expensive: 100 }
    ip_ceilings: { ip: 1000, ip_protocol: 1000 }
default_class: standard
algorithms:
  standard: { consistency: leased, lease: 10, lease_ms: 1000 }
";
        parse_str(yaml, Path::new("give-back.yaml")).expect("policy")
    };
    let replica = || async {
        let mut config = RedisConfig::new(server.url());
        config.timeout = Duration::from_millis(500);
        let redis = RedisStore::connect_with_clock(config, clock.clone())
            .await
            .expect("connect");
        Limiter::new(policy(), redis).with_lease_clock(Arc::new(clock.clone()))
    };
    let (a, b) = (replica().await, replica().await);
    let mut admitted_a = 0;
    for _ in 0..6 {
        admitted_a += usize::from(send(&a, "shared").await == 200);
    }
    assert_eq!(admitted_a, 6);
    clock.advance(Duration::from_millis(1_500));
    admitted_a += usize::from(send(&a, "shared").await == 200);
    assert_eq!(admitted_a, 7);
    assert_eq!(a.lease_tally().returned, 1, "{:?}", a.lease_tally());
    let mut admitted_b = 0;
    for _ in 0..30 {
        admitted_b += usize::from(send(&b, "shared").await == 200);
    }
    assert_eq!(admitted_b, 12, "the 4 units A gave back were B's to use");
    // A's lease of 2 holds 1: 7 + 12 + 1 = 20, the limit.
    assert_eq!(send(&a, "shared").await, 200);
    assert_eq!(send(&a, "shared").await, 429);
}

/// The Redis script's clock, apart from the replica's: reading it (once a
/// script call) moves the replica's clock on by the call's latency, as the
/// answer arrives that much later there.
struct Apart {
    redis: FakeClock,
    replica: FakeClock,
    latency_ms: Arc<AtomicU64>,
}

impl Clock for Apart {
    fn now(&self) -> Timestamp {
        let ms = self.latency_ms.load(Ordering::SeqCst);
        self.replica.advance(Duration::from_millis(ms));
        self.redis.now()
    }
}

/// A lease taken at 59.0 s of a minute lives until the minute's end on the
/// replica's clock. Redis's clock then runs 0.5 s ahead and a call takes
/// 0.4 s: at 59.6 s here Redis may be past the minute (59.6 + 0.5) though
/// surely not (59.6 + 0.1), so the units admitted from the leases are counted
/// as the over-admission seen. Redis's clock then steps to 61 s: the next call
/// shows it surely past the minute, so the leases of the old minute end there,
/// before their own time, and the caller is decided on Redis in its new minute
/// rather than admitted from a lease of the old one.
#[tokio::test]
async fn d4_redis_clock_decides_when_a_lease_window_is_over() {
    let server = RedisServer::start("d4-clocks");
    let start = Timestamp::from_secs(T0 + 59);
    let (redis_clock, replica_clock) = (FakeClock::new(start), FakeClock::new(start));
    let latency_ms = Arc::new(AtomicU64::new(0));
    let apart = Apart {
        redis: redis_clock.clone(),
        replica: replica_clock.clone(),
        latency_ms: Arc::clone(&latency_ms),
    };
    let mut config = RedisConfig::new(server.url());
    config.timeout = Duration::from_millis(500);
    let redis = RedisStore::connect_with_clock(config, apart)
        .await
        .expect("connect");
    let limiter = Limiter::new(policy(), redis).with_lease_clock(Arc::new(replica_clock.clone()));
    for _ in 0..6 {
        assert_eq!(send(&limiter, "k").await, 200);
    }
    assert!(
        held_after(6) > 0,
        "the model holds a lease after 6 requests"
    );
    assert_eq!(limiter.lease_tally().over_admission_seen, 0);

    // Redis 0.5 s ahead, a call 0.4 s long: "other" asks for its lease.
    redis_clock.advance(Duration::from_millis(500));
    latency_ms.store(400, Ordering::SeqCst);
    assert_eq!(send(&limiter, "other").await, 200);
    latency_ms.store(0, Ordering::SeqCst);
    replica_clock.set(Timestamp::from_nanos(
        (T0 + 59) * 1_000_000_000 + 600_000_000,
    ));
    let before = limiter.lease_tally();
    assert_eq!(send(&limiter, "k").await, 200);
    let after = limiter.lease_tally();
    assert_eq!(after.saved, before.saved + 1, "admitted from its leases");
    assert_eq!(
        after.over_admission_seen,
        before.over_admission_seen + 2,
        "one unit of the class and one of the IP ceiling may be past their minute"
    );

    // Redis steps past the minute: the next call ("third") shows it.
    redis_clock.set(Timestamp::from_secs(T0 + 61));
    assert_eq!(send(&limiter, "third").await, 200);
    let before = limiter.lease_tally();
    assert_eq!(send(&limiter, "k").await, 200);
    let after = limiter.lease_tally();
    assert_eq!(
        after.saved, before.saved,
        "decided on Redis, not from a lease"
    );
    // The class's lease of the old minute ends here; the IP ceiling's was
    // renewed by "third"'s call, in Redis's new minute, and ended then.
    assert_eq!(after.expired, before.expired + 1, "the lease ended early");
    assert_eq!(after.over_admission_seen, before.over_admission_seen);
}

/// Redis answering slowly: a lease three quarters spent is renewed early by
/// one request, and while Redis holds that request back the replica's next
/// requests are admitted from the rest of the lease without waiting; once
/// Redis answers, the renewal adds to the lease in hand (never past `lease`).
/// Eight requests leave the class's and the IP ceiling's leases holding 2 of
/// 5 units each (renewed at three quarters from 1 to 3 to 5); the ninth asks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d4_a_lease_is_renewed_early_and_spent_meanwhile_while_redis_is_slow() {
    let server = RedisServer::start("d4-renew");
    let clock = FakeClock::new(Timestamp::from_secs(T0 + 1));
    let mut config = RedisConfig::new(server.url());
    // Longer than the test holds Redis back: the renewal waits for its answer.
    config.timeout = Duration::from_secs(10);
    let redis = RedisStore::connect_with_clock(config, clock.clone())
        .await
        .expect("connect");
    let limiter = Arc::new(Limiter::new(policy(), redis).with_lease_clock(Arc::new(clock.clone())));
    for _ in 0..8 {
        assert_eq!(send(&limiter, "k").await, 200);
    }
    let before = limiter.lease_tally();
    // Redis holds back every write (a script call) until told otherwise.
    server.cli(&["CLIENT", "PAUSE", "20000", "WRITE"]);
    let asker = tokio::spawn({
        let limiter = Arc::clone(&limiter);
        async move { send(&limiter, "k").await }
    });
    let mut held_back = false;
    for _ in 0..2_000 {
        if server
            .cli(&["INFO", "clients"])
            .contains("blocked_clients:1")
        {
            held_back = true;
            break;
        }
        tokio::task::yield_now().await;
    }
    assert!(
        held_back,
        "the ninth request asks Redis to renew its leases"
    );
    for _ in 0..2 {
        assert_eq!(send(&limiter, "k").await, 200);
    }
    assert!(
        !asker.is_finished(),
        "admitted from the rest of the leases while the renewal waits for Redis"
    );
    assert_eq!(limiter.lease_tally().saved, before.saved + 2);
    server.cli(&["CLIENT", "UNPAUSE"]);
    assert_eq!(asker.await.expect("the asking request"), 200);
    let after = limiter.lease_tally();
    assert_eq!(
        after.taken,
        before.taken + 2,
        "both leases renewed: {after:?}"
    );
    assert_eq!(after.returned, before.returned, "renewed, not ended");
}

/// A replica's traffic stops with a lease in hand: no request comes to give
/// its leftovers back, so the upkeep does ([`Limiter::keep_leases`], which
/// `sluice serve` runs every `SWEEP_EVERY` while leases are held): once the
/// lease's time is up, what it did not spend is the other replicas' again, and
/// at shutdown a lease still live is ended and given back the same way.
#[tokio::test]
async fn d4_the_upkeep_gives_leftovers_back_when_no_request_comes() {
    let server = RedisServer::start("d4-upkeep");
    let clock = FakeClock::new(Timestamp::from_secs(T0 + 1));
    let (a, b) = (
        limiter(&server, &clock).await,
        limiter(&server, &clock).await,
    );
    for _ in 0..12 {
        assert_eq!(send(&a, "quiet").await, 200);
    }
    let held = held_after(12);
    assert!(held > 0, "A holds a lease of {held}");
    assert!(a.keep_leases(false).await, "a lease in hand: more to do");
    assert_eq!(a.lease_tally().returned, 0, "its time is not up");
    clock.advance(Duration::from_millis(1_500));
    let before = server.script_calls();
    assert!(!a.keep_leases(false).await, "nothing held, nothing waiting");
    assert_eq!(
        a.lease_tally().returned,
        2,
        "the class's and the IP's leases"
    );
    assert_eq!(server.script_calls() - before, 1, "given back in one call");
    let mut admitted_b = 0;
    for _ in 0..100 {
        admitted_b += usize::from(send(&b, "quiet").await == 200);
    }
    assert_eq!(admitted_b, 100 - 12, "the limit less what A admitted");
    // At shutdown: B's last lease is live, and ends.
    let c = limiter(&server, &clock).await;
    for _ in 0..5 {
        assert_eq!(send(&c, "other").await, 200);
    }
    assert!(c.keep_leases(true).await || c.lease_tally().returned > 0);
    assert!(!c.keep_leases(false).await, "ended and given back");
    let mut admitted_d = 0;
    for _ in 0..100 {
        admitted_d += usize::from(send(&b, "other").await == 200);
    }
    assert_eq!(admitted_d, 100 - 5, "the limit less what C admitted");
}

/// A JSON-RPC batch of more calls than the leased class's whole limit can
/// never fit (SPEC H2): refused without `Retry-After`, also while the class is known exhausted and every
/// other request of it is refused from what the replica knows.
#[tokio::test]
async fn d4_a_batch_past_the_limit_of_an_exhausted_leased_class_is_never_to_be_retried() {
    let server = RedisServer::start("d4-never");
    let clock = FakeClock::new(Timestamp::from_secs(T0 + 1));
    let yaml = "profile: p
window_seconds: 60
ceilings:
  ip: { classes: [read, standard, expensive] }
  ip_protocol: { classes: [protocol], only: true }
profiles:
  p:
    classes: { protocol: 100, read: 100, standard: 100, expensive: 3 }
    ip_ceilings: { ip: 1000, ip_protocol: 1000 }
default_class: standard
routes:
  - { method: POST, path: /mcp, jsonrpc: true }
jsonrpc:
  tools:
    t: { class: expensive }
algorithms:
  expensive: { consistency: leased, lease: 2, lease_ms: 1000 }
  ip: { consistency: leased, lease: 10, lease_ms: 1000 }
";
    let policy = parse_str(yaml, Path::new("never.yaml")).expect("policy");
    let limiter = limiter_with(&server, &clock, policy).await;
    let call = |id: usize| {
        format!(r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{{"name":"t"}}}}"#)
    };
    let post = |body: String| {
        let limiter = &limiter;
        async move {
            let mut parts = support::request_as("k", "POST", "/mcp");
            parts.headers.insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static("application/json"),
            );
            let route = limiter.route(&parts).map_err(|e| e.to_string());
            let intake = limiter.intake(Ok(route.expect("route")), PEER);
            let planned = intake.planned(&parts.headers, None, Some(body.as_bytes()));
            match planned.admit(None).await {
                Ok(_) => (200, None, String::new()),
                Err(answer) => {
                    let retry = answer
                        .headers()
                        .get(http::header::RETRY_AFTER)
                        .map(|v| v.to_str().unwrap_or_default().to_owned());
                    let status = answer.status().as_u16();
                    let body = http_body_util::BodyExt::collect(answer.into_body())
                        .await
                        .map(|c| c.to_bytes())
                        .unwrap_or_default();
                    (status, retry, String::from_utf8_lossy(&body).into_owned())
                }
            }
        }
    };
    let mut statuses = Vec::new();
    for id in 0..5 {
        statuses.push(post(call(id)).await.0);
    }
    assert_eq!(
        statuses.iter().filter(|&&s| s == 200).count(),
        3,
        "{statuses:?}"
    );
    let before = limiter.lease_tally().saved;
    let (status, retry, _) = post(call(9)).await;
    assert!(
        status != 200 && retry.is_some(),
        "exhausted: wait for the reset"
    );
    assert_eq!(
        limiter.lease_tally().saved,
        before + 1,
        "known exhausted, no store call"
    );
    let batch = format!("[{},{},{},{}]", call(10), call(11), call(12), call(13));
    let (status, retry, body) = post(batch).await;
    assert_ne!(status, 200);
    assert_eq!(retry, None, "four calls never fit a limit of 3: {body}");
}

/// Redis's clock 5 s ahead of the replica's: a request admitted from a lease
/// is stamped on Redis's clock, as one Redis decided, so settling it (an
/// adjustment at that time) goes to the window its units came from, and its
/// reset's seconds are reckoned against Redis's window.
#[tokio::test]
async fn d4_a_decision_from_a_lease_is_stamped_on_the_redis_clock() {
    let server = RedisServer::start("d4-stamp");
    let start = Timestamp::from_secs(T0 + 10);
    let (redis_clock, replica_clock) = (
        FakeClock::new(Timestamp::from_secs(T0 + 15)),
        FakeClock::new(start),
    );
    let apart = Apart {
        redis: redis_clock.clone(),
        replica: replica_clock.clone(),
        latency_ms: Arc::new(AtomicU64::new(0)),
    };
    let mut config = RedisConfig::new(server.url());
    config.timeout = Duration::from_millis(500);
    let redis = RedisStore::connect_with_clock(config, apart)
        .await
        .expect("connect");
    let limiter = Limiter::new(policy(), redis).with_lease_clock(Arc::new(replica_clock.clone()));
    let mut stamps = Vec::new();
    for _ in 0..12 {
        let parts = support::request_as("k", "GET", "/things");
        let route = limiter.route(&parts).map_err(|e| e.to_string());
        let intake = limiter.intake(Ok(route.expect("route")), PEER);
        let planned = intake.planned(&parts.headers, None, None);
        let forward = planned.admit(None).await.expect("admitted");
        stamps.push(forward.decision().decided_at());
    }
    assert!(limiter.lease_tally().saved > 0, "some decided from leases");
    assert!(
        stamps.iter().all(|&t| t == redis_clock.now()),
        "every decision on Redis's clock ({:?}), the replica's at {:?}: {stamps:?}",
        redis_clock.now(),
        replica_clock.now()
    );
}
