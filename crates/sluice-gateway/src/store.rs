//! The store `sluice serve` decides on, chosen by `--store` at start.

use std::path::Path;

use sluice_batch::{BatchBook, BatchConfig};
use sluice_core::{Budget, BudgetStatus, Clock as _, Decision, SystemClock, Timestamp};
use sluice_store::{
    BudgetStore, DurableStore, Guarded, LocalStore, MemoryConfig, MemoryStore, OpenError,
    QuotaBook, QuotaBookConfig, RedisConfig, RedisStore, StoreError,
};

/// This process (memory, with quotas in the embedded durable store) or Redis
/// behind a circuit breaker (replicas; quotas in Redis too).
pub(crate) enum AnyStore {
    /// Budgets in this process, monthly quotas durable under the data directory.
    Local(LocalStore),
    /// Budgets shared by every replica on one Redis.
    Redis(Guarded<RedisStore>),
}

impl AnyStore {
    /// The memory store on `clock` sized by `memory`, with monthly quotas kept in
    /// the embedded durable store in `data_dir`, and the batch queue (sluice-batch's
    /// [`BatchBook`]) in the same durable store when `batches` is given.
    ///
    /// # Errors
    /// The data directory cannot be created, is in use by another process, or its
    /// file is corrupt or cannot be written (each naming the path).
    pub(crate) fn local_with_batches(
        clock: SystemClock,
        data_dir: &Path,
        sync: sluice_store::JournalSync,
        batches: Option<BatchConfig>,
        memory: MemoryConfig,
    ) -> Result<(Self, Option<BatchBook>), OpenError> {
        let durable = DurableStore::open_with(data_dir, sync)?;
        let book = QuotaBook::open(&durable, QuotaBookConfig::default(), clock.now())?;
        let batches = match batches {
            Some(config) => Some(BatchBook::open(&durable, config)?),
            None => None,
        };
        Ok((
            AnyStore::Local(LocalStore::new(
                MemoryStore::with_clock(memory, clock),
                Some(book),
            )),
            batches,
        ))
    }

    /// Connects to Redis at `url`, waiting at most `timeout` per decision.
    ///
    /// # Errors
    /// The store's, when Redis cannot be reached at start.
    pub(crate) async fn redis(url: &str, timeout: std::time::Duration) -> Result<Self, StoreError> {
        let mut config = RedisConfig::new(url);
        config.timeout = timeout;
        Ok(AnyStore::Redis(Guarded::new(
            RedisStore::connect(config).await?,
        )))
    }

    /// The memory store on `clock` with monthly quotas in memory too (not durable):
    /// for tests of what does not concern quotas.
    #[cfg(test)]
    pub(crate) fn memory(clock: SystemClock) -> Self {
        AnyStore::Local(LocalStore::new(
            MemoryStore::with_clock(MemoryConfig::default(), clock),
            None,
        ))
    }

    /// Drops stale cells of an in-process store (Redis expires its own keys).
    pub(crate) fn reclaim(&self) {
        if let AnyStore::Local(m) = self {
            m.memory().reclaim();
        }
    }

    /// For `/status`: the kind of store and, for Redis, its breaker's state.
    pub(crate) fn describe_state(&self) -> serde_json::Value {
        match self {
            AnyStore::Local(m) => serde_json::json!({
                "kind": "memory",
                "cells": m.memory().len(),
                "max_cells": m.memory().capacity(),
                "overflowed": m.memory().overflowed(),
                "overflow_network_cells": m.memory().overflow_len().0,
                "quota_counts": m.book().map_or(0, QuotaBook::len),
                "quota_untracked": m.book().map_or(0, QuotaBook::untracked),
                "quota_commits": m.book().map_or(0, QuotaBook::commits),
            }),
            AnyStore::Redis(r) => {
                let state = match r.state() {
                    sluice_core::BreakerState::Closed => "ok",
                    sluice_core::BreakerState::Open { .. } => "unavailable",
                    sluice_core::BreakerState::HalfOpen { .. } => "probing",
                };
                serde_json::json!({ "kind": "redis", "state": state })
            }
        }
    }
}

impl BudgetStore for AnyStore {
    async fn decide(&self, budgets: &[Budget]) -> Result<Decision, StoreError> {
        match self {
            AnyStore::Local(m) => m.decide(budgets).await,
            AnyStore::Redis(r) => r.decide(budgets).await,
        }
    }

    fn leases(&self) -> bool {
        match self {
            AnyStore::Local(m) => m.leases(),
            AnyStore::Redis(r) => r.leases(),
        }
    }

    async fn take_leases(
        &self,
        budgets: &[Budget],
        wants: &[u32],
        backs: &[(Budget, sluice_core::GiveBack)],
    ) -> Result<(Decision, Vec<u32>), StoreError> {
        match self {
            AnyStore::Local(m) => m.take_leases(budgets, wants, backs).await,
            AnyStore::Redis(r) => r.take_leases(budgets, wants, backs).await,
        }
    }

    fn keep_give_backs(&self, backs: &[(Budget, sluice_core::GiveBack)]) {
        match self {
            AnyStore::Local(m) => m.keep_give_backs(backs),
            AnyStore::Redis(r) => r.keep_give_backs(backs),
        }
    }

    fn holds_give_backs(&self) -> bool {
        match self {
            AnyStore::Local(m) => m.holds_give_backs(),
            AnyStore::Redis(r) => r.holds_give_backs(),
        }
    }

    async fn peek(&self, budgets: &[Budget]) -> Result<Decision, StoreError> {
        match self {
            AnyStore::Local(m) => m.peek(budgets).await,
            AnyStore::Redis(r) => r.peek(budgets).await,
        }
    }

    async fn adjust(
        &self,
        budget: &Budget,
        delta: i64,
        reserved_at: Timestamp,
    ) -> Result<BudgetStatus, StoreError> {
        match self {
            AnyStore::Local(m) => m.adjust(budget, delta, reserved_at).await,
            AnyStore::Redis(r) => r.adjust(budget, delta, reserved_at).await,
        }
    }

    async fn decide_from(&self, budgets: &[Budget], network: u64) -> Result<Decision, StoreError> {
        match self {
            AnyStore::Local(m) => m.decide_from(budgets, network).await,
            AnyStore::Redis(r) => r.decide(budgets).await,
        }
    }

    async fn peek_from(&self, budgets: &[Budget], network: u64) -> Result<Decision, StoreError> {
        match self {
            AnyStore::Local(m) => m.peek_from(budgets, network).await,
            AnyStore::Redis(r) => r.peek(budgets).await,
        }
    }

    async fn adjust_from(
        &self,
        budget: &Budget,
        delta: i64,
        reserved_at: Timestamp,
        network: u64,
    ) -> Result<BudgetStatus, StoreError> {
        match self {
            AnyStore::Local(m) => m.adjust_from(budget, delta, reserved_at, network).await,
            AnyStore::Redis(r) => r.adjust(budget, delta, reserved_at).await,
        }
    }

    async fn note_usage_row(
        &self,
        period: &str,
        row: &str,
        bound: sluice_store::UsageRowBound,
    ) -> Result<bool, StoreError> {
        match self {
            AnyStore::Local(m) => m.note_usage_row(period, row, bound).await,
            AnyStore::Redis(r) => r.note_usage_row(period, row, bound).await,
        }
    }

    async fn usage_rows(
        &self,
        period: &str,
        after: Option<&str>,
        count: usize,
    ) -> Result<sluice_store::UsageRowsPage, StoreError> {
        match self {
            AnyStore::Local(m) => m.usage_rows(period, after, count).await,
            AnyStore::Redis(r) => r.usage_rows(period, after, count).await,
        }
    }

    async fn adjust_all_from(
        &self,
        changes: &[(Budget, i64)],
        reserved_at: Timestamp,
        network: u64,
    ) -> Result<Vec<BudgetStatus>, StoreError> {
        match self {
            AnyStore::Local(m) => m.adjust_all_from(changes, reserved_at, network).await,
            AnyStore::Redis(r) => r.adjust_all_from(changes, reserved_at, network).await,
        }
    }
}
