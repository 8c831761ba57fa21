//! Buckets, quota families, and how any budget counts (`mode:`, `algorithm:`).

use std::fmt;
use std::num::NonZeroU32;
use std::time::Duration;

/// Whose an extra bucket is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Per {
    /// The client IP (IPv6 by prefix).
    Ip,
    /// The credential (or the IP when there is none).
    Caller,
    /// The principal's user.
    User,
    /// The principal's workspace.
    Workspace,
}

/// How a refusal by a budget looks to the client.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The edge limiter's plain-text 429.
    Edge,
    /// The JSON envelope with `retry_at` and `retry_after_seconds`;
    /// `{retry_after}` in the message is replaced by the seconds.
    Envelope {
        /// The message template.
        message: String,
    },
}

/// An extra named bucket, or a weighted budget.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bucket {
    /// Its name (used in keys and headers).
    pub name: String,
    /// Units per window.
    pub limit: NonZeroU32,
    /// Window length in seconds.
    pub window: NonZeroU32,
    /// Whose bucket.
    pub per: Per,
    /// How a refusal looks.
    pub refusal: Refusal,
    /// Weighted: admission needs one unit, and the upstream's cost header
    /// (`X-Sluice-Cost`) then says what the call really spent. The
    /// responses of a request holding it describe this budget in `X-RateLimit-*`.
    pub weighted: bool,
    /// What an exhausted budget does to a request.
    pub on_exhausted: OnExhausted,
    /// Enforced, or decided and counted without refusing (a dry run).
    pub mode: Enforcement,
    /// How it counts its limit per window.
    pub algorithm: Algorithm,
    /// Decided on the shared store each time, or from leases of it (SPEC D4;
    /// `buckets:` only: token and money budgets stay exact).
    pub consistency: Consistency,
    /// A token budget (`tokens:` in a policy file): counted in the tokens an LLM
    /// call spends, reserved from its body and settled at the upstream's `usage`.
    pub tokens: Option<TokenBudget>,
}

/// What makes a bucket a token budget (SPEC T1): how the tokens of a call are
/// weighed, what a call that names no output budget reserves, and its period.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenBudget {
    /// Thousandths of a unit charged per input token (1000: one unit a token).
    pub input_milli: u32,
    /// Thousandths of a unit charged per output token.
    pub output_milli: u32,
    /// Thousandths of a unit charged per cached input token (of the input, read
    /// from the provider's cache).
    pub cached_input_milli: u32,
    /// Output tokens reserved for a call that names no `max_tokens` (or kin).
    pub default_max_output: u32,
    /// Counted per calendar month (UTC), durably, instead of per window.
    pub monthly: bool,
    /// A money budget (`spend:`): counted in [`MONEY_UNITS_PER_USD`] ths of a
    /// dollar at the call's model's [`Price`], not by the weights.
    pub priced: bool,
}

/// Units of a money budget per US dollar: a hundred-thousandth of a dollar each
/// (a thousandth of a cent), so a budget holds up to 42,949.67 USD and a call is
/// charged within a thousandth of a cent of its price.
pub const MONEY_UNITS_PER_USD: u64 = 100_000;

/// The price of a model (`prices:`; SPEC T4), per token, in millionths of a
/// money unit (a price of 2.50 USD per million tokens is 250,000).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Price {
    /// The model's name, or a prefix of names ending in `*`.
    pub model: String,
    /// Per input token (not from the cache).
    pub input: u64,
    /// Per output token.
    pub output: u64,
    /// Per cached input token.
    pub cached_input: u64,
}

impl Price {
    /// True when this price is `model`'s.
    pub fn matches(&self, model: &str) -> bool {
        match self.model.strip_suffix('*') {
            Some(prefix) => model.starts_with(prefix),
            None => self.model == model,
        }
    }

    /// Money units a call of `input` tokens (of which `cached_input` from the
    /// cache) and `output` tokens costs, rounded up.
    pub fn cost(&self, input: u32, cached_input: u32, output: u32) -> u32 {
        let cached = u128::from(cached_input.min(input));
        let fresh = u128::from(input) - cached;
        let micro = fresh * u128::from(self.input)
            + cached * u128::from(self.cached_input)
            + u128::from(output) * u128::from(self.output);
        u32::try_from(micro.div_ceil(1_000_000)).unwrap_or(u32::MAX)
    }
}

impl TokenBudget {
    /// Units a call of `input` tokens (of which `cached_input` from the cache)
    /// and `output` tokens spends, rounded up.
    pub fn charge(&self, input: u32, cached_input: u32, output: u32) -> u32 {
        let cached = u64::from(cached_input.min(input));
        let fresh = u64::from(input) - cached;
        let milli = fresh * u64::from(self.input_milli)
            + cached * u64::from(self.cached_input_milli)
            + u64::from(output) * u64::from(self.output_milli);
        u32::try_from(milli.div_ceil(1000)).unwrap_or(u32::MAX)
    }
}

/// The wire format an LLM route speaks (`llm:` on a route; SPEC T1): how its
/// body is estimated, its `usage` read and its refusals and headers written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LlmFormat {
    /// OpenAI's: chat completions, completions, responses, embeddings.
    OpenAi,
    /// Anthropic's messages.
    Anthropic,
}

/// Whether a budget refuses what it does not admit (`mode:` in a policy file).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Enforcement {
    /// Refuses: the default.
    #[default]
    Enforce,
    /// Shadow mode, a dry run: the budget is decided and counted as usual, and a
    /// refusal it would give is counted (`sluice_shadow_refusals_total`) and logged,
    /// and the request is forwarded as if the budget were off.
    Shadow,
}

/// Whether a budget is decided on the shared store every time (`exact`, the
/// default) or from leases of it a replica takes (`leased`, SPEC D4).
///
/// Only class, ceiling and bucket budgets (and the rate-limit service's rules)
/// counted in fixed windows may be leased; quotas, token and money budgets stay
/// exact.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Consistency {
    /// Every decision on the shared store: N replicas admit the limit together.
    #[default]
    Exact,
    /// Decided from leases: N replicas admit at most `limit + N × units` per
    /// window ([`sluice_core::LeaseTerms::bound`]).
    Leased(sluice_core::LeaseTerms),
}

impl Consistency {
    /// The lease terms of a leased budget.
    pub const fn lease(self) -> Option<sluice_core::LeaseTerms> {
        match self {
            Consistency::Exact => None,
            Consistency::Leased(t) => Some(t),
        }
    }
}

/// A budget's `consistency:`, `lease:` and `lease_ms:` as written (SPEC D4),
/// checked the same way wherever a budget may be leased: classes, ceilings,
/// buckets and the rate-limit service's descriptor rules.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct LeaseSpec<'a> {
    /// `exact` (also when absent) or `leased`.
    pub consistency: Option<&'a str>,
    /// `leased` only: the most units one replica takes at once.
    pub lease: Option<u32>,
    /// `leased` only: the longest a lease lives, in milliseconds.
    pub lease_ms: Option<u32>,
}

impl LeaseSpec<'_> {
    /// The consistency of a budget counted by `algorithm` in windows of
    /// `window` seconds, whose limits are `limits` (each with where it is set),
    /// or each problem as (key, message).
    pub(crate) fn check(
        self,
        algorithm: Algorithm,
        window: u32,
        limits: &[(String, u32)],
    ) -> Result<Consistency, Vec<(&'static str, String)>> {
        let mut problems = Vec::new();
        match self.consistency {
            None | Some("exact") => {
                for (key, set) in [
                    ("lease", self.lease.is_some()),
                    ("lease_ms", self.lease_ms.is_some()),
                ] {
                    if set {
                        problems.push((
                            key,
                            format!("`{key}` is for `consistency: leased`; this budget is exact"),
                        ));
                    }
                }
                if problems.is_empty() {
                    return Ok(Consistency::Exact);
                }
            }
            Some("leased") => {
                if algorithm != Algorithm::Fixed {
                    problems.push((
                        "consistency",
                        format!(
                            "a leased budget counts in fixed windows; this one is {} (make it `algorithm: fixed` or `consistency: exact`)",
                            algorithm.name()
                        ),
                    ));
                }
                let units = match self.lease {
                    None => {
                        problems.push((
                            "lease",
                            "required with `consistency: leased`: the most units one replica takes at once, 1 to the limit".to_owned(),
                        ));
                        None
                    }
                    Some(0) => {
                        problems.push((
                            "lease",
                            "must be at least 1: the most units one replica takes at once"
                                .to_owned(),
                        ));
                        None
                    }
                    Some(lease) => {
                        for (whose, limit) in limits {
                            if lease > *limit {
                                problems.push((
                                    "lease",
                                    format!(
                                        "a lease of {lease} is larger than the limit {limit}{whose}: at most the limit"
                                    ),
                                ));
                            }
                        }
                        NonZeroU32::new(lease)
                    }
                };
                let millis = self.lease_ms.unwrap_or(sluice_core::MAX_LEASE_MILLIS);
                let window_ms = u64::from(window) * 1000;
                if millis == 0 || millis > sluice_core::MAX_LEASE_MILLIS {
                    problems.push((
                        "lease_ms",
                        format!(
                            "expected 1 to {} milliseconds (a lease lives at most 1 s), got {millis}",
                            sluice_core::MAX_LEASE_MILLIS
                        ),
                    ));
                } else if u64::from(millis) > window_ms {
                    problems.push((
                        "lease_ms",
                        format!(
                            "{millis} ms is longer than the window of {window} s: a lease never outlives its window"
                        ),
                    ));
                }
                if let (Some(units), Some(millis), true) =
                    (units, NonZeroU32::new(millis), problems.is_empty())
                {
                    return Ok(Consistency::Leased(sluice_core::LeaseTerms::new(
                        units, millis,
                    )));
                }
            }
            Some(other) => {
                problems.push((
                    "consistency",
                    format!("expected exact or leased, got {other:?}"),
                ));
            }
        }
        Err(problems)
    }
}

/// How a budget counts its limit per window (`algorithm:` in a policy file).
///
/// Quotas are calendar months and take none; every other budget (a class, a per-IP
/// ceiling, a bucket) takes one, `fixed` by default.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Algorithm {
    /// `fixed`, the default and the seed's: `limit` per window, windows aligned to
    /// the Unix epoch (every replica agrees where one starts); a whole window's
    /// worth may go at its end and again at the start of the next.
    #[default]
    Fixed,
    /// `sliding`: at most `limit` in any `window_seconds`, counted exactly
    /// ([`sluice_core::Rate::RollingWindow`]) in [`SLIDING_SLOTS`] epoch-aligned
    /// slots per window. A unit counts from when it is spent until a window after
    /// the end of its slot: never shorter than the window, at most one slot (a
    /// sixtieth of it) longer. A refusal's wait is exact: until enough of the oldest
    /// slots have left.
    Sliding,
    /// `gcra`: `limit` per window evenly spaced (one unit every
    /// `window / limit`), at most `burst` back to back
    /// ([`sluice_core::Rate::Gcra`]).
    Gcra {
        /// How many units may go at once; `None` is the budget's limit (as governor's
        /// quotas do), so that a class's burst follows the active profile.
        burst: Option<NonZeroU32>,
    },
}

/// Slots per window of a [`Algorithm::Sliding`] budget: a unit is held at most a
/// sixtieth of the window longer than the window (a second on a minute), and a
/// decision reads at most 62 cells of it.
pub const SLIDING_SLOTS: u32 = 60;

/// The longest `window_seconds` of a [`Algorithm::Sliding`] budget: its window is
/// counted in milliseconds, in 32 bits.
pub const MAX_SLIDING_WINDOW_SECONDS: u32 = u32::MAX / 1000;

impl Algorithm {
    /// Its name in policy files: `fixed`, `sliding` or `gcra`.
    pub const fn name(self) -> &'static str {
        match self {
            Algorithm::Fixed => "fixed",
            Algorithm::Sliding => "sliding",
            Algorithm::Gcra { .. } => "gcra",
        }
    }

    /// The rate a store decides a budget of `limit` per `window` seconds counted
    /// this way by.
    pub fn rate(self, window: NonZeroU32, limit: NonZeroU32) -> sluice_core::Rate {
        use sluice_core::Rate;
        match self {
            Algorithm::Fixed => Rate::FixedWindow { seconds: window },
            Algorithm::Sliding => {
                // The validator keeps a sliding window within
                // MAX_SLIDING_WINDOW_SECONDS; saturating keeps any other at 49 days.
                let millis = window.saturating_mul(NonZeroU32::MIN.saturating_add(999));
                let slot = NonZeroU32::new(millis.get().div_ceil(SLIDING_SLOTS))
                    .unwrap_or(NonZeroU32::MIN);
                Rate::RollingWindow {
                    millis,
                    slot_millis: slot,
                }
            }
            Algorithm::Gcra { burst } => Rate::Gcra {
                period: Duration::from_secs(u64::from(window.get())),
                burst: burst.unwrap_or(limit),
            },
        }
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Algorithm::Gcra { burst: Some(b) } => write!(f, "gcra, burst {b}"),
            Algorithm::Gcra { burst: None } => f.write_str("gcra, burst = limit"),
            other => f.write_str(other.name()),
        }
    }
}

/// What an exhausted bucket does to a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnExhausted {
    /// Refuse it (429).
    Refuse,
    /// Forward it with `X-Sluice-Exhausted: <budget>; retry-after=<seconds>` and let
    /// the upstream answer (a "fuzzy lane").
    Pass,
}

/// A monthly verb quota per workspace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuotaFamily {
    /// Its name (`search`, `evals`, `messages`, …).
    pub name: String,
    /// Calls per calendar month (UTC); `None` = uncapped (counted, never refused).
    pub monthly: Option<NonZeroU32>,
    /// Enforced, or decided and counted without refusing (a dry run).
    pub mode: Enforcement,
}

impl QuotaFamily {
    /// The limit a budget of this family counts against (`u32::MAX` when uncapped).
    pub fn limit(&self) -> u32 {
        self.monthly.map_or(u32::MAX, NonZeroU32::get)
    }
}

/// The most quota families a policy may declare.
pub const MAX_QUOTA_FAMILIES: usize = 8;

/// The most buckets a policy may declare (a JSON-RPC body names the ones its
/// tools spend in a bit set).
pub const MAX_BUCKETS: usize = 32;

/// What a call spends besides its class budget: route buckets and a quota family.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Spends {
    /// Indices into [`Policy::buckets`](crate::Policy::buckets).
    pub buckets: Vec<usize>,
    /// Index into [`Policy::quotas`](crate::Policy::quotas).
    pub quota: Option<usize>,
    /// Index into [`Policy::lanes`](crate::Policy::lanes): the lane that guards the call.
    pub lane: Option<usize>,
}
