//! SPEC S3: the admin login cookie (`sluice_admin_<port>`, HttpOnly) is sluice's
//! own credential. A browser sends a host's cookies to all of its ports, so once
//! an operator has logged in to the admin listener, the cookie comes along on the
//! gateway's requests too; the gateway takes it out of `Cookie` before the
//! upstream reads it, on the fast path and on the service stack, and leaves every
//! other cookie as it came.

use crate::one_request;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sluice_gateway::{Gateway, GatewayConfig, Upstream};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};

/// An upstream that keeps each request head it reads (lowercase) and answers 200.
async fn recording_upstream() -> (SocketAddr, Arc<Mutex<Vec<String>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let heads = Arc::new(Mutex::new(Vec::new()));
    let kept = Arc::clone(&heads);
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            let kept = Arc::clone(&kept);
            tokio::spawn(async move {
                while let Some(got) = one_request::read_request(&mut conn).await {
                    let text = String::from_utf8_lossy(&got).to_ascii_lowercase();
                    let head = text.split("\r\n\r\n").next().unwrap_or_default().to_owned();
                    kept.lock().expect("heads").push(head);
                    let answer = "HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                    if conn.write_all(answer.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (addr, heads)
}

/// The `cookie` fields of a recorded head.
fn cookies(head: &str) -> Vec<&str> {
    head.lines()
        .filter_map(|l| l.strip_prefix("cookie:"))
        .map(str::trim)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_the_admin_login_cookie_never_goes_upstream() {
    let work = async {
        let (up, heads) = recording_upstream().await;
        let dir = std::env::temp_dir().join(format!(
            "sluice-admin-cookie-{}-{}",
            std::process::id(),
            fastrand::u64(..)
        ));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let mut config = GatewayConfig::new(
            sluice_policy::default_policy().expect("the built-in policy"),
            dir.clone(),
        );
        config.workers = std::num::NonZeroUsize::new(1).expect("one");
        config.upstream = Some(Upstream::from_addr(up));
        let gateway = Gateway::start(config).await.expect("gateway starts");
        let addr = gateway.addr().expect("gateway addr");
        // The admin listener's own cookie name.
        let door = sluice_door::Door::new(gateway.admin_addr(), sluice_door::DoorConfig::default());
        let admin = door.cookie_name().to_owned();
        assert!(
            admin
                .as_bytes()
                .starts_with(sluice_edge::ADMIN_COOKIE_PREFIX)
        );
        let requests = [
            // The fast path: a GET.
            format!(
                "GET /search/fields HTTP/1.1\r\nhost: x\r\nx-api-key: sk-c\r\ncookie: a=1; {admin}=secret-value; b=2\r\nconnection: close\r\n\r\n"
            ),
            // The service stack: a chunked body.
            format!(
                "POST /chats HTTP/1.1\r\nhost: x\r\nx-api-key: sk-c\r\ncookie: a=1; {admin}=secret-value; b=2\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n2\r\n{{}}\r\n0\r\n\r\n"
            ),
            // Nothing but the admin cookie: no `Cookie` at all.
            format!(
                "GET /search/fields HTTP/1.1\r\nhost: x\r\nx-api-key: sk-c\r\ncookie: {admin}=secret-value\r\nconnection: close\r\n\r\n"
            ),
        ];
        for request in &requests {
            let mut conn = TcpStream::connect(addr).await.expect("connect");
            conn.write_all(request.as_bytes()).await.expect("write");
            let mut got = Vec::new();
            let _ = conn.read_to_end(&mut got).await;
            assert!(
                got.starts_with(b"HTTP/1.1 200"),
                "{}",
                String::from_utf8_lossy(&got)
            );
        }
        // Request heads only (this reader takes a chunked body's last chunk for
        // a request of its own).
        let heads: Vec<String> = heads
            .lock()
            .expect("heads")
            .iter()
            .filter(|h| h.contains(" http/1.1\r\n"))
            .cloned()
            .collect();
        assert_eq!(heads.len(), 3, "{heads:?}");
        for head in &heads {
            assert!(!head.contains("secret-value"), "{head}");
            assert!(!head.contains("sluice_admin_"), "{head}");
        }
        assert_eq!(cookies(&heads[0]), ["a=1; b=2"]);
        assert_eq!(cookies(&heads[1]), ["a=1; b=2"]);
        assert!(cookies(&heads[2]).is_empty(), "{}", heads[2]);
        gateway.shutdown().await;
        let _ = std::fs::remove_dir_all(dir);
    };
    tokio::time::timeout(Duration::from_secs(60), work)
        .await
        .expect("test timed out");
}
