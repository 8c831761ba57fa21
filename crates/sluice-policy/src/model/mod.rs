//! The typed, checked policy that the rest of sluice uses: the policy itself
//! here, its parts in one file each.

mod budgets;
pub(crate) use budgets::LeaseSpec;
mod classes;
mod identity;
mod lanes;
mod plans;
mod routes;
mod turns;

use std::num::NonZeroU32;

use crate::path::Paths;

pub use budgets::{
    Algorithm, Bucket, Consistency, Enforcement, LlmFormat, MAX_BUCKETS, MAX_QUOTA_FAMILIES,
    MAX_SLIDING_WINDOW_SECONDS, MONEY_UNITS_PER_USD, OnExhausted, Per, Price, QuotaFamily, Refusal,
    SLIDING_SLOTS, Spends, TokenBudget,
};
pub use classes::{Ceiling, Class, ClassSet, CostClass, MAX_CEILINGS, MAX_CLASSES, Profile};
pub use identity::{CredentialSource, Identity, Principal};
pub use lanes::{Lane, LaneBatch, LaneReasons, MAX_LANES};
pub use plans::{
    CustomerPlan, MAX_PLANS, MAX_WORKSPACES, PlanLane, PlanLimit, PlanLimits, TenantPlan, Tenants,
};
pub use routes::{
    BatchEndpoint, Bounds, JsonRpc, JsonRpcRefusal, METHOD_OVERRIDE_FIELDS, Outage, Route,
    RouteClass, StorePolicy, Tool,
};
pub use turns::{
    BUILT_IN_TIERS, DEPTH_HEADER, MAX_RUN_ID, MAX_TIERS, RUN_HEADER, RunEndpoint, Turns, is_run_id,
};

/// The checked policy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Policy {
    /// The active profile's name.
    pub profile_name: String,
    /// Every profile, by name.
    pub profiles: Vec<(String, Profile)>,
    /// The active profile's numbers.
    pub profile: Profile,
    /// The cost classes, cheapest first (a request holding several is counted in
    /// the metrics of the last): [`Class`] is an index into it.
    pub classes: Vec<CostClass>,
    /// The per-IP ceilings, by name.
    pub ceilings: Vec<Ceiling>,
    /// Window of the class budgets and IP ceilings.
    pub window: NonZeroU32,
    /// Identity settings.
    pub identity: Identity,
    /// Extra buckets (token and money budgets among them).
    pub buckets: Vec<Bucket>,
    /// The price of each model, first match wins (`prices:`; SPEC T4).
    pub prices: Vec<Price>,
    /// Monthly quota families.
    pub quotas: Vec<QuotaFamily>,
    /// Guarded lanes.
    pub lanes: Vec<Lane>,
    /// Descriptor rules for Envoy's rate-limit service, by domain (`domains:`,
    /// and the files of a directory `sluice serve --rls-config` names).
    pub domains: Vec<crate::domains::Domain>,
    /// The route table, first match wins.
    pub routes: Vec<Route>,
    /// The class of a request no route matches.
    pub default_class: Class,
    /// JSON-RPC rules.
    pub jsonrpc: JsonRpc,
    /// Send the IETF draft fields too.
    pub ietf_headers: bool,
    /// Bounds.
    pub bounds: Bounds,
    /// How request paths are normalised before they are matched and forwarded.
    pub paths: Paths,
    /// The shared store's settings.
    pub store: StorePolicy,
    /// A dry run: every budget, bucket, quota and route in shadow mode
    /// (`dry_run: true`, or `sluice serve --dry-run`).
    pub dry_run: bool,
    /// The customer plans, by name.
    pub plans: Vec<CustomerPlan>,
    /// The index of the plan named `default`, the plan of a workspace on no other.
    pub default_plan: Option<usize>,
    /// Which workspace is on which plan.
    pub tenants: Tenants,
    /// The turn budgets of agent runs (SPEC T7).
    pub turns: Turns,
    /// The share of its limit, in thousandths, past which an admitted decision
    /// leaves a budget near its limit (`near_limit_ratio`, SPEC O2).
    pub near_limit_permille: u16,
    /// Webhooks told when a workspace's budget passes shares of its limit
    /// (`alerts:`, SPEC O3).
    pub alerts: Vec<Alert>,
}

/// The most webhooks `alerts:` may name.
pub const MAX_ALERTS: usize = 8;

/// The most thresholds (`at:`) one alert may name.
pub const MAX_ALERT_THRESHOLDS: usize = 8;

/// One webhook of `alerts:` (SPEC O3): an event is POSTed to `url` once per
/// budget subject (a workspace, for a quota), budget, threshold and period when
/// an admitted or settled call leaves one of `budgets` at or past a threshold of
/// its limit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Alert {
    /// Where events are POSTed (`http://` or `https://`).
    pub url: String,
    /// The thresholds, in thousandths of a limit, ascending, each 1 to 1,000.
    pub at_permille: Vec<u16>,
    /// The budgets watched: quota family, token budget or money budget names.
    pub budgets: Vec<String>,
    /// The file holding the signing secret (read when sluice starts).
    pub secret_file: std::path::PathBuf,
    /// How long one delivery may take.
    pub timeout: std::time::Duration,
    /// The first wait before a failed delivery is tried again (doubled each time).
    pub retry: std::time::Duration,
    /// The longest wait between two tries.
    pub max_retry: std::time::Duration,
}

impl Policy {
    /// The same policy with another profile's numbers active.
    ///
    /// # Errors
    /// The names of the profiles there are, when `name` is not one of them.
    pub fn with_profile(mut self, name: &str) -> Result<Policy, String> {
        match self.profiles.iter().find(|(n, _)| n == name) {
            Some((_, p)) => {
                self.profile = p.clone();
                self.profile_name = name.to_owned();
                Ok(self)
            }
            None => Err(format!(
                "no profile {name:?}; the policy has {}",
                self.profiles
                    .iter()
                    .map(|(n, _)| n.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )),
        }
    }

    /// The class named `name`, if the policy has one.
    pub fn class(&self, name: &str) -> Option<Class> {
        self.classes
            .iter()
            .position(|c| c.name == name)
            .and_then(Class::from_index)
    }

    /// The name of `class` (empty for a class the policy does not have, which a
    /// checked policy never holds).
    pub fn class_name(&self, class: Class) -> &str {
        self.classes
            .get(class.index())
            .map_or("", |c| c.name.as_str())
    }

    /// Every class, cheapest first.
    pub fn class_ids(&self) -> impl Iterator<Item = Class> + '_ {
        (0..self.classes.len()).filter_map(Class::from_index)
    }

    /// What `class` does while the shared store cannot be reached.
    pub fn outage(&self, class: Class) -> Outage {
        self.classes
            .get(class.index())
            .map_or(Outage::FailClosed, |c| c.outage)
    }
}
