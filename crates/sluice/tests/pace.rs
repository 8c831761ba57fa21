//! `sluice pace` as a real process in front of the provider simulator: a paced
//! chat, the admin's limits, and (C7) two processes on one Redis sharing one budget.

mod support;

use std::io::{BufRead as _, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use sluice_client::simulator::{Simulator, SimulatorConfig};
use support::redis::RedisServer;
use support::{get, send};

/// A `sluice pace` child; killed on drop.
struct Pace {
    child: Child,
    listen: String,
    admin: String,
}

impl Pace {
    fn spawn(config: &std::path::Path, store: &str) -> Pace {
        let mut child = Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args([
                "pace",
                "--listen",
                "127.0.0.1:0",
                "--admin",
                "127.0.0.1:0",
                "--store",
                store,
                "--config",
            ])
            .arg(config)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn sluice pace");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let line = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("start line");
        // "sluice pace: listening on http://A, admin http://B, store S"
        let addrs: Vec<String> = line
            .split("http://")
            .skip(1)
            .map(|s| {
                s.split([',', ' ', '\n'])
                    .next()
                    .unwrap_or_default()
                    .to_owned()
            })
            .collect();
        assert_eq!(addrs.len(), 2, "unexpected start line {line:?}");
        Pace {
            child,
            listen: addrs[0].clone(),
            admin: addrs[1].clone(),
        }
    }
}

impl Drop for Pace {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

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
    let body = serde_json::json!({
        "model": "gpt-4o-mini",
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "Say hello."}],
    });
    send(
        Request::post(format!("http://{}/sim/v1/chat/completions", pace.listen))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.to_string())))
            .expect("request"),
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
