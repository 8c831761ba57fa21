//! The upstream's response head: parsed in place, its body's framing found, and
//! rewritten into the head the client gets.

use std::mem::MaybeUninit;

use crate::fields::{
    MAX_HEADERS, for_each_connection_named, is_hop_by_hop, named_in_connection, parse_length,
};

/// How the response body is delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// No body (a response to HEAD, 204, 304).
    Empty,
    /// `Content-Length` bytes.
    Length(u64),
    /// Chunked: relayed with its framing as it is.
    Chunked,
    /// Until the upstream closes the connection; relayed to the client chunked (as
    /// hyper's server does), so its connection goes on.
    UntilClose,
}

/// What an upstream response head is.
#[derive(Debug, PartialEq, Eq)]
pub enum Parsed {
    /// The head is not complete yet.
    Partial,
    /// An interim (1xx) response of `len` bytes: skipped, the real one follows.
    Interim {
        /// Bytes of the interim head.
        len: usize,
    },
    /// A final response; its head for the client is in the buffer [`parse`] was given.
    Final(Head),
}

/// A final response head.
#[derive(Debug, PartialEq, Eq)]
pub struct Head {
    /// Bytes of the head in the upstream's buffer.
    pub len: usize,
    /// The status code.
    pub status: u16,
    /// How its body is delimited.
    pub framing: Framing,
    /// The upstream connection can serve another request once this body is read.
    pub reusable: bool,
}

/// The upstream's response cannot be relayed (answered 502).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BadResponse;

/// How the client's head is made from the upstream's.
#[derive(Debug, Clone, Copy)]
pub struct Rewrite<'a> {
    /// The request was a HEAD (the response has no body, whatever its fields say).
    pub head_request: bool,
    /// The client's connection closes after this response.
    pub close: bool,
    /// Fields the gateway sets itself (the rate-limit ones): the upstream's are dropped.
    pub replaced: &'a [http::HeaderName],
    /// Fields whose names start with this (in any case) are dropped too: the
    /// signals between the gateway and its upstream (`x-sluice-`); empty for none.
    pub dropped_prefix: &'a [u8],
    /// The client gets a body of known length chunked too (it is changed on its
    /// way: its length is no longer the upstream's).
    pub rechunk: bool,
}

/// What `buf` holds after any interim (1xx) heads: `None` while no final head is
/// complete; `Some(status)` for a complete final head, `Some(0)` for something that is
/// no head at all (which [`parse`] refuses). Used while a request is still being
/// written, to see whether the upstream has answered it already.
pub fn final_status(mut buf: &[u8]) -> Option<u16> {
    loop {
        let mut fields = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut response = httparse::Response::new(&mut fields);
        match response.parse(buf) {
            Ok(httparse::Status::Complete(len)) => match response.code {
                Some(code @ 100..=199) if code != 101 => buf = &buf[len..],
                code => return Some(code.unwrap_or(0)),
            },
            Ok(httparse::Status::Partial) => return None,
            Err(_) => return Some(0),
        }
    }
}

/// The value of the first field `name` (lowercase) of the complete final head at the
/// start of `buf`, if it has one.
pub fn field<'b>(buf: &'b [u8], name: &[u8]) -> Option<&'b [u8]> {
    let mut fields = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut response = httparse::Response::new(&mut fields);
    match response.parse(buf) {
        Ok(httparse::Status::Complete(_)) => response
            .headers
            .iter()
            .find(|f| f.name.as_bytes().eq_ignore_ascii_case(name))
            .map(|f| f.value),
        _ => None,
    }
}

/// Calls `each` with the value of every field named `name` (any case) of the
/// complete response head at the start of `buf`, in order; none for a head that
/// is not complete.
pub fn each_field(buf: &[u8], name: &[u8], mut each: impl FnMut(&[u8])) {
    let mut fields = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut response = httparse::Response::new(&mut fields);
    if let Ok(httparse::Status::Complete(_)) = response.parse(buf) {
        response
            .headers
            .iter()
            .filter(|f| f.name.as_bytes().eq_ignore_ascii_case(name))
            .for_each(|f| each(f.value));
    }
}

/// Parses the response head at the start of `buf`. For a final response the head the
/// client gets is written to `client`: the status line as HTTP/1.1, the upstream's
/// fields but the hop-by-hop and the replaced ones, then what `extra` writes (the
/// rate-limit fields, and a `Date` when it is told the upstream sent none), then the
/// framing (`transfer-encoding: chunked` for a chunked body and one that runs to the
/// upstream's close, `connection: close` when the client's connection closes after),
/// then the blank line.
///
/// # Errors
/// [`BadResponse`] for a head that is malformed, too large a list of fields, a status
/// under 100, a `101 Switching Protocols` (never asked for) or lengths that disagree.
pub fn parse(
    buf: &[u8],
    rewrite: &Rewrite<'_>,
    client: &mut Vec<u8>,
    extra: impl FnOnce(&mut Vec<u8>, bool),
) -> Result<Parsed, BadResponse> {
    let Rewrite {
        head_request,
        close,
        replaced,
        dropped_prefix,
        rechunk,
    } = *rewrite;
    let mut fields = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
    let mut response = httparse::Response::new(&mut []);
    let len = match httparse::ParserConfig::default().parse_response_with_uninit_headers(
        &mut response,
        buf,
        &mut fields,
    ) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) => return Ok(Parsed::Partial),
        Err(_) => return Err(BadResponse),
    };
    let (Some(version), Some(status)) = (response.version, response.code) else {
        return Err(BadResponse);
    };
    match status {
        0..=99 | 101 => return Err(BadResponse),
        100..=199 => return Ok(Parsed::Interim { len }),
        _ => {}
    }

    let mut length = None;
    let mut chunked = None;
    let mut upstream_closes = version == 0;
    let mut connection_names = false;
    let mut dated = false;
    for field in response.headers.iter() {
        let name = field.name.as_bytes();
        if name.eq_ignore_ascii_case(b"content-length") {
            let n = parse_length(field.value).ok_or(BadResponse)?;
            if length.is_some_and(|m| m != n) {
                return Err(BadResponse);
            }
            length = Some(n);
        } else if name.eq_ignore_ascii_case(b"transfer-encoding") {
            // Chunked when the last coding is chunked; any other coding last means
            // the body runs to the close.
            let last = field.value.rsplit(|&b| b == b',').next().unwrap_or(b"");
            chunked = Some(last.trim_ascii().eq_ignore_ascii_case(b"chunked"));
        } else if name.eq_ignore_ascii_case(b"connection") {
            for token in field.value.split(|&b| b == b',') {
                let token = token.trim_ascii();
                if token.eq_ignore_ascii_case(b"close") {
                    upstream_closes = true;
                } else if version == 0 && token.eq_ignore_ascii_case(b"keep-alive") {
                    upstream_closes = false;
                }
            }
            for_each_connection_named(field.value, |_| connection_names = true);
        }
    }
    let framing = if head_request || status == 204 || status == 304 {
        Framing::Empty
    } else {
        match (chunked, length) {
            (Some(true), _) => Framing::Chunked,
            (Some(false), _) | (None, None) => Framing::UntilClose,
            (None, Some(n)) => Framing::Length(n),
        }
    };

    let to_client_chunked = match framing {
        Framing::Chunked | Framing::UntilClose => true,
        Framing::Length(_) => rechunk,
        Framing::Empty => false,
    };
    client.clear();
    client.extend_from_slice(b"HTTP/1.1 ");
    client.extend_from_slice(itoa::Buffer::new().format(status).as_bytes());
    client.push(b' ');
    client.extend_from_slice(response.reason.unwrap_or("").as_bytes());
    client.extend_from_slice(b"\r\n");
    for field in response.headers.iter() {
        let name = field.name.as_bytes();
        let content_length = name.eq_ignore_ascii_case(b"content-length");
        if is_hop_by_hop(name)
            // A body the client gets chunked has no length field, whatever the
            // upstream said.
            || (to_client_chunked && content_length)
            // `Connection` may name any field but the one that frames the body.
            || (connection_names && !content_length && named_in_connection(response.headers, name))
            || replaced.iter().any(|r| r.as_str().as_bytes().eq_ignore_ascii_case(name))
            || (!dropped_prefix.is_empty()
                && name.len() >= dropped_prefix.len()
                && name[..dropped_prefix.len()].eq_ignore_ascii_case(dropped_prefix))
        {
            continue;
        }
        dated |= name.eq_ignore_ascii_case(b"date");
        client.extend_from_slice(name);
        client.extend_from_slice(b": ");
        client.extend_from_slice(field.value);
        client.extend_from_slice(b"\r\n");
    }
    extra(client, dated);
    if to_client_chunked {
        client.extend_from_slice(b"transfer-encoding: chunked\r\n");
    }
    if close {
        client.extend_from_slice(b"connection: close\r\n");
    }
    client.extend_from_slice(b"\r\n");

    Ok(Parsed::Final(Head {
        len,
        status,
        framing,
        reusable: !upstream_closes && framing != Framing::UntilClose,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_final_head_is_seen_past_interim_ones() {
        assert_eq!(final_status(b""), None);
        assert_eq!(final_status(b"HTTP/1.1 413 Payload Too La"), None);
        assert_eq!(final_status(b"HTTP/1.1 100 Continue\r\n\r\n"), None);
        assert_eq!(
            final_status(b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\nHTTP/1.1 200 OK\r\n"),
            None
        );
        assert_eq!(
            final_status(b"HTTP/1.1 103 Early Hints\r\n\r\nHTTP/1.1 413 Payload Too Large\r\n\r\n"),
            Some(413)
        );
        assert_eq!(
            final_status(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"),
            Some(200)
        );
        assert_eq!(final_status(b"HTTP/1.1 101 Switching\r\n\r\n"), Some(101));
        assert_eq!(final_status(b"not a response at all\r\n\r\n"), Some(0));
    }

    fn head(raw: &str, head_request: bool, close: bool) -> (Result<Parsed, BadResponse>, String) {
        rechunked(raw, head_request, close, false)
    }

    fn rechunked(
        raw: &str,
        head_request: bool,
        close: bool,
        rechunk: bool,
    ) -> (Result<Parsed, BadResponse>, String) {
        let mut client = Vec::new();
        let rewrite = Rewrite {
            head_request,
            close,
            replaced: &[http::HeaderName::from_static("x-ratelimit-limit")],
            dropped_prefix: b"x-signal-",
            rechunk,
        };
        let parsed = parse(raw.as_bytes(), &rewrite, &mut client, |c, dated| {
            c.extend_from_slice(b"x-ratelimit-limit: 300\r\n");
            if !dated {
                c.extend_from_slice(b"date: now\r\n");
            }
        });
        (parsed, String::from_utf8(client).expect("ascii"))
    }

    fn framing(raw: &str) -> (Framing, bool) {
        match head(raw, false, false).0 {
            Ok(Parsed::Final(h)) => (h.framing, h.reusable),
            other => panic!("{raw:?}: {other:?}"),
        }
    }

    #[test]
    fn a_body_changed_on_its_way_reaches_the_client_chunked() {
        let (parsed, client) = rechunked(
            "HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\n",
            false,
            false,
            true,
        );
        assert!(
            matches!(
                parsed,
                Ok(Parsed::Final(Head {
                    framing: Framing::Length(3),
                    ..
                }))
            ),
            "{parsed:?}: read as the upstream framed it"
        );
        assert!(!client.contains("content-length"), "{client}");
        assert!(
            client.contains("transfer-encoding: chunked\r\n"),
            "{client}"
        );
        let (_, empty) = rechunked("HTTP/1.1 204 No Content\r\n\r\n", false, false, true);
        assert!(!empty.contains("transfer-encoding"), "{empty}");
    }

    #[test]
    fn the_client_head_keeps_end_to_end_fields_and_adds_the_rate_limit_ones() {
        let raw = "HTTP/1.1 201 Created\r\nServer: up\r\nConnection: keep-alive, X-Hop, Content-Length\r\n\
                   X-Hop: 1\r\nX-RateLimit-Limit: 5\r\nKeep-Alive: timeout=5\r\nDate: then\r\n\
                   X-Signal-Who: up\r\nx-signal-what: up\r\nX-Signals: kept\r\n\
                   Content-Length: 2\r\n\r\n{}";
        let (parsed, client) = head(raw, false, false);
        assert_eq!(
            parsed,
            Ok(Parsed::Final(Head {
                len: raw.len() - 2,
                status: 201,
                framing: Framing::Length(2),
                reusable: true,
            }))
        );
        assert_eq!(
            client,
            "HTTP/1.1 201 Created\r\nServer: up\r\nDate: then\r\nX-Signals: kept\r\n\
             Content-Length: 2\r\nx-ratelimit-limit: 300\r\n\r\n"
        );
        let (_, client) = head("HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n", false, true);
        assert!(
            client.ends_with("date: now\r\nconnection: close\r\n\r\n"),
            "{client}"
        );
    }

    #[test]
    fn framing_follows_the_status_the_method_and_the_fields() {
        assert_eq!(
            framing("HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 5\r\n\r\n"),
            (Framing::Chunked, true)
        );
        assert_eq!(
            framing("HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\n"),
            (Framing::UntilClose, false)
        );
        assert_eq!(
            framing("HTTP/1.1 200 OK\r\n\r\n"),
            (Framing::UntilClose, false)
        );
        assert_eq!(
            framing("HTTP/1.1 204 No Content\r\n\r\n"),
            (Framing::Empty, true)
        );
        assert_eq!(
            framing("HTTP/1.1 200 OK\r\ncontent-length: 3\r\nconnection: close\r\n\r\n"),
            (Framing::Length(3), false)
        );
        assert_eq!(
            framing("HTTP/1.0 200 OK\r\ncontent-length: 3\r\n\r\n"),
            (Framing::Length(3), false)
        );
        assert_eq!(
            framing("HTTP/1.0 200 OK\r\ncontent-length: 3\r\nconnection: keep-alive\r\n\r\n"),
            (Framing::Length(3), true)
        );
        match head("HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\n", true, false).0 {
            Ok(Parsed::Final(h)) => assert_eq!(h.framing, Framing::Empty),
            other => panic!("{other:?}"),
        }
        let (_, client) = head(
            "HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\ncontent-length: 5\r\nconnection: date\r\ndate: x\r\n\r\n",
            false,
            false,
        );
        assert!(!client.contains("content-length"), "{client}");
        assert!(
            client.contains("transfer-encoding: chunked\r\n"),
            "{client}"
        );
        assert!(
            client.contains("date: now\r\n") && !client.contains("date: x"),
            "{client}"
        );
        let (chunked, client) = head(
            "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 5\r\n\r\n",
            false,
            false,
        );
        assert!(matches!(chunked, Ok(Parsed::Final(_))));
        assert!(!client.contains("content-length"), "{client}");
        assert!(
            client.contains("transfer-encoding: chunked\r\n"),
            "{client}"
        );
    }

    #[test]
    fn interim_partial_and_broken_heads() {
        assert_eq!(
            head(
                "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n",
                false,
                false
            )
            .0,
            Ok(Parsed::Interim { len: 25 })
        );
        assert_eq!(
            head("HTTP/1.1 200 OK\r\n", false, false).0,
            Ok(Parsed::Partial)
        );
        for bad in [
            "HTTP/1.1 101 Switching Protocols\r\n\r\n",
            "HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n",
            "HTTP/1.1 200 OK\r\ncontent-length: x\r\n\r\n",
            "HTTP/1.1 2000 OK\r\n\r\n",
            "HTTP/1.1 099 Low\r\n\r\n",
            "SPDY/3 200 OK\r\n\r\n",
        ] {
            assert_eq!(head(bad, false, false).0, Err(BadResponse), "{bad:?}");
        }
    }
}
