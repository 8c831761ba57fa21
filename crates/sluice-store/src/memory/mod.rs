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

mod cells;
mod decision;
mod expiry;
mod table;

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};

use crossbeam_utils::CachePadded;
use hashbrown::HashTable;
use parking_lot::Mutex;
use sluice_core::{Budget, BudgetStatus, Clock, Decision, Mode, SystemClock, Timestamp, adjust};

use crate::{BudgetStore, StoreError};

use cells::{Cells, Place, Slot};
pub use table::{MAX_SHARDS, TABLE_FILL, auto_shards};
use table::{Overflow, Shard, ShardSlot};

/// Hashed with a store's random state to make its shard seed.
const SHARD_SEED_INPUT: u64 = 0x7368_6172_6473; // "shards"

/// The subject digest of every scope's shared overflow budget.
const OVERFLOW_SUBJECT: u64 = 0x6f76_6572_666c_6f77; // "overflow"

/// No client network: new subjects at a full shard share their scope's
/// global overflow budget (see [`MemoryStore::decide_now_from`]).
pub const NO_NETWORK: u64 = 0;

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
    /// The usage rows noted in it (see [`BudgetStore::note_usage_row`]).
    rows: crate::rows::MemoryRows,
    /// The holds put on it (see [`BudgetStore::hold`]), at most
    /// [`crate::MAX_HOLDS`].
    holds: crate::holds::MemoryHolds,
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
            rows: crate::rows::MemoryRows::default(),
            holds: crate::holds::MemoryHolds::default(),
        }
    }

    /// [`BudgetStore::hold`], at once, on this store's clock.
    pub fn hold_now(&self, key: &sluice_core::BudgetKey, for_: std::time::Duration) {
        self.holds.hold(*key, for_, self.clock.now());
    }

    /// [`BudgetStore::held`], at once, on this store's clock.
    pub fn held_now(&self, keys: &[sluice_core::BudgetKey]) -> Vec<std::time::Duration> {
        self.holds.held(keys, self.clock.now())
    }

    /// [`BudgetStore::note_usage_row`], at once.
    pub fn note_usage_row_now(&self, period: &str, row: &str, bound: crate::UsageRowBound) -> bool {
        self.rows
            .note(period, row, bound, self.clock.now().as_secs())
    }

    /// [`BudgetStore::usage_rows`], at once.
    pub fn usage_rows_now(
        &self,
        period: &str,
        after: Option<&str>,
        count: usize,
    ) -> crate::UsageRowsPage {
        self.rows.page(period, after, count)
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
}

impl<C: Clock> MemoryStore<C> {
    /// [`BudgetStore::decide`] without the future: the memory store never waits.
    ///
    /// # Errors
    /// [`StoreError::Decision`] when given more than [`MAX_BUDGETS`](sluice_core::MAX_BUDGETS) budgets.
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

    fn note_usage_row(
        &self,
        period: &str,
        row: &str,
        bound: crate::UsageRowBound,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send {
        std::future::ready(Ok(self.note_usage_row_now(period, row, bound)))
    }

    fn usage_rows(
        &self,
        period: &str,
        after: Option<&str>,
        count: usize,
    ) -> impl Future<Output = Result<crate::UsageRowsPage, StoreError>> + Send {
        std::future::ready(Ok(self.usage_rows_now(period, after, count)))
    }

    fn hold(
        &self,
        key: &sluice_core::BudgetKey,
        for_: std::time::Duration,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        self.hold_now(key, for_);
        std::future::ready(Ok(()))
    }

    fn held(
        &self,
        keys: &[sluice_core::BudgetKey],
    ) -> impl Future<Output = Result<Vec<std::time::Duration>, StoreError>> + Send {
        std::future::ready(Ok(self.held_now(keys)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_core::BudgetKey;

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
