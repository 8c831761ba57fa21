//! SPEC L3 over loopback: a call whose client is still sending its body when the
//! lane's time runs out is the client's doing, answered 408, and never counts as
//! an upstream failure for the lane's breaker (slow uploads could otherwise open
//! it for every workspace).

use std::net::SocketAddr;
use std::time::Duration;

use sluice_gateway::{Gateway, GatewayConfig, Upstream};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};

const TEST_TIMEOUT: Duration = Duration::from_secs(60);

/// A lane whose calls may take 1 s, its breaker opened by one failure.
const POLICY: &str = r#"
profile: default
window_seconds: 3600
profiles:
  default:
    classes: { slow: 1000 }
lanes:
  slow_lane:
    timeout_seconds: 1
    breaker: { failures: 1, within_seconds: 60, open_seconds: 600 }
routes:
  - { method: POST, path: /slow, class: slow, lane: slow_lane }
default_class: slow
"#;

/// An upstream that answers 200 once it has a request's whole chunked body.
async fn upstream() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut got = Vec::new();
                let mut chunk = [0u8; 4096];
                loop {
                    if got.windows(5).any(|w| w == b"0\r\n\r\n") {
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l3_an_upload_still_coming_at_the_lanes_time_is_the_client_s_never_a_failure() {
    tokio::time::timeout(TEST_TIMEOUT, async {
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

        // A body that starts and stops coming: the lane's second passes.
        let mut slow = TcpStream::connect(addr).await.expect("connect");
        slow.write_all(format!("{HEAD}2\r\n{{}}\r\n").as_bytes())
            .await
            .expect("write");
        assert_eq!(status_of(&mut slow).await, 408, "the client's doing");
        // The breaker (one failure opens it) is still closed: a whole call goes.
        let mut whole = TcpStream::connect(addr).await.expect("connect");
        whole
            .write_all(format!("{HEAD}2\r\n{{}}\r\n0\r\n\r\n").as_bytes())
            .await
            .expect("write");
        assert_eq!(
            status_of(&mut whole).await,
            200,
            "the breaker stayed closed"
        );
        gateway.shutdown().await;
        let _ = std::fs::remove_dir_all(dir);
    })
    .await
    .expect("test timed out");
}
