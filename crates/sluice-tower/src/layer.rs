//! The tower `Layer` and `Service`: classify, decide, answer.

use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use arc_swap::ArcSwap;
use bytes::Bytes;
use http::header::{CONNECTION, HOST, HeaderValue};
use http::{Request, Response, StatusCode, Version};
use http_body::Body;
use http_body_util::{BodyExt, Either, Full};
use sluice_store::BudgetStore;
use tower::{Layer, Service};

use crate::settle::Settling;
use sluice_edge::{BodyFailure, Intake, Limiter, Refused, SharedLimiter, upstream_timed_out};

/// The connection's peer address, as a request extension. A server inserts it per
/// connection (sluice's gateway does); the layer also reads axum's
/// `ConnectInfo<SocketAddr>` (feature `axum`, on by default) and a function given
/// with [`SluiceLayer::with_peer`]. A request with no address at all is refused (500)
/// rather than counted as one caller with every other anonymous one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerAddr(pub SocketAddr);

/// A function that finds a request's client address (e.g. from a header set by a
/// trusted load balancer, or an extension of the server's).
pub type PeerFn = Arc<dyn Fn(&http::request::Parts) -> Option<IpAddr> + Send + Sync>;

/// A function that names a request's caller by a key of the application's choosing
/// (a user id, a tenant, a key from where the policy does not look; see
/// [`SluiceLayer::with_key`]). `None` leaves the caller to the policy's credential
/// sources and the client address.
pub type KeyFn = Arc<dyn Fn(&http::request::Parts) -> Option<Vec<u8>> + Send + Sync>;

/// The client address of `parts`: [`PeerAddr`], then axum's `ConnectInfo`, then `peer_fn`.
fn peer_of(parts: &http::request::Parts, peer_fn: Option<&PeerFn>) -> Option<IpAddr> {
    if let Some(p) = parts.extensions.get::<PeerAddr>() {
        return Some(p.0.ip());
    }
    #[cfg(feature = "axum")]
    if let Some(axum::extract::ConnectInfo(addr)) = parts
        .extensions
        .get::<axum::extract::ConnectInfo<SocketAddr>>()
    {
        return Some(addr.ip());
    }
    peer_fn.and_then(|f| f(parts))
}

/// The answer to a request whose client address the layer cannot find, said once
/// on stderr too: counting every such caller as one would give the whole internet
/// one budget.
fn no_peer_address() -> Response<Full<Bytes>> {
    static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if !SAID.swap(true, std::sync::atomic::Ordering::Relaxed) {
        eprintln!(
            "sluice: a request reached SluiceLayer with no client address: insert sluice_tower::PeerAddr, \
             serve with axum's into_make_service_with_connect_info::<SocketAddr>(), or give \
             SluiceLayer::with_peer a function; such requests are refused (500)"
        );
    }
    sluice_edge::envelope_response(
        http::StatusCode::INTERNAL_SERVER_ERROR,
        "no_client_address",
        "The rate limiter could not find the client's address, so it cannot count this request.",
        serde_json::json!({}),
    )
}

/// The body sluice answers with: its own refusals, or the inner service's —
/// as it came, or, for an LLM call, read for its `usage` as it passes (the
/// call's token budgets settle when it ends; SPEC T3).
pub type SluiceBody<B> = Either<Full<Bytes>, Either<B, Settling<B>>>;

/// Wraps a service with a [`Limiter`]. A request carrying a [`RequestId`](sluice_edge::RequestId)
/// extension has its refusal logged under that id (see [`sluice_edge::Planned::admit`]).
pub struct SluiceLayer<S> {
    limiter: SharedLimiter<S>,
    peer_fn: Option<PeerFn>,
    key_fn: Option<KeyFn>,
    batch_repeats: bool,
}

impl<S> SluiceLayer<S> {
    /// A layer deciding with `limiter`. With leased budgets on a store shared
    /// by replicas, give their leftovers back as `sluice serve` does: call
    /// [`Limiter::keep_leases`] every [`sluice_edge::SWEEP_EVERY`] while it
    /// returns true, await [`Limiter::leases_to_keep`] when it returns false,
    /// and call it with `ending` once the service stops.
    pub fn new(limiter: Arc<Limiter<S>>) -> Self {
        Self::reloadable(Arc::new(ArcSwap::new(limiter)))
    }

    /// A layer deciding with whichever limiter `limiter` holds when a request
    /// arrives: store another in it (see [`Limiter::reloaded`]) and the next
    /// requests are decided by it.
    pub fn reloadable(limiter: SharedLimiter<S>) -> Self {
        SluiceLayer {
            limiter,
            peer_fn: None,
            key_fn: None,
            batch_repeats: false,
        }
    }

    /// The same layer finding a request's client address with `peer` when it has
    /// neither a [`PeerAddr`] nor axum's `ConnectInfo`.
    #[must_use]
    pub fn with_peer(
        mut self,
        peer: impl Fn(&http::request::Parts) -> Option<IpAddr> + Send + Sync + 'static,
    ) -> Self {
        self.peer_fn = Some(Arc::new(peer));
        self
    }

    /// The same layer naming each request's caller by the key `key` returns for it
    /// (tower-governor's key extractor): the caller's class budgets, buckets and
    /// quotas are that key's, counted as a credential with those bytes would be
    /// (its principal from the policy's key table when the table holds it). Where
    /// `key` returns `None`, the policy's credential sources and the client address
    /// name the caller as usual. Per-IP ceilings still apply to the client address.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use sluice_store::{MemoryConfig, MemoryStore};
    /// use sluice_tower::{Limiter, SluiceLayer};
    ///
    /// let policy = sluice_policy::default_policy().expect("the built-in policy");
    /// let store = MemoryStore::new(MemoryConfig::default());
    /// let limiter = Arc::new(Limiter::new(policy, store));
    /// // Budgets per user id, from a header an authenticating layer in front sets.
    /// let layer = SluiceLayer::new(limiter).with_key(|parts| {
    ///     parts.headers.get("x-user-id").map(|v| v.as_bytes().to_vec())
    /// });
    /// # let _ = layer;
    /// ```
    #[must_use]
    pub fn with_key(
        mut self,
        key: impl Fn(&http::request::Parts) -> Option<Vec<u8>> + Send + Sync + 'static,
    ) -> Self {
        self.key_fn = Some(Arc::new(key));
        self
    }

    /// The same layer in front of sluice-batch's `BatchEndpoints`: a batch
    /// submit that a monthly quota refuses is passed on with the refusal as a
    /// [`RefusedUnlessRepeat`](sluice_edge::RefusedUnlessRepeat) extension, so
    /// that a repeat of a batch those items already counted is answered as it
    /// was (202, the same `batch_id`). Only for an inner service that answers
    /// every such request itself: one that forwards it would forward a refused
    /// request.
    #[must_use]
    pub fn with_batch_repeats(mut self) -> Self {
        self.batch_repeats = true;
        self
    }
}

impl<S> Clone for SluiceLayer<S> {
    fn clone(&self) -> Self {
        SluiceLayer {
            limiter: Arc::clone(&self.limiter),
            peer_fn: self.peer_fn.clone(),
            key_fn: self.key_fn.clone(),
            batch_repeats: self.batch_repeats,
        }
    }
}

impl<S, I> Layer<I> for SluiceLayer<S> {
    type Service = SluiceService<S, I>;

    fn layer(&self, inner: I) -> Self::Service {
        SluiceService {
            limiter: Arc::clone(&self.limiter),
            inner,
            peer_fn: self.peer_fn.clone(),
            key_fn: self.key_fn.clone(),
            batch_repeats: self.batch_repeats,
        }
    }
}

/// A request extension the layer sets on a call through a guarded lane: how long
/// the upstream may take to answer it (the lane's timeout), for a service that
/// forwards the request and has a shorter timeout of its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UpstreamTimeout(pub std::time::Duration);

/// The service [`SluiceLayer`] makes. It never waits in `poll_ready` beyond
/// the inner service: a refusal is answered at once.
pub struct SluiceService<S, I> {
    limiter: SharedLimiter<S>,
    inner: I,
    peer_fn: Option<PeerFn>,
    key_fn: Option<KeyFn>,
    batch_repeats: bool,
}

impl<S, I: Clone> Clone for SluiceService<S, I> {
    fn clone(&self) -> Self {
        SluiceService {
            limiter: Arc::clone(&self.limiter),
            inner: self.inner.clone(),
            peer_fn: self.peer_fn.clone(),
            key_fn: self.key_fn.clone(),
            batch_repeats: self.batch_repeats,
        }
    }
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, I, B, RB> Service<Request<B>> for SluiceService<S, I>
where
    S: BudgetStore + Send + Sync + 'static,
    I: Service<Request<B>, Response = Response<RB>> + Clone + Send + 'static,
    I::Future: Send + 'static,
    RB: Body<Data = Bytes> + Send + 'static,
    B: Body + From<Bytes> + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    type Response = Response<SluiceBody<RB>>;
    type Error = I::Error;
    type Future = BoxFuture<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        // The clone is not ready; the one polled ready is taken for this call.
        let ready = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, ready);
        let limiter = self.limiter.load_full();
        let peer_fn = self.peer_fn.clone();
        let key_fn = self.key_fn.clone();
        let batch_repeats = self.batch_repeats;
        Box::pin(async move {
            let (mut parts, body) = request.into_parts();
            // Phase 1 (see `sluice_edge::Intake`): a head RFC 9112 refuses (no
            // `Host`, several), or `CONNECT`, then a path with no normal form, then
            // a route the head cannot have, each refused before anything is read.
            // Routed and forwarded as the upstream will read the path.
            let path = limiter.normalize_target(&mut parts.uri);
            let hosts = parts.headers.get_all(HOST).iter().map(|v| v.as_bytes());
            let route = limiter.route_head(
                &parts.method,
                parts.version,
                hosts,
                path.map(|()| parts.uri.path()),
                Some(&parts.headers),
            );
            let Some(peer) = peer_of(&parts, peer_fn.as_ref()) else {
                return Ok(no_peer_address().map(Either::Left));
            };
            let request_id = parts.extensions.get::<sluice_edge::RequestId>().cloned();
            let mut intake = limiter.intake(route, peer);
            intake.set_path(parts.uri.path());
            if let Some(mut answer) = intake.refused(request_id.as_ref()) {
                if route == Err(Refused::Connect) && parts.version <= Version::HTTP_11 {
                    // What follows a CONNECT head may be a tunnel's bytes.
                    answer
                        .headers_mut()
                        .insert(CONNECTION, HeaderValue::from_static("close"));
                }
                return Ok(answer.map(Either::Left));
            }
            let key = key_fn.as_ref().and_then(|f| f(&parts));
            // Phase 2: the body, in whole, when the route takes its class from it.
            let body = match intake.body_bound() {
                None => body,
                Some(_) => match take_body(body, &mut intake, &parts.headers).await {
                    Ok(whole) => B::from(whole),
                    Err(failure) => return Ok(intake.body_refusal(failure).map(Either::Left)),
                },
            };
            // Phases 3 and 4: planned and admitted; what cannot be counted is
            // refused before anything is decided.
            let planned = intake.planned(&parts.headers, key.as_deref(), None);
            // A batch submit's upstream head, made now for the batch lane in case
            // a monthly quota refuses it: it may repeat a batch whose items that
            // quota already counted (see `RefusedUnlessRepeat`).
            let repeat_head = match (route, planned.plan()) {
                (Ok(Some(r)), Ok(plan))
                    if batch_repeats
                        && matches!(r.batch, Some(sluice_policy::BatchEndpoint::Submit(_))) =>
                {
                    let mut headers = parts.headers.clone();
                    sluice_edge::upstream_headers(&mut headers, plan, limiter.policy());
                    Some(headers)
                }
                _ => None,
            };
            // A call waiting for its lane's place waits while its client is there
            // (when the transport watches it): one that hangs up leaves the line.
            let hangup = parts
                .extensions
                .remove::<sluice_edge::Hangup>()
                .filter(|_| planned.plan().is_ok_and(|p| p.lane.is_some()));
            let admitted = match hangup {
                Some(hangup) => {
                    tokio::select! {
                        admitted = planned.admit(request_id.as_ref()) => admitted,
                        () = hangup.wait() => return Ok(client_gone().map(Either::Left)),
                    }
                }
                None => planned.admit(request_id.as_ref()).await,
            };
            let mut forward = match admitted {
                Ok(forward) => forward,
                Err(answer) => {
                    if let Some(headers) = repeat_head
                        && answer
                            .extensions()
                            .get::<sluice_edge::QuotaRefusal>()
                            .is_some()
                    {
                        // Nothing was spent: the lane answers a repeat, or this.
                        parts.headers = headers;
                        parts.extensions.insert(sluice_edge::QuotaSpent::default());
                        parts
                            .extensions
                            .insert(sluice_edge::RefusedUnlessRepeat::new(answer));
                        let response = inner.call(Request::from_parts(parts, body)).await?;
                        return Ok(response.map(|b| Either::Right(Either::Left(b))));
                    }
                    return Ok(answer.map(Either::Left));
                }
            };
            // An agent run's endpoint (SPEC T7): answered here for its caller,
            // never forwarded.
            if let Some(endpoint) = forward.run_endpoint(parts.uri.path()) {
                let body = match body_of_run_call(body).await {
                    Ok(body) => body,
                    Err(answer) => return Ok((*answer).map(Either::Left)),
                };
                let answer = forward.answer_run(endpoint, &parts.method, &body).await;
                return Ok(answer.map(Either::Left));
            }
            // An OpenAI stream that does not ask for its usage is asked for it, so
            // its token budgets settle at the truth; the client does not see it.
            let mut hide_usage = false;
            let mut body = body;
            if forward.plan().llm == Some(sluice_policy::LlmFormat::OpenAi)
                && let Some(asked) = intake
                    .whole()
                    .and_then(|b| sluice_edge::tokens::ask_stream_usage(parts.uri.path(), b))
            {
                parts.headers.remove(http::header::TRANSFER_ENCODING);
                parts
                    .headers
                    .insert(http::header::CONTENT_LENGTH, HeaderValue::from(asked.len()));
                body = B::from(Bytes::from(asked));
                hide_usage = true;
            }
            // Phase 5: the upstream head, and what was spent of each monthly quota
            // for the service behind (a batch lane gives back what it does not queue).
            forward.upstream_headers(&mut parts.headers);
            parts.extensions.insert(forward.quota_spent());
            // An LLM call that may reach the upstream from here on settles however
            // this future ends: at its answer's usage, or, with no answer to
            // settle at (an error, a timeout, a client that cancels its stream
            // while it waits), at its reservation, counted as spent (SPEC T3).
            let mut unsettled = Unsettled::new(&limiter, forward.settlement());
            let mut response = if forward.in_lane() {
                // A call through a lane may take as long as the lane allows (an
                // upstream that forwards reads it from the extension); past it, it is
                // cut and counts as a failure.
                let timeout = forward.upstream_timeout(std::time::Duration::MAX);
                parts.extensions.insert(UpstreamTimeout(timeout));
                // Whether the client's body has all come, where the transport
                // says (sluice's gateway does).
                let upload = parts.extensions.get::<sluice_edge::UploadEnded>().cloned();
                let call = inner.call(Request::from_parts(parts, body));
                // With no answer, `unsettled` settles at the reservation as it
                // drops.
                match tokio::time::timeout(timeout, call).await {
                    Ok(Ok(response)) => response,
                    Ok(Err(error)) => {
                        forward.finish(None);
                        return Err(error);
                    }
                    // The client still sending its body when the time ran out:
                    // the wait was its doing, never the upstream's (no failure
                    // for the lane's breaker): a body that came too slowly.
                    Err(_) if upload.as_ref().is_some_and(|u| !u.ended()) => {
                        let mut r = sluice_edge::body_too_slow(timeout);
                        forward.upload_too_slow(r.status().as_u16(), r.headers_mut());
                        return Ok(r.map(Either::Left));
                    }
                    Err(_) => {
                        let mut r = upstream_timed_out(timeout);
                        forward.upstream_failed(r.headers_mut());
                        return Ok(r.map(Either::Left));
                    }
                }
            } else {
                inner.call(Request::from_parts(parts, body)).await?
            };
            // Phase 6: the response head.
            let status = response.status().as_u16();
            // An answer sluice made for an upstream that failed after the call
            // reached it is no error answered before generation.
            let may_have_run = response
                .extensions()
                .get::<sluice_edge::tokens::UpstreamMayHaveRun>()
                .is_some();
            forward.response_head(status, response.headers_mut()).await;
            // The body's lease is held until the inner service has answered.
            drop(intake);
            // From here the answer's body settles the call.
            let Some((limiter, (plan, decision))) = unsettled.take() else {
                return Ok(response.map(|b| Either::Right(Either::Left(b))));
            };
            if hide_usage {
                // The answer loses a chunk on its way: its length is no longer the
                // upstream's.
                response.headers_mut().remove(http::header::CONTENT_LENGTH);
            }
            // An LLM call: its token budgets settle at the answer's `usage`, read
            // as the body passes (never held whole).
            let content_type = response
                .headers()
                .get(http::header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned);
            let settle: crate::settle::Settle = Box::new(move |usage| {
                Box::pin(async move {
                    let failed = status >= 400 && !may_have_run;
                    limiter.settle_usage(&plan, decision, usage, failed).await;
                })
            });
            Ok(response.map(|b| {
                let settling = Settling::new(b, content_type.as_deref(), settle);
                Either::Right(Either::Right(if hide_usage {
                    settling.hiding_usage_chunk()
                } else {
                    settling
                }))
            }))
        })
    }
}

/// What settles an LLM call: its plan and decision ([`Limiter::settle_usage`]).
type Settlement = (Box<sluice_edge::Plan>, sluice_core::Decision);

/// An LLM call's settlement while nothing else holds it: dropped still holding
/// it (the service's future ended or was dropped before an answer's body took
/// it over), it settles the call at its reservation, on the runtime, as one
/// that may have reached the upstream and has no usage to settle at (SPEC T3).
struct Unsettled<S: BudgetStore + Send + Sync + 'static> {
    settlement: Option<(Arc<Limiter<S>>, Settlement)>,
}

impl<S: BudgetStore + Send + Sync + 'static> Unsettled<S> {
    fn new(limiter: &Arc<Limiter<S>>, settlement: Option<Settlement>) -> Self {
        Unsettled {
            settlement: settlement.map(|s| (Arc::clone(limiter), s)),
        }
    }

    /// The settlement, for the answer's body to settle at its usage.
    fn take(&mut self) -> Option<(Arc<Limiter<S>>, Settlement)> {
        self.settlement.take()
    }
}

impl<S: BudgetStore + Send + Sync + 'static> Drop for Unsettled<S> {
    fn drop(&mut self) {
        // Outside a runtime (none to settle on) the reservation stands uncounted.
        if let (Some((limiter, (plan, decision))), Ok(runtime)) = (
            self.settlement.take(),
            tokio::runtime::Handle::try_current(),
        ) {
            runtime.spawn(async move {
                limiter.settle_usage(&plan, decision, None, false).await;
            });
        }
    }
}

/// The most bytes a run endpoint's body may hold (a `continue`'s `{"turns": N}`).
const MAX_RUN_CALL_BODY: usize = 4_096;

/// The body of a call to a run endpoint, whole, within [`MAX_RUN_CALL_BODY`]
/// and [`RUN_CALL_BODY_DEADLINE`].
///
/// # Errors
/// 413 for a longer one, 400 for one that breaks off, 408 for a slow one.
async fn body_of_run_call<B>(body: B) -> Result<Bytes, Box<Response<Full<Bytes>>>>
where
    B: Body,
{
    use bytes::Buf as _;
    let read = async {
        let mut whole = Vec::new();
        let mut body = std::pin::pin!(body);
        while let Some(frame) = body.as_mut().frame().await {
            let Ok(frame) = frame else {
                return Err(Box::new(sluice_edge::body_unreadable()));
            };
            let Ok(mut data) = frame.into_data() else {
                continue;
            };
            if whole.len() + data.remaining() > MAX_RUN_CALL_BODY {
                return Err(Box::new(sluice_edge::payload_too_large(MAX_RUN_CALL_BODY)));
            }
            while data.has_remaining() {
                let chunk = data.chunk();
                whole.extend_from_slice(chunk);
                let n = chunk.len();
                data.advance(n);
            }
        }
        Ok(Bytes::from(whole))
    };
    tokio::time::timeout(RUN_CALL_BODY_DEADLINE, read)
        .await
        .unwrap_or_else(|_| Err(Box::new(sluice_edge::body_too_slow(RUN_CALL_BODY_DEADLINE))))
}

/// How long a run endpoint's body may take to arrive.
const RUN_CALL_BODY_DEADLINE: std::time::Duration = std::time::Duration::from_secs(10);

/// Phase 2 for a body the route is classified by: one announced past the bound
/// is not read (the intake answers 413 once decided); any other is leased, at
/// once, from the gateway's bound (with hyper's read buffer meanwhile), charged
/// to the client, then taken frame by frame, each copied and let go, whole
/// within the limiter's body deadline. What the inner service is handed: the
/// whole body, or nothing for one past the bound.
async fn take_body<B, S>(
    body: B,
    intake: &mut Intake<'_, S>,
    headers: &http::HeaderMap,
) -> Result<Bytes, BodyFailure>
where
    B: Body,
    S: BudgetStore,
{
    let announced = body.size_hint().exact();
    if announced.is_some_and(|n| intake.too_large(n)) {
        return Ok(Bytes::new());
    }
    intake.lease_whole(announced, headers)?;
    let whole_by = intake.whole_by();
    let read = async {
        let mut body = std::pin::pin!(body);
        while let Some(frame) = body.as_mut().frame().await {
            let Ok(frame) = frame else {
                return Err(BodyFailure::Unreadable);
            };
            let Ok(data) = frame.into_data() else {
                continue;
            };
            if !intake.push(data)? {
                return Ok(Bytes::new());
            }
        }
        Ok(intake.take_whole(&[]))
    };
    tokio::time::timeout_at(whole_by, read)
        .await
        .unwrap_or(Err(BodyFailure::TooSlow))
}

/// The answer to a call whose client hung up while it waited: nobody reads it
/// (499, as nginx logs a client that closed the connection).
fn client_gone() -> Response<Full<Bytes>> {
    let mut answer = Response::new(Full::new(Bytes::new()));
    *answer.status_mut() = StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST);
    answer
        .headers_mut()
        .insert(CONNECTION, HeaderValue::from_static("close"));
    answer
}
