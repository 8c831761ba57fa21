//! A connection whose first bytes must come within a time: what keeps a socket
//! that connects and says nothing from holding a listener's place for ever.
//! HTTP/1.1 servers bound the wait for a request head; an HTTP/2 server waits
//! for the connection preface as long as the peer likes (its keep-alive pings
//! start only after the handshake), so the rate-limit service and the
//! gateway's HTTP/2 connections read through this.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

/// HTTP/2's client connection preface and the header of the SETTINGS frame
/// that must follow it: what a client has sent once its handshake has begun.
pub const HTTP2_HANDSHAKE_BYTES: usize = 24 + 9;

/// `stream`, whose first `due` bytes must have been read within a deadline;
/// a read still waiting past it fails with [`io::ErrorKind::TimedOut`]. After
/// those bytes it reads as `stream` does.
pub struct FirstWords<S> {
    stream: S,
    /// Until the first bytes have come: how many are still due, and when.
    due: Option<(usize, Pin<Box<Sleep>>)>,
}

impl<S> FirstWords<S> {
    /// Wraps `stream`: its first `due` bytes are due within `within` from now
    /// (call on the runtime that reads it).
    pub fn new(stream: S, due: usize, within: Duration) -> Self {
        FirstWords {
            stream,
            due: (due > 0).then(|| (due, Box::pin(tokio::time::sleep(within)))),
        }
    }

    /// The stream inside.
    pub fn get_ref(&self) -> &S {
        &self.stream
    }

    /// Whether the first bytes have all come.
    pub fn has_spoken(&self) -> bool {
        self.due.is_none()
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for FirstWords<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let this = &mut *self;
        let polled = Pin::new(&mut this.stream).poll_read(cx, buf);
        if let Some((due, deadline)) = this.due.as_mut() {
            match &polled {
                Poll::Ready(Ok(())) => {
                    let got = buf.filled().len() - before;
                    if got >= *due {
                        this.due = None;
                    } else {
                        *due -= got;
                    }
                }
                Poll::Pending => {
                    if deadline.as_mut().poll(cx).is_ready() {
                        return Poll::Ready(Err(io::Error::new(
                            io::ErrorKind::TimedOut,
                            "the peer did not speak in time",
                        )));
                    }
                }
                Poll::Ready(Err(_)) => {}
            }
        }
        polled
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for FirstWords<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

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

    /// A peer that says nothing, or too little, fails the read once the
    /// deadline passes, so silent sockets cannot hold a listener's places.
    #[tokio::test]
    async fn a_peer_that_does_not_speak_in_time_fails_the_read() {
        for said in [&b""[..], &b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"[..]] {
            let (server, mut client) = pair().await;
            client.write_all(said).await.expect("write");
            let mut connection =
                FirstWords::new(server, HTTP2_HANDSHAKE_BYTES, Duration::from_millis(50));
            let mut rest = Vec::new();
            let read =
                tokio::time::timeout(Duration::from_secs(10), connection.read_to_end(&mut rest))
                    .await
                    .expect("the deadline ends the read");
            let error = read.expect_err("overdue");
            assert_eq!(error.kind(), io::ErrorKind::TimedOut);
            assert_eq!(rest, said, "what came is still read");
        }
    }

    /// First bytes that come in pieces before the deadline lift it.
    #[tokio::test]
    async fn first_words_in_time_lift_the_deadline() {
        let (server, mut client) = pair().await;
        let mut connection = FirstWords::new(server, 24, Duration::from_secs(10));
        let preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
        let mut got = [0_u8; 24];
        client.write_all(&preface[..10]).await.expect("write");
        connection
            .read_exact(&mut got[..10])
            .await
            .expect("first piece");
        assert!(!connection.has_spoken());
        client.write_all(&preface[10..]).await.expect("write");
        connection
            .read_exact(&mut got[10..])
            .await
            .expect("the rest");
        assert_eq!(&got[..], &preface[..]);
        assert!(connection.has_spoken(), "the deadline is lifted");
    }
}
