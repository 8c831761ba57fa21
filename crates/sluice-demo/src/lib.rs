//! The built-in demo upstream: what `sluice serve` forwards to when no `--upstream` is
//! given, so every route of the default policy answers something.
//!
//! - `POST /mcp`: a minimal MCP server (JSON-RPC 2.0, Streamable HTTP transport, JSON
//!   responses): `initialize`, `ping`, `tools/list`, `tools/call`, the empty
//!   `resources/*` and `prompts/list`, `logging/setLevel`; notifications → 202.
//! - `GET /mcp`: a server-sent event stream with a heartbeat comment every 15 s;
//!   `DELETE /mcp` → 200 (end of session).
//! - `GET /demo/sse?n=3&interval_ms=50`: `n` events `interval_ms` apart.
//! - `GET /demo/slow?ms=500`: answers after `ms` milliseconds.
//! - `POST /messages/optimize` (and the `optimize_message` tool): a slow optimizer
//!   that can be told to fail, for the lane in front of it (see [`optimizer`]).
//! - `POST /search/query`: a warehouse that reports each query's cost in
//!   `X-Sluice-Cost` (see `warehouse`).
//! - anything else: 200 JSON echo of method, path, query, headers and JSON body.
//!
//! A request body past [`MAX_BODY_BYTES`] is answered 413, once all of it has been
//! read (and dropped): answering first and closing with the rest unread makes the
//! kernel reset the connection, and the reset can destroy the 413 before the gateway
//! has read it — the client then got a 502 (nginx's lingering close, made simple).

pub mod optimizer;
mod warehouse;

use std::collections::BTreeMap;
use std::hash::{BuildHasher as _, Hasher as _};
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Body;
use axum::extract::Query;
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Json, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// The MCP protocol versions the demo speaks, newest first. `initialize` answers
/// with the client's version when it is one of these, else with the newest.
pub const PROTOCOL_VERSIONS: [&str; 4] = ["2025-11-25", "2025-06-18", "2025-03-26", "2024-11-05"];

/// Time between heartbeats on `GET /mcp`.
pub const HEARTBEAT_INTERVAL: Duration = Duration::from_secs(15);

/// Heartbeats sent before `GET /mcp` ends its stream (an hour).
pub const MAX_HEARTBEATS: u32 = 240;

/// Largest `n` of `/demo/sse`.
pub const MAX_SSE_EVENTS: u32 = 100;

/// Largest `interval_ms` of `/demo/sse`.
pub const MAX_SSE_INTERVAL_MS: u64 = 5_000;

/// Largest `ms` of `/demo/slow`.
pub const MAX_SLOW_MS: u64 = 60_000;

/// The tools `tools/list` names: (name, description, input schema properties, required).
const TOOLS: &[(&str, &str, &[&str])] = &[
    (
        "optimize_message",
        "Optimize one message (expensive, guarded lane).",
        &["message"],
    ),
    (
        "optimize_message_batch",
        "Submit a batch of messages to optimize (batch lane).",
        &["messages"],
    ),
    ("start_chat", "Start a chat.", &["prompt"]),
    ("run_routine", "Run a routine.", &["routine_id"]),
    (
        "search_query",
        "Run a warehouse search query (weighted budget).",
        &["query"],
    ),
    ("search_fields", "List searchable fields.", &[]),
    ("get_batch", "Read a batch's progress.", &["batch_id"]),
    (
        "messages",
        "Retired: use optimize_message / optimize_message_batch. Dispatches on `action`.",
        &["action"],
    ),
];

/// The running demo upstream.
#[derive(Debug)]
pub struct Demo {
    addr: SocketAddr,
    task: JoinHandle<()>,
}

impl Demo {
    /// Where it listens (a loopback address).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Waits for the server to finish (after its stop signal fired).
    pub async fn join(self) {
        let _ = self.task.await;
    }
}

/// Starts the demo upstream on a free loopback port; it runs until `stop` resolves and
/// its open connections close.
///
/// # Errors
/// The loopback listener cannot be bound.
pub async fn start(
    optimizer: Arc<optimizer::Optimizer>,
    stop: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<Demo> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await?;
    let addr = listener.local_addr()?;
    let task = tokio::spawn(async move {
        if let Err(error) = axum::serve(listener, router(optimizer))
            .with_graceful_shutdown(stop)
            .await
        {
            tracing::warn!("demo upstream failed: {error}");
        }
    });
    Ok(Demo { addr, task })
}

/// Largest request body the demo takes (axum's default limit for a buffered body).
pub const MAX_BODY_BYTES: usize = 2 * 1024 * 1024;

/// The demo's routes.
pub fn router(optimizer: Arc<optimizer::Optimizer>) -> Router {
    Router::new()
        .route("/mcp", get(mcp_stream).post(mcp_post).delete(mcp_delete))
        .route("/messages/optimize", post(optimizer::optimize))
        .route(
            "/demo/optimizer",
            get(optimizer::stats).post(optimizer::settings),
        )
        .route("/demo/sse", get(sse))
        .route("/demo/slow", get(slow))
        .route("/search/query", post(warehouse::search_query))
        .fallback(echo)
        .with_state(optimizer)
        // The bound is the middleware's: it has read every body it passes on.
        .layer(axum::extract::DefaultBodyLimit::disable())
        .layer(axum::middleware::from_fn(read_whole_body))
}

/// Reads the whole request body before the route sees it: up to [`MAX_BODY_BYTES`]
/// kept, past it the rest read and dropped and the request answered 413, so that the
/// connection is never closed on unread bytes (see the module's documentation).
async fn read_whole_body(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    use http_body_util::BodyExt as _;
    let (parts, mut body) = request.into_parts();
    let mut kept = bytes::BytesMut::new();
    let mut over = false;
    while let Some(frame) = body.frame().await {
        let Ok(frame) = frame else {
            // The client left: no one to answer.
            return StatusCode::BAD_REQUEST.into_response();
        };
        if let Ok(data) = frame.into_data()
            && !over
        {
            if kept.len() + data.len() > MAX_BODY_BYTES {
                over = true;
                kept = bytes::BytesMut::new();
            } else {
                kept.extend_from_slice(&data);
            }
        }
    }
    if over {
        return (
            StatusCode::PAYLOAD_TOO_LARGE,
            Json(json!({
                "error": {
                    "code": "payload_too_large",
                    "message": format!("The demo takes bodies of at most {MAX_BODY_BYTES} bytes."),
                    "details": { "max_bytes": MAX_BODY_BYTES },
                }
            })),
        )
            .into_response();
    }
    next.run(axum::extract::Request::from_parts(
        parts,
        Body::from(kept.freeze()),
    ))
    .await
}

// ---------------------------------------------------------------------------------------
// REST echo

async fn echo(method: Method, uri: Uri, headers: HeaderMap, body: Bytes) -> Json<Value> {
    let mut received: BTreeMap<String, String> = BTreeMap::new();
    for (name, value) in &headers {
        let value = String::from_utf8_lossy(value.as_bytes()).into_owned();
        received
            .entry(name.as_str().to_owned())
            .and_modify(|joined| {
                joined.push_str(", ");
                joined.push_str(&value);
            })
            .or_insert(value);
    }
    let body = serde_json::from_slice::<Value>(&body).unwrap_or(Value::Null);
    Json(json!({
        "ok": true,
        "method": method.as_str(),
        "path": uri.path(),
        "query": uri.query(),
        "headers": received,
        "body": body,
    }))
}

// ---------------------------------------------------------------------------------------
// Streams and delays for tests and demos

#[derive(Debug, Deserialize)]
struct SseParams {
    n: Option<u32>,
    interval_ms: Option<u64>,
}

fn unix_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis())
}

fn event_stream(body: Body) -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

/// `n` events (`id`, `event: tick`, `data: {"seq","of","sent_unix_ms"}`), the first at
/// once, the rest `interval_ms` apart.
async fn sse(Query(params): Query<SseParams>) -> Response {
    let n = params.n.unwrap_or(3).min(MAX_SSE_EVENTS);
    let interval = Duration::from_millis(params.interval_ms.unwrap_or(50).min(MAX_SSE_INTERVAL_MS));
    let stream = futures_util::stream::unfold(0u32, move |seq| async move {
        if seq >= n {
            return None;
        }
        if seq > 0 {
            tokio::time::sleep(interval).await;
        }
        let data = json!({ "seq": seq, "of": n, "sent_unix_ms": unix_ms() });
        let event = format!("id: {seq}\nevent: tick\ndata: {data}\n\n");
        Some((
            Ok::<_, std::convert::Infallible>(Bytes::from(event)),
            seq + 1,
        ))
    });
    event_stream(Body::from_stream(stream))
}

#[derive(Debug, Deserialize)]
struct SlowParams {
    ms: Option<u64>,
}

/// Answers 200 JSON after `ms` milliseconds (at most [`MAX_SLOW_MS`]).
async fn slow(Query(params): Query<SlowParams>) -> Json<Value> {
    let ms = params.ms.unwrap_or(1_000).min(MAX_SLOW_MS);
    tokio::time::sleep(Duration::from_millis(ms)).await;
    Json(json!({ "ok": true, "slept_ms": ms }))
}

// ---------------------------------------------------------------------------------------
// MCP (Streamable HTTP, JSON responses)

/// `GET /mcp`: an open comment line at once, then a heartbeat comment every
/// [`HEARTBEAT_INTERVAL`], at most [`MAX_HEARTBEATS`] of them.
async fn mcp_stream() -> Response {
    let stream = futures_util::stream::unfold(0u32, |sent| async move {
        let chunk = if sent == 0 {
            ": sluice-demo stream open\n\n".to_owned()
        } else if sent <= MAX_HEARTBEATS {
            tokio::time::sleep(HEARTBEAT_INTERVAL).await;
            format!(": heartbeat {sent}\n\n")
        } else {
            return None;
        };
        Some((
            Ok::<_, std::convert::Infallible>(Bytes::from(chunk)),
            sent + 1,
        ))
    });
    event_stream(Body::from_stream(stream))
}

/// `DELETE /mcp`: the session ends (the demo keeps no session state).
async fn mcp_delete() -> StatusCode {
    StatusCode::OK
}

async fn mcp_post(
    axum::extract::State(optimizer): axum::extract::State<Arc<optimizer::Optimizer>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let message: Value = match serde_json::from_slice(&body) {
        Ok(message) => message,
        Err(_) => {
            return (
                StatusCode::BAD_REQUEST,
                Json(rpc_error(Value::Null, -32700, "Parse error")),
            )
                .into_response();
        }
    };
    // The optimizer's tool calls take the optimizer's time (all of a batch's at once).
    let optimize_calls = match &message {
        Value::Array(items) => items.iter().filter(|m| is_optimize_call(m)).count(),
        single => usize::from(is_optimize_call(single)),
    };
    if optimize_calls > 0
        && optimizer
            .run(
                &optimizer::workspace_of(&headers),
                u32::try_from(optimize_calls).unwrap_or(u32::MAX),
            )
            .await
            .is_err()
    {
        return optimizer::unavailable();
    }
    let mut new_session = false;
    let reply = match message {
        Value::Array(items) if items.is_empty() => Some(rpc_error(
            Value::Null,
            -32600,
            "Invalid Request: empty batch",
        )),
        Value::Array(items) => {
            let replies: Vec<Value> = items
                .iter()
                .filter_map(|item| handle_message(item, &mut new_session))
                .collect();
            (!replies.is_empty()).then_some(Value::Array(replies))
        }
        single => handle_message(&single, &mut new_session),
    };
    let Some(reply) = reply else {
        return StatusCode::ACCEPTED.into_response();
    };
    let mut response = Json(reply).into_response();
    if new_session && let Ok(id) = HeaderValue::from_str(&session_id()) {
        response.headers_mut().insert("mcp-session-id", id);
    }
    response
}

/// True for a `tools/call` of `optimize_message` (or the retired `messages` tool's
/// `optimize` action).
fn is_optimize_call(message: &Value) -> bool {
    if message.get("method").and_then(Value::as_str) != Some("tools/call") {
        return false;
    }
    let params = message.get("params");
    match params.and_then(|p| p.get("name")).and_then(Value::as_str) {
        Some("optimize_message") => true,
        Some("messages") => {
            params
                .and_then(|p| p.get("arguments"))
                .and_then(|a| a.get("action"))
                .and_then(Value::as_str)
                == Some("optimize")
        }
        _ => false,
    }
}

/// A fresh, hard-to-guess session id (128 bits, hex).
fn session_id() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let count = COUNTER.fetch_add(1, Ordering::Relaxed);
    let mut words = [0u64; 2];
    for (i, word) in words.iter_mut().enumerate() {
        let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
        hasher.write_u64(count);
        hasher.write_usize(i);
        hasher.write_u128(unix_ms());
        *word = hasher.finish();
    }
    format!("{:016x}{:016x}", words[0], words[1])
}

fn rpc_error(id: Value, code: i64, message: &str) -> Value {
    json!({ "jsonrpc": "2.0", "id": id, "error": { "code": code, "message": message } })
}

fn rpc_result(id: Value, result: Value) -> Value {
    json!({ "jsonrpc": "2.0", "id": id, "result": result })
}

/// Answers one JSON-RPC message; `None` for notifications and client responses.
fn handle_message(message: &Value, new_session: &mut bool) -> Option<Value> {
    let Some(object) = message.as_object() else {
        return Some(rpc_error(Value::Null, -32600, "Invalid Request"));
    };
    let id = object.get("id").cloned();
    let Some(method) = object.get("method").and_then(Value::as_str) else {
        if object.contains_key("result") || object.contains_key("error") {
            return None; // a response from the client
        }
        return Some(rpc_error(
            id.unwrap_or(Value::Null),
            -32600,
            "Invalid Request",
        ));
    };
    if object.get("jsonrpc").and_then(Value::as_str) != Some("2.0") {
        return Some(rpc_error(
            id.unwrap_or(Value::Null),
            -32600,
            "Invalid Request: jsonrpc must be \"2.0\"",
        ));
    }
    let id = id?; // a notification: nothing to answer
    let params = object.get("params").cloned().unwrap_or(Value::Null);
    Some(match call_method(method, &params, new_session) {
        Ok(result) => rpc_result(id, result),
        Err((code, message)) => rpc_error(id, code, &message),
    })
}

fn call_method(
    method: &str,
    params: &Value,
    new_session: &mut bool,
) -> Result<Value, (i64, String)> {
    match method {
        "initialize" => {
            *new_session = true;
            let asked = params.get("protocolVersion").and_then(Value::as_str);
            let version = PROTOCOL_VERSIONS
                .iter()
                .find(|v| Some(**v) == asked)
                .unwrap_or(&PROTOCOL_VERSIONS[0]);
            Ok(json!({
                "protocolVersion": version,
                "capabilities": { "tools": {} },
                "serverInfo": { "name": "sluice-demo", "version": env!("CARGO_PKG_VERSION") },
            }))
        }
        "ping" | "logging/setLevel" => Ok(json!({})),
        "tools/list" => Ok(json!({ "tools": tool_list() })),
        "tools/call" => call_tool(params),
        "resources/list" => Ok(json!({ "resources": [] })),
        "resources/templates/list" => Ok(json!({ "resourceTemplates": [] })),
        "prompts/list" => Ok(json!({ "prompts": [] })),
        _ => Err((-32601, format!("Method not found: {method}"))),
    }
}

fn tool_list() -> Vec<Value> {
    TOOLS
        .iter()
        .map(|(name, description, required)| {
            let mut properties = serde_json::Map::new();
            for field in *required {
                let schema = match *field {
                    "messages" => json!({ "type": "array", "items": { "type": "string" } }),
                    "action" => json!({
                        "type": "string",
                        "enum": ["optimize", "optimize_batch"],
                    }),
                    _ => json!({ "type": "string" }),
                };
                properties.insert((*field).to_owned(), schema);
            }
            json!({
                "name": name,
                "description": description,
                "inputSchema": {
                    "type": "object",
                    "properties": properties,
                    "required": required,
                },
            })
        })
        .collect()
}

fn tool_text(text: String, is_error: bool) -> Value {
    json!({ "content": [{ "type": "text", "text": text }], "isError": is_error })
}

fn call_tool(params: &Value) -> Result<Value, (i64, String)> {
    let Some(name) = params.get("name").and_then(Value::as_str) else {
        return Err((-32602, "Invalid params: `name` is required".to_owned()));
    };
    let arguments = params.get("arguments").cloned().unwrap_or(json!({}));
    if name == "messages" {
        let action = arguments.get("action").and_then(Value::as_str);
        let text = match action {
            Some("optimize") => "messages(action=optimize) → optimize_message: done (demo)",
            Some("optimize_batch") => {
                "messages(action=optimize_batch) → optimize_message_batch: accepted (demo)"
            }
            _ => {
                return Ok(tool_text(
                    "messages: unknown action (expected optimize or optimize_batch)".to_owned(),
                    true,
                ));
            }
        };
        return Ok(tool_text(text.to_owned(), false));
    }
    if TOOLS.iter().any(|(tool, _, _)| *tool == name) {
        Ok(tool_text(
            format!("{name}: done (demo) with arguments {arguments}"),
            false,
        ))
    } else {
        Err((-32602, format!("Unknown tool: {name}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn initialize_echoes_the_requested_protocol_version() {
        let mut session = false;
        let reply = handle_message(
            &json!({"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-03-26"}}),
            &mut session,
        )
        .expect("a reply");
        assert!(session);
        assert_eq!(reply["result"]["protocolVersion"], "2025-03-26");
        assert_eq!(reply["result"]["serverInfo"]["name"], "sluice-demo");
        let unknown = handle_message(
            &json!({"jsonrpc":"2.0","id":2,"method":"initialize","params":{"protocolVersion":"1999-01-01"}}),
            &mut session,
        )
        .expect("a reply");
        assert_eq!(
            unknown["result"]["protocolVersion"], PROTOCOL_VERSIONS[0],
            "a version it speaks"
        );
    }

    #[test]
    fn notifications_get_no_reply_and_unknown_methods_minus_32601() {
        let mut session = false;
        assert!(
            handle_message(
                &json!({"jsonrpc":"2.0","method":"notifications/initialized"}),
                &mut session
            )
            .is_none()
        );
        let reply = handle_message(
            &json!({"jsonrpc":"2.0","id":"x","method":"nope"}),
            &mut session,
        )
        .expect("a reply");
        assert_eq!(reply["error"]["code"], -32601);
        assert_eq!(reply["id"], "x");
    }

    #[test]
    fn tools_list_and_call() {
        let tools = tool_list();
        assert_eq!(tools.len(), 8);
        assert!(tools.iter().all(|t| t["inputSchema"]["type"] == "object"));
        let ok = call_tool(&json!({"name":"search_query","arguments":{"query":"x"}}))
            .expect("known tool");
        assert_eq!(ok["isError"], false);
        assert_eq!(ok["content"][0]["type"], "text");
        let retired = call_tool(&json!({"name":"messages","arguments":{"action":"optimize"}}))
            .expect("retired tool");
        assert_eq!(retired["isError"], false);
        assert!(call_tool(&json!({"name":"nope"})).is_err());
    }
}
