//! The demo's warehouse: `POST /search/query` answering the way a data
//! warehouse's API does, so a newcomer sees the weighted budget work.
//!
//! - The body is `{"sql": "…"}`. A query's cost in warehouse reads is one, plus one
//!   per `JOIN` (at most 5); the answer says it in `X-Sluice-Cost`.
//! - The same SQL again within [`CACHE_FOR`] is a cache hit: cost 0.
//! - SQL the gate refuses (missing, or holding `DROP`, `DELETE`, `UPDATE` or
//!   `INSERT`) is 400 `invalid_sql`, and still costs one read.
//! - A request sluice passed on with `X-Sluice-Exhausted` (a route with
//!   `on_exhausted: pass`) gets the fuzzy-lane answer: 200 with
//!   `success: true` and `detail.internal.status: "failed"`, cost 0.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Json, Response};
use bytes::Bytes;
use serde_json::{Value, json};

/// How long an answer stays in the result cache.
pub(super) const CACHE_FOR: Duration = Duration::from_secs(30);

/// The most answers cached; past it the cache starts over.
const CACHE_ENTRIES: usize = 4_096;

/// Most reads one query spends.
const MAX_COST: u32 = 5;

fn cache() -> &'static Mutex<HashMap<String, Instant>> {
    static CACHE: OnceLock<Mutex<HashMap<String, Instant>>> = OnceLock::new();
    CACHE.get_or_init(Mutex::default)
}

fn with_cost(mut response: Response, cost: u32) -> Response {
    response
        .headers_mut()
        .insert("x-sluice-cost", HeaderValue::from(cost));
    response
}

/// `POST /search/query`.
pub(super) async fn search_query(headers: HeaderMap, body: Bytes) -> Response {
    if let Some(exhausted) = headers.get("x-sluice-exhausted") {
        let note = format!(
            "Rate limit exceeded ({}); the query was not run. Back off before rewording it.",
            String::from_utf8_lossy(exhausted.as_bytes())
        );
        let answer = json!({
            "success": true,
            "detail": { "internal": { "status": "failed" } },
            "note": note,
        });
        return with_cost(Json(answer).into_response(), 0);
    }
    let sql = serde_json::from_slice::<Value>(&body)
        .ok()
        .and_then(|v| v.get("sql").and_then(Value::as_str).map(str::to_owned));
    let Some(sql) = sql.filter(|s| !s.trim().is_empty()) else {
        return invalid("a JSON body with a non-empty `sql` string is required");
    };
    let upper = sql.to_ascii_uppercase();
    if ["DROP", "DELETE", "UPDATE", "INSERT"].iter().any(|w| {
        upper
            .split(|c: char| !c.is_ascii_alphanumeric())
            .any(|t| t == *w)
    }) {
        return invalid("only SELECT queries are run");
    }
    let now = Instant::now();
    let cached = {
        let mut cache = cache()
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        cache.retain(|_, at| now.duration_since(*at) < CACHE_FOR);
        let hit = cache.contains_key(&sql);
        if !hit {
            if cache.len() >= CACHE_ENTRIES {
                cache.clear();
            }
            cache.insert(sql.clone(), now);
        }
        hit
    };
    let joins = upper
        .split(|c: char| !c.is_ascii_alphanumeric())
        .filter(|t| *t == "JOIN")
        .count();
    let cost = if cached {
        0
    } else {
        (1 + u32::try_from(joins).unwrap_or(MAX_COST)).min(MAX_COST)
    };
    let answer = json!({ "rows": [], "cost": cost, "cached": cached });
    with_cost(Json(answer).into_response(), cost)
}

/// The gate's refusal: 400 `invalid_sql`, one read spent.
fn invalid(message: &str) -> Response {
    let body = json!({"error": {"code": "invalid_sql", "message": message, "details": {}}});
    with_cost((StatusCode::BAD_REQUEST, Json(body)).into_response(), 1)
}
