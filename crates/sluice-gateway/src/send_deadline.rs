//! A client connection hyper serves, with the fast path's send timeout
//! ([`SEND_TIMEOUT`](crate::h1::SEND_TIMEOUT)): a write that makes no progress
//! for that long fails, and hyper closes the connection, so a client that stops
//! reading never holds its connection and the upstream's for as long as it likes.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

/// `io` whose writes fail once one has waited `timeout` without progress.
pub(crate) struct SendDeadline<IO> {
    io: IO,
    timeout: Duration,
    /// Armed while a write waits.
    waiting: Option<Pin<Box<Sleep>>>,
}

impl<IO> SendDeadline<IO> {
    pub(crate) fn new(io: IO, timeout: Duration) -> Self {
        SendDeadline {
            io,
            timeout,
            waiting: None,
        }
    }

    /// After a write's poll: progress (or an error) disarms the deadline; a
    /// write still waiting arms it, and fails once it has passed.
    fn after<T>(
        &mut self,
        cx: &mut Context<'_>,
        polled: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        if polled.is_ready() {
            self.waiting = None;
            return polled;
        }
        let timeout = self.timeout;
        let sleep = self
            .waiting
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        match sleep.as_mut().poll(cx) {
            Poll::Ready(()) => {
                self.waiting = None;
                crate::stalled::count(crate::stalled::Cut::Connection);
                Poll::Ready(Err(io::ErrorKind::TimedOut.into()))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

use std::future::Future as _;

impl<IO: AsyncRead + Unpin> AsyncRead for SendDeadline<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for SendDeadline<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.io).poll_write(cx, buf);
        self.after(cx, polled)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.after(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let polled = Pin::new(&mut self.io).poll_flush(cx);
        self.after(cx, polled)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let polled = Pin::new(&mut self.io).poll_shutdown(cx);
        self.after(cx, polled)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    /// A reader that stops reading: the writer fails at the deadline, not later;
    /// one that reads keeps it from ever passing.
    #[tokio::test(start_paused = true)]
    async fn a_write_without_progress_fails_at_the_deadline() {
        let (near, far) = tokio::io::duplex(1024);
        let mut near = SendDeadline::new(near, Duration::from_secs(60));
        let started = tokio::time::Instant::now();
        let stuck = near.write_all(&[7u8; 64 * 1024]).await;
        assert_eq!(stuck.map_err(|e| e.kind()), Err(io::ErrorKind::TimedOut));
        assert_eq!(started.elapsed(), Duration::from_secs(60));

        let (near, mut slow) = tokio::io::duplex(1024);
        let mut near = SendDeadline::new(near, Duration::from_secs(60));
        let reader = tokio::spawn(async move {
            let mut got = 0;
            let mut chunk = [0u8; 512];
            while got < 64 * 1024 {
                tokio::time::sleep(Duration::from_secs(30)).await;
                got += slow.read(&mut chunk).await.expect("read");
            }
            got
        });
        near.write_all(&[7u8; 64 * 1024])
            .await
            .expect("a slow reader is served");
        assert_eq!(reader.await.expect("reader"), 64 * 1024);
        drop(far);
    }
}
