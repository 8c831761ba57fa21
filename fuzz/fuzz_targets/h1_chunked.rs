//! `sluice_h1::chunked::ChunkedEnd` fed arbitrary bytes in arbitrary pieces.
//!
//! Input: one byte `k`, then `k % 8` little-endian `u16` cut points, then the body.
//!
//! Beyond "no panic":
//! - the result does not depend on how the bytes are split: fed whole or in the
//!   pieces the cut points make, the body ends at the same offset, or both are an
//!   error, or neither has ended;
//! - a `feed` takes every byte it is given unless the body ended inside them, and
//!   once ended takes none; the body's length is at most the bytes fed;
//! - the end is exact: the body's bytes alone end it, one fewer do not (and are no
//!   error); an ended body ends with the final CRLF.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice_h1::chunked::{BadChunk, ChunkedEnd};

/// Feeds `body` in pieces cut at `cuts`: where the body ends, if it does.
fn feed_in_pieces(body: &[u8], cuts: &[usize]) -> Result<Option<usize>, BadChunk> {
    let mut end = ChunkedEnd::new();
    let mut bounds: Vec<usize> = cuts.iter().map(|c| c % (body.len() + 1)).collect();
    bounds.push(body.len());
    bounds.sort_unstable();
    let mut at = 0;
    for bound in bounds {
        if bound < at {
            continue;
        }
        // Empty pieces too: a read of nothing changes nothing.
        let piece = &body[at..bound];
        let used = end.feed(piece)?;
        assert!(used <= piece.len());
        at += used;
        if end.is_done() {
            assert_eq!(
                end.feed(b"\r\n0\r\n\r\n"),
                Ok(0),
                "bytes taken past the end"
            );
            assert!(at <= body.len());
            return Ok(Some(at));
        }
        assert_eq!(used, piece.len(), "bytes left over, the end not found");
    }
    Ok(None)
}

fuzz_target!(|data: &[u8]| {
    let Some((&k, rest)) = data.split_first() else {
        return;
    };
    let n = usize::from(k % 8);
    if rest.len() < 2 * n {
        return;
    }
    let (cut_bytes, body) = rest.split_at(2 * n);
    let cuts: Vec<usize> = cut_bytes
        .chunks_exact(2)
        .map(|c| usize::from(u16::from_le_bytes([c[0], c[1]])))
        .collect();

    let whole = feed_in_pieces(body, &[]);
    let pieces = feed_in_pieces(body, &cuts);
    assert_eq!(whole, pieces, "fed whole vs. cut at {cuts:?}");
    // Byte by byte, for short bodies.
    if body.len() <= 256 {
        let every: Vec<usize> = (0..body.len()).collect();
        assert_eq!(whole, feed_in_pieces(body, &every), "fed byte by byte");
    }

    if let Ok(Some(len)) = whole {
        assert!(len <= body.len());
        assert!(body[..len].ends_with(b"\r\n\r\n"), "{:?}", &body[..len]);
        assert_eq!(feed_in_pieces(&body[..len], &[]), Ok(Some(len)));
        assert_eq!(feed_in_pieces(&body[..len - 1], &[]), Ok(None));
    }
});
