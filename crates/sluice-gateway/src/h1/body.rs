//! A request body the fast path takes in whole before deciding (phase 2 of
//! [`sluice_edge::Intake`]), each read within the head timeout and all of it within the
//! body deadline. One longer than the connection's read buffer holds is read into the
//! intake's pieces, each leased before it is allocated; and the response body relayed
//! while the client is watched.

use std::io;

use bytes::BytesMut;
use sluice_edge::{BodyFailure, Intake};
use sluice_store::BudgetStore;
use tokio::io::AsyncReadExt as _;
use tokio::net::TcpStream;

use super::READ_CHUNK;
use super::buffers::{Connection, Timers, read_more};

/// Most bytes kept of what a client sends while its response streams.
pub(super) const MAX_PIPELINED: usize = 64 * 1024;

/// Reads some of a request body into the spare room of `buf` (which has some): within
/// the head timeout, and before `whole_by`. The bytes read (at least one).
pub(super) async fn read_within(
    client: &mut TcpStream,
    timers: &mut Timers,
    whole_by: tokio::time::Instant,
    buf: &mut BytesMut,
) -> Result<usize, BodyFailure> {
    let now = tokio::time::Instant::now();
    if now >= whole_by {
        return Err(BodyFailure::TooSlow);
    }
    let stalled = (now + timers.head_timeout).min(whole_by);
    timers.head.set(stalled);
    let read = tokio::select! {
        biased;
        read = client.read_buf(buf) => read,
        () = timers.head.passed() => {
            return Err(if stalled == whole_by { BodyFailure::TooSlow } else { BodyFailure::Unreadable });
        }
    };
    match read {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(BodyFailure::Unreadable),
    }
}

/// Reads more of a response body from the upstream into `buf`, as [`read_more`].
/// Meanwhile the client's connection is watched: a client that has closed it ends
/// the relay (an error), so that a stream nobody reads any more (server-sent events
/// to a client that left) does not hold the upstream connection, or a drain, until
/// its next event. Bytes the client sends meanwhile (pipelined requests) are kept in
/// `pipelined`, up to a head's worth; past that the client is not watched.
pub(super) async fn read_body(
    conn: &mut TcpStream,
    buf: &mut BytesMut,
    client: &TcpStream,
    pipelined: &mut BytesMut,
) -> io::Result<usize> {
    loop {
        tokio::select! {
            biased;
            n = read_more(conn, buf) => return n,
            ready = client.readable(), if pipelined.len() < MAX_PIPELINED => {
                ready?;
                pipelined.reserve(READ_CHUNK);
                match client.try_read_buf(pipelined) {
                    Ok(0) => return Err(io::ErrorKind::ConnectionAborted.into()),
                    Err(e) if e.kind() != io::ErrorKind::WouldBlock => return Err(e),
                    _ => {}
                }
            }
        }
    }
}

impl<'f> Connection<'f> {
    /// Reads the body of the request whose head is the first `head_len` bytes of
    /// `from_client`, until `end` bytes are there with the head, each read within the
    /// head timeout and all of them by [`Intake::whole_by`]. A request
    /// that fits the connection's buffer is read into it (`Ok(None)`: nothing leased,
    /// the buffer is the connection's own); a longer body fills that buffer, then the
    /// rest is read into the intake's pieces, each leased before it is allocated, and
    /// comes back whole in a buffer of its length (`Ok(Some)`), the head alone left in
    /// `from_client`.
    pub(super) async fn read_body<S: BudgetStore>(
        &mut self,
        client: &mut TcpStream,
        timers: &mut Timers,
        (head_len, end): (usize, usize),
        intake: &mut Intake<'_, S>,
    ) -> Result<Option<bytes::Bytes>, BodyFailure> {
        let whole_by = intake.whole_by();
        if end <= self.from_client.capacity() {
            while self.from_client.len() < end {
                read_within(client, timers, whole_by, &mut self.from_client).await?;
            }
            return Ok(None);
        }
        // The connection's own buffer first: a client that stalls before filling it
        // holds nothing more.
        while self.from_client.len() < self.from_client.capacity() {
            read_within(client, timers, whole_by, &mut self.from_client).await?;
        }
        let start = self.from_client.len() - head_len;
        intake.lease_pieces(start, end - head_len, &self.identity)?;
        while !intake.is_whole() {
            let n = read_within(client, timers, whole_by, intake.room()?).await?;
            intake.filled(n);
        }
        let whole = intake.take_whole(&self.from_client[head_len..]);
        self.from_client.truncate(head_len);
        Ok(Some(whole))
    }
}
