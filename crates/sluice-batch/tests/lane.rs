//! The batch lane over a queue whose store fails at the worst moment (SPEC L4
//! with Q1): a submit whose store's answer is lost keeps its quota spent when the
//! batch may be queued.
//!
//! The lane runs as a gateway runs it (its endpoints, the built-in policy's
//! limiter over a memory store), over the embedded queue on in-memory storage
//! whose faults the tests switch on and off.

#![cfg(all(feature = "durable", feature = "lane"))]

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, Ordering};
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{HeaderValue, Request, Response, StatusCode, header};
use http_body_util::{BodyExt as _, Full};
use redb::StorageBackend;
use redb::backends::InMemoryBackend;
use serde_json::{Value, json};
use sluice_batch::lane::{BatchEndpoints, BatchLane, BatchUpstream, ItemBody, LaneBody, LaneHost};
use sluice_batch::{BatchBook, BatchConfig, BatchQueue};
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
fn lane(
    shared: &SharedLimiter<Refunds>,
    queue: &Arc<dyn BatchQueue>,
    upstream: &Upstream,
) -> Arc<BatchLane<Refunds, Upstream>> {
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

async fn answer(
    endpoints: &mut BatchEndpoints<NotFound, Refunds, Upstream>,
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
