//! A connection of the rate-limit service: the socket, what it holds until it
//! closes (its place under the listener's connection bound), and a deadline
//! for the client's first words ([`FirstWords`]).
//!
//! Without the deadline, a client that connects and never sends HTTP/2's
//! connection preface holds its place for ever (the server's keep-alive pings
//! start only after the handshake), so 1,024 silent sockets from anywhere that
//! reaches the port would shut Envoy out.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use sluice_door::{FirstWords, HTTP2_HANDSHAKE_BYTES};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// How long a new connection may take to begin HTTP/2's handshake (its
/// connection preface and a SETTINGS frame) before it is closed; the same
/// bound as the check listener's for a request head.
pub const PREFACE_TIMEOUT: Duration = Duration::from_secs(10);

/// A connection with what it holds until it closes.
pub(crate) struct Bounded<H> {
    stream: FirstWords<TcpStream>,
    _held: H,
}

impl<H> Bounded<H> {
    /// Wraps `stream`, holding `held` until it closes; the handshake is due
    /// within [`PREFACE_TIMEOUT`] from now (call on the runtime that serves it).
    pub(crate) fn new(stream: TcpStream, held: H) -> Self {
        Self::with_deadline(stream, held, PREFACE_TIMEOUT)
    }

    fn with_deadline(stream: TcpStream, held: H, within: Duration) -> Self {
        Bounded {
            stream: FirstWords::new(stream, HTTP2_HANDSHAKE_BYTES, within),
            _held: held,
        }
    }
}

impl<H: Unpin> AsyncRead for Bounded<H> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl<H: Unpin> AsyncWrite for Bounded<H> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

impl<H> tonic::transport::server::Connected for Bounded<H> {
    type ConnectInfo = tonic::transport::server::TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.stream.get_ref().connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    /// A connected pair: (the server's side, the client's side).
    async fn pair() -> (TcpStream, TcpStream) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let client = TcpStream::connect(listener.local_addr().expect("addr"))
            .await
            .expect("connect");
        let (server, _) = listener.accept().await.expect("accept");
        (server, client)
    }

    /// R1 bounds: a connection whose client says nothing is closed once the
    /// preface is overdue, so silent sockets cannot hold every place.
    #[tokio::test]
    async fn r1_a_silent_connection_is_closed_when_its_preface_is_overdue() {
        let (server, _client) = pair().await;
        let mut connection = Bounded::with_deadline(server, (), Duration::from_millis(50));
        let mut byte = [0_u8; 1];
        let read = tokio::time::timeout(Duration::from_secs(10), connection.read(&mut byte))
            .await
            .expect("the deadline ends the read");
        let error = read.expect_err("overdue");
        assert_eq!(error.kind(), io::ErrorKind::TimedOut);
    }
}
