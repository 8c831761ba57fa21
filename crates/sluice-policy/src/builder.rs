//! A policy built in code: [`Policy::builder`] fills the same [`RawPolicy`] a
//! file is read into, and [`PolicyBuilder::build`] checks it exactly as a file
//! is checked, so a policy built either way means the same.

use http::Method;

use std::collections::BTreeMap;

use crate::raw::{
    RawBucket, RawCeiling, RawClassLimits, RawKey, RawProfile, RawQuota, RawRoute, RawTool,
};
use crate::{CredentialSource, Per, Policy, PolicyError, Problem, RawPolicy, validate};

/// The profile a built policy defines and uses.
const PROFILE: &str = "production";

/// Builds a [`Policy`] in code (see [`Policy::builder`]).
///
/// It starts from the built-in policy's classes and numbers per caller and
/// window of 60 s (protocol 600, read 300, standard 60, expensive 30; per client
/// IP, ceiling `ip` of 300 requests holding read, standard or expensive calls and
/// `ip_protocol` of 1,200 holding only protocol calls), credentials from
/// `X-API-Key`, a bearer token and the `session` cookie, and no route, bucket,
/// quota or lane: every request is then of the `standard` class. Classes and
/// ceilings are named by the strings a policy file has; [`PolicyBuilder::limit`]
/// of a new name adds a class (the costliest so far).
/// Each method changes one thing; [`PolicyBuilder::build`] reports every
/// problem at once, each named by the key a policy file would have.
///
/// ```
/// use http::Method;
/// use sluice_policy::{Per, Policy, RouteClass};
///
/// let policy = Policy::builder()
///     .window_seconds(60)
///     .limit("expensive", 10)
///     .route(Method::POST, "/chats", "expensive")
///     .route_any_method("/search/*", "read")
///     .bucket("register", 5, 60, Per::Ip)
///     .route(Method::POST, "/oauth/register", "standard")
///     .spends("register")
///     .jsonrpc_route("/mcp")
///     .tool("start_chat", "expensive")
///     .build()?;
/// let expensive = policy.class("expensive").unwrap();
/// assert_eq!(policy.profile.limit(expensive).get(), 10);
/// let chats = policy.route(&Method::POST, "/chats").unwrap();
/// assert_eq!(chats.class, RouteClass::Fixed(expensive));
/// // Checked as a file is: a route naming no bucket of the policy is refused.
/// let wrong = Policy::builder().route(Method::GET, "/", "read").spends("nope").build();
/// assert!(wrong.unwrap_err().to_string().contains("routes[0].buckets"));
/// # Ok::<(), sluice_policy::PolicyError>(())
/// ```
#[derive(Clone, Debug)]
#[must_use]
pub struct PolicyBuilder {
    raw: RawPolicy,
    /// Misuses of the builder itself, reported by `build` beside the policy's.
    misuses: Vec<Problem>,
}

impl Policy {
    /// A [`PolicyBuilder`] on the built-in policy's numbers, with no routes.
    pub fn builder() -> PolicyBuilder {
        PolicyBuilder::new()
    }
}

impl Default for PolicyBuilder {
    fn default() -> Self {
        PolicyBuilder::new()
    }
}

impl PolicyBuilder {
    /// The built-in policy's numbers, no routes (see [`PolicyBuilder`]).
    pub fn new() -> Self {
        let mut raw = RawPolicy {
            profile: Some(PROFILE.to_owned()),
            window_seconds: Some(60),
            default_class: Some("standard".to_owned()),
            ..RawPolicy::default()
        };
        let classes = [
            ("protocol", 600),
            ("read", 300),
            ("standard", 60),
            ("expensive", 30),
        ];
        raw.profiles.insert(
            PROFILE.to_owned(),
            RawProfile {
                classes: RawClassLimits(
                    classes.iter().map(|(n, l)| ((*n).to_owned(), *l)).collect(),
                ),
                ip_ceilings: BTreeMap::from([
                    ("ip".to_owned(), 300),
                    ("ip_protocol".to_owned(), 1_200),
                ]),
            },
        );
        let names = |list: &[&str]| list.iter().map(|n| (*n).to_owned()).collect();
        raw.ceilings = BTreeMap::from([
            (
                "ip".to_owned(),
                RawCeiling {
                    classes: names(&["read", "standard", "expensive"]),
                    only: false,
                },
            ),
            (
                "ip_protocol".to_owned(),
                RawCeiling {
                    classes: names(&["protocol"]),
                    only: true,
                },
            ),
        ]);
        PolicyBuilder {
            raw,
            misuses: Vec::new(),
        }
    }

    /// A builder over a raw policy (one read from a file, say), to change it
    /// in code before it is checked.
    pub fn from_raw(raw: RawPolicy) -> Self {
        PolicyBuilder {
            raw,
            misuses: Vec::new(),
        }
    }

    /// The raw policy built so far: what a policy file would hold (serialise
    /// it to write one).
    pub fn into_raw(self) -> RawPolicy {
        self.raw
    }

    fn profile(&mut self) -> &mut RawProfile {
        let name = self
            .raw
            .profile
            .clone()
            .unwrap_or_else(|| PROFILE.to_owned());
        self.raw.profiles.entry(name).or_default()
    }

    /// The window of the class budgets and the IP ceilings, in seconds
    /// (aligned to the Unix epoch, so every replica agrees where one starts).
    pub fn window_seconds(mut self, seconds: u32) -> Self {
        self.raw.window_seconds = Some(seconds);
        self
    }

    /// Each caller may spend `per_window` calls of `class` per window; a class
    /// the policy does not have yet is added, the costliest so far.
    pub fn limit(mut self, class: &str, per_window: u32) -> Self {
        self.profile().classes.set(class, per_window);
        self
    }

    /// A per-IP ceiling named `name`: at most `per_window` requests per client
    /// IP and window, whatever the credential, of those holding any call of
    /// `classes` (or, with `only`, only calls of them). The built-in two are
    /// replaced by naming them.
    pub fn ip_ceiling(mut self, name: &str, classes: &[&str], only: bool, per_window: u32) -> Self {
        self.raw.ceilings.insert(
            name.to_owned(),
            RawCeiling {
                classes: classes.iter().map(|c| (*c).to_owned()).collect(),
                only,
            },
        );
        self.profile()
            .ip_ceilings
            .insert(name.to_owned(), per_window);
        self
    }

    /// No ceiling per client IP (callers are still limited each on its own).
    pub fn without_ip_ceilings(mut self) -> Self {
        self.raw.ceilings.clear();
        for profile in self.raw.profiles.values_mut() {
            profile.ip_ceilings.clear();
        }
        self
    }

    /// Requests to `method` and `path` cost one `class` call. Routes are
    /// matched in the order they were added, first match wins; `path` is a
    /// pattern (`/chats/{id}`, a trailing `*` for the rest).
    pub fn route(self, method: Method, path: &str, class: &str) -> Self {
        self.push_route(Some(method.as_str().to_owned()), path, Some(class), false)
    }

    /// Requests to `path` with any method cost one `class` call.
    pub fn route_any_method(self, path: &str, class: &str) -> Self {
        self.push_route(None, path, Some(class), false)
    }

    /// `POST` requests to `path` are JSON-RPC (MCP): their body is read and
    /// each call in it counted in its own class (see [`PolicyBuilder::tool`]).
    pub fn jsonrpc_route(self, path: &str) -> Self {
        self.push_route(Some("POST".to_owned()), path, None, true)
    }

    fn push_route(
        mut self,
        method: Option<String>,
        path: &str,
        class: Option<&str>,
        jsonrpc: bool,
    ) -> Self {
        self.raw.routes.push(RawRoute {
            method,
            path: Some(path.to_owned()),
            class: class.map(str::to_owned),
            jsonrpc,
            ..RawRoute::default()
        });
        self
    }

    /// The route added last also spends bucket `name` (see
    /// [`PolicyBuilder::bucket`]). Before any route, it is reported by
    /// [`PolicyBuilder::build`].
    pub fn spends(mut self, name: &str) -> Self {
        match self.raw.routes.last_mut() {
            Some(route) => route.buckets.push(name.to_owned()),
            None => self.misuse(
                "routes",
                format!("`spends({name:?})` needs a route before it"),
            ),
        }
        self
    }

    /// The route added last counts against monthly quota family `family`
    /// (see [`PolicyBuilder::quota`]).
    pub fn counts(mut self, family: &str) -> Self {
        match self.raw.routes.last_mut() {
            Some(route) => route.quota = Some(family.to_owned()),
            None => self.misuse(
                "routes",
                format!("`counts({family:?})` needs a route before it"),
            ),
        }
        self
    }

    fn misuse(&mut self, path: &str, message: String) {
        self.misuses.push(Problem {
            path: path.to_owned(),
            message,
        });
    }

    /// A bucket that routes may spend beside their class: `limit` per
    /// `window_seconds`, per `per`.
    pub fn bucket(mut self, name: &str, limit: u32, window_seconds: u32, per: Per) -> Self {
        let per = match per {
            Per::Ip => "ip",
            Per::Caller => "caller",
            Per::User => "user",
            Per::Workspace => "workspace",
        };
        let bucket = RawBucket {
            limit,
            window_seconds,
            per: per.to_owned(),
            ..RawBucket::default()
        };
        if self.raw.buckets.insert(name.to_owned(), bucket).is_some() {
            self.misuse(
                &format!("buckets.{name}"),
                "defined twice (a file could not hold both)".to_owned(),
            );
        }
        self
    }

    /// A monthly quota family per workspace: at most `monthly` calls a
    /// calendar month (UTC), or counted and never refused when `None`.
    pub fn quota(mut self, family: &str, monthly: Option<u32>) -> Self {
        if self
            .raw
            .quotas
            .insert(
                family.to_owned(),
                RawQuota {
                    monthly,
                    ..RawQuota::default()
                },
            )
            .is_some()
        {
            self.misuse(
                &format!("quotas.{family}"),
                "defined twice (a file could not hold both)".to_owned(),
            );
        }
        self
    }

    /// A JSON-RPC `tools/call` of tool `name` costs one `class` call.
    pub fn tool(mut self, name: &str, class: &str) -> Self {
        let tool = RawTool {
            class: class.to_owned(),
            ..RawTool::default()
        };
        if self
            .raw
            .jsonrpc
            .tools
            .insert(name.to_owned(), tool)
            .is_some()
        {
            self.misuse(
                &format!("jsonrpc.tools.{name}"),
                "defined twice (a file could not hold both)".to_owned(),
            );
        }
        self
    }

    /// The class of a request no route matches (`standard` unless told).
    pub fn default_class(mut self, class: &str) -> Self {
        self.raw.default_class = Some(class.to_owned());
        self
    }

    /// Where a caller's credential is read from, first found wins.
    pub fn credentials(mut self, sources: &[CredentialSource]) -> Self {
        let names = sources
            .iter()
            .map(|s| {
                match s {
                    CredentialSource::ApiKeyHeader => "x_api_key",
                    CredentialSource::Bearer => "bearer",
                    CredentialSource::SessionCookie => "session_cookie",
                }
                .to_owned()
            })
            .collect();
        self.raw.identity.credentials = Some(names);
        self
    }

    /// A proxy (an IP or a CIDR) whose `X-Forwarded-For` is believed.
    pub fn trusted_proxy(mut self, cidr: &str) -> Self {
        self.raw.identity.trusted_proxies.push(cidr.to_owned());
        self
    }

    /// A known credential: the lower-case hex SHA-256 of the secret (never
    /// the secret), and the workspace and user it belongs to.
    pub fn key(mut self, sha256: &str, workspace: &str, user: &str) -> Self {
        self.raw.identity.keys.push(RawKey {
            sha256: sha256.to_owned(),
            workspace: workspace.to_owned(),
            user: user.to_owned(),
            plan: None,
        });
        self
    }

    /// Checks the policy as a file is checked and builds it.
    ///
    /// # Errors
    /// [`PolicyError::Built`] with every problem found, each named by the key
    /// a policy file would have (`routes[2].buckets`, …).
    pub fn build(self) -> Result<Policy, PolicyError> {
        let mut problems = self.misuses;
        match validate(&self.raw) {
            Ok(policy) if problems.is_empty() => Ok(policy),
            Ok(_) => Err(PolicyError::Built { problems }),
            Err(more) => {
                problems.extend(more);
                Err(PolicyError::Built { problems })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(feature = "yaml")]
    #[test]
    fn a_policy_built_in_code_is_the_one_its_file_would_be() {
        let yaml = r#"
profile: production
window_seconds: 30
profiles:
  production:
    classes: { protocol: 600, read: 300, standard: 60, expensive: 5 }
    ip_ceilings: { ip: 100, ip_protocol: 1200 }
ceilings:
  ip: { classes: [read, standard, expensive] }
  ip_protocol: { classes: [protocol], only: true }
identity:
  credentials: [bearer]
  trusted_proxies: [10.0.0.0/8]
  keys:
    - { sha256: 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08, workspace: acme, user: ada }
buckets:
  register: { limit: 5, window_seconds: 60, per: ip }
quotas:
  messages: { monthly: 1000 }
routes:
  - { method: POST, path: /oauth/register, class: standard, buckets: [register] }
  - { method: POST, path: /messages, class: expensive, quota: messages }
  - { path: "/search/*", class: read }
  - { method: POST, path: /mcp, jsonrpc: true }
jsonrpc:
  tools:
    start_chat: { class: expensive }
default_class: read
"#;
        let from_file: RawPolicy = serde_saphyr::from_str(yaml).expect("the file reads");
        let built = Policy::builder()
            .window_seconds(30)
            .limit("expensive", 5)
            .ip_ceiling("ip", &["read", "standard", "expensive"], false, 100)
            .credentials(&[CredentialSource::Bearer])
            .trusted_proxy("10.0.0.0/8")
            .key(
                "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
                "acme",
                "ada",
            )
            .bucket("register", 5, 60, Per::Ip)
            .quota("messages", Some(1_000))
            .route(Method::POST, "/oauth/register", "standard")
            .spends("register")
            .route(Method::POST, "/messages", "expensive")
            .counts("messages")
            .route_any_method("/search/*", "read")
            .jsonrpc_route("/mcp")
            .tool("start_chat", "expensive")
            .default_class("read");
        assert_eq!(built.clone().into_raw(), from_file);
        let (built, from_file) = (
            built.build().expect("valid"),
            validate(&from_file).expect("valid"),
        );
        assert_eq!(built.describe(), from_file.describe());
    }

    #[test]
    fn every_problem_is_reported_at_once_by_the_key_a_file_would_have() {
        let err = Policy::builder()
            .bucket("twice", 1, 60, Per::Ip)
            .bucket("twice", 2, 60, Per::Ip)
            .tool("t", "read")
            .tool("t", "expensive")
            .spends("early")
            .limit("read", 0)
            .route(Method::GET, "/x", "read")
            .counts("nowhere")
            .build()
            .expect_err("five problems");
        let paths: Vec<&str> = err.problems().iter().map(|p| p.path.as_str()).collect();
        assert!(paths.contains(&"routes"), "{err}");
        assert!(paths.contains(&"profiles.production.classes.read"), "{err}");
        assert!(
            paths.iter().any(|p| p.starts_with("routes[0].quota")),
            "{err}"
        );
        assert!(paths.contains(&"buckets.twice"), "{err}");
        assert!(paths.contains(&"jsonrpc.tools.t"), "{err}");
        assert!(err.to_string().starts_with("the policy built in code: "));
    }

    #[cfg(feature = "yaml")]
    #[test]
    fn a_builder_starts_from_the_built_in_policys_numbers() {
        let built = Policy::builder().build().expect("valid");
        let default = crate::default_policy().expect("the built-in policy");
        assert_eq!(built.profile, default.profile);
        assert_eq!(built.window, default.window);
    }

    #[test]
    fn without_routes_every_request_is_standard_at_the_built_in_numbers() {
        let policy = Policy::builder().build().expect("valid");
        let standard = policy
            .class("standard")
            .expect("a class of the built-in policy");
        assert_eq!(policy.profile.limit(standard).get(), 60);
        assert!(policy.route(&Method::GET, "/anything").is_none());
        assert_eq!(policy.default_class, standard);
    }
}
