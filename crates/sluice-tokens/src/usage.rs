//! The tokens an answer actually used: `usage` in a JSON answer,
//! or in the events of a streamed one (OpenAI's last chunk, Anthropic's
//! `message_start` / `message_delta`), read from one document
//! ([`usage_from_json`]), from bytes as they come ([`UsageScanner`]) or as
//! the body passes through unchanged (`UsageTap`, feature `body`).

use serde_json::Value;

/// The longest SSE line kept while looking for usage; longer lines pass
/// through unread.
const MAX_LINE: usize = 1 << 20;
/// The largest JSON answer kept to read its usage.
const MAX_JSON: usize = 8 << 20;

/// Tokens an answer used.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Input tokens (`prompt_tokens` / `input_tokens` + cache writes).
    pub prompt: u32,
    /// Output tokens (`completion_tokens` / `output_tokens`).
    pub completion: u32,
}

impl Usage {
    /// Input plus output.
    pub fn total(&self) -> u32 {
        self.prompt.saturating_add(self.completion)
    }

    fn merge(&mut self, other: Usage) {
        self.prompt = self.prompt.max(other.prompt);
        self.completion = self.completion.max(other.completion);
    }
}

fn field(u: &Value, k: &str) -> Option<u32> {
    u.get(k)
        .and_then(Value::as_u64)
        .map(|n| u32::try_from(n).unwrap_or(u32::MAX))
}

/// The usage in one JSON document (an answer or one streamed event), in
/// either provider's shape.
pub fn usage_from_json(v: &Value) -> Option<Usage> {
    let u = v.get("usage").filter(|u| u.is_object()).or_else(|| {
        v.get("message")
            .and_then(|m| m.get("usage"))
            .filter(|u| u.is_object())
    })?;
    let prompt = field(u, "prompt_tokens").or_else(|| {
        let input = field(u, "input_tokens")?;
        Some(input.saturating_add(field(u, "cache_creation_input_tokens").unwrap_or(0)))
    });
    let completion = field(u, "completion_tokens").or_else(|| field(u, "output_tokens"));
    if prompt.is_none() && completion.is_none() {
        return field(u, "total_tokens").map(|t| Usage {
            prompt: t,
            completion: 0,
        });
    }
    Some(Usage {
        prompt: prompt.unwrap_or(0),
        completion: completion.unwrap_or(0),
    })
}

/// Reads usage from an answer's bytes as they pass.
#[derive(Debug)]
pub struct UsageScanner {
    sse: bool,
    buf: Vec<u8>,
    skipping: bool,
    found: Option<Usage>,
}

impl UsageScanner {
    /// A scanner for an answer of this `Content-Type` (server-sent events,
    /// or one JSON document).
    pub fn new(content_type: Option<&str>) -> Self {
        UsageScanner {
            sse: content_type.is_some_and(|c| c.starts_with("text/event-stream")),
            buf: Vec::new(),
            skipping: false,
            found: None,
        }
    }

    /// Feeds the next bytes.
    pub fn feed(&mut self, chunk: &[u8]) {
        if !self.sse {
            if self.buf.len() + chunk.len() <= MAX_JSON {
                self.buf.extend_from_slice(chunk);
            } else {
                self.skipping = true;
            }
            return;
        }
        let mut rest = chunk;
        while let Some(i) = rest.iter().position(|&b| b == b'\n') {
            if !self.skipping {
                self.buf.extend_from_slice(&rest[..i]);
                let line = std::mem::take(&mut self.buf);
                self.line(&line);
            }
            self.skipping = false;
            rest = &rest[i + 1..];
        }
        if !self.skipping {
            if self.buf.len() + rest.len() > MAX_LINE {
                self.buf.clear();
                self.skipping = true;
            } else {
                self.buf.extend_from_slice(rest);
            }
        }
    }

    fn line(&mut self, line: &[u8]) {
        let Some(data) = line.strip_prefix(b"data:") else {
            return;
        };
        if !contains(data, b"\"usage\"") {
            return;
        }
        if let Ok(v) = serde_json::from_slice::<Value>(data)
            && let Some(u) = usage_from_json(&v)
        {
            self.found.get_or_insert_with(Usage::default).merge(u);
        }
    }

    /// The usage seen, once the answer has ended.
    pub fn finish(&mut self) -> Option<Usage> {
        if self.sse {
            let line = std::mem::take(&mut self.buf);
            if !self.skipping {
                self.line(&line);
            }
            return self.found;
        }
        if self.skipping {
            return None;
        }
        let v: Value = serde_json::from_slice(&std::mem::take(&mut self.buf)).ok()?;
        usage_from_json(&v)
    }
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

#[cfg(feature = "body")]
pub use tap::{OnUsage, UsageTap};

/// The body that reads usage as it passes (feature `body`).
#[cfg(feature = "body")]
mod tap {
    use std::pin::Pin;
    use std::task::{Context, Poll};

    use bytes::Bytes;
    use http_body::{Body, Frame, SizeHint};

    use super::{Usage, UsageScanner};

    /// What a [`UsageTap`] calls once, when the answer ends (with the usage it
    /// saw) or is dropped unfinished (with what it saw so far, usually `None`).
    pub type OnUsage = Box<dyn FnOnce(Option<Usage>, bool) + Send + Sync>;

    /// A body that passes every frame through unchanged and unbuffered while a
    /// [`UsageScanner`] reads it; calls its [`OnUsage`] with `complete = true`
    /// at the end of the stream, or `false` when dropped before.
    pub struct UsageTap<B> {
        inner: Pin<Box<B>>,
        scanner: UsageScanner,
        on_usage: Option<OnUsage>,
    }

    impl<B> std::fmt::Debug for UsageTap<B> {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("UsageTap")
                .field("scanner", &self.scanner)
                .finish()
        }
    }

    impl<B> UsageTap<B> {
        /// Taps `inner`, an answer of this `Content-Type`.
        pub fn new(inner: B, content_type: Option<&str>, on_usage: OnUsage) -> Self {
            UsageTap {
                inner: Box::pin(inner),
                scanner: UsageScanner::new(content_type),
                on_usage: Some(on_usage),
            }
        }

        fn fire(&mut self, complete: bool) {
            if let Some(f) = self.on_usage.take() {
                f(self.scanner.finish(), complete);
            }
        }
    }

    impl<B> Body for UsageTap<B>
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
            match this.inner.as_mut().poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    if let Some(data) = frame.data_ref() {
                        this.scanner.feed(data);
                    }
                    Poll::Ready(Some(Ok(frame)))
                }
                Poll::Ready(None) => {
                    this.fire(true);
                    Poll::Ready(None)
                }
                other => other,
            }
        }

        fn is_end_stream(&self) -> bool {
            self.inner.is_end_stream()
        }

        fn size_hint(&self) -> SizeHint {
            self.inner.size_hint()
        }
    }

    impl<B> Drop for UsageTap<B> {
        fn drop(&mut self) {
            self.fire(false);
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn c6_usage_in_both_shapes() {
        let openai = json!({"usage":{"prompt_tokens":12,"completion_tokens":30,"total_tokens":42}});
        assert_eq!(
            usage_from_json(&openai),
            Some(Usage {
                prompt: 12,
                completion: 30
            })
        );
        let anthropic = json!({"usage":{"input_tokens":10,"cache_creation_input_tokens":5,"cache_read_input_tokens":100,"output_tokens":7}});
        assert_eq!(
            usage_from_json(&anthropic),
            Some(Usage {
                prompt: 15,
                completion: 7
            })
        );
        assert_eq!(usage_from_json(&json!({"usage":null})), None);
    }

    #[test]
    fn c6_usage_from_the_last_chunk_of_a_stream_split_anywhere() {
        let stream = concat!(
            "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n",
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":4}}\n\n",
            "data: [DONE]\n\n"
        );
        for cut in 0..stream.len() {
            let mut s = UsageScanner::new(Some("text/event-stream; charset=utf-8"));
            s.feed(&stream.as_bytes()[..cut]);
            s.feed(&stream.as_bytes()[cut..]);
            assert_eq!(
                s.finish(),
                Some(Usage {
                    prompt: 9,
                    completion: 4
                }),
                "cut at {cut}"
            );
        }
        let anthropic = concat!(
            "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":25,\"output_tokens\":1}}}\n\n",
            "event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":15}}\n\n"
        );
        let mut s = UsageScanner::new(Some("text/event-stream"));
        s.feed(anthropic.as_bytes());
        assert_eq!(
            s.finish(),
            Some(Usage {
                prompt: 25,
                completion: 15
            })
        );
    }

    #[cfg(feature = "body")]
    #[tokio::test]
    async fn tap_passes_bytes_unchanged_and_reports_once() {
        use std::sync::{Arc, Mutex};

        use bytes::Bytes;
        use http_body_util::{BodyExt, Full};

        let seen = Arc::new(Mutex::new(Vec::new()));
        let s2 = seen.clone();
        let body = Full::new(Bytes::from_static(
            br#"{"usage":{"prompt_tokens":1,"completion_tokens":2}}"#,
        ));
        let tap = UsageTap::new(
            body,
            Some("application/json"),
            Box::new(move |u, complete| s2.lock().unwrap().push((u, complete))),
        );
        let bytes = tap.collect().await.unwrap().to_bytes();
        assert!(bytes.starts_with(b"{\"usage\""));
        assert_eq!(
            *seen.lock().unwrap(),
            vec![(
                Some(Usage {
                    prompt: 1,
                    completion: 2
                }),
                true
            )]
        );
    }
}
