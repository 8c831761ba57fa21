//! Usage rows: the names of the counts a period holds, so that they can be
//! listed (a billing export reads every row of a month) where the counts
//! themselves are only ever looked up by key.
//!
//! A row is an opaque string (the edge writes `["2026-12-04","acme","gpt-4o*"]`:
//! a day, a workspace and a model) noted in its period (`2026-12`) before any
//! count of it is charged, so a listing of the period names every row whose
//! counts are not zero. A period holds at most the bound its caller gives
//! ([`UsageRowBound::max_rows`]); past it a new row is not noted
//! ([`BudgetStore::note_usage_row`] answers `false`) and the caller counts it
//! elsewhere. Each period is dropped at its [`UsageRowBound::kept_until`].
//!
//! Where the rows live follows where the counts do: in this process for
//! [`MemoryStore`](crate::MemoryStore), in the embedded durable store for
//! [`LocalStore`](crate::LocalStore) with a quota book (written and on disk
//! before the call returns), and in one Redis set per period for
//! [`RedisStore`](crate::RedisStore) (one answer on every replica).
//!
//! ```
//! use sluice_store::{BudgetStore, MemoryConfig, MemoryStore, UsageRowBound};
//!
//! # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
//! let store = MemoryStore::new(MemoryConfig::default());
//! let bound = UsageRowBound { max_rows: 2, kept_until: u64::MAX };
//! assert!(store.note_usage_row("2026-12", "a", bound).await.unwrap());
//! assert!(store.note_usage_row("2026-12", "b", bound).await.unwrap());
//! assert!(store.note_usage_row("2026-12", "a", bound).await.unwrap()); // already there
//! assert!(!store.note_usage_row("2026-12", "c", bound).await.unwrap()); // full
//! let page = store.usage_rows("2026-12", None, 10).await.unwrap();
//! assert_eq!(page.rows, ["a", "b"]);
//! assert!(page.next.is_none());
//! # });
//! ```

use std::collections::{BTreeMap, BTreeSet};

use parking_lot::Mutex;

/// The most rows [`BudgetStore::usage_rows`](crate::BudgetStore::usage_rows)
/// answers in one page, whatever was asked.
pub const MAX_ROWS_PAGE: usize = 1_000;

/// How many rows a period may hold, and when it is dropped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UsageRowBound {
    /// The most rows the period holds; a new row past it is not noted.
    pub max_rows: usize,
    /// Unix seconds: the period and its rows are dropped from then on.
    pub kept_until: u64,
}

/// One page of a period's rows (see
/// [`BudgetStore::usage_rows`](crate::BudgetStore::usage_rows)).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UsageRowsPage {
    /// The rows of this page (a row may, on Redis, be given twice across pages
    /// when the set grew while it was read: a reader skips those it has seen).
    pub rows: Vec<String>,
    /// Where the next page starts; `None` when this was the last.
    pub next: Option<String>,
}

/// The rows of every period, in this process.
#[derive(Debug, Default)]
pub(crate) struct MemoryRows {
    periods: Mutex<BTreeMap<String, (u64, BTreeSet<String>)>>,
}

impl MemoryRows {
    /// Notes `row` in `period` at `now` (Unix seconds): true when it is there
    /// (already, or now), false when the period is full.
    pub(crate) fn note(&self, period: &str, row: &str, bound: UsageRowBound, now: u64) -> bool {
        let mut periods = self.periods.lock();
        periods.retain(|_, (until, _)| *until > now);
        if bound.kept_until <= now {
            return false;
        }
        let (_, rows) = periods
            .entry(period.to_owned())
            .or_insert_with(|| (bound.kept_until, BTreeSet::new()));
        if rows.contains(row) {
            return true;
        }
        if rows.len() >= bound.max_rows {
            return false;
        }
        rows.insert(row.to_owned());
        true
    }

    /// The rows of `period` after `after` (in order), at most `count`.
    pub(crate) fn page(&self, period: &str, after: Option<&str>, count: usize) -> UsageRowsPage {
        let periods = self.periods.lock();
        let Some((_, rows)) = periods.get(period) else {
            return UsageRowsPage::default();
        };
        page_of(
            rows.iter().map(String::as_str),
            after,
            count.clamp(1, MAX_ROWS_PAGE),
        )
    }
}

/// The page of `rows` (in order) after `after`, at most `count`.
pub(crate) fn page_of<'r>(
    rows: impl Iterator<Item = &'r str>,
    after: Option<&str>,
    count: usize,
) -> UsageRowsPage {
    let mut page: Vec<String> = rows
        .filter(|r| after.is_none_or(|a| *r > a))
        .take(count + 1)
        .map(str::to_owned)
        .collect();
    let more = page.len() > count;
    page.truncate(count);
    UsageRowsPage {
        next: if more { page.last().cloned() } else { None },
        rows: page,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_go_through_every_row_once_in_order() {
        let rows = MemoryRows::default();
        let bound = UsageRowBound {
            max_rows: 100,
            kept_until: 10,
        };
        for i in 0..25 {
            assert!(rows.note("p", &format!("r{i:02}"), bound, 0));
        }
        let mut seen = Vec::new();
        let mut after = None;
        loop {
            let page = rows.page("p", after.as_deref(), 10);
            seen.extend(page.rows);
            match page.next {
                Some(n) => after = Some(n),
                None => break,
            }
        }
        assert_eq!(seen.len(), 25);
        assert!(seen.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn a_period_past_its_date_is_dropped() {
        let rows = MemoryRows::default();
        let bound = UsageRowBound {
            max_rows: 100,
            kept_until: 10,
        };
        assert!(rows.note("old", "r", bound, 0));
        let later = UsageRowBound {
            max_rows: 100,
            kept_until: 20,
        };
        assert!(rows.note("new", "r", later, 10));
        assert!(rows.page("old", None, 10).rows.is_empty());
        assert_eq!(rows.page("new", None, 10).rows, ["r"]);
    }
}
