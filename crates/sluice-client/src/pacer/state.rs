//! Per provider: the queues of waiting requests, the counters, what the
//! headers last said, and the requests of the last minute.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use sluice_core::Timestamp;

use super::ratio::InputRatios;
use crate::headers::RateLimitHeaders;
use crate::route::Cost;

/// Counters per provider.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ProviderStats {
    /// Requests let through.
    pub admitted: u64,
    /// Of those, requests admitted later than they arrived: those that
    /// slept for room and those queued behind them.
    pub waited: u64,
    /// Total time those requests spent waiting, in milliseconds.
    pub wait_ms: u64,
    /// Refused: larger than the whole TPM.
    pub too_large: u64,
    /// Refused: room later than the maximum wait.
    pub would_wait: u64,
    /// Requests shrunk to fit.
    pub shrunk: u64,
    /// Answers whose usage corrected a reservation.
    pub reconciled: u64,
    /// 429 answers seen from the provider.
    pub upstream_429: u64,
    /// Retries made.
    pub retries: u64,
    /// Of the requests let through, batch requests (M3).
    pub batch: u64,
}

#[derive(Default)]
pub(crate) struct Counters([AtomicU64; 10]);

impl Counters {
    pub(crate) fn add(&self, i: usize, n: u64) {
        self.0[i].fetch_add(n, Ordering::Relaxed);
    }
    pub(super) fn get(&self, i: usize) -> u64 {
        self.0[i].load(Ordering::Relaxed)
    }
}

pub(super) const ADMITTED: usize = 0;
pub(super) const WAITED: usize = 1;
pub(super) const WAIT_MS: usize = 2;
pub(super) const TOO_LARGE: usize = 3;
pub(super) const WOULD_WAIT: usize = 4;
pub(super) const SHRUNK: usize = 5;
pub(crate) const RECONCILED: usize = 6;
pub(super) const UPSTREAM_429: usize = 7;
pub(super) const RETRIES: usize = 8;
pub(super) const BATCH: usize = 9;

#[derive(Debug, Default)]
pub(super) struct Learned {
    pub(super) headers: Option<RateLimitHeaders>,
    pub(super) observed_at: Option<Timestamp>,
}

/// One queue of requests spending the same budgets (one provider, one
/// model group): the FIFO gates and the plan of the request at its head.
#[derive(Default)]
pub(super) struct Queue {
    /// Interactive requests, first come first served.
    pub(super) gate: tokio::sync::Mutex<()>,
    /// Batch requests, first come first served among themselves.
    pub(super) batch_gate: tokio::sync::Mutex<()>,
    /// Rung when this process gives tokens or requests back, so that the
    /// request waiting at the head of the queue looks again at once instead
    /// of at its next planned instant.
    pub(super) room: tokio::sync::Notify,
    /// The request at the head of the queue while it waits: when it goes and
    /// what it takes. Requests behind it may go first when that changes
    /// neither (see [`Pacer::try_ahead`]).
    pub(super) head: parking_lot::Mutex<Option<Head>>,
    /// Rung when the head's plan changes or room is given back, for the
    /// requests behind the head.
    pub(super) behind: tokio::sync::Notify,
    /// One request at a time checks whether it may go ahead of the head and
    /// reserves, so that two together never delay it.
    pub(super) ahead: tokio::sync::Mutex<()>,
}

/// The most queues (model groups) one provider keeps; past it, requests of
/// new groups share one overflow queue (still paced, only less fairly).
pub(super) const MAX_QUEUES: usize = 1_024;

/// One provider's local state: its queues, counters, what it learned from
/// headers.
#[derive(Default)]
pub(crate) struct ProviderState {
    pub(super) queues: parking_lot::Mutex<HashMap<String, Arc<Queue>>>,
    /// Interactive requests between arrival and admission: batch requests
    /// wait while any does.
    pub(super) interactive_waiting: AtomicUsize,
    /// Rung when no interactive request waits any more, or room comes back.
    pub(super) batch_wake: tokio::sync::Notify,
    pub(super) learned: parking_lot::Mutex<Learned>,
    /// What headers last said per model group (groups come from the config).
    pub(super) learned_by_group: parking_lot::Mutex<HashMap<String, (RateLimitHeaders, Timestamp)>>,
    pub(crate) counters: Counters,
    pub(super) recent: parking_lot::Mutex<RecentRequests>,
    /// Per model: the provider's input count to the pacer's estimate.
    pub(crate) ratios: parking_lot::Mutex<InputRatios>,
}

impl ProviderState {
    pub(super) fn queue(&self, group: &str) -> Arc<Queue> {
        let mut q = self.queues.lock();
        if q.len() >= MAX_QUEUES && !q.contains_key(group) {
            return q.entry("\0overflow".to_owned()).or_default().clone();
        }
        q.entry(group.to_owned()).or_default().clone()
    }

    /// Wakes every waiting request of the provider to look again.
    pub(crate) fn ring(&self) {
        for q in self.queues.lock().values() {
            q.room.notify_one();
            q.behind.notify_waiters();
        }
        self.batch_wake.notify_waiters();
    }
}

/// Counts an interactive request as waiting while it lives.
pub(super) struct Waiting<'s>(&'s ProviderState);

impl<'s> Waiting<'s> {
    pub(super) fn new(state: &'s ProviderState) -> Self {
        state.interactive_waiting.fetch_add(1, Ordering::SeqCst);
        Waiting(state)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if self.0.interactive_waiting.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.batch_wake.notify_waiters();
        }
    }
}

/// Requests this process let through, per second of the last minute: what the
/// admin page shows against the RPM (the RPM itself is paced by spacing, which
/// keeps no count).
#[derive(Debug)]
pub(super) struct RecentRequests {
    /// (Unix second, requests in it), by second modulo 60.
    pub(super) seconds: [(u64, u32); 60],
}

impl Default for RecentRequests {
    fn default() -> Self {
        RecentRequests {
            seconds: [(0, 0); 60],
        }
    }
}

impl RecentRequests {
    pub(super) fn add(&mut self, second: u64) {
        let slot = &mut self.seconds[(second % 60) as usize];
        if slot.0 != second {
            *slot = (second, 0);
        }
        slot.1 = slot.1.saturating_add(1);
    }

    /// Requests in the 60 seconds that end with `now`.
    pub(super) fn last_minute(&self, now: u64) -> u64 {
        self.seconds
            .iter()
            .filter(|(second, _)| *second <= now && second + 60 > now)
            .map(|(_, n)| u64::from(*n))
            .sum()
    }
}

/// Where a provider's windows stand now ([`Pacer::reading`](super::Pacer::reading)).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
#[non_exhaustive]
pub struct WindowReading {
    /// Tokens in the rolling 60 s window (+ arrival margin), as the books stand
    /// (shared by every process on the key); 0 while the TPM is unlimited.
    pub tokens: u64,
    /// Requests this process let through in the last 60 s.
    pub requests_last_minute: u64,
    /// Requests in the rolling day as the books stand, `None` while the RPD is
    /// unlimited (no day is counted then).
    pub requests_today: Option<u64>,
}

/// One model's learned input ratio ([`Pacer::input_ratios`](super::Pacer::input_ratios);
/// `inputRatios` of `GET /limits`).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
#[non_exhaustive]
pub struct InputRatioReading {
    /// The model (`""`: requests naming none; `"\0other"`: models past the
    /// cap of 256 per provider).
    pub model: String,
    /// The provider's reported input tokens to the pacer's estimate
    /// (0.5–4.0; 1 before any sample).
    pub ratio: f64,
    /// Answers learned from.
    pub samples: u32,
    /// What a request's input estimate is multiplied by to reserve now
    /// (never below 1 before 8 samples; a margin above the ratio until then).
    pub factor: f64,
}

/// What the request at the head of a queue waits for.
#[derive(Clone, Copy, Debug)]
pub(super) struct Head {
    /// When it goes.
    pub(super) ready_at: Timestamp,
    /// On which route (key).
    pub(super) route: usize,
    /// The tokens it reserves then.
    pub(super) cost: Cost,
}

/// Clears the head's plan when the head leaves the queue (admitted, refused
/// or cancelled).
pub(super) struct HeadGuard<'s>(pub(super) &'s Queue);

impl HeadGuard<'_> {
    pub(super) fn publish(&self, head: Head) {
        *self.0.head.lock() = Some(head);
        self.0.behind.notify_waiters();
    }
}

impl Drop for HeadGuard<'_> {
    fn drop(&mut self) {
        *self.0.head.lock() = None;
        self.0.behind.notify_waiters();
    }
}
