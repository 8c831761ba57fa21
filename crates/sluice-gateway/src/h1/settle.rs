//! An LLM call's answer on the fast path, read for its `usage` as it is relayed
//! (never held whole) and its token budgets settled when it ends (SPEC T3), as the
//! service stack's `Settling` body does: the answer's last bytes reach the client
//! only once the settlement is in the store, so a client that read its answer to
//! the end finds it counted in its next call. An answer cut short (the upstream or
//! the client left) is settled with what was seen of it; one whose relay is dropped
//! unfinished (a drain's end) is settled on the runtime as it is dropped.

use std::sync::Arc;

use sluice_core::Decision;
use sluice_edge::tokens::UsageChunkFilter;
use sluice_edge::{Limiter, Plan};
use sluice_tokens::UsageScanner;

use crate::store::AnyStore;

/// An LLM call admitted on the fast path, to be settled at its answer's `usage`.
pub(super) struct Settlement {
    limiter: Arc<Limiter<AnyStore>>,
    plan: Box<Plan>,
    /// `None` once settled.
    decision: Option<Decision>,
    /// The answer's status is an error: without a `usage`, the reservation is
    /// given back.
    failed: bool,
    /// Reads the answer's `usage` as its body (without its framing) passes.
    pub(super) scanner: UsageScanner,
    /// Removes the usage-only chunk sluice asked for, which the client did not.
    pub(super) hide: Option<UsageChunkFilter>,
}

impl Settlement {
    /// The settlement of the call `plan` admitted by `decision`, whose answer has
    /// `status` and `Content-Type` `content_type`; `hide`: its usage-only chunk is
    /// sluice's, not the client's.
    pub(super) fn new(
        limiter: Arc<Limiter<AnyStore>>,
        (plan, decision): (Box<Plan>, Decision),
        status: u16,
        content_type: Option<&str>,
        hide: bool,
    ) -> Self {
        Settlement {
            limiter,
            plan,
            decision: Some(decision),
            failed: status >= 400,
            scanner: UsageScanner::new(content_type),
            hide: hide.then(UsageChunkFilter::default),
        }
    }

    /// Settles the call with the usage seen (nothing when it is settled already).
    pub(super) async fn settle(&mut self) {
        if let Some(decision) = self.decision.take() {
            let usage = self.scanner.finish();
            self.limiter
                .settle_usage(&self.plan, decision, usage, self.failed)
                .await;
        }
    }
}

impl Drop for Settlement {
    fn drop(&mut self) {
        let Some(decision) = self.decision.take() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let usage = self.scanner.finish();
        let (limiter, plan, failed) = (Arc::clone(&self.limiter), self.plan.clone(), self.failed);
        runtime.spawn(async move {
            limiter.settle_usage(&plan, decision, usage, failed).await;
        });
    }
}
