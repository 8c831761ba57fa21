//! The usage export for billing (SPEC O4): what each workspace spent, per day
//! (UTC) and model (or family, as the policy's `prices:` name it), counted in
//! the budget store beside the budgets themselves and listed by the admin
//! listener's `GET /usage/export?month=YYYY-MM` as JSON lines.
//!
//! A row is a day, a workspace and a model: `null` for a call with no model (a
//! route that is not an LLM call), the price's model or family for an LLM call,
//! `other` for an LLM call of a model with no price. Its counts, each a budget
//! kept until its month is dropped (as `/usage`'s are, [`USAGE_MONTHS_KEPT`]
//! months later):
//! - an LLM call: `calls`, `quota_units` (by quota family), `tokens` (`input`,
//!   `cached_input`, `output`) and money, charged with its settlement (at its
//!   usage, its reservation, or refunded: a call and its quota units either
//!   way), in the same store call (and the same script call on Redis) as
//!   `/usage`'s monthly counts, so the export's sums are `/usage`'s to the token
//!   and the money unit;
//! - any other call that spent a monthly quota: `calls` and `quota_units`, in
//!   one store call right after its decision (one round trip more than the
//!   decision; a crash between the two loses that call's row counts, never the
//!   quota's).
//!
//! A row is noted in its month's list the first time this process counts in it
//! (one store call, then remembered), when a call is admitted (an LLM call's
//! before it is forwarded, so its settlement waits on nothing more): a new
//! workspace, day or model costs one round trip more, once per process.
//!
//! The counts live where the budgets do (in this process, the embedded durable
//! store, or Redis shared by every replica), and so does the list of a month's
//! rows ([`BudgetStore::note_usage_row`]): every replica exports the same lines.
//!
//! # Bounds
//! A month keeps two lists of rows, each of at most [`MAX_USAGE_ROWS`]: the rows
//! of workspaces the policy names (a credential in the key table, a principal a
//! trusted auth layer named) and the rows of workspaces sluice made of an
//! unknown credential or an address ([`UNNAMED`]). Anyone can send a fresh
//! credential, each its own workspace: kept apart, such rows can fill only
//! their own list, never fold a named workspace's days into the overflow.
//! Past a list's bound, a new row's counts go to its day's and model's overflow
//! row (`"workspace": null`, `"overflow": true`, at most [`OVERFLOW_ROWS`] of
//! them a month and list), so the month's sums stay whole;
//! `sluice_usage_rows_full_total` counts the calls so folded. The export reads a page of at most [`EXPORT_PAGE`] rows at a time
//! and writes their lines before reading the next: the answer is streamed, never
//! held whole. Each process remembers at most [`KNOWN_ROWS`] rows it has noted
//! (to spare the store a call per request), and forgets them all past it.

use std::collections::HashSet;
use std::sync::Arc;

use parking_lot::Mutex;
use sluice_core::{Budget, BudgetKey, MAX_BUDGETS, Rate, Timestamp, digest};
use sluice_store::{BudgetStore, UsageRowBound};

use super::llm_usage::OTHER;
use super::{Limiter, QuotaQueryError, USAGE_MONTHS_KEPT, UsageMonth};
use crate::plan::{BudgetKind, Plan};

/// The most rows (workspace, day and model) a month's export lists.
pub const MAX_USAGE_ROWS: usize = 100_000;

/// The most overflow rows (day and model, no workspace) a month holds on top of
/// [`MAX_USAGE_ROWS`].
pub const OVERFLOW_ROWS: usize = 4_096;

/// The most rows a process remembers having noted (see the module's bounds).
pub const KNOWN_ROWS: usize = 65_536;

/// The suffix of the list of a month's rows of workspaces the policy does not
/// name (the store's period `<month>/unnamed`; named workspaces' rows are listed
/// under the month itself).
pub const UNNAMED: &str = "/unnamed";

/// Rows the export reads from the store at a time.
pub const EXPORT_PAGE: usize = 500;

/// The subject of the overflow rows' counts (no workspace's digest).
const OVERFLOW_SUBJECT: u64 = 0x7573_6167_652d_6f76; // "usage-ov"

/// The counts of a row other than quota units, in the order the export reads them.
const FIELDS: [&str; 5] = ["calls", "input", "cached_input", "output", "spend"];

/// Shards of [`KnownRows`]: every metered call looks its row up, from every
/// worker thread.
const KNOWN_SHARDS: usize = 16;

/// The rows this process has noted, by digest, in shards by digest (see
/// [`KNOWN_ROWS`]: each shard holds at most its share, and forgets them all past
/// it).
#[derive(Debug, Default)]
pub(crate) struct KnownRows([Mutex<HashSet<u64>>; KNOWN_SHARDS]);

impl KnownRows {
    fn shard(&self, row: u64) -> &Mutex<HashSet<u64>> {
        // KNOWN_SHARDS divides 2^64: the low bits of the digest pick the shard.
        &self.0[(row % KNOWN_SHARDS as u64) as usize]
    }

    fn knows(&self, row: u64) -> bool {
        self.shard(row).lock().contains(&row)
    }

    fn learn(&self, row: u64) {
        let mut rows = self.shard(row).lock();
        if rows.len() >= KNOWN_ROWS / KNOWN_SHARDS {
            rows.clear();
        }
        rows.insert(row);
    }
}

/// A row as its counts are keyed: its day, model and the workspace's subject
/// digest.
/// The most settlements' names [`UsageNames`] keeps before it starts over.
const NAMED: usize = 4_096;

/// The names an LLM call's settlement charges its counts under, worked out
/// once per workspace, model and day rather than formatted and hashed again
/// on every call: the row's, and `/usage`'s monthly counts by direction.
#[derive(Debug)]
pub(super) struct Names {
    row: Arc<RowNames>,
    /// The row's digest in [`KnownRows`].
    known: u64,
    /// The row's own name, as the store notes it.
    own: String,
    /// `/usage`'s counts of the model's directions (`llm_usage::DIRECTIONS`).
    pub(super) directions: [u64; 4],
}

/// The names of the counts of the rows of one day and model.
#[derive(Debug)]
struct RowNames {
    month: UsageMonth,
    day: String,
    /// The row's model (`None` for a call not on an LLM route).
    model: Option<String>,
    /// The counts of [`FIELDS`], by index.
    fields: [u64; FIELDS.len()],
}

impl RowNames {
    fn new(month: UsageMonth, day: String, model: Option<String>) -> Arc<RowNames> {
        Arc::new(RowNames {
            fields: FIELDS.map(|f| field_digest(&day, model.as_deref(), f)),
            month,
            day,
            model,
        })
    }
}

/// What [`Names`] are of: a workspace (its digest), a price (the policy's
/// index), whether the call is on an LLM route, and a day (since 1970).
type NamesOf = (u64, Option<u16>, bool, u64);

/// [`Names`] by workspace (its digest), price (the policy's index) and day,
/// at most [`NAMED`].
#[derive(Debug, Default)]
pub(crate) struct UsageNames(Mutex<std::collections::HashMap<NamesOf, Arc<Names>>>);

#[derive(Clone, Debug)]
struct RowKey {
    names: Arc<RowNames>,
    subject: u64,
}

impl RowKey {
    /// The count of `field` of this row, charged `n`.
    fn counter(&self, field: &str, n: u32) -> Budget {
        let named = FIELDS
            .iter()
            .position(|f| *f == field)
            .map(|i| self.names.fields[i]);
        let name = named
            .unwrap_or_else(|| field_digest(&self.names.day, self.names.model.as_deref(), field));
        Budget {
            key: BudgetKey::from_digests(name, self.subject),
            rate: Rate::until(self.names.month.kept_until()),
            limit: u32::MAX,
            cost: n,
        }
    }
}

/// The digest naming the count of `field` of the rows of `day` and `model`.
fn field_digest(day: &str, model: Option<&str>, field: &str) -> u64 {
    let model = model.unwrap_or("-");
    digest(format!("usage-row:{day}:{model}:{field}").as_bytes())
}

fn day_of(t: Timestamp) -> String {
    let secs = i64::try_from(t.as_secs()).unwrap_or(i64::MAX);
    jiff::Timestamp::from_second(secs)
        .map(|ts| jiff::tz::Offset::UTC.to_datetime(ts).date().to_string())
        .unwrap_or_else(|_| "9999-12-31".to_owned())
}

/// The store's period of the list `month`'s rows of named workspaces (`named`)
/// or of the others are noted in (see the module's bounds).
fn list_of(month: super::UsageMonth, named: bool) -> String {
    if named {
        month.to_string()
    } else {
        format!("{month}{UNNAMED}")
    }
}

/// A row's name in its month's list: `["<day>","<workspace>"|null,"<model>"|null]`.
fn row_name(day: &str, workspace: Option<&str>, model: Option<&str>) -> String {
    serde_json::json!([day, workspace, model]).to_string()
}

/// What the export reads of a row's name.
fn parse_row(name: &str) -> Option<(String, Option<String>, Option<String>)> {
    let v: (String, Option<String>, Option<String>) = serde_json::from_str(name).ok()?;
    Some(v)
}

impl<S: BudgetStore> Limiter<S> {
    /// The row of an admitted `plan`'s call, decided at `at`, noted in its month
    /// (once per process, then remembered): its workspace's, or its day's and
    /// model's overflow row when the month is full. `None` when the store could
    /// not note it (the counts are then not charged; counted in
    /// `sluice_usage_export_failures_total`).
    async fn usage_row(&self, plan: &Plan, at: Timestamp) -> Option<RowKey> {
        let names = self.usage_names(plan, at);
        let key = |subject| RowKey {
            names: Arc::clone(&names.row),
            subject,
        };
        if self.usage_rows.knows(names.known) {
            return Some(key(plan.from.workspace));
        }
        let row = &names.row;
        let (month, day, model) = (row.month, &row.day, row.model.as_deref());
        let (own, known) = (&names.own, names.known);
        let period = list_of(month, plan.from.principal.is_some());
        let bound = UsageRowBound {
            max_rows: MAX_USAGE_ROWS,
            kept_until: month.kept_until(),
        };
        match self.store.note_usage_row(&period, own, bound).await {
            Ok(true) => {
                self.usage_rows.learn(known);
                return Some(key(plan.from.workspace));
            }
            Ok(false) => {}
            Err(_) => {
                metrics::counter!("sluice_usage_export_failures_total").increment(1);
                return None;
            }
        }
        metrics::counter!("sluice_usage_rows_full_total").increment(1);
        let overflow = row_name(day, None, model);
        let bound = UsageRowBound {
            max_rows: MAX_USAGE_ROWS + OVERFLOW_ROWS,
            ..bound
        };
        match self.store.note_usage_row(&period, &overflow, bound).await {
            Ok(true) => Some(key(OVERFLOW_SUBJECT)),
            _ => {
                metrics::counter!("sluice_usage_export_failures_total").increment(1);
                None
            }
        }
    }

    /// The units an admitted `plan` spent of each monthly quota (by family name),
    /// those not zero: what its decision charged, less a shadowed budget that
    /// would have refused (it spent nothing).
    fn quota_units<'p>(&'p self, plan: &Plan) -> Vec<(&'p str, u32)> {
        plan.budgets
            .iter()
            .zip(&plan.kinds)
            .enumerate()
            .filter(|(i, (b, _))| plan.shadowed & (1 << i) == 0 && b.cost > 0)
            .filter_map(|(_, (b, k))| match k {
                BudgetKind::Quota(q) => self
                    .policy
                    .quotas
                    .get(crate::plan::policy_index(*q))
                    .map(|f| (f.name.as_str(), b.cost)),
                _ => None,
            })
            .collect()
    }

    /// SPEC O4: counts an admitted call that spent a monthly quota and is not an
    /// LLM call (an LLM call is counted with its settlement, see
    /// [`Limiter::usage_row_counts`]) in its usage row — one call, and the units
    /// it spent of each quota — in one store call right after its decision. A
    /// count the store cannot take is lost, and counted in
    /// `sluice_usage_export_failures_total`.
    pub(super) async fn count_admitted(&self, plan: &Plan, decided_at: Timestamp) {
        if plan.llm.is_some() {
            // Its row is noted now, before it is forwarded, so that its settlement
            // (which the answer's end waits for) finds it known.
            let _ = self.usage_row(plan, decided_at).await;
            return;
        }
        let quotas = self.quota_units(plan);
        if quotas.is_empty() {
            return;
        }
        let Some(row) = self.usage_row(plan, decided_at).await else {
            return;
        };
        let changes: Vec<(Budget, i64)> = std::iter::once(row.counter("calls", 1))
            .chain(
                quotas
                    .iter()
                    .map(|(family, n)| row.counter(&format!("quota:{family}"), *n)),
            )
            .map(|b| (b, i64::from(b.cost)))
            .collect();
        if self
            .store
            .adjust_all_from(&changes, decided_at, plan.network)
            .await
            .is_err()
        {
            metrics::counter!("sluice_usage_export_failures_total").increment(1);
        }
    }

    /// The counts of a settled LLM call in its usage row, each with its count as
    /// its cost: one call, the units it spent of each monthly quota, and — from
    /// its usage, when there is one (`amounts`, see [`Limiter::usage_amounts`]) —
    /// tokens by direction and money units, those not zero. Charged with the
    /// settlement, in the same store call as `/usage`'s monthly counts. Empty
    /// when the row could not be noted.
    /// The [`Names`] of the counts a call of `plan` admitted at `at` charges
    /// (worked out once per workspace, model and day).
    pub(super) fn usage_names(&self, plan: &Plan, at: Timestamp) -> Arc<Names> {
        let memo = (
            plan.from.workspace,
            plan.price,
            plan.llm.is_some(),
            at.as_secs() / 86_400,
        );
        if let Some(names) = self.usage_names.0.lock().get(&memo) {
            return Arc::clone(names);
        }
        let month = UsageMonth::of(at);
        let day = day_of(at);
        let priced = plan
            .price
            .and_then(|i| self.policy.prices.get(usize::from(i)))
            .map_or(OTHER, |p| p.model.as_str());
        let model = plan.llm.map(|_| priced.to_owned());
        let own = row_name(&day, Some(&plan.from.workspace_label()), model.as_deref());
        let names = Arc::new(Names {
            known: digest(format!("{month}\n{own}").as_bytes()),
            directions: super::llm_usage::direction_digests(month, priced),
            own,
            row: RowNames::new(month, day, model),
        });
        let mut named = self.usage_names.0.lock();
        if named.len() >= NAMED {
            named.clear();
        }
        named.insert(memo, Arc::clone(&names));
        names
    }

    pub(super) async fn usage_row_counts(
        &self,
        plan: &Plan,
        amounts: Option<[u32; 4]>,
        admitted_at: Timestamp,
    ) -> Vec<Budget> {
        let Some(row) = self.usage_row(plan, admitted_at).await else {
            return Vec::new();
        };
        let mut counts = vec![row.counter("calls", 1)];
        if let Some(amounts) = amounts {
            counts.extend(
                FIELDS[1..]
                    .iter()
                    .zip(amounts)
                    .filter(|(_, n)| *n > 0)
                    .map(|(field, n)| row.counter(field, n)),
            );
        }
        counts.extend(
            self.quota_units(plan)
                .iter()
                .map(|(family, n)| row.counter(&format!("quota:{family}"), *n)),
        );
        counts
    }

    /// The month an export asks for: `None` is the current one, on the store's
    /// clock (which says what month a call counts in; one store call).
    ///
    /// # Errors
    /// [`QuotaQueryError::FutureMonth`] and [`QuotaQueryError::MonthNotKept`], as
    /// `/usage` answers them; [`QuotaQueryError::Store`] when the store cannot
    /// answer.
    pub async fn usage_export_month(
        &self,
        month: Option<UsageMonth>,
    ) -> Result<UsageMonth, QuotaQueryError> {
        let current = UsageMonth::of(self.store.peek(&[]).await?.decided_at());
        match month {
            None => Ok(current),
            Some(m) if m > current => Err(QuotaQueryError::FutureMonth(m)),
            Some(m) if !m.kept_in(current) => Err(QuotaQueryError::MonthNotKept(m)),
            Some(m) => Ok(m),
        }
    }

    /// The JSON lines of one page of `export` (see [`UsageExport`]): `None` once
    /// every row has been written.
    ///
    /// # Errors
    /// [`QuotaQueryError::Store`] when the store cannot answer.
    pub async fn usage_export_page(
        &self,
        export: &mut UsageExport,
    ) -> Result<Option<String>, QuotaQueryError> {
        if export.done {
            return Ok(None);
        }
        // The named workspaces' list, then the others'.
        let page = self
            .store
            .usage_rows(
                &list_of(export.month, !export.unnamed),
                export.cursor.as_deref(),
                EXPORT_PAGE,
            )
            .await?;
        export.cursor = page.next;
        if export.cursor.is_none() {
            export.done = export.unnamed;
            export.unnamed = true;
        }
        let families: Vec<&str> = self.policy.quotas.iter().map(|f| f.name.as_str()).collect();
        let mut out = String::new();
        for name in page.rows {
            // A row given twice (a Redis set read while it grew) is written once.
            if !export.seen.insert(digest(name.as_bytes())) {
                continue;
            }
            let Some((day, workspace, model)) = parse_row(&name) else {
                continue;
            };
            let subject = match &workspace {
                Some(w) => match self.policy.identity.workspace_subject(w) {
                    Some(s) => s,
                    None => continue,
                },
                None => OVERFLOW_SUBJECT,
            };
            let row = RowKey {
                names: RowNames::new(export.month, day.clone(), model.clone()),
                subject,
            };
            let budgets: Vec<Budget> = FIELDS
                .iter()
                .map(|f| (*f).to_owned())
                .chain(families.iter().map(|f| format!("quota:{f}")))
                .map(|f| row.counter(&f, 0))
                .collect();
            let mut used = Vec::with_capacity(budgets.len());
            for part in budgets.chunks(MAX_BUDGETS) {
                let decision = self.store.peek(part).await?;
                used.extend(
                    decision
                        .statuses()
                        .iter()
                        .map(|s| u64::from(s.limit - s.remaining)),
                );
            }
            if used.iter().all(|&n| n == 0) {
                continue;
            }
            let count = |i: usize| used.get(i).copied().unwrap_or(0);
            let quota_units: serde_json::Map<String, serde_json::Value> = families
                .iter()
                .enumerate()
                .filter(|(i, _)| count(FIELDS.len() + i) > 0)
                .map(|(i, f)| ((*f).to_owned(), count(FIELDS.len() + i).into()))
                .collect();
            let mut line = serde_json::json!({
                "workspace": workspace,
                "day": day,
                "model": model,
                "calls": count(0),
                "quota_units": quota_units,
                "tokens": {"input": count(1), "cached_input": count(2), "output": count(3)},
                "spend_units": count(4),
                "spend_usd": count(4) as f64 / sluice_policy::MONEY_UNITS_PER_USD as f64,
            });
            if workspace.is_none()
                && let Some(o) = line.as_object_mut()
            {
                o.insert("overflow".to_owned(), true.into());
            }
            out.push_str(&line.to_string());
            out.push('\n');
        }
        Ok(Some(out))
    }
}

/// Where an export of a month's usage stands (see
/// [`Limiter::usage_export_page`]): the month, the list being read and the
/// store's cursor in it, and the rows already written (at most twice
/// [`MAX_USAGE_ROWS`] + [`OVERFLOW_ROWS`] digests: an overflow row may be in
/// both lists, and is written once).
#[derive(Debug)]
pub struct UsageExport {
    month: UsageMonth,
    /// Reading the list of workspaces the policy does not name.
    unnamed: bool,
    cursor: Option<String>,
    seen: HashSet<u64>,
    done: bool,
}

impl UsageExport {
    /// An export of `month`, from its first row.
    pub fn new(month: UsageMonth) -> Self {
        UsageExport {
            month,
            unnamed: false,
            cursor: None,
            seen: HashSet::new(),
            done: false,
        }
    }

    /// The month it exports.
    pub fn month(&self) -> UsageMonth {
        self.month
    }
}

// The months an export can read are the months `/usage` keeps.
const _: () = assert!(USAGE_MONTHS_KEPT >= 1);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_day_is_the_utc_date_of_its_second() {
        // 2026-12-04T23:59:59Z and the second after.
        assert_eq!(day_of(Timestamp::from_secs(1_796_428_799)), "2026-12-04");
        assert_eq!(day_of(Timestamp::from_secs(1_796_428_800)), "2026-12-05");
    }

    #[test]
    fn row_names_read_back_whatever_a_workspace_is_named() {
        for w in ["acme", "a\"b\\c\td", "key:00ff", "ip:10.0.0.1", ""] {
            let name = row_name("2026-12-04", Some(w), Some("gpt-4o*"));
            assert_eq!(
                parse_row(&name),
                Some((
                    "2026-12-04".to_owned(),
                    Some(w.to_owned()),
                    Some("gpt-4o*".to_owned())
                ))
            );
        }
        assert_eq!(
            parse_row(&row_name("2026-12-04", None, None)),
            Some(("2026-12-04".to_owned(), None, None))
        );
    }
}
