//! T7, `turns:`: the tiers of agent runs and their bounds, built in or the
//! policy's, plans overriding a tier's turns; each bad value named by its key
//! path, nothing of a bad policy taken.

use std::path::Path;

use sluice_policy::{Policy, parse_str};

fn yaml(extra: &str) -> String {
    format!(
        "profile: p
profiles:
  p:
    classes: {{ llm: 60, other: 10 }}
default_class: other
{extra}"
    )
}

fn policy(extra: &str) -> Policy {
    parse_str(&yaml(extra), Path::new("turns.yaml")).unwrap_or_else(|e| panic!("{e}"))
}

fn problems(extra: &str) -> String {
    match parse_str(&yaml(extra), Path::new("bad.yaml")) {
        Ok(_) => panic!("accepted:\n{extra}"),
        Err(e) => e.to_string(),
    }
}

fn tiers(p: &Policy) -> Vec<(String, u32)> {
    p.turns
        .tiers
        .iter()
        .map(|(n, t)| (n.clone(), t.get()))
        .collect()
}

#[test]
fn t7_the_seeds_tiers_are_built_in_and_runs_are_counted_where_llm_routes_are() {
    let plain = policy("");
    assert!(
        !plain.turns.enabled,
        "no LLM route, no `turns:`: the run headers are the upstream's"
    );
    assert_eq!(plain.turns.endpoint("/runs/r"), None);
    let llm = policy(
        "routes:\n  - { method: POST, path: /v1/chat/completions, class: llm, llm: openai }\n",
    );
    assert!(llm.turns.enabled);
    let built_in = vec![
        ("quick".to_owned(), 10),
        ("standard".to_owned(), 50),
        ("deep".to_owned(), 75),
    ];
    assert_eq!(tiers(&llm), built_in);
    assert_eq!(llm.turns.tiers[llm.turns.default_tier].0, "standard");
    assert_eq!(llm.turns.idle.get(), 86_400);
    assert_eq!(
        llm.turns.endpoint("/runs/r-1/continue"),
        Some(sluice_policy::RunEndpoint::Continue("r-1"))
    );
    assert_eq!(llm.turns.endpoint("/runsx/r"), None);
}

#[test]
fn t7_a_policy_sets_tiers_bounds_and_plans_their_turns() {
    let p = policy(
        "turns:
  tiers: { quick: 5, research: 200 }
  default_tier: research
  idle_seconds: 3600
  max_grant: 20
  max_granted: 100
  runs_per_caller: 10
  endpoints: /agent-runs
  mcp_session: true
plans:
  pro: { turns: { research: 400 } }
",
    );
    assert!(p.turns.enabled, "`turns:` counts runs on MCP routes too");
    assert_eq!(
        tiers(&p),
        vec![
            ("quick".to_owned(), 5),
            ("standard".to_owned(), 50),
            ("deep".to_owned(), 75),
            ("research".to_owned(), 200)
        ]
    );
    assert_eq!(p.turns.tiers[p.turns.default_tier].0, "research");
    assert_eq!(
        p.turns.tier("RESEARCH"),
        Some(3),
        "a depth is read without regard to case"
    );
    assert_eq!(
        (p.turns.max_grant.get(), p.turns.max_granted.get()),
        (20, 100)
    );
    assert!(p.turns.mcp_session);
    assert_eq!(
        p.turns.endpoint("/agent-runs/x"),
        Some(sluice_policy::RunEndpoint::State("x"))
    );
    let pro = p
        .plans
        .iter()
        .find(|plan| plan.name == "pro")
        .expect("plan pro");
    assert_eq!(pro.turns[3].map(|n| n.get()), Some(400));
    assert!(
        p.describe().contains("research 200 (default)"),
        "{}",
        p.describe()
    );
}

#[test]
fn t7_bad_turns_are_named_by_their_key_path() {
    for (extra, path) in [
        ("turns: { tiers: { quick: 0 } }", "turns.tiers.quick"),
        ("turns: { tiers: { quick: 10001 } }", "turns.tiers.quick"),
        (
            "turns: { tiers: { 'bad tier': 3 } }",
            "turns.tiers.bad tier",
        ),
        ("turns: { default_tier: epic }", "turns.default_tier"),
        ("turns: { idle_seconds: 0 }", "turns.idle_seconds"),
        ("turns: { idle_seconds: 2592001 }", "turns.idle_seconds"),
        ("turns: { max_grant: 0 }", "turns.max_grant"),
        ("turns: { max_granted: 50001 }", "turns.max_granted"),
        (
            "turns: { max_grant: 11, max_granted: 10 }",
            "turns.max_grant",
        ),
        ("turns: { runs_per_caller: 0 }", "turns.runs_per_caller"),
        ("turns: { endpoints: runs }", "turns.endpoints"),
        ("turns: { endpoints: /runs/ }", "turns.endpoints"),
        ("turns: { endpoints: /a/../runs }", "turns.endpoints"),
        ("turns: { endpoints: '/runs/{id}' }", "turns.endpoints"),
        ("turns: { unknown: 1 }", "turns"),
        (
            "plans:\n  pro: { turns: { epic: 5 } }",
            "plans.pro.turns.epic",
        ),
        (
            "plans:\n  pro: { turns: { quick: 0 } }",
            "plans.pro.turns.quick",
        ),
    ] {
        let problems = problems(extra);
        assert!(
            problems.contains(path),
            "{extra}: wanted {path} in:\n{problems}"
        );
    }
}
