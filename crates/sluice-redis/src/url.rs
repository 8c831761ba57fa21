//! Documented on [`RedisUrl`].

use std::fmt;
use std::str::FromStr;

use redis::{ConnectionInfo, IntoConnectionInfo};

/// Where Redis is: a URL sluice accepts, parsed and checked.
///
/// | scheme | kind |
/// | --- | --- |
/// | `redis://[USER][:PASSWORD@]HOST[:PORT][/DB]` (`valkey://`) | [`UrlKind::Server`] |
/// | `redis+unix:///PATH[?db=N&pass=P]` (`unix://`, `valkey+unix://`) | [`UrlKind::UnixSocket`] |
/// | `redis+cluster://HOST:PORT,HOST:PORT,…` | [`UrlKind::Cluster`] |
///
/// A cluster's nodes are seed nodes, each read as `redis://NODE` (so
/// `redis+cluster://:PASSWORD@HOST:PORT,HOST:PORT` gives the first node a
/// password); the client learns the others from them. `rediss://` is refused
/// with [`UrlError::Tls`]: this build has no TLS client for Redis.
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
/// assert_eq!("memcached://host".parse::<RedisUrl>(), Err(UrlError::UnknownScheme));
/// ```
#[derive(Clone)]
pub struct RedisUrl {
    text: String,
    kind: UrlKind,
    /// One entry for one server, the seed nodes for a cluster.
    nodes: Vec<ConnectionInfo>,
}

/// What a [`RedisUrl`] points at.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum UrlKind {
    /// One Redis server over TCP (`redis://`).
    Server,
    /// One Redis server on a Unix socket (`redis+unix://`, `unix://`).
    UnixSocket,
    /// A Redis Cluster, by its seed nodes (`redis+cluster://`).
    Cluster,
}

/// Why a text is not a Redis URL sluice can use. The messages never repeat
/// the URL, which may hold a password.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum UrlError {
    /// The scheme is none of those sluice reads.
    #[error(
        "expected a Redis URL: redis://HOST:PORT[/DB], redis+unix:///PATH or \
         redis+cluster://HOST:PORT,HOST:PORT,…"
    )]
    UnknownScheme,
    /// `rediss://`: TLS to Redis, which this build does not include.
    #[error(
        "rediss:// (TLS to Redis) is not supported: sluice is built without a TLS client for Redis"
    )]
    Tls,
    /// `redis+cluster://` without a node.
    #[error("redis+cluster:// names no node: expected redis+cluster://HOST:PORT,HOST:PORT,…")]
    NoClusterNodes,
    /// The scheme is known but the rest does not read (a missing host, a
    /// database that is not a number, a wildcard address, …).
    #[error("malformed Redis URL{}: {reason}", node.map(|n| format!(" (cluster node {n})")).unwrap_or_default())]
    Invalid {
        /// The cluster node, counted from 1, when the URL is a cluster's.
        node: Option<usize>,
        /// What the Redis client found wrong.
        reason: String,
    },
}

impl RedisUrl {
    /// Reads `text`.
    ///
    /// # Errors
    /// [`UrlError`] when the scheme is unknown or TLS, a cluster names no
    /// node, or the address does not read.
    pub fn parse(text: &str) -> Result<Self, UrlError> {
        let (scheme, rest) = text.split_once("://").ok_or(UrlError::UnknownScheme)?;
        let (kind, nodes) = match scheme.to_ascii_lowercase().as_str() {
            "redis" | "valkey" => (UrlKind::Server, vec![info(text, None)?]),
            "redis+unix" | "valkey+unix" | "unix" => (UrlKind::UnixSocket, vec![info(text, None)?]),
            "rediss" | "valkeys" => return Err(UrlError::Tls),
            "redis+cluster" => {
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
            _ => return Err(UrlError::UnknownScheme),
        };
        Ok(RedisUrl {
            text: text.to_owned(),
            kind,
            nodes,
        })
    }

    /// One server, one server on a Unix socket, or a cluster.
    pub fn kind(&self) -> UrlKind {
        self.kind
    }

    /// The Redis client's connection settings: one for a server, the seed
    /// nodes of a cluster.
    pub fn nodes(&self) -> &[ConnectionInfo] {
        &self.nodes
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
        if self.kind == UrlKind::UnixSocket {
            // user and password travel in the query: `?db=0&user=u&pass=p`.
            let (path, query) = rest.split_once('?').unwrap_or((rest, ""));
            f.write_str(path)?;
            let mut sep = '?';
            for pair in query.split('&').filter(|p| !p.is_empty()) {
                match pair.split_once('=') {
                    Some(("pass", _)) => write!(f, "{sep}pass=…")?,
                    _ => write!(f, "{sep}{pair}")?,
                }
                sep = '&';
            }
            return Ok(());
        }
        // Userinfo sits before the last `@` of each node's authority.
        for (i, node) in rest.split(',').enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            let end = node.find(['/', '?', '#']).unwrap_or(node.len());
            match node[..end].rfind('@') {
                Some(at) => write!(f, "…{}", &node[at..])?,
                None => f.write_str(node)?,
            }
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
        assert_eq!(kind("rediss://localhost:6379"), Err(UrlError::Tls));
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
        let debug = format!("{:?}", RedisUrl::parse("redis://:pw@h").expect("url"));
        assert_eq!(debug, "RedisUrl(redis://…@h)");
    }
}
