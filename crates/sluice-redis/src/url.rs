//! Documented on [`RedisUrl`].

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use redis::{ConnectionInfo, IntoConnectionInfo, RedisConnectionInfo};

/// The port a sentinel listens on when its address names none.
pub const SENTINEL_PORT: u16 = 26379;

/// The query parameters of a `rediss://` URL that name TLS files (redis-py's names).
const TLS_PARAMETERS: [&str; 3] = ["ssl_ca_certs", "ssl_certfile", "ssl_keyfile"];

/// Query parameters whose value is a secret, hidden by `Display`.
const SECRET_PARAMETERS: [&str; 3] = ["pass", "password", "sentinel_password"];

/// Where Redis is: a URL sluice accepts, parsed and checked.
///
/// | scheme | kind |
/// | --- | --- |
/// | `redis://[USER][:PASSWORD@]HOST[:PORT][/DB]` (`valkey://`) | [`UrlKind::Server`] |
/// | `rediss://[USER][:PASSWORD@]HOST[:PORT][/DB][?ssl_ca_certs=PEM&ssl_certfile=PEM&ssl_keyfile=PEM]` (`valkeys://`) | [`UrlKind::Server`], over TLS |
/// | `redis+unix:///PATH[?db=N&pass=P]` (`unix://`, `valkey+unix://`) | [`UrlKind::UnixSocket`] |
/// | `redis+cluster://HOST:PORT,HOST:PORT,…` | [`UrlKind::Cluster`] |
/// | `redis+sentinel://[USER][:PASSWORD@]HOST[:PORT][,HOST[:PORT]…]/MASTER[/DB][?sentinel_username=U&sentinel_password=P]` (`valkey+sentinel://`) | [`UrlKind::Sentinel`] |
///
/// A cluster's nodes are seed nodes, each read as `redis://NODE` (so
/// `redis+cluster://:PASSWORD@HOST:PORT,HOST:PORT` gives the first node a
/// password); the client learns the others from them.
///
/// `rediss://` verifies the server's certificate and name against the
/// system's roots, or against the CA certificates of the PEM file
/// `ssl_ca_certs` alone when given; `ssl_certfile` and `ssl_keyfile` (PEM, both
/// or neither) give sluice a client certificate for mutual TLS. The files are
/// read when sluice connects. There is no way to skip verification
/// (`#insecure` is refused).
///
/// `redis+sentinel://` names the sentinels of one Redis master by the name the
/// sentinels know it by (`MASTER`), the convention of redis-py's `redis+sentinel`
/// URLs: a sentinel without a port listens on [`SENTINEL_PORT`]; `USER`,
/// `PASSWORD` and `DB` are the master's; `sentinel_username` and
/// `sentinel_password` authenticate to the sentinels when they require it.
///
/// `Display` and `Debug` show the URL with every password replaced by `…`,
/// so it is safe to log; scheme names are matched without regard to case.
///
/// ```
/// use sluice_redis::{RedisUrl, UrlError, UrlKind};
///
/// let url: RedisUrl = "redis+cluster://10.0.0.1:7000,10.0.0.2:7000".parse().unwrap();
/// assert_eq!(url.kind(), UrlKind::Cluster);
/// assert_eq!(url.nodes().len(), 2);
///
/// let unix: RedisUrl = "redis+unix:///run/redis.sock?db=2&pass=hush".parse().unwrap();
/// assert_eq!(unix.kind(), UrlKind::UnixSocket);
/// assert_eq!(unix.to_string(), "redis+unix:///run/redis.sock?db=2&pass=…");
///
/// let tls: RedisUrl = "rediss://:hush@redis.internal:6380/0?ssl_ca_certs=/etc/ca.pem".parse().unwrap();
/// assert!(tls.tls().is_some());
/// assert_eq!(tls.to_string(), "rediss://…@redis.internal:6380/0?ssl_ca_certs=/etc/ca.pem");
///
/// let sentinel: RedisUrl = "redis+sentinel://:hush@10.0.0.1,10.0.0.2:26380/mymaster/1".parse().unwrap();
/// assert_eq!(sentinel.kind(), UrlKind::Sentinel);
/// assert_eq!(sentinel.master_name(), Some("mymaster"));
/// assert_eq!(sentinel.nodes().len(), 2);
///
/// assert_eq!("memcached://host".parse::<RedisUrl>(), Err(UrlError::UnknownScheme));
/// ```
#[derive(Clone)]
pub struct RedisUrl {
    text: String,
    kind: UrlKind,
    /// One entry for one server, the seed nodes for a cluster, the sentinels
    /// for a sentinel URL.
    nodes: Vec<ConnectionInfo>,
    /// `rediss://`: the files that set up TLS (boxed, as the next: most URLs
    /// have neither, and the URL is kept in long-lived structures).
    tls: Option<Box<TlsFiles>>,
    /// `redis+sentinel://`: the master's name and its credentials and database.
    master: Option<Box<(String, RedisConnectionInfo)>>,
}

/// What a [`RedisUrl`] points at.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum UrlKind {
    /// One Redis server over TCP (`redis://`), or over TLS (`rediss://`).
    Server,
    /// One Redis server on a Unix socket (`redis+unix://`, `unix://`).
    UnixSocket,
    /// A Redis Cluster, by its seed nodes (`redis+cluster://`).
    Cluster,
    /// The master a group of Redis Sentinels names (`redis+sentinel://`),
    /// followed across failovers.
    Sentinel,
}

/// The files a `rediss://` URL names to set up TLS (its `ssl_ca_certs`,
/// `ssl_certfile` and `ssl_keyfile` parameters). None of them: the system's
/// roots, no client certificate.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TlsFiles {
    ca: Option<PathBuf>,
    identity: Option<(PathBuf, PathBuf)>,
}

impl TlsFiles {
    /// The PEM file of the CA certificates trusted in place of the system's
    /// roots (`ssl_ca_certs`).
    pub fn ca_file(&self) -> Option<&Path> {
        self.ca.as_deref()
    }

    /// The PEM files of the client certificate chain and its private key
    /// (`ssl_certfile`, `ssl_keyfile`), for mutual TLS.
    pub fn client_identity(&self) -> Option<(&Path, &Path)> {
        self.identity
            .as_ref()
            .map(|(cert, key)| (cert.as_path(), key.as_path()))
    }
}

/// Why a text is not a Redis URL sluice can use. The messages never repeat
/// the URL, which may hold a password.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum UrlError {
    /// The scheme is none of those sluice reads.
    #[error(
        "expected a Redis URL: redis://HOST:PORT[/DB], rediss://HOST:PORT[/DB], \
         redis+unix:///PATH, redis+cluster://HOST:PORT,HOST:PORT,… or \
         redis+sentinel://HOST:PORT,HOST:PORT,…/MASTER[/DB]"
    )]
    UnknownScheme,
    /// TLS where this build has none: `rediss+cluster://` or
    /// `rediss+sentinel://`.
    #[error(
        "{scheme}:// (TLS to a Redis {what}) is not supported; TLS is supported to one \
         server (rediss://HOST:PORT)"
    )]
    Tls {
        /// The scheme, lower case.
        scheme: String,
        /// `cluster` or `sentinel group`.
        what: &'static str,
    },
    /// `redis+cluster://` without a node.
    #[error("redis+cluster:// names no node: expected redis+cluster://HOST:PORT,HOST:PORT,…")]
    NoClusterNodes,
    /// `redis+sentinel://` without a sentinel.
    #[error(
        "redis+sentinel:// names no sentinel: expected \
         redis+sentinel://HOST:PORT,HOST:PORT,…/MASTER[/DB]"
    )]
    NoSentinels,
    /// `redis+sentinel://` without the master's name.
    #[error(
        "redis+sentinel:// names no master: expected \
         redis+sentinel://HOST:PORT,HOST:PORT,…/MASTER[/DB], MASTER as the sentinels \
         know it (`sentinel monitor MASTER …`)"
    )]
    NoMasterName,
    /// A query parameter the scheme does not take.
    #[error("{scheme}:// takes no parameter `{name}`; it takes {expected}")]
    UnknownParameter {
        /// The scheme, lower case.
        scheme: String,
        /// The parameter's name.
        name: String,
        /// The parameters it takes.
        expected: &'static str,
    },
    /// A TLS parameter on a URL without TLS, or a client certificate without
    /// its key (or the reverse).
    #[error("{0}")]
    TlsParameters(&'static str),
    /// The scheme is known but the rest does not read (a missing host, a
    /// database that is not a number, a wildcard address, …).
    #[error("malformed Redis URL{}: {reason}", node.map(|n| format!(" (node {n})")).unwrap_or_default())]
    Invalid {
        /// The cluster node or sentinel, counted from 1, when the URL names
        /// several.
        node: Option<usize>,
        /// What the Redis client found wrong.
        reason: String,
    },
}

impl RedisUrl {
    /// Reads `text`.
    ///
    /// # Errors
    /// [`UrlError`] when the scheme is unknown or asks for TLS sluice cannot
    /// give, a cluster names no node, a sentinel URL names no sentinel or no
    /// master, a parameter is unknown, or the address does not read.
    pub fn parse(text: &str) -> Result<Self, UrlError> {
        let (scheme, rest) = text.split_once("://").ok_or(UrlError::UnknownScheme)?;
        let scheme = scheme.to_ascii_lowercase();
        let (kind, nodes) = match scheme.as_str() {
            "redis" | "valkey" => {
                if parameters(rest)?
                    .iter()
                    .any(|(name, _)| TLS_PARAMETERS.contains(&name.as_str()))
                {
                    return Err(UrlError::TlsParameters(
                        "ssl_ca_certs, ssl_certfile and ssl_keyfile need TLS: rediss://",
                    ));
                }
                (UrlKind::Server, vec![info(text, None)?])
            }
            "rediss" | "valkeys" => {
                let tls = tls_files(&scheme, rest)?;
                if rest.contains('#') {
                    return Err(UrlError::TlsParameters(
                        "rediss:// takes no #fragment: sluice always verifies the server's \
                         certificate (give its CA with ssl_ca_certs=PATH)",
                    ));
                }
                return Ok(RedisUrl {
                    text: text.to_owned(),
                    kind: UrlKind::Server,
                    nodes: vec![info(text, None)?],
                    tls: Some(Box::new(tls)),
                    master: None,
                });
            }
            "redis+unix" | "valkey+unix" | "unix" => (UrlKind::UnixSocket, vec![info(text, None)?]),
            "redis+cluster" | "valkey+cluster" => {
                let nodes = rest
                    .split(',')
                    .filter(|n| !n.is_empty())
                    .enumerate()
                    .map(|(i, n)| info(&format!("redis://{n}"), Some(i + 1)))
                    .collect::<Result<Vec<_>, _>>()?;
                if nodes.is_empty() {
                    return Err(UrlError::NoClusterNodes);
                }
                (UrlKind::Cluster, nodes)
            }
            "redis+sentinel" | "valkey+sentinel" => return sentinel(text, rest),
            "rediss+cluster" | "valkeys+cluster" => {
                return Err(UrlError::Tls {
                    scheme,
                    what: "cluster",
                });
            }
            "rediss+sentinel" | "valkeys+sentinel" => {
                return Err(UrlError::Tls {
                    scheme,
                    what: "sentinel group",
                });
            }
            _ => return Err(UrlError::UnknownScheme),
        };
        Ok(RedisUrl {
            text: text.to_owned(),
            kind,
            nodes,
            tls: None,
            master: None,
        })
    }

    /// One server, one server on a Unix socket, a cluster, or a master named
    /// by sentinels.
    pub fn kind(&self) -> UrlKind {
        self.kind
    }

    /// The Redis client's connection settings: one for a server, the seed
    /// nodes of a cluster, the sentinels of a sentinel URL.
    pub fn nodes(&self) -> &[ConnectionInfo] {
        &self.nodes
    }

    /// The TLS files of a `rediss://` URL (`None` for every other scheme).
    pub fn tls(&self) -> Option<&TlsFiles> {
        self.tls.as_deref()
    }

    /// The master's name a `redis+sentinel://` URL asks the sentinels for.
    pub fn master_name(&self) -> Option<&str> {
        self.master.as_deref().map(|(name, _)| name.as_str())
    }

    /// The database and credentials a `redis+sentinel://` URL gives its
    /// master (and no one else).
    pub fn master_settings(&self) -> Option<&RedisConnectionInfo> {
        self.master.as_deref().map(|(_, settings)| settings)
    }
}

/// The Redis client's reading of `text`.
fn info(text: &str, node: Option<usize>) -> Result<ConnectionInfo, UrlError> {
    text.into_connection_info().map_err(|e| {
        // The client's message is `description - Kind[: detail]`; the kind
        // says nothing more here.
        let message = e.to_string();
        let reason = match (message.split_once(" - "), e.detail()) {
            (Some((description, _)), Some(detail)) => format!("{description}: {detail}"),
            (Some((description, _)), None) => description.to_owned(),
            (None, _) => message,
        };
        UrlError::Invalid { node, reason }
    })
}

/// The query of the URL after the scheme, as decoded `(name, value)` pairs.
fn parameters(rest: &str) -> Result<Vec<(String, String)>, UrlError> {
    let query = rest.split_once('?').map_or("", |(_, q)| q);
    let query = query.split_once('#').map_or(query, |(q, _)| q);
    query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|pair| {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            Ok((decode(name)?, decode(value)?))
        })
        .collect()
}

/// `text` with its `%XX` escapes decoded.
fn decode(text: &str) -> Result<String, UrlError> {
    let invalid = || UrlError::Invalid {
        node: None,
        reason: "a %-escape that is not UTF-8 text".to_owned(),
    };
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        let escaped = (b == b'%')
            .then(|| bytes.get(i + 1..i + 3))
            .flatten()
            .and_then(|hex| std::str::from_utf8(hex).ok())
            .and_then(|hex| u8::from_str_radix(hex, 16).ok());
        match escaped {
            Some(byte) => {
                out.push(byte);
                i += 3;
            }
            None => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).map_err(|_| invalid())
}

/// The TLS files a `rediss://` URL's query names.
fn tls_files(scheme: &str, rest: &str) -> Result<TlsFiles, UrlError> {
    let mut files = TlsFiles::default();
    let (mut cert, mut key) = (None, None);
    for (name, value) in parameters(rest)? {
        let path = || -> Result<PathBuf, UrlError> {
            if value.is_empty() {
                return Err(UrlError::TlsParameters(
                    "ssl_ca_certs, ssl_certfile and ssl_keyfile each name a PEM file",
                ));
            }
            Ok(PathBuf::from(&value))
        };
        match name.as_str() {
            "ssl_ca_certs" => files.ca = Some(path()?),
            "ssl_certfile" => cert = Some(path()?),
            "ssl_keyfile" => key = Some(path()?),
            // The Redis client's own: RESP2 or RESP3.
            "protocol" => {}
            _ => {
                return Err(UrlError::UnknownParameter {
                    scheme: scheme.to_owned(),
                    name,
                    expected: "ssl_ca_certs, ssl_certfile, ssl_keyfile and protocol",
                });
            }
        }
    }
    files.identity = match (cert, key) {
        (Some(cert), Some(key)) => Some((cert, key)),
        (None, None) => None,
        _ => {
            return Err(UrlError::TlsParameters(
                "ssl_certfile and ssl_keyfile go together: a client certificate needs its key",
            ));
        }
    };
    Ok(files)
}

/// Reads `redis+sentinel://[USER][:PASSWORD@]HOST[:PORT],…/MASTER[/DB][?…]`.
fn sentinel(text: &str, rest: &str) -> Result<RedisUrl, UrlError> {
    let scheme = text
        .split_once("://")
        .map_or("", |(s, _)| s)
        .to_ascii_lowercase();
    let main = rest.split_once('?').map_or(rest, |(m, _)| m);
    if main.contains('#') {
        return Err(UrlError::Invalid {
            node: None,
            reason: "a sentinel URL takes no #fragment".to_owned(),
        });
    }
    let (authority, path) = main.split_once('/').unwrap_or((main, ""));
    let (userinfo, hosts) = match authority.rfind('@') {
        Some(at) => (Some(&authority[..at]), &authority[at + 1..]),
        None => (None, authority),
    };
    if let Some(userinfo) = userinfo.filter(|u| u.contains(',')) {
        return Err(UrlError::Invalid {
            node: Some(userinfo.matches(',').count() + 1),
            reason: "credentials go once, before the first sentinel".to_owned(),
        });
    }
    let (mut sentinel_user, mut sentinel_password) = (None, None);
    for (name, value) in parameters(rest)? {
        match name.as_str() {
            "sentinel_username" => sentinel_user = Some(value),
            "sentinel_password" => sentinel_password = Some(value),
            _ => {
                return Err(UrlError::UnknownParameter {
                    scheme,
                    name,
                    expected: "sentinel_username and sentinel_password",
                });
            }
        }
    }
    let mut nodes = Vec::new();
    for (i, host) in hosts.split(',').filter(|h| !h.is_empty()).enumerate() {
        let node = Some(i + 1);
        let has_port = match host.rfind(']') {
            Some(bracket) => host[bracket..].contains(':'),
            None => host.contains(':'),
        };
        let address = if has_port {
            format!("redis://{host}")
        } else {
            format!("redis://{host}:{SENTINEL_PORT}")
        };
        let mut settings = RedisConnectionInfo::default();
        if let Some(user) = &sentinel_user {
            settings = settings.set_username(user);
        }
        if let Some(password) = &sentinel_password {
            settings = settings.set_password(password);
        }
        nodes.push(info(&address, node)?.set_redis_settings(settings));
    }
    if nodes.is_empty() {
        return Err(UrlError::NoSentinels);
    }
    let (name, db) = path.split_once('/').unwrap_or((path, ""));
    let name = decode(name)?;
    if name.is_empty() {
        return Err(UrlError::NoMasterName);
    }
    // The master's credentials and database, read as the Redis client reads a
    // server's (percent-escapes, `Invalid database number`).
    let credentials = userinfo.map(|u| format!("{u}@")).unwrap_or_default();
    let db = db.trim_end_matches('/');
    let settings = info(&format!("redis://{credentials}localhost/{db}"), None)?
        .redis_settings()
        .clone();
    Ok(RedisUrl {
        text: text.to_owned(),
        kind: UrlKind::Sentinel,
        nodes,
        tls: None,
        master: Some(Box::new((name, settings))),
    })
}

impl FromStr for RedisUrl {
    type Err = UrlError;

    fn from_str(s: &str) -> Result<Self, UrlError> {
        RedisUrl::parse(s)
    }
}

impl PartialEq for RedisUrl {
    fn eq(&self, other: &Self) -> bool {
        self.text == other.text
    }
}

impl Eq for RedisUrl {}

impl fmt::Display for RedisUrl {
    /// The URL with every password replaced by `…`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (scheme, rest) = self.text.split_once("://").unwrap_or(("", &self.text));
        write!(f, "{scheme}://")?;
        let (main, query) = rest.split_once('?').unwrap_or((rest, ""));
        if self.kind == UrlKind::UnixSocket {
            // user and password travel in the query: `?db=0&user=u&pass=p`.
            f.write_str(main)?;
        } else {
            // Userinfo sits before the last `@` of each node's authority.
            for (i, node) in main.split(',').enumerate() {
                if i > 0 {
                    f.write_str(",")?;
                }
                let end = node.find(['/', '#']).unwrap_or(node.len());
                match node[..end].rfind('@') {
                    Some(at) => write!(f, "…{}", &node[at..])?,
                    None => f.write_str(node)?,
                }
            }
        }
        let mut sep = '?';
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            match pair.split_once('=') {
                Some((name, _)) if SECRET_PARAMETERS.contains(&name) => {
                    write!(f, "{sep}{name}=…")?;
                }
                _ => write!(f, "{sep}{pair}")?,
            }
            sep = '&';
        }
        Ok(())
    }
}

impl fmt::Debug for RedisUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("RedisUrl")
            .field(&format_args!("{self}"))
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kind(text: &str) -> Result<UrlKind, UrlError> {
        RedisUrl::parse(text).map(|u| u.kind())
    }

    #[test]
    fn every_scheme_sluice_accepts_reads() {
        assert_eq!(kind("redis://127.0.0.1:6379"), Ok(UrlKind::Server));
        assert_eq!(kind("redis://127.0.0.1:6379/3"), Ok(UrlKind::Server));
        assert_eq!(kind("redis://localhost"), Ok(UrlKind::Server));
        assert_eq!(kind("valkey://localhost"), Ok(UrlKind::Server));
        assert_eq!(kind("REDIS://localhost"), Ok(UrlKind::Server));
        assert_eq!(kind("redis+unix:///tmp/r.sock"), Ok(UrlKind::UnixSocket));
        assert_eq!(kind("unix:///tmp/r.sock"), Ok(UrlKind::UnixSocket));
        assert_eq!(kind("valkey+unix:///tmp/r.sock"), Ok(UrlKind::UnixSocket));
        assert_eq!(kind("redis+cluster://a:1,b:2"), Ok(UrlKind::Cluster));
        assert_eq!(kind("redis+cluster://a:1,,b:2,"), Ok(UrlKind::Cluster));
        assert_eq!(kind("rediss://localhost:6380"), Ok(UrlKind::Server));
        assert_eq!(kind("valkeys://localhost"), Ok(UrlKind::Server));
        assert_eq!(kind("redis+sentinel://a:1,b:2/m"), Ok(UrlKind::Sentinel));
        assert_eq!(kind("valkey+sentinel://a/m/3"), Ok(UrlKind::Sentinel));
    }

    #[test]
    fn a_tls_url_keeps_its_files_and_verifies_the_server() {
        let url = RedisUrl::parse(
            "rediss://u:pw@redis.internal:6380/2?ssl_ca_certs=/etc/ca%20s.pem\
             &ssl_certfile=/etc/c.pem&ssl_keyfile=/etc/k.pem",
        )
        .expect("url");
        let [node] = url.nodes() else {
            panic!("one node")
        };
        assert!(
            matches!(
                node.addr(),
                redis::ConnectionAddr::TcpTls { host, port: 6380, insecure: false, .. }
                    if host == "redis.internal"
            ),
            "{:?}",
            node.addr()
        );
        assert_eq!(node.redis_settings().db(), 2);
        assert_eq!(node.redis_settings().password(), Some("pw"));
        let tls = url.tls().expect("tls");
        assert_eq!(tls.ca_file(), Some(Path::new("/etc/ca s.pem")));
        assert_eq!(
            tls.client_identity(),
            Some((Path::new("/etc/c.pem"), Path::new("/etc/k.pem")))
        );
        let plain = RedisUrl::parse("rediss://h").expect("url");
        assert_eq!(plain.tls(), Some(&TlsFiles::default()));
        assert_eq!(RedisUrl::parse("redis://h").expect("url").tls(), None);
    }

    #[test]
    fn a_sentinel_url_names_its_sentinels_and_the_masters_settings() {
        let url = RedisUrl::parse(
            "redis+sentinel://app:p%40ss@10.0.0.1,10.0.0.2:26380,[::1]/my%20master/3\
             ?sentinel_password=s3&sentinel_username=watch",
        )
        .expect("url");
        assert_eq!(url.master_name(), Some("my master"));
        let master = url.master_settings().expect("master");
        assert_eq!(master.db(), 3);
        assert_eq!(master.username(), Some("app"));
        assert_eq!(master.password(), Some("p@ss"));
        let addrs: Vec<_> = url.nodes().iter().map(|n| n.addr().clone()).collect();
        assert_eq!(
            addrs,
            [
                redis::ConnectionAddr::Tcp("10.0.0.1".into(), SENTINEL_PORT),
                redis::ConnectionAddr::Tcp("10.0.0.2".into(), 26380),
                redis::ConnectionAddr::Tcp("::1".into(), SENTINEL_PORT),
            ]
        );
        for node in url.nodes() {
            assert_eq!(node.redis_settings().username(), Some("watch"));
            assert_eq!(node.redis_settings().password(), Some("s3"));
            assert_eq!(node.redis_settings().db(), 0, "sentinels have no database");
        }
        let bare = RedisUrl::parse("redis+sentinel://h:1/m").expect("url");
        let master = bare.master_settings().expect("master");
        assert_eq!((master.db(), master.password()), (0, None));
        assert_eq!(bare.nodes()[0].redis_settings().password(), None);
        assert_eq!(bare.master_name(), Some("m"));
        assert_eq!(
            RedisUrl::parse("redis://h").expect("url").master_name(),
            None
        );
    }

    #[test]
    fn tls_and_sentinel_mistakes_are_named() {
        assert_eq!(
            kind("redis://h?ssl_ca_certs=/ca.pem"),
            Err(UrlError::TlsParameters(
                "ssl_ca_certs, ssl_certfile and ssl_keyfile need TLS: rediss://"
            ))
        );
        assert!(matches!(
            kind("rediss://h?ssl_certfile=/c.pem"),
            Err(UrlError::TlsParameters(m)) if m.contains("go together")
        ));
        assert!(matches!(
            kind("rediss://h?ssl_keyfile=/k.pem"),
            Err(UrlError::TlsParameters(m)) if m.contains("go together")
        ));
        assert!(matches!(
            kind("rediss://h?ssl_ca_certs="),
            Err(UrlError::TlsParameters(m)) if m.contains("PEM file")
        ));
        assert!(matches!(
            kind("rediss://h/#insecure"),
            Err(UrlError::TlsParameters(m)) if m.contains("always verifies")
        ));
        assert_eq!(
            kind("rediss://h?ssl_ca_cert=/ca.pem"),
            Err(UrlError::UnknownParameter {
                scheme: "rediss".into(),
                name: "ssl_ca_cert".into(),
                expected: "ssl_ca_certs, ssl_certfile, ssl_keyfile and protocol",
            })
        );
        assert_eq!(kind("redis+sentinel:///m"), Err(UrlError::NoSentinels));
        assert_eq!(kind("redis+sentinel://,/m"), Err(UrlError::NoSentinels));
        assert_eq!(kind("redis+sentinel://h:1"), Err(UrlError::NoMasterName));
        assert_eq!(kind("redis+sentinel://h:1/"), Err(UrlError::NoMasterName));
        assert_eq!(kind("redis+sentinel://h:1//0"), Err(UrlError::NoMasterName));
        assert!(matches!(
            kind("redis+sentinel://h:1/m?db=2"),
            Err(UrlError::UnknownParameter { name, .. }) if name == "db"
        ));
        assert!(matches!(
            kind("redis+sentinel://h:1,:pw@g:2/m"),
            Err(UrlError::Invalid { node: Some(2), .. })
        ));
        assert!(matches!(
            kind("redis+sentinel://h:1,g:port/m"),
            Err(UrlError::Invalid { node: Some(2), .. })
        ));
        assert!(matches!(
            kind("redis+sentinel://h:1/m/x"),
            Err(UrlError::Invalid { node: None, .. })
        ));
        assert!(matches!(
            kind("redis+sentinel://h:1/m#frag"),
            Err(UrlError::Invalid { node: None, .. })
        ));
        for text in [
            "redis+sentinel://:hush@h:1/m/x",
            "redis+sentinel://h:1/m?sentinel_password=hush&x=1",
            "rediss://:hush@h?ssl_certfile=/c",
        ] {
            let message = RedisUrl::parse(text).expect_err(text).to_string();
            assert!(!message.contains("hush"), "{message}");
        }
    }

    #[test]
    fn a_server_url_keeps_its_database_and_password() {
        let url = RedisUrl::parse("redis://u:p%40ss@10.1.2.3:6380/4").expect("url");
        let [node] = url.nodes() else {
            panic!("one node")
        };
        assert_eq!(
            node.addr(),
            &redis::ConnectionAddr::Tcp("10.1.2.3".into(), 6380)
        );
        assert_eq!(node.redis_settings().db(), 4);
        assert_eq!(node.redis_settings().username(), Some("u"));
        assert_eq!(node.redis_settings().password(), Some("p@ss"));
    }

    #[test]
    fn a_unix_url_keeps_its_path_and_database() {
        let url = RedisUrl::parse("redis+unix:///run/redis.sock?db=2").expect("url");
        let [node] = url.nodes() else {
            panic!("one node")
        };
        assert_eq!(
            node.addr(),
            &redis::ConnectionAddr::Unix("/run/redis.sock".into())
        );
        assert_eq!(node.redis_settings().db(), 2);
    }

    #[test]
    fn a_cluster_url_names_its_seed_nodes() {
        let url = RedisUrl::parse("redis+cluster://10.0.0.1:7000,,10.0.0.2:7001").expect("url");
        let addrs: Vec<_> = url.nodes().iter().map(|n| n.addr().clone()).collect();
        assert_eq!(
            addrs,
            [
                redis::ConnectionAddr::Tcp("10.0.0.1".into(), 7000),
                redis::ConnectionAddr::Tcp("10.0.0.2".into(), 7001),
            ]
        );
    }

    #[test]
    fn what_sluice_cannot_use_is_refused_with_a_reason() {
        assert_eq!(kind("not a url"), Err(UrlError::UnknownScheme));
        assert_eq!(kind("memory"), Err(UrlError::UnknownScheme));
        assert_eq!(kind("http://localhost:6379"), Err(UrlError::UnknownScheme));
        assert_eq!(
            kind("rediss+cluster://a:1,b:2"),
            Err(UrlError::Tls {
                scheme: "rediss+cluster".into(),
                what: "cluster"
            })
        );
        assert_eq!(
            kind("REDISS+SENTINEL://a:1/m"),
            Err(UrlError::Tls {
                scheme: "rediss+sentinel".into(),
                what: "sentinel group"
            })
        );
        assert_eq!(kind("redis+cluster://"), Err(UrlError::NoClusterNodes));
        assert_eq!(kind("redis+cluster://,,"), Err(UrlError::NoClusterNodes));
        assert!(matches!(
            kind("redis://localhost/notanumber"),
            Err(UrlError::Invalid { node: None, .. })
        ));
        assert!(matches!(
            kind("redis://"),
            Err(UrlError::Invalid { node: None, .. })
        ));
        assert!(matches!(
            kind("redis+cluster://a:1,b:notaport"),
            Err(UrlError::Invalid { node: Some(2), .. })
        ));
        let message = RedisUrl::parse("redis://:hush@localhost/x")
            .expect_err("db is not a number")
            .to_string();
        assert_eq!(message, "malformed Redis URL: Invalid database number");
        assert!(!message.contains("hush"), "{message}");
    }

    #[test]
    fn display_hides_every_password() {
        let shown = |text: &str| RedisUrl::parse(text).expect("url").to_string();
        assert_eq!(shown("redis://127.0.0.1:6379"), "redis://127.0.0.1:6379");
        assert_eq!(shown("redis://:pw@h:1/2"), "redis://…@h:1/2");
        assert_eq!(shown("redis://user:pw@h:1"), "redis://…@h:1");
        assert_eq!(
            shown("redis+cluster://:pw@a:1,u:pw@b:2,c:3"),
            "redis+cluster://…@a:1,…@b:2,c:3"
        );
        assert_eq!(
            shown("unix:///s.sock?pass=pw&db=1"),
            "unix:///s.sock?pass=…&db=1"
        );
        assert_eq!(
            shown("rediss://u:pw@h:6380/1?ssl_ca_certs=/ca.pem"),
            "rediss://…@h:6380/1?ssl_ca_certs=/ca.pem"
        );
        assert_eq!(
            shown("redis+sentinel://:pw@a,b:2/m/1?sentinel_username=w&sentinel_password=pw"),
            "redis+sentinel://…@a,b:2/m/1?sentinel_username=w&sentinel_password=…"
        );
        assert_eq!(shown("redis+sentinel://a:1/m"), "redis+sentinel://a:1/m");
        let debug = format!("{:?}", RedisUrl::parse("redis://:pw@h").expect("url"));
        assert_eq!(debug, "RedisUrl(redis://…@h)");
    }
}
