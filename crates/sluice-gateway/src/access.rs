//! Request ids and the access log on the hyper path (the fast path does the same in
//! `h1`): every request gets an id (`X-Request-Id`: the client's own when it
//! sent one sane one, see [`RequestId::pick`]), which is passed to the upstream,
//! returned to the client and named by the request's log lines; with the access log
//! on, one `sluice::access` line per request.

use std::net::IpAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use http::{Request, Response};
use sluice_edge::{RequestId, X_REQUEST_ID};
use sluice_tower::PeerAddr;
use tower::Service;

/// Writes one access line (target `sluice::access`). The path is logged without its
/// query, which may hold a credential.
pub(crate) fn log(
    id: &RequestId,
    method: &str,
    path: &str,
    status: u16,
    elapsed: Duration,
    peer: IpAddr,
    complete: bool,
) {
    tracing::info!(
        target: "sluice::access",
        request_id = id.as_str(),
        method,
        path,
        status,
        duration_ms = elapsed.as_secs_f64() * 1000.0,
        peer = %peer,
        complete,
        "request"
    );
}

/// Wraps the gateway's service stack: picks each request's id, sets it on the
/// request (`X-Request-Id`, and the [`RequestId`] extension the limiter logs refusals
/// with) and on the response, and writes the access line when `access_log` is on.
#[derive(Clone, Debug)]
pub(crate) struct RequestIds<I> {
    inner: I,
    access_log: bool,
}

impl<I> RequestIds<I> {
    /// `inner` with request ids, and access lines when `access_log`.
    pub(crate) fn new(inner: I, access_log: bool) -> Self {
        RequestIds { inner, access_log }
    }
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<I, B, RB> Service<Request<B>> for RequestIds<I>
where
    I: Service<Request<B>, Response = Response<RB>>,
    I::Future: Send + 'static,
{
    type Response = Response<RB>;
    type Error = I::Error;
    type Future = BoxFuture<Result<Response<RB>, I::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request<B>) -> Self::Future {
        let id = RequestId::pick(
            request
                .headers()
                .get_all(X_REQUEST_ID)
                .iter()
                .map(|v| v.as_bytes()),
        );
        request
            .headers_mut()
            .insert(X_REQUEST_ID, id.header_value());
        request.extensions_mut().insert(id);
        let access = self.access_log.then(|| {
            (
                request.method().clone(),
                request.uri().path().to_owned(),
                request
                    .extensions()
                    .get::<PeerAddr>()
                    .map_or(IpAddr::from([0, 0, 0, 0]), |p| p.0.ip()),
                Instant::now(),
            )
        });
        let answer = self.inner.call(request);
        Box::pin(async move {
            let mut response = answer.await?;
            response
                .headers_mut()
                .insert(X_REQUEST_ID, id.header_value());
            if let Some((method, path, peer, began)) = access {
                log(
                    &id,
                    method.as_str(),
                    &path,
                    response.status().as_u16(),
                    began.elapsed(),
                    peer,
                    true,
                );
            }
            Ok(response)
        })
    }
}
