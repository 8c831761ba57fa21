//! The body of a batch submit (`POST <route>/batch`): checked before anything is
//! decided, so a body that cannot be queued spends nothing.

use serde_json::Value;

use crate::Refused;

/// Longest `idempotency_key` accepted.
pub const MAX_IDEMPOTENCY_KEY: usize = 256;

/// A checked batch submit: its items (each the JSON body of one single call) and
/// its idempotency key.
#[derive(Debug)]
pub struct BatchSubmit {
    /// The items, in order, each as its JSON text.
    pub items: Vec<Vec<u8>>,
    /// The idempotency key, if one was given.
    pub idempotency_key: Option<String>,
}

/// Why a batch body cannot be queued.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BadBatch {
    /// A short machine-readable reason (`details.reason`).
    pub reason: &'static str,
    /// The item index or count the reason is about.
    pub n: usize,
}

impl std::fmt::Display for BadBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.n;
        match self.reason {
            "not_json" => f.write_str("the batch body is not JSON"),
            "not_an_object" => f.write_str(
                "the batch body must be an object: {\"items\": [...], \"idempotency_key\": \"...\"}",
            ),
            "unknown_field" => f.write_str("a batch has only `items` and `idempotency_key`"),
            "bad_idempotency_key" => write!(
                f,
                "`idempotency_key` must be a string of 1 to {MAX_IDEMPOTENCY_KEY} bytes"
            ),
            "no_items" => f.write_str("`items` must be an array of request bodies"),
            "empty_batch" => f.write_str("`items` is empty: a batch needs at least one item"),
            "too_many_items" => write!(f, "a batch holds at most {n} items"),
            "item_not_an_object" => write!(
                f,
                "items[{n}] is not a JSON object (each item is the body of one call)"
            ),
            other => f.write_str(other),
        }
    }
}

impl std::error::Error for BadBatch {}

fn bad(reason: &'static str, n: usize) -> Refused {
    Refused::Batch(BadBatch { reason, n })
}

/// Checks a batch body: an object with a non-empty `items` array of at most
/// `max_items` JSON objects, and an optional string `idempotency_key`; nothing
/// else.
///
/// # Errors
/// [`Refused::Batch`] saying what is wrong.
pub fn parse_batch(body: &[u8], max_items: u32) -> Result<BatchSubmit, Refused> {
    let value: Value = serde_json::from_slice(body).map_err(|_| bad("not_json", 0))?;
    let Value::Object(mut object) = value else {
        return Err(bad("not_an_object", 0));
    };
    if object
        .keys()
        .any(|k| k != "items" && k != "idempotency_key")
    {
        return Err(bad("unknown_field", 0));
    }
    let idempotency_key = match object.remove("idempotency_key") {
        None | Some(Value::Null) => None,
        Some(Value::String(key)) if !key.is_empty() && key.len() <= MAX_IDEMPOTENCY_KEY => {
            Some(key)
        }
        Some(_) => {
            return Err(bad("bad_idempotency_key", 0));
        }
    };
    let Some(Value::Array(items)) = object.remove("items") else {
        return Err(bad("no_items", 0));
    };
    if items.is_empty() {
        return Err(bad("empty_batch", 0));
    }
    if items.len() > max_items as usize {
        return Err(bad("too_many_items", max_items as usize));
    }
    let mut bodies = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        if !item.is_object() {
            return Err(bad("item_not_an_object", i));
        }
        bodies.push(serde_json::to_vec(item).unwrap_or_default());
    }
    Ok(BatchSubmit {
        items: bodies,
        idempotency_key,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn l4_batch_bodies_are_checked() {
        let ok = parse_batch(
            br#"{"items":[{"message":"a"},{"message":"b"}],"idempotency_key":"k1"}"#,
            10,
        )
        .expect("a good batch");
        assert_eq!(ok.items.len(), 2);
        assert_eq!(ok.idempotency_key.as_deref(), Some("k1"));
        for (body, reason) in [
            (&b"[1]"[..], "not_an_object"),
            (b"{", "not_json"),
            (br#"{"items":[]}"#, "empty_batch"),
            (br#"{"items":{}}"#, "no_items"),
            (br#"{}"#, "no_items"),
            (br#"{"items":[1]}"#, "item_not_an_object"),
            (br#"{"items":[{}],"extra":1}"#, "unknown_field"),
            (
                br#"{"items":[{}],"idempotency_key":5}"#,
                "bad_idempotency_key",
            ),
            (br#"{"items":[{},{},{}]}"#, "too_many_items"),
        ] {
            match parse_batch(body, 2) {
                Err(Refused::Batch(b)) => {
                    assert_eq!(b.reason, reason, "{}", String::from_utf8_lossy(body))
                }
                other => panic!("{}: {other:?}", String::from_utf8_lossy(body)),
            }
        }
    }
}
