//! Tenants at run time (SPEC P4): the admin API creates, changes and removes
//! workspaces (their plan, limits of their own) and credentials (by SHA-256),
//! without a restart. A change is checked as a policy file is (400 naming the
//! field, nothing changed), made durable first (the journal under `--data-dir`,
//! or Redis, which tells every replica), then applied, and logged as one audit
//! line. The policy file's key table and `workspaces:` stay the starting set.
//!
//! | route | does |
//! |---|---|
//! | `GET /tenants` | the table: workspaces (plan, own limits) and credentials, file's and admin's |
//! | `GET /tenants/workspaces/{name}` | one workspace: its plan and the limits it gets |
//! | `PUT /tenants/workspaces/{name}` | `{"plan": "pro", "limits": {"classes": {"search": 600}}}` |
//! | `DELETE /tenants/workspaces/{name}` | removes its plan and limits, and revokes its credentials |
//! | `PUT /tenants/keys/{sha256}` | `{"workspace": "acme", "user": "ada"}` |
//! | `DELETE /tenants/keys/{sha256}` | revokes the credential: a request sending it is refused (403) |

mod journal;
mod shared;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{Path as UrlPath, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Json, Response};
use axum::routing::get;
use parking_lot::Mutex;
use sluice_edge::SharedLimiter;
use sluice_policy::{Policy, Problem, TenantChange, TenantKey, TenantTable, TenantWorkspace};

use sluice_store::BudgetStore;

/// The tenant journal's file name under `--data-dir`.
pub use journal::FILE as JOURNAL_FILE;

/// How long a replica that finds no tenant table on Redis at start waits for
/// another replica to write its copy back, before it makes an empty one.
pub const COPY_WAIT: Duration = Duration::from_secs(1);

/// How often a replica asks Redis whether the tenant table is still there (one
/// command): a `FLUSHALL` closes no subscription, so nothing else tells it.
pub const EPOCH_CHECK: Duration = Duration::from_secs(30);

/// Where the table is kept.
enum Backend {
    /// One process: the journal under `--data-dir`.
    Journal(journal::Journal),
    /// Replicas on one Redis.
    Shared(Box<shared::Shared>),
}

/// The tenants of a running gateway: the table the admin API changed, over the
/// policy file's.
pub struct Tenants<S> {
    /// The policy as its file says, without the table.
    base: Mutex<Arc<Policy>>,
    /// What the admin API changed.
    table: Mutex<TenantTable>,
    limiter: SharedLimiter<S>,
    backend: Backend,
    /// Where the shared table applied here stands: its epoch and version.
    stamp: Mutex<shared::Stamp>,
    /// One change at a time on this process.
    changing: tokio::sync::Mutex<()>,
    /// The problems of the shared table's entries this replica's policy file
    /// cannot take (left out, the rest applied), for `GET /tenants`.
    not_applied: Mutex<Vec<String>>,
    /// What [`Tenants::over`] left out of a file read again, kept once it runs.
    pending_not_applied: Mutex<Option<Vec<Problem>>>,
}

/// The most problems `GET /tenants` lists of entries left out.
const MAX_NOT_APPLIED: usize = 32;

impl<S> std::fmt::Debug for Tenants<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tenants").finish_non_exhaustive()
    }
}

/// Why a change was not made.
#[derive(Debug)]
pub enum ChangeError {
    /// It does not pass the policy's checks: each problem at its key path.
    Invalid(Vec<Problem>),
    /// It could not be confirmed durable: the journal did not take it (nothing
    /// changed), or the shared store did not answer (it may have taken it, and
    /// then every replica applies it through the subscription).
    Unavailable(String),
}

impl<S: BudgetStore + 'static> Tenants<S> {
    /// The tenants of a process on the memory store: the journal under `data_dir`
    /// read, and its table applied over `limiter`'s policy (the file's).
    ///
    /// # Errors
    /// The journal cannot be read, or its table no longer passes the policy's checks.
    pub fn local(data_dir: &Path, limiter: SharedLimiter<S>) -> Result<Tenants<S>, String> {
        let base = Arc::new(limiter.load().policy().clone());
        let (journal, table) = journal::Journal::open(data_dir, &base)
            .map_err(|e| format!("the tenant journal under {}: {e}", data_dir.display()))?;
        let tenants = Tenants::new(base, table.clone(), limiter, Backend::Journal(journal));
        tenants.apply(table).map_err(|p| problems_text(&p))?;
        Ok(tenants)
    }

    /// The tenants of replicas on the Redis at `url`: the shared table read and
    /// applied over `limiter`'s policy; [`Tenants::follow`] keeps it current.
    ///
    /// When Redis holds no table (a first start, or Redis lost it), the other
    /// replicas are asked for their copy (at most [`COPY_WAIT`]) before an empty
    /// table is made: a replica that holds one writes it back.
    ///
    /// # Errors
    /// Redis cannot be reached, or its table does not pass the policy's checks.
    pub async fn shared(
        url: &str,
        timeout: Duration,
        limiter: SharedLimiter<S>,
    ) -> Result<Tenants<S>, String> {
        let base = Arc::new(limiter.load().policy().clone());
        let shared = shared::Shared::connect(url, timeout).await?;
        let (stamp, table) = shared.load().await?;
        if stamp.epoch.is_empty() {
            let mut pubsub = shared.subscribe().await?;
            // Only this one subscribed: no other replica runs to hold a copy.
            let heard = shared.ask_for_copies().await?;
            if heard > 1 {
                tracing::warn!(
                    target: "sluice::tenants",
                    "no tenant table on Redis: asking the {} other replicas for their copy (Redis lost it, or they start too)",
                    heard - 1
                );
            }
            let mut messages = pubsub.on_message();
            let deadline = tokio::time::Instant::now() + COPY_WAIT;
            while heard > 1
                && let Ok(Some(message)) =
                    tokio::time::timeout_at(deadline, futures_util::StreamExt::next(&mut messages))
                        .await
            {
                let payload: String = message.get_payload().unwrap_or_default();
                // A table written back (or made by a replica starting as well).
                if shared::parse_message(&payload).is_some_and(|(epoch, ..)| epoch != "-") {
                    break;
                }
            }
        }
        let tenants = Tenants::new(
            base,
            table.clone(),
            limiter,
            Backend::Shared(Box::new(shared)),
        );
        let Backend::Shared(shared) = &tenants.backend else {
            return Err("the tenant table is not shared".to_owned());
        };
        if stamp.epoch.is_empty() {
            let _one = tenants.changing.lock().await;
            tenants.reconcile(shared).await?;
        } else {
            tenants.apply(table).map_err(|p| problems_text(&p))?;
            *tenants.stamp.lock() = stamp;
        }
        Ok(tenants)
    }

    fn new(
        base: Arc<Policy>,
        table: TenantTable,
        limiter: SharedLimiter<S>,
        backend: Backend,
    ) -> Tenants<S> {
        Tenants {
            base: Mutex::new(base),
            table: Mutex::new(table),
            limiter,
            backend,
            stamp: Mutex::new(shared::Stamp::default()),
            changing: tokio::sync::Mutex::new(()),
            not_applied: Mutex::new(Vec::new()),
            pending_not_applied: Mutex::new(None),
        }
    }

    /// Holds off changes (this process's and other replicas') while a policy file
    /// is read again: [`Tenants::over`], then [`Tenants::rebase`] once it runs.
    pub async fn hold(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.changing.lock().await
    }

    /// `base` (a policy file read again) with the table over it. A shared
    /// table's entries the new file cannot take are left out, as another
    /// replica's change is: the file is taken, and
    /// [`Tenants::rebase`] lists them.
    ///
    /// # Errors
    /// The journal's table no longer passes the new file's checks (a plan it
    /// names is gone, say), or a shared one past the bounds: the file is
    /// refused, and the running policy stays.
    pub fn over(&self, base: &Policy) -> Result<Policy, String> {
        let table = self.table.lock().clone();
        let refused = |p: Vec<Problem>| {
            format!(
                "the tenants set through the admin API do not fit this policy: {}",
                problems_text(&p)
            )
        };
        match self.backend {
            Backend::Journal(_) => base.with_tenants(&table).map_err(refused),
            Backend::Shared(_) => {
                let (policy, left_out) = base.with_fitting_tenants(&table).map_err(refused)?;
                *self.pending_not_applied.lock() = Some(left_out);
                Ok(policy)
            }
        }
    }

    /// Keeps `left_out`, the problems of the shared table's entries left out,
    /// for `GET /tenants` and the gauge, with an error line naming them.
    fn keep_not_applied(&self, left_out: &[Problem]) {
        if !left_out.is_empty() {
            tracing::error!(
                target: "sluice::tenants",
                "entries of the shared tenant table do not fit this replica's policy and are left out (the rest applied): {}",
                problems_text(left_out)
            );
        }
        metrics::gauge!("sluice_tenant_entries_not_applied").set(left_out.len() as f64);
        *self.not_applied.lock() = left_out
            .iter()
            .take(MAX_NOT_APPLIED)
            .map(|p| format!("{}: {}", p.path, p.message))
            .collect();
    }

    /// Makes `base` (a policy file now running) the one changes are made over.
    pub fn rebase(&self, base: Policy) {
        *self.base.lock() = Arc::new(base);
        if let Some(left_out) = self.pending_not_applied.lock().take() {
            self.keep_not_applied(&left_out);
        }
    }

    /// Makes `change`: checked, made durable, applied, logged as one audit line
    /// naming `who`.
    ///
    /// # Errors
    /// [`ChangeError::Invalid`] or [`ChangeError::Unavailable`]; nothing changed.
    pub async fn change(&self, change: TenantChange, who: &str) -> Result<(), ChangeError> {
        let _one = self.changing.lock().await;
        let mut resets = 0;
        let (before_table, next, policy, change) = loop {
            let base = Arc::clone(&self.base.lock());
            let before_table = self.table.lock().clone();
            // Kept and told to the other replicas as made here: a removal names
            // the credentials it revokes.
            let change = before_table.resolved(&change, &base);
            let next = before_table.with(&change, &base);
            let policy = self
                .after(&base, &next, &change)
                .map_err(ChangeError::Invalid)?;
            match &self.backend {
                Backend::Journal(journal) => journal
                    .append(&change, &next)
                    .map_err(|e| ChangeError::Unavailable(format!("the tenant journal: {e}")))?,
                // The version moves when the subscription brings the change back, so a
                // change another replica published just before is not skipped.
                Backend::Shared(shared) => {
                    let seen = self.stamp.lock().clone();
                    match shared
                        .write(&change, &next, &seen)
                        .await
                        .map_err(ChangeError::Unavailable)?
                    {
                        shared::Written::Made => {}
                        // The table was lost or made again since this replica read
                        // it: read (or written back), then the change checked anew.
                        shared::Written::Reset if resets < 2 => {
                            resets += 1;
                            self.reconcile(shared)
                                .await
                                .map_err(ChangeError::Unavailable)?;
                            continue;
                        }
                        shared::Written::Reset => {
                            return Err(ChangeError::Unavailable(
                                "the shared tenant table was reset while the change was made"
                                    .to_owned(),
                            ));
                        }
                    }
                }
            }
            break (before_table, next, policy, change);
        };
        let (what, before, after) = describe(&change, &before_table, &next);
        self.install(next, policy);
        tracing::info!(
            target: "sluice::audit",
            who = %who,
            what = %what,
            before = %before,
            after = %after,
            "admin change"
        );
        Ok(())
    }

    /// The policy once `change` made `next`: the running policy with the entries
    /// the change touched (a change costs a copy of the policy, not a check of the
    /// whole table), or `base` with the whole table when workspaces' own limits
    /// replaced many times would otherwise pile up.
    fn after(
        &self,
        base: &Policy,
        next: &TenantTable,
        change: &TenantChange,
    ) -> Result<Policy, Vec<Problem>> {
        let limiter = self.limiter.load();
        let running = limiter.policy();
        let tenants = &running.tenants;
        if tenants.own.len() > 2 * tenants.by_name.len() + 64 {
            return base.with_tenants(next);
        }
        running.with_tenants(&next.touched_by(change))
    }

    /// Applies `table` (read at start, or from another replica). A shared table
    /// is applied with the entries this replica's policy file cannot take left
    /// out ([`Tenants::apply_fitting`]); a journal's is this process's own and is
    /// taken whole or not at all.
    fn apply(&self, table: TenantTable) -> Result<(), Vec<Problem>> {
        let base = Arc::clone(&self.base.lock());
        match self.backend {
            Backend::Journal(_) => {
                let policy = base.with_tenants(&table)?;
                self.install(table, policy);
                Ok(())
            }
            Backend::Shared(_) => self.apply_fitting(&base, table),
        }
    }

    /// Applies the shared `table` over `base` with each entry that does not fit
    /// left out: replicas whose policy files differ (a plan one lacks) keep
    /// following the table — later changes, revocations first, still reach
    /// them. What was left out is logged as an error, counted in
    /// `sluice_tenant_entries_not_applied` and listed by `GET /tenants`.
    fn apply_fitting(&self, base: &Policy, table: TenantTable) -> Result<(), Vec<Problem>> {
        let (policy, left_out) = base.with_fitting_tenants(&table)?;
        self.keep_not_applied(&left_out);
        self.install(table, policy);
        Ok(())
    }

    fn install(&self, table: TenantTable, policy: Policy) {
        let current = self.limiter.load_full();
        match current.reloaded(policy) {
            Ok(next) => {
                self.limiter.store(Arc::new(next));
                *self.table.lock() = table;
            }
            // Tenants never change lanes, which is all a reload refuses.
            Err(refused) => tracing::error!(target: "sluice::tenants", "not applied: {refused}"),
        }
    }

    /// With replicas on Redis: follows the other replicas' changes until `stop`,
    /// holding one subscription (no command while nothing changes), reading the
    /// whole table when it subscribes, when it misses a version and when the table
    /// was made again (another epoch). Every [`EPOCH_CHECK`] it asks Redis whether
    /// the table is still there and has not gone back (a `FLUSHALL` closes no
    /// subscription), and writes its copy back when it is not.
    pub async fn follow(self: Arc<Self>, stop: impl Future<Output = ()>) {
        let Backend::Shared(shared) = &self.backend else {
            return;
        };
        let mut stop = std::pin::pin!(stop);
        let mut wait = Duration::from_millis(100);
        loop {
            let session = async {
                let mut pubsub = shared.subscribe().await?;
                // Subscribed first, then read: nothing published between is lost.
                self.catch_up(shared).await?;
                wait = Duration::from_millis(100);
                let mut messages = pubsub.on_message();
                let mut check = tokio::time::Instant::now() + EPOCH_CHECK;
                loop {
                    let message = tokio::select! {
                        message = futures_util::StreamExt::next(&mut messages) => message,
                        () = tokio::time::sleep_until(check) => {
                            check = tokio::time::Instant::now() + EPOCH_CHECK;
                            let (epoch, version) = shared.now().await?;
                            let lost = {
                                let seen = self.stamp.lock();
                                epoch != seen.epoch || version < seen.version
                            };
                            if lost {
                                self.catch_up(shared).await?;
                            }
                            continue;
                        }
                    };
                    let Some(message) = message else { break };
                    let Ok(payload) = message.get_payload::<String>() else {
                        continue;
                    };
                    self.on_message(shared, &payload).await?;
                }
                Err::<(), String>("the subscription ended".to_owned())
            };
            tokio::select! {
                () = &mut stop => return,
                ended = session => {
                    if let Err(error) = ended {
                        tracing::warn!(target: "sluice::tenants", "following the shared tenant table: {error}; again in {wait:?}");
                    }
                }
            }
            tokio::select! {
                () = &mut stop => return,
                () = tokio::time::sleep(wait) => {}
            }
            wait = (wait * 2).min(Duration::from_secs(5));
        }
    }

    /// Applies a publication of the channel: the next change of this epoch, or
    /// else the whole table read again.
    async fn on_message(&self, shared: &shared::Shared, payload: &str) -> Result<(), String> {
        let Some((epoch, version, change)) = shared::parse_message(payload) else {
            return Ok(());
        };
        let seen = {
            let stamp = self.stamp.lock();
            (stamp.epoch == epoch).then_some(stamp.version)
        };
        // Another epoch (the table made again), or a request to read it.
        let Some(seen) = seen else {
            return self.catch_up(shared).await;
        };
        if version <= seen {
            return Ok(());
        }
        let Some(change) = change.filter(|_| version == seen + 1) else {
            return self.catch_up(shared).await;
        };
        let _one = self.changing.lock().await;
        let base = Arc::clone(&self.base.lock());
        let change = self.table.lock().resolved(&change, &base);
        let next = self.table.lock().with(&change, &base);
        // This replica's own change, come back: applied already.
        if *self.table.lock() == next {
            self.stamp.lock().version = version;
            return Ok(());
        }
        let applied = match self.after(&base, &next, &change) {
            Ok(policy) if self.not_applied.lock().is_empty() => {
                self.install(next, policy);
                Ok(())
            }
            // Made over another policy file (or entries left out before): the
            // whole table again, each entry that fits.
            _ => self.apply_fitting(&base, next),
        };
        match applied {
            Ok(()) => self.stamp.lock().version = version,
            Err(problems) => tracing::error!(
                target: "sluice::tenants",
                "a tenant change from another replica does not fit this policy: {}",
                problems_text(&problems)
            ),
        }
        Ok(())
    }

    /// Reads the shared table and applies it, or writes this replica's copy back
    /// (see [`Tenants::reconcile`]).
    async fn catch_up(&self, shared: &shared::Shared) -> Result<(), String> {
        let _one = self.changing.lock().await;
        self.reconcile(shared).await
    }

    /// With `changing` held: reads the shared table and takes it, unless Redis
    /// lost what this replica holds (see [`shared::repair`]). Then this replica's
    /// copy (or what the table lacks of it) is written back under a new epoch,
    /// logged as an error and counted in `sluice_tenant_table_repairs_total`; a
    /// replica that wrote second reads again and takes the first one's.
    async fn reconcile(&self, shared: &shared::Shared) -> Result<(), String> {
        for _ in 0..4 {
            let (now, table) = shared.load().await?;
            let mine = self.stamp.lock().clone();
            let held = self.table.lock().clone();
            let (write, repair, why) = match shared::repair(&mine, &held, &now, &table) {
                shared::Repair::Take => return self.take(now, table),
                shared::Repair::TakeIncomplete(why) => {
                    tracing::error!(target: "sluice::tenants", "{why}");
                    metrics::counter!("sluice_tenant_table_repairs_total", "repair" => "incomplete")
                        .increment(1);
                    return self.take(now, table);
                }
                shared::Repair::Write { table, kind, why } => (table, kind, why),
            };
            let stamp = shared::Stamp {
                epoch: shared::new_epoch(),
                version: 1,
                lineage: if now.epoch.is_empty() {
                    mine.lineage_with(&[])
                } else {
                    now.lineage_with(&[&mine])
                },
            };
            let expected = (!now.epoch.is_empty()).then_some(&now);
            if !shared.restore(&write, &stamp, expected).await? {
                // Another replica wrote first: read again.
                continue;
            }
            match repair {
                Some(repair) => {
                    tracing::error!(target: "sluice::tenants", "{why}; written back as epoch {}", stamp.epoch);
                    metrics::counter!("sluice_tenant_table_repairs_total", "repair" => repair)
                        .increment(1);
                }
                None => tracing::info!(
                    target: "sluice::tenants",
                    "made an empty shared tenant table (epoch {}): Redis held none, and no replica that answered held a copy",
                    stamp.epoch
                ),
            }
            return self.take(stamp, write);
        }
        Err("the shared tenant table kept changing while it was read".to_owned())
    }

    /// Applies `table`, read from Redis as `stamp`.
    fn take(&self, stamp: shared::Stamp, table: TenantTable) -> Result<(), String> {
        if let Err(problems) = self.apply(table) {
            return Err(format!(
                "the shared tenant table does not fit this policy: {}",
                problems_text(&problems)
            ));
        }
        *self.stamp.lock() = stamp;
        Ok(())
    }

    /// `GET /tenants`: every workspace on a plan and every credential, the file's
    /// and the admin API's (`source`), and the credentials revoked.
    pub fn list(&self) -> serde_json::Value {
        let limiter = self.limiter.load();
        let policy = limiter.policy();
        let table = self.table.lock();
        let workspaces: serde_json::Map<String, serde_json::Value> = policy
            .tenants
            .by_name
            .keys()
            .map(|name| {
                let own = table.workspaces.get(name).cloned().flatten();
                (
                    name.clone(),
                    serde_json::json!({
                        "plan": workspace_plan(policy, name),
                        "limits": own.as_ref().map(|w| &w.limits),
                        "source": if own.is_some() { "admin" } else { "file" },
                    }),
                )
            })
            .collect();
        let mut keys: Vec<(String, serde_json::Value)> = policy
            .identity
            .keys
            .iter()
            .map(|(sha, p)| {
                let sha = hex::encode(sha);
                let source = if table.keys.contains_key(&sha) { "admin" } else { "file" };
                let entry = serde_json::json!({ "workspace": p.workspace, "user": p.user, "source": source });
                (sha, entry)
            })
            .collect();
        keys.sort_by(|a, b| a.0.cmp(&b.0));
        let mut revoked: Vec<String> = policy.identity.revoked.iter().map(hex::encode).collect();
        revoked.sort();
        serde_json::json!({
            "workspaces": workspaces,
            "keys": keys.into_iter().collect::<serde_json::Map<_, _>>(),
            "revoked": revoked,
            "not_applied": *self.not_applied.lock(),
        })
    }
}

/// The name of the plan `workspace` is on (`null`: the profile's limits). A
/// workspace with limits of its own is on `<plan>+<workspace>`: its plan is the part
/// before the `+` (a plan name has none).
fn workspace_plan(policy: &Policy, workspace: &str) -> Option<String> {
    let plan = policy.plan_of(sluice_policy::workspace_digest(workspace))?;
    let named = plan.name.split('+').next().unwrap_or_default();
    (!named.is_empty()).then(|| named.to_owned())
}

/// What a change did, for the audit line: what, and the entries before and after.
fn describe(
    change: &TenantChange,
    before: &TenantTable,
    after: &TenantTable,
) -> (String, String, String) {
    match change {
        TenantChange::PutWorkspace { name, .. } | TenantChange::RemoveWorkspace { name, .. } => (
            format!(
                "{} workspace {name}",
                if matches!(change, TenantChange::PutWorkspace { .. }) {
                    "set"
                } else {
                    "remove"
                }
            ),
            show(before.workspaces.get(name)),
            show(after.workspaces.get(name)),
        ),
        TenantChange::PutKey { sha256, .. } | TenantChange::RevokeKey { sha256 } => {
            let sha = sha256.to_ascii_lowercase();
            (
                format!(
                    "{} key {}…",
                    if matches!(change, TenantChange::PutKey { .. }) {
                        "set"
                    } else {
                        "revoke"
                    },
                    sha.get(..12).unwrap_or(&sha)
                ),
                show(before.keys.get(&sha)),
                show(after.keys.get(&sha)),
            )
        }
    }
}

/// An entry as compact JSON in an audit line (`-`: not in the table).
fn show<T: serde::Serialize>(entry: Option<&T>) -> String {
    entry.map_or_else(
        || "-".to_owned(),
        |e| serde_json::to_string(e).unwrap_or_default(),
    )
}

/// Problems as one line each.
fn problems_text(problems: &[Problem]) -> String {
    problems
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

/// The admin routes of the tenants.
pub fn router<S: BudgetStore + 'static>(tenants: Arc<Tenants<S>>) -> Router {
    Router::new()
        .route("/tenants", get(list::<S>))
        .route(
            "/tenants/workspaces/{name}",
            get(workspace::<S>)
                .put(put_workspace::<S>)
                .delete(remove_workspace::<S>),
        )
        .route(
            "/tenants/keys/{sha256}",
            axum::routing::put(put_key::<S>).delete(revoke_key::<S>),
        )
        .with_state(tenants)
}

async fn list<S: BudgetStore + 'static>(State(tenants): State<Arc<Tenants<S>>>) -> Response {
    Json(tenants.list()).into_response()
}

async fn workspace<S: BudgetStore + 'static>(
    State(tenants): State<Arc<Tenants<S>>>,
    UrlPath(name): UrlPath<String>,
) -> Response {
    let limiter = tenants.limiter.load();
    let policy = limiter.policy();
    let own = tenants
        .table
        .lock()
        .workspaces
        .get(&name)
        .cloned()
        .flatten();
    Json(serde_json::json!({
        "workspace": name,
        "plan": workspace_plan(policy, &name),
        "limits": limiter.workspace_limits(&name),
        "own_limits": own.map(|w| w.limits),
    }))
    .into_response()
}

async fn put_workspace<S: BudgetStore + 'static>(
    State(tenants): State<Arc<Tenants<S>>>,
    entrant: Option<axum::Extension<sluice_door::Entrant>>,
    UrlPath(name): UrlPath<String>,
    body: Result<ChangeBody<TenantWorkspace>, Response>,
) -> Response {
    let workspace = match body.map(|b| b.named_once(&format!("workspaces.{name}"))) {
        Ok(Ok(w)) => w,
        Ok(Err(twice)) => return answer(Err(twice)),
        Err(refused) => return refused,
    };
    answer(
        tenants
            .change(
                TenantChange::PutWorkspace { name, workspace },
                &who(entrant),
            )
            .await,
    )
}

async fn remove_workspace<S: BudgetStore + 'static>(
    State(tenants): State<Arc<Tenants<S>>>,
    entrant: Option<axum::Extension<sluice_door::Entrant>>,
    UrlPath(name): UrlPath<String>,
) -> Response {
    answer(
        tenants
            .change(
                TenantChange::RemoveWorkspace {
                    name,
                    revoked: None,
                },
                &who(entrant),
            )
            .await,
    )
}

async fn put_key<S: BudgetStore + 'static>(
    State(tenants): State<Arc<Tenants<S>>>,
    entrant: Option<axum::Extension<sluice_door::Entrant>>,
    UrlPath(sha256): UrlPath<String>,
    body: Result<ChangeBody<TenantKey>, Response>,
) -> Response {
    let key = match body.map(|b| b.named_once(&format!("keys.{sha256}"))) {
        Ok(Ok(k)) => k,
        Ok(Err(twice)) => return answer(Err(twice)),
        Err(refused) => return refused,
    };
    answer(
        tenants
            .change(TenantChange::PutKey { sha256, key }, &who(entrant))
            .await,
    )
}

async fn revoke_key<S: BudgetStore + 'static>(
    State(tenants): State<Arc<Tenants<S>>>,
    entrant: Option<axum::Extension<sluice_door::Entrant>>,
    UrlPath(sha256): UrlPath<String>,
) -> Response {
    answer(
        tenants
            .change(TenantChange::RevokeKey { sha256 }, &who(entrant))
            .await,
    )
}

fn who(entrant: Option<axum::Extension<sluice_door::Entrant>>) -> String {
    entrant.map_or_else(|| "unknown".to_owned(), |e| e.0.to_string())
}

/// The body of a change, read as a `T` as axum's `Json` reads it (its content type,
/// and the parser's message for a body that does not read), with the key path of a
/// key it names twice at any depth: serde refuses a field of a struct named twice,
/// but a map (`limits.classes`) would keep the last value.
struct ChangeBody<T> {
    value: T,
    twice: Option<String>,
}

impl<T> ChangeBody<T> {
    /// The change read, or, when it names a key twice, a problem at that key's path
    /// under `at` (`workspaces.<name>`, `keys.<sha256>`): readers differ on which
    /// value counts, so none is taken.
    fn named_once(self, at: &str) -> Result<T, ChangeError> {
        match self.twice {
            None => Ok(self.value),
            Some(path) => Err(ChangeError::Invalid(vec![Problem {
                path: format!("{at}.{path}"),
                message: "named twice in the body: readers differ on which value counts".to_owned(),
            }])),
        }
    }
}

impl<S, T> axum::extract::FromRequest<S> for ChangeBody<T>
where
    S: Send + Sync,
    T: serde::de::DeserializeOwned + Send,
{
    type Rejection = Response;

    async fn from_request(request: axum::extract::Request, state: &S) -> Result<Self, Response> {
        let (parts, body) = request.into_parts();
        let bytes = axum::body::Bytes::from_request(
            axum::extract::Request::from_parts(parts.clone(), body),
            state,
        )
        .await
        .map_err(|e| bad_body(&e.into()))?;
        let again =
            axum::extract::Request::from_parts(parts, axum::body::Body::from(bytes.clone()));
        let Json(value) = Json::<T>::from_request(again, state)
            .await
            .map_err(|e| bad_body(&e))?;
        Ok(ChangeBody {
            value,
            twice: sluice_policy::json::key_named_twice(&bytes),
        })
    }
}

/// 400 for a body that does not read as the change: the parser's message names the
/// field (an unknown one, a duplicate one, a negative number).
fn bad_body(rejection: &axum::extract::rejection::JsonRejection) -> Response {
    (
        StatusCode::BAD_REQUEST,
        Json(serde_json::json!({
            "error": { "code": "invalid_tenant", "message": rejection.body_text() }
        })),
    )
        .into_response()
}

fn answer(result: Result<(), ChangeError>) -> Response {
    match result {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(ChangeError::Invalid(problems)) => (
            StatusCode::BAD_REQUEST,
            Json(serde_json::json!({
                "error": {
                    "code": "invalid_tenant",
                    "message": "the change does not pass the policy's checks; nothing was changed",
                    "problems": problems.iter().map(|p| serde_json::json!({
                        "path": p.path, "message": p.message,
                    })).collect::<Vec<_>>(),
                }
            })),
        )
            .into_response(),
        Err(ChangeError::Unavailable(reason)) => (
            StatusCode::SERVICE_UNAVAILABLE,
            [(axum::http::header::RETRY_AFTER, "1")],
            Json(serde_json::json!({
                "error": {
                    "code": "store_unavailable",
                    // A shared store that took the change but whose answer was
                    // lost has made it: the table says which.
                    "message": format!("the change could not be confirmed durable and may not have been made; GET /tenants shows the table as it stands: {reason}"),
                }
            })),
        )
            .into_response(),
    }
}

#[cfg(test)]
mod tests {
    use axum::extract::FromRequest as _;

    use super::*;

    /// What the admin API answers to `body` as the change of workspace `acme`,
    /// before the change is made: `None` when it reads.
    async fn refusal(body: &str) -> Option<(StatusCode, serde_json::Value)> {
        let request = axum::extract::Request::builder()
            .method("PUT")
            .uri("/tenants/workspaces/acme")
            .header("content-type", "application/json")
            .body(axum::body::Body::from(body.to_owned()))
            .expect("request");
        let refused = match ChangeBody::<TenantWorkspace>::from_request(request, &()).await {
            Ok(read) => match read.named_once("workspaces.acme") {
                Ok(_) => return None,
                Err(twice) => answer(Err(twice)),
            },
            Err(refused) => refused,
        };
        let status = refused.status();
        let bytes = axum::body::to_bytes(refused.into_body(), 1 << 20)
            .await
            .expect("body");
        Some((status, serde_json::from_slice(&bytes).expect("json")))
    }

    #[tokio::test]
    async fn p4_a_change_naming_a_key_twice_at_any_depth_is_refused_at_its_key_path() {
        for (body, path) in [
            (
                r#"{"plan":"free","limits":{"classes":{"expensive":5,"expensive":500}}}"#,
                "workspaces.acme.limits.classes.expensive",
            ),
            (
                r#"{"limits":{"quotas":{"messages":1,"\u006dessages":2}}}"#,
                "workspaces.acme.limits.quotas.messages",
            ),
            (
                r#"{"limits":{"spend":{"team":1.5,"team":2}},"plan":"free"}"#,
                "workspaces.acme.limits.spend.team",
            ),
        ] {
            let (status, json) = refusal(body).await.expect("refused");
            assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {json}");
            assert_eq!(json["error"]["code"], "invalid_tenant", "{json}");
            assert_eq!(
                json["error"]["problems"],
                serde_json::json!([{
                    "path": path,
                    "message": "named twice in the body: readers differ on which value counts",
                }]),
                "{body}"
            );
        }
        // A field of a struct (at the top, of a lane): serde's message, as before.
        for (body, field) in [
            (r#"{"plan":"pro","plan":"free"}"#, "plan"),
            (
                r#"{"limits":{"lanes":{"l":{"workspace_starts":1,"workspace_starts":2}}}}"#,
                "workspace_starts",
            ),
        ] {
            let (status, json) = refusal(body).await.expect("refused");
            assert_eq!(status, StatusCode::BAD_REQUEST);
            assert!(
                json["error"]["message"]
                    .as_str()
                    .is_some_and(|m| m.contains(&format!("duplicate field `{field}`"))),
                "{json}"
            );
        }
        // Each key once: read, whatever the keys of other maps.
        let once =
            r#"{"plan":"free","limits":{"classes":{"expensive":5},"quotas":{"expensive":5}}}"#;
        assert!(refusal(once).await.is_none());
    }
}
