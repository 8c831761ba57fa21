//! Shared helpers for the lane tests (all on tokio's paused clock).

#![allow(dead_code, unreachable_pub)]

use std::time::Duration;

use sluice_lanes::{Lane, LaneConfig, LanePermit, LaneRefusal};
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// How long a REST call waits in line.
pub const REST: Duration = Duration::from_secs(15);
/// How long a JSON-RPC tool call waits in line.
pub const JSONRPC: Duration = Duration::from_secs(120);

/// A lane with the default numbers.
pub fn lane() -> Lane {
    Lane::new("optimizer", LaneConfig::default()).expect("default config")
}

/// Lets every task that can run, run (time does not move).
pub async fn settle() {
    for _ in 0..20 {
        tokio::task::yield_now().await;
    }
}

/// Takes a place that must be free now.
pub async fn take(lane: &Lane, workspace: &str) -> LanePermit {
    let asked = Instant::now();
    let permit = lane
        .acquire(workspace, REST)
        .await
        .unwrap_or_else(|r| panic!("{workspace}: expected a place, got {r}"));
    assert_eq!(asked.elapsed(), Duration::ZERO, "{workspace} had to wait");
    permit
}

/// Takes `n` places of `workspace` at once.
pub async fn take_n(lane: &Lane, workspace: &str, n: usize) -> Vec<LanePermit> {
    let mut permits = Vec::with_capacity(n);
    for _ in 0..n {
        permits.push(take(lane, workspace).await);
    }
    permits
}

/// A call waiting in the background; yields what it got and how long it waited.
pub fn spawn_wait(
    lane: &Lane,
    workspace: &str,
    max_wait: Duration,
) -> JoinHandle<(Result<LanePermit, LaneRefusal>, Duration)> {
    let lane = lane.clone();
    let workspace = workspace.to_owned();
    tokio::spawn(async move {
        let asked = Instant::now();
        let got = lane.acquire(&workspace, max_wait).await;
        (got, asked.elapsed())
    })
}

/// Running calls of `workspace` by the lane's own count.
pub fn running(lane: &Lane, workspace: &str) -> u32 {
    lane.snapshot()
        .workspaces
        .iter()
        .find(|w| w.workspace == workspace)
        .map_or(0, |w| w.running)
}

/// Waiting calls of `workspace` by the lane's own count.
pub fn waiting(lane: &Lane, workspace: &str) -> u32 {
    lane.snapshot()
        .workspaces
        .iter()
        .find(|w| w.workspace == workspace)
        .map_or(0, |w| w.waiting)
}
