//! The in-memory lease ledger: the same rules as the shared one, on tokio's
//! paused clock (two clones stand for two replicas).

use std::time::Duration;

use sluice_lanes::{LaneConfig, LeaseKind, Ledger, MemoryLedger, RefusalReason, Taken};
use tokio::time::advance;

#[tokio::test(start_paused = true)]
async fn l1_memory_ledger_limits_starts_and_lease_expiry() {
    let a = MemoryLedger::new(LaneConfig::default(), Duration::from_secs(10));
    let b = a.clone();
    let mut held = Vec::new();
    for r in [&a, &b, &a] {
        match r
            .take(
                "acme",
                LaneConfig::default().workspace_limits(),
                LeaseKind::Single,
            )
            .await
            .expect("ledger")
        {
            Taken::Leased(l) => held.push(l),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(
        b.take(
            "acme",
            LaneConfig::default().workspace_limits(),
            LeaseKind::Single
        )
        .await
        .expect("ledger"),
        Taken::Refused {
            reason: RefusalReason::WorkspaceInFlightLimit,
            retry_after: None,
            may_free: false,
        }
    );
    // Renewed leases hold; the replica that stops renewing loses them.
    advance(Duration::from_secs(8)).await;
    assert!(a.renew(&held[0]).await.expect("renew"));
    advance(Duration::from_secs(3)).await;
    assert!(
        !a.renew(&held[1]).await.expect("renew"),
        "expired after 10 s"
    );
    let c = b.counts("acme").await.expect("counts");
    assert_eq!((c.workspace_running, c.workspace_starts), (1, 3));
    for _ in 0..9 {
        let Taken::Leased(l) = b
            .take(
                "acme",
                LaneConfig::default().workspace_limits(),
                LeaseKind::Single,
            )
            .await
            .expect("ledger")
        else {
            panic!("room for 9 more starts");
        };
        b.release(&l).await.expect("release");
    }
    assert_eq!(
        a.take(
            "acme",
            LaneConfig::default().workspace_limits(),
            LeaseKind::Single
        )
        .await
        .expect("ledger"),
        Taken::Refused {
            reason: RefusalReason::WorkspaceRateLimit,
            retry_after: Some(Duration::from_secs(49)),
            may_free: true,
        },
        "the first start (t = 0) leaves the window at 60 s; it is 11 s now"
    );
}
