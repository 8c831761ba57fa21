//! The answer of an LLM call, read for its `usage` as it passes through (never
//! held whole), its token budgets settled when it ends (SPEC T3).
//!
//! The body ends only once the settlement is in the store: a client that read
//! its answer to the end finds it counted in its next call. An answer dropped
//! before its end (the client left, the upstream cut the stream) is settled
//! with what was seen of it, on the runtime, as it is dropped.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use sluice_edge::tokens::UsageChunkFilter;
use sluice_tokens::{Usage, UsageScanner};

/// A settlement to run with the usage an answer reported (`None`: none seen).
pub type Settle = Box<dyn FnOnce(Option<Usage>) -> SettleFuture + Send>;

/// A settlement running.
pub type SettleFuture = Pin<Box<dyn Future<Output = ()> + Send>>;

/// An LLM call's answer on its way to the client (see the module docs).
pub struct Settling<B> {
    inner: Pin<Box<B>>,
    scanner: UsageScanner,
    settle: Option<Settle>,
    running: Option<SettleFuture>,
    ended: bool,
    /// Removes the usage-only chunk sluice asked for from the stream.
    hide: Option<UsageChunkFilter>,
}

impl<B> Settling<B> {
    /// `inner`, an answer of `Content-Type` `content_type`, settled by `settle`.
    pub fn new(inner: B, content_type: Option<&str>, settle: Settle) -> Self {
        Settling {
            inner: Box::pin(inner),
            scanner: UsageScanner::new(content_type),
            settle: Some(settle),
            running: None,
            ended: false,
            hide: None,
        }
    }

    /// The same answer with OpenAI's usage-only chunk removed from its events:
    /// sluice asked for it, the client did not
    /// ([`ask_stream_usage`](sluice_edge::tokens::ask_stream_usage)).
    #[must_use]
    pub fn hiding_usage_chunk(mut self) -> Self {
        self.hide = Some(UsageChunkFilter::default());
        self
    }
}

impl<B> std::fmt::Debug for Settling<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Settling")
            .field("settled", &self.settle.is_none())
            .field("ended", &self.ended)
            .finish_non_exhaustive()
    }
}

impl<B> Body for Settling<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        loop {
            if let Some(running) = this.running.as_mut() {
                return match running.as_mut().poll(cx) {
                    Poll::Ready(()) => {
                        this.running = None;
                        this.ended = true;
                        Poll::Ready(None)
                    }
                    Poll::Pending => Poll::Pending,
                };
            }
            if this.ended {
                return Poll::Ready(None);
            }
            match this.inner.as_mut().poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    if let Some(data) = frame.data_ref() {
                        this.scanner.feed(data);
                        if let Some(hide) = this.hide.as_mut() {
                            let mut passed = Vec::new();
                            hide.push(data, &mut passed);
                            if passed.is_empty() {
                                continue;
                            }
                            return Poll::Ready(Some(Ok(Frame::data(Bytes::from(passed)))));
                        }
                    }
                    return Poll::Ready(Some(Ok(frame)));
                }
                Poll::Ready(Some(Err(error))) => {
                    // Cut: settled with what was seen, as the answer is dropped.
                    return Poll::Ready(Some(Err(error)));
                }
                Poll::Ready(None) => {
                    let usage = this.scanner.finish();
                    match this.settle.take() {
                        Some(settle) => this.running = Some(settle(usage)),
                        None => this.ended = true,
                    }
                    // An unfinished last event goes on as it came.
                    let mut rest = Vec::new();
                    if let Some(hide) = this.hide.as_mut() {
                        hide.finish(&mut rest);
                    }
                    if !rest.is_empty() {
                        return Poll::Ready(Some(Ok(Frame::data(Bytes::from(rest)))));
                    }
                }
                Poll::Pending => return Poll::Pending,
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended
    }

    fn size_hint(&self) -> SizeHint {
        // Less than the upstream's when a chunk is taken out.
        if self.hide.is_some() {
            return SizeHint::default();
        }
        self.inner.size_hint()
    }
}

impl<B> Drop for Settling<B> {
    fn drop(&mut self) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        // A settlement begun runs to its end; one not begun runs with what was
        // seen of the answer.
        if let Some(running) = self.running.take() {
            runtime.spawn(running);
        } else if let Some(settle) = self.settle.take() {
            runtime.spawn(settle(self.scanner.finish()));
        }
    }
}
