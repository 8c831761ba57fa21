//! The batch side's watch on the upstream: whether a batch item's failure is
//! an outage to wait out (the item goes back to the queue, its attempts
//! unspent) or one of the item's attempts, and when dispatch may send the one
//! probe that tells an outage is over.
//!
//! The lane's breaker hears only single calls (a batch item's failure never
//! counts toward its streak, so one workspace's poison items cannot shut the
//! lane for the others). With no single calls flowing it never opens, so the
//! batch side keeps a streak of its own, over the whole lane: the breaker's
//! `failures` (5) outage-class failures in a row (an upstream 5xx, no answer,
//! a timeout: what SPEC L3 calls a failure) within its `within` (a minute),
//! with no call of the lane answered by the upstream in between — a single
//! call's answer or a batch item's, counted by
//! [`sluice_lanes::Lane::successes`]. While poison items of one workspace
//! fail, others' calls get answers, so the streak keeps breaking and the
//! failures stay the items' attempts.
//!
//! Once the streak is full the upstream is taken as down: no item is
//! dispatched for the breaker's `open_for` (30 s), then one item goes as the
//! probe; its answer ends the outage, its failure starts another `open_for`.
//! So an outage costs the upstream one probe per `open_for`, however long it
//! lasts and however many items wait. A workspace that alone has items queued,
//! all of them poison, with no other call to the lane, looks just like an
//! outage: its items wait, queued, and one of them is sent every `open_for`
//! until another call to the lane gets an answer; then their failures count
//! again and the items fail after their attempts. The probe goes to the
//! workspace that probed longest ago, so another workspace's batch queued
//! meanwhile probes next and ends such a pause.

use std::collections::HashMap;

use sluice_core::BreakerConfig;
use tokio::time::Instant;

/// What the runner may start now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Gate {
    /// As many items as the lane has places for.
    Go,
    /// One item, the probe.
    Probe,
    /// Nothing: until then (`None`: until the probe out reports).
    Wait(Option<Instant>),
}

/// The batch side's view of an upstream outage (see the module's docs).
#[derive(Debug, Default)]
pub(super) struct OutageWatch {
    /// Outage-class failures in a row, the first at `first_failure`.
    failures_in_row: u32,
    first_failure: Option<Instant>,
    /// The lane's count of answered calls at the streak's last failure.
    successes_seen: u64,
    /// While the upstream is taken as down: when the next probe may go.
    probe_at: Option<Instant>,
    /// A probe is out.
    probe_out: bool,
    /// When each workspace with items queued last sent the probe, during
    /// this outage (at most one entry per workspace with items queued).
    probed: HashMap<String, Instant>,
}

impl OutageWatch {
    /// Counts an outage-class failure seen at `now`, `successes` being the
    /// lane's count of answered calls; true when the upstream is taken as
    /// down (the streak is full, or already was): the item is to wait.
    pub(super) fn failure(&mut self, now: Instant, successes: u64, breaker: BreakerConfig) -> bool {
        let answered = successes != self.successes_seen;
        if self.probe_at.is_some() {
            if !answered {
                // Still down (however long): the next probe waits `open_for`
                // from this failure.
                self.probe_at = Some(now + breaker.open_for);
                return true;
            }
            // A call got an answer since: the outage is over, and this
            // failure starts a new streak.
            self.end();
        }
        let stale = self
            .first_failure
            .is_none_or(|first| now.saturating_duration_since(first) > breaker.within);
        if answered || stale {
            self.failures_in_row = 0;
            self.first_failure = Some(now);
        }
        self.successes_seen = successes;
        self.failures_in_row = self.failures_in_row.saturating_add(1);
        if self.failures_in_row >= breaker.failures.max(1) {
            self.probe_at = Some(now + breaker.open_for);
        }
        self.probe_at.is_some()
    }

    /// The upstream answered an item: any outage is over.
    pub(super) fn success(&mut self) {
        self.end();
    }

    /// Whether the upstream is taken as down, `successes` being the lane's
    /// count of answered calls now (an answer since the last failure ends an
    /// outage).
    pub(super) fn is_down(&mut self, successes: u64) -> bool {
        if self.probe_at.is_some() && successes != self.successes_seen {
            self.end();
        }
        self.probe_at.is_some()
    }

    /// What the runner may start at `now`.
    pub(super) fn gate(&mut self, now: Instant, successes: u64) -> Gate {
        if !self.is_down(successes) {
            return Gate::Go;
        }
        match self.probe_at {
            _ if self.probe_out => Gate::Wait(None),
            Some(at) if at > now => Gate::Wait(Some(at)),
            _ => Gate::Probe,
        }
    }

    /// Orders `candidates` (workspaces with items queued) for the probe: the
    /// one that probed longest ago (or never) first.
    pub(super) fn probe_order(&mut self, candidates: &mut [&str]) {
        self.probed.retain(|w, _| candidates.contains(&w.as_str()));
        candidates.sort_by_key(|w| self.probed.get(*w).copied());
    }

    /// `workspace`'s item went out as the probe at `now`.
    pub(super) fn probe_started(&mut self, workspace: &str, now: Instant) {
        self.probe_out = true;
        self.probed.insert(workspace.to_owned(), now);
    }

    /// The probe reported (its answer or failure counted already) or ended
    /// without a word.
    pub(super) fn probe_ended(&mut self) {
        self.probe_out = false;
    }

    /// When the next probe may go, while the upstream is taken as down.
    pub(super) fn probe_at(&self) -> Option<Instant> {
        self.probe_at
    }

    fn end(&mut self) {
        *self = OutageWatch::default();
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn breaker() -> BreakerConfig {
        BreakerConfig::new(5, Duration::from_secs(60), Duration::from_secs(30))
    }

    #[test]
    fn l3_l4_five_failures_in_a_row_within_a_minute_are_an_outage() {
        let t0 = Instant::now();
        let mut watch = OutageWatch::default();
        for i in 0..4 {
            assert!(!watch.failure(t0 + Duration::from_secs(i), 0, breaker()));
        }
        assert!(watch.failure(t0 + Duration::from_secs(4), 0, breaker()));
        assert!(watch.is_down(0));
        assert_eq!(watch.probe_at(), Some(t0 + Duration::from_secs(34)));
    }

    #[test]
    fn l4_an_answer_in_between_breaks_the_streak() {
        let t0 = Instant::now();
        let mut watch = OutageWatch::default();
        for successes in 0..20 {
            // One workspace's items fail while other calls get answers.
            assert!(!watch.failure(t0, successes, breaker()), "{successes}");
        }
        let mut watch = OutageWatch::default();
        for i in 0..4 {
            assert!(!watch.failure(t0 + Duration::from_secs(i * 20), 0, breaker()));
        }
        assert!(
            !watch.failure(t0 + Duration::from_secs(80), 0, breaker()),
            "not within a minute of the first"
        );
    }

    #[test]
    fn l4_an_outage_lets_one_probe_out_per_open_time() {
        let t0 = Instant::now();
        let mut watch = OutageWatch::default();
        for _ in 0..5 {
            watch.failure(t0, 0, breaker());
        }
        assert_eq!(
            watch.gate(t0, 0),
            Gate::Wait(Some(t0 + Duration::from_secs(30)))
        );
        let t1 = t0 + Duration::from_secs(30);
        assert_eq!(watch.gate(t1, 0), Gate::Probe);
        watch.probe_started("acme", t1);
        assert_eq!(watch.gate(t1, 0), Gate::Wait(None), "one probe at a time");
        assert!(
            watch.failure(t1, 0, breaker()),
            "the probe failed: still down"
        );
        watch.probe_ended();
        assert_eq!(
            watch.gate(t1, 0),
            Gate::Wait(Some(t1 + Duration::from_secs(30)))
        );
        // However long it lasts, only an answer ends it.
        let t2 = t1 + Duration::from_secs(300);
        assert!(watch.failure(t2, 0, breaker()), "still down after minutes");
        assert_eq!(
            watch.gate(t2, 0),
            Gate::Wait(Some(t2 + Duration::from_secs(30)))
        );
        // A single call's answer ends the outage.
        assert_eq!(watch.gate(t1, 1), Gate::Go);
        assert!(!watch.failure(t1, 1, breaker()), "a new streak");
    }

    #[test]
    fn l4_the_probe_goes_to_whoever_probed_longest_ago() {
        let t0 = Instant::now();
        let mut watch = OutageWatch::default();
        watch.probe_started("acme", t0);
        watch.probe_ended();
        watch.probe_started("globex", t0 + Duration::from_secs(30));
        watch.probe_ended();
        let mut candidates = vec!["globex", "acme", "initech"];
        watch.probe_order(&mut candidates);
        assert_eq!(candidates, ["initech", "acme", "globex"]);
        let mut candidates = vec!["globex"];
        watch.probe_order(&mut candidates);
        assert_eq!(watch.probed.len(), 1, "only workspaces still queued");
    }
}
