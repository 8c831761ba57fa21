//! E3/E4 for library users: the layer finds the client address however the server
//! hands it over (sluice's `PeerAddr`, axum's `ConnectInfo`, a function of the
//! user's), and refuses a request it cannot place rather than count every such
//! caller as one.

use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use sluice_policy::default_policy;
use sluice_store::{MemoryConfig, MemoryStore};
use sluice_tower::{Limiter, SluiceLayer};
use tower::{Layer as _, ServiceExt as _, service_fn};

fn ok(_: Request<Full<Bytes>>) -> impl Future<Output = Result<Response<Full<Bytes>>, Infallible>> {
    std::future::ready(Ok(Response::new(Full::new(Bytes::from_static(b"ok")))))
}

fn read(extensions: impl FnOnce(&mut http::Extensions)) -> Request<Full<Bytes>> {
    let mut request = Request::get("/search/fields")
        .header("host", "api")
        .body(Full::new(Bytes::new()))
        .expect("request");
    extensions(request.extensions_mut());
    request
}

#[tokio::test]
async fn e4_the_layer_reads_connect_info_a_peer_function_or_refuses() {
    let limiter = Arc::new(Limiter::new(
        default_policy().expect("policy"),
        MemoryStore::new(MemoryConfig::default()),
    ));
    let addr: SocketAddr = ([198, 51, 100, 7], 4000).into();

    // axum's ConnectInfo, as `into_make_service_with_connect_info` inserts it: the
    // anonymous caller is that address, with its own read budget.
    let layer = SluiceLayer::new(Arc::clone(&limiter));
    let r = layer
        .layer(service_fn(ok))
        .oneshot(read(|e| {
            e.insert(axum::extract::ConnectInfo(addr));
        }))
        .await
        .expect("infallible");
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(r.headers()["x-ratelimit-remaining"], "299");

    // A function of the user's.
    let layer =
        SluiceLayer::new(Arc::clone(&limiter)).with_peer(|_| Some(IpAddr::from([192, 0, 2, 1])));
    let r = layer
        .layer(service_fn(ok))
        .oneshot(read(|_| {}))
        .await
        .expect("infallible");
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(
        r.headers()["x-ratelimit-remaining"],
        "299",
        "another caller"
    );

    // Nothing: refused, never one budget for everybody.
    let layer = SluiceLayer::new(limiter);
    let r = layer
        .layer(service_fn(ok))
        .oneshot(read(|_| {}))
        .await
        .expect("infallible");
    assert_eq!(r.status(), StatusCode::INTERNAL_SERVER_ERROR);
}

/// A read from `ip` with header `x-user-id: user` (when given) and `x-api-key: key`
/// (when given), through `layer`; returns the read budget left.
async fn remaining(
    layer: &SluiceLayer<MemoryStore>,
    ip: [u8; 4],
    user: Option<&str>,
    key: Option<&str>,
) -> String {
    let mut request = read(|e| {
        e.insert(sluice_tower::PeerAddr((ip, 4000).into()));
    });
    if let Some(user) = user {
        request
            .headers_mut()
            .insert("x-user-id", user.parse().expect("value"));
    }
    if let Some(key) = key {
        request
            .headers_mut()
            .insert("x-api-key", key.parse().expect("value"));
    }
    let r = layer
        .layer(service_fn(ok))
        .oneshot(request)
        .await
        .expect("infallible");
    assert_eq!(r.status(), StatusCode::OK);
    r.headers()["x-ratelimit-remaining"]
        .to_str()
        .expect("text")
        .to_owned()
}

/// The layer over `limiter`, its caller named by the `x-user-id` header where sent.
fn keyed_by_user_id(limiter: Arc<Limiter<MemoryStore>>) -> SluiceLayer<MemoryStore> {
    SluiceLayer::new(limiter).with_key(|parts| {
        parts
            .headers
            .get("x-user-id")
            .map(|v| v.as_bytes().to_vec())
    })
}

#[tokio::test]
async fn e2_a_key_function_names_the_caller_and_otherwise_the_policy_does() {
    let limiter = Arc::new(Limiter::new(
        default_policy().expect("policy"),
        MemoryStore::new(MemoryConfig::default()),
    ));
    let layer = keyed_by_user_id(limiter);
    // Every request from an address of its own, so that the per-IP ceiling (300)
    // never binds before the read budget does.
    // One user from two addresses, with two different API keys: one budget.
    assert_eq!(
        remaining(&layer, [198, 51, 100, 1], Some("ada"), Some("k1")).await,
        "299"
    );
    assert_eq!(
        remaining(&layer, [198, 51, 100, 2], Some("ada"), Some("k2")).await,
        "298"
    );
    // Another user: a budget of its own.
    assert_eq!(
        remaining(&layer, [198, 51, 100, 3], Some("bob"), None).await,
        "299"
    );
    // No key: the policy's credential names the caller, as without the function...
    assert_eq!(
        remaining(&layer, [198, 51, 100, 4], None, Some("k1")).await,
        "299"
    );
    assert_eq!(
        remaining(&layer, [198, 51, 100, 5], None, Some("k1")).await,
        "298"
    );
    // ...and with no credential either, the address does.
    assert_eq!(remaining(&layer, [203, 0, 113, 9], None, None).await, "299");
}

#[tokio::test]
async fn e1_a_policy_built_in_code_limits_through_the_layer() {
    use sluice_policy::Policy;
    // Two reads a minute per user, keyed by the user's own header; no route but
    // `/search/*`, which costs a read.
    let policy = Policy::builder()
        .limit("read", 2)
        .route_any_method("/search/*", "read")
        .build()
        .expect("valid");
    let limiter = Arc::new(Limiter::new(
        policy,
        MemoryStore::new(MemoryConfig::default()),
    ));
    let layer = keyed_by_user_id(limiter);
    assert_eq!(
        remaining(&layer, [198, 51, 100, 1], Some("ada"), None).await,
        "1"
    );
    assert_eq!(
        remaining(&layer, [198, 51, 100, 2], Some("ada"), None).await,
        "0"
    );
    let refused = layer
        .layer(service_fn(ok))
        .oneshot({
            let mut r = read(|e| {
                e.insert(sluice_tower::PeerAddr(([198, 51, 100, 3], 4000).into()));
            });
            r.headers_mut()
                .insert("x-user-id", http::HeaderValue::from_static("ada"));
            r
        })
        .await
        .expect("infallible");
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        remaining(&layer, [198, 51, 100, 4], Some("bob"), None).await,
        "1"
    );
}
