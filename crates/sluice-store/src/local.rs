//! One process's store: budgets in memory, monthly quotas (and counts kept
//! until a date) in the embedded durable store when one is given.

use sluice_core::{
    Budget, BudgetStatus, Clock, Decision, MAX_BUDGETS, Mode, Rate, SystemClock, Timestamp,
};

use crate::durable::QuotaBook;
use crate::{BudgetStore, MemoryStore, StoreError};

/// Budgets in memory and, with a [`QuotaBook`], monthly quotas
/// ([`Rate::CalendarMonth`] budgets) and counts kept until a date
/// ([`Rate::until`], e.g. an LLM gateway's usage per month) durable on disk.
///
/// A decision over both is all or nothing: the quotas are looked at first, the
/// memory budgets decided only when the quotas fit, and the quotas spent only
/// when the memory budgets admitted — all under the book's lock. A decision
/// that spent a quota returns only once the count is on disk (see
/// [`QuotaBook::durable`]).
pub struct LocalStore<C: Clock = SystemClock> {
    memory: MemoryStore<C>,
    book: Option<QuotaBook>,
}

impl<C: Clock> std::fmt::Debug for LocalStore<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalStore")
            .field("book", &self.book)
            .finish_non_exhaustive()
    }
}

impl<C: Clock> LocalStore<C> {
    /// A store over `memory`, with quotas in `book` when given (else in memory).
    pub fn new(memory: MemoryStore<C>, book: Option<QuotaBook>) -> Self {
        LocalStore { memory, book }
    }

    /// The memory store.
    pub fn memory(&self) -> &MemoryStore<C> {
        &self.memory
    }

    /// The quota book, when quotas are durable.
    pub fn book(&self) -> Option<&QuotaBook> {
        self.book.as_ref()
    }

    async fn decide_mode(
        &self,
        budgets: &[Budget],
        mode: Mode,
        network: u64,
    ) -> Result<Decision, StoreError> {
        let Some(book) = &self.book else {
            return self.memory_mode(budgets, mode, network);
        };
        if !budgets.iter().any(is_monthly) {
            return self.memory_mode(budgets, mode, network);
        }
        if budgets.len() > MAX_BUDGETS {
            return Err(sluice_core::DecisionError::TooManyBudgets {
                given: budgets.len(),
            }
            .into());
        }
        let quotas: arrayvec::ArrayVec<Budget, MAX_BUDGETS> =
            budgets.iter().filter(|b| is_monthly(b)).copied().collect();
        let others: arrayvec::ArrayVec<Budget, MAX_BUDGETS> =
            budgets.iter().filter(|b| !is_monthly(b)).copied().collect();
        let now = self.memory.clock().now();
        let (quota_decision, other_decision, seq) = book.decide_with(&quotas, now, mode, |m| {
            self.memory_mode(&others, m, network)
        })?;
        if let Some(seq) = seq {
            book.durable(seq).await?;
        }
        // The statuses back in the order the budgets were given.
        let (mut q, mut o) = (
            quota_decision.statuses().iter(),
            other_decision.statuses().iter(),
        );
        let statuses = budgets.iter().filter_map(|b| {
            if is_monthly(b) {
                q.next().copied()
            } else {
                o.next().copied()
            }
        });
        let at = if others.is_empty() {
            quota_decision.decided_at()
        } else {
            other_decision.decided_at()
        };
        Ok(Decision::from_statuses(at, statuses))
    }

    fn memory_mode(
        &self,
        budgets: &[Budget],
        mode: Mode,
        network: u64,
    ) -> Result<Decision, StoreError> {
        match mode {
            Mode::Spend => self.memory.decide_now_from(budgets, network),
            Mode::Peek => self.memory.peek_now_from(budgets, network),
        }
    }
}

/// Whether `b` lives in the book: a monthly quota or a count kept until a date.
fn is_monthly(b: &Budget) -> bool {
    b.rate == Rate::CalendarMonth || b.rate.is_until()
}

impl<C: Clock> BudgetStore for LocalStore<C> {
    async fn decide(&self, budgets: &[Budget]) -> Result<Decision, StoreError> {
        self.decide_mode(budgets, Mode::Spend, crate::NO_NETWORK)
            .await
    }

    async fn peek(&self, budgets: &[Budget]) -> Result<Decision, StoreError> {
        self.decide_mode(budgets, Mode::Peek, crate::NO_NETWORK)
            .await
    }

    async fn adjust(
        &self,
        budget: &Budget,
        delta: i64,
        reserved_at: Timestamp,
    ) -> Result<BudgetStatus, StoreError> {
        self.adjust_from(budget, delta, reserved_at, crate::NO_NETWORK)
            .await
    }

    async fn decide_from(&self, budgets: &[Budget], network: u64) -> Result<Decision, StoreError> {
        self.decide_mode(budgets, Mode::Spend, network).await
    }

    async fn peek_from(&self, budgets: &[Budget], network: u64) -> Result<Decision, StoreError> {
        self.decide_mode(budgets, Mode::Peek, network).await
    }

    async fn adjust_from(
        &self,
        budget: &Budget,
        delta: i64,
        reserved_at: Timestamp,
        network: u64,
    ) -> Result<BudgetStatus, StoreError> {
        match &self.book {
            Some(book) if is_monthly(budget) => {
                let now = self.memory.clock().now();
                let (status, seq) = book.adjust(budget, delta, reserved_at, now);
                if let Some(seq) = seq {
                    book.durable(seq).await?;
                }
                Ok(status)
            }
            _ => Ok(self
                .memory
                .adjust_now_from(budget, delta, reserved_at, network)),
        }
    }

    async fn adjust_all_from(
        &self,
        changes: &[(Budget, i64)],
        reserved_at: Timestamp,
        network: u64,
    ) -> Result<Vec<BudgetStatus>, StoreError> {
        // The monthly changes in the book at once (one journal append), the others
        // in memory; then one wait for the book's to be durable.
        let book = self.book.as_ref();
        let monthly: Vec<(&Budget, i64)> = changes
            .iter()
            .filter(|(budget, _)| book.is_some() && is_monthly(budget))
            .map(|(budget, delta)| (budget, *delta))
            .collect();
        let (mut booked, seq) = match book {
            Some(book) if !monthly.is_empty() => {
                let now = self.memory.clock().now();
                book.adjust_many(&monthly, reserved_at, now)
            }
            _ => (Vec::new(), None),
        };
        let mut booked = booked.drain(..);
        let mut statuses = Vec::with_capacity(changes.len());
        for (budget, delta) in changes {
            let status = if book.is_some() && is_monthly(budget) {
                booked.next()
            } else {
                None
            };
            statuses.push(status.unwrap_or_else(|| {
                self.memory
                    .adjust_now_from(budget, *delta, reserved_at, network)
            }));
        }
        if let (Some(book), Some(seq)) = (book, seq) {
            book.durable(seq).await?;
        }
        Ok(statuses)
    }

    async fn note_usage_row(
        &self,
        period: &str,
        row: &str,
        bound: crate::UsageRowBound,
    ) -> Result<bool, StoreError> {
        let Some(book) = &self.book else {
            return Ok(self.memory.note_usage_row_now(period, row, bound));
        };
        let store = book.store().clone();
        let now = self.memory.clock().now().as_secs();
        let (period, row) = (period.to_owned(), row.to_owned());
        // A write transaction and its commit: off the async workers.
        tokio::task::spawn_blocking(move || store.note_usage_row(&period, &row, bound, now))
            .await
            .map_err(|e| StoreError::Unavailable(format!("usage rows: {e}")))?
    }

    async fn usage_rows(
        &self,
        period: &str,
        after: Option<&str>,
        count: usize,
    ) -> Result<crate::UsageRowsPage, StoreError> {
        match &self.book {
            Some(book) => book.store().usage_rows(period, after, count),
            None => Ok(self.memory.usage_rows_now(period, after, count)),
        }
    }

    /// Kept in memory: a hold lasts at most a day and is the provider's word
    /// of the moment, not a count to survive a restart.
    async fn hold(
        &self,
        key: &sluice_core::BudgetKey,
        for_: std::time::Duration,
    ) -> Result<(), StoreError> {
        self.memory.hold_now(key, for_);
        Ok(())
    }

    async fn held(
        &self,
        keys: &[sluice_core::BudgetKey],
    ) -> Result<Vec<std::time::Duration>, StoreError> {
        Ok(self.memory.held_now(keys))
    }
}
