//! SPEC T7: turn budgets of agent runs, through the edge's intake on a fake
//! clock. A call naming its run is one turn of it; a run's tier sets its turns
//! (pinned at its first); a spent run pauses (409, `continue_or_finish`, never
//! admitted); its owner grants more or finishes it; runs are the caller's own;
//! a turn is spent only with the call's other budgets, all or nothing; a run is
//! forgotten when idle; two replicas on one Redis count one run exactly.

use std::net::IpAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderMap, HeaderValue, Method, Version};
use serde_json::{Value, json};
use sluice_core::{FakeClock, Timestamp};
use sluice_edge::Limiter;
use sluice_policy::parse_str;
use sluice_store::{BudgetStore, MemoryConfig, MemoryStore, RedisConfig, RedisStore};

use crate::redis_server;

/// 2093-07-01T00:00:00Z less an hour: ahead of the real clock Redis expires keys by.
const T0: u64 = 3_897_244_800 - 3_600;

const PEER: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(203, 0, 113, 7));

const CHAT: &str = "/v1/chat/completions";

/// Tiers of 3 (quick) and 4 (standard, the default) turns, a run forgotten
/// after 60 s idle, grants of at most 5 with at most 8 left; a token budget of
/// `tokens` per caller an hour; a JSON-RPC route for MCP.
fn policy(tokens: u32) -> sluice_policy::Policy {
    policy_with(tokens, "")
}

/// [`policy`] with `more` lines under `turns:`.
fn policy_with(tokens: u32, more: &str) -> sluice_policy::Policy {
    let yaml = format!(
        r#"
profile: default
window_seconds: 3600
profiles:
  default:
    classes: {{ llm: 1000000, plain: 1000000 }}
identity:
  credentials: [bearer]
tokens:
  team: {{ per: caller, limit: {tokens}, window_seconds: 3600, default_max_output: 10 }}
turns:
  tiers: {{ quick: 3, standard: 4 }}
  idle_seconds: 60
  max_grant: 5
  max_granted: 8
  runs_per_caller: 50
{more}
routes:
  - {{ method: POST, path: {CHAT}, class: llm, llm: openai, tokens: [team] }}
  - {{ method: POST, path: /mcp, jsonrpc: true }}
  - {{ class: plain }}
jsonrpc:
  default_class: llm
"#
    );
    parse_str(&yaml, Path::new("turns.yaml")).expect("the test policy")
}

/// What a call's answer says: its status and JSON body (`Null` when admitted).
type Answer = (u16, Value);

/// A request through `limiter` as `key` on `path` with `headers` and `body`:
/// admitted (200, and a run endpoint's answer) or refused.
async fn request<S: BudgetStore>(
    limiter: &Limiter<S>,
    (method, path): (Method, &str),
    key: &str,
    extra: &[(&str, &str)],
    body: &[u8],
) -> Answer {
    let mut headers = HeaderMap::new();
    headers.insert(
        "authorization",
        HeaderValue::from_str(&format!("Bearer {key}")).expect("ascii"),
    );
    for (name, value) in extra {
        headers.append(
            http::HeaderName::from_bytes(name.as_bytes()).expect("a name"),
            HeaderValue::from_bytes(value.as_bytes()).expect("a value"),
        );
    }
    let route = limiter.route_head(&method, Version::HTTP_2, [], Ok(path), Some(&headers));
    let mut intake = limiter.intake(route, PEER);
    intake.set_path(path);
    if let Some(refused) = intake.refused(None) {
        return answer(refused).await;
    }
    let whole = intake.body_bound().map(|_| body);
    let forward = match intake.planned(&headers, None, whole).admit(None).await {
        Ok(forward) => forward,
        Err(refused) => return answer(refused).await,
    };
    match forward.run_endpoint(path) {
        Some(endpoint) => answer(forward.answer_run(endpoint, &method, body).await).await,
        None => (200, Value::Null),
    }
}

async fn answer(r: http::Response<http_body_util::Full<bytes::Bytes>>) -> Answer {
    use http_body_util::BodyExt as _;
    let status = r.status().as_u16();
    let body = r
        .into_body()
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
}

fn chat() -> Vec<u8> {
    json!({ "model": "gpt-4o", "messages": [{ "role": "user", "content": "Go on." }] })
        .to_string()
        .into_bytes()
}

/// A turn of run `run` (at `depth`, if named) by `key`.
async fn turn<S: BudgetStore>(
    limiter: &Limiter<S>,
    key: &str,
    run: &str,
    depth: Option<&str>,
) -> Answer {
    let mut headers = vec![("x-sluice-run", run)];
    if let Some(d) = depth {
        headers.push(("x-sluice-depth", d));
    }
    request(limiter, (Method::POST, CHAT), key, &headers, &chat()).await
}

/// A run endpoint: `GET /runs/<run>` or `POST /runs/<run>/<what>` with `body`.
async fn endpoint<S: BudgetStore>(
    limiter: &Limiter<S>,
    key: &str,
    run: &str,
    what: Option<&str>,
    body: &str,
) -> Answer {
    let (method, path) = match what {
        None => (Method::GET, format!("/runs/{run}")),
        Some(w) => (Method::POST, format!("/runs/{run}/{w}")),
    };
    request(limiter, (method, &path), key, &[], body.as_bytes()).await
}

fn memory(clock: &FakeClock) -> Limiter<MemoryStore<FakeClock>> {
    // Room for every key of the runs-per-caller test's 9,000 callers (past the
    // bound, new keys share the store's overflow budgets).
    let store = MemoryStore::with_clock(MemoryConfig::with_max_keys(100_000), clock.clone());
    Limiter::new(policy(1_000_000), store)
}

/// An MCP request by ada with `headers` and `body`.
async fn mcp<S: BudgetStore>(limiter: &Limiter<S>, headers: &[(&str, &str)], body: &str) -> Answer {
    request(
        limiter,
        (Method::POST, "/mcp"),
        "ada",
        headers,
        body.as_bytes(),
    )
    .await
}

/// The turns a run takes before it pauses, and the pause.
async fn until_paused<S: BudgetStore>(
    limiter: &Limiter<S>,
    key: &str,
    run: &str,
    depth: Option<&str>,
) -> (u32, Answer) {
    for taken in 0..100 {
        let a = turn(limiter, key, run, depth).await;
        if a.0 != 200 {
            return (taken, a);
        }
    }
    panic!("run {run} never paused");
}

#[tokio::test]
async fn t7_a_run_pauses_after_its_tiers_turns_with_continue_or_finish_in_the_apis_dialect() {
    let clock = FakeClock::new(Timestamp::from_secs(T0));
    let limiter = memory(&clock);
    // quick: 3 turns; the default tier (standard): 4.
    let (taken, (status, body)) = until_paused(&limiter, "ada", "r-quick", Some("quick")).await;
    assert_eq!(taken, 3);
    assert_eq!(status, 409, "{body}");
    let error = &body["error"];
    assert_eq!(error["code"], "turn_budget_exhausted", "{body}");
    assert_eq!(
        error["type"], "turn_budget_exhausted",
        "the OpenAI SDK's error.type: {body}"
    );
    assert_eq!(error["param"], Value::Null);
    let d = &error["details"];
    assert_eq!(d["question"], "continue_or_finish");
    assert_eq!(d["run"], "r-quick");
    assert_eq!(
        (d["turns_used"].as_u64(), d["turns_granted"].as_u64()),
        (Some(3), Some(3))
    );
    assert_eq!(d["continue_url"], "/runs/r-quick/continue");
    assert_eq!(d["finish_url"], "/runs/r-quick/finish");
    // Pausing takes no turn: asked again, the same.
    let again = turn(&limiter, "ada", "r-quick", Some("quick")).await;
    assert_eq!(again.1["error"]["details"]["turns_used"], 3);
    // A pause is no rate limit: the refusals by reason do not count it.
    assert!(
        limiter.tally(0).refusals.is_empty(),
        "{:?}",
        limiter.tally(0).refusals
    );
    // The default tier; a depth named later does not move a run's tier.
    let (taken, _) = until_paused(&limiter, "ada", "r-default", None).await;
    assert_eq!(taken, 4);
    let (status, _) = turn(&limiter, "ada", "r-default", Some("deep")).await;
    assert_eq!(status, 409, "the tier is the run's first call's");
    // The admin listener's list: both runs paused, each with its first call's tier.
    let listed = limiter.recent_runs(0.2, 10);
    let tiers: Vec<(&str, &str)> = listed["runs"]
        .as_array()
        .expect("runs")
        .iter()
        .filter_map(|r| Some((r["run"].as_str()?, r["tier"].as_str()?)))
        .collect();
    assert!(tiers.contains(&("r-quick", "quick")), "{listed}");
    assert!(tiers.contains(&("r-default", "standard")), "{listed}");
    assert!(
        listed["runs"]
            .as_array()
            .is_some_and(|r| r.iter().all(|r| r["state"] == "paused")),
        "{listed}"
    );
    // A call naming no run is no turn.
    for _ in 0..10 {
        assert_eq!(
            request(&limiter, (Method::POST, CHAT), "ada", &[], &chat())
                .await
                .0,
            200
        );
    }
}

#[tokio::test]
async fn t7_the_owner_grants_more_turns_or_finishes_the_run_within_the_bounds() {
    let clock = FakeClock::new(Timestamp::from_secs(T0));
    let limiter = memory(&clock);
    let (taken, _) = until_paused(&limiter, "ada", "r1", Some("quick")).await;
    assert_eq!(taken, 3);
    let (status, state) = endpoint(&limiter, "ada", "r1", None, "").await;
    assert_eq!(status, 200, "{state}");
    assert_eq!(state["state"], "paused");
    assert_eq!(
        (state["turns_used"].as_u64(), state["turns_left"].as_u64()),
        (Some(3), Some(0))
    );
    // Grants: 0, a negative one, one past max_grant, not a number: 400, nothing granted.
    for bad in [
        r#"{"turns":0}"#,
        r#"{"turns":-1}"#,
        r#"{"turns":6}"#,
        r#"{"turns":"2"}"#,
        "{}",
        "not json",
    ] {
        let (status, body) = endpoint(&limiter, "ada", "r1", Some("continue"), bad).await;
        assert_eq!(status, 400, "{bad}: {body}");
        assert_eq!(
            body["error"]["details"]["reason"], "bad_grant",
            "{bad}: {body}"
        );
    }
    let (status, state) = endpoint(&limiter, "ada", "r1", Some("continue"), r#"{"turns":5}"#).await;
    assert_eq!(status, 200, "{state}");
    assert_eq!(
        (state["state"].as_str(), state["turns_granted"].as_u64()),
        (Some("running"), Some(8))
    );
    // At most 8 left after a grant: 5 more now would be 10.
    let (status, body) = endpoint(&limiter, "ada", "r1", Some("continue"), r#"{"turns":4}"#).await;
    assert_eq!(
        (status, body["error"]["details"]["reason"].as_str()),
        (400, Some("grant_too_large")),
        "{body}"
    );
    let (taken, (_, paused)) = until_paused(&limiter, "ada", "r1", None).await;
    assert_eq!(taken, 5);
    assert_eq!(paused["error"]["details"]["turns_granted"], 8);
    // Finished: every later call is refused for good, no grant takes.
    let (status, state) = endpoint(&limiter, "ada", "r1", Some("finish"), "").await;
    assert_eq!(
        (status, state["state"].as_str()),
        (200, Some("finished")),
        "{state}"
    );
    let (status, body) = turn(&limiter, "ada", "r1", None).await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (409, Some("run_finished")),
        "{body}"
    );
    assert_eq!(body["error"]["details"]["question"], Value::Null);
    let (status, body) = endpoint(&limiter, "ada", "r1", Some("continue"), r#"{"turns":1}"#).await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (409, Some("run_finished")),
        "{body}"
    );
    // A run that never took a turn: 404; a wrong method: 405.
    let (status, _) = endpoint(&limiter, "ada", "nope", Some("continue"), r#"{"turns":1}"#).await;
    assert_eq!(status, 404);
    let (status, _) = endpoint(&limiter, "ada", "nope", None, "").await;
    assert_eq!(status, 404);
    let (status, _) = request(
        &limiter,
        (Method::GET, "/runs/r1/continue"),
        "ada",
        &[],
        b"",
    )
    .await;
    assert_eq!(status, 405);
}

#[tokio::test]
async fn t7_runs_are_their_callers_own() {
    let clock = FakeClock::new(Timestamp::from_secs(T0));
    let limiter = memory(&clock);
    let (taken, _) = until_paused(&limiter, "ada", "shared-id", Some("quick")).await;
    assert_eq!(taken, 3);
    // Another caller's run of the same id is its own, and it cannot see, grant or
    // finish the first caller's.
    let (taken, _) = until_paused(&limiter, "bob", "shared-id", Some("quick")).await;
    assert_eq!(taken, 3);
    let (status, _) = endpoint(
        &limiter,
        "eve",
        "shared-id",
        Some("continue"),
        r#"{"turns":5}"#,
    )
    .await;
    assert_eq!(status, 404);
    let (status, _) = endpoint(&limiter, "eve", "shared-id", Some("finish"), "").await;
    assert_eq!(status, 404);
    assert_eq!(
        turn(&limiter, "ada", "shared-id", None).await.0,
        409,
        "ada's run is still paused"
    );
    endpoint(
        &limiter,
        "bob",
        "shared-id",
        Some("continue"),
        r#"{"turns":1}"#,
    )
    .await;
    assert_eq!(turn(&limiter, "bob", "shared-id", None).await.0, 200);
    assert_eq!(turn(&limiter, "ada", "shared-id", None).await.0, 409);
}

#[tokio::test]
async fn t7_a_turn_is_spent_only_with_the_calls_other_budgets() {
    let clock = FakeClock::new(Timestamp::from_secs(T0));
    // 45 tokens an hour: two calls' reservations.
    let store = MemoryStore::with_clock(MemoryConfig::with_max_keys(10_000), clock.clone());
    let limiter = Limiter::new(policy(45), store);
    let mut admitted = 0;
    loop {
        let (status, body) = turn(&limiter, "ada", "r", Some("quick")).await;
        if status != 200 {
            // The token budget refused first: a rate limit, not a pause.
            assert_eq!(status, 429, "{body}");
            assert_eq!(body["error"]["code"], "rate_limit_exceeded", "{body}");
            break;
        }
        admitted += 1;
    }
    assert!(
        admitted < 3,
        "the token budget binds before the turns: {admitted}"
    );
    let (_, state) = endpoint(&limiter, "ada", "r", None, "").await;
    assert_eq!(
        state["turns_used"].as_u64(),
        Some(admitted),
        "a refused call spent no turn: {state}"
    );
    // A paused run's call spends no tokens: a quick run paused by its turns, on
    // a budget with room, leaves the tokens as they were.
    let store = MemoryStore::with_clock(MemoryConfig::with_max_keys(10_000), clock.clone());
    let limiter = Limiter::new(policy(10_000), store);
    until_paused(&limiter, "ada", "p", Some("quick")).await;
    let before = tokens_left(&limiter).await;
    for _ in 0..5 {
        assert_eq!(turn(&limiter, "ada", "p", None).await.0, 409);
    }
    assert_eq!(
        tokens_left(&limiter).await,
        before,
        "pauses spent no tokens"
    );
}

/// Ada's token budget left, as a call with no run would find it before
/// spending (peeked: nothing spent).
async fn tokens_left<S: BudgetStore>(limiter: &Limiter<S>) -> u32 {
    let mut headers = HeaderMap::new();
    headers.insert("authorization", HeaderValue::from_static("Bearer ada"));
    let route = limiter.route_head(&Method::POST, Version::HTTP_2, [], Ok(CHAT), Some(&headers));
    let mut intake = limiter.intake(route, PEER);
    intake.set_path(CHAT);
    let body = chat();
    let planned = intake.planned(&headers, None, Some(&body));
    let plan = planned.plan().expect("a plan");
    let tokens = plan
        .kinds
        .iter()
        .position(|k| matches!(k, sluice_edge::BudgetKind::Bucket(_)))
        .expect("the token budget");
    let peeked = limiter.store().peek(&plan.budgets).await.expect("a peek");
    peeked.statuses()[tokens].remaining
}

#[tokio::test]
async fn t7_bad_run_ids_depths_and_routes_are_refused_and_nothing_is_counted() {
    let clock = FakeClock::new(Timestamp::from_secs(T0));
    let limiter = memory(&clock);
    let long = "r".repeat(129);
    for (run, depth, reason) in [
        ("", None, "bad_run_id"),
        (long.as_str(), None, "bad_run_id"),
        ("has space", None, "bad_run_id"),
        ("slash/in", None, "bad_run_id"),
        ("ok", Some("epic"), "unknown_depth"),
    ] {
        let (status, body) = turn(&limiter, "ada", run, depth).await;
        assert_eq!(status, 400, "{run:?} {depth:?}: {body}");
        assert_eq!(body["error"]["details"]["reason"], reason, "{body}");
    }
    // A non-ASCII id, and a run named twice.
    let (status, body) = request(
        &limiter,
        (Method::POST, CHAT),
        "ada",
        &[("x-sluice-run", "r\u{e9}")],
        &chat(),
    )
    .await;
    assert_eq!(
        (status, body["error"]["details"]["reason"].as_str()),
        (400, Some("bad_run_id"))
    );
    let two = [("x-sluice-run", "a"), ("x-sluice-run", "b")];
    let (status, body) = request(&limiter, (Method::POST, CHAT), "ada", &two, &chat()).await;
    assert_eq!(
        (status, body["error"]["details"]["reason"].as_str()),
        (400, Some("several_run_headers"))
    );
    // A run header on a route whose calls are no turns.
    let (status, body) = request(
        &limiter,
        (Method::POST, "/other"),
        "ada",
        &[("x-sluice-run", "ok")],
        b"",
    )
    .await;
    assert_eq!(
        (status, body["error"]["details"]["reason"].as_str()),
        (400, Some("run_not_supported"))
    );
    // A depth with no run is no turn, whatever it names.
    let depth_only = [("x-sluice-depth", "epic"), ("x-sluice-depth", "x")];
    assert_eq!(
        request(&limiter, (Method::POST, CHAT), "ada", &depth_only, &chat())
            .await
            .0,
        200
    );
    // None of them took a turn of `ok`.
    assert_eq!(endpoint(&limiter, "ada", "ok", None, "").await.0, 404);
}

#[tokio::test]
async fn t7_a_run_idle_past_its_bound_is_forgotten() {
    let clock = FakeClock::new(Timestamp::from_secs(T0));
    let limiter = memory(&clock);
    until_paused(&limiter, "ada", "r", Some("quick")).await;
    clock.advance(Duration::from_secs(59));
    assert_eq!(
        turn(&limiter, "ada", "r", None).await.0,
        409,
        "still remembered"
    );
    // Its last turn was 60 s ago and a pause changes nothing: forgotten at 61 s.
    clock.advance(Duration::from_secs(2));
    assert_eq!(endpoint(&limiter, "ada", "r", None, "").await.0, 404);
    let (taken, _) = until_paused(&limiter, "ada", "r", Some("quick")).await;
    assert_eq!(taken, 3, "a new run of the same id");
}

#[tokio::test]
async fn t7_an_mcp_tool_call_is_a_turn_and_its_pause_a_jsonrpc_error() {
    let clock = FakeClock::new(Timestamp::from_secs(T0));
    let limiter = memory(&clock);
    let call = |id: u32| {
        json!({ "jsonrpc": "2.0", "id": id, "method": "tools/call", "params": { "name": "search", "arguments": {} } }).to_string()
    };
    let list = json!({ "jsonrpc": "2.0", "id": 99, "method": "tools/list" }).to_string();
    let run = [("x-sluice-run", "mcp-run"), ("x-sluice-depth", "quick")];
    // Listing tools with the run header is no turn.
    for _ in 0..5 {
        assert_eq!(mcp(&limiter, &run, &list).await.0, 200);
    }
    for i in 0..3 {
        assert_eq!(
            request(
                &limiter,
                (Method::POST, "/mcp"),
                "ada",
                &run,
                call(i).as_bytes()
            )
            .await
            .0,
            200
        );
    }
    let (status, body) = request(
        &limiter,
        (Method::POST, "/mcp"),
        "ada",
        &run,
        call(7).as_bytes(),
    )
    .await;
    assert_eq!(status, 409, "{body}");
    assert_eq!(body["jsonrpc"], "2.0");
    assert_eq!(body["id"], 7);
    assert_eq!(body["error"]["code"], sluice_edge::JSONRPC_TURNS_EXHAUSTED);
    let data = &body["error"]["data"];
    assert_eq!(data["question"], "continue_or_finish", "{body}");
    assert_eq!(data["code"], "turn_budget_exhausted");
    assert_eq!(data["run"], "mcp-run");
}

/// T7: a run's state is one, forgotten only after a whole idle bound with
/// nothing done to it. A run paused at its last turn and granted more turns 59
/// s later is remembered whole 59 s after the grant (turns used and left), on
/// the memory store and on Redis alike: the turns it took were forgotten at 60
/// s, so it read as no run (404) and its next turn as a new run's first.
async fn a_grant_keeps_the_whole_run<S: BudgetStore>(limiter: &Limiter<S>, clock: &FakeClock) {
    let (taken, _) = until_paused(limiter, "ada", "kept", Some("quick")).await;
    assert_eq!(taken, 3);
    clock.advance(Duration::from_secs(59));
    let (status, state) =
        endpoint(limiter, "ada", "kept", Some("continue"), r#"{"turns":2}"#).await;
    assert_eq!(status, 200, "{state}");
    clock.advance(Duration::from_secs(59));
    let (status, state) = endpoint(limiter, "ada", "kept", None, "").await;
    assert_eq!(status, 200, "{state}");
    assert_eq!(
        (state["turns_used"].as_u64(), state["turns_left"].as_u64()),
        (Some(3), Some(2)),
        "{state}"
    );
    assert_eq!(turn(limiter, "ada", "kept", None).await.0, 200);
    assert_eq!(turn(limiter, "ada", "kept", None).await.0, 200);
    assert_eq!(
        turn(limiter, "ada", "kept", None).await.0,
        409,
        "3 + 2 taken"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t7_a_grant_keeps_the_whole_run_remembered() {
    let clock = FakeClock::new(Timestamp::from_secs(T0));
    a_grant_keeps_the_whole_run(&memory(&clock), &clock).await;
    let server = redis_server::RedisServer::start("t7-kept");
    let clock = FakeClock::new(Timestamp::from_secs(T0 + 60));
    let mut config = RedisConfig::new(server.url());
    config.timeout = Duration::from_secs(2);
    let store = RedisStore::connect_with_clock(config, clock.clone())
        .await
        .expect("connect");
    a_grant_keeps_the_whole_run(&Limiter::new(policy(1_000_000), store), &clock).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t7_two_replicas_on_one_redis_count_one_run_exactly() {
    let server = redis_server::RedisServer::start("t7");
    let clock = FakeClock::new(Timestamp::from_secs(T0 + 60));
    let replica = |clock: FakeClock| {
        let url = server.url();
        async move {
            let mut config = RedisConfig::new(url);
            config.timeout = Duration::from_secs(2);
            let store = RedisStore::connect_with_clock(config, clock)
                .await
                .expect("connect");
            Arc::new(Limiter::new(policy(1_000_000), store))
        }
    };
    let (a, b) = (replica(clock.clone()).await, replica(clock.clone()).await);
    // 20 turns of one standard run (4 turns) at once, half on each replica.
    let mut calls = Vec::new();
    for i in 0..20 {
        let limiter = if i % 2 == 0 {
            Arc::clone(&a)
        } else {
            Arc::clone(&b)
        };
        calls.push(tokio::spawn(async move {
            turn(&limiter, "ada", "race", None).await.0
        }));
    }
    let mut statuses = Vec::new();
    for c in calls {
        statuses.push(c.await.expect("a call"));
    }
    assert_eq!(
        statuses.iter().filter(|&&s| s == 200).count(),
        4,
        "{statuses:?}"
    );
    assert_eq!(
        statuses.iter().filter(|&&s| s == 409).count(),
        16,
        "{statuses:?}"
    );
    // A grant on one replica is seen by the other at once.
    let (status, _) = endpoint(&a, "ada", "race", Some("continue"), r#"{"turns":2}"#).await;
    assert_eq!(status, 200);
    assert_eq!(turn(&b, "ada", "race", None).await.0, 200);
    assert_eq!(turn(&b, "ada", "race", None).await.0, 200);
    assert_eq!(turn(&a, "ada", "race", None).await.0, 409);
    let (_, state) = endpoint(&b, "ada", "race", None, "").await;
    assert_eq!(
        (
            state["turns_used"].as_u64(),
            state["turns_granted"].as_u64()
        ),
        (Some(6), Some(6)),
        "{state}"
    );
}

#[tokio::test]
async fn t7_a_caller_starts_at_most_runs_per_caller_runs() {
    let clock = FakeClock::new(Timestamp::from_secs(T0));
    let limiter = memory(&clock);
    for i in 0..50 {
        assert_eq!(
            turn(&limiter, "ada", &format!("run-{i}"), None).await.0,
            200,
            "run {i}"
        );
    }
    // A 51st run is refused as a rate limit (it may start once the window turns);
    // the runs begun go on, and another caller starts its own.
    let (status, body) = turn(&limiter, "ada", "run-50", None).await;
    assert_eq!(status, 429, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("run_starts")),
        "{body}"
    );
    // Counted as the refusal it is, by the budget that refused it.
    let refusals = limiter.tally(0).refusals;
    assert_eq!(refusals, vec![("run_starts".to_owned(), 1)], "{refusals:?}");
    assert_eq!(turn(&limiter, "ada", "run-7", None).await.0, 200);
    assert_eq!(turn(&limiter, "bob", "run-50", None).await.0, 200);
    // The refused start was given back whole: run-50 took no turn.
    assert_eq!(endpoint(&limiter, "ada", "run-50", None, "").await.0, 404);
    // A run's later turns spend no start, however many other runs this replica
    // has seen since (a table of recent runs would have forgotten it).
    for i in 0..9_000 {
        assert_eq!(
            turn(&limiter, &format!("other-{i}"), "r", None).await.0,
            200
        );
    }
    assert_eq!(turn(&limiter, "ada", "run-7", None).await.0, 200);
    assert_eq!(turn(&limiter, "ada", "run-8", None).await.0, 200);
    assert_eq!(turn(&limiter, "ada", "run-51", None).await.0, 429);
}

#[tokio::test]
async fn t7_with_mcp_session_an_mcp_sessions_tool_calls_are_one_run() {
    let clock = FakeClock::new(Timestamp::from_secs(T0));
    let store = MemoryStore::with_clock(MemoryConfig::with_max_keys(10_000), clock.clone());
    let limiter = Limiter::new(
        policy_with(1_000_000, "  mcp_session: true\n  default_tier: quick"),
        store,
    );
    let call = json!({ "jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": { "name": "s", "arguments": {} } }).to_string();
    // Any visible ASCII, as MCP allows; the run is named by its digest.
    let session = [("mcp-session-id", "c0ffee/+=session")];
    for _ in 0..3 {
        assert_eq!(mcp(&limiter, &session, &call).await.0, 200);
    }
    let (status, body) = mcp(&limiter, &session, &call).await;
    assert_eq!(status, 409, "{body}");
    let run = body["error"]["data"]["run"]
        .as_str()
        .expect("the run")
        .to_owned();
    assert!(run.starts_with("mcp-"), "{run}");
    // Another session is another run; a call with no session is no turn.
    let other = [("mcp-session-id", "another")];
    assert_eq!(mcp(&limiter, &other, &call).await.0, 200);
    for _ in 0..5 {
        assert_eq!(mcp(&limiter, &[], &call).await.0, 200);
    }
    // The session's run answers at its endpoint, by the name the pause gave.
    let (status, state) = endpoint(&limiter, "ada", &run, None, "").await;
    assert_eq!(
        (status, state["state"].as_str()),
        (200, Some("paused")),
        "{state}"
    );
}

/// A memory store whose decisions of one budget alone (a run start: the call's own
/// decision holds its class, tokens and run cells) fail while `down` is set.
struct StartsDown {
    store: MemoryStore<FakeClock>,
    down: std::sync::atomic::AtomicBool,
}

impl StartsDown {
    fn unavailable(&self, budgets: &[sluice_core::Budget]) -> bool {
        budgets.len() == 1 && self.down.load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl BudgetStore for StartsDown {
    async fn decide(
        &self,
        budgets: &[sluice_core::Budget],
    ) -> Result<sluice_core::Decision, sluice_store::StoreError> {
        if self.unavailable(budgets) {
            return Err(sluice_store::StoreError::Unavailable("down".into()));
        }
        self.store.decide(budgets).await
    }
    async fn peek(
        &self,
        budgets: &[sluice_core::Budget],
    ) -> Result<sluice_core::Decision, sluice_store::StoreError> {
        self.store.peek(budgets).await
    }
    async fn adjust(
        &self,
        budget: &sluice_core::Budget,
        delta: i64,
        reserved_at: Timestamp,
    ) -> Result<sluice_core::BudgetStatus, sluice_store::StoreError> {
        self.store.adjust(budget, delta, reserved_at).await
    }
}

/// A run start the store cannot count follows the call's outage rule: where the
/// call's budgets fail open it is counted on the fallback store (a caller's starts
/// stay bounded), where they fail closed the call is given back whole and refused
/// 503 — never admitted uncounted.
#[tokio::test]
async fn t7_a_run_start_the_store_cannot_count_follows_the_outage_rule() {
    let clock = FakeClock::new(Timestamp::from_secs(T0));
    let starts_down = |policy| {
        let store = StartsDown {
            store: MemoryStore::with_clock(MemoryConfig::default(), clock.clone()),
            down: true.into(),
        };
        // The fallback store reads the real clock.
        Limiter::new(policy, store).with_fallback(MemoryStore::new(MemoryConfig::default()))
    };
    // Fail open (the default): 50 starts counted on the fallback store, the 51st
    // refused by run_starts. Its window (`idle_seconds`, 60 s) is on the real
    // clock: a caller whose starts straddled a window's end is tried again anew.
    let open = starts_down(policy(1_000_000));
    let window = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs() / 60)
    };
    let mut seen = false;
    for caller in ["ada", "bea", "cy"] {
        let began = window();
        for i in 0..50 {
            let (status, body) = turn(&open, caller, &format!("run-{i}"), None).await;
            assert_eq!(status, 200, "run {i}: {body}");
        }
        let (status, body) = turn(&open, caller, "run-50", None).await;
        if window() != began {
            continue;
        }
        assert_eq!(status, 429, "{body}");
        assert!(
            body["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("run_starts")),
            "{body}"
        );
        seen = true;
        break;
    }
    assert!(seen, "three callers' starts each straddled a minute's end");
    // Fail closed: 503, and the turn it took is given back (the run is new again
    // once the store counts starts).
    let closed = starts_down(policy_with(
        1_000_000,
        "store:\n  outage: { llm: fail_closed }",
    ));
    let (status, body) = turn(&closed, "ada", "r", None).await;
    assert_eq!(status, 503, "{body}");
    closed
        .store()
        .down
        .store(false, std::sync::atomic::Ordering::Relaxed);
    assert_eq!(turn(&closed, "ada", "r", None).await.0, 200);
    let (status, state) = endpoint(&closed, "ada", "r", None, "").await;
    assert_eq!(status, 200, "{state}");
    assert_eq!(
        state["turns_used"], 1,
        "the refused call's turn was given back: {state}"
    );
}
