//! The forward-auth listener (`sluice serve --check ADDR`): answers the check
//! requests of nginx's `auth_request`, Traefik's ForwardAuth and Caddy's
//! `forward_auth` with the gateway's one limiter, so a request decided here and
//! one through sluice's own proxy spend the same budgets (see
//! [`sluice_edge::forward_auth`]).
//!
//! `GET /check` and any path below it, with any method (nginx's subrequest keeps
//! the original's); the check request's body is never read. Every other path is
//! 404. HTTP/1.1 with keep-alive; at most [`PROXY_LISTENER_CONNECTIONS`](crate::PROXY_LISTENER_CONNECTIONS)
//! connections at once.
//!
//! A proxy asks once per request of its own, so the check's cost is mostly
//! the round trip. The listener runs as the gateway does, a thread per core
//! ([`crate::per_thread`]).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use sluice_edge::SharedLimiter;
use tokio::net::TcpListener;

use crate::Stop;
use crate::per_thread::Connections;
use crate::store::AnyStore;

/// How long a connection may take to send a request head.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// The largest request head decided (the original request's headers ride in
/// it), as the gateway's: a head past it, counted by
/// [`sluice_edge::request_head_len`], is answered 431. Hyper's read buffer is
/// capped at it too, so a head that fills the buffer unfinished is refused
/// (431) before it is parsed, and a connection holds no more than about twice it.
const MAX_HEAD_BYTES: usize = sluice_edge::MAX_REQUEST_HEAD_BYTES;
/// How long open connections get to finish once the listener stops.
const GRACE: Duration = Duration::from_secs(5);

/// True for `/check` and the paths below it.
fn is_check_path(path: &str) -> bool {
    path == "/check" || path.starts_with("/check/")
}

/// Serves `listener` with `limiter` on `threads` threads until `stop`, at
/// most `max_connections` connections at once in all (the next waits to be
/// accepted) and as many as `per_address` allows from one address; returns
/// once every thread has let its connections finish (at most [`GRACE`]).
///
/// # Errors
/// A thread or its runtime that cannot be made.
pub(crate) fn serve(
    listener: TcpListener,
    limiter: SharedLimiter<AnyStore>,
    threads: NonZeroUsize,
    max_connections: NonZeroUsize,
    per_address: Arc<sluice_door::PerAddress>,
    stop: Stop,
) -> std::io::Result<impl std::future::Future<Output = ()>> {
    let stopped = stop.clone();
    crate::per_thread::serve(
        listener,
        threads,
        max_connections,
        per_address,
        "sluice-check",
        async move { stopped.wait().await },
        move |incoming| serve_here(incoming, Arc::clone(&limiter), stop.clone()),
    )
}

/// One thread's share of [`serve`]: serves the connections handed to it
/// until `stop`.
async fn serve_here(mut incoming: Connections, limiter: SharedLimiter<AnyStore>, stop: Stop) {
    let mut http1 = http1::Builder::new();
    http1
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT)
        .max_buf_size(MAX_HEAD_BYTES);
    let graceful = GracefulShutdown::new();
    let stop = stop.wait();
    tokio::pin!(stop);
    loop {
        let (stream, peer, held) = tokio::select! {
            () = &mut stop => break,
            handed = incoming.accept() => match handed {
                Some(handed) => handed,
                None => break,
            },
        };
        let limiter = Arc::clone(&limiter);
        let service = service_fn(move |request: Request<Incoming>| {
            let limiter = Arc::clone(&limiter);
            async move { Ok::<_, Infallible>(answer(&limiter, &request, peer).await) }
        });
        let connection = graceful.watch(http1.serve_connection(TokioIo::new(stream), service));
        tokio::spawn(async move {
            let _held = held;
            // A connection error concerns that proxy connection only.
            let _ = connection.await;
        });
    }
    drop(incoming);
    let _ = tokio::time::timeout(GRACE, graceful.shutdown()).await;
}

/// The answer to one check request: 431 for a head past [`MAX_HEAD_BYTES`]
/// (hyper's buffer cap alone lets a head that arrives in a few reads grow to
/// about twice it), 404 off `/check`, else the limiter's decision.
async fn answer(
    limiter: &SharedLimiter<AnyStore>,
    request: &Request<Incoming>,
    peer: SocketAddr,
) -> Response<Full<Bytes>> {
    if sluice_edge::request_head_len(request.method(), request.uri(), request.headers())
        > MAX_HEAD_BYTES
    {
        return sluice_edge::request_head_too_large(MAX_HEAD_BYTES);
    }
    if !is_check_path(request.uri().path()) {
        return sluice_edge::envelope_response(
            StatusCode::NOT_FOUND,
            "not_found",
            "the check listener answers /check and the paths below it",
            serde_json::json!({}),
        );
    }
    let limiter = limiter.load();
    limiter.forward_auth(request.headers(), peer.ip()).await
}

#[cfg(test)]
mod tests {
    use super::is_check_path;

    #[test]
    fn r2_only_check_and_below_are_check_paths() {
        assert!(is_check_path("/check"));
        assert!(is_check_path("/check/api/v1"));
        assert!(!is_check_path("/checkout"));
        assert!(!is_check_path("/"));
        assert!(!is_check_path("/metrics"));
    }
}
