//! The pure core of sluice: rate-limiting algorithms as functions of
//! `(state, now, request)`.
//!
//! No I/O, no async runtime, no reading of the time: a [`Clock`] is injected
//! and `now` is passed in. Stores (memory, embedded, Redis) keep the state and
//! call [`decide`] and [`adjust`] over a [`Ledger`] of what they hold.
//!
//! ```
//! use std::num::NonZeroU32;
//! use std::collections::HashMap;
//! use sluice_core::{decide, Budget, BudgetKey, CellRef, Ledger, Mode, Timestamp};
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
mod rate;
mod rolling;
mod turns;

pub use breaker::{Breaker, BreakerConfig, BreakerState, Permit};
pub use calendar::{MonthPeriod, month_of};
pub use clock::{Clock, FakeClock, SystemClock, Timestamp};
pub use decision::{
    Budget, CellRef, Decision, DecisionError, InPlaceDecision, Ledger, MAX_BUDGETS, Mode, adjust,
    decide, decide_cell, decide_within_bounds,
};
pub use key::{BudgetKey, digest};
pub use rate::{BudgetStatus, Rate, Verdict, cell_is_stale};
pub use rolling::MAX_ROLLING_SLOTS;
pub use turns::{ContinueOrFinish, DEFAULT_PROFILE_TURNS, Tier, Turn, TurnBudget};
