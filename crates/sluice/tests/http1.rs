//! The gateway's HTTP/1.1 path over raw loopback sockets: what the fast path serves
//! (pipelining, bodies in pieces, every framing an upstream uses, kept-alive upstream
//! connections) and what it leaves to hyper (HTTP/1.0, chunked request bodies,
//! `Expect: 100-continue`), all on one `sluice serve` process.

use crate::edit;
use edit::Edit as _;

use crate::support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use serde_json::Value;
use support::Sluice;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};

/// Bound on every test's whole body.
const TEST_TIMEOUT: Duration = Duration::from_secs(60);

async fn bounded<F: Future>(test: F) -> F::Output {
    tokio::time::timeout(TEST_TIMEOUT, test)
        .await
        .expect("test timed out")
}

/// One response read off a raw connection: status, lower-cased head, body (chunked
/// bodies decoded).
#[derive(Debug)]
struct Raw {
    status: u16,
    head: String,
    body: Vec<u8>,
}

impl Raw {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&self.body)))
    }
}

/// Reads one response (for a request that was or was not HEAD) from `stream`,
/// leaving what follows in `pending`.
async fn read_raw(stream: &mut TcpStream, pending: &mut Vec<u8>, head_request: bool) -> Raw {
    async fn fill(stream: &mut TcpStream, pending: &mut Vec<u8>) -> bool {
        let mut chunk = [0u8; 8192];
        let n = stream.read(&mut chunk).await.expect("read");
        pending.extend_from_slice(&chunk[..n]);
        n > 0
    }
    let end = loop {
        if let Some(at) = pending.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
        assert!(fill(stream, pending).await, "closed mid-head: {pending:?}");
    };
    let head = String::from_utf8_lossy(&pending[..end]).to_ascii_lowercase();
    pending.drain(..end);
    let status = head[9..12].parse().expect("status");
    let field = |name: &str| {
        head.lines()
            .find_map(|l| l.strip_prefix(&format!("{name}: ")))
            .map(str::trim)
            .map(str::to_owned)
    };
    let mut body = Vec::new();
    if head_request || status == 204 || status == 304 || (100..200).contains(&status) {
    } else if field("transfer-encoding").as_deref() == Some("chunked") {
        loop {
            let line_end = loop {
                if let Some(at) = pending.windows(2).position(|w| w == b"\r\n") {
                    break at;
                }
                assert!(fill(stream, pending).await, "closed mid-chunk");
            };
            let size_line = String::from_utf8_lossy(&pending[..line_end]).into_owned();
            let size = usize::from_str_radix(size_line.split(';').next().expect("size"), 16)
                .expect("hex size");
            pending.drain(..line_end + 2);
            if size == 0 {
                // Trailer fields, then the empty line.
                loop {
                    let at = loop {
                        if let Some(at) = pending.windows(2).position(|w| w == b"\r\n") {
                            break at;
                        }
                        assert!(fill(stream, pending).await, "closed in trailers");
                    };
                    pending.drain(..at + 2);
                    if at == 0 {
                        break;
                    }
                }
                break;
            }
            while pending.len() < size + 2 {
                assert!(fill(stream, pending).await, "closed mid-chunk");
            }
            body.extend_from_slice(&pending[..size]);
            pending.drain(..size + 2);
        }
    } else if let Some(length) = field("content-length") {
        let length: usize = length.parse().expect("length");
        while pending.len() < length {
            assert!(fill(stream, pending).await, "closed mid-body");
        }
        body = pending.drain(..length).collect();
    } else {
        while fill(stream, pending).await {}
        body = std::mem::take(pending);
    }
    Raw { status, head, body }
}

/// Sends `GET path` and reads its answer.
async fn ask(stream: &mut TcpStream, pending: &mut Vec<u8>, path: &str) -> Raw {
    let request = format!("GET {path} HTTP/1.1\r\nhost: x\r\n\r\n");
    stream.write_all(request.as_bytes()).await.expect("write");
    read_raw(stream, pending, false).await
}

/// Reads from `stream` into `got` until it holds a whole request head (an upstream's
/// side of the exchange): the head's length, or `None` when the stream ends first.
async fn read_request_head(stream: &mut TcpStream, got: &mut Vec<u8>) -> Option<usize> {
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(at) = got.windows(4).position(|w| w == b"\r\n\r\n") {
            return Some(at + 4);
        }
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => got.extend_from_slice(&chunk[..n]),
        }
    }
}

async fn connect(sluice: &Sluice) -> TcpStream {
    let stream = TcpStream::connect(sluice.start.gateway)
        .await
        .expect("connect");
    stream.set_nodelay(true).expect("nodelay");
    stream
}

#[tokio::test]
async fn pipelined_requests_and_split_bodies_are_answered_in_order() {
    let sluice = Sluice::spawn(&[]);
    bounded(async {
        let mut stream = connect(&sluice).await;
        // Two requests in one write, the second with a body.
        stream
            .write_all(
                b"GET /a HTTP/1.1\r\nhost: x\r\n\r\n\
                  POST /things/b HTTP/1.1\r\nhost: x\r\ncontent-length: 9\r\n\r\n{\"n\":42}\n",
            )
            .await
            .expect("write");
        let mut pending = Vec::new();
        let first = read_raw(&mut stream, &mut pending, false).await;
        let second = read_raw(&mut stream, &mut pending, false).await;
        assert_eq!((first.status, second.status), (200, 200));
        assert_eq!(first.json()["path"], "/a");
        assert_eq!(second.json()["path"], "/things/b");
        assert_eq!(second.json()["body"]["n"], 42);
        assert!(first.head.contains("x-ratelimit-limit: "), "{}", first.head);

        // A body larger than any one read, sent in pieces after its head.
        let big = format!("{{\"pad\":\"{}\"}}", "z".repeat(300_000));
        let head = format!(
            "PUT /things/c HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n",
            big.len()
        );
        stream.write_all(head.as_bytes()).await.expect("write");
        for piece in big.as_bytes().chunks(70_000) {
            stream.write_all(piece).await.expect("write");
            tokio::task::yield_now().await;
        }
        let third = read_raw(&mut stream, &mut pending, false).await;
        assert_eq!(third.status, 200);
        assert_eq!(third.json()["body"]["pad"].as_str().map(str::len), Some(300_000));

        // HEAD: the head only, then the connection goes on.
        stream
            .write_all(b"HEAD /d HTTP/1.1\r\nhost: x\r\n\r\nGET /e HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .await
            .expect("write");
        let head_only = read_raw(&mut stream, &mut pending, true).await;
        assert_eq!(head_only.status, 200);
        assert!(head_only.body.is_empty());
        let last = read_raw(&mut stream, &mut pending, false).await;
        assert_eq!(last.json()["path"], "/e");
        assert!(last.head.contains("connection: close"), "{}", last.head);
        let mut rest = Vec::new();
        stream.read_to_end(&mut rest).await.expect("closed");
        assert!(rest.is_empty() && pending.is_empty(), "{rest:?}");
    })
    .await;
}

#[tokio::test]
async fn requests_left_to_hyper_are_answered_on_the_same_connection() {
    let sluice = Sluice::spawn(&[]);
    bounded(async {
        let mut stream = connect(&sluice).await;
        let mut pending = Vec::new();
        // Served on the fast path first…
        stream
            .write_all(b"GET /one HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .expect("write");
        assert_eq!(read_raw(&mut stream, &mut pending, false).await.json()["path"], "/one");
        // …then a chunked request body hands the connection to hyper…
        stream
            .write_all(
                b"POST /things/two HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n\
                  4\r\n{\"n\"\r\n4\r\n:7}\n\r\n0\r\n\r\n",
            )
            .await
            .expect("write");
        let two = read_raw(&mut stream, &mut pending, false).await;
        assert_eq!(two.status, 200);
        assert_eq!(two.json()["body"]["n"], 7);
        assert!(two.head.contains("x-ratelimit-limit: "), "{}", two.head);
        // …which serves what follows.
        stream
            .write_all(b"GET /three HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .expect("write");
        assert_eq!(read_raw(&mut stream, &mut pending, false).await.json()["path"], "/three");

        // Expect: 100-continue gets its interim answer, then the real one.
        let mut stream = connect(&sluice).await;
        let mut pending = Vec::new();
        stream
            .write_all(b"POST /things/four HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\ncontent-length: 8\r\n\r\n")
            .await
            .expect("write");
        assert_eq!(read_raw(&mut stream, &mut pending, false).await.status, 100);
        stream.write_all(b"{\"n\":4}\n").await.expect("write");
        let four = read_raw(&mut stream, &mut pending, false).await;
        assert_eq!(four.json()["body"]["n"], 4);

        // HTTP/1.0.
        let mut stream = connect(&sluice).await;
        stream
            .write_all(b"GET /five HTTP/1.0\r\n\r\n")
            .await
            .expect("write");
        let mut pending = Vec::new();
        let five = read_raw(&mut stream, &mut pending, false).await;
        assert!(five.head.starts_with("http/1.0 200"), "{}", five.head);
        assert_eq!(five.json()["path"], "/five");
    })
    .await;
}

/// An upstream that answers its n-th request (counted over all connections) with
/// `answers[n]`, then closes the connection when that answer has no length of its
/// own; counts the connections it accepted.
async fn scripted_upstream(answers: Vec<&'static str>) -> (String, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let accepted = Arc::new(AtomicUsize::new(0));
    let served = Arc::new(AtomicUsize::new(0));
    let answers = Arc::new(answers);
    let count = Arc::clone(&accepted);
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            count.fetch_add(1, Ordering::SeqCst);
            let (served, answers) = (Arc::clone(&served), Arc::clone(&answers));
            tokio::spawn(async move {
                let mut pending = Vec::new();
                loop {
                    let Some(end) = read_request_head(&mut stream, &mut pending).await else {
                        return;
                    };
                    pending.drain(..end);
                    let n = served.fetch_add(1, Ordering::SeqCst);
                    let answer = answers
                        .get(n)
                        .copied()
                        .unwrap_or("HTTP/1.1 500 x\r\ncontent-length: 0\r\n\r\n");
                    if stream.write_all(answer.as_bytes()).await.is_err() {
                        return;
                    }
                    if answer.contains("connection: close") || answer.contains("close-delimited") {
                        return;
                    }
                }
            });
        }
    });
    (format!("http://{addr}"), accepted)
}

#[tokio::test]
async fn every_upstream_framing_is_relayed_and_kept_alive_connections_reused() {
    let (upstream, accepted) = scripted_upstream(vec![
        // Chunked, with a trailer field.
        "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-type: text/plain\r\n\r\n\
         5\r\nhello\r\n7;ext=1\r\n, world\r\n0\r\nx-digest: abc\r\n\r\n",
        // A length, on the same upstream connection; its own rate-limit field is replaced.
        "HTTP/1.1 201 Created\r\ncontent-length: 3\r\nx-up: 1\r\nX-RateLimit-Limit: 5\r\n\r\nabc",
        // To the close.
        "HTTP/1.1 200 OK\r\nx-kind: close-delimited\r\n\r\nuntil the end",
        // A new upstream connection after that close.
        "HTTP/1.1 204 No Content\r\n\r\n",
    ])
    .await;
    let sluice = Sluice::spawn(&["--upstream", &upstream]);
    bounded(async {
        let mut stream = connect(&sluice).await;
        let mut pending = Vec::new();
        let chunked = ask(&mut stream, &mut pending, "/1").await;
        assert_eq!(chunked.status, 200);
        assert_eq!(chunked.body, b"hello, world");
        assert!(
            chunked.head.contains("x-ratelimit-remaining: "),
            "{}",
            chunked.head
        );
        let length = ask(&mut stream, &mut pending, "/2").await;
        assert_eq!((length.status, length.body.as_slice()), (201, &b"abc"[..]));
        assert!(length.head.contains("x-up: 1"), "{}", length.head);
        assert_eq!(
            length.head.matches("x-ratelimit-limit: ").count(),
            1,
            "{}",
            length.head
        );
        assert!(
            !length.head.contains("x-ratelimit-limit: 5\r"),
            "{}",
            length.head
        );
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            1,
            "the connection was reused"
        );

        // The body that ran to the upstream's close reaches the client chunked, and the
        // client's connection goes on (on a new upstream connection).
        let to_close = ask(&mut stream, &mut pending, "/3").await;
        assert_eq!(to_close.body, b"until the end");
        assert!(
            to_close.head.contains("transfer-encoding: chunked")
                && !to_close.head.contains("connection: close"),
            "{}",
            to_close.head
        );
        let empty = ask(&mut stream, &mut pending, "/4").await;
        assert_eq!(empty.status, 204);
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    })
    .await;
}

#[tokio::test]
async fn a_kept_alive_connection_the_upstream_closed_is_not_a_502() {
    // Each answer says it keeps the connection, then the upstream closes it anyway.
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = Arc::clone(&accepted);
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            count.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                if read_request_head(&mut stream, &mut Vec::new())
                    .await
                    .is_none()
                {
                    return;
                }
                let _ = stream
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                    .await;
            });
        }
    });
    let sluice = Sluice::spawn(&["--upstream", &format!("http://{addr}")]);
    bounded(async {
        for round in 1..=3 {
            let mut stream = connect(&sluice).await;
            let mut pending = Vec::new();
            stream
                .write_all(b"GET /again HTTP/1.1\r\nhost: x\r\n\r\n")
                .await
                .expect("write");
            let reply = read_raw(&mut stream, &mut pending, false).await;
            assert_eq!(
                (reply.status, reply.body.as_slice()),
                (200, &b"ok"[..]),
                "round {round}"
            );
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 3);
    })
    .await;
}

#[tokio::test]
async fn a_client_that_leaves_a_stream_releases_the_upstream_connection() {
    // An upstream that sends one event of an endless stream, then waits for the
    // gateway to close the connection.
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (closed, mut upstream_closed) = tokio::sync::mpsc::channel(1);
    tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.expect("accept");
        let mut chunk = [0u8; 4096];
        let _ = stream.read(&mut chunk).await;
        stream
            .write_all(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
                  transfer-encoding: chunked\r\n\r\n9\r\ndata: 1\n\n\r\n",
            )
            .await
            .expect("write");
        // Nothing more is sent; the read ends when the gateway lets go.
        while matches!(stream.read(&mut chunk).await, Ok(n) if n > 0) {}
        let _ = closed.send(()).await;
    });
    let sluice = Sluice::spawn(&["--upstream", &format!("http://{addr}")]);
    bounded(async {
        let mut stream = connect(&sluice).await;
        stream
            .write_all(b"GET /events HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .expect("write");
        let mut seen = Vec::new();
        while !seen.windows(7).any(|w| w == b"data: 1") {
            let mut chunk = [0u8; 4096];
            let n = stream.read(&mut chunk).await.expect("read");
            assert!(n > 0, "closed before the first event");
            seen.extend_from_slice(&chunk[..n]);
        }
        drop(stream);
        upstream_closed
            .recv()
            .await
            .expect("the upstream connection was closed");
    })
    .await;
}

#[tokio::test]
async fn an_upstream_head_past_the_bound_is_a_502() {
    // Fields without end, never the blank line: the gateway stops reading at its bound.
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.expect("accept");
        let mut chunk = [0u8; 4096];
        let _ = stream.read(&mut chunk).await;
        let _ = stream.write_all(b"HTTP/1.1 200 OK\r\n").await;
        let field = b"x-filler: 0123456789012345678901234567890123456789\r\n";
        for _ in 0..10_000 {
            if stream.write_all(field).await.is_err() {
                return;
            }
        }
        // Held open: only the gateway's bound ends the exchange.
        let _ = stream.read(&mut chunk).await;
    });
    let sluice = Sluice::spawn(&["--upstream", &format!("http://{addr}")]);
    bounded(async {
        let mut stream = connect(&sluice).await;
        let mut pending = Vec::new();
        let reply = ask(&mut stream, &mut pending, "/big-head").await;
        assert_eq!(reply.status, 502, "{}", reply.head);
        assert_eq!(reply.json()["error"]["code"], "bad_gateway");
    })
    .await;
}

/// An upstream that refuses every upload with 413 as soon as it has its head; it
/// then reads on without closing when `reads_on`, else closes unread.
async fn refusing_on_the_head(reads_on: bool) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                if read_request_head(&mut stream, &mut Vec::new())
                    .await
                    .is_none()
                {
                    return;
                }
                let _ = stream
                    .write_all(
                        b"HTTP/1.1 413 Payload Too Large\r\ncontent-length: 8\r\n\r\ntoo big!",
                    )
                    .await;
                let mut chunk = [0u8; 4096];
                while reads_on && matches!(stream.read(&mut chunk).await, Ok(n) if n > 0) {}
            });
        }
    });
    format!("http://{addr}")
}

#[tokio::test]
async fn an_upstream_that_answers_before_the_whole_body_is_relayed() {
    for reads_on in [true, false] {
        let sluice = Sluice::spawn(&["--upstream", &refusing_on_the_head(reads_on).await]);
        bounded(async {
            // A million bytes announced, ten sent: streamed (through hyper), the
            // answer must not wait for the rest; the connection ends after it.
            let mut stream = connect(&sluice).await;
            stream
                .write_all(
                    b"PUT /upload HTTP/1.1\r\nhost: x\r\ncontent-length: 1000000\r\n\r\n0123456789",
                )
                .await
                .expect("write");
            let mut pending = Vec::new();
            let reply = read_raw(&mut stream, &mut pending, false).await;
            assert_eq!(
                (reply.status, reply.body.as_slice()),
                (413, &b"too big!"[..]),
                "{}",
                reply.head
            );
            assert!(reply.head.contains("x-ratelimit-limit: "), "{}", reply.head);
            assert!(reply.head.contains("date: "), "{}", reply.head);
            assert!(reply.head.contains("connection: close"), "{}", reply.head);
            let mut rest = Vec::new();
            let _ = stream.read_to_end(&mut rest).await;
            assert!(rest.is_empty() && pending.is_empty(), "{rest:?}");

            // A body the fast path takes in whole: sent in one write, the upstream's
            // answer relayed whether or not it read the body.
            let mut stream = connect(&sluice).await;
            let body = vec![b'u'; 40_000];
            let head = format!(
                "PUT /upload HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n",
                body.len()
            );
            stream.write_all(head.as_bytes()).await.expect("write");
            stream.write_all(&body).await.expect("write");
            let reply = read_raw(&mut stream, &mut pending, false).await;
            assert_eq!(
                (reply.status, reply.body.as_slice()),
                (413, &b"too big!"[..]),
                "{}",
                reply.head
            );
            assert!(reply.head.contains("x-ratelimit-limit: "), "{}", reply.head);
        })
        .await;
    }
}

/// An upstream that answers `early` (an interim or a final head) as soon as it has a
/// request's head, then reads the whole body it announced, then sends `rest`.
async fn answering_before_the_body(early: &'static str, rest: &'static str) -> String {
    let listener = small_buffer_listener();
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut got = Vec::new();
                let Some(end) = read_request_head(&mut stream, &mut got).await else {
                    return;
                };
                let mut chunk = [0u8; 4096];
                let head = String::from_utf8_lossy(&got[..end]).to_ascii_lowercase();
                let length: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length: "))
                    .and_then(|n| n.trim().parse().ok())
                    .expect("a length");
                stream.write_all(early.as_bytes()).await.expect("write");
                while got.len() < end + length {
                    match stream.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => got.extend_from_slice(&chunk[..n]),
                    }
                }
                let _ = stream.write_all(rest.as_bytes()).await;
            });
        }
    });
    format!("http://{addr}")
}

/// Upload sizes: one the fast path takes in whole before it forwards, one that streams
/// through hyper.
const UPLOADS: [usize; 2] = [30_000, 100_000];

/// Sends an upload of `size` bytes in ten pieces and reads the answer.
async fn upload(sluice: &Sluice, size: usize) -> Raw {
    let mut stream = connect(sluice).await;
    let head = format!("PUT /upload HTTP/1.1\r\nhost: x\r\ncontent-length: {size}\r\n\r\n");
    stream.write_all(head.as_bytes()).await.expect("write");
    for piece in vec![b'u'; size].chunks(size / 10) {
        tokio::task::yield_now().await;
        stream.write_all(piece).await.expect("write");
    }
    let mut pending = Vec::new();
    read_raw(&mut stream, &mut pending, false).await
}

/// The answers to an upload of each of [`UPLOADS`], then of a [`BIG_JSONRPC`] body
/// (which cannot be written in whole before the upstream answers), to an upstream
/// that answers `early` on the head and `rest` once it has the whole body.
async fn uploads_answered_early(early: &'static str, rest: &'static str) -> Vec<(usize, Raw)> {
    let upstream = answering_before_the_body(early, rest).await;
    let mut replies = Vec::new();
    let sluice = Sluice::spawn(&["--upstream", &upstream]);
    bounded(async {
        for size in UPLOADS {
            replies.push((size, upload(&sluice, size).await));
        }
    })
    .await;
    let sluice = sluice_for_big_bodies(&upstream);
    let (reply, _) = bounded(big_jsonrpc_upload(&sluice)).await;
    replies.push((BIG_JSONRPC, reply));
    replies
}

#[tokio::test]
async fn an_interim_answer_does_not_stop_the_upload() {
    let replies = uploads_answered_early(
        "HTTP/1.1 103 Early Hints\r\nlink: </a.css>\r\n\r\n",
        "HTTP/1.1 200 OK\r\ncontent-length: 8\r\n\r\nall read",
    )
    .await;
    for (size, reply) in replies {
        assert_eq!(
            (reply.status, reply.body.as_slice()),
            (200, &b"all read"[..]),
            "{size}"
        );
        if size != BIG_JSONRPC {
            assert!(!reply.head.contains("connection: close"), "{}", reply.head);
        }
    }
}

#[tokio::test]
async fn an_upstream_that_accepts_early_still_gets_the_whole_body() {
    // The head and the first chunk before the body is in, the last chunk after.
    let replies = uploads_answered_early(
        "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n6\r\nstart \r\n",
        "8\r\nall read\r\n0\r\n\r\n",
    )
    .await;
    for (size, reply) in replies {
        assert_eq!(
            (reply.status, reply.body.as_slice()),
            (200, &b"start all read"[..]),
            "{size}"
        );
    }
}

/// A client that leaves in the middle of a streamed upload: its request is counted as
/// a body that could not be read (400), not as an upstream failure (502).
#[tokio::test]
async fn a_client_that_leaves_mid_upload_is_not_an_upstream_failure() {
    // An upstream that reads whatever comes and never answers.
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut sink = Vec::new();
                let _ = stream.read_to_end(&mut sink).await;
            });
        }
    });
    let sluice = Sluice::spawn(&["--upstream", &format!("http://{addr}")]);
    bounded(async {
        // Streamed through hyper (chunked), then the client stops sending.
        let mut stream = connect(&sluice).await;
        stream
            .write_all(
                b"PUT /upload HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n",
            )
            .await
            .expect("write");
        stream.shutdown().await.expect("half-close");
        let mut answer = Vec::new();
        let _ = stream.read_to_end(&mut answer).await;
        // Counted once the proxy has given up on the upstream request.
        let metrics = loop {
            let text = support::get(&sluice.admin_url("/metrics")).await.text();
            if text.contains("sluice_requests_total{status=\"400\"} 1") {
                break text;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        let counted = |status: &str| {
            metrics
                .lines()
                .find_map(|l| l.strip_prefix(&format!("sluice_requests_total{{status=\"{status}\"}} ")))
                .map(str::to_owned)
        };
        assert_eq!(counted("502").as_deref().unwrap_or("0"), "0", "{metrics}");
    })
    .await;
}

/// A loopback listener whose connections take little before their reader reads: a
/// request body of [`BIG_JSONRPC`] bytes cannot be written to one in whole unread.
fn small_buffer_listener() -> TcpListener {
    let socket =
        socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).expect("socket");
    socket.set_recv_buffer_size(4096).expect("small buffer");
    let addr: std::net::SocketAddr = "127.0.0.1:0".parse().expect("addr");
    socket.bind(&addr.into()).expect("bind");
    socket.listen(8).expect("listen");
    socket.set_nonblocking(true).expect("nonblocking");
    TcpListener::from_std(socket.into()).expect("listener")
}

/// Size of the JSON-RPC bodies that no socket buffers hold (the fast path reads them
/// in whole to classify them, then writes them upstream).
const BIG_JSONRPC: usize = 32 << 20;

/// `sluice serve` in front of `upstream` with the default policy, which reads JSON-RPC
/// bodies of up to 64 MiB to classify them.
fn sluice_for_big_bodies(upstream: &str) -> Sluice {
    let policy = std::env::temp_dir().join(format!("sluice-http1-{}.yaml", std::process::id()));
    let yaml = sluice_policy::DEFAULT_POLICY_YAML
        .edit("max_body_bytes: 1048576", "max_body_bytes: 67108864");
    std::fs::write(&policy, yaml).expect("write policy");
    Sluice::spawn(&[
        "--upstream",
        upstream,
        "--config",
        policy.to_str().expect("utf-8 path"),
    ])
}

/// Sends a JSON-RPC call of [`BIG_JSONRPC`] bytes on a new connection and reads the
/// answer.
async fn big_jsonrpc_upload(sluice: &Sluice) -> (Raw, TcpStream) {
    let body = format!(
        "{{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"tools/list\",\"params\":{{\"pad\":\"{}\"}}}}",
        "z".repeat(BIG_JSONRPC)
    );
    let head = format!(
        "POST /mcp HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    let mut stream = connect(sluice).await;
    stream.write_all(head.as_bytes()).await.expect("write");
    stream.write_all(body.as_bytes()).await.expect("write");
    let mut pending = Vec::new();
    let reply = read_raw(&mut stream, &mut pending, false).await;
    assert!(pending.is_empty(), "{pending:?}");
    (reply, stream)
}

/// A JSON-RPC body too large for any socket buffers, to an upstream that answers 413
/// as soon as it has the head and then neither reads nor closes: the answer is relayed
/// at once (not a 504 once the write has waited out the upstream timeout).
#[tokio::test]
async fn an_upstream_that_refuses_and_stops_reading_is_relayed_while_the_body_goes_up() {
    let listener = small_buffer_listener();
    let addr = listener.local_addr().expect("addr");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        let Ok((mut stream, _)) = listener.accept().await else {
            return;
        };
        if read_request_head(&mut stream, &mut Vec::new())
            .await
            .is_some()
        {
            let _ = stream
                .write_all(b"HTTP/1.1 413 Payload Too Large\r\ncontent-length: 8\r\n\r\ntoo big!")
                .await;
        }
        // Holds the connection open, reading nothing, until the test ends.
        let _ = stopped.await;
    });
    let sluice = sluice_for_big_bodies(&format!("http://{addr}"));
    bounded(async {
        let (reply, mut stream) = big_jsonrpc_upload(&sluice).await;
        assert_eq!(
            (reply.status, reply.body.as_slice()),
            (413, &b"too big!"[..]),
            "{}",
            reply.head
        );
        assert!(reply.head.contains("connection: close"), "{}", reply.head);
        let mut rest = Vec::new();
        let _ = stream.read_to_end(&mut rest).await;
        assert!(rest.is_empty(), "{rest:?}");
    })
    .await;
    let _ = stop.send(());
}

/// An upstream that answers every request with the head it received.
async fn echo_upstream() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut pending = Vec::new();
                while let Some(end) = read_request_head(&mut stream, &mut pending).await {
                    let head: Vec<u8> = pending.drain(..end).collect();
                    let answer =
                        format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n", head.len());
                    if stream.write_all(answer.as_bytes()).await.is_err()
                        || stream.write_all(&head).await.is_err()
                    {
                        return;
                    }
                }
            });
        }
    });
    format!("http://{addr}")
}

/// What an [`echo_upstream`] behind `sluice` received of a `GET /search/fields`
/// sent in `version` with `fields` (lower case).
async fn forwarded_head(sluice: &Sluice, version: &str, fields: &str) -> String {
    let mut stream = connect(sluice).await;
    let request = format!("GET /search/fields {version}\r\nhost: x\r\n{fields}\r\n");
    stream.write_all(request.as_bytes()).await.expect("write");
    let raw = read_raw(&mut stream, &mut Vec::new(), false).await;
    let echoed = String::from_utf8_lossy(&raw.body).to_ascii_lowercase();
    assert_eq!(raw.status, 200, "{version}: {echoed}");
    echoed
}

/// SPEC's contract with the upstream: a client's `Connection` naming the fields
/// sluice sets (its identity, the request id) removes none of them, on the fast
/// path and on the path hyper serves (HTTP/1.0 here).
#[tokio::test]
async fn connection_never_removes_the_fields_sluice_sets() {
    bounded(async {
        let upstream = echo_upstream().await;
        let sluice = Sluice::spawn(&["--upstream", &upstream]);
        for version in ["HTTP/1.1", "HTTP/1.0"] {
            let echoed = forwarded_head(
                &sluice,
                version,
                "x-api-key: sk-conn\r\nconnection: X-Sluice-Workspace, x-sluice-user,X-Request-Id , keep-alive\r\n",
            )
            .await;
            for field in ["x-sluice-workspace: key:", "x-sluice-user: key:", "x-request-id: "] {
                assert!(echoed.contains(field), "{version}: {field} went missing: {echoed}");
            }
        }
    })
    .await;
}

/// A field spelled with `_` for one sluice reads or sets (`X_API_KEY`,
/// `X_Sluice_Workspace`, `X_Forwarded_For`) never reaches the upstream, on either
/// path: a server that maps names CGI-style would read it as the field sluice did
/// not count or set. Other underscore fields pass.
#[tokio::test]
async fn an_underscore_spelling_of_a_field_sluice_reads_or_sets_is_not_forwarded() {
    bounded(async {
        let upstream = echo_upstream().await;
        let sluice = Sluice::spawn(&["--upstream", &upstream]);
        for version in ["HTTP/1.1", "HTTP/1.0"] {
            let echoed = forwarded_head(
                &sluice,
                version,
                "x-api-key: sk-under\r\nX_API_KEY: sk-real\r\nX_Sluice_Workspace: victim\r\nx_forwarded_for: 198.51.100.1\r\nX_Request_Id: spoofed\r\nmy_field: kept\r\n",
            )
            .await;
            for gone in ["x_api_key", "x_sluice_workspace", "x_forwarded_for", "x_request_id", "victim", "sk-real"] {
                assert!(!echoed.contains(gone), "{version}: {gone} was forwarded: {echoed}");
            }
            assert!(echoed.contains("my_field: kept"), "{version}: {echoed}");
        }
    })
    .await;
}

/// The upstream's `X-Sluice-*` fields are its signals to sluice: none reaches the
/// client, on either path (SPEC: the contract with the upstream).
#[tokio::test]
async fn the_upstream_s_sluice_fields_never_reach_the_client() {
    bounded(async {
        let answer = "HTTP/1.1 200 OK\r\ncontent-length: 2\r\nx-sluice-workspace: leaked\r\nX-Sluice-User: leaked\r\nx-sluice-exhausted: up\r\nX-Sluice-Cost: 1\r\n\r\nok";
        let (upstream, _) = scripted_upstream(vec![answer, answer]).await;
        let sluice = Sluice::spawn(&["--upstream", &upstream]);
        for version in ["HTTP/1.1", "HTTP/1.0"] {
            let mut stream = connect(&sluice).await;
            let request = format!("GET /search/fields {version}\r\nhost: x\r\nx-api-key: sk-up\r\n\r\n");
            stream.write_all(request.as_bytes()).await.expect("write");
            let raw = read_raw(&mut stream, &mut Vec::new(), false).await;
            assert_eq!(raw.status, 200, "{version}: {}", raw.head);
            assert!(!raw.head.contains("x-sluice-"), "{version}: {}", raw.head);
        }
    })
    .await;
}

/// SPEC Q2, never charged less than the upstream said: an `X-Sluice-Cost` sent
/// twice is charged its larger value, and a fraction is rounded up (`2.5` is 3),
/// on the fast path (HTTP/1.1) and through hyper (HTTP/1.0) alike. Before, the
/// first field counted and `2.5` was charged as an absent cost, 1.
#[tokio::test]
async fn q2_a_cost_sent_twice_or_as_a_fraction_is_never_charged_less() {
    bounded(async {
        let twice = "HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\nx-sluice-cost: 2\r\nX-Sluice-Cost: 5\r\n\r\nok";
        let fraction = "HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\nx-sluice-cost: 2.5\r\n\r\nok";
        for version in ["HTTP/1.1", "HTTP/1.0"] {
            let (upstream, _) = scripted_upstream(vec![twice, fraction]).await;
            let sluice = Sluice::spawn(&["--upstream", &upstream]);
            // The budget's 10 units: 5 spent by the first, 3 by the second.
            for (answer, left) in [(twice, "5"), (fraction, "2")] {
                let mut stream = connect(&sluice).await;
                let body = r#"{"sql":"select 1"}"#;
                let request = format!(
                    "POST /search/query {version}\r\nhost: x\r\nx-api-key: sk-cost\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                );
                stream.write_all(request.as_bytes()).await.expect("write");
                let raw = read_raw(&mut stream, &mut Vec::new(), false).await;
                assert_eq!(raw.status, 200, "{version}: {}", raw.head);
                assert!(
                    raw.head.contains(&format!("\r\nx-ratelimit-remaining: {left}\r\n")),
                    "{version}, {answer:?}: {}",
                    raw.head
                );
                assert!(!raw.head.contains("x-sluice-cost"), "{}", raw.head);
            }
        }
    })
    .await;
}

/// RFC 9112 §6.1: a transfer coding sluice does not understand (one before
/// `chunked`, in one field or two, or `chunked` twice) is answered 501 and never
/// forwarded — hyper would take the chunks off and the upstream get the gzip bytes
/// labelled plain `chunked`. `chunked` alone, in any case, is forwarded.
#[tokio::test]
async fn a_transfer_coding_but_chunked_is_refused_501_and_never_forwarded() {
    let (upstream, accepted) =
        scripted_upstream(vec!["HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"]).await;
    let sluice = Sluice::spawn(&["--upstream", &upstream]);
    bounded(async {
        for codings in [
            "transfer-encoding: gzip, chunked\r\n",
            "Transfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n",
            "transfer-encoding: chunked, chunked\r\n",
        ] {
            let mut client = connect(&sluice).await;
            let request =
                format!("POST /x HTTP/1.1\r\nhost: x\r\n{codings}\r\n5\r\nhello\r\n0\r\n\r\n");
            client.write_all(request.as_bytes()).await.expect("write");
            let refused = read_raw(&mut client, &mut Vec::new(), false).await;
            assert_eq!(refused.status, 501, "{codings:?}: {}", refused.head);
            let details = &refused.json()["error"]["details"];
            assert_eq!(details["reason"], "transfer_coding", "{codings:?}");
            assert_eq!(details["transfer_codings"][0], "chunked");
        }
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            0,
            "nothing reached the upstream"
        );
        let mut client = connect(&sluice).await;
        client
            .write_all(b"POST /x HTTP/1.1\r\nhost: x\r\ntransfer-encoding:  Chunked \r\n\r\n5\r\nhello\r\n0\r\n\r\n")
            .await
            .expect("write");
        let forwarded = read_raw(&mut client, &mut Vec::new(), false).await;
        assert_eq!(forwarded.status, 200, "{}", forwarded.head);
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
    })
    .await;
}
