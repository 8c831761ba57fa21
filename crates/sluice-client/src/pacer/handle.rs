//! The [`Pacer`] handle and its books: the windows, the store, the holds,
//! the day caches and the per-provider state, shared by every clone.

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use sluice_core::{Budget, BudgetKey, Clock, Rate, Timestamp};
use sluice_store::{BudgetStore, MemoryConfig, MemoryStore};

use super::charge::Charge;
use super::state::ProviderState;
use crate::clock::TokioClock;
use crate::config::{LimitsSource, PaceConfig, StaticLimits};
use crate::priority::{BatchPace, InteractiveLog};
use crate::route::TokenAxis;
use crate::window::{SlotCache, SlotWindow, TokenWindow};

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

/// The most budgets whose settled day slots are kept in memory.
pub(super) const MAX_DAY_CACHES: usize = 4_096;

pub(super) struct Inner<S, C> {
    pub(super) store: S,
    pub(super) clock: C,
    pub(super) source: Arc<dyn LimitsSource>,
    pub(super) tpm: TokenWindow,
    pub(super) itpm: TokenWindow,
    pub(super) otpm: TokenWindow,
    pub(super) rpd: SlotWindow,
    /// The day of tokens (`tpd`): the RPD's geometry, spent in tokens.
    pub(super) tpd: SlotWindow,
    pub(super) rpm_scope: u64,
    pub(super) providers: parking_lot::Mutex<HashMap<String, Arc<ProviderState>>>,
    /// Scope of the holds' keys in the store (their subject is the budget's).
    pub(super) hold_scope: u64,
    /// Per budget: no request before this instant (a 429's Retry-After, a
    /// provider saying nothing is left until a reset), as this process put
    /// it. The store's hold ([`BudgetStore::hold`]) is the one every process
    /// sees; this one stands where it is later (a store that keeps no holds,
    /// a write to the store that failed).
    pub(super) holds: parking_lot::Mutex<HashMap<u64, Timestamp>>,
    /// Per budget: the day slots read once and kept.
    pub(super) days: parking_lot::Mutex<HashMap<u64, Arc<parking_lot::Mutex<SlotCache>>>>,
    /// Per budget: the settled slots of its day of tokens.
    pub(super) token_days: parking_lot::Mutex<HashMap<u64, Arc<parking_lot::Mutex<SlotCache>>>>,
    pub(super) interactive: parking_lot::Mutex<InteractiveLog>,
    pub(super) batch_pace: parking_lot::Mutex<BatchPace>,
}

impl<S, C> Inner<S, C> {
    pub(super) fn window(&self, axis: TokenAxis) -> &TokenWindow {
        match axis {
            TokenAxis::Total => &self.tpm,
            TokenAxis::Input => &self.itpm,
            TokenAxis::Output => &self.otpm,
        }
    }

    pub(super) fn day_cache(&self, subject: u64) -> Arc<parking_lot::Mutex<SlotCache>> {
        cache_of(&self.days, subject)
    }

    pub(super) fn token_day_cache(&self, subject: u64) -> Arc<parking_lot::Mutex<SlotCache>> {
        cache_of(&self.token_days, subject)
    }

    /// This process's own hold of `subject` (see [`Inner::holds`]).
    pub(super) fn hold_of(&self, subject: u64) -> Option<Timestamp> {
        self.holds.lock().get(&subject).copied()
    }

    /// The store's key of `subject`'s hold.
    pub(super) fn hold_key(&self, subject: u64) -> BudgetKey {
        BudgetKey::from_digests(self.hold_scope, subject)
    }
}

/// Keeps calls to LLM providers inside their TPM, RPM and RPD.
///
/// Cheap to clone (one `Arc`). See the crate docs for an example.
pub struct Pacer<S = MemoryStore<TokioClock>, C = TokioClock> {
    pub(super) inner: Arc<Inner<S, C>>,
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
                tpd: SlotWindow::new("tpd", Duration::from_secs(86_400), options.request_slot),
                rpm_scope: sluice_core::digest(b"sluice-pace/rpm"),
                hold_scope: sluice_core::digest(b"sluice-pace/hold"),
                providers: parking_lot::Mutex::new(HashMap::new()),
                holds: parking_lot::Mutex::new(HashMap::new()),
                days: parking_lot::Mutex::new(HashMap::new()),
                token_days: parking_lot::Mutex::new(HashMap::new()),
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

    pub(super) fn state(&self, provider: &str) -> Arc<ProviderState> {
        let mut map = self.inner.providers.lock();
        map.entry(provider.to_owned()).or_default().clone()
    }

    pub(super) fn rpm_budget(&self, subject: u64, rpm: u32, margin: Duration) -> Budget {
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
}

/// The day cache of `subject` in `caches`, made when missing (all of them
/// dropped past [`MAX_DAY_CACHES`]).
fn cache_of(
    caches: &parking_lot::Mutex<HashMap<u64, Arc<parking_lot::Mutex<SlotCache>>>>,
    subject: u64,
) -> Arc<parking_lot::Mutex<SlotCache>> {
    let mut d = caches.lock();
    if d.len() >= MAX_DAY_CACHES && !d.contains_key(&subject) {
        d.clear();
    }
    d.entry(subject).or_default().clone()
}

/// Crate-internal reads of the books, for [`Permit`](super::Permit).
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

    pub(crate) fn token_day_window(&self) -> &SlotWindow {
        &self.inner.tpd
    }

    pub(crate) fn token_day_cache(&self, subject: u64) -> Arc<parking_lot::Mutex<SlotCache>> {
        self.inner.token_day_cache(subject)
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
