//! The simulator on paused time: strict rolling windows, provider-shaped
//! answers and refusals, violation counters.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use serde_json::{Value, json};
use sluice_client::backoff::{Retryable, classify};
use sluice_client::simulator::{SimService, SimulatorConfig};
use sluice_client::{RateLimitHeaders, TEST_EPOCH, TokioClock};
use sluice_core::Clock;
use tower::Service;

fn post(path: &str, body: Value) -> Request<Full<Bytes>> {
    Request::post(format!("http://sim{path}"))
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap()
}

async fn send(
    sim: &mut SimService,
    req: Request<Full<Bytes>>,
) -> (StatusCode, http::HeaderMap, Bytes) {
    let r = sim.call(req).await.unwrap();
    let (parts, body) = r.into_parts();
    (
        parts.status,
        parts.headers,
        body.collect().await.unwrap().to_bytes(),
    )
}

fn chat(max_tokens: u32) -> Value {
    json!({"model":"gpt-4o","messages":[{"role":"user","content":"hi"}],"max_tokens":max_tokens})
}

#[tokio::test(start_paused = true)]
async fn simulator_enforces_a_strict_rolling_token_window_like_openai() {
    let clock = TokioClock::at(TEST_EPOCH);
    let cfg = SimulatorConfig {
        tpm: 100,
        rpm: 0,
        completion_tokens: 10,
        latency: Duration::ZERO,
        reconcile: false,
        ..SimulatorConfig::default()
    };
    let mut sim = SimService::new(cfg, Arc::new(clock));
    let (s, h, b) = send(&mut sim, post("/v1/chat/completions", chat(80))).await;
    assert_eq!(s, StatusCode::OK);
    let j: Value = serde_json::from_slice(&b).unwrap();
    assert_eq!(j["object"], "chat.completion");
    assert_eq!(j["usage"]["completion_tokens"], 10);
    let learned = RateLimitHeaders::parse(&h, clock.now());
    assert_eq!(learned.tokens.limit, Some(100));
    assert!(learned.tokens.remaining.unwrap() < 20);
    tokio::time::advance(Duration::from_secs(20)).await;
    let (s, h, b) = send(&mut sim, post("/v1/chat/completions", chat(80))).await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS);
    let j: Value = serde_json::from_slice(&b).unwrap();
    assert_eq!(j["error"]["code"], "rate_limit_exceeded");
    assert!(
        j["error"]["message"]
            .as_str()
            .unwrap()
            .contains("tokens per min (TPM): Limit 100")
    );
    // The 429 tells exactly when room comes back: 40 s later.
    assert_eq!(
        classify(s, &h, Some(&b)),
        Retryable::Yes {
            hint: Some(Duration::from_secs(40))
        }
    );
    tokio::time::advance(Duration::from_millis(39_999)).await;
    assert_eq!(
        send(&mut sim, post("/v1/chat/completions", chat(80)))
            .await
            .0,
        StatusCode::TOO_MANY_REQUESTS
    );
    tokio::time::advance(Duration::from_millis(1)).await;
    assert_eq!(
        send(&mut sim, post("/v1/chat/completions", chat(80)))
            .await
            .0,
        StatusCode::OK
    );
    let st = sim.stats();
    assert_eq!(
        (st.requests, st.admitted, st.violations, st.tpm_violations),
        (4, 2, 2, 2)
    );
    assert!(st.worst_window_tokens <= 100);
}

#[tokio::test(start_paused = true)]
async fn simulator_counts_rpm_and_reconciles_usage() {
    let clock = TokioClock::at(TEST_EPOCH);
    let cfg = SimulatorConfig {
        tpm: 1_000,
        rpm: 2,
        completion_tokens: 5,
        latency: Duration::from_millis(100),
        ..SimulatorConfig::default()
    };
    let mut sim = SimService::new(cfg, Arc::new(clock));
    // Reserved 900+ at arrival, only ~15 used: the window frees the rest.
    assert_eq!(
        send(&mut sim, post("/v1/chat/completions", chat(900)))
            .await
            .0,
        StatusCode::OK
    );
    assert_eq!(
        send(&mut sim, post("/v1/chat/completions", chat(900)))
            .await
            .0,
        StatusCode::OK
    );
    let (s, _, b) = send(&mut sim, post("/v1/chat/completions", chat(1))).await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS);
    assert!(String::from_utf8_lossy(&b).contains("requests per min (RPM)"));
    assert_eq!(sim.stats().rpm_violations, 1);
}

#[tokio::test(start_paused = true)]
async fn simulator_streams_with_usage_last_and_speaks_anthropic() {
    let clock = TokioClock::at(TEST_EPOCH);
    let mut sim = SimService::new(
        SimulatorConfig {
            completion_tokens: 12,
            ..SimulatorConfig::default()
        },
        Arc::new(clock),
    );
    let mut body = chat(50);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let (s, h, b) = send(&mut sim, post("/v1/chat/completions", body)).await;
    assert_eq!(s, StatusCode::OK);
    assert!(
        h["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let text = String::from_utf8(b.to_vec()).unwrap();
    let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert_eq!(*events.last().unwrap(), "data: [DONE]");
    assert!(events[events.len() - 2].contains("\"completion_tokens\":12"));

    let (s, h, b) = send(
        &mut sim,
        post("/v1/messages", json!({"model":"claude","max_tokens":30,"system":"s","messages":[{"role":"user","content":"hi"}]})),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    let j: Value = serde_json::from_slice(&b).unwrap();
    assert_eq!(j["type"], "message");
    assert_eq!(j["usage"]["output_tokens"], 12);
    let learned = RateLimitHeaders::parse(&h, clock.now());
    assert_eq!(learned.requests.limit, Some(500));
    assert!(learned.tokens.reset.is_some());
}

#[tokio::test(start_paused = true)]
async fn simulator_takes_a_request_s_own_latency_from_its_header() {
    let clock = TokioClock::at(TEST_EPOCH);
    let cfg = SimulatorConfig {
        latency: Duration::from_millis(100),
        ..SimulatorConfig::default()
    };
    let mut sim = SimService::new(cfg, Arc::new(clock));
    let (s, _, _) = send(&mut sim, post("/v1/chat/completions", chat(20))).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(
        clock.now(),
        TEST_EPOCH.saturating_add(Duration::from_millis(100))
    );
    let mut req = post("/v1/chat/completions", chat(20));
    req.headers_mut().insert(
        sluice_client::simulator::LATENCY_HEADER,
        http::HeaderValue::from_static("2500"),
    );
    let (s, _, _) = send(&mut sim, req).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(
        clock.now(),
        TEST_EPOCH.saturating_add(Duration::from_millis(2_600))
    );
}

fn chat_for(model: &str, max_tokens: u32) -> Value {
    json!({"model":model,"messages":[{"role":"user","content":"hi"}],"max_tokens":max_tokens})
}

#[tokio::test(start_paused = true)]
async fn m1_the_simulator_limits_each_model_apart_and_the_provider_as_a_whole() {
    use sluice_client::simulator::SimModel;
    let clock = TokioClock::at(TEST_EPOCH);
    let cfg = SimulatorConfig {
        tpm: 250,
        rpm: 0,
        completion_tokens: 10,
        latency: Duration::ZERO,
        reconcile: false,
        ..SimulatorConfig::default()
    };
    let mut sim = SimService::new(cfg, Arc::new(clock));
    sim.set_models([
        SimModel::new("gpt-4o", 100, 0),
        SimModel::new("gpt-4o-mini*", 200, 0),
    ]);
    let (s, h, _) = send(
        &mut sim,
        post("/v1/chat/completions", chat_for("gpt-4o", 80)),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    // The headers describe the model's own limits.
    assert_eq!(
        RateLimitHeaders::parse(&h, clock.now()).tokens.limit,
        Some(100)
    );
    let (s, _, b) = send(
        &mut sim,
        post("/v1/chat/completions", chat_for("gpt-4o", 20)),
    )
    .await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS, "over gpt-4o's own 100");
    assert!(String::from_utf8_lossy(&b).contains("gpt-4o"));
    let (s, _, _) = send(
        &mut sim,
        post("/v1/chat/completions", chat_for("gpt-4o-mini-x", 140)),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "another model has its own window");
    let (s, _, _) = send(
        &mut sim,
        post("/v1/chat/completions", chat_for("gpt-4o-mini", 20)),
    )
    .await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS, "over the provider's 250");
    assert_eq!(sim.model_stats("gpt-4o").unwrap().violations, 1);
    assert_eq!(sim.model_stats("gpt-4o-mini*").unwrap().admitted, 1);
    assert_eq!(sim.stats().violations, 2);
}

#[tokio::test(start_paused = true)]
async fn m2_the_simulator_counts_input_and_output_apart_like_anthropic() {
    let clock = TokioClock::at(TEST_EPOCH);
    let cfg = SimulatorConfig {
        tpm: 0,
        rpm: 0,
        itpm: 1_000,
        otpm: 100,
        completion_tokens: 10,
        latency: Duration::ZERO,
        reconcile: true,
        ..SimulatorConfig::default()
    };
    let mut sim = SimService::new(cfg, Arc::new(clock));
    let msg = |max: u32| json!({"model":"claude","max_tokens":max,"messages":[{"role":"user","content":"hi"}]});
    // The completion budget counts toward output at arrival...
    let (s, h, _) = send(&mut sim, post("/v1/messages", msg(90))).await;
    assert_eq!(s, StatusCode::OK);
    let learned = RateLimitHeaders::parse(&h, clock.now());
    assert_eq!(learned.output_tokens.limit, Some(100));
    assert_eq!(learned.input_tokens.limit, Some(1_000));
    // ...and is corrected to what was generated (10) when the answer ends.
    let (s, _, _) = send(&mut sim, post("/v1/messages", msg(90))).await;
    assert_eq!(s, StatusCode::OK);
    let (s, _, b) = send(&mut sim, post("/v1/messages", msg(90))).await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS, "10 + 10 + 90 > 100");
    assert!(String::from_utf8_lossy(&b).contains("OTPM"));
    assert_eq!(sim.stats().otpm_violations, 1);
    assert_eq!(sim.stats().output_used, 20);
}

/// A provider that counts prompts at 1.3× the client's estimate (another
/// tokenizer, a per-message overhead), a TPM of 6,000, answers after 5 s;
/// a pacer with the same TPM and no retries (every 429 is seen).
fn undercounted() -> (
    sluice_client::Pacer<sluice_store::MemoryStore<TokioClock>, TokioClock>,
    SimService,
) {
    use sluice_client::config::{PaceConfig, ProviderConfig, ProviderLimits};
    let clock = TokioClock::at(TEST_EPOCH);
    let sim = SimService::new(
        SimulatorConfig {
            tpm: 6_000,
            rpm: 0,
            completion_tokens: 10,
            latency: Duration::from_secs(5),
            prompt_percent: 130,
            ..SimulatorConfig::default()
        },
        Arc::new(clock),
    );
    let mut config = PaceConfig::from_providers([ProviderConfig::new(
        "p",
        "http://sim/v1",
        ProviderLimits::new(6_000, 0, 0),
    )]);
    config.pacer.max_attempts = 1;
    let store = sluice_store::MemoryStore::with_clock(sluice_store::MemoryConfig::default(), clock);
    let pacer = sluice_client::Pacer::with_store(
        store,
        clock,
        Arc::new(sluice_client::config::StaticLimits::new(config)),
    );
    (pacer, sim)
}

/// A request of some 300 prompt tokens (by the client's estimate) and 10
/// completion tokens.
fn long_chat() -> Value {
    let text = "the provider's count is the truth ".repeat(40);
    json!({"model":"gpt-4o","messages":[{"role":"user","content":text}],"max_tokens":10})
}

/// `n` requests at once through the pacer to the simulator; each answer read
/// to its end (its usage settles the reservation). The statuses.
async fn burst(
    client: &sluice_client::PacerService<
        SimService,
        sluice_store::MemoryStore<TokioClock>,
        TokioClock,
    >,
    n: usize,
) -> Vec<StatusCode> {
    use tower::ServiceExt;
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let c = client.clone();
            tokio::spawn(async move {
                let r = c
                    .oneshot(post("/v1/chat/completions", long_chat()))
                    .await
                    .unwrap();
                let status = r.status();
                let _ = r.into_body().collect().await.unwrap();
                status
            })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    // The usage settles on a spawned task: let it run.
    tokio::time::sleep(Duration::from_millis(10)).await;
    out
}

#[tokio::test(start_paused = true)]
async fn c6_the_provider_s_count_is_learned_per_model_and_a_full_window_trips_no_429() {
    // The client estimates 300-odd tokens a request; the provider counts
    // 1.3× that. A burst sized to the TPM by the estimate:
    let (pacer, sim) = undercounted();
    let client = tower::Layer::layer(
        &sluice_client::PacerLayer::new(pacer.clone(), "p"),
        sim.clone(),
    );
    let n = 24;
    // Without the ratio (a fresh pacer: nothing learned yet) the provider
    // refuses part of it (the first 429 then holds the rest back).
    let fresh = burst(&client, n).await;
    let refused = fresh
        .iter()
        .filter(|s| **s == StatusCode::TOO_MANY_REQUESTS)
        .count();
    assert!(refused >= 1, "{fresh:?}");
    assert_eq!(sim.stats().tpm_violations, refused as u64);

    // The same pacer has learned from the answers that came back: the
    // reservations converge to 1.3 × the estimate.
    let learned = pacer.input_ratios("p");
    assert_eq!(learned.len(), 1, "{learned:?}");
    assert_eq!(learned[0].model, "gpt-4o");
    assert!(learned[0].samples >= 8, "{learned:?}");
    assert!((learned[0].ratio - 1.3).abs() < 0.01, "{learned:?}");
    assert!((learned[0].factor - 1.3).abs() < 0.01, "{learned:?}");
    // And /limits shows it.
    let shown = pacer.limits_json().await;
    assert_eq!(
        shown["providers"]["p"]["inputRatios"][0]["model"], "gpt-4o",
        "{shown}"
    );

    // The same burst again, and again, once the window is empty: not one
    // 429, and the provider's window is filled to within one request.
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_secs(120)).await;
        let before = sim.stats().violations;
        let again = burst(&client, n).await;
        assert!(again.iter().all(|s| *s == StatusCode::OK), "{again:?}");
        assert_eq!(sim.stats().violations, before);
    }
    // (The fresh burst's 429 held the key for its Retry-After; the learned
    // ones drew none.)
    assert_eq!(pacer.stats("p").upstream_429, refused as u64);
    let worst = sim.stats().worst_window_tokens;
    assert!(worst <= 6_000 && worst > 5_400, "{worst}");
}

// ---------------------------------------------------------------------------
// The knobs real providers differ in (issue 42).
// ---------------------------------------------------------------------------

fn quick(cfg: SimulatorConfig) -> (TokioClock, SimService) {
    let clock = TokioClock::at(TEST_EPOCH);
    let sim = SimService::new(
        SimulatorConfig {
            latency: Duration::ZERO,
            completion_tokens: 1,
            ..cfg
        },
        Arc::new(clock),
    );
    (clock, sim)
}

fn prompt_tokens(b: &Bytes) -> u64 {
    let j: Value = serde_json::from_slice(b).unwrap();
    j["usage"]["prompt_tokens"].as_u64().unwrap()
}

#[tokio::test(start_paused = true)]
async fn simulator_counts_its_own_per_message_overhead_and_tokenizer_drift() {
    let three = json!({"model":"gpt-4o","max_tokens":1,"messages":[
        {"role":"system","content":" tok".repeat(100)},
        {"role":"user","content":" tok".repeat(100)},
        {"role":"user","content":" tok".repeat(100)}]});
    let (_, mut plain) = quick(SimulatorConfig::default());
    let base = prompt_tokens(
        &send(&mut plain, post("/v1/chat/completions", three.clone()))
            .await
            .2,
    );
    let (_, mut over) = quick(SimulatorConfig {
        message_overhead: 9,
        ..SimulatorConfig::default()
    });
    let b = send(&mut over, post("/v1/chat/completions", three.clone()))
        .await
        .2;
    assert_eq!(prompt_tokens(&b), base + 27);
    let (_, mut both) = quick(SimulatorConfig {
        message_overhead: -1_000,
        ..SimulatorConfig::default()
    });
    // Never below 0.
    let b = send(&mut both, post("/v1/chat/completions", three.clone()))
        .await
        .2;
    assert_eq!(prompt_tokens(&b), 0);
    let (_, mut drift) = quick(SimulatorConfig {
        prompt_percent: 85,
        message_overhead: 2,
        ..SimulatorConfig::default()
    });
    let b = send(&mut drift, post("/v1/chat/completions", three))
        .await
        .2;
    assert_eq!(prompt_tokens(&b), base * 85 / 100 + 6);
}

#[tokio::test(start_paused = true)]
async fn simulator_counts_a_request_when_it_arrives_after_its_delay_and_jitter() {
    let (clock, mut sim) = quick(SimulatorConfig {
        tpm: 0,
        arrival_delay: Duration::from_millis(300),
        arrival_jitter: Duration::from_millis(200),
        seed: 42,
        ..SimulatorConfig::default()
    });
    let mut delays = Vec::new();
    for _ in 0..20 {
        let sent = clock.now();
        assert_eq!(
            send(&mut sim, post("/v1/chat/completions", chat(1)))
                .await
                .0,
            StatusCode::OK
        );
        let arrived = sim.arrivals().last().unwrap().0;
        delays.push(arrived.saturating_since(sent));
    }
    assert!(
        delays
            .iter()
            .all(|d| *d >= Duration::from_millis(300) && *d <= Duration::from_millis(500)),
        "{delays:?}"
    );
    // Jittered: not all the same.
    assert!(delays.iter().any(|d| *d != delays[0]), "{delays:?}");
}

#[tokio::test(start_paused = true)]
async fn simulator_enforces_rpm_over_sub_minute_slices_as_azure_does() {
    // 120 RPM over 1 s slices: 2 a second, whatever the minute leaves.
    let (_, mut sim) = quick(SimulatorConfig {
        tpm: 0,
        rpm: 120,
        rpm_slice: Duration::from_secs(1),
        ..SimulatorConfig::default()
    });
    for _ in 0..2 {
        assert_eq!(
            send(&mut sim, post("/v1/chat/completions", chat(1)))
                .await
                .0,
            StatusCode::OK
        );
    }
    let (s, h, b) = send(&mut sim, post("/v1/chat/completions", chat(1))).await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        classify(s, &h, Some(&b)),
        Retryable::Yes {
            hint: Some(Duration::from_secs(1))
        }
    );
    assert_eq!(sim.stats().slice_violations, 1);
    tokio::time::advance(Duration::from_millis(999)).await;
    assert_eq!(
        send(&mut sim, post("/v1/chat/completions", chat(1)))
            .await
            .0,
        StatusCode::TOO_MANY_REQUESTS
    );
    tokio::time::advance(Duration::from_millis(1)).await;
    assert_eq!(
        send(&mut sim, post("/v1/chat/completions", chat(1)))
            .await
            .0,
        StatusCode::OK
    );
    // 10 s slices: 20 per 10 s.
    let (_, mut ten) = quick(SimulatorConfig {
        tpm: 0,
        rpm: 120,
        rpm_slice: Duration::from_secs(10),
        ..SimulatorConfig::default()
    });
    for _ in 0..20 {
        assert_eq!(
            send(&mut ten, post("/v1/chat/completions", chat(1)))
                .await
                .0,
            StatusCode::OK
        );
    }
    assert_eq!(
        send(&mut ten, post("/v1/chat/completions", chat(1)))
            .await
            .0,
        StatusCode::TOO_MANY_REQUESTS
    );
}

#[tokio::test(start_paused = true)]
async fn simulator_anchors_a_fixed_minute_at_an_arrival() {
    let (clock, mut sim) = quick(SimulatorConfig {
        tpm: 0,
        rpm: 2,
        anchored: true,
        ..SimulatorConfig::default()
    });
    // The minute opens at the first arrival, t = 0.
    assert_eq!(
        send(&mut sim, post("/v1/chat/completions", chat(1)))
            .await
            .0,
        StatusCode::OK
    );
    tokio::time::advance(Duration::from_secs(50)).await;
    let (s, h, _) = send(&mut sim, post("/v1/chat/completions", chat(1))).await;
    assert_eq!(s, StatusCode::OK);
    // Both leave together when the minute closes, 10 s from now.
    let learned = RateLimitHeaders::parse(&h, clock.now());
    assert_eq!(learned.requests.reset, Some(Duration::from_secs(10)));
    tokio::time::advance(Duration::from_millis(9_999)).await;
    assert_eq!(
        send(&mut sim, post("/v1/chat/completions", chat(1)))
            .await
            .0,
        StatusCode::TOO_MANY_REQUESTS
    );
    tokio::time::advance(Duration::from_millis(1)).await;
    // A rolling minute would still count the one at t = 50 s: here it is gone.
    assert_eq!(
        send(&mut sim, post("/v1/chat/completions", chat(1)))
            .await
            .0,
        StatusCode::OK
    );
    assert_eq!(
        send(&mut sim, post("/v1/chat/completions", chat(1)))
            .await
            .0,
        StatusCode::OK
    );
    assert_eq!(
        send(&mut sim, post("/v1/chat/completions", chat(1)))
            .await
            .0,
        StatusCode::TOO_MANY_REQUESTS
    );
}

#[tokio::test(start_paused = true)]
async fn simulator_without_headers_says_when_only_in_the_429_body() {
    let (_, mut sim) = quick(SimulatorConfig {
        tpm: 0,
        rpm: 1,
        headers: false,
        ..SimulatorConfig::default()
    });
    let (s, h, _) = send(&mut sim, post("/v1/chat/completions", chat(1))).await;
    assert_eq!(s, StatusCode::OK);
    assert!(h.keys().all(|k| !k.as_str().contains("ratelimit")), "{h:?}");
    let (s, h, b) = send(
        &mut sim,
        post(
            "/v1/messages",
            json!({"model":"claude","max_tokens":1,"messages":[{"role":"user","content":"hi"}]}),
        ),
    )
    .await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS);
    assert!(h.get("retry-after").is_none() && h.keys().all(|k| !k.as_str().contains("ratelimit")));
    assert_eq!(
        classify(s, &h, Some(&b)),
        Retryable::Yes {
            hint: Some(Duration::from_secs(60))
        }
    );
}

#[test]
fn simulator_best_schedule_follows_the_rows_rules() {
    use sluice_client::simulator::{ScheduleItem, best_schedule};
    // Ten requests of 100 tokens at t = 0, TPM 500: five go at once, five a
    // minute later (rolling) — or, anchored, when the minute closes.
    let items: Vec<ScheduleItem> = (0..10)
        .map(|_| ScheduleItem {
            at: Duration::ZERO,
            model: "gpt-4o".into(),
            input: 50,
            budget: 50,
            output: 50,
            latency: Duration::from_secs(1),
        })
        .collect();
    let cfg = SimulatorConfig {
        tpm: 500,
        rpm: 0,
        ..SimulatorConfig::default()
    };
    let by = |secs: u64, cfg: SimulatorConfig| {
        best_schedule(&[cfg], &[], &items, Duration::from_secs(secs), true).requests
    };
    assert_eq!(by(30, cfg), 5);
    assert_eq!(by(62, cfg), 10);
    // RPM 120 lets all ten go at once; in 1 s slices, two a second (those
    // sent at 0, 1 and 2 s are done by 3 s).
    let minute = SimulatorConfig {
        tpm: 0,
        rpm: 120,
        ..SimulatorConfig::default()
    };
    assert_eq!(by(3, minute), 10);
    let sliced = SimulatorConfig {
        rpm_slice: Duration::from_secs(1),
        ..minute
    };
    assert_eq!(by(3, sliced), 6);
    // Arriving 10 s late, nothing is done by 10 s.
    let late = SimulatorConfig {
        arrival_delay: Duration::from_secs(10),
        ..cfg
    };
    assert_eq!(by(10, late), 0);
    assert_eq!(by(12, late), 5);
}
