//! A request body the fast path takes in whole before deciding, when it is longer
//! than the connection's read buffer holds: read in pieces, each allocated once at
//! the size it is filled to ([`PIECE`], or what is left of the body) and leased
//! before it is allocated, so nothing is reallocated, copied or freed while the body
//! arrives and what the bound counts is what is held (one size for every piece:
//! see [`sluice_edge::PIECE_BYTES`]). Once whole, it is copied once into a buffer of
//! its exact length and the pieces are freed at once; the lease then is that length.

use bytes::{Buf as _, BytesMut};
use sluice_edge::{BufferFull, BufferLease};

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
