//! A bound on refusal log lines: a flood of refused requests is what a limiter
//! exists to absorb, and one stderr line per refusal would turn it into a flood
//! of writes (CPU on the refusal path, disk wherever the log goes). At most
//! `per_second` refusal lines are written in a second; the rest are counted, and
//! the first line written after a second that dropped some says how many.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// Default for [`RefusalLog::new`]: refusal lines written per second at most.
pub const DEFAULT_REFUSAL_LOG_PER_SECOND: u32 = 100;

/// How many refusal lines may still be written this second (see the module docs).
/// Shared by a limiter and the limiters that replace it on a reload.
#[derive(Debug)]
pub struct RefusalLog {
    /// Lines per second; 0: every refusal is written.
    per_second: u32,
    /// The Unix second `written` counts in.
    second: AtomicU64,
    written: AtomicU32,
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
    /// At most `per_second` refusal lines a second (0: no bound).
    pub fn new(per_second: u32) -> Self {
        RefusalLog {
            per_second,
            second: AtomicU64::new(0),
            written: AtomicU32::new(0),
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
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        self.take_at(now)
    }

    /// Takes a line in Unix second `now`. Races between threads at a second's turn
    /// can let a few more lines through than the bound; no line is lost from the
    /// count of dropped ones.
    pub(crate) fn take_at(&self, now: u64) -> Line {
        if self.per_second == 0 {
            return Line::Write;
        }
        let second = self.second.load(Ordering::Relaxed);
        if now > second
            && self
                .second
                .compare_exchange(second, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            self.written.store(0, Ordering::Relaxed);
        }
        if self.written.fetch_add(1, Ordering::Relaxed) < self.per_second {
            match self.dropped.swap(0, Ordering::Relaxed) {
                0 => Line::Write,
                dropped => Line::WriteAfterDropping(dropped),
            }
        } else {
            self.dropped.fetch_add(1, Ordering::Relaxed);
            Line::Drop
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
        assert_eq!(written, 50);
        assert_eq!(written + log.dropped(), 4_000);
    }
}
