//! SPEC O1: one OpenTelemetry span per request the edge decides, with the decision
//! as its attributes, and the W3C trace context carried through.
//!
//! The process installs a tracer once, at start ([`install`]); without one
//! (the default) nothing here runs for a request but one atomic load. With one,
//! [`crate::Planned::admit`] starts a span (kind server; its parent the request's
//! `traceparent` when the client sent a valid one), sets the decision on it
//! (`sluice.outcome`, `sluice.class`, `sluice.budget`, `sluice.limit`,
//! `sluice.remaining`, `sluice.reason`, `sluice.store.latency_ms`), and the
//! [`crate::Forward`] it returns carries it: the upstream is sent a
//! `traceparent` naming sluice's span (the client's own is replaced), the span
//! takes the upstream's status, and ends when the request is done. A refused
//! request's span ends with the refusal's status. Whether a span is kept is the
//! tracer's sampler's call; an unsampled span still passes its context on.
//!
//! Where the spans go (an exporter, its queue and its bounds) is the process's
//! business: this module only makes them.

use std::sync::OnceLock;
use std::time::Duration;

use http::{HeaderMap, HeaderName};
use opentelemetry::global::{BoxedSpan, BoxedTracer};
use opentelemetry::trace::{
    Span as _, SpanContext, SpanId, SpanKind, Status, TraceContextExt as _, TraceFlags, TraceId,
    TraceState, Tracer as _,
};
use opentelemetry::{Context, KeyValue};
use sluice_core::Decision;
use sluice_policy::Policy;

use crate::Plan;
use crate::limiter::{Reason, Refusal};

/// The W3C Trace Context request field.
pub static TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");

/// The name of every request span.
pub const SPAN_NAME: &str = "sluice.request";

/// The process's tracer, once installed.
static TRACER: OnceLock<BoxedTracer> = OnceLock::new();

/// Installs the tracer every decided request's span is made by: once per process,
/// before the first [`crate::Limiter`] is made (a limiter reads `traceparent`
/// only when a tracer is installed). False when one was installed already (the
/// first stays).
pub fn install(tracer: BoxedTracer) -> bool {
    TRACER.set(tracer).is_ok()
}

/// True once a tracer is installed ([`install`]).
pub fn is_on() -> bool {
    TRACER.get().is_some()
}

/// The span context a `traceparent` value names (version `00`, or a later one
/// read as `00` is), or `None` when it is not a valid one: a trace or parent id of
/// zeros, a version `ff`, wrong lengths or characters that are not lowercase hex.
pub fn parse_traceparent(value: &[u8]) -> Option<SpanContext> {
    let value = value.trim_ascii();
    if value.len() < 55 || (value.len() > 55 && value[55] != b'-') {
        return None;
    }
    let field = |range: std::ops::Range<usize>| -> Option<&str> {
        let bytes = value.get(range)?;
        bytes
            .iter()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(b))
            .then(|| std::str::from_utf8(bytes).ok())
            .flatten()
    };
    let version = field(0..2)?;
    if version == "ff" || (version == "00" && value.len() != 55) {
        return None;
    }
    if value[2] != b'-' || value[35] != b'-' || value[52] != b'-' {
        return None;
    }
    let trace_id = TraceId::from_hex(field(3..35)?).ok()?;
    let span_id = SpanId::from_hex(field(36..52)?).ok()?;
    let flags = u8::from_str_radix(field(53..55)?, 16).ok()?;
    if trace_id == TraceId::INVALID || span_id == SpanId::INVALID {
        return None;
    }
    Some(SpanContext::new(
        trace_id,
        span_id,
        TraceFlags::new(flags) & TraceFlags::SAMPLED,
        true,
        TraceState::default(),
    ))
}

/// The `traceparent` value (version `00`) naming `cx`.
pub fn format_traceparent(cx: &SpanContext) -> [u8; 55] {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut out = [b'-'; 55];
    let mut at = 0;
    let mut push = |bytes: &[u8], out: &mut [u8; 55]| {
        for b in bytes {
            out[at] = HEX[usize::from(b >> 4)];
            out[at + 1] = HEX[usize::from(b & 0xf)];
            at += 2;
        }
        at += 1;
    };
    push(&[0], &mut out);
    push(&cx.trace_id().to_bytes(), &mut out);
    push(&cx.span_id().to_bytes(), &mut out);
    push(&[cx.trace_flags().to_u8()], &mut out);
    out
}

/// The parent a request's span continues: its `traceparent`, when a tracer is
/// installed and the value is a valid one (a request with several is given
/// none: it cannot say which).
pub(crate) fn parent_of(headers: &HeaderMap) -> Option<SpanContext> {
    TRACER.get()?;
    let mut values = headers.get_all(&TRACEPARENT).iter();
    let first = values.next()?;
    if values.next().is_some() {
        return None;
    }
    parse_traceparent(first.as_bytes())
}

/// A decided request's span (see the module's documentation); ended when dropped.
pub(crate) struct RequestSpan {
    span: BoxedSpan,
    /// The `traceparent` naming this span, sent upstream.
    traceparent: [u8; 55],
}

impl std::fmt::Debug for RequestSpan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestSpan")
            .field("traceparent", &String::from_utf8_lossy(&self.traceparent))
            .finish_non_exhaustive()
    }
}

impl RequestSpan {
    /// A span starting now, child of `parent` when given; `None` when no tracer is
    /// installed.
    pub(crate) fn start(parent: Option<SpanContext>) -> Option<Box<RequestSpan>> {
        Self::named(SPAN_NAME, parent)
    }

    /// [`RequestSpan::start`] with the span named `name`.
    fn named(name: &'static str, parent: Option<SpanContext>) -> Option<Box<RequestSpan>> {
        let tracer = TRACER.get()?;
        let cx = match parent {
            Some(parent) => Context::new().with_remote_span_context(parent),
            None => Context::new(),
        };
        let span = tracer
            .span_builder(name)
            .with_kind(SpanKind::Server)
            .start_with_context(tracer, &cx);
        let traceparent = format_traceparent(span.span_context());
        Some(Box::new(RequestSpan { span, traceparent }))
    }

    /// The `traceparent` value naming this span.
    pub(crate) fn traceparent(&self) -> &[u8] {
        &self.traceparent
    }

    /// Sets the admitted decision on the span: its class, the budget shown in
    /// `X-RateLimit-*`, its limit and what is left, and how long deciding took.
    pub(crate) fn admitted(
        &mut self,
        policy: &Policy,
        plan: &Plan,
        decision: &Decision,
        took: Duration,
        request_id: Option<&crate::RequestId>,
    ) {
        if !self.span.is_recording() {
            return;
        }
        self.decided(
            "admitted",
            policy,
            plan,
            Some((decision, plan.shown_index(decision, policy))),
            took,
            request_id,
        );
    }

    /// Sets a refusal on the span: why, and (when budgets refused it) the binding
    /// budget, its limit and what is left.
    pub(crate) fn refused(
        &mut self,
        policy: &Policy,
        refusal: &Refusal,
        took: Duration,
        request_id: Option<&crate::RequestId>,
    ) {
        if !self.span.is_recording() {
            return;
        }
        let (outcome, reason) = match &refusal.reason {
            Reason::Invalid(refused) => ("invalid", refused.to_string()),
            Reason::Budget(_) => ("refused", String::new()),
            Reason::Lane { refusal, .. } => ("refused", refusal.reason.as_str().to_owned()),
            Reason::Unavailable(_) => ("unavailable", "limiter_unavailable".to_owned()),
        };
        match (&refusal.plan, &refusal.reason) {
            (Some(plan), Reason::Budget(decision)) => {
                let binding = match &plan.run {
                    Some(run) if crate::runs::paused(plan, decision) => run.index,
                    _ => decision.binding_index(),
                };
                self.span.set_attribute(KeyValue::new(
                    "sluice.reason",
                    plan.refusal_reason(binding, decision),
                ));
                self.decided(
                    outcome,
                    policy,
                    plan,
                    Some((decision, binding)),
                    took,
                    request_id,
                );
            }
            (Some(plan), _) => {
                self.span
                    .set_attribute(KeyValue::new("sluice.reason", reason));
                self.decided(outcome, policy, plan, None, took, request_id);
            }
            (None, _) => {
                self.span
                    .set_attribute(KeyValue::new("sluice.reason", reason));
                self.span
                    .set_attribute(KeyValue::new("sluice.outcome", outcome));
                if let Some(id) = request_id {
                    self.span
                        .set_attribute(KeyValue::new("sluice.request_id", id.as_str().to_owned()));
                }
            }
        }
    }

    fn decided(
        &mut self,
        outcome: &'static str,
        policy: &Policy,
        plan: &Plan,
        binding: Option<(&Decision, usize)>,
        took: Duration,
        request_id: Option<&crate::RequestId>,
    ) {
        let span = &mut self.span;
        span.set_attribute(KeyValue::new("sluice.outcome", outcome));
        span.set_attribute(KeyValue::new(
            "sluice.class",
            policy.class_name(plan.top_class).to_owned(),
        ));
        span.set_attribute(KeyValue::new(
            "sluice.store.latency_ms",
            took.as_secs_f64() * 1000.0,
        ));
        if let Some(id) = request_id {
            span.set_attribute(KeyValue::new("sluice.request_id", id.as_str().to_owned()));
        }
        if let Some((decision, i)) = binding
            && let Some(status) = decision.statuses().get(i)
        {
            span.set_attribute(KeyValue::new(
                "sluice.budget",
                plan.name(i, policy).to_owned(),
            ));
            span.set_attribute(KeyValue::new("sluice.limit", i64::from(status.limit)));
            span.set_attribute(KeyValue::new(
                "sluice.remaining",
                i64::from(status.remaining),
            ));
        }
    }

    /// The status of the answer the client was sent (`http.response.status_code`);
    /// a 5xx marks the span an error.
    pub(crate) fn status(&mut self, status: u16) {
        if !self.span.is_recording() {
            return;
        }
        self.span.set_attribute(KeyValue::new(
            "http.response.status_code",
            i64::from(status),
        ));
        if status >= 500 {
            self.span.set_status(Status::error(""));
        }
    }

    /// The upstream gave no answer (sluice answered 502 or 504 itself).
    pub(crate) fn upstream_failed(&mut self) {
        self.span
            .set_status(Status::error("the upstream gave no answer"));
    }
}

/// The span of a call decided outside [`crate::Planned::admit`]: Envoy's
/// rate-limit service's `ShouldRateLimit` (named [`RLS_SPAN_NAME`]), whose
/// transport sets the attributes; it ends when dropped.
pub struct CallSpan(Box<RequestSpan>);

/// The name of a rate-limit service call's span.
pub const RLS_SPAN_NAME: &str = "sluice.rls";

impl std::fmt::Debug for CallSpan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("CallSpan").field(&self.0).finish()
    }
}

impl CallSpan {
    /// A span named `name` starting now, child of the trace `traceparent`
    /// names when it is a valid one; `None` when no tracer is installed.
    pub fn start(name: &'static str, traceparent: Option<&[u8]>) -> Option<CallSpan> {
        TRACER.get()?;
        RequestSpan::named(name, traceparent.and_then(parse_traceparent)).map(CallSpan)
    }

    /// False when the sampler did not keep the span: setting attributes then
    /// does nothing, so they need not be made.
    pub fn is_recording(&self) -> bool {
        self.0.span.is_recording()
    }

    /// Sets the attribute `key`.
    pub fn set(&mut self, key: &'static str, value: impl Into<opentelemetry::Value>) {
        self.0.span.set_attribute(KeyValue::new(key, value));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VALID: &[u8] = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn o1_a_valid_traceparent_is_read_and_written_back_alike() {
        let cx = parse_traceparent(VALID).expect("valid");
        assert_eq!(
            cx.trace_id(),
            TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").expect("hex")
        );
        assert_eq!(
            cx.span_id(),
            SpanId::from_hex("00f067aa0ba902b7").expect("hex")
        );
        assert!(cx.is_sampled());
        assert!(cx.is_remote());
        assert_eq!(&format_traceparent(&cx)[..], VALID);
    }

    #[test]
    fn o1_invalid_traceparents_are_ignored() {
        for bad in [
            &b""[..],
            b"00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            b"ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            b"00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            b"00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            b"00-4bf92f3577b34da6a3ce929d0e0e473-600f067aa0ba902b7-01",
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0g",
        ] {
            assert!(
                parse_traceparent(bad).is_none(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
        // A later version may carry more fields after a dash.
        let later = b"01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00-more";
        let cx = parse_traceparent(later).expect("a later version");
        assert!(!cx.is_sampled());
    }
}
