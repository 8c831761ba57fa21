//! The classes, the ceilings and the profiles: their names, their limits
//! per profile and what `modes:`, `algorithms:` and `store.outage` say of them.

use std::num::NonZeroU32;

use crate::model::{
    Algorithm, Ceiling, Class, ClassSet, Consistency, CostClass, Enforcement, MAX_CEILINGS,
    MAX_CLASSES, Outage, Profile,
};
use crate::raw::{RawAlgorithm, RawPolicy, RawProfile};

use super::{Checker, MAX_CLASS_NAME, is_budget_name};

impl Checker {
    /// The class named `name` (at `path`), or a problem naming the classes there are.
    pub(super) fn class(&mut self, path: &str, name: &str) -> Option<Class> {
        let c = self
            .classes
            .iter()
            .position(|c| c == name)
            .and_then(Class::from_index);
        if c.is_none() {
            let known = self.classes.join(", ");
            self.problem(
                path,
                format!("unknown class {name:?}; the profiles name {known}"),
            );
        }
        c
    }

    /// The classes: those the profiles name, in the order they name them, which
    /// must be the same in every profile (a class's place is its rank).
    pub(super) fn class_names(&mut self, raw: &RawPolicy) {
        let Some((first, p)) = raw.profiles.iter().next() else {
            return;
        };
        let names: Vec<String> = p.classes.0.iter().map(|(n, _)| n.clone()).collect();
        for (name, other) in raw.profiles.iter().skip(1) {
            let theirs: Vec<&String> = other.classes.0.iter().map(|(n, _)| n).collect();
            if theirs != names.iter().collect::<Vec<_>>() {
                self.problem(
                    format!("profiles.{name}.classes"),
                    format!(
                        "names {} where profile {first} names {}: every profile names the same classes in the same order (cheapest first)",
                        theirs.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", "),
                        names.join(", ")
                    ),
                );
            }
        }
        if names.is_empty() || names.len() > MAX_CLASSES {
            self.problem(
                format!("profiles.{first}.classes"),
                format!(
                    "a policy has 1 to {MAX_CLASSES} classes, this one {}",
                    names.len()
                ),
            );
        }
        for name in &names {
            if !is_budget_name(name) {
                self.problem(
                    format!("profiles.{first}.classes.{name}"),
                    format!(
                        "a class name is 1 to {MAX_CLASS_NAME} letters, digits, `_`, `-` or `.`"
                    ),
                );
            }
        }
        self.classes = names.into_iter().take(MAX_CLASSES).collect();
    }

    /// The ceilings' names (`ceilings:`), each unlike every class's.
    pub(super) fn ceiling_names(&mut self, raw: &RawPolicy) {
        if raw.ceilings.len() > MAX_CEILINGS {
            self.problem("ceilings", format!("at most {MAX_CEILINGS} ceilings"));
        }
        for name in raw.ceilings.keys() {
            if !is_budget_name(name) {
                self.problem(
                    format!("ceilings.{name}"),
                    format!(
                        "a ceiling name is 1 to {MAX_CLASS_NAME} letters, digits, `_`, `-` or `.`"
                    ),
                );
            } else if self.classes.contains(name) {
                self.problem(
                    format!("ceilings.{name}"),
                    "a class has this name: headers, metrics and `modes:` name both, so they differ",
                );
            }
        }
        self.ceilings = raw.ceilings.keys().take(MAX_CEILINGS).cloned().collect();
    }

    /// One profile at `at`: a limit for every class and every ceiling.
    pub(super) fn profile(&mut self, at: &str, p: &RawProfile) -> Option<Profile> {
        let classes: Vec<Option<NonZeroU32>> = p
            .classes
            .0
            .iter()
            .take(MAX_CLASSES)
            .map(|(name, limit)| self.nonzero(&format!("{at}.classes.{name}"), *limit))
            .collect();
        let ceilings: Vec<Option<NonZeroU32>> = self
            .ceilings
            .clone()
            .iter()
            .map(|name| match p.ip_ceilings.get(name) {
                Some(&limit) => self.nonzero(&format!("{at}.ip_ceilings.{name}"), limit),
                None => {
                    self.problem(
                        format!("{at}.ip_ceilings.{name}"),
                        format!("required: the limit per IP and window of ceiling {name}"),
                    );
                    None
                }
            })
            .collect();
        for name in p.ip_ceilings.keys() {
            if !self.ceilings.contains(name) {
                let declared = if self.ceilings.is_empty() {
                    "none".to_owned()
                } else {
                    self.ceilings.join(", ")
                };
                self.problem(
                    format!("{at}.ip_ceilings.{name}"),
                    format!("no ceiling {name:?} under `ceilings:` (declared: {declared}); a ceiling says there which classes it is over"),
                );
            }
        }
        Some(Profile {
            classes: classes.into_iter().collect::<Option<Vec<_>>>()?,
            ceilings: ceilings.into_iter().collect::<Option<Vec<_>>>()?,
        })
    }

    /// `profiles:` and `profile:`: every profile checked, and the one in force
    /// (`production` unless `profile:` names another) with its name.
    pub(super) fn profiles(
        &mut self,
        raw: &RawPolicy,
    ) -> (String, Vec<(String, Profile)>, Option<Profile>) {
        self.class_names(raw);
        self.ceiling_names(raw);
        let profiles: Vec<(String, Profile)> = raw
            .profiles
            .iter()
            .filter_map(|(name, p)| {
                self.profile(&format!("profiles.{name}"), p)
                    .map(|p| (name.clone(), p))
            })
            .collect();
        if raw.profiles.is_empty() {
            self.problem(
                "profiles",
                "at least one profile (e.g. `production`) is required",
            );
        }
        let profile_name = raw
            .profile
            .clone()
            .unwrap_or_else(|| "production".to_owned());
        let profile = profiles
            .iter()
            .find(|(n, _)| *n == profile_name)
            .map(|(_, p)| p.clone());
        if !raw.profiles.is_empty() && !raw.profiles.contains_key(&profile_name) {
            self.problem(
                "profile",
                format!(
                    "names no profile: {profile_name:?}; defined are {}",
                    raw.profiles.keys().cloned().collect::<Vec<_>>().join(", ")
                ),
            );
        }
        (profile_name, profiles, profile)
    }

    /// The classes and the ceilings with what they take from `modes:`,
    /// `algorithms:` and `store.outage` (all by name).
    pub(super) fn budgets_without_objects(
        &mut self,
        raw: &RawPolicy,
    ) -> (Vec<CostClass>, Vec<Ceiling>) {
        let mut classes: Vec<CostClass> = self
            .classes
            .iter()
            .map(|name| CostClass {
                name: name.clone(),
                mode: Enforcement::Enforce,
                algorithm: Algorithm::Fixed,
                consistency: Consistency::Exact,
                outage: Outage::FailOpen,
            })
            .collect();
        let mut ceilings = Vec::new();
        for (name, c) in &raw.ceilings {
            if !self.ceilings.contains(name) {
                continue;
            }
            let mut over = ClassSet::EMPTY;
            for (i, class) in c.classes.iter().enumerate() {
                if let Some(class) = self.class(&format!("ceilings.{name}.classes[{i}]"), class) {
                    over = over.with(class);
                }
            }
            if c.classes.is_empty() {
                self.problem(
                    format!("ceilings.{name}.classes"),
                    "name the classes the ceiling is over (at least one)",
                );
            }
            ceilings.push(Ceiling {
                name: name.clone(),
                over,
                only: c.only,
                mode: Enforcement::Enforce,
                algorithm: Algorithm::Fixed,
                consistency: Consistency::Exact,
            });
        }
        let expected = |v: &Self| {
            let mut names: Vec<&str> = v.classes.iter().map(String::as_str).collect();
            names.extend(v.ceilings.iter().map(String::as_str));
            names.join(", ")
        };
        for (name, mode) in &raw.modes {
            let at = format!("modes.{name}");
            let Some(mode) = self.mode(&at, Some(mode)) else {
                continue;
            };
            if let Some(c) = classes.iter_mut().find(|c| c.name == *name) {
                c.mode = mode;
            } else if let Some(c) = ceilings.iter_mut().find(|c| c.name == *name) {
                c.mode = mode;
            } else {
                let names = expected(self);
                self.problem(
                    at,
                    format!("expected a class or a ceiling ({names}); buckets, quotas and routes take `mode:` themselves"),
                );
            }
        }
        let window = raw.window_seconds.unwrap_or(60);
        for (name, a) in &raw.algorithms {
            let at = format!("algorithms.{name}");
            let is_class = self.classes.contains(name);
            if !is_class && !self.ceilings.contains(name) {
                let names = expected(self);
                self.problem(
                    at,
                    format!("expected a class or a ceiling ({names}); buckets take `algorithm:` themselves, and quotas none"),
                );
                continue;
            }
            // A burst must fit the budget's limit in every profile (`--profile`
            // may pick any of them).
            let limits: Vec<(String, u32)> = raw
                .profiles
                .iter()
                .filter_map(|(profile, p)| {
                    let limit = if is_class {
                        p.classes.get(name)
                    } else {
                        p.ip_ceilings.get(name).copied()
                    }?;
                    (limit > 0).then(|| (format!(" of profile {profile}"), limit))
                })
                .collect();
            let Some(algorithm) =
                self.algorithm(&at, (a.algorithm.as_deref(), a.burst), window, &limits)
            else {
                continue;
            };
            // A lease must fit the budget's limit in every profile and plan.
            let mut lease_limits = limits;
            for (plan, p) in &raw.plans {
                let limit = if is_class {
                    p.classes.get(name)
                } else {
                    p.ip_ceilings.get(name)
                };
                if let Some(&limit) = limit {
                    lease_limits.push((format!(" of plan {plan}"), limit));
                }
            }
            let Some(consistency) = self.consistency(&at, a, algorithm, window, &lease_limits)
            else {
                continue;
            };
            if let Some(c) = classes.iter_mut().find(|c| c.name == *name) {
                c.algorithm = algorithm;
                c.consistency = consistency;
            } else if let Some(c) = ceilings.iter_mut().find(|c| c.name == *name) {
                c.algorithm = algorithm;
                c.consistency = consistency;
            }
        }
        for (name, choice) in &raw.store.outage {
            let at = format!("store.outage.{name}");
            let Some(class) = self.class(&at, name) else {
                continue;
            };
            let outage = match choice.as_str() {
                "fail_open" => Outage::FailOpen,
                "fail_closed" => Outage::FailClosed,
                other => {
                    self.problem(
                        at,
                        format!("expected fail_open or fail_closed, got {other:?}"),
                    );
                    continue;
                }
            };
            if let Some(c) = classes.get_mut(class.index()) {
                c.outage = outage;
            }
        }
        (classes, ceilings)
    }

    /// `consistency:`, `lease:` and `lease_ms:` of the budget at `at` (SPEC D4),
    /// counted by `algorithm` in windows of `window` seconds, whose limits are
    /// `limits` (each with where it is set).
    fn consistency(
        &mut self,
        at: &str,
        a: &RawAlgorithm,
        algorithm: Algorithm,
        window: u32,
        limits: &[(String, u32)],
    ) -> Option<Consistency> {
        let terms = crate::model::LeaseSpec {
            consistency: a.consistency.as_deref(),
            lease: a.lease,
            lease_ms: a.lease_ms,
        };
        match terms.check(algorithm, window, limits) {
            Ok(c) => Some(c),
            Err(problems) => {
                for (key, message) in problems {
                    self.problem(format!("{at}.{key}"), message);
                }
                None
            }
        }
    }
}
