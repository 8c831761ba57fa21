//! A client's request head, parsed in place and checked to be one a proxy can serve
//! by its framing alone: HTTP/1.1, a body of one `Content-Length` (or none), no
//! `Transfer-Encoding`, `Upgrade` or `Expect`, an origin-form target (or `CONNECT`).

use std::mem::MaybeUninit;

use http::Method;

use crate::fields::{for_each_connection_named, parse_length};

pub use crate::fields::MAX_HEADERS;

/// What a request head is.
#[derive(Debug)]
pub enum Parsed<'h, 'b> {
    /// The head is not complete yet.
    Partial,
    /// A head this parser leaves to a full HTTP implementation: not HTTP/1.1, a body
    /// that is not one `Content-Length` (chunked, or lengths that disagree),
    /// `Expect`, `Upgrade`, a target that is not a plain path, more than
    /// [`MAX_HEADERS`] fields, or bytes that are no request head.
    Unsupported,
    /// A head whose framing is known.
    Ready(Head<'h, 'b>),
}

/// A request head with known framing.
#[derive(Debug)]
pub struct Head<'h, 'b> {
    /// Bytes of the head in the buffer.
    pub len: usize,
    /// The request method.
    pub method: Method,
    /// The target as sent: an origin-form path with its query, or `CONNECT`'s
    /// authority.
    pub target: &'b str,
    /// The header fields, in order.
    pub fields: &'h [httparse::Header<'b>],
    /// The body's length (0 without `Content-Length`).
    pub body_len: u64,
    /// The client asked to close the connection after this request, or it is a
    /// `CONNECT` (what follows its head may be a tunnel's bytes).
    pub close: bool,
    /// A `Connection` field names header fields (beyond `close` and `keep-alive`).
    pub connection_names: bool,
    /// The first `Host` value.
    pub host: Option<&'b [u8]>,
}

impl<'b> Head<'_, 'b> {
    /// Every `Host` value, in order (RFC 9112 §3.2 wants exactly one).
    pub fn hosts(&self) -> impl Iterator<Item = &'b [u8]> + '_ {
        self.fields
            .iter()
            .filter(|f| f.name.eq_ignore_ascii_case("host"))
            .map(|f| f.value)
    }

    /// The target's path and its query (from the `?` on, or empty).
    pub fn path_and_query(&self) -> (&'b str, &'b str) {
        let target = self.target;
        target.split_at(
            target
                .bytes()
                .position(|b| b == b'?')
                .unwrap_or(target.len()),
        )
    }
}

/// Parses the request head at the start of `buf`, its fields into `storage`.
pub fn parse<'h, 'b>(
    buf: &'b [u8],
    storage: &'h mut [MaybeUninit<httparse::Header<'b>>; MAX_HEADERS],
) -> Parsed<'h, 'b> {
    let mut request = httparse::Request::new(&mut []);
    let len = match request.parse_with_uninit_headers(buf, storage) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) => return Parsed::Partial,
        Err(_) => return Parsed::Unsupported,
    };
    let (Some(method), Some(target), Some(1)) = (request.method, request.path, request.version)
    else {
        return Parsed::Unsupported;
    };
    let Ok(method) = Method::from_bytes(method.as_bytes()) else {
        return Parsed::Unsupported;
    };
    // `CONNECT`'s authority-form target is never a path; otherwise only an
    // origin-form target that `http` accepts as it is.
    let connect = method == Method::CONNECT;
    if !connect && !crate::target::accepted(target) {
        return Parsed::Unsupported;
    }

    let mut body_len = None;
    let mut close = false;
    let mut host: Option<&[u8]> = None;
    let mut connection_names = false;
    for field in request.headers.iter() {
        let name = field.name.as_bytes();
        if name.eq_ignore_ascii_case(b"content-length") {
            match (body_len, parse_length(field.value)) {
                (None, Some(n)) => body_len = Some(n),
                _ => return Parsed::Unsupported,
            }
        } else if name.eq_ignore_ascii_case(b"connection") {
            for token in field.value.split(|&b| b == b',') {
                if token.trim_ascii().eq_ignore_ascii_case(b"close") {
                    close = true;
                }
            }
            for_each_connection_named(field.value, |_| connection_names = true);
        } else if name.eq_ignore_ascii_case(b"host") {
            host = host.or(Some(field.value));
        } else if name.eq_ignore_ascii_case(b"transfer-encoding")
            || name.eq_ignore_ascii_case(b"upgrade")
            || name.eq_ignore_ascii_case(b"expect")
        {
            return Parsed::Unsupported;
        }
    }
    Parsed::Ready(Head {
        len,
        method,
        target,
        fields: request.headers,
        body_len: body_len.unwrap_or(0),
        close: close || connect,
        connection_names,
        host,
    })
}
