//! A real axum app behind the sluice layer on a loopback port, driven by a
//! fake clock, and a small HTTP client.
#![allow(dead_code, unreachable_pub, missing_docs)]

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use axum::Router;
use axum::extract::{ConnectInfo, Request};
use axum::middleware::Next;
use axum::response::Response;
use bytes::Bytes;
use http::{HeaderMap, Method, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use sluice_core::{FakeClock, Timestamp};
use sluice_policy::{DEFAULT_POLICY_YAML, parse_str};
use sluice_store::{MemoryConfig, MemoryStore};
use sluice_tower::{Limiter, PeerAddr, SluiceLayer};

/// 2025-11-30T00:00:00Z; the clock starts at T0 + 1, so windows end at T0 + 60.
pub const T0: u64 = 1_764_460_800;

pub struct Edge {
    pub addr: SocketAddr,
    pub clock: FakeClock,
    client: Client<HttpConnector, Full<Bytes>>,
}

pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: String,
}

impl Reply {
    pub fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
    }

    pub fn limit(&self) -> u32 {
        self.header("x-ratelimit-limit")
            .parse()
            .expect("X-RateLimit-Limit")
    }

    pub fn remaining(&self) -> u32 {
        self.header("x-ratelimit-remaining")
            .parse()
            .expect("X-RateLimit-Remaining")
    }
}

async fn peer_from_connect_info(mut req: Request, next: Next) -> Response {
    if let Some(ConnectInfo(addr)) = req.extensions().get::<ConnectInfo<SocketAddr>>().copied() {
        req.extensions_mut().insert(PeerAddr(addr));
    }
    next.run(req).await
}

/// Starts the default policy with `edit` applied to its YAML.
pub async fn start(edit: impl FnOnce(String) -> String) -> Edge {
    let yaml = edit(DEFAULT_POLICY_YAML.to_owned());
    let policy = parse_str(&yaml, Path::new("test-policy.yaml")).expect("policy");
    start_policy(policy).await
}

pub async fn start_policy(policy: sluice_policy::Policy) -> Edge {
    let clock = FakeClock::new(Timestamp::from_secs(T0 + 1));
    let store = MemoryStore::with_clock(MemoryConfig::default(), clock.clone());
    start_with(policy, store, clock).await
}

/// Starts the default policy with `edit` applied, monthly quotas kept durable in
/// `dir` (the embedded store), everything on one fake clock.
pub async fn start_durable(edit: impl FnOnce(String) -> String, dir: &Path) -> Edge {
    let yaml = edit(DEFAULT_POLICY_YAML.to_owned());
    let policy = parse_str(&yaml, Path::new("test-policy.yaml")).expect("policy");
    let clock = FakeClock::new(Timestamp::from_secs(T0 + 1));
    let durable = sluice_store::DurableStore::open(dir).expect("data dir");
    let book = sluice_store::QuotaBook::open(
        &durable,
        sluice_store::QuotaBookConfig::default(),
        Timestamp::from_secs(T0 + 1),
    )
    .expect("quota book");
    let store = sluice_store::LocalStore::new(
        MemoryStore::with_clock(MemoryConfig::default(), clock.clone()),
        Some(book),
    );
    start_with(policy, store, clock).await
}

/// Starts `policy` deciding on `store`; the fallback store reads `clock`.
pub async fn start_with<S>(policy: sluice_policy::Policy, store: S, clock: FakeClock) -> Edge
where
    S: sluice_store::BudgetStore + Send + Sync + 'static,
{
    start_limiter(
        Limiter::new(policy, store).with_fallback(mid_window_fallback()),
        clock,
    )
    .await
}

/// A fallback store (it reads the real clock) shifted to 30 s into a minute and
/// 1,830 s into an hour: a test's local decisions, on windows of a minute or an
/// hour, cannot straddle two windows unless the test runs for half a minute.
fn mid_window_fallback() -> MemoryStore {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_secs() as i64;
    let offset = 1_830 - now.rem_euclid(3_600);
    MemoryStore::with_clock(
        MemoryConfig::default(),
        sluice_core::SystemClock::with_offset(offset),
    )
}

/// Starts the app behind `limiter`; `clock` is what the test advances.
pub async fn start_limiter<S>(limiter: Limiter<S>, clock: FakeClock) -> Edge
where
    S: sluice_store::BudgetStore + Send + Sync + 'static,
{
    let limiter = Arc::new(limiter);
    let app = Router::new()
        .fallback(
            |method: Method, uri: http::Uri, headers: HeaderMap, body: Bytes| async move {
                // What sluice told the upstream, echoed; `x-test-cost: N` is answered
                // with `X-Sluice-Cost: N` and `x-test-status` sets the status.
                let seen = |name: &str| {
                    headers
                        .get(name)
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or("")
                        .to_owned()
                };
                let body = serde_json::json!({
                    "ok": true,
                    "method": method.as_str(),
                    "path": uri.path(),
                    "bytes": body.len(),
                    "workspace": seen("x-sluice-workspace"),
                    "user": seen("x-sluice-user"),
                    "exhausted": seen("x-sluice-exhausted"),
                    "signals": headers.keys().filter(|k| k.as_str().starts_with("x-sluice-")).count(),
                });
                let mut response = axum::response::IntoResponse::into_response(body.to_string());
                if let Some(cost) = headers.get("x-test-cost") {
                    response.headers_mut().insert("x-sluice-cost", cost.clone());
                }
                if let Some(status) = headers
                    .get("x-test-status")
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.parse::<u16>().ok())
                    .and_then(|v| StatusCode::from_u16(v).ok())
                {
                    *response.status_mut() = status;
                }
                response
            },
        )
        .layer(SluiceLayer::new(limiter))
        .layer(axum::middleware::from_fn(peer_from_connect_info));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        axum::serve(
            listener,
            app.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .await
        .ok();
    });
    let client = Client::builder(TokioExecutor::new()).build_http();
    Edge {
        addr,
        clock,
        client,
    }
}

impl Edge {
    pub async fn send(
        &self,
        method: Method,
        path: &str,
        headers: &[(&str, &str)],
        body: &str,
    ) -> Reply {
        let mut req = http::Request::builder()
            .method(method)
            .uri(format!("http://{}{path}", self.addr));
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let req = req
            .body(Full::new(Bytes::from(body.to_owned())))
            .expect("request");
        let res = self.client.request(req).await.expect("response");
        let status = res.status();
        let headers = res.headers().clone();
        let body = res.into_body().collect().await.expect("body").to_bytes();
        Reply {
            status,
            headers,
            body: String::from_utf8_lossy(&body).into_owned(),
        }
    }

    pub async fn get(&self, path: &str, headers: &[(&str, &str)]) -> Reply {
        self.send(Method::GET, path, headers, "").await
    }

    pub async fn post(&self, path: &str, headers: &[(&str, &str)], body: &str) -> Reply {
        self.send(Method::POST, path, headers, body).await
    }

    /// A JSON-RPC POST on /mcp.
    pub async fn rpc(&self, headers: &[(&str, &str)], body: &str) -> Reply {
        let mut h = headers.to_vec();
        h.push(("content-type", "application/json"));
        self.post("/mcp", &h, body).await
    }
}

pub fn tool_call(id: u32, name: &str) -> String {
    format!(
        r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{{"name":"{name}","arguments":{{}}}}}}"#
    )
}

pub fn method(id: u32, name: &str) -> String {
    format!(r#"{{"jsonrpc":"2.0","id":{id},"method":"{name}"}}"#)
}
