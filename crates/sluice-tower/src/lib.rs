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

mod answer;
mod batch;
mod buffers;
mod lanes;
mod layer;
mod limiter;
mod plan;
mod refusal_log;
mod request_id;

// What the gateway (sluice-gateway) builds on: its answers, batches, body
// buffers and lanes. Not for users of the layer; hidden from the docs.
#[doc(hidden)]
pub use answer::{
    COST_EXCEEDS_LIMIT, EDGE_BODY, JSONRPC_PARSE_ERROR, JSONRPC_RATE_LIMITED, RATELIMIT,
    RATELIMIT_POLICY, RateLimitValue, X_RATELIMIT_LIMIT, X_RATELIMIT_REMAINING, X_RATELIMIT_RESET,
    X_SLUICE_COST, X_SLUICE_EXHAUSTED, X_SLUICE_USER, X_SLUICE_WORKSPACE, body_too_slow,
    body_unreadable, buffers_full, buffers_refusal, envelope_response, for_each_rate_limit_header,
    for_each_upstream_header, is_sluice_signal, jsonrpc_payload_too_large, jsonrpc_refusal,
    limiter_unavailable, parse_cost, payload_too_large, rate_limit_headers, refusal, refusal_wait,
    retry_after_secs, rfc3339, take_cost, upstream_headers, upstream_timed_out,
};
#[doc(hidden)]
pub use batch::{
    BadBatch, BatchSubmit, BatchTool, BatchToolCall, MAX_IDEMPOTENCY_KEY, batch_tool_call,
    may_call_batch_tool, parse_batch,
};
#[doc(hidden)]
pub use buffers::{
    BODY_DEADLINE, BufferBudget, BufferFull, BufferLease, DEFAULT_BUFFERED_SHARE,
    DEFAULT_MAX_BUFFERED_BYTES, Holder, MAX_HOLDERS, PIECE_BYTES, READ_BUFFER_ALLOWANCE,
};
#[doc(hidden)]
pub use lanes::{
    LaneCall, LanePlace, lane_config, lane_refusal, lane_status, ledger_outage, publish_lane_gauges,
};
pub use layer::{
    KeyFn, PeerAddr, PeerFn, SharedLimiter, SluiceBody, SluiceLayer, SluiceService, UpstreamTimeout,
};
pub use limiter::{
    Admitted, ClassTally, Limiter, QuotaQueryError, QuotaUsage, Refused, ReloadRefused, Tally,
};
#[doc(hidden)]
pub use limiter::{DECISION_SECONDS_BUCKETS, FALLBACK_MAX_KEYS, TOP_CALLERS_TRACKED, check_head};
pub use plan::{BudgetKind, Passed, Plan, Scopes};
pub use refusal_log::{DEFAULT_REFUSAL_LOG_PER_SECOND, RefusalLog};
pub use request_id::{MAX_REQUEST_ID_LEN, RequestId, X_REQUEST_ID};

/// arc-swap, whose [`ArcSwap`](arc_swap::ArcSwap) holds a [`SharedLimiter`].
pub use arc_swap;
