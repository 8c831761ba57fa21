//! How long a client connection has had no request in flight.
//!
//! hyper closes an HTTP/1.1 connection whose next request head does not come within
//! its head timeout, but it keeps an HTTP/2 connection with no stream open for as long
//! as the client answers its pings: a client could hold its connection slots for ever.
//! [`Streams`] counts one connection's requests in flight, each from the moment hyper
//! hands it to the service until its response body has been sent whole or dropped (so
//! a long streamed answer, an SSE or MCP stream, counts until its last byte), and
//! notes when the last one ended; [`Streams::idle_for`] resolves once none has been in
//! flight for a given time, and the connection is then shut down gracefully.
//!
//! What it costs: per request, an atomic increment when it starts and, when its body
//! ends, a clock read and two atomic updates; per connection, one timer, which fires
//! once per idle period (while requests are in flight, once per period to look again)
//! and never in between.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use http_body::{Body, Frame, SizeHint};
use tokio::time::Instant;

/// The requests in flight on one client connection (for HTTP/2, its open streams).
/// Cheap to clone: clones count together.
#[derive(Clone, Debug)]
pub(crate) struct Streams(Arc<Counts>);

#[derive(Debug)]
struct Counts {
    /// Requests in flight.
    open: AtomicUsize,
    /// When the latest request ended (at first: when the connection was served), in
    /// nanoseconds since `start`.
    last_end: AtomicU64,
    start: Instant,
}

impl Streams {
    /// A connection served from now, with no request in flight yet.
    pub(crate) fn new() -> Self {
        Streams(Arc::new(Counts {
            open: AtomicUsize::new(0),
            last_end: AtomicU64::new(0),
            start: Instant::now(),
        }))
    }

    /// Counts one request in flight until the returned guard is dropped.
    pub(crate) fn open(&self) -> OpenStream {
        self.0.open.fetch_add(1, Ordering::Relaxed);
        OpenStream(Arc::clone(&self.0))
    }

    /// Requests in flight now.
    #[cfg(test)]
    fn in_flight(&self) -> usize {
        self.0.open.load(Ordering::Relaxed)
    }

    /// Since when no request has been in flight; `None` while one is.
    fn quiet_since(&self) -> Option<Instant> {
        // Acquire: the end that brought the count to zero noted its time before.
        if self.0.open.load(Ordering::Acquire) > 0 {
            return None;
        }
        let nanos = self.0.last_end.load(Ordering::Relaxed);
        Some(self.0.start + Duration::from_nanos(nanos))
    }

    /// Resolves once no request has been in flight for `timeout`. Its one timer fires
    /// when the quiet would reach `timeout`, or, while requests are in flight, once
    /// every `timeout` to look again.
    pub(crate) async fn idle_for(&self, timeout: Duration) {
        let timer = tokio::time::sleep_until(self.0.start + timeout);
        tokio::pin!(timer);
        loop {
            timer.as_mut().await;
            let now = Instant::now();
            let next = match self.quiet_since() {
                Some(since) if now.saturating_duration_since(since) >= timeout => return,
                Some(since) => since + timeout,
                None => now + timeout,
            };
            timer.as_mut().reset(next);
        }
    }
}

/// One request in flight on a connection, counted until dropped.
#[derive(Debug)]
pub(crate) struct OpenStream(Arc<Counts>);

impl Drop for OpenStream {
    fn drop(&mut self) {
        let counts = &self.0;
        let since_start = Instant::now().saturating_duration_since(counts.start);
        let nanos = u64::try_from(since_start.as_nanos()).unwrap_or(u64::MAX);
        // The latest end wins, whichever of two ending at once writes last.
        counts.last_end.fetch_max(nanos, Ordering::Relaxed);
        // Release: the time above is seen by whoever sees the count this leaves.
        counts.open.fetch_sub(1, Ordering::Release);
    }
}

/// A response body that keeps its request counted in flight until it is dropped
/// (hyper drops it once sent whole, or when the stream or connection ends first).
#[derive(Debug)]
pub(crate) struct CountedBody<B> {
    body: B,
    _open: Option<OpenStream>,
}

impl<B> CountedBody<B> {
    /// `body`, keeping `open` (when there is one) until it is dropped.
    pub(crate) fn new(body: B, open: Option<OpenStream>) -> Self {
        CountedBody { body, _open: open }
    }
}

impl<B: Body + Unpin> Body for CountedBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use bytes::Bytes;
    use http_body_util::{BodyExt as _, Full};

    const TIMEOUT: Duration = Duration::from_secs(30);

    #[tokio::test(start_paused = true)]
    async fn a_connection_is_idle_once_nothing_has_been_in_flight_for_the_timeout() {
        let streams = Streams::new();
        let start = Instant::now();
        streams.idle_for(TIMEOUT).await;
        assert_eq!(start.elapsed(), TIMEOUT);

        // A request that starts, then ends 50 s later: idle 30 s after its end.
        let open = streams.open();
        let idle = {
            let streams = streams.clone();
            tokio::spawn(async move {
                streams.idle_for(TIMEOUT).await;
                Instant::now()
            })
        };
        tokio::time::sleep(Duration::from_secs(50)).await;
        let ended = Instant::now();
        drop(open);
        assert_eq!(streams.in_flight(), 0);
        let idle_at = idle.await.expect("idle task");
        assert_eq!(idle_at - ended, TIMEOUT);
    }

    #[tokio::test(start_paused = true)]
    async fn a_response_body_counts_until_it_is_dropped() {
        let streams = Streams::new();
        let mut body = CountedBody::new(Full::new(Bytes::from_static(b"ok")), Some(streams.open()));
        assert_eq!(streams.in_flight(), 1);
        let frame = body.frame().await.expect("a frame").expect("data");
        assert_eq!(frame.into_data().expect("data"), "ok");
        assert!(body.is_end_stream());
        assert_eq!(streams.in_flight(), 1);
        drop(body);
        assert_eq!(streams.in_flight(), 0);
    }
}
