//! A client connection on the fast path as data: its buffers, its deadlines, and
//! reading more into them. The phases run over it in `connection` (a request),
//! `body` (its body) and `exchange` (the upstream).

use std::io;
use std::net::IpAddr;
use std::time::Duration;

use bytes::BytesMut;
use http::HeaderMap;
use sluice_h1::deadline::Deadline;
use tokio::io::AsyncReadExt as _;
use tokio::net::TcpStream;

use crate::proxy::ForwardedPeer;

use super::{FastPath, KEPT_CAPACITY, READ_CHUNK};

/// A connection's deadlines: for the next request head, for the upstream's answer.
pub(super) struct Timers {
    pub(super) head: Deadline,
    pub(super) head_timeout: Duration,
    pub(super) upstream: Deadline,
}

/// What follows a request.
pub(super) enum Next {
    /// The next request on this connection.
    Request,
    /// Closing the connection.
    Close,
    /// Leaving the connection to hyper (nothing of the current request was answered).
    Elsewhere,
}

/// How long a client may take to take any of what is sent to it before its
/// connection is closed (as nginx's `send_timeout`): a client that stops reading
/// would hold its connection and the upstream's for as long as it likes.
pub(crate) const SEND_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// Writes all of `bytes` to the client, each part within [`SEND_TIMEOUT`] of the
/// last: a client that takes nothing for that long is an error (`TimedOut`).
///
/// What the socket takes at once is written without a timer (nearly every answer:
/// the clock read and the timer's registration cost more than the write's check);
/// the timer is armed only for what has to wait for the client.
pub(super) async fn send(
    client: &mut tokio::net::TcpStream,
    mut bytes: &[u8],
) -> std::io::Result<()> {
    use tokio::io::AsyncWriteExt as _;
    while !bytes.is_empty() {
        match client.try_write(bytes) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => bytes = &bytes[n..],
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
            Err(e) => return Err(e),
        }
    }
    while !bytes.is_empty() {
        match tokio::time::timeout(SEND_TIMEOUT, client.write(bytes)).await {
            Ok(Ok(0)) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(Ok(n)) => bytes = &bytes[n..],
            Ok(Err(e)) => return Err(e),
            Err(_) => {
                crate::stalled::count(crate::stalled::Cut::Connection);
                return Err(std::io::ErrorKind::TimedOut.into());
            }
        }
    }
    Ok(())
}

/// One client connection's buffers.
pub(super) struct Connection<'f> {
    pub(super) fast: &'f FastPath,
    pub(super) peer: IpAddr,
    /// The peer as the forwarding fields write it.
    pub(super) forwarded_peer: ForwardedPeer,
    /// Read from the client, not served yet.
    pub(super) from_client: BytesMut,
    /// Read from the upstream, not relayed yet.
    pub(super) from_upstream: BytesMut,
    /// The request head and body for the upstream.
    pub(super) to_upstream: Vec<u8>,
    /// The response head (and the first body bytes) for the client.
    pub(super) to_client: Vec<u8>,
    /// The request fields the limiter reads.
    pub(super) identity: HeaderMap,
}

/// True when the empty `buf` holds an allocation larger than [`KEPT_CAPACITY`]: its
/// capacity counts only what lies after the bytes already consumed, so the space
/// before them is taken back first (no copy: nothing is left to move).
pub(super) fn holds_more_than_kept(buf: &mut BytesMut) -> bool {
    buf.capacity() > KEPT_CAPACITY || buf.try_reclaim(KEPT_CAPACITY + 1)
}

/// Reads what is there (at least one byte, or 0 at the end) into `buf`.
pub(super) async fn read_more(stream: &mut TcpStream, buf: &mut BytesMut) -> io::Result<usize> {
    buf.reserve(READ_CHUNK);
    stream.read_buf(buf).await
}

/// True when `buf`, of which the first `checked` bytes were found to hold no complete
/// head, may hold one now: when it is not empty and either nothing was checked yet
/// or the bytes since hold the blank line that ends a head. Parsing again only then
/// keeps a head that arrives a byte at a time from costing a parse per byte.
pub(super) fn may_end_head(buf: &[u8], checked: usize) -> bool {
    if checked == 0 {
        return !buf.is_empty();
    }
    let fresh = &buf[checked.saturating_sub(3).min(buf.len())..];
    fresh.windows(2).any(|w| w == b"\n\n") || fresh.windows(3).any(|w| w == b"\n\r\n")
}

impl<'f> Connection<'f> {
    pub(super) fn new(fast: &'f FastPath, peer: IpAddr) -> Self {
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
    pub(super) fn trim(&mut self) {
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
}
