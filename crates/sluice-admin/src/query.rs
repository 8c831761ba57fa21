//! The admin API's query strings: read as axum's `Query` reads them, refused with
//! the API's JSON envelope (400 `invalid_request`) instead of axum's plain text,
//! so that a script reading `error.code` reads every refusal the same way.

use axum::extract::FromRequestParts;
use axum::http::StatusCode;
use axum::http::request::Parts;
use axum::response::Response;
use serde::de::DeserializeOwned;

/// A query string deserialized into `T`: a field named twice, of the wrong type
/// or unknown to a `deny_unknown_fields` `T` is 400 `invalid_request`, its message
/// axum's.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Query<T>(pub(crate) T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequestParts<S> for Query<T> {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Response> {
        match axum::extract::Query::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Query(value)) => Ok(Query(value)),
            Err(rejection) => Err(crate::error(
                StatusCode::BAD_REQUEST,
                "invalid_request",
                rejection.body_text(),
            )),
        }
    }
}
