//! An axum app behind sluice: every route gets the default policy's budgets,
//! exact `X-RateLimit-*` headers and sluice's 429s.
//!
//! Run with `cargo run -p sluice-tower --example axum_app`, then
//! `curl -i -X POST -H 'X-API-Key: k' http://127.0.0.1:3000/chats` 31 times.
//!
//! sluice keys anonymous callers and IP ceilings on the client address: it reads
//! axum's `ConnectInfo` by itself, so serving with
//! `into_make_service_with_connect_info::<SocketAddr>()` is all it takes.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::routing::{get, post};
use sluice_policy::default_policy;
use sluice_store::{MemoryConfig, MemoryStore};
use sluice_tower::{Limiter, SluiceLayer};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let limiter = Limiter::new(default_policy()?, MemoryStore::new(MemoryConfig::default()));
    let app = Router::new()
        .route("/chats", post(|| async { "chat started\n" }))
        .route("/search/fields", get(|| async { "[\"a\",\"b\"]\n" }))
        .layer(SluiceLayer::new(Arc::new(limiter)));
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
