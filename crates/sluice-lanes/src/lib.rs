//! Guarded upstream lanes: protect an expensive upstream whose calls take
//! minutes, where a per-minute request rate protects nothing.
//!
//! A [`Lane`] guards one upstream. It limits each workspace to a number of
//! calls running at once and started in a rolling window, shares a global cap
//! fairly between workspaces (a freed place goes to the waiting workspace
//! with the fewest calls running), lets calls over a limit wait in a bounded
//! line for a bounded time and refuses them with an honest retry-after, stops
//! sending calls while a circuit breaker is open, and gives batch items only
//! the capacity single calls are not using.
//!
//! The lane knows nothing about HTTP: a gateway calls [`Lane::acquire`] before
//! forwarding a call, turns a [`LaneRefusal`] into its own refusal, and ends
//! the call with [`LanePermit::finish`]. Time is tokio's clock, so tests run on
//! paused time.
//!
//! ```
//! use std::time::Duration;
//! use sluice_lanes::{Lane, LaneConfig, Outcome, RefusalReason};
//!
//! # tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true)
//! #     .build().unwrap().block_on(async {
//! let lane = Lane::new("optimizer", LaneConfig::default()).unwrap();
//! let wait = Duration::from_secs(15);
//!
//! // Three calls of one workspace run at once...
//! let mut running = Vec::new();
//! for _ in 0..3 {
//!     running.push(lane.acquire("acme", wait).await.unwrap());
//! }
//! // ...a fourth waits 15 s in line, then is refused with an estimate.
//! let refused = lane.acquire("acme", wait).await.unwrap_err();
//! assert_eq!(refused.reason, RefusalReason::WorkspaceInFlightLimit);
//! assert_eq!(refused.reason.as_str(), "workspace_in_flight_limit");
//! assert!(refused.retry_after >= Duration::from_secs(5));
//!
//! // Another workspace is not held by acme's limit.
//! let other = lane.acquire("globex", wait).await.unwrap();
//! other.finish(Outcome::Success);
//!
//! // A finished (or dropped) permit gives its place back exactly once.
//! running.pop().unwrap().finish(Outcome::Success);
//! drop(running);
//! assert_eq!(lane.snapshot().running, 0);
//! # });
//! ```
//!
//! # Fairness, estimates and bounds
//!
//! * Within a workspace, waiting calls start in arrival order. Between
//!   workspaces, a free place of the global cap goes to the workspace with
//!   the fewest single calls running, ties to the call that has waited
//!   longest. A place is handed to the chosen waiter directly, so a newcomer
//!   never overtakes it.
//! * The start limit is exact and rolling: a start counts until exactly one
//!   window after it. A call it holds learns the exact time its start slot
//!   frees; if that is past its wait, it is refused at once with that time.
//! * Estimated retry-after values (in-flight limit, busy) are the time until
//!   the earliest running call is expected to finish, from an exponentially
//!   weighted mean of how long finished calls held their place, clamped to
//!   the configured bounds (default 5–75 s). Being estimates, a retry then
//!   may be refused again.
//! * The line is bounded (default 256 calls, 32 per workspace); past it a
//!   call is refused at once with the limit that holds it.
//! * Batch items never start while a single call waits for a global place,
//!   never beyond `global_cap - batch_reserve` at once, and never while the
//!   breaker is open.
//!
//! # Replicas
//!
//! [`Lane::new`] counts in this process. [`Lane::with_ledger`] makes the
//! limits hold across every replica sharing a [`Ledger`] (a `RedisLedger`
//! with the feature `redis`): each place is leased there before its permit is
//! handed out, leases are renewed while their calls run and come back within
//! the ledger's TTL when a replica dies. See the [`ledger`] module for how far
//! fairness holds across replicas, and [`LedgerOutage`] for what happens while
//! the ledger cannot be asked.

mod config;
mod lane;
mod leases;
pub mod ledger;
#[cfg(feature = "redis")]
mod redis;
mod refusal;
mod snapshot;

pub use config::{ConfigError, LaneConfig, WorkspaceLimits};
pub use lane::{BatchPermit, Lane, LanePermit};
pub use ledger::{
    Lease, LeaseKind, Ledger, LedgerCounts, LedgerError, LedgerOutage, MemoryLedger, Taken,
};
#[cfg(feature = "redis")]
pub use redis::{RedisLedger, RedisLedgerConfig};
pub use refusal::{LaneRefusal, Outcome, RefusalReason};
pub use sluice_core::BreakerConfig;
pub use snapshot::{BreakerStatus, LaneSnapshot, WorkspaceSnapshot};
