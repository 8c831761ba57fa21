//! Deciding: locking the shards a decision's cells are in, and the general and
//! in-place paths over them.

use arrayvec::ArrayVec;
use parking_lot::MutexGuard;
use sluice_core::{
    Budget, Clock, Decision, GcraStep, InPlaceDecision, MAX_BUDGETS, Mode, Timestamp, decide_cell,
    decide_within_bounds,
};

use crate::StoreError;

use super::{Cells, MAX_SHARDS, MemoryStore, NO_NETWORK, Place, Shard, Slot};

impl<C: Clock> MemoryStore<C> {
    /// A [`Ledger`] holding the locks of every shard the budgets' cells fall
    /// in at `now` (at most [`MAX_BUDGETS`] budgets: callers check).
    pub(super) fn lock_cells(
        &self,
        budgets: &[Budget],
        now: Timestamp,
        network: u64,
    ) -> Cells<'_, C> {
        let mut slots: ArrayVec<Slot, { 2 * MAX_BUDGETS }> = ArrayVec::new();
        let mut shard_ids: ArrayVec<usize, { 2 * MAX_BUDGETS }> = ArrayVec::new();
        for b in budgets {
            let shard = self.shard_of(&b.key);
            for cell in b.cells(now) {
                if slots.iter().any(|s| s.cell == cell) {
                    continue;
                }
                let hash = self.hash(cell);
                self.shards[shard].hint.prefetch(hash);
                slots.push(Slot {
                    cell,
                    hash,
                    shard,
                    guard: shard,
                    place: Place::Unresolved,
                    value: 0,
                    dirty: false,
                });
                if !shard_ids.contains(&shard) {
                    shard_ids.push(shard);
                }
            }
        }
        // Ascending order: two decisions never wait on each other in a cycle.
        shard_ids.sort_unstable();
        for slot in &mut slots {
            slot.guard = shard_ids
                .iter()
                .position(|&id| id == slot.guard)
                .unwrap_or(0);
        }
        let guards = shard_ids
            .iter()
            .map(|&id| self.shards[id].shard.lock())
            .collect();
        Cells {
            store: self,
            now,
            network,
            guards,
            overflow: None,
            slots,
        }
    }

    pub(super) fn check_len(budgets: &[Budget]) -> Result<(), StoreError> {
        if budgets.len() > MAX_BUDGETS {
            return Err(sluice_core::DecisionError::TooManyBudgets {
                given: budgets.len(),
            }
            .into());
        }
        Ok(())
    }

    #[inline(always)]
    pub(super) fn decide_mode(
        &self,
        budgets: &[Budget],
        mode: Mode,
        network: u64,
    ) -> Result<Decision, StoreError> {
        Self::check_len(budgets)?;
        match budgets {
            [one] => Ok(self.decide_one(one, mode, network)),
            _ => Ok(self.decide_in_place(budgets, mode, network)),
        }
    }

    /// The general path: every shard involved locked, cells read through [`Cells`].
    pub(super) fn decide_locked(&self, budgets: &[Budget], mode: Mode, network: u64) -> Decision {
        let (mut cells, now) = self.lock_cells_now(budgets, network);
        let decision = decide_within_bounds(budgets, &mut cells, now, mode);
        cells.commit();
        decision
    }

    /// [`MemoryStore::lock_cells`] with the time read once the locks are
    /// held, so that decisions on one cell see the clock in the order they
    /// take its lock (one that read the time earlier but locked later could
    /// otherwise write an older window over a newer one). Which cells a
    /// sliding window uses depends on the time: when they changed while
    /// locking, it locks again.
    pub(super) fn lock_cells_now(
        &self,
        budgets: &[Budget],
        network: u64,
    ) -> (Cells<'_, C>, Timestamp) {
        let mut now = self.clock.now();
        loop {
            let mut cells = self.lock_cells(budgets, now, network);
            let locked_at = self.clock.now();
            if budgets.iter().all(|b| b.cells(locked_at) == b.cells(now)) {
                cells.now = locked_at;
                return (cells, locked_at);
            }
            drop(cells);
            now = locked_at;
        }
    }

    /// The hottest path: one budget kept in one cell, decided in place under
    /// one shard lock (see [`MemoryStore::decide_in_place`] for when the
    /// general path decides instead).
    #[inline(always)]
    pub(super) fn decide_one(&self, budget: &Budget, mode: Mode, network: u64) -> Decision {
        let Some(cell) = budget.one_cell() else {
            return self.decide_locked(std::slice::from_ref(budget), mode, network);
        };
        let hash = self.hash(cell);
        let slot = &self.shards[self.shard_of(&budget.key)];
        let mut shard = slot.shard.lock();
        // Read under the lock (see `lock_cells_now`).
        let now = self.clock.now();
        if let Some(entry) = shard.cells.find_mut(hash, |e| e.0 == cell) {
            return decide_cell(budget, &mut entry.1, now, mode);
        }
        if shard.cells.len() >= self.shard_cap || self.overflow_live(now) {
            shard.sweep(now, &[]);
            shard.compact(&self.hasher, &slot.hint);
            if shard.cells.len() >= self.shard_cap || self.overflow_live(now) {
                drop(shard);
                return self.decide_locked(std::slice::from_ref(budget), mode, network);
            }
        }
        let mut value = 0;
        let decision = decide_cell(budget, &mut value, now, mode);
        if value != 0 {
            shard.insert(hash, cell, value, &self.hasher, &slot.hint);
        }
        decision
    }

    /// One GCRA budget with its step worked out once (the keyed limiter's
    /// path): as [`MemoryStore::decide_one`], without a [`Decision`] built.
    /// Returns the instant decided at and the step's answer: `Ok` admitted
    /// (and spent), `Err` the nanoseconds to wait (`u64::MAX`: never).
    #[inline(always)]
    pub(crate) fn spend_gcra(
        &self,
        budget: &Budget,
        step: &GcraStep,
    ) -> (Timestamp, Result<(), u64>) {
        debug_assert!(matches!(budget.rate, sluice_core::Rate::Gcra { .. }));
        let cell = budget.key.fingerprint();
        let hash = self.hash(cell);
        let slot = &self.shards[self.shard_of(&budget.key)];
        let mut shard = slot.shard.lock();
        // Read under the lock (see `lock_cells_now`).
        let now = self.clock.now();
        if let Some(entry) = shard.cells.find_mut(hash, |e| e.0 == cell) {
            let spent = step.spend(entry.1, budget.cost, now).map(|v| entry.1 = v);
            return (now, spent);
        }
        if shard.cells.len() >= self.shard_cap || self.overflow_live(now) {
            // A new key at a full shard: the general path sweeps or overflows.
            drop(shard);
            let d = self.decide_one(budget, Mode::Spend, NO_NETWORK);
            let answer = match d.retry_after() {
                _ if d.is_admitted() => Ok(()),
                _ if d.is_never() => Err(u64::MAX),
                wait => Err(wait.map_or(0, |w| u64::try_from(w.as_nanos()).unwrap_or(u64::MAX))),
            };
            return (d.decided_at(), answer);
        }
        let spent = step.spend(0, budget.cost, now).map(|v| {
            if v != 0 {
                shard.insert(hash, cell, v, &self.hasher, &slot.hint);
            }
        });
        (now, spent)
    }

    /// The hot path, for budgets kept in one cell each (all but sliding
    /// windows): lock each subject's shard (ascending), decide every budget
    /// in place, and restore the written cells if one refuses — under the
    /// locks, so nobody sees the tentative spend. The general path decides
    /// instead (after this changed nothing) when a budget needs it: a sliding
    /// window, or a new subject arriving at a full shard.
    #[inline(always)]
    pub(super) fn decide_in_place(&self, budgets: &[Budget], mode: Mode, network: u64) -> Decision {
        let budgets = &budgets[..budgets.len().min(MAX_BUDGETS)];
        // Per budget: its cell, the cell's hash, its shard. Then the shards
        // as one mask, locked in ascending order (two decisions never wait on
        // each other in a cycle); no branch depends on which shards they are.
        let mut cells = [0u64; MAX_BUDGETS];
        let mut hashes = [0u64; MAX_BUDGETS];
        let mut shards = [0usize; MAX_BUDGETS];
        for (i, b) in budgets.iter().enumerate() {
            let Some(cell) = b.one_cell() else {
                return self.decide_locked(budgets, mode, network);
            };
            let shard = self.shard_of(&b.key);
            let hash = self.hash(cell);
            self.shards[shard].hint.prefetch(hash);
            (cells[i], hashes[i], shards[i]) = (cell, hash, shard);
        }
        let mut locked = 0u64;
        for &shard in &shards[..budgets.len()] {
            locked |= 1 << shard;
        }
        let mut guards: ArrayVec<MutexGuard<'_, Shard>, MAX_BUDGETS> = ArrayVec::new();
        // By shard: the index of its guard (a lookup rather than a popcount,
        // which is a dozen instructions on baseline x86-64).
        let mut guard_of = [0u8; MAX_SHARDS];
        let mut rest = locked;
        while rest != 0 {
            let shard = rest.trailing_zeros() as usize;
            guard_of[shard] = guards.len() as u8;
            guards.push(self.shards[shard].shard.lock());
            rest &= rest - 1;
        }
        // Read under the locks (see `lock_cells_now`).
        let now = self.clock.now();
        // Per budget (bit i): whether its cell was written, and whether it
        // was inserted; the values the written cells held before.
        let (mut wrote, mut inserted) = (0u32, 0u32);
        let mut olds = [0u64; MAX_BUDGETS];
        let mut d = InPlaceDecision::new(now, mode);
        let mut fell_back = false;
        for (i, b) in budgets.iter().enumerate() {
            let (cell, hash, shard) = (cells[i], hashes[i], shards[i]);
            let table = &mut guards[usize::from(guard_of[shard])];
            if let Some(entry) = table.cells.find_mut(hash, |e| e.0 == cell) {
                olds[i] = entry.1;
                wrote |= u32::from(d.step(b, &mut entry.1)) << i;
                continue;
            }
            if table.cells.len() >= self.shard_cap || self.overflow_live(now) {
                table.sweep(now, &[]);
                table.compact(&self.hasher, &self.shards[shard].hint);
                if table.cells.len() >= self.shard_cap || self.overflow_live(now) {
                    fell_back = true;
                    break;
                }
            }
            let mut value = 0;
            if d.step(b, &mut value) {
                table.insert(hash, cell, value, &self.hasher, &self.shards[shard].hint);
                wrote |= 1 << i;
                inserted |= 1 << i;
            }
        }
        let decision = d.finish();
        if fell_back || !(decision.is_admitted() || wrote == 0) {
            // Last written first: a cell two budgets share gets back, step
            // by step, the value it held before the first.
            // (Removing an inserted cell leaves a tombstone: `Shard::insert`
            // rebuilds the table rather than let tombstones make it grow.)
            for i in (0..budgets.len()).rev().filter(|&i| wrote & (1 << i) != 0) {
                let (cell, hash) = (cells[i], hashes[i]);
                let shard = &mut guards[usize::from(guard_of[shards[i]])];
                if inserted & (1 << i) != 0 {
                    if let Ok(e) = shard.cells.find_entry(hash, |e| e.0 == cell) {
                        e.remove();
                        shard.tombstones = true;
                    }
                } else {
                    if let Some(e) = shard.cells.find_mut(hash, |e| e.0 == cell) {
                        e.1 = olds[i];
                    }
                    // A sweep since may have planned by the spent value.
                    shard.next_sweep = shard.next_sweep.min((olds[i] >> 32) + 1);
                }
            }
        }
        if fell_back {
            drop(guards);
            return self.decide_locked(budgets, mode, network);
        }
        decision
    }
}
