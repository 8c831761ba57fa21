//! sluice as Envoy's rate-limit service (SPEC R1): the gRPC service
//! `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`, with gRPC
//! health checking (`grpc.health.v1.Health`), answered by sluice's edge engine
//! ([`sluice_edge::descriptors`]) on the same limiter — policy, store and
//! replicas — as the gateway.
//!
//! The wire types ([`proto`]) are generated from a trimmed copy of Envoy's
//! protos with the same packages, names and field numbers (see
//! `proto/rls.proto`); the generated file is committed, so no build needs
//! `protoc`.
//!
//! Bounds: a message is at most [`MAX_MESSAGE_BYTES`]; a connection carries at
//! most [`MAX_STREAMS_PER_CONNECTION`] calls at once, and the listener holds at
//! most the connections it is given (like the gateway's).

use std::sync::Arc;
use std::time::Duration;

use sluice_edge::SharedLimiter;
use sluice_edge::descriptors::{Code, DescriptorCall, Outcome, RateLimitAnswer, RateLimitCall};
use sluice_policy::domains::Unit;
use sluice_store::BudgetStore;
use tokio::net::TcpListener;
use tonic::{Request, Response, Status};

#[allow(
    missing_docs,
    clippy::all,
    clippy::pedantic,
    unreachable_pub,
    rustdoc::invalid_html_tags
)]
mod generated;

mod connection;
mod counters;

pub use connection::PREFACE_TIMEOUT;

/// The Envoy RLS v3 wire types and the generated service and client.
pub mod proto {
    pub use crate::generated::*;
}

use proto::rate_limit_response::rate_limit::Unit as ProtoUnit;
use proto::rate_limit_response::{Code as ProtoCode, DescriptorStatus, RateLimit};
use proto::rate_limit_service_server::{RateLimitService, RateLimitServiceServer};
use proto::{HeaderValue, RateLimitRequest, RateLimitResponse};

/// The largest request message read (tonic's default, stated): a request of
/// 1,000 descriptors with entries of 64 KiB does not fit and is refused with
/// `RESOURCE_EXHAUSTED`; anything smaller is answered.
pub const MAX_MESSAGE_BYTES: usize = 4 * 1024 * 1024;
/// Calls one connection carries at once (HTTP/2 concurrent streams).
pub const MAX_STREAMS_PER_CONNECTION: u32 = 256;

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
                // Envoy sends a u64; more hits than a u32 holds can never fit.
                hits: d.hits_addend.map(|h| u32::try_from(h).unwrap_or(u32::MAX)),
                limit_override: d.limit.and_then(|l| {
                    let unit = ProtoUnit::try_from(l.unit).ok().and_then(unit_of)?;
                    Some((l.requests_per_unit, unit))
                }),
            })
            .collect(),
    }
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
    }
}

#[tonic::async_trait]
impl<S: BudgetStore + 'static> RateLimitService for Rls<S> {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let call = call_of(request.into_inner());
        let limiter = self.limiter.load_full();
        let answer = limiter.should_rate_limit(&call).await;
        let domain = if answer.outcome == Outcome::UnknownDomain {
            "unknown"
        } else {
            call.domain.as_str()
        };
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
    health_reporter
        .set_serving::<RateLimitServiceServer<Rls<S>>>()
        .await;
    let service =
        RateLimitServiceServer::new(Rls::new(limiter)).max_decoding_message_size(MAX_MESSAGE_BYTES);
    let incoming = incoming
        .map(|(stream, held)| Ok::<_, std::io::Error>(connection::Bounded::new(stream, held)));
    tonic::transport::Server::builder()
        .max_concurrent_streams(MAX_STREAMS_PER_CONNECTION)
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
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
