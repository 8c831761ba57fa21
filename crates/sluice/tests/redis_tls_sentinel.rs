//! Redis where users run it encrypted or highly available (SPEC D1, D3), against real
//! processes: `rediss://` to a `redis-server` with TLS only, its CA and certificates
//! made with the `openssl` command at test time; `redis+sentinel://` to a master, a
//! replica and three `redis-sentinel` processes (Debian's `redis-sentinel` package),
//! whose failover under load follows the outage rule and recovers without a restart.
//!
//! A test whose tools are missing is skipped with a message, unless `CI` is set:
//! there it fails (`scripts/test` installs them).

use crate::edit;
use edit::Edit as _;

use crate::support;

use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use support::{DataDir, Sluice, run_to_exit, send};

/// The sentinel tests start eight processes each and time a failover: one at a time.
static ONE_GROUP_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The longest a failover may take, from the master's death (or the `SENTINEL
/// FAILOVER` command) to decisions made by Redis again.
const RECOVERY_BOUND: Duration = Duration::from_secs(15);

/// The longest any one request may take, outage or not: the store timeout (100 ms in
/// these policies) and the breaker keep every answer far below it.
const ANSWER_BOUND: Duration = Duration::from_secs(1);

/// Whether every program in `names` can be started. When one cannot, the test is
/// skipped with a message, or fails when `CI` is set.
fn tools_present(names: &[&str]) -> bool {
    let missing: Vec<&str> = names
        .iter()
        .copied()
        .filter(|name| {
            Command::new(name)
                .arg("--version")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_err()
        })
        .collect();
    if missing.is_empty() {
        return true;
    }
    let ci = std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "false" && v != "0");
    assert!(
        !ci,
        "CI is set and {missing:?} cannot be run: scripts/test installs them"
    );
    eprintln!("SKIPPED: {missing:?} not installed (scripts/test installs them)");
    false
}

/// A free loopback port (bound, then released for the child to take).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// Polls `done` every 20 ms until it holds, or panics naming `what` past `within`.
fn wait_until(what: &str, within: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !done() {
        assert!(Instant::now() < deadline, "{what}: not within {within:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A child process, killed (SIGKILL) when dropped.
struct Process {
    child: Option<Child>,
}

impl Process {
    /// Runs `program args`, its output to `log`.
    fn start(program: &str, args: &[String], log: &Path) -> Process {
        let out = std::fs::File::create(log).expect("log file");
        let err = out.try_clone().expect("log file");
        let child = Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("{program}: {e}"));
        Process { child: Some(child) }
    }

    /// SIGKILL, as a crash would.
    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
    }
}

/// `redis-cli -p PORT ARGS`, its output (a stopped server refuses at once).
fn cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .args(["-p", &port.to_string()])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("redis-cli");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A field of `redis-cli`'s answer to `SENTINEL MASTER` (name and value on
/// alternate lines).
fn field<'a>(answer: &'a str, name: &str) -> Option<&'a str> {
    let mut lines = answer.lines();
    while let Some(line) = lines.next() {
        if line.trim() == name {
            return lines.next().map(str::trim);
        }
    }
    None
}

/// `EVALSHA` and `EVAL` calls a server has served.
fn script_calls(port: u16) -> u64 {
    support::redis::calls(
        &cli(port, &["INFO", "commandstats"]),
        support::redis::is_script,
    )
}

/// The master name the sentinels monitor.
const MASTER: &str = "sluice";

/// A master, its replica and three sentinels on free loopback ports, with a
/// failover detected after 1 s.
struct SentinelGroup {
    dir: DataDir,
    master: Process,
    master_port: u16,
    _replica: Process,
    replica_port: u16,
    _sentinels: Vec<Process>,
    sentinel_ports: Vec<u16>,
}

impl SentinelGroup {
    fn start() -> SentinelGroup {
        let dir = DataDir::new();
        std::fs::create_dir_all(&dir.0).expect("temp dir");
        let server = |name: &str, port: u16, extra: &[&str]| {
            let sub = dir.0.join(name);
            std::fs::create_dir_all(&sub).expect("server dir");
            let mut args: Vec<String> = [
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
            ]
            .iter()
            .map(|s| (*s).to_owned())
            .collect();
            args.push(sub.display().to_string());
            args.extend(extra.iter().map(|s| (*s).to_owned()));
            Process::start("redis-server", &args, &sub.join("log"))
        };
        let master_port = free_port();
        let master = server("master", master_port, &[]);
        wait_until("the master answers", Duration::from_secs(10), || {
            cli(master_port, &["PING"]).contains("PONG")
        });
        let replica_port = free_port();
        let master_port_text = master_port.to_string();
        let replica = server(
            "replica",
            replica_port,
            &["--replicaof", "127.0.0.1", &master_port_text],
        );
        wait_until("the replica syncs", Duration::from_secs(20), || {
            cli(replica_port, &["INFO", "replication"]).contains("master_link_status:up")
        });
        let mut sentinels = Vec::new();
        let mut sentinel_ports = Vec::new();
        for i in 0..3 {
            let port = free_port();
            let sub = dir.0.join(format!("sentinel-{i}"));
            std::fs::create_dir_all(&sub).expect("sentinel dir");
            let conf = sub.join("sentinel.conf");
            std::fs::write(
                &conf,
                format!(
                    "port {port}\nbind 127.0.0.1\ndir {}\n\
                     sentinel monitor {MASTER} 127.0.0.1 {master_port} 2\n\
                     sentinel down-after-milliseconds {MASTER} 1000\n\
                     sentinel failover-timeout {MASTER} 5000\n\
                     sentinel parallel-syncs {MASTER} 1\n",
                    sub.display()
                ),
            )
            .expect("sentinel.conf");
            sentinels.push(Process::start(
                "redis-sentinel",
                &[conf.display().to_string()],
                &sub.join("log"),
            ));
            sentinel_ports.push(port);
        }
        // A failover needs a majority of sentinels that know each other, and the replica.
        for &port in &sentinel_ports {
            wait_until(
                "each sentinel knows the other two and the replica",
                Duration::from_secs(30),
                || {
                    let answer = cli(port, &["SENTINEL", "MASTER", MASTER]);
                    field(&answer, "num-other-sentinels") == Some("2")
                        && field(&answer, "num-slaves") == Some("1")
                },
            );
        }
        SentinelGroup {
            dir,
            master,
            master_port,
            _replica: replica,
            replica_port,
            _sentinels: sentinels,
            sentinel_ports,
        }
    }

    /// `redis+sentinel://S1,S2,S3/sluice`.
    fn url(&self) -> String {
        let nodes: Vec<String> = self
            .sentinel_ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        format!("redis+sentinel://{}/{MASTER}", nodes.join(","))
    }

    /// The master's port, as the first sentinel names it.
    fn named_master(&self) -> Option<u16> {
        cli(
            self.sentinel_ports[0],
            &["SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER],
        )
        .lines()
        .nth(1)?
        .trim()
        .parse()
        .ok()
    }
}

/// The built-in policy with `edit`, in a file of its own.
fn policy(dir: &Path, name: &str, edit: impl FnOnce(String) -> String) -> String {
    let path = dir.join(name);
    std::fs::write(&path, edit(sluice_policy::DEFAULT_POLICY_YAML.to_owned())).expect("policy");
    path.to_str().expect("utf-8 path").to_owned()
}

/// For the failover tests: limits no load here reaches, a 100 ms store timeout, two
/// replicas (so a local decision shows half the limit), expensive calls fail closed
/// and reads fail open.
fn failover_policy(dir: &Path) -> String {
    policy(dir, "failover.yaml", |y| {
        y.edit(
            "classes: { protocol: 600, read: 300, standard: 60, expensive: 30 }",
            "classes: { protocol: 600, read: 100000, standard: 60, expensive: 100000 }",
        )
        .edit(
            "ip_ceilings: { ip: 300, ip_protocol: 1200 }",
            "ip_ceilings: { ip: 200000, ip_protocol: 1200 }",
        )
        .edit("expensive: fail_open }", "expensive: fail_closed }")
        .edit("timeout_ms: 20", "timeout_ms: 100")
        .edit("replicas: 1", "replicas: 2")
    })
}

/// The read limit Redis reports, and the one a replica reports alone (÷ 2 replicas).
const SHARED_LIMIT: &str = "100000";
const LOCAL_LIMIT: &str = "50000";

/// One answer under load.
#[derive(Clone, Debug)]
struct Answer {
    sent: Instant,
    took: Duration,
    expensive: bool,
    status: u16,
    limit: Option<String>,
    code: Option<String>,
}

impl Answer {
    /// Decided by Redis: an expensive call admitted (it fails closed otherwise), a
    /// read with the shared limit.
    fn by_redis(&self) -> bool {
        self.status == 200 && (self.expensive || self.limit.as_deref() == Some(SHARED_LIMIT))
    }

    /// What the outage rule allows: expensive calls 200 or 503 `limiter_unavailable`,
    /// reads 200 with the shared or the local limit.
    fn follows_the_rule(&self) -> bool {
        if self.expensive {
            self.status == 200
                || (self.status == 503 && self.code.as_deref() == Some("limiter_unavailable"))
        } else {
            self.status == 200 && matches!(self.limit.as_deref(), Some(SHARED_LIMIT | LOCAL_LIMIT))
        }
    }
}

/// Workers sending expensive calls and reads to `sluice` until stopped.
struct Load {
    answers: Arc<Mutex<Vec<Answer>>>,
    stop: Arc<AtomicBool>,
    workers: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    fn start(sluice: &Sluice, workers: usize) -> Load {
        let answers = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let workers = (0..workers)
            .map(|w| {
                let (answers, stop) = (Arc::clone(&answers), Arc::clone(&stop));
                let chats = sluice.url("/chats");
                let fields = sluice.url("/search/fields");
                tokio::spawn(async move {
                    let key = format!("sk-load-{w}");
                    while !stop.load(Ordering::Relaxed) {
                        for (url, expensive) in [(&chats, true), (&fields, false)] {
                            let method = if expensive { "POST" } else { "GET" };
                            let sent = Instant::now();
                            let reply = send(
                                Request::builder()
                                    .method(method)
                                    .uri(url.as_str())
                                    .header("x-api-key", key.as_str())
                                    .body(Full::new(Bytes::from_static(b"{}")))
                                    .expect("request"),
                            )
                            .await;
                            let answer = Answer {
                                sent,
                                took: sent.elapsed(),
                                expensive,
                                status: reply.status.as_u16(),
                                limit: reply.header("x-ratelimit-limit").map(str::to_owned),
                                code: serde_json::from_slice::<serde_json::Value>(&reply.body)
                                    .ok()
                                    .and_then(|v| v["error"]["code"].as_str().map(str::to_owned)),
                            };
                            answers.lock().expect("answers").push(answer);
                        }
                    }
                })
            })
            .collect();
        Load {
            answers,
            stop,
            workers,
        }
    }

    fn since(&self, from: Instant) -> Vec<Answer> {
        self.answers
            .lock()
            .expect("answers")
            .iter()
            .filter(|a| a.sent >= from)
            .cloned()
            .collect()
    }

    async fn stop(self) -> Vec<Answer> {
        self.stop.store(true, Ordering::Relaxed);
        for w in self.workers {
            w.await.expect("worker");
        }
        self.answers.lock().expect("answers").clone()
    }
}

/// Waits (bounded, polling) until requests sent after `from` are decided by Redis
/// again; returns when the first of them was sent.
async fn first_decided_by_redis_after(load: &Load, from: Instant) -> Instant {
    loop {
        if let Some(a) = load.since(from).iter().find(|a| a.by_redis()) {
            return a.sent;
        }
        assert!(
            from.elapsed() < RECOVERY_BOUND,
            "no decision by Redis within {RECOVERY_BOUND:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Every answer followed the outage rule within [`ANSWER_BOUND`]; the slowest.
fn assert_every_answer_bounded(answers: &[Answer]) -> Duration {
    for a in answers {
        assert!(
            a.follows_the_rule(),
            "an answer outside the outage rule: {a:?}"
        );
        assert!(a.took < ANSWER_BOUND, "a request took {:?}: {a:?}", a.took);
    }
    answers.iter().map(|a| a.took).max().unwrap_or_default()
}

/// SPEC D3 with Sentinel: the master is killed under load; while no master answers,
/// expensive calls fail closed (503) and reads fail open on this replica's share, none
/// waiting past the store timeout; once the sentinels promote the replica, the same
/// sluice process decides on it again, within 15 s of the kill.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d3_sentinel_master_killed_under_load_fails_per_the_outage_rule_then_follows_the_new_master()
 {
    if !tools_present(&["redis-server", "redis-sentinel", "redis-cli"]) {
        return;
    }
    let _one = ONE_GROUP_AT_A_TIME.lock().await;
    let mut group = SentinelGroup::start();
    let policy = failover_policy(&group.dir.0);
    let sluice = Sluice::spawn(&["--config", &policy, "--store", &group.url()]);
    let load = Load::start(&sluice, 6);
    let warm = Instant::now();
    first_decided_by_redis_after(&load, warm).await;
    assert!(
        script_calls(group.master_port) > 0,
        "decisions on the master"
    );

    group.master.kill();
    let killed = Instant::now();
    // The outage shows: an expensive call answered 503 by the outage rule.
    loop {
        if load.since(killed).iter().any(|a| a.status == 503) {
            break;
        }
        assert!(
            killed.elapsed() < RECOVERY_BOUND,
            "no outage answer after the kill"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let outage_seen = Instant::now();
    let recovered = first_decided_by_redis_after(&load, outage_seen).await;
    let took = recovered.duration_since(killed);
    // Decided by Redis from then on, a second later, through the promoted replica.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let answers = load.stop().await;
    let slowest = assert_every_answer_bounded(&answers);
    let settled = recovered + Duration::from_secs(1);
    let late: Vec<&Answer> = answers.iter().filter(|a| a.sent >= settled).collect();
    assert!(!late.is_empty(), "requests after the recovery");
    for a in &late {
        assert!(
            a.by_redis(),
            "after the recovery, every decision is Redis's: {a:?}"
        );
    }
    let failed_closed = answers
        .iter()
        .filter(|a| a.sent >= killed && a.expensive && a.status == 503)
        .count();
    let local_reads = answers
        .iter()
        .filter(|a| a.sent >= killed && a.limit.as_deref() == Some(LOCAL_LIMIT))
        .count();
    assert!(failed_closed > 0, "expensive calls failed closed meanwhile");
    assert_eq!(group.named_master(), Some(group.replica_port), "promoted");
    assert!(
        script_calls(group.replica_port) > 0,
        "decisions on the promoted replica"
    );
    assert!(
        sluice.stderr().contains("the sentinels name a new master"),
        "{}",
        sluice.stderr()
    );
    println!(
        "failover after SIGKILL: decisions by Redis again {took:?} after the kill \
         ({} answers, {failed_closed} expensive 503, {local_reads} reads on the local \
         share, slowest answer {slowest:?})",
        answers.len()
    );
    assert!(took < RECOVERY_BOUND, "recovered {took:?} after the kill");
}

/// SPEC D3 with Sentinel: `SENTINEL FAILOVER` demotes a live master (it answers
/// `READONLY` from then on); sluice follows the promoted replica by itself, every
/// answer meanwhile per the outage rule and bounded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d3_sentinel_failover_command_moves_decisions_to_the_promoted_replica() {
    if !tools_present(&["redis-server", "redis-sentinel", "redis-cli"]) {
        return;
    }
    let _one = ONE_GROUP_AT_A_TIME.lock().await;
    let group = SentinelGroup::start();
    let policy = failover_policy(&group.dir.0);
    let sluice = Sluice::spawn(&["--config", &policy, "--store", &group.url()]);
    let load = Load::start(&sluice, 6);
    first_decided_by_redis_after(&load, Instant::now()).await;

    let asked = Instant::now();
    let answer = cli(group.sentinel_ports[1], &["SENTINEL", "FAILOVER", MASTER]);
    assert!(answer.contains("OK"), "SENTINEL FAILOVER: {answer}");
    wait_until("the replica is promoted", RECOVERY_BOUND, || {
        group.named_master() == Some(group.replica_port)
    });
    // Decisions reach the promoted replica (it served none as a replica).
    loop {
        if script_calls(group.replica_port) > 0 {
            break;
        }
        assert!(
            asked.elapsed() < RECOVERY_BOUND,
            "no decision on the promoted replica within {RECOVERY_BOUND:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let moved = Instant::now();
    let took = moved.duration_since(asked);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let answers = load.stop().await;
    let slowest = assert_every_answer_bounded(&answers);
    let settled = moved + Duration::from_secs(1);
    for a in answers.iter().filter(|a| a.sent >= settled) {
        assert!(
            a.by_redis(),
            "after the move, every decision is Redis's: {a:?}"
        );
    }
    let before = script_calls(group.master_port);
    let after = script_calls(group.replica_port);
    println!(
        "SENTINEL FAILOVER: decisions on the promoted replica {took:?} after the command \
         ({} answers, {} outside Redis, slowest answer {slowest:?}; script calls: old \
         master {before}, new master {after})",
        answers.len(),
        answers.iter().filter(|a| !a.by_redis()).count()
    );
    assert!(took < RECOVERY_BOUND, "moved {took:?} after the command");
}

/// A CA, a server certificate for 127.0.0.1 and a client certificate it signed, and a
/// second CA that signed nothing here; made with the `openssl` command.
struct Pki {
    dir: PathBuf,
}

impl Pki {
    fn make(dir: &Path) -> Pki {
        let openssl = |args: &[&str]| {
            let out = Command::new("openssl")
                .args(args)
                .current_dir(dir)
                .stdin(Stdio::null())
                .output()
                .expect("openssl");
            assert!(
                out.status.success(),
                "openssl {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        let key = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
        ];
        for ca in ["ca", "other-ca"] {
            let (k, c, subject) = (
                format!("{ca}.key"),
                format!("{ca}.crt"),
                format!("/CN={ca}"),
            );
            let mut args = vec!["req", "-x509"];
            args.extend(key);
            args.extend(["-keyout", &k, "-out", &c, "-days", "2", "-subj", &subject]);
            openssl(&args);
        }
        std::fs::write(
            dir.join("server.ext"),
            "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
        )
        .expect("server.ext");
        std::fs::write(dir.join("client.ext"), "extendedKeyUsage=clientAuth\n")
            .expect("client.ext");
        for leaf in ["server", "client"] {
            let (k, csr, c, ext) = (
                format!("{leaf}.key"),
                format!("{leaf}.csr"),
                format!("{leaf}.crt"),
                format!("{leaf}.ext"),
            );
            let subject = format!("/CN=sluice-test-{leaf}");
            let mut args = vec!["req"];
            args.extend(key);
            args.extend(["-keyout", &k, "-out", &csr, "-subj", &subject]);
            openssl(&args);
            openssl(&[
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                "ca.crt",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-out",
                &c,
                "-days",
                "2",
                "-extfile",
                &ext,
            ]);
        }
        Pki {
            dir: dir.to_owned(),
        }
    }

    fn path(&self, file: &str) -> String {
        self.dir.join(file).display().to_string()
    }
}

/// SPEC D1 over TLS: a Redis that speaks only TLS and asks for client certificates is
/// the shared store through `rediss://` with a CA file and a client certificate, and
/// admits exactly the limit; a CA that did not sign the server's certificate, or no
/// client certificate, is refused at start with a clear reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d1_a_store_over_mutual_tls_admits_exactly_the_limit_and_refuses_a_wrong_ca() {
    if !tools_present(&["redis-server", "openssl"]) {
        return;
    }
    let dir = DataDir::new();
    std::fs::create_dir_all(&dir.0).expect("temp dir");
    let pki = Pki::make(&dir.0);
    let port = free_port();
    let args: Vec<String> = [
        "--port",
        "0",
        "--tls-port",
        &port.to_string(),
        "--bind",
        "127.0.0.1",
        "--tls-cert-file",
        &pki.path("server.crt"),
        "--tls-key-file",
        &pki.path("server.key"),
        "--tls-ca-cert-file",
        &pki.path("ca.crt"),
        "--tls-auth-clients",
        "yes",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        dir.arg(),
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    let _redis = Process::start("redis-server", &args, &dir.0.join("redis.log"));
    wait_until(
        "redis-server listens for TLS",
        Duration::from_secs(10),
        || TcpStream::connect(("127.0.0.1", port)).is_ok(),
    );
    let url = |ca: &str, identity: bool| {
        let mut url = format!("rediss://127.0.0.1:{port}/0?ssl_ca_certs={}", pki.path(ca));
        if identity {
            url += &format!(
                "&ssl_certfile={}&ssl_keyfile={}",
                pki.path("client.crt"),
                pki.path("client.key")
            );
        }
        url
    };
    // Exactness is the shared store's: no local decision (fail closed), and a debug
    // build under 40 concurrent requests needs more than the default 20 ms.
    let policy = policy(&dir.0, "tls.yaml", |y| {
        y.edit(
            "window_seconds: 60\nprofiles",
            "window_seconds: 4294967295\nprofiles",
        )
        .edit("expensive: fail_open }", "expensive: fail_closed }")
        .edit("timeout_ms: 20", "timeout_ms: 2000")
    });
    let sluice = Sluice::spawn(&["--config", &policy, "--store", &url("ca.crt", true)]);
    let tasks: Vec<_> = (0..40)
        .map(|_| {
            let url = sluice.url("/chats");
            tokio::spawn(async move {
                let reply = send(
                    Request::post(url)
                        .header("x-api-key", "sk-tls")
                        .body(Full::new(Bytes::from_static(b"{}")))
                        .expect("request"),
                )
                .await;
                (reply.status.as_u16(), reply.text())
            })
        })
        .collect();
    let mut admitted = 0;
    for task in tasks {
        let (status, body) = task.await.expect("task");
        match status {
            200 => admitted += 1,
            429 => {}
            other => panic!("every call decided by Redis over TLS: {other} {body}"),
        }
    }
    assert_eq!(admitted, 30, "the expensive limit, counted in Redis");
    drop(sluice);

    let refused = |store: &str| {
        let data = DataDir::new();
        let run = run_to_exit(
            &[
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--admin",
                "127.0.0.1:0",
                "--data-dir",
                data.arg(),
                "--config",
                &policy,
                "--store",
                store,
            ],
            Duration::from_secs(30),
        );
        assert!(!run.status.success(), "started with {store}");
        run.stderr
    };
    let wrong_ca = refused(&url("other-ca.crt", true));
    assert!(
        wrong_ca.contains("connecting to the store rediss://")
            && wrong_ca.contains("invalid peer certificate: UnknownIssuer"),
        "{wrong_ca}"
    );
    let no_identity = refused(&url("ca.crt", false));
    assert!(no_identity.contains("CertificateRequired"), "{no_identity}");
    let no_file = refused(&url("missing.crt", true));
    assert!(
        no_file.contains("missing.crt (ssl_ca_certs) cannot be read"),
        "{no_file}"
    );
}

/// An expensive call with `key`: its status.
async fn chat_status(sluice: &Sluice, key: &str) -> u16 {
    send(
        Request::post(sluice.url("/chats"))
            .header("x-api-key", key)
            .body(Full::new(Bytes::from_static(b"{}")))
            .expect("request"),
    )
    .await
    .status
    .as_u16()
}

/// With replicas on a sentinel group, a tenant change made on one replica reaches the
/// other within P4's second: each replica hears the table's publications on the
/// master the sentinels name (it subscribed to a sentinel, which never hears them, so
/// a change waited for the 30-second check).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p4_d3_a_tenant_change_reaches_the_other_replica_through_sentinels() {
    if !tools_present(&["redis-server", "redis-sentinel", "redis-cli"]) {
        return;
    }
    let _one = ONE_GROUP_AT_A_TIME.lock().await;
    let group = SentinelGroup::start();
    let table = format!(
        "  keys:\n    - {{ sha256: {}, workspace: ada, user: ada }}\n",
        support::sha256_hex("sk-sentinel")
    );
    let policy = policy(&group.dir.0, "tenants.yaml", |y| {
        y.edit("  keys: []\n", &table)
            .edit("replicas: 1", "replicas: 2")
    });
    let url = group.url();
    let one = Sluice::spawn(&["--config", &policy, "--store", &url]);
    let other = Sluice::spawn(&["--config", &policy, "--store", &url]);
    assert_eq!(chat_status(&other, "sk-sentinel").await, 200);
    let revoke = send(
        Request::delete(one.admin_url(&format!(
            "/tenants/keys/{}",
            support::sha256_hex("sk-sentinel")
        )))
        .body(Full::new(Bytes::new()))
        .expect("request"),
    )
    .await;
    assert_eq!(revoke.status, 204, "{}", revoke.text());
    let revoked = Instant::now();
    let bound = Duration::from_secs(3);
    while chat_status(&other, "sk-sentinel").await != 403 {
        assert!(
            revoked.elapsed() < bound,
            "the revocation did not reach the other replica within {bound:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    println!(
        "a revocation reached the other replica through the sentinels' master in {:?}",
        revoked.elapsed()
    );
}
