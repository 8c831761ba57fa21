//! Batch capacity: places for batch items, taken only where single calls leave
//! room, and the permit a batch item holds.

use sluice_core::Permit;
use tokio::time::{Instant, sleep_until};

use crate::leases::Asked;
use crate::ledger::LeaseKind;
use crate::refusal::Outcome;

use super::{Grant, Lane, Slot, State};

impl Lane {
    /// Takes a place for one batch item of `workspace` if there is one now.
    ///
    /// A batch item runs only on capacity single calls are not using: never
    /// while a single call waits for a place of the global cap, never beyond
    /// `global_cap - batch_reserve` batch items at once, and never while the
    /// breaker is open or its probe is out. Single calls probe first: a batch
    /// item may be the probe only when the breaker's time has been up for a
    /// further `open_for` with no single call taking the probe. A batch item's
    /// outcome never counts toward the breaker's failure streak (one
    /// workspace's poison items cannot shut the lane for the others); as the
    /// probe, its success closes the breaker and its failure hands the probe
    /// back. Batch items count toward the global cap only, not toward the
    /// workspace's limits.
    ///
    /// On a lane with a shared ledger this always answers `None` (a lease
    /// cannot be had without waiting for the ledger): use
    /// [`Lane::acquire_batch`].
    pub fn try_acquire_batch(&self, workspace: &str) -> Option<BatchPermit> {
        if self.shared.leases.is_some() {
            return None;
        }
        let now = Instant::now();
        let grant = self.shared.state.lock().start_batch(workspace, now)?;
        Some(BatchPermit {
            slot: self.slot(workspace, grant),
        })
    }

    /// Among `candidates` (workspaces with batch items queued, in the order
    /// the caller prefers for ties, e.g. oldest queued item first), the one
    /// with the fewest batch items running: whose turn it is.
    pub fn next_batch_workspace<'a>(&self, candidates: &[&'a str]) -> Option<&'a str> {
        let state = self.shared.state.lock();
        candidates
            .iter()
            .enumerate()
            .min_by_key(|(i, w)| {
                let running = state.workspaces.get(**w).map_or(0, |ws| ws.batch_running);
                (running, *i)
            })
            .map(|(_, w)| *w)
    }

    /// Picks whose turn it is among `candidates` (see
    /// [`Lane::next_batch_workspace`]) and takes a place for one of its batch
    /// items, in one step. Returns the index of the chosen candidate.
    ///
    /// On a lane with a shared ledger this always answers `None`: use
    /// [`Lane::acquire_next_batch`].
    pub fn try_acquire_next_batch(&self, candidates: &[&str]) -> Option<(usize, BatchPermit)> {
        if self.shared.leases.is_some() {
            return None;
        }
        let now = Instant::now();
        let mut state = self.shared.state.lock();
        let (index, workspace) = candidates.iter().enumerate().min_by_key(|(i, w)| {
            let running = state.workspaces.get(**w).map_or(0, |ws| ws.batch_running);
            (running, *i)
        })?;
        let grant = state.start_batch(workspace, now)?;
        drop(state);
        Some((
            index,
            BatchPermit {
                slot: self.slot(workspace, grant),
            },
        ))
    }

    /// [`Lane::try_acquire_batch`] on any lane: on a lane with a shared
    /// ledger, the place is also leased there (a lease refused because
    /// other replicas fill the caps answers `None`, and batch items wait
    /// [`LaneConfig::lease_retry`](crate::LaneConfig::lease_retry) before asking again; so does an
    /// unreachable ledger unless the lane fails open).
    pub async fn acquire_batch(&self, workspace: &str) -> Option<BatchPermit> {
        let now = Instant::now();
        let grant = self.shared.state.lock().start_batch(workspace, now)?;
        self.confirm_batch(workspace, grant).await
    }

    /// [`Lane::try_acquire_next_batch`] on any lane, leasing the place as
    /// [`Lane::acquire_batch`] does.
    pub async fn acquire_next_batch(&self, candidates: &[&str]) -> Option<(usize, BatchPermit)> {
        let now = Instant::now();
        let (index, workspace, grant) = {
            let mut state = self.shared.state.lock();
            let (index, workspace) = candidates.iter().enumerate().min_by_key(|(i, w)| {
                let running = state.workspaces.get(**w).map_or(0, |ws| ws.batch_running);
                (running, *i)
            })?;
            (index, *workspace, state.start_batch(workspace, now)?)
        };
        let permit = self.confirm_batch(workspace, grant).await?;
        Some((index, permit))
    }

    pub(super) async fn confirm_batch(&self, workspace: &str, grant: Grant) -> Option<BatchPermit> {
        let mut slot = self.slot(workspace, grant);
        let Some(leases) = &self.shared.leases else {
            return Some(BatchPermit { slot });
        };
        self.start_keeper(leases);
        slot.unsent = true;
        let asked = leases
            .take(
                workspace,
                self.shared.config.workspace_limits(),
                LeaseKind::Batch,
            )
            .await;
        match asked {
            Asked::Leased(held) => {
                leases.hold(slot.ticket, held);
                slot.unsent = false;
                self.shared.state.lock().leased(workspace, true);
                Some(BatchPermit { slot })
            }
            Asked::Refused { .. } | Asked::Unavailable => {
                let now = Instant::now();
                self.shared.state.lock().remote_batch_busy =
                    Some(now + self.shared.config.lease_retry);
                slot.give_back_as(None, true);
                None
            }
        }
    }

    /// Resolves when a batch item might find a place: at once if one is free
    /// now, else when a place is released, a single call leaves the line or
    /// the breaker's open time is up. Another taker may be quicker, so follow
    /// it with [`Lane::try_acquire_batch`] and wait again if that fails.
    pub async fn batch_capacity(&self) {
        loop {
            let notified = self.shared.batch_capacity.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let now = Instant::now();
            let breaker_until = {
                let state = self.shared.state.lock();
                if state.batch_place_free(now) {
                    return;
                }
                let remote = [state.remote_busy, state.remote_batch_busy]
                    .into_iter()
                    .flatten()
                    .filter(|until| *until > now)
                    .max();
                match (state.batch_breaker_wait(now), remote) {
                    (Some(a), Some(b)) => Some(a.max(b)),
                    (a, b) => a.or(b),
                }
            };
            match breaker_until {
                Some(until) => {
                    tokio::select! {
                        () = &mut notified => {}
                        () = sleep_until(until) => {}
                    }
                }
                None => notified.await,
            }
        }
    }
}

impl State {
    pub(super) fn batch_place_free(&self, now: Instant) -> bool {
        self.global_open(now)
            && self.remote_batch_busy.is_none_or(|until| until <= now)
            && self.batch_running < self.config.batch_cap()
            && !self.single_waits_for_global(now)
            && self.batch_breaker_wait(now).is_none()
    }

    pub(super) fn start_batch(&mut self, workspace: &str, now: Instant) -> Option<Grant> {
        self.dispatch(now);
        if !self.batch_place_free(now) {
            return None;
        }
        let probe = match self.breaker.permit(self.timestamp(now)) {
            Permit::Call => false,
            Permit::Probe => true,
            Permit::Refused { .. } => return None,
        };
        let key = self.key(workspace);
        let ticket = self.start(&key, now, true, probe);
        Some(Grant { ticket, probe })
    }
}

/// A place for one batch item (counted toward the global cap only). Like
/// [`LanePermit`](crate::LanePermit): [`BatchPermit::finish`] reports the outcome, a drop gives
/// the place back without one.
#[must_use = "the place is given back when the permit is dropped"]
pub struct BatchPermit {
    slot: Slot,
}

impl std::fmt::Debug for BatchPermit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchPermit")
            .field("workspace", &self.slot.workspace)
            .field("probe", &self.slot.probe)
            .finish_non_exhaustive()
    }
}

impl BatchPermit {
    /// The item ended: give the place back and feed the breaker and the
    /// estimate of call durations.
    pub fn finish(mut self, outcome: Outcome) {
        self.slot.give_back(Some(outcome));
    }

    /// The workspace whose batch the item belongs to.
    pub fn workspace(&self) -> &str {
        &self.slot.workspace
    }

    /// Whether this item is the breaker's half-open probe.
    pub fn is_probe(&self) -> bool {
        self.slot.probe
    }

    /// When the item got its place.
    pub fn started_at(&self) -> Instant {
        self.slot.started
    }
}
