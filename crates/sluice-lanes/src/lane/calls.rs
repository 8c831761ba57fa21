//! Running calls: starting and releasing places, the mean call duration, and
//! the permit a single call holds.

use std::sync::Arc;
use std::time::Duration;

use sluice_core::BreakerState;
use tokio::time::Instant;

use crate::refusal::Outcome;

use super::{DURATION_WEIGHT, Grant, Lane, Running, Shared, State};

impl Lane {
    pub(super) fn slot(&self, workspace: &str, grant: Grant) -> Slot {
        Slot {
            shared: Some(Arc::clone(&self.shared)),
            ticket: grant.ticket,
            probe: grant.probe,
            workspace: workspace.into(),
            started: Instant::now(),
            unsent: false,
        }
    }
}

impl State {
    /// Counts a call as started and running; returns its ticket.
    pub(super) fn start(&mut self, key: &Arc<str>, now: Instant, batch: bool, probe: bool) -> u64 {
        let ticket = self.ticket();
        self.running.insert(
            ticket,
            Running {
                workspace: Arc::clone(key),
                started: now,
                batch,
            },
        );
        let ws = self.entry(Arc::clone(key));
        if batch {
            ws.batch_running += 1;
            self.batch_running += 1;
        } else {
            ws.running += 1;
            ws.starts.push_back(now);
        }
        if probe {
            self.probe = Some(ticket);
        }
        ticket
    }

    /// Gives a place back. A ticket that holds no place (already released)
    /// changes nothing, so a place is never released twice.
    pub(super) fn release(&mut self, ticket: u64, outcome: Option<Outcome>, now: Instant) {
        self.release_as(ticket, outcome, now, false);
    }

    /// [`State::release`]; with `unstart`, the call was never sent, so its start
    /// leaves the rolling window too.
    pub(super) fn release_as(
        &mut self,
        ticket: u64,
        outcome: Option<Outcome>,
        now: Instant,
        unstart: bool,
    ) {
        let Some(run) = self.running.remove(&ticket) else {
            return;
        };
        if let Some(ws) = self.workspaces.get_mut(&run.workspace) {
            if run.batch {
                ws.batch_running = ws.batch_running.saturating_sub(1);
            } else {
                ws.running = ws.running.saturating_sub(1);
                if unstart && let Some(at) = ws.starts.iter().rposition(|&s| s == run.started) {
                    ws.starts.remove(at);
                }
            }
        }
        if run.batch {
            self.batch_running = self.batch_running.saturating_sub(1);
        }
        let was_probe = self.probe == Some(ticket);
        if was_probe {
            self.probe = None;
        }
        let ts = self.timestamp(now);
        match outcome {
            Some(outcome) => {
                self.observe(now.saturating_duration_since(run.started));
                if outcome == Outcome::Success {
                    self.successes = self.successes.wrapping_add(1);
                }
                if run.batch {
                    // A batch item never counts toward the failure streak, so
                    // one workspace's poison items cannot shut the lane for
                    // the others (they back off on their own). As the probe,
                    // its success closes the breaker; its failure hands the
                    // probe back (open, time up): the next single call probes
                    // at once, the next batch item only after `open_for`.
                    if was_probe {
                        match outcome {
                            Outcome::Success => self.breaker.success(),
                            Outcome::Failure => self.breaker.probe_abandoned(ts),
                        }
                    }
                } else if was_probe || self.breaker.state() == BreakerState::Closed {
                    // Only the probe speaks while the breaker is not closed: the
                    // late answer of a call sent before it opened decides nothing.
                    match outcome {
                        Outcome::Success => self.breaker.success(),
                        Outcome::Failure => self.breaker.failure(ts),
                    }
                }
            }
            None if was_probe => self.breaker.probe_abandoned(ts),
            None => {}
        }
        if let Some(refusal) = self.breaker_refusal(now) {
            // Nothing will be sent while it is open: tell the line now
            // rather than at the end of its wait.
            self.refuse_line(refusal);
        }
        self.dispatch(now);
        self.forget_if_idle(&run.workspace, now);
    }

    pub(super) fn observe(&mut self, took: Duration) {
        self.mean_duration = Some(match self.mean_duration {
            None => took,
            Some(mean) => mean.mul_f64(1.0 - DURATION_WEIGHT) + took.mul_f64(DURATION_WEIGHT),
        });
    }
}

/// A place held by one call; gives it back exactly once.
pub(super) struct Slot {
    pub(super) shared: Option<Arc<Shared>>,
    pub(super) ticket: u64,
    pub(super) probe: bool,
    pub(super) workspace: Box<str>,
    pub(super) started: Instant,
    /// Its lease is not had yet: given back, its start goes too.
    pub(super) unsent: bool,
}

impl Slot {
    pub(super) fn give_back(&mut self, outcome: Option<Outcome>) {
        self.give_back_as(outcome, false);
    }

    pub(super) fn give_back_as(&mut self, outcome: Option<Outcome>, unstart: bool) {
        if let Some(shared) = self.shared.take() {
            shared
                .state
                .lock()
                .release_as(self.ticket, outcome, Instant::now(), unstart);
            if let Some(leases) = &shared.leases {
                leases.end(self.ticket, unstart);
            }
            shared.batch_capacity.notify_waiters();
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.give_back_as(None, self.unsent);
    }
}

/// A place for one single call. Report how the call ended with
/// [`LanePermit::finish`]; dropping the permit instead (client gone, task
/// cancelled, panic) gives the place back and tells the breaker nothing.
#[must_use = "the place is given back when the permit is dropped"]
pub struct LanePermit {
    pub(super) slot: Slot,
}

impl std::fmt::Debug for LanePermit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LanePermit")
            .field("workspace", &self.slot.workspace)
            .field("probe", &self.slot.probe)
            .finish_non_exhaustive()
    }
}

impl LanePermit {
    /// The call ended: give the place back, feed the breaker (an upstream 5xx,
    /// refused connection or timeout is [`Outcome::Failure`]) and the estimate
    /// of call durations.
    pub fn finish(mut self, outcome: Outcome) {
        self.slot.give_back(Some(outcome));
    }

    /// The call was never sent (another limit refused it after it got its
    /// place): the place goes back and its start leaves the rolling window, as
    /// if it had never been taken. The breaker hears nothing.
    pub fn cancel(mut self) {
        self.slot.give_back_as(None, true);
    }

    /// The workspace the place counts for.
    pub fn workspace(&self) -> &str {
        &self.slot.workspace
    }

    /// Whether this call is the breaker's half-open probe: its outcome closes
    /// or re-opens the breaker.
    pub fn is_probe(&self) -> bool {
        self.slot.probe
    }

    /// When the call got its place.
    pub fn started_at(&self) -> Instant {
        self.slot.started
    }
}
