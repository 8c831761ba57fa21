//! Counts of texts seen lately, so a text sent again is not tokenized again.
//!
//! LLM calls repeat most of their text: a chat sends its whole conversation again
//! each turn, an application its system prompt and tool definitions with every
//! call, an agent its growing transcript. Tokenizing is the most expensive step of
//! an estimate (tens of nanoseconds a token), hashing a text a small part of that:
//! each thread keeps the counts of the texts it counted last, in a table of fixed
//! size (no allocation, a bounded few hundred kilobytes a thread), found by a hash
//! of the text keyed at random for the process, with the text's length and
//! encoding.
//!
//! Two texts of one length, hash and encoding would share a count. The hash is
//! 64 bits, keyed per process, so an outsider cannot aim for that; and an estimate
//! only reserves: a call settles at what the provider reports.

use std::cell::RefCell;
use std::hash::BuildHasher as _;

use crate::tokens::Encoding;

/// Texts shorter than this are tokenized each time: hashing and looking up cost
/// about what counting them does.
const MIN_CACHED_BYTES: usize = 64;

/// Entries a thread keeps (a power of two): 16 bytes each.
const ENTRIES: usize = 1 << 14;

/// One text's count.
#[derive(Clone, Copy, Default)]
struct Entry {
    /// The text's keyed hash; 0 for an empty entry.
    hash: u64,
    /// The text's length in bytes and its encoding, in one word.
    len_and_encoding: u32,
    count: u32,
}

thread_local! {
    static TABLE: RefCell<Vec<Entry>> = const { RefCell::new(Vec::new()) };
}

/// The hasher of every thread's table, keyed at random once per process.
fn hasher() -> &'static foldhash::quality::RandomState {
    static STATE: std::sync::OnceLock<foldhash::quality::RandomState> = std::sync::OnceLock::new();
    STATE.get_or_init(foldhash::quality::RandomState::default)
}

/// `text`'s count in `encoding`: the one kept for it, else `tokenize(text)` (kept
/// when `text` is long enough to be worth it).
pub(crate) fn count(encoding: Encoding, text: &str, tokenize: impl FnOnce(&str) -> usize) -> usize {
    if text.len() < MIN_CACHED_BYTES {
        return tokenize(text);
    }
    // A text past 2^31 bytes is never kept (its length would not fit the key).
    let Ok(len) = u32::try_from(text.len()) else {
        return tokenize(text);
    };
    if len >= 1 << 31 {
        return tokenize(text);
    }
    let key = len << 1 | u32::from(encoding == Encoding::Cl100kBase);
    // Never 0: 0 marks an empty entry.
    let hash = hasher().hash_one(text) | 1;
    let slot = usize::try_from(hash >> 32).unwrap_or(0) & (ENTRIES - 1);
    let kept = TABLE.with_borrow(|table| {
        table
            .get(slot)
            .filter(|e| e.hash == hash && e.len_and_encoding == key)
            .map(|e| e.count)
    });
    if let Some(count) = kept {
        return count as usize;
    }
    let n = tokenize(text);
    if let Ok(count) = u32::try_from(n) {
        TABLE.with_borrow_mut(|table| {
            if table.is_empty() {
                table.resize(ENTRIES, Entry::default());
            }
            if let Some(entry) = table.get_mut(slot) {
                *entry = Entry {
                    hash,
                    len_and_encoding: key,
                    count,
                };
            }
        });
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_text_counted_again_is_not_tokenized_again_and_others_are() {
        let text = "a system prompt long enough to be worth keeping its count for later calls";
        let calls = std::cell::Cell::new(0);
        let tokenize = |t: &str| {
            calls.set(calls.get() + 1);
            t.len() / 4
        };
        let first = count(Encoding::O200kBase, text, tokenize);
        assert_eq!(count(Encoding::O200kBase, text, tokenize), first);
        assert_eq!(calls.get(), 1, "the second count came from the table");
        // Another encoding, another text of the same length, a short text: counted.
        count(Encoding::Cl100kBase, text, tokenize);
        let other = text.replace('a', "b");
        count(Encoding::O200kBase, &other, tokenize);
        count(Encoding::O200kBase, "short", tokenize);
        count(Encoding::O200kBase, "short", tokenize);
        assert_eq!(calls.get(), 5);
    }

    #[cfg(feature = "tokenizer")]
    #[test]
    fn kept_counts_are_the_tokenizers() {
        let texts: Vec<String> = (0..200)
            .map(|i| {
                format!(
                    "message {i}: {}",
                    "the quick brown fox jumps over the lazy dog ".repeat(i % 7 + 2)
                )
            })
            .collect();
        for _ in 0..2 {
            for text in &texts {
                for encoding in [Encoding::O200kBase, Encoding::Cl100kBase] {
                    let direct = match encoding {
                        Encoding::O200kBase => bpe_openai::o200k_base().count(text),
                        Encoding::Cl100kBase => bpe_openai::cl100k_base().count(text),
                    };
                    assert_eq!(encoding.count(text) as usize, direct, "{text}");
                }
            }
        }
    }
}
