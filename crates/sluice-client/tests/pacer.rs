//! The pacer on paused tokio time: pre-flight waits, RPM spacing, oversize,
//! shrink, reconciliation, header learning, hot reload, shared budgets.
#![allow(clippy::unwrap_used)]

use crate::support;

use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use sluice_client::config::ApiStyle;
use sluice_client::config::{
    ConfigWatcher, LimitsSource, ProviderLimits, StaticLimits, overrides_path,
};
use sluice_client::shrink::{Demand, PacedRequest};
use sluice_client::tokens::EstimateOptions;
use sluice_client::tokens::TokenEstimate;
use sluice_client::{PaceError, Pacer, TEST_EPOCH, TokioClock};
use sluice_core::Clock;
use sluice_store::{MemoryConfig, MemoryStore};
use support::*;

#[tokio::test(start_paused = true)]
async fn c2_preflight_wait_ends_exactly_when_the_window_has_room() {
    let (pacer, clock) = pacer(limits(1_000, 0, 0));
    let first = pacer
        .acquire(
            "p",
            TokenEstimate {
                prompt: 300,
                completion: 500,
            },
        )
        .await
        .unwrap();
    assert_eq!(first.waited(), Duration::ZERO);
    // 800 in the window: 400 more fit only when the first leaves it, at the
    // end of its 250 ms slot + 60 s + the 1 s arrival margin.
    let p2 = pacer.clone();
    let c2 = clock;
    let waiter = tokio::spawn(async move {
        let permit = p2.acquire("p", 400u32).await.unwrap();
        (c2.now(), permit.waited())
    });
    tokio::task::yield_now().await;
    tokio::time::advance(Duration::from_millis(61_249)).await;
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    assert!(!waiter.is_finished(), "admitted before the window had room");
    let (when, waited) = waiter.await.unwrap();
    assert_eq!(when, at(61_250));
    assert_eq!(waited, Duration::from_millis(61_250));
    // A request that fits in what is left goes at once.
    let now = clock.now();
    let p = pacer.acquire("p", 200u32).await.unwrap();
    assert_eq!(p.waited(), Duration::ZERO);
    assert_eq!(clock.now(), now);
    assert_eq!(pacer.tokens_in_window("p").await.unwrap(), 600);
}

/// Acquires `tokens` on `pacer`, one request each, queued in that order; returns
/// (index, when admitted) in the order they were admitted.
async fn admitted_in_order<const N: usize>(
    pacer: &TestPacer,
    clock: TokioClock,
    tokens: [u32; N],
) -> Vec<(usize, sluice_core::Timestamp)> {
    let order = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for (i, tokens) in tokens.into_iter().enumerate() {
        let p = pacer.clone();
        let o = order.clone();
        tasks.push(tokio::spawn(async move {
            p.acquire("p", tokens).await.unwrap();
            o.lock().push((i, clock.now()));
        }));
        tokio::task::yield_now().await;
    }
    for t in tasks {
        t.await.unwrap();
    }
    order.lock().clone()
}

#[tokio::test(start_paused = true)]
async fn c2_waiting_requests_keep_their_order_when_going_ahead_would_delay_the_head() {
    let (pacer, clock) = pacer(limits(1_000, 0, 0));
    pacer.acquire("p", 500u32).await.unwrap();
    tokio::time::advance(Duration::from_secs(30)).await;
    pacer.acquire("p", 400u32).await.unwrap();
    // 600 fit when the first 500 leave the window (61.25 s). 50 more fit now,
    // but with them in the window the 600 would have to wait for the 400 too:
    // the small request stays behind.
    let order = admitted_in_order(&pacer, clock, [600, 50]).await;
    assert_eq!(
        order[0],
        (0, at(61_250)),
        "the head went when it planned to"
    );
    assert_eq!(order[1].0, 1);
}

#[tokio::test(start_paused = true)]
async fn c2_a_small_request_goes_ahead_of_a_waiting_large_one_that_still_goes_on_time() {
    let (pacer, clock) = pacer(limits(1_000, 0, 0));
    pacer.acquire("p", 900u32).await.unwrap();
    // 800 wait for the 900 to leave the window (61.25 s); 50 fit now, and
    // 800 + 50 still fit then: the small one need not wait behind the large one.
    let order = admitted_in_order(&pacer, clock, [800, 50]).await;
    assert_eq!(order, vec![(1, at(0)), (0, at(61_250))]);
    // The 900 and the 50, both reserved at 0, have left the window.
    assert_eq!(pacer.tokens_in_window("p").await.unwrap(), 800);
}

#[tokio::test(start_paused = true)]
async fn c2_stats_count_every_request_that_waited_queued_ones_too() {
    let (pacer, _clock) = pacer(limits(1_000, 0, 0));
    pacer.acquire("p", 900u32).await.unwrap();
    // The first waiter sleeps for room; the second (too large to go ahead of
    // it: it does not fit now) queues behind it and never sleeps itself, yet
    // it waited just as long.
    let mut tasks = Vec::new();
    for tokens in [800u32, 150u32] {
        let p = pacer.clone();
        tasks.push(tokio::spawn(async move {
            p.acquire("p", tokens).await.unwrap().waited()
        }));
        tokio::task::yield_now().await;
    }
    let mut waits = Vec::new();
    for t in tasks {
        waits.push(t.await.unwrap());
    }
    assert!(waits.iter().all(|w| *w > Duration::ZERO), "{waits:?}");
    let stats = pacer.stats("p");
    assert_eq!(stats.admitted, 3);
    assert_eq!(stats.waited, 2, "the queued request waited too");
    let total: u128 = waits.iter().map(Duration::as_millis).sum();
    assert_eq!(u128::from(stats.wait_ms), total);
}

#[tokio::test(start_paused = true)]
async fn c3_rpm_spacing_is_even_never_a_burst() {
    let (pacer, clock) = pacer(limits(0, 60, 0));
    // 8 requests fired at once at the top of a minute.
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let p = pacer.clone();
        tasks.push(tokio::spawn(async move {
            p.acquire("p", 0u32).await.unwrap();
            p.clock().now()
        }));
    }
    let mut times = Vec::new();
    for t in tasks {
        times.push(t.await.unwrap());
    }
    times.sort();
    assert_eq!(times[0], TEST_EPOCH);
    // One every (60 s + 1 s margin) / 60 = 1016.67 ms (timers tick in ms).
    let interval = Duration::from_nanos(61_000_000_000 / 60);
    for w in times.windows(2) {
        let gap = w[1].saturating_since(w[0]);
        assert!(
            gap >= interval && gap <= interval + Duration::from_millis(1),
            "gap {gap:?}"
        );
    }
    assert!(clock.now().saturating_since(TEST_EPOCH) < Duration::from_secs(8));
}

#[tokio::test(start_paused = true)]
async fn c3_rpd_rolls_over_a_day() {
    let (pacer, clock) = pacer(limits(0, 0, 2));
    pacer.acquire("p", 0u32).await.unwrap();
    pacer.acquire("p", 0u32).await.unwrap();
    // The third would wait a day: longer than the 90 s maximum wait.
    let e = pacer.acquire("p", 0u32).await.unwrap_err();
    assert!(matches!(e, PaceError::WouldWait { .. }), "{e}");
    assert!(e.retry_after().unwrap() > Duration::from_secs(86_000));
    tokio::time::advance(Duration::from_secs(86_400 + 61)).await;
    pacer.acquire("p", 0u32).await.unwrap();
    assert!(clock.now() > TEST_EPOCH);
}

#[tokio::test(start_paused = true)]
async fn c4_oversize_is_an_error_at_once_never_a_wait() {
    let (pacer, clock) = pacer(limits(1_000, 0, 0));
    pacer.acquire("p", 1_000u32).await.unwrap();
    // Someone is already waiting for room.
    let p = pacer.clone();
    let _waiter = tokio::spawn(async move { p.acquire("p", 500u32).await });
    tokio::task::yield_now().await;
    let e = pacer.acquire("p", 1_001u32).await.unwrap_err();
    assert_eq!(clock.now(), TEST_EPOCH, "no time passed");
    match &e {
        PaceError::TooLarge {
            estimated, limit, ..
        } => assert_eq!((*estimated, *limit), (1_001, 1_000)),
        other => panic!("{other}"),
    }
    assert_eq!(e.status(), http::StatusCode::PAYLOAD_TOO_LARGE);
    assert!(e.to_string().contains("can never be sent"));
    assert_eq!(e.envelope()["error"]["details"]["tpm_limit"], 1_000);
    assert_eq!(pacer.stats("p").too_large, 1);
}

fn conversation(turns: usize) -> serde_json::Value {
    let mut messages = vec![json!({"role":"system","content":"You are a careful assistant."})];
    for i in 0..turns {
        messages.push(
            json!({"role":"user","content":format!("question {i}: {}", "lorem ipsum ".repeat(40))}),
        );
        messages.push(json!({"role":"assistant","content":format!("answer {i}: {}", "dolor sit amet ".repeat(40))}));
    }
    messages.push(json!({"role":"user","content":"and the last question?"}));
    json!({"model":"gpt-4o","messages":messages,"max_tokens":100})
}

#[tokio::test(start_paused = true)]
async fn c4_shrink_keeps_system_and_last_user_turn() {
    let shrinking = provider("p", limits(2_000, 0, 0)).with_shrink(Duration::from_secs(5));
    let (pacer, clock) = pacer_with([shrinking]);
    pacer.acquire("p", 1_200u32).await.unwrap();
    let mut req = PacedRequest::new(
        ApiStyle::OpenAi,
        "/chat/completions",
        conversation(6),
        EstimateOptions::default(),
    );
    let before = req.tokens();
    assert!(before > 800 && before < 2_000, "{before}");
    // 800 left now; the window refills only after 61 s > 5 s: shrink.
    let permit = pacer.acquire_demand("p", &mut req).await.unwrap();
    assert_eq!(clock.now(), TEST_EPOCH, "sent at once after shrinking");
    assert!(req.tokens() <= 800);
    assert_eq!(permit.tokens(), req.tokens());
    let report = req.shrink_report().unwrap();
    assert_eq!(report.tokens_dropped, before - req.tokens());
    assert!(report.messages_dropped >= 2);
    let msgs = req.body()["messages"].as_array().unwrap();
    assert_eq!(msgs[0]["role"], "system");
    assert_eq!(msgs.last().unwrap()["content"], "and the last question?");
    assert_eq!(msgs.len() as u32 + report.messages_dropped, 14);
    assert_eq!(pacer.stats("p").shrunk, 1);

    // Without shrink, the same request is refused as too long a wait.
    let mut p = provider("p", limits(2_000, 0, 0));
    p.max_wait = Duration::from_secs(5);
    let (pacer, _) = pacer_with([p]);
    pacer.acquire("p", 1_200u32).await.unwrap();
    let mut req = PacedRequest::new(
        ApiStyle::OpenAi,
        "/chat/completions",
        conversation(6),
        EstimateOptions::default(),
    );
    let e = pacer.acquire_demand("p", &mut req).await.unwrap_err();
    assert!(matches!(e, PaceError::WouldWait { .. }), "{e}");
    assert!(req.shrink_report().is_none());
}

#[tokio::test(start_paused = true)]
async fn c4_shrink_brings_an_oversize_request_under_the_whole_tpm() {
    let shrinking = provider("p", limits(500, 0, 0)).with_shrink(Duration::from_secs(5));
    let (pacer, _) = pacer_with([shrinking]);
    let mut req = PacedRequest::new(
        ApiStyle::OpenAi,
        "/chat/completions",
        conversation(6),
        EstimateOptions::default(),
    );
    let permit = pacer.acquire_demand("p", &mut req).await.unwrap();
    assert!(permit.tokens() <= 500);
    assert!(req.shrink_report().unwrap().messages_dropped > 0);
}

#[tokio::test(start_paused = true)]
async fn c6_usage_reconciliation_frees_reserved_tokens() {
    let (pacer, clock) = pacer(limits(1_000, 0, 0));
    let permit = pacer
        .acquire(
            "p",
            TokenEstimate {
                prompt: 100,
                completion: 800,
            },
        )
        .await
        .unwrap();
    assert_eq!(pacer.tokens_in_window("p").await.unwrap(), 900);
    tokio::time::advance(Duration::from_secs(3)).await;
    // The answer used 100 + 150: 650 reserved tokens come back.
    permit.reconcile(250).await.unwrap();
    assert_eq!(pacer.tokens_in_window("p").await.unwrap(), 250);
    let t = clock.now();
    let p = pacer.acquire("p", 700u32).await.unwrap();
    assert_eq!(p.waited(), Duration::ZERO);
    assert_eq!(clock.now(), t);
    // Using more than reserved charges the difference now.
    p.reconcile(750).await.unwrap();
    assert_eq!(pacer.tokens_in_window("p").await.unwrap(), 1_000);
    assert_eq!(pacer.stats("p").reconciled, 2);
}

#[tokio::test(start_paused = true)]
async fn c2_a_waiting_request_goes_the_moment_a_reconcile_frees_room() {
    let (pacer, clock) = pacer(limits(1_000, 0, 0));
    let first = pacer
        .acquire(
            "p",
            TokenEstimate {
                prompt: 100,
                completion: 800,
            },
        )
        .await
        .unwrap();
    // 500 more do not fit: the waiter plans for the first request's slot to
    // leave the window, a minute away, and looks again within a second.
    let p2 = pacer.clone();
    let waiter = tokio::spawn(async move {
        let permit = p2.acquire("p", 500u32).await.unwrap();
        (clock.now(), permit.waited())
    });
    tokio::task::yield_now().await;
    tokio::time::advance(Duration::from_millis(300)).await;
    assert!(!waiter.is_finished());
    // The answer used 300 of its 900: the waiter goes now, not at its next
    // look.
    first.reconcile(300).await.unwrap();
    let (when, waited) = waiter.await.unwrap();
    assert_eq!(when, at(300));
    assert_eq!(waited, Duration::from_millis(300));
    assert_eq!(pacer.tokens_in_window("p").await.unwrap(), 800);
}

#[tokio::test(start_paused = true)]
async fn c6_headers_hold_and_foreign_usage_correct_the_window() {
    let (pacer, clock) = pacer(limits(10_000, 0, 0));
    pacer.acquire("p", 1_000u32).await.unwrap();
    let mut h = http::HeaderMap::new();
    h.insert("x-ratelimit-limit-tokens", "10000".parse().unwrap());
    // The provider counts 4,000: 3,000 spent by another client on this key.
    h.insert("x-ratelimit-remaining-tokens", "6000".parse().unwrap());
    h.insert("x-ratelimit-remaining-requests", "0".parse().unwrap());
    h.insert("x-ratelimit-reset-requests", "2s".parse().unwrap());
    pacer.observe("p", &h).await.unwrap();
    assert_eq!(pacer.tokens_in_window("p").await.unwrap(), 4_000);
    // Requests at 0 until a reset 2 s away: the next request waits for it.
    let p = pacer.acquire("p", 10u32).await.unwrap();
    assert_eq!(p.waited(), Duration::from_secs(2));
    assert_eq!(clock.now(), at(2_000));
    // A provider reporting a smaller plan never lowers the configured one.
    let mut h = http::HeaderMap::new();
    h.insert("x-ratelimit-limit-tokens", "5000".parse().unwrap());
    h.insert("x-ratelimit-remaining-tokens", "5000".parse().unwrap());
    pacer.observe("p", &h).await.unwrap();
    assert_eq!(pacer.tokens_in_window("p").await.unwrap(), 4_010);
    let j = pacer.limits_json().await;
    assert_eq!(j["providers"]["p"]["tpm"], 10_000);
    assert_eq!(
        j["providers"]["p"]["learned"]["headers"]["tokens"]["limit"],
        5_000
    );
}

#[tokio::test(start_paused = true)]
async fn c6_a_slow_answer_s_headers_are_read_as_of_its_arrival() {
    let (pacer, clock) = pacer(limits(10_000, 0, 0));
    pacer.acquire("p", 5_000u32).await.unwrap();
    tokio::time::advance(Duration::from_secs(30)).await;
    let slow = pacer.acquire("p", 1_000u32).await.unwrap();
    // On arrival the provider counted our 6,000 (and said so); the answer
    // comes back 35 s later, when the first 5,000 have left our window.
    let mut h = http::HeaderMap::new();
    h.insert("x-ratelimit-limit-tokens", "10000".parse().unwrap());
    h.insert("x-ratelimit-remaining-tokens", "4000".parse().unwrap());
    tokio::time::advance(Duration::from_secs(35)).await;
    assert_eq!(pacer.tokens_in_window("p").await.unwrap(), 1_000);
    slow.observe(&h).await.unwrap();
    // Nobody else spent: nothing is charged.
    assert_eq!(pacer.tokens_in_window("p").await.unwrap(), 1_000);
    // Had the provider counted 7,000, another client spent 1,000.
    h.insert("x-ratelimit-remaining-tokens", "3000".parse().unwrap());
    slow.observe(&h).await.unwrap();
    assert_eq!(pacer.tokens_in_window("p").await.unwrap(), 2_000);

    // Requests at zero until a reset 2 s after the arrival: an answer read
    // 1.5 s after it holds the provider 0.5 s more, not 2 s.
    let sent = clock.now();
    let last = pacer.acquire("p", 10u32).await.unwrap();
    let mut h = http::HeaderMap::new();
    h.insert("x-ratelimit-remaining-requests", "0".parse().unwrap());
    h.insert("x-ratelimit-reset-requests", "2s".parse().unwrap());
    tokio::time::advance(Duration::from_millis(1_500)).await;
    last.observe(&h).await.unwrap();
    pacer.acquire("p", 10u32).await.unwrap();
    assert_eq!(clock.now().saturating_since(sent), Duration::from_secs(2));
}

#[tokio::test(start_paused = true)]
async fn c7_two_pacers_on_one_store_share_one_budget() {
    let clock = TokioClock::at(TEST_EPOCH);
    let store = SharedStore(Arc::new(MemoryStore::with_clock(
        MemoryConfig::default(),
        clock,
    )));
    let config = sluice_client::PaceConfig::from_providers([provider("p", limits(1_000, 0, 0))]);
    let a = Pacer::with_store(
        store.clone(),
        clock,
        Arc::new(StaticLimits::new(config.clone())),
    );
    let b = Pacer::with_store(store, clock, Arc::new(StaticLimits::new(config)));
    a.acquire("p", 600u32).await.unwrap();
    // Process B sees A's spend: 600 more must wait for the window.
    let permit = b.acquire("p", 600u32).await.unwrap();
    assert_eq!(permit.waited(), Duration::from_millis(61_250));
    // And A sees B's.
    assert_eq!(a.tokens_in_window("p").await.unwrap(), 600);
    // A refund by B is seen by A.
    permit.reconcile(100).await.unwrap();
    let p = a.acquire("p", 900u32).await.unwrap();
    assert_eq!(p.waited(), Duration::ZERO);
}

#[tokio::test(start_paused = true)]
async fn c1_hot_reload_takes_effect_on_the_next_request() {
    let dir = temp_dir("reload");
    let file = dir.join("pace.yaml");
    let write = |tpm: &str| {
        std::fs::write(
            &file,
            format!("providers:\n  p:\n    baseUrl: http://127.0.0.1:9/v1\n    rateLimits: {{ tpm: {tpm}, rpm: 0, rpd: 0 }}\n"),
        )
        .unwrap();
    };
    write("1000");
    let watcher = Arc::new(ConfigWatcher::open(&file).unwrap());
    let clock = TokioClock::at(TEST_EPOCH);
    let source: Arc<dyn LimitsSource> = watcher.clone();
    let pacer = Pacer::with_store(
        MemoryStore::with_clock(MemoryConfig::default(), clock),
        clock,
        source,
    );
    pacer.acquire("p", 900u32).await.unwrap();
    assert!(matches!(
        pacer.acquire("p", 1_500u32).await,
        Err(PaceError::TooLarge { .. })
    ));
    // Edit the file: the very next request sees 50,000.
    write("50000");
    let p = pacer.acquire("p", 1_500u32).await.unwrap();
    assert_eq!(p.waited(), Duration::ZERO);
    assert_eq!(watcher.reloads(), 1);
    // A broken edit keeps the last good config and says why.
    std::fs::write(&file, "providers:\n  p:\n    rateLimitz: {}\n").unwrap();
    assert_eq!(pacer.config().provider("p").unwrap().limits.tpm, 50_000);
    assert!(watcher.last_error().unwrap().contains("rateLimitz"));
    // The settings page's save persists next to the file and applies at once.
    write("50000 ");
    watcher.save_limits("p", limits(7, 8, 9)).unwrap();
    assert_eq!(
        pacer.config().provider("p").unwrap().limits,
        limits(7, 8, 9)
    );
    let saved = std::fs::read_to_string(overrides_path(&file)).unwrap();
    assert!(saved.contains("tpm: 7, rpm: 8, rpd: 9"), "{saved}");
    let reopened = ConfigWatcher::open(&file).unwrap();
    assert_eq!(
        reopened.current().provider("p").unwrap().limits,
        limits(7, 8, 9)
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// C1: edits made at once from the settings page (two axes of one provider
/// sent apart, and another provider) are made one after the other, none
/// undoing another's: each reads the limits in force when it is made.
#[test]
fn c1_settings_edits_made_at_once_all_hold() {
    let dir = temp_dir("edits");
    let file = dir.join("pace.yaml");
    std::fs::write(
        &file,
        "providers:\n  p:\n    baseUrl: http://127.0.0.1:9/v1\n    rateLimits: { tpm: 1000, rpm: 10, rpd: 0 }\n  q:\n    baseUrl: http://127.0.0.1:9/v1\n    rateLimits: { tpm: 1000, rpm: 10, rpd: 0 }\n",
    )
    .unwrap();
    let watcher = Arc::new(ConfigWatcher::open(&file).unwrap());
    const EDITS: u32 = 30;
    let editors: Vec<_> = (0..3)
        .map(|which| {
            let watcher = Arc::clone(&watcher);
            std::thread::spawn(move || {
                for i in 1..=EDITS {
                    let (provider, edit): (&str, Box<dyn Fn(ProviderLimits) -> ProviderLimits>) =
                        match which {
                            0 => ("p", Box::new(move |c| limits(2000 + i, c.rpm, c.rpd))),
                            1 => ("p", Box::new(move |c| limits(c.tpm, 20 + i, c.rpd))),
                            _ => ("q", Box::new(move |c| limits(c.tpm, c.rpm, 300 + i))),
                        };
                    watcher.edit_limits(provider, &*edit).unwrap();
                }
            })
        })
        .collect();
    for e in editors {
        e.join().unwrap();
    }
    let reopened = ConfigWatcher::open(&file).unwrap();
    for source in [watcher.current(), reopened.current()] {
        assert_eq!(
            source.provider("p").unwrap().limits,
            limits(2000 + EDITS, 20 + EDITS, 0),
            "both axes of p"
        );
        assert_eq!(
            source.provider("q").unwrap().limits,
            limits(1000, 10, 300 + EDITS)
        );
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(start_paused = true)]
async fn unknown_provider_is_refused() {
    let (pacer, _) = pacer(limits(1, 1, 1));
    let e = pacer.acquire("nope", 1u32).await.unwrap_err();
    assert!(matches!(e, PaceError::UnknownProvider { .. }));
    assert_eq!(e.status(), http::StatusCode::NOT_FOUND);
}

#[tokio::test(start_paused = true)]
async fn c1_the_admin_reading_counts_tokens_and_requests_in_their_windows() {
    let (pacer, _clock) = pacer(limits(1_000, 600, 100));
    for _ in 0..3 {
        pacer.acquire("p", 100u32).await.unwrap();
    }
    let r = pacer.reading("p").await.unwrap();
    assert_eq!(r.tokens, 300);
    assert_eq!(r.requests_last_minute, 3);
    assert_eq!(r.requests_today, Some(3));
    // A minute and a half later the token window and the last minute are empty;
    // the day still holds all three.
    tokio::time::advance(Duration::from_secs(90)).await;
    let r = pacer.reading("p").await.unwrap();
    assert_eq!((r.tokens, r.requests_last_minute), (0, 0));
    assert_eq!(r.requests_today, Some(3));
    // Without an RPD no day is counted.
    let (unlimited, _) = support::pacer(limits(0, 0, 0));
    unlimited.acquire("p", 10u32).await.unwrap();
    let r = unlimited.reading("p").await.unwrap();
    assert_eq!(
        (r.tokens, r.requests_last_minute, r.requests_today),
        (0, 1, None)
    );
}

#[tokio::test(start_paused = true)]
async fn c1_tpd_paces_tokens_over_a_rolling_day_settled_by_usage() {
    let (pacer, clock) = pacer(limits(0, 0, 0).with_tpd(1_000));
    let start = clock.now();
    let first = pacer
        .acquire(
            "p",
            TokenEstimate {
                prompt: 100,
                completion: 500,
            },
        )
        .await
        .unwrap();
    assert_eq!(first.waited(), Duration::ZERO);
    // 600 of the day's 1,000 spent: 500 more fit only when they leave the
    // day, far past the 90 s a request may wait: refused at once.
    let e = pacer.acquire("p", 500u32).await.unwrap_err();
    assert!(matches!(e, PaceError::WouldWait { .. }), "{e:?}");
    assert!(
        e.retry_after().unwrap() > Duration::from_secs(86_000),
        "{e:?}"
    );
    assert_eq!(clock.now(), start, "no wait");
    // The answer used 100: the rest is given back to the day.
    first.reconcile(100).await.unwrap();
    let second = pacer.acquire("p", 500u32).await.unwrap();
    assert_eq!(second.waited(), Duration::ZERO);
    // A refused request (cancelled) gives all its tokens back.
    let third = pacer.acquire("p", 400u32).await.unwrap();
    assert!(pacer.acquire("p", 400u32).await.is_err(), "the day is full");
    third.cancel().await.unwrap();
    let fourth = pacer.acquire("p", 400u32).await.unwrap();
    // More used than reserved is charged now.
    fourth.reconcile(450).await.unwrap();
    assert!(
        pacer.acquire("p", 1u32).await.is_err(),
        "1,050 of 1,000 spent"
    );
    // A request larger than the whole day is too large, at once.
    let e = pacer.acquire("p", 1_001u32).await.unwrap_err();
    assert!(matches!(e, PaceError::TooLarge { .. }), "{e:?}");
    assert_eq!(clock.now(), start);
    // A day (and the margin and a slot) later, the whole day is back.
    tokio::time::advance(Duration::from_secs(86_400 + 62)).await;
    let p = pacer.acquire("p", 1_000u32).await.unwrap();
    assert_eq!(p.waited(), Duration::ZERO);
}

#[tokio::test(start_paused = true)]
async fn c1_tpd_waits_within_max_wait_for_the_day_to_roll() {
    // 900 of 1,000 spent in the day's first 60 s slot leave the day at that
    // slot's end + 24 h + the 1 s margin: at t = 86,461 s. A request of 200
    // at t = 86,380 s waits exactly until then (81 s, within its 90).
    let (pacer, clock) = pacer(limits(0, 0, 0).with_tpd(1_000));
    pacer.acquire("p", 900u32).await.unwrap();
    tokio::time::advance(Duration::from_secs(86_380)).await;
    let p = pacer.acquire("p", 200u32).await.unwrap();
    assert_eq!(p.waited(), Duration::from_secs(81));
    assert_eq!(clock.now(), at(86_461_000));
}

#[tokio::test(start_paused = true)]
async fn c6_reservations_follow_the_provider_s_count_per_model_within_bounds() {
    use sluice_client::AcquireOptions;
    use sluice_client::usage::Usage;
    let (pacer, _clock) = pacer(limits(100_000_000, 0, 0));
    let ask = TokenEstimate {
        prompt: 1_000,
        completion: 100,
    };
    let model = |m: &str| AcquireOptions::default().model(m);
    let answer = |prompt: u32| Usage {
        prompt,
        completion: 100,
        ..Usage::default()
    };
    // Nothing learned: the estimate.
    let p = pacer
        .acquire_with("p", &mut { ask }, &model("low"))
        .await
        .unwrap();
    assert_eq!(p.tokens(), 1_100);
    p.reconcile_usage(answer(500)).await.unwrap();
    // `low`'s provider counts half the estimate; below 8 answers the
    // estimate is still reserved whole.
    for n in 2..=8 {
        let p = pacer
            .acquire_with("p", &mut { ask }, &model("low"))
            .await
            .unwrap();
        assert_eq!(p.tokens(), 1_100, "after {} answers", n - 1);
        p.reconcile_usage(answer(500)).await.unwrap();
    }
    // Trusted: the provider's count.
    let p = pacer
        .acquire_with("p", &mut { ask }, &model("low"))
        .await
        .unwrap();
    assert_eq!(p.tokens(), 600);
    drop(p);
    // `high` counts 1.3×: more than the estimate at once (with a margin),
    // then the provider's count; and a 10× report does not poison it.
    for n in 0..8 {
        let p = pacer
            .acquire_with("p", &mut { ask }, &model("high"))
            .await
            .unwrap();
        if n == 0 {
            assert_eq!(p.tokens(), 1_100);
        } else {
            assert!(p.tokens() >= 1_400, "{}", p.tokens());
        }
        p.reconcile_usage(answer(1_300)).await.unwrap();
    }
    let p = pacer
        .acquire_with("p", &mut { ask }, &model("high"))
        .await
        .unwrap();
    assert_eq!(p.tokens(), 1_400);
    p.reconcile_usage(answer(13_000)).await.unwrap();
    let p = pacer
        .acquire_with("p", &mut { ask }, &model("high"))
        .await
        .unwrap();
    assert!((1_400..1_500).contains(&p.tokens()), "{}", p.tokens());
    drop(p);
    // Each model's own: `low` is as it was, a new model starts afresh.
    let p = pacer
        .acquire_with("p", &mut { ask }, &model("low"))
        .await
        .unwrap();
    assert_eq!(p.tokens(), 600);
    let p = pacer
        .acquire_with("p", &mut { ask }, &model("new"))
        .await
        .unwrap();
    assert_eq!(p.tokens(), 1_100);
    let shown: Vec<(String, u32)> = pacer
        .input_ratios("p")
        .into_iter()
        .map(|r| (r.model, r.samples))
        .collect();
    assert_eq!(
        shown,
        [("high".to_owned(), 9), ("low".to_owned(), 8)],
        "{shown:?}"
    );
    // Restored ratios are bounded too.
    pacer.restore_input_ratio("p", "wild", 1_000.0, 50);
    let p = pacer
        .acquire_with("p", &mut { ask }, &model("wild"))
        .await
        .unwrap();
    assert_eq!(p.tokens(), 4_100);
}

/// A store that answers nothing (Redis down).
#[derive(Clone)]
struct DownStore;

fn down() -> sluice_store::StoreError {
    sluice_store::StoreError::Unavailable("down".into())
}

impl sluice_store::BudgetStore for DownStore {
    async fn decide(
        &self,
        _: &[sluice_core::Budget],
    ) -> Result<sluice_core::Decision, sluice_store::StoreError> {
        Err(down())
    }
    async fn peek(
        &self,
        _: &[sluice_core::Budget],
    ) -> Result<sluice_core::Decision, sluice_store::StoreError> {
        Err(down())
    }
    async fn adjust(
        &self,
        _: &sluice_core::Budget,
        _: i64,
        _: sluice_core::Timestamp,
    ) -> Result<sluice_core::BudgetStatus, sluice_store::StoreError> {
        Err(down())
    }
    async fn hold(
        &self,
        _: &sluice_core::BudgetKey,
        _: Duration,
    ) -> Result<(), sluice_store::StoreError> {
        Err(down())
    }
    async fn held(
        &self,
        _: &[sluice_core::BudgetKey],
    ) -> Result<Vec<Duration>, sluice_store::StoreError> {
        Err(down())
    }
}

/// SPEC C5 with C7: a store that cannot tell the shared holds leaves this
/// process's own — a provider with no limits to pace still goes out while the
/// store is down, and a 429 this process saw still holds it.
#[tokio::test(start_paused = true)]
async fn c7_a_store_that_cannot_tell_the_holds_leaves_this_process_s_own() {
    let clock = TokioClock::at(TEST_EPOCH);
    let config = sluice_client::PaceConfig::from_providers([provider("p", limits(0, 0, 0))]);
    let pacer = Pacer::with_store(DownStore, clock, Arc::new(StaticLimits::new(config)));
    let permit = pacer.acquire("p", 10u32).await.unwrap();
    assert_eq!(permit.waited(), Duration::ZERO);
    drop(permit);
    assert!(
        pacer.hold("p", Duration::from_secs(5)).await.is_err(),
        "not shared"
    );
    let permit = pacer.acquire("p", 10u32).await.unwrap();
    assert_eq!(
        permit.waited(),
        Duration::from_secs(5),
        "held here all the same"
    );
}
