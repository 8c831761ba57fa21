//! Deciding a rate-limit service request (SPEC R1), free of its transport: a
//! domain and descriptors in, one status per descriptor and the overall code
//! out, decided by the policy's descriptor rules
//! ([`sluice_policy::domains`]) on the limiter's store.
//!
//! Every descriptor of one request is decided at once, all or nothing, in one
//! store decision (one round trip to Redis): a request one rule refuses spends
//! nothing anywhere (the reference service increments every descriptor even
//! when one refuses). A rule in shadow mode is decided and counted; when it
//! alone would refuse, the request is decided again without spending on it,
//! answered `OK`, and the would-be refusal counted.
//!
//! Bounds: a request's descriptors are all answered, however many; at most
//! [`MAX_COUNTED`] of them may be counted (matched by a rule with a limit),
//! and a request with more is refused whole (`OVER_LIMIT`, nothing spent),
//! never decided in part.

use std::time::Duration;

use sluice_core::{Budget, BudgetKey, BudgetStatus, MAX_BUDGETS, Rate, Verdict, digest};
use sluice_policy::domains::{DescriptorRule, Domain, DomainOutage, Unit};
use sluice_store::BudgetStore;

use crate::Limiter;

/// Most descriptors of one request counted in the store (the most budgets one
/// decision holds).
pub const MAX_COUNTED: usize = MAX_BUDGETS;

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
    /// Rules in shadow mode that would have refused (their ids).
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
}

fn ok_status() -> DescriptorStatus {
    DescriptorStatus {
        code: Code::Ok,
        current_limit: None,
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

impl<S: BudgetStore> Limiter<S> {
    /// Decides a rate-limit service request (see the module docs).
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
        // Match each descriptor to its rule.
        let mut matched: Vec<(usize, usize)> = Vec::new();
        for (i, d) in call.descriptors.iter().enumerate() {
            let entries: Vec<(&str, &str)> = d
                .entries
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            if entries.is_empty() {
                continue;
            }
            if let Some(rule) = domain.lookup(&entries).and_then(|n| n.rule) {
                matched.push((i, rule));
            }
        }
        // A rule another matched rule replaces does not apply to this request.
        let replaced: Vec<usize> = matched
            .iter()
            .filter_map(|&(_, r)| domain.rules.get(r))
            .flat_map(|r| r.replaces.iter().copied())
            .collect();
        let mut counted: Vec<Counted<'_>> = Vec::new();
        for (i, index) in matched {
            let Some(rule) = domain.rules.get(index) else {
                continue;
            };
            if replaced.contains(&index) {
                continue;
            }
            let Some(d) = call.descriptors.get(i) else {
                continue;
            };
            answer.rules[i] = Some(if rule.detailed_metric {
                let values: Vec<&str> = d.entries.iter().map(|(_, v)| v.as_str()).collect();
                let mut label = format!("{}:{}", rule.id, values.join("."));
                // A label holds at most MAX_LABEL bytes of the client's values.
                if label.len() > MAX_LABEL {
                    let mut end = MAX_LABEL;
                    while !label.is_char_boundary(end) {
                        end -= 1;
                    }
                    label.truncate(end);
                }
                label
            } else {
                rule.id.clone()
            });
            let (limit, unit) = d.limit_override.unwrap_or((rule.limit, rule.unit));
            if rule.unlimited {
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
                    code: if rule.shadow {
                        Code::Ok
                    } else {
                        Code::OverLimit
                    },
                    current_limit: Some(current(rule, 0, unit)),
                    limit_remaining: 0,
                    duration_until_reset: Duration::from_secs(u64::from(unit.seconds())),
                };
                if rule.shadow {
                    answer.shadow_refusals.push(rule.id.clone());
                } else {
                    answer.overall = Code::OverLimit;
                }
                continue;
            }
            let hits = d.hits.unwrap_or(call.hits_addend.max(1));
            let Some(budget) = budget(domain, rule, d, limit, unit, hits) else {
                continue;
            };
            // The same counter twice in one request: one budget spending both.
            if let Some(same) = counted.iter_mut().find(|c| {
                c.budget.key == budget.key && c.budget.rate == budget.rate && c.limit == limit
            }) {
                same.budget.cost = same.budget.cost.saturating_add(hits);
                same.descriptors.push(i);
                continue;
            }
            counted.push(Counted {
                descriptors: vec![i],
                rule,
                limit,
                unit,
                budget,
            });
        }
        if answer.overall == Code::OverLimit {
            // A rule of 0 refused: nothing is spent for the others either.
            self.fill_peeked(&mut answer, &counted).await;
            return answer;
        }
        if counted.is_empty() {
            return answer;
        }
        if counted.len() > MAX_COUNTED {
            answer.outcome = Outcome::TooManyCounted;
            answer.overall = Code::OverLimit;
            for c in &counted {
                for &i in &c.descriptors {
                    answer.statuses[i] = DescriptorStatus {
                        code: Code::OverLimit,
                        current_limit: Some(current(c.rule, c.limit, c.unit)),
                        limit_remaining: 0,
                        duration_until_reset: Duration::ZERO,
                    };
                }
            }
            return answer;
        }
        answer.outcome = Outcome::Decided;
        let mut budgets: Vec<Budget> = counted.iter().map(|c| c.budget).collect();
        let decision = match self.store().decide(&budgets).await {
            Ok(d) => d,
            Err(error) => return self.outage(answer, domain, &error.to_string()),
        };
        let mut decision = decision;
        if !decision.is_admitted() {
            // Refused only by rules in shadow mode: decide again without them spending.
            let refusing: Vec<usize> = decision
                .statuses()
                .iter()
                .enumerate()
                .filter(|(_, s)| s.verdict != Verdict::Admitted)
                .map(|(i, _)| i)
                .collect();
            if refusing
                .iter()
                .all(|&i| counted.get(i).is_some_and(|c| c.rule.shadow))
            {
                for &i in &refusing {
                    if let (Some(b), Some(c)) = (budgets.get_mut(i), counted.get(i)) {
                        b.cost = 0;
                        answer.shadow_refusals.push(c.rule.id.clone());
                    }
                }
                decision = match self.store().decide(&budgets).await {
                    Ok(d) => d,
                    Err(error) => return self.outage(answer, domain, &error.to_string()),
                };
            }
        }
        let now = decision.decided_at().as_secs();
        let mut tightest: Option<(u32, u32, u64)> = None;
        for (c, s) in counted.iter().zip(decision.statuses()) {
            let mut status = status_of(s, now, c.rule, c.limit, c.unit);
            if c.rule.shadow && status.code == Code::OverLimit {
                status.code = Code::Ok;
            }
            if status.code == Code::OverLimit {
                answer.overall = Code::OverLimit;
            }
            if !c.rule.shadow && tightest.is_none_or(|(_, r, _)| s.remaining < r) {
                tightest = Some((c.limit, s.remaining, s.reset));
            }
            for &i in &c.descriptors {
                answer.statuses[i] = status.clone();
            }
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
                    .extend(ietf_fields(&counted, decision.statuses(), now));
            }
        }
        answer
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
