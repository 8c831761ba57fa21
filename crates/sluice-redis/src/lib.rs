//! How sluice reaches Redis, written once for the budget store, the lane
//! ledger and the batch queue.
//!
//! - [`RedisUrl`]: every URL sluice accepts, parsed into a typed value with a
//!   clear [`UrlError`] — one server (`redis://HOST:PORT[/DB]`), one server
//!   over TLS (`rediss://HOST:PORT[/DB]`, with optional CA and client
//!   certificate files), one server on a Unix socket (`redis+unix:///PATH`,
//!   `unix:///PATH`), a cluster (`redis+cluster://HOST:PORT,HOST:PORT,…`) or
//!   the master a group of Redis Sentinels names
//!   (`redis+sentinel://HOST:PORT,HOST:PORT,…/MASTER[/DB]`). Its `Display`
//!   hides passwords.
//! - [`Connection`]: one server, a cluster or a sentinel group's master
//!   ([`SentinelMaster`], followed across failovers), opened with sluice's
//!   timeouts ([`CONNECT_TIMEOUT`], [`OPEN_TIMEOUT`], [`CLUSTER_OPEN_TIMEOUT`],
//!   and a response timeout the caller chooses); [`Connection::invoke`] calls a
//!   script by its hash, loads it again when Redis answers `NOSCRIPT`, and
//!   sends a call again on a new connection only when the one it was given
//!   had closed before the call was sent (a Redis restart while idle).
//!
//! ```no_run
//! use std::time::Duration;
//! use sluice_redis::{Connection, RedisUrl, UrlKind};
//!
//! # async fn run() -> Result<(), sluice_redis::ConnectError> {
//! let url: RedisUrl = "redis://:secret@127.0.0.1:6379/0".parse()?;
//! assert_eq!(url.kind(), UrlKind::Server);
//! assert_eq!(url.to_string(), "redis://…@127.0.0.1:6379/0");
//!
//! let conn = Connection::connect(&url, Duration::from_millis(20)).await?;
//! let script = sluice_redis::redis::Script::new("return ARGV[1] + 1");
//! conn.load_script(&script).await?;
//! let mut call = script.prepare_invoke();
//! call.arg(41);
//! let answer: i64 = conn.invoke(&call).await?;
//! assert_eq!(answer, 42);
//! # Ok(()) }
//! ```

mod connection;
mod url;

pub use connection::{
    CLUSTER_OPEN_TIMEOUT, CONNECT_TIMEOUT, ConnectError, Connection, MAX_RETRY_DELAY,
    MIN_RESPONSE_TIMEOUT, OPEN_TIMEOUT, RETRIES, SENTINEL_ASK_INTERVAL, SentinelMaster,
    unsent_on_failure,
};
pub use url::{RedisUrl, SENTINEL_PORT, TlsFiles, UrlError, UrlKind};

/// The Redis client this crate is built on, for script invocations and
/// replies (`redis::Script`, `redis::FromRedisValue`, `redis::Value`).
pub use redis;
