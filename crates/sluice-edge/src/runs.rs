//! Agent runs at the edge (SPEC T7): a call on an LLM route, or an MCP tool
//! call, that names its run (`X-Sluice-Run`, its tier in `X-Sluice-Depth`) is a
//! turn of that run, decided in the same decision as the call's other budgets.
//! A run whose turns are spent pauses: the call is answered 409 with a
//! `continue_or_finish` question and never forwarded, and the run's owner
//! grants more turns or finishes it through the gateway's run endpoints.
//!
//! A run is keyed by (caller, run id): nobody spends or grants another's run.
//! Each run is two [`Rate::Turns`] budgets in the store — the turns it may
//! still take (its tier's, pinned at its first turn, plus grants) and the turns
//! it took — and a run new to this replica also spends one of its caller's
//! run starts (`turns.runs_per_caller` per `turns.idle_seconds`).

use std::collections::HashMap;
use std::num::NonZeroU32;

use bytes::Bytes;
use http::{HeaderMap, Method, Response, StatusCode};
use http_body_util::Full;
use parking_lot::Mutex;
use serde_json::{Value, json};
use sluice_core::{Budget, BudgetKey, Decision, MAX_TIER_TURNS, Rate, Verdict};
use sluice_policy::{
    CustomerPlan, DEPTH_HEADER, LlmFormat, Policy, RUN_HEADER, Route, RouteClass, RunEndpoint,
    is_run_id,
};
use sluice_store::{BudgetStore, StoreError};

use crate::plan::{BudgetKind, Plan};

/// Why a call's run cannot be counted: answered 400, nothing counted or
/// forwarded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BadRun {
    /// The run id is empty, too long, or holds a byte a run id may not.
    #[error("the run id is not 1 to 128 ASCII letters, digits or -._~:@+=,")]
    Id,
    /// The depth names no tier of the policy.
    #[error("the depth names no tier of the policy's `turns.tiers`")]
    Depth,
    /// A run header on a route that is neither an LLM route nor a JSON-RPC one.
    #[error("a run is named on a route that is not an LLM route or an MCP endpoint")]
    NotHere,
    /// The run or the depth header sent more than once.
    #[error("the run or the depth is named more than once")]
    Several,
}

impl BadRun {
    /// The refusal's `details.reason`.
    pub fn reason(self) -> &'static str {
        match self {
            BadRun::Id => "bad_run_id",
            BadRun::Depth => "unknown_depth",
            BadRun::NotHere => "run_not_supported",
            BadRun::Several => "several_run_headers",
        }
    }
}

/// The run a call is a turn of.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlannedRun {
    /// Its id, as the caller named it.
    pub id: Box<str>,
    /// Its tier (index into the policy's `turns.tiers`).
    pub tier: usize,
    /// Its digest with the caller's: the store's subject for it.
    pub subject: u64,
    /// The index in the plan of its turns left; its turns taken follow.
    pub index: usize,
    /// The turns this call takes (an MCP batch may hold several tool calls).
    pub turns: u32,
}

/// The turns a run may still take: its tier's and its grants, less those taken.
const TURNS_LEFT: &[u8] = b"run:turns";
/// The turns a run took: a run's counter as a [`Rate::Turns`] budget that
/// nothing grants or finishes.
const TURNS_TAKEN: &[u8] = b"run:taken";
/// A caller's run starts per `turns.idle_seconds`.
const RUN_STARTS: &[u8] = b"run:starts";
/// The most turns one run takes in all, grants included: its turns-taken
/// counter's limit.
const TAKEN_LIMIT: u32 = MAX_TIER_TURNS;

/// The run a request from `caller` names, if it is a turn of one: on an LLM
/// route one turn; on a JSON-RPC route one per MCP `tools/call` in `body`
/// (none for other methods: an `initialize` may carry the run header too). A
/// run's own endpoints (`turns.endpoints`) are no turn.
///
/// # Errors
/// [`BadRun`]: a run id or a depth that cannot be read, or a run named on a
/// route where calls are no turns.
pub(crate) fn run_of(
    policy: &Policy,
    headers: &HeaderMap,
    (route, body, path): (Option<&Route>, Option<&[u8]>, &str),
    caller: u64,
) -> Result<Option<PlannedRun>, BadRun> {
    let turns = &policy.turns;
    if !turns.enabled {
        return Ok(None);
    }
    let named = one(headers, RUN_HEADER, BadRun::Id)?;
    if named.is_none() && !turns.mcp_session {
        return Ok(None);
    }
    if turns.endpoint(path).is_some() {
        return Ok(None);
    }
    let jsonrpc = route.is_some_and(|r| r.class == RouteClass::JsonRpc);
    let calls = match route {
        Some(r) if r.llm.is_some() => 1,
        Some(_) if jsonrpc => body.map_or(0, tool_calls),
        _ => 0,
    };
    let id: Box<str> = match named {
        Some(id) if !is_run_id(id) => return Err(BadRun::Id),
        Some(_) if calls == 0 && !jsonrpc => return Err(BadRun::NotHere),
        Some(id) => id.into(),
        // The MCP session names the run (its id may hold any visible ASCII: the
        // run is named by its digest).
        None if jsonrpc && calls > 0 => match one(headers, "mcp-session-id", BadRun::Id)? {
            Some(session) => format!("mcp-{:016x}", sluice_core::digest(session.as_bytes())).into(),
            None => return Ok(None),
        },
        None => return Ok(None),
    };
    // The depth is read only of a call that names a run.
    let tier = match one(headers, DEPTH_HEADER, BadRun::Depth)? {
        Some(d) => turns.tier(d).ok_or(BadRun::Depth)?,
        None => turns.default_tier,
    };
    if calls == 0 {
        return Ok(None);
    }
    Ok(Some(PlannedRun {
        subject: subject(caller, &id),
        id,
        tier,
        index: 0,
        turns: calls,
    }))
}

/// The one value of header `name`, if sent.
///
/// # Errors
/// [`BadRun::Several`] for more than one; `unreadable` for one that is not
/// visible ASCII.
fn one<'h>(
    headers: &'h HeaderMap,
    name: &str,
    unreadable: BadRun,
) -> Result<Option<&'h str>, BadRun> {
    let mut values = headers.get_all(name).iter();
    let Some(first) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(BadRun::Several);
    }
    first.to_str().map(Some).map_err(|_| unreadable)
}

/// The MCP `tools/call` requests in a JSON-RPC body (one, or a batch).
fn tool_calls(body: &[u8]) -> u32 {
    let is_call = |m: &Value| m.get("method").and_then(Value::as_str) == Some("tools/call");
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Array(items)) => {
            u32::try_from(items.iter().filter(|m| is_call(m)).count()).unwrap_or(u32::MAX)
        }
        Ok(m) => u32::from(is_call(&m)),
        Err(_) => 0,
    }
}

/// The store's subject of run `id` of `caller`.
fn subject(caller: u64, id: &str) -> u64 {
    let mut bytes = Vec::with_capacity(8 + id.len());
    bytes.extend_from_slice(&caller.to_le_bytes());
    bytes.extend_from_slice(id.as_bytes());
    sluice_core::digest(&bytes)
}

/// The turns of `tier` for a workspace on `plan`: the plan's, else the policy's.
pub(crate) fn tier_turns(policy: &Policy, plan: Option<&CustomerPlan>, tier: usize) -> u32 {
    plan.and_then(|p| p.turns.get(tier).copied().flatten())
        .or_else(|| policy.turns.tiers.get(tier).map(|(_, n)| *n))
        .map_or(1, NonZeroU32::get)
}

/// A run's two budgets: its turns left (`turns` for a run new now) and its turns
/// taken, each spending `cost`.
fn run_budgets(policy: &Policy, subject: u64, turns: u32, cost: u32) -> [Budget; 2] {
    let rate = Rate::Turns {
        idle_secs: policy.turns.idle,
    };
    let key = |scope: &[u8]| BudgetKey::from_digests(sluice_core::digest(scope), subject);
    [
        Budget {
            key: key(TURNS_LEFT),
            rate,
            limit: turns,
            cost,
        },
        Budget {
            key: key(TURNS_TAKEN),
            rate,
            limit: TAKEN_LIMIT,
            cost,
        },
    ]
}

/// Adds `run`'s budgets to `plan`: its turns left and taken (a run found new
/// once decided spends one of its caller's run starts: see
/// [`crate::Limiter::start_run`]). A plan with no room for them (the policy
/// check leaves it) is left as it is.
pub(crate) fn push(plan: &mut Plan, policy: &Policy, mut run: PlannedRun, shadow: bool) {
    if plan.budgets.remaining_capacity() < 3 {
        debug_assert!(
            false,
            "a plan with no room for a run: the policy check missed it"
        );
        return;
    }
    let customer = policy.plan_for(&plan.from).ok().flatten();
    let turns = tier_turns(policy, customer, run.tier);
    let window = policy.turns.idle;
    run.index = plan.budgets.len();
    let [left, taken] = run_budgets(policy, run.subject, turns, run.turns);
    plan.push(left, BudgetKind::Turns, window, shadow);
    plan.push(taken, BudgetKind::TurnsTaken, window, shadow);
    plan.run = Some(Box::new(run));
}

/// The run starts of `caller` under `policy`, spending `cost`.
fn run_starts(policy: &Policy, caller: u64, cost: u32) -> Budget {
    Budget {
        key: BudgetKey::from_digests(sluice_core::digest(RUN_STARTS), caller),
        rate: Rate::FixedWindow {
            seconds: policy.turns.idle,
        },
        limit: policy.turns.runs_per_caller.get(),
        cost,
    }
}

/// Where a run stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RunState {
    /// Turns taken.
    pub used: u32,
    /// Turns it may still take.
    pub left: u32,
    /// Finished by its owner.
    pub finished: bool,
}

impl RunState {
    /// Its state from the statuses of its turns left (`left`) and taken
    /// (`taken`), as a decision or a peek of them gives them.
    fn of(left: &sluice_core::BudgetStatus, taken: &sluice_core::BudgetStatus) -> Self {
        RunState {
            used: TAKEN_LIMIT.saturating_sub(taken.remaining),
            left: left.remaining,
            finished: left.verdict == Verdict::Never,
        }
    }

    /// Turns it may take in all: taken and left.
    fn granted(&self) -> u32 {
        self.used.saturating_add(self.left)
    }

    fn name(&self) -> &'static str {
        if self.finished {
            "finished"
        } else if self.left == 0 {
            "paused"
        } else {
            "running"
        }
    }
}

/// The runs this replica decided turns of lately, newest kept (the admin
/// listener's list).
#[derive(Debug, Default)]
pub(crate) struct RecentRuns {
    runs: Mutex<RunTable>,
}

/// The most runs [`RecentRuns`] keeps, in each of its two generations.
const RECENT_RUNS: usize = 4_096;

#[derive(Debug, Default)]
struct RunTable {
    current: HashMap<u64, SeenRun>,
    previous: HashMap<u64, SeenRun>,
}

/// A run as this replica last decided a turn of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeenRun {
    /// The caller, as logs and the status page show it.
    pub caller: String,
    /// The run's id.
    pub id: Box<str>,
    /// Its tier's name.
    pub tier: String,
    /// Turns taken.
    pub used: u32,
    /// Turns it may take in all.
    pub granted: u32,
    /// When (Unix seconds).
    pub at: u64,
}

impl RecentRuns {
    /// Keeps where run `subject` stands after a decision of one of its turns;
    /// a run seen before keeps the tier it was first seen with (a run's tier is
    /// its first call's, whatever later calls name).
    fn keep(&self, subject: u64, mut run: SeenRun) {
        let mut t = self.runs.lock();
        if let Some(seen) = t.current.get(&subject).or_else(|| t.previous.get(&subject)) {
            run.tier.clone_from(&seen.tier);
        }
        if t.current.len() >= RECENT_RUNS && !t.current.contains_key(&subject) {
            t.previous = std::mem::take(&mut t.current);
        }
        t.current.insert(subject, run);
    }

    /// The runs kept, those with the fewest turns left first.
    pub(crate) fn list(&self) -> Vec<SeenRun> {
        let t = self.runs.lock();
        let mut runs: Vec<SeenRun> = t
            .previous
            .iter()
            .filter(|(s, _)| !t.current.contains_key(s))
            .chain(&t.current)
            .map(|(_, r)| r.clone())
            .collect();
        runs.sort_by_key(|r| (r.granted.saturating_sub(r.used), std::cmp::Reverse(r.at)));
        runs
    }
}

/// True when the run of `plan` refused `decision`: its turns are spent, or it
/// took the most turns a run takes in all.
pub(crate) fn paused(plan: &Plan, decision: &Decision) -> bool {
    plan.run.as_ref().is_some_and(|run| {
        (run.index..run.index + 2).any(|i| {
            decision
                .statuses()
                .get(i)
                .is_some_and(|s| s.verdict != Verdict::Admitted)
                && plan.shadow & (1 << i) == 0
        })
    })
}

impl<S: BudgetStore> crate::Limiter<S> {
    /// A run new at `decision` (admitted: its first turn, or its first since it
    /// was forgotten) spends one of its caller's run starts
    /// (`turns.runs_per_caller` per `turns.idle_seconds`), in one more store
    /// call: the first turn of a run alone pays it, whichever replica decides
    /// it. A caller with no start left has the call given back — every budget
    /// it spent — and refused by `run_starts` (the decision that says so, the
    /// budget added to `plan`).
    ///
    /// A store that cannot count the start follows the plan's outage rule, as
    /// the call's own decision does: where every budget fails open the start is
    /// counted on the fallback store with this replica's share; otherwise the
    /// call is given back and the error returned (503, never admitted uncounted).
    ///
    /// # Errors
    /// The store's, when it cannot count the start and the plan fails closed.
    pub(crate) async fn start_run(
        &self,
        plan: &mut Plan,
        decision: Box<Decision>,
    ) -> Result<Box<Decision>, StoreError> {
        let Some(run) = &plan.run else {
            return Ok(decision);
        };
        let fresh = decision
            .statuses()
            .get(run.index + 1)
            .is_some_and(|taken| TAKEN_LIMIT.saturating_sub(taken.remaining) == run.turns);
        let shadow = plan.shadow & (1 << run.index) != 0;
        if !fresh {
            return Ok(decision);
        }
        let starts = run_starts(self.policy(), plan.caller, 1);
        let counted = match self.store().decide_from(&[starts], plan.network).await {
            Err(error) if self.fails_open(plan) => {
                metrics::counter!("sluice_settle_failures_total").increment(1);
                self.decide_locally(plan, &[starts]).map_err(|_| error)
            }
            counted => counted,
        };
        let status = match counted {
            Ok(d) => match d.statuses().first() {
                Some(s) => *s,
                None => return Ok(decision),
            },
            Err(error) => {
                self.give_back(plan, decision.decided_at()).await;
                return Err(error);
            }
        };
        if status.verdict == Verdict::Admitted || shadow {
            return Ok(decision);
        }
        // Given back whole: nothing of a refused call stays spent.
        let decided_at = decision.decided_at();
        self.give_back(plan, decided_at).await;
        plan.push(
            starts,
            BudgetKind::RunStarts,
            self.policy().turns.idle,
            false,
        );
        let statuses = decision.statuses().iter().copied().chain([status]);
        Ok(Decision::boxed_from_statuses(decided_at, statuses))
    }

    /// Gives back every budget the admitted call of `plan` spent at
    /// `decided_at` (a store that cannot take it back is counted in
    /// `sluice_settle_failures_total`).
    async fn give_back(&self, plan: &Plan, decided_at: sluice_core::Timestamp) {
        let spent: Vec<(Budget, i64)> = plan
            .budgets
            .iter()
            .enumerate()
            .filter(|&(i, b)| {
                b.cost > 0
                    && plan.shadowed & (1 << i) == 0
                    && plan.passed.is_none_or(|p| p.index != i)
            })
            .map(|(_, b)| (*b, -i64::from(b.cost)))
            .collect();
        if self
            .store()
            .adjust_all_from(&spent, decided_at, plan.network)
            .await
            .is_err()
        {
            metrics::counter!("sluice_settle_failures_total").increment(1);
        }
    }

    /// Keeps where the run of `plan` stands after `decision` (admitted, or
    /// paused by its turns), for the admin listener.
    pub(crate) fn keep_run(&self, plan: &Plan, decision: &Decision) {
        let Some(run) = &plan.run else {
            return;
        };
        let s = decision.statuses();
        let (Some(left), Some(taken)) = (s.get(run.index), s.get(run.index + 1)) else {
            return;
        };
        let state = RunState::of(left, taken);
        let outcome = if decision.is_admitted() {
            "taken"
        } else if paused(plan, decision) {
            if state.finished { "finished" } else { "paused" }
        } else {
            return;
        };
        metrics::counter!("sluice_run_turns_total", "outcome" => outcome).increment(1);
        self.runs.keep(
            run.subject,
            SeenRun {
                caller: plan.who.to_string(),
                id: run.id.clone(),
                tier: self
                    .policy()
                    .turns
                    .tiers
                    .get(run.tier)
                    .map_or_else(String::new, |(n, _)| n.clone()),
                used: state.used,
                granted: state.granted(),
                at: decision.decided_at().as_secs(),
            },
        );
    }

    /// The runs this replica decided turns of lately, with the fewest turns left
    /// first, as JSON (the admin listener's `GET /runs`): those with no more than
    /// `near` of their turns left, at most `max`.
    pub fn recent_runs(&self, near: f64, max: usize) -> Value {
        let runs: Vec<Value> = self
            .runs
            .list()
            .into_iter()
            .filter(|r| {
                f64::from(r.granted.saturating_sub(r.used)) <= near * f64::from(r.granted.max(1))
            })
            .take(max)
            .map(|r| {
                json!({
                    "caller": r.caller, "run": r.id, "tier": r.tier, "turns_used": r.used,
                    "turns_granted": r.granted, "state": if r.used >= r.granted { "paused" } else { "running" },
                    "at": crate::rfc3339(r.at),
                })
            })
            .collect();
        json!({ "runs": runs })
    }

    /// Answers a run endpoint (`GET <endpoints>/<run>`, `POST …/continue`, `POST
    /// …/finish`) for the caller of `plan` (admitted as any request, on its own
    /// class): the run's state, a grant of more turns (`{"turns": N}` in
    /// `body`, 1 to `turns.max_grant`, while at most `turns.max_granted` are
    /// left), or its end. A run the caller has none of is 404; a finished run
    /// takes no grant (409).
    pub(crate) async fn run_endpoint(
        &self,
        plan: &Plan,
        endpoint: RunEndpoint<'_>,
        method: &Method,
        body: &[u8],
    ) -> Response<Full<Bytes>> {
        let (id, wanted) = match endpoint {
            RunEndpoint::State(id) => (id, Method::GET),
            RunEndpoint::Continue(id) | RunEndpoint::Finish(id) => (id, Method::POST),
            RunEndpoint::Unknown(_) => return not_found("No such run endpoint."),
        };
        if *method != wanted {
            let mut r = crate::envelope_response(
                StatusCode::METHOD_NOT_ALLOWED,
                "method_not_allowed",
                &format!("Use {wanted} here."),
                json!({}),
            );
            if let Ok(allow) = http::HeaderValue::from_str(wanted.as_str()) {
                r.headers_mut().insert(http::header::ALLOW, allow);
            }
            return r;
        }
        if !is_run_id(id) {
            return invalid(BadRun::Id.reason(), &BadRun::Id.to_string());
        }
        let subject = subject(plan.caller, id);
        let [mut left, taken] = run_budgets(self.policy(), subject, 1, 0);
        // A peek of one turn: refused when paused, never when finished.
        left.cost = 1;
        let state = match self.store().peek_from(&[left, taken], plan.network).await {
            Ok(d) => match (d.statuses().first(), d.statuses().get(1)) {
                (Some(l), Some(t)) => RunState::of(l, t),
                _ => return crate::answer::limiter_unavailable(&"no run state"),
            },
            Err(e) => return crate::answer::limiter_unavailable(&e),
        };
        if state.used == 0 {
            return not_found("No such run of yours: it took no turn, or was forgotten idle.");
        }
        let state = match endpoint {
            RunEndpoint::Continue(_) => {
                let max_grant = self.policy().turns.max_grant.get();
                let Some(grant) = grant_of(body, max_grant) else {
                    return invalid_with(
                        "bad_grant",
                        &format!(
                            "Send {{\"turns\": N}} with N a whole number from 1 to {max_grant}."
                        ),
                        json!({ "max_grant": max_grant }),
                    );
                };
                if state.finished {
                    return conflict(
                        id,
                        "run_finished",
                        "The run is finished: it takes no more turns.",
                    );
                }
                let max = self.policy().turns.max_granted.get();
                if state.left.saturating_add(grant) > max {
                    return invalid_with(
                        "grant_too_large",
                        &format!(
                            "A run may have at most {max} turns left; it has {}.",
                            state.left
                        ),
                        json!({ "max_granted": max, "turns_left": state.left }),
                    );
                }
                // Both cells in one call: the turns taken are remembered as
                // long as the turns left (a grant keeps the run known).
                match self
                    .store()
                    .adjust_all_from(
                        &[(left, -i64::from(grant)), (taken, 0)],
                        ANY_TIME,
                        plan.network,
                    )
                    .await
                {
                    Ok(s) => {
                        metrics::counter!("sluice_run_grants_total").increment(1);
                        RunState {
                            left: s.first().map_or(state.left, |s| s.remaining),
                            ..state
                        }
                    }
                    Err(e) => return crate::answer::limiter_unavailable(&e),
                }
            }
            RunEndpoint::Finish(_) => {
                if !state.finished
                    && let Err(e) = self
                        .store()
                        .adjust_all_from(
                            &[(left, i64::from(u32::MAX)), (taken, 0)],
                            ANY_TIME,
                            plan.network,
                        )
                        .await
                {
                    return crate::answer::limiter_unavailable(&e);
                }
                RunState {
                    left: 0,
                    finished: true,
                    ..state
                }
            }
            _ => state,
        };
        let body = json!({
            "run": id,
            "state": state.name(),
            "turns_used": state.used,
            "turns_granted": state.granted(),
            "turns_left": state.left,
        });
        let mut r = Response::new(Full::new(Bytes::from(body.to_string())));
        r.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/json"),
        );
        r
    }
}

/// The instant a change of a run says it was reserved at: [`Rate::Turns`]
/// ignores it.
const ANY_TIME: sluice_core::Timestamp = sluice_core::Timestamp::from_secs(0);

/// The turns a `continue` body grants: `{"turns": N}`, 1 to `max`; `None`
/// for any other body (`turns` named twice included, as every body sluice
/// reads).
fn grant_of(body: &[u8], max: u32) -> Option<u32> {
    let v: Value = sluice_policy::json::parse_unique(body).ok()?;
    let n = v.get("turns").and_then(Value::as_u64)?;
    u32::try_from(n).ok().filter(|n| (1..=max).contains(n))
}

fn not_found(message: &str) -> Response<Full<Bytes>> {
    crate::envelope_response(StatusCode::NOT_FOUND, "not_found", message, json!({}))
}

fn invalid(reason: &str, message: &str) -> Response<Full<Bytes>> {
    invalid_with(reason, message, json!({}))
}

fn invalid_with(reason: &str, message: &str, mut details: Value) -> Response<Full<Bytes>> {
    if let Value::Object(map) = &mut details {
        map.insert("reason".into(), reason.into());
    }
    crate::envelope_response(StatusCode::BAD_REQUEST, "invalid_request", message, details)
}

fn conflict(run: &str, code: &str, message: &str) -> Response<Full<Bytes>> {
    crate::envelope_response(StatusCode::CONFLICT, code, message, json!({ "run": run }))
}

/// The answer to a call its run's turns paused (or its run is finished): 409,
/// never forwarded, no `Retry-After` (waiting does not help) and
/// `X-Should-Retry: false` (so the SDKs that retry a 409 do not). The body is SPEC
/// T7's envelope; on an `llm: openai` route `error.type` and `error.code` carry
/// it too, on an `llm: anthropic` route Anthropic's error shape with its
/// `details`, and on a JSON-RPC route a JSON-RPC error whose `data` holds it.
pub(crate) fn pause(
    plan: &Plan,
    decision: &Decision,
    policy: &Policy,
    jsonrpc_body: Option<&[u8]>,
) -> Response<Full<Bytes>> {
    let Some(run) = &plan.run else {
        return crate::answer::limiter_unavailable(&"no run");
    };
    let s = decision.statuses();
    let state = match (s.get(run.index), s.get(run.index + 1)) {
        (Some(l), Some(t)) => RunState::of(l, t),
        _ => RunState {
            used: 0,
            left: 0,
            finished: false,
        },
    };
    let base = format!("{}/{}", policy.turns.endpoints, run.id);
    let (code, message) = if state.finished {
        (
            "run_finished",
            format!("Run {} is finished: it takes no more turns.", run.id),
        )
    } else {
        (
            "turn_budget_exhausted",
            format!(
                "Run {} has taken all {} of its turns. Grant more (POST {base}/continue) or wrap up (POST {base}/finish).",
                run.id,
                state.granted()
            ),
        )
    };
    let details = json!({
        "question": if state.finished { Value::Null } else { "continue_or_finish".into() },
        "run": run.id,
        "turns_used": state.used,
        "turns_granted": state.granted(),
        "continue_url": format!("{base}/continue"),
        "finish_url": format!("{base}/finish"),
    });
    let mut response = match (plan.llm, jsonrpc_body) {
        (_, Some(request)) => jsonrpc_pause(request, code, &message, details),
        (Some(LlmFormat::OpenAi), _) => json_response(
            StatusCode::CONFLICT,
            &json!({
                "error": { "message": message, "type": code, "param": null, "code": code, "details": details },
            }),
        ),
        (Some(LlmFormat::Anthropic), _) => json_response(
            StatusCode::CONFLICT,
            &json!({
                "type": "error",
                "error": { "type": code, "message": message, "details": details },
            }),
        ),
        (None, None) => json_response(
            StatusCode::CONFLICT,
            &json!({ "error": { "code": code, "message": message, "details": details } }),
        ),
    };
    // The official OpenAI and Anthropic SDKs retry a 409 by default (a lock
    // timeout to them): this header, which they obey, tells them not to.
    response.headers_mut().insert(
        http::HeaderName::from_static("x-should-retry"),
        http::HeaderValue::from_static("false"),
    );
    response
}

/// The JSON-RPC error code of a paused run's tool call.
pub const JSONRPC_TURNS_EXHAUSTED: i64 = -32010;

/// A pause as JSON-RPC errors, one per request of `request` with an id (HTTP 409).
fn jsonrpc_pause(
    request: &[u8],
    code: &str,
    message: &str,
    details: Value,
) -> Response<Full<Bytes>> {
    let mut data = details;
    if let Value::Object(map) = &mut data {
        map.insert("code".into(), code.into());
    }
    let error = |id: Value| {
        json!({
            "jsonrpc": "2.0", "id": id,
            "error": { "code": JSONRPC_TURNS_EXHAUSTED, "message": message, "data": data },
        })
    };
    let body = match serde_json::from_slice::<Value>(request).unwrap_or_default() {
        Value::Array(items) => {
            let errors: Vec<Value> = items
                .iter()
                .filter_map(|m| m.get("id").cloned())
                .map(error)
                .collect();
            if errors.is_empty() {
                error(Value::Null)
            } else {
                Value::Array(errors)
            }
        }
        m => error(m.get("id").cloned().unwrap_or(Value::Null)),
    };
    json_response(StatusCode::CONFLICT, &body)
}

fn json_response(status: StatusCode, body: &Value) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body.to_string())));
    *r.status_mut() = status;
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    r
}

#[cfg(test)]
mod tests {
    use super::grant_of;

    /// SPEC T7: a `continue` grants the turns its body names, once named.
    #[test]
    fn t7_a_grant_names_its_turns_once() {
        assert_eq!(grant_of(br#"{"turns":3}"#, 10), Some(3));
        assert_eq!(grant_of(br#"{"t\u0075rns":3}"#, 10), Some(3));
        assert_eq!(grant_of(br#"{"turns":1,"turns":1000}"#, 2000), None);
        assert_eq!(grant_of(br#"{"turns":11}"#, 10), None);
        assert_eq!(grant_of(br#"{"turns":0}"#, 10), None);
        assert_eq!(grant_of(b"{}", 10), None);
    }
}
