//! A lane's leases in its shared ledger: taking one (with the outage rule),
//! and one keeper task per lane that renews every live lease each third of
//! the TTL and gives back the leases of ended permits (a permit's drop cannot
//! await, so it hands its lease over).

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::mpsc;
use tokio::time::{Instant, sleep_until};

use crate::config::{LaneConfig, WorkspaceLimits};
use crate::ledger::{DynLedger, Lease, LeaseKind, Ledger, LedgerOutage, MemoryLedger, Taken};
use crate::refusal::RefusalReason;

/// A lease a place holds, and which ledger it is in.
#[derive(Clone, Debug)]
pub(crate) struct Held {
    lease: Lease,
    /// Taken on this replica's fallback while the shared ledger was down.
    local: bool,
}

/// What asking for a lease answered.
pub(crate) enum Asked {
    Leased(Held),
    Refused {
        reason: RefusalReason,
        retry_after: Option<Duration>,
        may_free: bool,
    },
    /// The shared ledger cannot be asked and the lane fails closed.
    Unavailable,
}

/// A lease to give back: released, or cancelled (its call was never sent).
struct End {
    held: Held,
    cancel: bool,
}

/// What the keeper tells the lane once a lease is given back: the lease and
/// whether it was cancelled.
pub(crate) type OnEnd = Box<dyn Fn(&Lease, bool) + Send + Sync>;

/// A lane's leases: the ledger, the fallback, and every live lease by the
/// ticket of the place it holds.
pub(crate) struct Leases {
    ledger: Arc<dyn DynLedger>,
    /// This replica's own count while the shared ledger is down (failing
    /// open), and how many replicas share the limits.
    fallback: Option<(MemoryLedger, u32)>,
    book: Arc<Mutex<HashMap<u64, Held>>>,
    ends: mpsc::UnboundedSender<End>,
    /// The keeper's end of `ends`, until the keeper starts.
    keeper: Mutex<Option<mpsc::UnboundedReceiver<End>>>,
}

impl Leases {
    pub(crate) fn new(
        ledger: Arc<dyn DynLedger>,
        config: &LaneConfig,
        outage: LedgerOutage,
    ) -> Self {
        let fallback = match outage {
            LedgerOutage::FailClosed => None,
            LedgerOutage::FailOpen { replicas } => Some((
                MemoryLedger::new(share(config, replicas.get()), ledger.lease_ttl()),
                replicas.get(),
            )),
        };
        let (ends, rx) = mpsc::unbounded_channel();
        Leases {
            ledger,
            fallback,
            book: Arc::new(Mutex::new(HashMap::new())),
            ends,
            keeper: Mutex::new(Some(rx)),
        }
    }

    /// Asks for a lease; while the shared ledger cannot answer, asks the
    /// fallback when the lane fails open.
    pub(crate) async fn take(
        &self,
        workspace: &str,
        limits: WorkspaceLimits,
        kind: LeaseKind,
    ) -> Asked {
        let answer = match self.ledger.take_boxed(workspace, limits, kind).await {
            Ok(taken) => Some((taken, false)),
            Err(_) => match &self.fallback {
                Some((fallback, replicas)) => {
                    Ledger::take(fallback, workspace, share_limits(limits, *replicas), kind)
                        .await
                        .ok()
                        .map(|taken| (taken, true))
                }
                None => None,
            },
        };
        match answer {
            Some((Taken::Leased(lease), local)) => Asked::Leased(Held { lease, local }),
            Some((
                Taken::Refused {
                    reason,
                    retry_after,
                    may_free,
                },
                _,
            )) => Asked::Refused {
                reason,
                retry_after,
                may_free,
            },
            None => Asked::Unavailable,
        }
    }

    /// Records that the place `ticket` holds `held`: renewed from now on.
    pub(crate) fn hold(&self, ticket: u64, held: Held) {
        self.book.lock().insert(ticket, held);
    }

    /// Gives back the lease of the place `ticket`, if it holds one, through
    /// the keeper: at once, without waiting.
    pub(crate) fn end(&self, ticket: u64, cancel: bool) {
        if let Some(held) = self.book.lock().remove(&ticket) {
            // Without a keeper (its runtime is gone) the lease expires
            // within its TTL.
            let _ = self.ends.send(End { held, cancel });
        }
    }

    /// Live leases.
    pub(crate) fn held(&self) -> usize {
        self.book.lock().len()
    }

    /// Starts the keeper task if it is not running yet (call from within
    /// the runtime). It ends once the lane and every permit of it are gone
    /// and every lease is given back.
    pub(crate) fn start_keeper(&self, on_end: impl FnOnce() -> OnEnd) {
        let Some(ends) = self.keeper.lock().take() else {
            return;
        };
        tokio::spawn(keep(
            Arc::clone(&self.ledger),
            self.fallback.as_ref().map(|(f, _)| f.clone()),
            Arc::clone(&self.book),
            ends,
            on_end(),
        ));
    }
}

/// One replica's part of `n` while the shared ledger is down (at least 1).
fn part(n: u32, replicas: u32) -> u32 {
    (n / replicas.max(1)).max(1)
}

/// A workspace's limits on one replica while the shared ledger is down.
fn share_limits(limits: WorkspaceLimits, replicas: u32) -> WorkspaceLimits {
    let part = |n: NonZeroU32| NonZeroU32::new(part(n.get(), replicas)).unwrap_or(NonZeroU32::MIN);
    WorkspaceLimits::new(part(limits.in_flight), part(limits.starts))
}

/// The limits of one replica's share while the shared ledger is down.
fn share(config: &LaneConfig, replicas: u32) -> LaneConfig {
    let part = |n: u32| part(n, replicas);
    let mut local = config.clone();
    local.workspace_in_flight = part(config.workspace_in_flight);
    local.workspace_starts = part(config.workspace_starts);
    local.global_cap = part(config.global_cap);
    local.batch_reserve = (config.batch_reserve / replicas.max(1)).min(local.global_cap - 1);
    local
}

/// The keeper: gives back ended leases as they come, and renews every live
/// one each third of the TTL. A lease found expired at renewal (the replica
/// could not reach the ledger for a whole TTL) is dropped from the book: its
/// call runs on, no longer counted across replicas.
async fn keep(
    ledger: Arc<dyn DynLedger>,
    fallback: Option<MemoryLedger>,
    book: Arc<Mutex<HashMap<u64, Held>>>,
    mut ends: mpsc::UnboundedReceiver<End>,
    on_end: OnEnd,
) {
    let every = (ledger.lease_ttl() / 3).max(Duration::from_millis(1));
    let mut next = Instant::now() + every;
    loop {
        tokio::select! {
            end = ends.recv() => {
                let Some(End { held, cancel }) = end else {
                    return;
                };
                // An error leaves the lease to expire within its TTL.
                let _ = match (&fallback, held.local, cancel) {
                    (Some(f), true, true) => Ledger::cancel(f, &held.lease).await,
                    (Some(f), true, false) => Ledger::release(f, &held.lease).await,
                    (_, _, true) => ledger.cancel_boxed(&held.lease).await,
                    (_, _, false) => ledger.release_boxed(&held.lease).await,
                };
                on_end(&held.lease, cancel);
            }
            () = sleep_until(next) => {
                let live: Vec<(u64, Held)> =
                    book.lock().iter().map(|(t, h)| (*t, h.clone())).collect();
                for (ticket, held) in live {
                    let renewed = match (&fallback, held.local) {
                        (Some(f), true) => Ledger::renew(f, &held.lease).await,
                        _ => ledger.renew_boxed(&held.lease).await,
                    };
                    if renewed == Ok(false) {
                        book.lock().remove(&ticket);
                    }
                }
                next = Instant::now() + every;
            }
        }
    }
}
