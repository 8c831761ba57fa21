//! A flood of new keys through a trusted proxy (issue: hardening, item 4), over real
//! HTTP on loopback: once the memory store's key cap is full, new callers from the
//! networks the flood comes from share their network's budget (and are refused once
//! it is spent), while new callers from other networks still get 200.

use crate::support;

use std::sync::Arc;

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt as _, Full};
use support::Sluice;

/// The default policy, its window never rolling during a test (it started at the
/// Unix epoch and ends in 2106), the gateway's peer (loopback) a trusted proxy.
fn policy_file() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("sluice-flood-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("policy.yaml");
    let mut yaml = sluice_policy::DEFAULT_POLICY_YAML.to_owned();
    for (from, to) in [
        (
            "window_seconds: 60\nprofiles",
            "window_seconds: 4294967295\nprofiles",
        ),
        ("trusted_proxies: []", "trusted_proxies: [127.0.0.1]"),
    ] {
        assert!(
            yaml.contains(from),
            "the default policy no longer holds {from:?}"
        );
        yaml = yaml.replace(from, to);
    }
    std::fs::write(&path, yaml).expect("write policy");
    path
}

/// `GET /things` with `key` from `client` (through the trusted proxy): the status.
async fn get(
    http: &hyper_util::client::legacy::Client<
        hyper_util::client::legacy::connect::HttpConnector,
        Full<Bytes>,
    >,
    url: &str,
    key: &str,
    client: &str,
) -> u16 {
    let request = Request::get(url)
        .header("x-api-key", key)
        .header("x-forwarded-for", client)
        .body(Full::new(Bytes::new()))
        .expect("request");
    let response = http.request(request).await.expect("HTTP request");
    let status = response.status().as_u16();
    response.into_body().collect().await.expect("body");
    status
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e4_a_key_flood_through_a_trusted_proxy_leaves_other_networks_served() {
    let policy = policy_file();
    // A cap of 2,000 cells: each flood request holds one or two new ones (its key's
    // read budget, and its address's ceiling the first time), so the first ~1,300
    // requests fill it.
    let sluice = Sluice::spawn(&[
        "--config",
        policy.to_str().expect("utf-8 path"),
        "--max-keys",
        "2000",
    ]);
    let url = Arc::new(sluice.url("/things"));
    let http = support::client();
    tokio::time::timeout(std::time::Duration::from_secs(120), async {
        // An active caller from 192.0.2.0/24 spends 100 of its 300 reads first.
        for _ in 0..100 {
            assert_eq!(get(&http, &url, "active", "192.0.2.10").await, 200);
        }
        // The flood: 10,000 new keys from 6,350 addresses in 25 /24s of 10.0.0.0/16,
        // 16 at a time.
        let tasks: Vec<_> = (0..16u32)
            .map(|t| {
                let (http, url) = (http.clone(), Arc::clone(&url));
                tokio::spawn(async move {
                    let mut ok = 0u32;
                    for i in (t..10_000).step_by(16) {
                        let key = format!("flood-{i}");
                        let addr = format!("10.0.{}.{}", i % 25, i / 25 % 254 + 1);
                        if get(&http, &url, &key, &addr).await == 200 {
                            ok += 1;
                        }
                    }
                    ok
                })
            })
            .collect();
        let mut flood_ok = 0;
        for t in tasks {
            flood_ok += t.await.expect("flood task");
        }
        let status = support::get(&sluice.admin_url("/status")).await.json();
        let store = &status["limiter"]["store"];
        assert!(
            store["overflowed"].as_u64().unwrap_or(0) > 0,
            "the flood reached the cap: {store}"
        );
        let (cells, cap) = (&store["cells"], &store["max_cells"]);
        assert!(cells.as_u64() <= cap.as_u64(), "{store}");
        assert!(
            cap.as_u64() <= Some(2_000 + 64),
            "rounded up by at most one a shard"
        );
        // Past the cap each flooding network shared one read budget: 300 each.
        assert!(
            flood_ok <= 2_000 + 25 * 300,
            "{flood_ok} of 10,000 admitted"
        );

        // New callers from a flooding network: their network's budget is spent.
        assert_eq!(
            get(&http, &url, "newcomer-in-flood", "10.0.3.77").await,
            429
        );
        // New callers from networks the flood did not come from: served, IPv4 and IPv6.
        for (i, addr) in [
            "198.51.100.7",
            "198.51.100.8",
            "203.0.113.9",
            "192.0.2.200",
            "2001:db8:1:2::7",
            "2001:db8:99::1",
        ]
        .into_iter()
        .enumerate()
        {
            let key = format!("legitimate-{i}");
            assert_eq!(get(&http, &url, &key, addr).await, 200, "{addr}");
        }
        // The active caller kept its count: 200 more reads, then 429.
        for n in 0..200 {
            assert_eq!(
                get(&http, &url, "active", "192.0.2.10").await,
                200,
                "read {n}"
            );
        }
        assert_eq!(get(&http, &url, "active", "192.0.2.10").await, 429);
    })
    .await
    .expect("the test took over two minutes");
}
