//! `sluice serve`: the gateway.
//!
//! One process runs three listeners:
//! - the gateway (`--listen`): plain HTTP/1.1 requests take the fast path of [`h1`]
//!   (the limiter and the proxy's rules applied to the bytes, no `http` types), every
//!   other request the service stack `limiter layer → proxy`; both are wired in
//!   [`serve`] over one limiter;
//! - the admin listener (`--admin`): `/metrics`, `/status`, `/` (see [`admin`]);
//! - without `--upstream`, the built-in demo upstream on a loopback port (see [`demo`]).
//!
//! On start it prints exactly one line to stdout naming the bound addresses. SIGTERM or
//! Ctrl-C stops accepting, lets in-flight requests finish for up to [`SHUTDOWN_GRACE`],
//! then exits 0.

pub mod admin;
pub mod demo;
mod gateway;
mod h1;
pub mod metered;
mod pool;
pub mod proxy;
mod read_deadline;
pub mod store;
mod upload;

use std::io::Write as _;
use std::net::{SocketAddr, ToSocketAddrs as _};
use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::{Args, ValueEnum};
use sluice_core::SystemClock;
use sluice_policy::Policy;
use sluice_store::{MemoryConfig, MemoryStore};
use sluice_tower::{Limiter, SluiceLayer};
use store::AnyStore;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tower::Layer as _;

use crate::BadInput;
use proxy::{Proxy, ProxyConfig, Upstream};

/// How long in-flight requests may run on after SIGTERM / Ctrl-C before the process
/// exits anyway.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// How long the admin listener and the demo upstream get to close once the gateway has
/// drained (they only serve short requests and long-lived streams, which are cut).
const BACKEND_GRACE: Duration = Duration::from_secs(2);

/// Longest accepted `--upstream-timeout`.
const MAX_UPSTREAM_TIMEOUT_SECS: f64 = 3600.0;

/// The socket address of the connection a request arrived on, inserted as a request
/// extension by the gateway for every request; the limiter keys anonymous callers and
/// IP ceilings on it, and the proxy appends it to X-Forwarded-For.
pub use sluice_tower::PeerAddr;

/// The request body the gateway's service stack receives: the connection's body,
/// streamed, boxed. It is also `From<Bytes>`, so a layer that reads the body (the
/// limiter reads JSON-RPC bodies to classify them) can put the bytes back.
pub type GatewayBody = axum::body::Body;

/// The rate-limit profile: which set of numbers the built-in default policy uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Profile {
    /// The seed platform's production numbers (e.g. expensive 30/min).
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

/// Where budgets live, as given by `--store`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StoreSpec {
    /// In this process's memory (one replica).
    Memory,
    /// A Redis server shared by replicas (not built yet).
    Redis(String),
}

impl StoreSpec {
    /// A description safe to show (a Redis URL loses its password).
    pub fn describe(&self) -> String {
        match self {
            StoreSpec::Memory => "memory".to_owned(),
            StoreSpec::Redis(url) => match url.split_once('@') {
                Some((_, host)) => format!("redis://…@{host}"),
                None => url.clone(),
            },
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

    /// Address of the admin listener: /metrics, /status and the dashboard at / (port 0
    /// picks a free port).
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
}

/// Validated settings of `sluice serve` (what [`ServeArgs`] resolves to).
#[derive(Clone, Debug)]
pub struct ServeOptions {
    /// The policy: loaded from `--config` or built in, with `--profile` applied.
    pub policy: Policy,
    /// Gateway address to bind.
    pub listen: SocketAddr,
    /// Admin address to bind.
    pub admin: SocketAddr,
    /// External upstream, or `None` for the built-in demo.
    pub upstream: Option<Upstream>,
    /// Budget store.
    pub store: StoreSpec,
    /// Seconds this replica's clock is shifted by.
    pub clock_offset: i64,
    /// Directory of the embedded durable store (`--data-dir`, or the default).
    pub data_dir: PathBuf,
    /// How far a quota count is taken before its call goes on.
    pub quota_sync: QuotaSync,
    /// Time allowed for the upstream's response headers.
    pub upstream_timeout: Duration,
    /// Gateway worker threads.
    pub workers: NonZeroUsize,
    /// Most client connections open at once.
    pub max_connections: NonZeroUsize,
    /// Most client connections open at once from one address.
    pub max_connections_per_ip: NonZeroUsize,
    /// Most request-body bytes held in memory at once.
    pub max_buffered_bytes: usize,
}

impl ServeOptions {
    /// Checks what clap cannot: the store is one that is built, the config is readable.
    ///
    /// # Errors
    /// [`BadInput`] naming the flag and what was expected.
    pub fn from_args(args: ServeArgs) -> Result<Self, BadInput> {
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
        let data_dir = args.data_dir.unwrap_or_else(default_data_dir);
        if data_dir.exists() && !data_dir.is_dir() {
            return Err(BadInput(format!(
                "--data-dir {}: exists and is not a directory",
                data_dir.display()
            )));
        }
        Ok(ServeOptions {
            policy,
            listen: args.listen,
            admin: args.admin,
            upstream: args.upstream,
            store: args.store,
            clock_offset: args.clock_offset,
            data_dir,
            quota_sync: args.quota_sync,
            upstream_timeout: args.upstream_timeout,
            workers: args.workers.unwrap_or_else(|| {
                std::thread::available_parallelism().unwrap_or(NonZeroUsize::MIN)
            }),
            max_connections: connections_within_fd_limit(args.max_connections)?,
            max_connections_per_ip: args.max_connections_per_ip,
            max_buffered_bytes: args.max_buffered_bytes,
        })
    }
}

/// File descriptors the process needs besides two per client connection (a client's
/// and its upstream's): listeners, the admin side, the durable store, Redis, logs.
const FDS_BESIDES_CONNECTIONS: u64 = 128;

/// The `--max-connections` the open-file limit allows: the soft limit is raised
/// toward the hard one when two descriptors per connection do not fit, and when even
/// the hard one is too low the cap is lowered, with a warning, rather than `accept`
/// failing in a loop once descriptors run out.
///
/// # Errors
/// A limit too low for a single connection.
fn connections_within_fd_limit(wanted: NonZeroUsize) -> Result<NonZeroUsize, BadInput> {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let needed = (wanted.get() as u64)
        .saturating_mul(2)
        .saturating_add(FDS_BESIDES_CONNECTIONS);
    let limit = getrlimit(Resource::Nofile);
    let Some(soft) = limit.current else {
        return Ok(wanted);
    };
    if soft >= needed {
        return Ok(wanted);
    }
    let hard = limit.maximum.unwrap_or(u64::MAX);
    let raised = needed.min(hard);
    let soft = if raised > soft
        && setrlimit(
            Resource::Nofile,
            rustix::process::Rlimit {
                current: Some(raised),
                maximum: limit.maximum,
            },
        )
        .is_ok()
    {
        raised
    } else {
        soft
    };
    if soft >= needed {
        return Ok(wanted);
    }
    let fits = soft.saturating_sub(FDS_BESIDES_CONNECTIONS) / 2;
    let fits = usize::try_from(fits)
        .ok()
        .and_then(NonZeroUsize::new)
        .ok_or_else(|| {
            BadInput(format!(
                "the open-file limit is {soft} (hard {hard}): too low to serve a connection; raise it (ulimit -n)"
            ))
        })?;
    eprintln!(
        "sluice: --max-connections {wanted} needs {needed} open files and the limit is {soft} (hard {hard}): serving at most {fits} connections"
    );
    Ok(fits)
}

/// The data directory when `--data-dir` is not given: `$XDG_STATE_HOME/sluice`, else
/// `$HOME/.local/state/sluice`, else `./sluice-data`.
fn default_data_dir() -> PathBuf {
    let non_empty = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
    if let Some(state) = non_empty("XDG_STATE_HOME") {
        return PathBuf::from(state).join("sluice");
    }
    if let Some(home) = non_empty("HOME") {
        return PathBuf::from(home).join(".local/state/sluice");
    }
    PathBuf::from("sluice-data")
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

fn parse_store(s: &str) -> Result<StoreSpec, String> {
    if s == "memory" {
        Ok(StoreSpec::Memory)
    } else if [
        "redis://",
        "rediss://",
        "redis+unix://",
        "unix://",
        "redis+cluster://",
    ]
    .iter()
    .any(|scheme| s.starts_with(scheme))
    {
        Ok(StoreSpec::Redis(s.to_owned()))
    } else {
        Err(
            "expected `memory`, a redis://HOST:PORT[/DB] URL, redis+unix:///PATH or \
             redis+cluster://HOST:PORT,HOST:PORT,…"
                .to_owned(),
        )
    }
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
/// [`BadInput`] for flags that do not hold together; any other error (a port that
/// cannot be bound, a runtime that cannot start) is a runtime failure.
pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    let options = ServeOptions::from_args(args)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let result = runtime.block_on(serve(options));
    runtime.shutdown_timeout(Duration::from_secs(1));
    result
}

/// A one-shot stop signal that any number of tasks can wait on.
#[derive(Clone, Debug)]
pub struct Stop(watch::Receiver<bool>);

impl Stop {
    /// A stop signal and the function that fires it.
    pub fn channel() -> (watch::Sender<bool>, Stop) {
        let (tx, rx) = watch::channel(false);
        (tx, Stop(rx))
    }

    /// Resolves once the signal fires (or its sender is gone).
    pub async fn wait(mut self) {
        let _ = self.0.wait_for(|stopped| *stopped).await;
    }
}

/// Binds every listener, wires the service stack, prints the start line, serves until a
/// termination signal, then drains.
async fn serve(options: ServeOptions) -> anyhow::Result<()> {
    let started = Instant::now();
    admin::install_metrics();

    // Signal handlers are installed before the start line is printed, so a SIGTERM
    // sent by whoever reads that line is always handled gracefully.
    let termination = termination_signal().context("installing signal handlers")?;

    let gateway_listener = TcpListener::bind(options.listen)
        .await
        .with_context(|| format!("binding the gateway listener on {}", options.listen))?;
    let admin_listener = TcpListener::bind(options.admin)
        .await
        .with_context(|| format!("binding the admin listener on {}", options.admin))?;
    let gateway_addr = gateway_listener.local_addr()?;
    let admin_addr = admin_listener.local_addr()?;

    // The admin listener and the demo upstream stop only after the gateway has drained:
    // in-flight requests still need the demo to answer them.
    let (stop_backends, backends_stopped) = Stop::channel();
    let (upstream, demo) = match options.upstream.clone() {
        Some(upstream) => (upstream, None),
        None => {
            let demo = demo::start(backends_stopped.clone().wait())
                .await
                .context("starting the built-in demo upstream")?;
            (Upstream::from_addr(demo.addr()), Some(demo))
        }
    };

    let proxy_config = ProxyConfig {
        upstream: upstream.clone(),
        header_timeout: options.upstream_timeout,
    };
    let profile = options.policy.profile_name.clone();
    let clock = SystemClock::with_offset(options.clock_offset);
    let store = match &options.store {
        StoreSpec::Memory => {
            let store =
                AnyStore::local(clock.clone(), &options.data_dir, options.quota_sync.into())
                    .map_err(|e| BadInput(format!("--data-dir: {e}")))?;
            eprintln!(
                "sluice: monthly quota counts are kept in {} (--data-dir to choose another)",
                options.data_dir.display()
            );
            store
        }
        StoreSpec::Redis(url) => AnyStore::redis(url, options.policy.store.timeout)
            .await
            .with_context(|| format!("connecting to the store {}", options.store.describe()))?,
    };
    let fallback = MemoryStore::with_clock(
        MemoryConfig {
            max_keys: sluice_tower::FALLBACK_MAX_KEYS,
            ..MemoryConfig::default()
        },
        clock,
    );
    let per_ip = {
        let identity = options.policy.identity.clone();
        gateway::PerIp::new(options.max_connections_per_ip, move |ip| {
            identity.trusts(ip)
        })
    };
    let limiter = Arc::new(
        Limiter::new(options.policy, store)
            .with_fallback(fallback)
            .with_buffer_bound(options.max_buffered_bytes),
    );
    tokio::spawn(reclaim_stale_cells(
        Arc::clone(&limiter),
        backends_stopped.clone(),
    ));
    // Each gateway worker gets its own stack over the one shared limiter: its own
    // upstream connection pool, driven on its own thread.
    let make_service = {
        let limiter = Arc::clone(&limiter);
        let proxy_config = proxy_config.clone();
        move || SluiceLayer::new(Arc::clone(&limiter)).layer(Proxy::new(proxy_config.clone()))
    };

    let requests = metered::RequestStats::with_workers(options.workers);
    let admin_state = admin::AdminState::new(
        admin::StatusInfo {
            listen: format!("http://{gateway_addr}"),
            admin: format!("http://{admin_addr}"),
            upstream: upstream.to_string(),
            upstream_kind: if demo.is_some() { "demo" } else { "external" },
            profile,
            store: options.store.describe(),
        },
        started,
        requests.clone(),
    )
    .with_limiter_summary({
        let limiter = Arc::clone(&limiter);
        Arc::new(move || {
            let mut status = limiter.status();
            status["store"] = limiter.store().describe_state();
            status
        })
    });
    let admin_state = admin_state.with_quotas(Arc::clone(&limiter));
    let admin_task = tokio::spawn(admin::serve(
        admin_listener,
        admin::router(admin_state),
        backends_stopped.clone().wait(),
    ));

    let make_fast = {
        let limiter = Arc::clone(&limiter);
        move |stats| h1::FastPath::new(Arc::clone(&limiter), proxy_config.clone(), stats)
    };
    let workers = gateway::Workers::start(
        options.workers,
        make_service,
        make_fast,
        &requests,
        SHUTDOWN_GRACE,
    )
    .context("starting the gateway worker threads")?;
    let (stop_gateway, gateway_stopped) = Stop::channel();
    let gateway_task = tokio::spawn(gateway::serve(
        gateway_listener,
        workers,
        options.max_connections,
        per_ip,
        gateway_stopped.wait(),
    ));

    let upstream_line = match &demo {
        Some(_) => format!("built-in demo at {upstream}"),
        None => upstream.to_string(),
    };
    {
        let mut stdout = std::io::stdout().lock();
        writeln!(
            stdout,
            "sluice: listening on http://{gateway_addr} (admin http://{admin_addr}, upstream {upstream_line})"
        )
        .and_then(|()| stdout.flush())
        .context("writing the start line to stdout")?;
    }

    let signal = termination.await;
    eprintln!("sluice: {signal} received, finishing in-flight requests");
    let _ = stop_gateway.send(true);
    let drained = match gateway_task.await {
        Ok(gateway::Drain::Complete) => true,
        Ok(gateway::Drain::TimedOut { connections }) => {
            eprintln!(
                "sluice: grace period of {} s over ({connections} connection(s) were open), \
                 closing the rest",
                SHUTDOWN_GRACE.as_secs()
            );
            false
        }
        Err(e) => {
            eprintln!("sluice: gateway task failed: {e}");
            false
        }
    };

    let _ = stop_backends.send(true);
    if drained {
        let backends = async {
            let _ = admin_task.await;
            if let Some(demo) = demo {
                demo.join().await;
            }
        };
        // Long-lived streams (the demo's GET /mcp) would hold these open: cut them.
        let _ = tokio::time::timeout(BACKEND_GRACE, backends).await;
    }
    Ok(())
}

/// A future that resolves with the signal's name on SIGTERM or SIGINT (Ctrl-C).
pub(crate) fn termination_signal() -> std::io::Result<impl Future<Output = &'static str>> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        Ok(async move {
            tokio::select! {
                _ = term.recv() => "SIGTERM",
                _ = int.recv() => "SIGINT",
            }
        })
    }
    #[cfg(not(unix))]
    {
        Ok(async {
            match tokio::signal::ctrl_c().await {
                Ok(()) => "Ctrl-C",
                Err(_) => std::future::pending().await,
            }
        })
    }
}

/// How often stale budget cells are dropped from the memory store (they are also
/// dropped whenever a shard needs room).
const RECLAIM_EVERY: Duration = Duration::from_secs(30);

/// Drops budget cells whose window is over, until the stop signal.
async fn reclaim_stale_cells(limiter: Arc<Limiter<AnyStore>>, stop: Stop) {
    let mut tick = tokio::time::interval(RECLAIM_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let stopped = stop.wait();
    tokio::pin!(stopped);
    loop {
        tokio::select! {
            _ = tick.tick() => {
                limiter.store().reclaim();
                limiter.fallback().reclaim();
            }
            () = &mut stopped => return,
        }
    }
}
