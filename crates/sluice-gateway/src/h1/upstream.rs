//! One worker's keep-alive connections to the upstream, for the fast path.
//!
//! A plain stack of idle sockets: the fast path drives each upstream connection from
//! the task of the client request that uses it, so a connection in the stack is just
//! a socket whose last response was read to its end. The most recently used is
//! handed out first (its peer is the least likely to have closed it); one found
//! closed, or idle for longer than [`IDLE_TIMEOUT`], is dropped.

use std::collections::VecDeque;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::net::TcpStream;
use tokio::time::Instant;

/// How long a connection may wait idle for its next request.
pub(super) const IDLE_TIMEOUT: Duration = super::super::pool::IDLE_TIMEOUT;

/// One worker's idle upstream connections.
#[derive(Debug)]
pub(super) struct Pool {
    /// `host:port` to connect to.
    target: String,
    /// At most this many connections wait idle.
    max_idle: usize,
    /// Oldest first.
    idle: Mutex<VecDeque<Idle>>,
}

#[derive(Debug)]
struct Idle {
    stream: TcpStream,
    since: Instant,
}

impl Pool {
    /// An empty pool of connections to `target` (`host:port`).
    pub(super) fn new(target: String, max_idle: usize) -> Self {
        Pool {
            target,
            max_idle,
            idle: Mutex::new(VecDeque::new()),
        }
    }

    fn idle(&self) -> MutexGuard<'_, VecDeque<Idle>> {
        // The queue is left consistent at every point a panic could occur.
        self.idle.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The most recently used idle connection that is still open, if any.
    pub(super) fn checkout(&self) -> Option<TcpStream> {
        let now = Instant::now();
        let mut idle = self.idle();
        while let Some(Idle { stream, since }) = idle.pop_back() {
            if now.saturating_duration_since(since) >= IDLE_TIMEOUT {
                // Everything older is older still.
                idle.clear();
                return None;
            }
            // Anything to read while idle means the upstream closed it or sent bytes no
            // request asked for (which would be taken for the next request's answer):
            // either way it cannot carry a request. A non-blocking peek asks the
            // socket itself, not the readiness the reactor last saw.
            let mut probe = [std::mem::MaybeUninit::<u8>::uninit(); 1];
            match socket2::SockRef::from(&stream).peek(&mut probe) {
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Some(stream),
                _ => {}
            }
        }
        None
    }

    /// Puts a connection whose last response was read to its end back.
    pub(super) fn checkin(&self, stream: TcpStream) {
        let mut idle = self.idle();
        if idle.len() >= self.max_idle {
            idle.pop_front();
        }
        idle.push_back(Idle {
            stream,
            since: Instant::now(),
        });
    }

    /// Closes the connections idle for longer than [`IDLE_TIMEOUT`].
    pub(super) fn prune(&self) {
        let now = Instant::now();
        let mut idle = self.idle();
        while idle
            .front()
            .is_some_and(|i| now.saturating_duration_since(i.since) >= IDLE_TIMEOUT)
        {
            idle.pop_front();
        }
    }

    /// A new connection.
    ///
    /// # Errors
    /// The connect's.
    pub(super) async fn connect(&self) -> std::io::Result<TcpStream> {
        let stream = TcpStream::connect(&self.target).await?;
        stream.set_nodelay(true)?;
        Ok(stream)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn closed_stray_and_stale_connections_are_not_handed_out() {
        use tokio::io::AsyncWriteExt as _;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let pool = Pool::new(listener.local_addr().expect("addr").to_string(), 4);
        assert!(pool.checkout().is_none());
        let mut open = Vec::new();
        let mut peers = Vec::new();
        for _ in 0..3 {
            let stream = pool.connect().await.expect("connect");
            let (peer, _) = listener.accept().await.expect("accept");
            open.push(stream.local_addr().expect("addr"));
            peers.push(peer);
            pool.checkin(stream);
        }

        // Most recent first.
        let out = pool.checkout().expect("idle connection");
        assert_eq!(out.local_addr().expect("addr"), open[2]);
        pool.checkin(out);

        // The upstream closes the third, and sends the second bytes nobody asked for:
        // both are passed over, the first is handed out.
        peers.pop();
        peers[1]
            .write_all(b"HTTP/1.1 200 OK\r\n")
            .await
            .expect("write");
        let out = pool.checkout().expect("the first is still fine");
        assert_eq!(out.local_addr().expect("addr"), open[0]);
        pool.checkin(out);

        // Idle past the timeout: gone.
        tokio::time::advance(IDLE_TIMEOUT).await;
        pool.prune();
        assert!(pool.checkout().is_none());
    }
}
