//! A lane on a shared ledger: each place confirmed by a lease, the keeper that
//! renews leases, and the holds what the ledger said leaves.

use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio::time::Instant;

use crate::leases::{Asked, Leases, OnEnd};
use crate::ledger::LeaseKind;
use crate::refusal::{LaneRefusal, RefusalReason};

use super::{Confirmed, Grant, Hold, Lane, LanePermit, Shared, State};

impl Lane {
    /// Turns a place this lane's count gave into a permit: at once without a
    /// ledger, else once the ledger leases it. Held elsewhere, the call goes
    /// back in line as `line_ticket` (or is refused when its wait is over).
    pub(super) async fn confirm(
        &self,
        workspace: &str,
        grant: Grant,
        line_ticket: u64,
        deadline: Instant,
    ) -> Result<Confirmed, LaneRefusal> {
        let mut slot = self.slot(workspace, grant);
        let Some(leases) = &self.shared.leases else {
            return Ok(Confirmed::Permit(LanePermit { slot }));
        };
        self.start_keeper(leases);
        // Until the lease is had, a drop gives the place and its start back.
        slot.unsent = true;
        let limits = self.shared.state.lock().limits_of(workspace);
        let asked = leases.take(workspace, limits, LeaseKind::Single).await;
        let now = Instant::now();
        match asked {
            Asked::Leased(held) => {
                leases.hold(slot.ticket, held);
                slot.unsent = false;
                self.shared.state.lock().leased(workspace, false);
                Ok(Confirmed::Permit(LanePermit { slot }))
            }
            Asked::Unavailable => {
                slot.give_back_as(None, true);
                Err(LaneRefusal {
                    reason: RefusalReason::LedgerUnavailable,
                    retry_after: Duration::from_secs(1),
                })
            }
            Asked::Refused {
                reason,
                retry_after,
                may_free,
            } => {
                let mut state = self.shared.state.lock();
                let retry = self.shared.config.lease_retry;
                state.held_elsewhere(workspace, reason, retry_after, may_free, retry, now);
                slot.shared = None;
                state.release_as(slot.ticket, None, now, true);
                // Refused at once only when no start counted may still be given back.
                let slot_too_late = reason == RefusalReason::WorkspaceRateLimit
                    && !may_free
                    && retry_after.is_some_and(|r| now + r > deadline);
                let answer = if now >= deadline || slot_too_late {
                    let ahead = state.ahead_of(line_ticket, workspace);
                    let refusal = state.refusal(workspace, ahead, now);
                    state.forget_if_idle(workspace, now);
                    Err(refusal)
                } else {
                    let rx = state.requeue(line_ticket, workspace);
                    Ok(Confirmed::Requeued(line_ticket, rx))
                };
                drop(state);
                self.shared.batch_capacity.notify_waiters();
                answer
            }
        }
    }

    /// Starts the task that renews and gives back this lane's leases.
    pub(super) fn start_keeper(&self, leases: &Leases) {
        leases.start_keeper(|| {
            let lane: Weak<Shared> = Arc::downgrade(&self.shared);
            let on_end: OnEnd = Box::new(move |lease, cancelled| {
                if let Some(shared) = lane.upgrade() {
                    shared.lease_ended(lease, cancelled);
                }
            });
            on_end
        });
    }
}

impl State {
    /// A lease was had: what the ledger said before no longer holds.
    pub(super) fn leased(&mut self, workspace: &str, batch: bool) {
        if batch {
            self.remote_batch_busy = None;
        } else {
            self.remote_busy = None;
            if let Some(ws) = self.workspaces.get_mut(workspace) {
                ws.remote = None;
            }
        }
    }

    /// The shared ledger refused a call of `workspace` for `reason`: hold
    /// its scope until the next time to ask (exactly when a start frees, for
    /// the start limit, or sooner when a start counted `may_free`; `retry`
    /// later otherwise).
    pub(super) fn held_elsewhere(
        &mut self,
        workspace: &str,
        reason: RefusalReason,
        retry_after: Option<Duration>,
        may_free: bool,
        retry: Duration,
        now: Instant,
    ) {
        match reason {
            RefusalReason::WorkspaceInFlightLimit | RefusalReason::WorkspaceRateLimit => {
                let exact = match (reason, retry_after) {
                    (RefusalReason::WorkspaceRateLimit, Some(exact)) => {
                        Some(exact.max(Duration::from_millis(1)))
                    }
                    _ => None,
                };
                let wait = match exact {
                    Some(exact) if may_free => exact.min(retry),
                    Some(exact) => exact,
                    None => retry,
                };
                let key = self.key(workspace);
                self.entry(key).remote = Some(Hold {
                    reason,
                    until: now + wait,
                    retry_at: now + exact.unwrap_or(wait),
                });
            }
            _ => self.remote_busy = Some(now + retry),
        }
    }
}
