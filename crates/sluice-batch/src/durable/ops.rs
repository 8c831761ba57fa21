//! The queue's operations on the book, each one write (or read) transaction:
//! submit, claim, renew, release, finish (complete or fail), status and
//! backlogs; and putting a running item back, which opening the book, a
//! release and the upkeep share.

use std::time::Duration;

use redb::{ReadableTable as _, WriteTransaction};
use sluice_core::Timestamp;

use super::codec::{BatchRecord, ItemRecord, decode_result, encode_result, ns};
use super::fairness::fairest;
use super::schema::{
    BODIES, FINISHED, ITEMS, KEYS, META, ORIGINS, QUEUE, RESULTS, RUNNING, STATS, WORKSPACES,
};
use super::{BatchBook, TxError, corrupt};
use crate::queue::{
    BatchError, BatchState, BatchStatus, Claimed, Finish, ItemResult, ItemState, ItemStatus,
    SubmitError, Submitted, WorkspaceBacklog, estimate_finish, new_batch_id, next_mean,
};

impl BatchBook {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn submit_blocking(
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
        let written = self.write_if_told(|tx| {
            if let Some(key) = idempotency_key {
                let keyed =
                    keyed_batch(&tx.open_table(KEYS)?, &tx.open_table(META)?, workspace, key)?;
                if let Some((id, rec)) = keyed {
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
        });
        let answer = match written {
            Ok(answer) => answer,
            Err(failed) if failed.at_commit => {
                return self.settle_blocking(&batch_id, total, failed.error);
            }
            Err(failed) => return Err(failed.error.into()),
        };
        match answer {
            Ok(created) => Ok(created),
            Err(Ok(existing)) => Ok(existing),
            Err(Err(refused)) => Err(refused),
        }
    }

    /// After a submit of batch `id` whose commit failed (`lost`): whether it
    /// was stored anyway. A commit can fail after it wrote the batch (its
    /// final flush, say), and then the file may hold it once opened anew
    /// (which the failed write did): read it back. Stored, it is queued and
    /// runs, and the submit answers so; not stored, nothing was; unreadable
    /// (the file cannot be opened anew, e.g. on a full disk),
    /// [`SubmitError::OutcomeUnknown`].
    fn settle_blocking(
        &self,
        id: &str,
        total: u32,
        lost: BatchError,
    ) -> Result<Submitted, SubmitError> {
        match self.read(|tx| Ok(tx.open_table(META)?.get(id)?.is_some())) {
            Ok(true) => Ok(Submitted {
                batch_id: id.to_owned(),
                items: total,
                created: true,
            }),
            Ok(false) => Err(lost.into()),
            Err(asked) => Err(SubmitError::OutcomeUnknown(format!(
                "{lost}; then reading back whether it was stored: {asked}"
            ))),
        }
    }

    pub(super) fn claim_blocking(
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

    pub(super) fn renew_blocking(
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

    /// [`BatchBook::renew_blocking`] for every one of `claims`, in one
    /// transaction (written only when one of them was still running).
    pub(super) fn renew_all_blocking(
        &self,
        claims: &[(String, u32)],
        now: Timestamp,
    ) -> Result<usize, BatchError> {
        let lease_until = now.saturating_add(self.inner.config.lease).as_nanos();
        let renewed = self.write_when_changed(|tx| {
            let mut running = tx.open_table(RUNNING)?;
            let mut renewed = 0;
            for (batch_id, index) in claims {
                if running.get((batch_id.as_str(), *index))?.is_some() {
                    running.insert((batch_id.as_str(), *index), lease_until)?;
                    renewed += 1;
                }
            }
            Ok(renewed)
        })?;
        Ok(usize::try_from(renewed).unwrap_or(usize::MAX))
    }

    pub(super) fn release_blocking(
        &self,
        batch_id: &str,
        index: u32,
        attempts: u32,
    ) -> Result<bool, BatchError> {
        self.write_if(|tx| {
            if tx.open_table(RUNNING)?.get((batch_id, index))?.is_none() {
                return Ok(Err(()));
            }
            requeue_as(tx, batch_id, index, Some(attempts))?;
            Ok(Ok(()))
        })
        .map(|r| r.is_ok())
    }

    pub(super) fn finish_blocking(
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

    /// [`BatchQueue::earlier_batch`](crate::BatchQueue::earlier_batch), in one
    /// read transaction.
    pub(super) fn earlier_blocking(
        &self,
        workspace: &str,
        key: &str,
        digest: &[u8],
    ) -> Result<Option<Submitted>, BatchError> {
        self.read(|tx| {
            let keyed = keyed_batch(&tx.open_table(KEYS)?, &tx.open_table(META)?, workspace, key)?;
            Ok(keyed.and_then(|(id, rec)| {
                (rec.digest == digest).then_some(Submitted {
                    batch_id: id,
                    items: rec.total,
                    created: false,
                })
            }))
        })
    }

    pub(super) fn status_blocking(
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

    pub(super) fn backlogs_blocking(&self) -> Result<Vec<WorkspaceBacklog>, BatchError> {
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
}

/// Puts a running item back at its place in its workspace's queue (its claim
/// ran out, or the process that held it is gone): the claim counts as one of
/// its attempts.
pub(super) fn requeue(tx: &WriteTransaction, batch_id: &str, index: u32) -> Result<(), TxError> {
    requeue_as(tx, batch_id, index, None)
}

/// [`requeue`]; with `attempts`, the item's attempts spent are set to it (it
/// was released: its runner says what its claims spent).
fn requeue_as(
    tx: &WriteTransaction,
    batch_id: &str,
    index: u32,
    attempts: Option<u32>,
) -> Result<(), TxError> {
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
    if let Some(attempts) = attempts {
        item.attempt = attempts;
    }
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

/// The batch `workspace`'s idempotency `key` made, with its record; `None` when
/// the key made none that is kept.
fn keyed_batch(
    keys: &impl redb::ReadableTable<(&'static str, &'static str), &'static str>,
    meta: &impl redb::ReadableTable<&'static str, &'static [u8]>,
    workspace: &str,
    key: &str,
) -> Result<Option<(String, BatchRecord)>, TxError> {
    let Some(id) = keys.get((workspace, key))? else {
        return Ok(None);
    };
    let id = id.value().to_owned();
    let rec = meta
        .get(id.as_str())?
        .and_then(|r| BatchRecord::decode(r.value()))
        .ok_or_else(|| corrupt("the record", &id))?;
    Ok(Some((id, rec)))
}
