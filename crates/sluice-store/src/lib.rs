//! Where sluice's budgets live, and a keyed rate limiter over them.
//!
//! "10 requests a second per user" is [`KeyedLimiter`]: one budget per key
//! (any `Hash` type), refilled evenly, in this process or in a Redis shared
//! by every replica (feature `redis`).
//!
//! ```
//! use std::num::NonZeroU32;
//! use sluice_store::KeyedLimiter;
//!
//! let limiter = KeyedLimiter::per_second(NonZeroU32::new(2).unwrap());
//! assert!(limiter.check_key(&"alice").is_ok());
//! assert!(limiter.check_key(&"alice").is_ok());
//! let refused = limiter.check_key(&"alice").unwrap_err();
//! assert!(refused.wait_time().as_millis() <= 500); // a unit comes back every 500 ms
//! assert!(limiter.check_key(&"bob").is_ok()); // every key has its own budget
//! ```
//!
//! Underneath is one trait, [`BudgetStore`], and its backends. A backend
//! makes one decision over every budget of a request atomically: the memory
//! backend under the locks of the shards involved, the Redis backend
//! (feature `redis`) in one server-side script call — at most one round trip
//! per decision (concurrent decisions share one). Several budgets (a class,
//! an IP ceiling, a monthly quota) are charged all together or not at all:
//!
//! ```
//! use std::num::NonZeroU32;
//! use sluice_core::{Budget, BudgetKey, FakeClock, Timestamp};
//! use sluice_store::{BudgetStore, MemoryStore, MemoryConfig};
//!
//! # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
//! let clock = FakeClock::new(Timestamp::from_secs(1_764_460_800));
//! let store = MemoryStore::with_clock(MemoryConfig::default(), clock);
//! let minute = NonZeroU32::new(60).unwrap();
//! let caller = Budget::per_window(BudgetKey::new("standard", b"caller"), 2, minute);
//! let ip = Budget::per_window(BudgetKey::new("ip", b"203.0.113.7"), 100, minute);
//! assert!(store.decide(&[caller, ip]).await.unwrap().is_admitted());
//! assert!(store.decide(&[caller, ip]).await.unwrap().is_admitted());
//! let third = store.decide(&[caller, ip]).await.unwrap();
//! assert!(!third.is_admitted());
//! assert_eq!(third.retry_after().unwrap().as_secs(), 60);
//! assert_eq!(store.peek(&[ip]).await.unwrap().statuses()[0].remaining, 98); // the refusal spent nothing
//! # });
//! ```

use std::future::Future;
use std::time::Duration;

/// The side-by-side snippets of `docs/`, run as doc tests (one uses Redis).
#[cfg(all(doctest, feature = "redis"))]
#[doc = include_str!("../../../docs/vs-governor.md")]
struct VsGovernor;

use sluice_core::{Budget, BudgetKey, BudgetStatus, Decision, DecisionError, Timestamp};

#[cfg(feature = "durable")]
pub mod durable;
mod guarded;
pub mod holds;
mod keyed;
#[cfg(feature = "durable")]
mod local;
mod memory;
mod prefetch;
#[cfg(feature = "redis")]
mod redis;
mod rows;

/// The durable store's parts (see [`durable`]), also named at the root: the
/// gateway and the batch lanes open a [`DurableStore`] and its [`QuotaBook`]
/// from here.
#[cfg(feature = "durable")]
pub use durable::{DurableStore, JournalSync, OpenError, QuotaBook, QuotaBookConfig};
pub use guarded::Guarded;
/// The breaker [`Guarded`] gives a shared store unless told otherwise.
pub use guarded::STORE_BREAKER;
pub use holds::{MAX_HOLD, MAX_HOLDS};
pub use keyed::{InsufficientCapacity, KeyedLimiter, NotUntil, Quota};
#[cfg(feature = "durable")]
pub use local::LocalStore;
/// How [`MemoryStore`] picks its shard count from its key cap: the bounds and
/// the table fill it aims at, for those sizing a store (and its tests).
pub use memory::{MAX_SHARDS, TABLE_FILL, auto_shards};
pub use memory::{MemoryConfig, MemoryStore, NO_NETWORK};
/// The most decisions [`RedisStore`] carries in one script call.
#[cfg(feature = "redis")]
pub use redis::MAX_COALESCED;
#[cfg(feature = "redis")]
pub use redis::{RedisConfig, RedisStore};
pub use rows::{MAX_ROWS_PAGE, UsageRowBound, UsageRowsPage};

/// Why a store could not decide.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The request itself was malformed (e.g. too many budgets).
    #[error(transparent)]
    Decision(#[from] DecisionError),
    /// The backend could not be reached or did not answer in time.
    #[error("budget store unavailable: {0}")]
    Unavailable(String),
}

/// A place where budgets are kept and decided on.
///
/// Every method decides over all the budgets given atomically: all admit and
/// are spent, or nothing changes. Implementations own their notion of `now`
/// (an injected clock, or the shared server's clock).
pub trait BudgetStore: Send + Sync {
    /// Spends every budget's cost if all admit; otherwise changes nothing.
    ///
    /// # Errors
    /// [`StoreError::Decision`] for malformed input, [`StoreError::Unavailable`]
    /// when the backend cannot answer.
    fn decide(
        &self,
        budgets: &[Budget],
    ) -> impl Future<Output = Result<Decision, StoreError>> + Send;

    /// True when [`BudgetStore::take_leases`] takes leases: a store shared by
    /// replicas (Redis). A store in one process is exact already (the default,
    /// false), so a limiter asks it for no lease.
    fn leases(&self) -> bool {
        false
    }

    /// [`BudgetStore::decide`], taking leases (SPEC D4): budget `i` spends at
    /// least its cost and, where `wants[i]` is more, up to `wants[i]` units if
    /// they are left ([`sluice_core::take_lease`]), all or nothing over every
    /// budget as `decide`. Returns the decision and the units each budget
    /// granted (its cost, or more; 0 for all when refused). A `wants` shorter
    /// than `budgets` asks no more than the cost of the budgets past its end.
    ///
    /// `backs` are leftovers of ended leases, given back first (each as
    /// [`BudgetStore::adjust`] by `-units` at its `reserved_at`: a window
    /// already over takes nothing back), whatever the decision says.
    ///
    /// The default takes no lease: it gives back with `adjust` and decides
    /// exactly (each grant is the cost), which is what a store in one process
    /// means by a lease. The Redis store does it all in its one script call.
    ///
    /// # Errors
    /// As [`BudgetStore::decide`].
    fn take_leases(
        &self,
        budgets: &[Budget],
        wants: &[u32],
        backs: &[(Budget, sluice_core::GiveBack)],
    ) -> impl Future<Output = Result<(Decision, Vec<u32>), StoreError>> + Send {
        let _ = wants;
        async move {
            for (b, back) in backs {
                self.adjust(b, -i64::from(back.units), back.reserved_at)
                    .await?;
            }
            let decision = self.decide(budgets).await?;
            let grants = budgets
                .iter()
                .map(|b| if decision.is_admitted() { b.cost } else { 0 })
                .collect();
            Ok((decision, grants))
        }
    }

    /// Keeps `backs`, leftovers of ended leases whose call was never made (a
    /// circuit breaker turned it away), to give back in the next
    /// [`BudgetStore::take_leases`]: a store shared by replicas returns them
    /// once it answers again (SPEC D4). The default drops them: units unused
    /// until their window ends, never over-admitted.
    fn keep_give_backs(&self, backs: &[(Budget, sluice_core::GiveBack)]) {
        let _ = backs;
    }

    /// True while it keeps leftovers of ended leases for its recovery
    /// ([`BudgetStore::keep_give_backs`]): a [`BudgetStore::take_leases`] call,
    /// even of no budgets, then gives them back. The default keeps none.
    fn holds_give_backs(&self) -> bool {
        false
    }

    /// Reports what [`BudgetStore::decide`] would say, changing nothing.
    ///
    /// # Errors
    /// As [`BudgetStore::decide`].
    fn peek(&self, budgets: &[Budget])
    -> impl Future<Output = Result<Decision, StoreError>> + Send;

    /// Charges (`delta > 0`) or refunds (`delta < 0`) a budget after the fact;
    /// `reserved_at` is the [`Decision::decided_at`] of the original spend.
    /// The books stay within `[0, limit]`.
    ///
    /// # Errors
    /// [`StoreError::Unavailable`] when the backend cannot answer.
    fn adjust(
        &self,
        budget: &Budget,
        delta: i64,
        reserved_at: Timestamp,
    ) -> impl Future<Output = Result<BudgetStatus, StoreError>> + Send;

    /// [`BudgetStore::decide`] for a request from client network `network` (a
    /// digest of the client's /24 or /56, [`NO_NETWORK`] for none). A store that
    /// folds new subjects into shared overflow budgets when it is full (the
    /// memory store) folds them into that network's, so a flood of new keys
    /// from some networks leaves new callers from others a budget; the others
    /// ignore it (the default).
    ///
    /// # Errors
    /// As [`BudgetStore::decide`].
    fn decide_from(
        &self,
        budgets: &[Budget],
        network: u64,
    ) -> impl Future<Output = Result<Decision, StoreError>> + Send {
        let _ = network;
        self.decide(budgets)
    }

    /// [`BudgetStore::peek`] for a request from client network `network` (see
    /// [`BudgetStore::decide_from`]).
    ///
    /// # Errors
    /// As [`BudgetStore::decide`].
    fn peek_from(
        &self,
        budgets: &[Budget],
        network: u64,
    ) -> impl Future<Output = Result<Decision, StoreError>> + Send {
        let _ = network;
        self.peek(budgets)
    }

    /// Charges or refunds several budgets after the fact — each of `changes` is a
    /// budget and its delta, as [`BudgetStore::adjust_from`] takes them, for a
    /// spend decided at `reserved_at` — in one round trip where the store has
    /// one (the Redis script; one per hash slot on a Cluster), each change as
    /// [`BudgetStore::adjust_from`] would make it, in order. The statuses after
    /// each, in the same order.
    ///
    /// # Errors
    /// As [`BudgetStore::adjust`]; changes made before a failure stay made.
    fn adjust_all_from(
        &self,
        changes: &[(Budget, i64)],
        reserved_at: Timestamp,
        network: u64,
    ) -> impl Future<Output = Result<Vec<BudgetStatus>, StoreError>> + Send {
        async move {
            let mut statuses = Vec::with_capacity(changes.len());
            for (budget, delta) in changes {
                statuses.push(
                    self.adjust_from(budget, *delta, reserved_at, network)
                        .await?,
                );
            }
            Ok(statuses)
        }
    }

    /// Notes `row` among the usage rows of `period`, before any count of the row
    /// is charged: a listing of the period then names it (see
    /// [`BudgetStore::usage_rows`]). True when the row is there (already, or
    /// now); false when the period already holds `bound.max_rows` rows (the
    /// row is not noted; the caller counts it elsewhere). Durable where the
    /// store's monthly counts are, before it returns. A store that keeps no
    /// rows answers [`StoreError::Unavailable`] (the default).
    ///
    /// # Errors
    /// [`StoreError::Unavailable`] when the backend cannot answer or keeps no rows.
    fn note_usage_row(
        &self,
        period: &str,
        row: &str,
        bound: UsageRowBound,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send {
        let _ = (period, row, bound);
        std::future::ready(Err(StoreError::Unavailable(
            "this store keeps no usage rows".to_owned(),
        )))
    }

    /// A page of the rows noted in `period` ([`BudgetStore::note_usage_row`]):
    /// at most `count` (and at most [`MAX_ROWS_PAGE`]), starting where the page
    /// before said ([`UsageRowsPage::next`]; `None` for the first). Pages
    /// follow one another until one has no `next`; every row noted before the
    /// first page was asked is in one of them. A period with no rows is one
    /// empty page.
    ///
    /// # Errors
    /// [`StoreError::Unavailable`] when the backend cannot answer or keeps no rows.
    fn usage_rows(
        &self,
        period: &str,
        after: Option<&str>,
        count: usize,
    ) -> impl Future<Output = Result<UsageRowsPage, StoreError>> + Send {
        let _ = (period, after, count);
        std::future::ready(Err(StoreError::Unavailable(
            "this store keeps no usage rows".to_owned(),
        )))
    }

    /// Holds `key`: no request on it before `for_` from now, or before the end
    /// of the hold it has already, whichever is later (a shorter hold never
    /// shortens a longer one). `for_` is at most [`MAX_HOLD`]. "Now" is the
    /// store's: the Redis server's clock for the Redis store, so every process
    /// on it sees the hold end at one instant (see [`holds`]).
    ///
    /// The default keeps no hold (every key reads as not held by
    /// [`BudgetStore::held`]): a caller keeps its own, in its process. The
    /// stores of this crate keep them.
    ///
    /// # Errors
    /// [`StoreError::Unavailable`] when the backend cannot answer.
    fn hold(
        &self,
        key: &BudgetKey,
        for_: Duration,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        let _ = (key, for_);
        std::future::ready(Ok(()))
    }

    /// What is left, now, of the hold of each of `keys`
    /// ([`BudgetStore::hold`]), in their order: [`Duration::ZERO`] for a key
    /// not held. Measured on the store's clock, so a caller adds it to its
    /// own `now` whatever the two clocks say.
    ///
    /// # Errors
    /// [`StoreError::Unavailable`] when the backend cannot answer.
    fn held(
        &self,
        keys: &[BudgetKey],
    ) -> impl Future<Output = Result<Vec<Duration>, StoreError>> + Send {
        std::future::ready(Ok(vec![Duration::ZERO; keys.len()]))
    }

    /// [`BudgetStore::adjust`] for a request from client network `network` (see
    /// [`BudgetStore::decide_from`]): a budget folded into that network's
    /// overflow budget is adjusted there.
    ///
    /// # Errors
    /// As [`BudgetStore::adjust`].
    fn adjust_from(
        &self,
        budget: &Budget,
        delta: i64,
        reserved_at: Timestamp,
        network: u64,
    ) -> impl Future<Output = Result<BudgetStatus, StoreError>> + Send {
        let _ = network;
        self.adjust(budget, delta, reserved_at)
    }
}
