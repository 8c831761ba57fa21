//! `JsonRpc::classify` of the default policy on arbitrary bytes, with the policy's
//! bounds and with tight bounds picked from the input (depth 1–127, batch 1–8).
//!
//! Beyond "no panic", checked against serde_json's own reading of the body:
//! - what serde_json cannot read is an error, never a count;
//! - a body deeper than `max_json_depth` is `TooDeep`, a batch of more than
//!   `max_batch_items` is `TooManyItems` (past a bound: an error, never a cheaper
//!   count); an empty batch is `EmptyBatch`, a scalar `NotJsonRpc`;
//! - otherwise the body is counted: the items counted are exactly the batch's items
//!   (one for an object), so at most `max_batch_items`.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use serde_json::Value;
use sluice_policy::{Bounds, MAX_JSON_DEPTH, Policy, Unclassifiable, default_policy};

fn policy() -> &'static Policy {
    static POLICY: OnceLock<Policy> = OnceLock::new();
    POLICY.get_or_init(|| default_policy().expect("the default policy"))
}

/// The depth of a value: 1 for a scalar or an empty array or object, one more than
/// its deepest member otherwise.
fn depth(value: &Value) -> usize {
    1 + match value {
        Value::Array(a) => a.iter().map(depth).max().unwrap_or(0),
        Value::Object(o) => o.values().map(depth).max().unwrap_or(0),
        _ => 0,
    }
}

fn check(body: &[u8], bounds: &Bounds) {
    let policy = policy();
    let result = policy.jsonrpc.classify(body, bounds);
    let Ok(value) = serde_json::from_slice::<Value>(body) else {
        assert!(result.is_err(), "a body serde_json cannot read was counted");
        return;
    };
    let expected = if depth(&value) > bounds.max_json_depth {
        Err(Unclassifiable::TooDeep {
            max_json_depth: bounds.max_json_depth,
        })
    } else {
        match &value {
            Value::Array(a) if a.is_empty() => Err(Unclassifiable::EmptyBatch),
            Value::Array(a) if a.len() > bounds.max_batch_items => {
                Err(Unclassifiable::TooManyItems {
                    max_batch_items: bounds.max_batch_items,
                })
            }
            Value::Array(a) => Ok(a.len()),
            Value::Object(_) => Ok(1),
            _ => Err(Unclassifiable::NotJsonRpc),
        }
    };
    match (result, expected) {
        (Ok(items), Ok(n)) => {
            let counted: u32 = policy().class_ids().map(|c| items.count(c)).sum();
            assert_eq!(counted as usize, n, "items counted");
            assert!(n <= bounds.max_batch_items);
            for (_, calls) in items.lanes_called() {
                assert!(usize::from(calls) <= n);
            }
        }
        (result, expected) => assert_eq!(
            result.map(|_| ()),
            expected.map(|_| ()),
            "{:?}",
            String::from_utf8_lossy(body)
        ),
    }
}

fuzz_target!(|data: &[u8]| {
    let policy = policy();
    check(data, &policy.bounds);
    // Tight bounds from the body's bytes, so the fuzzer meets them at small sizes.
    let h = data.iter().fold(0usize, |h, &b| {
        h.wrapping_mul(31).wrapping_add(usize::from(b))
    });
    let tight = Bounds {
        max_json_depth: 1 + h % MAX_JSON_DEPTH,
        max_batch_items: 1 + (h >> 8) % 8,
        ..policy.bounds
    };
    check(data, &tight);
});
