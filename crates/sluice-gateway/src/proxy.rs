//! The reverse proxy: a tower [`Service`] that forwards each request to the upstream.
//!
//! - keep-alive connections to the upstream from a per-worker `UpstreamPool`;
//! - hop-by-hop headers dropped both ways (`Connection` and every header it names,
//!   `Keep-Alive`, `Proxy-*`, `TE`, `Trailer`, `Transfer-Encoding`, `Upgrade`);
//! - `X-Forwarded-For` and `Forwarded` get the socket peer appended (from the
//!   [`PeerAddr`] extension); `Host` becomes the upstream's;
//! - bodies are streamed both ways, frame by frame, never buffered; an upstream that
//!   refuses before it has the whole request body closes the client's connection
//!   after its answer (which ends the upload);
//! - an upstream that cannot be reached answers 502 `bad_gateway`, one that sends no
//!   response headers within the configured time 504 `gateway_timeout`, both as the JSON
//!   envelope `{"error":{"code","message","details"}}`; an exchange that failed because
//!   the client's body did (it left, or stopped sending) is a 400 `invalid_request`.
//!
//! The service takes `Request<B>` for any streaming body `B` and never fails: every
//! error becomes a response here, in one place.

use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::uri::{Authority, PathAndQuery, Scheme, Uri};
use http::{Request, Response, StatusCode, Version};
use http_body_util::BodyExt as _;
use http_body_util::combinators::BoxBody;
use tower::Service;

use sluice_h1::fields::strip_hop_by_hop;

use rustls::pki_types::ServerName;

use super::PeerAddr;
use super::pool::{Connections, SendError, UpstreamPool};
use super::tls::UpstreamTls;
use super::upload::{AbandonAfter, Upload};

pub(crate) use super::boxed::BoxError;

/// The body of every response the proxy produces: the upstream's body streamed through,
/// or a small JSON envelope.
pub(crate) type ProxyBody = BoxBody<Bytes, BoxError>;

/// Where requests are forwarded: `http[s]://authority[/base-path]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Upstream {
    authority: Authority,
    /// Empty, or starts with `/` and does not end with `/`.
    base_path: String,
    host: HeaderValue,
    /// For an https upstream, the name its certificate must have (SNI too).
    tls_name: Option<ServerName<'static>>,
    /// For an https upstream, the roots to verify it with; `None` until given
    /// ([`Upstream::with_tls`]) or, at start, the system's.
    tls: Option<UpstreamTls>,
}

impl Upstream {
    /// Parses `http://HOST[:PORT][/PREFIX]` or `https://HOST[:PORT][/PREFIX]` (port 80
    /// or 443 when none is named). A request for `/a?b` goes to
    /// `http[s]://HOST:PORT/PREFIX/a?b`. An https upstream's certificate is verified
    /// against the roots given with [`Upstream::with_tls`], or else the system's.
    ///
    /// # Errors
    /// A message saying what was expected: an absolute `http://` or `https://` URL
    /// with a host, no query, no credentials.
    pub fn parse(url: &str) -> Result<Self, String> {
        let uri: Uri = url
            .parse()
            .map_err(|e| format!("expected a URL such as http://127.0.0.1:3000 ({e})"))?;
        let https = match uri.scheme() {
            Some(s) if *s == Scheme::HTTP => false,
            Some(s) if *s == Scheme::HTTPS => true,
            _ => {
                return Err(
                    "expected an http:// or https:// URL such as http://127.0.0.1:3000".into(),
                );
            }
        };
        let authority = uri
            .authority()
            .cloned()
            .ok_or_else(|| "expected a host, as in http://127.0.0.1:3000".to_owned())?;
        if authority.as_str().contains('@') {
            return Err("credentials in the upstream URL are not supported".into());
        }
        if uri.query().is_some() {
            return Err("the upstream URL cannot have a query string".into());
        }
        let base_path = uri.path().trim_end_matches('/').to_owned();
        let mut upstream = Self::new(authority, base_path)?;
        if https {
            let host = upstream.authority.host();
            // An IPv6 literal is bracketed in the authority, not in a server name.
            let bare = host
                .strip_prefix('[')
                .and_then(|h| h.strip_suffix(']'))
                .unwrap_or(host);
            let name = ServerName::try_from(bare.to_owned())
                .map_err(|_| format!("{host} is not a host name TLS can verify"))?;
            upstream.tls_name = Some(name);
        }
        Ok(upstream)
    }

    /// The same upstream verified against `tls`'s roots (when it is https; an http
    /// upstream ignores them).
    #[must_use]
    pub fn with_tls(mut self, tls: UpstreamTls) -> Self {
        if self.is_https() {
            self.tls = Some(tls);
        }
        self
    }

    /// True for an `https://` upstream.
    pub fn is_https(&self) -> bool {
        self.tls_name.is_some()
    }

    /// The roots an https upstream is verified against, once given.
    pub fn tls(&self) -> Option<&UpstreamTls> {
        self.tls.as_ref()
    }

    /// For an https upstream, the name to verify and the roots (if given yet).
    pub(super) fn tls_parts(&self) -> Option<(&ServerName<'static>, Option<&UpstreamTls>)> {
        self.tls_name.as_ref().map(|name| (name, self.tls.as_ref()))
    }

    /// The scheme's port: 443 for https, 80 for http.
    fn default_port(&self) -> u16 {
        if self.is_https() { 443 } else { 80 }
    }

    /// The upstream at a socket address, no path prefix.
    pub fn from_addr(addr: SocketAddr) -> Self {
        let authority = Authority::try_from(addr.to_string().as_str());
        match authority {
            Ok(authority) => match Self::new(authority, String::new()) {
                Ok(upstream) => upstream,
                Err(_) => unreachable!("a socket address is a valid Host header"),
            },
            Err(_) => unreachable!("a socket address is a valid authority"),
        }
    }

    fn new(authority: Authority, base_path: String) -> Result<Self, String> {
        let host = HeaderValue::from_str(authority.as_str())
            .map_err(|_| "the upstream host is not a valid Host header".to_owned())?;
        Ok(Upstream {
            authority,
            base_path,
            host,
            tls_name: None,
            tls: None,
        })
    }

    /// The request target (origin form, `/PREFIX/path?query`) sent upstream for an
    /// incoming request's path and query: the limiter's layer has rewritten them to
    /// their normal form (no dot segment: the prefix cannot be climbed out of).
    fn uri_for(&self, path_and_query: Option<&PathAndQuery>) -> Result<Uri, http::Error> {
        let Some(tail) = path_and_query else {
            return Ok(Uri::from_static("/"));
        };
        if self.base_path.is_empty() {
            return Ok(Uri::from(tail.clone()));
        }
        let path = format!("{}{}", self.base_path, tail.as_str());
        Ok(Uri::from(PathAndQuery::try_from(path)?))
    }

    /// The `Host` header sent upstream.
    pub(super) fn host(&self) -> &HeaderValue {
        &self.host
    }

    /// The path prefix: empty, or starts with `/` and does not end with `/`.
    pub(super) fn base_path(&self) -> &str {
        &self.base_path
    }

    /// The `Host` an HTTP client derives from this upstream's URL: its host, and its
    /// port unless that is the scheme's (80, or 443 for https). Batch items are sent with it; single calls with
    /// [`Upstream::host`], the authority as written.
    pub(crate) fn client_host(&self) -> HeaderValue {
        let host = self.authority.host();
        let named = match self.authority.port() {
            Some(port) if port.as_u16() != self.default_port() => {
                HeaderValue::from_str(&format!("{host}:{port}"))
            }
            _ => HeaderValue::from_str(host),
        };
        // The authority is a valid Host header whole (see `Upstream::new`): so is its host.
        named.unwrap_or_else(|_| self.host.clone())
    }

    /// `host:port` to connect to (port 80, or 443 for https, when the URL names none).
    pub(super) fn connect_target(&self) -> String {
        format!(
            "{}:{}",
            self.authority.host(),
            self.authority.port_u16().unwrap_or(self.default_port())
        )
    }
}

impl fmt::Display for Upstream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let scheme = if self.is_https() { "https" } else { "http" };
        write!(f, "{scheme}://{}{}", self.authority, self.base_path)
    }
}

/// Settings of a [`Proxy`]: [`ProxyConfig::new`] and its `with_*` methods.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub(crate) struct ProxyConfig {
    /// Where requests go.
    pub upstream: Upstream,
    /// How long to wait for the upstream's response headers (connecting included) before
    /// answering 504. The body that follows is not limited by it.
    pub header_timeout: Duration,
}

impl ProxyConfig {
    /// Requests go to `upstream`; its response headers are awaited
    /// [`crate::DEFAULT_UPSTREAM_TIMEOUT`] at most.
    pub(crate) fn new(upstream: Upstream) -> Self {
        ProxyConfig {
            upstream,
            header_timeout: crate::DEFAULT_UPSTREAM_TIMEOUT,
        }
    }

    /// The same settings awaiting the upstream's response headers `timeout` at most.
    #[must_use]
    pub(crate) fn with_header_timeout(mut self, timeout: Duration) -> Self {
        self.header_timeout = timeout;
        self
    }
}

/// The reverse proxy service. Cheap to clone: clones share one connection pool.
#[derive(Clone)]
pub(crate) struct Proxy {
    inner: Arc<Inner>,
}

struct Inner {
    pool: UpstreamPool,
    config: ProxyConfig,
    /// `sluice_upstream_seconds{outcome}`: response, error, timeout
    /// (registered once, not looked up per request).
    upstream_seconds: &'static [sluice_edge::latency::Latency; 3],
}

impl fmt::Debug for Proxy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Proxy")
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

impl Proxy {
    /// A proxy sending over `connections`, a gateway worker's pool shared with its
    /// fast path (the worker prunes it).
    pub(super) fn over(config: ProxyConfig, connections: Arc<Connections>) -> Self {
        Proxy {
            inner: Arc::new(Inner {
                pool: UpstreamPool::new(connections),
                config,
                upstream_seconds: upstream_seconds(),
            }),
        }
    }
}

/// `sluice_upstream_seconds{outcome}` for the outcomes response, error and timeout.
pub(super) fn upstream_seconds() -> &'static [sluice_edge::latency::Latency; 3] {
    &sluice_edge::latency::UPSTREAM_SECONDS
}

/// The future of [`Proxy::call`].
pub(crate) type ProxyFuture =
    Pin<Box<dyn Future<Output = Result<Response<ProxyBody>, Infallible>> + Send>>;

impl<B> Service<Request<B>> for Proxy
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Response = Response<ProxyBody>;
    type Error = Infallible;
    type Future = ProxyFuture;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let inner = Arc::clone(&self.inner);
        Box::pin(async move { Ok(inner.forward(request).await) })
    }
}

impl Inner {
    async fn forward<B>(&self, request: Request<B>) -> Response<ProxyBody>
    where
        B: http_body::Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        let peer = request.extensions().get::<PeerAddr>().map(|p| p.0.ip());
        let (mut parts, body) = request.into_parts();
        let upstream = &self.config.upstream;

        let uri = match upstream.uri_for(parts.uri.path_and_query()) {
            Ok(uri) => uri,
            Err(_) => {
                return error_response(
                    StatusCode::BAD_REQUEST,
                    "bad_request",
                    "the request target cannot be forwarded",
                );
            }
        };
        let original_host = parts
            .headers
            .get(header::HOST)
            .cloned()
            .or_else(|| parts.uri.authority().and_then(|a| a.as_str().parse().ok()));

        strip_hop_by_hop(&mut parts.headers);
        if let Some(ip) = peer {
            append_x_forwarded_for(&mut parts.headers, ip);
            append_forwarded(&mut parts.headers, ip, original_host.as_ref());
        }
        parts.headers.insert(header::HOST, upstream.host.clone());
        // HTTP/2 splits `Cookie` into crumbs; to an HTTP/1.1 upstream they go as
        // one field joined by "; " (RFC 9113 §8.2.3), as sluice read them: many
        // servers read only the first `Cookie` field, or join several with ",".
        if parts.version == Version::HTTP_2 {
            join_cookie_crumbs(&mut parts.headers);
        }
        parts.uri = uri;
        parts.version = Version::HTTP_11;
        // A call through a guarded lane may take the lane's time.
        let header_timeout = parts
            .extensions
            .get::<sluice_tower::UpstreamTimeout>()
            .map_or(self.config.header_timeout, |t| t.0);
        parts.extensions = http::Extensions::new();

        let (upload, upload_handle) = Upload::new(body.map_err(Into::into).boxed_unsync());
        let outgoing = Request::from_parts(parts, upload.boxed_unsync());
        let started = Instant::now();
        let result = tokio::time::timeout(header_timeout, self.pool.send(outgoing)).await;
        let elapsed = started.elapsed();

        match result {
            Ok(Ok(response)) => {
                self.upstream_seconds[0].record(elapsed);
                let (mut parts, body) = response.into_parts();
                strip_hop_by_hop(&mut parts.headers);
                // A refusal before the whole upload: the upload is abandoned once the
                // refusal has been relayed, and the client's connection closes.
                if parts.status.as_u16() >= 400 && !upload_handle.ended() {
                    parts
                        .headers
                        .insert(header::CONNECTION, HeaderValue::from_static("close"));
                    let body = AbandonAfter::new(body, upload_handle);
                    return Response::from_parts(parts, body.map_err(Into::into).boxed());
                }
                Response::from_parts(parts, body.map_err(Into::into).boxed())
            }
            // The client's body failed (it left, or stopped sending): not the
            // upstream's doing (no upstream sample), answered as the limiter answers
            // a body it cannot read.
            Ok(Err(_)) if upload_handle.failed() => sluice_edge::body_unreadable()
                .map(|body| body.map_err(|never| match never {}).boxed()),
            Ok(Err(error)) => {
                self.upstream_seconds[1].record(elapsed);
                upstream_failure(
                    match error {
                        SendError::Connect => Failure::Unreachable,
                        SendError::Upstream => Failure::NoAnswer,
                    },
                    header_timeout,
                )
            }
            // The client's body still coming when the time ran out: the wait
            // was the client's doing, never the upstream's (no failure for the
            // lane's breaker), answered as a body that came too slowly.
            Err(_elapsed) if !upload_handle.ended() => {
                upload_handle.abandon();
                sluice_edge::body_too_slow(header_timeout)
                    .map(|body| body.map_err(|never| match never {}).boxed())
            }
            Err(_elapsed) => {
                self.upstream_seconds[2].record(elapsed);
                upstream_failure(Failure::Timeout, header_timeout)
            }
        }
    }
}

/// Several `Cookie` fields made one, their values joined by "; ".
fn join_cookie_crumbs(headers: &mut http::HeaderMap) {
    let mut crumbs = headers.get_all(header::COOKIE).iter();
    let (Some(first), Some(_)) = (crumbs.next(), crumbs.next()) else {
        return;
    };
    let mut joined = first.as_bytes().to_vec();
    for crumb in headers.get_all(header::COOKIE).iter().skip(1) {
        joined.extend_from_slice(b"; ");
        joined.extend_from_slice(crumb.as_bytes());
    }
    if let Ok(value) = HeaderValue::from_bytes(&joined) {
        headers.insert(header::COOKIE, value);
    }
}

/// Why the upstream gave no response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Failure {
    /// No connection could be opened.
    Unreachable,
    /// The connection failed before a response head arrived, or sent one that cannot
    /// be relayed.
    NoAnswer,
    /// No response head within the configured time.
    Timeout,
}

/// The answer for an upstream `failure`: 502 `bad_gateway` or, past `timeout`, 504
/// `gateway_timeout`, as the JSON envelope.
pub(super) fn upstream_failure(failure: Failure, timeout: Duration) -> Response<ProxyBody> {
    let mut answer = match failure {
        Failure::Unreachable => error_response(
            StatusCode::BAD_GATEWAY,
            "bad_gateway",
            "the upstream could not be reached",
        ),
        Failure::NoAnswer => error_response(
            StatusCode::BAD_GATEWAY,
            "bad_gateway",
            "the upstream failed to answer",
        ),
        Failure::Timeout => error_response(
            StatusCode::GATEWAY_TIMEOUT,
            "gateway_timeout",
            &format!(
                "the upstream sent no response within {} s",
                timeout.as_secs_f64()
            ),
        ),
    };
    if failure != Failure::Unreachable {
        // The call reached the upstream: an LLM call's reservation stands.
        answer
            .extensions_mut()
            .insert(sluice_edge::tokens::UpstreamMayHaveRun);
    }
    answer
}

/// sluice's JSON error envelope (the one definition, [`sluice_edge::envelope_response`])
/// with empty `details`, as the proxy's body type.
pub(crate) fn error_response(status: StatusCode, code: &str, message: &str) -> Response<ProxyBody> {
    sluice_edge::envelope_response(status, code, message, serde_json::json!({}))
        .map(|body| body.map_err(|never| match never {}).boxed())
}

/// Joins every value of `name` with `, `, appends `element`, and stores it as one value.
fn append_list(headers: &mut HeaderMap, name: HeaderName, element: &[u8]) {
    let value = if headers.contains_key(&name) {
        let mut joined: Vec<u8> = Vec::new();
        for value in headers.get_all(&name) {
            let bytes = value.as_bytes().trim_ascii();
            if bytes.is_empty() {
                continue;
            }
            joined.extend_from_slice(bytes);
            joined.extend_from_slice(b", ");
        }
        joined.extend_from_slice(element);
        HeaderValue::from_bytes(&joined)
    } else {
        HeaderValue::from_bytes(element)
    };
    // Every piece came from a valid header value or is plain ASCII.
    if let Ok(value) = value {
        headers.insert(name, value);
    }
}

/// Writes `ip` in its usual text form: dotted decimal without the formatting
/// machinery for IPv4 (every proxied request does this), `Display` for IPv6.
fn push_ip(out: &mut Vec<u8>, ip: IpAddr) {
    match ip {
        IpAddr::V4(v4) => {
            for (i, octet) in v4.octets().into_iter().enumerate() {
                if i > 0 {
                    out.push(b'.');
                }
                if octet >= 100 {
                    out.push(b'0' + octet / 100);
                }
                if octet >= 10 {
                    out.push(b'0' + octet / 10 % 10);
                }
                out.push(b'0' + octet % 10);
            }
        }
        IpAddr::V6(v6) => {
            use std::io::Write as _;
            let _ = write!(out, "{v6}");
        }
    }
}

/// Appends the peer IP to `X-Forwarded-For`.
fn append_x_forwarded_for(headers: &mut HeaderMap, ip: IpAddr) {
    append_list(
        headers,
        HeaderName::from_static("x-forwarded-for"),
        ForwardedPeer::new(ip).text(),
    );
}

/// Appends an RFC 7239 element `for=…;host="…";proto=http` to `Forwarded`.
fn append_forwarded(headers: &mut HeaderMap, ip: IpAddr, host: Option<&HeaderValue>) {
    let mut element = Vec::with_capacity(96);
    ForwardedPeer::new(ip).push_forwarded_element(&mut element, host.map(HeaderValue::as_bytes));
    append_list(headers, header::FORWARDED, &element);
}

/// A connection's peer as forwarding headers write it, formatted once per connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct ForwardedPeer {
    /// The address in its usual text form (what `X-Forwarded-For` gets).
    text: Vec<u8>,
    ipv6: bool,
}

impl ForwardedPeer {
    pub(super) fn new(ip: IpAddr) -> Self {
        let mut text = Vec::with_capacity(39);
        push_ip(&mut text, ip);
        ForwardedPeer {
            text,
            ipv6: ip.is_ipv6(),
        }
    }

    /// The address as `X-Forwarded-For` has it.
    pub(super) fn text(&self) -> &[u8] {
        &self.text
    }

    /// Writes the RFC 7239 element `for=…;host="…";proto=http` for a request from this
    /// peer that named `host` (left out when it is empty or would need escaping).
    pub(super) fn push_forwarded_element(&self, out: &mut Vec<u8>, host: Option<&[u8]>) {
        out.extend_from_slice(b"for=");
        if self.ipv6 {
            out.extend_from_slice(b"\"[");
            out.extend_from_slice(&self.text);
            out.extend_from_slice(b"]\"");
        } else {
            out.extend_from_slice(&self.text);
        }
        push_forwarded_host(out, host);
    }
}

/// The `;host="…";proto=http` end of a `Forwarded` element.
fn push_forwarded_host(out: &mut Vec<u8>, host: Option<&[u8]>) {
    if let Some(host) = host
        && !host.is_empty()
        && host
            .iter()
            .all(|&b| b.is_ascii_graphic() && b != b'"' && b != b'\\')
    {
        out.extend_from_slice(b";host=\"");
        out.extend_from_slice(host);
        out.push(b'"');
    }
    out.extend_from_slice(b";proto=http");
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SPEC E2 over HTTP/2: cookie crumbs go to the HTTP/1.1 upstream as the
    /// one field sluice read (RFC 9113 §8.2.3).
    #[test]
    fn e2_cookie_crumbs_are_joined_for_the_upstream() {
        let mut headers = HeaderMap::new();
        headers.append(header::COOKIE, HeaderValue::from_static("a=1"));
        headers.append(header::COOKIE, HeaderValue::from_static("session=abc"));
        join_cookie_crumbs(&mut headers);
        let all: Vec<_> = headers.get_all(header::COOKIE).iter().collect();
        assert_eq!(all, ["a=1; session=abc"]);
        let mut one = HeaderMap::new();
        one.append(header::COOKIE, HeaderValue::from_static("session=abc"));
        join_cookie_crumbs(&mut one);
        assert_eq!(one[header::COOKIE], "session=abc");
    }

    #[test]
    fn forwarded_headers_are_appended_not_replaced() {
        let mut headers = HeaderMap::new();
        headers.append("x-forwarded-for", HeaderValue::from_static("203.0.113.7"));
        headers.append("x-forwarded-for", HeaderValue::from_static("198.51.100.2"));
        append_x_forwarded_for(&mut headers, "127.0.0.1".parse().expect("ip"));
        assert_eq!(
            headers["x-forwarded-for"],
            "203.0.113.7, 198.51.100.2, 127.0.0.1"
        );

        let host = HeaderValue::from_static("api.example:8080");
        append_forwarded(&mut headers, "::1".parse().expect("ip"), Some(&host));
        assert_eq!(
            headers[header::FORWARDED],
            "for=\"[::1]\";host=\"api.example:8080\";proto=http"
        );
    }

    #[test]
    fn peer_addresses_are_written_as_usual() {
        for ip in [
            "0.0.0.0",
            "9.10.99.100",
            "127.0.0.1",
            "255.255.255.255",
            "::1",
            "2001:db8::7",
        ] {
            let mut out = Vec::new();
            push_ip(&mut out, ip.parse().expect("ip"));
            assert_eq!(out, ip.as_bytes());
        }
        let mut headers = HeaderMap::new();
        append_forwarded(&mut headers, "10.0.0.1".parse().expect("ip"), None);
        assert_eq!(headers[header::FORWARDED], "for=10.0.0.1;proto=http");
    }

    #[test]
    fn upstream_urls_are_checked_and_joined() {
        let up = Upstream::parse("http://127.0.0.1:3000/api/").expect("valid");
        assert_eq!(up.to_string(), "http://127.0.0.1:3000/api");
        let pq = PathAndQuery::from_static("/v1/x?y=1");
        assert_eq!(
            up.uri_for(Some(&pq)).expect("uri").to_string(),
            "/api/v1/x?y=1"
        );
        assert_eq!(up.connect_target(), "127.0.0.1:3000");
        assert_eq!(
            Upstream::parse("http://localhost")
                .expect("valid")
                .connect_target(),
            "localhost:80"
        );
        assert_eq!(
            Upstream::parse("http://[::1]:3000")
                .expect("valid")
                .connect_target(),
            "[::1]:3000"
        );
        // What the limiter's layer hands on is normal: it stays under the prefix.
        let policy = sluice_policy::default_policy().expect("default policy");
        let mut uri: Uri = "/x/../../etc".parse().expect("uri");
        let limiter = sluice_edge::Limiter::new(
            policy,
            sluice_store::MemoryStore::new(sluice_store::MemoryConfig::default()),
        );
        assert!(limiter.normalize_target(&mut uri).is_err());
        let mut uri: Uri = "//v1/../v1/%78?y=1".parse().expect("uri");
        limiter.normalize_target(&mut uri).expect("normal form");
        assert_eq!(
            up.uri_for(uri.path_and_query()).expect("uri").to_string(),
            "/api/v1/x?y=1"
        );
        let bare = Upstream::parse("http://127.0.0.1:3000").expect("valid");
        assert_eq!(
            bare.uri_for(Some(&pq)).expect("uri").to_string(),
            "/v1/x?y=1"
        );
        assert!(Upstream::parse("ftp://example.com").is_err());
        assert!(Upstream::parse("http://example.com/?q=1").is_err());
        assert!(Upstream::parse("not a url").is_err());
        assert_eq!(
            Upstream::from_addr("127.0.0.1:9".parse().expect("addr")).to_string(),
            "http://127.0.0.1:9"
        );
    }

    #[test]
    fn t0_https_upstreams_keep_their_prefix_and_default_to_port_443() {
        let up = Upstream::parse("https://api.example/v1/").expect("valid");
        assert!(up.is_https());
        assert_eq!(up.to_string(), "https://api.example/v1");
        assert_eq!(up.connect_target(), "api.example:443");
        assert_eq!(up.client_host(), "api.example");
        let pq = PathAndQuery::from_static("/chat?x=1");
        assert_eq!(
            up.uri_for(Some(&pq)).expect("uri").to_string(),
            "/v1/chat?x=1"
        );
        let up = Upstream::parse("https://127.0.0.1:8443").expect("valid");
        assert_eq!(up.connect_target(), "127.0.0.1:8443");
        assert_eq!(up.client_host(), "127.0.0.1:8443");
        assert_eq!(
            Upstream::parse("https://api:443")
                .expect("valid")
                .client_host(),
            "api"
        );
        assert_eq!(
            Upstream::parse("http://api:443")
                .expect("valid")
                .client_host(),
            "api:443"
        );
        let v6 = Upstream::parse("https://[::1]:8443").expect("valid");
        assert_eq!(v6.connect_target(), "[::1]:8443");
        assert!(v6.tls_parts().is_some());
        assert!(!Upstream::parse("http://api").expect("valid").is_https());
    }

    /// Batch items keep the `Host` the runner's former HTTP client derived from the
    /// URL: the port only when it is not 80.
    #[test]
    fn the_client_host_names_the_port_unless_it_is_80() {
        let host = |url: &str| Upstream::parse(url).expect("an upstream").client_host();
        assert_eq!(host("http://api:80/v1"), "api");
        assert_eq!(host("http://api"), "api");
        assert_eq!(host("http://127.0.0.1:3000"), "127.0.0.1:3000");
        assert_eq!(host("http://[::1]:8080"), "[::1]:8080");
        assert_eq!(
            Upstream::parse("http://api:80")
                .expect("an upstream")
                .host(),
            "api:80"
        );
    }
}
