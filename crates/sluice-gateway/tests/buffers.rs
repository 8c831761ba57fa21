//! Issue 23, item 4 (SPEC S, E5): request bodies taken in whole before a decision
//! are counted against `--max-buffered-bytes` as they are held, on both HTTP/1.1
//! paths of one gateway (the fast path takes a `Content-Length` body; a chunked body
//! is left to hyper and the service stack), and one client address holds at most its
//! share of the bound while another address is served. Raw loopback sockets; "another
//! address" is another address of 127/8, which Linux routes to lo.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use sluice_edge::{BufferBudget, Holder};
use sluice_gateway::{Gateway, GatewayConfig};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpSocket, TcpStream};

/// Bound on every test's whole body.
const TEST_TIMEOUT: Duration = Duration::from_secs(60);

/// The policy's `limits.max_body_bytes` (the default policy's): the longest JSON-RPC
/// body, and what the service stack leases for a body that announces no length.
const MAX_BODY: usize = 1 << 20;

/// Bound on buffered bytes in these tests.
const BOUND: usize = 8 << 20;

async fn bounded<F: Future>(test: F) -> F::Output {
    tokio::time::timeout(TEST_TIMEOUT, test)
        .await
        .expect("test timed out")
}

/// Which of the gateway's HTTP/1.1 paths serves a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path {
    /// The fast path: the body framed by `Content-Length`.
    Fast,
    /// hyper and the service stack: the body is chunked, which the fast path leaves
    /// to hyper.
    Hyper,
}

const BOTH: [Path; 2] = [Path::Fast, Path::Hyper];

/// A gateway with the built-in policy (trusting `trusted` as proxies) in front of the
/// built-in demo, `share` of an 8 MiB bound per client.
async fn gateway(share: f64, trusted: &str) -> (Gateway, tempdir::Dir) {
    let yaml = sluice_policy::DEFAULT_POLICY_YAML.replace(
        "trusted_proxies: []",
        &format!("trusted_proxies: [{trusted}]"),
    );
    let policy =
        sluice_policy::parse_str(&yaml, std::path::Path::new("test.yaml")).expect("policy");
    let dir = tempdir::Dir::new();
    let mut config = GatewayConfig::new(policy, dir.0.clone());
    config.workers = std::num::NonZeroUsize::new(2).expect("two");
    config.max_buffered_bytes = BOUND;
    config.max_buffered_share = share;
    let gateway = Gateway::start(config).await.expect("gateway starts");
    (gateway, dir)
}

mod tempdir {
    /// A directory removed when dropped.
    pub(super) struct Dir(pub(super) std::path::PathBuf);

    impl Dir {
        pub(super) fn new() -> Dir {
            let n = std::sync::atomic::AtomicU64::new(0);
            let path = std::env::temp_dir().join(format!(
                "sluice-buffers-{}-{}-{}",
                std::process::id(),
                fastrand::u64(..),
                n.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            ));
            std::fs::create_dir_all(&path).expect("temp dir");
            Dir(path)
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// A connection to `gateway` from `source` (an address of 127/8).
async fn connect_from(source: &str, gateway: SocketAddr) -> TcpStream {
    let socket = TcpSocket::new_v4().expect("socket");
    let source: IpAddr = source.parse().expect("address");
    socket
        .bind(SocketAddr::new(source, 0))
        .expect("bind a loopback source");
    socket.connect(gateway).await.expect("connect")
}

/// A JSON-RPC `tools/call` of `search_fields` padded to exactly `len` bytes.
fn call_of(len: usize) -> Vec<u8> {
    let start = br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"search_fields","arguments":{"pad":""#;
    let end = br#""}}}"#;
    let mut body = start.to_vec();
    body.resize(len - end.len(), b'x');
    body.extend_from_slice(end);
    body
}

/// The head of a `POST /mcp` of `len` bytes on `path` (extra fields before it).
fn head(path: Path, len: usize, extra: &str) -> Vec<u8> {
    let framing = match path {
        Path::Fast => format!("content-length: {len}"),
        Path::Hyper => "transfer-encoding: chunked".to_owned(),
    };
    format!(
        "POST /mcp HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n{extra}{framing}\r\n\r\n"
    )
    .into_bytes()
}

/// `bytes` of a body as `path` frames it (chunked: one chunk; `last`: the end too).
fn framed(path: Path, bytes: &[u8], last: bool) -> Vec<u8> {
    match path {
        Path::Fast => bytes.to_vec(),
        Path::Hyper => {
            let mut out = format!("{:x}\r\n", bytes.len()).into_bytes();
            out.extend_from_slice(bytes);
            out.extend_from_slice(b"\r\n");
            if last {
                out.extend_from_slice(b"0\r\n\r\n");
            }
            out
        }
    }
}

/// Waits until `done` holds of the budget (it changes as the gateway reads), then
/// returns what is used.
async fn until(budget: &BufferBudget, done: impl Fn(&BufferBudget) -> bool) -> usize {
    while !done(budget) {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    budget.used()
}

/// The status and the body of the answer on `stream`, read to its end.
async fn answer(stream: &mut TcpStream) -> (u16, String, String) {
    let mut got = Vec::new();
    let _ = stream.read_to_end(&mut got).await;
    let text = String::from_utf8_lossy(&got).into_owned();
    let status = text.get(9..12).and_then(|s| s.parse().ok()).unwrap_or(0);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    (status, head.to_ascii_lowercase(), body.to_owned())
}

/// The holder the gateway charges a request from `addr` (no trusted proxy).
fn holder(addr: &str) -> Holder {
    let policy = sluice_policy::default_policy().expect("default policy");
    Holder::of(&policy.identity.ip_subject(addr.parse().expect("address")))
}

/// A 1 MiB JSON-RPC body held unfinished is counted as it is held: on the fast path
/// what has arrived (its pieces, each leased before it is allocated: at most one
/// 64 KiB piece more than arrived), on the service stack the policy's bound its
/// pieces stay within, and the read buffer it arrives through; once whole it is forwarded and all of it is given
/// back. A second copy, a buffer grown by doubling, or a read buffer not counted
/// would show here as held bytes past what is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e5_buffered_bodies_hold_at_most_their_bound_on_both_paths() {
    bounded(async {
        let (gateway, _dir) = gateway(1.0, "").await;
        let budget = Arc::clone(gateway.buffers());
        let body = call_of(MAX_BODY);
        for path in BOTH {
            let mut client = connect_from("127.0.0.1", gateway.addr().expect("a gateway")).await;
            client
                .write_all(&head(path, body.len(), "connection: close\r\n"))
                .await
                .expect("head");
            let mut sent = 0;
            for part in [300 << 10, 700 << 10] {
                client
                    .write_all(&framed(path, &body[sent..part], false))
                    .await
                    .expect("part");
                sent = part;
                let used = match path {
                    Path::Fast => until(&budget, |b| b.used() >= sent).await,
                    Path::Hyper => until(&budget, |b| b.used() > 0).await,
                };
                match path {
                    // Pieces: what arrived, and at most the piece being filled.
                    Path::Fast => assert!(
                        used <= sent + (64 << 10),
                        "{path:?}: {used} counted for {sent} held"
                    ),
                    // The bound, and hyper's read buffer, counted at once.
                    Path::Hyper => assert_eq!(
                        used,
                        MAX_BODY + sluice_edge::READ_BUFFER_ALLOWANCE,
                        "{path:?}"
                    ),
                }
                assert!(used <= BOUND);
            }
            client
                .write_all(&framed(path, &body[sent..], true))
                .await
                .expect("the rest");
            let (status, _, answered) = answer(&mut client).await;
            assert_eq!(status, 200, "{path:?}: {answered:.200}");
            assert_eq!(until(&budget, |b| b.used() == 0).await, 0, "{path:?}");
            assert_eq!(budget.holders(), 0, "{path:?}: no client left in the table");
        }
        gateway.shutdown().await;
    })
    .await;
}

/// One address holding its share (1/8 of the bound: 1 MiB here) of unfinished bodies
/// is answered 503 with `Retry-After` for its next body, on either path, while a
/// whole call from another address is served; once it lets go, it is served again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e5_one_address_past_its_buffered_share_is_refused_while_another_is_served() {
    bounded(async {
        let (gateway, _dir) = gateway(0.125, "").await;
        let budget = Arc::clone(gateway.buffers());
        assert_eq!(budget.share(), MAX_BODY);
        let body = call_of(MAX_BODY);
        let (one, other) = ("127.0.0.2", "127.0.0.3");
        for path in BOTH {
            // Its whole share, but the last byte: held.
            let mut holding = connect_from(one, gateway.addr().expect("a gateway")).await;
            holding
                .write_all(&head(path, body.len(), ""))
                .await
                .expect("head");
            holding
                .write_all(&framed(path, &body[..body.len() - 1], false))
                .await
                .expect("body");
            until(&budget, |b| b.held_by(holder(one)) >= body.len() - 1).await;

            // Its next body: refused as the bound refuses, past the connection's own
            // buffer (the answer comes before the reset that its unread rest causes).
            let mut refused = connect_from(one, gateway.addr().expect("a gateway")).await;
            let next = call_of(64 << 10);
            refused
                .write_all(&head(path, next.len(), "connection: close\r\n"))
                .await
                .expect("head");
            let _ = refused.write_all(&framed(path, &next, true)).await;
            let (status, fields, answered) = answer(&mut refused).await;
            assert_eq!(status, 503, "{path:?}: {answered}");
            assert!(fields.contains("\r\nretry-after: 1"), "{path:?}: {fields}");
            let envelope: serde_json::Value = serde_json::from_str(&answered).expect("json");
            assert_eq!(envelope["error"]["code"], "busy", "{path:?}");
            assert_eq!(envelope["error"]["details"]["reason"], "client_share");

            // Another address: served, its body counted as its own.
            let mut served = connect_from(other, gateway.addr().expect("a gateway")).await;
            let call = call_of(256 << 10);
            served
                .write_all(&head(path, call.len(), "connection: close\r\n"))
                .await
                .expect("head");
            served
                .write_all(&framed(path, &call, true))
                .await
                .expect("body");
            let (status, _, answered) = answer(&mut served).await;
            assert_eq!(status, 200, "{path:?}: {answered:.200}");

            // Let go: its entry leaves the table.
            drop(holding);
            assert_eq!(until(&budget, |b| b.used() == 0).await, 0);
            assert_eq!(budget.holders(), 0, "{path:?}");
        }
        gateway.shutdown().await;
    })
    .await;
}

/// Behind a trusted proxy, the share is the client's the proxy names: one client
/// holding its share does not make the proxy's other clients 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e4_e5_behind_a_trusted_proxy_each_client_has_its_own_buffered_share() {
    bounded(async {
        let (gateway, _dir) = gateway(0.125, "127.0.0.4").await;
        let budget = Arc::clone(gateway.buffers());
        let body = call_of(MAX_BODY);
        let proxy = "127.0.0.4";
        let mut holding = connect_from(proxy, gateway.addr().expect("a gateway")).await;
        holding
            .write_all(&head(
                Path::Fast,
                body.len(),
                "x-forwarded-for: 203.0.113.1\r\n",
            ))
            .await
            .expect("head");
        holding
            .write_all(&body[..body.len() - 1])
            .await
            .expect("body");
        until(&budget, |b| {
            b.held_by(holder("203.0.113.1")) >= body.len() - 1
        })
        .await;
        assert_eq!(budget.held_by(holder(proxy)), 0, "not charged to the proxy");

        let mut served = connect_from(proxy, gateway.addr().expect("a gateway")).await;
        let call = call_of(256 << 10);
        served
            .write_all(&head(
                Path::Fast,
                call.len(),
                "x-forwarded-for: 203.0.113.2\r\nconnection: close\r\n",
            ))
            .await
            .expect("head");
        served.write_all(&call).await.expect("body");
        let (status, _, answered) = answer(&mut served).await;
        assert_eq!(status, 200, "{answered:.200}");
        drop(holding);
        assert_eq!(until(&budget, |b| b.used() == 0).await, 0);
        gateway.shutdown().await;
    })
    .await;
}
