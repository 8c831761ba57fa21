//! The in-process backend: sharded, bounded, O(1) per decision.
//!
//! # Layout
//! Cells live in `shards` hash tables, each behind its own mutex; a cell's
//! shard comes from a per-process randomly seeded hash of its subject, so a
//! decision locks only the one to few shards its cells fall in (in ascending
//! order, so two decisions never deadlock). There is no global lock and no
//! shared counter on the hot path. A decision over several budgets first
//! prefetches the slot each cell's lookup starts at (see the `prefetch`
//! module), which can hide part of a cold cell's cache miss behind the
//! locking; the one-cell, one-budget path takes its one lock at once.
//!
//! # Bounds
//! Each shard holds at most `max_keys / shards` cells (rounded up). Unless
//! told otherwise, a store picks its shard count from its key cap so that a
//! full shard's table is at most [`TABLE_FILL`] full (a swiss table grows at
//! 7/8): at the cap a cell costs about 16 / 0.85 + 1.2 ≈ 20 bytes, where
//! tables that had just doubled past the cap would cost up to 39. Tables grow
//! as cells arrive, or are allocated at that size at once with
//! [`MemoryConfig::preallocated`] (a fixed-size zone: memory that does not
//! move with the number of callers). A table keeps its size through churn:
//! the tombstones that removed cells leave (a refused decision's new cells, a
//! sweep's stale ones) are rebuilt away, in place, rather than let the table
//! grow. A cell whose window is over (see
//! [`sluice_core::cell_is_stale`]) is dropped when its shard needs room or on
//! [`MemoryStore::reclaim`]; dropping it changes no decision. Decisions read
//! the clock once they hold their locks, so on one cell they see time in the
//! order they lock it. A GCRA cell back at full capacity is stale too (its
//! theoretical arrival time is past), so a caller who spent nothing recently
//! holds no cell.
//!
//! # A flood of new subjects
//! When a shard is full of live cells, a *new* subject is folded into a shared
//! overflow budget of the same scope and limit; a caller that already has a
//! cell keeps it and its spent count, so an active caller is never handed a
//! fresh budget, and memory stays bounded. The overflow budget is the one of
//! the request's *client network* (see [`MemoryStore::decide_now_from`]; the
//! gateway passes the /24 of an IPv4 client, the /56 of an IPv6 one): a flood
//! spends the overflow budgets of the networks it comes from, and a new caller
//! from another network still gets a budget of its own network's. These
//! network budgets live in a table of their own, bounded at
//! [`MemoryStore::overflow_capacity`] cells (an eighth of `max_keys`, at least
//! 64), whose stale cells are dropped when it needs room. Only when that table
//! too is full of live cells — a flood from more networks, in one window, than
//! it holds — or when the request names no network, does a new subject share
//! its scope's one global overflow budget (one per scope, outside the caps).

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};

use arrayvec::ArrayVec;
use crossbeam_utils::CachePadded;
use hashbrown::HashTable;
use parking_lot::{Mutex, MutexGuard};
use sluice_core::{
    Budget, BudgetKey, BudgetStatus, CellRef, Clock, Decision, GcraStep, InPlaceDecision, Ledger,
    MAX_BUDGETS, Mode, SystemClock, Timestamp, adjust, cell_is_stale, decide_cell,
    decide_within_bounds, mix64,
};

use crate::prefetch::SlotHint;
use crate::{BudgetStore, StoreError};

/// Hashed with a store's random state to make its shard seed.
const SHARD_SEED_INPUT: u64 = 0x7368_6172_6473; // "shards"

/// The subject digest of every scope's shared overflow budget.
const OVERFLOW_SUBJECT: u64 = 0x6f76_6572_666c_6f77; // "overflow"

/// No client network: new subjects at a full shard share their scope's
/// global overflow budget (see [`MemoryStore::decide_now_from`]).
pub const NO_NETWORK: u64 = 0;

/// The overflow budgets (see the module docs): per scope and client network,
/// bounded, and per scope.
#[derive(Default)]
struct Overflow {
    networks: Shard,
    networks_hint: SlotHint,
    global: Shard,
    global_hint: SlotHint,
}

/// Sizing of a [`MemoryStore`]: [`MemoryConfig::default`], or
/// [`MemoryConfig::with_max_keys`] and its `with_*` methods.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct MemoryConfig {
    /// The most cells held at once (one per fixed-window budget of a subject,
    /// two per sliding-window one, one per slot holding units of a rolling
    /// window). At about 20 bytes a cell at the cap (see
    /// [`MemoryStore`]), the default of 1,000,000 takes about 20 MB.
    pub max_keys: usize,
    /// The number of shards, from 1 to [`MAX_SHARDS`] (larger values are
    /// taken as [`MAX_SHARDS`]); `0` (the default) picks it from `max_keys`
    /// and the machine's parallelism (see [`auto_shards`]).
    pub shards: usize,
    /// Allocate every shard's table for its share of `max_keys` at once (as a
    /// fixed-size zone), rather than let tables grow as cells arrive. The
    /// memory then stays what it was after the first seconds of traffic,
    /// whatever the number of callers does later: no table doubles under
    /// load, and a flood cannot make the process's footprint jump. Costs the
    /// whole bound's memory (about 20 bytes a cell) once traffic has touched
    /// the tables; off by default.
    pub preallocate: bool,
}

impl Default for MemoryConfig {
    fn default() -> Self {
        MemoryConfig {
            max_keys: 1_000_000,
            shards: 0,
            preallocate: false,
        }
    }
}

impl MemoryConfig {
    /// The default sizing holding at most `max_keys` cells.
    pub const fn with_max_keys(max_keys: usize) -> Self {
        MemoryConfig {
            max_keys,
            shards: 0,
            preallocate: false,
        }
    }

    /// About how many bytes the store's tables take with every cell in use
    /// (what [`MemoryConfig::preallocated`] asks for once traffic has touched
    /// them): 16 bytes a cell and a control byte per slot, at the fill the
    /// automatic shard count is picked for (a shard count of your own may
    /// round the tables up to twice that), plus the per-network overflow table
    /// (an eighth as many cells) once a flood fills it.
    pub fn bytes_at_cap(&self) -> u64 {
        ((self.max_keys as f64) * 1.125 * 17.0 / TABLE_FILL).ceil() as u64
    }

    /// The same sizing with every shard's table allocated up front (see
    /// [`MemoryConfig::preallocate`]).
    #[must_use]
    pub const fn preallocated(mut self) -> Self {
        self.preallocate = true;
        self
    }

    /// The same sizing on `shards` shards (`0`: picked from `max_keys`).
    #[must_use]
    pub const fn with_shards(mut self, shards: usize) -> Self {
        self.shards = shards;
        self
    }
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

#[derive(Default)]
struct Shard {
    cells: HashTable<(u64, u64)>,
    /// The table's bucket count when its slots were last published (0 while
    /// no hint could be: a table of fewer than two cells gives none).
    published_buckets: usize,
    /// No cell becomes stale before this Unix second: a sweep before then
    /// would find nothing to drop.
    next_sweep: u64,
    /// Cells were dropped since the table was last built, leaving tombstones
    /// (see [`Shard::compact`]).
    tombstones: bool,
}

impl Shard {
    /// Adds a cell that is not in the table (and republishes where the
    /// slots are when the table grew). When the table has no room left but
    /// tombstones hold some of it (cells removed after a refusal), it is
    /// rebuilt at its size instead of growing, as long as that frees at
    /// least 1/64 of its cells' count: each rebuild then costs at most 64
    /// inserts per tombstone that forced it (a table kept fuller than that
    /// grows instead, so no request pays a whole rebuild each time).
    fn insert(
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

    /// Drops stale cells if any can be stale by now, but not the cells in
    /// `pinned` (a decision holds their bucket indices). Leaves tombstones:
    /// see [`Shard::compact`].
    fn sweep(&mut self, now: Timestamp, pinned: &[u64]) {
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

    /// The most cells a table of `buckets` holds (7/8, or one less than a
    /// small table's count).
    fn room(buckets: usize) -> usize {
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
    fn compact(&mut self, hasher: &foldhash::fast::RandomState, hint: &SlotHint) {
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
    fn publish(&mut self, hint: &SlotHint) {
        self.published_buckets = if hint.publish(&self.cells) {
            self.cells.num_buckets()
        } else {
            0
        };
    }
}

/// One shard and the hint of where its slots are.
#[derive(Default)]
struct ShardSlot {
    shard: Mutex<Shard>,
    hint: SlotHint,
}

/// The in-process budget store: sharded (a decision locks only the shards
/// its callers' cells are in; no global lock) and bounded by
/// [`MemoryConfig::max_keys`] cells, about 20 bytes each at the cap. A cell
/// whose window is over is dropped when its shard needs room or on
/// [`MemoryStore::reclaim`], which changes no decision. When a shard is full
/// of live cells, a new caller shares its budget's overflow budget (one per
/// scope) while callers that already have a cell keep theirs: an active
/// caller is never handed a fresh budget.
pub struct MemoryStore<C: Clock = SystemClock> {
    clock: C,
    hasher: foldhash::fast::RandomState,
    /// Mixed into every subject before its shard is chosen.
    shard_seed: u64,
    shards: Box<[CachePadded<ShardSlot>]>,
    shard_cap: usize,
    /// Cells of the shared overflow budgets: per scope and client network
    /// (at most `overflow_cap`), and per scope. Locked only after every
    /// shard lock a decision takes, and held until it commits.
    overflow: Box<CachePadded<Mutex<Overflow>>>,
    overflow_cap: usize,
    /// The last second any overflow cell written is live to: until then a
    /// new cell starts from its overflow budget's count (see [`Cells::carried`]).
    overflow_until: AtomicU64,
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
        let shards = if config.shards == 0 {
            let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
            auto_shards(config.max_keys, cores)
        } else {
            config.shards.min(MAX_SHARDS)
        };
        let shard_cap = config.max_keys.div_ceil(shards).max(1);
        let shard = || {
            let slot = ShardSlot::default();
            if config.preallocate {
                let mut guard = slot.shard.lock();
                // Fallible: where the allocator refuses the memory, the table
                // grows as cells arrive instead of the process aborting (with
                // overcommit, pages are only committed as cells touch them).
                let mut cells = HashTable::new();
                if cells.try_reserve(shard_cap, |e: &(u64, u64)| e.0).is_ok() {
                    // No hint before two cells: the inserts publish one.
                    guard.cells = cells;
                }
            }
            CachePadded::new(slot)
        };
        let hasher = foldhash::fast::RandomState::default();
        let shard_seed = {
            use std::hash::BuildHasher;
            hasher.hash_one(SHARD_SEED_INPUT)
        };
        MemoryStore {
            clock,
            hasher,
            shard_seed,
            shards: (0..shards).map(|_| shard()).collect(),
            shard_cap,
            overflow: Box::new(CachePadded::new(Mutex::default())),
            overflow_cap: (config.max_keys / 8).max(64),
            overflow_until: AtomicU64::new(0),
            overflowed: AtomicU64::new(0),
        }
    }

    /// The clock this store reads.
    pub fn clock(&self) -> &C {
        &self.clock
    }

    /// Cells held now (not counting the overflow budgets').
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.shard.lock().cells.len()).sum()
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

    /// The most cells of per-network overflow budgets held at once (an
    /// eighth of `max_keys`, at least 64; outside [`MemoryStore::capacity`]).
    pub fn overflow_capacity(&self) -> usize {
        self.overflow_cap
    }

    /// Cells of overflow budgets held now: (per network, per scope).
    pub fn overflow_len(&self) -> (usize, usize) {
        let o = self.overflow.lock();
        (o.networks.cells.len(), o.global.cells.len())
    }

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
    fn overflow_live(&self, now: Timestamp) -> bool {
        self.overflow_until.load(Ordering::Relaxed) >= now.as_secs()
    }

    #[inline]
    fn hash(&self, cell: u64) -> u64 {
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
    fn shard_of(&self, key: &BudgetKey) -> usize {
        let h = mix64(key.subject() ^ self.shard_seed);
        ((u128::from(h) * self.shards.len() as u128) >> 64) as usize
    }

    /// A [`Ledger`] holding the locks of every shard the budgets' cells fall
    /// in at `now` (at most [`MAX_BUDGETS`] budgets: callers check).
    fn lock_cells(&self, budgets: &[Budget], now: Timestamp, network: u64) -> Cells<'_, C> {
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

    fn check_len(budgets: &[Budget]) -> Result<(), StoreError> {
        if budgets.len() > MAX_BUDGETS {
            return Err(sluice_core::DecisionError::TooManyBudgets {
                given: budgets.len(),
            }
            .into());
        }
        Ok(())
    }

    #[inline(always)]
    fn decide_mode(
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
    fn decide_locked(&self, budgets: &[Budget], mode: Mode, network: u64) -> Decision {
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
    fn lock_cells_now(&self, budgets: &[Budget], network: u64) -> (Cells<'_, C>, Timestamp) {
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
    fn decide_one(&self, budget: &Budget, mode: Mode, network: u64) -> Decision {
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
    fn decide_in_place(&self, budgets: &[Budget], mode: Mode, network: u64) -> Decision {
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

    /// [`BudgetStore::decide`] without the future: the memory store never waits.
    ///
    /// # Errors
    /// [`StoreError::Decision`] when given more than [`MAX_BUDGETS`] budgets.
    pub fn decide_now(&self, budgets: &[Budget]) -> Result<Decision, StoreError> {
        self.decide_mode(budgets, Mode::Spend, NO_NETWORK)
    }

    /// [`MemoryStore::decide_now`] for a request from client network
    /// `network` (a digest; [`NO_NETWORK`] for none): a new subject arriving
    /// at a full shard shares that network's overflow budget of its scope
    /// (see the module docs).
    ///
    /// # Errors
    /// As [`MemoryStore::decide_now`].
    pub fn decide_now_from(
        &self,
        budgets: &[Budget],
        network: u64,
    ) -> Result<Decision, StoreError> {
        self.decide_mode(budgets, Mode::Spend, network)
    }

    /// [`BudgetStore::peek`] without the future.
    ///
    /// # Errors
    /// As [`MemoryStore::decide_now`].
    pub fn peek_now(&self, budgets: &[Budget]) -> Result<Decision, StoreError> {
        self.decide_mode(budgets, Mode::Peek, NO_NETWORK)
    }

    /// [`MemoryStore::peek_now`] for a request from client network `network`.
    ///
    /// # Errors
    /// As [`MemoryStore::decide_now`].
    pub fn peek_now_from(&self, budgets: &[Budget], network: u64) -> Result<Decision, StoreError> {
        self.decide_mode(budgets, Mode::Peek, network)
    }

    /// [`BudgetStore::adjust`] without the future.
    pub fn adjust_now(&self, budget: &Budget, delta: i64, reserved_at: Timestamp) -> BudgetStatus {
        self.adjust_now_from(budget, delta, reserved_at, NO_NETWORK)
    }

    /// [`MemoryStore::adjust_now`] for a request from client network
    /// `network`: a budget that was folded into that network's overflow
    /// budget is adjusted there.
    pub fn adjust_now_from(
        &self,
        budget: &Budget,
        delta: i64,
        reserved_at: Timestamp,
        network: u64,
    ) -> BudgetStatus {
        // One budget is within MAX_BUDGETS, so the locked path applies as is.
        let (mut cells, now) = self.lock_cells_now(std::slice::from_ref(budget), network);
        let status = adjust(budget, delta, reserved_at, &mut cells, now);
        cells.commit();
        status
    }
}

/// Where a cell of a decision lives.
#[derive(Clone, Copy)]
enum Place {
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
struct Slot {
    cell: u64,
    hash: u64,
    /// The store's shard holding the cell.
    shard: usize,
    /// Index into the decision's guards.
    guard: usize,
    place: Place,
    value: u64,
    dirty: bool,
}

/// The [`Ledger`] over the shards one decision holds locked. Writes are
/// buffered and applied by [`Cells::commit`], updates before inserts, so a
/// table growing never moves a bucket another write still points at.
struct Cells<'a, C: Clock> {
    store: &'a MemoryStore<C>,
    now: Timestamp,
    /// The request's client network ([`NO_NETWORK`]: none).
    network: u64,
    guards: ArrayVec<MutexGuard<'a, Shard>, { 2 * MAX_BUDGETS }>,
    /// The overflow tables, locked at the first cell folded into them (after
    /// every shard lock) and held until the decision is over, so two
    /// decisions never both spend the same overflow count.
    overflow: Option<MutexGuard<'a, Overflow>>,
    slots: ArrayVec<Slot, { 2 * MAX_BUDGETS }>,
}

impl<'a, C: Clock> Cells<'a, C> {
    fn slot(&mut self, cell: u64) -> Option<usize> {
        self.slots.iter().position(|s| s.cell == cell)
    }

    fn overflow(&mut self) -> &mut Overflow {
        let store = self.store;
        self.overflow.get_or_insert_with(|| store.overflow.lock())
    }

    /// The count a new cell `at` starts from while overflow budgets are live:
    /// its network's overflow budget's (else its scope's global one's). A
    /// caller that spent in an overflow budget this window and then finds
    /// room in its shard (cells of shorter windows went stale) keeps what it
    /// spent there; a new caller from a network that overflowed shares what
    /// its network spent, until the window ends.
    fn carried(&mut self, at: CellRef<'_>) -> u64 {
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
    fn fold(&mut self, at: CellRef<'_>) -> (Place, u64) {
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
    fn resolve(&mut self, i: usize, at: CellRef<'_>) {
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
    fn commit(&mut self) {
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
fn put(
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
enum Unlisted {
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
    fn unlisted(&self, at: CellRef<'_>) -> Option<Unlisted> {
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

    fn read_unlisted(&mut self, at: CellRef<'_>) -> u64 {
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
    fn write_unlisted(&mut self, at: CellRef<'_>, value: u64) {
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

    fn decide_from(
        &self,
        budgets: &[Budget],
        network: u64,
    ) -> impl Future<Output = Result<Decision, StoreError>> + Send {
        std::future::ready(self.decide_now_from(budgets, network))
    }

    fn peek_from(
        &self,
        budgets: &[Budget],
        network: u64,
    ) -> impl Future<Output = Result<Decision, StoreError>> + Send {
        std::future::ready(self.peek_now_from(budgets, network))
    }

    fn adjust_from(
        &self,
        budget: &Budget,
        delta: i64,
        reserved_at: Timestamp,
        network: u64,
    ) -> impl Future<Output = Result<BudgetStatus, StoreError>> + Send {
        std::future::ready(Ok(self.adjust_now_from(
            budget,
            delta,
            reserved_at,
            network,
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A one-shard store of 1,700 cells (2,048 slots, 83 % full at its cap)
    /// on `clock`.
    fn one_shard(clock: sluice_core::FakeClock) -> MemoryStore<sluice_core::FakeClock> {
        MemoryStore::with_clock(MemoryConfig::with_max_keys(1_700).with_shards(1), clock)
    }

    #[test]
    fn a_preallocated_store_has_its_tables_at_full_size_before_any_cell_and_keeps_them() {
        // As a fixed-size zone: the table a shard needs at its cap exists
        // before the first caller, and churn over windows (sweeps, rebuilds
        // of the tombstones they leave, reclaims) keeps that one table.
        let clock = sluice_core::FakeClock::new(Timestamp::from_secs(1_764_460_800));
        let store = MemoryStore::with_clock(
            MemoryConfig::with_max_keys(1_700)
                .with_shards(1)
                .preallocated(),
            clock.clone(),
        );
        let grown = one_shard(clock.clone());
        assert!(grown.shards[0].shard.lock().cells.allocation_size() == 0);
        let size = |s: &MemoryStore<_>| {
            let shard = s.shards[0].shard.lock();
            (shard.cells.num_buckets(), shard.cells.allocation_size())
        };
        let at_start = size(&store);
        assert_eq!(at_start.0, 2_048);
        let minute = std::num::NonZeroU32::new(60).expect("non-zero");
        let mut next = 0;
        for round in 0..5 {
            for _ in 0..1_700 {
                let b = Budget::per_window(BudgetKey::from_digests(7, next), 10, minute);
                assert!(store.decide_now(&[b]).expect("decide").is_admitted());
                next += 1;
            }
            assert_eq!(store.len(), 1_700, "round {round}: every caller has a cell");
            assert_eq!(size(&store), at_start, "round {round}");
            assert!(
                store.shards[0].hint.is_published(),
                "round {round}: the prefetch hint"
            );
            clock.advance(std::time::Duration::from_secs(61));
            if round % 2 == 0 {
                store.reclaim();
                assert_eq!(store.len(), 0);
                assert_eq!(size(&store), at_start, "round {round}: reclaimed");
                // No tombstone left: all the room is free again.
                let shard = store.shards[0].shard.lock();
                assert_eq!(shard.cells.capacity(), Shard::room(at_start.0));
            }
        }
    }

    #[test]
    fn at_the_key_cap_a_cell_costs_about_twenty_bytes() {
        // A cell is 16 bytes plus one control byte; tables that had just
        // doubled past the cap would make it up to ~39.
        for cores in [1, 2, 8, 64] {
            for max_keys in [10_000, 100_000, 1_000_000, 2_000_000, 3_000_000] {
                let shards = auto_shards(max_keys, cores);
                assert!((16..=MAX_SHARDS).contains(&shards), "{shards}");
                let mut full = HashTable::new();
                let shard_cap = max_keys.div_ceil(shards) as u64;
                for k in 0..shard_cap {
                    full.insert_unique(k, (k, k), |e| e.0);
                }
                let bytes = shards * full.num_buckets() * 17;
                assert!(
                    bytes as f64 / max_keys as f64 <= 21.0,
                    "{cores} cores, cap {max_keys}: {shards} shards of {} buckets",
                    full.num_buckets()
                );
            }
        }
    }

    #[test]
    fn a_shard_refilled_after_sweeps_keeps_its_table_size() {
        // One shard at its cap, 1,700 cells in 2,048 slots (83 %): half the
        // cells live for a minute, half for an hour. Each round, the minute
        // passes and new one-minute subjects fill the shard again; the sweep
        // that makes room must not leave tombstones that force a doubling.
        let clock = sluice_core::FakeClock::new(Timestamp::from_secs(1_764_460_800));
        let store = one_shard(clock.clone());
        let minute = std::num::NonZeroU32::new(60).expect("non-zero");
        let hour = std::num::NonZeroU32::new(3_600).expect("non-zero");
        let spend = |subject: u64, window| {
            let b = Budget::per_window(BudgetKey::from_digests(7, subject), 10, window);
            assert!(store.decide_now(&[b]).expect("decide").is_admitted());
        };
        for s in 0..1_700 {
            spend(s, if s < 850 { hour } else { minute });
        }
        let buckets = store.shards[0].shard.lock().cells.num_buckets();
        assert_eq!(buckets, 2_048);
        let mut next = 1_000_000;
        for _ in 0..6 {
            clock.advance(std::time::Duration::from_secs(61));
            for _ in 0..850 {
                spend(next, minute);
                next += 1;
            }
            assert_eq!(store.len(), 1_700, "no subject went to the overflow");
        }
        assert_eq!(store.shards[0].shard.lock().cells.num_buckets(), buckets);
    }

    #[test]
    fn refused_requests_from_new_callers_leave_no_tombstones() {
        // A flood of new callers from one IP over its ceiling: each decision
        // inserts a new caller cell, then the ceiling refuses and it is
        // removed. Each removal leaves a tombstone that gives no room back:
        // unless they are rebuilt away, the table, kept 83 % full, doubles.
        let store = one_shard(sluice_core::FakeClock::new(Timestamp::from_secs(
            1_764_460_800,
        )));
        let minute = std::num::NonZeroU32::new(60).expect("non-zero");
        let caller = |s: u64| Budget::per_window(BudgetKey::from_digests(1, s), 10, minute);
        let ceiling = Budget::per_window(BudgetKey::from_digests(2, 0), 1, minute);
        for s in 0..1_698 {
            assert!(
                store
                    .decide_now(&[caller(s)])
                    .expect("decide")
                    .is_admitted()
            );
        }
        assert!(store.decide_now(&[ceiling]).expect("decide").is_admitted());
        let buckets = store.shards[0].shard.lock().cells.num_buckets();
        assert_eq!(buckets, 2_048);
        for s in 10_000..20_000 {
            let d = store.decide_now(&[caller(s), ceiling]).expect("decide");
            assert!(!d.is_admitted());
        }
        assert_eq!(store.len(), 1_699, "no refused caller kept a cell");
        assert_eq!(store.shards[0].shard.lock().cells.num_buckets(), buckets);
    }

    #[test]
    fn subjects_spread_evenly_over_the_shards() {
        // Subjects as a store sees them: digests of credentials or addresses.
        // (Sequential raw subjects, as benches use, spread less evenly for
        // a few of the per-process seeds; no caller can pick its digest.)
        let store = MemoryStore::new(MemoryConfig::with_max_keys(1_000).with_shards(32));
        let keys: Vec<BudgetKey> = (0..64_000u64)
            .map(|s| BudgetKey::new("ip", &s.to_le_bytes()))
            .collect();
        let mut per_shard = [0u32; 32];
        for k in &keys {
            per_shard[store.shard_of(k)] += 1;
        }
        let fair = keys.len() as u32 / 32;
        let most = per_shard.iter().copied().max().unwrap_or(0);
        assert!(most <= fair * 5 / 4, "{per_shard:?}");
    }
}
