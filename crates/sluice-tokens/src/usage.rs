//! The tokens an answer actually used: `usage` in a JSON answer,
//! or in the events of a streamed one (OpenAI's last chunk, the Responses
//! API's `response.completed`, Anthropic's `message_start` /
//! `message_delta`), read from one document ([`usage_from_json`]), from
//! bytes as they come ([`UsageScanner`]) or as the body passes through
//! unchanged (`UsageTap`, feature `body`).

use serde_json::Value;

mod document;

use document::DocumentScanner;

/// The longest SSE line kept whole while looking for usage; a longer `data:`
/// line is read as it passes, its usage parts alone kept
/// ([`DocumentScanner`]), and any other longer line passes unread.
const MAX_LINE: usize = 1 << 20;

/// Tokens an answer used.
///
/// [`prompt`](Self::prompt) is the whole input, whatever the provider's
/// shape: OpenAI's `prompt_tokens` (which includes cached tokens), or
/// Anthropic's `input_tokens` + `cache_creation_input_tokens` +
/// `cache_read_input_tokens` (its `input_tokens` leaves both cache parts
/// out). [`cached_input`](Self::cached_input) is the part of it read from a
/// cache, never more than `prompt`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Input tokens, all of them (`prompt_tokens`, or `input_tokens` + cache
    /// writes + cache reads).
    pub prompt: u32,
    /// Output tokens (`completion_tokens` / `output_tokens`).
    pub completion: u32,
    /// The part of [`prompt`](Self::prompt) read from a cache: OpenAI's
    /// `prompt_tokens_details.cached_tokens` (chat) or
    /// `input_tokens_details.cached_tokens` (Responses API), Anthropic's
    /// `cache_read_input_tokens`.
    pub cached_input: u32,
    /// The part of [`prompt`](Self::prompt) the provider does not count
    /// toward its input rate limits: Anthropic's cache reads; 0 for OpenAI,
    /// which counts cached tokens too. See [`Usage::rate_limited_input`].
    pub rate_exempt_input: u32,
}

impl Usage {
    /// Input plus output.
    pub fn total(&self) -> u32 {
        self.prompt.saturating_add(self.completion)
    }

    /// The input the provider counts toward its rate limits (TPM, ITPM):
    /// [`prompt`](Self::prompt) less
    /// [`rate_exempt_input`](Self::rate_exempt_input).
    pub fn rate_limited_input(&self) -> u32 {
        self.prompt.saturating_sub(self.rate_exempt_input)
    }

    /// True when the usage counts some input: one that counts none is no
    /// reading of what a call spent (see [`usage_from_json`]).
    pub fn counts_input(&self) -> bool {
        self.prompt > 0
    }

    /// Folds in another reading of the same answer (a stream reports usage
    /// more than once, some fields only in one event): the larger of each.
    fn merge(&mut self, other: Usage) {
        self.prompt = self.prompt.max(other.prompt);
        self.completion = self.completion.max(other.completion);
        self.cached_input = self.cached_input.max(other.cached_input);
        self.rate_exempt_input = self.rate_exempt_input.max(other.rate_exempt_input);
    }
}

/// A count in `usage`: a non-negative integer, saturated to `u32::MAX`;
/// anything else (negative, fractional, not a number) is not a count.
fn field(u: &Value, k: &str) -> Option<u32> {
    u.get(k)
        .and_then(Value::as_u64)
        .map(|n| u32::try_from(n).unwrap_or(u32::MAX))
}

/// The usage in one JSON document (an answer), in either provider's shape;
/// `None` when it has none. Counts that are not non-negative integers are
/// ignored; counts above `u32::MAX` saturate. A usage that counts no input
/// (none reported, or 0) is none: every call reads some, and an answer that
/// reports only its output has not said what it spent (SPEC T3: such a call
/// is charged its reservation, never less).
pub fn usage_from_json(v: &Value) -> Option<Usage> {
    usage_in(v).filter(Usage::counts_input)
}

/// [`usage_from_json`] of one part of an answer (a streamed event, which may
/// report its output alone), without the check that it counts input.
fn usage_in(v: &Value) -> Option<Usage> {
    // At the top (an answer, OpenAI's chunks, Anthropic's `message_delta`),
    // in Anthropic's `message_start` or the Responses API's
    // `response.completed` event.
    let u = v.get("usage").filter(|u| u.is_object()).or_else(|| {
        ["message", "response"].iter().find_map(|k| {
            v.get(*k)
                .and_then(|m| m.get("usage"))
                .filter(|u| u.is_object())
        })
    })?;
    // Anthropic's cache reads: outside its `input_tokens`, and outside its
    // input rate limits.
    let cache_read = field(u, "cache_read_input_tokens").unwrap_or(0);
    let prompt = field(u, "prompt_tokens").or_else(|| {
        let input = field(u, "input_tokens")?;
        Some(
            input
                .saturating_add(field(u, "cache_creation_input_tokens").unwrap_or(0))
                .saturating_add(cache_read),
        )
    });
    let completion = field(u, "completion_tokens").or_else(|| field(u, "output_tokens"));
    if prompt.is_none() && completion.is_none() {
        return field(u, "total_tokens").map(|t| Usage {
            prompt: t,
            ..Usage::default()
        });
    }
    let prompt = prompt.unwrap_or(0);
    // OpenAI's cached tokens: inside `prompt_tokens` / `input_tokens`.
    let openai_cached = ["prompt_tokens_details", "input_tokens_details"]
        .iter()
        .filter_map(|d| u.get(*d).and_then(|d| field(d, "cached_tokens")))
        .max()
        .unwrap_or(0);
    Some(Usage {
        prompt,
        completion: completion.unwrap_or(0),
        cached_input: cache_read.max(openai_cached).min(prompt),
        rate_exempt_input: cache_read.min(prompt),
    })
}

/// Reads usage from an answer's bytes as they pass.
#[derive(Debug)]
pub struct UsageScanner {
    sse: bool,
    /// A JSON answer's usage parts, read as they pass (never the whole answer).
    document: DocumentScanner,
    buf: Vec<u8>,
    skipping: bool,
    /// A `data:` line longer than [`MAX_LINE`], read as it passes (the
    /// Responses API's `response.completed` carries the whole response).
    long: Option<DocumentScanner>,
    found: Option<Usage>,
    /// A stream's usage is its answer's only once an event that closes the
    /// count has carried it: Anthropic's `message_start` reports the input
    /// and one output token before any is written, and a stream cut after it
    /// has not said what it spent (SPEC T3: charged its reservation).
    settled: bool,
}

impl UsageScanner {
    /// A scanner for an answer of this `Content-Type` (server-sent events,
    /// or one JSON document).
    pub fn new(content_type: Option<&str>) -> Self {
        UsageScanner {
            sse: content_type.is_some_and(|c| is_event_stream(c.as_bytes())),
            document: DocumentScanner::default(),
            buf: Vec::new(),
            skipping: false,
            long: None,
            found: None,
            settled: false,
        }
    }

    /// Feeds the next bytes.
    pub fn feed(&mut self, chunk: &[u8]) {
        if !self.sse {
            self.document.feed(chunk);
            return;
        }
        let mut rest = chunk;
        while let Some(i) = memchr::memchr(b'\n', rest) {
            self.push(&rest[..i]);
            self.end_line();
            rest = &rest[i + 1..];
        }
        self.push(rest);
    }

    /// Adds `bytes` to the line being read: to a long line's scanner, or held.
    fn push(&mut self, bytes: &[u8]) {
        if let Some(long) = &mut self.long {
            long.feed(bytes);
        } else if !self.skipping {
            self.hold(bytes);
        }
    }

    /// The line being read has ended: its usage, if it is one that has some.
    fn end_line(&mut self) {
        if let Some(long) = self.long.take() {
            self.long_line(long);
        } else if !self.skipping {
            let line = std::mem::take(&mut self.buf);
            self.line(&line);
        }
        self.skipping = false;
    }

    /// Adds `bytes` of the line being read to what is held of it; past
    /// [`MAX_LINE`], a `data:` line goes on as a long one, any other is skipped.
    fn hold(&mut self, bytes: &[u8]) {
        let room = MAX_LINE.saturating_sub(self.buf.len());
        if bytes.len() <= room {
            self.buf.extend_from_slice(bytes);
            return;
        }
        self.buf.extend_from_slice(&bytes[..room]);
        if let Some(data) = self.buf.strip_prefix(b"data:") {
            let mut long = DocumentScanner::default();
            long.feed(data);
            long.feed(&bytes[room..]);
            self.long = Some(long);
        } else {
            self.skipping = true;
        }
        self.buf.clear();
    }

    /// The usage of a long `data:` line, once it has ended. Such an event is
    /// taken to close the count (an event that opens one, Anthropic's
    /// `message_start`, is a few hundred bytes).
    fn long_line(&mut self, mut long: DocumentScanner) {
        if let Some(u) = long.parts().and_then(|p| usage_in(&Value::Object(p))) {
            self.found.get_or_insert_with(Usage::default).merge(u);
            self.settled = true;
        }
    }

    fn line(&mut self, line: &[u8]) {
        let Some(data) = line.strip_prefix(b"data:") else {
            return;
        };
        if !contains(data, b"\"usage\"") {
            return;
        }
        if let Some((u, opening)) = usage_of_event(data) {
            self.found.get_or_insert_with(Usage::default).merge(u);
            self.settled |= !opening;
        }
    }

    /// The usage seen, once the answer has ended.
    pub fn finish(&mut self) -> Option<Usage> {
        if self.sse {
            self.end_line();
            return self.found.filter(|u| self.settled && u.counts_input());
        }
        usage_from_json(&Value::Object(self.document.parts()?))
    }
}

/// True when a `Content-Type` value is `text/event-stream` (parameters aside,
/// in any case: media types are compared without case, RFC 9110 §8.3.1).
pub fn is_event_stream(content_type: &[u8]) -> bool {
    content_type
        .get(..17)
        .is_some_and(|t| t.eq_ignore_ascii_case(b"text/event-stream"))
}

/// The parts of a JSON document [`usage_from_json`] reads; the rest (an answer's
/// `choices`, its text) is skipped without being built.
#[derive(serde::Deserialize)]
struct UsageParts {
    #[serde(default)]
    usage: Option<Value>,
    #[serde(default)]
    message: Option<Value>,
    #[serde(default)]
    response: Option<Value>,
    /// A streamed event's type (Anthropic's `message_start`, …).
    #[serde(default, rename = "type")]
    kind: Option<Value>,
}

/// [`usage_from_json`] of the JSON document `bytes`, reading only its usage
/// parts. A document that is not JSON, or names a part twice, has none.
#[cfg(test)]
fn usage_of_document(bytes: &[u8]) -> Option<Usage> {
    usage_of_event(bytes)
        .map(|(usage, _)| usage)
        .filter(Usage::counts_input)
}

/// [`usage_of_document`] of one streamed event, and whether the event opens
/// the answer (Anthropic's `message_start`, whose usage counts no output yet).
fn usage_of_event(bytes: &[u8]) -> Option<(Usage, bool)> {
    let parts: UsageParts = serde_json::from_slice(bytes).ok()?;
    let opening = parts
        .kind
        .as_ref()
        .is_some_and(|k| k.as_str() == Some("message_start"));
    let mut doc = serde_json::Map::new();
    for (key, part) in [
        ("usage", parts.usage),
        ("message", parts.message),
        ("response", parts.response),
    ] {
        if let Some(part) = part {
            doc.insert(key.to_owned(), part);
        }
    }
    usage_in(&Value::Object(doc)).map(|usage| (usage, opening))
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    memchr::memmem::find(hay, needle).is_some()
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
                completion: 30,
                ..Usage::default()
            })
        );
        let anthropic = json!({"usage":{"input_tokens":10,"cache_creation_input_tokens":5,"cache_read_input_tokens":100,"output_tokens":7}});
        assert_eq!(
            usage_from_json(&anthropic),
            Some(Usage {
                prompt: 115,
                completion: 7,
                cached_input: 100,
                rate_exempt_input: 100,
            })
        );
        // What the provider's rate limits count: the cache reads left out.
        assert_eq!(
            usage_from_json(&anthropic).unwrap().rate_limited_input(),
            15
        );
        assert_eq!(usage_from_json(&json!({"usage":null})), None);
    }

    /// SPEC T3, fail closed: a usage that counts no input (none reported, or
    /// 0) is no usage, in one document or over a stream's events; Anthropic's
    /// output-only `message_delta` still counts once `message_start` gave the
    /// input.
    #[test]
    fn t3_a_usage_that_counts_no_input_is_none() {
        for usage in [
            json!({"usage":{"completion_tokens":30}}),
            json!({"usage":{"prompt_tokens":0,"completion_tokens":30}}),
            json!({"usage":{"output_tokens":30}}),
            json!({"usage":{"total_tokens":0}}),
        ] {
            assert_eq!(usage_from_json(&usage), None, "{usage}");
            let doc = usage.to_string();
            assert_eq!(scan("application/json", &[&doc]), None, "{usage}");
            let event = format!("data: {doc}\n\ndata: [DONE]\n\n");
            assert_eq!(scan("text/event-stream", &[&event]), None, "{usage}");
        }
        let delta_alone = "event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":15}}\n\n";
        assert_eq!(scan("text/event-stream", &[delta_alone]), None);
        let start = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":25,\"output_tokens\":1}}}\n\n";
        let whole = scan("text/event-stream", &[start, delta_alone]).expect("usage");
        assert_eq!((whole.prompt, whole.completion), (25, 15));
        // Embeddings report input alone: a usage.
        let embeddings = json!({"usage":{"prompt_tokens":8,"total_tokens":8}});
        assert_eq!(usage_from_json(&embeddings).map(|u| u.prompt), Some(8));
    }

    #[test]
    fn c6_usage_from_the_last_chunk_of_a_stream_split_anywhere() {
        let stream = concat!(
            "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n",
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":4}}\n\n",
            "data: [DONE]\n\n"
        );
        // A media type is compared without case (RFC 9110 §8.3.1).
        for content_type in ["Text/Event-Stream", "TEXT/EVENT-STREAM; charset=utf-8"] {
            let mut s = UsageScanner::new(Some(content_type));
            s.feed(stream.as_bytes());
            assert_eq!(s.finish().map(|u| u.completion), Some(4), "{content_type}");
        }
        assert!(!is_event_stream(b"text/event-strea"));
        assert!(!is_event_stream(b"application/json"));
        for cut in 0..stream.len() {
            let mut s = UsageScanner::new(Some("text/event-stream; charset=utf-8"));
            s.feed(&stream.as_bytes()[..cut]);
            s.feed(&stream.as_bytes()[cut..]);
            assert_eq!(
                s.finish(),
                Some(Usage {
                    prompt: 9,
                    completion: 4,
                    ..Usage::default()
                }),
                "cut at {cut}"
            );
        }
        // A `response.completed` event past the longest line held whole (its
        // response echoes 3 MiB of instructions): read as it passes, in pieces of
        // any size, without newline at the end too.
        let long = format!(
            "event: response.completed\ndata: {{\"type\":\"response.completed\",\"response\":{{\"instructions\":\"{}\",\"usage\":{{\"input_tokens\":300,\"output_tokens\":50000}}}}}}",
            "x".repeat(3 << 20)
        );
        for (piece, ending) in [(1 << 16, "\n\n"), (1000, ""), (MAX_LINE + 7, "\n")] {
            let mut s = UsageScanner::new(Some("text/event-stream"));
            for part in format!("{long}{ending}").as_bytes().chunks(piece) {
                s.feed(part);
            }
            assert_eq!(
                s.finish(),
                Some(Usage {
                    prompt: 300,
                    completion: 50000,
                    ..Usage::default()
                }),
                "pieces of {piece}"
            );
        }
        // A long line that is not data passes unread; the next line is read.
        let mut s = UsageScanner::new(Some("text/event-stream"));
        s.feed(format!(": {}\n", "y".repeat(MAX_LINE * 2)).as_bytes());
        s.feed(
            b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":4}}\n\n",
        );
        assert_eq!(s.finish().map(|u| (u.prompt, u.completion)), Some((3, 4)));
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
                completion: 15,
                ..Usage::default()
            })
        );
    }

    /// SPEC T3: an Anthropic stream cut after `message_start` (its usage
    /// counts the input and one output token, before any is written) has not
    /// said what it spent: no usage, so the call is charged its reservation,
    /// however much text it relayed. Once `message_delta` carries the count,
    /// the usage is the answer's.
    #[test]
    fn t3_an_anthropic_stream_cut_after_message_start_has_no_usage() {
        let start = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":25,\"output_tokens\":1}}}\n\n";
        let text = "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"a long answer\"}}\n\n";
        let delta = "event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":7999}}\n\n";
        assert_eq!(scan("text/event-stream", &[start, text, text]), None);
        assert_eq!(
            scan("text/event-stream", &[start, text, delta]),
            Some(Usage {
                prompt: 25,
                completion: 7999,
                ..Usage::default()
            })
        );
        // An OpenAI stream's one usage chunk, and the Responses API's
        // `response.completed`, close the count.
        let chunk =
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":4}}\n\n";
        assert!(scan("text/event-stream", &[chunk]).is_some());
        let completed = "event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"usage\":{\"input_tokens\":9,\"output_tokens\":4}}}\n\n";
        assert!(scan("text/event-stream", &[completed]).is_some());
    }

    fn scan(content_type: &str, parts: &[&str]) -> Option<Usage> {
        let mut s = UsageScanner::new(Some(content_type));
        for p in parts {
            s.feed(p.as_bytes());
        }
        s.finish()
    }

    #[test]
    fn openai_chat_usage_with_cached_tokens() {
        let answer = json!({"usage":{"prompt_tokens":2_006,"completion_tokens":300,"total_tokens":2_306,
            "prompt_tokens_details":{"cached_tokens":1_920,"audio_tokens":0},
            "completion_tokens_details":{"reasoning_tokens":0}}});
        let u = usage_from_json(&answer).unwrap();
        assert_eq!(
            u,
            Usage {
                prompt: 2_006,
                completion: 300,
                cached_input: 1_920,
                rate_exempt_input: 0,
            }
        );
        // OpenAI counts cached tokens toward its limits.
        assert_eq!(u.rate_limited_input(), 2_006);
        assert_eq!(u.total(), 2_306);
    }

    #[test]
    fn responses_api_usage() {
        let answer = json!({"object":"response","usage":{"input_tokens":328,"output_tokens":52,"total_tokens":380,
            "input_tokens_details":{"cached_tokens":256},"output_tokens_details":{"reasoning_tokens":0}}});
        assert_eq!(
            usage_from_json(&answer),
            Some(Usage {
                prompt: 328,
                completion: 52,
                cached_input: 256,
                rate_exempt_input: 0,
            })
        );
        // Streamed, the `response.completed` event holds it under `response`.
        let stream = "event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"object\":\"response\",\"usage\":{\"input_tokens\":10,\"output_tokens\":2,\"input_tokens_details\":{\"cached_tokens\":8}}}}\n\n";
        assert_eq!(
            scan("text/event-stream", &[stream]),
            Some(Usage {
                prompt: 10,
                completion: 2,
                cached_input: 8,
                rate_exempt_input: 0,
            })
        );
    }

    #[test]
    fn anthropic_usage_with_cache_read_and_cache_creation() {
        let answer = json!({"type":"message","usage":{"input_tokens":21,"cache_creation_input_tokens":188,
            "cache_read_input_tokens":2_048,"output_tokens":393}});
        let u = usage_from_json(&answer).unwrap();
        assert_eq!(
            u,
            Usage {
                prompt: 21 + 188 + 2_048,
                completion: 393,
                cached_input: 2_048,
                rate_exempt_input: 2_048,
            }
        );
        assert_eq!(u.rate_limited_input(), 21 + 188);
        assert_eq!(u.total(), 21 + 188 + 2_048 + 393);
        // Streamed: `message_start` holds the input, `message_delta` the
        // output (and, lately, the input again).
        let stream = [
            "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":21,\"cache_creation_input_tokens\":188,\"cache_read_input_tokens\":2048,\"output_tokens\":1}}}\n\n",
            "event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":393}}\n\n",
        ];
        assert_eq!(scan("text/event-stream", &stream), Some(u));
    }

    #[test]
    fn a_data_line_split_across_two_feeds() {
        let line = "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":70,\"completion_tokens\":8,\"prompt_tokens_details\":{\"cached_tokens\":64}}}\n\n";
        let want = Some(Usage {
            prompt: 70,
            completion: 8,
            cached_input: 64,
            rate_exempt_input: 0,
        });
        for cut in 1..line.len() {
            let (a, b) = line.split_at(cut);
            assert_eq!(scan("text/event-stream", &[a, b]), want, "cut at {cut}");
        }
        // No newline at the very end: the last line is read at finish.
        assert_eq!(scan("text/event-stream", &[line.trim_end()]), want);
    }

    #[test]
    fn only_the_usage_parts_of_an_answer_are_read_and_any_shape_around_them_is_fine() {
        let answer =
            br#"{"id":"x","message":"not an object","choices":[{"message":{"content":"hi"}}],
            "usage":{"prompt_tokens":7,"completion_tokens":2}}"#;
        let usage = usage_of_document(answer).expect("usage");
        assert_eq!((usage.prompt, usage.completion), (7, 2));
        assert_eq!(usage_of_document(b"[1]"), None);
        assert_eq!(
            usage_of_document(br#"{"usage":1,"usage":2}"#),
            None,
            "named twice"
        );
    }

    #[test]
    fn usage_twice_in_one_stream_the_larger_wins() {
        let stream = [
            "data: {\"usage\":{\"prompt_tokens\":500,\"completion_tokens\":3,\"prompt_tokens_details\":{\"cached_tokens\":128}}}\n\n",
            "data: {\"usage\":{\"prompt_tokens\":400,\"completion_tokens\":90,\"prompt_tokens_details\":{\"cached_tokens\":0}}}\n\n",
        ];
        assert_eq!(
            scan("text/event-stream", &stream),
            Some(Usage {
                prompt: 500,
                completion: 90,
                cached_input: 128,
                rate_exempt_input: 0,
            })
        );
    }

    #[test]
    fn negative_fractional_and_absurd_counts_never_panic() {
        // Negative and fractional counts are not counts: ignored.
        let u = json!({"usage":{"prompt_tokens":-5,"completion_tokens":2.5,"total_tokens":-1}});
        assert_eq!(usage_from_json(&u), None);
        let u = json!({"usage":{"prompt_tokens":-5,"completion_tokens":7,
            "prompt_tokens_details":{"cached_tokens":-3}}});
        // Its input unread, it has not said what the call spent (SPEC T3).
        assert_eq!(usage_from_json(&u), None);
        let u = json!({"usage":{"input_tokens":"12","output_tokens":true,"cache_read_input_tokens":1.0}});
        assert_eq!(usage_from_json(&u), None);
        // Counts beyond u32 saturate, sums too.
        let u = json!({"usage":{"prompt_tokens":u64::MAX,"completion_tokens":5_000_000_000u64,
            "prompt_tokens_details":{"cached_tokens":u64::MAX}}});
        assert_eq!(
            usage_from_json(&u),
            Some(Usage {
                prompt: u32::MAX,
                completion: u32::MAX,
                cached_input: u32::MAX,
                rate_exempt_input: 0,
            })
        );
        let u = json!({"usage":{"input_tokens":u32::MAX,"cache_creation_input_tokens":u32::MAX,
            "cache_read_input_tokens":u64::MAX,"output_tokens":1}});
        let u = usage_from_json(&u).unwrap();
        assert_eq!(
            (u.prompt, u.cached_input, u.rate_exempt_input),
            (u32::MAX, u32::MAX, u32::MAX)
        );
        assert_eq!(u.rate_limited_input(), 0);
        assert_eq!(u.total(), u32::MAX);
        // More cached than input (a confused server): capped at the input.
        let u = json!({"usage":{"prompt_tokens":10,"completion_tokens":1,
            "prompt_tokens_details":{"cached_tokens":99}}});
        assert_eq!(usage_from_json(&u).unwrap().cached_input, 10);
        // Numbers too large for u64 are not counts either; in a stream too.
        let line = "data: {\"usage\":{\"prompt_tokens\":1e400,\"completion_tokens\":123456789012345678901234567890}}\n";
        assert_eq!(scan("text/event-stream", &[line]), None);
        let line = "data: {\"usage\":{\"prompt_tokens\":123456789012345678901234567890,\"completion_tokens\":4}}\n";
        // Its input past u64: no usage, as with no input (SPEC T3).
        assert_eq!(scan("text/event-stream", &[line]), None);
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
                    completion: 2,
                    ..Usage::default()
                }),
                true
            )]
        );
    }
}
