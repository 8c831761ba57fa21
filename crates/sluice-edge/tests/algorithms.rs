//! P2, an algorithm per budget: `fixed` (the default), `sliding` (at most `limit`
//! in any `window_seconds`, counted exactly) and `gcra` (`limit` per window evenly
//! spaced, at most `burst` at once), through the edge's phase contract
//! (`sluice_edge::exchange`) on a fake clock: the decisions, `X-RateLimit-*`,
//! `Retry-After` and the IETF draft fields of each; and the same answers from the
//! memory store and from Redis at the same instants.

use std::net::IpAddr;
use std::path::Path;
use std::time::Duration;

use http::request::Parts;
use sluice_core::{FakeClock, Timestamp};
use sluice_edge::Limiter;
use sluice_policy::{Policy, parse_str};
use sluice_store::{BudgetStore, MemoryConfig, MemoryStore, RedisConfig, RedisStore};

use crate::redis_server;
use crate::support;

/// 2093-07-01T00:00:00Z less an hour: whole minutes since the epoch (a fixed window
/// starts at T0), and ahead of the real clock that Redis expires keys by.
const T0: u64 = 3_897_244_800 - 3_600;

/// The instant `ms` milliseconds after the epoch.
fn at_ms(ms: u64) -> Timestamp {
    Timestamp::from_nanos(ms * 1_000_000)
}

const PEER: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(203, 0, 113, 7));

/// A policy of 60-second windows whose expensive class allows 3, with `extra`
/// appended.
fn policy(extra: &str) -> Policy {
    policy_of(3, "", extra)
}

/// A policy of 60-second windows whose expensive class allows `expensive`, whose
/// bucket `exports` (4 a minute) has `bucket` in its settings, with `extra` appended.
fn policy_of(expensive: u32, bucket: &str, extra: &str) -> Policy {
    let yaml = format!(
        "profile: p
window_seconds: 60
ceilings:
  ip: {{ classes: [read, standard, expensive] }}
  ip_protocol: {{ classes: [protocol], only: true }}
profiles:
  p:
    classes: {{ protocol: 100, read: 100, standard: 100, expensive: {expensive} }}
    ip_ceilings: {{ ip: 1000, ip_protocol: 1000 }}
default_class: standard
headers: {{ ietf_draft: true }}
routes:
  - {{ method: POST, path: /chats, class: expensive }}
  - {{ method: GET, path: /exports, class: read, buckets: [exports] }}
buckets:
  exports: {{ limit: 4, window_seconds: 60, per: caller{bucket} }}
{extra}"
    );
    match parse_str(&yaml, Path::new("algorithms.yaml")) {
        Ok(policy) => policy,
        Err(e) => panic!("{e}"),
    }
}

/// The class budgets' algorithms: `algorithms: { expensive: {...} }`.
fn expensive(algorithm: &str) -> Policy {
    policy(&format!("algorithms: {{ expensive: {algorithm} }}"))
}

fn memory(policy: Policy, clock: &FakeClock) -> Limiter<MemoryStore<FakeClock>> {
    Limiter::new(
        policy,
        MemoryStore::with_clock(MemoryConfig::default(), clock.clone()),
    )
}

fn request(method: &str, path: &str, key: &str) -> Parts {
    support::request_as(key, method, path)
}

/// What the client is told about one request.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Answer {
    status: u16,
    limit: Option<u64>,
    remaining: Option<u64>,
    reset: Option<u64>,
    retry_after: Option<u64>,
    ietf: Option<String>,
}

fn number(headers: &http::HeaderMap, name: &str) -> Option<u64> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
}

/// One request through the limiter's phases: its answer (200 when forwarded).
async fn send<S: BudgetStore>(limiter: &Limiter<S>, method: &str, path: &str, key: &str) -> Answer {
    let parts = request(method, path, key);
    let route = limiter.route(&parts).map_err(|e| e.to_string());
    let route = route.expect("route");
    let intake = limiter.intake(Ok(route), PEER);
    let planned = intake.planned(&parts.headers, None, None);
    let (status, headers) = match planned.admit(None).await {
        Ok(forward) => {
            let mut headers = http::HeaderMap::new();
            forward.response_head(200, &mut headers).await;
            (200, headers)
        }
        Err(answer) => (answer.status().as_u16(), answer.headers().clone()),
    };
    Answer {
        status,
        limit: number(&headers, "x-ratelimit-limit"),
        remaining: number(&headers, "x-ratelimit-remaining"),
        reset: number(&headers, "x-ratelimit-reset"),
        retry_after: number(&headers, "retry-after"),
        ietf: headers
            .get("ratelimit")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned),
    }
}

async fn chats<S: BudgetStore>(limiter: &Limiter<S>, n: usize) -> Vec<Answer> {
    let mut answers = Vec::new();
    for _ in 0..n {
        answers.push(send(limiter, "POST", "/chats", "k").await);
    }
    answers
}

fn statuses(answers: &[Answer]) -> Vec<u16> {
    answers.iter().map(|a| a.status).collect()
}

#[tokio::test]
async fn p2_sliding_refuses_a_burst_straddling_a_fixed_window_boundary_that_fixed_admits() {
    for (algorithm, second_burst) in [
        ("{ algorithm: fixed }", [200, 200, 200]),
        ("{ algorithm: sliding }", [429, 429, 429]),
    ] {
        // Three calls in the last two seconds of one fixed window, three more in
        // the first seconds of the next: six within four seconds.
        let clock = FakeClock::new(Timestamp::from_secs(T0 + 58));
        let limiter = memory(expensive(algorithm), &clock);
        assert_eq!(statuses(&chats(&limiter, 3).await), [200; 3], "{algorithm}");
        clock.set(Timestamp::from_secs(T0 + 61));
        let after = chats(&limiter, 3).await;
        assert_eq!(statuses(&after), second_burst, "{algorithm}");
    }

    // Sliding: the calls of second 58 count until 60 s after the end of their
    // one-second slot, T0 + 119; from T0 + 61 that is 58 s, exactly.
    let clock = FakeClock::new(Timestamp::from_secs(T0 + 58));
    let limiter = memory(expensive("{ algorithm: sliding }"), &clock);
    chats(&limiter, 3).await;
    clock.set(Timestamp::from_secs(T0 + 61));
    let refused = send(&limiter, "POST", "/chats", "k").await;
    assert_eq!(refused.status, 429);
    assert_eq!(refused.retry_after, Some(58));
    assert_eq!((refused.limit, refused.remaining), (Some(3), Some(0)));
    // Whole again when the last counted call leaves.
    assert_eq!(refused.reset, Some(T0 + 119));
    clock.set(Timestamp::from_secs(T0 + 118));
    assert_eq!(send(&limiter, "POST", "/chats", "k").await.status, 429);
    clock.set(Timestamp::from_secs(T0 + 119));
    let again = send(&limiter, "POST", "/chats", "k").await;
    assert_eq!((again.status, again.remaining), (200, Some(2)));
}

#[tokio::test]
async fn p2_sliding_holds_at_most_the_limit_in_any_window_and_frees_each_slot_in_turn() {
    // One call at each of seconds 10, 20 and 30 of a window: the fourth is
    // refused until the first leaves (second 71), not until the window ends.
    let clock = FakeClock::new(Timestamp::from_secs(T0 + 10));
    let limiter = memory(expensive("{ algorithm: sliding }"), &clock);
    for at in [10, 20, 30] {
        clock.set(Timestamp::from_secs(T0 + at));
        assert_eq!(send(&limiter, "POST", "/chats", "k").await.status, 200);
    }
    clock.set(at_ms((T0 + 40) * 1_000 + 500));
    let refused = send(&limiter, "POST", "/chats", "k").await;
    assert_eq!(refused.status, 429);
    // 71 - 40.5 = 30.5 s, rounded up.
    assert_eq!(refused.retry_after, Some(31));
    // The IETF draft's t is this budget's own wait, never more than Retry-After;
    // the fixed IP ceiling's is its window's end.
    assert_eq!(
        refused.ietf.as_deref(),
        Some(r#""expensive";r=0;t=31, "ip";r=997;t=20"#)
    );
    clock.set(Timestamp::from_secs(T0 + 71));
    let next = send(&limiter, "POST", "/chats", "k").await;
    assert_eq!((next.status, next.remaining), (200, Some(0)));
    // Counted until second 132: the window is whole again only then.
    assert_eq!(next.reset, Some(T0 + 132));
}

#[tokio::test]
async fn p2_gcra_spaces_calls_a_burst_then_one_per_interval_with_the_exact_wait() {
    // 6 a minute is one every 10 s, at most 2 back to back.
    let policy = policy_of(
        6,
        "",
        "algorithms: { expensive: { algorithm: gcra, burst: 2 } }
",
    );
    let clock = FakeClock::new(Timestamp::from_secs(T0 + 1));
    let limiter = memory(policy, &clock);
    let burst = chats(&limiter, 3).await;
    assert_eq!(statuses(&burst), [200, 200, 429]);
    assert_eq!(
        burst.iter().map(|a| a.remaining).collect::<Vec<_>>(),
        [Some(1), Some(0), Some(0)]
    );
    // Limit per minute; whole again (both places back) 20 s after the burst.
    assert_eq!(burst[0].limit, Some(6));
    assert_eq!(burst[1].reset, Some(T0 + 21));
    assert_eq!(burst[2].retry_after, Some(10));
    assert_eq!(
        burst[2].ietf.as_deref(),
        Some(r#""expensive";r=0;t=10, "ip";r=998;t=59"#)
    );
    // Then one every 10 s: just before the interval, still refused, with the rest of
    // the wait; at it, admitted.
    for step in 1..=3u64 {
        clock.set(at_ms((T0 + 1 + 10 * step) * 1_000 - 500));
        let early = send(&limiter, "POST", "/chats", "k").await;
        assert_eq!(
            (early.status, early.retry_after),
            (429, Some(1)),
            "step {step}"
        );
        clock.set(Timestamp::from_secs(T0 + 1 + 10 * step));
        let on_time = chats(&limiter, 2).await;
        assert_eq!(statuses(&on_time), [200, 429], "step {step}");
        assert_eq!(on_time[1].retry_after, Some(10), "step {step}");
    }
    // Left alone for 20 s, the burst is back.
    clock.set(Timestamp::from_secs(T0 + 51));
    assert_eq!(statuses(&chats(&limiter, 3).await), [200, 200, 429]);
}

#[tokio::test]
async fn p2_a_bucket_and_an_ip_ceiling_take_their_algorithm_and_the_policy_header_its_window() {
    // The bucket: one call every 15 s, never two at once.
    let policy = policy_of(
        3,
        ", algorithm: gcra, burst: 1",
        "algorithms: { ip: { algorithm: sliding } }
",
    );
    let clock = FakeClock::new(Timestamp::from_secs(T0 + 1));
    let limiter = memory(policy, &clock);
    let first = send(&limiter, "GET", "/exports", "k").await;
    assert_eq!(first.status, 200);
    let second = send(&limiter, "GET", "/exports", "k").await;
    assert_eq!((second.status, second.retry_after), (429, Some(15)));
    assert_eq!(
        second.ietf.as_deref(),
        Some(r#""read";r=99;t=59, "ip";r=999;t=61, "exports";r=0;t=15"#)
    );
    clock.set(Timestamp::from_secs(T0 + 16));
    assert_eq!(send(&limiter, "GET", "/exports", "k").await.status, 200);
}

#[tokio::test]
async fn p2_a_reload_that_changes_how_a_budget_counts_starts_it_afresh() {
    // Fixed: three calls spend the window. GCRA after a reload would read the
    // fixed window's cell as a theoretical arrival time if the books were shared.
    let clock = FakeClock::new(Timestamp::from_secs(T0 + 1));
    let fixed = memory(expensive("{ algorithm: fixed }"), &clock);
    assert_eq!(statuses(&chats(&fixed, 4).await), [200, 200, 200, 429]);
    let gcra = fixed
        .reloaded(expensive("{ algorithm: gcra }"))
        .expect("reload");
    assert_eq!(statuses(&chats(&gcra, 4).await), [200, 200, 200, 429]);
    // A changed burst keeps the books: the budget stays spent.
    let burst = gcra
        .reloaded(expensive("{ algorithm: gcra, burst: 2 }"))
        .expect("reload");
    assert_eq!(send(&burst, "POST", "/chats", "k").await.status, 429);
    // Back to fixed: the fixed window's books again, still spent.
    let back = burst
        .reloaded(expensive("{ algorithm: fixed }"))
        .expect("reload");
    assert_eq!(send(&back, "POST", "/chats", "k").await.status, 429);
}

/// A sequence of (seconds to move the clock, method, path) for the parity test:
/// bursts, gaps inside a window, one straddling a fixed window's end, one past a
/// whole window.
fn sequence() -> Vec<(u64, &'static str, &'static str)> {
    let mut seq = Vec::new();
    for (gap, n) in [(0, 5), (7, 2), (11, 3), (29, 4), (2, 3), (61, 5), (1, 2)] {
        for i in 0..n {
            let path = if i % 2 == 0 { "/chats" } else { "/exports" };
            let method = if path == "/chats" { "POST" } else { "GET" };
            seq.push((if i == 0 { gap } else { 0 }, method, path));
        }
    }
    seq
}

#[tokio::test]
async fn p2_each_algorithm_answers_alike_on_memory_and_on_redis() {
    let server = redis_server::RedisServer::start("p2");
    for (n, algorithm) in [
        "algorithm: fixed",
        "algorithm: sliding",
        "algorithm: gcra, burst: 2",
    ]
    .into_iter()
    .enumerate()
    {
        // Starts 3 s before a fixed window ends, so the sequence crosses it.
        let clock = FakeClock::new(Timestamp::from_secs(T0 + 57));
        let extra = format!(
            "algorithms: {{ expensive: {{ {algorithm} }}, read: {{ {algorithm} }}, ip: {{ {algorithm} }} }}
"
        );
        let bucket = format!(", {algorithm}");
        let mut config = RedisConfig::new(server.url());
        config.timeout = Duration::from_secs(2);
        let redis = RedisStore::connect_with_clock(config, clock.clone())
            .await
            .expect("connect");
        let on_redis = Limiter::new(policy_of(3, &bucket, &extra), redis);
        let on_memory = memory(policy_of(3, &bucket, &extra), &clock);
        // A key per algorithm: the same Redis holds every run.
        let key = format!("key-{n}");
        let (mut from_memory, mut from_redis) = (Vec::new(), Vec::new());
        for (gap, method, path) in sequence() {
            clock.advance(Duration::from_secs(gap));
            from_memory.push(send(&on_memory, method, path, &key).await);
            from_redis.push(send(&on_redis, method, path, &key).await);
        }
        assert_eq!(from_memory, from_redis, "{algorithm}");
        let refused = from_memory.iter().filter(|a| a.status == 429).count();
        assert!(
            refused > 0 && refused < from_memory.len(),
            "{algorithm}: the sequence must see both answers: {from_memory:?}"
        );
    }
}
