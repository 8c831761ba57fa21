//! The gateway's HTTP/1.1 fast path: the requests almost every client sends, served
//! without building them as `http` types.
//!
//! A request head is parsed in place (httparse); its route and the fields the limiter
//! reads are all that is taken out of it; the head sent upstream is written straight
//! from the client's bytes (the path in the normal form it was routed by, a path
//! without one refused as the service stack refuses it; hop-by-hop fields dropped,
//! `Host` the upstream's, `X-Forwarded-For` and `Forwarded` appended); the upstream's
//! response head is rewritten the same way with the rate-limit fields added (and
//! `Date` when it has none). A request body is taken in whole before the request is decided and sent
//! (up to [`MAX_BUFFERED_BODY`], or the policy's bound for a JSON-RPC body), each read
//! within the head timeout, so a refusal leaves the connection usable and a stalled
//! upload holds nothing past that timeout. The response body is relayed as it comes,
//! its framing kept (`Content-Length`, chunked) or, for a body that runs to the
//! upstream's close, re-chunked. The upstream connection is driven
//! from the client connection's own task, from a per-worker pool of idle sockets.
//! Decisions, metrics, answers and error envelopes are the limiter's and the proxy's
//! own, so a request is answered as the service stack answers it.
//!
//! Anything else — HTTP/1.0, request bodies that are chunked, announced with
//! `Expect` or longer than the fast path takes in whole (these stream, both ways at
//! once), upgrades, targets that are not a path `http` accepts, heads past the bound
//! or that hyper would refuse, a JSON-RPC body past the policy's bound — is left to
//! hyper and the service stack: the fast path hands the connection over, with the
//! bytes it has read ([`Ended::Elsewhere`]), and hyper serves it from there on.

mod body;
mod request;

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use bytes::{Buf as _, Bytes, BytesMut};
use http::{HeaderMap, HeaderName, Method, Response};
use http_body_util::BodyExt as _;
use sluice_core::Decision;
use sluice_edge::{Forward, Limiter, Plan, RateLimitValue, RequestId, SharedLimiter};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;
use tokio::sync::watch;

use super::metered::RequestStats;
use super::pool::Connections;
use super::proxy::{Failure, ForwardedPeer, ProxyConfig, Upstream, upstream_failure};
use super::store::AnyStore;
use sluice_h1::chunked::ChunkedEnd;
use sluice_h1::deadline::Deadline;
use sluice_h1::response::{self, Framing};

/// Bytes reserved for each read from a socket.
const READ_CHUNK: usize = 16 * 1024;

/// Longest request body (on a route that does not read it) the fast path takes in
/// whole before it forwards the request, as a reverse proxy that buffers request
/// bodies does; a longer one is left to hyper, which streams it.
const MAX_BUFFERED_BODY: usize = 64 * 1024;

/// Largest buffer a connection keeps between requests.
const KEPT_CAPACITY: usize = 2 * READ_CHUNK;

/// How a connection left the fast path.
#[derive(Debug)]
pub(super) enum Ended {
    /// Closed: the client left, asked to close, or broke the protocol, or the
    /// worker drains.
    Closed,
    /// A request the fast path leaves to hyper: serve the connection with hyper
    /// from here, these bytes first.
    Elsewhere(TcpStream, Bytes),
}

/// One worker's fast path: the shared limiter, this worker's upstream connections.
pub(super) struct FastPath {
    /// The current limiter; each request takes the one current when its head is read.
    limiter: SharedLimiter<AnyStore>,
    config: ProxyConfig,
    /// This worker's upstream connections, shared with its hyper path.
    pool: Arc<Connections>,
    stats: RequestStats,
    /// One `sluice::access` line per request.
    access_log: bool,
    /// `sluice_upstream_seconds{outcome}`: response, error, timeout.
    upstream_seconds: [metrics::Histogram; 3],
}

/// The upstream's answer: its head (the client's form in the head buffer) and the
/// connection its body comes on.
struct Relay {
    head: response::Head,
    conn: TcpStream,
    /// The upstream took the whole request. When it did not (it stopped taking it,
    /// having answered first), neither connection carries another request.
    whole: bool,
}

impl FastPath {
    /// The fast path of one worker counting on `stats`.
    pub(super) fn new(
        limiter: SharedLimiter<AnyStore>,
        config: ProxyConfig,
        pool: Arc<Connections>,
        stats: RequestStats,
        access_log: bool,
    ) -> Self {
        FastPath {
            access_log,
            pool,
            limiter,
            config,
            stats,
            upstream_seconds: super::proxy::upstream_seconds(),
        }
    }

    /// Closes upstream connections idle for too long; call it now and then.
    pub(super) fn prune(&self) {
        self.pool.prune();
    }

    /// Serves the connection `stream` from `peer` until it closes or a request is
    /// left to hyper. Waiting for a request, it ends when `draining` turns true, or
    /// when no complete head arrives within `head_timeout`; a request body from which
    /// nothing comes for `head_timeout` is answered 400 and ends it too.
    pub(super) async fn serve(
        &self,
        mut stream: TcpStream,
        peer: SocketAddr,
        mut draining: watch::Receiver<bool>,
        head_timeout: Duration,
        max_head: usize,
    ) -> Ended {
        let mut conn = Connection::new(self, peer.ip());
        let now = tokio::time::Instant::now();
        let mut timers = Timers {
            head: Deadline::new(now + head_timeout),
            head_timeout,
            upstream: Deadline::new(now + self.config.header_timeout),
        };
        loop {
            match conn
                .one_request(&mut stream, &mut draining, &mut timers, max_head)
                .await
            {
                Ok(Next::Request) if !*draining.borrow() => conn.trim(),
                Ok(Next::Request | Next::Close) | Err(_) => {
                    let _ = stream.shutdown().await;
                    return Ended::Closed;
                }
                Ok(Next::Elsewhere) => {
                    return Ended::Elsewhere(stream, conn.from_client.freeze());
                }
            }
        }
    }
}

/// A connection's deadlines: for the next request head, for the upstream's answer.
struct Timers {
    head: Deadline,
    head_timeout: Duration,
    upstream: Deadline,
}

/// Why a request body was not taken in whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BodyRead {
    /// Nothing came for the head timeout, or the client left.
    Stalled,
    /// It kept coming, but not all of it within the body deadline.
    TooSlow,
    /// Holding more of it would pass the gateway's bound on buffered bytes, or its
    /// client's share of it.
    Busy(sluice_edge::BufferFull),
}

/// What follows a request.
enum Next {
    /// The next request on this connection.
    Request,
    /// Closing the connection.
    Close,
    /// Leaving the connection to hyper (nothing of the current request was answered).
    Elsewhere,
}

/// One client connection's buffers.
struct Connection<'f> {
    fast: &'f FastPath,
    peer: IpAddr,
    /// The peer as the forwarding fields write it.
    forwarded_peer: ForwardedPeer,
    /// Read from the client, not served yet.
    from_client: BytesMut,
    /// Read from the upstream, not relayed yet.
    from_upstream: BytesMut,
    /// The request head and body for the upstream.
    to_upstream: Vec<u8>,
    /// The response head (and the first body bytes) for the client.
    to_client: Vec<u8>,
    /// The request fields the limiter reads.
    identity: HeaderMap,
}

impl<'f> Connection<'f> {
    fn new(fast: &'f FastPath, peer: IpAddr) -> Self {
        Connection {
            fast,
            peer,
            forwarded_peer: ForwardedPeer::new(peer),
            from_client: BytesMut::with_capacity(READ_CHUNK),
            from_upstream: BytesMut::new(),
            to_upstream: Vec::with_capacity(1024),
            to_client: Vec::with_capacity(1024),
            identity: HeaderMap::new(),
        }
    }

    /// Gives back what a large request or response made a buffer grow to, so that an
    /// idle kept-alive connection holds at most a few of [`KEPT_CAPACITY`].
    fn trim(&mut self) {
        if self.from_client.is_empty() && holds_more_than_kept(&mut self.from_client) {
            self.from_client = BytesMut::with_capacity(READ_CHUNK);
        }
        if self.from_upstream.is_empty() && holds_more_than_kept(&mut self.from_upstream) {
            self.from_upstream = BytesMut::new();
        }
        for buf in [&mut self.to_upstream, &mut self.to_client] {
            if buf.capacity() > KEPT_CAPACITY {
                buf.clear();
                buf.shrink_to(1024);
            }
        }
    }

    /// Reads the body of the request whose head is the first `head_len` bytes of
    /// `from_client`, until `end` bytes are there with the head, each read within the
    /// head timeout and all of them within [`sluice_edge::BODY_DEADLINE`]. A request
    /// that fits the connection's buffer is read into it (`Ok(None)`: nothing leased,
    /// the buffer is the connection's own); a longer body fills that buffer, then the
    /// rest is read in [`body::Pieces`], each leased from `lease` before it is allocated, and comes back whole in a
    /// buffer of its length (`Ok(Some)`), the head alone left in `from_client`.
    async fn read_body(
        &mut self,
        client: &mut TcpStream,
        timers: &mut Timers,
        (head_len, end): (usize, usize),
        lease: Option<&mut sluice_edge::BufferLease>,
    ) -> Result<Option<BytesMut>, BodyRead> {
        let whole_by = tokio::time::Instant::now() + sluice_edge::BODY_DEADLINE;
        let Some(lease) = lease.filter(|_| end > self.from_client.capacity()) else {
            while self.from_client.len() < end {
                read_within(client, timers, whole_by, &mut self.from_client).await?;
            }
            return Ok(None);
        };
        // The connection's own buffer first: a client that stalls before filling it
        // holds nothing more.
        while self.from_client.len() < self.from_client.capacity() {
            read_within(client, timers, whole_by, &mut self.from_client).await?;
        }
        let start = self.from_client.len() - head_len;
        let mut pieces = body::Pieces::new(start, end - head_len, lease).map_err(BodyRead::Busy)?;
        while !pieces.is_whole() {
            let room = pieces.room(lease).map_err(BodyRead::Busy)?;
            let n = read_within(client, timers, whole_by, room).await?;
            pieces.filled(n);
        }
        let whole = pieces.into_whole(&self.from_client[head_len..], lease);
        self.from_client.truncate(head_len);
        Ok(Some(whole))
    }

    /// Serves one request.
    async fn one_request(
        &mut self,
        client: &mut TcpStream,
        draining: &mut watch::Receiver<bool>,
        timers: &mut Timers,
        max_head: usize,
    ) -> io::Result<Next> {
        let fast = self.fast;
        // The policy of this request, whatever a reload does meanwhile.
        let current = fast.limiter.load_full();
        let limiter = &*current;
        let route = |method: &Method, path: &str| limiter.route_for(method, path);
        let cx = request::Context {
            upstream: &fast.config.upstream,
            route: &route,
            paths: limiter.policy().paths,
            identity_headers: limiter.read_header_names(),
            peer: &self.forwarded_peer,
            counted_credential: limiter
                .policy()
                .identity
                .counted
                .map(|_| &limiter.policy().identity),
        };

        // A complete head.
        timers
            .head
            .set(tokio::time::Instant::now() + timers.head_timeout);
        let mut checked = 0;
        let head = loop {
            if may_end_head(&self.from_client, checked) {
                self.identity.clear();
                match request::parse(
                    &self.from_client,
                    &cx,
                    &mut self.to_upstream,
                    &mut self.identity,
                ) {
                    request::Parsed::Ready(head) if head.len <= max_head => break head,
                    request::Parsed::Ready(_) | request::Parsed::Elsewhere => {
                        return Ok(Next::Elsewhere);
                    }
                    request::Parsed::Partial => checked = self.from_client.len(),
                }
            }
            if self.from_client.len() >= max_head {
                // No head within the bound: hyper refuses it (431).
                return Ok(Next::Elsewhere);
            }
            // Between requests the drain wins: no request is cut.
            let idle = self.from_client.is_empty();
            let n = tokio::select! {
                biased;
                n = read_more(client, &mut self.from_client) => n?,
                () = timers.head.passed() => return Ok(Next::Close),
                _ = draining.wait_for(|d| *d), if idle => return Ok(Next::Close),
            };
            if n == 0 {
                return Ok(Next::Close);
            }
        };

        let id = head.request_id;
        // What the access line says of the request (copied only when it is kept).
        let access = fast
            .access_log
            .then(|| Access::new(&head.method, &self.from_client, self.peer));
        // The body, taken in whole before anything is decided or sent: bounded by the
        // policy when the route takes its class from it, else by what the fast path
        // holds; a longer one streams through hyper (both ways at once).
        let policy = limiter.policy();
        // A path with no normal form is refused once its body is read (the connection
        // goes on), before anything is decided, as the service stack refuses it.
        let target = head.route;
        let route = target.as_ref().ok().copied().flatten();
        // A batch lane's endpoints are answered by the service stack's batch lanes.
        if route.is_some_and(|r| r.batch.is_some()) {
            return Ok(Next::Elsewhere);
        }
        // Phase 2 (see `sluice_edge::exchange`): past the policy's bound a body the
        // route is classified by is refused with 413, after a decision, by the
        // service stack.
        let body_bound = limiter.body_bound(route);
        let needs_body = body_bound.is_some();
        let max_body = body_bound.unwrap_or(MAX_BUFFERED_BODY) as u64;
        if head.body_len > max_body {
            return Ok(Next::Elsewhere);
        }
        // Counted from its head, as the service stack counts a request.
        let in_flight = fast.stats.request();
        let head_request = head.method == Method::HEAD;
        let body_len = usize::try_from(head.body_len).unwrap_or(usize::MAX);
        let head_len = head.len;
        // The body is held in memory until it is forwarded: one longer than the
        // connection's buffer holds is leased from the gateway's one bound as its
        // pieces are allocated, charged to the client address the policy believes
        // (past the bound or the client's share: 503, and the connection closes with
        // the rest of the body unread).
        let end = head_len + body_len;
        let mut lease = if end > self.from_client.capacity() {
            let holder = limiter.buffer_holder(self.peer, &self.identity);
            Some(
                limiter
                    .buffers()
                    .try_lease_for(holder, 0)
                    .map_err(|_| io::Error::other("an empty lease always fits"))?,
            )
        } else {
            None
        };
        let held = match self
            .read_body(client, timers, (head_len, end), lease.as_mut())
            .await
        {
            Ok(held) => held,
            Err(read) => {
                // It stopped coming, came too slowly, the client left, or the bound
                // (or the client's share) is full: answered (when it still can be) as
                // the service stack answers.
                let answer = match read {
                    BodyRead::TooSlow => sluice_edge::body_too_slow(),
                    BodyRead::Busy(full) => sluice_edge::buffers_refusal(full, limiter.buffers()),
                    BodyRead::Stalled => sluice_edge::body_unreadable(),
                };
                let answer = own(answer).await;
                return self
                    .answer_own(client, answer, true, head_request, in_flight, &id, access)
                    .await;
            }
        };
        // The body: in place after the head, or whole in its own buffer.
        let (body, consumed) = match &held {
            None => (head_len..end, end),
            Some(whole) => (0..whole.len(), head_len),
        };
        let held = held.unwrap_or_default();
        let body_bytes: &[u8] = if held.is_empty() {
            &self.from_client[body.clone()]
        } else {
            &held
        };
        // A batch lane's tool call is answered by the service stack's batch lanes:
        // the request goes there whole (nothing of it was answered or decided).
        if needs_body
            && route.is_some_and(|r| r.batch.is_none())
            && sluice_edge::may_call_batch_tool(policy, body_bytes)
        {
            in_flight.handed_over();
            // hyper reads the request again from the bytes read: the head, then this.
            self.from_client.extend_from_slice(&held);
            return Ok(Next::Elsewhere);
        }
        // Phases 3 and 4: planned and admitted; a request that cannot be counted
        // (refused before anything is decided), a refusal, or a limiter that cannot
        // decide, is answered here.
        let read = if needs_body {
            sluice_edge::BodyRead::Whole(body_bytes)
        } else {
            sluice_edge::BodyRead::NotNeeded
        };
        let planned = limiter.planned(&self.identity, self.peer, target, read, None);
        let mut forward = match planned.admit(Some(&id)).await {
            Ok(forward) => forward,
            Err(answer) => {
                self.from_client.advance(consumed);
                let answer = own(answer).await;
                return self
                    .answer_own(
                        client,
                        answer,
                        head.close,
                        head_request,
                        in_flight,
                        &id,
                        access,
                    )
                    .await;
            }
        };

        // Forwarded: the head with who the request is from, and the body, in one
        // write: a body in the connection's buffer is copied after the head, one held
        // whole in its own buffer is written from there (never a second copy of it).
        self.to_upstream.truncate(self.to_upstream.len() - 2);
        // Phase 5: the upstream head.
        forward.for_each_upstream_header(|name, value| {
            push_field(&mut self.to_upstream, name.as_str().as_bytes(), value);
        });
        push_field(&mut self.to_upstream, b"x-request-id", id.as_bytes());
        self.to_upstream.extend_from_slice(b"\r\n");
        if held.is_empty() {
            self.to_upstream.extend_from_slice(body_bytes);
        }
        self.from_client.advance(consumed);
        let replaced = match (forward.decision().binding().is_some(), policy.ietf_headers) {
            (false, _) => &REPLACED_FIELDS[..2],
            (true, false) => &REPLACED_FIELDS[..5],
            (true, true) => &REPLACED_FIELDS[..],
        };
        let request = Exchanged {
            rewrite: response::Rewrite {
                head_request,
                close: head.close,
                replaced,
            },
            // Sent again on a new connection when a kept-alive one fails before any
            // answer: only a request that may be repeated.
            repeatable: head.method.is_idempotent(),
            forward: &forward,
            limiter,
            request_id: &id,
            body: &held,
        };

        // On the runtime's clock, as the deadlines are.
        let started = tokio::time::Instant::now();
        // A call through a guarded lane may take the lane's time.
        let header_timeout = forward.upstream_timeout(fast.config.header_timeout);
        timers.upstream.set(started + header_timeout);
        // Pinned where it is made: `select!` then holds a pointer to it rather than
        // a copy of the whole exchange (a few hundred bytes of state each request).
        let answer = {
            let mut exchange = std::pin::pin!(self.exchange(&request));
            tokio::select! {
                biased;
                answer = &mut exchange => answer,
                () = timers.upstream.passed() => Err(Failure::Timeout),
            }
        };
        let elapsed = started.elapsed().as_secs_f64();
        let (head_sent, conn, whole) = match answer {
            Ok(Relay {
                head: sent_head,
                conn,
                whole,
            }) => {
                fast.upstream_seconds[0].record(elapsed);
                // Phase 6: settled as the head was read (see `send_and_read_head`).
                forward.finish(Some(sent_head.status));
                (sent_head, conn, whole)
            }
            Err(failure) => {
                fast.upstream_seconds[if failure == Failure::Timeout { 2 } else { 1 }]
                    .record(elapsed);
                let mut answer = upstream_failure(failure, header_timeout);
                forward.upstream_failed(answer.headers_mut());
                let (parts, body) = answer.into_parts();
                let body = body
                    .collect()
                    .await
                    .map(|c| c.to_bytes())
                    .unwrap_or_default();
                let answer = Response::from_parts(parts, body);
                return self
                    .answer_own(
                        client,
                        answer,
                        head.close,
                        head_request,
                        in_flight,
                        &id,
                        access,
                    )
                    .await;
            }
        };

        // Counted once the head is there, as the service stack counts a response.
        in_flight.answered(Some(head_sent.status));
        let mut conn = conn;
        let status = head_sent.status;
        let relayed = self.relay_body(client, head_sent, &mut conn).await;
        if let Some(access) = access {
            access.log(&id, status, relayed.is_ok());
        }
        if relayed? && whole {
            fast.pool.checkin(conn);
        }
        Ok(if head.close || !whole {
            Next::Close
        } else {
            Next::Request
        })
    }

    /// Writes an answer of sluice's own (its body left out for a HEAD request), with
    /// the request's id.
    #[allow(clippy::too_many_arguments)]
    async fn answer_own(
        &mut self,
        client: &mut TcpStream,
        answer: Response<Bytes>,
        close: bool,
        head_request: bool,
        in_flight: super::metered::InFlight,
        id: &RequestId,
        access: Option<Access>,
    ) -> io::Result<Next> {
        let out = &mut self.to_client;
        out.clear();
        out.extend_from_slice(b"HTTP/1.1 ");
        out.extend_from_slice(
            itoa::Buffer::new()
                .format(answer.status().as_u16())
                .as_bytes(),
        );
        out.push(b' ');
        out.extend_from_slice(answer.status().canonical_reason().unwrap_or("").as_bytes());
        out.extend_from_slice(b"\r\n");
        for (name, value) in answer.headers() {
            push_field(out, name.as_str().as_bytes(), value.as_bytes());
        }
        push_field(out, b"x-request-id", id.as_bytes());
        push_date(out);
        push_field(
            out,
            b"content-length",
            itoa::Buffer::new().format(answer.body().len()).as_bytes(),
        );
        if close {
            out.extend_from_slice(b"connection: close\r\n");
        }
        out.extend_from_slice(b"\r\n");
        if !head_request {
            out.extend_from_slice(answer.body());
        }
        in_flight.answered(Some(answer.status().as_u16()));
        let written = client.write_all(out).await;
        if let Some(access) = access {
            access.log(id, answer.status().as_u16(), written.is_ok());
        }
        written?;
        Ok(if close { Next::Close } else { Next::Request })
    }

    /// Sends the request (head and body in `to_upstream`) and reads the response head,
    /// whose client form it leaves in `to_client`. A kept-alive connection that gives
    /// no answer at all is replaced by a new one once, for a request that may be
    /// repeated.
    async fn exchange(&mut self, request: &Exchanged<'_>) -> Result<Relay, Failure> {
        let fast = self.fast;
        let mut reused = fast.pool.checkout();
        loop {
            let was_reused = reused.is_some();
            let mut conn = match reused.take() {
                Some(conn) => conn,
                // Boxed: the connect future is large and rarely needed, and the
                // exchange's future, moved into the deadline's `select!` each
                // request, would otherwise carry its size.
                None => Box::pin(fast.pool.connect())
                    .await
                    .map_err(|_| Failure::Unreachable)?,
            };
            self.from_upstream.clear();
            match self.send_and_read_head(&mut conn, request).await {
                Ok((head, whole)) => return Ok(Relay { head, conn, whole }),
                // Nothing came back on a connection that had served before: it may
                // have been closed as the request was sent. Once more, on a new one.
                Err(Exchange::NoAnswer) if was_reused && request.repeatable => {}
                Err(_) => return Err(Failure::NoAnswer),
            }
        }
    }

    /// Writes the request in `to_upstream` (and `body` after it) to `conn`: true once
    /// all of it is written; false when the upstream stopped taking it: its connection failed or closed, or
    /// it refused first (a final head of 4xx or 5xx, or one that cannot be relayed,
    /// from an upstream that may read no further). What it answered is left in
    /// `from_upstream`, to be read as the head. An upstream that accepts early (it
    /// streams its answer as it reads) gets the whole request; interim heads are
    /// skipped.
    async fn send_request(&mut self, conn: &TcpStream, body: &[u8]) -> bool {
        let mut at = 0;
        let mut watching = true;
        let head = self.to_upstream.len();
        while at < head + body.len() {
            tokio::select! {
                biased;
                ready = conn.writable() => {
                    if ready.is_err() {
                        return false;
                    }
                    let written = if at < head {
                        let parts = [io::IoSlice::new(&self.to_upstream[at..]), io::IoSlice::new(body)];
                        conn.try_write_vectored(&parts)
                    } else {
                        conn.try_write(&body[at - head..])
                    };
                    match written {
                        Ok(n) => at += n,
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                        Err(_) => return false,
                    }
                }
                ready = conn.readable(), if watching => {
                    if ready.is_err() {
                        return false;
                    }
                    self.from_upstream.reserve(READ_CHUNK);
                    match conn.try_read_buf(&mut self.from_upstream) {
                        Ok(0) => return false,
                        Ok(_) => match response::final_status(&self.from_upstream) {
                            Some(status) if !(200..400).contains(&status) => return false,
                            // Accepted: the rest of its answer waits until the request
                            // is all written.
                            Some(_) => watching = false,
                            None if self.from_upstream.len() >= MAX_RESPONSE_HEAD => {
                                return false;
                            }
                            None => {}
                        },
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                        Err(_) => return false,
                    }
                }
            }
        }
        true
    }

    async fn send_and_read_head(
        &mut self,
        conn: &mut TcpStream,
        request: &Exchanged<'_>,
    ) -> Result<(response::Head, bool), Exchange> {
        let policy = request.limiter.policy();
        // An upstream that stops taking the request may have answered first (a 413,
        // say): what it answered is still read, and the client's connection closes
        // after it.
        let sent = self.send_request(conn, request.body).await;
        let rewrite = response::Rewrite {
            close: request.rewrite.close || !sent,
            ..request.rewrite
        };
        let mut checked = 0;
        loop {
            if may_end_head(&self.from_upstream, checked) {
                loop {
                    let parsed = response::parse(
                        &self.from_upstream,
                        &rewrite,
                        &mut self.to_client,
                        |out, dated| {
                            push_rate_limit_fields(
                                out,
                                request.forward.decision(),
                                request.forward.plan(),
                                policy,
                            );
                            push_field(out, b"x-request-id", request.request_id.as_bytes());
                            if !dated {
                                push_date(out);
                            }
                        },
                    )
                    .map_err(|_| Exchange::Broken)?;
                    match parsed {
                        response::Parsed::Final(_) if request.forward.settles() => {
                            // The weighted budgets are charged what the upstream says
                            // the call cost, and the head is written again with their
                            // standing after the charge.
                            let cost = response::field(&self.from_upstream, b"x-sluice-cost")
                                .and_then(sluice_edge::parse_cost);
                            let settled = request.forward.settle(cost).await;
                            let again = response::parse(
                                &self.from_upstream,
                                &rewrite,
                                &mut self.to_client,
                                |out, dated| {
                                    push_rate_limit_fields(
                                        out,
                                        &settled,
                                        request.forward.plan(),
                                        policy,
                                    );
                                    push_field(out, b"x-request-id", request.request_id.as_bytes());
                                    if !dated {
                                        push_date(out);
                                    }
                                },
                            )
                            .map_err(|_| Exchange::Broken)?;
                            let response::Parsed::Final(head) = again else {
                                return Err(Exchange::Broken);
                            };
                            self.from_upstream.advance(head.len);
                            return Ok((head, sent));
                        }
                        response::Parsed::Final(head) => {
                            self.from_upstream.advance(head.len);
                            return Ok((head, sent));
                        }
                        response::Parsed::Interim { len } => self.from_upstream.advance(len),
                        response::Parsed::Partial => {
                            checked = self.from_upstream.len();
                            break;
                        }
                    }
                }
            }
            if self.from_upstream.len() >= MAX_RESPONSE_HEAD {
                return Err(Exchange::Broken);
            }
            let read = read_more(conn, &mut self.from_upstream).await;
            if !matches!(read, Ok(n) if n > 0) {
                return Err(if self.from_upstream.is_empty() {
                    Exchange::NoAnswer
                } else {
                    Exchange::Broken
                });
            }
        }
    }

    /// Writes the response head and relays the body; true when the upstream connection
    /// can serve another request.
    async fn relay_body(
        &mut self,
        client: &mut TcpStream,
        head: response::Head,
        conn: &mut TcpStream,
    ) -> io::Result<bool> {
        let upstream = &mut self.from_upstream;
        let out = &mut self.to_client;
        let pipelined = &mut self.from_client;
        match head.framing {
            Framing::Empty => {
                client.write_all(out).await?;
                Ok(head.reusable && upstream.is_empty())
            }
            Framing::Length(n) => {
                let mut left = n;
                let take = usize::try_from(left)
                    .unwrap_or(usize::MAX)
                    .min(upstream.len());
                out.extend_from_slice(&upstream[..take]);
                upstream.advance(take);
                left -= take as u64;
                client.write_all(out).await?;
                while left > 0 {
                    upstream.clear();
                    if read_body(conn, upstream, client, pipelined).await? == 0 {
                        return Err(io::ErrorKind::UnexpectedEof.into());
                    }
                    let take = usize::try_from(left)
                        .unwrap_or(usize::MAX)
                        .min(upstream.len());
                    client.write_all(&upstream[..take]).await?;
                    upstream.advance(take);
                    left -= take as u64;
                }
                Ok(head.reusable && upstream.is_empty())
            }
            Framing::Chunked => {
                let mut end = ChunkedEnd::new();
                let used = end
                    .feed(upstream)
                    .map_err(|_| io::Error::from(io::ErrorKind::InvalidData))?;
                out.extend_from_slice(&upstream[..used]);
                upstream.advance(used);
                client.write_all(out).await?;
                while !end.is_done() {
                    upstream.clear();
                    if read_body(conn, upstream, client, pipelined).await? == 0 {
                        return Err(io::ErrorKind::UnexpectedEof.into());
                    }
                    let used = end
                        .feed(upstream)
                        .map_err(|_| io::Error::from(io::ErrorKind::InvalidData))?;
                    client.write_all(&upstream[..used]).await?;
                    upstream.advance(used);
                }
                Ok(head.reusable && upstream.is_empty())
            }
            Framing::UntilClose => {
                // Each read goes out as one chunk, the close as the last chunk.
                push_chunk(out, upstream);
                upstream.clear();
                client.write_all(out).await?;
                loop {
                    upstream.clear();
                    let n = read_body(conn, upstream, client, pipelined).await?;
                    out.clear();
                    push_chunk(out, upstream);
                    if n == 0 {
                        out.extend_from_slice(b"0\r\n\r\n");
                    }
                    client.write_all(out).await?;
                    if n == 0 {
                        return Ok(false);
                    }
                }
            }
        }
    }
}

/// What the exchange with the upstream needs of the request besides its bytes.
struct Exchanged<'a> {
    /// How the client's head is made from the upstream's.
    rewrite: response::Rewrite<'a>,
    /// The request may be sent again on a new connection.
    repeatable: bool,
    /// The admitted request: its decision, its plan, and the weighted budgets it
    /// settles from the response head.
    forward: &'a Forward<'a, AnyStore>,
    /// The limiter that decided the request.
    limiter: &'a Limiter<AnyStore>,
    /// The request's id, returned to the client.
    request_id: &'a RequestId,
    /// The request body, written after `to_upstream` (empty when it is in there).
    body: &'a [u8],
}

/// The fields the gateway sets itself: the upstream's `X-Sluice-Cost` (a signal for
/// sluice, never relayed), `X-Request-Id` (the request's own is returned), then the
/// rate-limit fields in the order
/// [`sluice_edge::for_each_rate_limit_header`] writes them: the legacy three, then the
/// IETF draft's two. The upstream's own fields of these names are dropped, as the
/// service stack drops or replaces them. A `static`: a `const` array of names would
/// be built and dropped at each use, once a request.
static REPLACED_FIELDS: [HeaderName; 7] = [
    sluice_edge::X_SLUICE_COST,
    sluice_edge::X_REQUEST_ID,
    sluice_edge::X_RATELIMIT_LIMIT,
    sluice_edge::X_RATELIMIT_REMAINING,
    sluice_edge::X_RATELIMIT_RESET,
    sluice_edge::RATELIMIT_POLICY,
    sluice_edge::RATELIMIT,
];

/// Why an exchange with the upstream failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Exchange {
    /// Nothing of a response arrived (the connection closed or failed).
    NoAnswer,
    /// The exchange broke after it had started, or the response cannot be relayed.
    Broken,
}

/// Longest upstream response head relayed, as for request heads.
const MAX_RESPONSE_HEAD: usize = 64 * 1024;

/// Most bytes kept of what a client sends while its response streams.
const MAX_PIPELINED: usize = 64 * 1024;

/// True when the empty `buf` holds an allocation larger than [`KEPT_CAPACITY`]: its
/// capacity counts only what lies after the bytes already consumed, so the space
/// before them is taken back first (no copy: nothing is left to move).
fn holds_more_than_kept(buf: &mut BytesMut) -> bool {
    buf.capacity() > KEPT_CAPACITY || buf.try_reclaim(KEPT_CAPACITY + 1)
}

/// Reads some of a request body into the spare room of `buf` (which has some): within
/// the head timeout, and before `whole_by`. The bytes read (at least one).
async fn read_within(
    client: &mut TcpStream,
    timers: &mut Timers,
    whole_by: tokio::time::Instant,
    buf: &mut BytesMut,
) -> Result<usize, BodyRead> {
    let now = tokio::time::Instant::now();
    if now >= whole_by {
        return Err(BodyRead::TooSlow);
    }
    let stalled = (now + timers.head_timeout).min(whole_by);
    timers.head.set(stalled);
    let read = tokio::select! {
        biased;
        read = client.read_buf(buf) => read,
        () = timers.head.passed() => {
            return Err(if stalled == whole_by { BodyRead::TooSlow } else { BodyRead::Stalled });
        }
    };
    match read {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(BodyRead::Stalled),
    }
}

/// Reads what is there (at least one byte, or 0 at the end) into `buf`.
async fn read_more(stream: &mut TcpStream, buf: &mut BytesMut) -> io::Result<usize> {
    buf.reserve(READ_CHUNK);
    stream.read_buf(buf).await
}

/// Reads more of a response body from the upstream into `buf`, as [`read_more`].
/// Meanwhile the client's connection is watched: a client that has closed it ends
/// the relay (an error), so that a stream nobody reads any more (server-sent events
/// to a client that left) does not hold the upstream connection, or a drain, until
/// its next event. Bytes the client sends meanwhile (pipelined requests) are kept in
/// `pipelined`, up to a head's worth; past that the client is not watched.
async fn read_body(
    conn: &mut TcpStream,
    buf: &mut BytesMut,
    client: &TcpStream,
    pipelined: &mut BytesMut,
) -> io::Result<usize> {
    loop {
        tokio::select! {
            biased;
            n = read_more(conn, buf) => return n,
            ready = client.readable(), if pipelined.len() < MAX_PIPELINED => {
                ready?;
                pipelined.reserve(READ_CHUNK);
                match client.try_read_buf(pipelined) {
                    Ok(0) => return Err(io::ErrorKind::ConnectionAborted.into()),
                    Err(e) if e.kind() != io::ErrorKind::WouldBlock => return Err(e),
                    _ => {}
                }
            }
        }
    }
}

/// True when `buf`, of which the first `checked` bytes were found to hold no complete
/// head, may hold one now: when it is not empty and either nothing was checked yet
/// or the bytes since hold the blank line that ends a head. Parsing again only then
/// keeps a head that arrives a byte at a time from costing a parse per byte.
fn may_end_head(buf: &[u8], checked: usize) -> bool {
    if checked == 0 {
        return !buf.is_empty();
    }
    let fresh = &buf[checked.saturating_sub(3).min(buf.len())..];
    fresh.windows(2).any(|w| w == b"\n\n") || fresh.windows(3).any(|w| w == b"\n\r\n")
}

/// Writes `date: <now as an HTTP date>\r\n`, as hyper's server adds to every
/// response without one; the text is made at most once a second per worker thread.
fn push_date(out: &mut Vec<u8>) {
    thread_local! {
        static DATE: std::cell::RefCell<(u64, String)> =
            const { std::cell::RefCell::new((0, String::new())) };
    }
    let now = std::time::SystemTime::now();
    let secs = now
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    DATE.with_borrow_mut(|(at, text)| {
        if *at != secs || text.is_empty() {
            *at = secs;
            *text = httpdate::fmt_http_date(now);
        }
        push_field(out, b"date", text.as_bytes());
    });
}

/// Appends `data` as one chunk of a chunked body (nothing for no data: an empty
/// chunk would end the body).
fn push_chunk(out: &mut Vec<u8>, data: &[u8]) {
    if data.is_empty() {
        return;
    }
    let mut size = [0u8; 16];
    let mut at = size.len();
    let mut n = data.len();
    loop {
        at -= 1;
        size[at] = b"0123456789abcdef"[n & 15];
        n >>= 4;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(&size[at..]);
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(data);
    out.extend_from_slice(b"\r\n");
}

/// `name: value\r\n`.
fn push_field(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.extend_from_slice(name);
    out.extend_from_slice(b": ");
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}

/// The rate-limit fields of `decision`, as the service stack adds them.
fn push_rate_limit_fields(
    out: &mut Vec<u8>,
    decision: &Decision,
    plan: &Plan,
    policy: &sluice_policy::Policy,
) {
    sluice_edge::for_each_rate_limit_header(decision, plan, policy, |name, value| match value {
        RateLimitValue::Number(n) => push_field(
            out,
            name.as_str().as_bytes(),
            itoa::Buffer::new().format(n).as_bytes(),
        ),
        RateLimitValue::Text(text) => {
            if http::HeaderValue::from_str(text).is_ok() {
                push_field(out, name.as_str().as_bytes(), text.as_bytes());
            }
        }
    });
}

/// What an access line says of a request on the fast path (kept only while the
/// access log is on).
pub(super) struct Access {
    method: Method,
    /// The path, without the query (which may hold a credential).
    path: String,
    peer: IpAddr,
    began: std::time::Instant,
}

impl Access {
    /// The request whose head starts `buf`.
    fn new(method: &Method, buf: &[u8], peer: IpAddr) -> Access {
        let target = buf
            .split(|&b| b == b' ')
            .nth(1)
            .unwrap_or_default()
            .split(|&b| b == b'?')
            .next()
            .unwrap_or_default();
        Access {
            method: method.clone(),
            path: String::from_utf8_lossy(target).into_owned(),
            peer,
            began: std::time::Instant::now(),
        }
    }

    /// The line, once the answer is sent (`whole`: all of it reached the client).
    fn log(self, id: &RequestId, status: u16, whole: bool) {
        super::access::log(
            id,
            self.method.as_str(),
            &self.path,
            status,
            self.began.elapsed(),
            self.peer,
            whole,
        );
    }
}

/// An answer of sluice's own, its body collected.
async fn own(answer: Response<http_body_util::Full<Bytes>>) -> Response<Bytes> {
    let (parts, body) = answer.into_parts();
    let body = match body.collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(never) => match never {},
    };
    Response::from_parts(parts, body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::num::NonZeroUsize;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::net::TcpListener;

    /// The head timeout of [`fast_path`].
    const HEAD_TIMEOUT: Duration = Duration::from_secs(30);

    /// An upstream answering `200 ok` to each request once it has its whole body, and
    /// counting its connections.
    async fn counting_upstream() -> (SocketAddr, Arc<AtomicUsize>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = Arc::clone(&accepted);
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let mut got = BytesMut::new();
                    loop {
                        let mut fields = [httparse::EMPTY_HEADER; 16];
                        let mut request = httparse::Request::new(&mut fields);
                        if let Ok(httparse::Status::Complete(end)) = request.parse(&got) {
                            let length: usize = request
                                .headers
                                .iter()
                                .find(|f| f.name.eq_ignore_ascii_case("content-length"))
                                .and_then(|f| std::str::from_utf8(f.value).ok()?.parse().ok())
                                .unwrap_or(0);
                            if got.len() >= end + length {
                                got.advance(end + length);
                                let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                                if stream.write_all(ok).await.is_err() {
                                    return;
                                }
                                continue;
                            }
                        }
                        if !matches!(stream.read_buf(&mut got).await, Ok(n) if n > 0) {
                            return;
                        }
                    }
                });
            }
        });
        (addr, accepted)
    }

    /// The fast path of the default policy in front of `upstream`.
    fn fast_path_to(upstream: SocketAddr) -> FastPath {
        let policy = sluice_policy::default_policy().expect("the default policy");
        let store = AnyStore::memory(sluice_core::SystemClock::new());
        let config = ProxyConfig {
            upstream: super::super::proxy::Upstream::from_addr(upstream),
            header_timeout: Duration::from_secs(60),
        };
        let stats = RequestStats::with_workers(NonZeroUsize::MIN);
        let pool = Arc::new(Connections::new(config.upstream.connect_target()));
        FastPath::new(
            Arc::new(sluice_edge::arc_swap::ArcSwap::from_pointee(Limiter::new(
                policy, store,
            ))),
            config,
            pool,
            stats.worker(0),
            false,
        )
    }

    /// [`fast_path_to`] `upstream`, serving every connection to the returned address.
    async fn fast_path(upstream: SocketAddr) -> SocketAddr {
        serve_on_loopback(Arc::new(fast_path_to(upstream))).await
    }

    /// Serves every connection to the returned address with `fast`.
    async fn serve_on_loopback(fast: Arc<FastPath>) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (_draining, drain) = watch::channel(false);
        tokio::spawn(async move {
            let _draining = _draining;
            while let Ok((stream, peer)) = listener.accept().await {
                let (fast, drain) = (Arc::clone(&fast), drain.clone());
                tokio::spawn(async move {
                    fast.serve(stream, peer, drain, HEAD_TIMEOUT, 64 * 1024)
                        .await
                });
            }
        });
        addr
    }

    #[tokio::test]
    async fn a_kept_alive_connection_gives_back_what_a_large_exchange_took() {
        let fast = fast_path_to(SocketAddr::from(([127, 0, 0, 1], 9)));
        let mut conn = Connection::new(&fast, IpAddr::from([127, 0, 0, 1]));
        let small = |conn: &Connection<'_>| {
            [
                conn.from_client.capacity(),
                conn.from_upstream.capacity(),
                conn.to_upstream.capacity(),
                conn.to_client.capacity(),
            ]
        };
        let fresh = small(&conn);
        conn.from_client.reserve(1 << 20);
        conn.from_upstream.reserve(1 << 20);
        conn.to_upstream.reserve(1 << 20);
        conn.to_client.reserve(1 << 20);
        conn.trim();
        assert!(
            small(&conn).iter().all(|&c| c <= KEPT_CAPACITY),
            "{:?}",
            small(&conn)
        );

        // A large body consumed to within a few bytes of its allocation's end: what
        // is left after it is small, the allocation is not.
        conn.from_client.reserve(1 << 20);
        let whole = conn.from_client.capacity();
        conn.from_client.resize(whole - 10, b'b');
        conn.from_client.advance(whole - 10);
        assert!(conn.from_client.capacity() <= KEPT_CAPACITY);
        conn.trim();
        conn.from_client.reserve(READ_CHUNK);
        assert!(
            conn.from_client.capacity() <= KEPT_CAPACITY,
            "{}",
            conn.from_client.capacity()
        );

        // Pipelined bytes are kept; buffers at their usual size are left as they are.
        conn.from_client.reserve(1 << 20);
        conn.from_client.extend_from_slice(b"GET / HTTP/1.1\r\n");
        conn.trim();
        assert_eq!(&conn.from_client[..], b"GET / HTTP/1.1\r\n");
        let mut usual = Connection::new(&fast, IpAddr::from([127, 0, 0, 1]));
        usual.trim();
        assert_eq!(small(&usual), fresh);
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_that_stops_coming_is_a_400_at_the_head_timeout() {
        let (upstream, accepted) = counting_upstream().await;
        let sluice = fast_path(upstream).await;

        // A hundred bytes announced, ten sent, then nothing.
        let mut client = TcpStream::connect(sluice).await.expect("connect");
        let started = tokio::time::Instant::now();
        client
            .write_all(b"POST /things HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n0123456789")
            .await
            .expect("write");
        let mut answer = Vec::new();
        let ended = tokio::time::timeout(HEAD_TIMEOUT * 3, client.read_to_end(&mut answer)).await;
        let waited = started.elapsed();
        assert!(ended.is_ok(), "still open after {waited:?}");
        let answer = String::from_utf8_lossy(&answer);
        assert!(
            answer.starts_with("HTTP/1.1 400 Bad Request\r\n"),
            "{answer}"
        );
        assert!(answer.contains("connection: close\r\n"), "{answer}");
        assert!(
            answer.contains("\"code\":\"invalid_request\"")
                && answer.contains("The request body could not be read."),
            "{answer}"
        );
        assert!(
            (HEAD_TIMEOUT..HEAD_TIMEOUT + Duration::from_secs(1)).contains(&waited),
            "closed after {waited:?}"
        );
        assert_eq!(accepted.load(Ordering::SeqCst), 0, "nothing went upstream");
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_that_keeps_coming_is_served_within_the_body_deadline() {
        let (upstream, _) = counting_upstream().await;
        let sluice = fast_path(upstream).await;

        // The head near the end of its own timeout, then ten bytes of the body every
        // twelve seconds: each read within the head timeout, the whole body past it
        // but within the body deadline.
        let mut client = TcpStream::connect(sluice).await.expect("connect");
        tokio::time::sleep(HEAD_TIMEOUT * 5 / 6).await;
        client
            .write_all(b"POST /things HTTP/1.1\r\nhost: x\r\ncontent-length: 40\r\n\r\n")
            .await
            .expect("write");
        for _ in 0..4 {
            tokio::time::sleep(sluice_edge::BODY_DEADLINE / 5).await;
            client.write_all(&[b'b'; 10]).await.expect("write");
        }
        // The exchange with the upstream runs on real time: paused time would jump to
        // the upstream's deadline while the loopback sockets are still at work.
        tokio::time::resume();
        let mut answer = vec![0u8; 256];
        let n = client.read(&mut answer).await.expect("read");
        let answer = String::from_utf8_lossy(&answer[..n]);
        assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{answer}");
        assert!(answer.ends_with("\r\n\r\nok"), "{answer}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_that_trickles_past_the_body_deadline_is_a_408_and_holds_nothing() {
        let (upstream, accepted) = counting_upstream().await;
        let fast = Arc::new(fast_path_to(upstream));
        let buffers = Arc::clone(fast.limiter.load().buffers());
        let sluice = serve_on_loopback(fast).await;
        // A byte every 20 s: each read within the head timeout, never the whole body.
        let mut client = TcpStream::connect(sluice).await.expect("connect");
        client
            .write_all(b"POST /things HTTP/1.1\r\nhost: x\r\ncontent-length: 1000\r\n\r\n")
            .await
            .expect("write");
        let started = tokio::time::Instant::now();
        let mut answer = Vec::new();
        let read = async {
            loop {
                tokio::select! {
                    n = client.read_buf(&mut answer) => {
                        if matches!(n, Ok(0) | Err(_)) { break; }
                    }
                    () = tokio::time::sleep(HEAD_TIMEOUT * 2 / 3) => {
                        let _ = client.write_all(b"b").await;
                    }
                }
            }
        };
        tokio::time::timeout(sluice_edge::BODY_DEADLINE * 2, read)
            .await
            .expect("answered");
        let waited = started.elapsed();
        let answer = String::from_utf8_lossy(&answer);
        assert!(
            answer.starts_with("HTTP/1.1 408 Request Timeout\r\n"),
            "{answer}"
        );
        assert!(answer.contains("\"code\":\"request_timeout\""), "{answer}");
        assert!(
            (sluice_edge::BODY_DEADLINE..sluice_edge::BODY_DEADLINE + Duration::from_secs(1))
                .contains(&waited),
            "answered after {waited:?}"
        );
        assert_eq!(buffers.used(), 0, "the lease is given back");
        assert_eq!(accepted.load(Ordering::SeqCst), 0, "nothing went upstream");
    }

    #[tokio::test]
    async fn a_full_buffer_bound_answers_503_and_leaves_the_body_unread() {
        let (upstream, accepted) = counting_upstream().await;
        let policy = sluice_policy::default_policy().expect("the default policy");
        let limiter = Limiter::new(policy, AnyStore::memory(sluice_core::SystemClock::new()))
            .with_buffer_bound(48 * 1024);
        let config = ProxyConfig {
            upstream: super::super::proxy::Upstream::from_addr(upstream),
            header_timeout: Duration::from_secs(60),
        };
        let stats = RequestStats::with_workers(NonZeroUsize::MIN);
        let limiter = Arc::new(sluice_edge::arc_swap::ArcSwap::from_pointee(limiter));
        let pool = Arc::new(Connections::new(config.upstream.connect_target()));
        let fast = Arc::new(FastPath::new(limiter, config, pool, stats.worker(0), false));
        let sluice = serve_on_loopback(fast).await;
        // A body that has sent 40 of its 60 KB holds a lease of what its buffer grew
        // to (what arrived, not what was announced)…
        let head = b"POST /things HTTP/1.1\r\nhost: x\r\ncontent-length: 60000\r\n\r\n";
        let mut first = TcpStream::connect(sluice).await.expect("connect");
        first.write_all(head).await.expect("write");
        first.write_all(&[b'a'; 40_000]).await.expect("write");
        // …so a second one growing as far does not fit the bound of 48 KiB: 503, closed.
        let mut answer = Vec::new();
        for _ in 0..20 {
            let mut second = TcpStream::connect(sluice).await.expect("connect");
            second.write_all(head).await.expect("write");
            let _ = second.write_all(&[b'a'; 40_000]).await;
            answer.clear();
            let _ =
                tokio::time::timeout(Duration::from_secs(5), second.read_to_end(&mut answer)).await;
            if !answer.is_empty() {
                break;
            }
        }
        let answer = String::from_utf8_lossy(&answer);
        assert!(
            answer.starts_with("HTTP/1.1 503 Service Unavailable\r\n"),
            "{answer}"
        );
        assert!(answer.contains("retry-after: 1\r\n"), "{answer}");
        assert!(answer.contains("connection: close\r\n"), "{answer}");
        // A body that fits is still served.
        let mut small = TcpStream::connect(sluice).await.expect("connect");
        small
            .write_all(b"POST /things HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: 3\r\n\r\nabc")
            .await
            .expect("write");
        let mut ok = Vec::new();
        small.read_to_end(&mut ok).await.expect("read");
        assert!(
            ok.starts_with(b"HTTP/1.1 200 OK\r\n"),
            "{}",
            String::from_utf8_lossy(&ok)
        );
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            1,
            "only the small request went upstream"
        );
        drop(first);
    }

    #[test]
    fn a_body_to_the_close_goes_out_in_chunks() {
        let mut out = Vec::new();
        push_chunk(&mut out, b"");
        push_chunk(&mut out, b"hello");
        push_chunk(&mut out, &[b'x'; 300]);
        let mut end = ChunkedEnd::new();
        out.extend_from_slice(b"0\r\n\r\n");
        assert_eq!(end.feed(&out), Ok(out.len()));
        assert!(end.is_done());
        assert!(out.starts_with(b"5\r\nhello\r\n12c\r\nxxx"), "{out:?}");
    }

    #[test]
    fn a_head_is_parsed_again_only_once_its_blank_line_may_have_come() {
        assert!(!may_end_head(b"", 0));
        assert!(may_end_head(b"G", 0), "a first look always parses");
        let head = b"GET / HTTP/1.1\r\nhost: x\r\n\r\n";
        for end in 1..head.len() {
            // Checked up to `end - 1`, then one more byte came.
            let expect = end + 1 == head.len();
            assert_eq!(may_end_head(&head[..=end], end), expect, "at {end}");
        }
        assert!(may_end_head(b"GET / HTTP/1.1\nhost: x\n\n", 20));
    }
}
