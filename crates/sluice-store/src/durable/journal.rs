//! The quota journal: the group-commit log in front of the durable store.
//!
//! A commit of the quota book appends one record per changed count and makes it
//! durable with one `fdatasync`: far less work than a B-tree transaction, so a call
//! waits less for its count to be on disk. From time to time the counts are written
//! to the durable store (a snapshot that says which journal record it covers) and
//! the journal starts over; at start the records past the snapshot are replayed.
//!
//! A record is 32 bytes: sequence number, cell, value and a check word, little
//! endian. Replay stops at the first record that is short or fails its check (a
//! write torn by a crash: it was never confirmed to a waiting call).

use std::fs::File;
use std::io::{Read as _, Seek as _, SeekFrom, Write as _};
use std::path::Path;

/// Bytes of one record.
pub(crate) const RECORD: usize = 32;

const CHECK_SALT: u64 = 0x736c_7569_6365_7131;

/// Where the journal's bytes go: a file, or a rehearsal's storage.
pub trait QuotaLog: Send + 'static {
    /// Appends `bytes` and makes them durable before returning.
    ///
    /// # Errors
    /// The write or the sync failed (e.g. the disk is full).
    fn append(&mut self, bytes: &[u8]) -> std::io::Result<()>;

    /// Everything appended since the last [`QuotaLog::reset`].
    ///
    /// # Errors
    /// The read failed.
    fn read_all(&mut self) -> std::io::Result<Vec<u8>>;

    /// Starts over, empty, durably.
    ///
    /// # Errors
    /// The truncation or the sync failed.
    fn reset(&mut self) -> std::io::Result<()>;

    /// Bytes appended since the last reset.
    fn len(&self) -> u64;

    /// True when nothing was appended since the last reset.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// True when an append costs no more than a system call (it does not wait for
    /// the disk): deciding threads then append themselves instead of handing the
    /// append to the writer thread.
    fn inline(&self) -> bool {
        false
    }
}

/// Bytes of zeros a journal file is given up front: a record then overwrites
/// blocks the file system has already allocated and initialised, and its
/// `fdatasync` flushes data alone, with no file-size or extent change to commit.
const PREALLOCATED: u64 = 2 * SNAPSHOT_HINT;

/// The size past which the quota book writes a snapshot and starts over (the
/// preallocation holds twice that).
pub(crate) const SNAPSHOT_HINT: u64 = 4 << 20;

/// How far a quota count is taken before the call it admits goes on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum JournalSync {
    /// Flushed to the disk (`fdatasync`, one per group commit): no count is lost
    /// when sluice or the machine crashes.
    #[default]
    Flush,
    /// Written to the operating system (`write`), not flushed: no count is lost
    /// when sluice crashes or is killed; a crash of the machine itself can lose the
    /// counts of its last seconds. Snapshots are flushed either way.
    Write,
}

/// The journal in a file, written in place from its start.
#[derive(Debug)]
pub(crate) struct FileLog {
    file: File,
    sync: JournalSync,
    /// Where the next record goes: the end of the valid records.
    end: u64,
}

impl FileLog {
    pub(crate) fn open(path: &Path, sync: JournalSync) -> std::io::Result<Self> {
        let mut file = super::private::open_options().truncate(false).open(path)?;
        super::private::tighten(&file, path);
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes)?;
        let end = (decode(&bytes).count() * RECORD) as u64;
        let size = bytes.len() as u64;
        if size < PREALLOCATED {
            file.seek(SeekFrom::Start(size))?;
            let zeros = vec![0u8; 64 << 10];
            let mut left = PREALLOCATED - size;
            while left > 0 {
                let n = left.min(zeros.len() as u64) as usize;
                file.write_all(&zeros[..n])?;
                left -= n as u64;
            }
            file.sync_all()?;
        }
        Ok(FileLog { file, sync, end })
    }
}

impl QuotaLog for FileLog {
    fn append(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt as _;
        // A failed write leaves `end` where it was: the next append overwrites what
        // it may have left, and replay stops at a record that fails its check.
        self.file.write_all_at(bytes, self.end)?;
        if self.sync == JournalSync::Flush {
            self.file.sync_data()?;
        }
        self.end += bytes.len() as u64;
        Ok(())
    }

    fn read_all(&mut self) -> std::io::Result<Vec<u8>> {
        let mut bytes = Vec::new();
        self.file.seek(SeekFrom::Start(0))?;
        self.file.read_to_end(&mut bytes)?;
        Ok(bytes)
    }

    fn reset(&mut self) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt as _;
        // The first record slot zeroed ends any replay at the start; older records
        // further on were all covered by an earlier snapshot (their numbers are at
        // most its), so a replay that reached them would skip them anyway.
        self.file.write_all_at(&[0u8; RECORD], 0)?;
        self.file.sync_data()?;
        self.end = 0;
        Ok(())
    }

    fn len(&self) -> u64 {
        self.end
    }

    fn inline(&self) -> bool {
        self.sync == JournalSync::Write
    }
}

fn check(seq: u64, cell: u64, value: u64) -> u64 {
    let mut x = seq ^ cell.rotate_left(21) ^ value.rotate_left(42) ^ CHECK_SALT;
    // splitmix64's finaliser: every input bit moves every output bit.
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Appends the record `(seq, cell, value)` to `out`.
pub(crate) fn encode(out: &mut Vec<u8>, seq: u64, cell: u64, value: u64) {
    for word in [seq, cell, value, check(seq, cell, value)] {
        out.extend_from_slice(&word.to_le_bytes());
    }
}

/// Every record of `bytes` whose check holds, in order (past a damaged one too).
fn whole_records(bytes: &[u8]) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
    bytes
        .chunks_exact(RECORD)
        .map(|r| {
            let word = |i: usize| {
                let mut w = [0u8; 8];
                w.copy_from_slice(&r[i * 8..i * 8 + 8]);
                u64::from_le_bytes(w)
            };
            (word(0), word(1), word(2), word(3))
        })
        .filter(|&(seq, cell, value, sum)| sum == check(seq, cell, value))
        .map(|(seq, cell, value, _)| (seq, cell, value))
}

/// The records of `bytes` in order, up to the first short or damaged one, or the
/// first numbered below the one before it: the journal is written from its start
/// again after each snapshot with numbers above every one it held (see
/// [`horizon`]), so a record numbered lower is an older run's, left past the end
/// of this one (its first slot was torn by a crash), and never replayed.
pub(crate) fn decode(bytes: &[u8]) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
    let mut last = 0u64;
    bytes
        .chunks_exact(RECORD)
        .map(|r| {
            let word = |i: usize| {
                let mut w = [0u8; 8];
                w.copy_from_slice(&r[i * 8..i * 8 + 8]);
                u64::from_le_bytes(w)
            };
            (word(0), word(1), word(2), word(3))
        })
        .take_while(move |&(seq, cell, value, sum)| {
            let ok = sum == check(seq, cell, value) && seq >= last;
            last = seq;
            ok
        })
        .map(|(seq, cell, value, _)| (seq, cell, value))
}

/// The highest number of any whole record in `bytes`, wherever it lies (past a
/// torn one too): the journal's next records are numbered above it, so that a
/// record of an earlier run left in the file is never taken for one of theirs.
pub(crate) fn horizon(bytes: &[u8]) -> u64 {
    whole_records(bytes)
        .map(|(seq, _, _)| seq)
        .max()
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_replay_stops_at_a_torn_one() {
        let mut bytes = Vec::new();
        encode(&mut bytes, 1, 10, 100);
        encode(&mut bytes, 2, 11, 101);
        encode(&mut bytes, 3, 12, 102);
        assert_eq!(
            decode(&bytes).collect::<Vec<_>>(),
            [(1, 10, 100), (2, 11, 101), (3, 12, 102)]
        );
        // A torn last record (short) is dropped.
        assert_eq!(decode(&bytes[..RECORD * 3 - 5]).count(), 2);
        // A damaged one ends the replay there.
        bytes[RECORD + 17] ^= 0x40;
        assert_eq!(decode(&bytes).collect::<Vec<_>>(), [(1, 10, 100)]);
        // Zeros (an extended file whose data never landed) are no record.
        assert_eq!(decode(&[0u8; RECORD * 2]).count(), 0);
    }

    /// A run whose first slot a crash tore leaves its later records whole past
    /// it: the horizon sees them, and a later run (numbered above it) written
    /// over the start is replayed up to them, never into them.
    #[test]
    fn q1_an_earlier_run_left_past_a_torn_slot_is_never_replayed() {
        let mut old = Vec::new();
        encode(&mut old, 6, 10, 106);
        encode(&mut old, 7, 10, 107);
        encode(&mut old, 8, 11, 108);
        old[3] ^= 0x40; // the first slot torn
        assert_eq!(decode(&old).count(), 0);
        assert_eq!(horizon(&old), 8);
        // The next run starts over at the file's start, numbered above 8.
        let mut next = Vec::new();
        encode(&mut next, 9, 10, 6);
        let mut file = old.clone();
        file[..RECORD].copy_from_slice(&next);
        assert_eq!(decode(&file).collect::<Vec<_>>(), [(9, 10, 6)]);
    }
}
