//! Clients that take nothing of their answer, on one `sluice serve` process in front
//! of an upstream with a large answer: each is cut at the send timeout (60 s), the
//! upstream's connection with it, and counted in `/metrics`
//! (`sluice_stalled_clients_total{cut}`), so an operator sees clients holding
//! connections this way. Both tests wait out the real 60 s, side by side.

mod support;

use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Empty;
use hyper_util::rt::{TokioExecutor, TokioIo};
use support::Sluice;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;

/// The send timeout the gateway holds clients to.
const SEND_TIMEOUT: Duration = Duration::from_secs(60);

/// Bound on each test's whole body.
const TEST_TIMEOUT: Duration = Duration::from_secs(150);

/// An upstream that answers one request with 1 GiB; the receiver tells whether the
/// connection was closed before it was all sent.
async fn large_answer() -> (String, oneshot::Receiver<bool>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (closed, upstream_closed) = oneshot::channel();
    tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.expect("accept");
        let mut head = [0u8; 4096];
        let _ = stream.read(&mut head).await;
        let size: usize = 1 << 30;
        let answer = format!("HTTP/1.1 200 OK\r\ncontent-length: {size}\r\n\r\n");
        let _ = stream.write_all(answer.as_bytes()).await;
        let chunk = vec![b'x'; 64 << 10];
        let mut sent = 0;
        while sent < size && stream.write_all(&chunk).await.is_ok() {
            sent += chunk.len();
        }
        let _ = closed.send(sent < size);
    });
    (format!("http://{addr}"), upstream_closed)
}

/// The count of `sluice_stalled_clients_total{cut}` in `sluice`'s `/metrics` (0 while
/// the family has no such line).
async fn stalled_clients(sluice: &Sluice, cut: &str) -> u64 {
    let metrics = support::get(&sluice.admin_url("/metrics")).await.text();
    let line = format!("sluice_stalled_clients_total{{cut=\"{cut}\"}} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(line.as_str()))
        .map_or(0, |n| n.trim().parse().expect("a count"))
}

/// Waits for the upstream's note that its connection was closed mid-answer, and for
/// no less than the send timeout from `started`.
async fn upstream_cut(upstream_closed: oneshot::Receiver<bool>, started: Instant) {
    let cut = upstream_closed.await.expect("the upstream's note");
    assert!(cut, "the whole answer went out to a client that took none");
    let waited = started.elapsed();
    assert!(
        waited >= SEND_TIMEOUT - Duration::from_secs(1),
        "cut after {waited:?}, before the send timeout"
    );
}

/// HTTP/1.1 (the fast path): the connection is closed.
#[tokio::test]
async fn an_http1_client_that_takes_nothing_is_cut_and_counted() {
    let (upstream, upstream_closed) = large_answer().await;
    let sluice = Sluice::spawn(&["--upstream", &upstream]);
    tokio::time::timeout(TEST_TIMEOUT, async {
        assert_eq!(stalled_clients(&sluice, "connection").await, 0);
        let mut client = TcpStream::connect(sluice.start.gateway)
            .await
            .expect("connect");
        client
            .write_all(b"GET /large HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .expect("write");
        let mut first = [0u8; 100];
        client
            .read_exact(&mut first)
            .await
            .expect("the answer starts");
        upstream_cut(upstream_closed, Instant::now()).await;
        assert_eq!(stalled_clients(&sluice, "connection").await, 1);
        assert_eq!(stalled_clients(&sluice, "stream").await, 0);
        drop(client);
    })
    .await
    .expect("test timed out");
}

/// HTTP/2 with a window of 0: the client's flow control lets nothing of the answer
/// come. The stream is cut (its body dropped, the upstream's connection closed), not
/// the connection.
#[tokio::test]
async fn an_http2_stream_its_client_never_lets_send_is_cut_and_counted() {
    let (upstream, upstream_closed) = large_answer().await;
    let sluice = Sluice::spawn(&["--upstream", &upstream]);
    tokio::time::timeout(TEST_TIMEOUT, async {
        assert_eq!(stalled_clients(&sluice, "stream").await, 0);
        let stream = TcpStream::connect(sluice.start.gateway)
            .await
            .expect("connect");
        let (mut send, connection) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
            .initial_stream_window_size(0)
            .handshake(TokioIo::new(stream))
            .await
            .expect("HTTP/2 handshake");
        tokio::spawn(connection);
        let request = http::Request::get(format!("http://{}/large", sluice.start.gateway))
            .body(Empty::<Bytes>::new())
            .expect("request");
        send.ready().await.expect("ready");
        let answer = send.send_request(request).await.expect("an answer");
        assert_eq!(answer.status(), 200);
        upstream_cut(upstream_closed, Instant::now()).await;
        assert_eq!(stalled_clients(&sluice, "stream").await, 1);
        assert_eq!(stalled_clients(&sluice, "connection").await, 0);
        drop(answer);
    })
    .await
    .expect("test timed out");
}
