//! Shared helpers for the sluice binary's integration tests: run `sluice serve` as a
//! child process on free ports, read where it listens from its start line, and talk to
//! it over loopback HTTP. Every wait is bounded.
#![allow(dead_code, unreachable_pub, missing_docs)]

#[path = "../../../../tests/support/redis_server.rs"]
pub mod redis;

use std::io::{BufRead as _, BufReader, Read as _};
use std::net::SocketAddr;
use std::process::{Child, ChildStdout, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::{BodyExt as _, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

/// Longest wait for the start line.
pub const START_TIMEOUT: Duration = Duration::from_secs(30);

/// Longest wait for any one HTTP exchange made by [`send`].
pub const HTTP_TIMEOUT: Duration = Duration::from_secs(30);

/// Where a running `sluice serve` listens, as its start line says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StartLine {
    pub gateway: SocketAddr,
    pub admin: SocketAddr,
    /// The upstream URL (`http://…`), the demo's address when it is the built-in demo.
    pub upstream: String,
    pub demo: bool,
    /// The forward-auth listener (`--check`), when one runs.
    pub check: Option<std::net::SocketAddr>,
    /// Envoy's rate-limit service (`--rls`), when it runs.
    pub rls: Option<std::net::SocketAddr>,
}

/// Parses `sluice: listening on http://A (admin http://B, upstream [built-in demo at ]URL)`.
pub fn parse_start_line(line: &str) -> Option<StartLine> {
    // `https://` for a listener that speaks TLS (SPEC O5).
    let rest = line.trim().strip_prefix("sluice: listening on ")?;
    let rest = rest
        .strip_prefix("http://")
        .or_else(|| rest.strip_prefix("https://"))?;
    let (gateway, rest) = rest.split_once(" (admin ")?;
    let rest = rest
        .strip_prefix("http://")
        .or_else(|| rest.strip_prefix("https://"))?;
    let (admin, rest) = rest.split_once(", upstream ")?;
    let upstream = rest.strip_suffix(')')?;
    let (upstream, rls) = match upstream.rsplit_once(", rls grpc://") {
        Some((upstream, rls)) => (upstream, Some(rls.parse().ok()?)),
        None => (upstream, None),
    };
    let (upstream, check) = match upstream.rsplit_once(", check http://") {
        Some((upstream, check)) => (upstream, Some(check.parse().ok()?)),
        None => (upstream, None),
    };
    let (upstream, demo) = match upstream.strip_prefix("built-in demo at ") {
        Some(url) => (url, true),
        None => (upstream, false),
    };
    Some(StartLine {
        gateway: gateway.parse().ok()?,
        admin: admin.parse().ok()?,
        upstream: upstream.to_owned(),
        demo,
        check,
        rls,
    })
}

/// A running `sluice serve`; killed when dropped.
pub struct Sluice {
    child: Child,
    pub start: StartLine,
    stderr: Arc<Mutex<String>>,
    /// The data directory the helper made for it (removed on drop), when the test
    /// gave none.
    own_data_dir: Option<DataDir>,
}

/// A fresh directory under the system's temporary directory, removed on drop.
pub struct DataDir(pub std::path::PathBuf);

impl DataDir {
    pub fn new() -> Self {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        DataDir(std::env::temp_dir().join(format!(
            "sluice-test-{}-{n}-{}",
            std::process::id(),
            fastrand::u32(..)
        )))
    }

    pub fn arg(&self) -> &str {
        self.0.to_str().expect("a UTF-8 temporary path")
    }
}

impl Drop for DataDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub fn binary() -> &'static str {
    env!("CARGO_BIN_EXE_sluice")
}

/// Collects a child's stderr in the background.
fn drain_stderr(child: &mut Child) -> Arc<Mutex<String>> {
    let collected = Arc::new(Mutex::new(String::new()));
    if let Some(mut stderr) = child.stderr.take() {
        let sink = Arc::clone(&collected);
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = stderr.read(&mut buf) {
                if n == 0 {
                    break;
                }
                if let Ok(mut text) = sink.lock() {
                    text.push_str(&String::from_utf8_lossy(&buf[..n]));
                }
            }
        });
    }
    collected
}

/// Sends the first stdout line over a channel, then keeps draining stdout.
fn read_first_line(stdout: ChildStdout) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut reader = BufReader::new(stdout);
        let mut line = String::new();
        if reader.read_line(&mut line).is_ok() {
            let _ = tx.send(line);
        }
        let mut rest = String::new();
        while matches!(reader.read_line(&mut rest), Ok(n) if n > 0) {
            rest.clear();
        }
    });
    rx
}

impl Sluice {
    /// Runs `sluice serve --listen 127.0.0.1:0 --admin 127.0.0.1:0 <extra>` (`extra`'s
    /// own `--admin` in place of that one) and waits
    /// (bounded) for its start line.
    /// Without `--data-dir` in `extra`, it gets a fresh one of its own.
    pub fn spawn(extra: &[&str]) -> Sluice {
        let own_data_dir = (!extra.contains(&"--data-dir")).then(DataDir::new);
        // An `--admin` in `extra` replaces the loopback default.
        let admin: &[&str] = if extra.contains(&"--admin") {
            &[]
        } else {
            &["--admin", "127.0.0.1:0"]
        };
        let mut child = Command::new(binary())
            .args(["serve", "--listen", "127.0.0.1:0"])
            .args(admin)
            .args(extra)
            .args(
                own_data_dir
                    .as_ref()
                    .map(|d| vec!["--data-dir", d.arg()])
                    .unwrap_or_default(),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn sluice");
        let stderr = drain_stderr(&mut child);
        let stdout = child.stdout.take().expect("piped stdout");
        let line = read_first_line(stdout).recv_timeout(START_TIMEOUT);
        let line = match line {
            Ok(line) => line,
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                let err = stderr.lock().map(|s| s.clone()).unwrap_or_default();
                panic!("sluice printed no start line within {START_TIMEOUT:?}; stderr: {err}");
            }
        };
        let Some(start) = parse_start_line(&line) else {
            let _ = child.kill();
            let status = child.wait();
            let err = stderr.lock().map(|s| s.clone()).unwrap_or_default();
            panic!("unexpected start line: {line:?} (exit: {status:?}); stderr: {err}");
        };
        Sluice {
            child,
            start,
            stderr,
            own_data_dir,
        }
    }

    /// A URL on the gateway.
    pub fn url(&self, path_and_query: &str) -> String {
        format!("http://{}{path_and_query}", self.start.gateway)
    }

    /// A URL on the admin listener.
    pub fn check_url(&self, path_and_query: &str) -> String {
        let check = self.start.check.expect("started with --check");
        format!("http://{check}{path_and_query}")
    }

    pub fn admin_url(&self, path_and_query: &str) -> String {
        format!("http://{}{path_and_query}", self.start.admin)
    }

    /// The child's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// What the child wrote to stderr so far.
    pub fn stderr(&self) -> String {
        self.stderr.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// What the child wrote to stderr, once it holds at least `n` lines that
    /// `pick` takes (or after 10 s): a line logged before an answer may reach
    /// the reader thread after the answer reaches the test.
    pub async fn stderr_with(&self, n: usize, pick: impl Fn(&str) -> bool) -> String {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            let text = self.stderr();
            if text.lines().filter(|l| pick(l)).count() >= n
                || std::time::Instant::now() >= deadline
            {
                return text;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    }

    /// The child's resident memory in KiB (`VmRSS` of /proc/PID/status).
    pub fn rss_kib(&self) -> u64 {
        std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .ok()
            .and_then(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("VmRSS:"))
                    .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            })
            .expect("VmRSS of the child")
    }

    /// Sends the signal `name` (`HUP`, `TERM`, …) to the child.
    pub fn signal(&self, name: &str) {
        let status = Command::new("kill")
            .args([&format!("-{name}"), &self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -{name} failed");
    }

    /// Sends SIGTERM to the child.
    pub fn terminate(&self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -TERM failed");
    }

    /// Sends SIGKILL to the child and waits for it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Waits up to `timeout` for the child to exit.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        wait_child(&mut self.child, timeout)
    }
}

impl Drop for Sluice {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

/// Polls `child` until it exits or `timeout` passes.
fn wait_child(child: &mut Child, timeout: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Some(status);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// What a one-shot run of the binary produced.
pub struct Finished {
    pub status: ExitStatus,
    pub stderr: String,
}

/// Runs `sluice <args>` expecting it to exit by itself within `timeout`.
pub fn run_to_exit(args: &[&str], timeout: Duration) -> Finished {
    let mut child = Command::new(binary())
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn sluice");
    let stderr = drain_stderr(&mut child);
    let status = match wait_child(&mut child, timeout) {
        Some(status) => status,
        None => {
            let _ = child.kill();
            let _ = child.wait();
            panic!("sluice {args:?} did not exit within {timeout:?}");
        }
    };
    // The drain thread ends at EOF, which follows the exit; give it a bounded moment.
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut text = String::new();
    while Instant::now() < deadline {
        text = stderr.lock().map(|s| s.clone()).unwrap_or_default();
        if Arc::strong_count(&stderr) == 1 {
            break;
        }
        std::thread::yield_now();
    }
    Finished {
        status,
        stderr: text,
    }
}

/// A running `sluice pace`, where it listens as its start line says; killed on drop.
pub struct Pace {
    child: Child,
    /// The proxy's address.
    pub listen: String,
    /// The admin listener's address.
    pub admin: String,
}

impl Pace {
    /// `sluice pace --listen 127.0.0.1:0 --admin 127.0.0.1:0 --store STORE --config CONFIG`.
    pub fn spawn(config: &std::path::Path, store: &str) -> Pace {
        Self::spawn_with(config, &["--admin", "127.0.0.1:0", "--store", store])
    }

    /// `sluice pace --listen 127.0.0.1:0 <args> --config CONFIG`, once it has printed
    /// its start line (bounded wait).
    pub fn spawn_with(config: &std::path::Path, args: &[&str]) -> Pace {
        let mut child = Command::new(binary())
            .args(["pace", "--listen", "127.0.0.1:0"])
            .args(args)
            .arg("--config")
            .arg(config)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn sluice pace");
        let stdout = child.stdout.take().expect("piped stdout");
        let line = read_first_line(stdout)
            .recv_timeout(START_TIMEOUT)
            .expect("pace start line");
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

    /// The child's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Pace {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A plain HTTP/1.1 client for the tests.
pub fn client() -> Client<HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new()).build(HttpConnector::new())
}

/// A whole response.
#[derive(Debug)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    /// The body as JSON (panics with the body if it is not).
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", self.body))
    }

    /// A header as text, if present.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// The body as text.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// Sends `request` and reads the whole response, within [`HTTP_TIMEOUT`].
pub async fn send(request: Request<Full<Bytes>>) -> Reply {
    let exchange = async {
        let response = client().request(request).await.expect("HTTP request");
        let (parts, body) = response.into_parts();
        let body = body.collect().await.expect("response body").to_bytes();
        Reply {
            status: parts.status,
            headers: parts.headers,
            body,
        }
    };
    tokio::time::timeout(HTTP_TIMEOUT, exchange)
        .await
        .expect("HTTP exchange timed out")
}

/// Sends `request` and returns the response with its body still streaming.
pub async fn open(request: Request<Full<Bytes>>) -> http::Response<Incoming> {
    tokio::time::timeout(HTTP_TIMEOUT, client().request(request))
        .await
        .expect("response headers timed out")
        .expect("HTTP request")
}

/// `GET url`.
pub async fn get(url: &str) -> Reply {
    send(
        Request::get(url)
            .body(Full::new(Bytes::new()))
            .expect("request"),
    )
    .await
}

/// `POST url` with a JSON body.
pub async fn post_json(url: &str, body: &Value) -> Reply {
    send(
        Request::post(url)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.to_string())))
            .expect("request"),
    )
    .await
}

#[test]
fn start_lines_parse() {
    let line = "sluice: listening on http://127.0.0.1:8080 (admin http://127.0.0.1:9090, upstream built-in demo at http://127.0.0.1:40000)\n";
    let start = parse_start_line(line).expect("parses");
    assert_eq!(start.gateway.port(), 8080);
    assert_eq!(start.admin.port(), 9090);
    assert_eq!(start.upstream, "http://127.0.0.1:40000");
    assert!(start.demo);
    let line =
        "sluice: listening on http://[::1]:1 (admin http://[::1]:2, upstream http://up:3/api)";
    let start = parse_start_line(line).expect("parses");
    assert_eq!(start.upstream, "http://up:3/api");
    assert!(!start.demo);
    assert_eq!(start.check, None);
    let line = "sluice: listening on http://127.0.0.1:1 (admin http://127.0.0.1:2, upstream http://up:3, check http://127.0.0.1:4)";
    let start = parse_start_line(line).expect("parses");
    assert_eq!(start.upstream, "http://up:3");
    assert_eq!(start.check.map(|c| c.port()), Some(4));
    let line = "sluice: listening on http://127.0.0.1:1 (admin http://127.0.0.1:2, upstream http://up:3, check http://127.0.0.1:4, rls grpc://127.0.0.1:5)";
    let start = parse_start_line(line).expect("parses");
    assert_eq!(start.check.map(|c| c.port()), Some(4));
    assert_eq!(start.rls.map(|c| c.port()), Some(5));
}

/// The lower-case hex SHA-256 of `secret`, as the key table and the tenants API name
/// a credential.
pub fn sha256_hex(secret: &str) -> String {
    use sha2::Digest as _;
    hex::encode(sha2::Sha256::digest(secret.as_bytes()))
}
