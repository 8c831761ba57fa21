//! What the limiter tells of its decisions: metrics, the dashboard's tally, the top
//! callers and `/status`.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use serde::Serialize;
use sluice_core::Decision;
use sluice_policy::{Class, MAX_CLASSES, Policy, Who};
use sluice_store::{BudgetStore, StoreError};

use super::Limiter;
use crate::plan::{BudgetKind, Plan};

/// The most callers the status page tracks per window; past it new callers
/// are counted together as `others`.
pub const TOP_CALLERS_TRACKED: usize = 4_096;

/// What the dashboard is told of the limiter's decisions since the process started
/// (see [`Limiter::tally`]). The same events as the `sluice_decisions_total`,
/// `sluice_refusals_total`, `sluice_lane_refusals_total` and
/// `sluice_local_decisions_total` metrics, readable without parsing their text.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Tally {
    /// One per class of the policy, cheapest first.
    pub classes: Vec<ClassTally>,
    /// Refusals by the budget that refused them (`sluice_refusals_total`'s
    /// `reason`: a class, a ceiling, a bucket or a quota family), most first;
    /// reasons with none left out.
    pub refusals: Vec<(String, u64)>,
    /// Calls the guarded lanes refused: (lane, reason as clients see it, count),
    /// by lane then reason.
    pub lane_refusals: Vec<(String, String, u64)>,
    /// Refusals budgets in shadow mode would have given, the requests forwarded
    /// instead: (budget, reason, count), by budget then reason
    /// (`sluice_shadow_refusals_total`).
    pub shadow_refusals: Vec<(String, &'static str, u64)>,
    /// Decisions made on this process's fallback store while the shared store
    /// was down (fail-open classes).
    pub local_decisions: u64,
    /// This replica's leases of leased budgets (SPEC D4): taken, returned,
    /// expired, and the store calls they saved.
    pub leases: super::LeaseTally,
    /// Admitted decisions that left a budget past `near_limit_ratio` of its
    /// limit, by budget (a class, a ceiling, a bucket or a quota family), most
    /// first; budgets with none left out (`sluice_near_limit_total`).
    pub near_limit: Vec<(String, u64)>,
}

/// One class's part of a [`Tally`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ClassTally {
    /// The class.
    pub class: Class,
    /// Its name.
    pub name: String,
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
pub(super) struct Counts {
    /// By class index, for every class a policy can have (a reload may add some).
    pub(super) classes: Box<[crossbeam_utils::CachePadded<ClassCounts>]>,
    /// Refusals by every reason the policy can give (fixed at start, kept across
    /// reloads).
    pub(super) refusals: HashMap<String, AtomicU64>,
    /// Refusals by a reason not known at start (none expected).
    pub(super) other_refusals: AtomicU64,
    /// Admitted decisions that left a budget near its limit, by every budget the
    /// policy names (fixed at start, kept across reloads).
    pub(super) near_limit: HashMap<String, AtomicU64>,
    pub(super) local: AtomicU64,
    /// Lane refusals by (lane index, reason): rare, a lock is fine.
    pub(super) lane_refusals: Mutex<HashMap<(usize, &'static str), u64>>,
    /// Refusals that budgets in shadow mode would have given, by (budget, reason):
    /// rare outside a dry run, and bounded by the policy's budget names.
    pub(super) shadow_refusals: Mutex<HashMap<(String, &'static str), u64>>,
}

#[derive(Default)]
pub(super) struct ClassCounts {
    admitted: AtomicU64,
    refused: AtomicU64,
    errors: AtomicU64,
    units: AtomicU64,
    /// `reset << 16 | permille` of the fullest budget seen: a later window (a later
    /// reset) always wins, and within one window the fullest does.
    fill: AtomicU64,
}

impl Counts {
    pub(super) fn new(policy: &Policy) -> Self {
        Counts {
            classes: (0..MAX_CLASSES).map(|_| Default::default()).collect(),
            refusals: refusal_reasons(policy)
                .map(|r| (r, AtomicU64::new(0)))
                .collect(),
            other_refusals: AtomicU64::new(0),
            near_limit: refusal_reasons(policy)
                .map(|r| (r, AtomicU64::new(0)))
                .collect(),
            local: AtomicU64::new(0),
            lane_refusals: Mutex::new(HashMap::new()),
            shadow_refusals: Mutex::new(HashMap::new()),
        }
    }

    /// Notes the fill of every class budget a decision reports.
    pub(super) fn fill(&self, plan: &Plan, decision: &Decision) {
        for (k, s) in plan.kinds.iter().zip(decision.statuses()) {
            let BudgetKind::Class(c) = k else { continue };
            let Some(counts) = self.classes.get(c.index()) else {
                continue;
            };
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
pub(super) fn refusal_reasons(policy: &Policy) -> impl Iterator<Item = String> + '_ {
    policy
        .classes
        .iter()
        .map(|c| c.name.clone())
        .chain(policy.ceilings.iter().map(|c| c.name.clone()))
        .chain(policy.buckets.iter().map(|b| b.name.clone()))
        .chain(policy.quotas.iter().map(|q| q.name.clone()))
        // A caller out of run starts (SPEC T7).
        .chain(policy.turns.enabled.then(|| "run_starts".to_owned()))
}

/// Shards of the top-callers table.
pub(super) const TOP_SHARDS: usize = 16;

/// Metric handles, registered once (a lookup per request costs more than
/// the decision).
pub(super) struct Meters {
    /// `sluice_decisions_total{class, outcome}` by class index and outcome
    /// (admitted, refused, error).
    pub(super) decisions: Vec<[metrics::Counter; 3]>,
    pub(super) local: metrics::Counter,
    /// `sluice_quota_units_total{family}` by family index.
    pub(super) quota_units: Vec<metrics::Counter>,
    /// `sluice_refusals_total{reason}` by every reason the policy can give.
    pub(super) refusals: HashMap<String, metrics::Counter>,
    /// `sluice_near_limit_total{budget}` by every budget the policy names.
    pub(super) near_limit: HashMap<String, metrics::Counter>,
    /// `sluice_llm_tokens_total{direction}`: input, cached_input, output.
    pub(super) llm_tokens: [metrics::Counter; 3],
    /// `sluice_llm_settlements_total{outcome}`: usage, refunded, reservation.
    pub(super) llm_settlements: [metrics::Counter; 3],
}

impl Meters {
    pub(super) fn register(policy: &Policy) -> Self {
        let outcomes = ["admitted", "refused", "error"];
        Meters {
            decisions: policy
                .classes
                .iter()
                .map(|c| {
                    outcomes.map(|o| {
                        metrics::counter!("sluice_decisions_total", "class" => c.name.clone(), "outcome" => o)
                    })
                })
                .collect(),
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
            near_limit: refusal_reasons(policy)
                .map(|budget| {
                    let counter =
                        metrics::counter!("sluice_near_limit_total", "budget" => budget.clone());
                    (budget, counter)
                })
                .collect(),
            llm_tokens: ["input", "cached_input", "output"]
                .map(|d| metrics::counter!("sluice_llm_tokens_total", "direction" => d)),
            llm_settlements: ["usage", "refunded", "reservation"]
                .map(|o| metrics::counter!("sluice_llm_settlements_total", "outcome" => o)),
        }
    }
}

#[derive(Default)]
pub(super) struct TopCallers {
    window: u64,
    /// Caller subject → (who, its workspace label, units spent this window).
    /// Touched by every admitted request: foldhash, seeded per process.
    spend: HashMap<u64, (Who, String, u64), foldhash::fast::RandomState>,
    others: u64,
}

/// What `/status` shows of a limiter (see [`Limiter::status`]), as JSON through
/// its `Serialize`.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[non_exhaustive]
pub struct Status {
    /// The profile's name.
    pub profile: String,
    /// The classes' window.
    pub window_seconds: u32,
    /// Each class's limit per caller per window, by name.
    pub classes: BTreeMap<String, u32>,
    /// The classes' names, cheapest first (the order of the dashboard's samples).
    pub class_names: Vec<String>,
    /// Each per-IP ceiling's limit per window, by name.
    pub ip_ceilings: BTreeMap<String, u32>,
    /// The per-route buckets.
    pub buckets: Vec<BucketLimit>,
    /// Routes in the policy.
    pub routes: usize,
    /// The ten callers that spent most in the current window, most first.
    pub top_callers: Vec<TopCaller>,
    /// Units the other callers spent in the current window.
    pub other_callers_units: u64,
    /// True while the store is failing (see [`Limiter::is_degraded`]).
    pub store_degraded: bool,
    /// True in a dry run: every budget in shadow mode, nothing refused.
    pub dry_run: bool,
    /// The guarded lanes, in the policy's order.
    pub lanes: Vec<crate::LaneStatus>,
    /// The customer plans: what a workspace on each gets.
    pub plans: Vec<PlanStatus>,
    /// How many workspaces the tenant table puts on a plan.
    pub workspaces_on_plans: usize,
    /// The rate-limit service's domains (`domains:` and `--rls-config`).
    pub domains: Vec<DomainStatus>,
    /// The share of its limit past which a budget is near it
    /// (`near_limit_ratio`, SPEC O2).
    pub near_limit_ratio: f64,
    /// Admitted decisions since start that left a budget near its limit, by
    /// budget name (`sluice_near_limit_total`).
    pub near_limit: BTreeMap<String, u64>,
}

/// A domain of Envoy's rate-limit service, in a [`Status`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct DomainStatus {
    /// Its name.
    pub domain: String,
    /// Where it was read: `domains[i]` of the policy, or a file.
    pub source: String,
    /// `fail_open` or `fail_closed` while the store cannot decide.
    pub outage: &'static str,
    /// Its rules, in the order of the file.
    pub rules: Vec<DomainRuleStatus>,
}

/// One rule of a [`DomainStatus`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct DomainRuleStatus {
    /// Its id (`key_value.key2`).
    pub id: String,
    /// Requests per unit (absent for an unlimited rule).
    pub limit: Option<u32>,
    /// Its unit.
    pub unit: &'static str,
    /// Its algorithm (`fixed`, `sliding` or `gcra`).
    pub algorithm: &'static str,
    /// Decided and counted, never refusing.
    pub shadow: bool,
}

/// A customer plan of a [`Status`]: the limits a workspace on it gets (its
/// overrides applied to the active profile).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct PlanStatus {
    /// Its name.
    pub name: String,
    /// `enforce`, or `shadow` when its limits are a dry run.
    pub mode: &'static str,
    /// Per caller and window, by class.
    pub classes: BTreeMap<String, u32>,
    /// Per IP and window, by ceiling.
    pub ip_ceilings: BTreeMap<String, u32>,
    /// Per window, by bucket (token budgets in tokens; money budgets are in
    /// `spend`).
    pub buckets: BTreeMap<String, u32>,
    /// Per calendar month, by money budget: US dollars, as text with two
    /// decimals (`"500.00"`).
    pub spend: BTreeMap<String, String>,
    /// Per calendar month, by capped quota family.
    pub quotas: BTreeMap<String, u32>,
    /// Per workspace in each lane: `<lane>.workspace_in_flight` and
    /// `<lane>.workspace_starts`.
    pub lanes: BTreeMap<String, u32>,
    /// The budgets whose limits the plan sets (the others are the profile's).
    pub overrides: Vec<String>,
}

/// What a workspace on `plan` (`None`: on none) gets under `p`'s active profile.
pub(crate) fn plan_status(p: &Policy, plan: Option<&sluice_policy::CustomerPlan>) -> PlanStatus {
    let limits = p.plan_limits(plan);
    let mut overrides = Vec::new();
    let mut table = |list: &mut dyn Iterator<Item = &sluice_policy::PlanLimit>| {
        list.map(|l| {
            if l.from_plan {
                overrides.push(l.name.clone());
            }
            (l.name.clone(), l.limit)
        })
        .collect::<BTreeMap<String, u32>>()
    };
    let classes = table(&mut limits.classes.iter());
    let ip_ceilings = table(&mut limits.ceilings.iter());
    let mut buckets = table(&mut limits.buckets.iter().map(|(l, _)| l));
    // A money budget's limit is in 1e-5 USD: told in dollars, apart.
    let spend = p
        .buckets
        .iter()
        .filter(|b| b.tokens.is_some_and(|t| t.priced))
        .filter_map(|b| {
            let units = buckets.remove(&b.name)?;
            let usd = f64::from(units) / sluice_policy::MONEY_UNITS_PER_USD as f64;
            Some((b.name.clone(), format!("{usd:.2}")))
        })
        .collect();
    let quotas = table(&mut limits.quotas.iter());
    let lanes = table(&mut limits.lanes.iter().flat_map(|(a, b)| [a, b]));
    PlanStatus {
        name: plan.map_or_else(String::new, |plan| plan.name.clone()),
        mode: match plan.map(|plan| plan.mode) {
            Some(sluice_policy::Enforcement::Shadow) => "shadow",
            _ => "enforce",
        },
        classes,
        ip_ceilings,
        buckets,
        spend,
        quotas,
        lanes,
        overrides,
    }
}

/// A per-route bucket of a [`Status`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct BucketLimit {
    /// Its name.
    pub name: String,
    /// Calls per window.
    pub limit: u32,
    /// Its window.
    pub window_seconds: u32,
}

/// A caller of a [`Status`]: who (never a credential), its workspace, what it spent.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct TopCaller {
    /// The caller as the status page names it.
    pub caller: String,
    /// Its workspace's label.
    pub workspace: String,
    /// Units it spent in the current window.
    pub units: u64,
}

impl<S: BudgetStore> Limiter<S> {
    /// Counts the refusals that budgets in shadow mode would have given a request
    /// that was admitted without them (`plan.shadowed`; `refused`: the decision
    /// with them), and logs each within the refusal log's bound.
    pub(super) fn record_shadow_refusals(&self, plan: &Plan, refused: &Decision, request_id: &str) {
        for i in Plan::indices(plan.shadowed) {
            let budget = plan.name(i, &self.policy);
            let reason = plan.refusal_reason(i, refused);
            self.count_shadow_refusal(budget, reason, || {
                tracing::info!(
                    target: "sluice::refusal",
                    request_id,
                    reason,
                    budget,
                    limit = refused.statuses().get(i).map_or(0, |s| s.limit),
                    class = self.policy.class_name(plan.top_class),
                    caller = %format_args!("{:016x}", plan.caller),
                    "shadow refusal: forwarded, the budget is in shadow mode"
                );
            });
        }
    }

    /// Counts a decision's outcome in the metrics and the status page.
    pub(super) fn record(&self, plan: &Plan, decision: &Result<Box<Decision>, StoreError>) {
        let top = plan.top_class.index();
        let (Some(counters), Some(counts)) = (
            self.metrics.decisions.get(top),
            self.counts.classes.get(top),
        ) else {
            return;
        };
        match decision {
            Ok(d) if d.is_admitted() => {
                let mut units = 0;
                for (i, (b, k)) in plan.budgets.iter().zip(&plan.kinds).enumerate() {
                    // A budget in shadow mode that would have refused spent nothing.
                    if plan.shadowed & (1 << i) != 0 {
                        continue;
                    }
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
                            if let Some(class) = self.counts.classes.get(c.index()) {
                                class.units.fetch_add(u64::from(b.cost), Ordering::Relaxed);
                            }
                        }
                        _ => {}
                    }
                }
                counters[0].increment(1);
                counts.admitted.fetch_add(1, Ordering::Relaxed);
                self.counts.fill(plan, d);
                self.count_near_limit(plan, d);
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
                // A run's pause is no rate limit: `sluice_run_turns_total` counts it.
                if crate::runs::paused(plan, d) {
                    return;
                }
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

    /// Counts each budget an admitted `decision` left past the policy's
    /// `near_limit_ratio` of its limit (SPEC O2): a class, a ceiling, a bucket
    /// or a capped quota, not a run's turns; a budget in shadow mode that would
    /// have refused spent nothing and is not counted.
    fn count_near_limit(&self, plan: &Plan, decision: &Decision) {
        let permille = u64::from(self.policy.near_limit_permille);
        for (i, (k, s)) in plan.kinds.iter().zip(decision.statuses()).enumerate() {
            let counted = matches!(
                k,
                BudgetKind::Class(_)
                    | BudgetKind::Ceiling(_)
                    | BudgetKind::Bucket(_)
                    | BudgetKind::Quota(_)
            );
            if !counted || s.limit == u32::MAX || plan.shadowed & (1 << i) != 0 {
                continue;
            }
            let used = u64::from(s.limit.saturating_sub(s.remaining));
            if used * 1000 < permille * u64::from(s.limit) {
                continue;
            }
            let budget = plan.name(i, &self.policy);
            if let Some(counter) = self.metrics.near_limit.get(budget) {
                counter.increment(1);
            }
            if let Some(n) = self.counts.near_limit.get(budget) {
                n.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// The counts since start that the dashboard shows (see [`Tally`]); the
    /// class fills are as of `now_secs` (Unix seconds).
    pub fn tally(&self, now_secs: u64) -> Tally {
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let classes = self
            .policy
            .class_ids()
            .zip(self.counts.classes.iter())
            .map(|(class, c)| {
                let fill = load(&c.fill);
                ClassTally {
                    class,
                    name: self.policy.class_name(class).to_owned(),
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
        let mut lane_refusals: Vec<(String, String, u64)> = self
            .counts
            .lane_refusals
            .lock()
            .iter()
            .filter_map(|(&(lane, reason), &n)| {
                let lane = self.policy.lanes.get(lane)?;
                Some((lane.name.clone(), lane.reason_name(reason).to_owned(), n))
            })
            .collect();
        lane_refusals.sort();
        let mut shadow_refusals: Vec<(String, &'static str, u64)> = self
            .counts
            .shadow_refusals
            .lock()
            .iter()
            .map(|((budget, reason), &n)| (budget.clone(), *reason, n))
            .collect();
        shadow_refusals.sort();
        let mut near_limit: Vec<(String, u64)> = self
            .counts
            .near_limit
            .iter()
            .map(|(b, n)| (b.clone(), load(n)))
            .filter(|(_, n)| *n > 0)
            .collect();
        near_limit.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        Tally {
            classes,
            refusals,
            lane_refusals,
            shadow_refusals,
            local_decisions: load(&self.counts.local),
            leases: self.leases.tally(),
            near_limit,
        }
    }

    /// What the workspace named `workspace` gets: its plan's limits over the
    /// profile's (`name` is its plan's, or empty on none).
    pub fn workspace_limits(&self, workspace: &str) -> PlanStatus {
        let p = &self.policy;
        plan_status(p, p.plan_of(sluice_policy::workspace_digest(workspace)))
    }

    /// A summary for `/status`: the policy's numbers and the callers that
    /// spent most in the current window.
    pub fn status(&self) -> Status {
        let p = &self.policy;
        let classes = p
            .class_ids()
            .map(|c| (p.class_name(c).to_owned(), p.profile.limit(c).get()))
            .collect();
        // The latest window any shard has seen is the current one; a shard still on
        // an older window has had no spend in this one.
        let shards: Vec<_> = self.top.iter().map(|shard| shard.lock()).collect();
        let window = shards.iter().map(|t| t.window).max().unwrap_or(0);
        let current = || shards.iter().filter(|t| t.window == window);
        let mut callers: Vec<TopCaller> = current()
            .flat_map(|t| t.spend.values())
            .map(|(who, workspace, units)| TopCaller {
                caller: who.to_string(),
                workspace: workspace.clone(),
                units: *units,
            })
            .collect();
        let others: u64 = current().map(|t| t.others).sum();
        callers.sort_by(|a, b| b.units.cmp(&a.units).then(a.caller.cmp(&b.caller)));
        callers.truncate(10);
        let near_limit = self
            .counts
            .near_limit
            .iter()
            .map(|(b, n)| (b.clone(), n.load(Ordering::Relaxed)))
            .filter(|(_, n)| *n > 0)
            .collect();
        Status {
            near_limit_ratio: f64::from(p.near_limit_permille) / 1000.0,
            near_limit,
            profile: p.profile_name.clone(),
            window_seconds: p.window.get(),
            classes,
            class_names: p.classes.iter().map(|c| c.name.clone()).collect(),
            ip_ceilings: p
                .ceilings
                .iter()
                .enumerate()
                .map(|(i, c)| (c.name.clone(), p.profile.ceiling(i).get()))
                .collect(),
            buckets: p
                .buckets
                .iter()
                .map(|b| BucketLimit {
                    name: b.name.clone(),
                    limit: b.limit.get(),
                    window_seconds: b.window.get(),
                })
                .collect(),
            routes: p.routes.len(),
            top_callers: callers,
            other_callers_units: others,
            store_degraded: self.is_degraded(),
            dry_run: p.dry_run,
            lanes: self.lanes.iter().map(crate::lane_status).collect(),
            plans: p
                .plans
                .iter()
                .map(|plan| plan_status(p, Some(plan)))
                .collect(),
            workspaces_on_plans: p.tenants.by_name.len(),
            domains: p
                .domains
                .iter()
                .map(|d| DomainStatus {
                    domain: d.name.clone(),
                    source: d.source.clone(),
                    outage: match d.outage {
                        sluice_policy::domains::DomainOutage::FailOpen => "fail_open",
                        sluice_policy::domains::DomainOutage::FailClosed => "fail_closed",
                    },
                    rules: d
                        .rules
                        .iter()
                        .map(|r| DomainRuleStatus {
                            id: r.id.clone(),
                            limit: (!r.unlimited).then_some(r.limit),
                            unit: r.unit.name(),
                            algorithm: r.algorithm.name(),
                            shadow: r.shadow,
                        })
                        .collect(),
                })
                .collect(),
        }
    }
}

/// The top-callers shard of `caller` (a hash already: its high bits pick).
pub(super) fn top_shard(caller: u64) -> usize {
    (caller >> 60) as usize % TOP_SHARDS
}

impl TopCallers {
    /// Adds `units` to `caller`'s spend in `window`; `workspace` (its label) is
    /// asked for only when the caller is new in the window.
    pub(super) fn record(
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
