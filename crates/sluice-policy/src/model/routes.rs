//! The route table, JSON-RPC rules, the bounds of what is read, the store's
//! settings, and how a request finds its route.

use std::borrow::Cow;
use std::collections::HashMap;
use std::num::NonZeroU32;

use http::Method;

use crate::path::{PathCase, PathError};
use crate::pattern::PathPattern;

use super::{Class, Enforcement, Policy, Spends};

/// One JSON-RPC tool's rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tool {
    /// Its class.
    pub class: Class,
    /// Buckets and quota a call of it spends.
    pub spends: Spends,
}

/// Where a route's class comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RouteClass {
    /// A fixed class.
    Fixed(Class),
    /// The JSON-RPC body, item by item.
    JsonRpc,
}

/// One route of the table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Route {
    /// The method; `None` = any.
    pub method: Option<Method>,
    /// The path; `None` = any.
    pub path: Option<PathPattern>,
    /// Its class.
    pub class: RouteClass,
    /// Indices into [`Policy::buckets`] this route also spends.
    pub buckets: Vec<usize>,
    /// Index into [`Policy::quotas`] this route counts against.
    pub quota: Option<usize>,
    /// Index into [`Policy::lanes`]: the lane that guards this route's calls.
    pub lane: Option<usize>,
    /// The batch lane endpoint this route is, if it is one (sluice answers it).
    pub batch: Option<BatchEndpoint>,
    /// Enforced, or every budget of a request on it decided and counted without
    /// refusing (a dry run).
    pub mode: Enforcement,
    /// The LLM wire format it speaks (`llm:`): its body is read, its token
    /// budgets reserved from it and settled at the upstream's `usage`.
    pub llm: Option<super::LlmFormat>,
}

/// A route that is a batch lane's endpoint: answered by sluice, never forwarded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BatchEndpoint {
    /// `POST <route>/batch` of the lane (index into [`Policy::lanes`]).
    Submit(usize),
    /// `GET <route>/batches/{id}` of the lane.
    Status(usize),
}

impl Route {
    /// True when the route matches, its path's literal segments compared byte for
    /// byte.
    pub fn matches(&self, method: &Method, path: &str) -> bool {
        self.matches_in(method, path, PathCase::Sensitive)
    }

    /// True when the route matches, its path's literal segments compared as `case`
    /// says (the policy's `paths.case`). A `GET` route matches `HEAD` too: servers
    /// run a GET handler for HEAD (RFC 9110 §9.3.2), so a HEAD spends what the GET
    /// does, never the default class.
    pub fn matches_in(&self, method: &Method, path: &str, case: PathCase) -> bool {
        self.method
            .as_ref()
            .is_none_or(|m| m == method || (*m == Method::GET && *method == Method::HEAD))
            && self.path.as_ref().is_none_or(|p| p.matches_in(path, case))
    }
}

/// JSON-RPC classification rules.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JsonRpc {
    /// Exact method → class.
    pub methods: HashMap<String, Class>,
    /// Method prefix (from `name/*`) → class.
    pub method_prefixes: Vec<(String, Class)>,
    /// Tool → its class and what else it spends.
    pub tools: HashMap<String, Tool>,
    /// Retired tool → action → current tool.
    pub retired: HashMap<String, HashMap<String, String>>,
    /// The class of anything not named.
    pub default_class: Class,
    /// How a refused JSON-RPC request is answered.
    pub refusal: JsonRpcRefusal,
}

/// How a refused JSON-RPC request is answered.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum JsonRpcRefusal {
    /// As any request: the edge's 429 or the JSON envelope.
    #[default]
    Edge,
    /// As JSON-RPC: HTTP 429 with a JSON-RPC error (code -32029) per request id,
    /// whose `data` says why and when to retry — so an agent whose SDK hides the
    /// HTTP status can still read the wait.
    JsonRpcError,
}

/// Bounds on what a request may make sluice read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bounds {
    /// Largest body read for classification (bytes); past it: 413.
    pub max_body_bytes: usize,
    /// Deepest JSON nesting accepted (a value inside `n` arrays or objects is at
    /// depth `n + 1`); a deeper body is refused with 400.
    pub max_json_depth: usize,
    /// Most items in one JSON-RPC batch; a larger batch is refused with 413.
    pub max_batch_items: usize,
}

/// What a class does while the shared store cannot be reached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outage {
    /// Decide locally with this replica's share of the limit.
    FailOpen,
    /// Refuse with 503 and `Retry-After`.
    FailClosed,
}

/// How the shared store is used.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StorePolicy {
    /// The longest one decision may wait for the store.
    pub timeout: std::time::Duration,
    /// Replicas sharing the store (a fail-open class gets limit ÷ replicas locally).
    pub replicas: NonZeroU32,
}

impl Policy {
    /// The first route matching, if any (paths compared as `paths.case` says).
    pub fn route(&self, method: &Method, path: &str) -> Option<&Route> {
        let case = self.paths.case;
        self.routes
            .iter()
            .find(|r| r.matches_in(method, path, case))
    }

    /// [`Policy::route`], for a path that may hold path parameters (`;…`): the route
    /// must be the same whether the upstream keeps them as part of the segment (most
    /// servers) or drops them (servlet containers), else sluice cannot know which
    /// route the upstream runs.
    ///
    /// A method that differs from a known one only by case (`post`, `Get`) is
    /// refused: Werkzeug and Express run `post /chats` as `POST /chats`, while the
    /// method table (case-sensitive, as RFC 9110 says) would match nothing.
    ///
    /// # Errors
    /// [`PathError::ParametersChangeRoute`] when the two readings match different
    /// routes (`POST /chats;x=1`, `POST /oauth;x/register`);
    /// [`PathError::EncodedSlashChangesRoute`] when the path read with `%2F` and
    /// `%5C` decoded to `/` matches another route (`POST /messages%2Foptimize`);
    /// [`PathError::MethodCase`] for a method in another case.
    pub fn route_checked(&self, method: &Method, path: &str) -> Result<Option<&Route>, PathError> {
        if self.is_method_in_other_case(method) {
            return Err(PathError::MethodCase);
        }
        let route = self.route(method, path);
        let bare = crate::path::without_parameters(path);
        if let Cow::Owned(bare) = bare
            && !same_route(route, self.route(method, &bare))
        {
            return Err(PathError::ParametersChangeRoute);
        }
        if let Some(decoded) = crate::path::with_encoded_slashes(path, self.paths.merge_slashes)?
            && !same_route(route, self.route(method, &decoded))
        {
            return Err(PathError::EncodedSlashChangesRoute);
        }
        Ok(route)
    }
}

impl Policy {
    /// True when `method` has a lower-case letter and, in upper case, is a method of
    /// RFC 9110 or one a route names: a spelling some servers run as that method.
    fn is_method_in_other_case(&self, method: &Method) -> bool {
        let name = method.as_str();
        if !name.bytes().any(|b| b.is_ascii_lowercase()) {
            return false;
        }
        const STANDARD: [&str; 9] = [
            "GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH",
        ];
        STANDARD.iter().any(|m| m.eq_ignore_ascii_case(name))
            || self
                .routes
                .iter()
                .filter_map(|r| r.method.as_ref())
                .any(|m| m.as_str().eq_ignore_ascii_case(name))
    }

    /// The route a request matches when a method-override field
    /// (`X-HTTP-Method-Override`, `X-Method-Override`, `X-HTTP-Method`) names another
    /// method than its own: many frameworks (Express's `method-override`, Rails,
    /// ASP.NET, Google's APIs) run the request as the method named, others as the
    /// method sent. Both readings must match one route, else sluice cannot know which
    /// one the upstream runs.
    ///
    /// # Errors
    /// [`PathError::MethodOverride`] for a field sluice cannot read (several values,
    /// not a method token, a method in another case) or one that changes the route
    /// matched; else as [`Policy::route_checked`].
    pub fn route_overridden<'v>(
        &self,
        method: &Method,
        path: &str,
        overrides: impl IntoIterator<Item = &'v [u8]>,
    ) -> Result<Option<&Route>, PathError> {
        let route = self.route_checked(method, path)?;
        for value in overrides {
            let named = std::str::from_utf8(value.trim_ascii())
                .ok()
                .and_then(|v| Method::from_bytes(v.as_bytes()).ok())
                .ok_or(PathError::MethodOverride)?;
            if named == *method {
                continue;
            }
            let other = self
                .route_checked(&named, path)
                .map_err(|_| PathError::MethodOverride)?;
            if !same_route(route, other) {
                return Err(PathError::MethodOverride);
            }
        }
        Ok(route)
    }
}

/// The request fields many frameworks read as the method to run instead of the
/// request's own (lower case): see [`Policy::route_overridden`].
pub const METHOD_OVERRIDE_FIELDS: [&str; 3] = [
    "x-http-method-override",
    "x-method-override",
    "x-http-method",
];

/// True when both are no route, or the same route of the table.
fn same_route(a: Option<&Route>, b: Option<&Route>) -> bool {
    match (a, b) {
        (None, None) => true,
        (Some(a), Some(b)) => std::ptr::eq(a, b),
        _ => false,
    }
}
