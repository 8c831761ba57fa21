//! The lease ledger against a real `redis-server` (one per test, on a Unix
//! socket in a temporary directory). Two ledgers on one server stand for two
//! replicas. Leases here live on Redis's real clock, so the TTL tests wait a
//! few hundred real milliseconds; the crash test runs two lanes on two
//! runtimes and shuts one down, as a killed replica stops.
#![cfg(feature = "redis")]

use std::time::Duration;

use sluice_lanes::{
    Lane, LaneConfig, Lease, LeaseKind, Ledger, LedgerOutage, RedisLedger, RedisLedgerConfig,
    RefusalReason, Taken,
};

use crate::redis_server;

use redis_server::{RedisCluster, RedisServer};

async fn replica(server: &RedisServer, ttl: Duration) -> RedisLedger {
    let mut config = RedisLedgerConfig::new(server.url());
    config.lease_ttl = ttl;
    config.timeout = Duration::from_millis(500);
    RedisLedger::connect(config, "optimizer", LaneConfig::default())
        .await
        .expect("connect")
}

async fn lease(ledger: &RedisLedger, workspace: &str, kind: LeaseKind) -> Lease {
    match ledger
        .take(workspace, LaneConfig::default().workspace_limits(), kind)
        .await
        .expect("ledger")
    {
        Taken::Leased(lease) => lease,
        refused => panic!("{workspace}: expected a lease, got {refused:?}"),
    }
}

async fn refused(
    ledger: &RedisLedger,
    workspace: &str,
    kind: LeaseKind,
) -> (RefusalReason, Option<Duration>) {
    match ledger
        .take(workspace, LaneConfig::default().workspace_limits(), kind)
        .await
        .expect("ledger")
    {
        Taken::Refused {
            reason,
            retry_after,
            ..
        } => (reason, retry_after),
        Taken::Leased(l) => panic!("{workspace}: expected a refusal, got {l:?}"),
    }
}

const LONG: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l1_workspace_and_global_limits_hold_across_replicas() {
    let server = RedisServer::start("lanes");
    let (a, b) = (replica(&server, LONG).await, replica(&server, LONG).await);
    let first = lease(&a, "acme", LeaseKind::Single).await;
    let _second = lease(&a, "acme", LeaseKind::Single).await;
    let _third = lease(&b, "acme", LeaseKind::Single).await;
    assert_eq!(
        refused(&b, "acme", LeaseKind::Single).await,
        (RefusalReason::WorkspaceInFlightLimit, None),
        "3 running across both replicas"
    );
    a.release(&first).await.expect("release");
    a.release(&first)
        .await
        .expect("a second release changes nothing");
    let _fourth = lease(&b, "acme", LeaseKind::Single).await;
    assert_eq!(b.counts("acme").await.expect("counts").workspace_running, 3);

    // The global cap of 20 across replicas: 17 more from other workspaces.
    for i in 0..17 {
        let r = if i % 2 == 0 { &a } else { &b };
        lease(r, &format!("w{}", i / 3), LeaseKind::Single).await;
    }
    let c = a.counts("other").await.expect("counts");
    assert_eq!(c.global, 20);
    assert_eq!(
        refused(&a, "other", LeaseKind::Single).await.0,
        RefusalReason::Busy
    );
    assert_eq!(
        refused(&b, "other", LeaseKind::Batch).await.0,
        RefusalReason::Busy
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l1_the_start_limit_holds_across_replicas_with_an_exact_retry_after() {
    let server = RedisServer::start("lanes");
    let (a, b) = (replica(&server, LONG).await, replica(&server, LONG).await);
    for i in 0..12 {
        let r = if i % 2 == 0 { &a } else { &b };
        let l = lease(r, "acme", LeaseKind::Single).await;
        r.release(&l).await.expect("release");
    }
    let (reason, retry) = refused(&a, "acme", LeaseKind::Single).await;
    assert_eq!(reason, RefusalReason::WorkspaceRateLimit);
    let retry = retry.expect("exact");
    assert!(
        retry <= Duration::from_secs(60) && retry > Duration::from_secs(55),
        "the first start leaves the 60 s window in {retry:?}"
    );
    assert_eq!(b.counts("acme").await.expect("counts").workspace_starts, 12);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l4_batch_items_stay_within_cap_minus_reserve_across_replicas() {
    let server = RedisServer::start("lanes");
    let (a, b) = (replica(&server, LONG).await, replica(&server, LONG).await);
    for i in 0..15 {
        let r = if i % 2 == 0 { &a } else { &b };
        lease(r, "bulk", LeaseKind::Batch).await;
    }
    assert_eq!(
        refused(&a, "bulk", LeaseKind::Batch).await.0,
        RefusalReason::Busy
    );
    // Batch items spend neither the workspace's places nor its starts.
    for _ in 0..3 {
        lease(&b, "bulk", LeaseKind::Single).await;
    }
    let c = a.counts("bulk").await.expect("counts");
    assert_eq!(
        (c.global, c.batch, c.workspace_running, c.workspace_starts),
        (18, 15, 3, 3)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l1_a_crashed_replicas_places_come_back_within_the_lease_ttl() {
    let server = RedisServer::start("lanes");
    let ttl = Duration::from_millis(400);
    let survivor = replica(&server, ttl).await;
    {
        let crashed = replica(&server, ttl).await;
        for _ in 0..3 {
            lease(&crashed, "acme", LeaseKind::Single).await;
        }
        // It dies without releasing anything.
    }
    assert_eq!(
        refused(&survivor, "acme", LeaseKind::Single).await.0,
        RefusalReason::WorkspaceInFlightLimit
    );
    tokio::time::sleep(ttl + Duration::from_millis(100)).await;
    assert_eq!(
        survivor
            .counts("acme")
            .await
            .expect("counts")
            .workspace_running,
        0
    );
    lease(&survivor, "acme", LeaseKind::Single).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l1_a_renewed_lease_outlives_its_ttl_and_an_expired_one_says_so() {
    let server = RedisServer::start("lanes");
    let ttl = Duration::from_millis(300);
    let (a, b) = (replica(&server, ttl).await, replica(&server, ttl).await);
    let held: Vec<Lease> = [
        lease(&a, "acme", LeaseKind::Single).await,
        lease(&a, "acme", LeaseKind::Single).await,
        lease(&a, "acme", LeaseKind::Single).await,
    ]
    .into();
    for _ in 0..6 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        for l in &held {
            assert!(a.renew(l).await.expect("renew"), "still held");
        }
    }
    assert_eq!(
        refused(&b, "acme", LeaseKind::Single).await.0,
        RefusalReason::WorkspaceInFlightLimit,
        "600 ms after taking, renewed leases still hold"
    );
    tokio::time::sleep(ttl + Duration::from_millis(100)).await;
    assert!(
        !a.renew(&held[0]).await.expect("renew"),
        "expired: the place is gone"
    );
}

/// A lane on a Redis ledger, built on `rt` (whose tasks renew its leases).
fn shared_lane(rt: &tokio::runtime::Runtime, server: &RedisServer, ttl: Duration) -> Lane {
    rt.block_on(async {
        let ledger = replica(server, ttl).await;
        Lane::with_ledger(
            "optimizer",
            LaneConfig::default(),
            ledger,
            LedgerOutage::FailClosed,
        )
        .expect("config")
    })
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime")
}

#[test]
fn l1_a_lane_renews_its_leases_and_a_crashed_replicas_places_come_back_within_the_ttl() {
    let server = RedisServer::start("lanes");
    let ttl = Duration::from_millis(500);
    let (survivor_rt, crashed_rt) = (runtime(), runtime());
    let survivor = shared_lane(&survivor_rt, &server, ttl);
    let crashed = shared_lane(&crashed_rt, &server, ttl);
    let wait = Duration::from_secs(15);
    let permits = crashed_rt.block_on(async {
        let mut held = Vec::new();
        for _ in 0..3 {
            held.push(crashed.acquire("acme", wait).await.expect("a place"));
        }
        held
    });
    let probe = survivor_rt.block_on(async {
        // Three lease lifetimes on, the calls still hold their places: the
        // crashed-to-be replica's task renews them.
        tokio::time::sleep(3 * ttl).await;
        let ledger = replica(&server, ttl).await;
        let held = ledger
            .counts("acme")
            .await
            .expect("counts")
            .workspace_running;
        let refused = survivor
            .acquire("acme", Duration::ZERO)
            .await
            .expect_err("3 running on the other replica");
        (held, refused.reason, ledger)
    });
    assert_eq!(
        (probe.0, probe.1),
        (3, RefusalReason::WorkspaceInFlightLimit)
    );
    // The replica dies: its tasks stop, nothing is released.
    crashed_rt.shutdown_background();
    let crashed_at = std::time::Instant::now();
    let back = survivor_rt.block_on(async {
        let permit = survivor
            .acquire("acme", 4 * ttl)
            .await
            .expect("the crashed replica's place came back");
        let took = crashed_at.elapsed();
        drop(permit);
        took
    });
    let bound = ttl + survivor.config().lease_retry + Duration::from_millis(250);
    assert!(
        back <= bound,
        "a place came back {back:?} after the crash (TTL {ttl:?})"
    );
    drop(permits);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l1_a_cancelled_lease_gives_its_start_back_a_released_one_does_not() {
    let server = RedisServer::start("lanes");
    let ledger = replica(&server, LONG).await;
    let sent = lease(&ledger, "acme", LeaseKind::Single).await;
    let unsent = lease(&ledger, "acme", LeaseKind::Single).await;
    ledger.release(&sent).await.expect("release");
    ledger.cancel(&unsent).await.expect("cancel");
    ledger
        .cancel(&sent)
        .await
        .expect("cancelling a released lease");
    let c = ledger.counts("acme").await.expect("counts");
    assert_eq!(
        (c.global, c.workspace_running, c.workspace_starts),
        (0, 0, 1),
        "only the call that was sent keeps its start"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l1_a_lane_ledger_on_a_redis_cluster_holds_its_limits_on_one_slot() {
    let cluster = RedisCluster::start();
    let connect = || async {
        let mut config = RedisLedgerConfig::new(cluster.url());
        config.timeout = Duration::from_secs(2);
        RedisLedger::connect(config, "optimizer", LaneConfig::default())
            .await
            .expect("connect to the cluster")
    };
    let (a, b) = (connect().await, connect().await);
    let first = lease(&a, "acme", LeaseKind::Single).await;
    lease(&b, "acme", LeaseKind::Single).await;
    lease(&a, "acme", LeaseKind::Single).await;
    assert_eq!(
        refused(&b, "acme", LeaseKind::Single).await.0,
        RefusalReason::WorkspaceInFlightLimit
    );
    a.cancel(&first).await.expect("cancel");
    let c = b.counts("acme").await.expect("counts");
    assert_eq!((c.workspace_running, c.workspace_starts), (2, 2));
}
