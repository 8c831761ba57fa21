//! Where sluice's budgets live.
//!
//! One trait, [`BudgetStore`], many backends. A backend makes one decision
//! over every budget of a request atomically: the memory backend under the
//! locks of the shards involved, the Redis backend (feature `redis`) in one
//! server-side script call — at most one round trip per decision (concurrent
//! decisions share one).
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
//! let budget = Budget::per_window(BudgetKey::new("standard", b"caller"), 2, minute);
//! assert!(store.decide(&[budget]).await.unwrap().is_admitted());
//! assert!(store.decide(&[budget]).await.unwrap().is_admitted());
//! let third = store.decide(&[budget]).await.unwrap();
//! assert!(!third.is_admitted());
//! assert_eq!(third.retry_after().unwrap().as_secs(), 60);
//! # });
//! ```

use std::future::Future;

use sluice_core::{Budget, BudgetStatus, Decision, DecisionError, Timestamp};

#[cfg(any(feature = "durable", feature = "redis"))]
pub mod batch;
#[cfg(feature = "durable")]
pub mod durable;
mod guarded;
#[cfg(feature = "durable")]
mod local;
mod memory;
mod prefetch;
#[cfg(feature = "redis")]
mod redis;

#[cfg(any(feature = "durable", feature = "redis"))]
pub use batch::{
    BatchConfig, BatchError, BatchQueue, BatchState, BatchStatus, Claimed, Finish, ItemResult,
    ItemState, ItemStatus, Maintenance, ResultBody, SubmitError, Submitted, WorkspaceBacklog,
};
#[cfg(feature = "durable")]
pub use durable::{BatchBook, DurableStore, JournalSync, OpenError, QuotaBook, QuotaBookConfig};
pub use guarded::{Guarded, STORE_BREAKER};
#[cfg(feature = "durable")]
pub use local::LocalStore;
pub use memory::{MAX_SHARDS, MemoryConfig, MemoryStore, NO_NETWORK, TABLE_FILL, auto_shards};
#[cfg(feature = "redis")]
pub use redis::{MAX_COALESCED, RedisBatches, RedisConfig, RedisStore};

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
