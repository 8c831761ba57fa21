//! `KeyedLimiter::check_key` side by side with governor's
//! `DefaultKeyedRateLimiter::check_key`, in one run, then the ratios.
//!
//! Both limit u64 keys to a quota high enough that every call is admitted
//! (`per_second(u32::MAX)`), on their default clocks and stores. Rows: one
//! hot key and 100,000 keys round-robin, on 1 and 2 threads; multi-thread
//! rows report wall time divided by the calls made by all threads.

use std::hint::black_box;
use std::num::NonZeroU32;
use std::path::{Path, PathBuf};
use std::time::Duration;

mod support;
use support::threaded;

use criterion::Criterion;
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};
use sluice_store::KeyedLimiter;

const KEYS: u64 = 100_000;

const GROUPS: [&str; 4] = [
    "keyed_hot_key_1_thread",
    "keyed_100k_keys_1_thread",
    "keyed_hot_key_2_threads",
    "keyed_100k_keys_2_threads",
];

fn bench(c: &mut Criterion) {
    for (g, name) in GROUPS.iter().enumerate() {
        let threads = if g < 2 { 1 } else { 2 };
        let keys = if g % 2 == 0 { 1 } else { KEYS };
        let sluice: KeyedLimiter<u64> = KeyedLimiter::per_second(NonZeroU32::MAX);
        let gov: DefaultKeyedRateLimiter<u64> =
            RateLimiter::keyed(Quota::per_second(NonZeroU32::MAX));
        for k in 0..keys {
            sluice.check_key(&k).ok();
            gov.check_key(&k).ok();
        }
        let key = |t: u64, i: u64| (i * 7 + t * 50_000) % keys;
        let mut group = c.benchmark_group(*name);
        group.bench_function("sluice", |b| {
            b.iter_custom(|iters| {
                threaded(threads, iters, &|t, i| {
                    black_box(sluice.check_key(&key(t, i)).is_ok());
                })
            })
        });
        group.bench_function("governor", |b| {
            b.iter_custom(|iters| {
                threaded(threads, iters, &|t, i| {
                    black_box(gov.check_key(&key(t, i)).is_ok());
                })
            })
        });
        group.finish();
    }
}

/// Criterion's point estimate (slope, else mean) of one function, in ns.
fn estimate(dir: &Path, group: &str, function: &str) -> Option<f64> {
    let path = dir.join(group).join(function).join("new/estimates.json");
    let text = std::fs::read_to_string(path).ok()?;
    let at = |field: &str| -> Option<f64> {
        let rest = &text[text.find(&format!("\"{field}\":{{"))?..];
        let rest = &rest[rest.find("\"point_estimate\":")? + 17..];
        let end = rest.find([',', '}'])?;
        rest[..end].trim().parse().ok()
    };
    at("slope").or_else(|| at("mean"))
}

fn main() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("criterion-keyed");
    let mut c = Criterion::default()
        .output_directory(&dir)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .configure_from_args();
    bench(&mut c);
    c.final_summary();
    println!(
        "\n{:<28} {:>10} {:>10} {:>16}",
        "row", "sluice", "governor", "sluice/governor"
    );
    for group in GROUPS {
        if let (Some(s), Some(g)) = (
            estimate(&dir, group, "sluice"),
            estimate(&dir, group, "governor"),
        ) {
            println!("{group:<28} {s:>8.1}ns {g:>8.1}ns {:>15.2}x", s / g);
        }
    }
}
