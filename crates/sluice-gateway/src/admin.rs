//! The admin listener: `GET /metrics` (Prometheus text), `GET /status` (JSON),
//! `GET /` (a self-contained dashboard that polls both every 2 s), and the monthly
//! quotas: `GET /quotas?workspace=W` and `POST /quotas/reset?workspace=W[&family=F]`
//! (only here: the gateway never serves them).

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::http::header;
use axum::response::{Html, IntoResponse, Json, Response};
use axum::routing::{get, post};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use serde::Serialize;
use tokio::net::TcpListener;

use super::metered::RequestStats;
use super::proxy::UPSTREAM_SECONDS_BUCKETS;
use super::store::AnyStore;

/// How often histograms are drained and idle metrics expired between scrapes.
const UPKEEP_INTERVAL: Duration = Duration::from_secs(5);

static PROMETHEUS: OnceLock<PrometheusHandle> = OnceLock::new();

/// Installs the Prometheus recorder as the process's global `metrics` recorder, once,
/// and returns the handle that renders it. If another recorder was installed first the
/// handle still works but sees none of the `metrics` macros' output.
pub fn install_metrics() -> &'static PrometheusHandle {
    PROMETHEUS.get_or_init(|| {
        // Both latencies are histograms with fixed buckets (not summaries): they add
        // up across replicas, and recording one costs a bucket search, not a sketch.
        let builder = PrometheusBuilder::new()
            .set_buckets_for_metric(
                Matcher::Full("sluice_upstream_seconds".to_owned()),
                UPSTREAM_SECONDS_BUCKETS,
            )
            .and_then(|b| {
                b.set_buckets_for_metric(
                    Matcher::Full("sluice_decision_seconds".to_owned()),
                    sluice_tower::DECISION_SECONDS_BUCKETS,
                )
            })
            .unwrap_or_else(|_| PrometheusBuilder::new());
        let recorder = builder.build_recorder();
        let handle = recorder.handle();
        if metrics::set_global_recorder(recorder).is_ok() {
            describe_metrics();
        }
        handle
    })
}

/// `# HELP` (and the unit) of every metric family sluice records, here and in the
/// limiter (`sluice_tower::Limiter`): a family missing here has no `# HELP` in
/// `/metrics` (the test `metrics_describe_every_sluice_family` scrapes them all).
fn describe_metrics() {
    metrics::describe_counter!(
        "sluice_requests_total",
        "Requests answered by the gateway, by HTTP status."
    );
    metrics::describe_gauge!(
        "sluice_requests_in_flight",
        "Requests received by the gateway and not yet answered."
    );
    metrics::describe_gauge!(
        "sluice_connections_open",
        "Client connections the gateway holds open, idle ones included."
    );
    metrics::describe_counter!(
        "sluice_quota_units_total",
        "Calls counted against monthly quotas, by family."
    );
    metrics::describe_histogram!(
        "sluice_upstream_seconds",
        metrics::Unit::Seconds,
        "Time from forwarding a request to the upstream's response headers, by outcome."
    );
    metrics::describe_counter!(
        "sluice_decisions_total",
        "Limiter decisions, by the request's top class and outcome (admitted, refused, error)."
    );
    metrics::describe_histogram!(
        "sluice_decision_seconds",
        metrics::Unit::Seconds,
        "Time the budget store took to decide all budgets of one request."
    );
    metrics::describe_counter!(
        "sluice_local_decisions_total",
        "Decisions made on this process's fallback store while the shared store was down (fail-open classes)."
    );
    metrics::describe_counter!(
        "sluice_refusals_total",
        "Requests refused with 429, by the budget that refused them."
    );
    metrics::describe_counter!(
        "sluice_settle_failures_total",
        "Weighted-budget charges (X-Sluice-Cost) the store could not apply after the upstream answered."
    );
    metrics::describe_gauge!(
        "sluice_lane_running",
        "Calls running through a guarded lane (single calls and batch items), by lane."
    );
    metrics::describe_gauge!(
        "sluice_lane_waiting",
        "Calls waiting in line for a guarded lane, by lane."
    );
    metrics::describe_gauge!(
        "sluice_lane_batch_running",
        "Batch items running through a guarded lane, by lane."
    );
    metrics::describe_gauge!(
        "sluice_lane_breaker_open",
        "1 while a guarded lane's breaker is open (calls refused at once), else 0."
    );
    metrics::describe_gauge!(
        "sluice_batch_queued",
        "Batch items waiting in a lane's batch queue (as its runner last saw it), by lane."
    );
    metrics::describe_counter!(
        "sluice_batch_items_total",
        "Batch items this process finished, by lane and outcome (done, failed, requeued)."
    );
    metrics::describe_counter!(
        "sluice_lane_refusals_total",
        "Calls a guarded lane refused, by lane and reason."
    );
    metrics::describe_gauge!(
        "sluice_store_degraded",
        "1 while the budget store is failing (its last decision failed), else 0."
    );
}

/// What `/status` reports about this process's wiring (fixed at start).
#[derive(Clone, Debug, Serialize)]
pub struct StatusInfo {
    /// The gateway's URL.
    pub listen: String,
    /// The admin listener's URL.
    pub admin: String,
    /// The upstream's URL.
    pub upstream: String,
    /// `"demo"` for the built-in demo upstream, `"external"` otherwise.
    pub upstream_kind: &'static str,
    /// The rate-limit profile.
    pub profile: String,
    /// The budget store.
    pub store: String,
}

/// The `/status` document.
#[derive(Clone, Debug, Serialize)]
pub struct Status {
    /// The binary's version.
    pub version: &'static str,
    /// Seconds since the process started serving.
    pub uptime_seconds: u64,
    /// Requests received by the gateway since start.
    pub requests_total: u64,
    /// Requests received and not yet answered.
    pub requests_in_flight: u64,
    /// Client connections held open, idle ones included.
    pub connections_open: u64,
    /// Addresses and settings.
    #[serde(flatten)]
    pub info: StatusInfo,
    /// The limiter's summary, `null` until a limiter is wired in.
    pub limiter: serde_json::Value,
}

/// Produces the limiter's summary for `/status` on every request.
pub type LimiterSummary = Arc<dyn Fn() -> serde_json::Value + Send + Sync>;

/// Shared state of the admin routes. Cheap to clone.
#[derive(Clone)]
pub struct AdminState {
    inner: Arc<AdminInner>,
}

#[derive(Clone)]
struct AdminInner {
    info: StatusInfo,
    started: Instant,
    requests: RequestStats,
    limiter: Option<LimiterSummary>,
    quotas: Option<sluice_tower::SharedLimiter<AnyStore>>,
}

impl std::fmt::Debug for AdminState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdminState")
            .field("info", &self.inner.info)
            .finish_non_exhaustive()
    }
}

impl AdminState {
    /// State for a gateway described by `info`, started at `started`.
    pub fn new(info: StatusInfo, started: Instant, requests: RequestStats) -> Self {
        AdminState {
            inner: Arc::new(AdminInner {
                info,
                started,
                requests,
                limiter: None,
                quotas: None,
            }),
        }
    }

    /// The same state with `summary` filling `/status`'s `limiter` field.
    #[must_use]
    pub fn with_limiter_summary(self, summary: LimiterSummary) -> Self {
        self.changed(|inner| inner.limiter = Some(summary))
    }

    /// The same state with `/quotas` answered from the current limiter's store.
    #[must_use]
    pub fn with_quotas(self, limiter: sluice_tower::SharedLimiter<AnyStore>) -> Self {
        self.changed(|inner| inner.quotas = Some(limiter))
    }

    fn changed(self, change: impl FnOnce(&mut AdminInner)) -> Self {
        let mut inner = Arc::unwrap_or_clone(self.inner);
        change(&mut inner);
        AdminState {
            inner: Arc::new(inner),
        }
    }

    /// The current `/status` document.
    pub fn status(&self) -> Status {
        let inner = &self.inner;
        Status {
            version: env!("CARGO_PKG_VERSION"),
            uptime_seconds: inner.started.elapsed().as_secs(),
            requests_total: inner.requests.total(),
            requests_in_flight: inner.requests.in_flight(),
            connections_open: inner.requests.connections_open(),
            info: inner.info.clone(),
            limiter: inner
                .limiter
                .as_ref()
                .map_or(serde_json::Value::Null, |summary| summary()),
        }
    }
}

/// The admin routes.
pub fn router(state: AdminState) -> Router {
    Router::new()
        .route("/", get(dashboard))
        .route("/metrics", get(metrics_text))
        .route("/status", get(status))
        .route("/quotas", get(quotas))
        .route("/quotas/reset", post(reset_quotas))
        .with_state(state)
}

/// Serves `router` on `listener` until `stop` resolves, running the metrics upkeep
/// alongside.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    stop: impl Future<Output = ()> + Send + 'static,
) {
    let handle = install_metrics();
    let upkeep = tokio::spawn(async move {
        let mut ticks = tokio::time::interval(UPKEEP_INTERVAL);
        loop {
            ticks.tick().await;
            handle.run_upkeep();
        }
    });
    if let Err(error) = axum::serve(listener, router)
        .with_graceful_shutdown(stop)
        .await
    {
        tracing::error!("admin listener failed: {error}");
    }
    upkeep.abort();
}

async fn metrics_text(State(state): State<AdminState>) -> Response {
    state.inner.requests.publish();
    if let Some(limiter) = &state.inner.quotas {
        for lane in limiter.load().lanes() {
            sluice_tower::publish_lane_gauges(lane);
        }
    }
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        install_metrics().render(),
    )
        .into_response()
}

async fn status(State(state): State<AdminState>) -> Json<Status> {
    Json(state.status())
}

/// The query of `/quotas` and `/quotas/reset`.
#[derive(Debug, serde::Deserialize)]
struct QuotaQuery {
    workspace: Option<String>,
    family: Option<String>,
}

async fn quotas(State(state): State<AdminState>, Query(q): Query<QuotaQuery>) -> Response {
    quota_answer(&state, q, false).await
}

async fn reset_quotas(State(state): State<AdminState>, Query(q): Query<QuotaQuery>) -> Response {
    quota_answer(&state, q, true).await
}

/// `{"workspace", "quotas": [{"family","limit","usage","resets_at"}]}`, or an error
/// envelope: 400 for a missing or unknown workspace or family, 503 when the store
/// cannot answer.
async fn quota_answer(state: &AdminState, q: QuotaQuery, reset: bool) -> Response {
    let error = |status: StatusCode, code: &str, message: String| {
        (
            status,
            Json(serde_json::json!({"error": {"code": code, "message": message, "details": {}}})),
        )
            .into_response()
    };
    let Some(limiter) = state.inner.quotas.as_ref().map(|l| l.load_full()) else {
        return error(
            StatusCode::NOT_FOUND,
            "not_found",
            "no quotas here".to_owned(),
        );
    };
    let Some(workspace) = q.workspace.filter(|w| !w.is_empty()) else {
        return error(
            StatusCode::BAD_REQUEST,
            "invalid_request",
            "`workspace` is required: /quotas?workspace=NAME (a workspace of the key table, key:<sha256 hex> or ip:<address>)".to_owned(),
        );
    };
    let answer = if reset {
        limiter.reset_quota(&workspace, q.family.as_deref()).await
    } else {
        limiter.quota_usage(&workspace).await
    };
    match answer {
        Ok(usage) => Json(serde_json::json!({
            "workspace": workspace,
            "quotas": usage.iter().map(|u| serde_json::json!({
                "family": u.family,
                "limit": u.limit,
                "usage": u.usage,
                "resets_at": sluice_tower::rfc3339(u.resets_at),
            })).collect::<Vec<_>>(),
        }))
        .into_response(),
        Err(sluice_tower::QuotaQueryError::Store(e)) => error(
            StatusCode::SERVICE_UNAVAILABLE,
            "store_unavailable",
            e.to_string(),
        ),
        Err(e) => error(StatusCode::BAD_REQUEST, "invalid_request", e.to_string()),
    }
}

async fn dashboard() -> Html<&'static str> {
    Html(DASHBOARD_HTML)
}

/// The dashboard page: no external assets, polls `/status` and `/metrics` every 2 s.
const DASHBOARD_HTML: &str = r##"<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>sluice</title>
<style>
  body { font: 14px/1.4 system-ui, sans-serif; margin: 2rem; color: #1d2330; background: #f7f8fa; }
  h1 { font-size: 1.4rem; margin: 0 0 .2rem; }
  h2 { font-size: 1rem; margin: 1.5rem 0 .5rem; }
  .muted { color: #667; }
  table { border-collapse: collapse; background: #fff; min-width: 28rem; }
  td, th { border: 1px solid #dde; padding: .3rem .6rem; text-align: left; vertical-align: top; }
  th { background: #eef0f4; font-weight: 600; }
  td.num { text-align: right; font-variant-numeric: tabular-nums; }
  pre { background: #fff; border: 1px solid #dde; padding: .6rem; max-height: 24rem; overflow: auto; }
  #state.bad { color: #b00020; }
</style>
</head>
<body>
<h1>sluice</h1>
<div class="muted">rate limiting gateway &middot; <span id="state">loading…</span></div>

<h2>Status</h2>
<table id="status"><tbody></tbody></table>

<h2>Gateway metrics</h2>
<table id="metrics"><thead><tr><th>metric</th><th>labels</th><th>value</th></tr></thead><tbody></tbody></table>

<h2>Guarded lanes</h2>
<div id="lanes" class="muted">no lanes in the policy</div>

<h2>Batch lanes</h2>
<div id="batches" class="muted">no batch lanes in the policy</div>

<h2>Monthly quotas</h2>
<form id="quota-form"><label>workspace <input id="workspace" placeholder="acme, key:…, ip:…" size="40"></label>
<button>show</button></form>
<table id="quotas"><thead><tr><th>family</th><th>usage</th><th>limit</th><th>resets at</th></tr></thead><tbody></tbody></table>

<h2>Limiter</h2>
<pre id="limiter">–</pre>

<h2>Raw /metrics</h2>
<pre id="raw"></pre>

<script>
"use strict";
function cell(row, text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  row.appendChild(td);
}
function showStatus(s) {
  const body = document.querySelector("#status tbody");
  body.replaceChildren();
  for (const [key, value] of Object.entries(s)) {
    if (key === "limiter") continue;
    const row = document.createElement("tr");
    const th = document.createElement("th");
    th.textContent = key;
    row.appendChild(th);
    cell(row, String(value));
    body.appendChild(row);
  }
  document.getElementById("limiter").textContent =
    s.limiter === null ? "no limiter wired in" : JSON.stringify(s.limiter, null, 2);
  showLanes((s.limiter && s.limiter.lanes) || []);
  showBatches((s.limiter && s.limiter.batches) || []);
}
function showBatches(batches) {
  const box = document.getElementById("batches");
  if (batches.length === 0) return;
  box.replaceChildren();
  box.className = "";
  for (const b of batches) {
    const head = document.createElement("div");
    head.textContent = b.lane + " batch lane: " + b.queued + " items queued, " + b.running +
      " running; here " + b.done_here + " done, " + b.failed_here + " failed, " +
      b.requeued_here + " sent back to the queue";
    box.appendChild(head);
    const table = document.createElement("table");
    const header = document.createElement("tr");
    for (const h of ["workspace", "queued", "running"]) {
      const th = document.createElement("th");
      th.textContent = h;
      header.appendChild(th);
    }
    table.appendChild(header);
    for (const w of b.workspaces) {
      const row = document.createElement("tr");
      cell(row, w.workspace);
      cell(row, String(w.queued), "num");
      cell(row, String(w.running), "num");
      table.appendChild(row);
    }
    box.appendChild(table);
  }
}
function showLanes(lanes) {
  const box = document.getElementById("lanes");
  if (lanes.length === 0) return;
  box.replaceChildren();
  box.className = "";
  for (const l of lanes) {
    const head = document.createElement("div");
    const breaker = l.breaker === "open"
      ? "breaker OPEN (" + Math.ceil(l.breaker_open_seconds_left) + " s left)"
      : "breaker " + l.breaker.replace("_", "-");
    head.textContent = l.lane + ": " + l.running + " of " + l.global_cap + " running (" +
      l.batch_running + " batch items, at most " + l.batch_cap + "), " + l.waiting +
      " waiting, " + breaker + ", calls take ~" + Math.round(l.expected_call_seconds) + " s";
    if (l.breaker === "open") head.style.color = "#b00020";
    box.appendChild(head);
    const table = document.createElement("table");
    const header = document.createElement("tr");
    for (const h of ["workspace", "running", "waiting", "started this window", "batch items"]) {
      const th = document.createElement("th");
      th.textContent = h;
      header.appendChild(th);
    }
    table.appendChild(header);
    for (const w of l.workspaces) {
      const row = document.createElement("tr");
      cell(row, w.workspace);
      cell(row, String(w.running), "num");
      cell(row, String(w.waiting), "num");
      cell(row, String(w.started_in_window), "num");
      cell(row, String(w.batch_running), "num");
      table.appendChild(row);
    }
    box.appendChild(table);
  }
}
function showMetrics(text) {
  document.getElementById("raw").textContent = text;
  const body = document.querySelector("#metrics tbody");
  body.replaceChildren();
  for (const line of text.split("\n")) {
    if (!line.startsWith("sluice_")) continue;
    const m = line.match(/^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)/);
    if (!m || m[1].endsWith("_bucket")) continue;
    const row = document.createElement("tr");
    cell(row, m[1]);
    cell(row, m[2] || "");
    cell(row, m[3], "num");
    body.appendChild(row);
  }
}
async function showQuotas() {
  const workspace = document.getElementById("workspace").value.trim();
  const body = document.querySelector("#quotas tbody");
  if (!workspace) { body.replaceChildren(); return; }
  const answer = await (await fetch("quotas?workspace=" + encodeURIComponent(workspace))).json();
  body.replaceChildren();
  if (answer.error) {
    const row = document.createElement("tr");
    cell(row, answer.error.message);
    body.appendChild(row);
    return;
  }
  for (const q of answer.quotas) {
    const row = document.createElement("tr");
    cell(row, q.family);
    cell(row, String(q.usage), "num");
    cell(row, q.limit === null ? "uncapped" : String(q.limit), "num");
    cell(row, q.resets_at);
    body.appendChild(row);
  }
}
document.getElementById("quota-form").addEventListener("submit", (e) => { e.preventDefault(); showQuotas(); });
async function refresh() {
  const state = document.getElementById("state");
  try {
    const [status, metrics] = await Promise.all([fetch("status"), fetch("metrics")]);
    showStatus(await status.json());
    showMetrics(await metrics.text());
    await showQuotas();
    state.textContent = "updated " + new Date().toLocaleTimeString();
    state.className = "";
  } catch (e) {
    state.textContent = "unreachable: " + e;
    state.className = "bad";
  }
}
refresh();
setInterval(refresh, 2000);
</script>
</body>
</html>
"##;
