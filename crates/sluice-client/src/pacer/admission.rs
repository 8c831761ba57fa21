//! A request's way in: it queues first come, first served, goes ahead of
//! the head of its queue only where that delays the head not at all, is
//! refused when it can never fit or would wait too long (or shrunk, where
//! the provider allows), and leaves with a [`Permit`].

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use sluice_core::{Clock, Timestamp};
use sluice_store::BudgetStore;

use super::handle::Pacer;
use super::permit::Permit;
use super::schedule::Plan;
use super::state::{Head, HeadGuard, ProviderState, Queue, SHRUNK, TOO_LARGE, WOULD_WAIT, Waiting};
use crate::config::ProviderConfig;
use crate::error::PaceError;
use crate::priority::{AcquireOptions, Priority};
use crate::route::{Cost, Route, group_of, routes};
use crate::shrink::Demand;

/// The longest single sleep: a waiting request re-reads the config (and the
/// shared books) at least this often.
pub(super) const MAX_SLEEP: Duration = Duration::from_secs(1);

/// What [`Pacer::try_ahead`] found.
pub(super) enum Ahead<S: BudgetStore + 'static, C: Clock + 'static> {
    /// Reserved ahead of the head.
    Went(Box<Permit<S, C>>),
    /// Not now; perhaps at this instant.
    LookAt(Timestamp),
    /// Not now.
    No,
}

/// One request as the pacer sees it on every look.
pub(super) struct Ask<'a> {
    pub(super) provider: &'a str,
    pub(super) state: &'a Arc<ProviderState>,
    pub(super) queue: &'a Arc<Queue>,
    pub(super) group: Option<&'a str>,
    /// The model the request names (its input ratio is learned under it).
    pub(super) model: Option<&'a str>,
    pub(super) arrived: Timestamp,
    pub(super) priority: Priority,
}

pub(super) fn cost_of(demand: &dyn Demand) -> Cost {
    let e = demand.split();
    Cost {
        input: e.prompt,
        output: e.completion,
    }
}

impl<S, C> Pacer<S, C>
where
    S: BudgetStore + 'static,
    C: Clock + 'static,
{
    /// Waits (first come, first served; a request goes ahead of a waiting
    /// one only when that delays it not at all) until `estimate` tokens and one
    /// request fit every window of `provider`, and reserves them.
    ///
    /// # Errors
    /// [`PaceError::UnknownProvider`], [`PaceError::TooLarge`] at once for
    /// a request above the whole TPM, [`PaceError::WouldWait`] when room
    /// comes back after the provider's maximum wait, [`PaceError::Store`].
    pub async fn acquire(
        &self,
        provider: &str,
        mut estimate: impl Demand,
    ) -> Result<Permit<S, C>, PaceError> {
        self.acquire_with(provider, &mut estimate, &AcquireOptions::default())
            .await
    }

    /// [`Pacer::acquire`] for a request that may be shrunk when
    /// the provider opts in: when it does not fit within its maximum wait
    /// (or at all), its oldest context is dropped until it does.
    ///
    /// # Errors
    /// As [`Pacer::acquire`].
    pub async fn acquire_demand(
        &self,
        provider: &str,
        demand: &mut dyn Demand,
    ) -> Result<Permit<S, C>, PaceError> {
        self.acquire_with(provider, demand, &AcquireOptions::default())
            .await
    }

    /// [`Pacer::acquire_demand`] with a model and a priority
    /// ([`AcquireOptions`]). A request for a model the provider's `models:`
    /// cover is paced by its group's limits and by the provider-wide ones;
    /// with several keys it takes the key that can send it soonest
    /// ([`Permit::key_name`]). A batch request goes only on room that
    /// interactive requests leave, and never while one waits.
    ///
    /// ```
    /// use sluice_client::config::{ModelLimits, PaceConfig, ProviderConfig, ProviderLimits};
    /// use sluice_client::tokens::TokenEstimate;
    /// use sluice_client::{AcquireOptions, Pacer};
    ///
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)]
    /// # async fn main() {
    /// let openai = ProviderConfig::new("openai", "https://api.openai.com/v1", ProviderLimits::new(0, 0, 0))
    ///     .with_models([ModelLimits::new("gpt-4o-mini*", ProviderLimits::new(1_000, 0, 0))]);
    /// let pacer = Pacer::from_config(PaceConfig::from_providers([openai]));
    /// let mini = AcquireOptions::default().model("gpt-4o-mini");
    /// let mut ask = TokenEstimate { prompt: 600, completion: 300 };
    /// let permit = pacer.acquire_with("openai", &mut ask, &mini).await.unwrap();
    /// assert_eq!(permit.group(), Some("gpt-4o-mini*"));
    /// // The model's 1,000 tokens a minute are spent; another model is not held.
    /// let other = AcquireOptions::default().model("gpt-4o");
    /// assert!(pacer.acquire_with("openai", &mut ask, &other).await.unwrap().waited().is_zero());
    /// # }
    /// ```
    ///
    /// # Errors
    /// As [`Pacer::acquire`].
    pub async fn acquire_with(
        &self,
        provider: &str,
        demand: &mut dyn Demand,
        options: &AcquireOptions,
    ) -> Result<Permit<S, C>, PaceError> {
        let arrived = self.inner.clock.now();
        let config = self.config();
        let Some(p) = config.provider(provider) else {
            return Err(PaceError::UnknownProvider {
                provider: provider.to_owned(),
            });
        };
        let model = options
            .model
            .clone()
            .or_else(|| demand.model().map(str::to_owned));
        let group = group_of(p, model.as_deref()).map(str::to_owned);
        let state = self.state(provider);
        let queue = state.queue(group.as_deref().unwrap_or(""));
        let ask = Ask {
            provider,
            state: &state,
            queue: &queue,
            group: group.as_deref(),
            model: model.as_deref(),
            arrived,
            priority: options.priority,
        };
        match options.priority {
            Priority::Interactive => {
                let _waiting = Waiting::new(&state);
                self.acquire_interactive(&ask, demand).await
            }
            Priority::Batch => self.acquire_batch(&ask, demand).await,
        }
    }

    pub(super) async fn acquire_interactive(
        &self,
        ask: &Ask<'_>,
        demand: &mut dyn Demand,
    ) -> Result<Permit<S, C>, PaceError> {
        let mut shrink_tried = false;
        // Refuse a request that can never fit before it queues.
        self.check_size(ask, demand, &mut shrink_tried)?;
        // First come, first served: the gate is fair. While its turn has not
        // come, a request goes ahead of the one waiting at the head when it
        // fits now and the head still goes when it planned to.
        let turn = ask.queue.gate.lock();
        tokio::pin!(turn);
        let _turn = loop {
            let look_again = match self.try_ahead(ask, demand).await? {
                Ahead::Went(permit) => return Ok(*permit),
                Ahead::LookAt(t) => t.saturating_since(self.inner.clock.now()).min(MAX_SLEEP),
                Ahead::No => MAX_SLEEP,
            };
            let behind = ask.queue.behind.notified();
            tokio::select! {
                biased;
                turn = &mut turn => break turn,
                () = behind => {}
                () = tokio::time::sleep(look_again) => {}
            }
        };
        let head = HeadGuard(ask.queue);
        loop {
            let p = self.check_size(ask, demand, &mut shrink_tried)?;
            let now = self.inner.clock.now();
            let deadline = ask.arrived.saturating_add(p.max_wait);
            let routes = routes(&p, ask.group);
            let (cost, estimated) = self.reserve_cost(ask, demand, &routes);
            let (i, plan) = self.best(&routes, cost, now, deadline, None).await?;
            if plan.ready_at <= now {
                if let Some(permit) = self
                    .try_reserve(ask, &p, &routes[i], cost, estimated, &plan)
                    .await?
                {
                    return Ok(self.admitted(ask, &routes[i], permit, now, cost));
                }
                // Another process spent first: look again shortly.
                tokio::time::sleep(Duration::from_millis(1)).await;
                continue;
            }
            if plan.ready_at > deadline {
                let wait = plan.ready_at.saturating_since(now);
                let extra = cost.input.saturating_sub(estimated);
                shrink_or_refuse(ask, &p, demand, &mut shrink_tried, &plan, wait, extra)?;
                continue;
            }
            head.publish(Head {
                ready_at: plan.ready_at,
                route: i,
                cost,
            });
            let sleep = plan.ready_at.saturating_since(now).min(MAX_SLEEP);
            // Room given back by an answer's usage (or a refusal) may come
            // before the planned instant: look again as soon as it does.
            tokio::select! {
                () = tokio::time::sleep(sleep) => {}
                () = ask.queue.room.notified() => {}
            }
        }
    }

    /// A batch request: first come, first served among batch requests; it
    /// goes only while no interactive request of the provider waits, and
    /// only on room that leaves each budget the interactive tokens of the
    /// last window plus the largest of them.
    pub(super) async fn acquire_batch(
        &self,
        ask: &Ask<'_>,
        demand: &mut dyn Demand,
    ) -> Result<Permit<S, C>, PaceError> {
        let mut shrink_tried = false;
        self.check_size(ask, demand, &mut shrink_tried)?;
        let _turn = ask.queue.batch_gate.lock().await;
        loop {
            let p = self.check_size(ask, demand, &mut shrink_tried)?;
            let now = self.inner.clock.now();
            let deadline = ask.arrived.saturating_add(p.max_wait);
            let routes = routes(&p, ask.group);
            let (cost, estimated) = self.reserve_cost(ask, demand, &routes);
            let wake = ask.state.batch_wake.notified();
            let room = ask.queue.room.notified();
            let mut sleep = MAX_SLEEP;
            if ask.state.interactive_waiting.load(Ordering::SeqCst) == 0 {
                let (i, plan) = self
                    .best(&routes, cost, now, deadline, Some(p.interactive_reserve))
                    .await?;
                if plan.ready_at <= now {
                    if let Some(permit) = self
                        .try_reserve(ask, &p, &routes[i], cost, estimated, &plan)
                        .await?
                    {
                        return Ok(self.admitted(ask, &routes[i], permit, now, cost));
                    }
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    continue;
                }
                sleep = plan.ready_at.saturating_since(now).min(MAX_SLEEP);
            }
            // Would it be in time with the whole limits?
            let (_, whole) = self.best(&routes, cost, now, deadline, None).await?;
            if whole.ready_at > deadline || now >= deadline {
                let wait = whole
                    .ready_at
                    .max(now.saturating_add(MAX_SLEEP))
                    .saturating_since(now);
                let extra = cost.input.saturating_sub(estimated);
                shrink_or_refuse(ask, &p, demand, &mut shrink_tried, &whole, wait, extra)?;
                continue;
            }
            let sleep = sleep
                .min(deadline.saturating_since(now))
                .max(Duration::from_millis(1));
            tokio::select! {
                () = tokio::time::sleep(sleep) => {}
                () = wake => {}
                () = room => {}
            }
        }
    }

    /// Reserves for a request behind the head of its queue when it
    /// fits now and leaves the head's plan as it is: the tokens of both fit
    /// by the head's instant, the request spacing still lets the head go
    /// then, and the day has room for both (or it goes with another key
    /// than the head's). A large request waiting for room
    /// no longer leaves the room that builds up before it unused (smaller
    /// ones behind it take it), and is never delayed by them. Within this
    /// process: other processes sharing the books do not see the head.
    ///
    /// # Errors
    /// As [`Pacer::acquire`].
    pub(super) async fn try_ahead(
        &self,
        ask: &Ask<'_>,
        demand: &mut dyn Demand,
    ) -> Result<Ahead<S, C>, PaceError> {
        let Some(head) = *ask.queue.head.lock() else {
            return Ok(Ahead::No);
        };
        let Ok(_one) = ask.queue.ahead.try_lock() else {
            return Ok(Ahead::No);
        };
        let config = self.config();
        let Some(p) = config.provider(ask.provider) else {
            return Ok(Ahead::No);
        };
        let now = self.inner.clock.now();
        let margin = config.pacer.arrival_margin;
        let routes = routes(p, ask.group);
        let (cost, estimated) = self.reserve_cost(ask, demand, &routes);
        let has_tokens = routes
            .iter()
            .any(|r| r.scopes.iter().any(|s| s.token_axes(cost).next().is_some()));
        let fits = routes
            .iter()
            .any(|r| r.scopes.iter().all(|s| cost.total() <= s.total_room(cost)));
        if !has_tokens || cost.total() == 0 || head.ready_at <= now || !fits {
            return Ok(Ahead::No);
        }
        let deadline = ask.arrived.saturating_add(p.max_wait);
        let (i, plan) = self.best(&routes, cost, now, deadline, None).await?;
        if plan.ready_at > now {
            return Ok(if plan.ready_at < head.ready_at {
                Ahead::LookAt(plan.ready_at)
            } else {
                Ahead::No
            });
        }
        let route = &routes[i];
        if i == head.route {
            for s in &route.scopes {
                if s.limits.rpm > 0 {
                    let spacing = (Duration::from_secs(60) + margin) / s.limits.rpm;
                    if now.saturating_add(spacing) > head.ready_at {
                        return Ok(Ahead::No);
                    }
                }
            }
            for (k, days) in &plan.days {
                if days
                    .room_at(route.scopes[*k].limits.rpd, 2, now)
                    .is_none_or(|t| t > now)
                {
                    return Ok(Ahead::No);
                }
            }
            // The day of tokens must hold both by the head's turn.
            for (k, days) in &plan.token_days {
                let both = head.cost.total().saturating_add(cost.total());
                if days
                    .room_at(route.scopes[*k].limits.tpd, both, now)
                    .is_none_or(|t| t > head.ready_at)
                {
                    return Ok(Ahead::No);
                }
            }
            for c in &plan.charges {
                let both = self
                    .inner
                    .window(c.axis)
                    .plan(
                        &self.inner.store,
                        route.scopes[c.scope].subject,
                        now,
                        margin,
                        c.limit,
                        head.cost.on(c.axis).saturating_add(c.cost),
                        head.ready_at,
                    )
                    .await?;
                if both.ready_at().is_none_or(|t| t > head.ready_at) {
                    return Ok(Ahead::No);
                }
            }
        }
        Ok(
            match self
                .try_reserve(ask, p, route, cost, estimated, &plan)
                .await?
            {
                Some(permit) => Ahead::Went(Box::new(self.admitted(ask, route, permit, now, cost))),
                None => Ahead::No,
            },
        )
    }

    /// What `demand` reserves on `routes`: its input estimate times the
    /// input ratio learned for its model ([`InputRatio::factor`]), never
    /// past what the whole limits of its best route hold (the ratio never
    /// makes a request that fits too large), and its completion budget;
    /// with the raw input estimate, to learn from the answer's usage.
    ///
    /// [`InputRatio::factor`]: super::ratio::InputRatio::factor
    pub(super) fn reserve_cost(
        &self,
        ask: &Ask<'_>,
        demand: &dyn Demand,
        routes: &[Route],
    ) -> (Cost, u32) {
        let raw = cost_of(demand);
        let ratio = ask.state.ratios.lock().get(ask.model.unwrap_or(""));
        let mut input = ratio.scale(raw.input);
        if input > raw.input {
            let room = routes
                .iter()
                .map(|r| {
                    r.scopes
                        .iter()
                        .map(|s| s.total_room(raw))
                        .min()
                        .unwrap_or(u32::MAX)
                })
                .max()
                .unwrap_or(u32::MAX);
            input = input.min(room.saturating_sub(raw.output).max(raw.input));
        }
        (
            Cost {
                input,
                output: raw.output,
            },
            raw.input,
        )
    }

    pub(super) fn check_size(
        &self,
        ask: &Ask<'_>,
        demand: &mut dyn Demand,
        shrink_tried: &mut bool,
    ) -> Result<ProviderConfig, PaceError> {
        let config = self.config();
        let Some(p) = config.provider(ask.provider) else {
            return Err(PaceError::UnknownProvider {
                provider: ask.provider.to_owned(),
            });
        };
        let routes = routes(p, ask.group);
        // The most total tokens a request of this shape fits on its best
        // route (0: none, the completion budget alone is too large).
        let room = |cost: Cost| {
            routes
                .iter()
                .map(|r| {
                    r.scopes
                        .iter()
                        .map(|s| s.total_room(cost))
                        .min()
                        .unwrap_or(u32::MAX)
                })
                .max()
                .unwrap_or(u32::MAX)
        };
        let cost = cost_of(demand);
        if cost.total() > room(cost) {
            if p.shrink && !*shrink_tried {
                *shrink_tried = true;
                if demand.shrink_to(room(cost)) {
                    ask.state.counters.add(SHRUNK, 1);
                }
            }
            let cost = cost_of(demand);
            let limit = room(cost);
            if cost.total() > limit {
                ask.state.counters.add(TOO_LARGE, 1);
                return Err(PaceError::TooLarge {
                    provider: ask.provider.to_owned(),
                    estimated: cost.total(),
                    limit,
                    shrink: p.shrink,
                });
            }
        }
        Ok(p.clone())
    }
}

/// A request that cannot go by its deadline (`plan`, `wait` from now): shrunk once to
/// what fits by then when the provider allows it (`Ok`: look again), else refused with
/// [`PaceError::WouldWait`]. `extra`: the tokens its input ratio adds to its estimate
/// (the estimate shrinks to the room less them).
pub(super) fn shrink_or_refuse(
    ask: &Ask<'_>,
    p: &ProviderConfig,
    demand: &mut dyn Demand,
    shrink_tried: &mut bool,
    plan: &Plan,
    wait: Duration,
    extra: u32,
) -> Result<(), PaceError> {
    if p.shrink && !*shrink_tried && plan.tokens_late {
        *shrink_tried = true;
        if demand.shrink_to(plan.room_by_deadline.saturating_sub(extra)) {
            ask.state.counters.add(SHRUNK, 1);
            return Ok(());
        }
    }
    ask.state.counters.add(WOULD_WAIT, 1);
    Err(PaceError::WouldWait {
        provider: ask.provider.to_owned(),
        wait,
        max_wait: p.max_wait,
    })
}
