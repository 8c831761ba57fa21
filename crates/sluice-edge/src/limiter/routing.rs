//! Routing: a request's target in its normal form, and the route it matches.

use std::borrow::Cow;

use http::header::CONTENT_ENCODING;
use http::request::Parts;
use http::uri::PathAndQuery;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Uri};
use sluice_policy::{METHOD_OVERRIDE_FIELDS, Policy, Route, RouteClass};
use sluice_store::BudgetStore;

use super::{Limiter, Refused};

impl<S: BudgetStore> Limiter<S> {
    /// The normal form of a request's path (no query), as it is matched and
    /// forwarded (see [`Paths`](sluice_policy::Paths)): borrowed when it is normal
    /// already.
    ///
    /// # Errors
    /// [`Refused::Path`] when it has none (a `..` above the root, a bad `%`).
    pub fn normalize_path<'p>(&self, path: &'p str) -> Result<Cow<'p, str>, Refused> {
        Ok(self.policy.paths.normalize(path)?)
    }

    /// Rewrites `uri` to its normal form (the path normalised, the query as it was),
    /// so that the request is routed, and forwarded, as the upstream will read it.
    /// Call it before [`Limiter::route`].
    ///
    /// # Errors
    /// [`Refused`] when the path has no normal form; `uri` is then unchanged.
    pub fn normalize_target(&self, uri: &mut Uri) -> Result<(), Refused> {
        let Cow::Owned(mut target) = self.normalize_path(uri.path())? else {
            return Ok(());
        };
        if let Some(query) = uri.query() {
            target.push('?');
            target.push_str(query);
        }
        let path_and_query = PathAndQuery::try_from(target).map_err(|_| Refused::Target)?;
        let mut parts = uri.clone().into_parts();
        parts.path_and_query = Some(path_and_query);
        *uri = Uri::from_parts(parts).map_err(|_| Refused::Target)?;
        Ok(())
    }

    /// The route a request matches (matched once per request and passed to
    /// [`crate::Intake::planned`]), by its method, path and method-override fields: the normal
    /// form of the path once [`Limiter::normalize_target`] has rewritten it.
    ///
    /// # Errors
    /// As [`Limiter::route_with`].
    pub fn route(&self, parts: &Parts) -> Result<Option<&Route>, Refused> {
        self.route_with(&parts.method, parts.uri.path(), &parts.headers)
    }

    /// The route a request with this method, path (in its normal form) and these
    /// fields matches: as [`Limiter::route_for`], and a method-override field
    /// (`X-HTTP-Method-Override`, `X-Method-Override`, `X-HTTP-Method`) must name a
    /// method of the same route (see [`Policy::route_overridden`]).
    ///
    /// # Errors
    /// [`Refused::Path`] as [`Limiter::route_for`], and for a method-override field
    /// that cannot be read or changes the route.
    pub fn route_with(
        &self,
        method: &Method,
        path: &str,
        headers: &HeaderMap,
    ) -> Result<Option<&Route>, Refused> {
        let overrides = METHOD_OVERRIDE_FIELDS
            .iter()
            .flat_map(|name| headers.get_all(*name))
            .map(HeaderValue::as_bytes);
        Ok(self.policy.route_overridden(method, path, overrides)?)
    }

    /// The route a request with this method and path (no query, in its normal form:
    /// see [`Limiter::normalize_path`]) matches.
    ///
    /// # Errors
    /// [`Refused::Path`] when path parameters (`;…`) change the route matched, or
    /// the method differs from a known one only by case (see
    /// [`Policy::route_checked`]).
    pub fn route_for(&self, method: &Method, path: &str) -> Result<Option<&Route>, Refused> {
        Ok(self.policy.route_checked(method, path)?)
    }

    /// True when the body must be read (bounded) before deciding: `route` takes
    /// its class or its cost from it (a JSON-RPC route, a batch submit, an LLM
    /// route whose tokens are estimated from it), or a lane guards it. A lane's
    /// call holds one of its few places from admission to answer; one admitted
    /// with its body still to come would hold it for as long as its client takes
    /// to send it (a slow upload per fresh credential could hold them all), so
    /// its body is whole before it waits for a place.
    pub fn needs_body(route: Option<&Route>) -> bool {
        route.is_some_and(|r| {
            r.class == RouteClass::JsonRpc
                || r.llm.is_some()
                || r.lane.is_some()
                || matches!(r.batch, Some(sluice_policy::BatchEndpoint::Submit(_)))
        })
    }

    /// The request fields [`crate::Intake::planned`] reads (lowercase): those
    /// [`Identity::read_headers`](sluice_policy::Identity::read_headers) names,
    /// `Content-Encoding` (a JSON-RPC body must be readable as sent), and with a
    /// tracer installed `traceparent` ([`crate::trace`]).
    pub fn read_headers(&self) -> Vec<HeaderName> {
        self.read_headers.clone()
    }

    /// [`Limiter::read_headers`], borrowed.
    pub fn read_header_names(&self) -> &[HeaderName] {
        &self.read_headers
    }
}

/// The request fields a limiter on `policy` reads (see [`Limiter::read_headers`]).
pub(super) fn read_headers_of(policy: &Policy) -> Vec<HeaderName> {
    let mut names = policy.identity.read_headers();
    if !names.contains(&CONTENT_ENCODING) {
        names.push(CONTENT_ENCODING);
    }
    // A call's agent run (SPEC T7), named by header or by its MCP session.
    for name in [
        sluice_policy::RUN_HEADER,
        sluice_policy::DEPTH_HEADER,
        "mcp-session-id",
    ] {
        let name = HeaderName::from_static(name);
        if !names.contains(&name) {
            names.push(name);
        }
    }
    // The trace a request's span continues (SPEC O1), with a tracer installed.
    if crate::trace::is_on() && !names.contains(&crate::trace::TRACEPARENT) {
        names.push(crate::trace::TRACEPARENT.clone());
    }
    names
}
