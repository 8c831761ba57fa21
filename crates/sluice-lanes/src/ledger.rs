//! Counts shared by replicas: leases with a short time to live.
//!
//! A [`Lane`](crate::Lane) counts in its own memory, which holds for one
//! process. When several replicas guard one upstream, the limits must hold
//! across all of them, so each call also holds a *lease* in a [`Ledger`]
//! shared by every replica (the Redis ledger, feature `redis`): taking a
//! lease checks the workspace's running calls, its starts in the rolling
//! window, the global cap and the batch cap across every replica at once and
//! records the call, all or nothing. A lease lives for the ledger's TTL and
//! is renewed while its call runs; a replica that crashes stops renewing, so
//! its places come back within one TTL.
//!
//! A lane built with [`Lane::with_ledger`](crate::Lane::with_ledger) takes
//! a lease for every place it hands out (see there): right after its own
//! count lets a call start, it asks the ledger ([`Ledger::take`]); one task
//! per lane renews every live lease each third of [`Ledger::ttl`] and gives
//! back the leases of finished, cancelled and dropped permits. A refused
//! lease means another replica holds the place: the call gives its local
//! place back and waits on, asking again after a short interval, until its
//! wait is over.
//!
//! How far fairness holds across replicas: the counts and the limits are
//! shared exactly; the waiting line is not. Each replica keeps its own line
//! and hands its freed places out fewest-running-first over its own waiters;
//! a place freed by another replica is seen when a waiter next asks the
//! ledger (a release is not pushed to other replicas), at most
//! [`LaneConfig::lease_retry`] later. So one replica never lets a workspace
//! overtake another of its own waiters, while between replicas whoever asks
//! first after a place frees gets it.
//!
//! [`MemoryLedger`] keeps the same leases in one process: the reference
//! behaviour, and a ledger for tests.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::hash::{BuildHasher, Hasher};
use std::num::NonZeroU32;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::time::Instant;

use crate::config::{LaneConfig, WorkspaceLimits};
use crate::refusal::RefusalReason;

/// Whether a lease is for a single call or a batch item.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LeaseKind {
    /// A single call: counts toward the workspace's limits and the global cap.
    Single,
    /// A batch item: counts toward the global cap and the batch cap only.
    Batch,
}

/// One call's hold on a place, shared by every replica.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lease {
    id: String,
    workspace: String,
    kind: LeaseKind,
}

impl Lease {
    /// The lease's id, unique across replicas.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The workspace it counts for.
    pub fn workspace(&self) -> &str {
        &self.workspace
    }

    /// Single call or batch item.
    pub fn kind(&self) -> LeaseKind {
        self.kind
    }
}

/// What [`Ledger::take`] answered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Taken {
    /// The place is held until released or until the lease is not renewed.
    Leased(Lease),
    /// A limit holds the call across all replicas.
    Refused {
        /// Which limit.
        reason: RefusalReason,
        /// Exact for [`RefusalReason::WorkspaceRateLimit`] (when the oldest
        /// start leaves the window); `None` for the others, which a lane
        /// estimates from its running calls.
        retry_after: Option<Duration>,
        /// For the start limit: some of the starts counted belong to calls
        /// still holding their place, which may yet give their start back
        /// (cancelled before being sent), so a start may free before
        /// `retry_after`. A lane then keeps asking instead of refusing at once.
        may_free: bool,
    },
}

/// The shared ledger could not be asked.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LedgerError {
    /// The store did not answer or answered something unusable.
    #[error("lane ledger unavailable: {0}")]
    Unavailable(String),
}

/// Counts of one workspace and of the lane, across replicas.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct LedgerCounts {
    /// Leases held across all workspaces (single calls and batch items).
    pub global: u32,
    /// Batch-item leases held.
    pub batch: u32,
    /// The workspace's single-call leases held.
    pub workspace_running: u32,
    /// The workspace's starts in the rolling window.
    pub workspace_starts: u32,
}

/// Where the counts of a lane shared by replicas live (see the module docs).
pub trait Ledger: Send + Sync {
    /// Takes a lease for one call of `workspace`, checking every limit across
    /// all replicas and recording the call, all or nothing. A single call is
    /// held to `limits` (the workspace's own, or the lane's
    /// [`LaneConfig::workspace_limits`]); a batch item only to the global and
    /// batch caps.
    ///
    /// # Errors
    /// [`LedgerError`] when the ledger cannot be asked.
    fn take(
        &self,
        workspace: &str,
        limits: WorkspaceLimits,
        kind: LeaseKind,
    ) -> impl Future<Output = Result<Taken, LedgerError>> + Send;

    /// Extends `lease` by one TTL; `false` when it had already expired (its
    /// place may have gone to another call).
    ///
    /// # Errors
    /// [`LedgerError`] when the ledger cannot be asked.
    fn renew(&self, lease: &Lease) -> impl Future<Output = Result<bool, LedgerError>> + Send;

    /// Gives the place back. Releasing twice changes nothing.
    ///
    /// # Errors
    /// [`LedgerError`] when the ledger cannot be asked (the lease then
    /// expires within its TTL).
    fn release(&self, lease: &Lease) -> impl Future<Output = Result<(), LedgerError>> + Send;

    /// Gives the place back as if it had never been taken: the call was
    /// never sent, so its start leaves the rolling window too. Cancelling
    /// twice, after a release, or once the lease has expired (its place may
    /// have gone to a call that counted that start) changes nothing more.
    /// The default only releases (the start then counts until it leaves the
    /// window).
    ///
    /// # Errors
    /// [`LedgerError`] when the ledger cannot be asked (the lease then
    /// expires within its TTL; the start stays for its window).
    fn cancel(&self, lease: &Lease) -> impl Future<Output = Result<(), LedgerError>> + Send {
        self.release(lease)
    }

    /// The counts of `workspace` and of the lane now.
    ///
    /// # Errors
    /// [`LedgerError`] when the ledger cannot be asked.
    fn counts(
        &self,
        workspace: &str,
    ) -> impl Future<Output = Result<LedgerCounts, LedgerError>> + Send;

    /// How long a lease lives without renewal.
    fn ttl(&self) -> Duration;
}

/// What a lane with a ledger does while its ledger cannot be asked (the
/// store is down or too slow).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum LedgerOutage {
    /// Refuse each call at once with
    /// [`RefusalReason::LedgerUnavailable`] (retry after 1 s); batch items
    /// wait. Nothing is counted that the other replicas cannot see.
    FailClosed,
    /// Count on this replica alone, with each limit (in flight per
    /// workspace, starts per workspace, the global cap, the batch reserve)
    /// divided by `replicas` (at least 1 each), so that the replicas together
    /// stay near the limits. Calls admitted this way are not in the shared
    /// ledger: when it answers again, new calls are counted there while
    /// these run to their end.
    FailOpen {
        /// Replicas sharing the ledger.
        replicas: NonZeroU32,
    },
}

/// A boxed ledger answer (the object-safe form of [`Ledger`]).
pub(crate) type Answer<'a, T> = Pin<Box<dyn Future<Output = Result<T, LedgerError>> + Send + 'a>>;

/// [`Ledger`] behind a pointer: what a lane holds.
pub(crate) trait DynLedger: Send + Sync {
    fn take_boxed<'a>(
        &'a self,
        workspace: &'a str,
        limits: WorkspaceLimits,
        kind: LeaseKind,
    ) -> Answer<'a, Taken>;
    fn renew_boxed<'a>(&'a self, lease: &'a Lease) -> Answer<'a, bool>;
    fn release_boxed<'a>(&'a self, lease: &'a Lease) -> Answer<'a, ()>;
    fn cancel_boxed<'a>(&'a self, lease: &'a Lease) -> Answer<'a, ()>;
    fn lease_ttl(&self) -> Duration;
}

impl<L: Ledger> DynLedger for L {
    fn take_boxed<'a>(
        &'a self,
        workspace: &'a str,
        limits: WorkspaceLimits,
        kind: LeaseKind,
    ) -> Answer<'a, Taken> {
        Box::pin(self.take(workspace, limits, kind))
    }

    fn renew_boxed<'a>(&'a self, lease: &'a Lease) -> Answer<'a, bool> {
        Box::pin(self.renew(lease))
    }

    fn release_boxed<'a>(&'a self, lease: &'a Lease) -> Answer<'a, ()> {
        Box::pin(self.release(lease))
    }

    fn cancel_boxed<'a>(&'a self, lease: &'a Lease) -> Answer<'a, ()> {
        Box::pin(self.cancel(lease))
    }

    fn lease_ttl(&self) -> Duration {
        self.ttl()
    }
}

/// Unique lease ids: a random replica tag and a counter.
#[derive(Debug)]
pub(crate) struct LeaseIds {
    replica: u64,
    next: AtomicU64,
}

impl LeaseIds {
    pub(crate) fn new() -> Self {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
        );
        h.write_u32(std::process::id());
        LeaseIds {
            replica: h.finish(),
            next: AtomicU64::new(0),
        }
    }

    pub(crate) fn lease(&self, workspace: &str, kind: LeaseKind) -> Lease {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        Lease {
            id: format!("{:016x}:{n}", self.replica),
            workspace: workspace.to_owned(),
            kind,
        }
    }
}

/// The lease ledger in one process's memory, with the same rules as the
/// shared one; clones share it. Time is tokio's clock.
#[derive(Clone, Debug)]
pub struct MemoryLedger {
    inner: Arc<MemoryInner>,
}

#[derive(Debug)]
struct MemoryInner {
    config: LaneConfig,
    ttl: Duration,
    ids: LeaseIds,
    state: Mutex<MemoryState>,
}

#[derive(Debug, Default)]
struct MemoryState {
    /// Lease id → (workspace, kind, expiry, taken at).
    leases: HashMap<String, (String, LeaseKind, Instant, Instant)>,
    starts: HashMap<String, VecDeque<Instant>>,
}

impl MemoryLedger {
    /// A ledger enforcing `config`'s global and batch caps and start window,
    /// and the per-workspace limits each call brings, with leases living `ttl`.
    pub fn new(config: LaneConfig, ttl: Duration) -> Self {
        MemoryLedger {
            inner: Arc::new(MemoryInner {
                config,
                ttl,
                ids: LeaseIds::new(),
                state: Mutex::new(MemoryState::default()),
            }),
        }
    }
}

impl MemoryState {
    fn prune(&mut self, now: Instant, window: Duration) {
        self.leases.retain(|_, (_, _, expiry, _)| *expiry > now);
        self.starts.retain(|_, starts| {
            while starts.front().is_some_and(|s| *s + window <= now) {
                starts.pop_front();
            }
            !starts.is_empty()
        });
    }

    fn count(&self, workspace: &str) -> LedgerCounts {
        let mut c = LedgerCounts::default();
        for (ws, kind, _, _) in self.leases.values() {
            c.global += 1;
            match kind {
                LeaseKind::Batch => c.batch += 1,
                LeaseKind::Single if ws == workspace => c.workspace_running += 1,
                LeaseKind::Single => {}
            }
        }
        c.workspace_starts = self
            .starts
            .get(workspace)
            .map_or(0, |s| u32::try_from(s.len()).unwrap_or(u32::MAX));
        c
    }
}

impl Ledger for MemoryLedger {
    async fn take(
        &self,
        workspace: &str,
        limits: WorkspaceLimits,
        kind: LeaseKind,
    ) -> Result<Taken, LedgerError> {
        let config = &self.inner.config;
        let now = Instant::now();
        let mut state = self.inner.state.lock();
        state.prune(now, config.start_window);
        let c = state.count(workspace);
        let refused = |reason, retry_after| {
            Ok(Taken::Refused {
                reason,
                retry_after,
                may_free: false,
            })
        };
        if kind == LeaseKind::Single {
            if c.workspace_running >= limits.in_flight.get() {
                return refused(RefusalReason::WorkspaceInFlightLimit, None);
            }
            if c.workspace_starts >= limits.starts.get() {
                let oldest = state.starts.get(workspace).and_then(|s| s.front().copied());
                let retry =
                    oldest.map(|s| (s + config.start_window).saturating_duration_since(now));
                let may_free = state.leases.values().any(|(ws, k, _, taken)| {
                    ws == workspace && *k == LeaseKind::Single && *taken + config.start_window > now
                });
                return Ok(Taken::Refused {
                    reason: RefusalReason::WorkspaceRateLimit,
                    retry_after: retry,
                    may_free,
                });
            }
        }
        if c.global >= config.global_cap
            || (kind == LeaseKind::Batch && c.batch >= config.batch_cap())
        {
            return refused(RefusalReason::Busy, None);
        }
        let lease = self.inner.ids.lease(workspace, kind);
        state.leases.insert(
            lease.id.clone(),
            (workspace.to_owned(), kind, now + self.inner.ttl, now),
        );
        if kind == LeaseKind::Single {
            state
                .starts
                .entry(workspace.to_owned())
                .or_default()
                .push_back(now);
        }
        Ok(Taken::Leased(lease))
    }

    async fn renew(&self, lease: &Lease) -> Result<bool, LedgerError> {
        let now = Instant::now();
        let mut state = self.inner.state.lock();
        state.prune(now, self.inner.config.start_window);
        Ok(match state.leases.get_mut(&lease.id) {
            Some((_, _, expiry, _)) => {
                *expiry = now + self.inner.ttl;
                true
            }
            None => false,
        })
    }

    async fn release(&self, lease: &Lease) -> Result<(), LedgerError> {
        self.inner.state.lock().leases.remove(&lease.id);
        Ok(())
    }

    async fn cancel(&self, lease: &Lease) -> Result<(), LedgerError> {
        let mut state = self.inner.state.lock();
        // Only a lease still held takes its start back: an expired one's
        // place may have gone to a call that counted that start (as in the
        // Redis script). Without this prune an expired lease no other
        // operation had dropped yet gave its start back.
        state.prune(Instant::now(), self.inner.config.start_window);
        let Some((workspace, kind, _, taken)) = state.leases.remove(&lease.id) else {
            return Ok(());
        };
        if kind == LeaseKind::Single
            && let Some(starts) = state.starts.get_mut(&workspace)
            && let Some(at) = starts.iter().rposition(|s| *s == taken)
        {
            starts.remove(at);
        }
        Ok(())
    }

    async fn counts(&self, workspace: &str) -> Result<LedgerCounts, LedgerError> {
        let now = Instant::now();
        let mut state = self.inner.state.lock();
        state.prune(now, self.inner.config.start_window);
        Ok(state.count(workspace))
    }

    fn ttl(&self) -> Duration {
        self.inner.ttl
    }
}
