//! SPEC O3 at the edge: an admitted call that leaves a watched budget at or past
//! an alert's threshold makes one event per workspace, budget, threshold and
//! period, handed to the sink before the call is answered; a refused call, an
//! unwatched budget and the next period's first calls make none (until they pass
//! a threshold again).

use std::net::IpAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};

use http::{HeaderMap, HeaderValue, Method, Version};
use sluice_core::{FakeClock, Timestamp};
use sluice_edge::{AlertEvent, AlertSink, Limiter};
use sluice_store::{MemoryConfig, MemoryStore};

const PEER: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(203, 0, 113, 7));

/// 2093-07-11T00:00:00Z.
const T0: u64 = 3_897_244_800 + 10 * 86_400;

/// A sink that records what it is offered.
#[derive(Default)]
struct Recorded(Mutex<Vec<AlertEvent>>);

impl AlertSink for Recorded {
    fn knows(&self, id: &str) -> bool {
        self.0
            .lock()
            .map(|e| e.iter().any(|e| e.id == id))
            .unwrap_or(false)
    }

    fn offer<'a>(
        &'a self,
        event: AlertEvent,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + 'a>> {
        if let Ok(mut events) = self.0.lock() {
            events.push(event);
        }
        Box::pin(std::future::ready(()))
    }
}

fn limiter(clock: &FakeClock, sink: Arc<Recorded>) -> Limiter<MemoryStore<FakeClock>> {
    let yaml = "
profile: p
window_seconds: 3600
profiles:
  p:
    classes: { calls: 1000 }
identity:
  credentials: [bearer]
quotas:
  messages: { monthly: 10 }
  searches: { monthly: 10 }
routes:
  - { method: POST, path: /messages, class: calls, quota: messages }
  - { method: POST, path: /search, class: calls, quota: searches }
alerts:
  - { url: 'http://127.0.0.1:9/hook', at: [0.8, 1.0], budgets: [messages], secret_file: s }
";
    let policy = sluice_policy::parse_str(yaml, Path::new("alerts.yaml")).expect("policy");
    Limiter::new(
        policy,
        MemoryStore::with_clock(MemoryConfig::default(), clock.clone()),
    )
    .with_alerts(sink)
}

async fn call(limiter: &Limiter<MemoryStore<FakeClock>>, path: &str, key: &str) -> bool {
    let mut headers = HeaderMap::new();
    headers.insert(
        "authorization",
        HeaderValue::from_str(&format!("Bearer {key}")).expect("ascii"),
    );
    let route = limiter.route_head(&Method::POST, Version::HTTP_2, [], Ok(path), Some(&headers));
    let mut intake = limiter.intake(route, PEER);
    intake.set_path(path);
    intake
        .planned(&headers, None, Some(b"{}"))
        .admit(None)
        .await
        .is_ok()
}

#[tokio::test]
async fn o3_the_80_and_100_percent_events_are_made_once_each_per_workspace_and_period() {
    let clock = FakeClock::new(Timestamp::from_secs(T0));
    let sink = Arc::new(Recorded::default());
    let limiter = limiter(&clock, Arc::clone(&sink));
    let events = || sink.0.lock().map(|e| e.clone()).unwrap_or_default();
    for n in 1..=7 {
        assert!(call(&limiter, "/messages", "alice").await);
        assert!(events().is_empty(), "{n} of 10: below 80 %");
    }
    // The 8th leaves 80 % spent; the 9th too, already told.
    assert!(call(&limiter, "/messages", "alice").await);
    assert!(call(&limiter, "/messages", "alice").await);
    let told = events();
    assert_eq!(told.len(), 1, "{told:?}");
    assert_eq!(
        (told[0].budget.as_str(), told[0].threshold_permille),
        ("messages", 800)
    );
    assert_eq!((told[0].used, told[0].limit), (8, 10));
    // The 10th: 100 %. The 11th is refused and tells nothing more.
    assert!(call(&limiter, "/messages", "alice").await);
    assert!(!call(&limiter, "/messages", "alice").await);
    let told = events();
    assert_eq!(told.len(), 2, "{told:?}");
    assert_eq!(told[1].threshold_permille, 1000);
    assert_eq!(told[0].workspace, told[1].workspace);
    assert_ne!(told[0].id, told[1].id);
    let body: serde_json::Value = serde_json::from_str(&told[1].body()).expect("JSON");
    assert_eq!(body["threshold"], 1.0);
    assert_eq!(body["budget"], "messages");
    // Another workspace has its own events; an unwatched budget has none.
    for _ in 0..10 {
        assert!(call(&limiter, "/search", "alice").await);
    }
    for _ in 0..8 {
        assert!(call(&limiter, "/messages", "bob").await);
    }
    let told = events();
    assert_eq!(told.len(), 3, "{told:?}");
    assert_ne!(told[2].workspace, told[0].workspace);
    // Next month: alice's counts start again, and so do her events.
    clock.advance(std::time::Duration::from_secs(25 * 86_400));
    for _ in 0..8 {
        assert!(call(&limiter, "/messages", "alice").await);
    }
    let told = events();
    assert_eq!(told.len(), 4, "{told:?}");
    assert!(told[3].period_ends_at > told[0].period_ends_at);
}

#[tokio::test]
async fn o3_a_reload_that_changes_the_alerts_is_refused_one_that_keeps_them_is_taken() {
    let clock = FakeClock::new(Timestamp::from_secs(T0));
    let limiter = limiter(&clock, Arc::new(Recorded::default()));
    let same = limiter.policy().clone();
    assert!(limiter.reloaded(same.clone()).is_ok());
    let mut changed = same;
    if let Some(a) = changed.alerts.first_mut() {
        a.at_permille = vec![500];
    }
    assert_eq!(
        limiter.reloaded(changed).err(),
        Some(sluice_edge::ReloadRefused::Alerts)
    );
}

/// A token budget's events come from the settlement that passes a threshold,
/// with what the call really spent (the upstream's usage), not its reservation.
#[tokio::test]
async fn o3_a_token_budget_passes_its_thresholds_at_the_settlement() {
    let clock = FakeClock::new(Timestamp::from_secs(T0));
    let sink = Arc::new(Recorded::default());
    let yaml = "
profile: p
window_seconds: 3600
profiles:
  p:
    classes: { llm: 1000 }
identity:
  credentials: [bearer]
tokens:
  team: { per: workspace, limit: 1000, monthly: true }
routes:
  - { method: POST, path: /v1/chat/completions, class: llm, llm: openai, tokens: [team] }
alerts:
  - { url: 'http://127.0.0.1:9/hook', at: [0.5, 1.0], budgets: [team], secret_file: s }
";
    let policy = sluice_policy::parse_str(yaml, Path::new("alerts.yaml")).expect("policy");
    let limiter = Limiter::new(
        policy,
        MemoryStore::with_clock(MemoryConfig::default(), clock.clone()),
    )
    .with_alerts(Arc::clone(&sink) as Arc<dyn AlertSink>);
    let usage = sluice_tokens::Usage {
        prompt: 20,
        completion: 230,
        cached_input: 0,
        rate_exempt_input: 0,
    };
    let mut headers = HeaderMap::new();
    headers.insert("authorization", HeaderValue::from_static("Bearer k"));
    let body = serde_json::json!({"model": "gpt-4o", "max_tokens": 1,
        "messages": [{"role": "user", "content": "Say hi."}]})
    .to_string();
    let path = "/v1/chat/completions";
    let mut told = Vec::new();
    for n in 1..=4 {
        let route =
            limiter.route_head(&Method::POST, Version::HTTP_2, [], Ok(path), Some(&headers));
        let mut intake = limiter.intake(route, PEER);
        intake.set_path(path);
        let Ok(forward) = intake
            .planned(&headers, None, Some(body.as_bytes()))
            .admit(None)
            .await
        else {
            panic!("call {n} refused");
        };
        let (plan, decision) = forward.settlement().expect("an LLM call");
        limiter
            .settle_usage(&plan, decision, Some(usage), false)
            .await;
        let events = sink.0.lock().map(|e| e.clone()).unwrap_or_default();
        told.push(events.len());
        if n == 2 {
            // 2 × 250 settled: exactly half, told at the settlement.
            assert_eq!(events[0].threshold_permille, 500);
            assert_eq!(events[0].used, 500, "{events:?}");
        }
    }
    assert_eq!(told, [0, 1, 1, 2]);
}
