//! `buckets:` and `quotas:`, the `mode:` of any budget and the `algorithm:` and
//! `burst:` it takes.

use std::collections::HashMap;
use std::num::NonZeroU32;

use crate::model::{
    Algorithm, Bucket, Consistency, Enforcement, MAX_BUCKETS, MAX_QUOTA_FAMILIES,
    MAX_SLIDING_WINDOW_SECONDS, MONEY_UNITS_PER_USD, OnExhausted, Per, Price, QuotaFamily, Refusal,
    TokenBudget,
};

/// The index of each bucket, token budget and money budget by name.
pub(super) struct BudgetIndex {
    pub(super) buckets: HashMap<String, usize>,
    pub(super) tokens: HashMap<String, usize>,
    pub(super) spend: HashMap<String, usize>,
}
use crate::raw::RawPolicy;

use super::Checker;

impl Checker {
    /// `buckets:` and `tokens:` (a token budget is a bucket that counts tokens),
    /// each checked, with the index of each bucket and of each token budget by
    /// name.
    pub(super) fn buckets(&mut self, raw: &RawPolicy) -> (BudgetIndex, Vec<Bucket>) {
        let mut bucket_index = HashMap::new();
        let mut token_index = HashMap::new();
        let mut spend_index = HashMap::new();
        let mut buckets = Vec::new();
        for (name, b) in &raw.buckets {
            let plan_limits: Vec<(&str, u32)> = raw
                .plans
                .iter()
                .filter_map(|(plan, p)| Some((plan.as_str(), *p.buckets.get(name)?)))
                .collect();
            if let Some(bucket) = self.bucket(name, b, &plan_limits) {
                bucket_index.insert(name.clone(), buckets.len());
                buckets.push(bucket);
            }
        }
        for (name, t) in &raw.tokens {
            if raw.buckets.contains_key(name) {
                // One name, one set of counters: a bucket and a token budget of one
                // name would share them.
                self.problem(
                    format!("tokens.{name}"),
                    "a bucket has this name; give the token budget another",
                );
                continue;
            }
            if let Some(bucket) = self.token_budget(name, t) {
                token_index.insert(name.clone(), buckets.len());
                buckets.push(bucket);
            }
        }
        for (name, m) in &raw.spend {
            if raw.buckets.contains_key(name) || raw.tokens.contains_key(name) {
                self.problem(
                    format!("spend.{name}"),
                    "a bucket or a token budget has this name; give the money budget another",
                );
                continue;
            }
            if let Some(bucket) = self.money_budget(name, m) {
                spend_index.insert(name.clone(), buckets.len());
                buckets.push(bucket);
            }
        }
        if raw.buckets.len() + raw.tokens.len() + raw.spend.len() > MAX_BUCKETS {
            self.problem(
                "buckets",
                format!("at most {MAX_BUCKETS} buckets, token and money budgets"),
            );
        }
        let index = BudgetIndex {
            buckets: bucket_index,
            tokens: token_index,
            spend: spend_index,
        };
        (index, buckets)
    }

    /// The money budget `name` (SPEC T4) as the bucket that counts it, in
    /// [`MONEY_UNITS_PER_USD`] ths of a dollar a calendar month.
    fn money_budget(&mut self, name: &str, m: &crate::raw::RawSpend) -> Option<Bucket> {
        let at = format!("spend.{name}");
        let per = self.per(&at, &m.per);
        if per == Some(Per::Ip) {
            self.problem(
                format!("{at}.per"),
                "a money budget is a caller's, a user's or a workspace's",
            );
        }
        if !m.monthly {
            self.problem(
                &at,
                "`monthly: true` is required: money budgets count calendar months",
            );
        }
        if m.consistency.as_deref().is_some_and(|c| c != "exact") {
            self.problem(
                format!("{at}.consistency"),
                "a money budget stays exact (SPEC D4): only class, ceiling and bucket budgets (and rate-limit service rules) in fixed windows may be `leased`; remove it or write `exact`",
            );
        }
        let limit = self.usd(&format!("{at}.limit_usd"), &m.limit_usd);
        let mode = self.mode(&format!("{at}.mode"), m.mode.as_deref());
        let (per, limit, mode) = (per?, limit?, mode?);
        Some(Bucket {
            name: name.to_owned(),
            limit,
            window: NonZeroU32::MIN,
            per,
            refusal: Refusal::Envelope {
                message: "Money budget spent until the month turns.".to_owned(),
            },
            weighted: true,
            on_exhausted: OnExhausted::Refuse,
            mode,
            algorithm: Algorithm::Fixed,
            consistency: Consistency::Exact,
            tokens: Some(TokenBudget {
                input_milli: 0,
                output_milli: 0,
                cached_input_milli: 0,
                default_max_output: m.default_max_output.unwrap_or(4096).min(10_000_000),
                monthly: true,
                priced: true,
            }),
        })
    }

    /// A money limit in US dollars, in [`MONEY_UNITS_PER_USD`] units: above 0 and
    /// at most what a budget's `u32` holds.
    pub(super) fn usd(&mut self, at: &str, usd: &serde_json::Number) -> Option<NonZeroU32> {
        let max_usd = f64::from(u32::MAX) / MONEY_UNITS_PER_USD as f64;
        let limit = match usd.as_f64() {
            Some(x) if x > 0.0 && x <= max_usd => {
                NonZeroU32::new((x * MONEY_UNITS_PER_USD as f64).round() as u32)
            }
            _ => None,
        };
        if limit.is_none() {
            self.problem(
                at,
                format!("a number of US dollars above 0 and at most {max_usd:.2}, got {usd}"),
            );
        }
        limit
    }

    /// `prices:`, each checked, in order.
    pub(super) fn prices(&mut self, raw: &RawPolicy) -> Vec<Price> {
        let mut prices = Vec::new();
        for (i, p) in raw.prices.iter().enumerate() {
            let at = format!("prices[{i}]");
            if p.model.is_empty() || p.model.trim_end_matches('*').contains('*') {
                self.problem(
                    format!("{at}.model"),
                    "a model's name, or a prefix ending in `*`",
                );
                continue;
            }
            let mut per_token = |key: &str, usd: Option<&serde_json::Number>| match usd
                .map(serde_json::Number::as_f64)
            {
                Some(Some(usd)) if (0.0..=1_000_000.0).contains(&usd) => {
                    Some((usd * MONEY_UNITS_PER_USD as f64).round() as u64)
                }
                _ => {
                    self.problem(
                        format!("{at}.{key}"),
                        "US dollars per million tokens, from 0 to 1,000,000",
                    );
                    None
                }
            };
            let input = per_token("input", Some(&p.input));
            let output = per_token("output", Some(&p.output));
            let cached = match &p.cached_input {
                Some(c) => per_token("cached_input", Some(c)),
                None => input,
            };
            if let (Some(input), Some(output), Some(cached_input)) = (input, output, cached) {
                prices.push(Price {
                    model: p.model.clone(),
                    input,
                    output,
                    cached_input,
                });
            }
        }
        prices
    }

    /// The token budget `name` (SPEC T1) as the bucket that counts it, or `None`
    /// (with its problems).
    fn token_budget(&mut self, name: &str, t: &crate::raw::RawTokens) -> Option<Bucket> {
        let at = format!("tokens.{name}");
        if t.consistency.as_deref().is_some_and(|c| c != "exact") {
            self.problem(
                format!("{at}.consistency"),
                "a token budget stays exact (SPEC D4: reserved before the call and settled at its usage on the store): only class, ceiling and bucket budgets (and rate-limit service rules) in fixed windows may be `leased`; remove it or write `exact`",
            );
        }
        let per = self.per(&at, &t.per);
        let limit = self.nonzero(&format!("{at}.limit"), t.limit);
        let window = match (t.window_seconds, t.monthly) {
            (Some(w), false) => self.nonzero(&format!("{at}.window_seconds"), w),
            (None, true) => Some(NonZeroU32::MIN),
            (Some(_), true) => {
                self.problem(&at, "`window_seconds` or `monthly: true`, not both");
                None
            }
            (None, false) => {
                self.problem(&at, "`window_seconds: N` or `monthly: true` is required");
                None
            }
        };
        let weight = |v: &mut Self, key: &str, w: Option<&serde_json::Number>, default: u32| {
            let Some(w) = w else {
                return Some(default);
            };
            match w.as_f64() {
                Some(f) if (0.0..=1000.0).contains(&f) => Some((f * 1000.0).round() as u32),
                _ => {
                    v.problem(
                        format!("{at}.weights.{key}"),
                        format!("a number from 0 to 1000, got {w}"),
                    );
                    None
                }
            }
        };
        let input = weight(self, "input", t.weights.input.as_ref(), 1000);
        let output = weight(self, "output", t.weights.output.as_ref(), 1000);
        let cached = weight(
            self,
            "cached_input",
            t.weights.cached_input.as_ref(),
            input.unwrap_or(1000),
        );
        let default_max_output = t.default_max_output.unwrap_or(4096);
        if default_max_output > 10_000_000 {
            self.problem(
                format!("{at}.default_max_output"),
                "at most 10,000,000 tokens",
            );
        }
        let mode = self.mode(&format!("{at}.mode"), t.mode.as_deref());
        let (per, limit, window, input, output, cached, mode) =
            (per?, limit?, window?, input?, output?, cached?, mode?);
        Some(Bucket {
            name: name.to_owned(),
            limit,
            window,
            per,
            refusal: Refusal::Envelope {
                message: "Token budget spent. Try again in {retry_after} seconds.".to_owned(),
            },
            weighted: true,
            on_exhausted: OnExhausted::Refuse,
            mode,
            algorithm: Algorithm::Fixed,
            consistency: Consistency::Exact,
            tokens: Some(TokenBudget {
                input_milli: input,
                output_milli: output,
                cached_input_milli: cached,
                default_max_output: default_max_output.min(10_000_000),
                monthly: t.monthly,
                priced: false,
            }),
        })
    }

    /// `per:` of a budget at `at`.
    fn per(&mut self, at: &str, per: &str) -> Option<Per> {
        match per {
            "ip" => Some(Per::Ip),
            "caller" => Some(Per::Caller),
            "user" => Some(Per::User),
            "workspace" => Some(Per::Workspace),
            other => {
                self.problem(
                    format!("{at}.per"),
                    format!("expected ip, caller, user or workspace, got {other:?}"),
                );
                None
            }
        }
    }

    /// The bucket `name`, or `None` (with its problems) when any of its settings
    /// is wrong.
    pub(super) fn bucket(
        &mut self,
        name: &str,
        b: &crate::raw::RawBucket,
        plan_limits: &[(&str, u32)],
    ) -> Option<Bucket> {
        let at = format!("buckets.{name}");
        let per = self.per(&at, &b.per);
        let refusal = match (b.refusal.as_deref(), &b.message) {
            (None | Some("edge"), None) => Some(Refusal::Edge),
            (None | Some("edge"), Some(_)) => {
                self.problem(
                    format!("{at}.message"),
                    "a message needs `refusal: envelope`",
                );
                None
            }
            (Some("envelope"), m) => Some(Refusal::Envelope {
                message: m.clone().unwrap_or_else(|| {
                    "Rate limited. Try again in {retry_after} seconds.".to_owned()
                }),
            }),
            (Some(other), _) => {
                self.problem(
                    format!("{at}.refusal"),
                    format!("expected edge or envelope, got {other:?}"),
                );
                None
            }
        };
        let limit = self.nonzero(&format!("{at}.limit"), b.limit);
        let w = self.nonzero(&format!("{at}.window_seconds"), b.window_seconds);
        let on_exhausted = match b.on_exhausted.as_deref() {
            None | Some("refuse") => Some(OnExhausted::Refuse),
            Some("pass") if b.weighted => Some(OnExhausted::Pass),
            Some("pass") => {
                self.problem(
                    format!("{at}.on_exhausted"),
                    "`pass` is for weighted budgets (`weighted: true`), whose upstream answers for them",
                );
                None
            }
            Some(other) => {
                self.problem(
                    format!("{at}.on_exhausted"),
                    format!("expected refuse or pass, got {other:?}"),
                );
                None
            }
        };
        let mode = self.mode(&format!("{at}.mode"), b.mode.as_deref());
        let limits: Vec<(String, u32)> = limit
            .map(|l| (String::new(), l.get()))
            .into_iter()
            .collect();
        let algorithm = self.algorithm(
            &at,
            (b.algorithm.as_deref(), b.burst),
            b.window_seconds,
            &limits,
        );
        // A lease is at most the bucket's limit and each plan's.
        let lease_limits: Vec<(String, u32)> = limits
            .iter()
            .cloned()
            .chain(
                plan_limits
                    .iter()
                    .map(|(plan, l)| (format!(" of plan {plan}"), *l)),
            )
            .collect();
        let consistency = algorithm.and_then(|a| {
            let spec = crate::model::LeaseSpec {
                consistency: b.consistency.as_deref(),
                lease: b.lease,
                lease_ms: b.lease_ms,
            };
            match spec.check(a, b.window_seconds, &lease_limits) {
                Ok(c) => Some(c),
                Err(problems) => {
                    for (key, message) in problems {
                        self.problem(format!("{at}.{key}"), message);
                    }
                    None
                }
            }
        });
        if let (
            Some(per),
            Some(refusal),
            Some(limit),
            Some(window),
            Some(on_exhausted),
            Some(mode),
            Some(algorithm),
            Some(consistency),
        ) = (
            per,
            refusal,
            limit,
            w,
            on_exhausted,
            mode,
            algorithm,
            consistency,
        ) {
            Some(Bucket {
                name: name.to_owned(),
                limit,
                window,
                per,
                refusal,
                weighted: b.weighted,
                on_exhausted,
                mode,
                algorithm,
                consistency,
                tokens: None,
            })
        } else {
            None
        }
    }

    /// `quotas:`, each checked, with the index of each by name.
    pub(super) fn quotas(&mut self, raw: &RawPolicy) -> (HashMap<String, usize>, Vec<QuotaFamily>) {
        let mut quota_index = HashMap::new();
        let mut quotas = Vec::new();
        for (name, q) in &raw.quotas {
            let at = format!("quotas.{name}.monthly");
            let monthly = match q.monthly {
                None => None,
                Some(n) => match self.nonzero(&at, n) {
                    Some(n) => Some(n),
                    None => continue,
                },
            };
            if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
                self.problem(
                    format!("quotas.{name}"),
                    "a family name is letters, digits and `_`",
                );
                continue;
            }
            let Some(mode) = self.mode(&format!("quotas.{name}.mode"), q.mode.as_deref()) else {
                continue;
            };
            if q.consistency.as_deref().is_some_and(|c| c != "exact") {
                self.problem(
                    format!("quotas.{name}.consistency"),
                    "a monthly quota stays exact (SPEC D4): only class, ceiling and bucket budgets (and rate-limit service rules) in fixed windows may be `leased`; remove it or write `exact`",
                );
                continue;
            }
            if q.algorithm.is_some() {
                self.problem(
                    format!("quotas.{name}.algorithm"),
                    "a quota counts calendar months (UTC) and takes no algorithm; remove it",
                );
                continue;
            }
            quota_index.insert(name.clone(), quotas.len());
            quotas.push(QuotaFamily {
                name: name.clone(),
                monthly,
                mode,
            });
        }
        if raw.quotas.len() > MAX_QUOTA_FAMILIES {
            self.problem(
                "quotas",
                format!("at most {MAX_QUOTA_FAMILIES} quota families"),
            );
        }
        (quota_index, quotas)
    }

    /// A `mode:` at `at`: `enforce` (the default) or `shadow`.
    pub(super) fn mode(&mut self, at: &str, mode: Option<&str>) -> Option<Enforcement> {
        match mode {
            None | Some("enforce") => Some(Enforcement::Enforce),
            Some("shadow") => Some(Enforcement::Shadow),
            Some(other) => {
                self.problem(at, format!("expected enforce or shadow, got {other:?}"));
                None
            }
        }
    }

    /// `algorithm:` and `burst:` of the budget at `at`, whose window is `window`
    /// seconds and whose limits are `limits` (each with what names it in a message:
    /// a class has one per profile).
    pub(super) fn algorithm(
        &mut self,
        at: &str,
        (algorithm, burst): (Option<&str>, Option<u32>),
        window: u32,
        limits: &[(String, u32)],
    ) -> Option<Algorithm> {
        let algorithm = match algorithm {
            None | Some("fixed") => Algorithm::Fixed,
            Some("sliding") => Algorithm::Sliding,
            Some("gcra") => Algorithm::Gcra { burst: None },
            Some(other) => {
                self.problem(
                    format!("{at}.algorithm"),
                    format!("expected fixed, sliding or gcra, got {other:?}"),
                );
                return None;
            }
        };
        let mut ok = true;
        if algorithm == Algorithm::Sliding && window > MAX_SLIDING_WINDOW_SECONDS {
            self.problem(
                format!("{at}.algorithm"),
                format!(
                    "a sliding window is counted in milliseconds: at most {MAX_SLIDING_WINDOW_SECONDS} seconds, this one is {window}"
                ),
            );
            ok = false;
        }
        let Some(burst) = burst else {
            return ok.then_some(algorithm);
        };
        if algorithm != (Algorithm::Gcra { burst: None }) {
            self.problem(
                format!("{at}.burst"),
                format!(
                    "`burst` is for `algorithm: gcra`; this budget is {}",
                    algorithm.name()
                ),
            );
            return None;
        }
        let Some(burst) = NonZeroU32::new(burst) else {
            self.problem(
                format!("{at}.burst"),
                "must be at least 1 (a burst of 0 would refuse everything)",
            );
            return None;
        };
        for (of, limit) in limits {
            if burst.get() > *limit {
                self.problem(
                    format!("{at}.burst"),
                    format!(
                        "{burst} is above the limit{of} ({limit}): at most the limit can go at once"
                    ),
                );
                ok = false;
            }
        }
        ok.then_some(Algorithm::Gcra { burst: Some(burst) })
    }

    /// False (with a problem at `path`) when `limit` is below the `burst` of a
    /// `gcra` budget: at most the limit can go at once.
    pub(super) fn fits_burst(
        &mut self,
        path: &str,
        algorithm: Algorithm,
        limit: NonZeroU32,
    ) -> bool {
        match algorithm {
            Algorithm::Gcra { burst: Some(burst) } if burst > limit => {
                self.problem(
                    path,
                    format!("{limit} is below the budget's gcra burst ({burst}): at most the limit can go at once"),
                );
                false
            }
            _ => true,
        }
    }
}
