//! What LLM calls spent, per workspace and calendar month (SPEC T6): counted
//! in the budget store when a call settles at its usage — durable on the
//! embedded store, one count on every replica with Redis — and read back for
//! the admin listener's `GET /usage`. Models are counted by the policy's
//! `prices:` entries (a model, or a family `gpt-4o*`); calls of a model with no
//! price are counted under `other`.

use sluice_core::{Budget, BudgetKey, Rate, digest};
use sluice_store::BudgetStore;
use sluice_tokens::Usage;

use super::{Limiter, QuotaQueryError};
use crate::plan::Plan;

/// The counters of one model (or family): input not from the cache, cached
/// input, output, and money units.
const DIRECTIONS: [&str; 4] = ["input", "cached_input", "output", "spend"];

/// The model key of calls with no price.
const OTHER: &str = "other";

/// The monthly counter of `direction` of calls of `model` by `workspace`.
fn counter(model: &str, direction: &str, workspace: u64, n: u32) -> Budget {
    Budget {
        key: BudgetKey::from_digests(
            digest(format!("llm-usage:{model}:{direction}").as_bytes()),
            workspace,
        ),
        rate: Rate::CalendarMonth,
        limit: u32::MAX,
        cost: n,
    }
}

impl<S: BudgetStore> Limiter<S> {
    /// Counts what an LLM call of `plan` spent, as its upstream reported it, in
    /// its workspace's monthly usage (one store call). A count the store cannot
    /// take is lost, and counted in `sluice_llm_usage_failures_total`.
    pub(super) async fn record_llm_usage(&self, plan: &Plan, usage: &Usage) {
        let price = plan
            .price
            .and_then(|i| self.policy.prices.get(usize::from(i)));
        let model = price.map_or(OTHER, |p| p.model.as_str());
        let spend = price.map_or(0, |p| {
            p.cost(usage.prompt, usage.cached_input, usage.completion)
        });
        let counts = [
            usage.prompt.saturating_sub(usage.cached_input),
            usage.cached_input,
            usage.completion,
            spend,
        ];
        let budgets: Vec<Budget> = DIRECTIONS
            .iter()
            .zip(counts)
            .filter(|(_, n)| *n > 0)
            .map(|(direction, n)| counter(model, direction, plan.from.workspace, n))
            .collect();
        if budgets.is_empty() {
            return;
        }
        if self
            .store
            .decide_from(&budgets, plan.network)
            .await
            .is_err()
        {
            metrics::counter!("sluice_llm_usage_failures_total").increment(1);
        }
    }

    /// What the LLM calls of `workspace` (its label, as `X-Sluice-Workspace`
    /// names it) spent this calendar month: tokens by direction and US dollars,
    /// in all and by model, as JSON (`GET /usage`).
    ///
    /// # Errors
    /// [`QuotaQueryError`]: a label that names no workspace, or a store that
    /// cannot answer.
    pub async fn llm_usage(&self, workspace: &str) -> Result<serde_json::Value, QuotaQueryError> {
        let subject = self
            .policy
            .identity
            .workspace_subject(workspace)
            .ok_or(QuotaQueryError::Workspace)?;
        let models: Vec<&str> = self
            .policy
            .prices
            .iter()
            .map(|p| p.model.as_str())
            .chain([OTHER])
            .collect();
        let budgets: Vec<Budget> = models
            .iter()
            .flat_map(|m| DIRECTIONS.iter().map(move |d| counter(m, d, subject, 0)))
            .collect();
        let decision = self.store.peek(&budgets).await?;
        let used: Vec<u64> = decision
            .statuses()
            .iter()
            .map(|s| u64::from(s.limit - s.remaining))
            .collect();
        let usd = |units: u64| units as f64 / sluice_policy::MONEY_UNITS_PER_USD as f64;
        let mut total = [0u64; 4];
        let mut by_model = serde_json::Map::new();
        for (m, counts) in models.iter().zip(used.chunks(DIRECTIONS.len())) {
            for (t, c) in total.iter_mut().zip(counts) {
                *t += c;
            }
            if counts.iter().any(|&c| c > 0) {
                by_model.insert(
                    (*m).to_owned(),
                    serde_json::json!({
                        "input": counts[0], "cached_input": counts[1], "output": counts[2],
                        "spend_usd": usd(counts[3]),
                    }),
                );
            }
        }
        let month = sluice_core::month_of(decision.decided_at());
        Ok(serde_json::json!({
            "workspace": workspace,
            "month": crate::rfc3339(month.start).get(..7).unwrap_or_default(),
            "tokens": { "input": total[0], "cached_input": total[1], "output": total[2] },
            "spend_usd": usd(total[3]),
            "by_model": by_model,
        }))
    }
}
