//! When a request can go, on which route: the plan of every window it
//! spends (tokens, requests spaced, the day), and for a batch request what
//! it must leave to interactive ones.

use std::time::Duration;

use sluice_core::{Clock, Timestamp};
use sluice_store::BudgetStore;

use super::handle::Pacer;
use crate::error::PaceError;
use crate::route::{Cost, Route, TokenAxis};
use crate::window::{History, TokenReading};

/// The instants ahead at which a batch request checks that interactive
/// requests would still find room.
pub(super) const BATCH_HORIZONS: [Duration; 7] = [
    Duration::ZERO,
    Duration::from_secs(5),
    Duration::from_secs(10),
    Duration::from_secs(20),
    Duration::from_secs(30),
    Duration::from_secs(45),
    Duration::from_secs(60),
];

/// How soon a batch request held back for interactive ones looks again
/// (room given back wakes it sooner).
pub(super) const BATCH_LOOK: Duration = Duration::from_millis(250);

/// How far ahead of the even pace of all tokens (batch and interactive)
/// batch tokens may go.
pub(super) const BATCH_BURST: Duration = Duration::from_secs(3);

/// One token axis of one scope, as planned.
pub(super) struct Planned {
    pub(super) scope: usize,
    pub(super) axis: TokenAxis,
    /// The limit reserved against (lower for a batch request).
    pub(super) limit: u32,
    pub(super) cost: u32,
    pub(super) reading: TokenReading,
}

pub(super) struct Plan {
    pub(super) ready_at: Timestamp,
    pub(super) tokens_late: bool,
    /// The total tokens the request could shrink to and fit by its deadline.
    pub(super) room_by_deadline: u32,
    pub(super) charges: Vec<Planned>,
    pub(super) days: Vec<(usize, History)>,
    /// The day of tokens of each scope with a TPD (by its index).
    pub(super) token_days: Vec<(usize, History)>,
}

pub(super) fn never() -> Timestamp {
    Timestamp::from_nanos(u64::MAX)
}

impl<S, C> Pacer<S, C>
where
    S: BudgetStore + 'static,
    C: Clock + 'static,
{
    /// The route that can send `cost` soonest and its plan (the first of
    /// equals).
    pub(super) async fn best(
        &self,
        routes: &[Route],
        cost: Cost,
        now: Timestamp,
        deadline: Timestamp,
        batch: Option<Duration>,
    ) -> Result<(usize, Plan), PaceError> {
        let mut best: Option<(usize, Plan)> = None;
        for (i, r) in routes.iter().enumerate() {
            let plan = self.plan(r, cost, now, deadline, batch).await?;
            let ready = plan.ready_at;
            if best.as_ref().is_none_or(|(_, b)| ready < b.ready_at) {
                best = Some((i, plan));
            }
            if ready <= now {
                break;
            }
        }
        // `routes` is never empty: a provider has its own key or its keys.
        best.ok_or(PaceError::UnknownProvider {
            provider: String::new(),
        })
    }

    pub(super) async fn plan(
        &self,
        route: &Route,
        cost: Cost,
        now: Timestamp,
        deadline: Timestamp,
        batch: Option<Duration>,
    ) -> Result<Plan, PaceError> {
        let margin = self.config().pacer.arrival_margin;
        let mut ready_at = now;
        let mut tokens_at = now;
        let mut room_by_deadline = u32::MAX;
        let mut charges = Vec::new();
        let mut days = Vec::new();
        let mut token_days = Vec::new();
        // The holds every process on the store put (a 429's Retry-After,
        // requests at zero until a reset): one store call for the route.
        let subjects: Vec<u64> = route.scopes.iter().map(|s| s.subject).collect();
        for h in self.holds_until(&subjects).await.into_iter().flatten() {
            ready_at = ready_at.max(h);
        }
        for (k, s) in route.scopes.iter().enumerate() {
            for (axis, limit) in s.token_axes(cost) {
                let c = cost.on(axis);
                let limit = if let Some(reserve_ahead) = batch {
                    // Batch tokens go at the budget's own rate (so that room
                    // comes back evenly, never in a burst interactive
                    // requests would wait behind), on what interactive
                    // requests leave.
                    let paced = self.inner.batch_pace.lock().ready_at(s.subject, axis);
                    let burst = u64::try_from(BATCH_BURST.as_nanos()).unwrap_or(u64::MAX);
                    tokens_at = tokens_at.max(Timestamp::from_nanos(
                        paced.as_nanos().saturating_sub(burst),
                    ));
                    let (reserve, clear) = self
                        .batch_room(s.subject, axis, (limit, c), now, margin, reserve_ahead)
                        .await?;
                    if !clear {
                        tokens_at = tokens_at.max(now.saturating_add(BATCH_LOOK));
                    }
                    limit.saturating_sub(reserve)
                } else {
                    limit
                };
                let h = self
                    .inner
                    .window(axis)
                    .plan(
                        &self.inner.store,
                        s.subject,
                        now,
                        margin,
                        limit,
                        c,
                        deadline,
                    )
                    .await?;
                tokens_at = tokens_at.max(h.ready_at().unwrap_or_else(never));
                let room = h.room_by_deadline();
                room_by_deadline = room_by_deadline.min(match axis {
                    TokenAxis::Total => room,
                    TokenAxis::Input => room.saturating_add(cost.output),
                    TokenAxis::Output if room >= c => u32::MAX,
                    TokenAxis::Output => 0,
                });
                charges.push(Planned {
                    scope: k,
                    axis,
                    limit,
                    cost: c,
                    reading: h,
                });
            }
            if s.limits.rpd > 0 {
                let cache = self.inner.day_cache(s.subject);
                let h = self
                    .inner
                    .rpd
                    .read(&self.inner.store, s.subject, &cache, now, margin)
                    .await?;
                if let Some(t) = h.room_at(s.limits.rpd, 1, now) {
                    ready_at = ready_at.max(t);
                }
                days.push((k, h));
            }
            if s.limits.tpd > 0 && cost.total() > 0 {
                let cache = self.inner.token_day_cache(s.subject);
                let h = self
                    .inner
                    .tpd
                    .read(&self.inner.store, s.subject, &cache, now, margin)
                    .await?;
                // More than the whole day's tokens never fits.
                let at = h
                    .room_at(s.limits.tpd, cost.total(), now)
                    .unwrap_or_else(never);
                ready_at = ready_at.max(at);
                token_days.push((k, h));
            }
            if s.limits.rpm > 0 {
                let d = self
                    .inner
                    .store
                    .peek(&[self.rpm_budget(s.subject, s.limits.rpm, margin)])
                    .await?;
                if let Some(wait) = d.retry_after() {
                    ready_at = ready_at.max(now.saturating_add(wait));
                }
            }
        }
        let tokens_late = tokens_at > deadline && ready_at <= deadline;
        Ok(Plan {
            ready_at: ready_at.max(tokens_at),
            tokens_late,
            room_by_deadline,
            charges,
            days,
            token_days,
        })
    }

    /// What a batch request of `cost` tokens leaves on `subject`'s `axis`
    /// (of `limit`) for interactive requests: the largest interactive
    /// request of the window, held back now (returned, to reserve against);
    /// and whether, at every horizon until the batch tokens leave the
    /// window, the tokens still counted then leave room for the interactive
    /// ones that come by then at their rate over the window, plus
    /// `reserve_ahead` more of them (`interactiveReserveSeconds`; false: wait).
    /// Until the window turns over (as after a start), nothing leaves it, so
    /// this holds back what interactive requests will need meanwhile.
    pub(super) async fn batch_room(
        &self,
        subject: u64,
        axis: TokenAxis,
        (limit, cost): (u32, u32),
        now: Timestamp,
        margin: Duration,
        reserve_ahead: Duration,
    ) -> Result<(u32, bool), PaceError> {
        let span = Duration::from_secs(60) + margin;
        let (per_sec, largest) = self
            .inner
            .interactive
            .lock()
            .demand(subject, axis, now, span);
        if largest == 0 {
            return Ok((0, true));
        }
        let still = self
            .inner
            .window(axis)
            .ahead(&self.inner.store, subject, margin, &BATCH_HORIZONS)
            .await?;
        let clear = BATCH_HORIZONS.iter().zip(still).all(|(h, still)| {
            let coming =
                per_sec * (h.as_secs_f64() + reserve_ahead.as_secs_f64()) + f64::from(largest);
            still as f64 + f64::from(cost) + coming <= f64::from(limit)
        });
        Ok((largest, clear))
    }
}
