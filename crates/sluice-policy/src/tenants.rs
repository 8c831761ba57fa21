//! Tenants at run time (P4): workspaces (their plan, limits of their own) and
//! credentials changed through the admin API, kept as a [`TenantTable`] and applied
//! over a policy file's with [`Policy::with_tenants`], checked as a file is checked.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::identity::workspace_digest;
use crate::model::{CustomerPlan, Enforcement, Policy, Principal, TenantPlan};
use crate::raw::{RawPlan, RawPolicy};
use crate::validate::{Checker, is_workspace_name};
use crate::{MAX_WORKSPACES, Problem};

/// The most credentials the tenant table holds (the policy file's and those the
/// admin API adds or revokes): a few hundred bytes each in every replica's memory.
pub const MAX_KEYS: usize = 100_000;

/// What the admin API changed: each workspace and credential it set or removed,
/// over the policy file's. The file stays the starting set.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantTable {
    /// Workspace name → what it is now (`None`: removed, with its credentials).
    #[serde(default)]
    pub workspaces: BTreeMap<String, Option<TenantWorkspace>>,
    /// Lower-case hex SHA-256 of a credential → whose it is now (`None`: revoked).
    #[serde(default)]
    pub keys: BTreeMap<String, Option<TenantKey>>,
}

/// A workspace as the admin API sets it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantWorkspace {
    /// Its plan (absent: `default`, or the profile's limits without one).
    pub plan: Option<String>,
    /// Limits of its own, over its plan's (the keys of a plan: `classes`,
    /// `ip_ceilings`, `buckets`, `quotas`, `mode`).
    #[serde(default, skip_serializing_if = "is_empty")]
    pub limits: RawPlan,
}

fn is_empty(plan: &RawPlan) -> bool {
    *plan == RawPlan::default()
}

/// A credential as the admin API sets it (by its SHA-256, never the secret).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantKey {
    /// The workspace it belongs to.
    pub workspace: String,
    /// The user it belongs to.
    pub user: String,
}

/// One change of the tenant table: what the admin API was asked, and what replicas
/// tell each other.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum TenantChange {
    /// Creates or replaces a workspace.
    PutWorkspace {
        /// Its name.
        name: String,
        /// What it is.
        workspace: TenantWorkspace,
    },
    /// Removes a workspace: its plan and limits, and every credential of it.
    RemoveWorkspace {
        /// Its name.
        name: String,
        /// The credentials (lower-case hex SHA-256) the removal revokes, as
        /// [`TenantTable::resolved`] names them when it is made: a change kept
        /// (a journal, replicas' messages) revokes these and no other, whatever
        /// the policy file names later. `None` (as the admin API asks it):
        /// every credential of the workspace now.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        revoked: Option<Vec<String>>,
    },
    /// Creates or replaces a credential.
    PutKey {
        /// Lower-case hex SHA-256 of the credential.
        sha256: String,
        /// Whose it is.
        key: TenantKey,
    },
    /// Revokes a credential: a request sending it is refused.
    RevokeKey {
        /// Lower-case hex SHA-256 of the credential.
        sha256: String,
    },
}

impl TenantTable {
    /// `change` as it is made over this table and `base` (the policy file's): a
    /// workspace removal names the credentials it revokes — each credential whose
    /// workspace is `name` now, the table's entry over the file's — so that the
    /// change, kept and made again later, revokes those and no other.
    pub fn resolved(&self, change: &TenantChange, base: &Policy) -> TenantChange {
        match change {
            TenantChange::RemoveWorkspace {
                name,
                revoked: None,
            } => {
                let of_it =
                    |k: &Option<TenantKey>| k.as_ref().is_some_and(|k| k.workspace == *name);
                let file_keys = base
                    .identity
                    .keys
                    .iter()
                    .filter(|(_, p)| p.workspace == *name)
                    .map(|(sha, _)| hex::encode(sha))
                    .filter(|sha| self.keys.get(sha).is_none_or(of_it));
                let own_keys = self
                    .keys
                    .iter()
                    .filter(|(_, k)| of_it(k))
                    .map(|(sha, _)| sha.clone());
                let mut revoked: Vec<String> = file_keys.chain(own_keys).collect();
                revoked.sort_unstable();
                revoked.dedup();
                TenantChange::RemoveWorkspace {
                    name: name.clone(),
                    revoked: Some(revoked),
                }
            }
            other => other.clone(),
        }
    }

    /// The table with `change` made (as [`TenantTable::resolved`] makes it).
    pub fn with(&self, change: &TenantChange, base: &Policy) -> TenantTable {
        let mut next = self.clone();
        match self.resolved(change, base) {
            TenantChange::PutWorkspace { name, workspace } => {
                next.workspaces.insert(name, Some(workspace));
            }
            TenantChange::RemoveWorkspace { name, revoked } => {
                // A workspace of the file's is kept removed by a mark; one the admin
                // API made is simply gone (marks never pile up past the file's).
                if base.tenants.by_name.contains_key(&name) {
                    next.workspaces.insert(name, None);
                } else {
                    next.workspaces.remove(&name);
                }
                for sha in revoked.unwrap_or_default() {
                    next.keys.insert(sha.to_ascii_lowercase(), None);
                }
            }
            TenantChange::PutKey { sha256, key } => {
                next.keys.insert(sha256.to_ascii_lowercase(), Some(key));
            }
            TenantChange::RevokeKey { sha256 } => {
                next.keys.insert(sha256.to_ascii_lowercase(), None);
            }
        }
        next
    }
}

impl TenantTable {
    /// The entries of `self` (the table after `change`, a change as
    /// [`TenantTable::resolved`] makes it) that `change` set: applied over the
    /// policy running before it, they make the policy after it.
    pub fn touched_by(&self, change: &TenantChange) -> TenantTable {
        let mut touched = TenantTable::default();
        // A workspace the table no longer holds is touched as removed.
        let mut workspace = |name: &str| {
            let entry = self.workspaces.get(name).cloned().flatten();
            touched.workspaces.insert(name.to_owned(), entry);
        };
        match change {
            TenantChange::PutWorkspace { name, .. } => workspace(name),
            TenantChange::RemoveWorkspace { name, revoked } => {
                workspace(name);
                // The credentials the removal revoked.
                touched.keys = revoked
                    .iter()
                    .flatten()
                    .map(|sha| sha.to_ascii_lowercase())
                    .filter_map(|sha| self.keys.get(&sha).map(|k| (sha, k.clone())))
                    .collect();
            }
            TenantChange::PutKey { sha256, .. } | TenantChange::RevokeKey { sha256 } => {
                let sha = sha256.to_ascii_lowercase();
                if let Some(entry) = self.keys.get(&sha) {
                    touched.keys.insert(sha, entry.clone());
                }
            }
        }
        touched
    }
}

/// The entry of a tenant table a problem is of, named by its key rather than
/// by a key path: a workspace's name may hold dots (`team` and `team.eu`).
#[derive(Clone, Debug, PartialEq, Eq)]
enum Entry {
    /// `workspaces.<name>`.
    Workspace(String),
    /// `keys.<sha256>`, as the table spells it.
    Key(String),
}

impl Policy {
    /// This policy (a file's) with the tenant table's workspaces and credentials over
    /// its own, checked as a file is checked.
    ///
    /// # Errors
    /// Every problem found, each at its key path in the table (`workspaces.acme.plan`,
    /// `workspaces.acme.limits.classes.search`, `keys.<sha256>.workspace`, …);
    /// nothing of a table with a problem is taken.
    pub fn with_tenants(&self, table: &TenantTable) -> Result<Policy, Vec<Problem>> {
        self.with_tenant_entries(table)
            .map_err(|problems| problems.into_iter().map(|(_, p)| p).collect())
    }

    /// [`Policy::with_tenants`], each problem with the entry of `table` it is of
    /// (`None`: a bound of the whole table).
    fn with_tenant_entries(
        &self,
        table: &TenantTable,
    ) -> Result<Policy, Vec<(Option<Entry>, Problem)>> {
        let mut next = self.clone();
        let mut v = Checker {
            classes: self.classes.iter().map(|c| c.name.clone()).collect(),
            ceilings: self.ceilings.iter().map(|c| c.name.clone()).collect(),
            ..Checker::default()
        };
        // The entry of each problem of `v`, in its order.
        let mut of: Vec<Option<Entry>> = Vec::new();
        for (sha, key) in &table.keys {
            put_key(&mut v, &mut next, sha, key.as_ref());
            of.resize(v.problems.len(), Some(Entry::Key(sha.clone())));
        }
        if next.identity.keys.len() + next.identity.revoked.len() > MAX_KEYS {
            v.problem(
                "keys",
                format!("at most {MAX_KEYS} credentials, revoked ones included"),
            );
            of.resize(v.problems.len(), None);
        }
        for (name, workspace) in &table.workspaces {
            self.put_workspace(&mut v, &mut next, name, workspace.as_ref());
            of.resize(v.problems.len(), Some(Entry::Workspace(name.clone())));
        }
        if next.tenants.by_name.len() > MAX_WORKSPACES {
            v.problem(
                "workspaces",
                format!("at most {MAX_WORKSPACES} workspaces on a plan"),
            );
            of.resize(v.problems.len(), None);
        }
        if v.problems.is_empty() {
            Ok(next)
        } else {
            Err(of.into_iter().zip(v.problems).collect())
        }
    }

    /// The workspace `name` of a tenant table (`None`: removed) put in `next`,
    /// its problems in `v`.
    fn put_workspace(
        &self,
        v: &mut Checker,
        next: &mut Policy,
        name: &str,
        workspace: Option<&TenantWorkspace>,
    ) {
        let at = format!("workspaces.{name}");
        if !is_workspace_name(name) {
            v.problem(
                at,
                "expected 1 to 256 printable ASCII characters, not starting with `key:` or `ip:` (it is sent upstream as a header)",
            );
            return;
        }
        let digest = workspace_digest(name);
        let Some(workspace) = workspace else {
            next.tenants.plans.remove(&digest);
            next.tenants.by_name.remove(name);
            return;
        };
        let named = match workspace.plan.as_deref() {
            Some(plan) => match self.plan(plan) {
                Some(i) => Some(i),
                None => {
                    let known: Vec<&str> = self.plans.iter().map(|p| p.name.as_str()).collect();
                    let known = if known.is_empty() {
                        "none".to_owned()
                    } else {
                        known.join(", ")
                    };
                    v.problem(
                        format!("{at}.plan"),
                        format!("no plan {plan:?} under `plans:` (declared: {known})"),
                    );
                    return;
                }
            },
            None => self.default_plan,
        };
        let plan = if is_empty(&workspace.limits) {
            match named {
                Some(i) => TenantPlan::Named(i),
                None => {
                    // No plan, no limits of its own: the profile's limits.
                    next.tenants.plans.remove(&digest);
                    next.tenants.by_name.remove(name);
                    return;
                }
            }
        } else {
            let Some(own) = own_plan(v, self, name, &workspace.limits, named) else {
                return;
            };
            next.tenants.own.push(own);
            TenantPlan::Own(next.tenants.own.len() - 1)
        };
        next.tenants.plans.insert(digest, plan);
        next.tenants.by_name.insert(name.to_owned(), plan);
    }
}

/// The credential `sha` of a tenant table (`None`: revoked) put in `next`, its
/// problems in `v`.
fn put_key(v: &mut Checker, next: &mut Policy, sha: &str, key: Option<&TenantKey>) {
    let at = format!("keys.{sha}");
    let mut digest = [0u8; 32];
    if sha.len() != 64 || hex::decode_to_slice(sha, &mut digest).is_err() {
        v.problem(
            at,
            "expected 64 hex digits: the SHA-256 of the credential (e.g. `printf %s KEY | sha256sum`)",
        );
        return;
    }
    match key {
        Some(key) => {
            for (field, name) in [("workspace", &key.workspace), ("user", &key.user)] {
                if !is_workspace_name(name) {
                    v.problem(
                        format!("{at}.{field}"),
                        "expected 1 to 256 printable ASCII characters, not starting with `key:` or `ip:` (it is sent upstream as a header)",
                    );
                }
            }
            next.identity.revoked.remove(&digest);
            next.identity.keys.insert(
                digest,
                Principal {
                    workspace: key.workspace.clone(),
                    user: key.user.clone(),
                },
            );
        }
        None => {
            next.identity.keys.remove(&digest);
            next.identity.revoked.insert(digest);
        }
    }
}

impl Policy {
    /// [`Policy::with_tenants`] leaving out each entry of `table` that has a
    /// problem (named by its key path: `workspaces.<name>…`, `keys.<sha256>…`),
    /// for a replica following a table that replicas with another policy file
    /// made: the policy with every entry that fits, and the problems of those
    /// left out (empty when all fit). Only the entries with a problem are left
    /// out: a workspace `team` stays when `team.eu` does not fit.
    ///
    /// # Errors
    /// The problems no entry names (more credentials or workspaces than the
    /// bounds): nothing of the table is taken then.
    pub fn with_fitting_tenants(
        &self,
        table: &TenantTable,
    ) -> Result<(Policy, Vec<Problem>), Vec<Problem>> {
        let mut fitting = table.clone();
        let mut left_out = Vec::new();
        loop {
            let problems = match self.with_tenant_entries(&fitting) {
                Ok(policy) => return Ok((policy, left_out)),
                Err(problems) => problems,
            };
            let before = left_out.len();
            let mut unnamed = Vec::new();
            for (entry, problem) in problems {
                match entry {
                    Some(Entry::Workspace(name)) => {
                        fitting.workspaces.remove(&name);
                        left_out.push(problem);
                    }
                    Some(Entry::Key(sha)) => {
                        fitting.keys.remove(&sha);
                        left_out.push(problem);
                    }
                    // Checked again without the entries left out.
                    None => unnamed.push(problem),
                }
            }
            if left_out.len() == before {
                return Err(unnamed);
            }
        }
    }
}

/// The plan of a workspace with limits of its own: its plan's (`named`) with its
/// own over them, checked as a plan of the file is (problems at
/// `workspaces.<name>.limits…`).
fn own_plan(
    v: &mut Checker,
    policy: &Policy,
    name: &str,
    limits: &RawPlan,
    named: Option<usize>,
) -> Option<CustomerPlan> {
    // Checked as a plan of the file under a plan name of its own: a workspace's
    // name (1 to 256 printable ASCII) need not be a plan's.
    const CHECKED_AS: &str = "own";
    let raw = RawPolicy {
        plans: BTreeMap::from([(CHECKED_AS.to_owned(), limits.clone())]),
        ..RawPolicy::default()
    };
    let mut checker = Checker {
        classes: v.classes.clone(),
        ceilings: v.ceilings.clone(),
        ..Checker::default()
    };
    let own = checker
        .plans(
            &raw,
            (
                &policy.classes,
                &policy.buckets,
                &policy.quotas,
                &policy.lanes,
            ),
            &policy.turns,
        )
        .pop();
    let prefix = format!("plans.{CHECKED_AS}");
    for mut problem in checker.problems {
        if let Some(rest) = problem.path.strip_prefix(&prefix) {
            problem.path = format!("workspaces.{name}.limits{rest}");
        }
        v.problems.push(problem);
    }
    let mut own = own?;
    let base = named.and_then(|i| policy.plans.get(i));
    // `<plan>+<workspace>`: no plan of the file is named so (a plan name has no
    // `+`), and a name in a request's trusted plan header never finds it.
    own.name = match base {
        Some(base) => format!("{}+{name}", base.name),
        None => format!("+{name}"),
    };
    if let Some(base) = base {
        let under = |own: &mut Vec<Option<_>>, base: &Vec<Option<_>>| {
            for (o, b) in own.iter_mut().zip(base) {
                *o = o.or(*b);
            }
        };
        under(&mut own.classes, &base.classes);
        under(&mut own.ceilings, &base.ceilings);
        under(&mut own.buckets, &base.buckets);
        under(&mut own.quotas, &base.quotas);
        for (o, b) in own.lanes.iter_mut().zip(&base.lanes) {
            *o = o.or(*b);
        }
        if base.mode == Enforcement::Shadow {
            own.mode = Enforcement::Shadow;
            if let Some(lane) = limits.lanes.keys().next() {
                v.problem(
                    format!("workspaces.{name}.limits.lanes.{lane}"),
                    format!(
                        "its plan {:?} is in shadow mode: a lane's places cannot be dry-run",
                        base.name
                    ),
                );
                return None;
            }
        }
    }
    Some(own)
}
