//! The pacer as a tower layer (documented on [`PacerLayer`]).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::Body;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, Limited};
use sluice_core::Clock;
use sluice_store::BudgetStore;
use tower::{Layer, Service, ServiceExt};

use crate::call::{After, Call, MAX_ERROR_BODY, hint_headers, read_head, reconcile_on_end, rejoin};
use crate::pacer::Pacer;
use crate::shrink::SHRINK_HEADER;
use crate::usage::UsageTap;

/// Errors of the layered service (a [`crate::PaceError`], the inner
/// service's error, or a body error).
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The answer body of a [`PacerService`].
pub type PacedBody = UnsyncBoxBody<Bytes, BoxError>;

/// The pacer as a tower layer, for a client stack of
/// `Service<http::Request<…>>` talking to one provider.
///
/// The request body is read (to estimate it), the request waits for room,
/// the inner service is called (again, after a backoff, on 429 and
/// retryable 5xx), and the answer's body streams back through a
/// [`UsageTap`] that reconciles the reservation when it ends. Pacing errors
/// come back as a boxed [`PaceError`](crate::PaceError).
///
/// **Read each answer's body to its end**: the usage it reports replaces
/// the request's estimate only then. A body dropped unread leaves the
/// estimate counted until it leaves the window.
///
/// ```
/// use bytes::Bytes;
/// use http_body_util::{BodyExt, Full};
/// use sluice_client::config::{PaceConfig, ProviderConfig, ProviderLimits};
/// use sluice_client::{Pacer, PacerLayer};
/// use tower::{ServiceBuilder, ServiceExt};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// let limits = ProviderLimits::new(30_000, 0, 0);
/// let config = PaceConfig::from_providers([ProviderConfig::new("openai", "http://127.0.0.1:9", limits)]);
/// let pacer = Pacer::from_config(config);
/// // Any `Service<http::Request<_>>` that calls the provider; here, a stand-in.
/// let provider = tower::service_fn(|_req: http::Request<_>| async {
///     let body = r#"{"usage":{"total_tokens":42}}"#;
///     Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(Bytes::from(body))))
/// });
/// let client = ServiceBuilder::new()
///     .layer(PacerLayer::new(pacer.clone(), "openai"))
///     .service(provider);
///
/// let request = http::Request::post("http://127.0.0.1:9/v1/chat/completions")
///     .body(Full::new(Bytes::from(r#"{"messages":[{"role":"user","content":"hi"}]}"#)))?;
/// let answer = client.oneshot(request).await?;
/// let body = answer.into_body().collect().await?.to_bytes(); // to the end
/// assert!(body.starts_with(b"{\"usage\""));
/// # for _ in 0..10 { tokio::task::yield_now().await; }
/// assert_eq!(pacer.tokens_in_window("openai").await?, 42);
/// # Ok(())
/// # }
/// ```
pub struct PacerLayer<S: BudgetStore + 'static, C: Clock + 'static> {
    pacer: Pacer<S, C>,
    provider: Arc<str>,
}

impl<S: BudgetStore + 'static, C: Clock + 'static> Clone for PacerLayer<S, C> {
    fn clone(&self) -> Self {
        PacerLayer {
            pacer: self.pacer.clone(),
            provider: self.provider.clone(),
        }
    }
}

impl<S: BudgetStore + 'static, C: Clock + 'static> PacerLayer<S, C> {
    /// A layer pacing calls to `provider` (a name in the pacer's config).
    pub fn new(pacer: Pacer<S, C>, provider: &str) -> Self {
        PacerLayer {
            pacer,
            provider: provider.into(),
        }
    }
}

impl<I, S: BudgetStore + 'static, C: Clock + 'static> Layer<I> for PacerLayer<S, C> {
    type Service = PacerService<I, S, C>;

    fn layer(&self, inner: I) -> Self::Service {
        PacerService {
            inner,
            pacer: self.pacer.clone(),
            provider: self.provider.clone(),
        }
    }
}

/// See [`PacerLayer`].
pub struct PacerService<I, S: BudgetStore + 'static, C: Clock + 'static> {
    inner: I,
    pacer: Pacer<S, C>,
    provider: Arc<str>,
}

impl<I: Clone, S: BudgetStore + 'static, C: Clock + 'static> Clone for PacerService<I, S, C> {
    fn clone(&self) -> Self {
        PacerService {
            inner: self.inner.clone(),
            pacer: self.pacer.clone(),
            provider: self.provider.clone(),
        }
    }
}

impl<I, B, RB, S, C> Service<http::Request<B>> for PacerService<I, S, C>
where
    I: Service<http::Request<Full<Bytes>>, Response = http::Response<RB>> + Clone + Send + 'static,
    I::Future: Send,
    I::Error: Into<BoxError>,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    RB: Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
    S: BudgetStore + 'static,
    C: Clock + 'static,
{
    type Response = http::Response<PacedBody>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        // Waiting happens inside the call, with a deadline; readiness of the
        // inner service is awaited there too.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let inner = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, inner);
        let pacer = self.pacer.clone();
        let provider = self.provider.clone();
        Box::pin(paced(inner, pacer, provider, req))
    }
}

async fn paced<I, B, RB, S, C>(
    mut inner: I,
    pacer: Pacer<S, C>,
    provider: Arc<str>,
    req: http::Request<B>,
) -> Result<http::Response<PacedBody>, BoxError>
where
    I: Service<http::Request<Full<Bytes>>, Response = http::Response<RB>> + Send,
    I::Error: Into<BoxError>,
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
    RB: Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
    S: BudgetStore + 'static,
    C: Clock + 'static,
{
    let max_body = pacer.config().pacer.max_body_bytes;
    let (parts, body) = req.into_parts();
    let bytes = Limited::new(body, max_body).collect().await?.to_bytes();
    let mut call = Call::new(
        &pacer,
        &provider,
        parts.method.clone(),
        parts.uri.path(),
        parts.headers.clone(),
        bytes,
    )?;
    loop {
        let permit = call.acquire().await?;
        let mut out = http::Request::new(Full::new(call.body()));
        *out.method_mut() = call.method.clone();
        *out.uri_mut() = parts.uri.clone();
        *out.version_mut() = parts.version;
        *out.headers_mut() = call.headers.clone();
        let svc = inner.ready().await.map_err(Into::into)?;
        let resp = svc.call(out).await.map_err(Into::into)?;
        let (mut rparts, rbody) = resp.into_parts();
        let (buffered, rbody) = if Call::<S, C>::wants_body(rparts.status) {
            // At most MAX_ERROR_BODY is read to decide; a longer body goes
            // back whole. A body that breaks off is taken as empty (the
            // answer may still be retried).
            let (head, rest) = read_head(Box::pin(rbody), MAX_ERROR_BODY)
                .await
                .unwrap_or_default();
            (Some((head, rest)), None)
        } else {
            (None, Some(rbody))
        };
        let next = call
            .after(
                permit,
                rparts.status,
                &rparts.headers,
                buffered.as_ref().map(|(head, _)| &head[..]),
            )
            .await;
        match (next, buffered) {
            (After::Retry(d), _) => tokio::time::sleep(d).await,
            (After::Deliver(_), Some((head, rest))) => {
                hint_headers(rparts.status, &mut rparts.headers, &head);
                let body = match rest {
                    None => Full::new(head).map_err(|e| match e {}).boxed_unsync(),
                    Some(rest) => rejoin(head, rest.map_err(Into::<BoxError>::into)).boxed_unsync(),
                };
                return Ok(http::Response::from_parts(rparts, body));
            }
            (After::Deliver(permit), None) => {
                let Some(rbody) = rbody else {
                    return Err("answer body missing".into());
                };
                if let Some(r) = call.shrink_report()
                    && let Ok(v) = http::HeaderValue::from_str(&r.header_value())
                {
                    rparts.headers.insert(SHRINK_HEADER, v);
                }
                let ct = rparts
                    .headers
                    .get(http::header::CONTENT_TYPE)
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_owned);
                let body = match permit {
                    Some(p) => UsageTap::new(rbody, ct.as_deref(), reconcile_on_end(p))
                        .map_err(Into::into)
                        .boxed_unsync(),
                    None => rbody.map_err(Into::into).boxed_unsync(),
                };
                return Ok(http::Response::from_parts(rparts, body));
            }
        }
    }
}
