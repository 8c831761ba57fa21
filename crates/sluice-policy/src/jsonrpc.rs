//! JSON-RPC bodies (SPEC E5): the class of every item of a request or batch.

use serde_json::Value;

use crate::model::{Bounds, Class, JsonRpc, MAX_BUCKETS, MAX_QUOTA_FAMILIES, Spends};

/// What a request holds: items by class, and what its items spend besides
/// (quota units by family, the buckets named).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Items {
    /// Items per class, indexed by [`Class::index`].
    pub counts: [u32; 4],
    /// Units per quota family, indexed like [`crate::Policy::quotas`].
    pub quotas: [u32; MAX_QUOTA_FAMILIES],
    /// Units per bucket, indexed like [`crate::Policy::buckets`]: each item that
    /// names a bucket spends one unit of it.
    pub bucket_units: [u16; MAX_BUCKETS],
}

impl Items {
    /// One item of `class`.
    pub fn one(class: Class) -> Self {
        let mut items = Items::default();
        items.counts[class.index()] = 1;
        items
    }

    /// Adds what one item spends besides its class.
    pub fn add_spends(&mut self, spends: &Spends) {
        for &b in &spends.buckets {
            if let Some(units) = self.bucket_units.get_mut(b) {
                *units = units.saturating_add(1);
            }
        }
        if let Some(q) = spends.quota
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
                    self.count_item(item, &mut items);
                }
                items
            }
            Value::Object(_) => {
                let mut items = Items::default();
                self.count_item(&value, &mut items);
                items
            }
            _ => Items::one(self.default_class),
        }
    }

    /// Counts one JSON-RPC message into `items`: its class, and for a tool call
    /// what the tool spends besides.
    fn count_item(&self, item: &Value, items: &mut Items) {
        match self.item_tool(item) {
            Some(tool) => {
                items.counts[tool.class.index()] += 1;
                items.add_spends(&tool.spends);
            }
            None => items.counts[self.item_class(item).index()] += 1,
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
