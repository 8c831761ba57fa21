//! SPEC O4: the usage export's rows (per workspace, day and model) add up to
//! exactly what the budgets counted — `/usage`'s tokens and money, `/quotas`'
//! units, the calls admitted — on every store (memory, the embedded durable one,
//! Redis), and the durable store's rows survive a restart. Driven through the
//! edge's intake on a fake clock, a real redis-server behind.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::Path;
use std::time::Duration;

use http::{HeaderMap, HeaderValue, Method, Version};
use serde_json::Value;
use sluice_core::{FakeClock, Timestamp};
use sluice_edge::{Limiter, UsageExport, UsageMonth};
use sluice_policy::parse_str;
use sluice_store::{BudgetStore, MemoryConfig, MemoryStore, RedisConfig, RedisStore};
use sluice_tokens::Usage;

use crate::redis_server;

/// 2093-07-11T23:00:00Z: an hour before a day turns, mid-month, ahead of the real
/// clock Redis expires keys by.
const T0: u64 = 3_897_244_800 + 10 * 86_400 + 23 * 3_600;

const PEER: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(203, 0, 113, 7));

/// An LLM route with two priced families (and unpriced models counted as
/// `other`) spending a monthly quota, and a plain route spending another.
const POLICY: &str = r#"
profile: default
window_seconds: 3600
profiles:
  default:
    classes: { llm: 1000000, plain: 1000000 }
identity:
  credentials: [bearer]
quotas:
  completions: {}
  messages: { monthly: 1000 }
tokens:
  team: { per: caller, limit: 1000000, window_seconds: 3600 }
prices:
  - { model: "gpt-4o*", input: 2.5, output: 10, cached_input: 1.25 }
  - { model: "claude*", input: 3, output: 15, cached_input: 0.3 }
routes:
  - { method: POST, path: /v1/chat/completions, class: llm, llm: openai, tokens: [team], quota: completions }
  - { method: POST, path: /messages, class: plain, quota: messages }
  - { class: plain }
"#;

fn policy() -> sluice_policy::Policy {
    parse_str(POLICY, Path::new("export.yaml")).expect("the test policy")
}

fn headers(key: &str) -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert(
        "authorization",
        HeaderValue::from_str(&format!("Bearer {key}")).expect("ascii"),
    );
    headers
}

/// A chat call's body naming `model`, 50 output tokens.
fn chat_body(model: &str) -> String {
    serde_json::json!({
        "model": model,
        "messages": [{ "role": "user", "content": "Say hi." }],
        "max_tokens": 50,
    })
    .to_string()
}

/// One chat call of `model` as `key`, admitted and settled with `usage` (none:
/// charged its reservation).
async fn chat<S: BudgetStore>(limiter: &Limiter<S>, key: &str, model: &str, usage: Option<Usage>) {
    let headers = headers(key);
    let path = "/v1/chat/completions";
    let body = chat_body(model);
    let route = limiter.route_head(&Method::POST, Version::HTTP_2, [], Ok(path), Some(&headers));
    let mut intake = limiter.intake(route, PEER);
    intake.set_path(path);
    let Ok(forward) = intake
        .planned(&headers, None, Some(body.as_bytes()))
        .admit(None)
        .await
    else {
        panic!("chat refused");
    };
    let (plan, decision) = forward.settlement().expect("an LLM call");
    limiter.settle_usage(&plan, decision, usage, false).await;
}

/// One `POST /messages` as `key`, admitted.
async fn message<S: BudgetStore>(limiter: &Limiter<S>, key: &str) {
    let headers = headers(key);
    let path = "/messages";
    let route = limiter.route_head(&Method::POST, Version::HTTP_2, [], Ok(path), Some(&headers));
    let mut intake = limiter.intake(route, PEER);
    intake.set_path(path);
    assert!(
        intake
            .planned(&headers, None, Some(b"{}"))
            .admit(None)
            .await
            .is_ok(),
        "message refused"
    );
}

/// The whole export of `month`, one JSON value a line.
async fn export<S: BudgetStore>(limiter: &Limiter<S>, month: &str) -> Vec<Value> {
    let month: UsageMonth = month.parse().expect("a month");
    let month = limiter.usage_export_month(Some(month)).await.expect("kept");
    let mut export = UsageExport::new(month);
    let mut lines = Vec::new();
    while let Some(page) = limiter
        .usage_export_page(&mut export)
        .await
        .expect("the store answers")
    {
        for line in page.lines() {
            lines.push(serde_json::from_str(line).expect("a JSON line"));
        }
    }
    lines
}

/// The workspace of an unknown credential: `key:<its SHA-256 in hex>`.
fn own_workspace(key: &str) -> String {
    use sha2::Digest as _;
    let hex: String = sha2::Sha256::digest(key.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("key:{hex}")
}

const USAGE: Usage = Usage {
    prompt: 20,
    completion: 30,
    cached_input: 5,
    rate_exempt_input: 0,
};

/// Calls of two workspaces over two days (the day turns in the middle): chats of
/// three model families, one settled at its reservation (no usage), and plain
/// messages.
async fn traffic<S: BudgetStore>(limiter: &Limiter<S>, clock: &FakeClock) {
    clock.advance(Duration::from_secs(60));
    for _ in 0..3 {
        chat(limiter, "alice", "gpt-4o-mini", Some(USAGE)).await;
    }
    chat(limiter, "alice", "claude-sonnet-4", Some(USAGE)).await;
    chat(limiter, "bob", "mystery-model", Some(USAGE)).await;
    message(limiter, "alice").await;
    message(limiter, "bob").await;
    // The next day (UTC).
    clock.advance(Duration::from_secs(3_600));
    chat(limiter, "alice", "gpt-4o", Some(USAGE)).await;
    chat(limiter, "alice", "gpt-4o", None).await;
    chat(limiter, "bob", "claude-haiku", Some(USAGE)).await;
    message(limiter, "alice").await;
    message(limiter, "alice").await;
}

/// Each workspace's sums over the export's lines.
fn sums(lines: &[Value]) -> BTreeMap<String, [u64; 7]> {
    let mut by_workspace: BTreeMap<String, [u64; 7]> = BTreeMap::new();
    for l in lines {
        let w = l["workspace"].as_str().expect("a workspace").to_owned();
        let n = |v: &Value| v.as_u64().unwrap_or(0);
        let s = by_workspace.entry(w).or_default();
        s[0] += n(&l["calls"]);
        s[1] += n(&l["quota_units"]["completions"]);
        s[2] += n(&l["quota_units"]["messages"]);
        s[3] += n(&l["tokens"]["input"]);
        s[4] += n(&l["tokens"]["cached_input"]);
        s[5] += n(&l["tokens"]["output"]);
        s[6] += n(&l["spend_units"]);
    }
    by_workspace
}

/// What the budgets counted for `workspace`: calls admitted (given), `/quotas`'
/// units by family, `/usage`'s tokens and money (in 1e-5 USD).
async fn counted<S: BudgetStore>(limiter: &Limiter<S>, workspace: &str, calls: u64) -> [u64; 7] {
    let quotas = limiter.quota_usage(workspace).await.expect("quotas");
    let quota = |f: &str| {
        quotas
            .iter()
            .find(|q| q.family == f)
            .map_or(0, |q| u64::from(q.usage))
    };
    let usage = limiter
        .llm_usage(workspace, Some("2093-07".parse().expect("month")))
        .await
        .expect("usage");
    let n = |v: &Value| v.as_u64().unwrap_or(0);
    let spend = (usage["spend_usd"].as_f64().unwrap_or(0.0) * 100_000.0).round() as u64;
    [
        calls,
        quota("completions"),
        quota("messages"),
        n(&usage["tokens"]["input"]),
        n(&usage["tokens"]["cached_input"]),
        n(&usage["tokens"]["output"]),
        spend,
    ]
}

/// Checks the export of July 2093 after [`traffic`] against the budgets.
async fn check<S: BudgetStore>(limiter: &Limiter<S>, store: &str) -> Vec<Value> {
    let lines = export(limiter, "2093-07").await;
    let (alice, bob) = (own_workspace("alice"), own_workspace("bob"));
    let sums = sums(&lines);
    assert_eq!(sums.len(), 2, "{store}: {lines:?}");
    assert_eq!(sums[&alice], counted(limiter, &alice, 9).await, "{store}");
    assert_eq!(sums[&bob], counted(limiter, &bob, 3).await, "{store}");
    // A line per workspace, day and model: alice has gpt-4o* and claude* and
    // plain calls (model null) on the 11th, gpt-4o* and plain on the 12th.
    let mut rows: Vec<(String, String, Value, u64)> = lines
        .iter()
        .map(|l| {
            (
                l["workspace"].as_str().unwrap_or("").to_owned(),
                l["day"].as_str().unwrap_or("").to_owned(),
                l["model"].clone(),
                l["calls"].as_u64().unwrap_or(0),
            )
        })
        .collect();
    rows.sort_by(|a, b| format!("{a:?}").cmp(&format!("{b:?}")));
    let row = |w: &str, d: &str, m: Value, c: u64| (w.to_owned(), d.to_owned(), m, c);
    let mut expected = vec![
        row(&alice, "2093-07-11", "gpt-4o*".into(), 3),
        row(&alice, "2093-07-11", "claude*".into(), 1),
        row(&alice, "2093-07-11", Value::Null, 1),
        row(&alice, "2093-07-12", "gpt-4o*".into(), 2),
        row(&alice, "2093-07-12", Value::Null, 2),
        row(&bob, "2093-07-11", "other".into(), 1),
        row(&bob, "2093-07-11", Value::Null, 1),
        row(&bob, "2093-07-12", "claude*".into(), 1),
    ];
    expected.sort_by(|a, b| format!("{a:?}").cmp(&format!("{b:?}")));
    assert_eq!(rows, expected, "{store}");
    // Each priced call: 15 × 2.50 + 5 × 1.25 + 30 × 10 per million, rounded up
    // to 35 units; a claude one 15 × 3 + 5 × 0.3 + 30 × 15: 50 units.
    let gpt_day_one = lines
        .iter()
        .find(|l| l["workspace"] == alice && l["day"] == "2093-07-11" && l["model"] == "gpt-4o*")
        .expect("a line");
    assert_eq!(gpt_day_one["spend_units"], 3 * 35, "{store}: {gpt_day_one}");
    assert_eq!(gpt_day_one["tokens"]["output"], 3 * 30, "{store}");
    assert_eq!(gpt_day_one["quota_units"]["completions"], 3, "{store}");
    // The call of the 12th that ended without a usage is counted as its budgets
    // kept it: its reservation (the prompt's estimate, the 50 output tokens it
    // named, and their price), beside the one settled at its usage.
    let policy = policy();
    let reserved = sluice_edge::tokens::Reservation::of(
        sluice_policy::LlmFormat::OpenAi,
        "/v1/chat/completions",
        chat_body("gpt-4o").as_bytes(),
        (&policy.prices, true),
    )
    .expect("a chat body");
    assert!(reserved.input > 0 && reserved.output == Some(50));
    let price = &policy.prices[0];
    let gpt_day_two = lines
        .iter()
        .find(|l| l["workspace"] == alice && l["day"] == "2093-07-12" && l["model"] == "gpt-4o*")
        .expect("a line");
    assert_eq!(
        gpt_day_two["tokens"]["input"],
        15 + u64::from(reserved.input),
        "{store}: {gpt_day_two}"
    );
    assert_eq!(gpt_day_two["tokens"]["output"], 30 + 50, "{store}");
    assert_eq!(
        gpt_day_two["spend_units"],
        35 + u64::from(price.cost(reserved.input, 0, 50)),
        "{store}"
    );
    // A month with nothing in it has no line; one not begun is refused.
    assert!(export(limiter, "2093-06").await.is_empty(), "{store}");
    assert!(matches!(
        limiter
            .usage_export_month(Some("2093-08".parse().expect("month")))
            .await,
        Err(sluice_edge::QuotaQueryError::FutureMonth(_))
    ));
    lines
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn o4_export_sums_equal_what_the_budgets_counted_on_every_store() {
    let server = redis_server::RedisServer::start("o4");
    let dir = std::env::temp_dir().join(format!(
        "sluice-o4-{}-{}",
        std::process::id(),
        fastrand::u64(..)
    ));
    for store in ["memory", "durable", "redis"] {
        let clock = FakeClock::new(Timestamp::from_secs(T0));
        let memory = || MemoryStore::with_clock(MemoryConfig::default(), clock.clone());
        let durable = || {
            let file = sluice_store::DurableStore::open(&dir).expect("data dir");
            let book = sluice_store::QuotaBook::open(
                &file,
                sluice_store::QuotaBookConfig::default(),
                sluice_core::Clock::now(&clock),
            )
            .expect("quota book");
            sluice_store::LocalStore::new(memory(), Some(book))
        };
        match store {
            "memory" => {
                let limiter = Limiter::new(policy(), memory());
                traffic(&limiter, &clock).await;
                check(&limiter, store).await;
            }
            "durable" => {
                let limiter = Limiter::new(policy(), durable());
                traffic(&limiter, &clock).await;
                let before = check(&limiter, store).await;
                // Restarted on the same data dir: the same lines.
                drop(limiter);
                let reopened = Limiter::new(policy(), durable());
                assert_eq!(export(&reopened, "2093-07").await, before);
            }
            _ => {
                let connect = || async {
                    let mut config = RedisConfig::new(server.url());
                    config.timeout = Duration::from_secs(2);
                    RedisStore::connect_with_clock(config, clock.clone())
                        .await
                        .expect("connect")
                };
                let limiter = Limiter::new(policy(), connect().await);
                traffic(&limiter, &clock).await;
                let lines = check(&limiter, store).await;
                // Another replica on the same Redis exports the same lines.
                let other = Limiter::new(policy(), connect().await);
                assert_eq!(export(&other, "2093-07").await, lines);
            }
        }
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// A memory store on a clock at [`T0`] whose July 2093 list of workspaces the policy
/// does not name is full (rows of another day, each a credential's workspace).
fn unnamed_rows_full() -> (FakeClock, MemoryStore<FakeClock>) {
    let clock = FakeClock::new(Timestamp::from_secs(T0));
    let store = MemoryStore::with_clock(MemoryConfig::default(), clock.clone());
    let bound = sluice_store::UsageRowBound {
        max_rows: sluice_edge::MAX_USAGE_ROWS,
        kept_until: u64::MAX,
    };
    let unnamed = format!("2093-07{}", sluice_edge::UNNAMED);
    for i in 0..sluice_edge::MAX_USAGE_ROWS {
        let row = format!("[\"2093-07-01\",\"key:{i:064x}\",null]");
        assert!(store.note_usage_row_now(&unnamed, &row, bound));
    }
    (clock, store)
}

/// SPEC O4, bounded: a month lists at most `MAX_USAGE_ROWS` rows; past it a new
/// workspace's counts go to its day's and model's overflow row, so the month's
/// sums stay whole. (Exercised on the store's bound directly: filling 100,000
/// rows through the edge would take the test's whole budget.)
#[tokio::test]
async fn o4_a_full_month_folds_new_rows_into_an_overflow_row() {
    let (clock, store) = unnamed_rows_full();
    let limiter = Limiter::new(policy(), store);
    clock.advance(Duration::from_secs(60));
    message(&limiter, "carol").await;
    chat(&limiter, "carol", "gpt-4o", Some(USAGE)).await;
    let lines = export(&limiter, "2093-07").await;
    let overflow: Vec<&Value> = lines.iter().filter(|l| l["overflow"] == true).collect();
    assert_eq!(overflow.len(), 2, "{overflow:?}");
    assert!(overflow.iter().all(|l| l["workspace"].is_null()));
    let calls: u64 = overflow
        .iter()
        .map(|l| l["calls"].as_u64().unwrap_or(0))
        .sum();
    assert_eq!(calls, 2);
    let output: u64 = overflow
        .iter()
        .map(|l| l["tokens"]["output"].as_u64().unwrap_or(0))
        .sum();
    assert_eq!(output, 30);
}

/// SPEC O4, bounded against a flood: every fresh credential is a workspace of
/// its own, so anyone can fill a month's rows. The workspaces the policy names
/// keep a list of their own: with the others' list full, a named workspace's
/// new day still gets its row (counted by name), while a fresh credential's
/// call folds into the overflow row.
#[tokio::test]
async fn o4_unknown_credentials_cannot_fold_a_named_workspace_into_the_overflow() {
    // What a flood of throwaway credentials leaves.
    let (clock, store) = unnamed_rows_full();
    // `sha256("a")`: acme's key.
    let named = POLICY.replace(
        "  credentials: [bearer]\n",
        "  credentials: [bearer]
  keys:
    - { sha256: ca978112ca1bbdcafac231b39a23dc4da786eff8147c4e72b9807785afee48bb, workspace: acme, user: ada }
",
    );
    let policy = parse_str(&named, Path::new("export.yaml")).expect("the test policy");
    let limiter = Limiter::new(policy, store);
    clock.advance(Duration::from_secs(60));
    message(&limiter, "a").await;
    chat(&limiter, "a", "gpt-4o", Some(USAGE)).await;
    message(&limiter, "throwaway").await;
    let lines = export(&limiter, "2093-07").await;
    let acme: Vec<&Value> = lines.iter().filter(|l| l["workspace"] == "acme").collect();
    assert_eq!(acme.len(), 2, "acme's rows by name: {lines:?}");
    let acme_calls: u64 = acme.iter().map(|l| l["calls"].as_u64().unwrap_or(0)).sum();
    assert_eq!(acme_calls, 2);
    assert_eq!(
        acme.iter()
            .map(|l| l["tokens"]["output"].as_u64().unwrap_or(0))
            .sum::<u64>(),
        30
    );
    let overflow: Vec<&Value> = lines.iter().filter(|l| l["overflow"] == true).collect();
    assert_eq!(
        overflow.len(),
        1,
        "the throwaway credential's call: {overflow:?}"
    );
    assert_eq!(overflow[0]["calls"], 1);
    assert!(
        !lines
            .iter()
            .any(|l| l["workspace"] == own_workspace("throwaway")),
        "the full list took no new row"
    );
}
