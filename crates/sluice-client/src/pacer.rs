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
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use http::HeaderMap;
use sluice_core::{Budget, BudgetKey, Clock, MAX_BUDGETS, Rate, Timestamp};
use sluice_store::{BudgetStore, MemoryConfig, MemoryStore};

use crate::clock::TokioClock;
use crate::config::{LimitsSource, PaceConfig, ProviderConfig, StaticLimits};
use crate::error::PaceError;
use crate::headers::RateLimitHeaders;
use crate::permit::Charge;
pub use crate::permit::Permit;
use crate::priority::{AcquireOptions, BatchPace, InteractiveLog, Priority};
use crate::route::{Cost, Route, Scope, TokenAxis, group_of, routes};
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
    /// Of the requests let through, batch requests (M3).
    pub batch: u64,
}

#[derive(Default)]
pub(crate) struct Counters([AtomicU64; 10]);

impl Counters {
    pub(crate) fn add(&self, i: usize, n: u64) {
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
pub(crate) const RECONCILED: usize = 6;
const UPSTREAM_429: usize = 7;
const RETRIES: usize = 8;
const BATCH: usize = 9;

#[derive(Debug, Default)]
struct Learned {
    headers: Option<RateLimitHeaders>,
    observed_at: Option<Timestamp>,
}

/// One queue of requests spending the same budgets (one provider, one
/// model group): the FIFO gates and the plan of the request at its head.
#[derive(Default)]
struct Queue {
    /// Interactive requests, first come first served.
    gate: tokio::sync::Mutex<()>,
    /// Batch requests, first come first served among themselves.
    batch_gate: tokio::sync::Mutex<()>,
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
}

/// The most queues (model groups) one provider keeps; past it, requests of
/// new groups share one overflow queue (still paced, only less fairly).
const MAX_QUEUES: usize = 1_024;

/// One provider's local state: its queues, counters, what it learned from
/// headers.
#[derive(Default)]
pub(crate) struct ProviderState {
    queues: parking_lot::Mutex<HashMap<String, Arc<Queue>>>,
    /// Interactive requests between arrival and admission: batch requests
    /// wait while any does.
    interactive_waiting: AtomicUsize,
    /// Rung when no interactive request waits any more, or room comes back.
    batch_wake: tokio::sync::Notify,
    learned: parking_lot::Mutex<Learned>,
    /// What headers last said per model group (groups come from the config).
    learned_by_group: parking_lot::Mutex<HashMap<String, (RateLimitHeaders, Timestamp)>>,
    pub(crate) counters: Counters,
    recent: parking_lot::Mutex<RecentRequests>,
}

impl ProviderState {
    fn queue(&self, group: &str) -> Arc<Queue> {
        let mut q = self.queues.lock();
        if q.len() >= MAX_QUEUES && !q.contains_key(group) {
            return q.entry("\0overflow".to_owned()).or_default().clone();
        }
        q.entry(group.to_owned()).or_default().clone()
    }

    /// Wakes every waiting request of the provider to look again.
    pub(crate) fn ring(&self) {
        for q in self.queues.lock().values() {
            q.room.notify_one();
            q.behind.notify_waiters();
        }
        self.batch_wake.notify_waiters();
    }
}

/// Counts an interactive request as waiting while it lives.
struct Waiting<'s>(&'s ProviderState);

impl<'s> Waiting<'s> {
    fn new(state: &'s ProviderState) -> Self {
        state.interactive_waiting.fetch_add(1, Ordering::SeqCst);
        Waiting(state)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if self.0.interactive_waiting.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.batch_wake.notify_waiters();
        }
    }
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

/// The instants ahead at which a batch request checks that interactive
/// requests would still find room.
const BATCH_HORIZONS: [Duration; 7] = [
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
const BATCH_LOOK: Duration = Duration::from_millis(250);
/// How far ahead of the even pace of all tokens (batch and interactive)
/// batch tokens may go.
const BATCH_BURST: Duration = Duration::from_secs(3);

/// The most budgets whose settled day slots are kept in memory.
const MAX_DAY_CACHES: usize = 4_096;

struct Inner<S, C> {
    store: S,
    clock: C,
    source: Arc<dyn LimitsSource>,
    tpm: TokenWindow,
    itpm: TokenWindow,
    otpm: TokenWindow,
    rpd: SlotWindow,
    rpm_scope: u64,
    providers: parking_lot::Mutex<HashMap<String, Arc<ProviderState>>>,
    /// Per budget: no request before this instant (a 429's Retry-After, a
    /// provider saying nothing is left until a reset).
    holds: parking_lot::Mutex<HashMap<u64, Timestamp>>,
    /// Per budget: the day slots read once and kept.
    days: parking_lot::Mutex<HashMap<u64, Arc<parking_lot::Mutex<SlotCache>>>>,
    interactive: parking_lot::Mutex<InteractiveLog>,
    batch_pace: parking_lot::Mutex<BatchPace>,
}

impl<S, C> Inner<S, C> {
    fn window(&self, axis: TokenAxis) -> &TokenWindow {
        match axis {
            TokenAxis::Total => &self.tpm,
            TokenAxis::Input => &self.itpm,
            TokenAxis::Output => &self.otpm,
        }
    }

    fn day_cache(&self, subject: u64) -> Arc<parking_lot::Mutex<SlotCache>> {
        let mut d = self.days.lock();
        if d.len() >= MAX_DAY_CACHES && !d.contains_key(&subject) {
            d.clear();
        }
        d.entry(subject).or_default().clone()
    }

    fn hold_of(&self, subject: u64) -> Option<Timestamp> {
        self.holds.lock().get(&subject).copied()
    }
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

/// What the request at the head of a queue waits for.
#[derive(Clone, Copy, Debug)]
struct Head {
    /// When it goes.
    ready_at: Timestamp,
    /// On which route (key).
    route: usize,
    /// The tokens it reserves then.
    cost: Cost,
}

/// Clears the head's plan when the head leaves the queue (admitted, refused
/// or cancelled).
struct HeadGuard<'s>(&'s Queue);

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
    Went(Box<Permit<S, C>>),
    /// Not now; perhaps at this instant.
    LookAt(Timestamp),
    /// Not now.
    No,
}

/// One token axis of one scope, as planned.
struct Planned {
    scope: usize,
    axis: TokenAxis,
    /// The limit reserved against (lower for a batch request).
    limit: u32,
    cost: u32,
    reading: TokenReading,
}

struct Plan {
    ready_at: Timestamp,
    tokens_late: bool,
    /// The total tokens the request could shrink to and fit by its deadline.
    room_by_deadline: u32,
    charges: Vec<Planned>,
    days: Vec<(usize, History)>,
}

/// One request as the pacer sees it on every look.
struct Ask<'a> {
    provider: &'a str,
    state: &'a Arc<ProviderState>,
    queue: &'a Arc<Queue>,
    group: Option<&'a str>,
    arrived: Timestamp,
    priority: Priority,
}

fn cost_of(demand: &dyn Demand) -> Cost {
    let e = demand.split();
    Cost {
        input: e.prompt,
        output: e.completion,
    }
}

fn never() -> Timestamp {
    Timestamp::from_nanos(u64::MAX)
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
        let minute = Duration::from_secs(60);
        Pacer {
            inner: Arc::new(Inner {
                store,
                clock,
                source,
                tpm: TokenWindow::new("tpm", minute, options.token_slot),
                itpm: TokenWindow::new("itpm", minute, options.token_slot),
                otpm: TokenWindow::new("otpm", minute, options.token_slot),
                rpd: SlotWindow::new("rpd", Duration::from_secs(86_400), options.request_slot),
                rpm_scope: sluice_core::digest(b"sluice-pace/rpm"),
                providers: parking_lot::Mutex::new(HashMap::new()),
                holds: parking_lot::Mutex::new(HashMap::new()),
                days: parking_lot::Mutex::new(HashMap::new()),
                interactive: parking_lot::Mutex::new(InteractiveLog::default()),
                batch_pace: parking_lot::Mutex::new(BatchPace::default()),
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
        map.entry(provider.to_owned()).or_default().clone()
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
        let model = options.model.as_deref().or_else(|| demand.model());
        let group = group_of(p, model).map(str::to_owned);
        let state = self.state(provider);
        let queue = state.queue(group.as_deref().unwrap_or(""));
        let ask = Ask {
            provider,
            state: &state,
            queue: &queue,
            group: group.as_deref(),
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

    async fn acquire_interactive(
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
            let cost = cost_of(demand);
            let routes = routes(&p, ask.group);
            let (i, plan) = self.best(&routes, cost, now, deadline, None).await?;
            if plan.ready_at <= now {
                if let Some(permit) = self.try_reserve(ask, &p, &routes[i], cost, &plan).await? {
                    return Ok(self.admitted(ask, &routes[i], permit, now, cost));
                }
                // Another process spent first: look again shortly.
                tokio::time::sleep(Duration::from_millis(1)).await;
                continue;
            }
            if plan.ready_at > deadline {
                let wait = plan.ready_at.saturating_since(now);
                shrink_or_refuse(ask, &p, demand, &mut shrink_tried, &plan, wait)?;
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
    async fn acquire_batch(
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
            let cost = cost_of(demand);
            let routes = routes(&p, ask.group);
            let wake = ask.state.batch_wake.notified();
            let room = ask.queue.room.notified();
            let mut sleep = MAX_SLEEP;
            if ask.state.interactive_waiting.load(Ordering::SeqCst) == 0 {
                let (i, plan) = self
                    .best(&routes, cost, now, deadline, Some(p.interactive_reserve))
                    .await?;
                if plan.ready_at <= now {
                    if let Some(permit) = self.try_reserve(ask, &p, &routes[i], cost, &plan).await?
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
                shrink_or_refuse(ask, &p, demand, &mut shrink_tried, &whole, wait)?;
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

    /// Counts `permit`, reserved at `now` for `ask`, and gives it its wait.
    fn admitted(
        &self,
        ask: &Ask<'_>,
        route: &Route,
        permit: Permit<S, C>,
        now: Timestamp,
        cost: Cost,
    ) -> Permit<S, C> {
        let waited = now.saturating_since(ask.arrived);
        let c = &ask.state.counters;
        c.add(ADMITTED, 1);
        if ask.priority == Priority::Batch {
            c.add(BATCH, 1);
            let span = Duration::from_secs(60) + self.config().pacer.arrival_margin;
            let mut pace = self.inner.batch_pace.lock();
            for s in &route.scopes {
                for (axis, limit) in s.token_axes(cost) {
                    pace.spend(s.subject, axis, cost.on(axis), limit, span, now);
                }
            }
        } else {
            // Interactive tokens count toward the batch pace too (they never
            // wait for it): batch and interactive tokens together go no
            // faster than the budget's rate, so the window fills as evenly
            // as it empties, and room never comes back with long gaps in it.
            let span = Duration::from_secs(60) + self.config().pacer.arrival_margin;
            let mut log = self.inner.interactive.lock();
            let mut pace = self.inner.batch_pace.lock();
            for s in &route.scopes {
                log.record(s.subject, now, cost);
                for (axis, limit) in s.token_axes(cost) {
                    pace.spend(s.subject, axis, cost.on(axis), limit, span, now);
                }
            }
        }
        ask.state.recent.lock().add(now.as_secs());
        if !waited.is_zero() {
            c.add(WAITED, 1);
            c.add(
                WAIT_MS,
                u64::try_from(waited.as_millis()).unwrap_or(u64::MAX),
            );
        }
        permit.with_waited(waited)
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
    async fn try_ahead(
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
        let cost = cost_of(demand);
        let now = self.inner.clock.now();
        let margin = config.pacer.arrival_margin;
        let routes = routes(p, ask.group);
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
        Ok(match self.try_reserve(ask, p, route, cost, &plan).await? {
            Some(permit) => Ahead::Went(Box::new(self.admitted(ask, route, permit, now, cost))),
            None => Ahead::No,
        })
    }

    fn check_size(
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

    /// The route that can send `cost` soonest and its plan (the first of
    /// equals).
    async fn best(
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

    async fn plan(
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
        for s in &route.scopes {
            if let Some(h) = self.inner.hold_of(s.subject) {
                ready_at = ready_at.max(h);
            }
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
    async fn batch_room(
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

    async fn try_reserve(
        &self,
        ask: &Ask<'_>,
        p: &ProviderConfig,
        route: &Route,
        cost: Cost,
        plan: &Plan,
    ) -> Result<Option<Permit<S, C>>, PaceError> {
        let margin = self.config().pacer.arrival_margin;
        let mut budgets = Vec::with_capacity(MAX_BUDGETS);
        let mut charges = Vec::with_capacity(plan.charges.len());
        let mut day_slots = Vec::with_capacity(plan.days.len());
        for c in &plan.charges {
            let subject = route.scopes[c.scope].subject;
            budgets.push(
                self.inner
                    .window(c.axis)
                    .budget(subject, margin, c.limit, c.cost),
            );
            charges.push(Charge {
                subject,
                axis: c.axis,
                tokens: c.cost,
                slot: c.reading.current(),
                limit: c.axis.limit(&route.scopes[c.scope].limits),
            });
        }
        for s in &route.scopes {
            if s.limits.rpm > 0 {
                budgets.push(self.rpm_budget(s.subject, s.limits.rpm, margin));
            }
        }
        for (k, h) in &plan.days {
            let s = &route.scopes[*k];
            let older = h.total() - u64::from(h.current_value());
            let limit = u32::try_from(u64::from(s.limits.rpd).saturating_sub(older)).unwrap_or(0);
            budgets.push(self.inner.rpd.cell(s.subject, h.current(), limit, 1));
            day_slots.push((s.subject, h.current()));
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
        let window_at_decision = plan
            .charges
            .iter()
            .map(|c| {
                (
                    route.scopes[c.scope].subject,
                    c.axis,
                    c.reading.total() + u64::from(c.cost),
                )
            })
            .collect();
        Ok(Some(Permit {
            pacer: self.clone(),
            state: ask.state.clone(),
            provider: ask.provider.into(),
            group: ask.group.map(Into::into),
            key_name: route.key_name.clone(),
            secret: route.secret.clone(),
            scopes: route.scopes.clone(),
            reserved: if charges.is_empty() {
                Cost::default()
            } else {
                cost
            },
            charges,
            day_slots,
            decided_at,
            window_at_decision,
            waited: Duration::ZERO,
            reconcile: p.reconcile,
        }))
    }

    /// Holds every request to `provider` for `d` from now, on every key (a
    /// 429's `Retry-After`, a provider saying nothing is left until a reset).
    pub fn hold(&self, provider: &str, d: Duration) {
        let config = self.config();
        let Some(p) = config.provider(provider) else {
            return;
        };
        for r in routes(p, None) {
            self.hold_subject(r.scopes[0].subject, d);
        }
    }

    /// Holds the budgets of `subject` for `d` from now.
    pub(crate) fn hold_subject(&self, subject: u64, d: Duration) {
        let now = self.inner.clock.now();
        let until = now.saturating_add(d.min(MAX_HOLD));
        let mut holds = self.inner.holds.lock();
        holds.retain(|_, t| *t > now);
        let h = holds.entry(subject).or_insert(until);
        *h = (*h).max(until);
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
            );
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

    async fn tokens_of(
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

    /// The effective limits per provider as JSON (`GET /limits`): the
    /// config's ([`PaceConfig::limits_json`], per-model limits and key names
    /// included, never a key) plus, per provider, what its headers last said
    /// (`learned`, and per model group under `models.<group>.learned`), the
    /// pacer's counters (`stats`), and the last reload error (`configError`).
    pub fn limits_json(&self) -> serde_json::Value {
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
                let hold = config
                    .provider(name)
                    .map(|p| {
                        routes(p, None)
                            .iter()
                            .filter_map(|r| self.inner.hold_of(r.scopes[0].subject))
                            .max()
                    })
                    .unwrap_or_default();
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
                    "holdSeconds".into(),
                    serde_json::json!(
                        hold.map(|h| h.saturating_since(now).as_secs_f64())
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

/// Crate-internal reads of the books, for [`Permit`].
impl<S, C> Pacer<S, C>
where
    S: BudgetStore + 'static,
    C: Clock + 'static,
{
    pub(crate) fn window(&self, axis: TokenAxis) -> &TokenWindow {
        self.inner.window(axis)
    }

    pub(crate) fn day_window(&self) -> &SlotWindow {
        &self.inner.rpd
    }

    pub(crate) fn day_cache(&self, subject: u64) -> Arc<parking_lot::Mutex<SlotCache>> {
        self.inner.day_cache(subject)
    }

    /// Tokens given back by an answer (of either priority) no longer count
    /// toward the batch pace.
    pub(crate) fn batch_refund(&self, c: &Charge, tokens: u32) {
        let span = Duration::from_secs(60) + self.config().pacer.arrival_margin;
        self.inner
            .batch_pace
            .lock()
            .refund(c.subject, c.axis, tokens, c.limit, span);
    }
}

/// A request that cannot go by its deadline (`plan`, `wait` from now): shrunk once to
/// what fits by then when the provider allows it (`Ok`: look again), else refused with
/// [`PaceError::WouldWait`].
fn shrink_or_refuse(
    ask: &Ask<'_>,
    p: &ProviderConfig,
    demand: &mut dyn Demand,
    shrink_tried: &mut bool,
    plan: &Plan,
    wait: Duration,
) -> Result<(), PaceError> {
    if p.shrink && !*shrink_tried && plan.tokens_late {
        *shrink_tried = true;
        if demand.shrink_to(plan.room_by_deadline) {
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
