//! The pacer: per provider a rolling 60 s token
//! window, requests spaced evenly (GCRA with a burst of one) and a rolling
//! day of requests, all kept in a [`BudgetStore`] so that processes sharing
//! the store share the budgets.
//!
//! A request *reserves* its estimate before it is sent (waiting, first come
//! first served, exactly until the windows have room; a smaller request may
//! go ahead of a waiting one only where that delays it not at all) and
//! *reconciles* with
//! the answer's actual `usage` afterwards ([`Permit::reconcile`]). The
//! provider counts a request when it arrives, not when it was sent, so every
//! window reaches back `60 s + arrival margin`.

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use http::HeaderMap;
use sluice_core::{Budget, BudgetKey, Clock, Rate, Timestamp};
use sluice_store::{BudgetStore, MemoryConfig, MemoryStore};

use crate::clock::TokioClock;
use crate::config::{LimitsSource, PaceConfig, ProviderConfig, StaticLimits};
use crate::error::PaceError;
use crate::headers::RateLimitHeaders;
use crate::shrink::Demand;
use crate::window::{History, SlotCache, SlotWindow, TokenReading, TokenWindow};

/// The longest single sleep: a waiting request re-reads the config (and the
/// shared books) at least this often.
const MAX_SLEEP: Duration = Duration::from_secs(1);
/// The longest hold a provider's headers may impose.
const MAX_HOLD: Duration = Duration::from_secs(24 * 3600);

/// Slot sizes of the pacer's windows: [`PacerOptions::default`], then set
/// the fields to change.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct PacerOptions {
    /// Slot of the 60 s token window: a reservation counts until its slot's
    /// end + 60 s + margin (default 250 ms).
    pub token_slot: Duration,
    /// Slot of the 24 h request window (default 60 s).
    pub request_slot: Duration,
}

impl Default for PacerOptions {
    fn default() -> Self {
        PacerOptions {
            token_slot: Duration::from_millis(250),
            request_slot: Duration::from_secs(60),
        }
    }
}

/// Counters per provider.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ProviderStats {
    /// Requests let through.
    pub admitted: u64,
    /// Of those, requests admitted later than they arrived: those that
    /// slept for room and those queued behind them.
    pub waited: u64,
    /// Total time those requests spent waiting, in milliseconds.
    pub wait_ms: u64,
    /// Refused: larger than the whole TPM.
    pub too_large: u64,
    /// Refused: room later than the maximum wait.
    pub would_wait: u64,
    /// Requests shrunk to fit.
    pub shrunk: u64,
    /// Answers whose usage corrected a reservation.
    pub reconciled: u64,
    /// 429 answers seen from the provider.
    pub upstream_429: u64,
    /// Retries made.
    pub retries: u64,
}

#[derive(Default)]
struct Counters([AtomicU64; 9]);

impl Counters {
    fn add(&self, i: usize, n: u64) {
        self.0[i].fetch_add(n, Ordering::Relaxed);
    }
    fn get(&self, i: usize) -> u64 {
        self.0[i].load(Ordering::Relaxed)
    }
}

const ADMITTED: usize = 0;
const WAITED: usize = 1;
const WAIT_MS: usize = 2;
const TOO_LARGE: usize = 3;
const WOULD_WAIT: usize = 4;
const SHRUNK: usize = 5;
const RECONCILED: usize = 6;
const UPSTREAM_429: usize = 7;
const RETRIES: usize = 8;

#[derive(Debug, Default)]
struct Learned {
    hold_until: Option<Timestamp>,
    headers: Option<RateLimitHeaders>,
    observed_at: Option<Timestamp>,
}

/// One provider's local state: the FIFO gate, the slots it has read, what
/// it learned from headers.
struct ProviderState {
    gate: tokio::sync::Mutex<()>,
    /// Rung when this process gives tokens or requests back, so that the
    /// request waiting at the head of the queue looks again at once instead
    /// of at its next planned instant.
    room: tokio::sync::Notify,
    /// The request at the head of the queue while it waits: when it goes and
    /// what it takes. Requests behind it may go first when that changes
    /// neither (see [`Pacer::try_ahead`]).
    head: parking_lot::Mutex<Option<Head>>,
    /// Rung when the head's plan changes or room is given back, for the
    /// requests behind the head.
    behind: tokio::sync::Notify,
    /// One request at a time checks whether it may go ahead of the head and
    /// reserves, so that two together never delay it.
    ahead: tokio::sync::Mutex<()>,
    tokens: parking_lot::Mutex<SlotCache>,
    days: parking_lot::Mutex<SlotCache>,
    learned: parking_lot::Mutex<Learned>,
    counters: Counters,
    recent: parking_lot::Mutex<RecentRequests>,
}

/// Requests this process let through, per second of the last minute: what the
/// admin page shows against the RPM (the RPM itself is paced by spacing, which
/// keeps no count).
#[derive(Debug)]
struct RecentRequests {
    /// (Unix second, requests in it), by second modulo 60.
    seconds: [(u64, u32); 60],
}

impl Default for RecentRequests {
    fn default() -> Self {
        RecentRequests {
            seconds: [(0, 0); 60],
        }
    }
}

impl RecentRequests {
    fn add(&mut self, second: u64) {
        let slot = &mut self.seconds[(second % 60) as usize];
        if slot.0 != second {
            *slot = (second, 0);
        }
        slot.1 = slot.1.saturating_add(1);
    }

    /// Requests in the 60 seconds that end with `now`.
    fn last_minute(&self, now: u64) -> u64 {
        self.seconds
            .iter()
            .filter(|(second, _)| *second <= now && second + 60 > now)
            .map(|(_, n)| u64::from(*n))
            .sum()
    }
}

/// Where a provider's windows stand now ([`Pacer::reading`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
#[non_exhaustive]
pub struct WindowReading {
    /// Tokens in the rolling 60 s window (+ arrival margin), as the books stand
    /// (shared by every process on the key); 0 while the TPM is unlimited.
    pub tokens: u64,
    /// Requests this process let through in the last 60 s.
    pub requests_last_minute: u64,
    /// Requests in the rolling day as the books stand, `None` while the RPD is
    /// unlimited (no day is counted then).
    pub requests_today: Option<u64>,
}

struct Inner<S, C> {
    store: S,
    clock: C,
    source: Arc<dyn LimitsSource>,
    tpm: TokenWindow,
    rpd: SlotWindow,
    rpm_scope: u64,
    providers: parking_lot::Mutex<HashMap<String, Arc<ProviderState>>>,
}

/// Keeps calls to LLM providers inside their TPM, RPM and RPD.
///
/// Cheap to clone (one `Arc`). See the crate docs for an example.
pub struct Pacer<S = MemoryStore<TokioClock>, C = TokioClock> {
    inner: Arc<Inner<S, C>>,
}

impl<S, C> Clone for Pacer<S, C> {
    fn clone(&self) -> Self {
        Pacer {
            inner: self.inner.clone(),
        }
    }
}

impl Pacer<MemoryStore<TokioClock>, TokioClock> {
    /// A pacer on an in-process store and the real clock (read through
    /// tokio, so paused-time tests drive it).
    pub fn new(source: Arc<dyn LimitsSource>) -> Self {
        let clock = TokioClock::system();
        Self::with_store(
            MemoryStore::with_clock(MemoryConfig::default(), clock),
            clock,
            source,
        )
    }

    /// [`Pacer::new`] over a fixed config.
    pub fn from_config(config: PaceConfig) -> Self {
        Self::new(Arc::new(StaticLimits::new(config)))
    }
}

fn subject_of(p: &ProviderConfig) -> u64 {
    // Same provider and key → same budgets in every process (the key is
    // hashed, never stored).
    let mut s = Vec::with_capacity(64);
    s.extend_from_slice(p.name.as_bytes());
    s.push(0);
    match &p.api_key {
        Some(k) => s.extend_from_slice(k.as_bytes()),
        None => s.extend_from_slice(p.base_url.as_bytes()),
    }
    sluice_core::digest(&s)
}

/// What the request at the head of a provider's queue waits for.
#[derive(Clone, Copy, Debug)]
struct Head {
    /// When it goes.
    ready_at: Timestamp,
    /// The tokens it reserves then.
    tokens: u32,
}

/// Clears the head's plan when the head leaves the queue (admitted, refused
/// or cancelled).
struct HeadGuard<'s>(&'s ProviderState);

impl HeadGuard<'_> {
    fn publish(&self, head: Head) {
        *self.0.head.lock() = Some(head);
        self.0.behind.notify_waiters();
    }
}

impl Drop for HeadGuard<'_> {
    fn drop(&mut self) {
        *self.0.head.lock() = None;
        self.0.behind.notify_waiters();
    }
}

/// What [`Pacer::try_ahead`] found.
enum Ahead<S: BudgetStore + 'static, C: Clock + 'static> {
    /// Reserved ahead of the head.
    Went(Permit<S, C>),
    /// Not now; perhaps at this instant.
    LookAt(Timestamp),
    /// Not now.
    No,
}

struct Plan {
    ready_at: Timestamp,
    tokens_late: bool,
    room_by_deadline: u32,
    tokens: Option<TokenReading>,
    days: Option<History>,
}

impl<S, C> Pacer<S, C>
where
    S: BudgetStore + 'static,
    C: Clock + 'static,
{
    /// A pacer keeping its books in `store`, reading time from `clock` (the
    /// store's clock, for an in-process store) and the config from `source`
    /// on every request.
    pub fn with_store(store: S, clock: C, source: Arc<dyn LimitsSource>) -> Self {
        Self::with_options(store, clock, source, PacerOptions::default())
    }

    /// [`Pacer::with_store`] with other slot sizes.
    pub fn with_options(
        store: S,
        clock: C,
        source: Arc<dyn LimitsSource>,
        options: PacerOptions,
    ) -> Self {
        Pacer {
            inner: Arc::new(Inner {
                store,
                clock,
                source,
                tpm: TokenWindow::new("tpm", Duration::from_secs(60), options.token_slot),
                rpd: SlotWindow::new("rpd", Duration::from_secs(86_400), options.request_slot),
                rpm_scope: sluice_core::digest(b"sluice-pace/rpm"),
                providers: parking_lot::Mutex::new(HashMap::new()),
            }),
        }
    }

    /// The config in force (re-read if its file changed).
    pub fn config(&self) -> Arc<PaceConfig> {
        self.inner.source.current()
    }

    /// Where the config comes from.
    pub fn source(&self) -> &Arc<dyn LimitsSource> {
        &self.inner.source
    }

    /// The clock the pacer reads.
    pub fn clock(&self) -> &C {
        &self.inner.clock
    }

    /// The store holding the books.
    pub fn store(&self) -> &S {
        &self.inner.store
    }

    fn state(&self, provider: &str) -> Arc<ProviderState> {
        let mut map = self.inner.providers.lock();
        map.entry(provider.to_owned())
            .or_insert_with(|| {
                Arc::new(ProviderState {
                    gate: tokio::sync::Mutex::new(()),
                    room: tokio::sync::Notify::new(),
                    head: parking_lot::Mutex::new(None),
                    behind: tokio::sync::Notify::new(),
                    ahead: tokio::sync::Mutex::new(()),
                    tokens: parking_lot::Mutex::new(SlotCache::default()),
                    days: parking_lot::Mutex::new(SlotCache::default()),
                    learned: parking_lot::Mutex::new(Learned::default()),
                    counters: Counters::default(),
                    recent: parking_lot::Mutex::new(RecentRequests::default()),
                })
            })
            .clone()
    }

    fn rpm_budget(&self, subject: u64, rpm: u32, margin: Duration) -> Budget {
        Budget {
            key: BudgetKey::from_digests(self.inner.rpm_scope, subject),
            rate: Rate::Gcra {
                period: Duration::from_secs(60) + margin,
                burst: NonZeroU32::MIN,
            },
            limit: rpm,
            cost: 1,
        }
    }

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
        self.acquire_demand(provider, &mut estimate).await
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
        let arrived = self.inner.clock.now();
        if self.config().provider(provider).is_none() {
            return Err(PaceError::UnknownProvider {
                provider: provider.to_owned(),
            });
        }
        let state = self.state(provider);
        let mut shrink_tried = false;
        // Refuse a request that can never fit before it queues.
        self.check_size(provider, &state, demand, &mut shrink_tried)?;
        // First come, first served: the gate is fair. While its turn has not
        // come, a request goes ahead of the one waiting at the head when it
        // fits now and the head still goes when it planned to.
        let turn = state.gate.lock();
        tokio::pin!(turn);
        let _turn = loop {
            let look_again = match self.try_ahead(provider, &state, demand, arrived).await? {
                Ahead::Went(permit) => return Ok(permit),
                Ahead::LookAt(t) => t.saturating_since(self.inner.clock.now()).min(MAX_SLEEP),
                Ahead::No => MAX_SLEEP,
            };
            let behind = state.behind.notified();
            tokio::select! {
                biased;
                turn = &mut turn => break turn,
                () = behind => {}
                () = tokio::time::sleep(look_again) => {}
            }
        };
        let head = HeadGuard(&state);
        loop {
            let p = self.check_size(provider, &state, demand, &mut shrink_tried)?;
            let config = self.config();
            let margin = config.pacer.arrival_margin;
            let subject = subject_of(&p);
            let now = self.inner.clock.now();
            let deadline = arrived.saturating_add(p.max_wait);
            let tokens = demand.tokens();
            let plan = self
                .plan(&state, &p, subject, margin, tokens, now, deadline)
                .await?;
            if plan.ready_at <= now {
                if let Some(permit) = self
                    .try_reserve(provider, &state, &p, subject, margin, tokens, &plan)
                    .await?
                {
                    return Ok(self.admitted(&state, permit, arrived, now));
                }
                // Another process spent first: look again shortly.
                tokio::time::sleep(Duration::from_millis(1)).await;
                continue;
            }
            if plan.ready_at > deadline {
                if p.shrink && !shrink_tried && plan.tokens_late {
                    shrink_tried = true;
                    if demand.shrink_to(plan.room_by_deadline) {
                        state.counters.add(SHRUNK, 1);
                        continue;
                    }
                }
                state.counters.add(WOULD_WAIT, 1);
                return Err(PaceError::WouldWait {
                    provider: provider.to_owned(),
                    wait: plan.ready_at.saturating_since(now),
                    max_wait: p.max_wait,
                });
            }
            head.publish(Head {
                ready_at: plan.ready_at,
                tokens,
            });
            let sleep = plan.ready_at.saturating_since(now).min(MAX_SLEEP);
            // Room given back by an answer's usage (or a refusal) may come
            // before the planned instant: look again as soon as it does.
            tokio::select! {
                () = tokio::time::sleep(sleep) => {}
                () = state.room.notified() => {}
            }
        }
    }

    /// Counts `permit`, reserved at `now` for a request that arrived at
    /// `arrived`, and gives it its wait.
    fn admitted(
        &self,
        state: &ProviderState,
        permit: Permit<S, C>,
        arrived: Timestamp,
        now: Timestamp,
    ) -> Permit<S, C> {
        let waited = now.saturating_since(arrived);
        let c = &state.counters;
        c.add(ADMITTED, 1);
        state.recent.lock().add(now.as_secs());
        if !waited.is_zero() {
            c.add(WAITED, 1);
            c.add(
                WAIT_MS,
                u64::try_from(waited.as_millis()).unwrap_or(u64::MAX),
            );
        }
        permit.with_waited(waited)
    }

    /// Reserves for a request behind the head of `provider`'s queue when it
    /// fits now and leaves the head's plan as it is: the tokens of both fit
    /// by the head's instant, the request spacing still lets the head go
    /// then, and the day has room for both. A large request waiting for room
    /// no longer leaves the room that builds up before it unused (smaller
    /// ones behind it take it), and is never delayed by them. Within this
    /// process: other processes sharing the books do not see the head.
    ///
    /// # Errors
    /// As [`Pacer::acquire`].
    async fn try_ahead(
        &self,
        provider: &str,
        state: &Arc<ProviderState>,
        demand: &mut dyn Demand,
        arrived: Timestamp,
    ) -> Result<Ahead<S, C>, PaceError> {
        let Some(head) = *state.head.lock() else {
            return Ok(Ahead::No);
        };
        let Ok(_one) = state.ahead.try_lock() else {
            return Ok(Ahead::No);
        };
        let config = self.config();
        let Some(p) = config.provider(provider) else {
            return Ok(Ahead::No);
        };
        let l = p.limits;
        let tokens = demand.tokens();
        let now = self.inner.clock.now();
        let margin = config.pacer.arrival_margin;
        if l.tpm == 0 || tokens == 0 || head.ready_at <= now || tokens > l.tpm {
            return Ok(Ahead::No);
        }
        if l.rpm > 0 {
            let spacing = (Duration::from_secs(60) + margin) / l.rpm;
            if now.saturating_add(spacing) > head.ready_at {
                return Ok(Ahead::No);
            }
        }
        let subject = subject_of(p);
        let deadline = arrived.saturating_add(p.max_wait);
        let plan = self
            .plan(state, p, subject, margin, tokens, now, deadline)
            .await?;
        if plan.ready_at > now {
            return Ok(if plan.ready_at < head.ready_at {
                Ahead::LookAt(plan.ready_at)
            } else {
                Ahead::No
            });
        }
        if let Some(days) = &plan.days
            && days.room_at(l.rpd, 2, now).is_none_or(|t| t > now)
        {
            return Ok(Ahead::No);
        }
        let both = self
            .inner
            .tpm
            .plan(
                &self.inner.store,
                subject,
                now,
                margin,
                l.tpm,
                head.tokens.saturating_add(tokens),
                head.ready_at,
            )
            .await?;
        if both.ready_at().is_none_or(|t| t > head.ready_at) {
            return Ok(Ahead::No);
        }
        Ok(
            match self
                .try_reserve(provider, state, p, subject, margin, tokens, &plan)
                .await?
            {
                Some(permit) => Ahead::Went(self.admitted(state, permit, arrived, now)),
                None => Ahead::No,
            },
        )
    }

    fn check_size(
        &self,
        provider: &str,
        state: &ProviderState,
        demand: &mut dyn Demand,
        shrink_tried: &mut bool,
    ) -> Result<ProviderConfig, PaceError> {
        let config = self.config();
        let Some(p) = config.provider(provider) else {
            return Err(PaceError::UnknownProvider {
                provider: provider.to_owned(),
            });
        };
        let tpm = p.limits.tpm;
        if tpm > 0 && demand.tokens() > tpm {
            if p.shrink && !*shrink_tried {
                *shrink_tried = true;
                if demand.shrink_to(tpm) {
                    state.counters.add(SHRUNK, 1);
                }
            }
            if demand.tokens() > tpm {
                state.counters.add(TOO_LARGE, 1);
                return Err(PaceError::TooLarge {
                    provider: provider.to_owned(),
                    estimated: demand.tokens(),
                    limit: tpm,
                    shrink: p.shrink,
                });
            }
        }
        Ok(p.clone())
    }

    #[allow(clippy::too_many_arguments)]
    async fn plan(
        &self,
        state: &ProviderState,
        p: &ProviderConfig,
        subject: u64,
        margin: Duration,
        tokens: u32,
        now: Timestamp,
        deadline: Timestamp,
    ) -> Result<Plan, PaceError> {
        let l = p.limits;
        let mut ready_at = now;
        let mut tokens_at = now;
        let mut room_by_deadline = u32::MAX;
        let mut tokens_history = None;
        if let Some(h) = state.learned.lock().hold_until
            && h > ready_at
        {
            ready_at = h;
        }
        if l.tpm > 0 && tokens > 0 {
            let h = self
                .inner
                .tpm
                .plan(
                    &self.inner.store,
                    subject,
                    now,
                    margin,
                    l.tpm,
                    tokens,
                    deadline,
                )
                .await?;
            tokens_at = h.ready_at().unwrap_or(Timestamp::from_nanos(u64::MAX));
            room_by_deadline = h.room_by_deadline();
            tokens_history = Some(h);
        }
        let mut days = None;
        if l.rpd > 0 {
            let h = self
                .inner
                .rpd
                .read(&self.inner.store, subject, &state.days, now, margin)
                .await?;
            if let Some(t) = h.room_at(l.rpd, 1, now) {
                ready_at = ready_at.max(t);
            }
            days = Some(h);
        }
        if l.rpm > 0 {
            let d = self
                .inner
                .store
                .peek(&[self.rpm_budget(subject, l.rpm, margin)])
                .await?;
            if let Some(wait) = d.retry_after() {
                ready_at = ready_at.max(now.saturating_add(wait));
            }
        }
        let tokens_late = tokens_at > deadline && ready_at <= deadline;
        Ok(Plan {
            ready_at: ready_at.max(tokens_at),
            tokens_late,
            room_by_deadline,
            tokens: tokens_history,
            days,
        })
    }

    #[allow(clippy::too_many_arguments)]
    async fn try_reserve(
        &self,
        provider: &str,
        state: &Arc<ProviderState>,
        p: &ProviderConfig,
        subject: u64,
        margin: Duration,
        tokens: u32,
        plan: &Plan,
    ) -> Result<Option<Permit<S, C>>, PaceError> {
        let l = p.limits;
        let mut budgets = Vec::with_capacity(3);
        let mut token_slot = None;
        let mut day_slot = None;
        if let Some(h) = &plan.tokens {
            budgets.push(self.inner.tpm.budget(subject, margin, l.tpm, tokens));
            token_slot = Some(h.current());
        }
        if l.rpm > 0 {
            budgets.push(self.rpm_budget(subject, l.rpm, margin));
        }
        if let Some(h) = &plan.days {
            let older = h.total() - u64::from(h.current_value());
            let limit = u32::try_from(u64::from(l.rpd).saturating_sub(older)).unwrap_or(0);
            budgets.push(self.inner.rpd.cell(subject, h.current(), limit, 1));
            day_slot = Some(h.current());
        }
        let decided_at = if budgets.is_empty() {
            self.inner.clock.now()
        } else {
            let d = self.inner.store.decide(&budgets).await?;
            if !d.is_admitted() {
                return Ok(None);
            }
            d.decided_at()
        };
        Ok(Some(Permit {
            pacer: self.clone(),
            state: state.clone(),
            provider: provider.into(),
            subject,
            tokens: if token_slot.is_some() { tokens } else { 0 },
            token_slot,
            day_slot,
            decided_at,
            window_at_decision: plan.tokens.as_ref().map(|h| h.total() + u64::from(tokens)),
            waited: Duration::ZERO,
            reconcile: p.reconcile,
        }))
    }

    /// Holds every request to `provider` for `d` from now (a 429's
    /// `Retry-After`, a provider saying nothing is left until a reset).
    pub fn hold(&self, provider: &str, d: Duration) {
        let until = self.inner.clock.now().saturating_add(d.min(MAX_HOLD));
        let state = self.state(provider);
        let mut l = state.learned.lock();
        l.hold_until = Some(l.hold_until.map_or(until, |h| h.max(until)));
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
    /// even when the answer took long.
    ///
    /// # Errors
    /// [`PaceError::Store`].
    pub async fn observe(&self, provider: &str, headers: &HeaderMap) -> Result<(), PaceError> {
        let now = self.inner.clock.now();
        self.learn(provider, headers, now, None).await
    }

    /// Learns from `headers` describing the provider's books at `at`, when
    /// this pacer's window held `ours_at` tokens (read now when unknown).
    async fn learn(
        &self,
        provider: &str,
        headers: &HeaderMap,
        at: Timestamp,
        ours_at: Option<u64>,
    ) -> Result<(), PaceError> {
        let now = self.inner.clock.now();
        let h = RateLimitHeaders::parse(headers, at);
        if h.is_empty() {
            return Ok(());
        }
        let config = self.config();
        let Some(p) = config.provider(provider) else {
            return Ok(());
        };
        let state = self.state(provider);
        {
            let mut l = state.learned.lock();
            l.headers = Some(h);
            l.observed_at = Some(now);
        }
        if h.requests.remaining == Some(0)
            && let Some(reset) = h.requests.reset
        {
            // The reset counts from when the provider wrote it.
            self.hold(provider, at.saturating_add(reset).saturating_since(now));
        }
        if p.limits.tpm > 0
            && let Some(used) = h.tokens.used()
        {
            let margin = config.pacer.arrival_margin;
            let subject = subject_of(p);
            let hist = self
                .inner
                .tpm
                .read(&self.inner.store, subject, &state.tokens, now, margin)
                .await?;
            let ours = ours_at.unwrap_or_else(|| hist.total());
            if used > ours {
                let foreign = (used - ours).min(u64::from(p.limits.tpm));
                let cell = self.inner.tpm.cell(subject, hist.current(), u32::MAX, 0);
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
        }
    }

    /// Tokens in `provider`'s current 60 s window (+ margin), as the books
    /// stand.
    ///
    /// # Errors
    /// [`PaceError::UnknownProvider`], [`PaceError::Store`].
    pub async fn tokens_in_window(&self, provider: &str) -> Result<u64, PaceError> {
        let config = self.config();
        let p = config
            .provider(provider)
            .ok_or_else(|| PaceError::UnknownProvider {
                provider: provider.to_owned(),
            })?;
        let state = self.state(provider);
        let h = self
            .inner
            .tpm
            .read(
                &self.inner.store,
                subject_of(p),
                &state.tokens,
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
        let requests_today = if p.limits.rpd > 0 {
            let h = self
                .inner
                .rpd
                .read(
                    &self.inner.store,
                    subject_of(p),
                    &state.days,
                    now,
                    config.pacer.arrival_margin,
                )
                .await?;
            Some(h.total())
        } else {
            None
        };
        let requests_last_minute = state.recent.lock().last_minute(now.as_secs());
        Ok(WindowReading {
            tokens,
            requests_last_minute,
            requests_today,
        })
    }

    /// The effective limits per provider as JSON (`GET /limits`): the
    /// config's ([`PaceConfig::limits_json`]) plus, per provider, what its
    /// headers last said (`learned`) and the pacer's counters (`stats`), and
    /// the last reload error (`configError`).
    pub fn limits_json(&self) -> serde_json::Value {
        let config = self.config();
        let mut v = config.limits_json();
        let now = self.inner.clock.now();
        if let Some(map) = v.get_mut("providers").and_then(|m| m.as_object_mut()) {
            for (name, entry) in map.iter_mut() {
                let state = self.state(name);
                let l = state.learned.lock();
                if let Some(obj) = entry.as_object_mut() {
                    obj.insert(
                        "learned".into(),
                        match (&l.headers, l.observed_at) {
                            (Some(h), Some(at)) => serde_json::json!({
                                "headers": h,
                                "secondsAgo": now.saturating_since(at).as_secs_f64(),
                            }),
                            _ => serde_json::Value::Null,
                        },
                    );
                    obj.insert(
                        "holdSeconds".into(),
                        serde_json::json!(
                            l.hold_until
                                .map(|h| h.saturating_since(now).as_secs_f64())
                                .unwrap_or(0.0)
                        ),
                    );
                    drop(l);
                    obj.insert("stats".into(), serde_json::json!(self.stats(name)));
                }
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

/// A reservation: the request may go. Reconcile it with the answer's usage,
/// or cancel it when the provider did not count the request; dropping it
/// keeps the reservation (the safe side).
pub struct Permit<S = MemoryStore<TokioClock>, C = TokioClock>
where
    S: BudgetStore + 'static,
    C: Clock + 'static,
{
    pacer: Pacer<S, C>,
    state: Arc<ProviderState>,
    provider: Arc<str>,
    subject: u64,
    tokens: u32,
    token_slot: Option<u64>,
    day_slot: Option<u64>,
    decided_at: Timestamp,
    /// Tokens in this pacer's window just after the reservation.
    window_at_decision: Option<u64>,
    waited: Duration,
    reconcile: bool,
}

impl<S, C> std::fmt::Debug for Permit<S, C>
where
    S: BudgetStore + 'static,
    C: Clock + 'static,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Permit")
            .field("provider", &self.provider)
            .field("tokens", &self.tokens)
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
    fn with_waited(mut self, waited: Duration) -> Self {
        self.waited = waited;
        self
    }

    /// The provider.
    pub fn provider(&self) -> &str {
        &self.provider
    }

    /// Tokens reserved.
    pub fn tokens(&self) -> u32 {
        self.tokens
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
    /// books when the request arrived: they are compared with this pacer's
    /// books as they stood when it let the request go, so tokens that left
    /// the window or were given back while the answer was on its way are
    /// not taken for another client's, and a reset is counted from the
    /// request's arrival.
    ///
    /// # Errors
    /// [`PaceError::Store`].
    pub async fn observe(&self, headers: &HeaderMap) -> Result<(), PaceError> {
        self.pacer
            .learn(
                &self.provider,
                headers,
                self.decided_at,
                self.window_at_decision,
            )
            .await
    }

    /// Replaces the reservation by what the answer actually used: unused
    /// tokens go back to the window they were reserved in; extra tokens are
    /// charged now.
    ///
    /// # Errors
    /// [`PaceError::Store`].
    pub async fn reconcile(self, actual_tokens: u32) -> Result<(), PaceError> {
        if !self.reconcile {
            return Ok(());
        }
        self.state.counters.add(RECONCILED, 1);
        self.settle(actual_tokens, false).await
    }

    /// Gives the whole reservation back (the provider refused the request
    /// without counting it). The request's place in the RPM spacing is kept.
    ///
    /// # Errors
    /// [`PaceError::Store`].
    pub async fn cancel(self) -> Result<(), PaceError> {
        self.settle(0, true).await
    }

    async fn settle(self, actual: u32, give_back_request: bool) -> Result<(), PaceError> {
        let inner = &self.pacer.inner;
        if let Some(slot) = self.token_slot {
            let delta = i64::from(actual) - i64::from(self.tokens);
            if delta < 0 {
                let cell = inner.tpm.cell(self.subject, slot, u32::MAX, 0);
                inner.store.adjust(&cell, delta, self.decided_at).await?;
                self.state.tokens.lock().refund(
                    self.subject,
                    slot,
                    u32::try_from(-delta).unwrap_or(u32::MAX),
                );
            } else if delta > 0 {
                let now = inner.clock.now();
                let cell = inner
                    .tpm
                    .cell(self.subject, inner.tpm.slot_of(now), u32::MAX, 0);
                inner.store.adjust(&cell, delta, now).await?;
            }
        }
        if give_back_request && let Some(slot) = self.day_slot {
            let cell = inner.rpd.cell(self.subject, slot, u32::MAX, 0);
            inner.store.adjust(&cell, -1, self.decided_at).await?;
            self.state.days.lock().refund(self.subject, slot, 1);
        }
        if actual < self.tokens || give_back_request {
            // A waiting request may fit now (a stored wake-up when none
            // waits costs one extra look later).
            self.state.room.notify_one();
            self.state.behind.notify_waiters();
        }
        Ok(())
    }
}
