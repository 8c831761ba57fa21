//! What a lane answers when a call may not start, and what a finished call
//! reports.

use std::fmt;
use std::time::Duration;

/// Why a call was refused. [`RefusalReason::as_str`] gives the reason string
/// clients see (`details.reason`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RefusalReason {
    /// The workspace already has as many calls running as it may.
    WorkspaceInFlightLimit,
    /// The workspace has started as many calls as it may in the rolling window.
    WorkspaceRateLimit,
    /// Every place of the global cap is taken.
    Busy,
    /// The breaker is open (or its one probe is out): no call is sent now.
    Unavailable,
    /// The ledger shared by the replicas could not be asked, and the lane
    /// fails closed (see [`LedgerOutage`](crate::LedgerOutage)): retry after
    /// 1 s. Not a limit of the upstream's: a gateway answers it as its store
    /// being unavailable.
    LedgerUnavailable,
}

impl RefusalReason {
    /// The lane engine's name of the reason: `workspace_in_flight_limit`,
    /// `workspace_rate_limit`, `busy`, `unavailable` or `ledger_unavailable`. A
    /// gateway may show `busy` and `unavailable` under names of its own (sluice's
    /// policy names them after the lane: `optimizer_busy` for a lane `optimizer`).
    pub const fn as_str(self) -> &'static str {
        match self {
            RefusalReason::WorkspaceInFlightLimit => "workspace_in_flight_limit",
            RefusalReason::WorkspaceRateLimit => "workspace_rate_limit",
            RefusalReason::Busy => "busy",
            RefusalReason::Unavailable => "unavailable",
            RefusalReason::LedgerUnavailable => "ledger_unavailable",
        }
    }

    /// Whether [`LaneRefusal::retry_after`] is exact for this reason (the
    /// rolling start window and the open breaker) rather than an estimate
    /// from running calls.
    pub const fn retry_after_is_exact(self) -> bool {
        matches!(
            self,
            RefusalReason::WorkspaceRateLimit | RefusalReason::Unavailable
        )
    }
}

impl fmt::Display for RefusalReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A call the lane did not start: why, and when a retry may succeed.
///
/// `retry_after` is exact for [`RefusalReason::WorkspaceRateLimit`] (when this
/// call's start slot leaves the rolling window) and for
/// [`RefusalReason::Unavailable`] (the time the breaker stays open).
/// For the other two it is an estimate of when a running call finishes,
/// within the lane's estimate bounds, so a retry then can be refused again.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("lane refused the call ({reason}); retry after {retry_after:?}")]
pub struct LaneRefusal {
    /// Why.
    pub reason: RefusalReason,
    /// When a retry may succeed.
    pub retry_after: Duration,
}

impl LaneRefusal {
    /// `retry_after` in whole seconds, rounded up (at least 1): what a
    /// `Retry-After` header and `details.retry_after_seconds` say.
    pub fn retry_after_secs(&self) -> u64 {
        let d = self.retry_after;
        let secs = d.as_secs() + u64::from(d.subsec_nanos() > 0);
        secs.max(1)
    }
}

/// How a call that held a place ended, as the breaker counts it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// The upstream answered (any status below 500).
    Success,
    /// The upstream failed: a 5xx, a refused connection or a timeout.
    Failure,
}
