//! The service's counters, registered once per label set and kept: a call
//! increments handles it already holds instead of building and looking up a
//! labelled key in the registry (what `metrics::counter!` does each time).
//! Bounded: past [`MAX_LABEL_SETS`] label sets, new ones are counted under
//! `rule="other"`.

use std::collections::HashMap;

use metrics::Counter;
use parking_lot::RwLock;

/// Most distinct (domain, rule) label sets kept (a `detailed_metric` rule makes
/// one per value).
pub const MAX_LABEL_SETS: usize = 10_000;

/// A domain's request counters by (code, outcome).
type ByCode = HashMap<(&'static str, &'static str), Counter>;

/// `sluice_rls_requests_total` and `sluice_rls_descriptors_total` handles.
#[derive(Default)]
pub(crate) struct Counters {
    /// (domain, code, outcome) → requests.
    requests: RwLock<HashMap<String, ByCode>>,
    /// domain → rule → [ok, over_limit].
    descriptors: RwLock<HashMap<String, HashMap<String, [Counter; 2]>>>,
}

impl Counters {
    pub(crate) fn request(&self, domain: &str, code: &'static str, outcome: &'static str) {
        if let Some(c) = self
            .requests
            .read()
            .get(domain)
            .and_then(|m| m.get(&(code, outcome)))
        {
            c.increment(1);
            return;
        }
        let counter = metrics::counter!(
            "sluice_rls_requests_total",
            "domain" => domain.to_owned(),
            "code" => code,
            "outcome" => outcome
        );
        counter.increment(1);
        let mut map = self.requests.write();
        if map.len() < MAX_LABEL_SETS || map.contains_key(domain) {
            map.entry(domain.to_owned())
                .or_default()
                .insert((code, outcome), counter);
        }
    }

    pub(crate) fn descriptor(&self, domain: &str, rule: &str, over: bool) {
        let i = usize::from(over);
        if let Some(c) = self
            .descriptors
            .read()
            .get(domain)
            .and_then(|m| m.get(rule))
        {
            c[i].increment(1);
            return;
        }
        let mut map = self.descriptors.write();
        let full = map.values().map(HashMap::len).sum::<usize>() >= MAX_LABEL_SETS;
        let rule = if full { "other" } else { rule };
        let make = |code: &'static str| {
            metrics::counter!(
                "sluice_rls_descriptors_total",
                "domain" => domain.to_owned(),
                "rule" => rule.to_owned(),
                "code" => code
            )
        };
        let pair = [make("ok"), make("over_limit")];
        pair[i].increment(1);
        if !full || rule == "other" {
            map.entry(domain.to_owned())
                .or_default()
                .insert(rule.to_owned(), pair);
        }
    }
}
