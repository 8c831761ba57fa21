//! The limiter: one policy, one store, and everything between a request's
//! head and its decision.

use std::borrow::Cow;
use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

use http::header::CONTENT_ENCODING;
use http::request::Parts;
use http::uri::PathAndQuery;
use http::{HeaderMap, HeaderName, Method, Uri, Version};
use parking_lot::Mutex;
use sluice_core::Decision;
use sluice_policy::{
    AmbiguousCredentials, Class, Items, Outage, PathError, Policy, Route, RouteClass,
    Unclassifiable, Who,
};
use sluice_store::{BudgetStore, MemoryConfig, MemoryStore, StoreError};

use crate::plan::{BudgetKind, Passed, Plan, Scopes, plan};

/// A request the limiter refuses before anything is decided: sluice cannot count it
/// as the upstream would read it, so it neither counts nor forwards it (nothing is
/// spent, as for a malformed request). [`Refused::response`] is the answer, the same
/// on every request path.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Refused {
    /// The path has no normal form: it cannot be matched as the upstream reads it.
    #[error(transparent)]
    Path(#[from] PathError),
    /// The normal form of the request target is not a target `http` accepts.
    #[error("the normalised request target is not a valid request target")]
    Target,
    /// The body of a JSON-RPC route cannot be classified.
    #[error(transparent)]
    Body(#[from] Unclassifiable),
    /// One kind of credential sent more than once.
    #[error(transparent)]
    Credentials(#[from] AmbiguousCredentials),
    /// An HTTP/1.1 request without a `Host` field (RFC 9112 §3.2).
    #[error("an HTTP/1.1 request must have a Host field")]
    NoHost,
    /// A request with several `Host` fields (RFC 9112 §3.2).
    #[error("{0} Host fields")]
    Hosts(usize),
    /// A `Host` field that is not `host[:port]` (RFC 9112 §3.2).
    #[error("the Host field is not host[:port]")]
    BadHost,
    /// A batch submit whose body cannot be queued.
    #[error(transparent)]
    Batch(#[from] crate::BadBatch),
    /// `CONNECT`: sluice is not a tunnel (a reverse proxy has nothing to connect to).
    #[error("CONNECT is not served: this is a gateway, not a tunnel")]
    Connect,
    /// A request (a JSON-RPC batch) holding more calls through a guarded lane than
    /// a workspace may run at once: it can never be admitted whole (send the calls
    /// apart, or through the batch lane).
    #[error(
        "the request holds {calls} calls through a guarded lane; a workspace runs at most {max} at once"
    )]
    LaneCalls {
        /// The calls through the lane the request holds.
        calls: u32,
        /// Calls a workspace may run at once.
        max: u32,
    },
}

/// Checks a request head before anything else is read of it: the method is not
/// `CONNECT`, and the `Host` fields (`hosts`: their values, in order) are as RFC
/// 9112 §3.2 asks — one, or none before HTTP/1.1 and in HTTP/2 (which has
/// `:authority`), and a value that is empty or `host[:port]`. Both HTTP/1.1
/// request paths call it, so both answer alike.
///
/// # Errors
/// [`Refused::Connect`], [`Refused::NoHost`], [`Refused::Hosts`] or
/// [`Refused::BadHost`].
pub fn check_head<'h>(
    method: &Method,
    version: Version,
    hosts: impl IntoIterator<Item = &'h [u8]>,
) -> Result<(), Refused> {
    if method == Method::CONNECT {
        return Err(Refused::Connect);
    }
    let mut hosts = hosts.into_iter();
    let Some(host) = hosts.next() else {
        return if version == Version::HTTP_11 {
            Err(Refused::NoHost)
        } else {
            Ok(())
        };
    };
    let more = hosts.count();
    if more > 0 {
        return Err(Refused::Hosts(more + 1));
    }
    let host = host.trim_ascii();
    if !host.is_empty() && !host_is_valid(host) {
        return Err(Refused::BadHost);
    }
    Ok(())
}

/// True when `host` (not empty) is `uri-host [":" port]`: an authority without
/// userinfo, as `http` reads one. `http` copies the bytes before it checks them;
/// a keep-alive connection sends the same `Host` with every request, so the last
/// host this thread found valid is kept and a repeat is known at once.
fn host_is_valid(host: &[u8]) -> bool {
    /// The longest host kept (longer ones are checked each time).
    const KEPT: usize = 64;
    thread_local! {
        static LAST_VALID: std::cell::RefCell<arrayvec::ArrayVec<u8, KEPT>> =
            const { std::cell::RefCell::new(arrayvec::ArrayVec::new_const()) };
    }
    if LAST_VALID.with_borrow(|last| !last.is_empty() && last.as_slice() == host) {
        return true;
    }
    let valid = !host.contains(&b'@') && http::uri::Authority::try_from(host).is_ok();
    if valid && host.len() <= KEPT {
        LAST_VALID.with_borrow_mut(|last| {
            last.clear();
            let _ = last.try_extend_from_slice(host);
        });
    }
    valid
}

/// The most callers the status page tracks per window; past it new callers
/// are counted together as `others`.
pub const TOP_CALLERS_TRACKED: usize = 4_096;

/// A policy and a store: classifies requests and decides their budgets.
///
/// When the store cannot answer (a shared store that is down), each request
/// follows its classes' outage rule: if every class it holds fails
/// open, it is decided on this process's fallback store with the limits
/// divided by the policy's replica count; otherwise the error stands and the
/// layer answers 503.
///
/// A limiter can be [reloaded](Limiter::reloaded) with a new policy: the new one
/// shares this one's store, fallback, buffer bound, top callers and lanes, so
/// budgets in flight keep their counts (a budget's cell is keyed by its scope and
/// subject, never by its limit).
pub struct Limiter<S> {
    policy: Policy,
    scopes: Scopes,
    store: Arc<S>,
    fallback: Arc<MemoryStore>,
    buffers: Arc<crate::BufferBudget>,
    degraded: Arc<AtomicBool>,
    /// Spend per caller this window, in shards by caller (no process-wide lock on
    /// the hot path).
    top: Arc<[crossbeam_utils::CachePadded<Mutex<TopCallers>>; TOP_SHARDS]>,
    metrics: Meters,
    /// Counts since start, for the dashboard (see [`Limiter::tally`]).
    counts: Arc<Counts>,
    /// The policy's guarded lanes, in its order.
    lanes: Vec<sluice_lanes::Lane>,
    /// The request fields [`Limiter::plan_for`] reads (see [`Limiter::read_headers`]).
    read_headers: Vec<HeaderName>,
    /// The bound on refusal log lines a second.
    refusal_log: Arc<crate::RefusalLog>,
    /// The same bound, apart, for the lines saying the store could not decide: a
    /// flood of ordinary refusals does not hide an outage.
    outage_log: Arc<crate::RefusalLog>,
}

/// Why a new policy cannot replace a running one without a restart (see
/// [`Limiter::reloaded`]).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ReloadRefused {
    /// The guarded lanes differ: a lane counts the calls running through it, which a
    /// new engine would not know of, and its batch lane's queue was opened with its
    /// settings.
    #[error(
        "lanes: the guarded lanes changed ({0}); a lane's running calls and batch queue live in its engine: restart sluice to apply"
    )]
    Lanes(String),
}

/// What the dashboard is told of the limiter's decisions since the process started
/// (see [`Limiter::tally`]). The same events as the `sluice_decisions_total`,
/// `sluice_refusals_total`, `sluice_lane_refusals_total` and
/// `sluice_local_decisions_total` metrics, readable without parsing their text.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Tally {
    /// One per class, in [`Class::ALL`]'s order.
    pub classes: Vec<ClassTally>,
    /// Refusals by the budget that refused them (`sluice_refusals_total`'s
    /// `reason`: a class, `ip`, `ip_protocol`, a bucket or a quota family), most
    /// first; reasons with none left out.
    pub refusals: Vec<(String, u64)>,
    /// Calls the guarded lanes refused: (lane, reason, count), by lane then reason.
    pub lane_refusals: Vec<(String, &'static str, u64)>,
    /// Decisions made on this process's fallback store while the shared store
    /// was down (fail-open classes).
    pub local_decisions: u64,
}

/// One class's part of a [`Tally`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ClassTally {
    /// The class.
    pub class: Class,
    /// A caller's budget of it per window.
    pub limit: u32,
    /// Requests admitted whose top class it is.
    pub admitted: u64,
    /// Requests refused whose top class it is.
    pub refused: u64,
    /// Requests whose top class it is that the store could not decide.
    pub errors: u64,
    /// Units of this class's budgets spent by admitted requests (a JSON-RPC batch
    /// spends one per item of the class).
    pub units: u64,
    /// The fullest budget of this class any caller was seen to have in the
    /// current window, in thousandths of its limit (0 when no decision touched
    /// the class in this window).
    pub fill_permille: u16,
}

/// The counters behind [`Limiter::tally`]: relaxed atomics, one cache line per
/// class, so the request path takes no lock for them.
struct Counts {
    classes: [crossbeam_utils::CachePadded<ClassCounts>; 4],
    /// Refusals by every reason the policy can give (fixed at start, kept across
    /// reloads).
    refusals: HashMap<String, AtomicU64>,
    /// Refusals by a reason not known at start (none expected).
    other_refusals: AtomicU64,
    local: AtomicU64,
    /// Lane refusals by (lane index, reason): rare, a lock is fine.
    lane_refusals: Mutex<HashMap<(usize, &'static str), u64>>,
}

#[derive(Default)]
struct ClassCounts {
    admitted: AtomicU64,
    refused: AtomicU64,
    errors: AtomicU64,
    units: AtomicU64,
    /// `reset << 16 | permille` of the fullest budget seen: a later window (a later
    /// reset) always wins, and within one window the fullest does.
    fill: AtomicU64,
}

impl Counts {
    fn new(policy: &Policy) -> Self {
        Counts {
            classes: std::array::from_fn(|_| Default::default()),
            refusals: refusal_reasons(policy)
                .map(|r| (r, AtomicU64::new(0)))
                .collect(),
            other_refusals: AtomicU64::new(0),
            local: AtomicU64::new(0),
            lane_refusals: Mutex::new(HashMap::new()),
        }
    }

    /// Notes the fill of every class budget a decision reports.
    fn fill(&self, plan: &Plan, decision: &Decision) {
        for (k, s) in plan.kinds.iter().zip(decision.statuses()) {
            let BudgetKind::Class(c) = k else { continue };
            let counts = &self.classes[c.index()];
            let used = u64::from(s.limit.saturating_sub(s.remaining));
            let permille = (used * 1000 / u64::from(s.limit.max(1))).min(1000);
            let packed = (s.reset << 16) | permille;
            // Most decisions change nothing: read before writing.
            if counts.fill.load(Ordering::Relaxed) < packed {
                counts.fill.fetch_max(packed, Ordering::Relaxed);
            }
        }
    }
}

/// Every reason a refusal by a budget of `policy` can name (`sluice_refusals_total`).
fn refusal_reasons(policy: &Policy) -> impl Iterator<Item = String> + '_ {
    Class::ALL
        .iter()
        .map(|c| c.name().to_owned())
        .chain(["ip".to_owned(), "ip_protocol".to_owned()])
        .chain(policy.buckets.iter().map(|b| b.name.clone()))
        .chain(policy.quotas.iter().map(|q| q.name.clone()))
}

/// A limiter that can be replaced while requests run (a policy reload): each request
/// takes the one current when it arrives ([`ArcSwap::load_full`](arc_swap::ArcSwap::load_full), no lock) and keeps
/// it to its end.
pub type SharedLimiter<S> = Arc<arc_swap::ArcSwap<Limiter<S>>>;

/// An admitted request (see [`Limiter::admit`]).
#[derive(Debug)]
pub struct Admitted {
    /// Its decision (boxed, as the plan).
    pub decision: Box<Decision>,
    /// Its plan (boxed: a plan is about a kilobyte, and an admitted request goes
    /// by value through every layer of the request path).
    pub plan: Box<Plan>,
    /// Its place in a guarded lane, held until its upstream call ends.
    pub lane: Option<crate::LanePlace>,
}

/// Shards of the top-callers table.
const TOP_SHARDS: usize = 16;

/// Metric handles, registered once (a lookup per request costs more than
/// the decision).
struct Meters {
    /// `sluice_decisions_total{class, outcome}` by class index and outcome
    /// (admitted, refused, error).
    decisions: [[metrics::Counter; 3]; 4],
    decision_seconds: metrics::Histogram,
    local: metrics::Counter,
    /// `sluice_quota_units_total{family}` by family index.
    quota_units: Vec<metrics::Counter>,
    /// `sluice_refusals_total{reason}` by every reason the policy can give.
    refusals: HashMap<String, metrics::Counter>,
}

impl Meters {
    fn register(policy: &Policy) -> Self {
        let outcomes = ["admitted", "refused", "error"];
        Meters {
            decisions: Class::ALL.map(|c| {
                outcomes.map(|o| {
                    metrics::counter!("sluice_decisions_total", "class" => c.name(), "outcome" => o)
                })
            }),
            decision_seconds: metrics::histogram!("sluice_decision_seconds"),
            local: metrics::counter!("sluice_local_decisions_total"),
            quota_units: policy
                .quotas
                .iter()
                .map(|q| metrics::counter!("sluice_quota_units_total", "family" => q.name.clone()))
                .collect(),
            refusals: refusal_reasons(policy)
                .map(|reason| {
                    let counter =
                        metrics::counter!("sluice_refusals_total", "reason" => reason.clone());
                    (reason, counter)
                })
                .collect(),
        }
    }
}

/// Histogram buckets (seconds) of `sluice_decision_seconds`: a memory decision takes
/// about a microsecond, a Redis one a loopback round trip or more.
pub const DECISION_SECONDS_BUCKETS: &[f64] = &[
    0.000_001,
    0.000_002_5,
    0.000_005,
    0.000_01,
    0.000_025,
    0.000_05,
    0.000_1,
    0.000_25,
    0.000_5,
    0.001,
    0.002_5,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
];

/// One workspace's standing on one monthly quota family.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuotaUsage {
    /// The family.
    pub family: String,
    /// Calls a month, `None` when uncapped.
    pub limit: Option<u32>,
    /// Calls counted this month.
    pub usage: u32,
    /// When the month turns (Unix seconds).
    pub resets_at: u64,
}

/// Why a quota could not be read or reset.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum QuotaQueryError {
    /// A `key:` or `ip:` label that does not parse.
    #[error("not a workspace: expected a workspace name, key:<64 hex digits> or ip:<address>")]
    Workspace,
    /// A family the policy does not declare.
    #[error("no quota family named {0:?}")]
    Family(String),
    /// The store could not answer.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Cells kept by the fallback store used while a shared store is down.
pub const FALLBACK_MAX_KEYS: usize = 100_000;

#[derive(Default)]
struct TopCallers {
    window: u64,
    /// Caller subject → (who, its workspace label, units spent this window).
    spend: HashMap<u64, (Who, String, u64)>,
    others: u64,
}

impl<S: BudgetStore> Limiter<S> {
    /// A limiter enforcing `policy` on `store`.
    pub fn new(policy: Policy, store: S) -> Self {
        let metrics = Meters::register(&policy);
        let counts = Arc::new(Counts::new(&policy));
        let lanes = crate::lanes::lanes_of(&policy);
        Limiter {
            scopes: Scopes::new(&policy),
            read_headers: read_headers_of(&policy),
            policy,
            store: Arc::new(store),
            buffers: crate::BufferBudget::new(crate::DEFAULT_MAX_BUFFERED_BYTES),
            fallback: Arc::new(MemoryStore::new(MemoryConfig::with_max_keys(
                FALLBACK_MAX_KEYS,
            ))),
            degraded: Arc::new(AtomicBool::new(false)),
            top: Arc::new(std::array::from_fn(|_| Default::default())),
            lanes,
            counts,
            metrics,
            refusal_log: Arc::default(),
            outage_log: Arc::default(),
        }
    }

    /// A limiter enforcing `policy` in this one's place, on the same store, fallback,
    /// buffer bound and top-callers table: a budget in flight keeps its count (cells
    /// are keyed by scope and subject, so a changed limit applies to the count
    /// already spent; a changed window starts afresh when the new window does).
    /// The guarded lanes are kept, engines and all, so they must be the same.
    ///
    /// # Errors
    /// [`ReloadRefused`] when `policy` changes what only a restart can change.
    pub fn reloaded(&self, policy: Policy) -> Result<Limiter<S>, ReloadRefused> {
        if policy.lanes != self.policy.lanes {
            let names = |p: &Policy| {
                p.lanes
                    .iter()
                    .map(|l| l.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            let what = if names(&policy) == names(&self.policy) {
                let changed: Vec<&str> = policy
                    .lanes
                    .iter()
                    .zip(&self.policy.lanes)
                    .filter(|(new, old)| new != old)
                    .map(|(new, _)| new.name.as_str())
                    .collect();
                format!("settings of {}", changed.join(", "))
            } else {
                format!("[{}] became [{}]", names(&self.policy), names(&policy))
            };
            return Err(ReloadRefused::Lanes(what));
        }
        // A lane shared through a ledger was built with its outage rule, which the
        // routes and tools that name it decide.
        for (i, lane) in self.lanes.iter().enumerate() {
            if lane.is_shared()
                && crate::ledger_outage(&policy, i) != crate::ledger_outage(&self.policy, i)
            {
                return Err(ReloadRefused::Lanes(format!(
                    "what lane {} does while its shared ledger is down",
                    lane.name()
                )));
            }
        }
        Ok(Limiter {
            scopes: Scopes::new(&policy),
            read_headers: read_headers_of(&policy),
            metrics: Meters::register(&policy),
            policy,
            store: Arc::clone(&self.store),
            fallback: Arc::clone(&self.fallback),
            buffers: Arc::clone(&self.buffers),
            degraded: Arc::clone(&self.degraded),
            top: Arc::clone(&self.top),
            // The dashboard's totals go on; a refusal reason the new policy adds is
            // counted with the reasons not known at start.
            counts: Arc::clone(&self.counts),
            lanes: self.lanes.clone(),
            refusal_log: Arc::clone(&self.refusal_log),
            outage_log: Arc::clone(&self.outage_log),
        })
    }

    /// The same limiter with `lanes` as its guarded lanes, one per lane of the policy
    /// and in its order (built elsewhere, e.g. on a ledger shared by replicas: see
    /// `sluice_lanes::Lane::with_ledger`) instead of lanes counting in this process.
    /// A call through a lane with no counterpart here is answered 503.
    pub fn with_lanes(mut self, lanes: Vec<sluice_lanes::Lane>) -> Self {
        self.lanes = lanes;
        self
    }

    /// The same limiter with `max_bytes` as the bound on request bytes held in
    /// memory at once (default [`crate::DEFAULT_MAX_BUFFERED_BYTES`]).
    pub fn with_buffer_bound(mut self, max_bytes: usize) -> Self {
        self.buffers = crate::BufferBudget::new(max_bytes);
        self
    }

    /// The same limiter with `share` (a fraction of the bound, see
    /// [`crate::BufferBudget::with_share`]) as what one client may hold of the bound on
    /// buffered request bytes (default [`crate::DEFAULT_BUFFERED_SHARE`]). Call it
    /// after [`Limiter::with_buffer_bound`], which sets the default share again.
    pub fn with_buffer_share(mut self, share: f64) -> Self {
        self.buffers = crate::BufferBudget::with_share(self.buffers.max(), share);
        self
    }

    /// Who the buffered bytes of a request from `peer` with `headers` are charged to:
    /// the client address the policy believes (behind a trusted proxy, the client it
    /// names), as per-IP budgets count it.
    pub fn buffer_holder(&self, peer: IpAddr, headers: &HeaderMap) -> crate::Holder {
        crate::Holder::of(&self.policy.identity.client_ip(peer, headers))
    }

    /// The bound on request bytes held in memory at once, which every request path
    /// that takes a body in whole leases from (see [`crate::BufferBudget`]).
    pub fn buffers(&self) -> &std::sync::Arc<crate::BufferBudget> {
        &self.buffers
    }

    /// The same limiter writing at most `per_second` refusal log lines a second
    /// (default [`crate::DEFAULT_REFUSAL_LOG_PER_SECOND`]; 0 writes every one). The
    /// refusals past it are counted, and the next line written says how many.
    /// Lines saying the store could not decide have a bound of their own, the same.
    pub fn with_refusal_log(mut self, per_second: u32) -> Self {
        self.refusal_log = Arc::new(crate::RefusalLog::new(per_second));
        self.outage_log = Arc::new(crate::RefusalLog::new(per_second));
        self
    }

    /// The bound on refusal log lines (see [`Limiter::with_refusal_log`]).
    pub fn refusal_log(&self) -> &crate::RefusalLog {
        &self.refusal_log
    }

    /// The same limiter with another fallback store (e.g. on a skewed test clock).
    pub fn with_fallback(mut self, fallback: MemoryStore) -> Self {
        self.fallback = Arc::new(fallback);
        self
    }

    /// The store decided on while the main store is down.
    pub fn fallback(&self) -> &MemoryStore {
        &self.fallback
    }

    /// True while the main store is failing (the last decision it was asked for failed).
    pub fn is_degraded(&self) -> bool {
        self.degraded.load(Ordering::Relaxed)
    }

    fn set_degraded(&self, degraded: bool) {
        if self.degraded.swap(degraded, Ordering::Relaxed) != degraded {
            metrics::gauge!("sluice_store_degraded").set(if degraded { 1.0 } else { 0.0 });
        }
    }

    /// True when every class the plan holds fails open and it holds no capped
    /// monthly quota (a quota decided on one replica alone would not be one).
    fn fails_open(&self, plan: &Plan) -> bool {
        !plan.holds_capped_quota(&self.policy)
            && plan.kinds.iter().all(|k| match k {
                BudgetKind::Class(c) => self.policy.store.outage(*c) == Outage::FailOpen,
                _ => true,
            })
    }

    /// Decides `plan` on the fallback store with this replica's share of each limit.
    fn decide_locally(&self, plan: &Plan) -> Result<Decision, StoreError> {
        let replicas = self.policy.store.replicas.get();
        let local: arrayvec::ArrayVec<sluice_core::Budget, { sluice_core::MAX_BUDGETS }> = plan
            .budgets
            .iter()
            .map(|b| sluice_core::Budget {
                limit: (b.limit / replicas).max(1),
                ..*b
            })
            .collect();
        self.fallback.decide_now_from(&local, plan.network)
    }

    /// The policy enforced.
    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// The store decided on.
    pub fn store(&self) -> &S {
        &self.store
    }

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
    /// [`Limiter::plan`]), by its method and path: the normal form of the path once
    /// [`Limiter::normalize_target`] has rewritten it.
    ///
    /// # Errors
    /// As [`Limiter::route_for`].
    pub fn route(&self, parts: &Parts) -> Result<Option<&Route>, Refused> {
        self.route_for(&parts.method, parts.uri.path())
    }

    /// The route a request with this method and path (no query, in its normal form:
    /// see [`Limiter::normalize_path`]) matches.
    ///
    /// # Errors
    /// [`Refused::Path`] when path parameters (`;…`) change the route matched (see
    /// [`Policy::route_checked`]).
    pub fn route_for(&self, method: &Method, path: &str) -> Result<Option<&Route>, Refused> {
        Ok(self.policy.route_checked(method, path)?)
    }

    /// True when `route` takes its class from the body (a JSON-RPC route):
    /// the body must be read (bounded) before deciding.
    pub fn needs_body(route: Option<&Route>) -> bool {
        route.is_some_and(|r| {
            r.class == RouteClass::JsonRpc
                || matches!(r.batch, Some(sluice_policy::BatchEndpoint::Submit(_)))
        })
    }

    /// The request fields [`Limiter::plan_for`] reads (lowercase): those
    /// [`Identity::read_headers`](sluice_policy::Identity::read_headers) names, and
    /// `Content-Encoding` (a JSON-RPC body must be readable as sent).
    pub fn read_headers(&self) -> Vec<HeaderName> {
        self.read_headers.clone()
    }

    /// [`Limiter::read_headers`], borrowed.
    pub fn read_header_names(&self) -> &[HeaderName] {
        &self.read_headers
    }

    /// The budgets of a request on `route` (see [`Limiter::route`]). `body` is
    /// the body of a JSON-RPC route (`None` for a body that was too large: it
    /// counts as one item of the default class, and is answered 413 once decided).
    ///
    /// # Errors
    /// [`Refused`] for a request that cannot be counted as the upstream would read
    /// it (nothing is decided or spent).
    pub fn plan(
        &self,
        parts: &Parts,
        peer: IpAddr,
        route: Option<&Route>,
        body: Option<&[u8]>,
    ) -> Result<Box<Plan>, Refused> {
        self.plan_for(&parts.headers, peer, route, body)
    }

    /// [`Limiter::plan`] from the request's headers alone: the route carries what the
    /// method and path decide, and of the headers only those
    /// [`Limiter::read_headers`] names are read.
    ///
    /// # Errors
    /// [`Refused::Credentials`] for a request that sends one kind of credential more
    /// than once (see [`Identity::check_credentials`](sluice_policy::Identity::check_credentials));
    /// [`Refused::Body`] for a request on a JSON-RPC route whose body cannot be
    /// classified: one sent with a `Content-Encoding` other than `identity`, or one
    /// [`JsonRpc::classify`](sluice_policy::JsonRpc::classify) cannot count.
    pub fn plan_for(
        &self,
        headers: &HeaderMap,
        peer: IpAddr,
        route: Option<&Route>,
        body: Option<&[u8]>,
    ) -> Result<Box<Plan>, Refused> {
        self.plan_keyed(headers, peer, route, body, None)
    }

    /// [`Limiter::plan_for`] with the caller named by `key` when there is one (see
    /// [`Identity::keyed_caller`](sluice_policy::Identity::keyed_caller)) instead of
    /// the credential or address the policy reads; per-IP ceilings still apply to
    /// the client address.
    ///
    /// # Errors
    /// As [`Limiter::plan_for`].
    pub fn plan_keyed(
        &self,
        headers: &HeaderMap,
        peer: IpAddr,
        route: Option<&Route>,
        body: Option<&[u8]>,
        key: Option<&[u8]>,
    ) -> Result<Box<Plan>, Refused> {
        let policy = &self.policy;
        // Charged as the upstream reads the credential, or not at all.
        policy.identity.check_credentials(headers)?;
        let mut items = match route.map(|r| &r.class) {
            Some(RouteClass::Fixed(c)) => Items::one(*c),
            Some(RouteClass::JsonRpc) => {
                sluice_policy::check_content_encoding(headers)?;
                match body {
                    Some(b) => {
                        let mut items = policy.jsonrpc.classify(b, &policy.bounds)?;
                        // A batch submit tool: its items count against the single
                        // call's quota now, as a REST submit's do.
                        if let Some(call) = crate::batch_tool_call(policy, b)?
                            && let crate::BatchTool::Submit(l) = call.tool
                            && let Some(batch) = policy.lanes.get(l).and_then(|l| l.batch.as_ref())
                        {
                            let args = serde_json::to_vec(&call.arguments).unwrap_or_default();
                            let submit = crate::parse_batch(&args, batch.max_items.get())?;
                            if let Some(q) = batch.quota
                                && let Some(units) = items.quotas.get_mut(q)
                            {
                                let n = u32::try_from(submit.items.len()).unwrap_or(u32::MAX);
                                *units = units.saturating_add(n);
                            }
                        }
                        items
                    }
                    None => Items::one(policy.jsonrpc.default_class),
                }
            }
            None => Items::one(policy.default_class),
        };
        let identity = &policy.identity;
        let client = identity.client_ip(peer, headers);
        let caller = match key {
            Some(key) => identity.keyed_caller(key),
            None => identity.caller(headers, &client, identity.trusts(peer)),
        };
        if let Some(route) = route {
            // No allocation per request: the route's own slice.
            items.spend(&route.buckets, route.quota);
            items.call_lane(route.lane);
            // A batch submit: its items count against the single call's quota now,
            // and a body that cannot be queued is refused before anything is decided.
            if let Some(sluice_policy::BatchEndpoint::Submit(l)) = route.batch
                && let Some(batch) = policy.lanes.get(l).and_then(|l| l.batch.as_ref())
            {
                // No body: it was larger than `limits.max_body_bytes`, and the
                // layer answers 413 `payload_too_large` (as on a JSON-RPC route)
                // once the submit's own class is decided; nothing is queued.
                if let Some(body) = body {
                    // Checked before parsing, as a JSON-RPC body is: the parser
                    // never recurses past the bound.
                    if sluice_policy::depth_exceeds(body, policy.bounds.max_json_depth) {
                        return Err(Refused::Body(sluice_policy::Unclassifiable::TooDeep {
                            max_json_depth: policy.bounds.max_json_depth,
                        }));
                    }
                    let submit = crate::parse_batch(body, batch.max_items.get())?;
                    if let Some(q) = batch.quota
                        && let Some(units) = items.quotas.get_mut(q)
                    {
                        let n = u32::try_from(submit.items.len()).unwrap_or(u32::MAX);
                        *units = units.saturating_add(n);
                    }
                }
            }
        }
        let lane = items
            .lanes_called()
            .next()
            .map(|(lane, _)| crate::LaneCall {
                lane,
                jsonrpc: matches!(route.map(|r| &r.class), Some(RouteClass::JsonRpc)),
                calls: items.lanes_called().map(|(_, n)| u32::from(n)).sum(),
            });
        let mut plan = Box::new(plan(policy, &self.scopes, &items, caller, &client));
        plan.lane = lane;
        Ok(plan)
    }

    /// Decides every budget of `plan` at once, and records the outcome.
    ///
    /// A request refused only by weighted budgets that pass an exhausted request on
    /// (`on_exhausted: pass`) is decided again without spending them and admitted;
    /// [`Plan::passed`] then says which one, for `X-Sluice-Exhausted`.
    ///
    /// # Errors
    /// The store's, when it cannot answer.
    pub async fn decide(&self, plan: &mut Plan) -> Result<Decision, StoreError> {
        self.decide_boxed(plan).await.map(|d| *d)
    }

    /// [`Limiter::decide`] with the decision boxed as the store gives it: a
    /// decision is 400 bytes, and the request path moves it through several
    /// async layers.
    async fn decide_boxed(&self, plan: &mut Plan) -> Result<Box<Decision>, StoreError> {
        let mut decision = self.decide_budgets(plan, &plan.budgets).await;
        if let Ok(refused) = &decision
            && !refused.is_admitted()
            && let Some(passed) = self.passable(plan, refused)
        {
            let mut budgets = plan.budgets.clone();
            budgets[passed.index].cost = 0;
            let again = self.decide_budgets(plan, &budgets).await;
            if again.as_ref().is_ok_and(|d| d.is_admitted()) {
                plan.passed = Some(passed);
            }
            decision = again;
        }
        self.record(plan, &decision);
        decision
    }

    /// The edge's one sequence after a request is planned, for every request path.
    /// `jsonrpc_body` is the body of a request on a JSON-RPC route: with the
    /// policy's `jsonrpc.refusal: jsonrpc_error`, its 429s are answered as JSON-RPC
    /// errors (see [`crate::jsonrpc_refusal`]); whatever that option, a body such a
    /// route cannot classify is refused with a JSON-RPC parse error (-32700, `id:
    /// null`: see [`Refused::jsonrpc_response`]), with the status it has elsewhere.
    ///
    /// a request that cannot be counted, a call its lane refuses, a refusal, or a
    /// store that cannot decide becomes the answer to send (`Err`); an admitted
    /// request comes back with its decision, its plan and its place in a lane, to be
    /// forwarded and annotated.
    ///
    /// A call through a lane waits for its place first (up to the lane's wait), then
    /// its budgets are decided; when they refuse it, the place and its start go
    /// back, so a refused call spends nothing anywhere.
    ///
    /// # Errors
    /// The answer to send instead of forwarding.
    pub async fn admit(
        &self,
        plan: Result<Box<Plan>, Refused>,
        jsonrpc_body: Option<&[u8]>,
    ) -> Result<Admitted, http::Response<http_body_util::Full<bytes::Bytes>>> {
        self.admit_as(plan, jsonrpc_body, None).await
    }

    /// [`Limiter::admit`] for the request with id `request_id`: a refusal is logged
    /// (target `sluice::refusal`, one line) with the id, its reason, the budget or
    /// lane, the class and the caller's digest — never a credential — within the
    /// bound of [`Limiter::with_refusal_log`].
    ///
    /// # Errors
    /// As [`Limiter::admit`].
    pub async fn admit_as(
        &self,
        plan: Result<Box<Plan>, Refused>,
        jsonrpc_body: Option<&[u8]>,
        request_id: Option<&crate::RequestId>,
    ) -> Result<Admitted, http::Response<http_body_util::Full<bytes::Bytes>>> {
        let class = plan.as_ref().map_or("", |p| p.top_class.name());
        let answered = self
            .admit_plan(plan, request_id, jsonrpc_body.is_some())
            .await;
        match (answered, jsonrpc_body) {
            (Err(refusal), Some(body))
                if self.policy.jsonrpc.refusal == sluice_policy::JsonRpcRefusal::JsonRpcError =>
            {
                Err(crate::answer::jsonrpc_refusal(refusal, body, class))
            }
            (answered, _) => answered,
        }
    }

    /// [`Limiter::admit`] but for the JSON-RPC form of a 429. On a route that answers
    /// as JSON-RPC (`jsonrpc`), a body the classifier cannot read is refused with a
    /// JSON-RPC parse error (see [`Refused::jsonrpc_response`]).
    async fn admit_plan(
        &self,
        plan: Result<Box<Plan>, Refused>,
        request_id: Option<&crate::RequestId>,
        jsonrpc: bool,
    ) -> Result<Admitted, http::Response<http_body_util::Full<bytes::Bytes>>> {
        let id = request_id.map_or("-", crate::RequestId::as_str);
        let mut plan = plan.map_err(|refused| {
            crate::refusal_log::refusal_line(&self.refusal_log, || {
                tracing::info!(
                    target: "sluice::refusal",
                    request_id = id,
                    reason = "invalid_request",
                    error = %refused,
                    "refused before deciding"
                );
            });
            if jsonrpc {
                refused.jsonrpc_response()
            } else {
                refused.response()
            }
        })?;
        let place = match plan.lane {
            None => None,
            Some(call) => Some(self.take_lane_places(&plan, call, id).await?),
        };
        let decided = self.decide_boxed(&mut plan).await;
        let answer = match decided {
            Ok(decision) if decision.is_admitted() => {
                return Ok(Admitted {
                    decision,
                    plan,
                    lane: place,
                });
            }
            Ok(decision) => {
                let binding = decision.binding_index();
                let reason = if decision.is_never() {
                    crate::COST_EXCEEDS_LIMIT
                } else if matches!(plan.kinds.get(binding), Some(BudgetKind::Quota(_))) {
                    "quota_exceeded"
                } else {
                    "rate_limited"
                };
                crate::refusal_log::refusal_line(&self.refusal_log, || {
                    tracing::info!(
                        target: "sluice::refusal",
                        request_id = id,
                        reason,
                        budget = plan.name(binding, &self.policy),
                        limit = decision.binding().map_or(0, |b| b.limit),
                        retry_after = (!decision.is_never())
                            .then(|| crate::answer::refusal_wait(&decision)),
                        class = plan.top_class.name(),
                        caller = %format_args!("{:016x}", plan.caller),
                        "refused"
                    );
                });
                crate::answer::refusal(&decision, &plan, &self.policy)
            }
            Err(error) => {
                crate::refusal_log::refusal_line(&self.outage_log, || {
                    tracing::warn!(
                        target: "sluice::refusal",
                        request_id = id,
                        reason = "limiter_unavailable",
                        class = plan.top_class.name(),
                        caller = %format_args!("{:016x}", plan.caller),
                        error = %error,
                        "the store could not decide"
                    );
                });
                crate::answer::limiter_unavailable(&error)
            }
        };
        if let Some(place) = place {
            place.cancel();
        }
        Err(answer)
    }

    /// The places in its lane a request's calls need, each waited for within the
    /// lane's one wait (they all go back when one cannot be had). A request with more
    /// calls than a workspace may run at once is refused at once: as its budgets
    /// refuse it when they do (nothing is spent either way), else as
    /// [`Refused::LaneCalls`].
    async fn take_lane_places(
        &self,
        plan: &Plan,
        call: crate::LaneCall,
        id: &str,
    ) -> Result<crate::LanePlace, http::Response<http_body_util::Full<bytes::Bytes>>> {
        let log = |reason: &str| {
            crate::refusal_log::refusal_line(&self.refusal_log, || {
                tracing::info!(
                    target: "sluice::refusal",
                    request_id = id,
                    reason,
                    lane = self.policy.lanes.get(call.lane).map_or("", |l| l.name.as_str()),
                    class = plan.top_class.name(),
                    caller = %format_args!("{:016x}", plan.caller),
                    "lane refused"
                );
            });
        };
        let (Some(lane), Some(rule)) =
            (self.lanes.get(call.lane), self.policy.lanes.get(call.lane))
        else {
            log("limiter_unavailable");
            return Err(crate::answer::limiter_unavailable(&"no such lane"));
        };
        if call.calls > rule.workspace_in_flight.get() {
            return Err(
                match self.store.peek_from(&plan.budgets, plan.network).await {
                    Ok(peeked) if !peeked.is_admitted() => {
                        log(plan.name(peeked.binding_index(), &self.policy));
                        crate::answer::refusal(&peeked, plan, &self.policy)
                    }
                    _ => {
                        log("too_many_lane_calls");
                        Refused::LaneCalls {
                            calls: call.calls,
                            max: rule.workspace_in_flight.get(),
                        }
                        .response()
                    }
                },
            );
        }
        let workspace = plan.from.workspace_label();
        let until = tokio::time::Instant::now() + crate::lanes::max_wait(rule, call);
        let mut permits = Vec::with_capacity(call.calls as usize);
        for _ in 0..call.calls {
            let left = until.saturating_duration_since(tokio::time::Instant::now());
            match lane.acquire(&workspace, left).await {
                Ok(permit) => permits.push(permit),
                Err(refusal) => {
                    crate::LanePlace::new(permits, rule.timeout).cancel();
                    log(refusal.reason.as_str());
                    if refusal.reason == sluice_lanes::RefusalReason::LedgerUnavailable {
                        // The lane fails closed while its shared ledger is down: as
                        // a store that cannot decide (see `lanes::ledger_outage`).
                        return Err(crate::answer::limiter_unavailable(&format!(
                            "the ledger of lane {} did not answer",
                            rule.name
                        )));
                    }
                    metrics::counter!(
                        "sluice_lane_refusals_total",
                        "lane" => rule.name.clone(),
                        "reason" => refusal.reason.as_str()
                    )
                    .increment(1);
                    *self
                        .counts
                        .lane_refusals
                        .lock()
                        .entry((call.lane, refusal.reason.as_str()))
                        .or_default() += 1;
                    return Err(crate::lane_refusal(&rule.name, &refusal));
                }
            }
        }
        Ok(crate::LanePlace::new(permits, rule.timeout))
    }

    /// The guarded lanes, in the policy's order (for status pages).
    pub fn lanes(&self) -> &[sluice_lanes::Lane] {
        &self.lanes
    }

    /// The pass-on budget that alone refused `refused`, if that is all that did.
    fn passable(&self, plan: &Plan, refused: &Decision) -> Option<Passed> {
        let mut passed = None;
        for (i, s) in refused.statuses().iter().enumerate() {
            if s.verdict == sluice_core::Verdict::Admitted {
                continue;
            }
            if !plan.passes(i, &self.policy) || passed.is_some() {
                return None;
            }
            let wait = s.retry_after().map_or_else(
                || s.reset_after_secs(refused.decided_at()),
                crate::answer::retry_after_secs,
            );
            passed = Some(Passed {
                index: i,
                retry_after: wait.max(1),
            });
        }
        passed
    }

    /// Charges the weighted budgets of an admitted `plan` what the upstream said
    /// the call cost (`cost`: `X-Sluice-Cost`, `None` = 1 per item, as admitted),
    /// and returns the decision with their statuses after the charge. A
    /// store that cannot answer leaves the decision as it was.
    pub async fn settle(&self, plan: &Plan, decision: Decision, cost: Option<u32>) -> Decision {
        let Some(cost) = cost else {
            return decision;
        };
        let mut statuses: arrayvec::ArrayVec<
            sluice_core::BudgetStatus,
            { sluice_core::MAX_BUDGETS },
        > = decision.statuses().iter().copied().collect();
        let mut changed = false;
        for i in plan.weighted(&self.policy) {
            if plan.passed.is_some_and(|p| p.index == i) {
                continue;
            }
            let Some(budget) = plan.budgets.get(i) else {
                continue;
            };
            let delta = i64::from(cost) - i64::from(budget.cost);
            if delta == 0 {
                continue;
            }
            match self
                .store
                .adjust_from(budget, delta, decision.decided_at(), plan.network)
                .await
            {
                Ok(status) => {
                    if let Some(s) = statuses.get_mut(i) {
                        *s = status;
                        changed = true;
                    }
                }
                Err(_) => {
                    // The charge is lost, the call was already admitted: counted.
                    metrics::counter!("sluice_settle_failures_total").increment(1);
                }
            }
        }
        if changed {
            Decision::from_statuses(decision.decided_at(), statuses)
        } else {
            decision
        }
    }

    async fn decide_budgets(
        &self,
        plan: &Plan,
        budgets: &[sluice_core::Budget],
    ) -> Result<Box<Decision>, StoreError> {
        let started = Instant::now();
        let decision = match self.store.decide_from(budgets, plan.network).await {
            Ok(d) => {
                self.set_degraded(false);
                Ok(Box::new(d))
            }
            Err(StoreError::Unavailable(e)) => {
                self.set_degraded(true);
                if self.fails_open(plan) {
                    self.metrics.local.increment(1);
                    self.counts.local.fetch_add(1, Ordering::Relaxed);
                    self.decide_locally(plan).map(Box::new)
                } else {
                    Err(StoreError::Unavailable(e))
                }
            }
            Err(e) => Err(e),
        };
        self.metrics
            .decision_seconds
            .record(started.elapsed().as_secs_f64());
        decision
    }

    /// Counts a decision's outcome in the metrics and the status page.
    fn record(&self, plan: &Plan, decision: &Result<Box<Decision>, StoreError>) {
        let counters = &self.metrics.decisions[plan.top_class.index()];
        let counts = &self.counts.classes[plan.top_class.index()];
        match decision {
            Ok(d) if d.is_admitted() => {
                let mut units = 0;
                for (b, k) in plan.budgets.iter().zip(&plan.kinds) {
                    match k {
                        BudgetKind::Quota(q) => {
                            if let Some(meter) =
                                self.metrics.quota_units.get(crate::plan::policy_index(*q))
                            {
                                meter.increment(u64::from(b.cost));
                            }
                        }
                        BudgetKind::Class(c) => {
                            units += u64::from(b.cost);
                            self.counts.classes[c.index()]
                                .units
                                .fetch_add(u64::from(b.cost), Ordering::Relaxed);
                        }
                        _ => {}
                    }
                }
                counters[0].increment(1);
                counts.admitted.fetch_add(1, Ordering::Relaxed);
                self.counts.fill(plan, d);
                let window = d.decided_at().as_secs() / u64::from(self.policy.window.get());
                self.top[top_shard(plan.caller)].lock().record(
                    window,
                    plan.caller,
                    plan.who,
                    || plan.from.workspace_label(),
                    units,
                );
            }
            Ok(d) => {
                let reason = plan.name(d.binding_index(), &self.policy);
                counters[1].increment(1);
                counts.refused.fetch_add(1, Ordering::Relaxed);
                self.counts.fill(plan, d);
                match self.metrics.refusals.get(reason) {
                    Some(counter) => counter.increment(1),
                    None => {
                        metrics::counter!("sluice_refusals_total", "reason" => reason.to_owned())
                            .increment(1)
                    }
                }
                match self.counts.refusals.get(reason) {
                    Some(n) => n.fetch_add(1, Ordering::Relaxed),
                    None => self.counts.other_refusals.fetch_add(1, Ordering::Relaxed),
                };
            }
            Err(_) => {
                counters[2].increment(1);
                counts.errors.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// The counts since start that the dashboard shows (see [`Tally`]); the
    /// class fills are as of `now_secs` (Unix seconds).
    pub fn tally(&self, now_secs: u64) -> Tally {
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let classes = Class::ALL
            .iter()
            .map(|&class| {
                let c = &self.counts.classes[class.index()];
                let fill = load(&c.fill);
                ClassTally {
                    class,
                    limit: self.policy.profile.limit(class).get(),
                    admitted: load(&c.admitted),
                    refused: load(&c.refused),
                    errors: load(&c.errors),
                    units: load(&c.units),
                    // The fill stands until its window's reset.
                    fill_permille: if fill >> 16 > now_secs {
                        u16::try_from(fill & 0xffff).unwrap_or(1000)
                    } else {
                        0
                    },
                }
            })
            .collect();
        let mut refusals: Vec<(String, u64)> = self
            .counts
            .refusals
            .iter()
            .map(|(r, n)| (r.clone(), load(n)))
            .chain(std::iter::once((
                "other".to_owned(),
                load(&self.counts.other_refusals),
            )))
            .filter(|(_, n)| *n > 0)
            .collect();
        refusals.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        let mut lane_refusals: Vec<(String, &'static str, u64)> = self
            .counts
            .lane_refusals
            .lock()
            .iter()
            .filter_map(|(&(lane, reason), &n)| {
                Some((self.policy.lanes.get(lane)?.name.clone(), reason, n))
            })
            .collect();
        lane_refusals.sort();
        Tally {
            classes,
            refusals,
            lane_refusals,
            local_decisions: load(&self.counts.local),
        }
    }

    /// Where a workspace stands on every monthly quota family, by its
    /// label as the upstream is told it (`X-Sluice-Workspace`).
    ///
    /// # Errors
    /// [`QuotaQueryError`]: a label that names no workspace, or a store that
    /// cannot answer.
    pub async fn quota_usage(&self, workspace: &str) -> Result<Vec<QuotaUsage>, QuotaQueryError> {
        let (families, budgets) = self.quota_budgets(workspace, None)?;
        let decision = self.store.peek(&budgets).await?;
        Ok(self.usage_of(&families, &decision))
    }

    /// Sets a workspace's usage of one family (or of every family) back to zero
    /// for the current month, and returns where it then stands.
    ///
    /// # Errors
    /// As [`Limiter::quota_usage`], and an unknown family.
    pub async fn reset_quota(
        &self,
        workspace: &str,
        family: Option<&str>,
    ) -> Result<Vec<QuotaUsage>, QuotaQueryError> {
        let (families, budgets) = self.quota_budgets(workspace, family)?;
        let now = self.store.peek(&budgets).await?.decided_at();
        for b in &budgets {
            self.store.adjust(b, -i64::from(b.limit), now).await?;
        }
        let decision = self.store.peek(&budgets).await?;
        Ok(self.usage_of(&families, &decision))
    }

    /// Gives `units` of quota family `family` (an index into the policy's quotas) back
    /// to `workspace` (its label as the upstream is told it): for calls counted at
    /// admission that were then not made (a batch the queue refused, or one it already
    /// held under the same idempotency key).
    ///
    /// # Errors
    /// As [`Limiter::quota_usage`].
    pub async fn refund_quota(
        &self,
        workspace: &str,
        family: usize,
        units: u32,
    ) -> Result<(), QuotaQueryError> {
        let Some(name) = self.policy.quotas.get(family).map(|q| q.name.clone()) else {
            return Err(QuotaQueryError::Family(family.to_string()));
        };
        let (_, budgets) = self.quota_budgets(workspace, Some(&name))?;
        let now = self.store.peek(&budgets).await?.decided_at();
        for b in &budgets {
            self.store.adjust(b, -i64::from(units), now).await?;
        }
        Ok(())
    }

    /// The families asked for (indices) and their budgets for `workspace`, spending nothing.
    fn quota_budgets(
        &self,
        workspace: &str,
        family: Option<&str>,
    ) -> Result<(Vec<usize>, Vec<sluice_core::Budget>), QuotaQueryError> {
        let subject = self
            .policy
            .identity
            .workspace_subject(workspace)
            .ok_or(QuotaQueryError::Workspace)?;
        if let Some(f) = family
            && !self.policy.quotas.iter().any(|q| q.name == f)
        {
            return Err(QuotaQueryError::Family(f.to_owned()));
        }
        Ok(self
            .policy
            .quotas
            .iter()
            .enumerate()
            .filter(|(_, q)| family.is_none_or(|f| q.name == f))
            .filter_map(|(i, q)| {
                let scope = *self.scopes.quota(i)?;
                Some((i, crate::plan::quota_budget(scope, q, subject, 0)))
            })
            .unzip())
    }

    fn usage_of(&self, families: &[usize], decision: &Decision) -> Vec<QuotaUsage> {
        families
            .iter()
            .zip(decision.statuses())
            .filter_map(|(&i, s)| {
                let q = self.policy.quotas.get(i)?;
                Some(QuotaUsage {
                    family: q.name.clone(),
                    limit: q.monthly.map(std::num::NonZeroU32::get),
                    usage: s.limit - s.remaining,
                    resets_at: s.reset,
                })
            })
            .collect()
    }

    /// A summary for `/status`: the policy's numbers and the callers that
    /// spent most in the current window.
    pub fn status(&self) -> serde_json::Value {
        let p = &self.policy;
        let classes: serde_json::Map<String, serde_json::Value> = Class::ALL
            .iter()
            .map(|&c| (c.name().to_owned(), p.profile.limit(c).get().into()))
            .collect();
        // The latest window any shard has seen is the current one; a shard still on
        // an older window has had no spend in this one.
        let shards: Vec<_> = self.top.iter().map(|shard| shard.lock()).collect();
        let window = shards.iter().map(|t| t.window).max().unwrap_or(0);
        let current = || shards.iter().filter(|t| t.window == window);
        let mut callers: Vec<(String, &str, u64)> = current()
            .flat_map(|t| t.spend.values())
            .map(|(who, workspace, units)| (who.to_string(), workspace.as_str(), *units))
            .collect();
        let others: u64 = current().map(|t| t.others).sum();
        callers.sort_by(|a, b| b.2.cmp(&a.2).then(a.0.cmp(&b.0)));
        serde_json::json!({
            "profile": p.profile_name,
            "window_seconds": p.window.get(),
            "classes": classes,
            "ip_ceilings": {
                "work": p.profile.ceiling_work.get(),
                "protocol_only": p.profile.ceiling_protocol_only.get(),
            },
            "buckets": p.buckets.iter().map(|b| serde_json::json!({
                "name": b.name, "limit": b.limit.get(), "window_seconds": b.window.get(),
            })).collect::<Vec<_>>(),
            "routes": p.routes.len(),
            "top_callers": callers.iter().take(10).map(|(label, workspace, units)| serde_json::json!({
                "caller": label, "workspace": workspace, "units": units,
            })).collect::<Vec<_>>(),
            "other_callers_units": others,
            "store_degraded": self.is_degraded(),
            "lanes": self.lanes.iter().map(crate::lane_status).collect::<Vec<_>>(),
        })
    }
}

/// The request fields a limiter on `policy` reads (see [`Limiter::read_headers`]).
fn read_headers_of(policy: &Policy) -> Vec<HeaderName> {
    let mut names = policy.identity.read_headers();
    if !names.contains(&CONTENT_ENCODING) {
        names.push(CONTENT_ENCODING);
    }
    names
}

/// The top-callers shard of `caller` (a hash already: its high bits pick).
fn top_shard(caller: u64) -> usize {
    (caller >> 60) as usize % TOP_SHARDS
}

impl TopCallers {
    /// Adds `units` to `caller`'s spend in `window`; `workspace` (its label) is
    /// asked for only when the caller is new in the window.
    fn record(
        &mut self,
        window: u64,
        caller: u64,
        who: Who,
        workspace: impl FnOnce() -> String,
        units: u64,
    ) {
        if window != self.window {
            self.window = window;
            self.spend.clear();
            self.others = 0;
        }
        if let Some((_, _, n)) = self.spend.get_mut(&caller) {
            *n += units;
        } else if self.spend.len() < TOP_CALLERS_TRACKED / TOP_SHARDS {
            self.spend.insert(caller, (who, workspace(), units));
        } else {
            self.others += units;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limiter() -> Limiter<MemoryStore> {
        let policy = sluice_policy::default_policy().expect("default policy");
        Limiter::new(policy, MemoryStore::new(MemoryConfig::default()))
    }

    #[test]
    fn a_host_is_judged_alike_whatever_host_came_before_it_on_the_thread() {
        let check = |host: &str| check_head(&Method::GET, Version::HTTP_11, [host.as_bytes()]);
        let long = format!("{}.example", "a".repeat(80));
        let hosts = [
            "api.example:8080",
            "api.example:8080",
            "u@api.example:8080",
            "api.example:8080",
            "api example",
            "[::1]:443",
            "[::1",
            "api.example:8080/x",
            long.as_str(),
            "api.example:8080",
        ];
        let mut refused = 0;
        for _ in 0..2 {
            for host in hosts {
                // As `http` reads an authority, with no userinfo.
                let valid = !host.contains('@') && http::uri::Authority::try_from(host).is_ok();
                match check(host) {
                    Ok(()) => assert!(valid, "{host}"),
                    Err(Refused::BadHost) => {
                        assert!(!valid, "{host}");
                        refused += 1;
                    }
                    Err(other) => panic!("{host}: {other:?}"),
                }
            }
        }
        assert_eq!(refused, 8, "four refused hosts, twice each");
    }

    #[test]
    fn e6_a_target_is_rewritten_to_its_normal_form_the_query_kept() {
        let limiter = limiter();
        for (target, normal) in [
            ("/chats?a=1", "/chats?a=1"),
            ("//x/../%63hats?next=/../%2e", "/chats?next=/../%2e"),
            ("http://h:1//oauth/%72egister", "http://h:1/oauth/register"),
            ("/a%2fb", "/a%2Fb"),
            ("*", "*"),
        ] {
            let mut uri: Uri = target.parse().expect("uri");
            limiter.normalize_target(&mut uri).expect("normal form");
            assert_eq!(uri.to_string(), normal, "{target}");
        }
        let mut uri: Uri = "/a/../../etc?x".parse().expect("uri");
        assert_eq!(
            limiter.normalize_target(&mut uri),
            Err(Refused::Path(PathError::AboveRoot))
        );
        assert_eq!(uri, "/a/../../etc?x", "left as it was");
    }

    #[test]
    fn e6_a_normal_path_is_matched_without_a_copy() {
        let limiter = limiter();
        assert!(matches!(
            limiter.normalize_path("/oauth/register"),
            Ok(Cow::Borrowed(_))
        ));
        let route = limiter.normalize_path("//oauth/%72egister").map(|p| {
            limiter
                .route_for(&Method::POST, &p)
                .ok()
                .flatten()
                .map(|r| r.buckets.len())
        });
        assert_eq!(
            route,
            Ok(Some(1)),
            "the registration route, with its bucket"
        );
    }
}
