//! A circuit breaker in front of a store: once the store keeps
//! failing, decisions fail at once instead of each waiting for its timeout;
//! a probe now and then finds out when the store is back.

use std::time::Duration;

use parking_lot::Mutex;
use sluice_core::{
    Breaker, BreakerConfig, BreakerState, Budget, BudgetKey, BudgetStatus, Clock, Decision, Permit,
    SystemClock, Timestamp,
};

use crate::{BudgetStore, StoreError};

/// The breaker a shared store gets by default: three failures within a
/// second open it for 250 ms, so recovery is noticed well within a second.
pub const STORE_BREAKER: BreakerConfig =
    BreakerConfig::new(3, Duration::from_secs(1), Duration::from_millis(250));

/// `S` behind a circuit breaker.
pub struct Guarded<S, C: Clock = SystemClock> {
    inner: S,
    breaker: Mutex<Breaker>,
    clock: C,
}

impl<S> Guarded<S> {
    /// `inner` behind [`STORE_BREAKER`] on the real clock.
    pub fn new(inner: S) -> Self {
        Guarded::with_clock(inner, STORE_BREAKER, SystemClock::new())
    }
}

impl<S, C: Clock> Guarded<S, C> {
    /// `inner` behind a breaker configured by `config`, timed by `clock`.
    pub fn with_clock(inner: S, config: BreakerConfig, clock: C) -> Self {
        Guarded {
            inner,
            breaker: Mutex::new(Breaker::new(config)),
            clock,
        }
    }

    /// The guarded store.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// Where the breaker stands: `Closed` while the store answers.
    pub fn state(&self) -> BreakerState {
        self.breaker.lock().state()
    }

    fn permit(&self) -> Result<Timestamp, StoreError> {
        let now = self.clock.now();
        match self.breaker.lock().permit(now) {
            Permit::Call | Permit::Probe => Ok(now),
            Permit::Refused { retry_after } => Err(StoreError::Unavailable(format!(
                "the store's circuit breaker is open (next probe in {} ms)",
                retry_after.as_millis()
            ))),
        }
    }

    fn record<T>(&self, result: &Result<T, StoreError>) {
        match result {
            Ok(_) => self.breaker.lock().success(),
            Err(StoreError::Unavailable(_)) => self.breaker.lock().failure(self.clock.now()),
            Err(_) => {}
        }
    }
}

impl<S: BudgetStore, C: Clock> BudgetStore for Guarded<S, C> {
    async fn decide(&self, budgets: &[Budget]) -> Result<Decision, StoreError> {
        self.permit()?;
        let result = self.inner.decide(budgets).await;
        self.record(&result);
        result
    }

    fn leases(&self) -> bool {
        self.inner.leases()
    }

    async fn take_leases(
        &self,
        budgets: &[Budget],
        wants: &[u32],
        backs: &[(Budget, sluice_core::GiveBack)],
    ) -> Result<(Decision, Vec<u32>), StoreError> {
        if let Err(e) = self.permit() {
            // Not sent: the leftovers wait in the store for its recovery.
            self.inner.keep_give_backs(backs);
            return Err(e);
        }
        let result = self.inner.take_leases(budgets, wants, backs).await;
        self.record(&result);
        result
    }

    fn keep_give_backs(&self, backs: &[(Budget, sluice_core::GiveBack)]) {
        self.inner.keep_give_backs(backs);
    }

    fn holds_give_backs(&self) -> bool {
        self.inner.holds_give_backs()
    }

    async fn peek(&self, budgets: &[Budget]) -> Result<Decision, StoreError> {
        self.permit()?;
        let result = self.inner.peek(budgets).await;
        self.record(&result);
        result
    }

    async fn adjust(
        &self,
        budget: &Budget,
        delta: i64,
        reserved_at: Timestamp,
    ) -> Result<BudgetStatus, StoreError> {
        self.permit()?;
        let result = self.inner.adjust(budget, delta, reserved_at).await;
        self.record(&result);
        result
    }

    async fn adjust_all_from(
        &self,
        changes: &[(Budget, i64)],
        reserved_at: Timestamp,
        network: u64,
    ) -> Result<Vec<BudgetStatus>, StoreError> {
        self.permit()?;
        let result = self
            .inner
            .adjust_all_from(changes, reserved_at, network)
            .await;
        self.record(&result);
        result
    }

    async fn note_usage_row(
        &self,
        period: &str,
        row: &str,
        bound: crate::UsageRowBound,
    ) -> Result<bool, StoreError> {
        self.permit()?;
        let result = self.inner.note_usage_row(period, row, bound).await;
        self.record(&result);
        result
    }

    async fn usage_rows(
        &self,
        period: &str,
        after: Option<&str>,
        count: usize,
    ) -> Result<crate::UsageRowsPage, StoreError> {
        self.permit()?;
        let result = self.inner.usage_rows(period, after, count).await;
        self.record(&result);
        result
    }

    async fn hold(&self, key: &BudgetKey, for_: Duration) -> Result<(), StoreError> {
        self.permit()?;
        let result = self.inner.hold(key, for_).await;
        self.record(&result);
        result
    }

    async fn held(&self, keys: &[BudgetKey]) -> Result<Vec<Duration>, StoreError> {
        self.permit()?;
        let result = self.inner.held(keys).await;
        self.record(&result);
        result
    }
}
