//! Descriptor rules for Envoy's rate-limit service (SPEC R1), written in the
//! configuration format of envoyproxy/ratelimit and read as it is: a `domain`
//! and nested `descriptors` of `key`, optional `value` (a trailing `*` matches
//! any value with that prefix), `rate_limit` (`unit`, `requests_per_unit`,
//! `name`, `replaces`, `unlimited`), `shadow_mode` and `detailed_metric`.
//!
//! sluice reads a few keys beyond that format: `algorithm` (`fixed`, the
//! default and the reference's, `sliding` or `gcra`) and `burst` on a
//! `rate_limit`; `consistency` (`exact`, the default, or `leased`), `lease` and
//! `lease_ms` on one, as on a class (SPEC D4: replicas on Redis decide from
//! leases of it); and `outage` (`fail_open`, the default, or `fail_closed`) on a
//! domain. A file of that project loads unchanged; a key neither format has is
//! named with its path.
//!
//! Matching follows the reference: a request's descriptor of *n* entries
//! matches a rule *n* levels deep; at each level an entry matches a node with
//! its key and exactly its value first, then one whose value ends in `*` and
//! prefixes it (the longest prefix), then one with its key and no value (which
//! counts each value apart).

use std::collections::BTreeMap;
use std::num::NonZeroU32;
use std::path::{Path, PathBuf};

use serde_json::Value;
use sluice_core::{Problem, Rate};

use crate::PolicyError;
use crate::model::Algorithm;

/// Most domains one policy (and its directory) holds.
pub const MAX_DOMAINS: usize = 1_000;
/// Most descriptor nodes one domain holds.
pub const MAX_DESCRIPTOR_NODES: usize = 100_000;
/// Deepest nesting of `descriptors` (the longest descriptor a rule can match).
pub const MAX_DESCRIPTOR_DEPTH: usize = 16;
/// Largest domain file read, in bytes (as a policy file).
pub const MAX_DOMAIN_FILE_BYTES: u64 = 4 * 1024 * 1024;
/// Longest `domain`, `key`, `value` or rule `name`, in bytes.
pub const MAX_DESCRIPTOR_TEXT: usize = 1_024;

/// The unit of a rule's `requests_per_unit`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unit {
    /// One second.
    Second,
    /// 60 seconds.
    Minute,
    /// 3,600 seconds.
    Hour,
    /// 86,400 seconds.
    Day,
    /// 7 days.
    Week,
    /// The calendar month (UTC), counted in the durable store as monthly
    /// quotas are.
    Month,
    /// 365 days, windows aligned to the Unix epoch.
    Year,
}

impl Unit {
    /// Parses a unit as the reference spells it (any case).
    pub fn parse(text: &str) -> Option<Unit> {
        Some(match text.to_ascii_lowercase().as_str() {
            "second" => Unit::Second,
            "minute" => Unit::Minute,
            "hour" => Unit::Hour,
            "day" => Unit::Day,
            "week" => Unit::Week,
            "month" => Unit::Month,
            "year" => Unit::Year,
            _ => return None,
        })
    }

    /// Its name, lower case.
    pub const fn name(self) -> &'static str {
        match self {
            Unit::Second => "second",
            Unit::Minute => "minute",
            Unit::Hour => "hour",
            Unit::Day => "day",
            Unit::Week => "week",
            Unit::Month => "month",
            Unit::Year => "year",
        }
    }

    /// Its length in seconds (a month: 31 days, the longest).
    pub const fn seconds(self) -> u32 {
        match self {
            Unit::Second => 1,
            Unit::Minute => 60,
            Unit::Hour => 3_600,
            Unit::Day => 86_400,
            Unit::Week => 604_800,
            Unit::Month => 2_678_400,
            Unit::Year => 31_536_000,
        }
    }
}

/// What a node's `value` matches.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum ValueMatch {
    /// No `value`: any value, each counted apart.
    Any,
    /// This value exactly.
    Exact(String),
    /// `prefix*`: any value starting with the prefix, each counted apart.
    Prefix(String),
}

/// One rule: the limit a matched descriptor is held to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DescriptorRule {
    /// Where it is: the keys and values down to it, `key_value.key2` as the
    /// reference names its metrics.
    pub id: String,
    /// Its `name` (what `replaces` refers to), if it has one.
    pub name: Option<String>,
    /// Requests per unit (0 refuses every request).
    pub limit: u32,
    /// The unit.
    pub unit: Unit,
    /// How it counts (`fixed`, the reference's, unless the rule says otherwise).
    pub algorithm: Algorithm,
    /// `unlimited: true`: always admitted, never counted.
    pub unlimited: bool,
    /// Decided on the store each time, or from leases of it (SPEC D4).
    pub consistency: crate::model::Consistency,
    /// `shadow_mode: true`: decided and counted, never refuses.
    pub shadow: bool,
    /// `detailed_metric: true`: its metrics name each value apart.
    pub detailed_metric: bool,
    /// The rules (by index in [`Domain::rules`]) this one replaces when both
    /// match one request.
    pub replaces: Vec<usize>,
}

impl DescriptorRule {
    /// How the store counts it. `None` for an unlimited rule or one of 0
    /// requests (decided without the store).
    pub fn rate(&self) -> Option<Rate> {
        if self.unlimited || self.limit == 0 {
            return None;
        }
        let limit = NonZeroU32::new(self.limit)?;
        if self.unit == Unit::Month {
            return Some(Rate::CalendarMonth);
        }
        let seconds = NonZeroU32::new(self.unit.seconds())?;
        Some(self.algorithm.rate(seconds, limit))
    }
}

/// One level of a domain's descriptor tree.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DescriptorNode {
    /// The entry key it matches.
    pub key: String,
    /// The entry value it matches.
    pub value: ValueMatch,
    /// Its rule (index in [`Domain::rules`]), if it sets one.
    pub rule: Option<usize>,
    /// The next level, ordered as [`Domain::lookup`] reads a level: by key, a key's
    /// exact values first (by value), then its prefixes, then its node without a
    /// value (the order the reader gives them).
    pub children: Vec<DescriptorNode>,
}

/// What the store does while it cannot decide for a domain.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DomainOutage {
    /// Answer `OK` (Envoy's own default when its rate-limit service fails).
    #[default]
    FailOpen,
    /// Answer `OVER_LIMIT`.
    FailClosed,
}

/// One domain: its descriptor tree and rules.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Domain {
    /// Its name (`domain:`).
    pub name: String,
    /// What is answered while the store cannot decide.
    pub outage: DomainOutage,
    /// Every rule, in the order of the file.
    pub rules: Vec<DescriptorRule>,
    /// The top level of the tree, ordered as [`DescriptorNode::children`].
    pub descriptors: Vec<DescriptorNode>,
    /// Where it was read: `domains[i]` of the policy, or a file.
    pub source: String,
}

impl Domain {
    /// The node a descriptor's `entries` (key, value) match, if any: the one
    /// as many levels deep as the descriptor has entries.
    pub fn lookup<'d>(&'d self, entries: &[(&str, &str)]) -> Option<&'d DescriptorNode> {
        let mut level = &self.descriptors;
        let mut found = None;
        for (key, value) in entries {
            let node = best_match(level, key, value)?;
            found = Some(node);
            level = &node.children;
        }
        found
    }
}

/// At one level (in [`level_order`]), the node for `key` and `value`: exact value
/// first, then the longest matching prefix, then the key with no value. The key's
/// nodes and an exact value are found by binary search; its prefixes (few, in files
/// as written) are scanned.
fn best_match<'d>(
    level: &'d [DescriptorNode],
    key: &str,
    value: &str,
) -> Option<&'d DescriptorNode> {
    let start = level.partition_point(|n| n.key.as_str() < key);
    let same_key = &level[start..];
    let same_key = &same_key[..same_key.partition_point(|n| n.key == key)];
    let exact = same_key.partition_point(|n| matches!(n.value, ValueMatch::Exact(_)));
    let found = same_key[..exact].binary_search_by(|n| match &n.value {
        ValueMatch::Exact(v) => v.as_str().cmp(value),
        ValueMatch::Prefix(_) | ValueMatch::Any => std::cmp::Ordering::Greater,
    });
    if let Ok(i) = found {
        return same_key.get(i);
    }
    let mut prefix: Option<(&DescriptorNode, usize)> = None;
    let mut any = None;
    for node in &same_key[exact..] {
        match &node.value {
            ValueMatch::Exact(_) => {}
            ValueMatch::Prefix(p) if value.starts_with(p.as_str()) => {
                if prefix.is_none_or(|(_, len)| p.len() > len) {
                    prefix = Some((node, p.len()));
                }
            }
            ValueMatch::Prefix(_) => {}
            ValueMatch::Any => any = Some(node),
        }
    }
    prefix.map(|(n, _)| n).or(any)
}

/// Reads the domains of a policy's `domains:` list (each in the reference
/// format), adding each problem at its key path.
pub(crate) fn from_policy(list: &[Value], problems: &mut Vec<Problem>) -> Vec<Domain> {
    list.iter()
        .enumerate()
        .filter_map(|(i, v)| domain(v, &format!("domains[{i}]"), problems))
        .collect()
}

/// Reads one file of the reference's format (`text`, read from `file`).
///
/// # Errors
/// [`PolicyError::Invalid`] with every problem, each at its key path
/// (`descriptors[1].rate_limit.unit`).
pub fn parse_domain_file(text: &str, file: &Path) -> Result<Domain, PolicyError> {
    parse_domain(text, file).map_err(|problems| PolicyError::Invalid {
        file: file.to_owned(),
        problems,
    })
}

fn parse_domain(text: &str, file: &Path) -> Result<Domain, Vec<Problem>> {
    #[cfg(feature = "yaml")]
    let value: Value = serde_saphyr::from_str(text).map_err(|e| {
        vec![Problem {
            path: String::new(),
            message: e.to_string(),
        }]
    })?;
    #[cfg(not(feature = "yaml"))]
    let value: Value = serde_json::from_str(text).map_err(|e| {
        vec![Problem {
            path: String::new(),
            message: e.to_string(),
        }]
    })?;
    let mut problems = Vec::new();
    let found = domain(&value, "", &mut problems);
    match found {
        Some(mut d) if problems.is_empty() => {
            d.source = file.display().to_string();
            Ok(d)
        }
        _ => Err(problems),
    }
}

/// Reads every `*.yaml` and `*.yml` file of `dir` (not its subdirectories) as a
/// domain file, and checks that no domain appears twice among them and
/// `already` (the policy's).
///
/// # Errors
/// [`PolicyError::Invalid`] for `dir` with each file's problems, each as `file:
/// path: message`.
pub fn load_domain_dir(dir: &Path, already: &[Domain]) -> Result<Vec<Domain>, PolicyError> {
    load_dir(dir, already).map_err(|problems| PolicyError::Invalid {
        file: dir.to_owned(),
        problems,
    })
}

fn load_dir(dir: &Path, already: &[Domain]) -> Result<Vec<Domain>, Vec<Problem>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| {
            vec![Problem {
                path: dir.display().to_string(),
                message: format!("cannot read the directory: {e}"),
            }]
        })?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| {
            p.is_file()
                && p.extension().is_some_and(|x| {
                    x.eq_ignore_ascii_case("yaml") || x.eq_ignore_ascii_case("yml")
                })
        })
        .collect();
    files.sort();
    let mut problems = Vec::new();
    let mut domains = Vec::new();
    for file in files {
        let shown = file.display().to_string();
        let text = match read_bounded(&file) {
            Ok(Some(text)) => text,
            Ok(None) => {
                problems.push(Problem {
                    path: shown,
                    message: format!("larger than {MAX_DOMAIN_FILE_BYTES} bytes, not read"),
                });
                continue;
            }
            Err(e) => {
                problems.push(Problem {
                    path: shown,
                    message: format!("cannot read: {e}"),
                });
                continue;
            }
        };
        match parse_domain(&text, &file) {
            Ok(d) => domains.push(d),
            Err(found) => problems.extend(found.into_iter().map(|p| Problem {
                path: if p.path.is_empty() {
                    shown.clone()
                } else {
                    format!("{shown}: {}", p.path)
                },
                message: p.message,
            })),
        }
    }
    let mut seen: BTreeMap<&str, &str> = already
        .iter()
        .map(|d| (d.name.as_str(), d.source.as_str()))
        .collect();
    for d in &domains {
        if let Some(first) = seen.insert(&d.name, &d.source) {
            problems.push(Problem {
                path: d.source.clone(),
                message: format!("domain {:?} is also defined in {first}", d.name),
            });
        }
    }
    if seen.len() > MAX_DOMAINS {
        problems.push(Problem {
            path: dir.display().to_string(),
            message: format!("at most {MAX_DOMAINS} domains"),
        });
    }
    if problems.is_empty() {
        Ok(domains)
    } else {
        Err(problems)
    }
}

/// The text of `file`, `None` when it is larger than [`MAX_DOMAIN_FILE_BYTES`]
/// (no more than that is read).
fn read_bounded(file: &Path) -> std::io::Result<Option<String>> {
    use std::io::Read as _;
    let mut bytes = Vec::new();
    std::fs::File::open(file)?
        .take(MAX_DOMAIN_FILE_BYTES + 1)
        .read_to_end(&mut bytes)?;
    if bytes.len() as u64 > MAX_DOMAIN_FILE_BYTES {
        return Ok(None);
    }
    String::from_utf8(bytes)
        .map(Some)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

/// Checks that no domain of the policy appears twice.
pub(crate) fn check_unique(domains: &[Domain], problems: &mut Vec<Problem>) {
    let mut seen: BTreeMap<&str, &str> = BTreeMap::new();
    for d in domains {
        if let Some(first) = seen.insert(&d.name, &d.source) {
            problems.push(Problem {
                path: d.source.clone(),
                message: format!("domain {:?} is also defined at {first}", d.name),
            });
        }
    }
    if domains.len() > MAX_DOMAINS {
        problems.push(Problem {
            path: "domains".to_owned(),
            message: format!("at most {MAX_DOMAINS} domains"),
        });
    }
}

fn join(at: &str, key: &str) -> String {
    if at.is_empty() {
        key.to_owned()
    } else {
        format!("{at}.{key}")
    }
}

struct Reader<'p> {
    problems: &'p mut Vec<Problem>,
}

impl Reader<'_> {
    fn problem(&mut self, path: String, message: impl Into<String>) {
        self.problems.push(Problem {
            path,
            message: message.into(),
        });
    }

    /// The map at `at`, each of its keys one of `known` (others are named).
    fn map<'v>(
        &mut self,
        value: &'v Value,
        at: &str,
        known: &[&str],
    ) -> Option<&'v serde_json::Map<String, Value>> {
        let Some(map) = value.as_object() else {
            self.problem(at.to_owned(), "expected a map");
            return None;
        };
        for key in map.keys() {
            if !known.contains(&key.as_str()) {
                self.problem(
                    join(at, key),
                    format!("unknown key; expected one of {}", known.join(", ")),
                );
            }
        }
        Some(map)
    }

    fn text(
        &mut self,
        map: &serde_json::Map<String, Value>,
        at: &str,
        key: &str,
    ) -> Option<String> {
        let value = map.get(key)?;
        let text = match value {
            Value::String(s) => s.clone(),
            // YAML reads `value: 10` as a number; the reference takes it as text.
            Value::Number(n) => n.to_string(),
            Value::Bool(b) => b.to_string(),
            _ => {
                self.problem(join(at, key), "expected text");
                return None;
            }
        };
        if text.len() > MAX_DESCRIPTOR_TEXT {
            self.problem(
                join(at, key),
                format!("at most {MAX_DESCRIPTOR_TEXT} bytes"),
            );
            return None;
        }
        Some(text)
    }

    fn flag(&mut self, map: &serde_json::Map<String, Value>, at: &str, key: &str) -> bool {
        match map.get(key) {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(_) => {
                self.problem(join(at, key), "expected true or false");
                false
            }
        }
    }
}

/// Reads one domain at `at` ("" for a file of its own).
fn domain(value: &Value, at: &str, problems: &mut Vec<Problem>) -> Option<Domain> {
    let before = problems.len();
    let mut r = Reader { problems };
    let map = r.map(value, at, &["domain", "descriptors", "outage"])?;
    let name = match r.text(map, at, "domain") {
        Some(name) if !name.is_empty() => name,
        Some(_) => {
            r.problem(join(at, "domain"), "must not be empty");
            String::new()
        }
        None => {
            if !map.contains_key("domain") {
                r.problem(join(at, "domain"), "required: the domain's name");
            }
            String::new()
        }
    };
    let outage = match map.get("outage") {
        None => DomainOutage::FailOpen,
        Some(Value::String(s)) if s == "fail_open" => DomainOutage::FailOpen,
        Some(Value::String(s)) if s == "fail_closed" => DomainOutage::FailClosed,
        Some(_) => {
            r.problem(join(at, "outage"), "expected fail_open or fail_closed");
            DomainOutage::FailOpen
        }
    };
    let mut d = Domain {
        name,
        outage,
        rules: Vec::new(),
        descriptors: Vec::new(),
        source: if at.is_empty() {
            String::new()
        } else {
            at.to_owned()
        },
    };
    // Names to resolve once every rule is read: (rule, names, path).
    let mut pending: Vec<(usize, Vec<String>, String)> = Vec::new();
    let mut nodes = 0usize;
    if let Some(list) = map.get("descriptors") {
        d.descriptors = descriptors(
            &mut r,
            list,
            &join(at, "descriptors"),
            "",
            1,
            &mut d.rules,
            &mut pending,
            &mut nodes,
        );
    }
    for (rule, names, path) in pending {
        let mut replaces = Vec::new();
        for (i, name) in names.iter().enumerate() {
            match d
                .rules
                .iter()
                .position(|x| x.name.as_deref() == Some(name.as_str()))
            {
                Some(target) if target != rule => replaces.push(target),
                Some(_) => r.problem(format!("{path}[{i}].name"), "a rule cannot replace itself"),
                None => r.problem(
                    format!("{path}[{i}].name"),
                    format!("no rule of domain {:?} is named {name:?}", d.name),
                ),
            }
        }
        if let Some(x) = d.rules.get_mut(rule) {
            x.replaces = replaces;
        }
    }
    let mut named: BTreeMap<&str, usize> = BTreeMap::new();
    for (i, rule) in d.rules.iter().enumerate() {
        if let Some(name) = &rule.name
            && named.insert(name, i).is_some()
        {
            r.problems.push(Problem {
                path: join(at, "descriptors"),
                message: format!(
                    "two rules are named {name:?}: `replaces` could not tell them apart"
                ),
            });
        }
    }
    (problems.len() == before).then_some(d)
}

#[allow(clippy::too_many_arguments)]
fn descriptors(
    r: &mut Reader<'_>,
    list: &Value,
    at: &str,
    parent_id: &str,
    depth: usize,
    rules: &mut Vec<DescriptorRule>,
    pending: &mut Vec<(usize, Vec<String>, String)>,
    nodes: &mut usize,
) -> Vec<DescriptorNode> {
    let Some(items) = list.as_array() else {
        if !list.is_null() {
            r.problem(at.to_owned(), "expected a list of descriptors");
        }
        return Vec::new();
    };
    if depth > MAX_DESCRIPTOR_DEPTH {
        r.problem(
            at.to_owned(),
            format!("at most {MAX_DESCRIPTOR_DEPTH} levels of descriptors"),
        );
        return Vec::new();
    }
    let mut out: Vec<DescriptorNode> = Vec::new();
    // The (key, value) pairs of this level so far: a second one is refused.
    let mut seen: std::collections::HashSet<(String, ValueMatch)> =
        std::collections::HashSet::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let at = format!("{at}[{i}]");
        *nodes += 1;
        if *nodes > MAX_DESCRIPTOR_NODES {
            r.problem(
                at,
                format!("at most {MAX_DESCRIPTOR_NODES} descriptors in a domain"),
            );
            return out;
        }
        let Some(map) = r.map(
            item,
            &at,
            &[
                "key",
                "value",
                "rate_limit",
                "shadow_mode",
                "detailed_metric",
                "descriptors",
            ],
        ) else {
            continue;
        };
        let key = match r.text(map, &at, "key") {
            Some(k) if !k.is_empty() => k,
            _ => {
                if !map.contains_key("key")
                    || map.get("key").is_some_and(|k| k.as_str() == Some(""))
                {
                    r.problem(
                        join(&at, "key"),
                        "required: the entry key this descriptor matches",
                    );
                }
                continue;
            }
        };
        let value = match r.text(map, &at, "value") {
            None => ValueMatch::Any,
            Some(v) => match v.strip_suffix('*') {
                Some(prefix) => ValueMatch::Prefix(prefix.to_owned()),
                None => ValueMatch::Exact(v),
            },
        };
        let id = {
            let part = match &value {
                ValueMatch::Any => key.clone(),
                ValueMatch::Exact(v) => format!("{key}_{v}"),
                ValueMatch::Prefix(p) => format!("{key}_{p}*"),
            };
            if parent_id.is_empty() {
                part
            } else {
                format!("{parent_id}.{part}")
            }
        };
        if !seen.insert((key.clone(), value.clone())) {
            r.problem(
                at.clone(),
                format!("a second descriptor with key {key:?} and this value at one level"),
            );
            continue;
        }
        let shadow = r.flag(map, &at, "shadow_mode");
        let detailed_metric = r.flag(map, &at, "detailed_metric");
        let rule = match map.get("rate_limit") {
            None | Some(Value::Null) => None,
            Some(raw) => rate_limit(
                r,
                raw,
                &join(&at, "rate_limit"),
                &id,
                shadow,
                detailed_metric,
                rules,
                pending,
            ),
        };
        let children = match map.get("descriptors") {
            None => Vec::new(),
            Some(list) => descriptors(
                r,
                list,
                &join(&at, "descriptors"),
                &id,
                depth + 1,
                rules,
                pending,
                nodes,
            ),
        };
        out.push(DescriptorNode {
            key,
            value,
            rule,
            children,
        });
    }
    // Ordered for `best_match`'s binary searches.
    out.sort_by(|a, b| level_order(a).cmp(&level_order(b)));
    out
}

/// Where a node stands in its level: by key, its exact values first (by value), then
/// its prefixes, then its `Any`. [`best_match`] finds a key's nodes and an exact value
/// by binary search, so a level of many values costs a lookup `log n`, not `n`.
fn level_order(node: &DescriptorNode) -> (&str, u8, &str) {
    match &node.value {
        ValueMatch::Exact(v) => (&node.key, 0, v),
        ValueMatch::Prefix(p) => (&node.key, 1, p),
        ValueMatch::Any => (&node.key, 2, ""),
    }
}

#[allow(clippy::too_many_arguments)]
fn rate_limit(
    r: &mut Reader<'_>,
    raw: &Value,
    at: &str,
    id: &str,
    shadow: bool,
    detailed_metric: bool,
    rules: &mut Vec<DescriptorRule>,
    pending: &mut Vec<(usize, Vec<String>, String)>,
) -> Option<usize> {
    let map = r.map(
        raw,
        at,
        &[
            "unit",
            "requests_per_unit",
            "name",
            "replaces",
            "unlimited",
            "algorithm",
            "burst",
            "consistency",
            "lease",
            "lease_ms",
        ],
    )?;
    let unlimited = r.flag(map, at, "unlimited");
    if unlimited && !unlimited_alone(r, map, at) {
        return None;
    }
    let unit = rate_limit_unit(r, map, at, unlimited)?;
    let limit = rate_limit_requests(r, map, at, unlimited)?;
    let name = r.text(map, at, "name").filter(|n| !n.is_empty());
    let replaces = rate_limit_replaces(r, map, at);
    let algorithm = rate_limit_algorithm(r, map, at, limit)?;
    let unit = unit.unwrap_or(Unit::Second);
    if !unit_takes_algorithm(r, at, unit, algorithm) {
        return None;
    }
    let consistency = rate_limit_consistency(r, map, at, (unit, algorithm, limit))?;
    let index = rules.len();
    if !replaces.is_empty() {
        pending.push((index, replaces, join(at, "replaces")));
    }
    rules.push(DescriptorRule {
        id: id.to_owned(),
        name,
        limit,
        unit,
        algorithm,
        unlimited,
        consistency,
        shadow,
        detailed_metric,
        replaces: Vec::new(),
    });
    Some(index)
}

/// Whether the `unlimited: true` rate limit at `at` names no `unit` and no
/// `requests_per_unit` (a problem for each it names). envoyproxy/ratelimit
/// refuses to load a unit with `unlimited` ("should not specify rate limit
/// unit when unlimited"); a limit beside it would be as silently ignored, so
/// it is refused too: a rule must not say a limit it does not keep.
fn unlimited_alone(r: &mut Reader<'_>, map: &serde_json::Map<String, Value>, at: &str) -> bool {
    let mut alone = true;
    for key in ["unit", "requests_per_unit"] {
        if map.contains_key(key) {
            r.problem(
                join(at, key),
                "not with `unlimited: true`: an unlimited rule counts nothing; remove one or the other",
            );
            alone = false;
        }
    }
    alone
}

/// The `unit:` of the rate limit at `at`: `None` within `Some` for an `unlimited`
/// rule that names none; `None` (with a problem) when it is wrong or missing.
fn rate_limit_unit(
    r: &mut Reader<'_>,
    map: &serde_json::Map<String, Value>,
    at: &str,
    unlimited: bool,
) -> Option<Option<Unit>> {
    match map.get("unit") {
        Some(Value::String(u)) => match Unit::parse(u) {
            Some(unit) => Some(Some(unit)),
            None => {
                r.problem(
                    join(at, "unit"),
                    format!("expected second, minute, hour, day, week, month or year, got {u:?}"),
                );
                None
            }
        },
        Some(_) => {
            r.problem(
                join(at, "unit"),
                "expected second, minute, hour, day, week, month or year",
            );
            None
        }
        None if unlimited => Some(None),
        None => {
            r.problem(join(at, "unit"), "required (or `unlimited: true`)");
            None
        }
    }
}

/// The `requests_per_unit:` of the rate limit at `at` (0 for an `unlimited` rule
/// that names none); `None` (with a problem) when it is wrong or missing.
fn rate_limit_requests(
    r: &mut Reader<'_>,
    map: &serde_json::Map<String, Value>,
    at: &str,
    unlimited: bool,
) -> Option<u32> {
    match map.get("requests_per_unit") {
        Some(Value::Number(n)) => match n.as_u64().and_then(|n| u32::try_from(n).ok()) {
            Some(n) => Some(n),
            None => {
                r.problem(
                    join(at, "requests_per_unit"),
                    "expected a whole number from 0 to 4294967295",
                );
                None
            }
        },
        Some(_) => {
            r.problem(
                join(at, "requests_per_unit"),
                "expected a whole number from 0 to 4294967295",
            );
            None
        }
        None if unlimited => Some(0),
        None => {
            r.problem(
                join(at, "requests_per_unit"),
                "required (or `unlimited: true`)",
            );
            None
        }
    }
}

/// The names under `replaces:` of the rate limit at `at` (a problem for each item
/// that is not `- name: <rule>`).
fn rate_limit_replaces(
    r: &mut Reader<'_>,
    map: &serde_json::Map<String, Value>,
    at: &str,
) -> Vec<String> {
    match map.get("replaces") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(list)) => {
            let mut names = Vec::new();
            for (i, item) in list.iter().enumerate() {
                let item_at = format!("{}[{i}]", join(at, "replaces"));
                let Some(m) = r.map(item, &item_at, &["name"]) else {
                    continue;
                };
                match r.text(m, &item_at, "name") {
                    Some(n) if !n.is_empty() => names.push(n),
                    _ => r.problem(
                        join(&item_at, "name"),
                        "required: the name of the rule replaced",
                    ),
                }
            }
            names
        }
        Some(_) => {
            r.problem(join(at, "replaces"), "expected a list of `- name: <rule>`");
            Vec::new()
        }
    }
}

/// The `algorithm:` and `burst:` of the rate limit at `at`, whose limit is `limit`;
/// `None` (with a problem) when either is wrong.
fn rate_limit_algorithm(
    r: &mut Reader<'_>,
    map: &serde_json::Map<String, Value>,
    at: &str,
    limit: u32,
) -> Option<Algorithm> {
    let algorithm = match map.get("algorithm") {
        None => Algorithm::Fixed,
        Some(Value::String(a)) => match a.as_str() {
            "fixed" => Algorithm::Fixed,
            "sliding" => Algorithm::Sliding,
            "gcra" => Algorithm::Gcra { burst: None },
            other => {
                r.problem(
                    join(at, "algorithm"),
                    format!("expected fixed, sliding or gcra, got {other:?}"),
                );
                return None;
            }
        },
        Some(_) => {
            r.problem(join(at, "algorithm"), "expected fixed, sliding or gcra");
            return None;
        }
    };
    let algorithm = match (algorithm, map.get("burst")) {
        (a, None) => a,
        (Algorithm::Gcra { .. }, Some(b)) => match b
            .as_u64()
            .and_then(|b| u32::try_from(b).ok())
            .and_then(NonZeroU32::new)
        {
            Some(burst) if burst.get() <= limit.max(1) => Algorithm::Gcra { burst: Some(burst) },
            _ => {
                r.problem(
                    join(at, "burst"),
                    format!("expected 1 to requests_per_unit ({limit})"),
                );
                return None;
            }
        },
        (_, Some(_)) => {
            r.problem(join(at, "burst"), "`burst` is for `algorithm: gcra`");
            return None;
        }
    };
    Some(algorithm)
}

/// The `consistency:`, `lease:` and `lease_ms:` of the rate limit at `at`, which
/// counts `limit` per `unit` by `algorithm`; `None` (with a problem) when they
/// are wrong. A month stays exact (SPEC D4: monthly counts are never leased).
fn rate_limit_consistency(
    r: &mut Reader<'_>,
    map: &serde_json::Map<String, Value>,
    at: &str,
    (unit, algorithm, limit): (Unit, Algorithm, u32),
) -> Option<crate::model::Consistency> {
    let whole = |key: &str, r: &mut Reader<'_>| match map.get(key) {
        None => Some(None),
        Some(v) => match v.as_u64().and_then(|n| u32::try_from(n).ok()) {
            Some(n) => Some(Some(n)),
            None => {
                r.problem(
                    join(at, key),
                    "expected a whole number from 0 to 4294967295",
                );
                None
            }
        },
    };
    let lease = whole("lease", r)?;
    let lease_ms = whole("lease_ms", r)?;
    let consistency = match map.get("consistency") {
        None => None,
        Some(Value::String(c)) => Some(c.as_str()),
        Some(_) => {
            r.problem(join(at, "consistency"), "expected exact or leased");
            return None;
        }
    };
    if consistency == Some("leased") && map.get("unlimited") == Some(&Value::Bool(true)) {
        r.problem(
            join(at, "consistency"),
            "an unlimited rule counts nothing, so there is nothing to lease: remove it or write `exact`",
        );
        return None;
    }
    if consistency == Some("leased") && unit == Unit::Month {
        r.problem(
            join(at, "consistency"),
            "a month is counted as a monthly quota, which stays exact (SPEC D4): remove it or write `exact`",
        );
        return None;
    }
    let spec = crate::model::LeaseSpec {
        consistency,
        lease,
        lease_ms,
    };
    match spec.check(algorithm, unit.seconds(), &[(String::new(), limit)]) {
        Ok(c) => Some(c),
        Err(problems) => {
            for (key, message) in problems {
                r.problem(join(at, key), message);
            }
            None
        }
    }
}

/// False (with a problem) when `algorithm` cannot count windows of `unit`: a month
/// is `fixed` only, and a sliding window has a longest length.
fn unit_takes_algorithm(r: &mut Reader<'_>, at: &str, unit: Unit, algorithm: Algorithm) -> bool {
    if unit == Unit::Month && algorithm != Algorithm::Fixed {
        r.problem(
            join(at, "algorithm"),
            "a month is a calendar month, counted as a monthly quota: `fixed` only",
        );
        return false;
    }
    if algorithm == Algorithm::Sliding && unit.seconds() > crate::model::MAX_SLIDING_WINDOW_SECONDS
    {
        r.problem(
            join(at, "algorithm"),
            format!(
                "a sliding window is at most {} seconds; a {} is longer",
                crate::model::MAX_SLIDING_WINDOW_SECONDS,
                unit.name()
            ),
        );
        return false;
    }
    true
}
