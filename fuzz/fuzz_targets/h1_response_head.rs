//! `sluice_h1::response::{parse, final_status, field}` on arbitrary bytes. The first
//! byte picks the rewrite (a HEAD request, the client's connection closing, which
//! fields the gateway replaces); the rest is what the upstream sent.
//!
//! Beyond "no panic":
//! - `parse`, `final_status` and `field` agree: `Partial` ⇔ no final status yet; a
//!   final head's status is `final_status`'s; an interim head is skipped by
//!   `final_status`; an error is a complete something (`Some`);
//! - a head's `len` is at most the input's and it ends with an empty line; every
//!   shorter prefix is `Partial` (the result does not depend on how bytes arrive);
//! - the head written for the client is one HTTP/1.1 head, complete exactly at its
//!   end, with the same status, no hop-by-hop field but the framing sluice sets,
//!   no replaced field but what `extra` wrote, `transfer-encoding: chunked` exactly
//!   when the body is relayed chunked (and then no `Content-Length`), the upstream's
//!   length when it is one; parsed again it frames the body the same way.
#![no_main]

use http::HeaderName;
use libfuzzer_sys::fuzz_target;
use sluice_h1::fields::{MAX_HEADERS, is_hop_by_hop, parse_length};
use sluice_h1::response::{self, Framing, Head, Parsed, Rewrite};

const EXTRA: &[u8] = b"x-ratelimit-limit: 30\r\n";

fn replaced_sets() -> [Vec<HeaderName>; 4] {
    [
        vec![],
        vec![HeaderName::from_static("x-ratelimit-limit")],
        vec![
            HeaderName::from_static("x-ratelimit-limit"),
            HeaderName::from_static("date"),
        ],
        vec![
            HeaderName::from_static("ratelimit"),
            HeaderName::from_static("ratelimit-policy"),
        ],
    ]
}

fn parse(
    buf: &[u8],
    rewrite: &Rewrite<'_>,
    client: &mut Vec<u8>,
) -> (Result<Parsed, response::BadResponse>, Option<bool>) {
    let mut dated = None;
    let parsed = response::parse(buf, rewrite, client, |out, d| {
        dated = Some(d);
        out.extend_from_slice(EXTRA);
        if !d {
            out.extend_from_slice(b"date: Thu, 01 Jan 2026 00:00:00 GMT\r\n");
        }
    });
    (parsed, dated)
}

/// True when `inner` lies inside `outer`.
fn within(inner: &[u8], outer: &[u8]) -> bool {
    let o = outer.as_ptr_range();
    let i = inner.as_ptr_range();
    o.start <= i.start && i.end <= o.end
}

fn check_client_head(head: &Head, rewrite: &Rewrite<'_>, client: &[u8], upstream: &[u8]) {
    // One complete HTTP/1.1 head, ending exactly where it was written.
    let mut fields = [httparse::EMPTY_HEADER; MAX_HEADERS + 8];
    let mut reparsed = httparse::Response::new(&mut fields);
    match reparsed.parse(client) {
        Ok(httparse::Status::Complete(n)) => assert_eq!(n, client.len(), "{client:?}"),
        other => panic!("the client head does not parse: {other:?} {client:?}"),
    }
    assert_eq!(reparsed.version, Some(1));
    assert_eq!(reparsed.code, Some(head.status));
    assert!(client.ends_with(b"\r\n\r\n"));

    let relayed_chunked = matches!(head.framing, Framing::Chunked | Framing::UntilClose);
    let mut chunked_fields = 0;
    let mut close_fields = 0;
    let mut extra_fields = 0;
    for f in reparsed.headers.iter() {
        let name = f.name.as_bytes();
        if name.eq_ignore_ascii_case(b"transfer-encoding") {
            assert_eq!(f.value, b"chunked");
            chunked_fields += 1;
        } else if name.eq_ignore_ascii_case(b"connection") {
            assert_eq!(f.value, b"close");
            close_fields += 1;
        } else {
            assert!(!is_hop_by_hop(name), "hop-by-hop {:?} relayed", f.name);
        }
        if name.eq_ignore_ascii_case(b"content-length") {
            assert!(!relayed_chunked, "a length on a body relayed chunked");
            if let Framing::Length(n) = head.framing {
                assert_eq!(parse_length(f.value), Some(n));
            }
        }
        if name.eq_ignore_ascii_case(b"x-ratelimit-limit") {
            extra_fields += 1;
        }
        for r in rewrite.replaced {
            // `extra` writes these two itself.
            let ours = matches!(r.as_str(), "x-ratelimit-limit" | "date");
            if !ours {
                assert!(!name.eq_ignore_ascii_case(r.as_str().as_bytes()));
            }
        }
    }
    assert_eq!(chunked_fields, usize::from(relayed_chunked), "{client:?}");
    assert_eq!(close_fields, usize::from(rewrite.close), "{client:?}");
    if rewrite
        .replaced
        .iter()
        .any(|r| r.as_str() == "x-ratelimit-limit")
    {
        assert_eq!(extra_fields, 1, "the upstream's replaced field relayed");
    }

    // Parsed again (as the upstream's head), it frames the body the same way; a body
    // that ran to the close is now chunked. A HEAD response is not checked (its
    // fields describe the body a GET would have had), nor a head that the fields
    // sluice adds took past `MAX_HEADERS` (an upstream head of up to 100 fields
    // becomes a client head of up to 104, as on the hyper path: see FUZZING.md).
    if !rewrite.head_request && reparsed.headers.len() <= MAX_HEADERS {
        let again = Rewrite {
            head_request: false,
            close: rewrite.close,
            replaced: &[],
        };
        let mut twice = Vec::new();
        let (parsed, _) = parse(client, &again, &mut twice);
        let expected = match head.framing {
            Framing::UntilClose => Framing::Chunked,
            f => f,
        };
        match parsed {
            Ok(Parsed::Final(h)) => {
                assert_eq!(h.len, client.len());
                assert_eq!(h.status, head.status);
                assert_eq!(h.framing, expected, "{upstream:?} → {client:?}");
            }
            other => panic!("the client head parsed again: {other:?} {client:?}"),
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&flags, buf)) = data.split_first() else {
        return;
    };
    let sets = replaced_sets();
    let rewrite = Rewrite {
        head_request: flags & 1 != 0,
        close: flags & 2 != 0,
        replaced: &sets[usize::from(flags >> 2) % sets.len()],
    };
    let mut client = Vec::new();
    let (parsed, dated) = parse(buf, &rewrite, &mut client);
    let status = response::final_status(buf);
    match &parsed {
        Ok(Parsed::Partial) => {
            assert_eq!(status, None);
            assert_eq!(dated, None);
        }
        Err(_) => {
            assert!(status.is_some(), "an error before a complete head");
            assert_eq!(dated, None);
        }
        Ok(Parsed::Interim { len }) => {
            let len = *len;
            assert!(len <= buf.len());
            assert!(buf[..len].ends_with(b"\n\n") || buf[..len].ends_with(b"\n\r\n"));
            assert_eq!(status, response::final_status(&buf[len..]));
            assert_eq!(dated, None);
        }
        Ok(Parsed::Final(head)) => {
            assert!(head.len <= buf.len());
            let raw = &buf[..head.len];
            assert!(raw.ends_with(b"\n\n") || raw.ends_with(b"\n\r\n"));
            assert!((200..=999).contains(&head.status), "{}", head.status);
            assert_eq!(status, Some(head.status));
            assert!(dated.is_some(), "extra was not called");
            if rewrite.head_request || head.status == 204 || head.status == 304 {
                assert_eq!(head.framing, Framing::Empty);
            }
            if head.framing == Framing::UntilClose {
                assert!(!head.reusable);
            }
            // `field` reads the same head.
            if let Some(v) = response::field(buf, b"content-length") {
                assert!(within(v, raw));
                if let Framing::Length(n) = head.framing {
                    assert_eq!(parse_length(v), Some(n));
                }
            }
            for name in [&b"x-sluice-cost"[..], b"date", b"server"] {
                if let Some(v) = response::field(buf, name) {
                    assert!(within(v, raw));
                }
            }
            check_client_head(head, &rewrite, &client, buf);
        }
    }
    // A complete head (interim or final) is `Partial` in every shorter prefix.
    let len = match parsed {
        Ok(Parsed::Interim { len }) => len,
        Ok(Parsed::Final(ref h)) => h.len,
        _ => return,
    };
    let mut checked = 0;
    for cut in (0..len).rev() {
        if cut == 0 || buf[cut - 1] == b'\n' || cut + 3 >= len {
            let mut scratch = Vec::new();
            let (p, _) = parse(&buf[..cut], &rewrite, &mut scratch);
            assert_eq!(p, Ok(Parsed::Partial), "the first {cut} bytes of {len}");
            checked += 1;
            if checked > 128 {
                break;
            }
        }
    }
});
