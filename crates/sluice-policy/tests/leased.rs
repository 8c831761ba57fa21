//! D4, leased budgets in the policy: `consistency: leased` with `lease` and
//! `lease_ms` under `algorithms:`, read into the model, each bad value refused by
//! its key path, and `sluice check`'s line with the bound.

use std::num::NonZeroU32;
use std::path::Path;

use sluice_core::LeaseTerms;
use sluice_policy::{Consistency, Policy, default_policy, parse_str};

fn nz(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).expect("non-zero")
}

/// Two profiles (read 300 and 1500), with `extra` appended.
fn yaml(extra: &str) -> String {
    format!(
        "profile: production
window_seconds: 60
ceilings:
  ip: {{ classes: [read, standard] }}
profiles:
  production:
    classes: {{ read: 300, standard: 60 }}
    ip_ceilings: {{ ip: 400 }}
  local:
    classes: {{ read: 1500, standard: 500 }}
    ip_ceilings: {{ ip: 2000 }}
default_class: standard
{extra}"
    )
}

fn policy(extra: &str) -> Policy {
    parse_str(&yaml(extra), Path::new("leased.yaml")).unwrap_or_else(|e| panic!("{e}"))
}

fn problems(extra: &str) -> String {
    match parse_str(&yaml(extra), Path::new("bad.yaml")) {
        Ok(_) => panic!("accepted:\n{extra}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn d4_every_budget_is_exact_unless_leased() {
    let p = default_policy().expect("default");
    assert!(
        p.classes
            .iter()
            .all(|c| c.consistency == Consistency::Exact)
    );
    assert!(
        p.ceilings
            .iter()
            .all(|c| c.consistency == Consistency::Exact)
    );
    assert!(p.describe_leases().is_empty());
    let p = policy("algorithms: { read: { consistency: exact } }\n");
    assert!(
        p.classes
            .iter()
            .all(|c| c.consistency == Consistency::Exact)
    );
}

#[test]
fn d4_leased_classes_and_ceilings_are_read_into_the_model() {
    let p = policy(
        "algorithms:
  read: { consistency: leased, lease: 20, lease_ms: 500 }
  ip: { consistency: leased, lease: 8 }
",
    );
    assert_eq!(
        p.classes[0].consistency,
        Consistency::Leased(LeaseTerms::new(nz(20), nz(500)))
    );
    assert_eq!(p.classes[1].consistency, Consistency::Exact);
    assert_eq!(
        p.ceilings[0].consistency,
        Consistency::Leased(LeaseTerms::new(nz(8), nz(1000))),
        "lease_ms defaults to 1000"
    );
}

#[test]
fn d4_check_prints_each_leased_budgets_bound_for_the_stated_replicas() {
    let mut p = policy(
        "store: { replicas: 3 }
algorithms:
  read: { consistency: leased, lease: 20, lease_ms: 500 }
  ip: { consistency: leased, lease: 8 }
",
    );
    let text = p.describe();
    assert!(
        text.contains("leased: read: leases of at most 20 units for at most 500 ms; with 3 replica(s) at most 300 + 3 x 20 = 360 admitted per 60 s window (exact: 300)"),
        "{text}"
    );
    assert!(
        text.contains("leased: ip: leases of at most 8 units for at most 1000 ms; with 3 replica(s) at most 400 + 3 x 8 = 424 admitted"),
        "{text}"
    );
    p.store.replicas = nz(10);
    assert!(p.describe_leases()[0].contains("at most 300 + 10 x 20 = 500 admitted"));
}

#[test]
fn d4_a_lease_larger_than_the_limit_is_refused_with_its_key_path() {
    let e = problems("algorithms: { standard: { consistency: leased, lease: 61 } }\n");
    assert!(
        e.contains("algorithms.standard.lease: a lease of 61 is larger than the limit 60 of profile production"),
        "{e}"
    );
    let e = problems(
        "algorithms: { read: { consistency: leased, lease: 50 } }
plans:
  free: { classes: { read: 10 } }
",
    );
    assert!(
        e.contains("algorithms.read.lease: a lease of 50 is larger than the limit 10 of plan free"),
        "{e}"
    );
    let e = problems("algorithms: { read: { consistency: leased, lease: 0 } }\n");
    assert!(
        e.contains("algorithms.read.lease: must be at least 1"),
        "{e}"
    );
    let e = problems("algorithms: { read: { consistency: leased } }\n");
    assert!(
        e.contains("algorithms.read.lease: required with `consistency: leased`"),
        "{e}"
    );
}

#[test]
fn d4_a_lease_ms_above_a_second_or_the_window_is_refused() {
    let e = problems("algorithms: { read: { consistency: leased, lease: 5, lease_ms: 1001 } }\n");
    assert!(
        e.contains("algorithms.read.lease_ms: expected 1 to 1000 milliseconds"),
        "{e}"
    );
    let e = problems("algorithms: { read: { consistency: leased, lease: 5, lease_ms: 0 } }\n");
    assert!(
        e.contains("algorithms.read.lease_ms: expected 1 to 1000"),
        "{e}"
    );
    let short = yaml("algorithms: { read: { consistency: leased, lease: 5, lease_ms: 800 } }\n")
        .replace("window_seconds: 60", "window_seconds: 1");
    let p = parse_str(&short, Path::new("short.yaml")).expect("800 ms fits a 1 s window");
    assert!(p.classes[0].consistency.lease().is_some());
}

#[test]
fn d4_leased_is_for_fixed_windows_and_exact_budgets_take_no_lease() {
    let e =
        problems("algorithms: { read: { algorithm: sliding, consistency: leased, lease: 5 } }\n");
    assert!(
        e.contains("algorithms.read.consistency: a leased budget counts in fixed windows; this one is sliding"),
        "{e}"
    );
    let e = problems("algorithms: { read: { lease: 5 } }\n");
    assert!(
        e.contains("algorithms.read.lease: `lease` is for `consistency: leased`"),
        "{e}"
    );
    let e = problems("algorithms: { read: { consistency: eventual } }\n");
    assert!(
        e.contains("algorithms.read.consistency: expected exact or leased, got \"eventual\""),
        "{e}"
    );
}

#[test]
fn d4_monthly_quotas_money_and_token_budgets_stay_exact() {
    let cases = [
        (
            "quotas:\n  evals: { monthly: 100, consistency: leased }\n",
            "quotas.evals.consistency: a monthly quota stays exact",
        ),
        (
            "spend:\n  dollars: { per: workspace, limit_usd: 50, monthly: true, consistency: leased }\n",
            "spend.dollars.consistency: a money budget stays exact",
        ),
        (
            "tokens:\n  team: { per: caller, limit: 1000, window_seconds: 60, consistency: leased }\n",
            "tokens.team.consistency: a token budget stays exact",
        ),
    ];
    for (extra, expected) in cases {
        let e = problems(extra);
        assert!(e.contains(expected), "{extra}: {e}");
    }
}

/// The rate-limit service's rules are leased as classes are (`consistency`,
/// `lease` and `lease_ms` on a `rate_limit`), and `sluice check` prints their bound.
#[test]
fn d4_rate_limit_service_rules_may_be_leased_and_check_prints_their_bound() {
    let p = policy(
        "store: { replicas: 2 }
domains:
  - domain: api
    descriptors:
      - key: user
        rate_limit: { unit: minute, requests_per_unit: 600, consistency: leased, lease: 25, lease_ms: 250 }
      - key: path
        rate_limit: { unit: second, requests_per_unit: 50 }
",
    );
    let rules = &p.domains[0].rules;
    assert_eq!(
        rules[0].consistency,
        Consistency::Leased(LeaseTerms::new(nz(25), nz(250)))
    );
    assert_eq!(rules[1].consistency, Consistency::Exact);
    let text = p.describe();
    assert!(
        text.contains("leased: api user: leases of at most 25 units for at most 250 ms; with 2 replica(s) at most 600 + 2 x 25 = 650 admitted per 60 s window (exact: 600)"),
        "{text}"
    );
    assert!(!text.contains("leased: api path"), "{text}");
}

/// Each bad leased rule is refused with its key path: a lease above the rule's
/// limit, a `lease_ms` past its unit, a month (a monthly count stays exact), an
/// algorithm other than fixed, a lease on an exact rule, a word not known.
#[test]
fn d4_bad_leased_rate_limit_service_rules_are_refused_with_their_key_path() {
    let rule = |rate_limit: &str| {
        problems(&format!(
            "domains:\n  - domain: api\n    descriptors:\n      - key: user\n        rate_limit: {rate_limit}\n"
        ))
    };
    let cases = [
        (
            "{ unit: second, requests_per_unit: 10, consistency: leased, lease: 11 }",
            "descriptors[0].rate_limit.lease: a lease of 11 is larger than the limit 10",
        ),
        (
            "{ unit: second, requests_per_unit: 10, consistency: leased, lease: 5, lease_ms: 1001 }",
            "descriptors[0].rate_limit.lease_ms: expected 1 to 1000 milliseconds",
        ),
        (
            "{ unit: month, requests_per_unit: 10, consistency: leased, lease: 5 }",
            "descriptors[0].rate_limit.consistency: a month is counted as a monthly quota, which stays exact",
        ),
        (
            "{ unit: minute, requests_per_unit: 10, algorithm: sliding, consistency: leased, lease: 5 }",
            "descriptors[0].rate_limit.consistency: a leased budget counts in fixed windows",
        ),
        (
            "{ unit: minute, requests_per_unit: 10, lease: 5 }",
            "descriptors[0].rate_limit.lease: `lease` is for `consistency: leased`",
        ),
        (
            "{ unit: minute, requests_per_unit: 10, consistency: leased }",
            "descriptors[0].rate_limit.lease: required with `consistency: leased`",
        ),
        (
            "{ unit: minute, requests_per_unit: 10, consistency: eventual, lease: 5 }",
            "descriptors[0].rate_limit.consistency: expected exact or leased, got \"eventual\"",
        ),
        (
            "{ unit: minute, requests_per_unit: 10, consistency: leased, lease: -1 }",
            "descriptors[0].rate_limit.lease: expected a whole number",
        ),
        (
            "{ unlimited: true, consistency: leased, lease: 5 }",
            "descriptors[0].rate_limit.consistency: an unlimited rule counts nothing",
        ),
    ];
    for (rate_limit, expected) in cases {
        let e = rule(rate_limit);
        assert!(e.contains(expected), "{rate_limit}: {e}");
    }
}

/// A route bucket is leased as a class is, its lease at most its limit and
/// each plan's, and `sluice check` prints its bound over its own window.
#[test]
fn d4_buckets_may_be_leased_within_their_limit_and_each_plans() {
    let buckets = "buckets:
  exports: { limit: 40, window_seconds: 10, per: caller, consistency: leased, lease: 8, lease_ms: 500 }
  uploads: { limit: 5, window_seconds: 60, per: ip }
";
    let p = policy(&format!("store: {{ replicas: 3 }}\n{buckets}"));
    let exports = p
        .buckets
        .iter()
        .find(|b| b.name == "exports")
        .expect("exports");
    assert_eq!(
        exports.consistency,
        Consistency::Leased(LeaseTerms::new(nz(8), nz(500)))
    );
    let uploads = p
        .buckets
        .iter()
        .find(|b| b.name == "uploads")
        .expect("uploads");
    assert_eq!(uploads.consistency, Consistency::Exact);
    let text = p.describe();
    assert!(
        text.contains("leased: exports: leases of at most 8 units for at most 500 ms; with 3 replica(s) at most 40 + 3 x 8 = 64 admitted per 10 s window (exact: 40)"),
        "{text}"
    );
    let e = problems(&format!(
        "{buckets}plans:\n  free: {{ buckets: {{ exports: 4 }} }}\n"
    ));
    assert!(
        e.contains("buckets.exports.lease: a lease of 8 is larger than the limit 4 of plan free"),
        "{e}"
    );
    let e = problems(
        "buckets:\n  exports: { limit: 40, window_seconds: 10, per: caller, consistency: leased, lease: 8, lease_ms: 20000 }\n",
    );
    assert!(
        e.contains("buckets.exports.lease_ms: expected 1 to 1000"),
        "{e}"
    );
    let e = problems(
        "buckets:\n  exports: { limit: 40, window_seconds: 10, per: caller, algorithm: gcra, consistency: leased, lease: 8 }\n",
    );
    assert!(
        e.contains("buckets.exports.consistency: a leased budget counts in fixed windows"),
        "{e}"
    );
}
