//! Every provider's dialect, end to end over loopback on paused time: a
//! local fake provider answers with recorded header sets and bodies, and
//! the pacer waits what each one asks (SPEC C5, C6).
#![allow(clippy::unwrap_used)]

use crate::support;

use std::collections::VecDeque;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use sluice_client::config::parse_str;
use sluice_client::{PacerMiddleware, TokioClock};
use sluice_core::{Clock, Timestamp};
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// One request as the fake provider saw it: when, and its head.
type Seen = Arc<parking_lot::Mutex<Vec<(Timestamp, String)>>>;

/// One scripted answer: status, headers, body.
type Answer = (u16, Vec<(&'static str, String)>, String);

/// A provider on a loopback port (0: any free one) that answers each
/// request with the next of `script` (status, headers, body), 200 `{}` when
/// it runs out; one request per connection.
async fn fake_provider(clock: TokioClock, script: Vec<Answer>) -> (String, Seen) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen: Seen = Arc::default();
    let script = Arc::new(parking_lot::Mutex::new(VecDeque::from(script)));
    let s2 = seen.clone();
    tokio::spawn(async move {
        loop {
            let (mut conn, _) = listener.accept().await.unwrap();
            let mut buf = Vec::new();
            let mut chunk = [0u8; 4096];
            // The head, then the body its content-length says.
            let head_end = loop {
                let n = conn.read(&mut chunk).await.unwrap();
                buf.extend_from_slice(&chunk[..n]);
                if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                    break i + 4;
                }
            };
            let head = String::from_utf8_lossy(&buf[..head_end]).to_lowercase();
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .map_or(0, |v| v.trim().parse().unwrap());
            while buf.len() < head_end + len {
                let n = conn.read(&mut chunk).await.unwrap();
                buf.extend_from_slice(&chunk[..n]);
            }
            s2.lock().push((clock.now(), head));
            let (code, headers, body) = script.lock().pop_front().unwrap_or((
                200,
                vec![],
                r#"{"usage":{"prompt_tokens":9,"completion_tokens":3,"total_tokens":12}}"#.into(),
            ));
            let mut out = format!(
                "HTTP/1.1 {code} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n",
                body.len()
            );
            for (k, v) in headers {
                out.push_str(&format!("{k}: {v}\r\n"));
            }
            out.push_str("\r\n");
            out.push_str(&body);
            conn.write_all(out.as_bytes()).await.unwrap();
            conn.shutdown().await.ok();
        }
    });
    (format!("http://{addr}"), seen)
}

fn chat(model: &str) -> serde_json::Value {
    json!({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20})
}

/// Gemini's 429 from its OpenAI-compatible endpoint, as recorded: no
/// rate-limit header, the delay only in the body's `google.rpc.RetryInfo`.
const GEMINI_429: &str = include_str!("recorded/gemini_429.json");

#[tokio::test(start_paused = true)]
async fn c5_the_google_preset_waits_gemini_s_retry_info_end_to_end() {
    let clock = TokioClock::at(sluice_client::TEST_EPOCH);
    let (url, seen) = fake_provider(clock, vec![(429, vec![], GEMINI_429.into())]).await;
    // The shipped `google` entry, only its base URL moved to the fake.
    let config = parse_str(
        &format!("providers:\n  google:\n    apiKey: g-key\n    baseUrl: {url}/v1beta/openai\n"),
        Path::new("pace.yaml"),
    )
    .unwrap();
    let google = config.provider("google").unwrap().clone();
    assert_eq!(google.limits, limits(250_000, 100, 0), "the shipped limits");
    let (pacer, _) = pacer_with([google]);
    let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
        .with(PacerMiddleware::new(pacer.clone(), "google"))
        .build();
    let resp = client
        .post(format!("{url}/v1beta/openai/chat/completions"))
        .header("content-type", "application/json")
        .body(chat("gemini-2.0-flash").to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    resp.bytes().await.unwrap();
    let seen = seen.lock().clone();
    assert_eq!(seen.len(), 2);
    let gap = seen[1].0.saturating_since(seen[0].0);
    assert!(
        gap >= Duration::from_secs(37) && gap < Duration::from_secs(38),
        "waited {gap:?}, asked 37 s"
    );
    let stats = pacer.stats("google");
    assert_eq!((stats.upstream_429, stats.retries), (1, 1));
}

fn header_map(pairs: &[(&'static str, &str)]) -> http::HeaderMap {
    let mut h = http::HeaderMap::new();
    for (k, v) in pairs {
        h.insert(*k, v.parse().unwrap());
    }
    h
}

#[tokio::test(start_paused = true)]
async fn c6_openai_reset_durations_hold_exactly_and_garbage_is_bounded() {
    // Recorded at the edge of a small plan: no requests left until 1m30.5s.
    for (reset, wait) in [
        ("1m30.5s", Duration::from_millis(90_500)),
        ("12ms", Duration::from_millis(12)),
        ("1h2m3s", Duration::from_secs(3723)),
        ("0s", Duration::ZERO),
    ] {
        let mut p = provider("openai", limits(150_000, 0, 0));
        p.max_wait = Duration::from_secs(86_400);
        let (pacer, clock) = pacer_with([p]);
        let h = header_map(&[
            ("x-ratelimit-limit-requests", "3"),
            ("x-ratelimit-remaining-requests", "0"),
            ("x-ratelimit-reset-requests", reset),
            ("x-ratelimit-limit-tokens", "150000"),
            ("x-ratelimit-remaining-tokens", "149000"),
            ("x-ratelimit-reset-tokens", "6m0s"),
        ]);
        let start = clock.now();
        pacer.observe("openai", &h).await.unwrap();
        // The 1,000 tokens the provider counted are in the window.
        assert_eq!(pacer.tokens_in_window("openai").await.unwrap(), 1_000);
        let permit = pacer.acquire("openai", 10u32).await.unwrap();
        assert_eq!(permit.waited(), wait, "{reset}");
        assert_eq!(clock.now().saturating_since(start), wait, "{reset}");
    }
    // Garbage resets hold nothing; an enormous one holds at most a day and
    // a request that cannot wait that long is refused at once.
    for (reset, held) in [("abc", false), ("-5s", false), ("99999999h", true)] {
        let (pacer, clock) = pacer_with([provider("openai", limits(150_000, 0, 0))]);
        let h = header_map(&[
            ("x-ratelimit-remaining-requests", "0"),
            ("x-ratelimit-reset-requests", reset),
        ]);
        pacer.observe("openai", &h).await.unwrap();
        let start = clock.now();
        let got = pacer.acquire("openai", 10u32).await;
        assert_eq!(clock.now(), start, "{reset}: no wait");
        match got {
            Ok(_) => assert!(!held, "{reset}"),
            Err(e) => {
                assert!(held, "{reset}: {e}");
                let after = e.retry_after().unwrap();
                assert!(
                    after <= Duration::from_secs(86_400) && after > Duration::from_secs(86_000),
                    "{reset}: {after:?}"
                );
            }
        }
    }
}

/// Anthropic's rate-limit headers as recorded on a Messages answer at
/// [`TEST_EPOCH`](sluice_client::TEST_EPOCH) (2025-11-30T00:00:00Z): no
/// requests left until 2 s on; 10,000 input and 1,000 output tokens counted;
/// `tokens-*` the most restrictive of the two (input, here).
const ANTHROPIC: [(&str, &str); 12] = [
    ("anthropic-ratelimit-requests-limit", "50"),
    ("anthropic-ratelimit-requests-remaining", "0"),
    ("anthropic-ratelimit-requests-reset", "2025-11-30T00:00:02Z"),
    ("anthropic-ratelimit-tokens-limit", "40000"),
    ("anthropic-ratelimit-tokens-remaining", "30000"),
    ("anthropic-ratelimit-tokens-reset", "2025-11-30T00:00:15Z"),
    ("anthropic-ratelimit-input-tokens-limit", "40000"),
    ("anthropic-ratelimit-input-tokens-remaining", "30000"),
    (
        "anthropic-ratelimit-input-tokens-reset",
        "2025-11-30T00:00:15Z",
    ),
    ("anthropic-ratelimit-output-tokens-limit", "8000"),
    ("anthropic-ratelimit-output-tokens-remaining", "7000"),
    (
        "anthropic-ratelimit-output-tokens-reset",
        "2025-11-30T00:00:07.5Z",
    ),
];

#[tokio::test(start_paused = true)]
async fn c6_m2_every_anthropic_axis_goes_to_its_own_window() {
    let recorded = header_map(&ANTHROPIC);
    // Paced by input and output apart (ITPM / OTPM): each axis's count
    // corrects its own window; there is no total window to correct.
    let mut p = provider("anthropic", limits(0, 50, 0).with_io(40_000, 8_000));
    p.style = sluice_client::config::ApiStyle::Anthropic;
    let (pacer, clock) = pacer_with([p]);
    pacer.observe("anthropic", &recorded).await.unwrap();
    assert_eq!(
        pacer.group_tokens("anthropic", None).await.unwrap(),
        (0, 10_000, 1_000)
    );
    let learned = &pacer.limits_json().await["providers"]["anthropic"]["learned"]["headers"];
    assert_eq!(learned["inputTokens"]["limit"], 40_000);
    assert_eq!(learned["outputTokens"]["remaining"], 7_000);
    assert_eq!(learned["outputTokens"]["reset"], 7.5);
    assert_eq!(learned["tokens"]["reset"], 15.0);
    // Requests at 0 until the RFC 3339 reset: the next request waits for it.
    let start = clock.now();
    let permit = pacer.acquire("anthropic", 10u32).await.unwrap();
    assert_eq!(permit.waited(), Duration::from_secs(2));
    assert_eq!(clock.now().saturating_since(start), Duration::from_secs(2));

    // Paced by one TPM (the shipped default's shape): `tokens-*` corrects
    // the total window; input and output have none.
    let mut p = provider("anthropic", limits(120_000, 50, 0));
    p.style = sluice_client::config::ApiStyle::Anthropic;
    let (pacer, _) = pacer_with([p]);
    pacer.observe("anthropic", &recorded).await.unwrap();
    assert_eq!(
        pacer.group_tokens("anthropic", None).await.unwrap(),
        (10_000, 0, 0)
    );

    // Resets that are garbage, in the past, or beyond any date this pacer
    // can hold hold nothing (a past one: the requests are back now).
    for reset in [
        "soon",
        "2025-11-29T23:59:00Z",
        "9999-12-31T23:59:59Z",
        "-0001-01-01T00:00:00Z",
    ] {
        let (pacer, clock) = pacer_with([provider("anthropic", limits(120_000, 50, 0))]);
        let h = header_map(&[
            ("anthropic-ratelimit-requests-remaining", "0"),
            ("anthropic-ratelimit-requests-reset", reset),
        ]);
        pacer.observe("anthropic", &h).await.unwrap();
        let start = clock.now();
        pacer.acquire("anthropic", 10u32).await.unwrap();
        assert_eq!(clock.now(), start, "{reset}");
    }
}

/// Azure OpenAI's 429 as recorded: `retry-after-ms` and `retry-after`, the
/// requests and tokens left (no limit, no reset), the delay in the message.
fn azure_429() -> Answer {
    (
        429,
        vec![
            ("retry-after", "3".into()),
            ("retry-after-ms", "2500".into()),
            ("x-ratelimit-remaining-requests", "0".into()),
            ("x-ratelimit-remaining-tokens", "0".into()),
            ("apim-request-id", "4e1c6b2a-0f3e-4c55-9d0b-6a2f1f8f9e11".into()),
        ],
        r#"{"error":{"code":"429","message":"Requests to the ChatCompletions_Create Operation under Azure OpenAI API version 2024-10-21 have exceeded token rate limit of your current OpenAI S0 pricing tier. Please retry after 3 seconds. Please go here: https://aka.ms/oai/quotaincrease if you would like to further increase the default rate limit."}}"#.into(),
    )
}

#[tokio::test(start_paused = true)]
async fn c5_c6_the_azure_preset_waits_retry_after_ms_end_to_end() {
    let clock = TokioClock::at(sluice_client::TEST_EPOCH);
    let (url, seen) = fake_provider(clock, vec![azure_429()]).await;
    let config = parse_str(
        &format!("providers:\n  azure:\n    apiKey: az-key\n    baseUrl: {url}/openai/v1\n"),
        Path::new("pace.yaml"),
    )
    .unwrap();
    let azure = config.provider("azure").unwrap().clone();
    assert_eq!(azure.auth_header.as_str(), "api-key");
    let (pacer, _) = pacer_with([azure]);
    let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
        .with(PacerMiddleware::new(pacer.clone(), "azure"))
        .build();
    let resp = client
        .post(format!("{url}/openai/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(chat("my-gpt-4o-deployment").to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    resp.bytes().await.unwrap();
    let seen = seen.lock().clone();
    assert_eq!(seen.len(), 2);
    let gap = seen[1].0.saturating_since(seen[0].0);
    assert!(
        gap >= Duration::from_millis(2500) && gap < Duration::from_millis(3500),
        "waited {gap:?}, asked 2.5 s"
    );
    // Azure's remaining-only headers are kept (for `/limits`) but, with no
    // limit and no reset, neither hold nor charge.
    let learned = &pacer.limits_json().await["providers"]["azure"]["learned"]["headers"];
    assert_eq!(learned["requests"]["remaining"], 0);
    assert!(learned["requests"]["reset"].is_null());
}

#[tokio::test(start_paused = true)]
async fn c3_the_azure_preset_keeps_azure_s_one_and_ten_second_rpm_slices() {
    // Azure enforces its RPM over 1 s and 10 s slices (RPM/60 and RPM/6):
    // the pacer's even spacing, (60 s + margin) / RPM, keeps both: the
    // shipped 180 and other RPMs Azure assigns (6 per 1,000 TPM); the 1 s
    // slice where RPM/60 is whole.
    let shipped = sluice_client::config::ProviderConfig::shipped("azure").unwrap();
    assert_eq!(shipped.limits.rpm, 180);
    for rpm in [180, 6, 60, 300, 1_200, 2_700] {
        let mut azure = shipped.clone();
        azure.limits = limits(0, rpm, 0);
        let (pacer, clock) = pacer_with([azure]);
        let mut times = Vec::new();
        for _ in 0..(rpm / 3).max(40) {
            pacer.acquire("azure", 10u32).await.unwrap();
            times.push(clock.now());
        }
        let mut slices = vec![(Duration::from_secs(10), rpm / 6)];
        if rpm % 60 == 0 {
            slices.push((Duration::from_secs(1), rpm / 60));
        }
        for (slice, most) in slices {
            for (i, t) in times.iter().enumerate() {
                let in_slice = times[i..]
                    .iter()
                    .take_while(|u| u.saturating_since(*t) < slice)
                    .count();
                assert!(
                    in_slice <= most as usize,
                    "RPM {rpm}: {in_slice} requests in {slice:?} from {t:?}, Azure allows {most}"
                );
            }
        }
    }
}

/// Through `sluice pace` (real time: nothing waits): Gemini asks for 37 s, the
/// provider may wait 5; the 429 goes back at once, whole, with the delay in
/// the headers an SDK honours.
#[cfg(feature = "proxy")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c5_the_proxy_hands_back_gemini_s_429_with_its_delay_in_headers() {
    use sluice_client::proxy::{ProxyOptions, ProxyServer};
    let clock = TokioClock::at(sluice_client::TEST_EPOCH);
    let (url, seen) = fake_provider(clock, vec![(429, vec![], GEMINI_429.into())]).await;
    let dir = temp_dir("gemini-proxy");
    let file = dir.join("pace.yaml");
    std::fs::write(
        &file,
        format!(
            "providers:\n  google:\n    apiKey: g-key\n    baseUrl: {url}/v1beta/openai\n    maxWaitSeconds: 5\n"
        ),
    )
    .unwrap();
    let server = ProxyServer::bind(ProxyOptions::new(&file, "127.0.0.1:0".parse().unwrap()))
        .await
        .unwrap();
    let listen = server.bound().listen;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let serving = tokio::spawn(server.serve_with_shutdown(async move {
        let _ = stopped.await;
    }));
    let started = std::time::Instant::now();
    let r = reqwest::Client::new()
        .post(format!("http://{listen}/google/chat/completions"))
        .json(&chat("gemini-2.0-flash"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["retry-after"], "37");
    assert_eq!(r.headers()["retry-after-ms"], "37000");
    let body = r.text().await.unwrap();
    assert_eq!(body, GEMINI_429);
    assert!(started.elapsed() < Duration::from_secs(5), "no wait");
    assert_eq!(seen.lock().len(), 1, "not retried");
    assert!(seen.lock()[0].1.contains("authorization: bearer g-key"));
    stop.send(()).unwrap();
    serving.await.unwrap().unwrap();
}

/// C5 and C6 for a request whose body is a stream (it cannot be read nor sent
/// twice, so it is paced as a request and never retried): its 429 still holds
/// the key for the `Retry-After` it names, so the next request waits for it
/// rather than being refused too.
#[tokio::test(start_paused = true)]
async fn c5_a_streamed_request_s_429_holds_the_calls_after_it() {
    let clock = TokioClock::at(sluice_client::TEST_EPOCH);
    let (url, seen) = fake_provider(
        clock,
        vec![(429, vec![("retry-after", "3".into())], "{}".into())],
    )
    .await;
    let config = parse_str(
        &format!("providers:\n  openai:\n    apiKey: sk-o\n    baseUrl: {url}/v1\n"),
        Path::new("pace.yaml"),
    )
    .unwrap();
    let openai = config.provider("openai").unwrap().clone();
    let (pacer, _) = pacer_with([openai]);
    let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
        .with(PacerMiddleware::new(pacer.clone(), "openai"))
        .build();
    let body = chat("gpt-4o").to_string();
    let stream =
        futures_util::stream::once(
            async move { Ok::<_, std::io::Error>(bytes::Bytes::from(body)) },
        );
    let refused = client
        .post(format!("{url}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(reqwest::Body::wrap_stream(stream))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 429, "a streamed body is not sent again");
    let next = client
        .post(format!("{url}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(chat("gpt-4o").to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(next.status(), 200);
    next.bytes().await.unwrap();
    let seen = seen.lock().clone();
    assert_eq!(seen.len(), 2);
    let gap = seen[1].0.saturating_since(seen[0].0);
    assert!(
        gap >= Duration::from_secs(3),
        "the next request waited {gap:?}, the 429 asked 3 s"
    );
}
