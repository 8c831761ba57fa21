//! A connection of the rate-limit service: the socket, what it holds until it
//! closes (its place under the listener's connection bound), and a deadline
//! for the client's first words.
//!
//! Without the deadline, a client that connects and never sends HTTP/2's
//! connection preface holds its place for ever (the server's keep-alive pings
//! start only after the handshake), so 1,024 silent sockets from anywhere that
//! reaches the port would shut Envoy out.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::Sleep;

/// How long a new connection may take to send HTTP/2's connection preface
/// (24 bytes) before it is closed; the same bound as the check listener's
/// for a request head.
pub const PREFACE_TIMEOUT: Duration = Duration::from_secs(10);

/// The length of HTTP/2's client connection preface.
const PREFACE_LEN: usize = 24;

/// A connection with what it holds until it closes.
pub(crate) struct Bounded<H> {
    stream: TcpStream,
    _held: H,
    /// Until the preface has come: the bytes still due and the deadline.
    preface: Option<(usize, Pin<Box<Sleep>>)>,
}

impl<H> Bounded<H> {
    /// Wraps `stream`, holding `held` until it closes; the preface is due
    /// within [`PREFACE_TIMEOUT`] from now (call on the runtime that serves it).
    pub(crate) fn new(stream: TcpStream, held: H) -> Self {
        Self::with_deadline(stream, held, PREFACE_TIMEOUT)
    }

    fn with_deadline(stream: TcpStream, held: H, within: Duration) -> Self {
        Bounded {
            stream,
            _held: held,
            preface: Some((PREFACE_LEN, Box::pin(tokio::time::sleep(within)))),
        }
    }
}

impl<H: Unpin> AsyncRead for Bounded<H> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let this = &mut *self;
        let polled = Pin::new(&mut this.stream).poll_read(cx, buf);
        if let Some((due, deadline)) = this.preface.as_mut() {
            match &polled {
                Poll::Ready(Ok(())) => {
                    let got = buf.filled().len() - before;
                    if got >= *due {
                        this.preface = None;
                    } else {
                        *due -= got;
                    }
                }
                Poll::Pending => {
                    if deadline.as_mut().poll(cx).is_ready() {
                        return Poll::Ready(Err(io::Error::new(
                            io::ErrorKind::TimedOut,
                            "no HTTP/2 connection preface in time",
                        )));
                    }
                }
                Poll::Ready(Err(_)) => {}
            }
        }
        polled
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
        self.stream.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

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

    /// A preface that comes in pieces before the deadline lifts it.
    #[tokio::test]
    async fn a_preface_in_time_lifts_the_deadline() {
        let (server, mut client) = pair().await;
        let mut connection = Bounded::with_deadline(server, (), Duration::from_millis(300));
        let preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
        let mut got = [0_u8; PREFACE_LEN];
        client.write_all(&preface[..10]).await.expect("write");
        connection
            .read_exact(&mut got[..10])
            .await
            .expect("first piece");
        client.write_all(&preface[10..]).await.expect("write");
        connection
            .read_exact(&mut got[10..])
            .await
            .expect("the rest");
        assert_eq!(&got[..], &preface[..]);
        assert!(connection.preface.is_none(), "the deadline is lifted");
        // The deadline's timer is gone with it: a later read waits on the
        // client alone.
        client.write_all(b"x").await.expect("write");
        let mut byte = [0_u8; 1];
        connection.read_exact(&mut byte).await.expect("still open");
        assert_eq!(&byte, b"x");
    }
}
