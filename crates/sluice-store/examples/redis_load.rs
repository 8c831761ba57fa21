//! Decisions per second through the Redis store at a given concurrency, for
//! `bench/redis/run`. Usage:
//! `redis_load URL [CONCURRENCY=64] [SECONDS=5] [BUDGETS=1]`.

use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use sluice_core::{Budget, BudgetKey};
use sluice_store::{BudgetStore, RedisConfig, RedisStore};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let url = args
        .get(1)
        .ok_or("usage: redis_load URL [CONCURRENCY] [SECONDS] [BUDGETS]")?;
    let concurrency: usize = args.get(2).map_or(Ok(64), |s| s.parse())?;
    let seconds: u64 = args.get(3).map_or(Ok(5), |s| s.parse())?;
    let budgets: usize = args.get(4).map_or(Ok(1), |s| s.parse())?;
    // With `quota` as the fifth argument, each decision also spends a monthly quota
    // of one of 100 workspaces (SPEC Q1), in the same script call.
    let quota = args.get(5).is_some_and(|s| s == "quota");
    let mut config = RedisConfig::new(url.clone());
    config.timeout = Duration::from_secs(2);
    let store = Arc::new(RedisStore::connect(config).await?);
    let window = NonZeroU32::MAX;
    let done = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let started = Instant::now();
    let tasks: Vec<_> = (0..concurrency)
        .map(|t| {
            let (store, done, errors) =
                (Arc::clone(&store), Arc::clone(&done), Arc::clone(&errors));
            tokio::spawn(async move {
                let mut i = 0u64;
                while Instant::now() < deadline {
                    let subject = (t as u64) * 1_000_000 + i % 1_000;
                    let mut req: Vec<Budget> = (0..budgets as u64)
                        .map(|b| {
                            Budget::per_window(
                                BudgetKey::from_digests(b, subject),
                                u32::MAX,
                                window,
                            )
                        })
                        .collect();
                    if quota {
                        req.push(Budget {
                            key: BudgetKey::from_digests(u64::MAX, subject % 100),
                            rate: sluice_core::Rate::CalendarMonth,
                            limit: u32::MAX,
                            cost: 1,
                        });
                    }
                    match store.decide(&req).await {
                        Ok(_) => done.fetch_add(1, Ordering::Relaxed),
                        Err(_) => errors.fetch_add(1, Ordering::Relaxed),
                    };
                    i += 1;
                }
            })
        })
        .collect();
    for t in tasks {
        t.await?;
    }
    let elapsed = started.elapsed().as_secs_f64();
    let n = done.load(Ordering::Relaxed);
    println!(
        "{:.0} decisions/s ({n} decisions, {} errors, concurrency {concurrency}, {budgets} budget(s) each{})",
        n as f64 / elapsed,
        errors.load(Ordering::Relaxed),
        if quota { " and a monthly quota" } else { "" }
    );
    Ok(())
}
