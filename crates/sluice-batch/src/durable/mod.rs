//! The batch queue in the embedded durable store: documented on [`BatchBook`].

use std::sync::Arc;
use std::time::Duration;

use redb::{ReadableDatabase as _, ReadableTable as _, TableDefinition, WriteTransaction};
use sluice_core::Timestamp;

use sluice_store::{DurableStore, OpenError};

use crate::queue::{
    BatchConfig, BatchError, BatchQueue, BatchState, BatchStatus, Claimed, Finish, ItemResult,
    ItemState, ItemStatus, Maintenance, Progress, ResultBody, SubmitError, Submitted,
    WorkspaceBacklog, estimate_finish, new_batch_id, next_mean,
};

type ItemKey<'a> = (&'a str, u32);

const META: TableDefinition<'_, &str, &[u8]> = TableDefinition::new("batch_meta");
const ITEMS: TableDefinition<'_, ItemKey<'_>, &[u8]> = TableDefinition::new("batch_items");
const BODIES: TableDefinition<'_, ItemKey<'_>, &[u8]> = TableDefinition::new("batch_bodies");
const RESULTS: TableDefinition<'_, ItemKey<'_>, &[u8]> = TableDefinition::new("batch_results");
const QUEUE: TableDefinition<'_, (&str, u64), ItemKey<'_>> = TableDefinition::new("batch_queue");
const RUNNING: TableDefinition<'_, ItemKey<'_>, u64> = TableDefinition::new("batch_running");
const WORKSPACES: TableDefinition<'_, &str, (u64, u64, u64)> =
    TableDefinition::new("batch_workspaces");
const KEYS: TableDefinition<'_, (&str, &str), &str> = TableDefinition::new("batch_keys");
const FINISHED: TableDefinition<'_, (u64, &str), ()> = TableDefinition::new("batch_finished");
const STATS: TableDefinition<'_, &str, u64> = TableDefinition::new("batch_stats");
/// Per origin: (unfinished items, stored bytes).
const ORIGINS: TableDefinition<'_, &str, (u64, u64)> = TableDefinition::new("batch_origins");

/// Batches dropped per transaction by a purge.
const PURGE_CHUNK: usize = 64;

fn create_tables(tx: &WriteTransaction) -> Result<(), redb::TableError> {
    tx.open_table(META).map(drop)?;
    tx.open_table(ITEMS).map(drop)?;
    tx.open_table(BODIES).map(drop)?;
    tx.open_table(RESULTS).map(drop)?;
    tx.open_table(QUEUE).map(drop)?;
    tx.open_table(RUNNING).map(drop)?;
    tx.open_table(WORKSPACES).map(drop)?;
    tx.open_table(KEYS).map(drop)?;
    tx.open_table(FINISHED).map(drop)?;
    tx.open_table(ORIGINS).map(drop)?;
    tx.open_table(STATS).map(drop)
}

/// A batch's record.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct BatchRecord {
    workspace: String,
    key: Option<String>,
    digest: Vec<u8>,
    total: u32,
    done: u32,
    failed: u32,
    queued: u32,
    running: u32,
    created_at: u64,
    /// 0: none yet.
    first_claim_at: u64,
    /// 0: not finished.
    finished_at: u64,
    /// The origin it came from (`""`: none, or a record of version 1).
    origin: String,
    /// Bytes of its bodies and results stored now.
    bytes: u64,
}

/// Version 2 added the origin and the bytes; a version 1 record reads as
/// having neither (its batch is not counted against the byte bound).
const RECORD_VERSION: u8 = 2;

impl BatchRecord {
    fn encode(&self) -> Vec<u8> {
        let mut out =
            Vec::with_capacity(80 + self.workspace.len() + self.digest.len() + self.origin.len());
        out.push(RECORD_VERSION);
        for n in [
            self.total,
            self.done,
            self.failed,
            self.queued,
            self.running,
        ] {
            out.extend_from_slice(&n.to_le_bytes());
        }
        for t in [self.created_at, self.first_claim_at, self.finished_at] {
            out.extend_from_slice(&t.to_le_bytes());
        }
        let key = self.key.as_deref();
        out.push(u8::from(key.is_some()));
        for bytes in [
            self.workspace.as_bytes(),
            key.unwrap_or("").as_bytes(),
            &self.digest,
        ] {
            let len = u32::try_from(bytes.len()).unwrap_or(u32::MAX);
            out.extend_from_slice(&len.to_le_bytes());
            out.extend_from_slice(bytes);
        }
        out.extend_from_slice(&self.bytes.to_le_bytes());
        let len = u32::try_from(self.origin.len()).unwrap_or(u32::MAX);
        out.extend_from_slice(&len.to_le_bytes());
        out.extend_from_slice(self.origin.as_bytes());
        out
    }

    fn decode(bytes: &[u8]) -> Option<Self> {
        let mut r = Reader(bytes);
        let version = r.take(1)?[0];
        if version != 1 && version != RECORD_VERSION {
            return None;
        }
        let mut rec = BatchRecord {
            total: r.u32()?,
            done: r.u32()?,
            failed: r.u32()?,
            queued: r.u32()?,
            running: r.u32()?,
            created_at: r.u64()?,
            first_claim_at: r.u64()?,
            finished_at: r.u64()?,
            ..BatchRecord::default()
        };
        let has_key = r.take(1)? == [1];
        rec.workspace = String::from_utf8(r.bytes()?.to_vec()).ok()?;
        let key = String::from_utf8(r.bytes()?.to_vec()).ok()?;
        rec.key = has_key.then_some(key);
        rec.digest = r.bytes()?.to_vec();
        if version >= 2 {
            rec.bytes = r.u64()?;
            rec.origin = String::from_utf8(r.bytes()?.to_vec()).ok()?;
        }
        Some(rec)
    }

    fn progress(&self, mean_item: Option<Duration>) -> Progress {
        Progress {
            queued: self.queued,
            running: self.running,
            finished: self.done + self.failed,
            first_claim_at: nonzero(self.first_claim_at),
            finished_at: nonzero(self.finished_at),
            mean_item,
        }
    }
}

fn nonzero(ns: u64) -> Option<Timestamp> {
    (ns != 0).then_some(Timestamp::from_nanos(ns))
}

/// An item's record.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct ItemRecord {
    state: u8,
    attempt: u32,
    /// Its place in the workspace's queue (kept when it goes back).
    place: u64,
    claimed_at: u64,
    finished_at: u64,
}

const ITEM_LEN: usize = 1 + 4 + 8 + 8 + 8;

impl ItemRecord {
    fn encode(&self) -> [u8; ITEM_LEN] {
        let mut out = [0u8; ITEM_LEN];
        out[0] = self.state;
        out[1..5].copy_from_slice(&self.attempt.to_le_bytes());
        out[5..13].copy_from_slice(&self.place.to_le_bytes());
        out[13..21].copy_from_slice(&self.claimed_at.to_le_bytes());
        out[21..29].copy_from_slice(&self.finished_at.to_le_bytes());
        out
    }

    fn decode(bytes: &[u8]) -> Option<Self> {
        let mut r = Reader(bytes);
        Some(ItemRecord {
            state: r.take(1)?[0],
            attempt: r.u32()?,
            place: r.u64()?,
            claimed_at: r.u64()?,
            finished_at: r.u64()?,
        })
    }

    fn state(&self) -> ItemState {
        ItemState::from_code(self.state)
    }
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }

    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }

    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }

    fn bytes(&mut self) -> Option<&'a [u8]> {
        let len = usize::try_from(self.u32()?).ok()?;
        self.take(len)
    }
}

/// A result's stored form: the status, then [`ResultBody::encode`].
fn encode_result(result: &ItemResult) -> Vec<u8> {
    let mut out = result.status.to_le_bytes().to_vec();
    out.extend_from_slice(&result.body.encode());
    out
}

fn decode_result(bytes: &[u8]) -> Option<ItemResult> {
    let (status, body) = bytes.split_at_checked(2)?;
    Some(ItemResult {
        status: u16::from_le_bytes(status.try_into().ok()?),
        body: ResultBody::decode(body),
    })
}

/// A failure inside a transaction: the storage's, or a record that does not
/// decode.
#[derive(Debug)]
enum TxError {
    Storage(redb::Error),
    Corrupt(String),
}

impl<E: Into<redb::Error>> From<E> for TxError {
    fn from(e: E) -> Self {
        TxError::Storage(e.into())
    }
}

fn corrupt(what: &str, id: &str) -> TxError {
    TxError::Corrupt(format!("{what} of batch {id} cannot be read"))
}

fn ns(t: Timestamp) -> u64 {
    // 0 means "none" in the records: the epoch itself counts as 1 ns past it.
    t.as_nanos().max(1)
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
    /// # Errors
    /// [`OpenError::Unusable`] when the file cannot be read or written.
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
        book.write(|tx| {
            create_tables(tx)?;
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
        })
        .map_err(|e| unusable(&e))?;
        Ok(book)
    }

    /// The bounds it keeps.
    pub fn config(&self) -> BatchConfig {
        self.inner.config
    }

    /// Runs `f` in one write transaction and commits it; a failed write opens
    /// the storage anew for the next one (redb takes no transaction after one).
    fn write<T>(
        &self,
        f: impl FnOnce(&WriteTransaction) -> Result<T, TxError>,
    ) -> Result<T, BatchError> {
        self.write_if(|tx| f(tx).map(Ok)).and_then(|r| r)
    }

    /// As [`BatchBook::write`], committing only when `f` returns `Ok(Ok(_))`.
    fn write_if<T, E>(
        &self,
        f: impl FnOnce(&WriteTransaction) -> Result<Result<T, E>, TxError>,
    ) -> Result<Result<T, E>, BatchError> {
        let db = self.db()?;
        let outcome = (|| {
            let tx = db.begin_write()?;
            let answer = f(&tx)?;
            if answer.is_ok() {
                tx.commit()?;
            } else {
                tx.abort()?;
            }
            Ok::<_, TxError>(answer)
        })();
        drop(db);
        outcome.map_err(|e| self.failed(e))
    }

    /// As [`BatchBook::write`] for `f` answering how many things it changed:
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

    #[allow(clippy::too_many_arguments)]
    fn submit_blocking(
        &self,
        workspace: &str,
        origin: &str,
        items: Vec<Vec<u8>>,
        idempotency_key: Option<&str>,
        body_digest: &[u8],
        now: Timestamp,
    ) -> Result<Submitted, SubmitError> {
        let config = self.inner.config;
        if items.is_empty() {
            return Err(SubmitError::Empty);
        }
        if items.len() > config.max_items {
            return Err(SubmitError::TooMany {
                given: items.len(),
                limit: config.max_items,
            });
        }
        let total = u32::try_from(items.len()).map_err(|_| SubmitError::TooMany {
            given: items.len(),
            limit: config.max_items,
        })?;
        let batch_id = new_batch_id()?;
        let answer = self.write_if(|tx| {
            if let Some(key) = idempotency_key {
                let keys = tx.open_table(KEYS)?;
                if let Some(id) = keys.get((workspace, key))? {
                    let id = id.value().to_owned();
                    let meta = tx.open_table(META)?;
                    let rec = meta
                        .get(id.as_str())?
                        .and_then(|r| BatchRecord::decode(r.value()))
                        .ok_or_else(|| corrupt("the record", &id))?;
                    return Ok(if rec.digest == body_digest {
                        // Nothing to write: the abort below changes nothing.
                        Err(Ok(Submitted {
                            batch_id: id,
                            items: rec.total,
                            created: false,
                        }))
                    } else {
                        Err(Err(SubmitError::Conflict { batch_id: id }))
                    });
                }
            }
            let mut workspaces = tx.open_table(WORKSPACES)?;
            let (queued, running, last) =
                workspaces.get(workspace)?.map_or((0, 0, 0), |v| v.value());
            let unfinished = queued + running;
            if unfinished + u64::from(total) > config.max_backlog {
                return Ok(Err(Err(SubmitError::Backlog {
                    queued: unfinished,
                    limit: config.max_backlog,
                })));
            }
            let mut stats = tx.open_table(STATS)?;
            let stored = stats.get("stored_items")?.map_or(0, |v| v.value());
            if stored + u64::from(total) > config.max_stored_items {
                return Ok(Err(Err(SubmitError::Full {
                    stored,
                    limit: config.max_stored_items,
                })));
            }
            let bytes: u64 = items.iter().map(|b| b.len() as u64).sum();
            let queued_all = stats.get("unfinished_items")?.map_or(0, |v| v.value());
            let bytes_all = stats.get("stored_bytes")?.map_or(0, |v| v.value());
            let mut origins = tx.open_table(ORIGINS)?;
            let held = if origin.is_empty() {
                None
            } else {
                Some(origins.get(origin)?.map_or((0, 0), |v| v.value()))
            };
            if let Some((bound, used, limit)) =
                config.queue_bound(u64::from(total), bytes, queued_all, bytes_all, held)
            {
                return Ok(Err(Err(SubmitError::QueueFull { bound, used, limit })));
            }
            if let Some((o_items, o_bytes)) = held {
                origins.insert(origin, (o_items + u64::from(total), o_bytes + bytes))?;
            }
            drop(origins);
            stats.insert("unfinished_items", queued_all + u64::from(total))?;
            stats.insert("stored_bytes", bytes_all + bytes)?;
            let first_place = stats.get("next_place")?.map_or(0, |v| v.value());
            stats.insert("next_place", first_place + u64::from(total))?;
            stats.insert("stored_items", stored + u64::from(total))?;
            workspaces.insert(workspace, (queued + u64::from(total), running, last))?;
            let rec = BatchRecord {
                workspace: workspace.to_owned(),
                key: idempotency_key.map(str::to_owned),
                digest: body_digest.to_vec(),
                total,
                queued: total,
                created_at: ns(now),
                origin: origin.to_owned(),
                bytes,
                ..BatchRecord::default()
            };
            tx.open_table(META)?
                .insert(batch_id.as_str(), rec.encode().as_slice())?;
            if let Some(key) = idempotency_key {
                tx.open_table(KEYS)?
                    .insert((workspace, key), batch_id.as_str())?;
            }
            let mut item_table = tx.open_table(ITEMS)?;
            let mut bodies = tx.open_table(BODIES)?;
            let mut queue = tx.open_table(QUEUE)?;
            for (index, body) in (0u32..).zip(&items) {
                let place = first_place + u64::from(index);
                let item = ItemRecord {
                    state: ItemState::Queued.code(),
                    place,
                    ..ItemRecord::default()
                };
                let key = (batch_id.as_str(), index);
                item_table.insert(key, item.encode().as_slice())?;
                bodies.insert(key, body.as_slice())?;
                queue.insert((workspace, place), key)?;
            }
            Ok(Ok(Submitted {
                batch_id: batch_id.clone(),
                items: total,
                created: true,
            }))
        })?;
        match answer {
            Ok(created) => Ok(created),
            Err(Ok(existing)) => Ok(existing),
            Err(Err(refused)) => Err(refused),
        }
    }

    fn claim_blocking(
        &self,
        workspace: Option<&str>,
        now: Timestamp,
    ) -> Result<Option<Claimed>, BatchError> {
        let lease = self.inner.config.lease;
        self.write_if(|tx| {
            let chosen = match workspace {
                Some(w) => w.to_owned(),
                None => match fairest(tx)? {
                    Some(w) => w,
                    None => return Ok(Err(())),
                },
            };
            let head = {
                let queue = tx.open_table(QUEUE)?;
                let mut range = queue.range((chosen.as_str(), 0)..=(chosen.as_str(), u64::MAX))?;
                match range.next() {
                    Some(row) => {
                        let (k, v) = row?;
                        let (id, index) = v.value();
                        Some((k.value().1, id.to_owned(), index))
                    }
                    None => None,
                }
            };
            let Some((place, id, index)) = head else {
                return Ok(Err(()));
            };
            tx.open_table(QUEUE)?.remove((chosen.as_str(), place))?;
            let key = (id.as_str(), index);
            let mut items = tx.open_table(ITEMS)?;
            let mut item = items
                .get(key)?
                .and_then(|v| ItemRecord::decode(v.value()))
                .ok_or_else(|| corrupt("an item", &id))?;
            item.state = ItemState::Running.code();
            item.attempt += 1;
            item.claimed_at = ns(now);
            items.insert(key, item.encode().as_slice())?;
            let lease_until = now.saturating_add(lease);
            tx.open_table(RUNNING)?
                .insert(key, lease_until.as_nanos())?;
            let mut meta = tx.open_table(META)?;
            let mut rec = meta
                .get(id.as_str())?
                .and_then(|r| BatchRecord::decode(r.value()))
                .ok_or_else(|| corrupt("the record", &id))?;
            rec.queued = rec.queued.saturating_sub(1);
            rec.running += 1;
            if rec.first_claim_at == 0 {
                rec.first_claim_at = ns(now);
            }
            meta.insert(id.as_str(), rec.encode().as_slice())?;
            let mut workspaces = tx.open_table(WORKSPACES)?;
            let (queued, running, _) = workspaces
                .get(chosen.as_str())?
                .map_or((0, 0, 0), |v| v.value());
            workspaces.insert(
                chosen.as_str(),
                (queued.saturating_sub(1), running + 1, ns(now)),
            )?;
            let body = tx
                .open_table(BODIES)?
                .get(key)?
                .map(|b| b.value().to_vec())
                .unwrap_or_default();
            Ok(Ok(Claimed {
                batch_id: id.clone(),
                workspace: chosen.clone(),
                index,
                item: body,
                attempt: item.attempt,
                lease_until,
            }))
        })
        .map(Result::ok)
    }

    fn renew_blocking(
        &self,
        batch_id: &str,
        index: u32,
        now: Timestamp,
    ) -> Result<bool, BatchError> {
        let lease_until = now.saturating_add(self.inner.config.lease).as_nanos();
        self.write_if(|tx| {
            let mut running = tx.open_table(RUNNING)?;
            if running.get((batch_id, index))?.is_none() {
                return Ok(Err(()));
            }
            running.insert((batch_id, index), lease_until)?;
            Ok(Ok(()))
        })
        .map(|r| r.is_ok())
    }

    fn release_blocking(&self, batch_id: &str, index: u32) -> Result<bool, BatchError> {
        self.write_if(|tx| {
            if tx.open_table(RUNNING)?.get((batch_id, index))?.is_none() {
                return Ok(Err(()));
            }
            requeue(tx, batch_id, index)?;
            Ok(Ok(()))
        })
        .map(|r| r.is_ok())
    }

    fn finish_blocking(
        &self,
        batch_id: &str,
        index: u32,
        state: ItemState,
        result: &ItemResult,
        now: Timestamp,
    ) -> Result<Finish, BatchError> {
        let answer = self.write_if(|tx| {
            let key = (batch_id, index);
            let mut items = tx.open_table(ITEMS)?;
            let Some(item) = items.get(key)?.map(|v| ItemRecord::decode(v.value())) else {
                return Ok(Err(Finish::Unknown));
            };
            let mut item = item.ok_or_else(|| corrupt("an item", batch_id))?;
            let was = item.state();
            if was.is_finished() {
                return Ok(Err(Finish::AlreadyFinished));
            }
            let mut meta = tx.open_table(META)?;
            let mut rec = meta
                .get(batch_id)?
                .and_then(|r| BatchRecord::decode(r.value()))
                .ok_or_else(|| corrupt("the record", batch_id))?;
            item.state = state.code();
            item.finished_at = ns(now);
            items.insert(key, item.encode().as_slice())?;
            let body_len = tx
                .open_table(BODIES)?
                .remove(key)?
                .map_or(0, |b| b.value().len() as u64);
            let encoded = encode_result(result);
            let result_len = encoded.len() as u64;
            tx.open_table(RESULTS)?.insert(key, encoded.as_slice())?;
            // The body goes, the result stays: the bytes held move by the
            // difference; one item fewer is unfinished.
            rec.bytes = (rec.bytes + result_len).saturating_sub(body_len);
            {
                let mut stats = tx.open_table(STATS)?;
                let all = stats.get("stored_bytes")?.map_or(0, |v| v.value());
                stats.insert("stored_bytes", (all + result_len).saturating_sub(body_len))?;
                let unfinished = stats.get("unfinished_items")?.map_or(0, |v| v.value());
                stats.insert("unfinished_items", unfinished.saturating_sub(1))?;
            }
            if !rec.origin.is_empty() {
                let mut origins = tx.open_table(ORIGINS)?;
                let (o_items, o_bytes) = origins
                    .get(rec.origin.as_str())?
                    .map_or((0, 0), |v| v.value());
                origins.insert(
                    rec.origin.as_str(),
                    (
                        o_items.saturating_sub(1),
                        (o_bytes + result_len).saturating_sub(body_len),
                    ),
                )?;
            }
            let (dq, dr) = match was {
                ItemState::Running => {
                    tx.open_table(RUNNING)?.remove(key)?;
                    (0, 1)
                }
                _ => {
                    tx.open_table(QUEUE)?
                        .remove((rec.workspace.as_str(), item.place))?;
                    (1, 0)
                }
            };
            rec.queued = rec.queued.saturating_sub(dq);
            rec.running = rec.running.saturating_sub(dr);
            match state {
                ItemState::Failed => rec.failed += 1,
                _ => rec.done += 1,
            }
            let mut workspaces = tx.open_table(WORKSPACES)?;
            let (queued, running, last) = workspaces
                .get(rec.workspace.as_str())?
                .map_or((0, 0, 0), |v| v.value());
            let (queued, running) = (
                queued.saturating_sub(u64::from(dq)),
                running.saturating_sub(u64::from(dr)),
            );
            if queued == 0 && running == 0 {
                workspaces.remove(rec.workspace.as_str())?;
            } else {
                workspaces.insert(rec.workspace.as_str(), (queued, running, last))?;
            }
            if was == ItemState::Running && item.claimed_at != 0 {
                let mut stats = tx.open_table(STATS)?;
                let mean = stats
                    .get("mean_item_ns")?
                    .map(|v| Duration::from_nanos(v.value()));
                let took = now.saturating_since(Timestamp::from_nanos(item.claimed_at));
                let next = next_mean(mean, took);
                stats.insert(
                    "mean_item_ns",
                    u64::try_from(next.as_nanos()).unwrap_or(u64::MAX),
                )?;
            }
            if rec.queued == 0 && rec.running == 0 {
                rec.finished_at = ns(now);
                tx.open_table(FINISHED)?
                    .insert((rec.finished_at, batch_id), ())?;
            }
            meta.insert(batch_id, rec.encode().as_slice())?;
            Ok(Ok(()))
        })?;
        Ok(match answer {
            Ok(()) => Finish::Recorded,
            Err(f) => f,
        })
    }

    fn status_blocking(
        &self,
        workspace: &str,
        batch_id: &str,
        now: Timestamp,
    ) -> Result<Option<BatchStatus>, BatchError> {
        self.read(|tx| {
            let meta = tx.open_table(META)?;
            let Some(rec) = meta.get(batch_id)? else {
                return Ok(None);
            };
            let rec =
                BatchRecord::decode(rec.value()).ok_or_else(|| corrupt("the record", batch_id))?;
            if rec.workspace != workspace {
                return Ok(None);
            }
            let mean = tx
                .open_table(STATS)?
                .get("mean_item_ns")?
                .map(|v| Duration::from_nanos(v.value()));
            let results = tx.open_table(RESULTS)?;
            let items_table = tx.open_table(ITEMS)?;
            let mut items = Vec::with_capacity(usize::try_from(rec.total).unwrap_or(0));
            for row in items_table.range((batch_id, 0)..=(batch_id, u32::MAX))? {
                let (k, v) = row?;
                let index = k.value().1;
                let item =
                    ItemRecord::decode(v.value()).ok_or_else(|| corrupt("an item", batch_id))?;
                let state = item.state();
                let result = if state.is_finished() {
                    results
                        .get((batch_id, index))?
                        .and_then(|r| decode_result(r.value()))
                } else {
                    None
                };
                items.push(ItemStatus {
                    index,
                    state,
                    attempts: item.attempt,
                    result,
                });
            }
            Ok(Some(status_of(batch_id, &rec, items, now, mean)))
        })
    }

    fn backlogs_blocking(&self) -> Result<Vec<WorkspaceBacklog>, BatchError> {
        self.read(|tx| {
            let table = tx.open_table(WORKSPACES)?;
            let mut out = Vec::new();
            for row in table.iter()? {
                let (k, v) = row?;
                let (queued, running, _) = v.value();
                out.push(WorkspaceBacklog {
                    workspace: k.value().to_owned(),
                    queued,
                    running,
                });
            }
            Ok(out)
        })
    }

    fn maintain_blocking(&self, now: Timestamp) -> Result<Maintenance, BatchError> {
        let requeued = self.write_when_changed(|tx| {
            let expired: Vec<(String, u32)> = {
                let table = tx.open_table(RUNNING)?;
                let mut all = Vec::new();
                for row in table.iter()? {
                    let (k, v) = row?;
                    if v.value() <= now.as_nanos() {
                        let (id, index) = k.value();
                        all.push((id.to_owned(), index));
                    }
                }
                all
            };
            for (id, index) in &expired {
                requeue(tx, id, *index)?;
            }
            Ok(expired.len() as u64)
        })?;
        let mut done = Maintenance {
            requeued,
            purged: 0,
        };
        let cutoff = now.as_nanos().saturating_sub(
            u64::try_from(self.inner.config.retention.as_nanos()).unwrap_or(u64::MAX),
        );
        loop {
            let purged = self.write_when_changed(|tx| purge_some(tx, cutoff).map(|n| n as u64))?;
            done.purged += purged;
            if purged < PURGE_CHUNK as u64 {
                return Ok(done);
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

/// The workspace with queued items and the fewest running; ties go to the one
/// whose last claim is oldest, then by name.
fn fairest(tx: &WriteTransaction) -> Result<Option<String>, TxError> {
    let table = tx.open_table(WORKSPACES)?;
    let mut best: Option<((u64, u64), String)> = None;
    for row in table.iter()? {
        let (k, v) = row?;
        let (queued, running, last) = v.value();
        if queued == 0 {
            continue;
        }
        let rank = (running, last);
        if best.as_ref().is_none_or(|(b, _)| rank < *b) {
            best = Some((rank, k.value().to_owned()));
        }
    }
    Ok(best.map(|(_, w)| w))
}

/// Puts a running item back at its place in its workspace's queue.
fn requeue(tx: &WriteTransaction, batch_id: &str, index: u32) -> Result<(), TxError> {
    let key = (batch_id, index);
    tx.open_table(RUNNING)?.remove(key)?;
    let mut items = tx.open_table(ITEMS)?;
    let Some(mut item) = items
        .get(key)?
        .map(|v| ItemRecord::decode(v.value()))
        .map(|i| i.ok_or_else(|| corrupt("an item", batch_id)))
        .transpose()?
    else {
        return Ok(());
    };
    if item.state() != ItemState::Running {
        return Ok(());
    }
    item.state = ItemState::Queued.code();
    items.insert(key, item.encode().as_slice())?;
    let mut meta = tx.open_table(META)?;
    let mut rec = meta
        .get(batch_id)?
        .and_then(|r| BatchRecord::decode(r.value()))
        .ok_or_else(|| corrupt("the record", batch_id))?;
    rec.running = rec.running.saturating_sub(1);
    rec.queued += 1;
    meta.insert(batch_id, rec.encode().as_slice())?;
    tx.open_table(QUEUE)?
        .insert((rec.workspace.as_str(), item.place), key)?;
    let mut workspaces = tx.open_table(WORKSPACES)?;
    let (queued, running, last) = workspaces
        .get(rec.workspace.as_str())?
        .map_or((0, 0, 0), |v| v.value());
    workspaces.insert(
        rec.workspace.as_str(),
        (queued + 1, running.saturating_sub(1), last),
    )?;
    Ok(())
}

/// Drops up to [`PURGE_CHUNK`] batches finished at or before `cutoff`.
fn purge_some(tx: &WriteTransaction, cutoff: u64) -> Result<usize, TxError> {
    let old: Vec<(u64, String)> = {
        let finished = tx.open_table(FINISHED)?;
        let mut all = Vec::new();
        for row in finished.range((0, "")..=(cutoff, "\u{10ffff}"))? {
            let (k, _) = row?;
            let (at, id) = k.value();
            if at > cutoff {
                break;
            }
            all.push((at, id.to_owned()));
            if all.len() == PURGE_CHUNK {
                break;
            }
        }
        all
    };
    let mut freed = 0u64;
    let mut freed_bytes = 0u64;
    for (at, id) in &old {
        let id = id.as_str();
        tx.open_table(FINISHED)?.remove((*at, id))?;
        let rec = tx
            .open_table(META)?
            .remove(id)?
            .map(|r| BatchRecord::decode(r.value()));
        let Some(rec) = rec else { continue };
        let rec = rec.ok_or_else(|| corrupt("the record", id))?;
        if let Some(key) = rec.key.as_deref() {
            let mut keys = tx.open_table(KEYS)?;
            let ours = keys
                .get((rec.workspace.as_str(), key))?
                .is_some_and(|v| v.value() == id);
            if ours {
                keys.remove((rec.workspace.as_str(), key))?;
            }
        }
        freed_bytes += rec.bytes;
        if !rec.origin.is_empty() {
            let mut origins = tx.open_table(ORIGINS)?;
            let held = origins
                .get(rec.origin.as_str())?
                .map_or((0, 0), |v| v.value());
            let left = (held.0, held.1.saturating_sub(rec.bytes));
            if left == (0, 0) {
                origins.remove(rec.origin.as_str())?;
            } else {
                origins.insert(rec.origin.as_str(), left)?;
            }
        }
        let range = (id, 0)..=(id, u32::MAX);
        tx.open_table(ITEMS)?
            .retain_in(range.clone(), |_, _| false)?;
        tx.open_table(RESULTS)?
            .retain_in(range.clone(), |_, _| false)?;
        tx.open_table(BODIES)?.retain_in(range, |_, _| false)?;
        freed += u64::from(rec.total);
    }
    if freed > 0 {
        let mut stats = tx.open_table(STATS)?;
        let stored = stats.get("stored_items")?.map_or(0, |v| v.value());
        stats.insert("stored_items", stored.saturating_sub(freed))?;
        let bytes = stats.get("stored_bytes")?.map_or(0, |v| v.value());
        stats.insert("stored_bytes", bytes.saturating_sub(freed_bytes))?;
    }
    Ok(old.len())
}

fn status_of(
    batch_id: &str,
    rec: &BatchRecord,
    items: Vec<ItemStatus>,
    now: Timestamp,
    mean: Option<Duration>,
) -> BatchStatus {
    let state = if rec.queued == 0 && rec.running == 0 {
        BatchState::Done
    } else if rec.first_claim_at == 0 {
        BatchState::Queued
    } else {
        BatchState::Running
    };
    BatchStatus {
        batch_id: batch_id.to_owned(),
        state,
        total: rec.total,
        done: rec.done,
        failed: rec.failed,
        queued: rec.queued,
        running: rec.running,
        created_at: Timestamp::from_nanos(rec.created_at),
        estimated_finish_at: estimate_finish(now, rec.progress(mean)),
        items,
    }
}

impl BatchQueue for BatchBook {
    async fn submit_from(
        &self,
        workspace: &str,
        origin: &str,
        items: Vec<Vec<u8>>,
        idempotency_key: Option<&str>,
        body_digest: &[u8],
        now: Timestamp,
    ) -> Result<Submitted, SubmitError> {
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
    }

    async fn claim_next(
        &self,
        workspace: &str,
        now: Timestamp,
    ) -> Result<Option<Claimed>, BatchError> {
        let workspace = workspace.to_owned();
        self.blocking(move |b| b.claim_blocking(Some(&workspace), now))
            .await?
    }

    async fn claim_fairest(&self, now: Timestamp) -> Result<Option<Claimed>, BatchError> {
        self.blocking(move |b| b.claim_blocking(None, now)).await?
    }

    async fn renew(&self, batch_id: &str, index: u32, now: Timestamp) -> Result<bool, BatchError> {
        let id = batch_id.to_owned();
        self.blocking(move |b| b.renew_blocking(&id, index, now))
            .await?
    }

    async fn release(
        &self,
        batch_id: &str,
        index: u32,
        _now: Timestamp,
    ) -> Result<bool, BatchError> {
        let id = batch_id.to_owned();
        self.blocking(move |b| b.release_blocking(&id, index))
            .await?
    }

    async fn complete(
        &self,
        batch_id: &str,
        index: u32,
        result: ItemResult,
        now: Timestamp,
    ) -> Result<Finish, BatchError> {
        let id = batch_id.to_owned();
        self.blocking(move |b| b.finish_blocking(&id, index, ItemState::Done, &result, now))
            .await?
    }

    async fn fail(
        &self,
        batch_id: &str,
        index: u32,
        result: ItemResult,
        now: Timestamp,
    ) -> Result<Finish, BatchError> {
        let id = batch_id.to_owned();
        self.blocking(move |b| b.finish_blocking(&id, index, ItemState::Failed, &result, now))
            .await?
    }

    async fn status(
        &self,
        workspace: &str,
        batch_id: &str,
        now: Timestamp,
    ) -> Result<Option<BatchStatus>, BatchError> {
        let (workspace, id) = (workspace.to_owned(), batch_id.to_owned());
        self.blocking(move |b| b.status_blocking(&workspace, &id, now))
            .await?
    }

    async fn backlogs(&self) -> Result<Vec<WorkspaceBacklog>, BatchError> {
        self.blocking(BatchBook::backlogs_blocking).await?
    }

    async fn maintain(&self, now: Timestamp) -> Result<Maintenance, BatchError> {
        self.blocking(move |b| b.maintain_blocking(now)).await?
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn l4_records_round_trip() {
        let rec = BatchRecord {
            workspace: "acme".to_owned(),
            key: Some("k-1".to_owned()),
            digest: vec![1, 2, 3],
            total: 10,
            done: 2,
            failed: 1,
            queued: 5,
            running: 2,
            created_at: 7,
            first_claim_at: 8,
            finished_at: 0,
            origin: "203.0.113.7".to_owned(),
            bytes: 1234,
        };
        assert_eq!(BatchRecord::decode(&rec.encode()), Some(rec.clone()));
        let no_key = BatchRecord { key: None, ..rec };
        assert_eq!(BatchRecord::decode(&no_key.encode()), Some(no_key));
        let item = ItemRecord {
            state: 1,
            attempt: 2,
            place: 3,
            claimed_at: 4,
            finished_at: 5,
        };
        assert_eq!(ItemRecord::decode(&item.encode()), Some(item));
        assert_eq!(BatchRecord::decode(b"\x01short"), None);
    }
}
