//! `lanes:`: each lane's settings and reasons, its batch lane, and the routes
//! a batch lane answers.

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::time::Duration;

use http::Method;

use crate::model::{BatchEndpoint, Lane, LaneBatch, LaneReasons, MAX_LANES, Route};
use crate::raw::{RawLane, RawLaneBatch, RawPolicy};

use super::{Checker, MAX_CLASS_NAME, MAX_LANE_STARTS};

impl Checker {
    /// `lanes:`, each checked, with the index of each by name.
    pub(super) fn lanes(&mut self, raw: &RawPolicy) -> (HashMap<String, usize>, Vec<Lane>) {
        let mut lane_index = HashMap::new();
        let mut lanes = Vec::new();
        for (name, raw_lane) in &raw.lanes {
            if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
                self.problem(
                    format!("lanes.{name}"),
                    "a lane name is letters, digits and `_`",
                );
                continue;
            }
            if let Some(lane) = self.lane(name, raw_lane) {
                lane_index.insert(name.clone(), lanes.len());
                lanes.push(lane);
            }
        }
        if raw.lanes.len() > MAX_LANES {
            self.problem("lanes", format!("at most {MAX_LANES} lanes"));
        }
        (lane_index, lanes)
    }

    /// Marks the routes each batch lane answers (its submit and status endpoints),
    /// which must be in `routes`, and gives the batch the single-call route's quota.
    pub(super) fn batch_endpoints(&mut self, lanes: &mut [Lane], routes: &mut [Route]) {
        // Each batch lane's endpoints are routes of the table (their classes are what a
        // submit and a status read cost), marked so that sluice answers them; items
        // count against the single-call route's quota.
        for (l, lane) in lanes.iter_mut().enumerate() {
            let Some(batch) = &mut lane.batch else {
                continue;
            };
            fn find(routes: &[Route], method: &Method, path: &str) -> Option<usize> {
                routes.iter().position(|r| r.matches(method, path))
            }
            let single = find(routes, &Method::POST, &batch.route);
            batch.quota = single.and_then(|i| routes[i].quota);
            let submit = batch.submit_path();
            let status = format!("{}/batches/{{id}}", batch.route);
            for (method, path, endpoint) in [
                (Method::POST, submit.clone(), BatchEndpoint::Submit(l)),
                (
                    Method::GET,
                    format!("{}/batches/x", batch.route),
                    BatchEndpoint::Status(l),
                ),
            ] {
                let wanted = if matches!(endpoint, BatchEndpoint::Submit(_)) {
                    &submit
                } else {
                    &status
                };
                match find(routes, &method, &path) {
                    Some(i)
                        if routes[i]
                            .path
                            .as_ref()
                            .is_some_and(|p| p.as_str().split('{').next() == wanted.split('{').next()) =>
                    {
                        routes[i].batch = Some(endpoint);
                    }
                    _ => self.problem(
                        format!("lanes.{}.batch.route", lane.name),
                        format!("the routes need `{{ method: {method}, path: \"{wanted}\", class: … }}` before any route that matches it (its class is what the call costs)"),
                    ),
                }
            }
        }
    }

    /// Checks that the tools a batch lane names are under `jsonrpc.tools`.
    pub(super) fn batch_tools(&mut self, raw: &RawPolicy, lanes: &[Lane]) {
        for lane in lanes {
            let Some(batch) = &lane.batch else { continue };
            for (field, tool) in [
                ("submit_tool", &batch.submit_tool),
                ("status_tool", &batch.status_tool),
            ] {
                if let Some(tool) = tool
                    && !raw.jsonrpc.tools.contains_key(tool)
                {
                    self.problem(
                        format!("lanes.{}.batch.{field}", lane.name),
                        format!("no tool named {tool:?} under `jsonrpc.tools`"),
                    );
                }
            }
        }
    }

    /// A lane's batch lane, checked, with the built-in defaults for what is left out.
    pub(super) fn lane_batch(&mut self, lane: &str, raw: &RawLaneBatch) -> Option<LaneBatch> {
        let at = |field: &str| format!("lanes.{lane}.batch.{field}");
        let route_ok = raw.route.starts_with('/')
            && raw.route.len() > 1
            && !raw.route.ends_with('/')
            && raw
                .route
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"/-_.~".contains(&b));
        if !route_ok {
            self.problem(
                at("route"),
                "a plain path such as /messages/optimize (no parameters, no trailing /)",
            );
        }
        let max_items = self.nonzero(&at("max_items"), raw.max_items.unwrap_or(1000));
        let backlog = self.nonzero(&at("backlog"), raw.backlog.unwrap_or(5000));
        let keep = self.nonzero(&at("keep_hours"), raw.keep_hours.unwrap_or(168));
        if let (Some(items), Some(backlog)) = (max_items, backlog)
            && items > backlog
        {
            self.problem(
                at("max_items"),
                format!("more than the backlog ({backlog}): such a batch could never be queued"),
            );
        }
        Some(LaneBatch {
            route: raw.route.clone(),
            max_items: max_items?,
            backlog: backlog?,
            keep: Duration::from_secs(u64::from(keep?.get()) * 3600),
            submit_tool: raw.submit_tool.clone(),
            status_tool: raw.status_tool.clone(),
            quota: None,
        })
        .filter(|_| route_ok)
    }

    /// A lane's settings, each checked, with the built-in defaults for what is
    /// left out.
    pub(super) fn lane(&mut self, name: &str, raw: &RawLane) -> Option<Lane> {
        let at = |field: &str| format!("lanes.{name}.{field}");
        let count = |v: &mut Self, field: &str, value: Option<u32>, default: u32| {
            v.nonzero(&at(field), value.unwrap_or(default))
        };
        let workspace_in_flight = count(self, "workspace_in_flight", raw.workspace_in_flight, 3);
        let workspace_starts = count(self, "workspace_starts", raw.workspace_starts, 12);
        let starts_window = count(self, "starts_window_seconds", raw.starts_window_seconds, 60);
        let global_in_flight = count(self, "global_in_flight", raw.global_in_flight, 20);
        let wait = count(self, "wait_seconds", raw.wait_seconds, 15);
        let jsonrpc_wait = count(self, "jsonrpc_wait_seconds", raw.jsonrpc_wait_seconds, 120);
        let max_waiting = count(self, "max_waiting", raw.max_waiting, 1000);
        let timeout = count(self, "timeout_seconds", raw.timeout_seconds, 180);
        let failures = count(self, "breaker.failures", raw.breaker.failures, 5);
        let within = count(
            self,
            "breaker.within_seconds",
            raw.breaker.within_seconds,
            60,
        );
        let open = count(self, "breaker.open_seconds", raw.breaker.open_seconds, 30);
        let lease_ttl = count(self, "lease_ttl_seconds", raw.lease_ttl_seconds, 10);
        let batch_reserve = raw.batch_reserve.unwrap_or(5);
        // A lane remembers each start of a workspace for its window.
        if let Some(starts) = workspace_starts
            && starts.get() > MAX_LANE_STARTS
        {
            self.problem(
                at("workspace_starts"),
                format!("at most {MAX_LANE_STARTS} (each start is remembered for its window)"),
            );
        }
        let global = global_in_flight?;
        if batch_reserve >= global.get() {
            self.problem(
                at("batch_reserve"),
                format!("must be less than global_in_flight ({global}): batch items need a place"),
            );
            return None;
        }
        let secs = |n: NonZeroU32| Duration::from_secs(u64::from(n.get()));
        Some(Lane {
            name: name.to_owned(),
            workspace_in_flight: workspace_in_flight?,
            workspace_starts: workspace_starts?,
            starts_window: secs(starts_window?),
            global_in_flight: global,
            batch_reserve,
            wait: secs(wait?),
            jsonrpc_wait: secs(jsonrpc_wait?),
            max_waiting: max_waiting?,
            timeout: secs(timeout?),
            breaker_failures: failures?,
            breaker_within: secs(within?),
            breaker_open: secs(open?),
            lease_ttl: secs(lease_ttl?),
            batch: match &raw.batch {
                None => None,
                Some(b) => Some(self.lane_batch(name, b)?),
            },
            reasons: self.lane_reasons(name, raw)?,
        })
    }

    /// The names clients see for a lane's `busy` and `unavailable` refusals.
    pub(super) fn lane_reasons(&mut self, lane: &str, raw: &RawLane) -> Option<LaneReasons> {
        let mut name = |field: &str, given: &Option<String>| {
            let name = given.clone().unwrap_or_else(|| format!("{lane}_{field}"));
            let ok = !name.is_empty()
                && name.len() <= MAX_CLASS_NAME
                && name
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
            if !ok {
                self.problem(
                    format!("lanes.{lane}.reasons.{field}"),
                    format!("a reason is 1 to {MAX_CLASS_NAME} lower-case letters, digits and `_`"),
                );
            }
            ok.then_some(name)
        };
        let busy = name("busy", &raw.reasons.busy);
        let unavailable = name("unavailable", &raw.reasons.unavailable);
        Some(LaneReasons {
            busy: busy?,
            unavailable: unavailable?,
        })
    }
}
