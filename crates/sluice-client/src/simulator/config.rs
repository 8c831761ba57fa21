//! How the simulated provider behaves and what it counts: its limits and
//! answers ([`SimulatorConfig`]), models with their own limits
//! ([`SimModel`]), and its counters ([`SimulatorStats`]).

use std::time::Duration;

use crate::tokens::Encoding;

pub(super) const MINUTE: Duration = Duration::from_secs(60);
/// A request header setting that request's latency, in milliseconds.
pub const LATENCY_HEADER: &str = "x-simulator-latency-ms";
pub(super) const DAY: Duration = Duration::from_secs(86_400);

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
    /// The provider counts (and reports in `usage`) prompts at this many
    /// percent of what [`encoding`](Self::encoding) makes of them (default
    /// 100): a provider whose tokenizer or per-message overhead differs
    /// from the client's estimate (130: it counts 1.3× the estimate).
    pub prompt_percent: u32,
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
            prompt_percent: 100,
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

    pub(super) fn limits(&self) -> Limits {
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
pub(super) struct Limits {
    pub(super) tpm: u32,
    pub(super) rpm: u32,
    pub(super) rpd: u32,
    pub(super) itpm: u32,
    pub(super) otpm: u32,
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
