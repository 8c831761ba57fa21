//! The batch queue: long lists of calls to an expensive upstream, kept durably
//! until each has run once and its answer is recorded.
//!
//! A batch is a list of items (each an opaque request body, e.g. the JSON body
//! of one upstream call) submitted by one workspace. Its items wait, in order,
//! in the workspace's queue; a runner [claims](BatchQueue::claim_next) the
//! next one, sends it, and records the answer with [`BatchQueue::complete`] or
//! [`BatchQueue::fail`]. Anyone of the same workspace can read the batch's
//! [status](BatchQueue::status) meanwhile.
//!
//! ```
//! # #[cfg(feature = "durable")]
//! # fn main() {
//! use sluice_batch::{BatchBook, BatchConfig, BatchQueue, BatchState, ItemResult, ResultBody};
//! use sluice_core::Timestamp;
//! use sluice_store::DurableStore;
//!
//! # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
//! # let dir = std::env::temp_dir().join(format!("sluice-batch-root-{}", std::process::id()));
//! let store = DurableStore::open(&dir).unwrap();
//! let queue = BatchBook::open(&store, BatchConfig::default()).unwrap();
//! let now = Timestamp::from_secs(1_796_040_000);
//!
//! // acme submits two calls; globex one.
//! let acme = vec![br#"{"draft":"hi"}"#.to_vec(), br#"{"draft":"bye"}"#.to_vec()];
//! let batch = queue.submit("acme", acme, Some("k-1"), b"digest", now).await.unwrap();
//! queue.submit("globex", vec![b"{}".to_vec()], None, b"other", now).await.unwrap();
//!
//! // A runner takes the fairest workspace's next item, sends it, records the answer.
//! let item = queue.claim_fairest(now).await.unwrap().unwrap();
//! assert_eq!(item.idempotency_key(), format!("{}/0", batch.batch_id));
//! let answer = ItemResult { status: 200, body: ResultBody::Json(b"{}".to_vec()) };
//! queue.complete(&item.batch_id, item.index, answer, now).await.unwrap();
//! // The next claim goes to globex: workspaces take turns.
//! assert_eq!(queue.claim_fairest(now).await.unwrap().unwrap().workspace, "globex");
//!
//! let status = queue.status("acme", &batch.batch_id, now).await.unwrap().unwrap();
//! assert_eq!((status.state, status.done, status.queued), (BatchState::Running, 1, 1));
//! // The same submit again is the same batch, not a second one.
//! let again = queue.submit("acme", vec![b"x".to_vec()], Some("k-1"), b"digest", now).await;
//! assert!(!again.unwrap().created);
//! # drop(queue); drop(store); let _ = std::fs::remove_dir_all(&dir);
//! # });
//! # }
//! # #[cfg(not(feature = "durable"))]
//! # fn main() {}
//! ```
//!
//! Two backends implement [`BatchQueue`]: `BatchBook` in the embedded
//! durable store (feature `durable`: sluice-store's `DurableStore`, the redb
//! file that also keeps the monthly quotas) for one process, and
//! `RedisBatches` (feature `redis`) when several replicas share the queue. Both keep every state change durable before the
//! call that made it returns (Redis: as durable as its persistence settings).
//!
//! # An item's life
//! `queued` → (claimed) `running` → `done` or `failed`. A running item holds
//! a lease ([`BatchConfig::lease`]; [`BatchQueue::renew`] extends it). An item
//! whose runner went away — a crash, a replica killed, a lease that ran out —
//! goes back to `queued` (at the head of its workspace's queue) and is
//! claimed again with its `attempt` one higher: the runner sends it with the
//! same [`Claimed::idempotency_key`], so the upstream can tell a repeat. The
//! first answer recorded for an item is its result; a later one is ignored
//! and reported as [`Finish::AlreadyFinished`].
//!
//! # Bounds
//! Items per batch ([`BatchConfig::max_items`], default 1,000), unfinished
//! items per workspace ([`BatchConfig::max_backlog`], default 5,000), items
//! stored in all ([`BatchConfig::max_stored_items`], default 1,000,000, finished
//! ones included until purged), and how long a finished batch is kept
//! ([`BatchConfig::retention`], default 7 days; [`BatchQueue::maintain`] drops
//! older ones).
//!
//! Whatever the workspaces (every unknown credential is one of its own), the
//! whole queue holds at most [`BatchConfig::max_queued_items`] unfinished items
//! (default 100,000) and [`BatchConfig::max_stored_bytes`] bytes of item bodies
//! and results (default 256 MiB); one origin (the client address a submit came
//! from, see [`BatchQueue::submit_from`]) holds at most
//! 1/[`BatchConfig::origin_share`] of each (default 1/8), so one address cannot
//! take the whole queue. Past either a submit is refused with
//! [`SubmitError::QueueFull`], nothing stored. A finished batch's bytes (its
//! results) count until it is purged after its retention: results stay
//! readable for as long as promised, and the bound is what sizes the disk.
//! The counts live with the queue (the redb file, or Redis), so every replica
//! sharing a queue keeps the same bound.
//!
//! Time is a parameter: every operation takes `now`, so the caller's clock (a
//! fake one in tests) decides leases, durations and retention.
//!
//! | feature | adds |
//! | --- | --- |
//! | `durable` | `BatchBook`, the queue in the embedded durable store (redb) |
//! | `redis` | `RedisBatches`, the queue in Redis, shared by every replica |
//! | `lane` (default) | `lane`: the batch lane over a queue, its HTTP endpoints and its runner |
//!
//! Without any, the crate is the queue's types and trait, for a backend of
//! one's own.
//!
//! # The lane
//! The `lane` module (feature `lane`, on by default) is the batch lane a gateway
//! serves: `POST <route>/batch` queues a batch, `GET <route>/batches/{id}` reads it,
//! and a runner sends the queued items upstream on the capacity single calls leave.
//! It takes from its host only a limiter (sluice-edge's `SharedLimiter`, over any
//! budget store) and a `lane::BatchUpstream` the runner sends items through.

mod queue;

#[cfg(feature = "lane")]
pub mod lane;

#[cfg(feature = "durable")]
mod durable;
#[cfg(feature = "redis")]
mod redis;

#[cfg(feature = "durable")]
pub use durable::BatchBook;
pub use queue::{
    BATCH_ID_PREFIX, BatchConfig, BatchError, BatchQueue, BatchState, BatchStatus, Claimed,
    DEFAULT_LEASE, DEFAULT_MAX_BACKLOG, DEFAULT_MAX_BATCH_ITEMS, DEFAULT_MAX_QUEUED_ITEMS,
    DEFAULT_MAX_STORED_BYTES, DEFAULT_MAX_STORED_ITEMS, DEFAULT_ORIGIN_SHARE, DEFAULT_RETENTION,
    Finish, ItemResult, ItemState, ItemStatus, Maintenance, QueueBound, QueueFuture, ResultBody,
    SubmitError, Submitted, WorkspaceBacklog,
};
#[cfg(feature = "redis")]
pub use redis::RedisBatches;
