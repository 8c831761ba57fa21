//! A tight loop of decisions, for profiling with `perf record`:
//! `hot_loop` decides one hot key; `hot_loop 4` a 4-budget request over
//! 100,000 subjects; `hot_loop 4 hot` a 4-budget request on the same subjects.
use std::num::NonZeroU32;

use sluice_core::{Budget, BudgetKey, Rate};
use sluice_store::{MemoryConfig, MemoryStore};

fn main() {
    let four = std::env::args().nth(1).is_some_and(|a| a == "4");
    let hot = std::env::args().nth(2).is_some();
    let store = MemoryStore::new(MemoryConfig::default());
    let minute = NonZeroU32::new(60).unwrap_or(NonZeroU32::MIN);
    let scopes: Vec<u64> = ["expensive", "ip", "route", "quota"]
        .iter()
        .map(|s| BudgetKey::new(s, b"").scope())
        .collect();
    let budget = |scope: usize, subject: u64| {
        Budget::per_window(
            BudgetKey::from_digests(scopes[scope], subject),
            u32::MAX,
            minute,
        )
    };
    let mut admitted = 0u64;
    for i in 0..20_000_000u64 {
        let d = if four {
            let i = if hot { 0 } else { i % 100_000 };
            let req = [
                budget(0, i),
                budget(1, i / 10),
                budget(2, i / 10),
                Budget {
                    rate: Rate::CalendarMonth,
                    ..budget(3, i / 100)
                },
            ];
            store.decide_now(&req)
        } else {
            store.decide_now(&[budget(0, 7)])
        };
        admitted += u64::from(d.is_ok_and(|d| d.is_admitted()));
    }
    println!("{admitted}");
}
