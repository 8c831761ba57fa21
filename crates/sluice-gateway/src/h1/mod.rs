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

mod access;
mod body;
mod buffers;
mod connection;
mod encode;
mod exchange;
mod request;
mod settle;

pub(crate) use buffers::SEND_TIMEOUT;
use buffers::{Connection, Next, Timers};

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use sluice_edge::SharedLimiter;
use tokio::io::AsyncWriteExt as _;
use tokio::net::TcpStream;
use tokio::sync::watch;

use super::metered::RequestStats;
use super::pool::Connections;
use super::proxy::{ProxyConfig, Upstream};
use super::store::AnyStore;
use sluice_h1::deadline::Deadline;

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
    upstream_seconds: &'static [sluice_edge::latency::Latency; 3],
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

    /// False for an https upstream: the fast path speaks plain HTTP/1.1 to the
    /// upstream, so every connection is left to hyper then.
    pub(super) fn is_on(&self) -> bool {
        !self.config.upstream.is_https()
    }

    /// True when the current policy has lanes, whose calls wait for a place (a
    /// connection hyper serves then watches for its client's hang-up).
    pub(super) fn has_lanes(&self) -> bool {
        !self.limiter.load().policy().lanes.is_empty()
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
        draining: &mut watch::Receiver<bool>,
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
                .one_request(&mut stream, draining, &mut timers, max_head)
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

#[cfg(test)]
impl FastPath {
    /// The fast path of the default policy (memory store) in front of `upstream`.
    pub(super) fn for_tests(upstream: SocketAddr) -> FastPath {
        let policy = sluice_policy::default_policy().expect("the default policy");
        let store = AnyStore::memory(sluice_core::SystemClock::new());
        let config = ProxyConfig {
            upstream: Upstream::from_addr(upstream),
            header_timeout: Duration::from_secs(60),
        };
        let stats = RequestStats::with_workers(std::num::NonZeroUsize::MIN);
        let pool = Arc::new(Connections::new(config.upstream.connect_target()));
        FastPath::new(
            Arc::new(sluice_edge::arc_swap::ArcSwap::from_pointee(
                sluice_edge::Limiter::new(policy, store),
            )),
            config,
            pool,
            stats.worker(0),
            false,
        )
    }
}

#[cfg(test)]
mod tests {
    use std::net::IpAddr;
    use std::num::NonZeroUsize;

    use bytes::{Buf as _, BytesMut};
    use sluice_edge::Limiter;
    use sluice_h1::chunked::ChunkedEnd;
    use tokio::io::AsyncReadExt as _;

    use super::buffers::may_end_head;
    use super::encode::push_chunk;
    use super::*;
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
        FastPath::for_tests(upstream)
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
                let (fast, mut drain) = (Arc::clone(&fast), drain.clone());
                tokio::spawn(async move {
                    fast.serve(stream, peer, &mut drain, HEAD_TIMEOUT, 64 * 1024)
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

    /// A client that stops reading a large answer is closed at the send timeout
    /// (as nginx's `send_timeout`), and the upstream connection with it: it never
    /// holds them for as long as it likes.
    #[tokio::test(start_paused = true)]
    async fn a_client_that_stops_reading_is_closed_at_the_send_timeout() {
        let counted = crate::stalled::Counted::new();
        let _recording = counted.install();
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let upstream = listener.local_addr().expect("addr");
        let (closed_tx, closed_rx) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.expect("accept");
            let mut head = [0u8; 1024];
            let _ = stream.read(&mut head).await;
            let size = 256 << 20;
            let answer = format!("HTTP/1.1 200 OK\r\ncontent-length: {size}\r\n\r\n");
            let _ = stream.write_all(answer.as_bytes()).await;
            let chunk = vec![b'x'; 64 << 10];
            let mut sent = 0;
            while sent < size {
                if stream.write_all(&chunk).await.is_err() {
                    break;
                }
                sent += chunk.len();
            }
            let _ = closed_tx.send(sent < size);
        });
        let sluice = fast_path(upstream).await;
        let mut client = TcpStream::connect(sluice).await.expect("connect");
        client
            .write_all(b"GET /things HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .expect("write");
        let mut first = [0u8; 100];
        client
            .read_exact(&mut first)
            .await
            .expect("the answer starts");
        let started = tokio::time::Instant::now();
        let cut = tokio::time::timeout(SEND_TIMEOUT * 2, closed_rx)
            .await
            .expect("the upstream connection is closed")
            .expect("sent");
        assert!(
            cut,
            "the whole answer went out to a client that read none of it"
        );
        let waited = started.elapsed();
        assert!(
            (SEND_TIMEOUT..SEND_TIMEOUT + Duration::from_secs(2)).contains(&waited),
            "closed after {waited:?}"
        );
        // Counted, so an operator sees it (`sluice_stalled_clients_total`).
        assert_eq!(counted.of(crate::stalled::Cut::Connection), 1);
        assert_eq!(counted.of(crate::stalled::Cut::Stream), 0);
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
