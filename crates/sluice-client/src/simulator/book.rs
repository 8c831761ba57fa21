//! The rules: rolling books of what arrived (tokens and requests in the
//! last 60 s, requests in the last 24 h), per provider and per model; a
//! request is admitted only when every book it is counted in has room, and
//! settled to what it used when its answer ends.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use sluice_core::{Clock, Timestamp};

use super::config::{DAY, Limits, MINUTE, Rules, SimModel, SimulatorConfig, SimulatorStats};

#[derive(Debug)]
pub(super) struct Entry {
    pub(super) id: u64,
    pub(super) at: Timestamp,
    pub(super) tokens: u64,
    pub(super) input: u64,
    pub(super) output: u64,
}

/// One token axis of a book: its name, limit, what a request asks, and
/// what an entry holds on it.
pub(super) type TokenAxis = (&'static str, u32, u64, fn(&Entry) -> u64);

/// What one request counts at arrival.
#[derive(Clone, Copy, Debug)]
pub(super) struct Count {
    pub(super) tokens: u64,
    pub(super) input: u64,
    pub(super) output: u64,
}

/// Why a book refused a request: the axis's name, when room comes back,
/// what was used, the limit, what was asked.
pub(super) struct Refusal {
    pub(super) axis: &'static str,
    pub(super) wait: Duration,
    pub(super) used: u64,
    pub(super) limit: u32,
    pub(super) requested: u64,
}

#[derive(Debug, Default)]
pub(super) struct Book {
    pub(super) minute: VecDeque<Entry>,
    pub(super) day: VecDeque<Timestamp>,
    /// Arrivals in the current sub-minute slice ([`Rules::slice`]).
    pub(super) recent: VecDeque<Timestamp>,
    /// When the anchored minute opened ([`Rules::anchored`]).
    pub(super) anchor: Option<Timestamp>,
    pub(super) next_id: u64,
    pub(super) stats: SimulatorStats,
    /// Arrival times and tokens of every admitted request (for reports).
    pub(super) log: Vec<(Timestamp, u64)>,
}

impl Book {
    pub(super) fn prune(&mut self, now: Timestamp, rules: Rules) {
        if rules.anchored {
            if self.anchor.is_some_and(|a| a.saturating_add(MINUTE) <= now) {
                self.minute.clear();
                self.anchor = None;
            }
        } else {
            while self
                .minute
                .front()
                .is_some_and(|e| e.at.saturating_add(MINUTE) <= now)
            {
                self.minute.pop_front();
            }
        }
        while self
            .recent
            .front()
            .is_some_and(|t| t.saturating_add(rules.slice) <= now)
        {
            self.recent.pop_front();
        }
        while self
            .day
            .front()
            .is_some_and(|t| t.saturating_add(DAY) <= now)
        {
            self.day.pop_front();
        }
    }

    /// When the entry arrived at `at` leaves the minute window.
    pub(super) fn leaves(&self, at: Timestamp, rules: Rules) -> Timestamp {
        match (rules.anchored, self.anchor) {
            (true, Some(a)) => a.saturating_add(MINUTE),
            _ => at.saturating_add(MINUTE),
        }
    }

    /// The next instant after `now` at which something leaves a window
    /// (after [`Book::prune`]).
    pub(super) fn next_change(&self, rules: Rules) -> Option<Timestamp> {
        let minute = self.minute.front().map(|e| self.leaves(e.at, rules));
        let slice = self.recent.front().map(|t| t.saturating_add(rules.slice));
        let day = self.day.front().map(|t| t.saturating_add(DAY));
        [minute, slice, day].into_iter().flatten().min()
    }

    pub(super) fn tokens(&self) -> u64 {
        self.minute.iter().map(|e| e.tokens).sum()
    }

    pub(super) fn sum(&self, f: fn(&Entry) -> u64) -> u64 {
        self.minute.iter().map(f).sum()
    }

    /// Whether `c` fits every axis of `l` at `now` (after
    /// [`Book::prune`]), the first axis over otherwise.
    pub(super) fn check(
        &self,
        l: Limits,
        c: Count,
        now: Timestamp,
        rules: Rules,
    ) -> Option<Refusal> {
        let until = |t: Timestamp| self.leaves(t, rules).saturating_since(now);
        let token_axes: [TokenAxis; 3] = [
            ("tokens", l.tpm, c.tokens, |e| e.tokens),
            ("input tokens", l.itpm, c.input, |e| e.input),
            ("output tokens", l.otpm, c.output, |e| e.output),
        ];
        for (axis, limit, asked, of) in token_axes {
            let used = self.sum(of);
            if limit > 0 && used + asked > u64::from(limit) {
                // Room comes back when enough of the oldest entries leave.
                let mut left = used;
                let mut wait = MINUTE;
                for e in &self.minute {
                    left -= of(e);
                    if left + asked <= u64::from(limit) {
                        wait = until(e.at);
                        break;
                    }
                }
                return Some(Refusal {
                    axis,
                    wait,
                    used,
                    limit,
                    requested: asked,
                });
            }
        }
        let count = self.minute.len() as u64;
        if l.rpm > 0 && count + 1 > u64::from(l.rpm) {
            return Some(Refusal {
                axis: "requests",
                wait: self.minute.front().map_or(MINUTE, |e| until(e.at)),
                used: count,
                limit: l.rpm,
                requested: 1,
            });
        }
        let per_slice = rules.slice_limit(l.rpm);
        if per_slice > 0 && self.recent.len() as u64 + 1 > per_slice {
            return Some(Refusal {
                axis: "requests per slice",
                wait: self.recent.front().map_or(rules.slice, |t| {
                    t.saturating_add(rules.slice).saturating_since(now)
                }),
                used: self.recent.len() as u64,
                limit: u32::try_from(per_slice).unwrap_or(u32::MAX),
                requested: 1,
            });
        }
        if l.rpd > 0 && self.day.len() as u64 + 1 > u64::from(l.rpd) {
            return Some(Refusal {
                axis: "requests per day",
                wait: self
                    .day
                    .front()
                    .map_or(DAY, |t| t.saturating_add(DAY).saturating_since(now)),
                used: self.day.len() as u64,
                limit: l.rpd,
                requested: 1,
            });
        }
        None
    }

    /// [`Book::check`], counting a refusal on its axis.
    pub(super) fn refuse(
        &mut self,
        l: Limits,
        c: Count,
        now: Timestamp,
        rules: Rules,
    ) -> Option<Refusal> {
        let r = self.check(l, c, now, rules)?;
        let st = &mut self.stats;
        match r.axis {
            "tokens" => st.tpm_violations += 1,
            "input tokens" => st.itpm_violations += 1,
            "output tokens" => st.otpm_violations += 1,
            "requests" => st.rpm_violations += 1,
            "requests per slice" => st.slice_violations += 1,
            _ => st.rpd_violations += 1,
        }
        Some(r)
    }

    pub(super) fn record(&mut self, id: u64, c: Count, now: Timestamp, rules: Rules) {
        self.minute.push_back(Entry {
            id,
            at: now,
            tokens: c.tokens,
            input: c.input,
            output: c.output,
        });
        if rules.anchored && self.anchor.is_none() {
            self.anchor = Some(now);
        }
        if !rules.slice.is_zero() {
            self.recent.push_back(now);
        }
        self.day.push_back(now);
        self.log.push((now, c.tokens));
        let st = &mut self.stats;
        st.admitted += 1;
        st.tokens_reserved += c.tokens;
        let (t, i, o) = (
            self.minute.iter().map(|e| e.tokens).sum::<u64>(),
            self.minute.iter().map(|e| e.input).sum::<u64>(),
            self.minute.iter().map(|e| e.output).sum::<u64>(),
        );
        let n = self.minute.len() as u64;
        let st = &mut self.stats;
        st.worst_window_tokens = st.worst_window_tokens.max(t);
        st.worst_window_requests = st.worst_window_requests.max(n);
        st.worst_window_input = st.worst_window_input.max(i);
        st.worst_window_output = st.worst_window_output.max(o);
    }

    pub(super) fn settle(&mut self, reconcile: bool, id: u64, input: u64, output: u64) {
        self.stats.tokens_used += input + output;
        self.stats.input_used += input;
        self.stats.output_used += output;
        if reconcile && let Some(e) = self.minute.iter_mut().find(|e| e.id == id) {
            e.tokens = input + output;
            e.input = input;
            e.output = output;
        }
    }
}

pub(super) struct Shared {
    pub(super) config: parking_lot::Mutex<SimulatorConfig>,
    pub(super) clock: Arc<dyn Clock>,
    pub(super) book: parking_lot::Mutex<Book>,
    /// Models with their own limits, each with its book (locked after
    /// `book`).
    pub(super) models: parking_lot::Mutex<Vec<(SimModel, Book)>>,
    /// The arrival jitter's stream ([`SimulatorConfig::seed`]).
    pub(super) rng: parking_lot::Mutex<fastrand::Rng>,
}

impl Shared {
    pub(super) fn new(config: SimulatorConfig, clock: Arc<dyn Clock>) -> Self {
        Shared {
            config: parking_lot::Mutex::new(config),
            clock,
            book: parking_lot::Mutex::new(Book::default()),
            models: parking_lot::Mutex::new(Vec::new()),
            rng: parking_lot::Mutex::new(fastrand::Rng::with_seed(config.seed)),
        }
    }

    pub(super) fn model_stats(&self, pattern: &str) -> Option<SimulatorStats> {
        self.models
            .lock()
            .iter()
            .find(|(m, _)| m.pattern == pattern)
            .map(|(_, b)| b.stats)
    }
}

pub(super) struct Verdict {
    pub(super) refused: Option<Refusal>,
    pub(super) id: u64,
    /// The limits the headers describe: the model's when it has its own.
    pub(super) limits: Limits,
    pub(super) remaining_requests: u64,
    pub(super) remaining_tokens: u64,
    pub(super) remaining_input: u64,
    pub(super) remaining_output: u64,
    pub(super) reset_requests: Duration,
    pub(super) reset_tokens: Duration,
}

/// Counts a request of `model` at arrival against the provider-wide book
/// and, when one of the models matches, that model's book: admitted only
/// when both have room.
pub(super) fn admit(
    shared: &Shared,
    cfg: &SimulatorConfig,
    model: &str,
    c: Count,
    now: Timestamp,
) -> Verdict {
    let rules = Rules::from(cfg);
    let mut b = shared.book.lock();
    let mut models = shared.models.lock();
    b.prune(now, rules);
    b.stats.requests += 1;
    let mut own = models
        .iter_mut()
        .find(|(m, _)| crate::config::glob_matches(&m.pattern, model));
    if let Some((_, mb)) = own.as_mut() {
        mb.prune(now, rules);
        mb.stats.requests += 1;
    }
    let mut refused = b.refuse(Limits::from(cfg), c, now, rules);
    if refused.is_none()
        && let Some((m, mb)) = own.as_mut()
    {
        refused = mb.refuse(m.limits(), c, now, rules);
        if refused.is_some() {
            mb.stats.violations += 1;
        }
    }
    let id = b.next_id;
    if refused.is_some() {
        b.stats.violations += 1;
    } else {
        b.next_id += 1;
        b.record(id, c, now, rules);
        if let Some((_, mb)) = own.as_mut() {
            mb.record(id, c, now, rules);
        }
    }
    let (limits, book): (Limits, &Book) = match &own {
        Some((m, mb)) => (m.limits(), mb),
        None => (Limits::from(cfg), &b),
    };
    let until = |t: Timestamp| book.leaves(t, rules).saturating_since(now);
    Verdict {
        refused,
        id,
        limits,
        remaining_requests: u64::from(limits.rpm).saturating_sub(book.minute.len() as u64),
        remaining_tokens: u64::from(limits.tpm).saturating_sub(book.tokens()),
        remaining_input: u64::from(limits.itpm).saturating_sub(book.sum(|e| e.input)),
        remaining_output: u64::from(limits.otpm).saturating_sub(book.sum(|e| e.output)),
        reset_requests: book.minute.front().map_or(Duration::ZERO, |e| until(e.at)),
        reset_tokens: book.minute.back().map_or(Duration::ZERO, |e| until(e.at)),
    }
}

/// Replaces an admitted request's count by what it used.
pub(super) fn settle(
    shared: &Shared,
    reconcile: bool,
    id: u64,
    model: &str,
    input: u64,
    output: u64,
) {
    let mut b = shared.book.lock();
    b.settle(reconcile, id, input, output);
    let mut models = shared.models.lock();
    if let Some((_, mb)) = models
        .iter_mut()
        .find(|(m, _)| crate::config::glob_matches(&m.pattern, model))
    {
        mb.settle(reconcile, id, input, output);
    }
}
