//! Deciding a rate-limit service request (SPEC R1), free of its transport: a
//! domain and descriptors in, one status per descriptor and the overall code
//! out, decided by the policy's descriptor rules
//! ([`sluice_policy::domains`]) on the limiter's store.
//!
//! Every descriptor of one request is decided at once, all or nothing, in one
//! store decision (one round trip to Redis): a request one rule refuses spends
//! nothing anywhere (the reference service increments every descriptor even
//! when one refuses). Rules in shadow mode (`shadow_mode: true`, or every rule
//! in a dry run: `dry_run: true`, `--dry-run`) follow the gateway's one shadow
//! rule: decided and counted, never refusing; a request only they would
//! refuse is decided again without spending on them, answered `OK`, and each
//! would-be refusal counted (`sluice_shadow_refusals_total`) and logged.
//!
//! Bounds: the work is linear in the request. A transport takes at most
//! [`MAX_DESCRIPTORS`] descriptors of at most [`MAX_ENTRIES`] entries each
//! (the rate-limit service refuses a larger request before decoding it); every
//! descriptor taken is answered. At most [`MAX_COUNTED`] of them may be
//! counted (matched by a rule with a limit): a request with more is refused
//! whole (`OVER_LIMIT`, nothing spent), never decided in part.

use std::time::Duration;

use sluice_core::{Budget, BudgetKey, BudgetStatus, MAX_BUDGETS, Rate, Verdict, digest};
use sluice_policy::domains::{DescriptorRule, Domain, DomainOutage, Unit};
use sluice_store::BudgetStore;

use crate::Limiter;
use crate::limiter::{shadow_waived, waive};

/// Most descriptors of one request counted in the store (the most budgets one
/// decision holds).
pub const MAX_COUNTED: usize = MAX_BUDGETS;

/// Most descriptors of one request a transport takes: Envoy sends one per
/// `rate_limits` action list of a route, a handful.
pub const MAX_DESCRIPTORS: usize = 1_024;

/// Most entries of one descriptor a transport takes: a descriptor matches a
/// rule as many levels deep as it has entries, and a domain is at most
/// [`sluice_policy::domains::MAX_DESCRIPTOR_DEPTH`] levels deep.
pub const MAX_ENTRIES: usize = 64;

/// Longest metric label a `detailed_metric` rule makes from a request's values,
/// in bytes (longer ones are cut).
pub const MAX_LABEL: usize = 256;

/// One descriptor of a request: its entries (key, value), its own
/// `hits_addend` if it has one, and a limit override if the client sent one.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DescriptorCall {
    /// (key, value) entries, outermost first.
    pub entries: Vec<(String, String)>,
    /// Hits for this descriptor (instead of the request's).
    pub hits: Option<u32>,
    /// A limit the client names instead of the rule's: requests per unit.
    pub limit_override: Option<(u32, Unit)>,
}

/// A rate-limit service request.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RateLimitCall {
    /// Its domain.
    pub domain: String,
    /// Its descriptors.
    pub descriptors: Vec<DescriptorCall>,
    /// Hits each descriptor spends unless it says otherwise (0 means 1).
    pub hits_addend: u32,
}

/// A descriptor's or the request's answer code.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Code {
    /// Under the limit (or no limit).
    Ok,
    /// Over the limit.
    OverLimit,
}

/// The limit a descriptor was decided against.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CurrentLimit {
    /// The rule's `name`, if it has one.
    pub name: String,
    /// Requests per unit.
    pub requests_per_unit: u32,
    /// The unit.
    pub unit: Unit,
}

/// One descriptor's answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DescriptorStatus {
    /// Over or under.
    pub code: Code,
    /// The limit it was decided against (`None`: no rule matched).
    pub current_limit: Option<CurrentLimit>,
    /// Requests left in the current window (`u32::MAX` for an unlimited rule).
    pub limit_remaining: u32,
    /// Until the window ends (or the budget is whole again).
    pub duration_until_reset: Duration,
}

/// Why a request was answered without a store decision, or how it went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Decided by the store.
    Decided,
    /// Nothing to count: no rule matched, or only unlimited ones.
    NothingCounted,
    /// The domain is not in the policy (answered `OK`, as Envoy expects).
    UnknownDomain,
    /// More descriptors to count than one decision holds: refused whole.
    TooManyCounted,
    /// The store could not decide; the domain's outage rule answered.
    Outage,
    /// A descriptor's key or value is not UTF-8: refused whole, nothing
    /// counted (see [`Limiter::refuse_not_utf8`]).
    NotUtf8,
}

/// The answer to a [`RateLimitCall`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RateLimitAnswer {
    /// `OverLimit` when any enforced descriptor is over its limit.
    pub overall: Code,
    /// One status per descriptor, in the request's order.
    pub statuses: Vec<DescriptorStatus>,
    /// `X-RateLimit-Limit`, `-Remaining` and `-Reset` of the most constrained
    /// descriptor counted, for Envoy to add to the response.
    pub headers: Vec<(&'static str, String)>,
    /// How it was decided.
    pub outcome: Outcome,
    /// Rules in shadow mode (or all, in a dry run) that would have refused an
    /// admitted request (their ids): counted and logged as the gateway's
    /// budgets are (`sluice_shadow_refusals_total`), by the engine.
    pub shadow_refusals: Vec<String>,
    /// For each descriptor, the rule it was decided by, as metrics name it: the
    /// rule's id, with the request's values for a rule with `detailed_metric`.
    pub rules: Vec<Option<String>>,
}

/// A descriptor matched to a rule to count.
struct Counted<'d> {
    /// Which descriptors of the request (more than one when they name one counter).
    descriptors: Vec<usize>,
    rule: &'d DescriptorRule,
    limit: u32,
    unit: Unit,
    budget: Budget,
    /// Decided in shadow mode: never refuses (its rule's, unless overridden, or a dry run).
    shadow: bool,
}

fn ok_status() -> DescriptorStatus {
    DescriptorStatus {
        code: Code::Ok,
        current_limit: None,
        limit_remaining: 0,
        duration_until_reset: Duration::ZERO,
    }
}

/// A counted descriptor's status in a request refused whole for counting
/// more than one decision holds.
fn too_many_status(rule: &DescriptorRule, limit: u32, unit: Unit) -> DescriptorStatus {
    DescriptorStatus {
        code: Code::OverLimit,
        current_limit: Some(current(rule, limit, unit)),
        limit_remaining: 0,
        duration_until_reset: Duration::ZERO,
    }
}

fn current(rule: &DescriptorRule, limit: u32, unit: Unit) -> CurrentLimit {
    CurrentLimit {
        name: rule.name.clone().unwrap_or_default(),
        requests_per_unit: limit,
        unit,
    }
}

/// What counts a descriptor whose `limit` override matches no rule of its
/// (known) domain: as Envoy's reference service does, the override is the
/// rule, counted by the descriptor's entries and unit, never in shadow mode.
/// Its id is empty, as no rule of a policy's is.
static LIMIT_OVERRIDE: std::sync::LazyLock<DescriptorRule> =
    std::sync::LazyLock::new(|| DescriptorRule {
        id: String::new(),
        name: Some("limit_override".to_owned()),
        limit: 0,
        unit: Unit::Second,
        algorithm: sluice_policy::Algorithm::Fixed,
        unlimited: false,
        consistency: sluice_policy::Consistency::Exact,
        shadow: false,
        detailed_metric: false,
        replaces: Vec::new(),
    });

/// The budget of `rule` matched by `call` (the request's values at each level
/// name its counter), with `limit` per `unit` and `hits` to spend.
fn budget(
    domain: &Domain,
    rule: &DescriptorRule,
    call: &DescriptorCall,
    limit: u32,
    unit: Unit,
    hits: u32,
) -> Option<Budget> {
    let mut scope = Vec::with_capacity(64);
    scope.extend_from_slice(b"rls\0");
    scope.extend_from_slice(domain.name.as_bytes());
    scope.push(0);
    scope.extend_from_slice(rule.id.as_bytes());
    if call.limit_override.is_some() {
        scope.extend_from_slice(format!("\0override:{limit}/{}", unit.name()).as_bytes());
    }
    let mut subject = Vec::with_capacity(64);
    for (key, value) in &call.entries {
        subject.extend_from_slice(key.as_bytes());
        subject.push(0);
        subject.extend_from_slice(value.as_bytes());
        subject.push(0);
    }
    let rate = if call.limit_override.is_some() {
        let limit = std::num::NonZeroU32::new(limit)?;
        match unit {
            Unit::Month => Rate::CalendarMonth,
            _ => rule
                .algorithm
                .rate(std::num::NonZeroU32::new(unit.seconds())?, limit),
        }
    } else {
        rule.rate()?
    };
    Some(Budget {
        key: BudgetKey::from_digests(digest(&scope), digest(&subject)),
        rate,
        limit,
        cost: hits,
    })
}

/// The IETF draft's `RateLimit-Policy` and `RateLimit` fields over every
/// descriptor counted, named by rule (as the gateway names its budgets).
fn ietf_fields(
    counted: &[Counted<'_>],
    statuses: &[BudgetStatus],
    now: u64,
) -> [(&'static str, String); 2] {
    let mut policy = String::new();
    let mut state = String::new();
    for (i, (c, s)) in counted.iter().zip(statuses).enumerate() {
        let sep = if i == 0 { "" } else { ", " };
        let name = c.rule.id.replace(['"', '\\'], "_");
        let window = c.unit.seconds();
        policy.push_str(&format!("{sep}\"{name}\";q={};w={window}", c.limit));
        let wait = s.retry_after().map_or(window.into(), |d| d.as_secs());
        let t = wait.max(s.reset.saturating_sub(now));
        state.push_str(&format!("{sep}\"{name}\";r={};t={t}", s.remaining));
    }
    [("ratelimit-policy", policy), ("ratelimit", state)]
}

fn status_of(
    s: &BudgetStatus,
    now_secs: u64,
    rule: &DescriptorRule,
    limit: u32,
    unit: Unit,
) -> DescriptorStatus {
    DescriptorStatus {
        code: if s.verdict == Verdict::Admitted {
            Code::Ok
        } else {
            Code::OverLimit
        },
        current_limit: Some(current(rule, limit, unit)),
        limit_remaining: s.remaining,
        duration_until_reset: Duration::from_secs(s.reset.saturating_sub(now_secs)),
    }
}

/// A request's descriptors planned (the rate-limit service's phase 3): the
/// budgets they count, the refusals rules in shadow mode gave before anything
/// was counted (a rule of 0), and whether there was more to count than one
/// decision holds.
struct DescriptorPlan<'d> {
    counted: Vec<Counted<'d>>,
    /// Refusals rules in shadow mode would have given: (rule, limit, reason).
    would_have: Vec<(&'d DescriptorRule, u32, &'static str)>,
    too_many: bool,
}

/// Each descriptor of `call` with entries, and the index of the rule it matches
/// in `domain`, but those a matched rule replaces (sorted: each look-up a binary
/// search, so the work stays linear).
fn matched_rules(domain: &Domain, call: &RateLimitCall) -> Vec<(usize, usize)> {
    // One buffer of entries for all.
    let mut matched: Vec<(usize, usize)> = Vec::new();
    let mut entries: Vec<(&str, &str)> = Vec::new();
    for (i, d) in call.descriptors.iter().enumerate() {
        if d.entries.is_empty() {
            continue;
        }
        entries.clear();
        entries.extend(d.entries.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        if let Some(rule) = domain.lookup(&entries).and_then(|n| n.rule) {
            matched.push((i, rule));
        }
    }
    let mut replaced: Vec<usize> = matched
        .iter()
        .filter_map(|&(_, r)| domain.rules.get(r))
        .flat_map(|r| r.replaces.iter().copied())
        .collect();
    replaced.sort_unstable();
    replaced.dedup();
    matched.retain(|(_, rule)| replaced.binary_search(rule).is_err());
    matched
}

/// How metrics name the rule a descriptor was decided by: its id, with the
/// descriptor's values for a rule with `detailed_metric` (at most
/// [`MAX_LABEL`] bytes of the client's values).
fn rule_label(rule: &DescriptorRule, descriptor: &DescriptorCall) -> String {
    if rule.id.is_empty() {
        // The limit override where no rule matched ([`LIMIT_OVERRIDE`]).
        return rule.name.clone().unwrap_or_default();
    }
    if !rule.detailed_metric {
        return rule.id.clone();
    }
    let values: Vec<&str> = descriptor.entries.iter().map(|(_, v)| v.as_str()).collect();
    let mut label = format!("{}:{}", rule.id, values.join("."));
    if label.len() > MAX_LABEL {
        let mut end = MAX_LABEL;
        while !label.is_char_boundary(end) {
            end -= 1;
        }
        label.truncate(end);
    }
    label
}

impl<S: BudgetStore> Limiter<S> {
    /// Decides a rate-limit service request (see the module docs): its domain
    /// and descriptors are its head, planned into budgets by the domain's rules,
    /// then decided all or nothing by the one shadow rule every transport shares.
    pub async fn should_rate_limit(&self, call: &RateLimitCall) -> RateLimitAnswer {
        let mut answer = RateLimitAnswer {
            overall: Code::Ok,
            statuses: vec![ok_status(); call.descriptors.len()],
            headers: Vec::new(),
            outcome: Outcome::NothingCounted,
            shadow_refusals: Vec::new(),
            rules: vec![None; call.descriptors.len()],
        };
        let Some(domain) = self.policy().domains.iter().find(|d| d.name == call.domain) else {
            answer.outcome = Outcome::UnknownDomain;
            return answer;
        };
        let plan = self.plan_descriptors(domain, call, &mut answer);
        if plan.too_many {
            // More to count than one decision holds: refused whole, in a dry
            // run too (it cannot be counted), nothing spent.
            answer.outcome = Outcome::TooManyCounted;
            answer.overall = Code::OverLimit;
            for c in &plan.counted {
                for &i in &c.descriptors {
                    answer.statuses[i] = too_many_status(c.rule, c.limit, c.unit);
                }
            }
            return answer;
        }
        if answer.overall == Code::OverLimit {
            // A rule of 0 refused: nothing is spent for the others either.
            self.fill_peeked(&mut answer, &plan.counted).await;
            return answer;
        }
        if plan.counted.is_empty() {
            self.count_shadow_refusals(domain, &plan.would_have, &mut answer);
            return answer;
        }
        answer.outcome = Outcome::Decided;
        // Decided here, not in a function of its own: one future for the request,
        // as small as one decision's.
        // On the heap: the request's future stays small (it is moved whole).
        let mut budgets: Vec<Budget> = plan.counted.iter().map(|c| c.budget).collect();
        let leases: arrayvec::ArrayVec<Option<sluice_core::LeaseTerms>, MAX_BUDGETS> = plan
            .counted
            .iter()
            .map(|c| c.rule.consistency.lease())
            .collect();
        let mut decision = match self.decide_rules(&leases, &budgets).await {
            Ok(d) => d,
            Err(error) => return self.outage(answer, domain, &error.to_string()),
        };
        // The gateway's shadow rule: rules in shadow mode never refuse. What
        // they refused is decided again with them spending nothing.
        let shadow = plan
            .counted
            .iter()
            .enumerate()
            .filter(|(_, c)| c.shadow)
            .fold(0_u16, |mask, (i, _)| mask | 1 << i);
        let waived = shadow_waived(&decision, shadow, || 0);
        let mut refused = None;
        if waived != 0 {
            // Seldom: the refusal waits on the heap, so that every request's
            // future stays as small as one decision's.
            let first = Box::new(decision);
            waive(&mut budgets, waived);
            decision = match self.decide_rules(&leases, &budgets).await {
                Ok(d) => d,
                Err(error) => return self.outage(answer, domain, &error.to_string()),
            };
            refused = Some((first, waived));
        }
        self.describe_decision(domain, plan, &decision, refused.as_ref(), &mut answer);
        answer
    }

    /// The answer to a request of `descriptors` descriptors in `domain` of which
    /// a key or value is not UTF-8, which no rule can be matched against: refused
    /// whole (`OVER_LIMIT`, every descriptor with it), nothing counted, whatever
    /// the domain, its rules or a dry run say, and logged under
    /// `sluice::refusal` within the refusal log's bound. The reference service
    /// cannot read such a request either (its decoder fails it with `INTERNAL`),
    /// and an error is what Envoy's `failure_mode_deny: false` lets through: a
    /// client whose header bytes reach a descriptor would skip every rule.
    pub fn refuse_not_utf8(&self, domain: &str, descriptors: usize) -> RateLimitAnswer {
        let known = self.policy().domains.iter().any(|d| d.name == domain);
        crate::refusal_log::refusal_line(self.refusal_log(), || {
            tracing::info!(
                target: "sluice::refusal",
                reason = "not_utf8",
                // The client's name of a domain the policy lacks is not logged.
                domain = if known { domain } else { "unknown" },
                descriptors,
                "refused: a descriptor key or value of a rate-limit service request is not UTF-8"
            );
        });
        let refused = DescriptorStatus {
            code: Code::OverLimit,
            ..ok_status()
        };
        RateLimitAnswer {
            overall: Code::OverLimit,
            statuses: vec![refused; descriptors],
            headers: Vec::new(),
            outcome: Outcome::NotUtf8,
            shadow_refusals: Vec::new(),
            rules: vec![None; descriptors],
        }
    }

    /// Decides the counted rules' `budgets` all or nothing: from leases where
    /// their rules are leased (`leases`, one for each) and the store takes them,
    /// else on the store (SPEC D4).
    async fn decide_rules(
        &self,
        leases: &[Option<sluice_core::LeaseTerms>],
        budgets: &[Budget],
    ) -> Result<sluice_core::Decision, sluice_store::StoreError> {
        if leases.iter().any(Option::is_some) {
            // On the heap: an exact rule's request future stays as small as
            // one store decision's.
            if let Some(decided) = Box::pin(self.decide_by_leases(leases, budgets, None)).await {
                return decided.map(|d| *d);
            }
        }
        self.store().decide(budgets).await
    }

    /// True when `rule` decides in shadow mode: its own `shadow_mode`, or every
    /// rule in a dry run (as every budget). A descriptor's `limit` override is
    /// never in its rule's shadow mode (`overridden`): as in the reference
    /// service, the override is the limit before any rule is looked at.
    fn in_shadow(&self, rule: &DescriptorRule, overridden: bool) -> bool {
        (rule.shadow && !overridden) || self.policy().dry_run
    }

    /// Plans `call`'s descriptors in `domain`: what each counts, one budget per
    /// counter (the same counter named twice spends both hits on one budget),
    /// with the answer for those decided without counting (unlimited rules,
    /// rules of 0, descriptors past [`MAX_COUNTED`] counters) written in
    /// `answer`.
    fn plan_descriptors<'d>(
        &'d self,
        domain: &'d Domain,
        call: &RateLimitCall,
        answer: &mut RateLimitAnswer,
    ) -> DescriptorPlan<'d> {
        let mut plan = DescriptorPlan {
            counted: Vec::new(),
            would_have: Vec::new(),
            too_many: false,
        };
        let matched = matched_rules(domain, call);
        let overridden = call.descriptors.iter().enumerate().filter(|(i, d)| {
            d.limit_override.is_some()
                && !d.entries.is_empty()
                && !matched.iter().any(|(m, _)| m == i)
        });
        let rules = matched
            .iter()
            .filter_map(|&(i, index)| Some((i, domain.rules.get(index)?)))
            .chain(overridden.map(|(i, _)| (i, &*LIMIT_OVERRIDE)));
        for (i, rule) in rules {
            let Some(d) = call.descriptors.get(i) else {
                continue;
            };
            answer.rules[i] = Some(rule_label(rule, d));
            let (limit, unit) = d.limit_override.unwrap_or((rule.limit, rule.unit));
            // The reference service (config_impl.go, GetLimit) takes a
            // descriptor's override as its limit before it looks for a rule: an
            // override is enforced whatever the rule says, neither unlimited
            // nor in the rule's shadow mode.
            let overridden = d.limit_override.is_some();
            let shadow = self.in_shadow(rule, overridden);
            if rule.unlimited && !overridden {
                answer.statuses[i] = DescriptorStatus {
                    code: Code::Ok,
                    current_limit: None,
                    limit_remaining: u32::MAX,
                    duration_until_reset: Duration::ZERO,
                };
                continue;
            }
            if limit == 0 {
                // 0 per unit refuses every request, counted nowhere.
                answer.statuses[i] = DescriptorStatus {
                    code: if shadow { Code::Ok } else { Code::OverLimit },
                    current_limit: Some(current(rule, 0, unit)),
                    limit_remaining: 0,
                    duration_until_reset: Duration::from_secs(u64::from(unit.seconds())),
                };
                if shadow {
                    plan.would_have.push((rule, 0, crate::COST_EXCEEDS_LIMIT));
                } else {
                    answer.overall = Code::OverLimit;
                }
                continue;
            }
            if plan.too_many {
                // Refused whole; no counter to look for.
                answer.statuses[i] = too_many_status(rule, limit, unit);
                continue;
            }
            let hits = d.hits.unwrap_or(call.hits_addend.max(1));
            let Some(budget) = budget(domain, rule, d, limit, unit, hits) else {
                continue;
            };
            // The same counter twice in one request: one budget spending both
            // (a look among at most MAX_COUNTED).
            if let Some(same) = plan.counted.iter_mut().find(|c| {
                c.budget.key == budget.key && c.budget.rate == budget.rate && c.limit == limit
            }) {
                same.budget.cost = same.budget.cost.saturating_add(hits);
                same.descriptors.push(i);
                continue;
            }
            if plan.counted.len() == MAX_COUNTED {
                plan.too_many = true;
                answer.statuses[i] = too_many_status(rule, limit, unit);
                continue;
            }
            plan.counted.push(Counted {
                descriptors: vec![i],
                rule,
                limit,
                unit,
                budget,
                shadow,
            });
        }
        plan
    }

    /// Writes the decision of the planned budgets into `answer`: each
    /// descriptor's status (a rule in shadow mode never over the limit), the
    /// refusals rules in shadow mode would have given (`refused`: the decision
    /// they refused, and which budgets were waived), and the `X-RateLimit-*`
    /// fields of the tightest budget.
    fn describe_decision(
        &self,
        domain: &Domain,
        mut plan: DescriptorPlan<'_>,
        decision: &sluice_core::Decision,
        refused: Option<&(Box<sluice_core::Decision>, u16)>,
        answer: &mut RateLimitAnswer,
    ) {
        let counted = &plan.counted;
        let now = decision.decided_at().as_secs();
        let mut tightest: Option<(u32, u32, u64)> = None;
        for (c, s) in counted.iter().zip(decision.statuses()) {
            let mut status = status_of(s, now, c.rule, c.limit, c.unit);
            if c.shadow && status.code == Code::OverLimit {
                status.code = Code::Ok;
            }
            if status.code == Code::OverLimit {
                answer.overall = Code::OverLimit;
            }
            // Rules in shadow mode are still described, as the gateway's budgets.
            if tightest.is_none_or(|(_, r, _)| s.remaining < r) {
                tightest = Some((c.limit, s.remaining, s.reset));
            }
            for &i in &c.descriptors {
                answer.statuses[i] = status.clone();
            }
        }
        if answer.overall == Code::Ok {
            // Admitted: what the rules in shadow mode would have refused is counted.
            if let Some((refused, waived)) = refused {
                for (i, (c, s)) in counted.iter().zip(refused.statuses()).enumerate() {
                    if waived & (1 << i) != 0 {
                        let reason = if s.verdict == Verdict::Never {
                            crate::COST_EXCEEDS_LIMIT
                        } else {
                            "rate_limited"
                        };
                        plan.would_have.push((c.rule, c.limit, reason));
                    }
                }
            }
            self.count_shadow_refusals(domain, &plan.would_have, answer);
        }
        if let Some((limit, remaining, reset)) = tightest {
            // As the gateway's: the reset in Unix seconds (SPEC H1).
            answer.headers = vec![
                ("x-ratelimit-limit", limit.to_string()),
                ("x-ratelimit-remaining", remaining.to_string()),
                ("x-ratelimit-reset", reset.to_string()),
            ];
            if self.policy().ietf_headers {
                answer
                    .headers
                    .extend(ietf_fields(&plan.counted, decision.statuses(), now));
            }
        }
    }

    /// Counts and logs the refusals that rules in shadow mode would have given
    /// an admitted request (`would_have`: rule, limit, reason), as the
    /// gateway's are counted (`sluice_shadow_refusals_total{budget="<domain>.<rule>",reason}`),
    /// and names them in `answer`.
    fn count_shadow_refusals(
        &self,
        domain: &Domain,
        would_have: &[(&DescriptorRule, u32, &'static str)],
        answer: &mut RateLimitAnswer,
    ) {
        for &(rule, limit, reason) in would_have {
            let budget = format!("{}.{}", domain.name, rule.id);
            self.count_shadow_refusal(&budget, reason, || {
                tracing::info!(
                    target: "sluice::refusal",
                    reason,
                    budget,
                    limit,
                    "shadow refusal: answered OK, the rule is in shadow mode"
                );
            });
            answer.shadow_refusals.push(rule.id.clone());
        }
    }

    /// Fills the statuses of `counted` as the books stand, spending nothing.
    async fn fill_peeked(&self, answer: &mut RateLimitAnswer, counted: &[Counted<'_>]) {
        if counted.is_empty() || counted.len() > MAX_COUNTED {
            return;
        }
        let budgets: Vec<Budget> = counted
            .iter()
            .map(|c| Budget {
                cost: 0,
                ..c.budget
            })
            .collect();
        if let Ok(decision) = self.store().peek(&budgets).await {
            let now = decision.decided_at().as_secs();
            for (c, s) in counted.iter().zip(decision.statuses()) {
                for &i in &c.descriptors {
                    answer.statuses[i] = status_of(s, now, c.rule, c.limit, c.unit);
                }
            }
        }
        answer.outcome = Outcome::Decided;
    }

    /// The answer while the store cannot decide, by the domain's outage rule.
    fn outage(&self, mut answer: RateLimitAnswer, domain: &Domain, error: &str) -> RateLimitAnswer {
        answer.outcome = Outcome::Outage;
        tracing::warn!(
            target: "sluice::refusal",
            domain = %domain.name,
            error,
            outage = match domain.outage { DomainOutage::FailOpen => "fail_open", DomainOutage::FailClosed => "fail_closed" },
            "the store could not decide a rate-limit service request"
        );
        if domain.outage == DomainOutage::FailClosed {
            answer.overall = Code::OverLimit;
            for s in &mut answer.statuses {
                s.code = Code::OverLimit;
            }
        }
        answer
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_core::{FakeClock, Timestamp};
    use sluice_store::{MemoryConfig, MemoryStore};

    /// 2025-11-30T00:00:00Z, the start of a minute.
    const T0: u64 = 1_764_460_800;

    /// The built-in policy with `domains` added, its clock inside one minute.
    fn limiter(domains: &str, dry_run: bool) -> Limiter<MemoryStore<FakeClock>> {
        let yaml = sluice_policy::DEFAULT_POLICY_YAML.replacen(
            "headers:\n",
            &format!("{domains}headers:\n"),
            1,
        );
        let mut policy = sluice_policy::parse_str(&yaml, std::path::Path::new("rls.yaml"))
            .unwrap_or_else(|e| panic!("{e}"));
        policy.dry_run = dry_run;
        let clock = FakeClock::new(Timestamp::from_secs(T0 + 1));
        Limiter::new(
            policy,
            MemoryStore::with_clock(MemoryConfig::default(), clock),
        )
    }

    const API: &str = "domains:
  - domain: api
    descriptors:
      - key: user
        rate_limit: { unit: minute, requests_per_unit: 5 }
      - key: trial
        rate_limit: { unit: minute, requests_per_unit: 1 }
        shadow_mode: true
      - key: closed
        rate_limit: { unit: minute, requests_per_unit: 0 }
";

    fn call(descriptors: &[&[(&str, &str)]]) -> RateLimitCall {
        RateLimitCall {
            domain: "api".to_owned(),
            descriptors: descriptors
                .iter()
                .map(|d| DescriptorCall {
                    entries: d
                        .iter()
                        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                        .collect(),
                    ..DescriptorCall::default()
                })
                .collect(),
            hits_addend: 0,
        }
    }

    /// R1, as Envoy's reference service: a descriptor carrying a `limit`
    /// override is counted by it in a known domain even when no rule of the
    /// domain matches its entries (it was answered OK, counting nothing), by
    /// its entries and unit; an unknown domain still counts nothing.
    #[tokio::test]
    async fn r1_a_limit_override_counts_where_no_rule_matches() {
        let limiter = limiter(API, false);
        let with_override = |domain: &str| {
            let mut c = call(&[&[("tenant", "acme")]]);
            c.domain = domain.to_owned();
            c.descriptors[0].limit_override = Some((3, Unit::Minute));
            c
        };
        let mut codes = Vec::new();
        for _ in 0..5 {
            codes.push(
                limiter
                    .should_rate_limit(&with_override("api"))
                    .await
                    .overall,
            );
        }
        assert_eq!(
            codes,
            [
                Code::Ok,
                Code::Ok,
                Code::Ok,
                Code::OverLimit,
                Code::OverLimit
            ]
        );
        let answer = limiter.should_rate_limit(&with_override("api")).await;
        let limit = answer.statuses[0].current_limit.as_ref().expect("a limit");
        assert_eq!((limit.requests_per_unit, limit.unit), (3, Unit::Minute));
        // Another tenant's entries are another counter.
        let mut other = with_override("api");
        other.descriptors[0].entries[0].1 = "globex".to_owned();
        assert_eq!(limiter.should_rate_limit(&other).await.overall, Code::Ok);
        for _ in 0..5 {
            assert_eq!(
                limiter
                    .should_rate_limit(&with_override("nowhere"))
                    .await
                    .overall,
                Code::Ok,
                "an unknown domain"
            );
        }
    }

    /// R1, as envoyproxy/ratelimit (`GetLimit` takes a descriptor's `limit`
    /// override before any rule): an override on an `unlimited` rule or one in
    /// `shadow_mode` is enforced as its limit (it was ignored: always `OK`);
    /// without one those rules answer as before; a dry run still refuses
    /// nothing.
    #[tokio::test]
    async fn r1_a_limit_override_is_enforced_on_unlimited_and_shadow_rules() {
        const RULES: &str = "domains:
  - domain: api
    descriptors:
      - key: unl
        rate_limit: { unlimited: true }
      - key: sh
        rate_limit: { unit: minute, requests_per_unit: 1 }
        shadow_mode: true
";
        /// Three calls of `key` with `limit`: their codes.
        async fn codes(
            limiter: &Limiter<MemoryStore<FakeClock>>,
            key: &str,
            limit: Option<(u32, Unit)>,
        ) -> Vec<Code> {
            let mut c = call(&[&[(key, "probe")]]);
            c.descriptors[0].limit_override = limit;
            let mut codes = Vec::new();
            for _ in 0..3 {
                codes.push(limiter.should_rate_limit(&c).await.overall);
            }
            codes
        }
        let enforced = limiter(RULES, false);
        for key in ["unl", "sh"] {
            assert_eq!(
                codes(&enforced, key, Some((2, Unit::Hour))).await,
                [Code::Ok, Code::Ok, Code::OverLimit],
                "{key}"
            );
            let mut c = call(&[&[(key, "probe")]]);
            c.descriptors[0].limit_override = Some((2, Unit::Hour));
            let answer = enforced.should_rate_limit(&c).await;
            let limit = answer.statuses[0].current_limit.as_ref().expect("a limit");
            assert_eq!((limit.requests_per_unit, limit.unit), (2, Unit::Hour));
            assert!(
                answer.shadow_refusals.is_empty(),
                "{key}: enforced, not shadowed"
            );
            assert_eq!(codes(&enforced, key, None).await, [Code::Ok; 3], "{key}");
        }
        let dry = limiter(RULES, true);
        for key in ["unl", "sh"] {
            assert_eq!(
                codes(&dry, key, Some((2, Unit::Hour))).await,
                [Code::Ok; 3],
                "{key} in a dry run"
            );
        }
    }

    /// P5 and R1: in a dry run the rate-limit service refuses nothing, as the
    /// gateway: every would-be refusal counted under the gateway's metric and
    /// tally, and the headers still describing the rule.
    #[tokio::test]
    async fn p5_r1_a_dry_run_answers_ok_and_counts_each_would_be_refusal() {
        let enforced = limiter(API, false);
        let user = call(&[&[("user", "ada")]]);
        let mut codes = Vec::new();
        for _ in 0..8 {
            codes.push(enforced.should_rate_limit(&user).await.overall);
        }
        assert_eq!(codes.iter().filter(|&&c| c == Code::OverLimit).count(), 3);

        let dry = limiter(API, true);
        for n in 1..=8_u32 {
            let answer = dry.should_rate_limit(&user).await;
            assert_eq!(answer.overall, Code::Ok, "call {n}");
            assert_eq!(answer.statuses[0].code, Code::Ok, "call {n}");
            let remaining = answer
                .headers
                .iter()
                .find(|(k, _)| *k == "x-ratelimit-remaining")
                .map(|(_, v)| v.clone());
            assert_eq!(
                remaining.as_deref(),
                Some(if n <= 5 {
                    ["4", "3", "2", "1", "0"][n as usize - 1]
                } else {
                    "0"
                }),
                "the headers still describe the rule"
            );
        }
        let closed = dry.should_rate_limit(&call(&[&[("closed", "x")]])).await;
        assert_eq!(closed.overall, Code::Ok, "a rule of 0, in a dry run");
        assert_eq!(
            dry.tally(T0 + 1).shadow_refusals,
            [
                ("api.closed".to_owned(), crate::COST_EXCEEDS_LIMIT, 1),
                ("api.user".to_owned(), "rate_limited", 3),
            ]
        );
        assert!(dry.tally(T0 + 1).refusals.is_empty());
    }

    /// P5: a rule in shadow mode beside an enforced one that refuses is not
    /// counted as a shadow refusal (the request was refused), and a request it
    /// alone would refuse spends on the others.
    #[tokio::test]
    async fn p5_a_shadow_rule_is_counted_only_when_the_request_is_admitted() {
        let limiter = limiter(API, false);
        let both = call(&[&[("user", "bo")], &[("trial", "t")]]);
        for _ in 0..5 {
            assert_eq!(limiter.should_rate_limit(&both).await.overall, Code::Ok);
        }
        let refused = limiter.should_rate_limit(&both).await;
        assert_eq!(refused.overall, Code::OverLimit);
        assert_eq!(refused.statuses[1].code, Code::Ok, "shadow: never over");
        assert_eq!(
            limiter.tally(T0 + 1).shadow_refusals,
            [("api.trial".to_owned(), "rate_limited", 4)],
            "calls 2 to 5 admitted past the trial's 1; the 6th refused by the user's"
        );
    }

    /// R1 bounds: the work is linear in the request: 100,000 distinct values of
    /// one rule (a quadratic look for a shared counter took seconds in a
    /// release build) are answered at once, refused whole, nothing spent.
    #[tokio::test]
    async fn r1_many_distinct_descriptors_of_one_rule_are_answered_in_linear_time() {
        let limiter = limiter(API, false);
        let values: Vec<String> = (0..100_000).map(|i| format!("u{i}")).collect();
        let many = RateLimitCall {
            domain: "api".to_owned(),
            descriptors: values
                .iter()
                .map(|v| DescriptorCall {
                    entries: vec![("user".to_owned(), v.clone())],
                    ..DescriptorCall::default()
                })
                .collect(),
            hits_addend: 1,
        };
        let started = std::time::Instant::now();
        let answer = limiter.should_rate_limit(&many).await;
        let took = started.elapsed();
        assert_eq!(answer.outcome, Outcome::TooManyCounted);
        assert_eq!(answer.statuses.len(), 100_000);
        assert!(answer.statuses.iter().all(|s| s.code == Code::OverLimit));
        // Generous for a debug build on a loaded machine: linear work takes a
        // small part of it, the quadratic one minutes.
        assert!(took < std::time::Duration::from_secs(10), "{took:?}");
        let one = limiter.should_rate_limit(&call(&[&[("user", "u0")]])).await;
        assert_eq!(one.statuses[0].limit_remaining, 4, "nothing was spent");
    }
}
