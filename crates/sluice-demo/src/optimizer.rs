//! The demo's message optimizer: the slow, expensive upstream a lane guards. Each
//! call takes a set time (a few seconds by default, `--demo-optimize-seconds`), and
//! the optimizer can be told to fail, so a newcomer can watch calls wait in the
//! lane, be refused, trip the breaker and recover on the dashboard.
//!
//! - `POST /messages/optimize` (and the `optimize_message` tool on `/mcp`): answers
//!   `{"optimized": …}` after the call time, or 503 while failing.
//! - `GET /demo/optimizer`: calls so far, running now and the most seen at once, in
//!   all and per workspace (`X-Sluice-Workspace`).
//! - `POST /demo/optimizer?failing=true|false&seconds=N`: make calls fail (or not),
//!   set the call time.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Json, Response};
use parking_lot::Mutex;
use serde::Deserialize;
use serde_json::{Value, json};

/// Longest call time the demo takes (`seconds` past it is refused).
pub const MAX_CALL_SECONDS: f64 = 600.0;

/// Default call time of the demo optimizer.
pub const DEFAULT_CALL_TIME: Duration = Duration::from_secs(3);

/// Most workspaces the counts remember (past it, new ones share one line).
const MAX_WORKSPACES: usize = 10_000;

/// The optimizer's state.
#[derive(Debug)]
pub struct Optimizer {
    call_ms: AtomicU64,
    failing: AtomicBool,
    counts: Mutex<Counts>,
}

#[derive(Debug, Default)]
struct Counts {
    calls: u64,
    running: u32,
    most: u32,
    workspaces: BTreeMap<String, Running>,
}

#[derive(Debug, Default, Clone, Copy)]
struct Running {
    calls: u64,
    running: u32,
    most: u32,
}

impl Optimizer {
    /// An optimizer whose calls take `call_time`.
    pub fn new(call_time: Duration) -> Arc<Self> {
        Arc::new(Optimizer {
            call_ms: AtomicU64::new(u64::try_from(call_time.as_millis()).unwrap_or(u64::MAX)),
            failing: AtomicBool::new(false),
            counts: Mutex::default(),
        })
    }

    /// Runs `calls` optimizer calls for `workspace` at once: counted while they run,
    /// `Err` when the optimizer is failing.
    pub async fn run(&self, workspace: &str, calls: u32) -> Result<(), ()> {
        {
            let mut counts = self.counts.lock();
            counts.calls += u64::from(calls);
            counts.running += calls;
            counts.most = counts.most.max(counts.running);
            let key = if counts.workspaces.len() < MAX_WORKSPACES
                || counts.workspaces.contains_key(workspace)
            {
                workspace.to_owned()
            } else {
                "(others)".to_owned()
            };
            let ws = counts.workspaces.entry(key).or_default();
            ws.calls += u64::from(calls);
            ws.running += calls;
            ws.most = ws.most.max(ws.running);
        }
        // Counted down however the call ends (the client may go away meanwhile).
        let _done = Done {
            optimizer: self,
            workspace,
            calls,
        };
        tokio::time::sleep(Duration::from_millis(self.call_ms.load(Ordering::Relaxed))).await;
        if self.failing.load(Ordering::Relaxed) {
            Err(())
        } else {
            Ok(())
        }
    }

    /// The counts as `GET /demo/optimizer` shows them.
    pub fn stats(&self) -> Value {
        let counts = self.counts.lock();
        json!({
            "call_seconds": self.call_ms.load(Ordering::Relaxed) as f64 / 1000.0,
            "failing": self.failing.load(Ordering::Relaxed),
            "calls": counts.calls,
            "running": counts.running,
            "most_at_once": counts.most,
            "workspaces": counts.workspaces.iter().map(|(name, w)| (name.clone(), json!({
                "calls": w.calls, "running": w.running, "most_at_once": w.most,
            }))).collect::<serde_json::Map<String, Value>>(),
        })
    }
}

struct Done<'a> {
    optimizer: &'a Optimizer,
    workspace: &'a str,
    calls: u32,
}

impl Drop for Done<'_> {
    fn drop(&mut self) {
        let mut counts = self.optimizer.counts.lock();
        counts.running = counts.running.saturating_sub(self.calls);
        let key = if counts.workspaces.contains_key(self.workspace) {
            self.workspace
        } else {
            "(others)"
        };
        if let Some(ws) = counts.workspaces.get_mut(key) {
            ws.running = ws.running.saturating_sub(self.calls);
        }
    }
}

/// The workspace sluice names for a request (or `-` when none).
pub(super) fn workspace_of(headers: &HeaderMap) -> String {
    headers
        .get("x-sluice-workspace")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("-")
        .to_owned()
}

/// `POST /messages/optimize`.
pub(super) async fn optimize(
    State(optimizer): State<Arc<Optimizer>>,
    headers: HeaderMap,
    body: bytes::Bytes,
) -> Response {
    let draft: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    match optimizer.run(&workspace_of(&headers), 1).await {
        Ok(()) => Json(json!({
            "optimized": draft.get("message").or_else(|| draft.get("draft")).cloned().unwrap_or(Value::Null),
            "idempotency_key": headers.get("idempotency-key").and_then(|v| v.to_str().ok()),
        }))
        .into_response(),
        Err(()) => unavailable(),
    }
}

/// The 503 of a failing optimizer.
pub(super) fn unavailable() -> Response {
    (
        StatusCode::SERVICE_UNAVAILABLE,
        Json(json!({"error": {"code": "unavailable", "message": "The optimizer is failing (demo).", "details": {}}})),
    )
        .into_response()
}

/// `GET /demo/optimizer`.
pub(super) async fn stats(State(optimizer): State<Arc<Optimizer>>) -> Json<Value> {
    Json(optimizer.stats())
}

#[derive(Debug, Deserialize)]
pub(super) struct Settings {
    failing: Option<bool>,
    seconds: Option<f64>,
}

/// `POST /demo/optimizer?failing=…&seconds=…`.
pub(super) async fn settings(
    State(optimizer): State<Arc<Optimizer>>,
    Query(settings): Query<Settings>,
) -> Response {
    if let Some(seconds) = settings.seconds {
        if !(0.0..=MAX_CALL_SECONDS).contains(&seconds) {
            return (
                StatusCode::BAD_REQUEST,
                format!("seconds must be from 0 to {MAX_CALL_SECONDS}\n"),
            )
                .into_response();
        }
        optimizer
            .call_ms
            .store((seconds * 1000.0) as u64, Ordering::Relaxed);
    }
    if let Some(failing) = settings.failing {
        optimizer.failing.store(failing, Ordering::Relaxed);
    }
    Json(optimizer.stats()).into_response()
}
