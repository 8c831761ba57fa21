//! The simulated provider served: in the caller's task as a tower service
//! ([`SimService`]) or on a local socket ([`Simulator`]).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::json;
use sluice_core::{Clock, Timestamp};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use super::answer::{SimBody, answer, full};
use super::book::{Book, Shared};
use super::config::{LATENCY_HEADER, SimModel, SimulatorConfig, SimulatorStats};
use crate::clock::TokioClock;

/// The simulated provider without a socket: a tower service answering in
/// the caller's task (benchmarks on paused time use it).
#[derive(Clone)]
pub struct SimService {
    pub(super) shared: Arc<Shared>,
}

impl std::fmt::Debug for SimService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimService").finish()
    }
}

impl SimService {
    /// A provider reading time from `clock`.
    pub fn new(config: SimulatorConfig, clock: Arc<dyn Clock>) -> Self {
        config.encoding.warm();
        SimService {
            shared: Arc::new(Shared::new(config, clock)),
        }
    }

    /// The counters so far.
    pub fn stats(&self) -> SimulatorStats {
        self.shared.book.lock().stats
    }

    /// Gives these models their own limits (and fresh books) from the next
    /// request on.
    pub fn set_models(&self, models: impl IntoIterator<Item = SimModel>) {
        *self.shared.models.lock() = models.into_iter().map(|m| (m, Book::default())).collect();
    }

    /// The counters of the model entry `pattern` ([`SimService::set_models`]).
    pub fn model_stats(&self, pattern: &str) -> Option<SimulatorStats> {
        self.shared.model_stats(pattern)
    }

    /// Arrival time and counted tokens of every admitted request.
    pub fn arrivals(&self) -> Vec<(Timestamp, u64)> {
        self.shared.book.lock().log.clone()
    }
}

impl<B> tower::Service<Request<B>> for SimService
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: std::error::Error + Send + Sync + 'static,
{
    type Response = Response<SimBody>;
    type Error = Infallible;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Response<SimBody>, Infallible>> + Send>,
    >;

    fn poll_ready(
        &mut self,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Infallible>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let shared = self.shared.clone();
        Box::pin(async move {
            let method = req.method().clone();
            let path = req.uri().path().to_owned();
            let latency = latency_of(req.headers());
            let body = match Limited::new(req.into_body(), 32 << 20).collect().await {
                Ok(c) => c.to_bytes(),
                Err(_) => Bytes::new(),
            };
            Ok(answer(shared, method, path, latency, body).await)
        })
    }
}

/// A running simulator (stops when dropped).
pub struct Simulator {
    pub(super) addr: SocketAddr,
    pub(super) shared: Arc<Shared>,
    pub(super) task: JoinHandle<()>,
}

impl std::fmt::Debug for Simulator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Simulator")
            .field("addr", &self.addr)
            .finish()
    }
}

impl Simulator {
    /// Starts on `127.0.0.1:0` with the real clock (read through tokio).
    ///
    /// # Errors
    /// When the listener cannot be bound.
    pub async fn start(config: SimulatorConfig) -> std::io::Result<Self> {
        Self::start_with_clock(config, Arc::new(TokioClock::system())).await
    }

    /// Starts on `127.0.0.1:0` reading time from `clock`.
    ///
    /// # Errors
    /// When the listener cannot be bound.
    pub async fn start_with_clock(
        config: SimulatorConfig,
        clock: Arc<dyn Clock>,
    ) -> std::io::Result<Self> {
        config.encoding.warm();
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared::new(config, clock));
        let s = shared.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let s = s.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req| {
                        let s = s.clone();
                        async move { Ok::<_, Infallible>(handle(s, req).await) }
                    });
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Ok(Simulator { addr, shared, task })
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:<port>/v1`, a provider's `baseUrl`.
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// The counters so far.
    pub fn stats(&self) -> SimulatorStats {
        self.shared.book.lock().stats
    }

    /// Arrival time and counted tokens of every admitted request.
    pub fn arrivals(&self) -> Vec<(Timestamp, u64)> {
        self.shared.book.lock().log.clone()
    }

    /// Changes the limits and behaviour from the next request on.
    pub fn set_config(&self, config: SimulatorConfig) {
        *self.shared.config.lock() = config;
    }

    /// Gives these models their own limits (and fresh books) from the next
    /// request on.
    pub fn set_models(&self, models: impl IntoIterator<Item = SimModel>) {
        *self.shared.models.lock() = models.into_iter().map(|m| (m, Book::default())).collect();
    }

    /// The counters of the model entry `pattern` ([`Simulator::set_models`]).
    pub fn model_stats(&self, pattern: &str) -> Option<SimulatorStats> {
        self.shared.model_stats(pattern)
    }
}

impl Drop for Simulator {
    fn drop(&mut self) {
        self.task.abort();
    }
}

pub(super) async fn handle(shared: Arc<Shared>, req: Request<Incoming>) -> Response<SimBody> {
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let latency = latency_of(req.headers());
    match Limited::new(req.into_body(), 32 << 20).collect().await {
        Ok(c) => answer(shared, method, path, latency, c.to_bytes()).await,
        Err(_) => full(
            StatusCode::PAYLOAD_TOO_LARGE,
            &json!({"error":{"message":"body too large"}}),
        ),
    }
}

/// The latency a request asks for ([`LATENCY_HEADER`]), if any.
pub(super) fn latency_of(headers: &http::HeaderMap) -> Option<Duration> {
    headers
        .get(LATENCY_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(Duration::from_millis)
}
