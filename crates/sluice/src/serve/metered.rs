//! The outermost per-connection service: tags each request with its [`PeerAddr`], hands
//! its body on as a [`GatewayBody`], and counts it (`sluice_requests_total{status}`,
//! requests in flight) whatever the layers inside decide, so refusals by the limiter are
//! counted as well as proxied answers.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use tower::Service;

use super::proxy::BoxError;
use super::{GatewayBody, PeerAddr};

/// Request counters shared by the gateway's connections and read by `/status`.
#[derive(Clone, Debug, Default)]
pub struct RequestStats {
    inner: Arc<Counters>,
}

#[derive(Debug)]
struct Counters {
    in_flight: AtomicU64,
    total: AtomicU64,
    /// `sluice_requests_in_flight`, registered once.
    in_flight_gauge: metrics::Gauge,
    /// `sluice_requests_total{status}` for the common statuses, registered once.
    by_status: Vec<(u16, metrics::Counter)>,
}

impl Default for Counters {
    fn default() -> Self {
        Counters {
            in_flight: AtomicU64::new(0),
            total: AtomicU64::new(0),
            in_flight_gauge: metrics::gauge!("sluice_requests_in_flight"),
            by_status: COMMON_STATUSES
                .iter()
                .map(|&(code, label)| {
                    (
                        code,
                        metrics::counter!("sluice_requests_total", "status" => label),
                    )
                })
                .collect(),
        }
    }
}

impl RequestStats {
    /// Requests received whose response headers have not been produced yet.
    pub fn in_flight(&self) -> u64 {
        self.inner.in_flight.load(Ordering::Relaxed)
    }

    /// Requests received since start.
    pub fn total(&self) -> u64 {
        self.inner.total.load(Ordering::Relaxed)
    }
}

/// Decrements the in-flight count when dropped (also when the request is cancelled).
struct InFlight(RequestStats);

impl InFlight {
    fn enter(stats: &RequestStats) -> Self {
        stats.inner.in_flight.fetch_add(1, Ordering::Relaxed);
        stats.inner.total.fetch_add(1, Ordering::Relaxed);
        stats.inner.in_flight_gauge.increment(1.0);
        InFlight(stats.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.inner.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.0.inner.in_flight_gauge.decrement(1.0);
    }
}

/// Wraps the gateway's service stack for one connection.
#[derive(Clone, Debug)]
pub struct Metered<S> {
    inner: S,
    peer: SocketAddr,
    stats: RequestStats,
}

impl<S> Metered<S> {
    /// `inner` serving the connection from `peer`.
    pub fn new(inner: S, peer: SocketAddr, stats: RequestStats) -> Self {
        Metered { inner, peer, stats }
    }
}

/// The future of [`Metered::call`].
pub type MeteredFuture<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send>>;

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for Metered<S>
where
    S: Service<Request<GatewayBody>, Response = Response<ResBody>>,
    S::Future: Send + 'static,
    ReqBody: http_body::Body<Data = Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: 'static,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = MeteredFuture<Response<ResBody>, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let mut request = request.map(GatewayBody::new);
        request.extensions_mut().insert(PeerAddr(self.peer));
        let guard = InFlight::enter(&self.stats);
        let future = self.inner.call(request);
        Box::pin(async move {
            let result = future.await;
            let code = result.as_ref().map(|r| r.status().as_u16()).ok();
            match code.and_then(|c| guard.0.inner.by_status.iter().find(|(k, _)| *k == c)) {
                Some((_, counter)) => counter.increment(1),
                None => {
                    let status = code.map_or_else(|| "error".into(), status_label);
                    metrics::counter!("sluice_requests_total", "status" => status).increment(1);
                }
            }
            drop(guard);
            result
        })
    }
}

/// A status code as a label value, without allocating for the common ones.
/// Statuses whose counters are registered up front.
const COMMON_STATUSES: [(u16, &str); 12] = [
    (200, "200"),
    (201, "201"),
    (202, "202"),
    (204, "204"),
    (304, "304"),
    (400, "400"),
    (404, "404"),
    (409, "409"),
    (429, "429"),
    (500, "500"),
    (502, "502"),
    (504, "504"),
];

/// The `status` label of a status code outside [`COMMON_STATUSES`].
fn status_label(code: u16) -> metrics::SharedString {
    code.to_string().into()
}
