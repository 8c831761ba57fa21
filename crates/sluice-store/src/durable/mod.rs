//! The embedded durable store: what must survive a restart or a crash of a
//! single `sluice serve` — monthly quota counts now (see [`QuotaBook`]), the
//! batch queue and its results later.
//!
//! One [redb](https://docs.rs/redb) file, `sluice.redb`, in a data directory.
//! redb locks the file: a second process opening the same directory gets
//! [`OpenError::Locked`] instead of two writers corrupting one file.
//!
//! ```
//! let dir = std::env::temp_dir().join(format!("sluice-doc-{}", std::process::id()));
//! let store = sluice_store::DurableStore::open(&dir).unwrap();
//! assert!(store.path().ends_with("sluice.redb"));
//! # drop(store); let _ = std::fs::remove_dir_all(&dir);
//! ```

mod quota;

use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use quota::{COMMIT_TIMEOUT, DEFAULT_MAX_QUOTA_CELLS, QuotaBook, QuotaBookConfig};

/// The file the store keeps in its data directory.
pub const DURABLE_FILE: &str = "sluice.redb";

/// Why the durable store could not be opened. Every variant names the path.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OpenError {
    /// The data directory could not be created or is not a directory.
    #[error("data directory {path}: {source}")]
    Directory {
        /// The directory.
        path: PathBuf,
        /// What the file system said.
        source: std::io::Error,
    },
    /// Another process has the store open.
    #[error(
        "{path} is in use by another process (one sluice per data directory: give each its own --data-dir)"
    )]
    Locked {
        /// The file.
        path: PathBuf,
    },
    /// The file exists but is not a store sluice can read, or cannot be written.
    #[error("{path}: {message}")]
    Unusable {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
}

/// An open embedded durable store.
#[derive(Clone)]
pub struct DurableStore {
    db: Arc<redb::Database>,
    path: PathBuf,
}

impl std::fmt::Debug for DurableStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DurableStore")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl DurableStore {
    /// Opens (creating when needed) the store in `dir`.
    ///
    /// # Errors
    /// [`OpenError`] naming the path: a directory that cannot be created, a file
    /// another process holds, a file that is corrupt or cannot be written.
    pub fn open(dir: &Path) -> Result<Self, OpenError> {
        std::fs::create_dir_all(dir).map_err(|source| OpenError::Directory {
            path: dir.to_owned(),
            source,
        })?;
        let path = dir.join(DURABLE_FILE);
        let db = redb::Database::create(&path).map_err(|e| match e {
            redb::DatabaseError::DatabaseAlreadyOpen => OpenError::Locked { path: path.clone() },
            other => OpenError::Unusable {
                path: path.clone(),
                message: other.to_string(),
            },
        })?;
        let store = DurableStore {
            db: Arc::new(db),
            path,
        };
        // A file opened read-only, or a full disk, shows at the first write: here,
        // at start, rather than at the first counted call.
        store.check_writable()?;
        Ok(store)
    }

    /// The store's file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The open database, for the tables of this crate's modules.
    pub(crate) fn db(&self) -> &Arc<redb::Database> {
        &self.db
    }

    fn check_writable(&self) -> Result<(), OpenError> {
        let unusable = |e: &dyn std::fmt::Display| OpenError::Unusable {
            path: self.path.clone(),
            message: format!("cannot be written: {e}"),
        };
        let tx = self.db.begin_write().map_err(|e| unusable(&e))?;
        quota::create_tables(&tx).map_err(|e| unusable(&e))?;
        tx.commit().map_err(|e| unusable(&e))
    }
}
