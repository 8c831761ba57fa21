//! `RawPolicy` → `Policy`: every check in one place, every problem reported
//! with the key path it is at.

use std::collections::HashMap;
use std::num::NonZeroU32;
#[cfg(feature = "yaml")]
use std::path::Path;
use std::path::PathBuf;
use std::time::Duration;

use http::{HeaderName, Method};
use ipnet::IpNet;

use crate::model::{
    Algorithm, BatchEndpoint, Bounds, Bucket, Ceiling, Class, ClassSet, CostClass,
    CredentialSource, CustomerPlan, Enforcement, Identity, JsonRpc, JsonRpcRefusal, Lane,
    LaneBatch, LaneReasons, MAX_BUCKETS, MAX_CEILINGS, MAX_CLASSES, MAX_LANES, MAX_PLANS,
    MAX_QUOTA_FAMILIES, MAX_SLIDING_WINDOW_SECONDS, MAX_WORKSPACES, OnExhausted, Outage, Per,
    PlanLane, Policy, Principal, Profile, QuotaFamily, Refusal, Route, RouteClass, Spends,
    StorePolicy, Tenants, Tool,
};
use crate::path::Paths;
use crate::pattern::PathPattern;
use crate::raw::{RawLane, RawLaneBatch, RawPolicy, RawProfile};

/// Default largest body read for classification: 1 MiB.
pub const DEFAULT_MAX_BODY_BYTES: usize = 1 << 20;

/// Most `workspace_starts` a lane allows per window.
pub const MAX_LANE_STARTS: u32 = 100_000;
/// Default deepest JSON nesting: 64.
pub const DEFAULT_MAX_JSON_DEPTH: usize = 64;
/// Default most items in one JSON-RPC batch: 1,000.
pub const DEFAULT_MAX_BATCH_ITEMS: usize = 1_000;
/// The deepest `limits.max_json_depth` there can be: the JSON parser itself reads
/// at most 127 nested arrays and objects.
pub const MAX_JSON_DEPTH: usize = 127;
/// Default longest wait for the shared store per decision: 20 ms.
pub const DEFAULT_STORE_TIMEOUT_MS: u64 = 20;

/// The most buckets one route may spend (a request's whole count of budgets is
/// checked too: see `budget_counts`).
pub const MAX_ROUTE_BUCKETS: usize = sluice_core::MAX_BUDGETS - 5;

/// The longest name of a class or a ceiling (it is sent in headers and metrics).
pub const MAX_CLASS_NAME: usize = 64;

/// One thing wrong with a policy, at a key path such as `routes[3].class`.
pub use sluice_core::Problem;

/// Why a policy was not accepted.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PolicyError {
    /// The file could not be read.
    #[error("{file}: {source}")]
    Read {
        /// The file.
        file: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The YAML does not have the policy's shape (the message has the line).
    #[error("{file}: {message}")]
    Parse {
        /// The file (or `<built-in>`).
        file: PathBuf,
        /// The parser's message, with line, column and the offending lines.
        message: String,
    },
    /// The YAML has the right shape but wrong values.
    #[error("{file}: {} problem(s):\n{}", problems.len(), problems.iter().map(|p| format!("  {p}")).collect::<Vec<_>>().join("\n"))]
    Invalid {
        /// The file (or `<built-in>`).
        file: PathBuf,
        /// Every problem found.
        problems: Vec<Problem>,
    },
    /// A policy built in code (see [`crate::PolicyBuilder`]) has wrong values.
    #[error("the policy built in code: {} problem(s):\n{}", problems.len(), problems.iter().map(|p| format!("  {p}")).collect::<Vec<_>>().join("\n"))]
    Built {
        /// Every problem found, each named by the key a policy file would have.
        problems: Vec<Problem>,
    },
}

impl PolicyError {
    /// The problems, when the policy parsed but did not validate.
    pub fn problems(&self) -> &[Problem] {
        match self {
            PolicyError::Invalid { problems, .. } | PolicyError::Built { problems } => problems,
            _ => &[],
        }
    }
}

/// Reads, parses and validates a policy file (feature `yaml`).
///
/// # Errors
/// [`PolicyError`] naming the file and what is wrong.
#[cfg(feature = "yaml")]
pub fn load_file(file: &Path) -> Result<Policy, PolicyError> {
    let text = std::fs::read_to_string(file).map_err(|source| PolicyError::Read {
        file: file.to_owned(),
        source,
    })?;
    parse_str(&text, file)
}

/// Parses and validates policy YAML (feature `yaml`); `file` names it in errors.
///
/// # Errors
/// [`PolicyError::Parse`] or [`PolicyError::Invalid`].
#[cfg(feature = "yaml")]
pub fn parse_str(text: &str, file: &Path) -> Result<Policy, PolicyError> {
    let raw: RawPolicy =
        serde_saphyr::from_str_with_options(text, yaml_options()).map_err(|e| {
            PolicyError::Parse {
                file: file.to_owned(),
                message: e.to_string(),
            }
        })?;
    validate(&raw).map_err(|problems| PolicyError::Invalid {
        file: file.to_owned(),
        problems,
    })
}

/// The YAML reader's bounds for a policy file: room for the largest policy the
/// validator takes ([`MAX_WORKSPACES`] workspaces of 4 nodes and 5 events each,
/// [`crate::tenants::MAX_KEYS`] keys of 9 nodes and 10 events each, and the rest),
/// where the reader's defaults (250,000 nodes, 1,000,000 events) stop a file at about
/// 62,000 workspaces. Anchors, aliases, depth and scalar bytes keep their default
/// bounds.
#[cfg(feature = "yaml")]
fn yaml_options() -> serde_saphyr::Options {
    /// Nodes (mappings, sequences and scalars) in one policy file.
    const MAX_NODES: usize = 2_000_000;
    /// Parser events in one policy file.
    const MAX_EVENTS: usize = 3_000_000;
    let mut budget = serde_saphyr::Budget::default();
    budget.max_nodes = MAX_NODES;
    budget.max_events = MAX_EVENTS;
    let mut options = serde_saphyr::Options::default();
    options.budget = Some(budget);
    options
}

/// Checks a raw policy and builds the typed one.
///
/// # Errors
/// Every problem found, each with its key path.
pub fn validate(raw: &RawPolicy) -> Result<Policy, Vec<Problem>> {
    let mut v = Checker::default();
    v.class_names(raw);
    v.ceiling_names(raw);
    let profiles: Vec<(String, Profile)> = raw
        .profiles
        .iter()
        .filter_map(|(name, p)| {
            v.profile(&format!("profiles.{name}"), p)
                .map(|p| (name.clone(), p))
        })
        .collect();
    if raw.profiles.is_empty() {
        v.problem(
            "profiles",
            "at least one profile (e.g. `production`) is required",
        );
    }
    let profile_name = raw
        .profile
        .clone()
        .unwrap_or_else(|| "production".to_owned());
    let profile = profiles
        .iter()
        .find(|(n, _)| *n == profile_name)
        .map(|(_, p)| p.clone());
    if !raw.profiles.is_empty() && !raw.profiles.contains_key(&profile_name) {
        v.problem(
            "profile",
            format!(
                "names no profile: {profile_name:?}; defined are {}",
                raw.profiles.keys().cloned().collect::<Vec<_>>().join(", ")
            ),
        );
    }
    let window = v.nonzero("window_seconds", raw.window_seconds.unwrap_or(60));
    let identity = v.identity(raw);
    let mut bucket_index = HashMap::new();
    let mut buckets = Vec::new();
    for (name, b) in &raw.buckets {
        let at = format!("buckets.{name}");
        let per = match b.per.as_str() {
            "ip" => Some(Per::Ip),
            "caller" => Some(Per::Caller),
            "user" => Some(Per::User),
            "workspace" => Some(Per::Workspace),
            other => {
                v.problem(
                    format!("{at}.per"),
                    format!("expected ip, caller, user or workspace, got {other:?}"),
                );
                None
            }
        };
        let refusal = match (b.refusal.as_deref(), &b.message) {
            (None | Some("edge"), None) => Some(Refusal::Edge),
            (None | Some("edge"), Some(_)) => {
                v.problem(
                    format!("{at}.message"),
                    "a message needs `refusal: envelope`",
                );
                None
            }
            (Some("envelope"), m) => Some(Refusal::Envelope {
                message: m.clone().unwrap_or_else(|| {
                    "Rate limited. Try again in {retry_after} seconds.".to_owned()
                }),
            }),
            (Some(other), _) => {
                v.problem(
                    format!("{at}.refusal"),
                    format!("expected edge or envelope, got {other:?}"),
                );
                None
            }
        };
        let limit = v.nonzero(&format!("{at}.limit"), b.limit);
        let w = v.nonzero(&format!("{at}.window_seconds"), b.window_seconds);
        let on_exhausted = match b.on_exhausted.as_deref() {
            None | Some("refuse") => Some(OnExhausted::Refuse),
            Some("pass") if b.weighted => Some(OnExhausted::Pass),
            Some("pass") => {
                v.problem(
                    format!("{at}.on_exhausted"),
                    "`pass` is for weighted budgets (`weighted: true`), whose upstream answers for them",
                );
                None
            }
            Some(other) => {
                v.problem(
                    format!("{at}.on_exhausted"),
                    format!("expected refuse or pass, got {other:?}"),
                );
                None
            }
        };
        let mode = v.mode(&format!("{at}.mode"), b.mode.as_deref());
        let limits: Vec<(String, u32)> = limit
            .map(|l| (String::new(), l.get()))
            .into_iter()
            .collect();
        let algorithm = v.algorithm(
            &at,
            (b.algorithm.as_deref(), b.burst),
            b.window_seconds,
            &limits,
        );
        if let (
            Some(per),
            Some(refusal),
            Some(limit),
            Some(window),
            Some(on_exhausted),
            Some(mode),
            Some(algorithm),
        ) = (per, refusal, limit, w, on_exhausted, mode, algorithm)
        {
            bucket_index.insert(name.clone(), buckets.len());
            buckets.push(Bucket {
                name: name.clone(),
                limit,
                window,
                per,
                refusal,
                weighted: b.weighted,
                on_exhausted,
                mode,
                algorithm,
            });
        }
    }
    if raw.buckets.len() > MAX_BUCKETS {
        v.problem("buckets", format!("at most {MAX_BUCKETS} buckets"));
    }
    let mut quota_index = HashMap::new();
    let mut quotas = Vec::new();
    for (name, q) in &raw.quotas {
        let at = format!("quotas.{name}.monthly");
        let monthly = match q.monthly {
            None => None,
            Some(n) => match v.nonzero(&at, n) {
                Some(n) => Some(n),
                None => continue,
            },
        };
        if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
            v.problem(
                format!("quotas.{name}"),
                "a family name is letters, digits and `_`",
            );
            continue;
        }
        let Some(mode) = v.mode(&format!("quotas.{name}.mode"), q.mode.as_deref()) else {
            continue;
        };
        if q.algorithm.is_some() {
            v.problem(
                format!("quotas.{name}.algorithm"),
                "a quota counts calendar months (UTC) and takes no algorithm; remove it",
            );
            continue;
        }
        quota_index.insert(name.clone(), quotas.len());
        quotas.push(QuotaFamily {
            name: name.clone(),
            monthly,
            mode,
        });
    }
    if raw.quotas.len() > MAX_QUOTA_FAMILIES {
        v.problem(
            "quotas",
            format!("at most {MAX_QUOTA_FAMILIES} quota families"),
        );
    }
    let mut lane_index = HashMap::new();
    let mut lanes = Vec::new();
    for (name, raw_lane) in &raw.lanes {
        if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
            v.problem(
                format!("lanes.{name}"),
                "a lane name is letters, digits and `_`",
            );
            continue;
        }
        if let Some(lane) = v.lane(name, raw_lane) {
            lane_index.insert(name.clone(), lanes.len());
            lanes.push(lane);
        }
    }
    if raw.lanes.len() > MAX_LANES {
        v.problem("lanes", format!("at most {MAX_LANES} lanes"));
    }
    let mut routes = Vec::new();
    for (i, r) in raw.routes.iter().enumerate() {
        let at = format!("routes[{i}]");
        let method = r.method.as_deref().and_then(|m| {
            match Method::from_bytes(m.to_ascii_uppercase().as_bytes()) {
                Ok(m) => Some(m),
                Err(_) => {
                    v.problem(format!("{at}.method"), format!("not an HTTP method: {m:?}"));
                    None
                }
            }
        });
        let path = r.path.as_deref().and_then(|p| match PathPattern::parse(p) {
            Ok(p) => Some(p),
            Err(e) => {
                v.problem(format!("{at}.path"), e);
                None
            }
        });
        let class = match (r.jsonrpc, r.class.as_deref()) {
            (true, None) => Some(RouteClass::JsonRpc),
            (true, Some(_)) => {
                v.problem(
                    format!("{at}.class"),
                    "a JSON-RPC route takes its class from the body; remove `class`",
                );
                None
            }
            (false, Some(c)) => v.class(&format!("{at}.class"), c).map(RouteClass::Fixed),
            (false, None) => {
                v.problem(format!("{at}.class"), "required (or `jsonrpc: true`)");
                None
            }
        };
        if r.buckets.len() > MAX_ROUTE_BUCKETS {
            v.problem(
                format!("{at}.buckets"),
                format!("at most {MAX_ROUTE_BUCKETS} buckets per route (a decision touches at most {} budgets)", sluice_core::MAX_BUDGETS),
            );
        }
        let spends = v.spends(
            &at,
            (&r.buckets, r.quota.as_deref(), r.lane.as_deref()),
            &bucket_index,
            &quota_index,
            &lane_index,
        );
        let mode = v.mode(&format!("{at}.mode"), r.mode.as_deref());
        if let (Some(class), Some(mode)) = (class, mode) {
            routes.push(Route {
                method,
                path,
                class,
                buckets: spends.buckets,
                quota: spends.quota,
                lane: spends.lane,
                batch: None,
                mode,
            });
        }
    }
    let default_class = match (raw.default_class.as_deref(), routes.last()) {
        (Some(name), _) => v.class("default_class", name),
        // A last route with no method and no path takes every request the others
        // leave: its class is the default.
        (None, Some(last)) if last.method.is_none() && last.path.is_none() => match last.class {
            RouteClass::Fixed(c) => Some(c),
            RouteClass::JsonRpc => {
                v.problem(
                    "default_class",
                    "required: the catch-all route is JSON-RPC, so name the class of a request no rule names",
                );
                None
            }
        },
        // A policy of one class needs no default.
        (None, _) if v.classes.len() == 1 => Class::from_index(0),
        (None, _) => {
            v.problem(
                "default_class",
                "required: the class of a request no route matches (or end `routes` with a route with no method and no path)",
            );
            None
        }
    };
    let jsonrpc = v.jsonrpc(raw, default_class, &bucket_index, &quota_index, &lane_index);
    // Each batch lane's endpoints are routes of the table (their classes are what a
    // submit and a status read cost), marked so that sluice answers them; items
    // count against the single-call route's quota.
    for (l, lane) in lanes.iter_mut().enumerate() {
        let Some(batch) = &mut lane.batch else {
            continue;
        };
        fn find(routes: &[Route], method: &Method, path: &str) -> Option<usize> {
            routes.iter().position(|r| r.matches(method, path))
        }
        let single = find(&routes, &Method::POST, &batch.route);
        batch.quota = single.and_then(|i| routes[i].quota);
        let submit = batch.submit_path();
        let status = format!("{}/batches/{{id}}", batch.route);
        for (method, path, endpoint) in [
            (Method::POST, submit.clone(), BatchEndpoint::Submit(l)),
            (
                Method::GET,
                format!("{}/batches/x", batch.route),
                BatchEndpoint::Status(l),
            ),
        ] {
            let wanted = if matches!(endpoint, BatchEndpoint::Submit(_)) {
                &submit
            } else {
                &status
            };
            match find(&routes, &method, &path) {
                Some(i)
                    if routes[i]
                        .path
                        .as_ref()
                        .is_some_and(|p| p.as_str().split('{').next() == wanted.split('{').next()) =>
                {
                    routes[i].batch = Some(endpoint);
                }
                _ => v.problem(
                    format!("lanes.{}.batch.route", lane.name),
                    format!("the routes need `{{ method: {method}, path: \"{wanted}\", class: … }}` before any route that matches it (its class is what the call costs)"),
                ),
            }
        }
    }
    for lane in &lanes {
        let Some(batch) = &lane.batch else { continue };
        for (field, tool) in [
            ("submit_tool", &batch.submit_tool),
            ("status_tool", &batch.status_tool),
        ] {
            if let Some(tool) = tool
                && !raw.jsonrpc.tools.contains_key(tool)
            {
                v.problem(
                    format!("lanes.{}.batch.{field}", lane.name),
                    format!("no tool named {tool:?} under `jsonrpc.tools`"),
                );
            }
        }
    }
    if let Some(j) = &jsonrpc {
        v.budget_counts(&routes, j);
    }
    let bounds = Bounds {
        max_body_bytes: raw.limits.max_body_bytes.unwrap_or(DEFAULT_MAX_BODY_BYTES),
        max_json_depth: raw.limits.max_json_depth.unwrap_or(DEFAULT_MAX_JSON_DEPTH),
        max_batch_items: raw
            .limits
            .max_batch_items
            .unwrap_or(DEFAULT_MAX_BATCH_ITEMS),
    };
    if bounds.max_body_bytes == 0 || bounds.max_json_depth == 0 || bounds.max_batch_items == 0 {
        v.problem("limits", "every bound must be above zero");
    }
    if bounds.max_json_depth > MAX_JSON_DEPTH {
        v.problem(
            "limits.max_json_depth",
            format!(
                "at most {MAX_JSON_DEPTH} (the JSON parser reads no deeper), got {}",
                bounds.max_json_depth
            ),
        );
    }
    let paths = Paths {
        merge_slashes: raw.paths.merge_slashes.unwrap_or(true),
        case: match raw.paths.case {
            Some(crate::raw::RawPathCase::Sensitive) => crate::PathCase::Sensitive,
            Some(crate::raw::RawPathCase::Insensitive) | None => crate::PathCase::Insensitive,
        },
    };
    let store = v.store(raw);
    let (classes, ceilings) = v.budgets_without_objects(raw);
    let plans = v.plans(raw, &classes, &buckets, &quotas, &lanes);
    let tenants = v.tenants(raw, &plans);
    let domains = crate::domains::from_policy(&raw.domains, &mut v.problems);
    crate::domains::check_unique(&domains, &mut v.problems);
    let default_plan = plans.iter().position(|p| p.name == "default");
    let parts = (profile, window, identity, default_class, jsonrpc, store);
    if !v.problems.is_empty() {
        return Err(v.problems);
    }
    match parts {
        (
            Some(profile),
            Some(window),
            Some(identity),
            Some(default_class),
            Some(jsonrpc),
            Some(store),
        ) => Ok(Policy {
            profile_name,
            profiles,
            profile,
            window,
            identity,
            buckets,
            quotas,
            lanes,
            domains,
            routes,
            default_class,
            jsonrpc,
            ietf_headers: raw.headers.ietf_draft,
            bounds,
            paths,
            store,
            classes,
            ceilings,
            dry_run: raw.dry_run,
            plans,
            default_plan,
            tenants,
        }),
        _ => Err(v.problems),
    }
}

#[derive(Default)]
pub(crate) struct Checker {
    pub(crate) problems: Vec<Problem>,
    /// The classes' names, cheapest first (a [`Class`] indexes them).
    pub(crate) classes: Vec<String>,
    /// The ceilings' names (indexes of [`Policy::ceilings`]).
    pub(crate) ceilings: Vec<String>,
}

/// True when `name` may name a workspace: printable ASCII, no space at either end,
/// not starting with `key:` or `ip:` (the labels of callers with no principal).
pub(crate) fn is_workspace_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 256
        && name.bytes().all(|b| b.is_ascii_graphic() || b == b' ')
        && !name.starts_with(' ')
        && !name.ends_with(' ')
        && !name.starts_with("key:")
        && !name.starts_with("ip:")
}

/// True when `name` may name a class or a ceiling: 1 to [`MAX_CLASS_NAME`] ASCII
/// letters, digits, `_`, `-` and `.` (it is sent in headers, quoted in
/// `RateLimit-Policy`, and in metric labels).
fn is_budget_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_CLASS_NAME
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
}

impl Checker {
    pub(crate) fn problem(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.problems.push(Problem {
            path: path.into(),
            message: message.into(),
        });
    }

    fn nonzero(&mut self, path: &str, n: u32) -> Option<NonZeroU32> {
        let nz = NonZeroU32::new(n);
        if nz.is_none() {
            self.problem(
                path,
                "must be at least 1 (a limit of 0 would refuse everything)",
            );
        }
        nz
    }

    fn class(&mut self, path: &str, name: &str) -> Option<Class> {
        let c = self
            .classes
            .iter()
            .position(|c| c == name)
            .and_then(Class::from_index);
        if c.is_none() {
            let known = self.classes.join(", ");
            self.problem(
                path,
                format!("unknown class {name:?}; the profiles name {known}"),
            );
        }
        c
    }

    /// The classes: those the profiles name, in the order they name them, which
    /// must be the same in every profile (a class's place is its rank).
    fn class_names(&mut self, raw: &RawPolicy) {
        let Some((first, p)) = raw.profiles.iter().next() else {
            return;
        };
        let names: Vec<String> = p.classes.0.iter().map(|(n, _)| n.clone()).collect();
        for (name, other) in raw.profiles.iter().skip(1) {
            let theirs: Vec<&String> = other.classes.0.iter().map(|(n, _)| n).collect();
            if theirs != names.iter().collect::<Vec<_>>() {
                self.problem(
                    format!("profiles.{name}.classes"),
                    format!(
                        "names {} where profile {first} names {}: every profile names the same classes in the same order (cheapest first)",
                        theirs.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", "),
                        names.join(", ")
                    ),
                );
            }
        }
        if names.is_empty() || names.len() > MAX_CLASSES {
            self.problem(
                format!("profiles.{first}.classes"),
                format!(
                    "a policy has 1 to {MAX_CLASSES} classes, this one {}",
                    names.len()
                ),
            );
        }
        for name in &names {
            if !is_budget_name(name) {
                self.problem(
                    format!("profiles.{first}.classes.{name}"),
                    format!(
                        "a class name is 1 to {MAX_CLASS_NAME} letters, digits, `_`, `-` or `.`"
                    ),
                );
            }
        }
        self.classes = names.into_iter().take(MAX_CLASSES).collect();
    }

    /// The ceilings' names (`ceilings:`), each unlike every class's.
    fn ceiling_names(&mut self, raw: &RawPolicy) {
        if raw.ceilings.len() > MAX_CEILINGS {
            self.problem("ceilings", format!("at most {MAX_CEILINGS} ceilings"));
        }
        for name in raw.ceilings.keys() {
            if !is_budget_name(name) {
                self.problem(
                    format!("ceilings.{name}"),
                    format!(
                        "a ceiling name is 1 to {MAX_CLASS_NAME} letters, digits, `_`, `-` or `.`"
                    ),
                );
            } else if self.classes.contains(name) {
                self.problem(
                    format!("ceilings.{name}"),
                    "a class has this name: headers, metrics and `modes:` name both, so they differ",
                );
            }
        }
        self.ceilings = raw.ceilings.keys().take(MAX_CEILINGS).cloned().collect();
    }

    fn profile(&mut self, at: &str, p: &RawProfile) -> Option<Profile> {
        let classes: Vec<Option<NonZeroU32>> = p
            .classes
            .0
            .iter()
            .take(MAX_CLASSES)
            .map(|(name, limit)| self.nonzero(&format!("{at}.classes.{name}"), *limit))
            .collect();
        let ceilings: Vec<Option<NonZeroU32>> = self
            .ceilings
            .clone()
            .iter()
            .map(|name| match p.ip_ceilings.get(name) {
                Some(&limit) => self.nonzero(&format!("{at}.ip_ceilings.{name}"), limit),
                None => {
                    self.problem(
                        format!("{at}.ip_ceilings.{name}"),
                        format!("required: the limit per IP and window of ceiling {name}"),
                    );
                    None
                }
            })
            .collect();
        for name in p.ip_ceilings.keys() {
            if !self.ceilings.contains(name) {
                let declared = if self.ceilings.is_empty() {
                    "none".to_owned()
                } else {
                    self.ceilings.join(", ")
                };
                self.problem(
                    format!("{at}.ip_ceilings.{name}"),
                    format!("no ceiling {name:?} under `ceilings:` (declared: {declared}); a ceiling says there which classes it is over"),
                );
            }
        }
        Some(Profile {
            classes: classes.into_iter().collect::<Option<Vec<_>>>()?,
            ceilings: ceilings.into_iter().collect::<Option<Vec<_>>>()?,
        })
    }

    fn identity(&mut self, raw: &RawPolicy) -> Option<Identity> {
        let id = &raw.identity;
        let sources = id
            .credentials
            .clone()
            .unwrap_or_else(|| vec!["x_api_key".into(), "bearer".into(), "session_cookie".into()]);
        let mut credentials = Vec::new();
        for (i, s) in sources.iter().enumerate() {
            match s.as_str() {
                "x_api_key" => credentials.push(CredentialSource::ApiKeyHeader),
                "bearer" => credentials.push(CredentialSource::Bearer),
                "session_cookie" => credentials.push(CredentialSource::SessionCookie),
                other => self.problem(
                    format!("identity.credentials[{i}]"),
                    format!("expected x_api_key, bearer or session_cookie, got {other:?}"),
                ),
            }
        }
        let counted = match id.counted_credential.as_deref() {
            None => None,
            Some(name) => {
                let source = match name {
                    "x_api_key" => Some(CredentialSource::ApiKeyHeader),
                    "bearer" => Some(CredentialSource::Bearer),
                    "session_cookie" => Some(CredentialSource::SessionCookie),
                    _ => None,
                };
                match source {
                    Some(s) if credentials.contains(&s) => Some(s),
                    _ => {
                        self.problem(
                            "identity.counted_credential".to_owned(),
                            format!("expected one of identity.credentials, got {name:?}"),
                        );
                        None
                    }
                }
            }
        };
        let mut trusted_proxies = Vec::new();
        for (i, c) in id.trusted_proxies.iter().enumerate() {
            let parsed = c
                .parse::<IpNet>()
                .or_else(|_| c.parse::<std::net::IpAddr>().map(IpNet::from));
            match parsed {
                Ok(net) => trusted_proxies.push(net),
                Err(_) => self.problem(
                    format!("identity.trusted_proxies[{i}]"),
                    format!("expected an IP address or CIDR such as 10.0.0.0/8, got {c:?}"),
                ),
            }
        }
        let ipv6_prefix = id.ipv6_prefix.unwrap_or(64);
        if ipv6_prefix == 0 || ipv6_prefix > 128 {
            self.problem(
                "identity.ipv6_prefix",
                format!("expected 1..=128, got {ipv6_prefix}"),
            );
        }
        let mut keys = HashMap::new();
        for (i, k) in id.keys.iter().enumerate() {
            for (field, name) in [("workspace", &k.workspace), ("user", &k.user)] {
                if !is_workspace_name(name) {
                    self.problem(
                        format!("identity.keys[{i}].{field}"),
                        format!("expected printable ASCII not starting with `key:` or `ip:` (it is sent upstream as a header), got {name:?}"),
                    );
                }
            }
            let mut digest = [0u8; 32];
            match hex::decode_to_slice(&k.sha256, &mut digest) {
                Ok(()) => {
                    if keys
                        .insert(
                            digest,
                            Principal {
                                workspace: k.workspace.clone(),
                                user: k.user.clone(),
                            },
                        )
                        .is_some()
                    {
                        self.problem(format!("identity.keys[{i}].sha256"), "listed twice");
                    }
                }
                Err(_) => self.problem(
                    format!("identity.keys[{i}].sha256"),
                    "expected 64 hex digits: the SHA-256 of the credential (e.g. `printf %s KEY | sha256sum`)",
                ),
            }
        }
        let principal_headers = id.principal_headers.as_ref().and_then(|h| {
            match (
                HeaderName::try_from(h.workspace.as_str()),
                HeaderName::try_from(h.user.as_str()),
            ) {
                (Ok(w), Ok(u)) => Some((w, u)),
                _ => {
                    self.problem("identity.principal_headers", "expected valid header names");
                    None
                }
            }
        });
        let plan_header = id
            .principal_headers
            .as_ref()
            .and_then(|h| h.plan.as_deref())
            .and_then(|name| match HeaderName::try_from(name) {
                Ok(h) => Some(h),
                Err(_) => {
                    self.problem(
                        "identity.principal_headers.plan",
                        "expected a valid header name",
                    );
                    None
                }
            });
        if principal_headers.is_some() && trusted_proxies.is_empty() {
            self.problem(
                "identity.principal_headers",
                "believed only from trusted proxies: list them under identity.trusted_proxies",
            );
        }
        Some(Identity {
            credentials,
            counted,
            session_cookie: id
                .session_cookie
                .clone()
                .unwrap_or_else(|| "session".to_owned()),
            trusted_proxies,
            ipv6_prefix,
            keys,
            revoked: std::collections::HashSet::new(),
            principal_headers,
            plan_header,
        })
    }

    fn store(&mut self, raw: &RawPolicy) -> Option<StorePolicy> {
        let s = &raw.store;
        let timeout_ms = s.timeout_ms.unwrap_or(DEFAULT_STORE_TIMEOUT_MS);
        if timeout_ms == 0 || timeout_ms > 60_000 {
            self.problem(
                "store.timeout_ms",
                format!("expected 1..=60000 milliseconds, got {timeout_ms}"),
            );
        }
        let replicas = self.nonzero("store.replicas", s.replicas.unwrap_or(1));
        Some(StorePolicy {
            timeout: std::time::Duration::from_millis(timeout_ms),
            replicas: replicas?,
        })
    }

    /// A `mode:` at `at`: `enforce` (the default) or `shadow`.
    fn mode(&mut self, at: &str, mode: Option<&str>) -> Option<Enforcement> {
        match mode {
            None | Some("enforce") => Some(Enforcement::Enforce),
            Some("shadow") => Some(Enforcement::Shadow),
            Some(other) => {
                self.problem(at, format!("expected enforce or shadow, got {other:?}"));
                None
            }
        }
    }

    /// `algorithm:` and `burst:` of the budget at `at`, whose window is `window`
    /// seconds and whose limits are `limits` (each with what names it in a message:
    /// a class has one per profile).
    fn algorithm(
        &mut self,
        at: &str,
        (algorithm, burst): (Option<&str>, Option<u32>),
        window: u32,
        limits: &[(String, u32)],
    ) -> Option<Algorithm> {
        let algorithm = match algorithm {
            None | Some("fixed") => Algorithm::Fixed,
            Some("sliding") => Algorithm::Sliding,
            Some("gcra") => Algorithm::Gcra { burst: None },
            Some(other) => {
                self.problem(
                    format!("{at}.algorithm"),
                    format!("expected fixed, sliding or gcra, got {other:?}"),
                );
                return None;
            }
        };
        let mut ok = true;
        if algorithm == Algorithm::Sliding && window > MAX_SLIDING_WINDOW_SECONDS {
            self.problem(
                format!("{at}.algorithm"),
                format!(
                    "a sliding window is counted in milliseconds: at most {MAX_SLIDING_WINDOW_SECONDS} seconds, this one is {window}"
                ),
            );
            ok = false;
        }
        let Some(burst) = burst else {
            return ok.then_some(algorithm);
        };
        if algorithm != (Algorithm::Gcra { burst: None }) {
            self.problem(
                format!("{at}.burst"),
                format!(
                    "`burst` is for `algorithm: gcra`; this budget is {}",
                    algorithm.name()
                ),
            );
            return None;
        }
        let Some(burst) = NonZeroU32::new(burst) else {
            self.problem(
                format!("{at}.burst"),
                "must be at least 1 (a burst of 0 would refuse everything)",
            );
            return None;
        };
        for (of, limit) in limits {
            if burst.get() > *limit {
                self.problem(
                    format!("{at}.burst"),
                    format!(
                        "{burst} is above the limit{of} ({limit}): at most the limit can go at once"
                    ),
                );
                ok = false;
            }
        }
        ok.then_some(Algorithm::Gcra { burst: Some(burst) })
    }

    /// The classes and the ceilings with what they take from `modes:`,
    /// `algorithms:` and `store.outage` (all by name).
    fn budgets_without_objects(&mut self, raw: &RawPolicy) -> (Vec<CostClass>, Vec<Ceiling>) {
        let mut classes: Vec<CostClass> = self
            .classes
            .iter()
            .map(|name| CostClass {
                name: name.clone(),
                mode: Enforcement::Enforce,
                algorithm: Algorithm::Fixed,
                outage: Outage::FailOpen,
            })
            .collect();
        let mut ceilings = Vec::new();
        for (name, c) in &raw.ceilings {
            if !self.ceilings.contains(name) {
                continue;
            }
            let mut over = ClassSet::EMPTY;
            for (i, class) in c.classes.iter().enumerate() {
                if let Some(class) = self.class(&format!("ceilings.{name}.classes[{i}]"), class) {
                    over = over.with(class);
                }
            }
            if c.classes.is_empty() {
                self.problem(
                    format!("ceilings.{name}.classes"),
                    "name the classes the ceiling is over (at least one)",
                );
            }
            ceilings.push(Ceiling {
                name: name.clone(),
                over,
                only: c.only,
                mode: Enforcement::Enforce,
                algorithm: Algorithm::Fixed,
            });
        }
        let expected = |v: &Self| {
            let mut names: Vec<&str> = v.classes.iter().map(String::as_str).collect();
            names.extend(v.ceilings.iter().map(String::as_str));
            names.join(", ")
        };
        for (name, mode) in &raw.modes {
            let at = format!("modes.{name}");
            let Some(mode) = self.mode(&at, Some(mode)) else {
                continue;
            };
            if let Some(c) = classes.iter_mut().find(|c| c.name == *name) {
                c.mode = mode;
            } else if let Some(c) = ceilings.iter_mut().find(|c| c.name == *name) {
                c.mode = mode;
            } else {
                let names = expected(self);
                self.problem(
                    at,
                    format!("expected a class or a ceiling ({names}); buckets, quotas and routes take `mode:` themselves"),
                );
            }
        }
        let window = raw.window_seconds.unwrap_or(60);
        for (name, a) in &raw.algorithms {
            let at = format!("algorithms.{name}");
            let is_class = self.classes.contains(name);
            if !is_class && !self.ceilings.contains(name) {
                let names = expected(self);
                self.problem(
                    at,
                    format!("expected a class or a ceiling ({names}); buckets take `algorithm:` themselves, and quotas none"),
                );
                continue;
            }
            // A burst must fit the budget's limit in every profile (`--profile`
            // may pick any of them).
            let limits: Vec<(String, u32)> = raw
                .profiles
                .iter()
                .filter_map(|(profile, p)| {
                    let limit = if is_class {
                        p.classes.get(name)
                    } else {
                        p.ip_ceilings.get(name).copied()
                    }?;
                    (limit > 0).then(|| (format!(" of profile {profile}"), limit))
                })
                .collect();
            let Some(algorithm) =
                self.algorithm(&at, (a.algorithm.as_deref(), a.burst), window, &limits)
            else {
                continue;
            };
            if let Some(c) = classes.iter_mut().find(|c| c.name == *name) {
                c.algorithm = algorithm;
            } else if let Some(c) = ceilings.iter_mut().find(|c| c.name == *name) {
                c.algorithm = algorithm;
            }
        }
        for (name, choice) in &raw.store.outage {
            let at = format!("store.outage.{name}");
            let Some(class) = self.class(&at, name) else {
                continue;
            };
            let outage = match choice.as_str() {
                "fail_open" => Outage::FailOpen,
                "fail_closed" => Outage::FailClosed,
                other => {
                    self.problem(
                        at,
                        format!("expected fail_open or fail_closed, got {other:?}"),
                    );
                    continue;
                }
            };
            if let Some(c) = classes.get_mut(class.index()) {
                c.outage = outage;
            }
        }
        (classes, ceilings)
    }

    /// `plans:`, each override checked to name a budget of the policy and to be a
    /// limit it can take.
    pub(crate) fn plans(
        &mut self,
        raw: &RawPolicy,
        classes: &[CostClass],
        buckets: &[Bucket],
        quotas: &[QuotaFamily],
        lanes: &[Lane],
    ) -> Vec<CustomerPlan> {
        if raw.plans.len() > MAX_PLANS {
            self.problem("plans", format!("at most {MAX_PLANS} plans"));
        }
        let mut plans = Vec::new();
        for (name, p) in raw.plans.iter().take(MAX_PLANS) {
            let at = format!("plans.{name}");
            if !is_budget_name(name) {
                self.problem(
                    &at,
                    format!(
                        "a plan name is 1 to {MAX_CLASS_NAME} letters, digits, `_`, `-` or `.`"
                    ),
                );
            }
            let mut plan = CustomerPlan {
                name: name.clone(),
                classes: vec![None; classes.len()],
                ceilings: vec![None; self.ceilings.len()],
                buckets: vec![None; buckets.len()],
                quotas: vec![None; quotas.len()],
                lanes: vec![PlanLane::default(); lanes.len()],
                mode: Enforcement::Enforce,
            };
            let mut ok = true;
            for (class, &limit) in &p.classes {
                let path = format!("{at}.classes.{class}");
                let (Some(c), Some(limit)) = (self.class(&path, class), self.nonzero(&path, limit))
                else {
                    ok = false;
                    continue;
                };
                if let Some(rule) = classes.get(c.index()) {
                    ok &= self.fits_burst(&path, rule.algorithm, limit);
                }
                plan.classes[c.index()] = Some(limit);
            }
            for (ceiling, &limit) in &p.ip_ceilings {
                let path = format!("{at}.ip_ceilings.{ceiling}");
                let Some(i) = self.ceilings.iter().position(|c| c == ceiling) else {
                    self.problem(&path, format!("no ceiling {ceiling:?} under `ceilings:`"));
                    ok = false;
                    continue;
                };
                plan.ceilings[i] = self.nonzero(&path, limit);
                ok &= plan.ceilings[i].is_some();
            }
            for (bucket, &limit) in &p.buckets {
                let path = format!("{at}.buckets.{bucket}");
                let Some(i) = buckets.iter().position(|b| b.name == *bucket) else {
                    self.problem(&path, format!("no bucket {bucket:?} under `buckets:`"));
                    ok = false;
                    continue;
                };
                plan.buckets[i] = self.nonzero(&path, limit);
                ok &= plan.buckets[i]
                    .is_some_and(|l| self.fits_burst(&path, buckets[i].algorithm, l));
            }
            for (family, &limit) in &p.quotas {
                let path = format!("{at}.quotas.{family}");
                let Some(i) = quotas.iter().position(|q| q.name == *family) else {
                    self.problem(&path, format!("no quota family {family:?} under `quotas:`"));
                    ok = false;
                    continue;
                };
                plan.quotas[i] = self.nonzero(&path, limit);
                ok &= plan.quotas[i].is_some();
            }
            for (lane, raw_lane) in &p.lanes {
                let path = format!("{at}.lanes.{lane}");
                let Some(i) = lanes.iter().position(|l| l.name == *lane) else {
                    self.problem(&path, format!("no lane {lane:?} under `lanes:`"));
                    ok = false;
                    continue;
                };
                let mut limit = |v: &mut Self, field: &str, value: Option<u32>| {
                    let value = value?;
                    let got = v.nonzero(&format!("{path}.{field}"), value);
                    ok &= got.is_some();
                    got
                };
                let own = PlanLane {
                    workspace_in_flight: limit(
                        self,
                        "workspace_in_flight",
                        raw_lane.workspace_in_flight,
                    ),
                    workspace_starts: limit(self, "workspace_starts", raw_lane.workspace_starts),
                };
                // A lane remembers each start of a workspace for its window.
                if let Some(starts) = own.workspace_starts
                    && starts.get() > MAX_LANE_STARTS
                {
                    self.problem(
                        format!("{path}.workspace_starts"),
                        format!(
                            "at most {MAX_LANE_STARTS} (each start is remembered for its window)"
                        ),
                    );
                    ok = false;
                }
                if own == PlanLane::default() {
                    self.problem(
                        &path,
                        "names no limit: set `workspace_in_flight`, `workspace_starts` or both",
                    );
                    ok = false;
                }
                plan.lanes[i] = own;
            }
            match self.mode(&format!("{at}.mode"), p.mode.as_deref()) {
                Some(mode) => plan.mode = mode,
                None => ok = false,
            }
            if plan.mode == Enforcement::Shadow
                && let Some(lane) = p.lanes.keys().next()
            {
                // A place in a lane is held or not: it cannot be taken in a dry run.
                self.problem(
                    format!("{at}.lanes.{lane}"),
                    "a plan in shadow mode cannot set a lane's limits: a lane's places cannot be dry-run",
                );
                ok = false;
            }
            if ok {
                plans.push(plan);
            }
        }
        plans
    }

    /// False (with a problem at `path`) when `limit` is below the `burst` of a
    /// `gcra` budget: at most the limit can go at once.
    fn fits_burst(&mut self, path: &str, algorithm: Algorithm, limit: NonZeroU32) -> bool {
        match algorithm {
            Algorithm::Gcra { burst: Some(burst) } if burst > limit => {
                self.problem(
                    path,
                    format!("{limit} is below the budget's gcra burst ({burst}): at most the limit can go at once"),
                );
                false
            }
            _ => true,
        }
    }

    /// The tenant table: `workspaces:` and the plans the key table names, one plan
    /// per workspace.
    fn tenants(&mut self, raw: &RawPolicy, plans: &[CustomerPlan]) -> Tenants {
        let mut tenants = Tenants::default();
        let plan_of =
            |v: &mut Self, at: &str, name: &str| match plans.iter().position(|p| p.name == name) {
                Some(i) => Some(i),
                None => {
                    let known: Vec<&str> = plans.iter().map(|p| p.name.as_str()).collect();
                    let known = if known.is_empty() {
                        "none".to_owned()
                    } else {
                        known.join(", ")
                    };
                    v.problem(
                        at,
                        format!("no plan {name:?} under `plans:` (declared: {known})"),
                    );
                    None
                }
            };
        let mut from: HashMap<&str, (usize, String)> = HashMap::new();
        for (workspace, w) in &raw.workspaces {
            let at = format!("workspaces.{workspace}");
            if !is_workspace_name(workspace) {
                self.problem(
                    &at,
                    "expected printable ASCII not starting with `key:` or `ip:` (it is sent upstream as a header)",
                );
                continue;
            }
            let plan = w.plan.as_deref().unwrap_or("default");
            if w.plan.is_none() && !plans.iter().any(|p| p.name == "default") {
                continue;
            }
            if let Some(i) = plan_of(self, &format!("{at}.plan"), plan) {
                from.insert(workspace, (i, format!("{at}.plan")));
            }
        }
        for (k, key) in raw.identity.keys.iter().enumerate() {
            let Some(plan) = &key.plan else { continue };
            let at = format!("identity.keys[{k}].plan");
            let Some(i) = plan_of(self, &at, plan) else {
                continue;
            };
            match from.get(key.workspace.as_str()) {
                Some((j, other)) if *j != i => self.problem(
                    at,
                    format!(
                        "workspace {:?} is on plan {:?} by {other}: a workspace has one plan",
                        key.workspace, plans[*j].name
                    ),
                ),
                Some(_) => {}
                None => {
                    from.insert(&key.workspace, (i, at));
                }
            }
        }
        if from.len() > MAX_WORKSPACES {
            self.problem(
                "workspaces",
                format!("at most {MAX_WORKSPACES} workspaces on a plan"),
            );
        }
        for (workspace, (i, _)) in from {
            let plan = crate::model::TenantPlan::Named(i);
            tenants
                .plans
                .insert(crate::identity::workspace_digest(workspace), plan);
            tenants.by_name.insert(workspace.to_owned(), plan);
        }
        tenants
    }

    /// The buckets, quota family and lane named at `at`, each checked to exist.
    fn spends(
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

    /// A lane's batch lane, checked, with the built-in defaults for what is left out.
    fn lane_batch(&mut self, lane: &str, raw: &RawLaneBatch) -> Option<LaneBatch> {
        let at = |field: &str| format!("lanes.{lane}.batch.{field}");
        let route_ok = raw.route.starts_with('/')
            && raw.route.len() > 1
            && !raw.route.ends_with('/')
            && raw
                .route
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"/-_.~".contains(&b));
        if !route_ok {
            self.problem(
                at("route"),
                "a plain path such as /messages/optimize (no parameters, no trailing /)",
            );
        }
        let max_items = self.nonzero(&at("max_items"), raw.max_items.unwrap_or(1000));
        let backlog = self.nonzero(&at("backlog"), raw.backlog.unwrap_or(5000));
        let keep = self.nonzero(&at("keep_hours"), raw.keep_hours.unwrap_or(168));
        if let (Some(items), Some(backlog)) = (max_items, backlog)
            && items > backlog
        {
            self.problem(
                at("max_items"),
                format!("more than the backlog ({backlog}): such a batch could never be queued"),
            );
        }
        Some(LaneBatch {
            route: raw.route.clone(),
            max_items: max_items?,
            backlog: backlog?,
            keep: Duration::from_secs(u64::from(keep?.get()) * 3600),
            submit_tool: raw.submit_tool.clone(),
            status_tool: raw.status_tool.clone(),
            quota: None,
        })
        .filter(|_| route_ok)
    }

    /// A lane's settings, each checked, with the built-in defaults for what is
    /// left out.
    fn lane(&mut self, name: &str, raw: &RawLane) -> Option<Lane> {
        let at = |field: &str| format!("lanes.{name}.{field}");
        let count = |v: &mut Self, field: &str, value: Option<u32>, default: u32| {
            v.nonzero(&at(field), value.unwrap_or(default))
        };
        let workspace_in_flight = count(self, "workspace_in_flight", raw.workspace_in_flight, 3);
        let workspace_starts = count(self, "workspace_starts", raw.workspace_starts, 12);
        let starts_window = count(self, "starts_window_seconds", raw.starts_window_seconds, 60);
        let global_in_flight = count(self, "global_in_flight", raw.global_in_flight, 20);
        let wait = count(self, "wait_seconds", raw.wait_seconds, 15);
        let jsonrpc_wait = count(self, "jsonrpc_wait_seconds", raw.jsonrpc_wait_seconds, 120);
        let max_waiting = count(self, "max_waiting", raw.max_waiting, 1000);
        let timeout = count(self, "timeout_seconds", raw.timeout_seconds, 180);
        let failures = count(self, "breaker.failures", raw.breaker.failures, 5);
        let within = count(
            self,
            "breaker.within_seconds",
            raw.breaker.within_seconds,
            60,
        );
        let open = count(self, "breaker.open_seconds", raw.breaker.open_seconds, 30);
        let lease_ttl = count(self, "lease_ttl_seconds", raw.lease_ttl_seconds, 10);
        let batch_reserve = raw.batch_reserve.unwrap_or(5);
        // A lane remembers each start of a workspace for its window.
        if let Some(starts) = workspace_starts
            && starts.get() > MAX_LANE_STARTS
        {
            self.problem(
                at("workspace_starts"),
                format!("at most {MAX_LANE_STARTS} (each start is remembered for its window)"),
            );
        }
        let global = global_in_flight?;
        if batch_reserve >= global.get() {
            self.problem(
                at("batch_reserve"),
                format!("must be less than global_in_flight ({global}): batch items need a place"),
            );
            return None;
        }
        let secs = |n: NonZeroU32| Duration::from_secs(u64::from(n.get()));
        Some(Lane {
            name: name.to_owned(),
            workspace_in_flight: workspace_in_flight?,
            workspace_starts: workspace_starts?,
            starts_window: secs(starts_window?),
            global_in_flight: global,
            batch_reserve,
            wait: secs(wait?),
            jsonrpc_wait: secs(jsonrpc_wait?),
            max_waiting: max_waiting?,
            timeout: secs(timeout?),
            breaker_failures: failures?,
            breaker_within: secs(within?),
            breaker_open: secs(open?),
            lease_ttl: secs(lease_ttl?),
            batch: match &raw.batch {
                None => None,
                Some(b) => Some(self.lane_batch(name, b)?),
            },
            reasons: self.lane_reasons(name, raw)?,
        })
    }

    /// The names clients see for a lane's `busy` and `unavailable` refusals.
    fn lane_reasons(&mut self, lane: &str, raw: &RawLane) -> Option<LaneReasons> {
        let mut name = |field: &str, given: &Option<String>| {
            let name = given.clone().unwrap_or_else(|| format!("{lane}_{field}"));
            let ok = !name.is_empty()
                && name.len() <= MAX_CLASS_NAME
                && name
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
            if !ok {
                self.problem(
                    format!("lanes.{lane}.reasons.{field}"),
                    format!("a reason is 1 to {MAX_CLASS_NAME} lower-case letters, digits and `_`"),
                );
            }
            ok.then_some(name)
        };
        let busy = name("busy", &raw.reasons.busy);
        let unavailable = name("unavailable", &raw.reasons.unavailable);
        Some(LaneReasons {
            busy: busy?,
            unavailable: unavailable?,
        })
    }

    /// Checks that no request any route admits can touch more budgets than one
    /// decision holds: its classes, the IP ceilings, its buckets and quotas.
    fn budget_counts(&mut self, routes: &[Route], jsonrpc: &JsonRpc) {
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
            if n > sluice_core::MAX_BUDGETS {
                self.problem(
                    format!("routes[{i}]"),
                    format!(
                        "a request here may touch {n} budgets (classes, the IP ceilings, buckets and quotas, with its tools'); one decision holds at most {}",
                        sluice_core::MAX_BUDGETS
                    ),
                );
            }
        }
    }

    fn jsonrpc(
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
