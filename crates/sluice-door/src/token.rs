//! The admin token: read once from a file (or the environment), compared in constant
//! time, never kept in a form a log or a cookie could give back; and the book of
//! wrong tokens per address that refuses a guesser at once.

use std::collections::HashMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use sha2::{Digest as _, Sha256};

/// The environment variable that may hold the admin token instead of a file.
pub const TOKEN_ENV: &str = "SLUICE_ADMIN_TOKEN";

/// Longest token file read (a token is one line).
const MAX_TOKEN_FILE: u64 = 4096;

/// Wrong tokens one address may send in [`ATTEMPT_WINDOW`] before it is refused at once.
pub const MAX_BAD_ATTEMPTS: u32 = 10;

/// The window [`MAX_BAD_ATTEMPTS`] counts in.
pub const ATTEMPT_WINDOW: Duration = Duration::from_secs(60);

/// Most addresses the book of wrong tokens remembers.
const MAX_ADDRESSES: usize = 16_384;

/// Why a token could not be had.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TokenError {
    /// The file could not be read (missing, not a file, unreadable).
    #[error("{}: {source}", path.display())]
    Unreadable {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file or variable holds no token.
    #[error("{0} holds no token")]
    Empty(String),
    /// Others may read the file.
    #[error("{} may be read by every user (mode {mode:o}): chmod 600 it", path.display())]
    WorldReadable {
        /// The file.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// The file is larger than a token.
    #[error("{} is larger than {MAX_TOKEN_FILE} bytes: not a token", path.display())]
    TooLarge {
        /// The file.
        path: PathBuf,
    },
}

/// An admin token, kept as its SHA-256 digest.
#[derive(Clone, PartialEq, Eq)]
pub struct AdminToken {
    digest: [u8; 32],
}

impl std::fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AdminToken(..)")
    }
}

impl AdminToken {
    /// A token from its text (surrounding whitespace removed).
    ///
    /// # Errors
    /// [`TokenError::Empty`] when nothing is left, naming `source`.
    pub fn new(text: &str, source: &str) -> Result<Self, TokenError> {
        let text = text.trim();
        if text.is_empty() {
            return Err(TokenError::Empty(source.to_owned()));
        }
        Ok(AdminToken {
            digest: Sha256::digest(text.as_bytes()).into(),
        })
    }

    /// The token in `path`: its first line, trimmed.
    ///
    /// # Errors
    /// The file is missing or unreadable, empty, larger than a token, or readable by
    /// every user of the machine (on Unix).
    pub fn from_file(path: &Path) -> Result<Self, TokenError> {
        let unreadable = |source| TokenError::Unreadable {
            path: path.to_owned(),
            source,
        };
        let meta = std::fs::metadata(path).map_err(unreadable)?;
        if !meta.is_file() {
            return Err(unreadable(std::io::Error::other("not a file")));
        }
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt as _;
            let mode = meta.permissions().mode() & 0o777;
            if mode & 0o004 != 0 {
                return Err(TokenError::WorldReadable {
                    path: path.to_owned(),
                    mode,
                });
            }
        }
        if meta.len() > MAX_TOKEN_FILE {
            return Err(TokenError::TooLarge {
                path: path.to_owned(),
            });
        }
        let text = std::fs::read_to_string(path).map_err(unreadable)?;
        let line = text.lines().next().unwrap_or("");
        Self::new(line, &path.display().to_string())
    }

    /// The token in [`TOKEN_ENV`], if the variable is set.
    ///
    /// # Errors
    /// [`TokenError::Empty`] when it is set to nothing but whitespace.
    pub fn from_env() -> Result<Option<Self>, TokenError> {
        match std::env::var(TOKEN_ENV) {
            Ok(v) => Self::new(&v, TOKEN_ENV).map(Some),
            Err(_) => Ok(None),
        }
    }

    /// Whether `presented` is this token (in time independent of where they differ).
    pub fn matches(&self, presented: &str) -> bool {
        let other: [u8; 32] = Sha256::digest(presented.trim().as_bytes()).into();
        crate::session::constant_time_eq(&self.digest, &other)
    }

    /// The sessions of this token's login cookies.
    pub(crate) fn sessions(&self) -> crate::session::Sessions {
        crate::session::Sessions::new(&self.digest)
    }
}

/// Wrong tokens per address in the current window, bounded.
#[derive(Debug, Default)]
pub struct Attempts {
    book: HashMap<IpAddr, (Instant, u32)>,
}

impl Attempts {
    /// How long `peer` is still refused at once, if it sent
    /// [`MAX_BAD_ATTEMPTS`] wrong tokens in this window.
    pub fn blocked(&self, peer: IpAddr, now: Instant) -> Option<Duration> {
        let (since, count) = *self.book.get(&peer)?;
        let left = (since + ATTEMPT_WINDOW).checked_duration_since(now)?;
        (count >= MAX_BAD_ATTEMPTS && !left.is_zero()).then_some(left)
    }

    /// Counts one wrong token from `peer`.
    pub fn failed(&mut self, peer: IpAddr, now: Instant) {
        if self.book.len() >= MAX_ADDRESSES && !self.book.contains_key(&peer) {
            self.book
                .retain(|_, (since, _)| now.saturating_duration_since(*since) < ATTEMPT_WINDOW);
            if self.book.len() >= MAX_ADDRESSES {
                // Every remembered address is in its window: the newcomer's first
                // wrong token is not remembered, which blocks no one who is not
                // guessing; guessers already in the book stay blocked.
                return;
            }
        }
        let entry = self.book.entry(peer).or_insert((now, 0));
        if now.saturating_duration_since(entry.0) >= ATTEMPT_WINDOW {
            *entry = (now, 0);
        }
        entry.1 = entry.1.saturating_add(1);
    }

    /// Addresses remembered now.
    pub fn len(&self) -> usize {
        self.book.len()
    }

    /// Whether no address is remembered.
    pub fn is_empty(&self) -> bool {
        self.book.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn s3_a_token_matches_itself_only() {
        let t = AdminToken::new(" s3cret\n", "test").expect("a token");
        assert!(t.matches("s3cret"));
        assert!(!t.matches("s3cre"));
        assert!(!t.matches(""));
        assert!(!format!("{t:?}").contains("s3cret"));
        assert!(matches!(AdminToken::new(" \n", "X"), Err(TokenError::Empty(s)) if s == "X"));
    }

    #[test]
    fn s3_ten_wrong_tokens_a_minute_block_the_address_for_the_rest_of_it() {
        let mut a = Attempts::default();
        let peer: IpAddr = "10.0.0.1".parse().expect("an address");
        let other: IpAddr = "10.0.0.2".parse().expect("an address");
        let t0 = Instant::now();
        for i in 0..MAX_BAD_ATTEMPTS {
            assert_eq!(a.blocked(peer, t0), None, "attempt {i}");
            a.failed(peer, t0 + Duration::from_secs(u64::from(i)));
        }
        let left = a
            .blocked(peer, t0 + Duration::from_secs(20))
            .expect("blocked");
        assert_eq!(left, Duration::from_secs(40));
        assert_eq!(a.blocked(other, t0), None);
        assert_eq!(a.blocked(peer, t0 + ATTEMPT_WINDOW), None);
        a.failed(peer, t0 + ATTEMPT_WINDOW);
        assert_eq!(a.blocked(peer, t0 + ATTEMPT_WINDOW), None, "a new window");
    }

    #[cfg(unix)]
    #[test]
    fn s3_a_token_file_must_exist_hold_a_token_and_be_private() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = std::env::temp_dir().join(format!("sluice-door-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a temp dir");
        let file = dir.join("token");
        assert!(matches!(
            AdminToken::from_file(&file),
            Err(TokenError::Unreadable { .. })
        ));
        std::fs::write(&file, "\n").expect("written");
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        assert!(matches!(
            AdminToken::from_file(&file),
            Err(TokenError::Empty(_))
        ));
        std::fs::write(&file, "tok\n").expect("written");
        assert!(
            AdminToken::from_file(&file)
                .expect("a token")
                .matches("tok")
        );
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        let e = AdminToken::from_file(&file).expect_err("world-readable");
        assert!(e.to_string().contains(&file.display().to_string()), "{e}");
        std::fs::remove_dir_all(&dir).expect("removed");
    }
}
