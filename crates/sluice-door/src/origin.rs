//! Whether a request comes from the listener's own origin, and whether a state change
//! is sent as JSON.
//!
//! Browsers attach `Origin` to every request that is not a plain GET/HEAD (forms and
//! `fetch` in `no-cors` mode included) and `Sec-Fetch-Site` to every request;
//! tools such as curl send neither. So a request that names another origin in either
//! field came from a page, and a state change from a page of another origin is
//! refused. A page may send `text/plain`, form and multipart bodies across origins
//! without asking first; `application/json` needs a preflight, which sluice never
//! grants: so a state change with a body must be JSON.

use http::HeaderMap;
use http::header::{CONTENT_LENGTH, CONTENT_TYPE, ORIGIN, TRANSFER_ENCODING};

use crate::host::split_authority;

/// `Sec-Fetch-Site`: where the browser says the request comes from.
pub const SEC_FETCH_SITE: &str = "sec-fetch-site";

/// The origin a request names, when it is not the one it is sent to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ForeignOrigin(pub String);

/// Checks `Origin` and `Sec-Fetch-Site` against `host` (the request's `Host`, already
/// allowed by the listener's [`HostRule`](crate::HostRule)).
///
/// # Errors
/// [`ForeignOrigin`] naming what the request said, when `Origin` is present and is
/// not `http(s)://<host>` (`null` included), or when `Sec-Fetch-Site` is present and
/// is neither `same-origin` nor `none` (a user typing the address).
pub fn same_origin(headers: &HeaderMap, host: &str) -> Result<(), ForeignOrigin> {
    if let Some(site) = headers.get(SEC_FETCH_SITE) {
        let site = site.to_str().unwrap_or("");
        if !site.eq_ignore_ascii_case("same-origin") && !site.eq_ignore_ascii_case("none") {
            return Err(ForeignOrigin(format!("Sec-Fetch-Site: {site}")));
        }
    }
    let mut origins = headers.get_all(ORIGIN).iter();
    let Some(origin) = origins.next() else {
        return Ok(());
    };
    let text = origin.to_str().unwrap_or("");
    if origins.next().is_some() || !origin_is_host(text, host) {
        return Err(ForeignOrigin(format!("Origin: {text}")));
    }
    Ok(())
}

/// Whether `origin` (`scheme://host[:port]`) is the origin of a request sent to `host`.
fn origin_is_host(origin: &str, host: &str) -> bool {
    let Some((scheme, authority)) = origin.split_once("://") else {
        return false;
    };
    let default_port = match scheme.to_ascii_lowercase().as_str() {
        "http" => 80,
        "https" => 443,
        _ => return false,
    };
    let (Some((oh, op)), Some((hh, hp))) = (split_authority(authority), split_authority(host))
    else {
        return false;
    };
    oh.eq_ignore_ascii_case(hh) && op.unwrap_or(default_port) == hp.unwrap_or(default_port)
}

/// Whether `origin` is one of `allowed` (exact origins such as
/// `http://localhost:3000`, compared without case; a trailing `/` ignored).
pub fn origin_listed(origin: &str, allowed: &[String]) -> bool {
    let origin = origin.trim_end_matches('/');
    allowed
        .iter()
        .any(|a| a.trim_end_matches('/').eq_ignore_ascii_case(origin))
}

/// Whether a state change is sent as JSON: with a body, `Content-Type` must be
/// `application/json` (parameters such as `charset` allowed); with none, it may also
/// be absent (`curl -X POST URL`).
pub fn json_or_empty(headers: &HeaderMap) -> bool {
    let mut types = headers.get_all(CONTENT_TYPE).iter();
    let content_type = types.next();
    if types.next().is_some() {
        return false;
    }
    match content_type {
        Some(v) => v
            .to_str()
            .ok()
            .and_then(|t| t.split(';').next())
            .is_some_and(|t| t.trim().eq_ignore_ascii_case("application/json")),
        None => {
            let no_length = headers
                .get(CONTENT_LENGTH)
                .is_none_or(|v| v.as_bytes() == b"0");
            no_length && !headers.contains_key(TRANSFER_ENCODING)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_headers as headers;

    #[test]
    fn s2_only_the_listeners_own_origin_may_change_state() {
        let host = "127.0.0.1:9090";
        assert!(same_origin(&headers(&[]), host).is_ok());
        assert!(same_origin(&headers(&[("origin", "http://127.0.0.1:9090")]), host).is_ok());
        assert!(same_origin(&headers(&[("sec-fetch-site", "same-origin")]), host).is_ok());
        assert!(same_origin(&headers(&[("sec-fetch-site", "none")]), host).is_ok());
        for foreign in [
            &[("origin", "http://evil.example")][..],
            &[("origin", "null")],
            &[("origin", "http://127.0.0.1:8000")],
            &[("origin", "http://127.0.0.2:9090")],
            &[("origin", "file://")],
            &[
                ("origin", "http://127.0.0.1:9090"),
                ("origin", "http://evil.example"),
            ],
            &[("sec-fetch-site", "same-site")],
            &[("sec-fetch-site", "cross-site")],
            &[
                ("origin", "http://127.0.0.1:9090"),
                ("sec-fetch-site", "cross-site"),
            ],
        ] {
            assert!(same_origin(&headers(foreign), host).is_err(), "{foreign:?}");
        }
        assert!(
            same_origin(
                &headers(&[("origin", "https://admin.example")]),
                "admin.example"
            )
            .is_ok()
        );
        assert!(
            same_origin(
                &headers(&[("origin", "http://admin.example")]),
                "admin.example:443"
            )
            .is_err()
        );
    }

    #[test]
    fn s2_a_state_change_is_json_or_has_no_body() {
        assert!(json_or_empty(&headers(&[])));
        assert!(json_or_empty(&headers(&[("content-length", "0")])));
        assert!(json_or_empty(&headers(&[
            ("content-type", "application/json; charset=utf-8"),
            ("content-length", "2")
        ])));
        for bad in [
            &[("content-type", "text/plain"), ("content-length", "9")][..],
            &[("content-type", "application/x-www-form-urlencoded")],
            &[("content-type", "multipart/form-data; boundary=x")],
            &[("content-length", "9")],
            &[("transfer-encoding", "chunked")],
            &[
                ("content-type", "application/json"),
                ("content-type", "text/plain"),
            ],
            &[("content-type", "application/jsonx")],
        ] {
            assert!(!json_or_empty(&headers(bad)), "{bad:?}");
        }
    }

    #[test]
    fn s4_listed_origins_match_exactly() {
        let allowed = vec!["http://localhost:3000/".to_owned()];
        assert!(origin_listed("http://localhost:3000", &allowed));
        assert!(origin_listed("HTTP://LOCALHOST:3000", &allowed));
        assert!(!origin_listed("http://localhost:3001", &allowed));
        assert!(!origin_listed("null", &allowed));
    }
}
