//! Load benchmark (issue: `bench/pacer`), two parts.
//!
//! 1. Against the simulator at TPM 60,000 / RPM 500, 2,000 mixed requests
//!    (short/medium/long prompts, small to large `max_tokens`, one in five
//!    streamed) arriving faster than the limits allow; the sluice pacer side
//!    by side with a naive client (sends at will, exponential backoff with
//!    full jitter on 429). Prints, per client: share of the TPM used while
//!    busy, 429s, the worst rolling 60 s window against the limits, p50/p99
//!    completion time.
//! 2. Workloads that vary the TPM:RPM balance, request sizes and the
//!    provider's answer time, each run for ten minutes with arrivals faster
//!    than the limits allow. Each is measured against the best schedule of
//!    the same arrivals, computed from the simulator's own rules with
//!    perfect knowledge of when answers end and what they use: the tokens
//!    of answers finished within the run, for the pacer and the naive
//!    client, and their 429s.
//!
//! 3. The matrix of providers that count by their own rules (the
//!    simulator's [`matrix_rows`]: tokenizer drift, per-message overhead,
//!    arrival delay and jitter, sub-minute RPM slices, anchored minutes, no
//!    headers, models' and keys' own limits), ten minutes a row, each
//!    against the best schedule of that row's rules; the pacer beside the
//!    naive client. Its seed is random and printed;
//!    `SLUICE_MATRIX_SEED=<seed>` runs the same again.
//!
//! Runs on tokio's paused clock with the simulator in process, so hours of
//! provider time take seconds; parts 1 and 2 are the same on every run
//! (fixed random streams).
//!
//! `cargo bench -p sluice-client --bench pacer [-- NAME]` (NAME: `original`
//! for part 1 only, `matrix` for part 3 only, or part of a workload's or a
//! row's name).
#![allow(clippy::unwrap_used, missing_docs)]

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use sluice_client::config::ApiStyle;
use sluice_client::config::{
    LimitsSource, PaceConfig, ProviderConfig, ProviderLimits, StaticLimits,
};
use sluice_client::simulator::{
    LATENCY_HEADER, MatrixClient, SimService, SimulatorConfig, matrix_rows,
};
use sluice_client::tokens::{EstimateOptions, estimate};
use sluice_client::{Pacer, PacerLayer, TEST_EPOCH, TokioClock};
use sluice_core::{Clock, Timestamp};
use sluice_store::{MemoryConfig, MemoryStore};
use tower::{Layer, Service, ServiceExt};

const TPM: u32 = 60_000;
const RPM: u32 = 500;
const REQUESTS: usize = 2_000;
/// Requests arrive over this long (about 3× faster than the TPM allows).
const ARRIVALS: Duration = Duration::from_secs(8 * 60);

#[derive(Clone, Copy, Debug)]
struct Job {
    at: Duration,
    prompt_words: usize,
    max_tokens: u32,
    stream: bool,
    /// The provider's answer time for this request (the simulator's
    /// default when `None`).
    latency: Option<Duration>,
}

fn workload() -> Vec<Job> {
    let mut rng = fastrand::Rng::with_seed(0x5eed);
    let mut jobs: Vec<Job> = (0..REQUESTS)
        .map(|_| Job {
            at: Duration::from_millis(rng.u64(0..ARRIVALS.as_millis() as u64)),
            prompt_words: [40, 300, 1_500][rng.usize(0..3)],
            max_tokens: [64, 256, 1_024][rng.usize(0..3)],
            stream: rng.u8(0..5) == 0,
            latency: None,
        })
        .collect();
    jobs.sort_by_key(|j| j.at);
    jobs
}

fn body(job: &Job) -> Bytes {
    let mut v = serde_json::json!({
        "model": "gpt-4o",
        "messages": [
            {"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": " tok".repeat(job.prompt_words)}
        ],
        "max_tokens": job.max_tokens,
    });
    if job.stream {
        v["stream"] = serde_json::json!(true);
        v["stream_options"] = serde_json::json!({"include_usage": true});
    }
    Bytes::from(v.to_string())
}

fn request(job: &Job) -> Request<Full<Bytes>> {
    let mut r = Request::post("http://sim.local/v1/chat/completions")
        .header("content-type", "application/json");
    if let Some(l) = job.latency {
        r = r.header(LATENCY_HEADER, l.as_millis().to_string());
    }
    r.body(Full::new(body(job))).unwrap()
}

#[derive(Debug, Default)]
struct Outcome {
    done: Vec<(Timestamp, Timestamp)>,
    /// When each answer ended and the tokens it used.
    finished: Vec<(Timestamp, u64)>,
    failed: usize,
    tokens_used: u64,
}

fn sim_config() -> SimulatorConfig {
    SimulatorConfig {
        tpm: TPM,
        rpm: RPM,
        rpd: 0,
        latency: Duration::from_millis(800),
        completion_tokens: 200,
        stream_chunks: 8,
        chunk_interval: Duration::from_millis(25),
        ..SimulatorConfig::default()
    }
}

fn usage_total(body: &[u8]) -> u64 {
    let text = String::from_utf8_lossy(body);
    let mut total = 0;
    for piece in text.split("data: ").chain(std::iter::once(text.as_ref())) {
        if let Ok(v) = serde_json::from_str::<serde_json::Value>(piece.trim())
            && let Some(t) = v["usage"]["total_tokens"].as_u64()
        {
            total = total.max(t);
        }
    }
    total
}

/// Runs `jobs` through the pacer against a simulator of `cfg`; with `stop`,
/// the run ends that long after the start, whatever is still queued.
async fn run_paced(
    jobs: &[Job],
    cfg: SimulatorConfig,
    stop: Option<Duration>,
) -> (Outcome, SimService, Duration) {
    let clock = TokioClock::at(TEST_EPOCH);
    let sim = SimService::new(cfg, Arc::new(clock));
    let mut p = ProviderConfig::new(
        "sim",
        "http://sim.local/v1",
        ProviderLimits::new(cfg.tpm, cfg.rpm, cfg.rpd),
    );
    // A backlog of hundreds of requests waits its turn rather than fail.
    p.max_wait = Duration::from_secs(24 * 3600);
    let source: Arc<dyn LimitsSource> =
        Arc::new(StaticLimits::new(PaceConfig::from_providers([p])));
    let pacer = Pacer::with_store(
        MemoryStore::with_clock(MemoryConfig::default(), clock),
        clock,
        source,
    );
    let svc = PacerLayer::new(pacer, "sim").layer(sim.clone());
    let out = Arc::new(parking_lot::Mutex::new(Outcome::default()));
    let mut tasks = Vec::new();
    for job in jobs.iter().copied() {
        let mut svc = svc.clone();
        let out = out.clone();
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep_until(clock.instant_at(TEST_EPOCH.saturating_add(job.at))).await;
            let start = clock.now();
            let r = ServiceExt::<Request<Full<Bytes>>>::ready(&mut svc)
                .await
                .unwrap()
                .call(request(&job))
                .await;
            let mut o = out.lock();
            match r {
                Ok(resp) if resp.status() == 200 => {
                    drop(o);
                    let b = resp.into_body().collect().await.unwrap().to_bytes();
                    let mut o = out.lock();
                    let used = usage_total(&b);
                    o.tokens_used += used;
                    o.done.push((start, clock.now()));
                    o.finished.push((clock.now(), used));
                }
                _ => o.failed += 1,
            }
        }));
    }
    finish(tasks, stop, clock, out, sim).await
}

/// Awaits every task (or, with `stop`, only until then) and returns what
/// the run did.
async fn finish(
    tasks: Vec<tokio::task::JoinHandle<()>>,
    stop: Option<Duration>,
    clock: TokioClock,
    out: Arc<parking_lot::Mutex<Outcome>>,
    sim: SimService,
) -> (Outcome, SimService, Duration) {
    match stop {
        Some(d) => {
            tokio::time::sleep_until(clock.instant_at(TEST_EPOCH.saturating_add(d))).await;
            for t in &tasks {
                t.abort();
            }
        }
        None => {
            for t in tasks {
                t.await.unwrap();
            }
        }
    }
    let busy = clock.now().saturating_since(TEST_EPOCH);
    let o = std::mem::take(&mut *out.lock());
    (o, sim, busy)
}

/// Runs `jobs` through the naive retry client; `stop` as [`run_paced`].
async fn run_naive(
    jobs: &[Job],
    cfg: SimulatorConfig,
    stop: Option<Duration>,
) -> (Outcome, SimService, Duration) {
    let clock = TokioClock::at(TEST_EPOCH);
    let sim = SimService::new(cfg, Arc::new(clock));
    let out = Arc::new(parking_lot::Mutex::new(Outcome::default()));
    let mut tasks = Vec::new();
    for (i, job) in jobs.iter().copied().enumerate() {
        let mut svc = sim.clone();
        let out = out.clone();
        tasks.push(tokio::spawn(async move {
            let mut rng = fastrand::Rng::with_seed(i as u64);
            tokio::time::sleep_until(clock.instant_at(TEST_EPOCH.saturating_add(job.at))).await;
            let start = clock.now();
            for attempt in 0..30u32 {
                let resp = svc.call(request(&job)).await.unwrap();
                if resp.status() == 429 {
                    // Exponential backoff with full jitter, 1 s doubling to 60 s.
                    let ceiling = (1u64 << attempt.min(6)).min(60) * 1000;
                    tokio::time::sleep(Duration::from_millis(rng.u64(0..=ceiling))).await;
                    continue;
                }
                let b = resp.into_body().collect().await.unwrap().to_bytes();
                let mut o = out.lock();
                let used = usage_total(&b);
                o.tokens_used += used;
                o.done.push((start, clock.now()));
                o.finished.push((clock.now(), used));
                return;
            }
            out.lock().failed += 1;
        }));
    }
    finish(tasks, stop, clock, out, sim).await
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

fn report(name: &str, (o, sim, busy): &(Outcome, SimService, Duration)) {
    let s = sim.stats();
    let mut lat: Vec<Duration> = o.done.iter().map(|(a, b)| b.saturating_since(*a)).collect();
    lat.sort();
    let minutes = busy.as_secs_f64() / 60.0;
    let share = o.tokens_used as f64 / (f64::from(TPM) * minutes);
    println!(
        "| {name:<12} | {:>5} | {:>4} | {:>5.1} % | {:>6} | {:>5.3}× | {:>5.3}× | {:>7.1} s | {:>7.1} s | {:>6.1} min |",
        o.done.len(),
        o.failed,
        share * 100.0,
        s.violations,
        s.worst_window_tokens as f64 / f64::from(TPM),
        s.worst_window_requests as f64 / f64::from(RPM),
        percentile(&lat, 0.5).as_secs_f64(),
        percentile(&lat, 0.99).as_secs_f64(),
        minutes,
    );
}

// ---------------------------------------------------------------------------
// Workloads unlike the one above: the TPM:RPM balance, request sizes and the
// provider's answer time vary. Each runs for a fixed time with requests
// arriving faster than the limits allow, and is measured against the best
// schedule the same arrivals allow.
// ---------------------------------------------------------------------------

/// Request sizes of a workload.
#[derive(Clone, Copy, Debug)]
enum Sizes {
    /// About this many prompt words and this completion budget (prompt ±10 %).
    Around {
        prompt_words: usize,
        max_tokens: u32,
    },
    /// Pareto-distributed prompts (from 50 words, α = 1.3, at most 7,000)
    /// with a completion budget of 64, 256 or 1,024.
    HeavyTail,
}

/// The provider's answer time in a workload.
#[derive(Clone, Copy, Debug)]
enum Latency {
    Fixed(Duration),
    /// Log-uniform between the two.
    Between(Duration, Duration),
}

#[derive(Clone, Copy, Debug)]
struct Workload {
    name: &'static str,
    tpm: u32,
    rpm: u32,
    sizes: Sizes,
    /// Tokens each answer generates (at most its `max_tokens`).
    completion_tokens: u32,
    latency: Latency,
    /// Mean arrivals per minute (Poisson).
    per_minute: f64,
    /// The run's length; arrivals continue throughout.
    minutes: u64,
}

const WORKLOADS: &[Workload] = &[
    Workload {
        name: "TPM-bound, ~700 tok, fast",
        tpm: 30_000,
        rpm: 60,
        sizes: Sizes::Around {
            prompt_words: 440,
            max_tokens: 250,
        },
        completion_tokens: 200,
        latency: Latency::Fixed(Duration::from_millis(800)),
        per_minute: 70.0,
        minutes: 10,
    },
    Workload {
        name: "TPM-bound, ~700 tok, slow",
        tpm: 30_000,
        rpm: 60,
        sizes: Sizes::Around {
            prompt_words: 440,
            max_tokens: 250,
        },
        completion_tokens: 200,
        latency: Latency::Fixed(Duration::from_secs(8)),
        per_minute: 70.0,
        minutes: 10,
    },
    Workload {
        name: "TPM-bound, ~700 tok, variable",
        tpm: 30_000,
        rpm: 60,
        sizes: Sizes::Around {
            prompt_words: 440,
            max_tokens: 250,
        },
        completion_tokens: 200,
        latency: Latency::Between(Duration::from_millis(200), Duration::from_secs(20)),
        per_minute: 70.0,
        minutes: 10,
    },
    Workload {
        name: "RPM-bound, ~100 tok, fast",
        tpm: 100_000,
        rpm: 60,
        sizes: Sizes::Around {
            prompt_words: 45,
            max_tokens: 40,
        },
        completion_tokens: 30,
        latency: Latency::Fixed(Duration::from_millis(500)),
        per_minute: 90.0,
        minutes: 10,
    },
    Workload {
        name: "RPM-bound, ~100 tok, 500 RPM",
        tpm: 100_000,
        rpm: 500,
        sizes: Sizes::Around {
            prompt_words: 45,
            max_tokens: 40,
        },
        completion_tokens: 30,
        latency: Latency::Between(Duration::from_millis(200), Duration::from_secs(5)),
        per_minute: 750.0,
        minutes: 10,
    },
    Workload {
        name: "balanced, ~700 tok",
        tpm: 42_000,
        rpm: 60,
        sizes: Sizes::Around {
            prompt_words: 440,
            max_tokens: 250,
        },
        completion_tokens: 200,
        latency: Latency::Fixed(Duration::from_secs(2)),
        per_minute: 90.0,
        minutes: 10,
    },
    Workload {
        name: "large, ~4,000 tok, fast",
        tpm: 80_000,
        rpm: 60,
        sizes: Sizes::Around {
            prompt_words: 3_000,
            max_tokens: 1_000,
        },
        completion_tokens: 300,
        latency: Latency::Fixed(Duration::from_secs(2)),
        per_minute: 40.0,
        minutes: 10,
    },
    Workload {
        name: "large, ~4,000 tok, slow",
        tpm: 80_000,
        rpm: 60,
        sizes: Sizes::Around {
            prompt_words: 3_000,
            max_tokens: 1_000,
        },
        completion_tokens: 300,
        latency: Latency::Fixed(Duration::from_secs(15)),
        per_minute: 40.0,
        minutes: 10,
    },
    Workload {
        name: "heavy-tailed mix, variable",
        tpm: 60_000,
        rpm: 500,
        sizes: Sizes::HeavyTail,
        completion_tokens: 200,
        latency: Latency::Between(Duration::from_millis(300), Duration::from_secs(15)),
        per_minute: 300.0,
        minutes: 10,
    },
];

impl Workload {
    fn sim_config(&self) -> SimulatorConfig {
        SimulatorConfig {
            tpm: self.tpm,
            rpm: self.rpm,
            rpd: 0,
            completion_tokens: self.completion_tokens,
            ..SimulatorConfig::default()
        }
    }

    fn duration(&self) -> Duration {
        Duration::from_secs(self.minutes * 60)
    }

    /// The arrivals, the same on every run.
    fn jobs(&self, seed: u64) -> Vec<Job> {
        let mut rng = fastrand::Rng::with_seed(seed);
        let mut jobs = Vec::new();
        let mut t = 0.0f64;
        let end = self.duration().as_secs_f64();
        loop {
            // Exponential gaps: a Poisson stream.
            t += -(1.0 - rng.f64()).ln() * 60.0 / self.per_minute;
            if t >= end {
                break;
            }
            let (prompt_words, max_tokens) = match self.sizes {
                Sizes::Around {
                    prompt_words,
                    max_tokens,
                } => {
                    let spread = prompt_words / 10;
                    (
                        rng.usize(prompt_words - spread..=prompt_words + spread),
                        max_tokens,
                    )
                }
                Sizes::HeavyTail => {
                    let words = 50.0 / (1.0 - rng.f64()).powf(1.0 / 1.3);
                    (
                        words.min(7_000.0) as usize,
                        [64, 256, 1_024][rng.usize(0..3)],
                    )
                }
            };
            let latency = match self.latency {
                Latency::Fixed(d) => d,
                Latency::Between(a, b) => {
                    let (a, b) = (a.as_secs_f64().ln(), b.as_secs_f64().ln());
                    Duration::from_millis(((a + (b - a) * rng.f64()).exp() * 1000.0) as u64)
                }
            };
            jobs.push(Job {
                at: Duration::from_secs_f64(t),
                prompt_words,
                max_tokens,
                stream: false,
                latency: Some(latency),
            });
        }
        jobs
    }
}

/// What the provider counts for a job, as the oracles see it.
#[derive(Clone, Copy, Debug)]
struct Item {
    at: Duration,
    /// Counted on arrival: prompt + completion budget.
    counted: u64,
    /// Counted once the answer ends: prompt + tokens generated.
    used: u64,
    latency: Duration,
}

fn items(jobs: &[Job], cfg: &SimulatorConfig) -> Vec<Item> {
    let mut opts = EstimateOptions::default();
    opts.encoding = cfg.encoding;
    opts.default_max_tokens = cfg.default_max_tokens;
    jobs.iter()
        .map(|j| {
            let v: serde_json::Value = serde_json::from_slice(&body(j)).unwrap();
            let est = estimate(ApiStyle::OpenAi, "/v1/chat/completions", &v, &opts);
            Item {
                at: j.at,
                counted: u64::from(est.total()),
                used: u64::from(est.prompt) + u64::from(cfg.completion_tokens.min(est.completion)),
                latency: j.latency.unwrap_or(cfg.latency),
            }
        })
        .collect()
}

/// A request the provider admitted, in an oracle's books.
#[derive(Clone, Copy, Debug)]
struct Sent {
    at: Duration,
    counted: u64,
    used: u64,
    settles: Duration,
}

const WINDOW: Duration = Duration::from_secs(60);

/// The provider's rolling 60 s books, exactly as the simulator keeps them.
#[derive(Default)]
struct Books {
    sent: std::collections::VecDeque<Sent>,
}

impl Books {
    fn prune(&mut self, t: Duration) {
        while self.sent.front().is_some_and(|s| s.at + WINDOW <= t) {
            self.sent.pop_front();
        }
    }

    /// Tokens and requests counted at `t` (after [`Books::prune`]).
    fn load(&self, t: Duration) -> (u64, u64) {
        let tokens = self
            .sent
            .iter()
            .map(|s| if s.settles <= t { s.used } else { s.counted })
            .sum();
        (tokens, self.sent.len() as u64)
    }

    /// The next instant after `t` at which the load drops.
    fn next_change(&self, t: Duration) -> Option<Duration> {
        self.sent
            .iter()
            .flat_map(|s| [s.at + WINDOW, s.settles])
            .filter(|&e| e > t)
            .min()
    }

    fn send(&mut self, it: &Item, t: Duration) {
        self.sent.push_back(Sent {
            at: t,
            counted: it.counted,
            used: it.used,
            settles: t + it.latency,
        });
    }
}

fn fits(load: (u64, u64), it: &Item, tpm: u32, rpm: u32) -> bool {
    (tpm == 0 || load.0 + it.counted <= u64::from(tpm)) && (rpm == 0 || load.1 < u64::from(rpm))
}

/// Answers finished, and the tokens they used, by the end of a run.
#[derive(Clone, Copy, Debug, Default)]
struct Tally {
    requests: u64,
    tokens: u64,
}

impl Tally {
    fn add(&mut self, used: u64) {
        self.requests += 1;
        self.tokens += used;
    }
}

/// The best schedule in arrival order: each request sent at the first
/// instant the provider's windows admit it, knowing exactly when earlier
/// answers end and what they use. Sending earlier never hurts a later
/// request (a request's weight in the window only falls with age), so no
/// in-order schedule finishes more by `stop`.
fn best_in_order(items: &[Item], tpm: u32, rpm: u32, stop: Duration) -> Tally {
    let mut books = Books::default();
    let mut tally = Tally::default();
    let mut t = Duration::ZERO;
    for it in items {
        t = t.max(it.at);
        loop {
            books.prune(t);
            if fits(books.load(t), it, tpm, rpm) {
                break;
            }
            match books.next_change(t) {
                Some(e) => t = e,
                None => return tally,
            }
        }
        if t >= stop {
            break;
        }
        books.send(it, t);
        if t + it.latency <= stop {
            tally.add(it.used);
        }
    }
    tally
}

/// A schedule free to reorder: whenever the load drops or a request
/// arrives, every waiting request that fits is sent, oldest first.
fn best_first_fit(items: &[Item], tpm: u32, rpm: u32, stop: Duration) -> Tally {
    let mut books = Books::default();
    let mut tally = Tally::default();
    let mut waiting: Vec<&Item> = Vec::new();
    let smallest = items.iter().map(|i| i.counted).min().unwrap_or(0);
    let mut next = 0;
    let mut t = Duration::ZERO;
    while t < stop {
        while next < items.len() && items[next].at <= t {
            waiting.push(&items[next]);
            next += 1;
        }
        books.prune(t);
        let mut load = books.load(t);
        if tpm == 0 || load.0 + smallest <= u64::from(tpm) {
            waiting.retain(|it| {
                if !fits(load, it, tpm, rpm) {
                    return true;
                }
                books.send(it, t);
                load = (load.0 + it.counted, load.1 + 1);
                if t + it.latency <= stop {
                    tally.add(it.used);
                }
                false
            });
        }
        let arrival = items.get(next).map(|i| i.at);
        t = match (books.next_change(t), arrival) {
            (Some(a), Some(b)) => a.min(b),
            (Some(a), None) => a,
            (None, Some(b)) => b,
            (None, None) => break,
        };
    }
    tally
}

/// What a client finished by `stop`.
fn tally_of(o: &Outcome, stop: Duration) -> Tally {
    let end = TEST_EPOCH.saturating_add(stop);
    let mut t = Tally::default();
    for &(at, used) in &o.finished {
        if at <= end {
            t.add(used);
        }
    }
    t
}

fn run_matrix(filter: Option<&str>) {
    println!(
        "\nWorkloads: arrivals faster than the limits allow for the whole run; \"best\" is the best schedule of the same arrivals (answers finished in the run, tokens they used), the pacer and the naive client as % of its tokens\n"
    );
    println!(
        "| workload | TPM / RPM | arrived | best in order: done / tokens | best reordered: tokens | sluice pacer | 429s | naive retry | 429s |"
    );
    println!("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for (n, w) in WORKLOADS.iter().enumerate() {
        if filter.is_some_and(|f| !w.name.contains(f)) {
            continue;
        }
        let cfg = w.sim_config();
        let jobs = w.jobs(0x5eed + n as u64);
        let its = items(&jobs, &cfg);
        let stop = w.duration();
        let in_order = best_in_order(&its, w.tpm, w.rpm, stop);
        let reordered = best_first_fit(&its, w.tpm, w.rpm, stop);
        let best = in_order.tokens.max(reordered.tokens) as f64;
        let (paced, naive) = paused().block_on(async {
            (
                run_paced(&jobs, cfg, Some(stop)).await,
                run_naive(&jobs, cfg, Some(stop)).await,
            )
        });
        let p = tally_of(&paced.0, stop);
        let q = tally_of(&naive.0, stop);
        println!(
            "| {} | {} / {} | {} | {} / {} | {} | {:.1} % | {} | {:.1} % | {} |",
            w.name,
            w.tpm,
            w.rpm,
            jobs.len(),
            in_order.requests,
            in_order.tokens,
            reordered.tokens,
            p.tokens as f64 / best * 100.0,
            paced.1.stats().violations,
            q.tokens as f64 / best * 100.0,
            naive.1.stats().violations,
        );
    }
}

fn paused() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap()
}

fn main() {
    // `cargo bench` passes `--bench`; any other argument picks workloads by
    // name ("original" for the first table only).
    let filter: Option<String> = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    if filter.as_deref().is_none_or(|f| f == "original") {
        run_original();
    }
    if filter
        .as_deref()
        .is_none_or(|f| f != "original" && f != "matrix")
    {
        run_matrix(filter.as_deref());
    }
    if filter.as_deref() != Some("original") {
        run_knobs(filter.as_deref().filter(|f| *f != "matrix"));
    }
}

/// Part 3: every row of the simulator's matrix for ten minutes, the pacer
/// beside the naive client, against the best schedule of the row's rules.
fn run_knobs(filter: Option<&str>) {
    let stop = Duration::from_secs(10 * 60);
    let seed: u64 = std::env::var("SLUICE_MATRIX_SEED")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or_else(|| fastrand::u64(..));
    println!(
        "\nThe matrix: providers that count by their own rules, ten minutes a row, seed {seed} (SLUICE_MATRIX_SEED={seed} runs it again); \"best\" is the best schedule of the row's rules, the clients as % of its tokens\n"
    );
    println!("| row | arrived | best: done / tokens | sluice pacer | 429s | naive retry | 429s |");
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: |");
    let rt = paused();
    for (i, row) in matrix_rows().iter().enumerate() {
        if filter.is_some_and(|f| !row.name.contains(f)) {
            continue;
        }
        let s = seed.wrapping_add(i as u64);
        let jobs = row.jobs(s, stop);
        let best = row.best(&jobs, stop);
        let (paced, naive) = rt.block_on(async {
            (
                row.run(MatrixClient::Pacer, &jobs, stop, s).await,
                row.run(MatrixClient::Naive, &jobs, stop, s).await,
            )
        });
        let pct = |t: u64| t as f64 / best.tokens.max(1) as f64 * 100.0;
        println!(
            "| {} | {} | {} / {} | {:.1} % | {} | {:.1} % | {} |",
            row.name,
            jobs.len(),
            best.requests,
            best.tokens,
            pct(paced.finished.tokens),
            paced.violations,
            pct(naive.finished.tokens),
            naive.violations,
        );
    }
}

fn run_original() {
    let rt = paused();
    let jobs = workload();
    let wall = std::time::Instant::now();
    let (paced, naive) = rt.block_on(async {
        (
            run_paced(&jobs, sim_config(), None).await,
            run_naive(&jobs, sim_config(), None).await,
        )
    });
    println!(
        "bench/pacer: {REQUESTS} mixed requests, simulator TPM {TPM} / RPM {RPM}, arrivals over {} min (paused clock; {:.1} s of wall time)\n",
        ARRIVALS.as_secs() / 60,
        wall.elapsed().as_secs_f64()
    );
    println!(
        "| client       |  done | fail | TPM used |   429s | worst 60 s tokens | worst 60 s requests |     p50 |     p99 |   busy |"
    );
    println!(
        "| ------------ | ----: | ---: | -------: | -----: | ----: | ----: | ------: | ------: | -----: |"
    );
    report("sluice pacer", &paced);
    report("naive retry", &naive);
}
