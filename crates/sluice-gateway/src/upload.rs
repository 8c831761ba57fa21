//! A request body that tells whether it has been sent in whole or failed on the
//! client's side, and that can be abandoned.
//!
//! A client whose body fails (it left, or stopped sending within the body timeout)
//! makes the upstream request fail too; the proxy answers that with 400, as the limiter
//! answers a body it cannot read, not with the 502 of an upstream failure.
//!
//! An upstream may answer before it has read the whole request body. When that answer
//! refuses (4xx, 5xx), the rest of the upload is of no use, and a client that waits
//! for its answer before it sends the rest would keep both connections open with
//! nothing more to come. So once such an answer has gone to the client, the proxy
//! abandons the upload: the client's body is dropped at once (hyper stops reading it
//! and closes the client's connection after the answer) and the upstream's request
//! ends in an error when hyper next asks for more of it (its connection is not
//! reused).

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};

use bytes::Bytes;
use futures_util::task::AtomicWaker;
use http_body::{Body, Frame, SizeHint};
use http_body_util::combinators::UnsyncBoxBody;

use super::boxed::BoxError;

/// A request body on its way upstream.
pub(super) struct Upload {
    shared: Arc<Shared>,
}

struct Shared {
    /// The client's body; `None` once abandoned. Held here, not in [`Upload`], so that
    /// abandoning drops it at once, even while the upload is not being polled (hyper
    /// polls it only when its write buffer has room).
    body: Mutex<Option<UnsyncBoxBody<Bytes, BoxError>>>,
    /// All of the body was taken.
    ended: AtomicBool,
    /// The client's body failed (it left, or stopped sending in time).
    failed: AtomicBool,
    abandoned: AtomicBool,
    /// The task sending the body, woken when it is abandoned.
    sender: AtomicWaker,
}

/// What the proxy holds of an [`Upload`]: whether it ended, and a way to abandon it.
#[derive(Clone)]
pub(super) struct UploadHandle(Arc<Shared>);

impl Upload {
    /// Wraps `body`; the handle tells when it has ended.
    pub(super) fn new(body: UnsyncBoxBody<Bytes, BoxError>) -> (Self, UploadHandle) {
        let shared = Arc::new(Shared {
            ended: AtomicBool::new(body.is_end_stream()),
            body: Mutex::new(Some(body)),
            failed: AtomicBool::new(false),
            abandoned: AtomicBool::new(false),
            sender: AtomicWaker::new(),
        });
        let handle = UploadHandle(Arc::clone(&shared));
        (Upload { shared }, handle)
    }
}

impl Shared {
    fn body(&self) -> MutexGuard<'_, Option<UnsyncBoxBody<Bytes, BoxError>>> {
        // A panic while polling the body leaves nothing half-changed here.
        self.body.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl UploadHandle {
    /// True once the whole body was taken.
    pub(super) fn ended(&self) -> bool {
        self.0.ended.load(Ordering::Acquire)
    }

    /// True once the client's body failed.
    pub(super) fn failed(&self) -> bool {
        self.0.failed.load(Ordering::Acquire)
    }

    /// Stops the upload: the client's body is dropped now, and the upload ends in an
    /// error for the upstream when it is next polled. Nothing happens to an upload
    /// that has ended.
    pub(super) fn abandon(&self) {
        if !self.ended() {
            self.0.abandoned.store(true, Ordering::Release);
            let body = self.0.body().take();
            drop(body);
            self.0.sender.wake();
        }
    }
}

impl Body for Upload {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let shared = &*self.shared;
        shared.sender.register(cx.waker());
        let mut guard = shared.body();
        // Gone only when abandoned: never an end, which would let the upstream take a
        // cut request as whole.
        let Some(body) = guard.as_mut() else {
            return Poll::Ready(Some(Err("the upload was abandoned".into())));
        };
        let polled = Pin::new(&mut *body).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Err(_))) => shared.failed.store(true, Ordering::Release),
            Poll::Ready(None) => shared.ended.store(true, Ordering::Release),
            _ if body.is_end_stream() => shared.ended.store(true, Ordering::Release),
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.shared.body().as_ref().is_some_and(Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        self.shared
            .body()
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), Body::size_hint)
    }
}

/// A response body that abandons an upload once it has been relayed in whole, or
/// dropped.
pub(super) struct AbandonAfter<B> {
    body: B,
    upload: UploadHandle,
}

impl<B> AbandonAfter<B> {
    /// Relays `body`, then abandons `upload`.
    pub(super) fn new(body: B, upload: UploadHandle) -> Self {
        AbandonAfter { body, upload }
    }
}

impl<B: Body + Unpin> Body for AbandonAfter<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        let polled = Pin::new(&mut self.body).poll_frame(cx);
        if matches!(polled, Poll::Ready(None | Some(Err(_)))) {
            self.upload.abandon();
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

impl<B> Drop for AbandonAfter<B> {
    fn drop(&mut self) {
        self.upload.abandon();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt as _, Full, StreamBody};

    #[tokio::test]
    async fn an_upload_ends_when_its_last_frame_is_taken() {
        let frames = futures_util::stream::iter(vec![
            Ok::<_, BoxError>(Frame::data(Bytes::from_static(b"a"))),
            Ok(Frame::data(Bytes::from_static(b"b"))),
        ]);
        let (mut upload, handle) = Upload::new(StreamBody::new(frames).boxed_unsync());
        assert!(!handle.ended());
        let first = upload.frame().await;
        assert!(first.is_some());
        assert!(!handle.ended(), "one frame is still to come");
        assert!(upload.frame().await.is_some());
        assert!(upload.frame().await.is_none());
        assert!(handle.ended());
        // Abandoning an upload that ended changes nothing.
        handle.abandon();
        assert!(upload.frame().await.is_none());

        // A body known to be empty has ended from the start.
        let (_, handle) = Upload::new(Full::new(Bytes::new()).map_err(Into::into).boxed_unsync());
        assert!(handle.ended());
    }

    #[tokio::test]
    async fn a_client_body_that_fails_is_told_apart() {
        let frames = futures_util::stream::iter(vec![
            Ok::<_, BoxError>(Frame::data(Bytes::from_static(b"a"))),
            Err("the client left".into()),
        ]);
        let (mut upload, handle) = Upload::new(StreamBody::new(frames).boxed_unsync());
        assert!(upload.frame().await.is_some_and(|f| f.is_ok()));
        assert!(!handle.failed());
        assert!(upload.frame().await.is_some_and(|f| f.is_err()));
        assert!(handle.failed() && !handle.ended());
    }

    #[tokio::test]
    async fn an_abandoned_upload_wakes_its_sender_and_fails() {
        // A body whose next frame never comes.
        let (sender, receiver) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, BoxError>>(1);
        let frames = futures_util::stream::unfold(receiver, |mut r| async move {
            r.recv().await.map(|f| (f, r))
        });
        let (mut upload, handle) = Upload::new(StreamBody::new(frames).boxed_unsync());
        let waiting = tokio::spawn(async move { upload.frame().await.map(|f| f.is_err()) });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());

        // The answer was relayed in whole: the upload is abandoned.
        let answer = AbandonAfter::new(Full::new(Bytes::from_static(b"refused")), handle);
        let relayed = answer.collect().await.map(|c| c.to_bytes());
        assert_eq!(relayed.ok(), Some(Bytes::from_static(b"refused")));
        assert!(sender.is_closed(), "the client's body is dropped");
        assert_eq!(waiting.await.ok(), Some(Some(true)), "the upload fails");
    }

    #[test]
    fn an_upload_nobody_polls_drops_the_clients_body_when_abandoned() {
        let (sender, receiver) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, BoxError>>(1);
        let frames = futures_util::stream::unfold(receiver, |mut r| async move {
            r.recv().await.map(|f| (f, r))
        });
        let (_upload, handle) = Upload::new(StreamBody::new(frames).boxed_unsync());
        drop(AbandonAfter::new(Full::new(Bytes::new()), handle));
        assert!(sender.is_closed());
    }
}
