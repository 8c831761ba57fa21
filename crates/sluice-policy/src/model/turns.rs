//! `turns:`: the turn budgets of agent runs (SPEC T7). A call on an LLM route,
//! or an MCP tool call, that names its run is one turn of it; a run's depth
//! tier sets how many it may take before it pauses with a
//! `continue_or_finish` question.

use std::num::NonZeroU32;

/// The built-in tiers: the seed's quick 10, standard 50 (the default agent's
/// own budget) and deep 75.
pub const BUILT_IN_TIERS: [(&str, u32); 3] = [("quick", 10), ("standard", 50), ("deep", 75)];

/// The most tiers a policy may name.
pub const MAX_TIERS: usize = 16;

/// The header that names a call's run.
pub const RUN_HEADER: &str = "x-sluice-run";

/// The header that names a run's depth tier.
pub const DEPTH_HEADER: &str = "x-sluice-depth";

/// The longest run id, in bytes.
pub const MAX_RUN_ID: usize = 128;

/// The turn budgets of agent runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Turns {
    /// Runs are counted: the policy writes `turns:` or has an LLM route. Else
    /// the run headers are the upstream's and no path is a run endpoint.
    pub enabled: bool,
    /// Each tier's name and turns, the built-in ones first.
    pub tiers: Vec<(String, NonZeroU32)>,
    /// The tier of a run whose calls name none (index into `tiers`).
    pub default_tier: usize,
    /// Seconds without a turn or a change after which a run is forgotten.
    pub idle: NonZeroU32,
    /// The most turns one `continue` may grant.
    pub max_grant: NonZeroU32,
    /// The most turns a run may be granted in all.
    pub max_granted: NonZeroU32,
    /// Runs one caller may start per `idle`.
    pub runs_per_caller: NonZeroU32,
    /// The path under which the gateway answers a run's endpoints (`/runs`).
    pub endpoints: String,
    /// On a JSON-RPC route, an MCP `tools/call` with no run header is a turn of
    /// the run its `Mcp-Session-Id` names.
    pub mcp_session: bool,
}

impl Default for Turns {
    fn default() -> Self {
        let nz = |n: u32| NonZeroU32::new(n).unwrap_or(NonZeroU32::MIN);
        Turns {
            enabled: false,
            tiers: BUILT_IN_TIERS
                .iter()
                .map(|&(name, n)| (name.to_owned(), nz(n)))
                .collect(),
            default_tier: 1,
            idle: nz(86_400),
            max_grant: nz(1_000),
            max_granted: nz(10_000),
            runs_per_caller: nz(1_000),
            endpoints: "/runs".to_owned(),
            mcp_session: false,
        }
    }
}

impl Turns {
    /// The index of the tier named `name` (compared without regard to ASCII case).
    pub fn tier(&self, name: &str) -> Option<usize> {
        self.tiers
            .iter()
            .position(|(t, _)| t.eq_ignore_ascii_case(name))
    }

    /// The run endpoint `path` names, if it names one: `GET <endpoints>/<run>`,
    /// `POST <endpoints>/<run>/continue`, `POST <endpoints>/<run>/finish`. The
    /// run id is as the path holds it (checked by [`is_run_id`]).
    pub fn endpoint<'p>(&self, path: &'p str) -> Option<RunEndpoint<'p>> {
        if !self.enabled {
            return None;
        }
        let rest = path
            .strip_prefix(self.endpoints.as_str())?
            .strip_prefix('/')?;
        Some(match rest.split_once('/') {
            None => RunEndpoint::State(rest),
            Some((run, "continue")) => RunEndpoint::Continue(run),
            Some((run, "finish")) => RunEndpoint::Finish(run),
            Some((run, _)) => RunEndpoint::Unknown(run),
        })
    }
}

/// A run's endpoint on the gateway.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RunEndpoint<'p> {
    /// `GET <endpoints>/<run>`: the run's state.
    State(&'p str),
    /// `POST <endpoints>/<run>/continue`: grant it more turns.
    Continue(&'p str),
    /// `POST <endpoints>/<run>/finish`: end it.
    Finish(&'p str),
    /// Another path under the run's: none sluice answers.
    Unknown(&'p str),
}

/// True when `id` may name a run: 1 to [`MAX_RUN_ID`] ASCII letters, digits
/// and `-._~:@+=,` (a path segment of the run's endpoints as it is, with
/// nothing to escape).
pub fn is_run_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= MAX_RUN_ID
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-._~:@+=,".contains(&b))
}
