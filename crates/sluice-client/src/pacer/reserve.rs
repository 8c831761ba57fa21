//! A plan turned into a [`Permit`]: the budgets reserved in one decision of
//! the store, then the admission counted.

use std::time::Duration;

use sluice_core::{Clock, MAX_BUDGETS, Timestamp};
use sluice_store::BudgetStore;

use super::admission::Ask;
use super::charge::Charge;
use super::handle::Pacer;
use super::permit::Permit;
use super::schedule::Plan;
use super::state::{ADMITTED, BATCH, WAIT_MS, WAITED};
use crate::config::ProviderConfig;
use crate::error::PaceError;
use crate::priority::Priority;
use crate::route::{Cost, Route};

impl<S, C> Pacer<S, C>
where
    S: BudgetStore + 'static,
    C: Clock + 'static,
{
    pub(super) async fn try_reserve(
        &self,
        ask: &Ask<'_>,
        p: &ProviderConfig,
        route: &Route,
        cost: Cost,
        estimated_input: u32,
        plan: &Plan,
    ) -> Result<Option<Permit<S, C>>, PaceError> {
        let margin = self.config().pacer.arrival_margin;
        let mut budgets = Vec::with_capacity(MAX_BUDGETS);
        let mut charges = Vec::with_capacity(plan.charges.len());
        let mut day_slots = Vec::with_capacity(plan.days.len());
        let mut token_day_slots = Vec::with_capacity(plan.token_days.len());
        for c in &plan.charges {
            let subject = route.scopes[c.scope].subject;
            budgets.push(
                self.inner
                    .window(c.axis)
                    .budget(subject, margin, c.limit, c.cost),
            );
            charges.push(Charge {
                subject,
                axis: c.axis,
                tokens: c.cost,
                slot: c.reading.current(),
                limit: c.axis.limit(&route.scopes[c.scope].limits),
            });
        }
        for s in &route.scopes {
            if s.limits.rpm > 0 {
                budgets.push(self.rpm_budget(s.subject, s.limits.rpm, margin));
            }
        }
        for (k, h) in &plan.days {
            let s = &route.scopes[*k];
            let older = h.total() - u64::from(h.current_value());
            let limit = u32::try_from(u64::from(s.limits.rpd).saturating_sub(older)).unwrap_or(0);
            budgets.push(self.inner.rpd.cell(s.subject, h.current(), limit, 1));
            day_slots.push((s.subject, h.current()));
        }
        for (k, h) in &plan.token_days {
            let s = &route.scopes[*k];
            let older = h.total() - u64::from(h.current_value());
            let limit = u32::try_from(u64::from(s.limits.tpd).saturating_sub(older)).unwrap_or(0);
            let tokens = cost.total();
            budgets.push(self.inner.tpd.cell(s.subject, h.current(), limit, tokens));
            token_day_slots.push((s.subject, h.current(), tokens));
        }
        let decided_at = if budgets.is_empty() {
            self.inner.clock.now()
        } else {
            let d = self.inner.store.decide(&budgets).await?;
            if !d.is_admitted() {
                return Ok(None);
            }
            d.decided_at()
        };
        let window_at_decision = plan
            .charges
            .iter()
            .map(|c| {
                (
                    route.scopes[c.scope].subject,
                    c.axis,
                    c.reading.total() + u64::from(c.cost),
                )
            })
            .collect();
        Ok(Some(Permit {
            pacer: self.clone(),
            state: ask.state.clone(),
            provider: ask.provider.into(),
            group: ask.group.map(Into::into),
            model: ask.model.map(Into::into),
            estimated_input,
            key_name: route.key_name.clone(),
            secret: route.secret.clone(),
            scopes: route.scopes.clone(),
            reserved: if charges.is_empty() && token_day_slots.is_empty() {
                Cost::default()
            } else {
                cost
            },
            charges,
            day_slots,
            token_day_slots,
            decided_at,
            window_at_decision,
            waited: Duration::ZERO,
            reconcile: p.reconcile,
        }))
    }

    /// Counts `permit`, reserved at `now` for `ask`, and gives it its wait.
    pub(super) fn admitted(
        &self,
        ask: &Ask<'_>,
        route: &Route,
        permit: Permit<S, C>,
        now: Timestamp,
        cost: Cost,
    ) -> Permit<S, C> {
        let waited = now.saturating_since(ask.arrived);
        let c = &ask.state.counters;
        c.add(ADMITTED, 1);
        if ask.priority == Priority::Batch {
            c.add(BATCH, 1);
            let span = Duration::from_secs(60) + self.config().pacer.arrival_margin;
            let mut pace = self.inner.batch_pace.lock();
            for s in &route.scopes {
                for (axis, limit) in s.token_axes(cost) {
                    pace.spend(s.subject, axis, cost.on(axis), limit, span, now);
                }
            }
        } else {
            // Interactive tokens count toward the batch pace too (they never
            // wait for it): batch and interactive tokens together go no
            // faster than the budget's rate, so the window fills as evenly
            // as it empties, and room never comes back with long gaps in it.
            let span = Duration::from_secs(60) + self.config().pacer.arrival_margin;
            let mut log = self.inner.interactive.lock();
            let mut pace = self.inner.batch_pace.lock();
            for s in &route.scopes {
                log.record(s.subject, now, cost);
                for (axis, limit) in s.token_axes(cost) {
                    pace.spend(s.subject, axis, cost.on(axis), limit, span, now);
                }
            }
        }
        ask.state.recent.lock().add(now.as_secs());
        if !waited.is_zero() {
            c.add(WAITED, 1);
            c.add(
                WAIT_MS,
                u64::try_from(waited.as_millis()).unwrap_or(u64::MAX),
            );
        }
        permit.with_waited(waited)
    }
}
