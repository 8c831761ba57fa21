//! The resolved policy as text, for `sluice check`.

use std::fmt::Write as _;

use crate::model::{
    Algorithm, CredentialSource, OnExhausted, Outage, Per, Policy, Refusal, RouteClass, Spends,
};

impl Policy {
    /// The resolved policy, one fact a line: what `sluice check` prints.
    pub fn describe(&self) -> String {
        let mut out = String::new();
        self.describe_limits(&mut out);
        for line in self.describe_plans() {
            let _ = writeln!(out, "{line}");
        }
        self.describe_callers(&mut out);
        self.describe_buckets(&mut out);
        self.describe_quotas(&mut out);
        self.describe_turns(&mut out);
        self.describe_alerts(&mut out);
        self.describe_lanes(&mut out);
        self.describe_routes(&mut out);
        self.describe_jsonrpc(&mut out);
        self.describe_settings(&mut out);
        out
    }

    /// The webhooks of `alerts:` (SPEC O3), one line each.
    fn describe_alerts(&self, out: &mut String) {
        for a in &self.alerts {
            let at: Vec<String> = a
                .at_permille
                .iter()
                .map(|p| format!("{}%", f64::from(*p) / 10.0))
                .collect();
            let _ = writeln!(
                out,
                "alert: POST {} when {} passes {} of its limit, once per workspace (the budget's subject), budget, threshold and period; signed with HMAC-SHA256 of the body (X-Sluice-Signature: sha256=<hex>) by the secret in {}; each delivery within {} ms, retried after {} ms, doubling, at most {} ms apart, until a 2xx (a redirect is a failure)",
                a.url,
                a.budgets.join(", "),
                at.join(", "),
                a.secret_file.display(),
                a.timeout.as_millis(),
                a.retry.as_millis(),
                a.max_retry.as_millis(),
            );
        }
    }

    /// The active profile, the window, each class's and ceiling's limit, and the
    /// budgets not counted in fixed windows.
    fn describe_limits(&self, out: &mut String) {
        let names: Vec<&str> = self.profiles.iter().map(|(n, _)| n.as_str()).collect();
        let _ = writeln!(
            out,
            "profile: {} (defined: {})",
            self.profile_name,
            names.join(", ")
        );
        let _ = writeln!(out, "window: {} s, aligned to the Unix epoch", self.window);
        let classes: Vec<String> = self
            .class_ids()
            .map(|c| format!("{} {}", self.class_name(c), self.profile.limit(c)))
            .collect();
        let _ = writeln!(out, "per caller and class: {}", classes.join(", "));
        let ceilings: Vec<String> = self
            .ceilings
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let over: Vec<&str> = c.over.iter().map(|k| self.class_name(k)).collect();
                let holding = if c.only { "only" } else { "any of" };
                format!(
                    "{} {} (requests holding {holding} {})",
                    c.name,
                    self.profile.ceiling(i),
                    over.join(", ")
                )
            })
            .collect();
        let _ = writeln!(
            out,
            "per IP: {}",
            if ceilings.is_empty() {
                "no ceiling".to_owned()
            } else {
                ceilings.join("; ")
            }
        );
        let counted: Vec<String> = self
            .classes
            .iter()
            .map(|c| (c.name.as_str(), c.algorithm))
            .chain(self.ceilings.iter().map(|c| (c.name.as_str(), c.algorithm)))
            .filter(|(_, algorithm)| *algorithm != Algorithm::Fixed)
            .map(|(name, algorithm)| format!("{name} {algorithm}"))
            .collect();
        if !counted.is_empty() {
            let _ = writeln!(
                out,
                "not in fixed windows: {} (the rest fixed)",
                counted.join("; ")
            );
        }
        for line in self.describe_leases() {
            let _ = writeln!(out, "{line}");
        }
    }

    /// One line per leased budget (SPEC D4): its lease and its bound per window for
    /// the policy's `store.replicas`, `limit + replicas × lease` (for the active
    /// profile's limit), classes and ceilings first, then buckets, then the
    /// rate-limit service's rules (by domain and rule).
    pub fn describe_leases(&self) -> Vec<String> {
        let replicas = self.store.replicas.get();
        let classes = self.class_ids().filter_map(|c| {
            let class = self.classes.get(c.index())?;
            let terms = class.consistency.lease()?;
            Some((class.name.as_str(), self.profile.limit(c).get(), terms))
        });
        let ceilings = self.ceilings.iter().enumerate().filter_map(|(i, c)| {
            let terms = c.consistency.lease()?;
            Some((c.name.as_str(), self.profile.ceiling(i).get(), terms))
        });
        let window = self.window;
        let budgets = classes
            .chain(ceilings)
            .map(|(name, limit, terms)| (name.to_owned(), limit, terms, window.get()));
        let buckets = self.buckets.iter().filter_map(|b| {
            let terms = b.consistency.lease()?;
            Some((b.name.clone(), b.limit.get(), terms, b.window.get()))
        });
        // The rate-limit service's rules, each by its domain and where it is.
        let rules = self.domains.iter().flat_map(|d| {
            d.rules.iter().filter_map(move |r| {
                let terms = r.consistency.lease()?;
                Some((
                    format!("{} {}", d.name, r.id),
                    r.limit,
                    terms,
                    r.unit.seconds(),
                ))
            })
        });
        budgets
            .chain(buckets)
            .chain(rules)
            .map(|(name, limit, terms, window)| {
                format!(
                    "leased: {name}: leases of at most {} units for at most {} ms; with {replicas} replica(s) at most {limit} + {replicas} x {} = {} admitted per {window} s window (exact: {limit})",
                    terms.units,
                    terms.millis,
                    terms.units,
                    terms.bound(limit, replicas),
                )
            })
            .collect()
    }

    /// Where callers' credentials are read, the key count and the trusted proxies.
    fn describe_callers(&self, out: &mut String) {
        let sources: Vec<&str> = self
            .identity
            .credentials
            .iter()
            .map(|s| match s {
                CredentialSource::ApiKeyHeader => "X-API-Key",
                CredentialSource::Bearer => "Authorization: Bearer",
                CredentialSource::SessionCookie => "session cookie",
            })
            .collect();
        let proxies: Vec<String> = self
            .identity
            .trusted_proxies
            .iter()
            .map(ToString::to_string)
            .collect();
        let _ = writeln!(
            out,
            "callers: {} (cookie {:?}), else the client IP (IPv6 by /{}); {} known key(s); trusted proxies: {}",
            sources.join(", "),
            self.identity.session_cookie,
            self.identity.ipv6_prefix,
            self.identity.keys.len(),
            if proxies.is_empty() {
                "none".to_owned()
            } else {
                proxies.join(", ")
            }
        );
    }

    /// Each bucket: its limit, window, algorithm, owner and what exhausting it does.
    fn describe_buckets(&self, out: &mut String) {
        let _ = writeln!(out, "buckets:");
        if self.buckets.is_empty() {
            let _ = writeln!(out, "  (none)");
        }
        for b in &self.buckets {
            let per = match b.per {
                Per::Ip => "IP",
                Per::Caller => "caller",
                Per::User => "user",
                Per::Workspace => "workspace",
            };
            let refusal = match &b.refusal {
                Refusal::Edge => "edge 429".to_owned(),
                Refusal::Envelope { message } => format!("JSON envelope {message:?}"),
            };
            let weighted = if b.weighted {
                " (weighted: the upstream's X-Sluice-Cost says what a call spent)"
            } else {
                ""
            };
            let exhausted = match b.on_exhausted {
                OnExhausted::Refuse => format!("refused with {refusal}"),
                OnExhausted::Pass => "passed on to the upstream with X-Sluice-Exhausted".to_owned(),
            };
            let algorithm = match b.algorithm {
                Algorithm::Fixed => String::new(),
                other => format!(" ({other})"),
            };
            if let Some(t) = b.tokens.filter(|t| t.priced) {
                // A money budget: the model's price of the tokens.
                let usd = f64::from(b.limit.get()) / crate::MONEY_UNITS_PER_USD as f64;
                let _ = writeln!(
                    out,
                    "  {}: {usd:.2} USD per calendar month (UTC) per {per} at the model's price ({} output tokens reserved when a call names none), reserved from the call's body and settled at the upstream's usage",
                    b.name, t.default_max_output
                );
                continue;
            }
            if let Some(t) = &b.tokens {
                // A token budget: reserved from the body, settled at the usage.
                let period = if t.monthly {
                    "per calendar month (UTC)".to_owned()
                } else {
                    format!("per {} s", b.window)
                };
                let weight = |milli: u32| format!("{}", f64::from(milli) / 1000.0);
                let _ = writeln!(
                    out,
                    "  {}: {} tokens {period} per {per} (weights: input {}, cached input {}, output {}; {} output tokens reserved when a call names none), reserved from the call's body and settled at the upstream's usage",
                    b.name,
                    b.limit,
                    weight(t.input_milli),
                    weight(t.cached_input_milli),
                    weight(t.output_milli),
                    t.default_max_output
                );
                continue;
            }
            let _ = writeln!(
                out,
                "  {}: {} per {} s{algorithm} per {per}{weighted}, {exhausted}",
                b.name, b.limit, b.window
            );
        }
    }

    /// Each monthly quota family: its cap, or uncapped.
    fn describe_quotas(&self, out: &mut String) {
        let _ = writeln!(out, "monthly quotas per workspace (calendar months, UTC):");
        if self.quotas.is_empty() {
            let _ = writeln!(out, "  (none)");
        }
        for q in &self.quotas {
            match q.monthly {
                Some(n) => {
                    let _ = writeln!(out, "  {}: {n} a month", q.name);
                }
                None => {
                    let _ = writeln!(out, "  {}: uncapped (counted)", q.name);
                }
            }
        }
    }

    /// The turn budgets of agent runs (SPEC T7).
    fn describe_turns(&self, out: &mut String) {
        let t = &self.turns;
        let _ = writeln!(
            out,
            "turns of agent runs (a call naming its run in X-Sluice-Run on an LLM route, or an MCP tool call):"
        );
        if !t.enabled {
            let _ = writeln!(out, "  (off: no LLM route and no `turns:`)");
            return;
        }
        let tiers: Vec<String> = t
            .tiers
            .iter()
            .enumerate()
            .map(|(i, (name, n))| {
                let default = if i == t.default_tier {
                    " (default)"
                } else {
                    ""
                };
                format!("{name} {n}{default}")
            })
            .collect();
        let _ = writeln!(out, "  tiers (X-Sluice-Depth): {}", tiers.join(", "));
        let _ = writeln!(
            out,
            "  a run is its caller's, forgotten {} s after its last turn or change; a grant is 1 to {} turns, with at most {} left; {} runs per caller per {} s{}",
            t.idle,
            t.max_grant,
            t.max_granted,
            t.runs_per_caller,
            t.idle,
            if t.mcp_session {
                "; an MCP session is a run"
            } else {
                ""
            }
        );
        let _ = writeln!(
            out,
            "  endpoints: GET {0}/<run>, POST {0}/<run>/continue {{\"turns\": N}}, POST {0}/<run>/finish",
            t.endpoints
        );
    }

    /// Each lane's limits, waits and breaker.
    fn describe_lanes(&self, out: &mut String) {
        for l in &self.lanes {
            let _ = writeln!(
                out,
                "lane {}: per workspace {} running, {} started per {} s; {} running in all ({} kept from batches); waits {} s (JSON-RPC {} s, at most {} in line); calls cut after {} s; breaker opens after {} failures within {} s, for {} s",
                l.name,
                l.workspace_in_flight,
                l.workspace_starts,
                l.starts_window.as_secs(),
                l.global_in_flight,
                l.batch_reserve,
                l.wait.as_secs(),
                l.jsonrpc_wait.as_secs(),
                l.max_waiting,
                l.timeout.as_secs(),
                l.breaker_failures,
                l.breaker_within.as_secs(),
                l.breaker_open.as_secs(),
            );
        }
    }

    /// The route table, first match first, then the class of anything else.
    fn describe_routes(&self, out: &mut String) {
        let _ = writeln!(out, "routes (first match wins):");
        for r in &self.routes {
            let method = r.method.as_ref().map_or("*", |m| m.as_str());
            let path = r.path.as_ref().map_or("*", |p| p.as_str());
            let class = match &r.class {
                RouteClass::Fixed(c) => self.class_name(*c).to_owned(),
                RouteClass::JsonRpc => "per JSON-RPC item".to_owned(),
            };
            let also = self.describe_spends(&Spends {
                buckets: r.buckets.clone(),
                quota: r.quota,
                lane: r.lane,
            });
            let _ = writeln!(out, "  {method:<7} {path:<36} {class}{also}");
        }
        let _ = writeln!(
            out,
            "  {:<7} {:<36} {}",
            "*",
            "(anything else)",
            self.class_name(self.default_class)
        );
    }

    /// The JSON-RPC rules: methods, tools, retired tools and the default class.
    fn describe_jsonrpc(&self, out: &mut String) {
        let mut methods: Vec<String> = self
            .jsonrpc
            .methods
            .iter()
            .map(|(m, c)| format!("{m}={}", self.class_name(*c)))
            .chain(
                self.jsonrpc
                    .method_prefixes
                    .iter()
                    .map(|(p, c)| format!("{p}*={}", self.class_name(*c))),
            )
            .collect();
        methods.sort();
        let mut tools: Vec<String> = self
            .jsonrpc
            .tools
            .iter()
            .map(|(t, tool)| {
                format!(
                    "{t}={}{}",
                    self.class_name(tool.class),
                    self.describe_spends(&tool.spends)
                )
            })
            .collect();
        tools.sort();
        let mut retired: Vec<String> = self
            .jsonrpc
            .retired
            .iter()
            .flat_map(|(name, actions)| {
                actions.iter().map(move |(a, t)| format!("{name}.{a}->{t}"))
            })
            .collect();
        retired.sort();
        let _ = writeln!(out, "jsonrpc methods: {}", methods.join(", "));
        let _ = writeln!(out, "jsonrpc tools: {}", tools.join(", "));
        let _ = writeln!(
            out,
            "jsonrpc retired tools: {}",
            if retired.is_empty() {
                "none".to_owned()
            } else {
                retired.join(", ")
            }
        );
        let _ = writeln!(
            out,
            "jsonrpc default: {}",
            self.class_name(self.jsonrpc.default_class)
        );
    }

    /// Headers, read bounds, path matching and the shared store.
    fn describe_settings(&self, out: &mut String) {
        let _ = writeln!(
            out,
            "headers: X-RateLimit-*{}",
            if self.ietf_headers {
                " + IETF draft RateLimit / RateLimit-Policy"
            } else {
                ""
            }
        );
        let _ = writeln!(
            out,
            "bounds: body {} bytes, JSON depth {}, batch {} items",
            self.bounds.max_body_bytes, self.bounds.max_json_depth, self.bounds.max_batch_items
        );
        let _ = writeln!(
            out,
            "paths: normalised (RFC 3986), repeated slashes {}, routes matched {}",
            if self.paths.merge_slashes {
                "merged"
            } else {
                "kept"
            },
            match self.paths.case {
                crate::PathCase::Insensitive => "in either case",
                crate::PathCase::Sensitive => "case-sensitively",
            }
        );
        let outage: Vec<String> = self
            .classes
            .iter()
            .map(|c| {
                let o = match c.outage {
                    Outage::FailOpen => "fail_open",
                    Outage::FailClosed => "fail_closed",
                };
                format!("{} {o}", c.name)
            })
            .collect();
        let _ = writeln!(
            out,
            "shared store: timeout {} ms, {} replica(s); while down: {}",
            self.store.timeout.as_millis(),
            self.store.replicas,
            outage.join(", ")
        );
    }

    /// One line per plan: what a workspace on it gets (its overrides applied to the
    /// active profile), then how many workspaces are on a plan.
    pub fn describe_plans(&self) -> Vec<String> {
        let mut lines = Vec::new();
        for plan in &self.plans {
            let limits = self.plan_limits(Some(plan));
            let show = |l: &crate::PlanLimit, unit: &str| {
                format!(
                    "{} {}{}{unit}",
                    l.name,
                    l.limit,
                    if l.from_plan { "*" } else { "" }
                )
            };
            let classes: Vec<String> = limits.classes.iter().map(|l| show(l, "")).collect();
            let ceilings: Vec<String> = limits.ceilings.iter().map(|l| show(l, "")).collect();
            let buckets: Vec<String> = limits
                .buckets
                .iter()
                .map(|(l, window)| {
                    let tokens = self
                        .buckets
                        .iter()
                        .find(|b| b.name == l.name)
                        .and_then(|b| b.tokens);
                    let monthly = tokens.is_some_and(|t| t.monthly);
                    if tokens.is_some_and(|t| t.priced) {
                        let usd = f64::from(l.limit) / crate::MONEY_UNITS_PER_USD as f64;
                        let star = if l.from_plan { "*" } else { "" };
                        format!("{} {usd:.2} USD{star}/month", l.name)
                    } else if monthly {
                        show(l, "/month")
                    } else {
                        show(l, &format!("/{window} s"))
                    }
                })
                .collect();
            let mut quotas: Vec<String> = limits.quotas.iter().map(|l| show(l, "/month")).collect();
            quotas.extend(
                self.quotas
                    .iter()
                    .filter(|q| !limits.quotas.iter().any(|l| l.name == q.name))
                    .map(|q| format!("{} uncapped", q.name)),
            );
            let lanes: Vec<String> = limits
                .lanes
                .iter()
                .map(|(running, starts)| {
                    format!(
                        "{} {}{} running, {}{} started",
                        running.name.split('.').next().unwrap_or(""),
                        running.limit,
                        if running.from_plan { "*" } else { "" },
                        starts.limit,
                        if starts.from_plan { "*" } else { "" },
                    )
                })
                .collect();
            let mut line = format!(
                "plan {}{}: per caller and class: {}",
                plan.name,
                if plan.mode == crate::Enforcement::Shadow {
                    " (shadow)"
                } else {
                    ""
                },
                classes.join(", ")
            );
            let turns: Vec<String> = plan
                .turns
                .iter()
                .zip(&self.turns.tiers)
                .filter_map(|(own, (name, _))| own.map(|n| format!("{name} {n}*")))
                .collect();
            for (what, list) in [
                ("per IP", ceilings),
                ("buckets", buckets),
                ("quotas", quotas),
                ("per workspace in lanes", lanes),
                ("turns of a run", turns),
            ] {
                if !list.is_empty() {
                    let _ = write!(line, "; {what}: {}", list.join(", "));
                }
            }
            line.push_str(" (* the plan's)");
            lines.push(line);
        }
        if !self.plans.is_empty() {
            lines.push(format!(
                "workspaces on a plan: {} (the others on {})",
                self.tenants.by_name.len(),
                self.default_plan
                    .and_then(|i| self.plans.get(i))
                    .map_or("the profile's limits", |_| "plan default")
            ));
        }
        lines
    }

    /// ` + bucket, … + quota family` for what a route or tool spends besides its class.
    fn describe_spends(&self, spends: &Spends) -> String {
        let mut also = String::new();
        for &i in &spends.buckets {
            if let Some(b) = self.buckets.get(i) {
                let _ = write!(also, " + {}", b.name);
            }
        }
        if let Some(q) = spends.quota.and_then(|q| self.quotas.get(q)) {
            let _ = write!(also, " + quota {}", q.name);
        }
        if let Some(l) = spends.lane.and_then(|l| self.lanes.get(l)) {
            let _ = write!(also, " in lane {}", l.name);
        }
        also
    }
}
