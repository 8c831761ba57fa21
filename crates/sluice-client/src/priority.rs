//! Priorities (SPEC M3): interactive requests go first; batch requests use
//! only what interactive ones leave. The pacer keeps, per budget, the
//! interactive requests of the last window ([`InteractiveLog`]) and holds
//! that much (plus the largest of them) back from batch requests.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use http::HeaderMap;
use sluice_core::Timestamp;

use crate::route::{Cost, TokenAxis};

/// The request header naming a request's priority (`interactive` or
/// `batch`); the proxy takes it off before forwarding.
pub const PRIORITY_HEADER: &str = "x-sluice-priority";

/// How urgent a request is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Priority {
    /// Someone waits for it: it goes first (the default).
    #[default]
    Interactive,
    /// It may wait: it goes only on room interactive requests leave, and
    /// never while one waits.
    Batch,
}

impl Priority {
    /// `interactive` or `batch` (any case); `None` for anything else.
    pub fn parse(s: &str) -> Option<Self> {
        if s.trim().eq_ignore_ascii_case("interactive") {
            Some(Priority::Interactive)
        } else if s.trim().eq_ignore_ascii_case("batch") {
            Some(Priority::Batch)
        } else {
            None
        }
    }

    /// The priority `headers` name ([`PRIORITY_HEADER`]); interactive when
    /// they name none.
    ///
    /// # Errors
    /// The header's value when it is neither `interactive` nor `batch`.
    pub fn from_headers(headers: &HeaderMap) -> Result<Self, String> {
        match headers.get(PRIORITY_HEADER) {
            None => Ok(Priority::Interactive),
            Some(v) => v
                .to_str()
                .ok()
                .and_then(Priority::parse)
                .ok_or_else(|| String::from_utf8_lossy(v.as_bytes()).into_owned()),
        }
    }
}

/// How [`crate::Pacer::acquire_with`] treats one request:
/// [`AcquireOptions::default`] (interactive, the model from the demand),
/// then the builder methods.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct AcquireOptions {
    /// The model the request is for (overrides the one its body names).
    pub model: Option<String>,
    /// Its priority.
    pub priority: Priority,
}

impl AcquireOptions {
    /// The same options for `model`.
    #[must_use]
    pub fn model(mut self, model: &str) -> Self {
        self.model = Some(model.to_owned());
        self
    }

    /// The same options with `priority`.
    #[must_use]
    pub fn priority(mut self, priority: Priority) -> Self {
        self.priority = priority;
        self
    }
}

/// The most budgets whose interactive requests are remembered; past it the
/// oldest-touched are forgotten (their reserve drops to zero, which only
/// lets batch requests use more).
const MAX_SUBJECTS: usize = 4_096;
/// The most interactive requests remembered per budget.
const MAX_ENTRIES: usize = 65_536;

/// Interactive reservations of the last window, per budget.
#[derive(Debug, Default)]
pub(crate) struct InteractiveLog {
    by_subject: HashMap<u64, VecDeque<(Timestamp, Cost)>>,
}

impl InteractiveLog {
    pub(crate) fn record(&mut self, subject: u64, at: Timestamp, cost: Cost) {
        if self.by_subject.len() >= MAX_SUBJECTS && !self.by_subject.contains_key(&subject) {
            let oldest = self
                .by_subject
                .iter()
                .min_by_key(|(_, q)| q.back().map(|e| e.0))
                .map(|(k, _)| *k);
            if let Some(k) = oldest {
                self.by_subject.remove(&k);
            }
        }
        let q = self.by_subject.entry(subject).or_default();
        if q.len() >= MAX_ENTRIES {
            q.pop_front();
        }
        q.push_back((at, cost));
    }

    /// What batch requests leave on `subject`'s `axis` at `now`: the
    /// interactive tokens still in the window (`span`) plus the largest
    /// interactive request among them (room for the next one).
    pub(crate) fn reserve(
        &mut self,
        subject: u64,
        axis: TokenAxis,
        now: Timestamp,
        span: Duration,
    ) -> u32 {
        let Some(q) = self.by_subject.get_mut(&subject) else {
            return 0;
        };
        while q.front().is_some_and(|e| e.0.saturating_add(span) <= now) {
            q.pop_front();
        }
        let (sum, max) = q.iter().fold((0u32, 0u32), |(s, m), e| {
            let c = e.1.on(axis);
            (s.saturating_add(c), m.max(c))
        });
        sum.saturating_add(max)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn m3_priority_is_read_from_the_header() {
        let mut h = HeaderMap::new();
        assert_eq!(Priority::from_headers(&h), Ok(Priority::Interactive));
        h.insert(PRIORITY_HEADER, http::HeaderValue::from_static("Batch"));
        assert_eq!(Priority::from_headers(&h), Ok(Priority::Batch));
        h.insert(PRIORITY_HEADER, http::HeaderValue::from_static("urgent"));
        assert_eq!(Priority::from_headers(&h), Err("urgent".to_owned()));
    }

    #[test]
    fn m3_the_reserve_is_the_window_s_interactive_tokens_plus_the_largest() {
        let mut log = InteractiveLog::default();
        let t0 = crate::clock::TEST_EPOCH;
        let c = |input, output| Cost { input, output };
        log.record(1, t0, c(100, 50));
        log.record(1, t0.saturating_add(Duration::from_secs(30)), c(300, 10));
        let span = Duration::from_secs(61);
        let at = t0.saturating_add(Duration::from_secs(40));
        assert_eq!(log.reserve(1, TokenAxis::Total, at, span), 150 + 310 + 310);
        assert_eq!(log.reserve(1, TokenAxis::Output, at, span), 60 + 50);
        let later = t0.saturating_add(Duration::from_secs(62));
        assert_eq!(log.reserve(1, TokenAxis::Input, later, span), 600);
        assert_eq!(log.reserve(2, TokenAxis::Input, later, span), 0);
    }
}
