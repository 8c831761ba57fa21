//! SPEC O2: admitted decisions that leave a budget past `near_limit_ratio` of its
//! limit are counted per budget (as envoyproxy/ratelimit's `near_limit`), in the
//! tally the dashboard reads and in `/status`; refusals and uncapped quotas are
//! not.

use std::net::IpAddr;
use std::path::Path;

use http::{HeaderMap, HeaderValue, Method, Version};
use sluice_core::{FakeClock, Timestamp};
use sluice_edge::Limiter;
use sluice_store::{MemoryConfig, MemoryStore};

const PEER: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(203, 0, 113, 9));

fn limiter(ratio: &str) -> Limiter<MemoryStore<FakeClock>> {
    let yaml = format!(
        r#"
profile: default
window_seconds: 3600
profiles:
  default:
    classes: {{ calls: 10 }}
identity:
  credentials: [bearer]
quotas:
  counted: {{}}
routes:
  - {{ method: POST, path: /calls, class: calls, quota: counted }}
{ratio}
"#
    );
    let policy = sluice_policy::parse_str(&yaml, Path::new("near.yaml")).expect("policy");
    // Whole hours since the epoch: the hour's window does not end within the test.
    let clock = FakeClock::new(Timestamp::from_secs(3_897_244_800));
    Limiter::new(
        policy,
        MemoryStore::with_clock(MemoryConfig::with_max_keys(1_000), clock),
    )
}

async fn call(limiter: &Limiter<MemoryStore<FakeClock>>, key: &str) -> bool {
    let mut headers = HeaderMap::new();
    headers.insert(
        "authorization",
        HeaderValue::from_str(&format!("Bearer {key}")).expect("ascii"),
    );
    let route = limiter.route_head(
        &Method::POST,
        Version::HTTP_2,
        [],
        Ok("/calls"),
        Some(&headers),
    );
    let mut intake = limiter.intake(route, PEER);
    intake.set_path("/calls");
    intake
        .planned(&headers, None, None)
        .admit(None)
        .await
        .is_ok()
}

fn near(limiter: &Limiter<MemoryStore<FakeClock>>) -> Vec<(String, u64)> {
    limiter.tally(0).near_limit
}

#[tokio::test]
async fn o2_admitted_decisions_past_the_ratio_are_counted_per_budget() {
    // Default 0.8 of 10: the 8th, 9th and 10th calls leave the class near its limit.
    let l = limiter("");
    for _ in 0..12 {
        call(&l, "ada").await;
    }
    assert_eq!(
        near(&l),
        vec![("calls".to_owned(), 3)],
        "refusals (11th, 12th) not counted"
    );
    assert_eq!(l.status().near_limit.get("calls"), Some(&3));
    assert!((l.status().near_limit_ratio - 0.8).abs() < 1e-9);
    // Another caller's budget is its own: 2 calls, far from it.
    call(&l, "bob").await;
    call(&l, "bob").await;
    assert_eq!(near(&l), vec![("calls".to_owned(), 3)]);
    // 0.5: from the 5th call on; the uncapped quota never.
    let l = limiter("near_limit_ratio: 0.5");
    for _ in 0..10 {
        assert!(call(&l, "ada").await);
    }
    assert_eq!(near(&l), vec![("calls".to_owned(), 6)]);
}

#[test]
fn o2_a_ratio_outside_0_to_1_is_a_problem() {
    for bad in ["0", "1.5", "-0.2", "\"half\""] {
        let yaml = format!(
            "profile: p\nprofiles:\n  p:\n    classes: {{ a: 1 }}\ndefault_class: a\nnear_limit_ratio: {bad}\n"
        );
        let err = sluice_policy::parse_str(&yaml, Path::new("bad.yaml")).expect_err(bad);
        assert!(err.to_string().contains("near_limit_ratio"), "{bad}: {err}");
    }
}
