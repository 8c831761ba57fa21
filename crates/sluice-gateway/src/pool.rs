//! Keep-alive HTTP/1.1 connections to the one upstream: one pool per gateway worker,
//! serving both of its request paths.
//!
//! The gateway talks to a single upstream, so the pool is a plain stack of idle
//! sockets ([`Connections`]): no per-host map, no key hashing, no lock contention (each
//! worker thread has its own). A socket in the stack is one whose last response was
//! read to its end; the most recently used is handed out first (its peer is the least
//! likely to have closed it), and one found closed, or idle for longer than
//! [`IDLE_TIMEOUT`], is dropped.
//!
//! The fast path drives a socket from the client connection's own task. The hyper
//! path ([`UpstreamPool`]) lends a socket to a hyper client connection for one
//! exchange and takes it back once the response body has been read to the end and
//! hyper reports the connection ready for another request (so `Connection: close`,
//! HTTP/1.0 and a request body the upstream did not take all keep it out).
//!
//! A request a pooled connection never took (the upstream closed it in the meantime)
//! is sent again on the next connection: nothing of it reached the upstream. A request
//! that was taken and then failed is not retried.
//!
//! To an https upstream the hyper path's connections are TLS ([`UpstreamIo::Tls`]),
//! pooled the same way; the fast path is off then and never takes one.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body::{Body, Frame, SizeHint};
use http_body_util::combinators::UnsyncBoxBody;
use hyper::body::Incoming;
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::boxed::BoxError;

/// The body type sent to the upstream (any incoming body, boxed).
pub(super) type OutgoingBody = UnsyncBoxBody<Bytes, BoxError>;

/// How long an idle upstream connection is kept.
pub(super) const IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// How often stale upstream connections are closed.
pub(super) const PRUNE_EVERY: Duration = Duration::from_secs(10);

/// At most this many idle upstream connections per worker.
pub(super) const POOL_MAX_IDLE: usize = 256;

/// Why a request got no response from the upstream.
#[derive(Debug)]
pub(super) enum SendError {
    /// No connection could be opened.
    Connect,
    /// The connection failed before the response headers arrived.
    Upstream,
}

/// A connection to the upstream: plain TCP, or TLS over it for an https upstream.
#[derive(Debug)]
pub(super) enum UpstreamIo {
    /// Plain HTTP/1.1.
    Plain(TcpStream),
    /// HTTP/1.1 over TLS.
    Tls(Box<tokio_rustls::client::TlsStream<TcpStream>>),
}

impl UpstreamIo {
    /// The socket underneath.
    fn tcp(&self) -> &TcpStream {
        match self {
            UpstreamIo::Plain(stream) => stream,
            UpstreamIo::Tls(stream) => stream.get_ref().0,
        }
    }
}

impl AsyncRead for UpstreamIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            UpstreamIo::Plain(stream) => Pin::new(stream).poll_read(cx, buf),
            UpstreamIo::Tls(stream) => Pin::new(stream.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for UpstreamIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            UpstreamIo::Plain(stream) => Pin::new(stream).poll_write(cx, buf),
            UpstreamIo::Tls(stream) => Pin::new(stream.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            UpstreamIo::Plain(stream) => Pin::new(stream).poll_write_vectored(cx, bufs),
            UpstreamIo::Tls(stream) => Pin::new(stream.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            UpstreamIo::Plain(stream) => stream.is_write_vectored(),
            UpstreamIo::Tls(stream) => stream.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            UpstreamIo::Plain(stream) => Pin::new(stream).poll_flush(cx),
            UpstreamIo::Tls(stream) => Pin::new(stream.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            UpstreamIo::Plain(stream) => Pin::new(stream).poll_shutdown(cx),
            UpstreamIo::Tls(stream) => Pin::new(stream.as_mut()).poll_shutdown(cx),
        }
    }
}

/// How new connections to the upstream are opened.
enum Transport {
    /// Plain TCP.
    Tcp,
    /// TLS, verifying the upstream as `name`.
    Tls {
        connector: tokio_rustls::TlsConnector,
        name: ServerName<'static>,
    },
    /// An https upstream given no roots to verify it with: every connect fails.
    Unverifiable,
}

impl std::fmt::Debug for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Transport::Tcp => f.write_str("Tcp"),
            Transport::Tls { name, .. } => write!(f, "Tls({name:?})"),
            Transport::Unverifiable => f.write_str("Unverifiable"),
        }
    }
}

/// One worker's idle connections to the upstream.
#[derive(Debug)]
pub(super) struct Connections {
    /// `host:port` to connect to.
    target: String,
    /// Plain or TLS.
    transport: Transport,
    /// At most this many connections wait idle.
    max_idle: usize,
    /// Oldest first.
    idle: Mutex<VecDeque<Idle>>,
    /// Connections of the hyper path whose response has ended, on their way back
    /// (their task has yet to see hyper report them ready).
    returning: AtomicUsize,
}

#[derive(Debug)]
struct Idle {
    stream: UpstreamIo,
    since: Instant,
}

impl Connections {
    /// An empty pool of plain connections to `target` (`host:port`), keeping at most
    /// [`POOL_MAX_IDLE`] idle.
    #[cfg(test)]
    pub(super) fn new(target: String) -> Self {
        Self::with_max_idle(target, POOL_MAX_IDLE)
    }

    /// An empty pool of connections to `upstream` (TLS to an https one), keeping at
    /// most [`POOL_MAX_IDLE`] idle.
    pub(super) fn to(upstream: &crate::Upstream) -> Self {
        let transport = match upstream.tls_parts() {
            None => Transport::Tcp,
            Some((name, Some(tls))) => Transport::Tls {
                connector: tls.connector(),
                name: name.clone(),
            },
            Some((_, None)) => Transport::Unverifiable,
        };
        Connections {
            transport,
            ..Self::with_max_idle(upstream.connect_target(), POOL_MAX_IDLE)
        }
    }

    fn with_max_idle(target: String, max_idle: usize) -> Self {
        Connections {
            target,
            transport: Transport::Tcp,
            max_idle,
            idle: Mutex::new(VecDeque::new()),
            returning: AtomicUsize::new(0),
        }
    }

    fn idle(&self) -> MutexGuard<'_, VecDeque<Idle>> {
        // The queue is left consistent at every point a panic could occur.
        self.idle.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The most recently used idle plain connection that is still open, if any (the
    /// fast path's: it never runs for an https upstream, whose connections are TLS).
    pub(super) fn checkout(&self) -> Option<TcpStream> {
        match self.checkout_io()? {
            UpstreamIo::Plain(stream) => Some(stream),
            UpstreamIo::Tls(_) => None,
        }
    }

    /// The most recently used idle connection that is still open, if any.
    fn checkout_io(&self) -> Option<UpstreamIo> {
        let now = Instant::now();
        let mut idle = self.idle();
        while let Some(Idle { stream, since }) = idle.pop_back() {
            if now.saturating_duration_since(since) >= IDLE_TIMEOUT {
                // Everything older is older still.
                idle.clear();
                return None;
            }
            // Anything to read while idle means the upstream closed it or sent bytes no
            // request asked for (which would be taken for the next request's answer):
            // either way it cannot carry a request.
            if quiet(stream.tcp(), now.saturating_duration_since(since)) {
                return Some(stream);
            }
        }
        None
    }

    /// Puts a plain connection whose last response was read to its end back.
    pub(super) fn checkin(&self, stream: TcpStream) {
        self.checkin_io(UpstreamIo::Plain(stream));
    }

    /// Puts a connection whose last response was read to its end back.
    fn checkin_io(&self, stream: UpstreamIo) {
        let mut idle = self.idle();
        if idle.len() >= self.max_idle {
            idle.pop_front();
        }
        idle.push_back(Idle {
            stream,
            since: Instant::now(),
        });
    }

    /// Closes the connections idle for longer than [`IDLE_TIMEOUT`]; the worker calls
    /// it every [`PRUNE_EVERY`], so a quiet pool does not hold idle sockets open.
    pub(super) fn prune(&self) {
        let now = Instant::now();
        let mut idle = self.idle();
        while idle
            .front()
            .is_some_and(|i| now.saturating_duration_since(i.since) >= IDLE_TIMEOUT)
        {
            idle.pop_front();
        }
    }

    /// A new connection.
    ///
    /// # Errors
    /// The connect's.
    pub(super) async fn connect(&self) -> std::io::Result<TcpStream> {
        let stream = TcpStream::connect(&self.target).await?;
        stream.set_nodelay(true)?;
        Ok(stream)
    }

    /// A new connection, TLS (handshake done, certificate verified) to an https
    /// upstream.
    ///
    /// # Errors
    /// The connect's, or the handshake's.
    async fn connect_io(&self) -> std::io::Result<UpstreamIo> {
        let (connector, name) = match &self.transport {
            Transport::Tcp => return Ok(UpstreamIo::Plain(self.connect().await?)),
            Transport::Tls { connector, name } => (connector, name),
            Transport::Unverifiable => {
                return Err(std::io::Error::other(
                    "no root certificates to verify the https upstream with",
                ));
            }
        };
        let stream = self.connect().await?;
        match connector.connect(name.clone(), stream).await {
            Ok(tls) => Ok(UpstreamIo::Tls(Box::new(tls))),
            Err(error) => {
                tracing::warn!("TLS with the upstream {} failed: {error}", self.target);
                Err(error)
            }
        }
    }
}

/// Closes `connections`' stale sockets every [`PRUNE_EVERY`] until the pool is gone,
/// on a task of the current runtime (when there is one). For a pool no gateway worker
/// prunes: the batch runners'.
pub(super) fn keep_pruned(connections: &Arc<Connections>) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let connections = Arc::downgrade(connections);
    runtime.spawn(async move {
        let mut tick = tokio::time::interval(PRUNE_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let Some(connections) = connections.upgrade() else {
                return;
            };
            connections.prune();
        }
    });
}

/// The hyper path's side of a worker's [`Connections`]: sends a request on a pooled
/// socket, or on a new one when none is idle. Cheap to clone: clones share the pool.
#[derive(Clone, Debug)]
pub(super) struct UpstreamPool {
    connections: Arc<Connections>,
}

/// A response body from a pooled connection: when it has been read to the end, the
/// connection's sender goes back to the task driving it, which returns the socket to
/// the pool once hyper reports it ready for another request. Dropped before that, the
/// connection is dropped too (the rest of that body is still on the wire).
#[derive(Debug)]
pub(super) struct PooledBody {
    body: Incoming,
    back: Option<Back>,
}

/// What a [`PooledBody`] gives back at its end, and where to.
#[derive(Debug)]
struct Back {
    sender: SendRequest<OutgoingBody>,
    connections: Arc<Connections>,
    to: oneshot::Sender<Returning>,
}

/// A connection on its way back to the pool, counted in [`Connections::returning`]
/// for as long as it exists.
#[derive(Debug)]
struct Returning {
    sender: Option<SendRequest<OutgoingBody>>,
    connections: Arc<Connections>,
}

impl Returning {
    fn new(sender: SendRequest<OutgoingBody>, connections: Arc<Connections>) -> Self {
        connections.returning.fetch_add(1, Ordering::Relaxed);
        Returning {
            sender: Some(sender),
            connections,
        }
    }
}

impl Drop for Returning {
    fn drop(&mut self) {
        self.connections.returning.fetch_sub(1, Ordering::Relaxed);
    }
}

impl PooledBody {
    fn give_back(&mut self) {
        if let Some(Back {
            sender,
            connections,
            to,
        }) = self.back.take()
        {
            // Counted from here, so that a request looking for a connection right
            // after this one ended waits for it. Refused when the connection has
            // ended already: then it is dropped (and uncounted) here.
            let _ = to.send(Returning::new(sender, connections));
        }
    }
}

impl Body for PooledBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.body).poll_frame(cx);
        match &polled {
            Poll::Ready(None) => this.give_back(),
            // The server may stop polling once the length it announced is written.
            Poll::Ready(Some(Ok(_))) if this.body.is_end_stream() => this.give_back(),
            Poll::Ready(Some(Err(_))) => this.back = None,
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

impl Drop for PooledBody {
    fn drop(&mut self) {
        // An empty body (HEAD, 204, 304, length 0) may never be polled.
        if self.body.is_end_stream() {
            self.give_back();
        }
    }
}

/// An idle connection at least this old is asked the kernel directly whether it is
/// still quiet: past it an upstream's idle timeout may have closed it just now (every
/// common server waits a second or more), a close the worker's reactor may not have
/// processed yet. Connections reused sooner, as under load, are judged by the
/// reactor's mark alone.
const ASK_THE_KERNEL_AFTER: Duration = Duration::from_millis(500);

/// True when `stream`, idle for `idle`, has nothing to read: no bytes, no end of
/// stream, no error.
///
/// The reactor's read mark says it without a system call. A read that took fewer
/// bytes than it had room for (every read of a response's end but one that filled its
/// buffer exactly) drained the socket and cleared the mark, so a mark found now is an
/// event since — or, after a read that filled its buffer, bytes that may still wait.
/// A marked stream is therefore asked the kernel (a non-blocking peek), and so is one
/// idle past [`ASK_THE_KERNEL_AFTER`]; a peek that finds nothing clears a stale mark.
/// The mark is read through `try_io`: no waker, and no task budget (a poll of
/// readiness could answer "not ready" only because the task spent its budget).
fn quiet(stream: &TcpStream, idle: Duration) -> bool {
    let peek = || {
        let mut probe = [std::mem::MaybeUninit::<u8>::uninit(); 1];
        socket2::SockRef::from(stream).peek(&mut probe)
    };
    let would_block = |r: std::io::Result<usize>| matches!(r, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock);
    let mut marked = false;
    // The closure runs only while the stream is marked; its `WouldBlock` clears the
    // mark it saw (not a later event's).
    let peeked = stream.try_io(tokio::io::Interest::READABLE, || {
        marked = true;
        peek()
    });
    if marked {
        would_block(peeked)
    } else if idle >= ASK_THE_KERNEL_AFTER {
        would_block(peek())
    } else {
        true
    }
}

/// What became of a request on one connection.
enum Attempt {
    Answered(Response<PooledBody>),
    /// The connection closed before it took any of the request: here it is back.
    Untaken(Request<OutgoingBody>),
    Failed,
}

impl UpstreamPool {
    /// The hyper path over `connections`.
    pub(super) fn new(connections: Arc<Connections>) -> Self {
        UpstreamPool { connections }
    }

    /// Sends `request` on a pooled connection, or on a new one when none is idle, and
    /// returns the response with its body still streaming.
    ///
    /// # Errors
    /// [`SendError::Connect`] when no connection could be opened,
    /// [`SendError::Upstream`] when the upstream failed before answering.
    pub(super) async fn send(
        &self,
        mut request: Request<OutgoingBody>,
    ) -> Result<Response<PooledBody>, SendError> {
        let mut yielded = false;
        loop {
            let Some(stream) = self.connections.checkout_io() else {
                // A connection whose response just ended is back once its task runs:
                // let it run once before opening another connection.
                if !yielded && self.connections.returning.load(Ordering::Relaxed) > 0 {
                    yielded = true;
                    tokio::task::yield_now().await;
                    continue;
                }
                break;
            };
            match self.attempt(stream, request).await {
                Attempt::Answered(response) => return Ok(response),
                // Never written: the connection had closed. Try the next one.
                Attempt::Untaken(unsent) => request = unsent,
                Attempt::Failed => return Err(SendError::Upstream),
            }
        }
        let stream = self
            .connections
            .connect_io()
            .await
            .map_err(|_| SendError::Connect)?;
        match self.attempt(stream, request).await {
            Attempt::Answered(response) => Ok(response),
            Attempt::Untaken(_) | Attempt::Failed => Err(SendError::Upstream),
        }
    }

    /// Sends `request` over `stream`, driven by a hyper client connection on a task of
    /// its own that gives the socket back to the pool when the exchange ends cleanly.
    async fn attempt(&self, stream: UpstreamIo, request: Request<OutgoingBody>) -> Attempt {
        let Ok((mut sender, connection)) = http1::handshake(TokioIo::new(stream)).await else {
            return Attempt::Failed;
        };
        let (back, returned) = oneshot::channel();
        tokio::spawn(drive(connection, returned, Arc::clone(&self.connections)));
        match sender.try_send_request(request).await {
            Ok(response) => Attempt::Answered(response.map(|body| PooledBody {
                body,
                back: Some(Back {
                    sender,
                    connections: Arc::clone(&self.connections),
                    to: back,
                }),
            })),
            Err(mut failed) => match failed.take_message() {
                Some(unsent) => Attempt::Untaken(unsent),
                None => Attempt::Failed,
            },
        }
    }
}

/// Drives one exchange's hyper client connection; once the response body has been
/// read to the end (its sender comes back on `returned`) and hyper reports the
/// connection ready for another request, puts the socket back into `connections`.
async fn drive(
    connection: http1::Connection<TokioIo<UpstreamIo>, OutgoingBody>,
    returned: oneshot::Receiver<Returning>,
    connections: Arc<Connections>,
) {
    let connection = connection.without_shutdown();
    tokio::pin!(connection);
    // An upstream connection error surfaces in the request that was using it.
    let mut returning = tokio::select! {
        biased;
        returning = returned => match returning {
            Ok(returning) => returning,
            // The body was dropped half read: hyper closes the connection.
            Err(_) => {
                let _ = connection.await;
                return;
            }
        },
        _ = &mut connection => return,
    };
    let Some(mut sender) = returning.sender.take() else {
        return;
    };
    let reusable = tokio::select! {
        ready = sender.ready() => ready.is_ok(),
        _ = &mut connection => false,
    };
    // With its sender gone, an idle connection ends and hands back its socket.
    drop(sender);
    if reusable
        && let Ok(parts) = connection.await
        && parts.read_buf.is_empty()
    {
        connections.checkin_io(parts.io.into_inner());
    }
    drop(returning);
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt as _, Empty};
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    use tokio::net::TcpListener;

    fn pool_to(target: String) -> UpstreamPool {
        let connections = Arc::new(Connections::with_max_idle(target, 8));
        keep_pruned(&connections);
        UpstreamPool::new(connections)
    }

    fn get(path: &str) -> Request<OutgoingBody> {
        Request::get(path)
            .header("host", "upstream")
            .body(Empty::new().map_err(|never| match never {}).boxed_unsync())
            .expect("request")
    }

    /// An upstream that answers one request per connection and then closes it
    /// without saying so (no `Connection: close`): every pooled connection is dead
    /// by the time it is reused.
    async fn one_shot_upstream() -> (String, tokio::task::JoinHandle<usize>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        let task = tokio::spawn(async move {
            let mut served = 0;
            while served < 5 {
                let Ok((mut socket, _)) = listener.accept().await else {
                    break;
                };
                let mut buf = vec![0u8; 4096];
                let mut read = 0;
                while !buf[..read].windows(4).any(|w| w == b"\r\n\r\n") {
                    match socket.read(&mut buf[read..]).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => read += n,
                    }
                }
                let _ = socket
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                    .await;
                drop(socket);
                served += 1;
            }
            served
        });
        (addr, task)
    }

    #[tokio::test]
    async fn connections_closed_by_the_upstream_are_never_a_failed_request() {
        let (addr, upstream) = one_shot_upstream().await;
        let pool = pool_to(addr);
        for i in 0..5 {
            let response = pool.send(get("/")).await.unwrap_or_else(|e| {
                panic!("request {i}: {e:?}");
            });
            assert_eq!(response.status(), 200);
            let body = response.into_body().collect().await.expect("body");
            assert_eq!(body.to_bytes(), "ok");
        }
        assert_eq!(upstream.await.expect("upstream"), 5);
    }

    #[tokio::test]
    async fn a_body_dropped_half_read_never_hands_its_connection_out_again() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let upstream = tokio::spawn(async move {
            // First connection: half a body, then silence. Second: a whole answer.
            let (mut first, _) = listener.accept().await.expect("accept");
            let mut buf = [0u8; 4096];
            let _ = first.read(&mut buf).await.expect("read");
            first
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nok")
                .await
                .expect("write");
            let (mut second, _) = listener.accept().await.expect("accept");
            let _ = second.read(&mut buf).await.expect("read");
            second
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nwhole")
                .await
                .expect("write");
            drop(first);
        });
        let pool = pool_to(addr.to_string());
        tokio::time::timeout(Duration::from_secs(10), async {
            let half = pool.send(get("/")).await.expect("first response");
            drop(half);
            let whole = pool.send(get("/")).await.expect("second response");
            let body = whole.into_body().collect().await.expect("body");
            assert_eq!(body.to_bytes(), "whol");
        })
        .await
        .expect("the second request got its own connection");
        upstream.await.expect("upstream");
    }

    #[tokio::test(start_paused = true)]
    async fn a_quiet_pool_closes_its_idle_connections() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let upstream = tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.expect("accept");
            let mut buf = [0u8; 4096];
            let n = socket.read(&mut buf).await.expect("read");
            assert!(n > 0);
            socket
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                .await
                .expect("write");
            // The next read ends only when the pool closes the connection.
            socket.read(&mut buf).await.expect("read")
        });
        let pool = pool_to(addr.to_string());
        let response = pool.send(get("/")).await.expect("response");
        response.into_body().collect().await.expect("body");
        // Paused time: the timers run ahead as soon as nothing else can.
        let closed = tokio::time::timeout(IDLE_TIMEOUT + PRUNE_EVERY * 2, upstream)
            .await
            .expect("the idle connection was closed by the pruning task");
        assert_eq!(closed.expect("upstream"), 0, "closed, nothing sent");
    }

    #[tokio::test]
    async fn a_ready_connection_is_reused_and_an_unreachable_upstream_is_a_connect_error() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let accepted = tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.expect("accept");
            let mut answered = 0;
            let mut pending = Vec::new();
            let mut buf = [0u8; 4096];
            while answered < 3 {
                let n = socket.read(&mut buf).await.expect("read");
                if n == 0 {
                    break;
                }
                pending.extend_from_slice(&buf[..n]);
                while let Some(end) = pending.windows(4).position(|w| w == b"\r\n\r\n") {
                    pending.drain(..end + 4);
                    socket
                        .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                        .await
                        .expect("write");
                    answered += 1;
                }
            }
            answered
        });
        let pool = pool_to(addr.to_string());
        // A second connection would wait forever for an answer: bounded, it fails.
        tokio::time::timeout(Duration::from_secs(10), async {
            for _ in 0..3 {
                let response = pool.send(get("/")).await.expect("response");
                response.into_body().collect().await.expect("body");
            }
        })
        .await
        .expect("every request went over the one accepted connection");
        // All three went over the one connection the upstream accepted.
        assert_eq!(accepted.await.expect("upstream"), 3);

        let closed = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let gone = closed.local_addr().expect("addr").to_string();
        drop(closed);
        let pool = pool_to(gone);
        assert!(matches!(pool.send(get("/")).await, Err(SendError::Connect)));
    }

    #[tokio::test(start_paused = true)]
    async fn closed_stray_and_stale_connections_are_not_handed_out() {
        use tokio::io::AsyncWriteExt as _;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let pool = Connections::with_max_idle(listener.local_addr().expect("addr").to_string(), 4);
        assert!(pool.checkout().is_none());
        let mut open = Vec::new();
        let mut peers = Vec::new();
        for _ in 0..3 {
            let stream = pool.connect().await.expect("connect");
            let (peer, _) = listener.accept().await.expect("accept");
            open.push(stream.local_addr().expect("addr"));
            peers.push(peer);
            pool.checkin(stream);
        }

        // Most recent first.
        let out = pool.checkout().expect("idle connection");
        assert_eq!(out.local_addr().expect("addr"), open[2]);
        pool.checkin(out);

        // The upstream closes the third, and sends the second bytes nobody asked for:
        // both are passed over, the first is handed out (once the reactor has had a
        // turn to see the events, as a worker's reactor has between requests).
        peers.pop();
        peers[1]
            .write_all(b"HTTP/1.1 200 OK\r\n")
            .await
            .expect("write");
        tokio::task::yield_now().await;
        let out = pool.checkout().expect("the first is still fine");
        assert_eq!(out.local_addr().expect("addr"), open[0]);
        pool.checkin(out);

        // Idle past the timeout: gone.
        tokio::time::advance(IDLE_TIMEOUT).await;
        pool.prune();
        assert!(pool.checkout().is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_closed_while_long_idle_is_passed_over_before_the_reactor_sees_it() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let pool = Connections::with_max_idle(addr.to_string(), 4);
        // A second handle on the pooled socket, to see what the kernel holds.
        let std_stream = std::net::TcpStream::connect(addr).expect("connect");
        let kernel_view = std_stream.try_clone().expect("clone");
        std_stream.set_nonblocking(true).expect("non-blocking");
        let stream = TcpStream::from_std(std_stream).expect("register");
        let (peer, _) = listener.accept().await.expect("accept");
        pool.checkin(stream);
        tokio::time::advance(ASK_THE_KERNEL_AFTER).await;
        // Closed with no await after it, so the reactor (on this thread) has not taken
        // in the close; wait, on this thread, until the kernel has (no reactor turn).
        drop(peer);
        let mut probe = [std::mem::MaybeUninit::<u8>::uninit(); 1];
        let waiting_since = std::time::Instant::now();
        while socket2::SockRef::from(&kernel_view)
            .peek(&mut probe)
            .is_err()
        {
            assert!(
                waiting_since.elapsed() < Duration::from_secs(10),
                "no FIN came"
            );
            std::thread::yield_now();
        }
        assert!(
            pool.checkout().is_none(),
            "the closed connection is not handed out"
        );
    }

    #[tokio::test]
    async fn a_connection_whose_answer_was_read_to_its_end_is_handed_out_again() {
        use tokio::io::AsyncWriteExt as _;
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let pool = Connections::with_max_idle(listener.local_addr().expect("addr").to_string(), 4);
        let stream = pool.connect().await.expect("connect");
        let (mut peer, _) = listener.accept().await.expect("accept");
        // An answer read to its end by its length, the last read filling its buffer:
        // it sees no `WouldBlock` and is not short, so the reactor still marks the
        // stream readable; the kernel, asked, finds it quiet.
        let answer = b"HTTP/1.1 204 No Content\r\n\r\n";
        peer.write_all(answer).await.expect("write");
        let mut got = Vec::new();
        while got.len() < answer.len() {
            stream.readable().await.expect("readable");
            let mut buf = [0u8; 64];
            match stream.try_read(&mut buf[..answer.len() - got.len()]) {
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => panic!("read: {e}"),
            }
        }
        let local = stream.local_addr().expect("addr");
        pool.checkin(stream);
        tokio::task::yield_now().await;
        let out = pool.checkout().expect("the connection is handed out again");
        assert_eq!(out.local_addr().expect("addr"), local);

        // Bytes left behind a read that filled its buffer raise no new event: the
        // mark that stayed, and the kernel asked, pass the connection over.
        peer.write_all(b"HTTP/1.1 200 OK\r\n").await.expect("write");
        let mut buf = [0u8; 4];
        out.readable().await.expect("readable");
        assert_eq!(
            out.try_read(&mut buf).expect("read"),
            4,
            "a read that fills its buffer"
        );
        pool.checkin(out);
        assert!(
            pool.checkout().is_none(),
            "bytes past a full read are never a next answer"
        );
    }

    /// An upstream that answers each request on each connection with `answer`, until
    /// `requests` have been answered; returns how many connections it accepted.
    async fn answering(
        answer: &'static [u8],
        requests: usize,
    ) -> (String, tokio::task::JoinHandle<usize>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        let task = tokio::spawn(async move {
            let (done, mut answered) = tokio::sync::mpsc::unbounded_channel::<()>();
            let mut accepted = 0;
            let mut count = 0;
            while count < requests {
                tokio::select! {
                    Ok((mut socket, _)) = listener.accept() => {
                        accepted += 1;
                        let done = done.clone();
                        tokio::spawn(async move {
                            let mut pending = Vec::new();
                            let mut buf = [0u8; 4096];
                            while let Ok(n) = socket.read(&mut buf).await {
                                if n == 0 {
                                    break;
                                }
                                pending.extend_from_slice(&buf[..n]);
                                while let Some(end) =
                                    pending.windows(4).position(|w| w == b"\r\n\r\n")
                                {
                                    pending.drain(..end + 4);
                                    let _ = socket.write_all(answer).await;
                                    let _ = done.send(());
                                }
                            }
                        });
                    }
                    Some(()) = answered.recv() => count += 1,
                }
            }
            accepted
        });
        (addr, task)
    }

    #[tokio::test]
    async fn the_hyper_path_hands_its_socket_back_to_the_shared_pool() {
        let (addr, upstream) =
            answering(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok", 2).await;
        let connections = Arc::new(Connections::with_max_idle(addr, 8));
        let hyper_path = UpstreamPool::new(Arc::clone(&connections));
        let response = hyper_path.send(get("/")).await.expect("response");
        response.into_body().collect().await.expect("body");
        // The fast path takes the same socket for its next request.
        let socket = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                if let Some(socket) = connections.checkout() {
                    return socket;
                }
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("the socket came back");
        socket.writable().await.expect("writable");
        socket
            .try_write(b"GET / HTTP/1.1\r\nhost: upstream\r\n\r\n")
            .expect("write");
        let mut answer = [0u8; 64];
        socket.readable().await.expect("readable");
        let n = socket.try_read(&mut answer).expect("read");
        assert!(answer[..n].starts_with(b"HTTP/1.1 200 OK"));
        assert_eq!(
            upstream.await.expect("upstream"),
            1,
            "one connection for both"
        );
    }

    #[tokio::test]
    async fn a_connection_the_upstream_closes_after_its_answer_is_not_pooled() {
        let (addr, upstream) = answering(
            b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok",
            2,
        )
        .await;
        let connections = Arc::new(Connections::with_max_idle(addr, 8));
        let hyper_path = UpstreamPool::new(Arc::clone(&connections));
        for _ in 0..2 {
            let response = hyper_path.send(get("/")).await.expect("response");
            response.into_body().collect().await.expect("body");
            for _ in 0..10 {
                tokio::task::yield_now().await;
            }
            assert!(
                connections.checkout().is_none(),
                "not kept: it was to close"
            );
        }
        assert_eq!(upstream.await.expect("upstream"), 2);
    }
}
