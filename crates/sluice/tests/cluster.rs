//! Budgets on a real 3-master Redis Cluster on loopback (created by the test
//! with `redis-cli --cluster create`): one script per slot at once, refunds
//! when any slot refuses (SPEC D1, D2).

use crate::edit;
use edit::Edit as _;

use crate::support;

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use sluice_core::{Budget, BudgetKey};
use sluice_store::{BudgetStore, RedisConfig, RedisStore};
use support::redis::RedisCluster;
use support::{Sluice, send};

/// Three gateways on `cluster` with the policy `yaml`, written to `path`.
fn three_replicas(cluster: &RedisCluster, path: &std::path::Path, yaml: &str) -> Vec<Sluice> {
    std::fs::write(path, yaml).expect("write policy");
    let policy = path.to_str().expect("utf-8 path");
    let url = cluster.url();
    (0..3)
        .map(|_| Sluice::spawn(&["--config", policy, "--store", &url]))
        .collect()
}

fn budget(scope: &str, subject: &[u8], limit: u32) -> Budget {
    Budget::per_window(BudgetKey::new(scope, subject), limit, NonZeroU32::MAX)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d2_three_replicas_on_a_cluster_admit_exactly_the_limit_and_refusals_refund() {
    let cluster = RedisCluster::start();

    // Store level: a caller's budget and an IP ceiling live in two slots.
    let mut config = RedisConfig::new(cluster.url());
    config.timeout = Duration::from_secs(2);
    let store = Arc::new(
        RedisStore::connect(config)
            .await
            .expect("connect to the cluster"),
    );
    let other = budget("expensive", b"sk-other", 30);
    let full = budget("ip", b"198.51.100.60", 1);
    assert!(store.decide(&[full]).await.expect("decide").is_admitted());
    let d = store.decide(&[other, full]).await.expect("decide");
    assert!(!d.is_admitted());
    assert_eq!(d.binding().expect("binding").limit, 1);
    let p = store.peek(&[other]).await.expect("peek");
    assert_eq!(
        p.statuses()[0].remaining,
        30,
        "a request refused by its IP ceiling leaves the caller's budget as it was"
    );

    // Three gateways on the cluster: 200 concurrent calls, one key, budget 30.
    let dir = std::env::temp_dir().join(format!("sluice-cluster-policy-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let policy = dir.join("cluster.yaml");
    let yaml = sluice_policy::DEFAULT_POLICY_YAML
        .edit(
            "window_seconds: 60\nprofiles",
            "window_seconds: 4294967295\nprofiles",
        )
        .edit("expensive: fail_open }", "expensive: fail_closed }")
        .edit("timeout_ms: 20", "timeout_ms: 2000");
    let replicas = three_replicas(&cluster, &policy, &yaml);
    let tasks: Vec<_> = (0..200)
        .map(|i| {
            let url = replicas[i % 3].url("/chats");
            tokio::spawn(async move {
                send(
                    Request::post(url)
                        .header("x-api-key", "sk-cluster")
                        .body(Full::new(Bytes::from_static(b"{}")))
                        .expect("request"),
                )
                .await
                .status
                .as_u16()
            })
        })
        .collect();
    let mut admitted = 0;
    for t in tasks {
        let status = t.await.expect("task");
        assert!(status == 200 || status == 429, "{status}");
        admitted += usize::from(status == 200);
    }
    assert_eq!(
        admitted, 30,
        "exactly the limit across three replicas on a cluster"
    );
    // The IP ceiling's slot gave back what refused calls held: 300 - 30 admitted.
    let ceiling = Budget::per_window(
        BudgetKey::from_digests(
            sluice_core::digest(b"ceiling:ip"),
            sluice_policy::default_policy()
                .expect("policy")
                .identity
                .ip_subject("127.0.0.1".parse().expect("ip"))
                .subject,
        ),
        300,
        NonZeroU32::MAX,
    );
    let p = store.peek(&[ceiling]).await.expect("peek");
    assert_eq!(p.statuses()[0].remaining, 270);
}

/// SPEC D4 on a Redis Cluster: a lease is taken in the one call per slot a
/// decision makes (the caller's class and its IP ceiling, both leased, live in
/// two), leftovers ride back on the slot's next call, and a request
/// that another slot refuses gives back the whole lease it was granted (all
/// or nothing, as on one Redis); three replicas admit within `limit + 3 ×
/// lease`, deciding most requests from their leases.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d4_leases_on_a_cluster_are_all_or_nothing_and_within_the_bound() {
    let cluster = RedisCluster::start();
    let mut config = RedisConfig::new(cluster.url());
    config.timeout = Duration::from_secs(2);
    let store = RedisStore::connect(config)
        .await
        .expect("connect to the cluster");
    assert!(store.leases(), "a Cluster takes leases");

    // Two subjects, two slots: the caller's class leases 10, its IP ceiling
    // admits.
    let class = budget("read", b"sk-lease", 100);
    let ceiling = budget("ip", b"198.51.100.70", 1);
    let (d, grants) = store
        .take_leases(&[class, ceiling], &[10, 0], &[])
        .await
        .expect("take");
    assert!(d.is_admitted());
    assert_eq!(grants, vec![10, 1], "a lease of 10 and the ceiling's cost");
    let left = |d: sluice_core::Decision| d.statuses()[0].remaining;
    assert_eq!(left(store.peek(&[class]).await.expect("peek")), 90);

    // The ceiling is spent now: the class's slot grants a lease, the other
    // refuses, and the lease goes back whole.
    let (d, grants) = store
        .take_leases(&[class, ceiling], &[10, 0], &[])
        .await
        .expect("take");
    assert!(!d.is_admitted(), "the ceiling refuses");
    assert_eq!(grants, vec![0, 0]);
    assert_eq!(
        left(store.peek(&[class]).await.expect("peek")),
        90,
        "the refused request's lease is given back whole, not just its cost"
    );

    // Leftovers: 7 of the first lease go back riding on the class's next
    // call; another subject's leftover on a call of its own.
    let other = budget("read", b"sk-other-lease", 100);
    let (d, _) = store.take_leases(&[other], &[5], &[]).await.expect("take");
    assert!(d.is_admitted());
    let back = |units| sluice_core::GiveBack {
        units,
        reserved_at: d.decided_at(),
    };
    let (d, grants) = store
        .take_leases(&[class], &[1], &[(class, back(7)), (other, back(4))])
        .await
        .expect("take");
    assert!(d.is_admitted());
    assert_eq!(grants, vec![1]);
    assert_eq!(left(store.peek(&[class]).await.expect("peek")), 96);
    assert_eq!(left(store.peek(&[other]).await.expect("peek")), 99);

    // Three gateways leasing the read class on the cluster.
    let dir = std::env::temp_dir().join(format!("sluice-cluster-leased-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let policy = dir.join("leased.yaml");
    const LIMIT: usize = 120;
    const LEASE: usize = 10;
    let yaml = sluice_policy::DEFAULT_POLICY_YAML
        .edit(
            "window_seconds: 60\nprofiles",
            "window_seconds: 4294967295\nprofiles",
        )
        .edit("read: 300", &format!("read: {LIMIT}"))
        .edit("read: fail_open", "read: fail_closed")
        .edit("timeout_ms: 20", "timeout_ms: 2000")
        .edit("  replicas: 1", "  replicas: 3")
        .edit(
            "store:\n",
            &format!(
                "algorithms:\n  read: {{ consistency: leased, lease: {LEASE}, lease_ms: 1000 }}\n  \
                 ip: {{ consistency: leased, lease: {LEASE}, lease_ms: 1000 }}\nstore:\n"
            ),
        );
    let replicas = three_replicas(&cluster, &policy, &yaml);
    const REQUESTS: usize = 300;
    let tasks: Vec<_> = (0..6)
        .map(|w| {
            let urls: Vec<String> = replicas.iter().map(|r| r.url("/search/fields")).collect();
            tokio::spawn(async move {
                let mut admitted = 0;
                for i in 0..REQUESTS / 6 {
                    let status = send(
                        Request::get(&urls[(w + i) % 3])
                            .header("x-api-key", "sk-cluster-leased")
                            .body(Full::new(Bytes::new()))
                            .expect("request"),
                    )
                    .await
                    .status
                    .as_u16();
                    assert!(status == 200 || status == 429, "decided: {status}");
                    admitted += usize::from(status == 200);
                }
                admitted
            })
        })
        .collect();
    let mut admitted = 0;
    for t in tasks {
        admitted += t.await.expect("task");
    }
    // One window: leases lend only what the counter counted.
    assert!(admitted <= LIMIT, "{admitted} admitted, limit {LIMIT}");
    assert!(
        admitted >= LIMIT - 3 * LEASE,
        "{admitted} admitted: leases kept too much"
    );
    let mut taken = 0;
    let mut saved = 0;
    for r in &replicas {
        let status = support::get(&r.admin_url("/status")).await.json();
        let leases = &status["limiter"]["leases"];
        taken += leases["taken"].as_u64().expect("leases.taken");
        saved += leases["calls_saved"].as_u64().expect("leases.calls_saved");
    }
    assert!(taken >= 3, "each replica took leases: {taken}");
    assert!(
        saved as usize >= REQUESTS / 2,
        "{saved} of {REQUESTS} requests decided from leases alone"
    );
}
