//! The pacer: per provider a rolling 60 s token
//! window, requests spaced evenly (GCRA with a burst of one) and a rolling
//! day of requests, all kept in a [`BudgetStore`] so that processes sharing
//! the store share the budgets.
//!
//! A request *reserves* its estimate before it is sent (waiting, first come
//! first served, exactly until the windows have room; a smaller request may
//! go ahead of a waiting one only where that delays it not at all) and
//! *reconciles* with
//! the answer's actual `usage` afterwards ([`Permit::reconcile`]). The
//! provider counts a request when it arrives, not when it was sent, so every
//! window reaches back `60 s + arrival margin`.
//!
//! The module's rooms: `handle` holds the [`Pacer`] itself and its books;
//! `state` each provider's queues and counters; `admission` the waiting and
//! admitting of a request; `schedule` when a request can go on which route;
//! `reserve` turning a plan into a [`Permit`]; `charge` and `permit` what a
//! reservation spent and its settling; `feedback` what answers and their
//! headers teach; `ratio` the provider's input count to the pacer's estimate,
//! learned per model from answers' usage; `readings` the counters and
//! windows read back.

mod admission;
mod charge;
mod feedback;
mod handle;
mod permit;
mod ratio;
mod readings;
mod reserve;
mod schedule;
mod state;

pub use handle::{Pacer, PacerOptions};
pub use permit::Permit;
pub use state::{InputRatioReading, ProviderStats, WindowReading};
