//! A client's hang-up, as a request extension: the transport that holds the
//! connection says when the client closed it, and a call waiting for its lane's
//! place (SPEC L1, L2) stops waiting then — its place, start and budgets, and the
//! upstream's work, were for nobody.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::watch;

/// Resolves once the client of the request hung up. Put in the request's
/// extensions by a transport that watches its connection (sluice's gateway over
/// HTTP/1.1); a request without one is waited for as long as it takes.
#[derive(Clone, Debug)]
pub struct Hangup(watch::Receiver<bool>);

/// The transport's side of a [`Hangup`]: says when the client hung up.
#[derive(Debug)]
pub struct HangupSender(watch::Sender<bool>);

impl Hangup {
    /// A hang-up and the sender that tells it.
    pub fn channel() -> (HangupSender, Hangup) {
        let (tx, rx) = watch::channel(false);
        (HangupSender(tx), Hangup(rx))
    }

    /// Resolves when the client hung up (or its watcher ended: the connection
    /// is gone).
    pub async fn wait(mut self) {
        let _ = self.0.wait_for(|gone| *gone).await;
    }
}

impl HangupSender {
    /// The client hung up.
    pub fn hung_up(&self) {
        let _ = self.0.send(true);
    }

    /// Resolves when no request holds a [`Hangup`] of it any more.
    pub async fn unheard(&self) {
        self.0.closed().await;
    }
}

/// Whether a request's body has all come, as its transport saw it: a request
/// extension (sluice's gateway sets it). A call whose time runs out while its
/// body is still coming is the client's doing, never an upstream failure.
#[derive(Clone, Debug, Default)]
pub struct UploadEnded(Arc<AtomicBool>);

impl UploadEnded {
    /// The body has all come.
    pub fn mark(&self) {
        self.0.store(true, Ordering::Release);
    }

    /// True once the body has all come.
    pub fn ended(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}
