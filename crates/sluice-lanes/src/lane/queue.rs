//! The waiting line: a single call's arrival, its wait in line, and the fair
//! hand-off of freed places to waiters.

use std::sync::Arc;
use std::time::Duration;

use sluice_core::Permit;
use tokio::sync::oneshot;
use tokio::time::{Instant, sleep_until};

use crate::config::WorkspaceLimits;
use crate::refusal::{LaneRefusal, RefusalReason};

use super::{
    Arrival, Confirmed, Grant, Hold, LONGEST_WAIT, Lane, LanePermit, State, Waiter, Workspace,
    live_count, live_starts, prune, unavailable, ws_has_room,
};

impl Lane {
    /// Takes a place for one single call of `workspace`, waiting in line up
    /// to `max_wait` when a limit holds it.
    ///
    /// A call starts at once when its workspace is under both of its limits,
    /// none of its workspace's calls waits before it and the global cap has a
    /// free place. Otherwise it waits; when the global cap frees a place, the
    /// waiting workspace with the fewest calls running gets it (ties: the one
    /// whose call has waited longest); within a workspace calls go in order.
    ///
    /// Refused at once, without waiting: while the breaker is open or its
    /// probe is out ([`RefusalReason::Unavailable`], retry-after =
    /// the time it stays open); when the line (or the workspace's share of
    /// it) is full; when `max_wait` is zero; and when the workspace's start
    /// limit would hold the call longer than `max_wait` (its exact start slot
    /// is known, so holding it only to refuse it later would waste its wait).
    ///
    /// Dropping the returned future leaves the line at once; a place handed
    /// to it in the meantime goes to the next waiter.
    ///
    /// # Errors
    /// [`LaneRefusal`] with the limit that held the call and when a retry may
    /// succeed.
    pub async fn acquire(
        &self,
        workspace: &str,
        max_wait: Duration,
    ) -> Result<LanePermit, LaneRefusal> {
        let limits = self.shared.config.workspace_limits();
        self.acquire_within(workspace, limits, max_wait).await
    }

    /// [`Lane::acquire`] for a workspace with limits of its own (e.g. from its
    /// plan) instead of the lane's: at most `limits.in_flight` of its single
    /// calls run at once and `limits.starts` start in any start window, here
    /// and, on a shared lane, across every replica. The global cap, the line
    /// and the breaker are the lane's, as for every call.
    ///
    /// A workspace's calls are held to the limits its latest call brought, so
    /// a change (a new plan) applies to the calls waiting too.
    ///
    /// # Errors
    /// As [`Lane::acquire`].
    pub async fn acquire_within(
        &self,
        workspace: &str,
        limits: WorkspaceLimits,
        max_wait: Duration,
    ) -> Result<LanePermit, LaneRefusal> {
        let max_wait = max_wait.min(LONGEST_WAIT);
        let arrived = Instant::now();
        let deadline = arrived + max_wait;
        let arrival = self
            .shared
            .state
            .lock()
            .arrive(workspace, limits, arrived, max_wait);
        let (mut ticket, mut rx) = match arrival {
            // A call that started at once stands in line, if it must, by the
            // ticket it got on arrival.
            Ok(Arrival::Started(grant)) => {
                match self
                    .confirm(workspace, grant, grant.ticket, deadline)
                    .await?
                {
                    Confirmed::Permit(permit) => return Ok(permit),
                    Confirmed::Requeued(ticket, rx) => (ticket, rx),
                }
            }
            Ok(Arrival::Queued(ticket, rx)) => (ticket, rx),
            Err(refusal) => {
                self.shared.batch_capacity.notify_waiters();
                return Err(refusal);
            }
        };
        loop {
            let grant = self.wait_in_line(workspace, ticket, rx, deadline).await?;
            match self.confirm(workspace, grant, ticket, deadline).await? {
                Confirmed::Permit(permit) => return Ok(permit),
                Confirmed::Requeued(t, r) => (ticket, rx) = (t, r),
            }
        }
    }

    /// Waits in line as `ticket` until a place is handed over or the wait
    /// is over.
    pub(super) async fn wait_in_line(
        &self,
        workspace: &str,
        ticket: u64,
        rx: oneshot::Receiver<Result<Grant, LaneRefusal>>,
        deadline: Instant,
    ) -> Result<Grant, LaneRefusal> {
        let mut wait = WaitGuard {
            lane: self,
            ticket,
            rx,
            done: false,
        };
        loop {
            let wake = self.shared.state.lock().wake_at(ticket, deadline);
            tokio::select! {
                biased;
                answer = &mut wait.rx => {
                    wait.done = true;
                    return match answer {
                        Ok(answer) => answer,
                        // The lane never drops a waiter's sender without answering.
                        Err(_) => Err(self.shared.state.lock().refusal(workspace, 0, Instant::now())),
                    };
                }
                () = sleep_until(wake) => {
                    let now = Instant::now();
                    let mut state = self.shared.state.lock();
                    state.dispatch(now);
                    if now >= deadline && state.line.contains_key(&ticket) {
                        let ahead = state.ahead_of(ticket, workspace);
                        state.leave_line(ticket);
                        let refusal = state.refusal(workspace, ahead, now);
                        state.forget_if_idle(workspace, now);
                        wait.done = true;
                        drop(state);
                        self.shared.batch_capacity.notify_waiters();
                        return Err(refusal);
                    }
                }
            }
        }
    }
}

/// Leaves the line when an `acquire` future is dropped while waiting.
pub(super) struct WaitGuard<'a> {
    pub(super) lane: &'a Lane,
    pub(super) ticket: u64,
    pub(super) rx: oneshot::Receiver<Result<Grant, LaneRefusal>>,
    pub(super) done: bool,
}

impl Drop for WaitGuard<'_> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let now = Instant::now();
        let mut state = self.lane.shared.state.lock();
        if let Some(waiter) = state.leave_line(self.ticket) {
            state.forget_if_idle(&waiter.workspace, now);
        } else if let Ok(Ok(grant)) = self.rx.try_recv() {
            // A place was handed over just before the waiter went away.
            state.release(grant.ticket, None, now);
        }
        drop(state);
        self.lane.shared.batch_capacity.notify_waiters();
    }
}

impl State {
    /// A new single call: start it, queue it or refuse it.
    pub(super) fn arrive(
        &mut self,
        workspace: &str,
        limits: WorkspaceLimits,
        now: Instant,
        max_wait: Duration,
    ) -> Result<Arrival, LaneRefusal> {
        self.dispatch(now);
        self.sweep(now);
        if let Some(refusal) = self.breaker_refusal(now) {
            return Err(refusal);
        }
        let key = self.key(workspace);
        let raised = {
            let ws = self
                .workspaces
                .entry(Arc::clone(&key))
                .or_insert_with(|| Workspace::new(limits));
            let raised = limits.in_flight > ws.limits.in_flight || limits.starts > ws.limits.starts;
            ws.limits = limits;
            raised
        };
        if raised {
            // Its calls already waiting may start under the new limits.
            self.dispatch(now);
        }
        let (ahead, free_here) = {
            let window = self.config.start_window;
            let ws = self
                .workspaces
                .entry(Arc::clone(&key))
                .or_insert_with(|| Workspace::new(limits));
            prune(&mut ws.starts, now, window);
            (ws.waiting, ws.waiting == 0 && ws_has_room(ws, window, now))
        };
        if free_here && self.global_open(now) {
            let probe = match self.breaker.permit(self.timestamp(now)) {
                Permit::Call => false,
                Permit::Probe => true,
                Permit::Refused { retry_after } => {
                    self.forget_if_idle(workspace, now);
                    return Err(unavailable(retry_after));
                }
            };
            let ticket = self.start(&key, now, false, probe);
            return Ok(Arrival::Started(Grant { ticket, probe }));
        }
        let line_full = self.line.len() >= self.config.max_waiting
            || usize::try_from(ahead).unwrap_or(usize::MAX)
                >= self.config.max_waiting_per_workspace;
        let held_until = self.workspaces.get(workspace).and_then(|ws| {
            ws.remote
                .filter(|h| h.reason == RefusalReason::WorkspaceRateLimit)
                .map(|h| h.until)
        });
        let slot_too_late = self
            .rate_slot(workspace, ahead, now)
            .into_iter()
            .chain(held_until)
            .any(|slot| slot.saturating_duration_since(now) > max_wait);
        if max_wait.is_zero() || line_full || slot_too_late {
            let refusal = self.refusal(workspace, ahead, now);
            self.forget_if_idle(workspace, now);
            return Err(refusal);
        }
        let ticket = self.ticket();
        let (tx, rx) = oneshot::channel();
        self.line.insert(
            ticket,
            Waiter {
                workspace: Arc::clone(&key),
                tx,
            },
        );
        if let Some(ws) = self.workspaces.get_mut(workspace) {
            ws.waiting += 1;
        }
        Ok(Arrival::Queued(ticket, rx))
    }

    /// Puts a call back in line as `ticket` (where it stood), after the
    /// ledger refused the place it was given.
    pub(super) fn requeue(
        &mut self,
        ticket: u64,
        workspace: &str,
    ) -> oneshot::Receiver<Result<Grant, LaneRefusal>> {
        let key = self.key(workspace);
        let (tx, rx) = oneshot::channel();
        self.entry(Arc::clone(&key)).waiting += 1;
        self.line.insert(ticket, Waiter { workspace: key, tx });
        rx
    }

    /// Hands free places of the global cap to waiters: the workspace with the
    /// fewest single calls running first, ties by the longest wait; in order
    /// within a workspace.
    pub(super) fn dispatch(&mut self, now: Instant) {
        while !self.line.is_empty() && self.global_open(now) {
            let Some(ticket) = self.next_waiter(now) else {
                return;
            };
            let probe = match self.breaker.permit(self.timestamp(now)) {
                Permit::Call => false,
                Permit::Probe => true,
                Permit::Refused { retry_after } => {
                    self.refuse_line(unavailable(retry_after));
                    return;
                }
            };
            let Some(waiter) = self.leave_line(ticket) else {
                return;
            };
            let started = self.start(&waiter.workspace, now, false, probe);
            if waiter
                .tx
                .send(Ok(Grant {
                    ticket: started,
                    probe,
                }))
                .is_err()
            {
                // Cannot happen (a waiter leaves the line before its receiver
                // goes), but a place must never leak.
                self.release(started, None, now);
            }
        }
    }

    /// The waiter a free global place goes to, if any may start.
    pub(super) fn next_waiter(&self, now: Instant) -> Option<u64> {
        let mut seen: Vec<&str> = Vec::new();
        let mut best: Option<(u32, u64)> = None;
        for (ticket, waiter) in &self.line {
            let name: &str = &waiter.workspace;
            if seen.contains(&name) {
                continue;
            }
            seen.push(name);
            let Some(ws) = self.workspaces.get(name) else {
                continue;
            };
            if !ws_has_room(ws, self.config.start_window, now) {
                continue;
            }
            if best.is_none_or(|(running, _)| ws.running < running) {
                best = Some((ws.running, *ticket));
            }
        }
        best.map(|(_, ticket)| ticket)
    }

    /// Whether some single call waits only for a place of the global cap.
    pub(super) fn single_waits_for_global(&self, now: Instant) -> bool {
        self.line.values().any(|w| {
            self.workspaces
                .get(&w.workspace)
                .is_some_and(|ws| ws_has_room(ws, self.config.start_window, now))
        })
    }

    pub(super) fn leave_line(&mut self, ticket: u64) -> Option<Waiter> {
        let waiter = self.line.remove(&ticket)?;
        if let Some(ws) = self.workspaces.get_mut(&waiter.workspace) {
            ws.waiting = ws.waiting.saturating_sub(1);
        }
        Some(waiter)
    }

    pub(super) fn refuse_line(&mut self, refusal: LaneRefusal) {
        let line = std::mem::take(&mut self.line);
        for waiter in line.into_values() {
            if let Some(ws) = self.workspaces.get_mut(&waiter.workspace) {
                ws.waiting = ws.waiting.saturating_sub(1);
            }
            // A receiver already gone has nothing to undo.
            let _ = waiter.tx.send(Err(refusal));
        }
    }

    /// Waiters of `workspace` that arrived before `ticket`.
    pub(super) fn ahead_of(&self, ticket: u64, workspace: &str) -> u32 {
        let n = self
            .line
            .range(..ticket)
            .filter(|(_, w)| &*w.workspace == workspace)
            .count();
        u32::try_from(n).unwrap_or(u32::MAX)
    }

    /// When the waiter `ticket` should look again: its deadline, or earlier
    /// when its workspace's oldest start leaves the window.
    pub(super) fn wake_at(&self, ticket: u64, deadline: Instant) -> Instant {
        let Some(waiter) = self.line.get(&ticket) else {
            return deadline;
        };
        let window = self.config.start_window;
        let now = Instant::now();
        let ws = self.workspaces.get(&waiter.workspace);
        let slot = ws.and_then(|ws| {
            let limit = ws.limits.starts.get() as usize;
            let live = live_count(&ws.starts, now, window);
            (live >= limit).then(|| {
                live_starts(&ws.starts, now, window)
                    .next()
                    .map(|s| *s + window)
            })?
        });
        // When a hold of the shared ledger ends: time to ask again.
        let held = ws.and_then(|ws| ws.remote.map(|h| h.until));
        [slot, held, self.remote_busy]
            .into_iter()
            .flatten()
            .filter(|at| *at > now)
            .fold(deadline, Instant::min)
    }

    /// When a call of `workspace` with `ahead` of its workspace's calls before
    /// it gets a start slot, if the start limit holds it.
    pub(super) fn rate_slot(&self, workspace: &str, ahead: u32, now: Instant) -> Option<Instant> {
        let window = self.config.start_window;
        let ws = self.workspaces.get(workspace)?;
        let limit = ws.limits.starts.get() as usize;
        let need = live_count(&ws.starts, now, window) + ahead as usize;
        if need < limit {
            return None;
        }
        // The call starts once `need - limit + 1` of the live starts have
        // left; later ones are not known yet, so count a whole window.
        Some(
            live_starts(&ws.starts, now, window)
                .nth(need - limit)
                .map_or(now + window, |s| *s + window),
        )
    }

    /// Why a call of `workspace` (with `ahead` of its workspace's calls before
    /// it) cannot start now, and when a retry may succeed: the limit that
    /// holds it longest.
    pub(super) fn refusal(&self, workspace: &str, ahead: u32, now: Instant) -> LaneRefusal {
        let mut worst: Option<LaneRefusal> = None;
        let mut consider = |reason, retry_after| {
            if worst.is_none_or(|w: LaneRefusal| retry_after > w.retry_after) {
                worst = Some(LaneRefusal {
                    reason,
                    retry_after,
                });
            }
        };
        if let Some(slot) = self.rate_slot(workspace, ahead, now) {
            consider(
                RefusalReason::WorkspaceRateLimit,
                slot.saturating_duration_since(now),
            );
        }
        let running_here = self.workspaces.get(workspace).map_or(0, |ws| ws.running);
        if running_here.saturating_add(ahead) >= self.limits_of(workspace).in_flight.get() {
            consider(
                RefusalReason::WorkspaceInFlightLimit,
                self.estimate(Some(workspace), now),
            );
        }
        if !self.global_has_room() || self.remote_busy.is_some() {
            consider(RefusalReason::Busy, self.estimate(None, now));
        }
        // What the shared ledger said last.
        match self.workspaces.get(workspace).and_then(|ws| ws.remote) {
            Some(Hold {
                reason: RefusalReason::WorkspaceRateLimit,
                retry_at,
                ..
            }) => consider(
                RefusalReason::WorkspaceRateLimit,
                retry_at.saturating_duration_since(now),
            ),
            Some(Hold { reason, .. }) => consider(reason, self.estimate(Some(workspace), now)),
            None => {}
        }
        worst.unwrap_or(LaneRefusal {
            reason: RefusalReason::Busy,
            retry_after: self.estimate(None, now),
        })
    }

    /// The estimated time until the earliest running call (of `workspace`'s
    /// single calls, or of all calls) finishes, from the moving average of
    /// finished calls' durations, within the configured bounds.
    pub(super) fn estimate(&self, workspace: Option<&str>, now: Instant) -> Duration {
        let mean = self.mean_duration.unwrap_or(self.config.expected_duration);
        let earliest = self
            .running
            .values()
            .filter(|r| workspace.is_none_or(|w| !r.batch && &*r.workspace == w))
            .map(|r| r.started)
            .min();
        let left = earliest.map_or(Duration::ZERO, |started| {
            (started + mean).saturating_duration_since(now)
        });
        left.clamp(
            self.config.min_retry_estimate,
            self.config.max_retry_estimate,
        )
    }
}
