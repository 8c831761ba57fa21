//! L1 and L4 as invariants: for any sequence of arrivals, finishes, drops,
//! cancelled waits and batch items, the lane never holds more than its
//! limits, its own counts always match the permits that exist, and
//! everything returns to zero — no place leaked, none released twice.

use crate::support;

use std::collections::HashMap;
use std::time::Duration;

use proptest::prelude::*;
use sluice_lanes::{BatchPermit, Lane, LaneConfig, LanePermit, LaneRefusal, Outcome};
use tokio::task::JoinHandle;

#[derive(Clone, Debug)]
enum Op {
    Acquire {
        ws: u8,
        wait_s: u8,
    },
    Batch {
        ws: u8,
    },
    Finish {
        idx: usize,
        ok: bool,
    },
    Drop {
        idx: usize,
    },
    Cancel {
        idx: usize,
    },
    /// A place is freed and handed to a waiter that is cancelled before it
    /// runs again (no settling in between).
    FinishThenCancel {
        idx: usize,
        cancel: usize,
    },
    Advance {
        ms: u32,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..8, prop_oneof![Just(0u8), Just(5), Just(15), Just(120)])
            .prop_map(|(ws, wait_s)| Op::Acquire { ws, wait_s }),
        2 => (0u8..8).prop_map(|ws| Op::Batch { ws }),
        3 => (any::<usize>(), prop::bool::weighted(0.8)).prop_map(|(idx, ok)| Op::Finish { idx, ok }),
        1 => any::<usize>().prop_map(|idx| Op::Drop { idx }),
        1 => any::<usize>().prop_map(|idx| Op::Cancel { idx }),
        2 => (any::<usize>(), any::<usize>()).prop_map(|(idx, cancel)| Op::FinishThenCancel { idx, cancel }),
        2 => (0u32..40_000).prop_map(|ms| Op::Advance { ms }),
    ]
}

enum Held {
    Single(LanePermit),
    Batch(BatchPermit),
}

impl Held {
    fn finish(self, outcome: Outcome) {
        match self {
            Held::Single(p) => p.finish(outcome),
            Held::Batch(p) => p.finish(outcome),
        }
    }
}

type Pending = JoinHandle<Result<LanePermit, LaneRefusal>>;

/// Moves every finished wait into `held`.
async fn collect(pending: &mut Vec<Pending>, held: &mut Vec<Held>) {
    let mut still = Vec::new();
    for task in pending.drain(..) {
        if task.is_finished() {
            if let Ok(Ok(permit)) = task.await {
                held.push(Held::Single(permit));
            }
        } else {
            still.push(task);
        }
    }
    *pending = still;
}

fn check(lane: &Lane, config: &LaneConfig, held: &[Held], pending: &[Pending]) {
    let snap = lane.snapshot();
    assert_eq!(
        snap.running as usize,
        held.len(),
        "the lane counts exactly the permits that exist"
    );
    assert_eq!(
        snap.waiting as usize,
        pending.len(),
        "and exactly the calls in line"
    );
    assert!(snap.running <= config.global_cap);
    assert!(snap.batch_running <= config.batch_cap());
    let mut singles: HashMap<&str, u32> = HashMap::new();
    for h in held {
        if let Held::Single(p) = h {
            *singles.entry(p.workspace()).or_default() += 1;
        }
    }
    for ws in &snap.workspaces {
        assert!(ws.running <= config.workspace_in_flight, "{ws:?}");
        assert!(ws.started_in_window <= config.workspace_starts, "{ws:?}");
        assert_eq!(
            ws.running,
            singles.get(ws.workspace.as_str()).copied().unwrap_or(0)
        );
    }
}

fn run(config: LaneConfig, ops: Vec<Op>) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("runtime");
    rt.block_on(async move {
        let lane = Lane::new("optimizer", config.clone()).expect("config");
        let mut held: Vec<Held> = Vec::new();
        let mut pending: Vec<Pending> = Vec::new();
        for op in ops {
            match op {
                Op::Acquire { ws, wait_s } => {
                    let lane = lane.clone();
                    pending.push(tokio::spawn(async move {
                        lane.acquire(&format!("w{ws}"), Duration::from_secs(wait_s.into()))
                            .await
                    }));
                }
                Op::Batch { ws } => {
                    if let Some(item) = lane.try_acquire_batch(&format!("w{ws}")) {
                        held.push(Held::Batch(item));
                    }
                }
                Op::Finish { idx, ok } if !held.is_empty() => {
                    let outcome = if ok {
                        Outcome::Success
                    } else {
                        Outcome::Failure
                    };
                    held.swap_remove(idx % held.len()).finish(outcome);
                }
                Op::Drop { idx } if !held.is_empty() => drop(held.swap_remove(idx % held.len())),
                Op::Cancel { idx } if !pending.is_empty() => {
                    let task = pending.swap_remove(idx % pending.len());
                    task.abort();
                    // A wait that already ended may hold a permit: drop it too.
                    if let Ok(Ok(permit)) = task.await {
                        drop(permit);
                    }
                }
                Op::FinishThenCancel { idx, cancel } if !held.is_empty() && !pending.is_empty() => {
                    held.swap_remove(idx % held.len()).finish(Outcome::Success);
                    let task = pending.swap_remove(cancel % pending.len());
                    task.abort();
                    if let Ok(Ok(permit)) = task.await {
                        drop(permit);
                    }
                }
                Op::Advance { ms } => {
                    tokio::time::advance(Duration::from_millis(ms.into())).await;
                }
                Op::Finish { .. }
                | Op::Drop { .. }
                | Op::Cancel { .. }
                | Op::FinishThenCancel { .. } => {}
            }
            support::settle().await;
            collect(&mut pending, &mut held).await;
            check(&lane, &config, &held, &pending);
        }
        for task in &pending {
            task.abort();
        }
        for task in pending.drain(..) {
            if let Ok(Ok(permit)) = task.await {
                drop(permit);
            }
        }
        drop(held);
        support::settle().await;
        let snap = lane.snapshot();
        assert_eq!((snap.running, snap.waiting, snap.batch_running), (0, 0, 0));
        assert!(
            snap.workspaces
                .iter()
                .all(|w| w.running == 0 && w.waiting == 0)
        );
    });
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn l1_l4_counts_never_exceed_limits_and_return_to_zero(ops in prop::collection::vec(op(), 1..80)) {
        run(LaneConfig::default(), ops);
    }

    #[test]
    fn l1_l4_the_same_under_a_small_contended_lane(ops in prop::collection::vec(op(), 1..80)) {
        let config = LaneConfig::default()
            .with_workspace_in_flight(2)
            .with_workspace_starts(4, Duration::from_secs(10))
            .with_global_cap(4)
            .with_batch_reserve(1)
            .with_max_waiting(6, 3);
        run(config, ops);
    }
}
