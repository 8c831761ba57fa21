//! Fairness of one lane's global cap, simulated on tokio's paused clock (so every
//! run prints the same numbers, in about a second).
//!
//! Workspaces keep a number of clients each (their demand); a client asks for a
//! place, holds it for one call time (varied a little by a fixed random stream),
//! and asks again at once; a refused client asks again a second later. The
//! workspace limits are lifted so that only the global cap (20) binds, and the run
//! lasts a simulated hour. Printed: completions per workspace, Jain's index over
//! them (1.0 = all equal), and, for unequal demand, the max-min fair share of each
//! workspace next to the share it got.
//!
//! `cargo bench -p sluice-lanes --bench fairness`

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use sluice_lanes::{Lane, LaneConfig, Outcome};

const CAP: u32 = 20;
const RUN: Duration = Duration::from_secs(3600);
const CALL: Duration = Duration::from_secs(90);

fn lane() -> Lane {
    let mut config = LaneConfig::default();
    config.global_cap = CAP;
    config.batch_reserve = 0;
    config.workspace_in_flight = CAP;
    config.workspace_starts = u32::MAX;
    config.max_waiting = 10_000;
    config.max_waiting_per_workspace = 10_000;
    Lane::new("fairness", config).expect("config")
}

/// A tiny deterministic generator (xorshift) for call times.
fn next(seed: &mut u64) -> u64 {
    *seed ^= *seed << 13;
    *seed ^= *seed >> 7;
    *seed ^= *seed << 17;
    *seed
}

async fn run(demands: &[u32]) -> Vec<u64> {
    let lane = lane();
    let done: Vec<Arc<AtomicU64>> = demands.iter().map(|_| Arc::default()).collect();
    let end = tokio::time::Instant::now() + RUN;
    let mut clients = Vec::new();
    for (w, &demand) in demands.iter().enumerate() {
        for c in 0..demand {
            let lane = lane.clone();
            let done = Arc::clone(&done[w]);
            let workspace = format!("ws{w}");
            let mut seed = 0x9E37_79B9_7F4A_7C15 ^ (((w as u64) << 32) | (u64::from(c) + 1));
            clients.push(tokio::spawn(async move {
                while tokio::time::Instant::now() < end {
                    match lane.acquire(&workspace, Duration::from_secs(15)).await {
                        Ok(permit) => {
                            // 60–120 s a call.
                            let took = CALL - Duration::from_secs(30)
                                + Duration::from_millis(next(&mut seed) % 60_000);
                            tokio::time::sleep(took).await;
                            permit.finish(Outcome::Success);
                            if tokio::time::Instant::now() <= end {
                                done.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                        Err(_) => tokio::time::sleep(Duration::from_secs(1)).await,
                    }
                }
            }));
        }
    }
    for client in clients {
        let _ = client.await;
    }
    done.iter().map(|d| d.load(Ordering::Relaxed)).collect()
}

fn jain(xs: &[f64]) -> f64 {
    let sum: f64 = xs.iter().sum();
    let squares: f64 = xs.iter().map(|x| x * x).sum();
    sum * sum / (xs.len() as f64 * squares)
}

/// Max-min fair shares of `cap` places among `demands`.
fn max_min(demands: &[u32], cap: u32) -> Vec<f64> {
    let mut share = vec![0.0; demands.len()];
    let mut left = f64::from(cap);
    let mut open: Vec<usize> = (0..demands.len()).collect();
    while !open.is_empty() {
        let even = left / open.len() as f64;
        let (small, big): (Vec<usize>, Vec<usize>) =
            open.iter().partition(|&&i| f64::from(demands[i]) <= even);
        if small.is_empty() {
            for &i in &big {
                share[i] = even;
            }
            break;
        }
        for &i in &small {
            share[i] = f64::from(demands[i]);
            left -= share[i];
        }
        open = big;
    }
    share
}

fn main() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("runtime");
    println!("fairness of one lane's global cap ({CAP} places), a simulated hour, calls 60–120 s");
    let equal = [8u32; 5];
    let done = runtime.block_on(run(&equal));
    let as_f: Vec<f64> = done.iter().map(|&d| d as f64).collect();
    println!(
        "equal demand {equal:?}: completions {done:?}, Jain's index {:.4} (goal >= 0.99)",
        jain(&as_f)
    );
    let unequal = [1u32, 2, 5, 10, 20];
    let done = runtime.block_on(run(&unequal));
    let total: u64 = done.iter().sum();
    let fair = max_min(&unequal, CAP);
    println!("unequal demand {unequal:?}: completions {done:?}");
    println!("  workspace  demand  max-min share  share got");
    for (i, &d) in unequal.iter().enumerate() {
        let got = done[i] as f64 / total as f64 * f64::from(CAP);
        println!("  ws{i}        {d:>6}  {:>13.2}  {got:>9.2}", fair[i]);
    }
    // Jain's index of got/fair: 1.0 when every workspace got its max-min share.
    let ratios: Vec<f64> = (0..unequal.len())
        .map(|i| done[i] as f64 / total as f64 * f64::from(CAP) / fair[i])
        .collect();
    println!(
        "  Jain's index of share got / max-min share: {:.4}",
        jain(&ratios)
    );
}
