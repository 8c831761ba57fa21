//! What a lane holds at one moment, for status pages, metrics and dashboards.

use std::time::Duration;

/// A lane at one moment (see [`Lane::snapshot`](crate::Lane::snapshot)).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct LaneSnapshot {
    /// The lane's name.
    pub lane: String,
    /// Calls in flight the lane allows across all workspaces.
    pub global_cap: u32,
    /// Batch items allowed at once (`global_cap - batch_reserve`).
    pub batch_cap: u32,
    /// Calls in flight now: single calls and batch items.
    pub running: u32,
    /// Single calls waiting in line.
    pub waiting: u32,
    /// Batch items in flight (part of `running`).
    pub batch_running: u32,
    /// Where the breaker stands.
    pub breaker: BreakerStatus,
    /// How long a call is expected to hold its place: the moving average of
    /// finished calls, or the configured guess before any finished.
    pub expected_duration: Duration,
    /// Every workspace holding, awaiting or recently starting a place,
    /// sorted by name.
    pub workspaces: Vec<WorkspaceSnapshot>,
}

/// One workspace's share of a lane.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct WorkspaceSnapshot {
    /// The workspace.
    pub workspace: String,
    /// Its single calls running.
    pub running: u32,
    /// Its single calls waiting in line.
    pub waiting: u32,
    /// Its single calls started in the rolling start window.
    pub started_in_window: u32,
    /// Its batch items running.
    pub batch_running: u32,
}

/// Where a lane's breaker stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum BreakerStatus {
    /// Calls go through.
    Closed,
    /// Calls are refused for `retry_after` more.
    Open {
        /// Time left until a probe may go through.
        retry_after: Duration,
    },
    /// The open time is over: the next call is (or, with `probe_out`, has
    /// gone as) the one probe whose outcome closes or re-opens the breaker.
    HalfOpen {
        /// Whether the probe is running.
        probe_out: bool,
    },
}

impl BreakerStatus {
    /// `closed`, `open` or `half_open`.
    pub const fn as_str(self) -> &'static str {
        match self {
            BreakerStatus::Closed => "closed",
            BreakerStatus::Open { .. } => "open",
            BreakerStatus::HalfOpen { .. } => "half_open",
        }
    }
}
