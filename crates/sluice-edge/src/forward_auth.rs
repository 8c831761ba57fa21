//! Forward auth: deciding a request that another proxy holds (nginx's
//! `auth_request`, Traefik's ForwardAuth, Caddy's `forward_auth`), from the
//! headers of the proxy's check request alone (SPEC R2).
//!
//! The proxy names the original request in headers: `X-Original-Method` and
//! `X-Original-URI` (the nginx configuration sluice documents), or
//! `X-Forwarded-Method` and `X-Forwarded-Uri` (Traefik, Caddy). The check
//! request carries the original's other headers (credentials,
//! `X-Forwarded-For`), so the request is classified by the same policy as
//! through sluice's own proxy — routes, identity, the client address through
//! the trusted proxies — and spends the same budgets.
//!
//! The body is never seen, and neither is the upstream's answer, so a route
//! that needs either cannot be decided here ([`Gap`]): it is refused, never
//! decided as something cheaper.
//!
//! Answers: 204 with `X-RateLimit-*`, `X-Sluice-Workspace` and `X-Sluice-User`
//! (for the proxy to set on the request it forwards) when admitted; the refusal sluice's proxy
//! would give (429 with `Retry-After`, a 400, a 503) otherwise. nginx's
//! `auth_request` turns any status but 2xx, 401 and 403 into a 500 for its
//! client, so every refusal of a request named by `X-Original-URI` is 403,
//! carrying the status it stands for in `X-Sluice-Status` beside the same
//! headers; the documented nginx configuration answers the client with it.

use std::net::IpAddr;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Response, StatusCode, Uri};
use http_body_util::Full;
use sluice_policy::{Policy, Route};
use sluice_store::BudgetStore;

use crate::Limiter;

/// `X-Original-Method`: the original request's method (nginx).
pub static X_ORIGINAL_METHOD: HeaderName = HeaderName::from_static("x-original-method");
/// `X-Original-URI`: the original request's target (nginx).
pub static X_ORIGINAL_URI: HeaderName = HeaderName::from_static("x-original-uri");
/// `X-Forwarded-Method`: the original request's method (Traefik, Caddy).
pub static X_FORWARDED_METHOD: HeaderName = HeaderName::from_static("x-forwarded-method");
/// `X-Forwarded-Uri`: the original request's target (Traefik, Caddy).
pub static X_FORWARDED_URI: HeaderName = HeaderName::from_static("x-forwarded-uri");
/// `X-Sluice-Status`: on a 403 to nginx, the status the refusal stands for.
pub static X_SLUICE_STATUS: HeaderName = HeaderName::from_static("x-sluice-status");

/// Which proxy asks, as its headers tell.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Asker {
    /// nginx's `auth_request` (`X-Original-URI`): a refusal is 403.
    Nginx,
    /// Traefik's ForwardAuth or Caddy's `forward_auth` (`X-Forwarded-Uri`): a
    /// refusal keeps its status.
    Forwarded,
}

/// Why a route cannot be decided through forward auth.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gap {
    /// Its class or cost comes from the body (a JSON-RPC route, a batch
    /// submit) or from the upstream's answer (a weighted bucket).
    Body,
    /// sluice must see the call end (a guarded lane holds a place until then)
    /// or answer it itself (a batch status read).
    Proxy,
}

impl Gap {
    /// Its `details.reason`: `needs_body` or `needs_proxy`.
    pub fn as_str(self) -> &'static str {
        match self {
            Gap::Body => "needs_body",
            Gap::Proxy => "needs_proxy",
        }
    }

    /// What a route with this gap needs, for `sluice check` and the refusal.
    pub fn explain(self) -> &'static str {
        match self {
            Gap::Body => {
                "its class or cost comes from the body or the upstream's answer, which forward auth never sees"
            }
            Gap::Proxy => {
                "sluice must see its call end (a guarded lane) or answer it itself (a batch read)"
            }
        }
    }
}

/// What forward auth cannot decide of `route` (`None`: it can).
pub fn gap(policy: &Policy, route: Option<&Route>) -> Option<Gap> {
    let route = route?;
    // A lane's call needs its body whole too, but first of all its end.
    if route.lane.is_some() {
        return Some(Gap::Proxy);
    }
    if Limiter::<sluice_store::MemoryStore>::needs_body(Some(route))
        || route
            .buckets
            .iter()
            .any(|&b| policy.buckets.get(b).is_some_and(|b| b.weighted))
    {
        return Some(Gap::Body);
    }
    if route.batch.is_some() {
        return Some(Gap::Proxy);
    }
    None
}

/// The routes of `policy` forward auth does not serve, each with why: what
/// `sluice check` names.
pub fn gaps(policy: &Policy) -> Vec<(&Route, Gap)> {
    policy
        .routes
        .iter()
        .filter_map(|r| gap(policy, Some(r)).map(|g| (r, g)))
        .collect()
}

/// The original request a check request names: who asks, its method and its
/// target.
fn original(headers: &HeaderMap) -> Result<(Asker, Method, Uri), &'static str> {
    // A proxy sets its own fields and replaces what a client sent; a field sent
    // twice, or both kinds at once, can only come from a client (passed through by
    // a proxy that sets the other kind): refused, never read as the cheaper one.
    let names = [
        &X_ORIGINAL_URI,
        &X_ORIGINAL_METHOD,
        &X_FORWARDED_URI,
        &X_FORWARDED_METHOD,
    ];
    if names
        .iter()
        .any(|n| headers.get_all(*n).iter().nth(1).is_some())
    {
        return Err("the original request is named more than once");
    }
    let nginx = headers.contains_key(&X_ORIGINAL_URI) || headers.contains_key(&X_ORIGINAL_METHOD);
    let forwarded =
        headers.contains_key(&X_FORWARDED_URI) || headers.contains_key(&X_FORWARDED_METHOD);
    if nginx && forwarded {
        return Err(
            "the original request is named both by X-Original-* and X-Forwarded-* fields: the proxy must strip the ones a client sent",
        );
    }
    let (asker, method, uri) = match headers.get(&X_ORIGINAL_URI) {
        Some(uri) => (Asker::Nginx, headers.get(&X_ORIGINAL_METHOD), uri),
        None => match headers.get(&X_FORWARDED_URI) {
            Some(uri) => (Asker::Forwarded, headers.get(&X_FORWARDED_METHOD), uri),
            None => {
                return Err(
                    "no original request: send X-Original-URI and X-Original-Method (nginx) or X-Forwarded-Uri and X-Forwarded-Method",
                );
            }
        },
    };
    let method = method
        .ok_or("the original request's method is missing (X-Original-Method or X-Forwarded-Method)")
        .and_then(|m| {
            Method::from_bytes(m.as_bytes())
                .map_err(|_| "the original request's method is not a method")
        })?;
    let uri = Uri::try_from(uri.as_bytes())
        .map_err(|_| "the original request's target is not a request target")?;
    if uri.path().is_empty() || !uri.path().starts_with('/') || uri.scheme().is_some() {
        return Err("the original request's target must be an origin-form target (/path?query)");
    }
    Ok((asker, method, uri))
}

impl<S: BudgetStore> Limiter<S> {
    /// Decides the request a proxy's check request names (see the module docs)
    /// and answers the proxy: `headers` are the check request's, `peer` the
    /// proxy's address (the client's is read through the policy's trusted
    /// proxies). Admitted requests have spent their budgets, as through
    /// sluice's own proxy.
    pub async fn forward_auth(&self, headers: &HeaderMap, peer: IpAddr) -> Response<Full<Bytes>> {
        let (asker, method, mut uri) = match original(headers) {
            Ok(original) => original,
            Err(message) => {
                // Who asked is unknown: 403 is what every proxy passes on.
                let mut answer = crate::envelope_response(
                    StatusCode::BAD_REQUEST,
                    "invalid_request",
                    message,
                    serde_json::json!({ "reason": "no_original_request" }),
                );
                as_nginx_refusal(&mut answer);
                return answer;
            }
        };
        let answer = self
            .forward_auth_for(headers, peer, &method, &mut uri)
            .await;
        match asker {
            Asker::Nginx => {
                let mut answer = answer;
                as_nginx_refusal(&mut answer);
                answer
            }
            Asker::Forwarded => answer,
        }
    }

    async fn forward_auth_for(
        &self,
        headers: &HeaderMap,
        peer: IpAddr,
        method: &Method,
        uri: &mut Uri,
    ) -> Response<Full<Bytes>> {
        // With `identity.counted_credential`, sluice's own proxy strips the kinds
        // it did not count before forwarding; the proxy asking here forwards the
        // request as the client sent it, and its upstream could read a credential
        // sluice never charged (a fresh counted key each call, the real one in
        // another field): such a request is refused, never decided.
        let identity = &self.policy().identity;
        if identity.counted.is_some() && {
            let fields: Vec<(&[u8], &[u8])> = headers
                .iter()
                .map(|(name, value)| (name.as_str().as_bytes(), value.as_bytes()))
                .collect();
            identity.sends_several_kinds(fields.iter().copied())
        } {
            return crate::envelope_response(
                StatusCode::BAD_REQUEST,
                "invalid_request",
                "the request sends more than one kind of credential; through forward auth the uncounted ones cannot be removed before the upstream reads them: send one",
                serde_json::json!({ "reason": "ambiguous_credentials" }),
            );
        }
        // sluice's own proxy never forwards an underscore spelling of a field it
        // reads or guards (`X_API_KEY`, `X_HTTP_Method_Override`, `X_Sluice_User`):
        // an upstream that maps names CGI-style reads it as the field sluice did
        // not see. The proxy asking here forwards it, so the request is refused.
        if let Some(name) = headers.keys().find(|name| {
            crate::is_underscore_spelling(name.as_str().as_bytes(), self.read_header_names())
        }) {
            return crate::envelope_response(
                StatusCode::BAD_REQUEST,
                "invalid_request",
                &format!(
                    "the request sends `{name}`, an underscore spelling of a field sluice reads or sets; through forward auth it cannot be removed before the upstream reads it: send it with hyphens"
                ),
                serde_json::json!({ "reason": "underscore_field", "field": name.as_str() }),
            );
        }
        // Phase 1 as every transport runs it, but the head's own checks: the proxy
        // asking has read the original head.
        let route = self
            .normalize_target(uri)
            .and_then(|()| self.route_with(method, uri.path(), headers));
        let intake = self.intake(route, peer);
        if let Some(answer) = intake.refused(None) {
            return answer;
        }
        if let Some(gap) = gap(self.policy(), intake.route()) {
            return crate::envelope_response(
                StatusCode::TOO_MANY_REQUESTS,
                "invalid_request",
                &format!(
                    "{method} {} cannot be decided through forward auth: {}; put `sluice serve` in front of this route instead",
                    uri.path(),
                    gap.explain()
                ),
                serde_json::json!({ "reason": gap.as_str() }),
            );
        }
        // No body: a route that needs one is a gap.
        match intake.planned(headers, None, None).admit(None).await {
            Ok(mut admitted) => {
                // The answer is the call's end (and its span's status, SPEC O1).
                admitted.finish(Some(StatusCode::NO_CONTENT.as_u16()));
                let mut answer = Response::new(Full::new(Bytes::new()));
                *answer.status_mut() = StatusCode::NO_CONTENT;
                crate::rate_limit_headers(
                    answer.headers_mut(),
                    admitted.decision(),
                    admitted.plan(),
                    self.policy(),
                );
                // Who sluice counted, for the proxy to set on the request it
                // forwards in place of any the client sent (SPEC: identity to
                // the upstream); the documented configurations copy them.
                let headers = answer.headers_mut();
                crate::answer::for_each_upstream_header(
                    admitted.plan(),
                    self.policy(),
                    |name, value| {
                        if crate::answer::is_sluice_signal(name.as_str().as_bytes())
                            && let Ok(value) = HeaderValue::from_bytes(value)
                        {
                            headers.insert(name.clone(), value);
                        }
                    },
                );
                answer
            }
            Err(answer) => answer,
        }
    }
}

/// nginx's `auth_request` takes only 2xx, 401 and 403: every refusal becomes
/// 403 with the status it stands for in `X-Sluice-Status` (a 403 of sluice's
/// own too, so that the nginx configuration can tell them apart).
fn as_nginx_refusal(answer: &mut Response<Full<Bytes>>) {
    let status = answer.status();
    if status.is_success() {
        return;
    }
    answer
        .headers_mut()
        .insert(X_SLUICE_STATUS.clone(), HeaderValue::from(status.as_u16()));
    *answer.status_mut() = StatusCode::FORBIDDEN;
}
