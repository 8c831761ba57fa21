//! Turn budgets for agent runs: a run may take a number of turns
//! set by its depth tier; when they are spent it pauses with a
//! `continue_or_finish` question, and the caller grants more or finishes.

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
}
