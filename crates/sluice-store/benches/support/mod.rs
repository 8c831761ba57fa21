//! What the store's benches share.

use std::sync::Barrier;
use std::time::{Duration, Instant};

/// Runs `op(thread, i)` `iters` times on each of `threads` threads; returns
/// wall time divided by the number of threads.
pub(crate) fn threaded(threads: u64, iters: u64, op: &(dyn Fn(u64, u64) + Sync)) -> Duration {
    let barrier = Barrier::new(threads as usize + 1);
    std::thread::scope(|s| {
        for t in 0..threads {
            let barrier = &barrier;
            s.spawn(move || {
                barrier.wait();
                for i in 0..iters {
                    op(t, i);
                }
            });
        }
        barrier.wait();
        // The scope joins every thread before returning.
        Instant::now()
    })
    .elapsed()
        / threads as u32
}
