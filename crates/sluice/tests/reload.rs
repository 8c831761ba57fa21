//! Reloading the policy without a restart (`sluice serve --config FILE`): a changed
//! file, or SIGHUP, puts the new policy in place on both request paths while traffic
//! runs; a file that does not pass `sluice check` changes nothing and is reported with
//! `sluice check`'s own message; budgets keep their counts across a reload.

use crate::edit;
use edit::Edit as _;

use crate::support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use serde_json::Value;
use support::{DataDir, Sluice, send};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

/// How soon a changed file must be in force.
const APPLIES_WITHIN: Duration = Duration::from_secs(1);

/// Bound on a whole test.
const TEST_TIMEOUT: Duration = Duration::from_secs(60);

/// The built-in policy with room for the load (read and the IP ceiling), expensive
/// at `expensive` a window, and hour-long windows (a minute's end would reset the
/// counts the test compares).
fn policy(expensive: u32) -> String {
    sluice_policy::DEFAULT_POLICY_YAML
        .edit("window_seconds: 60", "window_seconds: 3600")
        .edit(
            "classes: { protocol: 600, read: 300, standard: 60, expensive: 30 }",
            &format!(
                "classes: {{ protocol: 600, read: 100000, standard: 60, expensive: {expensive} }}"
            ),
        )
        .edit(
            "ip_ceilings: { ip: 300, ip_protocol: 1200 }",
            "ip_ceilings: { ip: 100000, ip_protocol: 100000 }",
        )
}

/// Writes `text` to `path` as an editor that saves in place does.
fn write(path: &std::path::Path, text: &str) {
    std::fs::write(path, text).expect("write the policy file");
}

/// `sluice serve --config DIR/policy.yaml` with [`policy`]`(expensive)` in the file.
fn serving(expensive: u32) -> (DataDir, std::path::PathBuf, Sluice) {
    let dir = DataDir::new();
    std::fs::create_dir_all(&dir.0).expect("dir");
    let file = dir.0.join("policy.yaml");
    write(&file, &policy(expensive));
    let sluice = Sluice::spawn(&["--config", file.to_str().expect("path")]);
    (dir, file, sluice)
}

/// `POST /chats` (expensive) as `key` on the fast path: status, X-RateLimit-Limit,
/// X-RateLimit-Remaining, X-RateLimit-Reset.
async fn chat(sluice: &Sluice, key: &str) -> (u16, u64, u64, u64) {
    let reply = send(
        Request::post(sluice.url("/chats"))
            .header("x-api-key", key)
            .body(Full::new(Bytes::new()))
            .expect("request"),
    )
    .await;
    let number = |name: &str| {
        reply
            .header(name)
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{name} on {reply:?}"))
    };
    (
        reply.status.as_u16(),
        number("x-ratelimit-limit"),
        number("x-ratelimit-remaining"),
        number("x-ratelimit-reset"),
    )
}

/// `POST /chats` as `key` over HTTP/1.0, which the fast path leaves to hyper and the
/// service stack: status and X-RateLimit-Limit.
async fn chat_on_hyper_path(sluice: &Sluice, key: &str) -> (u16, u64) {
    let mut stream = tokio::net::TcpStream::connect(sluice.start.gateway)
        .await
        .expect("connect");
    let head =
        format!("POST /chats HTTP/1.0\r\nhost: x\r\nx-api-key: {key}\r\ncontent-length: 0\r\n\r\n");
    stream.write_all(head.as_bytes()).await.expect("write");
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).await.expect("read");
    let text = String::from_utf8_lossy(&answer).to_lowercase();
    let status = text
        .get(9..12)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status: {text}"));
    let limit = text
        .lines()
        .find_map(|l| l.strip_prefix("x-ratelimit-limit: "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no x-ratelimit-limit: {text}"));
    (status, limit)
}

async fn status(sluice: &Sluice) -> Value {
    send(
        Request::get(sluice.admin_url("/status"))
            .body(Full::new(Bytes::new()))
            .expect("request"),
    )
    .await
    .json()
}

/// Polls `probe` until it returns `Some`, failing past `within`.
async fn until<T, F: Future<Output = Option<T>>>(
    within: Duration,
    what: &str,
    mut probe: impl FnMut() -> F,
) -> T {
    let deadline = Instant::now() + within;
    loop {
        if let Some(found) = probe().await {
            return found;
        }
        assert!(Instant::now() < deadline, "{what}: not within {within:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Read traffic from two callers until `stop`: every answer must be 200.
fn start_load(sluice: &Arc<Sluice>, stop: &Arc<AtomicBool>) -> Vec<tokio::task::JoinHandle<usize>> {
    (0..2)
        .map(|n| {
            let sluice = Arc::clone(sluice);
            let stop = Arc::clone(stop);
            tokio::spawn(async move {
                let mut sent = 0;
                let mut pace = tokio::time::interval(Duration::from_millis(5));
                while !stop.load(Ordering::Relaxed) {
                    pace.tick().await;
                    let reply = send(
                        Request::get(sluice.url("/projects"))
                            .header("x-api-key", format!("load-{n}"))
                            .body(Full::new(Bytes::new()))
                            .expect("request"),
                    )
                    .await;
                    assert_eq!(
                        reply.status, 200,
                        "a request failed during a reload: {reply:?}"
                    );
                    sent += 1;
                }
                sent
            })
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_e1_a_changed_class_limit_applies_within_a_second_under_load_and_keeps_counts() {
    tokio::time::timeout(TEST_TIMEOUT, async {
        let dir = DataDir::new();
        std::fs::create_dir_all(&dir.0).expect("dir");
        let file = dir.0.join("policy.yaml");
        write(&file, &policy(30));
        let sluice = Arc::new(Sluice::spawn(&["--config", file.to_str().expect("path")]));
        let before = status(&sluice).await;
        let version = before["limiter"]["policy"]["version"].clone();
        assert_eq!(version.as_str().map(str::len), Some(16), "{before}");
        assert!(
            before["limiter"]["policy"]["loaded_at"].is_string(),
            "{before}"
        );

        // The probe spends 3 of 30.
        for _ in 0..3 {
            assert_eq!(chat(&sluice, "probe").await.0, 200);
        }
        let stop = Arc::new(AtomicBool::new(false));
        let load = start_load(&sluice, &stop);

        // expensive 30 → 5, under load.
        write(&file, &policy(5));
        let written = Instant::now();
        let spent = Arc::new(AtomicUsize::new(3));
        let (limit, remaining, reset) = until(APPLIES_WITHIN, "the new limit", || {
            let sluice = Arc::clone(&sluice);
            let spent = Arc::clone(&spent);
            async move {
                let (code, limit, remaining, reset) = chat(&sluice, "probe").await;
                if code == 200 {
                    spent.fetch_add(1, Ordering::Relaxed);
                }
                (limit == 5).then_some((limit, remaining, reset))
            }
        })
        .await;
        let took = written.elapsed();
        assert_eq!(limit, 5);
        // The count spent under the old limit stands: 5 minus what the probe spent.
        let spent = spent.load(Ordering::Relaxed) as u64;
        let first_reset = chat(&sluice, "other-probe").await.3;
        if reset == first_reset {
            assert_eq!(remaining, 5u64.saturating_sub(spent), "spent {spent}");
        }
        // The hyper path has it too.
        assert_eq!(chat_on_hyper_path(&sluice, "hyper-probe").await.1, 5);
        let after = status(&sluice).await;
        assert_eq!(after["limiter"]["classes"]["expensive"], 5, "{after}");
        assert_ne!(after["limiter"]["policy"]["version"], version);
        assert_eq!(after["limiter"]["policy"]["reloads"], 1, "{after}");

        // The probe runs out at 5: refused.
        until(APPLIES_WITHIN, "a refusal at the new limit", || {
            let sluice = Arc::clone(&sluice);
            async move { (chat(&sluice, "probe").await.0 == 429).then_some(()) }
        })
        .await;

        stop.store(true, Ordering::Relaxed);
        let mut sent = 0;
        for task in load {
            sent += task.await.expect("no request of the load failed");
        }
        assert!(sent > 0);
        assert!(
            sluice.stderr().contains("policy reloaded"),
            "{}",
            sluice.stderr()
        );
        eprintln!("reload applied {took:?} after the write, {sent} load requests all 200");
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_a_broken_file_or_a_lane_change_changes_nothing_and_is_reported() {
    tokio::time::timeout(TEST_TIMEOUT, async {
        let (_dir, file, sluice) = serving(7);
        let version = status(&sluice).await["limiter"]["policy"]["version"].clone();

        // A typo: `sluice check` refuses it, so does the reload, with its words.
        let broken = policy(7).edit("default_class: standard", "default_klass: standard");
        write(&file, &broken);
        let checked = support::run_to_exit(
            &["check", file.to_str().expect("path")],
            Duration::from_secs(20),
        );
        assert_eq!(checked.status.code(), Some(2), "{}", checked.stderr);
        let message = checked
            .stderr
            .trim_end()
            .strip_prefix("sluice: ")
            .expect("check's message")
            .to_owned();
        let rejected = until(Duration::from_secs(2), "the rejection", || {
            let sluice = &sluice;
            async move {
                let s = status(sluice).await;
                (s["limiter"]["policy"]["rejected"] == 1).then_some(s)
            }
        })
        .await;
        assert_eq!(rejected["limiter"]["policy"]["version"], version);
        assert_eq!(rejected["limiter"]["classes"]["expensive"], 7);
        assert_eq!(
            rejected["limiter"]["policy"]["last_rejected"]["error"],
            message.as_str()
        );
        let log = sluice.stderr();
        assert!(log.contains("policy reload rejected"), "{log}");
        assert!(log.contains(&message), "{message} not in {log}");
        assert_eq!(chat(&sluice, "k").await.1, 7, "the old policy runs");
        // Reported once, not at every poll.
        tokio::time::sleep(Duration::from_millis(600)).await;
        assert_eq!(sluice.stderr().matches("policy reload rejected").count(), 1);

        // A lane's settings need a restart: refused, said why.
        write(
            &file,
            &policy(8).edit("workspace_in_flight: 3", "workspace_in_flight: 4"),
        );
        until(Duration::from_secs(2), "the lane change refused", || {
            let sluice = &sluice;
            async move {
                sluice
                    .stderr()
                    .contains("restart sluice to apply")
                    .then_some(())
            }
        })
        .await;
        assert_eq!(chat(&sluice, "k").await.1, 7, "the old policy still runs");
        let s = status(&sluice).await;
        assert_eq!(s["limiter"]["policy"]["version"], version);
        assert_eq!(s["limiter"]["policy"]["rejected"], 2);

        // A good file after a bad one is taken.
        write(&file, &policy(9));
        until(APPLIES_WITHIN * 2, "the good file", || {
            let sluice = &sluice;
            async move { (chat(sluice, "k").await.1 == 9).then_some(()) }
        })
        .await;
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_on_sighup_and_sighup_without_a_file_leaves_sluice_running() {
    tokio::time::timeout(TEST_TIMEOUT, async {
        let dir = DataDir::new();
        std::fs::create_dir_all(&dir.0).expect("dir");
        let file = dir.0.join("policy.yaml");
        write(&file, &policy(11));
        let sluice = Sluice::spawn(&[
            "--config",
            file.to_str().expect("path"),
            "--log-format",
            "json",
        ]);
        // Written and held open (its writer has not closed it): the watcher waits
        // for the close, SIGHUP takes the file as it is now.
        let mut held = std::fs::File::create(&file).expect("open the policy file");
        std::io::Write::write_all(&mut held, policy(12).as_bytes()).expect("write");
        std::io::Write::flush(&mut held).expect("flush");
        sluice.signal("HUP");
        until(APPLIES_WITHIN, "the SIGHUP reload", || {
            let sluice = &sluice;
            async move { (chat(sluice, "k").await.1 == 12).then_some(()) }
        })
        .await;
        let reloaded: Vec<Value> = sluice
            .stderr()
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|l| l["message"] == "policy reloaded")
            .collect();
        assert_eq!(reloaded.len(), 1, "{}", sluice.stderr());
        assert_eq!(reloaded[0]["trigger"], "SIGHUP");
        assert_eq!(reloaded[0]["target"], "sluice::reload");
        assert_eq!(reloaded[0]["level"], "INFO");
        drop(held);

        // The built-in policy: nothing to read, and SIGHUP does not end sluice.
        let plain = Sluice::spawn(&[]);
        plain.signal("HUP");
        until(Duration::from_secs(2), "the SIGHUP noted", || {
            let plain = &plain;
            async move {
                plain
                    .stderr()
                    .contains("no policy file to reload")
                    .then_some(())
            }
        })
        .await;
        assert_eq!(
            status(&plain).await["limiter"]["policy"]["source"],
            "built-in"
        );
    })
    .await
    .expect("test timed out");
}

/// Issue "one tenant cannot hurt the others" (4): a writer that paused in the middle of
/// the file (right after `get_batch: { class: read }`) had its prefix loaded — a policy
/// that passes `sluice check` but drops `jsonrpc.retired`. A file is now taken when its
/// writer closes it (or it is renamed into place), never half-written, however long
/// the writer pauses; the pause here is four times what the old watcher needed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_a_file_is_taken_whole_never_while_its_writer_pauses() {
    tokio::time::timeout(TEST_TIMEOUT, async {
        let (_dir, file, sluice) = serving(7);
        let running = status(&sluice).await["limiter"]["policy"]["version"].clone();

        let whole = policy(8);
        let cut = whole.find("get_batch: { class: read }\n").expect("the cut") + 27;
        let (prefix, rest) = whole.split_at(cut);
        sluice_policy::parse_str(prefix, std::path::Path::new("prefix.yaml"))
            .expect("the prefix alone passes `sluice check`: the trap is real");
        let mut writer = std::fs::File::create(&file).expect("open");
        std::io::Write::write_all(&mut writer, prefix.as_bytes()).expect("write");
        std::io::Write::flush(&mut writer).expect("flush");
        // The writer pauses (a scenario, not a wait for sluice).
        tokio::time::sleep(Duration::from_secs(2)).await;
        let s = status(&sluice).await;
        assert_eq!(
            s["limiter"]["policy"]["version"], running,
            "the prefix was not taken"
        );
        assert_eq!(s["limiter"]["policy"]["reloads"], 0);
        assert_eq!(chat(&sluice, "k").await.1, 7);
        std::io::Write::write_all(&mut writer, rest.as_bytes()).expect("write");
        drop(writer);
        until(APPLIES_WITHIN, "the whole file", || {
            let sluice = &sluice;
            async move { (chat(sluice, "k").await.1 == 8).then_some(()) }
        })
        .await;
        let s = status(&sluice).await;
        assert_eq!(s["limiter"]["policy"]["reloads"], 1, "{s}");
        assert_eq!(s["limiter"]["policy"]["rejected"], 0, "{s}");
    })
    .await
    .expect("test timed out");
}

/// Issue "one tenant cannot hurt the others" (3): a 200 MB file moved into place was
/// rejected, yet memory grew by hundreds of MB and was not given back. Its size is now
/// read first: rejected unread, reported once, memory flat.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_an_oversized_file_is_rejected_unread_with_memory_flat() {
    tokio::time::timeout(TEST_TIMEOUT, async {
        let (dir, file, sluice) = serving(7);
        let _ = status(&sluice).await;
        let before = sluice.rss_kib();
        // 200 MB, sparse (no disk used), renamed into place as the habit says.
        let big = dir.0.join("policy.yaml.new");
        std::fs::File::create(&big)
            .and_then(|f| f.set_len(200 << 20))
            .expect("a sparse file");
        std::fs::rename(&big, &file).expect("rename");
        let rejected = until(Duration::from_secs(10), "the rejection", || {
            let sluice = &sluice;
            async move {
                let s = status(sluice).await;
                (s["limiter"]["policy"]["rejected"] == 1).then_some(s)
            }
        })
        .await;
        let error = rejected["limiter"]["policy"]["last_rejected"]["error"]
            .as_str()
            .unwrap_or("");
        assert!(
            error.contains("larger than 4194304 bytes (209715200 bytes), not read"),
            "{error}"
        );
        // A while later, the file still in place: still rejected once, memory flat.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let s = status(&sluice).await;
        assert_eq!(s["limiter"]["policy"]["rejected"], 1, "reported once");
        let grown = sluice.rss_kib().saturating_sub(before);
        assert!(
            grown < 8 * 1024,
            "RSS grew by {grown} KiB with an oversized file in place"
        );
        assert_eq!(chat(&sluice, "k").await.1, 7, "the old policy runs");
    })
    .await
    .expect("test timed out");
}

/// S1: at rest the file costs nothing (the kernel says when it changed); edits that
/// leave the length as it was, made within a moment of the last one or with the
/// modification time set back, are still noticed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_s1_edits_of_the_same_length_apply_however_soon_or_dated_back() {
    tokio::time::timeout(TEST_TIMEOUT, async {
        let (_dir, file, sluice) = serving(21);
        let limit_is = |n: u64| {
            let sluice = &sluice;
            move || async move { (chat(sluice, "k").await.1 == n).then_some(()) }
        };
        // At once after the previous edit, the same length.
        write(&file, &policy(22));
        until(APPLIES_WITHIN * 2, "the first edit", limit_is(22)).await;
        write(&file, &policy(23));
        until(APPLIES_WITHIN * 2, "an edit right after it", limit_is(23)).await;
        // Long after, at rest: the same length, the modification time set back to
        // what it was (as `cp -p` or an archive would leave it).
        let modified = std::fs::metadata(&file)
            .and_then(|m| m.modified())
            .expect("mtime");
        until(Duration::from_secs(5), "the file at rest", || async {
            let age = std::fs::metadata(&file)
                .and_then(|m| m.modified())
                .ok()?
                .elapsed()
                .ok()?;
            (age > Duration::from_millis(1500)).then_some(())
        })
        .await;
        write(&file, &policy(24));
        std::fs::File::options()
            .write(true)
            .open(&file)
            .and_then(|f| f.set_modified(modified))
            .expect("set the modification time back");
        until(APPLIES_WITHIN * 2, "an edit dated back", limit_is(24)).await;
    })
    .await
    .expect("test timed out");
}
