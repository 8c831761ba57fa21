//! The outermost per-connection service: tags each request with its [`PeerAddr`], hands
//! its body on as a [`GatewayBody`] whose every part must come within the body timeout
//! (`ReadDeadline`), and counts it (`sluice_requests_total{status}`,
//! requests in flight) whatever the layers inside decide, so refusals by the limiter are
//! counted as well as proxied answers. On an HTTP/2 connection it also counts each
//! request in flight on the connection until its response body ends (see [`Streams`]),
//! so an idle connection can be told from a busy one, and watches each response body
//! for a client that stalls it with flow control.

use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use crossbeam_utils::CachePadded;
use http::{Request, Response};
use tower::Service;

use super::boxed::BoxError;
use super::idle::{CountedBody, Streams};
use super::read_deadline::ReadDeadline;
use super::{GatewayBody, PeerAddr};

/// Request counters of the gateway's connections, read by `/status` and `/metrics`.
///
/// Each worker thread counts in its own cache line ([`RequestStats::worker`]), so the
/// workers never contend for one; readers add the lines up.
#[derive(Clone, Debug)]
pub(crate) struct RequestStats {
    inner: Arc<Counters>,
    /// The line this handle counts in.
    line: usize,
}

#[derive(Debug)]
struct Counters {
    lines: Box<[CachePadded<Line>]>,
    /// `sluice_requests_in_flight`, registered once, set when metrics are rendered.
    in_flight_gauge: metrics::Gauge,
    /// `sluice_connections_open`, likewise.
    connections_gauge: metrics::Gauge,
    /// Woken (one permit kept) when a client connection closes.
    connection_closed: tokio::sync::Notify,
    /// `sluice_requests_total{status}` for the common statuses, registered once.
    by_status: Vec<(u16, metrics::Counter)>,
}

/// One worker's counts.
#[derive(Debug, Default)]
struct Line {
    /// Requests entered minus requests answered on this worker.
    in_flight: AtomicU64,
    total: AtomicU64,
    /// Client connections this worker holds open (whether or not they sent a byte).
    connections: AtomicU64,
}

impl RequestStats {
    /// Counters for `workers` worker threads.
    pub(crate) fn with_workers(workers: NonZeroUsize) -> Self {
        RequestStats {
            inner: Arc::new(Counters {
                lines: (0..workers.get())
                    .map(|_| CachePadded::new(Line::default()))
                    .collect(),
                in_flight_gauge: metrics::gauge!("sluice_requests_in_flight"),
                connections_gauge: metrics::gauge!("sluice_connections_open"),
                connection_closed: tokio::sync::Notify::new(),
                by_status: COMMON_STATUSES
                    .iter()
                    .map(|&(code, label)| {
                        (
                            code,
                            metrics::counter!("sluice_requests_total", "status" => label),
                        )
                    })
                    .collect(),
            }),
            line: 0,
        }
    }

    /// The handle worker `index` counts with (indexes past the count share the last).
    pub(crate) fn worker(&self, index: usize) -> Self {
        RequestStats {
            inner: Arc::clone(&self.inner),
            line: index.min(self.inner.lines.len() - 1),
        }
    }

    /// Requests received whose response headers have not been produced yet.
    pub(crate) fn in_flight(&self) -> u64 {
        self.inner
            .lines
            .iter()
            .map(|l| l.in_flight.load(Ordering::Relaxed))
            .sum()
    }

    /// Requests received since start.
    pub(crate) fn total(&self) -> u64 {
        self.inner
            .lines
            .iter()
            .map(|l| l.total.load(Ordering::Relaxed))
            .sum()
    }

    /// Client connections the gateway holds open now.
    pub(crate) fn connections_open(&self) -> u64 {
        self.inner
            .lines
            .iter()
            .map(|l| l.connections.load(Ordering::Relaxed))
            .sum()
    }

    /// Counts one client connection on this handle's worker until the returned guard
    /// is dropped.
    pub(crate) fn open_connection(&self) -> OpenConnection {
        self.line().connections.fetch_add(1, Ordering::Relaxed);
        OpenConnection(self.clone())
    }

    /// Waits until fewer than `max` client connections are open.
    pub(crate) async fn room_for_connection(&self, max: usize) {
        // A close between the count and the wait leaves a permit: no wake-up is lost.
        while self.connections_open() >= max as u64 {
            self.inner.connection_closed.notified().await;
        }
    }

    /// Sets the `sluice_requests_in_flight` and `sluice_connections_open` gauges from
    /// the counters (before a render).
    pub(crate) fn publish(&self) {
        // Precision: both counts stay far below 2^53.
        #[allow(clippy::cast_precision_loss)]
        {
            self.inner.in_flight_gauge.set(self.in_flight() as f64);
            self.inner
                .connections_gauge
                .set(self.connections_open() as f64);
        }
    }

    fn line(&self) -> &Line {
        &self.inner.lines[self.line]
    }
}

/// What the admin listener reads: the sums over every worker's line.
impl sluice_admin::RequestCounts for RequestStats {
    fn total(&self) -> u64 {
        RequestStats::total(self)
    }

    fn in_flight(&self) -> u64 {
        RequestStats::in_flight(self)
    }

    fn connections_open(&self) -> u64 {
        RequestStats::connections_open(self)
    }

    fn publish(&self) {
        RequestStats::publish(self);
    }
}

/// One open client connection, counted until dropped.
#[derive(Debug)]
pub(crate) struct OpenConnection(RequestStats);

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.0.line().connections.fetch_sub(1, Ordering::Relaxed);
        self.0.inner.connection_closed.notify_one();
    }
}

/// One request, counted as received and in flight from [`RequestStats::request`]
/// until [`InFlight::answered`] or until dropped (also when the request is cancelled).
#[derive(Debug)]
pub(crate) struct InFlight(RequestStats);

impl RequestStats {
    /// Counts one request on this handle's worker: received, and in flight until the
    /// returned guard is answered or dropped.
    pub(crate) fn request(&self) -> InFlight {
        let line = self.line();
        line.in_flight.fetch_add(1, Ordering::Relaxed);
        line.total.fetch_add(1, Ordering::Relaxed);
        InFlight(self.clone())
    }
}

impl InFlight {
    /// Counts the answer in `sluice_requests_total{status}`: its status code, or
    /// `error` for `None` (no response was produced).
    pub(crate) fn answered(self, code: Option<u16>) {
        match code.and_then(|c| self.0.inner.by_status.iter().find(|(k, _)| *k == c)) {
            Some((_, counter)) => counter.increment(1),
            None => {
                let status = code.map_or_else(|| "error".into(), status_label);
                metrics::counter!("sluice_requests_total", "status" => status).increment(1);
            }
        }
    }
}

impl InFlight {
    /// The request was not served here after all (handed to the other request path,
    /// which counts it): it leaves the counts.
    pub(crate) fn handed_over(self) {
        self.0.line().total.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.line().in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Wraps the gateway's service stack for one connection.
#[derive(Clone, Debug)]
pub(crate) struct Metered<S> {
    inner: S,
    peer: SocketAddr,
    stats: RequestStats,
    body_timeout: Duration,
    /// The connection's client hang-up, for each of its requests.
    hangup: Option<sluice_edge::Hangup>,
    /// The connection's requests in flight, each until its response body ends.
    streams: Option<Streams>,
}

impl<S> Metered<S> {
    /// `inner` serving the connection from `peer`; each part of a request body must
    /// come within `body_timeout`.
    pub(crate) fn new(
        inner: S,
        peer: SocketAddr,
        stats: RequestStats,
        body_timeout: Duration,
    ) -> Self {
        Metered {
            inner,
            peer,
            stats,
            body_timeout,
            hangup: None,
            streams: None,
        }
    }

    /// The same, telling each request when the client hangs up.
    pub(crate) fn with_hangup(mut self, hangup: Option<sluice_edge::Hangup>) -> Self {
        self.hangup = hangup;
        self
    }

    /// The same, counting each request in `streams` until its response body has been
    /// sent whole or dropped, or its client has stalled it for the send timeout (see
    /// [`Streams`]).
    pub(crate) fn counting(mut self, streams: Streams) -> Self {
        self.streams = Some(streams);
        self
    }
}

/// The future of [`Metered::call`].
pub(crate) type MeteredFuture<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send>>;

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for Metered<S>
where
    S: Service<Request<GatewayBody>, Response = Response<ResBody>>,
    S::Future: Send + 'static,
    ReqBody: http_body::Body<Data = Bytes> + Send + Unpin + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: http_body::Body + Send + 'static,
{
    type Response = Response<CountedBody<ResBody>>;
    type Error = S::Error;
    type Future = MeteredFuture<Response<CountedBody<ResBody>>, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let body_timeout = self.body_timeout;
        let ended = sluice_edge::UploadEnded::default();
        let mut request = request.map(|body| {
            if body.is_end_stream() {
                ended.mark();
            }
            GatewayBody::new(ReadDeadline::new(body, body_timeout).telling(ended.clone()))
        });
        request.extensions_mut().insert(ended);
        request.extensions_mut().insert(PeerAddr(self.peer));
        if let Some(hangup) = &self.hangup {
            request.extensions_mut().insert(hangup.clone());
        }
        let guard = self.stats.request();
        let open = self.streams.as_ref().map(Streams::open);
        let future = self.inner.call(request);
        Box::pin(async move {
            let result = future.await;
            guard.answered(result.as_ref().map(|r| r.status().as_u16()).ok());
            result.map(|response| {
                response.map(|body| match open {
                    Some(open) => CountedBody::watched(body, open),
                    None => CountedBody::plain(body),
                })
            })
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
