//! `identity:`: where a caller's credential is read, which proxies are trusted,
//! the key table and the principal headers.

use std::collections::HashMap;

use http::HeaderName;
use ipnet::IpNet;

use crate::model::{CredentialSource, Identity, Principal};
use crate::raw::RawPolicy;

use super::{Checker, is_workspace_name};

impl Checker {
    /// `identity:`, checked, with the built-in defaults for what is left out.
    pub(super) fn identity(&mut self, raw: &RawPolicy) -> Option<Identity> {
        let id = &raw.identity;
        let sources = id
            .credentials
            .clone()
            .unwrap_or_else(|| vec!["x_api_key".into(), "bearer".into(), "session_cookie".into()]);
        let mut credentials = Vec::new();
        for (i, s) in sources.iter().enumerate() {
            match s.as_str() {
                "x_api_key" => credentials.push(CredentialSource::ApiKeyHeader),
                "bearer" => credentials.push(CredentialSource::Bearer),
                "session_cookie" => credentials.push(CredentialSource::SessionCookie),
                other => self.problem(
                    format!("identity.credentials[{i}]"),
                    format!("expected x_api_key, bearer or session_cookie, got {other:?}"),
                ),
            }
        }
        let counted = match id.counted_credential.as_deref() {
            None => None,
            Some(name) => {
                let source = match name {
                    "x_api_key" => Some(CredentialSource::ApiKeyHeader),
                    "bearer" => Some(CredentialSource::Bearer),
                    "session_cookie" => Some(CredentialSource::SessionCookie),
                    _ => None,
                };
                match source {
                    Some(s) if credentials.contains(&s) => Some(s),
                    _ => {
                        self.problem(
                            "identity.counted_credential".to_owned(),
                            format!("expected one of identity.credentials, got {name:?}"),
                        );
                        None
                    }
                }
            }
        };
        let mut trusted_proxies = Vec::new();
        for (i, c) in id.trusted_proxies.iter().enumerate() {
            let parsed = c
                .parse::<IpNet>()
                .or_else(|_| c.parse::<std::net::IpAddr>().map(IpNet::from));
            match parsed {
                Ok(net) => trusted_proxies.push(net),
                Err(_) => self.problem(
                    format!("identity.trusted_proxies[{i}]"),
                    format!("expected an IP address or CIDR such as 10.0.0.0/8, got {c:?}"),
                ),
            }
        }
        let ipv6_prefix = id.ipv6_prefix.unwrap_or(64);
        if ipv6_prefix == 0 || ipv6_prefix > 128 {
            self.problem(
                "identity.ipv6_prefix",
                format!("expected 1..=128, got {ipv6_prefix}"),
            );
        }
        let mut keys = HashMap::new();
        for (i, k) in id.keys.iter().enumerate() {
            for (field, name) in [("workspace", &k.workspace), ("user", &k.user)] {
                if !is_workspace_name(name) {
                    self.problem(
                        format!("identity.keys[{i}].{field}"),
                        format!("expected printable ASCII not starting with `key:` or `ip:` (it is sent upstream as a header), got {name:?}"),
                    );
                }
            }
            let mut digest = [0u8; 32];
            match hex::decode_to_slice(&k.sha256, &mut digest) {
                Ok(()) => {
                    if keys
                        .insert(
                            digest,
                            Principal {
                                workspace: k.workspace.clone(),
                                user: k.user.clone(),
                            },
                        )
                        .is_some()
                    {
                        self.problem(format!("identity.keys[{i}].sha256"), "listed twice");
                    }
                }
                Err(_) => self.problem(
                    format!("identity.keys[{i}].sha256"),
                    "expected 64 hex digits: the SHA-256 of the credential (e.g. `printf %s KEY | sha256sum`)",
                ),
            }
        }
        let principal_headers = id.principal_headers.as_ref().and_then(|h| {
            match (
                HeaderName::try_from(h.workspace.as_str()),
                HeaderName::try_from(h.user.as_str()),
            ) {
                (Ok(w), Ok(u)) => Some((w, u)),
                _ => {
                    self.problem("identity.principal_headers", "expected valid header names");
                    None
                }
            }
        });
        let plan_header = id
            .principal_headers
            .as_ref()
            .and_then(|h| h.plan.as_deref())
            .and_then(|name| match HeaderName::try_from(name) {
                Ok(h) => Some(h),
                Err(_) => {
                    self.problem(
                        "identity.principal_headers.plan",
                        "expected a valid header name",
                    );
                    None
                }
            });
        if principal_headers.is_some() && trusted_proxies.is_empty() {
            self.problem(
                "identity.principal_headers",
                "believed only from trusted proxies: list them under identity.trusted_proxies",
            );
        }
        Some(Identity {
            credentials,
            counted,
            session_cookie: id
                .session_cookie
                .clone()
                .unwrap_or_else(|| "session".to_owned()),
            trusted_proxies,
            ipv6_prefix,
            keys,
            revoked: std::collections::HashSet::new(),
            principal_headers,
            plan_header,
        })
    }
}
