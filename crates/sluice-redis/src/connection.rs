//! Documented on [`Connection`].

use std::fmt;
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use redis::{FromRedisValue, RedisError, RedisResult, Script, ScriptInvocation};

use crate::url::{RedisUrl, UrlError, UrlKind};

/// The longest one attempt to open a socket to a Redis server may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

/// The longest [`Connection::connect`] waits for one server, retries
/// included.
pub const OPEN_TIMEOUT: Duration = Duration::from_secs(2);

/// The longest [`Connection::connect`] waits for a cluster (its seed nodes
/// and the slot map), retries included.
pub const CLUSTER_OPEN_TIMEOUT: Duration = Duration::from_secs(5);

/// How many times a failed connection attempt or request is retried.
pub const RETRIES: u32 = 2;

/// The longest pause between two reconnection attempts to one server.
pub const MAX_RETRY_DELAY: Duration = Duration::from_millis(500);

/// The shortest response timeout a connection is given (a zero timeout would
/// mean none).
pub const MIN_RESPONSE_TIMEOUT: Duration = Duration::from_millis(1);

/// A connection to one Redis (over TCP or a Unix socket) or to a Redis
/// Cluster. Cheap to clone: clones share one multiplexed connection, and
/// concurrent calls on it are pipelined.
///
/// One server is reached through a connection manager that reconnects by
/// itself; a cluster through the cluster client, which follows the slot map.
/// Every answer is awaited at most the response timeout given to
/// [`Connection::connect`]; a caller that needs a bound on a whole call
/// (retries included) wraps it in its own `tokio::time::timeout`.
#[derive(Clone)]
pub enum Connection {
    /// One server, over TCP or a Unix socket.
    Single(ConnectionManager),
    /// A Redis Cluster.
    Cluster(ClusterConnection),
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
    /// The Redis client refused the settings or the connection failed.
    #[error(transparent)]
    Redis(#[from] RedisError),
}

impl fmt::Debug for Connection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Connection::Single(_) => "Connection::Single",
            Connection::Cluster(_) => "Connection::Cluster",
        })
    }
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
    /// [`MIN_RESPONSE_TIMEOUT`]) for each answer afterwards.
    ///
    /// # Errors
    /// [`ConnectError::Timeout`] or [`ConnectError::ClusterTimeout`] when
    /// Redis does not answer within [`OPEN_TIMEOUT`] or
    /// [`CLUSTER_OPEN_TIMEOUT`]; [`ConnectError::Redis`] when the connection
    /// fails sooner.
    pub async fn connect(url: &RedisUrl, response_timeout: Duration) -> Result<Self, ConnectError> {
        let response_timeout = response_timeout.max(MIN_RESPONSE_TIMEOUT);
        if url.kind() == UrlKind::Cluster {
            let client = redis::cluster::ClusterClient::builder(url.nodes().to_vec())
                .connection_timeout(CONNECT_TIMEOUT)
                .response_timeout(response_timeout)
                .retries(RETRIES)
                .build()?;
            let conn = tokio::time::timeout(CLUSTER_OPEN_TIMEOUT, client.get_async_connection())
                .await
                .map_err(|_| ConnectError::ClusterTimeout)??;
            return Ok(Connection::Cluster(conn));
        }
        let node = url
            .nodes()
            .first()
            .cloned()
            .ok_or(UrlError::UnknownScheme)?;
        let client = redis::Client::open(node)?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(CONNECT_TIMEOUT))
            .set_response_timeout(Some(response_timeout))
            .set_number_of_retries(RETRIES as usize)
            .set_max_delay(MAX_RETRY_DELAY);
        let conn = tokio::time::timeout(
            OPEN_TIMEOUT,
            client.get_connection_manager_with_config(config),
        )
        .await
        .map_err(|_| ConnectError::Timeout)??;
        Ok(Connection::Single(conn))
    }

    /// Whether this is a cluster's connection.
    pub fn is_cluster(&self) -> bool {
        matches!(self, Connection::Cluster(_))
    }

    /// Loads `script` on one server, so that its first call goes by hash. On
    /// a cluster it does nothing: each node loads the script on its first
    /// `NOSCRIPT` (see [`Connection::invoke`]). A load that outlasts the response
    /// timeout (a decision's, often a few milliseconds; compiling a script on a busy
    /// server can take longer) is sent again until [`OPEN_TIMEOUT`] has passed: it
    /// happens once, at start, and loading twice changes nothing.
    ///
    /// # Errors
    /// The Redis client's error when the server refuses, or does not answer within
    /// [`OPEN_TIMEOUT`].
    pub async fn load_script(&self, script: &Script) -> RedisResult<()> {
        match self {
            Connection::Single(c) => {
                let deadline = tokio::time::Instant::now() + OPEN_TIMEOUT;
                loop {
                    match script.load_async(&mut c.clone()).await {
                        Ok(_) => return Ok(()),
                        Err(e) if e.is_timeout() && tokio::time::Instant::now() < deadline => {}
                        Err(e) => return Err(e),
                    }
                }
            }
            Connection::Cluster(_) => Ok(()),
        }
    }

    /// Calls a script by its hash (`EVALSHA`); when Redis answers
    /// `NOSCRIPT` (a restart, `SCRIPT FLUSH`, a cluster node seeing it for
    /// the first time) loads it and calls it again.
    ///
    /// # Errors
    /// The Redis client's error: no answer within the response timeout, the
    /// connection down, the script failing, or a reply not of type `T`.
    pub async fn invoke<T: FromRedisValue>(
        &self,
        invocation: &ScriptInvocation<'_>,
    ) -> RedisResult<T> {
        match self {
            Connection::Single(c) => invocation.invoke_async(&mut c.clone()).await,
            Connection::Cluster(c) => invocation.invoke_async(&mut c.clone()).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_bad_url_fails_before_any_connection() {
        let err = Connection::open("rediss://localhost", Duration::from_millis(5))
            .await
            .expect_err("no TLS");
        assert!(matches!(err, ConnectError::Url(UrlError::Tls)), "{err}");
        assert_eq!(err.to_string(), UrlError::Tls.to_string());
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
