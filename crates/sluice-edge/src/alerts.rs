//! Alerts (SPEC O3): when an admitted or settled call leaves a budget an
//! `alerts:` entry watches at or past one of its thresholds, the edge makes an
//! [`AlertEvent`] and hands it to an [`AlertSink`] — the gateway's outbox, which
//! keeps it (durably) and delivers it to the webhook in the background. An
//! event is one per alert, budget subject (the workspace, for a workspace's
//! budget), budget, threshold and period: its [`AlertEvent::id`] is a digest of
//! those, so a sink drops one it already has.
//!
//! The request that crossed a threshold waits only for the sink to keep the
//! event (a durable write, once per event); the delivery never delays a
//! request.

use std::future::Future;
use std::pin::Pin;

use sluice_core::{BudgetStatus, Timestamp, digest};

/// One event of an alert (see the module).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct AlertEvent {
    /// Its identity: the same for the same alert, subject, budget, threshold and
    /// period (16 hex digits).
    pub id: String,
    /// The alert's index in the policy's `alerts:`.
    pub alert: usize,
    /// The workspace of the call that crossed the threshold, as
    /// `X-Sluice-Workspace` names it.
    pub workspace: String,
    /// The budget's name (a quota family, token or money budget).
    pub budget: String,
    /// The threshold passed, in thousandths of the limit.
    pub threshold_permille: u16,
    /// Units of the budget spent when it was passed.
    pub used: u64,
    /// The budget's limit.
    pub limit: u64,
    /// Unix second its period (window or month) ends at.
    pub period_ends_at: u64,
    /// Unix second it was passed at (the store's clock).
    pub at: u64,
}

impl AlertEvent {
    /// The JSON body the webhook is sent.
    pub fn body(&self) -> String {
        serde_json::json!({
            "type": "budget.threshold",
            "id": self.id,
            "workspace": self.workspace,
            "budget": self.budget,
            "threshold": f64::from(self.threshold_permille) / 1000.0,
            "used": self.used,
            "limit": self.limit,
            "period_ends_at": self.period_ends_at,
            "at": self.at,
        })
        .to_string()
    }
}

/// Where the edge hands its alert events (the gateway's outbox).
pub trait AlertSink: Send + Sync {
    /// True when the sink already holds (or held) event `id`: checked before an
    /// event is offered, without I/O.
    fn knows(&self, id: &str) -> bool;

    /// Keeps `event` for delivery, once (an event it already has is dropped);
    /// returns once it is kept (on disk, for a durable sink). Never waits for a
    /// delivery.
    fn offer<'a>(&'a self, event: AlertEvent) -> Pin<Box<dyn Future<Output = ()> + Send + 'a>>;
}

/// The events `statuses` (of the budgets of `plan`, after its call) make for
/// `policy`'s alerts, at `at` — one per alert, watched budget and threshold
/// passed; a budget in shadow mode that would have refused spent nothing and
/// makes none.
pub(crate) fn events(
    policy: &sluice_policy::Policy,
    plan: &crate::Plan,
    statuses: &[BudgetStatus],
    at: Timestamp,
) -> Vec<AlertEvent> {
    let mut out = Vec::new();
    if policy.alerts.is_empty() {
        return out;
    }
    for (i, s) in statuses.iter().enumerate() {
        if plan.shadowed & (1 << i) != 0 || s.limit == u32::MAX || s.limit == 0 {
            continue;
        }
        let name = plan.name(i, policy);
        let Some(budget) = plan.budgets.get(i) else {
            continue;
        };
        let used = u64::from(s.limit.saturating_sub(s.remaining));
        for (n, alert) in policy.alerts.iter().enumerate() {
            if !alert.budgets.iter().any(|b| b == name) {
                continue;
            }
            for &p in &alert.at_permille {
                if used * 1000 < u64::from(p) * u64::from(s.limit) {
                    continue;
                }
                let id = digest(
                    format!(
                        "alert:{n}:{name}:{:016x}:{p}:{}",
                        budget.key.subject(),
                        s.reset
                    )
                    .as_bytes(),
                );
                out.push(AlertEvent {
                    id: format!("{id:016x}"),
                    alert: n,
                    workspace: plan.from.workspace_label(),
                    budget: name.to_owned(),
                    threshold_permille: p,
                    used,
                    limit: u64::from(s.limit),
                    period_ends_at: s.reset,
                    at: at.as_secs(),
                });
            }
        }
    }
    out
}
