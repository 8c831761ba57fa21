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
