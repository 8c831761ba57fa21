//! Planning: every budget a routed request touches.

use std::net::IpAddr;

use http::HeaderMap;
use sluice_policy::{Items, LaneBatch, Route, RouteClass};
use sluice_store::BudgetStore;

use super::{Limiter, Refused};
use crate::plan::{Plan, plan};

impl<S: BudgetStore> Limiter<S> {
    /// The budgets of a request with `headers` from `peer` on `route` (see
    /// [`Limiter::route_head`]), with `body` when its route takes its class from
    /// it (`None` for one past the bound: it counts as one item of the default
    /// class, and is answered 413 once decided), and the caller named by `key`
    /// when there is one (see
    /// [`Identity::keyed_caller`](sluice_policy::Identity::keyed_caller)) instead
    /// of the credential or address the policy reads; per-IP ceilings still apply
    /// to the client address. Of the headers only those
    /// [`Limiter::read_headers`] names are read. Reached through
    /// [`crate::Intake::planned`].
    ///
    /// # Errors
    /// [`Refused::Credentials`] for a request that sends one kind of credential more
    /// than once (see [`Identity::check_credentials`](sluice_policy::Identity::check_credentials));
    /// [`Refused::Body`] for a request on a JSON-RPC route whose body cannot be
    /// classified: one sent with a `Content-Encoding` other than `identity`, or one
    /// [`JsonRpc::classify`](sluice_policy::JsonRpc::classify) cannot count;
    /// [`Refused::Revoked`], [`Refused::UnknownPlan`], [`Refused::Batch`].
    pub(crate) fn plan_request(
        &self,
        headers: &HeaderMap,
        peer: IpAddr,
        route: Option<&Route>,
        body: Option<&[u8]>,
        (key, path): (Option<&[u8]>, &str),
    ) -> Result<Box<Plan>, Refused> {
        let policy = &self.policy;
        // Charged as the upstream reads the credential, or not at all.
        policy.identity.check_credentials(headers)?;
        let mut items = match route.map(|r| &r.class) {
            Some(RouteClass::Fixed(c)) => Items::one(*c),
            Some(RouteClass::JsonRpc) => {
                sluice_policy::check_content_encoding(headers)?;
                match body {
                    Some(b) => {
                        let mut items = policy.jsonrpc.classify(b, &policy.bounds)?;
                        // A batch submit tool: its items count against the single
                        // call's quota now, as a REST submit's do.
                        if let Some(call) = crate::batch_tool_call(policy, b)?
                            && let crate::BatchTool::Submit(l) = call.tool
                            && let Some(batch) = policy.lanes.get(l).and_then(|l| l.batch.as_ref())
                        {
                            let args = serde_json::to_vec(&call.arguments).unwrap_or_default();
                            count_batch_items(&mut items, batch, &args)?;
                        }
                        items
                    }
                    None => Items::one(policy.jsonrpc.default_class),
                }
            }
            None => Items::one(policy.default_class),
        };
        let identity = &policy.identity;
        let client = identity.client_ip(peer, headers);
        let caller = match key {
            Some(key) => identity.keyed_caller(key),
            None => identity.caller(headers, &client, identity.trusts(peer)),
        };
        // A revoked credential is refused, never counted as a caller of its own.
        if !identity.revoked.is_empty()
            && caller
                .credential_sha256
                .is_some_and(|sha| identity.revoked.contains(&sha))
        {
            return Err(Refused::Revoked);
        }
        if caller.plan.is_some() && policy.plan_for(&caller).is_err() {
            return Err(Refused::UnknownPlan);
        }
        if let Some(route) = route {
            // No allocation per request: the route's own slice.
            items.spend(&route.buckets, route.quota);
            items.call_lane(route.lane);
            // A batch submit: its items count against the single call's quota now,
            // and a body that cannot be queued is refused before anything is decided.
            if let Some(sluice_policy::BatchEndpoint::Submit(l)) = route.batch
                && let Some(batch) = policy.lanes.get(l).and_then(|l| l.batch.as_ref())
            {
                // No body: it was larger than `limits.max_body_bytes`, and the
                // layer answers 413 `payload_too_large` (as on a JSON-RPC route)
                // once the submit's own class is decided; nothing is queued.
                if let Some(body) = body {
                    // Checked before parsing, as a JSON-RPC body is: the parser
                    // never recurses past the bound.
                    if sluice_policy::depth_exceeds(body, policy.bounds.max_json_depth) {
                        return Err(Refused::Body(sluice_policy::Unclassifiable::TooDeep {
                            max_json_depth: policy.bounds.max_json_depth,
                        }));
                    }
                    count_batch_items(&mut items, batch, body)?;
                }
            }
        }
        let lane = items
            .lanes_called()
            .next()
            .map(|(lane, _)| crate::LaneCall {
                lane,
                jsonrpc: matches!(route.map(|r| &r.class), Some(RouteClass::JsonRpc)),
                calls: items.lanes_called().map(|(_, n)| u32::from(n)).sum(),
            });
        // An LLM call: what its token budgets reserve, from its body (none for
        // one past the bound: it is answered 413 once decided).
        let llm = route.and_then(|r| r.llm);
        if llm.is_some() {
            // Counted as sent, or not at all: a compressed body cannot be read.
            sluice_policy::check_content_encoding(headers)?;
        }
        // The tokens are estimated only for a route with a token or money budget.
        let counted = route.is_some_and(|r| {
            r.buckets
                .iter()
                .any(|&b| policy.buckets.get(b).is_some_and(|b| b.tokens.is_some()))
        });
        let reservation = match (llm, body) {
            (Some(format), Some(body)) => Some(crate::tokens::Reservation::of(
                format,
                path,
                body,
                (&policy.prices, counted),
            )?),
            _ => None,
        };
        // A money budget needs the model's price: a call of a model with none is
        // refused, never counted at no cost.
        let priced = route.is_some_and(|r| {
            r.buckets.iter().any(|&b| {
                policy
                    .buckets
                    .get(b)
                    .and_then(|b| b.tokens)
                    .is_some_and(|t| t.priced)
            })
        });
        if priced && reservation.is_some_and(|r| r.price.is_none()) {
            return Err(Refused::UnpricedModel);
        }
        let mode = route.map_or(sluice_policy::Enforcement::Enforce, |r| r.mode);
        let mut plan = plan(
            policy,
            &self.scopes,
            (&items, reservation.as_ref()),
            caller,
            &client,
            mode,
        );
        plan.lane = lane;
        plan.llm = llm;
        plan.price = reservation.and_then(|r| r.price);
        plan.reservation = reservation;
        // A turn of an agent run: its turns decided with the call's budgets.
        if let Some(run) = crate::runs::run_of(policy, headers, (route, body, path), plan.caller)? {
            let shadow = policy.dry_run || mode == sluice_policy::Enforcement::Shadow;
            crate::runs::push(&mut plan, policy, run, shadow);
        }
        Ok(plan)
    }
}

/// Counts a batch submit's items (`body`: the submit's JSON, `{"items": [...]}`)
/// against its single call's monthly quota now, as they are admitted, REST submit
/// or batch tool alike; nothing is queued yet.
///
/// # Errors
/// [`Refused::Batch`] for a body that cannot be queued.
fn count_batch_items(items: &mut Items, batch: &LaneBatch, body: &[u8]) -> Result<(), Refused> {
    let submit = crate::parse_batch(body, batch.max_items.get())?;
    if let Some(q) = batch.quota
        && let Some(units) = items.quotas.get_mut(q)
    {
        let n = u32::try_from(submit.items.len()).unwrap_or(u32::MAX);
        *units = units.saturating_add(n);
    }
    Ok(())
}
