//! One bound on the request bytes the gateway holds in memory at once, across
//! every connection and both request paths, and a share of it per client: a body
//! taken in whole before a decision leases what its buffers hold here (the fast path
//! as the body arrives, in pieces each allocated once; the service stack its announced
//! size or the policy's bound, which its pieces stay within, and the server's read
//! buffer: [`READ_BUFFER_ALLOWANCE`]). Past the bound, or
//! past its client's share, a new request waits for nothing: it is answered 503 with
//! `Retry-After`, and bodies already leased go on.
//!
//! A client is the address sluice believes (see [`Holder`]): behind a trusted proxy,
//! the client the proxy names, so the clients of one proxy do not share one share.
//! The table of clients holding bytes is bounded ([`MAX_HOLDERS`]): a client leaves it
//! when its last byte is given back, and past the bound new clients share one overflow
//! entry (with one share between them) until room is made.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use parking_lot::Mutex;

/// Default bound on buffered request bytes: 256 MiB.
pub const DEFAULT_MAX_BUFFERED_BYTES: usize = 256 << 20;

/// Default share of the bound one client may hold: 1/8.
pub const DEFAULT_BUFFERED_SHARE: f64 = 0.125;

/// Most clients the per-client table holds at once; past it, new clients share one
/// overflow entry (and one share). Each entry is a few dozen bytes.
pub const MAX_HOLDERS: usize = 65_536;

/// Bytes of each piece a body taken in whole is read into as it arrives, on every
/// request path: one size for every piece of every body, so that the allocator packs
/// them densely (one size class). Pieces of growing sizes each took a partly used
/// page of their own class, and one buffer of a body's whole size a large page of its
/// own; with transparent huge pages (mimalloc asks for them) a partly used region is
/// resident whole, and held bodies took 1.3x what was counted.
pub const PIECE_BYTES: usize = 64 * 1024;

/// What a body read through the service stack holds besides itself while it arrives,
/// leased with it when it may be longer than one piece ([`PIECE_BYTES`], the gateway's
/// bound on hyper's read buffer too): that read buffer, and one it has replaced and
/// not yet given back. A shorter body arrives through a buffer its own size or less.
/// Uncounted, 64 held 1 MiB bodies took 1.23x to 1.29x the bound there.
pub const READ_BUFFER_ALLOWANCE: usize = 128 * 1024;

/// The longest a request body taken in whole may take to arrive, however steadily
/// it comes: a client cannot hold a buffer for longer than this.
pub const BODY_DEADLINE: Duration = Duration::from_secs(60);

/// Who a lease is charged to: the client address sluice believes for the request
/// (its digest, IPv6 grouped by the policy's prefix, as per-IP budgets count it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Holder(u64);

impl Holder {
    /// The holder of a request from `client` (see
    /// [`Identity::client_ip`](sluice_policy::Identity::client_ip)).
    pub fn of(client: &sluice_policy::ClientIp) -> Self {
        Holder(client.subject)
    }
}

/// Why a lease was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BufferFull {
    /// The gateway's bound is reached.
    Bound,
    /// The client's share of it is reached.
    Share,
}

/// The bound, what is leased of it, and by whom.
#[derive(Debug)]
pub struct BufferBudget {
    used: AtomicUsize,
    max: usize,
    share: usize,
    holders: Mutex<Holders>,
}

/// Bytes held per client: only clients holding at least one byte have an entry.
#[derive(Debug, Default)]
struct Holders {
    by_client: HashMap<Holder, usize>,
    /// Bytes of the clients that found the table full.
    overflow: usize,
}

/// The entry a lease is charged to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Charged {
    /// No client: the bound alone.
    Nobody,
    /// Not charged to any entry yet (the lease holds nothing).
    Pending(Holder),
    Client(Holder),
    Overflow,
}

/// A lease of buffered bytes, given back when dropped.
#[derive(Debug)]
pub struct BufferLease {
    budget: Arc<BufferBudget>,
    bytes: usize,
    charged: Charged,
}

impl BufferBudget {
    /// A bound of `max` bytes, a client's share the default fraction of it.
    pub fn new(max: usize) -> Arc<Self> {
        Self::with_share(max, DEFAULT_BUFFERED_SHARE)
    }

    /// A bound of `max` bytes, of which one client may hold `share` (a fraction,
    /// clamped to `0.0..=1.0`; 1 means no share beyond the bound). Whatever the share,
    /// a client holding nothing may start one body up to the bound: a request that
    /// fits the bound is never refused for good.
    pub fn with_share(max: usize, share: f64) -> Arc<Self> {
        let share = if share.is_nan() {
            DEFAULT_BUFFERED_SHARE
        } else {
            share.clamp(0.0, 1.0)
        };
        // Exact for any bound a machine holds (below 2^52 bytes).
        let share_bytes = ((max as f64) * share) as usize;
        Arc::new(BufferBudget {
            used: AtomicUsize::new(0),
            max,
            share: share_bytes.min(max),
            holders: Mutex::new(Holders::default()),
        })
    }

    /// Leases `bytes` of the bound alone (no client's share), or `None` when that
    /// would pass the bound.
    pub fn try_lease(self: &Arc<Self>, bytes: usize) -> Option<BufferLease> {
        self.take(bytes)?;
        Some(BufferLease {
            budget: Arc::clone(self),
            bytes,
            charged: Charged::Nobody,
        })
    }

    /// Leases `bytes` for `holder`: within the bound and within the holder's share
    /// (unless the holder holds nothing else).
    ///
    /// # Errors
    /// [`BufferFull`] says which was reached; nothing is leased.
    pub fn try_lease_for(
        self: &Arc<Self>,
        holder: Holder,
        bytes: usize,
    ) -> Result<BufferLease, BufferFull> {
        let mut lease = BufferLease {
            budget: Arc::clone(self),
            bytes: 0,
            charged: Charged::Pending(holder),
        };
        lease.try_grow_for(bytes)?;
        Ok(lease)
    }

    /// Adds `bytes` to what is used, within the bound.
    fn take(&self, bytes: usize) -> Option<()> {
        let mut used = self.used.load(Ordering::Relaxed);
        loop {
            let next = used.checked_add(bytes).filter(|&n| n <= self.max)?;
            match self
                .used
                .compare_exchange_weak(used, next, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) => return Some(()),
                Err(now) => used = now,
            }
        }
    }

    /// Bytes leased now.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    /// The bound.
    pub fn max(&self) -> usize {
        self.max
    }

    /// The most bytes one client may hold (but for its first body).
    pub fn share(&self) -> usize {
        self.share
    }

    /// Bytes `holder` holds now (the overflow entry's, when it is there).
    pub fn held_by(&self, holder: Holder) -> usize {
        let holders = self.holders.lock();
        holders.by_client.get(&holder).copied().unwrap_or(0)
    }

    /// Clients holding bytes now (the overflow entry aside).
    pub fn holders(&self) -> usize {
        self.holders.lock().by_client.len()
    }
}

impl BufferLease {
    /// Leases `bytes` more, or returns false (leasing nothing) when that would pass
    /// the bound or the holder's share: a buffer that grows as its body arrives
    /// leases each piece before it allocates it.
    pub fn try_grow(&mut self, bytes: usize) -> bool {
        self.try_grow_for(bytes).is_ok()
    }

    /// [`BufferLease::try_grow`], saying what was reached.
    ///
    /// # Errors
    /// [`BufferFull`]; nothing is leased.
    pub fn try_grow_for(&mut self, bytes: usize) -> Result<(), BufferFull> {
        if bytes == 0 {
            return Ok(());
        }
        let budget = Arc::clone(&self.budget);
        let holder = match self.charged {
            Charged::Nobody => {
                budget.take(bytes).ok_or(BufferFull::Bound)?;
                self.bytes += bytes;
                return Ok(());
            }
            Charged::Pending(h) | Charged::Client(h) => Some(h),
            Charged::Overflow => None,
        };
        let mut holders = budget.holders.lock();
        let Holders {
            by_client,
            overflow,
        } = &mut *holders;
        let (entry, charged) = match holder {
            Some(h) if by_client.contains_key(&h) || by_client.len() < MAX_HOLDERS => {
                (by_client.entry(h).or_insert(0), Charged::Client(h))
            }
            // The table is full: this client shares the overflow entry.
            _ => (overflow, Charged::Overflow),
        };
        let held = *entry;
        // What others of this holder hold: a holder with nothing else may start one body.
        let others = held.saturating_sub(self.bytes);
        let fits_share = held.checked_add(bytes).is_some_and(|n| n <= budget.share);
        let outcome = if others > 0 && !fits_share {
            Err(BufferFull::Share)
        } else if budget.take(bytes).is_none() {
            Err(BufferFull::Bound)
        } else {
            *entry = held + bytes;
            Ok(())
        };
        if held == 0 && outcome.is_err() {
            // Nothing held: no entry left behind.
            if let Charged::Client(h) = charged {
                by_client.remove(&h);
            }
            return outcome;
        }
        if outcome.is_ok() {
            self.bytes += bytes;
            self.charged = charged;
        }
        outcome
    }

    /// Gives `bytes` of this lease back (at most what it holds): pieces freed once
    /// a body is copied whole.
    pub fn shrink(&mut self, bytes: usize) {
        let bytes = bytes.min(self.bytes);
        self.give_back(bytes);
        self.bytes -= bytes;
    }

    /// Bytes this lease holds.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    fn give_back(&self, bytes: usize) {
        if bytes == 0 {
            return;
        }
        let budget = &self.budget;
        match self.charged {
            Charged::Nobody | Charged::Pending(_) => {}
            Charged::Client(h) => {
                let mut holders = budget.holders.lock();
                if let Some(held) = holders.by_client.get_mut(&h) {
                    *held = held.saturating_sub(bytes);
                    if *held == 0 {
                        holders.by_client.remove(&h);
                    }
                }
            }
            Charged::Overflow => {
                let mut holders = budget.holders.lock();
                holders.overflow = holders.overflow.saturating_sub(bytes);
            }
        }
        budget.used.fetch_sub(bytes, Ordering::AcqRel);
    }
}

impl Drop for BufferLease {
    fn drop(&mut self) {
        self.give_back(self.bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leases_stay_within_the_bound_and_come_back() {
        let budget = BufferBudget::new(100);
        let a = budget.try_lease(60).expect("room");
        assert!(budget.try_lease(41).is_none());
        let b = budget.try_lease(40).expect("room");
        assert_eq!(budget.used(), 100);
        drop(a);
        assert_eq!(budget.used(), 40);
        assert!(budget.try_lease(usize::MAX).is_none());
        let mut c = budget.try_lease(0).expect("an empty lease");
        assert!(c.try_grow(50) && c.try_grow(10));
        assert!(!c.try_grow(1), "past the bound");
        assert_eq!((c.bytes(), budget.used()), (60, 100));
        c.shrink(20);
        assert_eq!((c.bytes(), budget.used()), (40, 80));
        drop(c);
        drop(b);
        assert_eq!(budget.used(), 0);
        assert_eq!(Arc::strong_count(&budget), 1, "no lease left behind");
    }

    #[test]
    fn one_holder_holds_at_most_its_share_but_may_always_start_one_body() {
        let budget = BufferBudget::with_share(1000, 0.25);
        assert_eq!(budget.share(), 250);
        let (one, other) = (Holder(1), Holder(2));
        // A first body may pass the share (a request that fits the bound always can).
        let mut first = budget.try_lease_for(one, 0).expect("an empty lease");
        assert_eq!(budget.holders(), 0, "an empty lease takes no entry");
        assert!(first.try_grow(300));
        assert_eq!(budget.held_by(one), 300);
        // A second of the same holder is refused as soon as it would hold anything.
        let mut second = budget.try_lease_for(one, 0).expect("an empty lease");
        assert_eq!(second.try_grow_for(1), Err(BufferFull::Share));
        assert_eq!(
            budget.try_lease_for(one, 10).map(|l| l.bytes()),
            Err(BufferFull::Share)
        );
        // Another holder is served.
        let b = budget.try_lease_for(other, 200).expect("another client");
        assert_eq!((budget.used(), budget.held_by(other)), (500, 200));
        drop(first);
        assert_eq!(budget.held_by(one), 0);
        assert!(
            second.try_grow(250),
            "within the share once the first is gone"
        );
        assert!(second.try_grow(1), "alone, a body may pass the share");
        drop(second);
        drop(b);
        assert_eq!((budget.used(), budget.holders()), (0, 0));
    }

    #[test]
    fn the_bound_still_holds_over_every_holder() {
        let budget = BufferBudget::with_share(100, 1.0);
        let a = budget.try_lease_for(Holder(1), 70).expect("room");
        assert_eq!(
            budget.try_lease_for(Holder(2), 31).map(|l| l.bytes()),
            Err(BufferFull::Bound)
        );
        assert_eq!(budget.holders(), 1, "a refused holder leaves no entry");
        drop(a);
        assert_eq!((budget.used(), budget.holders()), (0, 0));
    }

    #[test]
    fn the_table_of_holders_is_bounded_and_the_rest_share_an_overflow_entry() {
        let budget = BufferBudget::with_share(usize::MAX / 2, 0.5);
        let held: Vec<BufferLease> = (0..MAX_HOLDERS as u64)
            .map(|h| budget.try_lease_for(Holder(h), 1).expect("room"))
            .collect();
        assert_eq!(budget.holders(), MAX_HOLDERS);
        let late = budget
            .try_lease_for(Holder(u64::MAX), 5)
            .expect("the overflow entry");
        assert_eq!(budget.holders(), MAX_HOLDERS, "no entry past the bound");
        assert_eq!(budget.holders.lock().overflow, 5);
        drop(held);
        assert_eq!(budget.holders(), 0);
        drop(late);
        assert_eq!((budget.used(), budget.holders.lock().overflow), (0, 0));
    }
}
