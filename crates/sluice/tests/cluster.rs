//! Budgets on a real 3-master Redis Cluster on loopback (created by the test
//! with `redis-cli --cluster create`): one script per slot at once, refunds
//! when any slot refuses (SPEC D1, D2).

#[path = "../../../tests/support/edit.rs"]
mod edit;
use edit::Edit as _;

mod support;

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
    std::fs::write(&policy, yaml).expect("write policy");
    let policy = policy.to_str().expect("utf-8 path").to_owned();
    let url = cluster.url();
    let replicas: Vec<Sluice> = (0..3)
        .map(|_| Sluice::spawn(&["--config", &policy, "--store", &url]))
        .collect();
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
