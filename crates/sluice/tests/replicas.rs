//! Several `sluice serve` processes on one Redis (SPEC D1–D3, E8): a limit
//! means the same on every replica, whatever their clocks say, and an outage
//! follows the policy.

use crate::edit;
use edit::Edit as _;

use crate::support;

use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use support::redis::RedisServer;
use support::{Sluice, get, send};

/// The default policy with the longest window (no run can straddle one) and `edit`.
fn policy(name: &str, window: &str, edit: impl FnOnce(String) -> String) -> String {
    let dir = std::env::temp_dir().join(format!("sluice-replicas-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join(name);
    let yaml = sluice_policy::DEFAULT_POLICY_YAML.edit(
        "window_seconds: 60\nprofiles",
        &format!("window_seconds: {window}\nprofiles"),
    );
    std::fs::write(&path, edit(yaml)).expect("write policy");
    path.to_str().expect("utf-8 path").to_owned()
}

fn replica(policy: &str, store: &str, extra: &[&str]) -> Sluice {
    let mut args = vec!["--config", policy, "--store", store];
    args.extend_from_slice(extra);
    Sluice::spawn(&args)
}

/// `yaml` without the optimizer's batch lane: its runner asks the queue in Redis for
/// work every second (script calls of its own), and these tests count the
/// budgets' calls alone.
fn without_batch_lane(yaml: &str) -> String {
    yaml.edit(
        "    batch:\n      route: /messages/optimize\n      max_items: 1000\n      backlog: 5000\n      keep_hours: 168\n      submit_tool: optimize_message_batch\n      status_tool: get_batch\n",
        "",
    )
}

async fn call(sluice: &Sluice, method: &str, path: &str, key: &str) -> support::Reply {
    send(
        Request::builder()
            .method(method)
            .uri(sluice.url(path))
            .header("x-api-key", key)
            .body(Full::new(Bytes::from_static(b"{}")))
            .expect("request"),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d2_e8_three_replicas_admit_exactly_the_limit_in_total() {
    let redis = RedisServer::start("d2");
    // Exactness is the shared store's: a decision that times out must not be
    // decided again locally (fail_closed), and a debug build under 200 concurrent
    // requests on two cores needs more than the default 20 ms.
    let policy = policy("d2.yaml", "4294967295", |y| {
        without_batch_lane(&y)
            .edit("expensive: fail_open }", "expensive: fail_closed }")
            .edit("timeout_ms: 20", "timeout_ms: 2000")
    });
    let replicas: Vec<Sluice> = (0..3)
        .map(|_| replica(&policy, &redis.url(), &[]))
        .collect();
    let calls_before = redis.script_calls();
    let tasks: Vec<_> = (0..200)
        .map(|i| {
            let url = replicas[i % 3].url("/chats");
            tokio::spawn(async move {
                let r = send(
                    Request::post(url)
                        .header("x-api-key", "sk-shared")
                        .body(Full::new(Bytes::from_static(b"{}")))
                        .expect("request"),
                )
                .await;
                r.status.as_u16()
            })
        })
        .collect();
    let mut admitted = 0;
    for t in tasks {
        let status = t.await.expect("task");
        assert!(
            status == 200 || status == 429,
            "every request decided by Redis: {status}"
        );
        admitted += usize::from(status == 200);
    }
    assert_eq!(
        admitted, 30,
        "30 in total across three replicas, not 3 x 30"
    );
    assert!(
        redis.script_calls() - calls_before <= 200,
        "at most one round trip per decision"
    );
    // Remaining agrees: consecutive reads on different replicas count down the
    // same budgets (here the IP ceiling binds: 300 - 30 chats - each read).
    let mut last = None;
    for i in 0..6 {
        let r = call(&replicas[i % 3], "GET", "/search/fields", "sk-reader").await;
        let remaining: u32 = r
            .header("x-ratelimit-remaining")
            .and_then(|v| v.parse().ok())
            .expect("remaining");
        if let Some(previous) = last {
            assert_eq!(
                remaining + 1,
                previous,
                "replica {} counts on the shared books",
                i % 3
            );
        } else {
            assert_eq!(
                remaining, 269,
                "the IP ceiling after 30 chats and this read"
            );
        }
        last = Some(remaining);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d1_a_replica_with_a_skewed_clock_agrees_on_windows_and_resets() {
    let redis = RedisServer::start("skew");
    let policy = policy("skew.yaml", "60", |y| y);
    let straight = replica(&policy, &redis.url(), &[]);
    let skewed = replica(&policy, &redis.url(), &["--clock-offset", "30"]);
    // Three calls A, B, A: if A's two resets match, no window boundary fell in
    // between, and B's must match them too (bounded retries, no waiting).
    for attempt in 0..5 {
        let key = format!("sk-skew-{attempt}");
        let a1 = call(&straight, "POST", "/chats", &key).await;
        let b = call(&skewed, "POST", "/chats", &key).await;
        let a2 = call(&straight, "POST", "/chats", &key).await;
        let reset = |r: &support::Reply| r.header("x-ratelimit-reset").map(str::to_owned);
        if reset(&a1) != reset(&a2) {
            continue;
        }
        assert_eq!(
            reset(&b),
            reset(&a1),
            "the skewed replica reports the same reset"
        );
        assert_eq!(b.header("x-ratelimit-remaining"), Some("28"));
        assert_eq!(a2.header("x-ratelimit-remaining"), Some("27"));
        return;
    }
    panic!("five attempts each straddled a minute boundary");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d3_redis_down_each_class_as_configured_then_shared_mode_resumes() {
    let mut redis = RedisServer::start("outage");
    let policy = policy("outage.yaml", "4294967295", |y| {
        y.edit("expensive: fail_open }", "expensive: fail_closed }")
            .edit("replicas: 1", "replicas: 3")
    });
    let sluice = replica(&policy, &redis.url(), &[]);
    let r = call(&sluice, "GET", "/search/fields", "sk-o").await;
    assert_eq!(r.header("x-ratelimit-limit"), Some("300"), "shared mode");
    redis.kill();
    for i in 0..30 {
        let started = Instant::now();
        let read = call(&sluice, "GET", "/search/fields", "sk-o").await;
        assert_eq!(read.status, 200, "read fails open ({i})");
        assert_eq!(
            read.header("x-ratelimit-limit"),
            Some("100"),
            "300 / 3 replicas, locally"
        );
        let chat = call(&sluice, "POST", "/chats", "sk-o").await;
        assert_eq!(chat.status, 503, "expensive fails closed ({i})");
        assert_eq!(chat.json()["error"]["code"], "limiter_unavailable");
        assert!(chat.header("retry-after").is_some());
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "no request hangs"
        );
    }
    let status = get(&sluice.admin_url("/status")).await.json();
    assert_eq!(status["limiter"]["store_degraded"], true);
    assert_ne!(status["limiter"]["store"]["state"], "ok");
    let metrics = get(&sluice.admin_url("/metrics")).await.text();
    assert!(metrics.contains("sluice_store_degraded 1"), "{metrics}");
    redis.restart();
    let restarted = Instant::now();
    loop {
        let r = call(&sluice, "GET", "/search/fields", "sk-o").await;
        if r.header("x-ratelimit-limit") == Some("300") {
            break;
        }
        assert!(
            restarted.elapsed() < Duration::from_secs(5),
            "shared mode did not resume"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let took = restarted.elapsed();
    assert!(
        took < Duration::from_secs(1),
        "shared mode resumed after {took:?}"
    );
    // Each worker thread keeps its own connection: one that has not been used since
    // Redis came back reconnects (and loads the script again) on its first call, which
    // on a loaded machine may take longer than the store's 20 ms timeout, answered by
    // the outage rule. Within a second every one is back.
    let resumed = Instant::now();
    loop {
        let chat = call(&sluice, "POST", "/chats", "sk-o").await;
        if chat.status == 200 {
            break;
        }
        assert_eq!(chat.status, 503, "fails closed until it is served");
        assert!(
            resumed.elapsed() < Duration::from_secs(1),
            "expensive is served again within a second of shared mode"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn q1_three_replicas_on_one_redis_admit_exactly_a_workspaces_monthly_cap() {
    let redis = RedisServer::start("q1");
    let policy = policy("q1.yaml", "4294967295", |y| {
        // Without the optimizer's lane: on Redis its leases are script calls of
        // their own (tests/lanes.rs), and this counts the budgets' calls alone.
        without_batch_lane(&y)
            .edit("messages: { monthly: 1000 }", "messages: { monthly: 10 }")
            .edit("timeout_ms: 20", "timeout_ms: 2000")
            .edit("quota: messages, lane: optimizer }", "quota: messages }")
    });
    let replicas: Vec<Sluice> = (0..3)
        .map(|_| replica(&policy, &redis.url(), &[]))
        .collect();
    let calls_before = redis.script_calls();
    // 30 optimize calls of one workspace (one key, within its expensive class of 30),
    // spread over the three replicas at once.
    let tasks: Vec<_> = (0..30)
        .map(|i| {
            let url = replicas[i % 3].url("/messages/optimize");
            tokio::spawn(async move {
                let r = send(
                    Request::post(url)
                        .header("x-api-key", "sk-quota")
                        .body(Full::new(Bytes::from_static(b"{}")))
                        .expect("request"),
                )
                .await;
                (r.status.as_u16(), r.text())
            })
        })
        .collect();
    let mut admitted = 0;
    for t in tasks {
        let (status, body) = t.await.expect("task");
        match status {
            200 => admitted += 1,
            429 => assert!(body.contains("quota_exceeded"), "{body}"),
            other => panic!("every call decided by Redis: {other} {body}"),
        }
    }
    assert_eq!(
        admitted, 10,
        "the monthly cap in total across three replicas"
    );
    // Each decision is one script call, the quota in it with the other budgets
    // (a quota of its own would add a call each, 30 more); each admitted call is
    // counted in its row of the usage export (SPEC O4) by one more; and a replica
    // notes the workspace's row of the day before it knows it, once, or once per
    // admitted call that came before the first note was answered (at most 10).
    let calls = redis.script_calls() - calls_before;
    assert!(
        calls <= 30 + 10 + 10,
        "the quota is in the same single script call as the other budgets: {calls}"
    );
    // Every replica reads the same usage from Redis.
    let sha = {
        use sha2::Digest as _;
        hex::encode(sha2::Sha256::digest(b"sk-quota"))
    };
    for r in &replicas {
        let usage = get(&r.admin_url(&format!("/quotas?workspace=key:{sha}"))).await;
        let messages = usage.json()["quotas"]
            .as_array()
            .and_then(|q| q.iter().find(|q| q["family"] == "messages").cloned())
            .expect("messages");
        assert_eq!(messages["usage"], 10);
        assert_eq!(messages["limit"], 10);
    }
}

/// P5 on Redis: two replicas in a dry run forward past the shared limit, and each
/// counts the refusals it did not give; the budget's count in Redis is the limit, as
/// enforcing it would have left it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p5_d2_a_dry_run_on_two_replicas_forwards_past_the_shared_limit_and_counts_it() {
    let redis = RedisServer::start("p5");
    let policy = policy("p5.yaml", "4294967295", |y| {
        without_batch_lane(&y).edit("timeout_ms: 20", "timeout_ms: 2000")
    });
    let replicas: Vec<Sluice> = (0..2)
        .map(|_| replica(&policy, &redis.url(), &["--dry-run"]))
        .collect();
    // 30 expensive calls a minute for one key, 20 through each replica.
    for i in 0..40 {
        let r = call(&replicas[i % 2], "POST", "/chats", "sk-p5").await;
        assert_eq!(r.status, 200, "call {i}: {}", r.text());
    }
    let mut shadowed = 0;
    for sluice in &replicas {
        let metrics = get(&sluice.admin_url("/metrics")).await.text();
        shadowed += metrics
            .lines()
            .find(|l| {
                l.starts_with("sluice_shadow_refusals_total{")
                    && l.contains("\"expensive\"")
                    && l.contains("\"rate_limited\"")
            })
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|n| n.parse::<u64>().ok())
            .unwrap_or(0);
    }
    assert_eq!(shadowed, 10, "40 calls against a shared limit of 30");
    // Enforcing it now refuses the same key at once: the count is the limit.
    let enforced = replica(&policy, &redis.url(), &[]);
    let r = call(&enforced, "POST", "/chats", "sk-p5").await;
    assert_eq!(r.status, 429, "{}", r.text());
}

/// SPEC T7 across processes: two `sluice serve` replicas on one Redis count one
/// agent run's turns once (MCP tool calls through either), a grant made on one
/// is spent on the other, and the run's state reads alike on both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t7_two_replicas_count_one_runs_turns_once() {
    let redis = RedisServer::start("t7");
    let policy = policy("t7.yaml", "4294967295", |y| {
        format!(
            "{}turns:\n  tiers: {{ quick: 3 }}\n",
            without_batch_lane(&y).edit("timeout_ms: 20", "timeout_ms: 2000")
        )
    });
    let replicas: Vec<Sluice> = (0..2)
        .map(|_| replica(&policy, &redis.url(), &[]))
        .collect();
    let tool_call = |sluice: &Sluice, id: u32| {
        let body = format!(
            r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{{"name":"search_fields","arguments":{{}}}}}}"#
        );
        send(
            Request::post(sluice.url("/mcp"))
                .header("x-api-key", "sk-agent")
                .header("content-type", "application/json")
                .header("accept", "application/json, text/event-stream")
                .header("x-sluice-run", "shared-run")
                .header("x-sluice-depth", "quick")
                .body(Full::new(Bytes::from(body)))
                .expect("request"),
        )
    };
    let mut statuses = Vec::new();
    for i in 0..8u32 {
        statuses.push(
            tool_call(&replicas[i as usize % 2], i)
                .await
                .status
                .as_u16(),
        );
    }
    assert_eq!(
        statuses.iter().filter(|&&s| s == 409).count(),
        5,
        "{statuses:?}"
    );
    assert_eq!(&statuses[..3], &[200, 200, 200], "{statuses:?}");
    // A grant on the first, spent on the second.
    let grant = send(
        Request::post(replicas[0].url("/runs/shared-run/continue"))
            .header("x-api-key", "sk-agent")
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(br#"{"turns":1}"#)))
            .expect("request"),
    )
    .await;
    assert_eq!(grant.status.as_u16(), 200, "{}", grant.text());
    assert_eq!(tool_call(&replicas[1], 20).await.status.as_u16(), 200);
    assert_eq!(tool_call(&replicas[0], 21).await.status.as_u16(), 409);
    for sluice in &replicas {
        let state = send(
            Request::get(sluice.url("/runs/shared-run"))
                .header("x-api-key", "sk-agent")
                .body(Full::new(Bytes::new()))
                .expect("request"),
        )
        .await
        .json();
        assert_eq!(
            (
                state["turns_used"].as_u64(),
                state["turns_granted"].as_u64()
            ),
            (Some(4), Some(4)),
            "{state}"
        );
    }
}
