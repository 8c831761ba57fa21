//! The queue's upkeep, run from time to time by the runner: running items whose
//! lease ran out go back to their queue, finished batches past their retention
//! are dropped (a chunk per transaction).

use redb::{ReadableTable as _, WriteTransaction};
use sluice_core::Timestamp;

use super::codec::BatchRecord;
use super::ops::requeue;
use super::schema::{BODIES, FINISHED, ITEMS, KEYS, META, ORIGINS, RESULTS, RUNNING, STATS};
use super::{BatchBook, TxError, corrupt};
use crate::queue::{BatchError, Maintenance};

/// Batches dropped per transaction by a purge.
const PURGE_CHUNK: usize = 64;

impl BatchBook {
    pub(super) fn maintain_blocking(&self, now: Timestamp) -> Result<Maintenance, BatchError> {
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
