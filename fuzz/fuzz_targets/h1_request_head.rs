//! `sluice_h1::request::parse` on arbitrary bytes.
//!
//! Beyond "no panic":
//! - a `Ready` head's `len` is at most the input's length and the head ends with an
//!   empty line (`\r\n\r\n`, or a bare-LF form httparse accepts, as RFC 9112 §2.2
//!   allows; a head without a bare LF ends with `\r\n\r\n`);
//! - `body_len` is the value of the one `Content-Length` (0 without one), and a
//!   `Ready` head has no `Transfer-Encoding`, `Upgrade` or `Expect`;
//! - the target is a path (or `CONNECT`'s authority) and `path_and_query` cuts it
//!   in two; `host` is the first of `hosts()`;
//! - reading is independent of how the bytes arrive: every prefix shorter than a
//!   complete head is `Partial`, every longer one is `Ready` with the same `len`.
#![no_main]

use std::mem::MaybeUninit;

use libfuzzer_sys::fuzz_target;
use sluice_h1::fields::parse_length;
use sluice_h1::request::{self, MAX_HEADERS, Parsed};

/// What a parse says, without borrowing the buffer.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    Partial,
    Unsupported,
    Ready(usize),
}

fn outcome(buf: &[u8]) -> Outcome {
    let mut storage = [const { MaybeUninit::uninit() }; MAX_HEADERS];
    match request::parse(buf, &mut storage) {
        Parsed::Partial => Outcome::Partial,
        Parsed::Unsupported => Outcome::Unsupported,
        Parsed::Ready(head) => Outcome::Ready(head.len),
    }
}

fuzz_target!(|data: &[u8]| {
    let mut storage = [const { MaybeUninit::uninit() }; MAX_HEADERS];
    let len = match request::parse(data, &mut storage) {
        Parsed::Ready(head) => {
            let len = head.len;
            assert!(len <= data.len(), "len {len} past the input");
            let raw = &data[..len];
            assert!(
                raw.ends_with(b"\n\n") || raw.ends_with(b"\n\r\n"),
                "a head that does not end with an empty line: {raw:?}"
            );
            let bare_lf = raw
                .iter()
                .enumerate()
                .any(|(i, &b)| b == b'\n' && (i == 0 || raw[i - 1] != b'\r'));
            if !bare_lf {
                assert!(raw.ends_with(b"\r\n\r\n"), "{raw:?}");
            }

            let lengths: Vec<&[u8]> = head
                .fields
                .iter()
                .filter(|f| f.name.eq_ignore_ascii_case("content-length"))
                .map(|f| f.value)
                .collect();
            match lengths.as_slice() {
                [] => assert_eq!(head.body_len, 0),
                [one] => assert_eq!(Some(head.body_len), parse_length(one)),
                more => panic!("Ready with {} Content-Length fields", more.len()),
            }
            for f in head.fields {
                for refused in ["transfer-encoding", "upgrade", "expect"] {
                    assert!(
                        !f.name.eq_ignore_ascii_case(refused),
                        "Ready with {}",
                        f.name
                    );
                }
            }

            if head.method == http::Method::CONNECT {
                assert!(head.close, "CONNECT keeps the connection");
            } else {
                assert!(head.target.starts_with('/'), "{:?}", head.target);
                assert!(!head.target.contains('#'), "{:?}", head.target);
            }
            let (path, query) = head.path_and_query();
            assert_eq!(format!("{path}{query}"), head.target);
            assert!(!path.contains('?'));
            assert!(query.is_empty() || query.starts_with('?'));
            assert_eq!(head.host, head.hosts().next());
            len
        }
        Parsed::Partial | Parsed::Unsupported => {
            // A prefix that ends a head would make this input's result `Ready`
            // too: nothing more to check than the prefixes of a complete head.
            return;
        }
    };

    // The same head, however the bytes arrive. A head can only end at a line end,
    // so the prefixes that could differ are the ones ending at an LF; the bytes
    // just before and after the end are checked too.
    assert_eq!(outcome(&data[..len]), Outcome::Ready(len));
    if len < data.len() {
        assert_eq!(outcome(&data[..len + 1]), Outcome::Ready(len));
    }
    let mut checked = 0;
    for cut in (0..len).rev() {
        let at_line_end = cut > 0 && data[cut - 1] == b'\n';
        if at_line_end || cut + 3 >= len || cut == 0 {
            assert_eq!(
                outcome(&data[..cut]),
                Outcome::Partial,
                "the first {cut} bytes of a {len}-byte head"
            );
            checked += 1;
            if checked > 128 {
                break;
            }
        }
    }
});
