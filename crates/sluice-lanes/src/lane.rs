//! The lane: admission, the waiting line, fair hand-off, the breaker and
//! batch capacity, all under one lock that is never held across an `.await`.
//!
//! A freed place is handed to the next waiter directly (counted on its behalf
//! under the lock, then sent through the waiter's channel), so a newcomer can
//! never overtake a waiter that a place was freed for, and a waiter that goes
//! away after its place was handed over gives it straight back.
//!
//! On a lane with a shared ledger, a place this lane's own count lets start
//! is confirmed by a lease before its permit is handed out. A refused lease
//! gives the local place (and its start) back, puts the call back in line
//! where it stood, and remembers what the ledger said as a *hold* (the whole
//! lane when the global cap is full elsewhere, one workspace for its limits)
//! until the next time to ask: nobody of that scope starts or asks before
//! then, so the ledger is asked a bounded number of times per interval.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;
use sluice_core::{Breaker, BreakerState, Permit, Timestamp};
use tokio::sync::{Notify, oneshot};
use tokio::time::{Instant, sleep_until};

use crate::config::{ConfigError, LaneConfig, WorkspaceLimits};
use crate::leases::{Asked, Leases, OnEnd};
use crate::ledger::{Lease, LeaseKind, Ledger, LedgerOutage};
use crate::refusal::{LaneRefusal, Outcome, RefusalReason};
use crate::snapshot::{BreakerStatus, LaneSnapshot, WorkspaceSnapshot};

/// The weight of the newest finished call in the moving average of call
/// durations (an exponentially weighted mean).
const DURATION_WEIGHT: f64 = 0.2;

/// The longest wait a lane counts with (about 31 years): a larger `max_wait`
/// is treated as this, so deadlines never overflow.
const LONGEST_WAIT: Duration = Duration::from_secs(1 << 30);

/// One guarded upstream: its limits, waiting line, breaker and batch capacity.
///
/// Cheap to clone: clones share one lane. See the crate docs for an example.
#[derive(Clone)]
pub struct Lane {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Lane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lane")
            .field("name", &self.shared.name)
            .field("config", &self.shared.config)
            .finish_non_exhaustive()
    }
}

struct Shared {
    name: Arc<str>,
    config: LaneConfig,
    state: Mutex<State>,
    /// Woken whenever batch capacity may have appeared.
    batch_capacity: Notify,
    /// The ledger shared with other replicas, on a lane built with one.
    leases: Option<Leases>,
}

impl Shared {
    /// The keeper gave a lease back: its scope may have room again.
    fn lease_ended(&self, lease: &Lease, cancelled: bool) {
        let now = Instant::now();
        {
            let mut state = self.state.lock();
            state.remote_busy = None;
            if lease.kind() == LeaseKind::Batch {
                state.remote_batch_busy = None;
            }
            if let Some(ws) = state.workspaces.get_mut(lease.workspace())
                && ws
                    .remote
                    .is_some_and(|h| cancelled || h.reason != RefusalReason::WorkspaceRateLimit)
            {
                ws.remote = None;
            }
            state.dispatch(now);
        }
        self.batch_capacity.notify_waiters();
    }
}

/// Everything the lock guards.
struct State {
    config: LaneConfig,
    /// Where the breaker's clock starts.
    origin: Instant,
    workspaces: HashMap<Arc<str>, Workspace>,
    /// Waiting single calls by arrival order (the key is a ticket number).
    line: BTreeMap<u64, Waiter>,
    /// Every call holding a place, single or batch, by ticket number.
    running: BTreeMap<u64, Running>,
    batch_running: u32,
    next_ticket: u64,
    breaker: Breaker,
    /// The ticket of the half-open probe that is out, if any.
    probe: Option<u64>,
    /// The moving average of finished calls' durations, once one finished.
    mean_duration: Option<Duration>,
    /// Sweep idle workspaces once the map holds this many.
    sweep_at: usize,
    /// The shared ledger found the global cap full: no single call starts or
    /// asks before then. Kept (for the refusal reason) until a lease is had.
    remote_busy: Option<Instant>,
    /// The same for batch items (the global or the batch cap).
    remote_batch_busy: Option<Instant>,
}

impl Workspace {
    fn new(limits: WorkspaceLimits) -> Self {
        Workspace {
            limits,
            running: 0,
            batch_running: 0,
            waiting: 0,
            starts: VecDeque::new(),
            remote: None,
        }
    }
}

/// What the shared ledger said when it last refused a workspace's call.
#[derive(Clone, Copy, Debug)]
struct Hold {
    reason: RefusalReason,
    /// When to ask again.
    until: Instant,
    /// For the start limit: exactly when the oldest counted start leaves the
    /// window.
    retry_at: Instant,
}

struct Workspace {
    /// Its limits: those its latest call brought (the lane's unless a call
    /// named its own).
    limits: WorkspaceLimits,
    running: u32,
    batch_running: u32,
    waiting: u32,
    /// Starts of single calls, oldest first, pruned past the window.
    starts: VecDeque<Instant>,
    /// The shared ledger's last refusal of this workspace, until a lease is had.
    remote: Option<Hold>,
}

struct Waiter {
    workspace: Arc<str>,
    tx: oneshot::Sender<Result<Grant, LaneRefusal>>,
}

struct Running {
    workspace: Arc<str>,
    started: Instant,
    batch: bool,
}

/// A place handed to a waiter.
#[derive(Clone, Copy)]
struct Grant {
    ticket: u64,
    probe: bool,
}

enum Arrival {
    Started(Grant),
    Queued(u64, oneshot::Receiver<Result<Grant, LaneRefusal>>),
}

/// A place the lane's own count gave, after asking the shared ledger.
enum Confirmed {
    Permit(LanePermit),
    /// Held elsewhere: back in line at its ticket.
    Requeued(u64, oneshot::Receiver<Result<Grant, LaneRefusal>>),
}

impl Lane {
    /// A lane called `name` (e.g. `optimizer`) with `config`.
    ///
    /// # Errors
    /// [`ConfigError`] when the configuration cannot work (see
    /// [`LaneConfig::validate`]).
    pub fn new(name: impl Into<Arc<str>>, config: LaneConfig) -> Result<Self, ConfigError> {
        Self::build(name.into(), config, None)
    }

    /// A lane whose limits hold across every replica sharing `ledger` (e.g. a
    /// `RedisLedger` on one Redis, or clones of one
    /// [`MemoryLedger`](crate::MemoryLedger) in tests), built with the same
    /// `config` on each.
    ///
    /// Each place, single or batch, is first counted by this lane as on one
    /// process, then confirmed by a lease in the ledger before its permit is
    /// handed out. A refused lease means another replica holds the place:
    /// the call gives its local place back and keeps its place in line,
    /// and the ledger is asked again [`LaneConfig::lease_retry`] later (or
    /// as soon as this lane gives a lease back, or exactly when the start
    /// limit frees a start) until the call's wait is over; then it is
    /// refused with the ledger's reason. Live leases are renewed by one task
    /// per lane each third of the ledger's TTL, and given back by it when
    /// their permit is finished, cancelled (its start goes back too) or
    /// dropped. While the ledger cannot be asked, `outage` decides (see
    /// [`LedgerOutage`]); a call dropped while its lease is being asked
    /// leaves that lease to expire within the TTL.
    ///
    /// The breaker, the waiting line and the estimates stay per replica:
    /// each replica learns from its own calls.
    ///
    /// The task starts with the first call, so the lane may be built outside
    /// a runtime; its calls must run inside one.
    ///
    /// # Errors
    /// [`ConfigError`] when the configuration cannot work, or the ledger's
    /// TTL is zero.
    pub fn with_ledger(
        name: impl Into<Arc<str>>,
        config: LaneConfig,
        ledger: impl Ledger + 'static,
        outage: LedgerOutage,
    ) -> Result<Self, ConfigError> {
        if ledger.ttl().is_zero() {
            return Err(ConfigError::Zero("lease ttl"));
        }
        let leases = Leases::new(Arc::new(ledger), &config, outage);
        Self::build(name.into(), config, Some(leases))
    }

    fn build(
        name: Arc<str>,
        config: LaneConfig,
        leases: Option<Leases>,
    ) -> Result<Self, ConfigError> {
        config.validate()?;
        let state = State {
            origin: Instant::now(),
            workspaces: HashMap::new(),
            line: BTreeMap::new(),
            running: BTreeMap::new(),
            batch_running: 0,
            next_ticket: 0,
            breaker: Breaker::new(config.breaker),
            probe: None,
            mean_duration: None,
            sweep_at: 1024,
            remote_busy: None,
            remote_batch_busy: None,
            config: config.clone(),
        };
        Ok(Lane {
            shared: Arc::new(Shared {
                name,
                config,
                state: Mutex::new(state),
                batch_capacity: Notify::new(),
                leases,
            }),
        })
    }

    /// Whether the lane's limits hold across replicas (it was built with a
    /// ledger).
    pub fn is_shared(&self) -> bool {
        self.shared.leases.is_some()
    }

    /// Leases this lane holds in its shared ledger now (0 without one).
    pub fn leases_held(&self) -> usize {
        self.shared.leases.as_ref().map_or(0, Leases::held)
    }

    /// The lane's name.
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// The lane's configuration.
    pub fn config(&self) -> &LaneConfig {
        &self.shared.config
    }

    /// The longest the upstream may take for one call: cut it there and
    /// report [`Outcome::Failure`].
    pub fn upstream_timeout(&self) -> Duration {
        self.shared.config.upstream_timeout
    }

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
    async fn wait_in_line(
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

    /// Turns a place this lane's count gave into a permit: at once without a
    /// ledger, else once the ledger leases it. Held elsewhere, the call goes
    /// back in line as `line_ticket` (or is refused when its wait is over).
    async fn confirm(
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
    fn start_keeper(&self, leases: &Leases) {
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
    /// [`LaneConfig::lease_retry`] before asking again; so does an
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

    async fn confirm_batch(&self, workspace: &str, grant: Grant) -> Option<BatchPermit> {
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

    /// What the lane holds now: for `/status`, `/metrics` and dashboards.
    pub fn snapshot(&self) -> LaneSnapshot {
        let now = Instant::now();
        let mut state = self.shared.state.lock();
        state.snapshot(&self.shared.name, now)
    }

    fn slot(&self, workspace: &str, grant: Grant) -> Slot {
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

/// Leaves the line when an `acquire` future is dropped while waiting.
struct WaitGuard<'a> {
    lane: &'a Lane,
    ticket: u64,
    rx: oneshot::Receiver<Result<Grant, LaneRefusal>>,
    done: bool,
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
    fn timestamp(&self, now: Instant) -> Timestamp {
        let nanos = now.saturating_duration_since(self.origin).as_nanos();
        Timestamp::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
    }

    fn instant(&self, t: Timestamp) -> Instant {
        self.origin + Duration::from_nanos(t.as_nanos())
    }

    /// A new single call: start it, queue it or refuse it.
    fn arrive(
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

    /// The limits `workspace`'s calls are held to now.
    fn limits_of(&self, workspace: &str) -> WorkspaceLimits {
        self.workspaces
            .get(workspace)
            .map_or_else(|| self.config.workspace_limits(), |ws| ws.limits)
    }

    /// The entry of `key`, made with the lane's limits if it has none.
    fn entry(&mut self, key: Arc<str>) -> &mut Workspace {
        let limits = self.config.workspace_limits();
        self.workspaces
            .entry(key)
            .or_insert_with(|| Workspace::new(limits))
    }

    /// The workspace's key, shared with its entry if it has one.
    fn key(&self, workspace: &str) -> Arc<str> {
        self.workspaces
            .get_key_value(workspace)
            .map_or_else(|| Arc::from(workspace), |(k, _)| Arc::clone(k))
    }

    fn ticket(&mut self) -> u64 {
        let t = self.next_ticket;
        self.next_ticket += 1;
        t
    }

    fn global_has_room(&self) -> bool {
        self.running.len() < usize::try_from(self.config.global_cap).unwrap_or(usize::MAX)
    }

    /// Room in this lane's global cap, and the shared ledger not known full.
    fn global_open(&self, now: Instant) -> bool {
        self.global_has_room() && self.remote_busy.is_none_or(|until| until <= now)
    }

    /// A lease was had: what the ledger said before no longer holds.
    fn leased(&mut self, workspace: &str, batch: bool) {
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
    fn held_elsewhere(
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

    /// Puts a call back in line as `ticket` (where it stood), after the
    /// ledger refused the place it was given.
    fn requeue(
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

    /// Counts a call as started and running; returns its ticket.
    fn start(&mut self, key: &Arc<str>, now: Instant, batch: bool, probe: bool) -> u64 {
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
    fn release(&mut self, ticket: u64, outcome: Option<Outcome>, now: Instant) {
        self.release_as(ticket, outcome, now, false);
    }

    /// [`State::release`]; with `unstart`, the call was never sent, so its start
    /// leaves the rolling window too.
    fn release_as(&mut self, ticket: u64, outcome: Option<Outcome>, now: Instant, unstart: bool) {
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

    fn observe(&mut self, took: Duration) {
        self.mean_duration = Some(match self.mean_duration {
            None => took,
            Some(mean) => mean.mul_f64(1.0 - DURATION_WEIGHT) + took.mul_f64(DURATION_WEIGHT),
        });
    }

    /// Hands free places of the global cap to waiters: the workspace with the
    /// fewest single calls running first, ties by the longest wait; in order
    /// within a workspace.
    fn dispatch(&mut self, now: Instant) {
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
    fn next_waiter(&self, now: Instant) -> Option<u64> {
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
    fn single_waits_for_global(&self, now: Instant) -> bool {
        self.line.values().any(|w| {
            self.workspaces
                .get(&w.workspace)
                .is_some_and(|ws| ws_has_room(ws, self.config.start_window, now))
        })
    }

    fn leave_line(&mut self, ticket: u64) -> Option<Waiter> {
        let waiter = self.line.remove(&ticket)?;
        if let Some(ws) = self.workspaces.get_mut(&waiter.workspace) {
            ws.waiting = ws.waiting.saturating_sub(1);
        }
        Some(waiter)
    }

    fn refuse_line(&mut self, refusal: LaneRefusal) {
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
    fn ahead_of(&self, ticket: u64, workspace: &str) -> u32 {
        let n = self
            .line
            .range(..ticket)
            .filter(|(_, w)| &*w.workspace == workspace)
            .count();
        u32::try_from(n).unwrap_or(u32::MAX)
    }

    /// When the waiter `ticket` should look again: its deadline, or earlier
    /// when its workspace's oldest start leaves the window.
    fn wake_at(&self, ticket: u64, deadline: Instant) -> Instant {
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
    fn rate_slot(&self, workspace: &str, ahead: u32, now: Instant) -> Option<Instant> {
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
    fn refusal(&self, workspace: &str, ahead: u32, now: Instant) -> LaneRefusal {
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
    fn estimate(&self, workspace: Option<&str>, now: Instant) -> Duration {
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

    /// The refusal for any call while the breaker refuses calls, without
    /// changing the breaker.
    fn breaker_refusal(&self, now: Instant) -> Option<LaneRefusal> {
        match self.breaker.clone().permit(self.timestamp(now)) {
            Permit::Refused { retry_after } => Some(unavailable(retry_after)),
            Permit::Call | Permit::Probe => None,
        }
    }

    fn batch_place_free(&self, now: Instant) -> bool {
        self.global_open(now)
            && self.remote_batch_busy.is_none_or(|until| until <= now)
            && self.batch_running < self.config.batch_cap()
            && !self.single_waits_for_global(now)
            && self.batch_breaker_wait(now).is_none()
    }

    /// Until when the breaker keeps batch items back (`None`: they may go).
    ///
    /// Single calls probe first: once the open time is up, the next single
    /// call is the probe. A batch item may be the probe only when no single
    /// call took it within a further `open_for` (no single call is arriving),
    /// and never while a probe is out (until that probe is stale for single
    /// calls too, and another `open_for` has passed).
    fn batch_breaker_wait(&self, now: Instant) -> Option<Instant> {
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

    fn start_batch(&mut self, workspace: &str, now: Instant) -> Option<Grant> {
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

    /// Drops the entry of a workspace that holds nothing any more.
    fn forget_if_idle(&mut self, workspace: &str, now: Instant) {
        let window = self.config.start_window;
        if let Some(ws) = self.workspaces.get_mut(workspace) {
            prune(&mut ws.starts, now, window);
            if is_idle(ws, now) {
                self.workspaces.remove(workspace);
            }
        }
    }

    /// Drops idle workspaces once the map has grown: entries kept only for
    /// their recent starts go once those leave the window.
    fn sweep(&mut self, now: Instant) {
        if self.workspaces.len() < self.sweep_at {
            return;
        }
        let window = self.config.start_window;
        self.workspaces.retain(|_, ws| {
            prune(&mut ws.starts, now, window);
            !is_idle(ws, now)
        });
        self.sweep_at = (self.workspaces.len() * 2).max(1024);
    }

    fn snapshot(&mut self, name: &str, now: Instant) -> LaneSnapshot {
        let window = self.config.start_window;
        let mut workspaces: Vec<WorkspaceSnapshot> = self
            .workspaces
            .iter_mut()
            .map(|(key, ws)| {
                prune(&mut ws.starts, now, window);
                WorkspaceSnapshot {
                    workspace: key.to_string(),
                    running: ws.running,
                    waiting: ws.waiting,
                    started_in_window: u32::try_from(ws.starts.len()).unwrap_or(u32::MAX),
                    batch_running: ws.batch_running,
                }
            })
            .filter(|w| w.running + w.waiting + w.started_in_window + w.batch_running > 0)
            .collect();
        workspaces.sort_by(|a, b| a.workspace.cmp(&b.workspace));
        let breaker = match self.breaker.state() {
            BreakerState::Closed => BreakerStatus::Closed,
            BreakerState::Open { until } if self.instant(until) > now => BreakerStatus::Open {
                retry_after: self.instant(until).saturating_duration_since(now),
            },
            BreakerState::Open { .. } => BreakerStatus::HalfOpen { probe_out: false },
            BreakerState::HalfOpen { .. } => BreakerStatus::HalfOpen {
                probe_out: self.probe.is_some(),
            },
        };
        LaneSnapshot {
            lane: name.to_owned(),
            global_cap: self.config.global_cap,
            batch_cap: self.config.batch_cap(),
            running: u32::try_from(self.running.len()).unwrap_or(u32::MAX),
            waiting: u32::try_from(self.line.len()).unwrap_or(u32::MAX),
            batch_running: self.batch_running,
            breaker,
            expected_duration: self.mean_duration.unwrap_or(self.config.expected_duration),
            workspaces,
        }
    }
}

fn unavailable(retry_after: Duration) -> LaneRefusal {
    LaneRefusal {
        reason: RefusalReason::Unavailable,
        retry_after,
    }
}

fn prune(starts: &mut VecDeque<Instant>, now: Instant, window: Duration) {
    while starts.front().is_some_and(|s| *s + window <= now) {
        starts.pop_front();
    }
}

/// The starts of `starts` (oldest first) still in the window at `now`: the
/// window's first live start is found by binary search, so a check costs
/// O(log n) however many starts the window holds.
fn live_starts(
    starts: &VecDeque<Instant>,
    now: Instant,
    window: Duration,
) -> impl Iterator<Item = &Instant> {
    let first = starts.partition_point(|s| *s + window <= now);
    starts.range(first..)
}

fn live_count(starts: &VecDeque<Instant>, now: Instant, window: Duration) -> usize {
    starts.len() - starts.partition_point(|s| *s + window <= now)
}

fn ws_has_room(ws: &Workspace, window: Duration, now: Instant) -> bool {
    let live = live_count(&ws.starts, now, window);
    ws.running < ws.limits.in_flight.get()
        && live < ws.limits.starts.get() as usize
        && ws.remote.is_none_or(|h| h.until <= now)
}

/// Holds nothing, and no hold of the shared ledger's is still in force.
fn is_idle(ws: &Workspace, now: Instant) -> bool {
    ws.running == 0
        && ws.batch_running == 0
        && ws.waiting == 0
        && ws.starts.is_empty()
        && ws.remote.is_none_or(|h| h.until <= now)
}

/// A place held by one call; gives it back exactly once.
struct Slot {
    shared: Option<Arc<Shared>>,
    ticket: u64,
    probe: bool,
    workspace: Box<str>,
    started: Instant,
    /// Its lease is not had yet: given back, its start goes too.
    unsent: bool,
}

impl Slot {
    fn give_back(&mut self, outcome: Option<Outcome>) {
        self.give_back_as(outcome, false);
    }

    fn give_back_as(&mut self, outcome: Option<Outcome>, unstart: bool) {
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
    slot: Slot,
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

/// A place for one batch item (counted toward the global cap only). Like
/// [`LanePermit`]: [`BatchPermit::finish`] reports the outcome, a drop gives
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
