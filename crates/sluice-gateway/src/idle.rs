//! How long a client connection has had no request in flight, and which of its
//! streams' clients have stopped taking their answers.
//!
//! hyper closes an HTTP/1.1 connection whose next request head does not come within
//! its head timeout, but it keeps an HTTP/2 connection with no stream open for as long
//! as the client answers its pings: a client could hold its connection slots for ever.
//! [`Streams`] counts one connection's requests in flight, each from the moment hyper
//! hands it to the service until its response body has been sent whole or dropped (so
//! a long streamed answer, an SSE or MCP stream, counts until its last byte; over
//! HTTP/2, until that byte has been written out), and notes when the last one ended;
//! [`Streams::idle_for`] resolves once none has been in flight for a given time, and
//! the connection is then shut down gracefully.
//!
//! An HTTP/2 client can also stall one stream's answer for ever with flow control (a
//! window of 0, or no `WINDOW_UPDATE`): hyper then holds the piece of data the body
//! handed it and never asks the body for more, nothing waits on the socket, and the
//! body, with the upstream connection it streams from, would be held for as long as
//! the connection lives. So each answer of such a connection keeps the HTTP/1.1 send
//! timeout's meaning per stream: while data the body handed over has not all been
//! written out, the client must take some of it within the send timeout. Otherwise
//! the body is dropped (the upstream side released, the stream no longer in flight)
//! and the stream ends with an error, and so a reset, if hyper ever asks it again. A
//! body waiting on its upstream with all it handed written out is never cut: a slow
//! upstream or a quiet SSE stream waits as long as it likes.
//!
//! The watch needs no timer of its own: the idle timer, which looks at least once per
//! send timeout while requests are in flight, also looks at the answers whose data
//! waits, and is set for the first of their deadlines.
//!
//! What it costs: per request, an atomic increment when it starts and, when its body
//! ends, a clock read and two atomic updates. Per HTTP/2 stream on top: one small
//! allocation (the answer's slot, which the connection's watch refers to weakly) and
//! an uncontended lock of the watch in and out; per poll of the body an uncontended
//! lock; per piece of data handed, a reference count and an atomic increment (and a
//! clock read when no other piece was waiting); per write of data to the client, an
//! atomic store (and one decrement per piece). Per connection, one timer, which
//! fires once per idle period (while requests are in flight, once per period to look
//! again, and when data waiting on a client would reach the send timeout) and never
//! in between; each look at the answers collects them into one short list.

use std::fmt;
use std::io::IoSlice;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes};
use http_body::{Body, Frame, SizeHint};
use parking_lot::Mutex;
use tokio::time::Instant;

use super::boxed::BoxError;

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
    /// The response bodies being sent, watched for a client that stalls them.
    sending: Mutex<Sending>,
}

/// Nanoseconds from `start` to `at` (`at` before `start` counts as `start`).
fn nanos_since(start: Instant, at: Instant) -> u64 {
    let since = at.saturating_duration_since(start);
    u64::try_from(since.as_nanos()).unwrap_or(u64::MAX - 1)
}

impl Streams {
    /// A connection served from now, with no request in flight yet.
    pub(crate) fn new() -> Self {
        Streams(Arc::new(Counts {
            open: AtomicUsize::new(0),
            last_end: AtomicU64::new(0),
            start: Instant::now(),
            sending: Mutex::new(Sending::default()),
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

    /// Resolves once no request has been in flight for `timeout`. Meanwhile it ends
    /// each stream whose client has taken nothing of its answer for `send_timeout`
    /// (see the module's notes). Its one timer fires when the quiet would reach
    /// `timeout`, when a stream waiting on its client would reach `send_timeout`,
    /// or, while requests are in flight, once every `timeout` (at most every
    /// `send_timeout`, so that no stall is seen late) to look again.
    pub(crate) async fn idle_for(&self, timeout: Duration, send_timeout: Duration) {
        let look_every = timeout.min(send_timeout);
        let timer = tokio::time::sleep_until(self.0.start + timeout);
        tokio::pin!(timer);
        loop {
            timer.as_mut().await;
            let now = Instant::now();
            // First: a stream cut here no longer counts in flight.
            let stall = self.cut_stalled(now, send_timeout);
            let next = match self.quiet_since() {
                Some(since) if now.saturating_duration_since(since) >= timeout => return,
                Some(since) => since + timeout,
                None => now + look_every,
            };
            timer
                .as_mut()
                .reset(stall.map_or(next, |stall| stall.min(next)));
        }
    }
}

/// One request in flight on a connection, counted until dropped.
#[derive(Debug)]
pub(crate) struct OpenStream(Arc<Counts>);

impl Drop for OpenStream {
    fn drop(&mut self) {
        let counts = &self.0;
        let nanos = nanos_since(counts.start, Instant::now());
        // The latest end wins, whichever of two ending at once writes last.
        counts.last_end.fetch_max(nanos, Ordering::Relaxed);
        // Release: the time above is seen by whoever sees the count this leaves.
        counts.open.fetch_sub(1, Ordering::Release);
    }
}

/// One connection's response bodies being sent: a slab whose free places are reused,
/// so it holds at most as many places as the connection ever had answers being sent
/// at once.
#[derive(Default)]
struct Sending {
    places: Vec<Option<Weak<dyn Watched>>>,
    free: Vec<usize>,
}

impl fmt::Debug for Sending {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sending")
            .field("answers", &(self.places.len() - self.free.len()))
            .finish()
    }
}

impl Sending {
    /// Watches `answer`: the place to give back with [`Sending::remove`].
    fn insert(&mut self, answer: Weak<dyn Watched>) -> usize {
        match self.free.pop() {
            Some(place) => {
                self.places[place] = Some(answer);
                place
            }
            None => {
                self.places.push(Some(answer));
                self.places.len() - 1
            }
        }
    }

    fn remove(&mut self, place: usize) {
        if let Some(answer) = self.places.get_mut(place)
            && answer.take().is_some()
        {
            self.free.push(place);
        }
    }
}

impl Streams {
    /// Ends every answer whose client has taken nothing of it for `send_timeout` at
    /// `now`: when the next of the others would be.
    fn cut_stalled(&self, now: Instant, send_timeout: Duration) -> Option<Instant> {
        // Looked at out of the lock: an answer whose last owner is this look
        // leaves the watch as it goes.
        let answers: Vec<Arc<dyn Watched>> = {
            let sending = self.0.sending.lock();
            sending
                .places
                .iter()
                .flatten()
                .filter_map(Weak::upgrade)
                .collect()
        };
        answers
            .iter()
            .filter_map(|answer| answer.cut_if_stalled(now, send_timeout))
            .min()
    }
}

/// An answer the connection watches for a client that stalls it.
trait Watched: Send + Sync {
    /// Ends the answer when, at `now`, its client has taken nothing of it for
    /// `send_timeout`; otherwise when that would be, if data waits on the client.
    fn cut_if_stalled(&self, now: Instant, send_timeout: Duration) -> Option<Instant>;
}

/// An HTTP/2 answer: its response body, shared between its stream (which polls it),
/// the pieces of its data on their way to the client, and its connection's watch
/// (which ends it when the client stalls it). It lives until the body has been
/// dropped and its last piece has been written out or dropped.
struct Slot<B> {
    state: Mutex<Answer<B>>,
    /// Pieces of data handed to hyper that have not all been written out.
    pending: AtomicUsize,
    /// Since when data has waited on the client (from the moment `pending` left
    /// 0, or the watch last saw the client take some), in nanoseconds since `start`.
    since: AtomicU64,
    /// Set when the client has taken some of the data (h2 wrote some out); the
    /// watch clears it when it looks.
    took: AtomicBool,
    /// The connection's start, the origin of `since`.
    start: Instant,
    /// The connection, and this answer's place in its watch.
    counts: Arc<Counts>,
    place: usize,
}

/// What a stalled client's answer gives up.
struct Answer<B> {
    /// The body (the upstream's side), until sent whole, dropped by hyper, or cut.
    body: Option<B>,
    /// The request's count in flight, until its data has all been written out
    /// (or dropped), or the answer is cut.
    open: Option<OpenStream>,
}

impl<B> Slot<B> {
    fn now_nanos(&self) -> u64 {
        nanos_since(self.start, Instant::now())
    }

    /// `data` on its way to the client, counted as waiting on it until written out.
    fn sent(self: &Arc<Self>, data: B::Data) -> Sent<B>
    where
        B: Body,
    {
        if !data.has_remaining() {
            return Sent { data, slot: None };
        }
        // Only the stream's task hands data: no other piece can start waiting
        // between the look and the count.
        if self.pending.load(Ordering::Acquire) == 0 {
            self.since.store(self.now_nanos(), Ordering::Relaxed);
            self.took.store(false, Ordering::Relaxed);
        }
        // Release: whoever sees the count sees its start above.
        self.pending.fetch_add(1, Ordering::Release);
        Sent {
            data,
            slot: Some(Arc::clone(self)),
        }
    }

    fn poll_frame(
        self: &Arc<Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Sent<B>>, BoxError>>>
    where
        B: Body + Unpin,
        B::Error: Into<BoxError>,
    {
        let polled = {
            let mut answer = self.state.lock();
            let Some(body) = answer.body.as_mut() else {
                return Poll::Ready(Some(Err(Stalled.into())));
            };
            Pin::new(body).poll_frame(cx)
        };
        polled.map(|frame| {
            frame.map(|frame| {
                frame
                    .map(|frame| frame.map_data(|data| self.sent(data)))
                    .map_err(Into::into)
            })
        })
    }
}

impl<B: Send> Watched for Slot<B> {
    fn cut_if_stalled(&self, now: Instant, send_timeout: Duration) -> Option<Instant> {
        let mut answer = self.state.lock();
        if answer.open.is_none() || self.pending.load(Ordering::Acquire) == 0 {
            return None;
        }
        let mut since = self.start + Duration::from_nanos(self.since.load(Ordering::Relaxed));
        if self.took.swap(false, Ordering::Relaxed) {
            // The client took some since the last look: its time counts from now
            // (a write notes no time, which would cost a clock read each).
            since = now;
            self.since
                .store(nanos_since(self.start, now), Ordering::Relaxed);
        }
        let deadline = since + send_timeout;
        if now < deadline {
            return Some(deadline);
        }
        let body = answer.body.take();
        let open = answer.open.take();
        drop(answer);
        crate::stalled::count(crate::stalled::Cut::Stream);
        tracing::debug!(
            "an HTTP/2 client took nothing of its answer for {send_timeout:?}: its body is dropped"
        );
        drop(body);
        drop(open);
        None
    }
}

impl<B> Drop for Slot<B> {
    fn drop(&mut self) {
        self.counts.sending.lock().remove(self.place);
    }
}

/// What an HTTP/2 stream whose client stalled it ends with, if hyper asks it again.
#[derive(Debug, thiserror::Error)]
#[error("the client took nothing of the answer within the send timeout")]
struct Stalled;

/// A response body that keeps its request counted in flight until it is dropped
/// (hyper drops it once sent whole, or when the stream or connection ends first).
/// On an HTTP/2 connection the request counts until the body's data has been
/// written out too, and the connection watches the answer: a client that takes
/// nothing of it for the send timeout has it ended then (see the module's notes).
pub(crate) struct CountedBody<B>(Counted<B>);

enum Counted<B> {
    /// HTTP/1.1: the body alone (the socket's send deadline bounds a stall).
    Plain(B),
    /// HTTP/2: the body in its watched slot.
    Watched(Arc<Slot<B>>),
}

impl<B> fmt::Debug for CountedBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let watched = matches!(self.0, Counted::Watched(_));
        f.debug_struct("CountedBody")
            .field("watched", &watched)
            .finish()
    }
}

impl<B> CountedBody<B> {
    /// `body`, counted nowhere (HTTP/1.1).
    pub(crate) fn plain(body: B) -> Self {
        CountedBody(Counted::Plain(body))
    }

    /// `body`, counted in flight by `open` until it has been dropped and its data
    /// written out, and watched by `open`'s connection for a client that stalls it.
    pub(crate) fn watched(body: B, open: OpenStream) -> Self
    where
        B: Send + 'static,
    {
        let counts = Arc::clone(&open.0);
        let slot = Arc::new_cyclic(|slot: &Weak<Slot<B>>| {
            let watched: Weak<dyn Watched> = slot.clone();
            Slot {
                state: Mutex::new(Answer {
                    body: Some(body),
                    open: Some(open),
                }),
                pending: AtomicUsize::new(0),
                since: AtomicU64::new(0),
                took: AtomicBool::new(false),
                start: counts.start,
                place: counts.sending.lock().insert(watched),
                counts: Arc::clone(&counts),
            }
        });
        CountedBody(Counted::Watched(slot))
    }
}

impl<B> Drop for CountedBody<B> {
    fn drop(&mut self) {
        if let Counted::Watched(slot) = &self.0 {
            // Pieces still on their way keep the slot, never the body.
            let body = slot.state.lock().body.take();
            drop(body);
        }
    }
}

impl<B> Body for CountedBody<B>
where
    B: Body + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Sent<B>;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        match &mut self.get_mut().0 {
            Counted::Plain(body) => Pin::new(body).poll_frame(cx).map(|frame| {
                frame.map(|frame| {
                    frame
                        .map(|frame| frame.map_data(|data| Sent { data, slot: None }))
                        .map_err(Into::into)
                })
            }),
            Counted::Watched(slot) => slot.poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.0 {
            Counted::Plain(body) => body.is_end_stream(),
            Counted::Watched(slot) => slot
                .state
                .lock()
                .body
                .as_ref()
                .is_some_and(Body::is_end_stream),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.0 {
            Counted::Plain(body) => body.size_hint(),
            Counted::Watched(slot) => slot
                .state
                .lock()
                .body
                .as_ref()
                .map_or_else(SizeHint::default, Body::size_hint),
        }
    }
}

/// A piece of a response body's data on its way to the client. On an HTTP/2
/// connection it counts as waiting on the client until written out (h2 advancing
/// it to its end) or dropped, and each write of some of it tells the watch that the
/// client still takes its answer.
pub(crate) struct Sent<B: Body> {
    data: B::Data,
    /// While some of the piece waits on the client: its answer.
    slot: Option<Arc<Slot<B>>>,
}

impl<B: Body> Sent<B> {
    /// After some of the piece was taken.
    fn took(&mut self) {
        if let Some(slot) = &self.slot {
            slot.took.store(true, Ordering::Relaxed);
            if !self.data.has_remaining() {
                slot.pending.fetch_sub(1, Ordering::Release);
                self.slot = None;
            }
        }
    }
}

impl<B: Body> Drop for Sent<B> {
    fn drop(&mut self) {
        if let Some(slot) = &self.slot {
            slot.pending.fetch_sub(1, Ordering::Release);
        }
    }
}

impl<B: Body> fmt::Debug for Sent<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sent")
            .field("remaining", &self.data.remaining())
            .finish()
    }
}

impl<B: Body> Buf for Sent<B> {
    fn remaining(&self) -> usize {
        self.data.remaining()
    }

    fn chunk(&self) -> &[u8] {
        self.data.chunk()
    }

    fn chunks_vectored<'a>(&'a self, dst: &mut [IoSlice<'a>]) -> usize {
        self.data.chunks_vectored(dst)
    }

    fn advance(&mut self, cnt: usize) {
        self.data.advance(cnt);
        if cnt > 0 {
            self.took();
        }
    }

    fn copy_to_bytes(&mut self, len: usize) -> Bytes {
        let bytes = self.data.copy_to_bytes(len);
        if len > 0 {
            self.took();
        }
        bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use bytes::Bytes;
    use http_body_util::{BodyExt as _, Full};

    const TIMEOUT: Duration = Duration::from_secs(30);
    const SEND_TIMEOUT: Duration = Duration::from_secs(60);

    #[tokio::test(start_paused = true)]
    async fn a_connection_is_idle_once_nothing_has_been_in_flight_for_the_timeout() {
        let streams = Streams::new();
        let start = Instant::now();
        streams.idle_for(TIMEOUT, SEND_TIMEOUT).await;
        assert_eq!(start.elapsed(), TIMEOUT);

        // A request that starts, then ends 50 s later: idle 30 s after its end.
        let open = streams.open();
        let idle = {
            let streams = streams.clone();
            tokio::spawn(async move {
                streams.idle_for(TIMEOUT, SEND_TIMEOUT).await;
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
        let mut body = CountedBody::watched(Full::new(Bytes::from_static(b"ok")), streams.open());
        assert_eq!(streams.in_flight(), 1);
        let frame = body.frame().await.expect("a frame").expect("data");
        assert_eq!(frame.into_data().expect("data").chunk(), b"ok");
        assert!(body.is_end_stream());
        assert_eq!(streams.in_flight(), 1);
        drop(body);
        assert_eq!(streams.in_flight(), 0);
    }

    /// An upstream's body with `pieces` of 1 KiB ready, then waiting for ever; it
    /// notes when it is dropped.
    struct Upstream {
        pieces: usize,
        dropped: Arc<AtomicBool>,
    }

    impl Body for Upstream {
        type Data = Bytes;
        type Error = std::convert::Infallible;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            if self.pieces == 0 {
                return Poll::Pending;
            }
            self.pieces -= 1;
            Poll::Ready(Some(Ok(Frame::data(Bytes::from(vec![7u8; 1024])))))
        }
    }

    impl Drop for Upstream {
        fn drop(&mut self) {
            self.dropped.store(true, Ordering::Relaxed);
        }
    }

    /// A connection whose watch runs, and one answer on it from an [`Upstream`]
    /// with `pieces`: the connection, the answer, and whether its body was dropped.
    fn answer(pieces: usize) -> (Streams, CountedBody<Upstream>, Arc<AtomicBool>) {
        let streams = Streams::new();
        let dropped = Arc::new(AtomicBool::new(false));
        let upstream = Upstream {
            pieces,
            dropped: Arc::clone(&dropped),
        };
        let body = CountedBody::watched(upstream, streams.open());
        let watch = streams.clone();
        tokio::spawn(async move { watch.idle_for(TIMEOUT, SEND_TIMEOUT).await });
        (streams, body, dropped)
    }

    #[tokio::test(start_paused = true)]
    async fn an_answer_whose_client_takes_nothing_is_ended_at_the_send_timeout() {
        let (streams, mut body, dropped) = answer(usize::MAX);
        // A piece handed, never written out (a window of 0), never asked again.
        let piece = body.frame().await.expect("a frame").expect("data");
        tokio::time::sleep(SEND_TIMEOUT - Duration::from_secs(1)).await;
        assert!(!dropped.load(Ordering::Relaxed));
        assert_eq!(streams.in_flight(), 1);
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert!(dropped.load(Ordering::Relaxed));
        assert_eq!(streams.in_flight(), 0);
        // Asked again, the stream ends with an error, not as if whole.
        assert!(body.frame().await.expect("a frame").is_err());
        drop(piece);
    }

    #[tokio::test(start_paused = true)]
    async fn an_answer_waiting_on_its_upstream_or_taken_slowly_is_not_ended() {
        // Waiting on its upstream (its last poll `Pending`), with nothing handed.
        let (streams, mut body, dropped) = answer(0);
        let asked = tokio::time::timeout(SEND_TIMEOUT * 3, body.frame()).await;
        assert!(asked.is_err(), "the upstream has nothing yet");
        assert!(!dropped.load(Ordering::Relaxed));
        assert_eq!(streams.in_flight(), 1);

        // A client that takes a byte every 50 s keeps its answer for as long as that.
        let (streams, mut body, dropped) = answer(1);
        let mut piece = body
            .frame()
            .await
            .expect("a frame")
            .expect("data")
            .into_data()
            .expect("data");
        let asked = tokio::time::timeout(Duration::from_secs(1), body.frame()).await;
        assert!(asked.is_err(), "the upstream has nothing more");
        for _ in 0..6 {
            tokio::time::sleep(Duration::from_secs(50)).await;
            piece.advance(1);
        }
        assert!(!dropped.load(Ordering::Relaxed));
        assert_eq!(streams.in_flight(), 1);
        // Once it takes nothing more, the answer ends: one send timeout after the
        // watch saw its last byte taken (at most two after that byte).
        let last = Instant::now();
        while !dropped.load(Ordering::Relaxed) {
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        let waited = last.elapsed();
        assert!(
            (SEND_TIMEOUT..=SEND_TIMEOUT * 2).contains(&waited),
            "{waited:?}"
        );
        assert_eq!(streams.in_flight(), 0);
    }
}
