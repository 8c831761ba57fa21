//! Quota administration: where a workspace stands on its monthly quotas, resets
//! and refunds.

use sluice_core::Decision;
use sluice_store::{BudgetStore, StoreError};

use super::Limiter;

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
    /// A month of LLM usage that does not read as `YYYY-MM`.
    #[error(transparent)]
    Month(#[from] super::UsageMonthError),
    /// A month of LLM usage after the current one (`GET /usage?month=`).
    #[error("{0} has not begun: usage is kept for the current month and the {months} before it", months = super::USAGE_MONTHS_KEPT)]
    FutureMonth(super::UsageMonth),
    /// A month of LLM usage no longer kept: more than
    /// [`USAGE_MONTHS_KEPT`](super::USAGE_MONTHS_KEPT) before the current one.
    #[error("{0} is no longer kept: usage is kept for the current month and the {months} before it", months = super::USAGE_MONTHS_KEPT)]
    MonthNotKept(super::UsageMonth),
    /// The store could not answer.
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl<S: BudgetStore> Limiter<S> {
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
    pub(super) fn quota_budgets(
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
            .filter_map(|(i, _)| {
                let scope = *self.scopes.quota(i)?;
                let tier = self.policy.plan_of(subject);
                let cap = crate::plan::quota_cap(&self.policy, tier, i);
                Some((i, crate::plan::quota_budget(scope, cap, subject, 0)))
            })
            .unzip())
    }

    pub(super) fn usage_of(&self, families: &[usize], decision: &Decision) -> Vec<QuotaUsage> {
        families
            .iter()
            .zip(decision.statuses())
            .filter_map(|(&i, s)| {
                let q = self.policy.quotas.get(i)?;
                Some(QuotaUsage {
                    family: q.name.clone(),
                    // The workspace's cap (its plan's, else the family's).
                    limit: (s.limit != u32::MAX).then_some(s.limit),
                    usage: s.limit - s.remaining,
                    resets_at: s.reset,
                })
            })
            .collect()
    }
}
