//! A reservation ([`Permit`]): what a request spent on which budgets, to
//! settle with the answer's usage, give back, or learn from.

use std::sync::Arc;
use std::time::Duration;

use http::HeaderMap;
use sluice_core::{Clock, Timestamp};
use sluice_store::{BudgetStore, MemoryStore};

use super::charge::Charge;
use super::handle::Pacer;
use super::state::{ProviderState, RECONCILED};
use crate::clock::TokioClock;
use crate::error::PaceError;
use crate::route::{Cost, Scope, TokenAxis};
use crate::usage::Usage;

/// A reservation: the request may go. Reconcile it with the answer's usage,
/// or cancel it when the provider did not count the request; dropping it
/// keeps the reservation (the safe side).
pub struct Permit<S = MemoryStore<TokioClock>, C = TokioClock>
where
    S: BudgetStore + 'static,
    C: Clock + 'static,
{
    pub(crate) pacer: Pacer<S, C>,
    pub(crate) state: Arc<ProviderState>,
    pub(crate) provider: Arc<str>,
    pub(crate) group: Option<Arc<str>>,
    /// The model the request named (its input ratio is learned under it).
    pub(crate) model: Option<Arc<str>>,
    /// The pacer's own estimate of the request's input, before the ratio.
    pub(crate) estimated_input: u32,
    pub(crate) key_name: Option<String>,
    pub(crate) secret: Option<String>,
    /// The budgets spent, the narrowest last.
    pub(crate) scopes: Vec<Scope>,
    pub(crate) reserved: Cost,
    pub(crate) charges: Vec<Charge>,
    pub(crate) day_slots: Vec<(u64, u64)>,
    /// The day-of-tokens slots spent: (budget, slot, tokens).
    pub(crate) token_day_slots: Vec<(u64, u64, u32)>,
    pub(crate) decided_at: Timestamp,
    /// Tokens in this pacer's windows just after the reservation, per
    /// (budget, axis) reserved on.
    pub(crate) window_at_decision: Vec<(u64, TokenAxis, u64)>,
    pub(crate) waited: Duration,
    pub(crate) reconcile: bool,
}

impl<S, C> std::fmt::Debug for Permit<S, C>
where
    S: BudgetStore + 'static,
    C: Clock + 'static,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Permit")
            .field("provider", &self.provider)
            .field("group", &self.group)
            .field("key", &self.key_name)
            .field("tokens", &self.tokens())
            .field("decided_at", &self.decided_at)
            .field("waited", &self.waited)
            .finish()
    }
}

impl<S, C> Permit<S, C>
where
    S: BudgetStore + 'static,
    C: Clock + 'static,
{
    pub(crate) fn with_waited(mut self, waited: Duration) -> Self {
        self.waited = waited;
        self
    }

    /// The provider.
    pub fn provider(&self) -> &str {
        &self.provider
    }

    /// The model group whose budget the request spends (`None`: it named no
    /// model, or none of the provider's `models:` covers it — it went by
    /// the provider-wide limits alone).
    pub fn group(&self) -> Option<&str> {
        self.group.as_deref()
    }

    /// The name of the key the request goes with, when the provider has
    /// several (`apiKeys`).
    pub fn key_name(&self) -> Option<&str> {
        self.key_name.as_deref()
    }

    /// The key to send, when the pacer chose it among several.
    pub(crate) fn secret(&self) -> Option<&str> {
        self.secret.as_deref()
    }

    /// The narrowest budget the request spends (a 429 on its answer holds
    /// it, and only it).
    pub(crate) fn narrow_subject(&self) -> Option<u64> {
        self.scopes.last().map(|s| s.subject)
    }

    /// Tokens reserved (input and output together).
    pub fn tokens(&self) -> u32 {
        self.reserved.total()
    }

    /// How long the request waited for room.
    pub fn waited(&self) -> Duration {
        self.waited
    }

    /// When the reservation was made.
    pub fn decided_at(&self) -> Timestamp {
        self.decided_at
    }

    /// Learns from the rate-limit headers of the answer to this request, as
    /// [`Pacer::observe`] does, knowing that they describe the provider's
    /// books when the request arrived, for this request's model and key:
    /// they are compared with this pacer's books as they stood when it let
    /// the request go, so tokens that left the window or were given back
    /// while the answer was on its way are not taken for another client's,
    /// and a reset is counted from the request's arrival.
    ///
    /// # Errors
    /// [`PaceError::Store`].
    pub async fn observe(&self, headers: &HeaderMap) -> Result<(), PaceError> {
        self.pacer
            .learn(
                &self.provider,
                self.group.as_deref(),
                &self.scopes,
                headers,
                self.decided_at,
                Some(&self.window_at_decision),
            )
            .await
    }

    /// Replaces the reservation by what the answer actually used, in total:
    /// unused tokens go back to the window they were reserved in; extra
    /// tokens are charged now. Where input and output are counted apart, the
    /// input is taken as reserved and the rest as output; use
    /// [`Permit::reconcile_usage`] when the answer says both.
    ///
    /// # Errors
    /// [`PaceError::Store`].
    pub async fn reconcile(self, actual_tokens: u32) -> Result<(), PaceError> {
        let input = self.reserved.input.min(actual_tokens);
        let cost = Cost {
            input,
            output: actual_tokens - input,
        };
        self.reconcile_cost(cost).await
    }

    /// [`Permit::reconcile`] with the answer's input and output apart
    /// (its `usage`): each axis gets its own correction, and the provider's
    /// count of the input teaches the pacer the ratio of its count to the
    /// pacer's estimate for the request's model (later requests reserve
    /// their estimate times that ratio; see `docs/pacer.md`). Input that the
    /// provider does not count (Anthropic's `cache_read_input_tokens`, in
    /// [`Usage::rate_exempt_input`]) is not charged: the input charged is
    /// [`Usage::rate_limited_input`].
    ///
    /// # Errors
    /// [`PaceError::Store`].
    pub async fn reconcile_usage(self, usage: Usage) -> Result<(), PaceError> {
        // The provider's count is the truth: learn how it compares with
        // the estimate (all input, cache reads included: the estimate
        // counts them too).
        self.state.ratios.lock().learn(
            self.model.as_deref().unwrap_or(""),
            self.estimated_input,
            usage.prompt,
        );
        self.reconcile_cost(Cost {
            input: usage.rate_limited_input(),
            output: usage.completion,
        })
        .await
    }

    async fn reconcile_cost(self, cost: Cost) -> Result<(), PaceError> {
        if !self.reconcile {
            return Ok(());
        }
        self.state.counters.add(RECONCILED, 1);
        self.settle(cost, false).await
    }

    /// Gives the whole reservation back (the provider refused the request
    /// without counting it). The request's place in the RPM spacing is kept.
    ///
    /// # Errors
    /// [`PaceError::Store`].
    pub async fn cancel(self) -> Result<(), PaceError> {
        self.settle(Cost::default(), true).await
    }

    async fn settle(self, actual: Cost, give_back_request: bool) -> Result<(), PaceError> {
        let pacer = &self.pacer;
        let store = pacer.store();
        let mut gave_back = give_back_request;
        for c in &self.charges {
            let window = pacer.window(c.axis);
            let delta = i64::from(actual.on(c.axis)) - i64::from(c.tokens);
            if delta < 0 {
                gave_back = true;
                let cell = window.cell(c.subject, c.slot, u32::MAX, 0);
                store.adjust(&cell, delta, self.decided_at).await?;
                pacer.batch_refund(c, u32::try_from(-delta).unwrap_or(u32::MAX));
            } else if delta > 0 {
                let now = pacer.clock().now();
                let cell = window.cell(c.subject, window.slot_of(now), u32::MAX, 0);
                store.adjust(&cell, delta, now).await?;
            }
        }
        for &(subject, slot, tokens) in &self.token_day_slots {
            let days = pacer.token_day_window();
            let delta = i64::from(actual.total()) - i64::from(tokens);
            if delta < 0 {
                gave_back = true;
                let cell = days.cell(subject, slot, u32::MAX, 0);
                store.adjust(&cell, delta, self.decided_at).await?;
                let back = u32::try_from(-delta).unwrap_or(u32::MAX);
                pacer
                    .token_day_cache(subject)
                    .lock()
                    .refund(subject, slot, back);
            } else if delta > 0 {
                let now = pacer.clock().now();
                let cell = days.cell(subject, days.slot_of(now), u32::MAX, 0);
                store.adjust(&cell, delta, now).await?;
            }
        }
        if give_back_request {
            for &(subject, slot) in &self.day_slots {
                let cell = pacer.day_window().cell(subject, slot, u32::MAX, 0);
                store.adjust(&cell, -1, self.decided_at).await?;
                pacer.day_cache(subject).lock().refund(subject, slot, 1);
            }
        }
        if gave_back {
            // A waiting request may fit now (a stored wake-up when none
            // waits costs one extra look later).
            self.state.ring();
        }
        Ok(())
    }
}
