//! Request ids: the `X-Request-Id` a request is logged under, passed to the upstream
//! and returned to the client. A client's own id is kept when it is sane (at most
//! [`MAX_REQUEST_ID_LEN`] visible ASCII characters, sent once); otherwise the gateway
//! makes one from a random per-process prefix and a counter (no allocation).

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use http::HeaderName;
use http::header::HeaderValue;

/// `X-Request-Id`.
pub const X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// The longest client request id kept; a longer one is replaced.
pub const MAX_REQUEST_ID_LEN: usize = 64;

/// Hex digits of the per-process prefix of a generated id.
const PREFIX_LEN: usize = 12;

/// A request id, held inline (no allocation).
#[derive(Clone, Copy)]
pub struct RequestId {
    bytes: [u8; MAX_REQUEST_ID_LEN],
    len: u8,
}

impl std::fmt::Debug for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::fmt::Display for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl PartialEq for RequestId {
    fn eq(&self, other: &Self) -> bool {
        self.as_bytes() == other.as_bytes()
    }
}

impl Eq for RequestId {}

/// The per-process prefix: random hex digits, drawn once.
fn prefix() -> &'static [u8; PREFIX_LEN] {
    static PREFIX: OnceLock<[u8; PREFIX_LEN]> = OnceLock::new();
    PREFIX.get_or_init(|| {
        use std::hash::{BuildHasher as _, Hasher as _};
        // std's hasher keys are drawn from the system's random source.
        let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
        hasher.write_u32(std::process::id());
        let random = hasher.finish();
        let mut out = [0u8; PREFIX_LEN];
        for (i, b) in out.iter_mut().enumerate() {
            *b = HEX[((random >> (4 * i)) & 0xf) as usize];
        }
        out
    })
}

const HEX: &[u8; 16] = b"0123456789abcdef";

impl RequestId {
    /// A client's id when it is sane: 1 to [`MAX_REQUEST_ID_LEN`] visible ASCII
    /// characters (`!` to `~`, no spaces or controls).
    pub fn from_client(value: &[u8]) -> Option<RequestId> {
        if value.is_empty()
            || value.len() > MAX_REQUEST_ID_LEN
            || !value.iter().all(|b| (0x21..=0x7e).contains(b))
        {
            return None;
        }
        let mut bytes = [0u8; MAX_REQUEST_ID_LEN];
        bytes[..value.len()].copy_from_slice(value);
        Some(RequestId {
            bytes,
            len: value.len() as u8,
        })
    }

    /// A new id: this process's random prefix, `-`, and a counter in hex.
    pub fn generate() -> RequestId {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let mut bytes = [0u8; MAX_REQUEST_ID_LEN];
        bytes[..PREFIX_LEN].copy_from_slice(prefix());
        bytes[PREFIX_LEN] = b'-';
        let digits = (64 - n.leading_zeros()).div_ceil(4).max(1) as usize;
        let start = PREFIX_LEN + 1;
        for i in 0..digits {
            let shift = 4 * (digits - 1 - i);
            bytes[start + i] = HEX[((n >> shift) & 0xf) as usize];
        }
        RequestId {
            bytes,
            len: (start + digits) as u8,
        }
    }

    /// The id for a request that sent `values` as its `X-Request-Id` fields: the
    /// client's when it sent exactly one and it is sane, else a new one.
    pub fn pick<'v>(mut values: impl Iterator<Item = &'v [u8]>) -> RequestId {
        match (values.next(), values.next()) {
            (Some(one), None) => Self::from_client(one).unwrap_or_else(Self::generate),
            _ => Self::generate(),
        }
    }

    /// The id's bytes (visible ASCII).
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len)]
    }

    /// The id.
    pub fn as_str(&self) -> &str {
        // Only visible ASCII is ever stored.
        std::str::from_utf8(self.as_bytes()).unwrap_or("-")
    }

    /// The id as a header value.
    pub fn header_value(&self) -> HeaderValue {
        HeaderValue::from_bytes(self.as_bytes()).unwrap_or_else(|_| HeaderValue::from_static("-"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sane_client_id_is_kept() {
        let id = RequestId::pick([&b"abc-123_XYZ:./~"[..]].into_iter());
        assert_eq!(id.as_str(), "abc-123_XYZ:./~");
        let longest = [b'a'; MAX_REQUEST_ID_LEN];
        assert_eq!(
            RequestId::pick([&longest[..]].into_iter()).as_bytes(),
            &longest[..]
        );
    }

    #[test]
    fn an_id_that_is_not_sane_is_replaced() {
        let long = [b'a'; MAX_REQUEST_ID_LEN + 1];
        for bad in [
            &b""[..],
            b"has space",
            b"tab\there",
            b"\x7f",
            "é".as_bytes(),
            &long,
        ] {
            let id = RequestId::pick([bad].into_iter());
            assert_ne!(id.as_bytes(), bad);
            assert_eq!(&id.as_bytes()[..PREFIX_LEN], prefix());
        }
        // Sent twice: neither is believed.
        let id = RequestId::pick([&b"a"[..], b"a"].into_iter());
        assert_ne!(id.as_str(), "a");
    }

    #[test]
    fn generated_ids_differ_and_share_the_prefix() {
        let a = RequestId::generate();
        let b = RequestId::generate();
        assert_ne!(a, b);
        assert_eq!(a.as_bytes()[..PREFIX_LEN], b.as_bytes()[..PREFIX_LEN]);
        assert!(a.as_bytes().iter().all(|b| b.is_ascii_graphic()));
        assert!(RequestId::from_client(a.as_bytes()).is_some());
    }
}
