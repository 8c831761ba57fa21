//! The in-process backend: sharded, bounded, O(1) per decision.
//!
//! # Layout
//! Cells live in `shards` hash tables, each behind its own mutex; a cell's
//! shard comes from a per-process randomly seeded hash of its key, so a
//! decision locks only the one to few shards its cells fall in (in ascending
//! order, so two decisions never deadlock). There is no global lock and no
//! shared counter on the hot path.
//!
//! # Bounds
//! Each shard holds at most `max_keys / shards` cells (rounded up). A cell
//! whose window is over (see [`sluice_core::cell_is_stale`]) is dropped when
//! its shard needs room or on [`MemoryStore::reclaim`]; dropping it changes no
//! decision. When a shard is full of live cells, a *new* subject is folded
//! into a shared overflow budget of the same scope and limit (one per scope,
//! outside the cap): new callers during a key flood share one budget, and a
//! caller that already has a cell keeps it and its spent count. An active
//! caller is never handed a fresh budget.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};

use arrayvec::ArrayVec;
use crossbeam_utils::CachePadded;
use hashbrown::HashTable;
use parking_lot::{Mutex, MutexGuard};
use sluice_core::{
    Budget, BudgetKey, BudgetStatus, CellRef, Clock, Decision, Ledger, MAX_BUDGETS, Mode,
    SystemClock, Timestamp, adjust, cell_is_stale, decide,
};

use crate::{BudgetStore, StoreError};

/// The subject digest of every scope's shared overflow budget.
const OVERFLOW_SUBJECT: u64 = 0x6f76_6572_666c_6f77; // "overflow"

/// Sizing of a [`MemoryStore`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryConfig {
    /// The most cells held at once (one per fixed-window budget of a subject,
    /// two per sliding-window one). At 16 bytes a cell plus table overhead,
    /// the default of 1,000,000 stays under ~40 MB.
    pub max_keys: usize,
    /// The number of shards, rounded up to a power of two (at least 1).
    pub shards: usize,
}

impl Default for MemoryConfig {
    fn default() -> Self {
        MemoryConfig {
            max_keys: 1_000_000,
            shards: default_shards(),
        }
    }
}

fn default_shards() -> usize {
    let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
    (cores * 16).next_power_of_two()
}

#[derive(Default)]
struct Shard {
    cells: HashTable<(u64, u64)>,
    /// No cell becomes stale before this Unix second: a sweep before then
    /// would find nothing to drop.
    next_sweep: u64,
}

impl Shard {
    fn get(&self, hash: u64, cell: u64) -> Option<u64> {
        self.cells.find(hash, |e| e.0 == cell).map(|e| e.1)
    }

    /// Drops stale cells if any can be stale by now.
    fn sweep(&mut self, now: Timestamp) {
        if now.as_secs() < self.next_sweep {
            return;
        }
        let mut next = u64::MAX;
        self.cells.retain(|e| {
            let keep = !cell_is_stale(e.1, now);
            if keep {
                next = next.min((e.1 >> 32) + 1);
            }
            keep
        });
        self.next_sweep = next;
    }
}

/// The in-process budget store (see the module docs for layout and bounds).
pub struct MemoryStore<C: Clock = SystemClock> {
    clock: C,
    hasher: foldhash::fast::RandomState,
    shards: Box<[CachePadded<Mutex<Shard>>]>,
    shard_bits: u32,
    shard_cap: usize,
    /// Cells of the shared overflow budgets (one or two per scope). Locked
    /// only after every shard lock a decision takes.
    overflow: Mutex<std::collections::HashMap<u64, u64>>,
    overflowed: AtomicU64,
}

impl MemoryStore<SystemClock> {
    /// A store on the real clock.
    pub fn new(config: MemoryConfig) -> Self {
        Self::with_clock(config, SystemClock::new())
    }
}

impl<C: Clock> MemoryStore<C> {
    /// A store reading time from `clock`.
    pub fn with_clock(config: MemoryConfig, clock: C) -> Self {
        let shards = config.shards.max(1).next_power_of_two();
        let shard_cap = config.max_keys.div_ceil(shards).max(1);
        MemoryStore {
            clock,
            hasher: foldhash::fast::RandomState::default(),
            shards: (0..shards)
                .map(|_| CachePadded::new(Mutex::default()))
                .collect(),
            shard_bits: shards.trailing_zeros(),
            shard_cap,
            overflow: Mutex::default(),
            overflowed: AtomicU64::new(0),
        }
    }

    /// The clock this store reads.
    pub fn clock(&self) -> &C {
        &self.clock
    }

    /// Cells held now (not counting the overflow budgets').
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().cells.len()).sum()
    }

    /// True when no cell is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The most cells this store holds at once.
    pub fn capacity(&self) -> usize {
        self.shard_cap * self.shards.len()
    }

    /// How many budget lookups were folded into an overflow budget because
    /// their shard was full of live cells.
    pub fn overflowed(&self) -> u64 {
        self.overflowed.load(Ordering::Relaxed)
    }

    /// Drops every stale cell now (a server runs this now and then; shards
    /// also sweep themselves when they need room).
    pub fn reclaim(&self) {
        let now = self.clock.now();
        for s in self.shards.iter() {
            let mut s = s.lock();
            s.next_sweep = 0;
            s.sweep(now);
        }
    }

    #[inline]
    fn hash(&self, cell: u64) -> u64 {
        use std::hash::BuildHasher;
        self.hasher.hash_one(cell)
    }

    #[inline]
    fn shard_of(&self, hash: u64) -> usize {
        if self.shard_bits == 0 {
            0
        } else {
            (hash >> (64 - self.shard_bits)) as usize
        }
    }

    /// Decides (or adjusts) under the locks of every shard involved.
    fn with_cells<R>(
        &self,
        budgets: &[Budget],
        f: impl FnOnce(&mut Cells<'_, C>, Timestamp) -> R,
    ) -> Result<R, StoreError> {
        if budgets.len() > MAX_BUDGETS {
            return Err(sluice_core::DecisionError::TooManyBudgets {
                given: budgets.len(),
            }
            .into());
        }
        let now = self.clock.now();
        let mut shard_ids: ArrayVec<usize, { 2 * MAX_BUDGETS }> = ArrayVec::new();
        for b in budgets {
            for cell in b.cells(now) {
                shard_ids.push(self.shard_of(self.hash(cell)));
            }
        }
        if shard_ids.len() > 1 {
            shard_ids.sort_unstable();
        }
        let mut guards: ArrayVec<(usize, MutexGuard<'_, Shard>), { 2 * MAX_BUDGETS }> =
            ArrayVec::new();
        for id in shard_ids {
            if guards.last().is_none_or(|(last, _)| *last != id) {
                guards.push((id, self.shards[id].lock()));
            }
        }
        let mut cells = Cells {
            store: self,
            now,
            guards,
            overflow: None,
            targets: ArrayVec::new(),
        };
        Ok(f(&mut cells, now))
    }

    fn decide_mode(&self, budgets: &[Budget], mode: Mode) -> Result<Decision, StoreError> {
        self.with_cells(budgets, |cells, now| decide(budgets, cells, now, mode))?
            .map_err(StoreError::from)
    }

    /// [`BudgetStore::decide`] without the future: the memory store never waits.
    ///
    /// # Errors
    /// [`StoreError::Decision`] when given more than [`MAX_BUDGETS`] budgets.
    pub fn decide_now(&self, budgets: &[Budget]) -> Result<Decision, StoreError> {
        self.decide_mode(budgets, Mode::Spend)
    }

    /// [`BudgetStore::peek`] without the future.
    ///
    /// # Errors
    /// As [`MemoryStore::decide_now`].
    pub fn peek_now(&self, budgets: &[Budget]) -> Result<Decision, StoreError> {
        self.decide_mode(budgets, Mode::Peek)
    }

    /// [`BudgetStore::adjust`] without the future.
    pub fn adjust_now(&self, budget: &Budget, delta: i64, reserved_at: Timestamp) -> BudgetStatus {
        let one = std::slice::from_ref(budget);
        match self.with_cells(one, |cells, now| {
            adjust(budget, delta, reserved_at, cells, now)
        }) {
            Ok(status) => status,
            // One budget is always within MAX_BUDGETS.
            Err(_) => unreachable!("a single budget never exceeds MAX_BUDGETS"),
        }
    }
}

/// Where a cell read during a decision lives.
#[derive(Clone, Copy)]
enum Target {
    /// In shard `guard` (an index into the locked guards), under `hash`.
    Shard { guard: usize, hash: u64 },
    /// In the overflow table, under this cell key.
    Overflow(u64),
}

/// The [`Ledger`] over the shards one decision holds locked.
struct Cells<'a, C: Clock> {
    store: &'a MemoryStore<C>,
    now: Timestamp,
    guards: ArrayVec<(usize, MutexGuard<'a, Shard>), { 2 * MAX_BUDGETS }>,
    overflow: Option<MutexGuard<'a, std::collections::HashMap<u64, u64>>>,
    /// Where each cell read so far lives, so its write goes to the same place.
    targets: ArrayVec<(u64, Target), { 2 * MAX_BUDGETS }>,
}

impl<C: Clock> Cells<'_, C> {
    fn guard_index(&self, hash: u64) -> usize {
        let id = self.store.shard_of(hash);
        self.guards
            .iter()
            .position(|(g, _)| *g == id)
            .unwrap_or_default()
    }

    fn overflow_table(&mut self) -> &mut std::collections::HashMap<u64, u64> {
        self.overflow
            .get_or_insert_with(|| self.store.overflow.lock())
    }

    fn locate(&mut self, at: CellRef<'_>) -> (Target, u64) {
        if let Some(&(_, t)) = self.targets.iter().find(|(c, _)| *c == at.cell) {
            let v = match t {
                Target::Shard { guard, hash } => {
                    self.guards[guard].1.get(hash, at.cell).unwrap_or(0)
                }
                Target::Overflow(key) => self.overflow_table().get(&key).copied().unwrap_or(0),
            };
            return (t, v);
        }
        let hash = self.store.hash(at.cell);
        let guard = self.guard_index(hash);
        let shard = &mut self.guards[guard].1;
        if let Some(v) = shard.get(hash, at.cell) {
            return (Target::Shard { guard, hash }, v);
        }
        if shard.cells.len() >= self.store.shard_cap {
            shard.sweep(self.now);
        }
        if shard.cells.len() < self.store.shard_cap {
            return (Target::Shard { guard, hash }, 0);
        }
        // Full of live cells: fold this new subject into its scope's overflow budget.
        self.store.overflowed.fetch_add(1, Ordering::Relaxed);
        let shared = at.budget.with_key(BudgetKey::from_digests(
            at.budget.key.scope(),
            OVERFLOW_SUBJECT,
        ));
        let key = shared.cells(self.now)[at.index.min(1)];
        let v = self.overflow_table().get(&key).copied().unwrap_or(0);
        (Target::Overflow(key), v)
    }
}

impl<C: Clock> Ledger for Cells<'_, C> {
    fn read(&mut self, at: CellRef<'_>) -> u64 {
        let (target, value) = self.locate(at);
        if !self.targets.iter().any(|(c, _)| *c == at.cell) {
            self.targets.push((at.cell, target));
        }
        value
    }

    fn write(&mut self, at: CellRef<'_>, value: u64) {
        let target = match self.targets.iter().find(|(c, _)| *c == at.cell) {
            Some(&(_, t)) => t,
            None => self.locate(at).0,
        };
        match target {
            Target::Shard { guard, hash } => {
                let shard = &mut self.guards[guard].1;
                match shard.cells.find_mut(hash, |e| e.0 == at.cell) {
                    Some(e) => e.1 = value,
                    None => {
                        let hasher = &self.store.hasher;
                        shard.cells.insert_unique(hash, (at.cell, value), |e| {
                            use std::hash::BuildHasher;
                            hasher.hash_one(e.0)
                        });
                        shard.next_sweep = shard.next_sweep.min((value >> 32) + 1);
                    }
                }
            }
            Target::Overflow(key) => {
                self.overflow_table().insert(key, value);
            }
        }
    }
}

impl<C: Clock> BudgetStore for MemoryStore<C> {
    fn decide(
        &self,
        budgets: &[Budget],
    ) -> impl Future<Output = Result<Decision, StoreError>> + Send {
        std::future::ready(self.decide_now(budgets))
    }

    fn peek(
        &self,
        budgets: &[Budget],
    ) -> impl Future<Output = Result<Decision, StoreError>> + Send {
        std::future::ready(self.peek_now(budgets))
    }

    fn adjust(
        &self,
        budget: &Budget,
        delta: i64,
        reserved_at: Timestamp,
    ) -> impl Future<Output = Result<BudgetStatus, StoreError>> + Send {
        std::future::ready(Ok(self.adjust_now(budget, delta, reserved_at)))
    }
}
