//! A client's request head: parsed in place, checked to be one the fast path serves,
//! and rewritten into the head sent upstream.

use std::mem::MaybeUninit;

use http::{HeaderMap, HeaderName, HeaderValue, Method};
use sluice_edge::{Refused, RequestId};
use sluice_policy::{Paths, Route};

use sluice_h1::fields::{MAX_HEADERS, is_hop_by_hop, named_in_connection};

use super::super::proxy::ForwardedPeer;
use super::Upstream;

/// What a request head is, for the fast path.
#[derive(Debug)]
pub(super) enum Parsed<'l> {
    /// The head is not complete yet.
    Partial,
    /// A head the fast path leaves to hyper: not HTTP/1.1, a request body that is not
    /// one `Content-Length` (chunked, or lengths that disagree), `Expect`, `Upgrade`,
    /// a target that is not a plain path, too many fields, or a head hyper would
    /// refuse. hyper serves the connection from there on, so every such request
    /// is answered exactly as before the fast path existed.
    Elsewhere,
    /// A head the fast path serves.
    Ready(Head<'l>),
}

/// A request head the fast path serves; its rewritten form is in the `upstream` buffer
/// [`parse`] was given.
#[derive(Debug)]
pub(super) struct Head<'l> {
    /// Bytes of the head in the buffer.
    pub(super) len: usize,
    pub(super) method: Method,
    /// The body's length (0 without `Content-Length`).
    pub(super) body_len: u64,
    /// The client asked to close the connection after this request, or it is a
    /// `CONNECT` (what follows its head may be a tunnel's bytes).
    pub(super) close: bool,
    /// The route the method and the normal form of the path match; the refusal when
    /// the head is one the service stack refuses too (see
    /// [`sluice_edge::check_head`]), the path has no normal form or its parameters change
    /// the route.
    pub(super) route: Result<Option<&'l Route>, Refused>,
    /// The request's id: the client's `X-Request-Id` when it sent one sane one,
    /// else a new one (see [`RequestId::pick`]).
    pub(super) request_id: RequestId,
    /// The path in its normal form, for an LLM route (its endpoints count their
    /// bodies each their own way); `None` on any other.
    pub(super) llm_path: Option<Box<str>>,
}

/// Phase 1's outcome for a head with this method, these `Host` field values and
/// this path (in its normal form, or why it has none): its route, or its refusal
/// in the one refusal order (see [`sluice_edge::Limiter::route_head`]).
pub(super) type Router<'a, 'l> = dyn Fn(
        &Method,
        &mut dyn Iterator<Item = &[u8]>,
        Result<&str, Refused>,
    ) -> Result<Option<&'l Route>, Refused>
    + Sync
    + 'a;

/// What [`parse`] needs besides the bytes.
pub(super) struct Context<'a, 'l> {
    pub(super) upstream: &'a Upstream,
    /// Routes requests (by the normal form of their path).
    pub(super) route: &'a Router<'a, 'l>,
    /// How paths are normalised before they are routed and forwarded.
    pub(super) paths: Paths,
    /// Headers the limiter reads (lowercase); they are copied into `identity`.
    pub(super) identity_headers: &'a [HeaderName],
    /// The socket peer, appended to `X-Forwarded-For` and `Forwarded`.
    pub(super) peer: &'a ForwardedPeer,
    /// The policy's identity when it names a counted credential: a request sending
    /// several kinds is then left to hyper, whose path strips the uncounted ones.
    pub(super) counted_credential: Option<&'a sluice_policy::Identity>,
    /// A tracer is installed (SPEC O1): the client's `traceparent` is read with the
    /// fields the limiter reads and not forwarded (the upstream is sent sluice's).
    pub(super) traced: bool,
}

/// Parses the request head at the start of `buf`. When it is [`Parsed::Ready`], the
/// head to send upstream (request line with the path in its normal form and the query
/// as it came, the client's fields but the hop-by-hop ones,
/// `Host` the upstream's, `X-Forwarded-For` and `Forwarded` with the peer appended) is
/// written to `upstream`, and the fields the limiter reads are put in `identity`.
pub(super) fn parse<'l>(
    buf: &[u8],
    cx: &Context<'_, 'l>,
    upstream: &mut Vec<u8>,
    identity: &mut HeaderMap,
) -> Parsed<'l> {
    let mut storage = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
    let head = match sluice_h1::request::parse(buf, &mut storage) {
        sluice_h1::request::Parsed::Ready(head) => head,
        sluice_h1::request::Parsed::Partial => return Parsed::Partial,
        sluice_h1::request::Parsed::Unsupported => return Parsed::Elsewhere,
    };
    let (path, query) = head.path_and_query();
    // Routed and forwarded as the upstream will read it.
    let path = cx.paths.normalize(path).map_err(Refused::from);
    let method = head.method.clone();
    let fields = head.fields;
    if let Some(identity) = cx.counted_credential
        && identity.sends_several_kinds(fields.iter().map(|f| (f.name.as_bytes(), f.value)))
    {
        return Parsed::Elsewhere;
    }

    // Refused as the service stack refuses it: the head first, then the path.
    let route = (cx.route)(&method, &mut head.hosts(), path.as_deref().map_err(|r| *r));
    // An LLM call's answer is read for its usage: sluice asks for it
    // uncompressed (`Accept-Encoding: identity`, with sluice's own fields), in
    // place of what the client accepts.
    let llm = matches!(&route, Ok(Some(r)) if r.llm.is_some());

    // Second pass: the head sent upstream.
    upstream.clear();
    upstream.extend_from_slice(method.as_str().as_bytes());
    upstream.push(b' ');
    upstream.extend_from_slice(cx.upstream.base_path().as_bytes());
    if let Ok(path) = &path {
        upstream.extend_from_slice(path.as_bytes());
        upstream.extend_from_slice(query.as_bytes());
    }
    upstream.extend_from_slice(b" HTTP/1.1\r\nhost: ");
    upstream.extend_from_slice(cx.upstream.host().as_bytes());
    upstream.extend_from_slice(b"\r\n");
    let mut forwarded_for = Vec::new();
    let mut forwarded = Vec::new();
    // The client's ids, at most two looked at (two are as bad as more).
    let mut client_ids: [Option<&[u8]>; 2] = [None, None];
    for field in fields {
        let name = field.name.as_bytes();
        // A method-override field is read with the route by the service stack,
        // and an admin login cookie is taken out of `Cookie` there.
        if is_method_override(name)
            || (name.eq_ignore_ascii_case(b"cookie")
                && sluice_edge::carries_admin_cookie(field.value))
        {
            return Parsed::Elsewhere;
        }
        // Sent upstream as the id picked, after the decision.
        if name.eq_ignore_ascii_case(b"x-request-id") {
            if let Some(slot) = client_ids.iter_mut().find(|s| s.is_none()) {
                *slot = Some(field.value);
            } else {
                client_ids[1] = Some(field.value);
            }
            continue;
        }
        if let Some(known) = cx
            .identity_headers
            .iter()
            .find(|n| n.as_str().as_bytes().eq_ignore_ascii_case(name))
            && let Ok(value) = HeaderValue::from_bytes(field.value)
        {
            identity.append(known.clone(), value);
        }
        // `X-Sluice-*` are sluice's signals to the upstream: a client's never pass,
        // nor an underscore spelling of a field sluice reads or sets.
        if name.eq_ignore_ascii_case(b"host")
            || sluice_edge::is_underscore_spelling(name, cx.identity_headers)
            || (llm && name.eq_ignore_ascii_case(b"accept-encoding"))
            || is_hop_by_hop(name)
            || sluice_edge::is_sluice_signal(name)
            || (cx.traced && name.eq_ignore_ascii_case(b"traceparent"))
        {
            continue;
        }
        // `Connection` may name any field but the one that frames the body: the body
        // forwarded is the length that field gave.
        let content_length = name.eq_ignore_ascii_case(b"content-length");
        if head.connection_names && !content_length && named_in_connection(fields, name) {
            continue;
        }
        if name.eq_ignore_ascii_case(b"x-forwarded-for") {
            push_list_element(&mut forwarded_for, field.value);
            continue;
        }
        if name.eq_ignore_ascii_case(b"forwarded") {
            push_list_element(&mut forwarded, field.value);
            continue;
        }
        upstream.extend_from_slice(name);
        upstream.extend_from_slice(b": ");
        upstream.extend_from_slice(field.value);
        upstream.extend_from_slice(b"\r\n");
    }
    upstream.extend_from_slice(b"x-forwarded-for: ");
    upstream.extend_from_slice(&forwarded_for);
    upstream.extend_from_slice(cx.peer.text());
    upstream.extend_from_slice(b"\r\nforwarded: ");
    upstream.extend_from_slice(&forwarded);
    cx.peer.push_forwarded_element(upstream, head.host);
    upstream.extend_from_slice(b"\r\n\r\n");

    let llm_path = match (&route, &path) {
        (Ok(Some(r)), Ok(path)) if r.llm.is_some() => Some(Box::from(&**path)),
        _ => None,
    };
    Parsed::Ready(Head {
        llm_path,
        len: head.len,
        route,
        request_id: RequestId::pick(client_ids.into_iter().flatten()),
        method,
        body_len: head.body_len,
        close: head.close,
    })
}

/// Sets the `Content-Length` of the request head in `head` (as [`parse`] wrote it,
/// up to and with its blank line) to `len`: the body forwarded is not the one the
/// client sent (an OpenAI stream asked for its usage). A head without the field
/// gets one.
pub(super) fn set_content_length(head: &mut Vec<u8>, len: usize) {
    let mut value = itoa::Buffer::new();
    let value = value.format(len).as_bytes();
    let name = b"content-length:";
    let mut at = 0;
    while let Some(eol) = head[at..].windows(2).position(|w| w == b"\r\n") {
        let line = at..at + eol;
        at += eol + 2;
        let Some(rest) = head.get(line.start..line.end) else {
            break;
        };
        if rest.len() >= name.len() && rest[..name.len()].eq_ignore_ascii_case(name) {
            let mut field = b"content-length: ".to_vec();
            field.extend_from_slice(value);
            head.splice(line, field);
            return;
        }
    }
    // No such field: one more before the blank line.
    let end = head.len().saturating_sub(2);
    let mut field = b"content-length: ".to_vec();
    field.extend_from_slice(value);
    field.extend_from_slice(b"\r\n");
    head.splice(end..end, field);
}

/// True for a field some frameworks run the request's method from (see
/// [`sluice_policy::METHOD_OVERRIDE_FIELDS`]).
fn is_method_override(name: &[u8]) -> bool {
    name.len() >= 13
        && name[0].eq_ignore_ascii_case(&b'x')
        && sluice_policy::METHOD_OVERRIDE_FIELDS
            .iter()
            .any(|m| name.eq_ignore_ascii_case(m.as_bytes()))
}

/// Appends one field value of a list header (`X-Forwarded-For`, `Forwarded`) and the
/// `", "` that joins it to the next; empty values are left out.
fn push_list_element(list: &mut Vec<u8>, value: &[u8]) {
    let value = value.trim_ascii();
    if !value.is_empty() {
        list.extend_from_slice(value);
        list.extend_from_slice(b", ");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::Version;
    use sluice_policy::PathError;

    /// Phase 1 with a policy of no routes: the head, then the path.
    fn no_routes(
        method: &Method,
        hosts: &mut dyn Iterator<Item = &[u8]>,
        path: Result<&str, Refused>,
    ) -> Result<Option<&'static Route>, Refused> {
        sluice_edge::check_head(method, Version::HTTP_11, hosts)?;
        path.map(|_| None)
    }

    fn upstream() -> Upstream {
        Upstream::parse("http://10.0.0.9:3000/api").expect("upstream")
    }

    /// What [`parse`] made of a head, owned.
    #[derive(Debug, PartialEq, Eq)]
    enum Seen {
        Partial,
        Elsewhere,
        /// Head length, body length, close.
        Ready(usize, u64, bool),
    }

    /// Parses `head` from 192.0.2.1: what it is, the upstream head, the identity fields.
    fn parse_one(head: &str) -> (Seen, String, HeaderMap) {
        let up = upstream();
        let route = no_routes;
        let names = [
            HeaderName::from_static("x-api-key"),
            HeaderName::from_static("x-forwarded-for"),
        ];
        let cx = Context {
            upstream: &up,
            route: &route,
            identity_headers: &names,
            paths: Paths::default(),
            peer: &ForwardedPeer::new("192.0.2.1".parse().expect("ip")),
            counted_credential: None,
            traced: false,
        };
        let mut out = Vec::new();
        let mut identity = HeaderMap::new();
        let seen = match parse(head.as_bytes(), &cx, &mut out, &mut identity) {
            Parsed::Ready(h) => Seen::Ready(h.len, h.body_len, h.close),
            Parsed::Partial => Seen::Partial,
            Parsed::Elsewhere => Seen::Elsewhere,
        };
        (seen, String::from_utf8(out).expect("ascii"), identity)
    }

    #[test]
    fn the_upstream_head_drops_hop_by_hop_fields_and_appends_the_peer() {
        let head = "POST /v1/things?x=1 HTTP/1.1\r\nHost: api.example\r\nConnection: keep-alive, X-Secret\r\n\
                    X-Secret: s\r\nKeep-Alive: timeout=5\r\nProxy-Authorization: Basic x\r\nTE: trailers\r\n\
                    X-Forwarded-For: 203.0.113.7\r\nx-forwarded-for: 198.51.100.2\r\nForwarded: for=1.2.3.4\r\n\
                    X-Api-Key: k1\r\nContent-Length: 2\r\nX-Kept: yes\r\n\r\n{}";
        let (seen, out, identity) = parse_one(head);
        assert_eq!(seen, Seen::Ready(head.len() - 2, 2, false));
        assert_eq!(
            out,
            "POST /api/v1/things?x=1 HTTP/1.1\r\nhost: 10.0.0.9:3000\r\n\
             X-Api-Key: k1\r\nContent-Length: 2\r\nX-Kept: yes\r\n\
             x-forwarded-for: 203.0.113.7, 198.51.100.2, 192.0.2.1\r\n\
             forwarded: for=1.2.3.4, for=192.0.2.1;host=\"api.example\";proto=http\r\n\r\n"
        );
        assert_eq!(identity["x-api-key"], "k1");
        assert_eq!(identity.get_all("x-forwarded-for").iter().count(), 2);
    }

    #[test]
    fn e6_the_upstream_head_has_the_normal_path_under_the_prefix_and_the_query_as_sent() {
        let head = "GET //v1/./x/../%74hings?next=/../%2e HTTP/1.1\r\nhost: h\r\n\r\n";
        let (seen, out, _) = parse_one(head);
        assert_eq!(seen, Seen::Ready(head.len(), 0, false));
        assert!(
            out.starts_with("GET /api/v1/things?next=/../%2e HTTP/1.1\r\nhost: 10.0.0.9:3000\r\n"),
            "{out}"
        );
    }

    #[test]
    fn e6_a_path_without_a_normal_form_is_ready_to_be_refused() {
        let up = upstream();
        let route = no_routes;
        let cx = Context {
            upstream: &up,
            route: &route,
            identity_headers: &[],
            paths: Paths::default(),
            peer: &ForwardedPeer::new("192.0.2.1".parse().expect("ip")),
            counted_credential: None,
            traced: false,
        };
        for (target, error) in [
            ("/../etc", PathError::AboveRoot),
            ("/a/%2e%2e/../etc", PathError::AboveRoot),
            ("/a%g1", PathError::BadPercentEncoding),
            ("/oauth\\register", PathError::Backslash),
        ] {
            let head = format!("GET {target} HTTP/1.1\r\nhost: h\r\n\r\n");
            let mut out = Vec::new();
            match parse(head.as_bytes(), &cx, &mut out, &mut HeaderMap::new()) {
                Parsed::Ready(head) => {
                    assert_eq!(head.route.err(), Some(Refused::Path(error)), "{target}");
                }
                other => panic!("{target}: {other:?}"),
            }
        }
    }

    #[test]
    fn connection_cannot_unframe_a_body_but_drops_a_forwarding_chain() {
        let head = "POST /a HTTP/1.1\r\nhost: x\r\nconnection: content-length, x-forwarded-for\r\n\
                    x-forwarded-for: 203.0.113.9\r\ncontent-length: 34\r\n\r\n";
        let (seen, out, _) = parse_one(head);
        assert_eq!(seen, Seen::Ready(head.len(), 34, false));
        assert!(out.contains("\r\ncontent-length: 34\r\n"), "{out}");
        assert!(out.contains("\r\nx-forwarded-for: 192.0.2.1\r\n"), "{out}");
    }

    #[test]
    fn unusual_heads_are_left_to_hyper_and_partial_ones_wait() {
        for head in [
            "GET / HTTP/1.0\r\n\r\n",
            "POST / HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n",
            "POST / HTTP/1.1\r\ncontent-length: 1\r\ncontent-length: 1\r\n\r\n",
            "POST / HTTP/1.1\r\ncontent-length: +1\r\n\r\n",
            "POST / HTTP/1.1\r\nexpect: 100-continue\r\ncontent-length: 1\r\n\r\n",
            "GET / HTTP/1.1\r\nupgrade: websocket\r\n\r\n",
            "GET http://x/ HTTP/1.1\r\n\r\n",
            "GET / HTTP/1.1\r\nbad header\r\n\r\n",
            "GET /s?q=\"x\" HTTP/1.1\r\n\r\n",
            "GET /a<b HTTP/1.1\r\n\r\n",
        ] {
            assert_eq!(parse_one(head).0, Seen::Elsewhere, "{head:?}");
        }
        assert_eq!(parse_one("GET / HTTP/1.1\r\nhost: a\r\n").0, Seen::Partial);
        let close = "GET / HTTP/1.1\r\nconnection: Close\r\n\r\n";
        assert_eq!(parse_one(close).0, Seen::Ready(close.len(), 0, true));
    }

    /// RFC 9112 §3.2 and `CONNECT`: answered by the fast path (after the body, as the
    /// service stack answers), with the same refusal; a `CONNECT` closes the connection.
    #[test]
    fn heads_rfc_9112_refuses_and_connect_are_ready_to_be_refused() {
        let up = upstream();
        let route = no_routes;
        let cx = Context {
            upstream: &up,
            route: &route,
            identity_headers: &[],
            paths: Paths::default(),
            peer: &ForwardedPeer::new("192.0.2.1".parse().expect("ip")),
            counted_credential: None,
            traced: false,
        };
        for (head, refused, close) in [
            ("GET / HTTP/1.1\r\n\r\n", Refused::NoHost, false),
            ("GET /../x HTTP/1.1\r\n\r\n", Refused::NoHost, false),
            (
                "POST / HTTP/1.1\r\nhost: a\r\nHost: a\r\ncontent-length: 2\r\n\r\n",
                Refused::Hosts(2),
                false,
            ),
            (
                "GET / HTTP/1.1\r\nhost: u@a\r\n\r\n",
                Refused::BadHost,
                false,
            ),
            (
                "GET / HTTP/1.1\r\nhost: a b\r\n\r\n",
                Refused::BadHost,
                false,
            ),
            (
                "CONNECT x:1 HTTP/1.1\r\nhost: x:1\r\n\r\n",
                Refused::Connect,
                true,
            ),
            ("CONNECT /a HTTP/1.1\r\n\r\n", Refused::Connect, true),
        ] {
            let mut out = Vec::new();
            match parse(head.as_bytes(), &cx, &mut out, &mut HeaderMap::new()) {
                Parsed::Ready(ready) => {
                    assert_eq!(ready.route.err(), Some(refused), "{head:?}");
                    assert_eq!(ready.close, close, "{head:?}");
                }
                other => panic!("{head:?}: {other:?}"),
            }
        }
        for fine in [
            "GET / HTTP/1.1\r\nhost:\r\n\r\n",
            "GET / HTTP/1.1\r\nhost: [::1]:80\r\n\r\n",
        ] {
            match parse(fine.as_bytes(), &cx, &mut Vec::new(), &mut HeaderMap::new()) {
                Parsed::Ready(ready) => assert_eq!(ready.route.err(), None, "{fine:?}"),
                other => panic!("{fine:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn t3_a_changed_body_gets_its_own_length() {
        let mut head = b"POST /v1/chat HTTP/1.1\r\nhost: up\r\nContent-Length: 12\r\nx-a: content-length: 1\r\n\r\n".to_vec();
        set_content_length(&mut head, 345);
        assert_eq!(
            String::from_utf8_lossy(&head),
            "POST /v1/chat HTTP/1.1\r\nhost: up\r\ncontent-length: 345\r\nx-a: content-length: 1\r\n\r\n"
        );
        let mut bare = b"POST / HTTP/1.1\r\nhost: up\r\n\r\n".to_vec();
        set_content_length(&mut bare, 7);
        assert_eq!(
            String::from_utf8_lossy(&bare),
            "POST / HTTP/1.1\r\nhost: up\r\ncontent-length: 7\r\n\r\n"
        );
    }
}
