//! SPEC O1: the metrics `/metrics` has, sent to the OTLP collector as well, only
//! after activity: the span export task asks for an export once it has sent spans
//! (at most one every [`METRICS_EVERY`]), and an export whose metrics are the
//! same as the last one's sends nothing. At rest no span is sent, so no metric
//! is either, and nothing ticks.
//!
//! The families are read from the Prometheus text the admin listener serves
//! (one source of truth): counters become monotonic cumulative sums, gauges
//! gauges, histograms (fixed buckets) histograms and summaries summaries.

use std::collections::HashMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use opentelemetry_proto::tonic::collector::metrics::v1::ExportMetricsServiceRequest;
use opentelemetry_proto::tonic::collector::metrics::v1::metrics_service_client::MetricsServiceClient;
use opentelemetry_proto::tonic::common::v1::{AnyValue, InstrumentationScope, KeyValue, any_value};
use opentelemetry_proto::tonic::metrics::v1::{
    AggregationTemporality, Gauge, Histogram, HistogramDataPoint, Metric, NumberDataPoint,
    ResourceMetrics, ScopeMetrics, Sum, Summary, SummaryDataPoint, metric, number_data_point,
    summary_data_point,
};
use opentelemetry_proto::tonic::resource::v1::Resource;

use super::otlp::{EXPORT_TIMEOUT, OtlpError, OtlpProtocol};

/// Least time between two metric exports.
pub const METRICS_EVERY: Duration = Duration::from_secs(10);

/// Where the metrics go.
enum Target {
    Grpc(MetricsServiceClient<tonic::transport::Channel>),
    Http {
        client: reqwest::Client,
        url: String,
    },
}

/// The metric exporter: its target, the process's start, the text last sent.
pub(crate) struct MetricsExport {
    target: Target,
    resource: Resource,
    started: u64,
    last: Option<String>,
}

impl std::fmt::Debug for MetricsExport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetricsExport").finish_non_exhaustive()
    }
}

fn unix_nanos(at: SystemTime) -> u64 {
    at.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

impl MetricsExport {
    /// An exporter to the collector at `endpoint` (the spans' URL, for HTTP with
    /// its `/v1/traces` path) over `protocol`, naming `service`. Nothing is
    /// connected until the first export.
    pub(crate) fn new(
        endpoint: &str,
        protocol: OtlpProtocol,
        resource: &opentelemetry_sdk::Resource,
    ) -> Result<Self, OtlpError> {
        let bad = |e: String| OtlpError::Exporter(format!("metrics: {e}"));
        let target = match protocol {
            OtlpProtocol::Grpc => {
                let mut channel = tonic::transport::Endpoint::from_shared(endpoint.to_owned())
                    .map_err(|e| bad(e.to_string()))?
                    .timeout(EXPORT_TIMEOUT);
                if endpoint.starts_with("https:") {
                    channel = channel
                        .tls_config(tonic::transport::ClientTlsConfig::new().with_native_roots())
                        .map_err(|e| bad(e.to_string()))?;
                }
                Target::Grpc(MetricsServiceClient::new(channel.connect_lazy()))
            }
            OtlpProtocol::HttpProtobuf => {
                let url = match endpoint.strip_suffix("/v1/traces") {
                    Some(base) => format!("{base}/v1/metrics"),
                    None => endpoint.to_owned(),
                };
                let client = reqwest::Client::builder()
                    .timeout(EXPORT_TIMEOUT)
                    .build()
                    .map_err(|e| bad(e.to_string()))?;
                Target::Http { client, url }
            }
        };
        let resource = Resource {
            attributes: resource
                .iter()
                .map(|(k, v)| text_attribute(k.as_str(), &v.to_string()))
                .collect(),
            ..Default::default()
        };
        Ok(MetricsExport {
            target,
            resource,
            started: unix_nanos(SystemTime::now()),
            last: None,
        })
    }

    /// Sends the metrics if they differ from those last sent: `Ok(true)` when
    /// sent, `Ok(false)` when there was nothing new.
    pub(crate) async fn export(&mut self) -> Result<bool, String> {
        let text = sluice_admin::render_metrics();
        if self.last.as_deref() == Some(text.as_str()) {
            return Ok(false);
        }
        let request = ExportMetricsServiceRequest {
            resource_metrics: vec![ResourceMetrics {
                resource: Some(self.resource.clone()),
                scope_metrics: vec![ScopeMetrics {
                    scope: Some(InstrumentationScope {
                        name: "sluice".into(),
                        ..Default::default()
                    }),
                    metrics: from_prometheus(&text, self.started, unix_nanos(SystemTime::now())),
                    schema_url: String::new(),
                }],
                schema_url: String::new(),
            }],
        };
        match &mut self.target {
            Target::Grpc(client) => {
                client
                    .export(request)
                    .await
                    .map_err(|e| e.message().to_owned())?;
            }
            Target::Http { client, url } => {
                use prost::Message as _;
                let response = client
                    .post(url.as_str())
                    .header("content-type", "application/x-protobuf")
                    .body(request.encode_to_vec())
                    .send()
                    .await
                    .map_err(|e| e.to_string())?;
                if !response.status().is_success() {
                    return Err(format!("the collector answered {}", response.status()));
                }
            }
        }
        self.last = Some(text);
        Ok(true)
    }
}

fn text_attribute(key: &str, value: &str) -> KeyValue {
    KeyValue {
        key: key.to_owned(),
        value: Some(AnyValue {
            value: Some(any_value::Value::StringValue(value.to_owned())),
        }),
        ..Default::default()
    }
}

/// One sample line: its name, labels and value.
struct Sample<'a> {
    name: &'a str,
    labels: Vec<(&'a str, String)>,
    value: f64,
}

/// Reads `name{a="x",b="y"} value` (labels optional); `None` for a line that is
/// not one.
fn sample(line: &str) -> Option<Sample<'_>> {
    let end = line.find(['{', ' '])?;
    let name = &line[..end];
    let mut labels = Vec::new();
    let mut rest = &line[end..];
    if let Some(mut inner) = rest.strip_prefix('{') {
        loop {
            inner = inner.trim_start_matches(',');
            if let Some(after) = inner.strip_prefix('}') {
                rest = after;
                break;
            }
            let eq = inner.find('=')?;
            let key = inner[..eq].trim();
            let body = inner[eq + 1..].strip_prefix('"')?;
            let mut value = String::new();
            let mut escaped = false;
            let mut close = None;
            for (i, c) in body.char_indices() {
                if escaped {
                    value.push(if c == 'n' { '\n' } else { c });
                    escaped = false;
                } else if c == '\\' {
                    escaped = true;
                } else if c == '"' {
                    close = Some(i);
                    break;
                } else {
                    value.push(c);
                }
            }
            labels.push((key, value));
            inner = &body[close? + 1..];
        }
    }
    let value = match rest.split_whitespace().next()? {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().ok()?,
    };
    Some(Sample {
        name,
        labels,
        value,
    })
}

/// A family's points being gathered, by their labels.
enum Points {
    Numbers(Vec<(Vec<(String, String)>, f64)>),
    /// Labels (without `le`), buckets (`le`, cumulative count), sum, count.
    Histogram(Vec<Point>),
    /// Labels (without `quantile`), quantiles, sum, count.
    Summary(Vec<Point>),
}

#[derive(Default)]
struct Point {
    labels: Vec<(String, String)>,
    values: Vec<(f64, f64)>,
    sum: f64,
    count: f64,
}

fn point(points: &mut Vec<Point>, labels: Vec<(String, String)>) -> &mut Point {
    match points.iter().position(|p| p.labels == labels) {
        Some(i) => &mut points[i],
        None => {
            points.push(Point {
                labels,
                ..Point::default()
            });
            let last = points.len() - 1;
            &mut points[last]
        }
    }
}

/// The metrics of a Prometheus text exposition, at `now` (cumulative since `start`).
fn from_prometheus(text: &str, start: u64, now: u64) -> Vec<Metric> {
    let mut kinds: HashMap<&str, &str> = HashMap::new();
    let mut help: HashMap<&str, &str> = HashMap::new();
    let mut order: Vec<&str> = Vec::new();
    let mut families: HashMap<&str, Points> = HashMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            if let Some((name, kind)) = rest.split_once(' ') {
                kinds.insert(name, kind.trim());
            }
            continue;
        }
        if let Some(rest) = line.strip_prefix("# HELP ") {
            if let Some((name, text)) = rest.split_once(' ') {
                help.insert(name, text);
            }
            continue;
        }
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let Some(s) = sample(line) else { continue };
        let (family, part) = match ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|suffix| s.name.strip_suffix(suffix).map(|base| (base, *suffix)))
        {
            Some((base, suffix)) if matches!(kinds.get(base), Some(&"histogram" | &"summary")) => {
                (base, suffix)
            }
            _ => (s.name, ""),
        };
        let kind = kinds.get(family).copied().unwrap_or("gauge");
        if !families.contains_key(family) {
            order.push(family);
        }
        let entry = families.entry(family).or_insert_with(|| match kind {
            "histogram" => Points::Histogram(Vec::new()),
            "summary" => Points::Summary(Vec::new()),
            _ => Points::Numbers(Vec::new()),
        });
        let strip = |skip: &str| -> (Vec<(String, String)>, Option<f64>) {
            let mut at = None;
            let labels = s
                .labels
                .iter()
                .filter(|(k, v)| {
                    if *k == skip {
                        at = match v.as_str() {
                            "+Inf" => Some(f64::INFINITY),
                            v => v.parse().ok(),
                        };
                        false
                    } else {
                        true
                    }
                })
                .map(|(k, v)| ((*k).to_owned(), v.clone()))
                .collect();
            (labels, at)
        };
        match entry {
            Points::Numbers(points) => {
                let (labels, _) = strip("");
                points.push((labels, s.value));
            }
            Points::Histogram(points) | Points::Summary(points) => {
                let skip = if kind == "histogram" {
                    "le"
                } else {
                    "quantile"
                };
                let (labels, at) = strip(skip);
                let p = point(points, labels);
                match (part, at) {
                    ("_sum", _) => p.sum = s.value,
                    ("_count", _) => p.count = s.value,
                    (_, Some(at)) => p.values.push((at, s.value)),
                    _ => {}
                }
            }
        }
    }
    let attributes = |labels: &[(String, String)]| -> Vec<KeyValue> {
        labels.iter().map(|(k, v)| text_attribute(k, v)).collect()
    };
    order
        .into_iter()
        .filter_map(|name| {
            let points = families.remove(name)?;
            let data = match points {
                Points::Numbers(points) => {
                    let data_points = points
                        .into_iter()
                        .map(|(labels, value)| NumberDataPoint {
                            attributes: attributes(&labels),
                            start_time_unix_nano: start,
                            time_unix_nano: now,
                            value: Some(number_data_point::Value::AsDouble(value)),
                            ..Default::default()
                        })
                        .collect();
                    if kinds.get(name) == Some(&"counter") {
                        metric::Data::Sum(Sum {
                            data_points,
                            aggregation_temporality: AggregationTemporality::Cumulative.into(),
                            is_monotonic: true,
                        })
                    } else {
                        metric::Data::Gauge(Gauge { data_points })
                    }
                }
                Points::Histogram(points) => metric::Data::Histogram(Histogram {
                    data_points: points
                        .into_iter()
                        .map(|mut p| {
                            p.values.sort_by(|a, b| a.0.total_cmp(&b.0));
                            let mut counts = Vec::with_capacity(p.values.len());
                            let mut below = 0.0;
                            for (_, cumulative) in &p.values {
                                counts.push((cumulative - below).max(0.0) as u64);
                                below = *cumulative;
                            }
                            HistogramDataPoint {
                                attributes: attributes(&p.labels),
                                start_time_unix_nano: start,
                                time_unix_nano: now,
                                count: p.count as u64,
                                sum: Some(p.sum),
                                explicit_bounds: p
                                    .values
                                    .iter()
                                    .map(|(le, _)| *le)
                                    .filter(|le| le.is_finite())
                                    .collect(),
                                bucket_counts: counts,
                                ..Default::default()
                            }
                        })
                        .collect(),
                    aggregation_temporality: AggregationTemporality::Cumulative.into(),
                }),
                Points::Summary(points) => metric::Data::Summary(Summary {
                    data_points: points
                        .into_iter()
                        .map(|p| SummaryDataPoint {
                            attributes: attributes(&p.labels),
                            start_time_unix_nano: start,
                            time_unix_nano: now,
                            count: p.count as u64,
                            sum: p.sum,
                            quantile_values: p
                                .values
                                .iter()
                                .map(|(quantile, value)| summary_data_point::ValueAtQuantile {
                                    quantile: *quantile,
                                    value: *value,
                                })
                                .collect(),
                            ..Default::default()
                        })
                        .collect(),
                }),
            };
            Some(Metric {
                name: name.to_owned(),
                description: help.get(name).copied().unwrap_or_default().to_owned(),
                data: Some(data),
                ..Default::default()
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn o1_prometheus_families_become_otlp_metrics() {
        let text = "# HELP sluice_requests_total Requests.\n\
# TYPE sluice_requests_total counter\n\
sluice_requests_total{status=\"200\"} 3\n\
sluice_requests_total{status=\"429\"} 1\n\
# TYPE sluice_open gauge\n\
sluice_open 2\n\
# TYPE sluice_up_seconds histogram\n\
sluice_up_seconds_bucket{outcome=\"ok\",le=\"0.1\"} 1\n\
sluice_up_seconds_bucket{outcome=\"ok\",le=\"1\"} 3\n\
sluice_up_seconds_bucket{outcome=\"ok\",le=\"+Inf\"} 4\n\
sluice_up_seconds_sum{outcome=\"ok\"} 5.5\n\
sluice_up_seconds_count{outcome=\"ok\"} 4\n\
# TYPE sluice_lat summary\n\
sluice_lat{quantile=\"0.5\"} 0.2\n\
sluice_lat_sum 1\n\
sluice_lat_count 5\n\
odd{a=\"x\\\"y\"} 1\n";
        let metrics = from_prometheus(text, 1, 2);
        let names: Vec<&str> = metrics.iter().map(|m| m.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "sluice_requests_total",
                "sluice_open",
                "sluice_up_seconds",
                "sluice_lat",
                "odd"
            ]
        );
        assert_eq!(metrics[0].description, "Requests.");
        let Some(metric::Data::Sum(sum)) = &metrics[0].data else {
            panic!("a sum: {:?}", metrics[0]);
        };
        assert!(sum.is_monotonic);
        assert_eq!(sum.data_points.len(), 2);
        assert_eq!(
            sum.data_points[1].value,
            Some(number_data_point::Value::AsDouble(1.0))
        );
        let Some(metric::Data::Histogram(h)) = &metrics[2].data else {
            panic!("a histogram: {:?}", metrics[2]);
        };
        let p = &h.data_points[0];
        assert_eq!(p.explicit_bounds, [0.1, 1.0]);
        assert_eq!(p.bucket_counts, [1, 2, 1]);
        assert_eq!((p.count, p.sum), (4, Some(5.5)));
        assert_eq!(p.attributes.len(), 1);
        let Some(metric::Data::Summary(s)) = &metrics[3].data else {
            panic!("a summary: {:?}", metrics[3]);
        };
        assert_eq!((s.data_points[0].count, s.data_points[0].sum), (5, 1.0));
        let Some(metric::Data::Gauge(g)) = &metrics[4].data else {
            panic!("a gauge: {:?}", metrics[4]);
        };
        let value = g.data_points[0].attributes[0].value.clone();
        assert_eq!(
            value.and_then(|v| v.value),
            Some(any_value::Value::StringValue("x\"y".into()))
        );
    }
}
