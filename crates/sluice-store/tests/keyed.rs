//! The keyed limiter as a user drives it: waits on tokio's (paused) timer,
//! and over a real `redis-server` shared by two limiters (two replicas).

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use sluice_core::{Clock, Timestamp};
use sluice_store::{KeyedLimiter, MemoryConfig, MemoryStore, Quota};

/// A clock that reads tokio's timer, so a paused runtime drives both the
/// limiter's decisions and its sleeps.
struct TokioClock {
    start: tokio::time::Instant,
}

impl Clock for TokioClock {
    fn now(&self) -> Timestamp {
        Timestamp::from_secs(1_764_460_800).saturating_add(self.start.elapsed())
    }
}

fn nz(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).expect("non-zero")
}

#[tokio::test(start_paused = true)]
async fn until_key_ready_waits_exactly_one_interval_per_unit_past_the_burst() {
    let start = tokio::time::Instant::now();
    let store = MemoryStore::with_clock(MemoryConfig::default(), TokioClock { start });
    let limiter = KeyedLimiter::with_memory(Quota::per_second(nz(4)), store);
    for _ in 0..4 {
        limiter.until_key_ready(&7u64).await;
    }
    assert_eq!(start.elapsed(), Duration::ZERO, "the burst does not wait");
    for _ in 0..4 {
        limiter.until_key_ready(&7u64).await;
    }
    assert_eq!(
        start.elapsed(),
        Duration::from_secs(1),
        "4 more at 250 ms each"
    );
    // Another key was never touched.
    limiter.until_key_ready(&8u64).await;
    assert_eq!(start.elapsed(), Duration::from_secs(1));
}

#[tokio::test(start_paused = true)]
async fn concurrent_waiters_on_one_key_are_admitted_at_the_rate() {
    let start = tokio::time::Instant::now();
    let store = MemoryStore::with_clock(MemoryConfig::default(), TokioClock { start });
    let limiter = Arc::new(KeyedLimiter::with_memory(Quota::per_second(nz(10)), store));
    let tasks: Vec<_> = (0..30)
        .map(|_| {
            let limiter = Arc::clone(&limiter);
            tokio::spawn(async move {
                limiter.until_key_ready("shared").await;
                start.elapsed()
            })
        })
        .collect();
    let mut done = Vec::new();
    for t in tasks {
        done.push(t.await.expect("task"));
    }
    done.sort();
    // 10 at once, then one every 100 ms: the last of 30 at 2 s.
    assert_eq!(done[9], Duration::ZERO);
    assert_eq!(done[29], Duration::from_secs(2));
    for pair in done[10..].windows(2) {
        assert!(pair[1] - pair[0] <= Duration::from_millis(100));
    }
}

#[cfg(feature = "redis")]
use crate::redis_server;

#[cfg(feature = "redis")]
mod redis {
    use super::*;
    use sluice_store::{RedisConfig, RedisStore};

    use super::redis_server;

    async fn replica(url: String) -> KeyedLimiter<str, RedisStore> {
        let mut config = RedisConfig::new(url);
        config.timeout = Duration::from_millis(500);
        let store = RedisStore::connect(config).await.expect("connect");
        KeyedLimiter::with_redis(Quota::per_hour(nz(3)), store).named("login")
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn d1_two_replicas_share_each_keys_budget() {
        let server = redis_server::RedisServer::start("keyed");
        let a = replica(server.url()).await;
        let b = replica(server.url()).await;
        assert_eq!(a.check_key("alice").await.expect("redis"), Ok(()));
        assert_eq!(b.check_key("alice").await.expect("redis"), Ok(()));
        assert_eq!(a.check_key("alice").await.expect("redis"), Ok(()));
        let refused = b
            .check_key("alice")
            .await
            .expect("redis")
            .expect_err("the 4th in an hour, on either replica");
        assert!(refused.wait_time() > Duration::from_secs(1100));
        assert!(refused.wait_time() <= Duration::from_secs(1200));
        assert_eq!(b.check_key("bob").await.expect("redis"), Ok(()));
        // Another name is another budget on the same Redis.
        let other = replica(server.url()).await.named("signup");
        assert_eq!(other.check_key("alice").await.expect("redis"), Ok(()));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_unreachable_redis_is_an_error_not_an_admission() {
        let mut server = redis_server::RedisServer::start("keyed-down");
        let a = replica(server.url()).await;
        server.kill();
        assert!(a.check_key("alice").await.is_err());
    }
}
