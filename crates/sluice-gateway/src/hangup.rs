//! Watching an HTTP/1.1 connection that hyper serves for its client's hang-up
//! ([`sluice_edge::Hangup`]): hyper reads nothing of a connection while a
//! request's service runs, so a client that closed it while its call waited for
//! a lane's place would be waited for, and served, all the same. The watcher
//! holds a second descriptor of the socket and wakes only on the socket's events
//! (new bytes, the peer's close); it ends once no request of the connection can
//! hear it.

use std::io;
use std::os::fd::AsFd as _;

use sluice_edge::{Hangup, HangupSender};
use tokio::io::Interest;
use tokio::net::TcpStream;

/// Starts watching `stream` for its client's hang-up; `None` when the socket
/// cannot be watched (no descriptor left): its calls wait as before.
pub(crate) fn watch(stream: &TcpStream) -> Option<Hangup> {
    let fd = stream.as_fd().try_clone_to_owned().ok()?;
    let twin = TcpStream::from_std(std::net::TcpStream::from(fd)).ok()?;
    let (sender, hangup) = Hangup::channel();
    tokio::spawn(watch_twin(twin, sender));
    Some(hangup)
}

async fn watch_twin(twin: TcpStream, sender: HangupSender) {
    loop {
        tokio::select! {
            ready = twin.ready(Interest::READABLE) => match ready {
                Ok(r) if r.is_read_closed() || r.is_error() => break,
                Ok(_) => {
                    // Bytes to read (hyper's to take): wait for the next event.
                    let _ = twin.try_io(Interest::READABLE, || {
                        Err::<(), _>(io::ErrorKind::WouldBlock.into())
                    });
                }
                Err(_) => break,
            },
            () = sender.unheard() => return,
        }
    }
    sender.hung_up();
}
