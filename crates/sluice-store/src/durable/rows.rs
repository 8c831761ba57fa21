//! The usage rows of each period (see [`crate::UsageRowBound`]) in the
//! embedded durable store: one redb table of rows, one of periods (each with
//! its row count and the date it is dropped at).

use redb::{ReadableDatabase as _, ReadableTable as _, TableDefinition};

use super::DurableStore;
use crate::{StoreError, UsageRowBound, UsageRowsPage};

/// `<period>\u{1f}<row>` → nothing (a row is its key).
const USAGE_ROWS: TableDefinition<'_, &str, ()> = TableDefinition::new("usage_rows");

/// `<period>` → (rows held, Unix second it is dropped at).
const USAGE_PERIODS: TableDefinition<'_, &str, (u64, u64)> = TableDefinition::new("usage_periods");

/// Between a period and its row in a row's key: a byte no period holds.
const SEPARATOR: char = '\u{1f}';

fn unavailable(e: impl std::fmt::Display) -> StoreError {
    StoreError::Unavailable(format!("usage rows: {e}"))
}

/// The first key after every row of `period` (the separator's successor).
fn end_of(period: &str) -> String {
    format!("{period}\u{20}")
}

impl DurableStore {
    /// Notes `row` in `period` at `now` (Unix seconds), durably: true when it is
    /// there (already, or now, committed to disk), false when the period is
    /// full. Periods past their date are dropped first. Blocking (a write
    /// transaction and its commit): call it off an async worker.
    ///
    /// # Errors
    /// [`StoreError::Unavailable`] when the store cannot be written (a full
    /// disk: the store is opened again for the next call).
    pub fn note_usage_row(
        &self,
        period: &str,
        row: &str,
        bound: UsageRowBound,
        now: u64,
    ) -> Result<bool, StoreError> {
        let db = self
            .db()
            .ok_or_else(|| unavailable("the store is not open"))?;
        let key = format!("{period}{SEPARATOR}{row}");
        if let Ok(tx) = db.begin_read()
            && let Ok(rows) = tx.open_table(USAGE_ROWS)
            && rows.get(key.as_str()).ok().flatten().is_some()
        {
            return Ok(true);
        }
        let written = (|| -> Result<bool, redb::Error> {
            let tx = db.begin_write()?;
            let noted = {
                let mut periods = tx.open_table(USAGE_PERIODS)?;
                let mut rows = tx.open_table(USAGE_ROWS)?;
                let stale: Vec<String> = periods
                    .iter()?
                    .filter_map(Result::ok)
                    .filter(|(_, v)| v.value().1 <= now)
                    .map(|(k, _)| k.value().to_owned())
                    .collect();
                for p in &stale {
                    let start = format!("{p}{SEPARATOR}");
                    rows.retain_in(start.as_str()..end_of(p).as_str(), |_, ()| false)?;
                    periods.remove(p.as_str())?;
                }
                let held = periods.get(period)?.map(|v| v.value());
                let (count, until) = held.unwrap_or((0, bound.kept_until));
                if bound.kept_until <= now {
                    false
                } else if rows.get(key.as_str())?.is_some() {
                    true
                } else if usize::try_from(count).unwrap_or(usize::MAX) >= bound.max_rows {
                    false
                } else {
                    rows.insert(key.as_str(), ())?;
                    periods.insert(period, (count + 1, until))?;
                    true
                }
            };
            tx.commit()?;
            Ok(noted)
        })();
        written.map_err(|e| {
            if super::is_storage_full(&e) {
                drop(db);
                // A failed write leaves the handle unusable until opened again.
                let _ = self.reopen();
            }
            unavailable(e)
        })
    }

    /// A page of the rows of `period` after `after` (in order), at most `count`
    /// (and [`crate::MAX_ROWS_PAGE`]).
    ///
    /// # Errors
    /// [`StoreError::Unavailable`] when the store cannot be read.
    pub fn usage_rows(
        &self,
        period: &str,
        after: Option<&str>,
        count: usize,
    ) -> Result<UsageRowsPage, StoreError> {
        let db = self
            .db()
            .ok_or_else(|| unavailable("the store is not open"))?;
        let tx = db.begin_read().map_err(unavailable)?;
        let rows = match tx.open_table(USAGE_ROWS) {
            Ok(rows) => rows,
            Err(redb::TableError::TableDoesNotExist(_)) => return Ok(UsageRowsPage::default()),
            Err(e) => return Err(unavailable(e)),
        };
        let prefix = format!("{period}{SEPARATOR}");
        let start = match after {
            Some(a) => format!("{prefix}{a}"),
            None => prefix.clone(),
        };
        let end = end_of(period);
        let mut keys = Vec::new();
        let count = count.clamp(1, crate::MAX_ROWS_PAGE);
        for entry in rows
            .range(start.as_str()..end.as_str())
            .map_err(unavailable)?
        {
            let (k, _) = entry.map_err(unavailable)?;
            let key = k.value();
            let Some(row) = key.strip_prefix(prefix.as_str()) else {
                continue;
            };
            if after.is_some_and(|a| row <= a) {
                continue;
            }
            keys.push(row.to_owned());
            if keys.len() > count {
                break;
            }
        }
        Ok(crate::rows::page_of(
            keys.iter().map(String::as_str),
            None,
            count,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "sluice-rows-{name}-{}-{}",
            std::process::id(),
            fastrand::u64(..)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn rows_survive_a_reopen_are_bounded_and_dropped_at_their_date() {
        let dir = temp_dir("reopen");
        let bound = UsageRowBound {
            max_rows: 3,
            kept_until: 100,
        };
        {
            let store = DurableStore::open(&dir).expect("the store answers");
            for r in ["a", "b", "c"] {
                assert!(
                    store
                        .note_usage_row("2026-12", r, bound, 0)
                        .expect("the store answers")
                );
            }
            assert!(
                store
                    .note_usage_row("2026-12", "a", bound, 0)
                    .expect("the store answers")
            );
            assert!(
                !store
                    .note_usage_row("2026-12", "d", bound, 0)
                    .expect("the store answers")
            );
            // Another period has its own bound.
            assert!(
                store
                    .note_usage_row("2026-11", "d", bound, 0)
                    .expect("the store answers")
            );
        }
        let store = DurableStore::open(&dir).expect("the store answers");
        let page = store
            .usage_rows("2026-12", None, 2)
            .expect("the store answers");
        assert_eq!(page.rows, ["a", "b"]);
        let rest = store
            .usage_rows("2026-12", page.next.as_deref(), 2)
            .expect("the store answers");
        assert_eq!(rest.rows, ["c"]);
        assert!(rest.next.is_none());
        assert_eq!(
            store
                .usage_rows("2026-11", None, 9)
                .expect("the store answers")
                .rows,
            ["d"]
        );
        assert!(
            store
                .usage_rows("2026-10", None, 9)
                .expect("the store answers")
                .rows
                .is_empty()
        );
        // At its date a period goes, with its rows.
        let later = UsageRowBound {
            max_rows: 3,
            kept_until: 200,
        };
        assert!(
            store
                .note_usage_row("2027-01", "x", later, 100)
                .expect("the store answers")
        );
        assert!(
            store
                .usage_rows("2026-12", None, 9)
                .expect("the store answers")
                .rows
                .is_empty()
        );
        drop(store);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
