//! SPEC O1: the spans of decided requests ([`sluice_edge::trace`]) sent to an
//! OpenTelemetry collector over OTLP (gRPC, or HTTP with protobuf), off unless
//! `--otlp-endpoint` is given.
//!
//! A span that ends is put on a bounded queue ([`OtlpConfig::queue_spans`],
//! [`QUEUE_SPANS`] by default) without waiting:
//! when the queue is full (a collector that is down or slow) the span is dropped
//! and counted in `sluice_otlp_spans_dropped_total`, so the collector never slows
//! a request. One task takes spans off the queue: it waits for a span (nothing
//! runs and nothing is sent at rest, SPEC S1), gathers what else comes within
//! [`BATCH_WAIT`] (at most [`BATCH_SPANS`]), and exports the batch, one export at
//! a time, each within [`EXPORT_TIMEOUT`]. Sent spans are counted in
//! `sluice_otlp_spans_exported_total`, spans of failed exports in
//! `sluice_otlp_spans_failed_total`.
//!
//! The metrics `/metrics` has go the same way after activity (see
//! [`crate::otlp_metrics`]): once spans were sent, at most one export every
//! [`METRICS_EVERY`](crate::otlp_metrics::METRICS_EVERY), none when nothing
//! changed; each counted in `sluice_otlp_metric_exports_total{outcome}` (`sent`,
//! `unchanged`, `failed`).

use std::time::Duration;

use opentelemetry::Context;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{WithExportConfig as _, WithTonicConfig as _};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{
    Sampler, SdkTracerProvider, Span, SpanData, SpanExporter, SpanProcessor,
};
use tokio::sync::{mpsc, oneshot};

/// Most finished spans waiting to be exported by default ([`OtlpConfig::queue_spans`]);
/// past it a span is dropped (and counted).
pub const QUEUE_SPANS: usize = 4096;

/// Most spans one export sends.
pub const BATCH_SPANS: usize = 512;

/// How long a batch waits for more spans after its first.
pub const BATCH_WAIT: Duration = Duration::from_millis(500);

/// Longest one export may take (its retries included); past it its spans are
/// counted as failed.
pub const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);

/// Longest the spans still queued at shutdown are given to be sent.
pub const FLUSH_TIMEOUT: Duration = Duration::from_secs(3);

/// How spans reach the collector.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum OtlpProtocol {
    /// OTLP over gRPC (`opentelemetry.proto.collector.trace.v1.TraceService`),
    /// a collector's port 4317.
    Grpc,
    /// OTLP over HTTP with protobuf bodies (`POST /v1/traces`), port 4318.
    HttpProtobuf,
}

/// Where and how the spans go (`--otlp-*`).
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct OtlpConfig {
    /// The collector's URL (`http://` or `https://`). With
    /// [`OtlpProtocol::HttpProtobuf`], a URL without a path gets `/v1/traces`.
    pub endpoint: String,
    /// The protocol.
    pub protocol: OtlpProtocol,
    /// The share of traces kept (0 to 1) for a request that starts a trace; one
    /// that continues a trace is kept when its parent was sampled.
    pub sample_ratio: f64,
    /// Most finished spans waiting to be exported; past it a span is dropped.
    pub queue_spans: usize,
}

impl OtlpConfig {
    /// Spans to `endpoint` over `protocol`, every trace kept.
    pub fn new(endpoint: impl Into<String>, protocol: OtlpProtocol) -> Self {
        OtlpConfig {
            endpoint: endpoint.into(),
            protocol,
            sample_ratio: 1.0,
            queue_spans: QUEUE_SPANS,
        }
    }
}

/// Why the exporter could not be set up.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OtlpError {
    /// The endpoint is not an `http://` or `https://` URL.
    #[error("`{0}` is not an http:// or https:// URL")]
    Endpoint(String),
    /// The OTLP exporter refused its configuration.
    #[error("{0}")]
    Exporter(String),
    /// A tracer was installed already in this process.
    #[error("a tracer is installed already")]
    Installed,
}

/// The running exporter; [`Exporting::shutdown`] sends what is still queued.
#[derive(Debug)]
pub struct Exporting {
    provider: SdkTracerProvider,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl Exporting {
    /// Stops taking spans off the queue but for those already there, sends them
    /// within [`FLUSH_TIMEOUT`], and ends the task.
    pub async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ =
            tokio::time::timeout(FLUSH_TIMEOUT + Duration::from_millis(100), &mut self.task).await;
        self.task.abort();
        let _ = self.provider.shutdown();
    }
}

/// Sets up the exporter of `config` and installs the tracer the edge makes
/// request spans with ([`sluice_edge::trace::install`]). Call it inside the
/// runtime the export task is to run on, before the first limiter is made. Nothing
/// is connected until a span is exported.
///
/// # Errors
/// [`OtlpError`] for an endpoint that is not a URL, an exporter that refuses
/// it, or a second call in one process.
pub fn start(config: &OtlpConfig) -> Result<Exporting, OtlpError> {
    let endpoint = endpoint_url(config)?;
    let endpoint_for_metrics = endpoint.clone();
    // The counters below are the recorder's, not a no-op's.
    sluice_admin::install_metrics();
    // `service.name` is `sluice` unless OTEL_SERVICE_NAME names it (the builder
    // reads it, and OTEL_RESOURCE_ATTRIBUTES).
    let resource = match std::env::var_os("OTEL_SERVICE_NAME") {
        Some(_) => Resource::builder().build(),
        None => Resource::builder().with_service_name("sluice").build(),
    };
    let exporter = match config.protocol {
        OtlpProtocol::Grpc => {
            let https = endpoint.starts_with("https:");
            let builder = opentelemetry_otlp::SpanExporter::builder()
                .with_tonic()
                .with_endpoint(endpoint)
                .with_timeout(EXPORT_TIMEOUT);
            // An https collector is verified against the system's roots.
            let builder = if https {
                builder.with_tls_config(
                    opentelemetry_otlp::tonic_types::transport::ClientTlsConfig::new()
                        .with_native_roots(),
                )
            } else {
                builder
            };
            builder.build()
        }
        OtlpProtocol::HttpProtobuf => opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
            .with_endpoint(endpoint)
            .with_timeout(EXPORT_TIMEOUT)
            .build(),
    }
    .map_err(|e| OtlpError::Exporter(e.to_string()))?;
    let mut exporter = exporter;
    exporter.set_resource(&resource);
    let metrics =
        crate::otlp_metrics::MetricsExport::new(&endpoint_for_metrics, config.protocol, &resource)?;

    let (queue, spans) = mpsc::channel(config.queue_spans.max(1));
    let dropped = metrics::counter!("sluice_otlp_spans_dropped_total");
    // Shown from the start, at zero.
    dropped.absolute(0);
    let provider = SdkTracerProvider::builder()
        .with_span_processor(Queue { queue, dropped })
        .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
            config.sample_ratio,
        ))))
        .with_resource(resource)
        .build();
    let tracer = provider.tracer("sluice");
    if !sluice_edge::trace::install(opentelemetry::global::BoxedTracer::new(Box::new(tracer))) {
        return Err(OtlpError::Installed);
    }
    let (stop, stopped) = oneshot::channel();
    let task = tokio::spawn(export(spans, exporter, metrics, stopped));
    Ok(Exporting {
        provider,
        stop: Some(stop),
        task,
    })
}

/// The URL the exporter is given: `config.endpoint`, with `/v1/traces` added for
/// OTLP over HTTP when it has no path.
fn endpoint_url(config: &OtlpConfig) -> Result<String, OtlpError> {
    let uri: http::Uri = config
        .endpoint
        .parse()
        .map_err(|_| OtlpError::Endpoint(config.endpoint.clone()))?;
    if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.host().is_none() {
        return Err(OtlpError::Endpoint(config.endpoint.clone()));
    }
    Ok(match config.protocol {
        OtlpProtocol::HttpProtobuf if matches!(uri.path(), "" | "/") => {
            format!("{}/v1/traces", config.endpoint.trim_end_matches('/'))
        }
        _ => config.endpoint.clone(),
    })
}

/// The span processor: every finished (sampled) span onto the bounded queue, or
/// dropped and counted when it is full.
#[derive(Debug)]
struct Queue {
    queue: mpsc::Sender<SpanData>,
    dropped: metrics::Counter,
}

impl SpanProcessor for Queue {
    fn on_start(&self, _span: &mut Span, _cx: &Context) {}

    fn on_end(&self, span: SpanData) {
        if self.queue.try_send(span).is_err() {
            self.dropped.increment(1);
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        Ok(())
    }

    fn shutdown_with_timeout(&self, _timeout: Duration) -> OTelSdkResult {
        Ok(())
    }
}

/// The export task: waits for a span, gathers a batch, exports it, and then
/// (no sooner than [`METRICS_EVERY`](crate::otlp_metrics::METRICS_EVERY) after
/// the last) the metrics; at `stop`, sends what is queued within
/// [`FLUSH_TIMEOUT`] and ends.
async fn export(
    mut spans: mpsc::Receiver<SpanData>,
    exporter: impl SpanExporter,
    mut metrics: crate::otlp_metrics::MetricsExport,
    mut stop: oneshot::Receiver<()>,
) {
    // A metrics export is due (armed only after spans were sent: nothing ticks
    // at rest), and when the last one was.
    let mut metrics_due: Option<tokio::time::Instant> = None;
    let mut metrics_sent: Option<tokio::time::Instant> = None;
    let mut metrics_failing = false;
    let exported = metrics::counter!("sluice_otlp_spans_exported_total");
    let failed = metrics::counter!("sluice_otlp_spans_failed_total");
    exported.absolute(0);
    failed.absolute(0);
    // The last export failed: logged once until one succeeds again.
    let mut failing = false;
    let mut batch = Vec::with_capacity(BATCH_SPANS);
    loop {
        let due = metrics_due.unwrap_or_else(tokio::time::Instant::now);
        let first = tokio::select! {
            span = spans.recv() => span,
            _ = &mut stop => None,
            () = tokio::time::sleep_until(due), if metrics_due.is_some() => {
                metrics_due = None;
                metrics_sent = Some(tokio::time::Instant::now());
                let outcome = tokio::time::timeout(EXPORT_TIMEOUT, metrics.export()).await;
                let counted = match &outcome {
                    Ok(Ok(true)) => "sent",
                    Ok(Ok(false)) => "unchanged",
                    _ => "failed",
                };
                metrics::counter!("sluice_otlp_metric_exports_total", "outcome" => counted)
                    .increment(1);
                match outcome {
                    Ok(Ok(_)) if metrics_failing => {
                        tracing::info!("OTLP metric export works again");
                        metrics_failing = false;
                    }
                    Ok(Ok(_)) => {}
                    Ok(Err(why)) if !metrics_failing => {
                        tracing::warn!("OTLP metric export failed ({why})");
                        metrics_failing = true;
                    }
                    Err(_) if !metrics_failing => {
                        tracing::warn!("OTLP metric export failed (no answer in time)");
                        metrics_failing = true;
                    }
                    _ => {}
                }
                continue;
            }
        };
        let Some(first) = first else { break };
        batch.push(first);
        let until = tokio::time::Instant::now() + BATCH_WAIT;
        while batch.len() < BATCH_SPANS {
            match tokio::time::timeout_at(until, spans.recv()).await {
                Ok(Some(span)) => batch.push(span),
                Ok(None) | Err(_) => break,
            }
        }
        send(&exporter, &mut batch, &exported, &failed, &mut failing).await;
        if metrics_due.is_none() {
            let now = tokio::time::Instant::now();
            let every = crate::otlp_metrics::METRICS_EVERY;
            metrics_due = Some(metrics_sent.map_or(now, |sent| (sent + every).max(now)));
        }
    }
    // Shutting down: what is queued, within the flush timeout.
    let until = tokio::time::Instant::now() + FLUSH_TIMEOUT;
    let flush = async {
        while !spans.is_empty() {
            while batch.len() < BATCH_SPANS {
                match spans.try_recv() {
                    Ok(span) => batch.push(span),
                    Err(_) => break,
                }
            }
            send(&exporter, &mut batch, &exported, &failed, &mut failing).await;
        }
    };
    let _ = tokio::time::timeout_at(until, flush).await;
}

/// Exports `batch` (emptied) within [`EXPORT_TIMEOUT`], counting its spans.
async fn send(
    exporter: &impl SpanExporter,
    batch: &mut Vec<SpanData>,
    exported: &metrics::Counter,
    failed: &metrics::Counter,
    failing: &mut bool,
) {
    let n = batch.len() as u64;
    let spans = std::mem::replace(batch, Vec::with_capacity(BATCH_SPANS));
    match tokio::time::timeout(EXPORT_TIMEOUT, exporter.export(spans)).await {
        Ok(Ok(())) => {
            exported.increment(n);
            if *failing {
                tracing::info!("OTLP export works again");
                *failing = false;
            }
        }
        outcome => {
            failed.increment(n);
            if !*failing {
                let why = match outcome {
                    Ok(Err(e)) => e.to_string(),
                    _ => format!("no answer within {} s", EXPORT_TIMEOUT.as_secs()),
                };
                tracing::warn!(
                    "OTLP export failed ({why}); its spans are lost, later ones are tried"
                );
                *failing = true;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn o1_endpoints_are_http_urls_and_otlp_over_http_gets_its_path() {
        let grpc = OtlpConfig::new("http://127.0.0.1:4317", OtlpProtocol::Grpc);
        assert_eq!(endpoint_url(&grpc).expect("url"), "http://127.0.0.1:4317");
        let http = OtlpConfig::new("http://127.0.0.1:4318/", OtlpProtocol::HttpProtobuf);
        assert_eq!(
            endpoint_url(&http).expect("url"),
            "http://127.0.0.1:4318/v1/traces"
        );
        let own = OtlpConfig::new("https://c.example/otlp/traces", OtlpProtocol::HttpProtobuf);
        assert_eq!(
            endpoint_url(&own).expect("url"),
            "https://c.example/otlp/traces"
        );
        for bad in ["127.0.0.1:4317", "ftp://c.example", "not a url", ""] {
            let config = OtlpConfig::new(bad, OtlpProtocol::Grpc);
            assert!(endpoint_url(&config).is_err(), "{bad}");
        }
    }
}
