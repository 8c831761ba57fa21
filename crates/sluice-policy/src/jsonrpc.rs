//! JSON-RPC bodies: the class of every item of a request or batch.

use http::HeaderMap;
use http::header::CONTENT_ENCODING;
use serde_json::Value;

use crate::model::{
    Bounds, Class, ClassSet, JsonRpc, MAX_BUCKETS, MAX_CLASSES, MAX_LANES, MAX_QUOTA_FAMILIES,
    Spends,
};

/// What a request holds: items by class, and what its items spend besides
/// (quota units by family, the buckets named).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Items {
    /// Items per class, indexed by [`Class::index`].
    pub counts: [u32; MAX_CLASSES],
    /// The classes of which it holds an item.
    pub held: ClassSet,
    /// Units per quota family, indexed like [`crate::Policy::quotas`].
    pub quotas: [u32; MAX_QUOTA_FAMILIES],
    /// Units per bucket, indexed like [`crate::Policy::buckets`]: each item that
    /// names a bucket spends one unit of it.
    pub bucket_units: [u16; MAX_BUCKETS],
    /// Calls per lane, indexed like [`crate::Policy::lanes`]: each item that a
    /// lane guards is one call through it.
    pub lane_calls: [u16; MAX_LANES],
}

impl Items {
    /// One item of `class`.
    pub fn one(class: Class) -> Self {
        let mut items = Items::default();
        items.add(class, 1);
        items
    }

    /// Adds `n` items of `class`.
    pub fn add(&mut self, class: Class, n: u32) {
        if let Some(count) = self.counts.get_mut(class.index()) {
            *count = count.saturating_add(n);
            self.held = self.held.with(class);
        }
    }

    /// Adds what one item spends besides its class.
    pub fn add_spends(&mut self, spends: &Spends) {
        self.spend(&spends.buckets, spends.quota);
        self.call_lane(spends.lane);
    }

    /// Adds one call through `lane` (a route's or a tool's).
    pub fn call_lane(&mut self, lane: Option<usize>) {
        if let Some(l) = lane
            && let Some(calls) = self.lane_calls.get_mut(l)
        {
            *calls = calls.saturating_add(1);
        }
    }

    /// The lanes called, with how many calls each, in index order.
    pub fn lanes_called(&self) -> impl Iterator<Item = (usize, u16)> + '_ {
        self.lane_calls
            .iter()
            .enumerate()
            .filter(|(_, calls)| **calls > 0)
            .map(|(l, &calls)| (l, calls))
    }

    /// Adds one unit of each bucket in `buckets` and of the quota family `quota`
    /// (a route's, which keeps them apart rather than as [`Spends`]).
    pub fn spend(&mut self, buckets: &[usize], quota: Option<usize>) {
        for &b in buckets {
            if let Some(units) = self.bucket_units.get_mut(b) {
                *units = units.saturating_add(1);
            }
        }
        if let Some(q) = quota
            && let Some(units) = self.quotas.get_mut(q)
        {
            *units = units.saturating_add(1);
        }
    }

    /// The buckets named, with the units each spends, in index order.
    pub fn named_buckets(&self) -> impl Iterator<Item = (usize, u32)> + '_ {
        self.bucket_units
            .iter()
            .enumerate()
            .filter(|(_, units)| **units > 0)
            .map(|(b, &units)| (b, u32::from(units)))
    }

    /// Items of `class`.
    pub fn count(&self, class: Class) -> u32 {
        self.counts.get(class.index()).copied().unwrap_or(0)
    }
}

/// Why a JSON-RPC body cannot be counted as the upstream will read it. Such a body
/// is refused, never counted as one item of a cheaper class: the upstream may run
/// every call in it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Unclassifiable {
    /// A batch of more items than the bound.
    #[error("the batch holds more than {max_batch_items} items (limits.max_batch_items)")]
    TooManyItems {
        /// The bound.
        max_batch_items: usize,
    },
    /// JSON nested deeper than the bound.
    #[error("the JSON nests deeper than {max_json_depth} levels (limits.max_json_depth)")]
    TooDeep {
        /// The bound.
        max_json_depth: usize,
    },
    /// An empty batch (`[]`).
    #[error("the batch is empty")]
    EmptyBatch,
    /// A body that starts with a byte-order mark (UTF-8's, or UTF-16's).
    #[error("the body starts with a byte-order mark: send UTF-8 JSON without one (RFC 8259 §8.1)")]
    ByteOrderMark,
    /// A body that is not UTF-8 (UTF-16 or UTF-32 among others).
    #[error("the body is not UTF-8: send UTF-8 JSON (RFC 8259 §8.1)")]
    NotUtf8,
    /// A body that is not JSON.
    #[error("the body is not JSON")]
    NotJson,
    /// An object that names a key twice: parsers differ on which value counts,
    /// so the upstream may run another method or tool than sluice would count.
    #[error("an object names a key twice: readers differ on which value counts")]
    DuplicateKey,
    /// JSON that is neither an object nor an array (a number, a string, `null`…).
    #[error("the body is neither a JSON-RPC request object nor a batch of them")]
    NotJsonRpc,
    /// A body sent with a `Content-Encoding` (gzip, …): sluice does not decode
    /// bodies, so it cannot read this one.
    #[error(
        "a body with a Content-Encoding other than identity cannot be read: send it uncompressed"
    )]
    Encoded,
}

impl JsonRpc {
    /// Classifies a body: every item of a request or batch, in its class. A
    /// well-formed message whose method or tool the rules do not name, a retired
    /// tool with an unknown action, an object without a method and a batch item
    /// that is not an object all count as the default class.
    ///
    /// # Errors
    /// [`Unclassifiable`] for a body that cannot be counted: past a bound, not
    /// UTF-8 JSON, or not a JSON-RPC object or batch.
    pub fn classify(&self, body: &[u8], bounds: &Bounds) -> Result<Items, Unclassifiable> {
        if [&b"\xEF\xBB\xBF"[..], b"\xFE\xFF", b"\xFF\xFE"]
            .iter()
            .any(|bom| body.starts_with(bom))
        {
            return Err(Unclassifiable::ByteOrderMark);
        }
        // JSON holds no NUL byte; UTF-16 and UTF-32 text starts with one in its
        // first four bytes (RFC 4627 §3).
        let Ok(text) = std::str::from_utf8(body) else {
            return Err(Unclassifiable::NotUtf8);
        };
        if body.iter().take(4).any(|&b| b == 0) {
            return Err(Unclassifiable::NotUtf8);
        }
        // Checked before parsing: the parser never recurses past the bound.
        if depth_exceeds(body, bounds.max_json_depth) {
            return Err(Unclassifiable::TooDeep {
                max_json_depth: bounds.max_json_depth,
            });
        }
        let value = crate::json::parse_unique(text.as_bytes()).map_err(|e| match e {
            crate::json::NotUnique::NotJson => Unclassifiable::NotJson,
            crate::json::NotUnique::DuplicateKey => Unclassifiable::DuplicateKey,
        })?;
        match &value {
            Value::Array(batch) if batch.is_empty() => Err(Unclassifiable::EmptyBatch),
            Value::Array(batch) if batch.len() > bounds.max_batch_items => {
                Err(Unclassifiable::TooManyItems {
                    max_batch_items: bounds.max_batch_items,
                })
            }
            Value::Array(batch) => {
                let mut items = Items::default();
                for item in batch {
                    self.count_item(item, &mut items);
                }
                Ok(items)
            }
            Value::Object(_) => {
                let mut items = Items::default();
                self.count_item(&value, &mut items);
                Ok(items)
            }
            _ => Err(Unclassifiable::NotJsonRpc),
        }
    }

    /// Counts one JSON-RPC message into `items`: its class, and for a tool call
    /// what the tool spends besides.
    fn count_item(&self, item: &Value, items: &mut Items) {
        match self.item_tool(item) {
            Some(tool) => {
                items.add(tool.class, 1);
                items.add_spends(&tool.spends);
            }
            None => items.add(self.item_class(item), 1),
        }
    }

    /// The tool a `tools/call` message calls, when the policy names it (a retired
    /// name by its `arguments.action`).
    fn item_tool(&self, item: &Value) -> Option<&crate::model::Tool> {
        if item.get("method").and_then(Value::as_str) != Some("tools/call") {
            return None;
        }
        let params = item.get("params")?;
        let name = params.get("name").and_then(Value::as_str)?;
        let action = params
            .get("arguments")
            .and_then(|a| a.get("action"))
            .and_then(Value::as_str);
        self.tool(name, action)
    }

    /// The name of the tool a `tools/call` message calls, as the rules read it:
    /// a retired name is the tool its `arguments.action` maps to; any other
    /// name is the tool it names (escapes in the JSON read as serde reads
    /// them). `None` for a message that is no tool call.
    pub fn called_tool<'a>(&'a self, item: &'a Value) -> Option<&'a str> {
        if item.get("method").and_then(Value::as_str) != Some("tools/call") {
            return None;
        }
        let params = item.get("params")?;
        let name = params.get("name").and_then(Value::as_str)?;
        if self.tools.contains_key(name) {
            return Some(name);
        }
        let action = params
            .get("arguments")
            .and_then(|a| a.get("action"))
            .and_then(Value::as_str);
        match self.retired.get(name) {
            Some(actions) => action.and_then(|a| actions.get(a)).map(String::as_str),
            None => Some(name),
        }
    }

    /// The class of one JSON-RPC message.
    pub fn item_class(&self, item: &Value) -> Class {
        let Some(method) = item.get("method").and_then(Value::as_str) else {
            return self.default_class;
        };
        if method == "tools/call" {
            return self.item_tool(item).map_or(self.default_class, |t| t.class);
        }
        if let Some(&c) = self.methods.get(method) {
            return c;
        }
        self.method_prefixes
            .iter()
            .find(|(prefix, _)| method.starts_with(prefix.as_str()))
            .map_or(self.default_class, |&(_, c)| c)
    }

    /// The class of a tool call: by name, or for a retired name by the tool
    /// its `arguments.action` now maps to.
    pub fn tool_class(&self, name: &str, action: Option<&str>) -> Class {
        self.tool(name, action)
            .map_or(self.default_class, |t| t.class)
    }

    /// The rule of a tool: by name, or for a retired name the rule of the tool
    /// its `arguments.action` now maps to.
    pub fn tool(&self, name: &str, action: Option<&str>) -> Option<&crate::model::Tool> {
        if let Some(t) = self.tools.get(name) {
            return Some(t);
        }
        self.retired
            .get(name)
            .and_then(|actions| actions.get(action?))
            .and_then(|tool| self.tools.get(tool))
    }
}

/// Checks the `Content-Encoding` of a JSON-RPC body: sluice reads bodies as sent,
/// so any coding but `identity` (gzip, deflate, br, …) cannot be classified.
///
/// # Errors
/// [`Unclassifiable::Encoded`] when a `Content-Encoding` field names any other coding.
pub fn check_content_encoding(headers: &HeaderMap) -> Result<(), Unclassifiable> {
    let readable = headers.get_all(CONTENT_ENCODING).iter().all(|value| {
        value.as_bytes().split(|&b| b == b',').all(|coding| {
            let coding = coding.trim_ascii();
            coding.is_empty() || coding.eq_ignore_ascii_case(b"identity")
        })
    });
    if readable {
        Ok(())
    } else {
        Err(Unclassifiable::Encoded)
    }
}

/// True when a value in `json` sits deeper than `max` (the top value is at depth 1,
/// what an array or object holds one deeper). One pass over the bytes, before any
/// parsing: strings are skipped, their escapes too; a body that is not JSON may
/// pass or not, the parser refuses it next.
pub fn depth_exceeds(json: &[u8], max: usize) -> bool {
    // Arrays and objects open around the current position.
    let mut open = 0usize;
    let mut at = 0;
    while at < json.len() {
        match json[at] {
            b'"' => {
                if open + 1 > max {
                    return true;
                }
                at += 1;
                while at < json.len() && json[at] != b'"' {
                    at += if json[at] == b'\\' { 2 } else { 1 };
                }
            }
            b'[' | b'{' => {
                open += 1;
                if open > max {
                    return true;
                }
            }
            b']' | b'}' => open = open.saturating_sub(1),
            b' ' | b'\t' | b'\n' | b'\r' | b',' | b':' => {}
            // A number, `true`, `false` or `null`.
            _ => {
                if open + 1 > max {
                    return true;
                }
            }
        }
        at += 1;
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::default_policy;

    fn classify(body: &[u8]) -> Result<Items, Unclassifiable> {
        let p = default_policy().expect("default policy");
        p.jsonrpc.classify(body, &p.bounds)
    }

    fn call(id: usize, tool: &str) -> String {
        format!(
            r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{{"name":"{tool}"}}}}"#
        )
    }

    #[test]
    fn e5_a_batch_past_the_bound_is_unclassifiable_not_one_standard_item() {
        let p = default_policy().expect("default policy");
        let bounds = Bounds {
            max_batch_items: 30,
            ..p.bounds
        };
        let batch = |n: usize| {
            let items: Vec<String> = (0..n).map(|i| call(i, "start_chat")).collect();
            format!("[{}]", items.join(","))
        };
        assert_eq!(
            p.jsonrpc.classify(batch(31).as_bytes(), &bounds),
            Err(Unclassifiable::TooManyItems {
                max_batch_items: 30
            })
        );
        let items = p.jsonrpc.classify(batch(30).as_bytes(), &bounds);
        let expensive = p.class("expensive").expect("a built-in class");
        assert_eq!(items.map(|i| i.count(expensive)), Ok(30));
    }

    #[test]
    fn e5_depth_is_counted_as_the_values_nest() {
        let p = default_policy().expect("default policy");
        let bounds = |max_json_depth| Bounds {
            max_json_depth,
            ..p.bounds
        };
        let classify = |body: &str, max| p.jsonrpc.classify(body.as_bytes(), &bounds(max));
        let too_deep = |max| {
            Err(Unclassifiable::TooDeep {
                max_json_depth: max,
            })
        };
        // The method's value is at depth 2, a param's at 3.
        let rpc = r#"{"jsonrpc":"2.0","method":"ping","params":{"a":1}}"#;
        assert!(classify(rpc, 3).is_ok());
        assert_eq!(classify(rpc, 2), too_deep(2));
        let braces = r#"{"method":"ping","params":{"a":"[[[[{{{{\"]]]"}}"#;
        assert!(
            classify(braces, 3).is_ok(),
            "brackets in strings do not nest"
        );
        assert!(classify(r#"{"method":"ping","params":{}}"#, 2).is_ok());
        assert_eq!(
            classify(r#"{"method":"ping","params":{"a":[]}}"#, 2),
            too_deep(2)
        );
        let deep = format!("{}{}", "[".repeat(100), "]".repeat(100));
        assert_eq!(classify(&deep, 64), too_deep(64));
        // The parser's own limit is never reached.
        let deepest = format!(
            "{}{}",
            "[".repeat(crate::MAX_JSON_DEPTH),
            "]".repeat(crate::MAX_JSON_DEPTH)
        );
        assert!(classify(&deepest, crate::MAX_JSON_DEPTH).is_ok());
        let past = format!("[{deepest}]");
        assert_eq!(
            classify(&past, crate::MAX_JSON_DEPTH),
            too_deep(crate::MAX_JSON_DEPTH)
        );
    }

    #[test]
    fn e5_bodies_that_are_not_utf8_json_rpc_are_unclassifiable() {
        let ping = br#"{"jsonrpc":"2.0","id":1,"method":"ping"}"#;
        assert!(classify(ping).is_ok());
        let with_bom = [&b"\xEF\xBB\xBF"[..], ping].concat();
        assert_eq!(classify(&with_bom), Err(Unclassifiable::ByteOrderMark));
        let utf16: Vec<u8> = std::str::from_utf8(ping)
            .expect("ascii")
            .encode_utf16()
            .flat_map(u16::to_le_bytes)
            .collect();
        assert_eq!(classify(&utf16), Err(Unclassifiable::NotUtf8));
        let utf16_bom = [&b"\xFF\xFE"[..], &utf16].concat();
        assert_eq!(classify(&utf16_bom), Err(Unclassifiable::ByteOrderMark));
        assert_eq!(
            classify(&[0xff, 0xfe, b'{']),
            Err(Unclassifiable::ByteOrderMark)
        );
        assert_eq!(classify(&[b'{', 0xc3, b'}']), Err(Unclassifiable::NotUtf8));
        assert_eq!(classify(b"this is not json"), Err(Unclassifiable::NotJson));
        assert_eq!(classify(b""), Err(Unclassifiable::NotJson));
        assert_eq!(
            classify(br#"{"method":"ping""#),
            Err(Unclassifiable::NotJson)
        );
        assert_eq!(classify(b"[]"), Err(Unclassifiable::EmptyBatch));
        for not_rpc in [&b"42"[..], br#""tools/call""#, b"null", b"true"] {
            assert_eq!(classify(not_rpc), Err(Unclassifiable::NotJsonRpc));
        }
    }

    #[test]
    fn e5_jsonrpc_that_names_nothing_known_still_counts_as_standard() {
        let class = default_policy().expect("default policy").class("standard");
        let class = class.expect("a built-in class");
        let standard = |body: &str| classify(body.as_bytes()).map(|i| i.count(class));
        assert_eq!(standard(r#"{"hello":"world"}"#), Ok(1));
        assert_eq!(standard(&call(1, "no_such_tool")), Ok(1));
        assert_eq!(
            standard(r#"{"jsonrpc":"2.0","id":1,"method":"no/such"}"#),
            Ok(1)
        );
        assert_eq!(standard("[1]"), Ok(1), "a batch item that is not an object");
    }

    #[test]
    fn only_identity_content_encoding_is_readable() {
        let headers = |values: &[&str]| {
            let mut h = HeaderMap::new();
            for v in values {
                h.append(
                    CONTENT_ENCODING,
                    http::HeaderValue::from_str(v).expect("value"),
                );
            }
            h
        };
        for ok in [
            &[][..],
            &["identity"],
            &["Identity"],
            &["identity, identity"],
            &[""],
        ] {
            assert_eq!(check_content_encoding(&headers(ok)), Ok(()), "{ok:?}");
        }
        for refused in [
            &["gzip"][..],
            &["identity", "br"],
            &["identity, deflate"],
            &["x-gzip"],
        ] {
            assert_eq!(
                check_content_encoding(&headers(refused)),
                Err(Unclassifiable::Encoded),
                "{refused:?}"
            );
        }
    }
}
