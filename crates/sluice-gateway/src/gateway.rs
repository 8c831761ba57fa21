//! The gateway's accept loop and its workers.
//!
//! One acceptor task hands each accepted socket, round robin, to one of `workers`
//! threads. Each worker thread runs its own single-threaded tokio runtime and its own
//! service stack (so its own upstream connection pool): a connection, the upstream
//! connections its requests use and every wake-up between them stay on one thread, as
//! in nginx's worker processes, instead of hopping between the threads of a shared
//! work-stealing runtime. The budgets themselves are shared by every worker (one
//! limiter, one store).
//!
//! Each worker serves one HTTP/1.1 or HTTP/2 connection per socket, driving a clone
//! of its service stack (any `Service<Request<GatewayBody>>` answering any streaming
//! body) wrapped in [`Metered`], and drains gracefully when told to stop.
//!
//! A connection waiting for a request is closed after [`IDLE_TIMEOUT`]: over HTTP/1.1
//! when the next request head has not come (the fast path's head timer, hyper's
//! `header_read_timeout`, which runs between requests too), over HTTP/2 when none of
//! its streams has been in flight for that long ([`Streams`]; pings do not count),
//! with a GOAWAY. A request is in flight until its response body has ended, so a long
//! streamed answer keeps its connection. An HTTP/2 client that takes nothing of one
//! stream's answer for [`SEND_TIMEOUT`] (flow control lets it stall a stream without
//! stalling the socket) has that answer's body, and the upstream connection behind
//! it, dropped, as an HTTP/1.1 client that stops reading has its connection closed.
//!
//! At most `per_ip` client connections from one address are open at once (trusted
//! proxies aside): past it a new one from that address is closed at once, so one
//! client cannot take every connection slot. At most `max_connections` client
//! connections are open at once: at the limit the
//! acceptor stops accepting until one closes, and new clients wait in the kernel's
//! listen backlog, as with nginx's `worker_connections`.

use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use hyper::server::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot, watch};
use tower::Service;

use super::GatewayBody;
use super::boxed::BoxError;
use super::h1::{Ended, FastPath, SEND_TIMEOUT};
use super::idle::Streams;
use super::metered::{Metered, OpenConnection, RequestStats};
use super::send_deadline::SendDeadline;
use sluice_door::{AddressSlot, PerAddress};
use sluice_h1::rewind::Rewind;

/// A client that has not sent complete request headers within this time is dropped
/// (on a new connection, the wait for its first bytes counts once more on top).
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a client connection may wait with no request in flight before it is
/// closed: over HTTP/1.1 the head timeout between requests, over HTTP/2 the same time
/// with no stream in flight (a stream counts until its response body has ended).
const IDLE_TIMEOUT: Duration = HEADER_READ_TIMEOUT;
/// How often an HTTP/2 client is pinged, and how long its answer may take.
const HTTP2_PING_EVERY: Duration = Duration::from_secs(30);
const HTTP2_PING_TIMEOUT: Duration = Duration::from_secs(20);

/// The cap on a connection's read buffer, and so on a request head (request line and
/// headers): an HTTP/1 head that does not fit is refused with 431 (hyper checks the
/// cap between reads, so heads up to 64 KiB always pass and one that fills the
/// buffer past it, at most about twice the cap, is refused); an HTTP/2 header list
/// past it is refused by the h2 layer. With `--max-connections` it bounds the memory
/// client connections can pin (about 10,000 × 128 KiB at the defaults).
const MAX_REQUEST_HEAD_BYTES: usize = sluice_edge::MAX_REQUEST_HEAD_BYTES;

/// Pause after a failed `accept` (e.g. out of file descriptors) before trying again.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// Accepted sockets waiting for their worker; past this the acceptor waits (and the
/// kernel's listen backlog holds new clients).
const HANDOFF_QUEUE: usize = 1024;

/// How the drain ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Drain {
    /// Every connection finished its in-flight requests and closed.
    Complete,
    /// The grace period ran out before every connection closed; `connections` were
    /// open when the drain began.
    TimedOut {
        /// Connections open when the drain began.
        connections: usize,
    },
}

/// An accepted socket on its way to a worker, counted as open from the moment it
/// was accepted.
type Handoff = (
    std::net::TcpStream,
    SocketAddr,
    (OpenConnection, Option<AddressSlot>),
);

/// The gateway's worker threads, started and waiting for sockets.
pub(super) struct Workers {
    /// One hand-off queue per worker; closing them tells the workers to drain.
    handoffs: Vec<mpsc::Sender<Handoff>>,
    /// The workers' counters (one line each).
    stats: RequestStats,
    /// How each worker's drain ended.
    drains: Vec<oneshot::Receiver<Drain>>,
}

impl Workers {
    /// Starts `count` worker threads, each serving HTTP/1.1 on the fast path and
    /// everything else with the service that `make_worker` builds for it (the two
    /// share the worker's upstream connections), and draining for up to `grace` once
    /// its queue closes.
    ///
    /// # Errors
    /// A thread or its runtime that cannot be started.
    pub(super) fn start<F, S, B>(
        count: NonZeroUsize,
        make_worker: F,
        stats: &RequestStats,
        grace: Duration,
        tls: Option<&crate::ListenerTls>,
    ) -> std::io::Result<Self>
    where
        F: Fn(RequestStats) -> (S, FastPath),
        S: Service<Request<GatewayBody>, Response = Response<B>> + Clone + Send + 'static,
        S::Future: Send + 'static,
        S::Error: Into<BoxError>,
        B: http_body::Body + Send + Unpin + 'static,
        B::Data: Send,
        B::Error: Into<BoxError>,
    {
        let mut workers = Workers {
            handoffs: Vec::with_capacity(count.get()),
            stats: stats.clone(),
            drains: Vec::with_capacity(count.get()),
        };
        for index in 0..count.get() {
            let (handoff, sockets) = mpsc::channel(HANDOFF_QUEUE);
            let (drained, drain) = oneshot::channel();
            let stats = stats.worker(index);
            let (service, fast) = make_worker(stats.clone());
            let tls = tls.map(crate::ListenerTls::acceptor);
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            std::thread::Builder::new()
                .name(format!("sluice-gateway-{index}"))
                .spawn(move || {
                    let outcome = runtime.block_on(work(sockets, service, fast, stats, grace, tls));
                    let _ = drained.send(outcome);
                })?;
            workers.handoffs.push(handoff);
            workers.drains.push(drain);
        }
        Ok(workers)
    }
}

/// Accepts connections on `listener` and hands them to `workers` round robin, at most
/// `max_connections` open at once, until `stop` resolves; then stops accepting and
/// waits for every worker to drain.
pub(super) async fn serve(
    listener: TcpListener,
    workers: Workers,
    max_connections: NonZeroUsize,
    per_ip: Arc<PerAddress>,
    stop: impl Future<Output = ()>,
) -> Drain {
    let Workers {
        handoffs,
        stats,
        drains,
    } = workers;
    tokio::pin!(stop);
    let mut next = 0;
    loop {
        tokio::select! {
            biased;
            () = &mut stop => break,
            () = stats.room_for_connection(max_connections.get()) => {}
        }
        let accepted: (TcpStream, SocketAddr) = tokio::select! {
            biased;
            () = &mut stop => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    tracing::warn!("accept failed: {error}");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    continue;
                }
            },
        };
        let (stream, peer) = accepted;
        let mut slot = match per_ip.admit(peer.ip()) {
            Ok(slot) => slot,
            Err(_) => {
                metrics::counter!("sluice_connections_refused_total", "reason" => "per_ip")
                    .increment(1);
                drop(stream);
                continue;
            }
        };
        // Deregistered here, registered again with the worker's own reactor.
        let Ok(stream) = stream.into_std() else {
            continue;
        };
        // Round robin, skipping a worker whose queue is full; only when every queue is
        // full does the acceptor wait (and never past the stop). The socket counts on
        // the line of the worker it is offered to.
        let mut socket = Some((stream, peer));
        for _ in 0..handoffs.len() {
            let Some((stream, peer)) = socket.take() else {
                break;
            };
            let open = (stats.worker(next).open_connection(), slot.take());
            match handoffs[next].try_send((stream, peer, open)) {
                Ok(()) => {}
                Err(mpsc::error::TrySendError::Full((stream, peer, (_, back)))) => {
                    slot = back;
                    socket = Some((stream, peer));
                }
                Err(mpsc::error::TrySendError::Closed(_)) => {
                    tracing::warn!("gateway worker {next} stopped; connection from {peer} dropped");
                }
            }
            next = (next + 1) % handoffs.len();
        }
        if let Some((stream, peer)) = socket {
            let open = (stats.worker(next).open_connection(), slot.take());
            let handed = tokio::select! {
                biased;
                () = &mut stop => break,
                handed = handoffs[next].send((stream, peer, open)) => handed,
            };
            if handed.is_err() {
                tracing::warn!("gateway worker {next} stopped; connection from {peer} dropped");
            }
            next = (next + 1) % handoffs.len();
        }
    }

    drop(listener);
    drop(handoffs);
    let mut outcome = Drain::Complete;
    for drain in drains {
        match drain.await {
            Ok(Drain::Complete) => {}
            Ok(Drain::TimedOut { connections }) => {
                outcome = match outcome {
                    Drain::Complete => Drain::TimedOut { connections },
                    Drain::TimedOut { connections: c } => Drain::TimedOut {
                        connections: c + connections,
                    },
                };
            }
            Err(_) => {
                tracing::warn!("a gateway worker ended without draining");
                if outcome == Drain::Complete {
                    outcome = Drain::TimedOut { connections: 0 };
                }
            }
        }
    }
    outcome
}

/// An HTTP/2 connection whose preface (and so the handshake) is due within the
/// head timeout, as a request head is: until it has begun, hyper would wait, and
/// hold the connection's place, for ever (SPEC O5 over TLS too).
fn preface_due<IO>(stream: IO) -> sluice_door::FirstWords<IO> {
    sluice_door::FirstWords::new(
        stream,
        sluice_door::HTTP2_HANDSHAKE_BYTES,
        HEADER_READ_TIMEOUT,
    )
}

/// One worker: serves every socket handed to it until the hand-off queue closes, then
/// waits up to `grace` for its connections to finish.
async fn work<S, B>(
    mut sockets: mpsc::Receiver<Handoff>,
    service: S,
    fast: FastPath,
    stats: RequestStats,
    grace: Duration,
    tls: Option<tokio_rustls::TlsAcceptor>,
) -> Drain
where
    S: Service<Request<GatewayBody>, Response = Response<B>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    B: http_body::Body + Send + Unpin + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    let mut http1 = http1::Builder::new();
    http1
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT)
        .max_buf_size(MAX_REQUEST_HEAD_BYTES);
    let mut http2 = http2::Builder::new(TokioExecutor::new());
    http2
        .timer(TokioTimer::new())
        .max_header_list_size(MAX_REQUEST_HEAD_BYTES as u32)
        // A peer that stops answering pings is gone: its connection is closed.
        .keep_alive_interval(Some(HTTP2_PING_EVERY))
        .keep_alive_timeout(HTTP2_PING_TIMEOUT);
    // Tells every connection that the worker drains. Each connection's task holds
    // one receiver until it ends: their count is the connections open, and the
    // channel closes once the last has ended.
    let (draining, drain_started) = watch::channel(false);
    let fast = Arc::new(fast);
    tokio::spawn({
        let fast = Arc::clone(&fast);
        async move {
            let mut every = tokio::time::interval(super::pool::PRUNE_EVERY);
            loop {
                every.tick().await;
                fast.prune();
            }
        }
    });

    while let Some((stream, peer, open)) = sockets.recv().await {
        let Ok(stream) = TcpStream::from_std(stream) else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        let metered = Metered::new(service.clone(), peer, stats.clone(), HEADER_READ_TIMEOUT);
        let (http1, http2) = (http1.clone(), http2.clone());
        let mut drain_started = drain_started.clone();
        let fast = Arc::clone(&fast);
        if let Some(acceptor) = &tls {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let _open = open;
                // The handshake is due as a request head is (SPEC O5): a client
                // hello that never finishes is closed at the head timeout.
                let handshake = crate::listener_tls::handshake(
                    &acceptor,
                    stream,
                    HEADER_READ_TIMEOUT,
                    "gateway",
                );
                let stream = tokio::select! {
                    biased;
                    stream = handshake => stream,
                    _ = drain_started.wait_for(|started| *started) => return,
                };
                let Some(stream) = stream else { return };
                // Over TLS every request takes the hyper path (BENCHMARKS.md, TLS).
                if stream.get_ref().1.alpn_protocol() == Some(b"h2") {
                    serve_http2(&http2, stream, metered, drain_started).await;
                } else {
                    let service = h1_service(metered, stream.get_ref().0, fast.has_lanes());
                    serve_http1(&http1, stream, service, drain_started).await;
                }
            });
            continue;
        }
        tokio::spawn(async move {
            let _open = open;
            // Bytes already there win over the drain: that request is answered.
            let protocol = tokio::select! {
                biased;
                protocol = sniff(&stream) => protocol,
                _ = drain_started.wait_for(|started| *started) => return,
            };
            // A connection error (reset, malformed request) concerns that client only.
            match protocol {
                // An https upstream: hyper serves every connection from the start.
                Some(Protocol::Http1) if !fast.is_on() => {
                    let service = h1_service(metered, &stream, fast.has_lanes());
                    serve_http1(&http1, stream, service, drain_started).await;
                }
                Some(Protocol::Http1) => {
                    let served = fast.serve(
                        stream,
                        peer,
                        &mut drain_started,
                        HEADER_READ_TIMEOUT,
                        MAX_REQUEST_HEAD_BYTES,
                    );
                    let (stream, service) = match served.await {
                        Ended::Closed => return,
                        Ended::Elsewhere(stream, read) => {
                            let service = h1_service(metered, &stream, fast.has_lanes());
                            (Rewind::new(stream, read), service)
                        }
                    };
                    serve_http1(&http1, stream, service, drain_started).await;
                }
                Some(Protocol::Http2) => {
                    serve_http2(&http2, stream, metered, drain_started).await;
                }
                None => {}
            }
        });
    }

    drop(drain_started);
    let open = draining.receiver_count();
    draining.send_replace(true);
    match tokio::time::timeout(grace, draining.closed()).await {
        Ok(()) => Drain::Complete,
        Err(_) => Drain::TimedOut { connections: open },
    }
}

/// Serves `connection` until it ends, shutting it down gracefully with `shutdown`
/// (requests in flight finish, no new one is taken; over HTTP/2 a GOAWAY) once the
/// worker drains, or, given its `streams`, once none of them has been in flight for
/// [`IDLE_TIMEOUT`]. `draining` is held until the connection ends.
///
/// Given its `streams` (HTTP/2), a stream whose client takes nothing of its answer
/// for [`SEND_TIMEOUT`] has its response body dropped, before and after the shutdown;
/// and once shut down, a connection that has had nothing in flight for
/// [`SEND_TIMEOUT`] is dropped: the streams hyper still holds open then are ones
/// their clients stalled, which would keep a graceful close waiting for ever.
async fn drive<C, E>(
    connection: C,
    shutdown: impl FnOnce(Pin<&mut C>),
    mut draining: watch::Receiver<bool>,
    streams: Option<Streams>,
) where
    C: Future<Output = Result<(), E>>,
{
    tokio::pin!(connection);
    let idle_for = |timeout| {
        let streams = streams.clone();
        async move {
            match streams {
                Some(streams) => streams.idle_for(timeout, SEND_TIMEOUT).await,
                None => std::future::pending().await,
            }
        }
    };
    // A connection error (reset, malformed request) concerns that client only.
    tokio::select! {
        biased;
        _ = connection.as_mut() => return,
        _ = draining.wait_for(|started| *started) => {}
        () = idle_for(IDLE_TIMEOUT) => {}
    }
    shutdown(connection.as_mut());
    tokio::select! {
        biased;
        _ = connection.as_mut() => {}
        () = idle_for(SEND_TIMEOUT) => {}
    }
}

/// Serves `stream` over HTTP/1.1 with `service` until it ends (see [`drive`]).
async fn serve_http1<IO, S, B>(
    http1: &http1::Builder,
    stream: IO,
    service: TowerToHyperService<Metered<S>>,
    draining: watch::Receiver<bool>,
) where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    S: Service<Request<GatewayBody>, Response = Response<B>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    B: http_body::Body + Send + Unpin + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    let connection = http1.serve_connection(
        TokioIo::new(SendDeadline::new(stream, SEND_TIMEOUT)),
        service,
    );
    drive(
        connection,
        http1::Connection::graceful_shutdown,
        draining,
        None,
    )
    .await;
}

/// Serves `stream` over HTTP/2 with `metered` until it ends: its preface due as a
/// head is, its streams counted for the idle and send timeouts (see [`drive`]).
async fn serve_http2<IO, S, B>(
    http2: &http2::Builder<TokioExecutor>,
    stream: IO,
    metered: Metered<S>,
    draining: watch::Receiver<bool>,
) where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    S: Service<Request<GatewayBody>, Response = Response<B>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    B: http_body::Body + Send + Unpin + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    let streams = Streams::new();
    let service = TowerToHyperService::new(metered.counting(streams.clone()));
    let connection = http2.serve_connection(
        TokioIo::new(SendDeadline::new(preface_due(stream), SEND_TIMEOUT)),
        service,
    );
    drive(
        connection,
        http2::Connection::graceful_shutdown,
        draining,
        Some(streams),
    )
    .await;
}

/// The service of an HTTP/1.1 connection hyper serves: where the policy has
/// lanes (`lanes`), its requests hear the client hang up, for a call waiting for
/// a place (over HTTP/2 hyper hears of a stream the client gave up).
fn h1_service<S>(
    metered: Metered<S>,
    stream: &TcpStream,
    lanes: bool,
) -> TowerToHyperService<Metered<S>> {
    let hangup = if lanes {
        crate::hangup::watch(stream)
    } else {
        None
    };
    TowerToHyperService::new(metered.with_hangup(hangup))
}

/// The protocol a client speaks, told by its first bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Protocol {
    Http1,
    /// HTTP/2 with prior knowledge (the connection preface `PRI * HTTP/2.0`).
    Http2,
}

/// The start of the HTTP/2 connection preface; no HTTP/1 method is `PRI`.
const H2_PREFACE_START: &[u8; 4] = b"PRI ";

/// The protocol `first` bytes (at most four, at least one) tell, or `None` when they
/// could still start either.
fn classify(first: &[u8]) -> Option<Protocol> {
    if !H2_PREFACE_START.starts_with(first) {
        Some(Protocol::Http1)
    } else if first.len() == H2_PREFACE_START.len() {
        Some(Protocol::Http2)
    } else {
        None
    }
}

/// First pause before peeking again when the first bytes could still start either
/// protocol; it doubles up to [`SNIFF_RETRY_MAX`], so a client that stalls after one
/// byte costs a handful of peeks, not one per millisecond.
const SNIFF_RETRY: Duration = Duration::from_millis(1);

/// Longest pause between two peeks.
const SNIFF_RETRY_MAX: Duration = Duration::from_millis(100);

/// Peeks (without consuming) until the first bytes tell HTTP/1 from HTTP/2. `None`
/// when the client closes or sends nothing within [`HEADER_READ_TIMEOUT`]. Deciding
/// here, once per connection, lets each connection be served by the plain HTTP/1 or
/// HTTP/2 server instead of one that replays the sniffed bytes on every read.
async fn sniff(stream: &TcpStream) -> Option<Protocol> {
    let mut first = [0u8; 4];
    let mut pause = SNIFF_RETRY;
    let sniffing = async {
        loop {
            let n = stream.peek(&mut first).await.ok()?;
            if n == 0 {
                return None;
            }
            if let Some(protocol) = classify(&first[..n]) {
                return Some(protocol);
            }
            // "P", "PR" or "PRI" so far (POST, PUT, PATCH… or the preface): the
            // peeked bytes stay readable, so wait a moment before looking again.
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(SNIFF_RETRY_MAX);
        }
    };
    tokio::time::timeout(HEADER_READ_TIMEOUT, sniffing)
        .await
        .ok()
        .flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::convert::Infallible;

    use bytes::Bytes;
    use http_body_util::{BodyExt as _, Empty, StreamBody};
    use hyper::body::Frame;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    use tokio::time::Instant;

    /// Chunks of [`answers`]' `/slow` body, one every [`SLOW_EVERY`]: the body takes
    /// three times [`IDLE_TIMEOUT`] and more.
    const SLOW_CHUNKS: u32 = 10;
    const SLOW_EVERY: Duration = Duration::from_secs(10);

    /// The body of [`answers`]: `/slow` streams, anything else is whole.
    type TestBody = StreamBody<
        Pin<Box<dyn futures_util::Stream<Item = Result<Frame<Bytes>, Infallible>> + Send>>,
    >;

    /// The service a test worker runs: `ok` at once, or on `/slow`, [`SLOW_CHUNKS`]
    /// chunks one every [`SLOW_EVERY`].
    fn answers() -> impl Service<
        Request<GatewayBody>,
        Response = Response<TestBody>,
        Error = Infallible,
        Future = impl Send + 'static,
    > + Clone
    + Send
    + 'static {
        tower::service_fn(|request: Request<GatewayBody>| async move {
            let slow = request.uri().path() == "/slow";
            let chunks = futures_util::stream::unfold(0, move |sent| async move {
                if !slow {
                    return (sent == 0).then(|| (Ok(Frame::data(Bytes::from_static(b"ok"))), 1));
                }
                if sent == SLOW_CHUNKS {
                    return None;
                }
                tokio::time::sleep(SLOW_EVERY).await;
                Some((Ok(Frame::data(Bytes::from_static(b"chunk\n"))), sent + 1))
            });
            let body: TestBody = StreamBody::new(Box::pin(chunks));
            Ok::<_, Infallible>(Response::new(body))
        })
    }

    /// One worker serving [`answers`] (its fast path in front of nothing) on a
    /// loopback port, on this test's runtime: its address, how its drain ended, and
    /// the sender that drains it when dropped.
    async fn worker() -> (SocketAddr, oneshot::Receiver<Drain>, mpsc::Sender<()>) {
        worker_serving(answers()).await
    }

    /// The same, serving `service`.
    async fn worker_serving<S>(
        service: S,
    ) -> (SocketAddr, oneshot::Receiver<Drain>, mpsc::Sender<()>)
    where
        S: Service<Request<GatewayBody>, Response = Response<TestBody>, Error = Infallible>
            + Clone
            + Send
            + 'static,
        S::Future: Send + 'static,
    {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let stats = RequestStats::with_workers(NonZeroUsize::MIN);
        let fast = FastPath::for_tests(SocketAddr::from(([127, 0, 0, 1], 9)));
        let (handoff, sockets) = mpsc::channel(8);
        let (drained, drain) = oneshot::channel();
        let (stop, mut stopped) = mpsc::channel::<()>(1);
        let worker_stats = stats.worker(0);
        tokio::spawn(async move {
            let grace = Duration::from_secs(600);
            let outcome = work(sockets, service, fast, worker_stats, grace, None).await;
            let _ = drained.send(outcome);
        });
        tokio::spawn(async move {
            loop {
                let (stream, peer) = tokio::select! {
                    accepted = listener.accept() => accepted.expect("accept"),
                    _ = stopped.recv() => return,
                };
                let stream = stream.into_std().expect("std stream");
                let open = (stats.worker(0).open_connection(), None);
                if handoff.send((stream, peer, open)).await.is_err() {
                    return;
                }
            }
        });
        (addr, drain, stop)
    }

    /// An HTTP/2 (prior knowledge) client of `addr`: its request sender, and its
    /// connection's task, which ends when the connection closes.
    async fn h2_client(
        addr: SocketAddr,
    ) -> (
        hyper::client::conn::http2::SendRequest<Empty<Bytes>>,
        tokio::task::JoinHandle<hyper::Result<()>>,
    ) {
        let stream = TcpStream::connect(addr).await.expect("connect");
        let (send, connection) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
                .await
                .expect("HTTP/2 handshake");
        (send, tokio::spawn(connection))
    }

    /// The body of `path` asked on `send`, whole.
    async fn fetch(
        send: &mut hyper::client::conn::http2::SendRequest<Empty<Bytes>>,
        path: &str,
    ) -> hyper::Result<Bytes> {
        let request = Request::get(format!("http://localhost{path}"))
            .body(Empty::new())
            .expect("request");
        let answer = send.send_request(request).await?;
        Ok(answer.into_body().collect().await?.to_bytes())
    }

    /// `waited` is the idle timeout (within the second a paused clock's timers take).
    fn assert_one_idle_timeout(waited: Duration) {
        assert!(
            (IDLE_TIMEOUT..IDLE_TIMEOUT + Duration::from_secs(1)).contains(&waited),
            "{waited:?}"
        );
    }

    /// Waits for `connection` to close: how long it took.
    async fn closed_after(connection: tokio::task::JoinHandle<hyper::Result<()>>) -> Duration {
        let from = Instant::now();
        tokio::time::timeout(IDLE_TIMEOUT * 4, connection)
            .await
            .expect("the connection was closed")
            .expect("client connection task")
            .expect("the connection closed cleanly");
        from.elapsed()
    }

    #[tokio::test(start_paused = true)]
    async fn an_idle_http2_connection_is_closed_after_the_idle_timeout() {
        let (addr, _drain, _stop) = worker().await;

        // One request, then nothing but the pings the gateway sends (which the
        // client answers): the connection is closed one idle timeout after the answer.
        let (mut send, connection) = h2_client(addr).await;
        assert_eq!(fetch(&mut send, "/").await.expect("answer"), "ok");
        assert_one_idle_timeout(closed_after(connection).await);

        // One that never opens a stream: closed one idle timeout after its handshake.
        let (_send, connection) = h2_client(addr).await;
        assert_one_idle_timeout(closed_after(connection).await);
    }

    #[tokio::test(start_paused = true)]
    async fn an_http2_stream_still_sending_its_body_keeps_the_connection() {
        let (addr, _drain, _stop) = worker().await;
        let (mut send, connection) = h2_client(addr).await;

        // The answer's headers come at once; its body takes three idle timeouts and more.
        let started = Instant::now();
        let body = fetch(&mut send, "/slow")
            .await
            .expect("the whole slow body");
        assert_eq!(body, "chunk\n".repeat(SLOW_CHUNKS as usize));
        assert!(
            started.elapsed() >= IDLE_TIMEOUT * 3,
            "{:?}",
            started.elapsed()
        );

        // The connection still takes requests (no GOAWAY was sent while the body
        // streamed), and is closed one idle timeout after the last.
        assert_eq!(
            fetch(&mut send, "/")
                .await
                .expect("a request after the slow body"),
            "ok"
        );
        assert_one_idle_timeout(closed_after(connection).await);
    }

    #[tokio::test(start_paused = true)]
    async fn an_idle_http1_connection_on_the_hyper_path_is_closed_after_the_idle_timeout() {
        let (addr, _drain, _stop) = worker().await;
        let mut client = TcpStream::connect(addr).await.expect("connect");
        // A chunked body: the fast path leaves the connection to hyper.
        client
            .write_all(b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n")
            .await
            .expect("write");
        let from = Instant::now();
        let mut answer = Vec::new();
        tokio::time::timeout(IDLE_TIMEOUT * 4, client.read_to_end(&mut answer))
            .await
            .expect("the connection was closed")
            .expect("read");
        let answer = String::from_utf8_lossy(&answer);
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(answer.ends_with("ok\r\n0\r\n\r\n"), "{answer}");
        assert_one_idle_timeout(from.elapsed());
    }

    #[tokio::test(start_paused = true)]
    async fn a_draining_worker_lets_an_http2_stream_finish_then_closes() {
        let (addr, drain, stop) = worker().await;
        let (mut send, connection) = h2_client(addr).await;
        let slow = tokio::spawn(async move {
            let started = Instant::now();
            let body = fetch(&mut send, "/slow").await;
            (body, started.elapsed())
        });
        // The stream is open: the worker drains meanwhile.
        tokio::time::sleep(SLOW_EVERY / 2).await;
        drop(stop);
        let (body, took) = slow.await.expect("slow request task");
        assert_eq!(
            body.expect("the whole slow body"),
            "chunk\n".repeat(SLOW_CHUNKS as usize)
        );
        assert!(took >= SLOW_EVERY * SLOW_CHUNKS, "{took:?}");
        let waited = closed_after(connection).await;
        assert!(waited < Duration::from_secs(1), "{waited:?}");
        assert_eq!(drain.await.expect("the worker drained"), Drain::Complete);
    }

    /// A piece of the answers of [`stalling`].
    const PIECE: usize = 16 * 1024;
    /// A piece of `/large`, of which there are two: far more than a client window.
    const LARGE_PIECE: usize = 256 * 1024;

    /// Sends the time on its channel when dropped: when an answer's body (the
    /// upstream's side) was let go.
    struct DropNote(mpsc::UnboundedSender<Instant>);

    impl Drop for DropNote {
        fn drop(&mut self) {
            let _ = self.0.send(Instant::now());
        }
    }

    /// A service standing for an upstream whose bodies note on `dropped` when they
    /// are dropped: `/endless` has [`PIECE`]s ready for ever, `/late` waits three send
    /// timeouts for its upstream and then has one piece, `/large` has two
    /// [`LARGE_PIECE`]s ready at once.
    fn stalling(
        dropped: mpsc::UnboundedSender<Instant>,
    ) -> impl Service<
        Request<GatewayBody>,
        Response = Response<TestBody>,
        Error = Infallible,
        Future = impl Send + 'static,
    > + Clone
    + Send
    + 'static {
        tower::service_fn(move |request: Request<GatewayBody>| {
            let note = DropNote(dropped.clone());
            async move {
                let piece = |len| Ok(Frame::data(Bytes::from(vec![7u8; len])));
                let pieces: TestBody = match request.uri().path() {
                    "/endless" => StreamBody::new(Box::pin(futures_util::stream::unfold(
                        note,
                        move |note| async move { Some((piece(PIECE), note)) },
                    ))),
                    "/late" => StreamBody::new(Box::pin(futures_util::stream::unfold(
                        (note, false),
                        move |(note, sent)| async move {
                            if sent {
                                return None;
                            }
                            tokio::time::sleep(SEND_TIMEOUT * 3).await;
                            Some((piece(PIECE), (note, true)))
                        },
                    ))),
                    _ => StreamBody::new(Box::pin(futures_util::stream::unfold(
                        (note, 0),
                        move |(note, sent)| async move {
                            (sent < 2).then(|| (piece(LARGE_PIECE), (note, sent + 1)))
                        },
                    ))),
                };
                Ok::<_, Infallible>(Response::new(pieces))
            }
        })
    }

    /// A raw HTTP/2 client of `addr` whose streams' receive windows start at
    /// `window`: its request sender, a sender of new initial windows (a SETTINGS
    /// frame, which moves the windows of open streams too), and its connection's
    /// task, which ends when the connection closes.
    async fn raw_h2_client(
        addr: SocketAddr,
        window: u32,
    ) -> (
        h2::client::SendRequest<Bytes>,
        mpsc::UnboundedSender<u32>,
        tokio::task::JoinHandle<Result<(), h2::Error>>,
    ) {
        let stream = TcpStream::connect(addr).await.expect("connect");
        let (send, mut connection) = h2::client::Builder::new()
            .initial_window_size(window)
            .handshake::<_, Bytes>(stream)
            .await
            .expect("HTTP/2 handshake");
        let (windows, mut resized) = mpsc::unbounded_channel();
        let task = tokio::spawn(async move {
            loop {
                tokio::select! {
                    closed = &mut connection => return closed,
                    Some(window) = resized.recv() => connection.set_initial_window_size(window)?,
                }
            }
        });
        (send, windows, task)
    }

    /// Asks `path` on `send`: the answer's head.
    async fn ask(
        send: &mut h2::client::SendRequest<Bytes>,
        path: &str,
    ) -> http::Response<h2::RecvStream> {
        let request = Request::get(format!("http://localhost{path}"))
            .body(())
            .expect("request");
        let (answer, _) = send.send_request(request, true).expect("a stream");
        answer.await.expect("the answer's head")
    }

    /// `waited` is `timeout` (within the second a paused clock's timers take).
    fn assert_about(waited: Duration, timeout: Duration) {
        assert!(
            (timeout..timeout + Duration::from_secs(1)).contains(&waited),
            "{waited:?}, not {timeout:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_http2_stream_the_client_never_lets_send_releases_its_body_at_the_send_timeout() {
        let counted = crate::stalled::Counted::new();
        let _recording = counted.install();
        let (dropped, mut drops) = mpsc::unbounded_channel();
        let (addr, _drain, _stop) = worker_serving(stalling(dropped)).await;
        // A window of 0: the client lets nothing of any answer come.
        let (mut send, _windows, connection) = raw_h2_client(addr, 0).await;
        let started = Instant::now();
        let answer = ask(&mut send, "/endless").await;
        assert_eq!(answer.status(), 200);

        // The body handed hyper its first piece, which cannot go: the body (the
        // upstream's side) is dropped one send timeout later, not held for ever.
        let dropped_at = tokio::time::timeout(SEND_TIMEOUT * 4, drops.recv())
            .await
            .expect("the body was dropped")
            .expect("a drop note");
        assert_about(dropped_at - started, SEND_TIMEOUT);
        // Counted, so an operator sees it (`sluice_stalled_clients_total`).
        assert_eq!(counted.of(crate::stalled::Cut::Stream), 1);

        // The stream no longer counts in flight: the connection is shut down one idle
        // timeout later, and, as the stalled stream keeps a graceful close waiting,
        // dropped once nothing has been in flight for a send timeout.
        let closed = tokio::time::timeout(SEND_TIMEOUT * 4, connection).await;
        closed
            .expect("the connection was closed")
            .expect("client connection task")
            .ok();
        assert_about(Instant::now() - dropped_at, SEND_TIMEOUT);
        drop(answer);
    }

    #[tokio::test(start_paused = true)]
    async fn an_http2_stream_cut_for_its_stalled_client_is_reset_when_its_window_opens() {
        let (dropped, mut drops) = mpsc::unbounded_channel();
        let (addr, _drain, _stop) = worker_serving(stalling(dropped)).await;
        let (mut send, windows, _connection) = raw_h2_client(addr, 0).await;
        let answer = ask(&mut send, "/endless").await;
        tokio::time::timeout(SEND_TIMEOUT * 4, drops.recv())
            .await
            .expect("the body was dropped")
            .expect("a drop note");

        // The client opens its window: it gets the piece hyper held, then the
        // stream's reset, never an answer that looks whole.
        windows.send(PIECE as u32 * 4).expect("window");
        let mut body = answer.into_body();
        let mut got = 0;
        let ended = loop {
            match body.data().await {
                Some(Ok(data)) => {
                    got += data.len();
                    let _ = body.flow_control().release_capacity(data.len());
                }
                Some(Err(error)) => break error,
                None => panic!("the stream ended as if whole after {got} bytes"),
            }
        };
        assert!(ended.is_reset() && ended.is_remote(), "{ended:?}");
        assert_eq!(
            ended.reason(),
            Some(h2::Reason::INTERNAL_ERROR),
            "{ended:?}"
        );
        // (h2 drops what was queued for a stream it resets.)
        assert!(got <= PIECE, "{got}");
    }

    #[tokio::test(start_paused = true)]
    async fn an_http2_stream_waiting_on_a_slow_upstream_is_not_cut() {
        let (dropped, mut drops) = mpsc::unbounded_channel();
        let (addr, _drain, _stop) = worker_serving(stalling(dropped)).await;
        let (mut send, _windows, _connection) = raw_h2_client(addr, 65_535).await;
        let started = Instant::now();
        let mut body = ask(&mut send, "/late").await.into_body();
        let mut got = 0;
        while let Some(data) = body.data().await {
            let data = data.expect("the whole body");
            got += data.len();
            let _ = body.flow_control().release_capacity(data.len());
        }
        assert_eq!(got, PIECE);
        assert!(
            started.elapsed() >= SEND_TIMEOUT * 3,
            "{:?}",
            started.elapsed()
        );
        let dropped_at = drops.recv().await.expect("the body was dropped");
        assert!(dropped_at - started >= SEND_TIMEOUT * 3);
    }

    #[tokio::test(start_paused = true)]
    async fn an_http2_client_taking_a_large_answer_slowly_is_not_cut() {
        let (dropped, _drops) = mpsc::unbounded_channel();
        let (addr, _drain, _stop) = worker_serving(stalling(dropped)).await;
        // A small window the client moves on a piece every 20 s: the two large
        // pieces take minutes, and the second waits on the first for most of it.
        let (mut send, _windows, _connection) = raw_h2_client(addr, PIECE as u32).await;
        let started = Instant::now();
        let mut body = ask(&mut send, "/large").await.into_body();
        let mut got = 0;
        while let Some(data) = body.data().await {
            let data = data
                .unwrap_or_else(|e| panic!("after {got} bytes, {:?}: {e:?}", started.elapsed()));
            got += data.len();
            tokio::time::sleep(Duration::from_secs(20)).await;
            let _ = body.flow_control().release_capacity(data.len());
        }
        assert_eq!(got, 2 * LARGE_PIECE);
        assert!(
            started.elapsed() >= SEND_TIMEOUT * 5,
            "{:?}",
            started.elapsed()
        );
    }

    #[test]
    fn first_bytes_tell_http1_from_http2_prior_knowledge() {
        assert_eq!(classify(b"GET "), Some(Protocol::Http1));
        assert_eq!(classify(b"PUT "), Some(Protocol::Http1));
        assert_eq!(classify(b"PO"), Some(Protocol::Http1));
        assert_eq!(classify(b"PRI "), Some(Protocol::Http2));
        assert_eq!(classify(b"P"), None);
        assert_eq!(classify(b"PRI"), None);
    }

    #[tokio::test]
    async fn a_preface_arriving_in_pieces_is_still_http2() {
        use tokio::io::AsyncWriteExt as _;
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let mut client = TcpStream::connect(listener.local_addr().expect("addr"))
            .await
            .expect("connect");
        let (server, _) = listener.accept().await.expect("accept");
        let sniffed = tokio::spawn(async move { sniff(&server).await });
        client.write_all(b"PR").await.expect("write");
        client.flush().await.expect("flush");
        tokio::task::yield_now().await;
        client.write_all(b"I * HTTP/2.0\r\n").await.expect("write");
        assert_eq!(sniffed.await.expect("sniff"), Some(Protocol::Http2));

        // A client that closes before sending anything is no protocol at all.
        let client = TcpStream::connect(listener.local_addr().expect("addr"))
            .await
            .expect("connect");
        let (server, _) = listener.accept().await.expect("accept");
        drop(client);
        assert_eq!(sniff(&server).await, None);
    }
}
