//! A keyed rate limiter in two statements: "10 requests a second per user".
//!
//! [`KeyedLimiter`] keeps one budget per key (any [`Hash`] type: a user id, an
//! IP address, a `(tenant, route)` pair) under one [`Quota`], over the
//! [`MemoryStore`] by default or over a `RedisStore`
//! shared by every replica (feature `redis`). Budgets refill by the generic
//! cell rate algorithm: `n` units per period, evenly spaced, at most `burst`
//! back to back (by default the whole `n`).

use std::fmt;
use std::hash::{BuildHasher, Hash, Hasher};
use std::marker::PhantomData;
use std::num::NonZeroU32;
use std::time::Duration;

use sluice_core::{
    Budget, BudgetKey, Clock, Decision, GcraStep, Rate, SystemClock, Timestamp, digest,
};

use crate::{MemoryConfig, MemoryStore};

/// How many units a key may spend: `limit` per `period`, evenly spaced, at
/// most `burst` back to back.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Quota {
    limit: NonZeroU32,
    period: Duration,
    burst: NonZeroU32,
}

impl Quota {
    /// `n` units a second, all `n` allowed at once.
    pub const fn per_second(n: NonZeroU32) -> Self {
        Quota::per(n, Duration::from_secs(1))
    }

    /// `n` units a minute, all `n` allowed at once.
    pub const fn per_minute(n: NonZeroU32) -> Self {
        Quota::per(n, Duration::from_secs(60))
    }

    /// `n` units an hour, all `n` allowed at once.
    pub const fn per_hour(n: NonZeroU32) -> Self {
        Quota::per(n, Duration::from_secs(3600))
    }

    /// `n` units per `period`, all `n` allowed at once.
    pub const fn per(n: NonZeroU32, period: Duration) -> Self {
        Quota {
            limit: n,
            period,
            burst: n,
        }
    }

    /// One unit every `interval`, one at a time (pacing).
    pub const fn with_period(interval: Duration) -> Self {
        Quota {
            limit: NonZeroU32::MIN,
            period: interval,
            burst: NonZeroU32::MIN,
        }
    }

    /// The same rate with at most `burst` units back to back.
    #[must_use]
    pub const fn allow_burst(mut self, burst: NonZeroU32) -> Self {
        self.burst = burst;
        self
    }

    /// Units per period.
    pub const fn limit(&self) -> NonZeroU32 {
        self.limit
    }

    /// The period `limit` units are spread over.
    pub const fn period(&self) -> Duration {
        self.period
    }

    /// Units allowed back to back.
    pub const fn burst(&self) -> NonZeroU32 {
        self.burst
    }

    /// The time between two units: `period / limit`, rounded down to a whole
    /// microsecond (at least one), as every store spaces them.
    pub fn interval(&self) -> Duration {
        let micros = self.period.as_micros() / u128::from(self.limit.get());
        Duration::from_micros(u64::try_from(micros).unwrap_or(u64::MAX).max(1))
    }

    fn step(&self) -> GcraStep {
        GcraStep::new(self.period, self.limit.get(), self.burst)
    }

    fn budget(&self, key: BudgetKey, cost: u32) -> Budget {
        Budget {
            key,
            rate: Rate::Gcra {
                period: self.period,
                burst: self.burst,
            },
            limit: self.limit.get(),
            cost,
        }
    }
}

/// A refusal that will pass later: the key's budget has room again after
/// [`NotUntil::wait_time`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NotUntil {
    decided_at: Timestamp,
    wait: Duration,
}

impl NotUntil {
    /// How long from the decision until the call would be admitted, if
    /// nothing else spends on the key meanwhile.
    pub fn wait_time(&self) -> Duration {
        self.wait
    }

    /// The instant (on the limiter's clock) from which the call would be
    /// admitted.
    pub fn earliest_possible(&self) -> Timestamp {
        self.decided_at.saturating_add(self.wait)
    }

    /// The wait left at `now` (zero once [`NotUntil::earliest_possible`] has passed).
    pub fn wait_time_from(&self, now: Timestamp) -> Duration {
        self.earliest_possible().saturating_since(now)
    }

    fn from_decision(d: &Decision) -> Self {
        NotUntil {
            decided_at: d.decided_at(),
            wait: d.retry_after().unwrap_or(Duration::ZERO),
        }
    }
}

impl fmt::Display for NotUntil {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rate-limited for another {:?}", self.wait)
    }
}

impl std::error::Error for NotUntil {}

/// A batch larger than the quota's burst: it can never be admitted at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InsufficientCapacity(pub u32);

impl fmt::Display for InsufficientCapacity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "at most {} units fit at once", self.0)
    }
}

impl std::error::Error for InsufficientCapacity {}

/// How keys become budget subjects.
#[derive(Clone, Debug)]
enum KeyHasher {
    /// Seeded per limiter: nobody can aim two keys at one budget. For a store
    /// of this process only.
    Random(foldhash::fast::RandomState),
    /// SipHash-1-3 with sluice's fixed keys: every replica derives the same
    /// subject for the same key. For shared stores.
    #[cfg_attr(not(any(feature = "redis", test)), allow(dead_code))]
    Fixed,
}

impl KeyHasher {
    #[inline]
    fn subject<K: Hash + ?Sized>(&self, key: &K) -> u64 {
        match self {
            KeyHasher::Random(state) => state.hash_one(key),
            KeyHasher::Fixed => {
                let mut h = FixedHasher(Vec::new());
                key.hash(&mut h);
                digest(&h.0)
            }
        }
    }
}

/// Collects a key's bytes for [`digest`] (keys are short; the bytes are
/// what `Hash` writes, so equal keys give equal bytes).
struct FixedHasher(Vec<u8>);

impl Hasher for FixedHasher {
    fn finish(&self) -> u64 {
        digest(&self.0)
    }

    fn write(&mut self, bytes: &[u8]) {
        self.0.extend_from_slice(bytes);
    }
}

/// Many budgets under one [`Quota`], one per key; `S` is where they live.
///
/// Over the [`MemoryStore`] (the default) [`KeyedLimiter::check_key`] is a
/// plain function call; over a `RedisStore` it is async
/// and can fail when Redis cannot answer. Keys are hashed to 64 bits, so the
/// store holds no raw key; with the memory store the hash is seeded per
/// limiter. The memory store is bounded (see [`MemoryConfig::max_keys`]):
/// past its cap new keys share one overflow budget and keys that already
/// have a budget keep it.
///
/// ```
/// use std::num::NonZeroU32;
/// use sluice_store::{KeyedLimiter, Quota};
///
/// // 100 a minute per (tenant, route), at most 10 back to back.
/// let ten = NonZeroU32::new(10).unwrap();
/// let limiter = KeyedLimiter::new(Quota::per_minute(ten.saturating_mul(ten)).allow_burst(ten));
/// for _ in 0..10 {
///     assert!(limiter.check_key(&("acme", "/search")).is_ok());
/// }
/// let refused = limiter.check_key(&("acme", "/search")).unwrap_err();
/// assert!(refused.wait_time().as_millis() <= 600); // a unit every 60 s / 100
/// ```
pub struct KeyedLimiter<K: ?Sized, S = MemoryStore> {
    store: S,
    quota: Quota,
    /// The quota's GCRA spacing, worked out once.
    step: GcraStep,
    scope: u64,
    hasher: KeyHasher,
    _keys: PhantomData<fn(&K)>,
}

impl<K: ?Sized, S> fmt::Debug for KeyedLimiter<K, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyedLimiter")
            .field("quota", &self.quota)
            .finish_non_exhaustive()
    }
}

/// The scope of a limiter nobody named.
const DEFAULT_SCOPE: &str = "keyed";

impl<K: Hash + ?Sized> KeyedLimiter<K> {
    /// A limiter over its own [`MemoryStore`] (default sizing: a million
    /// keys, about 20 MB at the cap) on the real clock.
    pub fn new(quota: Quota) -> Self {
        KeyedLimiter::with_memory(quota, MemoryStore::new(MemoryConfig::default()))
    }

    /// `n` calls a second per key, all `n` allowed at once.
    pub fn per_second(n: NonZeroU32) -> Self {
        KeyedLimiter::new(Quota::per_second(n))
    }

    /// `n` calls a minute per key, all `n` allowed at once.
    pub fn per_minute(n: NonZeroU32) -> Self {
        KeyedLimiter::new(Quota::per_minute(n))
    }

    /// `n` calls an hour per key, all `n` allowed at once.
    pub fn per_hour(n: NonZeroU32) -> Self {
        KeyedLimiter::new(Quota::per_hour(n))
    }
}

impl<K: ?Sized, S> KeyedLimiter<K, S> {
    /// The quota every key gets.
    pub fn quota(&self) -> Quota {
        self.quota
    }

    /// The store the budgets live in.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// The same limiter under another name. Limiters sharing one store keep
    /// apart budgets only when their names differ (the default name is
    /// `keyed`); give each limiter over a shared Redis its own.
    #[must_use]
    pub fn named(mut self, name: &str) -> Self {
        self.scope = digest(name.as_bytes());
        self
    }
}

impl<K: Hash + ?Sized, C: Clock> KeyedLimiter<K, MemoryStore<C>> {
    /// A limiter over `store` (e.g. sized with [`MemoryConfig`], or on a
    /// [`FakeClock`](sluice_core::FakeClock) in tests). The store may be
    /// shared with other limiters of other names.
    pub fn with_memory(quota: Quota, store: MemoryStore<C>) -> Self {
        KeyedLimiter {
            store,
            quota,
            step: quota.step(),
            scope: digest(DEFAULT_SCOPE.as_bytes()),
            hasher: KeyHasher::Random(foldhash::fast::RandomState::default()),
            _keys: PhantomData,
        }
    }

    /// Spends one unit of `key`'s budget if it has one; otherwise changes
    /// nothing and says how long until it will.
    ///
    /// # Errors
    /// [`NotUntil`] when the key's budget is spent for now.
    #[inline]
    pub fn check_key(&self, key: &K) -> Result<(), NotUntil> {
        let budget = self.budget(key, 1);
        // One unit always fits a quota (limit and burst are at least 1), so the
        // step never answers "never" (`u64::MAX`) here.
        match self.store.spend_gcra(&budget, &self.step) {
            (_, Ok(())) => Ok(()),
            (decided_at, Err(wait)) => Err(NotUntil {
                decided_at,
                wait: Duration::from_nanos(wait),
            }),
        }
    }

    /// Spends `n` units of `key`'s budget at once, or none.
    ///
    /// # Errors
    /// [`InsufficientCapacity`] when `n` is above the quota's burst (it can
    /// never fit); `Ok(Err(NotUntil))` when it does not fit yet.
    pub fn check_key_n(
        &self,
        key: &K,
        n: NonZeroU32,
    ) -> Result<Result<(), NotUntil>, InsufficientCapacity> {
        if n > self.quota.burst {
            return Err(InsufficientCapacity(self.quota.burst.get()));
        }
        let budget = self.budget(key, n.get());
        match self.store.decide_now(std::slice::from_ref(&budget)) {
            Ok(d) if d.is_admitted() => Ok(Ok(())),
            Ok(d) if d.is_never() => Err(InsufficientCapacity(self.quota.burst.get())),
            Ok(d) => Ok(Err(NotUntil::from_decision(&d))),
            Err(_) => Err(InsufficientCapacity(self.quota.burst.get())),
        }
    }

    /// How many units `key` could spend now, changing nothing.
    pub fn remaining(&self, key: &K) -> u32 {
        let budget = self.budget(key, 0);
        self.store
            .peek_now(std::slice::from_ref(&budget))
            .ok()
            .and_then(|d| d.binding().map(|s| s.remaining))
            .unwrap_or(0)
    }

    /// Waits (on tokio's timer) until `key`'s budget has a unit, then spends it.
    ///
    /// Cancel-safe: dropping the future spends nothing. Waiters on one key are
    /// not queued: each retries when its own wait is over.
    #[cfg(feature = "tokio")]
    pub async fn until_key_ready(&self, key: &K) {
        loop {
            match self.check_key(key) {
                Ok(()) => return,
                Err(not_until) => tokio::time::sleep(not_until.wait_time()).await,
            }
        }
    }

    #[inline]
    fn budget(&self, key: &K, cost: u32) -> Budget {
        let subject = self.hasher.subject(key);
        self.quota
            .budget(BudgetKey::from_digests(self.scope, subject), cost)
    }
}

impl<K: Hash + ?Sized> Default for KeyedLimiter<K, MemoryStore<SystemClock>> {
    /// One call a second per key.
    fn default() -> Self {
        KeyedLimiter::per_second(NonZeroU32::MIN)
    }
}

#[cfg(feature = "redis")]
mod shared {
    use super::*;
    use crate::{BudgetStore, RedisStore, StoreError};

    impl<K: Hash + ?Sized> KeyedLimiter<K, RedisStore> {
        /// A limiter over a Redis shared by every replica: together they
        /// admit the quota once per key. Keys are hashed with fixed SipHash
        /// keys, so replicas agree as long as they hash the same key type on
        /// the same byte order; decisions use the Redis server's clock.
        pub fn with_redis(quota: Quota, store: RedisStore) -> Self {
            KeyedLimiter {
                store,
                quota,
                step: quota.step(),
                scope: digest(DEFAULT_SCOPE.as_bytes()),
                hasher: KeyHasher::Fixed,
                _keys: PhantomData,
            }
        }

        /// Spends one unit of `key`'s budget if it has one; otherwise
        /// changes nothing and says how long until it will. One script call.
        ///
        /// # Errors
        /// [`StoreError::Unavailable`] when Redis does not answer within its
        /// timeout; `Ok(Err(NotUntil))` when the budget is spent for now.
        pub async fn check_key(&self, key: &K) -> Result<Result<(), NotUntil>, StoreError> {
            let subject = self.hasher.subject(key);
            let budget = self
                .quota
                .budget(BudgetKey::from_digests(self.scope, subject), 1);
            let d = self.store.decide(std::slice::from_ref(&budget)).await?;
            Ok(if d.is_admitted() {
                Ok(())
            } else {
                Err(NotUntil::from_decision(&d))
            })
        }

        /// Waits until `key`'s budget has a unit, then spends it.
        ///
        /// # Errors
        /// [`StoreError::Unavailable`] when Redis does not answer.
        pub async fn until_key_ready(&self, key: &K) -> Result<(), StoreError> {
            loop {
                match self.check_key(key).await? {
                    Ok(()) => return Ok(()),
                    Err(not_until) => tokio::time::sleep(not_until.wait_time()).await,
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_core::FakeClock;

    fn nz(n: u32) -> NonZeroU32 {
        NonZeroU32::new(n).expect("non-zero")
    }

    fn on_fake_clock(quota: Quota) -> (KeyedLimiter<str, MemoryStore<FakeClock>>, FakeClock) {
        let clock = FakeClock::new(Timestamp::from_secs(1_764_460_800));
        let store = MemoryStore::with_clock(MemoryConfig::default(), clock.clone());
        (KeyedLimiter::with_memory(quota, store), clock)
    }

    #[test]
    fn per_second_admits_the_burst_then_one_unit_per_interval() {
        let (lim, clock) = on_fake_clock(Quota::per_second(nz(10)));
        for i in 0..10 {
            assert!(lim.check_key("alice").is_ok(), "call {i}");
        }
        let refused = lim
            .check_key("alice")
            .expect_err("11th in the same instant");
        assert_eq!(refused.wait_time(), Duration::from_millis(100));
        assert_eq!(
            refused.earliest_possible(),
            Timestamp::from_secs(1_764_460_800).saturating_add(Duration::from_millis(100))
        );
        clock.advance(Duration::from_millis(99));
        let still = lim.check_key("alice").expect_err("1 ms early");
        assert_eq!(still.wait_time(), Duration::from_millis(1));
        clock.advance(Duration::from_millis(1));
        assert!(lim.check_key("alice").is_ok());
        assert!(lim.check_key("alice").is_err());
    }

    #[test]
    fn keys_have_their_own_budgets_and_names_keep_limiters_apart() {
        let (lim, _) = on_fake_clock(Quota::per_minute(nz(1)));
        assert!(lim.check_key("alice").is_ok());
        assert!(lim.check_key("alice").is_err());
        assert!(lim.check_key("bob").is_ok());
        assert_eq!(lim.remaining("carol"), 1);
        assert_eq!(lim.remaining("alice"), 0);
    }

    #[test]
    fn a_refusal_spends_nothing() {
        let (lim, clock) = on_fake_clock(Quota::per_hour(nz(2)).allow_burst(nz(1)));
        assert!(lim.check_key("k").is_ok());
        for _ in 0..100 {
            assert!(lim.check_key("k").is_err());
        }
        clock.advance(Duration::from_secs(1800));
        assert!(
            lim.check_key("k").is_ok(),
            "refusals did not push the wait out"
        );
    }

    #[test]
    fn check_key_n_is_all_or_nothing_and_says_never_past_the_burst() {
        let (lim, _) = on_fake_clock(Quota::per_second(nz(5)));
        assert_eq!(lim.check_key_n("k", nz(6)), Err(InsufficientCapacity(5)));
        assert_eq!(lim.check_key_n("k", nz(3)), Ok(Ok(())));
        let later = lim.check_key_n("k", nz(3)).expect("fits the burst");
        assert_eq!(
            later.expect_err("2 left").wait_time(),
            Duration::from_millis(200)
        );
        assert_eq!(lim.remaining("k"), 2, "the refused batch spent nothing");
    }

    #[test]
    fn with_period_paces_one_at_a_time() {
        let (lim, clock) = on_fake_clock(Quota::with_period(Duration::from_millis(250)));
        assert!(lim.check_key("k").is_ok());
        assert_eq!(
            lim.check_key("k").expect_err("paced").wait_time(),
            Duration::from_millis(250)
        );
        clock.advance(Duration::from_millis(250));
        assert!(lim.check_key("k").is_ok());
    }

    #[test]
    fn past_the_store_cap_keys_that_have_a_budget_keep_it_and_new_keys_share_one() {
        // A store of 64 cells on one shard, each key holding one: the 65th
        // key goes the general way (its shard is full of live cells) into
        // the shared overflow budget, and says so with a refusal and a wait.
        let clock = FakeClock::new(Timestamp::from_secs(1_764_460_800));
        let store = MemoryStore::with_clock(
            MemoryConfig::with_max_keys(64).with_shards(1),
            clock.clone(),
        );
        let lim: KeyedLimiter<u64, _> = KeyedLimiter::with_memory(Quota::per_minute(nz(2)), store);
        for k in 0..64 {
            assert!(lim.check_key(&k).is_ok(), "key {k}");
        }
        assert!(
            lim.check_key(&1_000).is_ok(),
            "the overflow budget's first unit"
        );
        assert!(
            lim.check_key(&1_001).is_ok(),
            "and its second, by another new key"
        );
        let shared = lim
            .check_key(&1_002)
            .expect_err("the overflow budget is spent");
        assert_eq!(shared.wait_time(), Duration::from_secs(30));
        assert!(
            lim.check_key(&5).is_ok(),
            "key 5 kept its own budget: one unit left"
        );
        assert_eq!(
            lim.check_key(&5).expect_err("spent").wait_time(),
            Duration::from_secs(30)
        );
        assert_eq!(lim.store().len(), 64);
    }

    #[test]
    fn the_fixed_hasher_is_the_same_on_every_replica() {
        let a = KeyHasher::Fixed.subject("user-1");
        assert_eq!(a, KeyHasher::Fixed.subject("user-1"));
        assert_ne!(a, KeyHasher::Fixed.subject("user-2"));
    }
}
