//! A request body whose every frame must come within a time.
//!
//! hyper bounds the wait for a request head, not for its body: a client that
//! announces a body and stops sending it would hold its connection (and, on a route
//! whose class is read off the body, a request in flight) until it leaves. Wrapped in
//! [`ReadDeadline`], such a body fails once no frame has come for the timeout, as the
//! fast path gives each of its body reads the head timeout.
//!
//! tower-http's `TimeoutBody` has the same rule, but makes and polls a new timer
//! for every frame, also one that is ready at once (and answers a ready frame with a
//! timeout when the timer ran out meanwhile); this one arms its timer only when a
//! frame is not ready, so a body that is all there never touches the timer wheel.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use tokio::time::{Instant, Sleep};

use super::boxed::BoxError;

/// `body`, failing once a frame has been awaited for longer than `timeout`.
pub(super) struct ReadDeadline<B> {
    body: B,
    timeout: Duration,
    /// The timer, made when a poll first finds no frame ready (none for a body that is
    /// all there), then reset for each wait.
    timer: Option<Pin<Box<Sleep>>>,
    /// The timer runs for the wait now going on.
    waiting: bool,
    /// Told when the body has all come.
    ended: Option<sluice_edge::UploadEnded>,
}

impl<B> ReadDeadline<B> {
    /// Wraps `body`: each of its frames must come within `timeout`.
    pub(super) fn new(body: B, timeout: Duration) -> Self {
        ReadDeadline {
            body,
            timeout,
            timer: None,
            waiting: false,
            ended: None,
        }
    }

    /// The same, marking `ended` once the body has all come.
    pub(super) fn telling(mut self, ended: sluice_edge::UploadEnded) -> Self {
        self.ended = Some(ended);
        self
    }
}

impl<B> Body for ReadDeadline<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        match Pin::new(&mut this.body).poll_frame(cx) {
            Poll::Ready(frame) => {
                this.waiting = false;
                if let Some(ended) = &this.ended
                    && (frame.is_none() || this.body.is_end_stream())
                {
                    ended.mark();
                }
                Poll::Ready(frame.map(|f| f.map_err(Into::into)))
            }
            Poll::Pending => {
                let timeout = this.timeout;
                if !this.waiting {
                    let deadline = Instant::now() + timeout;
                    match &mut this.timer {
                        Some(timer) => timer.as_mut().reset(deadline),
                        None => this.timer = Some(Box::pin(tokio::time::sleep_until(deadline))),
                    }
                    this.waiting = true;
                }
                let timer = this
                    .timer
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
                match timer.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Some(Err(format!(
                        "no part of the request body came for {} s",
                        timeout.as_secs()
                    )
                    .into()))),
                    Poll::Pending => Poll::Pending,
                }
            }
        }
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
    use http_body_util::{BodyExt as _, StreamBody};

    /// A body sending one frame after each of `gaps`, then ending.
    fn paced(gaps: Vec<Duration>) -> impl Body<Data = Bytes, Error = BoxError> + Unpin {
        let frames = futures_util::stream::unfold(gaps.into_iter(), |mut gaps| async move {
            let gap = gaps.next()?;
            tokio::time::sleep(gap).await;
            Some((Ok(Frame::data(Bytes::from_static(b"part"))), gaps))
        });
        StreamBody::new(Box::pin(frames))
    }

    const TIMEOUT: Duration = Duration::from_secs(30);

    #[tokio::test(start_paused = true)]
    async fn a_body_whose_parts_keep_coming_is_read_however_long_it_takes() {
        let started = Instant::now();
        let body = ReadDeadline::new(paced(vec![Duration::from_secs(20); 4]), TIMEOUT);
        let read = body.collect().await.map(|c| c.to_bytes().len());
        assert_eq!(read.ok(), Some(16));
        assert_eq!(started.elapsed(), Duration::from_secs(80));
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_that_stops_coming_fails_after_the_timeout() {
        let started = Instant::now();
        let gaps = vec![Duration::from_secs(20), Duration::from_secs(3600)];
        let body = ReadDeadline::new(paced(gaps), TIMEOUT);
        let read = body.collect().await;
        let error = read.err().map(|e| e.to_string());
        assert_eq!(
            error.as_deref(),
            Some("no part of the request body came for 30 s")
        );
        assert_eq!(started.elapsed(), Duration::from_secs(50));
    }
}
