//! Admission: a planned request's lane place and budgets decided at once, a
//! weighted call settled after its answer, and why a request was refused.

use std::sync::atomic::Ordering;
use std::time::Instant;

use sluice_core::Decision;
use sluice_store::{BudgetStore, StoreError};

use super::{Limiter, Refused};
use crate::plan::{BudgetKind, Passed, Plan};

/// An admitted request (see [`Limiter::decide_request`]).
#[derive(Debug)]
pub(crate) struct Admitted {
    /// Its decision (boxed, as the plan).
    pub decision: Box<Decision>,
    /// Its plan (boxed: a plan is about a kilobyte, and an admitted request goes
    /// by value through every layer of the request path).
    pub plan: Box<Plan>,
    /// Its place in a guarded lane, held until its upstream call ends.
    pub lane: Option<crate::LanePlace>,
}

/// Why the edge refused a request, as a value (see [`crate::Planned::admit`]):
/// what a transport that does not answer in HTTP reads, and what
/// [`Limiter::answer`] renders for those that do.
#[derive(Debug)]
#[non_exhaustive]
pub struct Refusal {
    /// Why.
    pub reason: Reason,
    /// The plan it was decided on: which budgets, whose, what class. `None` for a
    /// request that could not be planned ([`Reason::Invalid`] before planning).
    pub plan: Option<Box<Plan>>,
}

/// Why a request was refused (see [`Refusal`]). Nothing was spent for any of them.
#[derive(Debug)]
#[non_exhaustive]
pub enum Reason {
    /// It cannot be counted as the upstream would read it, or can never be admitted
    /// as sent (more lane calls than a workspace may run at once): nothing was
    /// decided.
    Invalid(Refused),
    /// A budget refused it: the decision names the binding one, and whether a retry
    /// can succeed ([`Decision::is_never`]) and when.
    Budget(Box<Decision>),
    /// Its guarded lane refused it (the lane's index in the policy, and why).
    Lane {
        /// The lane's index in the policy's lanes.
        lane: usize,
        /// Why, and when a retry may succeed.
        refusal: sluice_lanes::LaneRefusal,
    },
    /// The store, or a lane's shared ledger, could not decide.
    Unavailable(String),
}

impl<S: BudgetStore> Limiter<S> {
    /// Decides every budget of `plan` at once, and records the outcome.
    ///
    /// A request refused only by weighted budgets that pass an exhausted request on
    /// (`on_exhausted: pass`) is decided again without spending them and admitted;
    /// [`Plan::passed`] then says which one, for `X-Sluice-Exhausted`.
    ///
    /// # Errors
    /// The store's, when it cannot answer.
    pub async fn decide(&self, plan: &mut Plan) -> Result<Decision, StoreError> {
        self.decide_boxed(plan, "-").await.map(|d| *d)
    }

    /// [`Limiter::decide`] with the decision boxed as the store gives it: a
    /// decision is 400 bytes, and the request path moves it through several
    /// async layers.
    ///
    /// Budgets in shadow mode never refuse ([`shadow_waived`], the rule every
    /// transport decides by): a refusal by some of them is decided again with
    /// them spending nothing (as a refusal spends nothing anywhere), and, once
    /// the request is admitted, counted and logged (under `request_id`) as the
    /// refusal it would have been ([`Limiter::count_shadow_refusal`]);
    /// [`Plan::shadowed`] then says which.
    async fn decide_boxed(
        &self,
        plan: &mut Plan,
        request_id: &str,
    ) -> Result<Box<Decision>, StoreError> {
        let mut decision = self.decide_budgets(plan, &plan.budgets).await;
        let mut would_have = None;
        let mut waived = 0;
        if let Ok(refused) = &decision
            && !refused.is_admitted()
        {
            // A bucket that passes an exhausted request on does so in shadow mode
            // too (below), as it would enforced.
            waived = shadow_waived(refused, plan.shadow, || {
                Plan::mask((0..plan.budgets.len()).filter(|&i| plan.passes(i, &self.policy)))
            });
            if waived != 0 {
                let budgets = without(&plan.budgets, waived);
                would_have = Some(std::mem::replace(
                    &mut decision,
                    self.decide_budgets(plan, &budgets).await,
                ));
            }
        }
        if let Ok(refused) = &decision
            && !refused.is_admitted()
            && let Some(passed) = self.passable(plan, refused)
        {
            let mut budgets = without(&plan.budgets, waived);
            budgets[passed.index].cost = 0;
            let again = self.decide_budgets(plan, &budgets).await;
            if again.as_ref().is_ok_and(|d| d.is_admitted()) {
                plan.passed = Some(passed);
            }
            decision = again;
        }
        if let (Some(Ok(refused)), Ok(admitted)) = (&would_have, &decision)
            && admitted.is_admitted()
        {
            plan.shadowed = waived;
            self.record_shadow_refusals(plan, refused, request_id);
        }
        // A run's first turn spends one of its caller's run starts, or is given
        // back and refused (counted as the refusal it is).
        let decision = match decision {
            Ok(admitted) if admitted.is_admitted() && plan.run.is_some() => {
                self.start_run(plan, admitted).await
            }
            other => other,
        };
        self.record(plan, &decision);
        // SPEC O4: the call and its quota units in its row of the usage export.
        if let Ok(admitted) = &decision
            && admitted.is_admitted()
        {
            self.count_admitted(plan, admitted.decided_at()).await;
            // SPEC O3: a budget it left past an alert's threshold.
            self.raise_alerts(plan, admitted).await;
        }
        decision
    }

    /// Counts one refusal that `budget` (as metrics name it), in shadow mode,
    /// would have given, for `reason` (`sluice_shadow_refusals_total` and the
    /// dashboard's tally), and writes its log line with `line` within the
    /// refusal log's bound: every transport's shadow refusals are counted here.
    pub(crate) fn count_shadow_refusal(
        &self,
        budget: &str,
        reason: &'static str,
        line: impl FnOnce(),
    ) {
        metrics::counter!(
            "sluice_shadow_refusals_total",
            "budget" => budget.to_owned(),
            "reason" => reason
        )
        .increment(1);
        *self
            .counts
            .shadow_refusals
            .lock()
            .entry((budget.to_owned(), reason))
            .or_default() += 1;
        crate::refusal_log::refusal_line(&self.refusal_log, line);
    }

    /// Phase 4 for a planned request (see [`crate::Planned::admit`]): a request
    /// that cannot be counted, a call its lane refuses, a refusal, or a store that
    /// cannot decide becomes a [`Refusal`] (logged, with `request_id`, its reason,
    /// the budget or lane, the class and the caller's digest — never a credential —
    /// within the bound of [`Limiter::with_refusal_log`]); an admitted request
    /// comes back with its decision, its plan and its place in a lane.
    ///
    /// A call through a lane waits for its place first (up to the lane's wait), then
    /// its budgets are decided; when they refuse it, the place and its start go
    /// back, so a refused call spends nothing anywhere.
    ///
    /// # Errors
    /// The [`Refusal`]; it has been logged and counted, and spent nothing.
    pub(crate) async fn decide_request(
        &self,
        plan: Result<Box<Plan>, Refused>,
        request_id: Option<&crate::RequestId>,
    ) -> Result<Admitted, Refusal> {
        let id = request_id.map_or("-", crate::RequestId::as_str);
        let mut plan = plan.map_err(|refused| self.unplanned(refused, id))?;
        let place = match plan.lane {
            None => None,
            Some(call) => match self.take_lane_places(&plan, call, id).await {
                Ok(place) => Some(place),
                Err(reason) => {
                    return Err(Refusal {
                        reason,
                        plan: Some(plan),
                    });
                }
            },
        };
        let decided = self.decide_boxed(&mut plan, id).await;
        if let Ok(decision) = &decided {
            self.keep_run(&plan, decision);
        }
        let reason = match decided {
            Ok(decision) if decision.is_admitted() => {
                return Ok(Admitted {
                    decision,
                    plan,
                    lane: place,
                });
            }
            Ok(decision) => {
                // A run's pause answers before any other refusal: waiting helps none.
                let binding = match &plan.run {
                    Some(run) if crate::runs::paused(&plan, &decision) => run.index,
                    _ => decision.binding_index(),
                };
                let reason = plan.refusal_reason(binding, &decision);
                crate::refusal_log::refusal_line(&self.refusal_log, || {
                    tracing::info!(
                        target: "sluice::refusal",
                        request_id = id,
                        reason,
                        budget = plan.name(binding, &self.policy),
                        limit = decision.binding().map_or(0, |b| b.limit),
                        retry_after = (!decision.is_never())
                            .then(|| crate::answer::refusal_wait(&decision)),
                        class = self.policy.class_name(plan.top_class),
                        caller = %format_args!("{:016x}", plan.caller),
                        "refused"
                    );
                });
                Reason::Budget(decision)
            }
            Err(error) => {
                crate::refusal_log::refusal_line(&self.outage_log, || {
                    tracing::warn!(
                        target: "sluice::refusal",
                        request_id = id,
                        reason = "limiter_unavailable",
                        class = self.policy.class_name(plan.top_class),
                        caller = %format_args!("{:016x}", plan.caller),
                        error = %error,
                        "the store could not decide"
                    );
                });
                Reason::Unavailable(error.to_string())
            }
        };
        if let Some(place) = place {
            place.cancel();
        }
        Err(Refusal {
            reason,
            plan: Some(plan),
        })
    }

    /// A request refused before it could be planned (its head, its credentials,
    /// its body), logged under `id` as every refusal is.
    fn unplanned(&self, refused: Refused, id: &str) -> Refusal {
        crate::refusal_log::refusal_line(&self.refusal_log, || {
            tracing::info!(
                target: "sluice::refusal",
                request_id = id,
                reason = "invalid_request",
                error = %refused,
                "refused before deciding"
            );
        });
        Refusal {
            reason: Reason::Invalid(refused),
            plan: None,
        }
    }

    /// The answer to a request refused before it could be planned (see
    /// [`crate::Intake::refused`]): logged, then rendered as every refusal is.
    pub(crate) fn refuse_unplanned(
        &self,
        refused: Refused,
        request_id: Option<&crate::RequestId>,
    ) -> http::Response<http_body_util::Full<bytes::Bytes>> {
        let id = request_id.map_or("-", crate::RequestId::as_str);
        self.answer(&self.unplanned(refused, id), None)
    }

    /// The HTTP answer to a refusal, for every transport that answers in HTTP: the
    /// one place a [`Refusal`] becomes a response. `jsonrpc_body` is the body of a
    /// request on a JSON-RPC route (see [`crate::Planned::admit`]).
    pub fn answer(
        &self,
        refusal: &Refusal,
        jsonrpc_body: Option<&[u8]>,
    ) -> http::Response<http_body_util::Full<bytes::Bytes>> {
        let policy = &self.policy;
        let answer = match (&refusal.reason, refusal.plan.as_deref()) {
            // A batch tool call whose arguments cannot be queued: the call's own
            // JSON-RPC error, as its other answers are.
            (Reason::Invalid(refused @ crate::Refused::Batch(bad)), _)
                if let Some(body) = jsonrpc_body =>
            {
                return crate::answer::jsonrpc_invalid_params(refused.response(), body, bad);
            }
            (Reason::Invalid(refused), _) if jsonrpc_body.is_some() => refused.jsonrpc_response(),
            (Reason::Invalid(refused), _) => refused.response(),
            (Reason::Budget(decision), Some(plan)) if crate::runs::paused(plan, decision) => {
                return crate::runs::pause(plan, decision, policy, jsonrpc_body);
            }
            (Reason::Budget(decision), Some(plan)) => match plan.llm {
                Some(format) => crate::dialect::llm_refusal(
                    format,
                    crate::answer::refusal(decision, plan, policy),
                    decision,
                    plan,
                    policy,
                ),
                None => crate::answer::refusal(decision, plan, policy),
            },
            (Reason::Lane { lane, refusal }, _) => match policy.lanes.get(*lane) {
                Some(lane) => crate::lane_refusal(lane, refusal),
                None => crate::answer::limiter_unavailable(&"no lane"),
            },
            (Reason::Unavailable(error), _) => crate::answer::limiter_unavailable(error),
            (Reason::Budget(_), None) => crate::answer::limiter_unavailable(&"no plan"),
        };
        match jsonrpc_body {
            Some(body) if policy.jsonrpc.refusal == sluice_policy::JsonRpcRefusal::JsonRpcError => {
                let class = refusal
                    .plan
                    .as_ref()
                    .map_or("", |p| self.policy.class_name(p.top_class));
                crate::answer::jsonrpc_refusal(answer, body, class)
            }
            _ => answer,
        }
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
    ) -> Result<crate::LanePlace, Reason> {
        let log = |reason: &str| {
            crate::refusal_log::refusal_line(&self.refusal_log, || {
                tracing::info!(
                    target: "sluice::refusal",
                    request_id = id,
                    reason,
                    lane = self.policy.lanes.get(call.lane).map_or("", |l| l.name.as_str()),
                    class = self.policy.class_name(plan.top_class),
                    caller = %format_args!("{:016x}", plan.caller),
                    "lane refused"
                );
            });
        };
        let (Some(lane), Some(rule)) =
            (self.lanes.get(call.lane), self.policy.lanes.get(call.lane))
        else {
            log("limiter_unavailable");
            return Err(Reason::Unavailable("no such lane".to_owned()));
        };
        // The workspace's own limits in this lane: its plan's, else the lane's.
        let tier = self.policy.plan_for(&plan.from).ok().flatten();
        let (in_flight, starts) = self
            .policy
            .lane_limits(tier, call.lane)
            .unwrap_or((rule.workspace_in_flight, rule.workspace_starts));
        let limits = sluice_lanes::WorkspaceLimits::new(in_flight, starts);
        if call.calls > in_flight.get() {
            return Err(
                match self.store.peek_from(&plan.budgets, plan.network).await {
                    // Budgets in shadow mode do not refuse here either.
                    Ok(peeked)
                        if !peeked.is_admitted()
                            && plan.shadow_refusals(&peeked) != plan.refusals(&peeked) =>
                    {
                        log(plan.name(peeked.binding_index(), &self.policy));
                        Reason::Budget(Box::new(peeked))
                    }
                    _ => {
                        log("too_many_lane_calls");
                        Reason::Invalid(Refused::LaneCalls {
                            calls: call.calls,
                            max: in_flight.get(),
                        })
                    }
                },
            );
        }
        let workspace = plan.from.workspace_label();
        let until = tokio::time::Instant::now() + crate::lanes::max_wait(rule, call);
        let mut permits = Vec::with_capacity(call.calls as usize);
        for _ in 0..call.calls {
            let left = until.saturating_duration_since(tokio::time::Instant::now());
            match lane.acquire_within(&workspace, limits, left).await {
                Ok(permit) => permits.push(permit),
                Err(refusal) => {
                    crate::LanePlace::new(permits, rule.timeout).cancel();
                    let reason = rule.reason_name(refusal.reason.as_str());
                    log(reason);
                    if refusal.reason == sluice_lanes::RefusalReason::LedgerUnavailable {
                        // The lane fails closed while its shared ledger is down: as
                        // a store that cannot decide (see `lanes::ledger_outage`).
                        return Err(Reason::Unavailable(format!(
                            "the ledger of lane {} did not answer",
                            rule.name
                        )));
                    }
                    metrics::counter!(
                        "sluice_lane_refusals_total",
                        "lane" => rule.name.clone(),
                        "reason" => reason.to_owned()
                    )
                    .increment(1);
                    *self
                        .counts
                        .lane_refusals
                        .lock()
                        .entry((call.lane, refusal.reason.as_str()))
                        .or_default() += 1;
                    return Err(Reason::Lane {
                        lane: call.lane,
                        refusal,
                    });
                }
            }
        }
        Ok(crate::LanePlace::new(permits, rule.timeout))
    }

    /// The pass-on budget that alone refused `refused`, if that is all that did.
    pub(super) fn passable(&self, plan: &Plan, refused: &Decision) -> Option<Passed> {
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
    /// the call cost (`X-Sluice-Cost`: `cost`), and returns `decision` with their
    /// statuses after the charge. Token budgets are not charged here: they settle
    /// at the answer's `usage` ([`Limiter::settle_usage`]).
    pub async fn settle(&self, plan: &Plan, decision: Decision, cost: Option<u32>) -> Decision {
        let Some(cost) = cost else {
            return decision;
        };
        let policy = &self.policy;
        self.charge(plan, decision, |i| {
            let is_tokens = matches!(plan.kinds.get(i), Some(BudgetKind::Bucket(b))
                if policy.buckets.get(crate::plan::policy_index(*b)).is_some_and(|b| b.tokens.is_some()));
            (!is_tokens).then_some(cost)
        })
        .await
    }

    /// SPEC T3: settles an LLM call's token budgets with what the upstream said it
    /// spent. `usage` replaces the reservation; without one, an answer that
    /// `failed` before generation (an error status) gives the reservation back
    /// and any other (a stream cut short, an answer with no usage) is charged the
    /// reservation. A settled call may take a budget below zero for the rest of
    /// its window. Returns the decision with the budgets' statuses after it.
    pub async fn settle_usage(
        &self,
        plan: &Plan,
        decision: Decision,
        usage: Option<sluice_tokens::Usage>,
        failed: bool,
    ) -> Decision {
        let outcome = match (&usage, failed) {
            (Some(usage), _) => {
                let directions = [
                    usage.prompt.saturating_sub(usage.cached_input),
                    usage.cached_input,
                    usage.completion,
                ];
                for (counter, n) in self.metrics.llm_tokens.iter().zip(directions) {
                    counter.increment(u64::from(n));
                }
                0
            }
            (None, true) => 1,
            (None, false) => 2,
        };
        self.metrics.llm_settlements[outcome].increment(1);
        // What the call spent, counted for `/usage` and in its row of the usage
        // export (SPEC O4), in the same store call.
        let amounts = match (&usage, failed) {
            (Some(usage), _) => Some(self.usage_amounts(plan, usage)),
            (None, false) => self.reserved_amounts(plan),
            (None, true) => None,
        };
        let mut counts = amounts.map_or_else(Vec::new, |amounts| {
            self.llm_usage_counts(plan, amounts, decision.decided_at())
        });
        counts.extend(
            self.usage_row_counts(plan, amounts, decision.decided_at())
                .await,
        );
        let policy = &self.policy;
        let settled = self
            .charge_with(
                plan,
                decision,
                |i| {
                    let Some(BudgetKind::Bucket(b)) = plan.kinds.get(i) else {
                        return None;
                    };
                    let tokens = policy.buckets.get(crate::plan::policy_index(*b))?.tokens?;
                    match (&usage, failed) {
                        (Some(usage), _) => {
                            crate::tokens::settled_units(&tokens, usage, &policy.prices, plan.price)
                        }
                        (None, true) => Some(0),
                        (None, false) => None,
                    }
                },
                counts,
            )
            .await;
        // SPEC O3: a budget the settlement left past an alert's threshold.
        self.raise_alerts(plan, &settled).await;
        settled
    }

    /// Charges each weighted budget `i` of `plan` what `actual(i)` says (`None`:
    /// leaves it as decided) in place of what the decision reserved, and returns
    /// the decision with their statuses after it.
    async fn charge(
        &self,
        plan: &Plan,
        decision: Decision,
        actual: impl Fn(usize) -> Option<u32>,
    ) -> Decision {
        self.charge_with(plan, decision, actual, Vec::new()).await
    }

    /// [`Limiter::charge`], with `counts` (budgets counting what the call spent,
    /// each charged its cost) in the same store call: a settlement is one round
    /// trip. The counts go first, so that up to [`sluice_core::MAX_BUDGETS`] of
    /// them are one script call on Redis: `/usage`'s monthly counts and the usage
    /// export's row are charged together or not at all.
    async fn charge_with(
        &self,
        plan: &Plan,
        decision: Decision,
        actual: impl Fn(usize) -> Option<u32>,
        counts: Vec<sluice_core::Budget>,
    ) -> Decision {
        let mut statuses: arrayvec::ArrayVec<
            sluice_core::BudgetStatus,
            { sluice_core::MAX_BUDGETS },
        > = decision.statuses().iter().copied().collect();
        // The budget index of each change, then the counts.
        let mut changes: Vec<(sluice_core::Budget, i64)> = Vec::new();
        let mut indices: Vec<usize> = Vec::new();
        for i in plan.weighted(&self.policy) {
            // A passed budget spent nothing, nor did a shadowed one that would have
            // refused: neither is charged now.
            if plan.passed.is_some_and(|p| p.index == i) || plan.shadowed & (1 << i) != 0 {
                continue;
            }
            let (Some(budget), Some(cost)) = (plan.budgets.get(i), actual(i)) else {
                continue;
            };
            let delta = i64::from(cost) - i64::from(budget.cost);
            if delta != 0 {
                changes.push((*budget, delta));
                indices.push(i);
            }
        }
        let charged = changes.len();
        let counted = counts.len();
        let changes: Vec<(sluice_core::Budget, i64)> = counts
            .into_iter()
            .map(|b| (b, i64::from(b.cost)))
            .chain(changes)
            .collect();
        if changes.is_empty() {
            return decision;
        }
        match self
            .store
            .adjust_all_from(&changes, decision.decided_at(), plan.network)
            .await
        {
            Ok(after) => {
                for (&i, status) in indices.iter().zip(after.iter().skip(counted)) {
                    if let Some(s) = statuses.get_mut(i) {
                        *s = *status;
                    }
                }
            }
            Err(_) => {
                // The charges are lost, the call was already admitted: counted.
                if charged > 0 {
                    metrics::counter!("sluice_settle_failures_total").increment(1);
                }
                if counted > 0 {
                    metrics::counter!("sluice_llm_usage_failures_total").increment(1);
                }
                return decision;
            }
        }
        if charged > 0 {
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
        if let Some(decision) = self.decide_leased(plan, budgets).await {
            crate::latency::DECISION_SECONDS.record(started.elapsed());
            return decision;
        }
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
                    self.decide_locally(plan, budgets).map(Box::new)
                } else {
                    Err(StoreError::Unavailable(e))
                }
            }
            Err(e) => Err(e),
        };
        crate::latency::DECISION_SECONDS.record(started.elapsed());
        decision
    }
}

/// The shadow rule (SPEC P5), one for every transport — the gateway, the
/// check listener and the rate-limit service: budgets in shadow mode
/// (`shadow`, a bit each by index: `mode: shadow`, a shadowed route or plan, a
/// rule's `shadow_mode`, or a dry run) are decided and counted as usual and
/// never refuse. Of a `decision` some of them refused, they are the budgets
/// to decide again spending nothing ([`waive`]) — but for those `kept`
/// names, which another rule answers (a budget that passes an exhausted
/// request on) — and, once the request is admitted, each is a refusal it would
/// have had, to count ([`Limiter::count_shadow_refusal`]). 0 when the decision
/// admitted the request or no budget in shadow mode refused it.
pub(crate) fn shadow_waived(decision: &Decision, shadow: u16, kept: impl FnOnce() -> u16) -> u16 {
    if decision.is_admitted() {
        return 0;
    }
    let refused = Plan::mask(
        decision
            .statuses()
            .iter()
            .enumerate()
            .filter(|(_, s)| s.verdict != sluice_core::Verdict::Admitted)
            .map(|(i, _)| i),
    );
    match refused & shadow {
        0 => 0,
        waived => waived & !kept(),
    }
}

/// `budgets` with those of `mask` (a bit each by index) spending nothing.
fn without(
    budgets: &arrayvec::ArrayVec<sluice_core::Budget, { sluice_core::MAX_BUDGETS }>,
    mask: u16,
) -> arrayvec::ArrayVec<sluice_core::Budget, { sluice_core::MAX_BUDGETS }> {
    let mut budgets = budgets.clone();
    waive(&mut budgets, mask);
    budgets
}

/// Makes the budgets of `mask` (a bit each by index, as [`shadow_waived`]
/// gives) spend nothing.
pub(crate) fn waive(budgets: &mut [sluice_core::Budget], mask: u16) {
    for i in Plan::indices(mask) {
        if let Some(b) = budgets.get_mut(i) {
            b.cost = 0;
        }
    }
}
