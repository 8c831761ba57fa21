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
    /// The per-IP ceilings by name: which requests each counts (its limit is the
    /// profile's `ip_ceilings.<name>`). None: no ceiling per IP.
    #[serde(default)]
    pub ceilings: BTreeMap<String, RawCeiling>,
    /// Who a request is from.
    #[serde(default)]
    pub identity: RawIdentity,
    /// Extra named buckets that routes refer to.
    #[serde(default)]
    pub buckets: BTreeMap<String, RawBucket>,
    /// Monthly quota families per workspace, that routes and tools name.
    #[serde(default)]
    pub quotas: BTreeMap<String, RawQuota>,
    /// Token budgets by name, that LLM routes name (SPEC T1).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub tokens: BTreeMap<String, RawTokens>,
    /// Model prices in USD per million tokens, first match wins (SPEC T4).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub prices: Vec<RawPrice>,
    /// Money budgets by name, that LLM routes name (SPEC T4).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub spend: BTreeMap<String, RawSpend>,
    /// Turn budgets of agent runs on LLM routes and MCP tool calls (SPEC T7);
    /// absent: the built-in tiers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub turns: Option<RawTurns>,
    /// Descriptor rules for Envoy's rate-limit service, each a domain in the
    /// configuration format of envoyproxy/ratelimit (read as it is: see
    /// [`crate::domains`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub domains: Vec<serde_json::Value>,
    /// Guarded lanes by name.
    #[serde(default)]
    pub lanes: BTreeMap<String, RawLane>,
    /// The route table, first match wins.
    #[serde(default)]
    pub routes: Vec<RawRoute>,
    /// The class of a request no route matches; unset, the class of a last route
    /// with no method and no path.
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
    /// ceilings, by name (a class or a ceiling).
    #[serde(default)]
    pub modes: BTreeMap<String, String>,
    /// True: every budget is in shadow mode (decided and counted, never refusing).
    #[serde(default)]
    pub dry_run: bool,
    /// The share of its limit past which an admitted decision leaves a budget
    /// near its limit, counted per budget (SPEC O2; default 0.8).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub near_limit_ratio: Option<serde_json::Number>,
    /// Webhooks told when a workspace's budget passes shares of its limit
    /// (SPEC O3).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub alerts: Vec<RawAlert>,
    /// How the class budgets and the per-IP ceilings count, by name (a class or a
    /// ceiling); those not named are `fixed`.
    #[serde(default)]
    pub algorithms: BTreeMap<String, RawAlgorithm>,
    /// Named sets of overrides of the profile's limits (`free`, `pro`, …); a
    /// workspace on no plan is on `default` when the policy has one.
    #[serde(default)]
    pub plans: BTreeMap<String, RawPlan>,
    /// Workspaces by name: the plan each is on (the starting set of the tenants the
    /// admin API changes at run time).
    #[serde(default)]
    pub workspaces: BTreeMap<String, RawWorkspace>,
}

/// One webhook of `alerts:` (SPEC O3).
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawAlert {
    /// Where events are POSTed (`http://` or `https://`).
    pub url: Option<String>,
    /// Shares of a budget's limit (above 0, at most 1) whose passing is an event.
    #[serde(default)]
    pub at: Vec<serde_json::Number>,
    /// The quota families, token budgets and money budgets watched, by name.
    #[serde(default)]
    pub budgets: Vec<String>,
    /// A file holding the secret the events are signed with (HMAC-SHA256).
    pub secret_file: Option<String>,
    /// How long a delivery may take, in milliseconds (default 5,000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    /// The first wait before a delivery is tried again, in milliseconds (default
    /// 1,000; doubled after each failure).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_ms: Option<u64>,
    /// The longest wait between two tries, in milliseconds (default 300,000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_retry_ms: Option<u64>,
}

/// A plan: limits that replace the profile's for the workspaces on it. What it does
/// not name comes from the profile.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawPlan {
    /// Per-caller limit per window, by class.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub classes: BTreeMap<String, u32>,
    /// Per-IP limit per window, by ceiling (for requests of the plan's workspaces).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub ip_ceilings: BTreeMap<String, u32>,
    /// Limit per window, by bucket.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub buckets: BTreeMap<String, u32>,
    /// Limit per window or month, by token budget.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub tokens: BTreeMap<String, u32>,
    /// Turns of a run, by depth tier (`turns.tiers`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub turns: BTreeMap<String, u32>,
    /// US dollars per calendar month, by money budget (`spend:`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub spend: BTreeMap<String, serde_json::Number>,
    /// Calls per calendar month, by quota family.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub quotas: BTreeMap<String, u32>,
    /// A lane's per-workspace limits, by lane (the lane's own where unset).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub lanes: BTreeMap<String, RawPlanLane>,
    /// `enforce` (default) or `shadow`: the budgets whose limits the plan sets are
    /// decided and counted at those limits, and never refuse.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
}

/// A plan's per-workspace limits of one lane.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawPlanLane {
    /// Calls of one workspace running at once.
    pub workspace_in_flight: Option<u32>,
    /// Calls of one workspace started in the lane's `starts_window_seconds`.
    pub workspace_starts: Option<u32>,
}

/// One workspace of the tenant table.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawWorkspace {
    /// The plan it is on; absent: `default`.
    pub plan: Option<String>,
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
    /// `exact` (default) or `leased` (SPEC D4): decided on the shared store every
    /// time, or from leases a replica takes of it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub consistency: Option<String>,
    /// `leased` only: the most units one replica takes at once, 1 to the limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease: Option<u32>,
    /// `leased` only: the longest a lease lives, in milliseconds (1 to 1000 and at
    /// most the window; default 1000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_ms: Option<u32>,
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
    /// Per-caller limit of each class per window, cheapest class first: the
    /// classes of the policy are the ones named here, in this order.
    pub classes: RawClassLimits,
    /// Per-IP limit of each ceiling (of `ceilings:`) per window.
    #[serde(default)]
    pub ip_ceilings: BTreeMap<String, u32>,
}

/// Class name → limit, in the order written (a map whose order is kept: a class's
/// place is its rank, cheapest first).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RawClassLimits(pub Vec<(String, u32)>);

impl RawClassLimits {
    /// The limit of the class named `name`, if the profile names it.
    pub fn get(&self, name: &str) -> Option<u32> {
        self.0.iter().find(|(n, _)| n == name).map(|(_, l)| *l)
    }

    /// Sets the limit of `name`, adding it last when it is new.
    pub fn set(&mut self, name: &str, limit: u32) {
        match self.0.iter_mut().find(|(n, _)| n == name) {
            Some(entry) => entry.1 = limit,
            None => self.0.push((name.to_owned(), limit)),
        }
    }
}

impl Serialize for RawClassLimits {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = serializer.serialize_map(Some(self.0.len()))?;
        for (name, limit) in &self.0 {
            map.serialize_entry(name, limit)?;
        }
        map.end()
    }
}

impl<'de> Deserialize<'de> for RawClassLimits {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Ordered;
        impl<'de> serde::de::Visitor<'de> for Ordered {
            type Value = RawClassLimits;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a map of class name to limit per window")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<RawClassLimits, A::Error> {
                let mut limits: Vec<(String, u32)> = Vec::new();
                while let Some((name, limit)) = map.next_entry::<String, u32>()? {
                    if limits.iter().any(|(n, _)| *n == name) {
                        return Err(serde::de::Error::custom(format!(
                            "class {name:?} is named twice"
                        )));
                    }
                    // The bound is checked with a key path by the validator; this
                    // one only keeps a hostile file from growing the list.
                    if limits.len() > 4 * crate::MAX_CLASSES {
                        return Err(serde::de::Error::custom("far too many classes"));
                    }
                    limits.push((name, limit));
                }
                Ok(RawClassLimits(limits))
            }
        }
        deserializer.deserialize_map(Ordered)
    }
}

/// A per-IP ceiling: the classes it is over.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawCeiling {
    /// The classes it is over.
    pub classes: Vec<String>,
    /// `false` (default): it counts a request holding any call of those classes;
    /// `true`: a request holding only calls of those classes.
    #[serde(default)]
    pub only: bool,
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
    /// The plan of its workspace (every key of one workspace names the same plan,
    /// or none; `workspaces:` may say it instead).
    pub plan: Option<String>,
}

/// Header names set by a trusted auth layer.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawPrincipalHeaders {
    /// Header carrying the workspace id.
    pub workspace: String,
    /// Header carrying the user id.
    pub user: String,
    /// Header carrying the plan of the workspace (a plan under `plans:`), if the
    /// auth layer says it.
    pub plan: Option<String>,
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
    /// `exact` (default) or `leased` (SPEC D4), as for a class.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub consistency: Option<String>,
    /// `leased` only: the most units one replica takes at once, 1 to the limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease: Option<u32>,
    /// `leased` only: the longest a lease lives, in milliseconds (default 1000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_ms: Option<u32>,
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
    /// `exact` only (SPEC D4: monthly quotas stay exact); read so that `leased`
    /// is refused with its key path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub consistency: Option<String>,
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
    /// The LLM wire format the route speaks: `openai` or `anthropic`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub llm: Option<String>,
    /// Token budgets a call of this route spends (it needs `llm:`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tokens: Vec<String>,
    /// Money budgets a call of this route spends (it needs `llm:`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub spend: Vec<String>,
}

/// A model's price (SPEC T4).
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawPrice {
    /// The model's name, or a prefix ending in `*`.
    pub model: String,
    /// USD per million input tokens.
    pub input: serde_json::Number,
    /// USD per million output tokens.
    pub output: serde_json::Number,
    /// USD per million cached input tokens (default: `input`).
    pub cached_input: Option<serde_json::Number>,
}

/// A money budget (SPEC T4).
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawSpend {
    /// Whose budget: `caller`, `user` or `workspace`.
    pub per: String,
    /// US dollars per calendar month.
    pub limit_usd: serde_json::Number,
    /// Counted per calendar month (UTC): the only period of a money budget.
    #[serde(default)]
    pub monthly: bool,
    /// Output tokens reserved for a call that names none (default 4096).
    pub default_max_output: Option<u32>,
    /// `enforce` (default) or `shadow`.
    pub mode: Option<String>,
    /// `exact` only (SPEC D4: money stays exact); read so that `leased` is refused
    /// with its key path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub consistency: Option<String>,
}

/// `turns:`, the turn budgets of agent runs (SPEC T7); what it leaves out is
/// built in.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawTurns {
    /// Turns of a run by depth tier, over the built-in `quick: 10`,
    /// `standard: 50` and `deep: 75`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub tiers: BTreeMap<String, u32>,
    /// The tier of a run whose calls name none (default `standard`).
    pub default_tier: Option<String>,
    /// Seconds without a turn or a change after which a run is forgotten
    /// (default 86,400: a day).
    pub idle_seconds: Option<u32>,
    /// The most turns one `continue` may grant (default 1,000).
    pub max_grant: Option<u32>,
    /// The most turns a run may be granted in all (default 10,000).
    pub max_granted: Option<u32>,
    /// Runs one caller may start per `idle_seconds` (default 1,000).
    pub runs_per_caller: Option<u32>,
    /// The path under which the gateway answers `GET <path>/<run>` and `POST
    /// <path>/<run>/continue|finish` (default `/runs`).
    pub endpoints: Option<String>,
    /// True: on a JSON-RPC route, an MCP `tools/call` with no run header is a
    /// turn of the run its `Mcp-Session-Id` names.
    pub mcp_session: Option<bool>,
}

/// One token budget (SPEC T1).
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawTokens {
    /// Whose budget: `ip`, `caller`, `user` or `workspace`.
    pub per: String,
    /// Units (weighed tokens) per window or month.
    pub limit: u32,
    /// Window length in seconds (or `monthly: true`).
    pub window_seconds: Option<u32>,
    /// Counted per calendar month (UTC), durably.
    #[serde(default)]
    pub monthly: bool,
    /// Units per input, output and cached input token (default 1, 1, 1).
    #[serde(default)]
    pub weights: RawTokenWeights,
    /// Output tokens reserved for a call that names none (default 4096).
    pub default_max_output: Option<u32>,
    /// `enforce` (default) or `shadow`.
    pub mode: Option<String>,
    /// `exact` only (SPEC D4: a token budget is reserved and settled on the
    /// store); read so that `leased` is refused with its key path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub consistency: Option<String>,
}

/// The weights of a token budget.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawTokenWeights {
    /// Per input token (default 1).
    pub input: Option<serde_json::Number>,
    /// Per output token (default 1).
    pub output: Option<serde_json::Number>,
    /// Per cached input token (default: the input weight).
    pub cached_input: Option<serde_json::Number>,
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
    /// The names clients see for the lane's own refusals (default
    /// `<lane>_busy` and `<lane>_unavailable`).
    #[serde(default)]
    pub reasons: RawLaneReasons,
}

/// The names clients see for a lane's own refusals.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawLaneReasons {
    /// Every place of the global cap is taken (`<lane>_busy`).
    pub busy: Option<String>,
    /// The breaker is open (`<lane>_unavailable`).
    pub unavailable: Option<String>,
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
    /// `insensitive` (the default: `/CHATS` matches the route `/chats`, as Express
    /// routes it) or `sensitive`.
    pub case: Option<RawPathCase>,
}

/// `paths.case`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RawPathCase {
    /// Literal segments match letters of either case.
    Insensitive,
    /// Literal segments match byte for byte.
    Sensitive,
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
