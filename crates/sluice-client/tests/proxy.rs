//! End to end over loopback: `sluice pace` (run_proxy) → the simulator, with
//! real sockets (port 0) and real time: plain and streamed chat completions
//! pass through, paced, with zero 429s; oversize → 413; shrink header; the
//! admin side's `/limits`, settings page and saved edits.
#![allow(clippy::unwrap_used)]

use crate::support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use sluice_client::proxy::{ProxyOptions, ProxyServer};
use sluice_client::shrink::SHRINK_HEADER;
use sluice_client::simulator::{Simulator, SimulatorConfig};

fn chat(max_tokens: u32) -> Value {
    json!({"model":"gpt-4o","messages":[
        {"role":"system","content":"You are terse."},
        {"role":"user","content":"Say hello."}],"max_tokens":max_tokens})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c1_c2_c3_end_to_end_proxy_to_simulator_paced_with_zero_429s() {
    let sim = Simulator::start(SimulatorConfig {
        tpm: 20_000,
        rpm: 600,
        latency: Duration::from_millis(20),
        completion_tokens: 30,
        stream_chunks: 5,
        chunk_interval: Duration::from_millis(40),
        ..SimulatorConfig::default()
    })
    .await
    .unwrap();
    let dir = support::temp_dir("e2e");
    let file = dir.join("pace.yaml");
    std::fs::write(
        &file,
        format!(
            "providers:\n  sim:\n    baseUrl: {url}\n    apiKey: ${{SLUICE_E2E_UNSET_KEY:-sk-sim}}\n    rateLimits: {{ tpm: 20000, rpm: 600, rpd: 0 }}\n  small:\n    baseUrl: {url}\n    rateLimits: {{ tpm: 300, rpm: 0, rpd: 0 }}\n    shrink: true\n    maxWaitSeconds: 2\n",
            url = sim.base_url()
        ),
    )
    .unwrap();
    let server = ProxyServer::bind(
        ProxyOptions::new(&file, "127.0.0.1:0".parse().unwrap())
            .with_admin("127.0.0.1:0".parse().unwrap()),
    )
    .await
    .unwrap();
    let bound = server.bound();
    assert_ne!(bound.listen.port(), 0);
    let admin = bound.admin.unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let serving = tokio::spawn(server.serve_with_shutdown(async move {
        let _ = stopped.await;
    }));
    let base = format!("http://{}", bound.listen);
    let client = reqwest::Client::new();

    // A chat completion passes through with its usage.
    let r = client
        .post(format!("{base}/sim/chat/completions"))
        .json(&chat(50))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.headers().contains_key("x-ratelimit-remaining-tokens"));
    assert!(r.headers().contains_key("x-sluice-waited-ms"));
    let j: Value = r.json().await.unwrap();
    assert_eq!(j["object"], "chat.completion");
    assert_eq!(j["usage"]["completion_tokens"], 30);

    // A streamed one arrives chunk by chunk (not buffered), usage last.
    let mut body = chat(50);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let started = Instant::now();
    let mut r = client
        .post(format!("{base}/sim/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(
        r.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let mut chunks = Vec::new();
    while let Some(c) = r.chunk().await.unwrap() {
        chunks.push((started.elapsed(), c));
    }
    let text: String = chunks
        .iter()
        .map(|(_, c)| String::from_utf8_lossy(c).into_owned())
        .collect();
    assert!(
        text.contains("\"usage\"") && text.trim_end().ends_with("data: [DONE]"),
        "{text}"
    );
    assert!(chunks.len() >= 3, "{} chunks", chunks.len());
    let spread = chunks.last().unwrap().0 - chunks[0].0;
    assert!(
        spread >= Duration::from_millis(120),
        "first chunk came {spread:?} before the last: buffered?"
    );

    // A burst of 12 is paced under RPM 600: ~101.7 ms apart, no 429.
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..12 {
        let c = client.clone();
        let url = format!("{base}/sim/chat/completions");
        tasks.push(tokio::spawn(async move {
            c.post(url).json(&chat(20)).send().await.unwrap().status()
        }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    assert!(
        t0.elapsed() >= Duration::from_millis(11 * 100),
        "not paced: {:?}",
        t0.elapsed()
    );
    // Spaced, not bunched: the pacer lets one through every ~101.7 ms. Where
    // they arrive, one request held up on a busy machine shortens the gap
    // before the next, so the spacing is read over the burst, not per gap.
    let arrivals = sim.arrivals();
    let burst = &arrivals[arrivals.len() - 12..];
    let span = burst[11].0.saturating_since(burst[2].0);
    assert!(
        span >= Duration::from_millis(9 * 90),
        "the last 10 of the burst arrived within {span:?}"
    );

    // Larger than the whole TPM: 413 at once, nothing sent.
    let before = sim.stats().requests;
    let r = client
        .post(format!("{base}/sim/chat/completions"))
        .json(&chat(30_000))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 413);
    let j: Value = r.json().await.unwrap();
    assert_eq!(j["error"]["code"], "request_too_large");
    assert_eq!(j["error"]["details"]["tpm_limit"], 20_000);
    assert_eq!(sim.stats().requests, before);

    // Shrink (opt-in on `small`): old turns dropped, the answer says so.
    let long = json!({"model":"gpt-4o","max_tokens":20,"messages":[
        {"role":"system","content":"You are terse."},
        {"role":"user","content":"lorem ipsum ".repeat(120)},
        {"role":"assistant","content":"dolor sit ".repeat(60)},
        {"role":"user","content":"And now?"}]});
    let r = client
        .post(format!("{base}/small/chat/completions"))
        .json(&long)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let h = r.headers()[SHRINK_HEADER].to_str().unwrap();
    assert!(h.contains("messages=2"), "{h}");

    // Unknown provider.
    let r = client
        .post(format!("{base}/nope/chat/completions"))
        .json(&chat(5))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);

    // Admin: limits as JSON, the settings page, an edit that persists.
    let j: Value = client
        .get(format!("http://{admin}/limits"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(j["providers"]["sim"]["tpm"], 20_000);
    assert_eq!(j["providers"]["sim"]["source"], "config");
    assert!(j["providers"]["sim"]["stats"]["admitted"].as_u64().unwrap() >= 14);
    let page = client
        .get(format!("http://{admin}/"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(page.contains("Settings → Providers") && page.contains("data-provider=\"sim\""));
    assert!(
        page.contains("fetch(\"dashboard.json\""),
        "the page is live"
    );
    let live: Value = client
        .get(format!("http://{admin}/dashboard.json"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let sim_live = &live["providers"]["sim"];
    assert_eq!(sim_live["tpm"], 20_000);
    assert!(sim_live["window"]["tokens"].as_u64().unwrap() > 0, "{live}");
    assert!(sim_live["window"]["requestsLastMinute"].as_u64().unwrap() >= 14);
    assert!(live["configFile"].is_string());
    let r = client
        .put(format!("http://{admin}/limits/sim"))
        .json(&json!({"rpm": 1200}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let j: Value = r.json().await.unwrap();
    assert_eq!(
        (j["rpm"].as_u64(), j["tpm"].as_u64(), j["source"].as_str()),
        (Some(1200), Some(20_000), Some("settings"))
    );
    assert!(dir.join("pace.overrides.yaml").exists());
    let r = client
        .put(format!("http://{admin}/limits/sim"))
        .json(&json!({"rpm": -1}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);

    let stats = sim.stats();
    assert_eq!(stats.violations, 0, "{stats:?}");
    assert!(
        stats.worst_window_tokens <= 20_000 && stats.worst_window_requests <= 600,
        "{stats:?}"
    );
    let _ = stop.send(());
    serving.await.unwrap().unwrap();
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c6_reqwest_middleware_paces_and_reconciles() {
    use sluice_client::config::{PaceConfig, ProviderConfig, ProviderLimits};
    use sluice_client::{Pacer, PacerMiddleware};

    let sim = Simulator::start(SimulatorConfig {
        completion_tokens: 7,
        latency: Duration::from_millis(5),
        ..SimulatorConfig::default()
    })
    .await
    .unwrap();
    let pacer = Pacer::from_config(PaceConfig::from_providers([ProviderConfig::new(
        "sim",
        &sim.base_url(),
        ProviderLimits::new(10_000, 1_200, 0),
    )]));
    let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
        .with(PacerMiddleware::new(pacer.clone(), "sim"))
        .build();
    let mut used = 0;
    for _ in 0..3 {
        let r = client
            .post(format!("{}/chat/completions", sim.base_url()))
            .body(chat(500).to_string())
            .header("content-type", "application/json")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let j: Value = r.json().await.unwrap();
        used += j["usage"]["total_tokens"].as_u64().unwrap();
    }
    // Reservations of ~520 each were replaced by the actual usage.
    let mut in_window = 0;
    for _ in 0..50 {
        in_window = pacer.tokens_in_window("sim").await.unwrap();
        if in_window == used {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(in_window, used);
    assert_eq!(pacer.stats("sim").admitted, 3);
    assert_eq!(sim.stats().violations, 0);
}

/// The proxy with models, keys and priorities: the answers say which
/// budget and key paced them, a request naming no covered model goes by the
/// provider-wide limits, a bad priority is a 400 sent nowhere, and the
/// admin side shows per-model limits and key names — never a key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn m1_m3_m4_the_proxy_names_the_budget_and_key_and_shows_no_key() {
    use sluice_client::simulator::SimModel;
    let sim = Simulator::start(SimulatorConfig {
        latency: Duration::from_millis(5),
        ..SimulatorConfig::default()
    })
    .await
    .unwrap();
    sim.set_models([SimModel::new("gpt-4o", 10_000, 100)]);
    let dir = support::temp_dir("models");
    let file = dir.join("pace.yaml");
    std::fs::write(
        &file,
        format!(
            "providers:\n  sim:\n    baseUrl: {url}\n    rateLimits: {{ tpm: 50000, rpm: 500, rpd: 0 }}\n    apiKeys:\n      - key: ${{SLUICE_MODELS_UNSET_A:-sk-secret-a}}\n        name: team-a\n      - key: sk-secret-b\n        name: team-b\n        rateLimits: {{ tpm: 1000 }}\n    models:\n      gpt-4o: {{ rateLimits: {{ tpm: 10000, rpm: 100 }} }}\n      \"gpt-4o-mini*\": {{ shared: small, rateLimits: {{ tpm: 20000 }} }}\n",
            url = sim.base_url()
        ),
    )
    .unwrap();
    let server = ProxyServer::bind(
        ProxyOptions::new(&file, "127.0.0.1:0".parse().unwrap())
            .with_admin("127.0.0.1:0".parse().unwrap()),
    )
    .await
    .unwrap();
    let bound = server.bound();
    let admin = bound.admin.unwrap();
    let serving = tokio::spawn(server.serve());
    let base = format!("http://{}/sim", bound.listen);
    let client = reqwest::Client::new();
    let send = |body: Value, priority: Option<&'static str>| {
        let mut r = client.post(format!("{base}/chat/completions")).json(&body);
        if let Some(p) = priority {
            r = r.header("x-sluice-priority", p);
        }
        r.send()
    };
    let r = send(chat(20), None).await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-sluice-budget"], "model=gpt-4o");
    assert_eq!(r.headers()["x-sluice-key"], "team-a");
    let _ = r.bytes().await;
    let mut mini = chat(20);
    mini["model"] = json!("gpt-4o-mini-2024-07-18");
    let r = send(mini, Some("batch")).await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-sluice-budget"], "model=small");
    let _ = r.bytes().await;
    let mut none = chat(20);
    none.as_object_mut().unwrap().remove("model");
    let r = send(none, None).await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-sluice-budget"], "provider");
    let _ = r.bytes().await;
    let before = sim.stats().requests;
    let r = send(chat(20), Some("urgent")).await.unwrap();
    assert_eq!(r.status(), 400);
    let j: Value = r.json().await.unwrap();
    assert_eq!(j["error"]["code"], "invalid_priority");
    assert_eq!(sim.stats().requests, before, "sent nowhere");
    assert_eq!(sim.stats().violations, 0);

    let mut shown = String::new();
    for path in ["limits", "status", "dashboard.json", ""] {
        let r = client
            .get(format!("http://{admin}/{path}"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{path}");
        shown.push_str(&r.text().await.unwrap());
    }
    assert!(!shown.contains("sk-secret"), "a key is shown");
    let limits: Value = client
        .get(format!("http://{admin}/dashboard.json"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let p = &limits["providers"]["sim"];
    assert_eq!(p["models"]["gpt-4o"]["tpm"], 10_000);
    assert_eq!(p["models"]["gpt-4o"]["rpm"], 100);
    assert_eq!(p["models"]["small"]["patterns"][0], "gpt-4o-mini*");
    assert!(
        p["models"]["gpt-4o"]["window"]["tokens"].as_u64().unwrap() > 0,
        "{p}"
    );
    assert!(p["models"]["gpt-4o"]["learned"].is_object(), "{p}");
    assert_eq!(p["apiKeys"][1]["name"], "team-b");
    assert_eq!(p["apiKeys"][1]["tpm"], 1_000);
    assert_eq!(p["stats"]["batch"], 1);
    assert!(shown.contains("Per-model limits") && shown.contains("data-group=\"small\""));
    assert!(shown.contains("team-b"));
    serving.abort();
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c6_learned_input_ratios_show_on_limits_and_survive_a_restart() {
    // The provider counts prompts at 1.3× the pacer's estimate.
    let sim = Simulator::start(SimulatorConfig {
        tpm: 100_000,
        rpm: 0,
        latency: Duration::from_millis(1),
        completion_tokens: 5,
        prompt_percent: 130,
        ..SimulatorConfig::default()
    })
    .await
    .unwrap();
    let dir = support::temp_dir("ratios");
    let file = dir.join("pace.yaml");
    std::fs::write(
        &file,
        format!(
            "providers:\n  sim:\n    baseUrl: {url}\n    rateLimits: {{ tpm: 100000, rpm: 0, rpd: 0, tpd: 5000000 }}\n",
            url = sim.base_url()
        ),
    )
    .unwrap();
    let start = || async {
        let server = ProxyServer::bind(
            ProxyOptions::new(&file, "127.0.0.1:0".parse().unwrap())
                .with_admin("127.0.0.1:0".parse().unwrap()),
        )
        .await
        .unwrap();
        let bound = server.bound();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let serving = tokio::spawn(server.serve_with_shutdown(async move {
            let _ = stopped.await;
        }));
        (bound, stop, serving)
    };
    let client = reqwest::Client::new();
    let ratios = |v: &Value| v["providers"]["sim"]["inputRatios"].clone();

    let (bound, stop, serving) = start().await;
    let prompt = "count me as the provider does ".repeat(30);
    for _ in 0..10 {
        let r = client
            .post(format!("http://{}/sim/chat/completions", bound.listen))
            .json(&json!({"model":"gpt-4o","max_tokens":5,
                "messages":[{"role":"user","content":prompt}]}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let _ = r.bytes().await.unwrap();
    }
    // The usage settles just after the body ends.
    let limits = || async {
        client
            .get(format!("http://{}/limits", bound.admin.unwrap()))
            .send()
            .await
            .unwrap()
            .json::<Value>()
            .await
            .unwrap()
    };
    let mut shown = limits().await;
    for _ in 0..50 {
        if ratios(&shown)[0]["samples"] == 10 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        shown = limits().await;
    }
    let learned = ratios(&shown);
    assert_eq!(learned[0]["model"], "gpt-4o", "{shown}");
    assert_eq!(learned[0]["samples"], 10, "{shown}");
    let ratio = learned[0]["ratio"].as_f64().unwrap();
    assert!((ratio - 1.3).abs() < 0.01, "{shown}");
    assert!((learned[0]["factor"].as_f64().unwrap() - ratio).abs() < 1e-9);

    // Stopped, the proxy keeps them next to its config; started again, it
    // reserves with them from its first request.
    stop.send(()).unwrap();
    serving.await.unwrap().unwrap();
    let kept = dir.join("pace.ratios.json");
    assert_eq!(sluice_client::proxy::ratios_path(&file), kept);
    let saved: Value = serde_json::from_slice(&std::fs::read(&kept).unwrap()).unwrap();
    assert_eq!(saved["providers"]["sim"][0]["samples"], 10, "{saved}");
    let (bound2, stop, serving) = start().await;
    let again: Value = client
        .get(format!("http://{}/limits", bound2.admin.unwrap()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(ratios(&again)[0]["samples"], 10, "{again}");
    assert!((ratios(&again)[0]["ratio"].as_f64().unwrap() - ratio).abs() < 1e-9);
    // The settings page shows it too, with the tokens-per-day limit.
    let page = client
        .get(format!("http://{}/", bound2.admin.unwrap()))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let row = format!("<tr><td>gpt-4o</td><td>{ratio:.3}</td>");
    assert!(page.contains(&row), "no {row} in the settings page");
    assert!(
        page.contains(">10</td></tr>"),
        "no 10 answers in the settings page"
    );
    assert!(
        page.contains("name=tpd type=number") && page.contains("value=\"5000000\""),
        "no TPD input on the settings page"
    );
    stop.send(()).unwrap();
    serving.await.unwrap().unwrap();
    // A malformed file is learned again from scratch, never an error.
    std::fs::write(&kept, b"{not json").unwrap();
    let (bound3, stop, serving) = start().await;
    let fresh: Value = client
        .get(format!("http://{}/limits", bound3.admin.unwrap()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(ratios(&fresh), json!([]), "{fresh}");
    let page = client
        .get(format!("http://{}/", bound3.admin.unwrap()))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        !page.contains("<td>gpt-4o</td>"),
        "a ratio shown after a bad file"
    );
    stop.send(()).unwrap();
    serving.await.unwrap().unwrap();
}

/// A fake OpenAI over real loopback HTTP/1.1, written by hand so that the
/// usage chunk of its stream leaves in two TCP writes: it keeps every
/// request body it got and answers each with the same stream (usage chunk
/// included, as a provider does when asked).
async fn split_usage_provider() -> (String, Arc<parking_lot::Mutex<Vec<Value>>>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let kept = seen.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut sock, _)) = listener.accept().await else {
                return;
            };
            sock.set_nodelay(true).unwrap();
            let kept = kept.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                let head_end = loop {
                    let n = sock.read(&mut chunk).await.unwrap();
                    assert!(n > 0, "the proxy hung up mid-request");
                    buf.extend_from_slice(&chunk[..n]);
                    if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        break i + 4;
                    }
                };
                let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
                let len: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .map(|v| v.trim().parse().unwrap())
                    .unwrap();
                while buf.len() < head_end + len {
                    let n = sock.read(&mut chunk).await.unwrap();
                    buf.extend_from_slice(&chunk[..n]);
                }
                kept.lock()
                    .push(serde_json::from_slice(&buf[head_end..head_end + len]).unwrap());
                let events = concat!(
                    "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"},\"finish_reason\":null}],\"usage\":null}\n\n",
                    "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}],\"usage\":null}\n\n",
                    "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":2,\"total_tokens\":11}}\n\n",
                    "data: [DONE]\n\n",
                );
                // Cut inside the usage chunk, in its "usage" object.
                let cut = events.find("\"completion_tokens\":2").unwrap();
                let chunked = |s: &str| format!("{:x}\r\n{s}\r\n", s.len());
                sock.write_all(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n",
                )
                .await
                .unwrap();
                sock.write_all(chunked(&events[..cut]).as_bytes())
                    .await
                    .unwrap();
                sock.flush().await.unwrap();
                sock.write_all(chunked(&events[cut..]).as_bytes())
                    .await
                    .unwrap();
                sock.write_all(b"0\r\n\r\n").await.unwrap();
                sock.flush().await.unwrap();
            });
        }
    });
    (format!("http://{addr}/v1"), seen)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c6_a_stream_s_usage_is_asked_for_reconciled_and_hidden_from_a_client_that_did_not_ask() {
    let (url, seen) = split_usage_provider().await;
    let dir = support::temp_dir("stream-usage");
    let file = dir.join("pace.yaml");
    std::fs::write(
        &file,
        format!("providers:\n  fake:\n    baseUrl: {url}\n    rateLimits: {{ tpm: 100000, rpm: 0, rpd: 0 }}\n"),
    )
    .unwrap();
    let server = ProxyServer::bind(
        ProxyOptions::new(&file, "127.0.0.1:0".parse().unwrap())
            .with_admin("127.0.0.1:0".parse().unwrap()),
    )
    .await
    .unwrap();
    let bound = server.bound();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let serving = tokio::spawn(server.serve_with_shutdown(async move {
        let _ = stopped.await;
    }));
    let client = reqwest::Client::new();
    let stream = |options: Option<Value>| {
        let mut body = json!({"model":"gpt-4o","stream":true,"max_tokens":500,
            "messages":[{"role":"user","content":"Say hi."}]});
        if let Some(o) = options {
            body["stream_options"] = o;
        }
        let c = client.clone();
        let url = format!("http://{}/fake/chat/completions", bound.listen);
        async move {
            let r = c.post(url).json(&body).send().await.unwrap();
            assert_eq!(r.status(), 200);
            assert!(r.headers().get("content-length").is_none());
            String::from_utf8(r.bytes().await.unwrap().to_vec()).unwrap()
        }
    };
    let status = || async {
        client
            .get(format!("http://{}/status", bound.admin.unwrap()))
            .send()
            .await
            .unwrap()
            .json::<Value>()
            .await
            .unwrap()
    };
    let reconciled = |v: &Value| v["providers"]["fake"]["reconciled"].as_u64().unwrap();

    // The client did not ask: the provider was asked, the client sees no
    // usage chunk, and the reservation (prompt + 500) settled to 11.
    let text = stream(None).await;
    assert_eq!(
        seen.lock()[0]["stream_options"],
        json!({"include_usage": true})
    );
    assert!(!text.contains("total_tokens"), "{text}");
    assert!(
        text.contains("\"content\":\"Hi\"") && text.ends_with("data: [DONE]\n\n"),
        "{text}"
    );
    let mut st = status().await;
    for _ in 0..100 {
        if reconciled(&st) == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
        st = status().await;
    }
    assert_eq!(reconciled(&st), 1, "{st}");
    let dash: Value = client
        .get(format!("http://{}/dashboard.json", bound.admin.unwrap()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(dash["providers"]["fake"]["window"]["tokens"], 11, "{dash}");

    // A client that asked gets the chunk, split as it came, whole.
    let text = stream(Some(json!({"include_usage": true}))).await;
    assert!(text.contains("\"total_tokens\":11"), "{text}");
    assert_eq!(
        seen.lock()[1]["stream_options"],
        json!({"include_usage": true})
    );
    // One that said no is asked for it, and does not see it.
    let text = stream(Some(json!({"include_usage": false}))).await;
    assert_eq!(
        seen.lock()[2]["stream_options"],
        json!({"include_usage": true})
    );
    assert!(!text.contains("total_tokens"), "{text}");
    stop.send(()).unwrap();
    serving.await.unwrap().unwrap();
}
