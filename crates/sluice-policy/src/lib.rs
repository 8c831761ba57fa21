//! sluice's policy: a YAML file → [`RawPolicy`] (serde) → [`validate`] →
//! [`Policy`] (typed, checked), and the classification of requests against
//! it: routes, JSON-RPC bodies, callers and client IPs.
//!
//! ```
//! use http::Method;
//! use sluice_policy::{default_policy, RouteClass};
//!
//! let policy = default_policy().unwrap();
//! // Classes are the policy's: the built-in one names four.
//! let expensive = policy.class("expensive").unwrap();
//! let protocol = policy.class("protocol").unwrap();
//! assert_eq!(policy.profile.limit(expensive).get(), 30);
//! let route = policy.route(&Method::POST, "/chats").unwrap();
//! assert_eq!(route.class, RouteClass::Fixed(expensive));
//! let body = br#"[{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"start_chat"}},
//!                 {"jsonrpc":"2.0","id":2,"method":"ping"}]"#;
//! let items = policy.jsonrpc.classify(body, &policy.bounds).unwrap();
//! assert_eq!((items.count(expensive), items.count(protocol)), (1, 1));
//! // What cannot be counted is refused, never counted as something cheaper.
//! assert!(policy.jsonrpc.classify(b"[]", &policy.bounds).is_err());
//! // Paths are matched in their normal form.
//! assert_eq!(policy.paths.normalize("//x/../%63hats").unwrap(), "/chats");
//! ```

mod builder;
mod cookie;
mod default;
mod describe;
pub mod domains;
mod identity;
pub mod json;
mod jsonrpc;
mod model;
mod path;
mod pattern;
pub mod raw;
mod tenants;
mod validate;
mod warnings;

pub use builder::PolicyBuilder;
pub use default::DEFAULT_POLICY_YAML;
#[cfg(feature = "yaml")]
pub use default::default_policy;
pub use identity::{
    AmbiguousCredentials, Caller, CallerKind, ClientIp, Label, NETWORK_PREFIX_V4,
    NETWORK_PREFIX_V6, Who, retain_cookies, workspace_digest,
};
pub use jsonrpc::{Items, Unclassifiable, check_content_encoding, depth_exceeds};
pub use model::{Alert, MAX_ALERT_THRESHOLDS, MAX_ALERTS};
pub use model::{
    Algorithm, BatchEndpoint, Bounds, Bucket, Ceiling, Class, ClassSet, Consistency, CostClass,
    CredentialSource, CustomerPlan, Enforcement, Identity, JsonRpc, JsonRpcRefusal, Lane,
    LaneBatch, LaneReasons, LlmFormat, MAX_BUCKETS, MAX_CEILINGS, MAX_CLASSES, MAX_LANES,
    MAX_PLANS, MAX_QUOTA_FAMILIES, MAX_SLIDING_WINDOW_SECONDS, MAX_WORKSPACES,
    METHOD_OVERRIDE_FIELDS, MONEY_UNITS_PER_USD, OnExhausted, Outage, Per, PlanLane, PlanLimit,
    PlanLimits, Policy, Price, Principal, Profile, QuotaFamily, Refusal, Route, RouteClass,
    SLIDING_SLOTS, Spends, StorePolicy, TenantPlan, Tenants, TokenBudget, Tool,
};
pub use model::{
    BUILT_IN_TIERS, DEPTH_HEADER, MAX_RUN_ID, MAX_TIERS, RUN_HEADER, RunEndpoint, Turns, is_run_id,
};
pub use path::{PathCase, PathError, Paths, without_parameters};
pub use pattern::PathPattern;
pub use raw::{RawAlert, RawPolicy};
pub use tenants::{MAX_KEYS, TenantChange, TenantKey, TenantTable, TenantWorkspace};
pub use validate::{
    DEFAULT_MAX_BATCH_ITEMS, DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_JSON_DEPTH,
    DEFAULT_STORE_TIMEOUT_MS, MAX_CLASS_NAME, MAX_JSON_DEPTH, MAX_LANE_STARTS, MAX_ROUTE_BUCKETS,
    PolicyError, Problem, validate,
};
#[cfg(feature = "yaml")]
pub use validate::{load_file, parse_str};
