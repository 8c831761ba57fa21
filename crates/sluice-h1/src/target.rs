//! Whether an origin-form request target is one the `http` crate accepts as a
//! path and query, checked in place: `http::uri::PathAndQuery::try_from` copies
//! the target into a fresh allocation to check it, once per request.
//!
//! `http` decides byte by byte from two classes: the bytes allowed before the
//! first `?` and those allowed after it (a `#` ends the target there, and
//! `http` drops the rest; here a `#` is refused: no client sends a fragment,
//! and the part dropped is not what was counted). The classes are read from `http` itself, once, by asking it
//! about each byte, so the check here accepts what the linked `http` accepts
//! (the tests hold the two to each other over arbitrary targets).

use std::sync::LazyLock;

use http::uri::PathAndQuery;

/// The longest target `http` takes (`u16::MAX - 1` bytes).
const MAX_TARGET: usize = u16::MAX as usize - 1;

/// The bytes `http` accepts in the path and in the query of a target.
struct Classes {
    path: [bool; 256],
    query: [bool; 256],
}

static CLASSES: LazyLock<Classes> = LazyLock::new(|| {
    let accepts = |bytes: &[u8]| PathAndQuery::try_from(bytes).is_ok();
    let mut classes = Classes {
        path: [false; 256],
        query: [false; 256],
    };
    for b in 0..=0x7fu8 {
        // `?` starts the query and `#` the fragment: neither is a path byte.
        classes.path[usize::from(b)] = b != b'?' && b != b'#' && accepts(&[b'/', b]);
        classes.query[usize::from(b)] = b != b'#' && accepts(&[b'/', b'?', b]);
    }
    // A byte past ASCII only ever comes in a UTF-8 sequence (targets are `str`):
    // each is asked about in one.
    for b in 0x80..=0xffu8 {
        let sequence: &[u8] = match b {
            0x80..=0xbf => &[0xc2, b],
            0xc2..=0xdf => &[b, 0x80],
            0xe0 => &[0xe0, 0xa0, 0x80],
            0xe1..=0xef => &[b, 0x80, 0x80],
            0xf0 => &[0xf0, 0x90, 0x80, 0x80],
            0xf1..=0xf4 => &[b, 0x80, 0x80, 0x80],
            // Never in UTF-8.
            _ => continue,
        };
        let mut path = vec![b'/'];
        path.extend_from_slice(sequence);
        classes.path[usize::from(b)] = accepts(&path);
        path.insert(1, b'?');
        classes.query[usize::from(b)] = accepts(&path);
    }
    classes
});

/// True when `target` starts with `/`, holds no `#`, and is a path and query the
/// `http` crate accepts.
pub fn accepted(target: &str) -> bool {
    if target.len() > MAX_TARGET || !target.starts_with('/') {
        return false;
    }
    let classes = &*CLASSES;
    let bytes = target.as_bytes();
    let (path, query) = match bytes.iter().position(|&b| b == b'?') {
        Some(at) => (&bytes[..at], &bytes[at + 1..]),
        None => (bytes, &[][..]),
    };
    path.iter().all(|&b| classes.path[usize::from(b)])
        && query.iter().all(|&b| classes.query[usize::from(b)])
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn http_accepts(target: &str) -> bool {
        PathAndQuery::try_from(target).is_ok()
    }

    #[test]
    fn a_target_with_a_fragment_or_without_a_leading_slash_is_refused() {
        for target in ["/a#b", "/?a#", "#", "a", "", "*", "?a"] {
            assert!(!accepted(target), "{target:?}");
        }
    }

    #[test]
    fn targets_at_the_edges_are_judged_as_http_judges_them() {
        let long = format!("/{}", "a".repeat(MAX_TARGET));
        for target in [
            "/",
            "/a?",
            "/?",
            "/??",
            "/a?b=c&d",
            "/a b",
            "/a\"b",
            "/{x}",
            "/?{x}",
            "/a|b?c|d",
            "/%zz",
            "/\u{7f}",
            "/?\u{7f}",
            "/é?é",
            "/😀",
            "/\\",
            "/?\\",
            "/`",
            "/?`",
            "/^",
            &long[..MAX_TARGET],
            &long,
        ] {
            assert_eq!(accepted(target), http_accepts(target), "{target:?}");
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4_000))]
        #[test]
        fn every_target_is_judged_as_http_judges_it(
            rest in "[\\x00-\\x7f]{0,40}|\\PC{0,20}|[ -~]{0,40}",
        ) {
            let target = format!("/{}", rest.replace('#', ""));
            prop_assert_eq!(accepted(&target), http_accepts(&target), "{:?}", target);
        }
    }
}
