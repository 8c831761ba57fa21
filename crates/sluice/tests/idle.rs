//! S1, at rest a process costs nothing: the real binary, started as a user would
//! and then left alone. `sluice serve` (built-in policy) on the embedded store and
//! on Redis, `sluice serve --config` (the shipped example, its file watched), `sluice
//! pace` on memory and on Redis, side by side, each Redis of its own on a private
//! Unix socket. Over one measured window each may use under 1 % of
//! a core (utime + stime in `/proc/PID/stat`) and send its Redis under one command
//! a second (`INFO commandstats`, the commands scripts call included). With
//! `--otlp-endpoint` (SPEC O1), nothing is sent and nothing runs at rest.

use crate::support;

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use serde_json::{Value, json};
use support::redis::RedisServer;
use support::{DataDir, Pace, Sluice, send};

/// How long the processes are watched at rest.
const WINDOW: Duration = Duration::from_secs(10);

/// SPEC S1: under 1 % of a core.
const MOST_CPU_SHARE: f64 = 0.01;

/// SPEC S1: under one command a second per replica.
const MOST_COMMANDS_PER_SECOND: f64 = 1.0;

/// Longest a process may take after its start line to stop using CPU (start-up
/// work, such as loading the tokenizer, may go on briefly after it).
const SETTLE_TIMEOUT: Duration = Duration::from_secs(10);

/// A pace config with one provider that is never called.
fn pace_config(dir: &DataDir) -> PathBuf {
    std::fs::create_dir_all(&dir.0).expect("config dir");
    let path = dir.0.join("pace.yaml");
    std::fs::write(
        &path,
        "providers:\n  idle:\n    apiKey: sk-idle\n    baseUrl: http://127.0.0.1:9/v1\n    rateLimits: { tpm: 60000, rpm: 500, rpd: 0 }\n",
    )
    .expect("write pace config");
    path
}

/// Clock ticks a second, as `/proc/PID/stat` counts CPU time.
fn ticks_per_second() -> u64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(100)
}

/// CPU time (user + system, in clock ticks) process `pid` has used so far.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("read /proc/PID/stat");
    // The fields after the command's name, which is in parentheses: state is the
    // first, utime and stime the 12th and 13th.
    let after_name = stat.rsplit_once(')').expect("a stat line").1;
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    let field = |i: usize| -> u64 { fields[i].parse().expect("a tick count") };
    field(11) + field(12)
}

/// Waits (bounded) until `pid` has used no CPU for a quarter of a second: what it
/// does right after its start line is start-up, not rest.
fn settle(pid: u32) {
    let deadline = Instant::now() + SETTLE_TIMEOUT;
    let mut last = cpu_ticks(pid);
    while Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(250));
        let now = cpu_ticks(pid);
        if now == last {
            return;
        }
        last = now;
    }
}

/// One process watched at rest, and the Redis it talks to, if any.
struct Watched<'a> {
    name: &'static str,
    pid: u32,
    redis: Option<&'a RedisServer>,
}

#[test]
fn s1_at_rest_serve_and_pace_cost_nothing() {
    let serve_redis = RedisServer::start("idle-serve");
    let pace_redis = RedisServer::start("idle-pace");
    let dir = DataDir::new();
    let config = pace_config(&dir);
    let serve_on_memory = Sluice::spawn(&[]);
    let serve_on_redis = Sluice::spawn(&["--store", &serve_redis.url()]);
    let example = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/policy.yaml");
    let serve_watching = Sluice::spawn(&["--config", example]);
    let pace_on_memory = Pace::spawn(&config, "memory");
    let pace_on_redis = Pace::spawn(&config, &pace_redis.url());
    let watched = [
        Watched {
            name: "sluice serve (embedded store)",
            pid: serve_on_memory.pid(),
            redis: None,
        },
        Watched {
            name: "sluice serve --store redis",
            pid: serve_on_redis.pid(),
            redis: Some(&serve_redis),
        },
        Watched {
            name: "sluice serve --config examples/policy.yaml",
            pid: serve_watching.pid(),
            redis: None,
        },
        Watched {
            name: "sluice pace",
            pid: pace_on_memory.pid(),
            redis: None,
        },
        Watched {
            name: "sluice pace --store redis",
            pid: pace_on_redis.pid(),
            redis: Some(&pace_redis),
        },
    ];
    let report = measure_at_rest(&watched, || std::thread::sleep(WINDOW));
    assert!(
        report.within_bounds,
        "at rest each process must use under 1 % of a core and send Redis under one command a second:\n{}\nserve stderr: {}",
        report.text,
        serve_on_redis.stderr()
    );
}

/// An upstream that takes each connection and closes it unanswered: every call
/// to it fails, as a crashed upstream's would.
fn closing_upstream() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            drop(stream);
        }
    });
    format!("http://{addr}")
}

/// `/status` of `sluice`'s admin listener.
async fn status(sluice: &Sluice) -> Value {
    send(
        Request::get(sluice.admin_url("/status"))
            .body(Full::new(Bytes::new()))
            .expect("request"),
    )
    .await
    .json()
}

/// S1 while work waits: batch items queued on Redis while the upstream fails every
/// call (batch items never open the shared breaker: the batch side takes the
/// upstream as down, or holds a workspace whose items fail 5 in a row) wait it
/// out on a timer, one probe item per open time; the runner neither spins nor
/// asks Redis in a loop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_l4_batch_items_of_a_held_workspace_waiting_cost_nothing() {
    let redis = RedisServer::start("idle-breaker");
    let upstream = closing_upstream();
    let sluice = Sluice::spawn(&["--store", &redis.url(), "--upstream", &upstream]);
    let items: Vec<Value> = (0..200)
        .map(|i| json!({ "message": format!("draft {i}") }))
        .collect();
    let reply = send(
        Request::post(sluice.url("/messages/optimize/batch"))
            .header("x-api-key", "sk-acme")
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(
                json!({ "items": items }).to_string(),
            )))
            .expect("request"),
    )
    .await;
    assert_eq!(reply.status, StatusCode::ACCEPTED, "{}", reply.text());
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let s = status(&sluice).await;
        let batches = &s["limiter"]["batches"][0];
        // Settled: the items that failed as the outage showed are back in the queue.
        let settled = batches["outage"] == true && batches["running"] == 0;
        if batches["held"].as_u64() >= Some(1) || settled {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the batch lane never waited: {s}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let watched = [Watched {
        name: "sluice serve --store redis, batch items of a held workspace waiting",
        pid: sluice.pid(),
        redis: Some(&redis),
    }];
    let report =
        tokio::task::block_in_place(|| measure_at_rest(&watched, || std::thread::sleep(WINDOW)));
    let after = status(&sluice).await;
    let batches = &after["limiter"]["batches"][0];
    assert!(
        batches["queued"].as_u64() > Some(0),
        "items were still waiting: {batches}"
    );
    assert!(
        report.within_bounds,
        "items of a held workspace waiting must cost under 1 % of a core and under one Redis command a second:\n{}\n{after}",
        report.text
    );
}

/// S1 with alerts (SPEC O3): events waiting for a webhook that fails wait on a
/// timer for their next try (a minute off here); the sender neither spins nor
/// polls, and the process costs nothing meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_o3_alert_events_waiting_for_a_failing_webhook_cost_nothing() {
    let hook = closing_upstream();
    let upstream = closing_upstream();
    let dir = DataDir::new();
    std::fs::create_dir_all(&dir.0).expect("dir");
    std::fs::write(dir.0.join("secret"), "s3cret").expect("secret");
    let policy = dir.0.join("policy.yaml");
    std::fs::write(
        &policy,
        format!(
            "profile: p
profiles:
  p:
    classes: {{ calls: 1000 }}
identity:
  credentials: [bearer]
quotas:
  messages: {{ monthly: 2 }}
routes:
  - {{ method: POST, path: /messages, class: calls, quota: messages }}
  - {{ class: calls }}
alerts:
  - {{ url: '{hook}/hook', at: [0.5, 1.0], budgets: [messages], secret_file: secret, retry_ms: 60000 }}
"
        ),
    )
    .expect("policy");
    let sluice = Sluice::spawn(&[
        "--config",
        policy.to_str().expect("utf-8"),
        "--upstream",
        &upstream,
    ]);
    for _ in 0..2 {
        let _ = send(
            Request::post(sluice.url("/messages"))
                .header("authorization", "Bearer sk-idle")
                .body(Full::new(Bytes::new()))
                .expect("request"),
        )
        .await;
    }
    // Both events tried once and failed: each waits a minute for its next try.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let s = status(&sluice).await;
        let alerts = s["limiter"]["alerts"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        if alerts.len() == 2 && alerts.iter().all(|a| a["attempts"] == 1) {
            break;
        }
        assert!(Instant::now() < deadline, "the events were not tried: {s}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let watched = [Watched {
        name: "sluice serve, alert events waiting for their next try",
        pid: sluice.pid(),
        redis: None,
    }];
    let report =
        tokio::task::block_in_place(|| measure_at_rest(&watched, || std::thread::sleep(WINDOW)));
    let after = status(&sluice).await;
    assert!(
        after["limiter"]["alerts"].as_array().is_some_and(|a| a
            .iter()
            .all(|e| e["state"] == "pending" && e["attempts"] == 1)),
        "still waiting, not tried again: {after}"
    );
    assert!(
        report.within_bounds,
        "alert events waiting must cost under 1 % of a core:\n{}",
        report.text
    );
}

/// S1 with OpenTelemetry (SPEC O1): a process whose collector closes every
/// connection unanswered, once its one span's export has failed, neither tries
/// again nor connects at rest, and costs nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_o1_a_failing_collector_costs_nothing_at_rest() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let collector = listener.local_addr().expect("addr");
    let connections = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = std::sync::Arc::clone(&connections);
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            drop(stream);
        }
    });
    let sluice = Sluice::spawn(&["--otlp-endpoint", &format!("http://{collector}")]);
    let _ = send(
        Request::get(sluice.url("/search/fields"))
            .body(Full::new(Bytes::new()))
            .expect("request"),
    )
    .await;
    // The span's export tried (and retried) and failed, then the metrics'.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let metrics = send(
            Request::get(sluice.admin_url("/metrics"))
                .body(Full::new(Bytes::new()))
                .expect("request"),
        )
        .await;
        let text = String::from_utf8_lossy(&metrics.body).into_owned();
        // And the metric export that follows activity.
        if text.contains("sluice_otlp_spans_failed_total 1")
            && text.contains("sluice_otlp_metric_exports_total{outcome=\"failed\"} 1")
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the export did not fail in time: {text}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(connections.load(std::sync::atomic::Ordering::SeqCst) > 0);
    let watched = [Watched {
        name: "sluice serve --otlp-endpoint, its collector failing",
        pid: sluice.pid(),
        redis: None,
    }];
    let before = connections.load(std::sync::atomic::Ordering::SeqCst);
    let report =
        tokio::task::block_in_place(|| measure_at_rest(&watched, || std::thread::sleep(WINDOW)));
    assert_eq!(
        connections.load(std::sync::atomic::Ordering::SeqCst),
        before,
        "connected to the collector at rest"
    );
    assert!(
        report.within_bounds,
        "an idle exporter must cost under 1 % of a core:\n{}",
        report.text
    );
}

/// What [`measure_at_rest`] found.
struct Report {
    within_bounds: bool,
    text: String,
}

/// Lets each watched process settle, then measures CPU and Redis commands over the
/// window `wait` takes.
fn measure_at_rest(watched: &[Watched<'_>], wait: impl FnOnce()) -> Report {
    for w in watched {
        settle(w.pid);
    }
    let sample = || -> Vec<(u64, u64)> {
        watched
            .iter()
            .map(|w| (cpu_ticks(w.pid), w.redis.map_or(0, RedisServer::commands)))
            .collect()
    };
    let before = sample();
    let started = Instant::now();
    // The measurement: every process left alone for the window.
    wait();
    let after = sample();
    let seconds = started.elapsed().as_secs_f64();
    let hz = ticks_per_second() as f64;
    let mut lines = Vec::new();
    let mut within_bounds = true;
    for ((w, (t0, c0)), (t1, c1)) in watched.iter().zip(&before).zip(&after) {
        let cpu = (t1 - t0) as f64 / hz / seconds;
        let commands = (c1 - c0) as f64 / seconds;
        within_bounds &= cpu < MOST_CPU_SHARE && commands < MOST_COMMANDS_PER_SECOND;
        lines.push(format!(
            "{}: {:.2} % of a core, {}",
            w.name,
            100.0 * cpu,
            match w.redis {
                Some(_) => format!(
                    "{commands:.2} Redis commands/s ({} in {seconds:.1} s)",
                    c1 - c0
                ),
                None => "no Redis".to_owned(),
            }
        ));
    }
    let text = lines.join("\n");
    eprintln!("{text}");
    Report {
        within_bounds,
        text,
    }
}
