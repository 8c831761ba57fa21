//! The door as an axum middleware: `router.layer(from_fn_with_state(door, guard))`.
//! Refusals are answered here with sluice's envelope
//! `{"error":{"code","message","details"}}`; a browser asking for a page without the
//! token gets the login page instead, which trades the token once for the HttpOnly,
//! SameSite=Strict cookie.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::extract::{ConnectInfo, Request, State};
use axum::middleware::Next;
use axum::response::Response;
use http::header::{ACCEPT, CACHE_CONTROL, CONTENT_SECURITY_POLICY, CONTENT_TYPE, HOST};
use http::{HeaderValue, Method, StatusCode};

use crate::door::{Door, LOGIN_PATH, LOGOUT_PATH, Refusal};

/// Largest login body read.
const MAX_LOGIN_BODY: usize = 4096;

const LOGIN_HTML: &str = include_str!("login.html");

/// The authority a request is sent to: the URI's (absolute form, HTTP/2) or its one
/// `Host` field; `None` when there is none or more than one.
pub fn authority(req: &http::request::Parts) -> Option<String> {
    if let Some(a) = req.uri.authority() {
        return Some(a.as_str().to_owned());
    }
    let mut hosts = req.headers.get_all(HOST).iter();
    let host = hosts.next()?;
    if hosts.next().is_some() {
        return None;
    }
    host.to_str().ok().map(str::to_owned)
}

/// The peer address axum recorded (`into_make_service_with_connect_info`).
pub fn peer(extensions: &http::Extensions) -> Option<IpAddr> {
    extensions
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| c.0.ip())
}

/// The middleware: checks the request's head at the door, answers the login and
/// logout itself, and hands the [`Entrant`](crate::Entrant) to the routes as a
/// request extension.
pub async fn guard(State(door): State<Arc<Door>>, req: Request, next: Next) -> Response {
    let (mut parts, body) = req.into_parts();
    let peer = peer(&parts.extensions);
    let authority = authority(&parts);
    let path = parts.uri.path().to_owned();
    let now = Instant::now();
    let entrant = match door.check(
        &parts.method,
        &path,
        &parts.headers,
        authority.as_deref(),
        peer,
        now,
    ) {
        Ok(e) => e,
        Err(Refusal::Unauthorized { .. }) if wants_page(&parts) => return login_page(),
        Err(refusal) => return refused(&refusal),
    };
    if parts.method == Method::POST && path == LOGIN_PATH {
        return login(&door, body, peer, now).await;
    }
    if parts.method == Method::POST && path == LOGOUT_PATH {
        return cookie_answer(&door.logout(&parts.headers));
    }
    parts.extensions.insert(entrant);
    next.run(Request::from_parts(parts, body)).await
}

fn wants_page(parts: &http::request::Parts) -> bool {
    parts.method == Method::GET
        && parts
            .headers
            .get(ACCEPT)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|a| a.contains("text/html"))
}

async fn login(door: &Door, body: Body, peer: Option<IpAddr>, now: Instant) -> Response {
    let Ok(bytes) = axum::body::to_bytes(body, MAX_LOGIN_BODY).await else {
        return envelope(
            StatusCode::PAYLOAD_TOO_LARGE,
            "body_too_large",
            "a login is a token, not more than 4096 bytes".to_owned(),
            None,
        );
    };
    let token = serde_json::from_slice::<serde_json::Value>(&bytes)
        .ok()
        .and_then(|v| v.get("token").and_then(|t| t.as_str()).map(str::to_owned));
    let Some(token) = token else {
        return envelope(
            StatusCode::BAD_REQUEST,
            "invalid_request",
            "a login is {\"token\": \"…\"}".to_owned(),
            None,
        );
    };
    if let Err(refusal) = door.login(&token, peer, now) {
        tracing::warn!(target: "sluice::audit", who = %peer.map_or_else(String::new, |p| p.to_string()), "admin login refused: {}", refusal.code());
        return refused(&refusal);
    }
    tracing::info!(target: "sluice::audit", who = %peer.map_or_else(String::new, |p| p.to_string()), "admin login");
    match door.login_cookie() {
        Some(cookie) => cookie_answer(&cookie),
        None => no_content(),
    }
}

fn no_content() -> Response {
    let mut r = Response::new(Body::empty());
    *r.status_mut() = StatusCode::NO_CONTENT;
    r
}

fn cookie_answer(cookie: &str) -> Response {
    let mut r = no_content();
    if let Ok(v) = HeaderValue::from_str(cookie) {
        r.headers_mut().insert(http::header::SET_COOKIE, v);
    }
    r.headers_mut()
        .insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    r
}

fn login_page() -> Response {
    let mut r = Response::new(Body::from(LOGIN_HTML));
    *r.status_mut() = StatusCode::UNAUTHORIZED;
    let h = r.headers_mut();
    h.insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    h.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(
        http::header::WWW_AUTHENTICATE,
        HeaderValue::from_static("Bearer realm=\"sluice\""),
    );
    h.insert(
        CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; \
             connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
        ),
    );
    r
}

/// The answer to a refusal: its status, the envelope, `WWW-Authenticate` on 401 and
/// `Retry-After` on 429.
pub fn refused(refusal: &Refusal) -> Response {
    let retry = match refusal {
        Refusal::TooManyAttempts(left) => Some(left.as_secs().max(1)),
        _ => None,
    };
    let mut r = envelope(refusal.status(), refusal.code(), refusal.message(), retry);
    if matches!(refusal, Refusal::Unauthorized { .. }) {
        r.headers_mut().insert(
            http::header::WWW_AUTHENTICATE,
            HeaderValue::from_static("Bearer realm=\"sluice\""),
        );
    }
    r
}

fn envelope(status: StatusCode, code: &str, message: String, retry_after: Option<u64>) -> Response {
    let body = serde_json::json!({"error": {"code": code, "message": message, "details": {}}});
    let mut r = Response::new(Body::from(body.to_string()));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    if let Some(secs) = retry_after {
        r.headers_mut()
            .insert(http::header::RETRY_AFTER, HeaderValue::from(secs));
    }
    r
}
