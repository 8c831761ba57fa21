//! A bound on refusal log lines: a flood of refused requests is what a limiter
//! exists to absorb, and one stderr line per refusal would turn it into a flood
//! of writes (CPU on the refusal path, disk wherever the log goes). At most
//! `per_second` refusal lines are written in a second; the rest are counted, and
//! the first line written after a second that dropped some says how many.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// Default for [`RefusalLog::new`]: refusal lines written per second at most.
pub const DEFAULT_REFUSAL_LOG_PER_SECOND: u32 = 100;

/// Bits of [`RefusalLog::state`] holding the lines written in its second.
const COUNT_BITS: u32 = 24;
const COUNT_MASK: u64 = (1 << COUNT_BITS) - 1;

/// How many refusal lines may still be written this second (see the module docs).
/// Shared by a limiter and the limiters that replace it on a reload.
#[derive(Debug)]
pub struct RefusalLog {
    /// Lines per second (at most 2^24 - 1); 0: every refusal is written.
    per_second: u32,
    /// Seconds are counted on the monotonic clock from here, so a step of the
    /// wall clock neither stalls nor resets the bound.
    started: Instant,
    /// The second (since `started`) in the high bits, the lines written in it
    /// in the low [`COUNT_BITS`]: one atomic, so the bound is exact.
    state: AtomicU64,
    /// Lines not written since the last report.
    dropped: AtomicU64,
}

/// Whether a refusal line may be written now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Line {
    /// Write it.
    Write,
    /// Write it, and say first that this many lines were not written before it.
    WriteAfterDropping(u64),
    /// Count it only.
    Drop,
}

impl RefusalLog {
    /// At most `per_second` refusal lines a second (0: no bound; a bound above
    /// 2^24 - 1 is taken as that).
    pub fn new(per_second: u32) -> Self {
        RefusalLog {
            per_second: per_second.min(COUNT_MASK as u32),
            started: Instant::now(),
            state: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
        }
    }

    /// The bound: lines a second, 0 for none.
    pub fn per_second(&self) -> u32 {
        self.per_second
    }

    /// Refusal lines not written since the last one that reported them.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Takes a line at the current time.
    pub(crate) fn take(&self) -> Line {
        if self.per_second == 0 {
            return Line::Write;
        }
        self.take_at(self.started.elapsed().as_secs())
    }

    /// Takes a line in second `now` (counted from the log's start; seconds only
    /// go forward). At most the bound of lines is written in any one second.
    pub(crate) fn take_at(&self, now: u64) -> Line {
        if self.per_second == 0 {
            return Line::Write;
        }
        let mut state = self.state.load(Ordering::Relaxed);
        loop {
            let (second, written) = (state >> COUNT_BITS, state & COUNT_MASK);
            let next = if now > second {
                (now << COUNT_BITS) | 1
            } else if written < u64::from(self.per_second) {
                state + 1
            } else {
                self.dropped.fetch_add(1, Ordering::Relaxed);
                return Line::Drop;
            };
            match self.state.compare_exchange_weak(
                state,
                next,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => break,
                Err(current) => state = current,
            }
        }
        match self.dropped.swap(0, Ordering::Relaxed) {
            0 => Line::Write,
            dropped => Line::WriteAfterDropping(dropped),
        }
    }
}

impl Default for RefusalLog {
    fn default() -> Self {
        RefusalLog::new(DEFAULT_REFUSAL_LOG_PER_SECOND)
    }
}

/// Writes one refusal line through `write` if `log` allows it now, after a line
/// saying how many were dropped before it.
pub(crate) fn refusal_line(log: &RefusalLog, write: impl FnOnce()) {
    match log.take() {
        Line::Write => write(),
        Line::WriteAfterDropping(dropped) => {
            tracing::info!(
                target: "sluice::refusal",
                dropped,
                per_second = log.per_second(),
                "refusal lines not written: more than the bound a second"
            );
            write();
        }
        Line::Drop => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn at_most_the_bound_a_second_then_the_count_of_the_rest() {
        let log = RefusalLog::new(3);
        let second =
            |log: &RefusalLog, now, n| (0..n).map(|_| log.take_at(now)).collect::<Vec<_>>();
        assert_eq!(
            second(&log, 100, 5),
            [
                Line::Write,
                Line::Write,
                Line::Write,
                Line::Drop,
                Line::Drop
            ]
        );
        assert_eq!(log.dropped(), 2);
        assert_eq!(
            second(&log, 101, 4),
            [
                Line::WriteAfterDropping(2),
                Line::Write,
                Line::Write,
                Line::Drop
            ]
        );
        assert_eq!(second(&log, 105, 1), [Line::WriteAfterDropping(1)]);
        assert_eq!(log.dropped(), 0);
    }

    #[test]
    fn a_bound_of_zero_writes_every_line() {
        let log = RefusalLog::new(0);
        assert!((0..10_000).all(|_| log.take_at(7) == Line::Write));
    }

    #[test]
    fn threads_together_write_about_the_bound_and_lose_no_count() {
        let log = RefusalLog::new(50);
        let written = std::sync::atomic::AtomicU64::new(0);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..1_000 {
                        if log.take_at(9) != Line::Drop {
                            written.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                });
            }
        });
        let written = written.load(Ordering::Relaxed);
        assert_eq!(written, 50, "exactly the bound in one second");
        assert_eq!(written + log.dropped(), 4_000);
    }
}
