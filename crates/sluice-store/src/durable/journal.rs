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
}

/// The journal in a file.
#[derive(Debug)]
pub(crate) struct FileLog {
    file: File,
    len: u64,
}

impl FileLog {
    pub(crate) fn open(path: &Path) -> std::io::Result<Self> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            .open(path)?;
        let len = file.metadata()?.len();
        Ok(FileLog { file, len })
    }
}

impl QuotaLog for FileLog {
    fn append(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        let written = self
            .file
            .write_all(bytes)
            .and_then(|()| self.file.sync_data());
        match written {
            Ok(()) => {
                self.len += bytes.len() as u64;
                Ok(())
            }
            Err(e) => {
                // A partial append must not stay in front of the next one.
                let _ = self.file.set_len(self.len);
                Err(e)
            }
        }
    }

    fn read_all(&mut self) -> std::io::Result<Vec<u8>> {
        let mut bytes = Vec::new();
        self.file.seek(SeekFrom::Start(0))?;
        self.file.read_to_end(&mut bytes)?;
        Ok(bytes)
    }

    fn reset(&mut self) -> std::io::Result<()> {
        self.file.set_len(0)?;
        self.file.sync_all()?;
        self.len = 0;
        Ok(())
    }

    fn len(&self) -> u64 {
        self.len
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

/// The records of `bytes` in order, up to the first short or damaged one.
pub(crate) fn decode(bytes: &[u8]) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
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
        .take_while(|&(seq, cell, value, sum)| sum == check(seq, cell, value))
        .map(|(seq, cell, value, _)| (seq, cell, value))
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
}
