//! The JSON answers of the batch endpoints: a batch's status, the submit's answer
//! (202, or why nothing was queued), and the error envelope.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};
use http_body_util::{BodyExt as _, Full};
use serde_json::{Value, json};
use sluice_core::Timestamp;

use super::LaneBody;
use crate::{BatchStatus, ResultBody, SubmitError, Submitted};

/// The `Retry-After` of a submit refused because the queue is full: the
/// queue's upkeep period, in which items finish and old batches are purged.
pub const QUEUE_FULL_RETRY: Duration = Duration::from_secs(30);

/// The answer to a submit to the batch route `route`: 202 with the batch's id,
/// its item count and where to read its status, or why it was not queued.
pub(super) fn submitted(route: &str, queued: Result<Submitted, SubmitError>) -> Response<LaneBody> {
    match queued {
        Ok(done) => {
            let status_url = format!("{route}/batches/{}", done.batch_id);
            let mut r = json_response(
                StatusCode::ACCEPTED,
                &json!({ "batch_id": done.batch_id, "items": done.items, "status_url": status_url }),
            );
            if let Ok(location) = HeaderValue::from_str(&status_url) {
                r.headers_mut().insert(header::LOCATION, location);
            }
            r
        }
        Err(SubmitError::Conflict { batch_id }) => envelope(
            StatusCode::CONFLICT,
            "conflict",
            "This idempotency_key was used for a different batch body.",
            json!({ "batch_id": batch_id }),
        ),
        Err(SubmitError::Backlog { queued, limit }) => envelope(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limited",
            &format!(
                "Your workspace has {queued} batch items waiting; at most {limit} may wait. Submit more once some have run."
            ),
            json!({ "reason": "batch_backlog_limit", "queued": queued, "limit": limit }),
        ),
        Err(SubmitError::QueueFull { bound, used, limit }) => {
            let mut r = envelope(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable",
                &format!(
                    "The batch queue is full ({}: {used} of {limit}); nothing was queued. Try again later.",
                    bound.as_str()
                ),
                json!({
                    "reason": "batch_queue_full",
                    "bound": bound.as_str(),
                    "used": used,
                    "limit": limit,
                    "retry_after_seconds": QUEUE_FULL_RETRY.as_secs(),
                }),
            );
            r.headers_mut().insert(
                header::RETRY_AFTER,
                HeaderValue::from(QUEUE_FULL_RETRY.as_secs()),
            );
            r
        }
        Err(SubmitError::TooMany { given, limit }) => envelope(
            StatusCode::BAD_REQUEST,
            "invalid_request",
            &format!("A batch holds at most {limit} items; this one has {given}."),
            json!({ "reason": "too_many_items", "limit": limit }),
        ),
        Err(SubmitError::Empty) => envelope(
            StatusCode::BAD_REQUEST,
            "invalid_request",
            "A batch needs at least one item.",
            json!({ "reason": "empty_batch" }),
        ),
        Err(SubmitError::OutcomeUnknown(e)) => {
            let mut r = envelope(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable",
                &format!(
                    "The batch store did not confirm this batch ({e}): it may have been queued, and then it runs and its calls stay counted. Submit it again with the same idempotency_key to get its batch_id (without one, a second submit is a second batch)."
                ),
                json!({ "reason": "batch_outcome_unknown" }),
            );
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("5"));
            r
        }
        Err(e) => {
            let mut r = envelope(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable",
                &format!("The batch could not be queued: {e}"),
                json!({}),
            );
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("5"));
            r
        }
    }
}

/// The batch status as `GET <route>/batches/{id}` shows it.
pub(super) fn status_json(s: &BatchStatus) -> Value {
    let at = |t: Timestamp| sluice_edge::rfc3339(t.as_secs());
    json!({
        "batch_id": s.batch_id,
        "state": s.state.as_str(),
        "total": s.total,
        "done": s.done,
        "failed": s.failed,
        "queued": s.queued,
        "running": s.running,
        "created_at": at(s.created_at),
        "estimated_finish_at": s.estimated_finish_at.map(at),
        "items": s.items.iter().map(|i| json!({
            "index": i.index,
            "state": i.state.as_str(),
            "attempts": i.attempts,
            "status": i.result.as_ref().map(|r| r.status),
            "result": i.result.as_ref().map(|r| match &r.body {
                ResultBody::Json(b) => serde_json::from_slice(b).unwrap_or(Value::Null),
                ResultBody::Text(t) => Value::from(t.as_str()),
            }),
        })).collect::<Vec<_>>(),
    })
}

pub(super) fn header_text(parts: &http::request::Parts, name: &str) -> String {
    parts
        .headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("-")
        .to_owned()
}

pub(super) fn boxed(r: Response<Full<Bytes>>) -> Response<LaneBody> {
    r.map(|b| b.map_err(|never| match never {}).boxed())
}

pub(super) fn json_response(status: StatusCode, body: &Value) -> Response<LaneBody> {
    let mut r = Response::new(Full::new(Bytes::from(body.to_string())));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    boxed(r)
}

pub(super) fn envelope(
    status: StatusCode,
    code: &str,
    message: &str,
    details: Value,
) -> Response<LaneBody> {
    boxed(sluice_edge::envelope_response(
        status, code, message, details,
    ))
}
