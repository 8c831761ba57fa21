//! Asking the CPU for a shard's cell before the shard's lock is taken.
//!
//! A multi-budget decision locks one shard per subject and then looks each
//! cell up. The lookup of a cold cell misses the cache, and the lock
//! instructions around it keep that miss from overlapping anything. So each
//! shard publishes, outside its lock, where its table's slots are; a
//! decision computes from each cell's hash the slot its lookup starts at and
//! prefetches that cache line first, which can hide part of the miss behind
//! the locking. Only that line is fetched: the table's control bytes (read
//! first by every lookup) are not, nor a slot a few places on where a
//! displaced cell sits, and for a cell not yet in the table there is nothing
//! to fetch.
//!
//! The published address is a hint only: it is read without the lock, may
//! be stale (the table has grown since) or torn, and is derived from the
//! addresses of slots the table hands out rather than from its private
//! layout. What it assumes of the table: its slots form one evenly spaced
//! array (checked on two of them at each publication), the array moves only
//! when the bucket count changes or a sweep rebuilds the table (the store
//! publishes after both), and a lookup starts at slot `hash & (buckets - 1)`, as in
//! swiss tables. Were any of it wrong, the prefetch would fetch a useless
//! line, never change an answer: nothing is ever read through the hint.

use std::sync::atomic::{AtomicUsize, Ordering};

use hashbrown::HashTable;

/// Where a shard's slots are, readable without the shard's lock.
#[derive(Debug, Default)]
pub(crate) struct SlotHint {
    /// The address slot 0 would have (0: no hint).
    base: AtomicUsize,
    /// Bytes from one slot to the next (may be negative, as two's complement).
    stride: AtomicUsize,
    /// Slots minus one (a power of two minus one).
    mask: AtomicUsize,
}

impl SlotHint {
    /// Publishes where `table`'s slots are now. Call under the shard's lock
    /// after the table may have moved (grown, or been rebuilt). Returns whether
    /// a hint was published: it takes two cells in the table to find the slots.
    pub(crate) fn publish<T>(&self, table: &HashTable<T>) -> bool {
        let buckets = table.num_buckets();
        // Two full slots give the spacing and where slot 0 sits.
        let mut full = (0..buckets).filter_map(|i| {
            table
                .get_bucket(i)
                .map(|entry| (i, std::ptr::from_ref(entry).addr()))
        });
        // `j > i`: buckets are visited in increasing order.
        let (Some((i, a)), Some((j, b))) = (full.next(), full.next()) else {
            self.base.store(0, Ordering::Relaxed);
            return false;
        };
        let stride = (b.wrapping_sub(a) as isize) / (j - i) as isize;
        if stride.unsigned_abs() != size_of::<T>() || !buckets.is_power_of_two() {
            // Not an array of slots as expected: no hint.
            self.base.store(0, Ordering::Relaxed);
            return false;
        }
        let base = a.wrapping_sub((i as isize).wrapping_mul(stride) as usize);
        // Three relaxed stores: a reader may see them mixed with the last
        // publication's, which only points a prefetch at a useless line.
        self.stride.store(stride as usize, Ordering::Relaxed);
        self.mask.store(buckets - 1, Ordering::Relaxed);
        self.base.store(base, Ordering::Relaxed);
        true
    }

    /// True when a hint is published.
    #[cfg(test)]
    pub(crate) fn is_published(&self) -> bool {
        self.base.load(Ordering::Relaxed) != 0
    }

    /// Prefetches the slot a lookup of `hash` starts at.
    #[inline]
    pub(crate) fn prefetch(&self, hash: u64) {
        let base = self.base.load(Ordering::Relaxed);
        if base == 0 {
            return;
        }
        let index = hash as usize & self.mask.load(Ordering::Relaxed);
        let stride = self.stride.load(Ordering::Relaxed);
        prefetch(base.wrapping_add(index.wrapping_mul(stride)));
    }
}

/// Asks the CPU to bring the cache line at `address` closer. A no-op
/// without x86-64's SSE (every usual x86-64 target has it).
#[inline]
fn prefetch(address: usize) {
    #[cfg(all(target_arch = "x86_64", target_feature = "sse"))]
    #[allow(unsafe_code)]
    // SAFETY: `_mm_prefetch`'s one precondition is the `sse` target feature,
    // which the `cfg` above requires. The intrinsic lowers to LLVM's
    // `llvm.prefetch`, which has no effect on the program's behaviour: it
    // reads nothing through the pointer and cannot fault, so any address —
    // stale, dangling, torn — is sound. The pointer is made without
    // provenance; nothing dereferences it.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
            std::ptr::without_provenance::<i8>(address),
        );
    }
    #[cfg(not(all(target_arch = "x86_64", target_feature = "sse")))]
    let _ = address;
}

#[cfg(test)]
mod tests {
    use std::hash::BuildHasher;

    use super::*;

    #[test]
    fn the_hint_knows_where_every_slot_is() {
        let hasher = foldhash::fast::RandomState::default();
        let mut table: HashTable<(u64, u64)> = HashTable::new();
        let hint = SlotHint::default();
        assert!(!hint.publish(&table));
        assert_eq!(hint.base.load(Ordering::Relaxed), 0, "no slots, no hint");
        for k in 0..1000u64 {
            table.insert_unique(hasher.hash_one(k), (k, k), |e| hasher.hash_one(e.0));
        }
        assert!(hint.publish(&table));
        let base = hint.base.load(Ordering::Relaxed);
        let stride = hint.stride.load(Ordering::Relaxed);
        let mask = hint.mask.load(Ordering::Relaxed);
        assert_ne!(base, 0);
        assert_eq!(mask + 1, table.num_buckets());
        // Every full slot sits where the hint says slot i is.
        for i in 0..table.num_buckets() {
            if let Some(e) = table.get_bucket(i) {
                let at = base.wrapping_add(i.wrapping_mul(stride));
                assert_eq!(std::ptr::from_ref(e) as usize, at);
            }
        }
        hint.prefetch(hasher.hash_one(7u64));
    }
}
