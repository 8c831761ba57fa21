//! Finds where a chunked message body ends, without decoding it.
//!
//! The fast path relays an upstream's chunked body to the client byte for byte (the
//! client speaks HTTP/1.1 too, so the framing can stay as it is) and only needs to
//! know where the body ends: then the upstream connection can serve the next request
//! and the client's response is complete. [`ChunkedEnd`] is fed the bytes as they
//! arrive and says how many of them belong to the body; it checks the framing as
//! strictly as a decoder would, so a malformed body is an error, never a guess.

/// Longest chunk-size line (size, extensions) accepted, as hyper's decoder bounds
/// chunk extensions.
const MAX_SIZE_LINE: u32 = 4096;

/// Most bytes of trailer fields accepted after the last chunk.
const MAX_TRAILERS: u32 = 64 * 1024;

/// The framing of a chunked body is broken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BadChunk;

/// Where in the chunked framing the bytes seen so far end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Hex digits of a chunk size (`digits` so far).
    Size { size: u64, digits: u8, line: u32 },
    /// Whitespace after the size.
    SizeSpace { size: u64, line: u32 },
    /// After the size: an extension (`;…`) up to CR.
    Extension { size: u64, line: u32 },
    /// After the CR that ends a size line.
    SizeLf { size: u64 },
    /// Inside a chunk's data.
    Data(u64),
    /// After a chunk's data: its CR.
    DataCr,
    /// After a chunk's data: its LF.
    DataLf,
    /// After the last chunk, at the start of a trailer line (or the final CRLF).
    TrailerStart { seen: u32 },
    /// Inside a trailer field line.
    Trailer { seen: u32 },
    /// After a trailer line's CR.
    TrailerLf { seen: u32 },
    /// After the CR of the final empty line.
    FinalLf,
    /// The body has ended.
    Done,
}

/// Tracks a chunked body's framing across the reads that bring it.
#[derive(Debug, Clone)]
pub struct ChunkedEnd {
    state: State,
}

impl Default for ChunkedEnd {
    fn default() -> Self {
        Self::new()
    }
}

impl ChunkedEnd {
    /// At the start of a body.
    pub fn new() -> Self {
        ChunkedEnd {
            state: State::Size {
                size: 0,
                digits: 0,
                line: 0,
            },
        }
    }

    /// True once the final CRLF has been seen.
    pub fn is_done(&self) -> bool {
        self.state == State::Done
    }

    /// Reads `bytes`, the next bytes of the body, and returns how many of them belong
    /// to it: all of them, or fewer when the body ends inside `bytes` (then
    /// [`ChunkedEnd::is_done`]).
    ///
    /// # Errors
    /// [`BadChunk`] when the bytes break the chunked framing.
    pub fn feed(&mut self, bytes: &[u8]) -> Result<usize, BadChunk> {
        self.feed_with(bytes, |_| {})
    }

    /// [`ChunkedEnd::feed`], handing `data` each run of chunk data among
    /// `bytes` (the body as the sender meant it, without its framing), in order.
    ///
    /// # Errors
    /// [`BadChunk`] when the bytes break the chunked framing (the data before
    /// the break has been handed on).
    pub fn feed_with(
        &mut self,
        bytes: &[u8],
        mut data: impl FnMut(&[u8]),
    ) -> Result<usize, BadChunk> {
        let mut i = 0;
        while i < bytes.len() {
            let b = bytes[i];
            self.state = match self.state {
                State::Size { size, digits, line } => {
                    let line = next_line_len(line, MAX_SIZE_LINE)?;
                    match hex_value(b) {
                        Some(v) => {
                            // 15 hex digits: sizes up to 2^60, far past anything real.
                            if digits >= 15 {
                                return Err(BadChunk);
                            }
                            State::Size {
                                size: size << 4 | u64::from(v),
                                digits: digits + 1,
                                line,
                            }
                        }
                        None if digits == 0 => return Err(BadChunk),
                        None => match b {
                            b'\r' => State::SizeLf { size },
                            b';' => State::Extension { size, line },
                            b' ' | b'\t' => State::SizeSpace { size, line },
                            _ => return Err(BadChunk),
                        },
                    }
                }
                State::SizeSpace { size, line } => {
                    let line = next_line_len(line, MAX_SIZE_LINE)?;
                    match b {
                        b' ' | b'\t' => State::SizeSpace { size, line },
                        b';' => State::Extension { size, line },
                        b'\r' => State::SizeLf { size },
                        _ => return Err(BadChunk),
                    }
                }
                State::Extension { size, line } => {
                    let line = next_line_len(line, MAX_SIZE_LINE)?;
                    match b {
                        b'\r' => State::SizeLf { size },
                        b'\n' => return Err(BadChunk),
                        _ => State::Extension { size, line },
                    }
                }
                State::SizeLf { size } => match (b, size) {
                    (b'\n', 0) => State::TrailerStart { seen: 0 },
                    (b'\n', size) => State::Data(size),
                    _ => return Err(BadChunk),
                },
                State::Data(left) => {
                    // Skip the data in one step (the one place bodies are large).
                    let take = usize::try_from(left)
                        .unwrap_or(usize::MAX)
                        .min(bytes.len() - i);
                    data(&bytes[i..i + take]);
                    i += take;
                    let left = left - take as u64;
                    self.state = if left == 0 {
                        State::DataCr
                    } else {
                        State::Data(left)
                    };
                    continue;
                }
                State::DataCr => match b {
                    b'\r' => State::DataLf,
                    _ => return Err(BadChunk),
                },
                State::DataLf => match b {
                    b'\n' => State::Size {
                        size: 0,
                        digits: 0,
                        line: 0,
                    },
                    _ => return Err(BadChunk),
                },
                State::TrailerStart { seen } => {
                    let seen = next_line_len(seen, MAX_TRAILERS)?;
                    match b {
                        b'\r' => State::FinalLf,
                        b'\n' => return Err(BadChunk),
                        _ => State::Trailer { seen },
                    }
                }
                State::Trailer { seen } => {
                    let seen = next_line_len(seen, MAX_TRAILERS)?;
                    match b {
                        b'\r' => State::TrailerLf { seen },
                        b'\n' => return Err(BadChunk),
                        _ => State::Trailer { seen },
                    }
                }
                State::TrailerLf { seen } => match b {
                    b'\n' => State::TrailerStart { seen },
                    _ => return Err(BadChunk),
                },
                State::FinalLf => match b {
                    b'\n' => State::Done,
                    _ => return Err(BadChunk),
                },
                State::Done => return Ok(i),
            };
            i += 1;
        }
        Ok(i)
    }
}

/// `len + 1`, or [`BadChunk`] past `max`.
fn next_line_len(len: u32, max: u32) -> Result<u32, BadChunk> {
    if len >= max {
        Err(BadChunk)
    } else {
        Ok(len + 1)
    }
}

fn hex_value(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Feeds `body` in pieces cut at `cuts`; the bytes that belong to the body.
    fn feed_in_pieces(body: &[u8], cuts: &[usize]) -> Result<Option<usize>, BadChunk> {
        feed_and_decode(body, cuts, &mut Vec::new())
    }

    /// [`feed_in_pieces`], the chunks' data appended to `data`.
    fn feed_and_decode(
        body: &[u8],
        cuts: &[usize],
        data: &mut Vec<u8>,
    ) -> Result<Option<usize>, BadChunk> {
        let mut end = ChunkedEnd::new();
        let mut at = 0;
        let mut bounds: Vec<usize> = cuts.iter().map(|c| c % (body.len() + 1)).collect();
        bounds.push(body.len());
        bounds.sort_unstable();
        for bound in bounds {
            if bound <= at {
                continue;
            }
            let used = end.feed_with(&body[at..bound], |d| data.extend_from_slice(d))?;
            at += used;
            if end.is_done() {
                return Ok(Some(at));
            }
            assert_eq!(at, bound, "bytes left over without the end being found");
        }
        Ok(None)
    }

    #[test]
    fn the_end_of_a_body_is_found_and_what_follows_is_left() {
        let body = b"5\r\nhello\r\n6 ;ext=1\r\n world\r\n0\r\nx-check: 1\r\n\r\nGET / HTTP/1.1";
        let framed = body.len() - b"GET / HTTP/1.1".len();
        assert_eq!(feed_in_pieces(body, &[]), Ok(Some(framed)));
        assert_eq!(feed_in_pieces(b"0\r\n\r\n", &[1, 3]), Ok(Some(5)));
        assert_eq!(feed_in_pieces(b"A\r\n0123456789\r\n0\r\n", &[]), Ok(None));
    }

    #[test]
    fn broken_framing_is_an_error() {
        for bad in [
            &b"\r\n"[..],
            b"g\r\n",
            b"5\nhello\r\n",
            b"5\r\nhello!\r\n",
            b"5\r\nhello\n0\r\n\r\n",
            b"0\r\nx\n",
            b"0\r\n\n",
            b"1000000000000000\r\n",
            b"5 x\r\nhello\r\n",
        ] {
            assert_eq!(feed_in_pieces(bad, &[]), Err(BadChunk), "{bad:?}");
        }
        let long_extension = format!("1;{}\r\n", "x".repeat(5000));
        assert_eq!(
            feed_in_pieces(long_extension.as_bytes(), &[]),
            Err(BadChunk)
        );
    }

    proptest! {
        /// However a well-formed body is cut into reads, its end is found exactly,
        /// and its data handed on whole.
        #[test]
        fn any_split_finds_the_same_end(
            chunks in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 1..40), 0..6),
            trailer in proptest::option::of("[a-z]{1,8}: [a-z0-9]{0,8}"),
            cuts in proptest::collection::vec(any::<usize>(), 0..8),
        ) {
            let mut body = Vec::new();
            for chunk in &chunks {
                body.extend_from_slice(format!("{:x}\r\n", chunk.len()).as_bytes());
                body.extend_from_slice(chunk);
                body.extend_from_slice(b"\r\n");
            }
            body.extend_from_slice(b"0\r\n");
            if let Some(t) = &trailer {
                body.extend_from_slice(t.as_bytes());
                body.extend_from_slice(b"\r\n");
            }
            body.extend_from_slice(b"\r\n");
            let framed = body.len();
            body.extend_from_slice(b"HTTP/1.1 200 OK\r\n");
            let mut data = Vec::new();
            prop_assert_eq!(feed_and_decode(&body, &cuts, &mut data), Ok(Some(framed)));
            prop_assert_eq!(data, chunks.concat(), "the data is the chunks' and nothing else");
        }
    }
}
