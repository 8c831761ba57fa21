//! SPEC T2, T3 across replicas: token budgets reserve all or nothing and settle
//! at the usage exactly when two replicas share one Redis and their calls race,
//! and the memory store and Redis give the same answers (monthly budgets too).
//! Driven through the edge's intake on a fake clock, a real redis-server behind.

use std::net::IpAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderMap, HeaderValue, Method, Version};
use sluice_core::{FakeClock, Timestamp};
use sluice_edge::Limiter;
use sluice_policy::parse_str;
use sluice_store::{BudgetStore, MemoryConfig, MemoryStore, RedisConfig, RedisStore};
use sluice_tokens::Usage;

use crate::redis_server;

/// 2093-07-01T00:00:00Z less an hour: ahead of the real clock Redis expires keys
/// by, and whole hours since the epoch (an hour's window starts here).
const T0: u64 = 3_897_244_800 - 3_600;

const PEER: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(203, 0, 113, 7));

/// A token budget per caller of `limit` units an hour (or a month), cached input
/// at half weight, 100 output tokens when a call names none.
fn policy(limit: u32, period: &str) -> sluice_policy::Policy {
    let yaml = format!(
        r#"
profile: default
window_seconds: 3600
profiles:
  default:
    classes: {{ llm: 1000000 }}
identity:
  credentials: [bearer]
tokens:
  team: {{ per: caller, limit: {limit}, {period}, weights: {{ cached_input: 0.5 }}, default_max_output: 100 }}
routes:
  - {{ method: POST, path: /v1/chat/completions, class: llm, llm: openai, tokens: [team] }}
  - {{ class: llm }}
"#
    );
    parse_str(&yaml, Path::new("tokens.yaml")).expect("the test policy")
}

/// A chat call naming `max_tokens`.
fn chat(max_tokens: u32) -> Vec<u8> {
    serde_json::json!({
        "model": "gpt-4o",
        "messages": [{ "role": "user", "content": "Say hi." }],
        "max_tokens": max_tokens,
    })
    .to_string()
    .into_bytes()
}

/// What the upstream reports: 20 input tokens, 5 of them cached, 30 output.
const USAGE: Usage = Usage {
    prompt: 20,
    completion: 30,
    cached_input: 5,
    rate_exempt_input: 0,
};

/// Units [`USAGE`] weighs: 15 + 5 × 0.5 + 30 = 47.5, rounded up.
const SETTLED: u32 = 48;

/// One call as `key` through `limiter`: admitted (the units left after its
/// reservation, then settled with `usage`) or refused (its status).
async fn call<S: BudgetStore>(
    limiter: &Limiter<S>,
    key: &str,
    body: &[u8],
    usage: Option<Usage>,
) -> Result<u32, u16> {
    let mut headers = HeaderMap::new();
    headers.insert(
        "authorization",
        HeaderValue::from_str(&format!("Bearer {key}")).expect("ascii"),
    );
    let path = "/v1/chat/completions";
    let route = limiter.route_head(&Method::POST, Version::HTTP_2, [], Ok(path), Some(&headers));
    let mut intake = limiter.intake(route, PEER);
    intake.set_path(path);
    let forward = intake
        .planned(&headers, None, Some(body))
        .admit(None)
        .await
        .map_err(|answer| answer.status().as_u16())?;
    let left = forward.decision().binding().map_or(0, |b| b.remaining);
    let (plan, decision) = forward.settlement().expect("an LLM call");
    limiter.settle_usage(&plan, decision, usage, false).await;
    Ok(left)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t2_t3_two_replicas_on_one_redis_reserve_all_or_nothing_and_settle_exactly() {
    let server = redis_server::RedisServer::start("t3");
    let clock = FakeClock::new(Timestamp::from_secs(T0 + 60));
    let replica = |clock: FakeClock| {
        let url = server.url();
        async move {
            let mut config = RedisConfig::new(url);
            config.timeout = Duration::from_secs(2);
            let store = RedisStore::connect_with_clock(config, clock)
                .await
                .expect("connect");
            Arc::new(Limiter::new(policy(1000, "window_seconds: 3600"), store))
        }
    };
    let (a, b) = (replica(clock.clone()).await, replica(clock.clone()).await);
    let body = chat(50);
    // The reservation of one call, seen from a first call on another key.
    let reserved = 1000 - call(&a, "probe", &body, None).await.expect("admitted");
    assert!(reserved > 50, "input and output reserved: {reserved}");
    // 40 calls at once, half on each replica: never more admitted than fit the
    // reservation, all or nothing.
    let calls: Vec<_> = (0..40)
        .map(|i| {
            let limiter = Arc::clone(if i % 2 == 0 { &a } else { &b });
            let body = body.clone();
            tokio::spawn(async move { call(&*limiter, "racer", &body, Some(USAGE)).await })
        })
        .collect();
    let mut admitted = 0;
    for c in calls {
        match c.await.expect("no panic") {
            Ok(_) => admitted += 1,
            Err(status) => assert_eq!(status, 429),
        }
    }
    // Each admitted call settled at 48; a refused one spent nothing. The calls
    // raced their reservations, so at least as many as fit at once were admitted,
    // and never more than the settled usage allows.
    assert!(
        admitted >= 1000 / reserved,
        "{admitted} admitted, {reserved} each"
    );
    assert!(
        admitted <= (1000 - reserved) / SETTLED + 1,
        "{admitted} admitted"
    );
    // Both replicas see the same count: what is left is exactly the settled usage.
    for limiter in [&a, &b] {
        match call(limiter, "racer", &chat(0), Some(Usage::default())).await {
            Ok(left) => assert_eq!(left, 1000 - SETTLED * admitted - (reserved - 50)),
            Err(status) => assert!(
                1000 - SETTLED * admitted < reserved - 50,
                "refused ({status}) with room left"
            ),
        }
    }
}

#[tokio::test]
async fn t2_t3_memory_and_redis_answer_alike_windowed_and_monthly() {
    let server = redis_server::RedisServer::start("t3p");
    for (n, period) in ["window_seconds: 3600", "monthly: true"]
        .into_iter()
        .enumerate()
    {
        let clock = FakeClock::new(Timestamp::from_secs(T0 + 60));
        let mut config = RedisConfig::new(server.url());
        config.timeout = Duration::from_secs(2);
        let redis = RedisStore::connect_with_clock(config, clock.clone())
            .await
            .expect("connect");
        let on_redis = Limiter::new(policy(500, period), redis);
        let memory = MemoryStore::with_clock(MemoryConfig::default(), clock.clone());
        let on_memory = Limiter::new(policy(500, period), memory);
        let key = format!("key-{n}");
        // Calls of growing output budgets, each settled at the usage (one with
        // none: charged its reservation), until one is refused; then one larger
        // than the whole budget, never admitted.
        let (mut from_memory, mut from_redis) = (Vec::new(), Vec::new());
        for (i, max) in [10, 50, 100, 200, 10, 300, 50, 50, 50, 50, 5000]
            .into_iter()
            .enumerate()
        {
            let usage = (i != 2).then_some(USAGE);
            clock.advance(Duration::from_secs(7));
            from_memory.push(call(&on_memory, &key, &chat(max), usage).await);
            from_redis.push(call(&on_redis, &key, &chat(max), usage).await);
        }
        assert_eq!(from_memory, from_redis, "{period}");
        assert!(
            from_memory.iter().any(Result::is_err),
            "{period}: {from_memory:?}"
        );
        assert_eq!(
            from_memory.last(),
            Some(&Err(429)),
            "{period}: too large for the budget"
        );
    }
}

/// A token route with prices for five model families, so that reading a
/// workspace's usage takes more budgets than one store call holds.
const PRICED: &str = r#"
profile: default
window_seconds: 3600
profiles:
  default:
    classes: { llm: 1000000 }
identity:
  credentials: [bearer]
tokens:
  team: { per: caller, limit: 1000000, window_seconds: 3600 }
prices:
  - { model: "gpt-4o*", input: 2.5, output: 10, cached_input: 1.25 }
  - { model: "o1*", input: 15, output: 60, cached_input: 7.5 }
  - { model: "o3*", input: 2, output: 8, cached_input: 0.5 }
  - { model: "claude*", input: 3, output: 15, cached_input: 0.3 }
  - { model: "gemini*", input: 1.25, output: 10, cached_input: 0.31 }
routes:
  - { method: POST, path: /v1/chat/completions, class: llm, llm: openai, tokens: [team] }
  - { class: llm }
"#;

/// The workspace of an unknown credential: `key:<its SHA-256 in hex>`.
fn own_workspace(key: &str) -> String {
    use sha2::Digest as _;
    let hex: String = sha2::Sha256::digest(key.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("key:{hex}")
}

/// SPEC T6 on every store (memory, the embedded durable one, Redis): a
/// workspace's usage is counted by the month its calls were admitted in and
/// read back exactly for that month after the clock has crossed into the next
/// (and a year on), on each store as on the others. A month after the current
/// one, or more than twelve before it, is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t6_usage_is_kept_per_month_across_the_turn_on_every_store() {
    use sluice_edge::{QuotaQueryError, UsageMonth};
    let server = redis_server::RedisServer::start("t6");
    let dir = std::env::temp_dir().join(format!(
        "sluice-t6-{}-{:?}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos()
    ));
    let month = |m: &str| m.parse::<UsageMonth>().expect("a month");
    let policy = || parse_str(PRICED, Path::new("priced.yaml")).expect("the test policy");
    for store in ["memory", "durable", "redis"] {
        // An hour before 2093-07-01T00:00:00Z.
        let clock = FakeClock::new(Timestamp::from_secs(T0));
        let memory = || MemoryStore::with_clock(MemoryConfig::default(), clock.clone());
        let durable = || {
            let file = sluice_store::DurableStore::open(&dir.join(store)).expect("data dir");
            let book = sluice_store::QuotaBook::open(
                &file,
                sluice_store::QuotaBookConfig::default(),
                sluice_core::Clock::now(&clock),
            )
            .expect("quota book");
            sluice_store::LocalStore::new(memory(), Some(book))
        };
        let mut config = RedisConfig::new(server.url());
        config.timeout = Duration::from_secs(2);
        let redis = RedisStore::connect_with_clock(config, clock.clone())
            .await
            .expect("connect");
        let limiter = match store {
            "memory" => Usage3::Memory(Limiter::new(policy(), memory())),
            "durable" => Usage3::Local(Limiter::new(policy(), durable())),
            _ => Usage3::Redis(Limiter::new(policy(), redis)),
        };
        let key = format!("t6-{store}");
        let workspace = own_workspace(&key);
        // Two calls in June; a third admitted in its last second and settled in
        // July still counts in June.
        clock.advance(Duration::from_secs(60));
        for _ in 0..2 {
            limiter.call(&key, Some(USAGE), None).await;
        }
        clock.advance(Duration::from_secs(3600 - 60 - 1));
        limiter
            .call(&key, Some(USAGE), Some((&clock, Duration::from_secs(2))))
            .await;
        // Three in July.
        for _ in 0..3 {
            limiter.call(&key, Some(USAGE), None).await;
        }
        let usage = |m| limiter.usage(&workspace, m);
        let june = usage(Some(month("2093-06"))).await.expect("June");
        let july = usage(Some(month("2093-07"))).await.expect("July");
        for (read, month_name) in [(&june, "2093-06"), (&july, "2093-07")] {
            assert_eq!(read["month"], month_name, "{store}: {read}");
            assert_eq!(read["tokens"]["input"], 3 * 15, "{store}: {read}");
            assert_eq!(read["tokens"]["cached_input"], 3 * 5, "{store}: {read}");
            assert_eq!(read["tokens"]["output"], 3 * 30, "{store}: {read}");
            assert_eq!(read["by_model"]["gpt-4o*"]["output"], 3 * 30, "{store}");
            // 15 × 2.50 + 5 × 1.25 + 30 × 10 per million: 343.75 µ$, rounded up
            // to the hundred-thousandth of a dollar: 35 a call.
            let spend = read["spend_usd"].as_f64().expect("spend_usd");
            assert!((spend - 3.0 * 0.00035).abs() < 1e-12, "{store}: {read}");
        }
        assert_eq!(usage(None).await.expect("now")["month"], "2093-07");
        assert!(matches!(
            usage(Some(month("2093-08"))).await,
            Err(QuotaQueryError::FutureMonth(_))
        ));
        let year_before = usage(Some(month("2092-07"))).await.expect("kept");
        assert_eq!(year_before["tokens"]["output"], 0, "{store}");
        assert!(matches!(
            usage(Some(month("2092-06"))).await,
            Err(QuotaQueryError::MonthNotKept(_))
        ));
        // A year on, July 2093 is still there, exactly; June is no longer kept.
        clock.advance(Duration::from_secs(366 * 86_400));
        let later = usage(Some(month("2093-07")))
            .await
            .expect("July, a year on");
        assert_eq!(later["tokens"], july["tokens"], "{store}");
        assert_eq!(later["spend_usd"], july["spend_usd"], "{store}");
        assert!(matches!(
            usage(Some(month("2093-06"))).await,
            Err(QuotaQueryError::MonthNotKept(_))
        ));
        if store == "durable" {
            // Restarted on the same data dir, a year on: July's counts survive.
            drop(limiter);
            let reopened = Limiter::new(policy(), durable());
            let read = reopened
                .llm_usage(&workspace, Some(month("2093-07")))
                .await
                .expect("July, after a restart");
            assert_eq!(read["tokens"], july["tokens"]);
        }
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// One limiter on one of the three stores [`t6_usage_is_kept_per_month_across_the_turn_on_every_store`] runs on.
enum Usage3 {
    Memory(Limiter<MemoryStore<FakeClock>>),
    Local(Limiter<sluice_store::LocalStore<FakeClock>>),
    Redis(Limiter<RedisStore>),
}

impl Usage3 {
    /// One chat call as `key`, admitted, settled with `usage` (after `wait` on
    /// `clock`, when given).
    async fn call(&self, key: &str, usage: Option<Usage>, wait: Option<(&FakeClock, Duration)>) {
        match self {
            Usage3::Memory(l) => call_settled(l, key, usage, wait).await,
            Usage3::Local(l) => call_settled(l, key, usage, wait).await,
            Usage3::Redis(l) => call_settled(l, key, usage, wait).await,
        }
    }

    async fn usage(
        &self,
        workspace: &str,
        month: Option<sluice_edge::UsageMonth>,
    ) -> Result<serde_json::Value, sluice_edge::QuotaQueryError> {
        match self {
            Usage3::Memory(l) => l.llm_usage(workspace, month).await,
            Usage3::Local(l) => l.llm_usage(workspace, month).await,
            Usage3::Redis(l) => l.llm_usage(workspace, month).await,
        }
    }
}

/// [`call`], admitted for sure, with time passing between admission and settlement.
async fn call_settled<S: BudgetStore>(
    limiter: &Limiter<S>,
    key: &str,
    usage: Option<Usage>,
    wait: Option<(&FakeClock, Duration)>,
) {
    let mut headers = HeaderMap::new();
    headers.insert(
        "authorization",
        HeaderValue::from_str(&format!("Bearer {key}")).expect("ascii"),
    );
    let path = "/v1/chat/completions";
    let route = limiter.route_head(&Method::POST, Version::HTTP_2, [], Ok(path), Some(&headers));
    let mut intake = limiter.intake(route, PEER);
    intake.set_path(path);
    let body = chat(50);
    let Ok(forward) = intake
        .planned(&headers, None, Some(&body))
        .admit(None)
        .await
    else {
        panic!("refused");
    };
    let (plan, decision) = forward.settlement().expect("an LLM call");
    if let Some((clock, wait)) = wait {
        clock.advance(wait);
    }
    limiter.settle_usage(&plan, decision, usage, false).await;
}

/// SPEC T3: one store round trip to reserve and one to settle. On Redis, a call
/// on a route with an hourly and a monthly token budget is one script call to
/// decide, and its settlement — both budgets at the usage, the month's usage
/// counts for `/usage` and the usage export's row (SPEC O4) — one more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t3_a_call_is_one_script_call_to_reserve_and_one_to_settle() {
    let server = redis_server::RedisServer::start("t3-trips");
    let clock = FakeClock::new(Timestamp::from_secs(T0 + 60));
    let mut config = RedisConfig::new(server.url());
    config.timeout = Duration::from_secs(2);
    let store = RedisStore::connect_with_clock(config, clock.clone())
        .await
        .expect("connect");
    let yaml = r#"
profile: default
window_seconds: 3600
profiles:
  default:
    classes: { llm: 1000000 }
identity:
  credentials: [bearer]
tokens:
  hour: { per: caller, limit: 100000, window_seconds: 3600 }
  month: { per: caller, limit: 1000000, monthly: true }
routes:
  - { method: POST, path: /v1/chat/completions, class: llm, llm: openai, tokens: [hour, month] }
"#;
    let limiter = Limiter::new(
        parse_str(yaml, Path::new("t3.yaml")).expect("policy"),
        store,
    );
    let body = chat(50);
    let mut headers = HeaderMap::new();
    headers.insert("authorization", HeaderValue::from_static("Bearer trips"));
    let path = "/v1/chat/completions";
    // The first call of a workspace, day and model notes its row of the usage
    // export (SPEC O4) once per process: one store call more, once. Counted from
    // the next call on.
    call_settled(&limiter, "trips", Some(USAGE), None).await;
    let before = server.script_calls();
    let route = limiter.route_head(&Method::POST, Version::HTTP_2, [], Ok(path), Some(&headers));
    let mut intake = limiter.intake(route, PEER);
    intake.set_path(path);
    let forward = intake
        .planned(&headers, None, Some(&body))
        .admit(None)
        .await
        .unwrap_or_else(|r| panic!("refused: {}", r.status()));
    assert_eq!(server.script_calls() - before, 1, "one call to reserve");
    let (plan, decision) = forward.settlement().expect("an LLM call");
    let settled = limiter
        .settle_usage(&plan, decision, Some(USAGE), false)
        .await;
    assert_eq!(server.script_calls() - before, 2, "one call to settle");
    // Both budgets were charged the usage, not the reservation.
    let spent: Vec<u32> = settled
        .statuses()
        .iter()
        .map(|s| s.limit - s.remaining)
        .collect();
    assert!(
        spent.contains(&(2 * (USAGE.prompt + USAGE.completion))),
        "{spent:?}"
    );
}

/// SPEC T4 with D3: while Redis does not answer, a route whose class fails open
/// is decided on this replica alone, but a money or monthly token budget is
/// counted durably and exactly like a monthly quota, so a call holding one is
/// refused rather than decided on a replica's share of nothing it knows (its
/// settlement would be lost with the store). A windowed token budget fails open
/// with its class.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t4_money_and_monthly_token_budgets_fail_closed_while_redis_is_down() {
    let mut server = redis_server::RedisServer::start("t4-outage");
    let clock = FakeClock::new(Timestamp::from_secs(T0 + 60));
    let with_outage = |period: &str| {
        let yaml = format!(
            r#"
profile: default
window_seconds: 3600
profiles:
  default:
    classes: {{ llm: 1000000 }}
identity:
  credentials: [bearer]
prices:
  - {{ model: "gpt-4o", input: 2.5, output: 10 }}
tokens:
  team: {{ per: caller, limit: 100000, {period}, default_max_output: 100 }}
spend:
  bill: {{ per: caller, limit_usd: 100, monthly: true }}
routes:
  - {{ method: POST, path: /v1/chat/completions, class: llm, llm: openai, tokens: [team] }}
  - {{ method: POST, path: /v1/responses, class: llm, llm: openai, spend: [bill] }}
  - {{ class: llm }}
store:
  timeout_ms: 200
  outage: {{ llm: fail_open }}
"#
        );
        parse_str(&yaml, Path::new("outage.yaml")).expect("the test policy")
    };
    let limiter = |period: &'static str| {
        let (url, clock) = (server.url(), clock.clone());
        async move {
            let mut config = RedisConfig::new(url);
            config.timeout = Duration::from_millis(200);
            let store = RedisStore::connect_with_clock(config, clock)
                .await
                .expect("connect");
            Limiter::new(with_outage(period), store)
        }
    };
    let windowed = limiter("window_seconds: 3600").await;
    let monthly = limiter("monthly: true").await;
    let body = chat(50);
    assert!(call(&windowed, "a", &body, Some(USAGE)).await.is_ok());
    assert!(call(&monthly, "a", &body, Some(USAGE)).await.is_ok());
    server.kill();
    assert!(
        call(&windowed, "a", &body, Some(USAGE)).await.is_ok(),
        "a windowed token budget fails open with its class"
    );
    let refused = call(&monthly, "a", &body, Some(USAGE)).await;
    assert!(
        matches!(refused, Err(s) if s >= 500),
        "a monthly token budget is not decided without its store: {refused:?}"
    );
    // A money budget, on the Responses API route.
    let mut headers = HeaderMap::new();
    headers.insert("authorization", HeaderValue::from_static("Bearer a"));
    let path = "/v1/responses";
    let route = windowed.route_head(&Method::POST, Version::HTTP_2, [], Ok(path), Some(&headers));
    let mut intake = windowed.intake(route, PEER);
    intake.set_path(path);
    let body = br#"{"model":"gpt-4o","input":"Say hi.","max_output_tokens":50}"#;
    let answer = intake.planned(&headers, None, Some(body)).admit(None).await;
    assert!(
        matches!(&answer, Err(a) if a.status().as_u16() >= 500),
        "a money budget is not decided without its store: {:?}",
        answer.as_ref().map(|_| ()).map_err(|a| a.status())
    );
}
