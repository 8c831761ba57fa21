//! Shared helpers for the integration tests.
#![allow(dead_code, unreachable_pub, clippy::unwrap_used)]

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use sluice_client::config::{
    LimitsSource, PaceConfig, ProviderConfig, ProviderLimits, StaticLimits,
};
use sluice_client::{Pacer, TEST_EPOCH, TokioClock};
use sluice_core::{Budget, BudgetKey, BudgetStatus, Decision, Timestamp};
use sluice_store::{BudgetStore, MemoryConfig, MemoryStore, StoreError};

pub type TestPacer = Pacer<MemoryStore<TokioClock>, TokioClock>;

pub fn limits(tpm: u32, rpm: u32, rpd: u32) -> ProviderLimits {
    ProviderLimits::new(tpm, rpm, rpd)
}

pub fn provider(name: &str, l: ProviderLimits) -> ProviderConfig {
    ProviderConfig::new(name, "http://127.0.0.1:9/v1", l)
}

/// A pacer on paused tokio time anchored at [`TEST_EPOCH`].
pub fn pacer_with(providers: impl IntoIterator<Item = ProviderConfig>) -> (TestPacer, TokioClock) {
    let clock = TokioClock::at(TEST_EPOCH);
    let store = MemoryStore::with_clock(MemoryConfig::default(), clock);
    let source: Arc<dyn LimitsSource> =
        Arc::new(StaticLimits::new(PaceConfig::from_providers(providers)));
    (Pacer::with_store(store, clock, source), clock)
}

pub fn pacer(l: ProviderLimits) -> (TestPacer, TokioClock) {
    pacer_with([provider("p", l)])
}

pub fn at(ms: u64) -> Timestamp {
    TEST_EPOCH.saturating_add(Duration::from_millis(ms))
}

pub fn ms_since_epoch(t: Timestamp) -> u64 {
    t.saturating_since(TEST_EPOCH).as_millis() as u64
}

/// A fresh directory under the system's temporary directory.
pub fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "sluice-client-{name}-{}-{}",
        std::process::id(),
        fastrand_u64()
    ));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn fastrand_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(7);
    h.finish()
}

/// One store shared by several pacers, as a Redis store would be shared by
/// several processes (SPEC C7).
#[derive(Clone)]
pub struct SharedStore(pub Arc<MemoryStore<TokioClock>>);

impl BudgetStore for SharedStore {
    fn decide(
        &self,
        budgets: &[Budget],
    ) -> impl Future<Output = Result<Decision, StoreError>> + Send {
        self.0.decide(budgets)
    }
    fn peek(
        &self,
        budgets: &[Budget],
    ) -> impl Future<Output = Result<Decision, StoreError>> + Send {
        self.0.peek(budgets)
    }
    fn adjust(
        &self,
        budget: &Budget,
        delta: i64,
        reserved_at: Timestamp,
    ) -> impl Future<Output = Result<BudgetStatus, StoreError>> + Send {
        self.0.adjust(budget, delta, reserved_at)
    }
    fn hold(
        &self,
        key: &BudgetKey,
        for_: Duration,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        self.0.hold(key, for_)
    }
    fn held(
        &self,
        keys: &[BudgetKey],
    ) -> impl Future<Output = Result<Vec<Duration>, StoreError>> + Send {
        self.0.held(keys)
    }
}
