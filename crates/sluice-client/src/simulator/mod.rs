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
//!
//! Real providers count by their own rules, and the knobs of
//! [`SimulatorConfig`] turn the simulator into one that does: a tokenizer
//! that counts more or less than the client's (`prompt_percent`), its own
//! per-message overhead (`message_overhead`), requests counted when they
//! arrive after a delay and jitter (`arrival_delay`, `arrival_jitter`),
//! RPM enforced over sub-minute slices as Azure does (`rpm_slice`), minutes
//! anchored at an arrival (`anchored`), no rate-limit headers (`headers`);
//! models ([`SimService::set_models`]) and keys (one simulator each) with
//! their own limits. [`best_schedule`] is the most any client could finish
//! under those rules, and [`matrix_rows`] the rows the pacer is held to.
//!
//! The module's rooms: `config` what the provider is told to be; `book` the
//! rules it counts by; `answer` and `headers` what it answers; `server` how
//! it is reached; `best` the best schedule under its rules; `matrix` the
//! rows the pacer is measured on.

mod answer;
mod best;
mod book;
mod config;
mod headers;
mod matrix;
mod server;

pub use answer::SimBody;
pub use best::{ScheduleItem, Tally, best_schedule};
pub use config::{LATENCY_HEADER, SimModel, SimulatorConfig, SimulatorStats};
pub use matrix::{MatrixClient, MatrixJob, MatrixRow, MatrixRun, MatrixWorkload, matrix_rows};
pub use server::{SimService, Simulator};

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::time::Duration;

    use super::headers::fmt_duration;

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
