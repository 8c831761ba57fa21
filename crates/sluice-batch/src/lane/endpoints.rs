//! The batch endpoints: `POST <route>/batch` (queue a batch), `GET
//! <route>/batches/{id}` (read its status) and the lanes' JSON-RPC tools, answered by
//! the [`BatchEndpoints`] service in front of the proxy once the limiter has
//! admitted the request.

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use http_body_util::BodyExt as _;
use serde_json::{Value, json};
use sha2::{Digest as _, Sha256};
use sluice_core::Clock as _;
use sluice_policy::BatchEndpoint;
use sluice_store::BudgetStore;
use tower::Service;

use super::responses::{boxed, envelope, header_text, json_response, status_json, submitted};
use super::{BatchLane, BatchUpstream, BoxError, LaneBody};
use crate::{SubmitError, Submitted};

impl<S: BudgetStore + 'static, U: BatchUpstream> BatchLane<S, U> {
    /// Queues the batch `body` (already checked and counted by the limiter) for the
    /// request `parts`, and answers 202, or why it was not queued.
    async fn submit(&self, parts: &http::request::Parts, body: Bytes) -> Response<LaneBody> {
        let submit = match sluice_edge::parse_batch(&body, self.batch.max_items.get()) {
            Ok(submit) => submit,
            Err(bad) => return boxed(sluice_edge::Refused::from(bad).response()),
        };
        let workspace = header_text(parts, "x-sluice-workspace");
        let n = u32::try_from(submit.items.len()).unwrap_or(u32::MAX);
        let items = self.queued_items(parts, &workspace, submit.items);
        let digest = batch_digest(&body);
        let now = self.clock.now();
        let origin = self.origin(parts);
        let queued = self
            .queue
            .submit_from(
                &self.queue_name(&workspace),
                &origin,
                items,
                submit.idempotency_key.as_deref(),
                &digest,
                now,
            )
            .await;
        // Calls counted at admission that this submit did not queue give their
        // quota back; a batch that may be queued (the store's answer was lost)
        // runs if it is, so its calls stay counted.
        if stored_nothing(&queued) {
            self.give_back_quota(parts, &workspace, n).await;
        }
        if queued.is_ok() || matches!(queued, Err(SubmitError::OutcomeUnknown(_))) {
            self.queued.notify_one();
        }
        submitted(&self.batch.route, queued)
    }

    /// Answers a submit that a monthly quota refused: a repeat of a batch the
    /// same key and body made (whose items that quota counted) as the repeat it
    /// is (202, the batch's id, nothing queued or counted); anything else with
    /// the refusal.
    async fn repeat(
        &self,
        parts: &http::request::Parts,
        body: &[u8],
        refused: sluice_edge::RefusedUnlessRepeat,
    ) -> Response<LaneBody> {
        let Ok(submit) = sluice_edge::parse_batch(body, self.batch.max_items.get()) else {
            return boxed(refused.take());
        };
        let Some(key) = submit.idempotency_key.as_deref() else {
            return boxed(refused.take());
        };
        let workspace = header_text(parts, "x-sluice-workspace");
        match self
            .queue
            .earlier_batch(&self.queue_name(&workspace), key, &batch_digest(body))
            .await
        {
            Ok(Some(earlier)) => submitted(&self.batch.route, Ok(earlier)),
            Ok(None) | Err(_) => boxed(refused.take()),
        }
    }

    /// The batch's `items` as the queue keeps them: each with the credential fields
    /// of the request `parts` it is sent with, the workspace and the user.
    fn queued_items(
        &self,
        parts: &http::request::Parts,
        workspace: &str,
        items: Vec<Vec<u8>>,
    ) -> Vec<Vec<u8>> {
        let user = header_text(parts, "x-sluice-user");
        let fields: serde_json::Map<String, Value> = self
            .credential_fields
            .iter()
            .flat_map(|name| parts.headers.get_all(name).iter().map(move |v| (name, v)))
            .filter_map(|(name, v)| Some((name.as_str().to_owned(), Value::from(v.to_str().ok()?))))
            .collect();
        items
            .into_iter()
            .map(|item| {
                let body: Value = serde_json::from_slice(&item).unwrap_or(Value::Null);
                json!({ "fields": fields, "workspace": workspace, "user": user, "body": body })
                    .to_string()
                    .into_bytes()
            })
            .collect()
    }

    /// The client address (through trusted proxies, an IPv6 client by its
    /// prefix), whose share of the queue's global bounds a batch takes.
    fn origin(&self, parts: &http::request::Parts) -> String {
        (self.peer_of)(parts)
            .map(|peer| {
                let limiter = self.limiter.load();
                let client = limiter
                    .policy()
                    .identity
                    .client_ip(peer.ip(), &parts.headers);
                client.who.to_string()
            })
            .unwrap_or_default()
    }

    /// Gives back the quota `n` calls not queued were counted: what the admission
    /// spent of it (nothing when the family is in shadow mode and would have
    /// refused them).
    async fn give_back_quota(&self, parts: &http::request::Parts, workspace: &str, n: u32) {
        if let Some(family) = self.batch.quota
            && let spent = parts
                .extensions
                .get::<sluice_edge::QuotaSpent>()
                .map_or(n, |s| s.of(family).min(n))
            && spent > 0
            && let Err(e) = self
                .limiter
                .load_full()
                .refund_quota(workspace, family, spent)
                .await
        {
            tracing::warn!("could not give back {spent} quota units to {workspace}: {e}");
        }
    }

    /// Answers a status read of batch `id` for the request `parts`.
    async fn status(&self, parts: &http::request::Parts, id: &str) -> Response<LaneBody> {
        let workspace = header_text(parts, "x-sluice-workspace");
        match self
            .queue
            .status(&self.queue_name(&workspace), id, self.clock.now())
            .await
        {
            Ok(Some(status)) => json_response(StatusCode::OK, &status_json(&status)),
            Ok(None) => envelope(
                StatusCode::NOT_FOUND,
                "not_found",
                "No such batch.",
                json!({ "batch_id": id }),
            ),
            Err(e) => {
                let mut r = envelope(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "unavailable",
                    &format!("The batch could not be read: {e}"),
                    json!({}),
                );
                r.headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from_static("5"));
                r
            }
        }
    }
}

/// Whether a submit's answer says it queued nothing: the batch an earlier submit
/// with the same key queued, or a refusal. A lost answer
/// ([`SubmitError::OutcomeUnknown`]) is not one: the batch may be queued.
fn stored_nothing(queued: &Result<Submitted, SubmitError>) -> bool {
    match queued {
        Ok(s) => !s.created,
        Err(SubmitError::OutcomeUnknown(_)) => false,
        Err(
            SubmitError::Empty
            | SubmitError::TooMany { .. }
            | SubmitError::Conflict { .. }
            | SubmitError::Backlog { .. }
            | SubmitError::Full { .. }
            | SubmitError::QueueFull { .. }
            | SubmitError::Unavailable(_),
        ) => true,
    }
}

/// The digest a batch body is known by: of its canonical JSON, so the same JSON in
/// another key order or spacing is the same batch.
fn batch_digest(body: &[u8]) -> sha2::digest::Output<Sha256> {
    match serde_json::from_slice::<Value>(body) {
        Ok(value) => {
            let mut canonical = Vec::with_capacity(body.len());
            write_canonical(&value, &mut canonical);
            Sha256::digest(&canonical)
        }
        Err(_) => Sha256::digest(body),
    }
}

/// `value` as canonical JSON: object keys sorted (by their UTF-8 bytes), no
/// whitespace, strings and numbers as serde_json writes them. The digest of a
/// batch body is taken over this form, so a resend that only reorders keys or
/// changes spacing matches its first submit. Written here rather than relying
/// on `Value`'s map order, which a crate feature (`preserve_order`) can change.
fn write_canonical(value: &Value, out: &mut Vec<u8>) {
    match value {
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort_unstable();
            out.push(b'{');
            for (i, key) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                out.extend_from_slice(Value::from(key.as_str()).to_string().as_bytes());
                out.push(b':');
                if let Some(v) = map.get(key) {
                    write_canonical(v, out);
                }
            }
            out.push(b'}');
        }
        Value::Array(items) => {
            out.push(b'[');
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_canonical(v, out);
            }
            out.push(b']');
        }
        scalar => out.extend_from_slice(scalar.to_string().as_bytes()),
    }
}
/// The service in front of the proxy (`I`) that answers the batch lanes' endpoints
/// (the limiter has admitted the request) and forwards everything else.
pub struct BatchEndpoints<I, S, U> {
    inner: I,
    lanes: Arc<Vec<Arc<BatchLane<S, U>>>>,
}

impl<I: Clone, S, U> Clone for BatchEndpoints<I, S, U> {
    fn clone(&self) -> Self {
        BatchEndpoints {
            inner: self.inner.clone(),
            lanes: Arc::clone(&self.lanes),
        }
    }
}

impl<I, S, U> BatchEndpoints<I, S, U> {
    /// `inner`, with `lanes` answered in front of it.
    pub fn new(inner: I, lanes: Arc<Vec<Arc<BatchLane<S, U>>>>) -> Self {
        BatchEndpoints { inner, lanes }
    }

    fn lane(&self, index: usize) -> Option<Arc<BatchLane<S, U>>> {
        self.lanes.iter().find(|l| l.lane_index == index).cloned()
    }
}

/// An answer of the batch lane (`answer`, as the REST endpoint gives it) to the
/// JSON-RPC call `id`: a success is the tool's result (its JSON as text and as
/// `structuredContent`), with HTTP 200; a refusal is a JSON-RPC error with the same
/// HTTP status, `error.data` holding the envelope's `code` and `details`
/// (`-32029` for a 429, `-32602` for a 400 or 404, `-32000` otherwise).
async fn jsonrpc_answer(id: Value, answer: Response<LaneBody>) -> Response<LaneBody> {
    let (parts, body) = answer.into_parts();
    let bytes = body
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    let json: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    let body = if parts.status.is_success() {
        json!({
            "jsonrpc": "2.0",
            "id": id,
            "result": {
                "content": [{ "type": "text", "text": json.to_string() }],
                "structuredContent": json,
                "isError": false,
            },
        })
    } else {
        let code = match parts.status.as_u16() {
            429 => -32029,
            400 | 404 => -32602,
            _ => -32000,
        };
        let error = &json["error"];
        let mut data = error["details"].clone();
        if let Value::Object(map) = &mut data {
            map.insert("code".into(), error["code"].clone());
        }
        json!({
            "jsonrpc": "2.0",
            "id": id,
            "error": { "code": code, "message": error["message"], "data": data },
        })
    };
    let status = if parts.status.is_success() {
        StatusCode::OK
    } else {
        parts.status
    };
    let mut r = json_response(status, &body);
    if let Some(retry) = parts.headers.get(header::RETRY_AFTER) {
        r.headers_mut().insert(header::RETRY_AFTER, retry.clone());
    }
    r
}

impl<S: BudgetStore + 'static, U: BatchUpstream> BatchLane<S, U> {
    /// Answers a call of this lane's submit or status tool.
    async fn tool(
        &self,
        parts: &http::request::Parts,
        call: sluice_edge::BatchToolCall,
    ) -> Response<LaneBody> {
        let answer = match call.tool {
            sluice_edge::BatchTool::Submit(_) => {
                let args = Bytes::from(call.arguments.to_string());
                self.submit(parts, args).await
            }
            sluice_edge::BatchTool::Status(_) => match call.arguments["batch_id"].as_str() {
                Some(id) => self.status(parts, id).await,
                None => envelope(
                    StatusCode::BAD_REQUEST,
                    "invalid_request",
                    "`batch_id` is required.",
                    json!({ "reason": "no_batch_id" }),
                ),
            },
        };
        jsonrpc_answer(call.id, answer).await
    }
}

impl<I, S, U, B> Service<Request<B>> for BatchEndpoints<I, S, U>
where
    I: Service<Request<B>, Response = Response<LaneBody>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    I::Future: Send + 'static,
    S: BudgetStore + 'static,
    U: BatchUpstream,
    B: http_body::Body<Data = Bytes> + From<Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Response = Response<LaneBody>;
    type Error = Infallible;
    type Future =
        std::pin::Pin<Box<dyn Future<Output = Result<Response<LaneBody>, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let endpoint = if self.lanes.is_empty() {
            None
        } else {
            self.lanes.first().and_then(|l| {
                l.limiter
                    .load()
                    .route_for(request.method(), request.uri().path())
                    .ok()
                    .flatten()
                    .and_then(|r| r.batch)
            })
        };
        let lane = endpoint.and_then(|e| match e {
            BatchEndpoint::Submit(i) | BatchEndpoint::Status(i) => self.lane(i),
        });
        // A submit a monthly quota refused (see sluice-edge's
        // `RefusedUnlessRepeat`): answered here, never passed on.
        if let Some(refused) = request
            .extensions()
            .get::<sluice_edge::RefusedUnlessRepeat>()
            .cloned()
        {
            let lane = lane.filter(|_| matches!(endpoint, Some(BatchEndpoint::Submit(_))));
            return Box::pin(async move {
                let (parts, body) = request.into_parts();
                let body = body.collect().await.map(|c| c.to_bytes()).ok();
                Ok(match (lane, body) {
                    (Some(lane), Some(body)) if parts.method == Method::POST => {
                        lane.repeat(&parts, &body, refused).await
                    }
                    _ => boxed(refused.take()),
                })
            });
        }
        let jsonrpc = self.lanes.first().is_some_and(|l| {
            let limiter = l.limiter.load();
            limiter.policy().lanes.iter().any(|lane| {
                lane.batch
                    .as_ref()
                    .is_some_and(|b| b.submit_tool.is_some() || b.status_tool.is_some())
            }) && limiter
                .route_for(request.method(), request.uri().path())
                .ok()
                .flatten()
                .is_some_and(|r| r.class == sluice_policy::RouteClass::JsonRpc)
        });
        let (Some(endpoint), Some(lane)) = (endpoint, lane) else {
            if jsonrpc {
                // A JSON-RPC body (the limiter read it whole): a batch tool call is
                // answered here, anything else goes on.
                let lanes = Arc::clone(&self.lanes);
                let mut inner = self.inner.clone();
                return Box::pin(async move {
                    let (parts, body) = request.into_parts();
                    let bytes = match body.collect().await {
                        Ok(c) => c.to_bytes(),
                        Err(_) => return Ok(boxed(sluice_edge::body_unreadable())),
                    };
                    let call = lanes.first().and_then(|l| {
                        sluice_edge::batch_tool_call(l.limiter.load().policy(), &bytes)
                            .ok()
                            .flatten()
                    });
                    let lane = call.as_ref().and_then(|c| match c.tool {
                        sluice_edge::BatchTool::Submit(i) | sluice_edge::BatchTool::Status(i) => {
                            lanes.iter().find(|l| l.lane_index == i).cloned()
                        }
                    });
                    match (call, lane) {
                        (Some(call), Some(lane)) => Ok(lane.tool(&parts, call).await),
                        _ => inner.call(Request::from_parts(parts, B::from(bytes))).await,
                    }
                });
            }
            let call = self.inner.call(request);
            return Box::pin(call);
        };
        Box::pin(async move {
            let (parts, body) = request.into_parts();
            Ok(match endpoint {
                BatchEndpoint::Submit(_) if parts.method == Method::POST => {
                    let body = match body.collect().await {
                        Ok(c) => c.to_bytes(),
                        Err(_) => return Ok(boxed(sluice_edge::body_unreadable())),
                    };
                    lane.submit(&parts, body).await
                }
                BatchEndpoint::Status(_) => match lane.batch.status_id(parts.uri.path()) {
                    Some(id) => lane.status(&parts, id).await,
                    None => envelope(
                        StatusCode::NOT_FOUND,
                        "not_found",
                        "No such batch.",
                        json!({}),
                    ),
                },
                BatchEndpoint::Submit(_) => envelope(
                    StatusCode::METHOD_NOT_ALLOWED,
                    "method_not_allowed",
                    "Submit a batch with POST.",
                    json!({}),
                ),
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn l4_canonical_json_ignores_key_order_and_spacing() {
        let canonical = |text: &str| {
            let mut out = Vec::new();
            write_canonical(&serde_json::from_str(text).expect("json"), &mut out);
            String::from_utf8(out).expect("utf-8")
        };
        let a = canonical(r#"{"items":[{"b":1,"a":"x"}],"idempotency_key":"k"}"#);
        let b =
            canonical("{ \"idempotency_key\": \"k\",\n \"items\": [ {\"a\": \"x\", \"b\": 1} ] }");
        assert_eq!(a, b);
        assert_eq!(a, r#"{"idempotency_key":"k","items":[{"a":"x","b":1}]}"#);
        assert_ne!(
            a,
            canonical(r#"{"items":[{"b":2,"a":"x"}],"idempotency_key":"k"}"#)
        );
    }
}
