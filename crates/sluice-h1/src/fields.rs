//! Field rules every HTTP/1.1 intermediary applies: which fields are hop-by-hop
//! (RFC 9110 §7.6.1), what `Connection` names, and what a `Content-Length` value is.
//! One copy for every request path of sluice and for its client.

use http::{HeaderMap, HeaderName, header};

/// Most header fields in a message head, as hyper's server allows.
pub const MAX_HEADERS: usize = 100;

/// True for a header that describes one connection, not the message, and so is never
/// forwarded: `Connection`, `Keep-Alive`, `TE`, `Trailer`, `Transfer-Encoding`,
/// `Upgrade` and every `Proxy-*` (`name` in any case).
pub fn is_hop_by_hop(name: &[u8]) -> bool {
    const FIXED: [&[u8]; 6] = [
        b"connection",
        b"keep-alive",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    ];
    FIXED.iter().any(|f| f.eq_ignore_ascii_case(name))
        || name
            .get(..6)
            .is_some_and(|p| p.eq_ignore_ascii_case(b"proxy-"))
}

/// Calls `named` with each header name a `Connection` value lists beyond the
/// connection options `keep-alive` and `close` (which every keep-alive message
/// carries and which name no header).
pub fn for_each_connection_named(value: &[u8], mut named: impl FnMut(&[u8])) {
    for token in value.split(|&b| b == b',').map(<[u8]>::trim_ascii) {
        if token.is_empty()
            || token.eq_ignore_ascii_case(b"keep-alive")
            || token.eq_ignore_ascii_case(b"close")
        {
            continue;
        }
        named(token);
    }
}

/// Removes hop-by-hop headers: those [`is_hop_by_hop`] names and every header named
/// in `Connection`.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // One pass over the names finds what goes; most messages carry only `Connection`
    // (or nothing) of it, so the common case is one removal and no allocation.
    let mut doomed: Vec<HeaderName> = Vec::new();
    for name in headers.keys() {
        if is_hop_by_hop(name.as_str().as_bytes()) {
            doomed.push(name.clone());
        }
    }
    if doomed.is_empty() {
        return;
    }
    for value in headers.get_all(header::CONNECTION) {
        for_each_connection_named(value.as_bytes(), |token| {
            if let Ok(name) = HeaderName::from_bytes(token) {
                doomed.push(name);
            }
        });
    }
    for name in doomed {
        headers.remove(name);
    }
}

/// True when a `Connection` field among `fields` (a request's or a response's) names
/// the header `name`.
pub fn named_in_connection(fields: &[httparse::Header<'_>], name: &[u8]) -> bool {
    let mut named = false;
    for field in fields {
        if field.name.eq_ignore_ascii_case("connection") {
            for_each_connection_named(field.value, |token| {
                named |= token.eq_ignore_ascii_case(name);
            });
        }
    }
    named
}

/// A `Content-Length` value: decimal digits only, as hyper accepts it (no list of
/// equal values, no sign, no spaces inside).
pub fn parse_length(value: &[u8]) -> Option<u64> {
    let digits = value.trim_ascii();
    if digits.is_empty() || digits.len() > 19 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    digits.iter().try_fold(0u64, |n, &d| {
        n.checked_mul(10)?.checked_add(u64::from(d - b'0'))
    })
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    #[test]
    fn content_lengths_are_plain_decimal() {
        assert_eq!(parse_length(b"0"), Some(0));
        assert_eq!(parse_length(b" 42 "), Some(42));
        assert_eq!(parse_length(b"18446744073709551615"), None);
        assert_eq!(
            parse_length(b"9999999999999999999"),
            Some(9_999_999_999_999_999_999)
        );
        for bad in [&b""[..], b"-1", b"1,1", b"0x1", b"1 1"] {
            assert_eq!(parse_length(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn hop_by_hop_headers_and_the_ones_connection_names_are_dropped() {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::CONNECTION,
            HeaderValue::from_static("close, x-secret"),
        );
        headers.insert("x-secret", HeaderValue::from_static("1"));
        headers.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        headers.insert("proxy-authorization", HeaderValue::from_static("Basic x"));
        headers.insert(header::TE, HeaderValue::from_static("trailers"));
        headers.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        headers.insert("x-kept", HeaderValue::from_static("yes"));
        strip_hop_by_hop(&mut headers);
        assert_eq!(headers.len(), 1, "{headers:?}");
        assert_eq!(headers["x-kept"], "yes");

        // Only a Proxy-* header: still found.
        headers.insert("proxy-connection", HeaderValue::from_static("keep-alive"));
        strip_hop_by_hop(&mut headers);
        assert_eq!(headers.len(), 1, "{headers:?}");
    }
}
