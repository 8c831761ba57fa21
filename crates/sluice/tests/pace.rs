//! `sluice pace` as a real process in front of the provider simulator: a paced
//! chat, the admin's limits, and (C7) two processes on one Redis sharing one budget.

use crate::support;

use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use sluice_client::simulator::{Simulator, SimulatorConfig};
use support::redis::RedisServer;
use support::{Pace, get, send};

fn config(name: &str, base_url: &str, limits: &str, extra: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("sluice-pace-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join(name);
    std::fs::write(
        &path,
        format!("providers:\n  sim:\n    baseUrl: {base_url}\n    apiKey: sk-sim\n    rateLimits: {limits}\n{extra}"),
    )
    .expect("write config");
    path
}

async fn chat(pace: &Pace, max_tokens: u32) -> support::Reply {
    chat_as(
        pace,
        "/sim/v1/chat/completions",
        max_tokens,
        &[("content-type", "application/json")],
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c1_pace_forwards_paced_calls_and_shows_its_limits() {
    let sim = Simulator::start(SimulatorConfig::default())
        .await
        .expect("simulator");
    let file = config(
        "one.yaml",
        &sim.base_url(),
        "{ tpm: 60000, rpm: 500, rpd: 0 }",
        "",
    );
    let pace = Pace::spawn(&file, "memory");
    for _ in 0..3 {
        let r = chat(&pace, 50).await;
        assert_eq!(r.status, 200, "{}", r.text());
        assert!(
            r.json()["usage"]["total_tokens"]
                .as_u64()
                .is_some_and(|t| t > 0)
        );
    }
    assert_eq!(sim.stats().violations, 0);
    let limits = get(&format!("http://{}/limits", pace.admin)).await.json();
    assert_eq!(limits["providers"]["sim"]["tpm"], 60000, "{limits}");
    assert_eq!(
        limits["providers"]["sim"]["stats"]["admitted"], 3,
        "{limits}"
    );
    let unknown = send(
        Request::post(format!("http://{}/nope/v1/chat/completions", pace.listen))
            .body(Full::new(Bytes::from_static(b"{}")))
            .expect("request"),
    )
    .await;
    assert_eq!(unknown.status, 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c7_two_pace_processes_on_one_redis_share_one_budget() {
    let redis = RedisServer::start("pace-c7");
    // One request a minute, on the provider and in the plan: after process A's
    // call, process B's next one would have to wait about a minute, longer than
    // the second a request may wait, so the pacer refuses it itself.
    let sim = Simulator::start(SimulatorConfig {
        tpm: 0,
        rpm: 1,
        ..SimulatorConfig::default()
    })
    .await
    .expect("simulator");
    let file = config(
        "shared.yaml",
        &sim.base_url(),
        "{ tpm: 0, rpm: 1, rpd: 0 }",
        "    maxWaitSeconds: 1\n",
    );
    let a = Pace::spawn(&file, &redis.url());
    let b = Pace::spawn(&file, &redis.url());
    let first = chat(&a, 50).await;
    assert_eq!(first.status, 200, "{}", first.text());
    let second = chat(&b, 50).await;
    assert_eq!(
        second.status,
        429,
        "the other process sees the budget the first one spent: {}",
        second.text()
    );
    assert!(second.header("retry-after").is_some());
    let stats = sim.stats();
    assert_eq!((stats.admitted, stats.violations), (1, 0), "{stats:?}");
}

/// A provider on a loopback port that answers its first request `429,
/// Retry-After: 30` and every later one 200 with a `usage`; it counts them.
async fn refusing_once() -> (String, std::sync::Arc<std::sync::atomic::AtomicU32>) {
    use std::sync::atomic::{AtomicU32, Ordering};
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("address");
    let seen = std::sync::Arc::new(AtomicU32::new(0));
    let count = seen.clone();
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            // The head, then the body its content-length says.
            let mut buf = Vec::new();
            let mut chunk = [0u8; 4096];
            let head_end = loop {
                match conn.read(&mut chunk).await {
                    Ok(0) | Err(_) => break None,
                    Ok(n) => buf.extend_from_slice(&chunk[..n]),
                }
                if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                    break Some(i + 4);
                }
            };
            let Some(head_end) = head_end else { continue };
            let head = String::from_utf8_lossy(&buf[..head_end]).to_lowercase();
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0);
            while buf.len() < head_end + len {
                match conn.read(&mut chunk).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => buf.extend_from_slice(&chunk[..n]),
                }
            }
            let (status, extra, body) = if count.fetch_add(1, Ordering::SeqCst) == 0 {
                (
                    "429 Too Many Requests",
                    "retry-after: 30\r\n",
                    r#"{"error":{"message":"Rate limit reached","type":"requests","code":"rate_limit_exceeded"}}"#,
                )
            } else {
                (
                    "200 OK",
                    "",
                    r#"{"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":3,"total_tokens":12}}"#,
                )
            };
            let answer = format!(
                "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n{extra}\r\n{body}",
                body.len()
            );
            let _ = conn.write_all(answer.as_bytes()).await;
            let _ = conn.shutdown().await;
        }
    });
    (format!("http://{addr}"), seen)
}

/// SPEC C7 with C5, across real processes on the Redis server's clock: the
/// provider refuses process A's call with `Retry-After: 30`; process B, which
/// never saw that answer, holds the key for those 30 s too: it shows the hold
/// and refuses its next call itself (it may wait 1 s), which never reaches
/// the provider.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c7_a_429_one_pace_process_got_holds_the_other_on_one_redis() {
    use std::sync::atomic::Ordering;

    let redis = RedisServer::start("pace-c7-hold");
    let (upstream, seen) = refusing_once().await;
    let file = config(
        "hold.yaml",
        &upstream,
        "{ tpm: 0, rpm: 0, rpd: 0 }",
        "    maxWaitSeconds: 1\n",
    );
    let a = Pace::spawn(&file, &redis.url());
    let b = Pace::spawn(&file, &redis.url());
    let refused = chat(&a, 50).await;
    assert_eq!(refused.status, 429, "{}", refused.text());
    assert_eq!(
        refused.header("retry-after"),
        Some("30"),
        "the provider's own"
    );
    assert_eq!(seen.load(Ordering::SeqCst), 1);
    let limits = get(&format!("http://{}/limits", b.admin)).await.json();
    let hold = limits["providers"]["sim"]["holdSeconds"]
        .as_f64()
        .expect("holdSeconds");
    assert!(hold > 25.0 && hold <= 30.0, "B's hold: {hold} s: {limits}");
    let second = chat(&b, 50).await;
    assert_eq!(second.status, 429, "{}", second.text());
    assert_eq!(
        second.json()["error"]["code"],
        "rate_limited",
        "refused by B's pacer, not by the provider: {}",
        second.text()
    );
    let wait: u64 = second
        .header("retry-after")
        .and_then(|v| v.parse().ok())
        .expect("retry-after");
    assert!((26..=30).contains(&wait), "{wait}");
    assert_eq!(
        seen.load(Ordering::SeqCst),
        1,
        "nothing went into the provider's refusal"
    );
}

/// SPEC C7 with C5 on one real Redis, exactly: pacer A (a clock 90 s ahead of
/// the server's) holds the key for a 429's 30 s; pacer B (its own connection,
/// a clock 7 minutes behind the server's) plans its next call at exactly the
/// hold's end by its own clock, and goes at once when that comes. The store
/// reads time from an injected clock (as the store's other exact tests do),
/// so no test waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c7_two_pacers_on_one_redis_wait_out_one_hold_whatever_their_clocks() {
    use std::sync::Arc;

    use sluice_client::config::{PaceConfig, ProviderConfig, ProviderLimits, StaticLimits};
    use sluice_client::{PaceError, Pacer};
    use sluice_core::{FakeClock, Timestamp};
    use sluice_store::{RedisConfig, RedisStore};

    let redis = RedisServer::start("pace-c7-exact");
    // Ahead of the real clock, by which Redis still expires keys.
    let server = FakeClock::new(Timestamp::from_secs(3_900_000_000));
    let ahead = FakeClock::new(Timestamp::from_secs(3_900_000_090));
    let behind = FakeClock::new(Timestamp::from_secs(3_899_999_580));
    let store = || async {
        let mut config = RedisConfig::new(redis.url());
        config.timeout = Duration::from_millis(500);
        RedisStore::connect_with_clock(config, server.clone())
            .await
            .expect("connect")
    };
    let mut p = ProviderConfig::new("p", "http://127.0.0.1:9/v1", ProviderLimits::new(0, 0, 0));
    p.max_wait = Duration::from_secs(10);
    let source = || Arc::new(StaticLimits::new(PaceConfig::from_providers([p.clone()])));
    let a = Pacer::with_store(store().await, ahead.clone(), source());
    let b = Pacer::with_store(store().await, behind.clone(), source());
    let advance = |d: Duration| {
        for clock in [&server, &ahead, &behind] {
            clock.advance(d);
        }
    };

    a.hold("p", Duration::from_secs(30)).await.expect("hold");
    let hold = |pacer: &Pacer<RedisStore, FakeClock>| {
        let pacer = pacer.clone();
        async move { pacer.limits_json().await["providers"]["p"]["holdSeconds"].clone() }
    };
    assert_eq!(hold(&b).await, 30.0);
    match b.acquire("p", 10u32).await {
        Err(PaceError::WouldWait { wait, .. }) => {
            assert_eq!(wait, Duration::from_secs(30), "planned at the hold's end");
        }
        other => panic!("B went into the provider's refusal: {other:?}"),
    }
    advance(Duration::from_millis(29_999));
    assert_eq!(hold(&b).await, 0.001);
    assert_eq!(hold(&a).await, 0.001);
    advance(Duration::from_millis(1));
    assert_eq!(hold(&b).await, 0.0);
    let permit = b.acquire("p", 10u32).await.expect("not held after it ends");
    assert_eq!(permit.waited(), Duration::ZERO);
}

/// A chat sent with extra `fields`, to `path` on the proxy.
async fn chat_with(pace: &Pace, path: &str, fields: &[(&str, &str)]) -> support::Reply {
    chat_as(pace, path, 20, fields).await
}

/// A chat asking for `max_tokens`, to `path`, with `fields`.
async fn chat_as(
    pace: &Pace,
    path: &str,
    max_tokens: u32,
    fields: &[(&str, &str)],
) -> support::Reply {
    let body = serde_json::json!({
        "model": "gpt-4o-mini",
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "Say hello."}],
    });
    let mut r = Request::post(format!("http://{}{path}", pace.listen));
    for (k, v) in fields {
        r = r.header(*k, *v);
    }
    send(
        r.body(Full::new(Bytes::from(body.to_string())))
            .expect("request"),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_pace_forwards_nothing_a_web_page_sent() {
    let sim = Simulator::start(SimulatorConfig::default())
        .await
        .expect("simulator");
    let file = config(
        "doors.yaml",
        &sim.base_url(),
        "{ tpm: 60000, rpm: 500, rpd: 0 }",
        "pacer:\n  allowedOrigins: [\"http://localhost:3000\"]\n",
    );
    let pace = Pace::spawn(&file, "memory");
    let path = "/sim/chat/completions";
    for (fields, status) in [
        (
            &[
                ("origin", "http://evil.example"),
                ("content-type", "text/plain"),
            ][..],
            403,
        ),
        (&[("origin", "null")], 403),
        (
            &[
                ("host", "evil.example:8088"),
                ("content-type", "application/json"),
            ],
            421,
        ),
    ] {
        let r = chat_with(&pace, path, fields).await;
        assert_eq!(r.status, status, "{fields:?}: {}", r.text());
    }
    assert_eq!(sim.stats().requests, 0, "nothing was forwarded");
    let listed = chat_with(
        &pace,
        path,
        &[
            ("origin", "http://localhost:3000"),
            ("content-type", "application/json"),
        ],
    )
    .await;
    assert_eq!(listed.status, 200, "{}", listed.text());
    // Both spellings of a baseUrl that ends in /v1 (the simulator's does).
    for path in ["/sim/chat/completions", "/sim/v1/chat/completions"] {
        let r = chat_with(&pace, path, &[("content-type", "application/json")]).await;
        assert_eq!(r.status, 200, "{path}: {}", r.text());
    }
    assert_eq!(sim.stats().requests, 3);

    // The settings: a page elsewhere cannot change a limit, a rebinding page cannot read.
    let admin = |p: &str| format!("http://{}{p}", pace.admin);
    let r = send(
        Request::post(admin("/limits/sim"))
            .header("origin", "http://evil.example")
            .header("content-type", "text/plain")
            .body(Full::new(Bytes::from_static(b"{\"tpm\":1}")))
            .expect("request"),
    )
    .await;
    assert_eq!(r.status, 403, "{}", r.text());
    let r = send(
        Request::put(admin("/limits/sim"))
            .header("content-type", "text/plain")
            .body(Full::new(Bytes::from_static(b"{\"tpm\":1}")))
            .expect("request"),
    )
    .await;
    assert_eq!(r.status, 415, "{}", r.text());
    let r = send(
        Request::get(admin("/limits"))
            .header("host", "evil.example")
            .body(Full::new(Bytes::new()))
            .expect("request"),
    )
    .await;
    assert_eq!(r.status, 421);
    assert_eq!(
        get(&admin("/limits")).await.json()["providers"]["sim"]["tpm"],
        60000
    );
    let r = send(
        Request::put(admin("/limits/sim"))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(b"{\"tpm\":50000}")))
            .expect("request"),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        get(&admin("/limits")).await.json()["providers"]["sim"]["tpm"],
        50000
    );
    let _ = std::fs::remove_file(sluice_client::config::overrides_path(&file));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_pace_with_client_keys_forwards_only_their_callers() {
    use sha2::Digest as _;
    let sim = Simulator::start(SimulatorConfig::default())
        .await
        .expect("simulator");
    let digest = hex::encode(sha2::Sha256::digest(b"team-key"));
    let file = config(
        "keys.yaml",
        &sim.base_url(),
        "{ tpm: 60000, rpm: 500, rpd: 0 }",
        &format!("pacer:\n  clientKeys: [\"sha256:{digest}\"]\n"),
    );
    let pace = Pace::spawn(&file, "memory");
    let path = "/sim/v1/chat/completions";
    let json = ("content-type", "application/json");
    assert_eq!(chat_with(&pace, path, &[json]).await.status, 401);
    assert_eq!(
        chat_with(&pace, path, &[json, ("authorization", "Bearer guess")])
            .await
            .status,
        401
    );
    assert_eq!(sim.stats().requests, 0);
    let r = chat_with(&pace, path, &[json, ("authorization", "Bearer team-key")]).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let r = chat_with(&pace, path, &[json, ("x-api-key", "team-key")]).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(sim.stats().requests, 2);
}

#[test]
fn s3_pace_settings_beyond_loopback_need_a_token() {
    let file = config(
        "door-token.yaml",
        "http://127.0.0.1:9/v1",
        "{ tpm: 0, rpm: 0, rpd: 0 }",
        "",
    );
    let config = file.to_str().expect("UTF-8");
    let args = [
        "pace",
        "--config",
        config,
        "--listen",
        "127.0.0.1:0",
        "--admin",
        "0.0.0.0:0",
    ];
    let f = support::run_to_exit(&args, Duration::from_secs(30));
    assert_eq!(f.status.code(), Some(2), "{}", f.stderr);
    assert!(f.stderr.contains("--admin-token-file"), "{}", f.stderr);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_pace_settings_with_a_token_need_it() {
    let file = config(
        "door-token2.yaml",
        "http://127.0.0.1:9/v1",
        "{ tpm: 0, rpm: 0, rpd: 0 }",
        "",
    );
    let token = file.with_extension("token");
    std::fs::write(&token, "pace-token\n").expect("token");
    {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    }
    let token = token.to_str().expect("UTF-8");
    let pace = Pace::spawn_with(
        &file,
        &["--admin", "0.0.0.0:0", "--admin-token-file", token],
    );
    let admin = &pace.admin;
    let url = format!("http://{admin}/limits");
    let without = get(&url).await;
    assert_eq!(without.status, 401);
    let with = send(
        Request::get(&url)
            .header("authorization", "Bearer pace-token")
            .body(Full::new(Bytes::new()))
            .expect("request"),
    )
    .await;
    assert_eq!(with.status, 200, "{}", with.text());
}

/// `sluice check` on a pacer config with models, keys and itpm/otpm: the
/// effective limits with key names and no key; and each kind of bad input
/// (M1–M4) named with its key path, exit 2.
#[test]
fn m1_m2_m4_check_names_bad_model_key_and_axis_input() {
    let dir = std::env::temp_dir().join(format!("sluice-pace-check-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let run = |name: &str, text: &str| {
        let path = dir.join(name);
        std::fs::write(&path, text).expect("write config");
        std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
            .arg("check")
            .arg(&path)
            .env_remove("SLUICE_CHECK_UNSET_KEY")
            .output()
            .expect("run sluice check")
    };
    let ok = run(
        "ok.yaml",
        "providers:\n  anthropic:\n    rateLimits: {tpm: 0, itpm: 40000, otpm: 8000}\n    apiKeys:\n      - {key: sk-ant-secret-1, name: prod}\n      - {key: sk-ant-secret-2, rateLimits: {itpm: 1000, otpm: 100}}\n    models:\n      \"claude-*-haiku*\": {rateLimits: {itpm: 100000, otpm: 20000}}\n",
    );
    let stdout = String::from_utf8_lossy(&ok.stdout);
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    assert!(
        stdout.contains("\"prod\"") && stdout.contains("claude-*-haiku*"),
        "{stdout}"
    );
    assert!(!stdout.contains("sk-ant-secret"), "{stdout}");
    let bad = run(
        "bad.yaml",
        "providers:\n  anthropic:\n    rateLimits: {otpm: 8000}\n    apiKeys:\n      - key: ${SLUICE_CHECK_UNSET_KEY}\n    models:\n      \"claude*\": {rateLimits: {itpm: 1, otpm: 1}}\n      \"*haiku\": {rateLimits: {itpm: 2, otpm: 2}}\n",
    );
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert_eq!(bad.status.code(), Some(2), "{stderr}");
    for expected in [
        "providers.anthropic.rateLimits.otpm",
        "providers.anthropic.apiKeys[0].key",
        "SLUICE_CHECK_UNSET_KEY",
        "`*haiku` and `claude*` can both match one model",
    ] {
        assert!(stderr.contains(expected), "{expected}: {stderr}");
    }
    let _ = std::fs::remove_dir_all(dir);
}
