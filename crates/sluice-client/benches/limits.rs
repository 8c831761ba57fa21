//! Load benchmark of providers' real limits (issue: `bench/pacer`, SPEC
//! M1–M4), on tokio's paused clock with the simulator in process:
//!
//! * **two models**, each with its own TPM and RPM at the provider;
//! * **mixed priorities**: interactive requests beside a saturating batch
//!   job — the interactive p99 against its p99 alone, and the tokens of all
//!   against the best schedule;
//! * **ITPM/OTPM-bound**: Anthropic-style input and output windows;
//! * **three keys**, each with its own limits (one simulated provider per
//!   key).
//!
//! Each is measured against the best schedule of the same arrivals,
//! computed from the simulator's own rules with perfect knowledge of when
//! answers end and what they use (a first-fit schedule that may reorder,
//! and may pick any key): the tokens of answers finished in the run.
//!
//! `cargo bench -p sluice-client --features simulator --bench limits [-- NAME]`
#![allow(clippy::unwrap_used, missing_docs)]

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use sluice_client::config::{
    ApiKey, ApiStyle, ApiStyleExt, LimitsSource, ModelLimits, PaceConfig, ProviderConfig,
    ProviderLimits, StaticLimits,
};
use sluice_client::simulator::{LATENCY_HEADER, SimModel, SimService, SimulatorConfig};
use sluice_client::tokens::{EstimateOptions, estimate};
use sluice_client::{Pacer, PacerLayer, TEST_EPOCH, TokioClock};
use sluice_core::Timestamp;
use sluice_store::{MemoryConfig, MemoryStore};
use tower::{Layer, Service, ServiceExt};

/// Token and request limits of one book (0 = unlimited).
#[derive(Clone, Copy, Debug, Default)]
struct Lim {
    tpm: u32,
    rpm: u32,
    itpm: u32,
    otpm: u32,
}

impl Lim {
    fn limits(self) -> ProviderLimits {
        ProviderLimits::new(self.tpm, self.rpm, 0).with_io(self.itpm, self.otpm)
    }
}

#[derive(Clone, Copy, Debug)]
struct Job {
    at: Duration,
    model: usize,
    prompt_words: usize,
    max_tokens: u32,
    latency: Duration,
    batch: bool,
}

/// One workload: the provider's limits (per key), its models' limits, the
/// arrivals.
struct Setup {
    name: &'static str,
    style: ApiStyle,
    /// Provider-wide limits per key (one entry: one key).
    keys: Vec<Lim>,
    /// Model names and their own limits.
    models: Vec<(&'static str, Lim)>,
    completion_tokens: u32,
    jobs: Vec<Job>,
    minutes: u64,
    /// `interactiveReserveSeconds`, when not the default.
    reserve: Option<Duration>,
}

impl Setup {
    fn path(&self) -> &'static str {
        match self.style {
            ApiStyle::Anthropic => "/v1/messages",
            _ => "/v1/chat/completions",
        }
    }

    fn body(&self, job: &Job) -> Bytes {
        let v = serde_json::json!({
            "model": self.models[job.model].0,
            "max_tokens": job.max_tokens,
            "messages": [{"role": "user", "content": " tok".repeat(job.prompt_words)}],
        });
        Bytes::from(v.to_string())
    }

    fn stop(&self) -> Duration {
        Duration::from_secs(self.minutes * 60)
    }
}

/// Poisson arrivals of `per_minute` for `minutes`, around `prompt_words`
/// (±10 %) with `max_tokens`, latency log-uniform in `latency`.
fn poisson(
    rng: &mut fastrand::Rng,
    per_minute: f64,
    minutes: u64,
    model: usize,
    (prompt_words, max_tokens): (usize, u32),
    (lo, hi): (f64, f64),
    batch: bool,
) -> Vec<Job> {
    let mut jobs = Vec::new();
    let mut t = 0.0f64;
    let end = (minutes * 60) as f64;
    loop {
        t += -(1.0 - rng.f64()).ln() * 60.0 / per_minute;
        if t >= end {
            return jobs;
        }
        let spread = prompt_words / 10;
        let (a, b) = (lo.ln(), hi.ln());
        jobs.push(Job {
            at: Duration::from_secs_f64(t),
            model,
            prompt_words: rng.usize(prompt_words - spread..=prompt_words + spread),
            max_tokens,
            latency: Duration::from_secs_f64((a + (b - a) * rng.f64()).exp()),
            batch,
        });
    }
}

fn sorted(mut jobs: Vec<Job>) -> Vec<Job> {
    jobs.sort_by_key(|j| j.at);
    jobs
}

fn two_models() -> Setup {
    let mut rng = fastrand::Rng::with_seed(0x3011);
    let minutes = 10;
    let mut jobs = poisson(&mut rng, 80.0, minutes, 0, (500, 256), (0.5, 3.0), false);
    jobs.extend(poisson(
        &mut rng,
        160.0,
        minutes,
        1,
        (500, 256),
        (0.3, 1.5),
        false,
    ));
    Setup {
        name: "two models, each its own TPM",
        style: ApiStyle::OpenAi,
        keys: vec![Lim {
            tpm: 200_000,
            rpm: 2_000,
            ..Lim::default()
        }],
        models: vec![
            (
                "gpt-4o",
                Lim {
                    tpm: 30_000,
                    rpm: 500,
                    ..Lim::default()
                },
            ),
            (
                "gpt-4o-mini",
                Lim {
                    tpm: 60_000,
                    rpm: 1_000,
                    ..Lim::default()
                },
            ),
        ],
        completion_tokens: 150,
        jobs: sorted(jobs),
        minutes,
        reserve: None,
    }
}

fn mixed_priorities(interactive_per_minute: f64, with_batch: bool) -> Setup {
    let mut rng = fastrand::Rng::with_seed(0x3012);
    let minutes = 10;
    let mut jobs = poisson(
        &mut rng,
        interactive_per_minute,
        minutes,
        0,
        (500, 256),
        (0.5, 2.0),
        false,
    );
    if with_batch {
        jobs.extend(poisson(
            &mut rng,
            150.0,
            minutes,
            0,
            (500, 256),
            (0.5, 2.0),
            true,
        ));
    }
    Setup {
        name: if with_batch {
            "mixed priorities: interactive + saturating batch"
        } else {
            "mixed priorities: interactive alone"
        },
        style: ApiStyle::OpenAi,
        keys: vec![Lim {
            tpm: 60_000,
            rpm: 3_000,
            ..Lim::default()
        }],
        models: vec![("gpt-4o", Lim::default())],
        completion_tokens: 150,
        jobs: sorted(jobs),
        minutes,
        reserve: None,
    }
}

fn itpm_otpm() -> Setup {
    let mut rng = fastrand::Rng::with_seed(0x3013);
    let minutes = 10;
    let jobs = poisson(&mut rng, 120.0, minutes, 0, (600, 512), (1.0, 4.0), false);
    Setup {
        name: "ITPM/OTPM-bound (Anthropic style)",
        style: ApiStyle::Anthropic,
        keys: vec![Lim {
            itpm: 40_000,
            otpm: 8_000,
            rpm: 1_000,
            ..Lim::default()
        }],
        models: vec![("claude-sonnet", Lim::default())],
        completion_tokens: 150,
        jobs,
        minutes,
        reserve: None,
    }
}

fn three_keys() -> Setup {
    let mut rng = fastrand::Rng::with_seed(0x3014);
    let minutes = 10;
    let jobs = poisson(&mut rng, 200.0, minutes, 0, (500, 256), (0.5, 3.0), false);
    let key = |tpm, rpm| Lim {
        tpm,
        rpm,
        ..Lim::default()
    };
    Setup {
        name: "three keys, each its own limits",
        style: ApiStyle::OpenAi,
        keys: vec![key(30_000, 500), key(60_000, 500), key(20_000, 60)],
        models: vec![("gpt-4o", Lim::default())],
        completion_tokens: 150,
        jobs,
        minutes,
        reserve: None,
    }
}

// ---------------------------------------------------------------------------
// The run through sluice's pacer (its tower layer).
// ---------------------------------------------------------------------------

#[derive(Debug, Default)]
struct Outcome {
    /// (job, started, answered, tokens used).
    done: Vec<(usize, Timestamp, Timestamp, u64)>,
    failed: usize,
}

struct Run {
    outcome: Outcome,
    sims: Vec<SimService>,
}

fn secret(i: usize) -> String {
    format!("sk-bench-{i}")
}

fn usage_total(body: &[u8]) -> u64 {
    let v: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
    let u = &v["usage"];
    u["total_tokens"].as_u64().unwrap_or_else(|| {
        u["input_tokens"].as_u64().unwrap_or(0) + u["output_tokens"].as_u64().unwrap_or(0)
    })
}

async fn run_paced(setup: &Setup) -> Run {
    let clock = TokioClock::at(TEST_EPOCH);
    // One simulated provider per key, each enforcing that key's limits and
    // the models' own.
    let sims: Vec<SimService> = setup
        .keys
        .iter()
        .map(|k| {
            let sim = SimService::new(
                SimulatorConfig {
                    tpm: k.tpm,
                    rpm: k.rpm,
                    rpd: 0,
                    itpm: k.itpm,
                    otpm: k.otpm,
                    completion_tokens: setup.completion_tokens,
                    ..SimulatorConfig::default()
                },
                Arc::new(clock),
            );
            sim.set_models(
                setup
                    .models
                    .iter()
                    .filter(|(_, l)| !l.limits().is_unlimited())
                    .map(|(name, l)| SimModel {
                        pattern: (*name).to_owned(),
                        tpm: l.tpm,
                        rpm: l.rpm,
                        itpm: l.itpm,
                        otpm: l.otpm,
                    }),
            );
            sim
        })
        .collect();
    let mut p = ProviderConfig::new("sim", "http://sim.local/v1", setup.keys[0].limits());
    p.style = setup.style;
    p.auth_header = setup.style.default_auth_header();
    // A backlog waits its turn rather than fail.
    p.max_wait = Duration::from_secs(24 * 3600);
    if let Some(r) = setup.reserve {
        p.interactive_reserve = r;
    }
    p = p.with_models(
        setup
            .models
            .iter()
            .filter(|(_, l)| !l.limits().is_unlimited())
            .map(|(name, l)| ModelLimits::new(name, l.limits())),
    );
    if setup.keys.len() > 1 {
        p = p.with_api_keys(
            setup
                .keys
                .iter()
                .enumerate()
                .map(|(i, k)| ApiKey::new(&format!("key{i}"), &secret(i), k.limits())),
        );
    }
    let source: Arc<dyn LimitsSource> =
        Arc::new(StaticLimits::new(PaceConfig::from_providers([p])));
    let pacer = Pacer::with_store(
        MemoryStore::with_clock(MemoryConfig::default(), clock),
        clock,
        source,
    );
    let routes: Arc<Vec<SimService>> = Arc::new(sims.clone());
    let router = tower::service_fn(move |req: Request<Full<Bytes>>| {
        let routes = routes.clone();
        async move {
            let key = req
                .headers()
                .get("authorization")
                .or_else(|| req.headers().get("x-api-key"))
                .and_then(|v| v.to_str().ok())
                .map(|v| v.trim_start_matches("Bearer ").to_owned());
            let i = key
                .and_then(|k| (0..routes.len()).find(|&i| secret(i) == k))
                .unwrap_or(0);
            let mut sim = routes[i].clone();
            sim.call(req).await
        }
    });
    let svc = PacerLayer::new(pacer, "sim").layer(router);
    let out = Arc::new(parking_lot::Mutex::new(Outcome::default()));
    let mut tasks = Vec::new();
    for (i, job) in setup.jobs.iter().copied().enumerate() {
        let mut svc = svc.clone();
        let out = out.clone();
        let body = setup.body(&job);
        let path = setup.path();
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep_until(clock.instant_at(TEST_EPOCH.saturating_add(job.at))).await;
            let start = sluice_core::Clock::now(&clock);

            let mut r = Request::post(format!("http://sim.local{path}"))
                .header("content-type", "application/json")
                .header(LATENCY_HEADER, job.latency.as_millis().to_string());
            if job.batch {
                r = r.header("x-sluice-priority", "batch");
            }
            let r = ServiceExt::<Request<Full<Bytes>>>::ready(&mut svc)
                .await
                .unwrap()
                .call(r.body(Full::new(body)).unwrap())
                .await;
            match r {
                Ok(resp) if resp.status() == 200 => {
                    let b = resp.into_body().collect().await.unwrap().to_bytes();
                    let used = usage_total(&b);
                    out.lock()
                        .done
                        .push((i, start, sluice_core::Clock::now(&clock), used));
                }
                _ => out.lock().failed += 1,
            }
        }));
    }
    tokio::time::sleep_until(clock.instant_at(TEST_EPOCH.saturating_add(setup.stop()))).await;
    for t in &tasks {
        t.abort();
    }
    let outcome = std::mem::take(&mut *out.lock());
    Run { outcome, sims }
}

// ---------------------------------------------------------------------------
// The best schedule: the simulator's books with perfect knowledge.
// ---------------------------------------------------------------------------

/// What the provider counts for a job: (total, input, output) at arrival
/// and once its answer ends.
#[derive(Clone, Copy, Debug)]
struct Item {
    at: Duration,
    model: usize,
    counted: [u64; 3],
    used: [u64; 3],
    latency: Duration,
}

fn items(setup: &Setup) -> Vec<Item> {
    let opts = EstimateOptions::default();
    setup
        .jobs
        .iter()
        .map(|j| {
            let v: serde_json::Value = serde_json::from_slice(&setup.body(j)).unwrap();
            let est = estimate(setup.style, setup.path(), &v, &opts);
            let (p, c) = (u64::from(est.prompt), u64::from(est.completion));
            let g = u64::from(setup.completion_tokens.min(est.completion));
            Item {
                at: j.at,
                model: j.model,
                counted: [p + c, p, c],
                used: [p + g, p, g],
                latency: j.latency,
            }
        })
        .collect()
}

const WINDOW: Duration = Duration::from_secs(60);

#[derive(Clone, Copy, Debug)]
struct Sent {
    at: Duration,
    counted: [u64; 3],
    used: [u64; 3],
    settles: Duration,
}

/// One rolling 60 s book, exactly as the simulator keeps it.
#[derive(Default)]
struct Books {
    sent: VecDeque<Sent>,
}

impl Books {
    fn prune(&mut self, t: Duration) {
        while self.sent.front().is_some_and(|s| s.at + WINDOW <= t) {
            self.sent.pop_front();
        }
    }

    fn fits(&self, it: &Item, l: Lim, t: Duration) -> bool {
        let mut load = [0u64; 3];
        for s in &self.sent {
            let v = if s.settles <= t { s.used } else { s.counted };
            for (a, x) in load.iter_mut().zip(v) {
                *a += x;
            }
        }
        let limits = [l.tpm, l.itpm, l.otpm];
        (0..3).all(|a| limits[a] == 0 || load[a] + it.counted[a] <= u64::from(limits[a]))
            && (l.rpm == 0 || (self.sent.len() as u64) < u64::from(l.rpm))
    }

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

/// Whenever a book's load drops or a request arrives, every waiting
/// request that fits is sent, oldest first, with the first key it fits.
/// Returns the tokens finished by the end of the run, per model.
fn best_first_fit(setup: &Setup, items: &[Item]) -> Vec<u64> {
    let stop = setup.stop();
    let mut keys: Vec<Books> = setup.keys.iter().map(|_| Books::default()).collect();
    let mut models: HashMap<(usize, usize), Books> = HashMap::new();
    let mut tally = vec![0u64; setup.models.len()];
    let mut waiting: Vec<&Item> = Vec::new();
    let mut next = 0;
    let mut t = Duration::ZERO;
    while t < stop {
        while next < items.len() && items[next].at <= t {
            waiting.push(&items[next]);
            next += 1;
        }
        for b in keys.iter_mut().chain(models.values_mut()) {
            b.prune(t);
        }
        waiting.retain(|it| {
            let ml = setup.models[it.model].1;
            for (k, kb) in keys.iter_mut().enumerate() {
                let mb = models.entry((k, it.model)).or_default();
                if kb.fits(it, setup.keys[k], t) && mb.fits(it, ml, t) {
                    kb.send(it, t);
                    mb.send(it, t);
                    if t + it.latency <= stop {
                        tally[it.model] += it.used[0];
                    }
                    return false;
                }
            }
            true
        });
        let change = keys
            .iter()
            .chain(models.values())
            .filter_map(|b| b.next_change(t))
            .min();
        let arrival = items.get(next).map(|i| i.at);
        t = match (change, arrival) {
            (Some(a), Some(b)) => a.min(b),
            (Some(a), None) => a,
            (None, Some(b)) => b,
            (None, None) => break,
        };
    }
    tally
}

// ---------------------------------------------------------------------------

fn paused() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap()
}

fn p99(mut d: Vec<Duration>) -> Duration {
    d.sort();
    if d.is_empty() {
        return Duration::ZERO;
    }
    d[((d.len() as f64 - 1.0) * 0.99).round() as usize]
}

/// Tokens finished in the run per model, and the 429s of every key.
fn tally(setup: &Setup, run: &Run) -> (Vec<u64>, u64) {
    let end = TEST_EPOCH.saturating_add(setup.stop());
    let mut per = vec![0u64; setup.models.len()];
    for &(i, _, at, used) in &run.outcome.done {
        if at <= end {
            per[setup.jobs[i].model] += used;
        }
    }
    let violations = run.sims.iter().map(|s| s.stats().violations).sum();
    (per, violations)
}

fn main() {
    let filter: Option<String> = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    let wanted = |name: &str| filter.as_deref().is_none_or(|f| name.contains(f));
    println!(
        "\nProviders' real limits (M1–M4): arrivals faster than the limits allow; \"best\" is the best schedule of the same arrivals (first fit, free to reorder and to pick any key; answers finished in the run, tokens they used)\n"
    );
    println!(
        "| workload | limits | arrived | best: tokens | sluice pacer: tokens | % of best | 429s |"
    );
    println!("| --- | --- | ---: | ---: | ---: | ---: | ---: |");
    let rt = paused();
    for setup in [two_models(), itpm_otpm(), three_keys()] {
        if !wanted(setup.name) {
            continue;
        }
        let wall = std::time::Instant::now();
        let best = best_first_fit(&setup, &items(&setup));
        let run = rt.block_on(run_paced(&setup));
        let (per, violations) = tally(&setup, &run);
        let limits = describe(&setup);
        for (m, (name, _)) in setup.models.iter().enumerate() {
            let label = if setup.models.len() > 1 {
                format!("{} — {name}", setup.name)
            } else {
                setup.name.to_owned()
            };
            let arrived = setup.jobs.iter().filter(|j| j.model == m).count();
            println!(
                "| {label} | {limits} | {arrived} | {} | {} | {:.1} % | {violations} |",
                best[m],
                per[m],
                per[m] as f64 / best[m].max(1) as f64 * 100.0,
            );
        }
        eprintln!(
            "({}: {:.1} s of wall time)",
            setup.name,
            wall.elapsed().as_secs_f64()
        );
    }
    if wanted("mixed priorities") {
        mixed(&rt);
    }
}

fn describe(s: &Setup) -> String {
    let one = |l: &Lim| {
        let mut parts = Vec::new();
        for (n, v) in [
            ("TPM", l.tpm),
            ("ITPM", l.itpm),
            ("OTPM", l.otpm),
            ("RPM", l.rpm),
        ] {
            if v > 0 {
                parts.push(format!("{n} {v}"));
            }
        }
        parts.join(" / ")
    };
    let keys: Vec<String> = s.keys.iter().map(one).collect();
    let mut out = if s.keys.len() > 1 {
        format!("keys: {}", keys.join("; "))
    } else {
        keys.join("")
    };
    for (name, l) in &s.models {
        let d = one(l);
        if !d.is_empty() {
            out.push_str(&format!("; {name}: {d}"));
        }
    }
    out
}

fn mixed(rt: &tokio::runtime::Runtime) {
    println!(
        "\nMixed priorities (TPM 60000 / RPM 3000): interactive requests (~700 tokens, answer in 0.5–2 s) alone and beside a saturating batch job (150/min of the same size)\n"
    );
    println!(
        "| run | interactive done | interactive p99 | ratio | all tokens | % of best | 429s |"
    );
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: |");
    for (per_minute, reserve) in [(10.0, None), (20.0, None), (20.0, Some(5))] {
        mixed_at(rt, per_minute, reserve);
    }
}

fn mixed_at(rt: &tokio::runtime::Runtime, per_minute: f64, reserve: Option<u64>) {
    let alone = mixed_priorities(per_minute, false);
    let mut both = mixed_priorities(per_minute, true);
    both.reserve = reserve.map(Duration::from_secs);
    let label = match reserve {
        Some(s) => format!(" (interactiveReserveSeconds: {s})"),
        None => String::new(),
    };
    let a = rt.block_on(run_paced(&alone));
    let b = rt.block_on(run_paced(&both));
    let latency = |s: &Setup, r: &Run| {
        p99(r
            .outcome
            .done
            .iter()
            .filter(|(i, ..)| !s.jobs[*i].batch)
            .map(|&(_, start, end, _)| end.saturating_since(start))
            .collect())
    };
    let interactive = |s: &Setup, r: &Run| {
        r.outcome
            .done
            .iter()
            .filter(|(i, ..)| !s.jobs[*i].batch)
            .count()
    };
    let (la, lb) = (latency(&alone, &a), latency(&both, &b));
    let best = best_first_fit(&both, &items(&both))[0];
    let (per, violations) = tally(&both, &b);
    let (pa, va) = tally(&alone, &a);
    println!(
        "| interactive {per_minute}/min alone | {} | {:.2} s | 1.00× | {} | – | {va} |",
        interactive(&alone, &a),
        la.as_secs_f64(),
        pa[0],
    );
    println!(
        "| interactive {per_minute}/min + batch{label} | {} | {:.2} s | {:.2}× | {} | {:.1} % | {violations} |",
        interactive(&both, &b),
        lb.as_secs_f64(),
        lb.as_secs_f64() / la.as_secs_f64(),
        per[0],
        per[0] as f64 / best.max(1) as f64 * 100.0,
    );
}
