//! The embedded durable store: what must survive a restart or a crash of a
//! single `sluice serve` — monthly quota counts (see [`QuotaBook`]) and, in
//! the same file, the batch queue with its results (the `sluice-batch`
//! crate's `BatchBook`, which opens its tables through [`DurableStore::db`]).
//!
//! One [redb](https://docs.rs/redb) file, `sluice.redb`, in a data directory,
//! and in front of it the quota journal, `quota.journal` (group commit: see
//! [`QuotaBook`]). redb locks its file: a second process opening the same
//! directory gets [`OpenError::Locked`] instead of two writers corrupting one store.
//! The directory is created readable by this user only (0700), and the files
//! with mode 0600 (an existing one that others can read is made so at open): the
//! batch queue keeps the credentials its items are sent with until each
//! item finishes.
//!
//! ```
//! let dir = std::env::temp_dir().join(format!("sluice-doc-{}", std::process::id()));
//! let store = sluice_store::DurableStore::open(&dir).unwrap();
//! assert!(store.path().ends_with("sluice.redb"));
//! # drop(store); let _ = std::fs::remove_dir_all(&dir);
//! ```

mod fillable;
mod journal;
mod outbox;
mod private;
mod quota;
mod rows;

use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use fillable::{FillableDisk, FillableLog};
pub use journal::{JournalSync, QuotaLog};
pub use quota::{
    COMMIT_TIMEOUT, DEFAULT_MAX_QUOTA_CELLS, DEFAULT_MAX_UNCAPPED_CELLS, QuotaBook, QuotaBookConfig,
};

/// The file the store keeps in its data directory.
pub const DURABLE_FILE: &str = "sluice.redb";

/// The quota journal's file in the data directory.
pub const JOURNAL_FILE: &str = "quota.journal";

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
    inner: Arc<Inner>,
}

struct Inner {
    /// `None` only while the storage is being opened anew.
    db: parking_lot::RwLock<Option<Arc<redb::Database>>>,
    path: PathBuf,
    /// Opens the storage again: redb refuses every transaction after a failed
    /// write (a full disk) until the database is opened anew.
    reopen: Box<dyn Fn() -> Result<redb::Database, redb::DatabaseError> + Send + Sync>,
    /// The quota journal, until a [`QuotaBook`] takes it.
    log: parking_lot::Mutex<Option<Box<dyn QuotaLog>>>,
}

impl std::fmt::Debug for DurableStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DurableStore")
            .field("path", &self.inner.path)
            .finish_non_exhaustive()
    }
}

/// The most memory redb's page cache may take (its default is 1 GiB): the
/// queue's contents live on disk, and a process that queued a few hundred
/// megabytes of batch items must not keep them all in memory too.
pub const CACHE_BYTES: usize = 32 * 1024 * 1024;

fn builder() -> redb::Builder {
    let mut builder = redb::Builder::new();
    builder.set_cache_size(CACHE_BYTES);
    builder
}

impl DurableStore {
    /// Opens (creating when needed) the store in `dir`: a directory created
    /// with mode 0700, files 0600 (an existing file others can read is made
    /// 0600, or, when that is refused, named in a warning on stderr).
    ///
    /// # Errors
    /// [`OpenError`] naming the path: a directory that cannot be created, a file
    /// another process holds, a file that is corrupt or cannot be written.
    pub fn open(dir: &Path) -> Result<Self, OpenError> {
        Self::open_with(dir, JournalSync::Flush)
    }

    /// [`DurableStore::open`] with the quota journal's `sync` chosen.
    ///
    /// # Errors
    /// As [`DurableStore::open`].
    pub fn open_with(dir: &Path, sync: JournalSync) -> Result<Self, OpenError> {
        // Readable by this user only (0700, files 0600): the batch queue holds
        // the credentials its items are sent with until each item finishes.
        private::create_dir(dir).map_err(|source| OpenError::Directory {
            path: dir.to_owned(),
            source,
        })?;
        let path = dir.join(DURABLE_FILE);
        private::prepare(&path);
        let db = builder().create(&path).map_err(|e| match e {
            redb::DatabaseError::DatabaseAlreadyOpen => OpenError::Locked { path: path.clone() },
            other => OpenError::Unusable {
                path: path.clone(),
                message: other.to_string(),
            },
        })?;
        // Opened only once the redb file is locked: no other process writes it.
        let journal = dir.join(JOURNAL_FILE);
        let log = journal::FileLog::open(&journal, sync).map_err(|e| OpenError::Unusable {
            path: journal.clone(),
            message: e.to_string(),
        })?;
        let file = path.clone();
        let store = DurableStore::new(db, path, Box::new(log), move || builder().create(&file));
        // A file opened read-only, or a full disk, shows at the first write: here,
        // at start, rather than at the first counted call.
        store.check_writable()?;
        Ok(store)
    }

    /// A store on `backend` and the quota journal `log` instead of files (`label`
    /// names it in errors and logs): e.g. a [`FillableDisk`] and its
    /// [`FillableDisk::log`] to rehearse a full disk.
    ///
    /// # Errors
    /// [`OpenError::Unusable`] when the storage cannot be read or written.
    ///
    /// The backend is cloned to open the storage again after a failed write, so a
    /// clone must reach the same storage.
    pub fn with_backend<B: redb::StorageBackend + Clone>(
        label: impl Into<PathBuf>,
        backend: B,
        log: impl QuotaLog,
    ) -> Result<Self, OpenError> {
        let path = label.into();
        let db = builder()
            .create_with_backend(backend.clone())
            .map_err(|e| OpenError::Unusable {
                path: path.clone(),
                message: e.to_string(),
            })?;
        let store = DurableStore::new(db, path, Box::new(log), move || {
            builder().create_with_backend(backend.clone())
        });
        store.check_writable()?;
        Ok(store)
    }

    fn new(
        db: redb::Database,
        path: PathBuf,
        log: Box<dyn QuotaLog>,
        reopen: impl Fn() -> Result<redb::Database, redb::DatabaseError> + Send + Sync + 'static,
    ) -> Self {
        DurableStore {
            inner: Arc::new(Inner {
                db: parking_lot::RwLock::new(Some(Arc::new(db))),
                path,
                reopen: Box::new(reopen),
                log: parking_lot::Mutex::new(Some(log)),
            }),
        }
    }

    /// The quota journal, for the one [`QuotaBook`] of this store.
    pub(crate) fn take_log(&self) -> Option<Box<dyn QuotaLog>> {
        self.inner.log.lock().take()
    }

    /// Opens the storage anew after a failed write (redb takes no transaction on
    /// a database whose write failed until then). For the books kept in this
    /// store: this crate's [`QuotaBook`], and the batch queue of `sluice-batch`.
    ///
    /// # Errors
    /// The storage still cannot be opened (e.g. a transaction still holds the old
    /// database); the caller tries again later.
    pub fn reopen(&self) -> Result<(), redb::DatabaseError> {
        let mut db = self.inner.db.write();
        // The old handle must be gone before the file can be locked again.
        drop(db.take());
        *db = Some(Arc::new((self.inner.reopen)()?));
        Ok(())
    }

    /// The store's file.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// The open database, for the tables of the books kept in it (this crate's
    /// [`QuotaBook`]; the batch queue of `sluice-batch`, whose tables are all
    /// named `batch_*`); `None` while it cannot be opened (after a failed write,
    /// until [`DurableStore::reopen`] works).
    pub fn db(&self) -> Option<Arc<redb::Database>> {
        self.inner.db.read().clone()
    }

    /// Writes once, so that a file opened read-only shows at start. A full
    /// disk does not stop a start when the store's tables are already there:
    /// the process serves, and writes (quota routes, the batch lane) answer
    /// 503 until there is room, as they do when the disk fills later; a
    /// replica that crashed on a full disk comes back as it was.
    fn check_writable(&self) -> Result<(), OpenError> {
        let unusable = |e: &dyn std::fmt::Display| OpenError::Unusable {
            path: self.inner.path.clone(),
            message: format!("cannot be written: {e}"),
        };
        let db = self.db().ok_or_else(|| unusable(&"not open"))?;
        let written = db.begin_write().map_err(redb::Error::from).and_then(|tx| {
            quota::create_tables(&tx)?;
            tx.commit().map_err(redb::Error::from)
        });
        let Err(e) = written else {
            return Ok(());
        };
        if !is_storage_full(&e) {
            return Err(unusable(&e));
        }
        // A failed write leaves the handle unusable: open the file again.
        drop(db);
        self.reopen().map_err(|e| unusable(&e))?;
        let db = self.db().ok_or_else(|| unusable(&"not open"))?;
        quota::tables_readable(&db).map_err(|_| unusable(&e))?;
        eprintln!(
            "sluice: {} has no room to write ({e}); serving, with quota routes and the batch lane answering 503 until there is room",
            self.inner.path.display()
        );
        Ok(())
    }
}

/// True when `e` comes from a full disk (`ENOSPC`), for a caller that lets a
/// start on a full disk go on, as the quota book and the batch queue do.
pub fn is_storage_full(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cause = Some(e);
    while let Some(error) = cause {
        if let Some(io) = error.downcast_ref::<std::io::Error>()
            && io.kind() == std::io::ErrorKind::StorageFull
        {
            return true;
        }
        cause = error.source();
    }
    // Some layers keep only the message of the I/O error they met.
    e.to_string()
        .to_ascii_lowercase()
        .contains("no space left on device")
}
