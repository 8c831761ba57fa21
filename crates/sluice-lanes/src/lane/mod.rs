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

mod batch;
mod breaker;
mod calls;
mod leasing;
mod queue;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use sluice_core::{Breaker, BreakerState, Timestamp};
use tokio::sync::{Notify, oneshot};
use tokio::time::Instant;

use crate::config::{ConfigError, LaneConfig, WorkspaceLimits};
use crate::leases::Leases;
use crate::ledger::{Lease, LeaseKind, Ledger, LedgerOutage};
use crate::refusal::{LaneRefusal, RefusalReason};
use crate::snapshot::{BreakerStatus, LaneSnapshot, WorkspaceSnapshot};

pub use batch::BatchPermit;
use breaker::unavailable;
pub use calls::LanePermit;
use calls::Slot;

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
    /// Calls the upstream answered (see [`Lane::successes`]).
    successes: u64,
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
            successes: 0,
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
    /// report [`Outcome::Failure`](crate::Outcome::Failure).
    pub fn upstream_timeout(&self) -> Duration {
        self.shared.config.upstream_timeout
    }

    /// How many calls on this lane, single calls and batch items alike, the
    /// upstream has answered (reported as
    /// [`Outcome::Success`](crate::Outcome::Success): any status below 500)
    /// since the lane was built. Two readings that differ tell that the
    /// upstream answered someone in between (the batch lane's outage watch
    /// uses this to tell an upstream down for everyone from one workspace's
    /// failing calls).
    pub fn successes(&self) -> u64 {
        self.shared.state.lock().successes
    }

    /// Where the breaker stands now (as [`Lane::snapshot`] gives it, without
    /// the rest).
    pub fn breaker(&self) -> BreakerStatus {
        let now = Instant::now();
        self.shared.state.lock().breaker_status(now)
    }

    /// What the lane holds now: for `/status`, `/metrics` and dashboards.
    pub fn snapshot(&self) -> LaneSnapshot {
        let now = Instant::now();
        let mut state = self.shared.state.lock();
        state.snapshot(&self.shared.name, now)
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
        let breaker = self.breaker_status(now);
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

    fn breaker_status(&self, now: Instant) -> BreakerStatus {
        match self.breaker.state() {
            BreakerState::Closed => BreakerStatus::Closed,
            BreakerState::Open { until } if self.instant(until) > now => BreakerStatus::Open {
                retry_after: self.instant(until).saturating_duration_since(now),
            },
            BreakerState::Open { .. } => BreakerStatus::HalfOpen { probe_out: false },
            BreakerState::HalfOpen { .. } => BreakerStatus::HalfOpen {
                probe_out: self.probe.is_some(),
            },
        }
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
