//! The pretokenizers of OpenAI's `o200k_base` and `cl100k_base` encodings, for
//! ASCII text, without a regular expression.
//!
//! An encoding splits a text into pieces by a regular expression before it
//! encodes each piece; for a short text the search's fixed costs (a cache from a
//! pool, a lazy DFA's start state, once a piece) are most of a count. For ASCII
//! text the expressions reduce to a handful of character classes that never
//! overlap (a letter is upper or lower case, never both; no letter or digit is
//! space), so the piece a leftmost-first search finds at a position is found by
//! reading the text once, as below. Text with any other byte goes to the
//! encoding's own expression. The property test at the end holds this to the
//! expression on generated text: the same pieces, always.
//!
//! The expressions (`bpe-openai`, with Unicode classes; the second and third
//! patterns follow the first, in order of preference):
//! - `o200k_base`: `[^\r\n\p{L}\p{N}]?[\p{Lu}…]*[\p{Ll}…]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?`
//!   `| [^\r\n\p{L}\p{N}]?[\p{Lu}…]+[\p{Ll}…]*(?i:…)?` `| \p{N}{1,3}`
//!   `|  ?[^\s\p{L}\p{N}]+[\r\n/]*` `| \s*[\r\n]+` `| \s+$`; then `\s+\s` (its last
//!   character given back), then `\s+`.
//! - `cl100k_base`: `(?i:'s|'t|'re|'ve|'m|'ll|'d)` `| [^\r\n\p{L}\p{N}]?\p{L}+`
//!   `| \p{N}{1,3}` `|  ?[^\s\p{L}\p{N}]+[\r\n]*` `| \s*[\r\n]+` `| \s+$`; then the
//!   same two.

/// Which encoding's expression to follow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Split {
    /// `o200k_base`'s: letters split at a lower-to-upper case change, a
    /// contraction kept with its word, `/` and line ends kept with punctuation.
    O200k,
    /// `cl100k_base`'s: a letter run whole, a contraction a piece of its own.
    Cl100k,
}

/// `\s` in ASCII: tab, line feed, vertical tab, form feed, carriage return, space.
fn is_space(b: u8) -> bool {
    matches!(b, b'\t'..=b'\r' | b' ')
}

/// `[^\r\n\p{L}\p{N}]`: what may lead a word.
fn is_lead(b: u8) -> bool {
    !matches!(b, b'\r' | b'\n') && !b.is_ascii_alphanumeric()
}

/// `[^\s\p{L}\p{N}]`: punctuation and the control bytes that are not space.
fn is_punct(b: u8) -> bool {
    !is_space(b) && !b.is_ascii_alphanumeric()
}

/// How many of `text`'s first bytes satisfy `class`.
fn run(text: &[u8], class: impl Fn(u8) -> bool) -> usize {
    text.iter().position(|&b| !class(b)).unwrap_or(text.len())
}

/// The length of the contraction `(?i:'s|'t|'re|'ve|'m|'ll|'d)` at the start of
/// `text`, or 0.
fn contraction(text: &[u8]) -> usize {
    let [b'\'', c, rest @ ..] = text else {
        return 0;
    };
    match c.to_ascii_lowercase() {
        b's' | b't' | b'm' | b'd' => 2,
        b'r' | b'v' if rest.first().is_some_and(|e| e.eq_ignore_ascii_case(&b'e')) => 3,
        b'l' if rest.first().is_some_and(|l| l.eq_ignore_ascii_case(&b'l')) => 3,
        _ => 0,
    }
}

/// The length of the piece at the start of `text` (ASCII, not empty).
fn piece(text: &[u8], split: Split) -> usize {
    let first = text[0];
    if split == Split::Cl100k {
        let n = contraction(text);
        if n > 0 {
            return n;
        }
    }
    // A word, with at most one leading byte that is neither a line end, a
    // letter nor a digit.
    let lead = usize::from(is_lead(first) && text.get(1).is_some_and(u8::is_ascii_alphabetic));
    let word = &text[lead..];
    if word.first().is_some_and(u8::is_ascii_alphabetic) {
        let len = match split {
            Split::Cl100k => run(word, |b| b.is_ascii_alphabetic()),
            Split::O200k => {
                let upper = run(word, |b| b.is_ascii_uppercase());
                let lower = run(&word[upper..], |b| b.is_ascii_lowercase());
                // `[Lu]*[Ll]+` when a lower-case letter follows the capitals,
                // else `[Lu]+[Ll]*` (no lower case at all): the same length.
                let len = upper + lower;
                len + contraction(&word[len..])
            }
        };
        return lead + len;
    }
    if first.is_ascii_digit() {
        return run(&text[..text.len().min(3)], |b| b.is_ascii_digit());
    }
    // ` ?[^\s\p{L}\p{N}]+` and its trailing line ends (and, in o200k, slashes).
    let space = usize::from(first == b' ' && text.get(1).copied().is_some_and(is_punct));
    let punct = run(&text[space..], is_punct);
    if punct > 0 {
        let at = space + punct;
        let tail = match split {
            Split::O200k => run(&text[at..], |b| matches!(b, b'\r' | b'\n' | b'/')),
            Split::Cl100k => run(&text[at..], |b| matches!(b, b'\r' | b'\n')),
        };
        return at + tail;
    }
    // Space: through its last line end (`\s*[\r\n]+`); all of it at the text's
    // end (`\s+$`); else all but its last byte (`\s+\s`, the last given back)
    // when it has two or more, else the one (`\s+`).
    let spaces = run(text, is_space);
    if let Some(last_line_end) = text[..spaces]
        .iter()
        .rposition(|&b| b == b'\r' || b == b'\n')
    {
        return last_line_end + 1;
    }
    if spaces == text.len() || spaces == 1 {
        return spaces;
    }
    spaces - 1
}

/// Calls `each` with the pieces of `text` (ASCII) in order, as `split`'s
/// encoding's expression cuts them.
pub(crate) fn pieces(text: &[u8], split: Split, mut each: impl FnMut(&[u8])) {
    let mut rest = text;
    while !rest.is_empty() {
        // Never 0 for a text that is not empty: every branch takes a byte.
        let n = piece(rest, split).max(1);
        let (head, tail) = rest.split_at(n);
        each(head);
        rest = tail;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ours(text: &str, split: Split) -> Vec<String> {
        let mut out = Vec::new();
        pieces(text.as_bytes(), split, |p| {
            out.push(String::from_utf8_lossy(p).into_owned());
        });
        out
    }

    fn theirs(text: &str, split: Split) -> Vec<String> {
        let tokenizer = match split {
            Split::O200k => bpe_openai::o200k_base(),
            Split::Cl100k => bpe_openai::cl100k_base(),
        };
        tokenizer.split(text).map(str::to_owned).collect()
    }

    /// Text made of the bytes and runs where the expressions' branches meet.
    fn ascii_text() -> impl Strategy<Value = String> {
        let atoms = prop::sample::select(vec![
            "a",
            "z",
            "A",
            "Z",
            "hello",
            "HELLO",
            "Hello",
            "hELLo",
            "iPhone",
            "0",
            "12",
            "1234",
            " ",
            "  ",
            "\t",
            "\n",
            "\r\n",
            "\x0b",
            "\x0c",
            "\r",
            "'",
            "'s",
            "'S",
            "'re",
            "'RE",
            "'Ve",
            "'ll",
            "'LL",
            "'d",
            "'m",
            "'t",
            "'x",
            "'",
            "/",
            "//",
            ".",
            "?!",
            "-",
            "_",
            "\x00",
            "\x1f",
            "\x7f",
            "\"",
            "{",
            "}",
            ":",
            ",",
            "don't",
            "I'M",
            "e.g.",
            "http://x/y",
            " 42",
            " ,",
            " \n",
            "\n\n",
            "  \n  ",
            " '",
            "' s",
        ]);
        prop::collection::vec(atoms, 0..24).prop_map(|v| v.concat())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4096))]

        #[test]
        fn c2_ascii_pieces_are_the_expressions_pieces(text in ascii_text()) {
            for split in [Split::O200k, Split::Cl100k] {
                prop_assert_eq!(ours(&text, split), theirs(&text, split), "{:?} {:?}", split, text);
            }
        }

        #[test]
        fn c2_any_ascii_bytes_give_the_expressions_pieces(bytes in prop::collection::vec(0u8..0x80, 0..64)) {
            let text = String::from_utf8(bytes).expect("ASCII");
            for split in [Split::O200k, Split::Cl100k] {
                prop_assert_eq!(ours(&text, split), theirs(&text, split), "{:?} {:?}", split, text);
            }
        }
    }

    #[test]
    fn c2_pieces_of_a_chat_turn() {
        let text = "Thanks. Question 12 of thread 345: does release 4.7 change that?\n\n  I'm SURE";
        for split in [Split::O200k, Split::Cl100k] {
            assert_eq!(ours(text, split), theirs(text, split));
        }
        assert_eq!(ours("don't STOPnow", Split::O200k), ["don't", " STOPnow"]);
        assert_eq!(ours("don't", Split::Cl100k), ["don", "'t"]);
    }
}
