//! `sluice serve`: flags, their checks, and the run of the gateway library
//! ([`sluice_gateway`]) until SIGTERM or Ctrl-C.
//!
//! On start it prints exactly one line to stdout naming the bound addresses. SIGTERM or
//! Ctrl-C stops accepting, lets in-flight requests finish for up to
//! [`SHUTDOWN_GRACE`], then exits 0.

use std::io::Write as _;
use std::net::{SocketAddr, ToSocketAddrs as _};
use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Args, ValueEnum};
use sluice_gateway::proxy::Upstream;
use sluice_gateway::{Drain, Gateway, GatewayConfig, SHUTDOWN_GRACE, StartError, StoreSpec};

use crate::BadInput;

/// Longest accepted `--upstream-timeout`.
const MAX_UPSTREAM_TIMEOUT_SECS: f64 = 3600.0;

/// The rate-limit profile: which set of numbers the built-in default policy uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Profile {
    /// The platform's production numbers (e.g. expensive 30/min).
    Production,
    /// Roomier numbers for local development (e.g. expensive 150/min).
    Local,
}

impl Profile {
    /// The profile's name as written on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            Profile::Production => "production",
            Profile::Local => "local",
        }
    }
}

/// `--quota-sync`: how far a quota count is taken before its call goes on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum QuotaSync {
    /// Flushed to the disk.
    Flush,
    /// Written to the operating system.
    Write,
}

impl From<QuotaSync> for sluice_store::JournalSync {
    fn from(sync: QuotaSync) -> Self {
        match sync {
            QuotaSync::Flush => sluice_store::JournalSync::Flush,
            QuotaSync::Write => sluice_store::JournalSync::Write,
        }
    }
}

/// Flags of `sluice serve`.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Policy file (YAML). Without it the built-in default policy runs.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,

    /// Address the gateway listens on (port 0 picks a free port).
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:8080", value_parser = parse_addr)]
    pub listen: SocketAddr,

    /// Address of the admin listener: /metrics, /status, the live dashboard at / and
    /// the JSON it reads, /dashboard.json (port 0 picks a free port).
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:9090", value_parser = parse_addr)]
    pub admin: SocketAddr,

    /// Base URL of the upstream API (http://HOST:PORT[/PREFIX]). Without it a built-in
    /// demo upstream runs on a free loopback port.
    #[arg(long, value_name = "URL", value_parser = parse_upstream)]
    pub upstream: Option<Upstream>,

    /// Which profile's numbers apply (default: the policy's own `profile:`, which is
    /// `production` in the built-in policy).
    #[arg(long, value_enum)]
    pub profile: Option<Profile>,

    /// Where budgets live: `memory` (one process), or shared by replicas: `redis://…`,
    /// `redis+unix:///PATH`, or a cluster `redis+cluster://HOST:PORT,HOST:PORT,…`.
    #[arg(long, value_name = "memory|redis://…", default_value = "memory", value_parser = parse_store)]
    pub store: StoreSpec,

    /// Shift this replica's clock by SECS (negative: behind). A drill for clock skew:
    /// with a Redis store every decision uses the Redis server's clock, so windows and
    /// resets do not move.
    #[arg(
        long,
        value_name = "SECS",
        default_value_t = 0,
        allow_hyphen_values = true
    )]
    pub clock_offset: i64,

    /// Directory of the embedded durable store: monthly quota counts (and later the
    /// batch queue). Default: $XDG_STATE_HOME/sluice, else ~/.local/state/sluice, else
    /// ./sluice-data. One process per directory. Not used with a Redis store (quotas
    /// then live in Redis).
    #[arg(long, value_name = "DIR")]
    pub data_dir: Option<PathBuf>,

    /// How far a monthly quota count is taken before the call it admits is forwarded:
    /// `write` (to the operating system: survives a restart, a crash or kill -9 of
    /// sluice, not a crash of the machine) or `flush` (to the disk, one fdatasync per
    /// group commit: survives a crash of the machine too, at a cost in latency).
    #[arg(long, value_enum, value_name = "write|flush", default_value = "write")]
    pub quota_sync: QuotaSync,

    /// Seconds to wait for the upstream's response headers before answering 504
    /// (fractions allowed, e.g. 0.5). Streaming bodies are not cut by it.
    #[arg(long, value_name = "SECS", default_value = "30", value_parser = parse_timeout)]
    pub upstream_timeout: Duration,

    /// Gateway worker threads, each serving its share of the connections with its own
    /// upstream connection pool (default: one per CPU the process may use; at most 1024).
    #[arg(long, value_name = "N", value_parser = parse_workers)]
    pub workers: Option<NonZeroUsize>,

    /// Most client connections open at once, idle ones included; at the limit the
    /// gateway stops accepting until one closes (new clients wait in the kernel's
    /// listen backlog). Each may hold an upstream connection too: the soft open-file
    /// limit is raised toward the hard one to hold two per connection; past the hard
    /// one the cap is lowered, with a warning.
    #[arg(long, value_name = "N", default_value = "10000")]
    pub max_connections: NonZeroUsize,

    /// Most client connections open at once from one address (the policy's trusted
    /// proxies aside); past it a new connection from that address is closed at once.
    #[arg(long, value_name = "N", default_value = "256")]
    pub max_connections_per_ip: NonZeroUsize,

    /// Most request-body bytes the gateway holds in memory at once, over every
    /// connection (bodies it takes in whole before deciding); past it a new request
    /// with a body gets 503 with Retry-After. Default 256 MiB.
    #[arg(long, value_name = "BYTES", default_value_t = sluice_tower::DEFAULT_MAX_BUFFERED_BYTES)]
    pub max_buffered_bytes: usize,

    /// Seconds a call of the built-in demo upstream's message optimizer takes
    /// (`POST /messages/optimize`, the `optimize_message` tool), so its lane's waits,
    /// refusals and breaker can be watched (fractions allowed; 0 to 600). Ignored
    /// with --upstream.
    #[arg(long, value_name = "SECS", default_value = "3", value_parser = parse_demo_seconds)]
    pub demo_optimize_seconds: Duration,
}

/// Checks what clap cannot (the config is readable, the data dir is a directory, the
/// open-file limit holds the connections) and resolves the flags into the gateway's
/// configuration.
///
/// # Errors
/// [`BadInput`] naming the flag and what was expected.
pub fn config_from_args(args: ServeArgs) -> Result<GatewayConfig, BadInput> {
    let policy = match &args.config {
        Some(path) => sluice_policy::load_file(path).map_err(|e| BadInput(e.to_string()))?,
        None => sluice_policy::default_policy().map_err(|e| BadInput(e.to_string()))?,
    };
    let policy = match args.profile {
        Some(profile) => policy
            .with_profile(profile.as_str())
            .map_err(|e| BadInput(format!("--profile: {e}")))?,
        None => policy,
    };
    let data_dir = args
        .data_dir
        .unwrap_or_else(sluice_gateway::process::default_data_dir);
    if data_dir.exists() && !data_dir.is_dir() {
        return Err(BadInput(format!(
            "--data-dir {}: exists and is not a directory",
            data_dir.display()
        )));
    }
    let mut config = GatewayConfig::new(policy, data_dir);
    config.listen = args.listen;
    config.admin = args.admin;
    config.upstream = args.upstream;
    config.store = args.store;
    config.clock_offset = args.clock_offset;
    config.quota_sync = args.quota_sync.into();
    config.upstream_timeout = args.upstream_timeout;
    if let Some(workers) = args.workers {
        config.workers = workers;
    }
    config.max_connections = {
        let (fits, warning) =
            sluice_gateway::process::connections_within_fd_limit(args.max_connections)
                .map_err(BadInput)?;
        if let Some(warning) = warning {
            eprintln!("sluice: {warning}");
        }
        fits
    };
    config.max_connections_per_ip = args.max_connections_per_ip;
    config.max_buffered_bytes = args.max_buffered_bytes;
    config.demo_optimize_time = args.demo_optimize_seconds;
    Ok(config)
}

pub(crate) fn parse_addr(s: &str) -> Result<SocketAddr, String> {
    if let Ok(addr) = s.parse::<SocketAddr>() {
        return Ok(addr);
    }
    let mut addrs = s
        .to_socket_addrs()
        .map_err(|e| format!("expected HOST:PORT such as 127.0.0.1:8080 ({e})"))?;
    addrs
        .next()
        .ok_or_else(|| format!("`{s}` resolves to no address"))
}

/// Most gateway worker threads `--workers` accepts.
const MAX_WORKERS: usize = 1024;

fn parse_workers(s: &str) -> Result<NonZeroUsize, String> {
    s.parse::<NonZeroUsize>()
        .ok()
        .filter(|n| n.get() <= MAX_WORKERS)
        .ok_or_else(|| format!("expected a whole number from 1 to {MAX_WORKERS}"))
}

fn parse_upstream(s: &str) -> Result<Upstream, String> {
    Upstream::parse(s)
}

pub(crate) fn parse_store(s: &str) -> Result<StoreSpec, String> {
    s.parse()
}

fn parse_demo_seconds(s: &str) -> Result<Duration, String> {
    let secs: f64 = s
        .parse()
        .map_err(|_| "expected a number of seconds such as 3 or 0.5".to_owned())?;
    if !(0.0..=sluice_gateway::demo::optimizer::MAX_CALL_SECONDS).contains(&secs) {
        return Err(format!(
            "expected 0 to {} seconds",
            sluice_gateway::demo::optimizer::MAX_CALL_SECONDS
        ));
    }
    Ok(Duration::from_secs_f64(secs))
}

fn parse_timeout(s: &str) -> Result<Duration, String> {
    let secs: f64 = s
        .parse()
        .map_err(|_| "expected a number of seconds such as 30 or 0.5".to_owned())?;
    if !(secs > 0.0 && secs <= MAX_UPSTREAM_TIMEOUT_SECS) {
        return Err(format!(
            "expected more than 0 and at most {MAX_UPSTREAM_TIMEOUT_SECS} seconds"
        ));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// Runs `sluice serve` until SIGTERM / Ctrl-C.
///
/// # Errors
/// [`BadInput`] for flags that do not hold together or a data dir that cannot be
/// used; any other error (a port that cannot be bound, a runtime that cannot start)
/// is a runtime failure.
pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    let config = config_from_args(args)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let result = runtime.block_on(serve(config));
    runtime.shutdown_timeout(Duration::from_secs(1));
    result
}

/// Starts the gateway, prints the start line, serves until a termination signal,
/// then drains.
async fn serve(config: GatewayConfig) -> anyhow::Result<()> {
    // Signal handlers are installed before the start line is printed, so a SIGTERM
    // sent by whoever reads that line is always handled gracefully.
    let termination =
        sluice_gateway::process::termination_signal().context("installing signal handlers")?;
    let data_dir = (config.store == StoreSpec::Memory).then(|| config.data_dir.clone());
    let gateway = Gateway::start(config).await.map_err(|e| match e {
        StartError::DataDir(e) => anyhow::Error::new(BadInput(format!("--data-dir: {e}"))),
        other => anyhow::Error::new(other),
    })?;
    if let Some(dir) = data_dir {
        eprintln!(
            "sluice: monthly quota counts are kept in {} (--data-dir to choose another)",
            dir.display()
        );
    }
    let upstream_line = if gateway.runs_demo() {
        format!("built-in demo at {}", gateway.upstream())
    } else {
        gateway.upstream().to_string()
    };
    {
        let mut stdout = std::io::stdout().lock();
        writeln!(
            stdout,
            "sluice: listening on http://{} (admin http://{}, upstream {upstream_line})",
            gateway.addr(),
            gateway.admin_addr()
        )
        .and_then(|()| stdout.flush())
        .context("writing the start line to stdout")?;
    }

    let signal = termination.await;
    eprintln!("sluice: {signal} received, finishing in-flight requests");
    if let Drain::TimedOut { connections } = gateway.shutdown().await {
        eprintln!(
            "sluice: grace period of {} s over ({connections} connection(s) were open), \
             closing the rest",
            SHUTDOWN_GRACE.as_secs()
        );
    }
    Ok(())
}
