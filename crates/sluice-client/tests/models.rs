//! Providers' real limits on paused tokio time (SPEC M1–M4): per-model
//! budgets beside the provider-wide ones, input and output apart,
//! priorities, several keys.
#![allow(clippy::unwrap_used)]

use crate::support;

use std::time::Duration;

use http::{HeaderMap, HeaderValue};
use sluice_client::AcquireOptions;
use sluice_client::config::{ModelLimits, ProviderLimits};
use sluice_client::tokens::TokenEstimate;
use sluice_core::Clock;
use support::*;

/// Lets paused time run for `d` in steps of 50 ms, so that every sleeper
/// wakes at its own instant.
async fn run_for(d: Duration) {
    let step = Duration::from_millis(50);
    let mut t = Duration::ZERO;
    while t < d {
        tokio::time::advance(step).await;
        for _ in 0..5 {
            tokio::task::yield_now().await;
        }
        t += step;
    }
}

fn ask(prompt: u32, completion: u32) -> TokenEstimate {
    TokenEstimate { prompt, completion }
}

fn model(m: &str) -> AcquireOptions {
    AcquireOptions::default().model(m)
}

/// Whether a request for `m` of `tokens` would go now: tries it with a
/// zero maximum wait on a clone of the situation (an acquire that does not
/// finish within `within` of paused time).
async fn goes_within(
    pacer: &TestPacer,
    opts: AcquireOptions,
    prompt: u32,
    completion: u32,
    within: Duration,
) -> bool {
    let p = pacer.clone();
    let task = tokio::spawn(async move {
        let mut a = ask(prompt, completion);
        p.acquire_with("p", &mut a, &opts).await.unwrap()
    });
    for _ in 0..20 {
        tokio::task::yield_now().await;
    }
    if !within.is_zero() {
        tokio::time::advance(within).await;
        for _ in 0..20 {
            tokio::task::yield_now().await;
        }
    }
    let done = task.is_finished();
    task.abort();
    done
}

#[tokio::test(start_paused = true)]
async fn m1_a_model_is_paced_by_its_own_limits_and_by_the_provider_wide_ones() {
    let p = provider("p", limits(3_000, 0, 0)).with_models([
        ModelLimits::new("gpt-4o", ProviderLimits::new(1_000, 0, 0)),
        ModelLimits::new("gpt-4o-mini*", ProviderLimits::new(2_500, 0, 0)),
    ]);
    let (pacer, _clock) = pacer_with([p]);
    let big = pacer
        .acquire_with("p", &mut ask(500, 300), &model("gpt-4o"))
        .await
        .unwrap();
    assert_eq!(big.group(), Some("gpt-4o"));
    // gpt-4o's own 1,000 a minute hold the next one...
    assert!(!goes_within(&pacer, model("gpt-4o"), 300, 0, Duration::ZERO).await);
    // ...but not another model: 800 + 2,000 fit the provider's 3,000.
    let mini = pacer
        .acquire_with("p", &mut ask(1_500, 500), &model("gpt-4o-mini-2024-07-18"))
        .await
        .unwrap();
    assert_eq!(mini.waited(), Duration::ZERO);
    assert_eq!(mini.group(), Some("gpt-4o-mini*"));
    // 400 more for the mini fit its own 2,500 but not the provider's 3,000.
    assert!(!goes_within(&pacer, model("gpt-4o-mini"), 400, 0, Duration::ZERO).await);
    assert!(goes_within(&pacer, model("gpt-4o-mini"), 200, 0, Duration::ZERO).await);
    assert_eq!(
        pacer.model_tokens("p", "gpt-4o").await.unwrap().0,
        800,
        "the model's own window"
    );
}

#[tokio::test(start_paused = true)]
async fn m1_models_of_one_shared_group_spend_one_budget() {
    let small = ProviderLimits::new(1_000, 0, 0);
    let p = provider("p", limits(0, 0, 0)).with_models([
        ModelLimits::new("gpt-4o-mini*", small).shared("small"),
        ModelLimits::new("gpt-3.5*", small).shared("small"),
    ]);
    let (pacer, _clock) = pacer_with([p]);
    let a = pacer
        .acquire_with("p", &mut ask(700, 0), &model("gpt-3.5-turbo"))
        .await
        .unwrap();
    assert_eq!(a.group(), Some("small"));
    assert!(!goes_within(&pacer, model("gpt-4o-mini"), 400, 0, Duration::ZERO).await);
    assert!(goes_within(&pacer, model("gpt-4o-mini"), 300, 0, Duration::ZERO).await);
}

#[tokio::test(start_paused = true)]
async fn m1_a_request_naming_no_model_goes_by_the_provider_wide_limits() {
    let p = provider("p", limits(2_000, 0, 0))
        .with_models([ModelLimits::new("gpt-4o", ProviderLimits::new(500, 0, 0))]);
    let (pacer, _clock) = pacer_with([p]);
    // No model, and a model no entry covers: the provider's 2,000 only.
    let none = pacer.acquire("p", 900u32).await.unwrap();
    assert_eq!(none.group(), None);
    let other = pacer
        .acquire_with("p", &mut ask(900, 0), &model("o1"))
        .await
        .unwrap();
    assert_eq!(other.group(), None);
    assert_eq!(other.waited(), Duration::ZERO);
    // Both spent the provider-wide window, which now holds gpt-4o too.
    assert!(!goes_within(&pacer, model("gpt-4o"), 300, 0, Duration::ZERO).await);
    assert!(goes_within(&pacer, model("gpt-4o"), 200, 0, Duration::ZERO).await);
}

#[tokio::test(start_paused = true)]
async fn m1_limits_learned_from_headers_are_per_model() {
    let p = provider("p", limits(0, 0, 0)).with_models([
        ModelLimits::new("a", ProviderLimits::new(10_000, 100, 0)),
        ModelLimits::new("b", ProviderLimits::new(10_000, 100, 0)),
    ]);
    let (pacer, clock) = pacer_with([p]);
    let permit = pacer
        .acquire_with("p", &mut ask(100, 0), &model("a"))
        .await
        .unwrap();
    // The answer for `a` says: no request left for 10 s, 6,000 tokens used
    // (another client on the same key).
    let mut h = HeaderMap::new();
    for (k, v) in [
        ("x-ratelimit-limit-requests", "100"),
        ("x-ratelimit-remaining-requests", "0"),
        ("x-ratelimit-reset-requests", "10s"),
        ("x-ratelimit-limit-tokens", "10000"),
        ("x-ratelimit-remaining-tokens", "4000"),
        ("x-ratelimit-reset-tokens", "36s"),
    ] {
        h.insert(k, HeaderValue::from_static(v));
    }
    permit.observe(&h).await.unwrap();
    assert_eq!(pacer.model_tokens("p", "a").await.unwrap().0, 6_000);
    assert_eq!(pacer.model_tokens("p", "b").await.unwrap().0, 0);
    // `b` goes at once; `a` waits for the reset the headers named.
    let b = pacer
        .acquire_with("p", &mut ask(100, 0), &model("b"))
        .await
        .unwrap();
    assert_eq!(b.waited(), Duration::ZERO);
    let start = clock.now();
    let p2 = pacer.clone();
    let a = tokio::spawn(async move {
        p2.acquire_with("p", &mut ask(100, 0), &model("a"))
            .await
            .unwrap()
            .waited()
    });
    for _ in 0..20 {
        tokio::task::yield_now().await;
    }
    assert!(!a.is_finished(), "`a` went during its hold");
    tokio::time::advance(Duration::from_secs(11)).await;
    let waited = a.await.unwrap();
    assert!(
        waited >= Duration::from_secs(10) - Duration::from_millis(1),
        "{waited:?}"
    );
    assert!(clock.now().saturating_since(start) >= Duration::from_secs(10));
}

fn io_provider(itpm: u32, otpm: u32) -> sluice_client::config::ProviderConfig {
    let mut p = provider("p", ProviderLimits::new(0, 0, 0).with_io(itpm, otpm));
    p.style = sluice_client::config::ApiStyle::Anthropic;
    p
}

#[tokio::test(start_paused = true)]
async fn m2_input_and_output_are_separate_axes_and_the_completion_budget_spends_output() {
    let (pacer, _clock) = pacer_with([io_provider(1_000, 500)]);
    let first = pacer.acquire("p", ask(800, 400)).await.unwrap();
    assert_eq!(first.tokens(), 1_200, "more than either axis alone");
    assert_eq!(
        pacer.model_tokens("p", "any").await.unwrap(),
        (0, 800, 400),
        "no TPM counted, input and output apart"
    );
    // Output is full: 200 more wait though the input has room...
    let opts = AcquireOptions::default;
    assert!(!goes_within(&pacer, opts(), 100, 200, Duration::ZERO).await);
    // ...and input is what limits a long prompt with a small completion.
    assert!(!goes_within(&pacer, opts(), 300, 50, Duration::ZERO).await);
    assert!(goes_within(&pacer, opts(), 150, 100, Duration::ZERO).await);
    // A completion budget above the whole OTPM can never go.
    let e = pacer.acquire("p", ask(10, 501)).await.unwrap_err();
    assert!(
        matches!(e, sluice_client::PaceError::TooLarge { .. }),
        "{e}"
    );
}

#[tokio::test(start_paused = true)]
async fn m2_the_answer_s_usage_reconciles_both_axes_and_cache_reads_do_not_count() {
    let (pacer, _clock) = pacer_with([io_provider(10_000, 2_000)]);
    let permit = pacer.acquire("p", ask(6_000, 1_000)).await.unwrap();
    // Anthropic's answer: 4,000 read from the cache (not counted toward
    // input), 100 new input, 50 written to the cache, 120 generated.
    let answer = serde_json::json!({"usage": {
        "input_tokens": 100, "cache_read_input_tokens": 4_000,
        "cache_creation_input_tokens": 50, "output_tokens": 120}});
    let usage = sluice_client::usage::usage_from_json(&answer).unwrap();
    assert_eq!((usage.rate_limited_input(), usage.completion), (150, 120));
    permit.reconcile_usage(usage).await.unwrap();
    assert_eq!(pacer.model_tokens("p", "any").await.unwrap(), (0, 150, 120));
    // The room given back is usable at once on both axes.
    let next = pacer.acquire("p", ask(9_800, 1_800)).await.unwrap();
    assert_eq!(next.waited(), Duration::ZERO);
    // A total-only reconcile keeps the input as reserved, the rest output.
    next.reconcile(9_900).await.unwrap();
    assert_eq!(
        pacer.model_tokens("p", "any").await.unwrap(),
        (0, 150 + 9_800, 120 + 100)
    );
}

fn batch() -> AcquireOptions {
    AcquireOptions::default().priority(sluice_client::Priority::Batch)
}

#[tokio::test(start_paused = true)]
async fn m3_batch_uses_only_what_interactive_leaves_and_never_delays_one_that_could_go() {
    let (pacer, clock) = pacer_with([provider("p", limits(1_000, 0, 0))]);
    // Interactive traffic of 200 in the window: batch requests leave it
    // that much again, plus its largest request (room for the next one).
    pacer.acquire("p", 200u32).await.unwrap();
    // (Those 200 tokens are 12.2 s of the budget's rate: batch tokens go
    // 3 s ahead of the pace of all tokens at most.)
    tokio::time::advance(Duration::from_secs(10)).await;
    // A batch request that fits what interactive ones leave goes now...
    let b = pacer
        .acquire_with("p", &mut ask(300, 0), &batch())
        .await
        .unwrap();
    assert_eq!(b.waited(), Duration::ZERO);
    assert_eq!(pacer.stats("p").batch, 1);
    // ...one that would eat into their room waits (500 + 200 > 1,000 - 400)...
    let p2 = pacer.clone();
    let waiting_batch = tokio::spawn(async move {
        let permit = p2
            .acquire_with("p", &mut ask(200, 0), &batch())
            .await
            .unwrap();
        permit.decided_at()
    });
    for _ in 0..20 {
        tokio::task::yield_now().await;
    }
    assert!(!waiting_batch.is_finished());
    // ...and the next interactive request goes at once: nothing batch took
    // delays it.
    let i = pacer.acquire("p", 200u32).await.unwrap();
    assert_eq!(i.waited(), Duration::ZERO);
    // The batch request goes once the interactive tokens leave the window
    // (71.25 s: their slot's end + 60 s + the arrival margin).
    tokio::time::advance(Duration::from_secs(62)).await;
    let went = waiting_batch.await.unwrap();
    assert!(
        went >= at(71_250) && went <= at(72_000),
        "{}",
        ms_since_epoch(went)
    );
    let _ = clock;
}

#[tokio::test(start_paused = true)]
async fn m3_interactive_tokens_count_toward_the_batch_pace() {
    // 6,000 a minute: 98.4 tokens a second over the 61 s window.
    let mut p = provider("p", limits(6_000, 0, 0));
    p.max_wait = Duration::from_secs(300);
    let (pacer, _clock) = pacer_with([p]);
    // 1,000 interactive tokens are 10.17 s of the budget's rate: a batch
    // request goes no sooner than 3 s before they are paid for, though the
    // window has room for it (so that the window fills no faster than it
    // empties, and room never comes back with a gap in it).
    let interactive = pacer.acquire("p", 1_000u32).await.unwrap();
    let p2 = pacer.clone();
    let waiting_batch = tokio::spawn(async move {
        let permit = p2
            .acquire_with("p", &mut ask(100, 0), &batch())
            .await
            .unwrap();
        permit.decided_at()
    });
    run_for(Duration::from_secs(5)).await;
    assert!(!waiting_batch.is_finished());
    // The answer gives 600 tokens back: 6.1 s of the pace, so the batch
    // request is in time now and goes at once.
    interactive.reconcile(400).await.unwrap();
    run_for(Duration::from_millis(100)).await;
    assert!(waiting_batch.is_finished());
    let went = waiting_batch.await.unwrap();
    assert!(
        went >= at(5_000) && went <= at(5_100),
        "{}",
        ms_since_epoch(went)
    );
}

#[tokio::test(start_paused = true)]
async fn m3_paced_batch_without_a_give_back_waits_for_the_pace() {
    let mut p = provider("p", limits(6_000, 0, 0));
    p.max_wait = Duration::from_secs(300);
    let (pacer, _clock) = pacer_with([p]);
    let _interactive = pacer.acquire("p", 1_000u32).await.unwrap();
    let b = pacer
        .acquire_with("p", &mut ask(100, 0), &batch())
        .await
        .unwrap();
    // 1,000 × 61 s / 6,000 = 10.167 s, less the 3 s a batch token may go
    // ahead of the pace.
    let went = ms_since_epoch(b.decided_at());
    assert!((7_150..=7_200).contains(&went), "{went}");
}

#[tokio::test(start_paused = true)]
async fn m3_interactive_requests_go_first_when_both_wait() {
    // Batch requests may wait long: the interactive one's tokens keep them
    // out of the window until those leave it.
    let mut p = provider("p", limits(1_000, 0, 0));
    p.max_wait = Duration::from_secs(300);
    let (pacer, _clock) = pacer_with([p]);
    // Batch fills the window (no interactive traffic: it may take all).
    let full = pacer
        .acquire_with("p", &mut ask(1_000, 0), &batch())
        .await
        .unwrap();
    assert_eq!(full.waited(), Duration::ZERO);
    let order = std::sync::Arc::new(parking_lot::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    // A batch request arrives first, an interactive one after it.
    for (name, opts) in [
        ("batch", batch()),
        ("interactive", AcquireOptions::default()),
    ] {
        let p = pacer.clone();
        let o = order.clone();
        tasks.push(tokio::spawn(async move {
            let permit = p.acquire_with("p", &mut ask(600, 0), &opts).await.unwrap();
            o.lock().push((name, permit.decided_at()));
        }));
        for _ in 0..20 {
            tokio::task::yield_now().await;
        }
    }
    run_for(Duration::from_secs(200)).await;
    for t in tasks {
        t.await.unwrap();
    }
    let order = order.lock().clone();
    assert_eq!(order[0].0, "interactive", "{order:?}");
    assert_eq!(order[0].1, at(61_250));
    assert_eq!(order[1].0, "batch");
    // It goes when the interactive tokens leave: 61.25 s later.
    assert_eq!(order[1].1, at(122_500));
}

fn keyed(keys: &[(&str, u32)]) -> sluice_client::config::ProviderConfig {
    use sluice_client::config::ApiKey;
    provider("p", limits(0, 0, 0)).with_api_keys(
        keys.iter()
            .map(|(name, tpm)| ApiKey::new(name, &format!("sk-{name}"), limits(*tpm, 0, 0))),
    )
}

#[tokio::test(start_paused = true)]
async fn m4_a_request_goes_to_the_key_that_can_send_it_soonest() {
    let (pacer, _clock) = pacer_with([keyed(&[("one", 1_000), ("two", 2_000)])]);
    let key_of = |p: &sluice_client::Permit| p.key_name().map(str::to_owned);
    let a = pacer.acquire("p", 900u32).await.unwrap();
    assert_eq!(key_of(&a).as_deref(), Some("one"));
    let b = pacer.acquire("p", 900u32).await.unwrap();
    assert_eq!(key_of(&b).as_deref(), Some("two"), "one is full");
    tokio::time::advance(Duration::from_secs(10)).await;
    let c = pacer.acquire("p", 900u32).await.unwrap();
    assert_eq!(key_of(&c).as_deref(), Some("two"));
    assert_eq!(c.waited(), Duration::ZERO);
    // Both full: the next goes with the key whose room comes first — `one`,
    // whose 900 leave at 61.25 s (`two` holds 900 more until 71.25 s).
    let p2 = pacer.clone();
    let d = tokio::spawn(async move {
        let permit = p2.acquire("p", 900u32).await.unwrap();
        (permit.key_name().map(str::to_owned), permit.decided_at())
    });
    run_for(Duration::from_secs(60)).await;
    let (key, when) = d.await.unwrap();
    assert_eq!((key.as_deref(), when), (Some("one"), at(61_250)));
}

#[tokio::test(start_paused = true)]
async fn m4_a_429_cooldown_on_one_key_does_not_stop_the_others() {
    use bytes::Bytes;
    use http_body_util::{BodyExt, Full};
    use tower::{ServiceBuilder, ServiceExt};

    let (pacer, clock) = pacer_with([keyed(&[("one", 10_000), ("two", 10_000)])]);
    // The provider refuses key `one` for 30 s; `two` answers.
    let seen = std::sync::Arc::new(parking_lot::Mutex::new(Vec::new()));
    let s = seen.clone();
    let upstream = tower::service_fn(move |req: http::Request<Full<Bytes>>| {
        let key = req.headers()["authorization"].to_str().unwrap().to_owned();
        s.lock().push(key.clone());
        async move {
            let r = if key == "Bearer sk-one" {
                http::Response::builder()
                    .status(429)
                    .header("retry-after", "30")
                    .body(Full::new(Bytes::from_static(b"{}")))
            } else {
                http::Response::builder().body(Full::new(Bytes::from_static(
                    br#"{"usage":{"prompt_tokens":5,"completion_tokens":5}}"#,
                )))
            };
            Ok::<_, std::convert::Infallible>(r.unwrap())
        }
    });
    let client = ServiceBuilder::new()
        .layer(sluice_client::PacerLayer::new(pacer.clone(), "p"))
        .service(upstream);
    let start = clock.now();
    for _ in 0..3 {
        let req = http::Request::post("http://x/v1/chat/completions")
            .body(Full::new(Bytes::from_static(
                br#"{"model":"m","max_tokens":10,"messages":[{"role":"user","content":"hi"}]}"#,
            )))
            .unwrap();
        let r = client.clone().oneshot(req).await.unwrap();
        assert_eq!(r.status(), 200);
        let _ = r.into_body().collect().await.unwrap();
    }
    // One 429 on `one`, then everything on `two`, at once: no wait for
    // `one`'s 30 s.
    assert_eq!(
        *seen.lock(),
        [
            "Bearer sk-one",
            "Bearer sk-two",
            "Bearer sk-two",
            "Bearer sk-two"
        ]
    );
    assert!(clock.now().saturating_since(start) < Duration::from_secs(1));
    assert_eq!(pacer.stats("p").upstream_429, 1);
    // Keys never show: /limits (and `sluice check`) name them only.
    let shown = pacer.limits_json().await.to_string();
    assert!(
        shown.contains("\"one\"") && !shown.contains("sk-one"),
        "{shown}"
    );
    let debug = format!("{:?}", pacer.config());
    assert!(
        !debug.contains("sk-one") && !debug.contains("sk-two"),
        "{debug}"
    );
}
