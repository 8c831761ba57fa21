//! The records of the queue's tables, byte by byte: a batch's record
//! (versioned: version 2 added the origin and the bytes), an item's record, and
//! a stored result. Written by hand, little-endian, so the file's format is
//! what this module says and nothing else.

use std::time::Duration;

use sluice_core::Timestamp;

use crate::queue::{ItemResult, ItemState, Progress, ResultBody};

/// A batch's record.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct BatchRecord {
    pub(super) workspace: String,
    pub(super) key: Option<String>,
    pub(super) digest: Vec<u8>,
    pub(super) total: u32,
    pub(super) done: u32,
    pub(super) failed: u32,
    pub(super) queued: u32,
    pub(super) running: u32,
    pub(super) created_at: u64,
    /// 0: none yet.
    pub(super) first_claim_at: u64,
    /// 0: not finished.
    pub(super) finished_at: u64,
    /// The origin it came from (`""`: none, or a record of version 1).
    pub(super) origin: String,
    /// Bytes of its bodies and results stored now.
    pub(super) bytes: u64,
}

/// Version 2 added the origin and the bytes; a version 1 record reads as
/// having neither (its batch is not counted against the byte bound).
const RECORD_VERSION: u8 = 2;

impl BatchRecord {
    pub(super) fn encode(&self) -> Vec<u8> {
        let mut out =
            Vec::with_capacity(80 + self.workspace.len() + self.digest.len() + self.origin.len());
        out.push(RECORD_VERSION);
        for n in [
            self.total,
            self.done,
            self.failed,
            self.queued,
            self.running,
        ] {
            out.extend_from_slice(&n.to_le_bytes());
        }
        for t in [self.created_at, self.first_claim_at, self.finished_at] {
            out.extend_from_slice(&t.to_le_bytes());
        }
        let key = self.key.as_deref();
        out.push(u8::from(key.is_some()));
        for bytes in [
            self.workspace.as_bytes(),
            key.unwrap_or("").as_bytes(),
            &self.digest,
        ] {
            let len = u32::try_from(bytes.len()).unwrap_or(u32::MAX);
            out.extend_from_slice(&len.to_le_bytes());
            out.extend_from_slice(bytes);
        }
        out.extend_from_slice(&self.bytes.to_le_bytes());
        let len = u32::try_from(self.origin.len()).unwrap_or(u32::MAX);
        out.extend_from_slice(&len.to_le_bytes());
        out.extend_from_slice(self.origin.as_bytes());
        out
    }

    pub(super) fn decode(bytes: &[u8]) -> Option<Self> {
        let mut r = Reader(bytes);
        let version = r.take(1)?[0];
        if version != 1 && version != RECORD_VERSION {
            return None;
        }
        let mut rec = BatchRecord {
            total: r.u32()?,
            done: r.u32()?,
            failed: r.u32()?,
            queued: r.u32()?,
            running: r.u32()?,
            created_at: r.u64()?,
            first_claim_at: r.u64()?,
            finished_at: r.u64()?,
            ..BatchRecord::default()
        };
        let has_key = r.take(1)? == [1];
        rec.workspace = String::from_utf8(r.bytes()?.to_vec()).ok()?;
        let key = String::from_utf8(r.bytes()?.to_vec()).ok()?;
        rec.key = has_key.then_some(key);
        rec.digest = r.bytes()?.to_vec();
        if version >= 2 {
            rec.bytes = r.u64()?;
            rec.origin = String::from_utf8(r.bytes()?.to_vec()).ok()?;
        }
        Some(rec)
    }

    pub(super) fn progress(&self, mean_item: Option<Duration>) -> Progress {
        Progress {
            queued: self.queued,
            running: self.running,
            finished: self.done + self.failed,
            first_claim_at: nonzero(self.first_claim_at),
            finished_at: nonzero(self.finished_at),
            mean_item,
        }
    }
}

fn nonzero(ns: u64) -> Option<Timestamp> {
    (ns != 0).then_some(Timestamp::from_nanos(ns))
}

/// An item's record.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct ItemRecord {
    pub(super) state: u8,
    pub(super) attempt: u32,
    /// Its place in the workspace's queue (kept when it goes back).
    pub(super) place: u64,
    pub(super) claimed_at: u64,
    pub(super) finished_at: u64,
}

const ITEM_LEN: usize = 1 + 4 + 8 + 8 + 8;

impl ItemRecord {
    pub(super) fn encode(&self) -> [u8; ITEM_LEN] {
        let mut out = [0u8; ITEM_LEN];
        out[0] = self.state;
        out[1..5].copy_from_slice(&self.attempt.to_le_bytes());
        out[5..13].copy_from_slice(&self.place.to_le_bytes());
        out[13..21].copy_from_slice(&self.claimed_at.to_le_bytes());
        out[21..29].copy_from_slice(&self.finished_at.to_le_bytes());
        out
    }

    pub(super) fn decode(bytes: &[u8]) -> Option<Self> {
        let mut r = Reader(bytes);
        Some(ItemRecord {
            state: r.take(1)?[0],
            attempt: r.u32()?,
            place: r.u64()?,
            claimed_at: r.u64()?,
            finished_at: r.u64()?,
        })
    }

    pub(super) fn state(&self) -> ItemState {
        ItemState::from_code(self.state)
    }
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }

    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }

    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }

    fn bytes(&mut self) -> Option<&'a [u8]> {
        let len = usize::try_from(self.u32()?).ok()?;
        self.take(len)
    }
}

/// A result's stored form: the status, then [`ResultBody::encode`].
pub(super) fn encode_result(result: &ItemResult) -> Vec<u8> {
    let mut out = result.status.to_le_bytes().to_vec();
    out.extend_from_slice(&result.body.encode());
    out
}

pub(super) fn decode_result(bytes: &[u8]) -> Option<ItemResult> {
    let (status, body) = bytes.split_at_checked(2)?;
    Some(ItemResult {
        status: u16::from_le_bytes(status.try_into().ok()?),
        body: ResultBody::decode(body),
    })
}

pub(super) fn ns(t: Timestamp) -> u64 {
    // 0 means "none" in the records: the epoch itself counts as 1 ns past it.
    t.as_nanos().max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn l4_records_round_trip() {
        let rec = BatchRecord {
            workspace: "acme".to_owned(),
            key: Some("k-1".to_owned()),
            digest: vec![1, 2, 3],
            total: 10,
            done: 2,
            failed: 1,
            queued: 5,
            running: 2,
            created_at: 7,
            first_claim_at: 8,
            finished_at: 0,
            origin: "203.0.113.7".to_owned(),
            bytes: 1234,
        };
        assert_eq!(BatchRecord::decode(&rec.encode()), Some(rec.clone()));
        let no_key = BatchRecord { key: None, ..rec };
        assert_eq!(BatchRecord::decode(&no_key.encode()), Some(no_key));
        let item = ItemRecord {
            state: 1,
            attempt: 2,
            place: 3,
            claimed_at: 4,
            finished_at: 5,
        };
        assert_eq!(ItemRecord::decode(&item.encode()), Some(item));
        assert_eq!(BatchRecord::decode(b"\x01short"), None);
    }
}
