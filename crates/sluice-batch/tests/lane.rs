//! The batch lane over a queue whose store fails at the worst moments (SPEC L4
//! with Q1): a submit whose store's answer is lost keeps its quota spent when the
//! batch may be queued, and an answer the store cannot record at once is
//! recorded later, the item's claim kept meanwhile, instead of being lost and the
//! item sent upstream again.
//!
//! The lane runs as a gateway runs it (its endpoints, its runner, the built-in
//! policy's limiter over a memory store), over the embedded queue on in-memory
//! storage whose faults the tests switch on and off; time is tokio's, paused.

#![cfg(all(feature = "durable", feature = "lane"))]

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU8, AtomicU32, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Request, Response, StatusCode, header};
use http_body_util::{BodyExt as _, Full};
use redb::StorageBackend;
use redb::backends::InMemoryBackend;
use serde_json::{Value, json};
use sluice_batch::lane::{
    BATCH_CLAIM, BatchEndpoints, BatchLane, BatchUpstream, ItemBody, LaneBody, LaneHost,
    MAX_ATTEMPTS, MAX_RECORD_WAIT, MAX_RESULT_BYTES,
};
use sluice_batch::{
    BatchBook, BatchConfig, BatchError, BatchQueue, BatchStatus, Claimed, Finish, ItemResult,
    ItemState, Maintenance, QueueFuture, ResultBody, SubmitError, Submitted, WorkspaceBacklog,
};
use sluice_core::{Budget, BudgetStatus, Clock as _, Decision, SystemClock, Timestamp};
use sluice_edge::arc_swap::ArcSwap;
use sluice_edge::{Limiter, SharedLimiter};
use sluice_store::durable::FillableDisk;
use sluice_store::{BudgetStore, DurableStore, MemoryConfig, MemoryStore, StoreError};

/// The memory store, counting the quota units given back (refunds are
/// adjustments below zero).
#[derive(Clone)]
struct Refunds {
    inner: Arc<MemoryStore>,
    given_back: Arc<AtomicI64>,
}

impl BudgetStore for Refunds {
    fn decide(
        &self,
        budgets: &[Budget],
    ) -> impl Future<Output = Result<Decision, StoreError>> + Send {
        self.inner.decide(budgets)
    }

    fn peek(
        &self,
        budgets: &[Budget],
    ) -> impl Future<Output = Result<Decision, StoreError>> + Send {
        self.inner.peek(budgets)
    }

    fn adjust(
        &self,
        budget: &Budget,
        delta: i64,
        reserved_at: Timestamp,
    ) -> impl Future<Output = Result<BudgetStatus, StoreError>> + Send {
        if delta < 0 {
            self.given_back.fetch_add(-delta, Ordering::SeqCst);
        }
        self.inner.adjust(budget, delta, reserved_at)
    }
}

/// The upstream: answers every item 200 with the number of items sent so far.
#[derive(Clone, Default)]
struct Upstream {
    sent: Arc<AtomicU32>,
}

impl BatchUpstream for Upstream {
    type Body = Full<Bytes>;
    type Error = Infallible;

    fn send(
        &self,
        _request: Request<ItemBody>,
    ) -> impl Future<Output = Result<Response<Full<Bytes>>, Infallible>> + Send {
        let n = self.sent.fetch_add(1, Ordering::SeqCst) + 1;
        async move {
            let mut r = Response::new(Full::new(Bytes::from(format!(r#"{{"answer":{n}}}"#))));
            r.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            Ok(r)
        }
    }
}

/// What the proxy behind the batch endpoints answers: nothing reaches it here.
#[derive(Clone)]
struct NotFound;

impl tower::Service<Request<Full<Bytes>>> for NotFound {
    type Response = Response<LaneBody>;
    type Error = Infallible;
    type Future = std::future::Ready<Result<Response<LaneBody>, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _request: Request<Full<Bytes>>) -> Self::Future {
        let mut r = Response::new(
            Full::new(Bytes::new())
                .map_err(|never| match never {})
                .boxed(),
        );
        *r.status_mut() = StatusCode::NOT_FOUND;
        std::future::ready(Ok(r))
    }
}

/// In-memory storage whose flushes (`fsync`) fail — the next `fail_next` ones,
/// and every one while `failing` says so — the writes before them kept: a
/// commit that fails after it wrote everything.
#[derive(Clone, Debug, Default)]
struct FlushFails {
    inner: Arc<InMemoryBackend>,
    fail_next: Arc<AtomicU32>,
    failing: Arc<AtomicBool>,
}

impl StorageBackend for FlushFails {
    fn len(&self) -> std::io::Result<u64> {
        self.inner.len()
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> std::io::Result<()> {
        self.inner.read(offset, out)
    }

    fn set_len(&self, len: u64) -> std::io::Result<()> {
        self.inner.set_len(len)
    }

    fn sync_data(&self) -> std::io::Result<()> {
        let once = self
            .fail_next
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if once || self.failing.load(Ordering::SeqCst) {
            return Err(std::io::Error::other("fsync: input/output error"));
        }
        self.inner.sync_data()
    }

    fn write(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        self.inner.write(offset, data)
    }
}

/// The embedded queue, whose answers' recording fails while `fail_records`
/// says so (the store down, or its disk full, for a while); it counts the
/// attempts to record and the renewals that held a claim.
struct Flaky {
    inner: BatchBook,
    fail_records: AtomicBool,
    record_attempts: AtomicU32,
    renewals: AtomicU32,
}

impl Flaky {
    fn record<'a>(
        &'a self,
        f: impl Future<Output = Result<Finish, BatchError>> + Send + 'a,
    ) -> QueueFuture<'a, Result<Finish, BatchError>> {
        self.record_attempts.fetch_add(1, Ordering::SeqCst);
        let fail = self.fail_records.load(Ordering::SeqCst);
        Box::pin(async move {
            if fail {
                return Err(BatchError::Unavailable("the store is down".to_owned()));
            }
            f.await
        })
    }
}

impl BatchQueue for Flaky {
    fn submit_from<'a>(
        &'a self,
        workspace: &'a str,
        origin: &'a str,
        items: Vec<Vec<u8>>,
        idempotency_key: Option<&'a str>,
        body_digest: &'a [u8],
        now: Timestamp,
    ) -> QueueFuture<'a, Result<Submitted, SubmitError>> {
        self.inner
            .submit_from(workspace, origin, items, idempotency_key, body_digest, now)
    }

    fn claim_next<'a>(
        &'a self,
        workspace: &'a str,
        now: Timestamp,
    ) -> QueueFuture<'a, Result<Option<Claimed>, BatchError>> {
        self.inner.claim_next(workspace, now)
    }

    fn claim_fairest<'a>(
        &'a self,
        now: Timestamp,
    ) -> QueueFuture<'a, Result<Option<Claimed>, BatchError>> {
        self.inner.claim_fairest(now)
    }

    fn renew<'a>(
        &'a self,
        batch_id: &'a str,
        index: u32,
        now: Timestamp,
    ) -> QueueFuture<'a, Result<bool, BatchError>> {
        self.inner.renew(batch_id, index, now)
    }

    fn renew_all<'a>(
        &'a self,
        claims: &'a [(String, u32)],
        now: Timestamp,
    ) -> QueueFuture<'a, Result<usize, BatchError>> {
        if !claims.is_empty() {
            self.renewals.fetch_add(1, Ordering::SeqCst);
        }
        self.inner.renew_all(claims, now)
    }

    fn release<'a>(
        &'a self,
        batch_id: &'a str,
        index: u32,
        attempts: u32,
        now: Timestamp,
    ) -> QueueFuture<'a, Result<bool, BatchError>> {
        self.inner.release(batch_id, index, attempts, now)
    }

    fn complete<'a>(
        &'a self,
        batch_id: &'a str,
        index: u32,
        result: ItemResult,
        now: Timestamp,
    ) -> QueueFuture<'a, Result<Finish, BatchError>> {
        self.record(self.inner.complete(batch_id, index, result, now))
    }

    fn fail<'a>(
        &'a self,
        batch_id: &'a str,
        index: u32,
        result: ItemResult,
        now: Timestamp,
    ) -> QueueFuture<'a, Result<Finish, BatchError>> {
        self.record(self.inner.fail(batch_id, index, result, now))
    }

    fn status<'a>(
        &'a self,
        workspace: &'a str,
        batch_id: &'a str,
        now: Timestamp,
    ) -> QueueFuture<'a, Result<Option<BatchStatus>, BatchError>> {
        self.inner.status(workspace, batch_id, now)
    }

    fn backlogs<'a>(&'a self) -> QueueFuture<'a, Result<Vec<WorkspaceBacklog>, BatchError>> {
        self.inner.backlogs()
    }

    fn maintain<'a>(&'a self, now: Timestamp) -> QueueFuture<'a, Result<Maintenance, BatchError>> {
        self.inner.maintain(now)
    }
}

/// The built-in policy's limiter (its `optimizer` batch lane, quota `messages`)
/// over a memory store that counts refunds.
fn limiter() -> (SharedLimiter<Refunds>, Arc<AtomicI64>) {
    let given_back = Arc::new(AtomicI64::new(0));
    let store = Refunds {
        inner: Arc::new(MemoryStore::new(MemoryConfig::default())),
        given_back: Arc::clone(&given_back),
    };
    let policy = sluice_policy::default_policy().expect("the built-in policy");
    let shared = Arc::new(ArcSwap::from_pointee(Limiter::new(policy, store)));
    (shared, given_back)
}

/// The policy's one batch lane over `queue`, sending through `upstream`.
fn lane<U: BatchUpstream + Clone>(
    shared: &SharedLimiter<Refunds>,
    queue: &Arc<dyn BatchQueue>,
    upstream: &U,
) -> Arc<BatchLane<Refunds, U>> {
    let host = LaneHost {
        upstream: upstream.clone(),
        base_path: String::new(),
        host_header: HeaderValue::from_static("upstream.test"),
        peer_of: |_| None,
    };
    let mut lanes = BatchLane::all(shared, queue, host, &SystemClock::new());
    assert_eq!(lanes.len(), 1, "the built-in policy has one batch lane");
    lanes.remove(0)
}

/// A batch of two items, as acme's key submits it (admitted by the limiter,
/// whose headers name the workspace and user).
fn submit_request() -> Request<Full<Bytes>> {
    let body = json!({"items": [{"draft": "one"}, {"draft": "two"}], "idempotency_key": "k-1"});
    Request::post("/messages/optimize/batch")
        .header("x-api-key", "acme-key")
        .header("x-sluice-workspace", "acme")
        .header("x-sluice-user", "ada")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .expect("request")
}

async fn answer<U: BatchUpstream>(
    endpoints: &mut BatchEndpoints<NotFound, Refunds, U>,
    request: Request<Full<Bytes>>,
) -> (StatusCode, Value) {
    use tower::Service as _;
    std::future::poll_fn(|cx| endpoints.poll_ready(cx))
        .await
        .expect("ready");
    let response = endpoints.call(request).await.expect("infallible");
    let status = response.status();
    let bytes = response
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

/// A submit whose commit failed after it wrote the batch (the disk's flush
/// failed): the batch is in the file, so it is queued and runs. It is answered
/// 202 with its id, and the quota its two items were counted at admission stays
/// spent — before, the submit answered 503 and gave the quota back, and the batch
/// ran anyway.
#[tokio::test]
async fn l4_q1_a_batch_stored_by_a_commit_that_failed_keeps_its_quota_and_is_answered_202() {
    let disk = FlushFails::default();
    let store =
        DurableStore::with_backend("flush-fails", disk.clone(), FillableDisk::new().0.log())
            .expect("store");
    let book = BatchBook::open(&store, BatchConfig::default()).expect("batches");
    let queue: Arc<dyn BatchQueue> = Arc::new(book.clone());
    let (shared, given_back) = limiter();
    let lane = lane(&shared, &queue, &Upstream::default());
    let mut endpoints = BatchEndpoints::new(NotFound, Arc::new(vec![lane]));

    // The submit's commit flush fails, once: the file is opened anew after it
    // and reads well.
    disk.fail_next.store(1, Ordering::SeqCst);
    let (status, body) = answer(&mut endpoints, submit_request()).await;
    assert_eq!(disk.fail_next.load(Ordering::SeqCst), 0, "the flush failed");
    let backlog = book.backlogs().await.expect("backlogs");
    assert_eq!(
        backlog
            .iter()
            .map(|b| (b.workspace.as_str(), b.queued))
            .collect::<Vec<_>>(),
        [("acme", 2)],
        "the batch is queued, and will run"
    );
    assert_eq!(
        given_back.load(Ordering::SeqCst),
        0,
        "a batch that runs keeps its quota ({status} {body})"
    );
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    let id = body["batch_id"].as_str().unwrap_or_default().to_owned();
    let stored = book
        .status("acme", &id, SystemClock::new().now())
        .await
        .expect("status");
    assert_eq!(stored.map(|s| (s.total, s.queued)), Some((2, 2)), "{body}");
}

/// A submit whose store cannot even be read back after its commit failed (every
/// flush fails, and with them opening the file anew): the batch may be queued,
/// so it answers 503 `batch_outcome_unknown` and gives no quota back. Once the
/// disk is well, the batch is there and the same submit finds it (and gives back
/// its own count, as every repeat does): its two items cost two units, not zero.
#[tokio::test]
async fn l4_q1_a_submit_whose_outcome_is_unknown_gives_no_quota_back() {
    let disk = FlushFails::default();
    let store =
        DurableStore::with_backend("flush-fails", disk.clone(), FillableDisk::new().0.log())
            .expect("store");
    let book = BatchBook::open(&store, BatchConfig::default()).expect("batches");
    let queue: Arc<dyn BatchQueue> = Arc::new(book.clone());
    let (shared, given_back) = limiter();
    let lane = lane(&shared, &queue, &Upstream::default());
    let mut endpoints = BatchEndpoints::new(NotFound, Arc::new(vec![lane]));

    disk.failing.store(true, Ordering::SeqCst);
    let (status, body) = answer(&mut endpoints, submit_request()).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(
        given_back.load(Ordering::SeqCst),
        0,
        "a batch that may run keeps its quota ({body})"
    );
    assert_eq!(
        body["error"]["details"]["reason"], "batch_outcome_unknown",
        "{body}"
    );

    disk.failing.store(false, Ordering::SeqCst);
    let (status, body) = answer(&mut endpoints, submit_request()).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    let id = body["batch_id"].as_str().unwrap_or_default().to_owned();
    let stored = book
        .status("acme", &id, SystemClock::new().now())
        .await
        .expect("status")
        .expect("the first submit's batch");
    assert_eq!((stored.total, stored.queued), (2, 2));
    assert_eq!(
        given_back.load(Ordering::SeqCst),
        2,
        "only the repeat gives back what it was counted"
    );
}

/// The lane's runner over a `Flaky` queue (on in-memory storage), with one
/// item of acme's queued: the queue, the upstream, the batch id, and what stops
/// the runner.
async fn running(
    fail_records: bool,
) -> (
    Arc<Flaky>,
    Upstream,
    String,
    tokio::sync::oneshot::Sender<()>,
) {
    let (disk, _) = FillableDisk::new();
    let store = DurableStore::with_backend("runner", disk.clone(), disk.log()).expect("store");
    let flaky = Arc::new(Flaky {
        inner: BatchBook::open(&store, BatchConfig::default().with_lease(BATCH_CLAIM))
            .expect("batches"),
        fail_records: AtomicBool::new(fail_records),
        record_attempts: AtomicU32::new(0),
        renewals: AtomicU32::new(0),
    });
    let item = json!({"fields": {"x-api-key": "acme-key"}, "workspace": "acme", "user": "ada", "body": {"draft": "one"}});
    let batch = flaky
        .submit(
            "acme",
            vec![item.to_string().into_bytes()],
            None,
            b"digest",
            SystemClock::new().now(),
        )
        .await
        .expect("submit");
    let queue: Arc<dyn BatchQueue> = Arc::clone(&flaky) as Arc<dyn BatchQueue>;
    let upstream = Upstream::default();
    let (shared, _) = limiter();
    let lane = lane(&shared, &queue, &upstream);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(lane.run(async move {
        let _ = stopped.await;
    }));
    (flaky, upstream, batch.batch_id, stop)
}

async fn item_state(queue: &Flaky, batch: &str) -> (ItemState, Option<ItemResult>) {
    let status = queue
        .status("acme", batch, SystemClock::new().now())
        .await
        .expect("status")
        .expect("batch");
    (status.items[0].state, status.items[0].result.clone())
}

/// Waits (on tokio's paused clock) until `done` holds, up to `within`.
async fn until(within: Duration, mut done: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + within;
    while !done() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "not within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The store cannot record an item's answer for 25 s (longer than a renewal
/// period, shorter than the claim): the runner keeps the answer, keeps the
/// claim renewed, and records it once the store takes it. The item is sent
/// upstream once, and its result is that one answer — before, the answer was
/// dropped at the first failure, the claim no longer renewed, and the item sent
/// again once its claim ran out.
#[tokio::test(start_paused = true)]
async fn l4_an_answer_the_store_could_not_take_is_recorded_later_and_the_item_not_sent_again() {
    let (queue, upstream, batch, _stop) = running(true).await;
    until(Duration::from_secs(5), || {
        queue.record_attempts.load(Ordering::SeqCst) >= 1
    })
    .await;
    assert_eq!(upstream.sent.load(Ordering::SeqCst), 1);
    let renewals_before = queue.renewals.load(Ordering::SeqCst);

    tokio::time::sleep(Duration::from_secs(25)).await;
    assert!(
        queue.renewals.load(Ordering::SeqCst) >= renewals_before + 2,
        "the claim is renewed while the answer waits to be recorded"
    );
    assert!(
        queue.record_attempts.load(Ordering::SeqCst) >= 3,
        "tried again"
    );
    assert_eq!(item_state(&queue, &batch).await.0, ItemState::Running);

    queue.fail_records.store(false, Ordering::SeqCst);
    let mut recorded = None;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while tokio::time::Instant::now() < deadline {
        let (state, result) = item_state(&queue, &batch).await;
        if state == ItemState::Done {
            recorded = result;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        recorded,
        Some(ItemResult {
            status: 200,
            body: ResultBody::Json(br#"{"answer":1}"#.to_vec()),
        }),
        "the first answer is the item's result"
    );
    assert_eq!(upstream.sent.load(Ordering::SeqCst), 1, "sent once");
}

/// A store that never takes the answer: the runner tries for
/// [`MAX_RECORD_WAIT`], then gives up — it stops trying and stops renewing the
/// claim, so the item goes back to the queue when its claim runs out.
#[tokio::test(start_paused = true)]
async fn l4_recording_an_answer_is_tried_for_a_bounded_time() {
    let (queue, upstream, batch, _stop) = running(true).await;
    until(Duration::from_secs(5), || {
        queue.record_attempts.load(Ordering::SeqCst) >= 1
    })
    .await;
    tokio::time::sleep(MAX_RECORD_WAIT + Duration::from_secs(10)).await;
    let (attempts, renewals) = (
        queue.record_attempts.load(Ordering::SeqCst),
        queue.renewals.load(Ordering::SeqCst),
    );
    tokio::time::sleep(MAX_RECORD_WAIT).await;
    assert_eq!(
        queue.record_attempts.load(Ordering::SeqCst),
        attempts,
        "no attempt after the bound"
    );
    assert_eq!(
        queue.renewals.load(Ordering::SeqCst),
        renewals,
        "the claim is no longer renewed"
    );
    assert_eq!(item_state(&queue, &batch).await.0, ItemState::Running);
    assert_eq!(upstream.sent.load(Ordering::SeqCst), 1);
}

/// How the scripted upstream answers: every item 200, …
const UP: u8 = 0;
/// … no item (the connection refused), …
const REFUSING: u8 = 1;
/// … or every item 503.
const UNAVAILABLE: u8 = 2;

/// … or every item 200 with a body longer than a result keeps.
const LARGE: u8 = 3;

/// The workspace whose items the scripted upstream answers 500 whatever its
/// mode: poison items.
const POISON: &str = "poison";

/// An upstream whose answers the tests switch (see [`UP`]), counting the
/// items sent to it, and those of [`POISON`].
#[derive(Clone, Default)]
struct Scripted {
    mode: Arc<AtomicU8>,
    sent: Arc<AtomicU32>,
    sent_poison: Arc<AtomicU32>,
    /// How many of the next answers break off after their first bytes.
    cut_next: Arc<AtomicU32>,
}

/// A scripted answer's body: whole, or breaking off after its first bytes.
enum ScriptedBody {
    Whole(Full<Bytes>),
    BreaksOff(Option<Bytes>),
}

impl http_body::Body for ScriptedBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, std::io::Error>>> {
        match self.get_mut() {
            ScriptedBody::Whole(full) => std::pin::Pin::new(full)
                .poll_frame(cx)
                .map_err(|never| match never {}),
            ScriptedBody::BreaksOff(first) => Poll::Ready(Some(match first.take() {
                Some(bytes) => Ok(http_body::Frame::data(bytes)),
                None => Err(std::io::ErrorKind::ConnectionReset.into()),
            })),
        }
    }
}

impl BatchUpstream for Scripted {
    type Body = ScriptedBody;
    type Error = std::io::Error;

    fn send(
        &self,
        request: Request<ItemBody>,
    ) -> impl Future<Output = Result<Response<ScriptedBody>, std::io::Error>> + Send {
        self.sent.fetch_add(1, Ordering::SeqCst);
        let cut = self
            .cut_next
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        let poison = request
            .headers()
            .get("x-sluice-workspace")
            .is_some_and(|w| w == POISON);
        if poison {
            self.sent_poison.fetch_add(1, Ordering::SeqCst);
        }
        let mode = self.mode.load(Ordering::SeqCst);
        async move {
            let status = match mode {
                REFUSING => {
                    return Err(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
                }
                UNAVAILABLE => StatusCode::SERVICE_UNAVAILABLE,
                _ if poison => StatusCode::INTERNAL_SERVER_ERROR,
                _ => StatusCode::OK,
            };
            let body = match mode {
                _ if cut => ScriptedBody::BreaksOff(Some(Bytes::from_static(b"{\"partial\":"))),
                LARGE => ScriptedBody::Whole(Full::new(Bytes::from(format!(
                    r#"{{"pad":"{}"}}"#,
                    "x".repeat(MAX_RESULT_BYTES)
                )))),
                _ => ScriptedBody::Whole(Full::new(Bytes::from(format!(
                    r#"{{"status":{}}}"#,
                    status.as_u16()
                )))),
            };
            let mut r = Response::new(body);
            *r.status_mut() = status;
            r.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            Ok(r)
        }
    }
}

/// A batch lane with its runner started: the lane, its endpoints, the
/// limiter's `optimizer` lane (where single calls run) and what stops the
/// runner.
type Started = (
    Arc<BatchLane<Refunds, Scripted>>,
    BatchEndpoints<NotFound, Refunds, Scripted>,
    sluice_lanes::Lane,
    tokio::sync::oneshot::Sender<()>,
);

/// The policy's batch lane over an embedded queue (in-memory storage) with
/// its runner started, sending through `upstream`.
fn scripted_lane(upstream: &Scripted) -> Started {
    let (shared, _) = limiter();
    let singles = shared
        .load()
        .lanes()
        .iter()
        .find(|l| l.name() == "optimizer")
        .expect("the built-in policy's optimizer lane")
        .clone();
    let (lane, endpoints, stop) = running_lane(&shared, upstream);
    (lane, endpoints, singles, stop)
}

/// A batch lane with its runner started: the lane, its endpoints and what
/// stops the runner.
type Running<U> = (
    Arc<BatchLane<Refunds, U>>,
    BatchEndpoints<NotFound, Refunds, U>,
    tokio::sync::oneshot::Sender<()>,
);

/// `shared`'s batch lane over an embedded queue (in-memory storage) with its
/// runner started, sending through `upstream`: the lane, its endpoints and
/// what stops the runner.
fn running_lane<U: BatchUpstream + Clone>(
    shared: &SharedLimiter<Refunds>,
    upstream: &U,
) -> Running<U> {
    let (disk, _) = FillableDisk::new();
    let store = DurableStore::with_backend("outage", disk.clone(), disk.log()).expect("store");
    let book =
        BatchBook::open(&store, BatchConfig::default().with_lease(BATCH_CLAIM)).expect("batches");
    let queue: Arc<dyn BatchQueue> = Arc::new(book);
    let lane = lane(shared, &queue, upstream);
    let endpoints = BatchEndpoints::new(NotFound, Arc::new(vec![Arc::clone(&lane)]));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(Arc::clone(&lane).run(async move {
        let _ = stopped.await;
    }));
    (lane, endpoints, stop)
}

/// Submits `n` items as `workspace`'s key does; the batch id.
async fn submit_items<U: BatchUpstream>(
    endpoints: &mut BatchEndpoints<NotFound, Refunds, U>,
    workspace: &str,
    n: usize,
) -> String {
    let items: Vec<Value> = (0..n).map(|i| json!({ "draft": i })).collect();
    let request = Request::post("/messages/optimize/batch")
        .header("x-api-key", format!("{workspace}-key"))
        .header("x-sluice-workspace", workspace)
        .header("x-sluice-user", "ada")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(
            json!({ "items": items }).to_string(),
        )))
        .expect("request");
    let (status, body) = answer(endpoints, request).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    body["batch_id"].as_str().expect("batch_id").to_owned()
}

/// `GET /messages/optimize/batches/{id}` as `workspace` reads it.
async fn batch_status<U: BatchUpstream>(
    endpoints: &mut BatchEndpoints<NotFound, Refunds, U>,
    workspace: &str,
    id: &str,
) -> Value {
    let request = Request::get(format!("/messages/optimize/batches/{id}"))
        .header("x-api-key", format!("{workspace}-key"))
        .header("x-sluice-workspace", workspace)
        .header("x-sluice-user", "ada")
        .body(Full::new(Bytes::new()))
        .expect("request");
    let (status, body) = answer(endpoints, request).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    body
}

/// Waits (on tokio's paused clock) until `workspace`'s batch `id` is done,
/// up to `within`; its status.
async fn finished<U: BatchUpstream>(
    endpoints: &mut BatchEndpoints<NotFound, Refunds, U>,
    workspace: &str,
    id: &str,
    within: Duration,
) -> Value {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let status = batch_status(endpoints, workspace, id).await;
        if status["state"] == "done" {
            return status;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "not done within {within:?}: {status}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The upstream down for five minutes — refusing connections, then (a second
/// run) answering 503 — while no single call is made, so the lane's breaker
/// never opens: the batch's items wait in the queue, shown `queued` with no
/// attempt spent, none `failed`; the upstream gets each item once, then one
/// probe per 30 s. Once it is back, every item ends `done` on its first
/// attempt. Before, each item spent its 3 attempts against the dead upstream
/// and was recorded `failed`: accepted (202) work lost to an outage.
#[tokio::test(start_paused = true)]
async fn l4_batch_items_wait_out_an_upstream_outage_without_spending_attempts() {
    for (mode, what) in [
        (REFUSING, "refusing connections"),
        (UNAVAILABLE, "answering 503"),
    ] {
        let upstream = Scripted::default();
        upstream.mode.store(mode, Ordering::SeqCst);
        let (lane, mut endpoints, _singles, _stop) = scripted_lane(&upstream);
        let id = submit_items(&mut endpoints, "acme", 8).await;

        tokio::time::sleep(Duration::from_secs(300)).await;
        let status = batch_status(&mut endpoints, "acme", &id).await;
        assert_eq!(
            (&status["done"], &status["failed"]),
            (&json!(0), &json!(0)),
            "{what}: {status}"
        );
        let items = status["items"].as_array().expect("items");
        assert_eq!(items.len(), 8);
        for item in items {
            assert!(
                item["state"] == "queued" || item["state"] == "running",
                "{what}: an item waits, queued: {status}"
            );
            // At most the failure that came before the outage showed (the
            // first four of the streak of five) counts.
            assert!(
                item["attempts"].as_u64() <= Some(1),
                "{what}: no attempt spent waiting: {status}"
            );
        }
        assert_eq!(lane.summary()["outage"], true, "{what}");
        let during = upstream.sent.load(Ordering::SeqCst);
        // At most each item once (the failures that showed the outage: five
        // in a row), then one probe every 30 s.
        assert!(
            (5 + 9..=8 + 11).contains(&during),
            "{what}: {during} items sent in five minutes of outage"
        );

        upstream.mode.store(UP, Ordering::SeqCst);
        let status = finished(&mut endpoints, "acme", &id, Duration::from_secs(60)).await;
        assert_eq!(
            (&status["done"], &status["failed"]),
            (&json!(8), &json!(0)),
            "{what}: {status}"
        );
        for item in status["items"].as_array().expect("items") {
            assert_eq!(
                (&item["state"], &item["status"]),
                (&json!("done"), &json!(200)),
                "{what}: {status}"
            );
            assert!(
                item["attempts"].as_u64() <= Some(2),
                "{what}: done on its first attempt after the outage: {status}"
            );
        }
        assert_eq!(
            upstream.sent.load(Ordering::SeqCst),
            during + 8,
            "{what}: each item once more"
        );
        assert_eq!(lane.summary()["outage"], false, "{what}");
    }
}

/// The upstream answers 500 to the poison workspace's items while it answers
/// another workspace's items and single calls (one every 0.7 s): those
/// failures are the items' own, not an outage. The poison items fail after
/// their 3 attempts each (sent exactly 3 times), the other workspace's batch
/// finishes, and dispatch never pauses.
#[tokio::test(start_paused = true)]
async fn l4_poison_items_of_one_workspace_still_fail_after_their_attempts() {
    let upstream = Scripted::default();
    let (lane, mut endpoints, singles, _stop) = scripted_lane(&upstream);
    let calls = tokio::spawn(async move {
        // Each from a workspace of its own (one workspace may start 12 a
        // minute).
        for n in 0u32.. {
            let permit = singles
                .acquire(&format!("single-{n}"), Duration::from_secs(15))
                .await;
            permit
                .expect("a place")
                .finish(sluice_lanes::Outcome::Success);
            tokio::time::sleep(Duration::from_millis(700)).await;
        }
    });
    let poison = submit_items(&mut endpoints, POISON, 6).await;
    let acme = submit_items(&mut endpoints, "acme", 10).await;

    let status = finished(&mut endpoints, POISON, &poison, Duration::from_secs(300)).await;
    assert_eq!(
        (&status["done"], &status["failed"]),
        (&json!(0), &json!(6)),
        "{status}"
    );
    for item in status["items"].as_array().expect("items") {
        assert_eq!(
            (&item["state"], &item["status"]),
            (&json!("failed"), &json!(500)),
            "{status}"
        );
    }
    // Each poison item is sent for its attempts. (Poison items failing
    // together, no single call's answer between them, may look like an
    // outage for a moment; the failure that showed it is not counted, so an
    // item may be sent once more.)
    let sent = upstream.sent_poison.load(Ordering::SeqCst);
    assert!(
        (6 * MAX_ATTEMPTS..=6 * (MAX_ATTEMPTS + 1)).contains(&sent),
        "{sent} poison items sent"
    );
    let status = finished(&mut endpoints, "acme", &acme, Duration::from_secs(60)).await;
    assert_eq!(
        (&status["done"], &status["failed"]),
        (&json!(10), &json!(0)),
        "{status}"
    );
    assert_eq!(lane.summary()["outage"], false);
    calls.abort();
}

/// The one state that cannot be told from an outage: a workspace alone has
/// items queued, all poison, and nothing else calls the upstream. Its items
/// wait, queued, and the upstream gets one probe per 30 s — a bounded cost —
/// until another call is answered. Before, they failed after their attempts
/// (as they must when others' calls are answered: see the test above).
#[tokio::test(start_paused = true)]
async fn l4_items_failing_alone_with_no_other_calls_wait_with_one_probe_per_30_s() {
    let upstream = Scripted::default();
    let (lane, mut endpoints, _singles, _stop) = scripted_lane(&upstream);
    let id = submit_items(&mut endpoints, POISON, 2).await;
    tokio::time::sleep(Duration::from_secs(60)).await;
    let before = upstream.sent.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_secs(600)).await;
    let probes = upstream.sent.load(Ordering::SeqCst) - before;
    assert!(
        (19..=21).contains(&probes),
        "{probes} items sent in 10 minutes"
    );
    let status = batch_status(&mut endpoints, POISON, &id).await;
    assert_eq!(status["failed"], 0, "{status}");
    assert_eq!(lane.summary()["outage"], true);
}

/// An answer the runner could not read whole is never recorded as an empty
/// success: one that breaks off is no answer (the item is sent again, with the
/// same Idempotency-Key, and ends `done` with the next answer), and one longer
/// than a result keeps is recorded `failed`, saying so, with the upstream's
/// status. Before, both were `done`, status 200, with an empty result: the
/// item's answer lost without a word.
#[tokio::test(start_paused = true)]
async fn l4_an_answer_cut_off_or_too_large_is_never_an_empty_success() {
    let upstream = Scripted::default();
    upstream.cut_next.store(1, Ordering::SeqCst);
    let (_lane, mut endpoints, _singles, _stop) = scripted_lane(&upstream);
    let id = submit_items(&mut endpoints, "acme", 1).await;
    let status = finished(&mut endpoints, "acme", &id, Duration::from_secs(120)).await;
    let item = &status["items"][0];
    assert_eq!(item["state"], "done", "{status}");
    assert_eq!(item["result"], json!({ "status": 200 }), "{status}");
    assert_eq!(upstream.sent.load(Ordering::SeqCst), 2, "sent again once");

    let upstream = Scripted::default();
    upstream.mode.store(LARGE, Ordering::SeqCst);
    let (_lane, mut endpoints, _singles, _stop) = scripted_lane(&upstream);
    let id = submit_items(&mut endpoints, "acme", 1).await;
    let status = finished(&mut endpoints, "acme", &id, Duration::from_secs(120)).await;
    let item = &status["items"][0];
    assert_eq!(item["state"], "failed", "{status}");
    assert_eq!(item["status"], 200, "{status}");
    assert!(
        item["result"]
            .as_str()
            .is_some_and(|r| r.contains("was not kept")),
        "{status}"
    );
    assert_eq!(upstream.sent.load(Ordering::SeqCst), 1, "not sent again");
}

/// An upstream that answers each item 200 after a second, counting the items
/// sent with each `X-API-Key`.
#[derive(Clone, Default)]
struct Slow {
    sent: Arc<parking_lot::Mutex<std::collections::HashMap<String, u32>>>,
}

impl Slow {
    fn sent(&self, key: &str) -> u32 {
        self.sent.lock().get(key).copied().unwrap_or(0)
    }
}

impl BatchUpstream for Slow {
    type Body = Full<Bytes>;
    type Error = Infallible;

    fn send(
        &self,
        request: Request<ItemBody>,
    ) -> impl Future<Output = Result<Response<Full<Bytes>>, Infallible>> + Send {
        let key = request
            .headers()
            .get("x-api-key")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        *self.sent.lock().entry(key).or_default() += 1;
        async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let mut r = Response::new(Full::new(Bytes::from_static(b"{}")));
            r.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            Ok(r)
        }
    }
}

/// A credential revoked through the admin API while its batch waits in the
/// queue sends nothing more upstream: each of its items not yet sent is
/// recorded `failed`, 403, `details.reason: "credential_revoked"`, as its own
/// requests are refused at the door; items already on their way finish. Another
/// credential's batch runs on. Before, the revoked credential's queued items
/// kept going upstream with it until the batch was done.
#[tokio::test(start_paused = true)]
async fn l4_p4_a_revoked_credential_s_queued_items_are_never_sent() {
    let upstream = Slow::default();
    let (shared, _) = limiter();
    let (_lane, mut endpoints, _stop) = running_lane(&shared, &upstream);
    let revoked = submit_items(&mut endpoints, "acme", 20).await;
    let kept = submit_items(&mut endpoints, "globex", 5).await;
    until(Duration::from_secs(30), || upstream.sent("acme-key") >= 1).await;

    let mut policy = shared.load().policy().clone();
    let sha: [u8; 32] = <sha2::Sha256 as sha2::Digest>::digest(b"acme-key").into();
    policy.identity.revoked.insert(sha);
    let reloaded = shared.load().reloaded(policy).expect("reload");
    shared.store(Arc::new(reloaded));
    let sent_before = upstream.sent("acme-key");

    let status = finished(&mut endpoints, "acme", &revoked, Duration::from_secs(600)).await;
    assert_eq!(
        upstream.sent("acme-key"),
        sent_before,
        "nothing sent with the credential after its revocation"
    );
    let items = status["items"].as_array().expect("items");
    let failed: Vec<&Value> = items.iter().filter(|i| i["state"] == "failed").collect();
    let done = items.iter().filter(|i| i["state"] == "done").count();
    assert_eq!(
        done, sent_before as usize,
        "the items already sent finish: {status}"
    );
    assert_eq!(failed.len(), 20 - done, "{status}");
    assert!(!failed.is_empty(), "{status}");
    for item in failed {
        assert_eq!(item["status"], 403, "{item}");
        assert_eq!(
            item["result"]["error"]["details"]["reason"], "credential_revoked",
            "{item}"
        );
    }
    let other = finished(&mut endpoints, "globex", &kept, Duration::from_secs(600)).await;
    assert!(
        other["items"]
            .as_array()
            .expect("items")
            .iter()
            .all(|i| i["state"] == "done"),
        "{other}"
    );
    assert_eq!(upstream.sent("globex-key"), 5);
}
