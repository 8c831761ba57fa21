//! The policy file as written: serde structs that mirror the YAML one to one.
//! Nothing here is checked beyond its shape; [`crate::validate`] turns a
//! [`RawPolicy`] into a typed [`crate::Policy`].

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The whole policy file.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawPolicy {
    /// Which profile's numbers apply.
    pub profile: Option<String>,
    /// Named sets of limits (`production`, `local`, …).
    #[serde(default)]
    pub profiles: BTreeMap<String, RawProfile>,
    /// Window of the class budgets and IP ceilings, in seconds.
    pub window_seconds: Option<u32>,
    /// Who a request is from.
    #[serde(default)]
    pub identity: RawIdentity,
    /// Extra named buckets that routes refer to.
    #[serde(default)]
    pub buckets: BTreeMap<String, RawBucket>,
    /// Monthly quota families per workspace, that routes and tools name.
    #[serde(default)]
    pub quotas: BTreeMap<String, RawQuota>,
    /// Guarded lanes by name.
    #[serde(default)]
    pub lanes: BTreeMap<String, RawLane>,
    /// The route table, first match wins.
    #[serde(default)]
    pub routes: Vec<RawRoute>,
    /// The class of a request no route matches.
    pub default_class: Option<String>,
    /// JSON-RPC classification.
    #[serde(default)]
    pub jsonrpc: RawJsonRpc,
    /// What the client is told.
    #[serde(default)]
    pub headers: RawHeaders,
    /// Bounds on what a request may make sluice read.
    #[serde(default)]
    pub limits: RawLimits,
    /// How request paths are normalised before they are matched and forwarded.
    #[serde(default)]
    pub paths: RawPaths,
    /// How the shared store is used, and what happens when it is down.
    #[serde(default)]
    pub store: RawStore,
    /// `enforce` (default) or `shadow` for the class budgets and the per-IP
    /// ceilings, by name (a class, `ip` or `ip_protocol`).
    #[serde(default)]
    pub modes: BTreeMap<String, String>,
    /// True: every budget is in shadow mode (decided and counted, never refusing).
    #[serde(default)]
    pub dry_run: bool,
    /// How the class budgets and the per-IP ceilings count, by name (a class, `ip`
    /// or `ip_protocol`); those not named are `fixed`.
    #[serde(default)]
    pub algorithms: BTreeMap<String, RawAlgorithm>,
}

/// How one budget counts: `algorithm: fixed | sliding | gcra` (default `fixed`) and,
/// for `gcra`, `burst: N` (default: the limit).
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawAlgorithm {
    /// `fixed` (default), `sliding` or `gcra`.
    pub algorithm: Option<String>,
    /// `gcra` only: how many units may go at once, 1 to the limit.
    pub burst: Option<u32>,
}

/// The shared store's settings.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawStore {
    /// The longest one decision may wait for the store, in milliseconds.
    pub timeout_ms: Option<u64>,
    /// How many replicas share the store: while it is down, a fail-open class
    /// is decided locally with limit ÷ replicas.
    pub replicas: Option<u32>,
    /// Per class: `fail_open` or `fail_closed`.
    #[serde(default)]
    pub outage: BTreeMap<String, String>,
}

/// One profile's numbers.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawProfile {
    /// Per-caller limit of each class per window.
    pub classes: RawClasses,
    /// Per-IP ceilings per window.
    pub ip_ceilings: RawCeilings,
}

/// The four classes' limits.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawClasses {
    /// Session traffic (initialize, ping, listing).
    pub protocol: u32,
    /// Reads.
    pub read: u32,
    /// Everything else.
    pub standard: u32,
    /// Costly calls.
    pub expensive: u32,
}

/// The per-IP ceilings.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawCeilings {
    /// Requests holding any read, standard or expensive call.
    pub work: u32,
    /// Requests holding only protocol calls.
    pub protocol_only: u32,
}

/// Identity settings.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawIdentity {
    /// Credential sources in order: `x_api_key`, `bearer`, `session_cookie`.
    pub credentials: Option<Vec<String>>,
    /// The one source counted when a request sends several kinds (one of
    /// `credentials`); the others are stripped before forwarding. Unset: such a
    /// request is refused as ambiguous.
    pub counted_credential: Option<String>,
    /// The console session cookie's name.
    pub session_cookie: Option<String>,
    /// CIDRs of proxies whose `X-Forwarded-For` is believed.
    #[serde(default)]
    pub trusted_proxies: Vec<String>,
    /// IPv6 callers are grouped by this prefix length for IP budgets.
    pub ipv6_prefix: Option<u8>,
    /// Known credentials: sha256 of the secret → workspace and user.
    #[serde(default)]
    pub keys: Vec<RawKey>,
    /// Headers an auth layer in front sets (believed only from trusted proxies).
    pub principal_headers: Option<RawPrincipalHeaders>,
}

/// One known credential.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawKey {
    /// Lower-case hex SHA-256 of the secret (the secret itself never appears).
    pub sha256: String,
    /// The workspace it belongs to.
    pub workspace: String,
    /// The user it belongs to.
    pub user: String,
}

/// Header names set by a trusted auth layer.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawPrincipalHeaders {
    /// Header carrying the workspace id.
    pub workspace: String,
    /// Header carrying the user id.
    pub user: String,
}

/// An extra bucket.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawBucket {
    /// Requests per window.
    pub limit: u32,
    /// Window length in seconds.
    pub window_seconds: u32,
    /// Whose bucket: `ip`, `caller`, `user` or `workspace`.
    pub per: String,
    /// How a refusal looks: `edge` (the plain-text 429) or `envelope` (JSON).
    pub refusal: Option<String>,
    /// The envelope's message; `{retry_after}` is replaced by the seconds.
    pub message: Option<String>,
    /// True: the upstream reports what a call spent (`X-Sluice-Cost`).
    #[serde(default)]
    pub weighted: bool,
    /// `refuse` (default) or `pass`: forward with `X-Sluice-Exhausted`.
    pub on_exhausted: Option<String>,
    /// `enforce` (default) or `shadow`: decided and counted, never refusing.
    pub mode: Option<String>,
    /// `fixed` (default), `sliding` or `gcra`.
    pub algorithm: Option<String>,
    /// `gcra` only: how many units may go at once, 1 to `limit` (default `limit`).
    pub burst: Option<u32>,
}

/// One monthly quota family.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawQuota {
    /// Calls per calendar month (UTC) per workspace; absent = uncapped.
    pub monthly: Option<u32>,
    /// `enforce` (default) or `shadow`: decided and counted, never refusing.
    pub mode: Option<String>,
    /// Refused when set: a quota counts calendar months, it takes no algorithm (read
    /// so that the refusal names its key path rather than failing the parse).
    pub algorithm: Option<String>,
}

/// One route.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawRoute {
    /// HTTP method; absent = any.
    pub method: Option<String>,
    /// Path pattern (`/a/{id}/b`, trailing `*` = the rest); absent = any.
    pub path: Option<String>,
    /// Cost class; absent only on JSON-RPC routes.
    pub class: Option<String>,
    /// True: the class comes from the JSON-RPC body.
    #[serde(default)]
    pub jsonrpc: bool,
    /// Extra buckets this route also spends.
    #[serde(default)]
    pub buckets: Vec<String>,
    /// The monthly quota family this route counts against.
    pub quota: Option<String>,
    /// The lane that guards this route's upstream calls.
    pub lane: Option<String>,
    /// `enforce` (default) or `shadow`: every budget a request on this route
    /// spends is decided and counted, and never refuses it.
    pub mode: Option<String>,
}

/// A guarded lane in front of an expensive upstream: how many of its calls may run
/// and start, how long a call waits in line, and when its breaker opens. Every field
/// is optional; the defaults are the built-in policy's.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawLane {
    /// Calls of one workspace running at once (3).
    pub workspace_in_flight: Option<u32>,
    /// Calls of one workspace started in any `starts_window_seconds` (12).
    pub workspace_starts: Option<u32>,
    /// The rolling window of `workspace_starts`, in seconds (60).
    pub starts_window_seconds: Option<u32>,
    /// Calls running at once over every workspace (20).
    pub global_in_flight: Option<u32>,
    /// Places of `global_in_flight` never given to batch items (5).
    pub batch_reserve: Option<u32>,
    /// Longest wait in line of a REST call, in seconds (15).
    pub wait_seconds: Option<u32>,
    /// Longest wait in line of a JSON-RPC tool call, in seconds (120).
    pub jsonrpc_wait_seconds: Option<u32>,
    /// Calls waiting in line at once, past which a call is refused at once (1000).
    pub max_waiting: Option<u32>,
    /// How long a call may take upstream before it is cut and counted a failure, in
    /// seconds (180).
    pub timeout_seconds: Option<u32>,
    /// With a shared store: how long a replica's hold on a place lives without being
    /// renewed, in seconds (10). A running call renews it every third of this; a
    /// replica that dies gives its places back within it.
    pub lease_ttl_seconds: Option<u32>,
    /// The breaker.
    #[serde(default)]
    pub breaker: RawBreaker,
    /// The batch lane: lists of calls run on the capacity single calls leave.
    pub batch: Option<RawLaneBatch>,
}

/// A lane's batch lane.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawLaneBatch {
    /// The single-call route, e.g. `/messages/optimize`: batches are submitted with
    /// `POST <route>/batch`, read with `GET <route>/batches/{id}`, and each item goes
    /// upstream as `POST <route>`.
    pub route: String,
    /// Most items in one batch (1000).
    pub max_items: Option<u32>,
    /// Most unfinished items one workspace may have queued (5000).
    pub backlog: Option<u32>,
    /// Hours a finished batch is kept for status reads (168).
    pub keep_hours: Option<u32>,
    /// The JSON-RPC tool that submits a batch (`arguments: {items, idempotency_key}`).
    pub submit_tool: Option<String>,
    /// The JSON-RPC tool that reads a batch (`arguments: {batch_id}`).
    pub status_tool: Option<String>,
}

/// A lane's circuit breaker.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawBreaker {
    /// Failures in a row that open it (5).
    pub failures: Option<u32>,
    /// Those failures fall within this many seconds (60).
    pub within_seconds: Option<u32>,
    /// Seconds it stays open before one probe decides (30).
    pub open_seconds: Option<u32>,
}

/// JSON-RPC classification rules.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawJsonRpc {
    /// Class → methods (a trailing `*` matches a prefix).
    #[serde(default)]
    pub methods: BTreeMap<String, Vec<String>>,
    /// Tool name → its rule (for `tools/call`).
    #[serde(default)]
    pub tools: BTreeMap<String, RawTool>,
    /// Retired tool name → `arguments.action` → the tool it now is.
    #[serde(default)]
    pub retired: BTreeMap<String, BTreeMap<String, String>>,
    /// The class of anything the rules do not name.
    pub default_class: Option<String>,
    /// How a refused JSON-RPC request is answered: `edge` (the same 429 as any
    /// request) or `jsonrpc_error` (a JSON-RPC error per request id).
    pub refusal: Option<String>,
}

/// One tool's rule.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawTool {
    /// Its cost class.
    pub class: String,
    /// Extra buckets a call of it also spends.
    #[serde(default)]
    pub buckets: Vec<String>,
    /// The monthly quota family a call of it counts against.
    pub quota: Option<String>,
    /// The lane that guards a call of it.
    pub lane: Option<String>,
}

/// Header options.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawHeaders {
    /// Also send the IETF draft-10 `RateLimit` and `RateLimit-Policy` fields.
    #[serde(default)]
    pub ietf_draft: bool,
}

/// Path normalisation.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawPaths {
    /// Merge repeated slashes (`//a` → `/a`) before matching and forwarding
    /// (default true).
    pub merge_slashes: Option<bool>,
}

/// Bounds.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawLimits {
    /// Largest body read for classification (bytes).
    pub max_body_bytes: Option<usize>,
    /// Deepest JSON nesting accepted in a classified body.
    pub max_json_depth: Option<usize>,
    /// Most items in one JSON-RPC batch.
    pub max_batch_items: Option<usize>,
}
