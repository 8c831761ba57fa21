//! The pacer against providers that count by their own rules: a matrix of
//! rows, each a simulated provider with some of the knobs real providers
//! differ in turned ([`SimulatorConfig`]'s tokenizer drift, per-message
//! overhead, arrival delay and jitter, sub-minute RPM slices, anchored
//! minutes, headers absent; models' and keys' own limits), a workload
//! arriving faster than the limits allow, and the best schedule of that
//! workload under the row's rules ([`best_schedule`]).
//!
//! A row runs on tokio's clock with the simulator in process: on paused
//! time ([`tokio::time::pause`]) ten minutes of provider time take a few
//! seconds. The workload, the sizes, the answer times and the jitter all
//! come from one seed, so a row that fails is reproduced by its seed.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() {
//! use std::time::Duration;
//! use sluice_client::simulator::{MatrixClient, matrix_rows};
//! let row = &matrix_rows()[0];
//! let stop = Duration::from_secs(30);
//! let jobs = row.jobs(7, stop);
//! let best = row.best(&jobs, stop);
//! let paced = row.run(MatrixClient::Pacer, &jobs, stop, 7).await;
//! assert_eq!(paced.violations, 0);
//! assert!(paced.finished.tokens <= best.tokens);
//! # }
//! ```

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use serde_json::{Value, json};
use tower::{Layer, Service, ServiceExt};

use super::answer::provider_prompt;
use super::best::{ScheduleItem, Tally, best_schedule};
use super::config::{LATENCY_HEADER, SimModel, SimulatorConfig};
use super::server::SimService;
use crate::api::ApiStyle;
use crate::config::{
    ApiKey, ApiStyleExt, LimitsSource, ModelLimits, PaceConfig, ProviderConfig, ProviderLimits,
    StaticLimits,
};
use crate::tokens::{EstimateOptions, estimate};
use crate::{Pacer, PacerLayer, TEST_EPOCH, TokioClock};

/// The workload a row runs: Poisson arrivals, prompts of a spread of sizes
/// and messages, answers of a spread of times.
#[derive(Clone, Debug, PartialEq)]
pub struct MatrixWorkload {
    /// Mean arrivals per minute.
    pub per_minute: f64,
    /// Prompt words (one token each to the estimator), uniform in the range.
    pub prompt_words: (usize, usize),
    /// Messages per request, uniform in the range (at least 1).
    pub messages: (usize, usize),
    /// Each request's `max_tokens`.
    pub max_tokens: u32,
    /// Answer times, log-uniform between the two.
    pub latency: (Duration, Duration),
    /// The models requests name, chosen uniformly.
    pub models: Vec<&'static str>,
}

/// One row of the matrix: a provider's rules and a workload.
#[derive(Clone, Debug, PartialEq)]
pub struct MatrixRow {
    /// What the row varies.
    pub name: &'static str,
    /// The request shapes (OpenAI's chat completions or Anthropic's messages).
    pub style: ApiStyle,
    /// One simulated provider per key, each with that key's limits; the
    /// first key's knobs (drift, overhead, delay, slices, anchoring,
    /// headers) are the provider's and hold for all.
    pub keys: Vec<SimulatorConfig>,
    /// Models with their own limits (on every key).
    pub models: Vec<SimModel>,
    /// What arrives.
    pub workload: MatrixWorkload,
}

/// A request of a row's workload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MatrixJob {
    /// When the client has it, from the start of the run.
    pub at: Duration,
    /// The model it names.
    pub model: &'static str,
    /// Prompt words over all its messages.
    pub words: usize,
    /// Its messages.
    pub messages: usize,
    /// The provider's answer time.
    pub latency: Duration,
}

/// Who sends a row's workload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MatrixClient {
    /// sluice's pacer (its tower layer), configured with the row's limits
    /// and told nothing of its knobs.
    Pacer,
    /// A client that sends at will and backs off with full jitter on 429
    /// (1 s doubling to 60 s, 30 attempts).
    Naive,
}

/// What a client did with a row's workload by the stop.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MatrixRun {
    /// Answers finished by the stop, and their tokens.
    pub finished: Tally,
    /// 429s the provider answered (all keys).
    pub violations: u64,
    /// Requests that ended in an error.
    pub failed: u64,
}

fn sim(tpm: u32, rpm: u32) -> SimulatorConfig {
    SimulatorConfig {
        tpm,
        rpm,
        completion_tokens: 200,
        ..SimulatorConfig::default()
    }
}

fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s)
}

/// The rows: a plain provider, then each knob alone, then together.
pub fn matrix_rows() -> Vec<MatrixRow> {
    let tpm_bound = MatrixWorkload {
        per_minute: 35.0,
        prompt_words: (200, 700),
        messages: (1, 6),
        max_tokens: 250,
        latency: (secs(0.5), secs(6.0)),
        models: vec!["gpt-4o"],
    };
    let rpm_bound = MatrixWorkload {
        per_minute: 68.0,
        prompt_words: (20, 80),
        messages: (1, 4),
        max_tokens: 40,
        latency: (secs(0.3), secs(3.0)),
        models: vec!["gpt-4o"],
    };
    let row = |name, cfg: SimulatorConfig, workload: &MatrixWorkload| MatrixRow {
        name,
        style: ApiStyle::OpenAi,
        keys: vec![cfg],
        models: Vec::new(),
        workload: workload.clone(),
    };
    let tpm = sim(20_000, 500);
    let rpm = sim(200_000, 60);
    vec![
        row("plain rolling minute", tpm, &tpm_bound),
        row(
            "tokenizer counts +15 %",
            SimulatorConfig {
                prompt_percent: 115,
                ..tpm
            },
            &tpm_bound,
        ),
        row(
            "tokenizer counts −15 %",
            SimulatorConfig {
                prompt_percent: 85,
                ..tpm
            },
            &tpm_bound,
        ),
        row(
            "per-message overhead +9",
            SimulatorConfig {
                message_overhead: 9,
                ..tpm
            },
            &tpm_bound,
        ),
        row(
            "arrival 300 ms + jitter 0–200 ms",
            SimulatorConfig {
                arrival_delay: secs(0.3),
                arrival_jitter: secs(0.2),
                ..tpm
            },
            &tpm_bound,
        ),
        row(
            "window anchored at arrival",
            SimulatorConfig {
                anchored: true,
                ..tpm
            },
            &tpm_bound,
        ),
        row(
            "no rate-limit headers, +15 %",
            SimulatorConfig {
                headers: false,
                prompt_percent: 115,
                ..tpm
            },
            &tpm_bound,
        ),
        row(
            "RPM in 1 s slices",
            SimulatorConfig {
                rpm_slice: secs(1.0),
                arrival_jitter: secs(0.01),
                ..rpm
            },
            &rpm_bound,
        ),
        row(
            "RPM in 10 s slices, jitter 0–100 ms",
            SimulatorConfig {
                rpm_slice: secs(10.0),
                arrival_delay: secs(0.1),
                arrival_jitter: secs(0.1),
                ..rpm
            },
            &rpm_bound,
        ),
        MatrixRow {
            name: "two models, each its own limits",
            style: ApiStyle::OpenAi,
            keys: vec![sim(200_000, 2_000)],
            models: vec![
                SimModel::new("gpt-4o", 10_000, 500),
                SimModel::new("gpt-4o-mini", 20_000, 1_000),
            ],
            workload: MatrixWorkload {
                per_minute: 36.0,
                models: vec!["gpt-4o", "gpt-4o-mini"],
                ..tpm_bound.clone()
            },
        },
        MatrixRow {
            name: "two keys, each its own limits",
            style: ApiStyle::OpenAi,
            keys: vec![sim(20_000, 500), sim(10_000, 500)],
            models: Vec::new(),
            workload: MatrixWorkload {
                per_minute: 54.0,
                ..tpm_bound.clone()
            },
        },
        MatrixRow {
            name: "Anthropic style, +10 %, overhead +5, anchored",
            style: ApiStyle::Anthropic,
            keys: vec![SimulatorConfig {
                prompt_percent: 110,
                message_overhead: 5,
                anchored: true,
                ..tpm
            }],
            models: Vec::new(),
            workload: tpm_bound.clone(),
        },
        MatrixRow {
            name: "all knobs: two models, drift, delay, slices, no headers",
            style: ApiStyle::OpenAi,
            keys: vec![SimulatorConfig {
                prompt_percent: 112,
                message_overhead: 4,
                arrival_delay: secs(0.2),
                arrival_jitter: secs(0.05),
                rpm_slice: secs(10.0),
                anchored: true,
                headers: false,
                ..sim(40_000, 80)
            }],
            models: vec![SimModel::new("gpt-4o", 15_000, 60)],
            workload: MatrixWorkload {
                per_minute: 60.0,
                models: vec!["gpt-4o", "gpt-4o-mini"],
                ..tpm_bound
            },
        },
    ]
}

fn secret(i: usize) -> String {
    format!("sk-matrix-{i}")
}

impl MatrixRow {
    /// The row's arrivals until `stop`, drawn from `seed`.
    pub fn jobs(&self, seed: u64, stop: Duration) -> Vec<MatrixJob> {
        let w = &self.workload;
        let mut rng = fastrand::Rng::with_seed(seed);
        let mut jobs = Vec::new();
        let mut t = 0.0f64;
        let end = stop.as_secs_f64();
        let per_minute = w.per_minute.max(0.001);
        loop {
            // Exponential gaps: a Poisson stream.
            t += -(1.0 - rng.f64()).ln() * 60.0 / per_minute;
            if t >= end {
                break;
            }
            let (lo, hi) = (
                w.latency.0.as_secs_f64().ln(),
                w.latency.1.as_secs_f64().ln(),
            );
            let latency =
                Duration::from_millis(((lo + (hi - lo) * rng.f64()).exp() * 1000.0) as u64);
            jobs.push(MatrixJob {
                at: Duration::from_secs_f64(t),
                model: w
                    .models
                    .get(rng.usize(0..w.models.len().max(1)))
                    .copied()
                    .unwrap_or("gpt-4o"),
                words: rng.usize(w.prompt_words.0..=w.prompt_words.1.max(w.prompt_words.0)),
                messages: rng.usize(w.messages.0.max(1)..=w.messages.1.max(w.messages.0).max(1)),
                latency,
            });
        }
        jobs
    }

    fn path(&self) -> &'static str {
        match self.style {
            ApiStyle::OpenAi => "/v1/chat/completions",
            ApiStyle::Anthropic => "/v1/messages",
        }
    }

    /// The request body of `job`: its words spread over its messages.
    pub fn body(&self, job: &MatrixJob) -> Value {
        let n = job.messages.max(1);
        let messages: Vec<Value> = (0..n)
            .map(|i| {
                let words = job.words / n + usize::from(i < job.words % n);
                let role = if (n - 1 - i).is_multiple_of(2) {
                    "user"
                } else {
                    "assistant"
                };
                json!({"role": role, "content": " tok".repeat(words)})
            })
            .collect();
        json!({"model": job.model, "max_tokens": self.workload.max_tokens, "messages": messages})
    }

    fn first(&self) -> SimulatorConfig {
        self.keys.first().copied().unwrap_or_default()
    }

    /// What the provider counts for each job.
    pub fn items(&self, jobs: &[MatrixJob]) -> Vec<ScheduleItem> {
        let cfg = self.first();
        let opts = EstimateOptions::new(cfg.encoding, cfg.default_max_tokens);
        jobs.iter()
            .map(|j| {
                let body = self.body(j);
                let est = estimate(self.style, self.path(), &body, &opts);
                ScheduleItem {
                    at: j.at,
                    model: j.model.to_owned(),
                    input: u64::from(provider_prompt(&cfg, est.prompt, &body)),
                    budget: u64::from(est.completion),
                    output: u64::from(cfg.completion_tokens.min(est.completion)),
                    latency: j.latency,
                }
            })
            .collect()
    }

    /// The best schedule of `jobs` under the row's rules by `stop`: the
    /// better of in order and reordered ([`best_schedule`]).
    pub fn best(&self, jobs: &[MatrixJob], stop: Duration) -> Tally {
        let items = self.items(jobs);
        let a = best_schedule(&self.keys, &self.models, &items, stop, false);
        let b = best_schedule(&self.keys, &self.models, &items, stop, true);
        if a.tokens >= b.tokens { a } else { b }
    }

    fn limits(cfg: &SimulatorConfig) -> ProviderLimits {
        ProviderLimits::new(cfg.tpm, cfg.rpm, cfg.rpd).with_io(cfg.itpm, cfg.otpm)
    }

    /// The pace config a user would write for this provider: its keys'
    /// and models' limits, nothing of its knobs.
    pub fn pace_config(&self) -> PaceConfig {
        let mut p = ProviderConfig::new("sim", "http://sim.local/v1", Self::limits(&self.first()));
        p.style = self.style;
        p.auth_header = self.style.default_auth_header();
        // A backlog waits its turn rather than fail.
        p.max_wait = Duration::from_secs(24 * 3600);
        p = p.with_models(self.models.iter().map(|m| {
            ModelLimits::new(
                &m.pattern,
                ProviderLimits::new(m.tpm, m.rpm, 0).with_io(m.itpm, m.otpm),
            )
        }));
        if self.keys.len() > 1 {
            p = p.with_api_keys(
                self.keys
                    .iter()
                    .enumerate()
                    .map(|(i, k)| ApiKey::new(&format!("key{i}"), &secret(i), Self::limits(k))),
            );
        }
        PaceConfig::from_providers([p])
    }

    /// Runs `jobs` through `client` against the row's provider until
    /// `stop` (on tokio's clock: pause it for a run that takes no real
    /// time), the jitter drawn from `seed`.
    pub async fn run(
        &self,
        client: MatrixClient,
        jobs: &[MatrixJob],
        stop: Duration,
        seed: u64,
    ) -> MatrixRun {
        let clock = TokioClock::at(TEST_EPOCH);
        let sims: Vec<SimService> = self
            .keys
            .iter()
            .enumerate()
            .map(|(i, k)| {
                let s = SimService::new(
                    SimulatorConfig {
                        seed: seed.wrapping_add(i as u64),
                        ..*k
                    },
                    Arc::new(clock),
                );
                s.set_models(self.models.iter().cloned());
                s
            })
            .collect();
        let routes = Arc::new(sims.clone());
        let router = tower::service_fn(move |req: Request<Full<Bytes>>| {
            let routes = routes.clone();
            async move {
                let h = req.headers();
                let key = h
                    .get("authorization")
                    .or_else(|| h.get("x-api-key"))
                    .and_then(|v| v.to_str().ok())
                    .map(|v| v.trim_start_matches("Bearer ").to_owned());
                let i = key
                    .and_then(|k| (0..routes.len()).find(|&i| secret(i) == k))
                    .unwrap_or(0);
                match routes.get(i) {
                    Some(sim) => sim.clone().call(req).await,
                    None => Ok(http::Response::new(Full::new(Bytes::new()).boxed())),
                }
            }
        });
        let out = Arc::new(parking_lot::Mutex::new(MatrixRun::default()));
        let end = TEST_EPOCH.saturating_add(stop);
        let mut tasks = Vec::new();
        let paced = match client {
            MatrixClient::Pacer => {
                let source: Arc<dyn LimitsSource> = Arc::new(StaticLimits::new(self.pace_config()));
                let pacer = Pacer::with_store(
                    sluice_store::MemoryStore::with_clock(
                        sluice_store::MemoryConfig::default(),
                        clock,
                    ),
                    clock,
                    source,
                );
                Some(PacerLayer::new(pacer, "sim").layer(router.clone()))
            }
            MatrixClient::Naive => None,
        };
        for (n, job) in jobs.iter().enumerate() {
            let body = Bytes::from(self.body(job).to_string());
            let path = self.path();
            let latency = job.latency.as_millis().to_string();
            let request = move |key: Option<usize>| {
                let mut r = Request::post(format!("http://sim.local{path}"))
                    .header("content-type", "application/json")
                    .header(LATENCY_HEADER, latency.as_str());
                if let Some(k) = key {
                    r = r.header("authorization", format!("Bearer {}", secret(k)));
                }
                r.body(Full::new(body.clone()))
            };
            let out = out.clone();
            let at = clock.instant_at(TEST_EPOCH.saturating_add(job.at));
            let keys = self.keys.len();
            let paced = paced.clone();
            let mut router = router.clone();
            tasks.push(tokio::spawn(async move {
                tokio::time::sleep_until(at).await;
                let ok = match paced {
                    Some(mut svc) => {
                        let Ok(req) = request(None) else { return };
                        let r = match ServiceExt::<Request<Full<Bytes>>>::ready(&mut svc).await {
                            Ok(s) => s.call(req).await.ok(),
                            Err(_) => None,
                        };
                        match r {
                            Some(resp) if resp.status() == 200 => {
                                resp.into_body().collect().await.ok().map(|b| b.to_bytes())
                            }
                            _ => None,
                        }
                    }
                    None => {
                        let mut rng = fastrand::Rng::with_seed(n as u64);
                        let mut got = None;
                        for attempt in 0..30u32 {
                            let Ok(req) = request(Some(n % keys.max(1))) else {
                                break;
                            };
                            let Ok(resp) = router.call(req).await;
                            if resp.status() == 429 {
                                // Full jitter, 1 s doubling to 60 s.
                                let ceiling = (1u64 << attempt.min(6)).min(60) * 1000;
                                tokio::time::sleep(Duration::from_millis(rng.u64(0..=ceiling)))
                                    .await;
                                continue;
                            }
                            got = resp.into_body().collect().await.ok().map(|b| b.to_bytes());
                            break;
                        }
                        got
                    }
                };
                let mut o = out.lock();
                match ok {
                    Some(b) if sluice_core::Clock::now(&clock) <= end => {
                        o.finished.add(usage_total(&b));
                    }
                    Some(_) => {}
                    None => o.failed += 1,
                }
            }));
        }
        tokio::time::sleep_until(clock.instant_at(end)).await;
        for t in &tasks {
            t.abort();
        }
        let mut run = *out.lock();
        run.violations = sims.iter().map(|s| s.stats().violations).sum();
        run
    }
}

/// The tokens an answer's `usage` reports (OpenAI's or Anthropic's).
fn usage_total(body: &[u8]) -> u64 {
    let v: Value = serde_json::from_slice(body).unwrap_or_default();
    let u = &v["usage"];
    u["total_tokens"].as_u64().unwrap_or_else(|| {
        u["input_tokens"].as_u64().unwrap_or(0) + u["output_tokens"].as_u64().unwrap_or(0)
    })
}
