//! Customer plans, the tenant table, and what a workspace on a plan gets.

use std::collections::HashMap;
use std::num::NonZeroU32;

use super::{Enforcement, Policy};

/// The most plans a policy may declare.
pub const MAX_PLANS: usize = 64;

/// The most workspaces the tenant table holds (the policy file's and those the
/// admin API adds): each is a few hundred bytes in every replica's memory.
pub const MAX_WORKSPACES: usize = 100_000;

/// A customer plan (`plans:`): limits that replace the active profile's for the
/// workspaces on it. `None` in a table: the profile's (or the policy's) limit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CustomerPlan {
    /// Its name (`default` is the plan of a workspace on no other).
    pub name: String,
    /// Per-caller limit per window, indexed by [`Class::index`](crate::Class::index).
    pub classes: Vec<Option<NonZeroU32>>,
    /// Per-IP limit per window, indexed like [`Policy::ceilings`].
    pub ceilings: Vec<Option<NonZeroU32>>,
    /// Limit per window, indexed like [`Policy::buckets`].
    pub buckets: Vec<Option<NonZeroU32>>,
    /// Calls per calendar month, indexed like [`Policy::quotas`].
    pub quotas: Vec<Option<NonZeroU32>>,
    /// Per-workspace limits in each lane, indexed like [`Policy::lanes`].
    pub lanes: Vec<PlanLane>,
    /// Turns of a run, indexed like [`Turns::tiers`](crate::Turns).
    pub turns: Vec<Option<NonZeroU32>>,
    /// Enforced, or its limits decided and counted without refusing (a dry run).
    pub mode: Enforcement,
}

/// A plan's per-workspace limits in one lane; a limit it does not set is the
/// lane's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PlanLane {
    /// Calls of one workspace running at once.
    pub workspace_in_flight: Option<NonZeroU32>,
    /// Calls of one workspace started in the lane's `starts_window`.
    pub workspace_starts: Option<NonZeroU32>,
}

impl PlanLane {
    /// `self`'s limits, with `under`'s where `self` sets none.
    pub fn or(self, under: PlanLane) -> PlanLane {
        PlanLane {
            workspace_in_flight: self.workspace_in_flight.or(under.workspace_in_flight),
            workspace_starts: self.workspace_starts.or(under.workspace_starts),
        }
    }
}

/// The tenant table: the plan of each workspace, by the digest of its name (as
/// [`Caller::workspace`](crate::Caller) holds it), and the names.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Tenants {
    /// Workspace digest → its plan.
    pub plans: HashMap<u64, TenantPlan>,
    /// Workspace name → its plan, as written (what `GET` lists).
    pub by_name: std::collections::BTreeMap<String, TenantPlan>,
    /// The plans of workspaces with limits of their own (set at run time): their
    /// plan's limits with theirs over them.
    pub own: Vec<CustomerPlan>,
}

/// One limit of what a workspace on a plan gets ([`Policy::plan_limits`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanLimit {
    /// The budget's name (a class, a ceiling, a bucket or a quota family).
    pub name: String,
    /// Its limit: per window, or per calendar month for a quota.
    pub limit: u32,
    /// True when the plan sets it (else it is the profile's, bucket's or family's).
    pub from_plan: bool,
}

/// What a workspace on a plan gets, budget by budget, in the policy's orders.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PlanLimits {
    /// Per caller and window, by class.
    pub classes: Vec<PlanLimit>,
    /// Per IP and window, by ceiling.
    pub ceilings: Vec<PlanLimit>,
    /// Per window, by bucket (with the bucket's window).
    pub buckets: Vec<(PlanLimit, NonZeroU32)>,
    /// Per calendar month, by capped quota family (uncapped ones left out).
    pub quotas: Vec<PlanLimit>,
    /// Per workspace, by lane: (calls running at once, calls started per the
    /// lane's window). Each limit is named `<lane>.workspace_in_flight` and
    /// `<lane>.workspace_starts`.
    pub lanes: Vec<(PlanLimit, PlanLimit)>,
}

/// Which plan a workspace of the tenant table is on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TenantPlan {
    /// A plan of [`Policy::plans`], by index.
    Named(usize),
    /// Its own limits: an index into [`Tenants::own`].
    Own(usize),
}

impl Policy {
    /// The plan of the workspace whose digest is `workspace`: its own, else
    /// `default` (if the policy has one).
    pub fn plan_of(&self, workspace: u64) -> Option<&CustomerPlan> {
        match self.tenants.plans.get(&workspace) {
            Some(TenantPlan::Named(i)) => self.plans.get(*i),
            Some(TenantPlan::Own(i)) => self.tenants.own.get(*i),
            None => self.default_plan.and_then(|i| self.plans.get(i)),
        }
    }

    /// The plan of a request from `caller`: the one a trusted auth layer named for
    /// it, else its workspace's ([`Policy::plan_of`]). A name that is no plan of the
    /// policy is `Err(())`: such a request is refused, never decided as on no plan.
    #[allow(clippy::result_unit_err)]
    pub fn plan_for(&self, caller: &crate::Caller) -> Result<Option<&CustomerPlan>, ()> {
        match &caller.plan {
            Some(name) => self
                .plan(name)
                .and_then(|i| self.plans.get(i))
                .map(Some)
                .ok_or(()),
            None => Ok(self.plan_of(caller.workspace)),
        }
    }

    /// What a workspace on `plan` gets under the active profile (`None`: on no
    /// plan, the profile's limits).
    pub fn plan_limits(&self, plan: Option<&CustomerPlan>) -> PlanLimits {
        fn limit(
            name: &str,
            own: Option<&Vec<Option<NonZeroU32>>>,
            i: usize,
            otherwise: NonZeroU32,
        ) -> PlanLimit {
            let set = own.and_then(|t| t.get(i).copied().flatten());
            PlanLimit {
                name: name.to_owned(),
                limit: set.unwrap_or(otherwise).get(),
                from_plan: set.is_some(),
            }
        }
        PlanLimits {
            classes: self
                .class_ids()
                .map(|c| {
                    let name = self.class_name(c);
                    limit(
                        name,
                        plan.map(|p| &p.classes),
                        c.index(),
                        self.profile.limit(c),
                    )
                })
                .collect(),
            ceilings: self
                .ceilings
                .iter()
                .enumerate()
                .map(|(i, c)| {
                    limit(
                        &c.name,
                        plan.map(|p| &p.ceilings),
                        i,
                        self.profile.ceiling(i),
                    )
                })
                .collect(),
            buckets: self
                .buckets
                .iter()
                .enumerate()
                .map(|(i, b)| {
                    (
                        limit(&b.name, plan.map(|p| &p.buckets), i, b.limit),
                        b.window,
                    )
                })
                .collect(),
            quotas: self
                .quotas
                .iter()
                .enumerate()
                .filter_map(|(i, q)| {
                    let own = plan.and_then(|p| p.quotas.get(i).copied().flatten());
                    let cap = own.or(q.monthly)?;
                    Some(limit(&q.name, plan.map(|p| &p.quotas), i, cap))
                })
                .collect(),
            lanes: self
                .lanes
                .iter()
                .enumerate()
                .map(|(i, lane)| {
                    let own = plan
                        .and_then(|p| p.lanes.get(i))
                        .copied()
                        .unwrap_or_default();
                    let limit =
                        |field: &str, own: Option<NonZeroU32>, otherwise: NonZeroU32| PlanLimit {
                            name: format!("{}.{field}", lane.name),
                            limit: own.unwrap_or(otherwise).get(),
                            from_plan: own.is_some(),
                        };
                    (
                        limit(
                            "workspace_in_flight",
                            own.workspace_in_flight,
                            lane.workspace_in_flight,
                        ),
                        limit(
                            "workspace_starts",
                            own.workspace_starts,
                            lane.workspace_starts,
                        ),
                    )
                })
                .collect(),
        }
    }

    /// The per-workspace limits of lane `lane` (an index into
    /// [`Policy::lanes`]) for a workspace on `plan`: (calls running at once,
    /// calls started per the lane's window); the lane's where the plan sets
    /// none. `None` for a lane the policy does not have.
    pub fn lane_limits(
        &self,
        plan: Option<&CustomerPlan>,
        lane: usize,
    ) -> Option<(NonZeroU32, NonZeroU32)> {
        let rule = self.lanes.get(lane)?;
        let own = plan
            .and_then(|p| p.lanes.get(lane))
            .copied()
            .unwrap_or_default();
        Some((
            own.workspace_in_flight.unwrap_or(rule.workspace_in_flight),
            own.workspace_starts.unwrap_or(rule.workspace_starts),
        ))
    }

    /// The plan named `name`.
    pub fn plan(&self, name: &str) -> Option<usize> {
        self.plans.iter().position(|p| p.name == name)
    }
}
