//! sluice as a tower layer: every request is classified by the policy,
//! decided on all its budgets at once, and answered with exact
//! `X-RateLimit-*` headers or a refusal. No axum here: any hyper or tower
//! stack can wrap its service (see `examples/axum_app.rs`).
//!
//! ```
//! use std::sync::Arc;
//! use sluice_policy::default_policy;
//! use sluice_store::{MemoryConfig, MemoryStore};
//! use sluice_tower::{Limiter, SluiceLayer};
//!
//! let limiter = Limiter::new(default_policy().unwrap(), MemoryStore::new(MemoryConfig::default()));
//! let layer = SluiceLayer::new(Arc::new(limiter));
//! # let _ = layer;
//! ```

mod answer;
mod batch;
mod buffers;
mod lanes;
mod layer;
mod limiter;
mod plan;

pub use answer::{
    COST_EXCEEDS_LIMIT, EDGE_BODY, JSONRPC_RATE_LIMITED, RATELIMIT, RATELIMIT_POLICY,
    RateLimitValue, X_RATELIMIT_LIMIT, X_RATELIMIT_REMAINING, X_RATELIMIT_RESET, X_SLUICE_COST,
    X_SLUICE_EXHAUSTED, X_SLUICE_USER, X_SLUICE_WORKSPACE, body_too_slow, body_unreadable,
    buffers_full, envelope_response, for_each_rate_limit_header, for_each_upstream_header,
    is_sluice_signal, jsonrpc_refusal, limiter_unavailable, parse_cost, payload_too_large,
    rate_limit_headers, refusal, refusal_wait, retry_after_secs, rfc3339, take_cost,
    upstream_headers, upstream_timed_out,
};
pub use batch::{
    BadBatch, BatchSubmit, BatchTool, BatchToolCall, MAX_IDEMPOTENCY_KEY, batch_tool_call,
    may_call_batch_tool, parse_batch,
};
pub use buffers::{BODY_DEADLINE, BufferBudget, BufferLease, DEFAULT_MAX_BUFFERED_BYTES};
pub use lanes::{
    LaneCall, LanePlace, lane_config, lane_refusal, lane_status, ledger_outage, publish_lane_gauges,
};
pub use layer::{PeerAddr, PeerFn, SluiceBody, SluiceLayer, SluiceService, UpstreamTimeout};
pub use limiter::{
    Admitted, ClassTally, DECISION_SECONDS_BUCKETS, FALLBACK_MAX_KEYS, Limiter, QuotaQueryError,
    QuotaUsage, Refused, TOP_CALLERS_TRACKED, Tally, check_head,
};
pub use plan::{BudgetKind, Passed, Plan, Scopes};
