//! Streamed chat completions through the proxy: the usage the pacer needs
//! asked for when the client did not ask (`stream_options.include_usage`),
//! and the chunk that carries it taken out of the stream again for that
//! client, which never asked to see it.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use serde_json::Value;

/// The longest event [`HideUsage`] holds back while it looks for the end
/// of it; a longer one passes on as it comes (it is not a usage chunk).
pub(crate) const MAX_EVENT: usize = 64 << 10;

/// The body to send instead of `body` for a streamed OpenAI-style
/// completion (`POST …/chat/completions` or `…/completions` with
/// `"stream": true`) whose client did not ask for usage: the same request
/// with `stream_options.include_usage` set. `None`: send it as it is (not
/// such a request, or the client asked).
pub(crate) fn ask_for_usage(path: &str, body: &[u8]) -> Option<Bytes> {
    if !(path.ends_with("/chat/completions") || path.ends_with("/completions")) {
        return None;
    }
    let mut v: Value = serde_json::from_slice(body).ok()?;
    let obj = v.as_object_mut()?;
    if obj.get("stream").and_then(Value::as_bool) != Some(true) {
        return None;
    }
    let options = obj
        .entry("stream_options")
        .or_insert_with(|| Value::Object(serde_json::Map::new()));
    if options.is_null() {
        // OpenAI reads `null` as absent.
        *options = Value::Object(serde_json::Map::new());
    }
    // A `stream_options` that is not an object is the provider's to refuse.
    let options = options.as_object_mut()?;
    if options.get("include_usage").and_then(Value::as_bool) == Some(true) {
        return None;
    }
    options.insert("include_usage".to_owned(), Value::Bool(true));
    serde_json::to_vec(&v).ok().map(Bytes::from)
}

/// Whether one server-sent event is OpenAI's usage chunk: data whose JSON
/// has `"choices": []` and a `usage` object.
fn is_usage_event(event: &[u8]) -> bool {
    let Ok(text) = std::str::from_utf8(event) else {
        return false;
    };
    let mut data = String::new();
    for line in text.lines() {
        if let Some(d) = line.strip_prefix("data:") {
            if !data.is_empty() {
                data.push('\n');
            }
            data.push_str(d.strip_prefix(' ').unwrap_or(d));
        }
    }
    let Ok(v) = serde_json::from_str::<Value>(&data) else {
        return false;
    };
    v.get("choices")
        .and_then(Value::as_array)
        .is_some_and(Vec::is_empty)
        && v.get("usage").is_some_and(Value::is_object)
}

/// The end of the last whole event in `buf` (just past its blank line:
/// `\n\n`, `\r\n\r\n` or `\r\r`), looking from `from` on, if any.
fn last_boundary(buf: &[u8], from: usize) -> Option<usize> {
    let mut end = None;
    let mut i = from;
    while i + 1 < buf.len() {
        let n = match (buf[i], buf[i + 1], buf.get(i + 2), buf.get(i + 3)) {
            (b'\r', b'\n', Some(b'\r'), Some(b'\n')) => 4,
            (b'\n', b'\n', _, _) | (b'\r', b'\r', _, _) => 2,
            _ => 0,
        };
        if n > 0 {
            i += n;
            end = Some(i);
        } else {
            i += 1;
        }
    }
    end
}

/// Splits whole events (each with its blank line) off the front of `done`.
fn events(done: &[u8]) -> Vec<&[u8]> {
    let mut out = Vec::new();
    let mut start = 0;
    while start < done.len() {
        let end = first_boundary(&done[start..]).map_or(done.len(), |e| start + e);
        out.push(&done[start..end]);
        start = end;
    }
    out
}

/// The end of the first whole event in `buf`, if any.
fn first_boundary(buf: &[u8]) -> Option<usize> {
    let mut i = 0;
    while i + 1 < buf.len() {
        match (buf[i], buf[i + 1], buf.get(i + 2), buf.get(i + 3)) {
            (b'\r', b'\n', Some(b'\r'), Some(b'\n')) => return Some(i + 4),
            (b'\n', b'\n', _, _) | (b'\r', b'\r', _, _) => return Some(i + 2),
            _ => i += 1,
        }
    }
    None
}

/// A server-sent event stream less its usage chunk: whole events pass on
/// as soon as they are complete, the usage chunk never does, however the
/// bytes were cut on the way (an event cut across reads is held until its
/// end comes, [`MAX_EVENT`] at most).
pub(crate) struct HideUsage<B> {
    inner: Pin<Box<B>>,
    held: BytesMut,
    /// Where to look for an event's end next in `held` (what came before
    /// holds none).
    scanned: usize,
    ended: bool,
}

impl<B> HideUsage<B> {
    /// `inner` less its usage chunk.
    pub(crate) fn new(inner: B) -> Self {
        HideUsage {
            inner: Box::pin(inner),
            held: BytesMut::new(),
            scanned: 0,
            ended: false,
        }
    }

    /// The whole events held, less the usage chunk (empty when none is
    /// whole yet, or all were the usage chunk).
    fn whole_events(&mut self) -> Bytes {
        let Some(end) = last_boundary(&self.held, self.scanned) else {
            if self.held.len() > MAX_EVENT {
                self.scanned = 0;
                return self.held.split().freeze();
            }
            // A blank line may start in the last 3 bytes and end in the next.
            self.scanned = self.held.len().saturating_sub(3);
            return Bytes::new();
        };
        self.scanned = 0;
        let done = self.held.split_to(end).freeze();
        let kept: Vec<&[u8]> = events(&done)
            .into_iter()
            .filter(|e| !is_usage_event(e))
            .collect();
        if kept.iter().map(|e| e.len()).sum::<usize>() == done.len() {
            return done;
        }
        Bytes::from(kept.concat())
    }
}

impl<B> Body for HideUsage<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        loop {
            if this.ended {
                if this.held.is_empty() {
                    return Poll::Ready(None);
                }
                // What is left never ended with a blank line: pass it on
                // unless it is the usage chunk.
                let rest = this.held.split().freeze();
                this.scanned = 0;
                if is_usage_event(&rest) {
                    return Poll::Ready(None);
                }
                return Poll::Ready(Some(Ok(Frame::data(rest))));
            }
            match this.inner.as_mut().poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) => {
                        this.held.extend_from_slice(&data);
                        let out = this.whole_events();
                        if !out.is_empty() {
                            return Poll::Ready(Some(Ok(Frame::data(out))));
                        }
                    }
                    // Trailers pass on, after what is held.
                    Err(frame) => {
                        if this.held.is_empty() {
                            return Poll::Ready(Some(Ok(frame)));
                        }
                        let rest = this.held.split().freeze();
                        this.scanned = 0;
                        return Poll::Ready(Some(Ok(Frame::data(rest))));
                    }
                },
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(e))),
                Poll::Ready(None) => this.ended = true,
                Poll::Pending => return Poll::Pending,
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended && self.held.is_empty()
    }

    fn size_hint(&self) -> SizeHint {
        // Bytes may be taken out: no exact size.
        SizeHint::default()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use http_body_util::{BodyExt, StreamBody};
    use serde_json::json;

    use super::*;

    const STREAM: &str = concat!(
        "data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"}}],\"usage\":null}\n\n",
        "data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}],\"usage\":null}\n\n",
        "data: {\"id\":\"c1\",\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":2,\"total_tokens\":11}}\n\n",
        "data: [DONE]\n\n",
    );

    fn without_usage() -> String {
        STREAM
            .split_inclusive("\n\n")
            .filter(|e| !e.contains("\"choices\":[]"))
            .collect()
    }

    async fn through(pieces: Vec<Bytes>) -> String {
        let s = futures_util::stream::iter(
            pieces
                .into_iter()
                .map(|b| Ok::<_, std::convert::Infallible>(Frame::data(b))),
        );
        let body = HideUsage::new(StreamBody::new(s));
        let out = body.collect().await.unwrap().to_bytes();
        String::from_utf8(out.to_vec()).unwrap()
    }

    #[tokio::test]
    async fn c6_the_usage_chunk_is_hidden_however_the_stream_is_cut() {
        let bytes = STREAM.as_bytes();
        // Whole, then cut in two at every byte, then one byte at a time.
        assert_eq!(through(vec![Bytes::from(STREAM)]).await, without_usage());
        for cut in 1..bytes.len() {
            let got = through(vec![
                Bytes::copy_from_slice(&bytes[..cut]),
                Bytes::copy_from_slice(&bytes[cut..]),
            ])
            .await;
            assert_eq!(got, without_usage(), "cut at {cut}");
        }
        let single: Vec<Bytes> = bytes
            .iter()
            .map(|b| Bytes::copy_from_slice(&[*b]))
            .collect();
        assert_eq!(through(single).await, without_usage());
        // CRLF line ends too.
        let crlf = STREAM.replace('\n', "\r\n");
        let got = through(vec![Bytes::from(crlf.clone())]).await;
        assert!(
            !got.contains("total_tokens") && got.ends_with("data: [DONE]\r\n\r\n"),
            "{got}"
        );
    }

    #[tokio::test]
    async fn c6_an_overlong_event_passes_on_and_nothing_else_is_touched() {
        let long = format!("data: {}", "x".repeat(MAX_EVENT + 10));
        let got = through(vec![
            Bytes::from(long.clone()),
            Bytes::from("\n\ndata: [DONE]\n\n"),
        ])
        .await;
        assert_eq!(got, format!("{long}\n\ndata: [DONE]\n\n"));
        // A stream without a usage chunk is passed on byte for byte.
        let plain = "event: ping\ndata: {}\n\ndata: {\"choices\":[{}]}\n\n";
        assert_eq!(through(vec![Bytes::from(plain)]).await, plain);
    }

    #[test]
    fn c6_usage_is_asked_for_only_on_a_stream_whose_client_did_not() {
        let ask = |path: &str, v: Value| {
            ask_for_usage(path, v.to_string().as_bytes())
                .map(|b| serde_json::from_slice::<Value>(&b).unwrap())
        };
        let stream = json!({"model":"gpt-4o","stream":true,"messages":[]});
        let asked = ask("/v1/chat/completions", stream.clone()).unwrap();
        assert_eq!(asked["stream_options"]["include_usage"], true);
        assert_eq!(asked["model"], "gpt-4o");
        // `null` options are absent, as OpenAI reads them (before, the stream
        // went unasked and its reservation was never settled).
        let mut null = stream.clone();
        null["stream_options"] = Value::Null;
        let asked = ask("/v1/chat/completions", null).unwrap();
        assert_eq!(asked["stream_options"], json!({"include_usage": true}));
        // Other options are kept; an explicit false is the client not asking.
        let mut other = stream.clone();
        other["stream_options"] = json!({"include_obfuscation": false, "include_usage": false});
        let asked = ask("/chat/completions", other).unwrap();
        assert_eq!(
            asked["stream_options"],
            json!({"include_obfuscation": false, "include_usage": true})
        );
        // Left alone: the client asked, no stream, another path, not JSON.
        let mut wants = stream.clone();
        wants["stream_options"] = json!({"include_usage": true});
        assert!(ask("/v1/chat/completions", wants).is_none());
        assert!(
            ask(
                "/v1/chat/completions",
                json!({"model":"gpt-4o","messages":[]})
            )
            .is_none()
        );
        assert!(ask("/v1/messages", stream).is_none());
        assert!(ask_for_usage("/v1/chat/completions", b"{not json").is_none());
        assert!(
            ask(
                "/v1/chat/completions",
                json!({"stream":true,"stream_options":"x"})
            )
            .is_none()
        );
    }
}
