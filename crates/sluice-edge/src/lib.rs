//! sluice's edge engine, free of any transport: everything between a request's
//! head and the answer a rate limiter gives it, for any server that can hand it
//! a method, a path, headers, a peer address and (for a JSON-RPC route) a body.
//!
//! One [`Limiter`] holds a validated [`Policy`](sluice_policy::Policy) and a
//! [`BudgetStore`](sluice_store::BudgetStore). A request goes through it in
//! phases, the same for every transport (sluice's HTTP/1.1 fast path, its hyper
//! path and the tower layer of `sluice-tower`, forward auth):
//!
//! 1. **head checked**: [`Limiter::route_head`] — [`check_head`] (method, `Host`
//!    fields), the path's normal form, the route — in one refusal order;
//! 2. **body read**: an [`Intake`] takes the head's outcome and, when the route
//!    takes its class from the body (JSON-RPC, batch submits), the body, within
//!    [`Bounds`](sluice_policy::Bounds), the [`BufferBudget`] and the body
//!    deadline; a refused head is answered before anything of the body is read;
//! 3. **planned**: [`Intake::planned`] names every budget the request touches
//!    (its class, per-IP ceilings, buckets, monthly quotas, its lane);
//! 4. **admitted**: [`Planned::admit`] waits for a lane place where one is
//!    needed, then decides every budget at once — all or nothing, a refusal spends
//!    nothing — and returns a [`Forward`] or the answer to send instead;
//! 5. **upstream head** and **response head**: [`Forward`] says who the request
//!    is from, settles what a weighted call reported ([`take_cost`]), and writes
//!    `X-RateLimit-*` ([`rate_limit_headers`]) for the budget it was counted in;
//! 6. **logged**: refusals are logged once each ([`RefusalLog`]), and every
//!    decision is counted for `/metrics` and [`Limiter::tally`].
//!
//! Every refusal is rendered to a response in one place ([`Limiter::answer`],
//! through [`Refused::response`] and [`answer`]'s functions), so every transport
//! answers alike. Envoy's rate-limit service decides descriptors, not requests:
//! [`descriptors`] shares the decision and the shadow rule with the phases.
//!
//! ```
//! use std::net::IpAddr;
//! use http::{Method, Version};
//! use sluice_edge::Limiter;
//! use sluice_policy::default_policy;
//! use sluice_store::{MemoryConfig, MemoryStore};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let limiter = Limiter::new(default_policy().unwrap(), MemoryStore::new(MemoryConfig::default()));
//! let peer: IpAddr = [203, 0, 113, 7].into();
//! let request = http::Request::post("/chats").header("x-api-key", "k").body(()).unwrap();
//! let (parts, ()) = request.into_parts();
//! let hosts = [b"api.example".as_slice()];
//! let call = || async {
//!     let route = limiter.route_head(&Method::POST, Version::HTTP_2, hosts, Ok("/chats"), None);
//!     let intake = limiter.intake(route, peer);
//!     intake.planned(&parts.headers, None, None).admit(None).await
//! };
//!
//! // The default policy's `expensive` class: 30 calls a minute per API key.
//! for remaining in (0..30).rev() {
//!     let admitted = call().await.unwrap();
//!     assert_eq!(admitted.decision().binding().map(|b| b.remaining), Some(remaining));
//! }
//! let refused = call().await.err().unwrap();
//! assert_eq!(refused.status(), 429);
//! assert!(refused.headers().contains_key("retry-after"));
//! # }
//! ```

mod alerts;
pub mod answer;
mod batch;
mod buffers;
pub mod descriptors;
pub mod dialect;
pub mod exchange;
pub mod forward_auth;
mod hangup;
mod head;
mod intake;
mod lanes;
pub mod latency;
pub use latency::DECISION_SECONDS_BUCKETS;
mod limiter;
mod plan;
mod refusal_log;
mod request_id;
mod runs;
pub mod tokens;
pub mod trace;

pub use alerts::{AlertEvent, AlertSink};
pub use answer::{
    ADMIN_COOKIE_PREFIX, COST_EXCEEDS_LIMIT, EDGE_BODY, JSONRPC_PARSE_ERROR, JSONRPC_RATE_LIMITED,
    RATELIMIT, RATELIMIT_POLICY, RateLimitValue, X_RATELIMIT_LIMIT, X_RATELIMIT_REMAINING,
    X_RATELIMIT_RESET, X_SLUICE_COST, X_SLUICE_EXHAUSTED, X_SLUICE_USER, X_SLUICE_WORKSPACE,
    body_too_slow, body_unreadable, buffers_full, buffers_refusal, carries_admin_cookie,
    envelope_response, for_each_rate_limit_header, for_each_upstream_header, is_sluice_signal,
    is_underscore_spelling, jsonrpc_payload_too_large, jsonrpc_refusal, limiter_unavailable,
    parse_cost, payload_too_large, rate_limit_headers, refusal, refusal_wait,
    request_head_too_large, retry_after_secs, rfc3339, take_cost, upstream_headers,
    upstream_timed_out,
};
pub use batch::{
    BadBatch, BatchSubmit, BatchTool, BatchToolCall, MAX_IDEMPOTENCY_KEY, batch_tool_call,
    may_call_batch_tool, parse_batch,
};
pub use buffers::{
    BODY_DEADLINE, BufferBudget, BufferFull, BufferLease, DEFAULT_BUFFERED_SHARE,
    DEFAULT_MAX_BUFFERED_BYTES, Holder, MAX_HOLDERS, PIECE_BYTES, READ_BUFFER_ALLOWANCE,
};
pub use exchange::{BodyRead, Forward, Planned, QuotaRefusal, QuotaSpent, RefusedUnlessRepeat};
pub use hangup::{Hangup, HangupSender, UploadEnded};
pub use intake::{BodyFailure, Intake};
pub use lanes::{
    LaneCall, LanePlace, LaneStatus, LaneWorkspace, lane_config, lane_refusal, lane_status,
    ledger_outage, publish_lane_gauges,
};
/// Leased budgets (SPEC D4): what this replica's leases did, and their bounds.
pub use limiter::{ASK_WAIT, LeaseTally, MAX_LEASED_KEYS, SWEEP_EVERY};
pub use limiter::{
    BucketLimit, ClassTally, DomainRuleStatus, DomainStatus, FALLBACK_MAX_KEYS, Limiter,
    PlanStatus, QuotaQueryError, QuotaUsage, Reason, Refusal, Refused, ReloadRefused,
    SharedLimiter, Status, TOP_CALLERS_TRACKED, Tally, TopCaller, USAGE_MONTHS_KEPT, UsageMonth,
    UsageMonthError, check_head,
};
/// The usage export for billing (SPEC O4) and its bounds.
pub use limiter::{EXPORT_PAGE, KNOWN_ROWS, MAX_USAGE_ROWS, OVERFLOW_ROWS, UNNAMED, UsageExport};
/// The head checks and bounds every HTTP/1.1 transport shares.
pub use limiter::{MAX_REQUEST_HEAD_BYTES, check_transfer_coding, request_head_len};
pub use plan::{BudgetKind, Passed, Plan, Scopes};
pub use refusal_log::{DEFAULT_REFUSAL_LOG_PER_SECOND, RefusalLog};
pub use request_id::{MAX_REQUEST_ID_LEN, RequestId, X_REQUEST_ID};
pub use runs::{BadRun, JSONRPC_TURNS_EXHAUSTED, PlannedRun, SeenRun};

/// arc-swap, whose [`ArcSwap`](arc_swap::ArcSwap) holds a [`SharedLimiter`].
pub use arc_swap;
