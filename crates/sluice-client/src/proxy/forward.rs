//! The forwarding side: `/<provider>/<path>` → `baseUrl/<path>`, paced.
//! Errors become responses here and only here.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::Response;
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode, header};
use sluice_core::Clock;
use sluice_store::BudgetStore;

use super::App;
use crate::call::{After, Call, MAX_ERROR_BODY, is_hop_by_hop, reconcile_on_end};
use crate::error::PaceError;
use crate::shrink::SHRINK_HEADER;
use crate::usage::UsageTap;

/// How long the proxy waited for room, on every paced answer.
pub(crate) const WAITED_HEADER: &str = "x-sluice-waited-ms";

pub(super) fn router<S: BudgetStore + 'static, C: Clock + 'static>(
    app: Arc<App<S, C>>,
) -> axum::Router {
    axum::Router::new()
        .fallback(forward::<S, C>)
        .with_state(app)
}

/// A JSON envelope answer `{"error":{"code","message","details"}}`.
pub(crate) fn envelope(
    status: StatusCode,
    body: &serde_json::Value,
    retry_after: Option<Duration>,
) -> Response {
    let mut r = Response::new(Body::from(body.to_string()));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    if let Some(d) = retry_after
        && let Ok(v) = HeaderValue::from_str(&d.as_secs_f64().ceil().max(1.0).to_string())
    {
        r.headers_mut().insert(header::RETRY_AFTER, v);
    }
    r
}

fn pace_error(e: &PaceError) -> Response {
    envelope(e.status(), &e.envelope(), e.retry_after())
}

fn simple_error(status: StatusCode, code: &str, message: &str) -> Response {
    envelope(
        status,
        &serde_json::json!({"error": {"code": code, "message": message, "details": {}}}),
        None,
    )
}

async fn forward<S: BudgetStore + 'static, C: Clock + 'static>(
    State(app): State<Arc<App<S, C>>>,
    req: Request,
) -> Response {
    let path = req.uri().path().to_owned();
    let query = req.uri().query().map(str::to_owned);
    let trimmed = path.trim_start_matches('/');
    let (provider, rest) = match trimmed.split_once('/') {
        Some((p, r)) => (p.to_owned(), format!("/{r}")),
        None => (trimmed.to_owned(), String::new()),
    };
    let config = app.pacer.config();
    let Some(p) = config.provider(&provider) else {
        return pace_error(&PaceError::UnknownProvider { provider });
    };
    let mut url = format!("{}{}", p.base_url, rest);
    if let Some(q) = query {
        url.push('?');
        url.push_str(&q);
    }
    let (parts, body) = req.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, config.pacer.max_body_bytes).await else {
        return simple_error(
            StatusCode::PAYLOAD_TOO_LARGE,
            "body_too_large",
            &format!(
                "request body larger than {} bytes (pacer.maxBodyBytes)",
                config.pacer.max_body_bytes
            ),
        );
    };
    let mut headers = HeaderMap::with_capacity(parts.headers.len());
    for (k, v) in &parts.headers {
        if is_hop_by_hop(k)
            || k == header::HOST
            || k == header::CONTENT_LENGTH
            // Identity answers: usage must be readable on the way back.
            || k == header::ACCEPT_ENCODING
        {
            continue;
        }
        headers.append(k.clone(), v.clone());
    }
    if let Some(key) = &p.api_key {
        headers.remove(header::AUTHORIZATION);
        headers.remove("x-api-key");
        if let Ok(v) = HeaderValue::from_str(&p.auth_value(key)) {
            headers.insert(p.auth_header.clone(), v);
        }
    }
    let mut call = match Call::new(&app.pacer, &provider, parts.method, &rest, headers, bytes) {
        Ok(c) => c,
        Err(e) => return pace_error(&e),
    };
    loop {
        let permit = match call.acquire().await {
            Ok(p) => p,
            Err(e) => return pace_error(&e),
        };
        let waited = permit.waited();
        let sent = app
            .client
            .request(call.method.clone(), &url)
            .headers(call.headers.clone())
            .body(call.body())
            .send()
            .await;
        let resp = match sent {
            Ok(r) => r,
            Err(e) => {
                // Never arrived: the provider counted nothing.
                let _ = permit.cancel().await;
                return simple_error(
                    StatusCode::BAD_GATEWAY,
                    "upstream_unreachable",
                    &format!("{provider}: {e}"),
                );
            }
        };
        let status = resp.status();
        let mut rheaders = HeaderMap::with_capacity(resp.headers().len());
        for (k, v) in resp.headers() {
            if !is_hop_by_hop(k) {
                rheaders.append(k.clone(), v.clone());
            }
        }
        if let Some(r) = call.shrink_report()
            && let Ok(v) = HeaderValue::from_str(&r.header_value())
        {
            rheaders.insert(SHRINK_HEADER, v);
        }
        if let Ok(v) = HeaderValue::from_str(&waited.as_millis().to_string()) {
            rheaders.insert(WAITED_HEADER, v);
        }
        if Call::<S, C>::wants_body(status) {
            let bytes = read_limited(resp, MAX_ERROR_BODY).await;
            match call.after(permit, status, &rheaders, Some(&bytes)).await {
                After::Retry(d) => {
                    tokio::time::sleep(d).await;
                    continue;
                }
                After::Deliver(_) => {
                    rheaders.remove(header::CONTENT_LENGTH);
                    return respond(status, rheaders, Body::from(bytes));
                }
            }
        }
        let next = call.after(permit, status, &rheaders, None).await;
        let ct = rheaders
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let upstream: http::Response<reqwest::Body> = resp.into();
        let body = match next {
            After::Deliver(Some(permit)) => Body::new(UsageTap::new(
                upstream.into_body(),
                ct.as_deref(),
                reconcile_on_end(permit),
            )),
            _ => Body::new(upstream.into_body()),
        };
        return respond(status, rheaders, body);
    }
}

fn respond(status: StatusCode, headers: HeaderMap, body: Body) -> Response {
    let mut r = Response::new(body);
    *r.status_mut() = status;
    *r.headers_mut() = headers;
    r
}

async fn read_limited(mut resp: reqwest::Response, limit: usize) -> Bytes {
    let mut out = Vec::new();
    while let Ok(Some(chunk)) = resp.chunk().await {
        if out.len() + chunk.len() > limit {
            break;
        }
        out.extend_from_slice(&chunk);
    }
    Bytes::from(out)
}
