//! The batch queue in the embedded durable store: documented on [`BatchBook`].
//!
//! [`BatchBook`] holds the book and its transactions; by job: `schema` (the
//! tables), `codec` (their records, byte by byte), `ops` (submit, claim,
//! finish, status), `fairness` (which workspace goes next), `upkeep` (expired
//! leases, purge).

mod codec;
mod fairness;
mod ops;
mod schema;
mod upkeep;

use std::sync::Arc;

use redb::{ReadableDatabase as _, ReadableTable as _, WriteTransaction};
use sluice_core::Timestamp;
use sluice_store::{DurableStore, OpenError};

use crate::queue::{
    BatchConfig, BatchError, BatchQueue, BatchStatus, Claimed, Finish, ItemResult, ItemState,
    Maintenance, QueueFuture, SubmitError, Submitted, WorkspaceBacklog,
};
use ops::requeue;
use schema::{RUNNING, create_tables};

/// A failure inside a transaction: the storage's, or a record that does not
/// decode.
#[derive(Debug)]
pub(super) enum TxError {
    Storage(redb::Error),
    Corrupt(String),
}

impl<E: Into<redb::Error>> From<E> for TxError {
    fn from(e: E) -> Self {
        TxError::Storage(e.into())
    }
}

/// A write transaction that failed: why, and whether it failed at its commit
/// (it may then have been written) or before (nothing of it was).
pub(super) struct WriteFailed {
    pub(super) error: BatchError,
    pub(super) at_commit: bool,
}

pub(super) fn corrupt(what: &str, id: &str) -> TxError {
    TxError::Corrupt(format!("{what} of batch {id} cannot be read"))
}

/// Batches in the embedded durable store.
///
/// The batch queue in the embedded durable store (see [the crate's docs](crate)).
///
/// Tables in the store's one redb file, every change one write transaction
/// committed with redb's default `Immediate` durability (an `fsync`) before
/// the call returns; a submit writes its whole batch in one. Opening the book
/// puts every item left running by the last process back in its queue: no
/// process of this data directory runs it any more (redb locks the file).
///
/// | table | key | value |
/// | --- | --- | --- |
/// | `batch_meta` | batch id | the batch's record (workspace, counts, times, key, digest) |
/// | `batch_items` | (batch id, index) | the item's record (state, attempt, queue place, times, status) |
/// | `batch_bodies` | (batch id, index) | the item's body, until it finishes |
/// | `batch_results` | (batch id, index) | the item's result |
/// | `batch_queue` | (workspace, place) | (batch id, index) of a queued item |
/// | `batch_running` | (batch id, index) | the claim's lease end |
/// | `batch_workspaces` | workspace | (queued, running, last claim) |
/// | `batch_keys` | (workspace, idempotency key) | batch id |
/// | `batch_finished` | (finish time, batch id) | — |
/// | `batch_origins` | origin (client address) | (unfinished items, stored bytes) |
/// | `batch_stats` | name | `next_place`, `stored_items`, `unfinished_items`, `stored_bytes`, `mean_item_ns` |
///
/// Cheap to clone; every clone is the same book. Open one per
/// [`DurableStore`]. The [`BatchQueue`] methods run their transaction on
/// tokio's blocking pool, so they need a tokio runtime.
///
/// ```
/// use sluice_core::Timestamp;
/// use sluice_batch::{BatchBook, BatchConfig, BatchQueue, Finish, ItemResult, ResultBody};
/// use sluice_store::DurableStore;
///
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
/// # let dir = std::env::temp_dir().join(format!("sluice-batch-doc-{}", std::process::id()));
/// let store = DurableStore::open(&dir).unwrap();
/// let batches = BatchBook::open(&store, BatchConfig::default()).unwrap();
/// let now = Timestamp::from_secs(1_796_040_000);
/// let items = vec![br#"{"draft":"hi"}"#.to_vec()];
/// let batch = batches.submit("acme", items, None, b"digest", now).await.unwrap();
/// let item = batches.claim_next("acme", now).await.unwrap().unwrap();
/// assert_eq!(item.idempotency_key(), format!("{}/0", batch.batch_id));
/// let answer = ItemResult { status: 200, body: ResultBody::Json(b"{}".to_vec()) };
/// let recorded = batches.complete(&item.batch_id, item.index, answer, now).await.unwrap();
/// assert_eq!(recorded, Finish::Recorded);
/// let status = batches.status("acme", &batch.batch_id, now).await.unwrap().unwrap();
/// assert_eq!((status.total, status.done), (1, 1));
/// # drop(batches); drop(store); let _ = std::fs::remove_dir_all(&dir);
/// # });
/// ```
#[derive(Clone)]
pub struct BatchBook {
    inner: Arc<BookInner>,
}

struct BookInner {
    store: DurableStore,
    config: BatchConfig,
}

impl std::fmt::Debug for BatchBook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchBook")
            .field("path", &self.inner.store.path())
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

impl BatchBook {
    /// Opens the batches of `store`, creating their tables when needed, and
    /// puts every item left running (by a process that stopped or crashed)
    /// back at the head of its workspace's queue.
    ///
    /// A full disk does not stop the start (a replica that crashed on a full
    /// disk comes back as it was): the lane answers 503 until there is room,
    /// and the items left running go back to the queue when their claims run
    /// out, at an upkeep ([`BatchQueue::maintain`]) once there is room.
    ///
    /// # Errors
    /// [`OpenError::Unusable`] when the file cannot be written for another
    /// reason than a full disk.
    pub fn open(store: &DurableStore, config: BatchConfig) -> Result<Self, OpenError> {
        let book = BatchBook {
            inner: Arc::new(BookInner {
                store: store.clone(),
                config,
            }),
        };
        let unusable = |e: &dyn std::fmt::Display| OpenError::Unusable {
            path: store.path().to_owned(),
            message: format!("cannot open the batch queue: {e}"),
        };
        let db = book.db().map_err(|e| unusable(&e))?;
        let write = |db: &redb::Database| {
            let tx = db.begin_write()?;
            create_tables(&tx)?;
            requeue_all_running(&tx)?;
            tx.commit()?;
            Ok::<_, TxError>(())
        };
        let mut written = write(&db);
        drop(db);
        // A write that failed before this one (the quota book's snapshot on a
        // full disk, say) leaves the file refusing writes until it is opened
        // anew: open it and try once more, to see this write's own answer.
        let mut full = false;
        if let Err(TxError::Storage(redb::Error::PreviousIo)) = written {
            match store.reopen() {
                Ok(()) => written = write(&*book.db().map_err(|e| unusable(&e))?),
                Err(e) => full = sluice_store::durable::is_storage_full(&e),
            }
        }
        let Err(error) = written else {
            return Ok(book);
        };
        full = full
            || matches!(&error, TxError::Storage(e) if sluice_store::durable::is_storage_full(e));
        let e = book.failed(error);
        if !full {
            return Err(unusable(&e));
        }
        eprintln!(
            "sluice: {}: no room to put the items left running back in the queue; \
             the batch lane answers 503 until there is room, and they go back \
             when their claims run out",
            store.path().display()
        );
        Ok(book)
    }

    /// The bounds it keeps.
    pub fn config(&self) -> BatchConfig {
        self.inner.config
    }

    /// Runs `f` in one write transaction, committed only when `f` returns
    /// `Ok(Ok(_))`; a failed write opens the storage anew for the next one
    /// (redb takes no transaction after one).
    fn write_if<T, E>(
        &self,
        f: impl FnOnce(&WriteTransaction) -> Result<Result<T, E>, TxError>,
    ) -> Result<Result<T, E>, BatchError> {
        self.write_if_told(f).map_err(|failed| failed.error)
    }

    /// [`BatchBook::write_if`], telling a write that failed before its commit
    /// (nothing of it was written) from one whose commit failed: a commit can
    /// fail after it wrote the transaction (its final flush, say), which the
    /// file may then hold once opened anew.
    fn write_if_told<T, E>(
        &self,
        f: impl FnOnce(&WriteTransaction) -> Result<Result<T, E>, TxError>,
    ) -> Result<Result<T, E>, WriteFailed> {
        let db = self.db().map_err(|error| WriteFailed {
            error,
            at_commit: false,
        })?;
        let mut at_commit = false;
        let outcome = (|| {
            let tx = db.begin_write()?;
            let answer = f(&tx)?;
            if answer.is_ok() {
                at_commit = true;
                tx.commit()?;
            } else {
                tx.abort()?;
            }
            Ok::<_, TxError>(answer)
        })();
        drop(db);
        outcome.map_err(|e| WriteFailed {
            error: self.failed(e),
            at_commit,
        })
    }

    /// As [`BatchBook::write_if`] for `f` answering how many things it changed:
    /// committed only when that is more than none, so upkeep that finds nothing
    /// to do writes nothing to the disk.
    fn write_when_changed(
        &self,
        f: impl FnOnce(&WriteTransaction) -> Result<u64, TxError>,
    ) -> Result<u64, BatchError> {
        self.write_if(|tx| f(tx).map(|n| if n > 0 { Ok(n) } else { Err(()) }))
            .map(|changed| changed.unwrap_or(0))
    }

    fn read<T>(
        &self,
        f: impl FnOnce(&redb::ReadTransaction) -> Result<T, TxError>,
    ) -> Result<T, BatchError> {
        let db = self.db()?;
        let outcome = db.begin_read().map_err(TxError::from).and_then(|tx| f(&tx));
        drop(db);
        outcome.map_err(|e| self.failed(e))
    }

    fn db(&self) -> Result<Arc<redb::Database>, BatchError> {
        if let Some(db) = self.inner.store.db() {
            return Ok(db);
        }
        self.inner.store.reopen().map_err(|e| {
            BatchError::Unavailable(format!("the batch store cannot be opened: {e}"))
        })?;
        self.inner
            .store
            .db()
            .ok_or_else(|| BatchError::Unavailable("the batch store is not open".to_owned()))
    }

    /// Turns a transaction's failure into the caller's error, opening the
    /// storage anew after a failed write.
    fn failed(&self, e: TxError) -> BatchError {
        match e {
            TxError::Storage(e) => {
                if matches!(e, redb::Error::Io(_) | redb::Error::PreviousIo) {
                    let _ = self.inner.store.reopen();
                }
                eprintln!(
                    "sluice: batch queue in {}: {e}",
                    self.inner.store.path().display()
                );
                BatchError::Unavailable("the batch store could not be read or written".to_owned())
            }
            TxError::Corrupt(m) => {
                eprintln!(
                    "sluice: batch queue in {}: {m}",
                    self.inner.store.path().display()
                );
                BatchError::Unavailable(m)
            }
        }
    }

    /// Runs `f` on tokio's blocking pool.
    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&BatchBook) -> T + Send + 'static,
    ) -> Result<T, BatchError> {
        let book = self.clone();
        tokio::task::spawn_blocking(move || f(&book))
            .await
            .map_err(|e| BatchError::Unavailable(format!("the batch store's task stopped: {e}")))
    }
}

/// Puts every item left running back at the head of its workspace's queue.
fn requeue_all_running(tx: &WriteTransaction) -> Result<(), TxError> {
    let running: Vec<(String, u32)> = {
        let table = tx.open_table(RUNNING)?;
        let mut all = Vec::new();
        for row in table.iter()? {
            let (k, _) = row?;
            let (id, index) = k.value();
            all.push((id.to_owned(), index));
        }
        all
    };
    for (id, index) in running {
        requeue(tx, &id, index)?;
    }
    Ok(())
}

impl BatchQueue for BatchBook {
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
            let (workspace, origin, key, digest) = (
                workspace.to_owned(),
                origin.to_owned(),
                idempotency_key.map(str::to_owned),
                body_digest.to_vec(),
            );
            self.blocking(move |b| {
                b.submit_blocking(&workspace, &origin, items, key.as_deref(), &digest, now)
            })
            .await?
        })
    }

    fn earlier_batch<'a>(
        &'a self,
        workspace: &'a str,
        idempotency_key: &'a str,
        body_digest: &'a [u8],
    ) -> QueueFuture<'a, Result<Option<Submitted>, BatchError>> {
        Box::pin(async move {
            let (workspace, key, digest) = (
                workspace.to_owned(),
                idempotency_key.to_owned(),
                body_digest.to_vec(),
            );
            self.blocking(move |b| b.earlier_blocking(&workspace, &key, &digest))
                .await?
        })
    }

    fn claim_next<'a>(
        &'a self,
        workspace: &'a str,
        now: Timestamp,
    ) -> QueueFuture<'a, Result<Option<Claimed>, BatchError>> {
        Box::pin(async move {
            let workspace = workspace.to_owned();
            self.blocking(move |b| b.claim_blocking(Some(&workspace), now))
                .await?
        })
    }

    fn claim_fairest<'a>(
        &'a self,
        now: Timestamp,
    ) -> QueueFuture<'a, Result<Option<Claimed>, BatchError>> {
        Box::pin(async move { self.blocking(move |b| b.claim_blocking(None, now)).await? })
    }

    fn renew<'a>(
        &'a self,
        batch_id: &'a str,
        index: u32,
        now: Timestamp,
    ) -> QueueFuture<'a, Result<bool, BatchError>> {
        Box::pin(async move {
            let id = batch_id.to_owned();
            self.blocking(move |b| b.renew_blocking(&id, index, now))
                .await?
        })
    }

    fn renew_all<'a>(
        &'a self,
        claims: &'a [(String, u32)],
        now: Timestamp,
    ) -> QueueFuture<'a, Result<usize, BatchError>> {
        Box::pin(async move {
            if claims.is_empty() {
                return Ok(0);
            }
            let claims = claims.to_vec();
            self.blocking(move |b| b.renew_all_blocking(&claims, now))
                .await?
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
            let id = batch_id.to_owned();
            self.blocking(move |b| b.release_blocking(&id, index, attempts))
                .await?
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
            let id = batch_id.to_owned();
            self.blocking(move |b| b.finish_blocking(&id, index, ItemState::Done, &result, now))
                .await?
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
            let id = batch_id.to_owned();
            self.blocking(move |b| b.finish_blocking(&id, index, ItemState::Failed, &result, now))
                .await?
        })
    }

    fn status<'a>(
        &'a self,
        workspace: &'a str,
        batch_id: &'a str,
        now: Timestamp,
    ) -> QueueFuture<'a, Result<Option<BatchStatus>, BatchError>> {
        Box::pin(async move {
            let (workspace, id) = (workspace.to_owned(), batch_id.to_owned());
            self.blocking(move |b| b.status_blocking(&workspace, &id, now))
                .await?
        })
    }

    fn backlogs<'a>(&'a self) -> QueueFuture<'a, Result<Vec<WorkspaceBacklog>, BatchError>> {
        Box::pin(async move { self.blocking(BatchBook::backlogs_blocking).await? })
    }

    fn maintain<'a>(&'a self, now: Timestamp) -> QueueFuture<'a, Result<Maintenance, BatchError>> {
        Box::pin(async move { self.blocking(move |b| b.maintain_blocking(now)).await? })
    }
}
