//! Documented on [`RedisLedger`].

use std::sync::Arc;
use std::time::Duration;

use sluice_core::Clock;
use sluice_redis::Connection;

use crate::config::{LaneConfig, WorkspaceLimits};
use crate::ledger::{Lease, LeaseIds, LeaseKind, Ledger, LedgerCounts, LedgerError, Taken};
use crate::refusal::RefusalReason;

const SCRIPT: &str = include_str!("lanes.lua");

/// How to reach the shared ledger.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RedisLedgerConfig {
    /// `redis://host:port/db`, `rediss://host:port/db`, `redis+unix:///path`,
    /// `redis+cluster://host:port,host:port,…` or
    /// `redis+sentinel://host:port,host:port,…/master` (read as a
    /// [`sluice_redis::RedisUrl`] by [`RedisLedger::connect`]).
    pub url: String,
    /// Prefix of every key (default `sluice:lane:`).
    pub prefix: String,
    /// How long a lease lives without renewal (default 10 s): a crashed
    /// replica's places come back within it. Renew well inside it.
    pub lease_ttl: Duration,
    /// The longest one call to Redis may take (default 200 ms).
    pub timeout: Duration,
}

impl RedisLedgerConfig {
    /// Defaults for `url`.
    pub fn new(url: impl Into<String>) -> Self {
        RedisLedgerConfig {
            url: url.into(),
            prefix: "sluice:lane:".to_owned(),
            lease_ttl: Duration::from_secs(10),
            timeout: Duration::from_millis(200),
        }
    }
}

/// A lane's leases on Redis. Cheap to clone.
///
/// The lease ledger on Redis, shared by every replica (feature `redis`).
///
/// One script call per operation, on the Redis server's clock: expired leases
/// and starts that left the window are dropped, the limits are checked and
/// the lease recorded, all at once. Keys are
/// `<prefix>{<lane>}:global|batch|ws:<workspace>:run|ws:<workspace>:starts`,
/// hash-tagged by lane so one script touches one slot (so a lane works on a
/// Redis Cluster too, `redis+cluster://h1:p1,h2:p2`, its keys on one node),
/// and every key expires shortly after its last lease or start. The script is
/// loaded once and called by its hash (reloaded on `NOSCRIPT` by the client;
/// on a cluster each node loads it on its first `NOSCRIPT`).
#[derive(Clone)]
pub struct RedisLedger {
    conn: Connection,
    script: redis::Script,
    limits: LaneConfig,
    prefix: String,
    lane: String,
    ttl: Duration,
    ids: Arc<LeaseIds>,
    /// Decides at this clock's time instead of the Redis server's (tests).
    clock: Option<Arc<dyn Clock>>,
}

impl std::fmt::Debug for RedisLedger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisLedger")
            .field("lane", &self.lane)
            .field("prefix", &self.prefix)
            .field("ttl", &self.ttl)
            .finish_non_exhaustive()
    }
}

fn unavailable(e: impl std::fmt::Display) -> LedgerError {
    LedgerError::Unavailable(e.to_string())
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl RedisLedger {
    /// Connects for the lane `lane` enforcing `limits` (its global and batch
    /// caps and start window; each single call brings its workspace's own
    /// limits), and loads the script.
    ///
    /// # Errors
    /// [`LedgerError::Unavailable`] when the URL is malformed or Redis does
    /// not answer within 2 s.
    pub async fn connect(
        config: RedisLedgerConfig,
        lane: &str,
        limits: LaneConfig,
    ) -> Result<Self, LedgerError> {
        Self::connect_inner(config, lane, limits, None).await
    }

    /// [`RedisLedger::connect`], but every operation happens at `clock`'s
    /// time (sent with the script call, to the millisecond) rather than on
    /// the Redis server's clock: for tests that drive the script and the
    /// [`MemoryLedger`](crate::MemoryLedger) on one fake clock. Keys still
    /// expire on the server's clock (a few seconds after the longer of the
    /// lease TTL and the start window), so a test must not let that much
    /// real time pass without touching a lane.
    ///
    /// # Errors
    /// As [`RedisLedger::connect`].
    pub async fn connect_with_clock(
        config: RedisLedgerConfig,
        lane: &str,
        limits: LaneConfig,
        clock: impl Clock + 'static,
    ) -> Result<Self, LedgerError> {
        Self::connect_inner(config, lane, limits, Some(Arc::new(clock))).await
    }

    async fn connect_inner(
        config: RedisLedgerConfig,
        lane: &str,
        limits: LaneConfig,
        clock: Option<Arc<dyn Clock>>,
    ) -> Result<Self, LedgerError> {
        let script = redis::Script::new(SCRIPT);
        let conn = Connection::open(&config.url, config.timeout)
            .await
            .map_err(unavailable)?;
        // A cluster's nodes load the script on their first NOSCRIPT.
        conn.load_script(&script).await.map_err(unavailable)?;
        Ok(RedisLedger {
            conn,
            script,
            limits,
            prefix: config.prefix,
            lane: lane.to_owned(),
            ttl: config.lease_ttl,
            ids: Arc::new(LeaseIds::new()),
            clock,
        })
    }

    fn keys(&self, workspace: &str) -> [String; 4] {
        let base = format!("{}{{{}}}:", self.prefix, self.lane);
        [
            format!("{base}global"),
            format!("{base}batch"),
            format!("{base}ws:{workspace}:run"),
            format!("{base}ws:{workspace}:starts"),
        ]
    }

    /// Runs `op` for `workspace`; `limits` are the workspace's (they decide
    /// only a `take_single`).
    async fn call<T: redis::FromRedisValue>(
        &self,
        op: &str,
        workspace: &str,
        limits: WorkspaceLimits,
        id: &str,
    ) -> Result<T, LedgerError> {
        let mut invocation = self.script.prepare_invoke();
        for key in self.keys(workspace) {
            invocation.key(key);
        }
        invocation
            .arg(op)
            .arg(id)
            .arg(millis(self.ttl))
            .arg(limits.in_flight.get())
            .arg(limits.starts.get())
            .arg(millis(self.limits.start_window))
            .arg(self.limits.global_cap)
            .arg(self.limits.batch_cap());
        if let Some(clock) = &self.clock {
            invocation.arg(clock.now().as_nanos() / 1_000_000);
        }
        self.conn.invoke(&invocation).await.map_err(unavailable)
    }
}

impl Ledger for RedisLedger {
    async fn take(
        &self,
        workspace: &str,
        limits: WorkspaceLimits,
        kind: LeaseKind,
    ) -> Result<Taken, LedgerError> {
        let lease = self.ids.lease(workspace, kind);
        let op = match kind {
            LeaseKind::Single => "take_single",
            LeaseKind::Batch => "take_batch",
        };
        let answer: Vec<redis::Value> = self.call(op, workspace, limits, lease.id()).await?;
        let ok: i64 = answer
            .first()
            .map(redis::from_redis_value_ref)
            .transpose()
            .map_err(unavailable)?
            .ok_or_else(|| unavailable("empty script answer"))?;
        if ok == 1 {
            return Ok(Taken::Leased(lease));
        }
        let reason: String = answer
            .get(1)
            .map(redis::from_redis_value_ref)
            .transpose()
            .map_err(unavailable)?
            .unwrap_or_default();
        let retry_ms: i64 = answer
            .get(2)
            .map(redis::from_redis_value_ref)
            .transpose()
            .map_err(unavailable)?
            .unwrap_or(0);
        let reason = match reason.as_str() {
            "workspace_in_flight_limit" => RefusalReason::WorkspaceInFlightLimit,
            "workspace_rate_limit" => RefusalReason::WorkspaceRateLimit,
            "busy" => RefusalReason::Busy,
            other => return Err(unavailable(format!("unknown refusal {other:?}"))),
        };
        let may_free: i64 = answer
            .get(3)
            .map(redis::from_redis_value_ref)
            .transpose()
            .map_err(unavailable)?
            .unwrap_or(0);
        let retry_after = (reason == RefusalReason::WorkspaceRateLimit)
            .then(|| Duration::from_millis(u64::try_from(retry_ms).unwrap_or(0)));
        Ok(Taken::Refused {
            reason,
            retry_after,
            may_free: may_free == 1,
        })
    }

    async fn renew(&self, lease: &Lease) -> Result<bool, LedgerError> {
        let held: i64 = self
            .call(
                "renew",
                lease.workspace(),
                self.limits.workspace_limits(),
                lease.id(),
            )
            .await?;
        Ok(held > 0)
    }

    async fn release(&self, lease: &Lease) -> Result<(), LedgerError> {
        let _: i64 = self
            .call(
                "release",
                lease.workspace(),
                self.limits.workspace_limits(),
                lease.id(),
            )
            .await?;
        Ok(())
    }

    async fn cancel(&self, lease: &Lease) -> Result<(), LedgerError> {
        let _: i64 = self
            .call(
                "cancel",
                lease.workspace(),
                self.limits.workspace_limits(),
                lease.id(),
            )
            .await?;
        Ok(())
    }

    async fn counts(&self, workspace: &str) -> Result<LedgerCounts, LedgerError> {
        let c: Vec<u32> = self
            .call("counts", workspace, self.limits.workspace_limits(), "")
            .await?;
        let at = |i: usize| c.get(i).copied().unwrap_or(0);
        Ok(LedgerCounts {
            global: at(0),
            batch: at(1),
            workspace_running: at(2),
            workspace_starts: at(3),
        })
    }

    fn ttl(&self) -> Duration {
        self.ttl
    }
}
