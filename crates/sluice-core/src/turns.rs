//! Turn budgets for agent runs: a run may take a number of turns
//! set by its depth tier; when they are spent it pauses with a
//! `continue_or_finish` question, and the caller grants more or finishes.

use std::num::NonZeroU32;
use std::time::Duration;

use crate::Timestamp;
use crate::rate::{OneCell, Verdict};

/// The depth tier of a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tier {
    /// 10 turns.
    Quick,
    /// 75 turns.
    Deep,
    /// The agent profile's own budget (50 for the default agent).
    Standard,
}

/// The default agent profile's turn budget, used by [`Tier::Standard`].
pub const DEFAULT_PROFILE_TURNS: u32 = 50;

impl Tier {
    /// The turns this tier allows, given the agent profile's own budget.
    pub fn turns(self, profile_turns: u32) -> u32 {
        match self {
            Tier::Quick => 10,
            Tier::Deep => 75,
            Tier::Standard => profile_turns,
        }
    }
}

/// What a run may do next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Turn {
    /// Take this turn; `remaining` more are allowed after it.
    Proceed {
        /// Turns left after this one.
        remaining: u32,
    },
    /// The budget is spent: ask the caller `continue_or_finish`.
    Paused(ContinueOrFinish),
    /// The caller chose to finish; no more turns.
    Finished,
}

/// The question a paused run asks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ContinueOrFinish {
    /// Turns taken so far.
    pub used: u32,
    /// Turns allowed so far (the tier's plus any granted).
    pub allowed: u32,
}

impl ContinueOrFinish {
    /// The question's name, as the run reports it.
    pub const NAME: &'static str = "continue_or_finish";
}

/// The turn budget of one run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TurnBudget {
    allowed: u32,
    used: u32,
    finished: bool,
}

impl TurnBudget {
    /// A run of `tier` under an agent profile allowing `profile_turns`.
    pub fn new(tier: Tier, profile_turns: u32) -> Self {
        TurnBudget {
            allowed: tier.turns(profile_turns),
            used: 0,
            finished: false,
        }
    }

    /// Asks to take one turn.
    pub fn take(&mut self) -> Turn {
        if self.finished {
            return Turn::Finished;
        }
        if self.used >= self.allowed {
            return Turn::Paused(ContinueOrFinish {
                used: self.used,
                allowed: self.allowed,
            });
        }
        self.used += 1;
        Turn::Proceed {
            remaining: self.allowed - self.used,
        }
    }

    /// The caller answered "continue": `extra` more turns (saturating).
    pub fn grant(&mut self, extra: u32) {
        self.allowed = self.allowed.saturating_add(extra);
    }

    /// The caller answered "finish": every later [`TurnBudget::take`] says [`Turn::Finished`].
    pub fn finish(&mut self) {
        self.finished = true;
    }

    /// Turns taken so far.
    pub fn used(&self) -> u32 {
        self.used
    }
}

/// The most turns a tier may allow (a run's [`crate::Rate::Turns`] limit).
pub const MAX_TIER_TURNS: u32 = 10_000;

/// The most turns a run may be granted in all, beyond its tier's.
pub const MAX_RUN_GRANTS: u32 = 50_000;

/// A run's cell (see [`crate::Rate::Turns`]): the high 32 bits the Unix second
/// until which the run is remembered; the low 32 its tier's turns (16 bits)
/// and its net turns (turns taken less turns granted), offset by
/// [`MAX_RUN_GRANTS`] (16 bits). A net turn count past the tier's means the run
/// is finished.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct RunCell {
    turns: u32,
    net: i64,
    until: u64,
}

impl RunCell {
    /// The run `value` holds at `now`, if it holds one.
    fn read(value: u64, now: Timestamp) -> Option<Self> {
        if crate::rate::cell_is_stale(value, now) {
            return None;
        }
        let low = crate::rate::low(value);
        Some(RunCell {
            turns: (low >> 16).clamp(1, MAX_TIER_TURNS),
            net: i64::from(low & 0xFFFF) - i64::from(MAX_RUN_GRANTS),
            until: value >> 32,
        })
    }

    fn new(turns: u32) -> Self {
        RunCell {
            turns: turns.clamp(1, MAX_TIER_TURNS),
            net: 0,
            until: 0,
        }
    }

    fn finished(&self) -> bool {
        self.net > i64::from(self.turns)
    }

    /// Turns left, grants included.
    fn left(&self) -> u32 {
        (i64::from(self.turns) - self.net).clamp(0, i64::from(u32::MAX)) as u32
    }

    /// The cell holding this run with `net` turns, remembered `idle` from `now`.
    fn write(&self, net: i64, idle: NonZeroU32, now: Timestamp) -> u64 {
        let net = net.clamp(-i64::from(MAX_RUN_GRANTS), i64::from(self.turns) + 1);
        let biased = (net + i64::from(MAX_RUN_GRANTS)) as u32;
        crate::rate::pack(
            now.as_secs() + u64::from(idle.get()),
            (self.turns << 16) | biased,
        )
    }
}

/// Takes `cost` turns of a run whose cell holds `value` at `now` (a new run's
/// tier allows `turns`): see [`crate::Rate::Turns`].
pub(crate) fn evaluate_cell(
    value: u64,
    turns: u32,
    cost: u32,
    idle: NonZeroU32,
    now: Timestamp,
) -> OneCell {
    let stored = RunCell::read(value, now);
    let run = stored.unwrap_or_else(|| RunCell::new(turns));
    let finished = run.finished();
    let fits = !finished && run.net + i64::from(cost) <= i64::from(run.turns);
    let before = run.left();
    let after = if fits { before - cost } else { before };
    let write = (fits && cost > 0).then(|| run.write(run.net + i64::from(cost), idle, now));
    let reset = match (write, stored) {
        (Some(v), _) => v >> 32,
        (None, Some(s)) => s.until,
        (None, None) => now.as_secs(),
    };
    let verdict = if finished {
        Verdict::Never
    } else if fits {
        Verdict::Admitted
    } else {
        Verdict::NotYet {
            retry_after: Duration::from_secs(reset.saturating_sub(now.as_secs())),
        }
    };
    OneCell {
        verdict,
        remaining_before: before,
        remaining_after: after,
        reset,
        write,
    }
}

/// Changes a run's net turns by `delta` (a grant is negative, a finish a
/// positive delta past its turns) at `now`: see [`crate::Rate::Turns`]. A run
/// the cell does not hold is changed as a new one of `turns`.
pub(crate) fn adjust_cell(
    value: u64,
    turns: u32,
    delta: i64,
    idle: NonZeroU32,
    now: Timestamp,
) -> OneCell {
    let stored = RunCell::read(value, now);
    let run = stored.unwrap_or_else(|| RunCell::new(turns));
    let before = run.left();
    let new = run.write(run.net.saturating_add(delta), idle, now);
    let changed = RunCell::read(new, now).unwrap_or(run);
    // Written whenever adjusted, a change of 0 too: an adjustment is the run's
    // owner acting on it, which keeps it (both its cells) remembered.
    let write = Some(new);
    let after = changed.left();
    OneCell {
        verdict: Verdict::Admitted,
        remaining_before: before,
        remaining_after: after,
        reset: write.map_or(run.until, |v| v >> 32),
        write,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q3_tiers_quick_deep_and_standard_allow_10_75_and_the_profiles_turns() {
        assert_eq!(Tier::Quick.turns(DEFAULT_PROFILE_TURNS), 10);
        assert_eq!(Tier::Deep.turns(DEFAULT_PROFILE_TURNS), 75);
        assert_eq!(Tier::Standard.turns(DEFAULT_PROFILE_TURNS), 50);
        assert_eq!(Tier::Standard.turns(20), 20);
    }

    #[test]
    fn q3_exhausted_run_pauses_then_grant_or_finish() {
        let mut run = TurnBudget::new(Tier::Quick, DEFAULT_PROFILE_TURNS);
        for i in 1..=10 {
            assert_eq!(run.take(), Turn::Proceed { remaining: 10 - i });
        }
        let paused = Turn::Paused(ContinueOrFinish {
            used: 10,
            allowed: 10,
        });
        assert_eq!(run.take(), paused);
        assert_eq!(run.take(), paused, "pausing takes no turn");
        run.grant(2);
        assert_eq!(run.take(), Turn::Proceed { remaining: 1 });
        assert_eq!(run.take(), Turn::Proceed { remaining: 0 });
        assert!(matches!(run.take(), Turn::Paused(_)));
        run.finish();
        assert_eq!(run.take(), Turn::Finished);
        assert_eq!(run.used(), 12);
    }

    fn take(cell: &mut u64, turns: u32, now: Timestamp) -> Verdict {
        let idle = NonZeroU32::new(60).expect("non-zero");
        let e = evaluate_cell(*cell, turns, 1, idle, now);
        if let Some(v) = e.write {
            *cell = v;
        }
        e.verdict
    }

    fn change(cell: &mut u64, delta: i64, now: Timestamp) -> u32 {
        let idle = NonZeroU32::new(60).expect("non-zero");
        let e = adjust_cell(*cell, 10, delta, idle, now);
        if let Some(v) = e.write {
            *cell = v;
        }
        e.remaining_after
    }

    #[test]
    fn t7_a_run_cell_keeps_its_tier_takes_grants_past_it_finishes_and_is_forgotten_idle() {
        let now = Timestamp::from_secs(1_000);
        let mut cell = 0;
        // The first turn pins the tier: later turns naming another do not move it.
        assert_eq!(take(&mut cell, 2, now), Verdict::Admitted);
        assert_eq!(take(&mut cell, 75, now), Verdict::Admitted);
        assert!(matches!(take(&mut cell, 75, now), Verdict::NotYet { .. }));
        // A grant past the tier's turns counts whole.
        assert_eq!(change(&mut cell, -5, now), 5);
        for _ in 0..5 {
            assert_eq!(take(&mut cell, 2, now), Verdict::Admitted);
        }
        assert!(matches!(take(&mut cell, 2, now), Verdict::NotYet { .. }));
        // Finished: never again, a grant aside.
        assert_eq!(change(&mut cell, i64::MAX, now), 0);
        assert_eq!(take(&mut cell, 2, now), Verdict::Never);
        // Forgotten 60 s after its last change: a new run.
        let later = Timestamp::from_secs(1_061);
        assert_eq!(take(&mut cell, 2, later), Verdict::Admitted);
        // Grants are bounded in all.
        assert_eq!(
            change(&mut cell, -i64::from(u32::MAX), later),
            2 + MAX_RUN_GRANTS
        );
    }
}
