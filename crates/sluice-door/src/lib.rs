//! The doors of sluice's listeners: which requests an admin listener takes, and what a
//! local proxy that adds a secret forwards, decided from the request head alone
//! (SPEC S2–S4).
//!
//! - [`HostRule`]: `Host` must be an address of the listener, `localhost` or an allowed
//!   name (DNS rebinding → 421).
//! - [`same_origin`], [`json_or_empty`]: a change (any method but GET/HEAD) only from
//!   the listener's own origin (403 otherwise) and as JSON (415 otherwise).
//! - [`AdminToken`], [`Door`]: with a token, every request carries it (`Authorization:
//!   Bearer`, or the login cookie); ten wrong ones a minute and the address waits.
//! - [`guard`]: all of it as an axum middleware; [`ProxyGate`] for the pacer proxy.
//! - [`serve`]: a listener's loop within [`Bounds`] (open connections, the wait for
//!   a request head; [`ADMIN_BOUNDS`] for an admin listener); [`accept_within`]: every
//!   listener's one bounded accept, with [`PerAddress`] (at most so many connections
//!   from one address, trusted proxies aside); [`FirstWords`]: a connection whose
//!   first bytes (an HTTP/2 handshake) must come in time, or it is closed.
//!
//! ```
//! use std::time::Instant;
//! use http::{HeaderMap, HeaderValue, Method};
//! use sluice_door::{Door, DoorConfig, Refusal};
//!
//! let door = Door::new("127.0.0.1:9090".parse().unwrap(), DoorConfig::default());
//! let now = Instant::now();
//! // curl from the machine: no Origin, no body.
//! let curl = HeaderMap::new();
//! assert!(door.check(&Method::POST, "/quotas/reset", &curl, Some("127.0.0.1:9090"), None, now).is_ok());
//! // A page elsewhere posting a form at it.
//! let mut page = HeaderMap::new();
//! page.insert("origin", HeaderValue::from_static("http://evil.example"));
//! let refused = door.check(&Method::POST, "/quotas/reset", &page, Some("127.0.0.1:9090"), None, now);
//! assert!(matches!(refused, Err(Refusal::ForeignOrigin(_))));
//! // A page that rebound its own name to 127.0.0.1, reading.
//! let read = door.check(&Method::GET, "/status", &curl, Some("evil.example:9090"), None, now);
//! assert_eq!(read.unwrap_err().status(), 421);
//! ```

mod door;
mod first_words;
mod guard;
mod host;
mod listener;
mod origin;
mod per_address;
mod proxy;
mod session;
mod token;

pub use door::{
    Door, DoorConfig, Entrant, LOGIN_PATH, LOGOUT_PATH, Refusal, bearer, changes_state,
};
pub use first_words::{FirstWords, HTTP2_HANDSHAKE_BYTES};
pub use guard::{authority, guard, peer, refused};
pub use host::HostRule;
pub use listener::{ADMIN_BOUNDS, Bounds, Place, accept_within, serve, serve_over};
pub use origin::{ForeignOrigin, SEC_FETCH_SITE, json_or_empty, origin_listed, same_origin};
pub use per_address::{AddressFull, AddressSlot, PerAddress};
pub use proxy::{ClientKey, ProxyGate, X_API_KEY};
pub use session::{MAX_ENDED, SESSION_SECONDS};
pub use token::{ATTEMPT_WINDOW, AdminToken, Attempts, MAX_BAD_ATTEMPTS, TOKEN_ENV, TokenError};

/// A header map of `fields`, for the tests.
#[cfg(test)]
pub(crate) fn test_headers(fields: &[(&'static str, &'static str)]) -> http::HeaderMap {
    let mut h = http::HeaderMap::new();
    for (k, v) in fields {
        h.append(*k, http::HeaderValue::from_static(v));
    }
    h
}

/// Whether an admin listener on `addr` needs a token: every address but loopback.
pub fn needs_token(addr: std::net::SocketAddr) -> bool {
    !addr.ip().is_loopback()
}
