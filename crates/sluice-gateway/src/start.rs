//! What [`Gateway::start`](crate::Gateway::start) builds and starts, beside it: the
//! shared lanes' ledgers and the stale-cell reclaim.

use std::time::Duration;

use sluice_edge::SharedLimiter;
use sluice_policy::Policy;

use crate::store::AnyStore;
use crate::{StartError, Stop};

/// How often stale budget cells are dropped from the memory store (they are also
/// dropped whenever a shard needs room).
const RECLAIM_EVERY: Duration = Duration::from_secs(30);

/// Drops budget cells whose window is over, until the stop signal.
pub(super) async fn reclaim_stale_cells(limiter: SharedLimiter<AnyStore>, stop: Stop) {
    let mut tick = tokio::time::interval(RECLAIM_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let stopped = stop.wait();
    tokio::pin!(stopped);
    loop {
        tokio::select! {
            _ = tick.tick() => {
                let limiter = limiter.load();
                limiter.store().reclaim();
                limiter.fallback().reclaim();
            }
            () = &mut stopped => return,
        }
    }
}

/// The policy's lanes on a lease ledger in the Redis at `url`, shared by every
/// replica on it: their limits hold across all of them (see
/// [`sluice_lanes::Lane::with_ledger`]). A lease lives `lease_ttl_seconds` without
/// renewal, and one call to Redis waits at most the store's timeout; while Redis
/// cannot be asked, each lane follows [`sluice_edge::ledger_outage`]. On a Redis
/// Cluster (`redis+cluster://`) each lane's keys live on one node (one hash tag per
/// lane), so a lane's limits hold there too.
///
/// # Errors
/// [`StartError::Lanes`] names the lane whose ledger cannot be set up.
pub(super) async fn shared_lanes(
    policy: &Policy,
    url: &str,
) -> Result<Vec<sluice_lanes::Lane>, StartError> {
    let mut lanes = Vec::with_capacity(policy.lanes.len());
    for (i, rule) in policy.lanes.iter().enumerate() {
        let failed = |reason: String| StartError::Lanes {
            lane: rule.name.clone(),
            reason,
        };
        let limits = sluice_edge::lane_config(rule);
        let mut ledger = sluice_lanes::RedisLedgerConfig::new(url);
        ledger.lease_ttl = rule.lease_ttl;
        ledger.timeout = policy.store.timeout;
        let ledger = sluice_lanes::RedisLedger::connect(ledger, &rule.name, limits.clone())
            .await
            .map_err(|e| failed(format!("connecting its lease ledger: {e}")))?;
        let lane = sluice_lanes::Lane::with_ledger(
            rule.name.as_str(),
            limits,
            ledger,
            sluice_edge::ledger_outage(policy, i),
        )
        .map_err(|e| failed(e.to_string()))?;
        lanes.push(lane);
    }
    Ok(lanes)
}
