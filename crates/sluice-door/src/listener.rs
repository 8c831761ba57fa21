//! Serves a listener's router over HTTP/1.1 with a bound on open connections
//! and a deadline for each request head: the admin listeners and the pacer's
//! proxy. (`axum::serve` has neither, so silent sockets could pile up until
//! the process, gateway or pacer and all, runs out of descriptors.)

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::ConnectInfo;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tower::ServiceExt;

use crate::per_address::{AddressSlot, PerAddress};

/// What a listener holds and how long it waits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bounds {
    /// The most connections open at once (the next waits to be accepted).
    pub max_connections: usize,
    /// How long a request head may take, also the longest a kept-alive
    /// connection may sit idle between requests.
    pub head_timeout: Duration,
    /// How long open connections get to finish once the listener stops;
    /// `None`: as long as they take.
    pub grace: Option<Duration>,
}

/// An admin listener's: 256 connections, a head within 10 s, 5 s to finish.
pub const ADMIN_BOUNDS: Bounds = Bounds {
    max_connections: 256,
    head_timeout: Duration::from_secs(10),
    grace: Some(Duration::from_secs(5)),
};
/// How long the loop waits after a failed accept (out of descriptors and the
/// like), as the gateway does.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// What an accepted connection holds until it closes: its place under the
/// listener's connection bound and, from an address that is counted, its
/// place under the per-address bound.
#[derive(Debug)]
pub struct Place {
    _permit: OwnedSemaphorePermit,
    _address: Option<AddressSlot>,
}

/// Waits for one of `places`, then accepts a connection on `listener` (with
/// `TCP_NODELAY`), holding the place for it; with `per_address`, a
/// connection from an address that holds its bound already is closed at once
/// (counted in `sluice_connections_refused_total{reason="per_ip",listener=name}`)
/// and the next one accepted instead. A failed accept (out of descriptors and
/// the like) is logged under `name` and tried again after a moment. `None`
/// once `places` is closed. Cancel-safe: dropped while waiting, it gives the
/// place back and loses no connection.
pub async fn accept_within(
    listener: &TcpListener,
    places: &Arc<Semaphore>,
    per_address: Option<&Arc<PerAddress>>,
    name: &str,
) -> Option<(Place, TcpStream, SocketAddr)> {
    let permit = Arc::clone(places).acquire_owned().await.ok()?;
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                let address = match per_address.map(|table| table.admit(peer.ip())) {
                    None | Some(Ok(None)) => None,
                    Some(Ok(Some(slot))) => Some(slot),
                    Some(Err(_)) => {
                        metrics::counter!(
                            "sluice_connections_refused_total",
                            "reason" => "per_ip",
                            "listener" => name.to_owned()
                        )
                        .increment(1);
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let place = Place {
                    _permit: permit,
                    _address: address,
                };
                return Some((place, stream, peer));
            }
            Err(error) => {
                tracing::warn!("{name}: accept failed: {error}");
                tokio::time::sleep(ACCEPT_BACKOFF).await;
            }
        }
    }
}

/// Serves `router` (behind its door, [`guard`](crate::guard)) on `listener`
/// until `stop`, within `bounds`, the peer's address in each request's
/// [`ConnectInfo`]. Returns once the open connections have finished (within
/// the bounds' grace).
pub async fn serve(
    listener: TcpListener,
    router: Router,
    bounds: Bounds,
    stop: impl std::future::Future<Output = ()>,
) {
    serve_over(listener, router, bounds, None, stop).await;
}

/// As [`serve`], over TLS when `tls` is given: each connection's handshake must
/// finish within the bounds' head timeout (a stalled one is closed and counted in
/// `sluice_tls_handshakes_failed_total{listener="admin",reason="timeout"}`).
pub async fn serve_over(
    listener: TcpListener,
    router: Router,
    bounds: Bounds,
    tls: Option<tokio_rustls::TlsAcceptor>,
    stop: impl std::future::Future<Output = ()>,
) {
    let mut http1 = http1::Builder::new();
    http1
        .timer(TokioTimer::new())
        .header_read_timeout(bounds.head_timeout);
    let places = Arc::new(Semaphore::new(bounds.max_connections.max(1)));
    let graceful = GracefulShutdown::new();
    tokio::pin!(stop);
    loop {
        let (place, stream, peer) = tokio::select! {
            () = &mut stop => break,
            accepted = accept_within(&listener, &places, None, "admin listener") => match accepted {
                Some(accepted) => accepted,
                None => break,
            },
        };
        let router = router.clone();
        let service = service_fn(move |mut request: hyper::Request<Incoming>| {
            request.extensions_mut().insert(ConnectInfo(peer));
            let answered = router.clone().oneshot(request.map(axum::body::Body::new));
            async move { Ok::<_, Infallible>(answered.await.unwrap_or_else(|never| match never {})) }
        });
        if let Some(acceptor) = &tls {
            let (acceptor, http1) = (acceptor.clone(), http1.clone());
            let watcher = graceful.watcher();
            let head_timeout = bounds.head_timeout;
            tokio::spawn(async move {
                let _place = place;
                let stream = match tokio::time::timeout(head_timeout, acceptor.accept(stream)).await
                {
                    Ok(Ok(stream)) => stream,
                    Ok(Err(_)) => {
                        metrics::counter!("sluice_tls_handshakes_failed_total",
                                "listener" => "admin", "reason" => "error")
                        .increment(1);
                        return;
                    }
                    Err(_) => {
                        metrics::counter!("sluice_tls_handshakes_failed_total",
                                "listener" => "admin", "reason" => "timeout")
                        .increment(1);
                        metrics::counter!("sluice_slow_heads_total", "listener" => "admin")
                            .increment(1);
                        return;
                    }
                };
                let _ = watcher
                    .watch(http1.serve_connection(TokioIo::new(stream), service))
                    .await;
            });
            continue;
        }
        let connection = graceful.watch(http1.serve_connection(TokioIo::new(stream), service));
        tokio::spawn(async move {
            let _place = place;
            // A connection error concerns that client only.
            let _ = connection.await;
        });
    }
    drop(listener);
    match bounds.grace {
        Some(grace) => {
            let _ = tokio::time::timeout(grace, graceful.shutdown()).await;
        }
        None => graceful.shutdown().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::routing::get;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn start(max: usize, head_timeout: Duration) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let router = Router::new().route(
            "/peer",
            get(|ConnectInfo(peer): ConnectInfo<SocketAddr>| async move { peer.to_string() }),
        );
        let bounds = Bounds {
            max_connections: max,
            head_timeout,
            grace: None,
        };
        tokio::spawn(serve(listener, router, bounds, std::future::pending()));
        addr
    }

    /// Sends one request and reads the answer up to the end of its body.
    async fn ask(stream: &mut tokio::net::TcpStream, wait: Duration) -> Option<String> {
        stream
            .write_all(b"GET /peer HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .ok()?;
        let mut answer = Vec::new();
        let mut chunk = [0_u8; 1024];
        loop {
            let n = tokio::time::timeout(wait, stream.read(&mut chunk))
                .await
                .ok()?
                .ok()?;
            if n == 0 {
                return None;
            }
            answer.extend_from_slice(&chunk[..n]);
            let text = String::from_utf8_lossy(&answer).into_owned();
            if let Some((head, body)) = text.split_once("\r\n\r\n")
                && let Some(length) = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length: "))
                    .and_then(|l| l.trim().parse::<usize>().ok())
                && body.len() >= length
            {
                return Some(text);
            }
        }
    }

    /// Bounds: the listener holds at most its bound of connections (the next
    /// waits), and tells each request its peer's address.
    #[tokio::test]
    async fn the_admin_listener_holds_at_most_its_connections() {
        let addr = start(1, Duration::from_secs(10)).await;
        let mut first = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let answer = ask(&mut first, Duration::from_secs(10))
            .await
            .expect("served");
        let local = first.local_addr().expect("local").to_string();
        assert!(answer.ends_with(&local), "the peer's address: {answer}");
        let mut second = tokio::net::TcpStream::connect(addr).await.expect("connect");
        assert!(
            ask(&mut second, Duration::from_millis(300)).await.is_none(),
            "one place: the second connection waits"
        );
        drop(first);
        assert!(
            ask(&mut second, Duration::from_secs(10)).await.is_some(),
            "served once the first closed"
        );
    }

    /// Bounds: a connection that sends no request head in time is closed, so
    /// silent sockets give their places back.
    #[tokio::test]
    async fn a_silent_admin_connection_is_closed() {
        let addr = start(8, Duration::from_millis(100)).await;
        let mut silent = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let mut byte = [0_u8; 1];
        let read = tokio::time::timeout(Duration::from_secs(10), silent.read(&mut byte))
            .await
            .expect("closed by the listener, not left open");
        assert!(matches!(read, Ok(0) | Err(_)), "closed: {read:?}");
    }
}
