//! One bound on the request bytes the gateway holds in memory at once, across
//! every connection and both request paths: a body taken in whole before a
//! decision leases what its buffer holds here (the fast path as the body arrives,
//! the service stack its announced size or the policy's bound). Past the bound, a new request waits for
//! nothing: it is answered 503 with `Retry-After`, and bodies already leased go on.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// Default bound on buffered request bytes: 256 MiB.
pub const DEFAULT_MAX_BUFFERED_BYTES: usize = 256 << 20;

/// The longest a request body taken in whole may take to arrive, however steadily
/// it comes: a client cannot hold a buffer for longer than this.
pub const BODY_DEADLINE: Duration = Duration::from_secs(60);

/// The bound and what is leased of it.
#[derive(Debug)]
pub struct BufferBudget {
    used: AtomicUsize,
    max: usize,
}

/// A lease of buffered bytes, given back when dropped.
#[derive(Debug)]
pub struct BufferLease {
    budget: Arc<BufferBudget>,
    bytes: usize,
}

impl BufferBudget {
    /// A bound of `max` bytes.
    pub fn new(max: usize) -> Arc<Self> {
        Arc::new(BufferBudget {
            used: AtomicUsize::new(0),
            max,
        })
    }

    /// Leases `bytes`, or `None` when that would pass the bound.
    pub fn try_lease(self: &Arc<Self>, bytes: usize) -> Option<BufferLease> {
        let mut used = self.used.load(Ordering::Relaxed);
        loop {
            let next = used.checked_add(bytes).filter(|&n| n <= self.max)?;
            match self
                .used
                .compare_exchange_weak(used, next, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) => {
                    return Some(BufferLease {
                        budget: Arc::clone(self),
                        bytes,
                    });
                }
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
}

impl BufferLease {
    /// Leases `bytes` more, or returns false (leasing nothing) when that would pass
    /// the bound: a buffer that grows as its body arrives leases as it grows.
    pub fn try_grow(&mut self, bytes: usize) -> bool {
        match self.budget.try_lease(bytes) {
            Some(more) => {
                self.bytes += more.bytes;
                std::mem::forget(more);
                true
            }
            None => false,
        }
    }

    /// Bytes this lease holds.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for BufferLease {
    fn drop(&mut self) {
        self.budget.used.fetch_sub(self.bytes, Ordering::AcqRel);
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
        drop(c);
        drop(b);
        assert_eq!(budget.used(), 0);
    }
}
