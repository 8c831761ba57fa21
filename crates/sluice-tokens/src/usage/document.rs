//! A JSON answer's usage parts, read as its bytes pass, in bounded memory.
//!
//! An answer may be large (a batch of embeddings runs to tens of megabytes)
//! while its usage is a few dozen bytes at its top level. [`DocumentScanner`]
//! follows the document's structure byte by byte (strings, escapes, nesting)
//! and keeps only the value of its top-level `usage` key, up to [`MAX_PART`]
//! bytes, and of its top-level `message` and `response` objects their own
//! `usage` alone, read the same way (the Responses API's `response.completed`
//! event carries the whole response, as large as the answer): what a
//! connection holds does not grow with the answer.
//!
//! It checks the structure, not every token: a document whose brackets do
//! not balance, whose strings do not close, that is not one object, or that
//! names a usage part twice, has no usage (its call is then charged what it
//! reserved). The parts kept are parsed as JSON in full. A key is compared
//! as serde reads it, escapes decoded (`"us\u0061ge"` is `usage`).
//!
//! Where it reads otherwise than serde's parse of the whole answer did, on
//! purpose:
//!
//! - Outside the kept parts, tokens are not checked: a malformed literal or
//!   number, a bad escape, bytes that are not UTF-8, a control character in
//!   a string, a missing colon or comma, a `[` closed by `}`. Serde refused
//!   such an answer (charged its reservation); the scanner reads its usage.
//!   Harmless: only the upstream writes bytes outside strings, and one that
//!   can could as well write a well-formed answer with any usage; the text a
//!   model writes (what a client can steer) is inside strings, whose quotes
//!   and escapes are followed exactly.
//! - A document that is an array has none, where serde read an array of up
//!   to three values as `usage`, `message` and `response`, in order.
//! - A `usage` part longer than [`MAX_PART`] (trailing whitespace counted)
//!   makes the usage unreadable, and so does a `message` or `response` that is
//!   not an object and is that long, or an object whose own `usage` is named
//!   twice or is that long (serde took the last of two).
//! - Beyond serde's depth limit within a part ([`SERDE_DEPTH`]) a document is
//!   unreadable, as it was; elsewhere any depth is read, as it was.

use serde_json::Value;

/// The longest value of a usage part kept; a longer one makes the document's
/// usage unreadable.
pub(super) const MAX_PART: usize = 64 << 10;

/// The nesting, the top object counted, at which serde_json's recursion limit
/// failed the parse of the whole answer within a usage part (elsewhere serde
/// skips values at any depth, and so does the scanner).
const SERDE_DEPTH: u32 = 128;

/// The top-level keys whose values are kept, in [`DocumentScanner::parts`]'s
/// order.
const PARTS: [&[u8]; 3] = [b"usage", b"message", b"response"];

/// The index of `usage` in [`PARTS`].
const USAGE: usize = 0;

/// The longest key, as written, compared with [`PARTS`]: "response" with
/// every letter escaped (`\u0072...`, 6 bytes each). Longer keys are none of
/// them.
const MAX_KEY: usize = 6 * 8;

/// The part a top-level key, as written between its quotes, names: escapes
/// are decoded as serde would (`"us\u0061ge"` is `usage`, and so counts as
/// naming it, twice if `"usage"` is there too). `Err` for a short key whose
/// escapes are not JSON's, which makes the whole document unreadable to serde.
fn part_named(key: &[u8]) -> Result<Option<usize>, ()> {
    if key.len() > MAX_KEY {
        return Ok(None);
    }
    if !key.contains(&b'\\') {
        return Ok(PARTS.iter().position(|p| *p == key));
    }
    let mut quoted = Vec::with_capacity(key.len() + 2);
    quoted.push(b'"');
    quoted.extend_from_slice(key);
    quoted.push(b'"');
    let key: String = serde_json::from_slice(&quoted).map_err(|_| ())?;
    Ok(PARTS.iter().position(|p| *p == key.as_bytes()))
}

/// Reads a JSON document's top-level usage parts as its bytes come.
#[derive(Debug, Default)]
pub(super) struct DocumentScanner {
    /// Objects and arrays open around the next byte.
    depth: u32,
    /// Inside a string, and just after a backslash in one.
    in_string: bool,
    escaped: bool,
    /// At the top object's level, where the next string is a key.
    expect_key: bool,
    /// Reading a top-level key (its bytes, up to [`MAX_KEY`] + 1).
    reading_key: bool,
    key: Vec<u8>,
    /// The part whose value comes next (its key and colon seen).
    pending: Option<usize>,
    /// The part whose value is being kept, and the bytes so far.
    capturing: Option<usize>,
    capture: Vec<u8>,
    /// Each part's value, once whole.
    parts: [Option<Vec<u8>>; 3],
    /// The top object has begun, or closed.
    started: bool,
    closed: bool,
    /// The document cannot be read (see the module's notes).
    broken: bool,
    /// Keeps its `usage` part alone: the scanner of a `message` or `response`
    /// object, whose own `usage` is the one read.
    usage_only: bool,
    /// The scanner of the `message` or `response` object being read, which
    /// keeps its `usage` alone: such an object may be as large as the answer
    /// (the Responses API's `response.completed` event carries the whole
    /// response, instructions and output), its usage a few dozen bytes.
    nested: Option<Box<DocumentScanner>>,
}

impl DocumentScanner {
    /// Feeds the next bytes of the document.
    pub(super) fn feed(&mut self, chunk: &[u8]) {
        if self.broken {
            return;
        }
        let mut i = 0;
        while i < chunk.len() {
            if self.in_string && !self.escaped && !self.reading_key {
                // Skip to the string's next quote or backslash at once.
                let rest = &chunk[i..];
                let n = memchr::memchr2(b'"', b'\\', rest).unwrap_or(rest.len());
                if n > 0 {
                    self.keep(&rest[..n]);
                    if self.broken {
                        return;
                    }
                    i += n;
                    continue;
                }
            }
            self.byte(chunk[i]);
            if self.broken {
                return;
            }
            i += 1;
        }
    }

    /// Adds `bytes` to the value being kept, if one is.
    fn keep(&mut self, bytes: &[u8]) {
        if let Some(nested) = &mut self.nested {
            nested.feed(bytes);
            if nested.broken {
                self.broken = true;
            }
            return;
        }
        if self.capturing.is_some() {
            if self.capture.len() + bytes.len() > MAX_PART {
                self.broken = true;
                return;
            }
            self.capture.extend_from_slice(bytes);
        }
    }

    fn byte(&mut self, b: u8) {
        if self.in_string {
            if self.escaped {
                self.escaped = false;
            } else if b == b'\\' {
                self.escaped = true;
            } else if b == b'"' {
                self.in_string = false;
            }
            if self.reading_key {
                if !self.in_string {
                    self.reading_key = false;
                } else if self.key.len() <= MAX_KEY {
                    self.key.push(b);
                }
            }
            self.keep(&[b]);
            return;
        }
        let white = matches!(b, b' ' | b'\t' | b'\n' | b'\r');
        // A kept value ends at the top object's next comma or its end.
        if self.capturing.is_some() && self.depth == 1 && matches!(b, b',' | b'}') {
            self.end_capture();
        }
        if let Some(part) = self.pending
            && !white
        {
            self.pending = None;
            self.capturing = Some(part);
            self.capture.clear();
            if part != USAGE && b == b'{' {
                self.nested = Some(Box::new(DocumentScanner {
                    usage_only: true,
                    ..DocumentScanner::default()
                }));
            }
        }
        self.keep(&[b]);
        match b {
            b'"' => {
                if self.depth == 0 {
                    self.broken = true;
                    return;
                }
                self.in_string = true;
                if self.depth == 1 && self.expect_key {
                    self.expect_key = false;
                    self.reading_key = true;
                    self.key.clear();
                }
            }
            b'{' | b'[' => {
                if self.depth == 0 {
                    if self.started || b == b'[' {
                        self.broken = true;
                        return;
                    }
                    self.started = true;
                    self.expect_key = true;
                }
                // Past u32::MAX levels (4 GiB of brackets) the count would
                // wrap: such a document is unreadable, not a panic.
                let Some(depth) = self.depth.checked_add(1) else {
                    self.broken = true;
                    return;
                };
                self.depth = depth;
                if self.capturing.is_some() && depth >= SERDE_DEPTH {
                    self.broken = true;
                }
            }
            b'}' | b']' => {
                if self.depth == 0 {
                    self.broken = true;
                    return;
                }
                self.depth -= 1;
                if self.depth == 0 {
                    self.closed = true;
                }
            }
            b',' if self.depth == 1 => self.expect_key = true,
            b':' if self.depth == 1 => {
                match part_named(&self.key) {
                    Ok(part) => self.pending = part.filter(|&p| p == USAGE || !self.usage_only),
                    Err(()) => {
                        self.broken = true;
                        return;
                    }
                }
                self.key.clear();
            }
            _ if self.depth == 0 && !white => self.broken = true,
            _ => {}
        }
    }

    fn end_capture(&mut self) {
        if let Some(part) = self.capturing.take() {
            let value = match self.nested.take() {
                // The object's own usage, as the one part it keeps.
                Some(mut nested) => match nested.parts() {
                    Some(parts) => match serde_json::to_vec(&Value::Object(parts)) {
                        Ok(value) => value,
                        Err(_) => {
                            self.broken = true;
                            return;
                        }
                    },
                    None => {
                        self.broken = true;
                        return;
                    }
                },
                None => std::mem::take(&mut self.capture),
            };
            if self.parts[part].replace(value).is_some() {
                // A part named twice: which one counts is not known.
                self.broken = true;
            }
        }
    }

    /// The document's usage parts, by key, once it has ended; `None` for a
    /// document that cannot be read (see the module's notes).
    pub(super) fn parts(&mut self) -> Option<serde_json::Map<String, Value>> {
        if self.broken || !self.closed || self.pending.is_some() || self.capturing.is_some() {
            return None;
        }
        let mut doc = serde_json::Map::new();
        for (key, part) in PARTS.iter().zip(&self.parts) {
            if let Some(bytes) = part {
                let value: Value = serde_json::from_slice(bytes).ok()?;
                doc.insert(String::from_utf8_lossy(key).into_owned(), value);
            }
        }
        Some(doc)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// The parts of `doc` fed in pieces of every size from 1 to 7 bytes, all
    /// alike, or `None`.
    fn parts_of(doc: &str) -> Option<serde_json::Map<String, Value>> {
        let whole = {
            let mut s = DocumentScanner::default();
            s.feed(doc.as_bytes());
            s.parts()
        };
        for size in 1..=7 {
            let mut s = DocumentScanner::default();
            for piece in doc.as_bytes().chunks(size) {
                s.feed(piece);
            }
            assert_eq!(s.parts(), whole, "in pieces of {size}: {doc}");
        }
        whole
    }

    #[test]
    fn top_level_parts_are_kept_and_nested_ones_are_not() {
        let doc = r#" {"id":"c","choices":[{"message":{"content":"a \"usage\": {}, \\"}}],
            "usage" : {"prompt_tokens":12,"completion_tokens":3}, "x":[1,{"usage":5}]} "#;
        let parts = parts_of(doc).unwrap();
        assert_eq!(parts.len(), 1);
        assert_eq!(parts["usage"]["prompt_tokens"], 12);
        let last = r#"{"usage":{"input_tokens":1},"message":null}"#;
        let parts = parts_of(last).unwrap();
        assert_eq!(parts["usage"]["input_tokens"], 1);
        assert_eq!(parts["message"], Value::Null);
    }

    #[test]
    fn unreadable_documents_have_no_parts() {
        for doc in [
            "",
            "not json",
            r#"{"usage":{"prompt_tokens":1}"#,
            r#"{"usage":{"prompt_tokens":1}}}"#,
            r#"{"usage":{"prompt_tokens":1}} {}"#,
            r#"{"usage":{"prompt_tokens":1}} x"#,
            r#"[{"usage":{"prompt_tokens":1}}]"#,
            r#"{"usage":{"prompt_tokens":1},"usage":{"prompt_tokens":2}}"#,
            r#"{"usage":{"prompt_tokens":1},"s":"open}"#,
            r#"{"usage":{"prompt_tokens":}}"#,
            r#"{"usage":}"#,
            r#"{"usage":"#,
        ] {
            assert_eq!(parts_of(doc), None, "{doc}");
        }
    }

    #[test]
    fn a_key_spelled_with_escapes_names_its_part_as_serde_reads_it() {
        // Once missed, which read the message's usage in place of the top's,
        // and took a part named twice for once.
        let doc = r#"{"us\u0061ge":{"prompt_tokens":9},"message":{"usage":{"prompt_tokens":1}}}"#;
        assert_eq!(parts_of(doc).unwrap()["usage"]["prompt_tokens"], 9);
        let doc = r#"{"\u0072\u0065\u0073\u0070\u006f\u006e\u0073\u0065":{"usage":{}}}"#;
        assert!(parts_of(doc).unwrap().contains_key("response"));
        for doc in [
            r#"{"usage":{"prompt_tokens":1},"us\u0061ge":{"prompt_tokens":2}}"#,
            r#"{"usage":{"prompt_tokens":1},"us\x":2}"#,
        ] {
            assert_eq!(parts_of(doc), None, "{doc}");
        }
        // Escapes that decode to something else name nothing.
        let doc = r#"{"usage\n":{"prompt_tokens":1},"\"usage":2,"usage":{"prompt_tokens":3}}"#;
        assert_eq!(parts_of(doc).unwrap()["usage"]["prompt_tokens"], 3);
    }

    #[test]
    fn a_part_nested_past_serdes_limit_is_unreadable_and_depth_elsewhere_is_fine() {
        let nested = |n: usize| {
            format!(
                r#"{{"usage":{{"prompt_tokens":5,"x":{}{}}}}}"#,
                "[".repeat(n),
                "]".repeat(n)
            )
        };
        // 1 + 1 + 125 levels: serde read it whole; 126 it did not.
        assert_eq!(parts_of(&nested(125)).unwrap()["usage"]["prompt_tokens"], 5);
        assert_eq!(parts_of(&nested(126)), None);
        let n = 100_000;
        let deep = format!(
            r#"{{"x":{}{},"usage":{{"prompt_tokens":5}}}}"#,
            "[".repeat(n),
            "]".repeat(n)
        );
        assert_eq!(parts_of(&deep).unwrap()["usage"]["prompt_tokens"], 5);
    }

    #[test]
    fn an_array_has_none_though_serde_read_it_in_order() {
        let doc = r#"[{"prompt_tokens":5,"completion_tokens":1}]"#;
        assert!(crate::usage::usage_of_document(doc.as_bytes()).is_some());
        assert_eq!(parts_of(doc), None);
    }

    #[test]
    fn depth_past_u32_is_unreadable_not_a_panic() {
        let mut s = DocumentScanner {
            depth: u32::MAX,
            started: true,
            ..DocumentScanner::default()
        };
        s.feed(b"[");
        assert!(s.broken);
        assert_eq!(s.parts(), None);
    }

    /// A `message` or `response` object is read for its own `usage` in bounded
    /// memory, however large the object (the Responses API's `response.completed`
    /// carries the whole response): only that usage is kept. Its `usage` named
    /// twice is unreadable, as a top-level one is.
    #[test]
    fn t3_a_response_object_of_any_size_gives_its_usage() {
        let mut s = DocumentScanner::default();
        s.feed(br#"{"type":"response.completed","response":{"instructions":""#);
        let block = "x".repeat(64 << 10);
        for _ in 0..64 {
            s.feed(block.as_bytes());
        }
        s.feed(br#"","output":[{"content":[{"text":"hi, "usage": {}"}]}],"#);
        s.feed(br#""usage":{"input_tokens":300,"output_tokens":50000},"user":null}}"#);
        assert!(s.capture.capacity() <= MAX_PART);
        let nested = s.nested.as_ref().map_or(0, |n| n.capture.capacity());
        assert!(nested <= MAX_PART, "{nested}");
        let parts = s.parts().expect("readable");
        assert_eq!(parts["response"]["usage"]["output_tokens"], 50000);
        assert_eq!(parts["response"].as_object().map(|o| o.len()), Some(1));

        for doc in [
            r#"{"response":{"usage":{"output_tokens":1},"usage":{"output_tokens":9}}}"#,
            r#"{"response":{"usage":{"output_tokens":1}},"response":{}}"#,
            r#"{"response":{"usage":{"output_tokens":1}"#,
        ] {
            assert_eq!(parts_of(doc), None, "{doc}");
        }
        // Not an object: kept as it is (and holds no usage).
        assert_eq!(
            parts_of(r#"{"response":null,"usage":{"prompt_tokens":2}}"#)
                .map(|p| p["usage"]["prompt_tokens"].clone()),
            Some(serde_json::json!(2))
        );
    }

    #[test]
    fn memory_is_bounded_whatever_the_document_size() {
        let mut s = DocumentScanner::default();
        s.feed(br#"{"data":["#);
        let block = "0.0123456789,".repeat(10_000);
        for _ in 0..200 {
            s.feed(block.as_bytes());
        }
        s.feed(br#"1],"usage":{"prompt_tokens":7}}"#);
        assert!(s.capture.capacity() <= MAX_PART && s.key.capacity() <= 64);
        assert_eq!(s.parts().unwrap()["usage"]["prompt_tokens"], 7);
        // A usage part longer than the bound is unreadable.
        let mut s = DocumentScanner::default();
        s.feed(br#"{"usage":{"pad":""#);
        s.feed(&vec![b'a'; MAX_PART]);
        s.feed(br#""}}"#);
        assert_eq!(s.parts(), None);
    }
}

/// Random documents against the code the scanner replaced: serde's parse of
/// the whole answer ([`usage_of_document`](super::usage_of_document)).
#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod properties {
    use proptest::prelude::*;
    use proptest::sample::Index;
    use serde_json::{Map, Value, json};

    use super::super::{Usage, UsageParts, UsageScanner, usage_from_json, usage_of_document};

    /// Strings with what could confuse a scanner: quotes, backslashes,
    /// brackets, a usage spelled out, non-ASCII.
    fn text() -> impl Strategy<Value = String> {
        prop_oneof![
            "[a-z\"\\\\{}\\[\\],: \n\té\u{1F600}/]{0,12}",
            Just(r#""usage":{"prompt_tokens":0}}"#.to_owned()),
            Just("\\".to_owned()),
        ]
    }

    fn key() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("usage".to_owned()),
            Just("message".to_owned()),
            Just("response".to_owned()),
            text(),
        ]
    }

    fn value() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            (-1e30..1e30f64).prop_map(Value::from),
            text().prop_map(Value::from),
        ];
        leaf.prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
                prop::collection::vec((key(), inner), 0..4)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    /// A count as providers write it, or as a confused one might.
    fn count() -> impl Strategy<Value = Value> {
        prop_oneof![
            4 => (0..100_000u64).prop_map(Value::from),
            1 => any::<u64>().prop_map(Value::from),
            1 => Just(json!(-5)),
            1 => Just(json!(2.5)),
            1 => Just(json!("12")),
        ]
    }

    fn usage() -> impl Strategy<Value = Value> {
        let names = prop::sample::subsequence(
            vec![
                "prompt_tokens",
                "completion_tokens",
                "total_tokens",
                "input_tokens",
                "output_tokens",
                "cache_read_input_tokens",
                "cache_creation_input_tokens",
            ],
            0..=7,
        );
        (
            names,
            prop::collection::vec(count(), 7),
            count(),
            any::<bool>(),
        )
            .prop_map(|(names, counts, cached, details)| {
                let mut u: Map<String, Value> = names
                    .into_iter()
                    .zip(counts)
                    .map(|(k, v)| (k.to_owned(), v))
                    .collect();
                if details {
                    u.insert(
                        "prompt_tokens_details".to_owned(),
                        json!({ "cached_tokens": cached }),
                    );
                }
                Value::Object(u)
            })
    }

    /// What a top-level `message` or `response` holds: often a usage.
    fn holder() -> impl Strategy<Value = Value> {
        (prop::option::of(usage()), key(), value()).prop_map(|(u, k, v)| {
            let mut m = Map::new();
            m.insert(k, v);
            if let Some(u) = u {
                m.insert("usage".to_owned(), u);
            }
            Value::Object(m)
        })
    }

    fn member() -> impl Strategy<Value = (String, Value)> {
        prop_oneof![
            3 => usage().prop_map(|v| ("usage".to_owned(), v)),
            2 => holder().prop_map(|v| ("message".to_owned(), v)),
            2 => holder().prop_map(|v| ("response".to_owned(), v)),
            1 => value().prop_map(|v| ("usage".to_owned(), v)),
            4 => (key(), value()),
        ]
    }

    fn ws() -> impl Strategy<Value = String> {
        "[ \t\r\n]{0,2}"
    }

    /// A document written as a server might: its top-level members in any
    /// order (a part sometimes twice), a key sometimes spelled with escapes,
    /// compact or pretty, whitespace between tokens; with its members.
    fn document() -> impl Strategy<Value = (Vec<u8>, Vec<(String, Value)>)> {
        let member = (
            member(),
            any::<bool>(),
            prop::bool::weighted(0.1),
            ws(),
            ws(),
        );
        let object = (prop::collection::vec(member, 0..5), ws(), ws()).prop_map(
            |(members, before, after)| {
                let text: Vec<String> = members
                    .iter()
                    .map(|((k, v), pretty, escaped, w1, w2)| {
                        let k = if *escaped {
                            let e: String =
                                k.encode_utf16().map(|c| format!("\\u{c:04x}")).collect();
                            format!("\"{e}\"")
                        } else {
                            serde_json::to_string(k).unwrap()
                        };
                        let v = if *pretty {
                            serde_json::to_string_pretty(v).unwrap()
                        } else {
                            serde_json::to_string(v).unwrap()
                        };
                        format!("{w1}{k}{w2}:{w1}{v}{w2}")
                    })
                    .collect();
                let doc = format!("{before}{{{}}}{after}", text.join(",")).into_bytes();
                (doc, members.into_iter().map(|(m, ..)| m).collect())
            },
        );
        prop_oneof![
            9 => object,
            1 => value().prop_map(|v| (serde_json::to_vec(&v).unwrap(), Vec::new())),
        ]
    }

    /// The usage of an object of these members, as serde reads it: none if
    /// a part is named twice.
    fn usage_of_members<'a>(members: impl Iterator<Item = &'a (String, Value)>) -> Option<Usage> {
        let mut parts = Map::new();
        for (k, v) in members {
            if ["usage", "message", "response"].contains(&k.as_str())
                && parts.insert(k.clone(), v.clone()).is_some()
            {
                return None;
            }
        }
        usage_from_json(&Value::Object(parts))
    }

    /// The scanner's usage of `doc`, fed in pieces cut at `cuts`.
    fn scan(doc: &[u8], cuts: &[Index]) -> Option<Usage> {
        let mut cuts: Vec<usize> = cuts.iter().map(|c| c.index(doc.len() + 1)).collect();
        cuts.sort_unstable();
        let mut s = UsageScanner::new(Some("application/json"));
        let mut from = 0;
        for cut in cuts {
            s.feed(&doc[from..cut]);
            from = cut;
        }
        s.feed(&doc[from..]);
        s.finish()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn any_document_split_anywhere_reads_as_serde_reads_it_whole(
            (doc, _) in document(),
            cuts in prop::collection::vec(any::<Index>(), 0..6),
        ) {
            let got = scan(&doc, &cuts);
            let whole = usage_of_document(&doc);
            if doc.trim_ascii_start().starts_with(b"{") {
                prop_assert_eq!(got, whole);
                // Each part named once: what the answer's whole value says.
                if let Ok(Value::Object(v)) = serde_json::from_slice::<Value>(&doc)
                    && serde_json::from_slice::<UsageParts>(&doc).is_ok()
                {
                    prop_assert_eq!(got, usage_from_json(&Value::Object(v)));
                }
            } else {
                // Not an object (serde reads an array of up to three as
                // usage, message, response, in order): none.
                prop_assert_eq!(got, None);
            }
        }

        #[test]
        fn a_damaged_document_never_panics_nor_reads_a_usage_it_does_not_have(
            (doc, members) in document(),
            at in any::<Index>(),
            byte in prop_oneof![
                Just(b'"'), Just(b'\\'), Just(b'{'), Just(b'}'), Just(b'['),
                Just(b']'), Just(b','), Just(b':'), Just(b' '), any::<u8>(),
            ],
            truncate in any::<bool>(),
            cuts in prop::collection::vec(any::<Index>(), 0..6),
        ) {
            let mut bad = doc.clone();
            let at = at.index(doc.len() + 1);
            if truncate {
                bad.truncate(at);
            } else {
                bad.insert(at, byte);
            }
            let got = scan(&bad, &cuts);
            if serde_json::from_slice::<UsageParts>(&bad).is_ok() {
                if bad.trim_ascii_start().starts_with(b"{") {
                    prop_assert_eq!(got, usage_of_document(&bad));
                }
            } else if got.is_some() {
                // Serde would have none; the scanner, which checks the
                // structure and not every token, reads the usage the
                // document had before the damage, or had without the one
                // member the damage fell in (a key no longer a part's).
                let without_one = (0..members.len()).map(|i| {
                    usage_of_members(members.iter().enumerate().filter(|(j, _)| *j != i).map(|(_, m)| m))
                });
                let candidates: Vec<Option<Usage>> =
                    std::iter::once(usage_of_members(members.iter())).chain(without_one).collect();
                prop_assert!(candidates.contains(&got), "{:?} from {}", got, String::from_utf8_lossy(&bad));
            }
        }
    }
}
