//! The tower layer on paused time: every Retry-After form, what is never
//! retried, idempotency keys, reconciliation from a streamed answer.
#![allow(clippy::unwrap_used)]

use crate::support;

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use sluice_client::shrink::SHRINK_HEADER;
use sluice_client::{IDEMPOTENCY_KEY, PaceError, PacerLayer};
use sluice_core::{Clock, Timestamp};
use support::*;
use tower::{Layer, Service, ServiceExt};

type Seen = Arc<parking_lot::Mutex<Vec<(Timestamp, Option<String>, Bytes)>>>;

/// A provider that answers from a script and records each call.
fn scripted(
    clock: sluice_client::TokioClock,
    script: Vec<Response<Full<Bytes>>>,
) -> (
    impl Service<
        Request<Full<Bytes>>,
        Response = Response<Full<Bytes>>,
        Error = std::convert::Infallible,
        Future = impl Send,
    > + Clone
    + Send
    + 'static,
    Seen,
) {
    let script = Arc::new(parking_lot::Mutex::new(VecDeque::from(script)));
    let seen: Seen = Arc::default();
    let s2 = seen.clone();
    let svc = tower::service_fn(move |req: Request<Full<Bytes>>| {
        let script = script.clone();
        let seen = s2.clone();
        async move {
            let key = req
                .headers()
                .get(IDEMPOTENCY_KEY)
                .map(|v| v.to_str().unwrap().to_owned());
            let body = req.into_body().collect().await.unwrap().to_bytes();
            seen.lock().push((clock.now(), key, body));
            let r = script.lock().pop_front().unwrap_or_else(|| ok(10, 5));
            Ok::<_, std::convert::Infallible>(r)
        }
    });
    (svc, seen)
}

async fn send<S>(svc: &mut S, req: Request<Full<Bytes>>) -> Result<S::Response, S::Error>
where
    S: Service<Request<Full<Bytes>>>,
{
    ServiceExt::<Request<Full<Bytes>>>::ready(svc)
        .await?
        .call(req)
        .await
}

fn ok(prompt: u32, completion: u32) -> Response<Full<Bytes>> {
    let body = format!(
        r#"{{"choices":[{{"message":{{"role":"assistant","content":"hi"}}}}],"usage":{{"prompt_tokens":{prompt},"completion_tokens":{completion}}}}}"#
    );
    Response::builder()
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .unwrap()
}

fn status(code: u16, headers: &[(&str, &str)], body: &str) -> Response<Full<Bytes>> {
    let mut b = Response::builder()
        .status(code)
        .header("content-type", "application/json");
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    b.body(Full::new(Bytes::from(body.to_owned()))).unwrap()
}

fn chat() -> Request<Full<Bytes>> {
    Request::post("http://provider.test/v1/chat/completions")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(
            br#"{"model":"gpt-4o","messages":[{"role":"user","content":"hello"}],"max_tokens":20}"#,
        )))
        .unwrap()
}

async fn retried_after(
    first: Response<Full<Bytes>>,
) -> (
    Duration,
    Vec<(Timestamp, Option<String>, Bytes)>,
    StatusCode,
) {
    let (pacer, clock) = pacer(limits(100_000, 0, 0));
    let (svc, seen) = scripted(clock, vec![first, ok(10, 5)]);
    let mut svc = PacerLayer::new(pacer, "p").layer(svc);
    let resp = send(&mut svc, chat()).await.unwrap();
    let status = resp.status();
    let seen = seen.lock().clone();
    let gap = if seen.len() > 1 {
        seen[1].0.saturating_since(seen[0].0)
    } else {
        Duration::ZERO
    };
    (gap, seen, status)
}

#[tokio::test(start_paused = true)]
async fn c5_retry_after_ms_header() {
    let (gap, seen, s) = retried_after(status(429, &[("retry-after-ms", "1500")], "{}")).await;
    assert_eq!((s, seen.len()), (StatusCode::OK, 2));
    assert_eq!(gap, Duration::from_millis(1500));
}

#[tokio::test(start_paused = true)]
async fn c5_retry_after_seconds_header() {
    let (gap, _, s) = retried_after(status(429, &[("retry-after", "7")], "{}")).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(gap, Duration::from_secs(7));
}

#[tokio::test(start_paused = true)]
async fn c5_retry_after_http_date() {
    let date = httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(4));
    let (gap, _, s) = retried_after(status(503, &[("retry-after", &date)], "{}")).await;
    assert_eq!(s, StatusCode::OK);
    // An HTTP date has whole seconds.
    assert!(
        gap > Duration::from_secs(2) && gap <= Duration::from_secs(4),
        "{gap:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn c5_openai_style_body_hint() {
    let body = r#"{"error":{"message":"Rate limit reached for gpt-4o in organization org-x on tokens per min (TPM): Limit 30000, Used 29000, Requested 2000. Please try again in 16.062s. Visit https://platform.openai.com/account/rate-limits to learn more.","type":"tokens","param":null,"code":"rate_limit_exceeded"}}"#;
    let (gap, _, s) = retried_after(status(429, &[], body)).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(gap, Duration::from_millis(16_062));
}

#[tokio::test(start_paused = true)]
async fn c5_details_retry_after_seconds() {
    let body = r#"{"error":{"code":"rate_limited","message":"busy","details":{"retry_after_seconds":12}}}"#;
    let (gap, _, _) = retried_after(status(429, &[], body)).await;
    assert_eq!(gap, Duration::from_secs(12));
}

#[tokio::test(start_paused = true)]
async fn c5_no_hint_backs_off_at_least_a_second_with_one_idempotency_key() {
    let (gap, seen, s) = retried_after(status(502, &[], "bad gateway")).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(
        gap,
        Duration::from_secs(1),
        "first backoff: full jitter over [0, 1 s], floored at 1 s"
    );
    let k0 = seen[0].1.clone().unwrap();
    assert!(k0.starts_with("sluice-"));
    assert_eq!(
        seen[1].1.as_deref(),
        Some(k0.as_str()),
        "same key on the retry"
    );
    assert_eq!(seen[0].2, seen[1].2, "same body on the retry");
}

#[tokio::test(start_paused = true)]
async fn c5_never_retries_insufficient_quota_400_401() {
    for first in [
        status(
            429,
            &[("retry-after", "1")],
            r#"{"error":{"message":"You exceeded your current quota","type":"insufficient_quota","code":"insufficient_quota"}}"#,
        ),
        status(400, &[], r#"{"error":{"message":"bad"}}"#),
        status(401, &[], r#"{"error":{"message":"no key"}}"#),
    ] {
        let code = first.status();
        let (_, seen, s) = retried_after(first).await;
        assert_eq!((s, seen.len()), (code, 1));
    }
}

#[tokio::test(start_paused = true)]
async fn c5_attempts_are_bounded() {
    let (pacer, clock) = pacer(limits(100_000, 0, 0));
    let script = (0..10).map(|_| status(503, &[], "{}")).collect();
    let (svc, seen) = scripted(clock, script);
    let mut svc = PacerLayer::new(pacer.clone(), "p").layer(svc);
    let resp = send(&mut svc, chat()).await.unwrap();
    assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(seen.lock().len(), 5);
    assert_eq!(pacer.stats("p").retries, 4);
    // Every backoff within [1 s, 60 s].
    let times: Vec<_> = seen.lock().iter().map(|s| s.0).collect();
    for w in times.windows(2) {
        let g = w[1].saturating_since(w[0]);
        assert!(
            g >= Duration::from_secs(1) && g <= Duration::from_secs(60),
            "{g:?}"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn c6_streamed_usage_in_the_last_chunk_reconciles() {
    let (pacer, clock) = pacer(limits(100_000, 0, 0));
    let sse = concat!(
        "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n",
        "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":3}}\n\n",
        "data: [DONE]\n\n",
    );
    let answer = Response::builder()
        .header("content-type", "text/event-stream")
        .body(Full::new(Bytes::from_static(sse.as_bytes())))
        .unwrap();
    let (svc, _) = scripted(clock, vec![answer]);
    let mut svc = PacerLayer::new(pacer.clone(), "p").layer(svc);
    let resp = send(&mut svc, chat()).await.unwrap();
    // Reserved: the prompt estimate + max_tokens 20.
    let reserved = pacer.tokens_in_window("p").await.unwrap();
    assert!(reserved > 20);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], sse.as_bytes(), "passed through unchanged");
    for _ in 0..5 {
        tokio::task::yield_now().await;
    }
    assert_eq!(pacer.tokens_in_window("p").await.unwrap(), 12);
}

#[tokio::test(start_paused = true)]
async fn c4_layer_errors_at_once_and_marks_shrunk_answers() {
    let (pacer, clock) = pacer(limits(5, 0, 0));
    let (svc, seen) = scripted(clock, vec![]);
    let mut svc = PacerLayer::new(pacer, "p").layer(svc);
    let e = send(&mut svc, chat()).await.unwrap_err();
    let e = e.downcast::<PaceError>().unwrap();
    assert!(matches!(*e, PaceError::TooLarge { .. }));
    assert!(seen.lock().is_empty());

    let shrinking = provider("p", limits(60, 0, 0)).with_shrink(Duration::from_secs(1));
    let (pacer, clock) = pacer_with([shrinking]);
    let (svc, seen) = scripted(clock, vec![]);
    let mut svc = PacerLayer::new(pacer, "p").layer(svc);
    let long = format!(
        r#"{{"model":"m","max_tokens":10,"messages":[{{"role":"system","content":"s"}},{{"role":"user","content":"{}"}},{{"role":"assistant","content":"ok"}},{{"role":"user","content":"last"}}]}}"#,
        "word ".repeat(100)
    );
    let req = Request::post("http://provider.test/v1/chat/completions")
        .body(Full::new(Bytes::from(long)))
        .unwrap();
    let resp = send(&mut svc, req).await.unwrap();
    let h = resp
        .headers()
        .get(SHRINK_HEADER)
        .unwrap()
        .to_str()
        .unwrap()
        .to_owned();
    assert!(h.starts_with("tokens=") && h.ends_with("messages=2"), "{h}");
    let sent: serde_json::Value = serde_json::from_slice(&seen.lock()[0].2).unwrap();
    assert_eq!(sent["messages"].as_array().unwrap().len(), 2);
}

/// Gemini's 429 (its OpenAI-compatible endpoint): no header, the delay only in
/// `error.details[]`'s `google.rpc.RetryInfo`.
fn gemini_429(delay: &str) -> Response<Full<Bytes>> {
    let body = format!(
        r#"[{{"error":{{"code":429,"message":"You exceeded your current quota, please check your plan and billing details.","status":"RESOURCE_EXHAUSTED","details":[{{"@type":"type.googleapis.com/google.rpc.QuotaFailure","violations":[{{"quotaMetric":"generativelanguage.googleapis.com/generate_content_free_tier_requests","quotaId":"GenerateRequestsPerMinutePerProjectPerModel-FreeTier","quotaValue":"15"}}]}},{{"@type":"type.googleapis.com/google.rpc.RetryInfo","retryDelay":"{delay}"}}]}}}}]"#
    );
    status(429, &[], &body)
}

#[tokio::test(start_paused = true)]
async fn c5_gemini_retry_info_is_waited_exactly() {
    for (delay, want) in [
        ("3s", Duration::from_secs(3)),
        ("37s", Duration::from_secs(37)),
        ("1.5s", Duration::from_millis(1500)),
        ("0.250s", Duration::from_millis(250)),
    ] {
        let (gap, seen, s) = retried_after(gemini_429(delay)).await;
        assert_eq!((s, seen.len()), (StatusCode::OK, 2), "{delay}");
        assert_eq!(gap, want, "{delay}: not the 1 s backoff floor");
    }
    // Garbage in the delay: no hint, the backoff (1 s first) decides.
    let (gap, _, s) = retried_after(gemini_429("-5s")).await;
    assert_eq!((s, gap), (StatusCode::OK, Duration::from_secs(1)));
}

#[tokio::test(start_paused = true)]
async fn c5_a_hint_past_max_wait_hands_the_429_back_at_once() {
    let mut p = provider("p", limits(100_000, 0, 0));
    p.max_wait = Duration::from_secs(10);
    let (pacer, clock) = pacer_with([p]);
    let (svc, seen) = scripted(clock, vec![gemini_429("37s"), ok(10, 5)]);
    let mut svc = PacerLayer::new(pacer.clone(), "p").layer(svc);
    let started = clock.now();
    let resp = send(&mut svc, chat()).await.unwrap();
    assert_eq!(resp.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(seen.lock().len(), 1, "not retried");
    assert_eq!(clock.now(), started, "no wait at all");
    // The delay only the body said is in the headers SDKs honour.
    let h = resp.headers();
    assert_eq!(h["retry-after"], "37");
    assert_eq!(h["retry-after-ms"], "37000");
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert!(
        std::str::from_utf8(&body).unwrap().contains("RetryInfo"),
        "the provider's body goes back"
    );
    assert_eq!(pacer.stats("p").upstream_429, 1);
    // The next request is held the 37 s: past its own 10 s wait, a clear
    // refusal at once, never a hang.
    let e = send(&mut svc, chat()).await.unwrap_err();
    let e = e.downcast::<PaceError>().unwrap();
    assert!(e.retry_after().unwrap() >= Duration::from_secs(36), "{e:?}");
    assert_eq!(clock.now(), started);
    assert_eq!(seen.lock().len(), 1);
}

#[tokio::test(start_paused = true)]
async fn c5_a_provider_that_answers_429_forever_is_bounded_by_max_wait() {
    // With a hint each time: the waits stop at maxWaitSeconds in all.
    let mut p = provider("p", limits(100_000, 0, 0));
    p.max_wait = Duration::from_secs(90);
    let (pacer, clock) = pacer_with([p]);
    let script = (0..20).map(|_| gemini_429("30s")).collect();
    let (svc, seen) = scripted(clock, script);
    let mut svc = PacerLayer::new(pacer.clone(), "p").layer(svc);
    let started = clock.now();
    let resp = send(&mut svc, chat()).await.unwrap();
    assert_eq!(resp.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(seen.lock().len(), 4, "30 s three times is the 90 s");
    assert_eq!(
        clock.now().saturating_since(started),
        Duration::from_secs(90)
    );
    // Without a hint: bounded attempts, each backoff at least 1 s, all
    // within maxWaitSeconds.
    let mut p = provider("p", limits(100_000, 0, 0));
    p.max_wait = Duration::from_secs(5);
    let (pacer, clock) = pacer_with([p]);
    let script = (0..20).map(|_| status(429, &[], "{}")).collect();
    let (svc, seen) = scripted(clock, script);
    let mut svc = PacerLayer::new(pacer.clone(), "p").layer(svc);
    let started = clock.now();
    let resp = send(&mut svc, chat()).await.unwrap();
    assert_eq!(resp.status(), StatusCode::TOO_MANY_REQUESTS);
    let n = seen.lock().len();
    assert!((2..=5).contains(&n), "{n}");
    assert!(clock.now().saturating_since(started) <= Duration::from_secs(5));
}

#[tokio::test(start_paused = true)]
async fn c5_a_long_error_body_is_handed_back_whole() {
    let (pacer, clock) = pacer(limits(100_000, 0, 0));
    // 200 KiB, past the 64 KiB read to look for a hint.
    let long = format!("<html>{}</html>", "x".repeat(200 << 10));
    let script = (0..10).map(|_| status(503, &[], &long)).collect();
    let (svc, seen) = scripted(clock, script);
    let mut svc = PacerLayer::new(pacer, "p").layer(svc);
    let resp = send(&mut svc, chat()).await.unwrap();
    assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(seen.lock().len(), 5, "retried as any 503");
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body.len(), long.len());
}

/// SPEC C7 with C5: a provider's 429 stops every process pacing its key, not
/// only the one it answered. Pacer `a` (a process whose requests wait at most
/// 10 s) gets `429, Retry-After: 30` and hands it back; pacer `b`, another
/// process on the same store that never saw the 429, waits those 30 s before
/// its next request, and not a moment past them.
#[tokio::test(start_paused = true)]
async fn c7_a_429_seen_by_one_pacer_holds_every_pacer_on_its_store() {
    use sluice_client::config::{PaceConfig, StaticLimits};
    use sluice_client::{Pacer, TEST_EPOCH, TokioClock};
    use sluice_store::{MemoryConfig, MemoryStore};

    let clock = TokioClock::at(TEST_EPOCH);
    let store = SharedStore(Arc::new(MemoryStore::with_clock(
        MemoryConfig::default(),
        clock,
    )));
    let mut impatient = provider("p", limits(100_000, 0, 0));
    impatient.max_wait = Duration::from_secs(10);
    let a = Pacer::with_store(
        store.clone(),
        clock,
        Arc::new(StaticLimits::new(PaceConfig::from_providers([impatient]))),
    );
    let config = PaceConfig::from_providers([provider("p", limits(100_000, 0, 0))]);
    let b = Pacer::with_store(store, clock, Arc::new(StaticLimits::new(config)));

    let (svc, seen) = scripted(clock, vec![status(429, &[("retry-after", "30")], "{}")]);
    let mut svc = PacerLayer::new(a.clone(), "p").layer(svc);
    let refused = send(&mut svc, chat()).await.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(seen.lock().len(), 1, "30 s is past a's 10 s: handed back");
    assert_eq!(clock.now(), TEST_EPOCH);
    assert_eq!(
        b.limits_json().await["providers"]["p"]["holdSeconds"],
        30.0,
        "b reads the hold a put"
    );
    // b's next request goes when the provider said, not into its refusal.
    let permit = b.acquire("p", 100u32).await.unwrap();
    assert_eq!(permit.waited(), Duration::from_secs(30));
    assert_eq!(clock.now(), at(30_000));
    // Once the hold is over, nobody is held by it.
    assert_eq!(b.limits_json().await["providers"]["p"]["holdSeconds"], 0.0);
    let next = b.acquire("p", 100u32).await.unwrap();
    assert_eq!(next.waited(), Duration::ZERO);
    let again = a.acquire("p", 100u32).await.unwrap();
    assert_eq!(again.waited(), Duration::ZERO);
    assert_eq!(clock.now(), at(30_000));
}
