//! A provider simulator for tests and benchmarks: an HTTP server that
//! enforces strict rolling windows — tokens and requests in the last 60 s,
//! requests in the last 24 h, on its own clock — answers like the real
//! providers, and counts every request it had to refuse.
//!
//! * `POST …/chat/completions`: an OpenAI chat completion with `usage`, or
//!   with `"stream": true` server-sent chunks (usage in a last chunk when
//!   `stream_options.include_usage` is set, as OpenAI does);
//! * `POST …/messages`: an Anthropic message (or its event stream);
//! * `GET …/models`: a model list (counted as a request of no tokens).
//!
//! A request is counted when it arrives, at `prompt + max_tokens` tokens
//! (the reservation OpenAI counts), and — with
//! [`SimulatorConfig::reconcile`] — corrected to the tokens actually used
//! when its answer ends. Over a limit it answers 429 with OpenAI's body
//! ("… Please try again in 1.5s …", `code: rate_limit_exceeded`) and
//! `x-ratelimit-*` headers (Anthropic's shapes on `/messages`).
//!
//! Providers' real limits too: [`SimService::set_models`] /
//! [`Simulator::set_models`] give models (names or `*` patterns) their own
//! windows beside the provider-wide ones, as OpenAI limits each model (the
//! answer's headers then describe the model's limits); `itpm` / `otpm` count
//! input at arrival and output as the completion budget at arrival,
//! corrected to what was generated when the answer ends, as Anthropic does.
//!
//! A request may carry `x-simulator-latency-ms: N` to take `N` ms instead of
//! [`SimulatorConfig::latency`] (benchmarks with varied answer times).
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! use sluice_client::simulator::{Simulator, SimulatorConfig};
//! let sim = Simulator::start(SimulatorConfig { tpm: 1_000, ..SimulatorConfig::default() }).await.unwrap();
//! assert!(sim.base_url().starts_with("http://127.0.0.1:"));
//! assert_eq!(sim.stats().violations, 0);
//! # }
//! ```

use std::collections::VecDeque;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, Limited, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{Value, json};
use sluice_core::{Clock, Timestamp};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::api::ApiStyle;
use crate::clock::TokioClock;
use crate::tokens::{Encoding, EstimateOptions, estimate};

const MINUTE: Duration = Duration::from_secs(60);
/// A request header setting that request's latency, in milliseconds.
pub const LATENCY_HEADER: &str = "x-simulator-latency-ms";
const DAY: Duration = Duration::from_secs(86_400);

/// How the simulated provider behaves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SimulatorConfig {
    /// Tokens per rolling 60 s (0 = unlimited).
    pub tpm: u32,
    /// Requests per rolling 60 s (0 = unlimited).
    pub rpm: u32,
    /// Requests per rolling 24 h (0 = unlimited).
    pub rpd: u32,
    /// Input tokens per rolling 60 s (0 = unlimited), counted at arrival.
    pub itpm: u32,
    /// Output tokens per rolling 60 s (0 = unlimited): counted at arrival
    /// as the completion budget, corrected to what was generated at the end
    /// (as Anthropic does).
    pub otpm: u32,
    /// Time before an answer (or its first chunk).
    pub latency: Duration,
    /// Tokens each answer generates (at most the request's `max_tokens`).
    pub completion_tokens: u32,
    /// Content chunks in a streamed answer.
    pub stream_chunks: u32,
    /// Time between streamed chunks.
    pub chunk_interval: Duration,
    /// The completion budget counted when a request sets none.
    pub default_max_tokens: u32,
    /// Correct a request's count to its actual usage when it ends.
    pub reconcile: bool,
    /// Tokenizer for prompts.
    pub encoding: Encoding,
}

impl Default for SimulatorConfig {
    fn default() -> Self {
        SimulatorConfig {
            tpm: 60_000,
            rpm: 500,
            rpd: 0,
            itpm: 0,
            otpm: 0,
            latency: Duration::from_millis(50),
            completion_tokens: 100,
            stream_chunks: 5,
            chunk_interval: Duration::from_millis(10),
            default_max_tokens: crate::api::DEFAULT_MAX_TOKENS,
            reconcile: true,
            encoding: Encoding::O200kBase,
        }
    }
}

/// What the simulator saw.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SimulatorStats {
    /// Requests received.
    pub requests: u64,
    /// Requests answered normally.
    pub admitted: u64,
    /// Requests refused with 429 (any axis).
    pub violations: u64,
    /// Of those, over the token window.
    pub tpm_violations: u64,
    /// Of those, over the request window.
    pub rpm_violations: u64,
    /// Of those, over the day.
    pub rpd_violations: u64,
    /// Of those, over the input-token window.
    pub itpm_violations: u64,
    /// Of those, over the output-token window.
    pub otpm_violations: u64,
    /// Streamed answers.
    pub streamed: u64,
    /// Tokens counted at arrival (prompt + completion budget).
    pub tokens_reserved: u64,
    /// Tokens actually used (prompt + generated).
    pub tokens_used: u64,
    /// The most tokens ever counted in one rolling 60 s window.
    pub worst_window_tokens: u64,
    /// The most requests ever counted in one rolling 60 s window.
    pub worst_window_requests: u64,
    /// Input tokens actually used.
    pub input_used: u64,
    /// Output tokens actually generated.
    pub output_used: u64,
    /// The most input tokens ever counted in one rolling 60 s window.
    pub worst_window_input: u64,
    /// The most output tokens ever counted in one rolling 60 s window.
    pub worst_window_output: u64,
}

/// A model's own limits at the simulated provider, enforced besides the
/// provider-wide ones of [`SimulatorConfig`] (as OpenAI limits each model
/// and Anthropic each model class): a request whose `model` matches
/// `pattern` (`*` = any run) must fit both. 0 = no model limit on an axis.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SimModel {
    /// A model name or pattern.
    pub pattern: String,
    /// Tokens per rolling 60 s.
    pub tpm: u32,
    /// Requests per rolling 60 s.
    pub rpm: u32,
    /// Input tokens per rolling 60 s.
    pub itpm: u32,
    /// Output tokens per rolling 60 s.
    pub otpm: u32,
}

impl SimModel {
    /// `pattern` limited to `tpm` tokens and `rpm` requests a minute.
    pub fn new(pattern: &str, tpm: u32, rpm: u32) -> Self {
        SimModel {
            pattern: pattern.to_owned(),
            tpm,
            rpm,
            ..SimModel::default()
        }
    }

    fn limits(&self) -> Limits {
        Limits {
            tpm: self.tpm,
            rpm: self.rpm,
            rpd: 0,
            itpm: self.itpm,
            otpm: self.otpm,
        }
    }
}

/// The axes one book is held to.
#[derive(Clone, Copy, Debug)]
struct Limits {
    tpm: u32,
    rpm: u32,
    rpd: u32,
    itpm: u32,
    otpm: u32,
}

impl From<&SimulatorConfig> for Limits {
    fn from(c: &SimulatorConfig) -> Self {
        Limits {
            tpm: c.tpm,
            rpm: c.rpm,
            rpd: c.rpd,
            itpm: c.itpm,
            otpm: c.otpm,
        }
    }
}

#[derive(Debug)]
struct Entry {
    id: u64,
    at: Timestamp,
    tokens: u64,
    input: u64,
    output: u64,
}

/// One token axis of a book: its name, limit, what a request asks, and
/// what an entry holds on it.
type TokenAxis = (&'static str, u32, u64, fn(&Entry) -> u64);

/// What one request counts at arrival.
#[derive(Clone, Copy, Debug)]
struct Count {
    tokens: u64,
    input: u64,
    output: u64,
}

/// Why a book refused a request: the axis's name, when room comes back,
/// what was used, the limit, what was asked.
struct Refusal {
    axis: &'static str,
    wait: Duration,
    used: u64,
    limit: u32,
    requested: u64,
}

#[derive(Debug, Default)]
struct Book {
    minute: VecDeque<Entry>,
    day: VecDeque<Timestamp>,
    next_id: u64,
    stats: SimulatorStats,
    /// Arrival times and tokens of every admitted request (for reports).
    log: Vec<(Timestamp, u64)>,
}

impl Book {
    fn prune(&mut self, now: Timestamp) {
        while self
            .minute
            .front()
            .is_some_and(|e| e.at.saturating_add(MINUTE) <= now)
        {
            self.minute.pop_front();
        }
        while self
            .day
            .front()
            .is_some_and(|t| t.saturating_add(DAY) <= now)
        {
            self.day.pop_front();
        }
    }

    fn tokens(&self) -> u64 {
        self.minute.iter().map(|e| e.tokens).sum()
    }

    fn sum(&self, f: fn(&Entry) -> u64) -> u64 {
        self.minute.iter().map(f).sum()
    }

    /// Whether `c` fits every axis of `l` at `now`, the first axis over
    /// otherwise (and counts it).
    fn refuse(&mut self, l: Limits, c: Count, now: Timestamp) -> Option<Refusal> {
        let until = |t: Timestamp| t.saturating_add(MINUTE).saturating_since(now);
        let token_axes: [TokenAxis; 3] = [
            ("tokens", l.tpm, c.tokens, |e| e.tokens),
            ("input tokens", l.itpm, c.input, |e| e.input),
            ("output tokens", l.otpm, c.output, |e| e.output),
        ];
        for (axis, limit, asked, of) in token_axes {
            let used = self.sum(of);
            if limit > 0 && used + asked > u64::from(limit) {
                // Room comes back when enough of the oldest entries leave.
                let mut left = used;
                let mut wait = MINUTE;
                for e in &self.minute {
                    left -= of(e);
                    if left + asked <= u64::from(limit) {
                        wait = until(e.at);
                        break;
                    }
                }
                match axis {
                    "tokens" => self.stats.tpm_violations += 1,
                    "input tokens" => self.stats.itpm_violations += 1,
                    _ => self.stats.otpm_violations += 1,
                }
                return Some(Refusal {
                    axis,
                    wait,
                    used,
                    limit,
                    requested: asked,
                });
            }
        }
        let count = self.minute.len() as u64;
        if l.rpm > 0 && count + 1 > u64::from(l.rpm) {
            self.stats.rpm_violations += 1;
            return Some(Refusal {
                axis: "requests",
                wait: self.minute.front().map_or(MINUTE, |e| until(e.at)),
                used: count,
                limit: l.rpm,
                requested: 1,
            });
        }
        if l.rpd > 0 && self.day.len() as u64 + 1 > u64::from(l.rpd) {
            self.stats.rpd_violations += 1;
            return Some(Refusal {
                axis: "requests per day",
                wait: self
                    .day
                    .front()
                    .map_or(DAY, |t| t.saturating_add(DAY).saturating_since(now)),
                used: self.day.len() as u64,
                limit: l.rpd,
                requested: 1,
            });
        }
        None
    }

    fn record(&mut self, id: u64, c: Count, now: Timestamp) {
        self.minute.push_back(Entry {
            id,
            at: now,
            tokens: c.tokens,
            input: c.input,
            output: c.output,
        });
        self.day.push_back(now);
        self.log.push((now, c.tokens));
        let st = &mut self.stats;
        st.admitted += 1;
        st.tokens_reserved += c.tokens;
        let (t, i, o) = (
            self.minute.iter().map(|e| e.tokens).sum::<u64>(),
            self.minute.iter().map(|e| e.input).sum::<u64>(),
            self.minute.iter().map(|e| e.output).sum::<u64>(),
        );
        let n = self.minute.len() as u64;
        let st = &mut self.stats;
        st.worst_window_tokens = st.worst_window_tokens.max(t);
        st.worst_window_requests = st.worst_window_requests.max(n);
        st.worst_window_input = st.worst_window_input.max(i);
        st.worst_window_output = st.worst_window_output.max(o);
    }

    fn settle(&mut self, reconcile: bool, id: u64, input: u64, output: u64) {
        self.stats.tokens_used += input + output;
        self.stats.input_used += input;
        self.stats.output_used += output;
        if reconcile && let Some(e) = self.minute.iter_mut().find(|e| e.id == id) {
            e.tokens = input + output;
            e.input = input;
            e.output = output;
        }
    }
}

struct Shared {
    config: parking_lot::Mutex<SimulatorConfig>,
    clock: Arc<dyn Clock>,
    book: parking_lot::Mutex<Book>,
    /// Models with their own limits, each with its book (locked after
    /// `book`).
    models: parking_lot::Mutex<Vec<(SimModel, Book)>>,
}

impl Shared {
    fn new(config: SimulatorConfig, clock: Arc<dyn Clock>) -> Self {
        Shared {
            config: parking_lot::Mutex::new(config),
            clock,
            book: parking_lot::Mutex::new(Book::default()),
            models: parking_lot::Mutex::new(Vec::new()),
        }
    }

    fn model_stats(&self, pattern: &str) -> Option<SimulatorStats> {
        self.models
            .lock()
            .iter()
            .find(|(m, _)| m.pattern == pattern)
            .map(|(_, b)| b.stats)
    }
}

/// The simulated provider without a socket: a tower service answering in
/// the caller's task (benchmarks on paused time use it).
#[derive(Clone)]
pub struct SimService {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for SimService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimService").finish()
    }
}

impl SimService {
    /// A provider reading time from `clock`.
    pub fn new(config: SimulatorConfig, clock: Arc<dyn Clock>) -> Self {
        config.encoding.warm();
        SimService {
            shared: Arc::new(Shared::new(config, clock)),
        }
    }

    /// The counters so far.
    pub fn stats(&self) -> SimulatorStats {
        self.shared.book.lock().stats
    }

    /// Gives these models their own limits (and fresh books) from the next
    /// request on.
    pub fn set_models(&self, models: impl IntoIterator<Item = SimModel>) {
        *self.shared.models.lock() = models.into_iter().map(|m| (m, Book::default())).collect();
    }

    /// The counters of the model entry `pattern` ([`SimService::set_models`]).
    pub fn model_stats(&self, pattern: &str) -> Option<SimulatorStats> {
        self.shared.model_stats(pattern)
    }

    /// Arrival time and counted tokens of every admitted request.
    pub fn arrivals(&self) -> Vec<(Timestamp, u64)> {
        self.shared.book.lock().log.clone()
    }
}

impl<B> tower::Service<Request<B>> for SimService
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: std::error::Error + Send + Sync + 'static,
{
    type Response = Response<SimBody>;
    type Error = Infallible;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Response<SimBody>, Infallible>> + Send>,
    >;

    fn poll_ready(
        &mut self,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Infallible>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let shared = self.shared.clone();
        Box::pin(async move {
            let method = req.method().clone();
            let path = req.uri().path().to_owned();
            let latency = latency_of(req.headers());
            let body = match Limited::new(req.into_body(), 32 << 20).collect().await {
                Ok(c) => c.to_bytes(),
                Err(_) => Bytes::new(),
            };
            Ok(answer(shared, method, path, latency, body).await)
        })
    }
}

/// A running simulator (stops when dropped).
pub struct Simulator {
    addr: SocketAddr,
    shared: Arc<Shared>,
    task: JoinHandle<()>,
}

impl std::fmt::Debug for Simulator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Simulator")
            .field("addr", &self.addr)
            .finish()
    }
}

impl Simulator {
    /// Starts on `127.0.0.1:0` with the real clock (read through tokio).
    ///
    /// # Errors
    /// When the listener cannot be bound.
    pub async fn start(config: SimulatorConfig) -> std::io::Result<Self> {
        Self::start_with_clock(config, Arc::new(TokioClock::system())).await
    }

    /// Starts on `127.0.0.1:0` reading time from `clock`.
    ///
    /// # Errors
    /// When the listener cannot be bound.
    pub async fn start_with_clock(
        config: SimulatorConfig,
        clock: Arc<dyn Clock>,
    ) -> std::io::Result<Self> {
        config.encoding.warm();
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared::new(config, clock));
        let s = shared.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let s = s.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req| {
                        let s = s.clone();
                        async move { Ok::<_, Infallible>(handle(s, req).await) }
                    });
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Ok(Simulator { addr, shared, task })
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:<port>/v1`, a provider's `baseUrl`.
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// The counters so far.
    pub fn stats(&self) -> SimulatorStats {
        self.shared.book.lock().stats
    }

    /// Arrival time and counted tokens of every admitted request.
    pub fn arrivals(&self) -> Vec<(Timestamp, u64)> {
        self.shared.book.lock().log.clone()
    }

    /// Changes the limits and behaviour from the next request on.
    pub fn set_config(&self, config: SimulatorConfig) {
        *self.shared.config.lock() = config;
    }

    /// Gives these models their own limits (and fresh books) from the next
    /// request on.
    pub fn set_models(&self, models: impl IntoIterator<Item = SimModel>) {
        *self.shared.models.lock() = models.into_iter().map(|m| (m, Book::default())).collect();
    }

    /// The counters of the model entry `pattern` ([`Simulator::set_models`]).
    pub fn model_stats(&self, pattern: &str) -> Option<SimulatorStats> {
        self.shared.model_stats(pattern)
    }
}

impl Drop for Simulator {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The simulator's answer body.
pub type SimBody = BoxBody<Bytes, Infallible>;

fn full(status: StatusCode, v: &Value) -> Response<SimBody> {
    let mut r = Response::new(Full::new(Bytes::from(v.to_string())).boxed());
    *r.status_mut() = status;
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

/// OpenAI's duration style: `20ms`, `1.5s`, `6m0s`.
fn fmt_duration(d: Duration) -> String {
    let ms = d.as_millis();
    if ms < 1000 {
        format!("{ms}ms")
    } else if ms < 60_000 {
        let s = d.as_secs_f64();
        let t = format!("{s:.3}");
        format!("{}s", t.trim_end_matches('0').trim_end_matches('.'))
    } else {
        format!("{}m{}s", ms / 60_000, (ms % 60_000) / 1000)
    }
}

struct Verdict {
    refused: Option<Refusal>,
    id: u64,
    /// The limits the headers describe: the model's when it has its own.
    limits: Limits,
    remaining_requests: u64,
    remaining_tokens: u64,
    remaining_input: u64,
    remaining_output: u64,
    reset_requests: Duration,
    reset_tokens: Duration,
}

/// Counts a request of `model` at arrival against the provider-wide book
/// and, when one of the models matches, that model's book: admitted only
/// when both have room.
fn admit(shared: &Shared, cfg: &SimulatorConfig, model: &str, c: Count, now: Timestamp) -> Verdict {
    let mut b = shared.book.lock();
    let mut models = shared.models.lock();
    b.prune(now);
    b.stats.requests += 1;
    let mut own = models
        .iter_mut()
        .find(|(m, _)| crate::config::glob_matches(&m.pattern, model));
    if let Some((_, mb)) = own.as_mut() {
        mb.prune(now);
        mb.stats.requests += 1;
    }
    let mut refused = b.refuse(Limits::from(cfg), c, now);
    if refused.is_none()
        && let Some((m, mb)) = own.as_mut()
    {
        refused = mb.refuse(m.limits(), c, now);
        if refused.is_some() {
            mb.stats.violations += 1;
        }
    }
    let id = b.next_id;
    if refused.is_some() {
        b.stats.violations += 1;
    } else {
        b.next_id += 1;
        b.record(id, c, now);
        if let Some((_, mb)) = own.as_mut() {
            mb.record(id, c, now);
        }
    }
    let (limits, book): (Limits, &Book) = match &own {
        Some((m, mb)) => (m.limits(), mb),
        None => (Limits::from(cfg), &b),
    };
    let until = |t: Timestamp| t.saturating_add(MINUTE).saturating_since(now);
    Verdict {
        refused,
        id,
        limits,
        remaining_requests: u64::from(limits.rpm).saturating_sub(book.minute.len() as u64),
        remaining_tokens: u64::from(limits.tpm).saturating_sub(book.tokens()),
        remaining_input: u64::from(limits.itpm).saturating_sub(book.sum(|e| e.input)),
        remaining_output: u64::from(limits.otpm).saturating_sub(book.sum(|e| e.output)),
        reset_requests: book.minute.front().map_or(Duration::ZERO, |e| until(e.at)),
        reset_tokens: book.minute.back().map_or(Duration::ZERO, |e| until(e.at)),
    }
}

/// Replaces an admitted request's count by what it used.
fn settle(shared: &Shared, reconcile: bool, id: u64, model: &str, input: u64, output: u64) {
    let mut b = shared.book.lock();
    b.settle(reconcile, id, input, output);
    let mut models = shared.models.lock();
    if let Some((_, mb)) = models
        .iter_mut()
        .find(|(m, _)| crate::config::glob_matches(&m.pattern, model))
    {
        mb.settle(reconcile, id, input, output);
    }
}

fn rate_headers(r: &mut Response<SimBody>, style: ApiStyle, v: &Verdict, now: Timestamp) {
    let cfg = v.limits;
    let h = r.headers_mut();
    let mut put = |k: String, val: String| {
        if let (Ok(k), Ok(val)) = (
            http::HeaderName::from_bytes(k.as_bytes()),
            HeaderValue::from_str(&val),
        ) {
            h.insert(k, val);
        }
    };
    match style {
        ApiStyle::OpenAi => {
            put("x-ratelimit-limit-requests".into(), cfg.rpm.to_string());
            put("x-ratelimit-limit-tokens".into(), cfg.tpm.to_string());
            put(
                "x-ratelimit-remaining-requests".into(),
                v.remaining_requests.to_string(),
            );
            put(
                "x-ratelimit-remaining-tokens".into(),
                v.remaining_tokens.to_string(),
            );
            put(
                "x-ratelimit-reset-requests".into(),
                fmt_duration(v.reset_requests),
            );
            put(
                "x-ratelimit-reset-tokens".into(),
                fmt_duration(v.reset_tokens),
            );
        }
        ApiStyle::Anthropic => {
            let at = |d: Duration| {
                let t = now.saturating_add(d);
                jiff::Timestamp::from_nanosecond(i128::from(t.as_nanos()))
                    .map(|t| t.to_string())
                    .unwrap_or_default()
            };
            put(
                "anthropic-ratelimit-requests-limit".into(),
                cfg.rpm.to_string(),
            );
            put(
                "anthropic-ratelimit-requests-remaining".into(),
                v.remaining_requests.to_string(),
            );
            put(
                "anthropic-ratelimit-requests-reset".into(),
                at(v.reset_requests),
            );
            put(
                "anthropic-ratelimit-tokens-limit".into(),
                cfg.tpm.to_string(),
            );
            put(
                "anthropic-ratelimit-tokens-remaining".into(),
                v.remaining_tokens.to_string(),
            );
            put(
                "anthropic-ratelimit-tokens-reset".into(),
                at(v.reset_tokens),
            );
            for (name, limit, remaining) in [
                ("input-tokens", cfg.itpm, v.remaining_input),
                ("output-tokens", cfg.otpm, v.remaining_output),
            ] {
                if limit > 0 {
                    put(
                        format!("anthropic-ratelimit-{name}-limit"),
                        limit.to_string(),
                    );
                    put(
                        format!("anthropic-ratelimit-{name}-remaining"),
                        remaining.to_string(),
                    );
                    put(
                        format!("anthropic-ratelimit-{name}-reset"),
                        at(v.reset_tokens),
                    );
                }
            }
        }
    }
}

fn words(n: u32) -> String {
    // " tok" is one token in both encodings.
    " tok".repeat(n as usize)
}

async fn handle(shared: Arc<Shared>, req: Request<Incoming>) -> Response<SimBody> {
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let latency = latency_of(req.headers());
    match Limited::new(req.into_body(), 32 << 20).collect().await {
        Ok(c) => answer(shared, method, path, latency, c.to_bytes()).await,
        Err(_) => full(
            StatusCode::PAYLOAD_TOO_LARGE,
            &json!({"error":{"message":"body too large"}}),
        ),
    }
}

/// The latency a request asks for ([`LATENCY_HEADER`]), if any.
fn latency_of(headers: &http::HeaderMap) -> Option<Duration> {
    headers
        .get(LATENCY_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(Duration::from_millis)
}

async fn answer(
    shared: Arc<Shared>,
    method: Method,
    path: String,
    latency: Option<Duration>,
    body: Bytes,
) -> Response<SimBody> {
    let mut cfg = *shared.config.lock();
    if let Some(l) = latency {
        cfg.latency = l;
    }
    let style = if path.ends_with("/messages") {
        ApiStyle::Anthropic
    } else {
        ApiStyle::OpenAi
    };
    let known = (method == Method::POST
        && (path.ends_with("/chat/completions") || path.ends_with("/messages")))
        || (method == Method::GET && path.ends_with("/models"));
    if !known {
        return full(
            StatusCode::NOT_FOUND,
            &json!({"error":{"message":format!("Unknown request URL: {method} {path}"),"type":"invalid_request_error","code":"unknown_url"}}),
        );
    }
    let json: Value = if method == Method::GET {
        Value::Object(Default::default())
    } else {
        match serde_json::from_slice(&body) {
            Ok(v @ Value::Object(_)) => v,
            _ => {
                return full(
                    StatusCode::BAD_REQUEST,
                    &json!({"error":{"message":"We could not parse the JSON body of your request.","type":"invalid_request_error","code":null}}),
                );
            }
        }
    };
    let est = estimate(
        style,
        &path,
        &json,
        &EstimateOptions {
            encoding: cfg.encoding,
            default_max_tokens: cfg.default_max_tokens,
        },
    );
    let est = if method == Method::GET {
        Default::default()
    } else {
        est
    };
    let now = shared.clock.now();
    let model = json
        .get("model")
        .and_then(Value::as_str)
        .unwrap_or("gpt-4o")
        .to_owned();
    let count = Count {
        tokens: u64::from(est.total()),
        input: u64::from(est.prompt),
        output: u64::from(est.completion),
    };
    let v = admit(&shared, &cfg, &model, count, now);
    if let Some(Refusal {
        axis,
        wait,
        used,
        limit,
        requested,
    }) = v.refused
    {
        let per = match axis {
            "tokens" => "tokens per min (TPM)",
            "input tokens" => "input tokens per min (ITPM)",
            "output tokens" => "output tokens per min (OTPM)",
            "requests" => "requests per min (RPM)",
            _ => "requests per day (RPD)",
        };
        let message = format!(
            "Rate limit reached for {model} in organization org-simulator on {per}: Limit {limit}, Used {used}, Requested {requested}. Please try again in {}. Visit https://platform.openai.com/account/rate-limits to learn more.",
            fmt_duration(wait)
        );
        let mut r = match style {
            ApiStyle::OpenAi => full(
                StatusCode::TOO_MANY_REQUESTS,
                &json!({"error":{"message":message,"type":axis,"param":null,"code":"rate_limit_exceeded"}}),
            ),
            ApiStyle::Anthropic => {
                let mut r = full(
                    StatusCode::TOO_MANY_REQUESTS,
                    &json!({"type":"error","error":{"type":"rate_limit_error","message":message}}),
                );
                if let Ok(h) = HeaderValue::from_str(&wait.as_secs_f64().ceil().to_string()) {
                    r.headers_mut().insert(http::header::RETRY_AFTER, h);
                }
                r
            }
        };
        rate_headers(&mut r, style, &v, now);
        return r;
    }
    let completion = cfg.completion_tokens.min(est.completion);
    let used = u64::from(est.prompt) + u64::from(completion);
    let (input, output) = (u64::from(est.prompt), u64::from(completion));
    if method == Method::GET {
        tokio::time::sleep(cfg.latency).await;
        settle(&shared, cfg.reconcile, v.id, &model, 0, 0);
        let mut r = full(
            StatusCode::OK,
            &json!({"object":"list","data":[{"id":"gpt-4o","object":"model","owned_by":"simulator"}]}),
        );
        rate_headers(&mut r, style, &v, now);
        return r;
    }
    let stream = json.get("stream").and_then(Value::as_bool).unwrap_or(false);
    if !stream {
        tokio::time::sleep(cfg.latency).await;
        settle(&shared, cfg.reconcile, v.id, &model, input, output);
        let answer = match style {
            ApiStyle::OpenAi => json!({
                "id": format!("chatcmpl-sim{}", v.id), "object": "chat.completion",
                "created": now.as_secs(), "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": words(completion), "refusal": null},
                             "logprobs": null, "finish_reason": if completion < est.completion { "stop" } else { "length" }}],
                "usage": {"prompt_tokens": est.prompt, "completion_tokens": completion, "total_tokens": used},
                "system_fingerprint": "fp_simulator"
            }),
            ApiStyle::Anthropic => json!({
                "id": format!("msg_sim{}", v.id), "type": "message", "role": "assistant", "model": model,
                "content": [{"type": "text", "text": words(completion)}],
                "stop_reason": "end_turn", "stop_sequence": null,
                "usage": {"input_tokens": est.prompt, "output_tokens": completion}
            }),
        };
        let mut r = full(StatusCode::OK, &answer);
        rate_headers(&mut r, style, &v, now);
        return r;
    }
    shared.book.lock().stats.streamed += 1;
    let include_usage = json
        .get("stream_options")
        .and_then(|o| o.get("include_usage"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(16);
    let s = shared.clone();
    let id = v.id;
    let prompt = est.prompt;
    let model_done = model.clone();
    tokio::spawn(async move {
        let send = |v: Value| Bytes::from(format!("data: {v}\n\n"));
        let event = |name: &str, v: Value| Bytes::from(format!("event: {name}\ndata: {v}\n\n"));
        tokio::time::sleep(cfg.latency).await;
        let chunks = cfg.stream_chunks.max(1);
        let per = completion / chunks;
        let mut frames = Vec::new();
        match style {
            ApiStyle::OpenAi => {
                let base = |delta: Value, finish: Value| json!({"id": format!("chatcmpl-sim{id}"), "object": "chat.completion.chunk", "created": now.as_secs(), "model": model, "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}]});
                frames.push(send(base(
                    json!({"role":"assistant","content":""}),
                    Value::Null,
                )));
                for i in 0..chunks {
                    let n = if i + 1 == chunks {
                        completion - per * (chunks - 1)
                    } else {
                        per
                    };
                    frames.push(send(base(json!({"content": words(n)}), Value::Null)));
                }
                frames.push(send(base(json!({}), json!("stop"))));
                if include_usage {
                    frames.push(send(json!({"id": format!("chatcmpl-sim{id}"), "object": "chat.completion.chunk", "created": now.as_secs(), "model": model, "choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": used}})));
                }
                frames.push(Bytes::from_static(b"data: [DONE]\n\n"));
            }
            ApiStyle::Anthropic => {
                frames.push(event("message_start", json!({"type":"message_start","message":{"id":format!("msg_sim{id}"),"type":"message","role":"assistant","model":model,"content":[],"usage":{"input_tokens":prompt,"output_tokens":1}}})));
                frames.push(event("content_block_start", json!({"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}})));
                for i in 0..chunks {
                    let n = if i + 1 == chunks {
                        completion - per * (chunks - 1)
                    } else {
                        per
                    };
                    frames.push(event("content_block_delta", json!({"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":words(n)}})));
                }
                frames.push(event(
                    "content_block_stop",
                    json!({"type":"content_block_stop","index":0}),
                ));
                frames.push(event("message_delta", json!({"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":completion}})));
                frames.push(event("message_stop", json!({"type":"message_stop"})));
            }
        }
        let last = frames.len() - 1;
        for (i, f) in frames.into_iter().enumerate() {
            if i == last {
                // The answer is complete when its last event leaves.
                settle(&s, cfg.reconcile, id, &model_done, input, output);
            }
            if tx.send(f).await.is_err() {
                return;
            }
            if i > 0 && i < last {
                tokio::time::sleep(cfg.chunk_interval).await;
            }
        }
    });
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|b| (Ok::<_, Infallible>(Frame::data(b)), rx))
    });
    let mut r = Response::new(StreamBody::new(stream).boxed());
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    r.headers_mut().insert(
        http::header::CACHE_CONTROL,
        HeaderValue::from_static("no-cache"),
    );
    rate_headers(&mut r, style, &v, now);
    r
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn openai_style_durations() {
        assert_eq!(fmt_duration(Duration::from_millis(20)), "20ms");
        assert_eq!(fmt_duration(Duration::from_millis(1500)), "1.5s");
        assert_eq!(fmt_duration(Duration::from_secs(1)), "1s");
        assert_eq!(fmt_duration(Duration::from_secs(360)), "6m0s");
        assert_eq!(
            crate::headers::parse_duration(&fmt_duration(Duration::from_millis(16_062))),
            Some(Duration::from_millis(16_062))
        );
    }
}
