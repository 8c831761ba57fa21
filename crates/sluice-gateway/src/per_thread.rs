//! A listener served a thread per core, as the gateway's workers are: one
//! acceptor hands each accepted connection to the thread holding the fewest
//! open connections, and each thread serves the connections handed to it on a
//! runtime of its own, so a request is decided on the thread that read it (the
//! Redis store's coalescer is per thread too) and never waits for, or wakes,
//! another thread. The forward-auth listener and the rate-limit service run
//! this way.
//!
//! Why one acceptor and not a copy of the socket per thread: the proxies in
//! front of these listeners (Envoy, nginx with `keepalive`) hold a few
//! long-lived connections. Threads racing to accept on copies of one socket
//! split four connections three to one as often as two to two, and the thread
//! with three is the bottleneck for the connections' whole life.

use std::future::Future;
use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use sluice_door::{PerAddress, Place};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc};

/// Connections handed to one thread and not yet taken by it.
const HANDOFF_QUEUE: usize = 64;

/// What a connection holds until it closes: its places under the listener's
/// connection bound and its per-address bound, and its count on its thread's
/// line.
#[derive(Debug)]
pub(crate) struct Held {
    _place: Place,
    open: Arc<[AtomicUsize]>,
    thread: usize,
}

impl Held {
    /// Counts the connection on `thread`'s line instead.
    fn move_to(&mut self, thread: usize) {
        self.open[self.thread].fetch_sub(1, Ordering::Relaxed);
        self.open[thread].fetch_add(1, Ordering::Relaxed);
        self.thread = thread;
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.open[self.thread].fetch_sub(1, Ordering::Relaxed);
    }
}

/// A connection on its way to a thread.
type Handoff = (std::net::TcpStream, SocketAddr, Held);

/// The connections handed to one thread.
pub(crate) struct Connections {
    handed: mpsc::Receiver<Handoff>,
}

impl Connections {
    /// The next connection handed to this thread, registered with this
    /// thread's runtime, with what it holds until it closes (keep it as long
    /// as the connection); `None` once the listener has stopped.
    pub(crate) async fn accept(&mut self) -> Option<(TcpStream, SocketAddr, Held)> {
        loop {
            let (stream, peer, held) = self.handed.recv().await?;
            match TcpStream::from_std(stream) {
                Ok(stream) => return Some((stream, peer, held)),
                Err(error) => tracing::warn!("a connection from {peer} was dropped: {error}"),
            }
        }
    }
}

/// Starts `threads` threads named `name-<index>`, each running `serve` on a
/// current-thread runtime of its own with the connections handed to it, and
/// returns the acceptor: it accepts on `listener` while fewer than
/// `max_connections` are open (the next waits in the listen backlog) and
/// closes at once one from an address holding its bound in `per_address`, hands
/// each connection to the thread with the fewest open, and once `stop`
/// resolves stops accepting, ends every thread's [`Connections`] and ends when
/// every thread's `serve` has ended.
///
/// # Errors
/// A thread or its runtime that cannot be made.
pub(crate) fn serve<F, Fut>(
    listener: TcpListener,
    threads: NonZeroUsize,
    max_connections: NonZeroUsize,
    per_address: Arc<PerAddress>,
    name: &'static str,
    stop: impl Future<Output = ()> + Send + 'static,
    serve: F,
) -> std::io::Result<impl Future<Output = ()> + Send + 'static>
where
    F: Fn(Connections) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = ()>,
{
    let mut handoffs = Vec::with_capacity(threads.get());
    let mut done = Vec::with_capacity(threads.get());
    for index in 0..threads.get() {
        let (handoff, handed) = mpsc::channel(HANDOFF_QUEUE);
        let serve = serve.clone();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let (finished, finish) = tokio::sync::oneshot::channel::<()>();
        std::thread::Builder::new()
            .name(format!("{name}-{index}"))
            .spawn(move || {
                runtime.block_on(serve(Connections { handed }));
                let _ = finished.send(());
            })?;
        handoffs.push(handoff);
        done.push(finish);
    }
    let open: Arc<[AtomicUsize]> = (0..threads.get()).map(|_| AtomicUsize::new(0)).collect();
    let places = Arc::new(Semaphore::new(max_connections.get()));
    Ok(async move {
        accept(listener, &handoffs, &open, places, &per_address, name, stop).await;
        drop(handoffs);
        for finish in done {
            let _ = finish.await;
        }
    })
}

/// The acceptor of [`serve`], until `stop`.
async fn accept(
    listener: TcpListener,
    handoffs: &[mpsc::Sender<Handoff>],
    open: &Arc<[AtomicUsize]>,
    places: Arc<Semaphore>,
    per_address: &Arc<PerAddress>,
    name: &str,
    stop: impl Future<Output = ()>,
) {
    tokio::pin!(stop);
    loop {
        let (place, stream, peer) = tokio::select! {
            biased;
            () = &mut stop => return,
            accepted = sluice_door::accept_within(&listener, &places, Some(per_address), name) => match accepted {
                Some(accepted) => accepted,
                None => return,
            },
        };
        // Deregistered here, registered again with the thread's own reactor.
        let Ok(stream) = stream.into_std() else {
            continue;
        };
        // The fewest open first; a thread whose queue is full (its runtime
        // stalled) or that has stopped is passed over, and only when every
        // queue is full does the acceptor wait for a live thread's, never past
        // the stop.
        let mut order: Vec<usize> = (0..handoffs.len()).collect();
        order.sort_by_key(|&i| open[i].load(Ordering::Relaxed));
        let first = order[0];
        open[first].fetch_add(1, Ordering::Relaxed);
        let held = Held {
            _place: place,
            open: Arc::clone(open),
            thread: first,
        };
        let mut connection = Some((stream, peer, held));
        for &thread in &order {
            let Some(mut handoff) = connection.take() else {
                break;
            };
            handoff.2.move_to(thread);
            match handoffs[thread].try_send(handoff) {
                Ok(()) => {}
                // Full: its runtime is behind; closed: the thread has stopped.
                Err(
                    mpsc::error::TrySendError::Full(back) | mpsc::error::TrySendError::Closed(back),
                ) => connection = Some(back),
            }
        }
        if let Some(mut handoff) = connection {
            let Some(&live) = order.iter().find(|&&i| !handoffs[i].is_closed()) else {
                tracing::error!("{name}: every thread has stopped; no longer accepting");
                return;
            };
            handoff.2.move_to(live);
            let handed = tokio::select! {
                biased;
                () = &mut stop => return,
                handed = handoffs[live].send(handoff) => handed,
            };
            if handed.is_err() {
                tracing::warn!("{name}-{live} stopped; a connection from {peer} was dropped");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// No bound per address.
    fn unbounded() -> Arc<PerAddress> {
        PerAddress::new(NonZeroUsize::MAX, |_| true)
    }

    /// Starts [`serve`] with `threads` threads and at most `max` connections;
    /// each thread answers every connection, once, with its own index. Returns
    /// the address and the stop.
    fn start(threads: usize, max: usize) -> (SocketAddr, tokio::sync::oneshot::Sender<()>) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        listener.set_nonblocking(true).expect("nonblocking");
        let addr = listener.local_addr().expect("addr");
        let listener = TcpListener::from_std(listener).expect("a tokio listener");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let served = serve(
            listener,
            NonZeroUsize::new(threads).expect("threads"),
            NonZeroUsize::new(max).expect("max"),
            unbounded(),
            "test",
            async move {
                let _ = stopped.await;
            },
            |mut incoming: Connections| async move {
                let index = std::thread::current()
                    .name()
                    .and_then(|n| n.rsplit('-').next())
                    .and_then(|i| i.parse::<u8>().ok())
                    .unwrap_or(u8::MAX);
                while let Some((mut stream, _, held)) = incoming.accept().await {
                    tokio::spawn(async move {
                        let _ = stream.write_all(&[index]).await;
                        // Open until the client closes; let go before closing.
                        let mut rest = Vec::new();
                        let _ = stream.read_to_end(&mut rest).await;
                        drop(held);
                        drop(stream);
                    });
                }
            },
        )
        .expect("threads start");
        tokio::spawn(served);
        (addr, stop)
    }

    /// Connects and reads which thread serves the connection, or `None` when
    /// nothing is answered within `wait`.
    async fn thread_of(stream: &mut TcpStream, wait: Duration) -> Option<u8> {
        let mut index = [0_u8; 1];
        match tokio::time::timeout(wait, stream.read_exact(&mut index)).await {
            Ok(Ok(_)) => Some(index[0]),
            _ => None,
        }
    }

    /// R1 (Envoy holds a few long-lived connections to the rate-limit
    /// service): four connections on two threads are served two and two, and
    /// the next goes to the thread that has the fewest open, also after one
    /// closed.
    #[tokio::test]
    async fn r1_connections_go_to_the_thread_with_the_fewest_open() {
        let (addr, _stop) = start(2, 64);
        let mut connections = Vec::new();
        let mut on = [0_usize; 2];
        for _ in 0..4 {
            let mut stream = TcpStream::connect(addr).await.expect("connect");
            let thread = thread_of(&mut stream, Duration::from_secs(10))
                .await
                .expect("served");
            on[usize::from(thread)] += 1;
            connections.push((stream, thread));
        }
        assert_eq!(on, [2, 2], "two connections on each thread");

        // One closes; once its thread has let it go, the next goes there.
        // (One on the second thread: round robin would hand the next to the first.)
        let at = connections
            .iter()
            .position(|(_, thread)| *thread == 1)
            .expect("one on the second thread");
        let (mut closed, thread) = connections.remove(at);
        closed.shutdown().await.expect("close");
        let mut rest = Vec::new();
        let _ = closed.read_to_end(&mut rest).await;
        let mut next = TcpStream::connect(addr).await.expect("connect");
        let served = thread_of(&mut next, Duration::from_secs(10)).await;
        assert_eq!(served, Some(thread), "the thread with fewer open is next");
    }

    /// R1 bounds: the threads together hold at most the listener's bound of
    /// connections; the next waits in the backlog until one closes.
    #[tokio::test]
    async fn r1_the_threads_share_one_connection_bound() {
        let (addr, _stop) = start(2, 1);
        let mut first = TcpStream::connect(addr).await.expect("connect");
        assert!(
            thread_of(&mut first, Duration::from_secs(10))
                .await
                .is_some()
        );
        let mut second = TcpStream::connect(addr).await.expect("connect");
        assert!(
            thread_of(&mut second, Duration::from_millis(300))
                .await
                .is_none(),
            "one place for both threads: the second connection waits"
        );
        drop(first);
        assert!(
            thread_of(&mut second, Duration::from_secs(10))
                .await
                .is_some(),
            "served once the first closed"
        );
    }

    /// A thread that has stopped is passed over: its connections go to the
    /// others instead of being dropped.
    #[tokio::test]
    async fn a_thread_that_stopped_is_passed_over() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let stopped = Arc::new(tokio::sync::Notify::new());
        let stopping = Arc::clone(&stopped);
        let served = serve(
            listener,
            NonZeroUsize::new(2).expect("threads"),
            NonZeroUsize::new(64).expect("max"),
            unbounded(),
            "stopping",
            std::future::pending(),
            move |mut incoming: Connections| {
                let stopping = Arc::clone(&stopping);
                async move {
                    if std::thread::current().name() == Some("stopping-0") {
                        drop(incoming);
                        stopping.notify_one();
                        return;
                    }
                    while let Some((mut stream, _, held)) = incoming.accept().await {
                        tokio::spawn(async move {
                            let _ = stream.write_all(&[1]).await;
                            let mut rest = Vec::new();
                            let _ = stream.read_to_end(&mut rest).await;
                            drop(held);
                        });
                    }
                }
            },
        )
        .expect("threads start");
        tokio::spawn(served);
        stopped.notified().await;
        let mut open = Vec::new();
        for _ in 0..4 {
            let mut stream = TcpStream::connect(addr).await.expect("connect");
            assert_eq!(
                thread_of(&mut stream, Duration::from_secs(10)).await,
                Some(1),
                "served by the thread still running"
            );
            open.push(stream);
        }
    }

    /// The stop ends every thread's incoming connections and the acceptor.
    #[tokio::test]
    async fn the_stop_ends_the_acceptor_and_the_threads() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let served = serve(
            listener,
            NonZeroUsize::new(2).expect("threads"),
            NonZeroUsize::new(8).expect("max"),
            unbounded(),
            "test",
            async move {
                let _ = stopped.await;
            },
            |mut incoming: Connections| async move { while incoming.accept().await.is_some() {} },
        )
        .expect("threads start");
        let served = tokio::spawn(served);
        let _ = stop.send(());
        tokio::time::timeout(Duration::from_secs(10), served)
            .await
            .expect("ends after the stop")
            .expect("no panic");
    }
}
