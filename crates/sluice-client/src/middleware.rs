//! The pacer as a reqwest middleware (documented on [`PacerMiddleware`]).

use std::sync::Arc;

use bytes::Bytes;
use http::Extensions;
use reqwest::ResponseBuilderExt;
use reqwest_middleware::{Middleware, Next};
use sluice_core::Clock;
use sluice_store::BudgetStore;

use crate::call::{After, Call, MAX_ERROR_BODY, hint_headers, read_head, reconcile_on_end, rejoin};
use crate::pacer::Pacer;
use crate::shrink::SHRINK_HEADER;
use crate::usage::UsageTap;

/// Names the provider of one request (in `reqwest_middleware`'s extensions).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PaceProvider(pub String);

/// The pacer as a [`reqwest_middleware::Middleware`]: the requests of a
/// `reqwest_middleware::ClientWithMiddleware` to one provider are estimated,
/// paced, retried with backoff and reconciled with their usage.
///
/// Only requests whose body is in memory (`.body(bytes)` / `.json(..)`) are
/// estimated; a streamed body is sent as is, counted as a request of no
/// tokens. A different provider for one request can be named with a
/// [`PaceProvider`] in the request's extensions.
///
/// **Read each answer to its end** (`.json()`, `.text()`, `.bytes()` or the
/// whole stream): the answer's `usage` replaces the request's estimate only
/// when its body ends. An answer dropped unread leaves the estimate (prompt
/// plus the most it may complete) counted in the window: never too little,
/// but the room it did not use comes back only when it leaves the window.
///
/// **Build the client with [`same_origin_redirects`](crate::same_origin_redirects)**
/// when the provider has keys (`apiKeys`): the middleware puts the chosen key
/// on the request, and reqwest's own redirect policy would carry a key in
/// `x-api-key` (or any header but `Authorization`) to another host.
///
/// ```
/// use serde_json::{Value, json};
/// use sluice_client::config::{PaceConfig, ProviderConfig, ProviderLimits};
/// use sluice_client::{Pacer, PacerMiddleware};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # use tokio::io::{AsyncReadExt, AsyncWriteExt};
/// # let provider = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
/// # let base_url = format!("http://{}/v1", provider.local_addr()?);
/// # tokio::spawn(async move {
/// #     let (mut conn, _) = provider.accept().await.unwrap();
/// #     let mut buf = vec![0; 4096];
/// #     let _ = conn.read(&mut buf).await;
/// #     let body = r#"{"usage":{"prompt_tokens":9,"completion_tokens":33,"total_tokens":42}}"#;
/// #     let head = format!("HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n", body.len());
/// #     conn.write_all(format!("{head}{body}").as_bytes()).await.unwrap();
/// # });
/// let limits = ProviderLimits::new(30_000, 500, 0);
/// let config = PaceConfig::from_providers([ProviderConfig::new("openai", &base_url, limits)]);
/// let pacer = Pacer::from_config(config);
/// let http = reqwest::Client::builder()
///     .redirect(sluice_client::same_origin_redirects())
///     .build()?;
/// let client = reqwest_middleware::ClientBuilder::new(http)
///     .with(PacerMiddleware::new(pacer.clone(), "openai"))
///     .build();
///
/// let chat = json!({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]});
/// let answer: Value = client
///     .post(format!("{base_url}/chat/completions"))
///     .body(chat.to_string())
///     .header("content-type", "application/json")
///     .send()
///     .await?
///     .json() // read to the end: its usage replaces the estimate
///     .await?;
/// assert_eq!(answer["usage"]["total_tokens"], 42);
/// # for _ in 0..10 { tokio::task::yield_now().await; }
/// assert_eq!(pacer.stats("openai").admitted, 1);
/// assert_eq!(pacer.tokens_in_window("openai").await?, 42);
/// # Ok(())
/// # }
/// ```
pub struct PacerMiddleware<S: BudgetStore + 'static, C: Clock + 'static> {
    pacer: Pacer<S, C>,
    provider: Arc<str>,
}

impl<S: BudgetStore + 'static, C: Clock + 'static> PacerMiddleware<S, C> {
    /// Paces requests to `provider` (a name in the pacer's config).
    pub fn new(pacer: Pacer<S, C>, provider: &str) -> Self {
        PacerMiddleware {
            pacer,
            provider: provider.into(),
        }
    }
}

fn rebuild(
    status: http::StatusCode,
    version: http::Version,
    url: reqwest::Url,
    headers: http::HeaderMap,
    body: reqwest::Body,
) -> reqwest::Response {
    let mut b = http::Response::builder()
        .status(status)
        .version(version)
        .url(url);
    if let Some(h) = b.headers_mut() {
        *h = headers;
    }
    match b.body(body) {
        Ok(r) => reqwest::Response::from(r),
        // Status, version and headers came from a valid response.
        Err(_) => reqwest::Response::from(http::Response::new(reqwest::Body::from(Bytes::new()))),
    }
}

#[async_trait::async_trait]
impl<S: BudgetStore + 'static, C: Clock + 'static> Middleware for PacerMiddleware<S, C> {
    async fn handle(
        &self,
        req: reqwest::Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<reqwest::Response> {
        let provider = extensions
            .get::<PaceProvider>()
            .map_or_else(|| self.provider.to_string(), |p| p.0.clone());
        let body = req
            .body()
            .and_then(reqwest::Body::as_bytes)
            .map(Bytes::copy_from_slice);
        let streamed = req.body().is_some() && body.is_none();
        if streamed {
            // Cannot be read or sent twice: pace it as a request, no retry.
            let permit = self
                .pacer
                .acquire(&provider, 0u32)
                .await
                .map_err(reqwest_middleware::Error::middleware)?;
            let resp = next.run(req, extensions).await;
            if let Ok(r) = &resp {
                // Not sent again, but what its answer says holds for the
                // calls after it: the provider's books (SPEC C6), and a 429's
                // wait for everyone on the key (C5), at least a second.
                let _ = permit.observe(r.headers()).await;
                if r.status() == http::StatusCode::TOO_MANY_REQUESTS {
                    let hint = match crate::backoff::classify(r.status(), r.headers(), None) {
                        crate::backoff::Retryable::Yes { hint } => hint,
                        crate::backoff::Retryable::No => None,
                    };
                    let wait = hint
                        .filter(|h| !h.is_zero())
                        .unwrap_or(crate::backoff::MIN_BACKOFF);
                    let _ = self.pacer.hold(&provider, wait).await;
                }
            }
            drop(permit);
            return resp;
        }
        let url = req.url().clone();
        let timeout = req.timeout().copied();
        let version = req.version();
        let mut call = Call::new(
            &self.pacer,
            &provider,
            req.method().clone(),
            url.path(),
            req.headers().clone(),
            body.unwrap_or_default(),
        )
        .map_err(reqwest_middleware::Error::middleware)?;
        loop {
            let permit = call
                .acquire()
                .await
                .map_err(reqwest_middleware::Error::middleware)?;
            let mut out = reqwest::Request::new(call.method.clone(), url.clone());
            *out.headers_mut() = call.headers.clone();
            *out.body_mut() = Some(reqwest::Body::from(call.body()));
            *out.timeout_mut() = timeout;
            *out.version_mut() = version;
            let resp = next.clone().run(out, extensions).await?;
            let status = resp.status();
            let mut headers = resp.headers().clone();
            let rurl = resp.url().clone();
            let rversion = resp.version();
            if Call::<S, C>::wants_body(status) {
                // At most MAX_ERROR_BODY is read to decide; a longer body
                // goes back whole.
                let body = http::Response::<reqwest::Body>::from(resp).into_body();
                let (head, rest) = read_head(body, MAX_ERROR_BODY).await?;
                match call.after(permit, status, &headers, Some(&head)).await {
                    After::Retry(d) => {
                        tokio::time::sleep(d).await;
                        continue;
                    }
                    After::Deliver(_) => {
                        hint_headers(status, &mut headers, &head);
                        let body = match rest {
                            None => head.into(),
                            Some(rest) => reqwest::Body::wrap(rejoin(head, rest)),
                        };
                        return Ok(rebuild(status, rversion, rurl, headers, body));
                    }
                }
            }
            let next_step = call.after(permit, status, &headers, None).await;
            let After::Deliver(Some(permit)) = next_step else {
                return Ok(resp);
            };
            if let Some(r) = call.shrink_report()
                && let Ok(v) = http::HeaderValue::from_str(&r.header_value())
            {
                headers.insert(SHRINK_HEADER, v);
            }
            let ct = headers
                .get(http::header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned);
            let http_resp: http::Response<reqwest::Body> = resp.into();
            let tapped = UsageTap::new(
                http_resp.into_body(),
                ct.as_deref(),
                reconcile_on_end(permit),
            );
            return Ok(rebuild(
                status,
                rversion,
                rurl,
                headers,
                reqwest::Body::wrap(tapped),
            ));
        }
    }
}
