//! The pure core of sluice: rate-limiting algorithms as functions of
//! `(state, now, request)`.
//!
//! No I/O, no async runtime, no reading of the time: a [`Clock`] is injected
//! and `now` is passed in. Stores (memory, embedded, Redis) keep the state and
//! call [`store_impl::decide`] over a [`store_impl::Ledger`] of what they
//! hold. To limit calls per key in a program, `sluice-store`'s `KeyedLimiter`
//! is the short way; this crate is what it is made of.
//!
//! ```
//! use std::num::NonZeroU32;
//! use std::collections::HashMap;
//! use sluice_core::{Budget, BudgetKey, Timestamp};
//! use sluice_core::store_impl::{decide, CellRef, Ledger, Mode};
//!
//! #[derive(Default)]
//! struct Cells(HashMap<u64, u64>);
//! impl Ledger for Cells {
//!     fn read(&mut self, at: CellRef<'_>) -> u64 { self.0.get(&at.cell).copied().unwrap_or(0) }
//!     fn write(&mut self, at: CellRef<'_>, v: u64) { self.0.insert(at.cell, v); }
//! }
//!
//! let minute = NonZeroU32::new(60).unwrap();
//! let expensive = Budget::per_window(BudgetKey::new("expensive", b"caller"), 30, minute);
//! let ip = Budget::per_window(BudgetKey::new("ip", b"203.0.113.7"), 300, minute);
//! let mut cells = Cells::default();
//! let now = Timestamp::from_secs(1_764_460_800);
//!
//! // 31 expensive units at once never fit a budget of 30; nothing is spent.
//! let batch = [expensive.with_cost(31), ip.with_cost(31)];
//! let refused = decide(&batch, &mut cells, now, Mode::Spend).unwrap();
//! assert!(!refused.is_admitted() && refused.is_never());
//! assert!(cells.0.is_empty());
//!
//! // One call is admitted on both budgets; the class budget binds.
//! let ok = decide(&[expensive, ip], &mut cells, now, Mode::Spend).unwrap();
//! assert!(ok.is_admitted());
//! assert_eq!(ok.binding().unwrap().limit, 30);
//! assert_eq!(ok.binding().unwrap().remaining, 29);
//! assert_eq!(ok.binding().unwrap().reset, 1_764_460_860);
//! ```

mod breaker;
mod calendar;
mod clock;
mod decision;
mod key;
mod lease;
mod problem;
mod rate;
mod rolling;
mod turns;

pub use breaker::{Breaker, BreakerConfig, BreakerState, Permit};
pub use calendar::{MonthPeriod, month_of};
pub use clock::{Clock, FakeClock, SystemClock, Timestamp};
pub use decision::{Budget, Decision, DecisionError, MAX_BUDGETS};
/// The store implementers' items (see [`store_impl`]), also named at the root:
/// the stores of this workspace (`sluice-store`'s memory, durable and Redis
/// stores, and `sluice-lanes`' ledgers) use them from here. Users of a store need
/// none of them.
pub use decision::{
    CellRef, InPlaceDecision, Ledger, Mode, adjust, decide, decide_cell, decide_within_bounds,
};
/// The key mixer a store shards and probes its table by (see [`store_impl`]).
pub use key::mix64;
pub use key::{BudgetKey, digest};
pub use lease::{
    ClockGap, GiveBack, LeaseCounts, LeaseHolder, LeaseTerms, Local, MAX_LEASE_MILLIS, take_lease,
    take_leases,
};
pub use problem::Problem;
pub use rate::{BudgetStatus, Rate, Verdict};
/// A keyed limiter's fast path ([`GcraStep`]: a GCRA budget's spacing worked out
/// once) and the test a store sweeps stale cells by ([`cell_is_stale`]), used by
/// `sluice-store`'s keyed, memory and durable stores (see [`store_impl`]).
pub use rate::{GcraStep, cell_is_stale};
pub use rolling::{MAX_ROLLING_SLOTS, RollingSlots};

/// For those who write a store: the pure decision over cells a store holds.
///
/// A store keeps each budget's state in one or two 64-bit cells (more for a
/// rolling window), hands them to [`decide`] through a
/// [`Ledger`], and writes back what it says. Users of a
/// store need none of this.
///
/// ```
/// use std::num::NonZeroU32;
/// use std::collections::HashMap;
/// use sluice_core::{Budget, BudgetKey, Timestamp};
/// use sluice_core::store_impl::{decide, CellRef, Ledger, Mode};
///
/// #[derive(Default)]
/// struct Cells(HashMap<u64, u64>);
/// impl Ledger for Cells {
///     fn read(&mut self, at: CellRef<'_>) -> u64 { self.0.get(&at.cell).copied().unwrap_or(0) }
///     fn write(&mut self, at: CellRef<'_>, v: u64) { self.0.insert(at.cell, v); }
/// }
///
/// let minute = NonZeroU32::new(60).unwrap();
/// let budget = Budget::per_window(BudgetKey::new("standard", b"caller"), 1, minute);
/// let mut cells = Cells::default();
/// let now = Timestamp::from_secs(1_764_460_800);
/// assert!(decide(&[budget], &mut cells, now, Mode::Spend).unwrap().is_admitted());
/// assert!(!decide(&[budget], &mut cells, now, Mode::Spend).unwrap().is_admitted());
/// assert_eq!(cells.0.len(), 1);
/// ```
pub mod store_impl {
    pub use crate::decision::{
        CellRef, InPlaceDecision, Ledger, Mode, adjust, decide, decide_cell, decide_within_bounds,
    };
    pub use crate::key::mix64;
    pub use crate::rate::{GcraStep, cell_is_stale};
}
pub use turns::{
    ContinueOrFinish, DEFAULT_PROFILE_TURNS, MAX_RUN_GRANTS, MAX_TIER_TURNS, Tier, Turn, TurnBudget,
};
