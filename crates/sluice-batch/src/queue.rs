//! The queue's types and its trait, [`BatchQueue`]: what every backend
//! stores, answers and refuses (see the crate's docs).

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use sluice_core::Timestamp;

/// Default for [`BatchConfig::max_items`].
pub const DEFAULT_MAX_BATCH_ITEMS: usize = 1_000;
/// Default for [`BatchConfig::max_backlog`].
pub const DEFAULT_MAX_BACKLOG: u64 = 5_000;
/// Default for [`BatchConfig::max_stored_items`].
pub const DEFAULT_MAX_STORED_ITEMS: u64 = 1_000_000;
/// Default for [`BatchConfig::max_queued_items`].
pub const DEFAULT_MAX_QUEUED_ITEMS: u64 = 100_000;
/// Default for [`BatchConfig::max_stored_bytes`]: 256 MiB.
pub const DEFAULT_MAX_STORED_BYTES: u64 = 256 * 1024 * 1024;
/// Default for [`BatchConfig::origin_share`]: one origin holds at most 1/8 of
/// each bound.
pub const DEFAULT_ORIGIN_SHARE: u32 = 8;
/// Default for [`BatchConfig::retention`]: 7 days.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);
/// Default for [`BatchConfig::lease`]: 10 minutes.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(600);

/// What the methods of [`BatchQueue`] return: a boxed future, sendable, that
/// may borrow the queue and the arguments for `'a`.
pub type QueueFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

// A gateway holds `Arc<dyn BatchQueue>`: the trait must stay dyn-compatible.
const _: Option<&dyn BatchQueue> = None;

/// The prefix of every batch id.
pub const BATCH_ID_PREFIX: &str = "bat_";

/// How a batch queue is bounded: [`BatchConfig::default`] and its `with_*`
/// methods.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct BatchConfig {
    /// The most items one batch may hold (default 1,000).
    pub max_items: usize,
    /// The most unfinished (queued or running) items one workspace may have,
    /// the new batch included (default 5,000).
    pub max_backlog: u64,
    /// The most items stored in all, finished ones included until they are
    /// purged (default 1,000,000).
    pub max_stored_items: u64,
    /// The most unfinished (queued or running) items of all workspaces
    /// together (default 100,000).
    pub max_queued_items: u64,
    /// The most bytes of item bodies and results stored in all, finished
    /// batches included until purged (default 256 MiB).
    pub max_stored_bytes: u64,
    /// One origin may hold at most 1/`origin_share` of
    /// [`BatchConfig::max_queued_items`] and of
    /// [`BatchConfig::max_stored_bytes`] (default 8; 1: no share of its own).
    pub origin_share: u32,
    /// How long a finished batch is kept after its last item finished
    /// (default 7 days).
    pub retention: Duration,
    /// How long a claim holds an item before it may go back to the queue
    /// (default 10 minutes): longer than the upstream's timeout, or renewed.
    pub lease: Duration,
}

impl Default for BatchConfig {
    fn default() -> Self {
        BatchConfig {
            max_items: DEFAULT_MAX_BATCH_ITEMS,
            max_backlog: DEFAULT_MAX_BACKLOG,
            max_stored_items: DEFAULT_MAX_STORED_ITEMS,
            max_queued_items: DEFAULT_MAX_QUEUED_ITEMS,
            max_stored_bytes: DEFAULT_MAX_STORED_BYTES,
            origin_share: DEFAULT_ORIGIN_SHARE,
            retention: DEFAULT_RETENTION,
            lease: DEFAULT_LEASE,
        }
    }
}

impl BatchConfig {
    /// The same bounds with at most `max_items` items in one batch.
    #[must_use]
    pub const fn with_max_items(mut self, max_items: usize) -> Self {
        self.max_items = max_items;
        self
    }

    /// The same bounds with at most `max_backlog` unfinished items per workspace.
    #[must_use]
    pub const fn with_max_backlog(mut self, max_backlog: u64) -> Self {
        self.max_backlog = max_backlog;
        self
    }

    /// The same bounds with at most `max_stored_items` items stored in all.
    #[must_use]
    pub const fn with_max_stored_items(mut self, max_stored_items: u64) -> Self {
        self.max_stored_items = max_stored_items;
        self
    }

    /// The same bounds with at most `max_queued_items` unfinished items in all.
    #[must_use]
    pub const fn with_max_queued_items(mut self, max_queued_items: u64) -> Self {
        self.max_queued_items = max_queued_items;
        self
    }

    /// The same bounds with at most `max_stored_bytes` bytes stored in all.
    #[must_use]
    pub const fn with_max_stored_bytes(mut self, max_stored_bytes: u64) -> Self {
        self.max_stored_bytes = max_stored_bytes;
        self
    }

    /// The same bounds with one origin holding at most 1/`share` of each
    /// (0 is taken as 1).
    #[must_use]
    pub const fn with_origin_share(mut self, share: u32) -> Self {
        self.origin_share = if share == 0 { 1 } else { share };
        self
    }

    /// One origin's part of the queued-items bound.
    pub fn origin_queued_items(&self) -> u64 {
        self.max_queued_items / u64::from(self.origin_share.max(1))
    }

    /// One origin's part of the stored-bytes bound.
    pub fn origin_stored_bytes(&self) -> u64 {
        self.max_stored_bytes / u64::from(self.origin_share.max(1))
    }

    /// Which bound, if any, a submit of `items` items and `bytes` bytes passes,
    /// given what the queue holds (`queued`, `stored`) and what its origin
    /// holds (`origin`: `None` when the submit names none).
    pub fn queue_bound(
        &self,
        items: u64,
        bytes: u64,
        queued: u64,
        stored: u64,
        origin: Option<(u64, u64)>,
    ) -> Option<(QueueBound, u64, u64)> {
        if queued.saturating_add(items) > self.max_queued_items {
            return Some((QueueBound::QueuedItems, queued, self.max_queued_items));
        }
        if stored.saturating_add(bytes) > self.max_stored_bytes {
            return Some((QueueBound::StoredBytes, stored, self.max_stored_bytes));
        }
        let (o_items, o_bytes) = origin?;
        if o_items.saturating_add(items) > self.origin_queued_items() {
            return Some((
                QueueBound::OriginQueuedItems,
                o_items,
                self.origin_queued_items(),
            ));
        }
        if o_bytes.saturating_add(bytes) > self.origin_stored_bytes() {
            return Some((
                QueueBound::OriginStoredBytes,
                o_bytes,
                self.origin_stored_bytes(),
            ));
        }
        None
    }

    /// The same bounds keeping a finished batch for `retention`.
    #[must_use]
    pub const fn with_retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// The same bounds with claims holding an item for `lease`.
    #[must_use]
    pub const fn with_lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }
}

/// What [`BatchQueue::submit`] accepted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Submitted {
    /// The batch's id: [`BATCH_ID_PREFIX`] and 128 random bits in hex.
    pub batch_id: String,
    /// How many items it holds.
    pub items: u32,
    /// False when an earlier submit with the same idempotency key and body
    /// made this batch.
    pub created: bool,
}

/// Which of the queue's global bounds a submit would pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum QueueBound {
    /// [`BatchConfig::max_queued_items`].
    QueuedItems,
    /// [`BatchConfig::max_stored_bytes`].
    StoredBytes,
    /// The origin's part of [`BatchConfig::max_queued_items`].
    OriginQueuedItems,
    /// The origin's part of [`BatchConfig::max_stored_bytes`].
    OriginStoredBytes,
}

impl QueueBound {
    /// `queued_items`, `stored_bytes`, `address_queued_items` or
    /// `address_stored_bytes`.
    pub fn as_str(self) -> &'static str {
        match self {
            QueueBound::QueuedItems => "queued_items",
            QueueBound::StoredBytes => "stored_bytes",
            QueueBound::OriginQueuedItems => "address_queued_items",
            QueueBound::OriginStoredBytes => "address_stored_bytes",
        }
    }

    /// The bound the Redis script names by number (0 to 3, in this order).
    #[cfg(feature = "redis")]
    pub(crate) fn from_code(code: i64) -> Self {
        match code {
            0 => QueueBound::QueuedItems,
            1 => QueueBound::StoredBytes,
            2 => QueueBound::OriginQueuedItems,
            _ => QueueBound::OriginStoredBytes,
        }
    }
}

/// Why a batch was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SubmitError {
    /// A batch needs at least one item.
    #[error("a batch needs at least one item")]
    Empty,
    /// More items than one batch may hold.
    #[error("a batch holds at most {limit} items, this one has {given}")]
    TooMany {
        /// Items given.
        given: usize,
        /// [`BatchConfig::max_items`].
        limit: usize,
    },
    /// The idempotency key was used before for a different body.
    #[error("idempotency key already used for a different batch ({batch_id})")]
    Conflict {
        /// The batch the key names.
        batch_id: String,
    },
    /// The workspace would have more unfinished items than it may.
    #[error("{queued} batch items already waiting; at most {limit} may wait per workspace")]
    Backlog {
        /// Unfinished items the workspace has now (before this batch).
        queued: u64,
        /// [`BatchConfig::max_backlog`].
        limit: u64,
    },
    /// The store holds as many items as it may.
    #[error("the batch store holds {stored} items, its maximum is {limit}")]
    Full {
        /// Items stored now.
        stored: u64,
        /// [`BatchConfig::max_stored_items`].
        limit: u64,
    },
    /// The whole queue, or the origin's part of it, would pass a bound.
    #[error("the batch queue is full ({}: {used} of {limit})", bound.as_str())]
    QueueFull {
        /// Which bound.
        bound: QueueBound,
        /// What it holds now (items, or bytes).
        used: u64,
        /// The bound.
        limit: u64,
    },
    /// The backend could not be reached or could not write: nothing was
    /// stored.
    #[error("batch store unavailable: {0}")]
    Unavailable(String),
    /// The backend was asked and its answer was lost (none came in time, or
    /// the connection broke after the request went out), and asking it
    /// afterwards whether the batch was stored failed too: the batch may be
    /// queued, and then it runs. A caller must take it as possibly queued
    /// (its calls stay counted); a submit again with the same idempotency key
    /// answers with the batch if it was.
    #[error("the batch store's answer was lost; the batch may have been queued: {0}")]
    OutcomeUnknown(String),
}

/// Why a batch operation other than a submit failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BatchError {
    /// The backend could not be reached or could not write.
    #[error("batch store unavailable: {0}")]
    Unavailable(String),
}

impl From<BatchError> for SubmitError {
    fn from(e: BatchError) -> Self {
        match e {
            BatchError::Unavailable(m) => SubmitError::Unavailable(m),
        }
    }
}

/// An item handed to a runner.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Claimed {
    /// Its batch.
    pub batch_id: String,
    /// The workspace that submitted it.
    pub workspace: String,
    /// Its place in the batch, from 0.
    pub index: u32,
    /// The body as submitted.
    pub item: Vec<u8>,
    /// Which attempt this claim is: 1 the first time; one more after each
    /// claim that ended by a crash or an expired lease; after a
    /// [release](BatchQueue::release), one more than the attempts it said
    /// were spent.
    pub attempt: u32,
    /// Until when the claim holds unless renewed.
    pub lease_until: Timestamp,
}

impl Claimed {
    /// `<batch_id>/<index>`: the same on every attempt, for the upstream's
    /// `Idempotency-Key`.
    pub fn idempotency_key(&self) -> String {
        format!("{}/{}", self.batch_id, self.index)
    }
}

/// The recorded answer for an item.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ItemResult {
    /// The upstream's status code (or one the runner chose when there was no
    /// answer, e.g. 504 for a timeout).
    pub status: u16,
    /// The answer's body.
    pub body: ResultBody,
}

/// An answer's body, as it should be shown.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ResultBody {
    /// A JSON document (the caller checked it parses), as its text.
    Json(Vec<u8>),
    /// Anything else, as text.
    Text(String),
}

impl ResultBody {
    /// `body` as [`ResultBody::Json`] when `is_json` (the caller checked it
    /// parses), else as lossy UTF-8 text.
    pub fn new(body: Vec<u8>, is_json: bool) -> Self {
        if is_json {
            ResultBody::Json(body)
        } else {
            ResultBody::Text(String::from_utf8_lossy(&body).into_owned())
        }
    }

    #[cfg(any(feature = "durable", feature = "redis"))]
    pub(crate) fn encode(&self) -> Vec<u8> {
        let (tag, bytes) = match self {
            ResultBody::Json(b) => (b'j', b.as_slice()),
            ResultBody::Text(t) => (b't', t.as_bytes()),
        };
        let mut out = Vec::with_capacity(bytes.len() + 1);
        out.push(tag);
        out.extend_from_slice(bytes);
        out
    }

    #[cfg(any(feature = "durable", feature = "redis"))]
    pub(crate) fn decode(bytes: &[u8]) -> Self {
        match bytes.split_first() {
            Some((b'j', rest)) => ResultBody::Json(rest.to_vec()),
            Some((_, rest)) => ResultBody::Text(String::from_utf8_lossy(rest).into_owned()),
            None => ResultBody::Text(String::new()),
        }
    }
}

/// What recording an answer did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// The answer is the item's result.
    Recorded,
    /// The item already had a result; this one was ignored.
    AlreadyFinished,
    /// No such item (never submitted, or purged).
    Unknown,
}

/// Where an item stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ItemState {
    /// Waiting to be claimed.
    Queued,
    /// Claimed by a runner.
    Running,
    /// Answered, recorded with [`BatchQueue::complete`].
    Done,
    /// Recorded with [`BatchQueue::fail`].
    Failed,
}

impl ItemState {
    /// `queued`, `running`, `done` or `failed`.
    pub fn as_str(self) -> &'static str {
        match self {
            ItemState::Queued => "queued",
            ItemState::Running => "running",
            ItemState::Done => "done",
            ItemState::Failed => "failed",
        }
    }

    #[cfg(any(feature = "durable", feature = "redis"))]
    pub(crate) fn code(self) -> u8 {
        match self {
            ItemState::Queued => 0,
            ItemState::Running => 1,
            ItemState::Done => 2,
            ItemState::Failed => 3,
        }
    }

    #[cfg(any(feature = "durable", feature = "redis"))]
    pub(crate) fn from_code(code: u8) -> Self {
        match code {
            0 => ItemState::Queued,
            1 => ItemState::Running,
            2 => ItemState::Done,
            _ => ItemState::Failed,
        }
    }

    /// True for `done` and `failed`.
    pub fn is_finished(self) -> bool {
        matches!(self, ItemState::Done | ItemState::Failed)
    }
}

/// Where a batch stands as a whole.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BatchState {
    /// No item has been claimed yet.
    Queued,
    /// Some item has been claimed and some item is unfinished.
    Running,
    /// Every item is finished (done or failed).
    Done,
}

impl BatchState {
    /// `queued`, `running` or `done`.
    pub fn as_str(self) -> &'static str {
        match self {
            BatchState::Queued => "queued",
            BatchState::Running => "running",
            BatchState::Done => "done",
        }
    }
}

/// One item in a [`BatchStatus`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ItemStatus {
    /// Its place in the batch, from 0.
    pub index: u32,
    /// Where it stands.
    pub state: ItemState,
    /// Its attempts, the one running included (see [`Claimed::attempt`]).
    pub attempts: u32,
    /// Its result, once finished.
    pub result: Option<ItemResult>,
}

/// A batch's progress, as its workspace may read it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BatchStatus {
    /// The batch's id.
    pub batch_id: String,
    /// Where it stands as a whole.
    pub state: BatchState,
    /// Items in all.
    pub total: u32,
    /// Items recorded with [`BatchQueue::complete`].
    pub done: u32,
    /// Items recorded with [`BatchQueue::fail`].
    pub failed: u32,
    /// Items waiting.
    pub queued: u32,
    /// Items claimed and not finished.
    pub running: u32,
    /// When it was submitted.
    pub created_at: Timestamp,
    /// When its last item finished (a finished batch), or when it should,
    /// from the pace its items have finished at so far or, before any has,
    /// from recent items' durations; `None` while nothing is known.
    pub estimated_finish_at: Option<Timestamp>,
    /// Every item, by index.
    pub items: Vec<ItemStatus>,
}

/// A workspace with unfinished batch items, for choosing whose item runs next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkspaceBacklog {
    /// The workspace.
    pub workspace: String,
    /// Its items waiting.
    pub queued: u64,
    /// Its items claimed and not finished.
    pub running: u64,
}

/// What [`BatchQueue::maintain`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Maintenance {
    /// Running items whose lease ran out, put back in the queue.
    pub requeued: u64,
    /// Finished batches dropped after their retention.
    pub purged: u64,
}

/// A durable batch queue (see [the crate's docs](crate)).
///
/// Every method is async: the embedded backend runs its transaction (one
/// `fsync`) on tokio's blocking pool, the Redis backend sends one script call.
/// A method returns once its change is durable.
///
/// The methods return a boxed future ([`QueueFuture`]) so that the trait is
/// dyn-compatible: a gateway that picks its backend at start holds an
/// `Arc<dyn BatchQueue>`. One allocation per operation is nothing next to
/// the `fsync` or the round trip each one costs.
pub trait BatchQueue: Send + Sync {
    /// Stores a new batch of `items` for `workspace`, all queued.
    ///
    /// With an `idempotency_key`, a second submit of the same workspace, key
    /// and `body_digest` (a digest of the request body as the caller defines
    /// it; compared for equality only) returns the first batch with
    /// `created: false`, whatever the backlog is now; the same key with a
    /// different digest is a [`SubmitError::Conflict`]. A key is remembered as
    /// long as its batch is kept.
    ///
    /// # Errors
    /// [`SubmitError::Empty`], [`SubmitError::TooMany`] (checked first),
    /// [`SubmitError::Conflict`], [`SubmitError::Backlog`] when the
    /// workspace's unfinished items would exceed [`BatchConfig::max_backlog`],
    /// [`SubmitError::Full`], [`SubmitError::Unavailable`] (nothing stored).
    /// A submit whose answer from the backend was lost asks the backend
    /// whether the batch was stored, and answers as if the answer had come:
    /// only when that cannot be told either is it
    /// [`SubmitError::OutcomeUnknown`] (the batch may be queued).
    fn submit<'a>(
        &'a self,
        workspace: &'a str,
        items: Vec<Vec<u8>>,
        idempotency_key: Option<&'a str>,
        body_digest: &'a [u8],
        now: Timestamp,
    ) -> QueueFuture<'a, Result<Submitted, SubmitError>> {
        self.submit_from(workspace, "", items, idempotency_key, body_digest, now)
    }

    /// [`BatchQueue::submit`] from `origin` (the client address, as the caller
    /// names it; `""`: none), which may hold at most
    /// 1/[`BatchConfig::origin_share`] of the queue's global bounds.
    ///
    /// # Errors
    /// As [`BatchQueue::submit`], and [`SubmitError::QueueFull`] when the
    /// queue, or `origin`'s part of it, would pass
    /// [`BatchConfig::max_queued_items`] or [`BatchConfig::max_stored_bytes`]
    /// (checked after the idempotency key: a repeat is never refused as full).
    fn submit_from<'a>(
        &'a self,
        workspace: &'a str,
        origin: &'a str,
        items: Vec<Vec<u8>>,
        idempotency_key: Option<&'a str>,
        body_digest: &'a [u8],
        now: Timestamp,
    ) -> QueueFuture<'a, Result<Submitted, SubmitError>>;

    /// The batch an earlier submit of `workspace` made with `idempotency_key` and
    /// a body of `body_digest` (as [`BatchQueue::submit`] compares them), with
    /// `created: false`; `None` when the key made no batch that is kept, or made
    /// one of another body. It reads only: a caller that may not submit (its
    /// quota spent by that very batch) can still be told its repeat's answer.
    /// A queue that keeps no keys answers `None` (the default).
    ///
    /// # Errors
    /// [`BatchError::Unavailable`].
    fn earlier_batch<'a>(
        &'a self,
        workspace: &'a str,
        idempotency_key: &'a str,
        body_digest: &'a [u8],
    ) -> QueueFuture<'a, Result<Option<Submitted>, BatchError>> {
        let _ = (workspace, idempotency_key, body_digest);
        Box::pin(std::future::ready(Ok(None)))
    }

    /// Claims the next queued item of `workspace` (the oldest, or one that
    /// went back to the queue), marking it running with a lease until
    /// `now` + [`BatchConfig::lease`]; `None` when it has none queued.
    ///
    /// # Errors
    /// [`BatchError::Unavailable`].
    fn claim_next<'a>(
        &'a self,
        workspace: &'a str,
        now: Timestamp,
    ) -> QueueFuture<'a, Result<Option<Claimed>, BatchError>>;

    /// Claims the next queued item of the workspace with the fewest items
    /// running (ties: the one whose last claim is oldest, so workspaces take
    /// turns); `None` when nothing is queued.
    ///
    /// # Errors
    /// [`BatchError::Unavailable`].
    fn claim_fairest<'a>(
        &'a self,
        now: Timestamp,
    ) -> QueueFuture<'a, Result<Option<Claimed>, BatchError>>;

    /// Extends a running item's lease to `now` + [`BatchConfig::lease`];
    /// false when the item is not running (finished, or put back).
    ///
    /// # Errors
    /// [`BatchError::Unavailable`].
    fn renew<'a>(
        &'a self,
        batch_id: &'a str,
        index: u32,
        now: Timestamp,
    ) -> QueueFuture<'a, Result<bool, BatchError>>;

    /// [`BatchQueue::renew`] for every one of `claims` (batch id, item index)
    /// in one call to the store: a runner renews all it runs at once, so its
    /// cost does not grow with the items running. An item no longer running
    /// is left alone. Returns how many claims now end later than before.
    ///
    /// # Errors
    /// [`BatchError::Unavailable`].
    fn renew_all<'a>(
        &'a self,
        claims: &'a [(String, u32)],
        now: Timestamp,
    ) -> QueueFuture<'a, Result<usize, BatchError>> {
        Box::pin(async move {
            let mut renewed = 0;
            for (batch_id, index) in claims {
                renewed += usize::from(self.renew(batch_id, *index, now).await?);
            }
            Ok(renewed)
        })
    }

    /// Puts a running item back at the head of its workspace's queue without
    /// a result (e.g. it could not be sent, or it is to wait out an upstream
    /// outage), with `attempts` as the attempts it has spent: its next
    /// claim's [`Claimed::attempt`] is `attempts + 1` (a claim that sent
    /// nothing that counts gives back its claim's `attempt - 1`). False when
    /// it was not running.
    ///
    /// # Errors
    /// [`BatchError::Unavailable`].
    fn release<'a>(
        &'a self,
        batch_id: &'a str,
        index: u32,
        attempts: u32,
        now: Timestamp,
    ) -> QueueFuture<'a, Result<bool, BatchError>>;

    /// Records `result` as the item's answer, state `done` — unless it has one
    /// already. An item still queued (its claim expired) is finished too.
    ///
    /// # Errors
    /// [`BatchError::Unavailable`].
    fn complete<'a>(
        &'a self,
        batch_id: &'a str,
        index: u32,
        result: ItemResult,
        now: Timestamp,
    ) -> QueueFuture<'a, Result<Finish, BatchError>>;

    /// As [`BatchQueue::complete`], state `failed` (e.g. the upstream failed,
    /// or gave no answer).
    ///
    /// # Errors
    /// [`BatchError::Unavailable`].
    fn fail<'a>(
        &'a self,
        batch_id: &'a str,
        index: u32,
        result: ItemResult,
        now: Timestamp,
    ) -> QueueFuture<'a, Result<Finish, BatchError>>;

    /// The batch's progress and results as of `now`; `None` when there is no
    /// such batch or it belongs to another workspace.
    ///
    /// # Errors
    /// [`BatchError::Unavailable`].
    fn status<'a>(
        &'a self,
        workspace: &'a str,
        batch_id: &'a str,
        now: Timestamp,
    ) -> QueueFuture<'a, Result<Option<BatchStatus>, BatchError>>;

    /// The workspaces with unfinished items, with their counts.
    ///
    /// # Errors
    /// [`BatchError::Unavailable`].
    fn backlogs<'a>(&'a self) -> QueueFuture<'a, Result<Vec<WorkspaceBacklog>, BatchError>>;

    /// Puts back running items whose lease ran out before `now`, and drops
    /// batches finished more than [`BatchConfig::retention`] before `now` (their
    /// idempotency keys with them). The runner calls it from time to time.
    ///
    /// # Errors
    /// [`BatchError::Unavailable`].
    fn maintain<'a>(&'a self, now: Timestamp) -> QueueFuture<'a, Result<Maintenance, BatchError>>;
}

#[cfg(any(feature = "durable", feature = "redis"))]
/// A new batch id: [`BATCH_ID_PREFIX`] and 128 bits from the operating
/// system's random source, in hex.
pub(crate) fn new_batch_id() -> Result<String, BatchError> {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes)
        .map_err(|e| BatchError::Unavailable(format!("no random source for a batch id: {e}")))?;
    let mut id = String::with_capacity(BATCH_ID_PREFIX.len() + 32);
    id.push_str(BATCH_ID_PREFIX);
    for b in bytes {
        use std::fmt::Write as _;
        let _ = write!(id, "{b:02x}");
    }
    Ok(id)
}

#[cfg(any(feature = "durable", feature = "redis"))]
/// The counts behind an estimate.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Progress {
    pub(crate) queued: u32,
    pub(crate) running: u32,
    /// Items finished (done or failed) after a claim.
    pub(crate) finished: u32,
    /// The batch's first claim.
    pub(crate) first_claim_at: Option<Timestamp>,
    /// The batch's last item finished then.
    pub(crate) finished_at: Option<Timestamp>,
    /// Recent items' mean duration, across batches.
    pub(crate) mean_item: Option<Duration>,
}

#[cfg(any(feature = "durable", feature = "redis"))]
/// When a batch should finish: its finish time when finished; else from the
/// pace of this batch (time since its first claim per finished item) for the
/// items left; else from recent items' mean duration, the running items'
/// number at a time; else unknown.
pub(crate) fn estimate_finish(now: Timestamp, p: Progress) -> Option<Timestamp> {
    let left = u64::from(p.queued) + u64::from(p.running);
    if left == 0 {
        return p.finished_at.or(Some(now));
    }
    if let (Some(first), true) = (p.first_claim_at, p.finished > 0) {
        let per_item = now.saturating_since(first) / p.finished;
        let left = u32::try_from(left).unwrap_or(u32::MAX);
        return Some(now.saturating_add(per_item.saturating_mul(left)));
    }
    let mean = p.mean_item?;
    let parallel = u64::from(p.running.max(1));
    let rounds = u32::try_from(left.div_ceil(parallel)).unwrap_or(u32::MAX);
    Some(now.saturating_add(mean.saturating_mul(rounds)))
}

/// The next mean item duration after one of `took` (a moving average that
/// weighs the last item 1/8; the Redis script computes the same).
#[cfg(feature = "durable")]
pub(crate) fn next_mean(mean: Option<Duration>, took: Duration) -> Duration {
    match mean {
        None => took,
        Some(m) => (m * 7 + took) / 8,
    }
}

#[cfg(all(test, any(feature = "durable", feature = "redis")))]
mod tests {
    use super::*;

    #[test]
    fn l4_batch_ids_are_prefixed_random_hex() {
        let a = new_batch_id().expect("id");
        let b = new_batch_id().expect("id");
        assert_ne!(a, b);
        assert_eq!(a.len(), 4 + 32);
        assert!(a.starts_with("bat_"));
        assert!(a[4..].bytes().all(|c| c.is_ascii_hexdigit()));
    }

    #[test]
    fn l4_estimate_from_the_batch_pace_then_the_mean() {
        let t = Timestamp::from_secs(1_000);
        let nothing = Progress {
            queued: 10,
            ..Progress::default()
        };
        assert_eq!(estimate_finish(t, nothing), None);
        let mean = Progress {
            queued: 8,
            running: 2,
            mean_item: Some(Duration::from_secs(60)),
            ..Progress::default()
        };
        // 10 left, 2 at a time: 5 rounds of a minute.
        assert_eq!(estimate_finish(t, mean), Some(Timestamp::from_secs(1_300)));
        let paced = Progress {
            queued: 5,
            running: 1,
            finished: 4,
            first_claim_at: Some(Timestamp::from_secs(800)),
            mean_item: Some(Duration::from_secs(600)),
            ..Progress::default()
        };
        // 200 s for 4 items: 50 s each, 6 left.
        assert_eq!(estimate_finish(t, paced), Some(Timestamp::from_secs(1_300)));
        let finished = Progress {
            finished: 3,
            finished_at: Some(Timestamp::from_secs(900)),
            ..Progress::default()
        };
        assert_eq!(
            estimate_finish(t, finished),
            Some(Timestamp::from_secs(900))
        );
    }

    #[test]
    fn l4_result_bodies_round_trip() {
        for body in [
            ResultBody::Json(br#"{"a":1}"#.to_vec()),
            ResultBody::Text("upstream timed out".to_owned()),
            ResultBody::Text(String::new()),
        ] {
            assert_eq!(ResultBody::decode(&body.encode()), body);
        }
    }
}
