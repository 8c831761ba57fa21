//! sluice as Envoy's rate-limit service (SPEC R1): the gRPC service
//! `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`, with gRPC
//! health checking (`grpc.health.v1.Health`), answered by sluice's edge engine
//! ([`sluice_edge::descriptors`]) on the same limiter — policy, store,
//! replicas, dry run and shadow rule — as the gateway.
//!
//! The wire types ([`proto`]) are generated from a trimmed copy of Envoy's
//! protos with the same packages, names and field numbers (see
//! `proto/rls.proto`); the generated file is committed, so no build needs
//! `protoc`.
//!
//! Bounds, each refused with a gRPC status and counted in
//! `sluice_rls_refused_total{reason}`:
//! - a message is at most [`MAX_MESSAGE_BYTES`] (`RESOURCE_EXHAUSTED`, read
//!   from its prefix) and holds at most [`MAX_DESCRIPTORS`] descriptors of at
//!   most [`MAX_ENTRIES`] entries (`RESOURCE_EXHAUSTED`, counted on the wire
//!   before anything is decoded); the work per call is linear in its size;
//! - a message must come whole within [`MESSAGE_TIMEOUT`]
//!   (`DEADLINE_EXCEEDED`, the stream reset and its memory released), and
//!   what unfinished messages hold is bounded per connection
//!   ([`MAX_UNFINISHED_BYTES_PER_CONNECTION`]) and in all, with the gateway's
//!   bodies (`--max-buffered-bytes` and its per-address share);
//! - HTTP/2: at most [`MAX_STREAMS_PER_CONNECTION`] calls at once on a
//!   connection, header lists of at most [`MAX_HEADER_LIST_BYTES`], frames of
//!   at most [`MAX_FRAME_BYTES`], [`WINDOW_BYTES`] received and not yet read
//!   per connection and per call; a handshake within [`PREFACE_TIMEOUT`];
//! - the listener holds at most the connections it is given, and (through
//!   the gateway's acceptor) at most `--max-connections-per-ip` from one
//!   address but for trusted proxies.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use sluice_edge::SharedLimiter;
use sluice_edge::descriptors::{Code, DescriptorCall, Outcome, RateLimitAnswer, RateLimitCall};
use sluice_policy::domains::Unit;
use sluice_store::BudgetStore;
use tokio::net::TcpListener;
use tonic::{Response, Status};

#[allow(
    missing_docs,
    clippy::all,
    clippy::pedantic,
    unreachable_pub,
    rustdoc::invalid_html_tags
)]
mod generated;

mod codec;
mod connection;
mod counters;
mod message;

pub use connection::PREFACE_TIMEOUT;
pub use message::{
    MAX_MESSAGE_BYTES, MAX_UNFINISHED_BYTES_PER_CONNECTION, MESSAGE_TIMEOUT, UNFINISHED_CALL_BYTES,
};
pub use sluice_edge::descriptors::{MAX_DESCRIPTORS, MAX_ENTRIES};

/// The Envoy RLS v3 wire types and the generated service and client.
pub mod proto {
    pub use crate::generated::*;
}

use connection::ConnectionInfo;
use message::{Message, Unfinished};
use proto::rate_limit_descriptor::RateLimitOverride;
use proto::rate_limit_response::rate_limit::Unit as ProtoUnit;
use proto::rate_limit_response::{Code as ProtoCode, DescriptorStatus, RateLimit};
use proto::{HeaderValue, RateLimitRequest, RateLimitResponse};

/// Calls one connection carries at once (HTTP/2 concurrent streams).
pub const MAX_STREAMS_PER_CONNECTION: u32 = 256;
/// The largest header list of a call (HTTP/2 `SETTINGS_MAX_HEADER_LIST_SIZE`):
/// Envoy's calls carry a few hundred bytes.
pub const MAX_HEADER_LIST_BYTES: u32 = 8 * 1024;
/// The largest HTTP/2 frame read (`SETTINGS_MAX_FRAME_SIZE`, HTTP/2's least).
pub const MAX_FRAME_BYTES: u32 = 16 * 1024;
/// Bytes a client may send on a connection, and on one call, before the
/// service has read them (HTTP/2's connection and stream windows).
pub const WINDOW_BYTES: u32 = 1024 * 1024;
/// How often a connection is pinged once its handshake is done; one whose
/// peer stopped answering is closed.
pub const KEEPALIVE: Duration = Duration::from_secs(30);

/// The path of the one method.
const SHOULD_RATE_LIMIT: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

/// The service over a limiter that reloads (as the gateway's does).
pub struct Rls<S> {
    limiter: SharedLimiter<S>,
    counters: counters::Counters,
}

impl<S> Rls<S> {
    /// The service deciding with `limiter`.
    pub fn new(limiter: SharedLimiter<S>) -> Self {
        Rls {
            limiter,
            counters: counters::Counters::default(),
        }
    }
}

fn unit_of(unit: ProtoUnit) -> Option<Unit> {
    Some(match unit {
        ProtoUnit::Second => Unit::Second,
        ProtoUnit::Minute => Unit::Minute,
        ProtoUnit::Hour => Unit::Hour,
        ProtoUnit::Day => Unit::Day,
        ProtoUnit::Week => Unit::Week,
        ProtoUnit::Month => Unit::Month,
        ProtoUnit::Year => Unit::Year,
        ProtoUnit::Unknown => return None,
    })
}

fn proto_unit(unit: Unit) -> ProtoUnit {
    match unit {
        Unit::Second => ProtoUnit::Second,
        Unit::Minute => ProtoUnit::Minute,
        Unit::Hour => ProtoUnit::Hour,
        Unit::Day => ProtoUnit::Day,
        Unit::Week => ProtoUnit::Week,
        Unit::Month => ProtoUnit::Month,
        Unit::Year => ProtoUnit::Year,
    }
}

fn proto_code(code: Code) -> ProtoCode {
    match code {
        Code::Ok => ProtoCode::Ok,
        Code::OverLimit => ProtoCode::OverLimit,
    }
}

/// The engine's call from the wire request. An override with an unknown unit
/// is ignored (the rule's limit applies).
pub fn call_of(request: RateLimitRequest) -> RateLimitCall {
    RateLimitCall {
        domain: request.domain,
        hits_addend: request.hits_addend,
        descriptors: request
            .descriptors
            .into_iter()
            .map(|d| DescriptorCall {
                entries: d.entries.into_iter().map(|e| (e.key, e.value)).collect(),
                hits: hits_of(d.hits_addend),
                limit_override: override_of(d.limit),
            })
            .collect(),
    }
}

/// A descriptor's hits: Envoy sends a u64; more than a u32 holds can never fit.
fn hits_of(hits: Option<u64>) -> Option<u32> {
    hits.map(|h| u32::try_from(h).unwrap_or(u32::MAX))
}

/// A descriptor's limit override, unless its unit is unknown.
fn override_of(limit: Option<RateLimitOverride>) -> Option<(u32, Unit)> {
    limit.and_then(|l| {
        let unit = ProtoUnit::try_from(l.unit).ok().and_then(unit_of)?;
        Some((l.requests_per_unit, unit))
    })
}

/// A request a descriptor key or value of which is not UTF-8: its domain and
/// how many descriptors it has.
#[derive(Debug)]
pub(crate) struct NotUtf8 {
    domain: String,
    descriptors: usize,
}

/// The engine's call from the request as the service decodes it (see
/// [`codec::WireRequest`]), as [`call_of`]; a request with a key or value that
/// is not UTF-8 is [`NotUtf8`]. Each key and value becomes a `String` in the
/// buffer it was decoded into.
pub(crate) fn call_of_wire(request: codec::WireRequest) -> Result<RateLimitCall, NotUtf8> {
    let count = request.descriptors.len();
    let mut descriptors = Vec::with_capacity(count);
    for d in request.descriptors {
        let mut entries = Vec::with_capacity(d.entries.len());
        for e in d.entries {
            match (String::from_utf8(e.key), String::from_utf8(e.value)) {
                (Ok(key), Ok(value)) => entries.push((key, value)),
                _ => {
                    return Err(NotUtf8 {
                        domain: request.domain,
                        descriptors: count,
                    });
                }
            }
        }
        descriptors.push(DescriptorCall {
            entries,
            hits: hits_of(d.hits_addend),
            limit_override: override_of(d.limit),
        });
    }
    Ok(RateLimitCall {
        domain: request.domain,
        hits_addend: request.hits_addend,
        descriptors,
    })
}

/// The wire answer from the engine's.
pub fn response_of(answer: RateLimitAnswer) -> RateLimitResponse {
    RateLimitResponse {
        overall_code: proto_code(answer.overall).into(),
        statuses: answer
            .statuses
            .into_iter()
            .map(|s| DescriptorStatus {
                code: proto_code(s.code).into(),
                current_limit: s.current_limit.map(|l| RateLimit {
                    name: l.name,
                    requests_per_unit: l.requests_per_unit,
                    unit: proto_unit(l.unit).into(),
                }),
                limit_remaining: s.limit_remaining,
                duration_until_reset: (!s.duration_until_reset.is_zero()).then(|| {
                    prost_types::Duration {
                        seconds: i64::try_from(s.duration_until_reset.as_secs())
                            .unwrap_or(i64::MAX),
                        nanos: 0,
                    }
                }),
            })
            .collect(),
        response_headers_to_add: answer
            .headers
            .into_iter()
            .map(|(key, value)| HeaderValue {
                key: key.to_owned(),
                value,
            })
            .collect(),
        request_headers_to_add: Vec::new(),
    }
}

fn outcome_label(outcome: Outcome) -> &'static str {
    match outcome {
        Outcome::Decided => "decided",
        Outcome::NothingCounted => "nothing_counted",
        Outcome::UnknownDomain => "unknown_domain",
        Outcome::TooManyCounted => "too_many_counted",
        Outcome::Outage => "outage",
        Outcome::NotUtf8 => "not_utf8",
    }
}

/// Sets a call's decision on its span: its domain, outcome, how it was decided,
/// the binding descriptor (the first over its limit, else the one with the
/// fewest requests left), its limit and what is left, and how long deciding took.
fn describe_call(
    span: &mut sluice_edge::trace::CallSpan,
    domain: &str,
    answer: &RateLimitAnswer,
    took: Duration,
) {
    let over = answer.overall == Code::OverLimit;
    span.set("sluice.outcome", if over { "refused" } else { "admitted" });
    span.set("sluice.rls.domain", domain.to_owned());
    span.set("sluice.rls.outcome", outcome_label(answer.outcome));
    span.set("sluice.store.latency_ms", took.as_secs_f64() * 1000.0);
    let binding = answer
        .statuses
        .iter()
        .filter(|s| s.current_limit.is_some())
        .min_by_key(|s| (s.code != Code::OverLimit, s.limit_remaining));
    if let Some(status) = binding
        && let Some(limit) = &status.current_limit
    {
        span.set("sluice.budget", limit.name.clone());
        span.set("sluice.limit", i64::from(limit.requests_per_unit));
        span.set("sluice.remaining", i64::from(status.limit_remaining));
    }
}

impl<S: BudgetStore + 'static> Rls<S> {
    /// Answers one call with the current limiter, and counts it.
    async fn answer(
        &self,
        request: tonic::Request<codec::WireRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        // SPEC O1: with a tracer installed, a span per call (Envoy sends its
        // trace context as metadata).
        let mut span = sluice_edge::trace::CallSpan::start(
            sluice_edge::trace::RLS_SPAN_NAME,
            request
                .metadata()
                .get("traceparent")
                .map(tonic::metadata::MetadataValue::as_bytes),
        );
        let began = span.as_ref().map(|_| std::time::Instant::now());
        let limiter = self.limiter.load_full();
        let (domain, answer) = match call_of_wire(request.into_inner()) {
            Ok(call) => {
                let answer = limiter.should_rate_limit(&call).await;
                (call.domain, answer)
            }
            Err(NotUtf8 {
                domain,
                descriptors,
            }) => {
                // Fail closed: refused whole, counted and logged (an error
                // would be let through by Envoy's `failure_mode_deny: false`).
                metrics::counter!("sluice_rls_refused_total", "reason" => "not_utf8").increment(1);
                let answer = limiter.refuse_not_utf8(&domain, descriptors);
                (domain, answer)
            }
        };
        if let (Some(span), Some(began)) = (&mut span, began)
            && span.is_recording()
        {
            describe_call(span, &domain, &answer, began.elapsed());
        }
        let unknown = match answer.outcome {
            Outcome::UnknownDomain => true,
            Outcome::NotUtf8 => !limiter.policy().domains.iter().any(|d| d.name == domain),
            _ => false,
        };
        let domain = if unknown { "unknown" } else { domain.as_str() };
        let code = if answer.overall == Code::Ok {
            "ok"
        } else {
            "over_limit"
        };
        self.counters
            .request(domain, code, outcome_label(answer.outcome));
        for (rule, status) in answer.rules.iter().zip(&answer.statuses) {
            if let Some(rule) = rule {
                self.counters
                    .descriptor(domain, rule, status.code == Code::OverLimit);
            }
        }
        // Shadow refusals are the engine's to count, as the gateway's.
        Ok(Response::new(response_of(answer)))
    }
}

/// The rate-limit service as tonic's router serves it: `ShouldRateLimit` with
/// its message read within the bounds (see the crate's docs) and its
/// descriptors counted on the wire before it is decoded; any other method of
/// the service is `UNIMPLEMENTED`.
pub struct RateLimitServer<S> {
    rls: Arc<Rls<S>>,
    message_timeout: Duration,
}

impl<S> RateLimitServer<S> {
    /// The service deciding with `limiter`.
    pub fn new(limiter: SharedLimiter<S>) -> Self {
        RateLimitServer {
            rls: Arc::new(Rls::new(limiter)),
            message_timeout: MESSAGE_TIMEOUT,
        }
    }

    /// The same service with `timeout` instead of [`MESSAGE_TIMEOUT`] for a
    /// call's message to come whole.
    #[must_use]
    pub fn with_message_timeout(mut self, timeout: Duration) -> Self {
        self.message_timeout = timeout;
        self
    }
}

impl<S> Clone for RateLimitServer<S> {
    fn clone(&self) -> Self {
        RateLimitServer {
            rls: Arc::clone(&self.rls),
            message_timeout: self.message_timeout,
        }
    }
}

impl<S> tonic::server::NamedService for RateLimitServer<S> {
    const NAME: &'static str = proto::rate_limit_service_server::SERVICE_NAME;
}

impl<S: BudgetStore + 'static> tonic::codegen::Service<http::Request<tonic::body::Body>>
    for RateLimitServer<S>
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = tonic::codegen::BoxFuture<Self::Response, Infallible>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut request: http::Request<tonic::body::Body>) -> Self::Future {
        if request.uri().path() != SHOULD_RATE_LIMIT {
            return Box::pin(async { Ok(Status::unimplemented("").into_http()) });
        }
        let unfinished = request
            .extensions_mut()
            .remove::<ConnectionInfo>()
            .map(|info| info.0);
        let timeout = self.message_timeout;
        let rls = Arc::clone(&self.rls);
        Box::pin(async move {
            let request = request.map(|body| Message::new(body, unfinished, timeout));
            let mut grpc = tonic::server::Grpc::new(codec::RlsCodec)
                .apply_max_message_size_config(Some(MAX_MESSAGE_BYTES), None);
            let method = Unary(|request| rls.answer(request));
            Ok(grpc.unary(method, request).await)
        })
    }
}

/// A unary method as tonic's server calls it, answered by `F` (its future
/// unboxed, inside the call's).
struct Unary<F>(F);

impl<F, A> tonic::codegen::Service<tonic::Request<codec::WireRequest>> for Unary<F>
where
    F: FnMut(tonic::Request<codec::WireRequest>) -> A,
    A: Future<Output = Result<Response<RateLimitResponse>, Status>>,
{
    type Response = Response<RateLimitResponse>;
    type Error = Status;
    type Future = A;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Status>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: tonic::Request<codec::WireRequest>) -> A {
        (self.0)(request)
    }
}

/// Serves the rate-limit service and gRPC health checking on `listener` until
/// `stop` resolves, holding at most `max_connections` connections at once (the
/// next waits to be accepted).
///
/// # Errors
/// The transport's error when the listener fails.
pub async fn serve<S: BudgetStore + 'static>(
    listener: TcpListener,
    limiter: SharedLimiter<S>,
    max_connections: usize,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), tonic::transport::Error> {
    let places = Arc::new(tokio::sync::Semaphore::new(max_connections.max(1)));
    let incoming =
        futures_util::stream::unfold((listener, places), |(listener, places)| async move {
            let (place, stream, _) =
                sluice_door::accept_within(&listener, &places, None, "rate-limit service").await?;
            Some(((stream, place), (listener, places)))
        });
    serve_connections(incoming, limiter, stop).await
}

/// Serves the rate-limit service and gRPC health checking on the connections
/// `incoming` yields, each with what it holds until it closes (its place
/// under a connection bound, say), until `stop` resolves or `incoming` ends.
/// Several threads that are handed connections by one acceptor each serve
/// theirs this way, on a runtime of their own.
///
/// # Errors
/// The transport's error.
pub async fn serve_connections<S, H>(
    incoming: impl futures_util::Stream<Item = (tokio::net::TcpStream, H)> + Send + 'static,
    limiter: SharedLimiter<S>,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), tonic::transport::Error>
where
    S: BudgetStore + 'static,
    H: Send + Unpin + 'static,
{
    use futures_util::StreamExt;
    let (health_reporter, health) = tonic_health::server::health_reporter();
    health_reporter.set_serving::<RateLimitServer<S>>().await;
    let service = RateLimitServer::new(Arc::clone(&limiter));
    let gauge = metrics::gauge!("sluice_rls_unfinished_bytes");
    let incoming = incoming.map(move |(stream, held)| {
        // A connection's unfinished messages lease from the process's bound,
        // charged to its peer's address (the gateway's bodies lease there too).
        let limiter = limiter.load();
        let peer = stream
            .peer_addr()
            .map_or(std::net::Ipv4Addr::UNSPECIFIED.into(), |p| p.ip());
        let unfinished = Unfinished::new(
            Arc::clone(limiter.buffers()),
            limiter.buffer_holder(peer, &http::HeaderMap::new()),
            gauge.clone(),
        );
        Ok::<_, std::io::Error>(connection::Bounded::new(stream, held, unfinished))
    });
    tonic::transport::Server::builder()
        .max_concurrent_streams(MAX_STREAMS_PER_CONNECTION)
        .http2_max_header_list_size(MAX_HEADER_LIST_BYTES)
        .max_frame_size(MAX_FRAME_BYTES)
        .initial_connection_window_size(WINDOW_BYTES)
        .initial_stream_window_size(WINDOW_BYTES)
        .http2_keepalive_interval(Some(KEEPALIVE))
        .add_service(health)
        .add_service(service)
        .serve_with_incoming_shutdown(incoming, stop)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A client's HTTP/2 preface and an empty SETTINGS frame: a connection the
    /// service serves answers with its own SETTINGS at once.
    const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0";

    /// Connects and sends the preface.
    async fn open(addr: std::net::SocketAddr) -> tokio::net::TcpStream {
        let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
        stream.write_all(PREFACE).await.expect("preface");
        stream
    }

    /// Whether the service answers on `stream` within `wait`.
    async fn served(stream: &mut tokio::net::TcpStream, wait: Duration) -> bool {
        let mut frame = [0_u8; 9];
        matches!(
            tokio::time::timeout(wait, stream.read_exact(&mut frame)).await,
            Ok(Ok(_))
        )
    }

    /// R1 bounds: the service holds at most its bound of connections; the
    /// next waits until one closes.
    #[tokio::test]
    async fn r1_the_service_holds_at_most_its_connection_bound() {
        let policy = sluice_policy::default_policy().expect("the default policy");
        let store = sluice_store::MemoryStore::new(sluice_store::MemoryConfig::default());
        let limiter = Arc::new(sluice_edge::arc_swap::ArcSwap::from_pointee(
            sluice_edge::Limiter::new(policy, store),
        ));
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(serve(listener, limiter, 1, std::future::pending()));

        let mut first = open(addr).await;
        assert!(served(&mut first, Duration::from_secs(10)).await);
        let mut second = open(addr).await;
        assert!(
            !served(&mut second, Duration::from_millis(300)).await,
            "one place: the second connection waits"
        );
        drop(first);
        assert!(
            served(&mut second, Duration::from_secs(10)).await,
            "served once the first closed"
        );
    }
}
