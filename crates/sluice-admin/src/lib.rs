//! The admin room of sluice: what the admin listener serves, apart from the
//! gateway's request paths.
//!
//! - `GET /metrics` (Prometheus text; [`install_metrics`] installs the recorder and
//!   describes every metric family sluice records);
//! - `GET /status` (JSON, [`Status`]) and `GET /` (a self-contained dashboard that
//!   polls `GET /dashboard.json` every second);
//! - the monthly quotas: `GET /quotas?workspace=W` and
//!   `POST /quotas/reset?workspace=W[&family=F]` (only here: the gateway never serves
//!   them);
//! - what LLM calls spent: `GET /usage?workspace=W[&month=YYYY-MM]` (SPEC T6), this
//!   month or one of the twelve before it;
//! - the usage export for billing: `GET /usage/export?month=YYYY-MM` (SPEC O4),
//!   JSON lines per workspace, day and model, streamed;
//! - the tenants API (`/tenants…`, see [`tenants`]): workspaces and credentials
//!   changed at run time.
//!
//! [`router`] and [`tenants::router`] give the routes, [`serve`] serves them; the
//! gateway (sluice-gateway) binds the listener, puts its door in front and passes in
//! what the routes read: the limiter, and the request counts ([`RequestCounts`]).
//!
//! The dashboard's charts read a history the admin side keeps itself: one
//! [`Sample`] every [`SAMPLE_INTERVAL`], the last [`HISTORY_SAMPLES`] of them (ten
//! minutes) in a ring, so its memory is bounded whatever the traffic.

mod query;
mod recorder;
pub mod tenants;

pub use recorder::{install_metrics, render_metrics};

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::http::header;
use axum::response::{Html, IntoResponse, Json, Response};
use axum::routing::{get, post};
use serde::Serialize;
use tokio::net::TcpListener;

use sluice_store::BudgetStore;

use crate::query::Query;

/// The gateway's request counters, as `/status`, `/metrics` and the dashboard read
/// them (the gateway's per-worker counters implement it).
pub trait RequestCounts: Send + Sync + 'static {
    /// Requests received since start.
    fn total(&self) -> u64;
    /// Requests received whose response headers have not been produced yet.
    fn in_flight(&self) -> u64;
    /// Client connections held open now.
    fn connections_open(&self) -> u64;
    /// Sets the gauges these counts feed, before `/metrics` is rendered.
    fn publish(&self);
}

/// How often histograms are drained and idle metrics expired between scrapes.
const UPKEEP_INTERVAL: Duration = Duration::from_secs(5);

/// What `/status` reports about this process's wiring (fixed at start).
#[derive(Clone, Debug, Serialize)]
pub struct StatusInfo {
    /// The gateway's URL (empty without a gateway: `sluice rls`).
    pub listen: String,
    /// The admin listener's URL.
    pub admin: String,
    /// The upstream's URL (empty without a gateway: `sluice rls`).
    pub upstream: String,
    /// `"demo"` for the built-in demo upstream, `"external"` for another, `"none"`
    /// without a gateway.
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

/// Shared state of the admin routes, over a limiter on a store `S`. Cheap to clone.
pub struct AdminState<S> {
    inner: Arc<AdminInner<S>>,
}

impl<S> Clone for AdminState<S> {
    fn clone(&self) -> Self {
        AdminState {
            inner: Arc::clone(&self.inner),
        }
    }
}

struct AdminInner<S> {
    info: StatusInfo,
    started: Instant,
    requests: Arc<dyn RequestCounts>,
    limiter: Option<LimiterSummary>,
    quotas: Option<sluice_edge::SharedLimiter<S>>,
    history: Arc<Mutex<History>>,
    /// The dashboard's quota table and when it was read (see [`QUOTAS_MAX_AGE`]).
    quota_table: Arc<Mutex<Option<(Instant, serde_json::Value)>>>,
    /// The dashboard's LLM usage table and when it was read (see [`USAGE_MAX_AGE`]).
    usage_table: Arc<Mutex<Option<(Instant, serde_json::Value)>>>,
}

/// How often the dashboard's history takes a sample.
pub const SAMPLE_INTERVAL: Duration = Duration::from_secs(1);

/// Samples the dashboard's history keeps: ten minutes at one a second. A sample is
/// about a hundred bytes, so the ring holds about 60 KB at most.
pub const HISTORY_SAMPLES: usize = 600;

/// Most workspaces the dashboard's quota table shows (the key table's first, then
/// the top callers'), and how long one reading of it is served again: every open
/// dashboard asks every second, the store is asked at most this often.
pub const QUOTA_WORKSPACES: usize = 12;
const QUOTAS_MAX_AGE: Duration = Duration::from_secs(2);

/// Most workspaces whose LLM usage the dashboard reads (the key table's first,
/// then the top callers'), of which it shows the [`USAGE_WORKSPACES`] that spent
/// most this month. Each costs a store call for every twelve counts (four per
/// model of the policy's `prices:`, and four for `other`).
pub const USAGE_CANDIDATES: usize = 32;

/// Most workspaces the dashboard's LLM usage chart shows: those that spent most
/// this month (money, then tokens) of the [`USAGE_CANDIDATES`] read.
pub const USAGE_WORKSPACES: usize = 10;

/// How long one reading of the dashboard's LLM usage is served again: the store
/// is asked at most this often, however many dashboards are open, and never when
/// none is.
pub const USAGE_MAX_AGE: Duration = Duration::from_secs(5);

/// One class in one [`Sample`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ClassSample {
    /// Requests admitted in the interval.
    pub admitted: u64,
    /// Requests refused in the interval.
    pub refused: u64,
    /// Units of the class spent in the interval.
    pub units: u64,
    /// The fullest budget of the class a caller had at the sample, in thousandths
    /// of its limit (see [`sluice_edge::ClassTally::fill_permille`]).
    pub fill_permille: u16,
}

/// What happened in one [`SAMPLE_INTERVAL`] (counts are of the interval that ends
/// at `at`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Sample {
    /// Its number: samples are numbered from 1 in the order taken.
    pub seq: u64,
    /// When it was taken (Unix seconds).
    pub at: u64,
    /// Requests the gateway received.
    pub requests: u64,
    /// Per class, in the policy's order (`/status`'s `class_names`).
    pub classes: Vec<ClassSample>,
    /// Decisions made on the fallback store (the shared store down, fail-open).
    pub local_decisions: u64,
    /// The store was failing when the sample was taken.
    pub degraded: bool,
    /// Requests in flight when the sample was taken.
    pub in_flight: u64,
}

/// The dashboard's ring of samples, and the totals the next one counts from.
#[derive(Debug, Default)]
struct History {
    samples: VecDeque<Sample>,
    last_seq: u64,
    last: Option<(u64, sluice_edge::Tally)>,
}

impl History {
    /// Adds a sample from the totals `requests` and `tally` read at `at`.
    fn push(
        &mut self,
        at: u64,
        requests: u64,
        tally: sluice_edge::Tally,
        degraded: bool,
        in_flight: u64,
    ) {
        let classes = tally
            .classes
            .iter()
            .map(|now| {
                // The same class before, by name: a reload may change the classes.
                let before = self
                    .last
                    .as_ref()
                    .and_then(|(_, t)| t.classes.iter().find(|c| c.name == now.name));
                let delta = |f: fn(&sluice_edge::ClassTally) -> u64| {
                    f(now).saturating_sub(before.map_or(0, f))
                };
                ClassSample {
                    admitted: delta(|c| c.admitted),
                    refused: delta(|c| c.refused),
                    units: delta(|c| c.units),
                    fill_permille: now.fill_permille,
                }
            })
            .collect();
        let (requests_before, local_before) = self
            .last
            .as_ref()
            .map_or((0, 0), |(r, t)| (*r, t.local_decisions));
        self.last_seq += 1;
        if self.samples.len() == HISTORY_SAMPLES {
            self.samples.pop_front();
        }
        self.samples.push_back(Sample {
            seq: self.last_seq,
            at,
            requests: requests.saturating_sub(requests_before),
            classes,
            local_decisions: tally.local_decisions.saturating_sub(local_before),
            degraded,
            in_flight,
        });
        self.last = Some((requests, tally));
    }

    /// The samples after `since`, oldest first.
    fn since(&self, since: u64) -> Vec<Sample> {
        let first = self.samples.partition_point(|s| s.seq <= since);
        self.samples.range(first..).cloned().collect()
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

// By hand: a derived `Clone` would ask `S: Clone`.
impl<S> Clone for AdminInner<S> {
    fn clone(&self) -> Self {
        AdminInner {
            info: self.info.clone(),
            started: self.started,
            requests: Arc::clone(&self.requests),
            limiter: self.limiter.clone(),
            quotas: self.quotas.clone(),
            history: Arc::clone(&self.history),
            quota_table: Arc::clone(&self.quota_table),
            usage_table: Arc::clone(&self.usage_table),
        }
    }
}

impl<S> std::fmt::Debug for AdminState<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdminState")
            .field("info", &self.inner.info)
            .finish_non_exhaustive()
    }
}

impl<S: BudgetStore + 'static> AdminState<S> {
    /// State for a gateway described by `info`, started at `started`, counting its
    /// requests in `requests`.
    pub fn new(info: StatusInfo, started: Instant, requests: impl RequestCounts) -> Self {
        AdminState {
            inner: Arc::new(AdminInner {
                info,
                started,
                requests: Arc::new(requests),
                limiter: None,
                quotas: None,
                history: Arc::default(),
                quota_table: Arc::default(),
                usage_table: Arc::default(),
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
    pub fn with_quotas(self, limiter: sluice_edge::SharedLimiter<S>) -> Self {
        self.changed(|inner| inner.quotas = Some(limiter))
    }

    fn changed(self, change: impl FnOnce(&mut AdminInner<S>)) -> Self {
        let mut inner = Arc::unwrap_or_clone(self.inner);
        change(&mut inner);
        AdminState {
            inner: Arc::new(inner),
        }
    }

    /// Takes one sample of the dashboard's history now (the sampler calls it every
    /// [`SAMPLE_INTERVAL`]; a state without a limiter keeps no history).
    pub fn sample(&self) {
        let Some(limiter) = &self.inner.quotas else {
            return;
        };
        let limiter = limiter.load();
        let now = unix_now();
        let tally = limiter.tally(now);
        self.inner.history.lock().push(
            now,
            self.inner.requests.total(),
            tally,
            limiter.is_degraded(),
            self.inner.requests.in_flight(),
        );
    }

    /// Samples the history every [`SAMPLE_INTERVAL`] until `stop` resolves.
    pub async fn keep_history(self, stop: impl Future<Output = ()>) {
        let mut ticks = tokio::time::interval(SAMPLE_INTERVAL);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let sampling = async {
            loop {
                ticks.tick().await;
                self.sample();
            }
        };
        tokio::select! {
            () = sampling => {}
            () = stop => {}
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
pub fn router<S: BudgetStore + 'static>(state: AdminState<S>) -> Router {
    Router::new()
        .route("/", get(dashboard))
        .route("/metrics", get(metrics_text::<S>))
        .route("/status", get(status::<S>))
        .route("/dashboard.json", get(dashboard_json::<S>))
        .route("/quotas", get(quotas::<S>))
        .route("/quotas/reset", post(reset_quotas::<S>))
        .route("/usage", get(llm_usage::<S>))
        .route("/usage/export", get(usage_export::<S>))
        .route("/runs", get(runs::<S>))
        .with_state(state)
}

/// Serves `router` on `listener` until `stop` resolves, running the metrics upkeep
/// alongside, within [`sluice_door::ADMIN_BOUNDS`] (256 connections, a request
/// head within 10 s).
pub async fn serve(
    listener: TcpListener,
    router: Router,
    stop: impl Future<Output = ()> + Send + 'static,
) {
    serve_over(listener, router, None, stop).await;
}

/// As [`serve`], over TLS when `tls` is given (`--admin-tls-cert`, SPEC O5).
pub async fn serve_over(
    listener: TcpListener,
    router: Router,
    tls: Option<tokio_rustls::TlsAcceptor>,
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
    sluice_door::serve_over(listener, router, sluice_door::ADMIN_BOUNDS, tls, stop).await;
    upkeep.abort();
}

async fn metrics_text<S: BudgetStore + 'static>(State(state): State<AdminState<S>>) -> Response {
    state.inner.requests.publish();
    if let Some(limiter) = &state.inner.quotas {
        for lane in limiter.load().lanes() {
            sluice_edge::publish_lane_gauges(lane);
        }
    }
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        render_metrics(),
    )
        .into_response()
}

async fn status<S: BudgetStore + 'static>(State(state): State<AdminState<S>>) -> Json<Status> {
    Json(state.status())
}

/// The query of `/quotas` and `/quotas/reset`.
#[derive(Debug, serde::Deserialize)]
struct QuotaQuery {
    workspace: Option<String>,
    family: Option<String>,
}

/// The error envelope of an admin answer: `{"error": {"code", "message", "details"}}`.
fn error(status: StatusCode, code: &str, message: String) -> Response {
    (
        status,
        Json(serde_json::json!({"error": {"code": code, "message": message, "details": {}}})),
    )
        .into_response()
}

/// The answer to a quota or usage query that failed: 503 when the store could
/// not answer, else 400.
fn query_error(e: &sluice_edge::QuotaQueryError) -> Response {
    match e {
        sluice_edge::QuotaQueryError::Store(e) => error(
            StatusCode::SERVICE_UNAVAILABLE,
            "store_unavailable",
            e.to_string(),
        ),
        e => error(StatusCode::BAD_REQUEST, "invalid_request", e.to_string()),
    }
}

/// The limiter `/usage` and `/usage/export` read, or their 404 where there is none.
// The error is the admin call's whole answer, made once per call.
#[allow(clippy::result_large_err)]
fn usage_limiter<S: BudgetStore + 'static>(
    state: &AdminState<S>,
) -> Result<std::sync::Arc<sluice_edge::Limiter<S>>, Response> {
    state
        .inner
        .quotas
        .as_ref()
        .map(|l| l.load_full())
        .ok_or_else(|| {
            error(
                StatusCode::NOT_FOUND,
                "not_found",
                "no usage here".to_owned(),
            )
        })
}

/// The month a usage query names (`None`: the current one), or its 400.
// The error is the admin call's whole answer, made once per call.
#[allow(clippy::result_large_err)]
fn month_asked(month: Option<&str>) -> Result<Option<sluice_edge::UsageMonth>, Response> {
    month
        .map(str::parse)
        .transpose()
        .map_err(|e| query_error(&sluice_edge::QuotaQueryError::Month(e)))
}

/// The query of `/usage`.
#[derive(Debug, serde::Deserialize)]
struct UsageQuery {
    workspace: Option<String>,
    month: Option<String>,
}

/// `GET /usage?workspace=W[&month=YYYY-MM]` (SPEC T6): what the workspace's LLM
/// calls spent in a calendar month (the current one without `month`), tokens and
/// US dollars, in all and by model (see
/// [`Limiter::llm_usage`](sluice_edge::Limiter::llm_usage)). The current month and
/// the [`USAGE_MONTHS_KEPT`](sluice_edge::USAGE_MONTHS_KEPT) before it are kept; a
/// month that does not read as `YYYY-MM`, one after the current month or one no
/// longer kept is 400.
async fn llm_usage<S: BudgetStore + 'static>(
    State(state): State<AdminState<S>>,
    Query(q): Query<UsageQuery>,
) -> Response {
    let limiter = match usage_limiter(&state) {
        Ok(limiter) => limiter,
        Err(answer) => return answer,
    };
    let Some(workspace) = q.workspace.filter(|w| !w.is_empty()) else {
        return error(
            StatusCode::BAD_REQUEST,
            "invalid_request",
            "`workspace` is required: /usage?workspace=NAME[&month=YYYY-MM]".to_owned(),
        );
    };
    let month = match month_asked(q.month.as_deref()) {
        Ok(month) => month,
        Err(answer) => return answer,
    };
    match limiter.llm_usage(&workspace, month).await {
        Ok(usage) => Json(usage).into_response(),
        Err(e) => query_error(&e),
    }
}

/// The query of `/usage/export`.
#[derive(Debug, serde::Deserialize)]
struct ExportQuery {
    month: Option<String>,
}

/// `GET /usage/export?month=YYYY-MM` (SPEC O4): every workspace's usage of the
/// month, one JSON line per workspace, day (UTC) and model — `calls`,
/// `quota_units` by family, `tokens` by direction, `spend_units` (1e-5 USD) and
/// `spend_usd` — as `application/x-ndjson`, streamed a page of
/// [`EXPORT_PAGE`](sluice_edge::EXPORT_PAGE) rows at a time (see
/// [`UsageExport`](sluice_edge::UsageExport); at most
/// [`MAX_USAGE_ROWS`](sluice_edge::MAX_USAGE_ROWS) rows a month, then overflow
/// rows). Without `month`, the current one. A month that does not read as
/// `YYYY-MM`, one after the current month or one no longer kept is 400; a month
/// with no usage is an empty 200. A store that cannot answer is 503 before the
/// first line, and ends the body early (an error the client sees) after it.
async fn usage_export<S: BudgetStore + 'static>(
    State(state): State<AdminState<S>>,
    Query(q): Query<ExportQuery>,
) -> Response {
    let limiter = match usage_limiter(&state) {
        Ok(limiter) => limiter,
        Err(answer) => return answer,
    };
    let month = match month_asked(q.month.as_deref()) {
        Ok(month) => month,
        Err(answer) => return answer,
    };
    let month = match limiter.usage_export_month(month).await {
        Ok(month) => month,
        Err(e) => return query_error(&e),
    };
    let mut export = sluice_edge::UsageExport::new(month);
    // The first page before the answer's head: a store that cannot answer is 503.
    let first = match limiter.usage_export_page(&mut export).await {
        Ok(lines) => lines.unwrap_or_default(),
        Err(e) => return query_error(&e),
    };
    let rest = futures_util::stream::unfold(Some((limiter, export)), |state| async move {
        let (limiter, mut export) = state?;
        match limiter.usage_export_page(&mut export).await {
            Ok(Some(lines)) => Some((Ok(lines), Some((limiter, export)))),
            Ok(None) => None,
            Err(e) => {
                tracing::warn!(month = %export.month(), error = %e, "usage export cut short: the store did not answer");
                Some((Err(std::io::Error::other(e.to_string())), None))
            }
        }
    });
    let body = futures_util::StreamExt::chain(
        futures_util::stream::once(std::future::ready(Ok::<_, std::io::Error>(first))),
        rest,
    );
    (
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        axum::body::Body::from_stream(body),
    )
        .into_response()
}

#[derive(Debug, serde::Deserialize)]
struct RunsQuery {
    near: Option<f64>,
}

/// The most runs `GET /runs` and the dashboard list.
const RUNS_LISTED: usize = 100;

/// `GET /runs[?near=R]` (SPEC T7): the agent runs this replica decided turns of
/// lately with at most the share `R` (default 0.2) of their turns left, those
/// with the fewest first (paused ones at the top), at most [`RUNS_LISTED`].
async fn runs<S: BudgetStore + 'static>(
    State(state): State<AdminState<S>>,
    Query(q): Query<RunsQuery>,
) -> Response {
    let Some(limiter) = state.inner.quotas.as_ref().map(|l| l.load_full()) else {
        return error(
            StatusCode::NOT_FOUND,
            "not_found",
            "no runs here".to_owned(),
        );
    };
    let near = match q.near {
        None => NEAR_TURN_BUDGET,
        Some(r) if (0.0..=1.0).contains(&r) => r,
        Some(_) => {
            return error(
                StatusCode::BAD_REQUEST,
                "invalid_request",
                "`near` is a share of a run's turns, 0 to 1".to_owned(),
            );
        }
    };
    Json(limiter.recent_runs(near, RUNS_LISTED)).into_response()
}

/// The share of its turns left under which a run is near its budget.
const NEAR_TURN_BUDGET: f64 = 0.2;

async fn quotas<S: BudgetStore + 'static>(
    State(state): State<AdminState<S>>,
    Query(q): Query<QuotaQuery>,
) -> Response {
    quota_answer(&state, q, false).await
}

async fn reset_quotas<S: BudgetStore + 'static>(
    State(state): State<AdminState<S>>,
    entrant: Option<axum::Extension<sluice_door::Entrant>>,
    Query(q): Query<QuotaQuery>,
) -> Response {
    let who = entrant.map_or_else(|| "unknown".to_owned(), |e| e.0.to_string());
    let workspace = q.workspace.clone();
    let family = q.family.clone();
    let before = match (&state.inner.quotas, &workspace) {
        (Some(limiter), Some(w)) => limiter.load().quota_usage(w).await.ok(),
        _ => None,
    };
    let answer = quota_answer(&state, q, true).await;
    if answer.status().is_success() {
        let usage = |u: &[sluice_edge::QuotaUsage]| {
            u.iter()
                .filter(|q| family.as_deref().is_none_or(|f| f == q.family))
                .map(|q| format!("{}={}", q.family, q.usage))
                .collect::<Vec<_>>()
                .join(",")
        };
        tracing::info!(
            target: "sluice::audit",
            who = %who,
            what = "quota reset",
            workspace = workspace.as_deref().unwrap_or(""),
            family = family.as_deref().unwrap_or("*"),
            before = %before.as_deref().map_or_else(String::new, usage),
            after = "0",
            "admin change"
        );
    }
    answer
}

/// `{"workspace", "quotas": [{"family","limit","usage","resets_at"}]}`, or an error
/// envelope: 400 for a missing or unknown workspace or family, 503 when the store
/// cannot answer.
async fn quota_answer<S: BudgetStore + 'static>(
    state: &AdminState<S>,
    q: QuotaQuery,
    reset: bool,
) -> Response {
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
        Ok(usage) => Json(usage_json(&workspace, &usage)).into_response(),
        Err(e) => query_error(&e),
    }
}

async fn dashboard() -> Response {
    (
        [
            (header::CACHE_CONTROL, "no-store"),
            // Everything the page needs is inline; it may fetch only its own origin.
            (
                header::CONTENT_SECURITY_POLICY,
                "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; \
                 connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'",
            ),
        ],
        Html(DASHBOARD_HTML),
    )
        .into_response()
}

/// The query of `/dashboard.json`.
#[derive(Debug, serde::Deserialize)]
struct DashboardQuery {
    /// Only samples after this one (`seq` of the last sample the page has).
    since: Option<u64>,
}

/// `GET /dashboard.json[?since=SEQ]`: what the dashboard shows, in one answer —
/// `status` (the `/status` document), `samples` (the history after `since`, see
/// [`Sample`]; `last_seq` is the newest sample's number, lower than `since` after
/// a restart), `tally` (counts since start: classes, refusals by reason, lane
/// refusals, fail-open decisions), `quotas` (per workspace, `null` when the
/// policy has no quota families) and `llm_usage` (tokens and money this month
/// per workspace, see [`USAGE_WORKSPACES`]; `null` when the policy has no LLM
/// route) and `runs` (agent runs at or near their turn budget; `null` when runs
/// are not counted).
async fn dashboard_json<S: BudgetStore + 'static>(
    State(state): State<AdminState<S>>,
    Query(q): Query<DashboardQuery>,
) -> Response {
    let status = state.status();
    let (samples, last_seq) = {
        let history = state.inner.history.lock();
        (history.since(q.since.unwrap_or(0)), history.last_seq)
    };
    let tally = state
        .inner
        .quotas
        .as_ref()
        .map(|limiter| tally_json(&limiter.load().tally(unix_now())));
    let quotas = quota_table(&state, &status.limiter).await;
    let llm_usage = usage_table(&state, &status.limiter).await;
    // Agent runs at or near their turn budget (SPEC T7), when runs are counted.
    let runs = state.inner.quotas.as_ref().and_then(|l| {
        let limiter = l.load();
        limiter
            .policy()
            .turns
            .enabled
            .then(|| limiter.recent_runs(NEAR_TURN_BUDGET, 20)["runs"].clone())
    });
    (
        [(header::CACHE_CONTROL, "no-store")],
        Json(serde_json::json!({
            "sample_interval_seconds": SAMPLE_INTERVAL.as_secs(),
            "history_samples": HISTORY_SAMPLES,
            "last_seq": last_seq,
            "status": status,
            "samples": samples,
            "tally": tally,
            "quotas": quotas,
            "llm_usage": llm_usage,
            "runs": runs,
        })),
    )
        .into_response()
}

fn tally_json(t: &sluice_edge::Tally) -> serde_json::Value {
    serde_json::json!({
        "classes": t.classes.iter().map(|c| serde_json::json!({
            "class": c.name,
            "limit": c.limit,
            "admitted": c.admitted,
            "refused": c.refused,
            "errors": c.errors,
            "units": c.units,
            "fill_permille": c.fill_permille,
        })).collect::<Vec<_>>(),
        "refusals": t.refusals.iter().map(|(reason, count)| serde_json::json!({
            "reason": reason, "count": count,
        })).collect::<Vec<_>>(),
        "lane_refusals": t.lane_refusals.iter().map(|(lane, reason, count)| serde_json::json!({
            "lane": lane, "reason": reason, "count": count,
        })).collect::<Vec<_>>(),
        "shadow_refusals": t.shadow_refusals.iter().map(|(budget, reason, count)| serde_json::json!({
            "budget": budget, "reason": reason, "count": count,
        })).collect::<Vec<_>>(),
        "local_decisions": t.local_decisions,
        "leases": serde_json::to_value(t.leases).unwrap_or_default(),
        "near_limit": t.near_limit.iter().map(|(budget, count)| serde_json::json!({
            "budget": budget, "count": count,
        })).collect::<Vec<_>>(),
    })
}

/// A workspace's quota usage as `/quotas` and the dashboard show it.
fn usage_json(workspace: &str, usage: &[sluice_edge::QuotaUsage]) -> serde_json::Value {
    serde_json::json!({
        "workspace": workspace,
        "quotas": usage.iter().map(|u| serde_json::json!({
            "family": u.family,
            "limit": u.limit,
            "usage": u.usage,
            "resets_at": sluice_edge::rfc3339(u.resets_at),
        })).collect::<Vec<_>>(),
    })
}

/// Quota usage of the key table's workspaces and the top callers' (at most
/// [`QUOTA_WORKSPACES`]), read at most every [`QUOTAS_MAX_AGE`]; `null` without
/// quota families.
async fn quota_table<S: BudgetStore + 'static>(
    state: &AdminState<S>,
    summary: &serde_json::Value,
) -> serde_json::Value {
    let Some(limiter) = &state.inner.quotas else {
        return serde_json::Value::Null;
    };
    let limiter = limiter.load_full();
    if limiter.policy().quotas.is_empty() {
        return serde_json::Value::Null;
    }
    if let Some((read_at, table)) = &*state.inner.quota_table.lock()
        && read_at.elapsed() < QUOTAS_MAX_AGE
    {
        return table.clone();
    }
    let workspaces = dashboard_workspaces(limiter.policy(), summary, QUOTA_WORKSPACES);
    let mut table = Vec::with_capacity(workspaces.len());
    for workspace in workspaces {
        let row = match limiter.quota_usage(&workspace).await {
            Ok(usage) => usage_json(&workspace, &usage),
            Err(e) => serde_json::json!({"workspace": workspace, "error": e.to_string()}),
        };
        table.push(row);
    }
    let table = serde_json::Value::Array(table);
    *state.inner.quota_table.lock() = Some((Instant::now(), table.clone()));
    table
}

/// The workspaces the dashboard reads: the key table's (in name order), then the
/// current window's top callers' (from the `/status` summary), at most `max`.
fn dashboard_workspaces(
    policy: &sluice_policy::Policy,
    summary: &serde_json::Value,
    max: usize,
) -> Vec<String> {
    let mut known: Vec<&str> = policy
        .identity
        .keys
        .values()
        .map(|p| p.workspace.as_str())
        .collect();
    known.sort_unstable();
    let callers = summary["top_callers"].as_array().into_iter().flatten();
    let mut workspaces: Vec<String> = Vec::new();
    for w in known
        .into_iter()
        .chain(callers.filter_map(|c| c["workspace"].as_str()))
    {
        if workspaces.len() == max {
            break;
        }
        if !workspaces.iter().any(|seen| seen == w) {
            workspaces.push(w.to_owned());
        }
    }
    workspaces
}

/// True when the policy has LLM calls to count: a route that speaks an LLM API,
/// or a token or money budget.
fn counts_llm_usage(policy: &sluice_policy::Policy) -> bool {
    policy.routes.iter().any(|r| r.llm.is_some())
        || policy.buckets.iter().any(|b| b.tokens.is_some())
}

/// The LLM usage of this month of the [`USAGE_WORKSPACES`] workspaces that spent
/// most, of the [`USAGE_CANDIDATES`] read (see [`dashboard_workspaces`]), read at
/// most every [`USAGE_MAX_AGE`]: `{"month", "read", "workspaces": [{"workspace",
/// "tokens": {"input","cached_input","output"}, "spend_usd"}]}`, most spent first
/// (workspaces that spent nothing left out); `null` when the policy has no LLM
/// route.
async fn usage_table<S: BudgetStore + 'static>(
    state: &AdminState<S>,
    summary: &serde_json::Value,
) -> serde_json::Value {
    let Some(limiter) = &state.inner.quotas else {
        return serde_json::Value::Null;
    };
    let limiter = limiter.load_full();
    if !counts_llm_usage(limiter.policy()) {
        return serde_json::Value::Null;
    }
    if let Some((read_at, table)) = &*state.inner.usage_table.lock()
        && read_at.elapsed() < USAGE_MAX_AGE
    {
        return table.clone();
    }
    let workspaces = dashboard_workspaces(limiter.policy(), summary, USAGE_CANDIDATES);
    let read = workspaces.len();
    let mut month = serde_json::Value::Null;
    let mut rows: Vec<(f64, u64, serde_json::Value)> = Vec::with_capacity(read);
    let mut errors = Vec::new();
    for workspace in workspaces {
        match limiter.llm_usage(&workspace, None).await {
            Ok(usage) => {
                month = usage["month"].clone();
                let tokens = &usage["tokens"];
                let total: u64 = ["input", "cached_input", "output"]
                    .iter()
                    .filter_map(|d| tokens[d].as_u64())
                    .sum();
                let spend = usage["spend_usd"].as_f64().unwrap_or(0.0);
                if total > 0 || spend > 0.0 {
                    rows.push((
                        spend,
                        total,
                        serde_json::json!({
                            "workspace": workspace,
                            "tokens": tokens,
                            "spend_usd": spend,
                        }),
                    ));
                }
            }
            Err(e) => {
                errors.push(serde_json::json!({"workspace": workspace, "error": e.to_string()}))
            }
        }
    }
    rows.sort_by(|a, b| b.0.total_cmp(&a.0).then(b.1.cmp(&a.1)));
    rows.truncate(USAGE_WORKSPACES);
    let table = serde_json::json!({
        "month": month,
        "read": read,
        "workspaces": rows.into_iter().map(|(_, _, row)| row).collect::<Vec<_>>(),
        "errors": errors.into_iter().take(1).collect::<Vec<_>>(),
    });
    *state.inner.usage_table.lock() = Some((Instant::now(), table.clone()));
    table
}

/// The dashboard page: one file, no external assets (inline CSS, JS and SVG); it
/// polls `dashboard.json` every second.
const DASHBOARD_HTML: &str = include_str!("dashboard.html");

#[cfg(test)]
mod tests {
    use sluice_store::{LocalStore, MemoryConfig, MemoryStore};

    use super::*;

    /// Counts that stay at zero: these tests read the limiter's tally only.
    struct NoRequests;

    impl RequestCounts for NoRequests {
        fn total(&self) -> u64 {
            0
        }
        fn in_flight(&self) -> u64 {
            0
        }
        fn connections_open(&self) -> u64 {
            0
        }
        fn publish(&self) {}
    }

    fn state() -> AdminState<LocalStore> {
        state_of(sluice_policy::default_policy().expect("default policy"))
    }

    /// An LLM route with a price, and the key table's workspaces `alpha`
    /// (`alpha-key`) and `beta` (`beta-key`).
    const LLM_POLICY: &str = r#"
profile: default
window_seconds: 3600
profiles:
  default:
    classes: { llm: 1000000 }
identity:
  credentials: [bearer]
  keys:
    - { sha256: 677509799af78b2efa2f2af71d0f906e0a0c50c048efd3b515625f788e92b99a, workspace: alpha, user: a }
    - { sha256: 7a3d637bc601f7000cc2c33141c8c8a7554e02e319fa8b293a0c88c613b77620, workspace: beta, user: b }
tokens:
  team: { per: caller, limit: 1000000, window_seconds: 3600 }
prices:
  - { model: "gpt-4o*", input: 2.5, output: 10, cached_input: 1.25 }
routes:
  - { method: POST, path: /v1/chat/completions, class: llm, llm: openai, tokens: [team] }
  - { class: llm }
"#;

    fn state_of(policy: sluice_policy::Policy) -> AdminState<LocalStore> {
        let store = LocalStore::new(
            MemoryStore::with_clock(MemoryConfig::default(), sluice_core::SystemClock::default()),
            None,
        );
        let limiter = Arc::new(sluice_edge::arc_swap::ArcSwap::from_pointee(
            sluice_edge::Limiter::new(policy, store),
        ));
        let info = StatusInfo {
            listen: String::new(),
            admin: String::new(),
            upstream: String::new(),
            upstream_kind: "external",
            profile: "production".to_owned(),
            store: "memory".to_owned(),
        };
        AdminState::new(info, Instant::now(), NoRequests).with_quotas(limiter)
    }

    /// One chat call as `key` of `model`, admitted and settled at `output` output
    /// tokens (and 10 input).
    async fn llm_call(state: &AdminState<LocalStore>, key: &str, model: &str, output: u32) {
        let Some(limiter) = state.inner.quotas.as_ref().map(|l| l.load_full()) else {
            panic!("a limiter");
        };
        let mut headers = http::HeaderMap::new();
        let bearer = format!("Bearer {key}");
        headers.insert(
            "authorization",
            http::HeaderValue::from_str(&bearer).expect("ascii"),
        );
        let path = "/v1/chat/completions";
        let route = limiter.route_head(
            &http::Method::POST,
            http::Version::HTTP_2,
            [],
            Ok(path),
            Some(&headers),
        );
        let mut intake = limiter.intake(route, [127, 0, 0, 1].into());
        intake.set_path(path);
        let body = serde_json::json!({"model": model, "max_tokens": 100,
            "messages": [{"role": "user", "content": "hi"}]})
        .to_string();
        let forward = match intake
            .planned(&headers, None, Some(body.as_bytes()))
            .admit(None)
            .await
        {
            Ok(forward) => forward,
            Err(answer) => panic!("{key} {model}: refused {}", answer.status()),
        };
        let (plan, decision) = forward.settlement().expect("an LLM call");
        let usage = sluice_tokens::Usage {
            prompt: 10,
            completion: output,
            cached_input: 0,
            rate_exempt_input: 0,
        };
        limiter
            .settle_usage(&plan, decision, Some(usage), false)
            .await;
    }

    #[tokio::test]
    async fn t6_the_dashboard_shows_llm_usage_per_workspace_most_spent_first_only_for_llm_policies()
    {
        let plain = state();
        assert_eq!(
            usage_table(&plain, &serde_json::Value::Null).await,
            serde_json::Value::Null,
            "no LLM route: no usage section"
        );
        let state = state_of(
            sluice_policy::parse_str(LLM_POLICY, std::path::Path::new("llm.yaml"))
                .expect("the test policy"),
        );
        // beta spends more than alpha; an unknown key spends most tokens (of a
        // model with no price) but is neither in the key table nor a top caller,
        // so it is not read.
        llm_call(&state, "alpha-key", "gpt-4o", 100).await;
        llm_call(&state, "beta-key", "gpt-4o", 1000).await;
        llm_call(&state, "beta-key", "gpt-4o-mini", 1000).await;
        for _ in 0..3 {
            llm_call(&state, "other-key", "llama-3", 2000).await;
        }
        let own = "key:0d8b9d4f6a0c8b8f2b7e6d1b0c7f1d1f4e7a3b6c0e2d9f8a7b6c5d4e3f2a1b0c";
        let summary = serde_json::json!({"top_callers": [{"workspace": own}]});
        let table = usage_table(&state, &summary).await;
        assert_eq!(table["read"], 3, "{table}");
        let names: Vec<&str> = table["workspaces"]
            .as_array()
            .expect("rows")
            .iter()
            .filter_map(|w| w["workspace"].as_str())
            .collect();
        // Three read (alpha, beta, the top caller's); the top caller's spent
        // nothing this month, so it is left out.
        assert_eq!(names, ["beta", "alpha"], "{table}");
        let beta = &table["workspaces"][0];
        assert_eq!(beta["tokens"]["output"], 2000);
        assert_eq!(beta["tokens"]["input"], 20);
        // 2 × (10 × 2.50 + 1,000 × 10) per million, each rounded up to 10⁻⁵ USD.
        let spend = beta["spend_usd"].as_f64().expect("spend");
        assert!((spend - 2.0 * 0.01003).abs() < 1e-12, "{table}");
        assert_eq!(
            table["month"],
            sluice_edge::UsageMonth::of(sluice_core::Clock::now(
                &sluice_core::SystemClock::default()
            ))
            .to_string()
        );
        // Read again within USAGE_MAX_AGE: the same reading, the store not asked.
        llm_call(&state, "alpha-key", "gpt-4o", 100_000).await;
        assert_eq!(usage_table(&state, &summary).await, table);
    }

    /// `GET /usage/export?month=…` as the router calls it: status, content
    /// type and body.
    async fn export(state: &AdminState<LocalStore>, month: Option<&str>) -> (u16, String, String) {
        let response = usage_export(
            State(state.clone()),
            Query(ExportQuery {
                month: month.map(str::to_owned),
            }),
        )
        .await;
        let status = response.status().as_u16();
        let kind = response
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned();
        let body = axum::body::to_bytes(response.into_body(), 1 << 20)
            .await
            .expect("a body");
        (status, kind, String::from_utf8_lossy(&body).into_owned())
    }

    #[tokio::test]
    async fn o4_export_is_json_lines_per_workspace_day_and_model_and_bad_months_are_400() {
        let state = state_of(
            sluice_policy::parse_str(LLM_POLICY, std::path::Path::new("llm.yaml"))
                .expect("the test policy"),
        );
        for bad in ["2026-13", "2026-1", "12-2026", "2026-12-01", "", "x"] {
            let (status, _, body) = export(&state, Some(bad)).await;
            assert_eq!(status, 400, "{bad:?}: {body}");
            assert!(body.contains("expected YYYY-MM"), "{bad:?}: {body}");
        }
        let today = || {
            let now = sluice_core::Clock::now(&sluice_core::SystemClock::default());
            (sluice_edge::UsageMonth::of(now), now.as_secs() / 86_400)
        };
        let (this_month, day) = today();
        // Nothing counted yet: an empty 200.
        let (status, kind, body) = export(&state, Some(&this_month.to_string())).await;
        assert_eq!(
            (status, kind.as_str(), body.as_str()),
            (200, "application/x-ndjson", "")
        );
        llm_call(&state, "alpha-key", "gpt-4o", 100).await;
        llm_call(&state, "alpha-key", "gpt-4o-mini", 100).await;
        llm_call(&state, "beta-key", "llama-3", 1000).await;
        let (status, _, body) = export(&state, None).await;
        assert_eq!(status, 200);
        if today() != (this_month, day) {
            // The day turned while the calls ran: their rows are split, as they
            // should be; the lines below assume one day.
            return;
        }
        let this_month = this_month.to_string();
        let lines: Vec<serde_json::Value> = body
            .lines()
            .map(|l| serde_json::from_str(l).expect("a JSON line"))
            .collect();
        assert_eq!(lines.len(), 2, "{body}");
        let line = |w: &str| {
            lines
                .iter()
                .find(|l| l["workspace"] == w)
                .unwrap_or_else(|| panic!("{w}: {body}"))
        };
        let (alpha, beta) = (line("alpha"), line("beta"));
        assert_eq!(alpha["model"], "gpt-4o*");
        assert_eq!(alpha["calls"], 2);
        assert_eq!(alpha["tokens"]["output"], 200);
        assert_eq!(beta["model"], "other");
        assert_eq!(beta["tokens"]["input"], 10);
        assert_eq!(beta["spend_units"], 0);
        let today = alpha["day"].as_str().expect("a day");
        assert!(today.starts_with(&this_month), "{today}");
        // The same sums as `/usage`.
        let Some(limiter) = state.inner.quotas.as_ref().map(|l| l.load_full()) else {
            panic!("a limiter");
        };
        let usage = limiter.llm_usage("alpha", None).await.expect("usage");
        assert_eq!(usage["tokens"]["output"], alpha["tokens"]["output"]);
        assert_eq!(usage["spend_usd"], alpha["spend_usd"]);
    }

    #[test]
    fn the_dashboard_history_is_a_bounded_ring_read_from_a_sequence_number() {
        let state = state();
        for _ in 0..HISTORY_SAMPLES + 50 {
            state.sample();
        }
        let history = state.inner.history.lock();
        assert_eq!(history.samples.len(), HISTORY_SAMPLES, "bounded");
        assert_eq!(history.last_seq, (HISTORY_SAMPLES + 50) as u64);
        assert_eq!(
            history.since(0).first().map(|s| s.seq),
            Some(51),
            "oldest dropped"
        );
        let newest: Vec<u64> = history
            .since(history.last_seq - 2)
            .iter()
            .map(|s| s.seq)
            .collect();
        assert_eq!(newest, [history.last_seq - 1, history.last_seq]);
        assert!(history.since(history.last_seq).is_empty());
    }

    #[tokio::test]
    async fn e1_a_sample_counts_the_decisions_of_its_interval_per_class() {
        let state = state();
        state.sample();
        let Some(limiter) = state.inner.quotas.as_ref().map(|l| l.load_full()) else {
            panic!("a limiter");
        };
        let request = http::Request::post("/chats")
            .header("x-api-key", "k")
            .body(())
            .expect("request");
        let (parts, ()) = request.into_parts();
        let peer: std::net::IpAddr = [127, 0, 0, 1].into();
        let route = limiter.route(&parts).expect("a route");
        for _ in 0..31 {
            let intake = limiter.intake(Ok(route), peer);
            let _ = intake.planned(&parts.headers, None, None).admit(None).await;
        }
        state.sample();
        let history = state.inner.history.lock();
        let last = history.samples.back().expect("a sample");
        let policy = limiter.policy();
        let index = |name: &str| policy.class(name).expect("a built-in class").index();
        let expensive = last.classes[index("expensive")];
        assert_eq!((expensive.admitted, expensive.refused), (30, 1));
        assert_eq!(expensive.units, 30);
        assert_eq!(expensive.fill_permille, 1000, "one caller spent all 30");
        let read = last.classes[index("read")];
        assert_eq!(read, ClassSample::default());
    }
}
