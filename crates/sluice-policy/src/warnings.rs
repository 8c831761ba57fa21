//! What `sluice check` warns of: a policy that loads and runs, but that an operator
//! may not mean, or that is sound only if the proxy in front does its part.

use crate::model::{Algorithm, Policy};
use crate::path::PathCase;

impl Policy {
    /// Warnings about this policy, one sentence each (empty when there are none):
    /// - routes that differ only by the case of their path (with `paths.case:
    ///   insensitive`, the later one is never matched; with `sensitive`, an upstream
    ///   that routes in either case runs both as one);
    /// - `identity.principal_headers` or `identity.plan_header`: they are believed
    ///   from trusted proxies, so the proxy in front must clear them from every
    ///   client's request, or a client names its own workspace and plan.
    pub fn warnings(&self) -> Vec<String> {
        let mut out = Vec::new();
        for (i, a) in self.routes.iter().enumerate() {
            let Some(pa) = &a.path else { continue };
            for b in &self.routes[..i] {
                let Some(pb) = &b.path else { continue };
                if a.method == b.method && pa.as_str() != pb.as_str() && pa.folded() == pb.folded()
                {
                    let method = a.method.as_ref().map_or("*", |m| m.as_str());
                    let effect = match self.paths.case {
                        PathCase::Insensitive => "the later one is never matched",
                        PathCase::Sensitive => {
                            "an upstream that routes in either case runs both as one"
                        }
                    };
                    out.push(format!(
                        "routes {method} {pb} and {method} {pa} differ only by case: {effect} \
                         (paths.case)"
                    ));
                }
            }
        }
        let mut trusted: Vec<&str> = Vec::new();
        if let Some((workspace, user)) = &self.identity.principal_headers {
            trusted.extend([workspace.as_str(), user.as_str()]);
        }
        if let Some(plan) = &self.identity.plan_header {
            trusted.push(plan.as_str());
        }
        if !trusted.is_empty() {
            out.push(format!(
                "{} are believed from trusted proxies: the proxy in front (and the \
                 nginx, Traefik or Caddy that asks `--check`) must clear them from every \
                 client's request, or a client names its own workspace and plan \
                 (docs/forward-auth.md, \"Principal headers\")",
                trusted.join(", ")
            ));
        }
        out
    }
}

/// How a budget keeps its books (its algorithm, and a sliding window's length): a
/// change starts them afresh.
type Books = (&'static str, Option<u32>);

/// The [`Books`] of a budget counted by `algorithm` over `window` seconds.
fn books(algorithm: Algorithm, window: u32) -> Books {
    match algorithm {
        Algorithm::Fixed => ("fixed", None),
        Algorithm::Sliding => ("sliding", Some(window)),
        Algorithm::Gcra { .. } => ("gcra", None),
    }
}

impl Policy {
    /// The budgets whose books `next` keeps another way than `self` (another
    /// algorithm, or a sliding window of another length), one sentence each: a reload
    /// to `next` starts them afresh for every caller, so within the window of the
    /// change a caller may spend up to one more whole limit of each (a budget switched
    /// through all three algorithms in one window admits up to three times its limit
    /// in it; switching back finds the earlier books as they were). `sluice serve`
    /// logs them as warnings when it applies a reload.
    pub fn counting_changes(&self, next: &Policy) -> Vec<String> {
        let mut out = Vec::new();
        for (kind, name, new) in next.every_books() {
            let Some((_, _, old)) = self.every_books().find(|&(k, n, _)| k == kind && n == name)
            else {
                continue;
            };
            if old != new {
                out.push(format!(
                    "{kind} {name} now counts {} (was {}): its count starts afresh for \
                     every caller, who may spend up to one more whole limit in this window",
                    describe_books(new),
                    describe_books(old)
                ));
            }
        }
        out
    }

    /// Every budget whose books a reload may change: (kind, name, books).
    fn every_books(&self) -> impl Iterator<Item = (&'static str, &str, Books)> {
        let window = self.window.get();
        let classes = self
            .classes
            .iter()
            .map(move |c| ("class", c.name.as_str(), books(c.algorithm, window)));
        let ceilings = self
            .ceilings
            .iter()
            .map(move |c| ("ceiling", c.name.as_str(), books(c.algorithm, window)));
        let buckets = self.buckets.iter().map(|b| {
            (
                "bucket",
                b.name.as_str(),
                books(b.algorithm, b.window.get()),
            )
        });
        classes.chain(ceilings).chain(buckets)
    }
}

fn describe_books((algorithm, window): Books) -> String {
    match window {
        Some(seconds) => format!("{algorithm} over {seconds} s"),
        None => algorithm.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use crate::parse_str;

    fn warnings(yaml: &str) -> Vec<String> {
        parse_str(yaml, std::path::Path::new("p.yaml"))
            .expect("the policy loads")
            .warnings()
    }

    const ROUTES: &str = "profile: p
profiles:
  p:
    classes: { search: 100, generate: 3 }
default_class: search
routes:
  - { method: POST, path: /generate, class: generate }
  - { method: POST, path: /Generate, class: search }
  - { method: GET, path: /Generate, class: search }
";

    #[test]
    fn e6_routes_that_differ_only_by_case_are_named() {
        let found = warnings(ROUTES);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(
            found[0].contains("POST /generate and POST /Generate differ only by case")
                && found[0].contains("never matched"),
            "{found:?}"
        );
        let sensitive = warnings(&format!("{ROUTES}paths: {{ case: sensitive }}\n"));
        assert!(sensitive[0].contains("runs both as one"), "{sensitive:?}");
    }

    #[test]
    fn e4_principal_headers_are_named_for_the_proxy_to_clear() {
        let found = warnings(
            "profile: p
profiles:
  p:
    classes: { search: 100 }
default_class: search
identity:
  trusted_proxies: [203.0.113.0/24]
  principal_headers: { workspace: x-workspace, user: x-user, plan: x-plan }
",
        );
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(
            found[0].starts_with("x-workspace, x-user, x-plan are believed from trusted proxies")
                && found[0].contains("must clear them"),
            "{found:?}"
        );
    }

    #[test]
    fn p2_a_reload_that_changes_how_a_budget_counts_is_named() {
        let fixed = crate::default_policy().expect("the default policy");
        assert_eq!(fixed.counting_changes(&fixed), Vec::<String>::new());
        let yaml = crate::DEFAULT_POLICY_YAML.replacen(
            "window_seconds: 60\n",
            "window_seconds: 60\nalgorithms: { expensive: { algorithm: gcra, burst: 5 } }\n",
            1,
        );
        assert_ne!(yaml, crate::DEFAULT_POLICY_YAML, "the edit applies");
        let gcra = parse_str(&yaml, std::path::Path::new("gcra.yaml")).expect("loads");
        let changes = fixed.counting_changes(&gcra);
        assert_eq!(changes.len(), 1, "{changes:?}");
        assert!(
            changes[0].starts_with("class expensive now counts gcra (was fixed)")
                && changes[0].contains("one more whole limit"),
            "{changes:?}"
        );
        assert_eq!(gcra.counting_changes(&fixed).len(), 1);
    }

    #[test]
    fn the_default_policy_warns_of_nothing() {
        let policy = crate::default_policy().expect("the default policy");
        assert_eq!(policy.warnings(), Vec::<String>::new());
    }
}
