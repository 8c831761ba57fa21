//! SPEC L1 and L3 over loopback: a lane's call takes its place once its body is
//! whole, so a client still sending one holds no place (slow uploads could
//! otherwise hold every place of the lane, or, cut at the lane's time, open its
//! breaker for every workspace).

use std::net::SocketAddr;
use std::time::Duration;

use sluice_gateway::{Gateway, GatewayConfig, Upstream};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};

const TEST_TIMEOUT: Duration = Duration::from_secs(60);

/// A lane of one place whose calls wait for it 15 s.
const POLICY: &str = r#"
profile: default
window_seconds: 3600
profiles:
  default:
    classes: { slow: 1000 }
lanes:
  slow_lane:
    global_in_flight: 1
    batch_reserve: 0
    wait_seconds: 15
    timeout_seconds: 60
    breaker: { failures: 1, within_seconds: 60, open_seconds: 600 }
routes:
  - { method: POST, path: /slow, class: slow, lane: slow_lane }
default_class: slow
"#;

/// An upstream that answers 200 once it has a request's whole body (`{}`,
/// chunked or not).
async fn upstream() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut got = Vec::new();
                let mut chunk = [0u8; 4096];
                loop {
                    if got.ends_with(b"0\r\n\r\n") || got.ends_with(b"{}") {
                        got.clear();
                        let ok = "HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                        if conn.write_all(ok.as_bytes()).await.is_err() {
                            return;
                        }
                    }
                    match conn.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => got.extend_from_slice(&chunk[..n]),
                    }
                }
            });
        }
    });
    addr
}

/// The status of the answer read from `conn`.
async fn status_of(conn: &mut TcpStream) -> u16 {
    let mut got = Vec::new();
    let mut chunk = [0u8; 4096];
    while !got.windows(4).any(|w| w == b"\r\n\r\n") {
        match conn.read(&mut chunk).await {
            Ok(0) | Err(_) => break,
            Ok(n) => got.extend_from_slice(&chunk[..n]),
        }
    }
    String::from_utf8_lossy(&got)
        .get(9..12)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

const HEAD: &str = "POST /slow HTTP/1.1\r\nhost: x\r\nx-api-key: k\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n";

/// The gateway of [`POLICY`] in front of [`upstream`], one worker, and its data dir.
async fn gateway() -> (Gateway, SocketAddr, std::path::PathBuf) {
    let policy = sluice_policy::parse_str(POLICY, std::path::Path::new("lanes.yaml"))
        .expect("the test policy");
    let dir = std::env::temp_dir().join(format!(
        "sluice-lanes-{}-{}",
        std::process::id(),
        fastrand::u64(..)
    ));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let mut config = GatewayConfig::new(policy, dir.clone());
    config.workers = std::num::NonZeroUsize::new(1).expect("one");
    config.upstream = Some(Upstream::from_addr(upstream().await));
    let gateway = Gateway::start(config).await.expect("gateway starts");
    let addr = gateway.addr().expect("an address");
    (gateway, addr, dir)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l1_l3_a_slow_upload_never_holds_the_lanes_place() {
    tokio::time::timeout(TEST_TIMEOUT, async {
        let (gateway, addr, dir) = gateway().await;

        // A body that starts and stops coming, on the lane's only place's route.
        let mut slow = TcpStream::connect(addr).await.expect("connect");
        slow.write_all(format!("{HEAD}2\r\n{{}}\r\n").as_bytes())
            .await
            .expect("write");
        // Another workspace's whole call is not kept waiting for it: the slow
        // one has no place while its body is still to come (held, it would wait
        // the lane's 15 s and be refused).
        let mut whole = TcpStream::connect(addr).await.expect("connect");
        whole
            .write_all(
                format!(
                    "{}2\r\n{{}}\r\n0\r\n\r\n",
                    HEAD.replace("x-api-key: k", "x-api-key: other")
                )
                .as_bytes(),
            )
            .await
            .expect("write");
        let answered = tokio::time::timeout(Duration::from_secs(10), status_of(&mut whole)).await;
        assert_eq!(answered, Ok(200), "the place was free for a whole call");
        // The slow call, once its body is whole, runs as any other.
        slow.write_all(b"0\r\n\r\n").await.expect("write");
        assert_eq!(status_of(&mut slow).await, 200);
        gateway.shutdown().await;
        let _ = std::fs::remove_dir_all(dir);
    })
    .await
    .expect("test timed out");
}
