//! Guarded lanes in front of an expensive upstream, and their batch lanes.

use std::num::NonZeroU32;
use std::time::Duration;

/// Most lanes a policy declares.
pub const MAX_LANES: usize = 4;

/// A guarded lane in front of an expensive upstream: the routes and tools that
/// name it run at most so many calls at once per workspace and in all, start at
/// most so many per workspace in a rolling window, wait in line for a bounded
/// time, and stop while the upstream keeps failing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lane {
    /// Its name (`optimizer` in the built-in policy).
    pub name: String,
    /// Calls of one workspace running at once.
    pub workspace_in_flight: NonZeroU32,
    /// Calls of one workspace started in any `starts_window`.
    pub workspace_starts: NonZeroU32,
    /// The rolling window of `workspace_starts`.
    pub starts_window: Duration,
    /// Calls running at once over every workspace.
    pub global_in_flight: NonZeroU32,
    /// Places of `global_in_flight` never given to batch items (less than it).
    pub batch_reserve: u32,
    /// Longest wait in line of a REST call.
    pub wait: Duration,
    /// Longest wait in line of a JSON-RPC tool call.
    pub jsonrpc_wait: Duration,
    /// Calls waiting in line at once; past it a call is refused at once.
    pub max_waiting: NonZeroU32,
    /// Longest upstream call; past it the call is cut and counts as a failure.
    pub timeout: Duration,
    /// Failures in a row that open the breaker.
    pub breaker_failures: NonZeroU32,
    /// Those failures fall within this span.
    pub breaker_within: Duration,
    /// How long the breaker stays open before one probe decides.
    pub breaker_open: Duration,
    /// With a shared store: how long a replica's lease on a place lives without
    /// renewal (a crashed replica's places come back within it).
    pub lease_ttl: Duration,
    /// The lane's batch lane, if it runs one.
    pub batch: Option<LaneBatch>,
    /// The names clients see (`details.reason`, metrics, logs) for the lane
    /// engine's `busy` and `unavailable` refusals (`reasons:`; by default the
    /// lane's name and the reason: `optimizer_busy` for a lane `optimizer`).
    pub reasons: LaneReasons,
}

/// The names clients see for a lane's own refusals.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaneReasons {
    /// Every place of the lane's global cap is taken (`<lane>_busy`).
    pub busy: String,
    /// The lane's breaker is open (`<lane>_unavailable`).
    pub unavailable: String,
}

impl Lane {
    /// The name clients see for the lane engine's refusal reason `engine` (`busy`
    /// and `unavailable` are the policy's; the workspace reasons keep theirs).
    pub fn reason_name<'a>(&'a self, engine: &'a str) -> &'a str {
        match engine {
            "busy" => &self.reasons.busy,
            "unavailable" => &self.reasons.unavailable,
            other => other,
        }
    }
}

/// A lane's batch lane: lists of single calls, queued durably and run on the
/// capacity single calls leave.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaneBatch {
    /// The single-call route (`/messages/optimize`): submit `POST <route>/batch`,
    /// status `GET <route>/batches/{id}`, each item `POST <route>` upstream.
    pub route: String,
    /// Most items in one batch.
    pub max_items: NonZeroU32,
    /// Most unfinished items one workspace may have queued.
    pub backlog: NonZeroU32,
    /// How long a finished batch is kept for status reads.
    pub keep: Duration,
    /// The JSON-RPC tool that submits a batch.
    pub submit_tool: Option<String>,
    /// The JSON-RPC tool that reads a batch.
    pub status_tool: Option<String>,
    /// The quota family the single-call route counts against: each item of a batch
    /// counts one unit of it at submit (index into [`Policy::quotas`](crate::Policy::quotas)).
    pub quota: Option<usize>,
}

impl LaneBatch {
    /// The submit path, `<route>/batch`.
    pub fn submit_path(&self) -> String {
        format!("{}/batch", self.route)
    }

    /// The batch id a status path (`<route>/batches/{id}`) names, if `path` is one.
    pub fn status_id<'p>(&self, path: &'p str) -> Option<&'p str> {
        let id = path
            .strip_prefix(self.route.as_str())?
            .strip_prefix("/batches/")?;
        (!id.is_empty() && !id.contains('/')).then_some(id)
    }
}
