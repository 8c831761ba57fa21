//! D4 beyond classes and ceilings: the rate-limit service's descriptor rules and
//! route buckets with `consistency: leased`, decided from leases on a real
//! `redis-server`, two replicas sharing it on one fake clock (the limiters' and
//! the Redis script's). Within the written bound, most calls decided with no
//! script call, and a request holding a leased and an exact budget still all or
//! nothing.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use sluice_core::{FakeClock, Timestamp};
use sluice_edge::Limiter;
use sluice_edge::descriptors::{Code, DescriptorCall, RateLimitCall};
use sluice_policy::parse_str;
use sluice_store::{RedisConfig, RedisStore};

use crate::redis_server;
use crate::support;

use redis_server::RedisServer;

/// Whole minutes since the epoch, ahead of the real clock Redis expires keys by.
const T0: u64 = 3_897_244_800 - 3_600;

/// Route bucket `exports`, 50 a minute per caller leased 5 at a time, beside the
/// exact class (100 a minute); domain `api`: `user` 100 a minute leased 10 at a
/// time, `path` 5 a minute, exact.
const POLICY: &str = "profile: p
window_seconds: 60
profiles:
  p:
    classes: { standard: 100 }
default_class: standard
identity:
  credentials: [x_api_key]
routes:
  - { method: GET, path: /exports, class: standard, buckets: [exports] }
buckets:
  exports: { limit: 50, window_seconds: 60, per: caller, consistency: leased, lease: 5, lease_ms: 1000 }
domains:
  - domain: api
    descriptors:
      - key: user
        rate_limit: { unit: minute, requests_per_unit: 100, consistency: leased, lease: 10, lease_ms: 1000 }
      - key: path
        rate_limit: { unit: minute, requests_per_unit: 5 }
";

async fn replica(server: &RedisServer, clock: &FakeClock) -> Limiter<RedisStore> {
    let policy = parse_str(POLICY, Path::new("leased.yaml")).expect("policy");
    let mut config = RedisConfig::new(server.url());
    config.timeout = Duration::from_millis(500);
    let redis = RedisStore::connect_with_clock(config, clock.clone())
        .await
        .expect("connect");
    Limiter::new(policy, redis).with_lease_clock(Arc::new(clock.clone()))
}

/// A call of domain `api` with one descriptor per (key, value).
fn call(entries: &[(&str, &str)]) -> RateLimitCall {
    RateLimitCall {
        domain: "api".to_owned(),
        descriptors: entries
            .iter()
            .map(|(k, v)| DescriptorCall {
                entries: vec![((*k).to_owned(), (*v).to_owned())],
                ..DescriptorCall::default()
            })
            .collect(),
        hits_addend: 1,
    }
}

/// Two replicas take turns calling for one user until both are refused: they
/// admit at least the limit less what their last leases may hold unspent, and
/// at most `limit + 2 × lease` (120); most calls cost no script call.
#[tokio::test]
async fn d4_leased_rules_admit_within_the_bound_and_save_script_calls() {
    let server = RedisServer::start("d4-rls");
    let clock = FakeClock::new(Timestamp::from_secs(T0 + 1));
    let replicas = [
        replica(&server, &clock).await,
        replica(&server, &clock).await,
    ];
    let before = server.script_calls();
    let mut admitted = 0;
    let mut calls = 0;
    for i in 0..400 {
        let answer = replicas[i % 2]
            .should_rate_limit(&call(&[("user", "ada")]))
            .await;
        calls += 1;
        admitted += usize::from(answer.overall == Code::Ok);
    }
    let scripts = server.script_calls() - before;
    eprintln!("d4 rls: {calls} calls, {admitted} admitted, {scripts} script calls");
    assert!(
        (80..=120).contains(&admitted),
        "admitted {admitted} of a limit of 100 leased 10 at a time by 2 replicas"
    );
    assert!(
        scripts * 4 <= calls,
        "{scripts} script calls for {calls} calls: leases save most of them"
    );
    let saved: u64 = replicas.iter().map(|r| r.lease_tally().saved).sum();
    assert!(saved >= 300, "{saved} calls decided from leases alone");
}

/// A call naming a leased rule (a lease in hand) and an exact rule that is
/// spent is refused whole: the leased rule's unit goes back to the lease.
#[tokio::test]
async fn d4_a_call_with_a_leased_and_a_spent_exact_rule_spends_neither() {
    let server = RedisServer::start("d4-rls-all-or-nothing");
    let clock = FakeClock::new(Timestamp::from_secs(T0 + 1));
    let limiter = replica(&server, &clock).await;
    let both = call(&[("user", "bo"), ("path", "/x")]);
    let user_only = call(&[("user", "bo")]);
    let mut last_ok = None;
    for _ in 0..5 {
        let answer = limiter.should_rate_limit(&both).await;
        assert_eq!(answer.overall, Code::Ok, "{answer:?}");
        last_ok = Some(answer.statuses[0].limit_remaining);
    }
    let refused = limiter.should_rate_limit(&both).await;
    assert_eq!(refused.overall, Code::OverLimit, "the path rule is spent");
    assert_eq!(refused.statuses[1].code, Code::OverLimit);
    let next = limiter.should_rate_limit(&user_only).await;
    assert_eq!(next.overall, Code::Ok);
    let before = last_ok.expect("five admitted");
    assert_eq!(
        next.statuses[0].limit_remaining,
        before - 1,
        "the refused call spent nothing of the leased rule"
    );
}

/// One GET of /exports as `key`: 200 when forwarded.
async fn export(limiter: &Limiter<RedisStore>, key: &str) -> u16 {
    support::send_as(limiter, key, "GET", "/exports", 1).await[0].0
}

/// A leased bucket beside an exact class: two replicas taking turns admit the
/// bucket's 50 within `50 + 2 × 5`, and once it is spent its refusals are
/// answered from the replicas' leases (known exhausted) with no script call;
/// the exact class still counts each admitted request on Redis.
#[tokio::test]
async fn d4_a_leased_bucket_admits_within_the_bound_beside_an_exact_class() {
    let server = RedisServer::start("d4-bucket");
    let clock = FakeClock::new(Timestamp::from_secs(T0 + 1));
    let replicas = [
        replica(&server, &clock).await,
        replica(&server, &clock).await,
    ];
    let mut admitted = 0;
    for i in 0..90 {
        admitted += usize::from(export(&replicas[i % 2], "cal").await == 200);
    }
    assert!(
        (40..=60).contains(&admitted),
        "admitted {admitted} of a bucket of 50 leased 5 at a time by 2 replicas"
    );
    let before = server.script_calls();
    for i in 0..40 {
        assert_eq!(export(&replicas[i % 2], "cal").await, 429, "spent");
    }
    let calls = server.script_calls() - before;
    assert!(
        calls <= 4,
        "{calls} script calls for 40 refusals of a bucket known spent"
    );
    let tally: u64 = replicas.iter().map(|r| r.lease_tally().taken).sum();
    assert!(tally >= 2, "{tally} leases taken");
}
