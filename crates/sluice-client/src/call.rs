//! One paced exchange with a provider, shared by every form (tower layer,
//! reqwest-middleware, proxy): estimate and maybe shrink the body, reserve,
//! send, learn from the answer, retry or deliver — and reconcile the
//! reservation with the answer's usage when its body ends.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, StatusCode};
use sluice_core::Clock;
use sluice_store::BudgetStore;

use crate::backoff::{Backoff, RetryPolicy, Retryable, classify};
use crate::error::PaceError;
use crate::pacer::{Pacer, Permit};
use crate::priority::{AcquireOptions, PRIORITY_HEADER, Priority};
use crate::shrink::{PacedRequest, ShrinkReport};
use crate::tokens::EstimateOptions;
use crate::usage::{OnUsage, Usage};

/// The most of an error body (429, retryable 5xx) read to find a retry
/// hint; a longer body is handed back whole, unread past this (and one
/// chunk).
pub(crate) const MAX_ERROR_BODY: usize = 64 << 10;

/// The header carrying a retried POST's idempotency key.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// What to do after an answer.
pub(crate) enum After<S: BudgetStore + 'static, C: Clock + 'static> {
    /// Send again after this long (the reservation is settled).
    Retry(Duration),
    /// Hand the answer over; with a permit when its usage should reconcile
    /// the reservation as the body ends.
    Deliver(Option<Box<Permit<S, C>>>),
}

/// One request on its way through the pacer.
pub(crate) struct Call<S: BudgetStore + 'static, C: Clock + 'static> {
    pacer: Pacer<S, C>,
    provider: String,
    pub(crate) method: Method,
    pub(crate) headers: HeaderMap,
    body: Bytes,
    json: Option<PacedRequest>,
    shrunk: Option<ShrinkReport>,
    backoff: Backoff,
    options: AcquireOptions,
    /// The longest this call sleeps between attempts, in all
    /// (`maxWaitSeconds`).
    max_wait: Duration,
    /// What it has slept between attempts so far.
    slept: Duration,
}

/// The JSON object a call's `body` is, to estimate; `None` for a body that is
/// no JSON object and does not say it is JSON (none, a multipart upload: paced
/// by its request alone). A UTF-8 byte-order mark is skipped, as the providers'
/// JSON readers skip it.
///
/// # Errors
/// [`PaceError::UncountableBody`] for a body sent as JSON (its `Content-Type`, or
/// a `{` first) that does not read as JSON, or whose completion budget, `n` or
/// `stream` a lenient provider would read otherwise than the estimate
/// ([`sluice_tokens::check_counts`]).
fn counted_body(body: &[u8], headers: &HeaderMap) -> Result<Option<serde_json::Value>, PaceError> {
    let text = body.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(body);
    if text.trim_ascii().is_empty() {
        return Ok(None);
    }
    let says_json = headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|t| {
            let t = t
                .split(';')
                .next()
                .unwrap_or("")
                .trim()
                .to_ascii_lowercase();
            t == "application/json" || t.ends_with("+json")
        })
        || text.trim_ascii_start().first() == Some(&b'{');
    match serde_json::from_slice::<serde_json::Value>(text) {
        Ok(serde_json::Value::Object(object)) => {
            sluice_tokens::check_counts(&object).map_err(|bad| PaceError::UncountableBody {
                reason: bad.reason(),
                message: bad.to_string(),
            })?;
            Ok(Some(serde_json::Value::Object(object)))
        }
        Ok(_) => Ok(None),
        Err(_) if says_json => Err(PaceError::UncountableBody {
            reason: "not_json",
            message: "it is sent as JSON but does not read as JSON".to_owned(),
        }),
        Err(_) => Ok(None),
    }
}

impl<S: BudgetStore + 'static, C: Clock + 'static> Call<S, C> {
    /// A call of `method` to `path` (below the provider's base URL) with
    /// these headers and body.
    pub(crate) fn new(
        pacer: &Pacer<S, C>,
        provider: &str,
        method: Method,
        path: &str,
        mut headers: HeaderMap,
        body: Bytes,
    ) -> Result<Self, PaceError> {
        let config = pacer.config();
        let p = config
            .provider(provider)
            .ok_or_else(|| PaceError::UnknownProvider {
                provider: provider.to_owned(),
            })?;
        let json = counted_body(&body, &headers)?.map(|v| {
            PacedRequest::new(
                p.style,
                path,
                v,
                EstimateOptions::new(p.encoding, p.default_max_tokens),
            )
        });
        // The sender sets the length of the body it sends (maybe shrunk).
        headers.remove(http::header::CONTENT_LENGTH);
        // The priority is for the pacer, never for the provider.
        let priority = Priority::from_headers(&headers)
            .map_err(|value| PaceError::InvalidPriority { value })?;
        headers.remove(PRIORITY_HEADER);
        let policy = RetryPolicy {
            max_attempts: config.pacer.max_attempts,
            ..RetryPolicy::default()
        };
        if method == Method::POST
            && policy.max_attempts > 1
            && !headers.contains_key(IDEMPOTENCY_KEY)
        {
            let key = format!(
                "sluice-{:016x}{:016x}",
                fastrand::u64(..),
                fastrand::u64(..)
            );
            if let Ok(v) = HeaderValue::from_str(&key) {
                headers.insert(IDEMPOTENCY_KEY, v);
            }
        }
        Ok(Call {
            pacer: pacer.clone(),
            provider: provider.to_owned(),
            method,
            headers,
            body,
            json,
            shrunk: None,
            backoff: Backoff::new(policy),
            options: AcquireOptions::default().priority(priority),
            max_wait: p.max_wait,
            slept: Duration::ZERO,
        })
    }

    /// The body to send (shrunk, if it was).
    pub(crate) fn body(&self) -> Bytes {
        self.body.clone()
    }

    /// What shrinking dropped, if it happened.
    pub(crate) fn shrink_report(&self) -> Option<ShrinkReport> {
        self.shrunk
    }

    /// Waits for room and reserves (shrinking the body if needed and
    /// allowed).
    pub(crate) async fn acquire(&mut self) -> Result<Permit<S, C>, PaceError> {
        let permit = match &mut self.json {
            Some(req) => {
                let permit = self
                    .pacer
                    .acquire_with(&self.provider, req, &self.options)
                    .await?;
                if req.shrink_report() != self.shrunk {
                    self.shrunk = req.shrink_report();
                    if let Ok(b) = serde_json::to_vec(req.body()) {
                        self.body = Bytes::from(b);
                    }
                }
                permit
            }
            None => {
                self.pacer
                    .acquire_with(&self.provider, &mut 0u32, &self.options)
                    .await?
            }
        };
        self.authorize(&permit);
        Ok(permit)
    }

    /// Sends the key the pacer chose among the provider's `apiKeys`.
    fn authorize(&mut self, permit: &Permit<S, C>) {
        let Some(secret) = permit.secret() else {
            return;
        };
        let config = self.pacer.config();
        let Some(p) = config.provider(&self.provider) else {
            return;
        };
        self.headers.remove(http::header::AUTHORIZATION);
        self.headers.remove("x-api-key");
        if let Ok(mut v) = HeaderValue::from_str(&p.auth_value(secret)) {
            v.set_sensitive(true);
            self.headers.insert(p.auth_header.clone(), v);
        }
    }

    /// Whether the provider has several keys to choose from (`apiKeys`).
    fn several_keys(&self) -> bool {
        self.pacer
            .config()
            .provider(&self.provider)
            .is_some_and(|p| p.api_keys.len() > 1)
    }

    /// Whether the answer's body is needed to decide (a status that may be
    /// retried: its body may hold a hint or `insufficient_quota`).
    pub(crate) fn wants_body(status: StatusCode) -> bool {
        matches!(
            status.as_u16(),
            408 | 409 | 429 | 500 | 502 | 503 | 504 | 529
        )
    }

    /// Learns from an answer and says what comes next.
    pub(crate) async fn after(
        &mut self,
        permit: Permit<S, C>,
        status: StatusCode,
        headers: &HeaderMap,
        body: Option<&[u8]>,
    ) -> After<S, C> {
        // Learning is best effort: a store hiccup must not lose the answer.
        let _ = permit.observe(headers).await;
        // A 429 describes the budget the request spent (its model on its
        // key): it holds that one, not the provider's other models and keys.
        let narrow = permit.narrow_subject();
        let is_429 = status == StatusCode::TOO_MANY_REQUESTS;
        match classify(status, headers, body) {
            Retryable::No if status.is_success() => After::Deliver(Some(Box::new(permit))),
            Retryable::No => {
                if is_429 {
                    self.pacer.count_429(&self.provider);
                }
                // Refused requests are not counted by the provider.
                let _ = permit.cancel().await;
                After::Deliver(None)
            }
            Retryable::Yes { hint } => {
                // Never past `maxWaitSeconds` in all: a provider that asks
                // for longer, or answers 429 on and on, gets its answer
                // handed back.
                let budget = self.max_wait.saturating_sub(self.slept);
                let delay = self.backoff.next_delay(hint).filter(|d| *d <= budget);
                if is_429 {
                    // The budget is full for everyone on this key: held
                    // before its tokens go back, so that no process on the
                    // store sends into the refusal meanwhile.
                    if let Some(d) = delay.or(hint) {
                        self.hold(narrow, d).await;
                    }
                    // Refused without counting: give the tokens back.
                    let _ = permit.cancel().await;
                } else {
                    // A 5xx may have been counted: keep the reservation.
                    drop(permit);
                }
                match delay {
                    Some(d) => {
                        self.pacer.count_retry(&self.provider, is_429);
                        if is_429 && self.several_keys() {
                            // Another key may send it now: the hold keeps
                            // this one out, the pacer waits only if every
                            // key is held or full.
                            return After::Retry(Duration::ZERO);
                        }
                        self.slept = self.slept.saturating_add(d);
                        After::Retry(d)
                    }
                    None => {
                        if is_429 {
                            self.pacer.count_429(&self.provider);
                        }
                        After::Deliver(None)
                    }
                }
            }
        }
    }

    /// Holds the budget a 429 answered for (`narrow`: the one the request
    /// spent; `None`: the provider's, on every key) for `d`, in this process
    /// and in the store, for every process on the key (SPEC C5, C7). Best
    /// effort, as learning is: whatever the store says, this process holds it.
    async fn hold(&self, narrow: Option<u64>, d: Duration) {
        let _ = match narrow {
            Some(subject) => self.pacer.hold_subject(subject, d).await,
            None => self.pacer.hold(&self.provider, d).await,
        };
    }
}

/// On a 429 handed back to the caller whose delay only its body says
/// (Gemini's `RetryInfo`, a message's "try again in 16.062s"), puts it in
/// `retry-after` (whole seconds, rounded up) and `retry-after-ms`, the
/// headers SDKs honour. A provider's own `retry-after` or `retry-after-ms`
/// is left as it is.
pub(crate) fn hint_headers(status: StatusCode, headers: &mut HeaderMap, body: &[u8]) {
    if status != StatusCode::TOO_MANY_REQUESTS
        || headers.contains_key(http::header::RETRY_AFTER)
        || headers.contains_key("retry-after-ms")
    {
        return;
    }
    let Some(d) = crate::backoff::body_hint(body) else {
        return;
    };
    let ms = d.as_millis();
    let secs = ms.div_ceil(1000);
    if let (Ok(s), Ok(m)) = (
        HeaderValue::from_str(&secs.to_string()),
        HeaderValue::from_str(&ms.to_string()),
    ) {
        headers.insert(http::header::RETRY_AFTER, s);
        headers.insert("retry-after-ms", m);
    }
}

/// Reads `body` until it ends or more than `limit` bytes have come (at most
/// `limit` and one frame are held): the bytes read, and the body's unread
/// rest when it went on. Trailers are skipped.
///
/// # Errors
/// The body's error.
pub(crate) async fn read_head<B>(mut body: B, limit: usize) -> Result<(Bytes, Option<B>), B::Error>
where
    B: http_body::Body<Data = Bytes> + Unpin,
{
    use http_body_util::BodyExt;
    let mut out = Vec::new();
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame?.into_data() {
            out.extend_from_slice(&data);
            if out.len() > limit {
                return Ok((Bytes::from(out), Some(body)));
            }
        }
    }
    Ok((Bytes::from(out), None))
}

/// `head` followed by what is left of the body it was read from.
pub(crate) fn rejoin<B>(
    head: Bytes,
    rest: B,
) -> impl http_body::Body<Data = Bytes, Error = B::Error>
where
    B: http_body::Body<Data = Bytes>,
{
    use futures_util::StreamExt;
    let first = futures_util::stream::once(std::future::ready(Ok(http_body::Frame::data(head))));
    http_body_util::StreamBody::new(first.chain(http_body_util::BodyStream::new(rest)))
}

/// The callback a [`UsageTap`](crate::usage::UsageTap) calls when the answer ends: reconcile
/// the reservation with the usage seen (on the runtime the request ran on).
/// Without usage the reservation stands.
pub(crate) fn reconcile_on_end<S, C>(permit: Box<Permit<S, C>>) -> OnUsage
where
    S: BudgetStore + 'static,
    C: Clock + 'static,
{
    let handle = tokio::runtime::Handle::try_current().ok();
    Box::new(move |usage: Option<Usage>, _complete: bool| {
        if let (Some(u), Some(h)) = (usage, handle) {
            h.spawn(async move {
                let _ = (*permit).reconcile_usage(u).await;
            });
        }
    })
}

/// Headers that belong to one connection, not to the message (the one list every
/// part of sluice uses: `Connection`, `Keep-Alive`, `TE`, `Trailer`,
/// `Transfer-Encoding`, `Upgrade` and every `Proxy-*`).
#[cfg(feature = "proxy")]
pub(crate) fn is_hop_by_hop(name: &http::HeaderName) -> bool {
    sluice_h1::fields::is_hop_by_hop(name.as_str().as_bytes())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use http_body_util::BodyExt;

    use super::*;

    /// SPEC C2: what a lenient provider reads as a number or a boolean is never
    /// taken as absent (the estimate would reserve the default output and the
    /// provider count 900): refused 400, nothing reserved or sent. A body sent as
    /// JSON that does not read as JSON is refused too; a UTF-8 byte-order mark is
    /// read past, as the providers' readers do; a body that is no JSON (a
    /// multipart upload) is paced by its request alone.
    #[test]
    fn c2_a_body_the_pacer_cannot_count_is_refused() {
        let json_type = {
            let mut h = HeaderMap::new();
            h.insert(
                http::header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            h
        };
        let none = HeaderMap::new();
        let reason = |body: &str, headers: &HeaderMap| match counted_body(body.as_bytes(), headers)
        {
            Err(PaceError::UncountableBody { reason, .. }) => Some(reason),
            _ => None,
        };
        for (body, why) in [
            (r#"{"messages":[],"max_tokens":"900"}"#, "bad_max_tokens"),
            (r#"{"messages":[],"max_tokens":900.0}"#, "bad_max_tokens"),
            (r#"{"messages":[],"max_tokens":1e30}"#, "bad_max_tokens"),
            (r#"{"messages":[],"n":"3"}"#, "bad_n"),
            (r#"{"messages":[],"n":3.0}"#, "bad_n"),
            (r#"{"messages":[],"stream":1}"#, "bad_stream"),
            ("{not json", "not_json"),
        ] {
            assert_eq!(reason(body, &none), Some(why), "{body}");
        }
        assert_eq!(reason("not json", &json_type), Some("not_json"));
        let bom = "\u{feff}{\"messages\":[],\"max_tokens\":10}";
        assert!(matches!(counted_body(bom.as_bytes(), &none), Ok(Some(_))));
        for fine in [
            r#"{"messages":[],"max_tokens":900,"n":2,"stream":true,"stream_options":null}"#,
            r#"{"messages":[],"max_tokens":null,"n":null,"stream":null}"#,
        ] {
            assert!(
                matches!(counted_body(fine.as_bytes(), &json_type), Ok(Some(_))),
                "{fine}"
            );
        }
        assert!(matches!(
            counted_body(b"--boundary\r\ncontent-disposition: form-data", &none),
            Ok(None)
        ));
        assert!(matches!(counted_body(b"", &json_type), Ok(None)));
    }

    #[tokio::test]
    async fn c5_an_error_body_is_read_only_up_to_its_bound_and_rejoined_whole() {
        // 100 frames of 1 KiB, read with a 4 KiB bound: at most 5 frames are held.
        let frames = (0..100u8).map(|i| {
            Ok::<_, std::convert::Infallible>(http_body::Frame::data(Bytes::from(vec![i; 1024])))
        });
        let body = http_body_util::StreamBody::new(futures_util::stream::iter(frames));
        let (head, rest) = read_head(body, 4 << 10).await.unwrap();
        assert_eq!(head.len(), 5 << 10);
        let whole = rejoin(head, rest.unwrap())
            .collect()
            .await
            .unwrap()
            .to_bytes();
        assert_eq!(whole.len(), 100 << 10);
        assert!(
            whole
                .chunks(1024)
                .enumerate()
                .all(|(i, c)| c[0] as usize == i)
        );
        // A short body is read whole, with nothing left.
        let (head, rest) = read_head(
            http_body_util::Full::new(Bytes::from_static(b"{}")),
            4 << 10,
        )
        .await
        .unwrap();
        assert_eq!((&head[..], rest.is_none()), (&b"{}"[..], true));
    }
}
