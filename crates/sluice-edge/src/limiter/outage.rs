//! The outage rule: what the limiter decides on while its store cannot answer.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use sluice_core::Decision;
use sluice_policy::Outage;
use sluice_store::{BudgetStore, MemoryStore, StoreError};

use super::Limiter;
use crate::plan::{BudgetKind, Plan};

/// Cells kept by the fallback store used while a shared store is down.
pub const FALLBACK_MAX_KEYS: usize = 100_000;

impl<S: BudgetStore> Limiter<S> {
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

    pub(super) fn set_degraded(&self, degraded: bool) {
        if self.degraded.swap(degraded, Ordering::Relaxed) != degraded {
            metrics::gauge!("sluice_store_degraded").set(if degraded { 1.0 } else { 0.0 });
        }
    }

    /// True when every class the plan holds fails open and it holds no capped
    /// monthly quota and no money or monthly token budget (SPEC T4: counted
    /// durably and exactly, like quotas; decided on one replica alone, and its
    /// settlement lost with the store, it would not be one).
    pub(crate) fn fails_open(&self, plan: &Plan) -> bool {
        !plan.holds_capped_quota(&self.policy)
            && plan.kinds.iter().all(|k| match k {
                BudgetKind::Class(c) => self.policy.outage(*c) == Outage::FailOpen,
                BudgetKind::Bucket(b) => self
                    .policy
                    .buckets
                    .get(crate::plan::policy_index(*b))
                    .and_then(|b| b.tokens)
                    .is_none_or(|t| !t.priced && !t.monthly),
                _ => true,
            })
    }

    /// Decides `budgets` (the plan's, or those of a decision made again: a passed or
    /// shadowed budget spending nothing) on the fallback store with this replica's
    /// share of each limit.
    pub(crate) fn decide_locally(
        &self,
        plan: &Plan,
        budgets: &[sluice_core::Budget],
    ) -> Result<Decision, StoreError> {
        let replicas = self.policy.store.replicas.get();
        let local: arrayvec::ArrayVec<sluice_core::Budget, { sluice_core::MAX_BUDGETS }> = budgets
            .iter()
            .map(|b| sluice_core::Budget {
                limit: (b.limit / replicas).max(1),
                // A GCRA budget's burst is shared too: else one replica alone could
                // let the whole burst through at once.
                rate: match b.rate {
                    sluice_core::Rate::Gcra { period, burst } => sluice_core::Rate::Gcra {
                        period,
                        burst: std::num::NonZeroU32::new(burst.get() / replicas)
                            .unwrap_or(std::num::NonZeroU32::MIN),
                    },
                    rate => rate,
                },
                ..*b
            })
            .collect();
        self.fallback.decide_now_from(&local, plan.network)
    }
}
