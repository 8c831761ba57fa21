//! Dropping stale cells: a shard's sweep when it needs room, and a whole store's
//! on [`MemoryStore::reclaim`].

use std::sync::atomic::Ordering;

use sluice_core::{Clock, Timestamp, cell_is_stale};

use super::{MemoryStore, Shard};

impl Shard {
    /// Drops stale cells if any can be stale by now, but not the cells in
    /// `pinned` (a decision holds their bucket indices). Leaves tombstones:
    /// see [`Shard::compact`].
    pub(super) fn sweep(&mut self, now: Timestamp, pinned: &[u64]) {
        if now.as_secs() < self.next_sweep {
            return;
        }
        let before = self.cells.len();
        let mut next = u64::MAX;
        self.cells.retain(|e| {
            let keep = !cell_is_stale(e.1, now) || pinned.contains(&e.0);
            if keep {
                next = next.min((e.1 >> 32) + 1);
            }
            keep
        });
        self.next_sweep = next;
        self.tombstones |= self.cells.len() < before;
    }
}

impl<C: Clock> MemoryStore<C> {
    /// Drops every stale cell now (a server runs this now and then; shards
    /// also sweep themselves when they need room).
    pub fn reclaim(&self) {
        let now = self.clock.now();
        for slot in self.shards.iter() {
            let mut s = slot.shard.lock();
            s.next_sweep = 0;
            s.sweep(now, &[]);
            s.compact(&self.hasher, &slot.hint);
        }
        let mut o = self.overflow.lock();
        let o = &mut *o;
        for (table, hint) in [
            (&mut o.networks, &o.networks_hint),
            (&mut o.global, &o.global_hint),
        ] {
            table.next_sweep = 0;
            table.sweep(now, &[]);
            table.compact(&self.hasher, hint);
        }
    }

    /// True while some overflow cell is live: a new cell must then be placed
    /// by the general path, which starts it from its overflow budget's count.
    #[inline(always)]
    pub(super) fn overflow_live(&self, now: Timestamp) -> bool {
        self.overflow_until.load(Ordering::Relaxed) >= now.as_secs()
    }
}
