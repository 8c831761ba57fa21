//! The built-in default policy: the example platform's documented
//! numbers. `examples/policy.yaml` is the same policy with comments; a test
//! proves the two are equal.

#[cfg(feature = "yaml")]
use std::path::Path;

#[cfg(feature = "yaml")]
use crate::model::Policy;
#[cfg(feature = "yaml")]
use crate::validate::{PolicyError, parse_str};

/// The default policy as YAML (compact; the commented copy is `examples/policy.yaml`).
pub const DEFAULT_POLICY_YAML: &str = r#"
profile: production
window_seconds: 60
profiles:
  production:
    classes: { protocol: 600, read: 300, standard: 60, expensive: 30 }
    ip_ceilings: { ip: 300, ip_protocol: 1200 }
  local:
    classes: { protocol: 3000, read: 1500, standard: 500, expensive: 150 }
    ip_ceilings: { ip: 2000, ip_protocol: 6000 }
ceilings:
  ip: { classes: [read, standard, expensive] }
  ip_protocol: { classes: [protocol], only: true }
identity:
  credentials: [x_api_key, bearer, session_cookie]
  session_cookie: session
  trusted_proxies: []
  ipv6_prefix: 64
  keys: []
buckets:
  oauth_register: { limit: 5, window_seconds: 60, per: ip }
  export:
    limit: 5
    window_seconds: 60
    per: user
    refusal: envelope
    message: "Export rate-limited. Try again in {retry_after} seconds."
  warehouse_reads:
    limit: 10
    window_seconds: 60
    per: user
    weighted: true
    refusal: envelope
    message: "Rate limit exceeded. Maximum 10 queries per minute. Try again in {retry_after} seconds."
quotas:
  messages: { monthly: 1000 }
  search: {}
  evals: {}
lanes:
  optimizer:
    workspace_in_flight: 3
    workspace_starts: 12
    starts_window_seconds: 60
    global_in_flight: 20
    batch_reserve: 5
    wait_seconds: 15
    jsonrpc_wait_seconds: 120
    max_waiting: 1000
    timeout_seconds: 180
    breaker: { failures: 5, within_seconds: 60, open_seconds: 30 }
    batch:
      route: /messages/optimize
      max_items: 1000
      backlog: 5000
      keep_hours: 168
      submit_tool: optimize_message_batch
      status_tool: get_batch
routes:
  - { method: GET, path: /mcp, class: protocol }
  - { method: DELETE, path: /mcp, class: protocol }
  - { method: POST, path: /mcp, jsonrpc: true }
  - { method: POST, path: /chats, class: expensive }
  - { method: POST, path: "/routines/{id}/run", class: expensive }
  - { method: POST, path: /messages/optimize, class: expensive, quota: messages, lane: optimizer }
  - { method: POST, path: /messages/optimize/batch, class: expensive }
  - { method: GET, path: "/messages/optimize/batches/{id}", class: read }
  - { method: POST, path: /search/query, class: read, quota: search, buckets: [warehouse_reads] }
  - { method: GET, path: /search/fields, class: read }
  - { method: POST, path: /evals, class: standard, quota: evals }
  - { method: GET, path: "/evals/{id}/export", class: read, buckets: [export] }
  - { method: POST, path: /oauth/register, class: standard, buckets: [oauth_register] }
  - { path: "/oauth/*", class: standard }
  - { path: "/api/mcp/api-keys/*", class: standard }
  - { method: GET, class: read }
default_class: standard
jsonrpc:
  methods:
    protocol:
      - initialize
      - ping
      - notifications/*
      - tools/list
      - resources/list
      - resources/templates/list
      - prompts/list
      - logging/setLevel
  tools:
    optimize_message: { class: expensive, quota: messages, lane: optimizer }
    optimize_message_batch: { class: expensive }
    start_chat: { class: expensive }
    run_routine: { class: expensive }
    search_query: { class: read, quota: search, buckets: [warehouse_reads] }
    search_fields: { class: read }
    get_batch: { class: read }
  retired:
    messages:
      optimize: optimize_message
      optimize_batch: optimize_message_batch
  default_class: standard
  refusal: jsonrpc_error
headers:
  ietf_draft: false
limits:
  max_body_bytes: 1048576
  max_json_depth: 64
  max_batch_items: 1000
paths:
  merge_slashes: true
  case: insensitive
store:
  timeout_ms: 20
  replicas: 1
  outage: { protocol: fail_open, read: fail_open, standard: fail_open, expensive: fail_open }
"#;

/// The built-in default policy (feature `yaml`).
///
/// # Errors
/// Never in a released build (a test parses it); the error type is the
/// loader's.
#[cfg(feature = "yaml")]
pub fn default_policy() -> Result<Policy, PolicyError> {
    parse_str(DEFAULT_POLICY_YAML, Path::new("<built-in default policy>"))
}
