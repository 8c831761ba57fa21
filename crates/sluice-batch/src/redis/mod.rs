//! The batch queue in Redis: documented on [`RedisBatches`].

use std::time::Duration;

use redis::Value;
use sluice_core::Timestamp;

use sluice_redis::Connection as Conn;
use sluice_store::RedisConfig;

use crate::queue::{
    BatchConfig, BatchError, BatchQueue, BatchState, BatchStatus, Claimed, Finish, ItemResult,
    ItemState, ItemStatus, Maintenance, Progress, QueueBound, QueueFuture, ResultBody, SubmitError,
    Submitted, WorkspaceBacklog, estimate_finish, new_batch_id,
};

const SCRIPT: &str = include_str!("batch.lua");

/// The longest a batch operation waits for Redis: a submit carries up to
/// [`BatchConfig::max_items`] bodies, a status read as many results.
const BATCH_TIMEOUT: Duration = Duration::from_secs(2);

/// Batches purged per script call.
const PURGE_CHUNK: u64 = 64;

/// How long the id of a submit given up on stays void (see
/// [`RedisBatches::stored`]): far longer than a request sent on a connection can
/// take to reach Redis.
const VOID_FOR: Duration = Duration::from_secs(3600);

/// Most claims one `renew_all` script call renews (its one `ZADD` takes two
/// arguments a claim, well inside Lua's stack).
const RENEW_CHUNK: usize = 1000;

/// The batch queue in Redis. Cheap to clone.
///
/// The batch queue in Redis (see [the crate's docs](crate)), for replicas that share
/// one store: any replica submits, claims and runs items, and answers status
/// reads.
///
/// Every operation is one call of one server-side script (`batch.lua`), so
/// each is atomic across replicas. All keys share one hash tag
/// (`<prefix>batch:{q}:…`), hence one slot on a cluster. Times are the callers'
/// (`now`), kept in milliseconds. A running item's lease is what brings it back
/// when its replica dies: [`BatchQueue::maintain`], called by any replica, puts
/// back the items whose lease ran out.
///
/// A submit whose answer is lost (none within 2 s, or the connection broken
/// after it went out) may have stored its batch: sluice then asks Redis whether
/// the batch exists, and that question makes its id void when it does not (the
/// submit, still on its way, would store nothing), so the answer is final — a
/// batch stored is answered as queued, one not stored never will be. Only when
/// that question goes unanswered too is the submit
/// [`SubmitError::OutcomeUnknown`].
///
/// Durability is Redis's: with `appendonly yes` (and `appendfsync always` for
/// no loss at all, `everysec` for at most a second) a restart of Redis loses no
/// queued item and no result; with persistence off, a Redis restart loses the
/// queue.
#[derive(Clone)]
pub struct RedisBatches {
    conn: Conn,
    script: redis::Script,
    /// `<prefix>batch:{q}:`.
    keys: String,
    config: BatchConfig,
}

impl std::fmt::Debug for RedisBatches {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisBatches")
            .field("keys", &self.keys)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

fn unavailable(e: impl std::fmt::Display) -> BatchError {
    BatchError::Unavailable(e.to_string())
}

/// A script call that failed: why, and whether it may have run (it went out
/// and no answer, or an error, came back) or is known not to have (turned
/// away before it was sent).
struct Failed {
    error: BatchError,
    may_have_run: bool,
}

fn ms(t: Timestamp) -> u64 {
    t.as_nanos() / 1_000_000
}

fn from_ms(ms: i64) -> Timestamp {
    Timestamp::from_nanos(u64::try_from(ms).unwrap_or(0).saturating_mul(1_000_000))
}

fn duration_ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn int(v: Option<&Value>) -> Result<i64, BatchError> {
    match v {
        Some(Value::Int(n)) => Ok(*n),
        Some(Value::BulkString(b)) => std::str::from_utf8(b)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| unavailable("unexpected reply from the batch script")),
        _ => Err(unavailable("unexpected reply from the batch script")),
    }
}

fn bytes(v: Option<&Value>) -> Result<Vec<u8>, BatchError> {
    match v {
        Some(Value::BulkString(b)) => Ok(b.clone()),
        Some(Value::Int(n)) => Ok(n.to_string().into_bytes()),
        Some(Value::Nil) => Ok(Vec::new()),
        _ => Err(unavailable("unexpected reply from the batch script")),
    }
}

fn text(v: Option<&Value>) -> Result<String, BatchError> {
    String::from_utf8(bytes(v)?).map_err(unavailable)
}

fn u32_of(n: i64) -> u32 {
    u32::try_from(n.max(0)).unwrap_or(u32::MAX)
}

fn array(v: Value) -> Result<Vec<Value>, BatchError> {
    match v {
        Value::Array(a) => Ok(a),
        Value::Nil => Ok(Vec::new()),
        _ => Err(unavailable("unexpected reply from the batch script")),
    }
}

/// A result's stored form: `<status>:` then [`ResultBody::encode`].
fn encode_result(result: &ItemResult) -> Vec<u8> {
    let mut out = format!("{}:", result.status).into_bytes();
    out.extend_from_slice(&result.body.encode());
    out
}

fn decode_result(bytes: &[u8]) -> Option<ItemResult> {
    let colon = bytes.iter().position(|&b| b == b':')?;
    let status = std::str::from_utf8(&bytes[..colon]).ok()?.parse().ok()?;
    Some(ItemResult {
        status,
        body: ResultBody::decode(&bytes[colon + 1..]),
    })
}

impl RedisBatches {
    /// Connects to the Redis of `redis` (its URL and key prefix; a batch
    /// operation waits up to 2 s, whatever `redis.timeout` says) for batches
    /// bounded by `config`.
    ///
    /// # Errors
    /// [`BatchError::Unavailable`] when the URL is malformed or Redis does not
    /// answer.
    pub async fn connect(redis: &RedisConfig, config: BatchConfig) -> Result<Self, BatchError> {
        let conn = Conn::open(&redis.url, BATCH_TIMEOUT.max(redis.timeout))
            .await
            .map_err(unavailable)?;
        Ok(RedisBatches {
            conn,
            script: redis::Script::new(SCRIPT),
            keys: format!("{}batch:{{q}}:", redis.prefix),
            config,
        })
    }

    /// The bounds it keeps.
    pub fn config(&self) -> BatchConfig {
        self.config
    }

    /// One script call: `op`, then `args`.
    async fn call(
        &self,
        op: &str,
        args: impl FnOnce(&mut redis::ScriptInvocation<'_>),
    ) -> Result<Value, BatchError> {
        self.try_call(op, args).await.map_err(|f| f.error)
    }

    /// [`RedisBatches::call`], telling a call that may have run from one that
    /// was never sent.
    async fn try_call(
        &self,
        op: &str,
        args: impl FnOnce(&mut redis::ScriptInvocation<'_>),
    ) -> Result<Value, Failed> {
        let mut invocation = self.script.prepare_invoke();
        invocation.key(self.keys.as_str()).arg(op);
        args(&mut invocation);
        let call = sluice_redis::unsent_on_failure(self.conn.invoke::<Value>(&invocation));
        match tokio::time::timeout(BATCH_TIMEOUT, call).await {
            Ok((Ok(reply), _)) => Ok(reply),
            Ok((Err(e), unsent)) => Err(Failed {
                error: unavailable(e),
                may_have_run: !unsent,
            }),
            Err(_) => Err(Failed {
                error: unavailable(format!("redis did not answer within {BATCH_TIMEOUT:?}")),
                may_have_run: true,
            }),
        }
    }

    /// Whether the submit of batch `id` stored it, asked after its answer was
    /// lost. When it did not, the id is void from then on (for [`VOID_FOR`]):
    /// that submit, should it still reach Redis (a request delayed on a
    /// connection that broke, say), stores nothing. Either way the answer is
    /// final: a batch this says was not stored never will be.
    async fn stored(&self, id: &str) -> Result<bool, BatchError> {
        let void_ms = duration_ms(VOID_FOR);
        let reply = self
            .call("settle", |i| {
                i.arg(id).arg(void_ms);
            })
            .await?;
        Ok(int(Some(&reply))? == 1)
    }

    /// The submit of batch `id` (see [`BatchQueue::submit_from`]): one script
    /// call; when its answer is lost, [`RedisBatches::stored`] tells whether
    /// it stored the batch.
    #[allow(clippy::too_many_arguments)]
    async fn submit_as(
        &self,
        id: &str,
        workspace: &str,
        origin: &str,
        items: &[Vec<u8>],
        idempotency_key: Option<&str>,
        body_digest: &[u8],
        now: Timestamp,
    ) -> Result<Submitted, SubmitError> {
        let sent = self
            .try_call("submit", |i| {
                i.arg(workspace)
                    .arg(if idempotency_key.is_some() { "1" } else { "0" })
                    .arg(idempotency_key.unwrap_or(""))
                    .arg(body_digest)
                    .arg(id)
                    .arg(ms(now))
                    .arg(self.config.max_backlog)
                    .arg(self.config.max_stored_items)
                    .arg(items.len())
                    .arg(origin)
                    .arg(self.config.max_queued_items)
                    .arg(self.config.max_stored_bytes)
                    .arg(self.config.origin_share.max(1));
                for item in items {
                    i.arg(item.as_slice());
                }
            })
            .await;
        let reply = match sent {
            Ok(reply) => array(reply)?,
            Err(Failed {
                error,
                may_have_run: false,
            }) => return Err(error.into()),
            // The answer was lost: ask. A batch stored is the submit's to
            // answer for (its calls were counted and it will run); one not
            // stored never will be.
            Err(Failed {
                error,
                may_have_run: true,
            }) => {
                return match self.stored(id).await {
                    Ok(true) => Ok(Submitted {
                        batch_id: id.to_owned(),
                        items: u32::try_from(items.len()).unwrap_or(u32::MAX),
                        created: true,
                    }),
                    Ok(false) => Err(error.into()),
                    Err(asked) => Err(SubmitError::OutcomeUnknown(format!(
                        "{error}; then asking whether it was stored: {asked}"
                    ))),
                };
            }
        };
        let code = int(reply.first())?;
        match code {
            0 | 1 => Ok(Submitted {
                batch_id: text(reply.get(1))?,
                items: u32_of(int(reply.get(2))?),
                created: code == 0,
            }),
            2 => Err(SubmitError::Conflict {
                batch_id: text(reply.get(1))?,
            }),
            3 => Err(SubmitError::Backlog {
                queued: u64::try_from(int(reply.get(1))?).unwrap_or(0),
                limit: self.config.max_backlog,
            }),
            5 => Err(SubmitError::QueueFull {
                bound: QueueBound::from_code(int(reply.get(1))?),
                used: u64::try_from(int(reply.get(2))?).unwrap_or(0),
                limit: u64::try_from(int(reply.get(3))?).unwrap_or(0),
            }),
            6 => Err(SubmitError::Unavailable(
                "the submit reached redis after it was given up on; nothing was stored".to_owned(),
            )),
            _ => Err(SubmitError::Full {
                stored: u64::try_from(int(reply.get(1))?).unwrap_or(0),
                limit: self.config.max_stored_items,
            }),
        }
    }

    async fn claim(&self, workspace: &str, now: Timestamp) -> Result<Option<Claimed>, BatchError> {
        let lease = duration_ms(self.config.lease);
        let reply = array(
            self.call("claim", |i| {
                i.arg(workspace).arg(ms(now)).arg(lease);
            })
            .await?,
        )?;
        if reply.is_empty() {
            return Ok(None);
        }
        Ok(Some(Claimed {
            batch_id: text(reply.first())?,
            index: u32_of(int(reply.get(1))?),
            workspace: text(reply.get(2))?,
            item: bytes(reply.get(3))?,
            attempt: u32_of(int(reply.get(4))?),
            lease_until: from_ms(int(reply.get(5))?),
        }))
    }

    async fn finish(
        &self,
        batch_id: &str,
        index: u32,
        state: ItemState,
        result: &ItemResult,
        now: Timestamp,
    ) -> Result<Finish, BatchError> {
        let encoded = encode_result(result);
        let reply = self
            .call("finish", |i| {
                i.arg(batch_id)
                    .arg(index)
                    .arg(state.code())
                    .arg(encoded.as_slice())
                    .arg(ms(now));
            })
            .await?;
        Ok(match int(Some(&reply))? {
            0 => Finish::Recorded,
            1 => Finish::AlreadyFinished,
            _ => Finish::Unknown,
        })
    }
}

impl BatchQueue for RedisBatches {
    fn submit_from<'a>(
        &'a self,
        workspace: &'a str,
        origin: &'a str,
        items: Vec<Vec<u8>>,
        idempotency_key: Option<&'a str>,
        body_digest: &'a [u8],
        now: Timestamp,
    ) -> QueueFuture<'a, Result<Submitted, SubmitError>> {
        Box::pin(async move {
            if items.is_empty() {
                return Err(SubmitError::Empty);
            }
            if items.len() > self.config.max_items {
                return Err(SubmitError::TooMany {
                    given: items.len(),
                    limit: self.config.max_items,
                });
            }
            let id = new_batch_id()?;
            self.submit_as(
                &id,
                workspace,
                origin,
                &items,
                idempotency_key,
                body_digest,
                now,
            )
            .await
        })
    }

    fn claim_next<'a>(
        &'a self,
        workspace: &'a str,
        now: Timestamp,
    ) -> QueueFuture<'a, Result<Option<Claimed>, BatchError>> {
        Box::pin(async move {
            if workspace.is_empty() {
                // The script reads "" as "the fairest"; no workspace has that name.
                return Ok(None);
            }
            self.claim(workspace, now).await
        })
    }

    fn claim_fairest<'a>(
        &'a self,
        now: Timestamp,
    ) -> QueueFuture<'a, Result<Option<Claimed>, BatchError>> {
        Box::pin(async move { self.claim("", now).await })
    }

    fn renew<'a>(
        &'a self,
        batch_id: &'a str,
        index: u32,
        now: Timestamp,
    ) -> QueueFuture<'a, Result<bool, BatchError>> {
        Box::pin(async move {
            let lease = duration_ms(self.config.lease);
            let reply = self
                .call("renew", |i| {
                    i.arg(batch_id).arg(index).arg(ms(now)).arg(lease);
                })
                .await?;
            Ok(int(Some(&reply))? == 1)
        })
    }

    fn renew_all<'a>(
        &'a self,
        claims: &'a [(String, u32)],
        now: Timestamp,
    ) -> QueueFuture<'a, Result<usize, BatchError>> {
        Box::pin(async move {
            let lease = duration_ms(self.config.lease);
            let mut renewed = 0;
            // One call per RENEW_CHUNK claims: a script's ZADD takes them at once.
            for chunk in claims.chunks(RENEW_CHUNK) {
                let reply = self
                    .call("renew_all", |i| {
                        i.arg(ms(now)).arg(lease);
                        for (batch_id, index) in chunk {
                            i.arg(batch_id.as_str()).arg(*index);
                        }
                    })
                    .await?;
                renewed += usize::try_from(int(Some(&reply))?).unwrap_or(0);
            }
            Ok(renewed)
        })
    }

    fn release<'a>(
        &'a self,
        batch_id: &'a str,
        index: u32,
        attempts: u32,
        _now: Timestamp,
    ) -> QueueFuture<'a, Result<bool, BatchError>> {
        Box::pin(async move {
            let reply = self
                .call("release", |i| {
                    i.arg(batch_id).arg(index).arg(attempts);
                })
                .await?;
            Ok(int(Some(&reply))? == 1)
        })
    }

    fn complete<'a>(
        &'a self,
        batch_id: &'a str,
        index: u32,
        result: ItemResult,
        now: Timestamp,
    ) -> QueueFuture<'a, Result<Finish, BatchError>> {
        Box::pin(async move {
            self.finish(batch_id, index, ItemState::Done, &result, now)
                .await
        })
    }

    fn fail<'a>(
        &'a self,
        batch_id: &'a str,
        index: u32,
        result: ItemResult,
        now: Timestamp,
    ) -> QueueFuture<'a, Result<Finish, BatchError>> {
        Box::pin(async move {
            self.finish(batch_id, index, ItemState::Failed, &result, now)
                .await
        })
    }

    fn earlier_batch<'a>(
        &'a self,
        workspace: &'a str,
        idempotency_key: &'a str,
        body_digest: &'a [u8],
    ) -> QueueFuture<'a, Result<Option<Submitted>, BatchError>> {
        Box::pin(async move {
            let reply = array(
                self.call("earlier", |i| {
                    i.arg(workspace).arg(idempotency_key).arg(body_digest);
                })
                .await?,
            )?;
            if reply.is_empty() {
                return Ok(None);
            }
            let batch_id = String::from_utf8(bytes(reply.first())?)
                .map_err(|_| BatchError::Unavailable("a batch id that is not UTF-8".to_owned()))?;
            Ok(Some(Submitted {
                batch_id,
                items: u32_of(int(reply.get(1))?),
                created: false,
            }))
        })
    }

    fn status<'a>(
        &'a self,
        workspace: &'a str,
        batch_id: &'a str,
        now: Timestamp,
    ) -> QueueFuture<'a, Result<Option<BatchStatus>, BatchError>> {
        Box::pin(async move {
            let reply = array(
                self.call("status", |i| {
                    i.arg(workspace).arg(batch_id);
                })
                .await?,
            )?;
            if reply.is_empty() {
                return Ok(None);
            }
            let n = |k: usize| int(reply.get(k));
            let (total, done, failed, queued, running) = (
                u32_of(n(0)?),
                u32_of(n(1)?),
                u32_of(n(2)?),
                u32_of(n(3)?),
                u32_of(n(4)?),
            );
            let (created, first, finished, mean) = (n(5)?, n(6)?, n(7)?, n(8)?);
            let mut items = Vec::with_capacity(reply.len().saturating_sub(9) / 3);
            for (index, item) in (0u32..).zip(reply.get(9..).unwrap_or_default().chunks_exact(3)) {
                let state = ItemState::from_code(u8::try_from(int(item.first())?).unwrap_or(0));
                let result = if state.is_finished() {
                    decode_result(&bytes(item.get(2))?)
                } else {
                    None
                };
                items.push(ItemStatus {
                    index,
                    state,
                    attempts: u32_of(int(item.get(1))?),
                    result,
                });
            }
            let progress = Progress {
                queued,
                running,
                finished: done + failed,
                first_claim_at: (first > 0).then(|| from_ms(first)),
                finished_at: (finished > 0).then(|| from_ms(finished)),
                mean_item: u64::try_from(mean).ok().map(Duration::from_millis),
            };
            let state = if queued == 0 && running == 0 {
                BatchState::Done
            } else if first == 0 {
                BatchState::Queued
            } else {
                BatchState::Running
            };
            Ok(Some(BatchStatus {
                batch_id: batch_id.to_owned(),
                state,
                total,
                done,
                failed,
                queued,
                running,
                created_at: from_ms(created),
                estimated_finish_at: estimate_finish(now, progress),
                items,
            }))
        })
    }

    fn backlogs<'a>(&'a self) -> QueueFuture<'a, Result<Vec<WorkspaceBacklog>, BatchError>> {
        Box::pin(async move {
            let reply = array(self.call("backlogs", |_| {}).await?)?;
            let mut out = Vec::with_capacity(reply.len() / 3);
            for row in reply.chunks_exact(3) {
                let (queued, running) = (int(row.get(1))?, int(row.get(2))?);
                if queued <= 0 && running <= 0 {
                    continue;
                }
                out.push(WorkspaceBacklog {
                    workspace: text(row.first())?,
                    queued: u64::try_from(queued).unwrap_or(0),
                    running: u64::try_from(running).unwrap_or(0),
                });
            }
            Ok(out)
        })
    }

    fn maintain<'a>(&'a self, now: Timestamp) -> QueueFuture<'a, Result<Maintenance, BatchError>> {
        Box::pin(async move {
            let cutoff = ms(now).saturating_sub(duration_ms(self.config.retention));
            let mut done = Maintenance::default();
            loop {
                let reply = array(
                    self.call("maintain", |i| {
                        i.arg(ms(now)).arg(cutoff).arg(PURGE_CHUNK);
                    })
                    .await?,
                )?;
                let requeued = u64::try_from(int(reply.first())?).unwrap_or(0);
                let purged = u64::try_from(int(reply.get(1))?).unwrap_or(0);
                done.requeued += requeued;
                done.purged += purged;
                if purged < PURGE_CHUNK {
                    return Ok(done);
                }
            }
        })
    }
}

#[cfg(test)]
#[path = "../../../../tests/support/redis_server.rs"]
mod redis_server;

#[cfg(test)]
mod tests {
    use super::*;

    /// After a submit's answer was lost, asking whether it stored its batch is
    /// final: a batch it says was not stored is never stored, even when the
    /// submit reaches Redis after the question (a request delayed on a broken
    /// connection); one it says was stored is there (SPEC L4 with Q1: a
    /// submit's quota is given back only for a batch that will not run).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn l4_q1_redis_a_submit_given_up_on_stores_nothing_when_it_arrives_late() {
        let server = super::redis_server::RedisServer::start("batch-settle");
        let q = RedisBatches::connect(&RedisConfig::new(server.url()), BatchConfig::default())
            .await
            .expect("connect");
        let now = Timestamp::from_secs(1_796_040_000);
        let items = vec![
            br#"{"draft":"one"}"#.to_vec(),
            br#"{"draft":"two"}"#.to_vec(),
        ];

        let late = "bat_00000000000000000000000000000001";
        assert_eq!(q.stored(late).await, Ok(false), "not there when asked");
        let arrived = q
            .submit_as(late, "acme", "", &items, Some("k"), b"d", now)
            .await;
        assert!(
            matches!(arrived, Err(SubmitError::Unavailable(_))),
            "{arrived:?}"
        );
        assert_eq!(q.status("acme", late, now).await, Ok(None));
        assert_eq!(q.backlogs().await, Ok(Vec::new()), "nothing queued");
        let again = q.submit("acme", items.clone(), Some("k"), b"d", now).await;
        assert!(
            matches!(again, Ok(Submitted { created: true, .. })),
            "the key was not taken: {again:?}"
        );

        let on_time = "bat_00000000000000000000000000000002";
        let stored = q
            .submit_as(on_time, "globex", "", &items, None, b"d", now)
            .await
            .expect("submit");
        assert!(stored.created);
        assert_eq!(q.stored(on_time).await, Ok(true));
        let status = q.status("globex", on_time, now).await.expect("status");
        assert_eq!(status.map(|s| s.queued), Some(2));
    }

    #[test]
    fn l4_redis_results_round_trip() {
        for r in [
            ItemResult {
                status: 200,
                body: ResultBody::Json(br#"{"a":"b:c"}"#.to_vec()),
            },
            ItemResult {
                status: 504,
                body: ResultBody::Text("timed out: after 180 s".to_owned()),
            },
        ] {
            assert_eq!(decode_result(&encode_result(&r)), Some(r));
        }
    }
}
