//! A listener served a thread per core, as the gateway's workers are: each
//! thread accepts on a copy of the one listening socket and serves the
//! connections it accepted on a runtime of its own, so a request is decided
//! on the thread that read it (the Redis store's coalescer is per thread too)
//! and never waits for, or wakes, another thread. The forward-auth listener
//! and the rate-limit service run this way.

use std::future::Future;
use std::num::NonZeroUsize;

use tokio::net::TcpListener;

/// Starts `threads` threads named `name-<index>`, each running `serve` on a
/// copy of `listener` on a current-thread runtime of its own; the future
/// returned ends once every thread's `serve` has ended.
///
/// # Errors
/// A thread, its runtime or its copy of the listening socket that cannot be
/// made.
pub(crate) fn serve<F, Fut>(
    listener: TcpListener,
    threads: NonZeroUsize,
    name: &'static str,
    serve: F,
) -> std::io::Result<impl Future<Output = ()>>
where
    F: Fn(TcpListener) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = ()>,
{
    let listener = listener.into_std()?;
    let mut done = Vec::with_capacity(threads.get());
    for index in 0..threads.get() {
        let listener = listener.try_clone()?;
        let serve = serve.clone();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let (finished, finish) = tokio::sync::oneshot::channel::<()>();
        std::thread::Builder::new()
            .name(format!("{name}-{index}"))
            .spawn(move || {
                runtime.block_on(async move {
                    match TcpListener::from_std(listener) {
                        Ok(listener) => serve(listener).await,
                        Err(error) => tracing::error!("{name} thread {index}: {error}"),
                    }
                });
                let _ = finished.send(());
            })?;
        done.push(finish);
    }
    Ok(async move {
        for finish in done {
            let _ = finish.await;
        }
    })
}
