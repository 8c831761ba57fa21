//! sluice as a tower layer: every request is classified by the policy,
//! decided on all its budgets at once, and answered with exact
//! `X-RateLimit-*` headers or a refusal. No axum needed: any hyper or tower
//! stack can wrap its service (the crate's `examples/axum_app.rs` shows an
//! axum app).
//!
//! The layer finds the client's address in axum's `ConnectInfo` (feature
//! `axum`, on by default), in a [`PeerAddr`] extension, or through a function
//! of yours ([`SluiceLayer::with_peer`]); a request with none of them is
//! refused with a 500 (and one loud log line) rather than counted with every
//! other such request as one caller.
//!
//! ```
//! use std::sync::Arc;
//! use bytes::Bytes;
//! use http::{Request, Response};
//! use http_body_util::Full;
//! use sluice_policy::default_policy;
//! use sluice_store::{MemoryConfig, MemoryStore};
//! use sluice_tower::{Limiter, PeerAddr, SluiceLayer};
//! use tower::{Layer, ServiceExt, service_fn};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let limiter = Limiter::new(default_policy().unwrap(), MemoryStore::new(MemoryConfig::default()));
//! let api = service_fn(|_req: Request<Full<Bytes>>| async {
//!     Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::from("ok"))))
//! });
//! let service = SluiceLayer::new(Arc::new(limiter)).layer(api);
//!
//! // The default policy's `expensive` class: 30 calls a minute per API key.
//! let call = || {
//!     let mut req = Request::post("/chats").header("host", "api").header("x-api-key", "k")
//!         .body(Full::default()).unwrap();
//!     req.extensions_mut().insert(PeerAddr(([203, 0, 113, 7], 4000).into()));
//!     req
//! };
//! for remaining in (0..30).rev() {
//!     let answer = service.clone().oneshot(call()).await.unwrap();
//!     assert_eq!(answer.headers()["x-ratelimit-remaining"], remaining.to_string().as_str());
//! }
//! let refused = service.clone().oneshot(call()).await.unwrap();
//! assert_eq!(refused.status(), 429);
//! assert!(refused.headers().contains_key("retry-after"));
//! # }
//! ```

/// The side-by-side snippets of `docs/`, run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../../../docs/vs-tower-governor.md")]
struct VsTowerGovernor;

mod layer;

pub mod settle;

pub use layer::{KeyFn, PeerAddr, PeerFn, SluiceBody, SluiceLayer, SluiceService, UpstreamTimeout};
/// The edge engine the layer runs: its limiter, plans, decisions and answers.
pub use sluice_edge::{
    self as edge, Limiter, Plan, Refused, ReloadRefused, RequestId, SharedLimiter,
};

/// arc-swap, whose [`ArcSwap`](arc_swap::ArcSwap) holds a [`SharedLimiter`].
pub use sluice_edge::arc_swap;
