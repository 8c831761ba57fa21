//! The batch runner: claims queued items as the lane has places for them (the lane
//! decides which workspace goes next), sends each upstream, records its answer, and
//! renews the claims of the items running here.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, header};
use http_body_util::{BodyExt as _, Full, Limited};
use serde_json::Value;
use sluice_core::Clock as _;
use sluice_store::BudgetStore;

use super::outage::{Gate, OutageWatch};
use super::{BatchLane, BatchUpstream};
use crate::{Claimed, Finish, ItemResult, ItemState, ResultBody, WorkspaceBacklog};

/// Most bytes of an upstream answer kept as an item's result.
pub const MAX_RESULT_BYTES: usize = 256 * 1024;

/// Attempts an item gets when the upstream fails it (5xx, no answer, a
/// timeout) before it is recorded as failed. A failure while the upstream is
/// down for everyone is not one of them: the item waits in the queue instead
/// (see the `BatchLane` runner's `run_item`).
pub const MAX_ATTEMPTS: u32 = 3;

/// Most workspaces whose batch failures are remembered at once (one entry
/// each, dropped on their next success or once their hold is over).
const MAX_HOLDS: usize = 10_000;

/// A workspace's batch failures: attempts failed in a row, and the end of its
/// hold.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Hold {
    failed_in_row: u32,
    until: Option<tokio::time::Instant>,
}

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
/// (retries, waits and the recording of the answer included), so an item
/// outlives its claim only when its replica is gone (or the store is down), and
/// goes back to the queue at most this plus the queue's upkeep period (30 s)
/// after the replica died. One renewal is one call to the store however many
/// items run (two Redis commands: the script and its one `ZADD`), so a lane's
/// running items cost a replica 0.2 commands a second.
pub const BATCH_CLAIM: Duration = Duration::from_secs(30);

/// How long a runner keeps trying to record an item's answer while the store
/// cannot take it: ten claims' lives ([`BATCH_CLAIM`]). The item's claim is
/// renewed meanwhile (whenever the store answers the renewals), so it is not
/// sent again; past its claim — a store down longer — the answer still counts
/// when it gets through, unless another run of the item recorded one first.
/// Only after this is the answer dropped, with an error logged: the item goes
/// back to the queue when its claim runs out, and is sent again.
pub const MAX_RECORD_WAIT: Duration = Duration::from_secs(BATCH_CLAIM.as_secs() * 10);

/// The first wait before an answer the store could not take is recorded again;
/// it doubles up to [`MAX_RECORD_BACKOFF`].
const FIRST_RECORD_BACKOFF: Duration = Duration::from_millis(250);

/// The longest wait between two attempts to record an answer.
const MAX_RECORD_BACKOFF: Duration = Duration::from_secs(5);

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
    /// The upstream is taken as down: nothing starts until then (`None`:
    /// until the probe out reports).
    Outage(Option<tokio::time::Instant>),
}
impl<S: BudgetStore + 'static, U: BatchUpstream> BatchLane<S, U> {
    /// Runs items on the capacity single calls leave, until `stop` resolves
    /// (spawn it on the runtime the lane's tasks are to run on).
    ///
    /// The runner waits on events and slow timers only, never on a condition that
    /// holds at rest: a batch queued here (or an item put back), a place freed on
    /// the lane (only while items wait for one), the lane's breaker or the shared
    /// ledger's hold running out, the next probe of an upstream outage, the
    /// queue's upkeep, and a look every [`IDLE_LOOK_EVERY`] for what other
    /// replicas queued.
    pub async fn run(self: Arc<Self>, stop: impl Future<Output = ()>) {
        let stopped = stop;
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
                // Look again when the next probe may go (or as usual: a
                // single call's answer may end the outage meanwhile); the
                // probe's end wakes the runner.
                Look::Outage(until) => until.map_or(IDLE_LOOK_EVERY, |until| {
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
            let mut waiting: Vec<&str> = backlogs
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
            // While the upstream is taken as down, one item at a time goes,
            // as the probe, from the workspace that probed longest ago.
            let successes = self.lane.successes();
            let probe = match self.watch(|w| w.gate(tokio::time::Instant::now(), successes)) {
                Gate::Go => false,
                Gate::Probe => {
                    self.outage.lock().probe_order(&mut waiting);
                    true
                }
                Gate::Wait(until) => return Look::Outage(until),
            };
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
            if probe {
                self.outage
                    .lock()
                    .probe_started(&claimed.workspace, tokio::time::Instant::now());
                tracing::info!(
                    "batch lane {}: the upstream looks down; batch {} item {} goes as the probe",
                    self.lane.name(),
                    claimed.batch_id,
                    claimed.index
                );
            }
            let this = Arc::clone(self);
            tokio::spawn(async move { this.run_item(claimed, permit, probe).await });
        }
    }

    /// Sends one item upstream and records its answer, or puts it back in the
    /// queue to wait out an upstream outage.
    ///
    /// An attempt the upstream fails (a 5xx, no answer, a timeout: a failure
    /// as SPEC L3 counts it) is, while the upstream is down for everyone, no
    /// attempt at all: the item is [released](crate::BatchQueue::release) —
    /// back at the head of its workspace's queue, durably, its attempts
    /// unspent — and waits there, queued, while dispatch pauses. The upstream
    /// is down while the lane's breaker is not closed, or after the breaker's
    /// `failures` (5) such failures of batch items in a row within its
    /// `within` (a minute) with no call of the lane answered in between (see
    /// the `outage` module: one probe item per `open_for`, 30 s, until one is
    /// answered).
    ///
    /// Otherwise the failure is one of the item's attempts: it is sent again
    /// by this task, holding its claim but no place on the lane meanwhile,
    /// after [`item_backoff`] (1 s, then 2 s): an item backs off on its own,
    /// and its failures never feed the lane's breaker (see
    /// [`sluice_lanes::Lane::acquire_batch`]), so a workspace's poison items
    /// cannot shut the lane for the others. The failures before an outage
    /// showed (at most the first four of its streak) stay counted when the
    /// item is put back, but an item that waited out an outage keeps at least
    /// its last attempt. After [`MAX_ATTEMPTS`] attempts (claims that ended
    /// by a crash or an expired claim count as one each) the item is recorded
    /// `failed` with the last answer, or with why there was none, as its
    /// result — once the lane has had an answer from the upstream since this
    /// claim's first send; until then its failures cannot be told from an
    /// outage's, and it keeps trying (backing off, up to 30 s apart) until
    /// either shows. So failures of one workspace's items while other calls
    /// get answers are theirs and fail them; a workspace whose items alone
    /// fail while nothing else calls the upstream sees them wait, one probe
    /// per 30 s, until something else is answered (a bounded cost, and the
    /// one state that cannot be told from an outage). An upstream that only
    /// times out, failing fewer than five items within a minute, is not taken
    /// as down: those items keep trying, one send per timeout and backoff,
    /// until it answers.
    ///
    /// The answer is then recorded (see [`BatchLane::record`]): while the store
    /// cannot take it, again and again, the claim renewed meanwhile, so that an
    /// answer once had is neither lost nor asked for a second time.
    async fn run_item(&self, claimed: Claimed, permit: sluice_lanes::BatchPermit, probe: bool) {
        let (batch, index) = (claimed.batch_id.as_str(), claimed.index);
        // The claim is renewed while the item runs (by the lane's renewals),
        // its answer's recording included; it leaves them when the task ends,
        // however it ends.
        let _running = RunningClaim::new(self, batch, index);
        let _probe = probe.then(|| ProbeOut(self));
        match self.run_attempts(&claimed, permit).await {
            Ran::Answered(state, result) => self.record(batch, index, state, result).await,
            Ran::Waits { spent } => self.put_back(batch, index, spent).await,
        }
    }

    /// Puts an item back in the queue to wait out an upstream outage, with
    /// `spent` attempts spent (its failures before the outage showed; at most
    /// `MAX_ATTEMPTS - 1`, so that an item that waited out an outage has an
    /// attempt left).
    async fn put_back(&self, batch: &str, index: u32, spent: u32) {
        self.count(3);
        let spent = spent.min(MAX_ATTEMPTS - 1);
        match self
            .queue
            .release(batch, index, spent, self.clock.now())
            .await
        {
            Ok(_) => tracing::debug!(
                "batch {batch} item {index}: the upstream is down; the item waits in the queue"
            ),
            Err(e) => tracing::warn!(
                "batch {batch} item {index}: the upstream is down, and the item could not be put back in the queue ({e}); it goes back when its claim runs out"
            ),
        }
        self.queued.notify_one();
    }

    /// Records `result` as the item's answer (`state`: done or failed). While
    /// the store cannot take it, tries again after 250 ms, doubling up to 5 s,
    /// for up to [`MAX_RECORD_WAIT`]; it stops at once when the store answers
    /// that the item is no longer this run's to record: another run recorded
    /// an answer first, or the batch is gone.
    async fn record(&self, batch: &str, index: u32, state: ItemState, result: ItemResult) {
        let give_up_at = tokio::time::Instant::now() + MAX_RECORD_WAIT;
        let mut backoff = FIRST_RECORD_BACKOFF;
        let mut failures = 0u32;
        loop {
            let now = self.clock.now();
            let recorded = if state == ItemState::Done {
                self.queue.complete(batch, index, result.clone(), now).await
            } else {
                self.queue.fail(batch, index, result.clone(), now).await
            };
            let e = match recorded {
                Ok(Finish::Recorded) => {
                    if failures > 0 {
                        tracing::info!(
                            "batch {batch} item {index}: its answer is recorded (after {failures} failed attempts)"
                        );
                    }
                    return;
                }
                Ok(Finish::AlreadyFinished) => {
                    tracing::debug!(
                        "batch {batch} item {index}: another run recorded its answer first; this one is dropped"
                    );
                    return;
                }
                Ok(Finish::Unknown) => {
                    tracing::debug!(
                        "batch {batch} item {index}: the batch is gone; its answer is dropped"
                    );
                    return;
                }
                Err(e) => e,
            };
            failures += 1;
            if tokio::time::Instant::now() + backoff > give_up_at {
                tracing::error!(
                    "batch {batch} item {index}: its answer could not be recorded for {} s ({e}); it is dropped, and the item is sent again once its claim runs out",
                    MAX_RECORD_WAIT.as_secs()
                );
                return;
            }
            if failures == 1 {
                tracing::warn!(
                    "batch {batch} item {index}: could not record its answer ({e}); trying again, its claim kept, for up to {} s",
                    MAX_RECORD_WAIT.as_secs()
                );
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(MAX_RECORD_BACKOFF);
        }
    }

    /// [`BatchLane::run_item`]'s attempts, until one answers or the last has
    /// failed (the item's state and result to record), or the item is to
    /// wait out an upstream outage in the queue.
    async fn run_attempts(&self, claimed: &Claimed, permit: sluice_lanes::BatchPermit) -> Ran {
        // The attempt being made: the claim's, then one more per failure
        // that counted.
        let mut attempt = claimed.attempt.max(1);
        let mut permit = permit;
        // The lane's answered calls before the first send: a later count
        // tells that the upstream answered someone since.
        let answered_before = self.lane.successes();
        loop {
            let sent = tokio::time::timeout(self.timeout, self.send(claimed)).await;
            let failed = match sent {
                Ok(Sent::Answer(status, body, is_json)) if status < 500 => {
                    permit.finish(sluice_lanes::Outcome::Success);
                    self.holds.lock().remove(&claimed.workspace);
                    self.watch(OutageWatch::success);
                    let result = ItemResult {
                        status,
                        body: ResultBody::new(body, is_json),
                    };
                    return if status < 400 {
                        self.count(0);
                        Ran::Answered(ItemState::Done, result)
                    } else {
                        self.count(1);
                        Ran::Answered(ItemState::Failed, result)
                    };
                }
                Ok(Sent::TooLarge(status)) => {
                    // Answered, but its answer cannot be kept: the item did not
                    // get its result, which it says (never an empty success).
                    permit.finish(sluice_lanes::Outcome::Success);
                    self.holds.lock().remove(&claimed.workspace);
                    self.watch(OutageWatch::success);
                    self.count(1);
                    let body = ResultBody::Text(format!(
                        "the upstream answered {status} with more than the {MAX_RESULT_BYTES} bytes a batch result keeps: the answer was not kept"
                    ));
                    return Ran::Answered(ItemState::Failed, ItemResult { status, body });
                }
                Ok(Sent::Revoked) => {
                    // Nothing went upstream: no outcome for the lane.
                    drop(permit);
                    self.count(1);
                    let body = serde_json::json!({ "error": {
                        "code": "forbidden",
                        "message": "The credential this batch was queued with was revoked before the item was sent: it was not sent.",
                        "details": { "reason": "credential_revoked" },
                    }});
                    let body = ResultBody::new(body.to_string().into_bytes(), true);
                    return Ran::Answered(ItemState::Failed, ItemResult { status: 403, body });
                }
                Ok(Sent::Unsendable) => {
                    // Nothing went upstream: no outcome for the lane.
                    drop(permit);
                    self.count(1);
                    let body = ResultBody::Text(
                        "the item could not be made into a request to the upstream".to_owned(),
                    );
                    return Ran::Answered(ItemState::Failed, ItemResult { status: 400, body });
                }
                failed => failed,
            };
            permit.finish(sluice_lanes::Outcome::Failure);
            if self.outage_failure() {
                // Not an attempt: the ones before it were.
                return Ran::Waits { spent: attempt - 1 };
            }
            self.failed_attempt(&claimed.workspace);
            let answered_since = self.lane.successes() != answered_before;
            if attempt >= MAX_ATTEMPTS && answered_since {
                let result = match failed {
                    Ok(Sent::Answer(status, body, is_json)) => ItemResult {
                        status,
                        body: ResultBody::new(body, is_json),
                    },
                    Ok(Sent::Cut) => ItemResult {
                        status: 502,
                        body: ResultBody::Text(format!(
                            "the upstream's answer broke off before its end ({attempt} attempts)"
                        )),
                    },
                    Ok(
                        Sent::Unreachable | Sent::Unsendable | Sent::TooLarge(_) | Sent::Revoked,
                    ) => ItemResult {
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
                return Ran::Answered(ItemState::Failed, result);
            }
            self.count(2);
            tokio::time::sleep(item_backoff(attempt)).await;
            // The workspace's hold, if its items kept failing.
            if let Some(until) = self.held_until(&claimed.workspace) {
                tokio::time::sleep_until(until).await;
            }
            // An outage began meanwhile: wait in the queue, not here.
            if self.upstream_down() {
                return Ran::Waits { spent: attempt };
            }
            permit = loop {
                if let Some(p) = self.lane.acquire_batch(&claimed.workspace).await {
                    break p;
                }
                self.lane.batch_capacity().await;
            };
            if self.upstream_down() && !permit.is_probe() {
                return Ran::Waits { spent: attempt };
            }
            attempt = attempt.saturating_add(1);
        }
    }

    /// One item's upstream call: its answer, or why there is none.
    async fn send(&self, claimed: &Claimed) -> Sent {
        let Ok(item) = serde_json::from_slice::<Value>(&claimed.item) else {
            return Sent::Unsendable;
        };
        let uri = format!("{}{}", self.base_path, self.batch.route);
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
        let body = Full::new(body)
            .map_err(|never| match never {})
            .boxed_unsync();
        let Ok(mut request) = request.body(body) else {
            return Sent::Unsendable;
        };
        // A credential revoked after the submit sends nothing more: its queued
        // items fail here, as its own requests are refused at the door.
        if self
            .limiter
            .load()
            .policy()
            .identity
            .revokes(request.headers())
        {
            return Sent::Revoked;
        }
        // After the item's own fields, unless they hold one.
        request
            .headers_mut()
            .entry(header::HOST)
            .or_insert_with(|| self.host.clone());
        let Ok(response) = self.upstream.send(request).await else {
            return Sent::Unreachable;
        };
        let status = response.status().as_u16();
        let is_json = response
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("application/json"));
        let body = match Limited::new(response.into_body(), MAX_RESULT_BYTES)
            .collect()
            .await
        {
            Ok(collected) => collected.to_bytes().to_vec(),
            Err(e) if e.is::<http_body_util::LengthLimitError>() => {
                return Sent::TooLarge(status);
            }
            // The answer broke off: no answer (sent again, with its
            // Idempotency-Key), never an empty result.
            Err(_) => return Sent::Cut,
        };
        let is_json = is_json && serde_json::from_slice::<Value>(&body).is_ok();
        Sent::Answer(status, body, is_json)
    }

    /// Counts an outage-class failure of an item; true when the upstream is
    /// down (the lane's breaker is not closed, or the batch side's streak is
    /// full): the item is to wait in the queue.
    fn outage_failure(&self) -> bool {
        let (successes, breaker) = (self.lane.successes(), self.lane.config().breaker);
        let now = tokio::time::Instant::now();
        let down = self.watch(|w| w.failure(now, successes, breaker));
        down || self.lane.breaker() != sluice_lanes::BreakerStatus::Closed
    }

    /// Whether the upstream is down now (see [`BatchLane::outage_failure`]).
    fn upstream_down(&self) -> bool {
        let successes = self.lane.successes();
        self.watch(|w| w.is_down(successes))
            || self.lane.breaker() != sluice_lanes::BreakerStatus::Closed
    }

    /// Runs `f` on the outage watch; logs and sets the outage gauge when the
    /// upstream is taken as down, or no longer.
    fn watch<T>(&self, f: impl FnOnce(&mut OutageWatch) -> T) -> T {
        let (was, is, out) = {
            let mut watch = self.outage.lock();
            let was = watch.probe_at().is_some();
            let out = f(&mut watch);
            (was, watch.probe_at().is_some(), out)
        };
        if was != is {
            let lane = self.lane.name().to_owned();
            if is {
                tracing::warn!(
                    "batch lane {lane}: the upstream failed {} batch items in a row with no call answered; batch items wait in the queue, one probe every {} s",
                    self.lane.config().breaker.failures,
                    self.lane.config().breaker.open_for.as_secs()
                );
            } else {
                tracing::info!("batch lane {lane}: the upstream answers again; batch items run");
            }
            metrics::gauge!("sluice_batch_outage", "lane" => lane).set(if is { 1.0 } else { 0.0 });
        }
        out
    }

    /// Counts a failed attempt of one of `workspace`'s items: after as many in a
    /// row as open the lane's breaker, its items are held for the breaker's open
    /// time (and again after each further failure while they keep failing).
    /// This is the batch side's breaker, per workspace: one workspace's poison
    /// items pause only that workspace's items. (An upstream down for everyone
    /// is the outage watch's: its failures are no attempts, and every
    /// workspace's items wait.)
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
    pub(super) fn held_until(&self, workspace: &str) -> Option<tokio::time::Instant> {
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
}

/// The claims of the items running on a lane, each with how many runs hold it.
#[derive(Debug, Default)]
pub(super) struct RunningClaims(HashMap<(String, u32), usize>);

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
struct RunningClaim<'a, S, U> {
    lane: &'a BatchLane<S, U>,
    claim: (String, u32),
}

impl<'a, S, U> RunningClaim<'a, S, U> {
    fn new(lane: &'a BatchLane<S, U>, batch_id: &str, index: u32) -> Self {
        let claim = (batch_id.to_owned(), index);
        lane.claims.lock().add(&claim);
        lane.claimed.notify_one();
        Self { lane, claim }
    }
}

impl<S, U> Drop for RunningClaim<'_, S, U> {
    fn drop(&mut self) {
        self.lane.claims.lock().remove(&self.claim);
    }
}

/// How an item's run ended.
enum Ran {
    /// With its state and result to record.
    Answered(ItemState, ItemResult),
    /// With the item to wait out an upstream outage in the queue, `spent`
    /// attempts spent.
    Waits { spent: u32 },
}

/// What one item's upstream call came to.
enum Sent {
    /// The upstream's status, body (at most [`MAX_RESULT_BYTES`]) and whether
    /// the body is JSON.
    Answer(u16, Vec<u8>, bool),
    /// No answer came: the upstream could not be reached, or failed before
    /// its response headers.
    Unreachable,
    /// The answer's body broke off before its end (its status came).
    Cut,
    /// An answer of this status, its body longer than [`MAX_RESULT_BYTES`].
    TooLarge(u16),
    /// The item could not be made into a request: nothing was sent.
    Unsendable,
    /// The credential the item was queued with has been revoked since: nothing
    /// was sent.
    Revoked,
}

/// The outage's probe, out while this lives: its end lets the next one go
/// (once its failure, if it failed, has been counted) and wakes the runner.
struct ProbeOut<'a, S, U>(&'a BatchLane<S, U>);

impl<S, U> Drop for ProbeOut<'_, S, U> {
    fn drop(&mut self) {
        self.0.outage.lock().probe_ended();
        self.0.queued.notify_one();
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
}
