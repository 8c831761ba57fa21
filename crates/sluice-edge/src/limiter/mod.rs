//! The limiter: one policy, one store, and everything between a request's
//! head and its decision, one module a phase (see the crate's docs).

use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use http::{HeaderMap, HeaderName};
use parking_lot::Mutex;
use sluice_policy::Policy;
use sluice_store::{BudgetStore, MemoryConfig, MemoryStore};

use crate::plan::Scopes;

mod admission;
mod leases;
mod llm_usage;
mod outage;
mod planning;
mod quota_admin;
mod routing;
mod telemetry;
mod usage_export;

pub use crate::head::{
    MAX_REQUEST_HEAD_BYTES, Refused, check_head, check_transfer_coding, request_head_len,
};
pub use admission::{Reason, Refusal};
pub(crate) use admission::{shadow_waived, waive};
pub use leases::{ASK_WAIT, LeaseTally, MAX_LEASED_KEYS, SWEEP_EVERY};
pub use llm_usage::{USAGE_MONTHS_KEPT, UsageMonth, UsageMonthError};
pub use outage::FALLBACK_MAX_KEYS;
pub use quota_admin::{QuotaQueryError, QuotaUsage};
use routing::read_headers_of;
pub use telemetry::{
    BucketLimit, ClassTally, DomainRuleStatus, DomainStatus, PlanStatus, Status,
    TOP_CALLERS_TRACKED, Tally, TopCaller,
};
use telemetry::{Counts, Meters, TOP_SHARDS, TopCallers};
pub use usage_export::{
    EXPORT_PAGE, KNOWN_ROWS, MAX_USAGE_ROWS, OVERFLOW_ROWS, UNNAMED, UsageExport,
};

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
    /// How long a body taken in whole may take to arrive (see [`crate::Intake`]).
    body_deadline: std::time::Duration,
    degraded: Arc<AtomicBool>,
    /// Spend per caller this window, in shards by caller (no process-wide lock on
    /// the hot path).
    top: Arc<[crossbeam_utils::CachePadded<Mutex<TopCallers>>; TOP_SHARDS]>,
    metrics: Meters,
    /// Counts since start, for the dashboard (see [`Limiter::tally`]).
    counts: Arc<Counts>,
    /// The policy's guarded lanes, in its order.
    lanes: Vec<sluice_lanes::Lane>,
    /// The request fields planning reads (see [`Limiter::read_headers`]).
    read_headers: Vec<HeaderName>,
    /// The bound on refusal log lines a second.
    refusal_log: Arc<crate::RefusalLog>,
    /// The same bound, apart, for the lines saying the store could not decide: a
    /// flood of ordinary refusals does not hide an outage.
    outage_log: Arc<crate::RefusalLog>,
    /// The agent runs this replica decided turns of lately (SPEC T7).
    pub(crate) runs: Arc<crate::runs::RecentRuns>,
    /// The usage export's rows this process has noted (SPEC O4).
    usage_rows: Arc<usage_export::KnownRows>,
    /// The names of the usage counts an LLM call's settlement charges, by
    /// workspace, model and day (this policy's: a reload starts it anew).
    usage_names: usage_export::UsageNames,
    /// Where alert events go (SPEC O3), when the policy has alerts.
    alerts: Option<Arc<dyn crate::AlertSink>>,
    /// This replica's leases of leased budgets (SPEC D4), kept across reloads.
    leases: Arc<leases::Leases>,
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
    /// The alerts changed (SPEC O3): their webhooks and secrets are read, and
    /// their sender started, when sluice starts.
    #[error(
        "alerts: the webhooks changed; they are read (with their secrets) when sluice starts: restart sluice to apply"
    )]
    Alerts,
}

/// A limiter that can be replaced while requests run (a policy reload): each request
/// takes the one current when it arrives ([`ArcSwap::load_full`](arc_swap::ArcSwap::load_full), no lock) and keeps
/// it to its end.
pub type SharedLimiter<S> = Arc<arc_swap::ArcSwap<Limiter<S>>>;

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
            body_deadline: crate::BODY_DEADLINE,
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
            runs: Arc::default(),
            usage_rows: Arc::default(),
            usage_names: usage_export::UsageNames::default(),
            alerts: None,
            leases: Arc::default(),
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
        if policy.alerts != self.policy.alerts {
            return Err(ReloadRefused::Alerts);
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
            body_deadline: self.body_deadline,
            degraded: Arc::clone(&self.degraded),
            top: Arc::clone(&self.top),
            // The dashboard's totals go on; a refusal reason the new policy adds is
            // counted with the reasons not known at start.
            counts: Arc::clone(&self.counts),
            lanes: self.lanes.clone(),
            refusal_log: Arc::clone(&self.refusal_log),
            outage_log: Arc::clone(&self.outage_log),
            runs: Arc::clone(&self.runs),
            usage_rows: Arc::clone(&self.usage_rows),
            usage_names: usage_export::UsageNames::default(),
            alerts: self.alerts.clone(),
            leases: Arc::clone(&self.leases),
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

    /// The same limiter handing the events of the policy's `alerts:` to `sink`
    /// (SPEC O3; see [`crate::AlertSink`]). Kept by a [reload](Limiter::reloaded).
    pub fn with_alerts(mut self, sink: Arc<dyn crate::AlertSink>) -> Self {
        self.alerts = Some(sink);
        self
    }

    /// Offers `sink` the alert events of `plan`'s budgets as `decision` leaves
    /// them (an admitted decision, or a settlement's): those it does not know yet,
    /// each waited for until kept.
    pub(crate) async fn raise_alerts(&self, plan: &crate::Plan, decision: &sluice_core::Decision) {
        let Some(sink) = &self.alerts else {
            return;
        };
        for event in crate::alerts::events(
            &self.policy,
            plan,
            decision.statuses(),
            decision.decided_at(),
        ) {
            if !sink.knows(&event.id) {
                sink.offer(event).await;
            }
        }
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

    /// The same limiter giving a request body taken in whole `deadline` to arrive
    /// (default [`crate::BODY_DEADLINE`]), however steadily it comes; past it, 408.
    pub fn with_body_deadline(mut self, deadline: std::time::Duration) -> Self {
        self.body_deadline = deadline;
        self
    }

    /// How long a request body taken in whole may take to arrive (see
    /// [`Limiter::with_body_deadline`]).
    pub fn body_deadline(&self) -> std::time::Duration {
        self.body_deadline
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

    /// The policy enforced.
    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// The store decided on.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// The guarded lanes, in the policy's order (for status pages).
    pub fn lanes(&self) -> &[sluice_lanes::Lane] {
        &self.lanes
    }
}

#[cfg(test)]
mod tests {
    use std::borrow::Cow;

    use http::{Method, Uri, Version};
    use sluice_policy::PathError;

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
