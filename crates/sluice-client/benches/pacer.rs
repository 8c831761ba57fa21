//! Load benchmark (issue: `bench/pacer`): against the simulator at TPM
//! 60,000 / RPM 500, 2,000 mixed requests (short/medium/long prompts, small
//! to large `max_tokens`, one in five streamed) arriving faster than the
//! limits allow; the sluice pacer side by side with a naive client (sends at
//! will, exponential backoff with full jitter on 429).
//!
//! Runs on tokio's paused clock with the simulator in process, so half an
//! hour of provider time takes seconds and the run is deterministic (seeded).
//! Prints, per client: share of the TPM used while busy, 429s, the worst
//! rolling 60 s window against the limits, p50/p99 completion time.
//!
//! `cargo bench -p sluice-client --bench pacer`
#![allow(clippy::unwrap_used, missing_docs)]

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use sluice_client::config::{
    LimitsSource, PaceConfig, ProviderConfig, ProviderLimits, StaticLimits,
};
use sluice_client::simulator::{SimService, SimulatorConfig};
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
}

fn workload() -> Vec<Job> {
    let mut rng = fastrand::Rng::with_seed(0x5eed);
    let mut jobs: Vec<Job> = (0..REQUESTS)
        .map(|_| Job {
            at: Duration::from_millis(rng.u64(0..ARRIVALS.as_millis() as u64)),
            prompt_words: [40, 300, 1_500][rng.usize(0..3)],
            max_tokens: [64, 256, 1_024][rng.usize(0..3)],
            stream: rng.u8(0..5) == 0,
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
    Request::post("http://sim.local/v1/chat/completions")
        .header("content-type", "application/json")
        .body(Full::new(body(job)))
        .unwrap()
}

#[derive(Debug, Default)]
struct Outcome {
    done: Vec<(Timestamp, Timestamp)>,
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

async fn run_paced(jobs: &[Job]) -> (Outcome, SimService, Duration) {
    let clock = TokioClock::at(TEST_EPOCH);
    let sim = SimService::new(sim_config(), Arc::new(clock));
    let mut p = ProviderConfig::new(
        "sim",
        "http://sim.local/v1",
        ProviderLimits {
            tpm: TPM,
            rpm: RPM,
            rpd: 0,
        },
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
                    o.tokens_used += usage_total(&b);
                    o.done.push((start, clock.now()));
                }
                _ => o.failed += 1,
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let busy = clock.now().saturating_since(TEST_EPOCH);
    let o = std::mem::take(&mut *out.lock());
    (o, sim, busy)
}

async fn run_naive(jobs: &[Job]) -> (Outcome, SimService, Duration) {
    let clock = TokioClock::at(TEST_EPOCH);
    let sim = SimService::new(sim_config(), Arc::new(clock));
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
                o.tokens_used += usage_total(&b);
                o.done.push((start, clock.now()));
                return;
            }
            out.lock().failed += 1;
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let busy = clock.now().saturating_since(TEST_EPOCH);
    let o = std::mem::take(&mut *out.lock());
    (o, sim, busy)
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

fn main() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    let jobs = workload();
    let wall = std::time::Instant::now();
    let (paced, naive) = rt.block_on(async { (run_paced(&jobs).await, run_naive(&jobs).await) });
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
