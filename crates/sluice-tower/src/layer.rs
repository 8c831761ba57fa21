//! The tower `Layer` and `Service`: classify, decide, answer.

use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use arc_swap::ArcSwap;
use bytes::{Buf as _, Bytes, BytesMut};
use http::header::{CONNECTION, HOST, HeaderValue};
use http::{Request, Response, Version};
use http_body::Body;
use http_body_util::{BodyExt, Either, Full};
use sluice_store::BudgetStore;
use tower::{Layer, Service};

use sluice_edge::{
    BodyRead, Limiter, Refused, SharedLimiter, body_too_slow, body_unreadable, buffers_refusal,
    upstream_timed_out,
};

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

/// The body sluice answers with: its own refusals, or the inner service's.
pub type SluiceBody<B> = Either<Full<Bytes>, B>;

/// Wraps a service with a [`Limiter`]. A request carrying a [`RequestId`](sluice_edge::RequestId)
/// extension has its refusal logged under that id (see [`Limiter::admit_as`]).
pub struct SluiceLayer<S> {
    limiter: SharedLimiter<S>,
    peer_fn: Option<PeerFn>,
    key_fn: Option<KeyFn>,
}

impl<S> SluiceLayer<S> {
    /// A layer deciding with `limiter`.
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
}

impl<S> Clone for SluiceLayer<S> {
    fn clone(&self) -> Self {
        SluiceLayer {
            limiter: Arc::clone(&self.limiter),
            peer_fn: self.peer_fn.clone(),
            key_fn: self.key_fn.clone(),
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
}

impl<S, I: Clone> Clone for SluiceService<S, I> {
    fn clone(&self) -> Self {
        SluiceService {
            limiter: Arc::clone(&self.limiter),
            inner: self.inner.clone(),
            peer_fn: self.peer_fn.clone(),
            key_fn: self.key_fn.clone(),
        }
    }
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, I, B, RB> Service<Request<B>> for SluiceService<S, I>
where
    S: BudgetStore + Send + Sync + 'static,
    I: Service<Request<B>, Response = Response<RB>> + Clone + Send + 'static,
    I::Future: Send + 'static,
    RB: Send,
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
        Box::pin(async move {
            let (mut parts, body) = request.into_parts();
            // A head RFC 9112 refuses (no `Host`, several), or `CONNECT`, is refused
            // before anything is read of it.
            let hosts = parts.headers.get_all(HOST).iter().map(|v| v.as_bytes());
            if let Err(refused) = sluice_edge::check_head(&parts.method, parts.version, hosts) {
                let mut answer = refused.response();
                if refused == Refused::Connect && parts.version <= Version::HTTP_11 {
                    // What follows a CONNECT head may be a tunnel's bytes.
                    answer
                        .headers_mut()
                        .insert(CONNECTION, HeaderValue::from_static("close"));
                }
                return Ok(answer.map(Either::Left));
            }
            // Routed and forwarded as the upstream will read the path; one that has
            // no normal form is refused before anything is decided.
            if let Err(refused) = limiter.normalize_target(&mut parts.uri) {
                return Ok(refused.response().map(Either::Left));
            }
            let Some(peer) = peer_of(&parts, peer_fn.as_ref()) else {
                return Ok(no_peer_address().map(Either::Left));
            };
            let key = key_fn.as_ref().and_then(|f| f(&parts));
            let route = match limiter.route(&parts) {
                Ok(route) => route,
                Err(refused) => return Ok(refused.response().map(Either::Left)),
            };
            // Phase 2: the body, in whole, when the route takes its class from it.
            let mut _lease = None;
            let (body, taken) = match limiter.body_bound(route) {
                None => (body, None),
                Some(max) => {
                    // The body is held in memory, in pieces within its size (or the
                    // bound, when it is not announced): that, and the server's read
                    // buffer meanwhile, is leased from the gateway's one bound first,
                    // charged to the client, and the body must arrive whole within the
                    // body deadline.
                    let announced = body
                        .size_hint()
                        .exact()
                        .and_then(|n| usize::try_from(n).ok());
                    let capacity = announced.unwrap_or(max).min(max);
                    let holder = limiter.buffer_holder(peer, &parts.headers);
                    // A body longer than one read buffer also leases that buffer's room.
                    let allowance = if capacity > sluice_edge::PIECE_BYTES {
                        sluice_edge::READ_BUFFER_ALLOWANCE
                    } else {
                        0
                    };
                    let leased = capacity.saturating_add(allowance);
                    let lease = match limiter.buffers().try_lease_for(holder, leased) {
                        Ok(lease) => lease,
                        Err(full) => {
                            return Ok(buffers_refusal(full, limiter.buffers()).map(Either::Left));
                        }
                    };
                    _lease = Some(lease);
                    let taken = tokio::time::timeout(
                        sluice_edge::BODY_DEADLINE,
                        take_whole(body, capacity, max),
                    )
                    .await;
                    let Ok(taken) = taken else {
                        return Ok(body_too_slow().map(Either::Left));
                    };
                    match taken {
                        Ok(bytes) => (B::from(bytes.clone()), Some(Ok(bytes))),
                        Err(Whole::TooLarge) => (B::from(Bytes::new()), Some(Err(()))),
                        Err(Whole::Unreadable) => return Ok(body_unreadable().map(Either::Left)),
                    }
                }
            };
            let read = match &taken {
                None => BodyRead::NotNeeded,
                Some(Ok(bytes)) => BodyRead::Whole(bytes),
                Some(Err(())) => BodyRead::TooLarge,
            };
            // Phases 3 and 4: planned and admitted; what cannot be counted is
            // refused before anything is decided.
            let planned = limiter.planned(&parts.headers, peer, Ok(route), read, key.as_deref());
            let mut forward = match planned
                .admit(parts.extensions.get::<sluice_edge::RequestId>())
                .await
            {
                Ok(forward) => forward,
                Err(answer) => return Ok(answer.map(Either::Left)),
            };
            // Phase 5: the upstream head, and what was spent of each monthly quota
            // for the service behind (a batch lane gives back what it does not queue).
            forward.upstream_headers(&mut parts.headers);
            parts.extensions.insert(forward.quota_spent());
            let mut response = if forward.in_lane() {
                // A call through a lane may take as long as the lane allows (an
                // upstream that forwards reads it from the extension); past it, it is
                // cut and counts as a failure.
                let timeout = forward.upstream_timeout(std::time::Duration::MAX);
                parts.extensions.insert(UpstreamTimeout(timeout));
                let call = inner.call(Request::from_parts(parts, body));
                match tokio::time::timeout(timeout, call).await {
                    Ok(Ok(response)) => response,
                    Ok(Err(error)) => {
                        forward.finish(None);
                        return Err(error);
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
            forward.response_head(status, response.headers_mut()).await;
            Ok(response.map(Either::Right))
        })
    }
}

/// Why a body could not be taken whole.
enum Whole {
    /// It is longer than the policy's bound.
    TooLarge,
    /// It failed, or is longer than it announced.
    Unreadable,
}

/// Takes `body` whole, frame by frame, each frame copied and let go as it comes,
/// within `capacity` bytes (what was leased for it): into pieces of
/// [`sluice_edge::PIECE_BYTES`] allocated as they are needed (never grown, never past the
/// lease), then once whole into one buffer of its length, the pieces freed at once.
/// Nothing else holds the body while it arrives. A body past `max` is
/// [`Whole::TooLarge`] once that is known.
async fn take_whole<B>(body: B, capacity: usize, max: usize) -> Result<Bytes, Whole>
where
    B: Body,
{
    let mut body = std::pin::pin!(body);
    let mut pieces: Vec<BytesMut> = Vec::new();
    let mut len = 0usize;
    while let Some(frame) = body.as_mut().frame().await {
        let Ok(frame) = frame else {
            return Err(Whole::Unreadable);
        };
        let Ok(mut data) = frame.into_data() else {
            continue;
        };
        let grown = len.saturating_add(data.remaining());
        if grown > max {
            return Err(Whole::TooLarge);
        }
        if grown > capacity {
            return Err(Whole::Unreadable);
        }
        while data.has_remaining() {
            let piece = match pieces.last_mut() {
                Some(piece) if piece.len() < piece.capacity() => piece,
                _ => {
                    let size = sluice_edge::PIECE_BYTES.min(capacity - len);
                    pieces.push(BytesMut::with_capacity(size));
                    pieces.last_mut().ok_or(Whole::Unreadable)?
                }
            };
            let room = piece.capacity() - piece.len();
            let chunk = data.chunk();
            let n = chunk.len().min(room);
            piece.extend_from_slice(&chunk[..n]);
            data.advance(n);
            len += n;
        }
    }
    if pieces.len() == 1 {
        return Ok(pieces.pop().unwrap_or_default().freeze());
    }
    let mut whole = BytesMut::with_capacity(len);
    for piece in pieces {
        whole.extend_from_slice(&piece);
    }
    Ok(whole.freeze())
}
