//! The gateway's accept loop: one HTTP/1.1 or HTTP/2 connection per accepted socket,
//! each driving a clone of the service stack (any `Service<Request<GatewayBody>>`
//! answering any streaming body) wrapped in [`Metered`], and a graceful drain when told
//! to stop.

use std::net::SocketAddr;
use std::time::Duration;

use http::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tower::Service;

use super::GatewayBody;
use super::metered::{Metered, RequestStats};
use super::proxy::BoxError;

/// A client that has not sent complete request headers within this time is dropped.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);

/// Pause after a failed `accept` (e.g. out of file descriptors) before trying again.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// How the drain ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Drain {
    /// Every connection finished its in-flight requests and closed.
    Complete,
    /// The grace period ran out before every connection closed; `connections` were
    /// open when the drain began.
    TimedOut { connections: usize },
}

/// Serves `listener` with `service` until `stop` resolves, then stops accepting and
/// waits up to `grace` for open connections to finish their in-flight requests.
pub(super) async fn serve<S, B>(
    listener: TcpListener,
    service: S,
    stats: RequestStats,
    stop: impl Future<Output = ()>,
    grace: Duration,
) -> Drain
where
    S: Service<Request<GatewayBody>, Response = Response<B>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT);
    let graceful = GracefulShutdown::new();
    tokio::pin!(stop);

    loop {
        let (stream, peer): (_, SocketAddr) = tokio::select! {
            biased;
            () = &mut stop => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    eprintln!("sluice: accept failed: {error}");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(Metered::new(service.clone(), peer, stats.clone()));
        let connection = builder
            .serve_connection(TokioIo::new(stream), service)
            .into_owned();
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            // A connection error (reset, malformed request) concerns that client only.
            let _ = connection.await;
        });
    }

    drop(listener);
    let open = graceful.count();
    match tokio::time::timeout(grace, graceful.shutdown()).await {
        Ok(()) => Drain::Complete,
        Err(_) => Drain::TimedOut { connections: open },
    }
}
