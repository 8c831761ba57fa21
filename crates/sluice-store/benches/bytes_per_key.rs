//! Bytes per live key: RSS growth while inserting 1,000,000 distinct keys,
//! measured the same way for sluice's memory store and governor's default
//! keyed store. Each side runs in a fresh child process so one's allocations
//! do not colour the other's.
//!
//! `cargo bench -p sluice-store --bench bytes_per_key`

use std::num::NonZeroU32;
use std::process::Command;

use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};
use sluice_core::{Budget, BudgetKey};
use sluice_store::{MemoryConfig, MemoryStore};

const KEYS: u64 = 1_000_000;

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

fn measure(side: &str) -> f64 {
    let before;
    let after;
    match side {
        "sluice" => {
            let store = MemoryStore::new(MemoryConfig::with_max_keys(2 * KEYS as usize));
            let scope = BudgetKey::new("standard", b"").scope();
            let minute = NonZeroU32::new(60).expect("non-zero");
            before = rss_bytes();
            for k in 0..KEYS {
                let b = Budget::per_window(BudgetKey::from_digests(scope, k), 100, minute);
                store.decide_now(&[b]).expect("decide");
            }
            after = rss_bytes();
            assert_eq!(store.len() as u64, KEYS);
        }
        _ => {
            let gov: DefaultKeyedRateLimiter<u64> =
                RateLimiter::keyed(Quota::per_minute(NonZeroU32::new(100).expect("nz")));
            before = rss_bytes();
            for k in 0..KEYS {
                gov.check_key(&k).ok();
            }
            after = rss_bytes();
            assert_eq!(gov.len() as u64, KEYS);
        }
    }
    (after - before) as f64 / KEYS as f64
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(pos) = args.iter().position(|a| a == "--child") {
        let side = args.get(pos + 1).map_or("sluice", String::as_str);
        println!("{}", measure(side));
        return;
    }
    let exe = std::env::current_exe().expect("own path");
    let run = |side: &str| -> f64 {
        let out = Command::new(&exe)
            .args(["--child", side])
            .output()
            .expect("child");
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .unwrap_or(f64::NAN)
    };
    let sluice = run("sluice");
    let governor = run("governor");
    println!("bytes per live key, RSS growth over {KEYS} keys");
    println!("  sluice MemoryStore        {sluice:7.1} B/key");
    println!("  governor keyed (u64 key)  {governor:7.1} B/key");
    println!("  ratio sluice/governor     {:7.2}x", sluice / governor);
}
