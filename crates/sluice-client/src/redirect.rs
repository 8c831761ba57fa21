//! Where a request that carries a provider's key may be redirected: only
//! within the origin it was sent to (documented on [`same_origin_redirects`]).

use reqwest::Url;
use reqwest::redirect::{Attempt, Policy};

/// The most redirects followed for one request, all within its origin; the
/// next one is the answer, as the provider sent it.
pub const MAX_REDIRECTS: usize = 5;

/// A redirect policy that keeps a provider's key with the provider: a
/// redirect is followed only to the origin (scheme, host, port) the request
/// was first sent to, at most [`MAX_REDIRECTS`] times; any other redirect —
/// another host, another port, `http` for `https` or the reverse — is
/// answered as the provider sent it (status and `Location`), and nothing is
/// sent there.
///
/// reqwest's own policy follows a redirect to another host and strips only
/// `Authorization` (and cookies) on the way: a key in `x-api-key`,
/// `api-key`, `x-goog-api-key` or any `authHeader` would go along. The
/// `sluice pace` proxy uses this policy; give it to the client under a
/// [`PacerMiddleware`](crate::PacerMiddleware) too, since the middleware adds
/// a key (`apiKeys`) to requests the client then sends:
///
/// ```
/// let client = reqwest::Client::builder()
///     .redirect(sluice_client::same_origin_redirects())
///     .build()?;
/// # Ok::<(), reqwest::Error>(())
/// ```
pub fn same_origin_redirects() -> Policy {
    Policy::custom(follow_within_origin)
}

fn follow_within_origin(attempt: Attempt<'_>) -> reqwest::redirect::Action {
    let previous = attempt.previous();
    let within = previous.len() <= MAX_REDIRECTS
        && previous
            .first()
            .is_some_and(|first| same_origin(first, attempt.url()));
    if within {
        attempt.follow()
    } else {
        attempt.stop()
    }
}

/// Whether `a` and `b` have one origin: scheme, host and port (a port left
/// out is the scheme's own).
pub(crate) fn same_origin(a: &Url, b: &Url) -> bool {
    a.scheme() == b.scheme()
        && a.host_str() == b.host_str()
        && a.port_or_known_default() == b.port_or_known_default()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::same_origin;
    use reqwest::Url;

    #[test]
    fn s4_an_origin_is_scheme_host_and_port() {
        let u = |s: &str| Url::parse(s).unwrap();
        let home = u("https://api.example.test/v1/chat");
        assert!(same_origin(&home, &u("https://api.example.test/v2/x?y=1")));
        assert!(same_origin(&home, &u("https://API.example.test:443/")));
        for other in [
            "http://api.example.test/v1/chat",
            "https://api.example.test:8443/v1/chat",
            "https://example.test/v1/chat",
            "https://api.example.test.evil.test/v1/chat",
            "https://user@evil.test/v1/chat",
        ] {
            assert!(!same_origin(&home, &u(other)), "{other}");
        }
        let local = u("http://127.0.0.1:8080/v1");
        assert!(!same_origin(&local, &u("http://localhost:8080/v1")));
        assert!(!same_origin(&local, &u("http://127.0.0.1:8081/v1")));
    }
}
