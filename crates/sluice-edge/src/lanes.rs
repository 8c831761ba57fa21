//! Guarded lanes at the edge: a request whose route or tool names a lane waits for a
//! place in it before its budgets are decided, and gives the place back when its
//! upstream call ends (see the `sluice-lanes` crate for the lane itself).

use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderValue, RETRY_AFTER};
use http::{Response, StatusCode};
use http_body_util::Full;
use serde::Serialize;
use sluice_core::BreakerConfig;
use sluice_lanes::{Lane, LaneConfig, LanePermit, LaneRefusal, LedgerOutage, Outcome};
use sluice_policy::{Outage, Policy, RouteClass};

use crate::answer::envelope_response;

/// A call through a lane that a request makes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaneCall {
    /// The lane (index into the policy's lanes).
    pub lane: usize,
    /// It is a JSON-RPC tool call (it may wait longer in line than a REST call).
    pub jsonrpc: bool,
    /// Calls through the lane the request holds (a JSON-RPC batch may hold several:
    /// each takes a place; more than a workspace may run at once is refused, see
    /// [`Refused::LaneCalls`](crate::Refused::LaneCalls)).
    pub calls: u32,
}

/// The settings of the policy's `lane` as the lane engine takes them.
pub fn lane_config(lane: &sluice_policy::Lane) -> LaneConfig {
    let mut config = LaneConfig::default();
    config.workspace_in_flight = lane.workspace_in_flight.get();
    config.workspace_starts = lane.workspace_starts.get();
    config.start_window = lane.starts_window;
    config.global_cap = lane.global_in_flight.get();
    config.batch_reserve = lane.batch_reserve;
    config.max_waiting = usize::try_from(lane.max_waiting.get()).unwrap_or(usize::MAX);
    config.breaker = BreakerConfig::new(
        lane.breaker_failures.get(),
        lane.breaker_within,
        lane.breaker_open,
    );
    config.upstream_timeout = lane.timeout;
    config
}

/// The lanes of `policy`, in its order.
pub(crate) fn lanes_of(policy: &Policy) -> Vec<Lane> {
    policy
        .lanes
        .iter()
        .filter_map(|l| Lane::new(l.name.as_str(), lane_config(l)).ok())
        .collect()
}

/// What the policy's lane number `lane` does while the ledger its replicas share
/// cannot be asked, by the store's outage rule: it fails open (each replica counts
/// its share, every limit divided by `store.replicas`) only when every route and
/// tool that names it would be decided locally too — each of their classes fails
/// open and none counts toward a capped monthly quota; otherwise it fails closed
/// and its calls are answered as a store that cannot decide (503
/// `limiter_unavailable`, `Retry-After: 1`).
pub fn ledger_outage(policy: &Policy, lane: usize) -> LedgerOutage {
    let capped = |quota: Option<usize>| {
        quota
            .and_then(|q| policy.quotas.get(q))
            .is_some_and(|q| q.monthly.is_some())
    };
    let opens = |class, quota| policy.outage(class) == Outage::FailOpen && !capped(quota);
    let routes = policy
        .routes
        .iter()
        .filter(|r| r.lane == Some(lane))
        .map(|r| match r.class {
            RouteClass::Fixed(class) => opens(class, r.quota),
            // A JSON-RPC route's calls through a lane are its tools'.
            RouteClass::JsonRpc => true,
        });
    let tools = policy
        .jsonrpc
        .tools
        .values()
        .filter(|t| t.spends.lane == Some(lane))
        .map(|t| opens(t.class, t.spends.quota));
    let mut named = routes.chain(tools).peekable();
    if named.peek().is_some() && named.all(|open| open) {
        LedgerOutage::FailOpen {
            replicas: policy.store.replicas,
        }
    } else {
        LedgerOutage::FailClosed
    }
}

/// How long a call of `lane` may wait in line.
pub(crate) fn max_wait(lane: &sluice_policy::Lane, call: LaneCall) -> Duration {
    if call.jsonrpc {
        lane.jsonrpc_wait
    } else {
        lane.wait
    }
}

/// The 429 of a call the lane refuses: the JSON envelope with `error.code:
/// "rate_limited"`, `details.reason` (`workspace_in_flight_limit`,
/// `workspace_rate_limit`, or the lane's names for busy and unavailable:
/// `optimizer_busy` and `optimizer_unavailable` for the built-in lane) and
/// `details.retry_after_seconds`, and `Retry-After` with the same seconds.
pub fn lane_refusal(lane: &sluice_policy::Lane, refusal: &LaneRefusal) -> Response<Full<Bytes>> {
    use sluice_lanes::RefusalReason;
    let seconds = refusal.retry_after_secs();
    let reason = lane.reason_name(refusal.reason.as_str());
    let lane = lane.name.as_str();
    let message = match refusal.reason {
        RefusalReason::WorkspaceInFlightLimit => format!(
            "Your workspace has as many {lane} calls running as it may. Try again in {seconds} seconds."
        ),
        RefusalReason::WorkspaceRateLimit => format!(
            "Your workspace has started as many {lane} calls this minute as it may. Try again in {seconds} seconds."
        ),
        RefusalReason::Unavailable => format!(
            "The {lane} upstream is failing; no calls are sent to it for now. Try again in {seconds} seconds."
        ),
        _ => format!("The {lane} upstream is busy. Try again in {seconds} seconds."),
    };
    let mut r = envelope_response(
        StatusCode::TOO_MANY_REQUESTS,
        "rate_limited",
        &message,
        serde_json::json!({
            "reason": reason,
            "retry_after_seconds": seconds,
            "lane": lane,
        }),
    );
    r.headers_mut()
        .insert(RETRY_AFTER, HeaderValue::from(seconds));
    r
}

/// The places in a lane held by an admitted request (one per call through the lane
/// it holds) until its upstream call ends.
#[derive(Debug)]
pub struct LanePlace {
    permits: Vec<LanePermit>,
    timeout: Duration,
}

impl LanePlace {
    pub(crate) fn new(permits: Vec<LanePermit>, timeout: Duration) -> Self {
        LanePlace { permits, timeout }
    }

    /// How long the upstream call may take: past it, it is cut and counts as a
    /// failure.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The call ended with the upstream's `status`, or with none (it could not be
    /// reached, gave no answer, or timed out): a 5xx or no answer is a failure for
    /// the lane's breaker.
    pub fn finish(self, status: Option<u16>) {
        let outcome = match status {
            Some(s) if s < 500 => Outcome::Success,
            _ => Outcome::Failure,
        };
        for permit in self.permits {
            permit.finish(outcome);
        }
    }

    /// The call was never sent: the places and their starts go back.
    pub(crate) fn cancel(self) {
        for permit in self.permits {
            permit.cancel();
        }
    }
}

/// One lane as `/status` shows it (see [`lane_status`]).
#[derive(Clone, Debug, PartialEq, Serialize)]
#[non_exhaustive]
pub struct LaneStatus {
    /// The lane's name.
    pub lane: String,
    /// Calls that may run at once across every workspace.
    pub global_cap: u32,
    /// Of those, the places batch items may take.
    pub batch_cap: u32,
    /// Calls running.
    pub running: u32,
    /// Calls waiting for a place.
    pub waiting: u32,
    /// Batch items running.
    pub batch_running: u32,
    /// The breaker: `closed`, `open` or `half_open`.
    pub breaker: &'static str,
    /// Seconds until an open breaker lets a call through (0 when it is not open).
    pub breaker_open_seconds_left: f64,
    /// How long a call is expected to take (the estimate behind retry-after).
    pub expected_call_seconds: f64,
    /// Each workspace with a call running or waiting.
    pub workspaces: Vec<LaneWorkspace>,
}

/// A workspace's standing in a [`LaneStatus`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct LaneWorkspace {
    /// Its label.
    pub workspace: String,
    /// Calls running.
    pub running: u32,
    /// Calls waiting.
    pub waiting: u32,
    /// Calls started in the rolling window.
    pub started_in_window: u32,
    /// Batch items running.
    pub batch_running: u32,
}

/// A lane as `/status` shows it: running and waiting calls in all and per
/// workspace, starts in the rolling window, batch items, the breaker and the
/// expected call duration.
pub fn lane_status(lane: &Lane) -> LaneStatus {
    let s = lane.snapshot();
    let breaker_left = match s.breaker {
        sluice_lanes::BreakerStatus::Open { retry_after } => retry_after.as_secs_f64(),
        _ => 0.0,
    };
    LaneStatus {
        lane: s.lane,
        global_cap: s.global_cap,
        batch_cap: s.batch_cap,
        running: s.running,
        waiting: s.waiting,
        batch_running: s.batch_running,
        breaker: s.breaker.as_str(),
        breaker_open_seconds_left: breaker_left,
        expected_call_seconds: s.expected_duration.as_secs_f64(),
        workspaces: s
            .workspaces
            .into_iter()
            .map(|w| LaneWorkspace {
                workspace: w.workspace,
                running: w.running,
                waiting: w.waiting,
                started_in_window: w.started_in_window,
                batch_running: w.batch_running,
            })
            .collect(),
    }
}

/// Sets the lane gauges (`sluice_lane_running`, `sluice_lane_waiting`,
/// `sluice_lane_batch_running`, `sluice_lane_breaker_open`, by lane) to what
/// `lane` holds now.
pub fn publish_lane_gauges(lane: &Lane) {
    let s = lane.snapshot();
    let name = s.lane.clone();
    metrics::gauge!("sluice_lane_running", "lane" => name.clone()).set(f64::from(s.running));
    metrics::gauge!("sluice_lane_waiting", "lane" => name.clone()).set(f64::from(s.waiting));
    metrics::gauge!("sluice_lane_batch_running", "lane" => name.clone())
        .set(f64::from(s.batch_running));
    let open = matches!(s.breaker, sluice_lanes::BreakerStatus::Open { .. });
    metrics::gauge!("sluice_lane_breaker_open", "lane" => name).set(if open { 1.0 } else { 0.0 });
}
