//! Monthly quotas (SPEC Q1) and the weighted warehouse-read budget (SPEC Q2)
//! through the tower layer, on the built-in policy and a fake clock.

use crate::edit;
use edit::Edit as _;

use crate::support;

use http::StatusCode;
use serde_json::Value;
use support::{Edge, Reply, T0, start, start_durable, tool_call};

const KEY: (&str, &str) = ("x-api-key", "sk-warehouse");

/// 2025-12-01T00:00:00Z: the month after T0's turns here.
const DECEMBER: u64 = T0 + 86_400;

struct TempDir(std::path::PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        TempDir(std::env::temp_dir().join(format!(
            "sluice-tower-{name}-{}-{}",
            std::process::id(),
            fastrand::u64(..)
        )))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn json(r: &Reply) -> Value {
    serde_json::from_str(&r.body).unwrap_or_else(|_| panic!("JSON body: {}", r.body))
}

async fn query(edge: &Edge, cost: &str) -> Reply {
    edge.post(
        "/search/query",
        &[KEY, ("x-test-cost", cost)],
        r#"{"sql":"select 1"}"#,
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn q2_the_seeds_worked_example_costs_3_3_3_then_2_then_the_refusal() {
    let edge = start(|y| y).await;
    for left in [7, 4, 1] {
        let r = query(&edge, "3").await;
        assert_eq!(r.status, StatusCode::OK);
        assert_eq!((r.limit(), r.remaining()), (10, left), "after a cost of 3");
        assert_eq!(
            r.header("x-sluice-cost"),
            "",
            "the cost header never reaches the client"
        );
    }
    // One unit left admits a call; it reports 2 and the budget is spent.
    let r = query(&edge, "2").await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!((r.limit(), r.remaining()), (10, 0));
    // The next is refused with the seed's envelope, word for word.
    let r = query(&edge, "1").await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    let wait = T0 + 60 - (T0 + 1);
    assert_eq!(r.header("retry-after"), wait.to_string());
    assert_eq!((r.limit(), r.remaining()), (10, 0));
    assert_eq!(r.header("x-ratelimit-reset"), (T0 + 60).to_string());
    let body = json(&r);
    assert_eq!(body["error"]["code"], "rate_limited");
    assert_eq!(
        body["error"]["message"],
        format!("Rate limit exceeded. Maximum 10 queries per minute. Try again in {wait} seconds.")
    );
    assert_eq!(body["error"]["details"]["retry_after_seconds"], wait);
    assert_eq!(body["error"]["details"]["limit"], 10);
    assert_eq!(body["error"]["details"]["window_seconds"], 60);
    // A new window: the budget is whole again.
    edge.clock.advance(std::time::Duration::from_secs(60));
    assert_eq!(query(&edge, "1").await.remaining(), 9);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn q2_a_cached_answer_changes_nothing_and_a_refused_sql_still_spends_one() {
    let edge = start(|y| y).await;
    let r = query(&edge, "0").await;
    assert_eq!(
        (r.status, r.remaining()),
        (StatusCode::OK, 10),
        "a cache hit spends none"
    );
    let r = edge
        .post(
            "/search/query",
            &[KEY, ("x-test-cost", "1"), ("x-test-status", "400")],
            r#"{"sql":"drop table t"}"#,
        )
        .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        (r.limit(), r.remaining()),
        (10, 9),
        "a refused SQL spends one"
    );
    // No cost header: the unit spent at admission stands.
    let r = edge.post("/search/query", &[KEY], "{}").await;
    assert_eq!(r.remaining(), 8);
    // A cost that is not a number counts as one, as absent.
    let r = query(&edge, "lots").await;
    assert_eq!(r.remaining(), 7);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn q2_a_read_that_is_no_warehouse_read_reports_the_read_class() {
    let edge = start(|y| y).await;
    let r = edge.get("/search/fields", &[KEY]).await;
    assert_eq!(
        (r.status, r.limit(), r.remaining()),
        (StatusCode::OK, 300, 299)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn q2_the_search_query_tool_spends_the_same_budget_as_the_route() {
    let edge = start(|y| y).await;
    assert_eq!(query(&edge, "4").await.remaining(), 6);
    let r = edge
        .post(
            "/mcp",
            &[
                KEY,
                ("content-type", "application/json"),
                ("x-test-cost", "6"),
            ],
            &tool_call(1, "search_query"),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!((r.limit(), r.remaining()), (10, 0));
    assert_eq!(
        query(&edge, "1").await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn q2_an_exhausted_budget_that_passes_is_forwarded_with_x_sluice_exhausted() {
    let edge = start(|y| {
        y.edit(
            "    weighted: true\n",
            "    weighted: true\n    on_exhausted: pass\n",
        )
    })
    .await;
    assert_eq!(query(&edge, "10").await.remaining(), 0);
    let r = query(&edge, "0").await;
    assert_eq!(r.status, StatusCode::OK, "the upstream answers, not sluice");
    assert_eq!(json(&r)["exhausted"], "warehouse_reads; retry-after=59");
    assert_eq!((r.limit(), r.remaining()), (10, 0));
    // The read class was still counted: 2 of 300 spent.
    let r = edge.get("/search/fields", &[KEY]).await;
    assert_eq!(r.remaining(), 297);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_is_told_the_workspace_and_user_and_never_a_clients_own() {
    // The key table names sk-acme's owner.
    let digest = hex::encode(<sha2::Sha256 as sha2::Digest>::digest(b"sk-acme"));
    let edge = start(|y| {
        y.edit(
            "  keys: []",
            &format!("  keys:\n    - {{ sha256: {digest}, workspace: acme, user: ada }}"),
        )
    })
    .await;
    let r = edge
        .post(
            "/evals",
            &[
                ("x-api-key", "sk-acme"),
                ("x-sluice-workspace", "someone-else"),
                ("x-sluice-user", "root"),
                ("x-sluice-exhausted", "nothing"),
            ],
            "{}",
        )
        .await;
    let body = json(&r);
    assert_eq!(body["workspace"], "acme");
    assert_eq!(body["user"], "ada");
    assert_eq!(body["exhausted"], "");
    assert_eq!(
        body["signals"], 2,
        "only sluice's own X-Sluice-* reach the upstream"
    );
    // An unknown credential is its own workspace, named by its hash.
    let r = edge
        .post("/evals", &[("x-api-key", "sk-other")], "{}")
        .await;
    let body = json(&r);
    assert!(
        body["workspace"]
            .as_str()
            .is_some_and(|w| w.starts_with("key:") && w.len() == 68),
        "{body}"
    );
    assert_eq!(body["workspace"], body["user"]);
    // No credential: the client IP.
    let r = edge.post("/evals", &[], "{}").await;
    assert_eq!(json(&r)["workspace"], "ip:127.0.0.1");
}

fn capped(monthly: u32) -> impl FnOnce(String) -> String {
    move |y| {
        y.edit(
            "messages: { monthly: 1000 }",
            &format!("messages: {{ monthly: {monthly} }}"),
        )
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn q1_an_exhausted_quota_is_refused_with_family_limit_usage_and_the_months_turn() {
    let dir = TempDir::new("exhausted");
    let edge = start_durable(capped(3), &dir.0).await;
    for left in [29, 28, 27] {
        let r = edge.post("/messages/optimize", &[KEY], "{}").await;
        assert_eq!(r.status, StatusCode::OK);
        assert_eq!(
            r.remaining(),
            left,
            "X-RateLimit-* describe the class, not the quota"
        );
    }
    let r = edge.post("/messages/optimize", &[KEY], "{}").await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(r.header("content-type"), "application/json");
    assert_eq!(r.header("retry-after"), (DECEMBER - (T0 + 1)).to_string());
    let body = json(&r);
    assert_eq!(body["error"]["code"], "quota_exceeded");
    let details = &body["error"]["details"];
    assert_eq!(details["family"], "messages");
    assert_eq!(details["limit"], 3);
    assert_eq!(details["usage"], 3);
    assert_eq!(details["resets_at"], "2025-12-01T00:00:00Z");
    // The refused call spent no class unit.
    assert_eq!(edge.post("/chats", &[KEY], "{}").await.remaining(), 26);
    // The same family through the JSON-RPC tool is refused too.
    let r = edge
        .post(
            "/mcp",
            &[KEY, ("content-type", "application/json")],
            &tool_call(1, "optimize_message"),
        )
        .await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    // The month turns; Retry-After had counted down to this instant.
    edge.clock.set(sluice_core::Timestamp::from_secs(DECEMBER));
    let r = edge.post("/messages/optimize", &[KEY], "{}").await;
    assert_eq!(r.status, StatusCode::OK, "a new month, a new quota");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn q1_a_call_refused_by_another_budget_spends_no_quota_and_a_batch_counts_each_item() {
    let dir = TempDir::new("all-or-nothing");
    let edge = start_durable(capped(3), &dir.0).await;
    // Spend the expensive class (30) elsewhere; optimize calls are then refused by it.
    for _ in 0..30 {
        assert_eq!(
            edge.post("/chats", &[KEY], "{}").await.status,
            StatusCode::OK
        );
    }
    for _ in 0..5 {
        let r = edge.post("/messages/optimize", &[KEY], "{}").await;
        assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(
            r.header("content-type"),
            "text/html; charset=utf-8",
            "the class refused"
        );
    }
    edge.clock.advance(std::time::Duration::from_secs(60));
    // A batch of two optimize_message calls counts two of the three.
    let batch = format!(
        "[{},{}]",
        tool_call(1, "optimize_message"),
        tool_call(2, "optimize_message")
    );
    let r = edge
        .post("/mcp", &[KEY, ("content-type", "application/json")], &batch)
        .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(
        edge.post("/messages/optimize", &[KEY], "{}").await.status,
        StatusCode::OK
    );
    let r = edge.post("/messages/optimize", &[KEY], "{}").await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(json(&r)["error"]["details"]["usage"], 3);
    // A batch larger than what is left is refused whole.
    edge.clock.set(sluice_core::Timestamp::from_secs(DECEMBER));
    let four = format!(
        "[{},{},{},{}]",
        tool_call(1, "optimize_message"),
        tool_call(2, "optimize_message"),
        tool_call(3, "optimize_message"),
        tool_call(4, "optimize_message")
    );
    let r = edge
        .post("/mcp", &[KEY, ("content-type", "application/json")], &four)
        .await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        r.header("retry-after"),
        "",
        "4 calls never fit a quota of 3"
    );
    // On /mcp, as JSON-RPC errors (one per call) that say it can never fit.
    let errors = json(&r);
    assert_eq!(errors.as_array().map(Vec::len), Some(4));
    assert_eq!(errors[0]["error"]["data"]["reason"], "cost_exceeds_limit");
    assert_eq!(errors[0]["error"]["data"]["limit"], 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn q1_a_full_disk_answers_quota_routes_503_and_serves_the_others() {
    let policy = sluice_policy::default_policy().expect("default");
    let clock = sluice_core::FakeClock::new(sluice_core::Timestamp::from_secs(T0 + 1));
    let (disk, full) = sluice_store::durable::FillableDisk::new();
    let durable = sluice_store::DurableStore::with_backend("full.redb", disk.clone(), disk.log())
        .expect("store");
    let book = sluice_store::QuotaBook::open(
        &durable,
        sluice_store::QuotaBookConfig::default(),
        sluice_core::Timestamp::from_secs(T0 + 1),
    )
    .expect("book");
    let store = sluice_store::LocalStore::new(
        sluice_store::MemoryStore::with_clock(sluice_store::MemoryConfig::default(), clock.clone()),
        Some(book),
    );
    let edge = support::start_with(policy, store, clock).await;
    assert_eq!(
        edge.post("/messages/optimize", &[KEY], "{}").await.status,
        StatusCode::OK
    );
    full.store(true, std::sync::atomic::Ordering::SeqCst);
    let r = edge.post("/messages/optimize", &[KEY], "{}").await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{}", r.body);
    assert!(!r.header("retry-after").is_empty());
    assert!(
        r.body.contains("durable"),
        "the answer says why: {}",
        r.body
    );
    assert!(
        !r.body.contains("full.redb"),
        "but names no server path: {}",
        r.body
    );
    // Routes without a quota keep working.
    assert_eq!(
        edge.post("/chats", &[KEY], "{}").await.status,
        StatusCode::OK
    );
    assert_eq!(
        edge.get("/search/fields", &[KEY]).await.status,
        StatusCode::OK
    );
}
