//! The sluice gateway as a library: the accept loop and its workers, both HTTP/1.1
//! request paths, the admin listener and the built-in demo upstream, over one
//! [`Limiter`]. The `sluice` binary parses flags into a [`GatewayConfig`] and calls
//! [`Gateway::start`]; anything else that wants a gateway in its own process can too.
//!
//! One gateway runs three listeners:
//! - the gateway (`listen`): plain HTTP/1.1 requests take the fast path of `h1`
//!   (the limiter and the proxy's rules applied to the bytes, no `http` types), every
//!   other request the service stack `limiter layer → proxy`; both are wired in
//!   [`Gateway::start`] over one limiter;
//! - the admin listener (`admin`): `/metrics`, `/status`, `/` (see [`sluice_admin`]);
//! - without an upstream, the built-in demo upstream on a loopback port (see [`sluice_demo`]).
//!
//! [`Gateway::shutdown`] stops accepting, lets in-flight requests finish for up to
//! [`SHUTDOWN_GRACE`], then closes the rest.
//!
//! [`Limiter`]: sluice_edge::Limiter

pub(crate) mod access;
mod alerts;
pub(crate) mod batch;
mod boxed;
mod check;
pub(crate) mod file_watch;
mod gateway;
mod h1;
mod hangup;
mod idle;
pub mod listener_tls;
pub(crate) mod metered;
pub mod otlp;
pub mod otlp_metrics;
mod per_thread;
mod pool;
pub mod process;
pub(crate) mod proxy;
mod read_deadline;
pub mod reload;
mod send_deadline;
mod stalled;
mod start;
pub(crate) mod store;
pub(crate) mod tls;
mod upload;

/// The alert outbox's bounds (SPEC O3): events kept, and tries of one delivery.
pub use alerts::{MAX_ATTEMPTS, MAX_OUTBOX_EVENTS};
use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sluice_core::SystemClock;
use sluice_policy::Policy;
use sluice_store::{JournalSync, MemoryConfig, OpenError, StoreError};
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub use gateway::Drain;
pub use listener_tls::ListenerTls;
pub use proxy::Upstream;
pub use reload::{PolicyFile, Reloader};
pub use tls::UpstreamTls;

/// How long in-flight requests may run on after [`Gateway::shutdown`] before the rest
/// are closed.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// How long the admin listener and the demo upstream get to close once the gateway has
/// drained (they only serve short requests and long-lived streams, which are cut).
const BACKEND_GRACE: Duration = Duration::from_secs(2);

/// The socket address of the connection a request arrived on, inserted as a request
/// extension by the gateway for every request; the limiter keys anonymous callers and
/// IP ceilings on it, and the proxy appends it to X-Forwarded-For.
pub use sluice_edge::DEFAULT_REFUSAL_LOG_PER_SECOND;
pub use sluice_tower::PeerAddr;

/// The request body the gateway's service stack receives: the connection's body,
/// streamed, boxed. It is also `From<Bytes>`, so a layer that reads the body (the
/// limiter reads JSON-RPC bodies to classify them) can put the bytes back.
pub type GatewayBody = axum::body::Body;

/// Where budgets live, as given by `--store`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StoreSpec {
    /// In this process's memory (one replica).
    Memory,
    /// A Redis server (or cluster) shared by replicas, by its URL (one that
    /// [`sluice_redis::RedisUrl`] reads, when parsed from a flag).
    Redis(String),
}

impl StoreSpec {
    /// A description safe to show (a Redis URL loses its passwords).
    pub fn describe(&self) -> String {
        match self {
            StoreSpec::Memory => "memory".to_owned(),
            StoreSpec::Redis(url) => match url.parse::<sluice_redis::RedisUrl>() {
                Ok(url) => url.to_string(),
                Err(_) => "redis (a URL that does not read)".to_owned(),
            },
        }
    }
}

impl std::str::FromStr for StoreSpec {
    type Err = String;

    /// `memory`, or a Redis URL as [`sluice_redis::RedisUrl`] reads it
    /// (`redis://`, `rediss://`, `redis+unix://`, `unix://`, `redis+cluster://`,
    /// `redis+sentinel://`).
    fn from_str(s: &str) -> Result<Self, String> {
        if s == "memory" {
            return Ok(StoreSpec::Memory);
        }
        match sluice_redis::RedisUrl::parse(s) {
            Ok(_) => Ok(StoreSpec::Redis(s.to_owned())),
            Err(sluice_redis::UrlError::UnknownScheme) => Err(
                "expected `memory`, a redis://HOST:PORT[/DB] URL, rediss://HOST:PORT[/DB], \
                 redis+unix:///PATH, redis+cluster://HOST:PORT,HOST:PORT,… or \
                 redis+sentinel://HOST:PORT,HOST:PORT,…/MASTER[/DB]"
                    .to_owned(),
            ),
            Err(e) => Err(e.to_string()),
        }
    }
}

/// What a gateway runs with. [`GatewayConfig::new`] gives the defaults the `sluice serve`
/// flags document; change the fields that differ.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct GatewayConfig {
    /// The policy (with its profile applied).
    pub policy: Policy,
    /// Gateway address to bind (port 0 picks a free port).
    pub listen: SocketAddr,
    /// Admin address to bind (port 0 picks a free port).
    pub admin: SocketAddr,
    /// External upstream, or `None` for the built-in demo.
    pub upstream: Option<Upstream>,
    /// Budget store.
    pub store: StoreSpec,
    /// Seconds this replica's clock is shifted by (a clock-skew drill).
    pub clock_offset: i64,
    /// Directory of the embedded durable store (monthly quota counts).
    pub data_dir: PathBuf,
    /// How far a quota count is taken before its call goes on.
    pub quota_sync: JournalSync,
    /// Time allowed for the upstream's response headers.
    pub upstream_timeout: Duration,
    /// Gateway worker threads, each with its own upstream connection pool.
    pub workers: NonZeroUsize,
    /// Most client connections open at once.
    pub max_connections: NonZeroUsize,
    /// Most client connections open at once from one address (trusted proxies aside),
    /// on each of the gateway, the check listener and the rate-limit service.
    pub max_connections_per_ip: NonZeroUsize,
    /// Most request-body bytes held in memory at once.
    pub max_buffered_bytes: usize,
    /// The share of `max_buffered_bytes` one client address may hold (a fraction; see
    /// [`sluice_edge::BufferBudget::with_share`]).
    pub max_buffered_share: f64,
    /// How long a request body taken in whole (a JSON-RPC or batch body) may take
    /// to arrive, however steadily it comes (see
    /// [`Limiter::with_body_deadline`](sluice_edge::Limiter::with_body_deadline)).
    pub body_deadline: Duration,
    /// Most budget cells the memory store holds (see [`MemoryConfig::max_keys`]).
    pub max_keys: usize,
    /// How long a call of the demo upstream's message optimizer takes.
    pub demo_optimize_time: Duration,
    /// The batch queue's global bounds: unfinished items and stored bytes in
    /// all, and the share one client address may hold
    /// ([`sluice_batch::BatchConfig::max_queued_items`],
    /// [`max_stored_bytes`](sluice_batch::BatchConfig::max_stored_bytes),
    /// [`origin_share`](sluice_batch::BatchConfig::origin_share)).
    pub batch_bounds: BatchBounds,
    /// The file the policy was read from, read again on SIGHUP and when it changes
    /// (`None`: the policy was given without a file and is never reloaded).
    pub policy_file: Option<PolicyFile>,
    /// One `sluice::access` log line per request.
    pub access_log: bool,
    /// Most refusal log lines a second (0: every refusal; see
    /// [`Limiter::with_refusal_log`](sluice_edge::Limiter::with_refusal_log)).
    pub refusal_log_per_second: u32,
    /// Who the admin listener lets in: `Host` names beyond its addresses, the token
    /// (required beyond loopback: [`Gateway::start`] refuses to start without one),
    /// paths open without it (see [`sluice_door`]).
    pub admin_door: sluice_door::DoorConfig,
    /// Address of the forward-auth listener (`--check`): nginx's `auth_request`,
    /// Traefik's ForwardAuth and Caddy's `forward_auth` ask it about the requests
    /// they hold; `None` runs none.
    pub check: Option<SocketAddr>,
    /// Address of Envoy's rate-limit service (`--rls`, gRPC); `None` runs none.
    pub rls: Option<SocketAddr>,
    /// Serve the HTTP gateway (`listen`, the upstream or the demo, the batch lanes).
    /// `false` runs only the limiter behind the admin listener and the `rls` and
    /// `check` listeners (`sluice rls`).
    pub gateway: bool,
    /// TLS on the gateway listener (`--tls-cert`, `--tls-key`; SPEC O5): its
    /// certificate is read again when its files change. `None`: plain HTTP.
    pub tls: Option<ListenerTls>,
    /// TLS on the admin listener (`--admin-tls-cert`, `--admin-tls-key`).
    pub admin_tls: Option<ListenerTls>,
}

/// The batch queue's global bounds (see [`GatewayConfig::batch_bounds`]); the
/// per-batch and per-workspace ones come from the policy's `batch:` settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchBounds {
    /// Most unfinished items of all workspaces together.
    pub max_queued_items: u64,
    /// Most bytes of item bodies and results stored, finished batches included
    /// until purged.
    pub max_stored_bytes: u64,
    /// One client address holds at most 1/`address_share` of each.
    pub address_share: u32,
}

impl Default for BatchBounds {
    fn default() -> Self {
        BatchBounds {
            max_queued_items: sluice_batch::DEFAULT_MAX_QUEUED_ITEMS,
            max_stored_bytes: sluice_batch::DEFAULT_MAX_STORED_BYTES,
            address_share: sluice_batch::DEFAULT_ORIGIN_SHARE,
        }
    }
}

/// Default for [`GatewayConfig::max_connections`].
pub const DEFAULT_MAX_CONNECTIONS: NonZeroUsize = NonZeroUsize::new(10_000).expect("not zero");

/// Default for [`GatewayConfig::max_connections_per_ip`].
pub const DEFAULT_MAX_CONNECTIONS_PER_IP: NonZeroUsize = NonZeroUsize::new(256).expect("not zero");

/// Default for [`GatewayConfig::upstream_timeout`].
pub const DEFAULT_UPSTREAM_TIMEOUT: Duration = Duration::from_secs(30);

impl GatewayConfig {
    /// A gateway for `policy` on loopback ports picked by the system, in front of the
    /// built-in demo, with monthly quota counts in `data_dir`, one worker per CPU and
    /// the other bounds at their defaults.
    pub fn new(policy: Policy, data_dir: PathBuf) -> Self {
        let loopback = SocketAddr::from(([127, 0, 0, 1], 0));
        GatewayConfig {
            policy,
            listen: loopback,
            admin: loopback,
            upstream: None,
            store: StoreSpec::Memory,
            clock_offset: 0,
            data_dir,
            quota_sync: JournalSync::Write,
            upstream_timeout: DEFAULT_UPSTREAM_TIMEOUT,
            workers: std::thread::available_parallelism().unwrap_or(NonZeroUsize::MIN),
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_connections_per_ip: DEFAULT_MAX_CONNECTIONS_PER_IP,
            max_buffered_bytes: sluice_edge::DEFAULT_MAX_BUFFERED_BYTES,
            max_buffered_share: sluice_edge::DEFAULT_BUFFERED_SHARE,
            body_deadline: sluice_edge::BODY_DEADLINE,
            max_keys: MemoryConfig::default().max_keys,
            demo_optimize_time: sluice_demo::optimizer::DEFAULT_CALL_TIME,
            batch_bounds: BatchBounds::default(),
            policy_file: None,
            access_log: false,
            admin_door: sluice_door::DoorConfig::default(),
            check: None,
            rls: None,
            gateway: true,
            tls: None,
            admin_tls: None,
            refusal_log_per_second: sluice_edge::DEFAULT_REFUSAL_LOG_PER_SECOND,
        }
    }
}

/// Why a gateway could not start.
///
/// The message says what was being done; the cause is the error's
/// [`source`](std::error::Error::source), so that a chain printed whole says
/// each thing once.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    /// A listener could not be bound.
    #[error("binding the {listener} listener on {addr}")]
    Bind {
        /// Which listener (`gateway` or `admin`).
        listener: &'static str,
        /// The address asked for.
        addr: SocketAddr,
        /// What the system said.
        source: std::io::Error,
    },
    /// The data directory cannot hold the durable store.
    #[error("data dir")]
    DataDir(#[from] OpenError),
    /// The shared store could not be reached.
    #[error("connecting to the store {store}")]
    Store {
        /// The store, as [`StoreSpec::describe`] shows it.
        store: String,
        /// What went wrong.
        source: StoreError,
    },
    /// A guarded lane's ledger could not be set up in the shared store: a lane's
    /// limits must hold across every replica, or the gateway does not start.
    #[error("lane {lane}: {reason}")]
    Lanes {
        /// The lane.
        lane: String,
        /// Why.
        reason: String,
    },
    /// The tenants set through the admin API could not be read, or no longer fit
    /// the policy.
    #[error("tenants: {0}")]
    Tenants(String),
    /// The admin listener would answer beyond loopback with no token.
    #[error(
        "the admin listener on {0} is reachable beyond loopback and needs a token: \
         --admin-token-file FILE or SLUICE_ADMIN_TOKEN"
    )]
    AdminWithoutToken(SocketAddr),
    /// An https upstream cannot be verified: the system has no root certificates
    /// and none were given ([`Upstream::with_tls`]).
    #[error("{0}")]
    UpstreamTls(String),
    /// An alert of the policy cannot be sent: its secret file cannot be read or is
    /// empty (SPEC O3).
    #[error("{0}")]
    Alerts(String),
    /// The built-in demo upstream or the worker threads could not start.
    #[error("{what}")]
    Io {
        /// What was being started.
        what: &'static str,
        /// What the system said.
        source: std::io::Error,
    },
}

/// A running gateway: its listeners are bound and serving.
#[derive(Debug)]
pub struct Gateway {
    addr: Option<SocketAddr>,
    admin_addr: SocketAddr,
    check_addr: Option<SocketAddr>,
    rls_addr: Option<SocketAddr>,
    upstream: Option<Upstream>,
    demo: Option<sluice_demo::Demo>,
    stop_gateway: watch::Sender<bool>,
    stop_backends: watch::Sender<bool>,
    gateway_task: JoinHandle<Drain>,
    admin_task: JoinHandle<()>,
    /// The leases' upkeep, which gives their leftovers back at the stop.
    leases_task: JoinHandle<()>,
    reloader: Arc<Reloader>,
    buffers: Arc<sluice_edge::BufferBudget>,
    /// `https` when the gateway listener speaks TLS, else `http`.
    scheme: &'static str,
    /// `https` when the admin listener speaks TLS, else `http`.
    admin_scheme: &'static str,
}

/// Most connections the forward-auth (`--check`) and rate-limit service (`--rls`)
/// listeners each hold at once: their clients are proxies that keep a pool of
/// connections, so this leaves the open-file limit to the gateway's own clients.
pub const PROXY_LISTENER_CONNECTIONS: usize = 1024;

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

impl Gateway {
    /// Binds every listener, wires the service stack over one limiter and starts
    /// serving; the gateway runs until [`Gateway::shutdown`].
    ///
    /// # Errors
    /// [`StartError`] names the listener, directory or store that could not be used.
    pub async fn start(config: GatewayConfig) -> Result<Gateway, StartError> {
        let started = Instant::now();
        start::check_admin_door(&config)?;
        sluice_admin::install_metrics();
        let listeners = start::Listeners::bind(&config)?;
        let (addr, admin_addr) = (
            listeners.gateway.as_ref().map(|g| g.addr),
            listeners.admin.addr,
        );
        let check_addr = listeners.check.as_ref().map(|c| c.addr);
        let rls_addr = listeners.rls.as_ref().map(|c| c.addr);
        // The admin listener and the demo upstream stop only after the gateway has
        // drained: in-flight requests still need the demo to answer them.
        let (stop_backends, backends_stopped) = Stop::channel();
        let (upstream, demo) = if config.gateway {
            let (upstream, demo) = start::upstream(&config, &backends_stopped).await?;
            (Some(upstream), demo)
        } else {
            (None, None)
        };
        let status = start::status_info(&config, &listeners, upstream.as_ref(), demo.is_some());

        let clock = SystemClock::with_offset(config.clock_offset);
        let (stores, batches) = start::Stores::open(&config, &clock).await?;
        let version = start::policy_version(&config);
        let shared_store = matches!(config.store, StoreSpec::Redis(_));
        let bounds = start::LimiterBounds::of(&config);
        let alerts = start::alerts(&config, &stores)?;
        let limiter = stores.limiter(
            config.policy.clone(),
            bounds,
            alerts.as_ref().map(|(outbox, _)| Arc::clone(outbox)),
        );
        let alerts = alerts.map(|(outbox, targets)| {
            start::spawn_alerts(&config, &limiter, &outbox, targets, &backends_stopped);
            outbox
        });
        let buffers = Arc::clone(limiter.load().buffers());
        let per_ip = start::per_ip(&limiter, config.max_connections_per_ip);
        let tenants = start::tenants(&config, &limiter, &backends_stopped).await?;
        let reloader = Arc::new(
            Reloader::new(
                Arc::clone(&limiter),
                config.policy_file.clone(),
                version,
                shared_store,
            )
            .with_tenants(Arc::clone(&tenants)),
        );

        let leases_task = start::spawn_upkeep(&limiter, &reloader, &backends_stopped).await?;
        let batch_lanes = match &upstream {
            Some(upstream) => {
                start::batch_lanes(batches, &limiter, upstream, &clock, &backends_stopped)
            }
            // No gateway, no batch endpoints: nothing would submit or run items.
            None => Arc::new(Vec::new()),
        };
        let core = start::Core {
            limiter,
            reloader,
            batch_lanes,
            tenants,
            alerts,
        };
        let stack = upstream
            .as_ref()
            .map(|u| core.worker_stack(u, config.upstream_timeout, config.access_log));

        let requests = metered::RequestStats::with_workers(config.workers);
        let admin_state = sluice_admin::AdminState::new(status, started, requests.clone());
        // Every listener listens from here on: until now a connection was refused.
        let admin_task = core.serve_admin(
            listeners.admin.listen()?,
            admin_addr,
            admin_state,
            config.admin_door.clone(),
            [config.tls.clone(), config.admin_tls.clone()],
            &backends_stopped,
        );

        if let Some(check) = listeners.check {
            core.serve_check(check, &config, &backends_stopped)?;
        }
        if let Some(rls) = listeners.rls {
            core.serve_rls(rls, &config, &backends_stopped)?;
        }
        let (stop_gateway, gateway_stopped) = Stop::channel();
        let gateway_task = match (listeners.gateway, stack) {
            (Some(bound), Some(stack)) => {
                let listener = bound.listen()?;
                let workers = gateway::Workers::start(
                    config.workers,
                    move |stats| stack.build(stats),
                    &requests,
                    SHUTDOWN_GRACE,
                    config.tls.as_ref(),
                )
                .map_err(start::io("starting the gateway worker threads"))?;
                if let Some(tls) = config.tls.clone() {
                    tokio::spawn(tls.watch(backends_stopped.clone().wait()));
                }
                tokio::spawn(gateway::serve(
                    listener,
                    workers,
                    config.max_connections,
                    per_ip,
                    gateway_stopped.wait(),
                ))
            }
            _ => tokio::spawn(async { Drain::Complete }),
        };
        start::log_started(&config.store, &config.data_dir, &core);
        Ok(Gateway {
            addr,
            admin_addr,
            check_addr,
            rls_addr,
            upstream,
            demo,
            stop_gateway,
            stop_backends,
            gateway_task,
            admin_task,
            leases_task,
            reloader: core.reloader,
            buffers,
            scheme: if config.tls.is_some() {
                "https"
            } else {
                "http"
            },
            admin_scheme: if config.admin_tls.is_some() {
                "https"
            } else {
                "http"
            },
        })
    }

    /// The bound on request-body bytes held in memory, with what is leased of it now
    /// and by which client (every request path leases from it; a reload keeps it).
    pub fn buffers(&self) -> &Arc<sluice_edge::BufferBudget> {
        &self.buffers
    }

    /// What reloads the policy (SIGHUP and file changes do it by themselves; this is
    /// for callers that want to ask, and for the policy's version).
    pub fn reloader(&self) -> &Arc<Reloader> {
        &self.reloader
    }

    /// The address the gateway listens on (`None` without a gateway: `sluice rls`).
    pub fn addr(&self) -> Option<SocketAddr> {
        self.addr
    }

    /// The address the admin listener listens on.
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin_addr
    }

    /// The address Envoy's rate-limit service listens on (`--rls`), if it runs.
    pub fn rls_addr(&self) -> Option<SocketAddr> {
        self.rls_addr
    }

    /// The address the forward-auth listener listens on (`--check`), if one runs.
    pub fn check_addr(&self) -> Option<SocketAddr> {
        self.check_addr
    }

    /// The upstream requests go to (`None` without a gateway).
    pub fn upstream(&self) -> Option<&Upstream> {
        self.upstream.as_ref()
    }

    /// True when the upstream is the built-in demo.
    pub fn runs_demo(&self) -> bool {
        self.demo.is_some()
    }

    /// The one line `sluice serve` prints on start, naming the bound addresses:
    /// `sluice: listening on http://ADDR (admin http://ADDR, upstream …)` (`https://`
    /// for a listener that speaks TLS), with
    /// `, check http://ADDR` before the `)` when the forward-auth listener runs and
    /// `, rls grpc://ADDR` when the rate-limit service does.
    pub fn start_line(&self) -> String {
        let mut check = self
            .check_addr
            .map_or_else(String::new, |c| format!(", check http://{c}"));
        let (Some(addr), Some(upstream)) = (self.addr, &self.upstream) else {
            // `sluice rls`: the rate-limit service first.
            let rls = self
                .rls_addr
                .map_or_else(|| "none".to_owned(), |r| format!("grpc://{r}"));
            return format!(
                "sluice rls: listening on {rls} (admin {}://{}{check})",
                self.admin_scheme,
                self.admin_addr()
            );
        };
        let upstream = if self.runs_demo() {
            format!("built-in demo at {upstream}")
        } else {
            upstream.to_string()
        };
        if let Some(rls) = self.rls_addr {
            check.push_str(&format!(", rls grpc://{rls}"));
        }
        format!(
            "sluice: listening on {}://{addr} (admin {}://{}, upstream {upstream}{check})",
            self.scheme,
            self.admin_scheme,
            self.admin_addr()
        )
    }

    /// Stops accepting, lets in-flight requests finish for up to [`SHUTDOWN_GRACE`]
    /// (the rest are closed), then stops the admin listener and the demo upstream.
    /// Returns how the drain went.
    pub async fn shutdown(self) -> Drain {
        let _ = self.stop_gateway.send(true);
        let drain = match self.gateway_task.await {
            Ok(drain) => drain,
            Err(_) => Drain::TimedOut { connections: 0 },
        };
        let _ = self.stop_backends.send(true);
        // Leases end with the requests: what they did not spend goes back.
        let _ = tokio::time::timeout(BACKEND_GRACE, self.leases_task).await;
        if drain == Drain::Complete {
            let demo = self.demo;
            let admin_task = self.admin_task;
            let backends = async {
                let _ = admin_task.await;
                if let Some(demo) = demo {
                    demo.join().await;
                }
            };
            // Long-lived streams (the demo's GET /mcp) would hold these open: cut them.
            let _ = tokio::time::timeout(BACKEND_GRACE, backends).await;
        }
        drain
    }
}
