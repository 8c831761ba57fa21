//! What the provider's answers teach: holds (a 429's `Retry-After`, no
//! requests left until a reset), tokens another client spent on the same
//! key, and the 429s and retries counted.

use std::time::Duration;

use http::HeaderMap;
use sluice_core::{Clock, Timestamp};
use sluice_store::BudgetStore;

use super::handle::Pacer;
use super::state::{RETRIES, UPSTREAM_429};
use crate::error::PaceError;
use crate::headers::RateLimitHeaders;
use crate::route::{Scope, TokenAxis, routes};

/// The longest hold a provider's headers may impose (what the store keeps
/// at most).
pub(super) const MAX_HOLD: Duration = sluice_store::MAX_HOLD;

impl<S, C> Pacer<S, C>
where
    S: BudgetStore + 'static,
    C: Clock + 'static,
{
    /// Holds every request to `provider` for `d` from now, on every key (a
    /// 429's `Retry-After`, a provider saying nothing is left until a reset):
    /// in this process at once, and in the store, so that every process
    /// pacing the key on it waits too (SPEC C7).
    ///
    /// # Errors
    /// [`PaceError::Store`] when the store did not take the hold (for a key
    /// of several, the first such error, the others held all the same):
    /// this process holds the provider all the same.
    pub async fn hold(&self, provider: &str, d: Duration) -> Result<(), PaceError> {
        let config = self.config();
        let Some(p) = config.provider(provider) else {
            return Ok(());
        };
        let mut result = Ok(());
        for r in routes(p, None) {
            let held = self.hold_subject(r.scopes[0].subject, d).await;
            if result.is_ok() {
                result = held;
            }
        }
        result
    }

    /// Holds the budgets of `subject` for `d` from now: in this process, then
    /// in the store (the later of its hold and this one, on its clock).
    pub(crate) async fn hold_subject(&self, subject: u64, d: Duration) -> Result<(), PaceError> {
        let d = d.min(MAX_HOLD);
        let now = self.inner.clock.now();
        let until = now.saturating_add(d);
        {
            let mut holds = self.inner.holds.lock();
            holds.retain(|_, t| *t > now);
            let h = holds.entry(subject).or_insert(until);
            *h = (*h).max(until);
        }
        self.inner
            .store
            .hold(&self.inner.hold_key(subject), d)
            .await?;
        Ok(())
    }

    /// When the holds of `subjects` end (`None`: not held), read from the
    /// store in one call: the hold every process on it put (what is left of
    /// it, on the store's clock, counted from this clock's now), or this
    /// process's own where that is later. A store that cannot answer leaves
    /// this process's own: a hold is the provider's word, which the provider
    /// enforces, and a provider with no limits to pace is never stopped by
    /// the store being down (the windows' reads fail a plan that needs them).
    pub(super) async fn holds_until(&self, subjects: &[u64]) -> Vec<Option<Timestamp>> {
        let keys: Vec<_> = subjects.iter().map(|&s| self.inner.hold_key(s)).collect();
        let left = self.inner.store.held(&keys).await.unwrap_or_default();
        let now = self.inner.clock.now();
        subjects
            .iter()
            .zip(left.into_iter().chain(std::iter::repeat(Duration::ZERO)))
            .map(|(&s, left)| {
                let shared = (!left.is_zero()).then(|| now.saturating_add(left));
                let own = self.inner.hold_of(s).filter(|t| *t > now);
                shared.max(own)
            })
            .collect()
    }

    /// Learns from a provider's rate-limit headers: requests left
    /// at zero hold the provider until the reset it names; tokens the
    /// provider counts beyond what this pacer's books hold (another client
    /// on the same key) are charged to the window. Nothing here lowers the
    /// configured limits: the pacer never limits below the plan.
    ///
    /// The headers are taken to describe the provider's books now and are
    /// compared with this pacer's books as they stand now. For the answer
    /// to a request this pacer let through, [`Permit::observe`] is exact
    /// even when the answer took long, and applies them to the request's
    /// model and key.
    ///
    /// [`Permit::observe`]: super::Permit::observe
    ///
    /// # Errors
    /// [`PaceError::Store`].
    pub async fn observe(&self, provider: &str, headers: &HeaderMap) -> Result<(), PaceError> {
        let now = self.inner.clock.now();
        let config = self.config();
        let Some(p) = config.provider(provider) else {
            return Ok(());
        };
        let Some(route) = routes(p, None).into_iter().next() else {
            return Ok(());
        };
        self.learn(provider, None, &route.scopes, headers, now, None)
            .await
    }

    /// Learns from `headers` describing the provider's books at `at` for
    /// the budgets `scopes` (the narrowest last), when this pacer's window
    /// held `ours_at` tokens per (budget, axis) (read now when `None`; an
    /// axis the request did not reserve on is then not compared: the books
    /// now are not the books the headers describe).
    pub(crate) async fn learn(
        &self,
        provider: &str,
        group: Option<&str>,
        scopes: &[Scope],
        headers: &HeaderMap,
        at: Timestamp,
        ours_at: Option<&[(u64, TokenAxis, u64)]>,
    ) -> Result<(), PaceError> {
        let now = self.inner.clock.now();
        let h = RateLimitHeaders::parse(headers, at);
        if h.is_empty() {
            return Ok(());
        }
        let config = self.config();
        let Some(narrow) = scopes.last() else {
            return Ok(());
        };
        let state = self.state(provider);
        {
            let mut l = state.learned.lock();
            l.headers = Some(h);
            l.observed_at = Some(now);
        }
        if let Some(g) = group {
            state.learned_by_group.lock().insert(g.to_owned(), (h, now));
        }
        // (A limit of 0 is no limit: nothing is held for it.)
        if h.requests.remaining == Some(0)
            && h.requests.limit != Some(0)
            && let Some(reset) = h.requests.reset
        {
            // The reset counts from when the provider wrote it.
            self.hold_subject(
                narrow.subject,
                at.saturating_add(reset).saturating_since(now),
            )
            .await?;
        }
        let margin = config.pacer.arrival_margin;
        for (axis, said) in [
            (TokenAxis::Total, h.tokens),
            (TokenAxis::Input, h.input_tokens),
            (TokenAxis::Output, h.output_tokens),
        ] {
            let Some(used) = said.used() else { continue };
            // The headers describe the narrowest budget that counts the axis.
            let Some(s) = scopes.iter().rev().find(|s| axis.limit(&s.limits) > 0) else {
                continue;
            };
            let window = self.inner.window(axis);
            let hist = window
                .read(&self.inner.store, s.subject, now, margin)
                .await?;
            let ours = match ours_at {
                None => hist.total(),
                Some(at) => match at
                    .iter()
                    .find(|(subject, a, _)| *subject == s.subject && *a == axis)
                {
                    Some(&(_, _, o)) => o,
                    None => continue,
                },
            };
            if used > ours {
                let foreign = (used - ours).min(u64::from(axis.limit(&s.limits)));
                let cell = window.cell(s.subject, hist.current(), u32::MAX, 0);
                self.inner
                    .store
                    .adjust(&cell, i64::try_from(foreign).unwrap_or(i64::MAX), now)
                    .await?;
            }
        }
        Ok(())
    }

    /// Counts a 429 answer and a retry (for [`Pacer::stats`]).
    pub(crate) fn count_retry(&self, provider: &str, was_429: bool) {
        let s = self.state(provider);
        s.counters.add(RETRIES, 1);
        if was_429 {
            s.counters.add(UPSTREAM_429, 1);
        }
    }

    /// Counts a final 429 answer that was not retried.
    pub(crate) fn count_429(&self, provider: &str) {
        self.state(provider).counters.add(UPSTREAM_429, 1);
    }
}
