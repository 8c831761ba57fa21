//! The [`Ledger`] over the cells one decision holds locked: where each cell
//! is, folding new subjects into overflow budgets, and the commit.

use std::sync::atomic::Ordering;

use arrayvec::ArrayVec;
use parking_lot::MutexGuard;
use sluice_core::{BudgetKey, CellRef, Clock, Ledger, MAX_BUDGETS, Timestamp};

use crate::prefetch::SlotHint;

use super::{MemoryStore, NO_NETWORK, OVERFLOW_SUBJECT, Overflow, Shard};

/// Where a cell of a decision lives.
#[derive(Clone, Copy)]
pub(super) enum Place {
    /// Not looked up yet.
    Unresolved,
    /// In its shard's table at this bucket.
    Bucket(usize),
    /// Not in its shard, which has room for it.
    New,
    /// Folded into its client network's overflow budget: the cell under
    /// this key in the per-network table.
    Network(u64),
    /// Folded into its scope's global overflow budget, under this key.
    Global(u64),
}

/// One cell a decision touches, hashed and placed once.
#[derive(Clone, Copy)]
pub(super) struct Slot {
    pub(super) cell: u64,
    pub(super) hash: u64,
    /// The store's shard holding the cell.
    pub(super) shard: usize,
    /// Index into the decision's guards.
    pub(super) guard: usize,
    pub(super) place: Place,
    pub(super) value: u64,
    pub(super) dirty: bool,
}

/// The [`Ledger`] over the shards one decision holds locked. Writes are
/// buffered and applied by [`Cells::commit`], updates before inserts, so a
/// table growing never moves a bucket another write still points at.
pub(super) struct Cells<'a, C: Clock> {
    pub(super) store: &'a MemoryStore<C>,
    pub(super) now: Timestamp,
    /// The request's client network ([`NO_NETWORK`]: none).
    pub(super) network: u64,
    pub(super) guards: ArrayVec<MutexGuard<'a, Shard>, { 2 * MAX_BUDGETS }>,
    /// The overflow tables, locked at the first cell folded into them (after
    /// every shard lock) and held until the decision is over, so two
    /// decisions never both spend the same overflow count.
    pub(super) overflow: Option<MutexGuard<'a, Overflow>>,
    pub(super) slots: ArrayVec<Slot, { 2 * MAX_BUDGETS }>,
}

impl<'a, C: Clock> Cells<'a, C> {
    pub(super) fn slot(&mut self, cell: u64) -> Option<usize> {
        self.slots.iter().position(|s| s.cell == cell)
    }

    pub(super) fn overflow(&mut self) -> &mut Overflow {
        let store = self.store;
        self.overflow.get_or_insert_with(|| store.overflow.lock())
    }

    /// The count a new cell `at` starts from while overflow budgets are live:
    /// its network's overflow budget's (else its scope's global one's). A
    /// caller that spent in an overflow budget this window and then finds
    /// room in its shard (cells of shorter windows went stale) keeps what it
    /// spent there; a new caller from a network that overflowed shares what
    /// its network spent, until the window ends.
    pub(super) fn carried(&mut self, at: CellRef<'_>) -> u64 {
        let (now, network, scope) = (self.now, self.network, at.budget.key.scope());
        let hasher = &self.store.hasher;
        let find = |table: &Shard, subject: u64| {
            use std::hash::BuildHasher;
            let key = at
                .budget
                .with_key(BudgetKey::from_digests(scope, subject))
                .cell_at(at.index, now)?;
            let hash = hasher.hash_one(key);
            table
                .cells
                .find(hash, |e| e.0 == key)
                .map(|e| e.1)
                .filter(|&v| !sluice_core::cell_is_stale(v, now))
        };
        let overflow = self.overflow();
        let from_network = (network != NO_NETWORK)
            .then(|| find(&overflow.networks, network))
            .flatten();
        from_network
            .or_else(|| find(&overflow.global, OVERFLOW_SUBJECT))
            .unwrap_or(0)
    }

    /// Where a new subject's cell `at` goes when its shard is full of live
    /// cells: its network's overflow budget while the per-network table has
    /// room for it, else its scope's global one.
    pub(super) fn fold(&mut self, at: CellRef<'_>) -> (Place, u64) {
        self.store.overflowed.fetch_add(1, Ordering::Relaxed);
        let (now, network, scope) = (self.now, self.network, at.budget.key.scope());
        let cap = self.store.overflow_cap;
        let pending = self
            .slots
            .iter()
            .filter(|s| matches!(s.place, Place::Network(_)))
            .count();
        let hasher = &self.store.hasher;
        let overflow = self.overflow();
        if network != NO_NETWORK {
            let shared = at.budget.with_key(BudgetKey::from_digests(scope, network));
            let key = shared.cell_at(at.index, now).unwrap_or(0);
            let hash = {
                use std::hash::BuildHasher;
                hasher.hash_one(key)
            };
            let table = &mut overflow.networks;
            if let Some(e) = table.cells.find(hash, |e| e.0 == key) {
                return (Place::Network(key), e.1);
            }
            if table.cells.len() + pending >= cap {
                table.sweep(now, &[]);
            }
            if table.cells.len() + pending < cap {
                return (Place::Network(key), 0);
            }
        }
        let shared = at
            .budget
            .with_key(BudgetKey::from_digests(scope, OVERFLOW_SUBJECT));
        let key = shared.cell_at(at.index, now).unwrap_or(0);
        let hash = {
            use std::hash::BuildHasher;
            hasher.hash_one(key)
        };
        let value = overflow
            .global
            .cells
            .find(hash, |e| e.0 == key)
            .map_or(0, |e| e.1);
        (Place::Global(key), value)
    }

    /// Finds where `at`'s cell lives and its value.
    pub(super) fn resolve(&mut self, i: usize, at: CellRef<'_>) {
        let Slot {
            cell, hash, guard, ..
        } = self.slots[i];
        let shard = &mut self.guards[guard];
        let (place, value) = if let Some(b) = shard.cells.find_bucket_index(hash, |e| e.0 == cell) {
            let value = shard.cells.get_bucket(b).map_or(0, |e| e.1);
            (Place::Bucket(b), value)
        } else {
            // New cells of this decision are inserted only at commit: count
            // the ones already placed in this shard, or a decision could take
            // the shard past its cap.
            let pending = self
                .slots
                .iter()
                .filter(|s| s.guard == guard && matches!(s.place, Place::New))
                .count();
            // Cells other slots found here keep their buckets: a sweep
            // must neither drop them nor move them (compaction waits for
            // the commit).
            let pinned: ArrayVec<u64, { 2 * MAX_BUDGETS }> = self
                .slots
                .iter()
                .filter(|s| s.guard == guard && matches!(s.place, Place::Bucket(_)))
                .map(|s| s.cell)
                .collect();
            let shard = &mut self.guards[guard];
            if shard.cells.len() + pending >= self.store.shard_cap {
                shard.sweep(self.now, &pinned);
            }
            if shard.cells.len() + pending < self.store.shard_cap {
                let value = if self.store.overflow_live(self.now) {
                    self.carried(at)
                } else {
                    0
                };
                (Place::New, value)
            } else {
                // Full of live cells: this new subject shares an overflow budget.
                self.fold(at)
            }
        };
        self.slots[i].place = place;
        self.slots[i].value = value;
    }

    /// Applies the buffered writes.
    pub(super) fn commit(&mut self) {
        let hasher = &self.store.hasher;
        for pass_inserts in [false, true] {
            for s in self.slots.iter().filter(|s| s.dirty) {
                match (s.place, pass_inserts) {
                    (Place::Bucket(b), false) => {
                        if let Some(e) = self.guards[s.guard].cells.get_bucket_mut(b) {
                            e.1 = s.value;
                        }
                    }
                    (Place::New, true) => {
                        let hint = &self.store.shards[s.shard].hint;
                        self.guards[s.guard].insert(s.hash, s.cell, s.value, hasher, hint);
                    }
                    (Place::Network(key) | Place::Global(key), true) => {
                        if let Some(o) = self.overflow.as_mut() {
                            let o = &mut **o;
                            let (table, hint) = match s.place {
                                Place::Network(_) => (&mut o.networks, &o.networks_hint),
                                _ => (&mut o.global, &o.global_hint),
                            };
                            put(table, hint, hasher, key, s.value);
                            self.store
                                .overflow_until
                                .fetch_max(s.value >> 32, Ordering::Relaxed);
                        }
                    }
                    _ => {}
                }
            }
        }
        if let Some(o) = self.overflow.as_mut() {
            let o = &mut **o;
            o.networks.compact(hasher, &o.networks_hint);
            o.global.compact(hasher, &o.global_hint);
        }
        // No bucket index is needed any more: rebuild what sweeps left
        // tombstones in.
        for s in &self.slots {
            let hint = &self.store.shards[s.shard].hint;
            self.guards[s.guard].compact(hasher, hint);
        }
    }
}

/// Sets `key` to `value` in an overflow table, inserting it when absent.
pub(super) fn put(
    table: &mut Shard,
    hint: &SlotHint,
    hasher: &foldhash::fast::RandomState,
    key: u64,
    value: u64,
) {
    use std::hash::BuildHasher;
    let hash = hasher.hash_one(key);
    match table.cells.find_mut(hash, |e| e.0 == key) {
        Some(e) => e.1 = value,
        None => table.insert(hash, key, value, hasher, hint),
    }
}

/// Where a cell a decision did not list lives.
pub(super) enum Unlisted {
    /// In the shard behind this guard.
    Shard(usize),
    /// In the per-network overflow table, under this key.
    Network(u64),
    /// In the global overflow table, under this key.
    Global(u64),
}

impl<C: Clock> Cells<'_, C> {
    /// Where a cell the decision did not list up front lives (a rolling
    /// window's older slots): in the table of its subject's shard, which the
    /// decision holds (it listed the budget's current slot there) — or, when
    /// that current slot was folded into an overflow budget, in that overflow
    /// table under the shared budget's key for the same slot. `None`: not held.
    pub(super) fn unlisted(&self, at: CellRef<'_>) -> Option<Unlisted> {
        let current = at.budget.cell_at(0, self.now)?;
        let listed = self.slots.iter().find(|s| s.cell == current)?;
        let scope = at.budget.key.scope();
        match listed.place {
            Place::Network(_) => at
                .budget
                .with_key(BudgetKey::from_digests(scope, self.network))
                .cell_at(at.index, self.now)
                .map(Unlisted::Network),
            Place::Global(_) => at
                .budget
                .with_key(BudgetKey::from_digests(scope, OVERFLOW_SUBJECT))
                .cell_at(at.index, self.now)
                .map(Unlisted::Global),
            _ => Some(Unlisted::Shard(listed.guard)),
        }
    }

    pub(super) fn read_unlisted(&mut self, at: CellRef<'_>) -> u64 {
        let hash = |key| self.store.hash(key);
        match self.unlisted(at) {
            Some(Unlisted::Shard(guard)) => {
                let h = hash(at.cell);
                self.guards[guard]
                    .cells
                    .find(h, |e| e.0 == at.cell)
                    .map_or(0, |e| e.1)
            }
            Some(Unlisted::Network(key)) => {
                let h = hash(key);
                self.overflow()
                    .networks
                    .cells
                    .find(h, |e| e.0 == key)
                    .map_or(0, |e| e.1)
            }
            Some(Unlisted::Global(key)) => {
                let h = hash(key);
                self.overflow()
                    .global
                    .cells
                    .find(h, |e| e.0 == key)
                    .map_or(0, |e| e.1)
            }
            None => 0,
        }
    }

    /// Writes a cell the decision did not list, at once: a refund into a
    /// rolling window's older slot, which only ever lowers a cell that is
    /// there (no bucket index is held for it, and nothing is inserted).
    pub(super) fn write_unlisted(&mut self, at: CellRef<'_>, value: u64) {
        let (key, network) = match self.unlisted(at) {
            Some(Unlisted::Shard(guard)) => {
                let hash = self.store.hash(at.cell);
                let shard = &mut self.guards[guard];
                if let Some(e) = shard.cells.find_mut(hash, |e| e.0 == at.cell) {
                    e.1 = value;
                }
                return;
            }
            Some(Unlisted::Network(key)) => (key, true),
            Some(Unlisted::Global(key)) => (key, false),
            None => return,
        };
        let hash = self.store.hash(key);
        let o = self.overflow();
        let table = if network {
            &mut o.networks
        } else {
            &mut o.global
        };
        if let Some(e) = table.cells.find_mut(hash, |e| e.0 == key) {
            e.1 = value;
        }
    }
}

impl<C: Clock> Ledger for Cells<'_, C> {
    fn read(&mut self, at: CellRef<'_>) -> u64 {
        let Some(i) = self.slot(at.cell) else {
            return self.read_unlisted(at);
        };
        if matches!(self.slots[i].place, Place::Unresolved) {
            self.resolve(i, at);
        }
        self.slots[i].value
    }

    fn write(&mut self, at: CellRef<'_>, value: u64) {
        if let Some(i) = self.slot(at.cell) {
            if matches!(self.slots[i].place, Place::Unresolved) {
                self.resolve(i, at);
            }
            self.slots[i].value = value;
            self.slots[i].dirty = true;
        } else {
            self.write_unlisted(at, value);
        }
    }
}
