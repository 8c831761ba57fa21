//! A request body taken in whole under a lease: in pieces of
//! [`PIECE_BYTES`](crate::PIECE_BYTES) allocated as they are needed, each
//! allocated once at the size it is filled to (never grown, never reallocated),
//! then copied once into one buffer of the body's length and the pieces freed at
//! once. What the lease counts is what is held.

use bytes::{Buf, Bytes, BytesMut};

use crate::{BufferFull, BufferLease, PIECE_BYTES};

/// Why a body could not be taken whole (see [`Pieces::push`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Overrun {
    /// It is longer than the policy's bound.
    TooLarge,
    /// It is longer than it announced (or than was leased for it).
    Unreadable,
    /// Holding more would pass the gateway's bound, or the client's share of it.
    Busy(BufferFull),
}

/// The pieces of a body that is arriving.
#[derive(Debug, Default)]
pub(crate) struct Pieces {
    pieces: Vec<BytesMut>,
    /// Body bytes held, a start left in a transport's own buffer included.
    len: usize,
    /// The body's length, or what was leased for it.
    expected: usize,
    /// Each piece is leased as it is allocated (else the lease was taken whole).
    lease_each: bool,
}

impl Pieces {
    /// A body of `expected` bytes whose first `start` bytes are held by the
    /// transport already (they are copied when it is whole); `lease_each`: each
    /// piece (and `start`) is leased before it is allocated.
    pub(crate) fn new(start: usize, expected: usize, lease_each: bool) -> Self {
        Pieces {
            pieces: Vec::new(),
            len: start,
            expected,
            lease_each,
        }
    }

    /// True once every byte is there.
    pub(crate) fn is_whole(&self) -> bool {
        self.len >= self.expected
    }

    /// Bytes held so far.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The buffer to read the next bytes into: the last piece while it has room,
    /// else a new one, leased first when pieces are leased one by one.
    pub(crate) fn room(&mut self, lease: &mut BufferLease) -> Result<&mut BytesMut, BufferFull> {
        let full = self.pieces.last().is_none_or(|p| p.len() == p.capacity());
        if full {
            let size = PIECE_BYTES.min(self.expected.saturating_sub(self.len));
            if self.lease_each {
                lease.try_grow_for(size)?;
            }
            self.pieces.push(BytesMut::with_capacity(size));
        }
        // Always there: pushed above when the last one was full.
        self.pieces.last_mut().ok_or(BufferFull::Bound)
    }

    /// Counts `n` bytes just read into [`Pieces::room`].
    pub(crate) fn filled(&mut self, n: usize) {
        self.len += n;
    }

    /// Copies `data` (one frame of a body) into the pieces and lets it go: past
    /// `max` bytes in all it is [`Overrun::TooLarge`], past what is expected
    /// [`Overrun::Unreadable`].
    pub(crate) fn push(
        &mut self,
        mut data: impl Buf,
        max: usize,
        lease: &mut BufferLease,
    ) -> Result<(), Overrun> {
        let grown = self.len.saturating_add(data.remaining());
        if grown > max {
            return Err(Overrun::TooLarge);
        }
        if grown > self.expected {
            return Err(Overrun::Unreadable);
        }
        while data.has_remaining() {
            let piece = self.room(lease).map_err(Overrun::Busy)?;
            let n = data.chunk().len().min(piece.capacity() - piece.len());
            piece.extend_from_slice(&data.chunk()[..n]);
            data.advance(n);
            self.filled(n);
        }
        Ok(())
    }

    /// The whole body: `start` (the bytes the transport held) then the pieces, in
    /// one buffer of its length (a single piece is taken as it is); the pieces
    /// are freed, and a lease taken piece by piece shrinks to that length.
    pub(crate) fn into_whole(mut self, start: &[u8], lease: &mut BufferLease) -> Bytes {
        if start.is_empty() && self.pieces.len() == 1 {
            return self.pieces.pop().unwrap_or_default().freeze();
        }
        let mut whole = BytesMut::with_capacity(self.len);
        whole.extend_from_slice(start);
        let mut allocated = start.len();
        for mut piece in self.pieces {
            allocated += piece.capacity();
            whole.extend_from_slice(piece.chunk());
            piece.clear();
        }
        if self.lease_each {
            // Every piece was filled to its capacity: this gives back nothing
            // unless the body came short.
            lease.shrink(allocated.saturating_sub(whole.len()));
        }
        whole.freeze()
    }
}
