//! The best schedule a workload allows under a provider's own rules: the
//! simulator's books (the same [`Book`] that answers requests: rolling or
//! anchored minutes, sub-minute slices, models' and keys' own limits)
//! driven with perfect knowledge of what each request counts, when it
//! arrives and when its answer ends.

use std::time::Duration;

use sluice_core::Timestamp;

use super::book::{Book, Count};
use super::config::{Limits, Rules, SimModel, SimulatorConfig};

/// A request of a workload as the provider counts it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScheduleItem {
    /// When the client has it, from the start of the run.
    pub at: Duration,
    /// The model it names.
    pub model: String,
    /// Input tokens, as the provider counts them.
    pub input: u64,
    /// The completion budget counted at arrival (`max_tokens`).
    pub budget: u64,
    /// Tokens the answer generates (at most the budget).
    pub output: u64,
    /// Time from arrival to the end of the answer.
    pub latency: Duration,
}

/// Answers finished by the end of a run and the tokens they used.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tally {
    /// Answers finished.
    pub requests: u64,
    /// Tokens they used (input + output, as the provider reported them).
    pub tokens: u64,
}

impl Tally {
    /// Counts one finished answer of `tokens`.
    pub fn add(&mut self, tokens: u64) {
        self.requests += 1;
        self.tokens += tokens;
    }
}

/// One key's books: the provider-wide one and one per model entry.
struct KeyBooks {
    limits: Limits,
    book: Book,
    models: Vec<(SimModel, Book)>,
}

impl KeyBooks {
    fn new(cfg: &SimulatorConfig, models: &[SimModel]) -> Self {
        KeyBooks {
            limits: Limits::from(cfg),
            book: Book::default(),
            models: models
                .iter()
                .map(|m| (m.clone(), Book::default()))
                .collect(),
        }
    }

    fn model(&mut self, model: &str) -> Option<&mut (SimModel, Book)> {
        self.models
            .iter_mut()
            .find(|(m, _)| crate::config::glob_matches(&m.pattern, model))
    }

    fn prune(&mut self, now: Timestamp, rules: Rules) {
        self.book.prune(now, rules);
        for (_, b) in &mut self.models {
            b.prune(now, rules);
        }
    }

    fn fits(&mut self, model: &str, c: Count, now: Timestamp, rules: Rules) -> bool {
        if self.book.check(self.limits, c, now, rules).is_some() {
            return false;
        }
        match self.model(model) {
            Some((m, b)) => b.check(m.limits(), c, now, rules).is_none(),
            None => true,
        }
    }

    fn record(&mut self, id: u64, model: &str, c: Count, now: Timestamp, rules: Rules) {
        self.book.record(id, c, now, rules);
        if let Some((_, b)) = self.model(model) {
            b.record(id, c, now, rules);
        }
    }

    fn settle(&mut self, reconcile: bool, id: u64, model: &str, input: u64, output: u64) {
        self.book.settle(reconcile, id, input, output);
        if let Some((_, b)) = self.model(model) {
            b.settle(reconcile, id, input, output);
        }
    }

    fn next_change(&self, rules: Rules) -> Option<Timestamp> {
        std::iter::once(&self.book)
            .chain(self.models.iter().map(|(_, b)| b))
            .filter_map(|b| b.next_change(rules))
            .min()
    }
}

fn at(d: Duration) -> Timestamp {
    Timestamp::from_nanos(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// The most a client could finish by `stop` with `items` at a provider
/// whose keys are `keys` (each a [`SimulatorConfig`] of that key's limits;
/// the first one's rules — slices, anchored minutes, reconciliation,
/// arrival delay — hold for all) and whose models have their own limits
/// `models` on every key.
///
/// Each request is sent, to the first key with room, at the first instant
/// every book it counts in admits it, knowing exactly when earlier answers
/// end and what they use; it arrives `arrival_delay` after it could be
/// sent (the jitter at its best, zero). In order (`reorder` false) a
/// request waits for the one before it; reordered, whenever anything
/// changes every waiting request that fits goes, oldest first.
pub fn best_schedule(
    keys: &[SimulatorConfig],
    models: &[SimModel],
    items: &[ScheduleItem],
    stop: Duration,
    reorder: bool,
) -> Tally {
    let Some(first) = keys.first() else {
        return Tally::default();
    };
    let rules = Rules::from(first);
    let reconcile = first.reconcile;
    let delay = first.arrival_delay;
    let mut books: Vec<KeyBooks> = keys.iter().map(|k| KeyBooks::new(k, models)).collect();
    // Answers yet to end: (when, key, id, item).
    let mut open: Vec<(Timestamp, usize, u64, usize)> = Vec::new();
    let mut tally = Tally::default();
    let mut waiting: Vec<usize> = Vec::new();
    let mut next = 0;
    let mut id = 0u64;
    let end = at(stop);
    let mut t = Timestamp::from_nanos(0);
    while t < end {
        while next < items.len() && at(items[next].at.saturating_add(delay)) <= t {
            waiting.push(next);
            next += 1;
        }
        open.retain(|&(when, k, id, i)| {
            if when > t {
                return true;
            }
            let it = &items[i];
            books[k].settle(reconcile, id, &it.model, it.input, it.output);
            false
        });
        for b in &mut books {
            b.prune(t, rules);
        }
        let mut k = 0;
        while k < waiting.len() {
            let i = waiting[k];
            let it = &items[i];
            let c = Count {
                tokens: it.input + it.budget,
                input: it.input,
                output: it.budget,
            };
            let key = (0..books.len()).find(|&key| books[key].fits(&it.model, c, t, rules));
            match key {
                Some(key) => {
                    books[key].record(id, &it.model, c, t, rules);
                    let done = t.saturating_add(it.latency);
                    open.push((done, key, id, i));
                    id += 1;
                    if done <= end {
                        tally.add(it.input + it.output);
                    }
                    waiting.remove(k);
                }
                None if reorder => k += 1,
                None => break,
            }
        }
        let arrival = items.get(next).map(|it| at(it.at.saturating_add(delay)));
        let settles = open.iter().map(|o| o.0).min();
        let change = books.iter().filter_map(|b| b.next_change(rules)).min();
        match [arrival, settles, change].into_iter().flatten().min() {
            Some(n) if n > t => t = n,
            _ => break,
        }
    }
    tally
}
