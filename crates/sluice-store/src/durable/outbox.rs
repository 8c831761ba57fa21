//! An outbox in the embedded durable store: records by key, each written and on
//! disk before the call returns, read back whole when a process starts (the
//! gateway keeps its alert events here, SPEC O3). The caller bounds how many it
//! keeps.

use redb::{ReadableDatabase as _, ReadableTable as _, TableDefinition};

use super::DurableStore;
use crate::StoreError;

/// Record key → its bytes.
const OUTBOX: TableDefinition<'_, &str, &[u8]> = TableDefinition::new("outbox");

fn unavailable(e: impl std::fmt::Display) -> StoreError {
    StoreError::Unavailable(format!("outbox: {e}"))
}

impl DurableStore {
    /// Writes `records` (key and bytes; a key already there is replaced) and
    /// removes `gone`, in one transaction committed to disk before it returns.
    /// Blocking: call it off an async worker.
    ///
    /// # Errors
    /// [`StoreError::Unavailable`] when the store cannot be written (a full disk:
    /// the store is opened again for the next call).
    pub fn outbox_write(&self, records: &[(&str, &[u8])], gone: &[&str]) -> Result<(), StoreError> {
        let db = self
            .db()
            .ok_or_else(|| unavailable("the store is not open"))?;
        let written = (|| -> Result<(), redb::Error> {
            let tx = db.begin_write()?;
            {
                let mut table = tx.open_table(OUTBOX)?;
                for (key, bytes) in records {
                    table.insert(*key, *bytes)?;
                }
                for key in gone {
                    table.remove(*key)?;
                }
            }
            tx.commit()?;
            Ok(())
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

    /// Every record of the outbox, at most `max` (in key order).
    ///
    /// # Errors
    /// [`StoreError::Unavailable`] when the store cannot be read.
    pub fn outbox_read(&self, max: usize) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
        let db = self
            .db()
            .ok_or_else(|| unavailable("the store is not open"))?;
        let tx = db.begin_read().map_err(unavailable)?;
        let table = match tx.open_table(OUTBOX) {
            Ok(t) => t,
            Err(redb::TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
            Err(e) => return Err(unavailable(e)),
        };
        let mut out = Vec::new();
        for entry in table.iter().map_err(unavailable)?.take(max) {
            let (k, v) = entry.map_err(unavailable)?;
            out.push((k.value().to_owned(), v.value().to_vec()));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_survive_a_reopen_and_go_when_removed() {
        let dir = std::env::temp_dir().join(format!(
            "sluice-outbox-{}-{}",
            std::process::id(),
            fastrand::u64(..)
        ));
        {
            let store = DurableStore::open(&dir).expect("open");
            assert!(store.outbox_read(10).expect("read").is_empty());
            store
                .outbox_write(&[("a", b"1"), ("b", b"2")], &[])
                .expect("write");
            store.outbox_write(&[("a", b"3")], &["b"]).expect("write");
        }
        let store = DurableStore::open(&dir).expect("reopen");
        assert_eq!(
            store.outbox_read(10).expect("read"),
            [("a".to_owned(), b"3".to_vec())]
        );
        drop(store);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
