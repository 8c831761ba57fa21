//! SPEC O1: OpenTelemetry. `sluice serve --otlp-endpoint` as a real process over
//! loopback, in front of an upstream of the test's own that keeps each request's
//! `traceparent`, sending to an OTLP gRPC receiver of the test's own (tonic with
//! the published `opentelemetry-proto` TraceService) that keeps every span: a
//! span per decided request with the decision as attributes (admitted and
//! refused, on the fast path and the hyper path), the client's trace continued and
//! sluice's span named to the upstream; nothing sent at rest; a collector that
//! never answers slows no request (spans past the queue dropped and counted).

use crate::edit;
use edit::Edit as _;

use crate::support;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use opentelemetry_proto::tonic::collector::metrics::v1::metrics_service_server::{
    MetricsService, MetricsServiceServer,
};
use opentelemetry_proto::tonic::collector::metrics::v1::{
    ExportMetricsServiceRequest, ExportMetricsServiceResponse,
};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value as Any;
use opentelemetry_proto::tonic::metrics::v1::{Metric, metric, number_data_point};
use opentelemetry_proto::tonic::trace::v1::Span;
use support::{DataDir, Sluice, get, send};

/// Bound on every test's whole body.
const TEST_TIMEOUT: Duration = Duration::from_secs(60);

/// Longest wait for spans to reach the receiver (sluice gathers a batch for half
/// a second before it sends it).
const SPANS_WITHIN: Duration = Duration::from_secs(15);

/// The client's trace: its id, and the id of the client's own span.
const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const PARENT_ID: &str = "00f067aa0ba902b7";

async fn bounded<F: Future>(test: F) -> F::Output {
    tokio::time::timeout(TEST_TIMEOUT, test)
        .await
        .expect("test timed out")
}

/// The built-in policy with one expensive call an hour per caller.
fn policy_file(dir: &DataDir) -> String {
    std::fs::create_dir_all(&dir.0).expect("dir");
    let file = dir.0.join("policy.yaml");
    let text = sluice_policy::DEFAULT_POLICY_YAML
        .edit("window_seconds: 60", "window_seconds: 3600")
        .edit("standard: 60, expensive: 30", "standard: 60, expensive: 1");
    std::fs::write(&file, text).expect("write");
    file.to_str().expect("path").to_owned()
}

/// The OTLP receiver: every span it was sent, how many exports and connections,
/// and the metric families of each metric export.
#[derive(Clone, Default)]
struct Receiver {
    spans: Arc<Mutex<Vec<Span>>>,
    exports: Arc<AtomicUsize>,
    connections: Arc<AtomicUsize>,
    metrics: Arc<Mutex<Vec<Vec<Metric>>>>,
}

#[tonic::async_trait]
impl MetricsService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportMetricsServiceRequest>,
    ) -> Result<tonic::Response<ExportMetricsServiceResponse>, tonic::Status> {
        let metrics = request
            .into_inner()
            .resource_metrics
            .into_iter()
            .flat_map(|r| r.scope_metrics)
            .flat_map(|s| s.metrics)
            .collect();
        self.metrics.lock().expect("metrics").push(metrics);
        Ok(tonic::Response::new(ExportMetricsServiceResponse {
            partial_success: None,
        }))
    }
}

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut spans = self.spans.lock().expect("spans");
        for resource in request.into_inner().resource_spans {
            for scope in resource.scope_spans {
                spans.extend(scope.spans);
            }
        }
        self.exports.fetch_add(1, Ordering::SeqCst);
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

impl Receiver {
    /// Serves OTLP gRPC on a free loopback port: its URL.
    async fn start(&self) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let connections = Arc::clone(&self.connections);
        let incoming = futures_util::stream::unfold(listener, move |listener| {
            let connections = Arc::clone(&connections);
            async move {
                let accepted = listener.accept().await.map(|(stream, _)| stream);
                connections.fetch_add(1, Ordering::SeqCst);
                Some((accepted, listener))
            }
        });
        let service = TraceServiceServer::new(self.clone());
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(service)
                .add_service(MetricsServiceServer::new(self.clone()))
                .serve_with_incoming(incoming),
        );
        format!("http://{addr}")
    }

    /// Waits (bounded) until `n` spans have come, and returns them.
    async fn spans(&self, n: usize) -> Vec<Span> {
        let deadline = Instant::now() + SPANS_WITHIN;
        loop {
            let spans = self.spans.lock().expect("spans").clone();
            if spans.len() >= n {
                return spans;
            }
            assert!(
                Instant::now() < deadline,
                "{} span(s) of {n} within {SPANS_WITHIN:?}",
                spans.len()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Receiver {
    /// Waits (bounded) until `n` metric exports have come, and returns them.
    async fn metric_exports(&self, n: usize) -> Vec<Vec<Metric>> {
        let deadline = Instant::now() + SPANS_WITHIN;
        loop {
            let exports = self.metrics.lock().expect("metrics").clone();
            if exports.len() >= n {
                return exports;
            }
            assert!(
                Instant::now() < deadline,
                "{} metric export(s) of {n} within {SPANS_WITHIN:?}",
                exports.len()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// An upstream that answers 200 to everything and keeps each request's
/// `traceparent` (empty when it had none): its URL.
async fn upstream(seen: Arc<Mutex<Vec<String>>>) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let seen = Arc::clone(&seen);
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |r: Request<Incoming>| {
                    let seen = Arc::clone(&seen);
                    async move {
                        let traceparent = r
                            .headers()
                            .get_all("traceparent")
                            .iter()
                            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
                            .collect::<Vec<_>>()
                            .join(",");
                        seen.lock().expect("seen").push(traceparent);
                        Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(
                            Bytes::from_static(b"{}"),
                        )))
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    format!("http://{addr}")
}

/// `POST /chats` as the caller with `key`, with `traceparent` when given.
fn chat(sluice: &Sluice, key: &str, traceparent: Option<&str>) -> Request<Full<Bytes>> {
    let mut request = Request::post(sluice.url("/chats"))
        .header("authorization", format!("Bearer {key}"))
        .header("content-type", "application/json");
    if let Some(t) = traceparent {
        request = request.header("traceparent", t);
    }
    request.body(Full::new(Bytes::new())).expect("request")
}

/// A span's attributes, each as text.
fn attributes(span: &Span) -> HashMap<String, String> {
    span.attributes
        .iter()
        .map(|kv| {
            let value = match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
                Some(Any::StringValue(s)) => s.clone(),
                Some(Any::IntValue(i)) => i.to_string(),
                Some(Any::DoubleValue(d)) => d.to_string(),
                Some(Any::BoolValue(b)) => b.to_string(),
                other => format!("{other:?}"),
            };
            (kv.key.clone(), value)
        })
        .collect()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The fields of a `traceparent` value: trace id, parent id, flags.
fn traceparent_fields(value: &str) -> (String, String, String) {
    let parts: Vec<&str> = value.split('-').collect();
    assert_eq!(parts.len(), 4, "{value}");
    assert_eq!(parts[0], "00", "{value}");
    (parts[1].into(), parts[2].into(), parts[3].into())
}

/// The span whose `sluice.request_id` is `id`.
fn span_of<'s>(spans: &'s [Span], id: &str) -> &'s Span {
    spans
        .iter()
        .find(|s| attributes(s).get("sluice.request_id").map(String::as_str) == Some(id))
        .unwrap_or_else(|| panic!("no span for request {id}: {spans:?}"))
}

#[tokio::test]
async fn o1_spans_carry_the_decision_and_the_client_trace_reaches_the_upstream() {
    let receiver = Receiver::default();
    let seen = Arc::new(Mutex::new(Vec::new()));
    bounded(async {
        let endpoint = receiver.start().await;
        let upstream = upstream(Arc::clone(&seen)).await;
        let dir = DataDir::new();
        let policy = policy_file(&dir);
        let sluice = Sluice::spawn(&[
            "--config",
            &policy,
            "--upstream",
            &upstream,
            "--otlp-endpoint",
            &endpoint,
        ]);
        let incoming = format!("00-{TRACE_ID}-{PARENT_ID}-01");

        // The fast path (HTTP/1.1): admitted, then refused (one call an hour).
        let admitted = send(chat(&sluice, "key-a", Some(&incoming))).await;
        assert_eq!(admitted.status, 200, "{}", admitted.text());
        let refused = send(chat(&sluice, "key-a", Some(&incoming))).await;
        assert_eq!(refused.status, 429, "{}", refused.text());

        // The upstream was sent sluice's span in the client's trace, once.
        let sent = seen.lock().expect("seen").clone();
        assert_eq!(sent.len(), 1, "{sent:?}");
        let (trace, parent, flags) = traceparent_fields(&sent[0]);
        assert_eq!(trace, TRACE_ID);
        assert_ne!(parent, PARENT_ID, "the client's own span passed on");
        assert_eq!(flags, "01");

        let spans = receiver.spans(2).await;
        let id = |reply: &support::Reply| {
            reply
                .headers
                .get("x-request-id")
                .and_then(|v| v.to_str().ok())
                .expect("x-request-id")
                .to_owned()
        };
        let first = span_of(&spans, &id(&admitted));
        assert_eq!(first.name, "sluice.request");
        assert_eq!(hex(&first.trace_id), TRACE_ID);
        assert_eq!(hex(&first.parent_span_id), PARENT_ID);
        assert_eq!(
            hex(&first.span_id),
            parent,
            "the span the upstream was named"
        );
        let a = attributes(first);
        assert_eq!(a["sluice.outcome"], "admitted", "{a:?}");
        assert_eq!(a["sluice.class"], "expensive", "{a:?}");
        assert_eq!(a["sluice.budget"], "expensive", "{a:?}");
        assert_eq!(a["sluice.limit"], "1", "{a:?}");
        assert_eq!(a["sluice.remaining"], "0", "{a:?}");
        assert_eq!(a["http.response.status_code"], "200", "{a:?}");
        let latency: f64 = a["sluice.store.latency_ms"].parse().expect("a number");
        assert!(latency >= 0.0, "{a:?}");

        let second = span_of(&spans, &id(&refused));
        assert_eq!(hex(&second.trace_id), TRACE_ID);
        assert_eq!(hex(&second.parent_span_id), PARENT_ID);
        let r = attributes(second);
        assert_eq!(r["sluice.outcome"], "refused", "{r:?}");
        assert_eq!(r["sluice.reason"], "rate_limited", "{r:?}");
        assert_eq!(r["sluice.class"], "expensive", "{r:?}");
        assert_eq!(r["sluice.budget"], "expensive", "{r:?}");
        assert_eq!(r["sluice.limit"], "1", "{r:?}");
        assert_eq!(r["sluice.remaining"], "0", "{r:?}");
        assert_eq!(r["http.response.status_code"], "429", "{r:?}");

        // The hyper path (HTTP/2 with prior knowledge), a request that starts
        // its trace at sluice: a root span, named to the upstream.
        let h2 = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
            .http2_only(true)
            .build_http::<Full<Bytes>>();
        let response = tokio::time::timeout(
            support::HTTP_TIMEOUT,
            h2.request(chat(&sluice, "key-b", None)),
        )
        .await
        .expect("in time")
        .expect("an answer over HTTP/2");
        assert_eq!(response.status(), 200);
        assert_eq!(response.version(), http::Version::HTTP_2);
        let request_id = response
            .headers()
            .get("x-request-id")
            .and_then(|v| v.to_str().ok())
            .expect("x-request-id")
            .to_owned();
        let sent = seen.lock().expect("seen").clone();
        assert_eq!(sent.len(), 2, "{sent:?}");
        let (trace, parent, _) = traceparent_fields(&sent[1]);
        let spans = receiver.spans(3).await;
        let third = span_of(&spans, &request_id);
        assert!(third.parent_span_id.is_empty(), "a root span");
        assert_eq!(hex(&third.trace_id), trace);
        assert_eq!(hex(&third.span_id), parent);
        let h = attributes(third);
        assert_eq!(h["sluice.outcome"], "admitted", "{h:?}");
        assert_eq!(h["sluice.remaining"], "0", "{h:?}");
        assert_eq!(h["http.response.status_code"], "200", "{h:?}");

        let metrics = get(&sluice.admin_url("/metrics")).await.text();
        assert!(
            metrics.contains("sluice_otlp_spans_dropped_total 0"),
            "{metrics}"
        );

        // The metrics `/metrics` has went too: the requests, by status.
        let exports = receiver.metric_exports(1).await;
        let requests = exports
            .iter()
            .flatten()
            .find(|m| m.name == "sluice_requests_total")
            .unwrap_or_else(|| panic!("no sluice_requests_total: {exports:?}"));
        let Some(metric::Data::Sum(sum)) = &requests.data else {
            panic!("a sum: {requests:?}");
        };
        assert!(sum.is_monotonic);
        let ok = sum
            .data_points
            .iter()
            .find(|p| {
                p.attributes.iter().any(|kv| {
                    kv.key == "status"
                        && matches!(
                            kv.value.as_ref().and_then(|v| v.value.as_ref()),
                            Some(Any::StringValue(s)) if s == "200"
                        )
                })
            })
            .unwrap_or_else(|| panic!("no status 200: {sum:?}"));
        assert!(
            matches!(ok.value, Some(number_data_point::Value::AsDouble(v)) if v >= 1.0),
            "{ok:?}"
        );
    })
    .await;
}

/// SPEC S1 with O1: a process with an endpoint but no requests connects to the
/// collector not once; after a request's span is sent, nothing more is.
#[tokio::test]
async fn o1_an_idle_process_exports_nothing() {
    let receiver = Receiver::default();
    bounded(async {
        let endpoint = receiver.start().await;
        let sluice = Sluice::spawn(&["--otlp-endpoint", &endpoint]);
        // Four times the batch's wait: a span would have been sent by then.
        let observe = Duration::from_secs(2);
        tokio::time::sleep(observe).await;
        assert_eq!(receiver.connections.load(Ordering::SeqCst), 0);
        assert_eq!(receiver.exports.load(Ordering::SeqCst), 0);

        let reply = get(&sluice.url("/search/fields")).await;
        assert!(reply.status.as_u16() < 500, "{}", reply.status);
        receiver.spans(1).await;
        // The metrics follow the activity once.
        let metrics = receiver.metric_exports(1).await;
        let exports = receiver.exports.load(Ordering::SeqCst);
        tokio::time::sleep(observe).await;
        assert_eq!(receiver.exports.load(Ordering::SeqCst), exports);
        assert_eq!(receiver.spans.lock().expect("spans").len(), 1);
        assert_eq!(
            receiver.metrics.lock().expect("metrics").len(),
            metrics.len(),
            "metrics sent at rest"
        );
    })
    .await;
}

/// A collector that takes the connection and never answers: requests are
/// answered as without one, and spans past the queue are dropped and counted.
#[tokio::test]
async fn o1_a_collector_that_never_answers_slows_no_request() {
    bounded(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr: SocketAddr = listener.local_addr().expect("addr");
        let (accepted, mut connected) = tokio::sync::mpsc::channel(4);
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((stream, _)) = listener.accept().await {
                held.push(stream);
                let _ = accepted.try_send(());
            }
        });
        let sluice = Sluice::spawn(&[
            "--otlp-endpoint",
            &format!("http://{addr}"),
            "--otlp-max-queue",
            "8",
        ]);
        // One span: its export connects and hangs.
        let first = get(&sluice.url("/search/fields")).await;
        assert!(first.status.as_u16() < 500, "{}", first.status);
        connected.recv().await.expect("the export connects");
        // The export holds its batch; eight more wait in the queue, the rest are
        // dropped. Each request is answered meanwhile.
        for _ in 0..20 {
            let began = Instant::now();
            let reply = get(&sluice.url("/search/fields")).await;
            assert!(reply.status.as_u16() < 500, "{}", reply.status);
            assert!(
                began.elapsed() < Duration::from_secs(5),
                "a request took {:?}",
                began.elapsed()
            );
        }
        let metrics = get(&sluice.admin_url("/metrics")).await.text();
        let dropped: u64 = metrics
            .lines()
            .find_map(|l| l.strip_prefix("sluice_otlp_spans_dropped_total "))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no dropped count: {metrics}"));
        assert!(dropped >= 12, "dropped {dropped}: {metrics}");
    })
    .await;
}

/// Without `--otlp-endpoint` sluice neither reads nor replaces a `traceparent`:
/// the upstream gets the client's own.
#[tokio::test]
async fn o1_without_an_endpoint_the_clients_traceparent_passes_unchanged() {
    let seen = Arc::new(Mutex::new(Vec::new()));
    bounded(async {
        let upstream = upstream(Arc::clone(&seen)).await;
        let sluice = Sluice::spawn(&["--upstream", &upstream]);
        let incoming = format!("00-{TRACE_ID}-{PARENT_ID}-01");
        let reply = send(chat(&sluice, "key-a", Some(&incoming))).await;
        assert_eq!(reply.status, 200, "{}", reply.text());
        assert_eq!(*seen.lock().expect("seen"), vec![incoming]);
    })
    .await;
}

/// `--otlp-protocol http/protobuf`: the spans are POSTed as protobuf to the URL's
/// `/v1/traces`.
#[tokio::test]
async fn o1_spans_go_over_otlp_http_protobuf_too() {
    let bodies: Arc<Mutex<Vec<(String, Bytes)>>> = Arc::default();
    bounded(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let kept = Arc::clone(&bodies);
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let kept = Arc::clone(&kept);
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |r: Request<Incoming>| {
                        let kept = Arc::clone(&kept);
                        async move {
                            use http_body_util::BodyExt as _;
                            let path = r.uri().path().to_owned();
                            let body = r.into_body().collect().await?.to_bytes();
                            kept.lock().expect("kept").push((path, body));
                            Ok::<_, hyper::Error>(http::Response::new(Full::new(Bytes::new())))
                        }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        let sluice = Sluice::spawn(&[
            "--otlp-endpoint",
            &format!("http://{addr}"),
            "--otlp-protocol",
            "http/protobuf",
        ]);
        let reply = get(&sluice.url("/search/fields")).await;
        // The spans to /v1/traces, then the metrics to /v1/metrics.
        let posted = |path: &str| {
            let deadline = Instant::now() + SPANS_WITHIN;
            let path = path.to_owned();
            let bodies = Arc::clone(&bodies);
            async move {
                loop {
                    let found = bodies
                        .lock()
                        .expect("bodies")
                        .iter()
                        .find(|(p, _)| *p == path)
                        .map(|(_, body)| body.clone());
                    if let Some(body) = found {
                        return body;
                    }
                    assert!(
                        Instant::now() < deadline,
                        "nothing POSTed to {path} within {SPANS_WITHIN:?}"
                    );
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        };
        use prost::Message as _;
        let traces = ExportTraceServiceRequest::decode(posted("/v1/traces").await)
            .expect("an OTLP trace export");
        let spans: Vec<Span> = traces
            .resource_spans
            .into_iter()
            .flat_map(|r| r.scope_spans)
            .flat_map(|s| s.spans)
            .collect();
        assert_eq!(spans.len(), 1, "{spans:?}");
        let a = attributes(&spans[0]);
        assert_eq!(a["sluice.outcome"], "admitted", "{a:?}");
        assert_eq!(
            a["http.response.status_code"],
            reply.status.as_u16().to_string(),
            "{a:?}"
        );
        let metrics = ExportMetricsServiceRequest::decode(posted("/v1/metrics").await)
            .expect("an OTLP metric export");
        assert!(
            metrics
                .resource_metrics
                .iter()
                .flat_map(|r| &r.scope_metrics)
                .flat_map(|s| &s.metrics)
                .any(|m| m.name == "sluice_requests_total"),
            "{metrics:?}"
        );
    })
    .await;
}

/// Envoy's rate-limit service (`--rls`): a span per `ShouldRateLimit` call, its
/// parent the `traceparent` of the call's metadata, with the call's decision.
#[tokio::test]
async fn o1_rate_limit_service_calls_get_spans_with_their_decision() {
    use sluice_rls::proto::rate_limit_descriptor::Entry;
    use sluice_rls::proto::rate_limit_service_client::RateLimitServiceClient;
    use sluice_rls::proto::{RateLimitDescriptor, RateLimitRequest};

    let receiver = Receiver::default();
    bounded(async {
        let endpoint = receiver.start().await;
        let dir = DataDir::new();
        std::fs::create_dir_all(&dir.0).expect("dir");
        let domains = "domains:
  - domain: api
    descriptors:
      - key: user
        rate_limit: { unit: hour, requests_per_unit: 1, name: per_user }
";
        let yaml =
            sluice_policy::DEFAULT_POLICY_YAML.edit("headers:\n", &format!("{domains}headers:\n"));
        let policy = dir.0.join("rls.yaml");
        std::fs::write(&policy, yaml).expect("write");
        let sluice = Sluice::spawn(&[
            "--config",
            policy.to_str().expect("path"),
            "--rls",
            "127.0.0.1:0",
            "--otlp-endpoint",
            &endpoint,
        ]);
        let rls = sluice.start.rls.expect("the rls address");
        let mut client = RateLimitServiceClient::connect(format!("http://{rls}"))
            .await
            .expect("connect");
        let call = || {
            let mut request = tonic::Request::new(RateLimitRequest {
                domain: "api".into(),
                descriptors: vec![RateLimitDescriptor {
                    entries: vec![Entry {
                        key: "user".into(),
                        value: "ann".into(),
                    }],
                    ..Default::default()
                }],
                hits_addend: 0,
            });
            request.metadata_mut().insert(
                "traceparent",
                format!("00-{TRACE_ID}-{PARENT_ID}-01")
                    .parse()
                    .expect("metadata"),
            );
            request
        };
        let ok = client.should_rate_limit(call()).await.expect("call");
        assert_eq!(ok.into_inner().overall_code, 1, "OK");
        let over = client.should_rate_limit(call()).await.expect("call");
        assert_eq!(over.into_inner().overall_code, 2, "OVER_LIMIT");

        let spans = receiver.spans(2).await;
        let mut outcomes = Vec::new();
        for span in &spans {
            assert_eq!(span.name, "sluice.rls");
            assert_eq!(hex(&span.trace_id), TRACE_ID);
            assert_eq!(hex(&span.parent_span_id), PARENT_ID);
            let a = attributes(span);
            assert_eq!(a["sluice.rls.domain"], "api", "{a:?}");
            assert_eq!(a["sluice.budget"], "per_user", "{a:?}");
            assert_eq!(a["sluice.limit"], "1", "{a:?}");
            assert_eq!(a["sluice.remaining"], "0", "{a:?}");
            assert!(a.contains_key("sluice.store.latency_ms"), "{a:?}");
            outcomes.push(a["sluice.outcome"].clone());
        }
        outcomes.sort();
        assert_eq!(outcomes, ["admitted", "refused"]);
    })
    .await;
}

/// `--otlp-sample-ratio 0`: a trace that starts at sluice is not kept (its
/// context still goes upstream, unsampled), one whose `traceparent` is sampled
/// is (parent-based sampling).
#[tokio::test]
async fn o1_sampling_keeps_none_of_its_own_traces_at_ratio_0_but_follows_a_sampled_parent() {
    let receiver = Receiver::default();
    let seen = Arc::new(Mutex::new(Vec::new()));
    bounded(async {
        let endpoint = receiver.start().await;
        let upstream = upstream(Arc::clone(&seen)).await;
        let sluice = Sluice::spawn(&[
            "--upstream",
            &upstream,
            "--otlp-endpoint",
            &endpoint,
            "--otlp-sample-ratio",
            "0",
        ]);
        let own = send(chat(&sluice, "key-a", None)).await;
        assert_eq!(own.status, 200, "{}", own.text());
        let incoming = format!("00-{TRACE_ID}-{PARENT_ID}-01");
        let continued = send(chat(&sluice, "key-b", Some(&incoming))).await;
        assert_eq!(continued.status, 200, "{}", continued.text());

        let sent = seen.lock().expect("seen").clone();
        assert_eq!(sent.len(), 2, "{sent:?}");
        let (own_trace, _, own_flags) = traceparent_fields(&sent[0]);
        assert_ne!(own_trace, TRACE_ID);
        assert_eq!(own_flags, "00", "unsampled");
        let (trace, _, flags) = traceparent_fields(&sent[1]);
        assert_eq!((trace.as_str(), flags.as_str()), (TRACE_ID, "01"));

        // Spans leave in the order they end: the first request's would have come
        // no later than the second's.
        let spans = receiver.spans(1).await;
        assert_eq!(spans.len(), 1, "{spans:?}");
        assert_eq!(hex(&spans[0].trace_id), TRACE_ID);
    })
    .await;
}

/// Forward auth (`--check`): the check of the proxy's request is a decided
/// request with its span, its parent the `traceparent` the proxy passed on.
#[tokio::test]
async fn o1_forward_auth_checks_get_spans_with_their_decision() {
    let receiver = Receiver::default();
    bounded(async {
        let endpoint = receiver.start().await;
        let dir = DataDir::new();
        let policy = policy_file(&dir);
        let sluice = Sluice::spawn(&[
            "--config",
            &policy,
            "--check",
            "127.0.0.1:0",
            "--otlp-endpoint",
            &endpoint,
        ]);
        let check = || {
            Request::get(sluice.check_url("/check"))
                // As Traefik and Caddy ask (nginx's style gets 403 for a refusal).
                .header("x-forwarded-method", "POST")
                .header("x-forwarded-uri", "/chats")
                .header("authorization", "Bearer key-a")
                .header("traceparent", format!("00-{TRACE_ID}-{PARENT_ID}-01"))
                .body(Full::new(Bytes::new()))
                .expect("request")
        };
        assert_eq!(send(check()).await.status, 204);
        assert_eq!(send(check()).await.status, 429);
        let spans = receiver.spans(2).await;
        let mut seen = Vec::new();
        for span in &spans {
            assert_eq!(span.name, "sluice.request");
            assert_eq!(hex(&span.trace_id), TRACE_ID);
            assert_eq!(hex(&span.parent_span_id), PARENT_ID);
            let a = attributes(span);
            assert_eq!(a["sluice.class"], "expensive", "{a:?}");
            assert_eq!(a["sluice.limit"], "1", "{a:?}");
            assert_eq!(a["sluice.remaining"], "0", "{a:?}");
            seen.push((
                a["sluice.outcome"].clone(),
                a["http.response.status_code"].clone(),
            ));
        }
        seen.sort();
        assert_eq!(
            seen,
            [
                ("admitted".to_owned(), "204".to_owned()),
                ("refused".to_owned(), "429".to_owned())
            ]
        );
    })
    .await;
}
