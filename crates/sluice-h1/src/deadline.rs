//! A connection's successive deadlines on one timer that rarely touches the runtime's
//! timer wheel.
//!
//! A keep-alive connection sets a new deadline for every request (its head must arrive
//! within the header timeout, the upstream's answer within the upstream timeout), and
//! each one lies later than the one before. A fresh `tokio::time::timeout` per wait
//! registers a timer and removes it again every time: about a sixth of the fast path's
//! user-space instructions. [`Deadline`] keeps one armed timer instead and lets a later
//! deadline wait: when the armed time comes and the current deadline lies further on,
//! the timer is armed again for it. So a deadline still ends the wait at its exact time,
//! and the wheel is touched about once per timeout period, not once per request.

use std::pin::Pin;

use tokio::time::{Instant, Sleep};

/// One connection's timer for one kind of deadline.
#[derive(Debug)]
pub struct Deadline {
    sleep: Pin<Box<Sleep>>,
    /// When the timer is armed to fire (never after `current`).
    armed: Instant,
    /// The deadline now in force.
    current: Instant,
}

impl Deadline {
    /// A timer for deadlines from `first` on.
    pub fn new(first: Instant) -> Self {
        Deadline {
            sleep: Box::pin(tokio::time::sleep_until(first)),
            armed: first,
            current: first,
        }
    }

    /// Makes `deadline` the one in force. A later one than armed waits until the armed
    /// time; an earlier one re-arms the timer at once.
    pub fn set(&mut self, deadline: Instant) {
        self.current = deadline;
        if deadline < self.armed {
            self.rearm();
        }
    }

    fn rearm(&mut self) {
        self.armed = self.current;
        self.sleep.as_mut().reset(self.current);
    }

    /// Completes when the deadline in force has passed.
    pub async fn passed(&mut self) {
        loop {
            self.sleep.as_mut().await;
            if Instant::now() >= self.current {
                return;
            }
            self.rearm();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn each_deadline_ends_the_wait_at_its_own_time() {
        let start = Instant::now();
        let second = Duration::from_secs(1);
        let mut deadline = Deadline::new(start + 10 * second);

        // Moved later before it fires: the wait ends at the later time, not the armed one.
        tokio::time::advance(4 * second).await;
        deadline.set(start + 14 * second);
        deadline.passed().await;
        assert_eq!(Instant::now() - start, 14 * second);

        // Moved earlier: re-armed at once.
        deadline.set(start + 30 * second);
        deadline.set(start + 16 * second);
        deadline.passed().await;
        assert_eq!(Instant::now() - start, 16 * second);

        // Already past: done at once.
        deadline.set(start);
        deadline.passed().await;
        assert_eq!(Instant::now() - start, 16 * second);
    }
}
