//! Documented on [`Connection`].

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Weak};
use std::time::Duration;

use arc_swap::ArcSwap;
use futures_util::StreamExt as _;
use redis::aio::{ConnectionManager, ConnectionManagerConfig, PubSubStream};
use redis::cluster_async::ClusterConnection;
use redis::sentinel::{Sentinel, SentinelNodeConnectionInfo};
use redis::{
    ClientTlsConfig, ConnectionAddr, ConnectionInfo, ErrorKind, FromRedisValue, IntoConnectionInfo,
    RedisError, RedisResult, Script, ScriptInvocation, ServerErrorKind, TlsCertificates,
};
use tokio::sync::mpsc;

use crate::url::{RedisUrl, TlsFiles, UrlError, UrlKind};

/// The longest one attempt to open a socket to a Redis server may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

/// The longest [`Connection::connect`] waits for one server, retries
/// included; and the longest one look-up of a master through its sentinels
/// may take (asking them, checking the master's role, connecting to it).
pub const OPEN_TIMEOUT: Duration = Duration::from_secs(2);

/// The longest [`Connection::connect`] waits for a cluster (its seed nodes
/// and the slot map), retries included.
pub const CLUSTER_OPEN_TIMEOUT: Duration = Duration::from_secs(5);

/// How many times a failed connection attempt or request is retried.
pub const RETRIES: u32 = 2;

/// The longest pause between two reconnection attempts to one server, and
/// between two look-ups of a master while its sentinels name none that answers.
pub const MAX_RETRY_DELAY: Duration = Duration::from_millis(500);

/// The shortest response timeout a connection is given (a zero timeout would
/// mean none).
pub const MIN_RESPONSE_TIMEOUT: Duration = Duration::from_millis(1);

/// The shortest time between two look-ups of a master that found it where it
/// was: calls failing for another reason (a timeout under load) do not make
/// sluice ask the sentinels more often than this.
pub const SENTINEL_ASK_INTERVAL: Duration = Duration::from_millis(250);

/// The longest pause between two attempts to subscribe to a sentinel's
/// announcements while none answers.
const MAX_SUBSCRIBE_PAUSE: Duration = Duration::from_secs(5);

/// The first pause after a failed look-up of a master; it doubles up to
/// [`MAX_RETRY_DELAY`].
const FIRST_LOOKUP_PAUSE: Duration = Duration::from_millis(50);

/// A connection to one Redis (over TCP, TLS or a Unix socket), to a Redis
/// Cluster, or to the master a group of Redis Sentinels names. Cheap to clone:
/// clones share one multiplexed connection, and concurrent calls on it are
/// pipelined.
///
/// One server is reached through a connection manager that reconnects by
/// itself; a cluster through the cluster client, which follows the slot map;
/// a sentinel group's master as [`SentinelMaster`] describes.
/// Every answer is awaited at most the response timeout given to
/// [`Connection::connect`]; a caller that needs a bound on a whole call
/// (retries included) wraps it in its own `tokio::time::timeout`.
#[derive(Clone)]
pub enum Connection {
    /// One server, over TCP, TLS or a Unix socket.
    Single(ConnectionManager),
    /// A Redis Cluster.
    Cluster(ClusterConnection),
    /// The master a group of Redis Sentinels names, followed across
    /// failovers.
    Sentinel(SentinelMaster),
}

/// Why [`Connection::connect`] failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectError {
    /// The URL does not read.
    #[error(transparent)]
    Url(#[from] UrlError),
    /// One server did not answer within [`OPEN_TIMEOUT`].
    #[error("timed out connecting to redis")]
    Timeout,
    /// A cluster did not answer within [`CLUSTER_OPEN_TIMEOUT`].
    #[error("timed out connecting to the redis cluster")]
    ClusterTimeout,
    /// The sentinels named no master that answered within [`OPEN_TIMEOUT`].
    #[error("timed out asking the redis sentinels for master `{0}` and connecting to it")]
    SentinelTimeout(String),
    /// A file a `rediss://` URL names could not be read, or holds no PEM
    /// certificate where one is expected.
    #[error("the TLS file {} ({parameter}) {reason}", path.display())]
    TlsFile {
        /// The URL's parameter that names it.
        parameter: &'static str,
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// The Redis client refused the settings or the connection failed (a
    /// TLS certificate that does not verify, a refused password, …).
    #[error(transparent)]
    Redis(#[from] RedisError),
}

impl fmt::Debug for Connection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Connection::Single(_) => "Connection::Single",
            Connection::Cluster(_) => "Connection::Cluster",
            Connection::Sentinel(_) => "Connection::Sentinel",
        })
    }
}

/// The connection manager settings every one-server connection gets.
fn manager_config(response_timeout: Duration) -> ConnectionManagerConfig {
    ConnectionManagerConfig::new()
        .set_connection_timeout(Some(CONNECT_TIMEOUT))
        .set_response_timeout(Some(response_timeout))
        .set_number_of_retries(RETRIES as usize)
        .set_max_delay(MAX_RETRY_DELAY)
}

/// Reads the PEM file `path` that the URL's `parameter` names.
fn read_pem(parameter: &'static str, path: &Path, expect: &str) -> Result<Vec<u8>, ConnectError> {
    let bytes = std::fs::read(path).map_err(|e| ConnectError::TlsFile {
        parameter,
        path: path.to_owned(),
        reason: format!("cannot be read: {e}"),
    })?;
    let marker = format!("-----BEGIN {expect}");
    if !bytes.windows(marker.len()).any(|w| w == marker.as_bytes()) {
        return Err(ConnectError::TlsFile {
            parameter,
            path: path.to_owned(),
            reason: format!("holds no PEM block `{marker}`"),
        });
    }
    Ok(bytes)
}

/// A client for one server: with the URL's TLS files when it names any.
fn server_client(
    node: ConnectionInfo,
    tls: Option<&TlsFiles>,
) -> Result<redis::Client, ConnectError> {
    let Some(files) = tls.filter(|f| f.ca_file().is_some() || f.client_identity().is_some()) else {
        return Ok(redis::Client::open(node)?);
    };
    let root_cert = files
        .ca_file()
        .map(|path| read_pem("ssl_ca_certs", path, "CERTIFICATE"))
        .transpose()?;
    let client_tls = files
        .client_identity()
        .map(|(cert, key)| {
            Ok::<_, ConnectError>(ClientTlsConfig {
                client_cert: read_pem("ssl_certfile", cert, "CERTIFICATE")?,
                client_key: read_pem("ssl_keyfile", key, "")?,
            })
        })
        .transpose()?;
    Ok(redis::Client::build_with_tls(
        node,
        TlsCertificates {
            client_tls,
            root_cert,
        },
    )?)
}

impl Connection {
    /// Reads `url` as a [`RedisUrl`] and connects to it.
    ///
    /// # Errors
    /// As [`Connection::connect`], and [`ConnectError::Url`] when `url` does
    /// not read.
    pub async fn open(url: &str, response_timeout: Duration) -> Result<Self, ConnectError> {
        Self::connect(&RedisUrl::parse(url)?, response_timeout).await
    }

    /// Connects to `url`, waiting up to `response_timeout` (at least
    /// [`MIN_RESPONSE_TIMEOUT`]) for each answer afterwards. For a sentinel
    /// URL it asks the sentinels for the master and connects to it.
    ///
    /// # Errors
    /// [`ConnectError::Timeout`], [`ConnectError::ClusterTimeout`] or
    /// [`ConnectError::SentinelTimeout`] when Redis does not answer within
    /// [`OPEN_TIMEOUT`] or [`CLUSTER_OPEN_TIMEOUT`];
    /// [`ConnectError::TlsFile`] when a TLS file does not read;
    /// [`ConnectError::Redis`] when the connection fails sooner (a
    /// certificate that does not verify, no sentinel knowing the master, …).
    pub async fn connect(url: &RedisUrl, response_timeout: Duration) -> Result<Self, ConnectError> {
        let response_timeout = response_timeout.max(MIN_RESPONSE_TIMEOUT);
        match url.kind() {
            UrlKind::Cluster => {
                let client = redis::cluster::ClusterClient::builder(url.nodes().to_vec())
                    .connection_timeout(CONNECT_TIMEOUT)
                    .response_timeout(response_timeout)
                    .retries(RETRIES)
                    .build()?;
                let conn =
                    tokio::time::timeout(CLUSTER_OPEN_TIMEOUT, client.get_async_connection())
                        .await
                        .map_err(|_| ConnectError::ClusterTimeout)??;
                return Ok(Connection::Cluster(conn));
            }
            UrlKind::Sentinel => {
                return Ok(Connection::Sentinel(
                    SentinelMaster::connect(url, response_timeout).await?,
                ));
            }
            _ => {}
        }
        let node = url
            .nodes()
            .first()
            .cloned()
            .ok_or(UrlError::UnknownScheme)?;
        let client = server_client(node, url.tls())?;
        let conn = tokio::time::timeout(
            OPEN_TIMEOUT,
            client.get_connection_manager_with_config(manager_config(response_timeout)),
        )
        .await
        .map_err(|_| ConnectError::Timeout)??;
        Ok(Connection::Single(conn))
    }

    /// A client for a subscription that hears what this connection's calls publish
    /// (`url` is the one it was made from): to the server, a cluster's first seed
    /// node (a cluster forwards a publication to every node), or a sentinel group's
    /// master of the moment; with the URL's TLS files when it names any.
    ///
    /// # Errors
    /// [`ConnectError`] when a TLS file cannot be read or the client not made.
    pub fn subscriber(&self, url: &RedisUrl) -> Result<redis::Client, ConnectError> {
        let node = match self {
            Connection::Sentinel(master) => master.master_info(url)?,
            Connection::Single(_) | Connection::Cluster(_) => url
                .nodes()
                .first()
                .cloned()
                .ok_or(UrlError::NoClusterNodes)?,
        };
        server_client(node, url.tls())
    }

    /// Whether this is a cluster's connection.
    pub fn is_cluster(&self) -> bool {
        matches!(self, Connection::Cluster(_))
    }

    /// Loads `script` on one server (a sentinel group's master now), so that
    /// its first call goes by hash. On a cluster it does nothing: each node
    /// loads the script on its first `NOSCRIPT` (see [`Connection::invoke`]),
    /// as a master promoted by a failover does. A load that outlasts the
    /// response timeout (a decision's, often a few milliseconds; compiling a
    /// script on a busy server can take longer) is sent again until
    /// [`OPEN_TIMEOUT`] has passed: it happens once, at start, and loading
    /// twice changes nothing.
    ///
    /// # Errors
    /// The Redis client's error when the server refuses, or does not answer within
    /// [`OPEN_TIMEOUT`].
    pub async fn load_script(&self, script: &Script) -> RedisResult<()> {
        let mut manager = match self {
            Connection::Single(c) => c.clone(),
            Connection::Sentinel(m) => m.manager(),
            Connection::Cluster(_) => return Ok(()),
        };
        let deadline = tokio::time::Instant::now() + OPEN_TIMEOUT;
        loop {
            match script.load_async(&mut manager).await {
                Ok(_) => return Ok(()),
                Err(e) if e.is_timeout() && tokio::time::Instant::now() < deadline => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// Calls a script by its hash (`EVALSHA`); when Redis answers
    /// `NOSCRIPT` (a restart, `SCRIPT FLUSH`, a cluster node or a newly
    /// promoted master seeing it for the first time) loads it and calls it
    /// again.
    ///
    /// On one server and on a sentinel group's master, a call turned away
    /// because its connection was already closed (Redis restarted, or closed
    /// it, while it was idle) or the last reconnection was refused is made
    /// once more, on the connection opened instead: never sent, it cannot
    /// count twice. A call that failed after it may have been sent is not
    /// made again.
    ///
    /// # Errors
    /// The Redis client's error: no answer within the response timeout, the
    /// connection down, the script failing, a reply not of type `T`, or
    /// (`READONLY`) a sentinel group's master demoted since the last look-up.
    pub async fn invoke<T: FromRedisValue>(
        &self,
        invocation: &ScriptInvocation<'_>,
    ) -> RedisResult<T> {
        match self {
            Connection::Single(c) => {
                again_if_unsent(|| {
                    let mut c = c.clone();
                    async move { invocation.invoke_async(&mut c).await }
                })
                .await
            }
            Connection::Cluster(c) => invocation.invoke_async(&mut c.clone()).await,
            Connection::Sentinel(m) => m.invoke(invocation).await,
        }
    }
}

/// Makes a call on one server's connection (`call` sends it on the
/// connection manager's connection of the moment) and, when it failed on a
/// connection already known to be broken, makes it once more, on the
/// connection the manager opened instead.
///
/// Why: a connection that Redis closed while it was idle (a restart, a
/// failover, an idle timeout on the server or a proxy) is noticed by the
/// connection's reader as soon as the socket closes, but the manager only
/// replaces it when a call fails on it. Without this, every call of the first
/// burst after Redis came back fails at once and falls under the outage rule —
/// and fails enough to open the store's circuit breaker, so the calls of the
/// next quarter second do too — although Redis answers.
///
/// Why calling again cannot count twice: the call is made again only when it
/// failed with a connection-level error (dropped, reset, refused, broken pipe —
/// never a timeout) *without ever having waited*: its future was ready on its
/// first poll. A command goes to Redis by being handed to the connection's
/// writer, a task of its own, and its answer (or the error that replaces it)
/// comes back from that task; a call that never waited was turned away before
/// any of that: the writer had already stopped (its connection closed), or
/// the manager's last attempt to reconnect had failed (a connection refused).
/// For a command that did reach Redis to fail, the connection must break after
/// it was written — a round trip on the network that a call which never
/// waited cannot have spanned. A call that failed after waiting may have been
/// executed (its script run, its units spent): it is never made again, and its
/// caller's outage rule applies.
async fn again_if_unsent<T, F, Fut>(mut call: F) -> RedisResult<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = RedisResult<T>>,
{
    let (result, waited) = watching_for_waits(call()).await;
    match result {
        Err(e) if !waited && is_broken_connection(&e) => {
            tracing::debug!(
                error = %e,
                "redis: the connection was closed before this call was sent; sending it on a new one"
            );
            call().await
        }
        result => result,
    }
}

/// Makes `call` and tells, when it failed, whether it is known never to have
/// reached Redis, by the rule by which a failed call is made once more on one
/// server and through Sentinel: it failed with a connection-level error
/// without ever having waited (a Cluster's calls always wait, so theirs never
/// count as unsent). A call that failed otherwise (a timeout, an error after
/// waiting) may have run: its caller must not make it again.
pub async fn unsent_on_failure<T>(
    call: impl Future<Output = RedisResult<T>>,
) -> (RedisResult<T>, bool) {
    let (result, waited) = watching_for_waits(call).await;
    let unsent = result
        .as_ref()
        .is_err_and(|e| !waited && is_broken_connection(e));
    (result, unsent)
}

/// Runs `future` to its end, and tells whether it ever waited (returned
/// `Pending`).
async fn watching_for_waits<F: Future>(future: F) -> (F::Output, bool) {
    let mut future = std::pin::pin!(future);
    let mut waited = false;
    let output = std::future::poll_fn(|cx| {
        let poll = future.as_mut().poll(cx);
        waited |= poll.is_pending();
        poll
    })
    .await;
    (output, waited)
}

/// Whether `e` says the connection is broken (closed, reset, refused, a
/// broken pipe) rather than slow (a timeout) or the command refused (an
/// error reply).
fn is_broken_connection(e: &RedisError) -> bool {
    !e.is_timeout() && (e.is_connection_dropped() || e.is_connection_refusal())
}

/// The master a group of Redis Sentinels names (`redis+sentinel://`),
/// followed across failovers without a restart. Cheap to clone: clones share
/// one connection and one follower.
///
/// [`Connection::connect`] asks the sentinels (all at once) for the master's
/// address, checks with `ROLE` that it is a master, and connects to it with a
/// connection manager as for one server. Then a call that fails the way a
/// failover makes calls fail — the connection refused or dropped, no answer
/// in time, `READONLY` from a master demoted to a replica, `MASTERDOWN`,
/// `LOADING` — or that its caller gives up on, makes a background task ask
/// the sentinels again: if they name another master, calls go to it from then
/// on. The call that failed is not retried: its caller sees the error at once
/// (sluice's outage rule decides what happens to the request).
///
/// The follower also listens to one sentinel's `+switch-master`
/// announcements (a subscription, silent at rest) and looks up when one names
/// this master: a master demoted by `SENTINEL FAILOVER` (a planned switch)
/// keeps answering until the sentinels reconfigure it, seconds after they
/// promoted another. When that sentinel goes away it subscribes to the next,
/// pausing up to 5 s between attempts while none answers, and looks up once
/// subscribed again (an announcement may have been missed).
///
/// Bounds: each look-up takes at most [`OPEN_TIMEOUT`]; while the sentinels
/// name no master that answers (during a failover, before one is promoted)
/// the look-ups are repeated with pauses doubling from 50 ms to
/// [`MAX_RETRY_DELAY`]; a look-up that finds the master where it was is
/// followed by at least [`SENTINEL_ASK_INTERVAL`] without another. The task
/// ends when the last clone is dropped.
#[derive(Clone)]
pub struct SentinelMaster {
    shared: Arc<Followed>,
}

/// What the clones of a [`SentinelMaster`] share.
struct Followed {
    /// The master calls go to now.
    current: ArcSwap<Master>,
    /// Asks the follower to look the master up again (capacity 1: one
    /// request waiting is enough).
    ask: mpsc::Sender<()>,
}

/// A master and the connection to it.
struct Master {
    addr: ConnectionAddr,
    manager: ConnectionManager,
}

/// How to look the master up: the sentinels, its name, its settings.
struct Lookup {
    sentinel: Sentinel,
    name: String,
    node: SentinelNodeConnectionInfo,
    config: ConnectionManagerConfig,
}

impl Lookup {
    /// The master the sentinels name, connected — or `None` when it is still
    /// at `known`.
    async fn master(&mut self, known: Option<&ConnectionAddr>) -> RedisResult<Option<Master>> {
        let client = self
            .sentinel
            .async_master_for(&self.name, Some(&self.node))
            .await?;
        let addr = client.get_connection_info().addr().clone();
        if known == Some(&addr) {
            return Ok(None);
        }
        let manager = client
            .get_connection_manager_with_config(self.config.clone())
            .await?;
        Ok(Some(Master { addr, manager }))
    }
}

impl SentinelMaster {
    async fn connect(url: &RedisUrl, response_timeout: Duration) -> Result<Self, ConnectError> {
        let name = url.master_name().ok_or(UrlError::NoMasterName)?.to_owned();
        let node = SentinelNodeConnectionInfo::default()
            .set_redis_connection_info(url.master_settings().cloned().unwrap_or_default());
        let mut lookup = Lookup {
            sentinel: Sentinel::build(url.nodes().to_vec())?,
            name,
            node,
            config: manager_config(response_timeout),
        };
        let master = tokio::time::timeout(OPEN_TIMEOUT, lookup.master(None))
            .await
            .map_err(|_| ConnectError::SentinelTimeout(lookup.name.clone()))??
            .ok_or(ConnectError::SentinelTimeout(lookup.name.clone()))?;
        let (ask, asked) = mpsc::channel(1);
        let shared = Arc::new(Followed {
            current: ArcSwap::from_pointee(master),
            ask,
        });
        let switches = Switches::new(url.nodes().to_vec(), &lookup.name);
        tokio::spawn(follow(Arc::downgrade(&shared), asked, lookup, switches));
        Ok(SentinelMaster { shared })
    }

    /// The connection to the master calls go to now.
    fn manager(&self) -> ConnectionManager {
        self.shared.current.load().manager.clone()
    }

    /// The master calls go to now, with the settings the URL gives it.
    fn master_info(&self, url: &RedisUrl) -> Result<ConnectionInfo, ConnectError> {
        let addr = self.shared.current.load().addr.clone();
        Ok(addr
            .into_connection_info()?
            .set_redis_settings(url.master_settings().cloned().unwrap_or_default()))
    }

    /// The address (`HOST:PORT`) of the master calls go to now.
    pub fn master_addr(&self) -> String {
        self.shared.current.load().addr.to_string()
    }

    /// Asks the follower to look the master up again.
    fn ask_sentinels(&self) {
        // Full: a look-up is already asked for.
        let _ = self.shared.ask.try_send(());
    }

    async fn invoke<T: FromRedisValue>(&self, invocation: &ScriptInvocation<'_>) -> RedisResult<T> {
        // A call its caller stops waiting for (its own timeout) may be a
        // master that no longer answers: ask too.
        let mut unanswered = AskOnDrop(Some(self));
        let mut attempts = 0u8;
        let result = again_if_unsent(|| {
            attempts = attempts.saturating_add(1);
            let mut manager = self.manager();
            async move { invocation.invoke_async(&mut manager).await }
        })
        .await;
        unanswered.0 = None;
        // A call made again found its connection closed: the master may have
        // gone (a failover), even if the new connection answered.
        if attempts > 1 || result.as_ref().is_err_and(points_elsewhere) {
            self.ask_sentinels();
        }
        result
    }
}

impl fmt::Debug for SentinelMaster {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SentinelMaster")
            .field("master", &self.master_addr())
            .finish_non_exhaustive()
    }
}

/// Asks the sentinels when dropped still holding the master.
struct AskOnDrop<'a>(Option<&'a SentinelMaster>);

impl Drop for AskOnDrop<'_> {
    fn drop(&mut self) {
        if let Some(master) = self.0 {
            master.ask_sentinels();
        }
    }
}

/// Whether `e` may mean that the master is elsewhere now.
fn points_elsewhere(e: &RedisError) -> bool {
    e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_timeout()
        || e.is_unrecoverable_error()
        || matches!(
            e.kind(),
            ErrorKind::Server(
                ServerErrorKind::ReadOnly
                    | ServerErrorKind::MasterDown
                    | ServerErrorKind::BusyLoading
            )
        )
}

/// The sentinels' `+switch-master` announcements, heard on one sentinel at a
/// time.
struct Switches {
    sentinels: Vec<ConnectionInfo>,
    /// The sentinel to subscribe to next.
    next: usize,
    /// `MASTER ` (an announcement is `MASTER OLD-IP OLD-PORT NEW-IP NEW-PORT`).
    prefix: Vec<u8>,
    stream: Option<PubSubStream>,
    pause: Duration,
}

impl Switches {
    fn new(sentinels: Vec<ConnectionInfo>, name: &str) -> Self {
        Switches {
            sentinels,
            next: 0,
            prefix: format!("{name} ").into_bytes(),
            stream: None,
            pause: FIRST_LOOKUP_PAUSE,
        }
    }

    /// Returns when a sentinel announces a new master for this name, or once
    /// subscribed anew. Cancel-safe: dropped at any await, it loses nothing
    /// but a subscription under way.
    async fn next(&mut self) {
        loop {
            if let Some(stream) = &mut self.stream {
                match stream.next().await {
                    Some(message) if message.get_payload_bytes().starts_with(&self.prefix) => {
                        return;
                    }
                    Some(_) => continue,
                    // The sentinel went away.
                    None => self.stream = None,
                }
            }
            let Some(sentinel) = self.sentinels.get(self.next % self.sentinels.len().max(1)) else {
                // No sentinel (a URL always names one): nothing to hear.
                return std::future::pending().await;
            };
            self.next = self.next.wrapping_add(1);
            let subscribe = async {
                let mut pubsub = redis::Client::open(sentinel.clone())?
                    .get_async_pubsub()
                    .await?;
                pubsub.subscribe("+switch-master").await?;
                Ok::<_, RedisError>(pubsub.into_on_message())
            };
            match tokio::time::timeout(CONNECT_TIMEOUT, subscribe).await {
                Ok(Ok(stream)) => {
                    self.stream = Some(stream);
                    self.pause = FIRST_LOOKUP_PAUSE;
                    return;
                }
                Ok(Err(e)) => tracing::debug!(
                    sentinel = %sentinel.addr(),
                    error = %e,
                    "redis: cannot subscribe to the sentinel's announcements"
                ),
                Err(_) => tracing::debug!(
                    sentinel = %sentinel.addr(),
                    "redis: subscribing to the sentinel's announcements timed out"
                ),
            }
            tokio::time::sleep(self.pause).await;
            self.pause = (self.pause * 2).min(MAX_SUBSCRIBE_PAUSE);
        }
    }
}

/// Looks the master up each time it is asked to or a sentinel announces a
/// switch, until it finds one that answers; ends when every [`SentinelMaster`]
/// is gone.
async fn follow(
    shared: Weak<Followed>,
    mut asked: mpsc::Receiver<()>,
    mut lookup: Lookup,
    mut switches: Switches,
) {
    loop {
        tokio::select! {
            asked_for = asked.recv() => {
                // Every sender gone: no one calls any more.
                if asked_for.is_none() {
                    return;
                }
            }
            () = switches.next() => {}
        }
        let mut pause = FIRST_LOOKUP_PAUSE;
        loop {
            let Some(known) = shared.upgrade().map(|s| s.current.load_full()) else {
                return;
            };
            match tokio::time::timeout(OPEN_TIMEOUT, lookup.master(Some(&known.addr))).await {
                Ok(Ok(None)) => break,
                Ok(Ok(Some(master))) => {
                    let Some(shared) = shared.upgrade() else {
                        return;
                    };
                    tracing::warn!(
                        master = %lookup.name,
                        from = %known.addr,
                        to = %master.addr,
                        "redis: the sentinels name a new master; calls go to it from now on"
                    );
                    shared.current.store(Arc::new(master));
                    break;
                }
                Ok(Err(e)) => tracing::debug!(
                    master = %lookup.name,
                    error = %e,
                    "redis: no master from the sentinels yet"
                ),
                Err(_) => tracing::debug!(
                    master = %lookup.name,
                    "redis: asking the sentinels timed out"
                ),
            }
            drop(known);
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(MAX_RETRY_DELAY);
        }
        tokio::time::sleep(SENTINEL_ASK_INTERVAL).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn io(kind: std::io::ErrorKind) -> RedisError {
        std::io::Error::from(kind).into()
    }

    /// How many times [`again_if_unsent`] makes a call that fails with
    /// `error`, after waiting once or at once.
    async fn calls_made(error: fn() -> RedisError, waits: bool) -> usize {
        let calls = std::sync::atomic::AtomicUsize::new(0);
        let result: RedisResult<()> = again_if_unsent(|| {
            calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            async move {
                if waits {
                    tokio::task::yield_now().await;
                }
                Err(error())
            }
        })
        .await;
        assert!(result.is_err());
        calls.into_inner()
    }

    #[tokio::test]
    async fn d3_a_call_turned_away_by_a_broken_connection_is_made_once_more_and_no_other() {
        use std::io::ErrorKind::{BrokenPipe, ConnectionRefused, ConnectionReset, TimedOut};
        // Failed without waiting on a closed or refused connection: not sent,
        // so sent once more (and only once).
        assert_eq!(calls_made(|| io(BrokenPipe), false).await, 2);
        assert_eq!(calls_made(|| io(ConnectionReset), false).await, 2);
        assert_eq!(calls_made(|| io(ConnectionRefused), false).await, 2);
        // Failed after waiting: it may have run; never again.
        assert_eq!(calls_made(|| io(BrokenPipe), true).await, 1);
        assert_eq!(calls_made(|| io(TimedOut), true).await, 1);
        // Not the connection: a timeout, or Redis refusing the command.
        assert_eq!(calls_made(|| io(TimedOut), false).await, 1);
        assert_eq!(
            calls_made(|| (ErrorKind::Client, "refused").into(), false).await,
            1
        );
        // A call that succeeds is made once.
        let calls = std::sync::atomic::AtomicUsize::new(0);
        let answer: RedisResult<i64> = again_if_unsent(|| {
            calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            async { Ok(42) }
        })
        .await;
        assert_eq!(answer.ok(), Some(42));
        assert_eq!(calls.into_inner(), 1);
    }

    #[tokio::test]
    async fn a_bad_url_fails_before_any_connection() {
        let err = Connection::open("rediss+cluster://localhost", Duration::from_millis(5))
            .await
            .expect_err("no TLS to a cluster");
        assert!(
            matches!(err, ConnectError::Url(UrlError::Tls { .. })),
            "{err}"
        );
        let err = Connection::open("redis+sentinel://localhost", Duration::from_millis(5))
            .await
            .expect_err("no master name");
        assert!(
            matches!(err, ConnectError::Url(UrlError::NoMasterName)),
            "{err}"
        );
    }

    #[tokio::test]
    async fn sentinels_that_do_not_answer_fail_within_the_open_timeout() {
        let started = std::time::Instant::now();
        let err = Connection::open(
            "redis+sentinel://127.0.0.1:1,127.0.0.1:2/mymaster",
            Duration::from_millis(5),
        )
        .await
        .expect_err("no sentinel");
        assert!(
            matches!(
                err,
                ConnectError::Redis(_) | ConnectError::SentinelTimeout(_)
            ),
            "{err}"
        );
        assert!(started.elapsed() < OPEN_TIMEOUT + Duration::from_secs(1));
    }

    #[tokio::test]
    async fn a_tls_file_that_does_not_read_is_named() {
        let dir = std::env::temp_dir();
        let missing = dir.join(format!("sluice-redis-none-{}.pem", std::process::id()));
        let err = Connection::open(
            &format!("rediss://127.0.0.1:1?ssl_ca_certs={}", missing.display()),
            Duration::from_millis(5),
        )
        .await
        .expect_err("no CA file");
        assert!(
            matches!(&err, ConnectError::TlsFile { parameter: "ssl_ca_certs", path, .. } if path == &missing),
            "{err}"
        );
        assert!(err.to_string().contains("cannot be read"), "{err}");
        let not_pem = dir.join(format!("sluice-redis-not-pem-{}.pem", std::process::id()));
        std::fs::write(&not_pem, "not a certificate").expect("write");
        let err = Connection::open(
            &format!("rediss://127.0.0.1:1?ssl_ca_certs={}", not_pem.display()),
            Duration::from_millis(5),
        )
        .await
        .expect_err("no PEM");
        let _ = std::fs::remove_file(&not_pem);
        assert!(
            err.to_string()
                .contains("holds no PEM block `-----BEGIN CERTIFICATE`"),
            "{err}"
        );
    }

    #[tokio::test]
    async fn a_missing_socket_fails_fast() {
        let path =
            std::env::temp_dir().join(format!("sluice-redis-none-{}.sock", std::process::id()));
        let started = std::time::Instant::now();
        let err = Connection::open(
            &format!("redis+unix://{}", path.display()),
            Duration::from_millis(5),
        )
        .await
        .expect_err("no server");
        assert!(
            matches!(err, ConnectError::Redis(_) | ConnectError::Timeout),
            "{err}"
        );
        assert!(started.elapsed() < OPEN_TIMEOUT + Duration::from_secs(1));
    }
}
