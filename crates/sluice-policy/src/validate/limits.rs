//! `limits:`, `paths:` and `store:`: the bounds of what is read, how paths are
//! matched and how long the shared store may take.

use crate::model::{Bounds, StorePolicy};
use crate::path::Paths;
use crate::raw::RawPolicy;

use super::{
    Checker, DEFAULT_MAX_BATCH_ITEMS, DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_JSON_DEPTH,
    DEFAULT_STORE_TIMEOUT_MS, MAX_JSON_DEPTH,
};

impl Checker {
    /// `limits:`: the bounds of a body, its JSON nesting and a batch, each above zero.
    pub(super) fn bounds(&mut self, raw: &RawPolicy) -> Bounds {
        let bounds = Bounds {
            max_body_bytes: raw.limits.max_body_bytes.unwrap_or(DEFAULT_MAX_BODY_BYTES),
            max_json_depth: raw.limits.max_json_depth.unwrap_or(DEFAULT_MAX_JSON_DEPTH),
            max_batch_items: raw
                .limits
                .max_batch_items
                .unwrap_or(DEFAULT_MAX_BATCH_ITEMS),
        };
        if bounds.max_body_bytes == 0 || bounds.max_json_depth == 0 || bounds.max_batch_items == 0 {
            self.problem("limits", "every bound must be above zero");
        }
        if bounds.max_json_depth > MAX_JSON_DEPTH {
            self.problem(
                "limits.max_json_depth",
                format!(
                    "at most {MAX_JSON_DEPTH} (the JSON parser reads no deeper), got {}",
                    bounds.max_json_depth
                ),
            );
        }
        bounds
    }

    /// `store:`: the longest wait per decision (1 ms to 60 s) and the replicas.
    pub(super) fn store(&mut self, raw: &RawPolicy) -> Option<StorePolicy> {
        let s = &raw.store;
        let timeout_ms = s.timeout_ms.unwrap_or(DEFAULT_STORE_TIMEOUT_MS);
        if timeout_ms == 0 || timeout_ms > 60_000 {
            self.problem(
                "store.timeout_ms",
                format!("expected 1..=60000 milliseconds, got {timeout_ms}"),
            );
        }
        let replicas = self.nonzero("store.replicas", s.replicas.unwrap_or(1));
        Some(StorePolicy {
            timeout: std::time::Duration::from_millis(timeout_ms),
            replicas: replicas?,
        })
    }
}

/// `paths:`: whether slashes merge (by default they do) and whether case counts
/// (by default it does not).
pub(super) fn paths(raw: &RawPolicy) -> Paths {
    Paths {
        merge_slashes: raw.paths.merge_slashes.unwrap_or(true),
        case: match raw.paths.case {
            Some(crate::raw::RawPathCase::Sensitive) => crate::PathCase::Sensitive,
            Some(crate::raw::RawPathCase::Insensitive) | None => crate::PathCase::Insensitive,
        },
    }
}
