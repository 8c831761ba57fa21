//! A request body the fast path takes in whole before deciding (phase 2 of
//! `sluice_edge::exchange`), each read within the head timeout and all of it within the
//! body deadline. One longer than the connection's read buffer holds is read in pieces,
//! each allocated once at the size it is filled to ([`PIECE`], or what is left of the
//! body) and leased before it is allocated, so nothing is reallocated, copied or freed
//! while the body arrives and what the bound counts is what is held (one size for every
//! piece: see [`sluice_edge::PIECE_BYTES`]). Once whole, it is copied once into a
//! buffer of its exact length and the pieces are freed at once; the lease then is that
//! length.

use std::io;

use bytes::{Buf as _, BytesMut};
use sluice_edge::{BufferFull, BufferLease};
use tokio::io::AsyncReadExt as _;
use tokio::net::TcpStream;

use super::READ_CHUNK;
use super::connection::{Connection, Timers, read_more};
use super::exchange::MAX_PIPELINED;

/// Bytes of each piece: what a client that stalls holds beyond what it sent, at most.
const PIECE: usize = sluice_edge::PIECE_BYTES;

/// The pieces of a body that is arriving.
#[derive(Debug, Default)]
pub(super) struct Pieces {
    pieces: Vec<BytesMut>,
    /// Body bytes held (the start, left in the connection's buffer, included).
    len: usize,
    /// The body's length.
    expected: usize,
}

impl Pieces {
    /// A body of `expected` bytes whose first `start` bytes are in the connection's
    /// buffer already; those are leased now (they are copied when it is whole).
    ///
    /// # Errors
    /// [`BufferFull`] when the lease cannot hold them.
    pub(super) fn new(
        start: usize,
        expected: usize,
        lease: &mut BufferLease,
    ) -> Result<Self, BufferFull> {
        lease.try_grow_for(start)?;
        Ok(Pieces {
            pieces: Vec::new(),
            len: start,
            expected,
        })
    }

    /// True once every byte is there.
    pub(super) fn is_whole(&self) -> bool {
        self.len >= self.expected
    }

    /// The buffer to read the next bytes into: the last piece while it has room, else a
    /// new one, leased first.
    ///
    /// # Errors
    /// [`BufferFull`] when the lease cannot hold a new piece.
    pub(super) fn room(&mut self, lease: &mut BufferLease) -> Result<&mut BytesMut, BufferFull> {
        let full = self.pieces.last().is_none_or(|p| p.len() == p.capacity());
        if full {
            let left = self.expected - self.len;
            let size = PIECE.min(left);
            lease.try_grow_for(size)?;
            self.pieces.push(BytesMut::with_capacity(size));
        }
        // Always there: pushed above when the last one was full.
        self.pieces.last_mut().ok_or(BufferFull::Bound)
    }

    /// Counts `n` bytes just read into [`Pieces::room`].
    pub(super) fn filled(&mut self, n: usize) {
        self.len += n;
    }

    /// The whole body: `start` (the bytes in the connection's buffer) then the pieces,
    /// in one buffer of the body's length; the pieces are freed and the lease shrinks
    /// to that length.
    pub(super) fn into_whole(self, start: &[u8], lease: &mut BufferLease) -> BytesMut {
        let mut whole = BytesMut::with_capacity(self.expected);
        whole.extend_from_slice(start);
        let mut allocated = start.len();
        for mut piece in self.pieces {
            allocated += piece.capacity();
            whole.extend_from_slice(piece.chunk());
            piece.clear();
        }
        // Every piece was filled to its capacity: this gives back nothing unless the
        // body came short (it did not: the caller asks only once whole).
        lease.shrink(allocated.saturating_sub(whole.len()));
        whole
    }
}

/// Why a request body was not taken in whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum BodyRead {
    /// Nothing came for the head timeout, or the client left.
    Stalled,
    /// It kept coming, but not all of it within the body deadline.
    TooSlow,
    /// Holding more of it would pass the gateway's bound on buffered bytes, or its
    /// client's share of it.
    Busy(sluice_edge::BufferFull),
}

/// Reads some of a request body into the spare room of `buf` (which has some): within
/// the head timeout, and before `whole_by`. The bytes read (at least one).
pub(super) async fn read_within(
    client: &mut TcpStream,
    timers: &mut Timers,
    whole_by: tokio::time::Instant,
    buf: &mut BytesMut,
) -> Result<usize, BodyRead> {
    let now = tokio::time::Instant::now();
    if now >= whole_by {
        return Err(BodyRead::TooSlow);
    }
    let stalled = (now + timers.head_timeout).min(whole_by);
    timers.head.set(stalled);
    let read = tokio::select! {
        biased;
        read = client.read_buf(buf) => read,
        () = timers.head.passed() => {
            return Err(if stalled == whole_by { BodyRead::TooSlow } else { BodyRead::Stalled });
        }
    };
    match read {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(BodyRead::Stalled),
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
    /// head timeout and all of them within [`sluice_edge::BODY_DEADLINE`]. A request
    /// that fits the connection's buffer is read into it (`Ok(None)`: nothing leased,
    /// the buffer is the connection's own); a longer body fills that buffer, then the
    /// rest is read in [`body::Pieces`], each leased from `lease` before it is allocated, and comes back whole in a
    /// buffer of its length (`Ok(Some)`), the head alone left in `from_client`.
    pub(super) async fn read_body(
        &mut self,
        client: &mut TcpStream,
        timers: &mut Timers,
        (head_len, end): (usize, usize),
        lease: Option<&mut sluice_edge::BufferLease>,
    ) -> Result<Option<BytesMut>, BodyRead> {
        let whole_by = tokio::time::Instant::now() + sluice_edge::BODY_DEADLINE;
        let Some(lease) = lease.filter(|_| end > self.from_client.capacity()) else {
            while self.from_client.len() < end {
                read_within(client, timers, whole_by, &mut self.from_client).await?;
            }
            return Ok(None);
        };
        // The connection's own buffer first: a client that stalls before filling it
        // holds nothing more.
        while self.from_client.len() < self.from_client.capacity() {
            read_within(client, timers, whole_by, &mut self.from_client).await?;
        }
        let start = self.from_client.len() - head_len;
        let mut pieces = Pieces::new(start, end - head_len, lease).map_err(BodyRead::Busy)?;
        while !pieces.is_whole() {
            let room = pieces.room(lease).map_err(BodyRead::Busy)?;
            let n = read_within(client, timers, whole_by, room).await?;
            pieces.filled(n);
        }
        let whole = pieces.into_whole(&self.from_client[head_len..], lease);
        self.from_client.truncate(head_len);
        Ok(Some(whole))
    }
}
