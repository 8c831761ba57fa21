//! P3, plans: named sets of overrides of the profile's limits, one per workspace
//! (from `workspaces:` or the key table), `default` for the rest. Each bad value is
//! named by its key path and nothing of a bad policy is taken.

use std::path::Path;

use sluice_policy::{Enforcement, Policy, parse_str, workspace_digest};

const KEY_A: &str = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";
const KEY_B: &str = "60303ae22b998861bce3b28f33eec1be758a213c86c93c076dbe9f558c11c752";

fn yaml(extra: &str) -> String {
    format!(
        "profile: p
profiles:
  p:
    classes: {{ search: 60, generate: 10 }}
    ip_ceilings: {{ ip: 100 }}
ceilings:
  ip: {{ classes: [search, generate] }}
default_class: search
buckets:
  exports: {{ limit: 5, window_seconds: 60, per: workspace }}
quotas:
  images: {{ monthly: 100 }}
{extra}"
    )
}

fn policy(extra: &str) -> Policy {
    parse_str(&yaml(extra), Path::new("plans.yaml")).unwrap_or_else(|e| panic!("{e}"))
}

fn problems(extra: &str) -> String {
    match parse_str(&yaml(extra), Path::new("bad.yaml")) {
        Ok(_) => panic!("accepted:\n{extra}"),
        Err(e) => e.to_string(),
    }
}

const PLANS: &str = "plans:
  default:
    classes: { generate: 2 }
  pro:
    classes: { generate: 50 }
    ip_ceilings: { ip: 1000 }
    buckets: { exports: 50 }
    quotas: { images: 10000 }
  trial:
    classes: { generate: 1 }
    mode: shadow
workspaces:
  acme: { plan: pro }
";

#[test]
fn p3_a_workspace_gets_its_plans_limits_and_the_rest_the_default_plans() {
    let p = policy(&format!(
        "{PLANS}identity:
  keys:
    - {{ sha256: {KEY_A}, workspace: acme, user: ada }}
    - {{ sha256: {KEY_B}, workspace: globex, user: bo, plan: trial }}
"
    ));
    let generate = p.class("generate").expect("a class");
    let plan = |ws: &str| p.plan_of(workspace_digest(ws)).map(|t| t.name.as_str());
    assert_eq!(plan("acme"), Some("pro"), "from workspaces:");
    assert_eq!(plan("globex"), Some("trial"), "from the key table");
    assert_eq!(plan("initech"), Some("default"), "on no plan: default");
    let pro = p.plan_of(workspace_digest("acme")).expect("pro");
    assert_eq!(pro.classes[generate.index()].map(|l| l.get()), Some(50));
    assert_eq!(pro.ceilings[0].map(|l| l.get()), Some(1000));
    assert_eq!(pro.buckets[0].map(|l| l.get()), Some(50));
    assert_eq!(pro.quotas[0].map(|l| l.get()), Some(10_000));
    // What a plan does not name comes from the profile.
    let search = p.class("search").expect("a class");
    assert_eq!(pro.classes[search.index()], None);
    assert_eq!(
        p.plan_of(workspace_digest("globex")).map(|t| t.mode),
        Some(Enforcement::Shadow)
    );
    assert_eq!(p.tenants.by_name.len(), 2);
    // `sluice check` prints what a workspace on each plan gets.
    let text = p.describe();
    assert!(
        text.contains("plan pro: per caller and class: search 60, generate 50*; per IP: ip 1000*; buckets: exports 50*/60 s; quotas: images 10000*/month"),
        "{text}"
    );
    assert!(
        text.contains("plan trial (shadow): per caller and class: search 60, generate 1*"),
        "{text}"
    );
    assert!(
        text.contains("workspaces on a plan: 2 (the others on plan default)"),
        "{text}"
    );
}

#[test]
fn p3_without_plans_every_workspace_gets_the_profiles_limits() {
    let p = policy("");
    assert!(p.plans.is_empty() && p.default_plan.is_none());
    assert!(p.plan_of(workspace_digest("acme")).is_none());
}

#[test]
fn p3_every_bad_override_is_named_by_its_key_path() {
    let error = problems(&format!(
        "plans:
  pro:
    classes: {{ nope: 5, generate: 0 }}
    ip_ceilings: {{ ip_v6: 5 }}
    buckets: {{ imports: 5 }}
    quotas: {{ videos: 5 }}
    lanes: {{ optimizer: {{ workspace_in_flight: 5 }} }}
    mode: loud
  \"bad name\": {{}}
workspaces:
  acme: {{ plan: gold }}
  \"key:abc\": {{ plan: pro }}
identity:
  keys:
    - {{ sha256: {KEY_A}, workspace: initech, user: ada, plan: pro }}
    - {{ sha256: {KEY_B}, workspace: initech, user: bo, plan: \"bad name\" }}
"
    ));
    for expected in [
        "plans.pro.classes.nope: unknown class \"nope\"",
        "plans.pro.classes.generate: must be at least 1",
        "plans.pro.ip_ceilings.ip_v6: no ceiling \"ip_v6\"",
        "plans.pro.buckets.imports: no bucket \"imports\"",
        "plans.pro.quotas.videos: no quota family \"videos\"",
        "plans.pro.lanes.optimizer: no lane \"optimizer\" under `lanes:`",
        "plans.pro.mode: expected enforce or shadow, got \"loud\"",
        "plans.bad name: a plan name is 1 to 64 letters",
        "workspaces.acme.plan: no plan \"gold\" under `plans:`",
        "workspaces.key:abc: expected printable ASCII not starting with `key:` or `ip:`",
    ] {
        assert!(
            error.contains(expected),
            "missing {expected:?} in:\n{error}"
        );
    }
}

#[test]
fn p3_two_plans_for_one_workspace_are_refused() {
    let error = problems(&format!(
        "plans:
  pro: {{}}
  free: {{}}
workspaces:
  acme: {{ plan: pro }}
identity:
  keys:
    - {{ sha256: {KEY_A}, workspace: acme, user: ada, plan: free }}
    - {{ sha256: {KEY_B}, workspace: acme, user: bo, plan: pro }}
"
    ));
    assert!(
        error.contains("identity.keys[0].plan: workspace \"acme\" is on plan \"pro\" by workspaces.acme.plan: a workspace has one plan"),
        "{error}"
    );
    assert!(!error.contains("identity.keys[1]"), "{error}");
}

#[test]
fn p3_a_plan_limit_below_a_gcra_burst_is_refused() {
    let error = problems(
        "algorithms:
  generate: { algorithm: gcra, burst: 5 }
plans:
  free:
    classes: { generate: 3 }
",
    );
    assert!(
        error.contains("plans.free.classes.generate: 3 is below the budget's gcra burst (5)"),
        "{error}"
    );
}

const LANE: &str = "lanes:
  optimizer: { workspace_in_flight: 3, workspace_starts: 12, starts_window_seconds: 60 }
";

#[test]
fn p3_a_plan_sets_a_lanes_per_workspace_limits_and_the_lane_keeps_the_rest() {
    let p = policy(&format!(
        "{LANE}plans:
  default:
    lanes: {{ optimizer: {{ workspace_starts: 6 }} }}
  pro:
    lanes: {{ optimizer: {{ workspace_in_flight: 10, workspace_starts: 60 }} }}
workspaces:
  acme: {{ plan: pro }}
"
    ));
    let limits = |workspace: &str| {
        let (running, starts) = p
            .lane_limits(p.plan_of(workspace_digest(workspace)), 0)
            .expect("the lane");
        (running.get(), starts.get())
    };
    assert_eq!(limits("acme"), (10, 60), "pro's own");
    assert_eq!(
        limits("globex"),
        (3, 6),
        "default's starts, the lane's in flight"
    );
    assert_eq!(
        p.lane_limits(None, 0).map(|(r, s)| (r.get(), s.get())),
        Some((3, 12))
    );
    assert!(p.lane_limits(None, 1).is_none(), "no second lane");
    let described = p.describe_plans().join("\n");
    assert!(
        described.contains("per workspace in lanes: optimizer 10* running, 60* started"),
        "{described}"
    );
    assert!(
        described.contains("optimizer 3 running, 6* started"),
        "{described}"
    );
}

#[test]
fn p3_every_bad_lane_override_is_named_by_its_key_path() {
    let error = problems(&format!(
        "{LANE}plans:
  pro:
    lanes:
      optimizer: {{ workspace_in_flight: 0, workspace_starts: 100001 }}
      translator: {{ workspace_in_flight: 2 }}
  empty:
    lanes: {{ optimizer: {{}} }}
  trial:
    mode: shadow
    lanes: {{ optimizer: {{ workspace_in_flight: 9 }} }}
"
    ));
    for expected in [
        "plans.pro.lanes.optimizer.workspace_in_flight: must be at least 1",
        "plans.pro.lanes.optimizer.workspace_starts: at most 100000",
        "plans.pro.lanes.translator: no lane \"translator\" under `lanes:`",
        "plans.empty.lanes.optimizer: names no limit",
        "plans.trial.lanes.optimizer: a plan in shadow mode cannot set a lane's limits",
    ] {
        assert!(
            error.contains(expected),
            "missing {expected:?} in:\n{error}"
        );
    }
    let unknown = problems(&format!(
        "{LANE}plans:
  pro:
    lanes: {{ optimizer: {{ global_in_flight: 40 }} }}
"
    ));
    assert!(unknown.contains("global_in_flight"), "{unknown}");
}

/// The documented bound is 100,000 workspaces on a plan (and as many known keys); the
/// YAML reader's default node budget stopped a file at about 62,000. A file at the
/// bound loads; one past it is refused by the validator, naming the bound.
#[test]
fn p3_a_file_with_100000_workspaces_and_keys_loads_and_one_more_is_refused() {
    fn file(workspaces: usize, keys: usize) -> String {
        let mut extra =
            String::from("plans:\n  pro:\n    classes: { generate: 50 }\nworkspaces:\n");
        for i in 0..workspaces {
            extra.push_str(&format!("  ws{i}: {{ plan: pro }}\n"));
        }
        if keys > 0 {
            extra.push_str("identity:\n  keys:\n");
        }
        for i in 0..keys {
            extra.push_str(&format!(
                "    - {{ sha256: \"{i:064x}\", workspace: k{i}, user: u{i} }}\n"
            ));
        }
        yaml(&extra)
    }
    let at_bound = file(sluice_policy::MAX_WORKSPACES, sluice_policy::MAX_KEYS);
    let loaded = parse_str(&at_bound, Path::new("big.yaml")).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(loaded.identity.keys.len(), sluice_policy::MAX_KEYS);
    let past = parse_str(
        &file(sluice_policy::MAX_WORKSPACES + 1, 0),
        Path::new("past.yaml"),
    )
    .err()
    .map(|e| e.to_string())
    .unwrap_or_default();
    assert!(past.contains("at most 100000 workspaces"), "{past}");
}

/// SPEC T4 with P3: a plan overrides a money budget's monthly dollars
/// (`plans.<p>.spend`), as it does a token budget's limit; `sluice check` tells
/// it as the plan's own; a name that is no money budget, or a bad amount, is a
/// problem at its key path.
#[test]
fn t4_p3_a_plan_overrides_a_money_budgets_dollars() {
    let yaml = |plan: &str| {
        format!(
            "profile: p
profiles:
  p:
    classes: {{ llm: 60 }}
default_class: llm
tokens:
  tpm: {{ per: workspace, limit: 1000, window_seconds: 60 }}
prices:
  - {{ model: gpt-4o, input: 2.5, output: 10 }}
spend:
  usd_month: {{ per: workspace, limit_usd: 50, monthly: true }}
routes:
  - {{ method: POST, path: /v1/chat/completions, class: llm, llm: openai, tokens: [tpm], spend: [usd_month] }}
plans:
{plan}
"
        )
    };
    let policy = parse_str(
        &yaml("  big: { spend: { usd_month: 500.25 } }"),
        Path::new("t4.yaml"),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let big = policy
        .plans
        .iter()
        .find(|p| p.name == "big")
        .expect("plan big");
    let i = policy
        .buckets
        .iter()
        .position(|b| b.name == "usd_month")
        .expect("the money budget");
    assert_eq!(
        big.buckets[i].map(|n| n.get()),
        Some(50_025_000),
        "in 1e-5 USD"
    );
    assert!(
        policy.describe().contains("usd_month 500.25 USD*/month"),
        "{}",
        policy.describe()
    );
    for (plan, path) in [
        ("  big: { spend: { tpm: 5 } }", "plans.big.spend.tpm"),
        (
            "  big: { spend: { usd_month: 0 } }",
            "plans.big.spend.usd_month",
        ),
        (
            "  big: { spend: { usd_month: -3 } }",
            "plans.big.spend.usd_month",
        ),
        (
            "  big: { spend: { usd_month: 1000000 } }",
            "plans.big.spend.usd_month",
        ),
        (
            "  big: { tokens: { usd_month: 5 } }",
            "plans.big.tokens.usd_month",
        ),
    ] {
        let e = parse_str(&yaml(plan), Path::new("bad.yaml"))
            .expect_err(plan)
            .to_string();
        assert!(e.contains(path), "{plan}: wanted {path} in {e}");
    }
}
