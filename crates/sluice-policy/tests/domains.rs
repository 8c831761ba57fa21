//! R1, descriptor rules in envoyproxy/ratelimit's configuration format: matching
//! precedence, what a rule counts with, and every bad key named by its path.

use std::path::Path;

use sluice_core::Rate;
use sluice_policy::domains::{MAX_DESCRIPTOR_DEPTH, Unit, parse_domain_file};
use sluice_policy::parse_str;

fn domain(text: &str) -> sluice_policy::domains::Domain {
    parse_domain_file(text, Path::new("d.yaml")).unwrap_or_else(|p| panic!("{p:?}"))
}

fn problems(text: &str) -> String {
    match parse_domain_file(text, Path::new("d.yaml")) {
        Ok(_) => panic!("accepted:\n{text}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn r1_an_exact_value_wins_then_the_longest_prefix_then_any_value() {
    let d = domain(
        "domain: d
descriptors:
  - key: path
    rate_limit: { unit: minute, requests_per_unit: 1 }
  - key: path
    value: /api*
    rate_limit: { unit: minute, requests_per_unit: 2 }
  - key: path
    value: /api/v1*
    rate_limit: { unit: minute, requests_per_unit: 3 }
  - key: path
    value: /api/v1/users
    rate_limit: { unit: minute, requests_per_unit: 4 }
",
    );
    let limit = |value: &str| {
        let node = d.lookup(&[("path", value)]).expect("a match");
        d.rules[node.rule.expect("a rule")].limit
    };
    assert_eq!(limit("/api/v1/users"), 4);
    assert_eq!(limit("/api/v1/orders"), 3);
    assert_eq!(limit("/api/v2"), 2);
    assert_eq!(limit("/health"), 1);
    assert!(d.lookup(&[("other", "x")]).is_none());
    assert!(
        d.lookup(&[("path", "/x"), ("deeper", "y")]).is_none(),
        "too deep"
    );
}

/// A level of many values, written in any order between other keys, prefixes and a
/// key without value: each value finds its own rule (the reader orders a level so that
/// a lookup searches it rather than reading it whole), the rest their prefix or the
/// key's own.
#[test]
fn r1_a_level_of_many_values_finds_each_its_rule() {
    let mut text = String::from(
        "domain: d
descriptors:
  - key: user
    rate_limit: { unit: minute, requests_per_unit: 1 }
  - key: user
    value: vip-*
    rate_limit: { unit: minute, requests_per_unit: 2 }
  - key: zone
    value: u5
    rate_limit: { unit: minute, requests_per_unit: 3 }
",
    );
    let users: u32 = 20_000;
    for i in (0..users).rev() {
        text.push_str(&format!(
            "  - key: user\n    value: u{i}\n    rate_limit: {{ unit: minute, requests_per_unit: {} }}\n",
            i + 10
        ));
    }
    let d = domain(&text);
    let limit = |key: &str, value: &str| {
        let node = d.lookup(&[(key, value)]).expect("a match");
        d.rules[node.rule.expect("a rule")].limit
    };
    for i in [0, 1, 5, 9_999, users - 1] {
        assert_eq!(limit("user", &format!("u{i}")), i + 10, "u{i}");
    }
    assert_eq!(limit("user", "vip-1"), 2);
    assert_eq!(limit("user", "u-unknown"), 1);
    assert_eq!(limit("zone", "u5"), 3);
    assert!(d.lookup(&[("zone", "u6")]).is_none());
}

#[test]
fn r1_a_rule_counts_by_its_unit_and_algorithm_and_a_month_is_a_calendar_month() {
    let d = domain(
        "domain: d
descriptors:
  - key: a
    rate_limit: { unit: HOUR, requests_per_unit: 10 }
  - key: b
    rate_limit: { unit: month, requests_per_unit: 1000 }
  - key: c
    rate_limit: { unit: minute, requests_per_unit: 60, algorithm: gcra, burst: 5 }
  - key: d
    rate_limit: { unlimited: true }
",
    );
    assert_eq!(d.rules[0].unit, Unit::Hour);
    assert!(
        matches!(d.rules[0].rate(), Some(Rate::FixedWindow { seconds }) if seconds.get() == 3600)
    );
    assert_eq!(d.rules[1].rate(), Some(Rate::CalendarMonth));
    assert!(matches!(d.rules[2].rate(), Some(Rate::Gcra { burst, .. }) if burst.get() == 5));
    assert_eq!(d.rules[3].rate(), None, "unlimited is never counted");
}

#[test]
fn r1_every_bad_key_of_a_domain_file_is_named_by_its_path() {
    let text = problems(
        "domain: d
colour: blue
descriptors:
  - key: a
    rate_limit: { unit: fortnight, requests_per_unit: 5 }
  - value: x
  - key: b
    rate_limit: { unit: second }
  - key: c
    rate_limit: { unit: month, requests_per_unit: 5, algorithm: sliding }
  - key: e
    rate_limit: { unit: second, requests_per_unit: 5, burst: 2 }
  - key: f
    rate_limit: { unit: second, requests_per_unit: 5, name: f, replaces: [{ name: f }] }
  - key: g
    shadow_mode: sometimes
",
    );
    for expected in [
        "colour: unknown key",
        "descriptors[0].rate_limit.unit: expected second, minute, hour, day, week, month or year, got \"fortnight\"",
        "descriptors[1].key: required",
        "descriptors[2].rate_limit.requests_per_unit: required",
        "descriptors[3].rate_limit.algorithm: a month is a calendar month",
        "descriptors[4].rate_limit.burst: `burst` is for `algorithm: gcra`",
        "descriptors[5].rate_limit.replaces[0].name: a rule cannot replace itself",
        "descriptors[6].shadow_mode: expected true or false",
    ] {
        assert!(text.contains(expected), "missing {expected:?} in:\n{text}");
    }
}

#[test]
fn r1_nesting_and_sizes_are_bounded() {
    let mut text = String::from("domain: deep\ndescriptors:\n");
    let mut indent = String::from("  ");
    for level in 0..=MAX_DESCRIPTOR_DEPTH {
        text.push_str(&format!(
            "{indent}- key: k{level}\n{indent}  descriptors:\n"
        ));
        indent.push_str("    ");
    }
    assert!(problems(&text).contains("at most 16 levels of descriptors"));
    let long = "v".repeat(2000);
    let text = problems(&format!(
        "domain: d\ndescriptors:\n  - key: a\n    value: {long}\n"
    ));
    assert!(
        text.contains("descriptors[0].value: at most 1024 bytes"),
        "{text}"
    );
}

#[test]
fn r1_a_policys_domains_are_checked_with_their_key_paths_and_named_once() {
    let base = sluice_policy::DEFAULT_POLICY_YAML;
    let with = |domains: &str| base.replacen("headers:\n", &format!("{domains}headers:\n"), 1);
    let ok = parse_str(
        &with("domains:\n  - domain: api\n    descriptors:\n      - key: user\n        rate_limit: { unit: day, requests_per_unit: 9 }\n"),
        Path::new("p.yaml"),
    )
    .expect("a policy with a domain");
    assert_eq!(ok.domains.len(), 1);
    assert_eq!(ok.domains[0].source, "domains[0]");
    let bad = parse_str(
        &with("domains:\n  - domain: api\n  - domain: api\n  - domain: x\n    descriptors:\n      - key: a\n        rate_limit: { unit: year }\n"),
        Path::new("p.yaml"),
    )
    .expect_err("refused")
    .to_string();
    assert!(
        bad.contains("domains[1]: domain \"api\" is also defined at domains[0]"),
        "{bad}"
    );
    assert!(
        bad.contains("domains[2].descriptors[0].rate_limit.requests_per_unit: required"),
        "{bad}"
    );
}

/// R1: `unlimited: true` beside a `unit` or a `requests_per_unit` was read as
/// unlimited, the limit it names silently dropped (envoyproxy/ratelimit refuses
/// to load a unit with it: "should not specify rate limit unit when
/// unlimited"). Each is a problem named by the rule's path, in a domain file
/// and in a policy's `domains:`; `unlimited: false` beside them, or
/// `unlimited: true` alone, loads.
#[test]
fn r1_unlimited_with_a_unit_or_a_limit_is_refused_by_its_path() {
    let text = problems(
        "domain: d
descriptors:
  - key: a
    rate_limit: { unit: second, requests_per_unit: 10, unlimited: true }
  - key: b
    descriptors:
      - key: c
        rate_limit: { requests_per_unit: 10, unlimited: true }
  - key: e
    rate_limit: { unit: minute, unlimited: true }
",
    );
    for expected in [
        "descriptors[0].rate_limit.unit: not with `unlimited: true`",
        "descriptors[0].rate_limit.requests_per_unit: not with `unlimited: true`",
        "descriptors[1].descriptors[0].rate_limit.requests_per_unit: not with `unlimited: true`",
        "descriptors[2].rate_limit.unit: not with `unlimited: true`",
    ] {
        assert!(text.contains(expected), "missing {expected:?} in:\n{text}");
    }
    let d = domain(
        "domain: d
descriptors:
  - key: a
    rate_limit: { unit: second, requests_per_unit: 10, unlimited: false }
  - key: b
    rate_limit: { unlimited: true }
",
    );
    assert_eq!((d.rules[0].limit, d.rules[0].unlimited), (10, false));
    assert!(d.rules[1].unlimited);
    let yaml = sluice_policy::DEFAULT_POLICY_YAML.replacen(
        "headers:\n",
        "domains:\n  - domain: api\n    descriptors:\n      - key: user\n        rate_limit: { unit: day, unlimited: true }\nheaders:\n",
        1,
    );
    let bad = parse_str(&yaml, Path::new("p.yaml"))
        .expect_err("refused")
        .to_string();
    assert!(
        bad.contains("domains[0].descriptors[0].rate_limit.unit: not with `unlimited: true`"),
        "{bad}"
    );
}
