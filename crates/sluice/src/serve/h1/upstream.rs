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
            // Readable while idle means the upstream closed it (or sent bytes no
            // request asked for): either way it cannot carry a request. This looks at
            // the readiness the reactor last saw; a close it has not seen yet shows
            // as a failed exchange, which the caller may retry on a new connection.
            let mut probe = [0u8; 1];
            match stream.try_read(&mut probe) {
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
    async fn closed_and_stale_connections_are_not_handed_out() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let pool = Pool::new(listener.local_addr().expect("addr").to_string(), 2);
        assert!(pool.checkout().is_none());

        let first = pool.connect().await.expect("connect");
        let (peer_of_first, _) = listener.accept().await.expect("accept");
        let second = pool.connect().await.expect("connect");
        let (_peer_of_second, _) = listener.accept().await.expect("accept");
        let first_addr = first.local_addr().expect("addr");
        let second_addr = second.local_addr().expect("addr");
        pool.checkin(first);
        pool.checkin(second);

        // Most recent first.
        let out = pool.checkout().expect("idle connection");
        assert_eq!(out.local_addr().expect("addr"), second_addr);
        pool.checkin(out);

        // The upstream closes the second; once the reactor has seen it, it is skipped.
        drop(_peer_of_second);
        let out = pool.checkout().expect("idle connection");
        out.readable().await.expect("readable");
        pool.checkin(out);
        let out = pool.checkout().expect("the first is still open");
        assert_eq!(out.local_addr().expect("addr"), first_addr);
        pool.checkin(out);

        // Idle past the timeout: gone.
        tokio::time::advance(IDLE_TIMEOUT).await;
        pool.prune();
        assert!(pool.checkout().is_none());
        drop(peer_of_first);
    }
}
