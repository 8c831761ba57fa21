//! The Redis backend against a real `redis-server` (started per test on a
//! Unix socket in a temporary directory: no ports to collide).
#![cfg(feature = "redis")]

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sluice_core::{Budget, BudgetKey, Rate, Verdict};
use sluice_store::{BudgetStore, Guarded, RedisConfig, RedisStore, StoreError};

use crate::redis_server;

use redis_server::RedisServer as Server;

/// A store on `server`, waiting up to 500 ms per decision.
async fn store_on(server: &Server) -> RedisStore {
    let mut config = RedisConfig::new(server.url());
    config.timeout = Duration::from_millis(500);
    RedisStore::connect(config).await.expect("connect")
}

/// The longest window there is (it began at the epoch and ends in 2106): the
/// tests run on Redis's real clock and must never straddle a window boundary.
fn minute() -> NonZeroU32 {
    NonZeroU32::MAX
}

fn budget(scope: &str, subject: &[u8], limit: u32) -> Budget {
    Budget::per_window(BudgetKey::new(scope, subject), limit, minute())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d1_decides_exactly_and_reports_like_the_memory_store() {
    let server = Server::start("store");
    let store = store_on(&server).await;
    let b = budget("expensive", b"caller", 30);
    for i in 0..30 {
        let d = store.decide(&[b]).await.expect("decide");
        assert!(d.is_admitted(), "call {i}");
        assert_eq!(d.statuses()[0].remaining, 29 - i);
        assert_eq!(
            d.statuses()[0].reset,
            u64::from(u32::MAX),
            "windows are aligned to the epoch"
        );
    }
    let d = store.decide(&[b]).await.expect("decide");
    assert!(!d.is_admitted());
    assert_eq!(d.statuses()[0].remaining, 0);
    let wait = d.retry_after().expect("retry after");
    assert!(wait > Duration::ZERO);
    let never = store.decide(&[b.with_cost(31)]).await.expect("decide");
    assert_eq!(never.statuses()[0].verdict, Verdict::Never);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d1_a_refused_multi_budget_decision_changes_nothing() {
    let server = Server::start("store");
    let store = store_on(&server).await;
    let class = budget("expensive", b"caller", 30);
    let ceiling = budget("ip", b"203.0.113.9", 1);
    assert!(
        store
            .decide(&[ceiling])
            .await
            .expect("decide")
            .is_admitted()
    );
    let d = store.decide(&[class, ceiling]).await.expect("decide");
    assert!(!d.is_admitted());
    assert_eq!(d.binding().expect("binding").limit, 1);
    let p = store.peek(&[class]).await.expect("peek");
    assert_eq!(
        p.statuses()[0].remaining,
        30,
        "the class budget was not spent"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d2_concurrent_decisions_admit_exactly_the_limit() {
    let server = Server::start("store");
    let store = Arc::new(store_on(&server).await);
    let b = budget("expensive", b"hot", 30);
    let tasks: Vec<_> = (0..200)
        .map(|_| {
            let store = Arc::clone(&store);
            tokio::spawn(async move { store.decide(&[b]).await.expect("decide").is_admitted() })
        })
        .collect();
    let mut admitted = 0;
    for t in tasks {
        admitted += usize::from(t.await.expect("task"));
    }
    assert_eq!(admitted, 30);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d1_one_script_call_per_decision() {
    let server = Server::start("store");
    let store = store_on(&server).await;
    let before = server.script_calls();
    let req = [
        budget("expensive", b"k", 30),
        budget("ip", b"1.2.3.4", 300),
        budget("bucket", b"1.2.3.4", 5),
    ];
    for _ in 0..20 {
        store.decide(&req).await.expect("decide");
    }
    assert_eq!(
        server.script_calls() - before,
        20,
        "one script call per 3-budget decision"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_key_has_a_ttl_and_no_raw_credential() {
    let server = Server::start("store");
    let store = store_on(&server).await;
    let secret = b"sk-very-secret";
    let sliding = Budget {
        rate: Rate::SlidingWindow { seconds: minute() },
        ..budget("sliding", secret, 10)
    };
    let gcra = Budget {
        rate: Rate::Gcra {
            period: Duration::from_secs(60),
            burst: NonZeroU32::new(2).expect("nz"),
        },
        ..budget("gcra", secret, 60)
    };
    let month = Budget {
        rate: Rate::CalendarMonth,
        ..budget("quota", secret, 1000)
    };
    let rolling = Budget {
        rate: Rate::RollingWindow {
            millis: NonZeroU32::new(61_000).expect("nz"),
            slot_millis: NonZeroU32::new(250).expect("nz"),
        },
        ..budget("tpm", secret, 1000)
    };
    store
        .decide(&[
            budget("expensive", secret, 30),
            sliding,
            gcra,
            month,
            rolling,
        ])
        .await
        .expect("decide");
    let keys = server.cli(&["KEYS", "*"]);
    let keys: Vec<&str> = keys.lines().filter(|k| !k.is_empty()).collect();
    assert_eq!(keys.len(), 5, "{keys:?}");
    for key in keys {
        assert!(!key.contains("secret"), "{key}");
        assert!(key.starts_with("sluice:{"), "hash-tagged by subject: {key}");
        let ttl: i64 = server.cli(&["TTL", key]).trim().parse().expect("ttl");
        assert!(ttl > 0, "{key} has no TTL");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adjust_gcra_sliding_and_month_budgets_decide_on_redis() {
    let server = Server::start("store");
    let store = store_on(&server).await;
    let b = budget("warehouse_reads", b"user", 10);
    let d = store.decide(&[b.with_cost(3)]).await.expect("decide");
    assert_eq!(d.statuses()[0].remaining, 7);
    let s = store.adjust(&b, 4, d.decided_at()).await.expect("adjust");
    assert_eq!(s.remaining, 3);
    let s = store
        .adjust(&b, -100, d.decided_at())
        .await
        .expect("adjust");
    assert_eq!(s.remaining, 10, "clamped at zero spent");
    let gcra = Budget {
        rate: Rate::Gcra {
            period: Duration::from_secs(3600),
            burst: NonZeroU32::new(1).expect("nz"),
        },
        ..budget("rpm", b"provider", 60)
    };
    assert!(store.decide(&[gcra]).await.expect("decide").is_admitted());
    let d = store.decide(&[gcra]).await.expect("decide");
    let wait = d.retry_after().expect("not yet");
    assert!(
        wait > Duration::from_secs(59) && wait <= Duration::from_secs(60),
        "{wait:?}"
    );
    let sliding = Budget {
        rate: Rate::SlidingWindow { seconds: minute() },
        ..budget("sliding", b"k", 2)
    };
    assert!(
        store
            .decide(&[sliding])
            .await
            .expect("decide")
            .is_admitted()
    );
    assert!(
        store
            .decide(&[sliding])
            .await
            .expect("decide")
            .is_admitted()
    );
    assert!(
        !store
            .decide(&[sliding])
            .await
            .expect("decide")
            .is_admitted()
    );
    let month = Budget {
        rate: Rate::CalendarMonth,
        ..budget("quota", b"ws", 2)
    };
    let d = store.decide(&[month]).await.expect("decide");
    let m = sluice_core::month_of(d.decided_at());
    assert_eq!(
        d.statuses()[0].reset,
        m.end,
        "resets at the next month, per the server's clock"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d1_the_script_is_reloaded_after_a_flush() {
    let server = Server::start("store");
    let store = store_on(&server).await;
    let b = budget("standard", b"k", 5);
    store.decide(&[b]).await.expect("decide");
    server.cli(&["SCRIPT", "FLUSH"]);
    let d = store.decide(&[b]).await.expect("decide after NOSCRIPT");
    assert_eq!(d.statuses()[0].remaining, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d3_an_unreachable_redis_fails_fast() {
    let dir = std::env::temp_dir().join(format!("sluice-redis-none-{}", std::process::id()));
    let started = Instant::now();
    let mut config = RedisConfig::new(format!("redis+unix://{}/missing.sock", dir.display()));
    config.timeout = Duration::from_millis(20);
    let err = RedisStore::connect(config).await.expect_err("no server");
    assert!(matches!(err, StoreError::Unavailable(_)));
    assert!(started.elapsed() < Duration::from_secs(3));
    let malformed = RedisStore::connect(RedisConfig::new("not a url")).await;
    assert!(malformed.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d3_an_open_breaker_fails_at_once_and_recovery_is_automatic() {
    let mut server = Server::start("store");
    let mut config = RedisConfig::new(server.url());
    config.timeout = Duration::from_millis(20);
    let store = Guarded::new(RedisStore::connect(config).await.expect("connect"));
    let b = budget("standard", b"k", 1_000_000);
    assert!(store.decide(&[b]).await.expect("decide").is_admitted());
    server.kill();
    // The first failures may each wait up to the timeout; then the breaker opens.
    let mut slow = 0;
    for _ in 0..50 {
        let started = Instant::now();
        assert!(store.decide(&[b]).await.is_err(), "redis is down");
        if started.elapsed() > Duration::from_millis(5) {
            slow += 1;
        }
    }
    assert!(
        slow <= 4,
        "{slow} decisions waited: the open breaker must answer at once"
    );
    assert!(!matches!(store.state(), sluice_core::BreakerState::Closed));
    server.restart();
    let restarted = Instant::now();
    let deadline = restarted + Duration::from_secs(5);
    loop {
        if store.decide(&[b]).await.is_ok() {
            break;
        }
        assert!(Instant::now() < deadline, "shared mode did not resume");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let took = restarted.elapsed();
    assert!(
        took < Duration::from_secs(1),
        "shared mode resumed after {took:?}"
    );
    assert_eq!(store.state(), sluice_core::BreakerState::Closed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d1_coalesced_decisions_are_each_all_or_nothing() {
    let server = Server::start("store");
    let store = Arc::new(store_on(&server).await);
    let full = budget("ip", b"198.51.100.7", 1);
    assert!(store.decide(&[full]).await.expect("decide").is_admitted());
    let calls_before = server.script_calls();
    let ready = Arc::new(tokio::sync::Barrier::new(100));
    let tasks: Vec<_> = (0..100u32)
        .map(|i| {
            let (store, ready) = (Arc::clone(&store), Arc::clone(&ready));
            tokio::spawn(async move {
                let own = budget("read", &i.to_be_bytes(), 10);
                let request = if i % 2 == 0 {
                    vec![own, full]
                } else {
                    vec![own]
                };
                ready.wait().await;
                (
                    i,
                    store.decide(&request).await.expect("decide").is_admitted(),
                )
            })
        })
        .collect();
    for t in tasks {
        let (i, admitted) = t.await.expect("task");
        assert_eq!(admitted, i % 2 == 1, "request {i}");
    }
    let calls = server.script_calls() - calls_before;
    assert!(
        calls < 100,
        "{calls} script calls for 100 concurrent decisions: coalesced"
    );
    for i in 0..100u32 {
        let own = budget("read", &i.to_be_bytes(), 10);
        let left = store.peek(&[own]).await.expect("peek").statuses()[0].remaining;
        assert_eq!(
            left,
            if i % 2 == 0 { 10 } else { 9 },
            "request {i} spent all or nothing"
        );
    }
}

/// SPEC T3: concurrent settlements (an LLM call's charges after its answer)
/// share script calls as decisions do, and each is applied once, exactly: a
/// shared budget ends at the sum of every change, and each settlement's own
/// budget at its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t3_concurrent_settlements_are_coalesced_and_each_applied_once() {
    let server = Server::start("store");
    let store = Arc::new(store_on(&server).await);
    let shared = budget("tokens", b"team", 1_000_000);
    let own = |i: u32| budget("tokens-own", &i.to_be_bytes(), 1_000_000);
    let now = sluice_core::Timestamp::from_nanos(
        u64::try_from(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .expect("after 1970")
                .as_nanos(),
        )
        .expect("in range"),
    );
    let calls_before = server.script_calls();
    let ready = Arc::new(tokio::sync::Barrier::new(100));
    let tasks: Vec<_> = (0..100u32)
        .map(|i| {
            let (store, ready) = (Arc::clone(&store), Arc::clone(&ready));
            tokio::spawn(async move {
                let changes = [(shared, i64::from(i) + 1), (own(i), 7)];
                ready.wait().await;
                store
                    .adjust_all_from(&changes, now, 0)
                    .await
                    .expect("adjusted")
                    .len()
            })
        })
        .collect();
    for t in tasks {
        assert_eq!(t.await.expect("task"), 2, "one status a change");
    }
    let calls = server.script_calls() - calls_before;
    assert!(
        calls < 100,
        "{calls} script calls for 100 concurrent settlements: coalesced"
    );
    let left = |b: Budget| {
        let store = Arc::clone(&store);
        async move { store.peek(&[b]).await.expect("peek").statuses()[0].remaining }
    };
    assert_eq!(left(shared).await, 1_000_000 - (1..=100).sum::<u32>());
    for i in 0..100u32 {
        assert_eq!(left(own(i)).await, 1_000_000 - 7, "settlement {i} once");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_with_an_injected_clock_decides_at_its_time() {
    // Ahead of the real clock, which Redis still expires keys by.
    let start = sluice_core::Timestamp::from_nanos(3_900_000_005_123_456_000);
    let clock = sluice_core::FakeClock::new(start);
    let server = Server::start("store");
    let mut config = RedisConfig::new(server.url());
    config.timeout = Duration::from_millis(500);
    let store = RedisStore::connect_with_clock(config, clock.clone())
        .await
        .expect("connect");
    let b = Budget::per_window(
        BudgetKey::new("standard", b"k"),
        2,
        NonZeroU32::MIN.saturating_add(9),
    );
    let d = store.decide(&[b]).await.expect("decide");
    assert_eq!(d.decided_at(), start);
    assert_eq!(d.statuses()[0].reset, 3_900_000_010);
    store.decide(&[b]).await.expect("decide");
    let d = store.decide(&[b]).await.expect("decide");
    assert_eq!(
        d.retry_after(),
        Some(Duration::from_nanos(4_876_544_000)),
        "until the window's end, to the microsecond"
    );
    clock.advance(Duration::from_secs(5));
    let d = store.decide(&[b]).await.expect("decide");
    assert_eq!(d.decided_at(), start.saturating_add(Duration::from_secs(5)));
    assert_eq!(
        d.statuses()[0].remaining,
        1,
        "a new window, by the injected clock"
    );
    // An adjustment's reservation instant travels to the microsecond too.
    let s = store.adjust(&b, -1, d.decided_at()).await.expect("adjust");
    assert_eq!(s.remaining, 2);
}

/// Redis's count of connected clients.
fn clients(server: &Server) -> u64 {
    server
        .cli(&["INFO", "clients"])
        .lines()
        .find_map(|l| l.strip_prefix("connected_clients:"))
        .and_then(|n| n.trim().parse().ok())
        .expect("connected_clients")
}

/// Polls `done` until it holds or 5 s have passed.
fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !done() {
        assert!(Instant::now() < deadline, "{what}");
        std::thread::yield_now();
    }
}

#[test]
fn d1_each_thread_decides_on_a_connection_of_its_own_and_lets_it_go_with_the_store() {
    let server = Server::start("store");
    let runtime = || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
    };
    // The runtime the store is made on runs its shared connection (in the
    // gateway, the process's multi-threaded runtime).
    let main = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    let store = main.block_on(store_on(&server));
    let alone = clients(&server);
    let b = budget("read", b"caller", 1_000);
    // Two threads, each on a runtime of its own (as the gateway's workers):
    // each decides on its own connection, and between them they spend
    // exactly. Their runtimes run until the end, as a worker's do.
    let (done_tx, done) = std::sync::mpsc::channel();
    let mut stops = Vec::new();
    std::thread::scope(|s| {
        for _ in 0..2 {
            let (stop_tx, stop) = tokio::sync::oneshot::channel::<()>();
            stops.push(stop_tx);
            let (store, done_tx) = (store.clone(), done_tx.clone());
            s.spawn(move || {
                runtime().block_on(async move {
                    for _ in 0..10 {
                        assert!(store.decide(&[b]).await.expect("decide").is_admitted());
                    }
                    drop(store);
                    done_tx.send(()).expect("done");
                    let _ = stop.await;
                });
            });
        }
        for _ in 0..2 {
            done.recv().expect("a thread decided");
        }
        eventually("one connection more per deciding thread", || {
            clients(&server) == alone + 2
        });
        let left = main.block_on(store.peek(&[b])).expect("peek").statuses()[0].remaining;
        assert_eq!(left, 980, "20 decisions on two threads' connections");
        // On a runtime that is gone by the next call, and then another: each
        // starts this thread's coalescer anew and still decides.
        for expected in [979, 978] {
            let d = runtime().block_on(store.decide(&[b])).expect("decide");
            assert_eq!(d.statuses()[0].remaining, expected);
        }
        // The last handle gone, the threads' coalescers end (their runtimes
        // still running) and every connection closes, the shared one too.
        drop(store);
        eventually("the coalescers' connections close with the store", || {
            clients(&server) < alone
        });
        for stop in stops.drain(..) {
            let _ = stop.send(());
        }
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d1_identical_concurrent_requests_are_each_decided_in_turn() {
    let server = Server::start("store");
    let store = Arc::new(store_on(&server).await);
    // One caller's class (30) and its address's ceiling (40): 60 identical
    // requests at once, coalesced into a few calls of repeated entries.
    let class = budget("read", b"hot caller", 30);
    let ceiling = budget("ip", b"192.0.2.1", 40);
    let ready = Arc::new(tokio::sync::Barrier::new(60));
    let tasks: Vec<_> = (0..60)
        .map(|_| {
            let (store, ready) = (Arc::clone(&store), Arc::clone(&ready));
            tokio::spawn(async move {
                ready.wait().await;
                store.decide(&[class, ceiling]).await.expect("decide")
            })
        })
        .collect();
    let mut remaining = Vec::new();
    let mut refused = 0;
    for t in tasks {
        let d = t.await.expect("task");
        if d.is_admitted() {
            remaining.push(d.statuses()[0].remaining);
            assert_eq!(
                d.statuses()[1].remaining,
                d.statuses()[0].remaining + 10,
                "both budgets spent together"
            );
        } else {
            refused += 1;
            assert_eq!(d.binding().expect("binding").limit, 30);
        }
    }
    remaining.sort_unstable();
    assert_eq!(
        remaining,
        (0..30).collect::<Vec<_>>(),
        "each admitted one saw the one before"
    );
    assert_eq!(refused, 30);
    let left = store.peek(&[class, ceiling]).await.expect("peek");
    assert_eq!(left.statuses()[0].remaining, 0);
    assert_eq!(left.statuses()[1].remaining, 10, "refusals spent nothing");
}

/// Waits (bounded) until `server` answers `PING`.
fn wait_until_it_answers(server: &Server) {
    eventually("redis-server answers PING", || {
        server.cli(&["PING"]).contains("PONG")
    });
}

/// Spawns `n` concurrent decisions of `request` on `store`: (admitted,
/// refused, failed — each failure's message).
async fn burst(
    store: &Arc<Guarded<RedisStore>>,
    request: Budget,
    n: usize,
) -> (usize, usize, Vec<String>) {
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let store = Arc::clone(store);
            tokio::spawn(async move { store.decide(&[request]).await })
        })
        .collect();
    let (mut admitted, mut refused, mut failed) = (0, 0, Vec::new());
    for task in tasks {
        match task.await.expect("task") {
            Ok(d) if d.is_admitted() => admitted += 1,
            Ok(_) => refused += 1,
            Err(e) => failed.push(e.to_string()),
        }
    }
    (admitted, refused, failed)
}

/// SPEC E8 and D3 (issue 39, item 6): Redis restarted (killed and started
/// again on the same socket, so every connection it had is closed) and left
/// idle; then a burst of 1,000 concurrent decisions on one counter of 5, on
/// the store as the gateway and the rate-limit service hold it (behind its
/// circuit breaker), from two worker threads whose coalescers each decide on
/// a connection of their own. Every decision is made on Redis: exactly 5
/// admitted, none failing (a failure is what the outage rule answers: with
/// `fail_open`, an admission), and the breaker stays closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e8_d3_a_burst_right_after_redis_restarts_is_decided_on_redis() {
    const BURST: usize = 1_000;
    let mut server = Server::start("store");
    let store = Arc::new(Guarded::new(store_on(&server).await));
    let alone = clients(&server);
    // Every connection the burst will use is open before the restart: the
    // store's shared one, and each worker thread's coalescer's own.
    let warm = budget("warm", b"caller", u32::MAX);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, _, failed) = burst(&store, warm, 64).await;
        assert!(failed.is_empty(), "before the restart: {failed:?}");
        if clients(&server) >= alone + 2 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the worker threads' coalescers did not open their connections"
        );
    }
    server.restart();
    wait_until_it_answers(&server);
    // Idle, as in the field: nothing asks the closed connections anything
    // until the burst.
    tokio::time::sleep(Duration::from_millis(500)).await;
    // 5 in the longest window there is (5 a minute, but never straddling a
    // window's end).
    let counter = budget("standard", b"after-restart", 5);
    let (admitted, refused, failed) = burst(&store, counter, BURST).await;
    assert!(
        failed.is_empty(),
        "{} of {BURST} decisions failed (the outage rule would answer them), the first: {:?}",
        failed.len(),
        failed.first()
    );
    assert_eq!((admitted, refused), (5, BURST - 5));
    assert_eq!(store.state(), sluice_core::BreakerState::Closed);
}

/// SPEC T7 on Redis: a run's key outlives the run (it is never dropped while the
/// run is remembered, which would give its turns back) and moves its expiry a
/// sixteenth of the idle time at a time, not at every turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t7_a_runs_key_outlives_the_run_and_is_re_expired_rarely() {
    let server = Server::start("store");
    let store = store_on(&server).await;
    let run = Budget {
        rate: Rate::Turns {
            idle_secs: NonZeroU32::new(1_600).expect("nz"),
        },
        ..budget("run:turns", b"caller-run", 5)
    };
    let before = server.commands_named("expireat");
    for _ in 0..4 {
        let d = store.decide(&[run]).await.expect("decide");
        assert!(d.is_admitted());
    }
    assert_eq!(
        server.commands_named("expireat") - before,
        1,
        "one EXPIREAT for four turns within the same 100 s"
    );
    let keys = server.cli(&["KEYS", "*"]);
    let key = keys.lines().find(|k| !k.is_empty()).expect("the run's key");
    let ttl: i64 = server.cli(&["TTL", key]).trim().parse().expect("ttl");
    // Remembered 1,600 s after its last turn; the key, up to 100 s longer.
    assert!((1_600..=1_702).contains(&ttl), "TTL {ttl}");
    assert_eq!(
        store.decide(&[run]).await.expect("decide").statuses()[0].remaining,
        0
    );
    assert!(!store.decide(&[run]).await.expect("decide").is_admitted());
}

/// SPEC D4: leftovers of leases given back while Redis is down are returned
/// once it answers again. While calls fail, leftovers are held, not sent (a
/// call that fails may have run, and its leftovers could then be neither known
/// returned nor safe to send again); a call the circuit breaker turns away
/// keeps its own. The call after the first that Redis answers gives them back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d4_leftovers_given_back_during_an_outage_are_returned_on_recovery() {
    let mut server = Server::start("store");
    let store = Guarded::new(store_on(&server).await);
    let leased = budget("read", b"leased", 100);
    let other = budget("read", b"other", 100);
    let (d, grants) = store
        .take_leases(&[leased], &[20], &[])
        .await
        .expect("take");
    assert_eq!(grants, vec![20], "a lease of 20");
    let back = |units| {
        (
            leased,
            sluice_core::GiveBack {
                units,
                reserved_at: d.decided_at(),
            },
        )
    };
    // The counts outlive the restart: the restarted server loads this file.
    assert!(server.cli(&["SAVE"]).contains("OK"));
    server.kill();
    // The first call after the kill may have been written to the dead
    // connection before it broke: a leftover there could have been given
    // back, so it is not kept (none is sent in it). The next find the
    // connection refused.
    assert!(
        store.take_leases(&[other], &[0], &[]).await.is_err(),
        "redis is down"
    );
    assert!(
        store.take_leases(&[other], &[0], &[back(5)]).await.is_err(),
        "redis is down"
    );
    // More calls while down open the breaker, which turns the next away.
    for _ in 0..20 {
        let _ = store.take_leases(&[other], &[0], &[]).await;
    }
    assert!(
        store.take_leases(&[other], &[0], &[back(4)]).await.is_err(),
        "still down"
    );
    server.restart();
    let deadline = Instant::now() + Duration::from_secs(5);
    while store.take_leases(&[other], &[0], &[]).await.is_err() {
        assert!(Instant::now() < deadline, "shared mode did not resume");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Redis answered that call; the next carries what was held.
    store
        .take_leases(&[other], &[0], &[])
        .await
        .expect("redis is back");
    let seen = store.peek(&[leased]).await.expect("peek");
    assert_eq!(
        seen.statuses()[0].remaining,
        80 + 5 + 4,
        "both leftovers given back after the outage"
    );
}

/// SPEC T3 on Redis as in memory: a charge takes a budget past its limit, and a later refund takes back from what was counted,
/// not from a count clamped at the limit (which would hand out the overrun
/// again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t3_a_settlement_past_the_limit_stays_counted_through_later_refunds() {
    let server = Server::start("t3-overrun");
    let store = store_on(&server).await;
    let memory = sluice_store::MemoryStore::new(sluice_store::MemoryConfig::default());
    // The longest window: no run straddles one (a calendar month's budget takes
    // the same path of the script and of the core).
    for rate in [Rate::FixedWindow { seconds: minute() }] {
        let b = Budget {
            rate,
            ..budget("tokens", b"overrun", 100)
        };
        let d = store.decide(&[b.with_cost(60)]).await.expect("reserve");
        let m = memory.decide(&[b.with_cost(60)]).await.expect("reserve");
        let steps: [(i64, u32); 3] = [(70, 0), (-20, 0), (-20, 10)];
        for (delta, remaining) in steps {
            let s = store
                .adjust(&b, delta, d.decided_at())
                .await
                .expect("adjust");
            let t = memory
                .adjust(&b, delta, m.decided_at())
                .await
                .expect("adjust");
            assert_eq!(
                (s.remaining, t.remaining),
                (remaining, remaining),
                "{rate:?} after {delta}: 130, 110 then 90 counted of 100"
            );
        }
        assert!(
            store
                .decide(&[b.with_cost(11)])
                .await
                .expect("d")
                .retry_after()
                .is_some(),
            "{rate:?}: 10 left"
        );
        assert!(
            store
                .decide(&[b.with_cost(10)])
                .await
                .expect("d")
                .is_admitted()
        );
    }
}

/// SPEC C7 (with C5): a hold is one key on the server, set on the server's
/// clock to the later of its end and the new one, expiring at that end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c7_a_hold_on_redis_only_grows_and_expires_at_its_end() {
    let server = Server::start("store");
    let store = store_on(&server).await;
    let key = BudgetKey::new("pace-hold", b"sk-very-secret");
    let other = BudgetKey::new("pace-hold", b"another key");
    let s = Duration::from_secs;
    store.hold(&key, s(30)).await.expect("hold");
    // A shorter hold never shortens a longer one.
    store.hold(&key, s(5)).await.expect("hold");
    let left = store.held(&[key, other]).await.expect("held");
    assert!(left[0] > s(29) && left[0] <= s(30), "{left:?}");
    assert_eq!(left[1], Duration::ZERO, "a key never held");
    // A longer one lengthens it.
    store.hold(&key, s(60)).await.expect("hold");
    let left = store.held(&[key]).await.expect("held")[0];
    assert!(left > s(59) && left <= s(60), "{left:?}");
    // One key beside the subject's budgets (same slot), expiring at the end.
    let keys = server.cli(&["KEYS", "*"]);
    let keys: Vec<&str> = keys.lines().filter(|k| !k.is_empty()).collect();
    assert_eq!(keys, [store.hold_key(&key).as_str()]);
    assert!(keys[0].starts_with("sluice:{") && keys[0].contains("}:hold:"));
    assert!(!keys[0].contains("secret"));
    let pttl: i64 = server.cli(&["PTTL", keys[0]]).trim().parse().expect("pttl");
    assert!(
        pttl > 59_000 && pttl <= 60_000,
        "expires at the hold's end: {pttl} ms"
    );
    // What a provider may impose is bounded.
    store.hold(&other, s(7 * 86_400)).await.expect("hold");
    let left = store.held(&[other]).await.expect("held")[0];
    assert!(
        left <= sluice_store::MAX_HOLD && left > s(86_399),
        "{left:?}"
    );
}

/// The hold scripts at an injected clock (as the pacer's tests run them):
/// exact to the microsecond, over once its end has come (though the key
/// lives on by the server's clock), and taken afresh after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c7_a_hold_ends_exactly_at_its_end() {
    let start = sluice_core::Timestamp::from_nanos(3_900_000_005_123_456_000);
    let clock = sluice_core::FakeClock::new(start);
    let server = Server::start("store");
    let mut config = RedisConfig::new(server.url());
    config.timeout = Duration::from_millis(500);
    let store = RedisStore::connect_with_clock(config, clock.clone())
        .await
        .expect("connect");
    let key = BudgetKey::new("pace-hold", b"k");
    store
        .hold(&key, Duration::from_secs(30))
        .await
        .expect("hold");
    clock.advance(Duration::from_millis(29_999));
    assert_eq!(
        store.held(&[key]).await.expect("held"),
        [Duration::from_millis(1)]
    );
    store
        .hold(&key, Duration::from_millis(1))
        .await
        .expect("hold");
    clock.advance(Duration::from_millis(1));
    assert_eq!(store.held(&[key]).await.expect("held"), [Duration::ZERO]);
    store
        .hold(&key, Duration::from_secs(5))
        .await
        .expect("hold");
    assert_eq!(
        store.held(&[key]).await.expect("held"),
        [Duration::from_secs(5)],
        "a hold after the last one ended starts afresh"
    );
}

/// On a Redis Cluster a hold lives in its subject's slot, and holds of
/// several subjects are read in one call per slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c7_holds_of_several_subjects_are_read_on_a_cluster() {
    let cluster = redis_server::RedisCluster::start();
    let mut config = RedisConfig::new(cluster.url());
    config.timeout = Duration::from_secs(2);
    let store = RedisStore::connect(config).await.expect("connect");
    let keys: Vec<BudgetKey> = (0..8u8)
        .map(|i| BudgetKey::new("pace-hold", &[i]))
        .collect();
    for (i, k) in keys.iter().enumerate().filter(|(i, _)| i % 2 == 0) {
        store
            .hold(k, Duration::from_secs(100 + i as u64))
            .await
            .expect("hold");
    }
    let left = store.held(&keys).await.expect("held");
    for (i, d) in left.iter().enumerate() {
        if i % 2 == 0 {
            let asked = Duration::from_secs(100 + i as u64);
            assert!(
                *d <= asked && *d > asked - Duration::from_secs(1),
                "{i}: {d:?}"
            );
        } else {
            assert_eq!(*d, Duration::ZERO, "{i}");
        }
    }
}
