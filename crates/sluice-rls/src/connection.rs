//! A connection of the rate-limit service: the socket, what it holds until it
//! closes (its places under the listener's connection bounds), a deadline
//! for the client's first words ([`FirstWords`]), and the account of what its
//! calls' unfinished messages hold ([`Unfinished`]), which each call carries.
//!
//! Without the deadline, a client that connects and never sends HTTP/2's
//! connection preface holds its place for ever (the server's keep-alive pings
//! start only after the handshake), so 1,024 silent sockets from anywhere that
//! reaches the port would shut Envoy out.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use sluice_door::{FirstWords, HTTP2_HANDSHAKE_BYTES};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use crate::message::Unfinished;

/// How long a new connection may take to begin HTTP/2's handshake (its
/// connection preface and a SETTINGS frame) before it is closed; the same
/// bound as the check listener's for a request head.
pub const PREFACE_TIMEOUT: Duration = Duration::from_secs(10);

/// A connection with what it holds until it closes.
pub(crate) struct Bounded<H> {
    stream: FirstWords<TcpStream>,
    info: ConnectionInfo,
    _held: H,
}

/// What each call of a connection carries (tonic copies it into every
/// request's extensions): the connection's account of unfinished messages.
#[derive(Clone, Debug)]
pub(crate) struct ConnectionInfo(pub(crate) Arc<Unfinished>);

impl<H> Bounded<H> {
    /// Wraps `stream`, holding `held` until it closes, its calls' unfinished
    /// messages counted in `unfinished`; the handshake is due within
    /// [`PREFACE_TIMEOUT`] from now (call on the runtime that serves it).
    pub(crate) fn new(stream: TcpStream, held: H, unfinished: Unfinished) -> Self {
        Self::with_deadline(stream, held, unfinished, PREFACE_TIMEOUT)
    }

    fn with_deadline(stream: TcpStream, held: H, unfinished: Unfinished, within: Duration) -> Self {
        Bounded {
            stream: FirstWords::new(stream, HTTP2_HANDSHAKE_BYTES, within),
            info: ConnectionInfo(Arc::new(unfinished)),
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
    type ConnectInfo = ConnectionInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.info.clone()
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
        let unfinished = Unfinished::new(
            sluice_edge::BufferBudget::new(1 << 20),
            crate::message::tests::holder(),
            metrics::Gauge::noop(),
        );
        let mut connection =
            Bounded::with_deadline(server, (), unfinished, Duration::from_millis(50));
        let mut byte = [0_u8; 1];
        let read = tokio::time::timeout(Duration::from_secs(10), connection.read(&mut byte))
            .await
            .expect("the deadline ends the read");
        let error = read.expect_err("overdue");
        assert_eq!(error.kind(), io::ErrorKind::TimedOut);
    }
}
