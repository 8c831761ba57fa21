//! The embedded durable store: quota counts that survive a restart, decided
//! all or nothing with the memory budgets, one commit for many decisions.

#![cfg(feature = "durable")]

use std::num::NonZeroU32;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use sluice_core::{Budget, BudgetKey, FakeClock, Rate, Timestamp};
use sluice_store::durable::QuotaLog as _;
use sluice_store::{
    BudgetStore, DurableStore, JournalSync, LocalStore, MemoryConfig, MemoryStore, OpenError,
    QuotaBook, QuotaBookConfig, StoreError,
};

/// 2026-11-30T12:00:00Z: half a day before the month turns.
const T0: u64 = 1_796_040_000;
/// 2026-12-01T00:00:00Z.
const DECEMBER: u64 = 1_796_083_200;

struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "sluice-durable-{name}-{}-{}",
            std::process::id(),
            fastrand::u64(..)
        ));
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn quota(workspace: &str, limit: u32) -> Budget {
    Budget {
        key: BudgetKey::new("quota:messages", workspace.as_bytes()),
        rate: Rate::CalendarMonth,
        limit,
        cost: 1,
    }
}

fn class(caller: &str, limit: u32) -> Budget {
    Budget::per_window(
        BudgetKey::new("expensive", caller.as_bytes()),
        limit,
        NonZeroU32::new(60).expect("non-zero"),
    )
}

fn local(dir: &TempDir, clock: &FakeClock, config: QuotaBookConfig) -> LocalStore<FakeClock> {
    let durable = DurableStore::open(&dir.0).expect("open");
    let book = QuotaBook::open(&durable, config, clock.now_ts()).expect("book");
    LocalStore::new(
        MemoryStore::with_clock(MemoryConfig::default(), clock.clone()),
        Some(book),
    )
}

trait Now {
    fn now_ts(&self) -> Timestamp;
}

impl Now for FakeClock {
    fn now_ts(&self) -> Timestamp {
        sluice_core::Clock::now(self)
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

#[test]
fn q1_counts_survive_a_restart_on_the_same_data_dir() {
    let dir = TempDir::new("restart");
    let clock = FakeClock::new(Timestamp::from_secs(T0));
    let rt = runtime();
    {
        let store = local(&dir, &clock, QuotaBookConfig::default());
        for _ in 0..7 {
            let d = rt.block_on(store.decide(&[class("k", 100), quota("acme", 10)]));
            assert!(d.expect("decide").is_admitted());
        }
    }
    let store = local(&dir, &clock, QuotaBookConfig::default());
    let seen = rt
        .block_on(store.peek(&[quota("acme", 10).with_cost(0)]))
        .expect("peek");
    assert_eq!(
        seen.statuses()[0].remaining,
        3,
        "7 of 10 spent before the restart"
    );
    // Three more fit, the fourth is refused with Retry-After to the month's turn.
    for _ in 0..3 {
        assert!(
            rt.block_on(store.decide(&[quota("acme", 10)]))
                .expect("decide")
                .is_admitted()
        );
    }
    let refused = rt
        .block_on(store.decide(&[quota("acme", 10)]))
        .expect("decide");
    assert!(!refused.is_admitted());
    assert_eq!(refused.statuses()[0].reset, DECEMBER);
    assert_eq!(
        refused.retry_after(),
        Some(Duration::from_secs(DECEMBER - T0))
    );
}

#[test]
fn q1_usage_resets_when_the_calendar_month_turns() {
    let dir = TempDir::new("month");
    let clock = FakeClock::new(Timestamp::from_secs(T0));
    let rt = runtime();
    let store = local(&dir, &clock, QuotaBookConfig::default());
    for _ in 0..2 {
        assert!(
            rt.block_on(store.decide(&[quota("acme", 2)]))
                .expect("decide")
                .is_admitted()
        );
    }
    assert!(
        !rt.block_on(store.decide(&[quota("acme", 2)]))
            .expect("decide")
            .is_admitted()
    );
    clock.set(Timestamp::from_secs(DECEMBER - 1));
    let last = rt
        .block_on(store.decide(&[quota("acme", 2)]))
        .expect("decide");
    assert!(!last.is_admitted());
    assert_eq!(last.retry_after(), Some(Duration::from_secs(1)));
    clock.set(Timestamp::from_secs(DECEMBER));
    let fresh = rt
        .block_on(store.decide(&[quota("acme", 2)]))
        .expect("decide");
    assert!(fresh.is_admitted());
    assert_eq!(fresh.statuses()[0].remaining, 1);
    // The next reset is the first of January 2027.
    assert_eq!(fresh.statuses()[0].reset, 1_798_761_600);
}

#[test]
fn q1_a_refused_quota_spends_nothing_else_and_a_refused_call_spends_no_quota() {
    let dir = TempDir::new("all-or-nothing");
    let clock = FakeClock::new(Timestamp::from_secs(T0));
    let rt = runtime();
    let store = local(&dir, &clock, QuotaBookConfig::default());
    // Quota of 1: the second call is refused by it and spends no class unit.
    assert!(
        rt.block_on(store.decide(&[class("a", 5), quota("one", 1)]))
            .expect("d")
            .is_admitted()
    );
    let refused = rt
        .block_on(store.decide(&[class("a", 5), quota("one", 1)]))
        .expect("d");
    assert!(!refused.is_admitted());
    assert_eq!(refused.binding_index(), 1, "the quota refused");
    let class_left = rt
        .block_on(store.peek(&[class("a", 5).with_cost(0)]))
        .expect("p");
    assert_eq!(
        class_left.statuses()[0].remaining,
        4,
        "the refused call spent no class unit"
    );
    // A class budget of 1: the second call is refused by it and spends no quota.
    assert!(
        rt.block_on(store.decide(&[class("b", 1), quota("two", 10)]))
            .expect("d")
            .is_admitted()
    );
    let refused = rt
        .block_on(store.decide(&[class("b", 1), quota("two", 10)]))
        .expect("d");
    assert!(!refused.is_admitted());
    assert_eq!(refused.binding_index(), 0, "the class budget refused");
    let quota_left = rt
        .block_on(store.peek(&[quota("two", 10).with_cost(0)]))
        .expect("p");
    assert_eq!(
        quota_left.statuses()[0].remaining,
        9,
        "the refused call spent no quota"
    );
}

#[test]
fn q1_concurrent_decisions_share_commits() {
    let dir = TempDir::new("group");
    let clock = FakeClock::new(Timestamp::from_secs(T0));
    let rt = runtime();
    let store = Arc::new(local(&dir, &clock, QuotaBookConfig::default()));
    let admitted = rt.block_on(async {
        let tasks: Vec<_> = (0..400)
            .map(|i| {
                let store = Arc::clone(&store);
                tokio::spawn(async move {
                    let ws = format!("ws{}", i % 8);
                    store.decide(&[quota(&ws, 1_000)]).await
                })
            })
            .collect();
        let mut admitted = 0;
        for t in tasks {
            if t.await.expect("task").expect("decide").is_admitted() {
                admitted += 1;
            }
        }
        admitted
    });
    assert_eq!(admitted, 400);
    let commits = store.book().expect("book").commits();
    assert!(commits >= 1, "at least one commit");
    assert!(
        commits < 400,
        "{commits} commits for 400 decisions: concurrent decisions must share commits"
    );
}

#[test]
fn q1_a_full_book_refuses_new_workspaces_and_keeps_counting_known_ones() {
    let dir = TempDir::new("full");
    let clock = FakeClock::new(Timestamp::from_secs(T0));
    let rt = runtime();
    let store = local(&dir, &clock, QuotaBookConfig::with_max_cells(2));
    for ws in ["a", "b"] {
        assert!(
            rt.block_on(store.decide(&[quota(ws, 5)]))
                .expect("d")
                .is_admitted()
        );
    }
    let full = rt.block_on(store.decide(&[quota("c", 5)]));
    assert!(matches!(full, Err(StoreError::Unavailable(_))), "{full:?}");
    assert!(
        rt.block_on(store.decide(&[quota("a", 5)]))
            .expect("d")
            .is_admitted()
    );
    // Next month, last month's counts make room.
    clock.set(Timestamp::from_secs(DECEMBER + 60));
    assert!(
        rt.block_on(store.decide(&[quota("c", 5)]))
            .expect("d")
            .is_admitted()
    );
}

#[test]
fn q1_uncapped_counts_of_a_flood_of_new_workspaces_stay_within_their_bound() {
    // Uncapped families are counted only to show usage: a flood of new workspaces
    // on one is admitted, but past `max_uncapped_cells` counts in the book its
    // new counts are not kept, and capped counts of new workspaces still fit.
    let dir = TempDir::new("uncapped");
    let clock = FakeClock::new(Timestamp::from_secs(T0));
    let rt = runtime();
    let store = local(
        &dir,
        &clock,
        QuotaBookConfig::with_max_cells(10).with_max_uncapped_cells(4),
    );
    let uncapped = |ws: &str| Budget {
        key: BudgetKey::new("quota:evals", ws.as_bytes()),
        ..quota(ws, u32::MAX)
    };
    for i in 0..100 {
        let d = rt
            .block_on(store.decide(&[uncapped(&format!("flood-{i}"))]))
            .expect("decide");
        assert!(
            d.is_admitted(),
            "an uncapped call is never refused for room"
        );
    }
    let book = store.book().expect("book");
    assert_eq!(book.len(), 4);
    assert_eq!(book.untracked(), 96);
    // A workspace already counted keeps counting.
    let d = rt
        .block_on(store.decide(&[uncapped("flood-0")]))
        .expect("decide");
    assert!(d.is_admitted());
    assert_eq!(book.untracked(), 96);
    // Capped counts of new workspaces have the rest of the book.
    for ws in ["a", "b", "c", "d", "e", "f"] {
        let d = rt.block_on(store.decide(&[quota(ws, 5)])).expect("decide");
        assert!(d.is_admitted(), "{ws}");
    }
    assert_eq!(book.len(), 10);
    let usage = rt
        .block_on(store.peek(&[uncapped("flood-0").with_cost(0)]))
        .expect("peek");
    assert_eq!(usage.statuses()[0].remaining, u32::MAX - 2);
}

#[test]
fn a_second_opener_of_one_data_dir_is_told_the_path() {
    let dir = TempDir::new("locked");
    let first = DurableStore::open(&dir.0).expect("open");
    match DurableStore::open(&dir.0) {
        Err(e @ OpenError::Locked { .. }) => {
            assert!(e.to_string().contains(&*dir.0.to_string_lossy()), "{e}");
        }
        other => panic!("expected Locked, got {other:?}"),
    }
    drop(first);
}

#[test]
fn a_corrupt_file_or_a_data_dir_that_is_a_file_is_an_error_naming_the_path() {
    let dir = TempDir::new("corrupt");
    std::fs::create_dir_all(&dir.0).expect("mkdir");
    let file = dir.0.join(sluice_store::durable::DURABLE_FILE);
    std::fs::write(&file, vec![0x5a; 64 * 1024]).expect("write");
    let e = DurableStore::open(&dir.0).expect_err("corrupt");
    assert!(matches!(e, OpenError::Unusable { .. }), "{e:?}");
    assert!(e.to_string().contains(&*file.to_string_lossy()), "{e}");

    let not_dir = dir.0.join("plain-file");
    std::fs::write(&not_dir, b"x").expect("write");
    let e = DurableStore::open(&not_dir).expect_err("a file");
    assert!(matches!(e, OpenError::Directory { .. }), "{e:?}");
    assert!(e.to_string().contains("plain-file"), "{e}");
}

#[test]
fn q1_a_full_disk_fails_quota_decisions_closed_and_recovers_by_itself() {
    let clock = FakeClock::new(Timestamp::from_secs(T0));
    let rt = runtime();
    let (disk, full) = sluice_store::durable::FillableDisk::new();
    let full = &full;
    let durable =
        DurableStore::with_backend("rehearsal.redb", disk.clone(), disk.log()).expect("open");
    let book = QuotaBook::open(&durable, QuotaBookConfig::default(), clock.now_ts()).expect("book");
    let store = LocalStore::new(
        MemoryStore::with_clock(MemoryConfig::default(), clock.clone()),
        Some(book),
    );
    assert!(
        rt.block_on(store.decide(&[class("k", 100), quota("acme", 10)]))
            .expect("d")
            .is_admitted()
    );
    full.store(true, std::sync::atomic::Ordering::SeqCst);
    // A call whose count cannot be made durable is not admitted.
    let failed = rt.block_on(store.decide(&[class("k", 100), quota("acme", 10)]));
    match failed {
        Err(StoreError::Unavailable(why)) => {
            assert!(why.contains("durable"), "{why}");
            assert!(
                !why.contains("rehearsal.redb"),
                "no path for clients: {why}"
            );
        }
        other => panic!("expected the store to be unavailable, got {other:?}"),
    }
    // Budgets without a quota keep working.
    assert!(
        rt.block_on(store.decide(&[class("k", 100)]))
            .expect("d")
            .is_admitted()
    );
    // Room again: the writer retries by itself and quota calls are admitted again.
    full.store(false, std::sync::atomic::Ordering::SeqCst);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let recovered = loop {
        match rt.block_on(store.decide(&[quota("acme", 10)])) {
            Ok(d) => break d,
            Err(_) if std::time::Instant::now() < deadline => {}
            Err(e) => panic!("no recovery within 10 s: {e}"),
        }
    };
    assert!(recovered.is_admitted());
    // What failed may have been counted (never less than what was admitted).
    let usage = 10 - recovered.statuses()[0].remaining;
    assert!((2..=3).contains(&usage), "usage {usage}");
}

#[test]
fn q1_a_crash_replays_the_journal_past_the_last_snapshot() {
    let clock = FakeClock::new(Timestamp::from_secs(T0));
    let rt = runtime();
    let (disk, _full) = sluice_store::durable::FillableDisk::new();
    let open = || {
        let durable =
            DurableStore::with_backend("crash.redb", disk.clone(), disk.log()).expect("open");
        let book =
            QuotaBook::open(&durable, QuotaBookConfig::default(), clock.now_ts()).expect("book");
        LocalStore::new(
            MemoryStore::with_clock(MemoryConfig::default(), clock.clone()),
            Some(book),
        )
    };
    let spend = |store: &LocalStore<FakeClock>, n: usize| {
        for _ in 0..n {
            let d = rt.block_on(store.decide(&[quota("acme", 100)]));
            assert!(d.expect("decide").is_admitted());
        }
    };
    let usage = |store: &LocalStore<FakeClock>| {
        let d = rt.block_on(store.peek(&[quota("acme", 100).with_cost(0)]));
        100 - d.expect("peek").statuses()[0].remaining
    };
    // A clean stop writes a snapshot and empties the journal.
    let first = open();
    spend(&first, 5);
    drop(first);
    assert_eq!(
        disk.log().len(),
        0,
        "the journal starts over after a snapshot"
    );
    // A crash (no clean stop): only the journal holds the next counts.
    let second = open();
    spend(&second, 3);
    assert!(disk.log().len() > 0);
    std::mem::forget(second);
    let third = open();
    assert_eq!(usage(&third), 8, "the snapshot's 5 and the journal's 3");
    spend(&third, 1);
    std::mem::forget(third);
    let fourth = open();
    assert_eq!(usage(&fourth), 9);
}

#[test]
fn q1_a_replica_that_crashed_on_a_full_disk_starts_again_with_every_count() {
    let clock = FakeClock::new(Timestamp::from_secs(T0));
    let rt = runtime();
    // A real full disk: writing over what the file has works, growing it does not.
    let (disk, full) = sluice_store::durable::FillableDisk::growth_only();
    let open = || {
        let durable = DurableStore::with_backend("full.redb", disk.clone(), disk.log())
            .expect("a full disk does not stop a start");
        let book = QuotaBook::open(&durable, QuotaBookConfig::default(), clock.now_ts())
            .expect("a full disk does not stop the quota counts from loading");
        LocalStore::new(
            MemoryStore::with_clock(MemoryConfig::default(), clock.clone()),
            Some(book),
        )
    };
    let usage = |store: &LocalStore<FakeClock>| {
        let d = rt.block_on(store.peek(&[quota("acme", 100).with_cost(0)]));
        100 - d.expect("peek").statuses()[0].remaining
    };
    let first = open();
    for _ in 0..7 {
        let d = rt.block_on(first.decide(&[quota("acme", 100)]));
        assert!(d.expect("decide").is_admitted());
    }
    // Killed (no clean stop: the journal holds the 7), then the disk fills.
    std::mem::forget(first);
    full.store(true, std::sync::atomic::Ordering::SeqCst);
    let second = open();
    assert_eq!(usage(&second), 7, "every count, from the journal");
    // While full: quota calls fail closed, everything else is served.
    assert!(rt.block_on(second.decide(&[quota("acme", 100)])).is_err());
    assert!(
        rt.block_on(second.decide(&[class("k", 100)]))
            .expect("decide")
            .is_admitted()
    );
    // Room again: quota calls are admitted again, and nothing was lost.
    full.store(false, std::sync::atomic::Ordering::SeqCst);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let recovered = loop {
        match rt.block_on(second.decide(&[quota("acme", 100)])) {
            Ok(d) => break d,
            Err(_) if std::time::Instant::now() < deadline => {}
            Err(e) => panic!("no recovery within 10 s: {e}"),
        }
    };
    assert!(recovered.is_admitted());
    let after = 100 - recovered.statuses()[0].remaining;
    assert!(
        (8..=9).contains(&after),
        "7 before, the failed call at most, this one: {after}"
    );
    drop(second);
    let third = open();
    assert_eq!(usage(&third), after, "a clean stop keeps them all");
}

/// SPEC T6: a count kept until a date ([`Rate::until`], an LLM gateway's usage of
/// one month) lives in the book with the quotas: it survives a restart, does not
/// reset when the month turns, and is dropped once its date is past.
#[test]
fn t6_counts_kept_until_a_date_survive_a_restart_and_go_after_it() {
    let dir = TempDir::new("until");
    let clock = FakeClock::new(Timestamp::from_secs(T0));
    let rt = runtime();
    let end = DECEMBER + 365 * 86_400;
    let kept = |cost| Budget {
        key: BudgetKey::new("llm-usage:test", b"acme"),
        rate: Rate::until(end),
        limit: u32::MAX,
        cost,
    };
    {
        let store = local(&dir, &clock, QuotaBookConfig::default());
        assert!(
            rt.block_on(store.decide(&[kept(7), class("k", 100)]))
                .expect("decide")
                .is_admitted()
        );
        assert_eq!(store.book().map(QuotaBook::len), Some(1), "in the book");
    }
    // Restarted after the month turned: the count is still there, whole.
    clock.advance(Duration::from_secs(DECEMBER - T0 + 40 * 86_400));
    let store = local(&dir, &clock, QuotaBookConfig::default());
    let seen = rt.block_on(store.peek(&[kept(0)])).expect("peek");
    assert_eq!(u32::MAX - seen.statuses()[0].remaining, 7);
    drop(store);
    // Restarted after its date: dropped from the book, reads as nothing.
    clock.advance(Duration::from_secs(end - DECEMBER));
    let store = local(&dir, &clock, QuotaBookConfig::default());
    assert_eq!(store.book().map(QuotaBook::len), Some(0), "dropped");
    let seen = rt.block_on(store.peek(&[kept(0)])).expect("peek");
    assert_eq!(seen.statuses()[0].remaining, u32::MAX);
}

/// SPEC T3, T6: a settlement's monthly changes (an LLM call's usage counts and
/// money) are one commit, not one a count, and each survives a restart.
#[test]
fn t3_a_settlements_monthly_changes_are_one_commit_and_survive_a_restart() {
    let dir = TempDir::new("settle");
    let clock = FakeClock::new(Timestamp::from_secs(T0));
    let rt = runtime();
    let (input, output) = (
        quota("usage:input", u32::MAX),
        quota("usage:output", u32::MAX),
    );
    {
        // Written to the operating system as the gateway's journal is: each commit
        // is appended by the call that makes it, so the count is exact.
        let durable = DurableStore::open_with(&dir.0, JournalSync::Write).expect("open");
        let book =
            QuotaBook::open(&durable, QuotaBookConfig::default(), clock.now_ts()).expect("book");
        let store = LocalStore::new(
            MemoryStore::with_clock(MemoryConfig::default(), clock.clone()),
            Some(book),
        );
        let before = store.book().expect("book").commits();
        let changes = [(input, 120), (class("k", 100), 3), (output, 45)];
        let statuses = rt
            .block_on(store.adjust_all_from(&changes, clock.now_ts(), 0))
            .expect("adjusted");
        assert_eq!(statuses.len(), 3, "one status a change, in order");
        assert_eq!(statuses[1].limit, 100, "the window's status in its place");
        assert_eq!(
            store.book().expect("book").commits() - before,
            1,
            "both monthly changes in one commit"
        );
    }
    let store = local(&dir, &clock, QuotaBookConfig::default());
    let seen = rt
        .block_on(store.peek(&[input.with_cost(0), output.with_cost(0)]))
        .expect("peek");
    assert_eq!(seen.statuses()[0].remaining, u32::MAX - 120);
    assert_eq!(seen.statuses()[1].remaining, u32::MAX - 45);
}

/// SPEC T3, Q1: settlements from several threads at once, each appending its
/// own changes or leaving them to the thread holding the journal, and the
/// writer thread taking over while the disk is full for a while, leave the
/// journal with each count's last value last: after a crash (no clean stop, no
/// snapshot) every count replays to the exact sum, those of the settlements
/// refused while the disk was full included (kept in memory, written after).
#[test]
fn t3_concurrent_settlements_replay_to_the_exact_sums_after_a_crash() {
    const THREADS: u32 = 4;
    const CALLS: u32 = 400;
    let clock = FakeClock::new(Timestamp::from_secs(T0));
    let (disk, full) = sluice_store::durable::FillableDisk::new();
    let open = || {
        let durable =
            DurableStore::with_backend("concurrent.redb", disk.clone(), disk.log_written_through())
                .expect("open");
        let book =
            QuotaBook::open(&durable, QuotaBookConfig::default(), clock.now_ts()).expect("book");
        LocalStore::new(
            MemoryStore::with_clock(MemoryConfig::default(), clock.clone()),
            Some(book),
        )
    };
    let (input, output) = (
        quota("usage:input", u32::MAX),
        quota("usage:output", u32::MAX),
    );
    let store = std::sync::Arc::new(open());
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let (store, clock, full) = (
                std::sync::Arc::clone(&store),
                clock.clone(),
                std::sync::Arc::clone(&full),
            );
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("runtime");
                let mut refused = 0;
                for i in 0..CALLS {
                    if t == 0 && i == CALLS / 4 {
                        full.store(true, std::sync::atomic::Ordering::SeqCst);
                    }
                    if t == 0 && i == CALLS / 4 + 5 {
                        full.store(false, std::sync::atomic::Ordering::SeqCst);
                    }
                    let changes = [(input, 3), (output, i64::from(t + 1))];
                    if rt
                        .block_on(store.adjust_all_from(&changes, clock.now_ts(), 0))
                        .is_err()
                    {
                        refused += 1;
                    }
                }
                refused
            })
        })
        .collect();
    let refused: u32 = threads
        .into_iter()
        .map(|t| t.join().expect("a settling thread"))
        .sum();
    let rt = runtime();
    // One settlement after the disk has room again: durable only once all the
    // counts before it are.
    let last = [(input, 0), (output, 0)];
    rt.block_on(store.adjust_all_from(&last, clock.now_ts(), 0))
        .expect("settled with room");
    let sums = |store: &LocalStore<FakeClock>| {
        let seen = rt
            .block_on(store.peek(&[input.with_cost(0), output.with_cost(0)]))
            .expect("peek");
        (
            u32::MAX - seen.statuses()[0].remaining,
            u32::MAX - seen.statuses()[1].remaining,
        )
    };
    let want = (3 * THREADS * CALLS, CALLS * (1..=THREADS).sum::<u32>());
    assert_eq!(
        sums(&store),
        want,
        "in memory ({refused} refused while full)"
    );
    // A crash: the journal alone holds the counts.
    let Ok(store) = std::sync::Arc::try_unwrap(store) else {
        panic!("the threads are done with the store");
    };
    std::mem::forget(store);
    assert_eq!(sums(&open()), want, "replayed from the journal");
}

/// The files of `from` as a crash of the machine would leave them while the
/// process runs: copied into `to` (the journal is synced at each commit).
fn crash_copy(from: &TempDir, to: &TempDir) {
    std::fs::create_dir_all(&to.0).expect("dir");
    for entry in std::fs::read_dir(&from.0).expect("read dir") {
        let entry = entry.expect("entry");
        std::fs::copy(entry.path(), to.0.join(entry.file_name())).expect("copy");
    }
}

/// Two crashes of the machine: the first tears the first slot of the journal's
/// last group while records after it land (never confirmed: lost); the next run
/// writes over the start of the file; the second crash comes before a snapshot.
/// Replay takes the next run's counts, never the torn run's records left past
/// them (they would set the count back to an older value).
#[test]
fn q1_a_journal_torn_by_a_crash_never_replays_its_leftovers_over_later_counts() {
    let (dir, crashed, again) = (
        TempDir::new("torn"),
        TempDir::new("torn-1"),
        TempDir::new("torn-2"),
    );
    let clock = FakeClock::new(Timestamp::from_secs(T0));
    let rt = runtime();
    let spend = |store: &LocalStore<FakeClock>, n: usize| {
        for _ in 0..n {
            let d = rt.block_on(store.decide(&[quota("acme", 100)]));
            assert!(d.expect("decide").is_admitted());
        }
    };
    let usage = |store: &LocalStore<FakeClock>| {
        let d = rt.block_on(store.peek(&[quota("acme", 100).with_cost(0)]));
        100 - d.expect("peek").statuses()[0].remaining
    };
    // 5 in a snapshot (a clean stop), then 3 in the journal alone: the machine
    // crashes while they are there.
    let first = local(&dir, &clock, QuotaBookConfig::default());
    spend(&first, 5);
    drop(first);
    let second = local(&dir, &clock, QuotaBookConfig::default());
    spend(&second, 3);
    crash_copy(&dir, &crashed);
    drop(second);
    // The crash tore the journal's first slot; the two records after it landed.
    let journal = crashed.0.join(sluice_store::durable::JOURNAL_FILE);
    let mut bytes = std::fs::read(&journal).expect("journal");
    bytes[3] ^= 0x40;
    std::fs::write(&journal, &bytes).expect("tear");
    let third = local(&crashed, &clock, QuotaBookConfig::default());
    assert_eq!(usage(&third), 5, "the torn group was never confirmed");
    spend(&third, 1);
    // The machine crashes again before a snapshot.
    crash_copy(&crashed, &again);
    drop(third);
    let fourth = local(&again, &clock, QuotaBookConfig::default());
    assert_eq!(usage(&fourth), 6, "the snapshot's 5 and the next run's 1");
}
