//! P3, plans: a workspace's plan replaces the profile's limits where it names
//! them, on every budget it can (class, ceiling, bucket, quota); a workspace on no
//! plan gets `default`'s; a plan in shadow mode dry-runs its limits. Driven through
//! the phase contract on a fake clock.

use std::path::Path;

use sluice_policy::{Policy, parse_str};

use crate::support;
use support::{T0, limiter, send_as, statuses};

/// `sha256("a")`, `sha256("b")`, `sha256("c")`: the keys of acme (pro), globex
/// (trial, in shadow mode) and initech (no plan: `default`).
const KEYS: &str = "identity:
  keys:
    - { sha256: ca978112ca1bbdcafac231b39a23dc4da786eff8147c4e72b9807785afee48bb, workspace: acme, user: ada }
    - { sha256: 3e23e8160039594a33894f6564e1b1348bbd7a0088d42c4acb73eeaed59c009d, workspace: globex, user: bo, plan: trial }
    - { sha256: 2e7d2c03a9507ae265ecf5b5356885a53393a2029d241394997265a1a25aefc6, workspace: initech, user: cy }
";

fn policy() -> Policy {
    let yaml = format!(
        "profile: p
window_seconds: 60
profiles:
  p:
    classes: {{ search: 100, generate: 3 }}
    ip_ceilings: {{ ip: 1000 }}
ceilings:
  ip: {{ classes: [search, generate] }}
default_class: search
buckets:
  exports: {{ limit: 2, window_seconds: 60, per: workspace }}
quotas:
  images: {{ monthly: 4 }}
routes:
  - {{ method: POST, path: /generate, class: generate, quota: images }}
  - {{ method: GET, path: /exports, class: search, buckets: [exports] }}
plans:
  default:
    classes: {{ generate: 2 }}
  pro:
    classes: {{ generate: 6 }}
    buckets: {{ exports: 5 }}
    quotas: {{ images: 5 }}
  trial:
    classes: {{ generate: 1 }}
    mode: shadow
workspaces:
  acme: {{ plan: pro }}
{KEYS}"
    );
    parse_str(&yaml, Path::new("plans.yaml")).unwrap_or_else(|e| panic!("{e}"))
}

#[tokio::test]
async fn p3_each_workspace_is_limited_by_its_plan_and_the_others_by_default() {
    let limiter = limiter(policy());
    // acme is on pro: generate 6 a minute per caller, but images 5 a month.
    assert_eq!(
        statuses(&send_as(&limiter, "a", "POST", "/generate", 6).await),
        [200, 200, 200, 200, 200, 429],
        "the plan's quota (5 a month) binds before its class limit (6)"
    );
    // initech has no plan: default's generate 2 (not the profile's 3).
    let answers = send_as(&limiter, "c", "POST", "/generate", 3).await;
    assert_eq!(statuses(&answers), [200, 200, 429]);
    assert_eq!(
        answers[0].1,
        Some(1),
        "X-RateLimit-* describe the plan's limit"
    );
    // A bucket per workspace: pro's 5 against the policy's 2.
    assert_eq!(
        statuses(&send_as(&limiter, "a", "GET", "/exports", 6).await),
        [200, 200, 200, 200, 200, 429]
    );
    assert_eq!(
        statuses(&send_as(&limiter, "c", "GET", "/exports", 3).await),
        [200, 200, 429]
    );
}

#[tokio::test]
async fn p3_a_plan_in_shadow_mode_counts_the_refusals_its_limits_would_give() {
    let limiter = limiter(policy());
    // globex's trial plan would allow 1 generation a minute: a dry run, so every
    // call goes (up to the quota's 4 a month, which trial does not set and which is
    // enforced), and each call past 1 is counted as a shadow refusal.
    assert_eq!(
        statuses(&send_as(&limiter, "b", "POST", "/generate", 5).await),
        [200, 200, 200, 200, 429]
    );
    let tally = limiter.tally(T0 + 1);
    assert_eq!(
        tally.shadow_refusals,
        [("generate".to_owned(), "rate_limited", 3)]
    );
}

#[tokio::test]
async fn p3_status_shows_what_a_workspace_on_each_plan_gets() {
    let limiter = limiter(policy());
    let status = limiter.status();
    let json = serde_json::to_value(&status).expect("json");
    let pro = json["plans"]
        .as_array()
        .and_then(|plans| plans.iter().find(|p| p["name"] == "pro"))
        .unwrap_or_else(|| panic!("no pro in {json}"));
    assert_eq!(pro["classes"]["generate"], 6);
    assert_eq!(pro["classes"]["search"], 100, "the profile's");
    assert_eq!(pro["buckets"]["exports"], 5);
    assert_eq!(pro["quotas"]["images"], 5);
    assert_eq!(
        pro["overrides"],
        serde_json::json!(["generate", "exports", "images"])
    );
    assert_eq!(json["workspaces_on_plans"], 2);
}

/// The answer to a `POST /generate` from `peer` with `headers`.
async fn generate_with(
    limiter: &sluice_edge::Limiter<sluice_store::MemoryStore<sluice_core::FakeClock>>,
    peer: std::net::IpAddr,
    headers: &[(&str, &str)],
) -> (u16, Option<String>) {
    let mut request = http::Request::builder().method("POST").uri("/generate");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let (parts, ()) = request.body(()).expect("request").into_parts();
    let route = limiter.route(&parts).expect("route");
    let intake = limiter.intake(Ok(route), peer);
    let planned = intake.planned(&parts.headers, None, None);
    match planned.admit(None).await {
        Ok(forward) => {
            let mut out = http::HeaderMap::new();
            forward.response_head(200, &mut out).await;
            let limit = out
                .get("x-ratelimit-limit")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned);
            (200, limit)
        }
        Err(answer) => (answer.status().as_u16(), None),
    }
}

#[tokio::test]
async fn p3_a_trusted_auth_layer_names_the_plan_and_a_plan_of_no_policy_is_refused() {
    let yaml = "profile: p
profiles:
  p:
    classes: { search: 100, generate: 3 }
default_class: search
routes:
  - { method: POST, path: /generate, class: generate }
plans:
  pro:
    classes: { generate: 6 }
identity:
  trusted_proxies: [203.0.113.0/24]
  principal_headers: { workspace: x-workspace, user: x-user, plan: x-plan }
";
    let limiter =
        limiter(parse_str(yaml, Path::new("header.yaml")).unwrap_or_else(|e| panic!("{e}")));
    let trusted = support::PEER;
    let from = |plan: &'static str| [("x-workspace", "acme"), ("x-user", "ada"), ("x-plan", plan)];
    assert_eq!(
        generate_with(&limiter, trusted, &from("pro")).await,
        (200, Some("6".to_owned()))
    );
    // A plan the policy does not have: refused, never decided as on no plan.
    assert_eq!(
        generate_with(&limiter, trusted, &from("gold")).await,
        (400, None)
    );
    // From a peer that is not a trusted proxy, the header is not believed.
    let stranger: std::net::IpAddr = [198, 51, 100, 1].into();
    assert_eq!(
        generate_with(&limiter, stranger, &from("pro")).await,
        (200, Some("3".to_owned()))
    );
}
