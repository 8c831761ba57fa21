//! JSON-RPC bodies (SPEC E5): the class of every item of a request or batch.

use serde_json::Value;

use crate::model::{Bounds, Class, JsonRpc};

/// What a JSON-RPC body holds, by class.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Items {
    /// Items per class, indexed by [`Class::index`].
    pub counts: [u32; 4],
}

impl Items {
    /// One item of `class`.
    pub fn one(class: Class) -> Self {
        let mut items = Items::default();
        items.counts[class.index()] = 1;
        items
    }

    /// Items of `class`.
    pub fn count(&self, class: Class) -> u32 {
        self.counts[class.index()]
    }

    /// True when every item is protocol traffic.
    pub fn protocol_only(&self) -> bool {
        Class::ALL
            .iter()
            .all(|&c| c == Class::Protocol || self.count(c) == 0)
    }
}

impl JsonRpc {
    /// Classifies a body. A body that is not JSON-RPC (not JSON, not UTF-8,
    /// too deep, an empty or oversized batch) counts as one item of the
    /// default class; it never fails.
    pub fn classify(&self, body: &[u8], bounds: &Bounds) -> Items {
        let Ok(value) = serde_json::from_slice::<Value>(body) else {
            return Items::one(self.default_class);
        };
        if depth_exceeds(&value, bounds.max_json_depth) {
            return Items::one(self.default_class);
        }
        match &value {
            Value::Array(batch) if !batch.is_empty() && batch.len() <= bounds.max_batch_items => {
                let mut items = Items::default();
                for item in batch {
                    items.counts[self.item_class(item).index()] += 1;
                }
                items
            }
            Value::Object(_) => Items::one(self.item_class(&value)),
            _ => Items::one(self.default_class),
        }
    }

    /// The class of one JSON-RPC message.
    pub fn item_class(&self, item: &Value) -> Class {
        let Some(method) = item.get("method").and_then(Value::as_str) else {
            return self.default_class;
        };
        if method == "tools/call" {
            let params = item.get("params");
            let name = params.and_then(|p| p.get("name")).and_then(Value::as_str);
            let action = params
                .and_then(|p| p.get("arguments"))
                .and_then(|a| a.get("action"))
                .and_then(Value::as_str);
            return name.map_or(self.default_class, |n| self.tool_class(n, action));
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
        if let Some(&c) = self.tools.get(name) {
            return c;
        }
        self.retired
            .get(name)
            .and_then(|actions| actions.get(action?))
            .and_then(|tool| self.tools.get(tool))
            .copied()
            .unwrap_or(self.default_class)
    }
}

/// True when `value` nests deeper than `max` (iterative: no recursion on input).
fn depth_exceeds(value: &Value, max: usize) -> bool {
    let mut stack = vec![(value, 1usize)];
    while let Some((v, d)) = stack.pop() {
        if d > max {
            return true;
        }
        match v {
            Value::Array(a) => stack.extend(a.iter().map(|x| (x, d + 1))),
            Value::Object(o) => stack.extend(o.values().map(|x| (x, d + 1))),
            _ => {}
        }
    }
    false
}
