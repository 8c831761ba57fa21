//! The edge end to end over loopback: an axum app behind the layer, real
//! HTTP, the default policy, a fake clock (no test can straddle a window).

use crate::edit;
use edit::Edit as _;

use crate::support;

use http::{Method, StatusCode};
use sluice_edge::EDGE_BODY;
use support::{T0, method, start, tool_call};

const KEY: (&str, &str) = ("x-api-key", "sk-test-one");

/// The policy with `/mcp` refusals answered as any request's (the edge 429 or the
/// envelope), as the seed describes them; the built-in policy answers them as
/// JSON-RPC errors (see `h2_jsonrpc_refusals_carry_the_wait_per_request_id`).
fn edge_refusals(yaml: &str) -> String {
    yaml.edit("  refusal: jsonrpc_error\n", "  refusal: edge\n")
}

fn assert_edge_429(r: &support::Reply) {
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(r.header("content-type"), "text/html; charset=utf-8");
    assert_eq!(r.body, EDGE_BODY);
    assert_eq!(
        r.header("retry-after"),
        "59",
        "the window ends at T0 + 60, now is T0 + 1"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e1_e6_h2_rest_and_tool_calls_share_the_expensive_budget() {
    let edge = start(|y| y).await;
    for i in 0..20 {
        let r = edge.post("/chats", &[KEY], "{}").await;
        assert_eq!(r.status, StatusCode::OK, "chat {i}");
        assert_eq!(r.limit(), 30);
        assert_eq!(r.remaining(), 29 - i);
        assert_eq!(r.header("x-ratelimit-reset"), (T0 + 60).to_string());
    }
    for i in 0..10 {
        let r = edge.rpc(&[KEY], &tool_call(i, "start_chat")).await;
        assert_eq!(r.status, StatusCode::OK, "tool call {i}");
        assert_eq!(r.remaining(), 9 - i);
    }
    let r = edge.post("/chats", &[KEY], "{}").await;
    assert_edge_429(&r);
    assert_eq!(r.limit(), 30);
    assert_eq!(r.remaining(), 0);
    // Classes are independent: reads still go through.
    let r = edge.get("/search/fields", &[KEY]).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.limit(), 300);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e5_a_batch_of_31_expensive_items_is_refused_whole_and_spends_nothing() {
    let edge = start(|y| edge_refusals(&y)).await;
    let batch: Vec<String> = (0..31).map(|i| tool_call(i, "optimize_message")).collect();
    let r = edge.rpc(&[KEY], &format!("[{}]", batch.join(","))).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(r.body, EDGE_BODY);
    assert_eq!(
        r.headers.get("retry-after"),
        None,
        "31 never fit in 30: waiting would not help, so no Retry-After"
    );
    assert_eq!(r.limit(), 30);
    assert_eq!(r.remaining(), 30, "nothing was spent");
    // 30 fit the class budget exactly, but not the optimizer's lane (a workspace
    // runs 3 at once): refused as such, and nothing is spent.
    let batch: Vec<String> = (0..30).map(|i| tool_call(i, "optimize_message")).collect();
    let r = edge.rpc(&[KEY], &format!("[{}]", batch.join(","))).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{}", r.body);
    assert!(r.body.contains("too_many_lane_calls"), "{}", r.body);
    let batch: Vec<String> = (0..30).map(|i| tool_call(i, "start_chat")).collect();
    let r = edge.rpc(&[KEY], &format!("[{}]", batch.join(","))).await;
    assert_eq!(r.status, StatusCode::OK, "30 fit exactly");
    assert_eq!(r.remaining(), 0);
    // A batch mixing classes counts each item in its own class.
    let mixed = format!("[{},{}]", method(1, "ping"), tool_call(2, "search_fields"));
    let r = edge.rpc(&[("x-api-key", "sk-other")], &mixed).await;
    assert_eq!(r.status, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e3_ten_keys_from_one_ip_hit_the_300_ceiling() {
    let edge = start(|y| y).await;
    let keys: Vec<String> = (0..10).map(|i| format!("sk-key-{i}")).collect();
    for (i, key) in keys.iter().enumerate() {
        for j in 0..30 {
            let r = edge.get("/search/fields", &[("x-api-key", key)]).await;
            assert_eq!(r.status, StatusCode::OK, "key {i} read {j}");
        }
    }
    let r = edge
        .get("/search/fields", &[("x-api-key", "sk-key-eleven")])
        .await;
    assert_edge_429(&r);
    assert_eq!(
        r.limit(),
        300,
        "the ceiling binds, and its 429 reads like a per-caller one"
    );
    // Protocol-only requests have their own ceiling.
    let r = edge
        .rpc(&[("x-api-key", "sk-key-eleven")], &method(1, "ping"))
        .await;
    assert_eq!(r.status, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e3_protocol_only_traffic_counts_toward_1200_and_not_300() {
    let edge = start(|y| edge_refusals(&y)).await;
    for i in 0..1200 {
        let key = if i % 2 == 0 { "sk-a" } else { "sk-b" };
        let r = edge.get("/mcp", &[("x-api-key", key)]).await;
        assert_eq!(r.status, StatusCode::OK, "protocol request {i}");
    }
    let r = edge.get("/search/fields", &[("x-api-key", "sk-c")]).await;
    assert_eq!(r.status, StatusCode::OK, "the 300 ceiling is untouched");
    assert_eq!(r.limit(), 300);
    assert_eq!(r.remaining(), 299);
    let r = edge
        .rpc(&[("x-api-key", "sk-c")], &method(1, "initialize"))
        .await;
    assert_edge_429(&r);
    assert_eq!(r.limit(), 1200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h1_x_ratelimit_limit_reads_the_budget_the_request_was_counted_in() {
    let edge = start(|y| y).await;
    let limit = |r: support::Reply| (r.status, r.limit());
    assert_eq!(
        limit(edge.rpc(&[KEY], &method(1, "initialize")).await),
        (StatusCode::OK, 600)
    );
    assert_eq!(
        limit(edge.get("/search/fields", &[KEY]).await),
        (StatusCode::OK, 300)
    );
    // A route holding the weighted warehouse-read budget reports it (SPEC Q2).
    assert_eq!(
        limit(edge.post("/search/query", &[KEY], "{}").await),
        (StatusCode::OK, 10)
    );
    assert_eq!(
        limit(edge.post("/evals", &[KEY], "{}").await),
        (StatusCode::OK, 60)
    );
    assert_eq!(
        limit(edge.post("/chats", &[KEY], "{}").await),
        (StatusCode::OK, 30)
    );
    assert_eq!(
        limit(edge.send(Method::PUT, "/unlisted", &[KEY], "").await),
        (StatusCode::OK, 60)
    );
    // Every response carries the three headers, also 429s (see other tests).
    let r = edge.get("/anything", &[]).await;
    assert!(r.header("x-ratelimit-reset").parse::<u64>().is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2_one_credential_is_one_set_of_budgets_from_any_address() {
    // Trust loopback as a proxy so X-Forwarded-For can stand for two addresses.
    let edge = start(|y| y.edit("trusted_proxies: []", "trusted_proxies: [127.0.0.1]")).await;
    let from = |ip: &'static str| ("x-forwarded-for", ip);
    for i in 0..30 {
        let ip = if i % 2 == 0 {
            "203.0.113.1"
        } else {
            "203.0.113.2"
        };
        let r = edge.post("/chats", &[KEY, from(ip)], "{}").await;
        assert_eq!(r.status, StatusCode::OK);
    }
    let r = edge.post("/chats", &[KEY, from("203.0.113.3")], "{}").await;
    assert_eq!(
        r.status,
        StatusCode::TOO_MANY_REQUESTS,
        "same key, third address"
    );
    let r = edge
        .post(
            "/chats",
            &[("authorization", "Bearer sk-test-two"), from("203.0.113.1")],
            "{}",
        )
        .await;
    assert_eq!(
        r.status,
        StatusCode::OK,
        "another credential from the same address"
    );
    assert_eq!(r.remaining(), 29);
    // No credential: the client IP is the caller.
    for (ip, remaining) in [
        ("198.51.100.1", 59),
        ("198.51.100.1", 58),
        ("198.51.100.2", 59),
    ] {
        let r = edge.post("/evals", &[from(ip)], "{}").await;
        assert_eq!(r.remaining(), remaining, "{ip}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e4_a_spoofed_forwarded_for_from_an_untrusted_peer_changes_nothing() {
    let edge = start(|y| y).await;
    for i in 0..60 {
        let spoof = format!("198.51.100.{i}");
        let r = edge
            .post("/evals", &[("x-forwarded-for", &spoof)], "{}")
            .await;
        assert_eq!(r.status, StatusCode::OK);
    }
    let r = edge
        .post("/evals", &[("x-forwarded-for", "192.0.2.200")], "{}")
        .await;
    assert_edge_429(&r);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e5_unknown_tool_retired_unknown_action_and_an_object_without_method_count_as_standard() {
    let edge = start(|y| y).await;
    let retired_unknown = r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"messages","arguments":{"action":"shred"}}}"#;
    let retired_known = r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"messages","arguments":{"action":"optimize"}}}"#;
    let cases = [
        (tool_call(1, "no_such_tool"), 60, 59),
        (retired_unknown.to_owned(), 60, 58),
        (r#"{"not":"jsonrpc"}"#.to_owned(), 60, 57),
        (retired_known.to_owned(), 30, 29),
    ];
    for (body, limit, remaining) in cases {
        let r = edge.rpc(&[KEY], &body).await;
        assert_eq!(r.status, StatusCode::OK, "{body}");
        assert_eq!((r.limit(), r.remaining()), (limit, remaining), "{body}");
    }
}

/// A body, the fields sent with it, and its refusal: status, `error.code`,
/// `error.details`.
type Case<'a> = (
    &'a str,
    &'a [(&'a str, &'a str)],
    u16,
    &'a str,
    serde_json::Value,
);

/// A body the limiter cannot count as the upstream would read it is refused, with
/// the bound or reason named, before anything is decided: nothing is spent and
/// nothing reaches the app (SPEC E5, H3).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e5_h3_bodies_that_cannot_be_counted_are_refused_and_spend_nothing() {
    let edge = start(|y| y.edit("max_batch_items: 1000", "max_batch_items: 30")).await;
    let batch = |n: u32| {
        let items: Vec<String> = (0..n).map(|i| tool_call(i, "start_chat")).collect();
        format!("[{}]", items.join(","))
    };
    let deep = format!("{}{}", "[".repeat(65), "]".repeat(65));
    let with_bom = format!("\u{feff}{}", method(1, "ping"));
    let cases: [Case<'_>; 7] = [
        (
            &batch(31),
            &[],
            413,
            "payload_too_large",
            serde_json::json!({"max_batch_items": 30}),
        ),
        (
            &deep,
            &[],
            400,
            "invalid_request",
            serde_json::json!({"max_json_depth": 64}),
        ),
        (
            "[]",
            &[],
            400,
            "invalid_request",
            serde_json::json!({"reason": "empty_batch"}),
        ),
        (
            "certainly not json",
            &[],
            400,
            "invalid_request",
            serde_json::json!({"reason": "not_json"}),
        ),
        (
            "42",
            &[],
            400,
            "invalid_request",
            serde_json::json!({"reason": "not_jsonrpc"}),
        ),
        (
            &with_bom,
            &[],
            400,
            "invalid_request",
            serde_json::json!({"reason": "byte_order_mark"}),
        ),
        (
            &tool_call(1, "start_chat"),
            &[("content-encoding", "gzip")],
            415,
            "unsupported_media_type",
            serde_json::json!({"content_encodings": ["identity"]}),
        ),
    ];
    // `/mcp` answers as JSON-RPC: each is a parse error (-32700, `id: null`) whose
    // `data` holds what the envelope's `details` hold elsewhere (issue 23, item 6).
    for (body, extra, status, _envelope_code, details) in cases {
        let mut headers = vec![KEY];
        headers.extend_from_slice(extra);
        let r = edge.rpc(&headers, body).await;
        assert_eq!(r.status.as_u16(), status, "{body:.40}: {}", r.body);
        let envelope: serde_json::Value = serde_json::from_str(&r.body).expect("json");
        assert_eq!(
            (
                &envelope["jsonrpc"],
                &envelope["id"],
                &envelope["error"]["code"]
            ),
            (&"2.0".into(), &serde_json::Value::Null, &(-32700).into()),
            "{body:.40}"
        );
        let data = &envelope["error"]["data"];
        assert!(data["reason"].is_string(), "{data}");
        for (key, value) in details.as_object().expect("details") {
            assert_eq!(&data[key], value, "{body:.40}: {key}");
        }
        assert!(
            envelope["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("nothing was counted")),
            "{envelope}"
        );
        assert!(
            r.headers.get("x-ratelimit-limit").is_none(),
            "nothing decided"
        );
        assert!(
            r.headers.get("retry-after").is_none(),
            "a retry cannot succeed"
        );
    }
    // Nothing was spent: the whole budget is left.
    let r = edge.rpc(&[KEY], &batch(30)).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!((r.limit(), r.remaining()), (30, 0));
    let r = edge
        .rpc(
            &[KEY, ("content-encoding", "identity")],
            &method(2, "no/such"),
        )
        .await;
    assert_eq!(
        (r.status, r.limit(), r.remaining()),
        (StatusCode::OK, 60, 59)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e7_oauth_registration_is_5_per_minute_per_ip() {
    let edge = start(|y| y).await;
    for i in 0..5 {
        let key = format!("sk-reg-{i}");
        let r = edge
            .post("/oauth/register", &[("x-api-key", &key)], "{}")
            .await;
        assert_eq!(r.status, StatusCode::OK);
    }
    let r = edge
        .post("/oauth/register", &[("x-api-key", "sk-reg-9")], "{}")
        .await;
    assert_edge_429(&r);
    assert_eq!(r.limit(), 5);
    let r = edge
        .get("/oauth/authorize", &[("x-api-key", "sk-reg-9")])
        .await;
    assert_eq!(
        r.status,
        StatusCode::OK,
        "other OAuth routes are standard-class only"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h3_the_export_bucket_refuses_with_the_json_envelope_and_retry_at() {
    let edge = start(|y| y).await;
    for _ in 0..5 {
        assert_eq!(
            edge.get("/evals/e1/export", &[KEY]).await.status,
            StatusCode::OK
        );
    }
    let r = edge.get("/evals/e1/export", &[KEY]).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(r.header("content-type"), "application/json");
    assert_eq!(r.header("retry-after"), "59");
    assert_eq!(r.limit(), 5);
    let body: serde_json::Value = serde_json::from_str(&r.body).expect("JSON envelope");
    assert_eq!(body["error"]["code"], "rate_limited");
    assert_eq!(
        body["error"]["message"],
        "Export rate-limited. Try again in 59 seconds."
    );
    assert_eq!(body["error"]["details"]["retry_after_seconds"], 59);
    assert_eq!(body["error"]["details"]["retry_at"], "2025-11-30T00:01:00Z");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e1_profile_local_numbers() {
    let edge = start(|y| y.edit("profile: production", "profile: local")).await;
    assert_eq!(edge.rpc(&[KEY], &method(1, "ping")).await.limit(), 3000);
    assert_eq!(edge.get("/search/fields", &[KEY]).await.limit(), 1500);
    assert_eq!(edge.post("/evals", &[KEY], "{}").await.limit(), 500);
    assert_eq!(edge.post("/chats", &[KEY], "{}").await.limit(), 150);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h1_ietf_draft_fields_list_every_budget_when_enabled() {
    let edge = start(|y| y.edit("ietf_draft: false", "ietf_draft: true")).await;
    let r = edge.post("/chats", &[KEY], "{}").await;
    assert_eq!(
        r.header("ratelimit-policy"),
        r#""expensive";q=30;w=60, "ip";q=300;w=60"#
    );
    assert_eq!(
        r.header("ratelimit"),
        r#""expensive";r=29;t=59, "ip";r=299;t=59"#
    );
    let plain = start(|y| y).await;
    let r = plain.post("/chats", &[KEY], "{}").await;
    assert!(r.headers.get("ratelimit").is_none(), "off by default");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_jsonrpc_bodies_get_413_and_count_as_standard() {
    let edge = start(|y| y.edit("max_body_bytes: 1048576", "max_body_bytes: 1024")).await;
    let big = format!(
        r#"{{"jsonrpc":"2.0","id":1,"method":"ping","params":{{"pad":"{}"}}}}"#,
        "x".repeat(2000)
    );
    let r = edge.rpc(&[KEY], &big).await;
    assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE);
    // Answered as the JSON-RPC route answers (issue 23, item 6).
    let body: serde_json::Value = serde_json::from_str(&r.body).expect("json");
    assert_eq!(body["error"]["code"], -32700);
    assert_eq!(body["error"]["data"]["reason"], "payload_too_large");
    assert_eq!(body["id"], serde_json::Value::Null);
    assert_eq!((r.limit(), r.remaining()), (60, 59));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn budgets_refill_when_the_window_rolls() {
    let edge = start(|y| y).await;
    for _ in 0..30 {
        edge.post("/chats", &[KEY], "{}").await;
    }
    assert_eq!(
        edge.post("/chats", &[KEY], "{}").await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    edge.clock.advance(std::time::Duration::from_secs(59));
    let r = edge.post("/chats", &[KEY], "{}").await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.remaining(), 29);
    assert_eq!(r.header("x-ratelimit-reset"), (T0 + 120).to_string());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_jsonrpc_body_past_the_buffer_bound_is_a_503_and_spends_nothing() {
    let policy = sluice_policy::default_policy().expect("default");
    let clock = sluice_core::FakeClock::new(sluice_core::Timestamp::from_secs(support::T0 + 1));
    let store =
        sluice_store::MemoryStore::with_clock(sluice_store::MemoryConfig::default(), clock.clone());
    let limiter = sluice_tower::Limiter::new(policy, store).with_buffer_bound(64);
    let edge = support::start_limiter(limiter, clock).await;
    let big = format!(
        r#"{{"jsonrpc":"2.0","id":1,"method":"ping","params":{{"pad":"{}"}}}}"#,
        "x".repeat(100)
    );
    let r = edge.rpc(&[KEY], &big).await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{}", r.body);
    assert_eq!(r.header("retry-after"), "1");
    assert!(r.body.contains("\"busy\""), "{}", r.body);
    // A body within the bound is served, and the refused one spent no protocol unit.
    let r = edge.rpc(&[KEY], &method(1, "ping")).await;
    assert_eq!(
        (r.status, r.limit(), r.remaining()),
        (StatusCode::OK, 600, 599)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2_a_request_that_can_never_fit_says_so_and_comes_without_retry_after() {
    // The export bucket (5 a minute, refused with the envelope) on a tool too: a
    // batch of 6 of its calls can never fit.
    let edge = start(|y| {
        edge_refusals(&y).edit(
            "search_fields: { class: read }",
            "search_fields: { class: read, buckets: [export] }",
        )
    })
    .await;
    let batch: Vec<String> = (0..6).map(|i| tool_call(i, "search_fields")).collect();
    let r = edge.rpc(&[KEY], &format!("[{}]", batch.join(","))).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS, "{}", r.body);
    assert_eq!(r.headers.get("retry-after"), None, "waiting would not help");
    let body: serde_json::Value = serde_json::from_str(&r.body).expect("envelope");
    assert_eq!(body["error"]["code"], "rate_limited");
    assert_eq!(body["error"]["details"]["reason"], "cost_exceeds_limit");
    assert_eq!(body["error"]["details"]["limit"], 5);
    assert!(
        body["error"]["details"]
            .get("retry_after_seconds")
            .is_none()
    );
    // Five fit, and the sixth alone is a refusal that only has to wait.
    let batch: Vec<String> = (0..5).map(|i| tool_call(i, "search_fields")).collect();
    let r = edge.rpc(&[KEY], &format!("[{}]", batch.join(","))).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let r = edge.rpc(&[KEY], &tool_call(9, "search_fields")).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(r.header("retry-after"), "59");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2_jsonrpc_refusals_carry_the_wait_per_request_id() {
    // The built-in policy: /mcp refusals are JSON-RPC errors an agent's SDK keeps.
    let edge = start(|y| y).await;
    let batch: Vec<String> = (0..31).map(|i| tool_call(i, "start_chat")).collect();
    let never = edge.rpc(&[KEY], &format!("[{}]", batch.join(","))).await;
    assert_eq!(never.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(never.header("content-type"), "application/json");
    assert_eq!(never.headers.get("retry-after"), None);
    let errors: serde_json::Value = serde_json::from_str(&never.body).expect("JSON-RPC");
    let errors = errors.as_array().expect("an array for a batch");
    assert_eq!(errors.len(), 31, "one error per request id");
    assert_eq!(errors[7]["id"], 7);
    assert_eq!(errors[7]["error"]["code"], -32029);
    assert_eq!(errors[7]["error"]["data"]["reason"], "cost_exceeds_limit");
    assert_eq!(
        errors[7]["error"]["data"]["retry_after_seconds"],
        serde_json::Value::Null
    );
    assert_eq!(errors[7]["error"]["data"]["limit"], 30);
    assert_eq!(errors[7]["error"]["data"]["class"], "expensive");

    // Spend the class, then a single call must wait: the wait is in the error.
    let thirty: Vec<String> = (0..30).map(|i| tool_call(i, "start_chat")).collect();
    let r = edge.rpc(&[KEY], &format!("[{}]", thirty.join(","))).await;
    assert_eq!(r.status, StatusCode::OK);
    let wait = edge.rpc(&[KEY], &tool_call(42, "start_chat")).await;
    assert_eq!(wait.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(wait.header("retry-after"), "59");
    assert_eq!(wait.header("x-ratelimit-limit"), "30");
    let error: serde_json::Value = serde_json::from_str(&wait.body).expect("JSON-RPC");
    assert_eq!(error["id"], 42);
    assert_eq!(error["error"]["message"], "Rate limited: retry in 59 s");
    assert_eq!(error["error"]["data"]["retry_after_seconds"], 59);
    assert_eq!(error["error"]["data"]["reason"], "rate_limited");
    // REST routes keep the seed's text/html answer.
    let rest = edge.post("/chats", &[KEY], "{}").await;
    assert_edge_429(&rest);
}
