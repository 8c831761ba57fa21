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
    /// Tokens the provider counts per message beyond what the client's
    /// estimator counts for one (its own per-message overhead; negative:
    /// fewer), added to each request's prompt after
    /// [`prompt_percent`](Self::prompt_percent); a prompt never counts
    /// below 0.
    pub message_overhead: i32,
    /// Time from a request reaching the simulator to the provider counting
    /// it: the provider's windows count a request when it *arrives*, not
    /// when the client sent it.
    pub arrival_delay: Duration,
    /// A random extra delay, uniform in `[0, arrival_jitter]`, added to
    /// [`arrival_delay`](Self::arrival_delay) per request (so requests may
    /// arrive in another order than they were sent).
    pub arrival_jitter: Duration,
    /// Seed of the jitter's random stream (the same seed, the same delays
    /// for the same order of requests).
    pub seed: u64,
    /// A sub-minute request slice (zero: none): besides the RPM over the
    /// minute, at most `⌈rpm × rpm_slice / 60 s⌉` requests in any rolling
    /// `rpm_slice` (Azure OpenAI enforces its RPM over 1 s or 10 s slices).
    pub rpm_slice: Duration,
    /// Minute windows anchored at arrival: a fixed 60 s window opens when a
    /// request arrives after the last one closed, and everything it counted
    /// leaves together when it closes (instead of each request leaving the
    /// rolling window 60 s after its own arrival).
    pub anchored: bool,
    /// Rate-limit headers on answers (`x-ratelimit-*`, `anthropic-ratelimit-*`,
    /// `Retry-After`); without them a 429 says when only in its body.
    pub headers: bool,
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
            message_overhead: 0,
            arrival_delay: Duration::ZERO,
            arrival_jitter: Duration::ZERO,
            seed: 0,
            rpm_slice: Duration::ZERO,
            anchored: false,
            headers: true,
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
    /// Of those, over a sub-minute request slice
    /// ([`SimulatorConfig::rpm_slice`]).
    pub slice_violations: u64,
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

/// How a book's windows run: a sub-minute request slice, anchored minutes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Rules {
    pub(super) slice: Duration,
    pub(super) anchored: bool,
}

impl From<&SimulatorConfig> for Rules {
    fn from(c: &SimulatorConfig) -> Self {
        Rules {
            slice: c.rpm_slice.min(MINUTE),
            anchored: c.anchored,
        }
    }
}

impl Rules {
    /// Requests allowed in one slice of an `rpm` limit (0: no slice limit).
    pub(super) fn slice_limit(&self, rpm: u32) -> u64 {
        if self.slice.is_zero() || rpm == 0 {
            return 0;
        }
        let per = u128::from(rpm) * self.slice.as_nanos();
        u64::try_from(per.div_ceil(MINUTE.as_nanos()))
            .unwrap_or(u64::MAX)
            .max(1)
    }
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
