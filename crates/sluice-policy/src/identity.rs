//! Who a request is from: the caller's credential (hashed at
//! once, never kept or logged raw) and the client IP.

use std::borrow::Cow;
use std::net::{IpAddr, Ipv6Addr};

use http::header::{AUTHORIZATION, COOKIE, HeaderName};
use http::{HeaderMap, HeaderValue};
use sha2::{Digest, Sha256};
use sluice_core::digest;

use crate::cookie;
use crate::model::{CredentialSource, Identity, Principal};

const X_API_KEY: HeaderName = HeaderName::from_static("x-api-key");
const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");

/// How a caller was recognised.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CallerKind {
    /// By a credential the request sent.
    Credential,
    /// By its client IP (no credential).
    Ip,
}

/// The caller of one request, as budgets see it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Caller {
    /// How it was recognised.
    pub kind: CallerKind,
    /// Digest of the credential's SHA-256 (or of the client IP): the subject
    /// of the per-caller class budgets.
    pub subject: u64,
    /// Digest of the workspace (the principal's, else the caller's own).
    pub workspace: u64,
    /// Digest of the user (the principal's, else the caller's own).
    pub user: u64,
    /// Who it is, in a form safe to log and show (see [`Who`]'s `Display`).
    pub who: Who,
    /// The principal, when the credential is in the key table or a trusted
    /// auth layer named one.
    pub principal: Option<Principal>,
    /// The SHA-256 of the credential, when there is one (never the credential).
    pub credential_sha256: Option<[u8; 32]>,
    /// The plan a trusted auth layer named for the request
    /// ([`Identity::plan_header`](crate::Identity)), as it wrote it.
    pub plan: Option<Box<str>>,
}

impl Caller {
    /// The workspace as the upstream is told it (`X-Sluice-Workspace`) and the
    /// admin's `/quotas?workspace=` takes it: the principal's workspace, else
    /// `key:<SHA-256 of the credential, hex>`, else `ip:<client address or prefix>`.
    pub fn workspace_label(&self) -> String {
        match &self.principal {
            Some(p) => p.workspace.clone(),
            None => self.own_label().as_str().to_owned(),
        }
    }

    /// The user as the upstream is told it (`X-Sluice-User`), labelled as
    /// [`Caller::workspace_label`].
    pub fn user_label(&self) -> String {
        match &self.principal {
            Some(p) => p.user.clone(),
            None => self.own_label().as_str().to_owned(),
        }
    }

    /// The label of a caller without a principal, its workspace and user both:
    /// `key:<SHA-256 of the credential, hex>`, else `ip:<address or prefix>`.
    /// Written on the stack, for the request path (no allocation).
    pub fn own_label(&self) -> Label {
        let mut label = Label::default();
        match &self.credential_sha256 {
            Some(sha) => {
                label.push(b"key:");
                sha.iter().for_each(|&b| label.push_hex(b));
            }
            None => self.who.write_to(&mut label),
        }
        label
    }
}

/// A caller's label (see [`Caller::own_label`]), held on the stack: at most
/// `key:` and 64 hex digits, or `ip:`, an IPv6 address and a prefix length.
#[derive(Clone, Copy)]
pub struct Label {
    bytes: [u8; Label::CAPACITY],
    len: u8,
}

impl Label {
    const CAPACITY: usize = 72;

    /// The label.
    pub fn as_str(&self) -> &str {
        // Only ASCII is ever pushed (see `push` and `fmt::Write::write_str`).
        std::str::from_utf8(self.as_bytes()).unwrap_or_default()
    }

    /// The label's bytes (ASCII).
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len)]
    }

    /// Appends ASCII `bytes` (past the capacity, the rest is left out: no label
    /// is that long). Byte by byte: the pieces are a few bytes long, shorter
    /// than a call to `memcpy`.
    #[inline]
    fn push(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.push_byte(b);
        }
    }

    #[inline]
    fn push_byte(&mut self, b: u8) {
        if let Some(slot) = self.bytes.get_mut(usize::from(self.len)) {
            *slot = b;
            self.len += 1;
        }
    }

    fn push_hex(&mut self, b: u8) {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        self.push_byte(HEX[usize::from(b >> 4)]);
        self.push_byte(HEX[usize::from(b & 15)]);
    }

    /// Appends `n` in decimal.
    fn push_decimal(&mut self, n: u8) {
        if n >= 100 {
            self.push_byte(b'0' + n / 100);
        }
        if n >= 10 {
            self.push_byte(b'0' + n / 10 % 10);
        }
        self.push_byte(b'0' + n % 10);
    }
}

impl Default for Label {
    fn default() -> Self {
        Label {
            bytes: [0; Label::CAPACITY],
            len: 0,
        }
    }
}

impl std::fmt::Write for Label {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        if !s.is_ascii() || s.len() > Self::CAPACITY - usize::from(self.len) {
            return Err(std::fmt::Error);
        }
        self.push(s.as_bytes());
        Ok(())
    }
}

impl std::fmt::Debug for Label {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(self.as_str(), f)
    }
}

/// A caller as logs and the status page show it, rendered only when shown:
/// `key:<first 12 hex of the credential's SHA-256>` or `ip:<address or prefix>`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Who {
    /// A credential, by the first 6 bytes of its SHA-256.
    Key([u8; 6]),
    /// A client IP (IPv6: the prefix of this length).
    Ip(IpAddr, Option<u8>),
}

impl Who {
    /// Writes the label into `label`: IPv4 addresses digit by digit (the
    /// request path writes one per forwarded request; `core::fmt`'s address
    /// formatting costs over a thousand instructions), IPv6 through `core::fmt`.
    fn write_to(&self, label: &mut Label) {
        match self {
            Who::Key(prefix) => {
                label.push(b"key:");
                prefix.iter().for_each(|&b| label.push_hex(b));
            }
            Who::Ip(addr, prefix) => {
                label.push(b"ip:");
                match addr {
                    IpAddr::V4(v4) => {
                        for (i, octet) in v4.octets().into_iter().enumerate() {
                            if i > 0 {
                                label.push(b".");
                            }
                            label.push_decimal(octet);
                        }
                    }
                    // At most 39 characters: always fits.
                    IpAddr::V6(v6) => {
                        let _ = std::fmt::Write::write_fmt(label, format_args!("{v6}"));
                    }
                }
                if let Some(prefix) = prefix {
                    label.push(b"/");
                    label.push_decimal(*prefix);
                }
            }
        }
    }
}

impl std::fmt::Display for Who {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut label = Label::default();
        self.write_to(&mut label);
        f.write_str(label.as_str())
    }
}

/// What a request sends of one kind of credential ([`Identity::check_credentials`]).
#[derive(Clone, Copy, Debug, Default)]
struct Sent {
    /// Fields of the kind (session cookies, for the cookie).
    count: usize,
    /// The first field unreadable as a credential (any session cookie, for the
    /// cookie).
    malformed: bool,
}

/// A request whose credential sluice cannot count as the upstream reads it: one kind
/// sent more than once (two `X-API-Key` fields, two `Authorization` fields, two
/// session cookies), or two kinds at once (an `X-API-Key` and a Bearer) when the policy
/// names no `identity.counted_credential`. sluice would charge one while the upstream
/// may read another, so the request is refused. With `count` 1, one field sluice
/// cannot read as the credential it is (an `Authorization: Bearer` without a single
/// token, an `X-API-Key` or Bearer that is not visible ASCII): uncounted, it must not
/// be forwarded either (see [`AmbiguousCredentials::is_malformed`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{}", self.describe())]
pub struct AmbiguousCredentials {
    /// Where the (first) credential is read from.
    pub sent_in: CredentialSource,
    /// How many the request sends (at least 2; 1 for a malformed one).
    pub count: usize,
    /// The other kind sent beside it, when two kinds came in one request.
    pub also: Option<CredentialSource>,
}

fn source_name(source: CredentialSource, plural: bool) -> &'static str {
    match (source, plural) {
        (CredentialSource::ApiKeyHeader, true) => "X-API-Key fields",
        (CredentialSource::Bearer, true) => "Authorization fields",
        (CredentialSource::SessionCookie, true) => "session cookies",
        (CredentialSource::ApiKeyHeader, false) => "an X-API-Key",
        (CredentialSource::Bearer, false) => "an Authorization",
        (CredentialSource::SessionCookie, false) => "a session cookie",
    }
}

fn source_field(source: CredentialSource) -> &'static str {
    match source {
        CredentialSource::ApiKeyHeader => "x-api-key",
        CredentialSource::Bearer => "authorization",
        CredentialSource::SessionCookie => "cookie",
    }
}

impl AmbiguousCredentials {
    /// Whether this is one field that is not a readable credential, rather than
    /// several.
    pub fn is_malformed(&self) -> bool {
        self.count == 1 && self.also.is_none()
    }

    fn describe(&self) -> String {
        if self.is_malformed() {
            let readable = match self.sent_in {
                CredentialSource::Bearer => "`Bearer <token>`, one token of visible ASCII",
                CredentialSource::ApiKeyHeader => "one token of visible ASCII",
                CredentialSource::SessionCookie => {
                    "a value as web frameworks read it: quoted, spaced or %XX-encoded, \
                     no backslash escape, not after a space or comma inside another pair"
                }
            };
            return format!(
                "malformed credential: {} that is not a readable credential ({readable})",
                source_name(self.sent_in, false)
            );
        }
        match self.also {
            Some(other) => format!(
                "ambiguous credentials: {} and {} in one request (send one, or name the \
                 counted one with identity.counted_credential)",
                source_name(self.sent_in, false),
                source_name(other, false)
            ),
            None => format!(
                "ambiguous credentials: {} {}",
                self.count,
                source_name(self.sent_in, true)
            ),
        }
    }

    /// The field (lower case) or, for the session cookie, `cookie`.
    pub fn field(&self) -> &'static str {
        source_field(self.sent_in)
    }

    /// Every field the refusal names: [`AmbiguousCredentials::field`], and the other
    /// kind's when two kinds came.
    pub fn fields(&self) -> Vec<&'static str> {
        std::iter::once(self.sent_in)
            .chain(self.also)
            .map(source_field)
            .collect()
    }
}

/// The client IP and its subject for IP budgets.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClientIp {
    /// The address believed to be the client's.
    pub addr: IpAddr,
    /// Digest of the address (IPv6: of its configured prefix).
    pub subject: u64,
    /// The address or prefix, for logs.
    pub who: Who,
    /// Digest of the client's network (the /24 of an IPv4 address, the /56 of an
    /// IPv6 one): new callers that find the memory store full share overflow
    /// budgets per network, so a flood of new keys from some networks leaves
    /// callers from others a budget.
    pub network: u64,
}

/// The prefix length of an IPv4 client's network (see [`ClientIp::network`]).
pub const NETWORK_PREFIX_V4: u8 = 24;

/// The prefix length of an IPv6 client's network (see [`ClientIp::network`]): a
/// site's usual allocation, so one site's /64s are one network.
pub const NETWORK_PREFIX_V6: u8 = 56;

impl Identity {
    /// The client IP: the socket peer, unless the peer is a trusted proxy;
    /// then the right-most `X-Forwarded-For` hop that is not a trusted proxy.
    /// Headers from untrusted peers change nothing.
    pub fn client_ip(&self, peer: IpAddr, headers: &HeaderMap) -> ClientIp {
        let addr = if self.is_trusted(peer) {
            self.forwarded_client(peer, headers)
        } else {
            peer
        };
        self.ip_subject(addr)
    }

    fn is_trusted(&self, ip: IpAddr) -> bool {
        let ip = canonical(ip);
        self.trusted_proxies.iter().any(|net| net.contains(&ip))
    }

    fn forwarded_client(&self, peer: IpAddr, headers: &HeaderMap) -> IpAddr {
        let hops: Vec<&str> = headers
            .get_all(X_FORWARDED_FOR)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .map(str::trim)
            .collect();
        let mut client = peer;
        for hop in hops.iter().rev() {
            match parse_hop(hop) {
                Some(ip) => {
                    client = ip;
                    if !self.is_trusted(ip) {
                        return ip;
                    }
                }
                // Garbage in the chain: believe nothing left of it.
                None => return client,
            }
        }
        client
    }

    /// The network of IPv6 address `v6`: its first `ipv6_prefix` bits.
    fn ipv6_network(&self, v6: Ipv6Addr) -> Ipv6Addr {
        let prefix = self.ipv6_prefix.clamp(1, 128);
        Ipv6Addr::from(u128::from(v6) & (u128::MAX << (128 - u32::from(prefix))))
    }

    /// The address `addr` is counted as wherever sluice bounds a client by its
    /// address (its IP budgets, its open connections): itself, an IPv6 one by
    /// its network (`ipv6_prefix`), whose holder has all its addresses.
    pub fn address_group(&self, addr: IpAddr) -> IpAddr {
        match canonical(addr) {
            IpAddr::V6(v6) => IpAddr::V6(self.ipv6_network(v6)),
            v4 => v4,
        }
    }

    /// The subject of IP budgets for `addr` (IPv6 grouped by prefix).
    pub fn ip_subject(&self, addr: IpAddr) -> ClientIp {
        let addr = canonical(addr);
        // "ip:" and up to 16 address bytes, on the stack (this runs per request).
        let mut keyed = [0u8; 19];
        keyed[..3].copy_from_slice(b"ip:");
        let (len, who) = match addr {
            IpAddr::V4(v4) => {
                keyed[3..7].copy_from_slice(&v4.octets());
                (7, Who::Ip(addr, None))
            }
            IpAddr::V6(v6) => {
                let net = self.ipv6_network(v6);
                keyed[3..19].copy_from_slice(&net.octets());
                (
                    19,
                    Who::Ip(IpAddr::V6(net), Some(self.ipv6_prefix.clamp(1, 128))),
                )
            }
        };
        // "net:" and the network's address bytes.
        let mut net = [0u8; 20];
        net[..4].copy_from_slice(b"net:");
        let net_len = match addr {
            IpAddr::V4(v4) => {
                let masked = u32::from(v4) & (u32::MAX << (32 - u32::from(NETWORK_PREFIX_V4)));
                net[4..8].copy_from_slice(&masked.to_be_bytes());
                8
            }
            IpAddr::V6(v6) => {
                let masked = u128::from(v6) & (u128::MAX << (128 - u32::from(NETWORK_PREFIX_V6)));
                net[4..20].copy_from_slice(&masked.to_be_bytes());
                20
            }
        };
        ClientIp {
            addr,
            subject: digest(&keyed[..len]),
            who,
            // Never 0, which a store reads as "no network".
            network: digest(&net[..net_len]).max(1),
        }
    }

    /// The caller: the first credential found (in the configured order),
    /// else the client IP.
    pub fn caller(&self, headers: &HeaderMap, client: &ClientIp, peer_trusted: bool) -> Caller {
        let mut caller = self.caller_of(headers, client, peer_trusted);
        if peer_trusted && let Some(name) = &self.plan_header {
            // Any value, even one not UTF-8: a plan that is not the policy's is
            // refused by the limiter, never read as no plan.
            caller.plan = headers
                .get(name)
                .map(|v| String::from_utf8_lossy(v.as_bytes()).into());
        }
        caller
    }

    fn caller_of(&self, headers: &HeaderMap, client: &ClientIp, peer_trusted: bool) -> Caller {
        let from_auth_layer = if peer_trusted {
            self.principal_headers.as_ref().and_then(|(w, u)| {
                // An empty field names no one: the caller is then its credential's.
                let w = headers.get(w)?.to_str().ok().filter(|w| !w.is_empty())?;
                let u = headers.get(u)?.to_str().ok().filter(|u| !u.is_empty())?;
                Some(Principal {
                    workspace: w.to_owned(),
                    user: u.to_owned(),
                })
            })
        } else {
            None
        };
        match self.credential(headers) {
            Some(secret) => self.credential_caller(secret.as_bytes(), from_auth_layer),
            None => {
                let (workspace, user) = principal_digests(from_auth_layer.as_ref(), client.subject);
                Caller {
                    kind: CallerKind::Ip,
                    subject: client.subject,
                    workspace,
                    user,
                    who: client.who,
                    principal: from_auth_layer,
                    credential_sha256: None,
                    plan: None,
                }
            }
        }
    }

    /// The caller that sent `credential`: budgets keyed by its SHA-256, its principal
    /// the one a trusted auth layer named, else the key table's for it, else its own.
    fn credential_caller(&self, credential: &[u8], from_auth_layer: Option<Principal>) -> Caller {
        let sha: [u8; 32] = Sha256::digest(credential).into();
        let mut keyed = [0u8; 37];
        keyed[..5].copy_from_slice(b"cred:");
        keyed[5..].copy_from_slice(&sha);
        let subject = digest(&keyed);
        let mut prefix = [0u8; 6];
        prefix.copy_from_slice(&sha[..6]);
        let principal = from_auth_layer.or_else(|| self.keys.get(&sha).cloned());
        let (workspace, user) = principal_digests(principal.as_ref(), subject);
        Caller {
            kind: CallerKind::Credential,
            subject,
            workspace,
            user,
            who: Who::Key(prefix),
            principal,
            credential_sha256: Some(sha),
            plan: None,
        }
    }

    /// The caller a key of the application's own choosing names (a user id, a tenant,
    /// an API key read from where the policy does not look), counted as a credential
    /// is: budgets keyed by its SHA-256 (the same as the same credential's), its
    /// principal from the key table when the table holds it.
    pub fn keyed_caller(&self, key: &[u8]) -> Caller {
        self.credential_caller(key, None)
    }

    /// Checks that the request sends each configured kind of credential at most once:
    /// one `X-API-Key` field, one `Authorization` field, one cookie of the session's
    /// name (over every `Cookie` field, as HTTP/2 splits them). Empty ones count: an
    /// empty first field would have sluice charge the next source while the upstream
    /// may read the second.
    ///
    /// # Errors
    /// [`AmbiguousCredentials`] for the first kind (in the configured order) sent more
    /// than once.
    pub fn check_credentials(&self, headers: &HeaderMap) -> Result<(), AmbiguousCredentials> {
        // Each kind's fields are read once (this runs per request), then judged in
        // three passes: sent more than once, unreadable, more than one kind.
        let mut read = [Sent::default(); CredentialSource::KINDS];
        for &source in self.credentials.iter().chain(&self.counted) {
            read[source.index()] = self.sent(source, headers);
        }
        let sent = |source: CredentialSource| read[source.index()];
        for &source in &self.credentials {
            let count = sent(source).count;
            if count > 1 {
                return Err(AmbiguousCredentials {
                    sent_in: source,
                    count,
                    also: None,
                });
            }
        }
        for &source in &self.credentials {
            if sent(source).malformed {
                return Err(AmbiguousCredentials {
                    sent_in: source,
                    count: 1,
                    also: None,
                });
            }
        }
        let mut present = [None; CredentialSource::KINDS];
        let mut kinds = 0;
        for &source in &self.credentials {
            if sent(source).count > 0 {
                if let Some(slot) = present.get_mut(kinds) {
                    *slot = Some(source);
                }
                kinds += 1;
            }
        }
        let (Some(first), Some(second)) = (present[0], present[1]) else {
            return Ok(());
        };
        match self.counted {
            Some(counted) if sent(counted).count > 0 => Ok(()),
            _ => Err(AmbiguousCredentials {
                sent_in: first,
                count: kinds,
                also: Some(second),
            }),
        }
    }

    /// What the request sends of `source`: how many fields (session cookies, over
    /// every `Cookie` field, as HTTP/2 splits them) and whether the first is one
    /// sluice cannot read as the credential the upstream may take it for (any, for
    /// the session cookie): not visible ASCII, a Bearer without exactly one token,
    /// or a session cookie whose value the common frameworks read differently (see
    /// [`crate::cookie`]). Other `Authorization` schemes (`Basic …`) are not
    /// sluice's credentials and pass.
    fn sent(&self, source: CredentialSource, headers: &HeaderMap) -> Sent {
        let name = match source {
            CredentialSource::ApiKeyHeader => X_API_KEY,
            CredentialSource::Bearer => AUTHORIZATION,
            CredentialSource::SessionCookie => {
                let mut sent = Sent::default();
                for pair in self.session_pairs(headers) {
                    sent.count += usize::from(pair.is_session());
                    sent.malformed |= pair == cookie::Pair::Unreadable;
                }
                return sent;
            }
        };
        let mut fields = headers.get_all(name).iter();
        let Some(first) = fields.next() else {
            return Sent::default();
        };
        let malformed = match first.to_str() {
            Err(_) => true,
            // A key is one token of visible ASCII (an empty field is one caller,
            // the key ""): a space or tab inside is read otherwise by servers that
            // split the field.
            Ok(text) if source == CredentialSource::ApiKeyHeader => {
                text.trim().contains([' ', '\t'])
            }
            Ok(text) => {
                let text = text.trim();
                let (scheme, token) = text.split_once([' ', '\t']).unwrap_or((text, ""));
                scheme.eq_ignore_ascii_case("bearer") && {
                    let token = token.trim();
                    token.is_empty() || token.contains([' ', '\t'])
                }
            }
        };
        Sent {
            count: 1 + fields.count(),
            malformed,
        }
    }

    /// Whether a request with these fields sends a credential of `source`: the field
    /// (`X-API-Key`, `Authorization`, whatever it holds) or a cookie of the session's
    /// name.
    fn sends<'a>(
        &self,
        source: CredentialSource,
        mut fields: impl Iterator<Item = (&'a [u8], &'a [u8])>,
    ) -> bool {
        match source {
            CredentialSource::ApiKeyHeader => {
                fields.any(|(n, _)| n.eq_ignore_ascii_case(b"x-api-key"))
            }
            CredentialSource::Bearer => {
                fields.any(|(n, _)| n.eq_ignore_ascii_case(b"authorization"))
            }
            CredentialSource::SessionCookie => fields.any(|(n, v)| {
                n.eq_ignore_ascii_case(b"cookie")
                    && cookie::pairs(v, &self.session_cookie).any(|pair| pair.is_session())
            }),
        }
    }

    /// Whether the request sends a credential of `source` (by lookup).
    fn sends_in(&self, source: CredentialSource, headers: &HeaderMap) -> bool {
        match source {
            CredentialSource::ApiKeyHeader => headers.contains_key(X_API_KEY),
            CredentialSource::Bearer => headers.contains_key(AUTHORIZATION),
            CredentialSource::SessionCookie => {
                self.session_pairs(headers).any(|pair| pair.is_session())
            }
        }
    }

    /// Every pair of every `Cookie` field (HTTP/2 splits them), each read for the
    /// session cookie by the one cookie reader ([`crate::cookie`]).
    fn session_pairs<'h>(
        &'h self,
        headers: &'h HeaderMap,
    ) -> impl Iterator<Item = cookie::Pair<'h>> + 'h {
        headers
            .get_all(COOKIE)
            .iter()
            .flat_map(|v| cookie::pairs(v.as_bytes(), &self.session_cookie))
    }

    /// Whether a request with these fields (name, value) sends more than one kind of
    /// credential: with `identity.counted_credential`, the others are stripped before
    /// it is forwarded (see [`Identity::strip_uncounted`]), so a server that writes
    /// the upstream head itself must leave such a request to one that can.
    pub fn sends_several_kinds<'a>(
        &self,
        fields: impl Iterator<Item = (&'a [u8], &'a [u8])> + Clone,
    ) -> bool {
        self.credentials
            .iter()
            .filter(|&&source| self.sends(source, fields.clone()))
            .nth(1)
            .is_some()
    }

    /// Removes from a request that is forwarded the credentials that were not counted:
    /// with `identity.counted_credential` set and sent, every other kind (the
    /// `X-API-Key` or `Authorization` field, the session cookie out of `Cookie`), so
    /// the upstream reads only the credential sluice charged.
    pub fn strip_uncounted(&self, headers: &mut HeaderMap) {
        let Some(counted) = self.counted else {
            return;
        };
        if !self.sends_in(counted, headers) {
            return;
        }
        for &source in &self.credentials {
            if source == counted {
                continue;
            }
            match source {
                CredentialSource::ApiKeyHeader => {
                    headers.remove(X_API_KEY);
                }
                CredentialSource::Bearer => {
                    headers.remove(AUTHORIZATION);
                }
                CredentialSource::SessionCookie => retain_cookies(headers, |pair| {
                    !cookie::read(pair, &self.session_cookie).is_session()
                }),
            }
        }
    }

    /// Every request header [`Identity::client_ip`] and [`Identity::caller`] may read.
    /// A server that does not build a request's whole header map keeps just these and
    /// gets the same client IP and caller.
    pub fn read_headers(&self) -> Vec<HeaderName> {
        let mut names = vec![X_FORWARDED_FOR];
        for source in &self.credentials {
            names.push(match source {
                CredentialSource::ApiKeyHeader => X_API_KEY,
                CredentialSource::Bearer => AUTHORIZATION,
                CredentialSource::SessionCookie => COOKIE,
            });
        }
        if let Some((workspace, user)) = &self.principal_headers {
            names.extend([workspace.clone(), user.clone()]);
        }
        names.extend(self.plan_header.clone());
        names.sort_unstable_by(|a, b| a.as_str().cmp(b.as_str()));
        names.dedup();
        names
    }

    /// The subject digest of the workspace a label names (see
    /// [`Caller::workspace_label`]): `key:<hex>` is an unknown credential's own
    /// workspace, `ip:<address>` a caller without credential, anything else a
    /// named workspace. `None` for a `key:`/`ip:` label that does not parse.
    pub fn workspace_subject(&self, label: &str) -> Option<u64> {
        if let Some(hex_sha) = label.strip_prefix("key:") {
            let mut sha = [0u8; 32];
            hex::decode_to_slice(hex_sha, &mut sha).ok()?;
            let mut keyed = [0u8; 37];
            keyed[..5].copy_from_slice(b"cred:");
            keyed[5..].copy_from_slice(&sha);
            return Some(digest(&keyed));
        }
        if let Some(addr) = label.strip_prefix("ip:") {
            let addr = addr.split('/').next().unwrap_or(addr);
            return Some(self.ip_subject(addr.parse().ok()?).subject);
        }
        Some(
            principal_digests(
                Some(&Principal {
                    workspace: label.to_owned(),
                    user: String::new(),
                }),
                0,
            )
            .0,
        )
    }

    /// True when `peer` is a trusted proxy.
    pub fn trusts(&self, peer: IpAddr) -> bool {
        self.is_trusted(peer)
    }

    /// True when the credential `headers` send (the one [`Identity::caller`] reads)
    /// was revoked through the admin API. Work queued with it (a batch's items) is
    /// checked again with this before it goes upstream.
    pub fn revokes(&self, headers: &HeaderMap) -> bool {
        !self.revoked.is_empty()
            && self.credential(headers).is_some_and(|secret| {
                let sha: [u8; 32] = Sha256::digest(secret.as_bytes()).into();
                self.revoked.contains(&sha)
            })
    }

    fn credential<'h>(&'h self, headers: &'h HeaderMap) -> Option<Cow<'h, str>> {
        if let Some(counted) = self.counted
            && self.sends_in(counted, headers)
        {
            return self.read_credential(counted, headers);
        }
        self.credentials
            .iter()
            .find_map(|&source| self.read_credential(source, headers))
    }

    fn read_credential<'h>(
        &'h self,
        source: CredentialSource,
        headers: &'h HeaderMap,
    ) -> Option<Cow<'h, str>> {
        let field = match source {
            CredentialSource::ApiKeyHeader => headers
                .get(X_API_KEY)
                .and_then(|v| v.to_str().ok())
                .map(str::trim)
                .filter(|s| !s.is_empty()),
            CredentialSource::Bearer => headers
                .get(AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| {
                    // `Bearer <token>`; a tab after the scheme is read as the
                    // upstream's lenient parsers read it, never left uncounted.
                    let (scheme, token) = v.trim().split_once([' ', '\t'])?;
                    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
                })
                .filter(|s| !s.is_empty()),
            CredentialSource::SessionCookie => {
                return self
                    .session_pairs(headers)
                    .find_map(|pair| match pair {
                        cookie::Pair::Session(value) => Some(value),
                        _ => None,
                    })
                    .filter(|s| !s.is_empty());
            }
        };
        field.map(Cow::Borrowed)
    }
}

/// Keeps in the `Cookie` fields of `headers` only the `name=value` pairs that
/// `keep` takes (each given trimmed of the spaces around it), and drops a
/// field left with none: what a request forwarded upstream carries of its
/// cookies when some are sluice's to remove.
pub fn retain_cookies(headers: &mut HeaderMap, keep: impl Fn(&[u8]) -> bool) {
    let kept: Vec<HeaderValue> = headers
        .get_all(COOKIE)
        .iter()
        .filter_map(|v| {
            let rest: Vec<&[u8]> = v
                .as_bytes()
                .split(|&b| b == b';')
                .map(<[u8]>::trim_ascii)
                .filter(|pair| !pair.is_empty() && keep(pair))
                .collect();
            (!rest.is_empty())
                .then(|| HeaderValue::from_bytes(&rest.join(&b"; "[..])).ok())
                .flatten()
        })
        .collect();
    headers.remove(COOKIE);
    for v in kept {
        headers.append(COOKIE, v);
    }
}

/// The digest a caller of the workspace named `name` holds in [`Caller::workspace`].
pub fn workspace_digest(name: &str) -> u64 {
    digest(format!("ws:{name}").as_bytes())
}

fn principal_digests(principal: Option<&Principal>, own: u64) -> (u64, u64) {
    match principal {
        Some(p) => (
            workspace_digest(&p.workspace),
            digest(format!("user:{}", p.user).as_bytes()),
        ),
        None => (own, own),
    }
}

/// IPv4-mapped IPv6 addresses are their IPv4 selves.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// One `X-Forwarded-For` hop: an address, possibly `[v6]:port` or `v4:port`.
fn parse_hop(hop: &str) -> Option<IpAddr> {
    if let Ok(ip) = hop.parse::<IpAddr>() {
        return Some(ip);
    }
    if let Some(rest) = hop.strip_prefix('[') {
        return rest.split_once(']')?.0.parse().ok();
    }
    let (host, port) = hop.rsplit_once(':')?;
    port.parse::<u16>().ok()?;
    host.parse::<std::net::Ipv4Addr>().ok().map(IpAddr::V4)
}

#[cfg(test)]
mod tests {
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

    use proptest::prelude::*;

    use super::Who;

    /// The label as `core::fmt` writes it.
    fn formatted(who: &Who) -> String {
        match who {
            Who::Key(prefix) => format!("key:{}", hex::encode(prefix)),
            Who::Ip(addr, None) => format!("ip:{addr}"),
            Who::Ip(addr, Some(prefix)) => format!("ip:{addr}/{prefix}"),
        }
    }

    #[test]
    fn labels_at_the_edges_read_as_core_fmt_writes_them() {
        let v4 = |a, b, c, d| IpAddr::V4(Ipv4Addr::new(a, b, c, d));
        for who in [
            Who::Ip(v4(0, 9, 10, 99), None),
            Who::Ip(v4(100, 199, 200, 255), None),
            Who::Ip(v4(255, 255, 255, 255), Some(32)),
            Who::Ip(IpAddr::V6(Ipv6Addr::UNSPECIFIED), Some(0)),
            Who::Ip(
                IpAddr::V6(Ipv6Addr::new(
                    0xffff, 0xffff, 0xffff, 0xffff, 0xffff, 0xffff, 0xffff, 0xffff,
                )),
                Some(128),
            ),
            Who::Key([0, 0x0f, 0xf0, 0xff, 0x5a, 0xa5]),
        ] {
            assert_eq!(who.to_string(), formatted(&who));
        }
    }

    proptest! {
        #[test]
        fn every_label_reads_as_core_fmt_writes_it(
            v4 in any::<[u8; 4]>(),
            v6 in any::<[u16; 8]>(),
            prefix in proptest::option::of(0u8..=128),
            key in any::<[u8; 6]>(),
        ) {
            for who in [
                Who::Ip(IpAddr::V4(Ipv4Addr::from(v4)), prefix),
                Who::Ip(IpAddr::V6(Ipv6Addr::from(v6)), prefix),
                Who::Key(key),
            ] {
                prop_assert_eq!(who.to_string(), formatted(&who));
            }
        }
    }

    /// The judgement of `check_credentials` spelled out as three passes over the
    /// fields, each looking them up again (what it did before it read each kind
    /// once): the two must agree on every request.
    fn check_credentials_by_lookups(
        identity: &super::Identity,
        headers: &http::HeaderMap,
    ) -> Result<(), super::AmbiguousCredentials> {
        use super::{AmbiguousCredentials, CredentialSource, cookie};
        let fields = |name| headers.get_all(name).iter();
        let count = |source| match source {
            CredentialSource::ApiKeyHeader => fields("x-api-key").count(),
            CredentialSource::Bearer => fields("authorization").count(),
            CredentialSource::SessionCookie => identity
                .session_pairs(headers)
                .filter(cookie::Pair::is_session)
                .count(),
        };
        let malformed = |source| {
            let first = match source {
                CredentialSource::ApiKeyHeader => headers.get("x-api-key"),
                CredentialSource::Bearer => headers.get("authorization"),
                CredentialSource::SessionCookie => {
                    return identity
                        .session_pairs(headers)
                        .any(|p| p == cookie::Pair::Unreadable);
                }
            };
            match first.map(|v| v.to_str()) {
                None => false,
                Some(Err(_)) => true,
                Some(Ok(text)) if source == CredentialSource::ApiKeyHeader => {
                    text.trim().contains([' ', '\t'])
                }
                Some(Ok(text)) => {
                    let text = text.trim();
                    let (scheme, token) = text.split_once([' ', '\t']).unwrap_or((text, ""));
                    scheme.eq_ignore_ascii_case("bearer") && {
                        let token = token.trim();
                        token.is_empty() || token.contains([' ', '\t'])
                    }
                }
            }
        };
        for &s in &identity.credentials {
            let n = count(s);
            if n > 1 {
                return Err(AmbiguousCredentials {
                    sent_in: s,
                    count: n,
                    also: None,
                });
            }
        }
        for &s in &identity.credentials {
            if malformed(s) {
                return Err(AmbiguousCredentials {
                    sent_in: s,
                    count: 1,
                    also: None,
                });
            }
        }
        let present: Vec<_> = identity
            .credentials
            .iter()
            .copied()
            .filter(|&s| identity.sends_in(s, headers))
            .collect();
        match (present.first(), present.get(1), identity.counted) {
            (Some(_), Some(_), Some(c)) if identity.sends_in(c, headers) => Ok(()),
            (Some(&first), Some(&second), _) => Err(AmbiguousCredentials {
                sent_in: first,
                count: present.len(),
                also: Some(second),
            }),
            _ => Ok(()),
        }
    }

    proptest! {
        /// Any mix of the three kinds (none, one, two; readable or not), in any
        /// order of sources, with or without a counted one.
        #[test]
        fn check_credentials_reads_each_kind_once_and_judges_as_by_lookups(
            order in Just(vec![0usize, 1, 2]).prop_shuffle(),
            kinds in 1usize..=3,
            counted in proptest::option::of(0usize..3),
            api_keys in proptest::collection::vec(prop_oneof![Just("k1".to_owned()), Just(String::new()), Just("\u{e9}".to_owned())], 0..3),
            auths in proptest::collection::vec(prop_oneof![
                Just("Bearer t".to_owned()), Just("bearer  ".to_owned()), Just("Bearer a b".to_owned()),
                Just("Basic x".to_owned()), Just("Bearer\tt".to_owned()), Just(String::new()),
            ], 0..3),
            cookies in proptest::collection::vec(prop_oneof![
                Just("sid=abc".to_owned()), Just("other=1".to_owned()), Just("sid=\"a".to_owned()),
                Just("sid=1; sid=2".to_owned()), Just("a=1; sid=%zz".to_owned()),
            ], 0..3),
        ) {
            use super::CredentialSource as C;
            let all = [C::ApiKeyHeader, C::Bearer, C::SessionCookie];
            let identity = super::Identity {
                credentials: order[..kinds].iter().map(|&i| all[i]).collect(),
                counted: counted.map(|i| all[i]),
                session_cookie: "sid".to_owned(),
                trusted_proxies: Vec::new(),
                ipv6_prefix: 64,
                keys: Default::default(),
                revoked: Default::default(),
                principal_headers: None,
                plan_header: None,
            };
            let mut headers = http::HeaderMap::new();
            let value = |text: &str| http::HeaderValue::from_bytes(text.as_bytes());
            for (name, values) in [("x-api-key", &api_keys), ("authorization", &auths), ("cookie", &cookies)] {
                for v in values {
                    if let Ok(v) = value(v) {
                        headers.append(name, v);
                    }
                }
            }
            prop_assert_eq!(
                identity.check_credentials(&headers),
                check_credentials_by_lookups(&identity, &headers)
            );
        }
    }
}
