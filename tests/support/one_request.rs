//! One HTTP/1.1 request read from a connection, for the tests' loopback
//! upstreams: its head, then a body of its `Content-Length`.
#![allow(dead_code, unreachable_pub)]

use tokio::io::AsyncReadExt as _;
use tokio::net::TcpStream;

/// The bytes of the next request on `conn` (head and body), or `None` when the
/// connection ends or fails first.
pub async fn read_request(conn: &mut TcpStream) -> Option<Vec<u8>> {
    let mut got = Vec::new();
    let mut chunk = [0u8; 8192];
    loop {
        let text = String::from_utf8_lossy(&got);
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let length: usize = head
                .to_ascii_lowercase()
                .lines()
                .find_map(|l| l.strip_prefix("content-length:")?.trim().parse().ok())
                .unwrap_or(0);
            if body.len() >= length {
                return Some(got);
            }
        }
        match conn.read(&mut chunk).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => got.extend_from_slice(&chunk[..n]),
        }
    }
}
