//! The door of one admin listener: every request's head is checked here before a
//! route sees it, and the answer is a value: who came in, or why not.

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use http::header::{AUTHORIZATION, COOKIE};
use http::{HeaderMap, Method, StatusCode};
use parking_lot::Mutex;

use crate::host::HostRule;
use crate::origin::{ForeignOrigin, json_or_empty, same_origin};
use crate::session::Sessions;
use crate::token::{AdminToken, Attempts};

/// The wall clock in Unix seconds (a session's issue and expiry).
fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Where the login page sends the token (`POST`, `{"token": "…"}`).
pub const LOGIN_PATH: &str = "/login";
/// Where the login cookie is cleared (`POST`).
pub const LOGOUT_PATH: &str = "/logout";

/// What a listener's door lets in.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DoorConfig {
    /// Names besides `localhost` and the listener's addresses that `Host` may carry
    /// (`--admin-host`).
    pub hosts: Vec<String>,
    /// The token every request must carry, if any.
    pub token: Option<AdminToken>,
    /// Paths answered without the token (`/metrics` with `--metrics-open`); their
    /// `Host` is still checked.
    pub open_paths: Vec<String>,
}

/// Who came in, for the audit line of a change.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Entrant {
    /// With the token (header or cookie), from this address.
    Token(Option<IpAddr>),
    /// With no token configured (a loopback listener), from this address.
    Local(Option<IpAddr>),
    /// On an open path, without the token.
    Open(Option<IpAddr>),
}

impl std::fmt::Display for Entrant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (how, peer) = match self {
            Entrant::Token(p) => ("token", p),
            Entrant::Local(p) => ("loopback", p),
            Entrant::Open(p) => ("open path", p),
        };
        match peer {
            Some(p) => write!(f, "{how} from {p}"),
            None => f.write_str(how),
        }
    }
}

/// Why a request is not let in.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Refusal {
    /// 421: the `Host` is not a name of this listener (DNS rebinding).
    MisdirectedHost(String),
    /// 403: a page of another origin asked for a change.
    ForeignOrigin(String),
    /// 415: a change whose body is not JSON.
    NotJson,
    /// 401: no token, or the wrong one.
    Unauthorized {
        /// Whether a token was given (and was wrong).
        wrong: bool,
    },
    /// 429: too many wrong tokens from this address; retry after this long.
    TooManyAttempts(Duration),
    /// 403: a page's request whose origin the pacer proxy does not list
    /// (`pacer.allowedOrigins`), naming what the request said.
    UnlistedOrigin(String),
}

impl Refusal {
    /// The status it is answered with.
    pub fn status(&self) -> StatusCode {
        match self {
            Refusal::MisdirectedHost(_) => StatusCode::MISDIRECTED_REQUEST,
            Refusal::ForeignOrigin(_) | Refusal::UnlistedOrigin(_) => StatusCode::FORBIDDEN,
            Refusal::NotJson => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            Refusal::Unauthorized { .. } => StatusCode::UNAUTHORIZED,
            Refusal::TooManyAttempts(_) => StatusCode::TOO_MANY_REQUESTS,
        }
    }

    /// The envelope's `error.code`.
    pub fn code(&self) -> &'static str {
        match self {
            Refusal::MisdirectedHost(_) => "misdirected_host",
            Refusal::ForeignOrigin(_) => "foreign_origin",
            Refusal::UnlistedOrigin(_) => "origin_not_allowed",
            Refusal::NotJson => "json_required",
            Refusal::Unauthorized { .. } => "unauthorized",
            Refusal::TooManyAttempts(_) => "too_many_attempts",
        }
    }

    /// What the envelope's `error.message` says.
    pub fn message(&self) -> String {
        match self {
            Refusal::MisdirectedHost(host) => format!(
                "Host `{host}` is not a name of this listener; a name a reverse proxy \
                 forwards must be allowed (--admin-host NAME, or pacer.allowedHosts)"
            ),
            Refusal::ForeignOrigin(said) => format!(
                "changes are taken only from this listener's own origin, not from a page \
                 of another one ({said})"
            ),
            Refusal::UnlistedOrigin(origin) => format!(
                "requests from web pages are not forwarded unless their origin is listed \
                 in pacer.allowedOrigins ({origin})"
            ),
            Refusal::NotJson => {
                "a change needs Content-Type: application/json (or no body at all)".to_owned()
            }
            Refusal::Unauthorized { wrong: true } => "the admin token is not valid".to_owned(),
            Refusal::Unauthorized { wrong: false } => {
                "this listener needs its admin token: Authorization: Bearer <token>".to_owned()
            }
            Refusal::TooManyAttempts(left) => format!(
                "too many wrong tokens from this address; try again in {} s",
                left.as_secs().max(1)
            ),
        }
    }
}

impl From<ForeignOrigin> for Refusal {
    fn from(f: ForeignOrigin) -> Self {
        Refusal::ForeignOrigin(f.0)
    }
}

/// The door of one listener.
#[derive(Debug)]
pub struct Door {
    rule: HostRule,
    token: Option<AdminToken>,
    open_paths: Vec<String>,
    cookie_name: String,
    sessions: Option<Sessions>,
    attempts: Mutex<Attempts>,
}

/// Whether `method` may change state (all but GET and HEAD).
pub fn changes_state(method: &Method) -> bool {
    method != Method::GET && method != Method::HEAD
}

impl Door {
    /// The door of a listener bound to `listener`.
    pub fn new(listener: SocketAddr, config: DoorConfig) -> Self {
        Door {
            rule: HostRule::new(listener, &config.hosts),
            sessions: config.token.as_ref().map(AdminToken::sessions),
            token: config.token,
            open_paths: config.open_paths,
            cookie_name: format!("sluice_admin_{}", listener.port()),
            attempts: Mutex::new(Attempts::default()),
        }
    }

    /// Whether a token is required.
    pub fn has_token(&self) -> bool {
        self.token.is_some()
    }

    /// The login cookie's name: one per port, as a browser sends a host's cookies to
    /// all its ports.
    pub fn cookie_name(&self) -> &str {
        &self.cookie_name
    }

    /// `Set-Cookie` of a successful login: a new session, for
    /// [`SESSION_SECONDS`](crate::SESSION_SECONDS).
    pub fn login_cookie(&self) -> Option<String> {
        let sessions = self.sessions.as_ref()?;
        Some(format!(
            "{}={}; HttpOnly; SameSite=Strict; Path=/; Max-Age={}",
            self.cookie_name,
            sessions.issue(unix_now()),
            crate::SESSION_SECONDS
        ))
    }

    /// Ends the sessions whose cookies `headers` carry (a logout: the cookie is
    /// refused from then on, wherever a copy of it is), and returns the
    /// `Set-Cookie` that clears it in the browser.
    pub fn logout(&self, headers: &HeaderMap) -> String {
        if let Some(sessions) = &self.sessions {
            let now = unix_now();
            self.each_cookie(headers, |value| sessions.end(value, now));
        }
        format!(
            "{}=; HttpOnly; SameSite=Strict; Path=/; Max-Age=0",
            self.cookie_name
        )
    }

    /// Calls `f` with the value of each login cookie `headers` carry.
    fn each_cookie(&self, headers: &HeaderMap, mut f: impl FnMut(&str)) {
        for value in headers.get_all(COOKIE) {
            let text = value.to_str().unwrap_or("");
            for pair in text.split(';') {
                if let Some((name, value)) = pair.trim().split_once('=')
                    && name == self.cookie_name
                {
                    f(value);
                }
            }
        }
    }

    /// Checks a request's head: its `Host` (`authority`, from the URI or the `Host`
    /// field), for a change its origin and content type, then the token unless the
    /// path is open or is the login itself.
    ///
    /// # Errors
    /// The [`Refusal`] to answer with.
    pub fn check(
        &self,
        method: &Method,
        path: &str,
        headers: &HeaderMap,
        authority: Option<&str>,
        peer: Option<IpAddr>,
        now: Instant,
    ) -> Result<Entrant, Refusal> {
        let host = authority.unwrap_or("");
        if !self.rule.allows(host) {
            return Err(Refusal::MisdirectedHost(host.chars().take(200).collect()));
        }
        if changes_state(method) {
            same_origin(headers, host)?;
            if !json_or_empty(headers) {
                return Err(Refusal::NotJson);
            }
        }
        if self.token.is_none() {
            return Ok(Entrant::Local(peer));
        }
        if self.open_paths.iter().any(|p| p == path) {
            return Ok(Entrant::Open(peer));
        }
        let key = peer.unwrap_or(IpAddr::from([0, 0, 0, 0]));
        if let Some(left) = self.attempts.lock().blocked(key, now) {
            return Err(Refusal::TooManyAttempts(left));
        }
        if path == LOGIN_PATH && method == Method::POST {
            // The login handler checks the token in the body.
            return Ok(Entrant::Open(peer));
        }
        match self.presented(headers) {
            Presented::Valid => Ok(Entrant::Token(peer)),
            Presented::None => Err(Refusal::Unauthorized { wrong: false }),
            Presented::Wrong => {
                self.attempts.lock().failed(key, now);
                Err(Refusal::Unauthorized { wrong: true })
            }
        }
    }

    /// Checks the token a login sends; a wrong one counts toward the address's limit.
    ///
    /// # Errors
    /// [`Refusal::Unauthorized`] or [`Refusal::TooManyAttempts`].
    pub fn login(
        &self,
        presented: &str,
        peer: Option<IpAddr>,
        now: Instant,
    ) -> Result<(), Refusal> {
        let Some(token) = &self.token else {
            return Ok(());
        };
        let key = peer.unwrap_or(IpAddr::from([0, 0, 0, 0]));
        let mut attempts = self.attempts.lock();
        if let Some(left) = attempts.blocked(key, now) {
            return Err(Refusal::TooManyAttempts(left));
        }
        if token.matches(presented) {
            Ok(())
        } else {
            attempts.failed(key, now);
            Err(Refusal::Unauthorized { wrong: true })
        }
    }

    fn presented(&self, headers: &HeaderMap) -> Presented {
        let (Some(token), Some(sessions)) = (&self.token, &self.sessions) else {
            return Presented::Valid;
        };
        let mut seen = Presented::None;
        let mut fields = headers.get_all(AUTHORIZATION).iter();
        if let Some(value) = fields.next() {
            // `Authorization` is one field (RFC 9110 §11.6.2). Sent twice, none of
            // its values is tried: a request carrying 90 guesses would otherwise
            // count as one wrong token toward the address's limit.
            if fields.next().is_some() {
                return Presented::Wrong;
            }
            match bearer(value.to_str().unwrap_or("")) {
                Some(bearer) if token.matches(bearer) => return Presented::Valid,
                _ => seen = Presented::Wrong,
            }
        }
        let now = unix_now();
        let mut live = false;
        self.each_cookie(headers, |value| {
            if sessions.is_live(value, now) {
                live = true;
            } else {
                seen = Presented::Wrong;
            }
        });
        if live { Presented::Valid } else { seen }
    }
}

enum Presented {
    None,
    Wrong,
    Valid,
}

/// The token of `Authorization: Bearer <token>` (scheme without case, one space or
/// more).
pub fn bearer(field: &str) -> Option<&str> {
    let (scheme, rest) = field.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| rest.trim())
        .filter(|t| !t.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::token::MAX_BAD_ATTEMPTS;

    fn door() -> Door {
        let token = AdminToken::new("s3cret", "test").expect("a token");
        Door::new(
            SocketAddr::from(([127, 0, 0, 1], 9090)),
            DoorConfig {
                hosts: Vec::new(),
                token: Some(token),
                open_paths: Vec::new(),
            },
        )
    }

    fn ask(door: &Door, fields: &[&str], now: Instant) -> Result<Entrant, Refusal> {
        let mut headers = HeaderMap::new();
        for field in fields {
            headers.append(AUTHORIZATION, field.parse().expect("a value"));
        }
        door.check(
            &Method::GET,
            "/status",
            &headers,
            Some("127.0.0.1:9090"),
            Some(IpAddr::from([10, 0, 0, 7])),
            now,
        )
    }

    /// SPEC S3: ten wrong tokens a minute, then 429. A request naming many tokens in
    /// as many `Authorization` fields is one wrong token, whichever of them is right:
    /// it cannot try 90 guesses for the price of one.
    #[test]
    fn s3_many_authorization_fields_try_no_token() {
        let door = door();
        let now = Instant::now();
        assert!(matches!(
            ask(&door, &["Bearer s3cret"], now),
            Ok(Entrant::Token(_))
        ));
        let guesses: Vec<String> = (0..90).map(|i| format!("Bearer guess{i}")).collect();
        let mut fields: Vec<&str> = guesses.iter().map(String::as_str).collect();
        fields.push("Bearer s3cret");
        assert!(matches!(
            ask(&door, &fields, now),
            Err(Refusal::Unauthorized { wrong: true })
        ));
        assert!(matches!(
            ask(&door, &["Bearer s3cret", "Bearer s3cret"], now),
            Err(Refusal::Unauthorized { wrong: true })
        ));
        for _ in 2..MAX_BAD_ATTEMPTS {
            assert!(ask(&door, &fields, now).is_err());
        }
        assert!(matches!(
            ask(&door, &["Bearer s3cret"], now),
            Err(Refusal::TooManyAttempts(_))
        ));
    }
}
