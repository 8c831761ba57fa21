//! Head checks: what is refused before anything of a request but its head is read.

use http::{HeaderMap, Method, Uri, Version};
use sluice_policy::{AmbiguousCredentials, PathError, Unclassifiable};

/// A request the limiter refuses before anything is decided: sluice cannot count it
/// as the upstream would read it, so it neither counts nor forwards it (nothing is
/// spent, as for a malformed request). [`Refused::response`] is the answer, the same
/// on every request path.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Refused {
    /// The path has no normal form: it cannot be matched as the upstream reads it.
    #[error(transparent)]
    Path(#[from] PathError),
    /// The normal form of the request target is not a target `http` accepts.
    #[error("the normalised request target is not a valid request target")]
    Target,
    /// The body of a JSON-RPC route cannot be classified.
    #[error(transparent)]
    Body(#[from] Unclassifiable),
    /// One kind of credential sent more than once.
    #[error(transparent)]
    Credentials(#[from] AmbiguousCredentials),
    /// A credential revoked through the admin API.
    #[error("the credential was revoked")]
    Revoked,
    /// A trusted auth layer named a plan the policy does not have.
    #[error("the plan the auth layer named is not a plan of the policy")]
    UnknownPlan,
    /// An HTTP/1.1 request without a `Host` field (RFC 9112 §3.2).
    #[error("an HTTP/1.1 request must have a Host field")]
    NoHost,
    /// A request with several `Host` fields (RFC 9112 §3.2).
    #[error("{0} Host fields")]
    Hosts(usize),
    /// A `Host` field that is not `host[:port]` (RFC 9112 §3.2).
    #[error("the Host field is not host[:port]")]
    BadHost,
    /// A batch submit whose body cannot be queued.
    #[error(transparent)]
    Batch(#[from] crate::BadBatch),
    /// The body of an LLM route does not read as its wire format says (SPEC T2):
    /// its tokens cannot be counted.
    #[error(transparent)]
    LlmBody(#[from] sluice_tokens::BadLlmBody),
    /// A call on a route with a money budget whose model has no price in the
    /// policy's `prices:` (SPEC T4): it cannot be counted.
    #[error("the model has no price in the policy's `prices`")]
    UnpricedModel,
    /// A call's run cannot be counted (SPEC T7).
    #[error(transparent)]
    Run(#[from] crate::BadRun),
    /// A `Transfer-Encoding` that is not `chunked` alone (a coding before it, such
    /// as `gzip, chunked`): sluice would pass the body on mislabelled, and RFC 9112
    /// §6.1 answers a coding the server does not understand with 501.
    #[error("the only transfer coding served is chunked")]
    TransferCoding,
    /// `CONNECT`: sluice is not a tunnel (a reverse proxy has nothing to connect to).
    #[error("CONNECT is not served: this is a gateway, not a tunnel")]
    Connect,
    /// A request (a JSON-RPC batch) holding more calls through a guarded lane than
    /// a workspace may run at once: it can never be admitted whole (send the calls
    /// apart, or through the batch lane).
    #[error(
        "the request holds {calls} calls through a guarded lane; a workspace runs at most {max} at once"
    )]
    LaneCalls {
        /// The calls through the lane the request holds.
        calls: u32,
        /// Calls a workspace may run at once.
        max: u32,
    },
}

/// Checks a request head before anything else is read of it: the method is not
/// `CONNECT`, and the `Host` fields (`hosts`: their values, in order) are as RFC
/// 9112 §3.2 asks — one, or none before HTTP/1.1 and in HTTP/2 (which has
/// `:authority`), and a value that is empty or `host[:port]`. Both HTTP/1.1
/// request paths call it, so both answer alike.
///
/// # Errors
/// [`Refused::Connect`], [`Refused::NoHost`], [`Refused::Hosts`] or
/// [`Refused::BadHost`].
pub fn check_head<'h>(
    method: &Method,
    version: Version,
    hosts: impl IntoIterator<Item = &'h [u8]>,
) -> Result<(), Refused> {
    if method == Method::CONNECT {
        return Err(Refused::Connect);
    }
    let mut hosts = hosts.into_iter();
    let Some(host) = hosts.next() else {
        return if version == Version::HTTP_11 {
            Err(Refused::NoHost)
        } else {
            Ok(())
        };
    };
    let more = hosts.count();
    if more > 0 {
        return Err(Refused::Hosts(more + 1));
    }
    let host = host.trim_ascii();
    if !host.is_empty() && !host_is_valid(host) {
        return Err(Refused::BadHost);
    }
    Ok(())
}

/// True when `host` (not empty) is `uri-host [":" port]`: an authority without
/// userinfo, as `http` reads one. `http` copies the bytes before it checks them;
/// a keep-alive connection sends the same `Host` with every request, so the last
/// host this thread found valid is kept and a repeat is known at once.
pub(super) fn host_is_valid(host: &[u8]) -> bool {
    /// The longest host kept (longer ones are checked each time).
    const KEPT: usize = 64;
    thread_local! {
        static LAST_VALID: std::cell::RefCell<arrayvec::ArrayVec<u8, KEPT>> =
            const { std::cell::RefCell::new(arrayvec::ArrayVec::new_const()) };
    }
    if LAST_VALID.with_borrow(|last| !last.is_empty() && last.as_slice() == host) {
        return true;
    }
    let valid = !host.contains(&b'@') && http::uri::Authority::try_from(host).is_ok();
    if valid && host.len() <= KEPT {
        LAST_VALID.with_borrow_mut(|last| {
            last.clear();
            let _ = last.try_extend_from_slice(host);
        });
    }
    valid
}

/// The bound on a request head of every HTTP/1.1 listener (the gateway's, the
/// forward-auth check listener's): 64 KiB, as [`request_head_len`] counts it.
pub const MAX_REQUEST_HEAD_BYTES: usize = 64 * 1024;

/// The bytes of an HTTP/1.1 request head as parsed: the request line
/// (`method SP target SP HTTP/1.1 CRLF`), each field as `name: value CRLF`, and
/// the empty line that ends the head. A head sent that way (one space after each
/// colon, none after a value) is exactly this long; whitespace around values is
/// not counted, as a parser drops it.
pub fn request_head_len(method: &Method, target: &Uri, fields: &HeaderMap) -> usize {
    // The target as received: origin-form (`/path?query`), absolute-form
    // (`scheme://authority/path?query`), authority-form or `*`.
    let scheme = target.scheme_str().map_or(0, |s| s.len() + "://".len());
    let authority = target.authority().map_or(0, |a| a.as_str().len());
    let path = target.path_and_query().map_or(0, |p| p.as_str().len());
    let line = method.as_str().len() + 1 + scheme + authority + path + " HTTP/1.1\r\n".len();
    let fields: usize = fields
        .iter()
        .map(|(name, value)| name.as_str().len() + ": ".len() + value.len() + "\r\n".len())
        .sum();
    line + fields + "\r\n".len()
}

/// Checks a request's `Transfer-Encoding` fields (`values`, in order): none, or
/// codings that are `chunked` and nothing else — one coding, in any case, with
/// whitespace around it. A coding before `chunked` (`gzip, chunked`) would reach
/// the upstream unnamed once the body is re-framed, so it is refused (RFC 9112
/// §6.1: 501 for a transfer coding the server does not understand), and so is
/// `chunked` twice.
///
/// # Errors
/// [`Refused::TransferCoding`].
pub fn check_transfer_coding<'h>(
    values: impl IntoIterator<Item = &'h [u8]>,
) -> Result<(), Refused> {
    let mut chunked = 0usize;
    for value in values {
        for coding in value.split(|&b| b == b',') {
            if !coding.trim_ascii().eq_ignore_ascii_case(b"chunked") {
                return Err(Refused::TransferCoding);
            }
            chunked += 1;
        }
    }
    if chunked > 1 {
        return Err(Refused::TransferCoding);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_chunked_alone_is_a_transfer_coding_served() {
        let check = |values: &[&str]| check_transfer_coding(values.iter().map(|v| v.as_bytes()));
        assert_eq!(check(&[]), Ok(()));
        assert_eq!(check(&["chunked"]), Ok(()));
        assert_eq!(check(&[" Chunked\t"]), Ok(()));
        for refused in [
            &["gzip, chunked"][..],
            &["gzip", "chunked"],
            &["chunked, chunked"],
            &["chunked", "chunked"],
            &["chunked,"],
            &["identity"],
            &[""],
            &["chunked;q=1"],
        ] {
            assert_eq!(check(refused), Err(Refused::TransferCoding), "{refused:?}");
        }
    }

    #[test]
    fn a_head_is_counted_as_written() {
        let head = "POST /chats?x=1 HTTP/1.1\r\nhost: a\r\nx-pad: bbb\r\n\r\n";
        let mut fields = HeaderMap::new();
        fields.insert("host", "a".parse().expect("value"));
        fields.insert("x-pad", "bbb".parse().expect("value"));
        let target: Uri = "/chats?x=1".parse().expect("target");
        assert_eq!(
            request_head_len(&Method::POST, &target, &fields),
            head.len()
        );
        let absolute: Uri = "http://a/b".parse().expect("target");
        assert_eq!(
            request_head_len(&Method::GET, &absolute, &HeaderMap::new()),
            "GET http://a/b HTTP/1.1\r\n\r\n".len()
        );
    }
}
