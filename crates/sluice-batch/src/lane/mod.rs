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
//! The queue keeps each item with the credential fields it is sent with (as the
//! request carried them: the raw credential) until the item finishes: its body,
//! which holds them, is dropped when its answer is recorded (the answer stays until
//! the batch is purged, after the lane's `keep_hours`). Until then they are at rest
//! in the queue's store: the redb file under the data dir (created readable by
//! sluice's user only), or Redis.
//!
//! The rooms of this folder: this file holds [`BatchLane`] (one lane's queue, its
//! lane and its counters), its `/status` share, and what a host gives the lanes
//! ([`LaneHost`]: a [`BatchUpstream`] to send items through, and how to read a
//! request's client address); `endpoints` answers the submit and status requests
//! and the JSON-RPC tools (the [`BatchEndpoints`] service in front of the proxy);
//! `runner` claims queued items and sends them upstream; `outage` tells the
//! runner when the upstream is down for everyone, so that items wait in the
//! queue instead of spending their attempts; `responses` writes the JSON
//! answers both give.
//!
//! The lanes depend on no gateway: a host builds them with [`BatchLane::all`] over
//! its limiter (any [`BudgetStore`]), the queue and a [`LaneHost`], spawns each
//! one's [`BatchLane::run`], and puts [`BatchEndpoints`] in front of its proxy.

mod endpoints;
mod outage;
mod responses;
mod runner;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Request, Response, header};
use http_body_util::combinators::{BoxBody, UnsyncBoxBody};
use serde_json::{Value, json};
use sluice_core::SystemClock;
use sluice_edge::SharedLimiter;
use sluice_policy::LaneBatch;
use sluice_store::BudgetStore;

use crate::{BatchQueue, WorkspaceBacklog};

pub use endpoints::BatchEndpoints;
pub use responses::QUEUE_FULL_RETRY;
pub use runner::{
    BATCH_CLAIM, IDLE_LOOK_EVERY, MAX_ATTEMPTS, MAX_ITEM_BACKOFF, MAX_RECORD_WAIT,
    MAX_RESULT_BYTES, item_backoff,
};
use runner::{Hold, RunningClaims};

/// The error of the lane's bodies: any error, boxed.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The body of every answer the batch endpoints give, and of the answers of the
/// service behind them (the host's proxy).
pub type LaneBody = BoxBody<Bytes, BoxError>;

/// The body of an item's request to the upstream: the item's JSON.
pub type ItemBody = UnsyncBoxBody<Bytes, BoxError>;

/// Reads a request's client address (the connection's peer) from what the host's
/// server put in the request; `None` when there is none.
pub type PeerOf = fn(&http::request::Parts) -> Option<SocketAddr>;

/// What a batch lane's runner sends items through: the host's client to the
/// upstream.
pub trait BatchUpstream: Send + Sync + 'static {
    /// The body of the upstream's answers (read up to [`MAX_RESULT_BYTES`]).
    type Body: http_body::Body<Data = Bytes, Error: Into<BoxError>> + Send;
    /// Why no answer came (the runner records only that none came).
    type Error: Send;

    /// Sends `request` (`POST <base path><route>`, its `Host` set) to the upstream,
    /// and returns its answer with the body still streaming.
    ///
    /// # Errors
    /// When the upstream gave no answer (it could not be reached, or failed
    /// before its response headers).
    fn send(
        &self,
        request: Request<ItemBody>,
    ) -> impl Future<Output = Result<Response<Self::Body>, Self::Error>> + Send;
}

/// What a host gives its batch lanes: the upstream items are sent to, and how to
/// read a request's client address.
#[derive(Clone, Debug)]
pub struct LaneHost<U> {
    /// The client the runners send items through (shared by every batch lane).
    pub upstream: U,
    /// The upstream's path prefix: empty, or starts with `/` and does not end
    /// with `/`. An item goes to `<base_path><route>`.
    pub base_path: String,
    /// The `Host` items are sent with, unless an item's credential fields hold one.
    pub host_header: HeaderValue,
    /// Reads a request's client address: a submit's origin (its share of the
    /// queue's global bounds) is the client it names.
    pub peer_of: PeerOf,
}

/// One lane's batch lane, shared by the intercepting service and the runner:
/// over the limiter of budget store `S`, sending items through `U`.
pub struct BatchLane<S, U> {
    lane: sluice_lanes::Lane,
    lane_index: usize,
    batch: LaneBatch,
    timeout: Duration,
    /// The queue of every batch lane: the embedded durable store, or Redis when
    /// replicas share one (so any replica runs items and answers status reads).
    queue: Arc<dyn BatchQueue>,
    limiter: SharedLimiter<S>,
    /// The runners' client to the upstream (shared by every batch lane).
    upstream: Arc<U>,
    /// The upstream's path prefix (see [`LaneHost::base_path`]).
    base_path: Arc<str>,
    /// The `Host` items are sent with (see [`LaneHost::host_header`]).
    host: HeaderValue,
    /// Reads a request's client address.
    peer_of: PeerOf,
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
    /// Whether the upstream is down for everyone, as batch items see it, and
    /// the probe that tells when it is up again (see [`BatchLane::run_item`]).
    outage: parking_lot::Mutex<outage::OutageWatch>,
    /// What the queue held when the runner last looked, for `/status`.
    last_backlog: parking_lot::Mutex<Vec<WorkspaceBacklog>>,
    /// Items finished here: done, failed, attempts sent again after a failure
    /// (`requeued` in `/status` and the metric), and items put back in the
    /// queue to wait out an upstream outage (`released`).
    outcomes: [std::sync::atomic::AtomicU64; 4],
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

impl<S: BudgetStore + 'static, U: BatchUpstream> BatchLane<S, U> {
    /// The batch lanes of `shared`'s policy over `queue`, sending items through
    /// `host`. A reload keeps the lanes as they are (see
    /// [`sluice_edge::Limiter::reloaded`]); the submit and status requests are
    /// decided by whichever limiter is current.
    ///
    /// The lanes share one queue, each in its own part of it: the policy's first
    /// batch lane queues under the workspace's name (as before there were
    /// several), every other one under `<lane name>` U+001F `<workspace>`. A
    /// lane's runner claims only its own part, and a status read finds only
    /// batches submitted through the same lane. Items queued through a lane keep
    /// its name: renaming a lane, or putting another batch lane first, leaves the
    /// items queued under the old name unclaimed until it is restored.
    pub fn all(
        shared: &SharedLimiter<S>,
        queue: &Arc<dyn BatchQueue>,
        host: LaneHost<U>,
        clock: &SystemClock,
    ) -> Vec<Arc<Self>> {
        let limiter = shared.load();
        let policy = limiter.policy();
        let upstream = Arc::new(host.upstream);
        let base_path: Arc<str> = host.base_path.into();
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
                    upstream: Arc::clone(&upstream),
                    base_path: Arc::clone(&base_path),
                    host: host.host_header.clone(),
                    peer_of: host.peer_of,
                    clock: clock.clone(),
                    credential_fields: credential_fields.clone(),
                    queued: tokio::sync::Notify::new(),
                    tag,
                    holds: parking_lot::Mutex::default(),
                    outage: parking_lot::Mutex::default(),
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
        let label = ["done", "failed", "requeued", "released"][outcome];
        metrics::counter!("sluice_batch_items_total", "lane" => self.lane.name().to_owned(), "outcome" => label)
            .increment(1);
    }

    /// This batch lane's share of `/status`: per workspace, items queued and
    /// running (as the runner last saw the queue), items finished here, and
    /// whether dispatch is paused by an upstream outage (`outage`, with
    /// `outage_probe_seconds` until the next probe may go).
    pub fn summary(&self) -> Value {
        let probe_at = self.outage.lock().probe_at();
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
            "released_here": n(3),
            "outage": probe_at.is_some(),
            "outage_probe_seconds": probe_at.map_or(0.0, |at| {
                at.saturating_duration_since(tokio::time::Instant::now()).as_secs_f64()
            }),
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
