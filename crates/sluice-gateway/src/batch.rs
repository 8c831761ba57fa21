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

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt as _, Full, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};
use sha2::{Digest as _, Sha256};
use sluice_batch::{
    BatchQueue, BatchStatus, Claimed, ItemResult, ResultBody, SubmitError, Submitted,
    WorkspaceBacklog,
};
use sluice_core::{Clock as _, SystemClock, Timestamp};
use sluice_edge::SharedLimiter;
use sluice_policy::{BatchEndpoint, LaneBatch};
use tower::Service;

use crate::Stop;
use crate::proxy::{BoxError, ProxyBody, Upstream};
use crate::store::AnyStore;

/// One lane's batch lane, shared by the intercepting service and the runner.
pub struct BatchLane {
    lane: sluice_lanes::Lane,
    lane_index: usize,
    batch: LaneBatch,
    timeout: Duration,
    /// The queue of every batch lane: the embedded durable store, or Redis when
    /// replicas share one (so any replica runs items and answers status reads).
    queue: Arc<dyn BatchQueue>,
    limiter: SharedLimiter<AnyStore>,
    upstream: Upstream,
    client: Client<HttpConnector, Full<Bytes>>,
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

/// Most bytes of an upstream answer kept as an item's result.
pub const MAX_RESULT_BYTES: usize = 256 * 1024;

/// Attempts an item gets when the upstream fails (5xx, no answer) before it is
/// recorded as failed.
pub const MAX_ATTEMPTS: u32 = 3;

/// Most workspaces whose batch failures are remembered at once (one entry
/// each, dropped on their next success or once their hold is over).
const MAX_HOLDS: usize = 10_000;

/// A workspace's batch failures: attempts failed in a row, and the end of its
/// hold.
#[derive(Clone, Copy, Debug, Default)]
struct Hold {
    failed_in_row: u32,
    until: Option<tokio::time::Instant>,
}

/// The `Retry-After` of a submit refused because the queue is full: the
/// queue's upkeep period, in which items finish and old batches are purged.
pub const QUEUE_FULL_RETRY: Duration = Duration::from_secs(30);

/// Longest wait before an item the upstream failed is sent again.
pub const MAX_ITEM_BACKOFF: Duration = Duration::from_secs(30);

/// How long an item waits after its `attempt`-th attempt failed: 1 s, doubling
/// with each attempt, at most [`MAX_ITEM_BACKOFF`].
pub fn item_backoff(attempt: u32) -> Duration {
    let doublings = attempt.saturating_sub(1).min(16);
    Duration::from_secs(1u64 << doublings).min(MAX_ITEM_BACKOFF)
}

/// How often a runner with nothing to start looks at the queue without being
/// woken: for items another replica queued on a shared queue (this replica's own
/// submissions wake it at once). On Redis one look is one script call (three
/// commands), so an idle replica's looks cost Redis well under a command a second.
pub const IDLE_LOOK_EVERY: Duration = Duration::from_secs(10);

/// How long the runner waits before looking again after the queue could not be
/// read, or the item it chose was claimed elsewhere first.
const RETRY_AFTER: Duration = Duration::from_secs(1);

/// How often expired claims go back to the queue and old batches are purged.
const MAINTAIN_EVERY: Duration = Duration::from_secs(30);

/// How long a runner's claim on an item lasts unless renewed: the runner renews
/// the claims of all the items it runs every third of this while they run
/// (retries and waits included), so an item outlives its claim only when its
/// replica is gone, and goes back to the queue at most this plus
/// [`MAINTAIN_EVERY`] after the replica died. One renewal is one call to the
/// store however many items run (two Redis commands: the script and its one
/// `ZADD`), so a lane's running items cost a replica 0.2 commands a second.
pub(crate) const BATCH_CLAIM: Duration = Duration::from_secs(30);

/// What a runner's look at the queue left it waiting for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Look {
    /// Nothing is queued.
    Empty,
    /// Items are queued and the lane has no place for one now.
    NoPlace,
    /// The queue could not be read, or the chosen item went to another replica.
    Later,
    /// Items are queued only for workspaces whose hold has not ended.
    Held,
}

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
    pub fn all(
        shared: &SharedLimiter<AnyStore>,
        queue: &Arc<dyn BatchQueue>,
        upstream: &Upstream,
        clock: &SystemClock,
    ) -> Vec<Arc<BatchLane>> {
        let limiter = shared.load();
        let policy = limiter.policy();
        let mut client = Client::builder(TokioExecutor::new());
        client.pool_idle_timeout(Duration::from_secs(60));
        let client = client.build(HttpConnector::new());
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
                    client: client.clone(),
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

    /// Queues the batch `body` (already checked and counted by the limiter) for the
    /// request `parts`, and answers 202, or why it was not queued.
    async fn submit(&self, parts: &http::request::Parts, body: Bytes) -> Response<ProxyBody> {
        let submit = match sluice_edge::parse_batch(&body, self.batch.max_items.get()) {
            Ok(submit) => submit,
            Err(bad) => return boxed(sluice_edge::Refused::from(bad).response()),
        };
        let workspace = header_text(parts, "x-sluice-workspace");
        let user = header_text(parts, "x-sluice-user");
        let fields: serde_json::Map<String, Value> = self
            .credential_fields
            .iter()
            .flat_map(|name| parts.headers.get_all(name).iter().map(move |v| (name, v)))
            .filter_map(|(name, v)| Some((name.as_str().to_owned(), Value::from(v.to_str().ok()?))))
            .collect();
        let n = u32::try_from(submit.items.len()).unwrap_or(u32::MAX);
        let items: Vec<Vec<u8>> = submit
            .items
            .into_iter()
            .map(|item| {
                let body: Value = serde_json::from_slice(&item).unwrap_or(Value::Null);
                json!({ "fields": fields, "workspace": workspace, "user": user, "body": body })
                    .to_string()
                    .into_bytes()
            })
            .collect();
        // The same JSON in another key order or spacing is the same batch.
        let digest = match serde_json::from_slice::<Value>(&body) {
            Ok(value) => {
                let mut canonical = Vec::with_capacity(body.len());
                write_canonical(&value, &mut canonical);
                Sha256::digest(&canonical)
            }
            Err(_) => Sha256::digest(&body),
        };
        let now = self.clock.now();
        // The client address (through trusted proxies, an IPv6 client by its
        // prefix), whose share of the queue's global bounds this batch takes.
        let origin = parts
            .extensions
            .get::<sluice_tower::PeerAddr>()
            .map(|peer| {
                let limiter = self.limiter.load();
                let client = limiter
                    .policy()
                    .identity
                    .client_ip(peer.0.ip(), &parts.headers);
                client.who.to_string()
            })
            .unwrap_or_default();
        let queued = self
            .queue
            .submit_from(
                &self.queue_name(&workspace),
                &origin,
                items,
                submit.idempotency_key.as_deref(),
                &digest,
                now,
            )
            .await;
        // Calls counted at admission but not queued now give their quota back: what
        // the admission spent of it (nothing when the family is in shadow mode and
        // would have refused them).
        let refund = !matches!(queued, Ok(Submitted { created: true, .. }));
        if refund
            && let Some(family) = self.batch.quota
            && let spent = parts
                .extensions
                .get::<sluice_edge::QuotaSpent>()
                .map_or(n, |s| s.of(family).min(n))
            && spent > 0
            && let Err(e) = self
                .limiter
                .load_full()
                .refund_quota(&workspace, family, spent)
                .await
        {
            tracing::warn!("could not give back {spent} quota units to {workspace}: {e}");
        }
        match queued {
            Ok(done) => {
                self.queued.notify_one();
                let status_url = format!("{}/batches/{}", self.batch.route, done.batch_id);
                let mut r = json_response(
                    StatusCode::ACCEPTED,
                    &json!({ "batch_id": done.batch_id, "items": done.items, "status_url": status_url }),
                );
                if let Ok(location) = HeaderValue::from_str(&status_url) {
                    r.headers_mut().insert(header::LOCATION, location);
                }
                r
            }
            Err(SubmitError::Conflict { batch_id }) => envelope(
                StatusCode::CONFLICT,
                "conflict",
                "This idempotency_key was used for a different batch body.",
                json!({ "batch_id": batch_id }),
            ),
            Err(SubmitError::Backlog { queued, limit }) => envelope(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limited",
                &format!(
                    "Your workspace has {queued} batch items waiting; at most {limit} may wait. Submit more once some have run."
                ),
                json!({ "reason": "batch_backlog_limit", "queued": queued, "limit": limit }),
            ),
            Err(SubmitError::QueueFull { bound, used, limit }) => {
                let mut r = envelope(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "unavailable",
                    &format!(
                        "The batch queue is full ({}: {used} of {limit}); nothing was queued. Try again later.",
                        bound.as_str()
                    ),
                    json!({
                        "reason": "batch_queue_full",
                        "bound": bound.as_str(),
                        "used": used,
                        "limit": limit,
                        "retry_after_seconds": QUEUE_FULL_RETRY.as_secs(),
                    }),
                );
                r.headers_mut().insert(
                    header::RETRY_AFTER,
                    HeaderValue::from(QUEUE_FULL_RETRY.as_secs()),
                );
                r
            }
            Err(SubmitError::TooMany { given, limit }) => envelope(
                StatusCode::BAD_REQUEST,
                "invalid_request",
                &format!("A batch holds at most {limit} items; this one has {given}."),
                json!({ "reason": "too_many_items", "limit": limit }),
            ),
            Err(SubmitError::Empty) => envelope(
                StatusCode::BAD_REQUEST,
                "invalid_request",
                "A batch needs at least one item.",
                json!({ "reason": "empty_batch" }),
            ),
            Err(e) => {
                let mut r = envelope(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "unavailable",
                    &format!("The batch could not be queued: {e}"),
                    json!({}),
                );
                r.headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from_static("5"));
                r
            }
        }
    }

    /// Answers a status read of batch `id` for the request `parts`.
    async fn status(&self, parts: &http::request::Parts, id: &str) -> Response<ProxyBody> {
        let workspace = header_text(parts, "x-sluice-workspace");
        match self
            .queue
            .status(&self.queue_name(&workspace), id, self.clock.now())
            .await
        {
            Ok(Some(status)) => json_response(StatusCode::OK, &status_json(&status)),
            Ok(None) => envelope(
                StatusCode::NOT_FOUND,
                "not_found",
                "No such batch.",
                json!({ "batch_id": id }),
            ),
            Err(e) => {
                let mut r = envelope(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "unavailable",
                    &format!("The batch could not be read: {e}"),
                    json!({}),
                );
                r.headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from_static("5"));
                r
            }
        }
    }

    /// Runs items on the capacity single calls leave, until `stop`.
    ///
    /// The runner waits on events and slow timers only, never on a condition that
    /// holds at rest: a batch queued here, a place freed on the lane (only while
    /// items wait for one), the lane's breaker or the shared ledger's hold running
    /// out, the queue's upkeep, and a look every [`IDLE_LOOK_EVERY`] for what other
    /// replicas queued.
    pub async fn run(self: Arc<Self>, stop: Stop) {
        let stopped = stop.wait();
        tokio::pin!(stopped);
        let renewing = tokio::spawn({
            let this = Arc::clone(&self);
            async move { this.renew_claims().await }
        });
        let _renewing = AbortOnDrop(renewing);
        let mut maintain = tokio::time::interval(MAINTAIN_EVERY);
        maintain.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let look = self.start_items().await;
            let look_again = match look {
                Look::Empty | Look::NoPlace => IDLE_LOOK_EVERY,
                Look::Later => RETRY_AFTER,
                // Look again when the first hold ends (or as usual).
                Look::Held => self.first_hold_end().map_or(IDLE_LOOK_EVERY, |until| {
                    until
                        .saturating_duration_since(tokio::time::Instant::now())
                        .min(IDLE_LOOK_EVERY)
                }),
            };
            tokio::select! {
                () = &mut stopped => return,
                () = self.lane.batch_capacity(), if look == Look::NoPlace => {}
                () = self.queued.notified() => {}
                () = tokio::time::sleep(look_again) => {}
                _ = maintain.tick() => {
                    if let Err(e) = self.queue.maintain(self.clock.now()).await {
                        tracing::warn!("batch queue upkeep failed: {e}");
                    }
                }
            }
        }
    }

    /// Renews the claims of the items running here, all in one call to the
    /// store, every third of [`BATCH_CLAIM`] while any runs; with none running
    /// it waits for one and costs nothing.
    async fn renew_claims(&self) {
        loop {
            while self.claims.lock().is_empty() {
                self.claimed.notified().await;
            }
            tokio::time::sleep(BATCH_CLAIM / 3).await;
            let claims = self.claims.lock().all();
            if claims.is_empty() {
                continue;
            }
            if let Err(e) = self.queue.renew_all(&claims, self.clock.now()).await {
                tracing::warn!(
                    "could not renew the claims of {} batch items: {e}",
                    claims.len()
                );
            }
        }
    }

    /// Starts as many queued items as the lane has places for now, and says what
    /// is left to wait for.
    async fn start_items(self: &Arc<Self>) -> Look {
        loop {
            let backlogs = match self.queue.backlogs().await {
                Ok(b) => b,
                Err(_) => return Look::Later,
            };
            // This lane's part of the queue, under the workspaces' own names.
            let backlogs: Vec<WorkspaceBacklog> = backlogs
                .into_iter()
                .filter_map(|b| {
                    let workspace = self.own_workspace(&b.workspace)?.to_owned();
                    Some(WorkspaceBacklog { workspace, ..b })
                })
                .collect();
            self.last_backlog.lock().clone_from(&backlogs);
            let waiting: Vec<&str> = backlogs
                .iter()
                .filter(|b| b.queued > 0 && self.held_until(&b.workspace).is_none())
                .map(|b| b.workspace.as_str())
                .collect();
            if waiting.is_empty() {
                return if backlogs.iter().any(|b| b.queued > 0) {
                    Look::Held
                } else {
                    Look::Empty
                };
            }
            // No place (or the shared ledger refused one, which the lane holds
            // until it is worth asking again): wait for the lane to have one.
            let Some((i, permit)) = self.lane.acquire_next_batch(&waiting).await else {
                return Look::NoPlace;
            };
            let claimed = match self
                .queue
                .claim_next(&self.queue_name(waiting[i]), self.clock.now())
                .await
            {
                Ok(Some(mut claimed)) => {
                    claimed.workspace = waiting[i].to_owned();
                    claimed
                }
                // Claimed by another replica meanwhile, or the queue is down.
                Ok(None) | Err(_) => {
                    drop(permit);
                    return Look::Later;
                }
            };
            let this = Arc::clone(self);
            tokio::spawn(async move { this.run_item(claimed, permit).await });
        }
    }

    /// Sends one item upstream and records its answer.
    ///
    /// An attempt the upstream fails (a 5xx, no answer, a timeout) is sent again
    /// by this task, holding its claim but no place on the lane meanwhile, after
    /// [`item_backoff`] (1 s, then 2 s): an item backs off on its own, and its
    /// failures never feed the lane's breaker (see
    /// [`sluice_lanes::Lane::acquire_batch`]), so a workspace's poison items
    /// cannot shut the lane for the others. After [`MAX_ATTEMPTS`] attempts
    /// (counting claims before this one, e.g. by a replica that crashed) the
    /// item is recorded `failed` with the last answer, or with why there was
    /// none, as its result.
    async fn run_item(&self, claimed: Claimed, permit: sluice_lanes::BatchPermit) {
        let (batch, index) = (claimed.batch_id.as_str(), claimed.index);
        // The claim is renewed while the item runs (by the lane's renewals); it
        // leaves them when the task ends, however it ends.
        let _running = RunningClaim::new(self, batch, index);
        let recorded = self.run_attempts(&claimed, permit).await;
        if let Err(e) = recorded {
            tracing::warn!("batch {batch} item {index}: could not record its answer: {e}");
        }
    }

    /// [`BatchLane::run_item`]'s attempts, until one is recorded.
    async fn run_attempts(
        &self,
        claimed: &Claimed,
        permit: sluice_lanes::BatchPermit,
    ) -> Result<sluice_batch::Finish, sluice_batch::BatchError> {
        let (batch, index) = (claimed.batch_id.as_str(), claimed.index);
        let mut attempt = claimed.attempt;
        let mut permit = permit;
        loop {
            let answer = tokio::time::timeout(self.timeout, self.send(claimed)).await;
            let now = self.clock.now();
            match answer {
                Ok(Some((status, body, is_json))) if status < 500 => {
                    permit.finish(sluice_lanes::Outcome::Success);
                    self.holds.lock().remove(&claimed.workspace);
                    let result = ItemResult {
                        status,
                        body: ResultBody::new(body, is_json),
                    };
                    return if status < 400 {
                        self.count(0);
                        self.queue.complete(batch, index, result, now).await
                    } else {
                        self.count(1);
                        self.queue.fail(batch, index, result, now).await
                    };
                }
                failed => {
                    permit.finish(sluice_lanes::Outcome::Failure);
                    self.failed_attempt(&claimed.workspace);
                    if attempt >= MAX_ATTEMPTS {
                        let result = match failed {
                            Ok(Some((status, body, is_json))) => ItemResult {
                                status,
                                body: ResultBody::new(body, is_json),
                            },
                            Ok(None) => ItemResult {
                                status: 502,
                                body: ResultBody::Text(format!(
                                    "the upstream could not be reached ({attempt} attempts)"
                                )),
                            },
                            Err(_) => ItemResult {
                                status: 504,
                                body: ResultBody::Text(format!(
                                    "the upstream did not answer within {} s ({attempt} attempts)",
                                    self.timeout.as_secs()
                                )),
                            },
                        };
                        self.count(1);
                        return self.queue.fail(batch, index, result, now).await;
                    }
                    self.count(2);
                    tokio::time::sleep(item_backoff(attempt)).await;
                    // The workspace's hold, if its items kept failing.
                    if let Some(until) = self.held_until(&claimed.workspace) {
                        tokio::time::sleep_until(until).await;
                    }
                    attempt += 1;
                    permit = loop {
                        if let Some(p) = self.lane.acquire_batch(&claimed.workspace).await {
                            break p;
                        }
                        self.lane.batch_capacity().await;
                    };
                }
            }
        }
    }

    /// One item's upstream call: its status, body (at most [`MAX_RESULT_BYTES`])
    /// and whether the body is JSON; `None` when no answer came.
    async fn send(&self, claimed: &Claimed) -> Option<(u16, Vec<u8>, bool)> {
        let item: Value = serde_json::from_slice(&claimed.item).ok()?;
        let uri = format!("{}{}", self.upstream, self.batch.route);
        let mut request = Request::post(uri)
            .header(header::CONTENT_TYPE, "application/json")
            .header("idempotency-key", claimed.idempotency_key())
            .header("x-request-id", claimed.idempotency_key());
        if let Some(fields) = item["fields"].as_object() {
            for (name, value) in fields {
                if let Some(value) = value.as_str() {
                    request = request.header(name.as_str(), value);
                }
            }
        }
        for (name, key) in [
            ("x-sluice-workspace", "workspace"),
            ("x-sluice-user", "user"),
        ] {
            if let Some(value) = item[key].as_str() {
                request = request.header(name, value);
            }
        }
        let body = Bytes::from(item["body"].to_string());
        let request = request.body(Full::new(body)).ok()?;
        let response = self.client.request(request).await.ok()?;
        let status = response.status().as_u16();
        let is_json = response
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("application/json"));
        let body = Limited::new(response.into_body(), MAX_RESULT_BYTES)
            .collect()
            .await
            .map(|c| c.to_bytes().to_vec())
            .unwrap_or_default();
        let is_json = is_json && serde_json::from_slice::<Value>(&body).is_ok();
        Some((status, body, is_json))
    }

    /// Counts a failed attempt of one of `workspace`'s items: after as many in a
    /// row as open the lane's breaker, its items are held for the breaker's open
    /// time (and again after each further failure while they keep failing).
    /// This is the batch side's breaker, per workspace: one workspace's poison
    /// items pause only that workspace's items, and an upstream down for
    /// everyone pauses every workspace's items instead of failing them all.
    fn failed_attempt(&self, workspace: &str) {
        let config = self.lane.config();
        let (threshold, open_for) = (config.breaker.failures.max(1), config.breaker.open_for);
        let now = tokio::time::Instant::now();
        let mut holds = self.holds.lock();
        if holds.len() >= MAX_HOLDS && !holds.contains_key(workspace) {
            holds.retain(|_, h| h.until.is_some_and(|until| until > now));
            if holds.len() >= MAX_HOLDS {
                return;
            }
        }
        let hold = holds.entry(workspace.to_owned()).or_default();
        hold.failed_in_row = hold.failed_in_row.saturating_add(1);
        if hold.failed_in_row >= threshold {
            hold.until = Some(now + open_for);
        }
    }

    /// Until when `workspace`'s batch items are held, if they are now.
    fn held_until(&self, workspace: &str) -> Option<tokio::time::Instant> {
        let now = tokio::time::Instant::now();
        self.holds
            .lock()
            .get(workspace)
            .and_then(|h| h.until)
            .filter(|until| *until > now)
    }

    /// When the first hold that has not ended ends.
    fn first_hold_end(&self) -> Option<tokio::time::Instant> {
        let now = tokio::time::Instant::now();
        self.holds
            .lock()
            .values()
            .filter_map(|h| h.until)
            .filter(|until| *until > now)
            .min()
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

    /// The lane (index into the policy's lanes) this batch lane runs on.
    pub fn lane_index(&self) -> usize {
        self.lane_index
    }

    /// This batch lane's share of `/status`: per workspace, items queued and
    /// running (as the runner last saw the queue), and items finished here.
    pub fn summary(&self) -> Value {
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

/// The batch status as `GET <route>/batches/{id}` shows it.
fn status_json(s: &BatchStatus) -> Value {
    let at = |t: Timestamp| sluice_edge::rfc3339(t.as_secs());
    json!({
        "batch_id": s.batch_id,
        "state": s.state.as_str(),
        "total": s.total,
        "done": s.done,
        "failed": s.failed,
        "queued": s.queued,
        "running": s.running,
        "created_at": at(s.created_at),
        "estimated_finish_at": s.estimated_finish_at.map(at),
        "items": s.items.iter().map(|i| json!({
            "index": i.index,
            "state": i.state.as_str(),
            "attempts": i.attempts,
            "status": i.result.as_ref().map(|r| r.status),
            "result": i.result.as_ref().map(|r| match &r.body {
                ResultBody::Json(b) => serde_json::from_slice(b).unwrap_or(Value::Null),
                ResultBody::Text(t) => Value::from(t.as_str()),
            }),
        })).collect::<Vec<_>>(),
    })
}

/// `value` as canonical JSON: object keys sorted (by their UTF-8 bytes), no
/// whitespace, strings and numbers as serde_json writes them. The digest of a
/// batch body is taken over this form, so a resend that only reorders keys or
/// changes spacing matches its first submit. Written here rather than relying
/// on `Value`'s map order, which a crate feature (`preserve_order`) can change.
fn write_canonical(value: &Value, out: &mut Vec<u8>) {
    match value {
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort_unstable();
            out.push(b'{');
            for (i, key) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                out.extend_from_slice(Value::from(key.as_str()).to_string().as_bytes());
                out.push(b':');
                if let Some(v) = map.get(key) {
                    write_canonical(v, out);
                }
            }
            out.push(b'}');
        }
        Value::Array(items) => {
            out.push(b'[');
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_canonical(v, out);
            }
            out.push(b']');
        }
        scalar => out.extend_from_slice(scalar.to_string().as_bytes()),
    }
}

fn header_text(parts: &http::request::Parts, name: &str) -> String {
    parts
        .headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("-")
        .to_owned()
}

fn boxed(r: Response<Full<Bytes>>) -> Response<ProxyBody> {
    r.map(|b| b.map_err(|never| match never {}).boxed())
}

fn json_response(status: StatusCode, body: &Value) -> Response<ProxyBody> {
    let mut r = Response::new(Full::new(Bytes::from(body.to_string())));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    boxed(r)
}

fn envelope(status: StatusCode, code: &str, message: &str, details: Value) -> Response<ProxyBody> {
    boxed(sluice_edge::envelope_response(
        status, code, message, details,
    ))
}

/// The service in front of the proxy that answers the batch lanes' endpoints (the
/// limiter has admitted the request) and forwards everything else.
#[derive(Clone)]
pub struct BatchEndpoints<S> {
    inner: S,
    lanes: Arc<Vec<Arc<BatchLane>>>,
}

impl<S> BatchEndpoints<S> {
    /// `inner`, with `lanes` answered in front of it.
    pub fn new(inner: S, lanes: Arc<Vec<Arc<BatchLane>>>) -> Self {
        BatchEndpoints { inner, lanes }
    }

    fn lane(&self, index: usize) -> Option<Arc<BatchLane>> {
        self.lanes.iter().find(|l| l.lane_index == index).cloned()
    }
}

/// An answer of the batch lane (`answer`, as the REST endpoint gives it) to the
/// JSON-RPC call `id`: a success is the tool's result (its JSON as text and as
/// `structuredContent`), with HTTP 200; a refusal is a JSON-RPC error with the same
/// HTTP status, `error.data` holding the envelope's `code` and `details`
/// (`-32029` for a 429, `-32602` for a 400 or 404, `-32000` otherwise).
async fn jsonrpc_answer(id: Value, answer: Response<ProxyBody>) -> Response<ProxyBody> {
    let (parts, body) = answer.into_parts();
    let bytes = body
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    let json: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    let body = if parts.status.is_success() {
        json!({
            "jsonrpc": "2.0",
            "id": id,
            "result": {
                "content": [{ "type": "text", "text": json.to_string() }],
                "structuredContent": json,
                "isError": false,
            },
        })
    } else {
        let code = match parts.status.as_u16() {
            429 => -32029,
            400 | 404 => -32602,
            _ => -32000,
        };
        let error = &json["error"];
        let mut data = error["details"].clone();
        if let Value::Object(map) = &mut data {
            map.insert("code".into(), error["code"].clone());
        }
        json!({
            "jsonrpc": "2.0",
            "id": id,
            "error": { "code": code, "message": error["message"], "data": data },
        })
    };
    let status = if parts.status.is_success() {
        StatusCode::OK
    } else {
        parts.status
    };
    let mut r = json_response(status, &body);
    if let Some(retry) = parts.headers.get(header::RETRY_AFTER) {
        r.headers_mut().insert(header::RETRY_AFTER, retry.clone());
    }
    r
}

impl BatchLane {
    /// Answers a call of this lane's submit or status tool.
    async fn tool(
        &self,
        parts: &http::request::Parts,
        call: sluice_edge::BatchToolCall,
    ) -> Response<ProxyBody> {
        let answer = match call.tool {
            sluice_edge::BatchTool::Submit(_) => {
                let args = Bytes::from(call.arguments.to_string());
                self.submit(parts, args).await
            }
            sluice_edge::BatchTool::Status(_) => match call.arguments["batch_id"].as_str() {
                Some(id) => self.status(parts, id).await,
                None => envelope(
                    StatusCode::BAD_REQUEST,
                    "invalid_request",
                    "`batch_id` is required.",
                    json!({ "reason": "no_batch_id" }),
                ),
            },
        };
        jsonrpc_answer(call.id, answer).await
    }
}

impl<S, B> Service<Request<B>> for BatchEndpoints<S>
where
    S: Service<Request<B>, Response = Response<ProxyBody>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    B: http_body::Body<Data = Bytes> + From<Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Response = Response<ProxyBody>;
    type Error = Infallible;
    type Future =
        std::pin::Pin<Box<dyn Future<Output = Result<Response<ProxyBody>, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let endpoint = if self.lanes.is_empty() {
            None
        } else {
            self.lanes.first().and_then(|l| {
                l.limiter
                    .load()
                    .route_for(request.method(), request.uri().path())
                    .ok()
                    .flatten()
                    .and_then(|r| r.batch)
            })
        };
        let lane = endpoint.and_then(|e| match e {
            BatchEndpoint::Submit(i) | BatchEndpoint::Status(i) => self.lane(i),
        });
        let jsonrpc = self.lanes.first().is_some_and(|l| {
            let limiter = l.limiter.load();
            limiter.policy().lanes.iter().any(|lane| {
                lane.batch
                    .as_ref()
                    .is_some_and(|b| b.submit_tool.is_some() || b.status_tool.is_some())
            }) && limiter
                .route_for(request.method(), request.uri().path())
                .ok()
                .flatten()
                .is_some_and(|r| r.class == sluice_policy::RouteClass::JsonRpc)
        });
        let (Some(endpoint), Some(lane)) = (endpoint, lane) else {
            if jsonrpc {
                // A JSON-RPC body (the limiter read it whole): a batch tool call is
                // answered here, anything else goes on.
                let lanes = Arc::clone(&self.lanes);
                let mut inner = self.inner.clone();
                return Box::pin(async move {
                    let (parts, body) = request.into_parts();
                    let bytes = match body.collect().await {
                        Ok(c) => c.to_bytes(),
                        Err(_) => return Ok(boxed(sluice_edge::body_unreadable())),
                    };
                    let call = lanes.first().and_then(|l| {
                        sluice_edge::batch_tool_call(l.limiter.load().policy(), &bytes)
                            .ok()
                            .flatten()
                    });
                    let lane = call.as_ref().and_then(|c| match c.tool {
                        sluice_edge::BatchTool::Submit(i) | sluice_edge::BatchTool::Status(i) => {
                            lanes.iter().find(|l| l.lane_index == i).cloned()
                        }
                    });
                    match (call, lane) {
                        (Some(call), Some(lane)) => Ok(lane.tool(&parts, call).await),
                        _ => inner.call(Request::from_parts(parts, B::from(bytes))).await,
                    }
                });
            }
            let call = self.inner.call(request);
            return Box::pin(call);
        };
        Box::pin(async move {
            let (parts, body) = request.into_parts();
            Ok(match endpoint {
                BatchEndpoint::Submit(_) if parts.method == Method::POST => {
                    let body = match body.collect().await {
                        Ok(c) => c.to_bytes(),
                        Err(_) => return Ok(boxed(sluice_edge::body_unreadable())),
                    };
                    lane.submit(&parts, body).await
                }
                BatchEndpoint::Status(_) => match lane.batch.status_id(parts.uri.path()) {
                    Some(id) => lane.status(&parts, id).await,
                    None => envelope(
                        StatusCode::NOT_FOUND,
                        "not_found",
                        "No such batch.",
                        json!({}),
                    ),
                },
                BatchEndpoint::Submit(_) => envelope(
                    StatusCode::METHOD_NOT_ALLOWED,
                    "method_not_allowed",
                    "Submit a batch with POST.",
                    json!({}),
                ),
            })
        })
    }
}

/// The claims of the items running on a lane, each with how many runs hold it.
#[derive(Debug, Default)]
struct RunningClaims(HashMap<(String, u32), usize>);

impl RunningClaims {
    fn add(&mut self, claim: &(String, u32)) {
        *self.0.entry(claim.clone()).or_default() += 1;
    }

    /// One run of `claim` ended; the claim stays while another holds it.
    fn remove(&mut self, claim: &(String, u32)) {
        if let Some(runs) = self.0.get_mut(claim) {
            *runs -= 1;
            if *runs == 0 {
                self.0.remove(claim);
            }
        }
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Every claim held, once each.
    fn all(&self) -> Vec<(String, u32)> {
        self.0.keys().cloned().collect()
    }
}

/// An item's claim among its lane's renewals while the item runs here.
struct RunningClaim<'a> {
    lane: &'a BatchLane,
    claim: (String, u32),
}

impl<'a> RunningClaim<'a> {
    fn new(lane: &'a BatchLane, batch_id: &str, index: u32) -> Self {
        let claim = (batch_id.to_owned(), index);
        lane.claims.lock().add(&claim);
        lane.claimed.notify_one();
        Self { lane, claim }
    }
}

impl Drop for RunningClaim<'_> {
    fn drop(&mut self) {
        self.lane.claims.lock().remove(&self.claim);
    }
}

/// A spawned task that ends when this is dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A claim held by two runs of its item (claimed again after its claim ran
    /// out) is renewed until both end.
    #[test]
    fn l4_a_claim_is_renewed_while_any_run_holds_it() {
        let mut claims = RunningClaims::default();
        let (a, b) = (("b1".to_owned(), 0), ("b1".to_owned(), 1));
        claims.add(&a);
        claims.add(&a);
        claims.add(&b);
        let mut all = claims.all();
        all.sort();
        assert_eq!(all, vec![a.clone(), b.clone()], "each claim once");
        claims.remove(&a);
        claims.remove(&b);
        assert_eq!(
            claims.all(),
            vec![a.clone()],
            "a's second run still holds it"
        );
        claims.remove(&a);
        assert!(claims.is_empty());
        claims.remove(&a);
        assert!(claims.is_empty(), "an extra end changes nothing");
    }

    #[test]
    fn l4_item_backoff_doubles_and_is_bounded() {
        let secs: Vec<u64> = (1..=8).map(|a| item_backoff(a).as_secs()).collect();
        assert_eq!(secs, [1, 2, 4, 8, 16, 30, 30, 30]);
        assert_eq!(item_backoff(u32::MAX), MAX_ITEM_BACKOFF);
    }

    #[test]
    fn l4_canonical_json_ignores_key_order_and_spacing() {
        let canonical = |text: &str| {
            let mut out = Vec::new();
            write_canonical(&serde_json::from_str(text).expect("json"), &mut out);
            String::from_utf8(out).expect("utf-8")
        };
        let a = canonical(r#"{"items":[{"b":1,"a":"x"}],"idempotency_key":"k"}"#);
        let b =
            canonical("{ \"idempotency_key\": \"k\",\n \"items\": [ {\"a\": \"x\", \"b\": 1} ] }");
        assert_eq!(a, b);
        assert_eq!(a, r#"{"idempotency_key":"k","items":[{"a":"x","b":1}]}"#);
        assert_ne!(
            a,
            canonical(r#"{"items":[{"b":2,"a":"x"}],"idempotency_key":"k"}"#)
        );
    }
}
