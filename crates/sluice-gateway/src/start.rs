//! The steps of [`Gateway::start`](crate::Gateway::start), each with one job, in the
//! order `start` takes them: bind the listeners, find the upstream (or start the
//! built-in demo), open the stores, build the one limiter, start the background
//! tasks and the batch lanes, then serve the admin listener and the gateway's workers.
//!
//! Nothing here is public: the steps exist so that `start` reads as the sequence it is.

use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::sync::Arc;
use std::time::Duration;

use sluice_batch::BatchQueue;
use sluice_core::SystemClock;
use sluice_edge::arc_swap::ArcSwap;
use sluice_edge::{Limiter, SharedLimiter};
use sluice_policy::Policy;
use sluice_store::{MemoryConfig, MemoryStore};
use sluice_tower::{SluiceLayer, SluiceService};
use tokio::net::{TcpListener, TcpSocket};
use tokio::task::JoinHandle;
use tower::Layer as _;

use crate::batch::{BatchEndpoints, BatchLane};
use crate::metered::RequestStats;
use crate::proxy::{Proxy, ProxyConfig, Upstream};
use crate::store::AnyStore;
use crate::{
    BatchBounds, GatewayConfig, PROXY_LISTENER_CONNECTIONS, Reloader, StartError, Stop, StoreSpec,
    access, h1, per_thread, pool, reload,
};

/// The error for `what` failing with an I/O error.
pub(super) fn io(what: &'static str) -> impl FnOnce(std::io::Error) -> StartError {
    move |source| StartError::Io { what, source }
}

/// Refuses an admin listener that would answer beyond loopback with no token.
///
/// # Errors
/// [`StartError::AdminWithoutToken`].
pub(super) fn check_admin_door(config: &GatewayConfig) -> Result<(), StartError> {
    if sluice_door::needs_token(config.admin) && config.admin_door.token.is_none() {
        return Err(StartError::AdminWithoutToken(config.admin));
    }
    Ok(())
}

/// A listener's socket, bound but not listening yet, with the address the
/// system gave it. Until [`Bound::listen`] (when the process is ready to
/// serve), a connection to it is refused at once, so a client or its balancer
/// goes elsewhere instead of waiting in the backlog while the process starts.
pub(super) struct Bound {
    socket: TcpSocket,
    /// Which listener it is, for an error.
    name: &'static str,
    /// Its address (the port chosen when port 0 was asked for).
    pub(super) addr: SocketAddr,
}

/// How many connections wait to be accepted on a listener (tokio's own
/// `TcpListener::bind` asks for as many).
const LISTEN_BACKLOG: u32 = 1024;

impl Bound {
    /// Starts listening: from now on connections wait to be accepted.
    ///
    /// # Errors
    /// [`StartError::Bind`]: another process bound the address meanwhile and
    /// listened first.
    pub(super) fn listen(self) -> Result<TcpListener, StartError> {
        let (name, addr) = (self.name, self.addr);
        self.socket
            .listen(LISTEN_BACKLOG)
            .map_err(|source| StartError::Bind {
                listener: name,
                addr,
                source,
            })
    }
}

/// The gateway's and the admin listener's sockets.
pub(super) struct Listeners {
    /// The gateway's (`listen`), unless the gateway does not run.
    pub(super) gateway: Option<Bound>,
    /// The admin listener's (`admin`).
    pub(super) admin: Bound,
    /// The forward-auth listener's (`check`), when one runs.
    pub(super) check: Option<Bound>,
    /// The rate-limit service's (`rls`), when it runs.
    pub(super) rls: Option<Bound>,
}

impl Listeners {
    /// Binds the gateway's address, then the admin's, then reads what each got.
    ///
    /// # Errors
    /// [`StartError::Bind`] names the listener whose address cannot be bound;
    /// [`StartError::Io`] when a bound address cannot be read.
    pub(super) fn bind(config: &GatewayConfig) -> Result<Listeners, StartError> {
        let gateway = match config.gateway {
            true => Some(bound("gateway", config.listen)?),
            false => None,
        };
        let admin = bound("admin", config.admin)?;
        let check = match config.check {
            None => None,
            Some(addr) => Some(bound("check", addr)?),
        };
        let rls = match config.rls {
            None => None,
            Some(addr) => Some(bound("rls", addr)?),
        };
        Ok(Listeners {
            gateway,
            admin,
            check,
            rls,
        })
    }
}

/// Binds `addr` for `listener` (with `SO_REUSEADDR`, as tokio's own
/// `TcpListener::bind`), without listening yet, and reads the address it got.
///
/// # Errors
/// [`StartError::Bind`], or [`StartError::Io`] when the address cannot be read.
fn bound(listener: &'static str, addr: SocketAddr) -> Result<Bound, StartError> {
    let failed = |source| StartError::Bind {
        listener,
        addr,
        source,
    };
    let socket = match addr {
        SocketAddr::V4(_) => TcpSocket::new_v4(),
        SocketAddr::V6(_) => TcpSocket::new_v6(),
    }
    .map_err(failed)?;
    #[cfg(unix)]
    socket.set_reuseaddr(true).map_err(failed)?;
    socket.bind(addr).map_err(failed)?;
    let addr = socket.local_addr().map_err(|source| StartError::Io {
        what: "reading a bound address",
        source,
    })?;
    Ok(Bound {
        socket,
        name: listener,
        addr,
    })
}

/// Warns when the forward-auth listener runs with no trusted proxy: every request
/// it decides would then be counted against the proxy's address, not its client's.
pub(super) fn warn_if_no_trusted_proxy(core: &Core, check: SocketAddr) {
    if core
        .limiter
        .load()
        .policy()
        .identity
        .trusted_proxies
        .is_empty()
    {
        tracing::warn!(
            "the check listener on {check} has no trusted proxy (identity.trusted_proxies): per-IP ceilings will count the proxy's address, not its clients'; trust the proxy's address so its X-Forwarded-For is read"
        );
    }
}

/// The upstream requests go to: the configured one, or else the built-in demo,
/// started on a loopback port and stopped by `stop`.
///
/// An https upstream given no roots is verified against the system's; every
/// request to it takes the hyper path (the fast path speaks plain HTTP/1.1 only).
///
/// # Errors
/// [`StartError::Io`] when the demo cannot start, [`StartError::UpstreamTls`] when an
/// https upstream has no roots to be verified against.
pub(super) async fn upstream(
    config: &GatewayConfig,
    stop: &Stop,
) -> Result<(Upstream, Option<sluice_demo::Demo>), StartError> {
    Ok(match config.upstream.clone() {
        Some(upstream) if upstream.is_https() => {
            let upstream = match upstream.tls() {
                Some(_) => upstream,
                None => {
                    let roots =
                        crate::UpstreamTls::system_roots().map_err(StartError::UpstreamTls)?;
                    upstream.with_tls(roots)
                }
            };
            tracing::info!(
                "the upstream {upstream} is https: the HTTP/1.1 fast path is off, every request takes the hyper path"
            );
            (upstream, None)
        }
        Some(upstream) => (upstream, None),
        None => {
            let optimizer = sluice_demo::optimizer::Optimizer::new(config.demo_optimize_time);
            let demo = sluice_demo::start(optimizer, stop.clone().wait())
                .await
                .map_err(io("starting the built-in demo upstream"))?;
            (Upstream::from_addr(demo.addr()), Some(demo))
        }
    })
}

/// What `/status` says of how this gateway is wired: its addresses, its upstream
/// (`demo` when it runs the built-in one), the profile and the store.
pub(super) fn status_info(
    config: &GatewayConfig,
    listeners: &Listeners,
    upstream: Option<&Upstream>,
    runs_demo: bool,
) -> sluice_admin::StatusInfo {
    sluice_admin::StatusInfo {
        listen: listeners.gateway.as_ref().map_or_else(String::new, |g| {
            let scheme = if config.tls.is_some() {
                "https"
            } else {
                "http"
            };
            format!("{scheme}://{}", g.addr)
        }),
        admin: format!(
            "{}://{}",
            if config.admin_tls.is_some() {
                "https"
            } else {
                "http"
            },
            listeners.admin.addr
        ),
        upstream: upstream.map_or_else(String::new, ToString::to_string),
        upstream_kind: match (upstream, runs_demo) {
            (None, _) => "none",
            (Some(_), true) => "demo",
            (Some(_), false) => "external",
        },
        profile: config.policy.profile_name.clone(),
        store: config.store.describe(),
    }
}

/// Where the limiter's budgets live, opened.
pub(super) struct Stores {
    /// The budget store `--store` names.
    budgets: AnyStore,
    /// The store decisions fall back on while `budgets` cannot be reached.
    fallback: MemoryStore,
    /// With Redis, the policy's lanes on a lease ledger shared by every replica.
    lanes: Option<Vec<sluice_lanes::Lane>>,
}

impl Stores {
    /// Opens the store `config.store` names and, in the same place, the batch queue
    /// of the lanes that run a batch lane (`None` when none does): in memory with the
    /// monthly quota counts and the queue in the durable file under `data_dir`, or in
    /// Redis, which then holds the lanes' leases too.
    ///
    /// # Errors
    /// [`StartError::DataDir`] when the durable file cannot be opened,
    /// [`StartError::Store`] when Redis cannot be reached, [`StartError::Lanes`] when
    /// a lane's ledger cannot be set up in it.
    pub(super) async fn open(
        config: &GatewayConfig,
        clock: &SystemClock,
    ) -> Result<(Stores, Option<Arc<dyn BatchQueue>>), StartError> {
        let batch_config = batch_config(&config.policy, config.batch_bounds);
        let (budgets, batches) = match &config.store {
            StoreSpec::Memory => open_local(config, clock, batch_config)?,
            StoreSpec::Redis(url) => open_redis(config, url, batch_config).await?,
        };
        // With Redis, each lane's limits hold across every replica on it.
        let lanes = match &config.store {
            StoreSpec::Redis(url) => Some(shared_lanes(&config.policy, url).await?),
            StoreSpec::Memory => None,
        };
        let fallback = MemoryStore::with_clock(
            MemoryConfig::with_max_keys(sluice_edge::FALLBACK_MAX_KEYS),
            clock.clone(),
        );
        let stores = Stores {
            budgets,
            fallback,
            lanes,
        };
        Ok((stores, batches))
    }

    /// The one limiter every request path decides with: `policy` over these stores,
    /// with the bounds of `bounds`; shared behind an [`ArcSwap`] so that a reload
    /// reaches every path.
    pub(super) fn limiter(
        self,
        policy: Policy,
        bounds: LimiterBounds,
        alerts: Option<Arc<crate::alerts::Outbox>>,
    ) -> SharedLimiter<AnyStore> {
        // An LLM route's first call does not wait for the tokenizers to be built.
        if sluice_edge::tokens::has_llm_routes(&policy) {
            tokio::task::spawn_blocking(sluice_edge::tokens::warm);
        }
        let mut limiter = Limiter::new(policy, self.budgets)
            .with_fallback(self.fallback)
            .with_buffer_bound(bounds.max_buffered_bytes)
            .with_buffer_share(bounds.max_buffered_share)
            .with_body_deadline(bounds.body_deadline)
            .with_refusal_log(bounds.refusal_log_per_second);
        if let Some(lanes) = self.lanes {
            limiter = limiter.with_lanes(lanes);
        }
        if let Some(outbox) = alerts {
            limiter = limiter.with_alerts(outbox);
        }
        // Every request path takes the limiter from here, so a reload reaches them all.
        Arc::new(ArcSwap::from_pointee(limiter))
    }
}

/// An alert outbox and where its events go.
pub(super) type Alerts = (Arc<crate::alerts::Outbox>, Vec<crate::alerts::Target>);

/// The alert outbox and its targets when the policy has `alerts:` (SPEC O3): the
/// outbox in the embedded durable store of `config.data_dir` (the one the quota
/// counts are in; with Redis, opened for it), the targets with their secrets
/// read (a relative `secret_file` is read from the policy file's directory).
///
/// # Errors
/// [`StartError::Alerts`] for a secret that cannot be read, [`StartError::DataDir`]
/// for a data directory that cannot hold the outbox.
pub(super) fn alerts(
    config: &GatewayConfig,
    stores: &Stores,
) -> Result<Option<Alerts>, StartError> {
    if config.policy.alerts.is_empty() {
        return Ok(None);
    }
    let base = config
        .policy_file
        .as_ref()
        .and_then(|f| f.path.parent().map(std::path::Path::to_path_buf))
        .unwrap_or_default();
    let targets = crate::alerts::targets(&config.policy, &base).map_err(StartError::Alerts)?;
    let disk = match &stores.budgets {
        AnyStore::Local(local) => local.book().map(|b| b.store().clone()),
        AnyStore::Redis(_) => Some(sluice_store::DurableStore::open_with(
            &config.data_dir,
            config.quota_sync,
        )?),
    };
    let outbox = crate::alerts::Outbox::open(disk).map_err(StartError::Alerts)?;
    Ok(Some((outbox, targets)))
}

/// Starts the alert sender; with Redis, each event is first claimed there, so
/// that one replica sends it.
pub(super) fn spawn_alerts(
    config: &GatewayConfig,
    limiter: &SharedLimiter<AnyStore>,
    outbox: &Arc<crate::alerts::Outbox>,
    targets: Vec<crate::alerts::Target>,
    stop: &Stop,
) {
    if matches!(config.store, StoreSpec::Redis(_)) {
        let limiter = Arc::clone(limiter);
        outbox.set_claim(Arc::new(
            move |event: sluice_edge::AlertEvent, replica: u64| {
                let limiter = limiter.load_full();
                Box::pin(
                    async move { crate::alerts::claim_in(limiter.store(), &event, replica).await },
                )
            },
        ));
    }
    tokio::spawn(crate::alerts::send(
        Arc::clone(outbox),
        targets,
        stop.clone(),
    ));
}

/// The batch queue's settings: one queue for the lanes that run a batch lane, in the
/// same store, with the first such lane's per-batch bounds and the global `bounds`,
/// and claims of [`BATCH_CLAIM`](sluice_batch::lane::BATCH_CLAIM) that runners renew
/// (`None` when no lane runs a batch lane).
fn batch_config(policy: &Policy, bounds: BatchBounds) -> Option<sluice_batch::BatchConfig> {
    policy.lanes.iter().find_map(|l| l.batch.as_ref()).map(|b| {
        sluice_batch::BatchConfig::default()
            .with_max_items(b.max_items.get() as usize)
            .with_max_backlog(u64::from(b.backlog.get()))
            .with_retention(b.keep)
            .with_max_queued_items(bounds.max_queued_items)
            .with_max_stored_bytes(bounds.max_stored_bytes)
            .with_origin_share(bounds.address_share)
            .with_lease(sluice_batch::lane::BATCH_CLAIM)
    })
}

/// The memory store on `clock`, with the monthly quota counts (and the batch queue)
/// in the durable file under `config.data_dir`.
///
/// # Errors
/// [`StartError::DataDir`].
fn open_local(
    config: &GatewayConfig,
    clock: &SystemClock,
    batch_config: Option<sluice_batch::BatchConfig>,
) -> Result<(AnyStore, Option<Arc<dyn BatchQueue>>), StartError> {
    let (store, book) = AnyStore::local_with_batches(
        clock.clone(),
        &config.data_dir,
        config.quota_sync,
        batch_config,
        MemoryConfig::with_max_keys(config.max_keys).preallocated(),
    )?;
    Ok((store, book.map(|b| Arc::new(b) as Arc<dyn BatchQueue>)))
}

/// The Redis at `url` for the budgets, and for the batch queue when there is one.
///
/// # Errors
/// [`StartError::Store`] when Redis cannot be reached.
async fn open_redis(
    config: &GatewayConfig,
    url: &str,
    batch_config: Option<sluice_batch::BatchConfig>,
) -> Result<(AnyStore, Option<Arc<dyn BatchQueue>>), StartError> {
    let store = AnyStore::redis(url, config.policy.store.timeout)
        .await
        .map_err(|source| StartError::Store {
            store: config.store.describe(),
            source,
        })?;
    let batches = match batch_config {
        Some(c) => Some(Arc::new(
            sluice_batch::RedisBatches::connect(&sluice_store::RedisConfig::new(url), c)
                .await
                .map_err(|e| StartError::Store {
                    store: config.store.describe(),
                    source: sluice_store::StoreError::Unavailable(e.to_string()),
                })?,
        ) as Arc<dyn BatchQueue>),
        None => None,
    };
    Ok((store, batches))
}

/// The policy's lanes on a lease ledger in the Redis at `url`, shared by every
/// replica on it: their limits hold across all of them (see
/// [`sluice_lanes::Lane::with_ledger`]). A lease lives `lease_ttl_seconds` without
/// renewal, and one call to Redis waits at most the store's timeout; while Redis
/// cannot be asked, each lane follows [`sluice_edge::ledger_outage`]. On a Redis
/// Cluster (`redis+cluster://`) each lane's keys live on one node (one hash tag per
/// lane), so a lane's limits hold there too.
///
/// # Errors
/// [`StartError::Lanes`] names the lane whose ledger cannot be set up.
async fn shared_lanes(policy: &Policy, url: &str) -> Result<Vec<sluice_lanes::Lane>, StartError> {
    let mut lanes = Vec::with_capacity(policy.lanes.len());
    for (i, rule) in policy.lanes.iter().enumerate() {
        let failed = |reason: String| StartError::Lanes {
            lane: rule.name.clone(),
            reason,
        };
        let limits = sluice_edge::lane_config(rule);
        let mut ledger = sluice_lanes::RedisLedgerConfig::new(url);
        ledger.lease_ttl = rule.lease_ttl;
        ledger.timeout = policy.store.timeout;
        let ledger = sluice_lanes::RedisLedger::connect(ledger, &rule.name, limits.clone())
            .await
            .map_err(|e| failed(format!("connecting its lease ledger: {e}")))?;
        let lane = sluice_lanes::Lane::with_ledger(
            rule.name.as_str(),
            limits,
            ledger,
            sluice_edge::ledger_outage(policy, i),
        )
        .map_err(|e| failed(e.to_string()))?;
        lanes.push(lane);
    }
    Ok(lanes)
}

/// The tenants the admin API changes, applied over the limiter's policy: from the
/// journal under `--data-dir` on the memory store, or from Redis, followed until
/// `stop` so that another replica's change reaches this one.
///
/// # Errors
/// [`StartError::Tenants`].
pub(super) async fn tenants(
    config: &GatewayConfig,
    limiter: &SharedLimiter<AnyStore>,
    stop: &Stop,
) -> Result<Arc<sluice_admin::tenants::Tenants<AnyStore>>, StartError> {
    use sluice_admin::tenants::Tenants;
    let limiter = Arc::clone(limiter);
    let tenants = match &config.store {
        StoreSpec::Memory => Tenants::local(&config.data_dir, limiter),
        // An admin path, not a decision's: the tenant table's calls wait as long as
        // opening a connection may.
        StoreSpec::Redis(url) => {
            let timeout = config.policy.store.timeout.max(sluice_redis::OPEN_TIMEOUT);
            Tenants::shared(url, timeout, limiter).await
        }
    }
    .map(Arc::new)
    .map_err(StartError::Tenants)?;
    tokio::spawn(Arc::clone(&tenants).follow(stop.clone().wait()));
    Ok(tenants)
}

/// What the limiter takes from the configuration besides the policy: read before the
/// policy is moved into it.
#[derive(Clone, Copy, Debug)]
pub(super) struct LimiterBounds {
    /// [`GatewayConfig::max_buffered_bytes`].
    max_buffered_bytes: usize,
    /// [`GatewayConfig::max_buffered_share`].
    max_buffered_share: f64,
    /// [`GatewayConfig::refusal_log_per_second`].
    refusal_log_per_second: u32,
    /// [`GatewayConfig::body_deadline`].
    body_deadline: Duration,
}

impl LimiterBounds {
    /// The limiter's bounds in `config`.
    pub(super) fn of(config: &GatewayConfig) -> LimiterBounds {
        LimiterBounds {
            max_buffered_bytes: config.max_buffered_bytes,
            max_buffered_share: config.max_buffered_share,
            refusal_log_per_second: config.refusal_log_per_second,
            body_deadline: config.body_deadline,
        }
    }
}

/// The running policy's version: the file's, or without a file the policy's own
/// digest.
pub(super) fn policy_version(config: &GatewayConfig) -> String {
    match &config.policy_file {
        Some(file) => file.version.clone(),
        None => reload::policy_version(format!("{:?}", config.policy).as_bytes()),
    }
}

/// The bound on connections from one address, trusting (and so not bounding) the
/// proxies the current policy trusts.
pub(super) fn per_ip(
    limiter: &SharedLimiter<AnyStore>,
    max_per_ip: NonZeroUsize,
) -> Arc<sluice_door::PerAddress> {
    let (trusted, grouped) = (Arc::clone(limiter), Arc::clone(limiter));
    sluice_door::PerAddress::grouped(
        max_per_ip,
        move |ip| trusted.load().policy().identity.trusts(ip),
        move |ip| grouped.load().policy().identity.address_group(ip),
    )
}

/// Starts the upkeep tasks, which run until `stop`: the reload watch (SIGHUP and
/// changes to the policy file), the reclaim of stale budget cells and the
/// leases' upkeep (returned: it ends the leases at `stop`).
///
/// # Errors
/// [`StartError::Io`] when the SIGHUP handler cannot be installed.
pub(super) async fn spawn_upkeep(
    limiter: &SharedLimiter<AnyStore>,
    reloader: &Arc<Reloader>,
    stop: &Stop,
) -> Result<JoinHandle<()>, StartError> {
    // Installed before anything is served: SIGHUP would otherwise end the process.
    #[cfg(unix)]
    {
        let hangups = reload::hangups().map_err(io("installing the SIGHUP handler"))?;
        tokio::spawn(reload::watcher(Arc::clone(reloader), hangups, stop.clone()).await);
    }
    tokio::spawn(reclaim_stale_cells(Arc::clone(limiter), stop.clone()));
    Ok(tokio::spawn(keep_leases(Arc::clone(limiter), stop.clone())))
}

/// The most rounds of ending leases at `stop` (each [`sluice_edge::SWEEP_EVERY`]
/// apart, while the store does not take the leftovers back).
const LEASE_ROUNDS_AT_STOP: usize = 5;

/// Ends the leases whose time is up and gives their leftovers back when no
/// request does (SPEC D4): every [`sluice_edge::SWEEP_EVERY`] while leases are
/// held or leftovers wait, asleep until the next lease otherwise. At `stop`,
/// ends every lease and gives back what it did not spend.
async fn keep_leases(limiter: SharedLimiter<AnyStore>, stop: Stop) {
    let stopped = stop.wait();
    tokio::pin!(stopped);
    loop {
        let current = limiter.load_full();
        let busy = current.keep_leases(false).await;
        tokio::select! {
            () = tokio::time::sleep(sluice_edge::SWEEP_EVERY), if busy => {}
            () = current.leases_to_keep(), if !busy => {}
            () = &mut stopped => break,
        }
    }
    for _ in 0..LEASE_ROUNDS_AT_STOP {
        if !limiter.load_full().keep_leases(true).await {
            return;
        }
        tokio::time::sleep(sluice_edge::SWEEP_EVERY).await;
    }
}

/// How often stale budget cells are dropped from the memory store (they are also
/// dropped whenever a shard needs room).
const RECLAIM_EVERY: Duration = Duration::from_secs(30);

/// Drops budget cells whose window is over, until the stop signal.
async fn reclaim_stale_cells(limiter: SharedLimiter<AnyStore>, stop: Stop) {
    let mut tick = tokio::time::interval(RECLAIM_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let stopped = stop.wait();
    tokio::pin!(stopped);
    loop {
        tokio::select! {
            _ = tick.tick() => {
                let limiter = limiter.load();
                limiter.store().reclaim();
                limiter.fallback().reclaim();
            }
            () = &mut stopped => return,
        }
    }
}

/// The batch lanes over the batch queue (none without one), sending to `upstream`,
/// each with its runner started until `stop`.
pub(super) fn batch_lanes(
    batches: Option<Arc<dyn BatchQueue>>,
    limiter: &SharedLimiter<AnyStore>,
    upstream: &Upstream,
    clock: &SystemClock,
    stop: &Stop,
) -> Arc<Vec<Arc<BatchLane>>> {
    let batch_lanes = Arc::new(match batches {
        Some(queue) => crate::batch::lanes(limiter, &queue, upstream, clock),
        None => Vec::new(),
    });
    for lane in batch_lanes.iter() {
        tokio::spawn(Arc::clone(lane).run(stop.clone().wait()));
    }
    batch_lanes
}

/// What a gateway serves from once it is built: the one limiter, what reloads it,
/// and the batch lanes. Both request paths of every worker and the admin listener
/// hold them.
pub(super) struct Core {
    /// The one limiter.
    pub(super) limiter: SharedLimiter<AnyStore>,
    /// What reloads it.
    pub(super) reloader: Arc<Reloader>,
    /// The batch lanes (none without a batch queue).
    pub(super) batch_lanes: Arc<Vec<Arc<BatchLane>>>,
    /// The tenants the admin API changes.
    pub(super) tenants: Arc<sluice_admin::tenants::Tenants<AnyStore>>,
    /// The alert outbox, when the policy has alerts (SPEC O3).
    pub(super) alerts: Option<Arc<crate::alerts::Outbox>>,
}

impl Core {
    /// What each gateway worker builds its request paths from, sending to
    /// `upstream` (waiting `upstream_timeout` at most for its response headers),
    /// with access lines when `access_log`.
    pub(super) fn worker_stack(
        &self,
        upstream: &Upstream,
        upstream_timeout: Duration,
        access_log: bool,
    ) -> WorkerStack {
        WorkerStack {
            limiter: Arc::clone(&self.limiter),
            batch_lanes: Arc::clone(&self.batch_lanes),
            proxy: ProxyConfig::new(upstream.clone()).with_header_timeout(upstream_timeout),
            access_log,
        }
    }

    /// Serves the forward-auth listener `check` (`--check`) until `stop`, on a
    /// thread per worker.
    ///
    /// # Errors
    /// [`StartError`] when it cannot listen or its threads cannot start.
    pub(super) fn serve_check(
        &self,
        check: Bound,
        config: &GatewayConfig,
        stop: &Stop,
    ) -> Result<(), StartError> {
        warn_if_no_trusted_proxy(self, check.addr);
        let served = crate::check::serve(
            check.listen()?,
            Arc::clone(&self.limiter),
            config.workers,
            NonZeroUsize::new(PROXY_LISTENER_CONNECTIONS).unwrap_or(NonZeroUsize::MIN),
            per_ip(&self.limiter, config.max_connections_per_ip),
            stop.clone(),
        )
        .map_err(io("starting the check listener threads"))?;
        tokio::spawn(served);
        Ok(())
    }

    /// Serves Envoy's rate-limit service on `rls` (`--rls`) until `stop`, on a
    /// thread per worker.
    ///
    /// # Errors
    /// [`StartError`] when it cannot listen or its threads cannot start.
    pub(super) fn serve_rls(
        &self,
        rls: Bound,
        config: &GatewayConfig,
        stop: &Stop,
    ) -> Result<(), StartError> {
        // A thread per core, as the check listener: a decision stays on the
        // thread that read it, with that thread's Redis coalescer.
        let limiter = Arc::clone(&self.limiter);
        let (stop, stopped) = (stop.clone(), stop.clone());
        let served = per_thread::serve(
            rls.listen()?,
            config.workers,
            NonZeroUsize::new(PROXY_LISTENER_CONNECTIONS).unwrap_or(NonZeroUsize::MIN),
            per_ip(&self.limiter, config.max_connections_per_ip),
            "sluice-rls",
            stopped.wait(),
            move |incoming| {
                // The peer's address rides in the stream's connect info.
                let incoming = futures_util::stream::unfold(incoming, |mut incoming| async {
                    let (stream, _, held) = incoming.accept().await?;
                    Some(((stream, held), incoming))
                });
                let served = sluice_rls::serve_connections(
                    incoming,
                    Arc::clone(&limiter),
                    stop.clone().wait(),
                );
                async move {
                    if let Err(error) = served.await {
                        tracing::error!("the rate-limit service failed: {error}");
                    }
                }
            },
        )
        .map_err(io("starting the rate-limit service threads"))?;
        tokio::spawn(served);
        Ok(())
    }

    /// Serves the admin listener `admin` until `stop`, behind the door `door`
    /// describes: `state` with `/status` showing the limiter's, the batch lanes' and
    /// the policy's state as they are when asked, `/quotas` from the limiter, and the
    /// dashboard's history sampled until `stop`.
    pub(super) fn serve_admin(
        &self,
        admin: TcpListener,
        admin_addr: SocketAddr,
        state: sluice_admin::AdminState<AnyStore>,
        door: sluice_door::DoorConfig,
        tls: [Option<crate::ListenerTls>; 2],
        stop: &Stop,
    ) -> JoinHandle<()> {
        let state = state
            .with_limiter_summary({
                let limiter = Arc::clone(&self.limiter);
                let batch_lanes = Arc::clone(&self.batch_lanes);
                let reloader = Arc::clone(&self.reloader);
                let alerts = self.alerts.clone();
                let [gateway_tls, admin_tls] = tls.clone();
                Arc::new(move || {
                    let limiter = limiter.load();
                    let mut status = serde_json::to_value(limiter.status()).unwrap_or_default();
                    status["store"] = limiter.store().describe_state();
                    status["batches"] = batch_lanes.iter().map(|b| b.summary()).collect();
                    status["policy"] = reloader.status();
                    // SPEC D4: what this replica's leases of leased budgets did.
                    status["leases"] =
                        serde_json::to_value(limiter.lease_tally()).unwrap_or_default();
                    // SPEC O3: the alert events most recently made, newest first.
                    status["alerts"] = alerts
                        .as_ref()
                        .map_or(serde_json::Value::Null, |o| o.recent());
                    // SPEC O5: each TLS listener's certificate, and why changed files
                    // were refused while the old certificate stays in use.
                    let tls_status = |t: &Option<crate::ListenerTls>| {
                        t.as_ref().map_or(serde_json::Value::Null, |t| t.status())
                    };
                    status["tls"] = serde_json::json!({
                        "gateway": tls_status(&gateway_tls),
                        "admin": tls_status(&admin_tls),
                    });
                    status
                })
            })
            .with_quotas(Arc::clone(&self.limiter));
        tokio::spawn(state.clone().keep_history(stop.clone().wait()));
        let door = Arc::new(sluice_door::Door::new(admin_addr, door));
        let [_, admin_tls] = tls;
        let acceptor = admin_tls.as_ref().map(crate::ListenerTls::acceptor);
        if let Some(tls) = admin_tls {
            tokio::spawn(tls.watch(stop.clone().wait()));
        }
        tokio::spawn(sluice_admin::serve_over(
            admin,
            sluice_admin::router(state)
                .merge(sluice_admin::tenants::router(Arc::clone(&self.tenants)))
                .layer(axum::middleware::from_fn_with_state(
                    door,
                    sluice_door::guard,
                )),
            acceptor,
            stop.clone().wait(),
        ))
    }
}

/// The hyper path's service stack: request ids and access lines, the limiter layer,
/// the batch endpoints, then the proxy.
pub(super) type WorkerService = access::RequestIds<SluiceService<AnyStore, BatchEndpoints<Proxy>>>;

/// What each gateway worker builds its two request paths from: its own stack over
/// the one shared limiter, with its own upstream connection pool, driven on its own
/// thread.
pub(super) struct WorkerStack {
    /// The one limiter.
    limiter: SharedLimiter<AnyStore>,
    /// The batch lanes.
    batch_lanes: Arc<Vec<Arc<BatchLane>>>,
    /// The proxy's settings.
    proxy: ProxyConfig,
    /// One access line per request.
    access_log: bool,
}

impl WorkerStack {
    /// One worker's request paths, counting on `stats`: the service stack for the
    /// hyper path and the fast path. Both send over the worker's one pool of
    /// upstream connections.
    pub(super) fn build(&self, stats: RequestStats) -> (WorkerService, h1::FastPath) {
        let connections = Arc::new(pool::Connections::to(&self.proxy.upstream));
        let service = access::RequestIds::new(
            SluiceLayer::reloadable(Arc::clone(&self.limiter))
                .with_batch_repeats()
                .layer(BatchEndpoints::new(
                    Proxy::over(self.proxy.clone(), Arc::clone(&connections)),
                    Arc::clone(&self.batch_lanes),
                )),
            self.access_log,
        );
        let fast = h1::FastPath::new(
            Arc::clone(&self.limiter),
            self.proxy.clone(),
            connections,
            stats,
            self.access_log,
        );
        (service, fast)
    }
}

/// Says where the monthly quota counts are kept (with the memory store, in
/// `data_dir`), which policy version the reloader loaded, and, loudly, a dry run.
pub(super) fn log_started(store: &StoreSpec, data_dir: &std::path::Path, core: &Core) {
    if *store == StoreSpec::Memory {
        tracing::info!(
            "monthly quota counts are kept in {} (--data-dir to choose another)",
            data_dir.display()
        );
    }
    tracing::info!(target: "sluice::reload", version = core.reloader.version(), "policy loaded");
    if core.limiter.load().policy().dry_run {
        tracing::warn!(
            "dry run: every budget is in shadow mode and refuses nothing (its would-be refusals are counted in sluice_shadow_refusals_total); guarded lanes, the breaker and the store outage rule still apply"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A bound listener refuses connections until it listens (the process is
    /// ready), then accepts them; a second bind of a listening address fails
    /// at once, naming the listener.
    #[tokio::test]
    async fn a_listener_refuses_until_the_process_is_ready() {
        let gateway = bound("gateway", SocketAddr::from(([127, 0, 0, 1], 0))).expect("bind");
        let addr = gateway.addr;
        let early = tokio::net::TcpStream::connect(addr).await;
        assert_eq!(
            early.map(|_| ()).map_err(|e| e.kind()),
            Err(std::io::ErrorKind::ConnectionRefused),
            "no connection waits in a backlog before the process is ready"
        );
        let listener = gateway.listen().expect("listen");
        let (connected, accepted) =
            tokio::join!(tokio::net::TcpStream::connect(addr), listener.accept());
        connected.expect("connects once listening");
        accepted.expect("accepted");
        match bound("admin", addr) {
            Err(StartError::Bind { listener, .. }) => assert_eq!(listener, "admin"),
            Err(other) => panic!("a port in use is a bind error, got {other}"),
            Ok(_) => panic!("a listening address cannot be bound again"),
        }
    }
}
