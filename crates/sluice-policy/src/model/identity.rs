//! Where credentials are read and who they belong to.

use std::collections::HashMap;

use ipnet::IpNet;

/// Where a credential is read from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CredentialSource {
    /// `X-API-Key: <key>`.
    ApiKeyHeader,
    /// `Authorization: Bearer <token>`.
    Bearer,
    /// The console session cookie.
    SessionCookie,
}

impl CredentialSource {
    /// How many kinds there are.
    pub const KINDS: usize = 3;

    /// This kind's place among the [`CredentialSource::KINDS`] (for a table by kind).
    pub const fn index(self) -> usize {
        match self {
            CredentialSource::ApiKeyHeader => 0,
            CredentialSource::Bearer => 1,
            CredentialSource::SessionCookie => 2,
        }
    }
}

/// Who a known credential belongs to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Principal {
    /// The workspace.
    pub workspace: String,
    /// The user.
    pub user: String,
}

/// Identity settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    /// Credential sources, in order.
    pub credentials: Vec<CredentialSource>,
    /// The source counted when a request sends several kinds of credential (the
    /// others are stripped before forwarding); `None`: such a request is refused.
    pub counted: Option<CredentialSource>,
    /// The session cookie's name.
    pub session_cookie: String,
    /// Proxies whose `X-Forwarded-For` is believed.
    pub trusted_proxies: Vec<IpNet>,
    /// IPv6 callers are grouped by this prefix for IP budgets.
    pub ipv6_prefix: u8,
    /// SHA-256 of a credential → its principal.
    pub keys: HashMap<[u8; 32], Principal>,
    /// SHA-256 of the credentials revoked at run time: refused (403), never counted
    /// as a caller of their own.
    pub revoked: std::collections::HashSet<[u8; 32]>,
    /// Headers a trusted auth layer sets: (workspace, user).
    pub principal_headers: Option<(http::HeaderName, http::HeaderName)>,
    /// The header a trusted auth layer names the workspace's plan in (with
    /// `principal_headers`): over the tenant table's plan for the request.
    pub plan_header: Option<http::HeaderName>,
}
