//! The batch lane: `POST <route>/batch` queues a list of single calls durably and
//! answers 202 at once; a runner sends the items upstream on the capacity single
//! calls leave (the lane decides which workspace goes next); `GET
//! <route>/batches/{id}` reads progress and results.
//!
//! The submit and the status read are decided by the limiter like any request (the
//! submit's class, and one unit of the single call's quota per item, at once);
//! sluice then answers them itself, never forwarding them. Each item goes upstream
//! as `POST <route>` with the item as its JSON body, the submitter's credential
//! fields, `X-Sluice-Workspace` / `X-Sluice-User`, and `Idempotency-Key:
//! <batch_id>/<index>`, so an item sent twice (after a crash) is recognisable, and
//! `X-Request-Id: <batch_id>/<index>` (the same on every attempt), so the
//! upstream's logs name the item. An `idempotency_key` is matched against a
//! digest of the body's canonical JSON (keys sorted, no whitespace): the same
//! JSON in another key order or spacing is the same batch.
//!
//! The queue keeps each item with the credential fields it is sent with, until the
//! batch is purged (finished batches are kept for the lane's `keep_hours`).
//!
//! The rooms of this folder: this file holds [`BatchLane`] (one lane's queue, its
//! lane and its counters) and its `/status` share; `endpoints` answers the submit
//! and status requests and the JSON-RPC tools (the [`BatchEndpoints`] service in
//! front of the proxy); `runner` claims queued items and sends them upstream;
//! `responses` writes the JSON answers both give.

mod endpoints;
mod responses;
mod runner;

use std::sync::Arc;
use std::time::Duration;

use http::{HeaderValue, header};
use serde_json::{Value, json};
use sluice_batch::{BatchQueue, WorkspaceBacklog};
use sluice_core::SystemClock;
use sluice_edge::SharedLimiter;
use sluice_policy::LaneBatch;

use crate::pool::{Connections, UpstreamPool, keep_pruned};
use crate::proxy::Upstream;
use crate::store::AnyStore;

pub(crate) use endpoints::BatchEndpoints;
pub(crate) use runner::BATCH_CLAIM;
use runner::{Hold, RunningClaims};

/// One lane's batch lane, shared by the intercepting service and the runner.
pub(crate) struct BatchLane {
    lane: sluice_lanes::Lane,
    lane_index: usize,
    batch: LaneBatch,
    timeout: Duration,
    /// The queue of every batch lane: the embedded durable store, or Redis when
    /// replicas share one (so any replica runs items and answers status reads).
    queue: Arc<dyn BatchQueue>,
    limiter: SharedLimiter<AnyStore>,
    upstream: Upstream,
    /// The runners' connections to the upstream: the pool the gateway's workers
    /// use, one of its own (shared by every batch lane).
    pool: UpstreamPool,
    /// The `Host` items are sent with (see [`Upstream::client_host`]).
    host: HeaderValue,
    clock: SystemClock,
    /// The request fields the limiter reads (credentials): kept with each item.
    credential_fields: Vec<http::HeaderName>,
    /// Wakes the runner when a batch was queued.
    queued: tokio::sync::Notify,
    /// The prefix of this lane's workspace names in the shared queue (see
    /// [`BatchLane::all`]); empty for the policy's first batch lane.
    tag: String,
    /// Per workspace whose batch attempts failed lately: how many in a row, and
    /// until when its items are held (see [`BatchLane::run_item`]).
    holds: parking_lot::Mutex<std::collections::HashMap<String, Hold>>,
    /// What the queue held when the runner last looked, for `/status`.
    last_backlog: parking_lot::Mutex<Vec<WorkspaceBacklog>>,
    /// Items finished here: done, failed, and attempts sent again after a failure
    /// (`requeued` in `/status` and the metric).
    outcomes: [std::sync::atomic::AtomicU64; 3],
    /// The claims of the items running here (batch id, index), which the
    /// runner renews all at once (see [`BatchLane::renew_claims`]), each with
    /// how many runs hold it (an item whose claim ran out during an outage
    /// may be claimed again here while its first run goes on).
    claims: parking_lot::Mutex<RunningClaims>,
    /// Wakes the renewals when an item starts running here.
    claimed: tokio::sync::Notify,
}

/// Between a batch lane's name and a workspace's in the queue (see
/// [`BatchLane::all`]): a character no workspace name holds (an HTTP field value
/// cannot carry it).
const LANE_SEPARATOR: char = '\u{1f}';

impl BatchLane {
    /// The batch lanes of `limiter`'s policy over `queue`. A reload keeps the
    /// lanes as they are (see [`sluice_edge::Limiter::reloaded`]); the submit and status
    /// requests are decided by whichever limiter is current.
    ///
    /// The lanes share one queue, each in its own part of it: the policy's first
    /// batch lane queues under the workspace's name (as before there were
    /// several), every other one under `<lane name>` U+001F `<workspace>`. A
    /// lane's runner claims only its own part, and a status read finds only
    /// batches submitted through the same lane. Items queued through a lane keep
    /// its name: renaming a lane, or putting another batch lane first, leaves the
    /// items queued under the old name unclaimed until it is restored.
    pub(crate) fn all(
        shared: &SharedLimiter<AnyStore>,
        queue: &Arc<dyn BatchQueue>,
        upstream: &Upstream,
        clock: &SystemClock,
    ) -> Vec<Arc<BatchLane>> {
        let limiter = shared.load();
        let policy = limiter.policy();
        // Pruned by a task of this runtime, which the runners run on.
        let connections = Arc::new(Connections::to(upstream));
        keep_pruned(&connections);
        let pool = UpstreamPool::new(connections);
        let host = upstream.client_host();
        let credential_fields: Vec<http::HeaderName> = limiter
            .read_headers()
            .into_iter()
            .filter(|n| n != header::CONTENT_ENCODING)
            .collect();
        let first_batch_lane = policy.lanes.iter().position(|rule| rule.batch.is_some());
        policy
            .lanes
            .iter()
            .enumerate()
            .filter_map(|(i, rule)| {
                let batch = rule.batch.clone()?;
                let lane = limiter.lanes().get(i)?.clone();
                let tag = if Some(i) == first_batch_lane {
                    String::new()
                } else {
                    format!("{}{LANE_SEPARATOR}", lane.name())
                };
                Some(Arc::new(BatchLane {
                    lane,
                    lane_index: i,
                    batch,
                    timeout: rule.timeout,
                    queue: Arc::clone(queue),
                    limiter: Arc::clone(shared),
                    upstream: upstream.clone(),
                    pool: pool.clone(),
                    host: host.clone(),
                    clock: clock.clone(),
                    credential_fields: credential_fields.clone(),
                    queued: tokio::sync::Notify::new(),
                    tag,
                    holds: parking_lot::Mutex::default(),
                    last_backlog: parking_lot::Mutex::default(),
                    outcomes: Default::default(),
                    claims: parking_lot::Mutex::default(),
                    claimed: tokio::sync::Notify::new(),
                }))
            })
            .collect()
    }

    /// `workspace`'s name in this lane's part of the queue.
    fn queue_name(&self, workspace: &str) -> String {
        format!("{}{workspace}", self.tag)
    }

    /// The workspace a name in the queue stands for, when it is in this lane's
    /// part of the queue.
    fn own_workspace<'a>(&self, queued: &'a str) -> Option<&'a str> {
        if self.tag.is_empty() {
            (!queued.contains(LANE_SEPARATOR)).then_some(queued)
        } else {
            queued.strip_prefix(self.tag.as_str())
        }
    }

    fn count(&self, outcome: usize) {
        self.outcomes[outcome].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let label = ["done", "failed", "requeued"][outcome];
        metrics::counter!("sluice_batch_items_total", "lane" => self.lane.name().to_owned(), "outcome" => label)
            .increment(1);
    }

    /// This batch lane's share of `/status`: per workspace, items queued and
    /// running (as the runner last saw the queue), and items finished here.
    pub(crate) fn summary(&self) -> Value {
        let backlog = self.last_backlog.lock();
        let n = |i: usize| self.outcomes[i].load(std::sync::atomic::Ordering::Relaxed);
        let queued: u64 = backlog.iter().map(|b| b.queued).sum();
        metrics::gauge!("sluice_batch_queued", "lane" => self.lane.name().to_owned())
            .set(queued as f64);
        json!({
            "lane": self.lane.name(),
            "queued": queued,
            "running": backlog.iter().map(|b| b.running).sum::<u64>(),
            "done_here": n(0),
            "failed_here": n(1),
            "requeued_here": n(2),
            "held": backlog.iter().filter(|b| self.held_until(&b.workspace).is_some()).count(),
            "workspaces": backlog.iter().map(|b| json!({
                "workspace": b.workspace, "queued": b.queued, "running": b.running,
                "held_seconds": self.held_until(&b.workspace).map_or(0.0, |until| {
                    until.saturating_duration_since(tokio::time::Instant::now()).as_secs_f64()
                }),
            })).collect::<Vec<_>>(),
        })
    }
}
