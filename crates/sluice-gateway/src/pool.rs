//! Keep-alive HTTP/1.1 connections to the one upstream, one pool per gateway worker.
//!
//! The gateway talks to a single upstream, so the pool is a plain queue of
//! connections: no per-host map, no key hashing, no lock contention (each worker
//! thread has its own pool). A connection goes back into the queue once its
//! response body has been read to the end ([`PooledBody`]) and is handed out again,
//! most recently queued first, once hyper reports it ready. A connection found
//! closed, or queued for longer than [`IDLE_TIMEOUT`], is dropped; a pruning task
//! closes those on a quiet pool too.
//!
//! A request a pooled connection never took (the upstream closed it in the meantime)
//! is sent again on the next connection: nothing of it reached the upstream. A request
//! that was taken and then failed is not retried.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body::{Body, Frame, SizeHint};
use http_body_util::combinators::UnsyncBoxBody;
use hyper::body::Incoming;
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::proxy::BoxError;

/// The body type sent to the upstream (any incoming body, boxed).
pub(super) type OutgoingBody = UnsyncBoxBody<Bytes, BoxError>;

/// How long an idle upstream connection is kept (by both request paths' pools).
pub(super) const IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// How often stale upstream connections are closed (by both request paths' pools).
pub(super) const PRUNE_EVERY: Duration = Duration::from_secs(10);

/// At most this many idle upstream connections per worker and request path.
pub(super) const POOL_MAX_IDLE: usize = 256;

/// Why a request got no response from the upstream.
#[derive(Debug)]
pub(super) enum SendError {
    /// No connection could be opened.
    Connect,
    /// The connection failed before the response headers arrived.
    Upstream,
}

/// One worker's connections to the upstream. Cheap to clone: clones share the queue.
#[derive(Clone, Debug)]
pub(super) struct UpstreamPool {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    /// `host:port` to connect to.
    target: String,
    /// At most this many connections wait in the queue.
    max_idle: usize,
    queue: Mutex<VecDeque<Pooled>>,
}

/// A response body from a pooled connection: when it has been read to the end, the
/// connection goes back into the queue; dropped before that, the connection is
/// dropped too (hyper closes it: the rest of that body is still on the wire).
#[derive(Debug)]
pub(super) struct PooledBody {
    body: Incoming,
    back: Option<(SendRequest<OutgoingBody>, UpstreamPool)>,
}

impl PooledBody {
    fn give_back(&mut self) {
        if let Some((sender, pool)) = self.back.take() {
            pool.checkin(sender);
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

/// What the queue had to offer.
enum Checkout {
    /// A connection ready for a request.
    Ready(SendRequest<OutgoingBody>),
    /// Only connections not ready yet (their task has not seen their last response
    /// end).
    Busy,
    /// No open connection.
    Empty,
}

#[derive(Debug)]
struct Pooled {
    sender: SendRequest<OutgoingBody>,
    /// When it went back into the queue.
    since: Instant,
}

impl Pooled {
    /// Closed, or queued for longer than [`IDLE_TIMEOUT`].
    fn is_stale(&self) -> bool {
        self.sender.is_closed() || self.since.elapsed() > IDLE_TIMEOUT
    }
}

impl UpstreamPool {
    /// A pool connecting to `target` (`host:port`), keeping at most `max_idle`
    /// connections.
    ///
    /// Inside a tokio runtime, a task on it closes stale connections every
    /// [`PRUNE_EVERY`] for as long as the pool exists, so a quiet pool does not hold
    /// idle sockets open.
    pub(super) fn new(target: String, max_idle: usize) -> Self {
        let pool = UpstreamPool {
            inner: Arc::new(Inner {
                target,
                max_idle,
                queue: Mutex::new(VecDeque::new()),
            }),
        };
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(prune(Arc::downgrade(&pool.inner)));
        }
        pool
    }

    /// Sends `request` on a pooled connection, or on a new one when none is ready,
    /// and returns the response with its body still streaming.
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
            match self.checkout() {
                Checkout::Ready(mut sender) => match sender.try_send_request(request).await {
                    Ok(response) => return Ok(self.returning(response, sender)),
                    Err(mut failed) => match failed.take_message() {
                        // Never written: the connection had closed. Try the next one.
                        Some(unsent) => request = unsent,
                        None => return Err(SendError::Upstream),
                    },
                },
                // A connection whose body just ended turns ready once its task runs:
                // let it run once before opening another connection.
                Checkout::Busy if !yielded => {
                    yielded = true;
                    tokio::task::yield_now().await;
                }
                Checkout::Busy | Checkout::Empty => break,
            }
        }
        let mut sender = self.connect().await?;
        match sender.try_send_request(request).await {
            Ok(response) => Ok(self.returning(response, sender)),
            Err(_) => Err(SendError::Upstream),
        }
    }

    /// The most recently queued connection that is ready for a request: the least
    /// likely to have been closed by the upstream's keep-alive timeout, and it lets
    /// the others idle out. Stale ones are dropped on the way; one not ready yet (its
    /// task has not seen the end of the last response) stays queued.
    fn checkout(&self) -> Checkout {
        let mut queue = self.queue();
        // The front holds the longest-queued ones.
        while queue.front().is_some_and(Pooled::is_stale) {
            queue.pop_front();
        }
        let mut i = queue.len();
        while i > 0 {
            i -= 1;
            if queue[i].sender.is_closed() {
                queue.remove(i);
            } else if queue[i].sender.is_ready()
                && let Some(pooled) = queue.remove(i)
            {
                return Checkout::Ready(pooled.sender);
            }
        }
        if queue.is_empty() {
            Checkout::Empty
        } else {
            Checkout::Busy
        }
    }

    /// `response` with a body that queues `sender` again once it has been read to the
    /// end.
    fn returning(
        &self,
        response: Response<Incoming>,
        sender: SendRequest<OutgoingBody>,
    ) -> Response<PooledBody> {
        response.map(|body| PooledBody {
            body,
            back: Some((sender, self.clone())),
        })
    }

    /// Queues a connection for the next request (dropped when the queue is full:
    /// hyper closes it).
    fn checkin(&self, sender: SendRequest<OutgoingBody>) {
        let mut queue = self.queue();
        if queue.len() < self.inner.max_idle {
            queue.push_back(Pooled {
                sender,
                since: Instant::now(),
            });
        }
    }

    async fn connect(&self) -> Result<SendRequest<OutgoingBody>, SendError> {
        let stream = TcpStream::connect(self.inner.target.as_str())
            .await
            .map_err(|_| SendError::Connect)?;
        let _ = stream.set_nodelay(true);
        let (sender, connection) = http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|_| SendError::Upstream)?;
        tokio::spawn(async move {
            // An upstream connection error surfaces in the request that was using it.
            let _ = connection.await;
        });
        Ok(sender)
    }

    fn queue(&self) -> MutexGuard<'_, VecDeque<Pooled>> {
        self.inner.queue()
    }
}

impl Inner {
    fn queue(&self) -> MutexGuard<'_, VecDeque<Pooled>> {
        // The queue holds no invariant a panic could break half way.
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Drops stale connections every [`PRUNE_EVERY`] until the pool is gone. Dropping a
/// connection's sender closes it (once a response still streaming on it is done).
async fn prune(pool: Weak<Inner>) {
    let mut tick = tokio::time::interval(PRUNE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(pool) = pool.upgrade() else {
            return;
        };
        pool.queue().retain(|pooled| !pooled.is_stale());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt as _, Empty};
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    use tokio::net::TcpListener;

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
        let pool = UpstreamPool::new(addr, 8);
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
        let pool = UpstreamPool::new(addr.to_string(), 8);
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
        let pool = UpstreamPool::new(addr.to_string(), 8);
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
        let pool = UpstreamPool::new(addr.to_string(), 8);
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
        let pool = UpstreamPool::new(gone, 8);
        assert!(matches!(pool.send(get("/")).await, Err(SendError::Connect)));
    }
}
