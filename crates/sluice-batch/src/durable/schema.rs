//! Where the queue lives in the store's redb file: its tables (listed on
//! [`BatchBook`](super::BatchBook)), all named `batch_*`, beside the quota
//! book's.

use redb::{TableDefinition, WriteTransaction};

pub(super) type ItemKey<'a> = (&'a str, u32);

pub(super) const META: TableDefinition<'_, &str, &[u8]> = TableDefinition::new("batch_meta");
pub(super) const ITEMS: TableDefinition<'_, ItemKey<'_>, &[u8]> =
    TableDefinition::new("batch_items");
pub(super) const BODIES: TableDefinition<'_, ItemKey<'_>, &[u8]> =
    TableDefinition::new("batch_bodies");
pub(super) const RESULTS: TableDefinition<'_, ItemKey<'_>, &[u8]> =
    TableDefinition::new("batch_results");
pub(super) const QUEUE: TableDefinition<'_, (&str, u64), ItemKey<'_>> =
    TableDefinition::new("batch_queue");
pub(super) const RUNNING: TableDefinition<'_, ItemKey<'_>, u64> =
    TableDefinition::new("batch_running");
pub(super) const WORKSPACES: TableDefinition<'_, &str, (u64, u64, u64)> =
    TableDefinition::new("batch_workspaces");
pub(super) const KEYS: TableDefinition<'_, (&str, &str), &str> = TableDefinition::new("batch_keys");
pub(super) const FINISHED: TableDefinition<'_, (u64, &str), ()> =
    TableDefinition::new("batch_finished");
pub(super) const STATS: TableDefinition<'_, &str, u64> = TableDefinition::new("batch_stats");
/// Per origin: (unfinished items, stored bytes).
pub(super) const ORIGINS: TableDefinition<'_, &str, (u64, u64)> =
    TableDefinition::new("batch_origins");

pub(super) fn create_tables(tx: &WriteTransaction) -> Result<(), redb::TableError> {
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
