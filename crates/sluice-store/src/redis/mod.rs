//! Documented on [`RedisStore`].

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use sluice_core::{
    Budget, BudgetKey, BudgetStatus, Clock, Decision, GiveBack, MAX_BUDGETS, Rate, Timestamp,
    Verdict,
};
use sluice_redis::Connection as Conn;
use tokio::sync::{Semaphore, mpsc, oneshot, watch};

use crate::{BudgetStore, StoreError};

const SCRIPT: &str = include_str!("budgets.lua");

/// [`HOLD`], hashed once.
static HOLD_SCRIPT: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(HOLD));

/// [`HELD`], hashed once.
static HELD_SCRIPT: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(HELD));

/// Notes a usage row in its period's set, bounded (see [`crate::UsageRowBound`]):
/// `KEYS[1]` the set, `ARGV` the row, the most rows, the Unix second it goes.
/// 1 when the row is there, 0 when the set is full.
const NOTE_ROW: &str = r"
if redis.call('SISMEMBER', KEYS[1], ARGV[1]) == 1 then return 1 end
if redis.call('SCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
redis.call('SADD', KEYS[1], ARGV[1])
redis.call('EXPIREAT', KEYS[1], ARGV[3])
return 1
";

/// One `SSCAN` page of a period's rows: `KEYS[1]` the set, `ARGV` the cursor and
/// the count hint.
const ROWS_PAGE: &str = r"
return redis.call('SSCAN', KEYS[1], ARGV[1], 'COUNT', ARGV[2])
";

/// Holds a key (see [`crate::holds`]): `KEYS[1]` the hold, `ARGV` its length
/// and the instant to hold from (Unix microseconds; 0: the server's `TIME`).
/// Keeps the later of the end it has and the new one, the key expiring then.
/// The microseconds the key is held from that instant.
const HOLD: &str = r"
local now = tonumber(ARGV[2])
if now == 0 then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local ends = now + tonumber(ARGV[1])
local held = tonumber(redis.call('GET', KEYS[1]))
if held and held >= ends then return held - now end
local px = math.max(1, math.ceil((ends - now) / 1000))
redis.call('SET', KEYS[1], string.format('%d', ends), 'PX', string.format('%d', px))
return ends - now
";

/// What is left of holds: `KEYS` the holds, `ARGV[1]` the instant (Unix
/// microseconds; 0: the server's `TIME`). Per key, the microseconds it is still
/// held (0: not held).
const HELD: &str = r"
local now = tonumber(ARGV[1])
if now == 0 then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local left = {}
for i, key in ipairs(KEYS) do
  local ends = tonumber(redis.call('GET', key))
  if ends and ends > now then left[i] = ends - now else left[i] = 0 end
end
return left
";

/// How to reach Redis and how long to wait for it: [`RedisConfig::new`],
/// then set the fields to change.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RedisConfig {
    /// `redis://host:port/db`, `rediss://host:port/db`, `redis+unix:///path`,
    /// `redis+cluster://host:port,host:port,…` or
    /// `redis+sentinel://host:port,host:port,…/master` (read as a
    /// [`sluice_redis::RedisUrl`] by [`RedisStore::connect`]).
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

/// The most decisions one script call carries when concurrent decisions
/// are coalesced.
pub const MAX_COALESCED: usize = 64;

/// Coalesced script calls one thread's coalescer has on their way at once.
const MAX_CALLS_IN_FLIGHT: usize = 2;

/// How long a coalescer that failed to open its own connection waits before
/// it tries again (meanwhile it decides on the store's shared connection).
const REOPEN_DELAY: Duration = Duration::from_secs(1);

/// Numbers stores, so that a thread finds its coalescer for each.
static NEXT_STORE: AtomicU64 = AtomicU64::new(1);

thread_local! {
    /// This thread's coalescers: the store's number and the coalescer's inbox.
    static COALESCERS: RefCell<Vec<(u64, mpsc::Sender<Job>)>> = const { RefCell::new(Vec::new()) };
}

/// What the handles of one store share to coalesce: the store's number, its
/// URL (each coalescer opens a connection of its own) and a signal that ends
/// every coalescer when the last handle is dropped.
struct Coalescing {
    id: u64,
    url: String,
    alive: watch::Sender<()>,
}

/// What a job asks of the coalescer.
#[derive(Clone, Copy, PartialEq, Eq)]
enum JobMode {
    /// Decide and spend: coalesced with the other spends.
    Spend,
    /// Decide without spending: coalesced with the other peeks.
    Peek,
    /// Charge or give back after the fact (a settlement), as reserved at the
    /// Unix microsecond it carries: coalesced with the other settlements
    /// reserved alike (see [`settlement_group`]).
    Adjusts(u64),
}

/// A decision (or a settlement) waiting for the coalescer.
struct Job {
    mode: JobMode,
    budgets: Vec<Budget>,
    reply: oneshot::Sender<Result<(Timestamp, Vec<Row>), StoreError>>,
}

/// The instant a settlement of `budgets` reserved at `reserved_us` is told to
/// the script with, so that settlements alike share a script call: the script
/// reads a reservation's instant by the second, but a rolling window's by its
/// slot, so a settlement holding one keeps its microsecond.
fn settlement_group(budgets: &[Budget], reserved_us: u64) -> u64 {
    if budgets
        .iter()
        .any(|b| matches!(b.rate, Rate::RollingWindow { .. }))
    {
        reserved_us
    } else {
        reserved_us - reserved_us % 1_000_000
    }
}

/// The budget store shared by replicas.
///
/// The Redis backend: every replica on one Redis admits the configured limit
/// in total.
///
/// One decision is one round trip: a server-side script (loaded once, called
/// by its hash, reloaded on `NOSCRIPT`) reads every budget of the request,
/// decides all or nothing on the Redis server's clock, and writes only when
/// all admit. Keys are `<prefix>{<subject>}:<scope>` in hex digests — never a
/// raw credential — hash-tagged by subject so a caller's budgets share a slot,
/// and every key carries a TTL. A hold ([`BudgetStore::hold`]) is a key of
/// its own beside its subject's budgets, `<prefix>{<subject>}:hold:<scope>`,
/// holding the Unix microsecond it ends at by the server's clock and expiring
/// then; a small script sets it (never earlier than it was) and reads what is
/// left of it, one call each. Concurrent decisions share one multiplexed
/// connection (pipelined); the connection manager reconnects by itself, and a
/// decision turned away by a connection Redis closed while it was idle (a
/// restart) is sent once more on the new one — never one that may have been
/// sent (see [`sluice_redis::Connection::invoke`]) — so the first burst after
/// Redis comes back is decided on Redis, not by the outage rule.
///
/// On a Redis Cluster (`redis+cluster://host:port,host:port,…`) a decision
/// sends one script per subject (one slot each) at once; when any refuses,
/// the others' spends are refunded, so all or nothing still holds: a refusal
/// may briefly hold units it then gives back, never the reverse.
///
/// On one Redis, decisions that arrive while others are on their way are
/// coalesced: one script call decides up to [`MAX_COALESCED`] of them in
/// order, each all or nothing, as if they had come one by one — fewer round
/// trips and far less per-call work for Redis, whose one core is the limit.
/// Each thread that decides has a coalescer of its own on its own runtime,
/// with a connection of its own: a decision, its script call and the reply
/// never leave the thread (a gateway worker's thread-per-core loop stays on
/// its core), and the store's threads never wait on one another's queue.
#[derive(Clone)]
pub struct RedisStore {
    conn: Conn,
    /// `None` on a cluster and in a coalescer's own handle.
    coalescing: Option<Arc<Coalescing>>,
    script: redis::Script,
    prefix: String,
    timeout: Duration,
    /// Decides at this clock's time instead of the Redis server's (tests).
    clock: Option<Arc<dyn Clock>>,
    /// Leftovers of leases not given back yet (SPEC D4): those of calls known
    /// never to have reached Redis, and those held while Redis does not
    /// answer. Given back in a call that takes leases once Redis answers again,
    /// so that an outage returns them on recovery. At most [`MAX_UNSENT_BACKS`].
    unsent: Arc<parking_lot::Mutex<Vec<(Budget, GiveBack)>>>,
    /// Whether the last call answered: while not, leftovers are held rather
    /// than sent in calls that may fail after reaching Redis (which would
    /// leave them neither known given back nor safe to send again).
    answering: Arc<std::sync::atomic::AtomicBool>,
}

/// The most leftovers kept for the call after an outage; past it the oldest
/// are dropped (units unused until their window ends, never over-admitted).
const MAX_UNSENT_BACKS: usize = 4_096;

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.prefix)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

/// The positions of `budgets` by subject: a subject's budgets share a Redis
/// Cluster slot (their keys' hash tag), in the order subjects first appear.
fn by_subject(budgets: &[Budget]) -> Vec<(u64, Vec<usize>)> {
    group_subjects(budgets.iter().map(|b| &b.key))
}

/// The positions of `keys` by subject, in the order subjects first appear.
fn group_subjects<'a>(keys: impl Iterator<Item = &'a BudgetKey>) -> Vec<(u64, Vec<usize>)> {
    let mut groups: Vec<(u64, Vec<usize>)> = Vec::new();
    for (i, k) in keys.enumerate() {
        match groups.iter_mut().find(|(s, _)| *s == k.subject()) {
            Some((_, members)) => members.push(i),
            None => groups.push((k.subject(), vec![i])),
        }
    }
    groups
}

/// The decision over `budgets` the script's `rows` say, and the units each
/// budget granted (its cost, or a lease's more; 0 for all when refused).
fn granted(at: Timestamp, rows: &[Row], budgets: &[Budget]) -> (Decision, Vec<u32>) {
    let d = decision(at, rows, budgets, true);
    let grants = if d.is_admitted() {
        rows.iter()
            .map(|r| to_u32(r.before.saturating_sub(r.after)))
            .collect()
    } else {
        vec![0; budgets.len()]
    };
    (d, grants)
}

fn unavailable(e: impl std::fmt::Display) -> StoreError {
    StoreError::Unavailable(e.to_string())
}

impl RedisStore {
    /// Connects to `config.url` and loads the decision script.
    ///
    /// # Errors
    /// [`StoreError::Unavailable`] when the URL is malformed or Redis does not
    /// answer within the connection timeout ([`sluice_redis::CONNECT_TIMEOUT`], 1 s).
    pub async fn connect(config: RedisConfig) -> Result<Self, StoreError> {
        Self::connect_inner(config, None).await
    }

    /// [`RedisStore::connect`], but every decision is made at `clock`'s time
    /// (sent with the script call, to the microsecond) rather than on the
    /// Redis server's clock: for tests that drive the script and the memory
    /// store with one fake clock. Keys still expire on the server's clock,
    /// so the fake time must not be behind it. It is for tests only (this
    /// crate's and the edge's and the lanes' Redis tests): a deployment
    /// decides on the server's clock.
    ///
    /// # Errors
    /// As [`RedisStore::connect`].
    pub async fn connect_with_clock(
        config: RedisConfig,
        clock: impl Clock + 'static,
    ) -> Result<Self, StoreError> {
        Self::connect_inner(config, Some(Arc::new(clock))).await
    }

    async fn connect_inner(
        config: RedisConfig,
        clock: Option<Arc<dyn Clock>>,
    ) -> Result<Self, StoreError> {
        let script = redis::Script::new(SCRIPT);
        let conn = Conn::open(&config.url, config.timeout)
            .await
            .map_err(unavailable)?;
        // A cluster's nodes load the script on their first NOSCRIPT.
        conn.load_script(&script).await.map_err(unavailable)?;
        let coalescing = (!conn.is_cluster()).then(|| {
            Arc::new(Coalescing {
                id: NEXT_STORE.fetch_add(1, Ordering::Relaxed),
                url: config.url.clone(),
                alive: watch::Sender::new(()),
            })
        });
        Ok(RedisStore {
            conn,
            coalescing,
            script,
            prefix: config.prefix,
            timeout: config.timeout,
            clock,
            unsent: Arc::default(),
            answering: Arc::new(std::sync::atomic::AtomicBool::new(true)),
        })
    }

    /// Up to `room` of the leftovers kept from calls that never reached Redis,
    /// oldest first.
    fn take_unsent(&self, room: usize) -> Vec<(Budget, GiveBack)> {
        let mut unsent = self.unsent.lock();
        let n = unsent.len().min(room);
        unsent.drain(..n).collect()
    }

    /// Keeps `backs`, whose call never reached Redis, for the next call.
    fn keep_unsent(&self, backs: &[(Budget, GiveBack)]) {
        let mut unsent = self.unsent.lock();
        unsent.extend_from_slice(backs);
        let over = unsent.len().saturating_sub(MAX_UNSENT_BACKS);
        unsent.drain(..over);
    }

    /// The Redis key of a budget: `<prefix>{<subject>}:<scope>`.
    pub fn key(&self, budget: &Budget) -> String {
        self.key_of(&budget.key)
    }

    /// The Redis key of the set of usage rows of `period`.
    fn rows_key(&self, period: &str) -> String {
        format!("{}usage-rows:{period}", self.prefix)
    }

    /// The Redis key of a hold (see [`BudgetStore::hold`]):
    /// `<prefix>{<subject>}:hold:<scope>`, in the slot of the subject's budgets
    /// and apart from them.
    pub fn hold_key(&self, key: &BudgetKey) -> String {
        format!(
            "{}{{{:016x}}}:hold:{:016x}",
            self.prefix,
            key.subject(),
            key.scope()
        )
    }

    /// The instant a script is told to act at: the injected clock's (tests),
    /// or 0 for the server's `TIME`.
    fn script_now(&self) -> u64 {
        self.clock.as_ref().map_or(0, |clock| micros(clock.now()))
    }

    /// One call of a small script (a hold's), within the store's timeout.
    async fn call_small<T: redis::FromRedisValue>(
        &self,
        invocation: &redis::ScriptInvocation<'_>,
    ) -> Result<T, StoreError> {
        tokio::time::timeout(self.timeout, self.conn.invoke::<T>(invocation))
            .await
            .map_err(|_| unavailable(format!("redis did not answer within {:?}", self.timeout)))?
            .map_err(unavailable)
    }

    /// What is left of the holds of `keys`, which share one slot (or any, on
    /// one Redis), in one script call.
    async fn held_in_slot(&self, keys: &[BudgetKey]) -> Result<Vec<Duration>, StoreError> {
        let mut invocation = HELD_SCRIPT.prepare_invoke();
        for key in keys {
            invocation.key(self.hold_key(key));
        }
        invocation.arg(self.script_now());
        let left: Vec<i64> = self.call_small(&invocation).await?;
        if left.len() != keys.len() {
            return Err(unavailable(format!(
                "unexpected reply from the holds script: {} values for {} keys",
                left.len(),
                keys.len()
            )));
        }
        Ok(left
            .into_iter()
            .map(|us| Duration::from_micros(u64::try_from(us).unwrap_or(0)))
            .collect())
    }

    fn key_of(&self, key: &BudgetKey) -> String {
        format!(
            "{}{{{:016x}}}:{:016x}",
            self.prefix,
            key.subject(),
            key.scope()
        )
    }

    async fn run(
        &self,
        mode: &str,
        budgets: &[Budget],
        delta: i64,
        reserved_us: u64,
    ) -> Result<(Timestamp, Vec<Row>), StoreError> {
        if budgets.len() > MAX_BUDGETS {
            return Err(sluice_core::DecisionError::TooManyBudgets {
                given: budgets.len(),
            }
            .into());
        }
        if self.conn.is_cluster() {
            return self.run_by_slot(mode, budgets, delta, reserved_us).await;
        }
        let job_mode = match (mode, delta) {
            ("spend", _) => Some(JobMode::Spend),
            ("peek", _) => Some(JobMode::Peek),
            ("adjusts", 0) => Some(JobMode::Adjusts(settlement_group(budgets, reserved_us))),
            _ => None,
        };
        let coalescer = job_mode.and_then(|m| self.local_coalescer().map(|tx| (m, tx)));
        let Some((job_mode, tx)) = coalescer else {
            return self.invoke(mode, budgets, delta, reserved_us).await;
        };
        let (reply, answer) = oneshot::channel();
        let job = Job {
            mode: job_mode,
            budgets: budgets.to_vec(),
            reply,
        };
        match tx.try_send(job) {
            Ok(()) => tokio::time::timeout(self.timeout.saturating_mul(2), answer)
                .await
                .map_err(|_| {
                    unavailable(format!("redis did not answer within {:?}", self.timeout))
                })?
                .map_err(|_| unavailable("the coalescer stopped"))?,
            // Backlog full (or the runtime is going away): go direct.
            Err(_) => self.invoke(mode, budgets, delta, reserved_us).await,
        }
    }

    /// This thread's coalescer for this store, started on the current
    /// runtime at the thread's first decision (and again when the runtime it
    /// ran on is gone). `None` outside a runtime and in a coalescer's own
    /// handle.
    fn local_coalescer(&self) -> Option<mpsc::Sender<Job>> {
        let coalescing = self.coalescing.as_ref()?;
        COALESCERS.with(|local| {
            let mut local = local.borrow_mut();
            if let Some((_, tx)) = local
                .iter()
                .find(|(id, tx)| *id == coalescing.id && !tx.is_closed())
            {
                return Some(tx.clone());
            }
            // Gone with their runtime or their store.
            local.retain(|(_, tx)| !tx.is_closed());
            let runtime = tokio::runtime::Handle::try_current().ok()?;
            let shared = RedisStore {
                coalescing: None,
                ..self.clone()
            };
            let tx = coalesce(
                &runtime,
                shared,
                coalescing.url.clone(),
                coalescing.alive.subscribe(),
            );
            local.push((coalescing.id, tx.clone()));
            Some(tx)
        })
    }

    /// Cluster: one script per subject at once; refunds when any refuses.
    async fn run_by_slot(
        &self,
        mode: &str,
        budgets: &[Budget],
        delta: i64,
        reserved_us: u64,
    ) -> Result<(Timestamp, Vec<Row>), StoreError> {
        let groups = by_subject(budgets);
        let calls = groups.iter().map(|(_, members)| {
            let part: Vec<Budget> = members.iter().map(|&i| budgets[i]).collect();
            async move {
                self.invoke(mode, &part, delta, reserved_us)
                    .await
                    .map(|r| (part, r))
            }
        });
        let answers = futures_util::future::join_all(calls).await;
        let mut rows: Vec<Option<Row>> = (0..budgets.len()).map(|_| None).collect();
        let mut at = None;
        let mut spent_groups = Vec::new();
        let mut failure = None;
        for ((_, members), answer) in groups.iter().zip(answers) {
            match answer {
                Ok((part, (t, group_rows))) => {
                    at = Some(at.map_or(t, |a: Timestamp| a.max(t)));
                    if mode == "spend" && group_rows.iter().all(|r| r.verdict == 0) {
                        spent_groups.push((part, t));
                    }
                    for (&i, r) in members.iter().zip(group_rows) {
                        rows[i] = Some(r);
                    }
                }
                Err(e) => failure = Some(e),
            }
        }
        let refused = failure.is_some() || rows.iter().flatten().any(|r| r.verdict != 0);
        if mode == "spend" && refused {
            // Give back what the admitting slots spent.
            for (part, t) in &spent_groups {
                for b in part.iter().filter(|b| b.cost > 0) {
                    let back = -i64::from(b.cost);
                    let _ = self
                        .invoke("adjust", std::slice::from_ref(b), back, micros(*t))
                        .await;
                }
            }
        }
        if let Some(e) = failure {
            return Err(e);
        }
        let rows = rows.into_iter().flatten().collect::<Vec<_>>();
        Ok((at.unwrap_or_default(), rows))
    }

    /// [`BudgetStore::take_leases`] on a Cluster: one script call per slot
    /// (a subject's budgets share one), at once, each taking its budgets'
    /// leases and the leftovers given back to them; the leftovers of
    /// subjects this request does not name ride on calls of their own. When
    /// any slot refuses or fails, what the admitting slots spent (the leases
    /// they granted, not just the costs) goes back, so the request is all or
    /// nothing as on one Redis.
    async fn take_leases_by_slot(
        &self,
        budgets: &[Budget],
        wants: &[u32],
        backs: &[(Budget, GiveBack)],
    ) -> Result<(Decision, Vec<u32>), StoreError> {
        let groups = by_subject(budgets);
        let (riding, alone): (Vec<_>, Vec<_>) = backs
            .iter()
            .partition(|(b, _)| groups.iter().any(|(s, _)| *s == b.key.subject()));
        let calls = groups.iter().map(|(subject, members)| {
            let part: Vec<Budget> = members.iter().map(|&i| budgets[i]).collect();
            let part_wants: Vec<u32> = members
                .iter()
                .map(|&i| wants.get(i).copied().unwrap_or(0))
                .collect();
            let part_backs: Vec<(Budget, GiveBack)> = riding
                .iter()
                .filter(|(b, _)| b.key.subject() == *subject)
                .copied()
                .collect();
            async move {
                self.invoke_many("spend", &[&part], 0, 0, &part_wants, &part_backs)
                    .await
                    .map(|(t, mut answers)| (part, t, answers.pop().unwrap_or_default()))
            }
        });
        // The other subjects' leftovers, a call per subject (kept for the next
        // call when it never reached Redis, lost when it may have: units
        // unused, never over-admitted).
        let alone_budgets: Vec<Budget> = alone.iter().map(|(b, _)| *b).collect();
        let alone_groups: Vec<Vec<(Budget, GiveBack)>> = by_subject(&alone_budgets)
            .into_iter()
            .map(|(_, members)| members.iter().map(|&i| alone[i]).collect())
            .collect();
        let given_back = alone_groups
            .iter()
            .map(|group| self.invoke_many("spend", &[], 0, 0, &[], group));
        let (answers, _) = futures_util::future::join(
            futures_util::future::join_all(calls),
            futures_util::future::join_all(given_back),
        )
        .await;
        let mut rows: Vec<Option<Row>> = (0..budgets.len()).map(|_| None).collect();
        let mut at = None;
        let mut spent = Vec::new();
        let mut failure = None;
        for ((_, members), answer) in groups.iter().zip(answers) {
            match answer {
                Ok((part, t, group_rows)) => {
                    at = Some(at.map_or(t, |a: Timestamp| a.max(t)));
                    if group_rows.iter().all(|r| r.verdict == 0) {
                        for (b, r) in part.iter().zip(&group_rows) {
                            spent.push((*b, r.before.saturating_sub(r.after), t));
                        }
                    }
                    for (&i, r) in members.iter().zip(group_rows) {
                        rows[i] = Some(r);
                    }
                }
                Err(e) => failure = Some(e),
            }
        }
        let refused = failure.is_some() || rows.iter().flatten().any(|r| r.verdict != 0);
        if refused {
            for (b, units, t) in spent.iter().filter(|(_, units, _)| *units > 0) {
                let back = -*units;
                let _ = self
                    .invoke("adjust", std::slice::from_ref(b), back, micros(*t))
                    .await;
            }
        }
        if let Some(e) = failure {
            return Err(e);
        }
        let rows: Vec<Row> = rows.into_iter().flatten().collect();
        Ok(granted(at.unwrap_or_default(), &rows, budgets))
    }

    /// One script call over budgets that share a slot (or any, on one Redis).
    async fn invoke(
        &self,
        mode: &str,
        budgets: &[Budget],
        delta: i64,
        reserved_us: u64,
    ) -> Result<(Timestamp, Vec<Row>), StoreError> {
        let (at, mut answers) = self
            .invoke_many(mode, &[budgets], delta, reserved_us, &[], &[])
            .await?;
        Ok((at, answers.pop().unwrap_or_default()))
    }

    /// One script call deciding several requests in order, each all or nothing.
    /// `wants` (SPEC D4) are the units the first request's budgets may take past
    /// their costs, by position: a fixed-window budget whose want is above its
    /// cost is sent as a lease (`l`), taking up to it. `backs` (SPEC D4, in
    /// `spend` only) are leftovers of ended leases, given back (`b`) in an
    /// entry of their own before the requests; their rows are not returned.
    async fn invoke_many(
        &self,
        mode: &str,
        requests: &[&[Budget]],
        delta: i64,
        reserved_us: u64,
        wants: &[u32],
        backs: &[(Budget, GiveBack)],
    ) -> Result<(Timestamp, Vec<Vec<Row>>), StoreError> {
        let mut packed = Packed::new(requests);
        // Each leftover's key, added to the call's keys where a request does
        // not name it already.
        let back_keys: Vec<usize> = backs
            .iter()
            .map(
                |(b, _)| match packed.keys.iter().position(|k| *k == b.key) {
                    Some(i) => i,
                    None => {
                        packed.keys.push(b.key);
                        packed.keys.len() - 1
                    }
                },
            )
            .collect();
        let mut packed_wants = vec![0u32; packed.budgets.len()];
        if let Some((_, first)) = packed.entries.first() {
            for (&index, &want) in first.iter().zip(wants) {
                if let Some(w) = packed_wants.get_mut(index) {
                    *w = want;
                }
            }
        }
        let mut invocation = self.script.prepare_invoke();
        for key in &packed.keys {
            invocation.key(self.key_of(key));
        }
        invocation
            .arg(mode)
            .arg(delta)
            .arg(reserved_us)
            .arg(self.clock.as_ref().map_or(0, |clock| micros(clock.now())))
            .arg(packed.budgets.len() + backs.len());
        for ((key, b), &want) in packed.budgets.iter().zip(&packed_wants) {
            let (kind, window, burst): (&str, u64, u64) = match b.rate {
                Rate::FixedWindow { seconds } if want > b.cost => {
                    ("l", u64::from(seconds.get()), u64::from(want))
                }
                Rate::FixedWindow { seconds } | Rate::Until { end: seconds } => {
                    ("f", u64::from(seconds.get()), 0)
                }
                Rate::SlidingWindow { seconds } => ("s", u64::from(seconds.get()), 0),
                Rate::CalendarMonth => ("m", 0, 0),
                Rate::RollingWindow {
                    millis,
                    slot_millis,
                } => ("r", u64::from(millis.get()), u64::from(slot_millis.get())),
                Rate::Turns { idle_secs } => ("u", u64::from(idle_secs.get()), 0),
                Rate::Gcra { period, burst } => (
                    "g",
                    u64::try_from(period.as_micros()).unwrap_or(u64::MAX),
                    u64::from(burst.get()),
                ),
            };
            invocation
                .arg(key + 1)
                .arg(kind)
                .arg(b.limit)
                .arg(b.cost)
                .arg(window)
                .arg(burst);
        }
        // A leftover: its units as the cost, the second its lease was taken in
        // as the burst (the script gives back only to that second's window).
        for ((b, back), key) in backs.iter().zip(&back_keys) {
            let window = match b.rate {
                Rate::FixedWindow { seconds } => u64::from(seconds.get()),
                _ => 0,
            };
            invocation
                .arg(key + 1)
                .arg("b")
                .arg(b.limit)
                .arg(back.units)
                .arg(window)
                .arg(back.reserved_at.as_secs());
        }
        let backs_entry = usize::from(!backs.is_empty());
        invocation.arg(packed.entries.len() + backs_entry);
        if !backs.is_empty() {
            invocation.arg(1).arg(backs.len());
            for i in 0..backs.len() {
                invocation.arg(packed.budgets.len() + i + 1);
            }
        }
        for (times, budgets) in &packed.entries {
            invocation.arg(*times).arg(budgets.len());
            for i in budgets {
                invocation.arg(i + 1);
            }
        }
        let (reply, unsent) = tokio::time::timeout(
            self.timeout,
            sluice_redis::unsent_on_failure(self.conn.invoke::<Vec<i64>>(&invocation)),
        )
        .await
        .map_err(|_| {
            self.answering.store(false, Ordering::Relaxed);
            unavailable(format!("redis did not answer within {:?}", self.timeout))
        })?;
        self.answering.store(reply.is_ok(), Ordering::Relaxed);
        if unsent && !backs.is_empty() {
            // Never reached Redis: the leftovers go in a later call.
            self.keep_unsent(backs);
        }
        let reply = reply.map_err(unavailable)?;
        let total: usize = requests.iter().map(|r| r.len()).sum();
        let (at, mut rows) = parse_reply(&reply, total + backs.len())?;
        rows.drain(..backs.len());
        let mut answers = Vec::with_capacity(requests.len());
        for request in requests.iter().rev() {
            let tail = rows.split_off(rows.len() - request.len());
            answers.push(tail);
        }
        answers.reverse();
        Ok((at, answers))
    }
}

/// Starts a coalescer on `runtime`: it drains whatever decisions are
/// waiting, up to [`MAX_COALESCED`], and decides them in one script call per
/// mode, several calls in flight at once. It decides on a connection of its
/// own, opened on `runtime` (so that the connection's driver runs there too);
/// until that connection is open, or while it cannot be, on `shared`'s. It
/// ends when `alive`'s sender (the store's last handle) is dropped or its
/// runtime shuts down.
fn coalesce(
    runtime: &tokio::runtime::Handle,
    shared: RedisStore,
    url: String,
    mut alive: watch::Receiver<()>,
) -> mpsc::Sender<Job> {
    let (tx, mut rx) = mpsc::channel::<Job>(4 * 1024);
    // While this many calls are on their way, new decisions wait in the
    // channel, and the next call takes all of them.
    let in_flight = Arc::new(Semaphore::new(MAX_CALLS_IN_FLIGHT));
    runtime.spawn(async move {
        let mut own: Option<RedisStore> = None;
        let mut opening: Option<oneshot::Receiver<Option<Conn>>> = None;
        let mut next_open = tokio::time::Instant::now();
        loop {
            let Ok(permit) = Arc::clone(&in_flight).acquire_owned().await else {
                return;
            };
            let first = tokio::select! {
                job = rx.recv() => match job {
                    Some(job) => job,
                    None => return,
                },
                // Never sent to: resolves when the last store handle is gone.
                _ = alive.changed() => return,
            };
            let mut jobs = vec![first];
            while jobs.len() < MAX_COALESCED {
                match rx.try_recv() {
                    Ok(job) => jobs.push(job),
                    Err(_) => break,
                }
            }
            if own.is_none() {
                if let Some(pending) = opening.as_mut() {
                    match pending.try_recv() {
                        Ok(Some(conn)) => {
                            own = Some(RedisStore {
                                conn,
                                ..shared.clone()
                            });
                            opening = None;
                        }
                        Ok(None) | Err(oneshot::error::TryRecvError::Closed) => opening = None,
                        Err(oneshot::error::TryRecvError::Empty) => {}
                    }
                }
                if own.is_none() && opening.is_none() && tokio::time::Instant::now() >= next_open {
                    next_open = tokio::time::Instant::now() + REOPEN_DELAY;
                    let (done, pending) = oneshot::channel();
                    let (url, timeout) = (url.clone(), shared.timeout);
                    tokio::spawn(async move {
                        let _ = done.send(Conn::open(&url, timeout).await.ok());
                    });
                    opening = Some(pending);
                }
            }
            let store = own.clone().unwrap_or_else(|| shared.clone());
            // One script call per mode (and per settlements' instant), in order.
            let mut groups: Vec<(JobMode, Vec<Job>)> = Vec::new();
            for job in jobs {
                match groups.iter_mut().find(|(mode, _)| *mode == job.mode) {
                    Some((_, group)) => group.push(job),
                    None => groups.push((job.mode, vec![job])),
                }
            }
            tokio::spawn(async move {
                let _permit = permit;
                for (mode, group) in groups {
                    let (mode, reserved_us) = match mode {
                        JobMode::Spend => ("spend", 0),
                        JobMode::Peek => ("peek", 0),
                        JobMode::Adjusts(reserved_us) => ("adjusts", reserved_us),
                    };
                    let requests: Vec<&[Budget]> =
                        group.iter().map(|j| j.budgets.as_slice()).collect();
                    match store
                        .invoke_many(mode, &requests, 0, reserved_us, &[], &[])
                        .await
                    {
                        Ok((at, answers)) => {
                            for (job, rows) in group.into_iter().zip(answers) {
                                let _ = job.reply.send(Ok((at, rows)));
                            }
                        }
                        Err(e) => {
                            let message = e.to_string();
                            for job in group {
                                let _ = job
                                    .reply
                                    .send(Err(StoreError::Unavailable(message.clone())));
                            }
                        }
                    }
                }
            });
        }
    });
    tx
}

/// Requests as one script call sends them: each key once, each distinct
/// budget once (with its key's index), and identical requests in a row as
/// one entry with a count — so a batch of one hot caller's requests costs
/// Redis a few arguments, not a dozen per request.
struct Packed {
    keys: Vec<BudgetKey>,
    /// (index in `keys`, budget).
    budgets: Vec<(usize, Budget)>,
    /// (identical requests in a row, indices in `budgets`).
    entries: Vec<(u32, Vec<usize>)>,
}

impl Packed {
    fn new(requests: &[&[Budget]]) -> Self {
        let mut packed = Packed {
            keys: Vec::new(),
            budgets: Vec::new(),
            entries: Vec::with_capacity(requests.len()),
        };
        let mut key_index: HashMap<BudgetKey, usize> = HashMap::new();
        let mut budget_index: HashMap<Budget, usize> = HashMap::new();
        let mut previous: Option<&[Budget]> = None;
        for &request in requests {
            if previous == Some(request)
                && let Some((times, _)) = packed.entries.last_mut()
            {
                *times += 1;
                continue;
            }
            previous = Some(request);
            let indices = request
                .iter()
                .map(|b| {
                    let key = *key_index.entry(b.key).or_insert_with(|| {
                        packed.keys.push(b.key);
                        packed.keys.len() - 1
                    });
                    *budget_index.entry(*b).or_insert_with(|| {
                        packed.budgets.push((key, *b));
                        packed.budgets.len() - 1
                    })
                })
                .collect();
            packed.entries.push((1, indices));
        }
        packed
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

/// The offset of a delta carried in a budget's cost (`adjusts` mode).
const DELTA_OFFSET: i64 = 1 << 31;

/// Unix microseconds: the script's unit of time.
fn micros(t: Timestamp) -> u64 {
    t.as_nanos() / 1_000
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

    fn leases(&self) -> bool {
        true
    }

    async fn take_leases(
        &self,
        budgets: &[Budget],
        wants: &[u32],
        backs: &[(Budget, GiveBack)],
    ) -> Result<(Decision, Vec<u32>), StoreError> {
        let leasing = budgets
            .iter()
            .zip(wants)
            .any(|(b, &w)| w > b.cost && matches!(b.rate, Rate::FixedWindow { .. }));
        // While Redis does not answer, leftovers are held; once it answers
        // again, those held go first.
        let merged: Vec<(Budget, GiveBack)>;
        let mut backs = backs;
        if self.answering.load(Ordering::Relaxed) {
            let kept = self.take_unsent(MAX_BUDGETS.saturating_sub(backs.len()));
            if !kept.is_empty() {
                merged = kept.into_iter().chain(backs.iter().copied()).collect();
                backs = &merged;
            }
        } else {
            self.keep_unsent(backs);
            backs = &[];
        }
        let backs_fit = backs.len() <= MAX_BUDGETS
            && backs
                .iter()
                .all(|(b, _)| matches!(b.rate, Rate::FixedWindow { .. }));
        if !backs_fit {
            // Leftovers the script does not take in the call (of another rate,
            // or too many): given back one by one first.
            for (b, back) in backs {
                self.adjust(b, -i64::from(back.units), back.reserved_at)
                    .await?;
            }
            backs = &[];
        }
        if budgets.len() <= MAX_BUDGETS && self.conn.is_cluster() {
            return self.take_leases_by_slot(budgets, wants, backs).await;
        }
        if (!leasing && backs.is_empty()) || budgets.len() > MAX_BUDGETS {
            // Nothing to lease: decided exactly, each grant its cost.
            let decision = self.decide(budgets).await?;
            let grants = budgets
                .iter()
                .map(|b| if decision.is_admitted() { b.cost } else { 0 })
                .collect();
            return Ok((decision, grants));
        }
        let (at, mut answers) = self
            .invoke_many("spend", &[budgets], 0, 0, wants, backs)
            .await?;
        let rows = answers.pop().unwrap_or_default();
        Ok(granted(at, &rows, budgets))
    }

    fn keep_give_backs(&self, backs: &[(Budget, GiveBack)]) {
        self.keep_unsent(backs);
    }

    fn holds_give_backs(&self) -> bool {
        !self.unsent.lock().is_empty()
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
        let (at, rows) = self.run("adjust", one, delta, micros(reserved_at)).await?;
        let d = decision(at, &rows, one, true);
        d.statuses()
            .first()
            .copied()
            .ok_or_else(|| unavailable("empty reply from the adjust script"))
    }

    async fn note_usage_row(
        &self,
        period: &str,
        row: &str,
        bound: crate::UsageRowBound,
    ) -> Result<bool, StoreError> {
        let script = redis::Script::new(NOTE_ROW);
        let mut invocation = script.prepare_invoke();
        invocation
            .key(self.rows_key(period))
            .arg(row)
            .arg(bound.max_rows)
            .arg(bound.kept_until);
        let noted: i64 = self.conn.invoke(&invocation).await.map_err(unavailable)?;
        Ok(noted == 1)
    }

    /// Pages are `SSCAN` pages: one may hold a few more rows than `count` (a small
    /// set comes whole), and a row may come twice when the set grew meanwhile.
    async fn usage_rows(
        &self,
        period: &str,
        after: Option<&str>,
        count: usize,
    ) -> Result<crate::UsageRowsPage, StoreError> {
        let script = redis::Script::new(ROWS_PAGE);
        let mut invocation = script.prepare_invoke();
        invocation
            .key(self.rows_key(period))
            .arg(after.unwrap_or("0"))
            .arg(count.clamp(1, crate::MAX_ROWS_PAGE));
        let (cursor, rows): (String, Vec<String>) =
            self.conn.invoke(&invocation).await.map_err(unavailable)?;
        Ok(crate::UsageRowsPage {
            rows,
            next: (cursor != "0").then_some(cursor),
        })
    }

    /// One script call on the key's slot, at the server's clock (the
    /// injected one for a store built with [`RedisStore::connect_with_clock`]).
    async fn hold(&self, key: &BudgetKey, for_: Duration) -> Result<(), StoreError> {
        let mut invocation = HOLD_SCRIPT.prepare_invoke();
        invocation
            .key(self.hold_key(key))
            .arg(u64::try_from(for_.min(crate::MAX_HOLD).as_micros()).unwrap_or(u64::MAX))
            .arg(self.script_now());
        let _: i64 = self.call_small(&invocation).await?;
        Ok(())
    }

    /// One script call on one Redis; on a Cluster, one per subject (a slot
    /// each), at once.
    async fn held(&self, keys: &[BudgetKey]) -> Result<Vec<Duration>, StoreError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        if !self.conn.is_cluster() {
            return self.held_in_slot(keys).await;
        }
        let groups = group_subjects(keys.iter());
        let calls = groups.iter().map(|(_, members)| {
            let part: Vec<BudgetKey> = members.iter().map(|&i| keys[i]).collect();
            async move { self.held_in_slot(&part).await }
        });
        let answers = futures_util::future::join_all(calls).await;
        let mut left = vec![Duration::ZERO; keys.len()];
        for ((_, members), answer) in groups.iter().zip(answers) {
            for (&i, d) in members.iter().zip(answer?) {
                left[i] = d;
            }
        }
        Ok(left)
    }

    async fn adjust_all_from(
        &self,
        changes: &[(Budget, i64)],
        reserved_at: Timestamp,
        _network: u64,
    ) -> Result<Vec<BudgetStatus>, StoreError> {
        // Each change's delta rides in its budget's cost, offset by 2^31 (the
        // script's `adjusts` mode reads it back).
        let mut statuses = Vec::with_capacity(changes.len());
        for part in changes.chunks(MAX_BUDGETS) {
            let budgets: Vec<Budget> = part
                .iter()
                .map(|(b, delta)| Budget {
                    cost: u32::try_from(
                        (*delta).clamp(-DELTA_OFFSET, DELTA_OFFSET - 1) + DELTA_OFFSET,
                    )
                    .unwrap_or(0),
                    ..*b
                })
                .collect();
            let (at, rows) = self
                .run("adjusts", &budgets, 0, micros(reserved_at))
                .await?;
            let d = decision(at, &rows, &budgets, true);
            statuses.extend(
                d.statuses()
                    .iter()
                    .zip(part)
                    .map(|(s, (b, _))| BudgetStatus {
                        limit: b.limit,
                        ..*s
                    }),
            );
        }
        Ok(statuses)
    }
}
