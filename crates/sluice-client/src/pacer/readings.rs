//! The pacer read back: counters, the tokens and requests in its windows,
//! and the effective limits as JSON.

use sluice_core::{Clock, Timestamp};
use sluice_store::BudgetStore;

use super::handle::Pacer;
use super::ratio::InputRatio;
use super::state::{
    ADMITTED, BATCH, InputRatioReading, ProviderStats, RECONCILED, RETRIES, SHRUNK, TOO_LARGE,
    UPSTREAM_429, WAIT_MS, WAITED, WOULD_WAIT, WindowReading,
};
use crate::error::PaceError;
use crate::headers::RateLimitHeaders;
use crate::route::{TokenAxis, group_of, routes};

impl<S, C> Pacer<S, C>
where
    S: BudgetStore + 'static,
    C: Clock + 'static,
{
    /// The counters of `provider`.
    pub fn stats(&self, provider: &str) -> ProviderStats {
        let c = &self.state(provider).counters;
        ProviderStats {
            admitted: c.get(ADMITTED),
            waited: c.get(WAITED),
            wait_ms: c.get(WAIT_MS),
            too_large: c.get(TOO_LARGE),
            would_wait: c.get(WOULD_WAIT),
            shrunk: c.get(SHRUNK),
            reconciled: c.get(RECONCILED),
            upstream_429: c.get(UPSTREAM_429),
            retries: c.get(RETRIES),
            batch: c.get(BATCH),
        }
    }

    /// Tokens in `provider`'s current 60 s window (+ margin), as the books
    /// stand (its first key's provider-wide window).
    ///
    /// # Errors
    /// [`PaceError::UnknownProvider`], [`PaceError::Store`].
    pub async fn tokens_in_window(&self, provider: &str) -> Result<u64, PaceError> {
        self.tokens_of(provider, None, TokenAxis::Total).await
    }

    /// Tokens in the current window of the budget `model` spends at
    /// `provider` (its group's, summed over the keys; the provider-wide
    /// window when no `models:` entry covers it): all tokens, then input
    /// and output apart.
    ///
    /// # Errors
    /// [`PaceError::UnknownProvider`], [`PaceError::Store`].
    pub async fn model_tokens(
        &self,
        provider: &str,
        model: &str,
    ) -> Result<(u64, u64, u64), PaceError> {
        let config = self.config();
        let p = config
            .provider(provider)
            .ok_or_else(|| PaceError::UnknownProvider {
                provider: provider.to_owned(),
            })?;
        let group = group_of(p, Some(model)).map(str::to_owned);
        drop(config);
        self.group_tokens(provider, group.as_deref()).await
    }

    /// Tokens in the current window of the model group `group` at
    /// `provider` (`None`: the provider-wide window), summed over its keys:
    /// all tokens, input, output.
    ///
    /// # Errors
    /// [`PaceError::UnknownProvider`], [`PaceError::Store`].
    pub async fn group_tokens(
        &self,
        provider: &str,
        group: Option<&str>,
    ) -> Result<(u64, u64, u64), PaceError> {
        let config = self.config();
        let p = config
            .provider(provider)
            .ok_or_else(|| PaceError::UnknownProvider {
                provider: provider.to_owned(),
            })?;
        let mut out = [0u64; 3];
        let now = self.inner.clock.now();
        let margin = config.pacer.arrival_margin;
        for r in routes(p, group) {
            let s = r.narrow();
            for (i, axis) in TokenAxis::ALL.into_iter().enumerate() {
                let h = self
                    .inner
                    .window(axis)
                    .read(&self.inner.store, s.subject, now, margin)
                    .await?;
                out[i] += h.total();
            }
        }
        Ok((out[0], out[1], out[2]))
    }

    pub(super) async fn tokens_of(
        &self,
        provider: &str,
        group: Option<&str>,
        axis: TokenAxis,
    ) -> Result<u64, PaceError> {
        let config = self.config();
        let p = config
            .provider(provider)
            .ok_or_else(|| PaceError::UnknownProvider {
                provider: provider.to_owned(),
            })?;
        let Some(route) = routes(p, group).into_iter().next() else {
            return Ok(0);
        };
        let h = self
            .inner
            .window(axis)
            .read(
                &self.inner.store,
                route.narrow().subject,
                self.inner.clock.now(),
                config.pacer.arrival_margin,
            )
            .await?;
        Ok(h.total())
    }

    /// Where `provider`'s windows stand now: tokens in the 60 s window, requests
    /// in the last minute and in the rolling day (see [`WindowReading`]).
    ///
    /// # Errors
    /// [`PaceError::UnknownProvider`], [`PaceError::Store`].
    pub async fn reading(&self, provider: &str) -> Result<WindowReading, PaceError> {
        let config = self.config();
        let p = config
            .provider(provider)
            .ok_or_else(|| PaceError::UnknownProvider {
                provider: provider.to_owned(),
            })?;
        let tokens = if p.limits.tpm > 0 {
            self.tokens_in_window(provider).await?
        } else {
            0
        };
        let state = self.state(provider);
        let now = self.inner.clock.now();
        let requests_today = match routes(p, None).first() {
            Some(r) if p.limits.rpd > 0 => {
                let subject = r.scopes[0].subject;
                let cache = self.inner.day_cache(subject);
                let h = self
                    .inner
                    .rpd
                    .read(
                        &self.inner.store,
                        subject,
                        &cache,
                        now,
                        config.pacer.arrival_margin,
                    )
                    .await?;
                Some(h.total())
            }
            _ => None,
        };
        let requests_last_minute = state.recent.lock().last_minute(now.as_secs());
        Ok(WindowReading {
            tokens,
            requests_last_minute,
            requests_today,
        })
    }

    /// The input ratios `provider` has learned, per model (`""`: requests
    /// naming no model; `"\0other"`: the models past the cap): the
    /// provider's reported input tokens to the pacer's estimate, and the
    /// factor a request's input estimate is reserved with now.
    pub fn input_ratios(&self, provider: &str) -> Vec<InputRatioReading> {
        let state = self.state(provider);
        let ratios = state.ratios.lock();
        let mut v: Vec<InputRatioReading> = ratios
            .iter()
            .map(|(model, r)| InputRatioReading {
                model: model.to_owned(),
                ratio: r.ratio(),
                samples: r.samples(),
                factor: r.factor(),
            })
            .collect();
        v.sort_by(|a, b| a.model.cmp(&b.model));
        v
    }

    /// Every provider's learned input ratios ([`Pacer::input_ratios`]), by
    /// provider; providers that learned none are left out.
    pub fn all_input_ratios(&self) -> std::collections::BTreeMap<String, Vec<InputRatioReading>> {
        let names: Vec<String> = self.inner.providers.lock().keys().cloned().collect();
        names
            .into_iter()
            .map(|name| {
                let r = self.input_ratios(&name);
                (name, r)
            })
            .filter(|(_, r)| !r.is_empty())
            .collect()
    }

    /// Sets what `provider` learned of `model`'s input ratio (restored from
    /// an earlier run, say): `ratio` (kept within 0.5–4.0) after `samples`
    /// samples. Ignored past the cap on models.
    pub fn restore_input_ratio(&self, provider: &str, model: &str, ratio: f64, samples: u32) {
        self.state(provider)
            .ratios
            .lock()
            .restore(model, InputRatio::from_parts(ratio, samples));
    }

    /// The effective limits per provider as JSON (`GET /limits`): the
    /// config's ([`PaceConfig::limits_json`], per-model limits and key names
    /// included, never a key) plus, per provider, what its headers last said
    /// (`learned`, and per model group under `models.<group>.learned`), the
    /// pacer's counters (`stats`), and the last reload error (`configError`).
    ///
    /// `holdSeconds` is what is left of the provider's hold (its keys'
    /// provider-wide budgets, the longest) as the store keeps it for every
    /// process on it; this process's own when the store cannot be read.
    ///
    /// [`PaceConfig::limits_json`]: crate::config::PaceConfig::limits_json
    pub async fn limits_json(&self) -> serde_json::Value {
        let config = self.config();
        let mut v = config.limits_json();
        let now = self.inner.clock.now();
        let learned_json = |h: &RateLimitHeaders, at: Timestamp| {
            serde_json::json!({
                "headers": h,
                "secondsAgo": now.saturating_since(at).as_secs_f64(),
            })
        };
        if let Some(map) = v.get_mut("providers").and_then(|m| m.as_object_mut()) {
            for (name, entry) in map.iter_mut() {
                let state = self.state(name);
                let subjects: Vec<u64> = config
                    .provider(name)
                    .map(|p| {
                        routes(p, None)
                            .iter()
                            .map(|r| r.scopes[0].subject)
                            .collect()
                    })
                    .unwrap_or_default();
                let hold = self
                    .holds_until(&subjects)
                    .await
                    .into_iter()
                    .flatten()
                    .max();
                let read_at = self.inner.clock.now();
                let Some(obj) = entry.as_object_mut() else {
                    continue;
                };
                {
                    let l = state.learned.lock();
                    obj.insert(
                        "learned".into(),
                        match (&l.headers, l.observed_at) {
                            (Some(h), Some(at)) => learned_json(h, at),
                            _ => serde_json::Value::Null,
                        },
                    );
                }
                if let Some(models) = obj.get_mut("models").and_then(|m| m.as_object_mut()) {
                    let by_group = state.learned_by_group.lock();
                    for (group, m) in models.iter_mut() {
                        if let (Some(o), Some((h, at))) = (m.as_object_mut(), by_group.get(group)) {
                            o.insert("learned".into(), learned_json(h, *at));
                        }
                    }
                }
                obj.insert(
                    "inputRatios".into(),
                    serde_json::json!(self.input_ratios(name)),
                );
                obj.insert(
                    "holdSeconds".into(),
                    serde_json::json!(
                        hold.map(|h| h.saturating_since(read_at).as_secs_f64())
                            .unwrap_or(0.0)
                    ),
                );
                obj.insert("stats".into(), serde_json::json!(self.stats(name)));
            }
        }
        if let Some(obj) = v.as_object_mut() {
            obj.insert(
                "configError".into(),
                serde_json::json!(self.inner.source.last_error()),
            );
        }
        v
    }
}
