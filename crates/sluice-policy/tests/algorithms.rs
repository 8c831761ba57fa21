//! P2, an algorithm per budget: `algorithm:` and `burst:` on buckets, `algorithms:`
//! for the class budgets and the per-IP ceilings, read into the model and checked,
//! each bad value named by its key path.

use std::num::NonZeroU32;
use std::path::Path;
use std::time::Duration;

use sluice_core::Rate;
use sluice_policy::{Algorithm, Policy, default_policy, parse_str};

fn nz(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).expect("non-zero")
}

/// Two profiles (expensive 30 and 150), with `extra` appended.
fn yaml(extra: &str) -> String {
    format!(
        "profile: production
window_seconds: 60
ceilings:
  ip: {{ classes: [read, standard, expensive] }}
  ip_protocol: {{ classes: [protocol], only: true }}
profiles:
  production:
    classes: {{ protocol: 600, read: 300, standard: 60, expensive: 30 }}
    ip_ceilings: {{ ip: 300, ip_protocol: 1200 }}
  local:
    classes: {{ protocol: 3000, read: 1500, standard: 500, expensive: 150 }}
    ip_ceilings: {{ ip: 2000, ip_protocol: 6000 }}
default_class: standard
{extra}"
    )
}

/// How the class or ceiling `name` counts.
fn algorithm_of(p: &Policy, name: &str) -> Algorithm {
    p.classes
        .iter()
        .map(|c| (&c.name, c.algorithm))
        .chain(p.ceilings.iter().map(|c| (&c.name, c.algorithm)))
        .find(|(n, _)| *n == name)
        .map(|(_, a)| a)
        .unwrap_or_else(|| panic!("no class or ceiling {name}"))
}

fn problems(extra: &str) -> String {
    match parse_str(&yaml(extra), Path::new("bad.yaml")) {
        Ok(_) => panic!("accepted:\n{extra}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn p2_the_built_in_policy_counts_every_budget_in_fixed_windows() {
    let p = default_policy().expect("default");
    assert!(p.classes.iter().all(|c| c.algorithm == Algorithm::Fixed));
    assert!(p.ceilings.iter().all(|c| c.algorithm == Algorithm::Fixed));
    assert!(p.buckets.iter().all(|b| b.algorithm == Algorithm::Fixed));
    assert_eq!(
        Algorithm::Fixed.rate(nz(60), nz(30)),
        Rate::FixedWindow { seconds: nz(60) }
    );
}

#[test]
fn p2_algorithms_and_bursts_are_read_into_the_model() {
    let p = parse_str(
        &yaml(
            "algorithms:
  expensive: { algorithm: gcra, burst: 5 }
  read: { algorithm: sliding }
  standard: { algorithm: gcra }
  ip: { algorithm: sliding }
  ip_protocol: { algorithm: fixed }
buckets:
  register: { limit: 5, window_seconds: 60, per: ip, algorithm: gcra, burst: 2 }
  exports: { limit: 5, window_seconds: 60, per: user, algorithm: sliding }
  plain: { limit: 5, window_seconds: 60, per: user }
",
        ),
        Path::new("p2.yaml"),
    )
    .expect("valid");
    let a = |name: &str| algorithm_of(&p, name);
    assert_eq!(a("expensive"), Algorithm::Gcra { burst: Some(nz(5)) });
    assert_eq!(a("read"), Algorithm::Sliding);
    assert_eq!(a("standard"), Algorithm::Gcra { burst: None });
    assert_eq!(a("protocol"), Algorithm::Fixed);
    assert_eq!(
        (a("ip"), a("ip_protocol")),
        (Algorithm::Sliding, Algorithm::Fixed)
    );
    let bucket = |name: &str| {
        p.buckets
            .iter()
            .find(|b| b.name == name)
            .map(|b| b.algorithm)
    };
    assert_eq!(
        bucket("register"),
        Some(Algorithm::Gcra { burst: Some(nz(2)) })
    );
    assert_eq!(bucket("exports"), Some(Algorithm::Sliding));
    assert_eq!(bucket("plain"), Some(Algorithm::Fixed));

    // The rates the stores decide by: sliding is the exact rolling window in 60
    // slots; gcra's period is the window, its burst the limit unless given.
    assert_eq!(
        Algorithm::Sliding.rate(nz(60), nz(300)),
        Rate::RollingWindow {
            millis: nz(60_000),
            slot_millis: nz(1_000)
        }
    );
    assert_eq!(
        Algorithm::Sliding.rate(nz(1), nz(3)),
        Rate::RollingWindow {
            millis: nz(1_000),
            slot_millis: nz(17)
        }
    );
    assert_eq!(
        Algorithm::Gcra { burst: None }.rate(nz(60), nz(60)),
        Rate::Gcra {
            period: Duration::from_secs(60),
            burst: nz(60)
        }
    );
    // `sluice check` says so; fixed budgets read as before.
    let text = p.describe();
    assert!(
        text.contains("not in fixed windows: read sliding; standard gcra, burst = limit; expensive gcra, burst 5; ip sliding (the rest fixed)"),
        "{text}"
    );
    assert!(
        text.contains("register: 5 per 60 s (gcra, burst 2) per IP"),
        "{text}"
    );
    assert!(text.contains("plain: 5 per 60 s per user"), "{text}");
}

#[test]
fn p2_an_unknown_algorithm_is_named_with_its_key_path() {
    let error = problems(
        "algorithms:
  read: { algorithm: leaky }
buckets:
  exports: { limit: 5, window_seconds: 60, per: user, algorithm: Sliding }
",
    );
    for expected in [
        "algorithms.read.algorithm: expected fixed, sliding or gcra, got \"leaky\"",
        "buckets.exports.algorithm: expected fixed, sliding or gcra, got \"Sliding\"",
    ] {
        assert!(error.contains(expected), "{expected:?} not in:\n{error}");
    }
}

#[test]
fn p2_an_algorithms_entry_names_a_class_or_a_ceiling() {
    let error = problems(
        "algorithms:
  search: { algorithm: sliding }
",
    );
    assert!(
        error.contains("algorithms.search: expected a class or a ceiling (protocol, read, standard, expensive, ip, ip_protocol)"),
        "{error}"
    );
}

#[test]
fn p2_a_burst_without_gcra_is_refused() {
    let error = problems(
        "algorithms:
  standard: { burst: 5 }
  read: { algorithm: sliding, burst: 5 }
buckets:
  exports: { limit: 5, window_seconds: 60, per: user, burst: 2 }
",
    );
    for expected in [
        "algorithms.standard.burst: `burst` is for `algorithm: gcra`; this budget is fixed",
        "algorithms.read.burst: `burst` is for `algorithm: gcra`; this budget is sliding",
        "buckets.exports.burst: `burst` is for `algorithm: gcra`; this budget is fixed",
    ] {
        assert!(error.contains(expected), "{expected:?} not in:\n{error}");
    }
}

#[test]
fn p2_a_burst_of_zero_or_above_the_limit_is_refused() {
    let error = problems(
        "algorithms:
  expensive: { algorithm: gcra, burst: 40 }
  ip: { algorithm: gcra, burst: 0 }
buckets:
  exports: { limit: 5, window_seconds: 60, per: user, algorithm: gcra, burst: 6 }
  register: { limit: 5, window_seconds: 60, per: ip, algorithm: gcra, burst: 0 }
",
    );
    for expected in [
        // Above production's 30, within local's 150: named by the profile it breaks.
        "algorithms.expensive.burst: 40 is above the limit of profile production (30)",
        "algorithms.ip.burst: must be at least 1",
        "buckets.exports.burst: 6 is above the limit (5)",
        "buckets.register.burst: must be at least 1",
    ] {
        assert!(error.contains(expected), "{expected:?} not in:\n{error}");
    }
    assert!(!error.contains("profile local"), "{error}");
    // At the limit is fine.
    assert!(
        parse_str(
            &yaml("algorithms: { expensive: { algorithm: gcra, burst: 30 } }\n"),
            Path::new("ok.yaml")
        )
        .is_ok()
    );
}

#[test]
fn p2_a_quota_takes_no_algorithm() {
    let error = problems(
        "quotas:
  evals: { monthly: 100, algorithm: sliding }
",
    );
    assert!(
        error.contains(
            "quotas.evals.algorithm: a quota counts calendar months (UTC) and takes no algorithm"
        ),
        "{error}"
    );
}

#[test]
fn p2_a_sliding_window_longer_than_its_millisecond_count_holds_is_refused() {
    let error = problems(
        "buckets:
  yearly: { limit: 5, window_seconds: 31536000, per: user, algorithm: sliding }
",
    );
    assert!(
        error.contains("buckets.yearly.algorithm: a sliding window is counted in milliseconds: at most 4294967 seconds"),
        "{error}"
    );
}
