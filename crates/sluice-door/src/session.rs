//! Admin login sessions: what the login cookie holds, how long it lasts, and the
//! sessions a logout ended.
//!
//! The cookie's value is `v2.<issued>.<nonce>.<mac>`: the second it was issued
//! (Unix time), 16 random bytes, and an HMAC-SHA-256 of both under a key derived
//! from the admin token. It proves the token was given without being it, lasts
//! [`SESSION_SECONDS`] from its issue (a copy taken from a browser is worth half a
//! day, not until the token changes), and ends at a logout: the listener keeps the
//! nonces of ended sessions until they would have expired, at most
//! [`MAX_ENDED`]; past that bound every session is ended at once (a new
//! generation of the key), never one left valid. A new token ends every session.

use std::collections::HashMap;
use std::hash::{BuildHasher as _, RandomState};
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use sha2::{Digest as _, Sha256};

/// How long a login lasts.
pub const SESSION_SECONDS: u64 = 12 * 3600;

/// The most sessions ended by a logout that a listener remembers before it ends
/// them all.
pub const MAX_ENDED: usize = 4096;

/// How far ahead of this process's clock an issue time may be (another replica's
/// clock, a clock stepped back).
const AHEAD: u64 = 300;

const VERSION: &str = "v2";

/// A session as its cookie names it.
struct Presented {
    issued: u64,
    nonce: [u8; 16],
    mac: [u8; 32],
}

/// The sessions of one listener's token.
#[derive(Debug)]
pub(crate) struct Sessions {
    key: [u8; 32],
    generation: AtomicU64,
    ended: Mutex<HashMap<[u8; 16], u64>>,
    counter: AtomicU64,
    random: RandomState,
}

impl Sessions {
    /// The sessions of the token whose SHA-256 is `digest`.
    pub(crate) fn new(digest: &[u8; 32]) -> Self {
        let mut h = Sha256::new();
        h.update(b"sluice-door admin session v2\0");
        h.update(digest);
        Sessions {
            key: h.finalize().into(),
            generation: AtomicU64::new(0),
            ended: Mutex::new(HashMap::new()),
            counter: AtomicU64::new(0),
            random: RandomState::new(),
        }
    }

    /// A new session's cookie value, issued at `now` (Unix seconds).
    pub(crate) fn issue(&self, now: u64) -> String {
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        let mut nonce = [0u8; 16];
        nonce[..8].copy_from_slice(&self.random.hash_one((n, 0u8)).to_le_bytes());
        nonce[8..].copy_from_slice(&self.random.hash_one((n, 1u8)).to_le_bytes());
        let mac = self.mac(now, &nonce);
        format!(
            "{VERSION}.{now}.{}.{}",
            hex::encode(nonce),
            hex::encode(mac)
        )
    }

    /// Whether `value` is a live session at `now`: made with this token's key,
    /// neither expired nor ended.
    pub(crate) fn is_live(&self, value: &str, now: u64) -> bool {
        let Some(p) = parse(value) else {
            return false;
        };
        if !constant_time_eq(&self.mac(p.issued, &p.nonce), &p.mac) {
            return false;
        }
        if p.issued > now.saturating_add(AHEAD) || now >= p.issued.saturating_add(SESSION_SECONDS) {
            return false;
        }
        !self.ended.lock().contains_key(&p.nonce)
    }

    /// Ends the session `value` names, if it is live at `now`.
    pub(crate) fn end(&self, value: &str, now: u64) {
        if !self.is_live(value, now) {
            return;
        }
        let Some(p) = parse(value) else {
            return;
        };
        let mut ended = self.ended.lock();
        ended.retain(|_, expires| *expires > now);
        if ended.len() >= MAX_ENDED {
            // No room to remember it: every session ends, this one with them.
            ended.clear();
            self.generation.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(target: "sluice::audit", "admin sessions: {MAX_ENDED} logouts in {SESSION_SECONDS} s; every session ended");
            return;
        }
        ended.insert(p.nonce, p.issued.saturating_add(SESSION_SECONDS));
    }

    /// HMAC-SHA-256 of the session under the key of this generation.
    fn mac(&self, issued: u64, nonce: &[u8; 16]) -> [u8; 32] {
        let mut message = [0u8; 32];
        message[..8].copy_from_slice(&self.generation.load(Ordering::Relaxed).to_le_bytes());
        message[8..16].copy_from_slice(&issued.to_le_bytes());
        message[16..].copy_from_slice(nonce);
        hmac_sha256(&self.key, &message)
    }
}

/// `v2.<issued>.<32 hex>.<64 hex>`, or `None`.
fn parse(value: &str) -> Option<Presented> {
    let mut parts = value.split('.');
    if parts.next()? != VERSION {
        return None;
    }
    let issued = parts.next()?;
    if issued.is_empty() || issued.len() > 20 || !issued.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let issued = issued.parse().ok()?;
    let mut nonce = [0u8; 16];
    hex::decode_to_slice(parts.next()?, &mut nonce).ok()?;
    let mut mac = [0u8; 32];
    hex::decode_to_slice(parts.next()?, &mut mac).ok()?;
    if parts.next().is_some() {
        return None;
    }
    Some(Presented { issued, nonce, mac })
}

/// HMAC (RFC 2104) over SHA-256 with a 32-byte key.
fn hmac_sha256(key: &[u8; 32], message: &[u8]) -> [u8; 32] {
    let mut inner_pad = [0x36u8; 64];
    let mut outer_pad = [0x5cu8; 64];
    for (i, k) in key.iter().enumerate() {
        inner_pad[i] ^= k;
        outer_pad[i] ^= k;
    }
    let inner = Sha256::new()
        .chain_update(inner_pad)
        .chain_update(message)
        .finalize();
    Sha256::new()
        .chain_update(outer_pad)
        .chain_update(inner)
        .finalize()
        .into()
}

/// Equal bytes, in time independent of where they differ.
pub(crate) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: u64 = 1_780_000_000;

    fn sessions() -> Sessions {
        Sessions::new(&Sha256::digest(b"admin-token").into())
    }

    #[test]
    fn hmac_matches_rfc_4231_case_2_shape() {
        // RFC 4231 test case 2 has a 4-byte key; with a 32-byte key padded by
        // zeros the HMAC is the same (keys shorter than the block are padded).
        let mut key = [0u8; 32];
        key[..4].copy_from_slice(b"Jefe");
        assert_eq!(
            hex::encode(hmac_sha256(&key, b"what do ya want for nothing?")),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }

    /// SPEC S3: a login cookie lasts half a day from its issue, ends at its
    /// logout (another session going on), and is never made without the token.
    #[test]
    fn s3_a_session_expires_ends_at_logout_and_cannot_be_forged() {
        let s = sessions();
        let one = s.issue(T0);
        let two = s.issue(T0);
        assert_ne!(one, two, "each login its own session");
        assert!(s.is_live(&one, T0) && s.is_live(&one, T0 + SESSION_SECONDS - 1));
        assert!(!s.is_live(&one, T0 + SESSION_SECONDS), "expired");
        assert!(!s.is_live(&one, T0 - AHEAD - 1), "issued in the future");
        s.end(&one, T0 + 10);
        assert!(!s.is_live(&one, T0 + 11), "ended at its logout");
        assert!(s.is_live(&two, T0 + 11), "the other session goes on");
        // Another token's sessions, a changed issue time, a changed nonce: refused.
        let other = Sessions::new(&Sha256::digest(b"other-token").into());
        assert!(!s.is_live(&other.issue(T0), T0));
        let later = two.replacen(&format!(".{T0}."), &format!(".{}.", T0 + 3600), 1);
        assert!(!s.is_live(&later, T0 + 11), "its issue time is in the mac");
        for bad in [
            "",
            "v2",
            "v1.abc",
            &format!("v2.{T0}.00.00"),
            &format!("{two}.x"),
        ] {
            assert!(!s.is_live(bad, T0), "{bad:?}");
        }
    }

    #[test]
    fn s3_past_the_bound_of_ended_sessions_every_session_ends() {
        let s = sessions();
        let kept = s.issue(T0);
        for _ in 0..=MAX_ENDED {
            let v = s.issue(T0);
            s.end(&v, T0 + 1);
            assert!(!s.is_live(&v, T0 + 1));
        }
        assert!(!s.is_live(&kept, T0 + 2), "no room to remember: all ended");
        let fresh = s.issue(T0 + 2);
        assert!(s.is_live(&fresh, T0 + 2), "a new login works");
        // Ended sessions are forgotten once they would have expired.
        let s = sessions();
        for i in 0..MAX_ENDED as u64 {
            let v = s.issue(T0 + i);
            s.end(&v, T0 + i);
        }
        let kept = s.issue(T0 + SESSION_SECONDS + MAX_ENDED as u64);
        let late = s.issue(T0 + SESSION_SECONDS + MAX_ENDED as u64);
        s.end(&late, T0 + SESSION_SECONDS + MAX_ENDED as u64);
        assert!(s.is_live(&kept, T0 + SESSION_SECONDS + MAX_ENDED as u64));
    }
}
