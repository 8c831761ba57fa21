//! The door of a local proxy that adds a secret to what it forwards (`sluice pace`
//! adds the provider's key): it forwards nothing a web page sent. A request with an
//! `Origin` is a page's, and is refused unless that origin is listed; a foreign
//! `Host` is DNS rebinding; and the operator may require a key of the caller.

use http::HeaderMap;
use http::header::{AUTHORIZATION, ORIGIN};
use sha2::{Digest as _, Sha256};

use crate::door::{Refusal, bearer};
use crate::host::HostRule;
use crate::origin::{SEC_FETCH_SITE, origin_listed};

/// A key a caller of the proxy may present, kept as its SHA-256 digest (configs list
/// `sha256:<hex>` or the bare 64 hex digits: `printf %s "$KEY" | sha256sum`).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct ClientKey([u8; 32]);

impl std::fmt::Debug for ClientKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ClientKey(sha256:{}…)", hex::encode(&self.0[..4]))
    }
}

impl ClientKey {
    /// A key from its digest's hex (`sha256:` prefix optional); `None` when it is not
    /// 64 hex digits.
    pub fn parse(text: &str) -> Option<Self> {
        let hex_text = text.trim();
        let hex_text = hex_text.strip_prefix("sha256:").unwrap_or(hex_text);
        let mut digest = [0u8; 32];
        hex::decode_to_slice(hex_text, &mut digest).ok()?;
        Some(ClientKey(digest))
    }

    /// The key whose text is `key` (for tests and tools).
    pub fn of(key: &str) -> Self {
        ClientKey(Sha256::digest(key.as_bytes()).into())
    }

    fn matches(&self, digest: &[u8; 32]) -> bool {
        self.0
            .iter()
            .zip(digest)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
    }
}

/// What the proxy's door lets through.
#[derive(Clone, Copy, Debug)]
pub struct ProxyGate<'a> {
    /// The names and addresses `Host` may carry.
    pub hosts: &'a HostRule,
    /// Origins of pages allowed to call the proxy (`pacer.allowedOrigins`).
    pub allowed_origins: &'a [String],
    /// Keys a caller must present one of, if any (`pacer.clientKeys`).
    pub client_keys: &'a [ClientKey],
}

/// The header SDKs of Anthropic-style APIs send their key in.
pub const X_API_KEY: &str = "x-api-key";

impl ProxyGate<'_> {
    /// Checks a request to the proxy, whatever its method.
    ///
    /// # Errors
    /// 421 for a foreign `Host`; 403 for an `Origin` not listed; 401 when client keys
    /// are required and the request carries none of them (`Authorization: Bearer` or
    /// `x-api-key`).
    pub fn check(&self, headers: &HeaderMap, authority: Option<&str>) -> Result<(), Refusal> {
        let host = authority.unwrap_or("");
        if !self.hosts.allows(host) {
            return Err(Refusal::MisdirectedHost(host.chars().take(200).collect()));
        }
        let mut listed = false;
        for origin in headers.get_all(ORIGIN) {
            let text = origin.to_str().unwrap_or("");
            if !origin_listed(text, self.allowed_origins) {
                return Err(Refusal::UnlistedOrigin(format!(
                    "Origin: {}",
                    text.chars().take(200).collect::<String>()
                )));
            }
            listed = true;
        }
        // A page's image or link GET carries no Origin, but the browser says where it
        // comes from.
        if !listed && let Some(site) = headers.get(SEC_FETCH_SITE) {
            let site = site.to_str().unwrap_or("");
            if !site.eq_ignore_ascii_case("same-origin") && !site.eq_ignore_ascii_case("none") {
                return Err(Refusal::UnlistedOrigin(format!("Sec-Fetch-Site: {site}")));
            }
        }
        if self.client_keys.is_empty() {
            return Ok(());
        }
        let presented = headers
            .get_all(AUTHORIZATION)
            .iter()
            .filter_map(|v| v.to_str().ok().and_then(bearer))
            .chain(
                headers
                    .get_all(X_API_KEY)
                    .iter()
                    .filter_map(|v| v.to_str().ok().map(str::trim)),
            )
            .map(|k| -> [u8; 32] { Sha256::digest(k.as_bytes()).into() })
            .collect::<Vec<_>>();
        if presented
            .iter()
            .any(|d| self.client_keys.iter().any(|k| k.matches(d)))
        {
            return Ok(());
        }
        Err(Refusal::Unauthorized {
            wrong: !presented.is_empty(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_headers as headers;

    #[test]
    fn s4_the_proxy_forwards_nothing_a_page_sent() {
        let hosts = HostRule::new(
            "127.0.0.1:8088".parse().expect("an address"),
            ["host.docker.internal"],
        );
        let allowed = vec!["http://localhost:3000".to_owned()];
        let gate = ProxyGate {
            hosts: &hosts,
            allowed_origins: &allowed,
            client_keys: &[],
        };
        let host = Some("127.0.0.1:8088");
        assert!(gate.check(&headers(&[]), host).is_ok());
        assert!(
            gate.check(&headers(&[]), Some("host.docker.internal:8088"))
                .is_ok()
        );
        assert!(
            gate.check(&headers(&[("origin", "http://localhost:3000")]), host)
                .is_ok()
        );
        assert_eq!(
            gate.check(&headers(&[("origin", "http://evil.example")]), host)
                .map_err(|r| r.status().as_u16()),
            Err(403)
        );
        assert_eq!(
            gate.check(&headers(&[("origin", "null")]), host)
                .map_err(|r| r.status().as_u16()),
            Err(403)
        );
        assert_eq!(
            gate.check(&headers(&[]), Some("evil.example:8088"))
                .map_err(|r| r.status().as_u16()),
            Err(421)
        );
        assert_eq!(
            gate.check(&headers(&[]), None)
                .map_err(|r| r.status().as_u16()),
            Err(421)
        );
    }

    #[test]
    fn s4_client_keys_when_listed_are_required() {
        let hosts = HostRule::new("127.0.0.1:8088".parse().expect("an address"), [""; 0]);
        let keys = [
            ClientKey::of("team-key"),
            ClientKey::parse(&format!("sha256:{}", "ab".repeat(32))).expect("hex"),
        ];
        let gate = ProxyGate {
            hosts: &hosts,
            allowed_origins: &[],
            client_keys: &keys,
        };
        let host = Some("localhost:8088");
        assert!(
            gate.check(&headers(&[("authorization", "Bearer team-key")]), host)
                .is_ok()
        );
        assert!(
            gate.check(&headers(&[("x-api-key", "team-key")]), host)
                .is_ok()
        );
        assert_eq!(
            gate.check(&headers(&[]), host),
            Err(Refusal::Unauthorized { wrong: false })
        );
        assert_eq!(
            gate.check(&headers(&[("authorization", "Bearer other")]), host),
            Err(Refusal::Unauthorized { wrong: true })
        );
        assert!(ClientKey::parse("xyz").is_none());
        assert!(!format!("{:?}", keys[0]).contains("team-key"));
    }
}
