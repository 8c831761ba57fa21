//! Asking the CPU for a shard's cell before the shard's lock is taken.
//!
//! A multi-budget decision locks one shard per subject and then looks each
//! cell up. The lookup of a cold cell misses the cache, and the lock
//! instructions around it keep that miss from overlapping anything. So each
//! shard publishes, outside its lock, where its table's slots are; a
//! decision computes each cell's likely slot from its hash and prefetches
//! that cache line first, and the miss overlaps the locking instead.
//!
//! The published address is a hint only: it is read without the lock, may
//! be stale (the table has grown since) or torn, and is derived from two
//! slots' addresses the table hands out rather than from its private layout.
//! The one thing assumed of the table is where a lookup starts: at slot
//! `hash & (buckets - 1)`, as in swiss tables. Were any of it wrong, the
//! prefetch would fetch a useless line, never change an answer: nothing is
//! ever read through the hint.

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
    /// after the table may have moved (grown).
    pub(crate) fn publish<T>(&self, table: &HashTable<T>) {
        let buckets = table.num_buckets();
        // Two full slots give the spacing and where slot 0 sits.
        let mut full = (0..buckets).filter_map(|i| {
            table
                .get_bucket(i)
                .map(|entry| (i, std::ptr::from_ref(entry) as usize))
        });
        let (Some((i, a)), Some((j, b))) = (full.next(), full.next()) else {
            return;
        };
        let stride = (b.wrapping_sub(a) as isize) / (j - i) as isize;
        if stride.unsigned_abs() != size_of::<T>() || !buckets.is_power_of_two() {
            // Not an array of slots as expected: publish nothing.
            self.base.store(0, Ordering::Relaxed);
            return;
        }
        let base = a.wrapping_sub((i as isize).wrapping_mul(stride) as usize);
        self.base.store(0, Ordering::Relaxed);
        self.stride.store(stride as usize, Ordering::Relaxed);
        self.mask.store(buckets - 1, Ordering::Relaxed);
        self.base.store(base, Ordering::Relaxed);
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

/// Asks the CPU to bring the cache line at `address` closer. A no-op off
/// x86-64.
#[inline]
fn prefetch(address: usize) {
    #[cfg(target_arch = "x86_64")]
    #[allow(unsafe_code)]
    // SAFETY: PREFETCHT0 is a hint: it does not dereference the pointer
    // architecturally, cannot fault, and writes nothing (Intel SDM vol. 2B,
    // "PREFETCHh"; AMD APM vol. 3, "PREFETCHlevel"). No Rust reference or
    // read is made from `address`, so a stale, dangling or unaligned value
    // is sound.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(address as *const i8);
    }
    #[cfg(not(target_arch = "x86_64"))]
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
        hint.publish(&table);
        assert_eq!(hint.base.load(Ordering::Relaxed), 0, "no slots, no hint");
        for k in 0..1000u64 {
            table.insert_unique(hasher.hash_one(k), (k, k), |e| hasher.hash_one(e.0));
        }
        hint.publish(&table);
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
