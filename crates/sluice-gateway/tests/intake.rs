//! Issue 40 (SPEC E4, E5): the gateway's two HTTP/1.1 paths — the fast path (a body
//! framed by `Content-Length`) and hyper with the tower layer (a chunked body, which
//! the fast path leaves to hyper) — go through one intake, so they refuse in one
//! order with one answer: a bad head first (before any of its body is read), then a
//! body past the policy's bound (413, once decided), then a body too slow to arrive
//! (408). Raw loopback sockets against a gateway with the built-in policy.

use std::net::SocketAddr;
use std::time::Duration;

use serde_json::Value;
use sluice_gateway::{Gateway, GatewayConfig};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

/// Bound on every test's whole body.
const TEST_TIMEOUT: Duration = Duration::from_secs(60);

/// The built-in policy's `limits.max_body_bytes`.
const MAX_BODY: usize = 1 << 20;

/// The body deadline of these gateways: short, so that a slow body is answered
/// within the test, and far longer than a loopback read.
const BODY_DEADLINE: Duration = Duration::from_secs(1);

/// Which of the gateway's HTTP/1.1 paths serves a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path {
    /// The fast path: the body framed by `Content-Length`.
    Fast,
    /// hyper and the tower layer: the body chunked.
    Hyper,
}

/// A gateway with the built-in policy in front of the built-in demo.
async fn gateway() -> (Gateway, std::path::PathBuf) {
    let policy = sluice_policy::default_policy().expect("policy");
    let dir = std::env::temp_dir().join(format!(
        "sluice-intake-{}-{}",
        std::process::id(),
        fastrand::u64(..)
    ));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let mut config = GatewayConfig::new(policy, dir.clone());
    config.workers = std::num::NonZeroUsize::new(2).expect("two");
    config.body_deadline = BODY_DEADLINE;
    (Gateway::start(config).await.expect("gateway starts"), dir)
}

/// A `POST /mcp` head with `len` body bytes as `path` frames them, and `host`.
fn head(path: Path, len: usize, host: bool) -> Vec<u8> {
    let framing = match path {
        Path::Fast => format!("content-length: {len}"),
        Path::Hyper => "transfer-encoding: chunked".to_owned(),
    };
    let host = if host { "host: x\r\n" } else { "" };
    format!("POST /mcp HTTP/1.1\r\n{host}content-type: application/json\r\n{framing}\r\n\r\n")
        .into_bytes()
}

/// `bytes` of a body as `path` frames them (never the end of a chunked body).
fn framed(path: Path, bytes: &[u8]) -> Vec<u8> {
    match path {
        Path::Fast => bytes.to_vec(),
        Path::Hyper => {
            let mut out = format!("{:x}\r\n", bytes.len()).into_bytes();
            out.extend_from_slice(bytes);
            out.extend_from_slice(b"\r\n");
            out
        }
    }
}

/// One answer on `stream`: its status and its JSON body (the body sized by its
/// `Content-Length`). `drip`: one byte of the body sent every 100 ms meanwhile.
async fn answer(stream: &mut TcpStream, path: Path, drip: bool) -> (u16, Value) {
    let mut got = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let text = String::from_utf8_lossy(&got).into_owned();
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let length: usize = head
                .to_ascii_lowercase()
                .lines()
                .find_map(|l| l.strip_prefix("content-length:")?.trim().parse().ok())
                .unwrap_or(0);
            if body.len() >= length {
                let status = text.get(9..12).and_then(|s| s.parse().ok()).unwrap_or(0);
                let json = serde_json::from_str(&body[..length]).unwrap_or(Value::Null);
                return (status, json);
            }
        }
        let read = async {
            if drip {
                tokio::time::sleep(Duration::from_millis(100)).await;
                let _ = stream.write_all(&framed(path, b" ")).await;
            }
            stream.read(&mut chunk).await
        };
        // A drip that is not answered yet goes on.
        match tokio::time::timeout(Duration::from_millis(150), read).await {
            Ok(Ok(0) | Err(_)) => return (0, Value::String(String::from_utf8_lossy(&got).into())),
            Ok(Ok(n)) => got.extend_from_slice(&chunk[..n]),
            Err(_) => {}
        }
    }
}

/// The scenarios, in the refusal order, with the status each must get.
async fn refusals(gateway: SocketAddr, path: Path) -> Vec<(&'static str, u16, Value)> {
    let mut seen = Vec::new();
    let oversize = vec![b' '; MAX_BODY + 1];
    // A bad head (no `Host`) with a body past the bound, of which nothing is sent
    // on the fast path: the head's refusal, at once.
    let mut c = TcpStream::connect(gateway).await.expect("connect");
    c.write_all(&head(path, MAX_BODY + 1, false))
        .await
        .expect("head");
    if path == Path::Hyper {
        let _ = c.write_all(&framed(path, &oversize)).await;
    }
    let (status, body) = answer(&mut c, path, false).await;
    seen.push(("bad head, oversize body", status, body));
    // A body past the bound, then nothing: 413 (decided), not 408.
    let mut c = TcpStream::connect(gateway).await.expect("connect");
    c.write_all(&head(path, MAX_BODY + 1, true))
        .await
        .expect("head");
    if path == Path::Hyper {
        let _ = c.write_all(&framed(path, &oversize)).await;
    }
    let (status, body) = answer(&mut c, path, false).await;
    seen.push(("oversize body, stalled", status, body));
    // A body within the bound that keeps coming, a byte at a time, past the
    // body deadline: 408.
    let mut c = TcpStream::connect(gateway).await.expect("connect");
    c.write_all(&head(path, 1000, true)).await.expect("head");
    let (status, body) = answer(&mut c, path, true).await;
    seen.push(("slow body", status, body));
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e5_both_paths_refuse_a_bad_head_then_an_oversize_body_then_a_slow_one_alike() {
    tokio::time::timeout(TEST_TIMEOUT, async {
        let (gateway, dir) = gateway().await;
        let addr = gateway.addr().expect("an address");
        let fast = refusals(addr, Path::Fast).await;
        let hyper = refusals(addr, Path::Hyper).await;
        for (want, ((what, status, body), (_, other_status, other_body))) in
            [400, 413, 408].into_iter().zip(fast.iter().zip(&hyper))
        {
            assert_eq!(*status, want, "{what} on the fast path: {body}");
            assert_eq!(*other_status, want, "{what} through hyper: {other_body}");
            assert_eq!(
                body["error"], other_body["error"],
                "{what}: the same answer"
            );
        }
        assert_eq!(fast[0].2["error"]["code"], "invalid_request");
        // A JSON-RPC route answers its parse error (the body was not read).
        assert_eq!(fast[1].2["error"]["code"], -32700);
        assert_eq!(fast[2].2["error"]["code"], "request_timeout");
        assert_eq!(fast[2].2["error"]["details"]["deadline_seconds"], 1.0);
        gateway.shutdown().await;
        let _ = std::fs::remove_dir_all(dir);
    })
    .await
    .expect("test timed out");
}
