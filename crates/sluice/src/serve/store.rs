//! The store `sluice serve` decides on, chosen by `--store` at start.

use sluice_core::{Budget, BudgetStatus, Decision, SystemClock, Timestamp};
use sluice_store::{
    BudgetStore, Guarded, MemoryConfig, MemoryStore, RedisConfig, RedisStore, StoreError,
};

/// Memory (one process) or Redis behind a circuit breaker (replicas).
pub enum AnyStore {
    /// Budgets in this process.
    Memory(MemoryStore),
    /// Budgets shared by every replica on one Redis.
    Redis(Guarded<RedisStore>),
}

impl AnyStore {
    /// The memory store on `clock`.
    pub fn memory(clock: SystemClock) -> Self {
        AnyStore::Memory(MemoryStore::with_clock(MemoryConfig::default(), clock))
    }

    /// Connects to Redis at `url`, waiting at most `timeout` per decision.
    ///
    /// # Errors
    /// The store's, when Redis cannot be reached at start.
    pub async fn redis(url: &str, timeout: std::time::Duration) -> Result<Self, StoreError> {
        let mut config = RedisConfig::new(url);
        config.timeout = timeout;
        Ok(AnyStore::Redis(Guarded::new(
            RedisStore::connect(config).await?,
        )))
    }

    /// Drops stale cells of an in-process store (Redis expires its own keys).
    pub fn reclaim(&self) {
        if let AnyStore::Memory(m) = self {
            m.reclaim();
        }
    }

    /// For `/status`: the kind of store and, for Redis, its breaker's state.
    pub fn describe_state(&self) -> serde_json::Value {
        match self {
            AnyStore::Memory(m) => serde_json::json!({ "kind": "memory", "cells": m.len() }),
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
            AnyStore::Memory(m) => m.decide(budgets).await,
            AnyStore::Redis(r) => r.decide(budgets).await,
        }
    }

    async fn peek(&self, budgets: &[Budget]) -> Result<Decision, StoreError> {
        match self {
            AnyStore::Memory(m) => m.peek(budgets).await,
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
            AnyStore::Memory(m) => m.adjust(budget, delta, reserved_at).await,
            AnyStore::Redis(r) => r.adjust(budget, delta, reserved_at).await,
        }
    }
}
