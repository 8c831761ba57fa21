//! The forwarding side: `/<provider>/<path>` → `baseUrl/<path>`, paced.
//! Errors become responses here and only here.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::Response;
use http::{HeaderMap, HeaderValue, StatusCode, header};
use sluice_core::Clock;
use sluice_store::BudgetStore;

use super::App;
use super::stream::HideUsage;
use crate::call::{
    After, Call, MAX_ERROR_BODY, hint_headers, is_hop_by_hop, read_head, reconcile_on_end, rejoin,
};
use crate::config::ProviderConfig;
use crate::error::PaceError;
use crate::shrink::{SHRINK_HEADER, ShrinkReport};
use crate::usage::UsageTap;

/// How long the proxy waited for room, on every paced answer.
pub(crate) const WAITED_HEADER: &str = "x-sluice-waited-ms";
/// Which budget paced the request, on every paced answer: `model=<group>`
/// (its model's limits and the provider-wide ones), or `provider` when it
/// named no model that `models:` covers (the provider-wide limits alone).
pub const BUDGET_HEADER: &str = "x-sluice-budget";
/// The name of the key the request went with, when the provider has several
/// (`apiKeys`); never the key itself.
pub const KEY_HEADER: &str = "x-sluice-key";

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
    let (parts, body) = req.into_parts();
    let config = app.pacer.config();
    if let Err(refusal) = admit(&app, &config.pacer, &parts) {
        return sluice_door::refused(&refusal);
    }
    let path = parts.uri.path();
    // Before the provider is chosen: a path that could leave its base path
    // is sent nowhere.
    if let Some(why) = super::path::refusal(path) {
        return envelope(
            StatusCode::BAD_REQUEST,
            &serde_json::json!({"error": {
                "code": "invalid_path",
                "message": format!(
                    "the path holds {why}: it could leave the provider's base URL, so it is not forwarded"
                ),
                "details": {"reason": why},
            }}),
            None,
        );
    }
    let trimmed = path.trim_start_matches('/');
    let (provider, rest) = match trimmed.split_once('/') {
        Some((p, r)) => (p.to_owned(), format!("/{r}")),
        None => (trimmed.to_owned(), String::new()),
    };
    let Some(p) = config.provider(&provider) else {
        return pace_error(&PaceError::UnknownProvider { provider });
    };
    let rest = without_repeated_segment(&p.base_url, rest);
    let mut url = format!("{}{}", p.base_url, rest);
    if let Some(q) = parts.uri.query() {
        url.push('?');
        url.push_str(q);
    }
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
    let headers = upstream_headers(&parts.headers, !config.pacer.client_keys.is_empty(), p);
    // A stream's usage is what reconciles its reservation: asked for when
    // the client did not, and hidden from it again on the way back.
    let asked = (p.style == crate::api::ApiStyle::OpenAi && parts.method == http::Method::POST)
        .then(|| super::stream::ask_for_usage(&rest, &bytes))
        .flatten();
    let hide_usage = asked.is_some();
    let bytes = asked.unwrap_or(bytes);
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
        let budget = permit
            .group()
            .map_or_else(|| "provider".to_owned(), |g| format!("model={g}"));
        let key_name = permit.key_name().map(str::to_owned);
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
        let mut rheaders = answer_headers(resp.headers(), call.shrink_report());
        paced_headers(&mut rheaders, waited, &budget, key_name);
        if Call::<S, C>::wants_body(status) {
            // At most MAX_ERROR_BODY is read to decide; a longer body goes
            // back whole. A body that breaks off is handed back empty.
            let upstream: http::Response<reqwest::Body> = resp.into();
            let (head, rest) = read_head(upstream.into_body(), MAX_ERROR_BODY)
                .await
                .unwrap_or_default();
            match call.after(permit, status, &rheaders, Some(&head)).await {
                After::Retry(d) => {
                    tokio::time::sleep(d).await;
                    continue;
                }
                After::Deliver(_) => {
                    hint_headers(status, &mut rheaders, &head);
                    let body = match rest {
                        None => {
                            rheaders.remove(header::CONTENT_LENGTH);
                            Body::from(head)
                        }
                        Some(rest) => Body::new(rejoin(head, rest)),
                    };
                    return respond(status, rheaders, body);
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
        let sse = ct
            .as_deref()
            .is_some_and(|c| c.starts_with("text/event-stream"));
        if hide_usage && sse {
            rheaders.remove(header::CONTENT_LENGTH);
            return respond(status, rheaders, Body::new(HideUsage::new(body)));
        }
        return respond(status, rheaders, body);
    }
}

/// The headers sent to the provider: the caller's, less the hop-by-hop ones,
/// `Host`, `Content-Length` and `Accept-Encoding` (identity answers: usage
/// must be readable on the way back); the caller's key removed when it is
/// for this proxy (`for_proxy`); the provider's key put in when the config
/// has one.
fn upstream_headers(from: &HeaderMap, for_proxy: bool, p: &ProviderConfig) -> HeaderMap {
    let mut headers = HeaderMap::with_capacity(from.len());
    for (k, v) in from {
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
    if for_proxy {
        // The caller's key is for this proxy, never for the provider.
        headers.remove(header::AUTHORIZATION);
        headers.remove(sluice_door::X_API_KEY);
    }
    if let Some(key) = &p.api_key {
        headers.remove(header::AUTHORIZATION);
        headers.remove(sluice_door::X_API_KEY);
        if let Ok(v) = HeaderValue::from_str(&p.auth_value(key)) {
            headers.insert(p.auth_header.clone(), v);
        }
    }
    headers
}

/// The provider's answer headers, less the hop-by-hop ones, with
/// [`SHRINK_HEADER`] when the request was shrunk.
fn answer_headers(from: &HeaderMap, shrunk: Option<ShrinkReport>) -> HeaderMap {
    let mut rheaders = HeaderMap::with_capacity(from.len());
    for (k, v) in from {
        if !is_hop_by_hop(k) {
            rheaders.append(k.clone(), v.clone());
        }
    }
    if let Some(r) = shrunk
        && let Ok(v) = HeaderValue::from_str(&r.header_value())
    {
        rheaders.insert(SHRINK_HEADER, v);
    }
    rheaders
}

/// What pacing did, on every paced answer: the wait ([`WAITED_HEADER`]),
/// the budget ([`BUDGET_HEADER`]) and the key's name ([`KEY_HEADER`]).
fn paced_headers(
    rheaders: &mut HeaderMap,
    waited: Duration,
    budget: &str,
    key_name: Option<String>,
) {
    if let Ok(v) = HeaderValue::from_str(&waited.as_millis().to_string()) {
        rheaders.insert(WAITED_HEADER, v);
    }
    if let Ok(v) = HeaderValue::from_str(budget) {
        rheaders.insert(BUDGET_HEADER, v);
    }
    if let Some(v) = key_name.and_then(|k| HeaderValue::from_str(&k).ok()) {
        rheaders.insert(KEY_HEADER, v);
    }
}

/// The proxy's door (SPEC S4): it adds the provider's key, so it forwards nothing a
/// web page sent (an `Origin` not in `pacer.allowedOrigins`), nothing sent under a
/// foreign `Host` (DNS rebinding), and, with `pacer.clientKeys`, nothing from a caller
/// without one of them.
fn admit<S: BudgetStore + 'static, C: Clock + 'static>(
    app: &App<S, C>,
    settings: &crate::config::PacerSettings,
    parts: &http::request::Parts,
) -> Result<(), sluice_door::Refusal> {
    let hosts = sluice_door::HostRule::new(app.listen, &settings.allowed_hosts);
    let keys: Vec<sluice_door::ClientKey> = settings
        .client_keys
        .iter()
        .filter_map(|k| sluice_door::ClientKey::parse(k))
        .collect();
    let gate = sluice_door::ProxyGate {
        hosts: &hosts,
        allowed_origins: &settings.allowed_origins,
        client_keys: &keys,
    };
    gate.check(&parts.headers, sluice_door::authority(parts).as_deref())
}

/// `rest` without its first segment when that segment is the one `base_url` ends in:
/// an SDK pointed at `http://proxy/openai/v1` (the habit of OpenAI-compatible
/// proxies) sends `/v1/chat/completions` for a `baseUrl` that already ends in `/v1`.
fn without_repeated_segment(base_url: &str, rest: String) -> String {
    let base_path = base_url
        .split_once("://")
        .map_or(base_url, |(_, r)| r)
        .split_once('/')
        .map_or("", |(_, p)| p);
    let Some(last) = base_path
        .trim_end_matches('/')
        .rsplit('/')
        .next()
        .filter(|s| !s.is_empty())
    else {
        return rest;
    };
    let Some(after) = rest.strip_prefix('/').and_then(|r| r.strip_prefix(last)) else {
        return rest;
    };
    if after.is_empty() || after.starts_with('/') {
        after.to_owned()
    } else {
        rest
    }
}

fn respond(status: StatusCode, headers: HeaderMap, body: Body) -> Response {
    let mut r = Response::new(body);
    *r.status_mut() = status;
    *r.headers_mut() = headers;
    r
}

#[cfg(test)]
mod tests {
    use super::without_repeated_segment;

    #[test]
    fn c1_a_base_url_ending_in_v1_takes_both_spellings() {
        let base = "https://api.openai.com/v1";
        for (sent, forwarded) in [
            ("/chat/completions", "/chat/completions"),
            ("/v1/chat/completions", "/chat/completions"),
            ("/v1", ""),
            ("/v10/x", "/v10/x"),
            ("/v1x", "/v1x"),
        ] {
            assert_eq!(
                without_repeated_segment(base, sent.to_owned()),
                forwarded,
                "{sent}"
            );
        }
        assert_eq!(
            without_repeated_segment("https://api.anthropic.com", "/v1/messages".to_owned()),
            "/v1/messages"
        );
        assert_eq!(
            without_repeated_segment("http://127.0.0.1:9/v1/", "/v1/models".to_owned()),
            "/models"
        );
    }
}
