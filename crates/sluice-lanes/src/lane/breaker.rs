//! The breaker: refusing calls while it is open, and when batch items may go
//! again (single calls probe first).

use std::time::Duration;

use sluice_core::{BreakerState, Permit};
use tokio::time::Instant;

use crate::refusal::{LaneRefusal, RefusalReason};

use super::State;

impl State {
    /// The refusal for any call while the breaker refuses calls, without
    /// changing the breaker.
    pub(super) fn breaker_refusal(&self, now: Instant) -> Option<LaneRefusal> {
        match self.breaker.clone().permit(self.timestamp(now)) {
            Permit::Refused { retry_after } => Some(unavailable(retry_after)),
            Permit::Call | Permit::Probe => None,
        }
    }

    /// Until when the breaker keeps batch items back (`None`: they may go).
    ///
    /// Single calls probe first: once the open time is up, the next single
    /// call is the probe. A batch item may be the probe only when no single
    /// call took it within a further `open_for` (no single call is arriving),
    /// and never while a probe is out (until that probe is stale for single
    /// calls too, and another `open_for` has passed).
    pub(super) fn batch_breaker_wait(&self, now: Instant) -> Option<Instant> {
        let ts = self.timestamp(now);
        let grace = self.config.breaker.open_for;
        let from = match self.breaker.state() {
            BreakerState::Closed => return None,
            BreakerState::Open { until } => until.saturating_add(grace),
            BreakerState::HalfOpen { since } => since.saturating_add(grace).saturating_add(grace),
        };
        let left = from.saturating_since(ts);
        if left.is_zero() && self.breaker_refusal(now).is_none() {
            None
        } else {
            // At least a moment: a probe still out may report meanwhile.
            Some(now + left.max(Duration::from_millis(1)))
        }
    }
}

pub(super) fn unavailable(retry_after: Duration) -> LaneRefusal {
    LaneRefusal {
        reason: RefusalReason::Unavailable,
        retry_after,
    }
}
