//! P1, classes, ceilings and profiles as data: a policy names its own classes (1 to
//! 32, cheapest first), its own per-IP ceilings over sets of them and profiles of any
//! name; nothing of the built-in taxonomy is compiled in. Each bad value is named by
//! its key path.

use std::path::Path;

use http::Method;
use sluice_policy::{ClassSet, Items, MAX_CLASSES, Policy, RouteClass, parse_str};

/// Six classes, three ceilings, two profiles, no `default_class` and no `jsonrpc:`.
const OWN: &str = "profile: free
profiles:
  free:
    classes: { ping: 50, list: 20, search: 6, write: 4, generate: 3, export: 2 }
    ip_ceilings: { ip_all: 40, ip_heavy: 8, ip_light: 30 }
  pro:
    classes: { ping: 500, list: 200, search: 60, write: 40, generate: 30, export: 20 }
    ip_ceilings: { ip_all: 400, ip_heavy: 80, ip_light: 300 }
ceilings:
  ip_all: { classes: [ping, list, search, write, generate, export] }
  ip_heavy: { classes: [generate, export] }
  ip_light: { classes: [ping, list], only: true }
routes:
  - { method: GET, path: /ping, class: ping }
  - { method: POST, path: /generate, class: generate }
  - { class: write }
";

fn own() -> Policy {
    parse_str(OWN, Path::new("own.yaml")).expect("valid")
}

fn problems(yaml: &str) -> String {
    match parse_str(yaml, Path::new("bad.yaml")) {
        Ok(_) => panic!("accepted:\n{yaml}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn p1_a_policy_names_its_own_classes_in_the_order_written() {
    let p = own();
    let names: Vec<&str> = p.classes.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(
        names,
        ["ping", "list", "search", "write", "generate", "export"]
    );
    let generate = p.class("generate").expect("a class");
    assert_eq!(p.class_name(generate), "generate");
    assert_eq!(p.profile.limit(generate).get(), 3);
    assert_eq!(
        p.route(&Method::POST, "/generate").map(|r| r.class.clone()),
        Some(RouteClass::Fixed(generate))
    );
    // No `default_class`: the last route, with no method and no path, is the
    // catch-all, and its class the default.
    assert_eq!(p.class_name(p.default_class), "write");
    // No `jsonrpc:` section: anything a JSON-RPC body would not name is the default.
    assert_eq!(p.jsonrpc.default_class, p.default_class);
    // Profiles have any name.
    let pro = p.with_profile("pro").expect("pro");
    assert_eq!(pro.profile.limit(generate).get(), 30);
    assert_eq!(pro.profile.ceiling(1).get(), 80);
}

#[test]
fn p1_a_ceiling_counts_requests_holding_any_of_its_classes_or_only_them() {
    let p = own();
    let class = |n: &str| p.class(n).expect("a class");
    let held = |names: &[&str]| -> ClassSet { names.iter().map(|n| class(n)).collect() };
    let applies = |ceiling: &str, names: &[&str]| {
        p.ceilings
            .iter()
            .find(|c| c.name == ceiling)
            .expect("a ceiling")
            .applies(held(names))
    };
    assert!(applies("ip_all", &["ping"]) && applies("ip_all", &["export"]));
    assert!(applies("ip_heavy", &["ping", "generate"]));
    assert!(!applies("ip_heavy", &["ping", "list"]));
    assert!(applies("ip_light", &["ping", "list"]));
    assert!(!applies("ip_light", &["ping", "generate"]));
    // A request's items hold their classes.
    let mut items = Items::one(class("ping"));
    items.add(class("export"), 2);
    assert_eq!(items.held, held(&["ping", "export"]));
    assert_eq!(items.count(class("export")), 2);
}

#[test]
fn p1_a_policy_may_have_one_class_and_no_ceiling() {
    let p = parse_str(
        "profiles:\n  only:\n    classes: { call: 100 }\nprofile: only\n",
        Path::new("one.yaml"),
    )
    .expect("valid");
    assert_eq!(p.classes.len(), 1);
    assert!(p.ceilings.is_empty() && p.profile.ceilings.is_empty());
    assert_eq!(p.class_name(p.default_class), "call");
}

#[test]
fn p1_up_to_32_classes_and_not_one_more() {
    let classes = |n: usize| {
        (0..n)
            .map(|i| format!("c{i}: {}", i + 1))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let yaml = |n: usize| {
        format!(
            "profile: p\nprofiles:\n  p:\n    classes: {{ {} }}\ndefault_class: c0\n",
            classes(n)
        )
    };
    let p = parse_str(&yaml(MAX_CLASSES), Path::new("32.yaml")).expect("32 classes");
    assert_eq!(p.classes.len(), 32);
    let last = p.class("c31").expect("the 32nd");
    assert_eq!(p.profile.limit(last).get(), 32);
    let error = problems(&yaml(MAX_CLASSES + 1));
    assert!(
        error.contains("profiles.p.classes: a policy has 1 to 32 classes, this one 33"),
        "{error}"
    );
}

#[test]
fn p1_every_bad_class_ceiling_and_profile_is_named_by_its_key_path() {
    let error = problems(
        "profile: a
profiles:
  a:
    classes: { read: 10, write: 5, \"bad name\": 1 }
    ip_ceilings: { ip: 10, undeclared: 3 }
  b:
    classes: { write: 5, read: 10, \"bad name\": 1 }
    ip_ceilings: {}
ceilings:
  ip: { classes: [read, writ] }
  read: { classes: [read] }
  none: { classes: [] }
routes:
  - { method: GET, path: /x, class: nope }
",
    );
    for expected in [
        "profiles.b.classes: names write, read, bad name where profile a names read, write, bad name",
        "profiles.a.classes.bad name: a class name is 1 to 64 letters",
        "profiles.a.ip_ceilings.undeclared: no ceiling \"undeclared\" under `ceilings:`",
        "profiles.b.ip_ceilings.ip: required",
        "profiles.a.ip_ceilings.none: required",
        "ceilings.ip.classes[1]: unknown class \"writ\"",
        "ceilings.read: a class has this name",
        "ceilings.none.classes: name the classes the ceiling is over",
        "routes[0].class: unknown class \"nope\"",
        "default_class: required",
    ] {
        assert!(
            error.contains(expected),
            "missing {expected:?} in:\n{error}"
        );
    }
}

#[test]
fn p1_the_seeds_ceiling_names_in_a_profile_need_their_ceilings_declared() {
    // A file written before ceilings were data names `work` and `protocol_only`:
    // refused with the key path and where to declare them, never read as no ceiling.
    let error = problems(
        "profile: p
profiles:
  p:
    classes: { protocol: 600, read: 300, standard: 60, expensive: 30 }
    ip_ceilings: { work: 300, protocol_only: 1200 }
default_class: standard
",
    );
    assert!(
        error.contains(
            "profiles.p.ip_ceilings.work: no ceiling \"work\" under `ceilings:` (declared: none)"
        ),
        "{error}"
    );
}

#[test]
fn p1_lane_refusal_reasons_are_named_after_the_lane_or_by_the_policy() {
    let lanes = |extra: &str| {
        format!(
            "profile: p
profiles:
  p:
    classes: {{ call: 10 }}
lanes:
  render:
    global_in_flight: 4
    batch_reserve: 1
{extra}"
        )
    };
    let p = parse_str(&lanes(""), Path::new("lanes.yaml")).expect("valid");
    let render = &p.lanes[0];
    assert_eq!(render.reason_name("busy"), "render_busy");
    assert_eq!(render.reason_name("unavailable"), "render_unavailable");
    assert_eq!(
        render.reason_name("workspace_rate_limit"),
        "workspace_rate_limit"
    );
    let p = parse_str(
        &lanes("    reasons: { busy: renderer_full, unavailable: renderer_down }\n"),
        Path::new("lanes.yaml"),
    )
    .expect("valid");
    assert_eq!(p.lanes[0].reason_name("busy"), "renderer_full");
    let error = problems(&lanes("    reasons: { busy: \"Not A Reason\" }\n"));
    assert!(
        error.contains("lanes.render.reasons.busy: a reason is 1 to 64 lower-case letters"),
        "{error}"
    );
}
