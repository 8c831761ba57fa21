//! A real `redis-server` per test, on a Unix socket in a private directory.

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
        let dir = std::env::temp_dir().join(format!("sluice-{name}-{}", std::process::id()));
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

    /// Script calls served so far (`INFO commandstats`).
    pub fn script_calls(&self) -> u64 {
        self.cli(&["INFO", "commandstats"])
            .lines()
            .filter(|l| l.starts_with("cmdstat_evalsha:") || l.starts_with("cmdstat_eval:"))
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
