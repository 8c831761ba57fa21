//! The Redis backend: every replica on one Redis admits the configured limit
//! in total (SPEC D1, D2).
//!
//! One decision is one round trip: a server-side script (loaded once, called
//! by its hash, reloaded on `NOSCRIPT`) reads every budget of the request,
//! decides all or nothing on the Redis server's clock, and writes only when
//! all admit. Keys are `<prefix>{<subject>}:<scope>` in hex digests — never a
//! raw credential — hash-tagged by subject so a caller's budgets share a slot,
//! and every key carries a TTL. Concurrent decisions share one multiplexed
//! connection (pipelined); the connection manager reconnects by itself.

use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use sluice_core::{Budget, BudgetStatus, Decision, MAX_BUDGETS, Rate, Timestamp, Verdict};

use crate::{BudgetStore, StoreError};

const SCRIPT: &str = include_str!("budgets.lua");

/// How to reach Redis and how long to wait for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RedisConfig {
    /// `redis://host:port/db`, `rediss://…` or `redis+unix:///path`.
    pub url: String,
    /// The longest one decision may wait for Redis (default 20 ms); past it
    /// the decision fails with [`StoreError::Unavailable`].
    pub timeout: Duration,
    /// Prefix of every key (default `sluice:`).
    pub prefix: String,
}

impl RedisConfig {
    /// Defaults for `url`.
    pub fn new(url: impl Into<String>) -> Self {
        RedisConfig {
            url: url.into(),
            timeout: Duration::from_millis(20),
            prefix: "sluice:".to_owned(),
        }
    }
}

/// The budget store shared by replicas (see the module docs).
#[derive(Clone)]
pub struct RedisStore {
    conn: ConnectionManager,
    script: redis::Script,
    prefix: String,
    timeout: Duration,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.prefix)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

fn unavailable(e: impl std::fmt::Display) -> StoreError {
    StoreError::Unavailable(e.to_string())
}

impl RedisStore {
    /// Connects to `config.url` and loads the decision script.
    ///
    /// # Errors
    /// [`StoreError::Unavailable`] when the URL is malformed or Redis does not
    /// answer within the connection timeout (1 s).
    pub async fn connect(config: RedisConfig) -> Result<Self, StoreError> {
        let client = redis::Client::open(config.url.as_str()).map_err(unavailable)?;
        let manager_config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(1)))
            .set_response_timeout(Some(config.timeout.max(Duration::from_millis(1))))
            .set_number_of_retries(2)
            .set_max_delay(Duration::from_millis(500));
        let conn = tokio::time::timeout(
            Duration::from_secs(2),
            client.get_connection_manager_with_config(manager_config),
        )
        .await
        .map_err(|_| unavailable("timed out connecting to redis"))?
        .map_err(unavailable)?;
        let script = redis::Script::new(SCRIPT);
        let mut c = conn.clone();
        script.load_async(&mut c).await.map_err(unavailable)?;
        Ok(RedisStore {
            conn,
            script,
            prefix: config.prefix,
            timeout: config.timeout,
        })
    }

    /// The Redis key of a budget: `<prefix>{<subject>}:<scope>`.
    pub fn key(&self, budget: &Budget) -> String {
        format!(
            "{}{{{:016x}}}:{:016x}",
            self.prefix,
            budget.key.subject(),
            budget.key.scope()
        )
    }

    async fn run(
        &self,
        mode: &str,
        budgets: &[Budget],
        delta: i64,
        reserved_at: u64,
    ) -> Result<(Timestamp, Vec<Row>), StoreError> {
        if budgets.len() > MAX_BUDGETS {
            return Err(sluice_core::DecisionError::TooManyBudgets {
                given: budgets.len(),
            }
            .into());
        }
        let mut invocation = self.script.prepare_invoke();
        for b in budgets {
            invocation.key(self.key(b));
        }
        invocation.arg(mode).arg(delta).arg(reserved_at);
        for b in budgets {
            let (kind, window, burst): (&str, u64, u32) = match b.rate {
                Rate::FixedWindow { seconds } => ("f", u64::from(seconds.get()), 0),
                Rate::SlidingWindow { seconds } => ("s", u64::from(seconds.get()), 0),
                Rate::CalendarMonth => ("m", 0, 0),
                Rate::Gcra { period, burst } => (
                    "g",
                    u64::try_from(period.as_micros()).unwrap_or(u64::MAX),
                    burst.get(),
                ),
            };
            invocation
                .arg(kind)
                .arg(b.limit)
                .arg(b.cost)
                .arg(window)
                .arg(burst);
        }
        let mut conn = self.conn.clone();
        let reply: Vec<i64> =
            tokio::time::timeout(self.timeout, invocation.invoke_async(&mut conn))
                .await
                .map_err(|_| {
                    unavailable(format!("redis did not answer within {:?}", self.timeout))
                })?
                .map_err(unavailable)?;
        parse_reply(&reply, budgets.len())
    }
}

/// One budget's part of the script's reply.
struct Row {
    verdict: i64,
    after: i64,
    before: i64,
    reset: i64,
    retry_us: i64,
}

fn parse_reply(reply: &[i64], budgets: usize) -> Result<(Timestamp, Vec<Row>), StoreError> {
    if reply.len() != 2 + 5 * budgets {
        return Err(unavailable(format!(
            "unexpected reply from the decision script: {} values for {budgets} budgets",
            reply.len()
        )));
    }
    let secs = u64::try_from(reply[0]).unwrap_or(0);
    let micros = u64::try_from(reply[1]).unwrap_or(0);
    let at = Timestamp::from_nanos(secs * 1_000_000_000 + micros * 1_000);
    let rows = reply[2..]
        .chunks_exact(5)
        .map(|r| Row {
            verdict: r[0],
            after: r[1],
            before: r[2],
            reset: r[3],
            retry_us: r[4],
        })
        .collect();
    Ok((at, rows))
}

fn to_u32(v: i64) -> u32 {
    u32::try_from(v.max(0)).unwrap_or(u32::MAX)
}

fn decision(at: Timestamp, rows: &[Row], budgets: &[Budget], spend: bool) -> Decision {
    let admitted = rows.iter().all(|r| r.verdict == 0);
    Decision::from_statuses(
        at,
        rows.iter().zip(budgets).map(|(r, b)| BudgetStatus {
            verdict: match r.verdict {
                0 => Verdict::Admitted,
                1 => Verdict::NotYet {
                    retry_after: Duration::from_micros(u64::try_from(r.retry_us).unwrap_or(0)),
                },
                _ => Verdict::Never,
            },
            limit: b.limit,
            remaining: to_u32(if admitted && spend { r.after } else { r.before }),
            reset: u64::try_from(r.reset).unwrap_or(0),
        }),
    )
}

impl BudgetStore for RedisStore {
    async fn decide(&self, budgets: &[Budget]) -> Result<Decision, StoreError> {
        let (at, rows) = self.run("spend", budgets, 0, 0).await?;
        Ok(decision(at, &rows, budgets, true))
    }

    async fn peek(&self, budgets: &[Budget]) -> Result<Decision, StoreError> {
        let (at, rows) = self.run("peek", budgets, 0, 0).await?;
        Ok(decision(at, &rows, budgets, false))
    }

    async fn adjust(
        &self,
        budget: &Budget,
        delta: i64,
        reserved_at: Timestamp,
    ) -> Result<BudgetStatus, StoreError> {
        let one = std::slice::from_ref(budget);
        let (at, rows) = self
            .run("adjust", one, delta, reserved_at.as_secs())
            .await?;
        let d = decision(at, &rows, one, true);
        d.statuses()
            .first()
            .copied()
            .ok_or_else(|| unavailable("empty reply from the adjust script"))
    }
}
