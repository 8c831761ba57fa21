//! P4, tenants at run time: the admin API creates, changes and removes workspaces
//! and credentials without a restart; each change is checked as a file is (400
//! naming the field, nothing changed), durable (the journal under `--data-dir`, or
//! Redis), on every replica within 1 s, and logged as one audit line.

use crate::edit;
use edit::Edit as _;

use crate::support;

use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use support::redis::RedisServer;
use support::{DataDir, Sluice, get, send};

/// The built-in policy with the longest window, plans `default` (expensive 2) and
/// `pro` (expensive 4), a key of the file's (`sk-file` of workspace `initech`), and
/// a store timeout of 2 s, and no batch lane.
fn policy(name: &str) -> String {
    let dir = std::env::temp_dir().join(format!("sluice-tenants-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join(name);
    let yaml = sluice_policy::DEFAULT_POLICY_YAML
        .edit("window_seconds: 60\nprofiles", "window_seconds: 4294967295\nprofiles")
        .edit(
            "  keys: []",
            &format!(
                "  keys:\n    - {{ sha256: {}, workspace: initech, user: cy }}",
                support::sha256_hex("sk-file")
            ),
        )
        .edit(
            "headers:\n",
            "plans:\n  default:\n    classes: { expensive: 2 }\n  pro:\n    classes: { expensive: 4 }\nheaders:\n",
        )
        // Three replicas start at once on two cores: room to connect.
        .edit("timeout_ms: 20", "timeout_ms: 2000")
        // No batch lane: its runner asks Redis for work every second, and a test
        // here counts the script calls of requests.
        .edit(
            "    batch:\n      route: /messages/optimize\n      max_items: 1000\n      backlog: 5000\n      keep_hours: 168\n      submit_tool: optimize_message_batch\n      status_tool: get_batch\n",
            "",
        );
    std::fs::write(&path, yaml).expect("write policy");
    path.to_str().expect("utf-8 path").to_owned()
}

/// `method` on the admin listener with a JSON body (or none).
async fn admin(sluice: &Sluice, method: &str, path: &str, body: Option<&str>) -> support::Reply {
    let mut request = Request::builder()
        .method(method)
        .uri(sluice.admin_url(path));
    if body.is_some() {
        request = request.header("content-type", "application/json");
    }
    send(
        request
            .body(Full::new(Bytes::from(body.unwrap_or("").to_owned())))
            .expect("request"),
    )
    .await
}

async fn chat(sluice: &Sluice, key: &str) -> support::Reply {
    send(
        Request::post(sluice.url("/chats"))
            .header("x-api-key", key)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(b"{}")))
            .expect("request"),
    )
    .await
}

/// What `sluice`'s `GET /tenants/workspaces/acme` says acme's expensive limit is.
async fn acme_expensive(sluice: &Sluice) -> serde_json::Value {
    let reply = get(&sluice.admin_url("/tenants/workspaces/acme")).await;
    reply.json()["limits"]["classes"]["expensive"].clone()
}

/// What a replica is asked until it answers as expected.
#[derive(Clone, Copy)]
enum Probe {
    /// acme's expensive limit (`GET /tenants/workspaces/acme`).
    AcmeExpensive,
    /// The status of a chat with `sk-file`.
    FileKeyChat,
}

impl Probe {
    async fn ask(self, sluice: &Sluice) -> serde_json::Value {
        match self {
            Probe::AcmeExpensive => acme_expensive(sluice).await,
            Probe::FileKeyChat => serde_json::json!(chat(sluice, "sk-file").await.status.as_u16()),
        }
    }
}

/// Waits (at most 5 s) until every replica answers `expected` to `probe`, and
/// returns how long it took.
async fn until_all(replicas: &[&Sluice], probe: Probe, expected: serde_json::Value) -> Duration {
    let started = Instant::now();
    for replica in replicas {
        while probe.ask(replica).await != expected {
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "a replica never answered {expected}"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    started.elapsed()
}

#[tokio::test]
async fn p4_a_change_is_checked_applied_at_once_audited_and_survives_a_restart() {
    let policy = policy("local.yaml");
    let data = DataDir::new();
    let sluice = Sluice::spawn(&["--config", &policy, "--data-dir", data.arg()]);
    // A credential and its workspace's plan, without a restart.
    let put = admin(
        &sluice,
        "PUT",
        &format!("/tenants/keys/{}", support::sha256_hex("sk-acme")),
        Some(r#"{"workspace":"acme","user":"ada"}"#),
    )
    .await;
    assert_eq!(put.status, 204, "{}", put.text());
    assert_eq!(
        chat(&sluice, "sk-acme").await.header("x-ratelimit-limit"),
        Some("2"),
        "default plan"
    );
    let pro = admin(
        &sluice,
        "PUT",
        "/tenants/workspaces/acme",
        Some(r#"{"plan":"pro"}"#),
    )
    .await;
    assert_eq!(pro.status, 204, "{}", pro.text());
    assert_eq!(
        chat(&sluice, "sk-acme").await.header("x-ratelimit-limit"),
        Some("4"),
        "pro"
    );
    // Limits of its own over its plan's.
    let own = admin(
        &sluice,
        "PUT",
        "/tenants/workspaces/acme",
        Some(r#"{"plan":"pro","limits":{"classes":{"expensive":7}}}"#),
    )
    .await;
    assert_eq!(own.status, 204, "{}", own.text());
    assert_eq!(acme_expensive(&sluice).await, 7);
    // A bad change: 400 naming each field, nothing changed.
    let bad = admin(
        &sluice,
        "PUT",
        "/tenants/workspaces/acme",
        Some(r#"{"plan":"gold","limits":{"classes":{"costly":1,"expensive":0}}}"#),
    )
    .await;
    assert_eq!(bad.status, 400, "{}", bad.text());
    let paths: Vec<String> = bad.json()["error"]["problems"]
        .as_array()
        .map(|p| {
            p.iter()
                .map(|p| p["path"].as_str().unwrap_or("").to_owned())
                .collect()
        })
        .unwrap_or_default();
    assert_eq!(
        paths,
        ["workspaces.acme.plan"],
        "the plan first: {}",
        bad.text()
    );
    let bad = admin(
        &sluice,
        "PUT",
        "/tenants/workspaces/acme",
        Some(r#"{"plan":"pro","limits":{"classes":{"costly":1,"expensive":0}}}"#),
    )
    .await;
    assert_eq!(bad.status, 400, "{}", bad.text());
    let text = bad.text();
    assert!(
        text.contains("workspaces.acme.limits.classes.costly")
            && text.contains("workspaces.acme.limits.classes.expensive"),
        "{text}"
    );
    let twice = admin(
        &sluice,
        "PUT",
        "/tenants/workspaces/acme",
        Some(r#"{"plan":"pro","plan":"default"}"#),
    )
    .await;
    assert_eq!(twice.status, 400, "{}", twice.text());
    assert!(
        twice.text().contains("duplicate field `plan`"),
        "{}",
        twice.text()
    );
    assert_eq!(acme_expensive(&sluice).await, 7, "nothing changed");
    // Revoking a credential of the file's: refused from now on.
    assert_eq!(chat(&sluice, "sk-file").await.status, 200);
    let revoke = admin(
        &sluice,
        "DELETE",
        &format!("/tenants/keys/{}", support::sha256_hex("sk-file")),
        None,
    )
    .await;
    assert_eq!(revoke.status, 204, "{}", revoke.text());
    let refused = chat(&sluice, "sk-file").await;
    assert_eq!(refused.status, 403, "{}", refused.text());
    assert_eq!(
        refused.json()["error"]["details"]["reason"],
        "credential_revoked"
    );
    // One audit line per change: who, what, before, after.
    let stderr = sluice.stderr_with(4, |l| l.contains("sluice::audit")).await;
    let audits: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("sluice::audit"))
        .collect();
    assert_eq!(audits.len(), 4, "{stderr}");
    assert!(
        audits[2].contains("what=set workspace acme")
            && audits[2].contains(r#"before={"plan":"pro"}"#)
            && audits[2].contains(r#"after={"plan":"pro","limits":{"classes":{"expensive":7}}}"#),
        "{}",
        audits[2]
    );
    // A restart keeps every change.
    sluice.terminate();
    drop(sluice);
    let sluice = Sluice::spawn(&["--config", &policy, "--data-dir", data.arg()]);
    assert_eq!(acme_expensive(&sluice).await, 7);
    assert_eq!(chat(&sluice, "sk-file").await.status, 403, "still revoked");
    assert_eq!(
        chat(&sluice, "sk-acme").await.header("x-ratelimit-limit"),
        Some("7")
    );
    let listed = get(&sluice.admin_url("/tenants")).await.json();
    assert_eq!(listed["workspaces"]["acme"]["plan"], "pro", "{listed}");
    assert_eq!(
        listed["keys"][support::sha256_hex("sk-acme")]["workspace"],
        "acme",
        "{listed}"
    );
    assert_eq!(
        listed["revoked"],
        serde_json::json!([support::sha256_hex("sk-file")]),
        "{listed}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p4_d2_changes_reach_three_replicas_within_a_second_and_survive_a_restart_of_all() {
    let mut redis = RedisServer::start("tenants");
    let policy = policy("shared.yaml");
    let spawn =
        || [0, 1, 2].map(|_| Sluice::spawn(&["--config", &policy, "--store", &redis.url()]));
    let replicas = spawn();
    let [a, b, c] = &replicas;
    // A plan override made on one replica.
    let key = admin(
        a,
        "PUT",
        &format!("/tenants/keys/{}", support::sha256_hex("sk-acme")),
        Some(r#"{"workspace":"acme","user":"ada"}"#),
    )
    .await;
    assert_eq!(key.status, 204, "{}", key.text());
    let pro = admin(
        a,
        "PUT",
        "/tenants/workspaces/acme",
        Some(r#"{"plan":"pro"}"#),
    )
    .await;
    assert_eq!(pro.status, 204, "{}", pro.text());
    let took = until_all(&[a, b, c], Probe::AcmeExpensive, 4.into()).await;
    eprintln!("p4: AcmeExpensive = 4 on every replica in {took:?}");
    assert!(
        took < Duration::from_secs(1),
        "the plan reached every replica after {took:?}"
    );
    // A runtime override made on another.
    let own = admin(
        b,
        "PUT",
        "/tenants/workspaces/acme",
        Some(r#"{"plan":"pro","limits":{"classes":{"expensive":7}}}"#),
    )
    .await;
    assert_eq!(own.status, 204, "{}", own.text());
    let took = until_all(&[a, b, c], Probe::AcmeExpensive, 7.into()).await;
    eprintln!("p4: AcmeExpensive = 7 on every replica in {took:?}");
    assert!(
        took < Duration::from_secs(1),
        "the override reached every replica after {took:?}"
    );
    assert_eq!(
        chat(c, "sk-acme").await.header("x-ratelimit-limit"),
        Some("7")
    );
    // A credential revoked on the third.
    let revoke = admin(
        c,
        "DELETE",
        &format!("/tenants/keys/{}", support::sha256_hex("sk-file")),
        None,
    )
    .await;
    assert_eq!(revoke.status, 204, "{}", revoke.text());
    let took = until_all(&[a, b, c], Probe::FileKeyChat, 403.into()).await;
    eprintln!("p4: FileKeyChat = 403 on every replica in {took:?}");
    assert!(
        took < Duration::from_secs(1),
        "the revocation reached every replica after {took:?}"
    );
    // Every replica restarted: all of it holds.
    for r in &replicas {
        r.terminate();
    }
    drop(replicas);
    let replicas = spawn();
    for r in &replicas {
        assert_eq!(acme_expensive(r).await, 7);
        assert_eq!(chat(r, "sk-file").await.status, 403);
    }
    // A workspace's plan and its own limits are read from memory: a request of it
    // makes the one script call any other request makes.
    let calls = |key: &'static str| {
        let redis = &redis;
        let replica = &replicas[1];
        async move {
            let before = redis.script_calls();
            for _ in 0..2 {
                assert_eq!(chat(replica, key).await.status, 200);
            }
            redis.script_calls() - before
        }
    };
    assert_eq!(
        calls("sk-acme").await,
        2,
        "no store round trip for the override"
    );
    assert_eq!(calls("sk-plain").await, 2);
    // Redis down: a change is 503 and changes nothing.
    redis.kill();
    let down = admin(
        &replicas[0],
        "PUT",
        "/tenants/workspaces/acme",
        Some(r#"{"plan":"default"}"#),
    )
    .await;
    assert_eq!(down.status, 503, "{}", down.text());
    assert_eq!(down.json()["error"]["code"], "store_unavailable");
    assert_eq!(
        acme_expensive(&replicas[0]).await,
        7,
        "nothing half-applied"
    );
}

/// A tmpfs of `size` mounted on a fresh directory, unmounted (and the directory
/// removed) on drop, a failing test included.
struct Tmpfs(std::path::PathBuf);

impl Tmpfs {
    /// `None`, with a message, where this test may not mount one (not root, or in
    /// a container without the right).
    fn mount(size: &str) -> Option<Tmpfs> {
        let dir = std::env::temp_dir().join(format!(
            "sluice-tmpfs-{}-{}",
            std::process::id(),
            fastrand::u32(..)
        ));
        std::fs::create_dir_all(&dir).expect("mount point");
        let mounted = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(&dir)
            .output();
        match mounted {
            Ok(out) if out.status.success() => Some(Tmpfs(dir)),
            other => {
                let why = match other {
                    Ok(out) => String::from_utf8_lossy(&out.stderr).into_owned(),
                    Err(e) => e.to_string(),
                };
                eprintln!("skipped: cannot mount a tmpfs here: {}", why.trim());
                let _ = std::fs::remove_dir(&dir);
                None
            }
        }
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Fills the file system of `path` with a file there, to its last page.
fn fill(path: &std::path::Path) {
    use std::io::Write as _;
    let mut file = std::fs::File::create(path).expect("filler");
    let chunk = vec![0u8; 64 * 1024];
    loop {
        match file.write(&chunk) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(28) => break, // ENOSPC
            Err(e) => panic!("filling the disk: {e}"),
        }
    }
}

/// Valid journal lines (credentials of acme) that end `room` bytes before a 4 KiB
/// page ends: on a full tmpfs the next write has exactly that room.
fn journal_seed(room: usize) -> String {
    let line = |i: usize, user: &str| {
        let change = serde_json::json!({
            "op": "put_key",
            "sha256": support::sha256_hex(&format!("sk-seed-{i}")),
            "key": { "workspace": "acme", "user": user },
        });
        format!("{change}\n")
    };
    let target = 4096 - room;
    let base = line(0, "").len();
    let count = target.div_ceil(base + 256);
    let users = target - count * base;
    (0..count)
        .map(|i| {
            let n = users / count + usize::from(i < users % count);
            line(i, &"u".repeat(n))
        })
        .collect()
}

#[tokio::test]
async fn p4_a_full_disk_refuses_a_change_whole_and_the_next_acknowledged_one_survives_a_restart() {
    let Some(disk) = Tmpfs::mount("12m") else {
        return;
    };
    let policy = policy("full-disk.yaml");
    let data = disk.0.join("data");
    std::fs::create_dir_all(&data).expect("data dir");
    let journal = data.join("tenants.jsonl");
    let seed = journal_seed(8);
    assert_eq!(seed.len(), 4096 - 8);
    std::fs::write(&journal, &seed).expect("seed the journal");
    let data_arg = data.to_str().expect("utf-8 path");
    let mut sluice = Sluice::spawn(&["--config", &policy, "--data-dir", data_arg]);
    let listed = get(&sluice.admin_url("/tenants")).await.json();
    assert_eq!(
        listed["keys"][support::sha256_hex("sk-seed-0")]["workspace"],
        "acme",
        "{listed}"
    );

    // The disk full: the revocation's line does not fit in the 8 bytes left.
    let filler = disk.0.join("filler");
    fill(&filler);
    let revoke = format!("/tenants/keys/{}", support::sha256_hex("sk-file"));
    let refused = admin(&sluice, "DELETE", &revoke, None).await;
    assert_eq!(refused.status, 503, "{}", refused.text());
    assert_eq!(refused.json()["error"]["code"], "store_unavailable");
    let after = std::fs::read_to_string(&journal).expect("journal");
    assert!(
        after == seed,
        "a refused change leaves nothing of itself in the journal; past the seed: {:?}",
        after.get(seed.len()..).unwrap_or(&after)
    );
    let listed = get(&sluice.admin_url("/tenants")).await.json();
    assert_eq!(listed["revoked"], serde_json::json!([]), "nothing applied");

    // Room again: the next changes are acknowledged, and a restart keeps them.
    std::fs::remove_file(&filler).expect("free the disk");
    let revoked = admin(&sluice, "DELETE", &revoke, None).await;
    assert_eq!(revoked.status, 204, "{}", revoked.text());
    let pro = admin(
        &sluice,
        "PUT",
        "/tenants/workspaces/acme",
        Some(r#"{"plan":"pro"}"#),
    )
    .await;
    assert_eq!(pro.status, 204, "{}", pro.text());
    sluice.terminate();
    assert!(
        sluice.wait_exit(Duration::from_secs(10)).is_some(),
        "sluice did not stop"
    );
    drop(sluice);
    for (i, line) in std::fs::read_to_string(&journal)
        .expect("journal")
        .lines()
        .enumerate()
    {
        assert!(
            serde_json::from_str::<serde_json::Value>(line).is_ok(),
            "line {} is not one whole change: {line}",
            i + 1
        );
    }
    let sluice = Sluice::spawn(&["--config", &policy, "--data-dir", data_arg]);
    assert_eq!(chat(&sluice, "sk-file").await.status, 403, "still revoked");
    assert_eq!(acme_expensive(&sluice).await, 4, "still on pro");
    let listed = get(&sluice.admin_url("/tenants")).await.json();
    assert_eq!(
        listed["revoked"],
        serde_json::json!([support::sha256_hex("sk-file")]),
        "{listed}"
    );
}

/// Whether any of `replicas` logged a line holding all of `words`.
fn logged(replicas: &[&Sluice], words: &[&str]) -> bool {
    replicas.iter().any(|r| {
        r.stderr()
            .lines()
            .any(|l| words.iter().all(|w| l.contains(w)))
    })
}

/// `sluice_tenant_table_repairs_total{repair="restored"}` summed over `replicas`.
async fn restores(replicas: &[&Sluice]) -> u64 {
    let mut sum = 0;
    for replica in replicas {
        let metrics = get(&replica.admin_url("/metrics")).await.text();
        sum += metrics
            .lines()
            .filter(|l| l.starts_with(r#"sluice_tenant_table_repairs_total{repair="restored"}"#))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .sum::<u64>();
    }
    sum
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p4_d2_a_revocation_survives_a_flushall_and_a_redis_restart_on_two_replicas() {
    let mut redis = RedisServer::start("tenants-reset");
    let policy = policy("reset.yaml");
    let url = redis.url();
    let spawn = || Sluice::spawn(&["--config", &policy, "--store", &url]);
    let (a, b) = (spawn(), spawn());
    let revoke = admin(
        &a,
        "DELETE",
        &format!("/tenants/keys/{}", support::sha256_hex("sk-file")),
        None,
    )
    .await;
    assert_eq!(revoke.status, 204, "{}", revoke.text());
    until_all(&[&a, &b], Probe::FileKeyChat, 403.into()).await;

    // FLUSHALL: the table is gone from Redis, not from the replicas.
    assert_eq!(redis.cli(&["FLUSHALL"]).trim(), "OK");
    for r in [&a, &b] {
        assert_eq!(chat(r, "sk-file").await.status, 403, "still revoked");
    }
    // A change made after it reaches the other replica within a second.
    let pro = admin(
        &b,
        "PUT",
        "/tenants/workspaces/acme",
        Some(r#"{"plan":"pro"}"#),
    )
    .await;
    assert_eq!(pro.status, 204, "{}", pro.text());
    let took = until_all(&[&a, &b], Probe::AcmeExpensive, 4.into()).await;
    eprintln!("p4: after FLUSHALL, AcmeExpensive = 4 on both replicas in {took:?}");
    assert!(
        took < Duration::from_secs(1),
        "the change reached the other replica after {took:?}"
    );
    for r in [&a, &b] {
        assert_eq!(chat(r, "sk-file").await.status, 403, "still revoked");
    }
    // Loudly: an error line and a count.
    assert!(
        logged(
            &[&a, &b],
            &["ERROR", "the shared tenant table is gone from Redis"]
        ),
        "a: {}\nb: {}",
        a.stderr(),
        b.stderr()
    );
    until_restored(&a, &b, 1).await;
    // Written back: a replica started now reads the revocation and the change.
    let c = spawn();
    assert_eq!(chat(&c, "sk-file").await.status, 403);
    assert_eq!(acme_expensive(&c).await, 4);
    drop(c);

    // Redis restarted without persistence: the replicas notice (their
    // subscriptions end) and one writes its copy back.
    redis.restart();
    until_restored(&a, &b, 2).await;
    assert_eq!(redis.cli(&["EXISTS", "{sluice:tenants}:epoch"]).trim(), "1");
    for r in [&a, &b] {
        assert_eq!(chat(r, "sk-file").await.status, 403, "still revoked");
    }
    let default = admin(
        &a,
        "PUT",
        "/tenants/workspaces/acme",
        Some(r#"{"plan":"default"}"#),
    )
    .await;
    assert_eq!(default.status, 204, "{}", default.text());
    let took = until_all(&[&a, &b], Probe::AcmeExpensive, 2.into()).await;
    eprintln!("p4: after a Redis restart, AcmeExpensive = 2 on both replicas in {took:?}");
    let c = spawn();
    assert_eq!(
        chat(&c, "sk-file").await.status,
        403,
        "revoked on Redis again"
    );
    assert_eq!(acme_expensive(&c).await, 2);
    drop(c);

    // FLUSHALL, and a replica starts before any change: it asks the others, and
    // one of them writes its copy back before it takes the table.
    assert_eq!(redis.cli(&["FLUSHALL"]).trim(), "OK");
    let d = spawn();
    assert_eq!(
        chat(&d, "sk-file").await.status,
        403,
        "revoked on the new one"
    );
    assert_eq!(acme_expensive(&d).await, 2);
    until_restored(&a, &b, 3).await;
    drop(d);

    // The table gone back (as a failover to a server that had not caught up
    // leaves it): the revocation missing, the version below what replicas saw.
    let set = |plan: &'static str| {
        let body = format!(r#"{{"plan":"{plan}"}}"#);
        let replica = if plan == "pro" { &a } else { &b };
        async move { admin(replica, "PUT", "/tenants/workspaces/acme", Some(&body)).await }
    };
    assert_eq!(set("pro").await.status, 204);
    until_all(&[&a, &b], Probe::AcmeExpensive, 4.into()).await;
    let keys = "{sluice:tenants}:keys";
    assert_eq!(
        redis
            .cli(&["HDEL", keys, &support::sha256_hex("sk-file")])
            .trim(),
        "1"
    );
    assert_eq!(
        redis.cli(&["SET", "{sluice:tenants}:version", "1"]).trim(),
        "OK"
    );
    let changed = set("default").await;
    assert_eq!(changed.status, 204, "{}", changed.text());
    let took = until_all(&[&a, &b], Probe::AcmeExpensive, 2.into()).await;
    assert!(
        took < Duration::from_secs(1),
        "the change reached the other replica after {took:?}"
    );
    assert_eq!(
        redis
            .cli(&["HEXISTS", keys, &support::sha256_hex("sk-file")])
            .trim(),
        "1",
        "written back"
    );
    for r in [&a, &b] {
        assert_eq!(chat(r, "sk-file").await.status, 403, "still revoked");
    }
    assert!(logged(&[&a, &b], &["ERROR", "went back from version"]));
}

/// Waits (at most 10 s) until `a` and `b` count `restores` tables written back.
async fn until_restored(a: &Sluice, b: &Sluice, count: u64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while restores(&[a, b]).await != count {
        assert!(
            Instant::now() < deadline,
            "no replica wrote the table back; a: {}\nb: {}",
            a.stderr(),
            b.stderr()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A workspace removal, read back from the journal at a restart, revokes the
/// credentials it revoked when it was made and no other: a credential the policy
/// file gave the workspace since is valid after the restart as it was before it.
#[tokio::test]
async fn p4_a_removal_made_again_at_restart_revokes_no_credential_given_since() {
    let policy = policy("removal.yaml");
    let data = DataDir::new();
    let sluice = Sluice::spawn(&["--config", &policy, "--data-dir", data.arg()]);
    let removed = admin(&sluice, "DELETE", "/tenants/workspaces/initech", None).await;
    assert_eq!(removed.status, 204, "{}", removed.text());
    assert_eq!(
        chat(&sluice, "sk-file").await.status,
        403,
        "revoked with its workspace"
    );
    // The operator gives initech a new credential in the file.
    let yaml = std::fs::read_to_string(&policy).expect("policy");
    let file_key = support::sha256_hex("sk-file");
    let yaml = yaml.edit(
        &format!("    - {{ sha256: {file_key}, workspace: initech, user: cy }}"),
        &format!(
            "    - {{ sha256: {file_key}, workspace: initech, user: cy }}\n    - {{ sha256: {}, workspace: initech, user: dee }}",
            support::sha256_hex("sk-file-new")
        ),
    );
    std::fs::write(&policy, yaml).expect("write policy");
    sluice.terminate();
    drop(sluice);
    let sluice = Sluice::spawn(&["--config", &policy, "--data-dir", data.arg()]);
    assert_eq!(chat(&sluice, "sk-file").await.status, 403, "still revoked");
    let new = chat(&sluice, "sk-file-new").await;
    assert_eq!(new.status, 200, "the file's new credential: {}", new.text());
    let listed = get(&sluice.admin_url("/tenants")).await.json();
    assert_eq!(listed["revoked"], serde_json::json!([file_key]), "{listed}");
}

/// Two policy files named after `name`: the test policy, and one that also has
/// the plan `enterprise` (expensive 9), which the first lacks.
fn plain_and_richer(name: &str) -> (String, String) {
    let plain = policy(&format!("{name}-plain.yaml"));
    let richer = policy(&format!("{name}-richer.yaml"));
    let yaml = std::fs::read_to_string(&richer).expect("policy").edit(
        "  pro:\n    classes: { expensive: 4 }\n",
        "  pro:\n    classes: { expensive: 4 }\n  enterprise:\n    classes: { expensive: 9 }\n",
    );
    std::fs::write(&richer, yaml).expect("write policy");
    (plain, richer)
}

/// Replicas whose policy files differ (one names a plan the other lacks): a
/// change the second cannot take is left out there — listed by its `GET
/// /tenants`, not applied — and the changes after it still reach it, a
/// revocation first of all (it stalled on the change before, every later one
/// with it).
#[tokio::test]
async fn p4_d2_a_change_one_replica_cannot_take_never_holds_back_the_next() {
    let redis = RedisServer::start("tenants-unfit");
    let (plain, richer) = plain_and_richer("unfit");
    let a = Sluice::spawn(&["--config", &richer, "--store", &redis.url()]);
    let b = Sluice::spawn(&["--config", &plain, "--store", &redis.url()]);
    let enterprise = admin(
        &a,
        "PUT",
        "/tenants/workspaces/acme",
        Some(r#"{"plan":"enterprise"}"#),
    )
    .await;
    assert_eq!(enterprise.status, 204, "{}", enterprise.text());
    assert_eq!(acme_expensive(&a).await, 9);
    let revoke = admin(
        &a,
        "DELETE",
        &format!("/tenants/keys/{}", support::sha256_hex("sk-file")),
        None,
    )
    .await;
    assert_eq!(revoke.status, 204, "{}", revoke.text());
    let took = until_all(&[&a, &b], Probe::FileKeyChat, 403.into()).await;
    eprintln!(
        "p4: the revocation reached the replica that could not take the change before it in {took:?}"
    );
    let listed = get(&b.admin_url("/tenants")).await.json();
    let not_applied = listed["not_applied"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert!(
        not_applied.len() == 1
            && not_applied[0]
                .as_str()
                .is_some_and(|p| p.starts_with("workspaces.acme.plan")),
        "{listed}"
    );
    assert!(listed["workspaces"].get("acme").is_none(), "{listed}");
    assert_eq!(
        get(&a.admin_url("/tenants")).await.json()["not_applied"],
        serde_json::json!([])
    );
}

/// Replicas whose policy files differ: of the shared table, a replica leaves out
/// the one entry it cannot take (`acme.eu` on a plan it lacks) and no other —
/// `acme`, whose name it starts with before a dot, keeps its plan there, on a
/// replica following the change and on one starting after it — and
/// `not_applied` and the gauge name that entry alone.
#[tokio::test]
async fn p4_d2_a_replica_leaves_out_only_the_entry_it_cannot_take_not_those_named_like_it() {
    let redis = RedisServer::start("tenants-dotted");
    let (plain, richer) = plain_and_richer("dotted");
    let a = Sluice::spawn(&["--config", &richer, "--store", &redis.url()]);
    let b = Sluice::spawn(&["--config", &plain, "--store", &redis.url()]);
    let pro = admin(
        &a,
        "PUT",
        "/tenants/workspaces/acme",
        Some(r#"{"plan":"pro"}"#),
    )
    .await;
    assert_eq!(pro.status, 204, "{}", pro.text());
    until_all(&[&a, &b], Probe::AcmeExpensive, 4.into()).await;
    let eu = admin(
        &a,
        "PUT",
        "/tenants/workspaces/acme.eu",
        Some(r#"{"plan":"enterprise"}"#),
    )
    .await;
    assert_eq!(eu.status, 204, "{}", eu.text());
    let not_applied = |listed: &serde_json::Value| {
        listed["not_applied"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    };
    let started = Instant::now();
    while not_applied(&get(&b.admin_url("/tenants")).await.json()).is_empty() {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the change never reached the replica that cannot take it"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let c = Sluice::spawn(&["--config", &plain, "--store", &redis.url()]);
    for replica in [&b, &c] {
        let listed = get(&replica.admin_url("/tenants")).await.json();
        let left_out = not_applied(&listed);
        assert!(
            left_out.len() == 1
                && left_out[0].as_str().is_some_and(
                    |p| p.starts_with("workspaces.acme.eu.plan: no plan \"enterprise\"")
                ),
            "{listed}"
        );
        assert_eq!(listed["workspaces"]["acme"]["plan"], "pro", "{listed}");
        assert!(listed["workspaces"].get("acme.eu").is_none(), "{listed}");
        assert_eq!(acme_expensive(replica).await, 4, "acme keeps its plan");
        let metrics = get(&replica.admin_url("/metrics")).await.text();
        assert!(
            metrics
                .lines()
                .any(|l| l == "sluice_tenant_entries_not_applied 1"),
            "{metrics}"
        );
    }
    assert_eq!(acme_expensive(&a).await, 4);
    let listed = get(&a.admin_url("/tenants")).await.json();
    assert_eq!(
        listed["workspaces"]["acme.eu"]["plan"], "enterprise",
        "{listed}"
    );
    assert_eq!(not_applied(&listed), Vec::<serde_json::Value>::new());
}

/// `name` as one path segment: every byte but a letter or digit percent-encoded.
fn segment(name: &str) -> String {
    name.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() {
                char::from(b).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// Any workspace name the API takes (1 to 256 printable ASCII: `@`, a space,
/// `;`, `/`, `+`, more than 64 characters, a plan's name) can hold limits of its
/// own through the admin API: applied at once, a bad one named at its key path,
/// and kept across a restart.
#[tokio::test]
async fn p4_any_workspace_the_api_takes_can_hold_limits_of_its_own() {
    let policy = policy("names.yaml");
    let data = DataDir::new();
    let sluice = Sluice::spawn(&["--config", &policy, "--data-dir", data.arg()]);
    let long = "w".repeat(256);
    let names = [
        "team@corp",
        "team corp",
        "a;b",
        "a/b",
        "a+b",
        "pro",
        &long[..65],
        long.as_str(),
    ];
    let expensive = |reply: support::Reply| reply.json()["limits"]["classes"]["expensive"].clone();
    for name in names {
        let path = format!("/tenants/workspaces/{}", segment(name));
        let own = admin(
            &sluice,
            "PUT",
            &path,
            Some(r#"{"plan":"pro","limits":{"classes":{"expensive":7}}}"#),
        )
        .await;
        assert_eq!(own.status, 204, "{name}: {}", own.text());
        let reply = get(&sluice.admin_url(&path)).await;
        assert_eq!(reply.json()["plan"], "pro", "{name}: {}", reply.text());
        assert_eq!(expensive(reply), 7, "{name}");
    }
    let key = admin(
        &sluice,
        "PUT",
        &format!("/tenants/keys/{}", support::sha256_hex("sk-corp")),
        Some(r#"{"workspace":"team@corp","user":"ada"}"#),
    )
    .await;
    assert_eq!(key.status, 204, "{}", key.text());
    assert_eq!(
        chat(&sluice, "sk-corp").await.header("x-ratelimit-limit"),
        Some("7")
    );
    let bad = admin(
        &sluice,
        "PUT",
        "/tenants/workspaces/team%40corp",
        Some(r#"{"plan":"pro","limits":{"classes":{"expensive":0}}}"#),
    )
    .await;
    assert_eq!(bad.status, 400, "{}", bad.text());
    assert_eq!(
        bad.json()["error"]["problems"][0]["path"],
        "workspaces.team@corp.limits.classes.expensive",
        "{}",
        bad.text()
    );
    sluice.terminate();
    drop(sluice);
    let sluice = Sluice::spawn(&["--config", &policy, "--data-dir", data.arg()]);
    for name in names {
        let path = format!("/tenants/workspaces/{}", segment(name));
        assert_eq!(expensive(get(&sluice.admin_url(&path)).await), 7, "{name}");
    }
    assert_eq!(
        chat(&sluice, "sk-corp").await.header("x-ratelimit-limit"),
        Some("7")
    );
}

/// A change body that names a key twice inside a map (`limits.classes`) is
/// refused 400 at that key's path, as a field twice at the top is: readers
/// differ on which value counts, so none is taken and nothing changes.
#[tokio::test]
async fn p4_a_change_naming_a_key_twice_at_any_depth_is_refused_at_its_key_path() {
    let policy = policy("twice.yaml");
    let sluice = Sluice::spawn(&["--config", &policy]);
    let own = admin(
        &sluice,
        "PUT",
        "/tenants/workspaces/acme",
        Some(r#"{"plan":"pro","limits":{"classes":{"expensive":7}}}"#),
    )
    .await;
    assert_eq!(own.status, 204, "{}", own.text());
    let twice = admin(
        &sluice,
        "PUT",
        "/tenants/workspaces/acme",
        Some(r#"{"plan":"pro","limits":{"classes":{"expensive":5,"expensive":500}}}"#),
    )
    .await;
    assert_eq!(twice.status, 400, "{}", twice.text());
    let error = &twice.json()["error"];
    assert_eq!(error["code"], "invalid_tenant", "{}", twice.text());
    assert_eq!(
        error["problems"][0]["path"],
        "workspaces.acme.limits.classes.expensive",
        "{}",
        twice.text()
    );
    assert_eq!(acme_expensive(&sluice).await, 7, "nothing changed");
}
