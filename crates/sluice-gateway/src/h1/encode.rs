//! Writing fields and chunks as bytes: what the fast path adds to the heads it sends.

use bytes::Bytes;
use http::Response;
use http_body_util::BodyExt as _;
use sluice_core::Decision;
use sluice_edge::{Plan, RateLimitValue};

/// Writes `date: <now as an HTTP date>\r\n`, as hyper's server adds to every
/// response without one; the text is made at most once a second per worker thread.
pub(super) fn push_date(out: &mut Vec<u8>) {
    thread_local! {
        static DATE: std::cell::RefCell<(u64, String)> =
            const { std::cell::RefCell::new((0, String::new())) };
    }
    let now = std::time::SystemTime::now();
    let secs = now
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    DATE.with_borrow_mut(|(at, text)| {
        if *at != secs || text.is_empty() {
            *at = secs;
            *text = httpdate::fmt_http_date(now);
        }
        push_field(out, b"date", text.as_bytes());
    });
}

/// Appends `data` as one chunk of a chunked body (nothing for no data: an empty
/// chunk would end the body).
pub(super) fn push_chunk(out: &mut Vec<u8>, data: &[u8]) {
    if data.is_empty() {
        return;
    }
    let mut size = [0u8; 16];
    let mut at = size.len();
    let mut n = data.len();
    loop {
        at -= 1;
        size[at] = b"0123456789abcdef"[n & 15];
        n >>= 4;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(&size[at..]);
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(data);
    out.extend_from_slice(b"\r\n");
}

/// `name: value\r\n`.
pub(super) fn push_field(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.extend_from_slice(name);
    out.extend_from_slice(b": ");
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}

/// The rate-limit fields of `decision` (and an LLM call's token fields), as the
/// service stack adds them.
pub(super) fn push_rate_limit_fields(
    out: &mut Vec<u8>,
    decision: &Decision,
    plan: &Plan,
    policy: &sluice_policy::Policy,
) {
    sluice_edge::for_each_rate_limit_header(decision, plan, policy, |name, value| match value {
        RateLimitValue::Number(n) => push_field(
            out,
            name.as_str().as_bytes(),
            itoa::Buffer::new().format(n).as_bytes(),
        ),
        RateLimitValue::Text(text) => {
            if http::HeaderValue::from_str(text).is_ok() {
                push_field(out, name.as_str().as_bytes(), text.as_bytes());
            }
        }
    });
    // An LLM call's token fields, in its API's dialect (SPEC T5).
    sluice_edge::dialect::for_each_token_header(decision, plan, policy, |name, value| {
        push_field(out, name.as_str().as_bytes(), value.as_bytes());
    });
}

/// An answer of sluice's own, its body collected (one that fails to read answers
/// empty: sluice's own bodies are whole in memory).
pub(super) async fn own<B>(answer: Response<B>) -> Response<Bytes>
where
    B: http_body::Body<Data = Bytes>,
{
    let (parts, body) = answer.into_parts();
    let body = body
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    Response::from_parts(parts, body)
}
