//! Documented on [`QuotaBook`].

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};
use redb::{ReadableDatabase as _, ReadableTable as _, TableDefinition};
use sluice_core::{
    Budget, BudgetStatus, CellRef, Decision, Ledger, Mode, Timestamp, adjust, cell_is_stale, decide,
};
use tokio::sync::watch;

use super::DurableStore;
use super::journal::QuotaLog;
use crate::StoreError;

/// Quota cells: the cell key (a budget's fingerprint) → its packed value.
const QUOTA_CELLS: TableDefinition<'_, u64, u64> = TableDefinition::new("quota_cells");

/// Facts about the snapshot: `journal_seq` = the last journal record it covers.
const QUOTA_META: TableDefinition<'_, &str, u64> = TableDefinition::new("quota_meta");

/// A snapshot is written when the journal holds this many bytes…
const SNAPSHOT_BYTES: u64 = super::journal::SNAPSHOT_HINT;

/// …or when counts changed since the last one this long ago.
const SNAPSHOT_EVERY: Duration = Duration::from_secs(30);

/// Default for [`QuotaBookConfig::max_cells`]: a million workspace-and-family
/// counts, about 50 MB of memory.
pub const DEFAULT_MAX_QUOTA_CELLS: usize = 1_000_000;

/// Default for [`QuotaBookConfig::max_uncapped_cells`]: about 5 MB of memory.
pub const DEFAULT_MAX_UNCAPPED_CELLS: usize = 100_000;

/// The longest a decision waits for the commit that makes it durable; past it
/// the call is refused (the store answers "unavailable").
pub const COMMIT_TIMEOUT: Duration = Duration::from_secs(5);

/// How many times a deciding thread that appended looks again for changes made
/// meanwhile before it leaves them to the writer thread.
const WRITE_THROUGH_ROUNDS: usize = 4;

/// How many times a decision whose change another thread is appending lets
/// the other tasks of its thread run before it waits to be woken.
const INLINE_YIELDS: usize = 8;

/// After a failed commit, the writer waits this long before it tries again.
const RETRY_AFTER_FAILURE: Duration = Duration::from_millis(200);

pub(super) fn create_tables(tx: &redb::WriteTransaction) -> Result<(), redb::TableError> {
    tx.open_table(QUOTA_CELLS).map(drop)?;
    tx.open_table(QUOTA_META).map(drop)
}

/// Whether the quota tables are there to read (without writing).
pub(super) fn tables_readable(db: &redb::Database) -> Result<(), redb::Error> {
    let tx = db.begin_read()?;
    tx.open_table(QUOTA_CELLS)?;
    tx.open_table(QUOTA_META)?;
    Ok(())
}

/// How a [`QuotaBook`] is bounded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct QuotaBookConfig {
    /// The most counts kept (one per workspace and family and month).
    pub max_cells: usize,
    /// A new count of an uncapped family (a budget whose limit is `u32::MAX`) is
    /// kept only while the book holds fewer counts than this in all.
    pub max_uncapped_cells: usize,
}

impl QuotaBookConfig {
    /// A book keeping at most `max_cells` counts (and new uncapped counts only while
    /// it holds fewer than [`DEFAULT_MAX_UNCAPPED_CELLS`]).
    pub const fn with_max_cells(max_cells: usize) -> Self {
        QuotaBookConfig {
            max_cells,
            max_uncapped_cells: DEFAULT_MAX_UNCAPPED_CELLS,
        }
    }

    /// The same bounds, keeping a new uncapped count only while the book holds fewer
    /// than `max_uncapped_cells` counts in all.
    pub const fn with_max_uncapped_cells(mut self, max_uncapped_cells: usize) -> Self {
        self.max_uncapped_cells = max_uncapped_cells;
        self
    }
}

impl Default for QuotaBookConfig {
    fn default() -> Self {
        QuotaBookConfig {
            max_cells: DEFAULT_MAX_QUOTA_CELLS,
            max_uncapped_cells: DEFAULT_MAX_UNCAPPED_CELLS,
        }
    }
}

/// Monthly quota counts, durable before the call they admit goes on.
///
/// The counts live in memory, where decisions read and write them under one
/// lock, and on disk, where one writer thread puts them. A decision that spends
/// takes a sequence number; the caller then waits until a commit covers that
/// number before it forwards the call. A commit appends the changed counts to the
/// quota journal ([`QuotaLog`](super::QuotaLog)) with one `fdatasync`; every decision
/// that arrives while a commit is on disk joins the next one: one flush serves all
/// the calls of that moment (group commit). From time to time, and at shutdown,
/// the counts are written to the redb file (a snapshot naming the last journal
/// record it covers) and the journal starts over.
///
/// Bounds: at most [`QuotaBookConfig::max_cells`] counts (one per workspace and
/// family); past it, cells of past months are dropped, and a new workspace is
/// refused (the store answers "unavailable", which quota routes turn into 503)
/// rather than counted nowhere. Counts of *uncapped* families (kept only to show
/// usage) take no part in that: a new one is kept only while the book holds fewer
/// than [`QuotaBookConfig::max_uncapped_cells`] counts in all; past it the call is
/// admitted and its usage not counted (see [`QuotaBook::untracked`]), so a flood of
/// new workspaces on an uncapped route can neither grow the book past that bound
/// nor take the room of capped counts. A commit that fails (a full disk) fails the
/// decisions waiting on it; their counts stay in memory and are written by the
/// next commit that succeeds, so a failure can over-count, never under-count.
pub struct QuotaBook {
    shared: Arc<Shared>,
    writer: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for QuotaBook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuotaBook")
            .field("cells", &self.len())
            .finish_non_exhaustive()
    }
}

struct Shared {
    state: Mutex<Book>,
    wake: Condvar,
    committed: watch::Sender<Commit>,
    store: DurableStore,
    /// The journal: the writer thread uses it, and decisions too when `inline`.
    /// Lock order: the journal, then the book (a decision holding the book
    /// only tries the journal).
    log: Mutex<Journal>,
    /// The journal's appends are cheap enough to make in the deciding thread.
    inline: bool,
    max_cells: usize,
    max_uncapped_cells: usize,
    /// Uncapped spends not counted because the book was past `max_uncapped_cells`.
    untracked: std::sync::atomic::AtomicU64,
    /// Commits written, for metrics and for tests of group commit.
    commits: std::sync::atomic::AtomicU64,
}

/// The counts in memory and what the writer has still to put on disk.
#[derive(Default)]
struct Book {
    cells: HashMap<u64, u64, foldhash::fast::FixedState>,
    /// Cells changed since the last commit took its snapshot.
    dirty: HashSet<u64, foldhash::fast::FixedState>,
    /// Cells dropped (past months) still to delete from the file.
    dropped: Vec<u64>,
    /// Cells journaled since the last snapshot.
    unsnapped: HashSet<u64, foldhash::fast::FixedState>,
    /// The last sequence number handed to a spending decision.
    seq: u64,
    closing: bool,
}

/// The journal and the number of its last append. Records carry that number,
/// assigned under the journal's lock, so they are numbered in the order they
/// reach the log, and a snapshot names the last one it covers.
struct Journal {
    log: Box<dyn QuotaLog>,
    seq: u64,
}

impl Journal {
    /// Appends the counts `writes` as one numbered group.
    fn append(&mut self, writes: &[(u64, u64)]) -> std::io::Result<()> {
        let seq = self.seq + 1;
        let mut bytes = Vec::with_capacity(writes.len() * super::journal::RECORD);
        for &(cell, value) in writes {
            super::journal::encode(&mut bytes, seq, cell, value);
        }
        self.log.append(&bytes)?;
        self.seq = seq;
        Ok(())
    }
}

/// What the writer has done: every decision up to `durable` is on disk; the
/// last failed commit would have covered decisions up to `failed`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Commit {
    durable: u64,
    failed: u64,
}

/// The [`Ledger`] over the book, recording which cells a decision wrote.
struct BookLedger<'a> {
    book: &'a mut Book,
    wrote: bool,
}

impl Ledger for BookLedger<'_> {
    fn read(&mut self, at: CellRef<'_>) -> u64 {
        self.book.cells.get(&at.cell).copied().unwrap_or(0)
    }

    fn write(&mut self, at: CellRef<'_>, value: u64) {
        self.book.cells.insert(at.cell, value);
        self.book.dirty.insert(at.cell);
        self.wrote = true;
    }
}

impl QuotaBook {
    /// Loads the counts of `store` (dropping those of past months as of `now`) and
    /// starts the writer thread.
    ///
    /// # Errors
    /// [`super::OpenError::Unusable`] when the file cannot be read.
    pub fn open(
        store: &DurableStore,
        config: QuotaBookConfig,
        now: Timestamp,
    ) -> Result<Self, super::OpenError> {
        let unusable = |e: &dyn std::fmt::Display| super::OpenError::Unusable {
            path: store.path().to_owned(),
            message: format!("cannot read the quota counts: {e}"),
        };
        let mut book = Book::default();
        let mut covered = 0;
        {
            let db = store.db().ok_or_else(|| unusable(&"not open"))?;
            let tx = db.begin_read().map_err(|e| unusable(&e))?;
            let table = tx.open_table(QUOTA_CELLS).map_err(|e| unusable(&e))?;
            for row in table.iter().map_err(|e| unusable(&e))? {
                let (k, v) = row.map_err(|e| unusable(&e))?;
                book.cells.insert(k.value(), v.value());
            }
            let meta = tx.open_table(QUOTA_META).map_err(|e| unusable(&e))?;
            if let Some(seq) = meta.get("journal_seq").map_err(|e| unusable(&e))? {
                covered = seq.value();
            }
        }
        let mut log = store
            .take_log()
            .ok_or_else(|| unusable(&"the journal is in use"))?;
        // The journal's records past the snapshot, in order: the last value wins.
        let journal = log.read_all().map_err(|e| unusable(&e))?;
        let mut journal_seq = covered;
        for (seq, cell, value) in super::journal::decode(&journal) {
            if seq > covered {
                book.cells.insert(cell, value);
                book.unsnapped.insert(cell);
                journal_seq = journal_seq.max(seq);
            }
        }
        // Numbered above every whole record in the file, those past a torn one
        // included (a group a crash tore was never confirmed): the snapshot below
        // covers them, and what follows never reads as one of them.
        journal_seq = journal_seq.max(super::journal::horizon(&journal));
        book.cells.retain(|&cell, &mut value| {
            let keep = !cell_is_stale(value, now);
            if !keep {
                book.dropped.push(cell);
            }
            keep
        });
        let shared = Arc::new(Shared {
            state: Mutex::new(book),
            wake: Condvar::new(),
            committed: watch::Sender::new(Commit::default()),
            store: store.clone(),
            inline: log.inline(),
            log: Mutex::new(Journal {
                log,
                seq: journal_seq,
            }),
            max_cells: config.max_cells.max(1),
            max_uncapped_cells: config.max_uncapped_cells,
            untracked: std::sync::atomic::AtomicU64::new(0),
            commits: std::sync::atomic::AtomicU64::new(0),
        });
        // What was replayed goes into a snapshot at once, and the journal starts
        // over. On a full disk the journal keeps it instead (a failed snapshot
        // resets nothing) and the writer snapshots once there is room: a replica
        // that crashed on a full disk starts again with every count.
        if let Err(e) = shared.snapshot() {
            if !super::is_storage_full(&e) {
                return Err(unusable(&e));
            }
            eprintln!(
                "sluice: no room to snapshot the quota counts in {} ({e}); the journal keeps them until there is",
                store.path().display()
            );
        }
        let writer = std::thread::Builder::new()
            .name("sluice-quota-writer".to_owned())
            .spawn({
                let shared = Arc::clone(&shared);
                move || shared.write_loop()
            })
            .map_err(|e| unusable(&e))?;
        Ok(QuotaBook {
            shared,
            writer: Some(writer),
        })
    }

    /// The durable store the book is kept in (where other books keep their
    /// tables too: the batch queue, the gateway's alert outbox).
    pub fn store(&self) -> &DurableStore {
        &self.shared.store
    }

    /// Counts kept in memory.
    pub fn len(&self) -> usize {
        self.shared.state.lock().cells.len()
    }

    /// Commits written to disk so far (each may hold many decisions).
    pub fn commits(&self) -> u64 {
        self.shared
            .commits
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// True when no count is kept.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Spends of uncapped families that were admitted without a count because the
    /// book held [`QuotaBookConfig::max_uncapped_cells`] counts or more.
    pub fn untracked(&self) -> u64 {
        self.shared
            .untracked
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Decides `quotas` (monthly budgets) and, only when they all admit, `others`
    /// through `decide_others` — under the book's lock, so the decision over both is
    /// all or nothing. Returns the statuses of both, and the sequence number to
    /// [wait for](QuotaBook::durable) when the quotas were spent.
    ///
    /// # Errors
    /// [`StoreError::Unavailable`] when the book is full; `decide_others`' error.
    pub(crate) fn decide_with(
        &self,
        quotas: &[Budget],
        now: Timestamp,
        mode: Mode,
        decide_others: impl FnOnce(Mode) -> Result<Decision, StoreError>,
    ) -> Result<(Decision, Decision, Option<u64>), StoreError> {
        let mut book = self.shared.state.lock();
        // A new count of an uncapped family past its bound: admitted, not counted.
        let quotas: arrayvec::ArrayVec<Budget, { sluice_core::MAX_BUDGETS }> = quotas
            .iter()
            .map(|b| {
                let untracked = mode == Mode::Spend
                    && b.limit == u32::MAX
                    && b.cost > 0
                    && book.cells.len() >= self.shared.max_uncapped_cells
                    && b.cells(now).iter().any(|c| !book.cells.contains_key(c));
                if untracked {
                    self.shared
                        .untracked
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    b.with_cost(0)
                } else {
                    *b
                }
            })
            .collect();
        let quotas = &quotas[..];
        if mode == Mode::Spend {
            self.make_room(&mut book, quotas, now)?;
        }
        let mut ledger = BookLedger {
            book: &mut book,
            wrote: false,
        };
        let look = decide(quotas, &mut ledger, now, Mode::Peek)?;
        if !look.is_admitted() || mode == Mode::Peek {
            // Nothing is spent anywhere: the others only show where they stand.
            let others = decide_others(Mode::Peek)?;
            return Ok((look, others, None));
        }
        let others = decide_others(Mode::Spend)?;
        if !others.is_admitted() {
            return Ok((look, others, None));
        }
        let spent = decide(quotas, &mut ledger, now, Mode::Spend)?;
        let wrote = ledger.wrote;
        Ok((spent, others, self.sequence(book, wrote)))
    }

    /// Charges or refunds a monthly budget after the fact (e.g. an operator's
    /// reset), durable when the returned sequence number is.
    pub(crate) fn adjust(
        &self,
        budget: &Budget,
        delta: i64,
        reserved_at: Timestamp,
        now: Timestamp,
    ) -> (BudgetStatus, Option<u64>) {
        let mut book = self.shared.state.lock();
        let mut ledger = BookLedger {
            book: &mut book,
            wrote: false,
        };
        let status = adjust(budget, delta, reserved_at, &mut ledger, now);
        let wrote = ledger.wrote;
        let seq = self.sequence(book, wrote);
        (status, seq)
    }

    /// [`QuotaBook::adjust`] for each of `changes` (budget and delta) under one
    /// lock: one sequence number, so one journal append, covers them all.
    pub(crate) fn adjust_many(
        &self,
        changes: &[(&Budget, i64)],
        reserved_at: Timestamp,
        now: Timestamp,
    ) -> (Vec<BudgetStatus>, Option<u64>) {
        let mut book = self.shared.state.lock();
        let mut ledger = BookLedger {
            book: &mut book,
            wrote: false,
        };
        let statuses = changes
            .iter()
            .map(|(budget, delta)| adjust(budget, *delta, reserved_at, &mut ledger, now))
            .collect();
        let wrote = ledger.wrote;
        let seq = self.sequence(book, wrote);
        (statuses, seq)
    }

    /// Numbers a change that wrote to the book (releasing its lock) and has it
    /// written; `None` when nothing was written.
    fn sequence(&self, mut book: parking_lot::MutexGuard<'_, Book>, wrote: bool) -> Option<u64> {
        if !wrote {
            return None;
        }
        book.seq += 1;
        let seq = book.seq;
        drop(book);
        if !self.shared.inline || !self.shared.write_through() {
            self.shared.wake.notify_one();
        }
        Some(seq)
    }

    /// Waits until the decision numbered `seq` is on disk.
    ///
    /// # Errors
    /// [`StoreError::Unavailable`] when the commit that should have covered it
    /// failed, or none did within [`COMMIT_TIMEOUT`].
    pub async fn durable(&self, seq: u64) -> Result<(), StoreError> {
        if self.shared.committed.borrow().durable >= seq {
            return Ok(());
        }
        if self.shared.inline {
            // Another deciding thread is appending this change with its own: a
            // `pwrite` away. Other tasks of this thread run meanwhile, and no
            // thread is woken for it (as the watch below would).
            for _ in 0..INLINE_YIELDS {
                tokio::task::yield_now().await;
                let c = *self.shared.committed.borrow();
                if c.durable >= seq {
                    return Ok(());
                }
                if c.failed >= seq {
                    break;
                }
            }
        }
        let mut committed = self.shared.committed.subscribe();
        let waited = tokio::time::timeout(
            COMMIT_TIMEOUT,
            committed.wait_for(|c| c.durable >= seq || c.failed >= seq),
        )
        .await;
        match waited {
            Ok(Ok(c)) if c.durable >= seq => Ok(()),
            // Clients may read these; the path and the cause go to the log.
            Ok(Ok(_)) => Err(StoreError::Unavailable(
                "the quota count could not be made durable".to_owned(),
            )),
            Ok(Err(_)) | Err(_) => Err(StoreError::Unavailable(format!(
                "the quota count was not made durable within {} s",
                COMMIT_TIMEOUT.as_secs()
            ))),
        }
    }

    /// Makes room for the cells `quotas` use that the book does not hold yet:
    /// drops cells of past months first; refuses when that is not enough.
    fn make_room(
        &self,
        book: &mut Book,
        quotas: &[Budget],
        now: Timestamp,
    ) -> Result<(), StoreError> {
        let new = quotas
            .iter()
            .filter(|b| b.cost > 0)
            .flat_map(|b| b.cells(now))
            .filter(|c| !book.cells.contains_key(c))
            .count();
        if book.cells.len() + new <= self.shared.max_cells {
            return Ok(());
        }
        let mut stale = Vec::new();
        book.cells.retain(|&cell, &mut value| {
            let keep = !cell_is_stale(value, now);
            if !keep {
                stale.push(cell);
            }
            keep
        });
        for cell in &stale {
            book.dirty.remove(cell);
            book.unsnapped.remove(cell);
        }
        book.dropped.extend(stale);
        if book.cells.len() + new <= self.shared.max_cells {
            return Ok(());
        }
        Err(StoreError::Unavailable(format!(
            "the quota book holds its maximum of {} counts",
            self.shared.max_cells
        )))
    }
}

impl Shared {
    /// The writer thread: takes what changed, appends it to the journal in one
    /// durable write, tells the waiting decisions; writes snapshots now and then;
    /// until the book closes and everything is in a snapshot.
    fn write_loop(&self) {
        let mut failing = false;
        let mut last_snapshot = std::time::Instant::now();
        loop {
            let closing = {
                let mut book = self.state.lock();
                while book.dirty.is_empty() && !book.closing {
                    let due = !book.unsnapped.is_empty() || !book.dropped.is_empty();
                    if due && last_snapshot.elapsed() >= SNAPSHOT_EVERY {
                        break;
                    }
                    let _ = self.wake.wait_for(&mut book, SNAPSHOT_EVERY);
                }
                book.closing
            };
            let flushed = {
                let mut log = self.log.lock();
                self.flush(&mut log)
            };
            match flushed {
                Ok(_) if failing => {
                    eprintln!(
                        "sluice: quota counts are written to {} again",
                        self.store.path().display()
                    );
                    failing = false;
                }
                Ok(_) => {}
                Err((e, target)) => {
                    if !failing {
                        eprintln!(
                            "sluice: cannot write quota counts next to {}: {e}; quota routes answer 503 until it works again",
                            self.store.path().display()
                        );
                        failing = true;
                    }
                    self.committed
                        .send_modify(|c| c.failed = c.failed.max(target));
                    if closing {
                        // Shutting down on a disk that takes nothing: what is lost
                        // here was never confirmed to a waiting call.
                        return;
                    }
                    std::thread::sleep(RETRY_AFTER_FAILURE);
                    continue;
                }
            }
            let journal_full = self.log.lock().log.len() >= SNAPSHOT_BYTES;
            let due = {
                let book = self.state.lock();
                !book.unsnapped.is_empty() || !book.dropped.is_empty()
            };
            if closing || journal_full || (due && last_snapshot.elapsed() >= SNAPSHOT_EVERY) {
                match self.snapshot() {
                    Ok(()) => last_snapshot = std::time::Instant::now(),
                    Err(e) => {
                        eprintln!(
                            "sluice: cannot write a snapshot of the quota counts to {}: {e}; the journal keeps them",
                            self.store.path().display()
                        );
                        // redb takes no transaction after a failed write until the
                        // database is opened anew; a reopen that fails is tried again.
                        let _ = self.store.reopen();
                        last_snapshot = std::time::Instant::now();
                    }
                }
                if closing && self.state.lock().dirty.is_empty() {
                    return;
                }
            }
        }
    }

    /// Appends the counts changed since the last append to the journal, as they
    /// are now, and tells the waiting decisions the number it covers. The counts
    /// are taken while the journal is held (`log`), so the journal has each
    /// count's values in the order the book had them, whoever appends.
    ///
    /// # Errors
    /// The append's error and the number it would have covered; the counts
    /// stay to write.
    fn flush(&self, log: &mut Journal) -> Result<u64, (std::io::Error, u64)> {
        let (writes, target) = {
            let mut book = self.state.lock();
            let dirty = std::mem::take(&mut book.dirty);
            let writes: Vec<(u64, u64)> = dirty
                .into_iter()
                .map(|c| (c, book.cells.get(&c).copied().unwrap_or(0)))
                .collect();
            (writes, book.seq)
        };
        if writes.is_empty() {
            return Ok(target);
        }
        if let Err(e) = log.append(&writes) {
            self.state
                .lock()
                .dirty
                .extend(writes.iter().map(|&(c, _)| c));
            return Err((e, target));
        }
        self.state
            .lock()
            .unsnapped
            .extend(writes.iter().map(|&(c, _)| c));
        self.commits
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.committed
            .send_modify(|c| c.durable = c.durable.max(target));
        Ok(target)
    }

    /// Writes the book's changes in the deciding thread (a journal that only
    /// writes to the operating system costs a `pwrite`: cheaper than handing it
    /// to the writer thread and back, two thread wake-ups). Whoever holds the
    /// journal writes for all: a thread that finds it held leaves its changes to
    /// the holder, which looks for changes again after it lets go (so none is
    /// left unwritten), at most [`WRITE_THROUGH_ROUNDS`] times. False when the
    /// writer thread is to take over: an append failed (it retries) or changes
    /// are left after those rounds.
    fn write_through(&self) -> bool {
        for _ in 0..WRITE_THROUGH_ROUNDS {
            let Some(mut log) = self.log.try_lock() else {
                return true;
            };
            let flushed = self.flush(&mut log);
            drop(log);
            if flushed.is_err() {
                return false;
            }
            if self.state.lock().dirty.is_empty() {
                return true;
            }
        }
        false
    }

    /// Writes the counts journaled since the last snapshot to the redb file, names
    /// the last journal record it covers, and starts the journal over.
    fn snapshot(&self) -> Result<(), redb::Error> {
        // Held until the journal starts over: every record in it until then has its
        // cell in `cells` (or in an earlier snapshot), and none is appended meanwhile
        // (decisions that would append leave their changes to this thread, which
        // writes them after: a few milliseconds every 30 s).
        let mut journal = self.log.lock();
        let mut book = self.state.lock();
        let unsnapped = std::mem::take(&mut book.unsnapped);
        let cells: Vec<(u64, u64)> = unsnapped
            .iter()
            .filter_map(|c| book.cells.get(c).map(|&v| (*c, v)))
            .collect();
        let dropped = std::mem::take(&mut book.dropped);
        drop(book);
        let covered = journal.seq;
        if let Err(e) = self.write_snapshot(&cells, &dropped, covered) {
            drop(journal);
            let mut book = self.state.lock();
            book.unsnapped.extend(cells.iter().map(|&(c, _)| c));
            book.dropped.extend(dropped);
            return Err(e);
        }
        // Every record up to `covered` is in the snapshot. A crash before this reset
        // replays none of them: they are not past `covered`.
        journal.log.reset()?;
        Ok(())
    }

    fn write_snapshot(
        &self,
        cells: &[(u64, u64)],
        dropped: &[u64],
        covered: u64,
    ) -> Result<(), redb::Error> {
        let db = self.store.db().ok_or_else(|| {
            redb::Error::Io(std::io::Error::other("the store is being opened again"))
        })?;
        let tx = db.begin_write()?;
        {
            let mut table = tx.open_table(QUOTA_CELLS)?;
            for &(cell, value) in cells {
                table.insert(cell, value)?;
            }
            for &cell in dropped {
                table.remove(cell)?;
            }
            tx.open_table(QUOTA_META)?.insert("journal_seq", covered)?;
        }
        tx.commit()?;
        Ok(())
    }
}

impl Drop for QuotaBook {
    /// Writes what is still in memory, then stops the writer.
    fn drop(&mut self) {
        self.shared.state.lock().closing = true;
        self.shared.wake.notify_all();
        if let Some(writer) = self.writer.take() {
            let _ = writer.join();
        }
    }
}
