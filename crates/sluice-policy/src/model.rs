//! The typed, checked policy that the rest of sluice uses.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt;
use std::num::NonZeroU32;
use std::time::Duration;

use http::Method;
use ipnet::IpNet;

use crate::path::{PathCase, PathError, Paths};
use crate::pattern::PathPattern;

/// The most cost classes a policy may declare (a request's classes are a bit set).
pub const MAX_CLASSES: usize = 32;

/// The most per-IP ceilings a policy may declare.
pub const MAX_CEILINGS: usize = 8;

/// A cost class, by its place in the policy's [`Policy::classes`]: every request
/// is counted against its caller's budget of its class. Its name
/// ([`Policy::class_name`]) is the policy's: `protocol`, `read`, `standard` and
/// `expensive` in the built-in one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Class(u8);

impl Class {
    /// The class at `index` of a policy's classes, if a policy can have one there.
    pub fn from_index(index: usize) -> Option<Class> {
        u8::try_from(index)
            .ok()
            .filter(|&i| usize::from(i) < MAX_CLASSES)
            .map(Class)
    }

    /// Index into [`Policy::classes`] and per-class tables.
    pub const fn index(self) -> usize {
        self.0 as usize
    }
}

/// A set of classes: those a request holds, or those a ceiling is over.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ClassSet(u32);

impl ClassSet {
    /// No class.
    pub const EMPTY: ClassSet = ClassSet(0);

    /// This set and `class`.
    #[must_use]
    pub const fn with(self, class: Class) -> ClassSet {
        ClassSet(self.0 | 1 << class.0)
    }

    /// True when `class` is in the set.
    pub const fn contains(self, class: Class) -> bool {
        self.0 & 1 << class.0 != 0
    }

    /// True when the set is empty.
    pub const fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// True when every class of this set is in `other`.
    pub const fn is_subset(self, other: ClassSet) -> bool {
        self.0 & !other.0 == 0
    }

    /// True when the two sets share a class.
    pub const fn intersects(self, other: ClassSet) -> bool {
        self.0 & other.0 != 0
    }

    /// How many classes the set holds.
    pub const fn len(self) -> usize {
        self.0.count_ones() as usize
    }

    /// The classes, in index order.
    pub fn iter(self) -> impl Iterator<Item = Class> {
        (0..MAX_CLASSES as u8)
            .map(Class)
            .filter(move |c| self.contains(*c))
    }
}

impl FromIterator<Class> for ClassSet {
    fn from_iter<I: IntoIterator<Item = Class>>(iter: I) -> Self {
        iter.into_iter().fold(ClassSet::EMPTY, ClassSet::with)
    }
}

/// A cost class as the policy declares it: its name and how its budgets count.
/// Its limit is the profile's ([`Profile::limit`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CostClass {
    /// Its name in files, headers, metrics, `/status` and logs.
    pub name: String,
    /// Enforced, or decided and counted without refusing (`modes:`).
    pub mode: Enforcement,
    /// How its budgets count (`algorithms:`).
    pub algorithm: Algorithm,
    /// What it does while the shared store cannot be reached (`store.outage`).
    pub outage: Outage,
}

/// A per-IP ceiling: one unit per request from a client IP (IPv6 by prefix),
/// whatever the credential, for the requests it is over.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ceiling {
    /// Its name in files, headers, metrics and `/status` (`ip` and `ip_protocol`
    /// in the built-in policy).
    pub name: String,
    /// The classes it is over.
    pub over: ClassSet,
    /// `false`: it counts a request holding any call of its classes; `true`: a
    /// request holding only calls of its classes (the built-in `ip_protocol`).
    pub only: bool,
    /// Enforced, or decided and counted without refusing (`modes:`).
    pub mode: Enforcement,
    /// How it counts (`algorithms:`).
    pub algorithm: Algorithm,
}

impl Ceiling {
    /// True when a request holding the classes `held` counts against it.
    pub fn applies(&self, held: ClassSet) -> bool {
        if self.only {
            held.is_subset(self.over)
        } else {
            held.intersects(self.over)
        }
    }
}

/// One profile's numbers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Profile {
    /// Per-caller limit per window, indexed by [`Class::index`].
    pub classes: Vec<NonZeroU32>,
    /// Per-IP limit per window, indexed like [`Policy::ceilings`].
    pub ceilings: Vec<NonZeroU32>,
}

impl Profile {
    /// The limit of `class` (the largest there is for a class the policy does not
    /// have, which a checked policy never asks for).
    pub fn limit(&self, class: Class) -> NonZeroU32 {
        self.classes
            .get(class.index())
            .copied()
            .unwrap_or(NonZeroU32::MAX)
    }

    /// The limit of ceiling `i` of [`Policy::ceilings`].
    pub fn ceiling(&self, i: usize) -> NonZeroU32 {
        self.ceilings.get(i).copied().unwrap_or(NonZeroU32::MAX)
    }
}

/// Where a credential is read from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CredentialSource {
    /// `X-API-Key: <key>`.
    ApiKeyHeader,
    /// `Authorization: Bearer <token>`.
    Bearer,
    /// The console session cookie.
    SessionCookie,
}

/// Who a known credential belongs to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Principal {
    /// The workspace.
    pub workspace: String,
    /// The user.
    pub user: String,
}

/// Identity settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    /// Credential sources, in order.
    pub credentials: Vec<CredentialSource>,
    /// The source counted when a request sends several kinds of credential (the
    /// others are stripped before forwarding); `None`: such a request is refused.
    pub counted: Option<CredentialSource>,
    /// The session cookie's name.
    pub session_cookie: String,
    /// Proxies whose `X-Forwarded-For` is believed.
    pub trusted_proxies: Vec<IpNet>,
    /// IPv6 callers are grouped by this prefix for IP budgets.
    pub ipv6_prefix: u8,
    /// SHA-256 of a credential → its principal.
    pub keys: HashMap<[u8; 32], Principal>,
    /// SHA-256 of the credentials revoked at run time: refused (403), never counted
    /// as a caller of their own.
    pub revoked: std::collections::HashSet<[u8; 32]>,
    /// Headers a trusted auth layer sets: (workspace, user).
    pub principal_headers: Option<(http::HeaderName, http::HeaderName)>,
    /// The header a trusted auth layer names the workspace's plan in (with
    /// `principal_headers`): over the tenant table's plan for the request.
    pub plan_header: Option<http::HeaderName>,
}

/// Whose an extra bucket is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Per {
    /// The client IP (IPv6 by prefix).
    Ip,
    /// The credential (or the IP when there is none).
    Caller,
    /// The principal's user.
    User,
    /// The principal's workspace.
    Workspace,
}

/// How a refusal by a budget looks to the client.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The edge limiter's plain-text 429.
    Edge,
    /// The JSON envelope with `retry_at` and `retry_after_seconds`;
    /// `{retry_after}` in the message is replaced by the seconds.
    Envelope {
        /// The message template.
        message: String,
    },
}

/// An extra named bucket, or a weighted budget.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bucket {
    /// Its name (used in keys and headers).
    pub name: String,
    /// Units per window.
    pub limit: NonZeroU32,
    /// Window length in seconds.
    pub window: NonZeroU32,
    /// Whose bucket.
    pub per: Per,
    /// How a refusal looks.
    pub refusal: Refusal,
    /// Weighted: admission needs one unit, and the upstream's cost header
    /// (`X-Sluice-Cost`) then says what the call really spent. The
    /// responses of a request holding it describe this budget in `X-RateLimit-*`.
    pub weighted: bool,
    /// What an exhausted budget does to a request.
    pub on_exhausted: OnExhausted,
    /// Enforced, or decided and counted without refusing (a dry run).
    pub mode: Enforcement,
    /// How it counts its limit per window.
    pub algorithm: Algorithm,
}

/// Whether a budget refuses what it does not admit (`mode:` in a policy file).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Enforcement {
    /// Refuses: the default.
    #[default]
    Enforce,
    /// Shadow mode, a dry run: the budget is decided and counted as usual, and a
    /// refusal it would give is counted (`sluice_shadow_refusals_total`) and logged,
    /// and the request is forwarded as if the budget were off.
    Shadow,
}

/// How a budget counts its limit per window (`algorithm:` in a policy file).
///
/// Quotas are calendar months and take none; every other budget (a class, a per-IP
/// ceiling, a bucket) takes one, `fixed` by default.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Algorithm {
    /// `fixed`, the default and the seed's: `limit` per window, windows aligned to
    /// the Unix epoch (every replica agrees where one starts); a whole window's
    /// worth may go at its end and again at the start of the next.
    #[default]
    Fixed,
    /// `sliding`: at most `limit` in any `window_seconds`, counted exactly
    /// ([`sluice_core::Rate::RollingWindow`]) in [`SLIDING_SLOTS`] epoch-aligned
    /// slots per window. A unit counts from when it is spent until a window after
    /// the end of its slot: never shorter than the window, at most one slot (a
    /// sixtieth of it) longer. A refusal's wait is exact: until enough of the oldest
    /// slots have left.
    Sliding,
    /// `gcra`: `limit` per window evenly spaced (one unit every
    /// `window / limit`), at most `burst` back to back
    /// ([`sluice_core::Rate::Gcra`]).
    Gcra {
        /// How many units may go at once; `None` is the budget's limit (as governor's
        /// quotas do), so that a class's burst follows the active profile.
        burst: Option<NonZeroU32>,
    },
}

/// Slots per window of a [`Algorithm::Sliding`] budget: a unit is held at most a
/// sixtieth of the window longer than the window (a second on a minute), and a
/// decision reads at most 62 cells of it.
pub const SLIDING_SLOTS: u32 = 60;

/// The longest `window_seconds` of a [`Algorithm::Sliding`] budget: its window is
/// counted in milliseconds, in 32 bits.
pub const MAX_SLIDING_WINDOW_SECONDS: u32 = u32::MAX / 1000;

impl Algorithm {
    /// Its name in policy files: `fixed`, `sliding` or `gcra`.
    pub const fn name(self) -> &'static str {
        match self {
            Algorithm::Fixed => "fixed",
            Algorithm::Sliding => "sliding",
            Algorithm::Gcra { .. } => "gcra",
        }
    }

    /// The rate a store decides a budget of `limit` per `window` seconds counted
    /// this way by.
    pub fn rate(self, window: NonZeroU32, limit: NonZeroU32) -> sluice_core::Rate {
        use sluice_core::Rate;
        match self {
            Algorithm::Fixed => Rate::FixedWindow { seconds: window },
            Algorithm::Sliding => {
                // The validator keeps a sliding window within
                // MAX_SLIDING_WINDOW_SECONDS; saturating keeps any other at 49 days.
                let millis = window.saturating_mul(NonZeroU32::MIN.saturating_add(999));
                let slot = NonZeroU32::new(millis.get().div_ceil(SLIDING_SLOTS))
                    .unwrap_or(NonZeroU32::MIN);
                Rate::RollingWindow {
                    millis,
                    slot_millis: slot,
                }
            }
            Algorithm::Gcra { burst } => Rate::Gcra {
                period: Duration::from_secs(u64::from(window.get())),
                burst: burst.unwrap_or(limit),
            },
        }
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Algorithm::Gcra { burst: Some(b) } => write!(f, "gcra, burst {b}"),
            Algorithm::Gcra { burst: None } => f.write_str("gcra, burst = limit"),
            other => f.write_str(other.name()),
        }
    }
}

/// What an exhausted bucket does to a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnExhausted {
    /// Refuse it (429).
    Refuse,
    /// Forward it with `X-Sluice-Exhausted: <budget>; retry-after=<seconds>` and let
    /// the upstream answer (a "fuzzy lane").
    Pass,
}

/// A monthly verb quota per workspace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuotaFamily {
    /// Its name (`search`, `evals`, `messages`, …).
    pub name: String,
    /// Calls per calendar month (UTC); `None` = uncapped (counted, never refused).
    pub monthly: Option<NonZeroU32>,
    /// Enforced, or decided and counted without refusing (a dry run).
    pub mode: Enforcement,
}

impl QuotaFamily {
    /// The limit a budget of this family counts against (`u32::MAX` when uncapped).
    pub fn limit(&self) -> u32 {
        self.monthly.map_or(u32::MAX, NonZeroU32::get)
    }
}

/// The most quota families a policy may declare.
pub const MAX_QUOTA_FAMILIES: usize = 8;

/// The most buckets a policy may declare (a JSON-RPC body names the ones its
/// tools spend in a bit set).
pub const MAX_BUCKETS: usize = 32;

/// What a call spends besides its class budget: route buckets and a quota family.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Spends {
    /// Indices into [`Policy::buckets`].
    pub buckets: Vec<usize>,
    /// Index into [`Policy::quotas`].
    pub quota: Option<usize>,
    /// Index into [`Policy::lanes`]: the lane that guards the call.
    pub lane: Option<usize>,
}

/// Most lanes a policy declares.
pub const MAX_LANES: usize = 4;

/// A guarded lane in front of an expensive upstream: the routes and tools that
/// name it run at most so many calls at once per workspace and in all, start at
/// most so many per workspace in a rolling window, wait in line for a bounded
/// time, and stop while the upstream keeps failing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lane {
    /// Its name (`optimizer` in the built-in policy).
    pub name: String,
    /// Calls of one workspace running at once.
    pub workspace_in_flight: NonZeroU32,
    /// Calls of one workspace started in any `starts_window`.
    pub workspace_starts: NonZeroU32,
    /// The rolling window of `workspace_starts`.
    pub starts_window: Duration,
    /// Calls running at once over every workspace.
    pub global_in_flight: NonZeroU32,
    /// Places of `global_in_flight` never given to batch items (less than it).
    pub batch_reserve: u32,
    /// Longest wait in line of a REST call.
    pub wait: Duration,
    /// Longest wait in line of a JSON-RPC tool call.
    pub jsonrpc_wait: Duration,
    /// Calls waiting in line at once; past it a call is refused at once.
    pub max_waiting: NonZeroU32,
    /// Longest upstream call; past it the call is cut and counts as a failure.
    pub timeout: Duration,
    /// Failures in a row that open the breaker.
    pub breaker_failures: NonZeroU32,
    /// Those failures fall within this span.
    pub breaker_within: Duration,
    /// How long the breaker stays open before one probe decides.
    pub breaker_open: Duration,
    /// With a shared store: how long a replica's lease on a place lives without
    /// renewal (a crashed replica's places come back within it).
    pub lease_ttl: Duration,
    /// The lane's batch lane, if it runs one.
    pub batch: Option<LaneBatch>,
    /// The names clients see (`details.reason`, metrics, logs) for the lane
    /// engine's `busy` and `unavailable` refusals (`reasons:`; by default the
    /// lane's name and the reason: `optimizer_busy` for a lane `optimizer`).
    pub reasons: LaneReasons,
}

/// The names clients see for a lane's own refusals.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaneReasons {
    /// Every place of the lane's global cap is taken (`<lane>_busy`).
    pub busy: String,
    /// The lane's breaker is open (`<lane>_unavailable`).
    pub unavailable: String,
}

impl Lane {
    /// The name clients see for the lane engine's refusal reason `engine` (`busy`
    /// and `unavailable` are the policy's; the workspace reasons keep theirs).
    pub fn reason_name<'a>(&'a self, engine: &'a str) -> &'a str {
        match engine {
            "busy" => &self.reasons.busy,
            "unavailable" => &self.reasons.unavailable,
            other => other,
        }
    }
}

/// A lane's batch lane: lists of single calls, queued durably and run on the
/// capacity single calls leave.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaneBatch {
    /// The single-call route (`/messages/optimize`): submit `POST <route>/batch`,
    /// status `GET <route>/batches/{id}`, each item `POST <route>` upstream.
    pub route: String,
    /// Most items in one batch.
    pub max_items: NonZeroU32,
    /// Most unfinished items one workspace may have queued.
    pub backlog: NonZeroU32,
    /// How long a finished batch is kept for status reads.
    pub keep: Duration,
    /// The JSON-RPC tool that submits a batch.
    pub submit_tool: Option<String>,
    /// The JSON-RPC tool that reads a batch.
    pub status_tool: Option<String>,
    /// The quota family the single-call route counts against: each item of a batch
    /// counts one unit of it at submit (index into [`Policy::quotas`]).
    pub quota: Option<usize>,
}

impl LaneBatch {
    /// The submit path, `<route>/batch`.
    pub fn submit_path(&self) -> String {
        format!("{}/batch", self.route)
    }

    /// The batch id a status path (`<route>/batches/{id}`) names, if `path` is one.
    pub fn status_id<'p>(&self, path: &'p str) -> Option<&'p str> {
        let id = path
            .strip_prefix(self.route.as_str())?
            .strip_prefix("/batches/")?;
        (!id.is_empty() && !id.contains('/')).then_some(id)
    }
}

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
    /// says (the policy's `paths.case`).
    pub fn matches_in(&self, method: &Method, path: &str, case: PathCase) -> bool {
        self.method.as_ref().is_none_or(|m| m == method)
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

/// The most plans a policy may declare.
pub const MAX_PLANS: usize = 64;

/// The most workspaces the tenant table holds (the policy file's and those the
/// admin API adds): each is a few hundred bytes in every replica's memory.
pub const MAX_WORKSPACES: usize = 100_000;

/// A customer plan (`plans:`): limits that replace the active profile's for the
/// workspaces on it. `None` in a table: the profile's (or the policy's) limit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CustomerPlan {
    /// Its name (`default` is the plan of a workspace on no other).
    pub name: String,
    /// Per-caller limit per window, indexed by [`Class::index`].
    pub classes: Vec<Option<NonZeroU32>>,
    /// Per-IP limit per window, indexed like [`Policy::ceilings`].
    pub ceilings: Vec<Option<NonZeroU32>>,
    /// Limit per window, indexed like [`Policy::buckets`].
    pub buckets: Vec<Option<NonZeroU32>>,
    /// Calls per calendar month, indexed like [`Policy::quotas`].
    pub quotas: Vec<Option<NonZeroU32>>,
    /// Per-workspace limits in each lane, indexed like [`Policy::lanes`].
    pub lanes: Vec<PlanLane>,
    /// Enforced, or its limits decided and counted without refusing (a dry run).
    pub mode: Enforcement,
}

/// A plan's per-workspace limits in one lane; a limit it does not set is the
/// lane's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PlanLane {
    /// Calls of one workspace running at once.
    pub workspace_in_flight: Option<NonZeroU32>,
    /// Calls of one workspace started in the lane's `starts_window`.
    pub workspace_starts: Option<NonZeroU32>,
}

impl PlanLane {
    /// `self`'s limits, with `under`'s where `self` sets none.
    pub fn or(self, under: PlanLane) -> PlanLane {
        PlanLane {
            workspace_in_flight: self.workspace_in_flight.or(under.workspace_in_flight),
            workspace_starts: self.workspace_starts.or(under.workspace_starts),
        }
    }
}

/// The tenant table: the plan of each workspace, by the digest of its name (as
/// [`Caller::workspace`](crate::Caller) holds it), and the names.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Tenants {
    /// Workspace digest → its plan.
    pub plans: HashMap<u64, TenantPlan>,
    /// Workspace name → its plan, as written (what `GET` lists).
    pub by_name: std::collections::BTreeMap<String, TenantPlan>,
    /// The plans of workspaces with limits of their own (set at run time): their
    /// plan's limits with theirs over them.
    pub own: Vec<CustomerPlan>,
}

/// One limit of what a workspace on a plan gets ([`Policy::plan_limits`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanLimit {
    /// The budget's name (a class, a ceiling, a bucket or a quota family).
    pub name: String,
    /// Its limit: per window, or per calendar month for a quota.
    pub limit: u32,
    /// True when the plan sets it (else it is the profile's, bucket's or family's).
    pub from_plan: bool,
}

/// What a workspace on a plan gets, budget by budget, in the policy's orders.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PlanLimits {
    /// Per caller and window, by class.
    pub classes: Vec<PlanLimit>,
    /// Per IP and window, by ceiling.
    pub ceilings: Vec<PlanLimit>,
    /// Per window, by bucket (with the bucket's window).
    pub buckets: Vec<(PlanLimit, NonZeroU32)>,
    /// Per calendar month, by capped quota family (uncapped ones left out).
    pub quotas: Vec<PlanLimit>,
    /// Per workspace, by lane: (calls running at once, calls started per the
    /// lane's window). Each limit is named `<lane>.workspace_in_flight` and
    /// `<lane>.workspace_starts`.
    pub lanes: Vec<(PlanLimit, PlanLimit)>,
}

/// Which plan a workspace of the tenant table is on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TenantPlan {
    /// A plan of [`Policy::plans`], by index.
    Named(usize),
    /// Its own limits: an index into [`Tenants::own`].
    Own(usize),
}

/// The checked policy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Policy {
    /// The active profile's name.
    pub profile_name: String,
    /// Every profile, by name.
    pub profiles: Vec<(String, Profile)>,
    /// The active profile's numbers.
    pub profile: Profile,
    /// The cost classes, cheapest first (a request holding several is counted in
    /// the metrics of the last): [`Class`] is an index into it.
    pub classes: Vec<CostClass>,
    /// The per-IP ceilings, by name.
    pub ceilings: Vec<Ceiling>,
    /// Window of the class budgets and IP ceilings.
    pub window: NonZeroU32,
    /// Identity settings.
    pub identity: Identity,
    /// Extra buckets.
    pub buckets: Vec<Bucket>,
    /// Monthly quota families.
    pub quotas: Vec<QuotaFamily>,
    /// Guarded lanes.
    pub lanes: Vec<Lane>,
    /// Descriptor rules for Envoy's rate-limit service, by domain (`domains:`,
    /// and the files of a directory `sluice serve --rls-config` names).
    pub domains: Vec<crate::domains::Domain>,
    /// The route table, first match wins.
    pub routes: Vec<Route>,
    /// The class of a request no route matches.
    pub default_class: Class,
    /// JSON-RPC rules.
    pub jsonrpc: JsonRpc,
    /// Send the IETF draft fields too.
    pub ietf_headers: bool,
    /// Bounds.
    pub bounds: Bounds,
    /// How request paths are normalised before they are matched and forwarded.
    pub paths: Paths,
    /// The shared store's settings.
    pub store: StorePolicy,
    /// A dry run: every budget, bucket, quota and route in shadow mode
    /// (`dry_run: true`, or `sluice serve --dry-run`).
    pub dry_run: bool,
    /// The customer plans, by name.
    pub plans: Vec<CustomerPlan>,
    /// The index of the plan named `default`, the plan of a workspace on no other.
    pub default_plan: Option<usize>,
    /// Which workspace is on which plan.
    pub tenants: Tenants,
}

impl Policy {
    /// The same policy with another profile's numbers active.
    ///
    /// # Errors
    /// The names of the profiles there are, when `name` is not one of them.
    pub fn with_profile(mut self, name: &str) -> Result<Policy, String> {
        match self.profiles.iter().find(|(n, _)| n == name) {
            Some((_, p)) => {
                self.profile = p.clone();
                self.profile_name = name.to_owned();
                Ok(self)
            }
            None => Err(format!(
                "no profile {name:?}; the policy has {}",
                self.profiles
                    .iter()
                    .map(|(n, _)| n.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )),
        }
    }

    /// The class named `name`, if the policy has one.
    pub fn class(&self, name: &str) -> Option<Class> {
        self.classes
            .iter()
            .position(|c| c.name == name)
            .and_then(Class::from_index)
    }

    /// The name of `class` (empty for a class the policy does not have, which a
    /// checked policy never holds).
    pub fn class_name(&self, class: Class) -> &str {
        self.classes
            .get(class.index())
            .map_or("", |c| c.name.as_str())
    }

    /// Every class, cheapest first.
    pub fn class_ids(&self) -> impl Iterator<Item = Class> + '_ {
        (0..self.classes.len()).filter_map(Class::from_index)
    }

    /// The plan of the workspace whose digest is `workspace`: its own, else
    /// `default` (if the policy has one).
    pub fn plan_of(&self, workspace: u64) -> Option<&CustomerPlan> {
        match self.tenants.plans.get(&workspace) {
            Some(TenantPlan::Named(i)) => self.plans.get(*i),
            Some(TenantPlan::Own(i)) => self.tenants.own.get(*i),
            None => self.default_plan.and_then(|i| self.plans.get(i)),
        }
    }

    /// The plan of a request from `caller`: the one a trusted auth layer named for
    /// it, else its workspace's ([`Policy::plan_of`]). A name that is no plan of the
    /// policy is `Err(())`: such a request is refused, never decided as on no plan.
    #[allow(clippy::result_unit_err)]
    pub fn plan_for(&self, caller: &crate::Caller) -> Result<Option<&CustomerPlan>, ()> {
        match &caller.plan {
            Some(name) => self
                .plan(name)
                .and_then(|i| self.plans.get(i))
                .map(Some)
                .ok_or(()),
            None => Ok(self.plan_of(caller.workspace)),
        }
    }

    /// What a workspace on `plan` gets under the active profile (`None`: on no
    /// plan, the profile's limits).
    pub fn plan_limits(&self, plan: Option<&CustomerPlan>) -> PlanLimits {
        fn limit(
            name: &str,
            own: Option<&Vec<Option<NonZeroU32>>>,
            i: usize,
            otherwise: NonZeroU32,
        ) -> PlanLimit {
            let set = own.and_then(|t| t.get(i).copied().flatten());
            PlanLimit {
                name: name.to_owned(),
                limit: set.unwrap_or(otherwise).get(),
                from_plan: set.is_some(),
            }
        }
        PlanLimits {
            classes: self
                .class_ids()
                .map(|c| {
                    let name = self.class_name(c);
                    limit(
                        name,
                        plan.map(|p| &p.classes),
                        c.index(),
                        self.profile.limit(c),
                    )
                })
                .collect(),
            ceilings: self
                .ceilings
                .iter()
                .enumerate()
                .map(|(i, c)| {
                    limit(
                        &c.name,
                        plan.map(|p| &p.ceilings),
                        i,
                        self.profile.ceiling(i),
                    )
                })
                .collect(),
            buckets: self
                .buckets
                .iter()
                .enumerate()
                .map(|(i, b)| {
                    (
                        limit(&b.name, plan.map(|p| &p.buckets), i, b.limit),
                        b.window,
                    )
                })
                .collect(),
            quotas: self
                .quotas
                .iter()
                .enumerate()
                .filter_map(|(i, q)| {
                    let own = plan.and_then(|p| p.quotas.get(i).copied().flatten());
                    let cap = own.or(q.monthly)?;
                    Some(limit(&q.name, plan.map(|p| &p.quotas), i, cap))
                })
                .collect(),
            lanes: self
                .lanes
                .iter()
                .enumerate()
                .map(|(i, lane)| {
                    let own = plan
                        .and_then(|p| p.lanes.get(i))
                        .copied()
                        .unwrap_or_default();
                    let limit =
                        |field: &str, own: Option<NonZeroU32>, otherwise: NonZeroU32| PlanLimit {
                            name: format!("{}.{field}", lane.name),
                            limit: own.unwrap_or(otherwise).get(),
                            from_plan: own.is_some(),
                        };
                    (
                        limit(
                            "workspace_in_flight",
                            own.workspace_in_flight,
                            lane.workspace_in_flight,
                        ),
                        limit(
                            "workspace_starts",
                            own.workspace_starts,
                            lane.workspace_starts,
                        ),
                    )
                })
                .collect(),
        }
    }

    /// The per-workspace limits of lane `lane` (an index into
    /// [`Policy::lanes`]) for a workspace on `plan`: (calls running at once,
    /// calls started per the lane's window); the lane's where the plan sets
    /// none. `None` for a lane the policy does not have.
    pub fn lane_limits(
        &self,
        plan: Option<&CustomerPlan>,
        lane: usize,
    ) -> Option<(NonZeroU32, NonZeroU32)> {
        let rule = self.lanes.get(lane)?;
        let own = plan
            .and_then(|p| p.lanes.get(lane))
            .copied()
            .unwrap_or_default();
        Some((
            own.workspace_in_flight.unwrap_or(rule.workspace_in_flight),
            own.workspace_starts.unwrap_or(rule.workspace_starts),
        ))
    }

    /// The plan named `name`.
    pub fn plan(&self, name: &str) -> Option<usize> {
        self.plans.iter().position(|p| p.name == name)
    }

    /// What `class` does while the shared store cannot be reached.
    pub fn outage(&self, class: Class) -> Outage {
        self.classes
            .get(class.index())
            .map_or(Outage::FailClosed, |c| c.outage)
    }

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
