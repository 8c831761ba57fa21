//! The body of a batch submit (`POST <route>/batch`): checked before anything is
//! decided, so a body that cannot be queued spends nothing.

use serde_json::Value;

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
            "duplicate_key" => f.write_str(
                "the batch body names a key twice in one object: readers differ on which value counts",
            ),
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
            "batch_tool_in_batch" => f.write_str(
                "a batch tool call must be sent on its own, not inside a JSON-RPC batch",
            ),
            "item_not_an_object" => write!(
                f,
                "items[{n}] is not a JSON object (each item is the body of one call)"
            ),
            other => f.write_str(other),
        }
    }
}

impl std::error::Error for BadBatch {}

fn bad(reason: &'static str, n: usize) -> BadBatch {
    BadBatch { reason, n }
}

/// Checks a batch body: an object with a non-empty `items` array of at most
/// `max_items` JSON objects, and an optional string `idempotency_key`; nothing
/// else.
///
/// # Errors
/// [`BadBatch`] saying what is wrong (a [`Refused::Batch`](crate::Refused::Batch)
/// through `?`).
pub fn parse_batch(body: &[u8], max_items: u32) -> Result<BatchSubmit, BadBatch> {
    // A key named twice is refused, as in every body sluice reads: readers
    // differ on which value counts.
    let value: Value = sluice_policy::json::parse_unique(body).map_err(|e| match e {
        sluice_policy::json::NotUnique::DuplicateKey => bad("duplicate_key", 0),
        sluice_policy::json::NotUnique::NotJson => bad("not_json", 0),
    })?;
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
            // A key named twice, at the top or in an item (L4: as every body).
            (br#"{"items":[{"m":1}],"items":[{"m":2}]}"#, "duplicate_key"),
            (br#"{"items":[{"m":1,"m":2}]}"#, "duplicate_key"),
            (br#"{"items":[{"m":1,"\u006d":2}]}"#, "duplicate_key"),
        ] {
            match parse_batch(body, 2) {
                Err(b) => {
                    assert_eq!(b.reason, reason, "{}", String::from_utf8_lossy(body))
                }
                other => panic!("{}: {other:?}", String::from_utf8_lossy(body)),
            }
        }
    }
}

/// Which batch lane tool a JSON-RPC call is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BatchTool {
    /// The lane's submit tool (`arguments: {items, idempotency_key}`).
    Submit(usize),
    /// The lane's status tool (`arguments: {batch_id}`).
    Status(usize),
}

/// A JSON-RPC `tools/call` of a batch lane's tool: the tool, the call's id and
/// its arguments.
#[derive(Clone, Debug)]
pub struct BatchToolCall {
    /// Which tool of which lane (index into the policy's lanes).
    pub tool: BatchTool,
    /// The request id.
    pub id: Value,
    /// The call's arguments (`null` when absent).
    pub arguments: Value,
}

/// True when `body` may hold a call of a batch lane's tool: a cheap look,
/// before anything is parsed, that never says no to one. It looks for each
/// batch tool's name and each retired name that maps to one, and says yes to
/// any body with a `\u` escape (a name can be spelled with them).
pub fn may_call_batch_tool(policy: &sluice_policy::Policy, body: &[u8]) -> bool {
    let mut tools = batch_tools(policy).peekable();
    if tools.peek().is_none() {
        return false;
    }
    let has = |needle: &[u8]| memchr::memmem::find(body, needle).is_some();
    if has(b"\\u") {
        return true;
    }
    let quoted = |name: &str| has(format!("\"{name}\"").as_bytes());
    tools.any(|(_, name)| {
        quoted(name)
            || policy
                .jsonrpc
                .retired
                .iter()
                .any(|(retired, actions)| actions.values().any(|t| t == name) && quoted(retired))
    })
}

fn batch_tools(policy: &sluice_policy::Policy) -> impl Iterator<Item = (BatchTool, &str)> {
    policy.lanes.iter().enumerate().flat_map(|(i, lane)| {
        let batch = lane.batch.as_ref();
        [
            batch
                .and_then(|b| b.submit_tool.as_deref())
                .map(|t| (BatchTool::Submit(i), t)),
            batch
                .and_then(|b| b.status_tool.as_deref())
                .map(|t| (BatchTool::Status(i), t)),
        ]
        .into_iter()
        .flatten()
    })
}

/// The batch lane tool call `body` holds, if it is one: a single JSON-RPC
/// `tools/call` naming a lane's submit or status tool.
///
/// # Errors
/// [`BadBatch`] (`batch_tool_in_batch`) for a JSON-RPC batch holding such a
/// call: sluice answers those calls itself, one per request.
pub fn batch_tool_call(
    policy: &sluice_policy::Policy,
    body: &[u8],
) -> Result<Option<BatchToolCall>, BadBatch> {
    if !may_call_batch_tool(policy, body) {
        return Ok(None);
    }
    // Read as the classifier reads it (which refuses a key named twice).
    let Ok(value) = sluice_policy::json::parse_unique(body) else {
        return Ok(None);
    };
    // The tool as the classifier reads it: a retired name by its action.
    let tool_of = |message: &Value| -> Option<BatchTool> {
        let name = policy.jsonrpc.called_tool(message)?;
        batch_tools(policy)
            .find(|(_, t)| *t == name)
            .map(|(tool, _)| tool)
    };
    match &value {
        Value::Array(items) => {
            if items.iter().any(|m| tool_of(m).is_some()) {
                return Err(bad("batch_tool_in_batch", 0));
            }
            Ok(None)
        }
        message => Ok(tool_of(message).map(|tool| {
            let params = message.get("params");
            let mut arguments = params
                .and_then(|p| p.get("arguments"))
                .cloned()
                .unwrap_or(Value::Null);
            // A retired name's `action` chose the tool: it is no argument of it.
            let named = params.and_then(|p| p.get("name")).and_then(Value::as_str);
            if named != policy.jsonrpc.called_tool(message)
                && let Some(arguments) = arguments.as_object_mut()
            {
                arguments.remove("action");
            }
            BatchToolCall {
                tool,
                id: message.get("id").cloned().unwrap_or(Value::Null),
                arguments,
            }
        })),
    }
}
