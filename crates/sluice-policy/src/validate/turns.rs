//! `turns:`, the turn budgets of agent runs (SPEC T7).

use std::num::NonZeroU32;

use sluice_core::{MAX_RUN_GRANTS, MAX_TIER_TURNS};

use crate::model::{MAX_TIERS, Turns};
use crate::raw::RawPolicy;

use super::{Checker, MAX_CLASS_NAME, is_budget_name};

/// The longest a run may be remembered idle: 30 days.
const MAX_IDLE_SECONDS: u32 = 30 * 86_400;

impl Checker {
    /// `turns:` checked, with the built-in tiers and bounds where it names none.
    pub(super) fn turns(&mut self, raw: &RawPolicy) -> Turns {
        let mut turns = Turns::default();
        let Some(t) = &raw.turns else {
            return turns;
        };
        for (name, &n) in &t.tiers {
            let at = format!("turns.tiers.{name}");
            if !is_budget_name(name) {
                self.problem(
                    &at,
                    format!(
                        "a tier name is 1 to {MAX_CLASS_NAME} letters, digits, `_`, `-` or `.`"
                    ),
                );
                continue;
            }
            let Some(n) = self.turns_of(&at, n) else {
                continue;
            };
            match turns.tier(name) {
                Some(i) => turns.tiers[i].1 = n,
                None => turns.tiers.push((name.to_ascii_lowercase(), n)),
            }
        }
        if turns.tiers.len() > MAX_TIERS {
            self.problem("turns.tiers", format!("at most {MAX_TIERS} tiers"));
        }
        if let Some(name) = &t.default_tier {
            match turns.tier(name) {
                Some(i) => turns.default_tier = i,
                None => self.problem(
                    "turns.default_tier",
                    format!("no tier {name:?} under `turns.tiers` or built in"),
                ),
            }
        }
        let mut bounded = |at: &str, given: Option<u32>, max: u32, into: &mut NonZeroU32| {
            if let Some(n) = given {
                match NonZeroU32::new(n).filter(|n| n.get() <= max) {
                    Some(n) => *into = n,
                    None => self.problem(at, format!("1 to {max}")),
                }
            }
        };
        bounded(
            "turns.idle_seconds",
            t.idle_seconds,
            MAX_IDLE_SECONDS,
            &mut turns.idle,
        );
        bounded(
            "turns.max_granted",
            t.max_granted,
            MAX_RUN_GRANTS,
            &mut turns.max_granted,
        );
        bounded(
            "turns.max_grant",
            t.max_grant,
            MAX_RUN_GRANTS,
            &mut turns.max_grant,
        );
        bounded(
            "turns.runs_per_caller",
            t.runs_per_caller,
            1_000_000,
            &mut turns.runs_per_caller,
        );
        if turns.max_grant > turns.max_granted {
            self.problem(
                "turns.max_grant",
                format!(
                    "at most `max_granted` ({}): one grant cannot be more than a run may have",
                    turns.max_granted
                ),
            );
        }
        if let Some(path) = &t.endpoints {
            let ok = path.len() > 1
                && path.len() <= 64
                && path.starts_with('/')
                && !path.ends_with('/')
                && path
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"/-_.".contains(&b))
                && !path.contains("//")
                && !path.split('/').any(|s| s == "." || s == "..");
            if ok {
                turns.endpoints = path.clone();
            } else {
                self.problem(
                    "turns.endpoints",
                    "a plain path such as /runs (no parameters, no trailing /, no dot segments)",
                );
            }
        }
        turns.mcp_session = t.mcp_session.unwrap_or(false);
        turns
    }

    /// A tier's turns, 1 to [`MAX_TIER_TURNS`].
    pub(super) fn turns_of(&mut self, at: &str, n: u32) -> Option<NonZeroU32> {
        let n = NonZeroU32::new(n).filter(|n| n.get() <= MAX_TIER_TURNS);
        if n.is_none() {
            self.problem(at, format!("1 to {MAX_TIER_TURNS} turns"));
        }
        n
    }
}
