//! P5, dry runs: a budget in shadow mode is decided and counted as usual, and a
//! refusal it would give is counted and forwarded instead; the rest of the policy
//! still refuses as before. Driven through the phase contract (`sluice_edge::exchange`)
//! on a fake clock, so no window boundary is crossed.

use std::path::Path;

use sluice_policy::{Policy, parse_str};

use crate::support;
use sluice_core::Timestamp;
use sluice_edge::Limiter;
use sluice_store::{MemoryConfig, MemoryStore};
use support::{PEER, T0, limiter, request, send, statuses};

fn policy(extra: &str) -> Policy {
    let yaml = format!(
        "profile: p
window_seconds: 60
ceilings:
  ip: {{ classes: [read, standard, expensive] }}
  ip_protocol: {{ classes: [protocol], only: true }}
profiles:
  p:
    classes: {{ protocol: 100, read: 100, standard: 100, expensive: 3 }}
    ip_ceilings: {{ ip: 1000, ip_protocol: 1000 }}
default_class: standard
{extra}"
    );
    match parse_str(&yaml, Path::new("shadow.yaml")) {
        Ok(policy) => policy,
        Err(e) => panic!("{e}"),
    }
}

/// A bucket of 2 a minute on `GET /exports`, in `mode`.
fn exports(mode: &str) -> Policy {
    policy(&format!(
        "buckets:
  exports: {{ limit: 2, window_seconds: 60, per: caller, mode: {mode} }}
routes:
  - {{ method: GET, path: /exports, class: read, buckets: [exports] }}
"
    ))
}

#[tokio::test]
async fn p5_a_shadowed_bucket_past_its_limit_forwards_every_request_and_counts_each_would_be_refusal()
 {
    // Enforced, the third call is refused.
    let enforced = limiter(exports("enforce"));
    assert_eq!(
        statuses(&send(&enforced, "GET", "/exports", 3).await),
        [200, 200, 429]
    );

    let limiter = limiter(exports("shadow"));
    let answers = send(&limiter, "GET", "/exports", 5).await;
    assert_eq!(
        statuses(&answers),
        [200; 5],
        "nothing refused in shadow mode"
    );
    // X-RateLimit-* still describe the budget: it stays spent.
    assert_eq!(
        answers.iter().map(|(_, r)| *r).collect::<Vec<_>>(),
        [Some(1), Some(0), Some(0), Some(0), Some(0)]
    );
    let tally = limiter.tally(T0 + 1);
    assert_eq!(
        tally.shadow_refusals,
        [("exports".to_owned(), "rate_limited", 3)],
        "each would-be refusal counted once"
    );
    assert!(
        tally.refusals.is_empty(),
        "no real refusal: {:?}",
        tally.refusals
    );
}

#[tokio::test]
async fn p5_a_shadowed_budget_leaves_the_enforced_ones_refusing() {
    // The bucket is shadowed, the expensive class (3 a minute) is not.
    let limiter = limiter(policy(
        "buckets:
  exports: { limit: 1, window_seconds: 60, per: caller, mode: shadow }
routes:
  - { method: POST, path: /exports, class: expensive, buckets: [exports] }
",
    ));
    assert_eq!(
        statuses(&send(&limiter, "POST", "/exports", 4).await),
        [200, 200, 200, 429],
        "the class still refuses its fourth call"
    );
    let tally = limiter.tally(T0 + 1);
    // The bucket would have refused calls 2 and 3; call 4 was refused by the class,
    // which it would have been anyway: not a shadow refusal.
    assert_eq!(
        tally.shadow_refusals,
        [("exports".to_owned(), "rate_limited", 2)]
    );
    assert_eq!(tally.refusals, [("expensive".to_owned(), 1)]);
}

#[tokio::test]
async fn p5_a_dry_run_refuses_nothing_and_counts_every_budget_that_would_have() {
    let mut policy = policy(
        "quotas:
  evals: { monthly: 2 }
routes:
  - { method: POST, path: /evals, class: expensive, quota: evals }
",
    );
    policy.dry_run = true;
    let limiter = limiter(policy);
    assert_eq!(
        statuses(&send(&limiter, "POST", "/evals", 5).await),
        [200; 5]
    );
    let tally = limiter.tally(T0 + 1);
    // The quota (2 a month) would have refused calls 3 to 5, the class (3 a
    // minute) calls 4 and 5.
    assert_eq!(
        tally.shadow_refusals,
        [
            ("evals".to_owned(), "quota_exceeded", 3),
            ("expensive".to_owned(), "rate_limited", 2),
        ]
    );
    assert!(tally.refusals.is_empty());
}

#[tokio::test]
async fn p5_a_shadowed_route_or_class_never_refuses() {
    let route = limiter(policy(
        "routes:
  - { method: POST, path: /chats, class: expensive, mode: shadow }
",
    ));
    assert_eq!(statuses(&send(&route, "POST", "/chats", 5).await), [200; 5]);
    assert_eq!(
        route.tally(T0 + 1).shadow_refusals,
        [("expensive".to_owned(), "rate_limited", 2)]
    );

    let class = limiter(policy(
        "modes: { expensive: shadow }
routes:
  - { method: POST, path: /chats, class: expensive }
",
    ));
    assert_eq!(statuses(&send(&class, "POST", "/chats", 5).await), [200; 5]);
    // Another class of the same policy still refuses.
    let enforced = limiter(policy(
        "modes: { read: shadow }
routes:
  - { method: POST, path: /chats, class: expensive }
",
    ));
    assert_eq!(
        statuses(&send(&enforced, "POST", "/chats", 4).await),
        [200, 200, 200, 429]
    );
}

#[test]
fn p5_a_mode_that_is_not_enforce_or_shadow_is_named_with_its_key_path() {
    let yaml = "profile: p
window_seconds: 60
ceilings:
  ip: { classes: [read, standard, expensive] }
  ip_protocol: { classes: [protocol], only: true }
profiles:
  p:
    classes: { protocol: 1, read: 1, standard: 1, expensive: 1 }
    ip_ceilings: { ip: 1, ip_protocol: 1 }
buckets:
  exports: { limit: 2, window_seconds: 60, per: caller, mode: dry }
quotas:
  evals: { monthly: 2, mode: Shadow }
modes: { expensive: shadow, search: shadow, ip: off }
routes:
  - { method: GET, path: /x, class: read, mode: maybe }
";
    let error = parse_str(yaml, Path::new("bad.yaml"))
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    for expected in [
        "buckets.exports.mode: expected enforce or shadow, got \"dry\"",
        "quotas.evals.mode: expected enforce or shadow, got \"Shadow\"",
        "modes.search: expected a class",
        "modes.ip: expected enforce or shadow, got \"off\"",
        "routes[0].mode: expected enforce or shadow, got \"maybe\"",
    ] {
        assert!(error.contains(expected), "{expected:?} not in:\n{error}");
    }
}

#[tokio::test]
async fn p5_a_quota_in_shadow_mode_that_would_have_refused_spent_nothing_to_give_back() {
    let limiter = limiter(policy(
        "quotas:
  evals: { monthly: 1, mode: shadow }
routes:
  - { method: POST, path: /evals, class: standard, quota: evals }
",
    ));
    let mut spent = Vec::new();
    for _ in 0..2 {
        let parts = request("POST", "/evals");
        let route = limiter.route(&parts).expect("route");
        let intake = limiter.intake(Ok(route), PEER);
        let planned = intake.planned(&parts.headers, None, None);
        let forward = planned.admit(None).await.expect("admitted");
        spent.push(forward.quota_spent().of(0));
    }
    // The first call spent its unit; the second, which the quota would have
    // refused, spent none (a batch lane must not give one back for it).
    assert_eq!(spent, [1, 0]);
}

/// A store that is down: every decision goes to the outage rule.
struct Down;

impl sluice_store::BudgetStore for Down {
    async fn decide(
        &self,
        _: &[sluice_core::Budget],
    ) -> Result<sluice_core::Decision, sluice_store::StoreError> {
        Err(sluice_store::StoreError::Unavailable("down".into()))
    }
    async fn peek(
        &self,
        _: &[sluice_core::Budget],
    ) -> Result<sluice_core::Decision, sluice_store::StoreError> {
        Err(sluice_store::StoreError::Unavailable("down".into()))
    }
    async fn adjust(
        &self,
        _: &sluice_core::Budget,
        _: i64,
        _: Timestamp,
    ) -> Result<sluice_core::BudgetStatus, sluice_store::StoreError> {
        Err(sluice_store::StoreError::Unavailable("down".into()))
    }
}

#[tokio::test]
async fn p5_d3_a_dry_run_refuses_nothing_while_the_store_is_down_and_classes_fail_open() {
    // The fallback store runs on the real clock: a window that started at the Unix
    // epoch and ends in 2106, so no run straddles a boundary.
    let yaml = "profile: p
window_seconds: 4294967295
ceilings:
  ip: { classes: [read, standard, expensive] }
  ip_protocol: { classes: [protocol], only: true }
profiles:
  p:
    classes: { protocol: 100, read: 100, standard: 100, expensive: 3 }
    ip_ceilings: { ip: 1000, ip_protocol: 1000 }
default_class: standard
routes:
  - { method: POST, path: /chats, class: expensive }
";
    let mut policy = parse_str(yaml, Path::new("down.yaml")).expect("policy");
    policy.dry_run = true;
    let limiter =
        Limiter::new(policy, Down).with_fallback(MemoryStore::new(MemoryConfig::default()));
    // Decided on the fallback store (3 a minute): calls 4 and 5 would have been
    // refused there.
    assert_eq!(
        statuses(&send(&limiter, "POST", "/chats", 5).await),
        [200; 5]
    );
    let tally = limiter.tally(T0 + 1);
    assert_eq!(
        tally.shadow_refusals,
        [("expensive".to_owned(), "rate_limited", 2)]
    );
    assert!(tally.refusals.is_empty());
}

/// A weighted bucket of 2 a minute that passes an exhausted request on, on
/// `POST /search`.
fn passing(extra: &str) -> Policy {
    policy(&format!(
        "buckets:
  reads: {{ limit: 2, window_seconds: 60, per: caller, weighted: true, on_exhausted: pass }}
routes:
  - {{ method: POST, path: /search, class: read, buckets: [reads] }}
{extra}"
    ))
}

#[tokio::test]
async fn p5_q2_a_bucket_that_passes_an_exhausted_request_on_does_so_in_a_dry_run_too() {
    let mut shadowed = passing("");
    shadowed.dry_run = true;
    for policy in [passing(""), shadowed] {
        let dry = policy.dry_run;
        let limiter = limiter(policy);
        for i in 0..4 {
            let parts = request("POST", "/search");
            let route = limiter.route(&parts).expect("route");
            let intake = limiter.intake(Ok(route), PEER);
            let planned = intake.planned(&parts.headers, None, None);
            let forward = planned.admit(None).await.expect("admitted: passed on");
            let mut upstream = http::HeaderMap::new();
            forward.upstream_headers(&mut upstream);
            assert_eq!(
                upstream.contains_key("x-sluice-exhausted"),
                i >= 2,
                "call {i}, dry run {dry}"
            );
            // The upstream reports no cost: one unit, as admitted.
            let mut answer = http::HeaderMap::new();
            forward.response_head(200, &mut answer).await;
        }
        assert!(
            limiter.tally(T0 + 1).shadow_refusals.is_empty(),
            "passing on is not a refusal, dry run {dry}"
        );
    }
}

#[tokio::test]
async fn p5_q2_a_shadowed_weighted_bucket_is_not_charged_for_calls_it_would_have_refused() {
    let limiter = limiter(policy(
        "buckets:
  reads: { limit: 2, window_seconds: 60, per: caller, weighted: true, mode: shadow }
routes:
  - { method: POST, path: /search, class: read, buckets: [reads] }
",
    ));
    let mut remaining = Vec::new();
    for i in 0..4 {
        let parts = request("POST", "/search");
        let route = limiter.route(&parts).expect("route");
        let intake = limiter.intake(Ok(route), PEER);
        let planned = intake.planned(&parts.headers, None, None);
        let forward = planned.admit(None).await.expect("admitted: shadowed");
        // The first two calls cost one unit each (no header); the two the bucket
        // would have refused report a cached answer (cost 0): they took no unit,
        // and give none back.
        let mut answer = http::HeaderMap::new();
        if i >= 2 {
            answer.insert("x-sluice-cost", http::HeaderValue::from_static("0"));
        }
        forward.response_head(200, &mut answer).await;
        remaining.push(
            answer["x-ratelimit-remaining"]
                .to_str()
                .unwrap_or("")
                .to_owned(),
        );
    }
    assert_eq!(remaining, ["1", "0", "0", "0"]);
    assert_eq!(
        limiter.tally(T0 + 1).shadow_refusals,
        [("reads".to_owned(), "rate_limited", 2)]
    );
}

#[tokio::test]
async fn p5_x_ratelimit_headers_describe_the_shadowed_budget_that_would_have_refused() {
    let limiter = limiter(policy(
        "quotas:
  evals: { monthly: 1, mode: shadow }
routes:
  - { method: POST, path: /evals, class: standard, quota: evals }
",
    ));
    let mut limits = Vec::new();
    for _ in 0..2 {
        let parts = request("POST", "/evals");
        let route = limiter.route(&parts).expect("route");
        let intake = limiter.intake(Ok(route), PEER);
        let planned = intake.planned(&parts.headers, None, None);
        let forward = planned.admit(None).await.expect("admitted");
        let mut answer = http::HeaderMap::new();
        forward.response_head(200, &mut answer).await;
        limits.push((
            answer["x-ratelimit-limit"]
                .to_str()
                .unwrap_or("")
                .to_owned(),
            answer["x-ratelimit-remaining"]
                .to_str()
                .unwrap_or("")
                .to_owned(),
        ));
    }
    // First the class (100 a minute), then the quota it would have been refused by.
    assert_eq!(
        limits,
        [
            ("100".to_owned(), "99".to_owned()),
            ("1".to_owned(), "0".to_owned())
        ]
    );
}
