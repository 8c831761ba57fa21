//! Token counts of short pieces seen lately, so a word is not encoded again.
//!
//! A text's pieces (its words, numbers and punctuation, as the encoding's
//! pretokenizer cuts them) repeat across texts far more than whole texts do:
//! a conversation's new question is new, its words are not. Encoding a piece
//! costs two allocations and a backtracking search; each thread keeps the
//! counts of the pieces of at most [`MAX_PIECE`] bytes it encoded last, in a
//! direct-mapped table of fixed size (no allocation after the first, 64 KiB a
//! thread). The whole piece is the key, so a count found is the piece's own:
//! two pieces that meet in one slot only push each other out.

use std::cell::RefCell;

use crate::tokens::Encoding;

/// The longest piece kept, in bytes (the key holds it whole).
pub(crate) const MAX_PIECE: usize = 16;

/// Slots a thread keeps (a power of two): 32 bytes each.
const SLOTS: usize = 1 << 11;

/// One piece's count: the piece's bytes, its length and encoding (0: empty).
#[derive(Clone, Copy, Default)]
struct Slot {
    bytes: u128,
    tag: u32,
    count: u32,
}

thread_local! {
    static TABLE: RefCell<Vec<Slot>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` with this thread's table (one look-up of the thread's storage for
/// all the pieces of a text, not one a piece).
pub(crate) fn with<R>(f: impl FnOnce(&mut Memo<'_>) -> R) -> R {
    TABLE.with(|table| match table.try_borrow_mut() {
        Ok(mut slots) => {
            if slots.is_empty() {
                slots.resize(SLOTS, Slot::default());
            }
            f(&mut Memo { slots: &mut slots })
        }
        // Never nested; were it, the pieces are encoded without the table.
        Err(_) => f(&mut Memo { slots: &mut [] }),
    })
}

/// A thread's table of pieces' counts, borrowed for one text.
pub(crate) struct Memo<'a> {
    slots: &'a mut [Slot],
}

impl Memo<'_> {
    /// `piece`'s count in `encoding`: the one kept for it, else
    /// `encode(piece)` (kept when the piece is short enough).
    pub(crate) fn count(
        &mut self,
        encoding: Encoding,
        piece: &[u8],
        encode: impl FnOnce(&[u8]) -> usize,
    ) -> usize {
        if piece.is_empty() || piece.len() > MAX_PIECE || self.slots.is_empty() {
            return encode(piece);
        }
        let mut padded = [0u8; MAX_PIECE];
        padded[..piece.len()].copy_from_slice(piece);
        let bytes = u128::from_le_bytes(padded);
        // Length 1..=16 and the encoding: never 0, the empty slot's tag.
        let tag = (piece.len() as u32) | (u32::from(encoding as u8) << 8);
        let mixed = (bytes as u64) ^ ((bytes >> 64) as u64).rotate_left(29) ^ u64::from(tag);
        let index =
            (mixed.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - SLOTS.trailing_zeros())) as usize;
        let Some(slot) = self.slots.get_mut(index) else {
            return encode(piece);
        };
        if slot.tag == tag && slot.bytes == bytes {
            return slot.count as usize;
        }
        let n = encode(piece);
        if let Ok(count) = u32::try_from(n) {
            *slot = Slot { bytes, tag, count };
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn c2_a_kept_count_is_the_pieces_own() {
        let calls = std::cell::Cell::new(0);
        let encode = |p: &[u8]| {
            calls.set(calls.get() + 1);
            p.len()
        };
        let count = |encoding, piece: &[u8]| with(|memo| memo.count(encoding, piece, encode));
        assert_eq!(count(Encoding::O200kBase, b" hello"), 6);
        assert_eq!(count(Encoding::O200kBase, b" hello"), 6);
        assert_eq!(calls.get(), 1, "the second is kept");
        // Another encoding, a piece that differs by a trailing NUL, a long piece:
        // each its own.
        assert_eq!(count(Encoding::Cl100kBase, b" hello"), 6);
        assert_eq!(count(Encoding::O200kBase, b" hello\0"), 7);
        let long = [b'a'; MAX_PIECE + 1];
        assert_eq!(count(Encoding::O200kBase, &long), MAX_PIECE + 1);
        assert_eq!(count(Encoding::O200kBase, &long), MAX_PIECE + 1);
        assert_eq!(calls.get(), 5);
    }
}
