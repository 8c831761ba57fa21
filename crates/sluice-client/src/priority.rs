//! Priorities (SPEC M3): interactive requests go first; batch requests use
//! only what interactive ones leave. The pacer keeps, per budget, the
//! interactive requests of the last window (`InteractiveLog`); a batch
//! request goes only when the room left after it holds the largest of them
//! and what comes at their rate in the next seconds, and batch tokens go no
//! faster than the budget's own even rate, interactive tokens counted in it
//! (`BatchPace`), so that the window fills no faster than it empties and
//! room comes back evenly, never after a gap an interactive request would
//! wait through.

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

    /// The interactive demand on `subject`'s `axis` at `now`: tokens a
    /// second over the window (`span`), and the largest interactive request
    /// in it.
    pub(crate) fn demand(
        &mut self,
        subject: u64,
        axis: TokenAxis,
        now: Timestamp,
        span: Duration,
    ) -> (f64, u32) {
        let Some(q) = self.by_subject.get_mut(&subject) else {
            return (0.0, 0);
        };
        while q.front().is_some_and(|e| e.0.saturating_add(span) <= now) {
            q.pop_front();
        }
        let (sum, max) = q.iter().fold((0u64, 0u32), |(s, m), e| {
            let c = e.1.on(axis);
            (s + u64::from(c), m.max(c))
        });
        (sum as f64 / span.as_secs_f64().max(1.0), max)
    }
}

/// Batch tokens per budget and axis go at the budget's rate (a GCRA over
/// tokens): the instant by which the tokens sent so far are paid for.
/// Interactive tokens are paid for here too, but only batch requests wait
/// for the pace.
#[derive(Debug, Default)]
pub(crate) struct BatchPace {
    paid_until: HashMap<(u64, TokenAxis), Timestamp>,
}

impl BatchPace {
    /// When the batch tokens sent on `subject`'s `axis` are paid for (a
    /// batch request may go a burst ahead of it).
    pub(crate) fn ready_at(&self, subject: u64, axis: TokenAxis) -> Timestamp {
        self.paid_until
            .get(&(subject, axis))
            .copied()
            .unwrap_or(Timestamp::from_nanos(0))
    }

    /// Pays for `cost` batch tokens sent at `now` on a budget of `limit`
    /// per `span`.
    pub(crate) fn spend(
        &mut self,
        subject: u64,
        axis: TokenAxis,
        cost: u32,
        limit: u32,
        span: Duration,
        now: Timestamp,
    ) {
        if limit == 0 {
            return;
        }
        if self.paid_until.len() >= MAX_SUBJECTS && !self.paid_until.contains_key(&(subject, axis))
        {
            self.paid_until.retain(|_, t| *t > now);
        }
        let t = self.paid_until.entry((subject, axis)).or_insert(now);
        let per_token = span.as_secs_f64() / f64::from(limit);
        *t = (*t)
            .max(now)
            .saturating_add(Duration::from_secs_f64(per_token * f64::from(cost)));
    }

    /// Takes back `tokens` batch tokens that an answer gave back (they no
    /// longer count toward the pace).
    pub(crate) fn refund(
        &mut self,
        subject: u64,
        axis: TokenAxis,
        tokens: u32,
        limit: u32,
        span: Duration,
    ) {
        if limit == 0 {
            return;
        }
        if let Some(t) = self.paid_until.get_mut(&(subject, axis)) {
            let back = span.as_secs_f64() / f64::from(limit) * f64::from(tokens);
            let back = u64::try_from(Duration::from_secs_f64(back).as_nanos()).unwrap_or(u64::MAX);
            *t = Timestamp::from_nanos(t.as_nanos().saturating_sub(back));
        }
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
    fn m3_batch_tokens_are_paid_for_at_the_budget_s_rate() {
        let mut pace = BatchPace::default();
        let t0 = crate::clock::TEST_EPOCH;
        let span = Duration::from_secs(60);
        pace.spend(1, TokenAxis::Total, 500, 1_000, span, t0);
        assert_eq!(
            pace.ready_at(1, TokenAxis::Total),
            t0.saturating_add(Duration::from_secs(30))
        );
        pace.spend(
            1,
            TokenAxis::Total,
            100,
            1_000,
            span,
            t0.saturating_add(Duration::from_secs(40)),
        );
        assert_eq!(
            pace.ready_at(1, TokenAxis::Total),
            t0.saturating_add(Duration::from_secs(46))
        );
        assert_eq!(pace.ready_at(2, TokenAxis::Total), Timestamp::from_nanos(0));
    }

    #[test]
    fn m3_interactive_demand_is_the_window_s_rate_and_its_largest_request() {
        let mut log = InteractiveLog::default();
        let t0 = crate::clock::TEST_EPOCH;
        let c = |input, output| Cost { input, output };
        log.record(1, t0, c(100, 50));
        log.record(1, t0.saturating_add(Duration::from_secs(30)), c(300, 10));
        let span = Duration::from_secs(60);
        let at = t0.saturating_add(Duration::from_secs(35));
        assert_eq!(
            log.demand(1, TokenAxis::Total, at, span),
            (460.0 / 60.0, 310)
        );
        assert_eq!(log.demand(1, TokenAxis::Output, at, span), (1.0, 50));
        let later = t0.saturating_add(Duration::from_secs(62));
        assert_eq!(log.demand(1, TokenAxis::Input, later, span), (5.0, 300));
        assert_eq!(log.demand(2, TokenAxis::Input, later, span), (0.0, 0));
    }
}
