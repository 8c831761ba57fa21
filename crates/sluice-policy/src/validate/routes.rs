//! `routes:`, `default_class`, `jsonrpc:` and what a route or a tool spends, and
//! the most budgets one request can touch.

use std::collections::HashMap;

use http::Method;

use crate::model::{
    Class, ClassSet, JsonRpc, JsonRpcRefusal, LlmFormat, Route, RouteClass, Spends, Tool,
};
use crate::pattern::PathPattern;
use crate::raw::RawPolicy;

use super::{Checker, MAX_ROUTE_BUCKETS};

/// The budgets a run's turn adds to a call's decision: the run's turns left, the
/// turns it took, and the caller's run starts (SPEC T7).
pub(super) const RUN_BUDGETS: usize = 3;

/// The index of each budget and lane by name, as routes name them.
pub(super) struct Indices<'a> {
    pub(super) buckets: &'a HashMap<String, usize>,
    pub(super) tokens: &'a HashMap<String, usize>,
    pub(super) spend: &'a HashMap<String, usize>,
    pub(super) quotas: &'a HashMap<String, usize>,
    pub(super) lanes: &'a HashMap<String, usize>,
}

impl Checker {
    /// `llm:` and `tokens:` of the route at `at`: its wire format, and the token
    /// budgets it spends (as bucket indices, appended to `buckets`).
    fn llm_route(
        &mut self,
        at: &str,
        r: &crate::raw::RawRoute,
        (tokens, spend): (&HashMap<String, usize>, &HashMap<String, usize>),
        buckets: &mut Vec<usize>,
    ) -> Option<Option<LlmFormat>> {
        let llm = match r.llm.as_deref() {
            None => None,
            Some("openai") => Some(LlmFormat::OpenAi),
            Some("anthropic") => Some(LlmFormat::Anthropic),
            Some(other) => {
                self.problem(
                    format!("{at}.llm"),
                    format!("expected openai or anthropic, got {other:?}"),
                );
                return None;
            }
        };
        for (key, names) in [("tokens", &r.tokens), ("spend", &r.spend)] {
            if !names.is_empty() && llm.is_none() {
                self.problem(
                    format!("{at}.{key}"),
                    "token and money budgets are counted on LLM routes: add `llm: openai` or `llm: anthropic`",
                );
            }
        }
        if llm.is_some() && r.jsonrpc {
            self.problem(
                format!("{at}.llm"),
                "a route is JSON-RPC or an LLM route, not both",
            );
        }
        let named = r.tokens.iter().map(|n| ("tokens", tokens, n));
        for (j, (key, index, name)) in named
            .chain(r.spend.iter().map(|n| ("spend", spend, n)))
            .enumerate()
        {
            match index.get(name) {
                Some(&k) if !buckets.contains(&k) => buckets.push(k),
                Some(_) => self.problem(format!("{at}.{key}[{j}]"), "listed twice"),
                None => self.problem(
                    format!("{at}.{key}[{j}]"),
                    format!("no budget named {name:?} under `{key}`"),
                ),
            }
        }
        Some(llm)
    }

    /// `routes:`, each checked, in order.
    pub(super) fn routes(&mut self, raw: &RawPolicy, indices: &Indices<'_>) -> Vec<Route> {
        let (bucket_index, quota_index, lane_index) =
            (indices.buckets, indices.quotas, indices.lanes);
        let mut routes = Vec::new();
        for (i, r) in raw.routes.iter().enumerate() {
            let at = format!("routes[{i}]");
            let method = r.method.as_deref().and_then(|m| {
                match Method::from_bytes(m.to_ascii_uppercase().as_bytes()) {
                    Ok(m) => Some(m),
                    Err(_) => {
                        self.problem(format!("{at}.method"), format!("not an HTTP method: {m:?}"));
                        None
                    }
                }
            });
            let path = r.path.as_deref().and_then(|p| match PathPattern::parse(p) {
                Ok(p) => Some(p),
                Err(e) => {
                    self.problem(format!("{at}.path"), e);
                    None
                }
            });
            let class = match (r.jsonrpc, r.class.as_deref()) {
                (true, None) => Some(RouteClass::JsonRpc),
                (true, Some(_)) => {
                    self.problem(
                        format!("{at}.class"),
                        "a JSON-RPC route takes its class from the body; remove `class`",
                    );
                    None
                }
                (false, Some(c)) => self.class(&format!("{at}.class"), c).map(RouteClass::Fixed),
                (false, None) => {
                    self.problem(format!("{at}.class"), "required (or `jsonrpc: true`)");
                    None
                }
            };
            if r.buckets.len() + r.tokens.len() + r.spend.len() > MAX_ROUTE_BUCKETS {
                self.problem(
                    format!("{at}.buckets"),
                    format!("at most {MAX_ROUTE_BUCKETS} buckets per route (a decision touches at most {} budgets)", sluice_core::MAX_BUDGETS),
                );
            }
            let spends = self.spends(
                &at,
                (&r.buckets, r.quota.as_deref(), r.lane.as_deref()),
                bucket_index,
                quota_index,
                lane_index,
            );
            let mut spends = spends;
            let llm = self.llm_route(&at, r, (indices.tokens, indices.spend), &mut spends.buckets);
            let mode = self.mode(&format!("{at}.mode"), r.mode.as_deref());
            if let (Some(class), Some(mode), Some(llm)) = (class, mode, llm) {
                routes.push(Route {
                    method,
                    path,
                    class,
                    buckets: spends.buckets,
                    quota: spends.quota,
                    lane: spends.lane,
                    batch: None,
                    mode,
                    llm,
                });
            }
        }
        routes
    }

    /// `default_class`, or the class of a catch-all last route, or the only class.
    pub(super) fn default_class(&mut self, raw: &RawPolicy, routes: &[Route]) -> Option<Class> {
        match (raw.default_class.as_deref(), routes.last()) {
            (Some(name), _) => self.class("default_class", name),
            // A last route with no method and no path takes every request the others
            // leave: its class is the default.
            (None, Some(last)) if last.method.is_none() && last.path.is_none() => {
                match last.class {
                    RouteClass::Fixed(c) => Some(c),
                    RouteClass::JsonRpc => {
                        self.problem(
                        "default_class",
                        "required: the catch-all route is JSON-RPC, so name the class of a request no rule names",
                    );
                        None
                    }
                }
            }
            // A policy of one class needs no default.
            (None, _) if self.classes.len() == 1 => Class::from_index(0),
            (None, _) => {
                self.problem(
                    "default_class",
                    "required: the class of a request no route matches (or end `routes` with a route with no method and no path)",
                );
                None
            }
        }
    }

    /// The buckets, quota family and lane named at `at`, each checked to exist.
    pub(super) fn spends(
        &mut self,
        at: &str,
        (buckets, quota, lane): (&[String], Option<&str>, Option<&str>),
        bucket_index: &HashMap<String, usize>,
        quota_index: &HashMap<String, usize>,
        lane_index: &HashMap<String, usize>,
    ) -> Spends {
        let mut spends = Spends::default();
        for (j, name) in buckets.iter().enumerate() {
            match bucket_index.get(name) {
                Some(&k) if !spends.buckets.contains(&k) => spends.buckets.push(k),
                Some(_) => self.problem(format!("{at}.buckets[{j}]"), "listed twice"),
                None => self.problem(
                    format!("{at}.buckets[{j}]"),
                    format!("no bucket named {name:?} under `buckets`"),
                ),
            }
        }
        if let Some(name) = quota {
            match quota_index.get(name) {
                Some(&k) => spends.quota = Some(k),
                None => self.problem(
                    format!("{at}.quota"),
                    format!(
                        "no quota family named {name:?} under `quotas` (declared: {})",
                        {
                            let mut names: Vec<&str> =
                                quota_index.keys().map(String::as_str).collect();
                            names.sort_unstable();
                            if names.is_empty() {
                                "none".to_owned()
                            } else {
                                names.join(", ")
                            }
                        }
                    ),
                ),
            }
        }
        if let Some(name) = lane {
            match lane_index.get(name) {
                Some(&k) => spends.lane = Some(k),
                None => self.problem(
                    format!("{at}.lane"),
                    format!("no lane named {name:?} under `lanes`"),
                ),
            }
        }
        spends
    }

    /// Checks that no request any route admits can touch more budgets than one
    /// decision holds: its classes, the IP ceilings, its buckets and quotas,
    /// and a run's.
    pub(super) fn budget_counts(&mut self, routes: &[Route], jsonrpc: &JsonRpc, runs: bool) {
        // Every ceiling may count one request (an upper bound), and a JSON-RPC
        // body may hold every class its rules name.
        let ceilings = self.ceilings.len();
        let jsonrpc_classes = jsonrpc
            .methods
            .values()
            .chain(jsonrpc.method_prefixes.iter().map(|(_, c)| c))
            .chain(jsonrpc.tools.values().map(|t| &t.class))
            .chain([&jsonrpc.default_class])
            .copied()
            .collect::<ClassSet>()
            .len();
        let mut tool_buckets: Vec<usize> = Vec::new();
        let mut tool_quotas: Vec<usize> = Vec::new();
        for tool in jsonrpc.tools.values() {
            for &b in &tool.spends.buckets {
                if !tool_buckets.contains(&b) {
                    tool_buckets.push(b);
                }
            }
            if let Some(q) = tool.spends.quota
                && !tool_quotas.contains(&q)
            {
                tool_quotas.push(q);
            }
        }
        for (i, r) in routes.iter().enumerate() {
            let n = match r.class {
                RouteClass::Fixed(_) => {
                    1 + ceilings + r.buckets.len() + usize::from(r.quota.is_some())
                }
                RouteClass::JsonRpc => {
                    let mut buckets = tool_buckets.clone();
                    buckets.extend(r.buckets.iter().filter(|b| !tool_buckets.contains(b)));
                    let mut quotas = tool_quotas.clone();
                    if let Some(q) = r.quota
                        && !quotas.contains(&q)
                    {
                        quotas.push(q);
                    }
                    jsonrpc_classes + ceilings + buckets.len() + quotas.len()
                }
            };
            // A call on an LLM route or an MCP tool call may be a run's turn.
            let n = n + if runs && (r.llm.is_some() || r.class == RouteClass::JsonRpc) {
                RUN_BUDGETS
            } else {
                0
            };
            if n > sluice_core::MAX_BUDGETS {
                self.problem(
                    format!("routes[{i}]"),
                    format!(
                        "a request here may touch {n} budgets (classes, the IP ceilings, buckets and quotas, with its tools', and a run's three); one decision holds at most {}",
                        sluice_core::MAX_BUDGETS
                    ),
                );
            }
        }
    }

    /// `jsonrpc:`: the classes of methods and tools, and what a call the rules miss costs.
    pub(super) fn jsonrpc(
        &mut self,
        raw: &RawPolicy,
        default_class: Option<Class>,
        bucket_index: &HashMap<String, usize>,
        quota_index: &HashMap<String, usize>,
        lane_index: &HashMap<String, usize>,
    ) -> Option<JsonRpc> {
        let j = &raw.jsonrpc;
        let mut methods = HashMap::new();
        let mut method_prefixes = Vec::new();
        for (class_name, list) in &j.methods {
            let Some(class) = self.class(&format!("jsonrpc.methods.{class_name}"), class_name)
            else {
                continue;
            };
            for m in list {
                match m.strip_suffix('*') {
                    Some(prefix) => method_prefixes.push((prefix.to_owned(), class)),
                    None => {
                        methods.insert(m.clone(), class);
                    }
                }
            }
        }
        let mut tools = HashMap::new();
        for (name, t) in &j.tools {
            let at = format!("jsonrpc.tools.{name}");
            let spends = self.spends(
                &at,
                (&t.buckets, t.quota.as_deref(), t.lane.as_deref()),
                bucket_index,
                quota_index,
                lane_index,
            );
            if let Some(class) = self.class(&format!("{at}.class"), &t.class) {
                tools.insert(name.clone(), Tool { class, spends });
            }
        }
        let mut retired = HashMap::new();
        for (name, actions) in &j.retired {
            let mut map = HashMap::new();
            for (action, tool) in actions {
                if !tools.contains_key(tool) {
                    self.problem(
                        format!("jsonrpc.retired.{name}.{action}"),
                        format!("names no tool under jsonrpc.tools: {tool:?}"),
                    );
                }
                map.insert(action.clone(), tool.clone());
            }
            retired.insert(name.clone(), map);
        }
        // Unset: the policy's default class.
        let default_class = match j.default_class.as_deref() {
            Some(name) => self.class("jsonrpc.default_class", name)?,
            None => default_class?,
        };
        let refusal = match j.refusal.as_deref() {
            None | Some("edge") => JsonRpcRefusal::Edge,
            Some("jsonrpc_error") => JsonRpcRefusal::JsonRpcError,
            Some(other) => {
                self.problem(
                    "jsonrpc.refusal",
                    format!("expected `edge` or `jsonrpc_error`, not {other:?}"),
                );
                JsonRpcRefusal::Edge
            }
        };
        Some(JsonRpc {
            methods,
            method_prefixes,
            tools,
            retired,
            default_class,
            refusal,
        })
    }
}
