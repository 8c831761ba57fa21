//! `plans:` and the tenant table (`workspaces:` and the plans the keys name).

use std::collections::HashMap;

use crate::model::{
    Bucket, CostClass, CustomerPlan, Enforcement, Lane, MAX_PLANS, MAX_WORKSPACES, PlanLane,
    QuotaFamily, Tenants, Turns,
};
use crate::raw::RawPolicy;

use super::{Checker, MAX_CLASS_NAME, MAX_LANE_STARTS, is_budget_name, is_workspace_name};

impl Checker {
    /// `plans:`, each override checked to name a budget of the policy and to be a
    /// limit it can take.
    pub(crate) fn plans(
        &mut self,
        raw: &RawPolicy,
        (classes, buckets, quotas, lanes): (&[CostClass], &[Bucket], &[QuotaFamily], &[Lane]),
        turns: &Turns,
    ) -> Vec<CustomerPlan> {
        if raw.plans.len() > MAX_PLANS {
            self.problem("plans", format!("at most {MAX_PLANS} plans"));
        }
        let mut plans = Vec::new();
        for (name, p) in raw.plans.iter().take(MAX_PLANS) {
            let at = format!("plans.{name}");
            if !is_budget_name(name) {
                self.problem(
                    &at,
                    format!(
                        "a plan name is 1 to {MAX_CLASS_NAME} letters, digits, `_`, `-` or `.`"
                    ),
                );
            }
            let mut plan = CustomerPlan {
                name: name.clone(),
                classes: vec![None; classes.len()],
                ceilings: vec![None; self.ceilings.len()],
                buckets: vec![None; buckets.len()],
                quotas: vec![None; quotas.len()],
                lanes: vec![PlanLane::default(); lanes.len()],
                turns: vec![None; turns.tiers.len()],
                mode: Enforcement::Enforce,
            };
            let mut ok = true;
            for (tier, &n) in &p.turns {
                let path = format!("{at}.turns.{tier}");
                let Some(i) = turns.tier(tier) else {
                    self.problem(
                        &path,
                        format!("no tier {tier:?} under `turns.tiers` or built in"),
                    );
                    ok = false;
                    continue;
                };
                plan.turns[i] = self.turns_of(&path, n);
                ok &= plan.turns[i].is_some();
            }
            for (class, &limit) in &p.classes {
                let path = format!("{at}.classes.{class}");
                let (Some(c), Some(limit)) = (self.class(&path, class), self.nonzero(&path, limit))
                else {
                    ok = false;
                    continue;
                };
                if let Some(rule) = classes.get(c.index()) {
                    ok &= self.fits_burst(&path, rule.algorithm, limit);
                }
                plan.classes[c.index()] = Some(limit);
            }
            for (ceiling, &limit) in &p.ip_ceilings {
                let path = format!("{at}.ip_ceilings.{ceiling}");
                let Some(i) = self.ceilings.iter().position(|c| c == ceiling) else {
                    self.problem(&path, format!("no ceiling {ceiling:?} under `ceilings:`"));
                    ok = false;
                    continue;
                };
                plan.ceilings[i] = self.nonzero(&path, limit);
                ok &= plan.ceilings[i].is_some();
            }
            let named = p.buckets.iter().map(|b| ("buckets", b));
            for (table, (bucket, &limit)) in named.chain(p.tokens.iter().map(|t| ("tokens", t))) {
                let path = format!("{at}.{table}.{bucket}");
                // A token budget is a bucket that counts tokens: each table names
                // its own kind (a money budget's, in dollars, below).
                let kind = |b: &Bucket| match b.tokens {
                    None => "buckets",
                    Some(t) if t.priced => "spend",
                    Some(_) => "tokens",
                };
                let Some(i) = buckets
                    .iter()
                    .position(|b| b.name == *bucket && kind(b) == table)
                else {
                    let kind = if table == "tokens" {
                        "token budget"
                    } else {
                        "bucket"
                    };
                    self.problem(&path, format!("no {kind} {bucket:?} under `{table}:`"));
                    ok = false;
                    continue;
                };
                plan.buckets[i] = self.nonzero(&path, limit);
                ok &= plan.buckets[i]
                    .is_some_and(|l| self.fits_burst(&path, buckets[i].algorithm, l));
            }
            for (name, usd) in &p.spend {
                let path = format!("{at}.spend.{name}");
                let Some(i) = buckets
                    .iter()
                    .position(|b| b.name == *name && b.tokens.is_some_and(|t| t.priced))
                else {
                    self.problem(&path, format!("no money budget {name:?} under `spend:`"));
                    ok = false;
                    continue;
                };
                plan.buckets[i] = self.usd(&path, usd);
                ok &= plan.buckets[i].is_some();
            }
            for (family, &limit) in &p.quotas {
                let path = format!("{at}.quotas.{family}");
                let Some(i) = quotas.iter().position(|q| q.name == *family) else {
                    self.problem(&path, format!("no quota family {family:?} under `quotas:`"));
                    ok = false;
                    continue;
                };
                plan.quotas[i] = self.nonzero(&path, limit);
                ok &= plan.quotas[i].is_some();
            }
            for (lane, raw_lane) in &p.lanes {
                let path = format!("{at}.lanes.{lane}");
                let Some(i) = lanes.iter().position(|l| l.name == *lane) else {
                    self.problem(&path, format!("no lane {lane:?} under `lanes:`"));
                    ok = false;
                    continue;
                };
                let mut limit = |v: &mut Self, field: &str, value: Option<u32>| {
                    let value = value?;
                    let got = v.nonzero(&format!("{path}.{field}"), value);
                    ok &= got.is_some();
                    got
                };
                let own = PlanLane {
                    workspace_in_flight: limit(
                        self,
                        "workspace_in_flight",
                        raw_lane.workspace_in_flight,
                    ),
                    workspace_starts: limit(self, "workspace_starts", raw_lane.workspace_starts),
                };
                // A lane remembers each start of a workspace for its window.
                if let Some(starts) = own.workspace_starts
                    && starts.get() > MAX_LANE_STARTS
                {
                    self.problem(
                        format!("{path}.workspace_starts"),
                        format!(
                            "at most {MAX_LANE_STARTS} (each start is remembered for its window)"
                        ),
                    );
                    ok = false;
                }
                if own == PlanLane::default() {
                    self.problem(
                        &path,
                        "names no limit: set `workspace_in_flight`, `workspace_starts` or both",
                    );
                    ok = false;
                }
                plan.lanes[i] = own;
            }
            match self.mode(&format!("{at}.mode"), p.mode.as_deref()) {
                Some(mode) => plan.mode = mode,
                None => ok = false,
            }
            if plan.mode == Enforcement::Shadow
                && let Some(lane) = p.lanes.keys().next()
            {
                // A place in a lane is held or not: it cannot be taken in a dry run.
                self.problem(
                    format!("{at}.lanes.{lane}"),
                    "a plan in shadow mode cannot set a lane's limits: a lane's places cannot be dry-run",
                );
                ok = false;
            }
            if ok {
                plans.push(plan);
            }
        }
        plans
    }

    /// The tenant table: `workspaces:` and the plans the key table names, one plan
    /// per workspace.
    pub(super) fn tenants(&mut self, raw: &RawPolicy, plans: &[CustomerPlan]) -> Tenants {
        let mut tenants = Tenants::default();
        let plan_of =
            |v: &mut Self, at: &str, name: &str| match plans.iter().position(|p| p.name == name) {
                Some(i) => Some(i),
                None => {
                    let known: Vec<&str> = plans.iter().map(|p| p.name.as_str()).collect();
                    let known = if known.is_empty() {
                        "none".to_owned()
                    } else {
                        known.join(", ")
                    };
                    v.problem(
                        at,
                        format!("no plan {name:?} under `plans:` (declared: {known})"),
                    );
                    None
                }
            };
        let mut from: HashMap<&str, (usize, String)> = HashMap::new();
        for (workspace, w) in &raw.workspaces {
            let at = format!("workspaces.{workspace}");
            if !is_workspace_name(workspace) {
                self.problem(
                    &at,
                    "expected printable ASCII not starting with `key:` or `ip:` (it is sent upstream as a header)",
                );
                continue;
            }
            let plan = w.plan.as_deref().unwrap_or("default");
            if w.plan.is_none() && !plans.iter().any(|p| p.name == "default") {
                continue;
            }
            if let Some(i) = plan_of(self, &format!("{at}.plan"), plan) {
                from.insert(workspace, (i, format!("{at}.plan")));
            }
        }
        for (k, key) in raw.identity.keys.iter().enumerate() {
            let Some(plan) = &key.plan else { continue };
            let at = format!("identity.keys[{k}].plan");
            let Some(i) = plan_of(self, &at, plan) else {
                continue;
            };
            match from.get(key.workspace.as_str()) {
                Some((j, other)) if *j != i => self.problem(
                    at,
                    format!(
                        "workspace {:?} is on plan {:?} by {other}: a workspace has one plan",
                        key.workspace, plans[*j].name
                    ),
                ),
                Some(_) => {}
                None => {
                    from.insert(&key.workspace, (i, at));
                }
            }
        }
        if from.len() > MAX_WORKSPACES {
            self.problem(
                "workspaces",
                format!("at most {MAX_WORKSPACES} workspaces on a plan"),
            );
        }
        for (workspace, (i, _)) in from {
            let plan = crate::model::TenantPlan::Named(i);
            tenants
                .plans
                .insert(crate::identity::workspace_digest(workspace), plan);
            tenants.by_name.insert(workspace.to_owned(), plan);
        }
        tenants
    }
}
