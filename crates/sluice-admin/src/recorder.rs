//! The Prometheus recorder behind `GET /metrics`: installed once per process, with
//! fixed histogram buckets, and the `# HELP` of every metric family sluice records.

use std::sync::OnceLock;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

static PROMETHEUS: OnceLock<PrometheusHandle> = OnceLock::new();

/// Installs the Prometheus recorder as the process's global `metrics` recorder, once,
/// and returns the handle that renders it. If another recorder was installed first the
/// handle still works but sees none of the `metrics` macros' output.
pub fn install_metrics() -> &'static PrometheusHandle {
    PROMETHEUS.get_or_init(|| {
        // The two latencies are `sluice_edge::latency`'s, rendered by
        // [`render_metrics`] after the recorder's families.
        let recorder = PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        if metrics::set_global_recorder(recorder).is_ok() {
            describe_metrics();
        }
        handle
    })
}

/// Every metric of this process in Prometheus' text format: the recorder's
/// families, then the latency histograms (`sluice_edge::latency`).
pub fn render_metrics() -> String {
    let mut text = install_metrics().render();
    if !text.is_empty() && !text.ends_with("\n\n") {
        text.push('\n');
    }
    sluice_edge::latency::render(&mut text);
    text
}

/// `# HELP` (and the unit) of every metric family sluice records, here and in the
/// limiter (`sluice_edge::Limiter`): a family missing here has no `# HELP` in
/// `/metrics` (the test `metrics_describe_every_sluice_family` scrapes them all).
fn describe_metrics() {
    metrics::describe_counter!(
        "sluice_otlp_spans_dropped_total",
        "Request spans dropped because the OTLP export queue was full (--otlp-max-queue)."
    );
    metrics::describe_counter!(
        "sluice_otlp_spans_exported_total",
        "Request spans the OTLP collector took."
    );
    metrics::describe_counter!(
        "sluice_otlp_spans_failed_total",
        "Request spans of OTLP exports that failed or timed out."
    );
    metrics::describe_counter!(
        "sluice_otlp_metric_exports_total",
        "Metric exports over OTLP after activity, by outcome: sent, unchanged (nothing new, nothing sent), failed."
    );
    metrics::describe_counter!(
        "sluice_requests_total",
        "Requests answered by the gateway, by HTTP status."
    );
    metrics::describe_counter!(
        "sluice_stalled_clients_total",
        "Clients cut for taking nothing of their answer for 60 s, by cut: connection (closed), stream (an HTTP/2 stream held by flow control, reset)."
    );
    metrics::describe_counter!(
        "sluice_slow_heads_total",
        "Connections closed for not finishing a request head (or a TLS handshake) in time, by listener."
    );
    metrics::describe_counter!(
        "sluice_connections_refused_total",
        "Client connections closed at once, by reason (per_ip: the address held --max-connections-per-ip) and listener."
    );
    metrics::describe_gauge!(
        "sluice_requests_in_flight",
        "Requests received by the gateway and not yet answered."
    );
    metrics::describe_gauge!(
        "sluice_connections_open",
        "Client connections the gateway holds open, idle ones included."
    );
    metrics::describe_counter!(
        "sluice_quota_units_total",
        "Calls counted against monthly quotas, by family."
    );
    metrics::describe_counter!(
        "sluice_decisions_total",
        "Limiter decisions, by the request's top class and outcome (admitted, refused, error)."
    );
    metrics::describe_counter!(
        "sluice_local_decisions_total",
        "Decisions made on this process's fallback store while the shared store was down (fail-open classes)."
    );
    metrics::describe_counter!(
        "sluice_leases_taken_total",
        "Leases of leased budgets this replica took from the shared store (SPEC D4)."
    );
    metrics::describe_counter!(
        "sluice_leases_returned_total",
        "Leases that ended with units left, given back to the shared store."
    );
    metrics::describe_counter!(
        "sluice_leases_expired_total",
        "Leases ended by time (lease_ms, their window's end, or the shared store's clock past their window)."
    );
    metrics::describe_counter!(
        "sluice_lease_calls_saved_total",
        "Requests decided from leases alone, with no call to the shared store."
    );
    metrics::describe_counter!(
        "sluice_lease_over_admission_seen_total",
        "Units admitted from leases when, by the shared store's clock as last measured, their window may already have ended: the most this replica can have admitted over a limit (SPEC D4)."
    );
    metrics::describe_counter!(
        "sluice_refusals_total",
        "Requests refused with 429, by the budget that refused them."
    );
    metrics::describe_counter!(
        "sluice_llm_tokens_total",
        "Tokens LLM calls spent as their upstream reported them, by direction (input, cached_input, output)."
    );
    metrics::describe_counter!(
        "sluice_llm_settlements_total",
        "LLM calls whose token budgets settled, by outcome: usage (at the upstream's count), refunded (an error with no usage), reservation (no usage: charged what was reserved)."
    );
    metrics::describe_counter!(
        "sluice_near_limit_total",
        "Admitted decisions that left a budget past near_limit_ratio (default 0.8) of its limit, by budget."
    );
    metrics::describe_counter!(
        "sluice_run_turns_total",
        "Turns of agent runs decided, by outcome: taken, paused (the run's turns spent), finished (its owner ended it)."
    );
    metrics::describe_counter!(
        "sluice_run_grants_total",
        "Grants of more turns to agent runs (POST /runs/<id>/continue)."
    );
    metrics::describe_counter!(
        "sluice_settle_failures_total",
        "Weighted-budget charges (X-Sluice-Cost) the store could not apply after the upstream answered."
    );
    metrics::describe_counter!(
        "sluice_alerts_sent_total",
        "Alert events a webhook took (answered 2xx) (SPEC O3)."
    );
    metrics::describe_counter!(
        "sluice_alert_delivery_failures_total",
        "Alert deliveries that failed (an error status, a redirect, a timeout, no connection), each retried with backoff."
    );
    metrics::describe_counter!(
        "sluice_alerts_dropped_total",
        "Alert events not kept (reason outbox_full) or given up after their last try (reason gave_up)."
    );
    metrics::describe_counter!(
        "sluice_alert_outbox_write_failures_total",
        "Alert events that could not be written to disk (kept in memory only)."
    );
    metrics::describe_counter!(
        "sluice_usage_export_failures_total",
        "Counts of the usage export (SPEC O4) lost: a row the store could not note, or a call's row counts it could not take."
    );
    metrics::describe_counter!(
        "sluice_usage_rows_full_total",
        "Calls counted in an overflow row of the usage export because their month already lists its most rows."
    );
    metrics::describe_gauge!(
        "sluice_lane_running",
        "Calls running through a guarded lane (single calls and batch items), by lane."
    );
    metrics::describe_gauge!(
        "sluice_lane_waiting",
        "Calls waiting in line for a guarded lane, by lane."
    );
    metrics::describe_gauge!(
        "sluice_lane_batch_running",
        "Batch items running through a guarded lane, by lane."
    );
    metrics::describe_gauge!(
        "sluice_lane_breaker_open",
        "1 while a guarded lane's breaker is open (calls refused at once), else 0."
    );
    metrics::describe_gauge!(
        "sluice_batch_queued",
        "Batch items waiting in a lane's batch queue (as its runner last saw it), by lane."
    );
    metrics::describe_counter!(
        "sluice_batch_items_total",
        "Batch items this process finished, by lane and outcome (done, failed, requeued)."
    );
    metrics::describe_counter!(
        "sluice_lane_refusals_total",
        "Calls a guarded lane refused, by lane and reason."
    );
    metrics::describe_counter!(
        "sluice_shadow_refusals_total",
        "Refusals a budget in shadow mode (mode: shadow, or --dry-run) would have given, the request forwarded instead, by budget and reason."
    );
    metrics::describe_counter!(
        "sluice_tenant_table_repairs_total",
        "Times this replica found the shared tenant table lost or made again by Redis (FLUSHALL, a restart without persistence) and repaired it, by repair: restored (its copy written back), newer (its newer copy over an older one), merged (its entries added to a table made meanwhile), incomplete (changes made before the loss may be missing)."
    );
    metrics::describe_gauge!(
        "sluice_store_degraded",
        "1 while the budget store is failing (its last decision failed), else 0."
    );
}
