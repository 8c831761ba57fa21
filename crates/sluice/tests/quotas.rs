//! Monthly quotas in a real `sluice serve` process (SPEC Q1, Q2, D1): counts that
//! survive `kill -9`, the warehouse budget on the HTTP/1.1 fast path against the
//! demo upstream, and clear errors for a data directory that cannot be used.

use crate::edit;
use edit::Edit as _;

use crate::support;

use std::io::{BufRead as _, BufReader, Read as _, Write as _};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use support::{DataDir, Sluice, get, run_to_exit};

/// Client connections sending at once during the crash test: the most calls that
/// can be counted but not forwarded when the process dies.
const CONCURRENCY: usize = 16;

/// A policy file: the built-in policy with room for load, the key `sk-crash` owned
/// by workspace `acme`, and `edit` applied.
fn policy_file(dir: &DataDir, edit: impl FnOnce(String) -> String) -> String {
    std::fs::create_dir_all(&dir.0).expect("dir");
    let sha = hex::encode(<sha2::Sha256 as sha2::Digest>::digest(b"sk-crash"));
    let yaml = sluice_policy::DEFAULT_POLICY_YAML
        .edit(
            "classes: { protocol: 600, read: 300, standard: 60, expensive: 30 }",
            "classes: { protocol: 600, read: 300, standard: 10000000, expensive: 30 }",
        )
        .edit(
            "ip_ceilings: { ip: 300, ip_protocol: 1200 }",
            "ip_ceilings: { ip: 10000000, ip_protocol: 1200 }",
        )
        .edit(
            "  keys: []",
            &format!("  keys:\n    - {{ sha256: {sha}, workspace: acme, user: ada }}"),
        );
    let path = dir.0.join("policy.yaml");
    std::fs::write(&path, edit(yaml)).expect("write policy");
    path.to_str().expect("utf-8").to_owned()
}

/// An upstream that counts the `POST /evals` it received in whole and answers each
/// `200 {}`; `open` counts its live connections.
struct CountingUpstream {
    port: u16,
    received: Arc<AtomicUsize>,
    open: Arc<AtomicUsize>,
}

impl CountingUpstream {
    fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let received = Arc::new(AtomicUsize::new(0));
        let open = Arc::new(AtomicUsize::new(0));
        let (r, o) = (Arc::clone(&received), Arc::clone(&open));
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let (r, o) = (Arc::clone(&r), Arc::clone(&o));
                o.fetch_add(1, Ordering::SeqCst);
                std::thread::spawn(move || {
                    let _ = serve_counting(stream, &r);
                    o.fetch_sub(1, Ordering::SeqCst);
                });
            }
        });
        CountingUpstream {
            port,
            received,
            open,
        }
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The count once every connection to it has closed (bounded wait).
    fn settled(&self) -> usize {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.open.load(Ordering::SeqCst) > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        self.received.load(Ordering::SeqCst)
    }
}

/// Reads one request head and its `Content-Length` body; `None` at the end.
fn read_request(reader: &mut BufReader<TcpStream>) -> Option<(String, Vec<u8>)> {
    let mut head = String::new();
    let mut length = 0usize;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).ok()? == 0 {
            return None;
        }
        if line == "\r\n" {
            break;
        }
        if let Some((name, value)) = line.split_once(':')
            && name.eq_ignore_ascii_case("content-length")
        {
            length = value.trim().parse().ok()?;
        }
        head.push_str(&line);
    }
    let mut body = vec![0; length];
    reader.read_exact(&mut body).ok()?;
    Some((head, body))
}

fn serve_counting(stream: TcpStream, received: &AtomicUsize) -> std::io::Result<()> {
    let mut writer = stream.try_clone()?;
    let mut reader = BufReader::new(stream);
    while let Some((head, _)) = read_request(&mut reader) {
        if head.starts_with("POST /evals ") {
            received.fetch_add(1, Ordering::SeqCst);
        }
        writer.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")?;
    }
    Ok(())
}

/// Sends `POST /evals` on one kept-alive connection until `stop` or an error.
fn hammer(gateway: std::net::SocketAddr, stop: &AtomicBool) {
    let Ok(stream) = TcpStream::connect(gateway) else {
        return;
    };
    let Ok(mut writer) = stream.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(stream);
    let request = b"POST /evals HTTP/1.1\r\nhost: sluice\r\nx-api-key: sk-crash\r\ncontent-length: 2\r\n\r\n{}";
    while !stop.load(Ordering::Relaxed) {
        if writer.write_all(request).is_err() {
            return;
        }
        // The response: a status line, fields, and a Content-Length body.
        if read_request(&mut reader).is_none() {
            return;
        }
    }
    let _ = writer.shutdown(Shutdown::Both);
}

async fn usage(sluice: &Sluice, family: &str) -> u64 {
    let r = get(&sluice.admin_url("/quotas?workspace=acme")).await;
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["quotas"]
        .as_array()
        .and_then(|q| q.iter().find(|q| q["family"] == family))
        .and_then(|q| q["usage"].as_u64())
        .unwrap_or_else(|| panic!("no {family} in {}", r.text()))
}

/// One round: load, SIGKILL at a random moment, restart on the same data dir.
/// Returns (calls the upstream received, usage stored after the restart).
async fn crash_round(round: usize, sync: &str) -> (usize, u64) {
    let dir = DataDir::new();
    let policy = policy_file(&dir, |y| y);
    let upstream = CountingUpstream::start();
    let args = [
        "--config",
        &policy,
        "--upstream",
        &upstream.url(),
        "--data-dir",
        dir.arg(),
        "--quota-sync",
        sync,
    ];
    let mut sluice = Sluice::spawn(&args);
    let gateway = sluice.start.gateway;
    let stop = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..CONCURRENCY)
        .map(|_| {
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || hammer(gateway, &stop))
        })
        .collect();
    // The load under way first (a loaded machine may take a while to serve the
    // first call), then a random moment of it: what is killed is whatever is in
    // flight then.
    let deadline = Instant::now() + Duration::from_secs(20);
    while upstream.received.load(Ordering::SeqCst) == 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let moment = Duration::from_millis(150 + fastrand::u64(..500) + 37 * round as u64 % 100);
    tokio::time::sleep(moment).await;
    sluice.kill();
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        let _ = c.join();
    }
    let received = upstream.settled();
    drop(sluice);
    let restarted = Sluice::spawn(&args);
    let stored = usage(&restarted, "evals").await;
    (received, stored)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn q1_kill_9_under_load_loses_no_count() {
    let rounds: usize = std::env::var("SLUICE_CRASH_ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(3);
    let mut worst = 0;
    for round in 0..rounds {
        // Every third round writes counts to the operating system only
        // (`--quota-sync write`): a process crash loses none of those either.
        let sync = if round % 3 == 1 { "write" } else { "flush" };
        let (received, stored) = crash_round(round, sync).await;
        let slack = stored as i64 - received as i64;
        eprintln!(
            "crash round {round} ({sync}): upstream received {received}, stored usage {stored}, slack {slack}"
        );
        assert!(received > 0, "round {round}: the load reached the upstream");
        assert!(
            stored >= received as u64,
            "round {round}: {received} calls forwarded but only {stored} counted"
        );
        assert!(
            stored <= (received + CONCURRENCY) as u64,
            "round {round}: {stored} counted for {received} forwarded and at most {CONCURRENCY} in flight"
        );
        worst = worst.max(slack);
    }
    eprintln!("crash rounds: {rounds}, worst slack {worst} (bound {CONCURRENCY})");
}

/// Sends one `POST /search/query` with `sql` over a plain HTTP/1.1 connection (the
/// fast path), returning the status line, the fields, and the body.
fn warehouse_query(gateway: std::net::SocketAddr, sql: &str) -> (String, String, String) {
    let body = format!("{{\"sql\":\"{sql}\"}}");
    let mut stream = TcpStream::connect(gateway).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    write!(
        stream,
        "POST /search/query HTTP/1.1\r\nhost: sluice\r\nx-api-key: sk-q2\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .expect("write");
    let mut answer = String::new();
    stream.read_to_string(&mut answer).expect("read");
    let (head, body) = answer.split_once("\r\n\r\n").expect("a head");
    let (status, fields) = head.split_once("\r\n").unwrap_or((head, ""));
    (
        status.to_owned(),
        fields.to_ascii_lowercase(),
        body.to_owned(),
    )
}

fn field<'a>(fields: &'a str, name: &str) -> &'a str {
    fields
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(": "))
        .unwrap_or("")
}

#[test]
fn q2_the_demo_warehouse_on_the_fast_path_runs_the_seeds_example() {
    let sluice = Sluice::spawn(&[]);
    let gateway = sluice.start.gateway;
    let tag = fastrand::u64(..);
    // Two JOINs: the demo warehouse spends three reads a query.
    for (i, left) in [7, 4, 1].into_iter().enumerate() {
        let (status, fields, _) = warehouse_query(
            gateway,
            &format!("select {tag} from a join b join c -- {i}"),
        );
        assert!(status.ends_with("200 OK"), "{status}");
        assert_eq!(field(&fields, "x-ratelimit-limit"), "10");
        assert_eq!(field(&fields, "x-ratelimit-remaining"), left.to_string());
        assert_eq!(field(&fields, "x-sluice-cost"), "", "never relayed");
    }
    // The same query again is a cache hit: nothing spent.
    let (_, fields, body) =
        warehouse_query(gateway, &format!("select {tag} from a join b join c -- 0"));
    assert!(body.contains("\"cached\":true"), "{body}");
    assert_eq!(field(&fields, "x-ratelimit-remaining"), "1");
    // One unit left admits a query of two reads; the next is refused.
    let (status, fields, _) = warehouse_query(gateway, &format!("select {tag} from a join b"));
    assert!(status.ends_with("200 OK"), "{status}");
    assert_eq!(field(&fields, "x-ratelimit-remaining"), "0");
    let (status, fields, body) = warehouse_query(gateway, &format!("select {tag} -- late"));
    assert!(status.contains(" 429 "), "{status}");
    let wait = field(&fields, "retry-after").to_owned();
    assert!(!wait.is_empty());
    assert!(
        body.contains(&format!(
            "Rate limit exceeded. Maximum 10 queries per minute. Try again in {wait} seconds."
        )),
        "{body}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn q1_usage_survives_a_graceful_restart_and_the_admin_can_reset_it() {
    let dir = DataDir::new();
    let policy = policy_file(&dir, |y| {
        y.edit("messages: { monthly: 1000 }", "messages: { monthly: 2 }")
    });
    let args = ["--config", policy.as_str(), "--data-dir", dir.arg()];
    let first = Sluice::spawn(&args);
    let send = |url: String| async move {
        support::send(
            http::Request::post(url)
                .header("x-api-key", "sk-crash")
                // The admin takes a change with a body only as JSON (SPEC S2).
                .header("content-type", "application/json")
                .body(http_body_util::Full::new(bytes::Bytes::from_static(b"{}")))
                .expect("request"),
        )
        .await
    };
    for _ in 0..2 {
        assert_eq!(send(first.url("/messages/optimize")).await.status, 200);
    }
    first.terminate();
    drop(first);
    let second = Sluice::spawn(&args);
    assert_eq!(usage(&second, "messages").await, 2);
    let refused = send(second.url("/messages/optimize")).await;
    assert_eq!(refused.status, 429);
    assert_eq!(refused.json()["error"]["code"], "quota_exceeded");
    // Only the admin listener resets; the gateway does not serve the admin's paths.
    let _ = send(second.url("/quotas/reset?workspace=acme")).await;
    assert_eq!(
        usage(&second, "messages").await,
        2,
        "the gateway only forwarded it"
    );
    let r = send(second.admin_url("/quotas/reset?workspace=acme&family=messages")).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(usage(&second, "messages").await, 0);
    assert_eq!(send(second.url("/messages/optimize")).await.status, 200);
    // Bad questions get clear answers.
    let r = get(&second.admin_url("/quotas")).await;
    assert_eq!(r.status, 400);
    let r = send(second.admin_url("/quotas/reset?workspace=acme&family=nope")).await;
    assert_eq!(r.status, 400);
    assert!(r.text().contains("nope"), "{}", r.text());
}

/// Runs `sluice serve` on `dir`, expecting it to stop by itself.
fn serve_to_exit(dir: &DataDir) -> support::Finished {
    run_to_exit(
        &[
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--admin",
            "127.0.0.1:0",
            "--data-dir",
            dir.arg(),
        ],
        Duration::from_secs(30),
    )
}

#[test]
fn a_data_dir_in_use_corrupt_or_not_a_directory_stops_the_start_with_exit_2() {
    let dir = DataDir::new();
    let first = Sluice::spawn(&["--data-dir", dir.arg()]);
    let second = serve_to_exit(&dir);
    assert_eq!(second.status.code(), Some(2), "{}", second.stderr);
    assert!(second.stderr.contains(dir.arg()), "{}", second.stderr);
    assert!(second.stderr.contains("in use"), "{}", second.stderr);
    drop(first);

    let corrupt = DataDir::new();
    std::fs::create_dir_all(&corrupt.0).expect("dir");
    std::fs::write(corrupt.0.join("sluice.redb"), vec![0x42; 8192]).expect("write");
    let run = serve_to_exit(&corrupt);
    assert_eq!(run.status.code(), Some(2), "{}", run.stderr);
    assert!(run.stderr.contains("sluice.redb"), "{}", run.stderr);

    let file = DataDir::new();
    std::fs::write(&file.0, b"not a directory").expect("write");
    let run = serve_to_exit(&file);
    assert_eq!(run.status.code(), Some(2), "{}", run.stderr);
    assert!(run.stderr.contains(file.arg()), "{}", run.stderr);
}
