//! An axum app behind sluice: every route gets the default policy's budgets,
//! exact `X-RateLimit-*` headers and the seed's 429s.
//!
//! Run with `cargo run -p sluice-tower --example axum_app`, then
//! `curl -i -X POST -H 'X-API-Key: k' http://127.0.0.1:3000/chats` 31 times.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::extract::{ConnectInfo, Request};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::{get, post};
use sluice_policy::default_policy;
use sluice_store::{MemoryConfig, MemoryStore};
use sluice_tower::{Limiter, PeerAddr, SluiceLayer};

/// sluice keys anonymous callers and IP ceilings on the peer address: hand
/// it over from axum's connection info.
async fn peer_addr(mut req: Request, next: Next) -> Response {
    if let Some(ConnectInfo(addr)) = req.extensions().get::<ConnectInfo<SocketAddr>>().copied() {
        req.extensions_mut().insert(PeerAddr(addr));
    }
    next.run(req).await
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let limiter = Limiter::new(default_policy()?, MemoryStore::new(MemoryConfig::default()));
    let app = Router::new()
        .route("/chats", post(|| async { "chat started\n" }))
        .route("/search/fields", get(|| async { "[\"a\",\"b\"]\n" }))
        .layer(SluiceLayer::new(Arc::new(limiter)))
        .layer(middleware::from_fn(peer_addr));
    let addr = std::env::var("LISTEN").unwrap_or_else(|_| "127.0.0.1:3000".to_owned());
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .await?;
    Ok(())
}
