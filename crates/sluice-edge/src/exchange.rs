//! The phase contract every transport follows, after pingora's `ProxyHttp` phases:
//! **head checked → body read → planned → admitted → upstream head → response head
//! → logged**. A transport does only its own I/O around these calls (parsing,
//! reading, writing, connecting); what is decided, in what order, and what the
//! client is told is the edge's, the same for each.
//!
//! 1. *Head checked*: [`Limiter::route_head`] — [`check_head`](crate::check_head),
//!    the path in its normal form ([`Limiter::normalize_target`] or
//!    [`Limiter::normalize_path`]), then the route — in one refusal order; its
//!    outcome starts an [`Intake`](crate::Intake), which answers a refused head at
//!    once ([`Intake::refused`](crate::Intake::refused)).
//! 2. *Body read*: the intake says whether the route takes its class from the
//!    body and how much of it may be held, leases it, and keeps the deadline; the
//!    transport reads into it (or hands it each frame) and it says what it got as
//!    a [`BodyRead`].
//! 3. *Planned*: [`Intake::planned`](crate::Intake::planned) names every budget of the request.
//! 4. *Admitted*: [`Planned::admit`] waits for a lane place where one is needed,
//!    decides every budget at once, and hands back a [`Forward`] or the answer to
//!    send instead (every refusal is rendered by [`Limiter::answer`]).
//! 5. *Upstream head*: [`Forward::for_each_upstream_header`] (or
//!    [`Forward::upstream_headers`]) says who the request is from, and
//!    [`Forward::upstream_timeout`] how long the upstream may take.
//! 6. *Response head*: [`Forward::response_head`] (or, for a transport that writes
//!    the head itself, [`Forward::settle`] and [`Forward::finish`]) charges what a
//!    weighted call reported, ends the lane place with the call's outcome, and
//!    writes `X-RateLimit-*`; [`Forward::upstream_failed`] when no head came.
//! 7. *Logged*: refusals were logged in phase 4 ([`Planned::admit`]); the
//!    access line is the transport's, with the status it sent. With a tracer
//!    installed ([`crate::trace`], SPEC O1) phase 4 starts the request's span,
//!    phase 5 sends its `traceparent` upstream and it ends with the [`Forward`].

use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, HeaderName, Response};
use http_body_util::Full;
use sluice_core::Decision;
use sluice_policy::{Route, RouteClass};
use sluice_store::BudgetStore;

use crate::trace::RequestSpan;
use crate::{LanePlace, Limiter, Plan, Refused, RequestId};

/// What a transport read of a request's body (phase 2; see [`Limiter::body_bound`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BodyRead<'b> {
    /// The route does not take its class from the body: it is not read here (it
    /// streams to the upstream, or was read for the transport's own reasons).
    NotNeeded,
    /// The whole body, within the bound.
    Whole(&'b [u8]),
    /// Longer than the policy's `limits.max_body_bytes`: decided as one call of the
    /// route's default class, then answered 413 (see [`Planned::admit`]).
    TooLarge,
}

impl<S: BudgetStore> Limiter<S> {
    /// Phase 2: the most body bytes a request on `route` must be read in whole
    /// before it can be planned (the policy's `limits.max_body_bytes`), or `None`
    /// when its route does not take its class from the body.
    pub fn body_bound(&self, route: Option<&Route>) -> Option<usize> {
        Self::needs_body(route).then_some(self.policy().bounds.max_body_bytes)
    }

    /// Phase 3: the budgets of a request with `headers` from `peer`, on the route (or
    /// the head's refusal) of phase 1, with the body of phase 2; `key` names the
    /// caller instead of its credential (see [`crate::Intake::planned`]).
    pub(crate) fn planned<'l, 'b>(
        &'l self,
        headers: &HeaderMap,
        peer: IpAddr,
        route: Result<Option<&Route>, Refused>,
        body: BodyRead<'b>,
        key: Option<&[u8]>,
        path: &str,
    ) -> Planned<'l, 'b, S> {
        let jsonrpc = route
            .as_ref()
            .is_ok_and(|r| r.is_some_and(|r| r.class == RouteClass::JsonRpc));
        let bytes = match body {
            BodyRead::Whole(bytes) => Some(bytes),
            BodyRead::NotNeeded | BodyRead::TooLarge => None,
        };
        let plan =
            route.and_then(|route| self.plan_request(headers, peer, route, bytes, (key, path)));
        Planned {
            limiter: self,
            plan,
            jsonrpc_body: bytes.filter(|_| jsonrpc),
            too_large: (body == BodyRead::TooLarge).then_some(jsonrpc),
            parent: crate::trace::parent_of(headers).map(Box::new),
        }
    }
}

/// A planned request (phase 3), to be admitted.
pub struct Planned<'l, 'b, S> {
    limiter: &'l Limiter<S>,
    plan: Result<Box<Plan>, Refused>,
    /// The body of a request on a JSON-RPC route: its refusals answer as JSON-RPC.
    jsonrpc_body: Option<&'b [u8]>,
    /// `Some(jsonrpc)` when the body was past the bound: answered 413 once decided.
    too_large: Option<bool>,
    /// The trace its client's `traceparent` continues (only read with a tracer
    /// installed, see [`crate::trace`]).
    /// Boxed: with no tracer (the default) it is `None`, and a planned request's
    /// future carries a pointer, not a span context.
    parent: Option<Box<opentelemetry::trace::SpanContext>>,
}

impl<'l, S: BudgetStore> Planned<'l, '_, S> {
    /// The plan, or why the request cannot be counted.
    pub fn plan(&self) -> Result<&Plan, &Refused> {
        self.plan.as_deref()
    }

    /// Phase 4: waits for the request's lane place where it needs one, decides every
    /// budget at once, and logs a refusal under `request_id` (see
    /// [`Limiter::with_refusal_log`]). A body that was past the bound is then answered 413,
    /// with `X-RateLimit-*` of the decision.
    ///
    /// # Errors
    /// The answer to send instead of forwarding.
    pub async fn admit(
        self,
        request_id: Option<&RequestId>,
    ) -> Result<Forward<'l, S>, Response<Full<Bytes>>> {
        let limiter = self.limiter;
        // SPEC O1: with a tracer installed, the request's span (else nothing).
        let mut span = RequestSpan::start(self.parent.map(|p| *p));
        let began = span.as_ref().map(|_| Instant::now());
        // One async layer: each layer copies the decision's future into its own
        // once more.
        let decided = limiter.decide_request(self.plan, request_id).await;
        let took = began.map(|b| b.elapsed()).unwrap_or_default();
        let admitted = match decided {
            Ok(admitted) => admitted,
            Err(refusal) => {
                let answer = limiter.answer(&refusal, self.jsonrpc_body);
                if let Some(span) = &mut span {
                    span.refused(limiter.policy(), &refusal, took, request_id);
                    span.status(answer.status().as_u16());
                }
                return Err(answer);
            }
        };
        if let Some(span) = &mut span {
            span.admitted(
                limiter.policy(),
                &admitted.plan,
                &admitted.decision,
                took,
                request_id,
            );
        }
        let mut forward = Forward {
            limiter,
            decision: admitted.decision,
            plan: admitted.plan,
            lane: admitted.lane,
            span,
        };
        match self.too_large {
            None => Ok(forward),
            Some(jsonrpc) => {
                let max = limiter.policy().bounds.max_body_bytes;
                let mut answer = if jsonrpc {
                    crate::jsonrpc_payload_too_large(max)
                } else {
                    crate::payload_too_large(max)
                };
                forward.write_rate_limit_headers(answer.headers_mut(), &forward.decision);
                if let Some(span) = &mut forward.span {
                    span.status(answer.status().as_u16());
                }
                Err(answer)
            }
        }
    }
}

/// A request extension the tower layer adds to a batch submit that a monthly quota
/// refused, when it passes it to the batch lane all the same: the submit may
/// repeat a batch that the same items already counted (its idempotency key and
/// body), which the lane answers as it did the first time (202, the same
/// `batch_id`). Anything else the lane answers with this refusal, queueing
/// nothing. It holds the refusal until the lane takes it.
#[derive(Clone, Debug)]
pub struct RefusedUnlessRepeat(Arc<parking_lot::Mutex<Option<Response<Full<Bytes>>>>>);

impl RefusedUnlessRepeat {
    /// Holds `refusal` for the lane.
    pub fn new(refusal: Response<Full<Bytes>>) -> Self {
        RefusedUnlessRepeat(Arc::new(parking_lot::Mutex::new(Some(refusal))))
    }

    /// The refusal (once: later takes answer a bare 429).
    pub fn take(&self) -> Response<Full<Bytes>> {
        self.0.lock().take().unwrap_or_else(|| {
            let mut r = Response::new(Full::new(Bytes::new()));
            *r.status_mut() = http::StatusCode::TOO_MANY_REQUESTS;
            r
        })
    }
}

/// A response extension of a refusal whose refusing budget is a monthly quota
/// (`quota_exceeded`): the tower layer passes a batch submit so refused to the
/// batch lane as [`RefusedUnlessRepeat`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QuotaRefusal;

/// What an admitted request spent of each monthly quota family (by the family's
/// index in the policy), for the service behind the edge: a request extension the
/// tower layer adds before it calls that service. A batch lane gives back what it
/// did not queue, and no more: a budget in shadow mode that would have refused
/// spent nothing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QuotaSpent([u32; sluice_policy::MAX_QUOTA_FAMILIES]);

impl QuotaSpent {
    /// Units spent of quota family `family`.
    pub fn of(&self, family: usize) -> u32 {
        self.0.get(family).copied().unwrap_or(0)
    }
}

/// An admitted request (phase 4), to be forwarded: its decision, its plan and its
/// place in a guarded lane, which goes back when this is dropped unfinished; with
/// a tracer installed, its span, which ends when this is dropped.
pub struct Forward<'l, S> {
    limiter: &'l Limiter<S>,
    decision: Box<Decision>,
    plan: Box<Plan>,
    lane: Option<LanePlace>,
    /// Boxed, as the planned request's parent.
    span: Option<Box<RequestSpan>>,
}

impl<S: BudgetStore> Forward<'_, S> {
    /// The decision admitting it.
    pub fn decision(&self) -> &Decision {
        &self.decision
    }

    /// Its plan.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Phase 5: each header the upstream is told (who the request is from, a
    /// weighted budget passed on exhausted, and with a tracer installed the
    /// `traceparent` of sluice's span), for a transport that writes the head
    /// itself; it leaves out the client's fields of these names (with a tracer
    /// installed, its `traceparent` too: [`crate::trace::is_on`]).
    pub fn for_each_upstream_header(&self, mut f: impl FnMut(&HeaderName, &[u8])) {
        crate::for_each_upstream_header(&self.plan, self.limiter.policy(), &mut f);
        if let Some(span) = &self.span {
            f(&crate::trace::TRACEPARENT, span.traceparent());
        }
    }

    /// Phase 5: [`Forward::for_each_upstream_header`] into `headers`, after removing
    /// any of those fields the client sent.
    pub fn upstream_headers(&self, headers: &mut HeaderMap) {
        crate::upstream_headers(headers, &self.plan, self.limiter.policy());
        if let Some(span) = &self.span
            && let Ok(value) = http::HeaderValue::from_bytes(span.traceparent())
        {
            headers.insert(crate::trace::TRACEPARENT.clone(), value);
        }
    }

    /// What the request spent of each monthly quota family: its units, but none of a
    /// family in shadow mode that would have refused it.
    pub fn quota_spent(&self) -> QuotaSpent {
        let mut spent = QuotaSpent::default();
        for (i, (budget, kind)) in self.plan.budgets.iter().zip(&self.plan.kinds).enumerate() {
            if let crate::BudgetKind::Quota(q) = kind
                && self.plan.shadowed & (1 << i) == 0
                && let Some(units) = usize::try_from(*q).ok().and_then(|q| spent.0.get_mut(q))
            {
                *units = units.saturating_add(budget.cost);
            }
        }
        spent
    }

    /// Phase 5: how long the upstream may take to answer: a guarded lane's own
    /// timeout, else `default`.
    pub fn upstream_timeout(&self, default: Duration) -> Duration {
        self.lane.as_ref().map_or(default, LanePlace::timeout)
    }

    /// True when the call goes through a guarded lane (its place is held until
    /// [`Forward::finish`]).
    pub fn in_lane(&self) -> bool {
        self.lane.is_some()
    }

    /// True when the plan holds weighted budgets, settled from the response head
    /// ([`Forward::settle`]).
    pub fn settles(&self) -> bool {
        self.plan.weighted(self.limiter.policy()).next().is_some()
    }

    /// Phase 6: charges the weighted budgets what the upstream said the call cost
    /// (`X-Sluice-Cost`, see [`Limiter::settle`]) and returns the decision after
    /// the charge, to describe in `X-RateLimit-*`.
    pub async fn settle(&self, cost: Option<u32>) -> Decision {
        self.limiter
            .settle(&self.plan, (*self.decision).clone(), cost)
            .await
    }

    /// Phase 6: ends the call's lane place with the upstream's status (`None`: no
    /// answer, a failure for the breaker). Nothing when it holds none.
    pub fn finish(&mut self, status: Option<u16>) {
        if let Some(place) = self.lane.take() {
            place.finish(status);
        }
        if let (Some(span), Some(status)) = (&mut self.span, status) {
            span.status(status);
        }
    }

    /// Phase 6 for a transport with the response head as a [`HeaderMap`]: ends the
    /// lane place with `status`, takes `X-Sluice-Cost` out of `headers`, settles the
    /// weighted budgets with it and writes `X-RateLimit-*` of the decision after it.
    pub async fn response_head(mut self, status: u16, headers: &mut HeaderMap) {
        self.finish(Some(status));
        let cost = crate::take_cost(headers);
        // The upstream's other signals (`X-Sluice-*`) never reach the client.
        if headers
            .keys()
            .any(|n| crate::is_sluice_signal(n.as_str().as_bytes()))
        {
            let signals: Vec<HeaderName> = headers
                .keys()
                .filter(|n| crate::is_sluice_signal(n.as_str().as_bytes()))
                .cloned()
                .collect();
            for name in signals {
                headers.remove(name);
            }
        }
        let decision = self.settle(cost).await;
        self.write_rate_limit_headers(headers, &decision);
    }

    /// Phase 6 when the upstream gave no head (`answer`: the gateway's own 502 or
    /// 504): ends the lane place as a failure and writes `X-RateLimit-*` of the
    /// decision into `headers`.
    pub fn upstream_failed(mut self, headers: &mut HeaderMap) {
        self.finish(None);
        if let Some(span) = &mut self.span {
            span.upstream_failed();
        }
        self.write_rate_limit_headers(headers, &self.decision);
    }

    /// Phase 6 when the client's body was still coming as the call's time ran
    /// out (`answer`: the 408 of a body that came too slowly): ends the lane
    /// place as answered — the client's doing, no failure of the upstream —
    /// and writes `X-RateLimit-*` of the decision into `headers`.
    pub fn upload_too_slow(mut self, status: u16, headers: &mut HeaderMap) {
        self.finish(Some(status));
        self.write_rate_limit_headers(headers, &self.decision);
    }

    fn write_rate_limit_headers(&self, headers: &mut HeaderMap, decision: &Decision) {
        let policy = self.limiter.policy();
        crate::rate_limit_headers(headers, decision, &self.plan, policy);
        crate::dialect::token_headers(headers, decision, &self.plan, policy);
    }

    /// The agent run endpoint (SPEC T7) a request to `path` is, if it is one:
    /// sluice answers it ([`Forward::answer_run`]), never forwarding it.
    pub fn run_endpoint<'p>(&self, path: &'p str) -> Option<sluice_policy::RunEndpoint<'p>> {
        self.limiter.policy().turns.endpoint(path)
    }

    /// Answers the run endpoint `endpoint` (see [`Forward::run_endpoint`]) for
    /// this request's caller, its `method` and `body` (a `continue`'s
    /// `{"turns": N}`), with `X-RateLimit-*` of its own decision.
    pub async fn answer_run(
        self,
        endpoint: sluice_policy::RunEndpoint<'_>,
        method: &http::Method,
        body: &[u8],
    ) -> Response<Full<Bytes>> {
        let mut r = self
            .limiter
            .run_endpoint(&self.plan, endpoint, method, body)
            .await;
        self.write_rate_limit_headers(r.headers_mut(), &self.decision);
        r
    }

    /// The plan and the decision of an LLM call, for settling its token budgets
    /// once the answer's `usage` is known ([`Limiter::settle_usage`]); `None`
    /// for any other call.
    pub fn settlement(&self) -> Option<(Box<Plan>, Decision)> {
        self.plan
            .llm
            .is_some()
            .then(|| (self.plan.clone(), (*self.decision).clone()))
    }
}
