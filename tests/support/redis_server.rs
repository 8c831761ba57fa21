//! Real `redis-server` processes for tests: one per test on a Unix socket in a
//! private directory, or a 3-master cluster on free loopback ports. Shared by
//! the store's and the binary's tests (`#[path]`-included), std only.
#![allow(dead_code, unreachable_pub, missing_docs)]

use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A `redis-server` child, killed on drop.
pub struct RedisServer {
    child: Option<Child>,
    dir: PathBuf,
    socket: PathBuf,
}

impl RedisServer {
    /// Starts one (bounded wait for its socket).
    pub fn start(name: &str) -> RedisServer {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let dir = std::env::temp_dir().join(format!("sluice-{name}-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let socket = dir.join("redis.sock");
        let mut server = RedisServer {
            child: None,
            dir,
            socket,
        };
        server.restart();
        server
    }

    /// The store URL for `sluice serve --store`.
    pub fn url(&self) -> String {
        format!("redis+unix://{}", self.socket.display())
    }

    /// Kills it, as an outage would.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_file(&self.socket);
    }

    /// Starts it (again) on the same socket.
    pub fn restart(&mut self) {
        self.kill();
        let child = Command::new("redis-server")
            .args([
                "--port",
                "0",
                "--save",
                "",
                "--appendonly",
                "no",
                "--unixsocket",
            ])
            .arg(&self.socket)
            .arg("--dir")
            .arg(&self.dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server must be installed (scripts/test installs it)");
        self.child = Some(child);
        wait_for(&self.socket);
    }

    /// `redis-cli` against it.
    pub fn cli(&self, args: &[&str]) -> String {
        let out = Command::new("redis-cli")
            .arg("-s")
            .arg(&self.socket)
            .args(args)
            .output()
            .expect("redis-cli");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Commands served so far (`INFO commandstats`), those scripts called
    /// included, the `INFO` calls that read them left out.
    pub fn commands(&self) -> u64 {
        calls(&self.cli(&["INFO", "commandstats"]), |l| {
            !l.starts_with("cmdstat_info:")
        })
    }

    /// Calls of the command `name` (lowercase, as `INFO commandstats` names it,
    /// e.g. `expireat`) served so far, those scripts made included.
    pub fn commands_named(&self, name: &str) -> u64 {
        let prefix = format!("cmdstat_{name}:");
        calls(&self.cli(&["INFO", "commandstats"]), |l| {
            l.starts_with(&prefix)
        })
    }

    /// Script calls served so far (`INFO commandstats`).
    pub fn script_calls(&self) -> u64 {
        calls(&self.cli(&["INFO", "commandstats"]), is_script)
    }
}

/// The calls `INFO commandstats` reports for the commands `pick` takes (it
/// gets each `cmdstat_…` line).
pub fn calls(commandstats: &str, pick: impl Fn(&str) -> bool) -> u64 {
    commandstats
        .lines()
        .filter(|l| l.starts_with("cmdstat_") && pick(l))
        .filter_map(|l| {
            l.split("calls=")
                .nth(1)?
                .split(',')
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum()
}

/// Whether a `cmdstat_…` line counts script calls (`EVALSHA`, `EVAL`).
pub fn is_script(line: &str) -> bool {
    line.starts_with("cmdstat_evalsha:") || line.starts_with("cmdstat_eval:")
}

fn wait_for(socket: &Path) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !socket.exists() {
        assert!(Instant::now() < deadline, "redis-server did not start");
        std::thread::yield_now();
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Three cluster-enabled `redis-server`s, killed on drop.
pub struct RedisCluster {
    children: Vec<Child>,
    dir: PathBuf,
    ports: Vec<u16>,
}

/// A port free for a node and for its cluster bus (port + 10000).
fn free_port(taken: &[u16]) -> u16 {
    let seed = std::process::id() as u16;
    for i in 0..2000u16 {
        let p = 20_000 + (seed.wrapping_mul(7).wrapping_add(i.wrapping_mul(13))) % 19_000;
        if taken.contains(&p) {
            continue;
        }
        if TcpListener::bind(("127.0.0.1", p)).is_ok()
            && TcpListener::bind(("127.0.0.1", p + 10_000)).is_ok()
        {
            return p;
        }
    }
    panic!("no free port pair for a cluster node");
}

impl RedisCluster {
    /// Starts three nodes and joins them into one cluster (bounded waits).
    pub fn start() -> RedisCluster {
        // Tests of one binary run at once: each cluster its own directory.
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let dir = std::env::temp_dir().join(format!("sluice-cluster-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut cluster = RedisCluster {
            children: Vec::new(),
            dir,
            ports: Vec::new(),
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        while cluster.ports.len() < 3 {
            assert!(Instant::now() < deadline, "no cluster node started");
            let port = free_port(&cluster.ports);
            if let Some(child) = cluster.node(port) {
                cluster.children.push(child);
                cluster.ports.push(port);
            }
        }
        let nodes: Vec<String> = cluster
            .ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        // Try the creation again (bounded) if a node was still not ready for it.
        loop {
            let mut create = Command::new("redis-cli")
                .args(["--cluster", "create"])
                .args(&nodes)
                .args(["--cluster-replicas", "0", "--cluster-yes"])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("redis-cli --cluster create");
            // It waits for the nodes to join without a bound of its own.
            let created = loop {
                if let Ok(Some(status)) = create.try_wait() {
                    break status.success();
                }
                if Instant::now() >= deadline {
                    let _ = create.kill();
                    let _ = create.wait();
                    break false;
                }
                std::thread::sleep(Duration::from_millis(20));
            };
            if created {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "redis-cli --cluster create did not make a cluster of {nodes:?} in time"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        while !cluster.ports.iter().all(|&p| {
            cluster
                .cli(p, &["CLUSTER", "INFO"])
                .contains("cluster_state:ok")
        }) {
            assert!(Instant::now() < deadline, "the cluster did not converge");
            std::thread::sleep(Duration::from_millis(20));
        }
        cluster
    }

    /// Starts one node on `port` and waits (bounded) until it answers as
    /// itself: its `INFO server` names the child's pid. A port another process
    /// took between the check and the bind (another test's ephemeral port, or
    /// a node's cluster bus) gives `None`, and the caller picks another port.
    fn node(&self, port: u16) -> Option<Child> {
        let node_dir = self.dir.join(port.to_string());
        std::fs::create_dir_all(&node_dir).expect("node dir");
        let mut child = Command::new("redis-server")
            .args(["--bind", "127.0.0.1", "--port", &port.to_string()])
            .args([
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
            ])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(&node_dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server must be installed (scripts/test installs it)");
        let ours = format!("process_id:{}", child.id());
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if matches!(child.try_wait(), Ok(Some(_))) {
                break;
            }
            if TcpStream::connect(("127.0.0.1", port)).is_ok()
                && self.cli(port, &["INFO", "server"]).contains(&ours)
            {
                return Some(child);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
        None
    }

    fn cli(&self, port: u16, args: &[&str]) -> String {
        let out = Command::new("redis-cli")
            .args(["-p", &port.to_string()])
            .args(args)
            .output()
            .expect("redis-cli");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The store URL for `--store`.
    pub fn url(&self) -> String {
        let nodes: Vec<String> = self
            .ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        format!("redis+cluster://{}", nodes.join(","))
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
