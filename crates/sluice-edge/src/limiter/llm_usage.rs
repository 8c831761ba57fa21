//! What LLM calls spent, per workspace and calendar month (SPEC T6): counted
//! in the budget store when a call settles at its usage — durable on the
//! embedded store, one count on every replica with Redis — and read back for
//! the admin listener's `GET /usage`, for the current month or one of the
//! [`USAGE_MONTHS_KEPT`] before it. Models are counted by the policy's
//! `prices:` entries (a model, or a family `gpt-4o*`); calls of a model with no
//! price are counted under `other`.
//!
//! Each count is a budget keyed by its month, its model and its direction
//! (`llm-usage:2026-12:gpt-4o*:output`, by workspace) whose rate is
//! [`Rate::until`] the first day of the month [`USAGE_MONTHS_KEPT`] + 1 months
//! later: it never resets within its month or after it, and every store drops it
//! at that date (the memory store's sweep, the durable book, Redis's
//! `EXPIREAT`). A key could name a day the same way (`llm-usage:2026-12-04:…`).

use std::fmt;
use std::str::FromStr;

use sluice_core::{Budget, BudgetKey, Clock as _, MAX_BUDGETS, Rate, Timestamp, digest};
use sluice_store::BudgetStore;
use sluice_tokens::Usage;

use super::{Limiter, QuotaQueryError};
use crate::plan::Plan;

/// The counters of one model (or family): input not from the cache, cached
/// input, output, and money units.
const DIRECTIONS: [&str; 4] = ["input", "cached_input", "output", "spend"];

/// The model key of calls with no price.
pub(super) const OTHER: &str = "other";

/// Months of LLM usage kept before the current one: a month's counts can be read
/// until the end of the twelfth month after it, and are dropped from the store
/// when the thirteenth begins.
pub const USAGE_MONTHS_KEPT: u32 = 12;

/// A calendar month (UTC) of LLM usage, as `GET /usage?month=YYYY-MM` names it.
///
/// ```
/// use sluice_edge::UsageMonth;
///
/// let month: UsageMonth = "2026-12".parse().unwrap();
/// assert_eq!(month.to_string(), "2026-12");
/// assert!("2026-13".parse::<UsageMonth>().is_err());
/// assert!("2026-1".parse::<UsageMonth>().is_err());
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct UsageMonth {
    year: u16,
    month: u8,
    /// Its first second (Unix seconds).
    start: u64,
}

/// A month that does not read as `YYYY-MM` (a year from 1970 to 2500, a month
/// from 01 to 12).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("not a month: expected YYYY-MM (e.g. 2026-12), got {0:?}")]
pub struct UsageMonthError(pub String);

impl UsageMonth {
    /// The month that holds `t`.
    pub fn of(t: Timestamp) -> UsageMonth {
        let m = sluice_core::month_of(t);
        UsageMonth {
            year: u16::try_from(m.year).unwrap_or(u16::MAX),
            month: u8::try_from(m.month).unwrap_or(12),
            start: m.start,
        }
    }

    /// Its first second (Unix seconds).
    pub fn start(self) -> u64 {
        self.start
    }

    /// Months since January 1970.
    fn index(self) -> u32 {
        u32::from(self.year).saturating_sub(1970) * 12 + u32::from(self.month) - 1
    }

    /// When its counts are dropped: the first second of the month
    /// [`USAGE_MONTHS_KEPT`] + 1 months later.
    pub fn kept_until(self) -> u64 {
        let later = self.index() + USAGE_MONTHS_KEPT + 1;
        sluice_core::MonthPeriod::new(i64::from(1970 + later / 12), later % 12 + 1)
            .map_or(u64::MAX, |m| m.start)
    }

    /// True when its counts are still kept in `current`.
    pub fn kept_in(self, current: UsageMonth) -> bool {
        self.index() + USAGE_MONTHS_KEPT >= current.index()
    }
}

impl FromStr for UsageMonth {
    type Err = UsageMonthError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || UsageMonthError(s.chars().take(32).collect());
        let (year, month) = s.split_once('-').ok_or_else(bad)?;
        let digits = |p: &str, n: usize| p.len() == n && p.bytes().all(|b| b.is_ascii_digit());
        if !digits(year, 4) || !digits(month, 2) {
            return Err(bad());
        }
        let (year, month): (u16, u8) = (
            year.parse().map_err(|_| bad())?,
            month.parse().map_err(|_| bad())?,
        );
        let period =
            sluice_core::MonthPeriod::new(i64::from(year), u32::from(month)).ok_or_else(bad)?;
        Ok(UsageMonth {
            year,
            month,
            start: period.start,
        })
    }
}

impl fmt::Display for UsageMonth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:04}-{:02}", self.year, self.month)
    }
}

/// The count of `direction` of calls of `model` by `workspace` in `month`.
fn counter(month: UsageMonth, model: &str, direction: &str, workspace: u64, n: u32) -> Budget {
    counted(
        month,
        direction_digest(month, model, direction),
        workspace,
        n,
    )
}

/// The count named `name` (a digest of [`direction_digest`]) of `workspace`,
/// charged `n`.
fn counted(month: UsageMonth, name: u64, workspace: u64, n: u32) -> Budget {
    Budget {
        key: BudgetKey::from_digests(name, workspace),
        rate: Rate::until(month.kept_until()),
        limit: u32::MAX,
        cost: n,
    }
}

/// The digest naming the count of `model`'s `direction` in `month`.
fn direction_digest(month: UsageMonth, model: &str, direction: &str) -> u64 {
    digest(format!("llm-usage:{month}:{model}:{direction}").as_bytes())
}

/// The digests naming the counts of `model`'s [`DIRECTIONS`] in `month`.
pub(super) fn direction_digests(month: UsageMonth, model: &str) -> [u64; 4] {
    DIRECTIONS.map(|d| direction_digest(month, model, d))
}

impl<S: BudgetStore> Limiter<S> {
    /// What an LLM call of `plan` spent, as its upstream reported it: input not
    /// from the cache, cached input, output, and money units (at its price; 0
    /// with none).
    pub(super) fn usage_amounts(&self, plan: &Plan, usage: &Usage) -> [u32; 4] {
        let spend = plan
            .price
            .and_then(|i| self.policy.prices.get(usize::from(i)))
            .map_or(0, |p| {
                p.cost(usage.prompt, usage.cached_input, usage.completion)
            });
        [
            usage.prompt.saturating_sub(usage.cached_input),
            usage.cached_input,
            usage.completion,
            spend,
        ]
    }

    /// What an LLM call of `plan` that ended without a `usage` (a stream cut,
    /// an answer naming none) is counted as having spent: what its budgets keep
    /// of its reservation — its estimated input, the output it named (else its
    /// first token budget's `default_max_output`), and the money its first money
    /// budget reserved (else, with a price, that price of those tokens) — so
    /// that `/usage` and the usage export count what the budgets did. `None`
    /// for a call that reserved nothing.
    pub(super) fn reserved_amounts(&self, plan: &Plan) -> Option<[u32; 4]> {
        let reservation = plan.reservation?;
        let token_budget = |priced: bool| {
            plan.kinds.iter().zip(&plan.budgets).find_map(|(kind, b)| {
                let crate::BudgetKind::Bucket(i) = kind else {
                    return None;
                };
                let tokens = self
                    .policy
                    .buckets
                    .get(crate::plan::policy_index(*i))?
                    .tokens?;
                (tokens.priced == priced).then_some((tokens.default_max_output, b.cost))
            })
        };
        let output = reservation
            .output
            .or_else(|| token_budget(false).map(|(default, _)| default))
            .or_else(|| token_budget(true).map(|(default, _)| default))
            .unwrap_or(0);
        let spend = token_budget(true)
            .map(|(_, reserved)| reserved)
            .or_else(|| {
                plan.price
                    .and_then(|i| self.policy.prices.get(usize::from(i)))
                    .map(|p| p.cost(reservation.input, 0, output))
            });
        Some([reservation.input, 0, output, spend.unwrap_or(0)])
    }

    /// The counters of what an LLM call of `plan` spent, as its upstream
    /// reported it (`counts`, see [`Limiter::usage_amounts`]), in its workspace's usage of the month of `admitted_at` (when
    /// the call was admitted, on the store's clock), each with its count as its
    /// cost: charged with the call's settlement, in the same store call. A count
    /// the store cannot take is lost, and counted in
    /// `sluice_llm_usage_failures_total`.
    pub(super) fn llm_usage_counts(
        &self,
        plan: &Plan,
        counts: [u32; 4],
        admitted_at: Timestamp,
    ) -> Vec<Budget> {
        let names = self.usage_names(plan, admitted_at);
        let month = UsageMonth::of(admitted_at);
        names
            .directions
            .iter()
            .zip(counts)
            .filter(|(_, n)| *n > 0)
            .map(|(name, n)| counted(month, *name, plan.from.workspace, n))
            .collect()
    }

    /// What the LLM calls of `workspace` (its label, as `X-Sluice-Workspace`
    /// names it) spent in `month` (`None`: the current month, on the store's
    /// clock): tokens by direction and US dollars, in all and by model, as JSON
    /// (`GET /usage`). A call counts in the month it was admitted in.
    ///
    /// Reads every model's four counts, [`MAX_BUDGETS`] to a store call (one or
    /// two calls for a few prices, one more when the current month is asked for
    /// just as it turns).
    ///
    /// # Errors
    /// [`QuotaQueryError`]: a label that names no workspace, a month after the
    /// current one or one no longer kept (more than [`USAGE_MONTHS_KEPT`] before
    /// it), or a store that cannot answer.
    pub async fn llm_usage(
        &self,
        workspace: &str,
        month: Option<UsageMonth>,
    ) -> Result<serde_json::Value, QuotaQueryError> {
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
        // The store's clock says which month is current; this process's guesses it.
        let guess =
            month.unwrap_or_else(|| UsageMonth::of(sluice_core::SystemClock::default().now()));
        let (mut used, now) = self.usage_counts(guess, &models, subject).await?;
        let current = UsageMonth::of(now);
        let month = match month {
            Some(m) if m > current => return Err(QuotaQueryError::FutureMonth(m)),
            Some(m) if !m.kept_in(current) => return Err(QuotaQueryError::MonthNotKept(m)),
            Some(m) => m,
            None if guess != current => {
                used = self.usage_counts(current, &models, subject).await?.0;
                current
            }
            None => current,
        };
        let usd = |units: u64| units as f64 / sluice_policy::MONEY_UNITS_PER_USD as f64;
        let mut total = [0u64; 4];
        let mut by_model = serde_json::Map::new();
        for (m, counts) in models.iter().zip(used.chunks(DIRECTIONS.len())) {
            for (t, c) in total.iter_mut().zip(counts) {
                *t += c;
            }
            if counts.iter().any(|&c| c > 0) {
                let count = |i: usize| counts.get(i).copied().unwrap_or(0);
                by_model.insert(
                    (*m).to_owned(),
                    serde_json::json!({
                        "input": count(0), "cached_input": count(1), "output": count(2),
                        "spend_usd": usd(count(3)),
                    }),
                );
            }
        }
        Ok(serde_json::json!({
            "workspace": workspace,
            "month": month.to_string(),
            "tokens": { "input": total[0], "cached_input": total[1], "output": total[2] },
            "spend_usd": usd(total[3]),
            "by_model": by_model,
        }))
    }

    /// The counts of `models` (each model's [`DIRECTIONS`] in order) of workspace
    /// `subject` in `month`, and when the store read them.
    async fn usage_counts(
        &self,
        month: UsageMonth,
        models: &[&str],
        subject: u64,
    ) -> Result<(Vec<u64>, Timestamp), QuotaQueryError> {
        let budgets: Vec<Budget> = models
            .iter()
            .flat_map(|m| {
                DIRECTIONS
                    .iter()
                    .map(move |d| counter(month, m, d, subject, 0))
            })
            .collect();
        let mut used = Vec::with_capacity(budgets.len());
        let mut now = Timestamp::from_secs(0);
        for part in budgets.chunks(MAX_BUDGETS) {
            let decision = self.store.peek(part).await?;
            now = now.max(decision.decided_at());
            used.extend(
                decision
                    .statuses()
                    .iter()
                    .map(|s| u64::from(s.limit - s.remaining)),
            );
        }
        Ok((used, now))
    }
}
