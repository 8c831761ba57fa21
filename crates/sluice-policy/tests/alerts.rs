//! O3, `alerts:`: webhooks told when a budget passes shares of its limit —
//! validated (each bad value named by its key path, nothing of a bad policy
//! taken) and described as `sluice check` prints it.

use std::path::Path;
use std::time::Duration;

use sluice_policy::{Policy, parse_str};

fn yaml(alerts: &str) -> String {
    format!(
        "profile: p
profiles:
  p:
    classes: {{ llm: 60, other: 10 }}
default_class: other
quotas:
  messages: {{ monthly: 100 }}
tokens:
  team: {{ per: workspace, limit: 100000, monthly: true }}
prices:
  - {{ model: \"gpt-4o*\", input: 2.5, output: 10 }}
spend:
  dollars: {{ per: workspace, limit_usd: 50, monthly: true }}
routes:
  - {{ method: POST, path: /v1/chat/completions, class: llm, llm: openai, tokens: [team], spend: [dollars] }}
  - {{ method: POST, path: /messages, class: other, quota: messages }}
{alerts}"
    )
}

fn policy(alerts: &str) -> Policy {
    parse_str(&yaml(alerts), Path::new("alerts.yaml")).unwrap_or_else(|e| panic!("{e}"))
}

fn problems(alerts: &str) -> String {
    match parse_str(&yaml(alerts), Path::new("bad.yaml")) {
        Ok(_) => panic!("accepted:\n{alerts}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn o3_an_alert_names_its_webhook_thresholds_budgets_and_secret_and_is_described() {
    let p = policy(
        "alerts:
  - url: https://billing.example/hooks/sluice
    at: [1.0, 0.8, 0.8]
    budgets: [messages, team, dollars]
    secret_file: /etc/sluice/alert-secret
    retry_ms: 50
",
    );
    let a = &p.alerts[0];
    assert_eq!(a.url, "https://billing.example/hooks/sluice");
    assert_eq!(a.at_permille, [800, 1000], "sorted, once each");
    assert_eq!(a.budgets, ["messages", "team", "dollars"]);
    assert_eq!(a.timeout, Duration::from_secs(5));
    assert_eq!(a.retry, Duration::from_millis(50));
    assert_eq!(a.max_retry, Duration::from_secs(300));
    let described = p.describe();
    assert!(
        described.contains(
            "alert: POST https://billing.example/hooks/sluice when messages, team, dollars passes 80%, 100% of its limit"
        ),
        "{described}"
    );
    assert!(
        described.contains("/etc/sluice/alert-secret"),
        "{described}"
    );
    assert!(policy("").alerts.is_empty());
}

#[test]
fn o3_bad_alerts_are_named_by_their_key_paths() {
    let bad = problems(
        "alerts:
  - url: ftp://x
    at: [0, 1.5]
    budgets: [messages, nope, llm]
    timeout_ms: 0
    retry_ms: 5000
    max_retry_ms: 1000
  - { url: 'http://hook', at: [], budgets: [], secret_file: '' }
",
    );
    for path in [
        "alerts[0].url",
        "alerts[0].at[0]",
        "alerts[0].at[1]",
        "alerts[0].budgets[1]",
        "alerts[0].budgets[2]",
        "alerts[0].secret_file",
        "alerts[0].timeout_ms",
        "alerts[0].max_retry_ms",
        "alerts[1].at",
        "alerts[1].budgets",
        "alerts[1].secret_file",
    ] {
        assert!(bad.contains(path), "{path} not named:\n{bad}");
    }
    assert!(!bad.contains("alerts[0].budgets[0]"), "{bad}");
    assert!(
        problems("alerts:\n  - { url: http://h, at: [1], budgets: [messages], secret_file: s, typo: 1 }\n")
            .contains("typo"),
        "an unknown key is refused"
    );
    let nine = "  - { url: http://h, at: [1], budgets: [messages], secret_file: s }\n".repeat(9);
    assert!(problems(&format!("alerts:\n{nine}")).contains("at most 8 webhooks"));
}
