//! `RawPolicy` → `Policy`: every check reported with the key path it is at. This
//! module holds the entry points and the order of the checks; each section of the
//! policy has its own file.

mod buckets;
mod classes;
mod identity;
mod lanes;
mod limits;
mod plans;
mod routes;
mod turns;

use std::num::NonZeroU32;
#[cfg(feature = "yaml")]
use std::path::Path;
use std::path::PathBuf;

use crate::model::Policy;
use crate::raw::RawPolicy;

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
    let (profile_name, profiles, profile) = v.profiles(raw);
    let window = v.nonzero("window_seconds", raw.window_seconds.unwrap_or(60));
    let identity = v.identity(raw);
    let (budget_index, buckets) = v.buckets(raw);
    let prices = v.prices(raw);
    let bucket_index = budget_index.buckets;
    let (quota_index, quotas) = v.quotas(raw);
    let (lane_index, mut lanes) = v.lanes(raw);
    let indices = routes::Indices {
        buckets: &bucket_index,
        tokens: &budget_index.tokens,
        spend: &budget_index.spend,
        quotas: &quota_index,
        lanes: &lane_index,
    };
    let mut routes = v.routes(raw, &indices);
    let default_class = v.default_class(raw, &routes);
    let jsonrpc = v.jsonrpc(raw, default_class, &bucket_index, &quota_index, &lane_index);
    v.batch_endpoints(&mut lanes, &mut routes);
    v.batch_tools(raw, &lanes);
    // Runs are counted when the policy writes `turns:` or has an LLM route.
    let runs = raw.turns.is_some() || routes.iter().any(|r| r.llm.is_some());
    if let Some(j) = &jsonrpc {
        v.budget_counts(&routes, j, runs);
    }
    let bounds = v.bounds(raw);
    let paths = limits::paths(raw);
    let store = v.store(raw);
    let (classes, ceilings) = v.budgets_without_objects(raw);
    let mut turns = v.turns(raw);
    turns.enabled = runs;
    let plans = v.plans(raw, (&classes, &buckets, &quotas, &lanes), &turns);
    let tenants = v.tenants(raw, &plans);
    let domains = crate::domains::from_policy(&raw.domains, &mut v.problems);
    crate::domains::check_unique(&domains, &mut v.problems);
    let default_plan = plans.iter().position(|p| p.name == "default");
    let near_limit_permille = v.near_limit(raw);
    let alerts = v.alerts(raw, &quotas, &buckets);
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
            prices,
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
            turns,
            near_limit_permille,
            alerts,
        }),
        _ => Err(v.problems),
    }
}

impl Checker {
    /// `alerts:` (SPEC O3): at most [`MAX_ALERTS`](crate::model::MAX_ALERTS)
    /// webhooks, each with an `http(s)://` URL, one to
    /// [`MAX_ALERT_THRESHOLDS`](crate::model::MAX_ALERT_THRESHOLDS) shares
    /// above 0 and at most 1, budgets that are quota families, token budgets or
    /// money budgets, a secret file, and bounded timings.
    fn alerts(
        &mut self,
        raw: &RawPolicy,
        quotas: &[crate::model::QuotaFamily],
        buckets: &[crate::model::Bucket],
    ) -> Vec<crate::model::Alert> {
        use crate::model::{Alert, MAX_ALERT_THRESHOLDS, MAX_ALERTS};
        use std::time::Duration;
        if raw.alerts.len() > MAX_ALERTS {
            self.problem("alerts", format!("at most {MAX_ALERTS} webhooks"));
        }
        let mut alerts = Vec::new();
        for (n, a) in raw.alerts.iter().enumerate().take(MAX_ALERTS) {
            let at = format!("alerts[{n}]");
            let url = match a.url.as_deref() {
                Some(u)
                    if (u.starts_with("http://") || u.starts_with("https://"))
                        && u.len() <= 2048
                        && u.parse::<http::Uri>().is_ok_and(|uri| uri.host().is_some()) =>
                {
                    u.to_owned()
                }
                _ => {
                    self.problem(
                        format!("{at}.url"),
                        "an http:// or https:// URL with a host (at most 2,048 bytes)",
                    );
                    String::new()
                }
            };
            let mut thresholds = Vec::new();
            if a.at.is_empty() || a.at.len() > MAX_ALERT_THRESHOLDS {
                self.problem(
                    format!("{at}.at"),
                    format!("1 to {MAX_ALERT_THRESHOLDS} shares of a limit, e.g. [0.8, 1.0]"),
                );
            }
            for (i, share) in a.at.iter().enumerate() {
                match share.as_f64().filter(|r| *r > 0.0 && *r <= 1.0) {
                    Some(r) => thresholds.push(((r * 1000.0).round() as u16).max(1)),
                    None => self.problem(
                        format!("{at}.at[{i}]"),
                        "a share of a limit, above 0 and at most 1",
                    ),
                }
            }
            thresholds.sort_unstable();
            thresholds.dedup();
            if a.budgets.is_empty() {
                self.problem(
                    format!("{at}.budgets"),
                    "one or more quota families, token budgets or money budgets",
                );
            }
            for (i, name) in a.budgets.iter().enumerate() {
                let known = quotas.iter().any(|q| &q.name == name)
                    || buckets
                        .iter()
                        .any(|b| &b.name == name && b.tokens.is_some());
                if !known {
                    self.problem(
                        format!("{at}.budgets[{i}]"),
                        format!("{name:?} is not a quota family, token budget or money budget of this policy"),
                    );
                }
            }
            let secret_file = match a.secret_file.as_deref() {
                Some(f) if !f.is_empty() => std::path::PathBuf::from(f),
                _ => {
                    self.problem(
                        format!("{at}.secret_file"),
                        "a file holding the secret events are signed with",
                    );
                    std::path::PathBuf::new()
                }
            };
            let mut millis = |key: &str, value: Option<u64>, default: u64, max: u64| {
                let ms = value.unwrap_or(default);
                if ms == 0 || ms > max {
                    self.problem(format!("{at}.{key}"), format!("1 to {max} milliseconds"));
                }
                Duration::from_millis(ms.clamp(1, max))
            };
            let timeout = millis("timeout_ms", a.timeout_ms, 5_000, 60_000);
            let retry = millis("retry_ms", a.retry_ms, 1_000, 3_600_000);
            let max_retry = millis("max_retry_ms", a.max_retry_ms, 300_000, 86_400_000);
            if max_retry < retry {
                self.problem(format!("{at}.max_retry_ms"), "at least retry_ms");
            }
            alerts.push(Alert {
                url,
                at_permille: thresholds,
                budgets: a.budgets.clone(),
                secret_file,
                timeout,
                retry,
                max_retry,
            });
        }
        alerts
    }

    /// `near_limit_ratio`: above 0 and at most 1, in thousandths (default 0.8).
    fn near_limit(&mut self, raw: &RawPolicy) -> u16 {
        let Some(ratio) = &raw.near_limit_ratio else {
            return 800;
        };
        match ratio.as_f64().filter(|r| *r > 0.0 && *r <= 1.0) {
            Some(r) => ((r * 1000.0).round() as u16).max(1),
            None => {
                self.problem(
                    "near_limit_ratio",
                    "a share of a limit, above 0 and at most 1",
                );
                800
            }
        }
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
}
