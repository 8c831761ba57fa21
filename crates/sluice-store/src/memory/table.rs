//! The tables of cells: the shards a store spreads its subjects over, how many
//! it picks, and the overflow budgets' tables.

use hashbrown::HashTable;
use parking_lot::Mutex;
use sluice_core::{BudgetKey, Clock, mix64};

use crate::prefetch::SlotHint;

use super::MemoryStore;

/// The overflow budgets (see the module docs): per scope and client network,
/// bounded, and per scope.
#[derive(Default)]
pub(super) struct Overflow {
    pub(super) networks: Shard,
    pub(super) networks_hint: SlotHint,
    pub(super) global: Shard,
    pub(super) global_hint: SlotHint,
}

/// How full a shard's table is at the key cap when the store picks its
/// shard count: under a swiss table's 7/8, with room for shards to differ.
pub const TABLE_FILL: f64 = 0.85;

/// The most shards a store has: a multi-budget decision names the shards it
/// locks with one 64-bit mask, so it orders its locks and finds each budget's
/// lock without a data-dependent branch (those mispredict on random shards).
pub const MAX_SHARDS: usize = 64;

/// The shard count a store with `max_keys` picks: at least `floor` (16 per
/// core, at most half of [`MAX_SHARDS`]), at most twice that, and such that
/// `max_keys / shards` cells fill a power-of-two table of at least 8 slots
/// to at most [`TABLE_FILL`].
pub fn auto_shards(max_keys: usize, cores: usize) -> usize {
    let floor = cores
        .clamp(1, MAX_SHARDS)
        .saturating_mul(16)
        .next_power_of_two()
        .min(MAX_SHARDS / 2);
    // The largest table for which `floor` shards hold no more than the cap
    // at TABLE_FILL; then as many such tables as the cap needs.
    let per_shard = max_keys as f64 / floor as f64 / TABLE_FILL;
    let buckets = if per_shard < 8.0 {
        8.0
    } else {
        // A power of two at most `per_shard`.
        f64::from(per_shard.log2().floor() as i32).exp2()
    };
    let shards = (max_keys as f64 / (buckets * TABLE_FILL)).ceil() as usize;
    shards.clamp(floor, MAX_SHARDS)
}

/// One shard's table of cells, `(cell, value)` pairs by the cell's hash.
#[derive(Default)]
pub(super) struct Shard {
    pub(super) cells: HashTable<(u64, u64)>,
    /// The table's bucket count when its slots were last published (0 while
    /// no hint could be: a table of fewer than two cells gives none).
    pub(super) published_buckets: usize,
    /// No cell becomes stale before this Unix second: a sweep before then
    /// would find nothing to drop.
    pub(super) next_sweep: u64,
    /// Cells were dropped since the table was last built, leaving tombstones
    /// (see [`Shard::compact`]).
    pub(super) tombstones: bool,
}

impl Shard {
    /// Adds a cell that is not in the table (and republishes where the
    /// slots are when the table grew). When the table has no room left but
    /// tombstones hold some of it (cells removed after a refusal), it is
    /// rebuilt at its size instead of growing, as long as that frees at
    /// least 1/64 of its cells' count: each rebuild then costs at most 64
    /// inserts per tombstone that forced it (a table kept fuller than that
    /// grows instead, so no request pays a whole rebuild each time).
    pub(super) fn insert(
        &mut self,
        hash: u64,
        cell: u64,
        value: u64,
        hasher: &foldhash::fast::RandomState,
        hint: &SlotHint,
    ) {
        use std::hash::BuildHasher;
        let len = self.cells.len();
        if self.tombstones
            && len == self.cells.capacity()
            && len + len / 64 < Self::room(self.cells.num_buckets())
        {
            self.compact(hasher, hint);
        }
        self.cells
            .insert_unique(hash, (cell, value), |e| hasher.hash_one(e.0));
        self.next_sweep = self.next_sweep.min((value >> 32) + 1);
        if self.cells.num_buckets() != self.published_buckets {
            self.publish(hint);
        }
    }

    /// The most cells a table of `buckets` holds (7/8, or one less than a
    /// small table's count).
    pub(super) fn room(buckets: usize) -> usize {
        if buckets < 8 {
            buckets.saturating_sub(1)
        } else {
            buckets / 8 * 7
        }
    }

    /// Rebuilds the table in its own allocation when dropped cells left
    /// tombstones: a tombstone gives no room back, so a table kept near its
    /// sizing would otherwise double the next time it fills. The live cells
    /// are set aside, the table cleared (keeping its buckets) and the cells
    /// put back, so the only memory a rebuild takes for a moment is the live
    /// cells' 16 bytes each, never a second table. Moves every cell within
    /// the table: call only where no bucket index is held.
    pub(super) fn compact(&mut self, hasher: &foldhash::fast::RandomState, hint: &SlotHint) {
        use std::hash::BuildHasher;
        if !std::mem::take(&mut self.tombstones) {
            return;
        }
        let kept: Vec<(u64, u64)> = self.cells.iter().copied().collect();
        if kept.is_empty() && self.cells.allocation_size() > 0 {
            // `clear` skips a table with no cells, tombstones and all: give
            // it one (in place: an empty table rehashes rather than grows).
            self.cells.insert_unique(0, (0, 0), |_| 0);
        }
        self.cells.clear();
        for e in kept {
            self.cells
                .insert_unique(hasher.hash_one(e.0), e, |e| hasher.hash_one(e.0));
        }
        // The slots are where they were: the published hint still holds, unless
        // none could be published yet.
        if self.published_buckets == 0 {
            self.publish(hint);
        }
    }

    /// Publishes where the table's slots are, and remembers the bucket count it
    /// did so for (none yet: the next insert tries again).
    pub(super) fn publish(&mut self, hint: &SlotHint) {
        self.published_buckets = if hint.publish(&self.cells) {
            self.cells.num_buckets()
        } else {
            0
        };
    }
}

/// One shard and the hint of where its slots are.
#[derive(Default)]
pub(super) struct ShardSlot {
    pub(super) shard: Mutex<Shard>,
    pub(super) hint: SlotHint,
}

impl<C: Clock> MemoryStore<C> {
    #[inline]
    pub(super) fn hash(&self, cell: u64) -> u64 {
        use std::hash::BuildHasher;
        self.hasher.hash_one(cell)
    }

    /// The shard holding every cell of `key`'s subject: all budgets of one
    /// caller (or one IP) sit behind one lock, so a request locks one shard
    /// per subject rather than one per budget. The subject is mixed with this
    /// store's random seed, so nobody can aim keys at one shard, through a
    /// full-avalanche finaliser, so that subjects a user numbers 0, 1, 2, …
    /// spread too (`foldhash::fast` alone, with an unlucky process seed,
    /// put such subjects in a quarter of the shards); the hash is scaled to
    /// the shard count by a multiply's high half (any count, no division).
    #[inline]
    pub(super) fn shard_of(&self, key: &BudgetKey) -> usize {
        let h = mix64(key.subject() ^ self.shard_seed);
        ((u128::from(h) * self.shards.len() as u128) >> 64) as usize
    }
}
